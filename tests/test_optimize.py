"""compile_inference and its optimisation passes: each pass keeps the outputs of the unoptimised program.

One small net exercises every rewrite and kernel (BatchNorm folding into a convolution and into an inner
product, a lone BatchNorm + Scale, channels-last convolutions with pad/stride/dilation/groups, 1x1 GEMMs at
stride 1 and 2, depthwise and split-group convolutions, Winograd on odd sizes with and without padding, MAX/AVE pooling with overhang,
global pooling, LRN, Concat, Eltwise, an InnerProduct over a channels-last 4-D input, and layers with no
channels-last kernel). Each pass runs alone (with ``nhwc`` where it refines its kernels) and all together,
compared with ``passes=()`` at Caffe's forward tolerance.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import caffejax
from caffejax.lower import optimize
from conftest import BUNDLED, DIFF_ATOL, DIFF_RTOL, FORWARD_ATOL, FORWARD_RTOL, assert_close

CONV = 'type: "Convolution" convolution_param {{ num_output: {n} kernel_size: {k} {extra} weight_filler {{ type: "gaussian" std: 0.2 }} bias_filler {{ type: "gaussian" std: 0.1 }} }}'


def _layer(name, type_, bottoms, tops, body=""):
    bottoms = " ".join(f'bottom: "{b}"' for b in bottoms)
    tops = " ".join(f'top: "{t}"' for t in tops)
    return f'layer {{ name: "{name}" type: "{type_}" {bottoms} {tops} {body} }}\n'


def _conv(name, bottom, top, n, k, extra=""):
    body = CONV.format(n=n, k=k, extra=extra)[len('type: "Convolution" '):]
    return _layer(name, "Convolution", [bottom], [top], body)


def _bn_scale(name, blob, scale=True):
    text = _layer(f"{name}_bn", "BatchNorm", [blob], [blob], "batch_norm_param { use_global_stats: true }")
    if scale:
        text += _layer(f"{name}_scale", "Scale", [blob], [blob],
                       'scale_param { bias_term: true filler { type: "uniform" min: 0.5 max: 1.5 } '
                       'bias_filler { type: "gaussian" std: 0.1 } }')
    return text


ZOO = (
    'name: "zoo" input: "data" input_shape { dim: 2 dim: 8 dim: 9 dim: 9 }\n'
    # conv + BN + Scale + in-place ReLU: folded; 3x3 pad 1 on 9x9: Winograd with a cropped last tile
    + _conv("a", "data", "a", 16, 3, "pad: 1") + _bn_scale("a", "a")
    + _layer("a_relu", "ReLU", ["a"], ["a"])
    # 1x1 stride 2 without bias + BN without Scale: folded, bias created; GEMM on a strided view
    + _conv("b", "a", "b", 12, 1, "stride: 2 bias_term: false") + _bn_scale("b", "b", scale=False)
    # depthwise 3x3, stride 1 and stride 2 (pad 1)
    + _conv("dw", "a", "dw", 16, 3, "pad: 1 group: 16")
    + _conv("dw2", "a", "dw2", 16, 3, "pad: 1 stride: 2 group: 16")
    # grouped, dilated: the direct NHWC convolution
    + _conv("gd", "dw", "gd", 16, 3, "pad: 2 dilation: 2 group: 4")
    + _layer("sum", "Eltwise", ["gd", "dw"], ["sum"], "eltwise_param { operation: SUM coeff: 1 coeff: -0.5 }")
    + _layer("cat", "Concat", ["sum", "a"], ["cat"])
    + _layer("lrn", "LRN", ["cat"], ["lrn"], "lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 k: 2 }")
    # MAX 2x2/2 over 9x9 (ceil mode: the last window overhangs), AVE 3x3/2 pad 1: both 5x5
    + _layer("maxp", "Pooling", ["lrn"], ["maxp"], "pooling_param { pool: MAX kernel_size: 2 stride: 2 }")
    + _layer("avep", "Pooling", ["lrn"], ["avep"], "pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 }")
    # a BatchNorm + Scale after a pooling: one per-channel affine Scale
    + _bn_scale("p", "maxp")
    # 3x3 without pad on 5x5: Winograd without padding, the last tile cropped
    + _conv("c", "maxp", "c", 8, 3)
    + _conv("c5", "avep", "c5", 8, 3)
    + _layer("c5_relu", "ReLU", ["c5"], ["c5"])
    # 1x1 stride 1 (GEMM) on the stride-2 branch
    + _conv("e", "b", "e", 8, 1)
    + _layer("gpool", "Pooling", ["e"], ["gpool"], "pooling_param { pool: AVE global_pooling: true }")
    + _layer("gmax", "Pooling", ["c5"], ["gmax"], "pooling_param { pool: MAX global_pooling: true }")
    # an InnerProduct over a 4-D channels-last value (weights permuted), then BN folded into it
    + _layer("fc", "InnerProduct", ["c"], ["fc"],
             'inner_product_param { num_output: 6 weight_filler { type: "gaussian" std: 0.2 } '
             'bias_filler { type: "gaussian" std: 0.1 } }')
    + _bn_scale("fc", "fc")
    + _layer("fct", "InnerProduct", ["dw2"], ["fct"],
             'inner_product_param { num_output: 5 transpose: true weight_filler { type: "gaussian" std: 0.1 } }')
    # no channels-last kernel: Flatten and Softmax read NCHW
    + _layer("flat", "Flatten", ["gpool"], ["flat"])
    + _layer("gflat", "Flatten", ["gmax"], ["gflat"])
    + _layer("joined", "Concat", ["flat", "gflat", "fc", "fct"], ["joined"])
    + _layer("prob", "Softmax", ["joined"], ["prob"])
)


def _randomize_batchnorm(net, seed=0):
    rng = np.random.default_rng(seed)
    for name, blobs in net.params.items():
        if net.layer_dict[name].type == "BatchNorm":
            channels = blobs[0].shape
            blobs[0].data[...] = rng.normal(0, 0.5, channels) * 4     # sums, divided by the factor 4
            blobs[1].data[...] = rng.uniform(0.5, 2.0, channels) * 4
            blobs[2].data[...] = 4


@pytest.fixture(autouse=True)
def winograd_on_small_batches(monkeypatch):
    """The zoo's batch of 2 (and the published nets' batch of 1 below) has fewer 2x2 tiles than Winograd takes
    by default: lower the minimum, so their 3x3 layers run (and are checked in) the Winograd kernel.
    test_winograd_needs_enough_tiles checks the rule itself."""
    monkeypatch.setattr(optimize, "WINOGRAD_MIN_TILES", 1)


@pytest.fixture(scope="module")
def zoo():
    caffejax.set_random_seed(3)
    net = caffejax.Net(ZOO, caffejax.TEST)
    _randomize_batchnorm(net)
    x = np.random.default_rng(1).normal(size=(2, 8, 9, 9)).astype(np.float32)
    reference = caffejax.compile_inference(net, passes=())({"data": x})
    return net, x, reference


def _check(got, reference, what):
    assert set(got) == set(reference)
    for blob in reference:
        assert_close(got[blob], reference[blob], FORWARD_RTOL, FORWARD_ATOL, f"{what}: {blob}")


def test_unoptimised_program_is_net_forward(zoo):
    net, x, reference = zoo
    out = net.forward(data=x)
    _check(reference, {blob: out[blob] for blob in reference}, "passes=() vs Net.forward")


@pytest.mark.parametrize("group, channels, outputs", [(16, 16, 16), (16, 16, 48), (4, 16, 16), (2, 16, 16),
                                                     (32, 64, 64)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_grouped_convolution_is_xla_grouped_convolution(group, channels, outputs, channels_last):
    """Depthwise (with a channel multiplier too) as shifted multiply-adds and up to 64 groups (ResNeXt's 32) as
    one convolution each: XLA's grouped convolution's values, in both layouts (stride 2, dilation 2, uneven
    padding)."""
    from jax import lax
    from caffejax.lower import vision

    rng = np.random.default_rng(group)
    x = rng.normal(size=(2, channels, 9, 8)).astype(np.float32)
    w = rng.normal(size=(outputs, channels // group, 3, 3)).astype(np.float32)
    g = vision.ConvGeometry(1, (3, 3), (2, 2), (1, 2), (2, 1))
    padding, out = [(1, 2), (2, 2)], (4, 5)
    expected = lax.conv_general_dilated(x, w, g.stride, padding, rhs_dilation=g.dilation, feature_group_count=group,
                                        precision=lax.Precision.HIGHEST)
    if channels_last:
        got = vision.grouped_convolution(x.transpose(0, 2, 3, 1), w.transpose(2, 3, 1, 0), g, padding, out, group,
                                         channels_last=True, precision=lax.Precision.HIGHEST)
        got = np.asarray(got).transpose(0, 3, 1, 2)
    else:
        got = vision.grouped_convolution(x, w, g, padding, out, group, precision=lax.Precision.HIGHEST)
    assert_close(got, expected, FORWARD_RTOL, FORWARD_ATOL, f"group {group}")


@pytest.mark.parametrize("stride, pad, dilation, size", [((1, 1), (1, 1), (1, 1), (8, 8)),
                                                        ((2, 2), (1, 1), (1, 1), (9, 8)),
                                                        ((2, 3), (0, 2), (1, 2), (9, 11)),
                                                        ((3, 2), (4, 4), (1, 1), (7, 6))])  # windows in the padding
def test_a_depthwise_convolution_pads_only_its_edges(stride, pad, dilation, size):
    """Channels-last, a depthwise convolution reads its input unpadded where its windows lie inside it, and
    pads only strips along the edges (XLA:CPU writes out a padded copy of a whole input that is padded): the
    same bits as the taps of the padded input, and no pad in the program as big as the whole input padded."""
    from caffejax.lower import vision

    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(2,) + size + (6,)).astype(np.float32))
    w = jnp.asarray(rng.normal(size=(3, 3, 1, 6)).astype(np.float32))
    g = vision.ConvGeometry(3, (3, 3), stride, pad, dilation)
    padding = tuple((p, p) for p in pad)
    out = tuple((n + 2 * p - d * 2 - 1) // s + 1 for n, p, d, s in zip(size, pad, dilation, stride))
    got = vision.grouped_convolution(x, w, g, padding, out, 6, channels_last=True)
    taps = vision.convolution_taps(x, 1, g, padding, out)
    per_tap = w.reshape(9, 6)
    want = taps[0] * per_tap[0]
    for t in range(1, 9):
        want = want + taps[t] * per_tap[t]
    np.testing.assert_array_equal(got, want)
    program = jax.jit(lambda x: vision.grouped_convolution(x, w, g, padding, out, 6, channels_last=True))
    text = program.lower(x).as_text()
    padded = [line.rsplit("-> tensor<", 1)[1] for line in text.splitlines() if "stablehlo.pad" in line]
    sizes = [math.prod(int(d) for d in shape.split("x")[:-1]) for shape in padded]
    whole = 2 * 6 * math.prod(n + 2 * p for n, p in zip(size, pad))  # the whole input padded
    assert sizes and all(n < whole for n in sizes), padded


@pytest.mark.parametrize("group, channels", [(32, 64), (16, 16)])
def test_convolutions_split_by_group_have_xla_grouped_convolutions_gradients(group, channels):
    """ResNeXt's grouped layers run one convolution per group, and a depthwise one with a channel multiplier as
    shifted multiply-adds over its repeated channels: their gradients are XLA's grouped convolution's (whose
    filter gradient XLA:CPU runs naively)."""
    from jax import lax
    from caffejax.lower import vision

    rng = np.random.default_rng(7)
    g = vision.ConvGeometry(1, (3, 3), (2, 2), (1, 1), (1, 1))
    padding, out = [(1, 1), (1, 1)], (4, 4)
    with jax.enable_x64(True):
        x = jnp.asarray(rng.normal(size=(2, 7, 7, channels)))
        w = jnp.asarray(rng.normal(size=(3, 3, channels // group, 96)))
        dy = jnp.asarray(rng.normal(size=(2,) + out + (96,)))

        def split(x, w):
            return vision.grouped_convolution(x, w, g, padding, out, group, channels_last=True,
                                              precision=lax.Precision.HIGHEST)

        def xla(x, w):
            return lax.conv_general_dilated(x, w, g.stride, padding, rhs_dilation=g.dilation,
                                            feature_group_count=group, dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                            precision=lax.Precision.HIGHEST)

        y, vjp = jax.vjp(split, x, w)
        want_y, want_vjp = jax.vjp(xla, x, w)
        assert f"feature_group_count={group}" not in str(jax.make_jaxpr(split)(x, w))
        np.testing.assert_allclose(y, want_y, rtol=1e-12, atol=1e-12)
        for got, want in zip(vjp(dy), want_vjp(dy)):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("passes", [("fold_batchnorm",), ("nhwc",), ("nhwc", "conv_gemm"), ("nhwc", "winograd"),
                                    ("nhwc", "winograd_medium"), ("nhwc", "widen"), ("nhwc", "inner_product_nhwc"),
                                    optimize.DEFAULT_PASSES, tuple(optimize.PASSES)])
def test_pass_keeps_outputs(zoo, passes):
    net, x, reference = zoo
    infer = caffejax.compile_inference(net, passes=passes)
    _check(infer({"data": x}), reference, "+".join(passes))


def test_inference_hands_back_the_blobs_asked_for(zoo):
    """compile_inference(blobs=[...]), as pycaffe's forward(blobs=...): inner blobs besides the outputs, as
    Net.forward's blobs hold them ('a' after its BatchNorm, Scale and ReLU ran in place, which the passes fold
    into its convolution), with and without the passes; an unknown name is refused."""
    net, x, reference = zoo
    out = net.forward(data=x, blobs=["a", "dw"])
    for passes in ((), optimize.DEFAULT_PASSES):
        got = caffejax.compile_inference(net, passes=passes, blobs=["a", "dw"])({"data": x})
        assert set(got) == set(reference) | {"a", "dw"}
        for blob in ("a", "dw"):
            assert_close(got[blob], out[blob], FORWARD_RTOL, FORWARD_ATOL, f"{passes}: {blob}")
    with pytest.raises(caffejax.GraphError, match=r"no blobs \['nope'\]"):
        caffejax.compile_inference(net, blobs=["nope"])


def _fire(squeeze=6, e1="", e3="pad: 1", e5="pad: 2 bias_term: false", relu3=True, e3_bottom="s", also_reads=None):
    """A fire module with a third, 5x5 branch: 1x1, 3x3 and 5x5 convolutions of one squeeze layer, each through
    a ReLU, joined along channels, then a pooling."""
    return ('name: "fire" input: "data" input_shape { dim: 2 dim: 8 dim: 7 dim: 7 }\n'
            + _conv("squeeze", "data", "s", squeeze, 1) + _layer("s_relu", "ReLU", ["s"], ["s"])
            + _conv("e1", "s", "e1", 8, 1, e1) + _layer("e1_relu", "ReLU", ["e1"], ["e1"])
            + _conv("e3", e3_bottom, "e3", 10, 3, e3) + (_layer("e3_relu", "ReLU", ["e3"], ["e3"]) if relu3 else "")
            + _conv("e5", "s", "e5", 4, 5, e5) + _layer("e5_relu", "ReLU", ["e5"], ["e5"])
            + _layer("cat", "Concat", ["e1", "e3", "e5"], ["cat"])
            + _layer("pool", "Pooling", ["cat"], ["pool"], "pooling_param { pool: MAX kernel_size: 2 stride: 2 }")
            + (_layer("other", "Pooling", [also_reads], ["other"], "pooling_param { pool: AVE global_pooling: true }")
               if also_reads else ""))


def _fire_run(text, passes, **kwargs):
    caffejax.set_random_seed(4)
    net = caffejax.Net(text, caffejax.TEST)
    x = np.random.default_rng(2).normal(size=(2, 8, 7, 7)).astype(np.float32)
    infer = caffejax.compile_inference(net, passes=passes, **kwargs)
    return net, x, infer, infer.plan({"data": x.shape}).graph.layers


def test_a_concat_of_centred_convolutions_of_one_input_becomes_one_convolution():
    """merge_concat_convolutions: the three branches (bias and no bias) become one 5x5 convolution, the 1x1 and
    3x3 filters set in its middle, and one ReLU writing the join; Caffe's values."""
    passes = ("merge_concat_convolutions",) + optimize.DEFAULT_PASSES
    net, x, infer, layers = _fire_run(_fire(), passes)
    assert [(layer.name, layer.type) for layer in layers[-3:]] == [
        ("e1+e3+e5", "Convolution"), ("e1_relu", "ReLU"), ("pool", "Pooling")]
    merged = layers[-3].proto.convolution_param
    assert (merged.num_output, list(merged.kernel_size), list(merged.pad)) == (22, [5], [2])
    reference = caffejax.compile_inference(net, passes=())({"data": x})
    _check(infer({"data": x}), reference, "merged")
    bf16 = caffejax.compile_inference(net, passes=passes, dtype=jnp.bfloat16)({"data": x})["pool"]
    assert_close(bf16, reference["pool"], 0.02, 0.02, "merged, bfloat16")


