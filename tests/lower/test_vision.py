"""Vision layer rules against BVLC Caffe's reference figures, plus the semantics the figures do not pin down
(checked against small numpy transcriptions of Caffe's CPU loops)."""

from __future__ import annotations

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from caffejax.errors import ShapeError
from caffejax.lower.registry import TEST, TRAIN, LayerContext, get_rule
from conftest import FORWARD_ATOL, FORWARD_RTOL, assert_close
from rule_harness import layer_forward, layer_vjp, parse_layer, reference_case, run_reference_case

# ---- the reference cases (float32 through the Net: tests/test_reference.py) ------------------------------------

VISION_CASES = [
    "conv_3d", "conv_basic", "conv_depthwise", "conv_dilation", "conv_group", "conv_nobias_1x1",
    "conv_pad_stride", "conv_rect", "deconv_bilinear_nobias", "deconv_group", "deconv_stride2",
    "pool_ave_ceil_overhang", "pool_ave_pad", "pool_floor", "pool_global_ave", "pool_global_max",
    "pool_max_ceil", "pool_max_pad", "pool_max_two_tops", "pool_rect", "lrn_across", "lrn_within", "spp",
    "im2col", "crop",
]


@pytest.mark.parametrize("name", VISION_CASES)
def test_reference_case_float64(name):
    run_reference_case(name, np.float64)


@pytest.mark.parametrize("name", ["conv_3d", "deconv_stride2", "pool_max_two_tops", "spp", "lrn_across"])
def test_jit_and_eval_shape_agree(name):
    case, _, (lp,) = reference_case(name)
    ref = case.figures
    bottoms = [jnp.asarray(ref[f"input/{b}"]) for b in lp.bottom]
    params = [jnp.asarray(ref[k]) for k in sorted(k for k in ref if k.startswith(f"param/{lp.name}/"))]
    rule = get_rule(lp.type)
    ctx = LayerContext(layer=lp, phase=TEST, key=jax.random.key(0), num_tops=len(lp.top))
    fn = lambda bs, ps: list(rule.forward(ctx, bs, ps))  # noqa: E731
    shapes = jax.eval_shape(fn, bottoms, params)
    tops = jax.jit(fn)(bottoms, params)
    assert [s.shape for s in shapes] == [ref[f"data/{t}"].shape for t in lp.top]
    for t, y in zip(lp.top, tops):
        assert_close(y, ref[f"data/{t}"], FORWARD_RTOL, FORWARD_ATOL, f"{name}: jitted top {t}")


# ---- numpy transcriptions of Caffe's loops ---------------------------------------------------------------------

def caffe_pool(x, method, kernel, stride, pad, out):
    """pooling_layer.cpp Forward_cpu for MAX (top, mask) and AVE (top, pool_size)."""
    n, c, h, w = x.shape
    top = np.zeros((n, c) + out, x.dtype)
    extra = np.zeros((n, c) + out, x.dtype)
    for i, j, ph, pw in itertools.product(range(n), range(c), range(out[0]), range(out[1])):
        hs, ws = ph * stride[0] - pad[0], pw * stride[1] - pad[1]
        if method == "MAX":
            he, we = min(hs + kernel[0], h), min(ws + kernel[1], w)
            hs, ws = max(hs, 0), max(ws, 0)
            best, idx = -np.finfo(np.float32).max, -1
            for hh, ww in itertools.product(range(hs, he), range(ws, we)):
                if x[i, j, hh, ww] > best:
                    best, idx = x[i, j, hh, ww], hh * w + ww
            top[i, j, ph, pw], extra[i, j, ph, pw] = best, idx
        else:
            he, we = min(hs + kernel[0], h + pad[0]), min(ws + kernel[1], w + pad[1])
            size = (he - hs) * (we - ws)
            hs, ws, he, we = max(hs, 0), max(ws, 0), min(he, h), min(we, w)
            top[i, j, ph, pw] = x[i, j, hs:he, ws:we].sum() / size
            extra[i, j, ph, pw] = size
    return top, extra


def caffe_max_pool_backward(x_shape, mask, dy):
    """Backward_cpu for MAX: bottom_diff[mask] += top_diff."""
    n, c, h, w = x_shape
    dx = np.zeros((n, c, h * w), dy.dtype)
    for i, j in itertools.product(range(n), range(c)):
        np.add.at(dx[i, j], mask[i, j].astype(int).ravel(), dy[i, j].ravel())
    return dx.reshape(x_shape)


def caffe_im2col(x, kernel, stride, pad, dilation, out):
    """im2col_nd_cpu for one image x (C, *spatial): (C * prod(kernel), *out)."""
    c = x.shape[0]
    cols = np.zeros((c,) + tuple(kernel) + tuple(out), x.dtype)
    for offset in itertools.product(*(range(k) for k in kernel)):
        for o in itertools.product(*(range(n) for n in out)):
            pos = [oi * s - p + t * d for oi, s, p, t, d in zip(o, stride, pad, offset, dilation)]
            if all(0 <= q < n for q, n in zip(pos, x.shape[1:])):
                cols[(slice(None),) + offset + o] = x[(slice(None),) + tuple(pos)]
    return cols.reshape((c * int(np.prod(kernel)),) + tuple(out))


def caffe_col2im(cols, channels, spatial, kernel, stride, pad, dilation):
    """col2im_nd_cpu: accumulate columns (C * prod(kernel), *cols_spatial) into an image (C, *spatial)."""
    out = cols.shape[1:]
    cols = cols.reshape((channels,) + tuple(kernel) + tuple(out))
    x = np.zeros((channels,) + tuple(spatial), cols.dtype)
    for offset in itertools.product(*(range(k) for k in kernel)):
        for o in itertools.product(*(range(n) for n in out)):
            pos = [oi * s - p + t * d for oi, s, p, t, d in zip(o, stride, pad, offset, dilation)]
            if all(0 <= q < n for q, n in zip(pos, spatial)):
                x[(slice(None),) + tuple(pos)] += cols[(slice(None),) + offset + o]
    return x


