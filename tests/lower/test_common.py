"""Common layer rules against BVLC Caffe's reference figures, plus the semantics the figures do not pin down."""

from __future__ import annotations

import functools

import caffejax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from caffejax.errors import CaffejaxError, ShapeError
from caffejax.lower.registry import TEST, TRAIN, LayerContext, get_rule
from rule_harness import assert_rejects, layer_context, layer_forward, layer_vjp, parse_layer, run_reference_case

# ---- the reference cases (float32 through the Net: tests/test_reference.py) ------------------------------------

COMMON_CASES = ["argmax", "argmax_outmax_axis", "accuracy_topk_ignore", "batchnorm_default_test",
                "batchnorm_global", "batchnorm_train", "batch_reindex", "bias", "scale_axis0_numaxes",
                "scale_bias", "scale_two_bottoms", "concat", "concat_axis0", "eltwise_max", "eltwise_prod",
                "eltwise_sum_coeff", "embed", "filter", "flatten", "flatten_axes", "inner_product",
                "inner_product_axis2", "inner_product_transpose", "mvn", "mvn_across_nomean", "parameter",
                "reduction_all_scalar_loss", "reduction_asum", "reduction_mean", "reduction_sum",
                "reduction_sumsq", "reshape", "reshape_axis", "slice", "slice_even", "softmax", "softmax_axis2",
                "split", "tile"]


@pytest.mark.parametrize("name", COMMON_CASES)
def test_reference_case_float64(name):
    run_reference_case(name, np.float64)


# ---- ArgMax, Accuracy -------------------------------------------------------------------------------------------

def test_argmax_ties_go_to_the_higher_index():
    x = np.array([[1, 3, 3, 0, 3]], np.float32)
    (y,) = layer_forward('type: "ArgMax" argmax_param { top_k: 4 out_max_val: true }', [x])
    assert y.shape == (1, 2, 4)
    np.testing.assert_array_equal(y[0, 0], [4, 2, 1, 0])
    np.testing.assert_array_equal(y[0, 1], [3, 3, 3, 1])


def test_argmax_shape_without_axis_keeps_trailing_ones_and_axis_replaces_dim():
    x = jnp.zeros((2, 3, 4, 5))
    assert layer_forward('type: "ArgMax" argmax_param { top_k: 3 }', [x])[0].shape == (2, 1, 3, 1)
    assert layer_forward('type: "ArgMax" argmax_param { top_k: 2 axis: -1 }', [x])[0].shape == (2, 3, 4, 2)


def test_argmax_rejects_top_k_beyond_the_axis():
    assert_rejects('name: "a" type: "ArgMax" argmax_param { top_k: 4 axis: 1 }', [jnp.zeros((2, 3))], match="top_k")


ACCURACY = 'type: "Accuracy" bottom: "x" bottom: "t" top: "a" top: "pc" accuracy_param { top_k: 2 ignore_label: 9 }'


def test_accuracy_counts_ties_with_the_true_score_against_it():
    # Three classes tie with the true class at the top: #{>= true} = 3 > top_k 2, so it is wrong.
    x = np.array([[1, 1, 1, 0], [0, 5, 1, 1]], np.float32)
    a, pc = layer_forward(ACCURACY, [x, np.array([0, 1], np.float32)])
    assert float(a) == 0.5
    np.testing.assert_array_equal(pc, [0, 1, 0, 0])
    (a, _) = layer_forward(ACCURACY, [x, np.array([3, 2], np.float32)])  # row 1: #{>= 1} = 3 > 2 as well
    assert float(a) == 0


def test_accuracy_ignore_label_and_zero_count():
    x = np.eye(3, dtype=np.float32)
    a, pc = layer_forward(ACCURACY, [x, np.array([9, 9, 9], np.float32)])
    assert float(a) == 0 and not np.any(pc)
    a, pc = layer_forward(ACCURACY, [x, np.array([0, 9, 1], np.float32)])
    assert float(a) == 0.5  # row 2: the true class scores 0, and 3 classes score >= 0 > top_k
    np.testing.assert_array_equal(pc, [1, 0, 0])


def test_accuracy_spatial_axis():
    x = np.zeros((1, 3, 2), np.float32)
    x[0, 2, 0] = x[0, 0, 1] = 1
    (a,) = layer_forward('type: "Accuracy" top: "a"', [x, np.array([[2, 1]], np.float32)])
    assert float(a) == 0.5


# ---- BatchNorm --------------------------------------------------------------------------------------------------

BN = 'name: "bn" type: "BatchNorm" batch_norm_param { use_global_stats: false moving_average_fraction: 0.5 }'
BN_GLOBAL = 'name: "bn" type: "BatchNorm" batch_norm_param { use_global_stats: true }'


def test_batch_norm_train_updates_running_sums_like_caffe():
    x = np.random.RandomState(0).randn(2, 3, 2, 2).astype(np.float32)
    ctx = layer_context(BN, TRAIN)
    blobs = [jnp.ones(3), jnp.full(3, 2.0), jnp.array([4.0])]
    get_rule("BatchNorm").forward(ctx, [jnp.asarray(x)], blobs)
    mean = x.mean(axis=(0, 2, 3))
    var = x.var(axis=(0, 2, 3))
    m = x.size // 3
    np.testing.assert_allclose(ctx.param_updates[0], 0.5 * 1 + mean, rtol=1e-6)
    np.testing.assert_allclose(ctx.param_updates[1], 0.5 * 2 + m / (m - 1) * var, rtol=1e-5)
    np.testing.assert_allclose(ctx.param_updates[2], [0.5 * 4 + 1])


