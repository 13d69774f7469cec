"""compile_inference(batch_sizes=...): a few programs for every batch size, the batch padded with rows.

Padding is right only where every layer computes each row of the batch from the same row of its inputs alone
(``LayerRule.rows_apart``). The flags are checked here layer by layer: a layer declared so gives its first rows
the same values whatever rows follow them, and a layer whose settings mix rows is refused by name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import caffejax
from caffejax.errors import CaffejaxError, ShapeError, UnsupportedError
from caffejax.lower import forks
from caffejax.lower.registry import get_rule, register_layer
from caffejax.runtime.inference import rows_mixed
from conftest import BUNDLED, MODELS, input_layer

LENET = (str(BUNDLED / "lenet/lenet.prototxt"), str(BUNDLED / "lenet/lenet_iter_10000.caffemodel"))
FILLED = 'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" std: 0.5 }'


@pytest.fixture(scope="module")
def lenet():
    return caffejax.Net(*LENET, caffejax.TEST)


def _images(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((n, 1, 28, 28), dtype=np.float32)


def test_every_batch_size_runs_one_of_the_programs_of_its_sizes(lenet):
    served = caffejax.compile_inference(lenet, batch_sizes=(8, 4))
    exact = caffejax.compile_inference(lenet)
    assert served.batch_sizes == (4, 8)
    x = _images(11)
    for n in (1, 3, 4, 5, 8):
        got = served({"data": x[:n]})["prob"]
        assert isinstance(got, jax.Array) and got.shape == (n, 10)
        np.testing.assert_allclose(np.asarray(got), np.asarray(exact({"data": x[:n]})["prob"]), rtol=1e-5, atol=1e-7)
    assert served.compile_count == 2  # batches of 4 and 8
    # Past the largest size: parts of 8 (the last one padded), still those two programs.
    np.testing.assert_allclose(np.asarray(served({"data": x})["prob"]), np.asarray(exact({"data": x})["prob"]),
                               rtol=1e-5, atol=1e-7)
    assert served.compile_count == 2
    assert served({"data": x[:0]})["prob"].shape == (0, 10)


def test_a_padded_batch_runs_the_size_s_program_on_copies_of_its_last_row(lenet):
    served = caffejax.compile_inference(lenet, batch_sizes=(4,))
    exact = caffejax.compile_inference(lenet)
    x = _images(3)
    padded = np.concatenate([x, x[2:], x[2:]])[:4]
    np.testing.assert_array_equal(np.asarray(served({"data": x})["prob"]),
                                  np.asarray(exact({"data": padded})["prob"])[:3])
    # a device array is padded on the device, the same way
    np.testing.assert_array_equal(np.asarray(served({"data": jnp.asarray(x)})["prob"]),
                                  np.asarray(exact({"data": padded})["prob"])[:3])


def test_warm_up_compiles_the_programs_of_every_size_before_the_first_call(lenet):
    served = caffejax.compile_inference(lenet, batch_sizes=(2, 4, 8))
    assert served.warm_up() == 3 and served.compile_count == 3
    for n in range(1, 9):
        served({"data": _images(n)})
    assert served.compile_count == 3 and served.warm_up() == 0
    exact = caffejax.compile_inference(lenet)
    assert exact.warm_up({"data": (5, 1, 28, 28)}) == 1
    exact({"data": _images(5)})
    assert exact.compile_count == 1
    with pytest.raises(CaffejaxError, match=r"warm_up: shapes for \['x'\] do not match the net's inputs \['data'\]"):
        exact.warm_up({"x": (1, 1, 28, 28)})


def test_after_warm_up_a_request_of_any_size_compiles_nothing(lenet):
    """Padding and cutting go through NumPy views of arrays in host memory: an eager jnp slice or concatenate would
    compile a program at each new number of rows (30-190 ms each), and so would a program's first run cost more."""
    from jax._src import monitoring

    served = caffejax.compile_inference(lenet, batch_sizes=(4, 8))
    assert served.warm_up() == 2
    compiled = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(event)

    monitoring.register_event_duration_secs_listener(listener)
    try:
        for n in (1, 3, 5, 7, 11, 13):
            for x in (_images(n), jax.device_put(_images(n))):
                assert served({"data": x})["prob"].shape == (n, 10)
    finally:
        monitoring.unregister_event_duration_listener(listener)
    assert compiled == [] and served.compile_count == 2


