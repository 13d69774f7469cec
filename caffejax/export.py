"""Taking a Caffe net out of caffejax: a serialized StableHLO program, or a Flax NNX module.

**StableHLO** (:func:`export_stablehlo`, :func:`load_stablehlo`). The net's forward, jitted, goes through
``jax.export`` and is written as one file. The weights are baked into the program as constants, so the
file is the whole model: loading it needs JAX and nothing of caffejax (the loader only calls
``jax.export.deserialize``). The program takes the fed blobs (the tops of Input and data layers) as a dict
by blob name and returns the net's outputs by blob name. Input shapes are fixed at export (``batch``
replaces the first axis); layer randomness is not exported (a net whose forward draws random numbers in
the exported phase is refused), nor are Python layers (host code). A file holds at most 2 GB (flatbuffers'
limit): use :func:`to_flax` for bigger nets.

**Flax NNX** (:func:`to_flax`). A ``flax.nnx.Module`` whose ``params[layer][i]`` are ``nnx.Param``
variables holding the Caffe blobs (BatchNorm's statistics are ``nnx.BatchStat``), each carrying the blob's
Caffe ``lr_mult``/``decay_mult`` as metadata. Calling it runs the same lowered program as ``Net.forward``
(no layer is re-implemented), so a legacy backbone drops into new JAX code and trains with optax.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from caffejax.errors import CaffejaxError, ShapeError, UnsupportedError
from caffejax.fileio import atomic_write, read_bytes
from caffejax.lower.python_layer import calls_back

__all__ = ["export_stablehlo", "load_stablehlo", "StableHLOModel", "to_flax", "save_flax_state", "load_flax_state"]


def _forward_fn(graph, program):
    """``f(params, inputs, key) -> outputs``: the whole net's forward over blobs named as Caffe names them."""
    on_host = next((layer for layer in graph.layers if layer.runs_on_host), None)
    if on_host is not None:
        raise UnsupportedError(
            f"layer '{on_host.name}' (type {on_host.type}) makes a top whose shape depends on the data, which a "
            f"traced program cannot have (caffejax runs it on the host, after the program). Export the net without "
            f"it, with its bottoms {list(on_host.bottoms)} as outputs, and run it on them yourself (for "
            f"DetectionOutput: caffejax.lower.forks.detect(layer_param, bottoms))")
    fed = graph.fed
    outputs = tuple(graph.outputs)

    def forward(params, inputs: Mapping[str, Any], key=None, masks: bool = False):
        missing, unknown = set(fed) - set(inputs), set(inputs) - set(fed)
        if missing or unknown:
            raise CaffejaxError(f"the net takes inputs {sorted(fed)}; got {sorted(inputs)}"
                                + (f" (missing {sorted(missing)})" if missing else "")
                                + (f" (unknown {sorted(unknown)})" if unknown else ""))
        env = {fed[name]: jnp.asarray(array) for name, array in inputs.items()}
        env, updates = program.run_layers(graph.layers, params, env, key, masks=masks)
        return {blob: env[graph.blob_value[blob]] for blob in outputs}, env, updates

    return forward


# ---- StableHLO --------------------------------------------------------------------------------------------

def export_stablehlo(net, path: str, *, batch: int | None = None,
                     platforms: Sequence[str] | None = None) -> jax.export.Exported:
    """Serialize ``net``'s forward (weights baked in) to ``path``; returns the ``jax.export.Exported``.

    The inputs are the net's fed blobs at their current shapes, with the first axis set to ``batch`` when
    given. ``platforms`` (e.g. ``("cpu", "cuda")``) lowers for those backends instead of the default one.
    """
    graph = net.graph
    python = [layer.name for layer in graph.layers if calls_back(layer)]
    if python:  # their code runs in this process, as host callbacks, which a serialized program cannot hold
        raise UnsupportedError(f"cannot export Python layers {python} to StableHLO: their code runs on the host, "
                               "in this process; register pure-JAX rules for them (caffejax.register_layer)")
    forward = _forward_fn(graph, net._program)
    params = net.param_arrays()
    specs = {}
    for name in graph.fed:
        shape = graph.blob_shape(name)
        if shape is None:
            raise ShapeError(f"cannot export: the shape of input blob '{name}' is unknown (its data source is "
                             "not readable); use a prototxt with an Input layer")
        if batch is not None:
            if not shape:
                raise ShapeError(f"cannot set the batch of input blob '{name}': it has no axes")
            shape = (int(batch),) + tuple(shape[1:])
        specs[name] = jax.ShapeDtypeStruct(tuple(shape), net.blobs[name].data.dtype)
    if not specs:
        raise CaffejaxError("cannot export a net without inputs (no Input or data layer)")

    def program(inputs):
        outputs, _, _ = forward(params, inputs)
        return outputs

    try:
        exported = jax.export.export(jax.jit(program), platforms=platforms)(specs)
        data = exported.serialize()
    except ImportError as e:  # jax's serializer needs the flatbuffers package
        raise UnsupportedError(f"StableHLO export needs {e.name or 'flatbuffers'}: "
                               "pip install 'caffejax[export]'") from None
    atomic_write(path, bytes(data))
    return exported


