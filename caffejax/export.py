"""Taking a Caffe net out of caffejax: a serialized StableHLO program, or a Flax NNX module.

**StableHLO** (:func:`export_stablehlo`, :func:`load_stablehlo`). The net's forward, as ``compile_inference``
optimises it (its passes: BatchNorm folded into convolutions, layouts), jitted, goes through ``jax.export`` and is
written as one file. The weights are baked into the program as constants, so the file is the whole model:
loading it needs JAX and nothing of caffejax's frontend (``jax.export.deserialize``). The program takes the fed
blobs (the tops of Input and data layers) as a dict by blob name and returns the net's outputs by blob name.
Input shapes are those of the net at export; ``batch`` sets their first axis to a number, or with a name
(``batch="batch"``) makes it a symbolic dimension, so that one file serves every batch size. Layer randomness is
not exported (a net whose forward draws random numbers in the exported phase is refused), nor are Python layers
(host code). A file holds at most 2 GB (flatbuffers' limit): use :func:`to_flax` for bigger nets.

XLA compiles the file where it is run, with that process's options. :func:`load_stablehlo` compiles it with the
XLA options caffejax gives its own forward programs (YNNPACK's dot fusions on the CPU from 20 MFLOP of
products, which the export records in the program's name), once per set of input shapes; ``jax.export``'s own
``call`` compiles it under XLA's defaults, 1.4-2.4x slower on the CPU at batch 16 (``python -m bench.export``),
unless the process sets ``XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=dot``.

**Flax NNX** (:func:`to_flax`). A ``flax.nnx.Module`` whose ``params[layer][i]`` are ``nnx.Param``
variables holding the Caffe blobs (BatchNorm's statistics are ``nnx.BatchStat``), each carrying the blob's
Caffe ``lr_mult``/``decay_mult`` as metadata. Calling it runs the same lowered program as ``Net.forward``
(no layer is re-implemented), so a legacy backbone drops into new JAX code and trains with optax.
"""

from __future__ import annotations

import functools
import re
import threading
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from caffejax.errors import CaffejaxError, ShapeError, UnsupportedError, prefixed
from caffejax.fileio import atomic_write, read_bytes
from caffejax.lower.optimize import check_passes, make_plan, optimize, prepare_params
from caffejax.lower.python_layer import calls_back
from caffejax.lower.registry import is_symbolic
from caffejax.runtime.inference import (_as_input, _in_dtype, _inputs_to_device, _maps_afresh_on_a_worker,
                                        InputValueErrors, built_once, default_device, default_passes, in_batches,
                                        rows_mixed, sorted_batch_sizes)
from caffejax.runtime.xla_options import forward_options, matmul_flops, ynn_multiplies_a_broadcast

__all__ = ["export_stablehlo", "load_stablehlo", "StableHLOModel", "to_flax", "save_flax_state", "load_flax_state"]


def _forward_fn(graph, program):
    """``f(params, inputs, key) -> outputs``: the whole net's forward over blobs named as Caffe names them."""
    _refuse_host_layers(graph)
    fed = graph.fed
    outputs = tuple(graph.outputs)

    def forward(params, inputs: Mapping[str, Any], key=None, masks: bool = False):
        missing, unknown = set(fed) - set(inputs), set(inputs) - set(fed)
        if missing or unknown:
            raise CaffejaxError(f"the net takes inputs {sorted(fed)}; got {sorted(inputs)}"
                                + (f" (missing {sorted(missing)})" if missing else "")
                                + (f" (unknown {sorted(unknown)})" if unknown else ""))
        env = {fed[name]: jnp.asarray(array) for name, array in inputs.items()}
        # The layout kernels training uses (channels-last, Convolution -> BatchNorm chains): a module's forward
        # is differentiated as often as not.
        env, updates = program.run_layers(graph.layers, params, env, key, masks=masks, kernels=program.kernels)
        return {blob: env[graph.blob_value[blob]] for blob in outputs}, env, updates

    return forward


