"""Several devices (caffejax.runtime.distributed): data-parallel training with Caffe's multi-GPU rule, and
sharded inference.

JAX fixes its device count when it starts, so the tests that need four devices run in a child pytest that
sees four virtual CPU devices (``test_four_device_tests_in_a_child_process`` starts it). Where this process
already sees four devices they run here directly.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import caffejax
from caffejax.errors import CaffejaxError, DataError, ShapeError
from caffejax.frontend.prototxt import parse_net_text
from caffejax.proto import caffe_pb2
from caffejax.runtime.distributed import DataShard, batch_mesh, data_parallel_forward, deal_records, pass_batch
from caffejax.runtime.solver import read_solver_param
from conftest import REFERENCE

SOLVERS = REFERENCE / "solvers"
FOUR_DEVICES = jax.device_count() >= 4
needs_four = pytest.mark.skipif(not FOUR_DEVICES, reason="runs in test_four_device_tests_in_a_child_process")
CHILD_FLAGS = "--xla_force_host_platform_device_count=4"


def test_four_device_tests_in_a_child_process():
    if FOUR_DEVICES:
        pytest.skip("this process sees four devices: the tests ran here")
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {CHILD_FLAGS}".strip(),
           "JAX_PLATFORMS": "cpu"}
    here = pathlib.Path(__file__)
    result = subprocess.run([sys.executable, "-m", "pytest", str(here), "-q", "-p", "no:cacheprovider", "-m",
                             "not slow", "-k", "not child_process"], cwd=here.parent.parent, env=env,
                            capture_output=True, text=True, timeout=600)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0 and "skipped" not in summary, result.stdout[-8000:] + result.stderr[-4000:]


# ---- training -------------------------------------------------------------------------------------------------------

def _feed(solver, **arrays) -> None:
    for name, array in arrays.items():
        solver.net.blobs[name].reshape(*array.shape)
        solver.net.blobs[name].data[...] = array


def _solver_param(case: str) -> caffe_pb2.SolverParameter:
    """The reference case's solver, starting from Caffe's snapshot weights (no filler program to compile)."""
    param, _ = read_solver_param(str(SOLVERS / f"{case}_solver.prototxt"))
    param.net = str(SOLVERS / param.net)
    param.weights.append(str(SOLVERS / f"{case}_iter_3.caffemodel"))
    return param


@needs_four
@pytest.mark.parametrize("case", ["sgd_momentum_step", "sgd_sigmoid_clip_itersize"])
def test_four_devices_train_as_one_device_on_the_concatenated_batch(case):
    """Caffe averages the devices' diffs; SoftmaxWithLoss averages over its batch: the same arithmetic as one
    device on the 4 batches concatenated (momentum, decay, the step policy, clipping and iter_size 2)."""
    four = caffejax.get_solver(_solver_param(case), devices=4)
    one = caffejax.get_solver(_solver_param(case))  # the same weights (the snapshot's)
    batch = one.net.blobs["data"].shape
    assert four.net.blobs["data"].shape == (4 * batch[0],) + batch[1:]  # the global batch
    assert four.net.blobs["label"].shape == (4 * batch[0],)
    rng = np.random.default_rng(3)
    for step in range(6):
        data = rng.standard_normal(four.net.blobs["data"].shape).astype(np.float32)
        label = rng.integers(0, 5, size=4 * batch[0]).astype(np.float32)
        if step == 5:  # net surgery between steps reaches the devices
            for solver in (four, one):
                solver.net.params["ip1"][1].data[...] = np.arange(5, dtype=np.float32) / 10
        for solver in (four, one):
            _feed(solver, data=data, label=label)
            solver.step(1)
        # param_arrays(), not .data: the weights stay device arrays, so steps reuse their replicated copies.
        expected = one.net.param_arrays()
        for name, arrays in four.net.param_arrays().items():
            for i, array in enumerate(arrays):
                np.testing.assert_allclose(array, expected[name][i], rtol=0, atol=1e-5,
                                           err_msg=f"{case} step {step} {name}/{i}")
                np.testing.assert_allclose(four.net.params[name][i].diff, one.net.params[name][i].diff, rtol=0,
                                           atol=1e-5)
        np.testing.assert_allclose(four.net.blobs["loss"].data, one.net.blobs["loss"].data, rtol=1e-5)
        np.testing.assert_allclose(four.net.blobs["ip1"].data, one.net.blobs["ip1"].data, rtol=0, atol=1e-5)
    assert four.compile_count == 1
    assert four.iter == 6


BATCH_NORM_NET = """
name: "bn"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 4 dim: 2 dim: 5 dim: 5 } } }
layer { name: "label" type: "Input" top: "label" input_param { shape { dim: 4 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 3 kernel_size: 3 } }
layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "conv" }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip" inner_product_param { num_output: 3 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


