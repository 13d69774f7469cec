"""Neuron layer rules against BVLC Caffe's reference figures, plus the semantics the figures do not pin down."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from caffejax.errors import ShapeError
from caffejax.lower.registry import TEST, TRAIN, LayerContext, get_rule
from rule_harness import layer_context, layer_forward, parse_layer, run_reference_case

# ---- the reference cases (float32 through the Net: tests/test_reference.py) ------------------------------------

NEURON_CASES = ["absval", "bnll", "clip", "dropout_test", "elu", "exp_base", "log_base", "power", "power_one",
                "prelu", "prelu_shared", "relu", "relu_leaky_inplace", "sigmoid", "swish", "tanh", "threshold"]


@pytest.mark.parametrize("name", NEURON_CASES)
def test_reference_case_float64(name):
    run_reference_case(name, np.float64)


# ---- helpers for the focused tests ------------------------------------------------------------------------------

def _grad(text, x, params=(), phase=TEST, key=None):
    """d Σ top / d bottom (and d/d params) for a one-bottom layer."""
    ctx = layer_context(text, phase, key, num_tops=1)
    f = lambda x, ps: jnp.sum(get_rule(ctx.type).forward(ctx, [x], ps)[0])
    return jax.grad(f, argnums=(0, 1))(jnp.asarray(x), [jnp.asarray(p) for p in params])


# ---- Dropout ----------------------------------------------------------------------------------------------------

DROPOUT = 'name: "d" type: "Dropout" bottom: "x" top: "y" dropout_param { dropout_ratio: 0.3 }'


def test_dropout_train_keeps_expected_fraction_and_scales():
    x = jnp.ones((200, 500), jnp.float32)
    (y,) = layer_forward(DROPOUT, [x], phase=TRAIN, key=jax.random.key(7))
    kept = np.asarray(y) != 0
    assert abs(kept.mean() - 0.7) < 0.01
    np.testing.assert_allclose(np.asarray(y)[kept], 1 / (1 - np.float32(0.3)), rtol=1e-6)


def test_dropout_same_key_same_mask_and_gradient_uses_it():
    x = jax.random.normal(jax.random.key(1), (4, 3, 5, 5))
    (a,) = layer_forward(DROPOUT, [x], phase=TRAIN, key=jax.random.key(3))
    (b,) = layer_forward(DROPOUT, [x], phase=TRAIN, key=jax.random.key(3))
    (c,) = layer_forward(DROPOUT, [x], phase=TRAIN, key=jax.random.key(4))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a) != 0, np.asarray(c) != 0)
    gx, _ = _grad(DROPOUT, x, phase=TRAIN, key=jax.random.key(3))
    np.testing.assert_allclose(np.asarray(gx), np.where(np.asarray(a) != 0, 1 / (1 - np.float32(0.3)), 0), rtol=1e-6)


def test_dropout_bits_are_threefry_2x32_of_the_element_index():
    """random_words is JAX's Threefry-2x32 (word 0 of counter (i, 0)) under two words drawn from the key."""
    from jax.extend.random import threefry_2x32
    from caffejax.lower.neuron import random_words

    key = jax.random.key(11)
    words = np.asarray(random_words(key, (3, 5, 7)))
    k = jax.random.bits(key, (2,), jnp.uint32)
    index = jnp.arange(words.size, dtype=jnp.uint32)
    want = np.asarray(threefry_2x32(k, jnp.concatenate([index, jnp.zeros_like(index)])))[:words.size]
    np.testing.assert_array_equal(words.ravel(), want)
    assert np.asarray(random_words(jax.random.key(12), (3, 5, 7))).tolist() != words.tolist()