@pytest.mark.parametrize("shape", [(4, 3, 5, 2), (40, 3), (3, 2, 4)])
def test_batch_norm_batch_stats_backward_is_the_derivative_of_its_forward(shape):
    """BatchNorm with batch statistics is differentiated by Caffe's formula (a written-out backward); in
    float64 it is JAX's own derivative of (x - mean) / sqrt(var + eps), for 2-D, 3-D and 4-D bottoms (the 2-D
    one is how channels-last programs see a 4-D blob)."""
    rng = np.random.default_rng(4)
    with jax.enable_x64(True):
        x = jnp.asarray(rng.normal(2.0, 3.0, shape))
        dy = jnp.asarray(rng.normal(size=shape))
        axes = (0,) + tuple(range(2, len(shape)))

        def plain(x):
            mean = jnp.mean(x, axis=axes, keepdims=True)
            return (x - mean) / jnp.sqrt(jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True) + 0.25)

        def rule(x):
            ctx = layer_context(BN.replace("moving_average_fraction", "eps: 0.25 moving_average_fraction"), TRAIN)
            return get_rule("BatchNorm").forward(ctx, [x], [jnp.zeros(shape[1]), jnp.zeros(shape[1]),
                                                          jnp.zeros(1)])[0]

        y, vjp = jax.vjp(rule, x)
        want_y, want_vjp = jax.vjp(plain, x)
        np.testing.assert_allclose(y, want_y, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(vjp(dy)[0], want_vjp(dy)[0], rtol=1e-10, atol=1e-12)
        # Shifting a channel's inputs changes nothing: its input gradient sums to 0.
        np.testing.assert_allclose(jnp.sum(vjp(dy)[0], axis=axes), 0, atol=1e-10)


def test_batch_norm_global_stats_with_zero_factor_uses_zero_statistics():
    x = np.random.RandomState(1).randn(2, 3, 4).astype(np.float32)
    (y,) = layer_forward('type: "BatchNorm" batch_norm_param { eps: 0.25 }', [x], [np.ones(3), np.ones(3), [0.0]])
    np.testing.assert_allclose(y, x / np.sqrt(0.25), rtol=1e-6)
    (y,) = layer_forward('type: "BatchNorm" batch_norm_param { eps: 0 }', [x], [[2.0, 4, 6], [8.0, 8, 8], [2.0]])
    np.testing.assert_allclose(y, (x - np.array([1, 2, 3])[:, None]) / 2, rtol=1e-6)


def test_batch_norm_global_stats_give_no_gradient_to_the_blobs():
    x = np.ones((2, 3), np.float32)
    _, _, (d_mean, d_var, d_factor) = layer_vjp('type: "BatchNorm"', [x], [np.ones((2, 3))],
                                                [np.ones(3), np.ones(3), [2.0]])
    assert not np.any(d_mean) and not np.any(d_var) and not np.any(d_factor)


def test_batch_norm_global_stats_gradient_keeps_its_broadcast_inside_the_product():
    """A product followed by BatchNorm with global statistics, differentiated: XLA does not write the
    per-channel factor out as a full tensor for the product's fusion, and the input gradient is
    dy / sqrt(var + eps) through the product."""
    from caffejax.runtime.xla_options import YNN_DOT_AND_REDUCE, YNN_OPTION

    ctx = layer_context(BN_GLOBAL, TRAIN)
    rng = np.random.default_rng(3)
    x, w, upstream = (jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in [(1024, 16), (32, 16), (1024, 32)])
    blobs = [jnp.asarray(rng.normal(size=32), jnp.float32), jnp.asarray(rng.uniform(1, 2, 32), jnp.float32),
             jnp.ones(1)]

    def loss(x, w):
        (y,) = get_rule("BatchNorm").forward(ctx, [x @ w.T], blobs)
        return jnp.sum(jnp.maximum(y, 0) * upstream)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), compiler_options={YNN_OPTION: YNN_DOT_AND_REDUCE})
    assert "wrapped_broadcast" not in grad.lower(x, w).compile().as_text()
    (y,) = get_rule("BatchNorm").forward(ctx, [x @ w.T], blobs)
    want = (jnp.where(y > 0, upstream, 0) / jnp.sqrt(blobs[1] + 1e-5)) @ w
    np.testing.assert_allclose(grad(x, w)[0], want, rtol=1e-4, atol=1e-4)


def test_batch_norm_rejects_learnable_statistics():
    lp = parse_layer('name: "bn" type: "BatchNorm" param { lr_mult: 1 }')
    with pytest.raises(CaffejaxError, match="lr_mult"):
        get_rule("BatchNorm").param_shapes(lp, [(2, 3)])
    lp = parse_layer('name: "bn" type: "BatchNorm" param { lr_mult: 1 } param { lr_mult: 1 } param { lr_mult: 1 }')
    assert get_rule("BatchNorm").param_shapes(lp, [(2, 3, 4)]) == [(3,), (3,), (1,)]


# ---- BatchReindex, Filter, Embed --------------------------------------------------------------------------------

def test_batch_reindex_gradient_scatter_adds():
    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    index = np.array([1, 1, 3, 0, 1.7], np.float32)  # static_cast<int>(1.7) == 1
    (y,) = layer_forward('type: "BatchReindex"', [x, index])
    np.testing.assert_array_equal(y, x[[1, 1, 3, 0, 1]])
    _, (dx, di), _ = layer_vjp('type: "BatchReindex"', [x, index], [np.ones((5, 2))])
    np.testing.assert_array_equal(dx, [[1, 1], [3, 3], [0, 0], [1, 1]])
    assert not np.any(di)