@needs_four
def test_batch_norm_normalises_each_device_batch_and_keeps_the_mean_statistics():
    """Each device's BatchNorm uses its own batch's statistics (as each GPU does); the diffs are averaged;
    the running statistics are the mean of the devices' copies."""
    param = caffe_pb2.SolverParameter(type="SGD", base_lr=0.1, lr_policy="fixed", max_iter=10)
    param.net_param.CopyFrom(parse_net_text(BATCH_NORM_NET))
    two = caffejax.get_solver(param, devices=2)
    rng = np.random.default_rng(4)
    for name in ("conv", "ip"):  # random weights (the prototxt's constant fillers compile fast)
        for blob in two.net.params[name]:
            blob.data[...] = rng.standard_normal(blob.shape).astype(np.float32) * np.float32(0.5)
    start = {name: [b.data.copy() for b in blobs] for name, blobs in two.net.params.items()}
    data = rng.standard_normal((8, 2, 5, 5)).astype(np.float32)
    data[4:] = 3 * data[4:] + 1  # the devices' batches differ in their statistics
    label = rng.integers(0, 3, size=8).astype(np.float32)
    _feed(two, data=data, label=label)
    two.step(1)

    # Each device on its own: one-device nets on each half, from the same weights.
    reference = caffejax.Net(BATCH_NORM_NET, caffejax.TRAIN)
    halves = []
    for rows in (slice(0, 4), slice(4, 8)):
        for name, arrays in start.items():
            for i, array in enumerate(arrays):
                reference.params[name][i].data[...] = array
        reference.clear_param_diffs()
        loss = reference.forward(data=data[rows], label=label[rows])["loss"].copy()
        reference.backward()
        halves.append((loss, {name: [(b.data.copy(), b.diff.copy()) for b in blobs]
                              for name, blobs in reference.params.items()}))
    (loss_a, a), (loss_b, b) = halves
    assert not np.allclose(a["bn"][0][0], b["bn"][0][0])  # the halves' statistics differ
    for name in ("conv", "ip"):
        for i in range(2):
            mean_diff = (a[name][i][1] + b[name][i][1]) / 2
            np.testing.assert_allclose(two.net.params[name][i].data, start[name][i] - np.float32(0.1) * mean_diff,
                                       rtol=1e-5, atol=1e-6, err_msg=f"{name}/{i}")
    for i in range(3):
        np.testing.assert_allclose(two.net.params["bn"][i].data, (a["bn"][i][0] + b["bn"][i][0]) / 2, rtol=1e-5,
                                   atol=1e-6, err_msg=f"bn/{i}")
    np.testing.assert_allclose(two.net.blobs["loss"].data, (loss_a + loss_b) / 2, rtol=1e-5)


