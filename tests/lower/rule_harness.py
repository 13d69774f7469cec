"""The layer-rule tests' harness: a reference case's layers run through their rules alone (no Net), and the
small helpers the focused tests use to build one layer from prototxt text and call its rule.

tests/test_reference.py checks every reference case through caffejax.Net in float32. The family test files run
their cases here in float64: that checks the rules are dtype-generic (nothing pinned to float32) and still give
Caffe's figures, forward and backward, when no Net assembles the program around them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from google.protobuf import text_format

from caffejax.errors import CaffejaxError
from caffejax.frontend.build import infer_top_shapes
from caffejax.lower.registry import TEST, LayerContext, get_rule
from caffejax.proto import caffe_pb2
from conftest import DIFF_ATOL, DIFF_RTOL, FORWARD_ATOL, FORWARD_RTOL, Case, assert_close, layer_case


# ---- one layer, from prototxt text ------------------------------------------------------------------------------

def parse_layer(text: str) -> caffe_pb2.LayerParameter:
    return text_format.Parse(text, caffe_pb2.LayerParameter())


def layer_context(layer: str | caffe_pb2.LayerParameter, phase: int = TEST, key: jax.Array | None = None,
                  num_tops: int | None = None) -> LayerContext:
    """The context a net gives LAYER (text or LayerParameter); by default as many tops as it names, at least one."""
    lp = parse_layer(layer) if isinstance(layer, str) else layer
    in_place = tuple(i < len(lp.bottom) and t == lp.bottom[i] for i, t in enumerate(lp.top))
    return LayerContext(layer=lp, phase=phase, key=key, num_tops=(len(lp.top) or 1) if num_tops is None else num_tops,
                        in_place=in_place)


def layer_forward(layer, bottoms, params=(), phase: int = TEST, key: jax.Array | None = None,
                  num_tops: int | None = None) -> list[jax.Array]:
    """The tops of one layer's rule, run jitted as in a net (one compile, not one per op). Bottoms whose values
    decide the top shapes (Filter's selector) enter as NumPy constants, as the Net feeds them."""
    ctx = layer_context(layer, phase, key, num_tops)
    rule = get_rule(ctx.type)
    fixed = set()
    if rule.shape_from_values and bottoms:  # indices may count from the end (the text need not name the bottoms)
        fixed = {j % len(bottoms) for j in rule.shape_from_values(ctx.layer)}

    def forward(traced, params):
        traced = iter(traced)
        return list(rule.forward(ctx, [np.asarray(b) if j in fixed else next(traced) for j, b in enumerate(bottoms)],
                                 params))

    return jax.jit(forward)([jnp.asarray(b) for j, b in enumerate(bottoms) if j not in fixed],
                            [jnp.asarray(p) for p in params])


def layer_vjp(layer, bottoms, cotangents, params=(), phase: int = TEST, key: jax.Array | None = None):
    """(tops, bottom diffs, param diffs) of one layer's rule, jitted, with COTANGENTS as the top diffs."""
    ctx = layer_context(layer, phase, key)
    rule = get_rule(ctx.type)
    tops, vjp = jax.vjp(jax.jit(lambda bs, ps: list(rule.forward(ctx, bs, ps))),
                        [jnp.asarray(b) for b in bottoms], [jnp.asarray(p) for p in params])
    bottom_diffs, param_diffs = vjp([jnp.asarray(c, t.dtype) for c, t in zip(cotangents, tops)])
    return tops, bottom_diffs, param_diffs


def assert_rejects(layer, bottoms, params=(), match: str | None = None, num_tops: int | None = None) -> None:
    """The layer's forward raises a CaffejaxError (matching MATCH) for these bottoms and params."""
    with pytest.raises(CaffejaxError, match=match):
        layer_forward(layer, bottoms, params, num_tops=num_tops)


# ---- a reference case: its layers in order, forward and vjp, against Caffe's figures ---------------------------

def reference_case(name: str) -> tuple[Case, caffe_pb2.NetParameter, list[caffe_pb2.LayerParameter]]:
    """Case NAME of tests/fixtures/reference/layers, its net, and the layers under test (all but the Inputs)."""
    case = layer_case(name)
    net = text_format.Parse(case.prototxt.read_text(), caffe_pb2.NetParameter())
    return case, net, [lp for lp in net.layer if lp.type != "Input"]


def run_reference_case(name: str, dtype=np.float32) -> None:
    """Run the layers of case NAME through their rules as one jitted program, in DTYPE; compare with Caffe's
    figures: learnable-blob shapes, tops (exactly where Caffe's are integers), the loss, and the diffs of the
    case's inputs and learnable blobs where Caffe computed them.
    """
    with jax.enable_x64(np.dtype(dtype) == np.float64):
        _run_reference_case(name, np.dtype(dtype))


def _run_reference_case(name: str, dtype: np.dtype) -> None:
    case, net, layers = reference_case(name)
    figures = case.figures
    rules = [get_rule(lp.type) for lp in layers]
    # Bottoms whose values decide top shapes (Filter's selector) enter as NumPy constants, as the Net feeds them.
    concrete = {lp.bottom[j] for lp, rule in zip(layers, rules) if rule.shape_from_values
                for j in rule.shape_from_values(lp)}
    constants = {b: np.asarray(figures["input/" + b], dtype) for b in concrete}
    inputs = {b: jnp.asarray(figures["input/" + b], dtype) for b in case.keys("input/") if b not in concrete}
    params = {lp.name: [jnp.asarray(figures[f"param/{lp.name}/{j}"], dtype)
                        for j in range(len(case.keys(f"param/{lp.name}/")))] for lp in layers}

    shapes = {b: tuple(v.shape) for b, v in {**inputs, **constants}.items()}
    for lp, rule in zip(layers, rules):
        bottom_shapes, param_shapes = [shapes[b] for b in lp.bottom], [p.shape for p in params[lp.name]]
        assert [tuple(s) for s in rule.param_shapes(lp, bottom_shapes)] == param_shapes, f"{name}: {lp.name}"
        known = {j: constants[b] for j, b in enumerate(lp.bottom) if b in constants}
        shapes.update(zip(lp.top, infer_top_shapes(lp, rule, case.phase, bottom_shapes, param_shapes, len(lp.top),
                                                   dtype, known)))

    def run(inputs, params):
        env = {**inputs, **constants}
        for lp, rule in zip(layers, rules):
            ctx = layer_context(lp, case.phase, jax.random.key(0))
            tops = list(rule.forward(ctx, [env[b] for b in lp.bottom], params[lp.name]))
            assert len(tops) == len(lp.top), f"{name}: {lp.name} gave {len(tops)} tops for {len(lp.top)}"
            env.update(zip(lp.top, tops))
        return {t: env[t] for lp in layers for t in lp.top}

    tops, vjp = jax.vjp(jax.jit(run), inputs, params)
    loss, cotangents = 0.0, {}
    for lp, rule in zip(layers, rules):
        exact = _integer_tops(lp)
        for i, t in enumerate(lp.top):
            assert tops[t].dtype == dtype, f"{name}: top {t} has dtype {tops[t].dtype}, expected {dtype}"
            assert tops[t].shape == shapes[t], f"{name}: top {t}: inferred shape {shapes[t]} != {tops[t].shape}"
            _assert_top(tops[t], figures["data/" + t], f"{name}: top {t}", exact=t in exact)
            weight = _loss_weight(lp, rule, i)
            loss += weight * float(jnp.sum(tops[t]))
            # Non-loss outputs got Caffe's random top diff; loss tops keep their seed, the loss weight.
            seed = figures.get("topdiff/" + t)
            cotangents[t] = jnp.full(tops[t].shape, weight, dtype) if seed is None else jnp.asarray(seed, dtype)
    assert_close(loss, figures["loss"], FORWARD_RTOL, FORWARD_ATOL, f"{name}: net loss")
    if not case.keys("diff/"):
        return  # Caffe ran forward only for this case
    input_diffs, param_diffs = vjp(cotangents)

    for b in inputs.keys() | constants.keys():
        uses = [(lp, rule, i) for lp, rule in zip(layers, rules) for i, c in enumerate(lp.bottom) if c == b]
        what = f"{name}: diff of input {b}"
        if any(_caffe_differentiates(net.force_backward, lp, rule, i) and b not in constants for lp, rule, i in uses):
            assert_close(input_diffs[b], figures["diff/" + b], DIFF_RTOL, DIFF_ATOL, what)
            continue
        # Caffe skipped this diff and left it zero, so ours is not compared with it. Without force_backward an
        # Input blob needs no backward: such a case's bottom diffs say nothing of the rule's gradient (the focused
        # tests check it). Caffe skips propagate_down: false, and bottoms a layer refuses to differentiate
        # (labels, indices, selectors), whose gradient must then be zero in the rule as well.
        assert not np.any(figures["diff/" + b]), f"{what}: Caffe computed one where none was expected"
        if b in inputs and not any(rule.allow_force_backward(lp, i) for lp, rule, i in uses):
            assert not np.any(input_diffs[b]), f"{what}: a gradient into a bottom Caffe never differentiates"
    for lp in layers:
        for j, diff in enumerate(param_diffs[lp.name]):
            assert_close(diff, figures[f"paramdiff/{lp.name}/{j}"], DIFF_RTOL, DIFF_ATOL,
                         f"{name}: diff of param {lp.name}/{j}")


def _integer_tops(lp) -> tuple[str, ...]:
    """Tops Caffe fills with integers or ratios of counts (ArgMax indices, Accuracy): they must match exactly."""
    if lp.type == "Accuracy" or (lp.type == "ArgMax" and not lp.argmax_param.out_max_val):
        return tuple(lp.top)
    return ()


def _assert_top(got, want, what: str, exact: bool) -> None:
    if not exact:
        assert_close(got, want, FORWARD_RTOL, FORWARD_ATOL, what)
        return
    # Rounded to Caffe's float32 first: a float64 count ratio (1/3) is exact once rounded like Caffe's.
    got = np.asarray(got).astype(want.dtype)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, Caffe's is {want.shape}"
    np.testing.assert_array_equal(got, want, err_msg=what)


def _loss_weight(lp, rule, i: int) -> float:
    """Caffe's loss weight of top I: as given, else 1 for a loss layer's first top and 0 for any other."""
    if i < len(lp.loss_weight):
        return lp.loss_weight[i]
    return 1.0 if rule.is_loss and i == 0 else 0.0


def _caffe_differentiates(force_backward: bool, lp, rule, i: int) -> bool:
    """Whether Caffe's backward computes the diff of bottom I of LP when that bottom is an Input blob."""
    propagate = not lp.propagate_down or lp.propagate_down[i]
    return force_backward and rule.allow_force_backward(lp, i) and propagate
