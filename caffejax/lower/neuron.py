"""Neuron layers: element-wise maps of one bottom onto one top of the same shape (Caffe's NeuronLayer).

Each rule is Caffe's Forward_cpu as a JAX expression. Where Caffe's hand-written Backward_cpu differs from the
true derivative of its forward (ReLU/PReLU/ELU at exactly 0, AbsVal's sign(0) = 0, Clip's closed interval,
Threshold's missing gradient) the expression is written so that JAX's derivative is Caffe's: ``jnp.where``
picks the branch Caffe's backward picks, and ``lax.stop_gradient`` cuts what Caffe does not differentiate.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from caffejax.lower.registry import TRAIN, layer, rejected


def same_shape(layer_param, bottom_shapes, param_shapes, num_tops):
    """A NeuronLayer's Reshape: top->ReshapeLike(*bottom[0]) (for neurons whose forward checks nothing)."""
    return [tuple(bottom_shapes[0])]


def same_shape_after(check):
    """:func:`same_shape` for a neuron whose forward checks its settings: ``check(layer_param, bottom_shapes,
    param_shapes)`` raises first what the forward raises."""
    def top_shapes(layer_param, bottom_shapes, param_shapes, num_tops):
        check(layer_param, bottom_shapes, param_shapes)
        return same_shape(layer_param, bottom_shapes, param_shapes, num_tops)

    return top_shapes


def neuron(type_name: str, **kwargs):
    """Register a NeuronLayer: exactly one bottom and one top; in place allowed unless said otherwise. Each
    element maps on its own, so each row of the batch does (LayerRule.rows_apart) unless said otherwise. Its
    top has its bottom's shape (NeuronLayer::Reshape): ``top_shapes`` is :func:`same_shape`, or
    :func:`same_shape_after` the checks of a layer whose forward checks its settings."""
    return layer(type_name, bottoms=(1, 1), tops=(1, 1), **{"rows_apart": True, "top_shapes": same_shape, **kwargs})


def sigmoid(x: jax.Array) -> jax.Array:
    """Caffe's sigmoid, 0.5·tanh(0.5·x) + 0.5 (sigmoid_layer.cpp): overflow-free and what Caffe computes."""
    return 0.5 * jnp.tanh(0.5 * x) + 0.5


def leaky(x: jax.Array, slope) -> jax.Array:
    """x > 0 ? x : slope·x. The derivative at x == 0 is ``slope``, as Caffe's (x > 0) + slope·(x <= 0)."""
    if isinstance(slope, (int, float)) and slope == 0:
        # A plain ReLU without the product 0·x (NaN stays NaN; -0 becomes +0, as in Caffe's CPU forward). In a
        # bfloat16 program XLA:CPU computes every bfloat16 product in float32 and rounds it back, and a fusion
        # that reads each value several times (a pooling window after the ReLU) repeats that: SqueezeNet v1.1's
        # bfloat16 forward at batch 16 took 45.5 ms this way against 51.9 (2 Sapphire Rapids cores).
        return jnp.where(x <= 0, jnp.zeros_like(x), x)
    return jnp.where(x > 0, x, slope * x)


def ln_of_base(layer_param, base: float, what: str) -> float:
    """ln(base) for Exp/Log's ``base`` (-1 means e), with Caffe's checks (exp_layer.cpp, log_layer.cpp)."""
    if base == -1:
        return 1.0
    if not base > 0:
        raise rejected(layer_param, f"{what}: base must be strictly positive, got {base}")
    return math.log(base)


# ---- stateless maps -------------------------------------------------------------------------------------------

@neuron("AbsVal", in_place=False)
def absval(ctx, bottoms, params):
    """y = |x|; dy/dx = sign(x), 0 at x == 0 (caffe_cpu_sign). Caffe forbids in-place AbsVal."""
    (x,) = bottoms
    return [x * lax.stop_gradient(jnp.sign(x))]


@neuron("BNLL")
def bnll(ctx, bottoms, params):
    """y = log(1 + e^x), computed as x + log(1 + e^-x) for x > 0 so that it cannot overflow (bnll_layer.cpp)."""
    (x,) = bottoms
    positive, negative = jnp.where(x > 0, x, 0), jnp.where(x > 0, 0, x)  # each branch stays finite
    return [jnp.where(x > 0, x + jnp.log1p(jnp.exp(-positive)), jnp.log1p(jnp.exp(negative)))]