MEMORY_NET = """
name: "memory"
layer { name: "data" type: "MemoryData" top: "data" top: "label"
  memory_data_param { batch_size: 3 channels: 1 height: 2 width: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 2 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


@needs_four
def test_data_layer_records_are_dealt_to_devices_as_caffe_does():
    """Two devices pull two prototxt batches per pass; device r gets records r, r + 2, r + 4 (rank = i mod N)."""
    param = caffe_pb2.SolverParameter(type="SGD", base_lr=0.1, lr_policy="fixed", max_iter=10)
    param.net_param.CopyFrom(parse_net_text(MEMORY_NET))
    two = caffejax.get_solver(param, devices=2)
    data = np.arange(12 * 4, dtype=np.float32).reshape(12, 1, 2, 2)
    labels = (np.arange(12) % 2).astype(np.float32)
    two.net.set_input_arrays(data, labels)
    two.step(1)
    np.testing.assert_array_equal(two.net.blobs["data"].data, data[[0, 2, 4, 1, 3, 5]])
    np.testing.assert_array_equal(two.net.blobs["label"].data.ravel(), labels[[0, 2, 4, 1, 3, 5]])
    two.step(1)  # the next pass continues the stream
    np.testing.assert_array_equal(two.net.blobs["data"].data, data[[6, 8, 10, 7, 9, 11]])


@needs_four
def test_refuses_uneven_batches_and_missing_devices():
    with pytest.raises(CaffejaxError, match="JAX sees 4 cpu device"):
        caffejax.get_solver(_solver_param("sgd_momentum_step"), devices=5)
    four = caffejax.get_solver(_solver_param("sgd_momentum_step"), devices=4)
    four.net.blobs["data"].reshape(22, 2, 8, 8)
    four.net.blobs["label"].reshape(22)
    with pytest.raises(DataError, match="'data' has shape \\(22, 2, 8, 8\\).*multiple of 4"):
        four.step(1)



@needs_four
def test_refuses_python_layers_over_several_devices_but_not_python_data_layers(tmp_path, monkeypatch):
    """One host object serves a Python layer inside the program for every device, in no set order: refused, by
    name. A Python data layer runs on the host before the program, as other data layers do, and is dealt out
    to the devices like theirs."""
    (tmp_path / "caffejax_test_devices_pylayer.py").write_text(textwrap.dedent("""
        import caffejax

        class Ones(caffejax.Layer):
            def setup(self, bottom, top):
                pass

            def reshape(self, bottom, top):
                top[0].reshape(2, 3)

            def forward(self, bottom, top):
                top[0].data[...] = 1

        class Twice(caffejax.Layer):
            def setup(self, bottom, top):
                pass

            def reshape(self, bottom, top):
                top[0].reshape(*bottom[0].shape)

            def forward(self, bottom, top):
                top[0].data[...] = 2 * bottom[0].data

            def backward(self, top, propagate_down, bottom):
                bottom[0].diff[...] = 2 * top[0].diff
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    data = """layer { name: "ones" type: "Python" top: "x"
                      python_param { module: "caffejax_test_devices_pylayer" layer: "Ones" } }
    """
    twice = """layer { name: "twice" type: "Python" bottom: "x" top: "x2"
                       python_param { module: "caffejax_test_devices_pylayer" layer: "Twice" } }
    """
    head = """layer { name: "ip" type: "InnerProduct" bottom: "%s" top: "y" inner_product_param { num_output: 2 } }
              layer { name: "loss" type: "EuclideanLoss" bottom: "y" bottom: "y" top: "loss" }
    """

    def solver_param(text):
        param = caffe_pb2.SolverParameter(type="SGD", base_lr=0.1, lr_policy="fixed", max_iter=1)
        param.net_param.CopyFrom(parse_net_text(text))
        return param

    with pytest.raises(caffejax.UnsupportedError, match="Python layers \\['twice'\\].*on one device, not 2"):
        caffejax.get_solver(solver_param(data + twice + head % "x2"), devices=2, allow_python_layers=True)
    caffejax.get_solver(solver_param(data + twice + head % "x2"), allow_python_layers=True).step(1)
    solver = caffejax.get_solver(solver_param(data + head % "x"), devices=2, allow_python_layers=True)
    solver.step(1)
    np.testing.assert_array_equal(solver.net.blobs["x"].data, np.ones((4, 3)))  # each device's batch of 2


# ---- inference ---------------------------------------------------------------------------------------------------