def _refuse_host_layers(graph) -> None:
    on_host = next((layer for layer in graph.layers if layer.runs_on_host), None)
    if on_host is not None:
        raise UnsupportedError(
            f"layer '{on_host.name}' (type {on_host.type}) makes a top whose shape depends on the data, which a "
            f"traced program cannot have (caffejax runs it on the host, after the program). Export the net without "
            f"it, with its bottoms {list(on_host.bottoms)} as outputs, and run it on them yourself (for "
            f"DetectionOutput: caffejax.lower.forks.detect(layer_param, bottoms))")


# ---- StableHLO --------------------------------------------------------------------------------------------

def export_stablehlo(net, path: str, *, batch: int | str | None = None, batch_inputs: Sequence[str] | None = None,
                     passes: Sequence[str] | None = None, dtype=jnp.float32,
                     platforms: Sequence[str] | None = None) -> jax.export.Exported:
    """Serialize ``net``'s forward (weights baked in) to ``path``; returns the ``jax.export.Exported``.

    The inputs are the net's fed blobs at their current shapes. ``batch``: a number sets their first axis to it;
    a name (``"batch"``) makes it a symbolic dimension of that name, so that one file takes every batch size
    (JAX compiles it for each size it is called with). ``batch_inputs``: the fed blobs whose first axis
    ``batch`` sets (default: all of them; name fewer where an input's first axis is not the batch).
    ``passes``: the optimisation passes the program is built with, as ``compile_inference``'s (default: its
    ones for ``dtype`` and ``inner_product_nhwc``; ``()`` exports Caffe's rules unchanged). ``dtype``: the
    weights' and activations' dtype, as ``compile_inference``'s (``jnp.bfloat16``: the bf16 mode); the program
    takes and returns float32 either way. ``platforms`` (e.g. ``("cpu", "cuda")``) lowers for those backends
    instead of the default one.
    """
    graph = net.graph
    python = [layer.name for layer in graph.layers if calls_back(layer)]
    if python:  # their code runs in this process, as host callbacks, which a serialized program cannot hold
        raise UnsupportedError(f"cannot export Python layers {python} to StableHLO: their code runs on the host, "
                               "in this process; register pure-JAX rules for them (caffejax.register_layer)")
    _refuse_host_layers(graph)
    fed = graph.fed
    if not fed:
        raise CaffejaxError("cannot export a net without inputs (no Input or data layer)")
    batched = _batched_inputs(fed, batch, batch_inputs)
    rows = None  # the rows of the batched inputs at the net's shapes, which the recorded work is counted at
    dim = jax.export.symbolic_shape(batch)[0] if isinstance(batch, str) else None if batch is None else int(batch)
    specs = {}
    for name in fed:
        shape = graph.blob_shape(name)
        if shape is None:
            raise ShapeError(f"cannot export: the shape of input blob '{name}' is unknown (its data source is "
                             "not readable); use a prototxt with an Input layer")
        if name in batched:
            if not shape:
                raise ShapeError(f"cannot set the batch of input blob '{name}': it has no axes")
            rows = rows or shape[0]
            shape = (dim,) + tuple(shape[1:])
        specs[name] = jax.ShapeDtypeStruct(tuple(shape), net.blobs[name].data.dtype)
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise CaffejaxError(f"export_stablehlo needs a floating dtype, got {dtype}")
    passes = default_passes(dtype) + ("inner_product_nhwc",) if passes is None else tuple(passes)
    check_passes(passes)
    plan = optimize(make_plan(graph, net.param_arrays()), passes)
    params = prepare_params(plan, dtype)
    function = _in_dtype(plan, dtype)

    def program(inputs):
        return function(params, {fed[name]: x for name, x in inputs.items()})

    # The work it does and its dtype, for the XLA options load_stablehlo compiles it with (forward_options), and
    # with a symbolic batch whether every layer computes each row apart (load_stablehlo's batch_sizes), in its name.
    flops = matmul_flops(graph) / max(rows or 1, 1)
    if isinstance(batch, str):
        program.__name__ = (f"caffejax_{dtype.name}_forward_flops_{round(flops)}_per_row"
                            + ("" if rows_mixed(graph, with_shapes=False) else "_rows_apart"))
    else:
        program.__name__ = f"caffejax_{dtype.name}_forward_flops_{round(flops * (batch or rows or 1))}"
    try:
        exported = jax.export.export(jax.jit(program), platforms=platforms)(specs)
    except CaffejaxError as e:
        if not isinstance(batch, str):
            raise
        raise prefixed(e, f"cannot export with the symbolic batch '{batch}' of inputs {sorted(batched)}") from None
    try:
        data = exported.serialize()
    except ImportError as e:  # jax's serializer needs the flatbuffers package
        raise UnsupportedError(f"StableHLO export needs {e.name or 'flatbuffers'}: "
                               "pip install 'caffejax[export]'") from None
    atomic_write(path, bytes(data))
    return exported


