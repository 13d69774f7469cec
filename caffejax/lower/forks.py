"""Rules for layers of popular Caffe forks, registered only on request.

BVLC Caffe does not have these layers; models converted from YOLO, SSD, Fast/Faster R-CNN, R-FCN, DeepLab/PSPNet
or MobileNet ports use them. ``register_all()`` makes all of them available, or one at a time: ``register_upsample()``,
``register_interp()``, ``register_relu6()``, ``register_permute()``, ``register_normalize()``,
``register_prior_box()``, ``register_detection_output()``, ``register_proposal()``,
``register_roi_pooling()``, ``register_psroi_pooling()``, ``register_smooth_l1_loss()``. Registering declares the
fork's LayerParameter field (``upsample_param``, ``interp_param``, ...) to the prototxt parser
(caffejax.frontend.prototxt.register_fork_param), so prototxts using it parse, and adds the layer's rule.
Each rule follows the fork's C++ layer, named in its docstring.

A prototxt that uses one of these fields before it is registered fails to parse with a message naming the
function to call (:func:`provider_of`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import re
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from caffejax.errors import SchemaError, ShapeError, UnsupportedError, layer_error
from caffejax.frontend.build import MAX_BLOB_ELEMENTS
from caffejax.frontend.prototxt import (ForkEnum, ForkMessage, ForkParam, ForkParamField, fork_param,
                                        register_fork_param)
from caffejax.lower.loss import legacy_shape
from caffejax.lower.registry import LayerContext, get_rule, is_symbolic, legacy_4d, register_layer

Shape = tuple[int, ...]
log = logging.getLogger("caffejax")


@dataclasses.dataclass(frozen=True)
class ForkLayer:
    """One fork layer: its type, rule pieces, the fork parameter it reads, and where it comes from."""

    type: str
    forward: Callable
    register_name: str
    origin: str
    param: ForkParam | None = None
    param_shapes: Callable | None = None
    init_params: Callable | None = None
    bottoms: tuple[int, int | None] = (1, 1)
    tops: tuple[int, int | None] = (1, 1)
    host_forward: Callable | None = None  # LayerRule.host_forward: runs on the host, after the program
    host_backward: Callable | None = None  # LayerRule.host_backward (None: Caffe's NOT_IMPLEMENTED)
    is_loss: bool = False
    allow_force_backward: Callable | None = None
    rows_apart: bool | Callable = False  # LayerRule.rows_apart


# ---- Upsample: nearest-neighbour by an integer factor (the YOLOv3 ports' upsample_layer.cpp) -----------------

UPSAMPLE_PARAM = ForkParam("upsample_param", "UpsampleParameter", 149,
                           (ForkParamField("scale", "int32", 1, default=1),),
                           origin="YOLOv3 Caffe ports (darknet2caffe)")


def upsample(ctx: LayerContext, bottoms, params):
    """Each input pixel repeated scale x scale times: top (N, C, H*scale, W*scale)."""
    (x,) = bottoms
    scale = fork_param(ctx.layer, "upsample_param").scale
    _check_4d(ctx, x)
    if scale < 1:
        raise ctx.error(f"upsample_param.scale must be at least 1, got {scale}", SchemaError)
    return [jnp.repeat(jnp.repeat(x, scale, axis=2), scale, axis=3)]


# ---- Interp: bilinear resizing with aligned corners (DeepLab v2 / PSPNet interp_layer.cpp) --------------------

INTERP_PARAM = ForkParam("interp_param", "InterpParameter", 100143,  # the forks' 143 is BVLC's input_param
                         (ForkParamField("height", "int32", 1, default=0),
                          ForkParamField("width", "int32", 2, default=0),
                          ForkParamField("zoom_factor", "int32", 3, default=1),
                          ForkParamField("shrink_factor", "int32", 4, default=1),
                          ForkParamField("pad_beg", "int32", 5, default=0),
                          ForkParamField("pad_end", "int32", 6, default=0)),
                         origin="DeepLab v2 and PSPNet")


def interp_out_size(ctx: LayerContext, p, size_in_eff: Shape, second_bottom: Shape | None) -> Shape:
    """InterpLayer::Reshape: the output (height, width) from the (cropped) input size and the parameters."""
    has = {name: p.HasField(name) for name in ("zoom_factor", "shrink_factor", "height", "width")}
    if second_bottom is not None:  # PSPNet: resize to the second bottom's size
        if any(has.values()):
            raise ctx.error("with a second bottom the output size is that bottom's; give no zoom_factor, "
                            "shrink_factor, height or width", SchemaError)
        return second_bottom
    if has["shrink_factor"] and p.shrink_factor < 1 or has["zoom_factor"] and p.zoom_factor < 1:
        raise ctx.error(f"zoom_factor and shrink_factor must be positive (zoom_factor {p.zoom_factor}, "
                        f"shrink_factor {p.shrink_factor})", SchemaError)
    shrunk = tuple((n - 1) // p.shrink_factor + 1 for n in size_in_eff)
    if has["shrink_factor"] and not has["zoom_factor"]:
        return shrunk
    if has["zoom_factor"] and not has["shrink_factor"]:
        return tuple(n + (n - 1) * (p.zoom_factor - 1) for n in size_in_eff)
    if has["height"] and has["width"]:
        return (p.height, p.width)
    if has["shrink_factor"] and has["zoom_factor"]:
        return tuple(n + (n - 1) * (p.zoom_factor - 1) for n in shrunk)
    raise ctx.error("interp_param must give zoom_factor, shrink_factor, or height and width (or the layer a "
                    "second bottom)", SchemaError)


def _interp_taps(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """caffe_cpu_interp2's sampling along one axis, in its float32 arithmetic: for each output index, the
    two input indices it blends and the weight of the second."""
    ratio = np.float32(n_in - 1) / np.float32(n_out - 1) if n_out > 1 else np.float32(0)
    position = (ratio * np.arange(n_out, dtype=np.float32)).astype(np.float32)
    first = position.astype(np.int64)  # C++'s float -> int truncation (positions are >= 0)
    second = first + (first < n_in - 1)
    return first, second, (position - first.astype(np.float32)).astype(np.float32)


def interp(ctx: LayerContext, bottoms, params):
    """Bilinear resizing as DeepLab's caffe_cpu_interp2: corners aligned, the input first cropped by
    pad_beg/pad_end (which must be <= 0). The gradient is the adjoint, as Caffe's backward."""
    x = bottoms[0]
    _check_4d(ctx, x)
    p = fork_param(ctx.layer, "interp_param")
    if p.pad_beg > 0 or p.pad_end > 0:
        raise ctx.error(f"only non-positive padding (cropping) is supported (pad_beg {p.pad_beg}, pad_end "
                        f"{p.pad_end})", SchemaError)
    size_in = tuple(int(n) for n in x.shape[2:])
    size_in_eff = tuple(n + p.pad_beg + p.pad_end for n in size_in)
    second = tuple(int(n) for n in bottoms[1].shape[2:4]) if len(bottoms) > 1 else None
    if len(bottoms) > 1:
        _check_4d(ctx, bottoms[1])
    size_out = interp_out_size(ctx, p, size_in_eff, second)
    if min(size_in_eff) <= 0 or min(size_out) <= 0:
        raise ctx.error(f"input {size_in} cropped by pad_beg {p.pad_beg}, pad_end {p.pad_end} gives "
                        f"{size_in_eff}, output {size_out}: sizes must be positive")
    elements = math.prod(x.shape[:2]) * math.prod(size_out)
    if not is_symbolic(elements) and elements > MAX_BLOB_ELEMENTS:  # (an export's symbolic batch: checked at build)
        raise ctx.error(f"output size {size_out} for a {tuple(x.shape)} input is larger than caffejax allows "
                        f"({MAX_BLOB_ELEMENTS} elements); is a factor mistyped?")
    crop = x[:, :, -p.pad_beg:-p.pad_beg + size_in_eff[0], -p.pad_beg:-p.pad_beg + size_in_eff[1]]
    if size_out == size_in_eff:  # caffe_cpu_interp2's special case: a plain copy
        return [crop]
    return [_bilinear_resize(crop, *(_interp_taps(n, m) for n, m in zip(size_in_eff, size_out)))]


def _bilinear_resize(x: jax.Array, rows, columns) -> jax.Array:
    """caffe_cpu_interp2 on (N, C, H, W) given each axis's :func:`_interp_taps`: every output blends two rows
    of two columns, in Caffe's float32 order.

    Its backward is the adjoint, dx = A_h^T dy A_w, with A the (out x in) matrices of the taps' weights: two
    products. JAX's own derivative of the four gathers is a scatter-add that XLA:CPU runs element by element
    (21 x 65x65 -> 513x513: 9 ms forward, 91 ms backward). Where dy holds an inf or a NaN, the products spread
    NaN over its whole row and column of x's cells, where Caffe's scatter reaches four."""
    (h0, h1, hl), (w0, w1, wl) = rows, columns

    def forward(x):
        rows0, rows1 = jnp.take(x, h0, axis=2), jnp.take(x, h1, axis=2)
        row_weight, column_weight = jnp.asarray(hl, x.dtype)[:, None], jnp.asarray(wl, x.dtype)
        one = jnp.asarray(1, x.dtype)

        def blend(r):
            return (one - column_weight) * jnp.take(r, w0, axis=3) + column_weight * jnp.take(r, w1, axis=3)

        return (one - row_weight) * blend(rows0) + row_weight * blend(rows1)

    def backward(_, dy):
        # Built here, at trace time, only for programs that differentiate the layer.
        adjoint_h, adjoint_w = (_interp_matrix(*taps, n) for taps, n in zip((rows, columns), x.shape[2:]))
        by_columns = jnp.einsum("ncHW,Ww->ncHw", dy, adjoint_w.astype(dy.dtype), precision=lax.Precision.HIGHEST)
        return (jnp.einsum("ncHw,Hh->nchw", by_columns, adjoint_h.astype(dy.dtype),
                           precision=lax.Precision.HIGHEST),)

    resize = jax.custom_vjp(forward)
    resize.defvjp(lambda x: (forward(x), None), backward)
    return resize(x)


