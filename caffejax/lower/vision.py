"""Vision layers: Convolution, Deconvolution, Pooling, LRN, SPP, Im2col, Crop.

Geometry (kernel/stride/pad/dilation, output sizes) is read from the proto exactly as Caffe's LayerSetUp and
Reshape do and is static; the math uses XLA's native convolution where it gives Caffe's numbers, and the
window elements in Caffe's row-major scan order where the order matters: MAX pooling is Caffe's scan as a
chain of ``where`` over shifted views (first maximum wins), STOCHASTIC pooling's sampling and Im2col's column
layout use an explicit array of every window. Written that way, JAX's derivative of the forward is Caffe's
Backward (Im2col's transpose is col2im), and the shifted-view forms fuse into one pass over the input on
XLA:CPU, where reduce_window is slow. Where that derivative is slow on XLA:CPU, the backward is written out
with the same math (``custom_vjp``): MAX pooling routes each output's gradient to the winner its scan
recorded, LRN is Caffe's CrossChannelBackward, the depthwise input gradient is a correlation with the
flipped filters, the depthwise filter gradient is summed by blocks of rows (channels-last) or of images, and
an unpadded stride-1 convolution's input gradient is col2im of dy . W^T.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from caffejax.lower.common import unfused
from caffejax.lower.registry import (TRAIN, LayerContext, canonical_axis, count, is_symbolic, layer, rejected,
                                     param_axis, rows_apart_off_axis_0)

Shape = tuple[int, ...]

# caffe.proto enum values used below.
POOL_MAX, POOL_AVE, POOL_STOCHASTIC = 0, 1, 2
ROUND_CEIL, ROUND_FLOOR = 0, 1
LRN_ACROSS_CHANNELS, LRN_WITHIN_CHANNEL = 0, 1

_FLT_MAX = float(np.finfo(np.float32).max)  # Caffe's -FLT_MAX starts every MAX window, in float and double



# ---- shared window machinery ------------------------------------------------------------------------------

def _pad(x: jax.Array, first_axis: int, pads: Sequence[tuple[int, int]], value,
         interior: Sequence[int] | None = None) -> jax.Array:
    """Pad (or, for negative amounts, crop) the spatial axes starting at ``first_axis``; axes after them
    (channels, in a channels-last layout) are left alone. ``interior``: that many cells of ``value`` also
    go between neighbouring elements along each axis (an array spread out by a stride, less one)."""
    trailing = x.ndim - first_axis - len(pads)
    interior = interior or (0,) * len(pads)
    config = ([(0, 0, 0)] * first_axis + [(lo, hi, i) for (lo, hi), i in zip(pads, interior)]
              + [(0, 0, 0)] * trailing)
    return lax.pad(x, np.asarray(value, x.dtype), config)


def _taps(xpad: jax.Array, first_axis: int, kernel: Shape, stride: Shape, dilation: Shape,
          out: Shape) -> list[jax.Array]:
    """One strided view of a padded input per kernel offset t, in row-major order (the order in which
    Caffe's loops visit a window): ``tap_t[..., o] = xpad[..., o*s + t*d]``. Axes after the spatial ones
    (channels in a channels-last layout) are carried along."""
    lead, nsp = first_axis, len(kernel)
    taps = []
    for offset in itertools.product(*(range(k) for k in kernel)):
        start = [0] * lead + [t * d for t, d in zip(offset, dilation)] + [0] * (xpad.ndim - lead - nsp)
        limit = (list(xpad.shape[:lead]) + [b + (o - 1) * s + 1 for b, o, s in zip(start[lead:], out, stride)]
                 + list(xpad.shape[lead + nsp:]))
        taps.append(lax.slice(xpad, start, limit, [1] * lead + list(stride) + [1] * (xpad.ndim - lead - nsp)))
    return taps


def convolution_taps(x: jax.Array, first_axis: int, g: ConvGeometry, padding, out: Shape) -> list[jax.Array]:
    """A convolution's views of its input, one per kernel offset (row-major, Caffe's im2col order): x padded
    with zeros by ``padding`` (its spatial axes start at ``first_axis``), read with the kernel's stride and
    dilation (:func:`_taps`)."""
    return _taps(_pad(x, first_axis, padding, 0), first_axis, g.kernel, g.stride, g.dilation, out)


def _windows(xpad: jax.Array, first_axis: int, kernel: Shape, stride: Shape, dilation: Shape,
             out: Shape) -> jax.Array:
    """All windows of a padded input as one array ``lead + (prod(kernel),) + out``:
    ``w[..., t, o] = xpad[..., o*s + t*d]`` with the kernel offsets t in row-major order. ``xpad`` must span
    exactly ``(o-1)*s + (k-1)*d + 1``.
    """
    lead = xpad.shape[:first_axis]
    nsp = len(kernel)
    if all(d == 1 and (o == 1 or s == k) for k, s, d, o in zip(kernel, stride, dilation, out)):
        # The windows tile the input: a reshape and a transpose, no copies per offset.
        tiles = xpad.reshape(lead + tuple(itertools.chain.from_iterable(zip(out, kernel))))
        order = (tuple(range(first_axis)) + tuple(first_axis + 2 * i + 1 for i in range(nsp))
                 + tuple(first_axis + 2 * i for i in range(nsp)))
        return tiles.transpose(order).reshape(lead + (math.prod(kernel),) + tuple(out))
    return jnp.stack(_taps(xpad, first_axis, kernel, stride, dilation, out), axis=first_axis)


# ---- Convolution / Deconvolution / Im2col: base_conv_layer.cpp ----------------------------------------

@dataclasses.dataclass(frozen=True)
class ConvGeometry:
    """BaseConvolutionLayer's kernel_shape_, stride_, pad_, dilation_ and channel_axis_."""

    channel_axis: int
    kernel: Shape
    stride: Shape
    pad: Shape
    dilation: Shape

    @property
    def extent(self) -> Shape:
        return tuple(d * (k - 1) + 1 for k, d in zip(self.kernel, self.dilation))


def _per_axis(layer_param, what: str, values: Sequence[int], n: int, default: int | None) -> Shape:
    """Caffe's rule for a repeated spatial field: given once (all axes) or once per axis (or never)."""
    if len(values) == 0 and default is not None:
        return (default,) * n
    if len(values) not in (1, n):
        raise rejected(layer_param, f"{what} must be specified once, or once per spatial dimension "
                                    f"({what} specified {len(values)} times; {n} spatial dims)")
    return tuple(int(values[0 if len(values) == 1 else i]) for i in range(n))


def _per_axis_hw(layer_param, p, what: str, n: int, default: int | None) -> Shape:
    """``what`` or its 2-D only ``what_h``/``what_w`` alternative (kernel_size is kernel_h/kernel_w)."""
    field = "kernel_size" if what == "kernel" else what
    if p.HasField(f"{what}_h") or p.HasField(f"{what}_w"):
        if n != 2:
            raise rejected(layer_param, f"{what}_h & {what}_w can only be used for 2D convolution "
                                        f"(the bottom has {n} spatial dims)")
        if len(getattr(p, field)):
            raise rejected(layer_param, f"either {field} or {what}_h/w should be specified; not both")
        return (getattr(p, f"{what}_h"), getattr(p, f"{what}_w"))
    return _per_axis(layer_param, field, getattr(p, field), n, default)


def conv_geometry(layer_param, bottom_shape: Shape) -> ConvGeometry:
    p = layer_param.convolution_param
    channel_axis = canonical_axis(layer_param.name, p.axis, len(bottom_shape))
    n = len(bottom_shape) - channel_axis - 1
    kernel = _per_axis_hw(layer_param, p, "kernel", n, None)
    stride = _per_axis_hw(layer_param, p, "stride", n, 1)
    pad = _per_axis_hw(layer_param, p, "pad", n, 0)
    dilation = _per_axis(layer_param, "dilation", p.dilation, n, 1)
    if any(k <= 0 for k in kernel):
        raise rejected(layer_param, f"filter dimensions must be nonzero, got kernel {kernel}")
    if any(s <= 0 for s in stride):
        raise rejected(layer_param, f"stride dimensions must be nonzero, got stride {stride}")
    if any(d <= 0 for d in dilation):
        # Caffe does not check this, but a zero dilation collapses the kernel onto one pixel: not supported.
        raise rejected(layer_param, f"dilation must be positive, got {dilation}")
    return ConvGeometry(channel_axis, kernel, stride, pad, dilation)


def conv_out_shape(layer_param, g: ConvGeometry, spatial: Shape) -> Shape:
    """conv_layer.cpp: out = (in + 2p - extent) / s + 1, with C's truncating division."""
    out = []
    for size, e, s, p in zip(spatial, g.extent, g.stride, g.pad):
        numerator = size + 2 * p - e
        o = int(numerator / s) + 1
        if o <= 0:
            raise rejected(layer_param, f"kernel extent {g.extent} does not fit the input {spatial} padded by "
                                        f"{g.pad} (output size {o})")
        out.append(o)
    return tuple(out)


def conv_padding(g: ConvGeometry, out: Shape, spatial: Shape) -> list[tuple[int, int]]:
    """(low, high) padding per spatial axis for a VALID convolution giving Caffe's ``out`` windows.

    A high pad beyond p only arises when Caffe's truncating division keeps a partly outside window.
    """
    return [(p, p + max(0, (o - 1) * s + e - n - 2 * p))
            for p, o, s, e, n in zip(g.pad, out, g.stride, g.extent, spatial)]


def _deconv_out_shape(layer_param, g: ConvGeometry, spatial: Shape) -> Shape:
    """deconv_layer.cpp: out = s (in - 1) + extent - 2p."""
    out = tuple(s * (size - 1) + e - 2 * p for size, e, s, p in zip(spatial, g.extent, g.stride, g.pad))
    if any(o <= 0 for o in out):
        raise rejected(layer_param, f"deconvolution output size {out} from input {spatial} is empty")
    return out


def conv_channels(layer_param, bottom_shape: Shape, g: ConvGeometry) -> tuple[int, int, int]:
    """(channels, num_output, group) with LayerSetUp's CHECKs."""
    p = layer_param.convolution_param
    channels, num_output, group = bottom_shape[g.channel_axis], p.num_output, p.group
    if num_output <= 0:
        raise rejected(layer_param, f"num_output must be > 0, got {num_output}")
    if group <= 0 or channels % group:
        raise rejected(layer_param, f"the bottom's {channels} channels are not divisible by group {group}")
    if num_output % group:
        raise rejected(layer_param, f"num_output {num_output} should be a multiple of group {group}")
    return channels, num_output, group