@pytest.mark.parametrize("variant", [
    dict(squeeze=40),                          # more input channels than MERGE_MAX_CHANNELS
    # stride 2: a 3x2 kernel padded by 1 gives 4x4 outputs, as the others do, off their centre
    dict(e1="stride: 2", e3="kernel_size: 2 pad: 1 stride: 2", e5="pad: 2 stride: 2"),
    dict(e3="pad: 2 dilation: 2"),             # another dilation
    dict(e3="kernel_size: 5 pad: 1 pad: 2", e5="kernel_size: 1 pad: 2 pad: 0 bias_term: false"),  # 3x5, 5x1
    dict(relu3=False),                         # a ReLU on some branches only
    dict(e3_bottom="data", e3="pad: 1"),       # another input
    dict(also_reads="e3"),                     # a branch's value read by another layer too
], ids=["channels", "off_centre", "dilation", "crossed", "relu", "input", "read_elsewhere"])
def test_convolutions_a_concat_joins_otherwise_stay_apart(variant):
    net, x, infer, layers = _fire_run(_fire(**variant), ("merge_concat_convolutions",) + optimize.DEFAULT_PASSES)
    assert "cat" in [layer.name for layer in layers]
    _check(infer({"data": x}), caffejax.compile_inference(net, passes=())({"data": x}), str(variant))


def test_a_branch_handed_back_keeps_its_blob():
    """A blob asked for (``blobs=``) is an output: its branch stays apart and hands back Caffe's values."""
    passes = ("merge_concat_convolutions",) + optimize.DEFAULT_PASSES
    net, x, infer, layers = _fire_run(_fire(), passes, blobs=["e3"])
    assert "cat" in [layer.name for layer in layers]
    assert_close(infer({"data": x})["e3"], net.forward(data=x, blobs=["e3"])["e3"], FORWARD_RTOL, FORWARD_ATOL, "e3")


def test_every_rewrite_and_kernel_is_exercised(zoo):
    net, x, _ = zoo
    plan = caffejax.compile_inference(net, passes=tuple(optimize.PASSES)).plan({"data": x.shape})
    types = [layer.type for layer in plan.graph.layers]
    assert "BatchNorm" not in types                       # all four folded away
    assert types.count("Scale") == 1                      # the one after the pooling, BN + Scale as one
    kernels = {name: kernel.name for name, kernel in plan.kernels.items()}
    assert kernels["c"] == "conv_winograd_f2x2_3x3"
    assert kernels["b"] == "conv_1x1_gemm"
    # defer_rounding: c5 -> ReLU -> global MAX pooling and e -> global AVE pooling keep float32 sums; so does a,
    # read by a plain ReLU alone, which rounds
    assert kernels["c5"] == "conv_winograd_f2x2_3x3_unrounded" and kernels["e"] == "conv_1x1_gemm_unrounded"
    assert kernels["a"] == "conv_winograd_f2x2_3x3_unrounded" and kernels["a_relu"] == "elementwise_rounding"
    # widen wraps the direct convolutions, poolings and LRN (float32 compute under bfloat16 storage)
    assert kernels["dw"] == kernels["dw2"] == kernels["gd"] == "conv_nhwc_widened"
    assert kernels["fc"] == kernels["fct"] == "inner_product_nhwc"  # on the channels-last value, weights permuted
    assert kernels["maxp"] == kernels["avep"] == kernels["gpool"] == "pool_nhwc_widened"
    assert kernels["lrn"] == "lrn_nhwc_widened" and kernels["cat"] == "concat_nhwc"
    assert kernels["p_bn"] == "per_channel_nhwc"
    assert "flat" not in kernels and "prob" not in kernels


def test_default_passes_leave_1x1_convolutions_to_xla(zoo):
    """conv_gemm is named, not a default: by default a 1x1 convolution is the direct NHWC convolution, which
    XLA turns into a dot itself (see optimize.DEFAULT_PASSES)."""
    net, x, _ = zoo
    assert "conv_gemm" in optimize.PASSES and "conv_gemm" not in optimize.DEFAULT_PASSES
    infer = caffejax.compile_inference(net)
    kernels = infer.plan({"data": x.shape}).kernels
    assert kernels["b"].name == kernels["e"].name == "conv_nhwc"
    # The strided one ("b", 1x1 stride 2) too: its pixels taken out first, XLA makes a dot of it instead of
    # running a strided convolution.
    infer({"data": x})
    hlo = infer._programs[infer._signature({"data": x.shape})].run.as_text()
    layer_b = [line for line in hlo.splitlines() if 'op_name="jit(run)/b/' in line]
    assert layer_b and not any(" convolution(" in line for line in layer_b)
    assert any(" dot(" in line for line in layer_b)


def test_winograd_needs_enough_tiles(zoo, monkeypatch):
    """At the default minimum, 'a' (9x9 out: 25 tiles an image) and 'c' (3x3 out: 4) run Winograd only from the
    batch that gives each product 64 rows: 3 images for 'a', 16 for 'c'."""
    net, x, _ = zoo
    monkeypatch.undo()  # the default minimum again (winograd_on_small_batches lowered it)
    assert optimize.WINOGRAD_MIN_TILES == 64
    infer = caffejax.compile_inference(net)
    for batch, winograd in [(1, set()), (2, set()), (3, {"a"}), (15, {"a"}), (16, {"a", "c", "c5"})]:
        plan = infer.plan({"data": (batch,) + x.shape[1:]})
        assert {name for name, kernel in plan.kernels.items() if kernel.name == "conv_winograd_f2x2_3x3"} == winograd


def test_winograd_medium_takes_3x3_layers_up_to_28x28():
    """winograd stops at 14x14 outputs, winograd_medium at 28x28; both keep the outputs."""
    text = ('input: "data" input_shape { dim: 1 dim: 4 dim: 28 dim: 28 }\n'
            + _conv("big", "data", "big", 6, 3, "pad: 1") + _conv("small", "big", "small", 6, 3, "pad: 1 stride: 2")
            + _conv("tail", "small", "tail", 5, 3, "pad: 1"))
    caffejax.set_random_seed(7)
    net = caffejax.Net(text, caffejax.TEST)
    x = np.random.default_rng(2).normal(size=(1, 4, 28, 28)).astype(np.float32)
    reference = caffejax.compile_inference(net, passes=())({"data": x})
    chosen = {}
    for passes in [("nhwc", "winograd"), ("nhwc", "winograd_medium")]:
        infer = caffejax.compile_inference(net, passes=passes)
        _check(infer({"data": x}), reference, "+".join(passes))
        kernels = infer.plan({"data": x.shape}).kernels
        chosen[passes[1]] = {name for name, k in kernels.items() if k.name == "conv_winograd_f2x2_3x3"}
    # "small" has stride 2: never Winograd
    assert chosen == {"winograd": {"tail"}, "winograd_medium": {"big", "tail"}}


IM2COL_NET = ('input: "data" input_shape { dim: 2 dim: 6 dim: 11 dim: 11 }\n'
              # 3x3 pad 1, 48 filters: im2col
              + _conv("wide", "data", "wide", 48, 3, "pad: 1")
              # two groups of 24 channels -> 48 filters each, 5x5, stride 2, uneven padding overhang
              + _conv("grouped", "wide", "grouped", 96, 5, "pad: 2 stride: 2 group: 2")
              # dilation 2, no padding
              + _conv("dilated", "grouped", "dilated", 48, 3, "dilation: 2")
              # too few filters (47) and an odd channel count (47) stay direct convolutions
              + _conv("few", "wide", "few", 47, 3, "pad: 1") + _conv("odd", "few", "odd", 48, 3, "pad: 1")
              # depthwise and 1x1 are not im2col's
              + _conv("dw", "wide", "dw", 48, 3, "pad: 1 group: 48") + _conv("pw", "wide", "pw", 64, 1))


@pytest.mark.parametrize("by_kernel_rows", [False, True])
def test_conv_im2col_keeps_outputs_and_takes_wide_even_layers(monkeypatch, by_kernel_rows):
    """im2col + one product per group gives the convolution's outputs (float32 at Caffe's forward tolerance,
    bfloat16 within its rounding of the widened convolution's), for padding, stride, groups and dilation, with
    the product whole or summed over kernel rows; it takes layers with enough filters per group and an even
    channel count per group, before Winograd."""
    limit = 0 if by_kernel_rows else 1 << 30
    monkeypatch.setattr(optimize, "IM2COL_ROW_MIN_COLUMNS", limit)
    monkeypatch.setattr(optimize, "IM2COL_ROW_MIN_ROWS", limit)
    caffejax.set_random_seed(11)
    net = caffejax.Net(IM2COL_NET, caffejax.TEST)
    x = np.random.default_rng(4).normal(size=(2, 6, 11, 11)).astype(np.float32)
    reference = caffejax.compile_inference(net, passes=())({"data": x})
    passes = ("nhwc", "conv_im2col", "winograd")
    infer = caffejax.compile_inference(net, passes=passes)
    _check(infer({"data": x}), reference, "+".join(passes))
    kernels = {name: k.name for name, k in infer.plan({"data": x.shape}).kernels.items() if name in net.layer_dict}
    assert {name for name, k in kernels.items() if k == "conv_im2col"} == {"wide", "grouped", "dilated"}
    assert kernels["few"] == "conv_winograd_f2x2_3x3" and kernels["odd"] == "conv_winograd_f2x2_3x3"
    assert kernels["dw"] == "conv_nhwc" and kernels["pw"] == "conv_nhwc"
    # bfloat16: against the widened direct convolutions, layer by layer the same products summed in float32
    widened = caffejax.compile_inference(net, passes=("nhwc", "widen"), dtype=jnp.bfloat16)({"data": x})
    got = caffejax.compile_inference(net, passes=("nhwc", "conv_im2col", "widen"), dtype=jnp.bfloat16)({"data": x})
    for blob in reference:
        ref = np.asarray(reference[blob])
        np.testing.assert_allclose(np.asarray(got[blob]), np.asarray(widened[blob]), rtol=0,
                                   atol=0.02 * float(np.abs(ref).max()), err_msg=blob)
    # the window matrix limit: "grouped" has 2 x 6x6 x 24 x 5x5 = 43200 values a group, "wide" 13068
    monkeypatch.setattr(optimize, "IM2COL_MAX_WINDOW_VALUES", 43199)
    kernels = caffejax.compile_inference(net, passes=passes).plan({"data": x.shape}).kernels
    assert kernels["wide"].name == "conv_im2col" and kernels["grouped"].name == "conv_nhwc"


def _conv_shape(channels, size, kernel, num_output, batch, group=1, pad=0):
    from caffejax.lower import vision

    g = vision.ConvGeometry(1, (kernel, kernel), (1, 1), (pad, pad), (1, 1))
    out = (size + 2 * pad - kernel + 1,) * 2
    return optimize.ConvShape(g, group, channels, num_output, out, ((pad, pad), (pad, pad)), batch)


def test_im2col_sums_over_kernel_rows_where_they_are_long_and_many():
    """The rule: kernel rows of at least IM2COL_ROW_MIN_COLUMNS values (kw x C/g) and at least
    IM2COL_ROW_MIN_ROWS output pixels; and the sum over kernel rows is the whole product (kh products)."""
    rule = optimize._im2col_by_kernel_rows
    assert rule(_conv_shape(96, 27, 5, 256, 16, group=2, pad=2))       # AlexNet's conv2: 5 x 48 per group
    assert rule(_conv_shape(64, 56, 3, 64, 16, pad=1))                 # ResNet-50's first 3x3s: 3 x 64
    assert not rule(_conv_shape(20, 12, 5, 50, 16))                    # LeNet's conv2: 5 x 20
    assert not rule(_conv_shape(16, 55, 3, 64, 16, pad=1))             # SqueezeNet's fire2 expand3x3: 3 x 16
    assert not rule(_conv_shape(256, 13, 3, 384, 1, pad=1))            # AlexNet's conv3 at batch 1: 169 rows
    conv = _conv_shape(6, 7, 3, 5, 2, pad=1)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 7, 7, 6)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(3 * 3 * 6, 5)), jnp.float32)
    whole = optimize._windows_times_filters(x, w, conv, by_kernel_rows=False)
    rows = optimize._windows_times_filters(x, w, conv, by_kernel_rows=True)
    np.testing.assert_allclose(np.asarray(rows), np.asarray(whole), rtol=1e-5, atol=1e-5)
    jaxpr = str(jax.make_jaxpr(lambda x, w: optimize._windows_times_filters(x, w, conv, True))(x, w))
    assert jaxpr.count("dot_general") == 3