@neuron("Clip")
def clip(ctx, bottoms, params):
    """y = max(min, min(x, max)); dy/dx = 1 on the closed interval [min, max], else 0 (clip_layer.cpp)."""
    (x,) = bottoms
    p = ctx.layer.clip_param
    lo, hi = p.min, p.max
    below_max = jnp.where(x > hi, hi, x)
    return [jnp.where(below_max < lo, lo, below_max)]


@neuron("ELU")
def elu(ctx, bottoms, params):
    """y = x > 0 ? x : α(e^x - 1); dy/dx at x <= 0 is α·e^x (= y + α as Caffe writes it), so α at x == 0."""
    (x,) = bottoms
    alpha = ctx.layer.elu_param.alpha
    negative = jnp.where(x > 0, 0, x)  # keeps exp finite on the branch that where() discards
    return [jnp.where(x > 0, x, alpha * (jnp.exp(negative) - 1))]


@neuron("Exp", top_shapes=same_shape_after(lambda lp, *_: ln_of_base(lp, lp.exp_param.base, "exp_param")))
def exp(ctx, bottoms, params):
    """y = base^(shift + scale·x) = outer · e^(inner·x), inner = ln(base)·scale, outer = base^shift."""
    (x,) = bottoms
    p = ctx.layer.exp_param
    inner = ln_of_base(ctx.layer, p.base, "exp_param") * p.scale
    outer = 1.0 if p.shift == 0 else (math.exp(p.shift) if p.base == -1 else p.base ** p.shift)
    return [jnp.exp(inner * x) * outer]


def _ln_of_log_base(layer_param) -> float:
    """ln of Log's base, which must not be 1 either (its output scale 1 / ln(base) would be infinite)."""
    base = layer_param.log_param.base
    ln_base = ln_of_base(layer_param, base, "log_param")
    if ln_base == 0:
        raise rejected(layer_param, f"log_param: base {base} gives log(base) = 0, an infinite output scale")
    return ln_base


@neuron("Log", top_shapes=same_shape_after(lambda lp, *_: _ln_of_log_base(lp)))
def log(ctx, bottoms, params):
    """y = log_base(shift + scale·x) = ln(shift + scale·x) / ln(base)."""
    (x,) = bottoms
    p = ctx.layer.log_param
    return [jnp.log(p.scale * x + p.shift) * (1.0 / _ln_of_log_base(ctx.layer))]


@neuron("Power")
def power(ctx, bottoms, params):
    """y = (shift + scale·x)^power; if power·scale == 0 the top is the constant (1 if power == 0 else
    shift^power) and carries no gradient, as Caffe's diff_scale_ == 0 case (power_layer.cpp)."""
    (x,) = bottoms
    p = ctx.layer.power_param
    if p.power * p.scale == 0:
        value = 1.0 if p.power == 0 else jnp.power(jnp.asarray(p.shift, x.dtype), p.power)
        return [jnp.full(x.shape, value, x.dtype)]
    z = p.scale * x + p.shift
    # power 1 is the affine map itself; Caffe skips powx there, which also keeps dy/dx = scale at z == 0.
    y = z if p.power == 1 else jnp.power(z, p.power)
    if ctx.in_place and ctx.in_place[0]:
        return [_in_place_power_gradient(x, y, p.power, p.scale, p.shift)]
    return [y]


def _in_place_power_gradient(x, y, power, scale, shift):
    """Caffe's Power backward run in place: bottom and top share data and diff, so it reads y where it
    means x, and its final ``bottom_diff *= top_diff`` multiplies the local derivative by itself (the top
    diff was already overwritten). The gradient is that squared local term, whatever the upstream diff was;
    the reference figures (net_phase_rules) show exactly this."""
    diff_scale = power * scale
    if power == 1:
        local = jnp.full_like(y, diff_scale)
    elif power == 2:
        local = diff_scale * scale * y + diff_scale * shift
    elif shift == 0:
        local = jnp.full_like(y, power)  # (y / y) * power
    else:
        local = diff_scale * y / (scale * y + shift)
    return _replace_gradient(x, y, jnp.square(local))


