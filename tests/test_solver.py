"""Caffe's solvers: training steps against BVLC Caffe's figures, Caffe's snapshots, test nets, lr policies."""

from __future__ import annotations

import logging
import math

import jax
import numpy as np
import pytest

import caffejax
from caffejax.frontend.prototxt import parse_net_text
from caffejax.lower import registry
from caffejax.lower.registry import LayerRule
from caffejax.proto import caffe_pb2
from caffejax.runtime.lr_policy import learning_rate
from conftest import REFERENCE, program_calls

SOLVERS = REFERENCE / "solvers"
CASES = sorted(p.name[: -len("_solver.prototxt")] for p in SOLVERS.glob("*_solver.prototxt"))
LOSS_RTOL, WEIGHT_RTOL, WEIGHT_ATOL = 1e-4, 1e-3, 1e-5


def _figures(case: str) -> dict[str, np.ndarray]:
    return dict(np.load(SOLVERS / f"{case}.npz"))


def _set_params(net, figures, prefix: str) -> None:
    for key, array in figures.items():
        if key.startswith(prefix):
            layer, index = key[len(prefix):].split("/")
            net.params[layer][int(index)].data[...] = array


def _feed_and_step(solver, figures, k: int) -> None:
    solver.net.blobs["data"].data[...] = figures[f"batch/{k}/data"]
    solver.net.blobs["label"].data[...] = figures[f"batch/{k}/label"]
    solver.step(1)


def _check_step(solver, figures, k: int, case: str) -> None:
    np.testing.assert_allclose(solver.net.blobs["loss"].data, figures[f"loss/{k}"], rtol=LOSS_RTOL,
                               err_msg=f"{case} loss/{k}")
    prefix = f"step/{k}/"
    keys = [key for key in figures if key.startswith(prefix)]
    assert keys, f"{case}: no step/{k} figures"
    for key in keys:
        layer, index = key[len(prefix):].split("/")
        # An absolute atol (README): weights that cancel to ~0 (AdaGrad's first bias step) are rounding noise.
        np.testing.assert_allclose(solver.net.params[layer][int(index)].data, figures[key], rtol=WEIGHT_RTOL,
                                   atol=WEIGHT_ATOL, err_msg=f"{case} {key}")


# ---- Caffe's figures -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_steps_and_caffe_snapshot_match_caffe(case):
    figures = _figures(case)
    solver = caffejax.get_solver(str(SOLVERS / f"{case}_solver.prototxt"))
    assert solver.type == solver.param.type  # get_solver picks the class the file names
    _set_params(solver.net, figures, "init/")
    for k in range(6):
        _feed_and_step(solver, figures, k)
        _check_step(solver, figures, k, case)
    assert solver.iter == 6

    # Caffe's own snapshot after step 3 (its learned_net names the sibling caffemodel).
    solver.restore(str(SOLVERS / f"{case}_iter_3.solverstate"))
    assert solver.iter == 3
    for k in range(3, 6):
        _feed_and_step(solver, figures, k)
        _check_step(solver, figures, k, case)
    # Every iteration, iter_size passes included, was one program, compiled once; no Net program ran.
    assert solver.compile_count == 1
    assert solver.net.compile_count == 0


# ---- our snapshots -------------------------------------------------------------------------------------------

def test_binary_solver_states_that_do_not_read_raise_solver_errors(tmp_path):
    from caffejax.errors import SolverError
    from caffejax.runtime.snapshot import read_state

    (tmp_path / "garbage.solverstate").write_bytes(b"\x0f\xff\xff not a SolverState")
    with pytest.raises(SolverError, match=r"garbage\.solverstate: not a valid binary SolverState"):
        read_state(str(tmp_path / "garbage.solverstate"))
    with pytest.raises(SolverError, match=r"missing\.solverstate: no such solver state file"):
        read_state(str(tmp_path / "missing.solverstate"))
    state = caffe_pb2.SolverState(iter=3, current_step=1, learned_net="m.caffemodel")
    state.history.add(data=[1.0, 2.0]).shape.dim.extend([2])
    (tmp_path / "good.solverstate").write_bytes(state.SerializeToString())
    data = read_state(str(tmp_path / "good.solverstate"))
    assert (data.iter, data.current_step, data.learned_net) == (3, 1, "m.caffemodel")
    np.testing.assert_array_equal(data.history[0], [1.0, 2.0])