def test_window_rows_are_caffes_im2col_in_channels_last_order():
    """Row (n, oh, ow) holds the window's values offset by offset (row-major), each offset's channels in
    order; bfloat16 pairs (even channels) give the same bits as the unpaired gather."""
    from caffejax.lower import vision

    g = vision.ConvGeometry(1, (2, 3), (2, 1), (1, 0), (1, 2))
    x = np.arange(2 * 5 * 7 * 4, dtype=np.float32).reshape(2, 5, 7, 4)
    out = (3, 3)                                    # (5 + 2 - 2) // 2 + 1, (7 - 5) // 1 + 1
    padding = ((1, 0), (0, 0))
    rows = np.asarray(optimize.window_rows(jnp.asarray(x), g, padding, out))
    assert rows.shape == (2 * 3 * 3, 6 * 4)
    xp = np.pad(x, ((0, 0), (1, 0), (0, 0), (0, 0)))
    want = np.stack([np.concatenate([xp[n, oh * 2 + i, ow + 2 * j] for i in range(2) for j in range(3)])
                     for n in range(2) for oh in range(3) for ow in range(3)])
    np.testing.assert_array_equal(rows, want)
    paired = optimize.window_rows(jnp.asarray(x, jnp.bfloat16), g, padding, out)
    assert paired.dtype == jnp.bfloat16
    want_bf16 = np.asarray(jnp.asarray(want, jnp.bfloat16), np.float32)
    np.testing.assert_array_equal(np.asarray(paired, np.float32), want_bf16)


@pytest.mark.parametrize("axis, shapes", [(0, [(1, 5, 4), (2, 5, 4), (3, 5, 4)]),
                                          (1, [(3, 1, 4), (3, 2, 4), (3, 3, 4)]),
                                          (2, [(3, 5, 2), (3, 5, 4), (3, 5, 6)]),
                                          (-1, [(3, 5, 2), (3, 5, 4), (3, 5, 6)])])
def test_paired_concatenate_moves_bfloat16_in_pairs_with_the_same_bits_and_gradient(axis, shapes):
    """paired_concatenate joins 16-bit arrays as 32-bit pairs (even last axes): the same bits as
    jnp.concatenate, NaNs and signed zeros included, and the plain concatenation's derivative."""
    rng = np.random.default_rng(0)
    arrays = [jnp.asarray(rng.normal(size=s), jnp.bfloat16) for s in shapes]
    arrays[0] = arrays[0].at[0, 0, 0].set(jnp.nan).at[0, 0, 1].set(-0.0)
    got = jax.jit(lambda *a: optimize.paired_concatenate(a, axis))(*arrays)
    want = jnp.concatenate(arrays, axis)
    assert got.dtype == jnp.bfloat16 and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))
    assert "bitcast_convert_type" in str(jax.make_jaxpr(lambda *a: optimize.paired_concatenate(a, axis))(*arrays))
    weights = jnp.asarray(rng.normal(size=want.shape), jnp.bfloat16)
    finite = [a.at[0, 0, 0].set(1.0) for a in arrays]
    grads = jax.grad(lambda *a: jnp.sum((optimize.paired_concatenate(a, axis) * weights).astype(jnp.float32)),
                     argnums=tuple(range(3)))(*finite)
    want_grads = jax.grad(lambda *a: jnp.sum((jnp.concatenate(a, axis) * weights).astype(jnp.float32)),
                          argnums=tuple(range(3)))(*finite)
    for g, w in zip(grads, want_grads):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_paired_concatenate_pairs_a_symbolic_batch_with_integer_views(axis):
    """With a symbolic batch (an export's), where the bitcast of 16-bit pairs to 32 bits does not refine, the
    pairs are packed and unpacked on same-width views: the join itself moves uint32 values, the exported program
    refines at any batch and gives jnp.concatenate's bits, NaNs and signed zeros included."""
    batch, = jax.export.symbolic_shape("b")
    shapes = {0: [(3, 4)] * 3, 1: [(1, 4), (2, 4), (3, 4)], -1: [(3, 2), (3, 4), (3, 6)]}[axis]
    specs = [jax.ShapeDtypeStruct((batch,) + shape, jnp.bfloat16) for shape in shapes]
    exported = jax.export.export(jax.jit(lambda *a: optimize.paired_concatenate(a, axis)))(*specs)
    joins = re.findall(r"stablehlo\.concatenate .*tensor<\?x.*", exported.mlir_module())  # not the shapes' own
    assert any("xui32>" in join for join in joins) and not any("bf16" in join for join in joins), joins
    rng = np.random.default_rng(1)
    for rows in (1, 3):
        arrays = [jnp.asarray(rng.normal(size=(rows,) + s.shape[1:]), jnp.bfloat16) for s in specs]
        arrays[0] = arrays[0].at[0, 0, 0].set(jnp.nan).at[0, 0, 1].set(-0.0)
        got = exported.call(*arrays)
        want = jnp.concatenate(arrays, axis)
        assert got.dtype == jnp.bfloat16 and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))


def test_paired_concatenate_leaves_odd_and_wide_arrays_to_jnp():
    odd = [jnp.ones((2, 3), jnp.bfloat16), jnp.zeros((2, 3), jnp.bfloat16)]
    wide = [jnp.ones((2, 4), jnp.float32), jnp.zeros((2, 4), jnp.float32)]
    for arrays in (odd, wide):
        jaxpr = str(jax.make_jaxpr(lambda *a: optimize.paired_concatenate(a, 0))(*arrays))
        assert "bitcast_convert_type" not in jaxpr
        np.testing.assert_array_equal(optimize.paired_concatenate(arrays, 0), jnp.concatenate(arrays, 0))


def test_a_concat_moves_bfloat16_in_pairs_unless_a_pooling_reads_it(monkeypatch):
    """A Concat along channels joins bfloat16 as 32-bit pairs where the join is written out for its readers
    (a convolution, a Split); where a pooling reads it, XLA fuses a plain join into the pooling's windows, so it
    stays jnp.concatenate. Either way the program's outputs are the plain join's, bit for bit."""
    text = ('input: "data" input_shape { dim: 2 dim: 4 dim: 6 dim: 6 }\n'
            + _conv("a", "data", "a", 6, 1) + _conv("b", "data", "b", 4, 3, "pad: 1")
            + _layer("cat1", "Concat", ["a", "b"], ["cat1"])
            + _conv("c", "cat1", "c", 4, 1)
            + _layer("cat2", "Concat", ["c", "b"], ["cat2"])
            + _layer("pool", "Pooling", ["cat2"], ["pool"], "pooling_param { pool: MAX kernel_size: 2 stride: 2 }"))
    net = caffejax.Net(text, caffejax.TEST)
    x = np.random.default_rng(6).normal(size=(2, 4, 6, 6)).astype(np.float32)
    infer = caffejax.compile_inference(net, passes=("nhwc",), dtype=jnp.bfloat16)
    plan = infer.plan({"data": x.shape})
    bottoms = [jnp.ones((2, 6, 6, 6), jnp.bfloat16), jnp.ones((2, 6, 6, 4), jnp.bfloat16)]
    for name, paired in (("cat1", True), ("cat2", False)):
        kernel = plan.kernels[name]
        assert kernel.name == "concat_nhwc"
        jaxpr = str(jax.make_jaxpr(lambda *b, k=kernel: k.forward(None, list(b), []))(*bottoms))
        assert ("bitcast_convert_type" in jaxpr) == paired, name
    got = infer({"data": x})
    monkeypatch.setattr(optimize, "paired_concatenate", lambda arrays, axis: jnp.concatenate(arrays, axis))
    want = caffejax.compile_inference(net, passes=("nhwc",), dtype=jnp.bfloat16)({"data": x})
    np.testing.assert_array_equal(np.asarray(got["pool"]), np.asarray(want["pool"]))


def test_widen_computes_in_float32_and_rounds_once(zoo):
    """A widened kernel fed bfloat16 runs its convolution (pooling, LRN) on float32 operands and rounds its top
    to bfloat16 once: the same value as the float32 kernel on the rounded operands, rounded. Fed float32 in a
    bfloat16 program (an unrounded product, defer_rounding), it rounds only its top. In a float32 program it is
    the kernel itself."""
    net, x, _ = zoo
    plan = caffejax.compile_inference(net, passes=("nhwc",)).plan({"data": x.shape})
    widened = optimize.widen(plan).kernels
    rng = np.random.default_rng(4)
    for name in ["gd", "maxp", "avep", "lrn"]:
        layer = next(layer for layer in plan.graph.layers if layer.name == name)
        kernel = plan.kernels[name]
        assert widened[name].name == kernel.name + "_widened"
        params = [np.asarray(a) for a in kernel.prepare(plan.params.get(name, []))]
        nchw = plan.graph.value_shapes[layer.bottom_values[0]]
        bottom = rng.normal(size=(nchw[0],) + tuple(nchw[2:]) + (nchw[1],)).astype(np.float32)  # NHWC
        ctx = optimize.LayerContext(layer=layer.proto, phase=caffejax.TEST, key=None, num_tops=1,
                                    in_place=tuple(layer.in_place), dtype=jnp.bfloat16)

        def run(k, dtype, bottom=bottom, params=params, ctx=ctx):
            return k.forward(ctx, [jnp.asarray(bottom, dtype)], [jnp.asarray(a, dtype) for a in params])[0]

        # bfloat16 goes in and comes out through conversions only; everything in between is float32
        jaxpr = jax.make_jaxpr(lambda: run(widened[name], jnp.bfloat16))().jaxpr
        narrow = [eqn.primitive.name for eqn in jaxpr.eqns
                  if any(getattr(v.aval, "dtype", None) == jnp.bfloat16 for v in [*eqn.invars, *eqn.outvars])]
        assert set(narrow) == {"convert_element_type"}, (name, narrow)
        assert len(jaxpr.eqns) > len(narrow), name
        got = run(widened[name], jnp.bfloat16)
        assert got.dtype == jnp.bfloat16
        rounded = [np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32) for a in [bottom] + params]
        expected = kernel.forward(dataclasses.replace(ctx, dtype=jnp.float32), [jnp.asarray(rounded[0])],
                                  [jnp.asarray(a) for a in rounded[1:]])[0].astype(jnp.bfloat16)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(expected, np.float32), err_msg=name)
        unrounded = widened[name].forward(ctx, [jnp.asarray(bottom)], [jnp.asarray(a, jnp.bfloat16) for a in params])[0]
        assert unrounded.dtype == jnp.bfloat16
        expected = kernel.forward(dataclasses.replace(ctx, dtype=jnp.float32), [jnp.asarray(bottom)],
                                  [jnp.asarray(a) for a in rounded[1:]])[0].astype(jnp.bfloat16)
        np.testing.assert_array_equal(np.asarray(unrounded, np.float32), np.asarray(expected, np.float32), err_msg=name)
        f32_ctx = dataclasses.replace(ctx, dtype=jnp.float32)
        f32 = run(widened[name], jnp.float32, ctx=f32_ctx)
        np.testing.assert_array_equal(np.asarray(f32), np.asarray(run(kernel, jnp.float32, ctx=f32_ctx)), err_msg=name)


def test_defer_rounding_keeps_float32_sums_only_on_the_way_into_widened_kernels(zoo):
    """In a bfloat16 program, a product read only by widened convolutions and poolings (through element-wise
    layers) leaves its sum unrounded: the zoo's c5 (-> ReLU -> global MAX) and e (-> global AVE). Products read
    by another product (b), a Concat (a) or an LRN keep rounding. The outputs stay the bfloat16 program's."""
    net, x, reference = zoo
    passes = ("nhwc", "conv_gemm", "winograd", "widen")
    rounded = caffejax.compile_inference(net, passes=passes, dtype=jnp.bfloat16)
    deferred = caffejax.compile_inference(net, passes=passes + ("defer_rounding",), dtype=jnp.bfloat16)
    kernels = {name: k.name for name, k in deferred.plan({"data": x.shape}).kernels.items()}
    assert {name for name, k in kernels.items() if k.endswith("_unrounded")} == {"c5", "e"}
    assert kernels["b"] == "conv_1x1_gemm" and kernels["a"] == "conv_winograd_f2x2_3x3"
    ref = np.asarray(reference["prob"])
    for infer in (rounded, deferred):
        np.testing.assert_allclose(np.asarray(infer({"data": x})["prob"]), ref, atol=0.05 * float(np.abs(ref).max()))
    # float32: nothing to defer, the same program's values
    f32 = caffejax.compile_inference(net, passes=passes + ("defer_rounding",))({"data": x})
    np.testing.assert_array_equal(np.asarray(f32["prob"]),
                                  np.asarray(caffejax.compile_inference(net, passes=passes)({"data": x})["prob"]))


def test_defer_rounding_keeps_one_channel_taps_float32_on_the_way_into_the_pooling():
    """LeNet's conv1 (conv_taps, batch 16) leaves its float32 sums unrounded into pool1, which rounds each
    window's maximum instead of four values: pool1 and every later blob the rounding program's, bit for bit."""
    net = caffejax.Net(str(BUNDLED / "lenet/lenet.prototxt"), caffejax.TEST)
    x = np.random.default_rng(4).random((16, 1, 28, 28), dtype=np.float32)
    passes = optimize.DEFAULT_PASSES + ("widen",)
    rounded = caffejax.compile_inference(net, passes=passes, dtype=jnp.bfloat16, blobs=["pool1", "prob"])
    deferred = caffejax.compile_inference(net, passes=passes + ("defer_rounding",), dtype=jnp.bfloat16,
                                          blobs=["pool1", "prob"])
    kernels = {name: k.name for name, k in deferred.plan({"data": x.shape}).kernels.items()}
    assert kernels["conv1"] == "conv_taps_unrounded" and kernels["pool1"] == "pool_nhwc_widened"
    assert rounded.plan({"data": x.shape}).kernels["conv1"].name == "conv_taps"
    got, want = deferred({"data": x}), rounded({"data": x})
    for blob in ("pool1", "prob"):
        assert got[blob].dtype == want[blob].dtype
        np.testing.assert_array_equal(np.asarray(got[blob]), np.asarray(want[blob]), err_msg=blob)