def _interp_matrix(first: np.ndarray, second: np.ndarray, weight: np.ndarray, n_in: int) -> np.ndarray:
    """The (out x in) matrix of one axis's taps: row k holds 1 - weight[k] at first[k] and weight[k] at
    second[k] (their sum where they coincide)."""
    matrix = np.zeros((len(first), n_in), np.float32)
    np.add.at(matrix, (np.arange(len(first)), first), np.float32(1) - weight)
    np.add.at(matrix, (np.arange(len(first)), second), weight)
    return matrix


# ---- ReLU6: min(max(x, 0), 6) (MobileNet ports' relu6_layer.cpp) ------------------------------------------------

def relu6(ctx: LayerContext, bottoms, params):
    """min(max(x, 0), 6); the gradient passes where 0 < x < 6 (as the forks' backward), NaN propagates."""
    (x,) = bottoms
    zero, six = jnp.asarray(0, x.dtype), jnp.asarray(6, x.dtype)
    return [jnp.where(x <= zero, zero, jnp.where(x >= six, six, x))]


# ---- Permute: reorder axes (SSD's permute_layer.cpp) --------------------------------------------------------------

PERMUTE_PARAM = ForkParam("permute_param", "PermuteParameter", 202,
                          (ForkParamField("order", "uint32", 1, repeated=True),), origin="SSD (weiliu89/caffe)")


def permute_order(ctx: LayerContext, num_axes: int) -> list[int]:
    """PermuteLayer::LayerSetUp: the given axes, then the others in their order."""
    order: list[int] = []
    for axis in fork_param(ctx.layer, "permute_param").order:
        if axis >= num_axes:
            raise ctx.error(f"order {axis} is not an axis of the {num_axes}-D bottom", ShapeError)
        if axis in order:
            raise ctx.error(f"order lists axis {axis} twice", SchemaError)
        order.append(int(axis))
    return order + [axis for axis in range(num_axes) if axis not in order]


def permute_keeps_rows(layer_param, phase: int, bottom_shapes) -> bool:
    """LayerRule.rows_apart: rows stay rows where the batch axis stays first (an order from 0, or none)."""
    return list(fork_param(layer_param, "permute_param").order[:1]) in ([], [0])


def permute(ctx: LayerContext, bottoms, params):
    (x,) = bottoms
    return [jnp.transpose(x, permute_order(ctx, x.ndim))]


# ---- Normalize: L2 normalization with a learned scale (SSD's normalize_layer.cpp) -------------------------------

NORMALIZE_PARAM = ForkParam("norm_param", "NormalizeParameter", 206,
                            (ForkParamField("across_spatial", "bool", 1, default=True),
                             ForkParamField("scale_filler", "FillerParameter", 2),
                             ForkParamField("channel_shared", "bool", 3, default=True),
                             ForkParamField("eps", "float", 4, default=1e-10)),
                            origin="SSD (weiliu89/caffe)")


def _normalize_shapes(layer, bottom_shapes: Sequence[Shape]) -> list[Shape]:
    """The scale: one value (a 0-axis blob, as Caffe allocates it) or one per channel."""
    shape = bottom_shapes[0]
    if len(shape) < 2:
        raise ShapeError(f"layer '{layer.name}' (type {layer.type}): the bottom must have at least 2 axes, got {shape}")
    return [()] if fork_param(layer, "norm_param").channel_shared else [(shape[1],)]


def _normalize_init(layer, shapes: Sequence[Shape], key) -> list:
    from caffejax.lower.fillers import fill
    from caffejax.proto import caffe_pb2

    p = fork_param(layer, "norm_param")
    filler = p.scale_filler if p.HasField("scale_filler") else caffe_pb2.FillerParameter(type="constant", value=1.0)
    return [fill(filler, shapes[0], key)]


def normalize(ctx: LayerContext, bottoms, params):
    """x / sqrt(sum x^2 + eps) over each item (across_spatial) or over the channels at each position, then
    times the scale (one value or one per channel)."""
    (x,) = bottoms
    if not 2 <= x.ndim <= 4:
        raise ctx.error(f"the bottom must have 2 to 4 axes (Caffe's legacy num, channels, height, width), "
                        f"got {x.shape}")
    p = fork_param(ctx.layer, "norm_param")
    eps = jnp.asarray(p.eps, x.dtype)
    flat = x.reshape(x.shape[:2] + (math.prod(x.shape[2:]),))  # (num, channels, height * width)
    if p.across_spatial:
        norm = jnp.sqrt(jnp.sum(flat * flat, axis=(1, 2), keepdims=True) + eps)
        top = flat * (jnp.asarray(1, x.dtype) / norm)  # caffe_cpu_scale by 1 / norm
    else:
        norm = jnp.sqrt(eps + jnp.sum(flat * flat, axis=1, keepdims=True))
        top = flat / norm
    scale = params[0].astype(x.dtype)
    top = top * (scale if scale.ndim == 0 else scale[None, :, None])
    return [top.reshape(x.shape)]


# ---- PriorBox: SSD's default boxes for one feature map (SSD's prior_box_layer.cpp) --------------------------------

# How SSD encodes a box against its prior (PriorBoxParameter.CodeType in SSD's caffe.proto; declared in
# DetectionOutputParameter too, which reads it, so that each registers alone).
_CODE_TYPE = ForkEnum("CodeType", (("CORNER", 1), ("CENTER_SIZE", 2), ("CORNER_SIZE", 3)))
PRIOR_BOX_PARAM = ForkParam("prior_box_param", "PriorBoxParameter", 203,
                            (ForkParamField("min_size", "float", 1, repeated=True),
                             ForkParamField("max_size", "float", 2, repeated=True),
                             ForkParamField("aspect_ratio", "float", 3, repeated=True),
                             ForkParamField("flip", "bool", 4, default=True),
                             ForkParamField("clip", "bool", 5, default=False),
                             ForkParamField("variance", "float", 6, repeated=True),
                             ForkParamField("img_size", "uint32", 7),
                             ForkParamField("img_h", "uint32", 8),
                             ForkParamField("img_w", "uint32", 9),
                             ForkParamField("step", "float", 10),
                             ForkParamField("step_h", "float", 11),
                             ForkParamField("step_w", "float", 12),
                             ForkParamField("offset", "float", 13, default=0.5)),
                            origin="SSD (weiliu89/caffe)", enums=(_CODE_TYPE,))


@dataclasses.dataclass(frozen=True)
class _PriorBoxes:
    """PriorBoxLayer::LayerSetUp's settings: sizes, aspect ratios (1 first, then each new one and its flip),
    variances, and the image size and steps where the prototxt gives them (0: taken from the bottoms)."""

    min_sizes: tuple[float, ...]
    max_sizes: tuple[float, ...]
    aspect_ratios: tuple[float, ...]
    variance: tuple[float, ...]
    img_h: int
    img_w: int
    step_h: float
    step_w: float


def _prior_boxes(ctx: LayerContext) -> _PriorBoxes:
    p = fork_param(ctx.layer, "prior_box_param")
    if not p.min_size:
        raise ctx.error("must provide min_size", SchemaError)
    if any(size <= 0 for size in p.min_size):
        raise ctx.error(f"min_size must be positive, got {list(p.min_size)}", SchemaError)
    ratios = [np.float32(1.0)]
    for ar in p.aspect_ratio:
        ar = np.float32(ar)
        if all(abs(float(ar) - float(r)) >= 1e-6 for r in ratios):  # a repeated ratio is ignored
            ratios.append(ar)
            if p.flip:
                ratios.append(np.float32(1.0 / float(ar)))
    if p.max_size and len(p.max_size) != len(p.min_size):
        raise ctx.error(f"{len(p.max_size)} max_size for {len(p.min_size)} min_size; give one per min_size",
                        SchemaError)
    if any(hi <= lo for lo, hi in zip(p.min_size, p.max_size)):
        raise ctx.error("max_size must be greater than min_size", SchemaError)
    variance = tuple(p.variance) or (0.1,)
    if len(variance) not in (1, 4) or any(v <= 0 for v in variance):
        raise ctx.error(f"give 1 or 4 positive variances, got {list(p.variance)}", SchemaError)
    img_h, img_w = _given_or_pair(ctx, p, "img_size", "img_h", "img_w")
    step_h, step_w = _given_or_pair(ctx, p, "step", "step_h", "step_w")
    return _PriorBoxes(tuple(p.min_size), tuple(p.max_size), tuple(ratios), variance, img_h, img_w, step_h, step_w)


def _given_or_pair(ctx: LayerContext, p, single: str, height: str, width: str) -> tuple[float, float]:
    """LayerSetUp's img_size or img_h/img_w (step or step_h/step_w): (height, width), 0 where neither is given."""
    if p.HasField(height) or p.HasField(width):
        if p.HasField(single):
            raise ctx.error(f"Either {single} or {height}/{width} should be specified; not both.", SchemaError)
        values = getattr(p, height), getattr(p, width)
        if min(values) <= 0:
            raise ctx.error(f"{height} and {width} should be larger than 0, got {values[0]} and {values[1]}",
                            SchemaError)
        return values
    if p.HasField(single):
        if getattr(p, single) <= 0:
            raise ctx.error(f"{single} should be larger than 0.", SchemaError)
        return getattr(p, single), getattr(p, single)
    return 0, 0


