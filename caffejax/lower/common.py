"""Common layers: Caffe's shape plumbing, normalisations, products and indexing layers.

Each rule is the Caffe layer's LayerSetUp (learnable blobs), Reshape (checks and top shapes) and Forward_cpu
as a JAX expression. Backward is the derivative JAX takes of that expression; where Caffe's hand-written
Backward_cpu differs from the true derivative, the expression is written so that it does not:
``jnp.where`` routes Eltwise MAX's gradient to the bottom Caffe's mask picks, ``lax.stop_gradient`` cuts what
Caffe does not differentiate (indices, selectors, labels, BatchNorm's stored statistics), and ``custom_vjp``
gives MVN and the unstable Eltwise PROD Caffe's own formulas.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from caffejax.errors import SchemaError
from caffejax.lower.registry import (TEST, LayerContext, canonical_axis, count, is_symbolic, layer, legacy_4d,
                                     param_axis, rejected, rows_apart_off_axis_0)
from caffejax.proto import caffe_pb2

Shape = tuple[int, ...]


# ---- helpers shared by several rules --------------------------------------------------------------------------


def accumulator_dtype(dtype) -> jnp.dtype:
    """The dtype products are summed in: float32, or the values' own where wider (Caffe's float math; the
    bfloat16 inference mode keeps bfloat16 storage and float32 sums)."""
    return jnp.promote_types(dtype, jnp.float32)


def matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b in full float precision (Caffe's gemm; no reduced-precision tensor-core passes), summed in
    :func:`accumulator_dtype` (the result has that dtype)."""
    return jnp.matmul(a, b, precision=lax.Precision.HIGHEST, preferred_element_type=accumulator_dtype(a.dtype))