def test_batch_reindex_out_of_range_index_gives_nan():
    (y,) = layer_forward('type: "BatchReindex"', [np.ones((2, 3)), np.array([0, 2, -1], np.float32)])
    assert not np.isnan(y[0]).any() and np.isnan(y[1:]).all()


FILTER = 'name: "f" type: "Filter" bottom: "a" bottom: "b" bottom: "s" top: "fa" top: "fb"'


def test_filter_selects_rows_and_routes_gradient_back():
    a = np.arange(10, dtype=np.float32).reshape(5, 2)
    b = np.arange(5, dtype=np.float32)
    s = np.array([[0], [2], [0], [-1], [0.5]], np.float32)
    fa, fb = layer_forward(FILTER, [a, b, s])
    np.testing.assert_array_equal(fa, a[[1, 3, 4]])
    np.testing.assert_array_equal(fb, b[[1, 3, 4]])
    ctx = layer_context(FILTER)
    # The selector must stay concrete: it enters as a constant, only the filtered bottoms are traced.
    _, vjp = jax.vjp(lambda a, b: get_rule("Filter").forward(ctx, [a, b, jnp.asarray(s)], []), a, b)
    da, db = vjp([jnp.full((3, 2), 2.0, jnp.float32), jnp.ones(3, jnp.float32)])
    np.testing.assert_array_equal(da, [[0, 0], [2, 2], [0, 0], [2, 2], [2, 2]])
    np.testing.assert_array_equal(db, [0, 1, 0, 1, 1])
    assert not get_rule("Filter").allow_force_backward(ctx.layer, 2)


def test_filter_needs_a_concrete_selector():
    lp = parse_layer('name: "f" type: "Filter" top: "y"')
    ctx = LayerContext(layer=lp, phase=TEST, num_tops=1)
    with pytest.raises(ShapeError, match="concrete"):
        jax.eval_shape(lambda x, s: get_rule("Filter").forward(ctx, [x, s], []),
                       jax.ShapeDtypeStruct((4, 2), jnp.float32), jax.ShapeDtypeStruct((4,), jnp.float32))


def test_filter_rejects_non_singleton_selector():
    assert_rejects('name: "f" type: "Filter" top: "y"', [np.ones((4, 2)), np.ones((4, 2))], match="singleton")


def test_embed_has_no_input_gradient_and_scatter_adds_into_weights():
    lp = 'type: "Embed" embed_param { num_output: 2 input_dim: 3 }'
    w = np.arange(6, dtype=np.float32).reshape(3, 2)
    x = np.array([[2, 0], [2, 2]], np.float32)
    (y,) = layer_forward(lp, [x], [w, [10.0, 20.0]])
    np.testing.assert_array_equal(y, w[[[2, 0], [2, 2]]] + [10, 20])
    _, (dx,), (dw, db) = layer_vjp(lp, [x], [np.ones((2, 2, 2))], [w, [10.0, 20.0]])
    assert not np.any(dx)
    np.testing.assert_array_equal(dw, [[1, 1], [0, 0], [3, 3]])
    np.testing.assert_array_equal(db, [4, 4])


# ---- Bias, Scale --------------------------------------------------------------------------------------------------

def test_scale_param_shapes_follow_scale_layer_setup():
    shapes = lambda text, bottoms: get_rule("Scale").param_shapes(parse_layer(text), bottoms)
    assert shapes('type: "Scale"', [(2, 3, 4)]) == [(3,)]
    both = 'type: "Scale" scale_param { axis: -2 num_axes: -1 bias_term: true }'
    assert shapes(both, [(2, 3, 4)]) == [(3, 4), (3, 4)]
    assert shapes('type: "Scale" scale_param { num_axes: 0 bias_term: true }', [(2, 3)]) == [(), ()]
    assert shapes('type: "Scale" scale_param { bias_term: true }', [(2, 3, 4), (3, 4)]) == [(3, 4)]
    assert shapes('type: "Scale"', [(2, 3, 4), (3,)]) == []
    bias = parse_layer('type: "Bias" bias_param { axis: 0 num_axes: 2 }')
    assert get_rule("Bias").param_shapes(bias, [(2, 3, 4)]) == [(2, 3)]
    with pytest.raises(CaffejaxError):
        shapes('name: "s" type: "Scale" scale_param { axis: 2 num_axes: 2 }', [(2, 3, 4)])


def test_scale_defaults_to_unit_init_and_bias_to_zero():
    lp = parse_layer('type: "Scale" scale_param { bias_term: true }')
    scale, bias = get_rule("Scale").init_params(lp, [(3,), (3,)], jax.random.key(0))
    np.testing.assert_array_equal(scale, np.ones(3))
    np.testing.assert_array_equal(bias, np.zeros(3))


def test_scale_scalar_bottom_applies_from_axis_zero():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    (y,) = layer_forward('type: "Scale" scale_param { axis: 1 }', [x, np.float32(3)])
    np.testing.assert_array_equal(y, 3 * x)
    _, (dx, ds), _ = layer_vjp('type: "Scale"', [x, np.float32(3)], [np.ones((2, 3))])
    assert float(ds) == x.sum()


def test_scale_second_bottom_shape_must_match():
    assert_rejects('name: "s" type: "Scale"', [np.ones((2, 3, 4)), np.ones((4,))], match="does not match")


def test_bias_two_bottoms():
    x = np.zeros((2, 3, 4), np.float32)
    (y,) = layer_forward('type: "Bias" bias_param { axis: -2 }', [x, np.arange(12, dtype=np.float32).reshape(3, 4)])
    np.testing.assert_array_equal(y[1], np.arange(12).reshape(3, 4))


