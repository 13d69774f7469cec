"""Loss layer rules against BVLC Caffe's reference figures, plus normalization, clipping and label semantics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from caffejax.errors import DataError, ShapeError
from caffejax.lower.registry import TEST, TRAIN, LayerContext, get_rule
from caffejax.proto import caffe_pb2
from rule_harness import layer_context, parse_layer, run_reference_case

# ---- the reference cases (float32 through the Net: tests/test_reference.py) ------------------------------------

LOSS_CASES = ["contrastive_loss", "contrastive_loss_legacy", "euclidean_loss", "hinge_l1", "hinge_l2",
              "infogain_loss", "multinomial_logistic_loss", "sigmoid_xent_loss", "softmax_loss_batch_size",
              "softmax_loss_legacy_normalize_false", "softmax_loss_none_weight", "softmax_loss_spatial_full",
              "softmax_loss_valid_ignore"]


@pytest.mark.parametrize("name", LOSS_CASES)
def test_reference_case_float64(name):
    run_reference_case(name, np.float64)


def test_loss_weight_on_nonloss_layer():
    """A loss_weight on a non-loss top seeds its whole diff with the weight (InnerProduct is another family's)."""
    try:
        get_rule("InnerProduct")
    except (KeyError, ImportError):
        pytest.skip("the InnerProduct rule is not available yet")
    run_reference_case("loss_weight_on_nonloss")


# ---- helpers for the focused tests ------------------------------------------------------------------------------

def _run(text, bottoms):
    """Tops of a loss layer and d top0 / d bottoms."""
    ctx = layer_context(text)
    rule = get_rule(ctx.type)
    bottoms = [jnp.asarray(b) for b in bottoms]
    tops = rule.forward(ctx, bottoms, [])
    grads = jax.grad(lambda bs: rule.forward(ctx, bs, [])[0])(bottoms)
    return tops, grads


def _softmax(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


# Logits (N=2, C=4, inner=3) and labels (2, 3) with one ignored position.
RNG = np.random.default_rng(0)
LOGITS = RNG.normal(size=(2, 4, 3)).astype(np.float32)
LABELS = np.array([[0, 3, -1], [2, 1, 1]], np.float32)


def _softmax_reference(norm_divisor, ignore=True):
    p = _softmax(LOGITS.astype(np.float64), 1)
    labels = LABELS.astype(int)
    valid = labels != -1 if ignore else np.ones_like(labels, bool)
    safe = np.where(valid, labels, 0)
    picked = np.take_along_axis(p, safe[:, None, :], 1)[:, 0, :]
    loss = -np.sum(np.where(valid, np.log(picked), 0)) / norm_divisor
    onehot = np.arange(4)[None, :, None] == safe[:, None, :]
    grad = (p - onehot) * valid[:, None, :] / norm_divisor
    return loss, grad


@pytest.mark.parametrize("loss_param, divisor", [
    ("normalization: FULL", 6),
    ("normalization: VALID", 5),
    ("", 5),                                       # default VALID
    ("normalization: BATCH_SIZE", 2),
    ("normalization: NONE", 1),
    ("normalize: true", 5),                        # legacy true -> VALID
    ("normalize: false", 2),                       # legacy false -> BATCH_SIZE
    ("normalization: FULL normalize: false", 6),   # normalization wins when both are set
])
def test_softmax_loss_normalization_modes(loss_param, divisor):
    text = f'type: "SoftmaxWithLoss" loss_param {{ ignore_label: -1 {loss_param} }}'
    (loss,), (gx, gl) = _run(text, [LOGITS, LABELS])
    want_loss, want_grad = _softmax_reference(divisor)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gx), want_grad, rtol=1e-4, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(gl), 0)  # no gradient into labels
    assert loss.shape == ()


def test_softmax_loss_all_ignored_is_zero_not_nan():
    text = 'type: "SoftmaxWithLoss" loss_param { ignore_label: 7 }'
    (loss,), (gx, _) = _run(text, [LOGITS, np.full((2, 3), 7, np.float32)])
    assert float(loss) == 0.0
    np.testing.assert_array_equal(np.asarray(gx), 0)


def test_softmax_loss_clips_at_flt_min_and_keeps_caffe_gradient():
    x = np.array([[0.0, 200.0]], np.float32)  # p[label 0] underflows to 0
    (loss,), (gx, _) = _run('type: "SoftmaxWithLoss"', [x, np.array([0.0], np.float32)])
    np.testing.assert_allclose(float(loss), -np.log(np.finfo(np.float32).tiny), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(gx), [[-1.0, 1.0]], atol=1e-6)  # p - onehot, not 0


