"""caffejax.Net's pycaffe contract: compile once per shape, reshape, from/to passes, surgery, weights I/O."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import jax
import numpy as np
import pytest

import caffejax
from caffejax.proto import caffe_pb2
from conftest import BUNDLED, REFERENCE, layer_case, program_calls

LENET = BUNDLED / "lenet" / "lenet.prototxt"
LENET_WEIGHTS = BUNDLED / "lenet" / "lenet_iter_10000.caffemodel"


@pytest.fixture(scope="module")
def lenet():
    return caffejax.Net(str(LENET), str(LENET_WEIGHTS), caffejax.TEST)


def digits(n, seed=0):
    return np.random.default_rng(seed).random((n, 1, 28, 28), dtype=np.float32)


def test_pycaffe_constructor_orders():
    a = caffejax.Net(str(LENET), str(LENET_WEIGHTS), caffejax.TEST)
    b = caffejax.Net(str(LENET), caffejax.TEST, weights=str(LENET_WEIGHTS))
    np.testing.assert_array_equal(a.params["conv1"][0].data, b.params["conv1"][0].data)
    with pytest.raises(TypeError):
        caffejax.Net(str(LENET))


def test_pycaffes_private_indices_are_caffes_blob_indices():
    """Scripts walk the graph by index (net._bottom_ids(i), net._blobs[j]...) as pycaffe exposes Caffe's Net: blob
    j is _blob_names[j], in Caffe's order (the upgraded input first, InsertSplits' blobs where Caffe puts them)."""
    net = caffejax.Net("""
        input: "x" input_shape { dim: 2 dim: 3 }
        layer { name: "a" type: "ReLU" bottom: "x" top: "a" }
        layer { name: "b" type: "Sigmoid" bottom: "x" top: "b" }
        layer { name: "c" type: "Eltwise" bottom: "a" bottom: "b" top: "c" }
        layer { name: "d" type: "ReLU" bottom: "c" top: "c" }
    """, caffejax.TEST)
    assert net._layer_names == ["input", "x_input_0_split", "a", "b", "c", "d"]
    assert net._blob_names == ["x", "x_input_0_split_0", "x_input_0_split_1", "a", "b", "c"]
    assert (net._inputs, net._outputs) == ([0], [5])
    assert [(net._bottom_ids(i), net._top_ids(i)) for i in range(6)] == [
        ([], [0]), ([0], [1, 2]), ([1], [3]), ([2], [4]), ([3, 4], [5]), ([5], [5])]
    assert [blob is net.blobs[name] for blob, name in zip(net._blobs, net._blob_names)] == [True] * 6
    types = caffejax.layer_type_list()
    assert types == sorted(types) and {"Convolution", "Python", "SoftmaxWithLoss"} <= set(types)


def test_compiles_once_per_shape(lenet):
    lenet.blobs["data"].reshape(3, 1, 28, 28)
    before = lenet.compile_count
    lenet.forward(data=digits(3))
    lenet.forward(data=digits(3, seed=1))
    assert lenet.compile_count == before + 2  # the pass and its weights' preparation
    lenet.blobs["data"].reshape(5, 1, 28, 28)
    out = lenet.forward(data=digits(5))
    assert out["prob"].shape == (5, 10)
    assert lenet.compile_count == before + 3  # the pass: the preparation computes the same
    lenet.blobs["data"].reshape(3, 1, 28, 28)  # back to a shape seen before: cached program
    lenet.forward(data=digits(3))
    assert lenet.compile_count == before + 3


def test_a_reshape_back_to_shapes_seen_before_builds_no_graph(monkeypatch):
    """A pycaffe script that resizes its input for every scale of an image pyramid (MTCNN's detect_face) goes back
    and forth between shapes: the net is built and shape-inferred once per shape, not at every reshape, and each
    forward still runs at its own shapes."""
    import caffejax.runtime.net as net_module

    net = caffejax.Net(str(LENET), str(LENET_WEIGHTS), caffejax.TEST)
    builds, build_graph = [], net_module.build_graph
    monkeypatch.setattr(net_module, "build_graph",
                        lambda *args, **kwargs: builds.append(kwargs["input_shapes"]) or build_graph(*args, **kwargs))
    first = {}
    for n in (2, 3, 2, 3, 1, 2):
        net.blobs["data"].reshape(n, 1, 28, 28)
        out = net.forward(data=digits(n, seed=n))["prob"]
        assert out.shape == (n, 10) and net.blobs["ip1"].data.shape == (n, 500)
        np.testing.assert_array_equal(out, first.setdefault(n, out.copy()))
    assert [shapes["data"][0] for shapes in builds] == [2, 3, 1]


def test_shapes_fed_in_turn_keep_each_form_of_the_weights(monkeypatch):
    """Input shapes whose kernels take the weights in other forms (a 3x3 convolution as Winograd over enough
    tiles, as XLA's convolution over fewer) keep each form: fed in turn (ResNet-50 fed batches of 1 and 2, an image
    pyramid's scales), no forward lays the weights out again, and each runs with its own form."""
    net = caffejax.Net("""
        input: "x" input_shape { dim: 1 dim: 4 dim: 8 dim: 8 }
        layer { name: "c" type: "Convolution" bottom: "x" top: "y"
                convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.1 }
                                    bias_filler { type: "constant" value: 0.5 } } }
    """, caffejax.TEST)
    laid_out = program_calls(monkeypatch, "prepare", lambda net: net.blobs["x"].shape[0])
    x = np.random.default_rng(0).standard_normal((4, 4, 8, 8)).astype(np.float32)
    kernels, first = {}, {}
    for n in (1, 4, 1, 4, 1):
        net.blobs["x"].reshape(n, 4, 8, 8)
        y = net.forward(x=x[:n])["y"]
        kernels[n] = net._program.forward_kernels["c"].name
        np.testing.assert_array_equal(y, first.setdefault(n, y.copy()))
    assert kernels == {1: "conv_nhwc", 4: "conv_winograd_f2x2_3x3"}
    assert laid_out == [1, 4]
    np.testing.assert_allclose(first[4][:1], first[1], rtol=1e-5, atol=1e-5)


def test_a_forward_works_out_its_pass_once_per_range_and_shapes(monkeypatch):
    """What a pass hands back and its program's range signature come from the graph alone: the first forward over
    a range works them out, later ones over the same shapes do not, a reshape (a new graph) works them out
    afresh, and a reshape back to shapes seen before does not (an image pyramid's scales walked image after
    image)."""
    net = caffejax.Net(str(LENET), str(LENET_WEIGHTS), caffejax.TEST)
    calls = []
    returned_values, range_signature = caffejax.Net._returned_values, caffejax.Net._range_signature
    monkeypatch.setattr(caffejax.Net, "_returned_values",
                        lambda self, layers: calls.append("returned") or returned_values(self, layers))
    monkeypatch.setattr(caffejax.Net, "_range_signature", staticmethod(
        lambda graph, first, last: calls.append("signature") or range_signature(graph, first, last)))
    net.blobs["data"].reshape(2, 1, 28, 28)
    first = net.forward(data=digits(2))["prob"].copy()
    assert {"returned", "signature"} <= set(calls)
    done = len(calls)
    again = net.forward(data=digits(2))["prob"]
    assert len(calls) == done
    np.testing.assert_array_equal(again, first)
    net.blobs["data"].reshape(3, 1, 28, 28)
    out = net.forward(data=digits(3))["prob"]
    assert len(calls) > done and out.shape == (3, 10)
    np.testing.assert_allclose(out[:2], first, rtol=1e-5, atol=1e-7)  # digits(3) begins with digits(2)
    done = len(calls)
    net.blobs["data"].reshape(2, 1, 28, 28)  # back to shapes seen before: their pass is known
    np.testing.assert_array_equal(net.forward(data=digits(2))["prob"], first)
    assert len(calls) == done


def test_forward_hands_back_the_blobs_named_and_those_read_after_every_pass(monkeypatch):
    """forward(blobs=[...]) hands its blobs back from the pass itself, and a blob read after every forward
    (features taken from fc7, pycaffe's way) is handed back from the third pass on: neither recomputes the net.
    A blob read once (a script printing the blobs' shapes) is recomputed then and compiles nothing more."""
    recomputes = program_calls(monkeypatch, "forward-all")
    net = caffejax.Net(str(LENET), str(LENET_WEIGHTS), caffejax.TEST)
    net.blobs["data"].reshape(2, 1, 28, 28)
    x = digits(2, seed=5)
    named = net.forward(data=x, blobs=["ip1"])["ip1"].copy()
    assert recomputes == []
    features, pooled = [], net.forward(data=x, blobs=["pool2"])["pool2"].copy()
    assert recomputes == []
    for _ in range(5):
        net.forward(data=x)
        features.append((net.blobs["ip1"].data.copy(), net.blobs["pool2"].data.copy()))  # two blobs, each read
    assert len(recomputes) == 2  # after the first two passes
    for ip1, pool2 in features:
        np.testing.assert_array_equal(ip1, named)
        np.testing.assert_array_equal(pool2, pooled)
    compiled, recomputed = net.compile_count, len(recomputes)
    for _ in range(3):  # no longer read: the pass that handed it back, then the plain one again
        net.forward(data=x)
    assert net.compile_count == compiled and len(recomputes) == recomputed
    shapes = {name: blob.data.shape for name, blob in net.blobs.items()}  # every blob, once
    assert shapes["conv2"] == (2, 50, 8, 8) and len(recomputes) == recomputed + 1
    for _ in range(3):
        np.testing.assert_array_equal(net.forward(data=x)["prob"], net.forward(data=x, blobs=["ip1"])["prob"])
    assert net.compile_count == compiled


def test_blobs_read_at_random_after_each_forward_compile_a_bounded_number_of_programs():
    """Each set of blobs read after two passes in a row is handed back by a program of its own: a script reading
    blobs at random after every forward (a viewer sampling layers) compiled a program at nearly every new pair of
    sets (22 in LeNet's 60 forwards). At most LEARNT_SETS_PER_RANGE of them now; the other reads recompute, and
    every read holds the pass's value."""
    from caffejax.runtime.net import LEARNT_SETS_PER_RANGE

    net = caffejax.Net(str(LENET), str(LENET_WEIGHTS), caffejax.TEST)
    net.blobs["data"].reshape(1, 1, 28, 28)
    x = digits(1, seed=2)
    net.forward(data=x)
    want = {name: blob.data.copy() for name, blob in net.blobs.items()}
    compiled = net.compile_count
    choose = random.Random(0)
    names = [name for name in net.blobs if name != "data"]
    for _ in range(40):
        net.forward(data=x)
        for name in choose.sample(names, 3):
            np.testing.assert_allclose(net.blobs[name].data, want[name], rtol=1e-6, atol=1e-7, err_msg=name)
    assert net.compile_count - compiled <= LEARNT_SETS_PER_RANGE


def test_blob_data_and_forward_kwargs_agree(lenet):
    lenet.blobs["data"].reshape(2, 1, 28, 28)
    x = digits(2, seed=3)
    out = lenet.forward(data=x)["prob"].copy()
    lenet.blobs["data"].data[...] = x
    lenet.forward()
    np.testing.assert_array_equal(lenet.blobs["prob"].data, out)
    np.testing.assert_allclose(out.sum(axis=1), 1.0, rtol=1e-5)
    with pytest.raises(caffejax.CaffejaxError):
        lenet.forward(wrong=x)


def test_forward_from_to_equals_full_pass(lenet):
    lenet.blobs["data"].reshape(2, 1, 28, 28)
    lenet.forward(data=digits(2, seed=4))
    full = {name: blob.data.copy() for name, blob in lenet.blobs.items()}
    lenet.blobs["ip1"].data[...] = 0
    lenet.forward(start="relu1")  # Caffe's ForwardFromTo: relu1..end, reading ip1 as it is now
    assert np.all(lenet.blobs["prob"].data == lenet.blobs["prob"].data[0:1])  # constant input -> same rows
    lenet.forward(end="pool2")
    lenet.forward(start="ip1")
    for name in ("pool2", "ip1", "ip2", "prob"):
        np.testing.assert_allclose(lenet.blobs[name].data, full[name], rtol=1e-6, atol=1e-7)
    out = lenet.forward(end="conv2", blobs=["pool1"])
    assert set(out) == {"conv2", "pool1"}


def test_intermediate_blobs_read_later_are_those_of_the_pass_that_made_them():
    """A forward computes only its outputs; an intermediate blob read afterwards is recomputed from what that
    pass saw, even when the input and the weights were changed in place since."""
    net = caffejax.Net(str(LENET), str(LENET_WEIGHTS), caffejax.TEST)
    net.blobs["data"].reshape(2, 1, 28, 28)
    x = digits(2, seed=6)
    net.blobs["data"].data[...] = x
    w = net.params["conv1"][0].data  # a host copy, handed out before the pass
    net.forward()
    net.blobs["data"].data[...] = 0
    w[...] = 0
    expected = caffejax.Net(str(LENET), str(LENET_WEIGHTS), caffejax.TEST)
    expected.blobs["data"].reshape(2, 1, 28, 28)
    expected.forward(data=x)
    for name in ("conv1", "pool2", "ip1"):
        np.testing.assert_array_equal(net.blobs[name].data, expected.blobs[name].data)
    now = net.forward()["prob"]  # the next pass sees the zeros: equal rows, unlike before
    np.testing.assert_array_equal(now[0], now[1])
    assert not np.allclose(now, expected.blobs["prob"].data)


def test_param_surgery_takes_effect(lenet):
    lenet.blobs["data"].reshape(1, 1, 28, 28)
    x = digits(1, seed=5)
    before = lenet.forward(data=x)["prob"].copy()
    w = lenet.params["ip2"][0].data
    saved = w.copy()
    w[...] = 0
    lenet.params["ip2"][1].data[...] = np.arange(10, dtype=np.float32)
    after = lenet.forward(data=x)["prob"]
    expected = np.exp(np.arange(10)) / np.exp(np.arange(10)).sum()
    np.testing.assert_allclose(after[0], expected, rtol=1e-5)
    w[...] = saved
    lenet.copy_from(str(LENET_WEIGHTS))
    np.testing.assert_allclose(lenet.forward(data=x)["prob"], before, rtol=1e-6)


def test_save_round_trip_is_exact(lenet, tmp_path):
    path = tmp_path / "lenet.caffemodel"
    lenet.save(str(path))
    again = caffejax.Net(str(LENET), str(path), caffejax.TEST)
    for name, blobs in lenet.params.items():
        for a, b in zip(blobs, again.params[name]):
            np.testing.assert_array_equal(a.data, b.data)
    # The file is an ordinary V2 NetParameter with blobs, as BVLC Caffe writes and reads them.
    proto = caffe_pb2.NetParameter.FromString(path.read_bytes())
    assert [layer.name for layer in proto.layer if layer.blobs] == list(lenet.params)
    assert not proto.layers
    assert list(proto.layer[1].blobs[0].shape.dim) == list(lenet.params["conv1"][0].shape)


def test_hdf5_round_trip(lenet, tmp_path):
    pytest.importorskip("h5py")
    path = tmp_path / "lenet.caffemodel.h5"
    lenet.save_hdf5(str(path))
    again = caffejax.Net(str(LENET), caffejax.TEST)
    again.load_hdf5(str(path))
    for name, blobs in lenet.params.items():
        for a, b in zip(blobs, again.params[name]):
            np.testing.assert_array_equal(a.data, b.data)
    import h5py

    with h5py.File(path, "r") as f:  # Net::ToHDF5 makes a group for every layer, empty where it has no blobs
        assert list(f) == ["data"] and set(f["data"]) == set(lenet._layer_names)
        assert len(f["data/pool1"]) == 0 and sorted(f["data/conv1"]) == ["0", "1"]


def test_copy_from_shape_mismatch_names_layer_and_shapes(tmp_path):
    text = LENET.read_text().replace("num_output: 500", "num_output: 400")
    net = caffejax.Net(text, caffejax.TEST)
    before = {name: [np.array(b.data) for b in blobs] for name, blobs in net.params.items()}
    with pytest.raises(caffejax.WeightsError) as err:
        net.copy_from(str(LENET_WEIGHTS))
    message = str(err.value)
    assert "'ip1'" in message and "(500, 800)" in message and "(400, 800)" in message
    # Nothing was installed, not even conv1's and conv2's, which come before ip1 and fit.
    for name, blobs in net.params.items():
        for old, blob in zip(before[name], blobs):
            np.testing.assert_array_equal(blob.data, old)


def test_copy_from_installs_every_blob_as_a_device_array(lenet):
    net = caffejax.Net(str(LENET), caffejax.TEST)
    net.copy_from(str(LENET_WEIGHTS))
    for name, blobs in net.params.items():
        for mine, theirs in zip(blobs, lenet.params[name]):
            assert isinstance(mine._data.value(), jax.Array)
            np.testing.assert_array_equal(mine.data, theirs.data)


def test_share_with_uses_the_other_nets_weights():
    a = caffejax.Net(str(LENET), str(LENET_WEIGHTS), caffejax.TEST)
    b = caffejax.Net(str(LENET), caffejax.TEST)
    b.share_with(a)
    a.params["ip2"][1].data[...] = 7.0
    np.testing.assert_array_equal(b.params["ip2"][1].data, 7.0)
    x = digits(64, seed=6)
    np.testing.assert_array_equal(a.forward(data=x)["prob"], b.forward(data=x)["prob"])


def test_outputs_are_finite_at_batch_1_and_4_for_bundled_models():
    for name in ("det1", "det2", "det3", "det4"):
        net = caffejax.Net(str(BUNDLED / "mtcnn" / f"{name}.prototxt"),
                           str(BUNDLED / "mtcnn" / f"{name}.caffemodel"), caffejax.TEST)
        for batch in (1, 4):
            shape = (batch,) + net.blobs["data"].shape[1:]
            net.blobs["data"].reshape(*shape)
            out = net.forward(data=np.random.default_rng(batch).standard_normal(shape).astype(np.float32))
            for top, value in out.items():
                assert value.shape[0] == batch and np.isfinite(value).all(), (name, top)


@pytest.mark.parametrize("prototxt", [REFERENCE / "layers" / f"{name}.prototxt"
                                      for name in ("conv_depthwise", "pool_global_max", "im2col", "spp")]
                         + [BUNDLED / "mtcnn" / "det2.prototxt", LENET], ids=lambda path: path.stem)
def test_a_batch_of_no_images_runs_as_caffes_loops_over_none(prototxt):
    """Caffe runs a net whose inputs have num 0 (an MTCNN cascade whose first stage found no face): each loop
    over the batch runs zero times, so every top is empty and every parameter's gradient zero. The depthwise
    filter gradient summed by blocks of rows, the global max pooling, Im2col and SPP each raised on it."""
    net = caffejax.Net(str(prototxt), caffejax.TEST)
    for name in net.inputs:
        net.blobs[name].reshape(0, *net.blobs[name].shape[1:])
    out = net.forward()
    assert set(out) == set(net.outputs)
    for name, value in out.items():
        assert value.shape == net.graph.blob_shape(name) and value.shape[0] == 0, name
    for name in net.outputs:
        net.blobs[name].diff[...] = 1.0
    net.backward()
    for name, blobs in net.params.items():
        for i, blob in enumerate(blobs):
            assert blob.diff.shape == blob.data.shape and not blob.diff.any(), (name, i)


def test_a_blob_the_host_cannot_allocate_is_an_out_of_memory_error_naming_its_shape(monkeypatch):
    """A mistyped dim (2147483647 where 2 was meant) made numpy's bare MemoryError; the net still runs after."""
    allocate = np.zeros

    def zeros(shape, *args, **kwargs):  # this host has no room for arrays over a million elements
        if np.prod(shape, dtype=np.int64) > 10 ** 6:
            raise MemoryError("Unable to allocate")
        return allocate(shape, *args, **kwargs)

    monkeypatch.setattr(np, "zeros", zeros)
    text = ('layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 1000000 dim: 3 } } }\n'
            'layer { name: "r" type: "ReLU" bottom: "x" top: "y" %s}')
    with pytest.raises(caffejax.OutOfMemoryError, match=r"blob 'y' \(the loss top of layer 'r'\): an array of "
                                                        r"shape \(1000000, 3\) \(float32\) needs 0.0112 GiB"):
        caffejax.Net(text % "loss_weight: 1 ", caffejax.TEST)
    net = caffejax.Net(text % "", caffejax.TEST)
    with pytest.raises(caffejax.OutOfMemoryError, match=r"shape \(1000000, 3\) .* is a dim mistyped\?"):
        net.forward()  # the unfed input's zeros
    net.blobs["x"].reshape(2, 3)
    np.testing.assert_array_equal(net.forward(x=-np.ones((2, 3), np.float32))["y"], 0)


def test_weights_the_host_cannot_fill_are_an_out_of_memory_error_naming_the_layer(monkeypatch):
    """A mistyped input dim (100000000 channels) made the fillers' float64 draw fail with numpy's bare
    MemoryError out of Net() (found by fuzzing)."""
    from caffejax.lower import fillers

    draw = fillers._rng_gaussian

    def gaussian(name, shape, *args):  # this host has no room for arrays over a million elements
        if np.prod(shape, dtype=np.int64) > 10 ** 6:
            raise MemoryError("Unable to allocate")
        return draw(name, shape, *args)

    monkeypatch.setattr(fillers, "_rng_gaussian", gaussian)
    text = ('layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 1 dim: 300000 dim: 3 dim: 3 } } }\n'
            'layer { name: "c" type: "Convolution" bottom: "x" top: "y" convolution_param { num_output: 4 '
            'kernel_size: 3 weight_filler { type: "gaussian" } } }\n')
    with pytest.raises(caffejax.OutOfMemoryError, match=r"^<string>:2: layer 'c' \(type Convolution\): its "
                                                        r"learnable blobs \(4, 300000, 3, 3\), \(4,\) do not fit"):
        caffejax.Net(text, caffejax.TEST)


_DEVICE_OUT_OF_MEMORY = """
import resource, sys
import numpy as np
import caffejax

text = ('layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 1 dim: 1 } } }'
        'layer { name: "t" type: "Tile" bottom: "x" top: "y" tile_param { axis: 1 tiles: 2000000000 } }')
net = caffejax.Net(text, caffejax.TEST)
infer = caffejax.compile_inference(net)
small = caffejax.Net(text.replace("2000000000", "3"), caffejax.TEST)
small.forward(x=np.ones((1, 1), np.float32))
# From here on the process may map 2 GiB more than it has, and the 8 GB top does not fit.
mapped = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize:")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (mapped + (2 << 30), resource.RLIM_INFINITY))
for run in (lambda: net.forward(x=np.ones((1, 1), np.float32)), lambda: infer({"x": np.ones((1, 1), np.float32)})):
    try:
        run()
        print("ran")
    except caffejax.OutOfMemoryError as e:
        print(type(e).__name__, e)
print(small.forward(x=np.ones((1, 1), np.float32))["y"].tolist())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS limits mappings on Linux")
def test_a_program_the_device_cannot_hold_is_an_out_of_memory_error_naming_the_biggest_blobs():
    """XLA's RESOURCE_EXHAUSTED came out of forward() as a JaxRuntimeError (a mutated prototxt's 65536 channels);
    Net's and compile_inference's programs now raise OutOfMemoryError, and the process runs on."""
    done = subprocess.run([sys.executable, "-c", _DEVICE_OUT_OF_MEMORY], capture_output=True, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 3, done.stdout
    for line in lines[:2]:
        assert line.startswith("OutOfMemoryError the net: a compiled program needs more memory than the device "
                               "has (RESOURCE_EXHAUSTED: "), line
        assert line.endswith("its biggest blobs: 'y' (1, 2000000000) (7.45 GiB in float32). Is a dim mistyped, "
                             "or the batch too big?"), line
    assert lines[2] == "[[1.0, 1.0, 1.0]]"


def test_dropout_train_is_random_per_pass_and_test_is_identity():
    text = """
    layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 4 dim: 100 } } }
    layer { name: "drop" type: "Dropout" bottom: "x" top: "y" dropout_param { dropout_ratio: 0.5 } }
    """
    x = np.ones((4, 100), np.float32)
    train = caffejax.Net(text, caffejax.TRAIN)
    a = train.forward(x=x)["y"].copy()
    b = train.forward(x=x)["y"].copy()
    assert set(np.unique(a)) <= {0.0, 2.0} and not np.array_equal(a, b)
    np.testing.assert_array_equal(caffejax.Net(text, caffejax.TEST).forward(x=x)["y"], x)


def test_pass_keys_are_the_seeds_key_with_the_pass_count_folded_in():
    """Each pass draws from fold_in(key(seed), pass count) with the seed of that moment, as before the seed's
    key was kept between passes (it is made once per seed now, and the fold is one compiled call)."""
    import jax
    from caffejax.runtime import mode

    net = caffejax.Net(str(LENET), caffejax.TEST)
    saved, keys = mode.random_seed(), []
    try:
        for seed in (7, 7, 8, 7):
            caffejax.set_random_seed(seed)
            key = jax.random.key_data(net._next_key())
            want = jax.random.key_data(jax.random.fold_in(jax.random.key(seed), net._pass_count))
            np.testing.assert_array_equal(key, want)
            keys.append(np.asarray(key))
    finally:
        caffejax.set_random_seed(saved)
    assert len({k.tobytes() for k in keys}) == 4


def test_backward_seeds_loss_weight_and_accumulates_param_diffs():
    case = layer_case("inner_product")
    net = case.make_net()
    case.feed(net)
    net.forward()
    top = [b for b in case.keys("topdiff/")][0]
    net.blobs[top].diff[...] = case.figures["topdiff/" + top]
    net.backward()
    first = net.params["l"][0].diff.copy()
    net.backward()
    np.testing.assert_allclose(net.params["l"][0].diff, 2 * first, rtol=1e-6)  # Caffe accumulates
    net.clear_param_diffs()
    assert not net.params["l"][0].diff.any()


def test_backward_makes_the_other_blobs_diffs_when_read():
    """Net.backward hands back the parameters' diffs and the inputs' (and requested) blobs' diffs; every other
    blob's diff is made on its first read, by one more pass over the same weights, inputs and top diffs: the
    values the pass would have written out (in-place ReLU's blob holding its bottom's diff, as Caffe's does)."""
    from caffejax.frontend.prototxt import parse_net_text

    param = parse_net_text(str(LENET))
    param.force_backward = True
    x = digits(2, seed=5)
    seed = np.random.default_rng(6).random((2, 10), dtype=np.float32)

    def passed(net, returned=None):
        net.blobs["data"].reshape(*x.shape)
        net.forward(data=x)
        net.blobs["prob"].diff[...] = seed
        if returned is None:
            return net.backward()
        last = len(net.layers) - 1
        return net._backward(last, 0, returned=returned)

    net = caffejax.Net(param, str(LENET_WEIGHTS), caffejax.TEST)
    outputs = passed(net)
    assert list(outputs) == ["data"] and np.abs(outputs["data"]).max() > 0
    assert net.compile_count == 3 and net.blobs["ip1"]._diff._pending is not None  # forward, preparation, backward
    diff_of_data, diff_of_w = outputs["data"].copy(), net.params["conv1"][0].diff.copy()
    net.blobs["prob"].diff[...] = 0  # the pass's own top diffs make the others, not the blob's later ones
    written = caffejax.Net(param, str(LENET_WEIGHTS), caffejax.TEST)
    passed(written, returned=set(written.blobs))  # every diff written out by the pass itself
    assert all(blob._diff._pending is None for blob in written.blobs.values())
    for name in ("conv1", "pool1", "conv2", "pool2", "ip1", "ip2"):
        np.testing.assert_allclose(net.blobs[name].diff, written.blobs[name].diff, rtol=1e-6, atol=1e-9,
                                   err_msg=name)
    assert net.compile_count == 4  # all made by one program, the first read
    # Only the input's diff asked for, the pass runs the channels-last kernels; every diff, Caffe's layout. The
    # two programs sum in different orders: they agree to a few units in the last place of the largest diff.
    for got, want in [(written.blobs["data"].diff, diff_of_data), (written.params["conv1"][0].diff, diff_of_w)]:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    # ReLU runs in place: its blob holds the diff of ReLU's bottom, zero wherever ReLU's output is.
    ip1, relu_out = net.blobs["ip1"].diff, net.blobs["ip1"].data
    assert np.any(relu_out == 0) and not np.any(ip1[relu_out == 0]) and np.any(ip1[relu_out > 0])
    passed(net)  # a new pass supersedes the diffs not yet read
    assert net.blobs["conv2"]._diff._pending is not None
    np.testing.assert_allclose(net.blobs["conv2"].diff, written.blobs["conv2"].diff, rtol=1e-6, atol=1e-9)
    # From the ReLU run in place on ip1 (deep dream's loop): the blob it seeds from and then writes is made at
    # once, so writing the next pass's seed into it does not first run the pass again.
    net.forward(data=x)
    net.blobs["ip1"].diff[...] = 1.0
    net.backward(start="relu1")
    assert net.blobs["ip1"]._diff._pending is None and net.blobs["conv2"]._diff._pending is not None
    assert not np.any(net.blobs["ip1"].diff[net.blobs["ip1"].data == 0])


def test_a_backward_after_resizing_an_input_runs_at_the_new_shapes():
    """Resizing a fed blob re-infers the shapes on the next pass, a backward as well as a forward: a backward
    right after the resize ran the program of the old shapes on the new input (a bare TypeError from inside JAX;
    found by fuzzing sequences of Net calls). It runs as after net.reshape(): the new shapes, the tops' diffs
    zero but the loss weight's."""
    from caffejax.frontend.prototxt import parse_net_text

    param = parse_net_text(str(LENET))
    param.force_backward = True
    net = caffejax.Net(param, str(LENET_WEIGHTS), caffejax.TEST)
    net.blobs["data"].reshape(2, 1, 28, 28)
    net.forward(data=digits(2))
    net.blobs["prob"].diff[...] = 1.0
    net.blobs["data"].reshape(3, 1, 28, 28)
    net.blobs["data"].data[...] = digits(3, seed=1)
    diffs = net.backward()
    assert diffs["data"].shape == (3, 1, 28, 28) and net.blobs["prob"].diff.shape == (3, 10)
    assert not diffs["data"].any()  # zero seeds
    net.blobs["prob"].diff[...] = np.random.default_rng(2).random((3, 10), dtype=np.float32)
    twin = caffejax.Net(param, str(LENET_WEIGHTS), caffejax.TEST)
    twin.blobs["data"].reshape(3, 1, 28, 28)
    twin.forward(data=digits(3, seed=1))
    twin.blobs["prob"].diff[...] = net.blobs["prob"].diff
    np.testing.assert_allclose(net.backward()["data"], twin.backward()["data"], rtol=1e-6, atol=1e-9)


def test_a_net_whose_data_source_is_missing_says_so_and_can_be_fed_by_hand():
    """BVLC's lenet_train_test.prototxt without its LMDB: the net builds with the shapes below the Data layer
    unknown (Caffe would not build it). Weights for those layers, or a pass over them, raise the Data layer's
    DataSourceUnavailable naming the layer that needed the shapes; they were a WeightsError ("0 blobs in the
    net"), and a forward from conv1 a ShapeError about a 0-D blob. Fed by hand (the tops reshaped), the net
    makes and fills the learnable blobs it could not before (a KeyError then), takes the weights, and computes
    what the deploy net computes."""
    from conftest import MODELS

    train_test = MODELS / "bvlc/examples/mnist/lenet_train_test.prototxt"
    with pytest.raises(caffejax.DataSourceUnavailable, match=r"layer 'mnist' \(type Data\): LMDB source .* not "
                       r"found .*; so the shapes of layer 'conv1' are unknown and it cannot take its weights from "
                       r".*lenet_iter_10000.caffemodel\. .* before copy_from"):
        caffejax.Net(str(train_test), str(LENET_WEIGHTS), caffejax.TEST)
    net = caffejax.Net(str(train_test), caffejax.TEST)
    assert list(net.params) == [] and net.blobs["conv1"].shape == ()
    for start in ("conv1", "ip2"):
        with pytest.raises(caffejax.DataSourceUnavailable, match=f"the shapes of layer '{start}' are unknown and it "
                                                                 "cannot run"):
            net.forward(start=start)
    with pytest.raises(caffejax.DataSourceUnavailable, match="^layer 'mnist' .* not found"):
        net.forward()  # the Data layer itself
    net.blobs["data"].reshape(2, 1, 28, 28)
    net.blobs["label"].reshape(2)
    net.reshape()
    assert list(net.params) == ["conv1", "conv2", "ip1", "ip2"] and net.params["conv1"][0].data.std() > 0
    assert [layer.name for layer in net.layers if layer.blobs] == ["conv1", "conv2", "ip1", "ip2"]
    net.copy_from(str(LENET_WEIGHTS))
    x = digits(2, seed=3)
    net.blobs["data"].data[...] = x
    net.blobs["label"].data[...] = [1, 2]
    net.forward(start="conv1")
    deploy = caffejax.Net(str(LENET), str(LENET_WEIGHTS), caffejax.TEST)
    deploy.blobs["data"].reshape(2, 1, 28, 28)
    np.testing.assert_allclose(net.blobs["ip2"].data, deploy.forward(data=x, blobs=["ip2"])["ip2"], rtol=1e-5,
                               atol=1e-6)


def test_forward_all_runs_items_in_batches_and_refuses_a_batch_of_none(lenet):
    """pycaffe's forward_all: 5 items through a batch of 2, the last batch zero-padded, 5 rows back. A net whose
    batch is 0 has no batch to run them in: a ShapeError (pycaffe's range() raised a bare ValueError; found by
    fuzzing)."""
    x, shape = digits(5, seed=9), lenet.blobs["data"].shape
    lenet.blobs["data"].reshape(2, 1, 28, 28)
    probs = lenet.forward_all(data=x)["prob"]
    lenet.blobs["data"].reshape(5, 1, 28, 28)
    np.testing.assert_allclose(probs, lenet.forward(data=x)["prob"], rtol=1e-5, atol=1e-7)
    lenet.blobs["data"].reshape(0, 1, 28, 28)
    for run in (lambda: lenet.forward_all(data=x), lambda: lenet.forward_backward_all(data=x)):
        with pytest.raises(caffejax.ShapeError, match=r"5 items in batches .* 'data' is \(0, 1, 28, 28\), no batch"):
            run()
    lenet.blobs["data"].reshape(*shape)


def test_a_backward_reads_the_input_a_layer_in_place_overwrote():
    """A layer in place on a fed blob (a Power on "data") leaves its output in the blob; the backward's
    recompute read that as the input, transforming it twice (InnerProduct's filter gradient from 2(2x+1)+1
    instead of 2x+1; found by fuzzing sequences of Net calls). It reads what the forward read, as Caffe's
    backward computes from the forward it follows."""
    net = caffejax.Net("""name: "p"
force_backward: true
layer { name: "in" type: "Input" top: "data" input_param { shape { dim: 2 dim: 4 } } }
layer { name: "pre" type: "Power" bottom: "data" top: "data" power_param { scale: 2 shift: 1 } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 1 } } }""", caffejax.TEST)
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    net.forward(data=x)
    np.testing.assert_allclose(net.blobs["data"].data, 2 * x + 1, rtol=1e-6)
    net.blobs["ip"].diff[...] = 1.0
    diffs = net.backward()
    np.testing.assert_allclose(net.params["ip"][0].diff, np.tile((2 * x + 1).sum(0), (3, 1)), rtol=1e-5)
    # Caffe's in-place Power (power 1) sets the shared diff to its scale, 2, then multiplies it by itself.
    np.testing.assert_array_equal(diffs["data"], np.full((2, 4), 4.0, np.float32))



IN_PLACE_CHAIN = """name: "chain"
layer { name: "in" type: "Input" top: "data" top: "target"
  input_param { shape { dim: 3 dim: 2 dim: 2 dim: 2 } shape { dim: 3 dim: 2 } } }
layer { name: "square" type: "Power" bottom: "data" top: "sq" power_param { power: 2 shift: 0.5 } }
layer { name: "scale" type: "Scale" bottom: "sq" top: "sq" scale_param { filler { type: "gaussian" } } }
layer { name: "ip" type: "InnerProduct" bottom: "sq" top: "ip"
  inner_product_param { num_output: 2 weight_filler { type: "gaussian" } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "ip" bottom: "target" top: "loss" }"""


def test_a_backward_range_from_inside_an_in_place_chain_reads_the_chains_input():
    """backward(end="scale"), a Scale in place on the Power's top: the range reads the Scale's input, which the
    Scale overwrote in the blob. The recompute read the blob, so it scaled twice: the loss's diff, the
    InnerProduct's and the Scale's gradients all came out wrong (found by fuzzing nets of pycaffe Python
    layers against native twins). Caffe's Scale keeps a copy of its bottom: the range's gradients are the
    whole backward's. After forward(start="scale") the Scale read the blob's old data, which it keeps too."""
    net = caffejax.Net(IN_PLACE_CHAIN, caffejax.TRAIN)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 2, 2, 2)).astype(np.float32)
    net.blobs["data"].data[...] = x
    net.blobs["target"].data[...] = rng.standard_normal((3, 2))
    net.forward()
    net.backward()
    whole = {name: [p.diff.copy() for p in net.params[name]] for name in ("scale", "ip")}
    loss_diff = net.blobs["ip"].diff.copy()
    np.testing.assert_allclose(loss_diff, (net.blobs["ip"].data - net.blobs["target"].data) / 3, rtol=1e-5)
    net.clear_param_diffs()
    net.backward(end="scale")
    np.testing.assert_allclose(net.blobs["ip"].diff, loss_diff, rtol=1e-6)
    for name, diffs in whole.items():
        for got, want in zip(net.params[name], diffs):
            np.testing.assert_allclose(got.diff, want, rtol=1e-5, atol=1e-7)

    # forward(start="scale") scales the blob's data (the last Scale output) again, as Caffe's does.
    s, w = net.params["scale"][0].data.copy(), net.params["ip"][0].data.copy()
    read = s[:, None, None] * (x + 0.5) ** 2
    net.forward(start="scale")
    np.testing.assert_allclose(net.blobs["sq"].data, s[:, None, None] * read, rtol=1e-5)
    net.clear_param_diffs()
    net.backward(end="scale")
    ip_diff = (net.blobs["ip"].data - net.blobs["target"].data) / 3
    np.testing.assert_allclose(net.blobs["ip"].diff, ip_diff, rtol=1e-5)
    sq_diff = (ip_diff @ w).reshape(x.shape)
    np.testing.assert_allclose(net.params["scale"][0].diff, (sq_diff * read).sum(axis=(0, 2, 3)), rtol=1e-4)