# ---- Concat, Slice, Split, Tile, Silence --------------------------------------------------------------------------

def test_concat_legacy_dim_and_conflicts():
    a, b = np.ones((2, 3)), np.zeros((2, 1))
    (y,) = layer_forward('type: "Concat" concat_param { concat_dim: 1 }', [a, b])
    assert y.shape == (2, 4)
    assert_rejects('name: "c" type: "Concat" concat_param { concat_dim: 1 axis: 1 }', [a, b], match="not both")
    assert_rejects('name: "c" type: "Concat"', [a, np.zeros((3, 1))], match="same shape")


def test_slice_points_and_checks():
    x = np.arange(6, dtype=np.float32)
    three = 'type: "Slice" top: "a" top: "b" top: "c" slice_param '
    tops = layer_forward(three + '{ axis: 0 slice_point: 1 slice_point: 4 }', [x])
    assert [t.tolist() for t in tops] == [[0], [1, 2, 3], [4, 5]]
    tops = layer_forward(three + '{ slice_dim: 0 }', [x])
    assert [t.shape for t in tops] == [(2,), (2,), (2,)]
    assert_rejects('name: "s" type: "Slice" top: "a" top: "b" slice_param { axis: 0 slice_point: 3 slice_point: 4 }',
                   [x], match="slice_point")
    assert_rejects('name: "s" type: "Slice" top: "a" top: "b" top: "c" '
                   'slice_param { axis: 0 slice_point: 3 slice_point: 3 }', [x], match="increasing")
    assert_rejects('name: "s" type: "Slice" top: "a" top: "b" top: "c" top: "d" slice_param { axis: 0 }', [x],
                   match="evenly")


def test_tile_is_a_block_repeat():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    (y,) = layer_forward('type: "Tile" tile_param { axis: 0 tiles: 2 }', [x])
    np.testing.assert_array_equal(y, np.tile(x, (2, 1)))
    (y,) = layer_forward('type: "Tile" tile_param { tiles: 2 }', [x])
    np.testing.assert_array_equal(y, [[0, 1, 2, 0, 1, 2], [3, 4, 5, 3, 4, 5]])
    assert_rejects('name: "t" type: "Tile"', [x], match="tiles")


def test_silence_has_no_tops():
    assert layer_forward('type: "Silence" bottom: "x"', [np.ones(3)], num_tops=0) == []


# ---- Eltwise ------------------------------------------------------------------------------------------------------

MAX3 = 'type: "Eltwise" eltwise_param { operation: MAX }'


def test_eltwise_max_tie_rule_routes_gradient_to_one_winner():
    a = np.array([1, 2, 3, 5], np.float32)
    b = np.array([1, 2, 0, 5], np.float32)
    c = np.array([0, 2, 3, 6], np.float32)
    (y,) = layer_forward(MAX3, [a, b, c])
    np.testing.assert_array_equal(y, [1, 2, 3, 6])
    _, (da, db, dc), _ = layer_vjp(MAX3, [a, b, c], [np.ones(4)])
    np.testing.assert_array_equal(da, [0, 0, 1, 0])  # tie 0-1 -> bottom 1; tie with bottom 2 keeps the earlier
    np.testing.assert_array_equal(db, [1, 1, 0, 0])
    np.testing.assert_array_equal(dc, [0, 0, 0, 1])


def test_eltwise_prod_gradients_stable_and_quotient():
    a = np.array([0.0, 2.0], np.float32)
    b = np.array([3.0, 4.0], np.float32)
    _, (da, db), _ = layer_vjp('type: "Eltwise" eltwise_param { operation: PROD }', [a, b], [np.ones(2)])
    np.testing.assert_array_equal(da, [3, 4])
    np.testing.assert_array_equal(db, [0, 2])
    quotient = 'type: "Eltwise" eltwise_param { operation: PROD stable_prod_grad: false }'
    _, (da, db), _ = layer_vjp(quotient, [a, b], [np.ones(2)])
    assert np.isnan(da[0]) and da[1] == 4  # top / a: 0 / 0 as in Caffe's caffe_div
    np.testing.assert_array_equal(db, [0, 2])


def test_eltwise_config_errors():
    a = np.ones(2)
    assert_rejects('name: "e" type: "Eltwise" eltwise_param { coeff: 1 }', [a, a], match="one coefficient")
    assert_rejects('name: "e" type: "Eltwise" eltwise_param { operation: PROD coeff: 1 coeff: 2 }', [a, a],
                   match="summation")
    assert_rejects('name: "e" type: "Eltwise"', [a, np.ones(3)], match="differ")


# ---- Flatten, Reshape, InnerProduct -------------------------------------------------------------------------------

def test_reshape_rules():
    x = jnp.zeros((2, 3, 4))
    shape = lambda text: layer_forward(f'name: "r" type: "Reshape" reshape_param {{ {text} }}', [x])[0].shape
    assert shape('shape { dim: 0 dim: -1 }') == (2, 12)
    assert shape('shape { dim: 2 dim: 2 } axis: 2') == (2, 3, 2, 2)
    assert shape('shape { dim: 1 } axis: -1 num_axes: 0') == (2, 3, 4, 1)  # -1 means ndim + axis + 1 = 3
    assert shape('shape { dim: 6 } axis: 0 num_axes: 2') == (6, 4)
    assert shape('shape { } axis: 1 num_axes: 0') == (2, 3, 4)
    for bad, match in [('shape { dim: -1 dim: -1 }', "multiple -1"), ('shape { dim: 5 dim: -1 }', "divisible"),
                       ('shape { dim: 7 }', "count"), ('shape { dim: 0 } axis: 3', "no bottom axis"),
                       ('shape { dim: 1 } axis: -5', "out of range")]:
        with pytest.raises(ShapeError, match=match):
            shape(bad)
    assert not get_rule("Reshape").in_place and not get_rule("Flatten").in_place and not get_rule("Split").in_place


