"""pycaffe's hooks: a net's per-layer callbacks, a solver's add_callback, and the process-level calls scripts
make around them (caffe.Timer, caffe.log, the multi-GPU settings), as BVLC's python/train.py uses them."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from google.protobuf import text_format

import caffejax
from caffejax.proto import caffe_pb2
from caffejax.runtime import mode

# An in-place BatchNorm -> Scale -> ReLU chain: run one layer at a time, each backward must read the bottom
# its forward read, not the blob the chain overwrote.
NET = '''name: "hooks"
layer { name: "x" type: "Input" top: "x" top: "label"
        input_param { shape { dim: 4 dim: 3 dim: 6 dim: 6 } shape { dim: 4 } } }
layer { name: "conv" type: "Convolution" bottom: "x" top: "conv"
        convolution_param { num_output: 5 kernel_size: 3 weight_filler { type: "gaussian" std: 0.3 }
                            bias_filler { type: "constant" value: 0.1 } } }
layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "conv" }
layer { name: "sc" type: "Scale" bottom: "conv" top: "conv"
        scale_param { bias_term: true filler { type: "constant" value: 1.5 } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
'''
RNG = np.random.default_rng(0)
X = RNG.normal(size=(4, 3, 6, 6)).astype(np.float32)
LABELS = np.array([0, 1, 2, 1], np.float32)


def _net() -> caffejax.Net:
    caffejax.set_random_seed(3)
    return caffejax.Net(NET, caffejax.TRAIN)


def _param_diffs(net) -> dict[str, list[np.ndarray]]:
    return {name: [np.array(blob.diff) for blob in blobs] for name, blobs in net.params.items()}


def test_layer_callbacks_run_around_each_layer_with_the_fused_passes_values():
    plain = _net()
    loss = plain.forward(x=X, label=LABELS)["loss"]
    plain.backward()
    hooked, calls = _net(), []
    for when in ("before_forward", "after_forward", "before_backward", "after_backward"):
        getattr(hooked, when)(lambda i, when=when: calls.append((when, i)))
    np.testing.assert_allclose(hooked.forward(x=X, label=LABELS)["loss"], loss, rtol=1e-6)
    hooked.backward()
    n = len(hooked.layers)
    forward = [(w, i) for i in range(n) for w in ("before_forward", "after_forward")]
    backward = [(w, i) for i in reversed(range(n)) for w in ("before_backward", "after_backward")]
    assert calls == forward + backward  # every layer, the Input's too, as Caffe's ForwardFromTo/BackwardFromTo
    for name, diffs in _param_diffs(plain).items():
        for want, got in zip(diffs, _param_diffs(hooked)[name]):
            # The conv bias's gradient behind a TRAIN-phase BatchNorm is exactly zero; computed, it is rounding
            # noise on either side (up to 1e-7 apart on an AMD EPYC), and the other gradients here reach 1.4,
            # so the absolute tolerance follows the size of the net's gradients.
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(hooked.blobs["x"].diff, plain.blobs["x"].diff, rtol=1e-5, atol=1e-7)


def test_layer_by_layer_backward_adds_each_sharers_part_to_the_shared_diff():
    """Blobs shared by ParamSpec name have one diff (Net::ShareWeights): run one layer at a time, the sharer's
    backward adds its part too. It added nothing (only owners were summed; found by fuzzing sequences of Net
    calls): a siamese net's shared weights got half their gradient."""
    from conftest import REFERENCE

    prototxt = str(REFERENCE / "layers" / "net_shared_params.prototxt")  # ip_a owns 'w' and 'b', ip_b shares
    plain, hooked = caffejax.Net(prototxt, caffejax.TEST), caffejax.Net(prototxt, caffejax.TEST)
    hooked.before_backward(lambda i: None)
    rng = np.random.default_rng(1)
    inputs = {"x": rng.normal(size=(4, 5)), "y": rng.normal(size=(4, 5)), "s": [1, 0, 1, 0]}
    for net in (plain, hooked):
        for i, blob in enumerate(net.params["ip_a"]):
            blob.data[...] = plain.params["ip_a"][i].data
        net.forward(**inputs)
        net.backward()
    assert hooked.params["ip_b"][0] is hooked.params["ip_a"][0]
    for want, got in zip(_param_diffs(plain)["ip_a"], _param_diffs(hooked)["ip_a"]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    only_b = caffejax.Net(prototxt, caffejax.TEST)  # a range holding the sharer and not the owner, fused
    for i, blob in enumerate(only_b.params["ip_a"]):
        blob.data[...] = plain.params["ip_a"][i].data
    only_b.forward(**inputs)
    only_b.backward(start="loss", end="ip_b")
    part = only_b.params["ip_a"][0].diff
    assert np.abs(part).max() > 0 and not np.allclose(part, plain.params["ip_a"][0].diff)


def test_a_layer_callback_sees_and_changes_the_blobs_between_layers():
    """What a callback writes into a blob is what the next layer reads, as with Caffe's blobs."""
    net = _net()
    seen = {}
    relu = list(net._layer_names).index("relu")

    def after(i):
        if i == relu:
            seen["relu"] = np.array(net.blobs["conv"].data)
            net.blobs["conv"].data[...] = 0.0

    net.after_forward(after)
    net.forward(x=X, label=LABELS)
    assert seen["relu"].min() == 0.0 and seen["relu"].max() > 0  # the ReLU's output
    np.testing.assert_allclose(net.blobs["ip"].data, np.broadcast_to(net.params["ip"][1].data, (4, 3)), atol=1e-7)


def test_layer_by_layer_backward_uses_each_layers_forward_mask():
    """Each layer run on its own draws its own key; its backward must reuse it: a Dropout's backward passes
    no gradient where its forward dropped, and all of it where it kept."""
    net = caffejax.Net(NET.replace('layer { name: "ip"', 'layer { name: "drop" type: "Dropout" bottom: "conv" '
                                                         'top: "conv" }\nlayer { name: "ip"'), caffejax.TRAIN)
    drop, seen = list(net._layer_names).index("drop"), {}
    net.before_forward(lambda i: seen.setdefault("in", np.array(net.blobs["conv"].data)) if i == drop else None)
    net.after_forward(lambda i: seen.setdefault("out", np.array(net.blobs["conv"].data)) if i == drop else None)
    net.after_backward(lambda i: seen.setdefault("diff", np.array(net.blobs["conv"].diff)) if i == drop else None)
    net.forward(x=X, label=LABELS)
    net.backward()
    dropped, kept = (seen["in"] > 0) & (seen["out"] == 0), (seen["in"] > 0) & (seen["out"] != 0)
    assert dropped.any() and kept.any()
    assert not seen["diff"][dropped].any() and seen["diff"][kept].all()


def _solver(iter_size: int) -> caffejax.SGDSolver:
    caffejax.set_random_seed(5)
    param = text_format.Parse(f'base_lr: 0.05 lr_policy: "fixed" momentum: 0.9 weight_decay: 0.01 max_iter: 100 '
                              f'iter_size: {iter_size} net_param {{ {NET} }}', caffe_pb2.SolverParameter())
    solver = caffejax.SGDSolver(param)
    solver.net.blobs["x"].data[...] = X
    solver.net.blobs["label"].data[...] = LABELS
    return solver


@pytest.mark.parametrize("iter_size", [1, 2])
def test_solver_callbacks_come_before_the_passes_and_before_the_update(iter_size):
    """Solver::Step: on_start, iter_size forward/backward passes, on_gradients_ready with the diffs summed over
    the passes, the update. The weights are those of the fused iterations."""
    fused, hooked = _solver(iter_size), _solver(iter_size)
    events = []

    def on_gradients_ready():
        events.append(("gradients", np.array(hooked.net.params["ip"][1].diff)))

    hooked.add_callback(lambda: events.append("start"), on_gradients_ready)
    fused.step(2)
    hooked.step(2)
    assert [e if isinstance(e, str) else e[0] for e in events] == ["start", "gradients"] * 2
    # The softmax loss gradient's bias part sums to 0 over classes in every pass; not yet the update.
    assert abs(events[1][1].sum()) < 1e-5 and np.abs(events[1][1]).max() > 0
    for name, blobs in fused.net.params.items():
        for want, got in zip(blobs, hooked.net.params[name]):
            np.testing.assert_allclose(got.data, want.data, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(hooked.smoothed_loss, fused.smoothed_loss, rtol=1e-5)


def test_solver_callback_objects_and_errors():
    solver, events = _solver(1), []

    class Callback:  # Caffe's Solver::Callback shape
        def on_start(self):
            events.append("start")

        def on_gradients_ready(self):
            events.append("ready")

    solver.add_callback(Callback())
    solver.step(1)
    assert events == ["start", "ready"]
    with pytest.raises(TypeError, match="on_gradients_ready must be callable"):
        solver.add_callback(lambda: None, 3)


def test_timer_is_caffes(monkeypatch):
    clock = [10.0]
    monkeypatch.setattr(mode.time, "perf_counter", lambda: clock[0])
    timer = caffejax.Timer()
    assert timer.ms == 0.0  # never run: Caffe warns and reads 0
    timer.start()
    clock[0] += 0.25
    timer.start()  # already running: no restart
    clock[0] += 0.25
    assert timer.ms == pytest.approx(500.0)  # reading stops a running timer
    clock[0] += 1.0
    assert timer.ms == pytest.approx(500.0)
    timer.start()
    clock[0] += 0.002
    timer.stop()
    timer.stop()
    assert timer.ms == pytest.approx(2.0)  # the last interval, not a sum


def test_log_and_init_log_use_caffes_log(caplog):
    logger = logging.getLogger("caffejax")
    level = logger.level
    try:
        caffejax.init_log(1)
        assert logger.level == logging.WARNING
        caffejax.init_log()
        with caplog.at_level(logging.INFO, logger="caffejax"):
            caffejax.log("iteration 7 done")
        assert [r.getMessage() for r in caplog.records if r.name == "caffejax"] == ["iteration 7 done"]
        with pytest.raises(ValueError, match="glog"):
            caffejax.init_log(4)
    finally:
        logger.setLevel(level)


# A process that configured no logging: Caffe's log shows where glog writes it, on stderr, and a script's own
# output keeps stdout to itself (``python train.py > scores.txt``).
_LOG_SCRIPT = """
import caffejax
from caffejax.proto import caffe_pb2
from google.protobuf import text_format
param = caffe_pb2.SolverParameter(base_lr=0.1, max_iter=2, display=1, lr_policy="fixed")
text_format.Merge(%r, param.net_param)
caffejax.SGDSolver(param).solve()
caffejax.init_log(0, False)
caffejax.log("asked for by the script")
print("the script's own line")
"""


def _run_log_script(cwd, glog_minloglevel: str | None = None):
    """_LOG_SCRIPT in a fresh process, with GLOG_minloglevel set to ``glog_minloglevel`` (None: unset)."""
    import os
    import subprocess
    import sys

    env = {name: value for name, value in os.environ.items() if name != "GLOG_minloglevel"}
    if glog_minloglevel is not None:
        env["GLOG_minloglevel"] = glog_minloglevel
    script = _LOG_SCRIPT % NET.replace('"x" type: "Input"', '"x" type: "DummyData"').replace(
        "input_param", "dummy_data_param")
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=cwd,
                          env=env)


def test_caffes_log_goes_to_stderr_and_leaves_stdout_to_the_script(tmp_path):
    done = _run_log_script(tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "the script's own line\n"
    for line in ("Solver scaffolding done.", "Iteration 0 (", "Optimization Done.", "] asked for by the script"):
        assert line in done.stderr


def test_glog_minloglevel_keeps_caffes_info_lines_out_until_init_log_asks_for_them(tmp_path):
    """pycaffe scripts set GLOG_minloglevel=2 before ``import caffe`` to keep Caffe's log quiet; glog reads it as
    the library loads, and caffe.init_log(0) shows INFO again."""
    done = _run_log_script(tmp_path, glog_minloglevel="2")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "the script's own line\n"
    assert "Solver scaffolding done." not in done.stderr and "Iteration 0 (" not in done.stderr, done.stderr
    assert "] asked for by the script" in done.stderr


def test_glog_level_reads_glogs_minloglevel(monkeypatch):
    from caffejax.runtime.mode import glog_level

    monkeypatch.delenv("GLOG_minloglevel", raising=False)
    assert glog_level() == logging.INFO
    for value, level in [("0", logging.INFO), ("1", logging.WARNING), (" 2 ", logging.ERROR), ("3", logging.CRITICAL),
                         ("9", logging.CRITICAL), ("-1", logging.INFO), ("two", logging.INFO), ("", logging.INFO)]:
        monkeypatch.setenv("GLOG_minloglevel", value)
        assert glog_level() == level, value


def test_multi_gpu_settings_accept_one_solver_and_refuse_more():
    assert caffejax.solver_count() == 1 and caffejax.solver_rank() == 0 and caffejax.has_nccl() is False
    caffejax.set_solver_count(1)
    caffejax.set_solver_rank(0)
    caffejax.set_multiprocess(False)
    for call in (lambda: caffejax.set_solver_count(4), lambda: caffejax.set_solver_rank(2),
                 lambda: caffejax.set_multiprocess(True), lambda: caffejax.NCCL(None, None),
                 caffejax.NCCL.new_uid):
        with pytest.raises(caffejax.UnsupportedError, match="devices=N"):
            call()
