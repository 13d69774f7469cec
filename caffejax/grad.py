"""Gradient masking as a first-class, pure function: ``caffejax.value_and_grad(net, masks=...)``.

It returns ``fn(params, inputs, key=None, masks=None) -> (loss, grads)``. This is Caffe's training objective (loss
tops weighted by their loss_weight, Caffe's propagate_down/lr_mult masks) as a pure function of the
params pytree (``net.param_arrays()``: owner layer name -> list of arrays) and the fed blobs (by name).
``fn`` composes with ``jax.jit``, ``jax.vmap`` (per-example gradients) and ``jax.jvp``
(Hessian-vector products).

``masks`` (all optional):

- ``layers={"conv1": 0.0}`` scales the gradient a layer sends to each of its learnable blobs. 0 freezes
  them; the loss is unchanged. For a shared blob only that layer's share of the gradient is scaled.
- ``params={("conv1", 0): mask}`` multiplies the gradient ``conv1`` sends to its blob 0 elementwise, e.g. by
  a pruning mask of the blob's shape.
- ``blobs={"pool1": 0.0}`` scales the gradient flowing back through a blob into the layer that produced it.
  0 stops it there: layers upstream of ``pool1`` get no gradient through it. The mask may be an array of
  the blob's shape.

Masks given to ``value_and_grad`` are constants of the function; masks given to ``fn`` at the call (the same
kinds) are its arguments, so a jitted ``fn`` compiles once for a sweep over mask values, e.g. each layer frozen
in turn with ``masks={"layers": {name: 0.0 if name == frozen else 1.0 for name in names}}`` (GoogLeNet's
training objective at batch 16, six layers frozen in turn on 2 CPU cores: 61 s as six functions, each compiled,
17 s as one). Where both name a gradient, it is scaled by both.

Example::

    net = caffejax.Net("lenet_train.prototxt", caffejax.TRAIN)
    fn = caffejax.value_and_grad(net, masks={"params": {("ip1", 0): prune_mask}, "blobs": {"pool1": 0.0}})
    loss, grads = jax.jit(fn)(net.param_arrays(), {"data": x, "label": y})
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from caffejax.errors import CaffejaxError


def value_and_grad(net, masks: Mapping[str, Mapping] | None = None) -> Callable:
    """A pure ``(params, inputs, key=None, masks=None) -> (loss, grads)`` for ``net``'s current graph, with
    masks: those given here, times those given at the call (same kinds, see the module docstring)."""
    graph = net.graph
    program = net._program
    blob_masks, param_masks = _resolved(graph, masks)
    fed = graph.fed

    def fn(params, inputs, key=None, masks=None):
        missing = set(fed) - set(inputs)
        if missing:
            raise CaffejaxError(f"inputs missing for fed blobs {sorted(missing)}")
        env = {fed[name]: jnp.asarray(array) for name, array in inputs.items() if name in fed}
        blobs, params_masked = blob_masks, param_masks
        if masks is not None:
            blobs, params_masked = (_combined(fixed, given) for fixed, given in zip((blob_masks, param_masks),
                                                                                    _resolved(graph, masks)))
        loss, grads, _ = program.loss_and_grads(params, env, key, blob_masks=blobs or None,
                                                param_masks=params_masked or None)
        return loss, grads

    return fn


def _resolved(graph, masks: Mapping[str, Mapping] | None) -> tuple[dict[str, Any], dict[tuple[str, int], Any]]:
    """``masks`` checked against the graph, as (value id -> blob mask, (layer, blob index) -> param mask)."""
    masks = dict(masks or {})
    unknown = set(masks) - {"layers", "params", "blobs"}
    if unknown:
        raise CaffejaxError(f"unknown mask kinds {sorted(unknown)}; use 'layers', 'params' or 'blobs'")
    layer_names = {layer.name for layer in graph.layers}
    for name in masks.get("layers", {}):
        if name not in layer_names:
            raise CaffejaxError(f"gradient mask names layer '{name}', which the net does not have")
    for blob in masks.get("blobs", {}):
        if blob not in graph.blob_first_value:
            raise CaffejaxError(f"gradient mask names blob '{blob}', which the net does not have")
    blob_masks = {graph.blob_first_value[b]: m for b, m in masks.get("blobs", {}).items()}
    param_masks: dict[tuple[str, int], Any] = {}
    for layer in graph.layers:
        if layer.name in masks.get("layers", {}):
            for i in range(len(layer.params)):
                param_masks[(layer.name, i)] = jnp.asarray(masks["layers"][layer.name])
    for (layer, index), mask in masks.get("params", {}).items():
        try:
            slot = graph.layer(layer).params[index]
        except (KeyError, IndexError):
            raise CaffejaxError(f"gradient mask names param ({layer!r}, {index}), which the net does not have") \
                from None
        mask = jnp.asarray(mask)
        if mask.shape not in ((), tuple(slot.shape)):
            raise CaffejaxError(f"mask for param ({layer!r}, {index}) has shape {tuple(mask.shape)}; the blob "
                                f"is {tuple(slot.shape)}")
        param_masks[(layer, index)] = param_masks.get((layer, index), 1.0) * mask
    return blob_masks, param_masks


def _combined(fixed: Mapping, given: Mapping) -> dict:
    """Two masks of one kind as one: where both name a gradient, it is scaled by both."""
    return {**fixed, **{key: fixed[key] * mask if key in fixed else mask for key, mask in given.items()}}