def test_flatten_axes():
    x = jnp.zeros((2, 3, 4, 5))
    assert layer_forward('type: "Flatten" flatten_param { axis: -3 end_axis: 2 }', [x])[0].shape == (2, 12, 5)
    assert layer_forward('type: "Flatten" flatten_param { axis: 0 }', [x])[0].shape == (120,)


def test_inner_product_rejects_mismatched_weights():
    assert_rejects('name: "ip" type: "InnerProduct" inner_product_param { num_output: 2 bias_term: false }',
                   [np.ones((2, 3))], [np.ones((2, 4))], match="incompatible")


@pytest.mark.parametrize("transpose", [False, True])
def test_inner_product_gradients_at_one_row_are_the_products(transpose):
    """One row (batch 1): the rule's own backward gives the gradients of x W^T + b (x W with transpose),
    summed in float32 as at more rows."""
    rng = np.random.default_rng(6)
    x, dy = rng.standard_normal((1, 2, 3, 4)), rng.standard_normal((1, 5))
    w, b = rng.standard_normal((24, 5) if transpose else (5, 24)), rng.standard_normal(5)
    ip = f'type: "InnerProduct" inner_product_param {{ num_output: 5 transpose: {str(transpose).lower()} }}'
    (y,), (dx,), (dw, db) = layer_vjp(ip, [x.astype(np.float32)], [dy], [w.astype(np.float32), b.astype(np.float32)])
    rows = x.reshape(1, 24)
    np.testing.assert_allclose(y, rows @ (w if transpose else w.T) + b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, (dy @ (w.T if transpose else w)).reshape(x.shape), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, rows.T @ dy if transpose else dy.T @ rows, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(db, dy[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("outputs, inputs", [(64, 128), (512, 512)])  # a small weight; one of FEW_ROWS_MIN_WEIGHT
def test_inner_product_weight_gradient_at_one_row_is_one_product_of_finished_vectors(outputs, inputs):
    """Behind Dropout at batch 1, the weight gradient stays a dot in the compiled program: XLA's rewrite of a
    product over one row as a broadcast multiply had fused the Dropout mask's Threefry rounds into every
    element of the N x K gradient (AlexNet's training step at batch 1: 437-506 -> 256-263 ms). So too where
    the row multiplies a big weight as W x^T (common.FEW_ROWS)."""
    drop = layer_context('type: "Dropout" dropout_param { dropout_ratio: 0.5 }', TRAIN, key=jax.random.key(0))
    ip = layer_context(f'type: "InnerProduct" inner_product_param {{ num_output: {outputs} }}')

    def loss(x, w, b):
        (h,) = get_rule("Dropout").forward(drop, [x], [])
        (y,) = get_rule("InnerProduct").forward(ip, [h], [w, b])
        return jnp.sum(y * y)

    args = tuple(jnp.ones(shape, jnp.float32) for shape in [(1, inputs), (outputs, inputs), (outputs,)])
    hlo = jax.jit(jax.grad(loss, argnums=1)).lower(*args).compile().as_text()
    weight_gradient_dots = [line for line in hlo.splitlines()
                            if " dot(" in line and line.strip().split(" = ")[1].startswith(f"f32[{outputs},{inputs}]")]
    assert weight_gradient_dots, "the weight gradient was not computed as a product"


def test_inner_product_and_softmax_on_bfloat16_sum_in_float32_and_round_once():
    """bfloat16 values (compile_inference's bf16 mode): the product and bias summed in float32 and the top
    rounded once, as the float32 rule on the same values; Softmax's exponentials summed in float32 too."""
    rng = np.random.default_rng(5)
    x, w, b = (np.asarray(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16))
               for shape in [(4, 2048), (6, 2048), (6,)])
    ip = 'type: "InnerProduct" inner_product_param { num_output: 6 }'
    (y,) = layer_forward(ip, [x], [w, b])
    (wide,) = layer_forward(ip, [x.astype(np.float32)], [w.astype(np.float32), b.astype(np.float32)])
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(wide.astype(jnp.bfloat16), np.float32))
    # 1000 classes, one far ahead: in bfloat16 arithmetic the others' exponentials would vanish from the sum
    logits = np.array(jnp.asarray(rng.standard_normal((2, 1000)), jnp.bfloat16))
    logits[:, 0] = 6
    (p,) = layer_forward('type: "Softmax"', [logits])
    (p32,) = layer_forward('type: "Softmax"', [logits.astype(np.float32)])
    assert p.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(p, np.float32), np.asarray(p32.astype(jnp.bfloat16), np.float32))


