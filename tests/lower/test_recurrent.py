"""Recurrent layer rules (RNN, LSTM, LSTMUnit) against BVLC Caffe's reference figures and Caffe's unrolled nets."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from caffejax.errors import CaffejaxError
from caffejax.lower.recurrent import lstm_unit
from caffejax.lower.registry import get_rule
from rule_harness import layer_context, layer_forward, parse_layer, run_reference_case

# ---- the reference cases (float32 through the Net: tests/test_reference.py) ------------------------------------

RECURRENT_CASES = ["lstm", "rnn"]


@pytest.mark.parametrize("name", RECURRENT_CASES)
def test_reference_case_float64(name):
    run_reference_case(name, np.float64)


# ---- numpy versions of Caffe's unrolled nets ----------------------------------------------------------------------

def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def _lstm_numpy(x, cont, w_x, b, w_h, x_static=None, w_static=None, h0=None, c0=None):
    t_len, n = cont.shape
    h_dim = w_h.shape[1]
    h = np.zeros((n, h_dim)) if h0 is None else h0[0]
    c = np.zeros((n, h_dim)) if c0 is None else c0[0]
    out = []
    for t in range(t_len):
        gates = (cont[t][:, None] * h) @ w_h.T + (x[t].reshape(n, -1) @ w_x.T + b)
        if x_static is not None:
            gates = gates + x_static.reshape(n, -1) @ w_static.T
        i, f, o, g = np.split(gates, 4, axis=1)
        c = cont[t][:, None] * _sigmoid(f) * c + _sigmoid(i) * np.tanh(g)
        h = _sigmoid(o) * np.tanh(c)
        out.append(h)
    return np.stack(out), h[None], c[None]


def _rnn_numpy(x, cont, w_x, b, w_h, w_o, b_o, x_static=None, w_static=None, h0=None):
    t_len, n = cont.shape
    h = np.zeros((n, w_h.shape[1])) if h0 is None else h0[0]
    out = []
    for t in range(t_len):
        pre = (cont[t][:, None] * h) @ w_h.T + (x[t].reshape(n, -1) @ w_x.T + b)
        if x_static is not None:
            pre = pre + x_static.reshape(n, -1) @ w_static.T
        h = np.tanh(pre)
        out.append(np.tanh(h @ w_o.T + b_o))
    return np.stack(out), h[None]


def _random(rng, *shape):
    return rng.randn(*shape).astype(np.float32) * 0.5


LSTM_EXPOSED = ('name: "l" type: "LSTM" bottom: "x" bottom: "cont" bottom: "xs" bottom: "h0" bottom: "c0" '
                'top: "h" top: "hT" top: "cT" recurrent_param { num_output: 3 expose_hidden: true }')
RNN_EXPOSED = ('name: "r" type: "RNN" bottom: "x" bottom: "cont" bottom: "xs" bottom: "h0" '
               'top: "o" top: "hT" recurrent_param { num_output: 3 expose_hidden: true }')


def test_lstm_static_input_and_exposed_hidden_match_the_unrolled_net():
    rng = np.random.RandomState(0)
    t_len, n, h_dim = 4, 2, 3
    x, xs = _random(rng, t_len, n, 2, 2), _random(rng, n, 5)
    cont = np.array([[1, 0], [1, 1], [0, 1], [1, 1]], np.float32)
    h0, c0 = _random(rng, 1, n, h_dim), _random(rng, 1, n, h_dim)
    shapes = get_rule("LSTM").param_shapes(parse_layer(LSTM_EXPOSED),
                                           [x.shape, cont.shape, xs.shape, h0.shape, c0.shape])
    assert shapes == [(12, 4), (12,), (12, 5), (12, 3)]  # W_xc, b_c, W_xc_static, W_hc
    w_x, b, w_s, w_h = (_random(rng, *s) for s in shapes)
    h, h_t, c_t = layer_forward(LSTM_EXPOSED, [x, cont, xs, h0, c0], [w_x, b, w_s, w_h])
    ref = _lstm_numpy(x, cont, w_x, b, w_h, xs, w_s, h0, c0)
    for got, want in zip((h, h_t, c_t), ref):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_rnn_static_input_and_exposed_hidden_match_the_unrolled_net():
    rng = np.random.RandomState(1)
    t_len, n, h_dim = 3, 2, 3
    x, xs = _random(rng, t_len, n, 4), _random(rng, n, 2, 3)
    cont = np.array([[0, 0], [1, 1], [1, 0]], np.float32)
    h0 = _random(rng, 1, n, h_dim)
    shapes = get_rule("RNN").param_shapes(parse_layer(RNN_EXPOSED), [x.shape, cont.shape, xs.shape, h0.shape])
    assert shapes == [(3, 4), (3,), (3, 6), (3, 3), (3, 3), (3,)]  # W_xh, b_h, W_xh_static, W_hh, W_ho, b_o
    params = [_random(rng, *s) for s in shapes]
    o, h_t = layer_forward(RNN_EXPOSED, [x, cont, xs, h0], params)
    w_x, b, w_s, w_h, w_o, b_o = params
    ref_o, ref_h = _rnn_numpy(x, cont, w_x, b, w_h, w_o, b_o, xs, w_s, h0)
    np.testing.assert_allclose(o, ref_o, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(h_t, ref_h, rtol=1e-5, atol=1e-6)


def test_exposed_hidden_states_carry_data_but_no_gradient():
    """RecurrentLayer shares only data with h_0/c_0 and h_T/c_T: no diff flows through them, nor to cont."""
    rng = np.random.RandomState(2)
    x, xs, cont = _random(rng, 3, 2, 2), _random(rng, 2, 5), np.ones((3, 2), np.float32)
    h0, c0 = _random(rng, 1, 2, 3), _random(rng, 1, 2, 3)
    params = [_random(rng, 12, 2), _random(rng, 12), _random(rng, 12, 5), _random(rng, 12, 3)]
    ctx = layer_context(LSTM_EXPOSED)
    bottoms = [jnp.asarray(b) for b in (x, cont, xs, h0, c0)]
    _, vjp = jax.vjp(lambda bs: get_rule("LSTM").forward(ctx, bs, [jnp.asarray(p) for p in params]), bottoms)
    (dx, dcont, dxs, dh0, dc0), = vjp([jnp.zeros((3, 2, 3), jnp.float32), jnp.ones((1, 2, 3), jnp.float32), jnp.ones((1, 2, 3), jnp.float32)])
    for d in (dx, dcont, dxs, dh0, dc0):
        assert not np.any(d)
    (dx, dcont, dxs, dh0, dc0), = vjp([jnp.ones((3, 2, 3), jnp.float32), jnp.zeros((1, 2, 3), jnp.float32), jnp.zeros((1, 2, 3), jnp.float32)])
    assert np.any(dx) and np.any(dxs) and not np.any(dcont) and not np.any(dh0) and not np.any(dc0)


def test_cont_zero_starts_a_new_sequence():
    rng = np.random.RandomState(3)
    text = 'name: "l" type: "LSTM" recurrent_param { num_output: 2 }'
    params = [_random(rng, 8, 3), _random(rng, 8), _random(rng, 8, 2)]
    x = _random(rng, 5, 1, 3)
    cont = np.array([[0], [1], [1], [0], [1]], np.float32)
    (h,) = layer_forward(text, [x, cont], params)
    (tail,) = layer_forward(text, [x[3:], cont[3:]], params)
    np.testing.assert_allclose(h[3:], tail, rtol=1e-6, atol=1e-7)


def test_recurrent_shape_checks():
    rng = np.random.RandomState(4)
    text = 'name: "l" type: "LSTM" recurrent_param { num_output: 2 }'
    params = [_random(rng, 8, 3), _random(rng, 8), _random(rng, 8, 2)]
    with pytest.raises(CaffejaxError, match="#timesteps, #streams"):
        layer_forward(text, [np.ones((4, 2, 3)), np.ones((4, 3))], params)
    with pytest.raises(CaffejaxError, match="at least 3 axes"):
        layer_forward(text, [np.ones((4, 2)), np.ones((4, 2))], params)
    with pytest.raises(CaffejaxError, match="do not fit"):
        layer_forward(text, [np.ones((4, 2, 5)), np.ones((4, 2))], params)
    with pytest.raises(CaffejaxError, match="num_output"):
        get_rule("RNN").param_shapes(parse_layer('name: "r" type: "RNN"'), [(4, 2, 3), (4, 2)])
    with pytest.raises(CaffejaxError, match="hidden state"):
        bottoms = [np.ones((4, 2, 2)), np.ones((4, 2)), np.ones((2, 5)), np.ones((1, 2, 4)), np.ones((1, 2, 3))]
        layer_forward(LSTM_EXPOSED, bottoms, [np.ones((12, 2)), np.ones(12), np.ones((12, 5)), np.ones((12, 3))])
    with pytest.raises(CaffejaxError, match="tops"):
        layer_forward(text, [np.ones((4, 2, 3)), np.ones((4, 2))], params, num_tops=2)


def test_recurrent_init_uses_weight_and_bias_fillers():
    lp = parse_layer('type: "RNN" recurrent_param { num_output: 2 weight_filler { type: "constant" value: 3 } '
                     'bias_filler { type: "constant" value: 7 } }')
    shapes = get_rule("RNN").param_shapes(lp, [(4, 1, 5), (4, 1)])
    blobs = get_rule("RNN").init_params(lp, shapes, jax.random.key(0))
    assert [float(np.unique(b)[0]) for b in blobs] == [3, 7, 3, 3, 7]


@pytest.mark.parametrize("type_", ["LSTM", "RNN"])
def test_recurrent_debug_info_is_said_to_be_unsupported_when_the_net_is_built(type_, caplog):
    """recurrent_param.debug_info asks Caffe's unrolled net to log its layers; there is no unrolled net here, so
    building a net with it says so (by layer name) rather than dropping the setting silently."""
    import caffejax

    text = f"""
    layer {{ name: "x" type: "Input" top: "x" input_param {{ shape {{ dim: 3 dim: 2 dim: 4 }} }} }}
    layer {{ name: "cont" type: "Input" top: "cont" input_param {{ shape {{ dim: 3 dim: 2 }} }} }}
    layer {{ name: "rec" type: "{type_}" bottom: "x" bottom: "cont" top: "h"
             recurrent_param {{ num_output: 5 %s }} }}"""
    with caplog.at_level(logging.WARNING, logger="caffejax"):
        caffejax.Net(text % "debug_info: true", caffejax.TEST).forward()
        said = [r.getMessage() for r in caplog.records if r.name == "caffejax" and r.levelno == logging.WARNING]
        assert said and all(f"layer 'rec' (type {type_}): recurrent_param.debug_info is not supported" in m
                            for m in said)
        caplog.clear()
        caffejax.Net(text % "", caffejax.TEST).forward()
        assert not [r for r in caplog.records if "debug_info" in r.getMessage()]


# ---- LSTMUnit -----------------------------------------------------------------------------------------------------

UNIT = 'type: "LSTMUnit" bottom: "c" bottom: "x" bottom: "cont" top: "c1" top: "h1"'


def test_lstm_unit_forward_and_backward_are_caffes():
    rng = np.random.RandomState(5)
    c_prev, x = _random(rng, 1, 3, 2), _random(rng, 1, 3, 8)
    cont = np.array([[1, 0, 0.5]], np.float32)
    c, h = layer_forward(UNIT, [c_prev, x, cont])
    i, f, o, g = np.split(x, 4, axis=-1)
    f_act = cont[..., None] * _sigmoid(f)
    want_c = f_act * c_prev + _sigmoid(i) * np.tanh(g)
    np.testing.assert_allclose(c, want_c, rtol=1e-6)
    np.testing.assert_allclose(h, _sigmoid(o) * np.tanh(want_c), rtol=1e-6)

    dc, dh = _random(rng, 1, 3, 2), _random(rng, 1, 3, 2)
    _, vjp = jax.vjp(lambda *a: lstm_unit(*a), jnp.asarray(c_prev), jnp.asarray(x), jnp.asarray(cont))
    d_c_prev, dx, d_cont = vjp((jnp.asarray(dc), jnp.asarray(dh)))
    # With binary cont Caffe's backward is the true derivative.
    _, true_vjp = jax.vjp(lambda c_, x_: _true_unit(c_, x_, jnp.asarray(cont)), jnp.asarray(c_prev), jnp.asarray(x))
    true_dc, true_dx = true_vjp((jnp.asarray(dc), jnp.asarray(dh)))
    np.testing.assert_allclose(d_c_prev, true_dc, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(dx[:, :2], true_dx[:, :2], rtol=1e-5, atol=1e-7)
    # With cont = 0.5 Caffe's f gradient is c_term·c_prev·f·(1 - f) with f = cont·σ(x_f).
    tanh_c = np.tanh(want_c)
    c_term = dc + dh * _sigmoid(o) * (1 - tanh_c ** 2)
    np.testing.assert_allclose(dx[:, 2, 2:4], (c_term * c_prev * f_act * (1 - f_act))[:, 2], rtol=1e-5)
    assert not np.any(d_cont)


def _true_unit(c_prev, x, cont):
    i, f, o, g = jnp.split(x, 4, axis=-1)
    c = cont[..., None] * jax.nn.sigmoid(f) * c_prev + jax.nn.sigmoid(i) * jnp.tanh(g)
    return c, jax.nn.sigmoid(o) * jnp.tanh(c)


def test_lstm_unit_shape_checks():
    with pytest.raises(CaffejaxError, match="4 x"):
        layer_forward(UNIT, [np.ones((1, 3, 2)), np.ones((1, 3, 6)), np.ones((1, 3))])
    with pytest.raises(CaffejaxError, match="bottom"):
        layer_forward(UNIT, [np.ones((2, 3, 2)), np.ones((2, 3, 8)), np.ones((2, 3))])
    assert not get_rule("LSTMUnit").allow_force_backward(parse_layer(UNIT), 2)
    assert not get_rule("LSTM").allow_force_backward(parse_layer(UNIT), 1)
