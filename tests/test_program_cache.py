"""caffejax's program cache: compiled inference programs kept on disk and loaded without tracing."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import caffejax
from caffejax.runtime import program_cache
from conftest import BUNDLED

LENET = BUNDLED / "lenet/lenet.prototxt"
WEIGHTS = BUNDLED / "lenet/lenet_iter_10000.caffemodel"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(program_cache.ENVIRONMENT, str(tmp_path / "programs"))
    return tmp_path / "programs"


def _events(caplog) -> list[str]:
    return [r.getMessage().split()[-1] for r in caplog.records if r.name == program_cache.__name__]


def _digits(batch: int) -> np.ndarray:
    return np.random.default_rng(batch).random((batch, 1, 28, 28), dtype=np.float32)


@pytest.mark.parametrize("held", [False, True], ids=["weights as arguments", "weights held"])
def test_a_new_function_loads_the_program_and_reads_its_own_weights(cache, caplog, monkeypatch, held):
    """Weights over inference.CONSTANT_WEIGHTS_MAX_BYTES are arguments of the program: other weights, the same
    program, their output. Smaller ones are constants in it, and its key: other weights, another program."""
    from caffejax.runtime import inference

    monkeypatch.setattr(inference, "CONSTANT_WEIGHTS_MAX_BYTES", inference.CONSTANT_WEIGHTS_MAX_BYTES if held else -1)
    caplog.set_level(logging.DEBUG, logger=program_cache.__name__)
    net = caffejax.Net(str(LENET), str(WEIGHTS), caffejax.TEST)
    x = _digits(3)
    first = caffejax.compile_inference(net)({"data": x})["prob"]
    assert _events(caplog) == ["compiled"] and len(list(cache.glob("*.program"))) == 1
    again = caffejax.compile_inference(net)({"data": x})["prob"]
    assert _events(caplog) == ["compiled", "cache"]  # "... loaded from the cache"
    np.testing.assert_array_equal(np.asarray(again), np.asarray(first))
    net.params["ip2"][1].data[...] += 5.0 * np.arange(10, dtype=np.float32)
    edited = caffejax.compile_inference(net)({"data": x})["prob"]
    assert _events(caplog) == ["compiled", "cache", "compiled" if held else "cache"]
    assert len(list(cache.glob("*.program"))) == (2 if held else 1)
    np.testing.assert_allclose(np.asarray(edited), np.asarray(caffejax.compile_inference(
        net, passes=())({"data": x})["prob"]), rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(edited), np.asarray(first))


def test_a_program_is_read_back_with_the_garbage_collector_paused(cache, monkeypatch):
    import gc

    from jax.experimental import serialize_executable

    seen = []
    load = serialize_executable.deserialize_and_load

    def spy(*args, **kwargs):
        seen.append(gc.isenabled())
        return load(*args, **kwargs)

    monkeypatch.setattr(serialize_executable, "deserialize_and_load", spy)
    x = _digits(64)  # the prototxt's batch
    first = caffejax.Net(str(LENET), str(WEIGHTS), caffejax.TEST).forward(data=x)["prob"].copy()
    again = caffejax.Net(str(LENET), str(WEIGHTS), caffejax.TEST).forward(data=x)["prob"]  # Net's own programs
    np.testing.assert_array_equal(again, first)
    assert seen == [False, False] and gc.isenabled()  # its weights' preparation, the pass


def test_other_shapes_passes_and_dtypes_are_other_programs(cache):
    import jax.numpy as jnp

    net = caffejax.Net(str(LENET), str(WEIGHTS), caffejax.TEST)
    caffejax.compile_inference(net)({"data": _digits(2)})
    caffejax.compile_inference(net)({"data": _digits(5)})
    caffejax.compile_inference(net, passes=("nhwc",))({"data": _digits(2)})
    caffejax.compile_inference(net, dtype=jnp.bfloat16)({"data": _digits(2)})
    assert len(list(cache.glob("*.program"))) == 4


def test_a_damaged_program_is_compiled_again_and_replaced(cache, caplog):
    net = caffejax.Net(str(LENET), str(WEIGHTS), caffejax.TEST)
    x = _digits(2)
    expected = np.asarray(caffejax.compile_inference(net)({"data": x})["prob"])
    (path,) = cache.glob("*.program")
    path.write_bytes(path.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger=program_cache.__name__):
        got = caffejax.compile_inference(net)({"data": x})["prob"]
    assert "does not load" in caplog.text
    np.testing.assert_array_equal(np.asarray(got), expected)
    assert path.stat().st_size > 1000 and not list(cache.glob("*.tmp"))


def test_off_by_environment_and_without_jax_cache(monkeypatch, tmp_path):
    import jax

    monkeypatch.setenv(program_cache.ENVIRONMENT, "0")
    assert program_cache.cache_directory() is None
    monkeypatch.delenv(program_cache.ENVIRONMENT)
    before = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        assert program_cache.cache_directory() is None
        jax.config.update("jax_compilation_cache_dir", str(tmp_path))
        assert program_cache.cache_directory() == tmp_path / program_cache.SUBDIRECTORY
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_the_key_follows_the_source_and_the_description():
    import jax

    args = (np.zeros((2, 3), np.float32),)
    key = program_cache.program_key(["a"], args, {})
    assert key == program_cache.program_key(["a"], args, {})
    assert key != program_cache.program_key(["b"], args, {})
    assert key != program_cache.program_key(["a"], (np.zeros((2, 4), np.float32),), {})
    assert key != program_cache.program_key(["a"], args, {"xla_cpu_experimental_ynn_fusion_type": "x"})
    assert len(program_cache.source_digest()) == 64


def test_net_forward_loads_its_programs_without_tracing(cache, caplog):
    """A new Net of the same model runs Net.forward's program, and the one that fills an intermediate blob when
    it is read, from the cache: nothing is traced (compile_count stays 0), and the values are the first net's."""
    caplog.set_level(logging.DEBUG, logger=program_cache.__name__)
    x = _digits(2)
    first = caffejax.Net(str(LENET), str(WEIGHTS), caffejax.TEST)
    first.blobs["data"].reshape(*x.shape)
    prob = first.forward(data=x)["prob"].copy()
    conv1 = first.blobs["conv1"].data.copy()  # deferred: the program that keeps every blob runs now
    assert _events(caplog) == ["compiled"] * 3 and first.compile_count == 3  # and the weights' preparation
    again = caffejax.Net(str(LENET), str(WEIGHTS), caffejax.TEST)
    again.blobs["data"].reshape(*x.shape)
    np.testing.assert_array_equal(again.forward(data=x)["prob"], prob)
    np.testing.assert_array_equal(again.blobs["conv1"].data, conv1)
    assert _events(caplog) == ["compiled"] * 3 + ["cache"] * 3 and again.compile_count == 0
    # The weights are the program's arguments: net surgery shows on the next pass of the loaded program.
    again.params["ip2"][1].data[...] += 3.0 * np.arange(10, dtype=np.float32)
    assert not np.allclose(again.forward(data=x)["prob"], prob)