def test_batch_sizes_in_bfloat16(lenet):
    served = caffejax.compile_inference(lenet, dtype=jnp.bfloat16, batch_sizes=(2, 8))
    exact = caffejax.compile_inference(lenet, dtype=jnp.bfloat16)
    x = _images(5)
    got = np.asarray(served({"data": x})["prob"])
    assert got.dtype == np.float32 and got.shape == (5, 10) and served.compile_count == 1
    np.testing.assert_array_equal(got.argmax(1), np.asarray(exact({"data": x})["prob"]).argmax(1))


@pytest.mark.parametrize("sizes", [(), [0, 4], [2.5], "4", 4, (True,), [2, "4"], None])
def test_batch_sizes_must_be_positive_whole_numbers(lenet, sizes):
    if sizes is None:
        assert caffejax.compile_inference(lenet, batch_sizes=None).batch_sizes is None
        assert caffejax.compile_inference(lenet, batch_sizes=np.array([16, 2, 2])).batch_sizes == (2, 16)
        return
    with pytest.raises(CaffejaxError, match="batch_sizes must be a non-empty list of positive whole numbers"):
        caffejax.compile_inference(lenet, batch_sizes=sizes)


def test_inputs_of_different_rows_cannot_be_padded():
    net = caffejax.Net('name: "two"\n' + input_layer(3, 2, name="a") + input_layer(3, 2, name="b")
                       + 'layer { name: "sum" type: "Eltwise" bottom: "a" bottom: "b" top: "y" }', caffejax.TEST)
    served = caffejax.compile_inference(net, batch_sizes=(4,))
    a = np.ones((3, 2), np.float32)
    np.testing.assert_array_equal(np.asarray(served({"a": a, "b": 2 * a})["y"]), 3 * a)
    with pytest.raises(ShapeError, match=r"the same number of rows .*'b': \(2, 2\)"):
        served({"a": a, "b": a[:2]})


# ---- the layers' rows_apart ---------------------------------------------------------------------------------------

def _layer(type_, body="", bottoms=("x",), tops=("y",)) -> str:
    bottom = " ".join(f'bottom: "{b}"' for b in bottoms)
    top = " ".join(f'top: "{t}"' for t in tops)
    return f'layer {{ name: "l" type: "{type_}" {bottom} {top} {body} }}'


