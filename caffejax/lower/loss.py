"""Loss layers (Caffe's LossLayer subclasses): top 0 is a scalar loss of shape ().

What every LossLayer shares (loss_layer.cpp): bottom[0] and bottom[1] have the same first dimension; labels
are float blobs holding integers, read with static_cast<int> (``astype(int32)``: truncation toward zero);
labels never receive a gradient, and force_backward does not reach them (``allow_force_backward``).
Normalized losses divide by max(1, normalizer) with the normalizer chosen by ``loss_param.normalization``.

Where Caffe's Backward_cpu is not the derivative of its Forward_cpu (it ignores the log clipping thresholds,
divides by dist + 1e-4 in ContrastiveLoss, zeroes ignored positions), the forward is written so that JAX's
derivative is Caffe's backward: ``jax.custom_vjp`` for the softmax losses, ``lax.stop_gradient`` elsewhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from caffejax.errors import DataError, WeightsError
from caffejax.frontend.caffemodel import blobproto_to_array, read_blobproto
from caffejax.lower.registry import canonical_axis, count, is_symbolic, layer, legacy_4d
from caffejax.proto import caffe_pb2

# float.h's FLT_MIN: SoftmaxWithLoss clips probabilities here before the log, for every Dtype.
FLT_MIN = float(np.finfo(np.float32).tiny)
# loss_layer.hpp's kLOG_THRESHOLD: MultinomialLogisticLoss and InfogainLoss clip probabilities here.
LOG_THRESHOLD = float(np.float32(1e-20))

_Norm = caffe_pb2.LossParameter


def loss_layer(type_name: str, bottoms=(2, 2), tops=(1, 1), label_bottoms=(1,)):
    """Register a LossLayer; force_backward skips ``label_bottoms`` (LossLayer::AllowForceBackward)."""
    return layer(type_name, is_loss=True, bottoms=bottoms, tops=tops,
                 allow_force_backward=lambda layer_param, i: i not in label_bottoms)


# ---- what LossLayer shares ---------------------------------------------------------------------------------------

def check_batch(ctx, data: jax.Array, label: jax.Array) -> None:
    """LossLayer::Reshape: bottom[0] and bottom[1] must agree on shape(0)."""
    if data.ndim == 0 or label.ndim == 0 or data.shape[0] != label.shape[0]:
        raise ctx.error("the data and label should have the same first dimension, got "
                        f"{tuple(data.shape)} and {tuple(label.shape)}")


def legacy_shape(ctx, x: jax.Array, what: str) -> tuple[int, int, int, int]:
    """Blob's (num, channels, height, width): missing trailing axes read as 1; more than 4 axes is an error."""
    if x.ndim > 4:
        raise ctx.error(f"{what} {tuple(x.shape)}: cannot use legacy num/channels/height/width on > 4 axes")
    return legacy_4d(x.shape)


def check_prob_top(ctx) -> None:
    """An optional second top needs a loss_weight for each top: LossLayer adds the single default weight 1,
    then Layer::SetLossWeights checks one weight per top (layer.hpp)."""
    if ctx.num_tops == 2 and len(ctx.layer.loss_weight) != 2:
        raise ctx.error("with a second (probability) top, loss_weight must be given once per top "
                        f"(got {len(ctx.layer.loss_weight)} loss_weight values for 2 tops)")


def int_labels(label: jax.Array) -> jax.Array:
    """static_cast<int>(label): truncation toward zero; a label never carries a gradient."""
    return lax.stop_gradient(label).astype(jnp.int32)


def valid_mask(ctx, labels: jax.Array) -> jax.Array:
    """Positions whose label is not loss_param.ignore_label (all of them when none is set)."""
    p = ctx.layer.loss_param
    if p.HasField("ignore_label"):
        return labels != p.ignore_label
    return jnp.ones(labels.shape, bool)


def normalizer(mode: int, outer: int, inner: int, valid: jax.Array, dtype) -> jax.Array:
    """get_normalizer: FULL = outer·inner, VALID = non-ignored count, BATCH_SIZE = outer, NONE = 1;
    at least 1, so a batch whose labels are all ignored gives loss 0 rather than NaN."""
    if mode == _Norm.VALID:
        return jnp.maximum(1, jnp.sum(valid)).astype(dtype)
    n = {_Norm.FULL: outer * inner, _Norm.BATCH_SIZE: outer, _Norm.NONE: 1}[mode]
    if is_symbolic(n):  # a batch-polymorphic export: the count is a value of the program
        return jnp.maximum(jnp.asarray(n, dtype), 1)
    return jnp.asarray(max(1.0, float(n)), dtype)