def _lenet_for_backward(force_backward: bool):
    from caffejax.frontend.prototxt import parse_net_text

    param = parse_net_text(str(LENET))
    param.force_backward = force_backward
    net = caffejax.Net(param, str(WEIGHTS), caffejax.TEST)
    net.blobs["data"].reshape(2, 1, 28, 28)
    return net


def test_net_backward_loads_its_program_without_tracing(cache, caplog):
    """A new Net of the same model runs Net.backward's program from the cache (GoogLeNet at batch 1: 2.4 s of
    tracing and lowering a new process, 0.7 s loaded): nothing is traced, the diffs are the first net's, and
    the parameter diffs still add up over passes as Caffe's do. Which diffs a pass computes is part of the key:
    the same layers without force_backward are another program."""
    caplog.set_level(logging.DEBUG, logger=program_cache.__name__)
    x, seed = _digits(2), np.random.default_rng(7).random((2, 10), dtype=np.float32)

    def forward_backward_twice(net):
        net.forward(data=x)
        net.blobs["prob"].diff[...] = seed
        net.backward()
        once = net.params["ip1"][0].diff.copy()
        net.forward(data=x)
        net.backward()
        return net.blobs["data"].diff.copy(), once, net.params["ip1"][0].diff.copy()

    first = _lenet_for_backward(True)
    data_diff, once, twice = forward_backward_twice(first)
    assert _events(caplog) == ["compiled"] * 3 and first.compile_count == 3  # forward, its weights', backward
    assert np.abs(data_diff).max() > 0 and np.abs(once).max() > 0
    np.testing.assert_allclose(twice, 2 * once, rtol=1e-6, atol=1e-12)
    again = _lenet_for_backward(True)
    for got, expected in zip(forward_backward_twice(again), (data_diff, once, twice)):
        np.testing.assert_array_equal(got, expected)
    assert _events(caplog) == ["compiled"] * 3 + ["cache"] * 3 and again.compile_count == 0
    unforced = _lenet_for_backward(False)
    unforced.forward(data=x)
    unforced.backward()
    assert _events(caplog)[6:] == ["cache", "cache", "compiled"]
    assert not np.any(unforced.params["ip1"][0].diff) and not np.any(unforced.blobs["data"].diff)