ROW = (3, 4, 5)  # one row of the input x: channels, height, width
# Each layer declared to keep rows apart, in settings that do: (layer, one row of each input).
ROWS_APART = {
    "AbsVal": (_layer("AbsVal"), {}),
    "BNLL": (_layer("BNLL"), {}),
    "Clip": (_layer("Clip", "clip_param { min: 0.2 max: 0.7 }"), {}),
    "ELU": (_layer("ELU"), {}),
    "Exp": (_layer("Exp"), {}),
    "Log": (_layer("Log"), {}),
    "Power": (_layer("Power", "power_param { power: 2 scale: 3 shift: 1 }"), {}),
    "ReLU": (_layer("ReLU", "relu_param { negative_slope: 0.1 }"), {}),
    "Sigmoid": (_layer("Sigmoid"), {}),
    "Swish": (_layer("Swish"), {}),
    "TanH": (_layer("TanH"), {}),
    "Threshold": (_layer("Threshold", "threshold_param { threshold: 0.5 }"), {}),
    "Dropout": (_layer("Dropout"), {}),
    "PReLU": (_layer("PReLU", 'prelu_param { filler { type: "gaussian" std: 1 } }'), {}),
    "ArgMax": (_layer("ArgMax", "argmax_param { top_k: 2 out_max_val: true }"), {}),
    "ArgMax along axis 1": (_layer("ArgMax", "argmax_param { axis: 1 }"), {}),
    "BatchNorm": (_layer("BatchNorm"), {}),
    "Embed": (_layer("Embed", f"embed_param {{ num_output: 3 input_dim: 7 {FILLED} }}", ("i",)), {"i": (2,)}),
    "Bias": (_layer("Bias", 'bias_param { filler { type: "gaussian" std: 1 } }'), {}),
    "Scale": (_layer("Scale", 'scale_param { filler { type: "gaussian" std: 1 } bias_term: true }'), {}),
    "Concat": (_layer("Concat", "", ("x", "x")), {}),
    "Concat along axis -1": (_layer("Concat", "concat_param { axis: -1 }", ("x", "x")), {}),
    "Slice": (_layer("Slice", "slice_param { slice_point: 1 }", tops=("y", "z")), {}),
    "Split": (_layer("Split", tops=("y", "z")), {}),
    "Tile": (_layer("Tile", "tile_param { tiles: 2 }"), {}),
    "Eltwise": (_layer("Eltwise", "eltwise_param { operation: PROD }", ("x", "x")), {}),
    "Flatten": (_layer("Flatten"), {}),
    "Reshape": (_layer("Reshape", "reshape_param { shape { dim: 0 dim: -1 dim: 4 } }"), {}),
    "Reshape after axis 0": (_layer("Reshape", "reshape_param { axis: 1 shape { dim: 12 dim: -1 } }"), {}),
    "InnerProduct": (_layer("InnerProduct", f"inner_product_param {{ num_output: 6 {FILLED} }}"), {}),
    "MVN": (_layer("MVN", "mvn_param { across_channels: true }"), {}),
    "Softmax": (_layer("Softmax"), {}),
    "Reduction": (_layer("Reduction", "reduction_param { axis: 1 operation: SUMSQ }"), {}),
    "Convolution": (_layer("Convolution", f"convolution_param {{ num_output: 4 kernel_size: 3 pad: 1 {FILLED} }}"),
                    {}),
    "Deconvolution": (_layer("Deconvolution", f"convolution_param {{ num_output: 2 kernel_size: 2 stride: 2 "
                                              f"{FILLED} }}"), {}),
    "Im2col": (_layer("Im2col", "convolution_param { kernel_size: 2 }"), {}),
    "Pooling": (_layer("Pooling", "pooling_param { pool: MAX kernel_size: 3 stride: 2 }"), {}),
    "SPP": (_layer("SPP", "spp_param { pyramid_height: 2 }"), {}),
    "LRN": (_layer("LRN", "lrn_param { local_size: 3 }"), {}),
    "Crop": (_layer("Crop", "crop_param { axis: 1 offset: 1 }", ("x", "r")), {"r": (2, 2, 3)}),
}


def _net(layer: str, rows: dict[str, tuple[int, ...]], batch: int, phase=caffejax.TEST) -> caffejax.Net:
    inputs = {"x": ROW, **rows} if '"x"' in layer else rows
    return caffejax.Net('name: "one_layer"\n' + "".join(input_layer(batch, *row, name=name)
                                                        for name, row in inputs.items()) + layer, phase)


# The forks' layers (registered in the tests that use them).
FORK_ROWS_APART = {
    "ReLU6": (_layer("ReLU6"), {}),
    "Upsample": (_layer("Upsample", "upsample_param { scale: 2 }"), {}),
    "Interp": (_layer("Interp", "interp_param { zoom_factor: 2 }"), {}),
    "Permute": (_layer("Permute", "permute_param { order: 0 order: 2 order: 3 order: 1 }"), {}),
    "Normalize": (_layer("Normalize", 'norm_param { across_spatial: false scale_filler { type: "gaussian" std: 1 } '
                                      "channel_shared: false }"), {}),
}


def test_every_layer_kept_apart_is_checked_here(isolated_registry):
    forks.register_all()
    flagged = {t for t in caffejax.layer_type_list() if get_rule(t).rows_apart is not False}
    tried = {case.split(" ")[0] for case in [*ROWS_APART, *FORK_ROWS_APART]}
    assert flagged - tried == {"Silence"}  # no top to compare


@pytest.mark.parametrize("case", [*ROWS_APART, *FORK_ROWS_APART])
def test_a_layer_kept_apart_gives_its_rows_what_it_gives_them_alone(case, isolated_registry):
    forks.register_all()
    layer, rows = {**ROWS_APART, **FORK_ROWS_APART}[case]
    net = _net(layer, rows, batch=3)
    assert rows_mixed(net.graph) == []
    rng = np.random.default_rng(1)
    inputs = {name: np.asarray(net.blobs[name].data.shape) for name in net.inputs}
    fed = {name: (rng.integers(0, 7, (5, *shape[1:])) if name == "i" else rng.uniform(0.1, 1, (5, *shape[1:])))
           .astype(np.float32) for name, shape in inputs.items()}
    infer = caffejax.compile_inference(net, passes=())
    three = infer({name: x[:3] for name, x in fed.items()})
    five = infer(fed)  # two other rows after the same three
    for blob, y in three.items():
        np.testing.assert_allclose(np.asarray(five[blob])[:3], np.asarray(y), rtol=1e-6, atol=1e-7, err_msg=blob)


