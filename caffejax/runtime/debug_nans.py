"""Finding the layer that first produced NaN or Inf (``--debug-nans``, ``Net(..., debug_nans=True)``).

A compiled pass only shows that some output went non-finite. :func:`find_first_nan` replays the pass eagerly,
one layer at a time, on the same inputs, weights and random key, and reports the first layer whose top is not
finite, or the fed blob or learnable blob that already was.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from caffejax.lower.program import run_host_layers


@dataclasses.dataclass(frozen=True)
class NonFinite:
    """Where a pass first holds NaN or Inf.

    ``kind`` is "top" (the layer computed it from finite bottoms and weights), "input" (a fed blob of the
    layer already held it) or "weights" (one of the layer's learnable blobs did). ``blob`` is the top or
    input blob's name, or the learnable blob's index as a string.
    """

    layer: str
    type: str
    kind: str
    blob: str
    nans: int
    infs: int

    def __str__(self) -> str:
        what = f"{self.nans} NaN and {self.infs} Inf values"
        if self.kind == "top":
            return f"layer '{self.layer}' (type {self.type}) produced {what} in top '{self.blob}' from finite inputs"
        if self.kind == "weights":
            return f"layer '{self.layer}' (type {self.type}) has {what} in its learnable blob {self.blob}"
        return f"blob '{self.blob}', fed by layer '{self.layer}' (type {self.type}), holds {what}"


def find_first_nan(net, params: Mapping[str, list[Any]] | None = None,
                   recorded: Mapping[str, Any] | None = None) -> NonFinite | None:
    """Replay ``net``'s last forward layer by layer and report where NaN/Inf first appears (None if nowhere).

    ``params`` (the program's params pytree, see Net.param_arrays) replaces the net's current weights: a solver
    passes the weights an iteration started from, since its update has already overwritten them. ``recorded``
    (value id -> array): the tops of the Python layers that forward made, which the replay takes instead of
    running them again (a Python data layer would serve the next batch). Without them, they run again.
    """
    program, graph = net._program, net.graph
    params = net.param_arrays() if params is None else params
    env = {**net._last_forward_feed(graph.layers), **net._state_feed(graph.layers, net._state_seen),
           **graph.concrete}
    with jax.disable_jit():
        for index, layer in enumerate(graph.layers):
            if layer.is_input:
                for top, value in zip(layer.tops, layer.top_values):
                    found = _non_finite(layer, "input", top, env[value])
                    if found:
                        return found
                continue
            for slot in layer.params:
                found = _non_finite(layer, "weights", str(slot.index), params[slot.storage[0]][slot.storage[1]])
                if found:
                    return found
            if layer.runs_on_host:
                env.update(run_host_layers([layer], env, net._python_layers))
            else:
                # The key of the forward pass that ran this layer (in a net run in stages, each stage's own).
                key = net._key_of_forward(index, index) if net._last_key is not None else jax.random.key(0)
                env, _ = program.run_layers([layer], params, env, key, recorded=recorded)
            for top, value in zip(layer.tops, layer.top_values):
                found = _non_finite(layer, "top", top, env[value])
                if found:
                    return found
    return None


def _non_finite(layer, kind: str, blob: str, array) -> NonFinite | None:
    array = jnp.asarray(array)
    if not jnp.issubdtype(array.dtype, jnp.floating) or bool(jnp.all(jnp.isfinite(array))):
        return None
    values = np.asarray(array)
    return NonFinite(layer=layer.name, type=layer.type, kind=kind, blob=blob, nans=int(np.isnan(values).sum()),
                     infs=int(np.isinf(values).sum()))