def test_a_backward_asked_for_no_inner_diff_runs_the_channels_last_kernels():
    """program.forward_backward runs the kernels (LeNet's convolutions channels-last) when the diffs it must
    make are the inputs' or none, and Caffe's layout when one is inside the range (a perturbed value must be
    in Caffe's layout); the gradients agree."""
    from caffejax.frontend.prototxt import parse_net_text

    param = parse_net_text(str(LENET))
    param.force_backward = True
    net = caffejax.Net(param, str(LENET_WEIGHTS), caffejax.TEST)
    net.blobs["data"].reshape(2, 1, 28, 28)
    net.reshape()
    graph, program = net.graph, net._program
    data, inner = graph.fed["data"], graph.layer("conv1").top_values[0]
    inputs = {data: digits(2, seed=4)}
    seeds = {graph.layer("prob").top_values[0]: np.ones((2, 10), np.float32)}

    def layouts(diff_values):
        jaxpr = jax.make_jaxpr(lambda p: program.forward_backward(p, inputs, seeds, diff_values=diff_values))(
            net.param_arrays())
        return {str(e.params["dimension_numbers"].lhs_spec) for e in jaxpr.eqns
                if e.primitive.name == "conv_general_dilated"}

    nhwc, nchw = "(0, 3, 1, 2)", "(0, 1, 2, 3)"  # the forward convolutions' input layouts
    assert nhwc in layouts(()) and layouts(()) == layouts((data,)) and nchw not in layouts(())
    assert nchw in layouts((data, inner)) and nhwc not in layouts((data, inner))
    def forward_backward(diff_values):  # jitted: run eagerly, each pass takes 5-10 s
        return jax.jit(lambda p: program.forward_backward(p, inputs, seeds, diff_values=diff_values))(
            net.param_arrays())

    _, _, fast_grads, fast = forward_backward((data,))
    _, _, caffe_grads, caffe = forward_backward((data, inner))
    np.testing.assert_allclose(fast[data], caffe[data], rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(fast_grads["conv1"][0], caffe_grads["conv1"][0], rtol=1e-5, atol=1e-7)


def test_shape_errors_after_a_reshape_name_the_file_and_line(tmp_path):
    path = tmp_path / "small.prototxt"
    path.write_text('name: "t"\ninput: "data"\ninput_shape { dim: 1 dim: 3 dim: 8 dim: 8 }\n'
                    'layer {\n  name: "conv"\n  type: "Convolution"\n  bottom: "data"\n  top: "conv"\n'
                    '  convolution_param { num_output: 4 kernel_size: 5 }\n}\n')
    net = caffejax.Net(str(path), caffejax.TEST)
    net.blobs["data"].reshape(1, 3, 3, 3)
    with pytest.raises(caffejax.ShapeError, match=f"^{path}:4: layer 'conv' \\(type Convolution\\): kernel extent"):
        net.reshape()
    net = caffejax.Net(str(path), caffejax.TEST)
    with pytest.raises(caffejax.ShapeError, match=r"input 'data' has shape \(1, 3, 3, 3\); the net expects "
                                                  r"\(1, 3, 8, 8\)"):
        net.forward(data=np.ones((1, 3, 3, 3), np.float32))
    assert net.forward(data=np.ones((1, 3, 1, 1), np.float32))["conv"].shape == (1, 4, 4, 4)  # broadcasts
    # Weights that no longer fit a reshaped bottom fail as the pass's program is first traced: located too.
    lenet = caffejax.Net(str(LENET), str(LENET_WEIGHTS), caffejax.TEST)
    lenet.blobs["data"].reshape(1, 1, 32, 32)
    line = LENET.read_text().split("\n").index('  name: "ip1"')  # 1-based: the "layer {" line above
    with pytest.raises(caffejax.ShapeError, match=f"^{LENET}:{line}: layer 'ip1' \\(type InnerProduct\\): input "
                                                  r"size incompatible .* bottom \(1, 50, 5, 5\) has K = 1250"):
        lenet.forward()


def test_a_new_value_fills_a_held_host_copy_and_replaces_one_nobody_holds():
    """A host array handed out and still held (or a view of it) sees later values, as pycaffe's views onto
    Caffe's memory do; one dropped by everybody is not kept in step with the device, whose value stays there."""
    from caffejax.runtime.blob import ArraySlot

    slot = ArraySlot((2, 3))
    held = slot.host()
    slot.set(jax.numpy.full((2, 3), 2.0))
    assert slot.on_host() and slot.host() is held
    np.testing.assert_array_equal(held, 2.0)
    row = held[1]  # a view holds its base array too
    del held
    slot.set(jax.numpy.full((2, 3), 3.0))
    assert slot.on_host()
    np.testing.assert_array_equal(row, 3.0)
    del row
    new = jax.numpy.full((2, 3), 4.0)
    slot.set(new)
    assert not slot.on_host() and slot.value() is new
    np.testing.assert_array_equal(slot.host(), 4.0)


SPLIT_FORWARD_NET = """force_backward: true
layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 4 dim: 6 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "x" top: "ip1"
  inner_product_param { num_output: 8 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "drop" type: "Dropout" bottom: "ip1" top: "drop" }
layer { name: "ip2" type: "InnerProduct" bottom: "drop" top: "ip2"
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "Reduction" bottom: "ip2" top: "loss" reduction_param { operation: SUMSQ } loss_weight: 1 }
"""


def test_a_backward_over_a_forward_run_in_parts_takes_each_parts_key_and_blobs():
    """pycaffe's forward(end=...), then forward(start=...) on what the blobs hold (written in between), then one
    backward(): Caffe's backward reads each layer's blobs and Dropout masks as its forward left them. The backward
    runs in the same parts: each with its forward's key (the Dropout's mask of the first part, not the second
    part's), and the later part from the blobs (the write in between counts)."""
    net = caffejax.Net(SPLIT_FORWARD_NET, caffejax.TRAIN)
    x = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    net.forward(x=x, end="drop")
    net.blobs["drop"].data[...] *= 2  # net surgery between the parts: the second part reads it
    net.forward(start="ip2")
    drop, ip2 = np.array(net.blobs["drop"].data), np.array(net.blobs["ip2"].data)
    (w1, _), (w2, b2) = ([np.array(b.data) for b in net.params[name]] for name in ("ip1", "ip2"))
    np.testing.assert_allclose(ip2, drop @ w2.T + b2, rtol=1e-5, atol=1e-6)
    kept = drop != 0
    assert 0 < kept.mean() < 1
    net.backward()
    d_ip2 = 2 * ip2  # SUMSQ
    d_drop = d_ip2 @ w2
    np.testing.assert_allclose(net.blobs["drop"].diff, d_drop, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(net.params["ip2"][0].diff, d_ip2.T @ drop, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(net.blobs["x"].diff, (d_drop * kept * 2.0) @ w1, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("on_device", [False, True])
def test_a_held_host_array_is_handed_to_programs_as_one_copy_while_its_bits_stay(monkeypatch, on_device):
    """A held host array is handed to a program as a private copy (the user may write to it while the program
    runs), on the device when it is big; while its bits stay as they were, the same copy again, so that weights
    the user holds are not copied (to the device) on every pass, and a backward finds its forward's inputs
    unchanged. Any changed bit makes a new copy: a NaN is the same NaN, -0.0 is not 0.0. A new device value
    copied into the held array (a solver's new weights) is handed as it is."""
    import caffejax.runtime.blob as blob_module
    from caffejax.runtime.blob import ArraySlot, same_bits

    if on_device:
        monkeypatch.setattr(blob_module, "HANDED_ON_DEVICE_MIN_BYTES", 24)  # this slot's size
    slot = ArraySlot((2, 3))
    held = slot.host()
    held[...] = 1.0
    first = slot.value()
    assert isinstance(first, jax.Array if on_device else np.ndarray) and first is not held
    assert slot.value() is first
    held[...] = 7.0  # the copy handed is the program's own
    np.testing.assert_array_equal(first, 1.0)
    assert slot.value() is not first
    held[...] = 1.0
    held[0, 0] = np.nan
    nan = slot.value()
    assert nan is not first and np.isnan(nan[0, 0]) and slot.value() is nan
    held[0, 1] = 0.0
    zero = slot.value()
    held[0, 1] = -0.0
    assert slot.value() is not zero and np.signbit(slot.value()[0, 1])
    before = slot.value()
    new = jax.numpy.full((2, 3), 5.0, np.float32)  # the slot's dtype, under JAX_ENABLE_X64 too
    slot.set(new)  # copied into the held array, and handed itself
    assert slot.value() is new
    np.testing.assert_array_equal(held, 5.0)
    jax.jit(lambda x: x + 1, donate_argnums=0)(new)  # a program used up its buffer: a new copy is handed
    assert new.is_deleted() and slot.value() is not new
    np.testing.assert_array_equal(slot.value(), 5.0)
    held[1, 2] = 6.0
    assert slot.value()[1, 2] == 6.0
    slot.set(np.full((2, 3), 8.0, np.float32))  # a host value: copied in, and handed as a new copy
    assert isinstance(slot.value(), jax.Array if on_device else np.ndarray) and slot.value() is not before
    np.testing.assert_array_equal(slot.value(), 8.0)
    a = np.arange(10, dtype=np.float32)
    b = a.copy()
    assert same_bits(a, b, chunk=4)
    b[9] = 0  # in the last chunk
    assert not same_bits(a, b, chunk=4) and not same_bits(a, a[:9], chunk=4)


def test_programs_of_big_nets_get_their_numpy_arguments_on_the_device_first(monkeypatch):
    """Given a NumPy argument, a program runs on an XLA worker thread, where glibc maps big buffers afresh on
    every call (MobileNet v2's forward + backward at batch 16: up to 400 thousand page faults): Net's programs
    for big graphs get device arrays; small ones (LeNet at batch 1) their arguments as they are."""
    import caffejax.runtime.net as net_module

    calls = []

    def recording(tree):
        moved = net_module.to_device.__wrapped__(tree)
        calls.append(all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(moved)))
        return moved

    recording.__wrapped__ = net_module.to_device
    monkeypatch.setattr(net_module, "to_device", recording)
    x = digits(1, seed=2)
    small = caffejax.Net(str(LENET), str(LENET_WEIGHTS), caffejax.TEST)
    small.blobs["data"].reshape(1, 1, 28, 28)
    expected = small.forward(data=x)["prob"].copy()
    assert calls == []
    monkeypatch.setattr(net_module, "DEVICE_ARGUMENTS_MIN_FLOPS", 0)
    big = caffejax.Net(str(LENET), str(LENET_WEIGHTS), caffejax.TEST)
    big.blobs["data"].reshape(1, 1, 28, 28)
    np.testing.assert_array_equal(big.forward(data=x)["prob"], expected)
    big.blobs["conv1"].data  # a deferred blob's recompute is another program
    assert calls == [True] * 3  # the weights' preparation, the forward, the recompute


def test_compiled_inference_with_big_buffers_gets_its_numpy_inputs_on_the_device_first(monkeypatch):
    """A compile_inference program whose scratch space a worker thread would map afresh on every call (MobileNet
    v2 at batch 16: 150 MB, 38 thousand page faults a call) is given its NumPy inputs on the device, in a call
    of their own, and so runs on the calling thread; a small one (LeNet) takes them as they are. Jax arrays
    pass as they are either way, and the outputs are the same."""
    import caffejax.runtime.inference as inference_module

    calls = []
    to_device = inference_module._inputs_to_device

    def recording(tree):
        calls.append([isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(tree)])
        return to_device(tree)

    monkeypatch.setattr(inference_module, "_inputs_to_device", recording)
    x = digits(2, seed=3)
    net = caffejax.Net(str(LENET), str(LENET_WEIGHTS), caffejax.TEST)
    expected = np.asarray(caffejax.compile_inference(net)({"data": x})["prob"])
    assert calls == []
    monkeypatch.setattr(inference_module, "_WORKER_HEAP_BYTES", 0)
    infer = caffejax.compile_inference(net)
    np.testing.assert_array_equal(infer({"data": x})["prob"], expected)
    np.testing.assert_array_equal(infer({"data": jax.numpy.asarray(x)})["prob"], expected)
    assert calls == [[False], [True]]


def test_compiled_inference_takes_a_data_layers_tops_as_inputs():
    """A net whose batch comes from a data layer (a train_val net) compiles for inference with that layer's tops
    as inputs: the caller gives the batch, at any size, and gets the net's forward on it. It raised a bare
    KeyError ('data') on the first call, the inputs listing only Input layers."""
    text = """
        layer { name: "mem" type: "MemoryData" top: "data" top: "label"
                memory_data_param { batch_size: 2 channels: 3 height: 1 width: 1 } }
        layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
                inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 1 } } }
        layer { name: "prob" type: "Softmax" bottom: "ip" top: "prob" }
    """
    from caffejax.frontend.prototxt import parse_net_text

    net = caffejax.Net(parse_net_text(text), caffejax.TEST)
    infer = caffejax.compile_inference(net)
    assert infer.inputs == ["data", "label"]
    x = np.random.default_rng(0).normal(size=(5, 3, 1, 1)).astype(np.float32)
    w, b = (np.asarray(blob.data, np.float64) for blob in net.params["ip"])
    z = x.reshape(5, 3) @ w.T + b
    expected = np.exp(z - z.max(1, keepdims=True))
    expected /= expected.sum(1, keepdims=True)
    np.testing.assert_allclose(infer({"data": x, "label": np.zeros(5, np.float32)})["prob"], expected, rtol=1e-5)


def test_unknown_blob_names_are_refused_before_the_pass(lenet, monkeypatch):
    """net.forward(blobs=[...]) and net.backward(diffs=[...]) with a name the net lacks: a GraphError naming it
    (and the net), before any pass runs. It was a bare KeyError ('nope') after the pass; it is still a KeyError,
    as pycaffe's was."""
    from caffejax.errors import UnknownBlobError

    monkeypatch.setattr(lenet, "_forward", lambda *a, **k: pytest.fail("ran a pass"))
    monkeypatch.setattr(lenet, "_backward", lambda *a, **k: pytest.fail("ran a pass"))
    for call, text in ((lambda: lenet.forward(blobs=["ip1", "nope"]), "forward(blobs=...): no blob named 'nope'"),
                       (lambda: lenet.backward(diffs=["nope", "ip9"]),
                        "backward(diffs=...): no blob named 'nope', 'ip9' in net 'LeNet'")):
        with pytest.raises(UnknownBlobError) as error:
            call()
        assert isinstance(error.value, (caffejax.GraphError, KeyError)) and text in str(error.value)


def test_weights_move_to_the_device_once_and_writes_through_data_still_count():
    """Weights filled or loaded as NumPy arrays, or read through .data and since let go, are the programs'
    device arrays after a forward: a forward used to copy every weight to the device on every call (AlexNet's
    Net.forward at batch 1: 523 -> 26 ms). A .data still held is read afresh at each forward, as pycaffe's
    shared memory behaves."""
    net = caffejax.Net(str(LENET), str(LENET_WEIGHTS), caffejax.TEST)
    net.blobs["data"].reshape(2, 1, 28, 28)
    x = digits(2)
    before = net.forward(data=x)["prob"].copy()
    assert all(isinstance(blob._data.value(), jax.Array) for blobs in net.params.values() for blob in blobs)
    weight = net.params["ip2"][0].data  # held: the next forward reads what is written here
    weight[...] = 0
    bias = net.params["ip2"][1].data
    want = np.exp(bias - bias.max()) / np.exp(bias - bias.max()).sum()
    np.testing.assert_allclose(net.forward(data=x)["prob"], np.broadcast_to(want, (2, 10)), rtol=1e-5)
    del weight, bias
    value = net.params["ip2"][0]._data.value()  # let go: the array as it is, no copy, no host copy kept
    assert isinstance(value, np.ndarray) and not value.any() and not net.params["ip2"][0]._data.on_host()
    net.copy_from(str(LENET_WEIGHTS))
    np.testing.assert_allclose(net.forward(data=x)["prob"], before, rtol=1e-6)


UNREAD_INPUT = '''input: "x" input_shape { dim: 2 dim: 3 } input: "unused" input_shape { dim: 2 dim: 5 }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y"
        inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 1 } } }
layer { name: "loss" type: "Reduction" bottom: "y" top: "loss" reduction_param { operation: SUMSQ } loss_weight: 1 }
'''


def test_a_fed_blob_no_layer_reads_keeps_its_data_and_shapes_no_program(tmp_path):
    """An input no layer reads is one of the net's outputs, as in Caffe, holding what was fed: after a forward,
    layer by layer, a backward, a solver's step and debug_nans' checks. A pass's program does not take it, so
    a new shape of it compiles nothing."""
    net = caffejax.Net(UNREAD_INPUT, caffejax.TRAIN)
    x = np.ones((2, 3), np.float32)
    out = net.forward(x=x, unused=np.full((2, 5), 3, np.float32))
    assert set(out) == {"loss", "unused"} and (out["unused"] == 3).all()
    net.backward()
    assert not net.blobs["unused"].diff.any()
    net.forward()
    net.backward()  # (now a backward follows each forward: the programs handing on the forward's pullback)
    compiled = net.compile_count
    net.blobs["unused"].reshape(4, 5)
    net.blobs["unused"].data[...] = 4
    net.forward()
    net.backward()
    assert net.compile_count == compiled and (net.blobs["unused"].data == 4).all()
    net.debug_nans = True
    net.after_forward(lambda i: None)
    net.blobs["unused"].data[...] = np.nan  # debug_nans checks the outputs: a NaN fed there is named
    with pytest.raises(caffejax.NumericalError, match="unused"):
        net.forward()
    (tmp_path / "net.prototxt").write_text(UNREAD_INPUT)
    (tmp_path / "solver.prototxt").write_text(f'net: "{tmp_path / "net.prototxt"}" base_lr: 0.01 lr_policy: "fixed" '
                                              'max_iter: 1 snapshot_after_train: false')
    solver = caffejax.SGDSolver(str(tmp_path / "solver.prototxt"))
    solver.net.blobs["unused"].data[...] = 7
    solver.net.blobs["x"].data[...] = 1
    solver.step(1)
    assert (solver.net.blobs["unused"].data == 7).all() and solver.net.blobs["y"].data.shape == (2, 2)


PULLBACK_NET = """force_backward: true
layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } } }
layer { name: "conv" type: "Convolution" bottom: "x" top: "conv"
  convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "drop" type: "Dropout" bottom: "conv" top: "conv" }
layer { name: "fc" type: "InnerProduct" bottom: "conv" top: "fc"
  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "Reduction" bottom: "fc" top: "loss" reduction_param { operation: SUMSQ } loss_weight: 1 }
"""


def test_a_backward_after_a_forward_runs_from_its_pullback(monkeypatch):
    """pycaffe's loop of net.forward() and net.backward(): once a backward followed a forward of the same layers,
    the next forward keeps its pullback and the backward runs from it, not running the forward again, with the
    same diffs (the same Dropout masks). A weight or an input written between the two makes the backward run the
    forward again on the new one, as before; forwards alone keep no pullback. Not with the program cache on
    (test_program_cache's backward test)."""
    monkeypatch.setattr(caffejax.runtime.net, "cache_directory", lambda: None)  # (with it, none is learnt)
    net, twin = caffejax.Net(PULLBACK_NET, caffejax.TRAIN), caffejax.Net(PULLBACK_NET, caffejax.TRAIN)
    twin._wants_pullback = lambda start, end: False
    for name in net.params:
        for mine, theirs in zip(twin.params[name], net.params[name]):
            mine.data[...] = theirs.data
    ran = []
    jitted = caffejax.Net._jitted
    monkeypatch.setattr(caffejax.Net, "_jitted", lambda self, kind, *args, **kwargs: (
        ran.append(kind) if self is net and not kind.endswith("-all") else None,  # (-all: deferred blobs')
        jitted(self, kind, *args, **kwargs))[1])
    rng = np.random.default_rng(3)

    def both(between=None):
        x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
        ran.clear()
        for each in (net, twin):
            each.forward(x=x)
            if between:
                between(each)
            each.backward()
        for name in ("conv", "fc"):
            np.testing.assert_allclose(net.params[name][0].diff, twin.params[name][0].diff, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(net.blobs["x"].diff, twin.blobs["x"].diff, rtol=1e-5, atol=1e-7)
        assert np.abs(net.blobs["x"].diff).max() > 0
        return list(ran)

    # The first backward learns that one follows a forward; that forward, keeping no pullback, read its weights
    # prepared apart.
    assert both() == ["forward", "prepare", "backward"]
    assert both() == ["forward-pullback", "backward-pullback"] == both()
    twice = lambda each: each.params["conv"][0].data.__imul__(2)  # noqa: E731
    assert both(twice) == ["forward-pullback", "backward"]  # the new weights
    other = lambda each: each.blobs["x"].data.__setitem__(Ellipsis, 1.0)  # noqa: E731
    assert both(other) == ["forward-pullback", "backward"]  # the new input, as the blob holds it now
    # Arrays the user holds (a notebook's `x = net.blobs["x"].data`) are handed to programs as one private copy
    # while their bits stay (ArraySlot.value), so the backward still knows its forward's inputs and weights.
    held = {each: (each.blobs["x"].data, each.params["fc"][0].data) for each in (net, twin)}
    assert both() == ["forward-pullback", "backward-pullback"] == both()
    assert both(lambda each: held[each][0].__imul__(2)) == ["forward-pullback", "backward"]
    assert both(lambda each: held[each][1].__imul__(0.5)) == ["forward-pullback", "backward"]
    del held
    net.forward(x=np.ones((2, 3, 8, 8), np.float32))
    net.forward(x=np.ones((2, 3, 8, 8), np.float32))  # forwards alone: the user stopped calling backward
    assert not net._pullbacks and not net._pullback_ranges