@needs_four
def test_sharded_inference_equals_one_device():
    net = caffejax.Net(str(SOLVERS / "sgd_momentum_step_net.prototxt"), caffejax.TEST,
                       weights=str(SOLVERS / "sgd_momentum_step_iter_3.caffemodel"))
    forward = data_parallel_forward(net, 4, blobs=["ip1"])
    rng = np.random.default_rng(5)
    data = rng.standard_normal((24, 2, 8, 8)).astype(np.float32)
    label = rng.integers(0, 5, size=24).astype(np.float32)
    sharded = forward(data=data, label=label)
    assert set(sharded) == {"loss", "ip1"}
    net.blobs["data"].reshape(*data.shape)
    net.blobs["label"].reshape(*label.shape)
    single = net.forward(data=data, label=label, blobs=["ip1"])
    assert sharded["ip1"].shape == (24, 5)
    np.testing.assert_allclose(sharded["ip1"], single["ip1"], rtol=1e-6, atol=1e-6)
    # The loss does not depend on the batch size: the mean of the devices' losses, the global batch's loss.
    np.testing.assert_allclose(sharded["loss"], single["loss"], rtol=1e-6)
    with pytest.raises(DataError, match="multiple of 4"):
        forward(data=data[:22], label=label[:22])
    with pytest.raises(CaffejaxError, match="fed blob"):
        forward(data=data)
    # Rows that split evenly but do not fit each other: the error names the shapes fed, not only one device's
    # (6 rows of data and 3 labels).
    with pytest.raises(ShapeError, match=r"inputs of shapes \{'data': \(24, 2, 8, 8\), 'label': \(12,\)\} over 4 "
                                         r"devices: .*\(3,\)"):
        forward(data=data, label=label[:12])


@pytest.mark.parametrize("devices", [2.5, "2", [0, 1], True, None])
def test_refuses_devices_that_are_not_a_count_or_jax_devices(devices):
    """Device ids, a float, a string or a bool were Python's TypeError/AttributeError (or, True, one device)."""
    with pytest.raises(CaffejaxError, match="devices: give a number of devices or a list of jax devices"):
        batch_mesh(devices)


# ---- the data a pass reads (no devices needed) --------------------------------------------------------------------

def _numbered_batches(batch_size: int):
    count = iter(range(10 ** 6))

    def pull():
        records = np.array([next(count) for _ in range(batch_size)])
        return {"data": records.astype(np.float32), "label": -records}

    return pull


def test_deal_records_gives_record_i_to_device_i_mod_n():
    np.testing.assert_array_equal(deal_records(np.arange(6), 3), [0, 3, 1, 4, 2, 5])
    np.testing.assert_array_equal(deal_records(np.arange(12).reshape(6, 2), 2)[:, 0], [0, 4, 8, 2, 6, 10])


def test_pass_batch_keeps_this_process_batches_and_deals_them():
    # One process, two devices, batches of 3: records 0..5, dealt 0 2 4 | 1 3 5.
    one = pass_batch(_numbered_batches(3), devices=2, shard=DataShard())
    np.testing.assert_array_equal(one["data"], [0, 2, 4, 1, 3, 5])
    np.testing.assert_array_equal(one["label"], -one["data"])
    # Process 1 of 2, two devices each: of batches 0..3 it keeps 1 and 3 (records 3..5, 9..11).
    pull = _numbered_batches(3)
    np.testing.assert_array_equal(pass_batch(pull, devices=2, shard=DataShard(1, 2))["data"], [3, 5, 10, 4, 9, 11])
    # The stream continues: the next pass keeps batches 5 and 7.
    np.testing.assert_array_equal(pass_batch(pull, devices=2, shard=DataShard(1, 2))["data"],
                                  [15, 17, 22, 16, 21, 23])


# ---- several processes (jax.distributed) ---------------------------------------------------------------------------

TWO_PROCESS_SCRIPT = textwrap.dedent("""
    import os, sys
    process_id, port, solver_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=process_id)
    import numpy as np
    import caffejax

    four = caffejax.get_solver(solver_path, devices=jax.device_count())  # 2 processes x 2 devices
    one = caffejax.get_solver(solver_path)  # this process's first device, on the whole global batch
    for name, blobs in four.net.params.items():
        for i, blob in enumerate(blobs):
            one.net.params[name][i].data[...] = blob.data
    assert four.net.blobs["data"].shape == (12, 2, 8, 8), four.net.blobs["data"].shape  # this process's rows
    rng = np.random.default_rng(3)
    for step in range(3):
        data = rng.standard_normal((24, 2, 8, 8)).astype(np.float32)
        label = rng.integers(0, 5, size=24).astype(np.float32)
        rows = slice(12 * process_id, 12 * (process_id + 1))
        four.net.blobs["data"].data[...] = data[rows]
        four.net.blobs["label"].data[...] = label[rows]
        four.step(1)
        one.net.blobs["data"].reshape(24, 2, 8, 8)
        one.net.blobs["label"].reshape(24)
        one.net.blobs["data"].data[...] = data
        one.net.blobs["label"].data[...] = label
        one.step(1)
        for name, blobs in one.net.params.items():
            for i, blob in enumerate(blobs):
                np.testing.assert_allclose(four.net.params[name][i].data, blob.data, rtol=0, atol=1e-5)
        np.testing.assert_allclose(four.net.blobs["ip1"].data, one.net.blobs["ip1"].data[rows], atol=1e-5)
        np.testing.assert_allclose(four.net.blobs["loss"].data, one.net.blobs["loss"].data, rtol=1e-5)
    print("process", process_id, "agrees")
""")


