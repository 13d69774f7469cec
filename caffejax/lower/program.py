"""Composing the layer rules into one pure function per net, and its backward with Caffe's masks.

``NetProgram(graph)`` is an interpreter over the IR, like torch.fx's: ``forward(params, inputs, key)`` runs
every layer's rule in order on an environment of values and returns all values, plus the blobs layers
rewrote (BatchNorm's running statistics in TRAIN). State a layer carries between forwards (RNN/LSTM's last
hidden state) travels as values too: ``Graph.state`` maps the id a forward reads to the id it leaves. The
runtime wraps it in ``jax.jit``; XLA sees the whole net as one program.

Backward is ``jax.vjp`` of that same function, with Caffe's masks applied as ``stop_gradient``:
a bottom with ``bottom_need_backward`` false (propagate_down: false, labels, layers not under a loss) and a
param with ``param_need_backward`` false (lr_mult: 0 without force_backward) receive no gradient. The
objective is Caffe's: every top with a loss weight is seeded with that weight, every other output with the
diff the user put on it.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from caffejax.errors import GraphError, ShapeError, UnsupportedError, layer_error
from caffejax.frontend.ir import Graph, Layer, reads_after_host
from caffejax.lower.optimize import NCHW, Layouts, to_layout
from caffejax.lower.registry import LayerContext, get_rule

Params = dict[str, list[jax.Array]]      # owner layer name -> its learnable blobs (owners only)
Values = dict[str, jax.Array]            # value id -> array
Updates = dict[str, dict[int, jax.Array]]  # owner layer name -> {blob index: new value} written in forward


class NetProgram:
    """The pure functions of one Graph. Stateless: all arrays come in as arguments.

    ``kernels`` (layer name -> :class:`caffejax.lower.optimize.Kernel`, e.g. ``optimize.layout_kernels``)
    run those layers channels-last; values move between layouts where a reader needs the other one (each
    move made once) and every value leaves ``run_layers`` in Caffe's layout; a kernel with a ``chain`` computes
    its layer and the ones after it as one where the run allows (:meth:`_chain`). Forward and
    ``loss_and_grads`` use them, caffejax.grad's blob masks too (a mask, given in Caffe's layout, moves to its
    value's; a chain hiding a masked value runs layer by layer); a backward handing on the diffs of values
    inside its range perturbs them (``perturb``) and runs Caffe's layout throughout, as those have Caffe's shapes.
    ``forward_kernels`` (default: ``kernels``) are the ones for programs that only run forward (Net.forward
    without a pullback, and the recomputes of its values): the kernels fastest without a backward.
    """

    def __init__(self, graph: Graph, kernels: Mapping[str, Any] | None = None,
                 forward_kernels: Mapping[str, Any] | None = None):
        self.graph = graph
        self.rules = [get_rule(layer.type) for layer in graph.layers]
        self.position = {id(layer): i for i, layer in enumerate(graph.layers)}
        self.kernels = dict(kernels or {})
        self.forward_kernels = self.kernels if forward_kernels is None else dict(forward_kernels)

    # -- forward --------------------------------------------------------------------------------------------
    def run_layers(self, layers: Sequence[Layer], params: Params, env: Values, key: jax.Array | None,
                   masks: bool = False, perturb: Mapping[str, jax.Array] | None = None,
                   blob_masks: Mapping[str, Any] | None = None,
                   param_masks: Mapping[tuple[str, int], Any] | None = None,
                   kernels: Mapping[str, Any] | None = None, layouts: Mapping[str, str] | None = None,
                   restore_layout: bool = True, fold_visible: bool = False,
                   recorded: Mapping[str, jax.Array] | None = None,
                   prepared: Mapping[str, Sequence[jax.Array]] | None = None) -> tuple[Values, Updates]:
        """Run ``layers`` over ``env`` (value id -> array, holding at least their bottoms).

        ``masks`` applies Caffe's backward masks as stop_gradient. ``perturb`` adds a zero-valued array to
        values (its gradient is that value's diff). ``blob_masks`` multiplies the gradient flowing into a
        value by a mask (0 stops it); ``param_masks`` ((layer name, blob index) -> mask) multiplies the gradient
        a layer sends to one of its learnable blobs: research hooks, see caffejax.grad.
        ``kernels`` run the named layers their way (see the class docstring); not with ``perturb``. With
        ``blob_masks`` a chain runs one layer at a time where it would hide a masked value.
        With kernels, ``layouts`` says which values of ``env`` are not in NCHW, and ``restore_layout=False``
        leaves every value in the layout it was made in (one layer timed as it runs inside the net);
        ``fold_visible`` runs the chains whose inner values blobs hold too (the caller hands none of them back).
        ``recorded`` (value id -> array): a layer all of whose tops are in it gets them as
        ``LayerContext.recorded_tops`` (a Python layer then does not run its forward again).
        ``prepared``: :meth:`prepare_weights` of the same run (layers, kernels, ``fold_visible``, no masks),
        made beforehand: its layers' kernels take those arrays instead of preparing theirs.
        Returns the environment with every value computed, and the params layers rewrote.
        """
        env = dict(env)
        updates: Updates = {}
        dtype = _dtype_of(params, env)
        if kernels and perturb:
            raise ValueError("run_layers: kernels change values' layouts; perturb needs Caffe's")
        tracked = Layouts(env, layouts) if kernels else None
        prepared = prepared or {}
        check_one_program(layers)
        for index, layer, kernel, chain in self._computed_layers(layers, kernels, masks, fold_visible, blob_masks):
            rule = self.rules[index]
            layout = tracked.layout_for(kernel, layer.bottom_values) if tracked else None
            bottoms = [tracked.fetch(v, layout) for v in layer.bottom_values] if tracked else \
                [env[v] for v in layer.bottom_values]
            if masks:
                bottoms = [b if need and layer.need_backward else _no_gradient(b)
                           for b, need in zip(bottoms, layer.bottom_need_backward)]
            blobs = self._layer_blobs(layer, params, masks, param_masks)
            # Carried state absent from env (a fresh net, or a caller that does not keep state) is Caffe's zeros.
            state = [env[v] for v in layer.state_in] if all(v in env for v in layer.state_in) else None
            given = ([recorded[v] for v in layer.top_values]
                     if recorded and layer.top_values and all(v in recorded for v in layer.top_values) else None)
            ctx = LayerContext(layer=layer.proto, phase=self.graph.phase,
                               key=None if key is None else jax.random.fold_in(key, index),
                               num_tops=len(layer.tops), in_place=tuple(layer.in_place), dtype=dtype,
                               state=state, python_layers=self.graph.python_layers, recorded_tops=given)
            if chain:
                with jax.named_scope("+".join([layer.name] + [link.name for link in chain])):
                    if layer.name not in prepared:
                        blobs += [p for link in chain for p in self._layer_blobs(link, params, masks, param_masks)]
                    tops = list(kernel.forward(ctx, bottoms, prepared.get(layer.name) or kernel.chain.prepare(blobs)))
            else:
                with jax.named_scope(layer.name):  # profiles and XLA dumps name the layer each op comes from
                    if kernel is not None:
                        tops = list(kernel.forward(ctx, bottoms, prepared.get(layer.name) or kernel.prepare(blobs)))
                    else:
                        tops = list(rule.forward(ctx, bottoms, blobs))
            top_values = chain[-1].top_values if chain else layer.top_values
            if tracked:
                tracked.produced(top_values, tops, layout)
            for i, value in ctx.state_updates.items():
                env[layer.state_out[i]] = _no_gradient(value)
            for value, top in zip(top_values, tops):
                if perturb is not None and value in perturb:
                    top = top + perturb[value]
                if blob_masks is not None and value in blob_masks:
                    layout = tracked.layout.get(value, NCHW) if tracked else NCHW
                    mask = _blob_mask(blob_masks[value], top, layout, chain[-1] if chain else layer, value)
                    top = _scale_gradient(top, mask)
                env[value] = top
            for i, new in ctx.param_updates.items():
                owner, j = layer.params[i].storage
                updates.setdefault(owner, {})[j] = new
        if tracked and restore_layout:
            tracked.restore_caffe_layout()
        return env, updates

    def prepare_weights(self, layers: Sequence[Layer], params: Params, fold_visible: bool = False
                        ) -> dict[str, list[jax.Array]]:
        """The arrays the :attr:`forward_kernels` of a run of ``layers`` (without masks) read, in their own form: a
        kernel's ``prepare`` (channels-last filters), a chain's (BatchNorm folded into the filters). By layer name;
        the layers whose kernels read the arrays as they are are left out. ``run_layers(prepared=...,
        kernels=forward_kernels)`` takes them: made once while the weights stay (Net.forward), not in every
        forward."""
        prepared = {}
        for _, layer, kernel, chain in self._computed_layers(layers, self.forward_kernels, False, fold_visible):
            if chain:
                blobs = [p for link in (layer, *chain) for p in self._layer_blobs(link, params, False, None)]
                prepared[layer.name] = list(kernel.chain.prepare(blobs))
            elif kernel is not None and kernel.prepares and layer.params:
                prepared[layer.name] = list(kernel.prepare(self._layer_blobs(layer, params, False, None)))
        return prepared

    def _computed_layers(self, layers: Sequence[Layer], kernels: Mapping[str, Any] | None, masks: bool,
                         fold_visible: bool, blob_masks: Mapping[str, Any] | None = None):
        """(index, layer, kernel or None, chain) of each layer a run of ``layers`` computes, in order: not the
        fed ones, those run on the host (after the program: run_host_layers), nor those a chain before them
        computes (:meth:`_chain`)."""
        running = {layer.name for layer in layers}
        absorbed: set[str] = set()
        for layer in layers:
            if layer.is_input or layer.runs_on_host or layer.name in absorbed:
                continue
            kernel = kernels.get(layer.name) if kernels else None
            chain = self._chain(layer, kernel, running, masks, fold_visible, blob_masks)
            absorbed.update(link.name for link in chain)
            yield self.position[id(layer)], layer, kernel, chain

    def _layer_blobs(self, layer: Layer, params: Params, masks: bool,
                     param_masks: Mapping[tuple[str, int], Any] | None) -> list[jax.Array]:
        """The learnable blobs ``layer`` reads, with Caffe's masks and the research hooks' gradient masks."""
        blobs = [params[slot.storage[0]][slot.storage[1]] for slot in layer.params]
        if masks:
            blobs = [p if need and layer.need_backward else _no_gradient(p)
                     for p, need in zip(blobs, layer.param_need_backward)]
        if param_masks:
            blobs = [_scale_gradient(p, param_masks[(layer.name, i)]) if (layer.name, i) in param_masks else p
                     for i, p in enumerate(blobs)]
        return blobs

    def _chain(self, layer: Layer, kernel, running: set[str], masks: bool, fold_visible: bool,
               blob_masks: Mapping[str, Any] | None = None) -> list[Layer]:
        """The layers after ``layer`` its kernel's chain computes with it in this run, or none (run one by one).

        A chain runs when all its layers do (and, if visible, when ``fold_visible``), and, under Caffe's masks
        (a backward pass), when it is ``differentiated`` and the gradient passes every link or none: the folded
        form cannot stop a gradient in the middle (propagate_down: false on a link), nor scale it by a mask of a
        value inside the chain (``blob_masks``)."""
        chain = kernel.chain if kernel is not None else None
        if (chain is None or not running.issuperset(chain.layers) or (chain.visible and not fold_visible)
                or (masks and not chain.differentiated)):
            return []
        links = [self.graph.layer(name) for name in chain.layers]
        if blob_masks and any(value in blob_masks for link in [layer] + links[:-1] for value in link.top_values):
            return []
        if masks:
            passes = [link.need_backward and link.bottom_need_backward[0] for link in links]
            if not (all(passes) if layer.need_backward else not any(passes)):
                return []
        return links

    def forward(self, params: Params, inputs: Values, key: jax.Array | None = None,
                start: int = 0, end: int | None = None) -> tuple[Values, Updates]:
        return self.run_layers(self.layers_between(start, end), params, inputs, key, kernels=self.kernels)

    # -- loss and backward ----------------------------------------------------------------------------------
    def loss_weighted_values(self, layers: Sequence[Layer]) -> dict[str, float]:
        return {value: weight for layer in layers
                for value, weight in zip(layer.top_values, layer.loss_weights) if weight}

    def loss(self, env: Values, layers: Sequence[Layer] | None = None) -> jax.Array:
        """Caffe's Net::Forward loss: sum over every top of loss_weight * sum(top)."""
        weighted = self.loss_weighted_values(self.graph.layers if layers is None else layers)
        terms = [weight * jnp.sum(env[value]) for value, weight in weighted.items() if value in env]
        return sum(terms, jnp.zeros((), jnp.float32))

    def forward_backward(self, params: Params, inputs: Values, seeds: Mapping[str, jax.Array],
                         key: jax.Array | None = None, start: int = 0, end: int | None = None,
                         diff_values: Sequence[str] = (), recorded: Mapping[str, jax.Array] | None = None
                         ) -> tuple[Values, Updates, Params, Values]:
        """Forward over layers [start, end], then Caffe's backward over the same range.

        ``seeds`` (value id -> array) are the top diffs backward starts from: Caffe keeps a loss top's diff at
        its loss weight, and other outputs' diffs are what the user placed on them. ``recorded``: tops of the
        last forward for layers that must not run again (see :meth:`run_layers`). Returns (values, param
        updates, param diffs shaped like ``params``, diffs of the values named in ``diff_values``); when those
        are inputs' only, the values lack the ones inside visible chains, which then fold.
        """
        layers = self.layers_between(start, end)
        seed_ids = list(seeds)
        # The kernels run when no value inside the range is asked for: a perturbed value must be in Caffe's
        # layout. MobileNet v2's Net.backward at batch 16 took twice its training step in Caffe's layout. Then
        # the visible chains fold too (no value is handed back but the diffs): MobileNet v2's deploy net,
        # forward + backward to its input at batch 16, 1.35-1.41 -> 1.05-1.11 s.
        kernels = None if any(v not in inputs for v in diff_values) else self.kernels

        def run(params, perturb):
            env = {v: (x + perturb[v] if v in perturb else x) for v, x in inputs.items()}
            computed = {v: p for v, p in perturb.items() if v not in inputs}
            env, updates = self.run_layers(layers, params, env, key, masks=True, perturb=computed, kernels=kernels,
                                           fold_visible=kernels is not None, recorded=recorded)
            return {v: env[v] for v in seed_ids}, (env, updates)

        dtype = _dtype_of(params, inputs)
        perturb = {v: jnp.zeros(self.graph.value_shapes[v], dtype) for v in diff_values}
        seeded, vjp, (env, updates) = jax.vjp(run, params, perturb, has_aux=True)
        cotangent = {v: jnp.asarray(seeds[v], seeded[v].dtype).reshape(seeded[v].shape) for v in seed_ids}
        grads, value_diffs = vjp(cotangent)
        return env, updates, grads, value_diffs

    def loss_and_grads(self, params: Params, inputs: Values, key: jax.Array | None = None,
                       blob_masks: Mapping[str, Any] | None = None,
                       param_masks: Mapping[tuple[str, int], Any] | None = None, fold_visible: bool = False
                       ) -> tuple[jax.Array, Params, tuple[Values, Updates]]:
        """Caffe's training objective and its gradient with respect to ``params``.

        The objective is Net::ForwardBackward's: loss tops seeded with their weights, other outputs with a
        zero diff, Caffe's masks applied. Returns (loss, grads shaped like ``params``, (values, updates));
        with ``fold_visible`` (see :meth:`run_layers`) the values inside visible chains are not among them.
        """
        def objective(params):
            env, updates = self.run_layers(self.graph.layers, params, inputs, key, masks=True,
                                           blob_masks=blob_masks, param_masks=param_masks,
                                           kernels=self.kernels, fold_visible=fold_visible)
            return self.loss(env), (env, updates)

        (loss, aux), grads = jax.value_and_grad(objective, has_aux=True)(params)
        return loss, grads, aux

    def layers_between(self, start: int = 0, end: int | None = None) -> list[Layer]:
        """Layers start..end inclusive, as Caffe's ForwardFromTo/BackwardFromTo count them."""
        return self.graph.layers[start: len(self.graph.layers) if end is None else end + 1]


def run_host_layers(layers: Sequence[Layer], values: Mapping[str, Any], python_layers=None) -> dict[str, np.ndarray]:
    """The layers among ``layers`` that run on the host (``Layer.runs_on_host``: their top shapes depend on the
    data), in order, after the program: their :func:`host_forward` on host copies of their bottoms, read from
    ``values`` (value id -> array: what the program returned or was fed). Returns their tops by value id, as
    NumPy arrays. ``python_layers``: the net's PythonLayers, which Python layers run on the host call."""
    made: dict[str, np.ndarray] = {}
    for layer in layers:
        if layer.runs_on_host:
            bottoms = [made[v] if v in made else np.asarray(values[v]) for v in layer.bottom_values]
            tops = list(host_forward(layer, python_layers)(layer.proto, bottoms))
            if len(tops) < len(layer.tops):  # more: optional tops the layer does not have (Proposal's scores)
                raise layer_error(GraphError, layer.name, layer.type, f"its forward on the host gave {len(tops)} "
                                  f"tops; the layer has {len(layer.tops)} ({', '.join(layer.tops)})")
            made.update(zip(layer.top_values, tops))
    return made


def host_forward(layer: Layer, python_layers=None) -> Callable[[Any, Sequence[np.ndarray]], list[np.ndarray]]:
    """``(layer_param, bottoms) -> tops`` of a layer run on the host: its rule's host_forward, or for a Python layer
    whose forward sized its tops by the data, its net's object's reshape and forward (PythonLayers.host_forward)."""
    if layer.type == "Python":
        if python_layers is None:
            raise layer_error(UnsupportedError, layer.name, layer.type, "runs on the host, on its net's layer "
                              "object, which was not given")
        return python_layers.host_forward
    return get_rule(layer.type).host_forward


def host_backward(layer: Layer, python_layers=None) -> Callable[..., list[np.ndarray | None]]:
    """``(layer_param, bottoms, tops, top_diffs, propagate_down) -> bottom diffs`` (None: left as they are) of a
    layer run on the host: its rule's host_backward, or a Python layer's own backward on its net's object
    (PythonLayers.host_backward). A layer without one raises UnsupportedError, as Caffe's NOT_IMPLEMENTED
    Backward aborts (SSD's DetectionOutput)."""
    if layer.type == "Python":
        host_forward(layer, python_layers)  # the same error without the net's layer objects
        return python_layers.host_backward
    backward = get_rule(layer.type).host_backward
    if backward is None:
        raise layer_error(UnsupportedError, layer.name, layer.type,
                          "has no backward (Caffe's is NOT_IMPLEMENTED), and the backward asked for one (a loss "
                          "after its tops, or force_backward)")
    return backward


def check_one_program(layers: Sequence[Layer]) -> None:
    """Raise UnsupportedError if a compiled layer among ``layers`` reads what a layer run on the host among them
    makes (Graph.staging_layers): one program would need the host's result inside it. Net.forward, Net.backward,
    a solver's step, compile_inference and caffejax time run such a net in stages (Net._forward_in_stages,
    Net._backward_around_host, inference._Stages); nothing that compiles the layers as one program can."""
    found = next(reads_after_host(layers), None)
    if found is not None:
        layer, host = found
        raise layer_error(UnsupportedError, layer.name, layer.type,
                          f"reads the top of layer '{host.name}' (type {host.type}), which runs on the host "
                          "because its top's shape depends on the data (or, a Python layer, it reads fed blobs "
                          "whose shape changes). Net.forward, Net.backward, a solver's "
                          "step, compile_inference and caffejax time run such a net in stages around that layer; "
                          "one compiled program over both (over several devices, an export, "
                          "caffejax.grad.value_and_grad) cannot")


def _no_gradient(x):
    # NumPy constants (Filter's selector) carry no gradient already, and must stay concrete for their layer.
    return x if isinstance(x, np.ndarray) else jax.lax.stop_gradient(x)


def _dtype_of(params: Params, inputs: Values):
    leaves = [x for x in jax.tree.leaves((params, inputs)) if jnp.issubdtype(jnp.result_type(x), jnp.floating)]
    return jnp.result_type(*leaves) if leaves else jnp.float32


def _blob_mask(mask, top: jax.Array, layout: str, layer: Layer, value: str):
    """A blob's gradient mask, given in Caffe's layout, checked (it must broadcast to the blob's shape and keep it)
    and moved to the layout of the ``top`` its layer made."""
    shape = np.shape(mask)
    caffe_shape = top.shape if layout == NCHW or top.ndim != 4 else tuple(top.shape[i] for i in (0, 3, 1, 2))
    try:
        fits = np.broadcast_shapes(shape, caffe_shape) == caffe_shape
    except ValueError:
        fits = False
    if not fits:
        raise layer_error(ShapeError, layer.name, layer.type,
                          f"the gradient mask of its top '{value}' has shape {shape}, which does not broadcast to "
                          f"the top's shape {caffe_shape}")
    if layout == NCHW or top.ndim != 4 or not shape:
        return mask
    return to_layout(jnp.reshape(mask, (1,) * (4 - len(shape)) + shape), NCHW, layout)


@jax.custom_vjp
def _scale_gradient(x, mask):
    return x


def _scale_gradient_fwd(x, mask):
    return x, mask


def _scale_gradient_bwd(mask, g):
    return (g * mask).astype(g.dtype), jnp.zeros_like(mask)


_scale_gradient.defvjp(_scale_gradient_fwd, _scale_gradient_bwd)