def test_defer_rounding_keeps_a_widened_convolutions_float32_result_on_the_way_into_widened_kernels():
    """A 3-channel first layer, as SqueezeNet's conv1 -> ReLU -> pool1: the widened convolution leaves its result
    unrounded where only widened kernels read it (through element-wise layers), and the reader rounds. Into a
    MAX pooling the outputs are the rounding program's bit for bit (ReLU and the maximum keep the order that
    rounding keeps). Read by a two-input Eltwise, or as an output, it still rounds."""
    text = ('input: "data" input_shape { dim: 2 dim: 3 dim: 15 dim: 15 }\n'
            + _conv("c1", "data", "c1", 6, 3, "stride: 2") + _layer("r1", "ReLU", ["c1"], ["c1"])
            + _layer("p1", "Pooling", ["c1"], ["p1"], "pooling_param { pool: MAX kernel_size: 3 stride: 2 }")
            + _conv("c2", "p1", "c2", 6, 3, "pad: 1 stride: 2")
            + _layer("sum", "Eltwise", ["c2", "c2"], ["sum"])
            + _conv("c3", "data", "c3", 4, 3, "stride: 2"))
    net = caffejax.Net(text, caffejax.TEST)
    x = np.random.default_rng(5).normal(size=(2, 3, 15, 15)).astype(np.float32)
    passes = ("nhwc", "widen")
    rounded = caffejax.compile_inference(net, passes=passes, dtype=jnp.bfloat16, blobs=["p1"])
    deferred = caffejax.compile_inference(net, passes=passes + ("defer_rounding",), dtype=jnp.bfloat16, blobs=["p1"])
    plan = deferred.plan({"data": x.shape})
    kernels = {name: k.name for name, k in plan.kernels.items()}
    assert kernels["c1"] == "conv_nhwc_widened_unrounded"
    assert kernels["c2"] == kernels["c3"] == "conv_nhwc_widened" and kernels["p1"] == "pool_nhwc_widened"
    got, want = deferred({"data": x}), rounded({"data": x})
    for blob in ("p1", "sum", "c3"):
        np.testing.assert_array_equal(np.asarray(got[blob]), np.asarray(want[blob]), err_msg=blob)
    # its top stays float32 inside the program: the value it holds is the float32 convolution's
    layer = next(layer for layer in plan.graph.layers if layer.name == "c1")
    ctx = optimize.LayerContext(layer=layer.proto, phase=caffejax.TEST, key=None, num_tops=1,
                                in_place=tuple(layer.in_place), dtype=jnp.bfloat16)
    params = [jnp.asarray(a, jnp.bfloat16) for a in plan.kernels["c1"].prepare(plan.params["c1"])]
    bottom = jnp.asarray(x.transpose(0, 2, 3, 1), jnp.bfloat16)
    top = plan.kernels["c1"].forward(ctx, [bottom], params)[0]
    assert top.dtype == jnp.float32
    widened = rounded.plan({"data": x.shape}).kernels["c1"].forward(ctx, [bottom], params)[0]
    assert widened.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(top.astype(jnp.bfloat16), np.float32), np.asarray(widened, np.float32))


def test_a_plain_relu_alone_rounds_what_a_product_or_widened_convolution_hands_it(monkeypatch):
    """A product (p, 1x1) or widened convolution (d, depthwise) whose output only a ReLU without a negative
    slope reads hands it float32, and the ReLU rounds: the ReLU of the rounded sum is the rounded ReLU of the
    sum, so the outputs are the program's that rounds first, bit for bit. A leaky ReLU (l), a second reader (s)
    or an output handed back (u) keep the rounding where it was."""
    text = ('input: "data" input_shape { dim: 2 dim: 8 dim: 9 dim: 9 }\n'
            + _conv("d", "data", "d", 8, 3, "pad: 1 group: 8") + _layer("dr", "ReLU", ["d"], ["dr"])
            + _conv("p", "dr", "p", 16, 1) + _layer("pr", "ReLU", ["p"], ["p"])
            + _conv("l", "p", "l", 8, 1) + _layer("lr", "ReLU", ["l"], ["l"], "relu_param { negative_slope: 0.1 }")
            + _conv("s", "p", "s", 8, 1) + _layer("sr", "ReLU", ["s"], ["sr"])
            + _layer("ss", "Eltwise", ["s", "sr"], ["ss"])
            + _conv("u", "p", "u", 8, 1) + _layer("ur", "ReLU", ["u"], ["ur"])
            + _layer("cat", "Concat", ["l", "ss", "ur"], ["cat"]))
    net = caffejax.Net(text, caffejax.TEST)
    x = np.random.default_rng(7).normal(size=(2, 8, 9, 9)).astype(np.float32)
    passes = ("nhwc", "conv_gemm", "widen", "defer_rounding")
    deferred = caffejax.compile_inference(net, passes=passes, dtype=jnp.bfloat16, blobs=["u"])
    kernels = {name: k.name for name, k in deferred.plan({"data": x.shape}).kernels.items()}
    assert kernels["p"] == "conv_1x1_gemm_unrounded" and kernels["pr"] == "elementwise_rounding"
    assert kernels["d"] == "conv_nhwc_widened_unrounded" and kernels["dr"] == "elementwise_rounding"
    assert [kernels[name] for name in ("l", "s", "u")] == ["conv_1x1_gemm"] * 3
    assert kernels["lr"] == kernels["sr"] == kernels["ur"] == "elementwise"
    got = deferred({"data": x})
    monkeypatch.setattr(optimize, "_plain_relu_alone", lambda *args: None)  # the rounding where it was
    rounded = caffejax.compile_inference(net, passes=passes, dtype=jnp.bfloat16, blobs=["u"])
    assert rounded.plan({"data": x.shape}).kernels["p"].name == "conv_1x1_gemm"
    want = rounded({"data": x})
    for blob in ("cat", "u"):
        np.testing.assert_array_equal(np.asarray(got[blob]), np.asarray(want[blob]), err_msg=blob)


def test_a_sum_of_two_read_by_a_plain_relu_alone_is_summed_in_float32_and_rounded_by_the_relu(monkeypatch):
    """ResNet's join: an Eltwise SUM of two values (no coefficients) that only a plain ReLU reads sums in float32
    and the ReLU rounds, the same bits as summing in bfloat16 (XLA:CPU sums bfloat16 in float32 and rounds).
    A sum with coefficients (c) or of three values (t) rounds between its terms, and keeps rounding."""
    text = ('input: "data" input_shape { dim: 2 dim: 8 dim: 9 dim: 9 }\n'
            + _conv("a", "data", "a", 8, 3, "pad: 1") + _layer("ar", "ReLU", ["a"], ["a"])
            + _conv("b", "a", "b", 8, 1)
            + _layer("join", "Eltwise", ["a", "b"], ["join"]) + _layer("jr", "ReLU", ["join"], ["join"])
            + _layer("c", "Eltwise", ["join", "b"], ["c"], "eltwise_param { coeff: 1 coeff: 0.5 }")
            + _layer("cr", "ReLU", ["c"], ["c"])
            + _layer("t", "Eltwise", ["join", "b", "c"], ["t"]) + _layer("tr", "ReLU", ["t"], ["t"]))
    net = caffejax.Net(text, caffejax.TEST)
    x = np.random.default_rng(8).normal(size=(2, 8, 9, 9)).astype(np.float32)
    passes = ("nhwc", "conv_gemm", "widen", "defer_rounding")
    deferred = caffejax.compile_inference(net, passes=passes, dtype=jnp.bfloat16)
    kernels = {name: k.name for name, k in deferred.plan({"data": x.shape}).kernels.items()}
    assert kernels["join"] == "elementwise_unrounded" and kernels["jr"] == "elementwise_rounding"
    assert kernels["c"] == kernels["t"] == kernels["cr"] == kernels["tr"] == "elementwise"
    got = deferred({"data": x})["t"]
    monkeypatch.setattr(optimize, "_sums_two", lambda *args: False)
    rounded = caffejax.compile_inference(net, passes=passes, dtype=jnp.bfloat16)
    assert rounded.plan({"data": x.shape}).kernels["join"].name == "elementwise"
    np.testing.assert_array_equal(np.asarray(got), np.asarray(rounded({"data": x})["t"]))


def test_fold_keeps_values_other_layers_read():
    """A convolution whose output is read besides its BatchNorm keeps its output: the BatchNorm (and its
    Scale) become one Scale instead. A BatchNorm whose output is a net output still folds."""
    text = ('input: "data" input_shape { dim: 1 dim: 3 dim: 5 dim: 5 }\n'
            + _conv("a", "data", "a", 4, 3, "pad: 1")
            + _layer("bn", "BatchNorm", ["a"], ["bn"]) + _layer("sc", "Scale", ["bn"], ["sc"], "scale_param { bias_term: true }")
            + _layer("sum", "Eltwise", ["sc", "a"], ["sum"])
            + _conv("b", "sum", "b", 4, 1) + _layer("bn2", "BatchNorm", ["b"], ["out"]))
    caffejax.set_random_seed(5)
    net = caffejax.Net(text, caffejax.TEST)
    _randomize_batchnorm(net, seed=2)
    x = np.random.default_rng(0).normal(size=(1, 3, 5, 5)).astype(np.float32)
    reference = caffejax.compile_inference(net, passes=())({"data": x})
    infer = caffejax.compile_inference(net, passes=("fold_batchnorm",))
    _check(infer({"data": x}), reference, "fold_batchnorm")
    layers = infer.plan({"data": x.shape}).graph.layers
    assert [layer.type for layer in layers] == ["Input", "Convolution", "Split", "Scale", "Eltwise", "Convolution"]


def test_bf16_mode_agrees_with_fp32(zoo):
    net, x, reference = zoo
    infer = caffejax.compile_inference(net, dtype=jnp.bfloat16)
    got = infer({"data": x})["prob"]
    assert got.dtype == jnp.float32
    ref = np.asarray(reference["prob"])
    np.testing.assert_allclose(np.asarray(got), ref, atol=0.05 * float(np.abs(ref).max()))
    plan = infer.plan({"data": x.shape})
    params = infer._programs[infer._signature({"data": x.shape})].params
    assert all(a.dtype == jnp.bfloat16 for arrays in params.values() for a in arrays)
    del plan


def test_a_bf16_program_takes_float32_inputs_and_rounds_them_itself(zoo):
    """A bfloat16 program's inputs are float32 (Caffe's blobs): it rounds them itself, fused into their first
    readers, rather than NumPy converting a host batch first (ml_dtypes' conversion, a tenth of SqueezeNet's
    bfloat16 forward). A batch already in bfloat16 on the device gives the same bits."""
    net, x, _ = zoo
    infer = caffejax.compile_inference(net, dtype=jnp.bfloat16)
    got = np.asarray(infer({"data": x})["prob"])
    program = infer._programs[infer._signature({"data": x.shape})]
    fed = jax.tree.leaves(program.run.in_avals[0][1])
    assert [a.dtype for a in fed] == [jnp.float32]
    rounded = np.asarray(infer({"data": jnp.asarray(x, jnp.bfloat16)})["prob"])
    np.testing.assert_array_equal(got, rounded)
    assert not np.array_equal(x, np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32))  # the rounding mattered


def test_one_program_per_input_shape_and_weights_snapshot(zoo):
    net, x, reference = zoo
    infer = caffejax.compile_inference(net)
    first = infer({"data": x})
    infer({"data": x + 1})
    infer({"data": jnp.asarray(x)})                      # a device array of the same shape: the same program
    infer.plan({"data": [np.int64(d) for d in x.shape]})  # shapes given as NumPy ints: the same program
    assert infer.compile_count == 1
    single = infer({"data": x[:1]})                       # another batch size: a second program
    assert infer.compile_count == 2
    assert_close(single["prob"], first["prob"][:1], FORWARD_RTOL, FORWARD_ATOL, "batch of one")
    saved = net.params["a"][0].data.copy()
    net.params["a"][0].data[...] = 0                     # surgery after compiling is not seen
    try:
        _check(infer({"data": x}), first, "after net surgery")
    finally:
        net.params["a"][0].data[...] = saved


SHARED_WEIGHTS_NET = (
    'name: "shared" input: "data" input_shape { dim: 1 dim: 3 dim: 6 dim: 6 }\n'
    + _conv("conv", "data", "conv", 8, 3, "pad: 1")
    + _layer("pool", "Pooling", ["conv"], ["pool"], "pooling_param { pool: AVE global_pooling: true }")
    + _layer("fc", "InnerProduct", ["pool"], ["fc"],
             'inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.2 } }')
)


@pytest.mark.parametrize("in_host_memory", [True, False], ids=["compared", "digest"])
def test_programs_for_other_input_shapes_share_the_weights_they_prepare_alike(monkeypatch, in_host_memory):
    """compile_inference's programs for other input shapes read one device copy of each weight they prepare
    alike, and add their own where they do not: the 3x3 convolution's Winograd filters on 6x6 and 6x7 images,
    its plain channels-last ones on 16x16 (WINOGRAD_MAX_SIZE). Off the CPU a digest of the bits stands in for
    the device array (``in_host_memory`` False). (Programs taking their weights as arguments, as those of nets
    with more than inference.CONSTANT_WEIGHTS_MAX_BYTES of them do.)"""
    from caffejax.runtime import inference

    monkeypatch.setattr(inference, "_in_host_memory", lambda array: in_host_memory)
    monkeypatch.setattr(inference, "CONSTANT_WEIGHTS_MAX_BYTES", -1)
    caffejax.set_random_seed(5)
    net = caffejax.Net(SHARED_WEIGHTS_NET, caffejax.TEST)
    infer, plain = caffejax.compile_inference(net), caffejax.compile_inference(net, passes=())
    rng = np.random.default_rng(0)
    shapes = [(2, 3, 6, 6), (1, 3, 6, 6), (1, 3, 16, 16), (1, 3, 6, 7)]
    programs = []
    for shape in shapes:
        x = rng.normal(size=shape).astype(np.float32)
        _check(infer({"data": x}), plain({"data": x}), f"input {shape}")
        programs.append(infer._programs[infer._signature({"data": shape})])
    assert [p.plan.kernels["conv"].name for p in programs] == ["conv_winograd_f2x2_3x3"] * 2 + ["conv_nhwc"] + [
        "conv_winograd_f2x2_3x3"]
    conv = [p.params["conv"][0] for p in programs]
    assert conv[0] is conv[1] is conv[3] and conv[2] is not conv[0] and conv[2].shape != conv[0].shape
    for layer, index in [("conv", 1), ("fc", 0), ("fc", 1)]:  # the bias and the inner product's arrays
        assert all(p.params[layer][index] is programs[0].params[layer][index] for p in programs), (layer, index)


@pytest.mark.parametrize("in_host_memory", [True, False], ids=["compared", "digest"])
def test_shared_weights_keep_one_device_array_per_bits(monkeypatch, in_host_memory):
    """SharedWeights hands back the kept array whose bits, in the weights' dtype, a new one has, and keeps every
    other version beside it: another dtype of the same values shares, other bits, another shape or another
    array of the layer do not, nor does -0.0 with 0.0."""
    from caffejax.runtime import inference

    monkeypatch.setattr(inference, "_in_host_memory", lambda array: in_host_memory)
    shared = inference.SharedWeights(jnp.float32)
    a = np.arange(12, dtype=np.float64).reshape(3, 4)
    first = shared.adopt("l", 0, a)
    assert first.dtype == jnp.float32 and np.array_equal(np.asarray(first), a)
    assert shared.adopt("l", 0, a.astype(np.float32)) is first          # the same bits, in the weights' dtype
    other = shared.adopt("l", 0, a + 1)                                  # other bits: a copy of their own
    assert other is not first and np.array_equal(np.asarray(other), a + 1)
    assert shared.adopt("l", 0, a.copy()) is first and shared.adopt("l", 0, a + 1) is other
    assert shared.adopt("l", 0, a.reshape(4, 3)) is not first            # another shape
    assert shared.adopt("l", 1, a) is not first                          # another array of the layer
    negative_zero = shared.adopt("z", 0, np.zeros(3))
    assert shared.adopt("z", 0, -np.zeros(3)) is not negative_zero       # bits, not values: -0.0 is its own


