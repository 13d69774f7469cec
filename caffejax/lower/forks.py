"""Rules for layers of popular Caffe forks, registered only on request.

BVLC Caffe does not have these layers; models converted from YOLO, SSD, DeepLab/PSPNet or MobileNet ports use
them. ``register_all()`` makes all of them available, or one at a time: ``register_upsample()``,
``register_interp()``, ``register_relu6()``, ``register_permute()``, ``register_normalize()``,
``register_prior_box()``. Registering
declares the fork's LayerParameter field (``upsample_param``, ``interp_param``, ...) to the prototxt parser
(caffejax.frontend.prototxt.register_fork_param), so prototxts using it parse, and adds the layer's rule.
Each rule follows the fork's C++ layer, named in its docstring.

A prototxt that uses one of these fields before it is registered fails to parse with a message naming the
function to call (:func:`provider_of`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from caffejax.errors import SchemaError, ShapeError
from caffejax.frontend.build import MAX_BLOB_ELEMENTS
from caffejax.frontend.prototxt import ForkParam, ForkParamField, fork_param, register_fork_param
from caffejax.lower.registry import LayerContext, get_rule, register_layer

Shape = tuple[int, ...]


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
    if math.prod(x.shape[:2]) * math.prod(size_out) > MAX_BLOB_ELEMENTS:
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
                            origin="SSD (weiliu89/caffe)")


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


# ---- registration -------------------------------------------------------------------------------------------------

FORK_LAYERS: tuple[ForkLayer, ...] = (
    ForkLayer("Upsample", upsample, "register_upsample", UPSAMPLE_PARAM.origin, UPSAMPLE_PARAM),
    ForkLayer("Interp", interp, "register_interp", INTERP_PARAM.origin, INTERP_PARAM, bottoms=(1, 2)),
    ForkLayer("ReLU6", relu6, "register_relu6", "MobileNet Caffe ports"),
    ForkLayer("Permute", permute, "register_permute", PERMUTE_PARAM.origin, PERMUTE_PARAM),
    ForkLayer("Normalize", normalize, "register_normalize", NORMALIZE_PARAM.origin, NORMALIZE_PARAM,
              param_shapes=_normalize_shapes, init_params=_normalize_init),
    ForkLayer("PriorBox", prior_box, "register_prior_box", PRIOR_BOX_PARAM.origin, PRIOR_BOX_PARAM, bottoms=(2, 2)),
)


def provider_of(field: str) -> ForkLayer | None:
    """The fork layer caffejax has for a LayerParameter field a fork added (for the parser's messages)."""
    return next((f for f in FORK_LAYERS if f.param is not None and f.param.field == field), None)


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
                   tops=fork.tops, override=override)


def _by_type(type_name: str) -> ForkLayer:
    return next(f for f in FORK_LAYERS if f.type == type_name)


def register_upsample(override: bool = False) -> None:
    register(_by_type("Upsample"), override)


def register_interp(override: bool = False) -> None:
    register(_by_type("Interp"), override)


def register_relu6(override: bool = False) -> None:
    register(_by_type("ReLU6"), override)


def register_permute(override: bool = False) -> None:
    register(_by_type("Permute"), override)


def register_normalize(override: bool = False) -> None:
    register(_by_type("Normalize"), override)


def register_prior_box(override: bool = False) -> None:
    register(_by_type("PriorBox"), override)


def register_all(override: bool = False) -> None:
    """Every fork layer of this module (see the module docstring)."""
    for fork in FORK_LAYERS:
        register(fork, override)