def test_dropout_bits_are_uniform():
    from caffejax.lower.neuron import random_words

    words = np.asarray(random_words(jax.random.key(5), (1 << 20,)))
    counts = np.bincount(words >> 24, minlength=256)  # top byte: chi-square with 255 degrees of freedom
    expected = words.size / 256
    assert ((counts - expected) ** 2 / expected).sum() < 350  # p ~ 1e-4
    bits = (words[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    np.testing.assert_allclose(bits.mean(axis=0), 0.5, atol=0.005)


@pytest.mark.parametrize("ratio", [0.0, 0.5, 0.9])
def test_dropout_keeps_one_minus_ratio(ratio):
    x = jnp.ones((1 << 20,), jnp.float32)
    layer = f'name: "d" type: "Dropout" bottom: "x" top: "y" dropout_param {{ dropout_ratio: {ratio} }}'
    (y,) = layer_forward(layer, [x], phase=TRAIN, key=jax.random.key(2))
    kept = np.asarray(y) != 0
    assert abs(kept.mean() - (1 - ratio)) < 0.003
    if ratio == 0:
        assert kept.all()


def test_dropout_test_phase_is_identity_without_key():
    x = jnp.arange(12.0).reshape(3, 4)
    (y,) = layer_forward(DROPOUT, [x], phase=TEST, key=None)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


def test_dropout_train_without_key_is_an_error():
    from caffejax.errors import CaffejaxError
    with pytest.raises(CaffejaxError, match="PRNG key"):
        layer_forward(DROPOUT, [jnp.ones((2, 2))], phase=TRAIN, key=None)


def test_dropout_is_jittable_with_key():
    lp = parse_layer(DROPOUT)
    f = jax.jit(lambda x, k: get_rule("Dropout").forward(LayerContext(lp, TRAIN, k), [x], [])[0])
    y = f(jnp.ones((10, 10)), jax.random.key(0))
    assert y.shape == (10, 10)


def test_dropout_bad_ratio():
    with pytest.raises(ShapeError, match="dropout_ratio"):
        layer_forward('name: "d" type: "Dropout" dropout_param { dropout_ratio: 1 }', [jnp.ones(3)], phase=TRAIN,
                      key=jax.random.key(0))


# ---- gradients at the kinks, as Caffe's hand-written backward --------------------------------------------------

X_KINKS = np.array([-1.0, 0.0, 2.0], np.float32)


def test_relu_gradient_at_zero_is_negative_slope():
    gx, _ = _grad('type: "ReLU" relu_param { negative_slope: 0.1 }', X_KINKS)
    np.testing.assert_allclose(np.asarray(gx), [0.1, 0.1, 1.0], rtol=1e-6)
    gx, _ = _grad('type: "ReLU"', X_KINKS)
    np.testing.assert_array_equal(np.asarray(gx), [0.0, 0.0, 1.0])


def test_relu_keeps_nan_and_bfloat16_values():
    """Caffe's max(x, 0) + slope·min(x, 0) propagates NaN; a plain ReLU (slope 0) keeps bfloat16 values as they
    are, without a product (a bfloat16 product is float32 math rounded back, see neuron.leaky)."""
    x = np.array([np.nan, -3.0, -0.0, 0.0, 2.5], np.float32)
    (y,) = layer_forward('type: "ReLU"', [x])
    np.testing.assert_array_equal(np.asarray(y), [np.nan, 0.0, 0.0, 0.0, 2.5])
    (y,) = layer_forward('type: "ReLU" relu_param { negative_slope: 0.5 }', [x])
    np.testing.assert_array_equal(np.asarray(y), [np.nan, -1.5, 0.0, 0.0, 2.5])
    xb = jnp.asarray(x, jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda v: layer_forward('type: "ReLU"', [v])[0])(xb)
    assert not any(eqn.primitive.name == "mul" for eqn in jaxpr.jaxpr.eqns)


def test_prelu_gradients_at_zero():
    x = np.array([[-1.0, 0.0, 2.0], [0.0, -3.0, 1.0]], np.float32)[:, :, None]  # (N=2, C=3, 1)
    slope = np.array([0.25, 0.5, 0.75], np.float32)
    gx, (gslope,) = _grad('type: "PReLU"', x, [slope])
    np.testing.assert_allclose(np.asarray(gx)[..., 0], [[0.25, 0.5, 1.0], [0.25, 0.5, 1.0]])
    np.testing.assert_allclose(np.asarray(gslope), [-1.0, -3.0, 0.0])  # Σ x·(x <= 0) per channel


def test_prelu_channel_shared_and_shapes():
    lp = parse_layer('name: "p" type: "PReLU" prelu_param { channel_shared: true }')
    assert get_rule("PReLU").param_shapes(lp, [(2, 3, 4)]) == [()]
    assert get_rule("PReLU").param_shapes(parse_layer('type: "PReLU"'), [(2, 3, 4)]) == [(3,)]
    (y,) = layer_forward('type: "PReLU" prelu_param { channel_shared: true }', [np.full((1, 2), -2.0)],
                         [np.float32(0.5)])
    np.testing.assert_array_equal(np.asarray(y), [[-1.0, -1.0]])
    with pytest.raises(ShapeError, match="at least 2 axes"):
        get_rule("PReLU").param_shapes(lp, [(5,)])
    with pytest.raises(ShapeError, match="expected 3"):
        layer_forward('type: "PReLU"', [np.ones((1, 3, 2))], [np.ones(2)])


def test_prelu_default_filler_is_quarter():
    pytest.importorskip("caffejax.lower.fillers")
    lp = parse_layer('type: "PReLU"')
    (a,) = get_rule("PReLU").init_params(lp, [(3,)], jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(a), [0.25, 0.25, 0.25])


def test_elu_gradient_at_zero_is_alpha():
    gx, _ = _grad('type: "ELU" elu_param { alpha: 0.7 }', X_KINKS)
    np.testing.assert_allclose(np.asarray(gx), [0.7 * np.exp(-1.0), 0.7, 1.0], rtol=1e-6)


def test_bnll_gradient_at_zero_and_large_inputs_finite():
    x = np.array([-200.0, 0.0, 200.0], np.float32)
    (y,) = layer_forward('type: "BNLL"', [x])
    np.testing.assert_allclose(np.asarray(y), [0.0, np.log(2.0), 200.0], rtol=1e-6)
    gx, _ = _grad('type: "BNLL"', x)
    np.testing.assert_allclose(np.asarray(gx), [0.0, 0.5, 1.0], atol=1e-7)


def test_absval_gradient_at_zero_is_zero():
    gx, _ = _grad('type: "AbsVal"', X_KINKS)
    np.testing.assert_array_equal(np.asarray(gx), [-1.0, 0.0, 1.0])
    assert not get_rule("AbsVal").in_place


def test_clip_gradient_on_closed_interval():
    x = np.array([-0.6, -0.5, 0.0, 0.7, 0.8], np.float32)
    text = 'type: "Clip" clip_param { min: -0.5 max: 0.7 }'
    (y,) = layer_forward(text, [x])
    np.testing.assert_allclose(np.asarray(y), [-0.5, -0.5, 0.0, 0.7, 0.7])
    gx, _ = _grad(text, x)
    np.testing.assert_array_equal(np.asarray(gx), [0.0, 1.0, 1.0, 1.0, 0.0])


def test_threshold_has_no_gradient():
    x = np.array([0.1, 0.2, 0.3], np.float32)
    (y,) = layer_forward('type: "Threshold" threshold_param { threshold: 0.2 }', [x])
    np.testing.assert_array_equal(np.asarray(y), [0.0, 0.0, 1.0])
    gx, _ = _grad('type: "Threshold" threshold_param { threshold: 0.2 }', x)
    np.testing.assert_array_equal(np.asarray(gx), [0.0, 0.0, 0.0])


# ---- Power / Exp / Log parameters ------------------------------------------------------------------------------

@pytest.mark.parametrize("text, value", [
    ('power_param { power: 0 scale: 3 shift: 2 }', 1.0),    # power 0: constant 1
    ('power_param { power: 3 scale: 0 shift: 2 }', 8.0),    # scale 0: shift^power
])
def test_power_constant_case_has_zero_gradient(text, value):
    x = np.array([-1.0, 0.0, 2.0], np.float32)
    (y,) = layer_forward(f'type: "Power" {text}', [x])
    np.testing.assert_array_equal(np.asarray(y), [value] * 3)
    gx, _ = _grad(f'type: "Power" {text}', x)
    np.testing.assert_array_equal(np.asarray(gx), [0.0, 0.0, 0.0])


def test_power_one_and_two():
    x = np.array([-1.0, 0.0, 2.0], np.float32)
    gx, _ = _grad('type: "Power" power_param { power: 1 scale: -2 shift: 1 }', x)
    np.testing.assert_array_equal(np.asarray(gx), [-2.0, -2.0, -2.0])
    (y,) = layer_forward('type: "Power" power_param { power: 2 scale: 0.5 shift: 1 }', [x])
    np.testing.assert_allclose(np.asarray(y), (0.5 * x + 1) ** 2)
    gx, _ = _grad('type: "Power" power_param { power: 2 scale: 0.5 shift: 1 }', x)
    np.testing.assert_allclose(np.asarray(gx), 2 * 0.5 * (0.5 * x + 1))


def test_exp_and_log_natural_base_defaults():
    x = np.array([0.5, 1.0, 2.0], np.float32)
    (y,) = layer_forward('type: "Exp"', [x])
    np.testing.assert_allclose(np.asarray(y), np.exp(x), rtol=1e-6)
    (y,) = layer_forward('type: "Log"', [x])
    np.testing.assert_allclose(np.asarray(y), np.log(x), rtol=1e-6)


def test_exp_log_bad_base():
    with pytest.raises(ShapeError, match="strictly positive"):
        layer_forward('type: "Exp" exp_param { base: -2 }', [np.ones(2)])
    with pytest.raises(ShapeError, match="strictly positive"):
        layer_forward('type: "Log" log_param { base: 0 }', [np.ones(2)])
    with pytest.raises(ShapeError, match="log\\(base\\) = 0"):
        layer_forward('type: "Log" log_param { base: 1 }', [np.ones(2)])


def test_neuron_rules_are_one_bottom_one_top_and_eval_shape_safe():
    for t in ["AbsVal", "BNLL", "Clip", "Dropout", "ELU", "Exp", "Log", "Power", "PReLU", "ReLU", "Sigmoid",
              "Swish", "TanH", "Threshold"]:
        rule = get_rule(t)
        assert (rule.bottoms, rule.tops) == ((1, 1), (1, 1)), t
        lp = parse_layer(f'name: "l" type: "{t}"')
        params = [jax.ShapeDtypeStruct(s, jnp.float32) for s in rule.param_shapes(lp, [(2, 3, 4)])]
        out = jax.eval_shape(lambda x, ps: rule.forward(LayerContext(lp, TRAIN, jax.random.key(0)), [x], ps),
                             jax.ShapeDtypeStruct((2, 3, 4), jnp.float32), params)
        assert [(o.shape, o.dtype) for o in out] == [((2, 3, 4), jnp.float32)], t