def test_prepared_weights_are_host_memory_the_device_adopts(zoo):
    """On the CPU each prepared weight is a read-only, 64-byte aligned host array that the device array uses
    as it is (no second copy of the weights at the first call), whatever layout or dtype its kernel wanted."""
    net, x, _ = zoo
    if jax.default_backend() != "cpu":
        pytest.skip("host memory is adopted only by the CPU device")
    for dtype in (np.float32, jnp.bfloat16):
        plan = optimize.optimize(optimize.make_plan(net.graph_at({"data": x.shape}), net.param_arrays()))
        prepared = optimize.prepare_params(plan, dtype)
        assert {k.name for k in plan.kernels.values()} >= {"conv_nhwc", "conv_winograd_f2x2_3x3"}
        for name, arrays in prepared.items():
            for array in arrays:
                assert array.dtype == dtype, name
                host = np.asarray(array)
                assert host.ctypes.data == array.unsafe_buffer_pointer(), name
                assert host.ctypes.data % 64 == 0 and not host.flags.writeable, name


SNAPSHOT_NET = """
name: "snapshot"
layer { name: "data" type: "Input" top: "data" top: "target"
  input_param { shape { dim: 4 dim: 6 } shape { dim: 4 dim: 2 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "ip" bottom: "target" top: "loss" }
"""


def test_compile_inference_keeps_the_nets_device_weights_as_they_are_while_a_solver_steps_on():
    """compile_inference keeps each weight the net holds as an array on the CPU device as a view of that array
    (no copy of the net's weights), and its weights stay those of the moment it was made: a solver's later steps,
    which write their new weights into the buffers of weights nothing else holds, leave its loss as it was."""
    from caffejax.frontend.prototxt import parse_net_text
    from caffejax.proto import caffe_pb2

    if jax.default_backend() != "cpu":
        pytest.skip("host memory is adopted only by the CPU device")
    caffejax.set_random_seed(2)
    param = caffe_pb2.SolverParameter(type="SGD", base_lr=0.1, momentum=0.9, lr_policy="fixed", max_iter=100)
    param.net_param.CopyFrom(parse_net_text(SNAPSHOT_NET))
    solver = caffejax.SGDSolver(param)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(4, 6)).astype(np.float32), rng.normal(size=(4, 2)).astype(np.float32)
    solver.net.blobs["data"].data[...], solver.net.blobs["target"].data[...] = x, y
    solver.step(2)  # the weights are now the step's device arrays, the buffers before them its spares
    infer = caffejax.compile_inference(solver.net)
    weights = solver.net.param_arrays()["ip"]
    for array, kept in zip(weights, infer._weights["ip"]):
        assert isinstance(array, jax.Array) and np.shares_memory(np.asarray(array), kept)
    w, b = (np.array(a, copy=True) for a in weights)
    del weights, array, kept
    expected = ((x @ w.T + b - y) ** 2).sum() / (2 * len(x))
    first = float(infer({"data": x, "target": y})["loss"])
    assert math.isclose(first, expected, rel_tol=1e-5)
    solver.step(4)
    assert not np.allclose(solver.net.params["ip"][0].data, w)  # the net's weights moved on
    assert float(infer({"data": x, "target": y})["loss"]) == first


def test_an_inner_product_on_a_channels_last_value_reads_the_weights_as_the_net_holds_them(zoo, monkeypatch):
    """An InnerProduct reading a channels-last value runs Caffe's rule on that value moved back to NCHW (a
    transpose of the activations): its program reads the weights kept by compile_inference as they are (on the
    CPU, their very memory), not a copy with the columns permuted to channels-last order, which held AlexNet's
    fc6 (151 MB) twice; its forwards took the same time to within 2% (alternating blocks at batch 1 and 16, fp32
    and bf16; fp32 at batch 16 0.4-1.7% slower without the copy). (Weights as arguments, as AlexNet's are: over
    inference.CONSTANT_WEIGHTS_MAX_BYTES.)"""
    from caffejax.runtime import inference

    monkeypatch.setattr(inference, "CONSTANT_WEIGHTS_MAX_BYTES", -1)
    net, x, reference = zoo
    infer = caffejax.compile_inference(net)
    _check(infer({"data": x}), reference, "optimised")
    program = infer._programs[infer._signature({"data": x.shape})]
    layouts = optimize.value_layouts(program.plan.graph, program.plan.kernels)
    for name in ("fc", "fct"):
        layer = next(layer for layer in program.plan.graph.layers if layer.name == name)
        assert layouts.get(layer.bottom_values[0]) == optimize.NHWC and name not in program.plan.kernels
    weight = program.params["fct"][0]  # (fc has a BatchNorm folded into it)
    np.testing.assert_array_equal(np.asarray(weight), net.params["fct"][0].data)
    if jax.default_backend() == "cpu":
        assert np.asarray(weight).ctypes.data == infer._weights["fct"][0].ctypes.data


def test_a_program_keeps_the_weights_its_passes_made_only_in_their_prepared_form(zoo, monkeypatch):
    """A BatchNorm folded into a convolution makes new filters, which the convolution's kernel (Winograd) makes
    its own filters from: the program keeps those alone, its plan the folded ones' shapes (ResNet-50 held 90 MB
    more for each input shape), and ``plan()`` works the folded ones out again for inspection."""
    import gc
    import weakref

    from caffejax.runtime import inference

    net, x, reference = zoo
    folded = {}
    prepare = inference.prepare_params

    def recording(plan, dtype, adopt=None):
        folded.update((name, weakref.ref(plan.params[name][0])) for name in ("a", "b"))
        return prepare(plan, dtype, adopt)

    monkeypatch.setattr(inference, "prepare_params", recording)
    infer = caffejax.compile_inference(net)
    _check(infer({"data": x}), reference, "optimised")
    program = infer._programs[infer._signature({"data": x.shape})]
    assert program.plan.kernels["a"].name == "conv_winograd_f2x2_3x3" and "BatchNorm" not in {
        layer.type for layer in program.plan.graph.layers}
    gc.collect()
    assert folded["a"]() is None and folded["b"]() is None
    assert all(isinstance(a, jax.ShapeDtypeStruct) for arrays in program.plan.params.values() for a in arrays)
    shown = infer.plan({"data": x.shape})
    assert {name: [a.shape for a in arrays] for name, arrays in shown.params.items()} == {
        name: [a.shape for a in arrays] for name, arrays in program.plan.params.items()}
    scale = net.params["a_scale"][0].data / np.sqrt(net.params["a_bn"][1].data / net.params["a_bn"][2].data + 1e-5)
    assert_close(shown.params["a"][0], net.params["a"][0].data * scale[:, None, None, None], 1e-5, 1e-6, "folded")


def test_aligned_copies_keep_values_and_dtype():
    a = np.arange(24, dtype=np.float64).reshape(2, 3, 4).transpose(2, 0, 1)
    for dtype in (None, np.float32, jnp.bfloat16):
        copy = optimize.aligned_copy(a, dtype)
        assert copy.ctypes.data % 64 == 0 and copy.flags.c_contiguous and copy.shape == a.shape
        assert copy.dtype == (a.dtype if dtype is None else dtype)
        np.testing.assert_array_equal(copy.astype(np.float64), a)
    assert optimize.aligned_empty((0, 5), np.float32).shape == (0, 5)


def test_an_input_refilled_after_the_call_does_not_reach_the_program(zoo, monkeypatch):
    """Programs whose inputs go to the device first copy them: a caller refilling its input array for the
    next batch while the program still runs does not change this call's outputs."""
    from caffejax.runtime import inference
    net, x, reference = zoo
    monkeypatch.setattr(inference, "_maps_afresh_on_a_worker", lambda compiled: True)
    infer = caffejax.compile_inference(net, passes=())
    assert infer._program(infer._signature({"data": x.shape})).inputs_to_device_first
    batch = optimize.aligned_copy(x)  # aligned: what the device could take without a copy
    assert inference._inputs_to_device({"data": batch})["data"].unsafe_buffer_pointer() != batch.ctypes.data
    outputs = infer({"data": batch})
    batch[...] = 0
    _check(outputs, reference, "input refilled after the call")


def test_bad_passes_and_inputs_raise(zoo):
    net, x, _ = zoo
    with pytest.raises(caffejax.CaffejaxError, match="unknown optimisation pass"):
        caffejax.compile_inference(net, passes=("fold_batchnorm", "turbo"))
    infer = caffejax.compile_inference(net)
    with pytest.raises(caffejax.CaffejaxError, match="do not match the net's inputs"):
        infer({"image": x})
    with pytest.raises(caffejax.ShapeError):
        infer({"data": x[:, :3]})


@pytest.mark.slow
@pytest.mark.parametrize("prototxt", ["resnet/ResNet-50-deploy.prototxt", "mobilenet/mobilenet_v2_deploy.prototxt",
                                      "bvlc/models/bvlc_googlenet/deploy.prototxt"])
def test_published_nets_keep_outputs(prototxt):
    from conftest import MODELS
    import sys, pathlib
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    from bench.nets import randomize_weights

    net = caffejax.Net(str(MODELS / prototxt), caffejax.TEST)
    randomize_weights(net)
    x = np.random.default_rng(0).random((1,) + tuple(net.blobs[net.inputs[0]].shape[1:]), dtype=np.float32)
    reference = caffejax.compile_inference(net, passes=())({net.inputs[0]: x})
    _check(caffejax.compile_inference(net)({net.inputs[0]: x}), reference, prototxt)


# ---- layout kernels inside Net's own programs (forward, loss and gradients, training) ---------------------------

TRAIN_ZOO = (ZOO.replace("use_global_stats: true", "use_global_stats: false").rsplit("layer {", 1)[0]
             + _layer("label", "Input", [], ["label"], "input_param { shape { dim: 2 } }")
             + _layer("loss", "SoftmaxWithLoss", ["joined", "label"], ["loss"])
             # Dropout keeps Caffe's layout (its mask must be the NCHW program's); a 1x1 GEMM reads it
             + _layer("cdrop", "Dropout", ["cat"], ["cdrop"], "dropout_param { dropout_ratio: 0.3 }")
             + _conv("f", "cdrop", "f", 4, 1)
             + _layer("fpool", "Pooling", ["f"], ["fpool"], "pooling_param { pool: MAX global_pooling: true }")
             + _layer("fflat", "Flatten", ["fpool"], ["fflat"])
             + _layer("loss2", "SoftmaxWithLoss", ["fflat", "label"], ["loss2"], "loss_weight: 0.5"))


def _zoo_net(text, phase, channels_last):
    caffejax.set_random_seed(5)
    net = caffejax.Net(text, phase, channels_last=channels_last)
    _randomize_batchnorm(net)
    return net


def test_layout_kernels_cover_the_zoo():
    graph = caffejax.Net(TRAIN_ZOO, caffejax.TRAIN).graph
    kinds = {kernel.name for kernel in optimize.layout_kernels(graph).values()}
    assert {"conv_nhwc", "conv_1x1_gemm", "pool_nhwc", "concat_nhwc", "lrn_nhwc", "per_channel_nhwc",
            "elementwise"} <= kinds
    assert "conv_winograd_f2x2_3x3" not in kinds
    assert "cdrop" not in optimize.layout_kernels(graph)


# AlexNet's pool1 -> conv2 (group 2) in small: MAX pools read by a convolution split into groups, by a plain
# one, by a depthwise one (not split), and an AVE pool read by a split one.
POOLS_INTO_GROUPS = (
    'name: "groups" input: "data" input_shape { dim: 2 dim: 4 dim: 11 dim: 11 }\n'
    + _conv("a", "data", "a", 8, 3) + _layer("a_relu", "ReLU", ["a"], ["a"])
    + _layer("split_max", "Pooling", ["a"], ["pm"], "pooling_param { pool: MAX kernel_size: 3 stride: 2 }")
    + _conv("g", "pm", "g", 6, 3, "pad: 1 group: 2")
    + _layer("plain_max", "Pooling", ["a"], ["pp"], "pooling_param { pool: MAX kernel_size: 3 stride: 2 }")
    + _conv("c", "pp", "c", 6, 3)
    + _layer("dw_max", "Pooling", ["a"], ["pd"], "pooling_param { pool: MAX kernel_size: 2 stride: 2 }")
    + _conv("dw", "pd", "dw", 8, 3, "group: 8")
    + _layer("split_ave", "Pooling", ["a"], ["pa"], "pooling_param { pool: AVE kernel_size: 3 stride: 2 }")
    + _conv("ga", "pa", "ga", 4, 1, "group: 2")
    + _layer("label", "Input", [], ["label"], "input_param { shape { dim: 2 } }")
    + _layer("fg", "InnerProduct", ["g"], ["fg"], 'inner_product_param { num_output: 5 '
             'weight_filler { type: "gaussian" std: 0.1 } }')
    + _layer("fc", "InnerProduct", ["c"], ["fc"], 'inner_product_param { num_output: 5 '
             'weight_filler { type: "gaussian" std: 0.1 } }')
    + _layer("fd", "InnerProduct", ["dw"], ["fd"], 'inner_product_param { num_output: 5 '
             'weight_filler { type: "gaussian" std: 0.1 } }')
    + _layer("fa", "InnerProduct", ["ga"], ["fa"], 'inner_product_param { num_output: 5 '
             'weight_filler { type: "gaussian" std: 0.1 } }')
    + _layer("sum", "Eltwise", ["fg", "fc", "fd", "fa"], ["sum"])
    + _layer("loss", "SoftmaxWithLoss", ["sum", "label"], ["loss"])
)


def test_max_pools_read_by_split_groups_take_their_differentiated_top_from_reduce_window():
    """Only a MAX pooling that a convolution split into groups reads gets the reduce_window top (AlexNet's
    pool1); the training objective stays Caffe's rules' (loss and every param gradient)."""
    caffejax.set_random_seed(4)
    net = caffejax.Net(POOLS_INTO_GROUPS, caffejax.TRAIN)
    graph = net.graph
    kernels = optimize.layout_kernels(graph)
    assert {name: kernels[name].name for name in ("split_max", "plain_max", "dw_max", "split_ave")} == {
        "split_max": "pool_nhwc_window_top", "plain_max": "pool_nhwc", "dw_max": "pool_nhwc",
        "split_ave": "pool_nhwc"}
    x = np.random.default_rng(3).integers(-3, 4, size=(2, 4, 11, 11)).astype(np.float32)  # ties in the pools
    inputs = {graph.fed["data"]: x, graph.fed["label"]: np.array([1, 3], np.float32)}
    _rules_against_kernels(graph, kernels, net.param_arrays(), inputs)