def test_programs_of_python_layers_and_carried_state_are_not_kept(cache, tmp_path):
    python_net = ('layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 2 } } }\n'
                  'layer { name: "p" type: "Python" bottom: "x" top: "y" '
                  'python_param { module: "caffejax_test_cached" layer: "Double" } }\n')
    (tmp_path / "caffejax_test_cached.py").write_text(textwrap.dedent('''
        import caffejax
        class Double(caffejax.Layer):
            def reshape(self, bottom, top):
                top[0].reshape(*bottom[0].data.shape)
            def forward(self, bottom, top):
                top[0].data[...] = 2 * bottom[0].data
        '''))
    sys.path.insert(0, str(tmp_path))
    try:
        net = caffejax.Net(python_net, caffejax.TEST, allow_python_layers=True)
        np.testing.assert_array_equal(net.forward(x=np.ones(2, np.float32))["y"], [2.0, 2.0])
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("caffejax_test_cached", None)
    rnn = ('layer { name: "x" type: "Input" top: "x" top: "cont" '
           'input_param { shape { dim: 3 dim: 1 dim: 2 } shape { dim: 3 dim: 1 } } }\n'
           'layer { name: "rnn" type: "RNN" bottom: "x" bottom: "cont" top: "h" '
           'recurrent_param { num_output: 2 weight_filler { type: "gaussian" std: 0.5 } } }\n')
    net = caffejax.Net(rnn, caffejax.TEST)
    for _ in range(2):  # the first forward starts from Caffe's zero state, the second from the first's
        net.forward(x=np.ones((3, 1, 2), np.float32), cont=np.ones((3, 1), np.float32))
    assert not cache.exists() or not list(cache.glob("*.program"))


def test_programs_over_a_python_data_layer_are_kept(cache, tmp_path, caplog):
    """A Python data layer runs on the host before the program, which only takes its tops: a second net of the
    same model loads the program (FCN's training restarts compile a program per image size) and computes the
    same loss on the same batch."""
    caplog.set_level(logging.DEBUG, logger=program_cache.__name__)
    text = ('layer { name: "d" type: "Python" top: "x" top: "t" '
            'python_param { module: "caffejax_test_cached_data" layer: "Ramp" } }\n'
            'layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" '
            'inner_product_param { num_output: 2 weight_filler { type: "constant" value: 0.5 } } }\n'
            'layer { name: "loss" type: "EuclideanLoss" bottom: "y" bottom: "t" top: "loss" }\n')
    (tmp_path / "caffejax_test_cached_data.py").write_text(textwrap.dedent('''
        import numpy as np
        import caffejax
        class Ramp(caffejax.Layer):
            def reshape(self, bottom, top):
                top[0].reshape(3, 4)
                top[1].reshape(3, 2)
            def forward(self, bottom, top):
                top[0].data[...] = np.arange(12).reshape(3, 4)
                top[1].data[...] = 1
        '''))
    sys.path.insert(0, str(tmp_path))
    try:
        losses = [caffejax.Net(text, caffejax.TRAIN, allow_python_layers=True).forward()["loss"] for _ in range(2)]
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("caffejax_test_cached_data", None)
    assert _events(caplog) == ["compiled", "cache"]
    assert losses[0] == losses[1] > 0


CACHED_RUN = """
import sys, numpy as np, jax
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
import caffejax
net = caffejax.Net(sys.argv[2], sys.argv[3], caffejax.TEST)
x = np.random.default_rng(0).random((2, 1, 28, 28), dtype=np.float32)
net.blobs["data"].reshape(*x.shape)
a = np.asarray(net.forward(data=x)["prob"])
b = np.asarray(caffejax.compile_inference(net)({"data": x})["prob"])
np.save(sys.argv[4], np.stack([a, b]))
"""