@pytest.mark.parametrize("transpose", [False, True])
def test_one_bfloat16_row_times_the_weight_stays_a_bfloat16_product(transpose):
    """At one row, a bfloat16 InnerProduct gives the float32 rule's value rounded once, and on the CPU its
    compiled program never converts the weight to float32 (XLA's matrix-vector form did, on every call)."""
    rng = np.random.default_rng(8)
    x, w, b = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
               for shape in [(1, 256), (256, 48) if transpose else (48, 256), (48,)])
    ip = layer_context('type: "InnerProduct" inner_product_param '
                       f'{{ num_output: 48 transpose: {str(transpose).lower()} }}')
    forward = jax.jit(lambda x, w, b: get_rule("InnerProduct").forward(ip, [x], [w, b])[0])
    y = forward(x, w, b)
    (wide,) = get_rule("InnerProduct").forward(ip, [x.astype(jnp.float32)], [w.astype(jnp.float32),
                                                                             b.astype(jnp.float32)])
    assert y.dtype == jnp.bfloat16 and y.shape == (1, 48)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(wide.astype(jnp.bfloat16), np.float32))
    if jax.default_backend() == "cpu":
        hlo = forward.lower(x, w, b).compile().as_text()
        weight = "f32[256,48]" if transpose else "f32[48,256]"
        assert not [line for line in hlo.splitlines() if " = " in line and line.split(" = ")[1].startswith(weight)]


def _inner_product_forward(num_output, transpose=False):
    ip = layer_context('type: "InnerProduct" inner_product_param '
                       f'{{ num_output: {num_output} transpose: {str(transpose).lower()} }}')
    return lambda x, w, b: get_rule("InnerProduct").forward(ip, [x], [w, b])[0]


def _dot_outputs(function, *args) -> list[str]:
    """The shapes of the dot products in the compiled program (e.g. ``f32[500,16]``)."""
    hlo = jax.jit(function).lower(*args).compile().as_text()
    return [line.split(" = ")[1].split("{")[0] for line in hlo.splitlines()
            if " dot(" in line and " = " in line]


def _assert_hessian_vector_products_are_the_plain_products(forward, x, w, b, rng):
    """Forward-over-reverse through ``forward`` (an InnerProduct's x W^T + b) gives the plain product's
    Hessian-vector product of sum(tanh(.)^2) in the weight, along a random tangent drawn from ``rng``."""
    from caffejax.lower import common

    def loss(product, w):  # scaled so that tanh is not saturated: its curvature is then well conditioned
        return jnp.sum(jnp.tanh(product(x, w / 30, b)) ** 2)

    def plain(x, w, b):
        return common.matmul_bt(x, w) + b

    tangent = jnp.asarray(rng.standard_normal(w.shape), jnp.float32)
    _, hvp = jax.jvp(jax.grad(functools.partial(loss, forward)), (w,), (tangent,))
    _, plain_hvp = jax.jvp(jax.grad(functools.partial(loss, plain)), (w,), (tangent,))
    np.testing.assert_allclose(hvp, plain_hvp, rtol=1e-3, atol=1e-3 * float(jnp.max(jnp.abs(plain_hvp))))


def test_few_rows_times_a_big_weight_keep_the_weight_on_the_left():
    """16 rows times a 500 x 800 weight: Caffe's x W^T + b, its gradients the plain product's (bias, rows and
    weight), and forward-over-reverse works; on the CPU the program multiplies W x^T (the weight is not the
    factor YNNPACK packs), and so with more than MANY_ROWS rows, while a transposed weight, bfloat16 values,
    FEW_ROWS to MANY_ROWS rows and a small weight keep x W^T."""
    from caffejax.lower import common

    rng = np.random.default_rng(9)
    x, w, b = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in [(16, 800), (500, 800), (500,)])
    forward = _inner_product_forward(500)
    y = forward(x, w, b)
    np.testing.assert_allclose(y, np.asarray(x, np.float64) @ np.asarray(w, np.float64).T + np.asarray(b),
                               rtol=1e-5, atol=1e-4)
    def plain(x, w, b):
        return common.matmul_bt(x, w) + b

    dy = jnp.asarray(rng.standard_normal((16, 500)), jnp.float32)
    grads = jax.vjp(forward, x, w, b)[1](dy)
    for got, want in zip(grads, jax.vjp(plain, x, w, b)[1](dy)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)

    _assert_hessian_vector_products_are_the_plain_products(forward, x, w, b, rng)
    if jax.default_backend() != "cpu":
        return
    assert _dot_outputs(forward, x, w, b) == ["f32[500,16]"]
    assert _dot_outputs(forward, x[:1], w, b) == ["f32[500,1]"]  # one row too
    rows = jnp.asarray(rng.standard_normal((common.FEW_ROWS + 1, 800)), jnp.float32)
    assert _dot_outputs(forward, rows, w, b) == [f"f32[{common.FEW_ROWS + 1},500]"]
    many = jnp.asarray(rng.standard_normal((common.MANY_ROWS + 44, 800)), jnp.float32)  # 300 ROIs of a head
    assert _dot_outputs(forward, many, w, b) == [f"f32[500,{common.MANY_ROWS + 44}]"]
    np.testing.assert_allclose(forward(many, w, b), np.asarray(many, np.float64) @ np.asarray(w, np.float64).T
                               + np.asarray(b), rtol=1e-5, atol=1e-4)
    assert _dot_outputs(_inner_product_forward(500, transpose=True), x, w.T, b) == ["f32[16,500]"]
    small = jnp.asarray(rng.standard_normal((40, 800)), jnp.float32)
    assert _dot_outputs(_inner_product_forward(40), x, small, b[:40]) == ["f32[16,40]"]
    x16, w16, b16 = (a.astype(jnp.bfloat16) for a in (x, w, b))
    assert _dot_outputs(forward, x16, w16, b16) == ["f32[16,500]"]