@pytest.mark.parametrize("phase", [caffejax.TEST, caffejax.TRAIN])
def test_channels_last_net_forward_keeps_every_blob(phase):
    text = ZOO if phase == caffejax.TEST else TRAIN_ZOO
    x = np.random.default_rng(1).normal(size=(2, 8, 9, 9)).astype(np.float32)
    nets = [_zoo_net(text, phase, channels_last) for channels_last in (False, True)]
    for net in nets:
        net.blobs["data"].data[...] = x
        if "label" in net.blobs:
            net.blobs["label"].data[...] = [1, 3]
        net.forward()
    plain, fast = nets
    assert fast.compile_count and fast._program.kernels and not plain._program.kernels
    for name in plain.blobs:
        assert_close(fast.blobs[name].data, plain.blobs[name].data, FORWARD_RTOL, FORWARD_ATOL, name)
    for name in plain.params:  # BatchNorm's TRAIN statistics, written back by forward
        for a, b in zip(fast.params[name], plain.params[name]):
            assert_close(a.data, b.data, FORWARD_RTOL, FORWARD_ATOL, name)


@pytest.mark.parametrize("prepared_apart", [False, True])
def test_a_net_forward_runs_the_inference_kernels_and_its_backward_the_training_ones(monkeypatch, prepared_apart):
    """Net's programs without a backward (Net.forward, its blobs' recomputes) run 1x1 convolutions as ``nhwc``'s
    convolutions, which XLA makes dots of itself, and small 3x3 ones as Winograd, as compile_inference does (both
    faster there); those with a backward run ``conv_gemm``'s products and XLA's convolutions. In bfloat16 on a CPU
    with bfloat16 matrix instructions both multiply. The blobs a forward leaves (BatchNorm folded into Winograd's
    filters, in the forward or, ``prepared_apart``, in a program of their own) and the gradients a backward makes
    after it stay Caffe's."""
    monkeypatch.setattr(caffejax.runtime.net, "PREPARE_WEIGHTS_APART", prepared_apart)
    x = np.random.default_rng(1).normal(size=(2, 8, 9, 9)).astype(np.float32)
    plain, fast = (_zoo_net(TRAIN_ZOO, caffejax.TRAIN, channels_last) for channels_last in (False, True))
    program = fast._program
    pointwise, small_3x3 = {"b", "e", "f"}, {"a", "c", "c5"}
    assert {name for name in pointwise if program.kernels[name].name == "conv_1x1_gemm"} == pointwise
    assert {program.forward_kernels[name].name for name in pointwise} == {"conv_nhwc"}
    assert {program.kernels[name].name for name in small_3x3} == {"conv_nhwc"}
    assert {program.forward_kernels[name].name for name in small_3x3} == {"conv_winograd_f2x2_3x3"}
    assert {name for name, kernel in program.kernels.items()
            if program.forward_kernels[name].name != kernel.name} == pointwise | small_3x3
    for net in (plain, fast):
        net.blobs["data"].data[...] = x
        net.blobs["label"].data[...] = [1, 3]
        net.forward()
    assert bool(_prepared_of(fast)) == prepared_apart
    for name in plain.blobs:  # the blobs the forward did not hand back, recomputed when read, too
        assert_close(fast.blobs[name].data, plain.blobs[name].data, FORWARD_RTOL, FORWARD_ATOL, name)
    for net in (plain, fast):
        net.clear_param_diffs()
        net.backward()
    _assert_gradients_close({name: [p.diff for p in blobs] for name, blobs in fast.params.items()},
                            {name: [p.diff for p in blobs] for name, blobs in plain.params.items()})

    # A Convolution -> BatchNorm -> Scale chain (global statistics) run as Winograd: folded, then transformed.
    x = np.random.default_rng(2).normal(size=(4, 8, 9, 9)).astype(np.float32)
    plain, fast = (_zoo_net(ZOO, caffejax.TEST, channels_last) for channels_last in (False, True))
    for net in (plain, fast):
        net.blobs["data"].reshape(*x.shape)
        net.reshape()
        net.blobs["data"].data[...] = x
        net.forward()
    kernel = fast._program.forward_kernels["a"]
    assert kernel.name == "conv_winograd_f2x2_3x3" and kernel.chain.layers == ("a_bn", "a_scale")
    for name in plain.blobs:
        assert_close(fast.blobs[name].data, plain.blobs[name].data, FORWARD_RTOL, FORWARD_ATOL, name)

    monkeypatch.setattr(caffejax.runtime.net, "bf16_matrix_programs", lambda dtype: True)
    program = _zoo_net(TRAIN_ZOO, caffejax.TRAIN, channels_last=True)._program
    assert program.forward_kernels == program.kernels


def _assert_gradients_close(got, expected):
    """Every param gradient at Caffe's diff tolerance. Some gradients are analytically zero (a bias before a
    TRAIN BatchNorm) and hold only rounding noise: absolute errors are measured against the largest gradient
    of the net."""
    scale = max(float(np.abs(b).max()) for blobs in expected.values() for b in blobs if b is not None)
    for name, blobs in expected.items():
        for i, (a, b) in enumerate(zip(got[name], blobs)):
            if b is not None:
                np.testing.assert_allclose(a, b, rtol=DIFF_RTOL, atol=DIFF_ATOL * scale, err_msg=f"d {name}[{i}]")


def _rules_against_kernels(graph, kernels, params, inputs, seed=0):
    """One training pass (``loss_and_grads``) by Caffe's rules, layer by layer in NCHW, and one with
    ``kernels``; checks the kernels' loss and every param gradient against the rules' and returns both passes'
    ``(loss, grads, (values, updates))``, the rules' first."""
    from caffejax.lower.program import NetProgram

    key = jax.random.key(seed)
    rules, fast = [jax.jit(program.loss_and_grads)(params, inputs, key)
                   for program in (NetProgram(graph), NetProgram(graph, kernels))]
    assert_close(fast[0], rules[0], FORWARD_RTOL, FORWARD_ATOL, "loss")
    _assert_gradients_close(fast[1], rules[1])
    return rules, fast


def test_channels_last_loss_and_gradients_are_caffes():
    """The training objective through the layout kernels: loss, every param gradient, BatchNorm's updates."""
    net = _zoo_net(TRAIN_ZOO, caffejax.TRAIN, channels_last=False)
    graph = net.graph
    rng = np.random.default_rng(2)
    inputs = {graph.fed["data"]: rng.normal(size=(2, 8, 9, 9)).astype(np.float32),
              graph.fed["label"]: np.array([1, 3], np.float32)}
    (_, _, (env, updates)), (_, _, (fast_env, fast_updates)) = _rules_against_kernels(
        graph, optimize.layout_kernels(graph), net.param_arrays(), inputs, seed=7)
    assert updates.keys() == fast_updates.keys() and updates
    for name, changed in updates.items():
        for i, value in changed.items():
            assert_close(fast_updates[name][i], value, FORWARD_RTOL, FORWARD_ATOL, f"{name}[{i}] update")
    for value in env:
        assert np.shape(fast_env[value]) == np.shape(env[value]), value  # every value back in Caffe's layout


def test_channels_last_float64_net_stays_float64():
    import jax

    x = np.random.default_rng(4).normal(size=(2, 8, 9, 9))
    with jax.enable_x64(True):
        outs = []
        for channels_last in (False, True):
            caffejax.set_random_seed(5)
            net = caffejax.Net(ZOO, caffejax.TEST, dtype=np.float64, channels_last=channels_last)
            _randomize_batchnorm(net)
            outs.append(net.forward(data=x)["prob"])
    assert outs[1].dtype == np.float64
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-10, atol=1e-13)


def test_one_layer_runs_as_inside_the_net_with_value_layouts():
    """value_layouts + run_layers(layouts=, restore_layout=False): a layer alone, in the layouts the whole
    net makes its values in (how `caffejax time` and bench.profile time layers)."""
    import jax

    from caffejax.lower.optimize import NCHW, NHWC, to_layout, value_layouts

    net = caffejax.Net(str(BUNDLED / "lenet/lenet.prototxt"), caffejax.TEST)
    program, graph = net._program, net.graph
    params = net.param_arrays()
    fed = {value: np.random.default_rng(0).random(graph.value_shapes[value], dtype=np.float32)
           for value in graph.fed.values()}
    env, _ = program.run_layers(graph.layers, params, fed, None, kernels=program.kernels)
    layouts = value_layouts(graph, program.kernels)
    conv2 = next(layer for layer in graph.layers if layer.name == "conv2")
    assert layouts[conv2.bottom_values[0]] == NHWC and layouts[conv2.top_values[0]] == NHWC
    have = {v: layouts.get(v, NCHW) for v in conv2.bottom_values}
    bottoms = {v: to_layout(env[v], NCHW, have[v]) for v in conv2.bottom_values}
    out, _ = program.run_layers([conv2], params, bottoms, None, kernels=program.kernels, layouts=have,
                                restore_layout=False)
    top = conv2.top_values[0]
    assert out[top].shape == to_layout(env[top], NCHW, NHWC).shape
    np.testing.assert_allclose(np.asarray(out[top]), np.asarray(to_layout(env[top], NCHW, NHWC)), rtol=1e-5,
                               atol=1e-6)
    restored, _ = program.run_layers([conv2], params, bottoms, None, kernels=program.kernels, layouts=have)
    np.testing.assert_allclose(np.asarray(restored[top]), np.asarray(env[top]), rtol=1e-5, atol=1e-6)
    assert jax.tree.structure(restored) == jax.tree.structure(out)


def test_big_one_channel_convolution_runs_as_taps_and_keeps_outputs():
    """LeNet's conv1 (1 channel, 5x5) takes the shifted multiply-adds at batch 16, channels first (the fed
    input's layout: vision.few_channel_convolution), XLA's convolution at batch 1 (too few outputs to pay);
    either way the outputs are Caffe's rules'. Training programs take it too."""
    net = caffejax.Net(str(BUNDLED / "lenet/lenet.prototxt"), caffejax.TEST)
    x = np.random.default_rng(2).random((16, 1, 28, 28), dtype=np.float32)
    reference = caffejax.compile_inference(net, passes=())({"data": x})
    for passes in (("nhwc", "conv_taps"), optimize.DEFAULT_PASSES):
        infer = caffejax.compile_inference(net, passes=passes)
        _check(infer({"data": x}), reference, "+".join(passes))
        assert infer.plan({"data": x.shape}).kernels["conv1"].name == "conv_taps"
        assert infer.plan({"data": x.shape}).kernels["conv1"].layout == optimize.NCHW
        assert infer.plan({"data": (1, 1, 28, 28)}).kernels["conv1"].name == "conv_nhwc"
    net.blobs["data"].reshape(16, 1, 28, 28)
    net.reshape()
    assert optimize.layout_kernels(net.graph)["conv1"].name == "conv_taps"


def test_colour_convolution_with_few_filters_runs_as_taps_and_keeps_outputs():
    """MTCNN's det1 conv1 (3 channels, 3x3, 10 filters) takes the shifted multiply-adds, channels first, in
    compile_inference and in the net's own programs, on a big image and on a small pyramid scale (16450 outputs,
    below the one-channel threshold), but not on the smallest (3910 outputs); det2's (28 filters) keeps XLA's
    convolution; the outputs are Caffe's rules' either way."""
    for name, shape, kernel in (("det1", (1, 3, 240, 320), "conv_taps"), ("det1", (1, 3, 49, 37), "conv_taps"),
                                ("det1", (1, 3, 25, 19), "conv_nhwc"), ("det2", (32, 3, 24, 24), "conv_nhwc")):
        net = caffejax.Net(str(BUNDLED / f"mtcnn/{name}.prototxt"), caffejax.TEST,
                           weights=str(BUNDLED / f"mtcnn/{name}.caffemodel"))
        x = np.random.default_rng(3).random(shape, dtype=np.float32)
        reference = caffejax.compile_inference(net, passes=())({"data": x})
        infer = caffejax.compile_inference(net)
        _check(infer({"data": x}), reference, name)
        assert infer.plan({"data": shape}).kernels["conv1"].name == kernel, name
        net.blobs["data"].reshape(*shape)
        net.reshape()
        assert optimize.layout_kernels(net.graph)["conv1"].name == kernel, name


def test_big_one_channel_convolution_is_written_out_apart_from_the_pooling_reading_it():
    """LeNet's conv1 taps at batch 16 are computed in a conditional (common.unfused), so that pool1's loop reads
    them instead of computing each one again in every window: no computation of the program both multiplies
    (the taps) and selects (the max pooling)."""
    net = caffejax.Net(str(BUNDLED / "lenet/lenet.prototxt"), caffejax.TEST)
    x = np.random.default_rng(2).random((16, 1, 28, 28), dtype=np.float32)
    infer = caffejax.compile_inference(net)
    infer({"data": x})
    hlo = infer._programs[infer._signature({"data": x.shape})].run.as_text()
    entry = hlo[hlo.index("\nENTRY"):]
    if jax.default_backend() == "cpu":  # (common.unfused is the CPU's)
        assert entry.count(" conditional(") == 1
        assert not any(" multiply(" in part and " select(" in part for part in hlo.split("\n\n"))


def test_a_small_nets_program_holds_its_weights_a_bigger_ones_takes_them(monkeypatch):
    """compile_inference's program holds weights of at most inference.CONSTANT_WEIGHTS_MAX_BYTES as constants
    (every argument costs each call its dispatch) and takes bigger ones as arguments, with the same outputs; held,
    LeNet's conv1 taps stay apart from pool1 (common.unfused's test of its constant filters is not folded). A net
    with an array of one value in all that the program multiplies by takes its weights too, one it adds holds them."""
    from caffejax.runtime import inference

    net = caffejax.Net(str(BUNDLED / "lenet/lenet.prototxt"), str(BUNDLED / "lenet/lenet_iter_10000.caffemodel"),
                       caffejax.TEST)
    x = np.random.default_rng(4).random((16, 1, 28, 28), dtype=np.float32)

    def program_of(infer):
        outputs = infer({"data": x})
        program = infer._programs[infer._signature({"data": x.shape})]
        hlo = program.run.as_text()
        return outputs["prob"], program, hlo[hlo.index("\nENTRY"):]

    on_cpu = jax.default_backend() == "cpu"  # (held on the CPU only)
    held, program, entry = program_of(caffejax.compile_inference(net))
    assert (program.params == {}) == on_cpu and entry.count(" parameter(") == (1 if on_cpu else 9)
    assert entry.count(" conditional(") == (1 if on_cpu else 0)
    monkeypatch.setattr(inference, "CONSTANT_WEIGHTS_MAX_BYTES", 1 << 20)  # LeNet's weights take 1.7 MB
    taken, program, entry = program_of(caffejax.compile_inference(net))
    assert len(jax.tree.leaves(program.params)) == 8 and entry.count(" parameter(") == 9  # the input besides
    np.testing.assert_allclose(np.asarray(held), np.asarray(taken), rtol=1e-5, atol=1e-8)
    # An array of one value in all is a broadcast in XLA: added (a bias of zeros), it is held; multiplied by, it
    # would be wrong in XLA:CPU's YNNPACK dot fusions (NaN), and the net takes its weights as arguments.
    monkeypatch.undo()
    net.blobs["data"].reshape(*x.shape)
    net.params["ip1"][1].data[...] = 0
    zero_bias, program, entry = program_of(caffejax.compile_inference(net))
    assert (program.params == {}) == on_cpu
    np.testing.assert_allclose(np.asarray(zero_bias), net.forward(data=x)["prob"], rtol=1e-5, atol=1e-8)
    net.params["ip2"][0].data[...] = 0.25
    uniform, program, entry = program_of(caffejax.compile_inference(net))
    assert len(jax.tree.leaves(program.params)) == 8
    np.testing.assert_allclose(np.asarray(uniform), net.forward(data=x)["prob"], rtol=1e-5, atol=1e-8)