def test_snapshot_restore_continues_identically(tmp_path):
    figures = _figures("adam_poly")
    param = caffe_pb2.SolverParameter(
        type="Adam", base_lr=0.01, momentum=0.9, lr_policy="multistep", gamma=0.5, stepvalue=[1, 3], max_iter=10,
        net=str(SOLVERS / "adam_poly_net.prototxt"), snapshot_prefix=str(tmp_path / "snap"), random_seed=3)
    solver = caffejax.get_solver(param)
    assert isinstance(solver, caffejax.AdamSolver)
    for k in range(2):
        _feed_and_step(solver, figures, k)
    at_snapshot = {name: [b.data.copy() for b in blobs] for name, blobs in solver.net.params.items()}
    states = {}
    for fmt in (caffe_pb2.SolverParameter.BINARYPROTO, caffe_pb2.SolverParameter.HDF5):
        solver.param.snapshot_format = fmt
        states[fmt] = solver.snapshot()
    for name in ("snap_iter_2.caffemodel", "snap_iter_2.solverstate", "snap_iter_2.caffemodel.h5",
                 "snap_iter_2.solverstate.h5"):
        assert (tmp_path / name).is_file(), name
    assert not list(tmp_path.glob("*.tmp"))  # written atomically

    state = caffe_pb2.SolverState.FromString((tmp_path / "snap_iter_2.solverstate").read_bytes())
    assert (state.iter, state.current_step) == (2, 1)
    assert state.learned_net == str(tmp_path / "snap_iter_2.caffemodel")
    assert len(state.history) == 2 * 4  # Adam: m for every learnable blob, then v for every one
    assert tuple(state.history[4].shape.dim) == solver.net.params["conv1"][0].data.shape

    expected = []
    for k in range(2, 4):
        _feed_and_step(solver, figures, k)
        expected.append({name: [b.data.copy() for b in blobs] for name, blobs in solver.net.params.items()})
    for fmt, path in states.items():
        solver.restore(path)
        assert (solver.iter, solver.current_step) == (2, 1)
        for k, weights in zip(range(2, 4), expected):
            _feed_and_step(solver, figures, k)
            for name, blobs in weights.items():
                for i, array in enumerate(blobs):
                    np.testing.assert_allclose(solver.net.params[name][i].data, array, rtol=1e-6, atol=1e-8,
                                               err_msg=f"format {fmt}: {name}/{i} after step {k}")
    assert solver.compile_count == 1

    # The solver's `weights` field (LoadNetWeights) starts a new solver from the snapshot's caffemodel.
    param.weights.append(str(tmp_path / "snap_iter_2.caffemodel"))
    fresh = caffejax.get_solver(param)
    for name, blobs in at_snapshot.items():
        for i, array in enumerate(blobs):
            np.testing.assert_array_equal(fresh.net.params[name][i].data, array)


# ---- data layers, iter_size and apply_update ---------------------------------------------------------------

class _Batches:
    """A DataSource handing out fixed (data, target) batches in order."""

    def __init__(self, layer, phase, base_dir):
        rng = np.random.default_rng(5)
        self.batches = [(rng.standard_normal((4, 3)).astype(np.float32),
                         rng.standard_normal((4, 2)).astype(np.float32)) for _ in range(3)]
        self.pulled = 0

    def next_batch(self):
        batch = self.batches[self.pulled % len(self.batches)]
        self.pulled += 1
        return batch

    def close(self):
        pass


SOURCE_TYPE = "CaffejaxTestBatches"


@pytest.fixture
def batches_layer(monkeypatch):
    """A data layer type reading from _Batches, registered for one test only."""
    registry.registered_types()  # load the real families first
    rule = LayerRule(SOURCE_TYPE, forward=lambda ctx, bottoms, params: [], data_source=_Batches,
                     input_shapes=lambda layer, phase, base_dir: [(4, 3), (4, 2)], bottoms=(0, 0), tops=(2, 2))
    monkeypatch.setitem(registry._REGISTRY, SOURCE_TYPE, rule)

REGRESSION_NET = f"""
name: "regression"
layer {{ name: "data" type: "{SOURCE_TYPE}" top: "data" top: "target" }}
layer {{ name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param {{ num_output: 2 weight_filler {{ type: "gaussian" std: 0.5 }} }} }}
layer {{ name: "loss" type: "EuclideanLoss" bottom: "ip" bottom: "target" top: "loss" }}
"""