def matmul_bt(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b.T for a (..., K) and 2-D b (M, K) (Caffe's gemm with CblasTrans on B), as one product
    contracting both last axes, summed in :func:`accumulator_dtype` (the result has that dtype).

    Written as ``matmul(a, b.T)``, XLA:CPU materialises the transpose of b on every call: for AlexNet's fc6
    that is a 151 MB copy per forward, 30x the product itself.
    """
    return lax.dot_general(a, b, (((a.ndim - 1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                           preferred_element_type=accumulator_dtype(a.dtype))


def transposed_copy(a: jax.Array) -> jax.Array:
    """The transpose of 2-D ``a`` written out, for a product that should read it so. Barriers keep ``a`` and its
    copy apart: without them XLA folds a transpose that feeds a dot back into the dot, and fuses one into
    ``a``'s producer as a slow transposed write."""
    return lax.optimization_barrier(lax.optimization_barrier(a).T)


def unfused(fn, *operands: jax.Array) -> jax.Array:
    """``fn(*operands)`` written out by XLA as a computation of its own, which none of its readers fuses in.

    XLA fuses an element-wise producer into each reader's loop, and a reader that reads each value several
    times (a pooling window) then computes it again for every read. XLA:CPU removes optimization barriers before
    it fuses, so a barrier does not stop that; a conditional does, as its branches are computations of their
    own. Its test reads the first operand's first value at run time and both branches are ``fn``, so the values
    are ``fn``'s either way. That value passes an optimization barrier: where it is a constant (weights a
    program holds, inference's CONSTANT_WEIGHTS_MAX_BYTES) XLA would fold the test, and the conditional with it.
    The first operand is a float array (an empty one has nothing to test: ``fn`` then runs as it is), best one
    that ``jax.vmap`` does not batch (filters rather than inputs): with a batched test JAX runs both branches and
    selects. Off the CPU ``fn`` runs as it is: there a conditional reads its test back to the host, and nothing
    was measured."""
    first = operands[0]
    if first.size == 0 or jax.default_backend() != "cpu":
        return fn(*operands)
    return lax.cond(jnp.isnan(lax.optimization_barrier(first.reshape(-1)[0])), fn, fn, *operands)


def _fill(filler_param: Any, shape: Shape, key: jax.Array) -> jax.Array:
    from caffejax.lower.fillers import fill  # lazily: the fillers module belongs to another family
    return fill(filler_param, shape, key)


def _constant_filler(value: float) -> Any:
    return caffe_pb2.FillerParameter(type="constant", value=value)


def _keys(key, n: int) -> list:
    from caffejax.lower.fillers import split

    return split(key, n)


def _gather_rows(table: jax.Array, index: jax.Array) -> jax.Array:
    """table[int(index)] along axis 0; an index outside [0, rows) (a CHECK failure in Caffe) gives NaN rows."""
    rows = table.shape[0]
    index = lax.stop_gradient(index).astype(jnp.int32)  # static_cast<int>: truncation toward zero
    valid = (index >= 0) & (index < rows)
    picked = jnp.take(table, jnp.clip(index, 0, rows - 1), axis=0)
    valid = valid.reshape(valid.shape + (1,) * (table.ndim - 1))
    return jnp.where(valid, picked, jnp.array(jnp.nan, table.dtype))


def _legacy_axis(layer_param: Any, param: Any, legacy: str, ndim: int) -> int:
    """Concat/Slice's axis: ``axis`` (negative allowed) or the deprecated uint32 ``*_dim``, not both."""
    if param.HasField("axis") and param.HasField(legacy):
        raise rejected(layer_param, f"either axis or {legacy} should be specified; not both")
    if param.HasField(legacy):
        dim = getattr(param, legacy)
        if dim >= ndim:
            raise rejected(layer_param, f"{legacy} {dim} out of range for a {ndim}-D blob")
        return dim
    return canonical_axis(layer_param, param.axis, ndim)


def _param_span(layer_param: Any, axis: int, num_axes: int, bottom_shape: Shape) -> Shape:
    """bottom.shape[axis : axis + num_axes] (num_axes -1: to the end): a learned Scale/Bias blob's shape."""
    ndim = len(bottom_shape)
    axis = canonical_axis(layer_param, axis, ndim)
    if num_axes < -1:
        raise rejected(layer_param, f"num_axes must be non-negative, or -1 to extend to the end; got {num_axes}")
    if num_axes >= 0 and ndim < axis + num_axes:
        raise rejected(layer_param, f"the blob's shape extends past bottom[0]'s shape {bottom_shape} when "
                                    f"applied from axis {axis} over {num_axes} axes")
    end = ndim if num_axes == -1 else axis + num_axes
    return tuple(bottom_shape[axis:end])


def _operand_axis(layer_param: Any, shape: Shape, operand_shape: Shape, axis: int) -> int:
    """Scale/Bias Reshape: the axis from which the operand covers shape[axis : axis + its ndim]; a scalar
    forces axis 0."""
    ndim = len(operand_shape)
    axis = 0 if ndim == 0 else canonical_axis(layer_param, axis, len(shape))
    span = tuple(shape[axis:axis + ndim])
    if len(shape) < axis + ndim or span != tuple(operand_shape):
        raise rejected(layer_param, f"operand of shape {tuple(operand_shape)} does not match bottom[0] "
                                    f"{tuple(shape)} from axis {axis} (its dims there: {span})")
    return axis


def _broadcast_operand(ctx: LayerContext, x: jax.Array, operand: jax.Array, axis: int) -> jax.Array:
    """The operand reshaped to broadcast over x (see _operand_axis)."""
    axis = _operand_axis(ctx.layer, x.shape, operand.shape, axis)
    return operand.reshape((1,) * axis + tuple(operand.shape) + (1,) * (x.ndim - axis - operand.ndim))


def _descending(values: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Sort the last axis like std::partial_sort with std::greater on (value, index) pairs.

    Largest value first; among equal values the higher index first. Returns (values, indices).
    """
    values = jnp.where(values == 0, jnp.zeros_like(values), values)  # -0.0 == 0.0 in C++; lax.sort tells them apart
    index = lax.broadcasted_iota(jnp.int32, values.shape, values.ndim - 1)
    ascending, order = lax.sort((values, index), dimension=values.ndim - 1, num_keys=2)
    return jnp.flip(ascending, -1), jnp.flip(order, -1)


# ---- ArgMax, Accuracy -----------------------------------------------------------------------------------------

@layer("ArgMax", bottoms=(1, 1), tops=(1, 1), rows_apart=rows_apart_off_axis_0(
    lambda lp, ndim: canonical_axis(lp, lp.argmax_param.axis, ndim) if lp.argmax_param.HasField("axis") else 1))
def argmax(ctx: LayerContext, bottoms, params):
    """The top_k largest entries per instance: their indices, or with out_max_val their values.

    Without ``axis``: over the flattened count(1) entries, top (N, 1|2, top_k, 1...) holding the indices and
    then (out_max_val) the values. With ``axis``: that axis becomes top_k, holding values if out_max_val else
    indices. Ties: the higher index first. No gradient (Caffe's Backward is NOT_IMPLEMENTED).
    """
    (x,) = bottoms
    p = ctx.layer.argmax_param
    top_k = p.top_k
    if top_k < 1:
        raise ctx.error(f"top_k must not be less than 1, got {top_k}")
    if x.ndim < 1:
        raise ctx.error("bottom must have at least one axis")
    x = lax.stop_gradient(x)
    if p.HasField("axis"):
        axis = canonical_axis(ctx, p.axis, x.ndim)
        if top_k > x.shape[axis]:
            raise ctx.error(f"top_k {top_k} must be <= the dimension of axis {axis} ({x.shape[axis]})")
        values, indices = _descending(jnp.moveaxis(x, axis, -1))
        picked = values if p.out_max_val else indices.astype(x.dtype)
        return [jnp.moveaxis(picked[..., :top_k], -1, axis)]
    dim = count(x.shape, 1)
    if top_k > dim:
        raise ctx.error(f"top_k {top_k} must be <= the flattened dimension per instance ({dim})")
    values, indices = _descending(x.reshape(x.shape[0], dim))
    rows = [indices[:, :top_k].astype(x.dtype)] + ([values[:, :top_k]] if p.out_max_val else [])
    top = jnp.stack(rows, axis=1)
    return [top.reshape(top.shape + (1,) * (max(x.ndim, 3) - 3))]


@layer("Accuracy", bottoms=(2, 2), tops=(1, 2), allow_force_backward=lambda lp, i: i != 1)
def accuracy(ctx: LayerContext, bottoms, params):
    """Top-k accuracy: a prediction is correct iff #{classes scoring >= the true class} <= top_k.

    Labels equal to ignore_label are skipped; the result is 0 when nothing is counted. The optional second
    top holds per-class accuracy (0 for a class with no labels). No gradient.
    """
    x, label = (lax.stop_gradient(b) for b in bottoms)
    p = ctx.layer.accuracy_param
    if label.size == 0 or p.top_k > x.size // label.size:
        raise ctx.error(f"top_k {p.top_k} must be <= the number of classes "
                        f"(count {x.size} / label count {label.size})")
    axis = canonical_axis(ctx, p.axis, x.ndim)
    outer, classes, inner = count(x.shape, 0, axis), x.shape[axis], count(x.shape, axis + 1)
    if outer * inner != label.size:
        raise ctx.error(f"number of labels ({label.size}, shape {tuple(label.shape)}) must match the number "
                        f"of predictions ({outer * inner}) of scores {tuple(x.shape)} with class axis {axis}")
    scores = x.reshape(outer, classes, inner)
    labels = label.reshape(outer, inner).astype(jnp.int32)  # static_cast<int>
    counted = labels != p.ignore_label if p.HasField("ignore_label") else jnp.ones(labels.shape, bool)
    true_score = jnp.take_along_axis(scores, jnp.clip(labels, 0, classes - 1)[:, None, :], axis=1)
    # The loop in accuracy_layer.cpp counts the true class itself among the ">= true score" classes.
    correct = counted & (jnp.sum(scores >= true_score, axis=1) <= p.top_k)
    total = jnp.sum(counted).astype(x.dtype)
    hits = jnp.sum(correct).astype(x.dtype)
    tops = [jnp.where(total == 0, 0, hits / jnp.maximum(total, 1)).astype(x.dtype)]
    if ctx.num_tops > 1:
        one_hot = (labels[..., None] == jnp.arange(classes)) & counted[..., None]
        per_label = jnp.sum(one_hot, axis=(0, 1)).astype(x.dtype)
        per_hit = jnp.sum(one_hot & correct[..., None], axis=(0, 1)).astype(x.dtype)
        tops.append(jnp.where(per_label == 0, 0, per_hit / jnp.maximum(per_label, 1)).astype(x.dtype))
    return tops


# ---- BatchNorm ------------------------------------------------------------------------------------------------

def _batch_norm_param_shapes(layer_param, bottom_shapes):
    """mean [C], variance [C], moving-average factor [1]; C = shape(1) (1 for a 1-D bottom)."""
    params = layer_param.param
    # LayerSetUp CHECKs explicitly configured lr_mults are 0 (UpgradeNetBatchNorm zeroes exactly-3 specs).
    if len(params) != 3 and any(spec.lr_mult != 0 for spec in list(params)[:3]):
        raise rejected(layer_param, "cannot configure batch normalization statistics as layer parameters "
                                    "(their lr_mult must be 0)", SchemaError)
    shape = bottom_shapes[0]
    channels = 1 if len(shape) == 1 else shape[1]
    return [(channels,), (channels,), (1,)]


def _batch_norm_init(layer_param, shapes, key):
    return [np.zeros(shape, np.float32) for shape in shapes]


def _batch_norm_top_shapes(layer_param, bottom_shapes, param_shapes, num_tops):
    """The bottom's shape; it needs a channel axis, and the blobs must fit its channels."""
    shape = tuple(bottom_shapes[0])
    if len(shape) < 2:
        raise rejected(layer_param, f"bottom must have a channel axis (shape(1)); got shape {shape}")
    channels = shape[1]
    if [tuple(s) for s in param_shapes] != [(channels,), (channels,), (1,)]:
        raise rejected(layer_param, f"blobs {[tuple(s) for s in param_shapes]} do not fit {channels} channels")
    return [shape]


def uses_global_stats(batch_norm_param: Any, phase: int) -> bool:
    """Whether a BatchNorm layer normalises by its stored statistics (by default in TEST) rather than the batch's."""
    p = batch_norm_param
    return p.use_global_stats if p.HasField("use_global_stats") else phase == TEST


@layer("BatchNorm", param_shapes=_batch_norm_param_shapes, init_params=_batch_norm_init,
       bottoms=(1, 1), tops=(1, 1), frozen_params=True, top_shapes=_batch_norm_top_shapes,
       rows_apart=lambda layer_param, phase, shapes: uses_global_stats(layer_param.batch_norm_param, phase))
def batch_norm(ctx: LayerContext, bottoms, params):
    """y = (x - mean) / sqrt(var + eps) per channel (axis 1), no affine part.

    With global stats (default in TEST): mean = b0/b2, var = b1/b2 (0 if b2 == 0), no gradient to the blobs.
    Otherwise the biased batch statistics over all axes but 1, and the blobs are updated as Caffe does:
    b2 = maf·b2 + 1, b0 = maf·b0 + mean, b1 = maf·b1 + m/(m-1)·var with m = count/C.
    """
    (x,) = bottoms
    p = ctx.layer.batch_norm_param
    _batch_norm_top_shapes(ctx.layer, [x.shape], [b.shape for b in params], 1)
    channels = x.shape[1]
    use_global_stats = uses_global_stats(p, ctx.phase)
    per_channel = (1, channels) + (1,) * (x.ndim - 2)
    axes = (0,) + tuple(range(2, x.ndim))
    if use_global_stats:
        mean, inv_std = batch_norm_global_stats(params, p.eps, x.dtype)
        return [_scale_channels(x - mean.reshape(per_channel), inv_std.reshape(per_channel))]
    mean, var = _batch_stats(x, axes)  # XLA computes them once for both uses: the same sums of the same x
    _update_moving_stats(ctx, params, mean.reshape(-1), var.reshape(-1), x.size // channels)
    return [_normalize_by_batch_stats(x, axes, p.eps)]


def _batch_stats(x: jax.Array, axes: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """The biased mean and variance over ``axes`` (kept as size-1 axes), in Caffe's two passes:
    var = mean((x - mean)^2)."""
    mean = jnp.mean(x, axis=axes, keepdims=True)
    return mean, jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _normalize_by_batch_stats(x: jax.Array, axes: tuple[int, ...], eps: float) -> jax.Array:
    """y = (x - mean) / sqrt(var + eps) with the batch's statistics over ``axes``.

    Differentiated as Caffe's Backward_cpu writes it: dx = (dy - mean(dy) - mean(dy . y) . y) / sqrt(var + eps),
    two sums and one element-wise pass (the exact derivative). JAX's own derivative of the statistics takes
    more passes over x and dy: paired A/B of the training step with every BatchNorm on batch statistics, on 2
    AVX2 cores, MobileNet v2 1.61 -> 1.00 s at batch 16 (55.8 against 62.4 ms at batch 1), ResNet-50 4.09 ->
    3.51 s at batch 16 (0.97 of the time at batch 1)."""
    return _normalize_by_batch_stats_fwd(x, axes, eps)[0]


def _normalize_by_batch_stats_fwd(x, axes, eps):
    mean, var = _batch_stats(x, axes)
    std = jnp.sqrt(var + eps)
    # x rather than y is kept: x is the layer before's output, alive anyway, where y may never be written out
    # (XLA fuses the normalization into the Scale and ReLU after it); the backward recomputes y in its passes.
    return (x - mean) / std, (x, mean, std)


def _normalize_by_batch_stats_bwd(axes, eps, residuals, dy):
    x, mean, std = residuals
    y = (x - mean) / std
    return ((dy - jnp.mean(dy, axis=axes, keepdims=True) - jnp.mean(dy * y, axis=axes, keepdims=True) * y) / std,)


_normalize_by_batch_stats.defvjp(_normalize_by_batch_stats_fwd, _normalize_by_batch_stats_bwd)


def batch_norm_global_stats(params, eps: float, dtype) -> tuple[jax.Array, jax.Array]:
    """(mean, 1 / sqrt(var + eps)) per channel from BatchNorm's stored sums: mean = b0/b2, var = b1/b2 (0 if
    b2 == 0). No gradient reaches the sums."""
    mean_sum, var_sum, factor = (lax.stop_gradient(b.astype(dtype)) for b in params)
    scale = jnp.where(factor[0] == 0, 0, 1 / jnp.where(factor[0] == 0, 1, factor[0]))
    return scale * mean_sum, 1 / jnp.sqrt(scale * var_sum + eps)


@jax.custom_vjp
def _scale_channels(x: jax.Array, scale: jax.Array) -> jax.Array:
    """x * scale for a constant per-channel ``scale`` (no gradient reaches it).

    Differentiated as a plain product, the forward and the backward multiply by the same broadcast of
    ``scale``; XLA shares it and, where a product takes the multiply into its fusion, writes the broadcast
    out as a full tensor (ResNet-50's training step: 37 of them, about 60 ms). The backward's own copy of
    ``scale`` keeps the two broadcasts apart."""
    return x * scale


def _scale_channels_fwd(x, scale):
    return x * scale, scale


def _scale_channels_bwd(scale, dy):
    return dy * lax.optimization_barrier(scale), jnp.zeros_like(scale)


_scale_channels.defvjp(_scale_channels_fwd, _scale_channels_bwd)


def _update_moving_stats(ctx: LayerContext, params, mean, var, m: int) -> None:
    """batch_norm_layer.cpp's running sums: caffe_cpu_axpby(Y = alpha·X + beta·Y) with beta = maf."""
    maf = ctx.layer.batch_norm_param.moving_average_fraction
    mean_sum, var_sum, factor = params
    correction = jnp.asarray(m, var.dtype) / (m - 1) if m > 1 else 1
    # State, not part of the differentiated function: Caffe never backpropagates into these sums.
    ctx.update_param(0, lax.stop_gradient(maf * mean_sum + mean))
    ctx.update_param(1, lax.stop_gradient(maf * var_sum + correction * var))
    ctx.update_param(2, lax.stop_gradient(maf * factor + 1))


# ---- BatchReindex, Filter, Embed ------------------------------------------------------------------------------

@layer("BatchReindex", bottoms=(2, 2), tops=(1, 1), allow_force_backward=lambda lp, i: i != 1)
def batch_reindex(ctx: LayerContext, bottoms, params):
    """top[n] = x[int(index[n])]; the gradient scatter-adds into x, none reaches the index."""
    x, index = bottoms
    if index.ndim != 1:
        raise ctx.error(f"index must be 1-D, got shape {tuple(index.shape)}")
    if x.ndim < 1:
        raise ctx.error("bottom[0] must have a batch axis")
    return [_gather_rows(x, index)]


@layer("Filter", bottoms=(2, None), tops=(1, None),
       allow_force_backward=lambda lp, i: i != len(lp.bottom) - 1,
       shape_from_values=lambda lp: [len(lp.bottom) - 1])
def filter_(ctx: LayerContext, bottoms, params):
    """top[i] = bottom[i] rows n where selector[n] != 0 (the selector is the last bottom, N x 1 x 1...).

    The top's batch size depends on the selector's VALUES, so it is static only when the selector is a
    concrete array (a constant of the program); a traced selector is an error. The gradient copies the top
    diff back to the selected rows (zero elsewhere); none reaches the selector.
    """
    *data, selector = bottoms
    if ctx.num_tops != len(data):
        raise ctx.error(f"needs one top per filtered bottom: {len(data)} bottoms to filter, {ctx.num_tops} tops")
    if selector.ndim < 1 or any(d != 1 for d in selector.shape[1:]):
        raise ctx.error(f"selector dimensions must be singletons (1) except the first, got "
                        f"{tuple(selector.shape)}")
    for i, b in enumerate(data):
        if b.ndim < 1 or b.shape[0] != selector.shape[0]:
            raise ctx.error(f"bottom[{i}] {tuple(b.shape)} must have the selector's 0th dimension "
                            f"({selector.shape[0]})")
    try:
        chosen = np.flatnonzero(np.asarray(selector).reshape(-1) != 0)
    except jax.errors.TracerArrayConversionError:
        raise ctx.error("the number of rows Filter outputs depends on the selector's values, so caffejax can "
                        "only compile it when the selector (last bottom) is a concrete array, not a traced "
                        "input of the program") from None
    return [jnp.take(b, jnp.asarray(chosen, jnp.int32), axis=0) for b in data]


def _embed_param_shapes(layer_param, bottom_shapes):
    p = layer_param.embed_param
    if p.num_output <= 0:
        raise rejected(layer_param, "EmbedLayer num_output must be positive")
    if p.input_dim <= 0:
        raise rejected(layer_param, "EmbedLayer input_dim must be positive")
    return [(p.input_dim, p.num_output)] + ([(p.num_output,)] if p.bias_term else [])


def _embed_init(layer_param, shapes, key):
    p = layer_param.embed_param
    fillers = [p.weight_filler, p.bias_filler]
    return [_fill(f, s, k) for f, s, k in zip(fillers, shapes, _keys(key, len(shapes)))]


@layer("Embed", param_shapes=_embed_param_shapes, init_params=_embed_init, bottoms=(1, 1), tops=(1, 1),
       rows_apart=True)
def embed(ctx: LayerContext, bottoms, params):
    """top = W[int(x)] + b, shape bottom.shape + [num_output]; no gradient to the (index) input."""
    (x,) = bottoms
    y = _gather_rows(params[0], x)
    if ctx.layer.embed_param.bias_term:
        y = y + params[1]
    return [y]


# ---- Bias, Scale ----------------------------------------------------------------------------------------------

def _bias_param_shapes(layer_param, bottom_shapes):
    """One bottom: a learned bias over bottom.shape[axis : axis + num_axes]; two bottoms: none."""
    p = layer_param.bias_param
    if len(bottom_shapes) > 1:
        return []
    return [_param_span(layer_param, p.axis, p.num_axes, bottom_shapes[0])]


def _bias_init(layer_param, shapes, key):
    return [_fill(layer_param.bias_param.filler, s, key) for s in shapes]  # filler default: constant 0


def _bias_top_shapes(layer_param, bottom_shapes, param_shapes, num_tops):
    operand = bottom_shapes[1] if len(bottom_shapes) > 1 else param_shapes[0]
    _operand_axis(layer_param, bottom_shapes[0], operand, layer_param.bias_param.axis)
    return [tuple(bottom_shapes[0])]


@layer("Bias", param_shapes=_bias_param_shapes, init_params=_bias_init, bottoms=(1, 2), tops=(1, 1),
       top_shapes=_bias_top_shapes,
       rows_apart=rows_apart_off_axis_0(param_axis("bias_param")))
def bias(ctx: LayerContext, bottoms, params):
    """top = x + b broadcast over x.shape[axis : axis + b.ndim]; b is bottom[1] or the learned blob."""
    x = bottoms[0]
    b = bottoms[1] if len(bottoms) > 1 else params[0]
    return [x + _broadcast_operand(ctx, x, b, ctx.layer.bias_param.axis)]


def _scale_param_shapes(layer_param, bottom_shapes):
    """[scale (one bottom only)], [bias (bias_term)], as scale_layer.cpp's LayerSetUp allocates them."""
    p = layer_param.scale_param
    shapes = []
    if len(bottom_shapes) == 1:
        shapes.append(_param_span(layer_param, p.axis, p.num_axes, bottom_shapes[0]))
    if p.bias_term:
        # The internal Bias layer spans bottom[1]'s axes when the scale is a bottom, else num_axes.
        num_axes = len(bottom_shapes[1]) if len(bottom_shapes) > 1 else p.num_axes
        shapes.append(_param_span(layer_param, p.axis, num_axes, bottom_shapes[0]))
    return shapes


def _scale_init(layer_param, shapes, key):
    p = layer_param.scale_param
    scale_filler = p.filler if p.HasField("filler") else _constant_filler(1.0)  # identity by default
    fillers = ([scale_filler] if len(shapes) > p.bias_term else []) + ([p.bias_filler] if p.bias_term else [])
    return [_fill(f, s, k) for f, s, k in zip(fillers, shapes, _keys(key, len(shapes)))]


def _scale_operands(scale_param: Any, bottoms: Sequence, params: Sequence) -> list:
    """[s, b (bias_term)] of a Scale layer, arrays or their shapes: s is bottom[1] or the first learned blob."""
    if len(bottoms) > 1:
        s, rest = bottoms[1], list(params)
    else:
        s, rest = params[0], list(params[1:])
    return [s, rest[0]] if scale_param.bias_term else [s]


def _scale_top_shapes(layer_param, bottom_shapes, param_shapes, num_tops):
    p = layer_param.scale_param
    for operand in _scale_operands(p, bottom_shapes, param_shapes):
        _operand_axis(layer_param, bottom_shapes[0], operand, p.axis)
    return [tuple(bottom_shapes[0])]


@layer("Scale", param_shapes=_scale_param_shapes, init_params=_scale_init, bottoms=(1, 2), tops=(1, 1),
       top_shapes=_scale_top_shapes,
       rows_apart=rows_apart_off_axis_0(param_axis("scale_param")))
def scale(ctx: LayerContext, bottoms, params):
    """top = x * s (+ b with bias_term), s and b broadcast over x.shape[axis : axis + ndim]; s is bottom[1]
    or the learned blob. A scalar operand applies from axis 0."""
    x = bottoms[0]
    p = ctx.layer.scale_param
    s, *bias_ = _scale_operands(p, bottoms, params)
    y = x * _broadcast_operand(ctx, x, s, p.axis)
    if bias_:
        y = y + _broadcast_operand(ctx, x, bias_[0], p.axis)
    return [y]


# ---- Concat, Slice, Split, Silence, Tile ----------------------------------------------------------------------

def _concat_axis(layer_param: Any, bottom_shapes: Sequence[Shape]) -> int:
    """The axis Concat joins along; every other dim of the bottoms must agree."""
    first = tuple(bottom_shapes[0])
    axis = _legacy_axis(layer_param, layer_param.concat_param, "concat_dim", len(first))
    for i, shape in enumerate(bottom_shapes[1:], 1):
        if len(shape) != len(first) or any(shape[j] != first[j] for j in range(len(shape)) if j != axis):
            raise rejected(layer_param, f"all inputs must have the same shape except at concat axis {axis}: "
                                        f"bottom[0] {first}, bottom[{i}] {tuple(shape)}")
    return axis


def _concat_top_shapes(layer_param, bottom_shapes, param_shapes, num_tops):
    axis = _concat_axis(layer_param, bottom_shapes)
    first = tuple(bottom_shapes[0])
    return [first[:axis] + (sum(s[axis] for s in bottom_shapes),) + first[axis + 1:]]


@layer("Concat", bottoms=(1, None), tops=(1, 1), top_shapes=_concat_top_shapes,
       rows_apart=rows_apart_off_axis_0(lambda lp, ndim: _legacy_axis(lp, lp.concat_param, "concat_dim", ndim)))
def concat(ctx: LayerContext, bottoms, params):
    """top = the bottoms joined along axis (or legacy concat_dim); all other dims must agree."""
    return [jnp.concatenate(bottoms, axis=_concat_axis(ctx.layer, [b.shape for b in bottoms]))]


@layer("Slice", bottoms=(1, 1), tops=(1, None),
       rows_apart=rows_apart_off_axis_0(lambda lp, ndim: _legacy_axis(lp, lp.slice_param, "slice_dim", ndim)))
def slice_(ctx: LayerContext, bottoms, params):
    """The bottom cut along axis (or legacy slice_dim) at slice_point (tops-1 strictly increasing points),
    or into equal parts when no slice_point is given."""
    (x,) = bottoms
    p = ctx.layer.slice_param
    axis = _legacy_axis(ctx.layer, p, "slice_dim", x.ndim)
    size, tops = x.shape[axis], ctx.num_tops
    points = list(p.slice_point)
    if points:
        if len(points) != tops - 1:
            raise ctx.error(f"{len(points)} slice_points for {tops} tops (need tops - 1)")
        if tops > size:
            raise ctx.error(f"{tops} tops exceed the {size} entries of axis {axis}")
        if any(b <= a for a, b in zip([0] + points, points)):
            raise ctx.error(f"slice_point must be strictly increasing from 0, got {points}")
        if points[-1] > size:
            raise ctx.error(f"slice_point {points[-1]} is past axis {axis}'s size {size}")
    else:
        if size % tops:
            raise ctx.error(f"number of top blobs ({tops}) should evenly divide input slice axis ({size})")
        points = [size // tops * i for i in range(1, tops)]
    return jnp.split(x, points, axis=axis)


def split_on_host(lp, bottoms):
    """Split's forward on the host, where only layers run there read its tops (LayerRule.host_when_read_on_host)."""
    return [bottoms[0]] * len(lp.top)


def split_backward_on_host(lp, bottoms, tops, top_diffs, propagate_down):
    """The tops' diffs summed in order, as SplitLayer::Backward_cpu adds each to the first."""
    return [functools.reduce(np.add, top_diffs) if propagate_down[0] else None]


@layer("Split", bottoms=(1, 1), tops=(1, None), in_place=False, rows_apart=True,
       top_shapes=lambda lp, bottom_shapes, param_shapes, num_tops: [tuple(bottom_shapes[0])] * num_tops,
       host_forward=split_on_host, host_backward=split_backward_on_host, host_when_read_on_host=True)
def split(ctx: LayerContext, bottoms, params):
    """Every top is the bottom; the bottom's diff is the sum of the tops' diffs."""
    return [bottoms[0]] * ctx.num_tops


@layer("Silence", bottoms=(1, None), tops=(0, 0), rows_apart=True)
def silence(ctx: LayerContext, bottoms, params):
    """No tops; the bottoms get zero gradient."""
    return []


@layer("Tile", bottoms=(1, 1), tops=(1, 1),
       rows_apart=rows_apart_off_axis_0(param_axis("tile_param")))
def tile(ctx: LayerContext, bottoms, params):
    """Each block of count(axis:) entries repeated ``tiles`` times in a row (np.tile along axis)."""
    (x,) = bottoms
    p = ctx.layer.tile_param
    axis = canonical_axis(ctx, p.axis, x.ndim)
    if not p.HasField("tiles"):
        raise ctx.error("number of tiles must be specified")
    if p.tiles <= 0:
        raise ctx.error(f"number of tiles must be positive, got {p.tiles}")
    reps = [1] * x.ndim
    reps[axis] = p.tiles
    return [jnp.tile(x, reps)]


# ---- Eltwise --------------------------------------------------------------------------------------------------

@jax.custom_vjp
def _product_by_quotient(xs: tuple) -> jax.Array:
    """Π x_i whose gradient is Caffe's stable_prod_grad: false formula, top / x_i (inf/nan where x_i == 0)."""
    return functools.reduce(jnp.multiply, xs)


def _product_by_quotient_fwd(xs):
    top = functools.reduce(jnp.multiply, xs)
    return top, (top, xs)


def _product_by_quotient_bwd(residual, g):
    top, xs = residual
    return (tuple(g * (top / x) for x in xs),)


_product_by_quotient.defvjp(_product_by_quotient_fwd, _product_by_quotient_bwd)


def _eltwise_max(bottoms: Sequence[jax.Array]) -> jax.Array:
    """Element-wise max by Caffe's mask rule: bottom 1 wins ties with bottom 0, later bottoms need a strict >.
    jnp.where's derivative sends the whole gradient to the bottom the mask records, as Caffe's backward."""
    top = jnp.where(bottoms[0] > bottoms[1], bottoms[0], bottoms[1])
    for b in bottoms[2:]:
        top = jnp.where(b > top, b, top)
    return top


def _eltwise_top_shapes(layer_param, bottom_shapes, param_shapes, num_tops):
    """bottom[0]'s shape, which every bottom must have; coefficients only for SUM, one per bottom."""
    p = layer_param.eltwise_param
    coeffs = list(p.coeff)
    if coeffs and len(coeffs) != len(bottom_shapes):
        raise rejected(layer_param, f"takes one coefficient per bottom blob: {len(coeffs)} coeffs, "
                                    f"{len(bottom_shapes)} bottoms")
    if p.operation == caffe_pb2.EltwiseParameter.PROD and coeffs:
        raise rejected(layer_param, "only takes coefficients for summation (operation SUM)")
    first = tuple(bottom_shapes[0])
    for i, shape in enumerate(bottom_shapes[1:], 1):
        if tuple(shape) != first:
            raise rejected(layer_param, f"bottom[0] {first} and bottom[{i}] {tuple(shape)} differ")
    if p.operation not in (caffe_pb2.EltwiseParameter.PROD, caffe_pb2.EltwiseParameter.SUM,
                           caffe_pb2.EltwiseParameter.MAX):
        raise rejected(layer_param, f"unknown elementwise operation {p.operation}")
    return [first]


@layer("Eltwise", bottoms=(2, None), tops=(1, 1), top_shapes=_eltwise_top_shapes, rows_apart=True)
def eltwise(ctx: LayerContext, bottoms, params):
    """PROD: Π x_i; SUM: Σ coeff_i·x_i (coeff one per bottom, default 1); MAX: element-wise max.
    PROD's gradient is the product of the other bottoms (stable_prod_grad) or top / x_i."""
    _eltwise_top_shapes(ctx.layer, [b.shape for b in bottoms], [], 1)
    p = ctx.layer.eltwise_param
    if p.operation == caffe_pb2.EltwiseParameter.PROD:
        if p.stable_prod_grad:
            return [functools.reduce(jnp.multiply, bottoms)]
        return [_product_by_quotient(tuple(bottoms))]
    if p.operation == caffe_pb2.EltwiseParameter.SUM:
        coeffs = list(p.coeff) or [1.0] * len(bottoms)
        return [functools.reduce(jnp.add, [b if c == 1 else c * b for c, b in zip(coeffs, bottoms)])]
    return [_eltwise_max(bottoms)]


# ---- Flatten, Reshape -----------------------------------------------------------------------------------------

def _flatten_top_shapes(layer_param, bottom_shapes, param_shapes, num_tops):
    """Axes [axis, end_axis] of the bottom's shape collapsed into one."""
    shape = tuple(bottom_shapes[0])
    p = layer_param.flatten_param
    start = canonical_axis(layer_param, p.axis, len(shape))
    end = canonical_axis(layer_param, p.end_axis, len(shape))
    if end + 1 < start:
        raise rejected(layer_param, f"end_axis {p.end_axis} comes before axis {p.axis} for a {len(shape)}-D blob")
    return [shape[:start] + (count(shape, start, end + 1),) + shape[end + 1:]]


@layer("Flatten", bottoms=(1, 1), tops=(1, 1), in_place=False, top_shapes=_flatten_top_shapes,
       rows_apart=rows_apart_off_axis_0(param_axis("flatten_param")))
def flatten(ctx: LayerContext, bottoms, params):
    """Axes [axis, end_axis] collapsed into one (defaults 1 and -1)."""
    (x,) = bottoms
    return [x.reshape(_flatten_top_shapes(ctx.layer, [x.shape], [], 1)[0])]


def _reshape_top_shapes(layer_param, bottom_shapes, param_shapes, num_tops):
    """reshape_layer.cpp: dims [axis, axis + num_axes) replaced by shape; 0 copies, one -1 is inferred."""
    bottom_shape = tuple(bottom_shapes[0])
    p = layer_param.reshape_param
    ndim = len(bottom_shape)
    dims = list(p.shape.dim)
    if dims.count(-1) > 1:
        raise rejected(layer_param, f"new shape {dims} contains multiple -1 dims; at most one may be inferred")
    # A negative axis counts from the end with ndim + axis + 1 (so -1 means "after the last axis").
    start = p.axis if p.axis >= 0 else ndim + p.axis + 1
    if not 0 <= start <= ndim:
        raise rejected(layer_param, f"axis {p.axis} out of range for a {ndim}-D bottom")
    if p.num_axes < -1:
        raise rejected(layer_param, f"num_axes must be >= 0, or -1 for all; got {p.num_axes}")
    end = ndim if p.num_axes == -1 else start + p.num_axes
    if end > ndim:
        raise rejected(layer_param, f"end axis = axis + num_axes = {end} is out of range for a {ndim}-D bottom")
    top = list(bottom_shape[:start]) + dims + list(bottom_shape[end:])
    for i, d in enumerate(dims):
        if d == 0:
            if start + i >= ndim:
                raise rejected(layer_param, f"new shape {dims} contains a 0, but there is no bottom axis "
                                            f"{start + i} to copy")
            top[start + i] = bottom_shape[start + i]
    total = count(bottom_shape)
    if -1 in dims:
        known = count([d for j, d in enumerate(top) if j != start + dims.index(-1)])
        if known == 0 or total % known:
            raise rejected(layer_param, f"bottom count ({total}) must be divisible by the product of the "
                                        f"specified dimensions ({known}) of {dims}")
        top[start + dims.index(-1)] = total // known
    if any(d < 0 for d in top) or count(top) != total:
        raise rejected(layer_param, f"output count must match input count: {tuple(bottom_shape)} -> {tuple(top)}")
    return [tuple(top)]


def _reshape_keeps_rows(layer_param, phase, bottom_shapes) -> bool:
    """Rows stay rows where the reshaped axes start after the batch axis, or the new shape copies it (a 0)."""
    p = layer_param.reshape_param
    shape = bottom_shapes[0] if bottom_shapes else None
    if p.axis < 0 and shape is None:
        return True  # where the span starts is unknown without the shape (LayerRule.rows_apart)
    start = p.axis if p.axis >= 0 else len(shape) + p.axis + 1
    return start > 0 or (len(p.shape.dim) > 0 and p.shape.dim[0] == 0)


@layer("Reshape", bottoms=(1, 1), tops=(1, 1), in_place=False, top_shapes=_reshape_top_shapes,
       rows_apart=_reshape_keeps_rows)
def reshape(ctx: LayerContext, bottoms, params):
    """The bottom's data under a new shape (see _reshape_top_shapes)."""
    (x,) = bottoms
    return [x.reshape(_reshape_top_shapes(ctx.layer, [x.shape], [], 1)[0])]


# ---- InnerProduct ---------------------------------------------------------------------------------------------

def _inner_product_param_shapes(layer_param, bottom_shapes):
    """W: N x K (K x N if transpose), K = count(axis:); b: N."""
    p = layer_param.inner_product_param
    shape = bottom_shapes[0]
    k = count(shape, canonical_axis(layer_param, p.axis, len(shape)))
    n = p.num_output
    return [(k, n) if p.transpose else (n, k)] + ([(n,)] if p.bias_term else [])


def _inner_product_init(layer_param, shapes, key):
    p = layer_param.inner_product_param
    fillers = [p.weight_filler, p.bias_filler]
    return [_fill(f, s, k) for f, s, k in zip(fillers, shapes, _keys(key, len(shapes)))]


# A few rows times a big N x K weight (Caffe's layout, not ``transpose``) is computed as (W x^T + b)^T on the
# CPU. YNNPACK packs the right-hand factor of a product before multiplying; as x W^T that is the whole weight,
# on every call, and for a few rows the packing costs more than the product. As W x^T the packed factor is the
# rows. The bias is added in that orientation: it keeps XLA from folding the final transpose back into the
# product (with nothing between them it does). Measured on 2 Sapphire Rapids cores, 16 rows, x W^T -> W x^T:
# AlexNet's fc6 (4096 x 9216) 26.5 -> 8.4 ms, fc7 8.3 -> 2.8 ms, GoogLeNet's classifier (1000 x 1024) 0.44 ->
# 0.32 ms, LeNet's ip1 (500 x 800) 0.26 -> 0.19 ms. Whole fp32 forwards at batch 16 took 0.84 (AlexNet) and
# 0.90-0.95 (LeNet) of the time, GoogLeNet's and ResNet-50's 0.99; training steps 0.95. With more rows than
# FEW_ROWS, or fewer outputs than rows (a 2 x 9216 weight), or a small weight, the plain product was as fast or
# faster; a ``transpose: true`` weight (K x N) would be read across its rows (fc6: 27 -> 46 ms). The backward is
# the plain product's but for the input gradient dy W of a big weight (FEW_ROWS_INPUT_GRADIENT_MIN_WEIGHT): as a
# product YNNPACK packs W for it on every call, and XLA's own kernel takes it from dy^T written out
# (common.transposed_copy; XLA leaves a product contracting dy^T's leading axis to its own kernel). Alone, on 2
# AMX Xeon cores, 16 rows: fc6 28.5 -> 16.6 ms, fc7 8.5 -> 5.9, 1000 x 4096 1.19 -> 0.87, 1000 x 2048 0.64 ->
# 0.56; 2 and 8 rows of fc6 0.73 and 0.76 of the time; even at 1000 x 1024, slower at LeNet's 500 x 800 (0.127 ->
# 0.149 ms) and for many rows (300 x 4096 x 4096 1.27x). AlexNet at batch 16: the bench's training step 357 ->
# 342 ms (alternating, one process); Solver.step 385 and 382 -> 368 and 363 ms (alternating processes).
# Not for 16-bit values: XLA sinks the transpose into the next product, which then reads its rows down the
# columns; YNNPACK declines such a bfloat16 product and XLA's own has no bfloat16 x bfloat16 -> float32 kernel
# (LeNet's ip2 after ip1 failed to run). bf16 forwards at batch 16 had gained 2-3% (AlexNet, GoogLeNet).
#
# One row (batch 1) is multiplied so too, its backward the one-row product's (:func:`_one_row_product_bwd`).
# From jaxlib 0.12 YNNPACK's dot fusions take a one-row x W^T + b, which XLA's own matrix-vector kernel ran
# before, and pack the whole weight on every call. On 2 AMD EPYC cores under jax 0.12.1, x W^T -> W x^T alone:
# AlexNet's fc6 17.5 -> 2.9 ms, fc7 5.7 -> 1.3, fc8 1.65 -> 0.40, GoogLeNet's classifier 0.21 -> 0.08 ms;
# AlexNet's forward at batch 1 33.3 -> 15.8 ms, its training step 97-120 -> 78-88 ms (alternating, one
# process). Under jax 0.10.2 and 0.11.2 the two ran alike: fc6 4.8 against 4.9 ms and 4.5 against 4.5; under
# 0.10.2 the forwards of AlexNet, GoogLeNet, ResNet-50 and LeNet at batch 1 within 1% and AlexNet's step within
# its spread of +-4 ms, under 0.11.2 AlexNet's forward within 2%.
#
# Past MANY_ROWS rows the plain product falls off a cliff on the CPU: on 2 AMD EPYC (AVX2) cores, 300 rows (a
# Fast/Faster R-CNN head's ROIs) times VGG16's fc6 (4096 x 25088) took 1168 ms as x W^T and 540 ms as W x^T,
# AlexNet's fc6 (4096 x 9216) 435 -> 223 ms, a 4096 x 4096 weight 173 -> 91 ms, where at 128 rows the two were
# within 10% (96 and 89 ms) and x W^T had grown 4.5x for 2.3x the rows. Between FEW_ROWS and MANY_ROWS the plain
# product stays (as measured on Sapphire Rapids).
FEW_ROWS = 32
MANY_ROWS = 256
FEW_ROWS_MIN_WEIGHT = 1 << 18
FEW_ROWS_INPUT_GRADIENT_MIN_WEIGHT = 1 << 20


def _few_rows_apply(rows: jax.Array, weight: jax.Array, transpose: bool, bias_term: bool) -> bool:
    m, (n, k) = rows.shape[0], weight.shape
    if is_symbolic(m):  # a batch-polymorphic export: the plain product, whatever the batch
        return False
    return (not transpose and bias_term and (m <= FEW_ROWS or m > MANY_ROWS) and m < n
            and n * k >= FEW_ROWS_MIN_WEIGHT and rows.dtype.itemsize >= 4 and jax.default_backend() == "cpu")


def _rows_times_weight_plus_bias(rows: jax.Array, weight: jax.Array, bias: jax.Array) -> jax.Array:
    y = matmul_bt(rows, weight)
    return y + bias.astype(y.dtype)


def _weight_times_rows_plus_bias(rows: jax.Array, weight: jax.Array, bias: jax.Array) -> jax.Array:
    """rows W^T + b, in :func:`accumulator_dtype`, as (W rows^T + b)^T (see FEW_ROWS)."""
    columns = lax.dot_general(weight, rows, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                              preferred_element_type=accumulator_dtype(rows.dtype))
    return (columns + bias.astype(columns.dtype)[:, None]).T


# Its derivative is the plain product's. The forward rule calls the undecorated function, so that
# forward-over-reverse (a Hessian-vector product) differentiates it as it is.
_few_rows_product = jax.custom_vjp(_weight_times_rows_plus_bias)


def _few_rows_product_fwd(rows, weight, bias):
    return _weight_times_rows_plus_bias(rows, weight, bias), (rows, weight, bias)


def _few_rows_product_bwd(residuals, dy):
    rows, weight, bias = residuals
    if rows.shape[0] == 1:  # the one-row product's (see _one_row_times_weight)
        return (*_one_row_product_bwd(False, (rows, weight), dy), jnp.sum(dy, axis=0).astype(bias.dtype))
    d_rows, d_weight, d_bias = jax.vjp(_rows_times_weight_plus_bias, *residuals)[1](dy)
    if rows.shape[0] <= FEW_ROWS and weight.size >= FEW_ROWS_INPUT_GRADIENT_MIN_WEIGHT:
        # dy W, as (dy^T)^T W: the plain product's (d_rows above) is left unused, and XLA drops it.
        d_rows = lax.dot_general(transposed_copy(dy), weight, (((0,), (0,)), ((), ())),
                                 precision=lax.Precision.HIGHEST, preferred_element_type=dy.dtype).astype(rows.dtype)
    return d_rows, d_weight, d_bias


_few_rows_product.defvjp(_few_rows_product_fwd, _few_rows_product_bwd)


# With one row, the weight gradient dy^T x contracts an axis of size 1, and XLA rewrites it as the product of
# two broadcasts, fusing into it whatever made dy and x: each element of the N x K gradient recomputes them.
# Behind Dropout that is the Threefry mask, 20 rounds per element. A zero row appended to both factors keeps
# the product a product of two finished arrays (XLA:CPU turns optimization barriers into ordering only; they
# do not stop the fusion). Training steps at batch 1 (bench's train step, alternating processes, 2 AVX2
# cores): AlexNet 437-506 -> 256-263 ms, GoogLeNet 185-229 -> 163-203 ms.
def _rows_times_weight(rows: jax.Array, weight: jax.Array, transpose: bool) -> jax.Array:
    """rows (M x K) times weight (K x N if ``transpose``, else N x K, multiplied as its transpose)."""
    return matmul(rows, weight) if transpose else matmul_bt(rows, weight)


def _one_row_times_weight(row: jax.Array, weight: jax.Array, transpose: bool) -> jax.Array:
    """:func:`_rows_times_weight` of one row. On the CPU a 16-bit row is multiplied with a zero row beside it:
    XLA:CPU runs a one-row bfloat16 product as a matrix-vector product in float32 and converts the whole weight
    to float32 for it on every call, where a two-row product stays a bfloat16 one (YNNPACK's). AlexNet's fc6
    (9216 -> 4096) took 11.5 ms one row at a time, 2.8 ms with two (2 Sapphire Rapids cores)."""
    if row.dtype.itemsize == 2 and jax.default_backend() == "cpu":
        return _rows_times_weight(jnp.concatenate([row, jnp.zeros_like(row)]), weight, transpose)[:1]
    return _rows_times_weight(row, weight, transpose)


_one_row_product = jax.custom_vjp(_one_row_times_weight, nondiff_argnums=(2,))


def _one_row_product_fwd(row, weight, transpose):
    return _one_row_times_weight(row, weight, transpose), (row, weight)


def _one_row_product_bwd(transpose, residuals, dy):
    row, weight = residuals
    d_row = matmul_bt(dy, weight) if transpose else matmul(dy, weight)
    first, second = (jnp.concatenate([a, jnp.zeros_like(a)]) for a in ((row, dy) if transpose else (dy, row)))
    d_weight = matmul(first.T, second)
    return d_row.astype(row.dtype), d_weight.astype(weight.dtype)


_one_row_product.defvjp(_one_row_product_fwd, _one_row_product_bwd)


def _inner_product_top_shapes(layer_param, bottom_shapes, param_shapes, num_tops):
    """shape[:axis] + [N]; the N x K weights (K x N with transpose) must take K = count(axis:), the bias N."""
    shape = tuple(bottom_shapes[0])
    p = layer_param.inner_product_param
    axis = canonical_axis(layer_param, p.axis, len(shape))
    weight = tuple(param_shapes[0])
    if len(weight) != 2:
        raise rejected(layer_param, f"weights must be a matrix, got shape {weight}")
    k = count(shape, axis)
    w_k, n = (weight[0], weight[1]) if p.transpose else (weight[1], weight[0])
    if k != w_k:
        raise rejected(layer_param, f"input size incompatible with inner product parameters: bottom {shape} has "
                                    f"K = {k} from axis {axis}, weights {weight} expect {w_k}")
    if p.bias_term and tuple(param_shapes[1]) != (n,):
        raise rejected(layer_param, f"bias of shape {tuple(param_shapes[1])} does not fit {n} outputs")
    return [shape[:axis] + (n,)]


@layer("InnerProduct", param_shapes=_inner_product_param_shapes, init_params=_inner_product_init,
       bottoms=(1, 1), tops=(1, 1), top_shapes=_inner_product_top_shapes,
       rows_apart=rows_apart_off_axis_0(param_axis("inner_product_param")))
def inner_product(ctx: LayerContext, bottoms, params):
    """y = x Wᵀ + b (x W with transpose) over x viewed as count(:axis) x count(axis:); top shape[:axis]+[N]."""
    (x,) = bottoms
    p = ctx.layer.inner_product_param
    (top_shape,) = _inner_product_top_shapes(ctx.layer, [x.shape], [b.shape for b in params], 1)
    axis = len(top_shape) - 1
    weight = params[0]
    rows = x.reshape(count(x.shape, 0, axis), count(x.shape, axis))
    if _few_rows_apply(rows, weight, p.transpose, p.bias_term):
        y = _few_rows_product(rows, weight, params[1])
    else:
        y = (_one_row_product if rows.shape[0] == 1 else _rows_times_weight)(rows, weight, p.transpose)
        if p.bias_term:
            y = y + params[1].astype(y.dtype)
    # Rounded to the values' dtype once, after the bias (a no-op in float32).
    return [y.astype(x.dtype).reshape(top_shape)]


# ---- MVN, Softmax, Reduction ----------------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _normalize_variance(centered: jax.Array, axes: tuple[int, ...], eps: float) -> jax.Array:
    return centered / (jnp.sqrt(jnp.mean(jnp.square(centered), axis=axes, keepdims=True)) + eps)


def _normalize_variance_fwd(centered, axes, eps):
    std = jnp.sqrt(jnp.mean(jnp.square(centered), axis=axes, keepdims=True)) + eps
    y = centered / std
    return y, (y, std)


def _normalize_variance_bwd(axes, eps, residual, dy):
    """mvn_layer.cpp's Backward: (dy - mean(dy) - mean(dy·y)·y) / (sqrt(var) + eps), the derivative with
    eps inside the square root; it stays finite for a constant input, where the true one does not."""
    y, std = residual
    mean = functools.partial(jnp.mean, axis=axes, keepdims=True)
    return ((dy - mean(dy) - mean(dy * y) * y) / std,)


_normalize_variance.defvjp(_normalize_variance_fwd, _normalize_variance_bwd)


@layer("MVN", bottoms=(1, 1), tops=(1, 1), rows_apart=True)
def mvn(ctx: LayerContext, bottoms, params):
    """y = x - mean, and with normalize_variance y /= (sqrt(var) + eps) (eps after the root), per (n, c) or
    per n when across_channels, over Caffe's legacy (num, channels, height, width) view."""
    (x,) = bottoms
    p = ctx.layer.mvn_param
    if x.ndim > 4:
        raise ctx.error(f"works on blobs of at most 4 axes (num, channels, height, width), got {tuple(x.shape)}")
    legacy = legacy_4d(x.shape)
    axes = (1, 2, 3) if p.across_channels else (2, 3)
    v = x.reshape(legacy)
    centered = v - jnp.mean(v, axis=axes, keepdims=True)
    y = _normalize_variance(centered, axes, p.eps) if p.normalize_variance else centered
    return [y.reshape(x.shape)]


def _softmax_top_shapes(layer_param, bottom_shapes, param_shapes, num_tops):
    canonical_axis(layer_param, layer_param.softmax_param.axis, len(bottom_shapes[0]))
    return [tuple(bottom_shapes[0])]


@layer("Softmax", bottoms=(1, 1), tops=(1, 1), top_shapes=_softmax_top_shapes,
       rows_apart=rows_apart_off_axis_0(param_axis("softmax_param")))
def softmax(ctx: LayerContext, bottoms, params):
    """y = exp(x - max) / Σ exp(x - max) along axis."""
    (x,) = bottoms
    # Exponentials and their sum in float32 at least (a bfloat16 sum of 1000 classes drops the small ones).
    y = jax.nn.softmax(x.astype(accumulator_dtype(x.dtype)), axis=canonical_axis(ctx, ctx.layer.softmax_param.axis,
                                                                                x.ndim))
    return [y.astype(x.dtype)]


@layer("Reduction", bottoms=(1, 1), tops=(1, 1),
       rows_apart=rows_apart_off_axis_0(param_axis("reduction_param")))
def reduction(ctx: LayerContext, bottoms, params):
    """coeff · (SUM x | ASUM |x| | SUMSQ x² | MEAN x) over all axes >= axis; top shape = shape[:axis].
    ASUM's gradient is sign(x) with sign(0) = 0 (caffe_cpu_sign)."""
    (x,) = bottoms
    p = ctx.layer.reduction_param
    axis = canonical_axis(ctx, p.axis, x.ndim)
    dim = count(x.shape, axis)
    v = x.reshape(tuple(x.shape[:axis]) + (dim,))
    op = p.operation
    R = caffe_pb2.ReductionParameter
    if op in (R.SUM, R.MEAN):
        total = jnp.sum(v, axis=-1)
    elif op == R.ASUM:
        total = jnp.sum(v * lax.stop_gradient(jnp.sign(v)), axis=-1)
    elif op == R.SUMSQ:
        total = jnp.sum(v * v, axis=-1)
    else:
        raise ctx.error(f"unknown reduction operation {op}")
    coeff = jnp.asarray(p.coeff, x.dtype)
    if op == R.MEAN:
        coeff = coeff / dim  # reduction_layer.cpp folds 1/dim into coeff
    return [total * coeff]


# ---- Parameter ------------------------------------------------------------------------------------------------

def _parameter_param_shapes(layer_param, bottom_shapes):
    return [tuple(int(d) for d in layer_param.parameter_param.shape.dim)]


def _parameter_init(layer_param, shapes, key):
    return [np.zeros(s, np.float32) for s in shapes]  # a fresh Blob is zero-filled; there is no filler


@layer("Parameter", param_shapes=_parameter_param_shapes, init_params=_parameter_init,
       bottoms=(0, 0), tops=(1, 1))
def parameter(ctx: LayerContext, bottoms, params):
    """top = the layer's one learnable blob; the top's diff is the blob's diff."""
    return [params[0]]