def caffe_conv(x, w, b, group, kernel, stride, pad, dilation):
    """ConvolutionLayer::Forward_cpu: per image, W (per group) times im2col."""
    ext = [d * (k - 1) + 1 for k, d in zip(kernel, dilation)]
    out = tuple((n + 2 * p - e) // s + 1 for n, p, e, s in zip(x.shape[2:], pad, ext, stride))
    cout = w.shape[0]
    ys = []
    for img in x:
        cols = caffe_im2col(img, kernel, stride, pad, dilation, out).reshape(group, -1, int(np.prod(out)))
        y = np.einsum("gok,gkl->gol", w.reshape(group, cout // group, -1), cols).reshape((cout,) + out)
        ys.append(y if b is None else y + b.reshape((-1,) + (1,) * len(out)))
    return np.stack(ys)


def caffe_deconv(x, w, b, group, kernel, stride, pad, dilation):
    """DeconvolutionLayer::Forward_cpu: per image, col = W^T x per group, then col2im into the top."""
    ext = [d * (k - 1) + 1 for k, d in zip(kernel, dilation)]
    out = tuple(s * (n - 1) + e - 2 * p for n, p, e, s in zip(x.shape[2:], pad, ext, stride))
    cin, cout = w.shape[0], w.shape[1] * group
    ys = []
    for img in x:
        wg = w.reshape(group, cin // group, -1)                    # (g, Cin/g, Cout/g * K)
        cols = np.einsum("gik,gil->gkl", wg, img.reshape(group, cin // group, -1))
        y = caffe_col2im(cols.reshape((-1,) + x.shape[2:]), cout, out, kernel, stride, pad, dilation)
        ys.append(y if b is None else y + b.reshape((-1,) + (1,) * len(out)))
    return np.stack(ys)


# ---- Pooling -----------------------------------------------------------------------------------------------------

POOL_CONFIGS = [
    # (kernel, stride, pad, round_mode, (H, W))
    ((3, 3), (2, 2), (0, 0), "CEIL", (7, 8)),
    ((3, 3), (2, 2), (1, 1), "CEIL", (6, 6)),
    ((3, 3), (3, 3), (0, 0), "CEIL", (8, 8)),
    ((2, 2), (2, 2), (0, 0), "CEIL", (7, 8)),    # LeNet's, the last row's windows cropped
    ((2, 3), (1, 2), (1, 0), "CEIL", (5, 7)),
    ((3, 2), (2, 3), (2, 1), "FLOOR", (9, 7)),
    ((4, 4), (3, 3), (1, 1), "CEIL", (10, 11)),
    ((5, 5), (2, 2), (2, 2), "CEIL", (9, 11)),   # three windows reach one cell per axis
    ((3, 3), (2, 2), (1, 1), "FLOOR", (7, 9)),
    # stride 1
    ((3, 3), (1, 1), (1, 1), "CEIL", (6, 7)),
    ((2, 3), (1, 1), (0, 1), "FLOOR", (5, 6)),
    ((3, 2), (1, 1), (0, 0), "CEIL", (4, 5)),
]


def _pool_layer(method, kernel, stride, pad, round_mode, tops=("y",)):
    top = " ".join(f'top: "{t}"' for t in tops)
    return parse_layer(f'name: "p" type: "Pooling" bottom: "x" {top} pooling_param {{ pool: {method} '
                       f'kernel_h: {kernel[0]} kernel_w: {kernel[1]} stride_h: {stride[0]} stride_w: {stride[1]} '
                       f'pad_h: {pad[0]} pad_w: {pad[1]} round_mode: {round_mode} }}')


@pytest.mark.parametrize("kernel,stride,pad,round_mode,size", POOL_CONFIGS)
def test_max_pool_ties_mask_and_gradient_follow_caffe(kernel, stride, pad, round_mode, size):
    # Small integers make many ties: the first maximum in row-major window order must win, and the gradient of
    # overlapping windows must accumulate on it.
    rng = np.random.default_rng(0)
    x = rng.integers(-2, 3, size=(2, 3) + size).astype(np.float32)
    lp = _pool_layer("MAX", kernel, stride, pad, round_mode, tops=("y", "mask"))
    y, mask = layer_forward(lp, [x])
    ref_y, ref_mask = caffe_pool(x, "MAX", kernel, stride, pad, y.shape[2:])
    np.testing.assert_array_equal(np.asarray(y), ref_y)
    np.testing.assert_array_equal(np.asarray(mask), ref_mask)
    dy = rng.normal(size=y.shape).astype(np.float32)
    _, (dx,), _ = layer_vjp(_pool_layer("MAX", kernel, stride, pad, round_mode), [x], [dy])
    # Where overlapping windows send several diffs to one element, they are added in Caffe's loop order
    # (outputs row-major, from zero), so even the float32 rounding is Caffe's.
    np.testing.assert_array_equal(np.asarray(dx), caffe_max_pool_backward(x.shape, ref_mask, dy))


@pytest.mark.parametrize("kernel,stride,pad,round_mode,size", POOL_CONFIGS)
def test_max_pool_channels_last_gradient_is_the_nchw_one(kernel, stride, pad, round_mode, size):
    """The channels-last kernels (Net, training) pool with the spatial axes at 1: the same routing."""
    from caffejax.lower import vision

    rng = np.random.default_rng(1)
    x = rng.integers(-2, 3, size=(2, 3) + size).astype(np.float32)
    g = vision.pooling_geometry(_pool_layer("MAX", kernel, stride, pad, round_mode), x.shape)
    dy = rng.normal(size=(2, 3) + g.out).astype(np.float32)
    def pullback(first_axis):  # jitted: run eagerly, each small operation of the backward compiles alone
        return jax.jit(lambda x, dy: jax.vjp(lambda x: vision.max_pool(x, g, first_axis)[0], x)[1](dy)[0])

    nchw = pullback(2)(x, dy)
    nhwc = pullback(1)(x.transpose(0, 2, 3, 1), dy.transpose(0, 2, 3, 1))
    np.testing.assert_array_equal(np.asarray(nhwc).transpose(0, 3, 1, 2), np.asarray(nchw))


def test_max_pool_gradient_of_windows_apart_reads_its_diffs_once():
    """Windows that do not overlap (LeNet's 2x2/2) route their diffs in a conditional of their own on the CPU
    (common.unfused), which reads the diffs written out: fused, XLA computed what makes each diff again for
    every cell of its window. Overlapping windows (3x3/2) keep their residues in the program. The gradient is
    the spread form's, bit for bit."""
    from caffejax.lower import vision

    rng = np.random.default_rng(3)
    x = rng.integers(-2, 3, size=(2, 7, 8, 3)).astype(np.float32)  # channels last, as Net's kernels pool
    for kernel, stride, conditionals in (((2, 2), (2, 2), 1), ((3, 3), (2, 2), 0)):
        g = vision.pooling_geometry(_pool_layer("MAX", kernel, stride, (0, 0), "CEIL"), (2, 3, 7, 8))
        a, b = (rng.normal(size=(2,) + g.out + (3,)).astype(np.float32) for _ in range(2))

        def pullback(x, a, b):  # the diffs made by a product, which XLA would fuse into their readers
            return jax.vjp(lambda x: vision.max_pool(x, g, 1)[0], x)[1](a * b)[0]

        hlo = jax.jit(pullback).lower(x, a, b).compile().as_text()
        if jax.default_backend() == "cpu":
            assert hlo[hlo.index("\nENTRY"):].count(" conditional(") == conditionals, (kernel, stride)
        if conditionals:
            _, winner = vision._scan_with_winner(x, g, 1)
            spread = vision._spread_to_winners(g, 1, winner, a * b)[:, :x.shape[1], :x.shape[2]]  # the ceil row off
            np.testing.assert_array_equal(np.asarray(jax.jit(pullback)(x, a, b)), np.asarray(spread))


@pytest.mark.parametrize("first_axis", [1, 2])
def test_max_pool_windows_apart_route_by_one_select_per_residue(first_axis):
    """Windows that do not overlap take their gradient as one select per residue of the stride, at the outputs'
    size, interleaved into place (vision._residues_interleaved): bit for bit the general residues' values, for
    kernels below the stride, padding and ceil-mode overhangs, in either layout; and no select over (outputs,
    residue, outputs, residue, channels), whose channels loop XLA:CPU left scalar on AVX2 (LeNet's pool1 5x
    slower there)."""
    from caffejax.lower import vision

    rng = np.random.default_rng(5)
    for kernel, stride, pad, size in (((2, 2), (2, 2), (0, 0), (8, 8)), ((2, 2), (2, 2), (1, 0), (7, 9)),
                                      ((1, 1), (2, 2), (0, 0), (7, 7)), ((2, 1), (3, 2), (1, 0), (10, 7)),
                                      ((3, 3), (3, 3), (1, 1), (11, 11))):
        g = vision.pooling_geometry(_pool_layer("MAX", kernel, stride, pad, "CEIL"), (2, 20) + size)
        out = (2,) + g.out + (20,) if first_axis == 1 else (2, 20) + g.out
        winner = rng.integers(-1, kernel[0] * kernel[1], out).astype(np.int8)
        dtop = rng.normal(size=out).astype(np.float32)
        dtop.flat[::7] = -0.0
        routed = jax.jit(lambda w, d: vision._residues_interleaved(g, first_axis, w, d))
        expected = jax.jit(lambda w, d: vision._residues_to_winners(g, first_axis, w, d))(winner, dtop)
        np.testing.assert_array_equal(np.asarray(routed(winner, dtop)).view(np.int32),
                                      np.asarray(expected).view(np.int32), err_msg=f"{kernel} {stride} {pad}")
        if jax.default_backend() == "cpu":
            hlo = routed.lower(winner, dtop).compile().as_text()
            assert not re.search(r"pred\[\d+(,\d+){5}\]\S* compare\(", hlo), (kernel, stride, pad)


def _ties_nan_and_minus_inf(shape, seed):
    """Small integers (many ties), a few NaNs and -infs, and one image's first channel all -inf (windows with
    nothing above -FLT_MAX)."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-2, 3, size=shape).astype(np.float32)
    x[rng.random(shape) < 0.1] = np.nan
    x[rng.random(shape) < 0.1] = -np.inf
    x[0, 0] = -np.inf
    return x


@pytest.mark.parametrize("kernel,stride,pad,round_mode,size", POOL_CONFIGS)
def test_max_pool_differentiated_top_by_window_is_the_scans(kernel, stride, pad, round_mode, size):
    """With ``differentiated_top_by_window`` (a pooling that a split grouped convolution reads, in the layout
    kernels) a differentiated program's top comes from reduce_window: Caffe's values all the same (NaN never
    wins, -FLT_MAX where nothing is above it), and Caffe's routing of the gradient; forward-over-reverse works."""
    from caffejax.lower import vision

    x = _ties_nan_and_minus_inf((2, 3) + size, seed=3)
    g = vision.pooling_geometry(_pool_layer("MAX", kernel, stride, pad, round_mode), x.shape)
    ref_y, ref_mask = caffe_pool(x, "MAX", kernel, stride, pad, g.out)
    dy = np.random.default_rng(4).normal(size=ref_y.shape).astype(np.float32)

    @jax.jit
    def top_and_pullback(x, dy):
        y, pullback = jax.vjp(lambda x: vision.max_pool(x, g, differentiated_top_by_window=True)[0], x)
        return y, pullback(dy)[0]

    assert "reduce_window" in str(jax.make_jaxpr(top_and_pullback)(x, dy))
    y, dx = top_and_pullback(x, dy)
    np.testing.assert_array_equal(np.asarray(y), ref_y)
    # A window with no winner (mask -1) sends its diff nowhere (Caffe would write before the array).
    np.testing.assert_array_equal(np.asarray(dx),
                                  caffe_max_pool_backward(x.shape, ref_mask, np.where(ref_mask >= 0, dy, 0)))

    def loss(x, by_window):  # a second derivative through the pooling: its top's tangent
        return jnp.sum(jnp.sin(vision.max_pool(x, g, differentiated_top_by_window=by_window)[0]) ** 2)

    finite = np.nan_to_num(x, nan=0.5, neginf=-3.0)
    tangent = np.random.default_rng(5).normal(size=x.shape).astype(np.float32)
    hvps = [jax.jit(lambda x, t, b=b: jax.jvp(jax.grad(lambda x: loss(x, b)), (x,), (t,))[1])(finite, tangent)
            for b in (False, True)]
    np.testing.assert_allclose(np.asarray(hvps[1]), np.asarray(hvps[0]), rtol=1e-6, atol=1e-6)


def test_big_max_pool_windows_skip_nan_like_caffe():
    """Windows of more than _MAX_TAPS elements (not global) go through reduce_window with the scan's rules."""
    x = _ties_nan_and_minus_inf((2, 2, 13, 12), seed=6)
    layer = _pool_layer("MAX", (9, 9), (2, 3), (1, 0), "CEIL")
    (y,) = layer_forward(layer, [x])
    ref_y, _ = caffe_pool(x, "MAX", (9, 9), (2, 3), (1, 0), y.shape[2:])
    np.testing.assert_array_equal(np.asarray(y), ref_y)


def test_max_pool_mask_top_gets_no_gradient():
    x = np.random.default_rng(1).normal(size=(1, 2, 5, 5)).astype(np.float32)
    lp = _pool_layer("MAX", (2, 2), (2, 2), (0, 0), "CEIL", tops=("y", "mask"))
    y, _ = layer_forward(lp, [x])
    _, (dx,), _ = layer_vjp(lp, [x], [np.zeros(y.shape), np.ones(y.shape)])
    assert not np.any(np.asarray(dx))


def test_max_pool_all_ties_route_to_first_element():
    x = np.ones((1, 1, 4, 4), np.float32)
    lp = _pool_layer("MAX", (3, 3), (1, 1), (0, 0), "CEIL", tops=("y", "mask"))
    y, mask = layer_forward(lp, [x])
    np.testing.assert_array_equal(np.asarray(mask)[0, 0], [[0, 1], [4, 5]])
    _, (dx,), _ = layer_vjp(_pool_layer("MAX", (3, 3), (1, 1), (0, 0), "CEIL"), [x], [np.ones((1, 1, 2, 2))])
    expected = np.zeros((4, 4), np.float32)
    expected[[0, 0, 1, 1], [0, 1, 0, 1]] = 1
    np.testing.assert_array_equal(np.asarray(dx)[0, 0], expected)


def test_max_pool_skips_nan_like_caffe_strict_greater():
    x = np.array([[[[np.nan, 1.0], [3.0, np.nan]]]], np.float32)
    y, mask = layer_forward(_pool_layer("MAX", (2, 2), (2, 2), (0, 0), "CEIL", tops=("y", "mask")), [x])
    assert float(y[0, 0, 0, 0]) == 3.0 and float(mask[0, 0, 0, 0]) == 2


@pytest.mark.parametrize("stride", [(2, 2), (1, 1)])
def test_max_pool_nan_and_minus_inf_windows(stride):
    x = np.array([[[[np.nan, 1.0, -np.inf], [3.0, np.nan, -np.inf], [-np.inf, -np.inf, -np.inf]]]], np.float32)
    y, mask = layer_forward(_pool_layer("MAX", (2, 2), stride, (0, 0), "FLOOR", tops=("y", "mask")), [x])
    assert float(y[0, 0, 0, 0]) == 3.0 and float(mask[0, 0, 0, 0]) == 3
    if stride == (1, 1):
        np.testing.assert_array_equal(np.asarray(y)[0, 0], [[3.0, 1.0], [3.0, -np.finfo(np.float32).max]])
        np.testing.assert_array_equal(np.asarray(mask)[0, 0], [[3, 1], [3, -1]])


def test_max_pool_window_below_minus_flt_max_keeps_caffe_initial_value():
    x = np.full((1, 1, 2, 2), -np.inf, np.float32)
    y, mask = layer_forward(_pool_layer("MAX", (2, 2), (2, 2), (0, 0), "CEIL", tops=("y", "mask")), [x])
    assert float(y[0, 0, 0, 0]) == -np.finfo(np.float32).max and float(mask[0, 0, 0, 0]) == -1


@pytest.mark.parametrize("kernel,stride,pad,round_mode,size", POOL_CONFIGS)
def test_ave_pool_divisor_and_gradient_follow_caffe(kernel, stride, pad, round_mode, size):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(2, 2) + size).astype(np.float32)
    lp = _pool_layer("AVE", kernel, stride, pad, round_mode)
    dy = rng.normal(size=(2, 2) + layer_forward(lp, [x])[0].shape[2:]).astype(np.float32)
    (y,), (dx,), _ = layer_vjp(lp, [x], [dy])
    ref_y, pool_size = caffe_pool(x, "AVE", kernel, stride, pad, y.shape[2:])
    np.testing.assert_allclose(np.asarray(y), ref_y, rtol=1e-5, atol=1e-6)
    # Backward_cpu: every in-image cell of a window gets top_diff / pool_size.
    manual = np.zeros_like(x)
    for ph, pw in itertools.product(range(y.shape[2]), range(y.shape[3])):
        hs, ws = ph * stride[0] - pad[0], pw * stride[1] - pad[1]
        hsl = slice(max(hs, 0), min(hs + kernel[0], size[0]))
        wsl = slice(max(ws, 0), min(ws + kernel[1], size[1]))
        manual[:, :, hsl, wsl] += dy[:, :, ph:ph + 1, pw:pw + 1] / pool_size[:, :, ph:ph + 1, pw:pw + 1]
    np.testing.assert_allclose(np.asarray(dx), manual, rtol=1e-5, atol=1e-6)


def test_ave_pool_semantics_example():
    # H=6, k3, s2, p1: 4 outputs; the last row's divisor is 2 (window clipped at H+p, not at the image).
    x = np.ones((1, 1, 6, 6), np.float32)
    (y,) = layer_forward(_pool_layer("AVE", (3, 3), (2, 2), (1, 1), "CEIL"), [x])
    assert y.shape == (1, 1, 4, 4)
    rows = np.array([2, 3, 3, 1]) / np.array([3, 3, 3, 2])  # in-image cells / Caffe's pool_size per row
    np.testing.assert_allclose(np.asarray(y)[0, 0], np.outer(rows, rows), rtol=1e-6)


def test_pool_output_sizes_ceil_floor_and_pad_clip():
    x = np.zeros((1, 1, 7, 7), np.float32)
    # CEIL: ceil((7-2)/2)+1 = 4; FLOOR: 3.
    assert layer_forward(_pool_layer("MAX", (2, 2), (2, 2), (0, 0), "CEIL"), [x])[0].shape == (1, 1, 4, 4)
    assert layer_forward(_pool_layer("MAX", (2, 2), (2, 2), (0, 0), "FLOOR"), [x])[0].shape == (1, 1, 3, 3)
    # pad 1: ceil((7+2-2)/2)+1 = 5, but the last window would start at 4*2 >= H+p = 8: clipped to 4.
    assert layer_forward(_pool_layer("MAX", (2, 2), (2, 2), (1, 1), "CEIL"), [x])[0].shape == (1, 1, 4, 4)
    # Padding on one axis turns the clip on for both: width ceil((5-1)/3)+1 = 3 starts at 6 >= 5 -> 2.
    x = np.zeros((1, 1, 6, 5), np.float32)
    assert layer_forward(_pool_layer("MAX", (2, 1), (2, 3), (1, 0), "CEIL"), [x])[0].shape == (1, 1, 4, 2)
    # Without padding Caffe keeps that window although it lies wholly past the input: -FLT_MAX, mask -1.
    y, mask = layer_forward(_pool_layer("MAX", (2, 1), (2, 3), (0, 0), "CEIL", tops=("y", "mask")), [x])
    assert y.shape == (1, 1, 3, 3)
    assert np.all(np.asarray(y)[..., 2] == -np.finfo(np.float32).max) and np.all(np.asarray(mask)[..., 2] == -1)


def test_global_pooling_kernel_is_the_input():
    x = np.random.default_rng(3).normal(size=(2, 3, 5, 4)).astype(np.float32)
    lp = parse_layer('name: "g" type: "Pooling" bottom: "x" top: "y" pooling_param { pool: AVE global_pooling: true }')
    (y,) = layer_forward(lp, [x])
    np.testing.assert_allclose(np.asarray(y), x.mean(axis=(2, 3), keepdims=True), rtol=1e-5)


def test_stochastic_pool_test_phase_is_weighted_average():
    x = np.abs(np.random.default_rng(4).normal(size=(1, 2, 5, 5))).astype(np.float32)
    x[0, 1] = 0  # sum 0 -> 0
    lp = parse_layer('name: "s" type: "Pooling" bottom: "x" top: "y" '
                     'pooling_param { pool: STOCHASTIC kernel_size: 3 stride: 2 }')
    (y,) = layer_forward(lp, [x], phase=TEST)
    assert y.shape == (1, 2, 2, 2)
    for ph, pw in itertools.product(range(2), range(2)):
        win = x[0, 0, 2 * ph:2 * ph + 3, 2 * pw:2 * pw + 3]
        np.testing.assert_allclose(float(y[0, 0, ph, pw]), (win ** 2).sum() / win.sum(), rtol=1e-5)
    assert not np.any(np.asarray(y[0, 1]))


def test_stochastic_pool_train_samples_by_value_and_routes_gradient():
    # One 2x2 window with values 1, 2, 3, 4 repeated over many channels: pick frequency is value / 10.
    x = np.tile(np.array([[1, 2], [3, 4]], np.float32), (1, 4000, 1, 1))
    lp = parse_layer('name: "s" type: "Pooling" bottom: "x" top: "y" '
                     'pooling_param { pool: STOCHASTIC kernel_size: 2 stride: 2 }')
    (y,), (dx,), _ = layer_vjp(lp, [x], [np.ones((1, 4000, 1, 1))], phase=TRAIN, key=jax.random.key(7))
    picks = np.asarray(y).ravel()
    freq = np.array([(picks == v).mean() for v in (1, 2, 3, 4)])
    np.testing.assert_allclose(freq, [0.1, 0.2, 0.3, 0.4], atol=0.03)
    dx = np.asarray(dx).reshape(4000, 4)
    np.testing.assert_array_equal(dx.sum(axis=1), 1)  # the gradient goes to the sampled element alone
    np.testing.assert_array_equal(np.asarray(x).reshape(4000, 4)[dx == 1], picks)


def test_stochastic_pool_train_needs_a_key():
    lp = parse_layer('name: "s" type: "Pooling" bottom: "x" top: "y" '
                     'pooling_param { pool: STOCHASTIC kernel_size: 2 }')
    ctx = LayerContext(layer=lp, phase=TRAIN, key=None, num_tops=1)
    with pytest.raises(Exception, match="PRNG key"):
        get_rule("Pooling").forward(ctx, [jnp.ones((1, 1, 4, 4))], [])


@pytest.mark.parametrize("param,tops,match", [
    ("pool: MAX kernel_size: 3 pad: 3", 1, "pad"),
    ("pool: STOCHASTIC kernel_size: 3 pad: 1", 1, "padding"),
    ("pool: MAX global_pooling: true stride: 2", 1, "global_pooling"),
    ("pool: MAX global_pooling: true kernel_size: 2", 1, "global_pooling"),
    ("pool: MAX kernel_size: 2 kernel_h: 2 kernel_w: 2", 1, "kernel_size OR"),
    ("pool: MAX kernel_h: 2", 1, "kernel_size OR"),
    ("pool: MAX kernel_size: 2 pad: 1 pad_h: 1 pad_w: 1", 1, "pad is pad"),
    ("pool: MAX kernel_size: 2 stride_h: 1", 1, "stride is stride"),
    ("pool: MAX kernel_size: 0", 1, "cannot be zero"),
    ("pool: AVE kernel_size: 2", 2, "mask"),
])
def test_pooling_rejects_what_caffe_rejects(param, tops, match):
    lp = parse_layer(f'name: "p" type: "Pooling" bottom: "x" top: "y" pooling_param {{ {param} }}')
    with pytest.raises(ShapeError, match=match):
        layer_forward(lp, [np.zeros((1, 1, 6, 6), np.float32)], num_tops=tops)


def test_pooling_needs_4d_input():
    lp = _pool_layer("MAX", (2, 2), (2, 2), (0, 0), "CEIL")
    with pytest.raises(ShapeError, match="4 axes"):
        layer_forward(lp, [np.zeros((1, 6, 6), np.float32)])


# ---- Convolution / Deconvolution / Im2col -------------------------------------------------------------------

CONV_CONFIGS = [
    # (spatial, Cin, Cout, group, kernel, stride, pad, dilation)
    ((7, 6), 4, 6, 2, (3, 2), (2, 1), (1, 0), (1, 2)),
    ((5, 5), 3, 3, 3, (3, 3), (1, 1), (2, 2), (2, 1)),
    ((4, 5, 3), 2, 4, 1, (2, 3, 1), (1, 2, 1), (1, 0, 1), (1, 1, 2)),
    ((6,), 4, 2, 2, (3,), (2,), (1,), (1,)),
]


def _conv_text(kind, cout, group, kernel, stride, pad, dilation, extra=""):
    rep = lambda name, vals: " ".join(f"{name}: {v}" for v in vals)  # noqa: E731
    return (f'name: "c" type: "{kind}" bottom: "x" top: "y" convolution_param {{ num_output: {cout} '
            f'group: {group} {rep("kernel_size", kernel)} {rep("stride", stride)} {rep("pad", pad)} '
            f'{rep("dilation", dilation)} {extra} }}')


@pytest.mark.parametrize("spatial,cin,cout,group,kernel,stride,pad,dilation", CONV_CONFIGS)
def test_convolution_matches_caffe_im2col_gemm(spatial, cin, cout, group, kernel, stride, pad, dilation):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(2, cin) + spatial).astype(np.float32)
    lp = parse_layer(_conv_text("Convolution", cout, group, kernel, stride, pad, dilation))
    shapes = get_rule("Convolution").param_shapes(lp, [x.shape])
    assert [tuple(s) for s in shapes] == [(cout, cin // group) + kernel, (cout,)]
    w, b = (rng.normal(size=s).astype(np.float32) for s in shapes)
    (y,) = layer_forward(lp, [x], [w, b])
    np.testing.assert_allclose(np.asarray(y), caffe_conv(x, w, b, group, kernel, stride, pad, dilation),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("spatial,cin,cout,group,kernel,stride,pad,dilation",
                         CONV_CONFIGS + [((5, 4), 2, 2, 1, (1, 2), (2, 3), (1, 1), (1, 1))])
def test_deconvolution_matches_caffe_col2im(spatial, cin, cout, group, kernel, stride, pad, dilation):
    rng = np.random.default_rng(6)
    x = rng.normal(size=(2, cin) + spatial).astype(np.float32)
    lp = parse_layer(_conv_text("Deconvolution", cout, group, kernel, stride, pad, dilation))
    shapes = get_rule("Deconvolution").param_shapes(lp, [x.shape])
    assert [tuple(s) for s in shapes] == [(cin, cout // group) + kernel, (cout,)]
    w, b = (rng.normal(size=s).astype(np.float32) for s in shapes)
    (y,) = layer_forward(lp, [x], [w, b])
    np.testing.assert_allclose(np.asarray(y), caffe_deconv(x, w, b, group, kernel, stride, pad, dilation),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("spatial,cin,cout,group,kernel,stride,pad,dilation", [
    c for c in CONV_CONFIGS if len(c[0]) == 2] + [
    ((5, 4), 2, 2, 1, (1, 2), (2, 3), (1, 1), (1, 1)),   # kernel shorter than the stride
    ((4, 4), 3, 3, 3, (4, 4), (2, 2), (1, 1), (1, 1)),   # bilinear upsampling's shape: one channel per group
    ((3, 2), 2, 4, 1, (16, 16), (8, 8), (4, 0), (1, 1)),  # FCN's 8x one
    ((4, 3), 4, 6, 2, (3, 3), (1, 1), (0, 2), (1, 1)),   # stride 1
])
def test_deconvolution_by_col2im_has_the_convolution_forms_values_and_gradients(spatial, cin, cout, group,
                                                                                kernel, stride, pad, dilation):
    """2-D Deconvolution runs as Caffe's col2im(W^T x), with the filter gradient of that form and the input
    gradient of the stride-dilated convolution's: in float64 all three are the convolution form's."""
    from caffejax.lower import vision

    rng = np.random.default_rng(12)
    x = rng.normal(size=(2, cin) + spatial)
    w = rng.normal(size=(cin, cout // group) + kernel)
    g = vision.ConvGeometry(channel_axis=1, kernel=kernel, stride=stride, pad=pad, dilation=dilation)
    out = tuple(s * (i - 1) + d * (k - 1) + 1 - 2 * p for i, k, s, p, d in zip(spatial, kernel, stride, pad, dilation))
    dy = rng.normal(size=(2, cout) + out)
    _assert_same_forward_and_gradients_in_float64(lambda x, w: vision._deconvolution_2d(x, w, g, group, out),
                                                  lambda x, w: vision._deconvolution_by_convolution(x, w, g, group),
                                                  x, w, dy)


def _assert_same_forward_and_gradients_in_float64(ours, xla, x, w, dy):
    """ours(x, w) equals xla(x, w), and so do dx and dw pulled back from dy, to 1e-12 in float64."""
    def value_and_pullback(fn):  # jitted: run eagerly, each of a form's many small operations compiles alone
        return jax.jit(lambda x, w, dy: (lambda y, pull: (y, pull(dy)))(*jax.vjp(fn, x, w)))(x, w, dy)

    with jax.enable_x64(True):
        want_y, want_grads = value_and_pullback(xla)
        got_y, got_grads = value_and_pullback(ours)
        np.testing.assert_allclose(got_y, want_y, rtol=1e-12, atol=1e-12)
        for got, want, name in zip(got_grads, want_grads, ("dx", "dw")):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("batch,kernel,stride,pad,dilation", [
    (5, (3, 3), (1, 1), (1, 1), (1, 1)),   # two chunks of 2 and a last image alone
    (4, (3, 3), (2, 2), (1, 1), (1, 1)),
    (3, (3, 2), (2, 1), (0, 1), (2, 1)),
    (4, (3, 3), (2, 3), (3, 2), (1, 1)),   # pads past the kernel's reach: the input gradient crops dy's spread
])
def test_depthwise_gradients_summed_by_chunks_are_the_whole_batch_gradients(monkeypatch, channels_last, batch,
                                                                             kernel, stride, pad, dilation):
    """The depthwise filter gradient, summed over 2-image chunks on the CPU (whatever the core count here), or
    channels-last by blocks of rows, equals XLA's own grouped-convolution gradient in float64; so do the
    forward and the input gradient (a correlation of dy, spread by the stride, with the flipped filters)."""
    from caffejax.lower import vision

    monkeypatch.setattr(vision, "_depthwise_chunk", lambda: 2)
    rng = np.random.default_rng(11)
    channels, spatial = 6, (9, 8)
    x = rng.normal(size=(batch, channels) + spatial)
    w = rng.normal(size=(channels, 1) + kernel)
    g = vision.ConvGeometry(channel_axis=1, kernel=kernel, stride=stride, pad=pad, dilation=dilation)
    out = tuple((n + 2 * p - (d * (k - 1) + 1)) // s + 1 for n, k, s, p, d in zip(spatial, kernel, stride, pad,
                                                                                    dilation))
    padding = [(p, p) for p in pad]
    dy = rng.normal(size=(batch, channels) + out)

    def xla(x, w):
        return jax.lax.conv_general_dilated(x, w, stride, padding, rhs_dilation=dilation,
                                            feature_group_count=channels, precision=jax.lax.Precision.HIGHEST)

    def ours(x, w):
        if not channels_last:
            return vision.grouped_convolution(x, w, g, padding, out, channels)
        y = vision.grouped_convolution(x.transpose(0, 2, 3, 1), w.transpose(2, 3, 1, 0), g, padding, out, channels,
                                       channels_last=True)
        return y.transpose(0, 3, 1, 2)

    _assert_same_forward_and_gradients_in_float64(ours, xla, x, w, dy)
    if jax.default_backend() == "cpu":  # the chunked loops are what ran
        x, w, dy = (a.astype(np.float32) for a in (x, w, dy))
        assert "stablehlo.while" not in jax.jit(ours).lower(x, w).as_text()
        backward = jax.jit(lambda x, w, dy: jax.vjp(ours, x, w)[1](dy)[1]).lower(x, w, dy).as_text()
        assert backward.count("stablehlo.while") == 1  # the filter gradient's


@pytest.mark.parametrize("products", [9, 36, 54, 252])
@pytest.mark.parametrize("batch,spatial,kernel,stride,pad,dilation", [
    (3, (9, 8), (3, 3), (1, 1), (1, 1), (1, 1)),
    (2, (13, 7), (3, 3), (1, 1), (1, 0), (1, 1)),   # 13 output rows: a prime, the last block filled with zeros
    (4, (11, 9), (3, 2), (2, 1), (0, 1), (2, 1)),
    (1, (16, 5), (5, 5), (3, 1), (2, 2), (1, 1)),
])
def test_depthwise_filter_gradient_by_rows_every_block_shape(monkeypatch, products, batch, spatial, kernel, stride,
                                                            pad, dilation):
    """The channels-last filter gradient summed by blocks of rows, with blocks of several images, of some rows of
    one image, and of a row count that does not divide the image (zero rows fill the last block), equals XLA's
    grouped-convolution gradient in float64."""
    from caffejax.lower import vision

    monkeypatch.setattr(vision, "_DEPTHWISE_BLOCK_PRODUCTS", products)
    rng = np.random.default_rng(12)
    channels = 5
    g = vision.ConvGeometry(channel_axis=3, kernel=kernel, stride=stride, pad=pad, dilation=dilation)
    out = tuple((n + 2 * p - (d * (k - 1) + 1)) // s + 1 for n, k, s, p, d in zip(spatial, kernel, stride, pad,
                                                                                    dilation))
    padding = tuple((p, p) for p in pad)
    x = rng.normal(size=(batch,) + spatial + (channels,))
    dy = rng.normal(size=(batch,) + out + (channels,))
    with jax.enable_x64(True):
        got = vision._depthwise_filter_gradient_by_rows(jnp.asarray(x), jnp.asarray(dy), g, padding, out,
                                                        jnp.float64)
        want = jax.vjp(lambda w: jax.lax.conv_general_dilated(
            x, w, stride, padding, rhs_dilation=dilation, feature_group_count=channels,
            dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=jax.lax.Precision.HIGHEST),
            jnp.zeros(kernel + (1, channels)))[1](dy)[0]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_depthwise_layers_trace_few_operations_per_product():
    """A padded 3x3 depthwise layer's forward (by regions: 5 of them, 45 weighted taps) and its filter gradient's
    loop body (a block of 28 rows: 252 products) trace a few operations per product: each input row, column
    window and offset's weights taken once, not indexed again per product. Indexed per product (jnp), the
    body held 7 operations per product and MobileNet v2's training step traced in 4.7 s, 3.2 s since."""
    from caffejax.lower import vision

    g = vision.ConvGeometry(channel_axis=3, kernel=(3, 3), stride=(1, 1), pad=(1, 1), dilation=(1, 1))
    padding, out = ((1, 1), (1, 1)), (28, 28)
    x = dy = jnp.zeros((2, 28, 28, 8), jnp.float32)
    gradient = jax.make_jaxpr(lambda x, dy: vision._depthwise_filter_gradient_by_rows(
        x, dy, g, padding, out, jnp.float32))(x, dy)
    (loop,) = [e for e in gradient.jaxpr.eqns if e.primitive.name in ("scan", "while")]
    body = (loop.params.get("jaxpr") or loop.params["body_jaxpr"]).jaxpr
    assert sum(e.primitive.name == "mul" for e in body.eqns) >= 252
    assert len(body.eqns) < 3.5 * 252
    forward = jax.make_jaxpr(lambda x, w: vision._depthwise_taps(x, w, g, padding, out, True, None))(
        x, jnp.zeros((3, 3, 1, 8), jnp.float32))
    assert sum(e.primitive.name == "mul" for e in forward.jaxpr.eqns) == 45
    assert len(forward.jaxpr.eqns) < 5 * 45


def test_convolution_channel_axis_and_several_bottoms():
    # axis 2: the leading axes (2, 3) are the "num" of Caffe's loop; every bottom gets its own top.
    rng = np.random.default_rng(8)
    x1, x2 = (rng.normal(size=(2, 3, 4, 6, 5)).astype(np.float32) for _ in range(2))
    lp = parse_layer('name: "c" type: "Convolution" bottom: "a" bottom: "b" top: "p" top: "q" '
                     'convolution_param { num_output: 5 kernel_size: 3 axis: 2 }')
    w, b = (rng.normal(size=s).astype(np.float32) for s in get_rule("Convolution").param_shapes(lp, [x1.shape] * 2))
    p, q = layer_forward(lp, [x1, x2], [w, b])
    assert p.shape == (2, 3, 5, 4, 3)
    for x, y in ((x1, p), (x2, q)):
        ref = caffe_conv(x.reshape(6, 4, 6, 5), w, b, 1, (3, 3), (1, 1), (0, 0), (1, 1))
        np.testing.assert_allclose(np.asarray(y), ref.reshape(y.shape), rtol=1e-4, atol=1e-4)


def test_convolution_truncating_output_size_keeps_a_partial_window():
    # (2 + 0 - 3) / 2 + 1 = 1 in C (truncation toward zero): one window reading a zero past the input.
    x = np.array([[[[1.0, 2.0]]]], np.float32)
    lp = parse_layer('name: "c" type: "Convolution" bottom: "x" top: "y" '
                     'convolution_param { num_output: 1 kernel_h: 1 kernel_w: 3 stride: 2 bias_term: false }')
    (y,) = layer_forward(lp, [x], [np.ones((1, 1, 1, 3), np.float32)])
    np.testing.assert_array_equal(np.asarray(y), [[[[3.0]]]])


def test_convolution_param_shapes_and_default_fillers():
    lp = parse_layer('name: "c" type: "Convolution" bottom: "x" top: "y" '
                     'convolution_param { num_output: 4 kernel_size: 3 group: 2 }')
    rule = get_rule("Convolution")
    shapes = [tuple(s) for s in rule.param_shapes(lp, [(1, 6, 8, 8)])]
    assert shapes == [(4, 3, 3, 3), (4,)]
    w, b = rule.init_params(lp, shapes, jax.random.key(0))
    assert not np.any(np.asarray(w)) and not np.any(np.asarray(b))  # constant 0 for both by default
    lp.convolution_param.bias_term = False
    lp.convolution_param.weight_filler.type = "xavier"
    (w,) = rule.init_params(lp, [(4, 3, 3, 3)], jax.random.key(0))
    assert w.shape == (4, 3, 3, 3) and np.all(np.abs(np.asarray(w)) <= np.sqrt(3 / 27))


def test_deconvolution_bilinear_init_upsamples():
    lp = parse_layer('name: "up" type: "Deconvolution" bottom: "x" top: "y" convolution_param { num_output: 3 '
                     'group: 3 kernel_size: 4 stride: 2 pad: 1 bias_term: false weight_filler { type: "bilinear" } }')
    rule = get_rule("Deconvolution")
    shapes = [tuple(s) for s in rule.param_shapes(lp, [(1, 3, 5, 5)])]
    assert shapes == [(3, 1, 4, 4)]
    (w,) = rule.init_params(lp, shapes, jax.random.key(0))
    (y,) = layer_forward(lp, [np.ones((1, 3, 5, 5), np.float32)], [w])
    assert y.shape == (1, 3, 10, 10)
    np.testing.assert_allclose(np.asarray(y)[0, :, 1:-1, 1:-1], 1.0, rtol=1e-6)  # interior of a constant


@pytest.mark.parametrize("kind", ["Convolution", "Deconvolution"])
@pytest.mark.parametrize("param,shape,match", [
    ("num_output: 4 kernel_size: 3 group: 2", (1, 3, 5, 5), "group"),
    ("num_output: 3 kernel_size: 3 group: 2", (1, 4, 5, 5), "multiple of group"),
    ("num_output: 0 kernel_size: 3", (1, 4, 5, 5), "num_output"),
    ("num_output: 2 kernel_size: 3 kernel_size: 3", (1, 4, 5, 5, 5), "once per spatial dimension"),
    ("num_output: 2 kernel_h: 3 kernel_w: 3", (1, 4, 5, 5, 5), "2D"),
    ("num_output: 2 kernel_size: 3 kernel_h: 3 kernel_w: 3", (1, 4, 5, 5), "not both"),
    ("num_output: 2 kernel_size: 3 stride: 0", (1, 4, 5, 5), "nonzero"),
    ("num_output: 2", (1, 4, 5, 5), "kernel_size must be specified"),
])
def test_convolution_rejects_what_caffe_rejects(kind, param, shape, match):
    lp = parse_layer(f'name: "c" type: "{kind}" bottom: "x" top: "y" convolution_param {{ {param} }}')
    with pytest.raises(ShapeError, match=match):
        get_rule(kind).param_shapes(lp, [shape])


def test_convolution_rejects_a_kernel_larger_than_the_padded_input_and_wrong_blobs():
    lp = parse_layer('name: "c" type: "Convolution" bottom: "x" top: "y" convolution_param { num_output: 1 '
                     'kernel_size: 5 stride: 1 }')
    with pytest.raises(ShapeError, match="does not fit"):
        layer_forward(lp, [np.zeros((1, 1, 3, 3), np.float32)], [np.zeros((1, 1, 5, 5)), np.zeros(1)])
    with pytest.raises(ShapeError, match="learnable blobs"):
        layer_forward(lp, [np.zeros((1, 1, 8, 8), np.float32)], [np.zeros((1, 1, 3, 3)), np.zeros(1)])


@pytest.mark.parametrize("spatial,kernel,stride,pad,dilation", [
    ((7, 7), (3, 3), (2, 2), (1, 1), (1, 1)),
    ((6, 5), (2, 3), (1, 2), (0, 1), (2, 1)),
    ((4, 5, 3), (2, 2, 2), (2, 1, 1), (1, 0, 1), (1, 2, 1)),
    ((7, 8), (2, 3), (2, 3), (0, 0), (1, 1)),  # non-overlapping windows, the input's tail left out
    ((6, 6), (2, 2), (2, 2), (1, 1), (1, 1)),  # non-overlapping windows over padding
])
def test_im2col_layout_and_col2im_gradient(spatial, kernel, stride, pad, dilation):
    rng = np.random.default_rng(9)
    x = rng.normal(size=(2, 3) + spatial).astype(np.float32)
    lp = parse_layer(_conv_text("Im2col", 1, 1, kernel, stride, pad, dilation))
    (y,) = layer_forward(lp, [x])
    ref = np.stack([caffe_im2col(img, kernel, stride, pad, dilation, y.shape[2:]) for img in x])
    np.testing.assert_array_equal(np.asarray(y), ref)
    dy = rng.normal(size=y.shape).astype(np.float32)
    _, (dx,), _ = layer_vjp(lp, [x], [dy])
    ref_dx = np.stack([caffe_col2im(c, 3, spatial, kernel, stride, pad, dilation) for c in dy])
    np.testing.assert_allclose(np.asarray(dx), ref_dx, rtol=1e-5, atol=1e-6)


# ---- LRN ---------------------------------------------------------------------------------------------------------

def test_lrn_across_channels_formula():
    rng = np.random.default_rng(10)
    x = rng.normal(size=(2, 6, 3, 3)).astype(np.float32)
    lp = parse_layer('name: "n" type: "LRN" bottom: "x" top: "y" '
                     'lrn_param { local_size: 3 alpha: 0.5 beta: 0.6 k: 1.5 }')
    (y,) = layer_forward(lp, [x])
    sq = np.pad(x ** 2, ((0, 0), (1, 1), (0, 0), (0, 0)))
    scale = 1.5 + 0.5 / 3 * (sq[:, :-2] + sq[:, 1:-1] + sq[:, 2:])
    np.testing.assert_allclose(np.asarray(y), x * scale ** -0.6, rtol=1e-5)


@pytest.mark.parametrize("beta", [0.75, 0.5, 1.0, 0.6])
def test_lrn_inverse_power_is_pow_with_its_edge_cases(beta):
    """s^-beta through square roots for the usual betas: pow's values in float64 (within a few ulp in
    float32), and pow's inf at 0, 0 at inf and NaN below 0."""
    from caffejax.lower.vision import _inverse_power

    s = np.concatenate([np.geomspace(1e-6, 1e6, 97), [0.0, np.inf, -1.0]])
    with jax.enable_x64(True):
        got = np.asarray(_inverse_power(jnp.asarray(s), beta))
    with np.errstate(divide="ignore", invalid="ignore"):
        want = np.power(s, -beta)
    np.testing.assert_allclose(got, want, rtol=1e-14)
    got32 = np.asarray(_inverse_power(jnp.asarray(s, jnp.float32), beta))
    np.testing.assert_allclose(got32, want.astype(np.float32), rtol=1e-6)


def test_lrn_within_channel_ignores_k_and_uses_caffe_divisor():
    rng = np.random.default_rng(11)
    x = rng.normal(size=(1, 2, 5, 5)).astype(np.float32)
    text = 'name: "n" type: "LRN" bottom: "x" top: "y" lrn_param {{ local_size: 3 alpha: 0.3 beta: 0.75 ' \
           'norm_region: WITHIN_CHANNEL k: {} }}'
    (y1,) = layer_forward(parse_layer(text.format(1)), [x])
    (y2,) = layer_forward(parse_layer(text.format(7)), [x])
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2))
    sq = np.pad(x ** 2, ((0, 0), (0, 0), (1, 1), (1, 1)))
    window = sum(sq[:, :, i:i + 5, j:j + 5] for i in range(3) for j in range(3))
    np.testing.assert_allclose(np.asarray(y1), x * (1 + 0.3 * window / 9) ** -0.75, rtol=1e-5)


def test_lrn_rejects_even_local_size():
    lp = parse_layer('name: "n" type: "LRN" bottom: "x" top: "y" lrn_param { local_size: 4 }')
    with pytest.raises(ShapeError, match="odd"):
        layer_forward(lp, [np.zeros((1, 4, 3, 3), np.float32)])


# ---- SPP ---------------------------------------------------------------------------------------------------------

def test_spp_levels_are_caffe_poolings():
    rng = np.random.default_rng(12)
    x = rng.normal(size=(2, 3, 9, 7)).astype(np.float32)
    lp = parse_layer('name: "s" type: "SPP" bottom: "x" top: "y" spp_param { pyramid_height: 3 pool: AVE }')
    (y,) = layer_forward(lp, [x])
    parts = []
    for level in range(3):
        bins = 2 ** level
        k = [int(np.ceil(n / bins)) for n in (9, 7)]
        p = [(kk * bins - n + 1) // 2 for kk, n in zip(k, (9, 7))]
        (pooled,) = layer_forward(_pool_layer("AVE", k, k, p, "CEIL"), [x])
        assert pooled.shape[2:] == (bins, bins)
        parts.append(np.asarray(pooled).reshape(2, -1))
    np.testing.assert_allclose(np.asarray(y), np.concatenate(parts, axis=1), rtol=1e-6)


def test_spp_pyramid_height_one_is_a_bare_4d_pool():
    x = np.random.default_rng(13).normal(size=(2, 3, 5, 4)).astype(np.float32)
    lp = parse_layer('name: "s" type: "SPP" bottom: "x" top: "y" spp_param { pyramid_height: 1 }')
    (y,) = layer_forward(lp, [x])
    np.testing.assert_array_equal(np.asarray(y), x.max(axis=(2, 3), keepdims=True))


def test_spp_rejects_pad_not_smaller_than_kernel():
    # height 1 with 2 bins: kernel 1, pad (2 - 1 + 1) / 2 = 1: Pooling's CHECK_LT(pad, kernel) fails in Caffe.
    lp = parse_layer('name: "s" type: "SPP" bottom: "x" top: "y" spp_param { pyramid_height: 2 }')
    with pytest.raises(ShapeError, match="pad"):
        layer_forward(lp, [np.zeros((1, 1, 1, 8), np.float32)])


# ---- Crop --------------------------------------------------------------------------------------------------------

def test_crop_offsets_and_no_gradient_into_the_reference():
    x = np.arange(2 * 3 * 6 * 7, dtype=np.float32).reshape(2, 3, 6, 7)
    ref = np.zeros((2, 2, 3, 4), np.float32)
    one = parse_layer('name: "c" type: "Crop" bottom: "x" bottom: "r" top: "y" crop_param { axis: 1 offset: 1 }')
    (y,) = layer_forward(one, [x, ref])
    np.testing.assert_array_equal(np.asarray(y), x[:, 1:3, 1:4, 1:5])
    default = parse_layer('name: "c" type: "Crop" bottom: "x" bottom: "r" top: "y"')
    (y,) = layer_forward(default, [x, ref])  # axis 2, offset 0
    np.testing.assert_array_equal(np.asarray(y), x[:, :, :3, :4])
    _, (dx, dref), _ = layer_vjp(one, [x, ref], [np.ones((2, 2, 3, 4))])
    assert not np.any(np.asarray(dref)) and float(np.asarray(dx).sum()) == 2 * 2 * 3 * 4


@pytest.mark.parametrize("param,ref_shape,match", [
    ("axis: 2 offset: 1 offset: 2 offset: 3", (2, 3, 4, 4), "number of offset"),
    ("axis: 2 offset: 4", (2, 3, 4, 4), "out-of-bounds"),
    ("axis: 4", (2, 3, 4, 4), "out of range"),
    ("axis: 1", (2, 3, 4), "fewer axes"),
])
def test_crop_rejects_what_caffe_rejects(param, ref_shape, match):
    lp = parse_layer(f'name: "c" type: "Crop" bottom: "x" bottom: "r" top: "y" crop_param {{ {param} }}')
    with pytest.raises(ShapeError, match=match):
        layer_forward(lp, [np.zeros((2, 3, 6, 6), np.float32), np.zeros(ref_shape, np.float32)])


@pytest.mark.parametrize("kernel,pad,dilation,batch", [((5, 5), (0, 0), (1, 1), 3), ((3, 3), (0, 0), (2, 2), 2),
                                                       ((5, 3), (0, 1), (1, 1), 1)])
def test_valid_convolution_input_gradient_by_gemm_is_xlas(kernel, pad, dilation, batch):
    """An unpadded channels-last convolution's input gradient as col2im(dy . W^T) equals XLA's own (a
    convolution over the padded dy) in float64; the backward then holds one convolution, the filter
    gradient's, and on the CPU one conditional: the rows' sum of col2im, written out apart from the columns'
    pads that read it at k offsets."""
    from caffejax.lower import vision

    rng = np.random.default_rng(5)
    spatial, channels, outputs = (12, 11), 4, 6
    g = vision.ConvGeometry(channel_axis=3, kernel=kernel, stride=(1, 1), pad=pad, dilation=dilation)
    out = tuple(n + 2 * p - d * (k - 1) for n, k, p, d in zip(spatial, kernel, pad, dilation))
    padding = [(p, p) for p in pad]
    x = rng.normal(size=(batch,) + spatial + (channels,))
    w = rng.normal(size=kernel + (channels, outputs))
    dy = rng.normal(size=(batch,) + out + (outputs,))
    assert vision._input_gradient_by_gemm(g, x.shape, out, w.shape)

    def xla(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), padding, rhs_dilation=dilation,
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                            precision=jax.lax.Precision.HIGHEST)

    def ours(x, w):
        return vision.grouped_convolution(x, w, g, padding, out, 1, channels_last=True,
                                          precision=jax.lax.Precision.HIGHEST)

    _assert_same_forward_and_gradients_in_float64(ours, xla, x, w, dy)
    x, w, dy = (a.astype(np.float32) for a in (x, w, dy))

    def convolutions(f):
        backward = jax.jit(lambda x, w, dy: jax.vjp(f, x, w)[1](dy))
        return backward.lower(x, w, dy).as_text().count("stablehlo.convolution")

    assert (convolutions(xla), convolutions(ours)) == (2, 1)  # dx and dw; dw alone
    if jax.default_backend() == "cpu":
        hlo = jax.jit(lambda x, w, dy: jax.vjp(ours, x, w)[1](dy)).lower(x, w, dy).compile().as_text()
        assert hlo[hlo.index("\nENTRY"):].count(" conditional(") == 1


def test_same_padded_convolution_keeps_xlas_input_gradient():
    from caffejax.lower import vision

    g = vision.ConvGeometry(channel_axis=3, kernel=(3, 3), stride=(1, 1), pad=(1, 1), dilation=(1, 1))
    assert not vision._input_gradient_by_gemm(g, (16, 56, 56, 64), (56, 56), (3, 3, 64, 64))
    strided = vision.ConvGeometry(channel_axis=3, kernel=(5, 5), stride=(2, 2), pad=(0, 0), dilation=(1, 1))
    assert not vision._input_gradient_by_gemm(strided, (16, 12, 12, 20), (4, 4), (5, 5, 20, 50))


@pytest.mark.parametrize("channels,kernel,stride,pad,dilation", [(1, (5, 5), (1, 1), (0, 0), (1, 1)),
                                                                 (3, (3, 3), (2, 2), (1, 1), (1, 1)),
                                                                 (2, (3, 2), (1, 2), (2, 0), (2, 1))])
def test_few_channel_convolution_is_xlas(channels, kernel, stride, pad, dilation):
    """The shifted multiply-adds give XLA's convolution, and its gradients are XLA's, in float64."""
    from caffejax.lower import vision

    rng = np.random.default_rng(8)
    spatial, outputs, batch = (11, 9), 5, 2
    g = vision.ConvGeometry(channel_axis=1, kernel=kernel, stride=stride, pad=pad, dilation=dilation)
    out = tuple((n + 2 * p - d * (k - 1) - 1) // s + 1 for n, k, s, p, d in zip(spatial, kernel, stride, pad,
                                                                                dilation))
    padding = tuple((p, p) for p in pad)
    x = rng.normal(size=(batch, channels) + spatial)
    w = rng.normal(size=(outputs, channels) + kernel)
    dy = rng.normal(size=(batch, outputs) + out)
    options = (("precision", jax.lax.Precision.HIGHEST),)

    def xla(x, w):  # NCHW x, Caffe's O x C x kh x kw filters
        return jax.lax.conv_general_dilated(x, w, stride, padding, rhs_dilation=dilation,
                                            precision=jax.lax.Precision.HIGHEST)

    def ours(x, w):
        return vision.few_channel_convolution(x, w, g, padding, out, options)

    with jax.enable_x64(True):  # the multiply-adds themselves (differentiated, the forward is XLA's)
        np.testing.assert_allclose(jax.jit(ours)(x, w), jax.jit(xla)(x, w), rtol=1e-12, atol=1e-12)
    _assert_same_forward_and_gradients_in_float64(ours, xla, x, w, dy)


def test_few_channel_convolution_writes_its_taps_out_once_and_takes_xlas_gradients():
    """Alone and differentiated, the forward is the multiply-adds written out apart from their readers (in a
    conditional on the filters: common.unfused), so that the backward's fusions read them instead of computing
    them again; the gradients come from XLA's convolution."""
    from caffejax.lower import vision

    g = vision.ConvGeometry(channel_axis=1, kernel=(5, 5), stride=(1, 1), pad=(0, 0), dilation=(1, 1))
    x, w = jnp.ones((2, 1, 12, 12)), jnp.ones((4, 1, 5, 5))

    def ours(x, w):
        return vision.few_channel_convolution(x, w, g, ((0, 0), (0, 0)), (8, 8), ())

    cases = 1 if jax.default_backend() == "cpu" else 0  # (common.unfused is the CPU's)
    alone = jax.jit(ours).lower(x, w).as_text()
    assert "convolution" not in alone and alone.count("stablehlo.case") == cases
    forward_of_vjp = jax.jit(lambda x, w: jax.vjp(ours, x, w)[0]).lower(x, w).as_text()
    assert "convolution" not in forward_of_vjp and forward_of_vjp.count("stablehlo.case") == cases
    gradients = jax.jit(lambda x, w: jax.vjp(ours, x, w)[1](jnp.ones((2, 4, 8, 8)))).lower(x, w).as_text()
    assert gradients.count("stablehlo.convolution") == 2  # dx and dw (the forward, unread, is dropped)
    # Vmapped over examples (per-example gradients) the test stays unbatched: one branch runs, not both.
    per_example = jax.jit(jax.vmap(ours, in_axes=(0, None))).lower(jnp.ones((3, 2, 1, 12, 12)), w)
    assert per_example.as_text().count("stablehlo.case") == cases and "stablehlo.select" not in per_example.as_text()
