"""Past one device: data-parallel training and sharded inference on a ``jax.sharding.Mesh``.

``caffejax.get_solver(path, devices=4)`` trains as ``caffe train --gpu 0,1,2,3`` does. The rule below is
that of Caffe's P2PSync (parallel.cpp before 1.0) and of its NCCL successor (parallel.cpp in 1.0), with
solver.cpp's Step and sgd_solver.cpp's ApplyUpdate:

1. Every device runs the prototxt's net on its own batch of the prototxt's size: N devices see N times the
   batch per iteration. Each device does the iter_size forward/backward passes, accumulating its diffs.
2. ``on_gradients_ready`` (after the passes, before ApplyUpdate) all-reduces the diffs: it SUMS them over
   the devices and then scales by ``1 / solver_count`` ("Loss functions divide gradients by the batch size,
   so to compensate for split batch, the root solver divides by number of solvers"; NCCL:
   ``ncclAllReduce(ncclSum)`` then ``caffe_gpu_scal(1 / solver_count)``). The diff is the MEAN over devices.
3. ApplyUpdate is then the one-device update of that mean diff: ClipGradients on it, Normalize divides by
   iter_size only (never by N), Regularize, ComputeUpdateValue, ``data -= diff``. Every device applies the
   same update to the same weights, so the weights stay equal (replicated). In one line::

       w <- w - rule( clip( (1/N) sum_d sum_i grad L(d, i) ) / iter_size + decay * w )

   For a loss that is a mean over its batch (SoftmaxWithLoss with no ignored label, EuclideanLoss, ...) this
   is one device training on the N batches concatenated.
4. BatchNorm in TRAIN normalises each device's batch with that batch's statistics, as each GPU does. Caffe
   keeps a copy of the running statistics per GPU (they drift apart) and snapshots the root's. caffejax
   keeps one copy: the mean of the N copies. The update is linear (``s <- maf * s + batch statistic``), so
   averaging every iteration gives exactly the mean of Caffe's N copies; a TEST net with use_global_stats
   reads that mean.
5. Random layers (Dropout) draw different numbers on every device (Caffe seeds solver r with
   ``random_seed + r``): the device's index is folded into the iteration's key.
6. Data layers: Caffe's DataLayer gives record i to solver rank ``i mod N`` (DataReader, later
   DataLayer::Skip). In one process, caffejax pulls N prototxt batches per pass and deals their records out
   the same way: device r gets records r, r + N, r + 2N, ... Deliberately for every data layer: in Caffe 1.0
   only Data and HDF5Data skip the other ranks' records; ImageData, WindowData and MemoryData give every
   GPU its own reader of the whole stream, so without shuffling the GPUs train on the same batch.
7. The test nets run on one device, with the trained weights (Caffe tests on the root solver only).
8. The loss shown is the mean of the devices' losses (Caffe shows the root solver's own loss).

The train net's blobs hold the global batch: ``solver.net.blobs['data']`` is N x the prototxt's batch along
axis 0, and rows ``[r * batch, (r + 1) * batch)`` are device r's. Feed one global batch; caffejax shards it.
Blobs a pass produces come back the same way: per-example blobs concatenated along axis 0, blobs that do not
depend on the batch size (the loss, Accuracy) averaged over devices. The weights in ``solver.net.params``
are the root device's copy; test nets, snapshots and ``net.forward()`` use them on that one device.

How it runs: one jitted ``jax.shard_map`` over a one-axis mesh named ``"batch"``. Inputs are sharded along
axis 0 (``PartitionSpec("batch")``), weights and solver history replicated (``PartitionSpec()``); inside,
each device runs the one-device iteration of ``caffejax.runtime.solver`` on its shard, and ``lax.pmean``
(an XLA all-reduce) averages the diffs, the loss and the rewritten BatchNorm statistics.

Several hosts: the same script runs once per host (one process each), after ``jax.distributed.initialize``::

    import jax
    jax.distributed.initialize()  # or (coordinator_address="host0:1234", num_processes=P, process_id=p)
    import caffejax
    solver = caffejax.get_solver("solver.prototxt", devices=jax.device_count())
    solver.solve()

The mesh spans every process's devices; each process holds and feeds its own part of the global batch (its
devices x the prototxt's batch), so ``solver.net.blobs`` show this process's rows. Each process's data layers
keep the batches ``k`` with ``k mod P == p`` of their stream (:class:`DataShard`) and deal them to its
devices as above: an iteration reads the same records as Caffe's, grouped per device differently (which
only BatchNorm's batch statistics can tell). The sources read and drop the other processes' batches; a
record-level skip inside caffejax.data's readers, like Caffe's DataLayer::Skip, would save that I/O. Only
process 0 writes snapshots.
On CPUs, multi-process collectives need ``jax.config.update("jax_cpu_collectives_implementation", "gloo")``.

Sharded inference: :func:`data_parallel_forward` runs a Net's forward with the batch split over devices;
:func:`data_parallel` with :func:`shard_batch`, :func:`replicated` and :func:`per_example_blobs` does the
same for any ``fn(weights, batch) -> blobs`` (an optimised inference program).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from caffejax.errors import CaffejaxError, DataError, ShapeError, UnsupportedError
from caffejax.frontend.ir import Graph
from caffejax.lower.optimize import layout_kernels
from caffejax.lower.program import NetProgram, run_host_layers
from caffejax.runtime.xla_options import compiler_options

AXIS = "batch"  # the mesh axis the batch is split along
PER_DEVICE = PartitionSpec(AXIS)
REPLICATED = PartitionSpec()

Devices = int | Sequence[jax.Device]


# ---- the mesh and placing arrays on it ---------------------------------------------------------------------------

def batch_mesh(devices: Devices) -> Mesh:
    """A one-axis mesh named ``"batch"``: the first ``devices`` of ``jax.devices()``, or the devices given.

    Each process's devices are kept together (in process order), so a process's rows of the global batch are
    one contiguous block. CaffejaxError for more devices than JAX sees, or for anything but a count or distinct
    ``jax.Device`` objects (device ids, a float, a string, a bool).
    """
    if isinstance(devices, (int, np.integer)) and not isinstance(devices, bool):
        available = jax.devices()
        if not 1 <= devices <= len(available):
            hint = (" (on CPUs, set XLA_FLAGS=--xla_force_host_platform_device_count=N before jax is imported)"
                    if available[0].platform == "cpu" else "")
            raise CaffejaxError(f"devices={devices}: JAX sees {len(available)} {available[0].platform} "
                                f"device(s){hint}")
        chosen = list(available[:devices])
    else:
        chosen = _listed_devices(devices)
        if not chosen or len(set(chosen)) != len(chosen):
            raise CaffejaxError(f"devices: give distinct jax devices, got {chosen!r}")
    chosen.sort(key=lambda d: d.process_index)  # stable: keeps the order within a process
    per_process = {}
    for device in chosen:
        per_process[device.process_index] = per_process.get(device.process_index, 0) + 1
    if jax.process_count() > 1 and (len(per_process) != jax.process_count() or len(set(per_process.values())) > 1):
        raise CaffejaxError(f"devices: every process needs the same number of devices in the mesh, got {per_process} "
                            f"(devices per process index) for {jax.process_count()} processes")
    return Mesh(np.array(chosen), (AXIS,))


def _listed_devices(devices) -> list[jax.Device]:
    """``devices`` as a list of jax devices; CaffejaxError for anything else (a float, a string, device ids:
    Python's own errors named neither the argument nor what it takes)."""
    wrong = CaffejaxError(f"devices: give a number of devices or a list of jax devices (jax.devices()), got "
                          f"{devices!r}")
    if isinstance(devices, (str, bytes)) or not isinstance(devices, Iterable):
        raise wrong
    chosen = list(devices)
    if not all(isinstance(device, jax.Device) for device in chosen):
        raise wrong
    return chosen


def shard_batch(tree, mesh: Mesh, axis: int = 0):
    """This process's rows of a global batch (every array of ``tree``) as global arrays split along ``axis``
    over the mesh. In one process that is the whole batch; its size along ``axis`` must divide evenly."""
    spec = PartitionSpec(*([None] * axis), AXIS)
    sharding = NamedSharding(mesh, spec)

    def place(x):
        if jax.process_count() == 1:
            return jax.device_put(x, sharding)
        return jax.make_array_from_process_local_data(sharding, np.asarray(x))

    return jax.tree.map(place, tree)


def replicated(tree, mesh: Mesh):
    """Every array of ``tree`` copied to every device of the mesh (weights, solver history, scalars)."""
    sharding = NamedSharding(mesh, REPLICATED)
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)
    return jax.tree.map(lambda x: _host_value_everywhere(x, sharding), tree)