def prior_box(ctx: LayerContext, bottoms, params):
    """SSD's default boxes for a feature map (bottom 0) over an image (bottom 1, or img_size / img_h, img_w):
    top (1, 2, H * W * priors per cell * 4), channel 0 the boxes' (xmin, ymin, xmax, ymax) as fractions of the image,
    channel 1 their variances. Per cell, row-major: for each min_size, its square box, then the square of
    sqrt(min_size * max_size), then one box per aspect ratio other than 1 (min_size * sqrt(ar) wide, min_size /
    sqrt(ar) high; OpenCV's PriorBox gives the same). As the C++ layer, the sizes are
    truncated to integers (``int min_size_``), the centres are float and the corners computed in double and
    stored as float; the values depend on the shapes only, so they enter the program as a constant."""
    feature, image = bottoms
    _check_4d(ctx, feature)
    _check_4d(ctx, image)
    p = fork_param(ctx.layer, "prior_box_param")
    boxes = _prior_boxes(ctx)
    layer_h, layer_w = feature.shape[2], feature.shape[3]
    img_h, img_w = (boxes.img_h, boxes.img_w) if boxes.img_h and boxes.img_w else image.shape[2:]
    f32 = np.float32
    if boxes.step_h and boxes.step_w:
        step_h, step_w = f32(boxes.step_h), f32(boxes.step_w)
    else:
        step_h, step_w = f32(f32(img_h) / f32(layer_h)), f32(f32(img_w) / f32(layer_w))
    sizes = []  # (width, height) of each prior, as float, in the layer's order
    for s, min_size in enumerate(boxes.min_sizes):
        lo = int(min_size)
        sizes.append((f32(lo), f32(lo)))
        if boxes.max_sizes:
            side = f32(math.sqrt(lo * int(boxes.max_sizes[s])))
            sizes.append((side, side))
        for ar in boxes.aspect_ratios:
            if abs(float(ar) - 1.0) < 1e-6:
                continue
            sizes.append((f32(lo * math.sqrt(ar)), f32(lo / math.sqrt(ar))))
    size = np.array(sizes, np.float64)  # (priors per cell, 2)
    offset = f32(p.offset)
    center_x = ((np.arange(layer_w, dtype=np.float32) + offset) * step_w).astype(np.float64)
    center_y = ((np.arange(layer_h, dtype=np.float32) + offset) * step_h).astype(np.float64)
    cx, cy = center_x[None, :, None], center_y[:, None, None]
    half_w, half_h = size[None, None, :, 0] / 2.0, size[None, None, :, 1] / 2.0
    corners = np.stack(np.broadcast_arrays((cx - half_w) / img_w, (cy - half_h) / img_h, (cx + half_w) / img_w,
                                           (cy + half_h) / img_h), axis=-1).astype(np.float32)  # H, W, priors, 4
    if p.clip:
        corners = np.clip(corners, 0.0, 1.0)
    variance = np.broadcast_to(np.asarray(boxes.variance, np.float32), corners.shape)
    top = np.stack([corners.reshape(-1), variance.reshape(-1)])[None]
    return [jnp.asarray(top, feature.dtype)]


def _check_4d(ctx: LayerContext, x) -> None:
    if x.ndim != 4:
        raise ctx.error(f"the bottom must have 4 axes (num, channels, height, width), got {tuple(x.shape)}")


# ---- DetectionOutput: SSD's decoding and non-maximum suppression (SSD's detection_output_layer.cpp) ---------------

DETECTION_OUTPUT_PARAM = ForkParam(
    "detection_output_param", "DetectionOutputParameter", 204,
    (ForkParamField("num_classes", "uint32", 1),
     ForkParamField("share_location", "bool", 2, default=True),
     ForkParamField("background_label_id", "int32", 3, default=0),
     ForkParamField("nms_param", "NonMaximumSuppressionParameter", 4),
     ForkParamField("save_output_param", "SaveOutputParameter", 5),
     ForkParamField("code_type", "CodeType", 6, default="CORNER"),
     ForkParamField("keep_top_k", "int32", 7, default=-1),
     ForkParamField("variance_encoded_in_target", "bool", 8, default=False),
     ForkParamField("confidence_threshold", "float", 9),
     ForkParamField("visualize", "bool", 10, default=False),
     ForkParamField("visualize_threshold", "float", 11),
     ForkParamField("save_file", "string", 12),
     # OpenCV's addition (opencv-caffe.proto), which its face detector's deploy.prototxt sets: decoded boxes
     # clipped to [0, 1] before NMS, as DecodeBBox's clip_bbox does.
     ForkParamField("clip", "bool", 1000, default=False)),
    origin="SSD (weiliu89/caffe)",
    enums=(_CODE_TYPE,),
    messages=(
        ForkMessage("NonMaximumSuppressionParameter",
                    (ForkParamField("nms_threshold", "float", 1, default=0.3),
                     ForkParamField("top_k", "int32", 2),
                     ForkParamField("eta", "float", 3, default=1.0))),
        ForkMessage("ResizeParameter",
                    (ForkParamField("prob", "float", 1, default=1.0),
                     ForkParamField("resize_mode", "Resize_mode", 2, default="WARP"),
                     ForkParamField("height", "uint32", 3, default=0),
                     ForkParamField("width", "uint32", 4, default=0),
                     ForkParamField("pad_mode", "Pad_mode", 5, default="CONSTANT"),
                     ForkParamField("pad_value", "float", 6, repeated=True),
                     ForkParamField("interp_mode", "Interp_mode", 7, repeated=True),
                     ForkParamField("height_scale", "uint32", 8, default=0),
                     ForkParamField("width_scale", "uint32", 9, default=0)),
                    (ForkEnum("Resize_mode", (("WARP", 1), ("FIT_SMALL_SIZE", 2), ("FIT_LARGE_SIZE_AND_PAD", 3))),
                     ForkEnum("Pad_mode", (("CONSTANT", 1), ("MIRRORED", 2), ("REPEAT_NEAREST", 3))),
                     ForkEnum("Interp_mode", (("LINEAR", 1), ("AREA", 2), ("NEAREST", 3), ("CUBIC", 4),
                                              ("LANCZOS4", 5))))),
        ForkMessage("SaveOutputParameter",
                    (ForkParamField("output_directory", "string", 1),
                     ForkParamField("output_name_prefix", "string", 2),
                     ForkParamField("output_format", "string", 3),
                     ForkParamField("label_map_file", "string", 4),
                     ForkParamField("name_size_file", "string", 5),
                     ForkParamField("num_test_image", "uint32", 6),
                     ForkParamField("resize_param", "ResizeParameter", 7)))))


@dataclasses.dataclass(frozen=True)
class _Detection:
    """DetectionOutputLayer::LayerSetUp's settings."""

    num_classes: int
    share_location: bool
    background_label_id: int
    code_type: int  # 1 CORNER, 2 CENTER_SIZE, 3 CORNER_SIZE
    variance_encoded_in_target: bool
    clip: bool
    keep_top_k: int
    confidence_threshold: np.float32
    nms_threshold: np.float32
    top_k: int
    eta: np.float32


def _detection(layer_param) -> _Detection:
    p = fork_param(layer_param, "detection_output_param")

    def fail(message: str, cls=SchemaError):
        return layer_error(cls, layer_param.name, layer_param.type, message)

    if not p.HasField("num_classes"):
        raise fail("Must specify num_classes")
    nms = p.nms_param
    if not nms.nms_threshold >= 0:
        raise fail(f"nms_threshold must be non negative, got {nms.nms_threshold}")
    if not 0 < nms.eta <= 1:
        raise fail(f"nms_param.eta must be in (0, 1], got {nms.eta}")
    if p.share_location and p.background_label_id == -1:
        # DecodeBBoxesAll takes the shared boxes' label -1 for the background and skips them; Forward then stops
        # with "Could not find location predictions for label -1".
        raise fail("share_location with background_label_id -1: Caffe takes the shared location predictions "
                   "(label -1) for the background and finds none to decode")
    if p.visualize:
        raise fail("visualize (an OpenCV window drawing the detections) is not supported; remove it",
                   UnsupportedError)
    return _Detection(p.num_classes, p.share_location, p.background_label_id, p.code_type,
                      p.variance_encoded_in_target, p.clip, p.keep_top_k,
                      np.float32(p.confidence_threshold if p.HasField("confidence_threshold")
                                 else -np.finfo(np.float32).max),
                      np.float32(nms.nms_threshold), nms.top_k if nms.HasField("top_k") else -1, np.float32(nms.eta))


def _detection_counts(layer_param, shapes: Sequence[Shape]) -> tuple[_Detection, int]:
    """DetectionOutputLayer::Reshape's checks on the bottoms (loc, conf, priors): the settings and the number of
    priors."""
    d = _detection(layer_param)
    if any(len(s) > 4 for s in shapes):
        raise layer_error(ShapeError, layer_param.name, layer_param.type,
                          f"bottoms must have at most 4 axes (Caffe's num/channels/height/width), got {list(shapes)}")
    loc, conf, prior = (legacy_4d(s) for s in shapes)
    num_priors = prior[2] // 4
    num_loc_classes = 1 if d.share_location else d.num_classes
    problems = []
    if loc[0] != conf[0]:
        problems.append(f"loc and conf have different nums ({loc[0]} and {conf[0]})")
    if num_priors * num_loc_classes * 4 != loc[1]:
        problems.append(f"Number of priors must match number of location predictions: {num_priors} priors x "
                        f"{num_loc_classes} x 4 != {loc[1]} loc channels")
    if int(np.prod(prior)) < num_priors * 8:  # GetPriorBBoxes reads the variances after the boxes, unchecked
        problems.append(f"the prior bottom must hold {num_priors} boxes and then their variances, (1, 2, "
                        f"{num_priors * 4}) as PriorBox makes it; got {tuple(shapes[2])}")
    if num_priors * d.num_classes != conf[1]:
        problems.append(f"Number of priors must match number of confidence predictions: {num_priors} priors x "
                        f"{d.num_classes} classes != {conf[1]} conf channels")
    if problems:
        raise layer_error(ShapeError, layer_param.name, layer_param.type,
                          "; ".join(problems) + f" (bottom shapes {[tuple(s) for s in shapes]})")
    return d, num_priors