def test_softmax_loss_axis_and_label_count():
    x = RNG.normal(size=(2, 3, 5)).astype(np.float32)  # classes on the last axis
    labels = np.array([[0, 4, 2], [1, 1, 3]], np.float32)
    (loss,), _ = _run('type: "SoftmaxWithLoss" softmax_param { axis: -1 }', [x, labels])
    p = _softmax(x.astype(np.float64), -1)
    want = -np.mean(np.log(np.take_along_axis(p, labels.astype(int)[..., None], -1)))
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    with pytest.raises(ShapeError, match="number of labels"):
        _run('type: "SoftmaxWithLoss"', [x, np.zeros((2, 4), np.float32)])
    with pytest.raises(ShapeError, match="same first dimension"):
        _run('type: "SoftmaxWithLoss"', [LOGITS, np.zeros((6,), np.float32)])


def test_softmax_loss_prob_top():
    text = ('type: "SoftmaxWithLoss" top: "loss" top: "prob" loss_weight: 1 loss_weight: 0 '
            'loss_param { ignore_label: -1 }')
    (loss, prob), _ = _run(text, [LOGITS, LABELS])
    np.testing.assert_allclose(np.asarray(prob), _softmax(LOGITS, 1), rtol=1e-5)
    # Caffe's backward ignores the prob top's diff.
    lp = parse_layer(text)
    ctx = LayerContext(lp, TEST, None, 2)
    g = jax.grad(lambda x: jnp.sum(get_rule("SoftmaxWithLoss").forward(ctx, [x, jnp.asarray(LABELS)], [])[1]))(
        jnp.asarray(LOGITS))
    np.testing.assert_array_equal(np.asarray(g), 0)
    with pytest.raises(ShapeError, match="loss_weight"):
        _run('type: "SoftmaxWithLoss" top: "loss" top: "prob"', [LOGITS, LABELS])


def test_sigmoid_cross_entropy_normalization_and_ignore():
    x = RNG.normal(size=(4, 5)).astype(np.float32) * 3
    t = (RNG.random((4, 5)) > 0.5).astype(np.float32)
    t[0, :2] = -1
    s = 1 / (1 + np.exp(-x.astype(np.float64)))
    nll = -(t * np.log(s) + (1 - t) * np.log(1 - s))
    valid = t != -1
    for loss_param, divisor, ignore in [("", 4, False), ("ignore_label: -1", 4, True),
                                        ("ignore_label: -1 normalization: VALID", 18, True),
                                        ("normalization: FULL", 20, False), ("normalize: true", 20, False)]:
        (loss,), (gx, gt) = _run(f'type: "SigmoidCrossEntropyLoss" loss_param {{ {loss_param} }}', [x, t])
        mask = valid if ignore else np.ones_like(valid)
        if not ignore:  # t = -1 is then a (strange) soft target, used as is
            nll_all = -(x * (t - (x >= 0)) - np.log1p(np.exp(x - 2 * x * (x >= 0))))
            np.testing.assert_allclose(float(loss), nll_all.sum() / divisor, rtol=1e-5)
        else:
            np.testing.assert_allclose(float(loss), nll[mask].sum() / divisor, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(gx), (s - t) * mask / divisor, rtol=1e-4, atol=1e-7)
        np.testing.assert_array_equal(np.asarray(gt), 0)


def test_sigmoid_cross_entropy_is_stable_for_large_inputs():
    x = np.array([[-1000.0, 1000.0]], np.float32)
    (loss,), (gx, _) = _run('type: "SigmoidCrossEntropyLoss"', [x, np.array([[1.0, 0.0]], np.float32)])
    np.testing.assert_allclose(float(loss), 2000.0)
    np.testing.assert_allclose(np.asarray(gx), [[-1.0, 1.0]])


def test_multinomial_logistic_clipping_keeps_caffe_gradient():
    p = np.array([[0.0, 1.0], [0.25, 0.75]], np.float32)
    (loss,), (gp, gl) = _run('type: "MultinomialLogisticLoss"', [p, np.array([0, 1], np.float32)])
    np.testing.assert_allclose(float(loss), (-np.log(np.float32(1e-20)) - np.log(0.75)) / 2, rtol=1e-6)
    # Caffe: -1 / (N · max(p, 1e-20)) at the label, also where the clip is active.
    np.testing.assert_allclose(np.asarray(gp), [[-0.5 / np.float32(1e-20), 0], [0, -0.5 / 0.75]], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(gl), 0)
    with pytest.raises(ShapeError, match="label must be"):
        _run('type: "MultinomialLogisticLoss"', [p, np.zeros((2, 2), np.float32)])