def legacy_normalization(ctx, default: int) -> int:
    """``normalization`` if set, else the legacy ``normalize`` (true: VALID, false: BATCH_SIZE), else default."""
    p = ctx.layer.loss_param
    if p.HasField("normalization"):
        return p.normalization
    if p.HasField("normalize"):
        return _Norm.VALID if p.normalize else _Norm.BATCH_SIZE
    return default


def class_axis_view(ctx, x: jax.Array, label: jax.Array, axis: int):
    """(outer, C, inner) view of the scores around the class axis, and the (outer, inner) integer labels."""
    axis = canonical_axis(ctx, axis, x.ndim)
    outer, inner = count(x.shape, 0, axis), count(x.shape, axis + 1)
    if outer * inner != label.size:
        raise ctx.error(f"number of labels must match number of predictions: scores {tuple(x.shape)} with "
                        f"class axis {axis} need {outer * inner} labels, label blob {tuple(label.shape)} has "
                        f"{label.size}")
    return x.reshape(outer, x.shape[axis], inner), int_labels(label).reshape(outer, inner), axis


def pick_class(values: jax.Array, labels: jax.Array) -> jax.Array:
    """values[i, labels[i, j], j] of an (outer, C, inner) array."""
    return jnp.take_along_axis(values, labels[:, None, :], axis=1)[:, 0, :]


# ---- softmax losses: Caffe's backward is the derivative of the unclipped log, zero on ignored positions ----------

@jax.custom_vjp
def infogain_nll(logits, labels, valid, H):
    """Per position -Σ_l H[y, l]·log(max(p_l, 1e-20)), p = softmax over axis 1 of (outer, C, inner) logits;
    zero where not valid. Its derivative is (p·Σ_l H[y, l] - H[y])·valid, Caffe's, whatever the clipping did."""
    return _infogain_fwd(logits, labels, valid, H)[0]


def _infogain_fwd(logits, labels, valid, H):
    prob = jax.nn.softmax(logits, axis=1)
    safe = jnp.where(valid, labels, 0)
    rows = jnp.moveaxis(H[safe], -1, 1)  # H[y_ij, l] laid out as (outer, C, inner)
    nll = -jnp.sum(rows * jnp.log(jnp.maximum(prob, LOG_THRESHOLD)), axis=1)
    return jnp.where(valid, nll, 0), (prob, rows, valid)


def _infogain_bwd(res, g):
    prob, rows, valid = res
    scale = jnp.where(valid, g, 0)[:, None, :]
    return (prob * jnp.sum(rows, axis=1, keepdims=True) - rows) * scale, None, None, None


infogain_nll.defvjp(_infogain_fwd, _infogain_bwd)


@jax.custom_vjp
def softmax_nll(logits, labels, valid):
    """Per position -log(max(p_y, FLT_MIN)), p = softmax over axis 1; zero where not valid.
    Its derivative is (p - onehot(y))·valid, Caffe's, also where the clipping is active."""
    return _softmax_fwd(logits, labels, valid)[0]


def _softmax_fwd(logits, labels, valid):
    prob = jax.nn.softmax(logits, axis=1)
    safe = jnp.where(valid, labels, 0)
    nll = -jnp.log(jnp.maximum(pick_class(prob, safe), FLT_MIN))
    return jnp.where(valid, nll, 0), (prob, safe, valid)


def _softmax_bwd(res, g):
    prob, safe, valid = res
    onehot = jnp.arange(prob.shape[1])[None, :, None] == safe[:, None, :]
    return (prob - onehot.astype(prob.dtype)) * jnp.where(valid, g, 0)[:, None, :], None, None


softmax_nll.defvjp(_softmax_fwd, _softmax_bwd)


@loss_layer("SoftmaxWithLoss", tops=(1, 2))
def softmax_with_loss(ctx, bottoms, params):
    """loss = -Σ_{valid} log(max(p[label], FLT_MIN)) / max(1, normalizer), p = softmax over softmax_param.axis.

    Normalization defaults to VALID; the legacy ``normalize`` counts only when ``normalization`` is unset.
    An optional second top is the probabilities p; Caffe's backward ignores its diff, so it is a constant here.
    """
    x, label = bottoms
    check_batch(ctx, x, label)
    check_prob_top(ctx)
    logits, labels, axis = class_axis_view(ctx, x, label, ctx.layer.softmax_param.axis)
    valid = valid_mask(ctx, labels)
    mode = legacy_normalization(ctx, default=_Norm.VALID)
    loss = jnp.sum(softmax_nll(logits, labels, valid)) / normalizer(mode, *labels.shape, valid, x.dtype)
    tops = [loss]
    if ctx.num_tops == 2:
        tops.append(lax.stop_gradient(jax.nn.softmax(x, axis=axis)))
    return tops