ROWS_MIXED = {
    "Softmax over the batch": (_layer("Softmax", "softmax_param { axis: 0 }"), {}),
    "Softmax over axis -4": (_layer("Softmax", "softmax_param { axis: -4 }"), {}),
    "Concat of batches": (_layer("Concat", "concat_param { axis: 0 }", ("x", "x")), {}),
    "Concat by concat_dim 0": (_layer("Concat", "concat_param { concat_dim: 0 }", ("x", "x")), {}),
    "Slice of the batch": (_layer("Slice", "slice_param { axis: 0 slice_point: 1 }", tops=("y", "z")), {}),
    "Reduction of everything": (_layer("Reduction"), {}),
    "BatchNorm by the batch's statistics": (_layer("BatchNorm", "batch_norm_param { use_global_stats: false }"), {}),
    "Flatten of the batch": (_layer("Flatten", "flatten_param { axis: 0 }"), {}),
    "Reshape of the batch": (_layer("Reshape", "reshape_param { shape { dim: -1 dim: 30 } }"), {}),
    "InnerProduct over the batch": (_layer("InnerProduct", "inner_product_param { num_output: 2 axis: 0 }"), {}),
    "ArgMax along the batch": (_layer("ArgMax", "argmax_param { axis: 0 }"), {}),
    "Tile of the batch": (_layer("Tile", "tile_param { axis: 0 tiles: 2 }"), {}),
    "Crop of the batch": (_layer("Crop", "crop_param { axis: 0 }", ("x", "r")), {"r": (3, 4, 5)}),
    "BatchReindex": (_layer("BatchReindex", "", ("x", "k")), {"k": ()}),
    "Parameter": ('layer { name: "l" type: "Parameter" top: "y" parameter_param { shape { dim: 2 } } }', {"k": ()}),
    "Permute of the batch": (_layer("Permute", "permute_param { order: 1 order: 0 }"), {}),
    "PriorBox": (_layer("PriorBox", "prior_box_param { min_size: 2 }", ("x", "x")), {}),
}


@pytest.mark.parametrize("case", list(ROWS_MIXED))
def test_a_net_with_a_layer_mixing_rows_is_refused_by_name(case, isolated_registry):
    forks.register_all()
    layer, rows = ROWS_MIXED[case]
    net = _net(layer, rows, batch=3)
    kind = layer.split('type: "')[1].split('"')[0]
    assert rows_mixed(net.graph, with_shapes=False) == [f"layer 'l' ({kind})"]
    with pytest.raises(UnsupportedError, match=rf"pads a batch with rows.*in net 'one_layer' layer 'l' \({kind}\) do "
                                               "not. Leave batch_sizes out"):
        caffejax.compile_inference(net, batch_sizes=(4,))


def test_dropout_mixes_rows_in_train_only():
    assert rows_mixed(_net(_layer("Dropout"), {}, 3, caffejax.TRAIN).graph) == ["layer 'l' (Dropout)"]
    assert rows_mixed(_net(_layer("Dropout"), {}, 3, caffejax.TEST).graph) == []


def test_recurrent_layers_are_refused():
    lstm = _layer("LSTM", f"recurrent_param {{ num_output: 2 {FILLED} }}", ("x", "cont"))
    net = _net(lstm, {"cont": (3,)}, batch=3)  # x: 3 time steps x 3 streams x 4 x 5
    with pytest.raises(UnsupportedError, match=r"layer 'l' \(LSTM\)"):
        caffejax.compile_inference(net, batch_sizes=(4,))