def test_hinge_l1_gradient_zero_at_exact_margin():
    x = np.array([[1.0, -1.0, 0.5]], np.float32)  # label 0: margin 1 - 1 = 0; class 1: 1 - 1 = 0; class 2: 1.5
    (loss,), (gx, _) = _run('type: "HingeLoss"', [x, np.array([0.0], np.float32)])
    np.testing.assert_allclose(float(loss), 1.5)
    np.testing.assert_array_equal(np.asarray(gx), [[0.0, 0.0, 1.0]])


def test_euclidean_gradients_to_both_bottoms_and_shape_rule():
    a = RNG.normal(size=(3, 4)).astype(np.float32)
    b = RNG.normal(size=(3, 2, 2)).astype(np.float32)  # same count(1): allowed
    (loss,), (ga, gb) = _run('type: "EuclideanLoss"', [a, b])
    d = a - b.reshape(3, 4)
    np.testing.assert_allclose(float(loss), (d ** 2).sum() / 6, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(ga), d / 3, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(gb), -d.reshape(3, 2, 2) / 3, rtol=1e-6)
    with pytest.raises(ShapeError, match="same dimension"):
        _run('type: "EuclideanLoss"', [a, np.zeros((3, 5), np.float32)])


def test_contrastive_gradient_uses_dist_plus_epsilon():
    a = np.array([[0.3, 0.4], [0.0, 0.0], [1.0, 1.0]], np.float32)[..., None, None]
    b = np.zeros_like(a)
    sim = np.array([0, 0, 1], np.float32)[:, None, None, None]
    (loss,), (ga, gb, gs) = _run('type: "ContrastiveLoss" contrastive_loss_param { margin: 1 }', [a, b, sim])
    # pair 0: d = 0.5, (1 - 0.5)^2; pair 1: d = 0, 1^2; pair 2 similar: d^2 = 2.
    np.testing.assert_allclose(float(loss), (0.25 + 1 + 2) / 6, rtol=1e-6)
    want = np.zeros((3, 2), np.float32)
    want[0] = -(1 - 0.5) * np.array([0.3, 0.4]) / (3 * (0.5 + 1e-4))
    want[2] = np.array([1.0, 1.0]) / 3
    np.testing.assert_allclose(np.asarray(ga)[..., 0, 0], want, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gb)[..., 0, 0], -want, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(gs), 0)
    with pytest.raises(ShapeError, match="bottom 2"):
        _run('type: "ContrastiveLoss"', [a, b, np.zeros((3, 2), np.float32)])


# ---- InfogainLoss -----------------------------------------------------------------------------------------------

H = (np.eye(4) + 0.1 * RNG.random((4, 4))).astype(np.float32)


def _infogain_reference(divisor):
    p = _softmax(LOGITS.astype(np.float64), 1)
    labels = LABELS.astype(int)
    valid = labels != -1
    rows = np.moveaxis(H[np.where(valid, labels, 0)], -1, 1)  # (2, 4, 3)
    loss = -np.sum(rows * np.log(p) * valid[:, None, :]) / divisor
    grad = (p * rows.sum(1, keepdims=True) - rows) * valid[:, None, :] / divisor
    return loss, grad


def test_infogain_third_bottom_with_ignore_and_caffe_gradient():
    text = 'type: "InfogainLoss" loss_param { ignore_label: -1 }'
    (loss,), (gx, gl, gh) = _run(text, [LOGITS, LABELS, H.reshape(1, 1, 4, 4)])
    want_loss, want_grad = _infogain_reference(5)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gx), want_grad, rtol=1e-4, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(gl), 0)
    np.testing.assert_array_equal(np.asarray(gh), 0)
    rule = get_rule("InfogainLoss")
    assert [rule.allow_force_backward(None, i) for i in range(3)] == [True, False, False]


def test_infogain_source_binaryproto(tmp_path):
    blob = caffe_pb2.BlobProto(num=1, channels=1, height=4, width=4)
    blob.data.extend(H.reshape(-1).tolist())
    path = tmp_path / "H.binaryproto"
    path.write_bytes(blob.SerializeToString())
    text = f'type: "InfogainLoss" top: "loss" top: "prob" loss_weight: 1 loss_weight: 0 ' \
           f'loss_param {{ ignore_label: -1 normalization: BATCH_SIZE }} infogain_loss_param {{ source: "{path}" }}'
    (loss, prob), (gx, _) = _run(text, [LOGITS, LABELS])
    want_loss, want_grad = _infogain_reference(2)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gx), want_grad, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(np.asarray(prob), _softmax(LOGITS, 1), rtol=1e-5)