def _euclidean_grads(w, b, x, y):
    diff = x @ w.T + b - y
    n = x.shape[0]
    return diff.T @ x / n, diff.sum(0) / n, float((diff ** 2).sum() / (2 * n))


def test_iter_size_pulls_one_batch_per_pass_and_apply_update(batches_layer):
    param = caffe_pb2.SolverParameter(type="SGD", base_lr=0.1, lr_policy="fixed", iter_size=2, max_iter=5)
    param.net_param.CopyFrom(parse_net_text(REGRESSION_NET))
    solver = caffejax.SGDSolver(param)
    w0, b0 = (solver.net.params["ip"][i].data.copy() for i in range(2))
    batches = _Batches(None, None, None).batches

    solver.step(1)
    grads = [_euclidean_grads(w0, b0, x, y) for x, y in batches[:2]]
    update_w = np.float32(0.1) * (grads[0][0] + grads[1][0]) / 2
    update_b = np.float32(0.1) * (grads[0][1] + grads[1][1]) / 2
    np.testing.assert_allclose(solver.net.params["ip"][0].data, w0 - update_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(solver.net.params["ip"][1].data, b0 - update_b, rtol=1e-5, atol=1e-6)
    # As Caffe leaves them: diff holds the update, the blobs hold the last pass (second batch).
    np.testing.assert_allclose(solver.net.params["ip"][0].diff, update_w, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(solver.net.blobs["data"].data, batches[1][0])
    assert math.isclose(float(solver.net.blobs["loss"].data), grads[1][2], rel_tol=1e-5)

    # pycaffe's manual loop: clear, forward (pulls batch 3), backward, apply_update (Normalize by iter_size).
    w1, b1 = (solver.net.params["ip"][i].data.copy() for i in range(2))
    solver.net.clear_param_diffs()
    solver.net.forward()
    solver.net.backward()
    solver.apply_update()
    gw, gb, _ = _euclidean_grads(w1, b1, *batches[2])
    np.testing.assert_allclose(solver.net.params["ip"][0].data, w1 - np.float32(0.1) * gw / 2, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(solver.net.params["ip"][1].data, b1 - np.float32(0.1) * gb / 2, rtol=1e-5, atol=1e-6)
    assert solver.iter == 1  # ApplyUpdate alone does not count an iteration


# ---- test nets -------------------------------------------------------------------------------------------------

CLASSIFIER_NET = """
name: "classifier"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 4 dim: 3 } } }
layer { name: "label" type: "Input" top: "label" input_param { shape { dim: 4 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
layer { name: "accuracy" type: "Accuracy" bottom: "ip" bottom: "label" top: "accuracy"
  include { phase: TEST stage: "val" } }
"""


def _softmax_scores(w, b, x, label):
    logits = x @ w.T + b
    logits = logits - logits.max(1, keepdims=True)
    log_prob = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    loss = -log_prob[np.arange(len(label)), label.astype(int)].mean()
    return float((logits.argmax(1) == label).mean()), float(loss)


def test_test_nets_score_shared_weights_like_caffe(caplog):
    param = caffe_pb2.SolverParameter(type="Nesterov", base_lr=0.1, momentum=0.9, lr_policy="fixed", display=1,
                                      test_iter=[3], test_interval=2, test_compute_loss=True, max_iter=10)
    param.net_param.CopyFrom(parse_net_text(CLASSIFIER_NET))
    param.test_state.add(stage=["val"])  # merged over TEST: only then is the accuracy layer in
    solver = caffejax.get_solver(param)
    assert solver.net.outputs == ["loss"] and solver.test_nets[0].outputs == ["accuracy", "loss"]

    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal((4, 3)).astype(np.float32), rng.integers(0, 3, 4).astype(np.float32))
               for _ in range(3)]
    solver.net.blobs["data"].data[...], solver.net.blobs["label"].data[...] = batches[0]
    test_net = solver.test_nets[0]
    forward, calls = test_net.forward, []

    def forward_next_batch(*args, **kwargs):  # a data layer would hand out the next batch on every forward
        test_net.blobs["data"].data[...], test_net.blobs["label"].data[...] = batches[len(calls) % 3]
        calls.append(1)
        return forward(*args, **kwargs)

    test_net.forward = forward_next_batch
    caplog.set_level(logging.INFO, logger="caffejax")
    solver.step(3)
    assert sum("Testing net (#0)" in r.getMessage() for r in caplog.records) == 2  # at iter 0 and 2
    assert len(calls) == 2 * 3

    caplog.clear()
    means = solver.test(0)
    w, b = (solver.net.params["ip"][i].data for i in range(2))
    expected = np.mean([_softmax_scores(w, b, x, y) for x, y in batches], axis=0)
    np.testing.assert_allclose(means, expected, rtol=1e-5)
    np.testing.assert_array_equal(test_net.params["ip"][0].data, w)  # shares the train net's weights
    lines = [r.getMessage() for r in caplog.records]
    assert f"    Test net output #0: accuracy = {means[0]:g}" in lines
    assert f"    Test net output #1: loss = {means[1]:g} (* 1 = {means[1]:g} loss)" in lines
    assert f"Test loss: {means[1]:g}" in lines


def test_training_log_lines(caplog, batches_layer):
    param = caffe_pb2.SolverParameter(type="SGD", base_lr=0.05, lr_policy="step", gamma=0.5, stepsize=1,
                                      display=2, average_loss=2, max_iter=4)
    param.net_param.CopyFrom(parse_net_text(REGRESSION_NET))
    solver = caffejax.get_solver(param)
    caplog.set_level(logging.INFO, logger="caffejax")
    solver.step(3)
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("Iteration 0 (") and "iter/s" in line and "s/2 iters), loss = " in line
               for line in lines)
    assert any(line.startswith("    Train net output #0: loss = ") and line.endswith(" loss)") for line in lines)
    assert "Iteration 0, lr = 0.05" in lines and "Iteration 2, lr = 0.0125" in lines
    assert not any(line.startswith("Iteration 1") for line in lines)