def _read_infogain_matrix(ctx) -> np.ndarray:
    """infogain_loss_param.source: a binary BlobProto, read relative to the working directory as Caffe does, as
    Blob::FromProto takes it (caffemodel.blobproto_to_array: legacy 4-D dims if any is set, else shape;
    double_data if present, else data)."""
    source = ctx.layer.infogain_loss_param.source
    try:
        blob = read_blobproto(source)
    except WeightsError as e:  # its message names the file
        raise ctx.error(f"infogain_loss_param.source: {e}", DataError) from None
    try:
        return blobproto_to_array(blob)
    except WeightsError as e:
        raise ctx.error(f"infogain_loss_param.source {source}: {e}", DataError) from None


@loss_layer("InfogainLoss", bottoms=(2, 3), tops=(1, 2), label_bottoms=(1, 2))
def infogain_loss(ctx, bottoms, params):
    """loss = -Σ_{valid} Σ_l H[label, l]·log(max(p_l, 1e-20)) / max(1, normalizer), p = softmax over
    infogain_loss_param.axis; H is bottom[2], or the BlobProto file infogain_loss_param.source.

    Normalization is ``loss_param.normalization`` (default VALID); the legacy ``normalize`` is rejected.
    An optional second top is the probabilities p (no gradient, as Caffe's backward ignores it).
    Neither the label nor H get a gradient: Caffe's backward is fatal for both, so force_backward skips them.
    """
    x, label = bottoms[:2]
    check_batch(ctx, x, label)
    check_prob_top(ctx)
    if ctx.layer.loss_param.HasField("normalize"):
        raise ctx.error('loss_param.normalize is deprecated for InfogainLoss; use "normalization"')
    logits, labels, axis = class_axis_view(ctx, x, label, ctx.layer.infogain_loss_param.axis)
    num_labels = logits.shape[1]
    if len(bottoms) == 3:
        H = bottoms[2]
    elif ctx.layer.infogain_loss_param.HasField("source"):
        H = _read_infogain_matrix(ctx)
    else:
        raise ctx.error("the infogain matrix must come from a third bottom or infogain_loss_param.source")
    if H.size != num_labels * num_labels:
        raise ctx.error(f"H must be {num_labels}x{num_labels} for {num_labels} classes on axis {axis}, "
                        f"got shape {tuple(H.shape)}")
    H = lax.stop_gradient(jnp.asarray(H, x.dtype).reshape(num_labels, num_labels))
    valid = valid_mask(ctx, labels)
    mode = ctx.layer.loss_param.normalization
    loss = jnp.sum(infogain_nll(logits, labels, valid, H)) / normalizer(mode, *labels.shape, valid, x.dtype)
    tops = [loss]
    if ctx.num_tops == 2:
        tops.append(lax.stop_gradient(jax.nn.softmax(x, axis=axis)))
    return tops


# ---- losses on probabilities, scores and pairs -------------------------------------------------------------------

@loss_layer("MultinomialLogisticLoss")
def multinomial_logistic_loss(ctx, bottoms, params):
    """loss = -Σ_n log(max(p[n, label_n], 1e-20)) / N on probabilities p viewed as (N, count / N).

    Caffe's backward is -1 / (N·max(p, 1e-20)) at the label, also below the threshold: the clipping is
    kept out of the derivative.
    """
    p, label = bottoms
    check_batch(ctx, p, label)
    num = legacy_shape(ctx, p, "probabilities")[0]
    if legacy_shape(ctx, label, "label")[1:] != (1, 1, 1):
        raise ctx.error(f"label must be (N, 1, 1, 1), got shape {tuple(label.shape)}")
    probs = p.reshape(num, -1)
    picked = jnp.take_along_axis(probs, int_labels(label).reshape(num, 1), axis=1)[:, 0]
    clipped = picked + lax.stop_gradient(jnp.maximum(picked, LOG_THRESHOLD) - picked)
    return [-jnp.sum(jnp.log(clipped)) / num]


@loss_layer("SigmoidCrossEntropyLoss")
def sigmoid_cross_entropy_loss(ctx, bottoms, params):
    """loss = -Σ_{valid} [x·(t - (x >= 0)) - log(1 + e^(x - 2x·(x >= 0)))] / max(1, normalizer), the
    overflow-free form of the cross-entropy of sigmoid(x) against targets t (which may be soft).

    Normalization defaults to BATCH_SIZE (outer = shape(0), inner = count(1)); ignore_label compares
    int(t). The derivative, sigmoid(x) - t on valid positions, is Caffe's backward.
    """
    x, target = bottoms
    check_batch(ctx, x, target)
    if x.size != target.size:
        raise ctx.error(f"inputs must have the same count, got {tuple(x.shape)} and {tuple(target.shape)}")
    t = lax.stop_gradient(target).reshape(x.shape).astype(x.dtype)
    valid = valid_mask(ctx, int_labels(t))
    positive = (x >= 0).astype(x.dtype)
    nll = -(x * (t - positive) - jnp.log(1 + jnp.exp(x - 2 * x * positive)))
    mode = legacy_normalization(ctx, default=_Norm.BATCH_SIZE)
    norm = normalizer(mode, x.shape[0], count(x.shape, 1), valid, x.dtype)
    return [jnp.sum(jnp.where(valid, nll, 0)) / norm]