def detection_output(ctx: LayerContext, bottoms, params):
    """The top's shape before the first forward: DetectionOutputLayer::Reshape sets (1, 1, 1, 7), since the number
    of detections is known only after NMS. The detections themselves are :func:`detect`'s, on the host."""
    _detection_counts(ctx.layer, [tuple(b.shape) for b in bottoms])
    save = fork_param(ctx.layer, "detection_output_param").save_output_param
    if save.output_directory and save.label_map_file and save.name_size_file:
        # Caffe saves only when all three are given (it warns and skips otherwise); deploy prototxts often carry
        # them from evaluation, which OpenCV ignores as well. Said when the net is built, as LayerSetUp would.
        log.warning("layer '%s' (type DetectionOutput): save_output_param is not supported; detections are not "
                    "written to '%s'", ctx.layer.name, save.output_directory)
    return [jnp.zeros((1, 1, 1, 7), bottoms[0].dtype)]


def _decode(d: _Detection, priors: np.ndarray, variances: np.ndarray, loc: np.ndarray) -> np.ndarray:
    """bbox_util.cpp's DecodeBBox over every prior: (..., 4) corners as float, with the float and double steps
    of the C++ (its NormalizedBBox holds floats; ``/ 2.`` is double)."""
    f32 = np.float32
    px0, py0, px1, py1 = (priors[:, i] for i in range(4))
    v = np.ones_like(variances) if d.variance_encoded_in_target else variances
    x0, y0, x1, y1 = (loc[..., i] for i in range(4))
    if d.code_type == 1:  # CORNER
        return np.stack([px0 + v[:, 0] * x0, py0 + v[:, 1] * y0, px1 + v[:, 2] * x1, py1 + v[:, 3] * y1], -1)
    width, height = px1 - px0, py1 - py0
    if not (np.all(width > 0) and np.all(height > 0)):
        raise ValueError("a prior box has no positive width and height (DecodeBBox's CHECK_GT(prior_width, 0))")
    if d.code_type == 3:  # CORNER_SIZE
        return np.stack([px0 + v[:, 0] * x0 * width, py0 + v[:, 1] * y0 * height,
                         px1 + v[:, 2] * x1 * width, py1 + v[:, 3] * y1 * height], -1)
    center_x = ((px0.astype(np.float64) + px1) / 2.0).astype(f32)
    center_y = ((py0.astype(np.float64) + py1) / 2.0).astype(f32)
    cx = v[:, 0] * x0 * width + center_x
    cy = v[:, 1] * y0 * height + center_y
    w = np.exp(v[:, 2] * x1) * width
    h = np.exp(v[:, 3] * y1) * height
    half_w, half_h = w.astype(np.float64) / 2.0, h.astype(np.float64) / 2.0
    return np.stack([cx - half_w, cy - half_h, cx + half_w, cy + half_h], -1).astype(f32)


def _box_sizes(boxes: np.ndarray) -> np.ndarray:
    """BBoxSize: width * height, 0 for a box with xmax < xmin or ymax < ymin."""
    invalid = (boxes[:, 2] < boxes[:, 0]) | (boxes[:, 3] < boxes[:, 1])
    return np.where(invalid, np.float32(0), (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]))


def _overlaps(boxes: np.ndarray, sizes: np.ndarray, others: np.ndarray, other_sizes: np.ndarray) -> np.ndarray:
    """JaccardOverlap of each of ``boxes`` (m, 4) with each of ``others`` (n, 4): (m, n), normalized boxes, in
    float arithmetic (symmetric, as the C++'s is). IntersectBBox's test for disjoint boxes is left out: each of
    its cases makes the width or the height of the intersection negative, which gives 0 too."""
    x0, y0, x1, y1 = (boxes[:, i, None] for i in range(4))
    width = np.minimum(x1, others[:, 2]) - np.maximum(x0, others[:, 0])
    height = np.minimum(y1, others[:, 3]) - np.maximum(y0, others[:, 1])
    inter = width * height
    iou = inter / ((sizes[:, None] + other_sizes) - inter)
    return np.where((width > 0) & (height > 0), iou, np.float32(0))


_NMS_MATRIX_MAX = 2048  # candidates up to which their overlaps are computed at once (16 MiB)


def _nms(d: _Detection, boxes: np.ndarray, sizes: np.ndarray, scores: np.ndarray) -> list[int]:
    """ApplyNMSFast: the scores above the threshold, in descending order (ties by index: a stable sort), at most
    top_k of them; each kept if its overlap with every box kept before is at most the threshold, which eta
    lowers after each keep while above 0.5. The largest overlap with the boxes kept so far is carried per
    candidate; a NaN overlap stays NaN and fails the test, as in the C++."""
    candidates = np.flatnonzero(scores > d.confidence_threshold)
    candidates = candidates[np.argsort(-scores[candidates], kind="stable")]
    if -1 < d.top_k < len(candidates):
        candidates = candidates[:d.top_k]
    boxes, sizes = boxes[candidates], sizes[candidates]
    matrix = _overlaps(boxes, sizes, boxes, sizes) if len(candidates) <= _NMS_MATRIX_MAX else None
    largest = np.full(len(candidates), -np.inf, np.float32)  # the largest overlap with a kept box
    kept: list[int] = []
    threshold = d.nms_threshold
    for j in range(len(candidates)):
        if not largest[j] <= threshold:
            continue
        kept.append(int(candidates[j]))
        row = matrix[j] if matrix is not None else _overlaps(boxes[j:j + 1], sizes[j:j + 1], boxes, sizes)[0]
        np.maximum(largest, row, out=largest)
        if d.eta < 1 and threshold > 0.5:
            threshold = np.float32(threshold * d.eta)
    return kept


def detect(layer_param, bottoms: Sequence[np.ndarray]) -> list[np.ndarray]:
    """DetectionOutputLayer::Forward_cpu on host arrays: loc (N, priors x loc classes x 4), conf (N, priors x
    classes), priors (1, 2, priors x 4). Per image, each class but the background: the decoded boxes (unclipped,
    unless OpenCV's ``clip`` is set) through NMS; then, past keep_top_k, the best keep_top_k over all classes.
    Top (1, 1, detections, 7), rows [image, label, score, xmin, ymin, xmax, ymax] by image, then label, then the
    order NMS kept them; with no detection at all, one row per image [i, -1, -1, -1, -1, -1, -1]. Caffe's
    keep_top_k sort is not stable; here equal scores keep label order."""
    with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN boxes go through as in the C++
        return _detect(layer_param, *(np.asarray(b, np.float32) for b in bottoms))


def _detect(layer_param, loc: np.ndarray, conf: np.ndarray, prior: np.ndarray) -> list[np.ndarray]:
    d, num_priors = _detection_counts(layer_param, [b.shape for b in (loc, conf, prior)])
    num = legacy_4d(loc.shape)[0]
    num_loc_classes = 1 if d.share_location else d.num_classes
    loc = loc.reshape(num, num_priors, num_loc_classes, 4)
    conf = conf.reshape(num, num_priors, d.num_classes)
    flat_prior = prior.reshape(-1)
    priors = flat_prior[:num_priors * 4].reshape(num_priors, 4)
    variances = flat_prior[num_priors * 4:num_priors * 8].reshape(num_priors, 4)
    rows = []
    for i in range(num):
        decoded = {}  # location label (-1: shared) -> (boxes, sizes)
        for c in range(num_loc_classes):
            label = -1 if d.share_location else c
            if label != d.background_label_id:
                try:
                    boxes = _decode(d, priors, variances, loc[i, :, c])
                except ValueError as e:
                    raise layer_error(ShapeError, layer_param.name, layer_param.type, str(e)) from None
                if d.clip:
                    boxes = np.clip(boxes, np.float32(0), np.float32(1))
                decoded[label] = (boxes, _box_sizes(boxes))
        labels, kept = [], []
        for c in range(d.num_classes):
            if c != d.background_label_id:
                found = _nms(d, *decoded[-1 if d.share_location else c], conf[i, :, c])
                labels += [c] * len(found)
                kept += found
        labels, kept = np.asarray(labels, np.int64), np.asarray(kept, np.int64)
        scores = conf[i, kept, labels]
        if -1 < d.keep_top_k < len(kept):
            best = np.argsort(-scores, kind="stable")[:d.keep_top_k]
            # Caffe regroups the best by label (a std::map), each label's in descending score order.
            best = best[np.argsort(labels[best], kind="stable")]
            labels, kept, scores = labels[best], kept[best], scores[best]
        boxes = np.zeros((len(kept), 4), np.float32)
        for label, (label_boxes, _) in decoded.items():
            rows_of = slice(None) if d.share_location else labels == label
            boxes[rows_of] = label_boxes[kept[rows_of]]
        rows.append(np.column_stack([np.full(len(kept), i, np.float32), labels.astype(np.float32), scores, boxes]))
    found_rows = np.concatenate(rows) if rows else np.zeros((0, 7), np.float32)
    if not len(found_rows):
        top = np.full((1, 1, num, 7), -1, np.float32)
        top[0, 0, :, 0] = np.arange(num)
        return [top]
    return [found_rows.reshape(1, 1, len(found_rows), 7)]


# ---- ROIPooling: max pooling over regions of interest (Fast/Faster R-CNN's roi_pooling_layer.cpp) -----------------

ROI_POOLING_PARAM = ForkParam("roi_pooling_param", "ROIPoolingParameter", 8266711,
                              (ForkParamField("pooled_h", "uint32", 1, default=0),
                               ForkParamField("pooled_w", "uint32", 2, default=0),
                               ForkParamField("spatial_scale", "float", 3, default=1.0)),
                              origin="Fast/Faster R-CNN (rbgirshick/caffe-fast-rcnn)")


@dataclasses.dataclass(frozen=True)
class _RoiBins:
    """Each ROI's image and the edges of its pooling bins on the feature map, as Forward_cpu computes them:
    ``image`` (R,), ``valid`` (R,) where 0 <= image < N (Caffe's CHECKs), rows ``[h0, h1)`` (R, pooled_h) and
    columns ``[w0, w1)`` (R, pooled_w), clipped to the map; a bin with h1 <= h0 or w1 <= w0 is empty."""

    image: jax.Array
    valid: jax.Array
    h0: jax.Array
    h1: jax.Array
    w0: jax.Array
    w1: jax.Array