def test_one_row_times_a_big_weight_has_caffes_values_and_the_one_row_gradients():
    """Batch 1 times a 512 x 512 weight (FEW_ROWS_MIN_WEIGHT), multiplied as W x^T on the CPU (jaxlib 0.12's
    YNNPACK packed the whole weight for x W^T on every call: AlexNet's forward at batch 1 took 2.1x as long):
    Caffe's x W^T + b, the plain product's gradients, forward-over-reverse too; a bfloat16 row keeps the
    one-row product beside a zero row."""
    from caffejax.lower import common

    rng = np.random.default_rng(12)
    x, w, b = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in [(1, 512), (512, 512), (512,)])
    assert w.size == common.FEW_ROWS_MIN_WEIGHT
    forward = _inner_product_forward(512)
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    np.testing.assert_allclose(forward(x, w, b), x64 @ w64.T + np.asarray(b), rtol=1e-5, atol=1e-4)
    dy = jnp.asarray(rng.standard_normal((1, 512)), jnp.float32)
    d_x, d_w, d_b = jax.vjp(forward, x, w, b)[1](dy)
    dy64 = np.asarray(dy, np.float64)
    np.testing.assert_allclose(d_x, dy64 @ w64, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(d_w, dy64.T @ x64, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d_b, dy64[0], rtol=1e-6, atol=1e-6)

    _assert_hessian_vector_products_are_the_plain_products(forward, x, w, b, rng)
    if jax.default_backend() == "cpu":
        assert _dot_outputs(forward, x, w, b) == ["f32[512,1]"]
        x16, w16, b16 = (a.astype(jnp.bfloat16) for a in (x, w, b))
        assert _dot_outputs(forward, x16, w16, b16) == ["f32[2,512]"]


def test_few_rows_take_the_input_gradient_of_a_big_weight_from_dy_written_out():
    """8 rows times a 1024 x 1024 weight (FEW_ROWS_INPUT_GRADIENT_MIN_WEIGHT): the rows' gradient dy W is Caffe's
    (and the weight's and bias's are, forward-over-reverse too); on the CPU the training options leave it to
    XLA's own product of dy^T written out (common.transposed_copy) instead of YNNPACK's, which packs W on
    every call. LeNet's 500 x 800 weight and more than FEW_ROWS rows keep the plain product."""
    from caffejax.lower import common
    from caffejax.runtime.xla_options import YNN_DOT_AND_REDUCE, YNN_OPTION

    rng = np.random.default_rng(11)
    x, w, b = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in [(8, 1024), (1024, 1024), (1024,)])
    assert w.size == common.FEW_ROWS_INPUT_GRADIENT_MIN_WEIGHT
    forward = _inner_product_forward(1024)
    dy = jnp.asarray(rng.standard_normal((8, 1024)), jnp.float32)
    d_x, d_w, d_b = jax.vjp(forward, x, w, b)[1](dy)
    x64, w64, dy64 = (np.asarray(a, np.float64) for a in (x, w, dy))
    np.testing.assert_allclose(d_x, dy64 @ w64, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(d_w, dy64.T @ x64, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(d_b, dy64.sum(0), rtol=1e-5, atol=1e-4)

    _assert_hessian_vector_products_are_the_plain_products(forward, x, w, b, rng)

    def barriers(x, w, b):
        return str(jax.make_jaxpr(lambda x, w, b: jax.vjp(forward, x, w, b)[1](jnp.ones((len(x), len(w)), jnp.float32)))(
            x, w, b)).count("optimization_barrier")

    lenet_ip1 = jnp.asarray(rng.standard_normal((500, 1024)), jnp.float32)
    many = jnp.asarray(rng.standard_normal((common.FEW_ROWS + 1, 1024)), jnp.float32)
    on_cpu = jax.default_backend() == "cpu"
    assert barriers(x, w, b) == (2 if on_cpu else 0)
    assert barriers(x, lenet_ip1, b[:500]) == 0 and barriers(many, w, b) == 0
    if on_cpu:  # the input gradient: a product contracting dy^T's leading axis
        hlo = jax.jit(lambda x, w, b: jax.vjp(forward, x, w, b)[1](dy)[0],
                      compiler_options={YNN_OPTION: YNN_DOT_AND_REDUCE}).lower(x, w, b).compile().as_text()
        products = [line for line in hlo.splitlines()
                    if " = f32[8,1024]" in line and ("dot(" in line or "fusion(" in line)]
        dots = [line for line in products if " dot(" in line]
        assert dots and all("lhs_contracting_dims={0}" in line for line in dots)
        # XLA's own product, not a YNNPACK fusion, up to jax 0.10. From jax 0.11 YNNPACK's dot fusions take this
        # form too (jax 0.12.1; on 2 AMD EPYC cores as fast as the plain product: fc6's 16 x 4096 x 9216 11.4 ms).
        if jax.__version_info__ < (0, 11):
            assert dots == products


def test_bfloat16_inner_products_in_a_row_run():
    """A big InnerProduct over 16 rows feeding a small one, in a bfloat16 program: XLA has no bfloat16 x
    bfloat16 -> float32 product of its own to fall back on if the first hands the second its rows transposed."""
    net = caffejax.Net("""
        layer { name: "data" type: "Input" top: "x" input_param { shape { dim: 16 dim: 800 } } }
        layer { name: "ip1" type: "InnerProduct" bottom: "x" top: "h"
                inner_product_param { num_output: 500 weight_filler { type: "gaussian" std: 0.05 } } }
        layer { name: "relu" type: "ReLU" bottom: "h" top: "h" }
        layer { name: "ip2" type: "InnerProduct" bottom: "h" top: "y"
                inner_product_param { num_output: 10 weight_filler { type: "gaussian" std: 0.05 } } }
    """, caffejax.TEST)
    x = np.random.default_rng(10).standard_normal((16, 800)).astype(np.float32)
    want = caffejax.compile_inference(net)({"x": x})["y"]
    got = caffejax.compile_inference(net, dtype=jnp.bfloat16)({"x": x})["y"]
    np.testing.assert_allclose(got, want, rtol=0.05, atol=0.05 * float(np.max(np.abs(want))))


# ---- MVN, Reduction -----------------------------------------------------------------------------------------------

def test_mvn_gradient_is_caffes_and_finite_for_constant_input():
    x = np.full((1, 2, 3, 3), 4.0, np.float32)
    _, (dx,), _ = layer_vjp('type: "MVN"', [x], [np.arange(18, dtype=np.float32).reshape(1, 2, 3, 3)])
    dy = np.arange(18, dtype=np.float32).reshape(1, 2, 3, 3)
    expected = (dy - dy.mean(axis=(2, 3), keepdims=True)) / 1e-9
    np.testing.assert_allclose(dx, expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())


def test_mvn_eps_is_added_after_the_root():
    x = np.array([[1.0, -1.0]], np.float32)
    (y,) = layer_forward('type: "MVN" mvn_param { eps: 1 across_channels: true }', [x])
    np.testing.assert_allclose(y, [[0.5, -0.5]])


def test_reduction_asum_gradient_sign_zero_at_zero():
    x = np.array([[-2.0, 0.0, 3.0]], np.float32)
    _, (dx,), _ = layer_vjp('type: "Reduction" reduction_param { operation: ASUM axis: 1 coeff: 2 }', [x], [np.ones(1)])
    np.testing.assert_array_equal(dx, [[-2, 0, 2]])


def test_reduction_default_is_sum_to_scalar():
    (y,) = layer_forward('type: "Reduction"', [np.ones((2, 3))])
    assert y.shape == () and float(y) == 6


# ---- Parameter ---------------------------------------------------------------------------------------------------

def test_parameter_shape_and_zero_init():
    lp = parse_layer('type: "Parameter" parameter_param { shape { dim: 2 dim: 5 } }')
    shapes = get_rule("Parameter").param_shapes(lp, [])
    assert shapes == [(2, 5)]
    (blob,) = get_rule("Parameter").init_params(lp, shapes, jax.random.key(0))
    np.testing.assert_array_equal(blob, np.zeros((2, 5)))


def test_rules_are_jit_and_eval_shape_safe():
    for text, bottoms, params in [
        ('type: "ArgMax" argmax_param { top_k: 2 out_max_val: true }', [(3, 10)], []),
        ('type: "Accuracy" top: "a" top: "b"', [(3, 10), (3,)], []),
        ('type: "BatchNorm" batch_norm_param { use_global_stats: false }', [(2, 3, 4)], [(3,), (3,), (1,)]),
        ('type: "MVN"', [(2, 3, 4, 5)], []),
    ]:
        ctx = layer_context(text)
        rule = get_rule(ctx.type)
        args = [jnp.ones(s) for s in bottoms], [jnp.ones(s) for s in params]
        jax.jit(lambda bs, ps: rule.forward(ctx, bs, ps))(*args)


def test_unfused_writes_its_value_out_as_a_computation_no_reader_fuses_in(monkeypatch):
    """common.unfused(fn, x): fn's values and gradients, computed inside a conditional XLA keeps (an optimization
    barrier XLA:CPU removes before fusing), so that a pooling reading it does not compute it per window, also
    where the operand tested is a constant; an empty operand, or a backend other than the CPU, runs fn as it is."""
    from caffejax.lower import common

    def taps(x):  # an element-wise producer, and a reader that reads each of its values four times
        return x * 3.0 + jnp.sin(x)

    def pool(y):
        return jnp.maximum(jnp.maximum(y[:, ::2, ::2], y[:, 1::2, ::2]), jnp.maximum(y[:, ::2, 1::2], y[:, 1::2, 1::2]))

    def pooled(x, apart):
        return pool(common.unfused(taps, x) if apart else taps(x))

    x = jnp.asarray(np.random.default_rng(3).standard_normal((4, 24, 24)), jnp.float32)
    x64 = np.asarray(x, np.float64)
    y64 = (x64 * 3.0 + np.sin(x64)).reshape(4, 12, 2, 12, 2)
    np.testing.assert_allclose(pooled(x, True), y64.max(axis=(2, 4)), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(lambda x: pooled(x, True).sum())(x),  # (the sine in and out of a loop
                               jax.grad(lambda x: pooled(x, False).sum())(x), rtol=1e-6)  # may differ in a bit)
    fused, apart = (jax.jit(pooled, static_argnums=1).lower(x, flag).compile().as_text() for flag in (False, True))
    on_cpu = jax.default_backend() == "cpu"  # (elsewhere fn runs as it is)
    assert "conditional(" not in fused and apart.count("conditional(") == (1 if on_cpu else 0)

    def pooling_computes_the_sine(hlo):  # a computation that takes the maximum and the sine both
        return any("maximum(" in part and "sine(" in part for part in hlo.split("\n\n"))

    if on_cpu:
        assert pooling_computes_the_sine(fused) and not pooling_computes_the_sine(apart)
    assert np.asarray(common.unfused(taps, jnp.zeros((0, 3)))).shape == (0, 3)
    # A constant tested (weights a program holds): XLA does not fold the test, and so keeps the conditional.
    w = jnp.float32(1.5)
    held = jax.jit(lambda x: pool(common.unfused(lambda w, x: taps(x) * w, w, x))).lower(x).compile()
    assert held.as_text().count("conditional(") == (1 if on_cpu else 0)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # where a conditional reads its test back
    assert "cond" not in str(jax.make_jaxpr(lambda x: common.unfused(taps, x))(x))