class StableHLOModel:
    """A deserialized export: call it with the input blobs by name; it returns the outputs by name."""

    def __init__(self, exported: jax.export.Exported):
        self.exported = exported
        args, kwargs = jax.tree.unflatten(exported.in_tree, exported.in_avals)
        if kwargs or len(args) != 1 or not isinstance(args[0], dict):
            raise CaffejaxError("not a caffejax StableHLO export: it does not take one dict of input blobs")
        self._avals = args[0]
        self.input_shapes = {name: tuple(aval.shape) for name, aval in self._avals.items()}

    @property
    def input_names(self) -> list[str]:
        return list(self.input_shapes)

    def __call__(self, **inputs) -> dict[str, jax.Array]:
        if set(inputs) != set(self.input_shapes):
            raise CaffejaxError(f"the exported net takes inputs {sorted(self.input_shapes)}; got {sorted(inputs)}")
        for name, array in inputs.items():
            if tuple(np.shape(array)) != self.input_shapes[name]:
                raise ShapeError(f"input '{name}' has shape {tuple(np.shape(array))}; the exported net takes "
                                 f"{self.input_shapes[name]}")
        return self.exported.call({name: jnp.asarray(array, self._avals[name].dtype)
                                   for name, array in inputs.items()})


def load_stablehlo(path: str) -> StableHLOModel:
    """Load a file written by :func:`export_stablehlo`. Needs only JAX (``jax.export.deserialize``)."""
    data = read_bytes(path)
    try:
        exported = jax.export.deserialize(bytearray(data))
    except ImportError as e:
        raise UnsupportedError(f"loading a StableHLO export needs {e.name or 'flatbuffers'}: "
                               "pip install 'caffejax[export]'") from None
    except Exception as e:  # flatbuffers raises assorted errors on a file that is not an export
        raise CaffejaxError(f"{path}: not a caffejax StableHLO export ({type(e).__name__}: {e})") from None
    try:
        return StableHLOModel(exported)
    except CaffejaxError as e:
        raise CaffejaxError(f"{path}: {e}") from None


# ---- Flax NNX ---------------------------------------------------------------------------------------------

def _nnx():
    try:
        from flax import nnx
    except ImportError:
        raise UnsupportedError("to_flax needs Flax: pip install 'caffejax[flax]'") from None
    return nnx


def to_flax(net):
    """A Flax NNX module holding ``net``'s learnable blobs and running its lowered program.

    ``model(**inputs)`` returns the outputs by blob name (BatchNorm statistics are updated in TRAIN, as
    Caffe's forward updates them); ``model(key, **inputs)`` passes a ``jax.random`` key for layers that draw
    random numbers (Dropout in TRAIN). ``model.loss(**inputs)`` is Caffe's objective (loss tops times their
    loss_weight, with Caffe's backward masks), ready for ``nnx.value_and_grad``. Shared blobs appear once,
    under the layer that owns them.
    """
    return _module_class()(net)


@functools.cache
def _module_class():
    """CaffeModule, defined on first use so that importing this module does not import Flax."""
    from caffejax.lower.registry import get_rule

    nnx = _nnx()

    class CaffeModule(nnx.Module):
        """A Caffe net as a Flax NNX module (see :func:`to_flax`)."""

        def __init__(self, net):
            graph = net.graph
            self.phase = graph.phase
            self.input_names = tuple(graph.fed)
            self.output_names = tuple(graph.outputs)
            self._forward = _forward_fn(graph, net._program)
            self._loss = net._program.loss
            blobs = {}
            for name, layer_arrays in net.param_arrays().items():
                layer = graph.layer(name)
                # BatchNorm's statistics are written by forward, not learned: BatchStat, not Param.
                kind = nnx.BatchStat if get_rule(layer.type).frozen_params else nnx.Param
                # A blob this layer shares from an earlier one stays None here: it lives with its owner.
                blobs[name] = nnx.List([
                    None if array is None else kind(jnp.asarray(array), lr_mult=slot.lr_mult,
                                                    decay_mult=slot.decay_mult)
                    for slot, array in zip(layer.params, layer_arrays)])
            self.params = nnx.Dict(blobs)

        def _arrays(self):
            return {name: [None if v is None else v[...] for v in variables]
                    for name, variables in self.params.items()}

        def _run(self, key, inputs, masks):
            outputs, env, updates = self._forward(self._arrays(), inputs, key, masks)
            for owner, changed in updates.items():
                for index, value in changed.items():
                    self.params[owner][index][...] = value
            return outputs, env

        def __call__(self, key=None, /, **inputs) -> dict[str, jax.Array]:
            return self._run(key, inputs, masks=False)[0]

        def loss(self, key=None, /, **inputs) -> jax.Array:
            """Caffe's training objective: sum of loss_weight * sum(top) over the loss tops."""
            _, env = self._run(key, inputs, masks=True)
            return self._loss(env)

    return CaffeModule


def save_flax_state(model, path: str) -> None:
    """Write a :func:`to_flax` module's variables (msgpack, Flax's serialization) to ``path``; atomic."""
    nnx = _nnx()
    from flax import serialization

    pure = nnx.to_pure_dict(nnx.state(model))
    atomic_write(path, serialization.msgpack_serialize(jax.tree.map(np.asarray, pure)))


def load_flax_state(model, path: str) -> None:
    """Load variables written by :func:`save_flax_state` into a module built from the same net."""
    nnx = _nnx()
    from flax import serialization

    data = read_bytes(path)
    try:
        pure = serialization.msgpack_restore(data)
    except Exception as e:
        raise CaffejaxError(f"{path}: not a Flax msgpack state ({type(e).__name__}: {e})") from None
    state = nnx.state(model)
    try:
        nnx.replace_by_pure_dict(state, pure)
    except Exception as e:
        raise CaffejaxError(f"{path}: its variables do not fit this net ({type(e).__name__}: {e})") from None
    nnx.update(model, state)