def test_the_displayed_loss_is_smoothed_with_caffes_running_update(caplog, batches_layer):
    """Solver::UpdateSmoothedLoss in float: a running mean, then smoothed += (new - oldest) / average_loss.
    After losses 1e8, 1, 1 (average_loss 2) Caffe shows 0, not the mean of the last two (1): 1e8 + 1 is 1e8
    in float, and the update then takes 1e8 / 2 back off 5e7."""
    param = caffe_pb2.SolverParameter(type="SGD", base_lr=0.05, lr_policy="fixed", display=1, average_loss=2,
                                      max_iter=4)
    param.net_param.CopyFrom(parse_net_text(REGRESSION_NET))
    solver = caffejax.get_solver(param)
    losses = iter([1e8, 1.0, 1.0, 7.0])
    solver._train_iteration = lambda rate: (np.float32(next(losses)), None)
    caplog.set_level(logging.INFO, logger="caffejax")
    solver.step(3)
    shown = [r.getMessage().rsplit("loss = ", 1)[1] for r in caplog.records
             if r.getMessage().startswith("Iteration ") and "iter/s" in r.getMessage()]
    assert shown == ["1e+08", "5e+07", "0"]
    assert solver.smoothed_loss == 0.0
    solver.step(1)  # a new step() starts a new window
    assert solver.smoothed_loss == 7.0


# ---- learning-rate policies --------------------------------------------------------------------------------

def _solver_param(**fields) -> caffe_pb2.SolverParameter:
    return caffe_pb2.SolverParameter(base_lr=0.1, **fields)