def test_a_users_layer_is_padded_only_where_it_says_it_keeps_rows_apart(isolated_registry):
    def double(ctx, bottoms, params):
        return [2 * bottoms[0]]

    register_layer("DoubleUnsaid", double, bottoms=(1, 1), tops=(1, 1))
    register_layer("DoubleApart", double, bottoms=(1, 1), tops=(1, 1), rows_apart=True)
    with pytest.raises(UnsupportedError, match=r"layer 'l' \(DoubleUnsaid\)"):
        caffejax.compile_inference(_net(_layer("DoubleUnsaid"), {}, 3), batch_sizes=(4,))
    served = caffejax.compile_inference(_net(_layer("DoubleApart"), {}, 3), batch_sizes=(4,))
    x = np.ones((3, *ROW), np.float32)
    np.testing.assert_array_equal(np.asarray(served({"x": x})["y"]), 2 * x)
    with pytest.raises(Exception, match="rows_apart must be True, False or callable"):
        register_layer("DoubleWrong", double, rows_apart="yes")


def test_a_layer_said_to_keep_rows_apart_whose_top_is_not_one_row_per_row_is_refused_at_its_shapes(
        isolated_registry):
    register_layer("FirstRow", lambda ctx, bottoms, params: [bottoms[0][:1]], bottoms=(1, 1), tops=(1, 1),
                   rows_apart=True)
    served = caffejax.compile_inference(_net(_layer("FirstRow"), {}, 3), batch_sizes=(4,))
    with pytest.raises(UnsupportedError, match=r"one row per row of the inputs; in net 'one_layer' blob 'y' "
                                               r"\(1, 3, 4, 5\) do not"):
        served({"x": np.ones((3, *ROW), np.float32)})


def test_a_net_run_in_stages_around_a_host_layer_is_refused(isolated_registry):
    register_layer("HostDouble", lambda ctx, bottoms, params: [2 * bottoms[0]], bottoms=(1, 1), tops=(1, 1),
                   host_forward=lambda layer_param, bottoms: [2 * bottoms[0]], rows_apart=True)
    net = _net(_layer("HostDouble") + ' layer { name: "r" type: "ReLU" bottom: "y" top: "z" }', {}, 3)
    assert net.graph.staging_layers
    with pytest.raises(UnsupportedError, match="in net 'one_layer' layers run on the host between programs do not"):
        caffejax.compile_inference(net, batch_sizes=(4,))


# ---- published nets -------------------------------------------------------------------------------------------------

PUBLISHED = {
    "alexnet": MODELS / "bvlc/models/bvlc_alexnet/deploy.prototxt",
    "cifar10_full": MODELS / "bvlc/examples/cifar10/cifar10_full.prototxt",
    "googlenet": MODELS / "bvlc/models/bvlc_googlenet/deploy.prototxt",
    "resnet50": MODELS / "resnet/ResNet-50-deploy.prototxt",
    "mobilenet_v2": MODELS / "mobilenet/mobilenet_v2_deploy.prototxt",
    "squeezenet": MODELS / "squeezenet/v1.1/deploy.prototxt",
    "fcn8s": MODELS / "fcn/voc-fcn8s/deploy.prototxt",
    "inception_v3": MODELS / "soeaver/deploy_inception-v3.prototxt",
    "densenet121": MODELS / "densenet/DenseNet_121.prototxt",
    **{f"mtcnn_{name}": BUNDLED / f"mtcnn/{name}.prototxt" for name in ("det1", "det2", "det3", "det4")},
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_nets_keep_rows_apart(name):
    graph = caffejax.Net(str(PUBLISHED[name]), caffejax.TEST).graph
    assert rows_mixed(graph) == []


@pytest.mark.slow
@pytest.mark.parametrize("name", ["googlenet", "mobilenet_v2", "fcn8s"])
def test_a_published_net_padded_gives_each_row_its_own_outputs(name):
    from bench.nets import randomize_weights

    net = caffejax.Net(str(PUBLISHED[name]), caffejax.TEST)
    randomize_weights(net)
    data = net.inputs[0]
    shape = (3,) + tuple(net.blobs[data].shape[1:]) if name != "fcn8s" else (3, 3, 64, 80)
    x = np.random.default_rng(0).random(shape, dtype=np.float32)
    exact = caffejax.compile_inference(net)({data: x})
    padded = caffejax.compile_inference(net, batch_sizes=(4,))({data: x})
    for blob, y in exact.items():
        np.testing.assert_allclose(np.asarray(padded[blob]), np.asarray(y), rtol=1e-4, atol=1e-5, err_msg=blob)
