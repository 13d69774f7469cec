"""``caffejax.compile_inference``: a net's outputs as one optimised XLA program.

``Net.forward`` is Caffe's forward: every blob, Caffe's layouts, net surgery visible on the next pass. For
serving, only the outputs matter: ``compile_inference(net)`` snapshots the net's weights, runs the
optimisation passes of :mod:`caffejax.lower.optimize` (BatchNorm folding, channels-last layout, faster
convolution kernels), lays the weights out once, and returns a function ``inputs -> outputs`` compiled once
per input-shape signature::

    infer = caffejax.compile_inference(net)                  # float32, every pass
    probs = infer({"data": images})["prob"]
    fast = caffejax.compile_inference(net, dtype=jnp.bfloat16)  # opt-in: bf16 storage, float32 sums
    served = caffejax.compile_inference(net, batch_sizes=(1, 4, 16))  # 3 programs for any batch size

Later changes to the net's weights are not seen: compile again after net surgery. Several threads may call the
function at once (each program is compiled once; a net with Python layers runs one call at a time). It is pure:
RNN/LSTM layers without expose_hidden start every call from a zero state (``Net.forward`` carries it over
between calls, as Caffe does); feed h_0/c_0 through expose_hidden to carry it yourself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Callable, Container, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from caffejax.errors import CaffejaxError, ShapeError, TopsSizedByData, UnknownBlobError, UnsupportedError
from caffejax.frontend.ir import Graph, stage_interface
from caffejax.lower.optimize import (DEFAULT_PASSES, Plan, adopted_by_device, aligned_copy, check_passes, make_plan,
                                     optimize, prepare_params, run_plan)
from caffejax.lower.program import check_one_program, run_host_layers
from caffejax.lower.python_layer import calls_back
from caffejax.lower.registry import get_rule
from caffejax.runtime.blob import as_numbers, bits_digest, same_bits
from caffejax.runtime.memory import DeviceMemoryErrors, garbage_collection_paused
from caffejax.runtime.program_cache import compile_program, describe_graph
from caffejax.runtime.xla_options import bf16_matrix_programs, compiler_options, ynn_multiplies_a_broadcast

Shapes = tuple[tuple[str, tuple[int, ...]], ...]


def built_once(built: dict, key, lock: threading.RLock, build: Callable[[], Any]) -> Any:
    """``built[key]``, made by ``build()`` under ``lock`` where it is not there yet: threads calling a compiled
    function at once (a threaded server's first requests) wait for one thread's build of a program, instead of
    each compiling its own (four threads' first calls of SqueezeNet v1.1 at one shape compiled it four times) and
    adopting the weights each time over (SharedWeights). Looked up without the lock once built."""
    value = built.get(key)
    if value is None:
        with lock:
            value = built.get(key)
            if value is None:
                with garbage_collection_paused():
                    value = built[key] = build()
    return value


class SharedWeights:
    """The prepared weights of one compile_inference's programs, on the device once: a program built for new input
    shapes reads an array kept for a layer where it prepares the same bits, and adds its own where they differ (a
    3x3 convolution's Winograd filters on small images, its plain ones on big images). Each program held a copy
    of its own before: FCN-8s's resident memory grew by 484-534 MB (its weights) for each new input size, and
    now by 7-12 MB from the third on (the second's spare copies stay with the allocator). An array on one CPU
    device is host memory, compared with a new one there; elsewhere (another device, or replicated over several)
    a digest of the host array it came from stands in for it."""

    def __init__(self, dtype, put: Callable[[np.ndarray], jax.Array] | None = None):
        self.dtype = dtype
        self._put = put or (lambda host: adopted_by_device(host, dtype))  # (over devices: replicated on each)
        self._kept: dict[tuple[str, int], list[tuple[jax.Array, bytes | None]]] = {}

    def adopt(self, layer: str, index: int, host: np.ndarray) -> jax.Array:
        """The device array of the ``index``-th prepared array of ``layer``: a kept one holding ``host``'s bits in
        the weights' dtype, else ``host`` adopted by the device (and kept from now on)."""
        host = np.asarray(host, self.dtype)
        kept = self._kept.setdefault((layer, index), [])
        for array, digest in kept:
            if array.shape == host.shape and array.dtype == host.dtype and (
                    same_bits(np.asarray(array), host) if digest is None else digest == bits_digest(host)):
                return array
        array = self._put(host)
        kept.append((array, None if _in_host_memory(array) else bits_digest(host)))
        return array


def _in_host_memory(array: jax.Array) -> bool:
    """Whether the array is on one CPU device, whose memory is the host's (np.asarray of it is a view, not a
    transfer nor a gathering of copies)."""
    devices = array.devices()
    return len(devices) == 1 and next(iter(devices)).platform == "cpu"


def _kept_weight(a) -> np.ndarray:
    """A weight as compile_inference keeps it: an array on one CPU device as a view of its memory, which nothing
    writes (a blob given new data takes a new array; a solver gives up no array anything else holds) and which
    the device adopts as it is; anything else as an aligned copy. Copied, a net's weights were held once more
    from compile_inference on: AlexNet's resident memory (weights loaded, compile_inference, one forward at
    batch 1) went 1013 -> 775 MB."""
    if isinstance(a, jax.Array) and _in_host_memory(a):
        return np.asarray(a)
    return aligned_copy(a)


@dataclasses.dataclass
class _Program:
    plan: Plan  # its arrays' shapes only (InferenceFunction._optimized)
    params: dict[str, list[jax.Array]]
    run: Callable[..., dict[str, jax.Array]]
    feeds: list[tuple[str, str]]  # (input blob, value id) pairs of the graph's fed layers
    device: Any = None  # where the program runs and its inputs go (None: split over a mesh)
    inputs_to_device_first: bool = False  # see _maps_afresh_on_a_worker

    def __post_init__(self):
        # Layers run on the host after the program (Layer.runs_on_host); looked up once, not on every call.
        self.host_layers = bool(self.plan.graph.made_on_host)


class InferenceFunction:
    """``infer(inputs) -> outputs``: input arrays by input blob name (NCHW, any batch size; the Input layers' and
    the data layers' tops, ``inputs``) to the net's output blobs (float32). ``compile_count`` counts the
    programs built (one per input-shape signature; a net run in stages, one per stage and the shapes it
    reads: :class:`_Stages`). With ``batch_sizes`` a call runs the program of the smallest of them that holds
    its rows (:func:`in_batches`)."""

    def __init__(self, net, passes: Sequence[str] | None, dtype, devices=None, blobs: Sequence[str] = (),
                 batch_sizes: Sequence[int] | None = None):
        self.dtype = jnp.dtype(dtype)
        if not jnp.issubdtype(self.dtype, jnp.floating):
            raise CaffejaxError(f"compile_inference needs a floating dtype, got {self.dtype}")
        # The programs take their inputs in float32 at least (Caffe's blobs) and round them to ``dtype`` (_in_dtype).
        self._feed_dtype = jnp.promote_types(self.dtype, jnp.float32)
        self.passes = default_passes(self.dtype) if passes is None else tuple(passes)
        check_passes(self.passes)
        self._net = net
        # The weights as they are now (later changes to the net's blobs do not reach the programs), in memory
        # the device can take as its own (prepare_params).
        self._weights = {owner: [_kept_weight(a) for a in arrays] for owner, arrays in net.param_arrays().items()}
        self._programs: dict[Shapes, _Program] = {}
        # The function may be called from several threads at once. Each program is built once (built_once, under
        # the lock). A net with Python layers runs one call at a time: a layer's object, and its top blobs, are one
        # for all calls, and a layer found to size its tops by the data rebuilds the net (TopsSizedByData).
        self._lock = threading.RLock()
        self._one_call_at_a_time = (self._lock if any(calls_back(layer) for layer in net.graph.layers)
                                    else contextlib.nullcontext())
        # The caller gives the batch a data layer would read (a Python data layer is not run either).
        self.inputs = list(net.graph.fed)
        self._input_names, self._sorted_inputs = frozenset(self.inputs), sorted(self.inputs)
        unknown = [blob for blob in blobs if blob not in net.blobs]
        if unknown:
            raise UnknownBlobError(f"compile_inference: the net has no blobs {unknown}")
        if blobs and devices is not None:
            raise UnsupportedError("compile_inference: blobs= besides the outputs is not available over devices")
        # pycaffe's forward(blobs=...): blobs handed back besides the outputs (the ROIs of a Faster R-CNN, which
        # its box deltas are relative to), as Net.forward's blobs hold them
        self.outputs = list(dict.fromkeys([*net.outputs, *blobs]))
        self._mesh = None
        # The programs' prepared weights: one copy (on each device) for all input shapes.
        self._shared = SharedWeights(self.dtype)
        if devices is not None:
            from caffejax.runtime.distributed import batch_mesh, replicated

            mesh = self._mesh = batch_mesh(devices)
            self._shared = SharedWeights(self.dtype, lambda host: replicated(host, mesh))
        self._stages = self._in_stages() if net.graph.staging_layers else None
        self.batch_sizes = None if batch_sizes is None else self._checked_batch_sizes(batch_sizes)

    def _checked_batch_sizes(self, batch_sizes: Sequence[int]) -> tuple[int, ...]:
        """``batch_sizes`` sorted, once they are positive whole numbers (multiples of the devices splitting each
        batch) and the net computes every row of a batch apart from the others (:func:`rows_mixed`)."""
        sizes = sorted_batch_sizes(batch_sizes, "compile_inference: ")
        if self._mesh is not None:
            from caffejax.runtime.distributed import devices_of_this_process

            devices = len(devices_of_this_process(self._mesh))
            if any(s % devices for s in sizes):
                raise CaffejaxError(f"compile_inference: batch_sizes {list(sizes)} must be multiples of the {devices} "
                                    "devices each batch is split over")
        _refuse_mixed_rows(self._net.graph.name, rows_mixed(self._net.graph, with_shapes=False) + (
            ["layers run on the host between programs"] if self._stages is not None else []))
        return sizes

    def _in_stages(self) -> "_Stages":
        if self._mesh is not None:
            check_one_program(self._net.graph.layers)  # each device would run the host layer on its rows
        return _Stages(self)

    @property
    def compile_count(self) -> int:
        return len(self._programs) + (len(self._stages.programs) if self._stages is not None else 0)

    def plan(self, shapes: Mapping[str, Sequence[int]]) -> Plan:
        """The optimised plan for these input shapes (what the program runs; for inspection), its arrays as the
        passes leave them (folded, merged), before its kernels prepare them: the program keeps only the prepared
        ones (:meth:`_optimized`), so they are worked out again here."""
        if self._stages is not None:
            raise UnsupportedError("compile_inference: the net runs in stages around a layer run on the host "
                                   "(Graph.staging_layers); there is no one plan to show")
        signature = self._signature(shapes)
        self._program(signature)
        return self._optimized_plan(self._source_graph(signature))

    def warm_up(self, shapes: Mapping[str, Sequence[int]] | None = None) -> int:
        """Compile and run once ahead of the first calls, as a server does before it takes requests: the program
        for the input ``shapes`` (default: the net's fed blobs as they are shaped now) or, with ``batch_sizes``, one
        for each size in place of their axis 0. Returns how many programs that compiled (none already there).
        The run on zeros is part of it: a compiled program's first run took 7-46 ms more than the next ones (LeNet
        on 2 AMD EPYC cores, a forward of 0.5-1.5 ms)."""
        if self._stages is not None:
            raise UnsupportedError("compile_inference: the net runs in stages around a layer run on the host "
                                   "(Graph.staging_layers), whose later programs are shaped by what that layer "
                                   "makes: warm it up with a call")
        shapes = {name: tuple(self._net.blobs[name].shape) for name in self.inputs} if shapes is None else shapes
        if shapes.keys() != self._input_names:
            raise CaffejaxError(f"warm_up: shapes for {sorted(shapes)} do not match the net's inputs {self.inputs}")
        before = self.compile_count
        for size in self.batch_sizes or (None,):
            jax.block_until_ready(self._call({name: np.zeros(shape if size is None else (size, *shape[1:]),
                                                             self._feed_dtype) for name, shape in shapes.items()}))
        return self.compile_count - before

    def __call__(self, inputs: Mapping[str, Any]) -> dict[str, jax.Array]:
        if inputs.keys() != self._input_names:
            raise CaffejaxError(f"inputs {sorted(inputs)} do not match the net's inputs {self.inputs}")
        with InputValueErrors(inputs):
            if self.batch_sizes is None:
                return self._call(inputs)
            # A serving process fed every batch size from 1 to 64 compiles 7 programs with batch_sizes (1, 2, 4,
            # ..., 64), not 64 (ResNet-50's take 0.8-2.5 s each on 2 cores; the weights' prepared forms are kept
            # once for all, SharedWeights).
            return in_batches(self._call, inputs, self.batch_sizes, "compile_inference(batch_sizes=...)")

    def _call(self, inputs: Mapping[str, Any]) -> dict[str, jax.Array]:
        with self._one_call_at_a_time:
            return self._call_program(inputs)

    def _call_program(self, inputs: Mapping[str, Any]) -> dict[str, jax.Array]:
        if self._stages is not None:
            try:
                return self._stages(inputs)
            except TopsSizedByData:  # a Python layer learnt at a build (_graph): the stages are built anew
                self._net.reshape()
                self._stages = self._in_stages()
                return self._call_program(inputs)
        # _signature's key, made without its int() of every dim: np.shape gives Python ints. At LeNet's batch 1
        # the Python around the program call is a tenth of the call.
        signature = tuple((name, np.shape(inputs[name])) for name in self._sorted_inputs)
        # A Python layer's failure as its typed error; buffers the device cannot hold as an OutOfMemoryError.
        try:
            program = self._programs.get(signature) or self._program(self._signature(dict(signature)))
            fed = {value: _as_input(inputs[blob], self._feed_dtype, program.device) for blob, value in program.feeds}
            if program.inputs_to_device_first:
                fed = _inputs_to_device(fed)
            with self._net._python_layers, DeviceMemoryErrors(program.plan.graph):
                outputs = program.run(program.params, fed)
        except TopsSizedByData:
            # The net rebuilt runs that Python layer on the host: after the program, or between two when compiled
            # layers read its tops; its first call takes the tops this forward made.
            self._programs.pop(signature, None)
            self._net.reshape()
            if self._net.graph.staging_layers:
                self._stages = self._in_stages()
            return self._call_program(inputs)
        return (_finished_on_host(program.plan.graph, outputs, self._net._python_layers) if program.host_layers
                else outputs)

    def _signature(self, shapes: Mapping[str, Sequence[int]]) -> Shapes:
        return tuple((name, tuple(int(d) for d in shapes[name])) for name in sorted(shapes))

    def _program(self, signature: Shapes) -> _Program:
        return built_once(self._programs, signature, self._lock, lambda: self._build_program(signature))

    def _optimized_plan(self, graph: Graph) -> Plan:
        """``graph``'s plan from the kept weights, through this function's passes."""
        return optimize(make_plan(graph, self._weights), self.passes)

    def _optimized(self, graph: Graph) -> tuple[Plan, dict[str, list[jax.Array]]]:
        """``graph``'s optimised plan and its arrays prepared for its kernels, on the device. The plan keeps its
        arrays' shapes only: those the passes made (a BatchNorm folded into a convolution's filters) would be held
        beside their prepared form for the program's life (ResNet-50: 90 MB for each input shape)."""
        plan = self._optimized_plan(graph)
        params = prepare_params(plan, self.dtype, self._shared.adopt)
        shapes = {name: [jax.ShapeDtypeStruct(np.shape(a), np.result_type(a)) for a in arrays]
                  for name, arrays in plan.params.items()}
        return dataclasses.replace(plan, params=shapes), params

    def _source_graph(self, signature: Shapes) -> Graph:
        """The graph a program for these input shapes is optimised from (over devices: one device's rows)."""
        return self._graph(dict(signature)) if self._mesh is None else self._per_device_graph(signature)[0]

    def _rows_kept_apart(self, graph: Graph) -> Graph:
        """``graph``, which a program is built from, checked at its shapes as ``batch_sizes`` needs (if given)."""
        if self.batch_sizes is not None:
            _refuse_mixed_rows(graph.name, rows_mixed(graph))
        return graph

    def _build_program(self, signature: Shapes) -> _Program:
        if self._mesh is not None:
            return self._sharded_program(signature)
        plan, params = self._optimized(self._rows_kept_apart(self._source_graph(signature)))
        feeds = list(plan.graph.fed.items())
        fed = {value: jax.ShapeDtypeStruct(plan.graph.value_shapes[value], self._feed_dtype) for _, value in feeds}
        params, run = _compiled(plan, self.dtype, params, fed, _describe(plan, self.passes))
        device = default_device()  # (where prepare_params put the weights)
        return _Program(plan, params, run, feeds, device,
                        inputs_to_device_first=device.platform == "cpu" and _maps_afresh_on_a_worker(run))

    def _sharded_program(self, signature: Shapes) -> _Program:
        """The plan one device runs on its rows of the batch, in one jitted shard_map over the mesh: inputs
        split along axis 0, weights replicated, per-example outputs concatenated back (batch-independent ones
        averaged). Not kept in the program cache (its executables are tied to the devices)."""
        from caffejax.runtime.distributed import data_parallel, local_value, shard_batch

        one_device, per_example = self._per_device_graph(signature)
        plan, params = self._optimized(self._rows_kept_apart(one_device))
        feeds = list(plan.graph.fed.items())
        sharded = data_parallel(_in_dtype(plan, self.dtype), self._mesh,
                                {blob: per_example[blob] for blob in plan.graph.program_outputs},
                                compiler_options=compiler_options(plan.graph, dtype=self.dtype))
        mesh = self._mesh

        def run(params, fed):
            outputs = sharded(params, shard_batch(fed, mesh))
            return outputs if jax.process_count() == 1 else {b: local_value(y) for b, y in outputs.items()}

        return _Program(plan, params, run, feeds)

    def _per_device_graph(self, signature: Shapes) -> tuple[Graph, dict[str, bool]]:
        """distributed.per_device_graph at these input shapes, over this process's devices of the mesh."""
        from caffejax.runtime.distributed import devices_of_this_process, per_device_graph

        local_devices = len(devices_of_this_process(self._mesh))
        try:
            return per_device_graph(self._net, dict(signature), local_devices)
        except ShapeError as error:
            raise ShapeError(f"compile_inference: the net does not accept inputs of shapes {dict(signature)} "
                             f"over {local_devices} devices: {error}") from None

    def _graph(self, shapes: Mapping[str, tuple[int, ...]]) -> Graph:
        """The net's graph with its inputs at ``shapes`` (Caffe's Reshape of every layer). Where shapes after a
        Python layer that may size its tops by the data do not fit (Graph.deferred_errors), that layer runs on
        the host from now on: TopsSizedByData, on which the caller rebuilds, as for a forward that found it."""
        try:
            graph = self._net.graph_at(shapes)
        except ShapeError as error:
            raise ShapeError(f"compile_inference: the net does not accept inputs of shapes {dict(shapes)}: "
                             f"{error}") from None
        if graph.deferred_errors and self._net._learn_layers_sizing_by_data(graph):
            raise TopsSizedByData(f"compile_inference: layers {sorted(graph.deferred_errors)} do not fit the "
                                  "shapes a Python layer's reshape gave; it runs on the host from now on")
        return graph if self.outputs == graph.outputs else dataclasses.replace(graph, outputs=self.outputs)


@dataclasses.dataclass
class _StageProgram:
    plan: Plan  # its arrays' shapes only (InferenceFunction._optimized)
    params: dict[str, list[jax.Array]]
    run: Callable[..., dict[str, jax.Array]]
    reads: list[str]  # the values it takes from the inputs, earlier stages and host layers


class _Stages:
    """compile_inference of a net whose compiled layers read what a layer run on the host makes
    (Graph.staging_layers: Faster R-CNN's and R-FCN's ROI pooling on the proposals): the layers before that
    layer as one optimised program, the layer on the host, then the layers after it as another, built for the
    shapes it made (Net.forward's stages, with the inference passes in each). A stage's program is compiled
    once per shapes of the values it reads: the layers before the proposals once per input shape, those after
    them once per number of proposals too."""

    def __init__(self, owner: InferenceFunction):
        self.owner = owner
        self.programs: dict[tuple, _StageProgram] = {}
        self._graphs: dict[tuple, Graph] = {}  # by the shapes of the inputs and the host layers' tops

    def _graph(self, shapes: Mapping[str, tuple[int, ...]]) -> Graph:
        """The net's graph at these input and host-made shapes, built once: a build of VGG16's Faster R-CNN
        takes 0.1-0.2 s, a tenth of its forward at 300 x 400."""
        return built_once(self._graphs, tuple(sorted(shapes.items())), self.owner._lock,
                          lambda: self.owner._graph(shapes))

    def __call__(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        owner = self.owner
        python_layers = owner._net._python_layers
        shapes = {name: tuple(np.shape(inputs[name])) for name in owner.inputs}
        graph = self._graph(shapes)
        values: dict[str, Any] = {graph.fed[name]: inputs[name] for name in owner.inputs}
        begin = 0
        while True:
            stage = next((i for i in graph.staging_layers if i >= begin), len(graph.layers))
            if begin < stage:
                program = self._program(graph, begin, stage, values)
                fed = {v: _as_input(values[v], owner._feed_dtype, None) for v in program.reads}
                try:
                    with python_layers, DeviceMemoryErrors(program.plan.graph):
                        values.update(program.run(program.params, fed))
                except TopsSizedByData:
                    # Another Python layer sized its tops by the data: the net rebuilt runs it on the host too,
                    # and this stage runs again, split around it (its first host call takes those tops).
                    graph = self._rebuilt(shapes)
                    continue
                # Layers run on the host within the range (whose tops no compiled layer reads) finish it.
                values.update(run_host_layers(graph.layers[begin:stage], values, python_layers))
            if stage == len(graph.layers):
                break
            host = graph.layers[stage]
            made = run_host_layers([host], values, python_layers)
            values.update(made)
            shapes.update((top, made[value].shape) for top, value in zip(host.tops, host.top_values))
            try:
                graph = self._graph(shapes)  # the layers after it shaped by what it made
            except TopsSizedByData:
                # Layers after it do not fit what it made, and a Python layer before them may size its tops by
                # the data: that layer runs on the host from now on. The pass goes on from here, on the values
                # it has: the host layers before are not run again (a Python layer's forward once a pass).
                graph = self._rebuilt(shapes)
            begin = stage + 1
        return {blob: values[graph.blob_value[blob]] for blob in graph.outputs}

    def _rebuilt(self, shapes: Mapping[str, tuple[int, ...]]) -> Graph:
        """The graph at ``shapes`` once the net has learnt a Python layer sizing its tops by the data (it runs on the
        host now): the graphs and programs built before are dropped, since which layers they compile changed.
        Layer indices and value ids do not change, so a pass in progress goes on with its values."""
        self.owner._net.reshape()
        self._graphs.clear()
        self.programs.clear()
        return self._graph(shapes)

    def _program(self, graph: Graph, begin: int, end: int, values: Mapping[str, Any]) -> _StageProgram:
        layers, reads, needed = stage_interface(graph, begin, end, {graph.blob_value[b] for b in graph.outputs})
        key = (begin, end, tuple((v, tuple(np.shape(values[v]))) for v in reads))
        return built_once(self.programs, key, self.owner._lock, lambda: self._build(graph, layers, reads, needed))

    def _build(self, graph: Graph, layers, reads: list[str], needed: set[str]) -> _StageProgram:
        """The optimised program of one stage (:func:`stage_interface`): a graph of its compiled layers that
        takes ``reads`` (by value) and hands back, by value, those of them and of its tops that are ``needed`` (not
        the inputs it does not read: the caller has them)."""
        owner = self.owner
        returned = [v for v in dict.fromkeys([*reads, *(v for layer in layers if not layer.is_input
                                                        for v in layer.top_values)]) if v in needed]
        stage = dataclasses.replace(graph, layers=layers, outputs=returned, blob_value={v: v for v in returned})
        plan, params = owner._optimized(stage)
        fed = {v: jax.ShapeDtypeStruct(graph.value_shapes[v], owner._feed_dtype) for v in reads}
        description = _describe(plan, owner.passes)
        params, run = _compiled(plan, owner.dtype, params, fed,
                                None if description is None else [*description, f"reads {reads}"])
        return _StageProgram(plan, params, run, reads)


# A program whose prepared weights take at most this many bytes holds them as constants instead of taking them
# as arguments. Every argument costs each call time in JAX's and XLA's dispatch, and XLA folds at compile time
# what a program computes from constants alone (a weight's transpose, the test of a conditional on it: see
# common.unfused). Measured on 2 Sapphire Rapids cores, compile_inference called in alternating blocks (medians):
# LeNet at batch 1 0.159 -> 0.140 ms (float32; 0.88-0.94 of the time over five series) and 0.224 -> 0.199 ms
# (bfloat16; 0.86-0.95, once 1.03); MTCNN's det1 at 1x3x48x64 0.424 -> 0.407 ms, det2 at batch 8 0.754 -> 0.677,
# det4 (73 arrays, 4.0 MB) 2.49 -> 2.36 ms (0.89-0.98 for the four nets, det1 once 1.07); LeNet at batch 16
# 0.98-1.01 in float32 and 1.02-1.04 in bfloat16 (traced, that program is not slower: 0.65 against 0.70 ms).
# Compile times alike (0.1-0.9 s). Bigger weights stay arguments: the executable, and the program cache on disk,
# would hold another copy of them, and they are read far longer than they are dispatched.
CONSTANT_WEIGHTS_MAX_BYTES = 4 << 20


def _compiled(plan: Plan, dtype, params: dict[str, list[jax.Array]], fed: Mapping[str, Any],
              description: list[bytes | str] | None) -> tuple[dict[str, list[jax.Array]], Callable]:
    """The plan's program, computing in ``dtype``, compiled for the inputs ``fed`` (loaded from the program cache
    under ``description`` where it holds it), and the weights to call it with: ``params``, or none where the
    program holds them as constants (:data:`CONSTANT_WEIGHTS_MAX_BYTES`)."""
    function = _in_dtype(plan, dtype)
    options = compiler_options(plan.graph, dtype=dtype)
    arrays = jax.tree.leaves(params)
    # (on the first device only: an executable the program cache loads runs there, and with no weights among its
    # arguments compile_program would not see that the program belongs elsewhere)
    if (jax.default_backend() == "cpu" and sum(a.nbytes for a in arrays) <= CONSTANT_WEIGHTS_MAX_BYTES
            and all(a.devices() == {jax.devices()[0]} for a in arrays)):
        held = params

        def run(_, inputs):  # named as _in_dtype's: the program's operations are "jit(run)/<layer>/..."
            return function(held, inputs)

        with _constants_embedded(CONSTANT_WEIGHTS_MAX_BYTES):
            compiled = compile_program(run, ({}, fed), options=options, description=None if description is None else [
                *description, "weights held", *(bits_digest(np.asarray(a)) for a in arrays)])  # (what it computes)
        # Where XLA made a held array, or a part of one the program multiplies by, a broadcast (all its values
        # one value: an untrained net's zeros, a zeroed group of filters), YNNPACK's dot would multiply by it
        # wrongly: the program takes the weights instead. (The program cache keeps the held one; a later process
        # loads it, finds the same and compiles this one too.)
        if not ynn_multiplies_a_broadcast(compiled.as_text() or ""):
            return {}, compiled
    return params, compile_program(function, (params, fed), options=options, description=description)


def _constants_embedded(max_bytes: int):
    """A context in which jax puts closed-over constants of up to ``max_bytes`` each into the program itself. Since
    jax 0.11 (``jax_use_simplified_jaxpr_constants``) it hoists any over ``jax_embedded_constants_max_bytes``
    (1 KiB) out as hidden arguments of the executable, passed at every call: held weights would be arguments
    again (jax 0.12.1: LeNet's program took its 5 arrays so). Older jax embeds them all."""
    from jax._src import config

    limit = getattr(config, "embedded_constants_max_bytes", None)
    return limit(max(max_bytes, limit.value)) if callable(limit) else contextlib.nullcontext()


def _describe(plan: Plan, passes: Sequence[str]) -> list[bytes | str] | None:
    """What the plan's program computes, for the program cache (None: not cacheable)."""
    described = describe_graph(plan.graph, plan.kernels)
    return None if described is None else ["inference", repr(tuple(passes)), *described]


def rows_mixed(graph: Graph, with_shapes: bool = True) -> list[str]:
    """What in ``graph`` would change a row's values if its batch were padded with more rows or cut in parts: the
    layers that do not compute every row of their tops from the same row of their bottoms alone
    (LayerRule.rows_apart; a fed layer's rows are the caller's) and, ``with_shapes``, the blobs whose axis 0 is
    not the fed blobs' one common number of rows. Empty where nothing would."""
    mixed = [f"layer '{layer.name}' ({layer.type})" for layer in graph.layers if not (
        layer.is_input or get_rule(layer.type).keeps_rows_apart(
            layer.proto, graph.phase, [graph.value_shapes.get(v) for v in layer.bottom_values]))]
    if not with_shapes:
        return mixed
    fed = {tuple(graph.value_shapes[value] or ())[:1] for value in graph.fed.values()}
    rows = fed.pop() if len(fed) == 1 else ()
    return mixed + [f"blob '{top}' {shape}" for layer in graph.layers
                    for top, value in zip(layer.tops, layer.top_values)
                    if (shape := graph.value_shapes.get(value)) is not None and (not rows or tuple(shape)[:1] != rows)]


def _refuse_mixed_rows(net_name: str, mixed: Sequence[str]) -> None:
    """The UnsupportedError of ``batch_sizes`` for a net where ``mixed`` (:func:`rows_mixed`) names something."""
    if mixed:
        raise UnsupportedError(
            f"compile_inference(batch_sizes=...) pads a batch with rows, which needs every layer to compute each "
            f"row of its tops from the same row of its bottoms alone (LayerRule.rows_apart) and every blob to "
            f"hold one row per row of the inputs; in net '{net_name}' {', '.join(mixed)} do not. Leave "
            "batch_sizes out to compile a program per batch size")


# Padding and cutting batches (in_batches). Arrays in host memory go through NumPy views: an
# eager jnp slice, repeat or concatenate compiles a program for every new number of rows, and a server's first
# request of each size paid it (LeNet on 2 AMD EPYC cores: 30-80 ms for the outputs' slice, 110-190 ms to pad a
# device array, against a forward of 1-2 ms).

def sorted_batch_sizes(batch_sizes: Sequence[int], who: str) -> tuple[int, ...]:
    """``batch_sizes`` sorted, once they are a non-empty collection of positive whole numbers (else a
    CaffejaxError, its message after ``who``)."""
    try:
        sizes = [] if isinstance(batch_sizes, (str, bytes)) else sorted(set(batch_sizes))
    except TypeError:  # not iterable, or sizes that do not compare
        sizes = []
    if not sizes or not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) and s > 0 for s in sizes):
        raise CaffejaxError(f"{who}batch_sizes must be a non-empty list of positive whole numbers, got {batch_sizes!r}")
    return tuple(int(s) for s in sizes)


def in_batches(run: Callable[[Mapping[str, Any]], Mapping[str, Any]], inputs: Mapping[str, Any],
               batch_sizes: Sequence[int], who: str, batched: Sequence[str] | None = None,
               cut: Container[str] | None = None) -> dict[str, Any]:
    """``run``'s outputs for ``inputs``' rows, from the program of the smallest of ``batch_sizes`` (sorted) that
    holds them: the ``batched`` inputs (default: all) padded (:func:`_padded_rows`) and the ``cut`` outputs
    (default: all) cut back to their rows; more rows than the largest size run in parts of that size, their
    ``cut`` outputs joined and the others taken from the first part. ``who`` heads the ShapeError of inputs
    whose rows differ."""
    batched = list(inputs) if batched is None else batched
    rows = {name: np.shape(inputs[name])[0] if np.ndim(inputs[name]) else None for name in batched}
    if None in rows.values() or len(set(rows.values())) != 1:
        raise ShapeError(f"{who}: the inputs must have the same number of rows (axis 0) to pad them; their shapes "
                         f"are { {name: np.shape(inputs[name]) for name in batched} }")
    n, largest = next(iter(rows.values())), batch_sizes[-1]
    if n > largest:
        inputs = {name: _host_view(x) if name in rows else x for name, x in inputs.items()}
        parts = [in_batches(run, {name: x[i:i + largest] if name in rows else x for name, x in inputs.items()},
                            batch_sizes, who, batched, cut) for i in range(0, n, largest)]
        return {blob: _joined([part[blob] for part in parts]) if cut is None or blob in cut else parts[0][blob]
                for blob in parts[0]}
    size = next(s for s in batch_sizes if s >= n)
    if size == n:
        return run(inputs)
    outputs = run({name: _padded_rows(_host_view(x), size) if name in rows else x for name, x in inputs.items()})
    return {blob: _first_rows(y, n) if cut is None or blob in cut else y for blob, y in outputs.items()}


def _host_view(x):
    """A device array in host memory as a NumPy view of it; anything else as it is."""
    return np.asarray(x) if isinstance(x, jax.Array) and _in_host_memory(x) else x


def _padded_rows(x, rows: int):
    """``x`` with rows added after its own up to ``rows``, copies of its last one: values the net computes from a
    real row stay finite where zeros might not (a Log, a Power); zeros only where ``x`` has no row."""
    missing = rows - np.shape(x)[0]
    if missing == 0:
        return x
    xp = jnp if isinstance(x, jax.Array) else np
    x = xp.asarray(x)
    fill = xp.repeat(x[-1:], missing, axis=0) if x.shape[0] else xp.zeros((missing,) + x.shape[1:], x.dtype)
    return xp.concatenate([x, fill])


def _first_rows(y: jax.Array, n: int) -> jax.Array:
    """The first ``n`` rows of an output; in host memory, the device adopts the NumPy view of them as it is."""
    return adopted_by_device(np.asarray(y)[:n], y.dtype) if _in_host_memory(y) else y[:n]


def _joined(parts: Sequence[jax.Array]) -> jax.Array:
    """Outputs of consecutive parts of a batch, joined along axis 0."""
    if all(_in_host_memory(part) for part in parts):
        return adopted_by_device(np.concatenate([np.asarray(part) for part in parts]), parts[0].dtype)
    return jnp.concatenate(parts)


class InputValueErrors:
    """Calls of a compiled net inside it (``with InputValueErrors(inputs):``): NumPy's ValueError or TypeError for an
    input it cannot read as numbers (strings, ragged lists) comes out as the InputValueError naming that input
    (blob.as_numbers); other errors pass as they are. A class with ``__exit__``, as PythonLayers is."""

    __slots__ = ("inputs",)

    def __init__(self, inputs: Mapping[str, Any]):
        self.inputs = inputs

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, traceback) -> bool:
        if kind is not None and issubclass(kind, (ValueError, TypeError)) and not issubclass(kind, CaffejaxError):
            for name, x in self.inputs.items():
                if not isinstance(x, jax.Array):
                    as_numbers(name, x, np.float32)  # (raises, naming it, for the first input it cannot read)
        return False


def default_device() -> jax.Device:
    """The device a program built now runs on: JAX's default one (``jax.default_device``'s where set)."""
    return next(iter(jax.device_put(np.zeros((), np.float32)).sharding.device_set))


def _as_input(x, dtype, device):
    """An input in the programs' input ``dtype`` on the program's device (None: the mesh places it);
    jax arrays already there go to the program as they are. A host array goes to a one-device program as it is:
    the compiled program's own call moves it in C++, where jax.device_put first would cost more than LeNet's
    whole forward at batch 1 (75 of 370 us, and the Python around it as much again). Programs with big buffers
    then move their host inputs in one call of their own (:func:`_maps_afresh_on_a_worker`)."""
    if not isinstance(x, jax.Array):
        x = np.asarray(x, dtype)
        return x if device is not None else jax.device_put(x)
    x = x if x.dtype == dtype else x.astype(dtype)
    if device is not None and x.sharding.device_set != {device}:  # a compiled program runs where it was built
        x = jax.device_put(x, device)
    return x


# Given a NumPy input, an XLA:CPU program waits for its transfer and then runs on a worker thread, whose glibc
# malloc arena serves a block that does not fit one of its 64 MB heaps with a fresh mmap (net.to_device).
_WORKER_HEAP_BYTES = 64 << 20


def _inputs_to_device(fed: dict[str, Any]) -> dict[str, jax.Array]:
    """The host inputs as device arrays of their own: each copied once into memory the device adopts as it is
    (optimize.aligned_copy); device arrays pass as they are. Not net.to_device: its identity program would be
    compiled at the first call of every input shape, 50-85 ms of a warm start on 2 AVX2 cores. Not a bare
    jax.device_put: on the CPU it adopts a caller's array that happens to be aligned, even with
    may_alias=False, and the caller may refill that array for its next batch while this program runs."""
    return {value: x if isinstance(x, jax.Array) else jax.device_put(aligned_copy(x)) for value, x in fed.items()}


def _maps_afresh_on_a_worker(compiled) -> bool:
    """Whether a compiled CPU program's scratch space or outputs are blocks a worker thread maps afresh, and so
    page-faults in again, on every call. Such a program gets its host inputs on the device first (_inputs_to_device)
    and then runs on the calling thread, whose malloc keeps freed memory (caffejax.runtime.memory). Measured on 2
    AVX2 cores, alternating processes, NumPy inputs at batch 16: MobileNet v2 (150 MB of scratch) 36-38 thousand
    faults and 215-234 ms a call -> at most 1.4 thousand and 157-178 ms (in one round of five the old code did
    not fault and took 178 ms too); GoogLeNet (112 MB) 29 thousand and 398-447 -> 349-430 ms; ResNet-50 (147 MB)
    851-933 -> 839-883 ms. Programs with less do not fault, and on the calling
    thread some ran slower (SqueezeNet v1.1, 62 MB: 104-110 -> 108-121 ms), so they keep the worker."""
    analysis = compiled.memory_analysis()
    return analysis is not None and max(analysis.temp_size_in_bytes,
                                        analysis.output_size_in_bytes) >= _WORKER_HEAP_BYTES


def _finished_on_host(graph: Graph, outputs: Mapping[str, Any], python_layers) -> dict[str, Any]:
    """The net's outputs from a program's (``Graph.program_outputs``): the layers run on the host after it (SSD's
    DetectionOutput) made from the blobs it returned."""
    made = run_host_layers(graph.layers, {graph.blob_value[blob]: array for blob, array in outputs.items()},
                           python_layers)
    return {blob: made[graph.blob_value[blob]] if graph.blob_value[blob] in made else outputs[blob]
            for blob in graph.outputs}


def _in_dtype(plan: Plan, dtype) -> Callable[..., dict[str, jax.Array]]:
    """The plan's function computing in ``dtype``, from inputs in float32 at least (``_feed_dtype``) to outputs in
    float32: the inputs are rounded to ``dtype`` inside the program, where XLA fuses the rounding into their
    first readers. NumPy's own float32 -> bfloat16 conversion (ml_dtypes) took 4.5-6.8 ms for SqueezeNet's
    input at batch 16 (16x3x227x227), a tenth of its bfloat16 forward."""
    def run(params, inputs):
        inputs = {value: x.astype(dtype) for value, x in inputs.items()}
        return {name: y.astype(jnp.float32) for name, y in run_plan(plan, params, inputs).items()}
    return run


def default_passes(dtype) -> tuple[str, ...]:
    """The passes ``compile_inference`` runs unless told: :data:`~caffejax.lower.optimize.DEFAULT_PASSES`, and
    for bfloat16 on a CPU with bfloat16 matrix instructions ``conv_gemm`` and ``conv_im2col`` too (and
    ``winograd_medium``, ``widen``, ``defer_rounding``). There a 1x1 convolution as a bfloat16 product runs on
    those instructions (:data:`~caffejax.runtime.xla_options.YNN_INDIVIDUAL_DOT`), while XLA's own bfloat16
    convolutions do not: 16x56x56x256 -> 64 took 2.4 ms against 81 ms (2 Sapphire Rapids cores), and
    ResNet-50's bfloat16 forward at batch 16 went from 571 to 371 ms (float32: 563 ms). Other convolutions as
    im2col products: AlexNet's bfloat16 forward at batch 16 82.9 -> 61.3 ms, GoogLeNet's 138.5 -> 118.5 ms
    (float32: about 95 and 170). A Concat of convolutions of one input becomes one im2col product
    (``merge_concat_convolutions``): SqueezeNet v1.1's bfloat16 forward took 0.87 of the time at batch 16
    and 0.82 at batch 1."""
    if not bf16_matrix_programs(dtype):
        return DEFAULT_PASSES
    return DEFAULT_PASSES + ("merge_concat_convolutions", "conv_gemm", "conv_im2col", "winograd_medium", "widen",
                             "defer_rounding")


def compile_inference(net, *, passes: Sequence[str] | None = None, dtype=jnp.float32,
                      devices=None, blobs: Sequence[str] = (),
                      batch_sizes: Sequence[int] | None = None) -> InferenceFunction:
    """The net's forward to its outputs, optimised for inference (see :mod:`caffejax.lower.optimize`).

    ``passes``: the optimisation passes to run (default: :func:`default_passes` for the dtype;
    ``()`` runs Caffe's rules unchanged).
    ``dtype``: the storage and compute dtype of weights and activations; ``jnp.bfloat16`` halves the memory
    traffic, products still summed in float32. Outputs are float32 either way.
    ``devices``: a number (the first N of ``jax.devices()``) or a list of devices to split each batch over,
    along axis 0 (a multiple of the device count); each device runs the optimised program on its rows, with
    the weights replicated. Several processes feed their own rows (see caffejax.runtime.distributed).
    ``blobs``: blobs to hand back besides the outputs, as pycaffe's ``net.forward(blobs=[...])`` (Faster R-CNN's
    ``rois``, which its ``bbox_pred`` deltas are relative to).
    ``batch_sizes``: the batch sizes to compile programs for, where the net computes each row of a batch apart
    from the others (every layer's ``rows_apart``; else UnsupportedError). A call runs the program of the
    smallest that holds its rows, its inputs padded with copies of their last row and the outputs cut back;
    more rows than the largest run in parts of the largest. Padded rows cost the time they take, and
    XLA may sum a row's products in another order at another batch size (a difference in the last bits).
    """
    return InferenceFunction(net, passes, dtype, devices, blobs, batch_sizes)