def test_a_program_whose_held_filters_xla_makes_a_broadcast_takes_them_as_arguments():
    """Held as constants, a grouped convolution's filters whose second group is all zeros (a pruned group) are
    sliced by the im2col products one per group; XLA makes that slice a broadcast of 0, which XLA:CPU's YNNPACK
    dot fusions multiply by wrongly (garbage where the output is 0: from 1e-36 to 1e21 in three runs). Such a
    program takes its weights as arguments, and the zeroed group's outputs are exactly 0."""
    text = ('name: "pruned" input: "data" input_shape { dim: 16 dim: 8 dim: 24 dim: 24 }\n'
            + _conv("conv", "data", "conv", 128, 3, "group: 2 bias_term: false"))
    net = caffejax.Net(text, caffejax.TEST)
    net.params["conv"][0].data[64:] = 0
    x = np.random.default_rng(7).random((16, 8, 24, 24), dtype=np.float32)
    expected = net.forward(data=x)["conv"].copy()
    infer = caffejax.compile_inference(net, passes=optimize.DEFAULT_PASSES + ("conv_im2col",))
    got = np.asarray(infer({"data": x})["conv"])
    assert infer._programs[infer._signature({"data": x.shape})].plan.kernels["conv"].name == "conv_im2col"
    assert not got[:, 64:].any()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


# ---- Convolution -> BatchNorm (global statistics) [-> Scale] chains in Net's own programs ---------------------

def _frozen(text):
    return text.replace('type: "Convolution"', 'type: "Convolution" param { lr_mult: 0 }', 1)


CHAIN_NET = (
    'name: "chains" input: "data" input_shape { dim: 2 dim: 6 dim: 7 dim: 7 }\n'
    + _layer("label", "Input", [], ["label"], "input_param { shape { dim: 2 } }")
    # in place, as ResNet writes them: conv with a bias -> BN -> Scale with a bias -> ReLU
    + _conv("a", "data", "a", 8, 3, "pad: 1") + _bn_scale("a", "a") + _layer("a_relu", "ReLU", ["a"], ["a"])
    # 1x1 without bias -> BN alone
    + _conv("b", "a", "b", 8, 1, "bias_term: false") + _bn_scale("b", "b", scale=False)
    # grouped 3x3 -> BN -> Scale without a bias
    + _conv("g", "b", "g", 8, 3, "pad: 1 group: 2 bias_term: false")
    + _layer("g_bn", "BatchNorm", ["g"], ["g"], "batch_norm_param { use_global_stats: true }")
    + _layer("g_scale", "Scale", ["g"], ["g"], 'scale_param { filler { type: "uniform" min: 0.5 max: 1.5 } }')
    # depthwise (the shifted multiply-adds with their own filter gradient) -> BN -> Scale
    + _conv("dw", "g", "dw", 8, 3, "pad: 1 group: 8 bias_term: false") + _bn_scale("dw", "dw")
    # the BatchNorm writes a new blob: the convolution's output is a blob's final value, a visible chain
    + _conv("d", "dw", "d", 8, 1)
    + _layer("d_bn", "BatchNorm", ["d"], ["d_bn"], "batch_norm_param { use_global_stats: true }")
    # a loss weight on a convolution's output: InsertSplits gives it a second reader, so no chain
    + _conv("lw", "data", "lw", 8, 1).replace("} }\n", "} loss_weight: 0.01 }\n", 1)
    + _layer("lw_bn", "BatchNorm", ["lw"], ["lw_bn"], "batch_norm_param { use_global_stats: true }")
    # a second reader of the convolution's output: no chain
    + _conv("m", "data", "m", 8, 1)
    + _layer("m_bn", "BatchNorm", ["m"], ["m_bn"], "batch_norm_param { use_global_stats: true }")
    # propagate_down: false on the BatchNorm stops the gradient inside the chain: run layer by layer
    + _conv("p", "d_bn", "p", 8, 1)
    + _layer("p_bn", "BatchNorm", ["p"], ["p"], "batch_norm_param { use_global_stats: true } propagate_down: false")
    + _layer("p_scale", "Scale", ["p"], ["p"], 'scale_param { bias_term: true }')
    # a frozen convolution of the data with a learnable Scale: no gradient passes the chain, gamma's still comes
    + _frozen(_conv("f", "data", "f", 8, 3, "pad: 1 bias_term: false")) + _bn_scale("f", "f")
    + _layer("sum", "Eltwise", ["p", "f", "a", "m", "m_bn", "lw_bn"], ["sum"])
    + _layer("pool", "Pooling", ["sum"], ["pool"], "pooling_param { pool: AVE global_pooling: true }")
    + _layer("fc", "InnerProduct", ["pool"], ["fc"],
             'inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.2 } }')
    + _layer("loss", "SoftmaxWithLoss", ["fc", "label"], ["loss"])
)


def _chain_net(channels_last=True):
    caffejax.set_random_seed(6)
    net = caffejax.Net(CHAIN_NET, caffejax.TRAIN, channels_last=channels_last)
    _randomize_batchnorm(net)
    return net


def test_batch_norm_chains_form_where_each_inner_value_has_one_reader():
    kernels = optimize.layout_kernels(_chain_net().graph)
    chains = {name: (k.chain.name, k.chain.layers, k.chain.visible) for name, k in kernels.items() if k.chain}
    assert chains == {"a": ("conv_batch_norm_scale", ("a_bn", "a_scale"), False),
                      "b": ("conv_batch_norm", ("b_bn",), False),
                      "g": ("conv_batch_norm_scale", ("g_bn", "g_scale"), False),
                      "dw": ("conv_batch_norm_scale", ("dw_bn", "dw_scale"), False),
                      "d": ("conv_batch_norm", ("d_bn",), True),
                      "p": ("conv_batch_norm_scale", ("p_bn", "p_scale"), False),
                      "f": ("conv_batch_norm_scale", ("f_bn", "f_scale"), False)}
    # BatchNorm with the batch's statistics: nothing to fold
    train_stats = caffejax.Net(CHAIN_NET.replace("use_global_stats: true", "use_global_stats: false"),
                               caffejax.TRAIN).graph
    assert not any(k.chain for k in optimize.layout_kernels(train_stats).values())


def test_a_chain_never_takes_in_a_loss_weighted_value():
    """Its inner values are never made, so a loss weight on one (a graph InsertSplits did not see) ends the
    chain before it."""
    import dataclasses

    graph = _chain_net().graph
    for weighted, layers in (("a", None), ("a_bn", ("a_bn",))):
        changed = [dataclasses.replace(layer, loss_weights=[0.5]) if layer.name == weighted else layer
                   for layer in graph.layers]
        chain = optimize.layout_kernels(dataclasses.replace(graph, layers=changed))["a"].chain
        assert (chain and chain.layers) == layers


def test_batch_norm_chains_keep_caffes_loss_and_gradients():
    """The folded chains differentiated (dx and dW through W' = a W, Scale's gradient through the filter
    gradient) against Caffe's layers one by one in NCHW; the cut chain (propagate_down: false) and the frozen
    convolution under a learnable Scale included."""
    graph = _chain_net().graph
    net = _chain_net(channels_last=False)
    rng = np.random.default_rng(3)
    inputs = {graph.fed["data"]: rng.normal(size=(2, 6, 7, 7)).astype(np.float32),
              graph.fed["label"]: np.array([1, 3], np.float32)}
    (_, _, (env, _)), (_, fast_grads, (fast_env, _)) = _rules_against_kernels(
        graph, optimize.layout_kernels(graph), net.param_arrays(), inputs)
    assert not np.any(fast_grads["p"][0]) and np.any(fast_grads["f_scale"][0]) and not np.any(fast_grads["f"][0])
    inside = {graph.layer(name).top_values[0] for name in ("a", "a_bn", "b", "g", "g_bn", "dw", "dw_bn", "f", "f_bn")}
    assert inside <= set(env) and not inside & set(fast_env)  # the chains ran folded
    assert graph.layer("p").top_values[0] in fast_env          # the cut one did not
    assert graph.layer("d").top_values[0] in fast_env          # nor the visible one (its blob is handed back)


# A stem with a differentiated output, then a 1x1 convolution that widens 64 channels to 80 over 2 x 40 x 40 pixels
# (chained with its BatchNorm and Scale, as ResNet's branch2c) and one that narrows them back.
WIDENING_NET = (
    'name: "widening" input: "data" input_shape { dim: 2 dim: 64 dim: 40 dim: 40 }\n'
    + _layer("label", "Input", [], ["label"], "input_param { shape { dim: 2 } }")
    + _conv("stem", "data", "stem", 64, 3, "pad: 1") + _layer("stem_relu", "ReLU", ["stem"], ["stem"])
    + _conv("wide", "stem", "wide", 80, 1) + _bn_scale("wide", "wide") + _layer("wide_relu", "ReLU", ["wide"], ["wide"])
    + _conv("narrow", "wide", "narrow", 64, 1)
    + _layer("pool", "Pooling", ["narrow"], ["pool"], "pooling_param { pool: AVE global_pooling: true }")
    + _layer("fc", "InnerProduct", ["pool"], ["fc"],
             'inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.2 } }')
    + _layer("loss", "SoftmaxWithLoss", ["fc", "label"], ["loss"])
)


def test_a_widening_1x1_filter_gradient_reads_its_diff_by_filter_rows_and_keeps_caffes_gradients():
    """On the CPU, a 1x1 product with more filters than channels (and enough channels and pixels) takes its
    filter gradient from dy written out as C_out x pixels (optimize._widening_product); the narrowing one keeps
    the plain product. Loss and every gradient (the stem's through the widening product's input gradient)
    against Caffe's layers one by one."""
    from caffejax.lower.program import NetProgram

    net = caffejax.Net(WIDENING_NET, caffejax.TRAIN, channels_last=False)
    _randomize_batchnorm(net)
    graph = net.graph
    shapes = {name: optimize._conv_shape(graph.layer(name), graph) for name in ("wide", "narrow")}
    assert shapes["wide"].is_pointwise and shapes["narrow"].is_pointwise
    on_cpu = jax.default_backend() == "cpu"
    assert optimize._filter_gradient_by_filter_rows(shapes["wide"], np.dtype(np.float32)) == on_cpu
    assert not optimize._filter_gradient_by_filter_rows(shapes["narrow"], np.dtype(np.float32))
    assert not optimize._filter_gradient_by_filter_rows(shapes["wide"], np.dtype(jnp.bfloat16))
    fewer_pixels = dataclasses.replace(shapes["wide"], batch=1)  # 1600 pixels
    assert not optimize._filter_gradient_by_filter_rows(fewer_pixels, np.dtype(np.float32))

    rng = np.random.default_rng(8)
    inputs = {graph.fed["data"]: rng.normal(size=(2, 64, 40, 40)).astype(np.float32),
              graph.fed["label"]: np.array([1, 3], np.float32)}
    kernels = optimize.layout_kernels(graph)
    assert kernels["wide"].name == "conv_1x1_gemm" and kernels["wide"].chain
    _rules_against_kernels(graph, kernels, net.param_arrays(), inputs)
    if on_cpu:  # the copy of dy between its two barriers is made once, for the widening product alone
        jaxpr = str(jax.make_jaxpr(NetProgram(graph, kernels).loss_and_grads)(
            net.param_arrays(), inputs, jax.random.key(0)))
        assert jaxpr.count("optimization_barrier") == 2


def test_a_one_channel_convolution_chains_with_its_batch_norm():
    """A gray image's first convolution runs as taps (conv_taps, channels first) and still folds the
    BatchNorm -> Scale after it; the step keeps Caffe's loss and gradients."""
    text = ('name: "gray" input: "data" input_shape { dim: 2 dim: 1 dim: 68 dim: 68 }\n'
            + _layer("label", "Input", [], ["label"], "input_param { shape { dim: 2 } }")
            + _conv("t", "data", "t", 8, 3, "pad: 1") + _bn_scale("t", "t")
            + _layer("pool", "Pooling", ["t"], ["pool"], "pooling_param { pool: MAX kernel_size: 4 stride: 4 }")
            + _layer("fc", "InnerProduct", ["pool"], ["fc"],
                     'inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.05 } }')
            + _layer("loss", "SoftmaxWithLoss", ["fc", "label"], ["loss"]))
    caffejax.set_random_seed(2)
    net = caffejax.Net(text, caffejax.TRAIN)
    _randomize_batchnorm(net)
    graph = net.graph
    kernels = optimize.layout_kernels(graph)
    assert kernels["t"].name == "conv_taps" and kernels["t"].chain.layers == ("t_bn", "t_scale")
    rng = np.random.default_rng(4)
    inputs = {graph.fed["data"]: rng.normal(size=(2, 1, 68, 68)).astype(np.float32),
              graph.fed["label"]: np.array([1, 3], np.float32)}
    (_, _, (env, _)), (_, _, (fast_env, _)) = _rules_against_kernels(graph, kernels, net.param_arrays(), inputs)
    assert graph.layer("t").top_values[0] in env and graph.layer("t").top_values[0] not in fast_env  # folded


def test_a_net_run_that_cuts_a_chain_runs_its_layers_one_by_one():
    """Net.forward(end=...) stopping inside a chain leaves Caffe's value of the blob there; a whole run and a
    run from a chain's middle agree with the NCHW net's too."""
    x = np.random.default_rng(4).normal(size=(2, 6, 7, 7)).astype(np.float32)
    nets = [_chain_net(channels_last) for channels_last in (False, True)]
    for end in ("a_bn", "g_scale", "loss"):
        for net in nets:
            net.blobs["data"].data[...] = x
            net.blobs["label"].data[...] = [0, 2]
            net.forward(end=end)
        for name in ("a", "g", "loss"):
            assert_close(nets[1].blobs[name].data, nets[0].blobs[name].data, FORWARD_RTOL, FORWARD_ATOL,
                         f"{name} after forward(end={end})")
    for net in nets:
        net.forward(start="a_scale")
    for name in ("loss", "d_bn", "d"):  # "d", inside a visible chain: made again, layer by layer, when read
        assert_close(nets[1].blobs[name].data, nets[0].blobs[name].data, FORWARD_RTOL, FORWARD_ATOL, name)