def _host_value_everywhere(x, sharding: NamedSharding) -> jax.Array:
    # Across processes device_put only takes host values (the same in every process); a random key travels
    # as its raw data.
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = jax.device_put(np.asarray(jax.random.key_data(x)), sharding)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    return jax.device_put(np.asarray(x), sharding)


def local_value(array: jax.Array):
    """A global array as this process sees it: all of it in one process; across processes, this process's
    rows of a batch-split array, or its copy of a replicated one."""
    if array.is_fully_addressable:
        return array
    if array.is_fully_replicated:
        return array.addressable_shards[0].data
    shards = sorted(array.addressable_shards, key=lambda s: s.index[0].start or 0)
    return np.concatenate([np.asarray(s.data) for s in shards])


def devices_of_this_process(mesh: Mesh) -> list[jax.Device]:
    return [d for d in mesh.devices.flat if d.process_index == jax.process_index()]


class _Replicas:
    """Replicated copies of one-device arrays, kept between steps (or forward calls) so that weights that did
    not change are not broadcast again.

    The solver and its net hold one-device arrays: the root device's copy, which test nets and snapshots use
    as on one device. A step needs them replicated. ``keep`` hands out the root's copies of a step's
    replicated results and remembers them; ``place`` gives the remembered copy for an array handed back
    unchanged and broadcasts anything else. Only immutable ``jax.Array`` leaves are remembered, so a weight
    edited through ``blob.data`` (a host array) is always placed anew.
    """

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.root = devices_of_this_process(mesh)[0]
        self._kept: dict[int, tuple[jax.Array, jax.Array]] = {}

    def place(self, tree):
        """``tree`` replicated over the mesh, reusing the copies kept for arrays seen before. What this call
        placed is kept in place of what was kept (so the copies of arrays no longer used are freed)."""
        kept = {}

        def one(x):
            hit = self._kept.get(id(x))
            placed = hit[1] if hit is not None and hit[0] is x else replicated(x, self.mesh)
            if isinstance(x, jax.Array):
                kept[id(x)] = (x, placed)
            return placed

        placed = jax.tree.map(one, tree)
        self._kept = kept
        return placed

    def root_copy(self, array: jax.Array) -> jax.Array:
        return next(shard.data for shard in array.addressable_shards if shard.device == self.root)

    def keep(self, tree):
        """The root's copies of ``tree``'s replicated arrays, remembered (replacing what was kept before)."""
        self._kept = {}

        def one(array):
            local = self.root_copy(array)
            self._kept[id(local)] = (local, array)
            return local

        return jax.tree.map(one, tree)