def _batched_inputs(fed: Mapping[str, str], batch, batch_inputs: Sequence[str] | None) -> list[str]:
    """The fed blobs whose first axis ``batch`` sets (checked)."""
    if batch is None:
        if batch_inputs is not None:
            raise CaffejaxError("batch_inputs names the inputs batch sets; no batch was given")
        return []
    if isinstance(batch, str):
        if not batch.isidentifier():
            raise CaffejaxError(f"batch must be a whole number or the name of a symbolic dimension (a Python "
                                f"identifier, e.g. 'batch'); got {batch!r}")
    elif isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
        raise CaffejaxError(f"batch must be a positive whole number or the name of a symbolic dimension; got {batch!r}")
    if batch_inputs is None:
        return list(fed)
    if isinstance(batch_inputs, str) or not batch_inputs:
        raise CaffejaxError(f"batch_inputs must be a non-empty list of input blob names; got {batch_inputs!r}")
    unknown = [name for name in batch_inputs if name not in fed]
    if unknown:
        raise CaffejaxError(f"batch_inputs {unknown} are not inputs of the net; its inputs are {list(fed)}")
    return list(dict.fromkeys(batch_inputs))


# The name export_stablehlo gives the program: its dtype and the work of its products (matmul_flops), in all or
# per row, and whether its layers compute each row of a symbolic batch apart.
_RECORDED_WORK = re.compile(r"caffejax_(float32|bfloat16|float16|float64)_forward_flops_(\d+)(_per_row)?(_rows_apart)?")