@pytest.mark.parametrize("fields, formula", [
    (dict(lr_policy="fixed"), lambda it: 0.1),
    (dict(lr_policy="step", gamma=0.5, stepsize=3), lambda it: 0.1 * 0.5 ** (it // 3)),
    (dict(lr_policy="exp", gamma=0.9), lambda it: 0.1 * 0.9 ** it),
    (dict(lr_policy="inv", gamma=0.1, power=0.75), lambda it: 0.1 * (1 + 0.1 * it) ** -0.75),
    (dict(lr_policy="poly", power=1.5, max_iter=10), lambda it: 0.1 * (1 - it / 10) ** 1.5),
    (dict(lr_policy="sigmoid", gamma=0.5, stepsize=3), lambda it: 0.1 / (1 + math.exp(-0.5 * (it - 3)))),
])
def test_lr_policies_follow_caffes_formulas(fields, formula):
    param = _solver_param(**fields)
    for it in (0, 1, 2, 3, 7, 10):
        rate, _ = learning_rate(param, it, 0)
        assert math.isclose(rate, formula(it), rel_tol=1e-6), (fields, it)
    # step keeps current_step = iter // stepsize (saved in the solverstate)
    if fields["lr_policy"] == "step":
        assert learning_rate(param, 7, 0)[1] == 2


def test_multistep_advances_at_most_once_per_call():
    param = _solver_param(lr_policy="multistep", gamma=0.1, stepvalue=[2, 3, 10])
    assert learning_rate(param, 1, 0) == (pytest.approx(0.1), 0)
    # Jumping past two stepvalues (e.g. after restoring at iter 5 with current_step 0): one step per call.
    rate, step = learning_rate(param, 5, 0)
    assert step == 1 and math.isclose(rate, 0.01, rel_tol=1e-6)
    rate, step = learning_rate(param, 6, step)
    assert step == 2 and math.isclose(rate, 0.001, rel_tol=1e-6)
    assert learning_rate(param, 7, step)[1] == 2  # 7 < 10


# ---- refusals -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, message", [
    (dict(type="Adagrad"), "Unknown solver type"),
    (dict(type="AdaGrad", lr_policy="fixed", momentum=0.9), "Momentum cannot be used with AdaGrad"),
    (dict(type="RMSProp", lr_policy="fixed", momentum=0.9), "Momentum cannot be used with RMSProp"),
    (dict(type="SGD", lr_policy="cosine"), "Unknown learning rate policy"),
    (dict(type="SGD", lr_policy="fixed", regularization_type="L3"), "Unknown regularization type"),
    (dict(type="SGD", lr_policy="fixed"), "exactly one train net"),
])
def test_bad_solvers_are_refused_clearly(fields, message):
    with pytest.raises(caffejax.SolverError, match=message):
        caffejax.get_solver(caffe_pb2.SolverParameter(**fields))


def test_solver_log_names_the_net_file_as_caffe_does(tmp_path, caplog):
    (tmp_path / "net.prototxt").write_text(CLASSIFIER_NET)
    (tmp_path / "solver.prototxt").write_text('net: "net.prototxt"\nbase_lr: 0.1\nlr_policy: "fixed"\n'
                                              'test_iter: 1\ntest_interval: 10\nmax_iter: 1\n')
    caplog.set_level(logging.INFO, logger="caffejax")
    caffejax.get_solver(str(tmp_path / "solver.prototxt"))
    messages = [r.getMessage() for r in caplog.records]
    assert "Creating training net from net file: net.prototxt" in messages
    assert "Creating test net (#0) specified by net file: net.prototxt" in messages