def _conv_param_shapes(layer_param, bottom_shapes: Sequence[Shape], reverse: bool) -> list[Shape]:
    """W: conv_out x conv_in/group x kernel (conv_out = Cin for Deconvolution); b: num_output."""
    g = conv_geometry(layer_param, bottom_shapes[0])
    channels, num_output, group = conv_channels(layer_param, bottom_shapes[0], g)
    conv_out, conv_in = (channels, num_output) if reverse else (num_output, channels)
    shapes = [(conv_out, conv_in // group) + g.kernel]
    if layer_param.convolution_param.bias_term:
        shapes.append((num_output,))
    return shapes


def _conv_init_params(layer_param, shapes: Sequence[Shape], key) -> list:
    from caffejax.lower.fillers import fill, split

    p = layer_param.convolution_param
    fillers = [p.weight_filler, p.bias_filler][:len(shapes)]
    keys = split(key, len(shapes))
    return [fill(f, s, k) for f, s, k in zip(fillers, shapes, keys)]


def _as_batched(x: jax.Array, channel_axis: int) -> jax.Array:
    """(outer..., C, spatial...) -> (num, C, spatial...) with num = count(0, channel_axis)."""
    return x.reshape((count(x.shape, 0, channel_axis),) + x.shape[channel_axis:])


def _conv_setup(layer_param, bottom_shapes: Sequence[Shape], param_shapes: Sequence[Shape], num_tops: int,
                reverse: bool) -> tuple[ConvGeometry, int, int, int, Shape, Shape]:
    """(geometry, channels, num_output, group, spatial, out) of a (De)Convolution with BaseConvolutionLayer's
    CHECKs: one top per bottom, all bottoms alike, learnable blobs of the shapes LayerSetUp allocates."""
    if len(bottom_shapes) != num_tops:
        raise rejected(layer_param, f"needs one top per bottom, got {len(bottom_shapes)} bottoms and {num_tops} "
                                    f"tops")
    shape = tuple(bottom_shapes[0])
    for i, b in enumerate(bottom_shapes[1:], 1):
        if tuple(b) != shape:
            raise rejected(layer_param, f"shape mismatch - bottom[0]: {shape} vs. bottom[{i}]: {tuple(b)}")
    g = conv_geometry(layer_param, shape)
    channels, num_output, group = conv_channels(layer_param, shape, g)
    expected = _conv_param_shapes(layer_param, [shape], reverse)
    if [tuple(p) for p in param_shapes] != [tuple(p) for p in expected]:
        raise rejected(layer_param, f"expected learnable blobs of shapes {list(expected)}, got "
                                    f"{[tuple(p) for p in param_shapes]}")
    spatial = shape[g.channel_axis + 1:]
    out = _deconv_out_shape(layer_param, g, spatial) if reverse else conv_out_shape(layer_param, g, spatial)
    return g, channels, num_output, group, spatial, out


def _conv_top_shapes(reverse: bool):
    def top_shapes(layer_param, bottom_shapes, param_shapes, num_tops):
        g, _, num_output, _, _, out = _conv_setup(layer_param, bottom_shapes, param_shapes, num_tops, reverse)
        return [tuple(b[:g.channel_axis]) + (num_output,) + out for b in bottom_shapes]
    return top_shapes


def _add_bias(y: jax.Array, params: Sequence[jax.Array], nspatial: int) -> jax.Array:
    if len(params) < 2:
        return y
    return y + params[1].astype(y.dtype).reshape((1, -1) + (1,) * nspatial)


# Caffe runs a grouped convolution as one GEMM per group. XLA:CPU's feature_group_count convolutions are far
# slower than that (measured on 2 cores: 6x for AlexNet's two groups; 10-50x, forward and backward, for
# MobileNet's depthwise ones), so up to this many groups run as separate convolutions, and depthwise ones
# (one group per input channel, any number of filters each) as k*k shifted multiply-adds, which XLA fuses
# into one pass. ResNeXt's 32 groups are the worst case: XLA derives the filter gradient of a grouped
# convolution as a batch_group_count convolution, which XLA:CPU runs naively (a 3x3 layer of ResNeXt-50 at
# batch 4: 0.6-5.2 s, against 4-25 ms split). Split, ResNeXt-50's training step at batch 4 took 1.36 s instead
# of 36 s, and its forward at batch 16 0.68 of the time; the price is compile time (training step 4 -> 26 s,
# forward 1.2 -> 8.2 s), one small convolution per group in each direction. More groups than this (and not
# one per input channel) run as XLA's one convolution.
MAX_SPLIT_GROUPS = 64


def runs_group_by_group(group: int, channels: int, kernel: Shape) -> bool:
    """Whether :func:`grouped_convolution` splits its input into one convolution per group (neither the
    depthwise form nor XLA's one grouped convolution)."""
    depthwise = group == channels and math.prod(kernel) <= _MAX_TAPS
    return 1 < group <= MAX_SPLIT_GROUPS and not depthwise


def grouped_convolution(x: jax.Array, w: jax.Array, g: ConvGeometry, padding, out: Shape, group: int,
                        channels_last: bool = False, **options) -> jax.Array:
    """Caffe's convolution (no bias) of a batched x: (N, C, spatial...) with filters (O, C/g, k...), or
    with ``channels_last`` 2-D (N, H, W, C) with filters (kh, kw, C/g, O). ``options``: dot precision and
    accumulation dtype for lax.conv_general_dilated (products accumulate in the result's dtype)."""
    channel_axis, out_axis = (x.ndim - 1, w.ndim - 1) if channels_last else (1, 0)
    channels, num_output = x.shape[channel_axis], w.shape[out_axis]
    if group > 1 and group == channels and math.prod(g.kernel) <= _MAX_TAPS:  # num_output % group == 0
        if num_output > channels:
            # A channel multiplier m: output c*m + j filters input channel c, so it is the depthwise convolution
            # of each channel repeated m times. XLA's grouped convolution ran 4x 28x28x128 -> 256 at 25 ms
            # forward and 4.8 s backward (its filter gradient), this form at 1.6 and 7.9 ms.
            x = jnp.repeat(x, num_output // channels, axis=channel_axis)
        return _depthwise(x, w, g, tuple(map(tuple, padding)), out, channels_last,
                          options.get("preferred_element_type"))
    numbers = ("NHWC", "HWIO", "NHWC") if channels_last else None

    def conv(x, w, groups):
        return lax.conv_general_dilated(x, w, g.stride, padding, rhs_dilation=g.dilation,
                                        feature_group_count=groups, dimension_numbers=numbers, **options)

    if runs_group_by_group(group, channels, g.kernel):
        pairs = zip(jnp.split(x, group, axis=channel_axis), jnp.split(w, group, axis=out_axis))
        return jnp.concatenate([conv(xg, wg, 1) for xg, wg in pairs], axis=channel_axis)
    if channels_last and group == 1 and _input_gradient_by_gemm(g, x.shape, out, w.shape):
        return _conv_gemm_input_gradient(x, w, g, tuple(map(tuple, padding)), tuple(sorted(options.items())))
    return conv(x, w, group)


# XLA computes a convolution's input gradient as another convolution over every input position, of dy padded
# by (k-1)*d - pad: for an unpadded ("valid") convolution that multiplies the zeros around dy too, H*W /
# (OH*OW) times the forward's work (2.25x for LeNet's conv2, 12x12 -> 8x8). As a product dy . W^T, giving
# each output's k*k columns, summed back onto the input (col2im), it costs the forward's work and a cheap
# pass. LeNet's conv2 at batch 16: 1.97 -> 0.77 ms. Only for stride 1 (a stride spreads the columns, and
# XLA's fused sum of spread arrays is slow) and while the columns (N*OH*OW x k*k*C) stay under 64M elements.
# Not for padded ("same") convolutions: alone, SqueezeNet's 3x3 expand layers' input gradients at batch 16 ran
# 1.6-1.9x faster this way, but whole training steps were slower (paired A/B: SqueezeNet v1.1 1.063,
# GoogLeNet 1.067); XLA's own runs beside the filter gradient, the product and col2im pass do not.
_GEMM_INPUT_GRADIENT_MIN_WASTE = 1.5
_GEMM_INPUT_GRADIENT_MAX_COLUMNS = 1 << 26


def _input_gradient_by_gemm(g: ConvGeometry, x_shape: Shape, out: Shape, w_shape: Shape) -> bool:
    spatial = x_shape[1:-1]
    columns = x_shape[0] * math.prod(out) * math.prod(w_shape[:-1])
    if is_symbolic(columns):  # a batch-polymorphic export, which holds no backward: XLA's convolution
        return False
    waste = math.prod(spatial) / math.prod(out)
    return (all(s == 1 for s in g.stride) and waste >= _GEMM_INPUT_GRADIENT_MIN_WASTE
            and columns <= _GEMM_INPUT_GRADIENT_MAX_COLUMNS)


def _conv_nhwc(x, w, g: ConvGeometry, padding, options) -> jax.Array:
    return lax.conv_general_dilated(x, w, g.stride, padding, rhs_dilation=g.dilation,
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"), **dict(options))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _conv_gemm_input_gradient(x, w, g: ConvGeometry, padding, options) -> jax.Array:
    """A channels-last convolution (one group) whose input gradient is col2im(dy . W^T)."""
    return _conv_nhwc(x, w, g, padding, options)


def _conv_gemm_input_gradient_fwd(x, w, g, padding, options):
    return _conv_nhwc(x, w, g, padding, options), (x, w)


def _conv_gemm_input_gradient_bwd(g, padding, options, residuals, dy):
    x, w = residuals
    dw = jax.vjp(lambda w: _conv_nhwc(x, w, g, padding, options), w)[1](dy)[0]
    nsp = len(g.kernel)
    kernel_cells, channels = math.prod(g.kernel), w.shape[-2]
    columns = lax.dot_general(dy, w.reshape(kernel_cells * channels, w.shape[-1]).astype(dy.dtype),
                              (((dy.ndim - 1,), (1,)), ((), ())), **dict(options))
    # col2im one kernel axis at a time, first (rows) first: offset o's columns land at o*d along that axis of
    # the padded input, summed into one array per offset of the kernel axes after it; then the padding is
    # cropped off. All k*k offsets summed in one pass (the adjoint of _taps as written) made XLA evaluate every
    # pad's bounds for every cell of the padded input: LeNet's training step at batch 16 took 1.036x as long
    # (paired A/B; conv2 5x5, 12x12 -> 8x8). Rows first, each offset's columns are kw x C contiguous values,
    # where last first they were C: the step took 0.967-0.974 of the time (batch 16 and 1, 2 Sapphire Rapids
    # cores); one pad of the columns per axis, read at k shifted offsets, took 1.106.
    # Each axis's sum is read at k offsets by the next axis's pads; left to XLA, it wrote the k padded arrays
    # apart and summed them again for every read (LeNet's conv2: five 36-43 us passes and a 61 us one). So every
    # axis but the last is summed apart (common.unfused; the filters are the test, see there): 76 us in all,
    # LeNet's step 0.93 of the time at batch 16 (2.24 -> 2.08 ms), 0.97 at batches 1 and 64, the same bits.
    columns = columns.reshape(dy.shape[:-1] + tuple(g.kernel) + (channels,))
    padded = [size + lo + hi for size, (lo, hi) in zip(x.shape[1:1 + nsp], padding)]

    def land(columns, axis):
        pads = [(0, 0)] * nsp
        summed = None
        for o in range(g.kernel[axis]):
            start = o * g.dilation[axis]
            pads[axis] = (start, padded[axis] - start - dy.shape[1 + axis])
            # The kernel axes left are (axis, ..., nsp - 1), after the batch and the nsp spatial ones.
            placed = _pad(lax.index_in_dim(columns, o, 1 + nsp, keepdims=False), 1, pads, 0)
            summed = placed if summed is None else summed + placed
        return summed

    for axis in range(nsp - 1):
        columns = unfused(lambda w, columns, axis=axis: land(columns, axis), w, columns)
    columns = land(columns, nsp - 1)
    dx = _pad(columns, 1, [(-lo, -hi) for lo, hi in padding], 0)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_conv_gemm_input_gradient.defvjp(_conv_gemm_input_gradient_fwd, _conv_gemm_input_gradient_bwd)


def _few_channel_taps(x, w, g: ConvGeometry, padding, out: Shape, options) -> jax.Array:
    dtype = dict(options).get("preferred_element_type") or x.dtype
    taps = convolution_taps(x, 2, g, padding, out)
    per_tap = w.reshape(w.shape[0], w.shape[1], len(taps)).astype(dtype)  # output, channel, offset
    per_output = (-1,) + (1,) * len(out)
    y = None
    for t, tap in enumerate(taps):
        for c in range(tap.shape[1]):
            term = tap[:, c:c + 1].astype(dtype) * per_tap[:, c, t].reshape(per_output)
            y = term if y is None else y + term
    return y


def _channels_last_convolution(x, w, g: ConvGeometry, padding, options) -> jax.Array:
    """XLA's channels-last convolution of a 2-D NCHW x with Caffe's O x C x kh x kw filters, NCHW out: the
    function whose derivative gives :func:`few_channel_convolution`'s gradients (its forward is the taps)."""
    y = _conv_nhwc(x.transpose(0, 2, 3, 1), w.transpose(2, 3, 1, 0), g, padding, options)
    return y.transpose(0, 3, 1, 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def few_channel_convolution(x, w, g: ConvGeometry, padding, out: Shape, options) -> jax.Array:
    """A convolution (one group) of a 2-D NCHW x over a few input channels with Caffe's O x C x kh x kw
    filters, as k*k*C shifted multiply-adds, which XLA fuses into one pass over the output; its own
    convolution runs a 1-channel one at 10-20 GFLOP/s (LeNet's conv1, 5x5, at batch 16: 0.66-0.85 ms alone,
    this 0.42 ms). ``options``: the products' accumulation (``preferred_element_type``, ``precision``) as
    sorted (name, value) pairs.

    Channels first, the fused sum runs along output rows (24 pixels for LeNet's conv1); channels last it ran
    across the 20 output channels and XLA:CPU vectorised it worse. LeNet's forward (compile_inference, paired
    A/B, 2 AMD EPYC cores): batch 16 1.10 -> 1.01 ms (minimum 0.75 -> 0.70), batch 64 3.74 -> 3.26 ms.

    The sum is written out apart from its readers (:func:`~caffejax.lower.common.unfused`): XLA fuses
    element-wise taps into every reader of the output and computes them again there. Fused into LeNet's pool1,
    each 2x2 window's loop computed its four sums, 0.23-0.25 ms against 0.10-0.14 for the sum and 0.06 for the
    pooling apart (traced, batch 16, 2 AMX Xeon cores); LeNet's forward (alternating blocks, the same outputs
    bit for bit): compile_inference at batch 16 0.99-1.03 -> 0.95-0.99 ms, at batch 64 2.73 -> 2.49 ms,
    bfloat16 at batch 16 0.95 -> 0.90 ms; Net.forward 1.14 -> 1.10 and 2.89 -> 2.67 ms.

    The gradients are XLA's convolution's: the derivative of the sum would be k*k*C separate reductions. A
    differentiated program computes the forward as the taps too, written out once for the backward's readers:
    LeNet's training step (the bench's, alternating blocks) at batch 16 2.59-2.87 -> 2.41-2.53 ms, at batch 64
    8.55 -> 7.96 ms against XLA's convolution there; Solver.step at batch 16 3.07 -> 2.89 ms. (Fused, the
    backward's fusions computed the taps again: 3.4-4.1 ms against 3.1-3.5 ms with XLA's convolution, 2 AMD EPYC
    cores.)"""
    return _few_channel_taps_apart(x, w, g, padding, out, options)


def _few_channel_taps_apart(x, w, g: ConvGeometry, padding, out: Shape, options) -> jax.Array:
    # The conditional tests the filters (the first operand), not x: vmapped over examples (per-example gradients,
    # caffejax.grad) a test of x would be batched, and JAX would then run both branches and select.
    return unfused(lambda w, x: _few_channel_taps(x, w, g, padding, out, options), w, x)


def _few_channel_convolution_fwd(x, w, g, padding, out, options):
    return _few_channel_taps_apart(x, w, g, padding, out, options), (x, w)


def _few_channel_convolution_bwd(g, padding, out, options, residuals, dy):
    x, w = residuals
    dx, dw = jax.vjp(lambda x, w: _channels_last_convolution(x, w, g, padding, options), x, w)[1](dy)
    return dx.astype(x.dtype), dw.astype(w.dtype)


few_channel_convolution.defvjp(_few_channel_convolution_fwd, _few_channel_convolution_bwd)


def _depthwise_taps(x, w, g: ConvGeometry, padding, out: Shape, channels_last: bool, accumulate) -> jax.Array:
    """One filter per channel: sum over the kernel offsets t (row-major, Caffe's im2col order) of the
    shifted input times that offset's per-channel weight."""
    dtype = accumulate or x.dtype
    # Each offset's weights are taken once, as a (1, ..., C, ...) array along the taps' channel axis, and
    # broadcast and multiplied in lax's own operations: a padded layer sums its taps region by region, and
    # jnp's indexing and broadcasting arithmetic per tap and region took 0.5 s of MobileNet v2's training
    # step's trace. (The same operations as jnp's: the same program.)
    ndim = len(out) + 2
    if channels_last:                                   # (k..., 1, C)
        per_tap, row_shape = w.reshape(-1, w.shape[-1]), (1,) * (ndim - 1) + (w.shape[-1],)
    else:                                               # (C, 1, k...)
        per_tap, row_shape = w.reshape(w.shape[0], -1).T, (1, w.shape[0]) + (1,) * (ndim - 2)
    per_tap = lax.convert_element_type(per_tap, dtype)
    rows = [lax.reshape(lax.index_in_dim(per_tap, t, keepdims=False), row_shape) for t in range(per_tap.shape[0])]

    def weighted_sum(taps):
        def term(t):
            tap = lax.convert_element_type(taps[t], dtype)
            return lax.mul(tap, lax.broadcast_in_dim(rows[t], tap.shape, tuple(range(ndim))))

        y = term(0)
        for t in range(1, len(taps)):
            y = lax.add(y, term(t))
        return y

    if channels_last:
        return _by_regions(x, g, padding, out, weighted_sum)
    return weighted_sum(convolution_taps(x, 2, g, padding, out))


# A padded depthwise layer read its input through a padded copy that XLA:CPU wrote out first (with the ReLU and
# bias before it fused into the copy), then took the taps from it. Split by regions, the outputs whose windows
# lie inside the input read it unpadded and only thin strips along the edges are padded: the same sums. Alone,
# a product, ReLU and 3x3 stride-2 depthwise layer at batch 16 (bfloat16, 2 AMX Xeon cores): MobileNet v2's
# 112x112x96 17.1 -> 9.5 ms, 56x56x144 3.4 -> 2.5, 28x28x192 1.22 -> 1.00, 14x14x576 0.91 -> 0.80; 112x112x96
# at batch 1 0.71 -> 0.60. Stride-1 layers alone were 1.03-1.10x slower so (56x56x144, 112x112x32, 28x28x192,
# 14x14x384), but inside MobileNet v2's whole forward, with the strided ones by regions already, taking the
# stride-1 ones too took 0.901 of the time in bfloat16 and 0.945 in float32 at batch 16, 0.973 and 0.990 at
# batch 1 (the float32 outputs the same bits, the bfloat16 ones within 6e-5 of them, as close to float32's).
def _by_regions(x, g: ConvGeometry, padding, out: Shape, weighted_sum) -> jax.Array:
    """``weighted_sum`` of the taps of a channels-last x (N, spatial..., C), computed by regions of the output:
    along each axis, the outputs whose windows need padding before and after, and those between them, which
    recurse into the next axis (in 2-D: the top and bottom rows, then the left and right edges of the rows
    between, and the inside, which reads x unpadded); the regions joined back in place."""
    spatial = x.shape[1:1 + len(out)]
    inside = []
    for k, s, d, (lo, _), size, o in zip(g.kernel, g.stride, g.dilation, padding, spatial, out):
        begin = -(-lo // s)
        end = max(begin, min(o, (size - 1 - (k - 1) * d + lo) // s + 1))
        inside.append((begin, end))

    def region(box):
        """The taps of the outputs in ``box`` ((begin, end) per axis) from the input span their windows read,
        padded only where that span leaves the input."""
        starts, limits, pads = [0], [x.shape[0]], []
        for (o0, o1), k, s, d, (lo, _), size in zip(box, g.kernel, g.stride, g.dilation, padding, spatial):
            i0, i1 = o0 * s - lo, (o1 - 1) * s - lo + (k - 1) * d + 1   # the input span [i0, i1) they read
            start = min(max(i0, 0), size)
            limit = max(min(i1, size), start)
            starts.append(start)
            limits.append(limit)
            # (windows wholly in the padding, where pad >= the kernel's extent, read no input at all)
            pads.append((start - i0, i1 - limit) if limit > start else (i1 - i0, 0))
        span = lax.slice(x, starts + [0], limits + [x.shape[-1]])
        return weighted_sum(convolution_taps(span, 1, g, pads, tuple(o1 - o0 for o0, o1 in box)))

    def build(axis: int, box: list[tuple[int, int]]) -> jax.Array:
        if axis == len(out):
            return region(box)
        begin, end = inside[axis]
        rest = [(0, o) for o in out[axis + 1:]]
        if begin >= end:  # no output window lies inside the input along this axis
            return region(box + [(0, out[axis])] + rest)
        parts = [region(box + [(0, begin)] + rest)] if begin > 0 else []
        parts.append(build(axis + 1, box + [(begin, end)]))
        if end < out[axis]:
            parts.append(region(box + [(end, out[axis])] + rest))
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1 + axis)

    return build(0, [])


# XLA:CPU sums each kernel offset's filter gradient over batch and space (keeping the channel axis) with the
# padded input and the products materialised: over the whole batch those buffers leave the cache (past 32 MB
# glibc also maps each one afresh, so every call page-faults it in). A few images at a time they stay small
# and cached: MobileNet v2 at batch 16 on 2 cores, 112x112x32: 110 -> 26 ms; its training step 2.4 -> 1.9 s.
# Chunks of 1, 2, 4 and 8 images were tried there, 2 was best: one image per core, at least 2. Chunking the
# forward (x 4 faster alone for 112x112x96 stride 2) gained nothing inside the whole programs, and the input
# gradient chunked measured 3-8x slower alone, so both run over the whole batch. Channels-last 2-D filter
# gradients on the CPU go by rows instead (:func:`_depthwise_filter_gradient_by_rows`).
def _depthwise_chunk() -> int:
    return max(2, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


# Products one block of :func:`_depthwise_filter_gradient_by_rows` adds per output element: 28 rows for a 3x3
# kernel. Measured alone on MobileNet v2's shapes at batch 16 (2 AVX2 cores), blocks of 28 rows were best or
# near it everywhere; 14-16 rows were up to 2x slower on the big images (each block has a fixed cost), 56 a
# little slower.
_DEPTHWISE_BLOCK_PRODUCTS = 252


def _divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, max(1, min(n, limit)) + 1) if n % d == 0)


def _row(x: jax.Array, m: int, r: int, dtype) -> jax.Array:
    """``x[m, r]`` of a 4-D array, in ``dtype``."""
    row = lax.slice(x, (m, r) + (0,) * (x.ndim - 2), (m + 1, r + 1) + x.shape[2:])
    return lax.convert_element_type(lax.reshape(row, x.shape[2:]), dtype)


def _depthwise_filter_gradient_by_rows(x, dy, g: ConvGeometry, padding, out: Shape, dtype) -> jax.Array:
    """The filter gradient of a channels-last 2-D :func:`_depthwise_taps`, ``dw[t, c] = sum over n, o of
    xpad[n, o*s + t*d, c] * dy[n, o, c]``, summed a block of rows at a time: each block (a few images, or a
    few rows of one) is one element-wise pass that adds, for every kernel offset, its products over the
    block's rows into a (k*k, OW, C) total; the totals are summed over OW at the end.

    XLA:CPU's own form sums each offset's products separately, materialising the offset's shifted view of
    the input and reading x and dy again for each of the k*k offsets. Here x and dy are read once, the
    block's rows staying cached while every offset uses them. Measured alone at batch 16 (2 AVX2 cores)
    against two images at a time of XLA's form: 112x112x32 28 -> 14 ms, 56x56x144 25 -> 11 ms, 28x28x192
    6.3 -> 4.4 ms, 7x7x960 5.1 -> 2.6 ms; stride 2, 112x112x96 23 -> 18 ms and 56x56x144 6.2 -> 7.0 ms."""
    (kh, kw), (sh, sw), (dil_h, dil_w) = g.kernel, g.stride, g.dilation
    if dy.size == 0:  # an empty batch: no product to sum, and no block to slice
        return jnp.zeros((kh, kw, 1, x.shape[-1]), dtype)
    xpad = _pad(x, 1, padding, 0)
    n, (oh, ow), channels = x.shape[0], out, x.shape[-1]
    terms = max(1, _DEPTHWISE_BLOCK_PRODUCTS // (kh * kw))
    if oh >= terms:
        images, rows = 1, _divisor_at_most(oh, terms)
        if 2 * rows < terms:  # no good divisor: zero rows of dy (and rows of x under them) fill the last block
            rows = terms
            extra = -oh % rows
            dy = _pad(dy, 1, [(0, extra), (0, 0)], 0)
            need = (oh + extra - 1) * sh + (kh - 1) * dil_h + 1
            xpad = _pad(xpad, 1, [(0, max(0, need - xpad.shape[1])), (0, 0)], 0)
    else:
        images, rows = _divisor_at_most(n, terms // oh), oh
    row_blocks = dy.shape[1] // rows
    span = (rows - 1) * sh + (kh - 1) * dil_h + 1

    # The block is written in lax's own operations, each input row and each row's column window taken once:
    # a block adds k*k*rows products, and jnp's indexing and arithmetic cost ~0.1 ms apiece to trace, where
    # these take a few microseconds. MobileNet v2's training step traced in 4.7 s, 2.9 of them here.
    def block(i, total):
        b, r0 = (i // row_blocks) * images, (i % row_blocks) * rows
        xs = lax.dynamic_slice(xpad, (b, r0 * sh, 0, 0), (images, span, xpad.shape[2], channels))
        ds = lax.dynamic_slice(dy, (b, r0, 0, 0), (images, rows, ow, channels))
        dy_rows = {(m, r): _row(ds, m, r, dtype) for m in range(images) for r in range(rows)}
        x_row = functools.cache(lambda m, row: _row(xs, m, row, dtype))

        @functools.cache
        def window(m: int, row: int, kj: int) -> jax.Array:   # image m's input row ``row`` under kernel column kj
            return lax.slice(x_row(m, row), (kj * dil_w, 0), (kj * dil_w + (ow - 1) * sw + 1, channels), (sw, 1))

        sums = []
        for ki, kj in itertools.product(range(kh), range(kw)):
            products = [lax.mul(window(m, r * sh + ki * dil_h, kj), dy_rows[m, r])
                        for m in range(images) for r in range(rows)]
            sums.append(functools.reduce(lax.add, products))
        return total + jnp.stack(sums)

    blocks = (n // images) * row_blocks
    total = lax.fori_loop(0, blocks, block, jnp.zeros((kh * kw, ow, channels), dtype))
    return total.sum(axis=1).reshape(kh, kw, 1, channels)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _depthwise(x, w, g: ConvGeometry, padding, out: Shape, channels_last: bool, accumulate=None) -> jax.Array:
    """:func:`_depthwise_taps`, whose filter gradient is summed by blocks of rows (channels-last) or a few images
    at a time on the CPU."""
    return _depthwise_taps(x, w, g, padding, out, channels_last, accumulate)


def _depthwise_fwd(x, w, g, padding, out, channels_last, accumulate):
    return _depthwise_taps(x, w, g, padding, out, channels_last, accumulate), (x, w)


def _depthwise_input_gradient(dy, w, g: ConvGeometry, padding, spatial: Shape, channels_last: bool,
                              accumulate) -> jax.Array:
    """dx of :func:`_depthwise_taps`, written as the forward of another depthwise convolution: dy spread out by
    the stride (zeros between its elements), padded by (k-1)*d - pad, correlated with the flipped filters.

    JAX's own derivative pads each offset's contribution back to the input's shape and sums the k*k padded
    arrays. XLA:CPU fuses that into one loop that tests, for every input element, every offset's padding
    (interior padding too, for a stride), together with what it fused around it; in MobileNet v2's training
    step at batch 16 the 112x112x96 stride-2 one took 83 ms, where this form's k*k plain views of one
    padded array run as a forward does. The step went 1.13-1.31 -> 0.93-0.96 s."""
    first = 1 if channels_last else 2
    pads = []
    for k, s, d, (lo, _), size, o in zip(g.kernel, g.stride, g.dilation, padding, spatial,
                                         dy.shape[first:first + len(spatial)]):
        before = (k - 1) * d - lo
        pads.append((before, size + (k - 1) * d - before - ((o - 1) * s + 1)))
    spread = _pad(dy, first, pads, 0, interior=[s - 1 for s in g.stride])
    flipped = jnp.flip(w, tuple(range(len(spatial))) if channels_last else tuple(range(2, w.ndim)))
    unit = dataclasses.replace(g, stride=(1,) * len(spatial), pad=(0,) * len(spatial))
    return _depthwise_taps(spread, flipped, unit, ((0, 0),) * len(spatial), spatial, channels_last, accumulate)


def _depthwise_bwd(g, padding, out, channels_last, accumulate, residuals, dy):
    x, w = residuals

    def forward(x, w):
        return _depthwise_taps(x, w, g, padding, out, channels_last, accumulate)

    first = 1 if channels_last else 2
    spatial = x.shape[first:first + len(g.kernel)]
    dx = _depthwise_input_gradient(dy, w, g, padding, spatial, channels_last, accumulate).astype(x.dtype)
    total_dtype = jnp.promote_types(w.dtype, jnp.float32)
    if jax.default_backend() == "cpu" and channels_last and len(g.kernel) == 2:
        return dx, _depthwise_filter_gradient_by_rows(x, dy, g, padding, out, total_dtype).astype(w.dtype)

    def filter_gradient(x, dy):
        return jax.vjp(lambda w: forward(x, w), w)[1](dy)[0].astype(total_dtype)

    chunk, batch = _depthwise_chunk(), x.shape[0]
    if jax.default_backend() != "cpu" or batch <= chunk:
        return dx, filter_gradient(x, dy).astype(w.dtype)
    whole = batch - batch % chunk
    pairs = (x[:whole].reshape((-1, chunk) + x.shape[1:]), dy[:whole].reshape((-1, chunk) + dy.shape[1:]))
    dw = lax.scan(lambda total, pair: (total + filter_gradient(*pair), None), jnp.zeros(w.shape, total_dtype),
                  pairs)[0]
    if whole < batch:
        dw = dw + filter_gradient(x[whole:], dy[whole:])
    return dx, dw.astype(w.dtype)


_depthwise.defvjp(_depthwise_fwd, _depthwise_bwd)


@layer("Convolution", param_shapes=lambda lp, shapes: _conv_param_shapes(lp, shapes, reverse=False),
       init_params=_conv_init_params, bottoms=(1, None), tops=(1, None), top_shapes=_conv_top_shapes(False),
       rows_apart=True)
def convolution(ctx: LayerContext, bottoms, params):
    """y = W * x + b per group (cross-correlation), W: Cout x Cin/g x k..., one top per bottom."""
    shape = tuple(bottoms[0].shape)
    g, _, num_output, group, spatial, out = _conv_setup(ctx.layer, [b.shape for b in bottoms],
                                                        [p.shape for p in params], ctx.num_tops, reverse=False)
    padding = conv_padding(g, out, spatial)
    tops = []
    for x in bottoms:
        y = grouped_convolution(_as_batched(x, g.channel_axis), params[0].astype(x.dtype), g, padding, out, group,
                                precision=lax.Precision.HIGHEST)
        y = _add_bias(y, params, len(spatial))
        tops.append(y.reshape(shape[:g.channel_axis] + (num_output,) + out))
    return tops


def _deconvolution_by_col2im(x: jax.Array, w: jax.Array, g: ConvGeometry, group: int, out: Shape) -> jax.Array:
    """2-D Deconvolution of x (N, C, H, W) by w (C, O/g, kh, kw) as Caffe's col2im(W^T x): input pixel (i, j)
    adds W[c, o, t, u] x[c, i, j] to output (i*sh + t*dh - ph, j*sw + u*dw - pw).

    The dilated kernel is padded with zero taps to P x Q blocks of stride size, t = p*sh + a: the columns
    (one product per group) then land on output block (i + p, j + q), phase (a, b), so col2im is P*Q shifted
    sums of whole blocks, and blocks and phases interleave by a reshape. XLA's transposed convolution (a
    convolution of the stride-dilated input) multiplies all the zeros between the input's pixels: the bilinear
    upsampling Caffe's documentation recommends (group: C), 16x16 / 8 over 21 channels of 16x16, took 333 ms
    forward; a learned 4x4 / 2 one of 4x64x32x32 19 ms forward and 151 ms for its filter gradient."""
    n, c, h, wd = x.shape
    og = w.shape[1]
    (sh, sw), (dh, dw), (ph, pw) = g.stride, g.dilation, g.pad
    eh, ew = g.extent
    p_blocks, q_blocks = -(-eh // sh), -(-ew // sw)
    taps = jnp.zeros((c, og, p_blocks * sh, q_blocks * sw), w.dtype).at[:, :, :eh:dh, :ew:dw].set(w)
    taps = taps.reshape(group, c // group, og, p_blocks, sh, q_blocks, sw)
    cols = jnp.einsum("ngchw,gcopaqb->ngopqhawb", x.reshape(n, group, c // group, h, wd), taps,
                      precision=lax.Precision.HIGHEST)
    blocks = sum(jnp.pad(cols[:, :, :, p, q], ((0, 0),) * 3 + ((p, p_blocks - 1 - p), (0, 0),
                                                               (q, q_blocks - 1 - q), (0, 0)))
                 for p in range(p_blocks) for q in range(q_blocks))
    full = blocks.reshape(n, group * og, (h + p_blocks - 1) * sh, (wd + q_blocks - 1) * sw)
    return full[:, :, ph:ph + out[0], pw:pw + out[1]]


def _deconvolution_by_convolution(x: jax.Array, w: jax.Array, g: ConvGeometry, group: int) -> jax.Array:
    """Deconvolution of x (N, C, spatial...) by w (C, O/g, k...) as a convolution of the stride-dilated input
    with the spatially flipped kernel whose two channel axes are swapped within each group, padded by
    extent - 1 - p on both sides."""
    channels, og, nsp = w.shape[0], w.shape[1], w.ndim - 2
    w = jnp.swapaxes(w.reshape((group, channels // group, og) + g.kernel), 1, 2)
    w = jnp.flip(w.reshape((group * og, channels // group) + g.kernel), axis=tuple(range(2, 2 + nsp)))
    return lax.conv_general_dilated(x, w, window_strides=(1,) * nsp,
                                    padding=[(e - 1 - p, e - 1 - p) for e, p in zip(g.extent, g.pad)],
                                    lhs_dilation=g.stride, rhs_dilation=g.dilation, feature_group_count=group,
                                    precision=lax.Precision.HIGHEST)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _deconvolution_2d(x: jax.Array, w: jax.Array, g: ConvGeometry, group: int, out: Shape) -> jax.Array:
    """2-D Deconvolution: forward and filter gradient by :func:`_deconvolution_by_col2im`; input gradient by
    :func:`_deconvolution_by_convolution`, whose derivative in x is a plain strided convolution of dy (Caffe's
    im2col + GEMM), where the columns' derivative regathers and transposes them (measured alone: 1.6-6.7 ms
    against 5.1-22.6 ms)."""
    return _deconvolution_by_col2im(x, w, g, group, out)


def _deconvolution_2d_fwd(x, w, g, group, out):
    return _deconvolution_by_col2im(x, w, g, group, out), (x, w)


def _deconvolution_2d_bwd(g, group, out, residuals, dy):
    x, w = residuals
    _, input_vjp = jax.vjp(lambda x: _deconvolution_by_convolution(x, w, g, group), x)
    _, filter_vjp = jax.vjp(lambda w: _deconvolution_by_col2im(x, w, g, group, out), w)
    return input_vjp(dy)[0], filter_vjp(dy)[0]


_deconvolution_2d.defvjp(_deconvolution_2d_fwd, _deconvolution_2d_bwd)


@layer("Deconvolution", param_shapes=lambda lp, shapes: _conv_param_shapes(lp, shapes, reverse=True),
       init_params=_conv_init_params, bottoms=(1, None), tops=(1, None), top_shapes=_conv_top_shapes(True),
       rows_apart=True)
def deconvolution(ctx: LayerContext, bottoms, params):
    """y = W^T x + b: the transpose of Convolution (Caffe's col2im), W: Cin x Cout/g x k...

    2-D: as Caffe computes it, the columns W^T x summed into the output (:func:`_deconvolution_2d`). Otherwise
    as :func:`_deconvolution_by_convolution`.
    """
    shape = tuple(bottoms[0].shape)
    g, channels, num_output, group, spatial, out = _conv_setup(
        ctx.layer, [b.shape for b in bottoms], [p.shape for p in params], ctx.num_tops, reverse=True)
    nsp = len(spatial)
    tops = []
    for x in bottoms:
        x_batched, w = _as_batched(x, g.channel_axis), params[0].astype(x.dtype)
        if nsp == 2:
            y = _deconvolution_2d(x_batched, w, g, group, out)
        else:
            y = _deconvolution_by_convolution(x_batched, w, g, group)
        y = _add_bias(y, params, nsp)
        tops.append(y.reshape(shape[:g.channel_axis] + (num_output,) + out))
    return tops


@layer("Im2col", bottoms=(1, 1), tops=(1, 1), rows_apart=True)
def im2col(ctx: LayerContext, bottoms, params):
    """Caffe's column buffer: top channel c*prod(k) + (kernel offset, row-major) holds that tap of channel c."""
    (x,) = bottoms
    g = conv_geometry(ctx.layer, tuple(x.shape))
    first = g.channel_axis + 1
    spatial = tuple(x.shape[first:])
    if not spatial:
        raise ctx.error(f"needs at least one spatial axis after the channel axis, bottom shape {x.shape}")
    out = conv_out_shape(ctx.layer, g, spatial)
    # Pad so every (partly outside) window Caffe's size formula admits reads zeros, and no more.
    pads = [(p, (o - 1) * s + e - n - p) for p, o, s, e, n in zip(g.pad, out, g.stride, g.extent, spatial)]
    cols = _windows(_pad(x, first, pads, 0), first, g.kernel, g.stride, g.dilation, out)  # (..., C, K, out...)
    return [cols.reshape(x.shape[:g.channel_axis] + (x.shape[g.channel_axis] * math.prod(g.kernel),) + out)]


# ---- Pooling: pooling_layer.cpp ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PoolGeometry:
    """One 2-D pooling window layout over an (H, W) input; ``out`` is Caffe's pooled size."""

    method: int
    kernel: tuple[int, int]
    stride: tuple[int, int]
    pad: tuple[int, int]
    size: tuple[int, int]
    out: tuple[int, int]

    @property
    def padded_size(self) -> tuple[int, ...]:
        """The padded input's size per axis: exactly the ``out`` windows."""
        return tuple((o - 1) * s + k for o, s, k in zip(self.out, self.stride, self.kernel))

    def padding(self) -> list[tuple[int, int]]:
        """(low, high) per axis so the padded input holds exactly the ``out`` windows (high may crop)."""
        return [(p, e - n - p) for p, e, n in zip(self.pad, self.padded_size, self.size)]


def _pool_geometry(layer_param, method: int, kernel, stride, pad, size, round_mode: int,
                   global_pooling: bool = False) -> PoolGeometry:
    """PoolingLayer's LayerSetUp CHECKs and Reshape's output size (ceil/floor, then the pad clip)."""
    if global_pooling and (any(pad) or any(s != 1 for s in stride)):
        raise rejected(layer_param, f"with global_pooling: true only pad = 0 and stride = 1 (pad {pad}, "
                                    f"stride {stride})")
    if any(k <= 0 for k in kernel):
        raise rejected(layer_param, f"filter dimensions cannot be zero, got kernel {kernel}")
    if any(s <= 0 for s in stride):
        raise rejected(layer_param, f"stride must be positive, got {stride}")
    if any(pad):
        if method not in (POOL_AVE, POOL_MAX):
            raise rejected(layer_param, f"padding (pad {pad}) is implemented only for average and max pooling")
        if any(p >= k for p, k in zip(pad, kernel)):
            raise rejected(layer_param, f"pad {pad} must be smaller than kernel {kernel}")
    if round_mode not in (ROUND_CEIL, ROUND_FLOOR):
        raise rejected(layer_param, f"unknown rounding mode {round_mode}")
    out = []
    for n, k, s, p in zip(size, kernel, stride, pad):
        span = n + 2 * p - k
        o = (-(-span // s) if round_mode == ROUND_CEIL else span // s) + 1
        # With any padding, the last window must start strictly inside the image (plus its low pad).
        if any(pad) and (o - 1) * s >= n + p:
            o -= 1
        if any(pad) and (o - 1) * s >= n + p:
            raise rejected(layer_param, f"the last pooling window starts in the padding (input {size}, kernel "
                                        f"{kernel}, stride {stride}, pad {pad})")
        if o <= 0:
            raise rejected(layer_param, f"kernel {kernel} with pad {pad} does not fit the input {size}")
        out.append(o)
    return PoolGeometry(method, tuple(kernel), tuple(stride), tuple(pad), tuple(size), tuple(out))


def pooling_geometry(layer_param, shape: Shape) -> PoolGeometry:
    p = layer_param.pooling_param
    if len(shape) != 4:
        raise rejected(layer_param, f"input must have 4 axes (num, channels, height, width), got {shape}")
    if p.global_pooling:
        if p.HasField("kernel_size") or p.HasField("kernel_h") or p.HasField("kernel_w"):
            raise rejected(layer_param, "with global_pooling: true the filter size cannot be specified")
        kernel = shape[2:]
    else:
        if p.HasField("kernel_size") == (p.HasField("kernel_h") and p.HasField("kernel_w")):
            raise rejected(layer_param, "filter size is kernel_size OR kernel_h and kernel_w; not both")
        kernel = (p.kernel_size,) * 2 if p.HasField("kernel_size") else (p.kernel_h, p.kernel_w)
    if not ((not p.HasField("pad") and p.HasField("pad_h") and p.HasField("pad_w"))
            or (not p.HasField("pad_h") and not p.HasField("pad_w"))):
        raise rejected(layer_param, "pad is pad OR pad_h and pad_w are required")
    if not ((not p.HasField("stride") and p.HasField("stride_h") and p.HasField("stride_w"))
            or (not p.HasField("stride_h") and not p.HasField("stride_w"))):
        raise rejected(layer_param, "stride is stride OR stride_h and stride_w are required")
    pad = (p.pad_h, p.pad_w) if p.HasField("pad_h") else (p.pad,) * 2
    stride = (p.stride_h, p.stride_w) if p.HasField("stride_h") else (p.stride,) * 2
    return _pool_geometry(layer_param, p.pool, kernel, stride, pad, shape[2:], p.round_mode,
                          p.global_pooling)


def _pool_windows(x: jax.Array, g: PoolGeometry, fill) -> jax.Array:
    """(N, C, kh*kw, oh, ow): every window of x, padding and overhang cells set to ``fill``."""
    return _windows(_pad(x, 2, g.padding(), fill), 2, g.kernel, g.stride, (1, 1), g.out)


def _pool_taps(x: jax.Array, g: PoolGeometry, fill, first_axis: int) -> list[jax.Array]:
    """Each window offset's view of x (padding and overhang cells set to ``fill``), row-major."""
    return _taps(_pad(x, first_axis, g.padding(), fill), first_axis, g.kernel, g.stride, (1, 1), g.out)


def _window_index(g: PoolGeometry, t: jax.Array, trailing: int) -> jax.Array:
    """Caffe's flat bottom index h * W + w of window element ``t`` (row-major in the kernel; int32, one per
    output, whose two spatial axes are followed by ``trailing`` axes)."""
    ones = (1,) * trailing
    rows = (np.arange(g.out[0]) * g.stride[0] - g.pad[0]).reshape((-1, 1) + ones)
    cols = (np.arange(g.out[1]) * g.stride[1] - g.pad[1]).reshape((-1,) + ones)
    return (rows + t // g.kernel[1]) * g.size[1] + cols + t % g.kernel[1]


def max_pool(x: jax.Array, g: PoolGeometry, first_axis: int = 2, with_mask: bool = False,
             differentiated_top_by_window: bool = False) -> tuple[jax.Array, jax.Array | None]:
    """(top, mask or None): Caffe's scan. The top starts at -FLT_MAX and takes each window element, in
    row-major order, that is strictly greater (padding cells read -inf and never are).

    So the first of equal maxima wins, NaNs never win, and a window with nothing above -FLT_MAX keeps
    -FLT_MAX (mask -1). The scan records each output's winning window element, and the backward sends each
    output's gradient to exactly that element, the one Caffe's mask records (overlapping windows accumulate):
    see :func:`_row_major_scan`. ``first_axis`` is where the two spatial axes start (2 for N, C, H, W; 1 for
    channels-last). The mask (flat index h * W + w) carries no gradient.

    ``differentiated_top_by_window``: where the pooling is differentiated, its top comes from
    :func:`_window_max` (the same values) and only the winners from the scan. See :func:`_row_major_scan_fwd`
    for when that pays.

    Windows of more than _MAX_TAPS elements would trace one step per element (a global max over 100 x 100
    is 10,000 steps); they go through :func:`_large_max_pool` instead.
    """
    if g.kernel[0] * g.kernel[1] > _MAX_TAPS and (is_global_window(g) or not with_mask):
        return _large_max_pool(x, g, first_axis, with_mask)
    top, winner = _row_major_scan(x, g, first_axis, differentiated_top_by_window)
    if not with_mask:
        return top, None
    winner = winner.astype(jnp.int32)
    index = _window_index(g, winner, trailing=x.ndim - first_axis - 2)
    return top, lax.stop_gradient(jnp.where(winner >= 0, index, -1).astype(x.dtype))


def _scan_with_winner(x: jax.Array, g: PoolGeometry, first_axis: int) -> tuple[jax.Array, jax.Array]:
    """(top, winner): the scan's maximum and the window element (row-major; -1 for none) that holds it.

    Its backward is Caffe's: each output's gradient goes to its winner (:func:`_row_major_scan_bwd`).
    Differentiating the chain of ``where`` instead makes XLA:CPU rebuild the chain behind
    every element of every view in the fused backward: 2.5-5x slower (3x3/2 pools at batch 16: 183 -> 74
    ms on 113x113x64, 77 -> 16 ms on 56x56x128). For stride 1 a separable scan (rows, then the rows'
    winners) had a faster derivative than the chain, but this one is faster still (3x3/1 at batch 16:
    26 -> 8 ms on 28x28x192, 37 -> 14 ms on 28x28x256) and no slower forward.
    """
    taps = _pool_taps(x, g, -jnp.inf, first_axis)
    top = jnp.full(taps[0].shape, -_FLT_MAX, x.dtype)
    index_dtype = np.int8 if len(taps) <= np.iinfo(np.int8).max else np.int32
    winner = jnp.full(taps[0].shape, -1, index_dtype)
    for t, tap in enumerate(taps):
        greater = tap > top
        top = jnp.where(greater, tap, top)
        winner = jnp.where(greater, index_dtype(t), winner)
    return top, winner


def _window_max(x: jax.Array, g: PoolGeometry, first_axis: int) -> jax.Array:
    """Each window's maximum by XLA's reduce_window, under the scan's rules: a NaN never wins (it reads as
    -inf) and a window with nothing above -FLT_MAX gives -FLT_MAX. Equal maxima are one value, so the top is
    the scan's; only a zero's sign may differ (the scan keeps the first of -0 and +0)."""
    lead, trailing = (1,) * first_axis, (1,) * (x.ndim - first_axis - 2)
    xpad = _pad(jnp.where(jnp.isnan(x), -jnp.inf, x), first_axis, g.padding(), -jnp.inf)
    top = lax.reduce_window(xpad, np.asarray(-np.inf, x.dtype), lax.max, lead + g.kernel + trailing,
                            lead + g.stride + trailing, "VALID")
    floor = jnp.asarray(-_FLT_MAX, x.dtype)
    return jnp.where(top > floor, top, floor)  # not maximum: at -FLT_MAX itself nothing wins, no gradient


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _row_major_scan(x: jax.Array, g: PoolGeometry, first_axis: int,
                    differentiated_top_by_window: bool) -> tuple[jax.Array, jax.Array]:
    """:func:`_scan_with_winner` with Caffe's backward written out."""
    return _scan_with_winner(x, g, first_axis)


def _row_major_scan_fwd(x, g, first_axis, differentiated_top_by_window):
    """The scan, or with ``differentiated_top_by_window`` its winners and the top of :func:`_window_max`.

    XLA:CPU fuses the scan, a chain of cheap selects, into every reader of the top. A grouped convolution split
    into one convolution per group (:func:`grouped_convolution`) reads it through one channel slice per group,
    and each group's filter gradient reads its slice transposed (channels, rows, columns, batch): the scan was
    rebuilt behind every element of those transposes, its window read across the whole batch for each. In
    AlexNet's training step at batch 16 (pool1 -> conv2, group 2) the two transposes took 10 ms each. XLA does
    not repeat a reduce_window in its readers: the step took 0.953-0.960 of the time at batch 16 and 0.970 at
    batch 1 (paired A/B, 2 Sapphire Rapids cores). Elsewhere the scan is the faster top: with every max pooling
    this way, training steps at batch 16 took 1.060 (LeNet), 1.065 (SqueezeNet v1.1) and 1.076 (GoogLeNet) of
    the time. So the layout kernels ask for it only for a pooling that a split grouped convolution reads
    (:func:`caffejax.lower.optimize.layout_kernels`)."""
    top, winner = _scan_with_winner(x, g, first_axis)
    if differentiated_top_by_window:
        top = _window_max(x, g, first_axis)
    return (top, winner), winner


def _row_major_scan_bwd(g, first_axis, differentiated_top_by_window, winner, cotangents):
    """Each output's gradient to its winner, added in Caffe's order (outputs row-major, from zero): the
    gradient of the padded input by residues of the stride (:func:`_residues_to_winners`), its padding cropped
    off.

    JAX's own transpose of the window views (k*k padded arrays, summed) ran as one loop testing every offset's
    interior padding per element: about 10% of AlexNet's and GoogLeNet's training steps at batch 16.

    Where windows do not overlap, every cell of a window reads its output's diff, and XLA:CPU fuses what makes the
    diffs (LeNet's pool1: conv2's input gradient, a sum of 25 views) into each of those s*s reads. There the
    residues are written out apart (:func:`caffejax.lower.common.unfused`; :func:`_residues_interleaved`), reading
    the diffs once: against the diffs spread out by the stride (:func:`_spread_to_winners`, k*k masked views, which
    XLA made in four passes), LeNet's training step took 0.94 of the time at batch 16 (2.49 -> 2.34 ms; outputs bit
    for bit the same), 0.88 at batch 64 and the same at batch 1, a VGG-like one (3x3 convolutions, 2x2/2 pools,
    112x112, batch 16) 0.98 (2 Sapphire Rapids cores). Overlapping windows' residues stay in the program: written
    out apart, SqueezeNet v1.1's step at batch 16 took 1.03 of the time. Off the CPU, where ``unfused`` is a plain
    call and nothing was measured, non-overlapping windows keep the spread form."""
    dtop = cotangents[0]
    if any(k > s for k, s in zip(g.kernel, g.stride)):
        dxpad = _residues_to_winners(g, first_axis, winner, dtop)
    elif jax.default_backend() == "cpu":  # (vmapped, the conditional's test is batched: both branches run)
        dxpad = unfused(lambda d, w: _residues_interleaved(g, first_axis, w, d), dtop, winner)
    else:
        dxpad = _spread_to_winners(g, first_axis, winner, dtop)
    return (_pad(dxpad, first_axis, [(-lo, -hi) for lo, hi in g.padding()], 0),)


def _residues_to_winners(g: PoolGeometry, first_axis: int, winner: jax.Array, dtop: jax.Array) -> jax.Array:
    """The padded input's gradient by residues of the stride.

    Padded-input cell j = m*s + r (r < s per axis) is reached only from output o = m - q, through kernel
    offset t = r + s*q. So the gradient, as cells (m, r), is a sum over the ceil(k/s) shifts q per axis of one
    view of the winners and one of the top diffs at m - q, each broadcast over r and kept where the winner
    is offset t(r, q). Spreading the diffs out by the stride instead (k*k views of arrays s*s times bigger)
    cost 1.5-1.6x more at 3x3/2 (batch 16, with the ReLU before the pool: 14.2 -> 8.1 ms on SqueezeNet's
    113x113x64, 9.2 -> 6.0 ms on 56x56x128, 4.9 -> 3.0 ms on AlexNet's 55x55x96), and its views' sums rounded
    differently from Caffe's where one cell won several windows; for stride 1 the two are the same views.
    The residues stay an axis of one array (not classes stacked together), and the padded views are computed
    once. Windows that do not overlap need no padding (one shift, q = 0), and there XLA:CPU fuses what makes
    the diffs into every one of the s*s reads of them (LeNet's 2x2/2 pool re-summed its 25-view input gradient
    4 times: a training step 1.6x slower), so there this runs apart from them (:func:`_row_major_scan_bwd`)."""
    lead, trailing = dtop.shape[:first_axis], dtop.shape[first_axis + 2:]
    reach = [-(-k // s) for k, s in zip(g.kernel, g.stride)]   # outputs whose windows hold one cell, per axis
    cells = [o + q - 1 for o, q in zip(g.out, reach)]           # values of m per axis
    pads = [(q - 1, q - 1) for q in reach]
    won, gradient = _pad(winner, first_axis, pads, -1), _pad(dtop, first_axis, pads, 0)
    (sh, sw), (kh, kw) = g.stride, g.kernel
    ones_lead, ones_trailing = (1,) * first_axis, (1,) * len(trailing)

    def view(a, q):  # lead, m_h, 1, m_w, 1, trailing: a's output m - q (the fill where there is none)
        start = [0] * first_axis + [r - 1 - qi for r, qi in zip(reach, q)] + [0] * len(trailing)
        limit = list(lead) + [b + m for b, m in zip(start[first_axis:], cells)] + list(trailing)
        return lax.slice(a, start, limit).reshape(lead + (cells[0], 1, cells[1], 1) + trailing)

    dx = jnp.zeros(lead + (cells[0], sh, cells[1], sw) + trailing, dtop.dtype)
    for q in itertools.product(*(reversed(range(n)) for n in reach)):  # the earlier output first, as Caffe
        th, tw = np.arange(sh)[:, None] + sh * q[0], np.arange(sw)[None, :] + sw * q[1]
        offset = np.where((th < kh) & (tw < kw), th * kw + tw, -2).astype(winner.dtype)  # -2: no such offset
        offset = offset.reshape(ones_lead + (1, sh, 1, sw) + ones_trailing)
        dx = dx + jnp.where(view(won, q) == offset, view(gradient, q), 0)
    dxpad = dx.reshape(lead + (cells[0] * sh, cells[1] * sw) + trailing)
    return lax.slice(dxpad, [0] * dxpad.ndim, list(lead) + list(g.padded_size) + list(trailing))


def _residues_interleaved(g: PoolGeometry, first_axis: int, winner: jax.Array, dtop: jax.Array) -> jax.Array:
    """:func:`_residues_to_winners` for windows that do not overlap (kernel <= stride per axis), where each cell
    takes at most one output's diff: one select per residue (r_h, r_w) of the stride at the outputs' own size,
    the s*s of them stacked and interleaved into place. The same values, bit for bit.

    :func:`_residues_to_winners` writes one select over (outputs, r_h, outputs, r_w, channels) whose innermost
    loop is the channels. At LLVM's level 3 (XLA's default) a loop of 16-37 such iterations is unrolled whole
    before the loop vectorizer runs, and on AVX2 (no mask registers) the unrolled int8 compare and float select
    stay scalar. On 2 AMD EPYC (Zen 3, AVX2 only) cores, alone (in its conditional): LeNet's pool1 (16x24x24x20,
    2x2/2) 0.20 -> 0.04 ms (minima; 0.07 at level 2), MTCNN-like 16x48x48x10 0.46 -> 0.09, 16x8x8x50 and VGG's
    shapes (64-512 channels) even; LeNet's training step (one process, alternating, the same weights after
    three steps, bit for bit) 0.88-0.90 of the time at batch 16, 0.91 at 64, 0.97 at 1. Not measured on
    AVX-512 hosts, where the select is a smaller share (~0.07 of LeNet's ~2.1 ms step)."""
    lead, trailing = dtop.shape[:first_axis], dtop.shape[first_axis + 2:]
    (sh, sw), (kh, kw) = g.stride, g.kernel
    parts = [jnp.where(winner == winner.dtype.type(rh * kw + rw), dtop, 0) if rh < kh and rw < kw
             else jnp.zeros_like(dtop) for rh in range(sh) for rw in range(sw)]
    stacked = jnp.stack(parts, axis=first_axis + 2).reshape(lead + tuple(g.out) + (sh, sw) + trailing)
    a = first_axis  # lead, o_h, o_w, r_h, r_w, trailing -> lead, o_h, r_h, o_w, r_w, trailing
    order = list(range(a)) + [a, a + 2, a + 1, a + 3] + list(range(a + 4, stacked.ndim))
    dxpad = stacked.transpose(order).reshape(lead + (g.out[0] * sh, g.out[1] * sw) + trailing)
    return lax.slice(dxpad, [0] * dxpad.ndim, list(lead) + list(g.padded_size) + list(trailing))


def _spread_to_winners(g: PoolGeometry, first_axis: int, winner: jax.Array, dtop: jax.Array) -> jax.Array:
    """The padded input's gradient through the winners and diffs spread out by the stride (-1 and 0 between
    them) and padded by k-1: offset t reads one plain view of each, and the k*k masked views add up. Used off
    the CPU for windows that do not overlap, where each cell takes at most one diff (so no order of sums to
    keep) and the spread arrays are computed once."""
    pads, interior = [(k - 1, k - 1) for k in g.kernel], [s - 1 for s in g.stride]

    def views(a, fill):  # offset t reads a's cell o where o*stride + t = j: _taps' views, last offset first
        spread = _pad(a, first_axis, pads, fill, interior)
        return _taps(spread, first_axis, g.kernel, (1, 1), (1, 1), g.padded_size)[::-1]

    dxpad = None
    for t, (won, gradient) in enumerate(zip(views(winner, -1), views(dtop, 0))):
        term = jnp.where(won == t, gradient, 0)
        dxpad = term if dxpad is None else dxpad + term
    return dxpad


_row_major_scan.defvjp(_row_major_scan_fwd, _row_major_scan_bwd)


def _large_max_pool(x: jax.Array, g: PoolGeometry, first_axis: int,
                    with_mask: bool) -> tuple[jax.Array, jax.Array | None]:
    """max_pool for big windows, at a trace cost independent of the window size.

    A global window is an argmax over the flattened spatial axes with Caffe's rules (NaN never wins, the first
    of equal maxima does, nothing above -FLT_MAX keeps -FLT_MAX and mask -1), and the gradient goes to the
    chosen element through a gather. Other big windows take :func:`_window_max` (no mask), whose gradient is
    XLA's: ties send it to XLA's choice of element, not necessarily Caffe's first.
    """
    if not is_global_window(g):
        return _window_max(x, g, first_axis), None
    floor = jnp.asarray(-_FLT_MAX, x.dtype)
    trailing = x.shape[first_axis + 2:]
    flat = x.reshape(x.shape[:first_axis] + (x.shape[first_axis] * x.shape[first_axis + 1],) + trailing)
    index = jnp.argmax(jnp.where(jnp.isnan(flat), -jnp.inf, flat), axis=first_axis, keepdims=True)
    best = jnp.take_along_axis(flat, index, axis=first_axis)
    found = best > floor
    out_shape = x.shape[:first_axis] + (1, 1) + trailing
    top = jnp.where(found, best, floor).reshape(out_shape)
    if not with_mask:
        return top, None
    mask = jnp.where(found, index.astype(x.dtype), jnp.asarray(-1, x.dtype)).reshape(out_shape)
    return top, lax.stop_gradient(mask)


def _select(windows: jax.Array, t: jax.Array) -> jax.Array:
    """windows[:, :, t] per output: a gather, whose derivative sends each output's gradient to that element."""
    return jnp.take_along_axis(windows, t[:, :, None], axis=2)[:, :, 0]


def is_global_window(g: PoolGeometry) -> bool:
    """One window covering the whole (unpadded) input: a plain reduction over the spatial axes."""
    return g.out == (1, 1) and g.kernel == g.size and not any(g.pad)


# Windows up to this many elements are summed as a chain of shifted adds (fused by XLA into one pass);
# bigger ones use XLA's reduce_window, which is slow on CPU but has no per-element trace cost.
_MAX_TAPS = 64


def _window_sum(x: jax.Array, g: PoolGeometry, first_axis: int = 2) -> jax.Array:
    """Sum of each window's inputs, added in Caffe's row-major order (padding and overhang count as 0)."""
    if is_global_window(g):
        return jnp.sum(x, axis=(first_axis, first_axis + 1), keepdims=True)
    if g.kernel[0] * g.kernel[1] <= _MAX_TAPS:
        taps = _pool_taps(x, g, 0, first_axis)
        total = taps[0]
        for tap in taps[1:]:
            total = total + tap
        return total
    trailing = (1,) * (x.ndim - first_axis - 2)
    return lax.reduce_window(_pad(x, first_axis, g.padding(), 0), np.zeros((), x.dtype), lax.add,
                             (1,) * first_axis + g.kernel + trailing, (1,) * first_axis + g.stride + trailing,
                             "VALID")


def _ave_divisor(g: PoolGeometry) -> np.ndarray:
    """Caffe's pool_size: window extent clipped to [start, size + pad) before clipping to the image."""
    extents = []
    for o, s, p, k, n in zip(g.out, g.stride, g.pad, g.kernel, g.size):
        start = np.arange(o) * s - p
        extents.append(np.minimum(start + k, n + p) - start)
    return np.outer(extents[0], extents[1])


def ave_pool(x: jax.Array, g: PoolGeometry, first_axis: int = 2) -> jax.Array:
    divisor = _ave_divisor(g).reshape(g.out + (1,) * (x.ndim - first_axis - 2))
    return _window_sum(x, g, first_axis) / jnp.asarray(divisor, x.dtype)


def _stochastic_pool_train(x: jax.Array, g: PoolGeometry, key: jax.Array) -> jax.Array:
    """Pick the first window element whose running sum reaches u * (window sum), u ~ U[0, 1).

    The top selects that element, so the gradient goes to it alone, as in Caffe's StoPoolBackward.
    Overhanging cells read zeros, which never become the first hit (the window's first cell is inside).
    """
    windows = _pool_windows(x, g, 0)
    running = lax.stop_gradient(jnp.cumsum(windows, axis=2))
    threshold = jax.random.uniform(key, running.shape[:2] + running.shape[3:], x.dtype) * running[:, :, -1]
    return _select(windows, jnp.argmax(running >= threshold[:, :, None], axis=2))


def _stochastic_pool_test(x: jax.Array, g: PoolGeometry) -> jax.Array:
    """sum(x^2) / sum(x) over the window, 0 where sum(x) <= 0 (StoPoolForwardTest)."""
    s1, s2 = _window_sum(x, g), _window_sum(x * x, g)
    positive = s1 > 0
    return jnp.where(positive, s2 / jnp.where(positive, s1, 1), 0)


def _pool(ctx: LayerContext, x: jax.Array, g: PoolGeometry, key_index: int = 0,
          with_mask: bool = False) -> tuple[jax.Array, Any]:
    """(top, mask or None) of one pooling of x (N, C, H, W)."""
    if g.method == POOL_MAX:
        return max_pool(x, g, with_mask=with_mask)
    if g.method == POOL_AVE:
        return ave_pool(x, g), None
    if g.method == POOL_STOCHASTIC:
        if ctx.phase == TRAIN:
            return _stochastic_pool_train(x, g, jax.random.fold_in(ctx.rng(), key_index)), None
        return _stochastic_pool_test(x, g), None
    raise ctx.error(f"unknown pooling method {g.method}")


def _pooling_setup(layer_param, shape: Shape, num_tops: int) -> PoolGeometry:
    g = pooling_geometry(layer_param, tuple(shape))
    if num_tops > 1 and g.method != POOL_MAX:
        raise rejected(layer_param, f"only MAX pooling has a second (mask) top; got {num_tops} tops")
    return g


def _pooling_top_shapes(layer_param, bottom_shapes, param_shapes, num_tops):
    shape = tuple(bottom_shapes[0])
    return [shape[:2] + _pooling_setup(layer_param, shape, num_tops).out] * num_tops


@layer("Pooling", bottoms=(1, 1), tops=(1, 2), top_shapes=_pooling_top_shapes, rows_apart=True)
def pooling(ctx: LayerContext, bottoms, params):
    """MAX / AVE / STOCHASTIC pooling over k x k windows; MAX may emit a second top with the argmax index."""
    (x,) = bottoms
    g = _pooling_setup(ctx.layer, x.shape, ctx.num_tops)
    top, mask = _pool(ctx, x, g, with_mask=ctx.num_tops > 1)
    return [top, mask][:ctx.num_tops]


# ---- SPP: spp_layer.cpp -----------------------------------------------------------------------------------

def _spp_level_geometry(layer_param, level: int, size: tuple[int, int]) -> PoolGeometry:
    """GetPoolingParam: 2^level bins, kernel ceil(size/bins), pad (kernel*bins - size + 1)/2, stride kernel."""
    bins = 2 ** level
    kernel = tuple(math.ceil(n / bins) for n in size)
    pad = tuple((k * bins - n + 1) // 2 for k, n in zip(kernel, size))
    method = layer_param.spp_param.pool
    return _pool_geometry(layer_param, method, kernel, kernel, pad, size, ROUND_CEIL)


@layer("SPP", bottoms=(1, 1), tops=(1, 1), rows_apart=True)
def spp(ctx: LayerContext, bottoms, params):
    """Spatial pyramid pooling: pool at 1, 2, 4, ... bins per side, flatten each level, concat on axis 1."""
    (x,) = bottoms
    if x.ndim != 4:
        raise ctx.error(f"input must have 4 axes (num, channels, height, width), got {x.shape}")
    size = tuple(x.shape[2:])
    if min(size) <= 0:
        raise ctx.error(f"input dimensions cannot be zero, got {x.shape}")
    height = ctx.layer.spp_param.pyramid_height
    if height == 0:
        raise ctx.error("pyramid_height must be at least 1 (the concat of zero levels is empty)")
    if height == 1:  # Caffe then runs one bare Pooling layer: the top stays 4-D
        return [_pool(ctx, x, _spp_level_geometry(ctx.layer, 0, size))[0]]
    levels = [_pool(ctx, x, _spp_level_geometry(ctx.layer, i, size), key_index=i)[0] for i in range(height)]
    return [jnp.concatenate([y.reshape(y.shape[0], math.prod(y.shape[1:])) for y in levels], axis=1)]


# ---- LRN: lrn_layer.cpp -----------------------------------------------------------------------------------

def lrn_across_channels(x: jax.Array, p: Any, channel_axis: int = 1) -> jax.Array:
    """x (k + alpha/n sum_{n channels} x^2)^-beta, the channel window zero padded, with Caffe's backward."""
    n = p.local_size
    # A window reaching past every channel adds only padding zeros there: summing over at most all channels is
    # exact, and keeps the trace small for a huge local_size.
    pre_pad = max(0, min((n - 1) // 2, x.shape[channel_axis] - 1))
    return _lrn_cross_channel(x, channel_axis, pre_pad, float(p.k), float(p.alpha) / n, float(p.beta))


def _channel_window_sum(v: jax.Array, channel_axis: int, pre_pad: int) -> jax.Array:
    """sum of v over channels c - pre_pad .. c + pre_pad (zero padded): shifted views added in Caffe's order,
    one fused pass (XLA:CPU's reduce_window is slow)."""
    size = v.shape[channel_axis]
    taps = _taps(_pad(v, channel_axis, [(pre_pad, pre_pad)], 0), channel_axis, (2 * pre_pad + 1,), (1,), (1,),
                 (size,))
    window = taps[0]
    for tap in taps[1:]:
        window = window + tap
    return window


def _lrn_scale(x, channel_axis, pre_pad, k, alpha_over_n, beta):
    """(scale, scale^-beta) with scale = k + alpha/n sum x^2 (lrn_layer.cpp's scale_)."""
    scale = jnp.asarray(k, x.dtype) + jnp.asarray(alpha_over_n, x.dtype) * _channel_window_sum(x * x, channel_axis,
                                                                                               pre_pad)
    return scale, _inverse_power(scale, beta)


def _inverse_power(s: jax.Array, beta: float) -> jax.Array:
    """s^-beta, with square roots for Caffe's usual betas (AlexNet's and GoogLeNet's 0.75): XLA:CPU runs them
    at the speed of the memory traffic, where exp(-beta log s) makes the LRN's forward 2x slower (GoogLeNet's
    norm2 at batch 16: 13.5 -> 6.8 ms) and its general pow is 1.7x slower again. Like Caffe's pow they give
    inf at s = 0, 0 at s = inf and NaN below 0 (k <= 0 or alpha < 0)."""
    if beta == 0.75:
        root = jnp.sqrt(s)
        return 1 / (root * jnp.sqrt(root))
    if beta == 0.5:
        return 1 / jnp.sqrt(s)
    if beta == 1:
        return 1 / s
    return jnp.exp(-jnp.asarray(beta, s.dtype) * jnp.log(s))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _lrn_cross_channel(x, channel_axis, pre_pad, k, alpha_over_n, beta):
    return x * _lrn_scale(x, channel_axis, pre_pad, k, alpha_over_n, beta)[1]


def _lrn_cross_channel_fwd(x, channel_axis, pre_pad, k, alpha_over_n, beta):
    scale, factor = _lrn_scale(x, channel_axis, pre_pad, k, alpha_over_n, beta)
    return x * factor, (x, scale, factor)


def _lrn_cross_channel_bwd(channel_axis, pre_pad, k, alpha_over_n, beta, residuals, dy):
    """CrossChannelBackward: dx = dy scale^-beta - (2 alpha beta / n) x sum_window(dy y / scale). Written out:
    differentiating the forward traces the power's derivative and the window's transpose, 5x slower."""
    x, scale, factor = residuals
    ratio = dy * x * factor / scale  # dy * top / scale
    coefficient = jnp.asarray(2 * alpha_over_n * beta, x.dtype)
    return (dy * factor - coefficient * x * _channel_window_sum(ratio, channel_axis, pre_pad),)


_lrn_cross_channel.defvjp(_lrn_cross_channel_fwd, _lrn_cross_channel_bwd)


def _lrn_setup(layer_param, shape: Shape) -> PoolGeometry | None:
    """Checks an LRN's configuration against its 4-D bottom; WITHIN_CHANNEL's averaging window, or None."""
    p = layer_param.lrn_param
    n = p.local_size
    if n % 2 != 1:
        raise rejected(layer_param, f"LRN only supports odd values for local_size, got {n}")
    if len(shape) != 4:
        raise rejected(layer_param, f"input must have 4 axes (num, channels, height, width), got {tuple(shape)}")
    if p.norm_region == LRN_ACROSS_CHANNELS:
        return None
    if p.norm_region == LRN_WITHIN_CHANNEL:
        pre_pad = (n - 1) // 2
        return _pool_geometry(layer_param, POOL_AVE, (n, n), (1, 1), (pre_pad, pre_pad), tuple(shape[2:]),
                              ROUND_CEIL)
    raise rejected(layer_param, f"unknown norm_region {p.norm_region}")


def _lrn_top_shapes(layer_param, bottom_shapes, param_shapes, num_tops):
    _lrn_setup(layer_param, bottom_shapes[0])
    return [tuple(bottom_shapes[0])]


@layer("LRN", bottoms=(1, 1), tops=(1, 1), top_shapes=_lrn_top_shapes, rows_apart=True)
def lrn(ctx: LayerContext, bottoms, params):
    """ACROSS_CHANNELS: x (k + alpha/n sum_{n channels} x^2)^-beta (zero padded over channels).

    WITHIN_CHANNEL: Caffe's x (1 + alpha AVEpool_{n x n, pad (n-1)/2}(x^2))^-beta; k is not used.
    """
    (x,) = bottoms
    p = ctx.layer.lrn_param
    window = _lrn_setup(ctx.layer, x.shape)
    if window is None:
        return [lrn_across_channels(x, p)]
    return [x * _inverse_power(1 + jnp.asarray(p.alpha, x.dtype) * ave_pool(x * x, window), float(p.beta))]


# ---- Crop: crop_layer.cpp ---------------------------------------------------------------------------------

@layer("Crop", bottoms=(2, 2), tops=(1, 1),
       rows_apart=rows_apart_off_axis_0(param_axis("crop_param")))
def crop(ctx: LayerContext, bottoms, params):
    """top = bottom[0][..., o_i : o_i + bottom[1].shape[i], ...] for axes i >= axis; bottom[1] gives only its
    shape (no gradient flows into it)."""
    x, ref = bottoms
    p = ctx.layer.crop_param
    ndim = x.ndim
    start_axis = canonical_axis(ctx, p.axis, ndim)
    offsets = list(p.offset)
    if len(offsets) > 1 and start_axis + len(offsets) != ndim:
        raise ctx.error(f"number of offset values specified ({len(offsets)}) must be equal to the number of "
                        f"dimensions following axis {start_axis} of the {ndim}-D bottom")
    if ref.ndim < ndim:
        raise ctx.error(f"bottom[1] of shape {ref.shape} has fewer axes than bottom[0] {x.shape}")
    starts, sizes = [], []
    for i in range(ndim):
        offset, size = 0, x.shape[i]
        if i >= start_axis:
            size = ref.shape[i]
            if offsets:
                offset = offsets[0] if len(offsets) == 1 else offsets[i - start_axis]
            if x.shape[i] - offset < size:
                raise ctx.error(f"the crop for dimension {i} is out-of-bounds with size {size} and offset "
                                f"{offset} (bottom[0] {x.shape}, bottom[1] {ref.shape})")
        starts.append(offset)
        sizes.append(size)
    return [lax.slice(x, starts, [s + n for s, n in zip(starts, sizes)])]