def _c_round(x: jax.Array) -> jax.Array:
    """C's round(): halves away from zero (jnp.round rounds them to even); exact where floor(x + 0.5) is not
    (0.49999997f + 0.5f rounds up to 1)."""
    whole = jnp.trunc(x)
    return whole + jnp.where(jnp.abs(x - whole) >= 0.5, jnp.sign(x), 0)


def _roi_rows(rois: jax.Array, images: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The ROIs as (R, 5) rows [image, x1, y1, x2, y2] in their float arithmetic (at least float32, as Caffe's
    Dtype), carrying no gradient; each one's image (static_cast<int>, NaN as -1) and whether that image is in
    the batch of ``images`` (Caffe CHECKs it)."""
    dtype = jnp.promote_types(rois.dtype, jnp.float32)
    rows = lax.stop_gradient(rois).reshape(rois.shape[0], 5).astype(dtype)
    image = jnp.trunc(jnp.nan_to_num(rows[:, 0], nan=-1.0, posinf=images, neginf=-1.0))
    return rows, image, (image >= 0) & (image < images)


def _as_index(x: jax.Array) -> jax.Array:
    """Whole-valued floats as int32, clipped far outside any map first so that the conversion is defined."""
    limit = jnp.asarray(2.0 ** 30, x.dtype)
    return jnp.clip(x, -limit, limit).astype(jnp.int32)


def _divided_exactly(x: jax.Array, count: int) -> jax.Array:
    """x / count as a true division: XLA turns a division by a broadcast constant into a multiply by its
    reciprocal, 1 ulp off (14 / 6 gave 2.3333335, and a bin edge ceil(3 x 2.3333335) = 8, not 7); behind the
    barrier the divisor is no constant and the division stays."""
    return x / lax.optimization_barrier(jnp.full(x.shape, count, x.dtype))


def _check_rois(ctx: LayerContext, rois: jax.Array) -> None:
    if math.prod(legacy_shape(ctx, rois, "rois")[1:]) != 5:
        raise ctx.error(f"ROI layer C x H x W must be 5 ([image, x1, y1, x2, y2] per ROI), got rois of shape "
                        f"{tuple(rois.shape)}")


def _roi_bins(rois: jax.Array, pooled: tuple[int, int], scale: float, shape: Shape) -> _RoiBins:
    """LayerSetUp and the head of Forward_cpu's ROI loop, in the rois' float arithmetic: R = [image, x1, y1, x2,
    y2] scaled and rounded to the map, at least 1 x 1, cut into pooled_h x pooled_w bins of
    floor(i * size / pooled) to ceil((i + 1) * size / pooled)."""
    n, _, height, width = shape
    rois, image, valid = _roi_rows(rois, n)
    dtype = rois.dtype
    x1, y1, x2, y2 = (_as_index(_c_round(rois[:, i] * jnp.asarray(scale, dtype))) for i in range(1, 5))

    def edges(start, end, bins, size):
        extent = jnp.maximum(end - start + 1, 1)  # malformed ROIs are forced to 1 x 1
        bin_size = _divided_exactly(extent.astype(dtype), bins)
        steps = jnp.arange(bins, dtype=dtype)
        lo = jnp.floor(steps[None, :] * bin_size[:, None]).astype(jnp.int32) + start[:, None]
        hi = jnp.ceil((steps[None, :] + 1) * bin_size[:, None]).astype(jnp.int32) + start[:, None]
        return jnp.clip(lo, 0, size), jnp.clip(hi, 0, size)

    h0, h1 = edges(y1, y2, pooled[0], height)
    w0, w1 = edges(x1, x2, pooled[1], width)
    return _RoiBins(jnp.clip(image, 0, n - 1).astype(jnp.int32), valid, h0, h1, w0, w1)


def _levels(size: int) -> int:
    """Power-of-two window levels a range-maximum table over ``size`` places needs: 1, 2, 4, ... <= size."""
    return size.bit_length()


def _shifted(x: jax.Array, axis: int, by: int, fill) -> jax.Array:
    """x moved ``by`` places toward the start along ``axis``, the end filled with ``fill``."""
    size = x.shape[axis]
    if by >= size:
        return jnp.full_like(x, fill)
    kept = lax.slice_in_dim(x, by, size, axis=axis)
    pad = jnp.full(kept.shape[:axis] + (by,) + kept.shape[axis + 1:], fill, x.dtype)
    return jnp.concatenate([kept, pad], axis=axis)


def _range_max_tables(x: jax.Array, with_index: bool):
    """A sparse table of x (N, H, W, C): T[n, a, y, b, x, c] = max over rows [y, y + 2^a) and columns
    [x, x + 2^b) (cut at the map's edge), so that the maximum over any rectangle is the maximum of four entries.
    ``with_index`` also gives where that maximum is (h * W + w): the first in Caffe's scan order (rows, then
    columns) among equal values, since each merge keeps the upper or left candidate on a tie."""
    n, height, width, c = x.shape
    low = jnp.asarray(-jnp.inf, x.dtype)
    index = (jnp.arange(height, dtype=jnp.int32)[:, None] * width + jnp.arange(width, dtype=jnp.int32)[None, :])
    index = jnp.broadcast_to(index[None, :, :, None], x.shape) if with_index else None

    def build(values, where, axis, levels):
        tables, indices = [values], [where]
        for level in range(1, levels):
            by = 1 << (level - 1)
            right = _shifted(tables[-1], axis, by, low)
            keep = tables[-1] >= right  # the earlier candidate on a tie
            tables.append(jnp.where(keep, tables[-1], right))
            if where is not None:
                indices.append(jnp.where(keep, indices[-1], _shifted(indices[-1], axis, by, 0)))
        stack = lambda parts: jnp.stack(parts, axis=axis)
        return stack(tables), (stack(indices) if where is not None else None)

    values, where = build(x, index, 2, _levels(width))  # (N, H, Lw, W, C)
    return build(values, where, 1, _levels(height))  # (N, Lh, H, Lw, W, C)


def _level_of(length: jax.Array, levels: int) -> jax.Array:
    """floor(log2(length)) for 1 <= length < 2^levels, counted in integers; 0 for an empty range."""
    powers = jnp.asarray([1 << k for k in range(1, levels)], jnp.int32)
    return jnp.sum(length[..., None] >= powers, axis=-1).astype(jnp.int32)


def _roi_corners(bins: _RoiBins, shape: Shape) -> tuple[jax.Array, jax.Array]:
    """The four table entries (flat row numbers) that cover each bin, (4, R, pooled_h, pooled_w), and which
    bins are empty (R, pooled_h, pooled_w)."""
    n, height, width = shape[0], shape[2], shape[3]
    lh, lw = _levels(height), _levels(width)
    rows = jnp.maximum(bins.h1 - bins.h0, 0)
    columns = jnp.maximum(bins.w1 - bins.w0, 0)
    kh, kw = _level_of(rows, lh), _level_of(columns, lw)
    tops = (bins.h0, jnp.maximum(bins.h1 - (1 << kh), 0))
    lefts = (bins.w0, jnp.maximum(bins.w1 - (1 << kw), 0))
    image = bins.image[:, None, None]
    corners = []
    for y in tops:
        for x in lefts:
            h_part = (image * lh + kh[:, :, None]) * height + jnp.minimum(y, height - 1)[:, :, None]
            corners.append((h_part * lw + kw[:, None, :]) * width + jnp.minimum(x, width - 1)[:, None, :])
    empty = (rows[:, :, None] == 0) | (columns[:, None, :] == 0)
    return jnp.stack(corners), empty


def _roi_max(x_nhwc: jax.Array, bins: _RoiBins, with_index: bool):
    """Each bin's maximum (R, pooled_h, pooled_w, C) as Forward_cpu leaves it: NaN is never greater than what
    it has, so it is skipped; a bin of values none above -FLT_MAX gives -FLT_MAX; an empty bin gives 0; an ROI
    of an image outside the batch gives NaN rows (Caffe stops at its CHECK). ``with_index`` also gives the
    winners (h * W + w) and where a winner exists (Caffe's argmax -1 elsewhere)."""
    c = x_nhwc.shape[-1]
    clean = jnp.where(jnp.isnan(x_nhwc), jnp.asarray(-jnp.inf, x_nhwc.dtype), x_nhwc)
    table, where = _range_max_tables(clean, with_index)
    corners, empty = _roi_corners(bins, (x_nhwc.shape[0], c, x_nhwc.shape[1], x_nhwc.shape[2]))
    picked = jnp.take(table.reshape(-1, c), corners, axis=0, mode="clip")  # (4, R, ph, pw, C); in range
    lowest = jnp.asarray(-np.finfo(np.float32).max, x_nhwc.dtype)  # Caffe's start, -FLT_MAX for any Dtype
    # Pairwise, not a reduction over the 4: XLA hands that to YNNPACK, which took 100 ms (VGG16's pool5).
    best = jnp.maximum(jnp.maximum(picked[0], picked[1]), jnp.maximum(picked[2], picked[3]))
    won = (best > lowest) & ~empty[..., None]
    top = jnp.where(empty[..., None], jnp.zeros((), x_nhwc.dtype), jnp.maximum(best, lowest))
    top = jnp.where(bins.valid[:, None, None, None], top, jnp.asarray(jnp.nan, x_nhwc.dtype))
    if not with_index:
        return top
    candidates = jnp.take(where.reshape(-1, c), corners, axis=0, mode="clip")
    ranked = jnp.where(picked == best[None], candidates, jnp.iinfo(jnp.int32).max)
    winner = jnp.minimum(jnp.minimum(ranked[0], ranked[1]), jnp.minimum(ranked[2], ranked[3]))  # first scanned
    return top, winner, won & bins.valid[:, None, None, None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _roi_pool(x: jax.Array, rois: jax.Array, pooled: tuple[int, int], scale: float) -> jax.Array:
    bins = _roi_bins(rois, pooled, scale, x.shape)
    return _roi_max(x.transpose(0, 2, 3, 1), bins, with_index=False).transpose(0, 3, 1, 2)


def _roi_pool_forward(x, rois, pooled, scale):
    bins = _roi_bins(rois, pooled, scale, x.shape)
    top, winner, won = _roi_max(x.transpose(0, 2, 3, 1), bins, with_index=True)
    return top.transpose(0, 3, 1, 2), (winner, won, bins.image, x.shape, rois)


def _roi_pool_backward(pooled, scale, residuals, dtop):
    """Backward_cpu: each top diff goes to its bin's winner, summed over bins and ROIs; none to the ROIs."""
    winner, won, image, shape, rois = residuals
    n, c, height, width = shape
    grad = jnp.where(won, dtop.transpose(0, 2, 3, 1), jnp.zeros((), dtop.dtype))
    flat = ((image[:, None, None, None] * (height * width) + winner) * c
            + jnp.arange(c, dtype=jnp.int32)[None, None, None, :])
    flat = jnp.where(won, flat, 0)
    dx = jnp.zeros((n * height * width * c,), dtop.dtype).at[flat.reshape(-1)].add(grad.reshape(-1))
    return dx.reshape(n, height, width, c).transpose(0, 3, 1, 2), jnp.zeros_like(rois)


_roi_pool.defvjp(_roi_pool_forward, _roi_pool_backward)


def roi_pooling(ctx: LayerContext, bottoms, params):
    """Max pooling of each region of interest of the feature map (bottom 0) into pooled_h x pooled_w bins:
    bottom 1 holds one ROI [image, x1, y1, x2, y2] per item (image coordinates, times spatial_scale on the
    map), the top is (ROIs, channels, pooled_h, pooled_w). The gradient goes to each bin's first maximum in
    Caffe's scan order; none reaches the ROIs (Backward_cpu writes only bottom 0)."""
    x, rois = bottoms
    p = fork_param(ctx.layer, "roi_pooling_param")
    if p.pooled_h <= 0 or p.pooled_w <= 0:
        raise ctx.error(f"pooled_h and pooled_w must be > 0, got {p.pooled_h} x {p.pooled_w}")
    features = x.reshape(legacy_shape(ctx, x, "bottom 0"))
    _check_rois(ctx, rois)
    top = _roi_pool(features, rois, (int(p.pooled_h), int(p.pooled_w)), float(np.float32(p.spatial_scale)))
    return [top]


# ---- PSROIPooling: position-sensitive average pooling over regions of interest (R-FCN's psroi_pooling_layer) --------

PSROI_POOLING_PARAM = ForkParam("psroi_pooling_param", "PSROIPoolingParameter", 10001,
                                (ForkParamField("spatial_scale", "float", 1),
                                 ForkParamField("output_dim", "int32", 2),
                                 ForkParamField("group_size", "int32", 3)),
                                origin="R-FCN (daijifeng001/caffe-rfcn)")


def _rounded_product(a: jax.Array, b: jax.Array) -> jax.Array:
    """a * b rounded to its dtype before a later add uses it, as Caffe's CPU build (x86-64, no FMA) computes
    ``a * b + c``: XLA:CPU fuses such a multiply and add into one fused multiply-add, rounding once (a bin edge
    then moves where the sum lands within an ulp of a whole number). The product's magnitude goes through abs,
    which the fusion does not look through."""
    magnitude = jnp.abs(a * b)
    return jnp.where(jnp.signbit(a) != jnp.signbit(b), -magnitude, magnitude)


def _psroi_bin_masks(rois: jax.Array, group: int, scale: float, shape: Shape):
    """Forward_cpu's bins: for each ROI [image, x1, y1, x2, y2], the rows (R, group, H) and columns (R, group, W)
    of its group x group bins on the map, as masks; each bin's area (R, group, group); which image it reads
    (R, N one-hot); and whether that image is in the batch (R,). The corners are rounded (C's round) before the
    spatial_scale, the ROI is at least 0.1 x 0.1, a bin runs from floor(start + i * size / group) to
    ceil(start + (i + 1) * size / group), clipped to the map, all in float32 as Caffe's Dtype."""
    n, _, height, width = shape
    rois, image, valid = _roi_rows(rois, n)
    dtype = rois.dtype
    scale = jnp.asarray(scale, dtype)
    x1, y1, x2, y2 = (_c_round(rois[:, i]) for i in range(1, 5))

    def edges(first, last, size):
        start = _rounded_product(first, scale)
        end = _rounded_product(last + 1, scale)
        extent = jnp.maximum(end - start, jnp.asarray(0.1, dtype))  # too small ROIs forced to 0.1
        bin_size = _divided_exactly(extent, group)
        steps = jnp.arange(group + 1, dtype=dtype)
        at = _rounded_product(steps[None, :], bin_size[:, None]) + start[:, None]  # (R, group + 1)
        lo = jnp.clip(_as_index(jnp.floor(at[:, :-1])), 0, size)
        hi = jnp.clip(_as_index(jnp.ceil(at[:, 1:])), 0, size)
        places = jnp.arange(size, dtype=jnp.int32)
        mask = (places[None, None, :] >= lo[:, :, None]) & (places[None, None, :] < hi[:, :, None])
        return mask, jnp.maximum(hi - lo, 0)

    rows, heights = edges(y1, y2, height)
    columns, widths = edges(x1, x2, width)
    area = (heights[:, :, None] * widths[:, None, :]).astype(dtype)
    one_hot = (image[:, None] == jnp.arange(n, dtype=dtype)[None, :]).astype(dtype)
    return rows.astype(dtype), columns.astype(dtype), area, one_hot, valid


def _psroi_sums(x: jax.Array, rows, columns, one_hot, output_dim: int, group: int) -> jax.Array:
    """Each bin's sum over its rows and columns of its own channel (output channel d, bin (i, j) reads input
    channel (d * group + i) * group + j): (R, output_dim, group, group). Linear in x."""
    n, _, height, width = x.shape
    maps = x.reshape(n, output_dim, group, group, height, width)
    highest = lax.Precision.HIGHEST  # no TF32 or bf16 passes on a GPU: Caffe sums in float
    # The longer axis first, which leaves the smaller partial sums: R-FCN's cls maps (1029 x 38 x 63) at 300
    # ROIs, 54 -> 49 ms forward and 60 -> 40 ms backward on 2 AVX2 cores, columns first.
    if width >= height:
        columns = jnp.einsum("rn,rjw->rnjw", one_hot, columns, precision=highest)
        by_column = jnp.einsum("rnjw,ndijhw->jrdih", columns, maps, precision=highest)  # (group, R, D, group, H)
        return jnp.einsum("jrdih,rih->rdij", by_column, rows, precision=highest)
    rows = jnp.einsum("rn,rih->rnih", one_hot, rows, precision=highest)
    by_row = jnp.einsum("rnih,ndijhw->irdjw", rows, maps, precision=highest)  # (group, R, D, group, W)
    return jnp.einsum("irdjw,rjw->rdij", by_row, columns, precision=highest)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _psroi_pool(x: jax.Array, rois: jax.Array, output_dim: int, group: int, scale: float) -> jax.Array:
    rows, columns, area, one_hot, valid = _psroi_bin_masks(rois, group, scale, x.shape)
    finite = jnp.isfinite(x)
    sums = _psroi_sums(jnp.where(finite, x, jnp.zeros((), x.dtype)), rows, columns, one_hot, output_dim, group)

    def with_special_values(sums):
        # A masked sum would spread a NaN or infinity outside a bin into it (0 x inf); Caffe's loop never reads
        # those. A bin holding one gives what a float sum of its values gives: NaN for a NaN or both
        # infinities, else the infinity.
        counts = [_psroi_sums(kind.astype(x.dtype), rows, columns, one_hot, output_dim, group) > 0
                  for kind in (jnp.isnan(x), x == jnp.inf, x == -jnp.inf)]
        nan, high, low = counts
        sums = jnp.where(high, jnp.asarray(jnp.inf, x.dtype), sums)
        sums = jnp.where(low, jnp.asarray(-jnp.inf, x.dtype), sums)
        return jnp.where(nan | (high & low), jnp.asarray(jnp.nan, x.dtype), sums)

    sums = lax.cond(jnp.all(finite), lambda s: s, with_special_values, sums)
    area = area[:, None].astype(x.dtype)
    top = jnp.where(area > 0, sums / jnp.where(area > 0, area, 1), jnp.zeros((), x.dtype))
    return jnp.where(valid[:, None, None, None], top, jnp.asarray(jnp.nan, x.dtype))


def _psroi_pool_forward(x, rois, output_dim, group, scale):
    return _psroi_pool(x, rois, output_dim, group, scale), (rois, x.shape)


def _psroi_pool_backward(output_dim, group, scale, residuals, dtop):
    """Backward_gpu (caffe-rfcn has no Backward_cpu): each top diff over its bin's area to every place of the
    bin, whatever its value; none to the ROIs, nor from an ROI of an image outside the batch."""
    (rois, shape), dtype = residuals, dtop.dtype
    rows, columns, area, one_hot, valid = _psroi_bin_masks(rois, group, scale, shape)
    area = area[:, None].astype(dtype)
    share = jnp.where((area > 0) & valid[:, None, None, None], dtop / jnp.where(area > 0, area, 1),
                      jnp.zeros((), dtype))
    _, spread = jax.vjp(lambda v: _psroi_sums(v, rows, columns, one_hot, output_dim, group),
                        jnp.zeros(shape, dtype))
    return spread(share)[0], jnp.zeros_like(rois)


_psroi_pool.defvjp(_psroi_pool_forward, _psroi_pool_backward)


def psroi_pooling(ctx: LayerContext, bottoms, params):
    """Position-sensitive average pooling of each region of interest (R-FCN): bottom 0 holds output_dim x
    group_size x group_size score maps, bottom 1 one ROI [image, x1, y1, x2, y2] per item (image coordinates,
    times spatial_scale on the map); the top (ROIs, output_dim, group_size, group_size) holds, for bin (i, j) of
    output channel d, the mean of map (d * group_size + i) * group_size + j over the bin (0 for an empty bin)."""
    x, rois = bottoms
    p = fork_param(ctx.layer, "psroi_pooling_param")
    missing = [f for f in ("spatial_scale", "output_dim", "group_size") if not p.HasField(f)]
    if missing:
        raise ctx.error(f"psroi_pooling_param needs {', '.join(missing)} (required in caffe-rfcn's caffe.proto)",
                        SchemaError)
    if p.output_dim <= 0 or p.group_size <= 0:
        raise ctx.error(f"output_dim and group_size must be > 0, got {p.output_dim} and {p.group_size}")
    features = x.reshape(legacy_shape(ctx, x, "bottom 0"))
    if features.shape[1] != p.output_dim * p.group_size ** 2:
        raise ctx.error(f"input channel number does not match layer parameters: bottom 0 has {features.shape[1]} "
                        f"channels, output_dim x group_size^2 = {p.output_dim} x {p.group_size}^2 = "
                        f"{p.output_dim * p.group_size ** 2}")
    _check_rois(ctx, rois)
    top = _psroi_pool(features, rois, int(p.output_dim), int(p.group_size), float(np.float32(p.spatial_scale)))
    return [top]


# ---- Proposal: Faster R-CNN's region proposals (py-faster-rcnn's rpn/proposal_layer.py, as OpenCV's layer) -------

PROPOSAL_PARAM = ForkParam("proposal_param", "ProposalParameter", 201,
                           (ForkParamField("feat_stride", "uint32", 1, default=16),
                            ForkParamField("base_size", "uint32", 2, default=16),
                            ForkParamField("min_size", "uint32", 3, default=16),
                            ForkParamField("ratio", "float", 4, repeated=True),
                            ForkParamField("scale", "float", 5, repeated=True),
                            ForkParamField("pre_nms_topn", "uint32", 6, default=6000),
                            ForkParamField("post_nms_topn", "uint32", 7, default=300),
                            ForkParamField("nms_thresh", "float", 8, default=0.7)),
                           origin="Faster R-CNN's Python ProposalLayer as OpenCV's caffe.proto declares it")


def _anchors(base_size: int, ratios: Sequence[float], scales: Sequence[float]) -> np.ndarray:
    """py-faster-rcnn's generate_anchors: the base_size square at the origin, reshaped to each aspect ratio (its
    width and height rounded as NumPy rounds, halves to even) and then scaled; (ratios x scales, 4) corners."""
    def corners(w, h, x, y):
        return np.column_stack([x - 0.5 * (w - 1), y - 0.5 * (h - 1), x + 0.5 * (w - 1), y + 0.5 * (h - 1)])

    size = float(base_size)
    center = 0.5 * (size - 1)
    widths = np.round(np.sqrt(size * size / np.asarray(ratios, np.float64)))
    heights = np.round(widths * np.asarray(ratios, np.float64))
    scales = np.asarray(scales, np.float64)
    return np.vstack([corners(w * scales, h * scales, center, center) for w, h in zip(widths, heights)])


def _proposal_settings(layer_param):
    p = fork_param(layer_param, "proposal_param")
    ratios = tuple(p.ratio) or (0.5, 1.0, 2.0)  # py-faster-rcnn's generate_anchors defaults
    scales = tuple(p.scale) or (8.0, 16.0, 32.0)
    return p, _anchors(p.base_size, ratios, scales)


def proposal(ctx: LayerContext, bottoms, params):
    """The tops' shapes before the first forward, as the Python layer's reshape sets them: rois (1, 5) and the
    optional scores (1, 1). Its forward runs on the host (:func:`propose`): how many boxes survive depends on
    the scores."""
    scores, deltas, info = bottoms
    _, anchors = _proposal_settings(ctx.layer)
    count = len(anchors)
    if scores.ndim != 4 or scores.shape[0] != 1:
        raise ctx.error(f"the scores (bottom 0) must be (1, 2 x anchors, H, W): one image a batch, as "
                        f"py-faster-rcnn's layer asserts; got {tuple(scores.shape)}")
    if scores.shape[1] != 2 * count or tuple(deltas.shape) != (1, 4 * count) + tuple(scores.shape[2:]):
        raise ctx.error(f"{count} anchors per position need scores (1, {2 * count}, H, W) and deltas (1, "
                        f"{4 * count}, H, W); got {tuple(scores.shape)} and {tuple(deltas.shape)}")
    if math.prod(info.shape) < 3:
        raise ctx.error(f"im_info (bottom 2) must hold [height, width, scale]; got shape {tuple(info.shape)}")
    dtype = scores.dtype
    return [jnp.zeros((1, 5), dtype), jnp.zeros((1, 1), dtype)][:ctx.num_tops]


def _nms_faster_rcnn(boxes: np.ndarray, threshold: float, limit: int) -> np.ndarray:
    """py-faster-rcnn's NMS (py_cpu_nms, and gpu_nms alike) on float32 boxes already in descending score order:
    keep a box unless it overlaps a kept one by more than ``threshold`` (areas with +1, as its pixel boxes);
    stops at ``limit`` kept (0: no limit), the post_nms_topN cut it applies after."""
    x1, y1, x2, y2 = boxes.T
    areas = (x2 - x1 + 1) * (y2 - y1 + 1)
    order = np.arange(len(boxes))
    keep = []
    while order.size and (limit <= 0 or len(keep) < limit):
        i, rest = order[0], order[1:]
        keep.append(i)
        w = np.maximum(0.0, np.minimum(x2[i], x2[rest]) - np.maximum(x1[i], x1[rest]) + 1)
        h = np.maximum(0.0, np.minimum(y2[i], y2[rest]) - np.maximum(y1[i], y1[rest]) + 1)
        inter = w * h
        order = rest[inter / (areas[i] + areas[rest] - inter) <= threshold]
    return np.asarray(keep, np.int64)


def propose_backward(layer_param, bottoms, tops, top_diffs, propagate_down) -> list[None]:
    """ProposalLayer.backward: "This layer does not propagate gradients" (its body is ``pass``): the bottoms'
    diffs stay as they are, so a backward through a Faster R-CNN (force_backward, or a loss after the ROIs)
    reaches the image through the ROI pooling, not through the proposals."""
    return [None] * len(bottoms)


def propose(layer_param, bottoms: Sequence[np.ndarray]) -> list[np.ndarray]:
    """ProposalLayer.forward on host arrays (TEST settings from proposal_param): every anchor at every position
    of the (1, 2A, H, W) scores, moved by its deltas (bbox_transform_inv), clipped to the image of im_info
    [height, width, scale], those narrower or shorter than min_size x scale dropped, the best pre_nms_topn by
    foreground score, NMS at nms_thresh, the first post_nms_topn kept. Tops: rois (R, 5) [0, x1, y1, x2, y2] and
    the scores (R, 1). The box arithmetic is float32, as the Python layer's on Caffe's float blobs."""
    p, anchors = _proposal_settings(layer_param)
    scores, deltas, info = (np.asarray(b, np.float32) for b in bottoms)
    count = len(anchors)
    height, width = scores.shape[-2:]
    foreground = scores[:, count:]
    shift_x, shift_y = np.meshgrid(np.arange(width) * p.feat_stride, np.arange(height) * p.feat_stride)
    shifts = np.column_stack([shift_x.ravel(), shift_y.ravel(), shift_x.ravel(), shift_y.ravel()])
    boxes = (anchors[None, :, :] + shifts[:, None, :]).reshape(-1, 4).astype(np.float32)  # (H W A, 4)
    deltas = deltas.transpose(0, 2, 3, 1).reshape(-1, 4)
    foreground = foreground.transpose(0, 2, 3, 1).reshape(-1)
    # bbox_transform_inv
    widths, heights = boxes[:, 2] - boxes[:, 0] + 1.0, boxes[:, 3] - boxes[:, 1] + 1.0
    center_x, center_y = boxes[:, 0] + 0.5 * widths, boxes[:, 1] + 0.5 * heights
    with np.errstate(over="ignore"):  # exp of a large delta: an infinite box, clipped below as Python's is
        new_x, new_y = deltas[:, 0] * widths + center_x, deltas[:, 1] * heights + center_y
        new_w, new_h = np.exp(deltas[:, 2]) * widths, np.exp(deltas[:, 3]) * heights
    image_h, image_w, image_scale = info.reshape(-1)[:3]
    proposals = np.column_stack([np.clip(new_x - 0.5 * new_w, 0, image_w - 1), np.clip(new_y - 0.5 * new_h, 0,
                                 image_h - 1), np.clip(new_x + 0.5 * new_w, 0, image_w - 1),
                                 np.clip(new_y + 0.5 * new_h, 0, image_h - 1)]).astype(np.float32)
    min_size = np.float32(p.min_size) * image_scale
    kept = np.flatnonzero((proposals[:, 2] - proposals[:, 0] + 1 >= min_size)
                          & (proposals[:, 3] - proposals[:, 1] + 1 >= min_size))
    order = kept[np.argsort(-foreground[kept], kind="stable")]  # ties: the first anchor first
    if p.pre_nms_topn > 0:
        order = order[:p.pre_nms_topn]
    chosen = order[_nms_faster_rcnn(proposals[order], np.float32(p.nms_thresh), int(p.post_nms_topn))]
    rois = np.column_stack([np.zeros(len(chosen), np.float32), proposals[chosen]])
    return [rois, foreground[chosen].reshape(-1, 1)]


# ---- SmoothL1Loss: the R-CNNs' and SSD's box regression loss (their smooth_L1_loss_layer.cpp) ---------------------

SMOOTH_L1_LOSS_PARAM = ForkParam("smooth_l1_loss_param", "SmoothL1LossParameter", 8266712,
                                 (ForkParamField("sigma", "float", 1, default=1.0),),
                                 origin="Fast/Faster R-CNN (rbgirshick/caffe-fast-rcnn) and SSD (weiliu89/caffe)")


def _smooth_l1(diff: jax.Array, sigma2) -> jax.Array:
    """f(d) = 0.5 σ² d² where |d| < 1/σ², |d| - 0.5/σ² elsewhere (the comparison and constants in double, as the
    C++ has them); its derivative σ² d, or sign(d) from the edge on, is Caffe's backward."""
    size = abs(diff)
    return jnp.where(size < 1.0 / np.float64(sigma2), 0.5 * sigma2 * diff * diff,
                     size - np.float32(0.5 / np.float64(sigma2)))


@jax.custom_vjp
def _weighted_smooth_l1(a: jax.Array, b: jax.Array, weights: jax.Array) -> jax.Array:
    return _smooth_l1(weights * (a - b), 1.0)


def _weighted_smooth_l1_forward(a, b, weights):
    diff = weights * (a - b)
    return _smooth_l1(diff, 1.0), (diff, weights)


def _weighted_smooth_l1_backward(residuals, derror):
    """Fast R-CNN's and SSD's Backward_cpu: f'(w (a - b)) to a, its negative to b, not times w (their
    gradient, which is the derivative where w is 0 or 1, as their bbox_loss_weights are); none to w."""
    diff, weights = residuals
    slope = jnp.where(abs(diff) < 1, diff, jnp.sign(diff)) * derror
    return slope, -slope, jnp.zeros_like(weights)


_weighted_smooth_l1.defvjp(_weighted_smooth_l1_forward, _weighted_smooth_l1_backward)


def smooth_l1_loss(ctx: LayerContext, bottoms, params):
    """loss = Σ f(a - b) / a.num() with f the smooth L1 of :func:`_smooth_l1`, in the form each fork gives it:

    - 2 bottoms (predictions, targets): as both forks.
    - 4 bottoms (py-faster-rcnn): Σ w_out · f(w_in · (a - b)) / num with σ from smooth_l1_loss_param; the
      gradient is the derivative, times both weights.
    - 3 bottoms (Fast R-CNN's and SSD's layer, bbox_loss_weights): Σ f(w · (a - b)) / num with σ = 1; their
      gradient is f'(w · (a - b)), not times w. py-faster-rcnn's layer refuses 3 bottoms and these forks have no
      sigma, so a sigma with 3 bottoms is an error.

    No gradient reaches the weights (Backward writes bottoms 0 and 1 only)."""
    a, b, *weights = bottoms
    legacy = [legacy_shape(ctx, v, f"bottom {i}") for i, v in enumerate(bottoms)]
    for i, shape in enumerate(legacy[1:], 1):
        if shape != legacy[0]:  # LossLayer's num check, then the layer's channels, height and width
            raise ctx.error(f"bottom {i} {tuple(bottoms[i].shape)} must have bottom 0's shape {tuple(a.shape)} "
                            "(num, channels, height, width)")
    p = fork_param(ctx.layer, "smooth_l1_loss_param")
    weights = [lax.stop_gradient(w).reshape(a.shape) for w in weights]
    b = b.reshape(a.shape)
    if len(weights) == 1:
        if p.HasField("sigma") and p.sigma != 1:
            raise ctx.error(f"sigma {p.sigma} with 3 bottoms: the 3-bottom SmoothL1Loss (Fast R-CNN's, SSD's) has "
                            "no sigma, and py-faster-rcnn's, which has, takes inside and outside weights (4 bottoms)")
        errors = _weighted_smooth_l1(a, b, weights[0])
    else:
        sigma2 = np.float32(p.sigma) ** 2
        inside, outside = weights or (None, None)
        errors = _smooth_l1(a - b if inside is None else inside * (a - b), sigma2)
        if outside is not None:
            errors = outside * errors
    return [jnp.sum(errors) / legacy[0][0]]


# ---- registration -------------------------------------------------------------------------------------------------

FORK_LAYERS: tuple[ForkLayer, ...] = (
    ForkLayer("Upsample", upsample, "register_upsample", UPSAMPLE_PARAM.origin, UPSAMPLE_PARAM, rows_apart=True),
    ForkLayer("Interp", interp, "register_interp", INTERP_PARAM.origin, INTERP_PARAM, bottoms=(1, 2),
              rows_apart=True),
    ForkLayer("ReLU6", relu6, "register_relu6", "MobileNet Caffe ports", rows_apart=True),
    ForkLayer("Permute", permute, "register_permute", PERMUTE_PARAM.origin, PERMUTE_PARAM,
              rows_apart=permute_keeps_rows),
    ForkLayer("Normalize", normalize, "register_normalize", NORMALIZE_PARAM.origin, NORMALIZE_PARAM,
              param_shapes=_normalize_shapes, init_params=_normalize_init, rows_apart=True),
    ForkLayer("PriorBox", prior_box, "register_prior_box", PRIOR_BOX_PARAM.origin, PRIOR_BOX_PARAM, bottoms=(2, 2)),
    ForkLayer("DetectionOutput", detection_output, "register_detection_output", DETECTION_OUTPUT_PARAM.origin,
              DETECTION_OUTPUT_PARAM, bottoms=(3, 3), host_forward=detect),
    ForkLayer("Proposal", proposal, "register_proposal", PROPOSAL_PARAM.origin, PROPOSAL_PARAM, bottoms=(3, 3),
              tops=(1, 2), host_forward=propose, host_backward=propose_backward),
    ForkLayer("ROIPooling", roi_pooling, "register_roi_pooling", ROI_POOLING_PARAM.origin, ROI_POOLING_PARAM,
              bottoms=(2, 2)),
    ForkLayer("PSROIPooling", psroi_pooling, "register_psroi_pooling", PSROI_POOLING_PARAM.origin,
              PSROI_POOLING_PARAM, bottoms=(2, 2)),
    ForkLayer("SmoothL1Loss", smooth_l1_loss, "register_smooth_l1_loss", SMOOTH_L1_LOSS_PARAM.origin,
              SMOOTH_L1_LOSS_PARAM, bottoms=(2, 4), is_loss=True,
              allow_force_backward=lambda layer_param, i: i != 1),  # LossLayer::AllowForceBackward
)


def provider_of(field: str) -> ForkLayer | None:
    """The fork layer caffejax has for a LayerParameter field a fork added (for the parser's messages)."""
    return next((f for f in FORK_LAYERS if f.param is not None and f.param.field == field), None)


def python_layer_hint(module: str, layer: str, param_str: str) -> str:
    """For a refused Python layer whose computation a fork layer here carries (py-faster-rcnn's and py-R-FCN's
    rpn.proposal_layer.ProposalLayer): how to run the model without its code; else ""."""
    if (module, layer) != ("rpn.proposal_layer", "ProposalLayer"):
        return ""
    stride = re.search(r"feat_stride'?\s*:\s*(\d+)", param_str)
    return (" caffejax's Proposal layer computes py-faster-rcnn's ProposalLayer without its code: change this "
            f"layer to type: \"Proposal\" with proposal_param {{ feat_stride: {stride.group(1) if stride else 16} }} "
            "(with pre_nms_topn, post_nms_topn, nms_thresh and min_size as your lib's cfg.TEST sets them: 6000, "
            "300, 0.7 and 16 in py-faster-rcnn's) and enable it (--fork-layers, or "
            "caffejax.lower.forks.register_proposal())")


def enabling_hint(fork: ForkLayer) -> str:
    """How to enable a fork layer, for the messages that meet it unregistered."""
    return (f"It is a Caffe fork's layer ({fork.origin}): call caffejax.lower.forks.{fork.register_name}() or "
            "caffejax.lower.forks.register_all() to use caffejax's rule for it (on the command line, --fork-layers).")


def register(fork: ForkLayer, override: bool = False) -> None:
    """Declare the fork's parameter to the parser and register its rule (again: a no-op)."""
    if fork.param is not None:
        register_fork_param(fork.param)
    try:
        current: Any = get_rule(fork.type)
    except KeyError:
        current = None
    if current is not None and current.forward is fork.forward:
        return
    register_layer(fork.type, fork.forward, fork.param_shapes, fork.init_params, bottoms=fork.bottoms,
                   tops=fork.tops, host_forward=fork.host_forward, host_backward=fork.host_backward,
                   is_loss=fork.is_loss, allow_force_backward=fork.allow_force_backward, rows_apart=fork.rows_apart,
                   override=override)


def of_type(type_name: str) -> ForkLayer | None:
    """The fork layer caffejax has for a layer type, if any (for the messages of an unknown type)."""
    return next((f for f in FORK_LAYERS if f.type == type_name), None)


def register_upsample(override: bool = False) -> None:
    register(of_type("Upsample"), override)


def register_interp(override: bool = False) -> None:
    register(of_type("Interp"), override)


def register_relu6(override: bool = False) -> None:
    register(of_type("ReLU6"), override)


def register_permute(override: bool = False) -> None:
    register(of_type("Permute"), override)


def register_normalize(override: bool = False) -> None:
    register(of_type("Normalize"), override)


def register_prior_box(override: bool = False) -> None:
    register(of_type("PriorBox"), override)


def register_detection_output(override: bool = False) -> None:
    register(of_type("DetectionOutput"), override)


def register_proposal(override: bool = False) -> None:
    register(of_type("Proposal"), override)


def register_roi_pooling(override: bool = False) -> None:
    register(of_type("ROIPooling"), override)


def register_psroi_pooling(override: bool = False) -> None:
    register(of_type("PSROIPooling"), override)


def register_smooth_l1_loss(override: bool = False) -> None:
    register(of_type("SmoothL1Loss"), override)


def register_all(override: bool = False) -> None:
    """Every fork layer of this module (see the module docstring)."""
    for fork in FORK_LAYERS:
        register(fork, override)