def test_infogain_errors(tmp_path):
    with pytest.raises(ShapeError, match="third bottom or infogain_loss_param.source"):
        _run('type: "InfogainLoss"', [LOGITS, LABELS])
    with pytest.raises(DataError, match="cannot read"):
        _run(f'type: "InfogainLoss" infogain_loss_param {{ source: "{tmp_path}/missing" }}', [LOGITS, LABELS])
    # The source is read as every BlobProto file is (caffemodel.read_blobproto, blobproto_to_array).
    short = caffe_pb2.BlobProto(num=1, channels=1, height=4, width=4)
    short.data.extend([1.0, 2.0, 3.0])
    (tmp_path / "short.binaryproto").write_bytes(short.SerializeToString())
    (tmp_path / "text.binaryproto").write_text("not a BlobProto\n")
    for name, message in [("short", r"short.binaryproto: BlobProto holds 3 values but its shape \(1, 1, 4, 4\) "
                                    "needs 16"), ("text", "text.binaryproto: not a valid BlobProto")]:
        with pytest.raises(DataError, match=f"infogain_loss_param.source.*{message}"):
            _run(f'type: "InfogainLoss" infogain_loss_param {{ source: "{tmp_path}/{name}.binaryproto" }}',
                 [LOGITS, LABELS])
    with pytest.raises(ShapeError, match="4x4"):
        _run('type: "InfogainLoss"', [LOGITS, LABELS, np.eye(3, dtype=np.float32)])
    with pytest.raises(ShapeError, match="normalize"):
        _run('type: "InfogainLoss" loss_param { normalize: true }', [LOGITS, LABELS, H])


# ---- rule flags -------------------------------------------------------------------------------------------------

def test_loss_rule_flags():
    for t, bottoms, tops, labels in [
        ("SoftmaxWithLoss", (2, 2), (1, 2), [1]), ("SigmoidCrossEntropyLoss", (2, 2), (1, 1), [1]),
        ("MultinomialLogisticLoss", (2, 2), (1, 1), [1]), ("HingeLoss", (2, 2), (1, 1), [1]),
        ("InfogainLoss", (2, 3), (1, 2), [1, 2]), ("ContrastiveLoss", (3, 3), (1, 1), [2]),
        ("EuclideanLoss", (2, 2), (1, 1), []),
    ]:
        rule = get_rule(t)
        assert rule.is_loss and (rule.bottoms, rule.tops) == (bottoms, tops), t
        assert [i for i in range(bottoms[1]) if not rule.allow_force_backward(None, i)] == labels, t


def test_losses_are_jittable():
    lp = parse_layer('type: "SoftmaxWithLoss" loss_param { ignore_label: -1 }')
    f = jax.jit(jax.value_and_grad(
        lambda x, t: get_rule("SoftmaxWithLoss").forward(LayerContext(lp, TRAIN, None), [x, t], [])[0]))
    loss, g = f(jnp.asarray(LOGITS), jnp.asarray(LABELS))
    want_loss, want_grad = _softmax_reference(5)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(g), want_grad, rtol=1e-4, atol=1e-7)


def test_loss_tops_are_scalars_under_eval_shape():
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    for t, shapes in [("SoftmaxWithLoss", [f32(2, 4, 3), f32(2, 3)]),
                      ("SigmoidCrossEntropyLoss", [f32(2, 5), f32(2, 5)]),
                      ("MultinomialLogisticLoss", [f32(2, 5), f32(2)]), ("HingeLoss", [f32(2, 5), f32(2)]),
                      ("InfogainLoss", [f32(2, 5), f32(2), f32(5, 5)]), ("EuclideanLoss", [f32(2, 5), f32(2, 5)]),
                      ("ContrastiveLoss", [f32(2, 5, 1, 1), f32(2, 5, 1, 1), f32(2, 1, 1, 1)])]:
        lp = parse_layer(f'name: "l" type: "{t}"')
        out = jax.eval_shape(lambda bs: get_rule(t).forward(LayerContext(lp, TRAIN, None), bs, []), shapes)
        assert [(o.shape, o.dtype) for o in out] == [((), jnp.float32)], t