DROPOUT_NET = """
layer { name: "in" type: "Input" top: "x" top: "label"
        input_param { shape { dim: 4 dim: 3 dim: 6 dim: 6 } shape { dim: 4 } } }
layer { name: "conv" type: "Convolution" bottom: "x" top: "conv"
        convolution_param { num_output: 5 kernel_size: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "drop" type: "Dropout" bottom: "conv" top: "drop" dropout_param { dropout_ratio: 0.5 } }
layer { name: "ip" type: "InnerProduct" bottom: "drop" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def test_a_pass_folds_its_key_in_its_program_and_only_a_rerun_makes_it_apart(monkeypatch):
    """Net.forward and Solver.step fold the pass count into the seed's key inside their programs (XLA drops the
    fold where no layer draws random numbers), not by a call of their own on every pass (LeNet's Net.forward at
    batch 1: 46 us of 335). Only running the layers again makes the key apart: a deferred blob's recompute,
    which draws the forward's Dropout mask."""
    made = []
    fold_key = caffejax.runtime.net.fold_key
    monkeypatch.setattr(caffejax.runtime.net, "fold_key", lambda key, n: made.append(int(n)) or fold_key(key, n))
    caffejax.set_random_seed(3)
    net = caffejax.Net(parse_net_text(DROPOUT_NET), caffejax.TRAIN)
    net.blobs["x"].data[...] = np.random.default_rng(0).normal(size=(4, 3, 6, 6))
    labels = np.array([0, 1, 2, 1])
    net.blobs["label"].data[...] = labels
    loss = net.forward()["loss"]
    assert made == []
    ip = net.blobs["ip"].data  # recomputed with the key made now
    assert made == [net._pass_count]
    logp = ip - ip.max(axis=1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(loss, -logp[np.arange(4), labels].mean(), rtol=1e-5)
    assert 0 < np.count_nonzero(net.blobs["drop"].data) < np.count_nonzero(net.blobs["conv"].data)

    solver = _dropout_net_solver("SGD")
    made.clear()
    solver.step(2)
    assert made == []
    solver.net.blobs["drop"].data
    assert made == [solver.net._pass_count, 0]  # the step's key, then its pass's


def _lazy_and_every_blob_solvers(seed: int):
    """Two SGD solvers of DROPOUT_NET with the same weights and fed blobs: the first's steps hand back what they
    choose (the outputs, the blobs read after every step), the second's every blob."""
    param = caffe_pb2.SolverParameter(type="SGD", base_lr=0.5, lr_policy="fixed", max_iter=9, random_seed=3)
    param.net_param.CopyFrom(parse_net_text(DROPOUT_NET))
    lazy, every = caffejax.SGDSolver(param), caffejax.SGDSolver(param)
    every._returned_blobs = lambda learnt=frozenset(): None
    x = np.random.default_rng(seed).normal(size=(4, 3, 6, 6))
    for one in (lazy, every):
        one.net.blobs["x"].data[...] = x
        one.net.blobs["label"].data[...] = [0, 1, 2, 1]
    for name in ("conv", "ip"):
        for i, blob in enumerate(lazy.net.params[name]):
            every.net.params[name][i].data[...] = blob.data
    return lazy, every


def test_blobs_after_a_step_hold_its_forward():
    """An iteration's program hands back only the net's outputs (written out, every blob made MobileNet v2's
    iteration 2x slower); the other blobs, read after the step, are recomputed from the weights before the update
    with the pass's key: the values, Dropout's mask included, of a step that hands back every blob."""
    lazy, every = _lazy_and_every_blob_solvers(seed=0)
    assert lazy._returned_blobs() == {"loss"}
    for _ in range(2):
        lazy.step(1)
        every.step(1)
        for name in ("conv", "drop", "ip", "loss"):
            np.testing.assert_allclose(lazy.net.blobs[name].data, every.net.blobs[name].data, rtol=1e-5, atol=1e-6,
                                       err_msg=name)
        assert 0 < np.mean(lazy.net.blobs["drop"].data == 0) < 1  # Dropout did drop some, not all
        for name in ("conv", "ip"):
            np.testing.assert_allclose(lazy.net.params[name][0].data, every.net.params[name][0].data, rtol=1e-5,
                                       atol=1e-6)


def test_blobs_read_after_every_step_are_handed_back_by_the_step(monkeypatch):
    """A training loop reading a blob after each solver.step (an activation watched as the net trains) gets it from
    the step itself from the third iteration on, where it was recomputed by a forward of its own after each step:
    the same values, Dropout's mask included, as a step handing back every blob."""
    recomputes = program_calls(monkeypatch, "forward-all")
    lazy, every = _lazy_and_every_blob_solvers(seed=1)
    for step in range(5):
        lazy.step(1)
        every.step(1)
        for name in ("drop", "ip"):
            np.testing.assert_allclose(lazy.net.blobs[name].data, every.net.blobs[name].data, rtol=1e-5, atol=1e-6,
                                       err_msg=f"{name} after step {step + 1}")
    assert len(recomputes) == 2  # after the first two steps
    compiles = lazy.compile_count
    lazy.step(2)  # not read: the step that hands them back, then the plain one, both compiled already
    assert lazy.compile_count == compiles and len(recomputes) == 2


def test_a_backward_after_a_step_takes_the_steps_dropout_mask():
    """pycaffe's solver.step(1) then net.backward(), and debug_nans' replay (find_first_nan), run the layers again
    with the key of the step's pass, as the blobs deferred after the step are: the Dropout's bottom gets diffs
    where, and only where, the step's mask kept units. (They took the net's last Net.forward's key, or a new one.)"""
    param = caffe_pb2.SolverParameter(type="SGD", base_lr=0.0, lr_policy="fixed", max_iter=5, random_seed=3)
    param.net_param.CopyFrom(parse_net_text(DROPOUT_NET))
    solver = caffejax.SGDSolver(param)
    net = solver.net
    net.blobs["x"].data[...] = np.random.default_rng(0).normal(size=(4, 3, 6, 6))
    net.blobs["label"].data[...] = [0, 1, 2, 1]
    for _ in range(2):
        solver.step(1)
        net.backward()
        alive = net.blobs["conv"].data > 0  # (ReLU in place: its backward zeroes the rest)
        dropped = net.blobs["drop"].data[alive] == 0
        assert 0 < np.mean(dropped) < 1
        np.testing.assert_array_equal(net.blobs["conv"].diff[alive] == 0, dropped)
        key = net._key_of_forward(3, 3)  # the Dropout's, as find_first_nan replays it
        replayed = net._program.run_layers([net.graph.layer("drop")], net.param_arrays(),
                                           {net.graph.blob_value["conv"]: net.blobs["conv"].data}, key)[0]
        np.testing.assert_array_equal(replayed[net.graph.blob_value["drop"]], net.blobs["drop"].data)


def test_a_step_folds_its_keys_in_compiled_calls(monkeypatch):
    """Solver.step's host work folds no key eagerly: an eager jax.random.fold_in costs about 200 us on 2 cores
    (LeNet's Solver.step at batch 16 runs in about 4 ms). That the key it notes is the one its program folds,
    test_a_backward_after_a_step_takes_the_steps_dropout_mask checks."""
    solver = _dropout_net_solver("SGD")
    solver.step(1)  # compiled: its trace folds keys inside the program
    eager = []
    fold_in = jax.random.fold_in
    monkeypatch.setattr(jax.random, "fold_in", lambda *args: eager.append(args) or fold_in(*args))
    solver.step(1)
    assert eager == []


@pytest.mark.parametrize("clip", [None, 0.5])
def test_the_gradient_norm_is_computed_only_to_clip(clip):
    """Only gradient clipping reads the diffs' L2 norm: without it the update does not sum their squares (a fifth
    of LeNet's iteration at batch 1)."""
    param = caffe_pb2.SolverParameter(type="SGD", base_lr=0.5, lr_policy="fixed", max_iter=5)
    if clip is not None:
        param.clip_gradients = clip
    param.net_param.CopyFrom(parse_net_text(DROPOUT_NET))
    solver = caffejax.SGDSolver(param)
    params = solver.net.param_arrays()
    diffs = [3 * np.ones(solver.net.params[l.layer][l.index].shape, np.float32) for l in solver._learnables]
    scalars = solver.step_scalars(0.5)
    jaxpr = str(jax.make_jaxpr(solver._apply_update)(params, diffs, solver._history, scalars))
    norm = solver._apply_update(params, diffs, solver._history, scalars)[3]
    if clip is None:
        assert "sqrt" not in jaxpr
        assert float(norm) == 0
    else:
        assert "sqrt" in jaxpr
        np.testing.assert_allclose(float(norm), 3 * np.sqrt(sum(d.size for d in diffs)), rtol=1e-6)


def _dropout_net_solver(kind: str):
    """A solver of ``kind`` (momentum 0.9) over DROPOUT_NET, its inputs written."""
    param = caffe_pb2.SolverParameter(type=kind, base_lr=0.5, momentum=0.9, lr_policy="fixed", max_iter=5,
                                      random_seed=3)
    param.net_param.CopyFrom(parse_net_text(DROPOUT_NET))
    solver = caffejax.get_solver(param)
    solver.net.blobs["x"].data[...] = np.random.default_rng(0).normal(size=(4, 3, 6, 6))
    solver.net.blobs["label"].data[...] = [0, 1, 2, 1]
    return solver


def _record_iterations(solver, what) -> list:
    """A list that gets ``what(arguments, outputs)`` of every call of the solver's iteration program."""
    recorded, program = [], solver._step_program

    def recording(*learnt):
        step = program(*learnt)

        def record(*args):
            outputs = step(*args)
            recorded.append(what(args, outputs))
            return outputs

        return record

    solver._step_program = recording
    return recorded


def test_a_step_writes_the_new_history_over_the_old():
    """The momentum history is the solver's alone, so the iteration's program is given its buffers to write the
    next history into (AlexNet's iteration at batch 1: 3.3 -> 2.8 GB peak RSS)."""
    solver = _dropout_net_solver("SGD")
    solver.step(1)
    old = [h for history in solver._history for h in history]
    solver.step(1)
    assert all(h.is_deleted() for h in old)
    # SGD's update is its new history (Caffe copies history_ into the diff), and both survived the handover.
    for learnable, (history,) in zip(solver._learnables, solver._history):
        np.testing.assert_array_equal(solver.net.params[learnable.layer][learnable.index].diff, np.asarray(history))


@pytest.mark.parametrize("kind", ["SGD", "Adam"])
def test_a_step_writes_the_new_weights_into_the_buffers_of_the_weights_before_the_last(kind):
    """Iteration k's new weights go into the buffers that held the weights iteration k-1 started from, given up
    to the program (no fresh buffers to page in: AlexNet's Solver.step at batch 16 took 60 thousand page faults,
    420-470 -> 386-398 ms). The weights iteration k started from stay: the blobs it deferred need them."""
    import warnings

    solver = _dropout_net_solver(kind)
    ids = lambda arrays: [id(a) for a in arrays]  # noqa: E731 (holding the arrays would keep them from being given)
    calls = _record_iterations(solver, lambda args, outputs: (
        ids(args[0][l.layer][l.index] for l in solver._learnables), ids(args[-1])))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # JAX warns of donated buffers that no output took
        solver.step(4)
    for (started, _), (_, spare) in zip(calls, calls[1:]):
        assert spare == started
    assert not any(w.is_deleted() for w in jax.tree.leaves(solver._spare))
    assert solver.net.blobs["conv"].data.shape == (4, 5, 4, 4)  # computed from them


def test_weights_someone_holds_are_not_given_up():
    """Weights the user kept (here through param_arrays) are never handed to an iteration: it takes new buffers
    for those, and the kept arrays stay readable with their values."""
    solver = _dropout_net_solver("SGD")
    solver.step(1)
    kept = solver.net.param_arrays()
    values = jax.tree.map(np.array, kept)
    solver.step(3)
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(values)):
        assert not a.is_deleted()
        np.testing.assert_array_equal(np.asarray(a), b)