class StableHLOModel:
    """A deserialized export: call it with the input blobs by name; it returns the outputs by name.

    ``input_shapes`` gives each input's shape, a symbolic batch by its name (``("batch", 3, 227, 227)``).
    Each new set of input shapes compiles the program once (``compile_count``), on the CPU with the XLA options
    caffejax gives its own forward programs of that much work (caffejax.runtime.xla_options.forward_options).
    ``batch_sizes`` (a file with a symbolic batch whose layers compute each row apart): as compile_inference's,
    a call runs the program of the smallest of them that holds its rows, the batched inputs padded and the
    outputs that carry the batch cut back; more rows than the largest run in parts of that size.
    """

    def __init__(self, exported: jax.export.Exported, batch_sizes: Sequence[int] | None = None):
        self.exported = exported
        args, kwargs = jax.tree.unflatten(exported.in_tree, exported.in_avals)
        if kwargs or len(args) != 1 or not isinstance(args[0], dict):
            raise CaffejaxError("not a caffejax StableHLO export: it does not take one dict of input blobs")
        self._avals = args[0]
        self.input_shapes = {name: tuple(str(d) if is_symbolic(d) else d for d in aval.shape)
                             for name, aval in self._avals.items()}
        recorded = _RECORDED_WORK.fullmatch(exported.fun_name)
        self._work = None if recorded is None else (jnp.dtype(recorded[1]), int(recorded[2]), bool(recorded[3]))
        self._call = jax.jit(exported.call)
        self._compiled: dict[tuple, Any] = {}
        self._compiling = threading.RLock()  # (several threads may call the model at once: built_once)
        # The inputs and outputs whose axis 0 is the symbolic batch: padded and cut with batch_sizes.
        self._batched = [name for name, shape in self.input_shapes.items() if shape and isinstance(shape[0], str)]
        outputs = jax.tree.unflatten(exported.out_tree, exported.out_avals)
        self._cut = {name for name, aval in outputs.items() if aval.shape and is_symbolic(aval.shape[0])}
        self.batch_sizes = None if batch_sizes is None else self._checked_batch_sizes(
            batch_sizes, recorded is not None and bool(recorded[4]))

    def _checked_batch_sizes(self, batch_sizes: Sequence[int], rows_apart: bool) -> tuple[int, ...]:
        """``batch_sizes`` sorted, once they are positive whole numbers and the file can be padded with rows."""
        sizes = sorted_batch_sizes(batch_sizes, "")
        symbols = {d for shape in self.input_shapes.values() for d in shape if isinstance(d, str)}
        if len(symbols) != 1 or any(isinstance(d, str) for shape in self.input_shapes.values() for d in shape[1:]):
            raise UnsupportedError(f"batch_sizes pads the symbolic batch of a file exported with one (axis 0 of its "
                                   f"inputs, export_stablehlo(batch='batch')); this one takes {self.input_shapes}")
        if not rows_apart:
            raise UnsupportedError(
                "batch_sizes pads a batch with rows, which needs every layer to compute each row of its tops from the "
                "same row of its bottoms alone; export_stablehlo records that in the file, and this one does not "
                "say so (a layer mixes rows, or another tool wrote it). Leave batch_sizes out to compile a program "
                "per batch size")
        return sizes

    @property
    def input_names(self) -> list[str]:
        return list(self.input_shapes)

    @property
    def compile_count(self) -> int:
        return len(self._compiled)

    def warm_up(self, *shapes: Mapping[str, Sequence[int]]) -> int:
        """Compile and run once on zeros, before the first calls, the program for each set of input ``shapes``
        (input name -> shape; a symbolic batch given a size), as compile_inference's ``warm_up``: a server fed
        batches of 1, 8 and 32 calls ``model.warm_up(*({"data": (n, 3, 227, 227)} for n in (1, 8, 32)))``; with
        ``batch_sizes`` and no shapes, one for each of those sizes. Returns how many programs that compiled (none
        already there)."""
        if not shapes and self.batch_sizes is not None:
            shapes = tuple({name: (size, *shape[1:]) if name in self._batched else shape
                            for name, shape in self.input_shapes.items()} for size in self.batch_sizes)
        before = self.compile_count
        for shape in shapes:
            if shape.keys() != self.input_shapes.keys():
                raise CaffejaxError(f"warm_up: shapes for {sorted(shape)} do not match the exported net's inputs "
                                    f"{sorted(self.input_shapes)}")
            jax.block_until_ready(self(**{name: np.zeros(tuple(dims), self._avals[name].dtype)
                                          for name, dims in shape.items()}))
        return self.compile_count - before

    def __call__(self, **inputs) -> dict[str, jax.Array]:
        if inputs.keys() != self.input_shapes.keys():
            raise CaffejaxError(f"the exported net takes inputs {sorted(self.input_shapes)}; got {sorted(inputs)}")
        with InputValueErrors(inputs):
            if self.batch_sizes is None:
                return self._run(inputs)
            return in_batches(self._run, inputs, self.batch_sizes, "batch_sizes", self._batched, self._cut)

    def _run(self, inputs: Mapping[str, Any]) -> dict[str, jax.Array]:
        signature = tuple(sorted((name, tuple(np.shape(x))) for name, x in inputs.items()))
        # Shapes not seen before: checked, then compiled for the default device (a checked signature stays valid).
        program, inputs_to_device_first, device = built_once(
            self._compiled, signature, self._compiling, lambda: self._compile(signature))
        # As compile_inference's inputs: device arrays elsewhere move to the program's device.
        arrays = {name: _as_input(x, self._avals[name].dtype, device) for name, x in inputs.items()}
        return program(_inputs_to_device(arrays) if inputs_to_device_first else arrays)

    def _symbol_sizes(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, int]:
        """The size of each symbolic dimension in ``shapes``; ShapeError where a shape does not fit."""
        sizes: dict[str, tuple[int, str]] = {}
        for name, shape in shapes.items():
            want = self.input_shapes[name]
            if len(shape) != len(want) or any(n != w for n, w in zip(shape, want) if not isinstance(w, str)):
                raise ShapeError(f"input '{name}' has shape {shape}; the exported net takes {want}")
            for n, w in zip(shape, want):
                if not isinstance(w, str):
                    continue
                if n < 1:
                    raise ShapeError(f"input '{name}' has shape {shape}; the exported net's symbolic dimension "
                                     f"'{w}' takes sizes of 1 or more")
                seen = sizes.setdefault(w, (n, name))
                if seen[0] != n:
                    raise ShapeError(f"inputs '{seen[1]}' and '{name}' give the symbolic dimension '{w}' sizes "
                                     f"{seen[0]} and {n}; it takes one size per call (their shapes "
                                     f"{shapes[seen[1]]} and {shape})")
        return {w: n for w, (n, _) in sizes.items()}

    def _compile(self, signature: tuple[tuple[str, tuple[int, ...]], ...]):
        """The program for inputs of these shapes on the default device, whether its host inputs go to the device
        first, and that device."""
        sizes = self._symbol_sizes(dict(signature))
        lowered = self._call.lower({name: jax.ShapeDtypeStruct(shape, self._avals[name].dtype)
                                    for name, shape in signature})
        options = {}
        if self._work is not None and len(sizes) <= 1:
            dtype, flops, per_row = self._work
            options = forward_options(flops * (next(iter(sizes.values()), 1) if per_row else 1), dtype)
        compiled = lowered.compile(compiler_options=options or None)
        # As compile_inference's programs that hold their weights: a YNNPACK dot fusion multiplying by a
        # broadcast (a constant of one value) gives wrong values, where XLA's own dot does not.
        if options and ynn_multiplies_a_broadcast(compiled.as_text() or ""):
            compiled = lowered.compile()
        # As compile_inference's programs: host inputs of a program with big buffers go to the device first, so
        # that it runs on the calling thread (MobileNet v2 at batch 16: 160 -> 132 ms a call, 2 AMD EPYC cores).
        device = default_device()
        return compiled, device.platform == "cpu" and _maps_afresh_on_a_worker(compiled), device


def load_stablehlo(path: str, batch_sizes: Sequence[int] | None = None) -> StableHLOModel:
    """Load a file written by :func:`export_stablehlo`. Needs only JAX (``jax.export.deserialize``).
    ``batch_sizes``: see :class:`StableHLOModel`."""
    data = read_bytes(path)
    try:
        exported = jax.export.deserialize(bytearray(data))
    except ImportError as e:
        raise UnsupportedError(f"loading a StableHLO export needs {e.name or 'flatbuffers'}: "
                               "pip install 'caffejax[export]'") from None
    except Exception as e:  # flatbuffers raises assorted errors on a file that is not an export
        raise CaffejaxError(f"{path}: not a caffejax StableHLO export ({type(e).__name__}: {e})") from None
    try:
        return StableHLOModel(exported, batch_sizes)
    except CaffejaxError as e:
        raise prefixed(e, path) from None


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