@pytest.mark.slow
def test_two_processes_train_as_one_device(tmp_path):
    """The documented multi-host path: jax.distributed.initialize, one process per host, each feeding its rows."""
    script = tmp_path / "train.py"
    script.write_text(TWO_PROCESS_SCRIPT)
    port = str(20000 + os.getpid() % 20000)
    env = {key: value for key, value in os.environ.items() if key not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    path = str(SOLVERS / "sgd_momentum_step_solver.prototxt")
    processes = [subprocess.Popen([sys.executable, str(script), str(i), port, path], env=env, cwd=tmp_path,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in processes]
    for i, (p, output) in enumerate(zip(processes, outputs)):
        assert p.returncode == 0 and f"process {i} agrees" in output, output[-6000:]


# ---- compile_inference over devices -------------------------------------------------------------------------------

def _lenet_on_one_device(rows: int):
    """The trained LeNet, ``rows`` random images and its probabilities for them from the one-device program."""
    from conftest import BUNDLED

    net = caffejax.Net(str(BUNDLED / "lenet/lenet.prototxt"), str(BUNDLED / "lenet/lenet_iter_10000.caffemodel"),
                       caffejax.TEST)
    x = np.random.default_rng(0).random((rows, 1, 28, 28), dtype=np.float32)
    return net, x, np.asarray(caffejax.compile_inference(net)({"data": x})["prob"])


@needs_four
def test_compile_inference_over_devices_is_the_one_device_program():
    net, x, one = _lenet_on_one_device(8)
    four = caffejax.compile_inference(net, devices=4)
    got = four({"data": x})["prob"]
    assert len(got.sharding.device_set) == 4 and got.shape == (8, 10)
    np.testing.assert_allclose(np.asarray(got), one, rtol=1e-5, atol=1e-7)
    assert four.plan({"data": (8, 1, 28, 28)}).graph.blob_shape("data") == (2, 1, 28, 28)  # each device's rows
    np.testing.assert_allclose(np.asarray(four({"data": x[:4]})["prob"]), one[:4], rtol=1e-5, atol=1e-7)
    programs = list(four._programs.values())  # batches of 8 and 4: one replicated copy of each weight for both
    assert len(programs) == 2 and all(a is b for name in programs[0].params
                                      for a, b in zip(programs[0].params[name], programs[1].params[name]))
    assert len(programs[0].params["conv1"][0].sharding.device_set) == 4
    two = caffejax.compile_inference(net, devices=jax.devices()[2:])
    np.testing.assert_allclose(np.asarray(two({"data": x[:2]})["prob"]), one[:2], rtol=1e-5, atol=1e-7)
    with pytest.raises(DataError, match="do not split evenly over 4 devices"):
        four({"data": x[:6]})
    with pytest.raises(CaffejaxError, match="devices=5: JAX sees 4 cpu device"):
        caffejax.compile_inference(net, devices=5)


@needs_four
def test_compile_inference_over_devices_pads_batches_to_sizes_the_devices_split():
    net, x, one = _lenet_on_one_device(9)
    served = caffejax.compile_inference(net, devices=4, batch_sizes=(4, 8))
    for n in (1, 3, 6, 9):
        got = served({"data": x[:n]})["prob"]
        assert got.shape == (n, 10)
        np.testing.assert_allclose(np.asarray(got), one[:n], rtol=1e-5, atol=1e-7)
    assert served.compile_count == 2
    with pytest.raises(CaffejaxError, match=r"batch_sizes \[4, 6\] must be multiples of the 4 devices"):
        caffejax.compile_inference(net, devices=4, batch_sizes=(6, 4))


@needs_four
def test_detections_over_devices_are_the_one_device_ones(isolated_registry):
    """A layer run on the host (SSD's DetectionOutput) finishes what the devices gathered: compile_inference and
    data_parallel_forward over four devices find Net.forward's detections."""
    from caffejax.lower import forks
    from test_ssd_detection import SSD_PARAM, _ssd_text

    forks.register_all()
    net = caffejax.Net(_ssd_text(SSD_PARAM, True).replace("dim: 2 ", "dim: 4 ", 1), caffejax.TEST)
    images = np.random.default_rng(0).standard_normal((4, 3, 32, 32)).astype(np.float32)
    one = np.asarray(net.forward(data=images)["detection_out"])
    assert set(one[0, 0, :, 0]) == {0, 1, 2, 3}
    np.testing.assert_allclose(caffejax.compile_inference(net, devices=4)({"data": images})["detection_out"], one,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(data_parallel_forward(net, 4)(data=images)["detection_out"], one, rtol=1e-5,
                               atol=1e-6)


@needs_four
def test_compile_inference_takes_inputs_from_any_device_and_runs_on_the_default_one(tmp_path, monkeypatch):
    from conftest import BUNDLED
    from caffejax.runtime import program_cache

    monkeypatch.setenv(program_cache.ENVIRONMENT, str(tmp_path))
    net = caffejax.Net(str(BUNDLED / "lenet/lenet.prototxt"), str(BUNDLED / "lenet/lenet_iter_10000.caffemodel"),
                       caffejax.TEST)
    x = np.random.default_rng(1).random((2, 1, 28, 28), dtype=np.float32)
    expected = np.asarray(caffejax.compile_inference(net)({"data": x})["prob"])
    elsewhere = jax.device_put(x, jax.devices()[2])
    got = caffejax.compile_inference(net)({"data": elsewhere})["prob"]  # loaded from the program cache
    assert got.devices() == {jax.devices()[0]}
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6)
    with jax.default_device(jax.devices()[3]):
        there = caffejax.compile_inference(net)({"data": elsewhere})["prob"]
    assert there.devices() == {jax.devices()[3]}
    # (that program takes LeNet's weights as arguments, the first device's holds them as constants, which XLA may
    # sum in another order: the probabilities within a few ulps of their logits)
    np.testing.assert_allclose(np.asarray(there), expected, rtol=1e-5)
    assert len(list(tmp_path.glob("*.program"))) == 1  # the program for device 3 was compiled, not cached


@needs_four
def test_a_loaded_export_takes_inputs_from_any_device_and_runs_on_the_default_one(tmp_path):
    from caffejax.export import export_stablehlo, load_stablehlo
    from conftest import BUNDLED

    net = caffejax.Net(str(BUNDLED / "lenet/lenet.prototxt"), str(BUNDLED / "lenet/lenet_iter_10000.caffemodel"),
                       caffejax.TEST)
    export_stablehlo(net, str(tmp_path / "lenet.stablehlo"), batch="batch")
    x = np.random.default_rng(1).random((2, 1, 28, 28), dtype=np.float32)
    model = load_stablehlo(str(tmp_path / "lenet.stablehlo"))
    expected = np.asarray(model(data=x)["prob"])
    for elsewhere in (jax.device_put(x, jax.devices()[2]), jax.device_put(x, jax.devices()[1])):
        got = model(data=elsewhere)["prob"]  # (the same program: one per input shape)
        assert got.devices() == {jax.devices()[0]} and model.compile_count == 1
        np.testing.assert_array_equal(np.asarray(got), expected)
    with jax.default_device(jax.devices()[3]):
        there = load_stablehlo(str(tmp_path / "lenet.stablehlo"))(data=jax.device_put(x, jax.devices()[2]))["prob"]
    assert there.devices() == {jax.devices()[3]}
    np.testing.assert_allclose(np.asarray(there), expected, rtol=1e-6)