@layer("EuclideanLoss", is_loss=True, bottoms=(2, 2), tops=(1, 1),
       allow_force_backward=lambda layer_param, i: True)
def euclidean_loss(ctx, bottoms, params):
    """loss = Σ (a - b)² / 2N with N = a.num(); both bottoms get a gradient (neither is a label)."""
    a, b = bottoms
    check_batch(ctx, a, b)
    num = legacy_shape(ctx, a, "bottom 0")[0]
    legacy_shape(ctx, b, "bottom 1")
    if count(a.shape, 1) != count(b.shape, 1):
        raise ctx.error(f"inputs must have the same dimension, got {tuple(a.shape)} and {tuple(b.shape)}")
    diff = a - b.reshape(a.shape)
    return [jnp.sum(diff * diff) / num / 2]


@loss_layer("HingeLoss")
def hinge_loss(ctx, bottoms, params):
    """loss = Σ_{n,k} max(0, 1 - δ(k = label_n)·x_nk)^p / N with δ = ±1, p = 1 (L1) or 2 (L2).

    The L1 derivative is sign(max(0, ·)): zero where the margin is exactly 0, as caffe_cpu_sign.
    """
    x, label = bottoms
    check_batch(ctx, x, label)
    num = legacy_shape(ctx, x, "scores")[0]
    scores = x.reshape(num, -1)
    labels = int_labels(label).reshape(-1)[:num]  # Caffe reads label[n] for n < N only
    sign = jnp.where(jnp.arange(scores.shape[1])[None, :] == labels[:, None], -1, 1).astype(x.dtype)
    margin = 1 + sign * scores
    hinge = jnp.where(margin > 0, margin, 0)
    if ctx.layer.hinge_loss_param.norm == caffe_pb2.HingeLossParameter.L2:
        return [jnp.sum(hinge * hinge) / num]
    return [jnp.sum(hinge) / num]


@jax.custom_vjp
def caffe_distance(dist_sq):
    """sqrt(d²), whose derivative Caffe takes as 1 / (2·(d + 1e-4)): finite at d = 0."""
    return jnp.sqrt(dist_sq)


def _distance_fwd(dist_sq):
    dist = jnp.sqrt(dist_sq)
    return dist, dist


def _distance_bwd(dist, g):
    return (g / (2 * (dist + 1e-4)),)


caffe_distance.defvjp(_distance_fwd, _distance_bwd)


@loss_layer("ContrastiveLoss", bottoms=(3, 3), label_bottoms=(2,))
def contrastive_loss(ctx, bottoms, params):
    """loss = Σ_n [y_n ? d_n² : max(margin - d_n, 0)²] / 2N, d_n = ‖a_n - b_n‖, y = int(bottom[2]) ≠ 0;
    legacy_version uses max(margin - d_n², 0) for dissimilar pairs.

    a and b are (N, C, 1, 1), the similarity (N, 1, 1, 1). Caffe's backward for a dissimilar pair is
    -(margin - d)·(a - b) / (N·(d + 1e-4)), zero where margin - d <= 0 (``caffe_distance``).
    """
    a, b, similar = bottoms
    check_batch(ctx, a, b)
    num, channels, height, width = legacy_shape(ctx, a, "bottom 0")
    if legacy_shape(ctx, b, "bottom 1")[1:] != (channels, 1, 1) or (height, width) != (1, 1):
        raise ctx.error(f"bottoms 0 and 1 must be (N, C, 1, 1) with the same C, got {tuple(a.shape)} "
                        f"and {tuple(b.shape)}")
    if legacy_shape(ctx, similar, "bottom 2")[1:] != (1, 1, 1) or similar.size < num:
        raise ctx.error(f"bottom 2 must be (N, 1, 1, 1) with N = {num}, got shape {tuple(similar.shape)}")
    diff = (a - b).reshape(num, channels)
    dist_sq = jnp.sum(diff * diff, axis=1)
    is_similar = int_labels(similar).reshape(-1)[:num] != 0
    margin = ctx.layer.contrastive_loss_param.margin
    if ctx.layer.contrastive_loss_param.legacy_version:
        gap = margin - dist_sq
        dissimilar = jnp.where(gap > 0, gap, 0)
    else:
        gap = margin - caffe_distance(dist_sq)
        dissimilar = jnp.where(gap > 0, gap, 0) ** 2
    return [jnp.sum(jnp.where(is_similar, dist_sq, dissimilar)) / num / 2]