# ---- one device's share of a global batch ---------------------------------------------------------------------

def per_device_shapes(shapes: Mapping[str, Sequence[int]], devices: int) -> dict[str, tuple[int, ...]]:
    """The fed shapes one of ``devices`` devices sees: axis 0 divided evenly (DataError where it cannot be)."""
    out = {}
    for top, shape in shapes.items():
        shape = tuple(int(d) for d in shape or ())
        if not shape or shape[0] % devices:
            raise DataError(f"blob '{top}' has shape {shape}: its {shape[0] if shape else 0} rows do not split "
                            f"evenly over {devices} devices (feed a multiple of {devices} rows)")
        out[top] = (shape[0] // devices,) + shape[1:]
    return out


def twice_the_batch(shapes: Mapping[str, Sequence[int]]) -> dict[str, tuple[int, ...]]:
    return {top: (2 * shape[0],) + tuple(shape[1:]) for top, shape in shapes.items()}


def per_example_blobs(one: Graph, two: Graph, blobs: Sequence[str] | None = None) -> dict[str, bool]:
    """For each blob (default: all), whether it is per-example, given the graphs of one device's batch
    (``one``) and of twice that batch (``two``): True when axis 0 doubles (the global blob is the devices'
    concatenated), False when the shape stays (the global blob is the devices' mean: a loss, Accuracy)."""
    return {blob: _is_per_example(blob, one.blob_shape(blob), two.blob_shape(blob))
            for blob in (one.blobs if blobs is None else blobs)}


def _is_per_example(blob: str, one, two) -> bool:
    if one is None or two is None:
        return True
    one, two = tuple(one), tuple(two)
    if one == two:
        return False
    if one and two == (2 * one[0],) + one[1:]:
        return True
    raise UnsupportedError(f"blob '{blob}' is {one} for one device's batch and {two} for twice that batch: only blobs "
                           "that grow along axis 0 with the batch, or do not change, can be split over devices")


def per_device_graph(net, shapes: Mapping[str, Sequence[int]], devices: int) -> tuple[Graph, dict[str, bool]]:
    """The net's graph one device runs when the fed blobs have ``shapes`` over ``devices`` devices, and
    :func:`per_example_blobs` of it."""
    local = per_device_shapes(shapes, devices)
    one = net.graph_at(local)
    if one.concrete:
        raise UnsupportedError(f"net '{one.name}': blobs whose values decide shapes (a Filter's selector) cannot be "
                               "split over devices: each device would need its own program")
    return one, per_example_blobs(one, net.graph_at(twice_the_batch(local)))


def _split_by_layout(blobs: Mapping[str, jax.Array], per_example: Mapping[str, bool]):
    """(per-example blobs, batch-independent blobs averaged over the devices); traced inside shard_map."""
    split = {blob: value for blob, value in blobs.items() if per_example[blob]}
    shared = {blob: jax.lax.pmean(value, AXIS) for blob, value in blobs.items() if not per_example[blob]}
    return split, shared


def data_parallel(fn: Callable, mesh: Mesh, per_example: Mapping[str, bool],
                  compiler_options: Mapping[str, str] | None = None) -> Callable:
    """``jit(shard_map(fn))`` for ``fn(replicated, batch) -> {blob: array}``, which one device runs on its rows.

    ``replicated`` (weights, a key) is the same on every device (place it with :func:`replicated`); ``batch``
    is split along axis 0 (place it with :func:`shard_batch`). The result holds global arrays: per-example
    blobs concatenated along axis 0, batch-independent ones averaged over the devices (:func:`local_value`
    gives this process's part).
    """
    def on_device(shared, batch):
        return _split_by_layout(fn(shared, batch), per_example)

    mapped = jax.shard_map(on_device, mesh=mesh, in_specs=(REPLICATED, PER_DEVICE), out_specs=(PER_DEVICE, REPLICATED),
                           check_vma=False)

    def run(shared, batch):
        split, averaged = mapped(shared, batch)
        return {**split, **averaged}

    return jax.jit(run, compiler_options=dict(compiler_options or {}))


# ---- the data a pass reads ------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DataShard:
    """Which batches of a data layer's stream are this process's: those ``k`` with ``k mod count == index``
    (Caffe's DataLayer::Skip per solver rank, at batch granularity)."""

    index: int = 0
    count: int = 1

    @classmethod
    def of_this_process(cls) -> "DataShard":
        return cls(jax.process_index(), jax.process_count())

    def owns(self, k: int) -> bool:
        return k % self.count == self.index


def deal_records(batch: np.ndarray, devices: int) -> np.ndarray:
    """Records in stream order -> device-major rows where device r holds records r, r + N, r + 2N, ... (Caffe
    gives record i to solver rank ``i mod N``)."""
    per_device = batch.shape[0] // devices
    return batch.reshape((per_device, devices) + batch.shape[1:]).swapaxes(0, 1).reshape(batch.shape)


def pass_batch(pull: Callable[[], Mapping[str, np.ndarray]], devices: int, shard: DataShard) -> dict[str, np.ndarray]:
    """One forward/backward pass's batch for this process's ``devices`` devices: ``pull()`` gives the next
    prototxt batch of every data layer (top -> array); this process keeps its own of ``devices * count``
    consecutive batches and deals their records to its devices."""
    own = []
    for k in range(devices * shard.count):
        batch = pull()
        if shard.owns(k):
            own.append(batch)
    return {top: deal_records(np.concatenate([b[top] for b in own]), devices) for top in own[0]}


# ---- training ----------------------------------------------------------------------------------------------------

class DataParallel:
    """A solver's data parallelism: its mesh, its data shard, and the weights kept on the mesh between steps."""

    def __init__(self, devices: Devices, shard: DataShard | None = None):
        self.mesh = batch_mesh(devices)
        self.shard = shard or DataShard.of_this_process()
        self.local_devices = len(devices_of_this_process(self.mesh))
        self._replicas = _Replicas(self.mesh)

    @property
    def is_root_process(self) -> bool:
        return jax.process_index() == 0

    def use_global_batch(self, net) -> None:
        """Grow every fed blob of known shape along axis 0 to this process's part of the global batch."""
        for top in net.graph.fed:
            shape = net.blobs[top].shape
            if shape:
                net.blobs[top].reshape((shape[0] * self.local_devices,) + tuple(shape[1:]))
        net.reshape()

    def pass_batch(self, pull: Callable[[], Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        return pass_batch(pull, self.local_devices, self.shard)

    def train_step(self, net, make_step: Callable[[NetProgram, str], Callable]) -> Callable:
        """The solver's iteration for the net's current (global) graph, over the mesh.

        ``make_step(program, axis)`` is the one-device iteration ``(params, history, fed, pulled, key,
        scalars) -> (params, history, loss, updates, blobs, state, norm)`` of one device's graph, averaging over
        ``axis``. The callable returned takes and gives what the one-device iteration does (``pulled``
        stacked along a leading iter_size axis), as one-device arrays, with the blobs of the global batch.
        """
        shapes = {top: net.graph.value_shapes[value] for top, value in net.graph.fed.items()}
        one_device, per_example = per_device_graph(net, shapes, self.local_devices)
        step = make_step(NetProgram(one_device, layout_kernels(one_device) if net.channels_last else None), AXIS)

        def on_device(params, history, fed, pulled, key, scalars):
            params, history, loss, updates, blobs, _, norm = step(params, history, fed, pulled, key, scalars)
            return (params, history, loss, updates, *_split_by_layout(blobs, per_example), norm)

        mapped = jax.jit(jax.shard_map(
            on_device, mesh=self.mesh, check_vma=False,
            in_specs=(REPLICATED, REPLICATED, PER_DEVICE, PartitionSpec(None, AXIS), REPLICATED, REPLICATED),
            out_specs=(REPLICATED, REPLICATED, REPLICATED, REPLICATED, PER_DEVICE, REPLICATED, REPLICATED)),
            compiler_options=compiler_options(one_device, backward=True, dtype=net._dtype))
        replicas = self._replicas

        def run(params, history, fed, pulled, key, scalars):
            params, history, loss, updates, split, shared, norm = mapped(
                *replicas.place((params, history)), shard_batch(fed, self.mesh),
                shard_batch(pulled, self.mesh, axis=1), replicated(key, self.mesh), replicated(scalars, self.mesh))
            params, history = replicas.keep((params, history))
            loss, updates, shared, norm = jax.tree.map(replicas.root_copy, (loss, updates, shared, norm))
            return params, history, loss, updates, {**jax.tree.map(local_value, split), **shared}, {}, norm

        return run


# ---- inference ---------------------------------------------------------------------------------------------------

def data_parallel_forward(net, devices: Devices, blobs: Sequence[str] = ()) -> Callable[..., dict[str, np.ndarray]]:
    """``forward(**arrays)``: the net's forward with the batch split over ``devices``, one program per shapes.

    Give an array for every fed blob (``net.inputs``, and data layers' tops), this process's rows of the
    global batch along axis 0 (a multiple of its device count). Each device runs the net on its share, as
    ``net.forward`` would on that share alone; the result maps the net's outputs (and ``blobs``) to arrays:
    per-example blobs concatenated along axis 0 (the rows of the input), batch-independent ones (a loss,
    Accuracy) averaged over the devices. The weights are read from the net on every call. Nothing is written
    back into the net (not its blobs, nor BatchNorm statistics in TRAIN). Rows that do not split evenly over
    the devices are a DataError (nothing is padded); shapes the net does not take, a ShapeError naming the
    shapes fed as well as one device's.
    """
    mesh = batch_mesh(devices)
    local_devices = len(devices_of_this_process(mesh))
    replicas = _Replicas(mesh)
    asked = list(dict.fromkeys(list(net.outputs) + list(blobs)))
    graph = net.graph
    # Layers run on the host (Layer.runs_on_host) finish the blobs they make from the gathered ones they read.
    made_on_host = graph.made_on_host
    wanted = list(dict.fromkeys([blob for blob in asked if blob not in made_on_host] + graph.read_on_host))
    tops = list(net.graph.fed)
    programs: dict[Any, Callable] = {}

    def compile_for(shapes):
        try:
            one_device, per_example = per_device_graph(net, shapes, local_devices)
        except ShapeError as error:  # its shapes are one device's: name the global ones fed too
            raise ShapeError(f"forward over devices: the net does not accept inputs of shapes {shapes} over "
                             f"{local_devices} devices: {error}") from None
        program = NetProgram(one_device, layout_kernels(one_device) if net.channels_last else None)
        fed = one_device.fed

        def on_device(shared, arrays):
            params, key = shared
            env, _ = program.forward(params, {fed[top]: arrays[top] for top in tops},
                                     jax.random.fold_in(key, jax.lax.axis_index(AXIS)))
            return {blob: env[one_device.blob_value[blob]] for blob in wanted}

        return data_parallel(on_device, mesh, {blob: per_example[blob] for blob in wanted})

    def forward(**arrays) -> dict[str, np.ndarray]:
        if set(arrays) != set(tops):
            raise CaffejaxError(f"forward over devices: give an array for each fed blob {tops}, got {sorted(arrays)}")
        arrays = {top: np.asarray(array, net._dtype) for top, array in arrays.items()}
        shapes = {top: array.shape for top, array in arrays.items()}
        signature = tuple(sorted(shapes.items()))
        fn = programs.get(signature)
        if fn is None:
            fn = programs[signature] = compile_for(shapes)
        shared = (replicas.place(net.param_arrays()), replicated(net._next_key(), mesh))
        gathered = fn(shared, shard_batch(arrays, mesh))
        outputs = {blob: np.asarray(local_value(value)) for blob, value in gathered.items()}
        if made_on_host:
            made = run_host_layers(graph.layers, {graph.blob_value[blob]: array for blob, array in outputs.items()},
                                   net._python_layers)
            outputs.update((blob, made[graph.blob_value[blob]]) for blob in asked if blob in made_on_host)
        return {blob: outputs[blob] for blob in asked}

    return forward