def test_a_forward_folds_a_visible_chain_and_makes_its_blobs_when_read():
    """Net.forward's pass folds the chain whose convolution writes a blob of its own (MobileNet's BatchNorms
    write new blobs); the blob is made again, layer by layer, on its first read."""
    net = _chain_net()
    graph, program = net.graph, net._program
    inside = graph.layer("d").top_values[0]
    env = {graph.fed["data"]: np.zeros((2, 6, 7, 7), np.float32), graph.fed["label"]: np.zeros(2, np.float32)}
    def values_made(**options):  # traced only: which values the pass makes, not their numbers
        return jax.eval_shape(lambda p: program.run_layers(graph.layers, p, env, None, kernels=program.kernels,
                                                           **options), net.param_arrays())[0]

    folded, plain = values_made(fold_visible=True), values_made()
    assert inside not in folded and inside in plain
    x = np.random.default_rng(8).normal(size=(2, 6, 7, 7)).astype(np.float32)
    reference = _chain_net(channels_last=False)
    for n in (net, reference):
        n.forward(data=x, label=np.array([1, 1], np.float32))
    assert net.blobs["d"]._data._pending is not None  # not handed back by the pass
    for name in ("loss", "d", "d_bn", "sum"):
        assert_close(net.blobs[name].data, reference.blobs[name].data, FORWARD_RTOL, FORWARD_ATOL, name)


def _prepared_of(net):
    """The weights a net's whole forward read prepared (Net._prepared_weights: the entry of its current program)."""
    return next(entry.arrays for entry in net._prepared[(0, len(net.layers) - 1, True)]
                if entry.program is net._program)


def test_a_forward_over_the_same_weights_prepares_them_once(monkeypatch):
    """Net.forward's kernels read their weights prepared (channels-last filters, BatchNorm folded into them) by a
    program of their own, made again only when a weight is another array: net surgery through ``.data``, held or
    not, reaches the next forward. The prepared arrays keep no weight alive."""
    import gc
    import weakref

    import caffejax.runtime.net as net_module

    x = np.random.default_rng(9).normal(size=(2, 6, 7, 7)).astype(np.float32)
    net, reference = _chain_net(), _chain_net(channels_last=False)

    def forward_both():
        for n in (net, reference):
            n.forward(data=x, label=np.array([1, 3], np.float32))
        for name in ("loss", "sum", "fc"):
            assert_close(net.blobs[name].data, reference.blobs[name].data, FORWARD_RTOL, FORWARD_ATOL, name)

    forward_both()
    prepared = _prepared_of(net)
    assert {"a", "b", "g", "dw", "d", "p", "f"} <= set(prepared)  # every chain's convolution
    forward_both()
    assert _prepared_of(net) is prepared
    for n in (net, reference):  # not held
        n.params["a"][0].data[...] *= 2
    forward_both()
    assert _prepared_of(net) is not prepared
    held = [n.params["g_bn"][0].data for n in (net, reference)]
    for mean in held:
        mean += 1.0
    forward_both()
    old = weakref.ref(net.param_arrays()["b"][0])
    net.params["b"][0].data[...] = 0.5
    reference.params["b"][0].data[...] = 0.5
    forward_both()
    gc.collect()
    assert old() is None
    # A forward in two parts keeps each part's prepared weights; layer by layer (a callback set) none are made.
    kinds = []
    jitted = caffejax.Net._jitted
    monkeypatch.setattr(caffejax.Net, "_jitted", lambda self, kind, *args, **kwargs: (
        kinds.append(kind) if self is net else None, jitted(self, kind, *args, **kwargs))[1])
    parts, last = [], len(net.layers) - 1
    for _ in range(2):
        for n in (net, reference):
            n.forward(end="b_bn")
            n.forward(start="g")
        parts.append([entry.arrays for (start, end, _), entries in net._prepared.items() if (start, end) != (0, last)
                      for entry in entries])
    assert len(parts[0]) == 2 and all(a is b for a, b in zip(*parts))
    assert kinds.count("prepare") == 2
    for name in ("loss", "sum"):
        assert_close(net.blobs[name].data, reference.blobs[name].data, FORWARD_RTOL, FORWARD_ATOL, name)
    net._prepared.clear()
    net.after_forward(lambda i: None)
    net.forward()
    assert net._prepared == {}
    monkeypatch.setattr(net_module, "PREPARE_WEIGHTS_APART", False)  # laid out in the forward itself
    net, reference = _chain_net(), _chain_net(channels_last=False)
    forward_both()
    assert _prepared_of(net) == {}


SHAPES_NET = (
    'name: "shapes" input: "data" input_shape { dim: 1 dim: 1 dim: 28 dim: 28 }\n'
    + _conv("gray", "data", "gray", 20, 5)   # one input channel: shifted multiply-adds from 6 images on
    + _conv("c", "gray", "c", 8, 3, "pad: 1") + _bn_scale("c", "c")
)


def test_a_forward_at_other_input_shapes_takes_the_weights_prepared_alike(monkeypatch):
    """Net.forward's program for other input shapes reads the weights another one prepared where its
    preparation computes the same (Net._preparation_digest), without compiling a preparation of its own; where
    it differs it makes its own: from 6 images on the one-channel convolution runs as shifted multiply-adds
    (conv_taps), which read its filters as they are."""
    kinds = []
    jitted = caffejax.Net._jitted
    caffejax.set_random_seed(7)
    net = caffejax.Net(SHAPES_NET, caffejax.TEST)
    _randomize_batchnorm(net)
    reference = caffejax.Net(SHAPES_NET, caffejax.TEST, channels_last=False)
    for name, blobs in net.params.items():
        for mine, theirs in zip(blobs, reference.params[name]):
            theirs.data[...] = mine.data

    def traced(self, kind, start, end, build, **kwargs):  # each trace of a program is one compile
        def counted(*args):
            if self is net:
                kinds.append(kind)
            return build(*args)
        return jitted(self, kind, start, end, counted, **kwargs)

    monkeypatch.setattr(caffejax.Net, "_jitted", traced)
    rng = np.random.default_rng(3)
    prepared = []
    for batch in (1, 2, 8, 1, 2, 8):
        x = rng.normal(size=(batch, 1, 28, 28)).astype(np.float32)
        for n in (net, reference):
            n.blobs["data"].reshape(*x.shape)
            n.forward(data=x)
        assert_close(net.blobs["c"].data, reference.blobs["c"].data, FORWARD_RTOL, FORWARD_ATOL, f"batch {batch}")
        prepared.append(_prepared_of(net))
    assert prepared[1] is prepared[0] and prepared[4] is prepared[3]  # batch 2 takes batch 1's
    assert prepared[3] is prepared[0] and prepared[5] is prepared[2]  # each form kept, not made again
    assert {"gray", "c"} <= set(prepared[0]) and set(prepared[2]) == {"c"}  # batch 8's conv_taps reads them as is
    assert kinds.count("prepare") == 2  # batch 1's and batch 8's: batch 2 compiled none


def test_gradient_masks_reach_the_layers_inside_a_chain():
    """caffejax.value_and_grad's layer and param masks on a chain's convolution and Scale: the same gradients
    as the NCHW net's, where the chain runs layer by layer."""
    import jax

    x = np.random.default_rng(5).normal(size=(2, 6, 7, 7)).astype(np.float32)
    prune = (np.random.default_rng(6).random((8, 6, 3, 3)) > 0.5).astype(np.float32)
    masks = {"layers": {"a_scale": 0.0, "g_bn": 0.0}, "params": {("a", 0): prune, ("g_scale", 0): np.full(8, 0.5)}}
    results = []
    for channels_last in (False, True):
        net = _chain_net(channels_last)
        fn = caffejax.value_and_grad(net, masks=masks)
        results.append(jax.jit(fn)(net.param_arrays(), {"data": x, "label": np.array([2, 0], np.float32)}))
    (loss, grads), (fast_loss, fast_grads) = results
    assert_close(fast_loss, loss, FORWARD_RTOL, FORWARD_ATOL, "loss")
    _assert_gradients_close(fast_grads, grads)
    assert not np.any(fast_grads["a_scale"][0]) and not np.any(fast_grads["a"][0][prune == 0])


def test_blob_masks_run_with_the_layout_kernels():
    """caffejax.value_and_grad's blob masks keep the layout kernels (channels-last convolutions, chains): a mask
    given in Caffe's NCHW layout scales the gradient of a value made channels-last, and a chain whose inner value
    is masked runs layer by layer. The same loss and gradients as the NCHW net's."""
    import jax

    rng = np.random.default_rng(7)
    x = rng.normal(size=(2, 6, 7, 7)).astype(np.float32)
    masks = {"blobs": {"a": rng.uniform(0, 2, (1, 8, 1, 1)).astype(np.float32),  # inside the chain a -> a_relu
                       "d": rng.uniform(0, 2, 7).astype(np.float32),  # inside the visible chain d -> d_bn, by W
                       "sum": rng.uniform(0, 2, (2, 8, 7, 7)).astype(np.float32), "m": 0.5}}
    results, texts = [], []
    for channels_last in (False, True):
        net = _chain_net(channels_last)
        fn = caffejax.value_and_grad(net, masks=masks)
        inputs = {"data": x, "label": np.array([2, 0], np.float32)}
        texts.append(str(jax.make_jaxpr(fn)(net.param_arrays(), inputs)))
        results.append(jax.jit(fn)(net.param_arrays(), inputs))
    (loss, grads), (fast_loss, fast_grads) = results
    assert "lhs_spec=(0, 1, 2, 3)" not in texts[1] and "lhs_spec=(0, 1, 2, 3)" in texts[0]  # NHWC convolutions
    assert_close(fast_loss, loss, FORWARD_RTOL, FORWARD_ATOL, "loss")
    _assert_gradients_close(fast_grads, grads)
    _, unmasked = caffejax.value_and_grad(_chain_net(False))(_chain_net(False).param_arrays(), inputs)
    assert not np.allclose(grads["a"][0], unmasked["a"][0], rtol=1e-3)  # the masks changed what they reach


def test_a_solver_step_folds_visible_chains_and_keeps_caffes_weights(monkeypatch):
    """A Solver iteration hands back only the loss (one pass, one device), so it folds the visible chain too;
    its convolution's blob is made when read. Weights after two SGD steps and the blobs equal a solver's
    without chains."""
    from caffejax.lower.program import NetProgram
    from caffejax.proto import caffe_pb2
    from caffejax.frontend.prototxt import parse_net_text

    def solver():
        param = caffe_pb2.SolverParameter(type="SGD", base_lr=0.1, momentum=0.9, lr_policy="fixed", max_iter=5)
        param.net_param.CopyFrom(parse_net_text(CHAIN_NET))
        caffejax.set_random_seed(6)
        s = caffejax.get_solver(param)
        _randomize_batchnorm(s.net)
        s.net.blobs["data"].data[...] = np.random.default_rng(9).normal(size=(2, 6, 7, 7))
        s.net.blobs["label"].data[...] = [3, 1]
        return s

    folds = []
    run_layers = NetProgram.run_layers
    monkeypatch.setattr(NetProgram, "run_layers", lambda self, *a, **k: folds.append(k.get("fold_visible"))
                        or run_layers(self, *a, **k))
    chained = solver()
    assert chained.net._program.kernels["d"].chain.visible
    chained.step(2)
    assert folds and all(folds)  # both traces of the iteration (the step program is traced once)
    monkeypatch.setattr(optimize, "batch_norm_chains", lambda graph, kernels: dict(kernels))
    plain = solver()
    assert not any(k.chain for k in plain.net._program.kernels.values())
    plain.step(2)
    for name, blobs in plain.net.params.items():
        for i, blob in enumerate(blobs):
            assert_close(chained.net.params[name][i].data, blob.data, FORWARD_RTOL, FORWARD_ATOL, f"{name}[{i}]")
    for name in ("d", "d_bn", "lw", "lw_bn", "loss"):
        assert_close(chained.net.blobs[name].data, plain.net.blobs[name].data, FORWARD_RTOL, FORWARD_ATOL, name)


def test_backward_passes_run_only_the_chains_that_pay_there(monkeypatch):
    """Differentiated, a chain costs passes over its filters: backward passes run it only where the output has
    enough values per filter value (CHAIN_BACKWARD_MIN_RATIO); forward passes run every chain. The gradients
    are Caffe's either way."""
    import jax

    from caffejax.lower.program import NetProgram

    monkeypatch.setattr(optimize, "CHAIN_BACKWARD_MIN_RATIO", 5.0)  # batch 2 x 7x7 outputs: 98 per filter
    net = _chain_net()
    graph = net.graph
    kernels = optimize.layout_kernels(graph)
    # 3x3 over 6 channels (54 per filter), 3x3 over 8 in groups of 4 (36): 98 / 54 and 98 / 36 < 5
    assert {name for name, k in kernels.items() if k.chain and not k.chain.differentiated} == {"a", "g", "f"}
    rng = np.random.default_rng(3)
    inputs = {graph.fed["data"]: rng.normal(size=(2, 6, 7, 7)).astype(np.float32),
              graph.fed["label"]: np.array([1, 3], np.float32)}
    params, key = net.param_arrays(), jax.random.key(0)
    _, (_, _, (env, _)) = _rules_against_kernels(graph, kernels, params, inputs)
    value = {name: graph.layer(name).top_values[0] for name in ("a", "b", "g", "dw")}
    assert value["a"] in env and value["g"] in env and value["b"] not in env and value["dw"] not in env
    forward, _ = NetProgram(graph, kernels).run_layers(graph.layers, params, inputs, key, kernels=kernels)
    assert not set(value.values()) & set(forward)


def test_net_backward_folds_the_visible_chains_when_it_makes_no_inner_diff():
    """Net.backward hands back diffs only, so a pass asked for no diff inside the net folds the visible chain
    (d -> d_bn, whose convolution output is a blob) as a solver iteration does: its inner value is never made.
    Asked for that value's diff, the pass runs in Caffe's layout. The diffs are the NCHW net's either way."""
    net, reference = _chain_net(), _chain_net(channels_last=False)
    graph, program = net.graph, net._program
    data, inside = graph.fed["data"], graph.layer("d").top_values[0]
    x = np.random.default_rng(9).normal(size=(2, 6, 7, 7)).astype(np.float32)
    label = np.array([1, 3], np.float32)
    env = {data: x, graph.fed["label"]: label}
    seeds = {graph.layer("loss").top_values[0]: np.float32(1)}
    def values_made(diff_values):  # traced only: which values the pass makes, not their numbers
        return jax.eval_shape(lambda p: program.forward_backward(p, env, seeds, diff_values=diff_values),
                              net.param_arrays())[0]

    folded, layer_by_layer = values_made((data,)), values_made((data, inside))
    assert inside not in folded and inside in layer_by_layer
    for n in (net, reference):
        n.forward(data=x, label=label)
        n.backward()
    for name in ("d", "d_bn", "a", "fc"):
        for i, blob in enumerate(net.params[name]):
            assert_close(blob.diff, reference.params[name][i].diff, DIFF_RTOL, DIFF_ATOL, f"{name}[{i}]")
    for name in ("d", "d_bn", "sum"):  # made when read, in Caffe's layout
        assert_close(net.blobs[name].diff, reference.blobs[name].diff, DIFF_RTOL, DIFF_ATOL, name)