def test_a_failed_iteration_forgets_the_blobs_deferred_from_the_weights_it_gave_up():
    """If the iteration's program raises after taking the spare weights, the blobs the last iteration deferred
    (which would be computed from those) are dropped, not left to fail on a deleted array when read."""
    solver = _dropout_net_solver("SGD")
    solver.step(2)
    assert solver.net.blobs["conv"]._data._pending is not None
    program = solver._step_program

    def failing(*learnt):
        step = program(*learnt)

        def run(*args):
            for spare in args[-1]:  # (the last argument: _into_spare)
                spare.delete()  # as giving them up does
            raise RuntimeError("the program failed")

        return run

    solver._step_program = failing
    with pytest.raises(RuntimeError, match="the program failed"):
        solver.step(1)
    assert solver.net.blobs["conv"]._data._pending is None
    assert solver.net.blobs["conv"].data.shape == (4, 5, 4, 4)


@pytest.mark.parametrize("kind", ["SGD", "Nesterov"])
def test_an_update_that_is_the_new_history_comes_back_once(kind):
    """SGD's update is its new history: the iteration hands it back once (a second output of the same value is a
    copy into fresh memory, AlexNet's 244 MB an iteration) and the diffs get the history. Nesterov's update is
    another value, returned as itself."""
    solver = _dropout_net_solver(kind)
    returned = _record_iterations(solver, lambda args, outputs: outputs[3])
    solver.step(2)
    for updates in returned:
        assert all((update is None) == (kind == "SGD") for update in updates)
    for learnable, (history,) in zip(solver._learnables, solver._history):
        diff = solver.net.params[learnable.layer][learnable.index].diff
        assert np.array_equal(diff, np.asarray(history)) == (kind == "SGD")


def test_an_iteration_runs_on_device_arrays_and_leaves_the_weights_there():
    """The iteration's program gets device arrays only: given a NumPy argument it waits for the transfer and runs
    on an XLA worker thread, whose malloc arena maps its big buffers afresh every time (MobileNet v2 at batch 16:
    300 thousand page faults and 1.5x the time per step). Weights once written through ``.data`` go back to the
    device after a step unless the host array is still held, and a held one still sees every update."""
    solver = _dropout_net_solver("SGD")
    solver.net.params["ip"][1].data[...] = 0.25  # surgery through the host array, which is then dropped
    held = solver.net.params["conv"][0].data
    seen = _record_iterations(solver, lambda args, outputs: [type(leaf) for leaf in jax.tree.leaves(args)
                                                              if not isinstance(leaf, jax.Array)])
    solver.step(2)
    assert seen == [[], []]
    assert not solver.net.params["ip"][1]._data.on_host()
    np.testing.assert_array_equal(held, np.asarray(solver.net.param_arrays()["conv"][0]))
    assert not np.allclose(solver.net.params["ip"][1].data, 0.25)
