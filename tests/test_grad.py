"""caffejax.value_and_grad: Caffe's objective as a pure function, with per-layer/param/blob gradient masks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import caffejax

NET = """
name: "mlp"
layer { name: "data" type: "Input" top: "x" top: "label"
        input_param { shape { dim: 6 dim: 5 } shape { dim: 6 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "x" top: "h"
        inner_product_param { num_output: 8 weight_filler { type: "gaussian" std: 0.5 }
                              bias_filler { type: "gaussian" std: 0.5 } } }
layer { name: "act" type: "TanH" bottom: "h" top: "h" }
layer { name: "ip2" type: "InnerProduct" bottom: "h" top: "score"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "score" bottom: "label" top: "loss"
        loss_param { normalization: NONE } }
"""


@pytest.fixture(scope="module")
def setup():
    net = caffejax.Net(NET, caffejax.TRAIN)
    rng = np.random.default_rng(0)
    inputs = {"x": rng.standard_normal((6, 5)).astype(np.float32),
              "label": rng.integers(0, 3, 6).astype(np.float32)}
    return net, net.param_arrays(), inputs


def test_matches_net_forward_backward(setup):
    net, params, inputs = setup
    loss, grads = jax.jit(caffejax.value_and_grad(net))(params, inputs)
    net.clear_param_diffs()
    net.forward(**inputs)
    net.backward()
    np.testing.assert_allclose(loss, net._last_loss, rtol=1e-6)
    for layer, blobs in net.params.items():
        for i, blob in enumerate(blobs):
            np.testing.assert_allclose(grads[layer][i], blob.diff, rtol=1e-5, atol=1e-6)


def test_param_mask_changes_exactly_the_masked_elements(setup):
    net, params, inputs = setup
    _, full = caffejax.value_and_grad(net)(params, inputs)
    mask = (np.random.default_rng(1).random((8, 5)) > 0.5).astype(np.float32)
    _, masked = caffejax.value_and_grad(net, masks={"params": {("ip1", 0): mask}})(params, inputs)
    np.testing.assert_allclose(masked["ip1"][0], full["ip1"][0] * mask, rtol=1e-6)
    assert np.any(full["ip1"][0][mask == 0] != 0)  # the mask really removed something
    for layer, i in (("ip1", 1), ("ip2", 0)):
        np.testing.assert_array_equal(masked[layer][i], full[layer][i])


def test_layer_mask_freezes_only_that_layer(setup):
    net, params, inputs = setup
    loss0, full = caffejax.value_and_grad(net)(params, inputs)
    loss1, masked = caffejax.value_and_grad(net, masks={"layers": {"ip2": 0.0}})(params, inputs)
    assert loss0 == loss1
    assert not np.any(masked["ip2"][0])
    np.testing.assert_array_equal(masked["ip1"][0], full["ip1"][0])


def test_blob_mask_stops_gradient_at_the_blob(setup):
    net, params, inputs = setup
    _, full = caffejax.value_and_grad(net)(params, inputs)
    _, stopped = caffejax.value_and_grad(net, masks={"blobs": {"h": 0.0}})(params, inputs)
    assert not np.any(stopped["ip1"][0]) and not np.any(stopped["ip1"][1])  # upstream of h: nothing
    np.testing.assert_array_equal(stopped["ip2"][0], full["ip2"][0])       # downstream: untouched
    half = np.full((6, 8), 0.5, np.float32)
    _, halved = caffejax.value_and_grad(net, masks={"blobs": {"h": half}})(params, inputs)
    np.testing.assert_allclose(halved["ip1"][0], 0.5 * full["ip1"][0], rtol=1e-6)


def test_per_example_gradients_by_vmap_sum_to_batch_gradient(setup):
    net, params, inputs = setup
    fn = caffejax.value_and_grad(net)
    _, batch = fn(params, inputs)

    def one(x, label):
        return fn(params, {"x": x[None], "label": label[None]})[1]

    per_example = jax.vmap(one)(inputs["x"], inputs["label"])
    summed = jax.tree.map(lambda g: g.sum(axis=0), per_example)
    for layer in batch:
        for a, b in zip(summed[layer], batch[layer]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_hessian_vector_product_by_jvp(setup):
    net, params, inputs = setup
    fn = caffejax.value_and_grad(net)

    def grad_of(p):
        return fn(p, inputs)[1]

    tangent = jax.tree.map(lambda p: jnp.asarray(np.random.default_rng(2).standard_normal(p.shape),
                                                 jnp.float32), params)
    _, hvp = jax.jvp(grad_of, (params,), (tangent,))
    eps = 1e-3
    plus = grad_of(jax.tree.map(lambda p, t: p + eps * t, params, tangent))
    minus = grad_of(jax.tree.map(lambda p, t: p - eps * t, params, tangent))
    finite = jax.tree.map(lambda a, b: (a - b) / (2 * eps), plus, minus)
    for a, b in zip(jax.tree.leaves(hvp), jax.tree.leaves(finite)):
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-3)


def test_masks_given_at_the_call_are_values_of_one_compiled_program(setup):
    """A sweep over masks (each layer frozen in turn, a pruning mask changed) compiles once: masks given at the
    call are the program's arguments, not constants of a new function. They give the gradients masks given
    at construction give, and scale a gradient both name by both."""
    net, params, inputs = setup
    traced = []
    fn = caffejax.value_and_grad(net, masks={"layers": {"ip1": 0.5}})
    jitted = jax.jit(lambda *args, **kwargs: traced.append(1) or fn(*args, **kwargs))
    prune = (np.random.default_rng(2).random((3, 8)) > 0.5).astype(np.float32)
    for frozen in ("ip1", "ip2"):
        masks = {"layers": {name: float(name != frozen) for name in ("ip1", "ip2")},
                 "params": {("ip2", 0): prune}, "blobs": {"h": np.full((6, 8), 0.25, np.float32)}}
        loss, grads = jitted(params, inputs, masks=masks)
        fixed = {"layers": {"ip1": 0.5 * masks["layers"]["ip1"], "ip2": masks["layers"]["ip2"]},
                 "params": masks["params"], "blobs": masks["blobs"]}
        want_loss, want = caffejax.value_and_grad(net, masks=fixed)(params, inputs)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
        for layer in want:
            for got, expected in zip(grads[layer], want[layer]):
                np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
        assert not np.any(grads[frozen][0])
    assert len(traced) == 1
    with pytest.raises(caffejax.CaffejaxError, match="nope"):
        fn(params, inputs, masks={"layers": {"nope": 0.0}})


def test_bad_masks_are_reported(setup):
    net, _, _ = setup
    with pytest.raises(caffejax.CaffejaxError, match="nope"):
        caffejax.value_and_grad(net, masks={"blobs": {"nope": 0.0}})
    with pytest.raises(caffejax.CaffejaxError, match="shape"):
        caffejax.value_and_grad(net, masks={"params": {("ip1", 0): np.ones((2, 2))}})
    fn = caffejax.value_and_grad(net, masks={"blobs": {"h": np.ones((3, 3))}})
    with pytest.raises(caffejax.ShapeError, match=r"layer 'ip1'.*top 'h' has shape \(3, 3\).*\(6, 8\)"):
        fn(*setup[1:])


CONV_NET = """
name: "conv"
layer { name: "data" type: "Input" top: "x" top: "label"
        input_param { shape { dim: 5 dim: 3 dim: 6 dim: 6 } shape { dim: 5 } } }
layer { name: "conv" type: "Convolution" bottom: "x" top: "c"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "bn" type: "BatchNorm" bottom: "c" top: "c" batch_norm_param { use_global_stats: true } }
layer { name: "bn2" type: "BatchNorm" bottom: "c" top: "c" batch_norm_param { use_global_stats: false } }
layer { name: "norm" type: "LRN" bottom: "c" top: "n" lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 } }
layer { name: "pool" type: "Pooling" bottom: "n" top: "p" pooling_param { pool: MAX kernel_size: 3 stride: 1 pad: 1 } }
layer { name: "pool2" type: "Pooling" bottom: "p" top: "p2" pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "dw" type: "Convolution" bottom: "p2" top: "d"
        convolution_param { num_output: 4 group: 4 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "up" type: "Deconvolution" bottom: "d" top: "u"
        convolution_param { num_output: 2 kernel_size: 4 stride: 2 pad: 1 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "ip" type: "InnerProduct" bottom: "u" top: "score"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "score" bottom: "label" top: "loss" }
"""


def test_hessian_vector_product_through_written_out_backwards(monkeypatch):
    """The written-out backwards (BatchNorm's with global and with batch statistics, LRN's, MAX pooling's with
    stride 1 and 2, the depthwise convolution's filter gradient over 2-image chunks, Deconvolution's) compose
    with forward-over-reverse (jax.jvp of grad)."""
    from caffejax.lower import vision

    monkeypatch.setattr(vision, "_depthwise_chunk", lambda: 2)
    with jax.enable_x64(True):
        net = caffejax.Net(CONV_NET, caffejax.TRAIN, dtype=np.float64)
        rng = np.random.default_rng(0)
        bn = net.params["bn"]
        bn[0].data[...], bn[1].data[...], bn[2].data[...] = rng.normal(size=4), rng.uniform(0.5, 2, 4), 1.0
        inputs = {"x": rng.standard_normal((5, 3, 6, 6)), "label": np.array([0.0, 2.0, 1.0, 1.0, 0.0])}
        params = net.param_arrays()
        fn = caffejax.value_and_grad(net)

        @jax.jit  # run eagerly, forward-over-reverse dispatches each of its operations alone: about a minute
        def grad_of(p):
            return fn(p, inputs)[1]

        tangent = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape)), params)
        for bn in ("bn", "bn2"):  # Caffe's statistics are constants here
            tangent[bn] = [jnp.zeros_like(b) for b in tangent[bn]]
        _, hvp = jax.jvp(grad_of, (params,), (tangent,))
        eps = 1e-5
        plus = grad_of(jax.tree.map(lambda p, t: p + eps * t, params, tangent))
        minus = grad_of(jax.tree.map(lambda p, t: p - eps * t, params, tangent))
        for a, b, c in zip(jax.tree.leaves(hvp), jax.tree.leaves(plus), jax.tree.leaves(minus)):
            np.testing.assert_allclose(a, (b - c) / (2 * eps), rtol=1e-4, atol=1e-7)
