"""Recurrent layers: RNN and LSTM (Caffe's RecurrentLayer and its unrolled nets), and LSTMUnit.

Caffe runs RNN/LSTM as an unrolled net of InnerProduct, Scale, Eltwise, TanH and LSTMUnit layers, one block
per time step. Here each is one ``lax.scan`` over T with the same arithmetic:

- bottoms x (T x N x ...), cont (T x N), [x_static (N x ...)], [h_0 (1 x N x H), c_0 (LSTM) with expose_hidden];
- the previous hidden state is multiplied by cont_t before the recurrent product (the unrolled net's
  ``h_conted_{t-1} = cont_t · h_{t-1}`` Scale layer), so cont_t = 0 starts a new sequence;
- without expose_hidden, h_0 (and c_0) are what the previous forward left in h_T (c_T), as Caffe's
  RecurrentLayer::Forward copies them before running the unrolled net; the program carries them as layer
  state (``state_shapes``, ``ctx.state``), zeros for a fresh net as Caffe's blobs start;
- no gradient reaches cont, h_0/c_0, nor comes back from the exposed h_T/c_T tops: Caffe's RecurrentLayer
  shares only data (not diffs) with those blobs.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
from jax import lax

from caffejax.lower.common import matmul_bt
from caffejax.lower.registry import LayerContext, count, layer, rejected

log = logging.getLogger("caffejax")


# ---- LSTMUnit ---------------------------------------------------------------------------------------------------

def _gates(x, cont):
    """The activations of lstm_unit_layer.cpp: i, f, o = σ(.), g = tanh(.), f zeroed where cont == 0."""
    xi, xf, xo, xg = jnp.split(x, 4, axis=-1)
    cont = cont[..., None]
    i, o, g = jax.nn.sigmoid(xi), jax.nn.sigmoid(xo), jnp.tanh(xg)
    f = jnp.where(cont == 0, 0, cont * jax.nn.sigmoid(xf))
    return i, f, o, g


@jax.custom_vjp
def lstm_unit(c_prev: jax.Array, x: jax.Array, cont: jax.Array) -> tuple[jax.Array, jax.Array]:
    """c = f·c_prev + i·g, h = o·tanh(c), with gates (i, f, o, g) = x split in four along the last axis and
    f = cont·σ(x_f). Gradient: Caffe's LSTMUnit Backward (f's local derivative is f·(1 - f), which is the
    true one for binary cont), none to cont."""
    i, f, o, g = _gates(x, cont)
    c = f * c_prev + i * g
    return c, o * jnp.tanh(c)


def _lstm_unit_fwd(c_prev, x, cont):
    i, f, o, g = _gates(x, cont)
    c = f * c_prev + i * g
    tanh_c = jnp.tanh(c)
    return (c, o * tanh_c), (c_prev, cont, i, f, o, g, tanh_c)


def _lstm_unit_bwd(residual, cotangents):
    c_prev, cont, i, f, o, g, tanh_c = residual
    dc, dh = cotangents
    c_term = dc + dh * o * (1 - tanh_c * tanh_c)
    dx = jnp.concatenate([c_term * g * i * (1 - i),
                          c_term * c_prev * f * (1 - f),
                          dh * tanh_c * o * (1 - o),
                          c_term * i * (1 - g * g)], axis=-1)
    return c_term * f, dx, jnp.zeros_like(cont)


lstm_unit.defvjp(_lstm_unit_fwd, _lstm_unit_bwd)


@layer("LSTMUnit", bottoms=(3, 3), tops=(2, 2), allow_force_backward=lambda lp, i: i != 2)
def lstm_unit_layer(ctx: LayerContext, bottoms, params):
    """One LSTM step: bottoms c_prev (1 x N x D), gate inputs x (1 x N x 4D), cont (1 x N); tops c, h."""
    c_prev, x, cont = bottoms
    n = c_prev.shape[1] if c_prev.ndim > 1 else None
    for i, (b, ndim) in enumerate(zip(bottoms, (3, 3, 2))):
        if b.ndim != ndim or b.shape[0] != 1 or b.shape[1] != n:
            raise ctx.error(f"bottom[{i}] must be {ndim}-D with shape (1, {n}, ...), got {tuple(b.shape)}")
    if x.shape[2] != 4 * c_prev.shape[2]:
        raise ctx.error(f"gate input {tuple(x.shape)} must have 4 x {c_prev.shape[2]} channels (from c_prev)")
    return list(lstm_unit(c_prev, x, lax.stop_gradient(cont)))


# ---- RNN / LSTM -------------------------------------------------------------------------------------------------

def _num_output(layer_param) -> int:
    num_output = layer_param.recurrent_param.num_output
    if num_output <= 0:
        raise rejected(layer_param, "num_output must be positive")
    return num_output


def _has_static_input(layer_param, num_bottoms: int, num_hidden: int) -> bool:
    """recurrent_layer.cpp: bottom[2] is x_static when there are more bottoms than x, cont and the exposed
    hidden states."""
    return num_bottoms > 2 + num_hidden * layer_param.recurrent_param.expose_hidden


# (gates per hidden unit, recurrent state blobs, has an output layer) of each type.
_LAYOUT = {"LSTM": (4, 2, False), "RNN": (1, 1, True)}


def _recurrent_param_shapes(layer_param, bottom_shapes, gates: int, num_hidden: int, output_layer: bool):
    """The unrolled net's owned params in layer order: W_x [gates·H x I], b [gates·H], [W_x_static],
    W_h [gates·H x H], and for RNN the output layer W_o [H x H], b_o [H]."""
    h = _num_output(layer_param)
    x_shape = bottom_shapes[0]
    if len(x_shape) < 3:  # the unrolled net's x_transform is an InnerProduct from axis 2
        raise rejected(layer_param, f"bottom[0] must be (#timesteps, #streams, features...) with at least 3 axes, "
                                    f"got {tuple(x_shape)}")
    shapes = [(gates * h, count(x_shape, 2)), (gates * h,)]
    if _has_static_input(layer_param, len(bottom_shapes), num_hidden):
        if len(bottom_shapes[2]) < 2:  # x_static's transform is an InnerProduct from axis 1
            raise rejected(layer_param, f"x_static must be (#streams, features...), got {tuple(bottom_shapes[2])}")
        shapes.append((gates * h, count(bottom_shapes[2], 1)))
    shapes.append((gates * h, h))
    if output_layer:
        shapes += [(h, h), (h,)]
    return shapes


def _recurrent_setup(layer_param, bottom_shapes, layer_type: str):
    """RecurrentLayer::LayerSetUp: the learnable blobs' shapes. Its ``debug_info`` turns on the unrolled net's
    own debug_info, a log of every layer of every time step; the one scan here has no such layers, so a net
    asking for it is told when it is built (as detection_output's save_output_param), and again when new
    shapes build it again, instead of the setting being dropped silently."""
    if layer_param.recurrent_param.debug_info:
        log.warning("layer '%s' (type %s): recurrent_param.debug_info is not supported; the recurrence runs as "
                    "one scan, without the unrolled net whose layers Caffe would log", layer_param.name, layer_type)
    return _recurrent_param_shapes(layer_param, bottom_shapes, *_LAYOUT[layer_type])


def _recurrent_init(layer_param, shapes, key):
    """weight_filler for the matrices, bias_filler for the vectors (every InnerProduct of the unrolled net)."""
    from caffejax.lower.fillers import fill, split  # lazily: the fillers module belongs to another family

    p = layer_param.recurrent_param
    keys = split(key, len(shapes))
    return [fill(p.weight_filler if len(s) == 2 else p.bias_filler, s, k) for s, k in zip(shapes, keys)]


def _recurrent_inputs(ctx: LayerContext, bottoms, params, num_hidden: int):
    """RecurrentLayer's checks; returns x (T x N x I), cont, x_static (N x S or None), the initial states."""
    p = ctx.layer.recurrent_param
    h = _num_output(ctx.layer)
    exposed = num_hidden if p.expose_hidden else 0
    if not 2 + exposed <= len(bottoms) <= 3 + exposed:
        raise ctx.error(f"takes x, cont, [x_static]{', and the initial hidden states' if exposed else ''}: "
                        f"{2 + exposed} or {3 + exposed} bottoms, got {len(bottoms)}")
    if ctx.num_tops != 1 + exposed:
        raise ctx.error(f"needs {1 + exposed} tops, got {ctx.num_tops}")
    x, cont = bottoms[0], bottoms[1]
    expected = _recurrent_param_shapes(ctx.layer, [b.shape for b in bottoms], *_LAYOUT[ctx.type])
    if [tuple(w.shape) for w in params] != expected:
        raise ctx.error(f"blobs {[tuple(w.shape) for w in params]} do not fit the expected {expected}")
    t, n = x.shape[0], x.shape[1]
    if cont.shape != (t, n):
        raise ctx.error(f"bottom[1] must have exactly 2 axes -- (#timesteps, #streams) = ({t}, {n}); "
                        f"got {tuple(cont.shape)}")
    static = _has_static_input(ctx.layer, len(bottoms), num_hidden)
    x_static = None
    if static:
        x_static = bottoms[2]
        if x_static.shape[0] != n:
            raise ctx.error(f"x_static {tuple(x_static.shape)} must have {n} streams on axis 0")
        x_static = x_static.reshape(n, count(x_static.shape, 1))
    if ctx.state is not None:
        states = [lax.stop_gradient(s[0]).astype(x.dtype) for s in ctx.state]
    else:
        states = [jnp.zeros((n, h), x.dtype)] * num_hidden
    if exposed:
        states = []
        for i, b in enumerate(bottoms[2 + static:]):
            if b.shape != (1, n, h):
                raise ctx.error(f"bottom[{2 + static + i}] shape {tuple(b.shape)} must match the hidden state "
                                f"input shape (1, {n}, {h})")
            states.append(lax.stop_gradient(b[0]))
    return x.reshape(t, n, count(x.shape, 2)), lax.stop_gradient(cont), x_static, states


def _input_transform(x, w_x, b, x_static, w_static):
    """W_x·x_t + b for all t at once, and W_static·x_static (added at every step), as the unrolled net's
    x_transform and x_static_transform InnerProducts."""
    # matmul_bt sums in float32 at least; the recurrence keeps the values' dtype (a no-op in float32).
    x_term = matmul_bt(x, w_x).astype(x.dtype) + b
    static_term = matmul_bt(x_static, w_static).astype(x.dtype) if x_static is not None else None
    return x_term, static_term


def _step_input(h_prev, cont_t, w_h, x_t, static_term):
    """W_h·(cont_t·h_{t-1}) + W_x·x_t + b [+ W_static·x_static], summed in the unrolled net's Eltwise order."""
    total = matmul_bt(cont_t[:, None] * h_prev, w_h).astype(h_prev.dtype) + x_t
    return total if static_term is None else total + static_term


def _carried_state_shapes(layer_param, bottom_shapes, num_hidden: int):
    """Without expose_hidden, the h_T (and c_T) one forward leaves for the next: (1 x N x H) each."""
    if layer_param.recurrent_param.expose_hidden or len(bottom_shapes[0]) < 2:
        return []
    return [(1, bottom_shapes[0][1], _num_output(layer_param))] * num_hidden


def _carry(ctx: LayerContext, *last_states) -> None:
    if not ctx.layer.recurrent_param.expose_hidden:
        for i, s in enumerate(last_states):
            ctx.update_state(i, lax.stop_gradient(s)[None])


@layer("LSTM", param_shapes=lambda lp, shapes: _recurrent_setup(lp, shapes, "LSTM"),
       init_params=_recurrent_init, bottoms=(2, 5), tops=(1, 3), allow_force_backward=lambda lp, i: i != 1,
       state_shapes=lambda lp, shapes: _carried_state_shapes(lp, shapes, 2))
def lstm(ctx: LayerContext, bottoms, params):
    """h_t from gates W_xc·x_t + b_c [+ W_xc_static·x_static] + W_hc·(cont_t·h_{t-1}), order i, f, o, g:
    c_t = cont_t·f·c_{t-1} + i·g, h_t = o·tanh(c_t). Blobs W_xc, b_c, [W_xc_static], W_hc.
    Tops: h (T x N x H), and with expose_hidden h_T, c_T (1 x N x H)."""
    x, cont, x_static, (h0, c0) = _recurrent_inputs(ctx, bottoms, params, num_hidden=2)
    w_x, b = params[0], params[1]
    w_static = params[2] if x_static is not None else None
    w_h = params[-1]
    x_term, static_term = _input_transform(x, w_x, b, x_static, w_static)

    def step(carry, inputs):
        h_prev, c_prev = carry
        x_t, cont_t = inputs
        c, h = lstm_unit(c_prev, _step_input(h_prev, cont_t, w_h, x_t, static_term), cont_t)
        return (h, c), h

    (h_last, c_last), hs = lax.scan(step, (h0, c0), (x_term, cont))
    _carry(ctx, h_last, c_last)
    tops = [hs]
    if ctx.layer.recurrent_param.expose_hidden:
        tops += [lax.stop_gradient(h_last)[None], lax.stop_gradient(c_last)[None]]
    return tops


@layer("RNN", param_shapes=lambda lp, shapes: _recurrent_setup(lp, shapes, "RNN"),
       init_params=_recurrent_init, bottoms=(2, 4), tops=(1, 2), allow_force_backward=lambda lp, i: i != 1,
       state_shapes=lambda lp, shapes: _carried_state_shapes(lp, shapes, 1))
def rnn(ctx: LayerContext, bottoms, params):
    """h_t = tanh(W_hh·(cont_t·h_{t-1}) + W_xh·x_t + b_h [+ W_xh_static·x_static]), o_t = tanh(W_ho·h_t + b_o).
    Blobs W_xh, b_h, [W_xh_static], W_hh, W_ho, b_o. Tops: o (T x N x H), and with expose_hidden h_T."""
    x, cont, x_static, (h0,) = _recurrent_inputs(ctx, bottoms, params, num_hidden=1)
    w_x, b = params[0], params[1]
    w_static = params[2] if x_static is not None else None
    w_h, w_o, b_o = params[-3], params[-2], params[-1]
    x_term, static_term = _input_transform(x, w_x, b, x_static, w_static)

    def step(h_prev, inputs):
        x_t, cont_t = inputs
        h = jnp.tanh(_step_input(h_prev, cont_t, w_h, x_t, static_term))
        return h, h

    h_last, hs = lax.scan(step, h0, (x_term, cont))
    _carry(ctx, h_last)
    tops = [jnp.tanh(matmul_bt(hs, w_o).astype(hs.dtype) + b_o)]
    if ctx.layer.recurrent_param.expose_hidden:
        tops.append(lax.stop_gradient(h_last)[None])
    return tops