@jax.custom_vjp
def _replace_gradient(x, y, x_diff):
    """y, whose backward ignores the upstream diff and gives x the fixed diff ``x_diff``."""
    return y


_replace_gradient.defvjp(
    lambda x, y, x_diff: (y, (x_diff, y)),
    lambda res, g: (res[0].astype(g.dtype), jnp.zeros_like(res[1]), jnp.zeros_like(res[0])))


@neuron("ReLU")
def relu(ctx, bottoms, params):
    """y = x > 0 ? x : negative_slope·x; dy/dx = negative_slope at x == 0 (relu_layer.cpp)."""
    (x,) = bottoms
    return [leaky(x, ctx.layer.relu_param.negative_slope)]


@neuron("Sigmoid")
def sigmoid_layer(ctx, bottoms, params):
    """y = 1 / (1 + e^-x)."""
    (x,) = bottoms
    return [sigmoid(x)]


@neuron("Swish")
def swish(ctx, bottoms, params):
    """y = x · sigmoid(β·x)."""
    (x,) = bottoms
    return [x * sigmoid(ctx.layer.swish_param.beta * x)]


@neuron("TanH")
def tanh(ctx, bottoms, params):
    """y = tanh(x)."""
    (x,) = bottoms
    return [jnp.tanh(x)]


@neuron("Threshold")
def threshold(ctx, bottoms, params):
    """y = x > threshold ? 1 : 0. Caffe's Backward is NOT_IMPLEMENTED: no gradient flows."""
    (x,) = bottoms
    return [lax.stop_gradient((x > ctx.layer.threshold_param.threshold).astype(x.dtype))]


# ---- Dropout ----------------------------------------------------------------------------------------------------

def _dropout_ratio(layer_param) -> float:
    ratio = layer_param.dropout_param.dropout_ratio
    if not 0 <= ratio < 1:
        raise rejected(layer_param, f"dropout_ratio must be in [0, 1), got {ratio}")
    return ratio


# Threefry-2x32 (Salmon et al. 2011; JAX's default generator) written out. JAX lowers its own on the CPU as a
# loop of 5 steps that writes both words of every counter to memory at each step; written out, XLA fuses
# all 20 rounds into one loop over the elements, in registers. SqueezeNet's 16x512x14x14 mask on 2 AVX2
# cores: jax.random.bernoulli 9.5-13.7 ms, this 2.5-3.1 ms.
_THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_THREEFRY_PARITY = 0x1BD11BDA


def _threefry_first_word(k0: jax.Array, k1: jax.Array, x0: jax.Array, x1: jax.Array) -> jax.Array:
    """Word 0 of Threefry-2x32 (20 rounds) of the counter (x0, x1) under the key (k0, k1); uint32 arrays."""
    keys = (k0, k1, k0 ^ k1 ^ jnp.uint32(_THREEFRY_PARITY))
    x0, x1 = x0 + k0, x1 + k1
    for i in range(5):
        for r in _THREEFRY_ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = ((x1 << jnp.uint32(r)) | (x1 >> jnp.uint32(32 - r))) ^ x0
        x0, x1 = x0 + keys[(i + 1) % 3], x1 + keys[(i + 2) % 3] + jnp.uint32(i + 1)
    return x0