def test_programs_kept_while_jaxs_own_cache_holds_them_run(tmp_path):
    """JAX's persistent cache already holds the programs (caffejax upgraded, or its program cache switched on
    later). The programs caffejax keeps must still run when a later process loads them: an executable JAX
    loaded from its cache serializes without some kernels, and failed there with "NOT_FOUND: Function ... not
    found". Three processes: JAX's cache only; then caffejax's kept too; then loaded from caffejax's."""
    jax_cache = tmp_path / "jax-cache"
    outputs = []
    for step, program_cache_setting in enumerate(["0", "", ""]):
        out = tmp_path / f"out{step}.npy"
        env = {**os.environ, program_cache.ENVIRONMENT: program_cache_setting}
        done = subprocess.run([sys.executable, "-c", CACHED_RUN, str(jax_cache), str(LENET), str(WEIGHTS), str(out)],
                              capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        outputs.append(np.load(out))
    # Net.forward's pass and its weights' preparation, compile_inference's program.
    assert len(list((jax_cache / program_cache.SUBDIRECTORY).glob("*.program"))) == 3
    for got in outputs[1:]:
        np.testing.assert_array_equal(got, outputs[0])


FRESH_COMPILE = """
import sys, jax, jax.numpy as jnp
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
from caffejax.runtime import program_cache
events = []
jax.monitoring.register_event_listener(lambda event, **kwargs: events.append(event))
USED = "/jax/compilation_cache/compile_requests_use_cache"
jax.jit(jnp.sin).lower(1.0).compile()  # the process's first compile: JAX decides its cache is on
assert events.count(USED) == 1, events
with program_cache._without_jax_cache():
    jax.jit(jnp.cos).lower(1.0).compile()
assert events.count(USED) == 1, "the compile meant to be fresh went through JAX's cache"
jax.jit(jnp.tanh).lower(1.0).compile()
assert events.count(USED) == 2, "JAX's cache stayed off after the fresh compile"
"""


def test_a_fresh_compile_keeps_out_of_jaxs_cache_after_the_process_used_it(tmp_path):
    """A program compiled to be kept neither reads nor writes JAX's cache, even where an earlier compile of the
    process found the cache on (JAX keeps that first answer): jax 0.12.1 loaded such a program from its cache,
    and the kept copy failed when the next process ran it. Later compiles use the cache again."""
    done = subprocess.run([sys.executable, "-c", FRESH_COMPILE, str(tmp_path / "jax-cache")], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


SOLVER_NET = '''
layer { name: "x" type: "Input" top: "x" top: "label" input_param { shape { dim: 8 dim: 1 dim: 6 dim: 6 }
        shape { dim: 8 } } }
layer { name: "conv" type: "Convolution" bottom: "x" top: "conv"
        convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
'''


def _trained(solver_type: str, steps: int):
    from caffejax.proto import caffe_pb2
    from google.protobuf import text_format

    caffejax.set_random_seed(7)
    param = text_format.Parse(f'type: "{solver_type}" base_lr: 0.05 lr_policy: "fixed" momentum: 0.9 '
                              f'weight_decay: 0.001 max_iter: 10 net_param {{ {SOLVER_NET} }}',
                              caffe_pb2.SolverParameter())
    solver = caffejax.get_solver(param)
    rng = np.random.default_rng(0)
    solver.net.blobs["x"].data[...] = rng.normal(size=(8, 1, 6, 6))
    solver.net.blobs["label"].data[...] = rng.integers(0, 3, 8)
    history = None
    for _ in range(steps):
        history = list(solver._history[0])  # what the next step gives up
        solver.step(1)
    return solver, history


@pytest.mark.parametrize("solver_type", ["SGD", "Adam"])
def test_a_solvers_iteration_loads_without_tracing_and_trains_the_same(cache, caplog, solver_type):
    """A new solver of the same net and settings runs its iterations from the kept program: nothing traced, the
    same weights after three steps, and the history each step gives up (donated) is given up by the loaded
    program too."""
    caplog.set_level(logging.DEBUG, logger=program_cache.__name__)
    first, _ = _trained(solver_type, 3)
    assert _events(caplog) == ["compiled"] and first.compile_count == 1
    again, given_up = _trained(solver_type, 3)
    assert _events(caplog) == ["compiled", "cache"] and again.compile_count == 0
    assert all(array.is_deleted() for array in given_up)
    for name in ("conv", "ip"):
        for trained, expected in zip(again.net.params[name], first.net.params[name]):
            np.testing.assert_array_equal(trained.data, expected.data)
    other = caffejax.get_solver(first.param.__class__.FromString(first.param.SerializeToString()))
    other.param.momentum = 0.5  # other settings: another program
    assert other._step_description() != first._step_description()

    class OwnRule(caffejax.SGDSolver):  # code outside caffejax decides its program: never kept
        pass

    assert OwnRule(first.param)._step_description() is None