def random_words(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """32 random bits per element: Threefry-2x32 of the counter (element index, 0) under two words drawn
    from ``key`` (any of JAX's PRNG implementations), keeping the first output word."""
    k0, k1 = jax.random.bits(key, (2,), jnp.uint32)
    count = math.prod(shape)
    if count >= 2**32:  # the index would wrap; JAX's own generator has a wider counter
        return jax.random.bits(key, shape, jnp.uint32)
    index = lax.iota(jnp.uint32, count).reshape(shape)
    return _threefry_first_word(k0, k1, index, jnp.zeros_like(index))


# In TRAIN each row's mask depends on where the row is in the batch (the random words are drawn by position).
@neuron("Dropout", top_shapes=same_shape_after(lambda lp, *_: _dropout_ratio(lp)),
        rows_apart=lambda layer_param, phase, shapes: phase != TRAIN)
def dropout(ctx, bottoms, params):
    """TRAIN: y = x · mask / (1 - r), mask ~ Bernoulli(1 - r) per element; TEST: y = x (dropout_layer.cpp).
    The mask comes from :func:`random_words`, so the same key gives the same mask.

    The gradient is top_diff · mask / (1 - r) in TRAIN, the identity in TEST, which is what JAX derives.
    Forks of Caffe add ``dropout_param.scale_train`` (false: scale by 1 - r at TEST instead of 1/(1 - r) at
    TRAIN); BVLC's caffe.proto has no such field, so it reads as true there.
    """
    (x,) = bottoms
    p = ctx.layer.dropout_param
    ratio = _dropout_ratio(ctx.layer)
    scale_train = getattr(p, "scale_train", True)
    if ctx.phase == TRAIN:
        # Kept where 32 random bits reach ratio * 2^32: P(keep) = 1 - ratio to 2^-33, as Caffe's 32-bit draws.
        threshold = jnp.uint32(min(round(ratio * 2**32), 2**32 - 1))
        keep = (random_words(ctx.rng(), x.shape) >= threshold).astype(x.dtype)
        return [x * keep * (1.0 / (1.0 - ratio))] if scale_train else [x * keep]
    return [x] if scale_train else [x * (1.0 - ratio)]


# ---- PReLU ------------------------------------------------------------------------------------------------------

def _check_prelu_bottom(layer_param, bottom_shape) -> None:
    if len(bottom_shape) < 2:
        raise rejected(layer_param, f"bottom must have at least 2 axes, got shape {tuple(bottom_shape)}")


def _prelu_param_shapes(layer_param, bottom_shapes):
    """One slope blob: shape () if channel_shared, else [C] with C = bottom.shape[1] (prelu_layer.cpp)."""
    _check_prelu_bottom(layer_param, bottom_shapes[0])
    return [()] if layer_param.prelu_param.channel_shared else [(bottom_shapes[0][1],)]


def _prelu_init_params(layer_param, shapes, key):
    """prelu_param.filler, or constant 0.25 when none is given."""
    from caffejax.lower.fillers import fill
    from caffejax.proto import caffe_pb2

    p = layer_param.prelu_param
    filler = p.filler if p.HasField("filler") else caffe_pb2.FillerParameter(type="constant", value=0.25)
    return [fill(filler, shapes[0], key)]


def _check_prelu_slope(layer_param, bottom_shape, slope_shape) -> None:
    """A bottom of at least 2 axes, and a slope blob of one value per channel (axis 1), or one if
    channel_shared. Caffe indexes the blob flat, so any blob of that count (shared PERMISSIVE params) will do."""
    _check_prelu_bottom(layer_param, bottom_shape)
    shared = layer_param.prelu_param.channel_shared
    expected, count = 1 if shared else bottom_shape[1], math.prod(slope_shape)
    if count != expected:
        raise rejected(layer_param, f"negative slope blob has {count} values, expected {expected} "
                       f"({'channel_shared' if shared else f'one per channel of bottom {tuple(bottom_shape)}'})")


@neuron("PReLU", param_shapes=_prelu_param_shapes, init_params=_prelu_init_params,
        top_shapes=same_shape_after(lambda lp, bottoms, params: _check_prelu_slope(lp, bottoms[0], params[0])))
def prelu(ctx, bottoms, params):
    """y = x > 0 ? x : a_c·x with c the channel (axis 1), or one a for all if channel_shared.

    dy/dx = a_c at x == 0 and dy/da_c = Σ x·(x <= 0), both as Caffe's Backward_cpu.
    """
    (x,) = bottoms
    (slope,) = params
    _check_prelu_slope(ctx.layer, x.shape, slope.shape)
    flat = slope.reshape(-1).astype(x.dtype)
    a = flat[0] if ctx.layer.prelu_param.channel_shared else flat.reshape((x.shape[1],) + (1,) * (x.ndim - 2))
    return [leaky(x, a)]
