"""``caffejax.Net``: pycaffe's Net, running one XLA program per input-shape signature.

The Net holds the state pycaffe users touch (blobs, params, names, Caffe's indices) and hands the pure
functions of :class:`~caffejax.lower.program.NetProgram` their arrays. A forward is one call of one jitted
program; so is a backward (a ``jax.vjp`` of the same forward). Programs are cached per input shapes and pass
range, so repeated passes at one shape never recompile.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import logging
import os
import threading
import weakref
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from caffejax.errors import (CaffejaxError, DataSourceUnavailable, GraphError, NetInUseError, NumericalError,
                             OutOfMemoryError, ShapeError, TopsSizedByData, UnknownBlobError, UnsupportedError,
                             WeightsError, layer_error)
from caffejax.fileio import atomic_write
from caffejax.frontend.build import build_graph, load_net_param, may_size_tops_by_data
from caffejax.frontend.caffemodel import encode_net, read_weights
from caffejax.frontend.prototxt import locate_layer_error
from caffejax.frontend.ir import Graph, readers_by_value
from caffejax.lower.fillers import HostKey, fold_in
from caffejax.lower.optimize import layout_kernels
from caffejax.lower.program import NetProgram, host_backward, run_host_layers
from caffejax.lower.python_layer import HostDataLayer, PythonLayers, calls_back
from caffejax.lower.registry import TRAIN, TEST, get_rule
from caffejax.runtime import mode
from caffejax.runtime.blob import ArraySlot, Blob, as_numbers, bits_digest
from caffejax.runtime.debug_info import log_backward, log_forward, log_inputs
from caffejax.runtime.memory import DeviceMemoryErrors
from caffejax.runtime.net_init_log import log_net_init
from caffejax.runtime.program_cache import cache_directory, describe_graph, jit_through_cache
from caffejax.runtime.snapshot import write_model_hdf5
from caffejax.runtime.xla_options import bf16_matrix_programs, compiler_options, matmul_flops

log = logging.getLogger("caffejax")

_fold_in = jax.jit(jax.random.fold_in)


def fold_key(key: jax.Array, n: int) -> jax.Array:
    """``jax.random.fold_in(key, n)`` as one compiled call: 41 us, where eagerly it costs 213 us (2 AMD EPYC
    cores; LeNet's Solver.step at batch 16 takes about 4 ms)."""
    return _fold_in(key, np.uint32(n))


class LayerView:
    """pycaffe's Layer: ``type``, ``name``, ``blobs`` (its learnable blobs)."""

    def __init__(self, name: str, type: str, blobs: list[Blob]):
        self.name, self.type, self.blobs = name, type, blobs

    def __repr__(self) -> str:
        return f"<Layer {self.name!r} ({self.type})>"


class PythonLayerView(LayerView):
    """A ``Python`` layer in ``net.layers``: what pycaffe hands back there is the user's own layer object, so
    scripts call its methods and set its attributes through the net (py-faster-rcnn's
    ``solver.net.layers[0].set_roidb(roidb)``). ``name``, ``type`` and ``blobs`` (the net's blobs of the layer)
    are the view's; every other attribute is the user object's."""

    _OWN = ("name", "type", "blobs", "_find_object")

    def __init__(self, name: str, blobs: list[Blob], find_object):
        super().__init__(name, "Python", blobs)
        object.__setattr__(self, "_find_object", find_object)

    def _layer_object(self):
        found = object.__getattribute__(self, "_find_object")()
        if found is None:  # its setup has not run: the net could not shape the layer's bottoms yet
            raise AttributeError(f"Python layer '{self.name}' has no layer object yet: its setup runs when the net "
                                 "knows its bottoms' shapes")
        return found

    def __getattr__(self, attribute: str):
        if attribute.startswith("__"):  # copy, pickle and friends ask for these; the view has none
            raise AttributeError(attribute)
        return getattr(self._layer_object(), attribute)

    def __setattr__(self, attribute: str, value) -> None:
        if attribute in self._OWN:
            object.__setattr__(self, attribute, value)
        else:
            setattr(self._layer_object(), attribute, value)


_CALLBACK_POINTS = ("before_forward", "after_forward", "before_backward", "after_backward")


def _python_top_values(layers) -> list[str]:
    """The value ids of the tops of the Python layers among ``layers``: a forward records them, for the backward
    that must not run those layers again."""
    return [v for layer in layers if calls_back(layer) for v in layer.top_values]


def pulls_batches(layer) -> bool:
    """Whether a layer's tops are a batch the net reads on the host before each pass: a data layer with a
    source (Data, ImageData, ...) or a Python data layer."""
    return layer.is_input and (layer.type == "Python" or get_rule(layer.type).data_source is not None)


def _collect(store: list, value) -> None:
    """A batch's blob into forward_all's list: its items, or the whole value for a scalar (a loss: one per batch)."""
    value = np.array(value, copy=True)
    if value.ndim:
        store.extend(value)
    else:
        store.append(value)


def _collected(store: list, num: int | None) -> np.ndarray:
    """forward_all's result: the first ``num`` items (the last batch's zero padding dropped); scalars per batch."""
    if store and np.ndim(store[0]) == 0:
        return np.asarray(store)
    return np.asarray(store[:num])


def _broadcasts(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    try:
        return np.broadcast_shapes(shape, target) == tuple(target)
    except ValueError:
        return False


# An identity program: XLA copies its NumPy arguments into buffers of its own.
_copy_to_device = jax.jit(lambda *arrays: arrays)


def to_device(tree):
    """``tree`` with its NumPy leaves (the blobs' host copies, weights set from NumPy, a solver's scalars) made
    device arrays in one small program, finished before this returns.

    Given a NumPy argument, a program waits for its transfer and then runs on one of XLA's worker threads.
    glibc gives each thread its own malloc arena, and outside the main one it serves blocks over 64 MB with a
    fresh mmap whatever ``caffejax.runtime.memory`` asked, so every call paged its big buffers in again:
    MobileNet v2's ``Solver.step(1)`` at batch 16 took 1.18-1.25 s and 297 thousand page faults, 0.81-0.84 s
    and 0-5 thousand with its arguments on the device first; its ``forward()`` + ``backward()`` 2.0-4.2 s
    (9-400 thousand faults), 1.8-1.9 s. ``jax.device_put`` would do too, at about 40 us an array; this costs
    one dispatch (LeNet's Solver.step: +1-2%)."""
    leaves, treedef = jax.tree.flatten(tree)
    host = [i for i, leaf in enumerate(leaves) if not isinstance(leaf, jax.Array)]
    if host:
        for i, array in zip(host, jax.block_until_ready(_copy_to_device(*(leaves[i] for i in host)))):
            leaves[i] = array
    return jax.tree.unflatten(treedef, leaves)


# Net's programs for graphs of fewer FLOPs (convolutions and inner products) than this take their NumPy
# arguments as they are: their buffers are small, and to_device's dispatch cost LeNet's forward 10% at batch 1
# (0.30 -> 0.33 ms) and 3-14% at batch 16 (37 MFLOP; 1.37-1.39 -> 1.41-1.58 ms).
DEVICE_ARGUMENTS_MIN_FLOPS = 100e6


# How many sets of blobs read after the last two passes (Net._learnt_blobs) the passes over one range of one graph
# hand back, each set a program of its own (a compile): a script reading 3 of LeNet's blobs at random after each
# forward compiled 22 programs in 60 forwards (7.3 s; each set seen twice in a row was new), where a loop
# reading the same blobs every time needs one. Past these, a pass hands back the largest of them the reads
# hold, and the other blobs read are recomputed when read (no compile).
LEARNT_SETS_PER_RANGE = 4


# Net.forward prepares its kernels' weights in a program of its own (Net._prepared_weights), however small they
# are: laid out in every forward instead, LeNet's 100 KB of filters cost its forward at batch 1 8% and MTCNN's det3
# and det4 20% and 12%. The preparation costs a net's first forward 30-70 ms more to compile and its first at
# another input shape less (that forward lays nothing out). False: laid out in the forward itself.
PREPARE_WEIGHTS_APART = True


def _with_device_arguments(program):
    """``program(*args)`` with the NumPy arrays among its arguments moved by :func:`to_device`."""
    def run(*args):
        return program(*to_device(args))
    return run


def _folding_key(fn, position: int = 2):
    """``fn(*args)``, whose ``args[position]`` is a pass's key, as a program taking the pass's seed key and count
    (Net._next_pass) there in place of it, which it folds itself: where no layer draws random numbers, XLA drops
    the fold."""
    def run(*args):
        seed_key, count = args[position:position + 2]
        return fn(*args[:position], jax.random.fold_in(seed_key, count), *args[position + 2:])
    return run


class _PassKey:
    """A pass's key, made when first asked for: ``key()`` folds ``n`` into ``base`` (a seed key and a pass count,
    Net._next_pass; or a solver's step key, itself a _PassKey, and 0). The pass's program folds the key itself
    where it draws random numbers (:func:`_folding_key`); this one only a backward or a deferred blob's recompute,
    running the pass's layers again, asks for. Folded by a call of its own on every pass, it cost LeNet's
    Net.forward at batch 1 46 us of 335 (2 AMX Xeon cores), where the program drew no random numbers."""

    def __init__(self, base: "jax.Array | _PassKey", n):
        self._parts, self._key = (base, n), None

    def __call__(self) -> jax.Array:
        if self._key is None:
            base, n = self._parts
            self._key = fold_key(base() if isinstance(base, _PassKey) else base, n)
        return self._key


def _noting_read(read: set[str], blob: str, load: Callable[[], None] | None = None) -> None:
    """A blob's pending load (ArraySlot.defer): notes that ``blob`` was read, then loads its value (``load``:
    its recompute; None where it holds it already)."""
    read.add(blob)
    if load is not None:
        load()


def _shaped_by_feeds_alone(graph: Graph) -> bool:
    """Whether building the net again at the fed shapes this graph was built at gives this graph again: no Python
    layer (its pycaffe object may come to run on the host, or size its tops by the data), no blob whose data
    decides shapes (Filter's selector), no shape left unknown (a data layer's source not opened yet) and no
    shape error deferred."""
    return not (graph.concrete or graph.deferred_errors or any(layer.type == "Python" for layer in graph.layers)
                or any(shape is None for shape in graph.value_shapes.values()))


def _with_program_errors(program, graph: Graph, source):
    """``program(*args)`` inside :class:`DeviceMemoryErrors` for ``graph``, a layer's error from its first
    trace (weights that no longer fit a reshaped bottom) located at the layer's line in ``source``."""
    def run(*args):
        try:
            with DeviceMemoryErrors(graph):
                return program(*args)
        except CaffejaxError as e:
            raise locate_layer_error(e, source) from None
    return run


def _constructor_arguments(args: tuple, phase, weights, level, stages):
    """Net's positional arguments as pycaffe's two constructors take them: ``Net(file, weights, phase)``, and
    ``Net(file, phase, level=0, stages=None, weights=None)``, whose ``level`` an int after the phase is. A path
    after the phase is taken as the weights too (pycaffe refuses it). Returns (phase, weights, level, stages)."""
    rest = list(args)
    if rest and isinstance(rest[0], (str, os.PathLike)):
        weights = os.fspath(rest.pop(0))
        if len(rest) > 1:
            raise TypeError(f"Net(): unexpected arguments {rest[1:]!r} after Net(prototxt, weights, phase)")
        return (rest[0] if rest else phase), weights, level, stages
    if rest:
        phase = rest.pop(0)
    later = iter(("level", "stages", "weights"))
    for arg in rest:
        if isinstance(arg, (str, os.PathLike)):
            weights = os.fspath(arg)
            continue
        slot = next(later, None)
        if slot == "level" and isinstance(arg, int) and not isinstance(arg, bool):
            level = arg
        elif slot in ("level", "stages") and isinstance(arg, (list, tuple)):
            stages, later = arg, iter(("weights",))
        else:
            raise TypeError(f"Net(): unexpected argument {arg!r}; use Net(prototxt, phase, level=0, stages=(), "
                            "weights=None) or Net(prototxt, weights, phase)")
    return phase, weights, level, stages


def _names_a_file(text: str) -> bool:
    """Whether a string that is no existing file is meant as one's path rather than prototxt text: one line,
    without the braces, quotes or ``field:`` every prototxt has (a Windows drive's colon is allowed)."""
    return bool(text.strip()) and not any(c in text for c in '\n{"') and ":" not in os.path.basename(text)


def _same_arrays(arrays: list, tree) -> bool:
    """Whether ``tree``'s leaves are the very ``arrays`` (identity: a blob hands a program the same array until its
    data is set or written through ``.data``)."""
    leaves = jax.tree.leaves(tree)
    return len(leaves) == len(arrays) and all(a is b for a, b in zip(arrays, leaves))


class _OneThreadAtATime:
    """A Net's passes run inside it (``with net._passes:``). A Net holds one set of blobs, as Caffe's does: a pass
    from a second thread would fill them under the first one's feet (and the outputs it returned, which are the
    blobs' arrays), so it raises NetInUseError instead of mixing the two silently. The thread running a pass may
    enter again (a callback or a Python layer calling the net). A class with ``__exit__``, as PythonLayers is."""

    __slots__ = ("_lock", "_net_name")

    def __init__(self, net_name: str):
        self._lock = threading.RLock()
        self._net_name = net_name

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            raise NetInUseError(
                f"net '{self._net_name}' is running a pass in another thread: a Net holds one set of blobs, as "
                "Caffe's does, which this call would overwrite under it. Threads may share "
                "caffejax.compile_inference(net)'s function instead, or each use a Net of its own, or hold a lock "
                "around the net's calls")

    def __exit__(self, kind, error, traceback) -> bool:
        self._lock.release()
        return False


@dataclasses.dataclass(frozen=True)
class _PreparedWeights:
    """A forward range's prepared weights (Net._prepared_weights): the program and layers that made them, and the
    weights they came from (weak references, in the order of their leaves)."""

    program: NetProgram
    layers: Sequence[Any]
    weights: list[weakref.ref]
    arrays: dict[str, list]

    def made_from(self, leaves: Sequence[Any]) -> bool:
        """Whether these arrays were made from ``leaves``, the very arrays (the weights' leaves, in order)."""
        return len(self.weights) == len(leaves) and all(ref() is leaf for ref, leaf in zip(self.weights, leaves))


@dataclasses.dataclass(frozen=True)
class _PassPlan:
    """What a forward pass over layers start..end works out from the graph alone (Net._pass_plan; a solver's step
    over the whole net notes its writes too), once per range and graph instead of on every pass: at LeNet's
    batch 1 the Python around Net.forward's program took about as long as the program (0.2 ms of 0.4), and it
    grows with the layers (MTCNN's det4 has 61)."""

    layers: list
    returned: list[str]  # the values its program hands back, sorted (Net._returned_values)
    reruns: bool  # Net._reruns
    feed: list[tuple[str, str]]  # (value id, blob) its compiled layers read from blobs (Net._feed_sources)
    python_tops: list[str]  # the tops of its Python layers (_python_top_values)
    state: list[tuple[str, str]]  # (state in, state out) value ids of its layers
    weighs_loss: bool  # whether any of its values is loss-weighted (else its loss is 0)
    writes: tuple[dict[str, str], tuple[str, ...], tuple[str, ...]]  # what it leaves in the blobs (Net._writes_of)


@dataclasses.dataclass
class _GraphFacts:
    """What Net works out from one graph and its program alone, kept with the program (by its signature) for when
    a reshape comes back to its shapes: a pycaffe script walking an image pyramid adopts each scale's graph again
    at every image."""

    owned_params: list[tuple[str, tuple]]  # param_arrays' walk: see Net._set_graph
    pass_plans: dict[tuple[int, int], _PassPlan] = dataclasses.field(default_factory=dict)  # Net._pass_plan
    range_keys: dict[tuple[int, int], tuple] = dataclasses.field(default_factory=dict)  # Net._range_key
    # The sets of blobs the passes over each range hand back besides their outputs (Net._learnt_blobs)
    learnt_sets: dict[tuple[int, int], list[frozenset[str]]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Pullback:
    """A forward pass's pullback (Net._wants_pullback): jax.vjp's function, from the diffs of the values seeding a
    backward over the pass's layers to the params' diffs and those of ``inputs``."""

    pullback: Any
    inputs: tuple[str, ...]
    # The weights and inputs it was made from (None in a solver's iteration, where nothing runs between the passes):
    # a user may change them between Net.forward and Net.backward, whose backward then reads the new ones.
    made_from: list | None
    seeds: dict[str, jax.ShapeDtypeStruct]  # what the pullback takes: the seeding values' shapes and dtypes
    # The pass's range signature (Net._range_signature): a rebuild for a later stage's new shapes (a new number of
    # ROIs) keeps the pullback of a stage before it, whose layers it leaves as they were.
    signature: tuple


class Net:
    """A Caffe net.

    ``Net(prototxt, phase)``, ``Net(prototxt, weights, phase)`` (pycaffe's order) or
    ``Net(prototxt, phase, weights=..., level=0, stages=())``. ``prototxt`` is a path, prototxt text, or a
    ``caffe_pb2.NetParameter``. ``allow_python_layers`` lets ``Python`` layers import and run their module
    (only for trusted models). ``debug_nans`` checks every forward's outputs and, when one holds NaN or Inf,
    raises a NumericalError naming the first layer that produced it (caffejax.find_first_nan).
    ``channels_last`` runs convolutions, pooling, LRN, Concat and per-channel layers channels-last inside
    the compiled programs, and Convolution -> BatchNorm (global statistics) [-> Scale] chains as one folded
    convolution (``optimize.layout_kernels``; blobs stay NCHW): the same values up to float rounding,
    several times faster on CPUs. False runs Caffe's rules in Caffe's layout throughout.
    """

    def __init__(self, network, *args, phase: int | None = None, weights: str | None = None, level: int = 0,
                 stages: Sequence[str] = (), allow_python_layers: bool = False, dtype=np.float32,
                 debug_nans: bool = False, channels_last: bool = True):
        phase, weights, level, stages = _constructor_arguments(args, phase, weights, level, stages)
        if phase not in (TRAIN, TEST):
            raise TypeError("Net() needs a phase: caffejax.TRAIN or caffejax.TEST")
        is_path = isinstance(network, os.PathLike) or (isinstance(network, str) and os.path.exists(network))
        # A missing file is named as one (pycaffe's "Could not open file"), not parsed as prototxt text.
        reads_file = is_path or (isinstance(network, str) and _names_a_file(network))
        self._net_param = load_net_param(network, is_path=reads_file if isinstance(network, (str, os.PathLike))
                                         else None)
        self._base_dir = os.path.dirname(os.path.abspath(os.fspath(network))) if is_path else None
        self._source = network  # where layer errors are located (file:line), at build and at every reshape
        self._phase, self._level, self._stages = phase, level, tuple(stages)
        self._allow_python = allow_python_layers
        self._python_layers = PythonLayers()  # this net's pycaffe layer objects, kept across rebuilds
        self._passes = _OneThreadAtATime(self._net_param.name)
        self._dtype = np.dtype(dtype)
        if self._dtype.itemsize > 4 and not jax.config.jax_enable_x64:
            raise CaffejaxError(f"Net(dtype={self._dtype}) needs JAX's 64-bit mode: "
                                "jax.config.update('jax_enable_x64', True) before building the net")
        self.debug_nans = debug_nans
        # Caffe's debug_info (caffejax.runtime.debug_info): log every layer's blobs as a pass runs, layer by layer.
        self.debug_info = bool(self._net_param.debug_info)
        self.channels_last = channels_last
        self._programs: dict[Any, NetProgram] = {}
        # Graphs by the fed shapes they were built at, where those alone decide them (_shaped_by_feeds_alone). A
        # pycaffe script that reshapes its input for every scale of an image pyramid (MTCNN's detect_face) built
        # and shape-inferred the whole net again at each scale: det1 over a 480x640 photo's 10 scales through
        # Net.forward took 76-96 ms, now 22-27 (compile_inference 17-24; 2 AMD EPYC cores, alternating processes).
        self._graphs_by_fed_shapes: dict[tuple, Graph] = {}
        self._graph_facts: dict[Any, _GraphFacts] = {}  # by program signature, as _programs
        # The blobs read since the last forward over each range (first, last layer), and after the pass before it:
        # the next pass hands back those read after both instead of leaving them to be recomputed when read
        # (_handed_back).
        self._blobs_read: dict[tuple[int, int], set[str]] = {}
        self._blobs_read_before: dict[tuple[int, int], set[str]] = {}
        self._blob_index_map: tuple[Any, dict[str, int]] = (None, {})  # (graph, blob name -> index)
        # pycaffe's net.before_forward(fn) ... after_backward(fn): called with each layer's index around it
        self._layer_callbacks: dict[str, list] = {when: [] for when in _CALLBACK_POINTS}
        self._layer_inputs: dict[int, tuple[dict[str, Any], _PassKey]] = {}  # (what it read, its key), one by one
        # Forward passes' pullbacks by range, for the backward passes over the same ranges (_wants_pullback): the
        # ranges whose forward a backward followed, and whether every pass keeps one (a solver's iteration).
        self._pullbacks: dict[tuple[int, int], _Pullback] = {}
        self._pullback_ranges: set[tuple[int, int]] = set()
        self._keep_every_pullback = False
        # The weights a forward's kernels read, prepared, and what from, by range (_prepared_weights); what each
        # program's preparation of a range computes (_preparation_digest).
        self._prepared: dict[tuple[int, int, bool], list[_PreparedWeights]] = {}
        self._preparation_digests: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._preparations: dict[bytes, Any] = {}  # compiled preparations by digest, for programs computing the same
        self._compiled: dict[Any, Any] = {}
        self.compile_count = 0  # how many times a program was traced (each trace is one XLA compile)
        self._pass_count = 0
        self._sources: dict[str, Any] = {}
        self._last_key = None
        # Each forward pass's key by its range (first, last layer): a backward over part of it, or find_first_nan's
        # replay, takes that pass's key (its Dropout masks), not the last pass's (in a net run in stages, the
        # layers after the proposals).
        self._pass_keys: dict[tuple[int, int], _PassKey] = {}
        self._seed_key: tuple[int, jax.Array] | None = None  # (seed, jax.random.key(seed)), made once per seed
        # State layers carry between forwards (RNN/LSTM's h_T -> h_0), by the value id a forward reads it
        # as: what the next forward reads, and what the last forward read (backward recomputes from it).
        self._state: dict[str, Any] = {}
        self._state_seen: dict[str, Any] = {}
        try:
            # Net::Init reshapes every layer at the shapes setup gave: a mismatch there is an error at once, also
            # after a Python layer that may size its tops by the data (later builds wait for its forward).
            self._set_graph(self._build({}, defer_shape_errors=False))
            # Fillers run only for layers the weights file does not cover (the file would overwrite them).
            loaded = read_weights(weights) if weights is not None else None
            self._init_params(skip=set(loaded.blobs) if loaded else set())
        except CaffejaxError as e:  # a layer's error gets the line of the layer's definition in front
            raise locate_layer_error(e, self._source) from None
        # Logged as Caffe logs them, before the weights are copied (once the net is built and its weights file
        # read, so that a missing file or a bad layer is reported alone).
        log_net_init(self._net_param, self._graph, self._dtype.itemsize)
        if loaded is not None:
            self._copy_weights(loaded)

    # -- structure ------------------------------------------------------------------------------------------
    def _build(self, input_shapes, defer_shape_errors: bool = True) -> Graph:
        try:
            return build_graph(self._net_param, self._phase, self._level, self._stages, input_shapes=input_shapes,
                               base_dir=self._base_dir, allow_python_layers=self._allow_python,
                               concrete_inputs=self._concrete_data(), python_layers=self._python_layers,
                               defer_shape_errors=defer_shape_errors)
        except CaffejaxError as e:
            raise locate_layer_error(e, self._source) from None

    def graph_at(self, shapes: Mapping[str, Sequence[int]]) -> Graph:
        """The net's graph with the fed blobs named in ``shapes`` at those shapes (Caffe's Reshape of every
        layer; the others keep theirs). The net itself is left as it is."""
        graph = self._graph
        shapes = {name: tuple(int(d) for d in shape) for name, shape in shapes.items()}
        if all(graph.value_shapes.get(graph.fed.get(name)) == shape for name, shape in shapes.items()):
            return graph
        return self._build({**self._fed_shapes(), **shapes})

    def _fed_shapes(self) -> dict[str, tuple[int, ...]]:
        """The fed blobs' current shapes, by blob name; not those of a data layer whose source could not be
        opened and that nobody has fed since (their shapes stay unknown)."""
        shapes = {top: self.blobs[top].shape for top, value in self._graph.fed.items()
                  if not self._never_fed(top, value)}
        shapes.update((top, self.blobs[top].shape) for top in self._staged_blobs())
        return shapes

    def _staged_blobs(self) -> list[str]:
        """The tops of the host layers that compiled layers read (Graph.staging_layers): their last forward's
        shapes shape the layers after them."""
        return [top for i in self._staging for top in self._graph.layers[i].tops]

    def _never_fed(self, top: str, value: str) -> bool:
        return self._graph.value_shapes.get(value) is None and self.blobs[top].shape == ()

    def _concrete_blobs(self) -> dict[str, str]:
        """The fed blobs whose values decide shapes (Filter selectors): value id -> blob name."""
        graph = getattr(self, "_graph", None)
        if graph is None or not graph.concrete:
            return {}
        blob_of = {value: blob for blob, value in graph.fed.items()}
        return {value: blob_of[value] for value in graph.concrete}

    def _concrete_data(self) -> dict[str, np.ndarray]:
        return {blob: np.array(self.blobs[blob].data) for blob in self._concrete_blobs().values()}

    def _net_program(self, graph: Graph) -> NetProgram:
        """The graph's program. Channels-last, programs with a backward multiply 1x1 convolutions as products
        (``conv_gemm``); those without run compile_inference's kernels (layout_kernels(differentiated=False)):
        1x1 convolutions left to XLA, which makes dots of them itself, small 3x3 ones as Winograd. Except in
        bfloat16 on a CPU with bfloat16 matrix instructions, where only the products run on those.

        Net.forward (alternating blocks, 2 AMX Xeon cores), 1x1 layers left to XLA: at batch 1 MobileNet v2 0.81
        of the time, SqueezeNet v1.1 0.85, ResNet-50 0.91, GoogLeNet 0.94-0.96; at batch 16 MobileNet v2 0.89-0.93,
        ResNet-50 0.93, GoogLeNet 0.95, SqueezeNet v1.1 0.97-1.03; LeNet and AlexNet (no 1x1 layers) even. With
        Winograd too, at batch 16: ResNet-50 0.93, GoogLeNet 0.97, SqueezeNet v1.1 0.99 (batch 1 has too few
        tiles for it); ResNet-50's first forward at batch 16 took 2.7 s against 2.1 s, paid back in 17 forwards.
        Both against the training kernels at batch 16: ResNet-50 0.88, MobileNet v2 0.89, GoogLeNet 0.94."""
        if not self.channels_last:
            return NetProgram(graph)
        kernels = layout_kernels(graph)
        forward = kernels if bf16_matrix_programs(self._dtype) else layout_kernels(graph, differentiated=False)
        return NetProgram(graph, kernels, forward)

    def _set_graph(self, graph: Graph) -> None:
        """Adopt a (re)built graph: blobs are kept by name and reshaped; new ones are created."""
        signature = self._signature(graph)
        if signature not in self._programs:
            self._programs[signature] = self._net_program(graph)
        self._program = self._programs[signature]
        # A rebuild at shapes seen before gives an equal graph of new objects; the net keeps the one its program
        # was made from, whose layers the program knows (find_first_nan walks net.graph through net._program).
        graph = self._graph = self._program.graph
        self._shapes_unknown = any(shape is None for shape in graph.value_shapes.values())  # see _require_shapes
        self._host_layers = [layer for layer in graph.layers if layer.runs_on_host]  # see _run_host_layers
        self._staging = graph.staging_layers if self._host_layers else []  # see _forward_in_stages
        self._recorded_tops: dict[str, jax.Array] = {}  # Python layers' tops from the last forward, by value id
        self._layer_inputs = {}
        # Values a forward read from blobs that a layer of the same pass then overwrote in place (a Power on
        # "data", or the Scale a forward(start=...) began at), as that forward read them: a backward's recompute,
        # or find_first_nan's replay, reads these (_last_forward_feed), not the blob's new data.
        self._overwritten_inputs: dict[str, Any] = {}
        # Which value each blob's data came from (blob -> value id): a backward over part of the net recomputes
        # the inputs of its range whose blobs a layer in place has since overwritten (_recomputed_feed).
        self._blob_holds: dict[str, str] = dict(graph.blob_value)
        self._facts = self._graph_facts.get(signature)
        if self._facts is None:
            # The layers owning learnable blobs, and each blob's key where the layer owns it (None where it shares
            # another layer's): param_arrays' walk, fixed per graph.
            self._facts = self._graph_facts[signature] = _GraphFacts(
                [(layer.name, tuple(slot.key if slot.is_owner else None for slot in layer.params))
                 for layer in graph.layers if any(slot.is_owner for slot in layer.params)])
        old = getattr(self, "blobs", {})
        self.blobs: collections.OrderedDict[str, Blob] = collections.OrderedDict()
        # A top of a layer run on the host keeps what its last forward made: that layer's forward reshapes it (as
        # Caffe's Layer::Forward calls its Reshape), not a rebuild for other shapes, which a later stage of the
        # same forward may need (py-faster-rcnn's proposals, read by its proposal target layer on the host).
        made_on_host = graph.made_on_host
        for name in graph.blobs:
            shape = graph.blob_shape(name) or ()
            blob = old.get(name)
            if blob is None:
                blob = Blob(shape, self._dtype)
            elif name not in made_on_host and blob.shape != shape:
                blob._data.reshape(shape)  # (the graph's shapes need none of Blob.reshape's checks of a user's)
                blob._diff.reshape(shape)
            self.blobs[name] = blob
        # Caffe keeps a loss top's diff at its loss weight; backward starts from it.
        for layer in graph.layers:
            for top, weight in zip(layer.tops, layer.loss_weights):
                if weight and top in self.blobs:
                    try:
                        self.blobs[top].diff[...] = weight
                    except OutOfMemoryError as e:
                        raise OutOfMemoryError(f"blob '{top}' (the loss top of layer '{layer.name}'): {e}") from None

    @staticmethod
    def _signature(graph: Graph):
        """What a whole net's graph and its programs depend on: the fed shapes, which layers run on the host (a
        Python layer does once its forward sized its tops by the data) and the shapes they made, and the data
        of shape-deciding blobs. (A program over some of the layers: _range_signature.)"""
        shapes = tuple((layer.name, tuple(graph.value_shapes[v] or ()) if v in graph.value_shapes else None)
                       for layer in graph.layers if layer.is_input or layer.runs_on_host for v in layer.top_values)
        return shapes + tuple((value, data.tobytes()) for value, data in sorted(graph.concrete.items()))

    def _range_key(self, first: int, last: int):
        """:meth:`_range_signature` of the net's graph, worked out once per range and graph."""
        key = self._facts.range_keys.get((first, last))
        if key is None:
            key = self._facts.range_keys[(first, last)] = self._range_signature(self._graph, first, last)
        return key

    @staticmethod
    def _range_signature(graph: Graph, first: int, last: int):
        """What a compiled program over layers first..last depends on: the shapes of the values they read from
        outside the range (fed, carried state, made by earlier layers or on the host), which of them run on the
        host, and the data of shape-deciding blobs. Not the shapes of what it does not read: in a net run in
        stages, a stage is not compiled again when an input only a later stage reads changes shape."""
        layers = graph.layers[first:last + 1]
        made = {v for layer in layers if not layer.is_input for v in layer.top_values}
        read = dict.fromkeys(v for layer in layers if not layer.runs_on_host
                             for v in (*layer.bottom_values, *layer.state_in) if v not in made)
        return (tuple((v, graph.value_shapes.get(v)) for v in read),
                tuple(i for i, layer in enumerate(layers, first) if layer.runs_on_host),
                tuple((value, data.tobytes()) for value, data in sorted(graph.concrete.items())))

    def _init_params(self, skip: set[str] = frozenset()) -> None:
        """Allocate the learnable blobs not allocated yet and run Caffe's fillers on them: every blob when the
        net is built; after a reshape, those of layers whose shapes were unknown until then."""
        self.params: collections.OrderedDict[str, list[Blob]] = collections.OrderedDict()
        existing = getattr(self, "_param_blobs", {})
        self._param_blobs: dict[tuple[str, int], Blob] = {}
        new = set()
        for layer in self._graph.layers:
            blobs = []
            for slot in layer.params:
                if slot.is_owner:
                    self._param_blobs[slot.key] = existing.get(slot.key)
                    if self._param_blobs[slot.key] is None:
                        self._param_blobs[slot.key] = Blob(slot.shape, self._dtype)
                        new.add(layer.name)
                blobs.append(self._param_blobs[slot.storage])
            if blobs:
                self.params[layer.name] = blobs
        self.layers = [PythonLayerView(layer.name, self.params.get(layer.name, []),
                                       functools.partial(self._python_layers.object_of, layer.proto))
                       if layer.type == "Python"
                       else LayerView(layer.name, layer.type, self.params.get(layer.name, []))
                       for layer in self._graph.layers]
        to_fill = [(position, layer) for position, layer in enumerate(self._graph.layers)
                   if layer.name in new and layer.name not in skip
                   and (layer.type == "Python" or get_rule(layer.type).init_params is not None)]
        if not to_fill:
            return

        # Fillers run on the host (NumPy): no XLA compilation just to initialise a net.
        key = HostKey(mode.random_seed())
        for position, layer in to_fill:
            try:
                if layer.type == "Python":  # no filler: its blobs start from what the layer's setup wrote
                    arrays = self._python_layers.learnable_values(layer.proto)
                else:
                    arrays = get_rule(layer.type).init_params(layer.proto, [slot.shape for slot in layer.params],
                                                              fold_in(key, position))
            except CaffejaxError as e:  # a filler setting Caffe CHECK-fails on: name the layer
                raise layer_error(type(e), layer.name, layer.type, str(e)) from None
            except MemoryError:  # the fillers draw in float64 on the host
                shapes = ", ".join(str(tuple(slot.shape)) for slot in layer.params)
                raise layer_error(OutOfMemoryError, layer.name, layer.type,
                                  f"its learnable blobs {shapes} do not fit in the host's memory; is a dim or "
                                  "num_output mistyped?") from None
            for slot, array in zip(layer.params, arrays):
                if slot.is_owner:
                    self._param_blobs[slot.key]._data.set(np.asarray(array, self._dtype))

    # -- pycaffe's introspection ----------------------------------------------------------------------------
    @property
    def graph(self) -> Graph:
        return self._graph

    @property
    def phase(self) -> int:
        return self._phase

    @property
    def inputs(self) -> list[str]:
        return list(self._graph.inputs)

    @property
    def outputs(self) -> list[str]:
        return list(self._graph.outputs)

    @property
    def _layer_names(self) -> list[str]:
        return [layer.name for layer in self._graph.layers]

    @property
    def _blob_names(self) -> list[str]:
        return list(self._graph.blobs)

    @property
    def top_names(self) -> collections.OrderedDict:
        return collections.OrderedDict((layer.name, list(layer.tops)) for layer in self._graph.layers)

    @property
    def bottom_names(self) -> collections.OrderedDict:
        return collections.OrderedDict((layer.name, list(layer.bottoms)) for layer in self._graph.layers)

    @property
    def blob_loss_weights(self) -> collections.OrderedDict:
        return collections.OrderedDict((b, self._graph.blob_loss_weights.get(b, 0.0)) for b in self._graph.blobs)

    @property
    def _blob_loss_weights(self) -> list[float]:
        return list(self.blob_loss_weights.values())

    # Caffe's blob indices (positions in _blob_names), as pycaffe's private accessors give them to scripts.
    @property
    def _blobs(self) -> list[Blob]:
        return [self.blobs[name] for name in self._blob_names]

    @property
    def _inputs(self) -> list[int]:
        return self._blob_indices(self._graph.inputs)

    @property
    def _outputs(self) -> list[int]:
        return self._blob_indices(self._graph.outputs)

    def _bottom_ids(self, layer_index: int) -> list[int]:
        return self._blob_indices(self._graph.layers[layer_index].bottoms)

    def _top_ids(self, layer_index: int) -> list[int]:
        return self._blob_indices(self._graph.layers[layer_index].tops)

    def _blob_indices(self, names) -> list[int]:
        # The name -> index map is made once per graph (a reshape builds a new one): scripts call _bottom_ids(i)
        # for every layer, which rebuilt it each time was O(layers x blobs).
        graph, index = self._blob_index_map
        if graph is not self._graph:
            index = {name: i for i, name in enumerate(self._graph.blobs)}
            self._blob_index_map = (self._graph, index)
        return [index[name] for name in names]

    @property
    def layer_dict(self) -> collections.OrderedDict:
        return collections.OrderedDict((layer.name, layer) for layer in self.layers)

    def _check_blob_names(self, names: Sequence[str], argument: str) -> None:
        """Blob names asked for before the pass runs, so that a misspelt one costs no pass (pycaffe's KeyError
        came after it)."""
        unknown = [name for name in names if name not in self.blobs]
        if unknown:
            raise UnknownBlobError(f"{argument}: no blob named {', '.join(map(repr, unknown))} in net "
                                   f"'{self._graph.name}'")

    def _layer_index(self, name: str) -> int:
        try:
            return self._layer_names.index(name)
        except ValueError:
            raise CaffejaxError(f"no layer named '{name}' in net '{self._graph.name}'") from None

    # -- arrays for the programs ----------------------------------------------------------------------------
    def param_arrays(self) -> dict[str, list[Any]]:
        """The learnable blobs as the program's ``params`` pytree: layer name -> one entry per blob of the
        layer, the array where the layer owns the blob and None where it shares another layer's."""
        out: dict[str, list[Any]] = {}
        on_host: list[tuple[ArraySlot, str, int]] = []
        blobs = self._param_blobs
        for name, keys in self._facts.owned_params:
            arrays = out[name] = []
            for i, key in enumerate(keys):
                if key is None:
                    arrays.append(None)
                    continue
                data = blobs[key]._data
                array = data.value()
                if isinstance(array, np.ndarray) and not data.on_host():
                    on_host.append((data, name, i))
                arrays.append(array)
        if on_host:
            # Weights held as NumPy arrays nobody else can write (filled, loaded, or a .data since dropped) move
            # to the device once, not at every pass: AlexNet's Net.forward at batch 1 copied its 244 MB each call.
            moved = to_device([out[name][i] for _, name, i in on_host])
            for (data, name, i), array in zip(on_host, moved):
                data.set(array)
                out[name][i] = array
        return out

    def _feed(self, layers, read_only: bool = False) -> dict[str, Any]:
        """Values the layers read but do not produce: fed tops and earlier blobs, from the blobs' data. With
        ``read_only``, only what the compiled layers among them read (not the fed tops none of them reads, nor
        what only layers run on the host read: _host_feed): a program over them (a pass's) then does not change
        with those values' shapes (_range_signature)."""
        return self._blob_values(self._feed_sources(layers, read_only))

    def _blob_values(self, sources) -> dict[str, Any]:
        """Value id -> its blob's data, for (value id, blob name) pairs (:meth:`_feed_sources`)."""
        return {value: self.blobs[blob]._data.value() for value, blob in sources}

    def _feed_sources(self, layers, read_only: bool = False) -> list[tuple[str, str]]:
        """:meth:`_feed`'s values and the blobs it reads them from: (value id, blob name) pairs."""
        produced = set()
        sources: dict[str, str] = {}
        read = ({value for layer in layers if not layer.runs_on_host for value in layer.bottom_values}
                if read_only else None)
        for layer in layers:
            for j, value in enumerate(() if read_only and layer.runs_on_host else layer.bottom_values):
                if value not in produced and value not in sources:
                    sources[value] = layer.bottoms[j]
            if layer.is_input:
                for top, value in zip(layer.tops, layer.top_values):
                    if read is None or value in read:
                        sources[value] = top
            produced.update(layer.top_values)
        for value in self._graph.concrete:  # these enter the program as constants, see _with_concrete
            sources.pop(value, None)
        return list(sources.items())

    def _host_feed(self, layers) -> dict[str, Any]:
        """What the layers run on the host among ``layers`` (a pass's) read from before them, from the blobs' data:
        the fed tops and earlier blobs that the pass's program is not given (_feed's ``read_only``)."""
        made = {v for layer in layers if not layer.is_input for v in layer.top_values}
        return {v: self.blobs[blob]._data.value() for layer in layers if layer.runs_on_host
                for blob, v in zip(layer.bottoms, layer.bottom_values) if v not in made}

    def _last_forward_feed(self, layers, read_only: bool = False) -> dict[str, Any]:
        """:meth:`_feed`, with the fed values the last forward read where a layer in place overwrote their blob."""
        env = self._feed(layers, read_only)
        env.update((v, array) for v, array in self._overwritten_inputs.items() if v in env)
        return env

    def _holds(self, blob: str, value: str) -> bool:
        """Whether ``value`` can be read from ``blob``: the blob holds it, or the last forward kept what it read."""
        return self._blob_holds.get(blob, value) == value or value in self._overwritten_inputs

    def _recomputed_feed(self, before: int, layers, key) -> dict[str, Any]:
        """The values ``layers`` (a backward's range, from layer ``before`` on) read from blobs that no longer
        hold them, made again by the layers before the range that produce them, with the last forward's key.
        A range that starts inside an in-place chain (backward(end=...) at a Scale in place on a Power's top)
        reads the chain's input, which the chain's later layers overwrote in the blob; Caffe's layers keep what
        they need themselves (the Scale a copy of its bottom). Empty for a range from layer 0."""
        if before == 0:
            return {}
        produced = {value for layer in layers for value in layer.top_values}
        wanted = {value for layer in layers for blob, value in zip(layer.bottoms, layer.bottom_values)
                  if value not in produced and not self._holds(blob, value)}
        if not wanted:
            return {}
        needed, chosen = set(wanted), []
        for index in range(before - 1, -1, -1):  # the producers, and theirs where their bottoms are gone too
            layer = self._graph.layers[index]
            if needed.intersection(layer.top_values):
                chosen.append(index)
                needed.difference_update(layer.top_values)
                needed.update(value for blob, value in zip(layer.bottoms, layer.bottom_values)
                              if not self._holds(blob, value))
        prefix = [self._graph.layers[i] for i in reversed(chosen)]
        program, returned = self._program, tuple(sorted(wanted))

        def recompute(params, env, key, recorded):
            values = program.run_layers(prefix, params, env, key, kernels=program.forward_kernels,
                                        recorded=recorded)[0]
            return {v: values[v] for v in returned}

        fn = self._jitted("recompute", chosen[-1], before - 1, self._with_concrete(recompute),
                          variant=(tuple(reversed(chosen)), returned))
        recorded = {v: self._recorded_tops[v] for v in _python_top_values(prefix) if v in self._recorded_tops}
        env = {**self._last_forward_feed(prefix), **self._state_feed(prefix, self._state_seen)}
        return fn(self.param_arrays(), env, key, recorded)

    def _state_feed(self, layers, store: dict[str, Any]) -> dict[str, Any]:
        """The carried state ``layers`` read, from ``store``; a state whose shape no longer fits the graph
        (the batch changed) is dropped: the layer starts from zeros, as for a fresh net."""
        shapes = self._graph.value_shapes
        return {v: store[v] for layer in layers for v in layer.state_in
                if v in store and tuple(np.shape(store[v])) == tuple(shapes[v])}

    def _read_state(self, layers) -> dict[str, Any]:
        """The carried state ``layers`` read on this pass, remembered for the backward that follows it."""
        state = self._state_feed(layers, self._state)
        for layer in layers:
            for value in layer.state_in:
                self._state_seen.pop(value, None)
        self._state_seen.update(state)
        return state

    def reset_state(self) -> None:
        """Forget the state layers carry between forwards (RNN/LSTM start again from h_0 = c_0 = 0)."""
        self._state.clear()
        self._state_seen.clear()

    def _with_concrete(self, fn):
        """``fn(params, env, ...)`` with the shape-deciding values of the current graph added to ``env`` as
        constants (the program is compiled for exactly those values)."""
        concrete = dict(self._graph.concrete)
        if not concrete:
            return fn
        return lambda params, env, *rest: fn(params, {**env, **concrete}, *rest)

    def _next_pass(self) -> tuple[jax.Array, np.uint32]:
        """This pass's seed key and count, whose fold (``jax.random.fold_in``) is the pass's key; a program folds
        them itself (:func:`_folding_key`). The seed's key is made once: eagerly, ``jax.random.key`` costs
        0.1-0.2 ms."""
        self._pass_count += 1
        seed = mode.random_seed()
        if self._seed_key is None or self._seed_key[0] != seed:
            self._seed_key = (seed, jax.random.key(seed))
        return self._seed_key[1], np.uint32(self._pass_count)

    def _next_key(self) -> jax.Array:
        """This pass's key (:meth:`_next_pass`) on its own, as one compiled call (eagerly, ``fold_in`` costs
        0.1-0.2 ms)."""
        return fold_key(*self._next_pass())

    def _jitted(self, kind: str, start: int, end: int, build, variant: tuple = ()):
        """The compiled program of ``kind`` over layers start..end, ``build`` traced the first time; ``variant``
        names what else decides it (a backward's diffs made at once)."""
        cache_key = (self._range_key(min(start, end), max(start, end)), kind, start, end, variant)
        fn = self._compiled.get(cache_key)
        if fn is None:
            def counted(*args):
                self.compile_count += 1
                return build(*args)
            options = compiler_options(self._graph, backward=kind.startswith("backward"), dtype=self._dtype)
            fn = jit_through_cache(counted, options=options,
                                   describe=lambda: self._cache_description(kind, start, end, variant))
            if matmul_flops(self._graph) >= DEVICE_ARGUMENTS_MIN_FLOPS:
                fn = _with_device_arguments(fn)
            fn = self._compiled[cache_key] = _with_program_errors(fn, self._graph, self._source)
        return fn

    def _cache_description(self, kind: str, start: int, end: int, variant: tuple = ()
                           ) -> list[bytes | str] | None:
        """What a forward or backward program over the whole net computes, for the program cache: a new process
        then loads it instead of tracing the net (GoogLeNet at batch 1: forward 0.55 s; backward, whose trace
        and lowering JAX's own cache does not save, 2.4 s -> 0.7 s, half of it loading). None for programs whose
        arguments may change structure between calls (carried RNN state present or not), and for passes over
        part of the net (layer by layer, with callbacks set: a file per layer)."""
        if ((start, end) != (0, len(self._graph.layers) - 1) or kind.endswith("pullback")
                or any(layer.state_in for layer in self._graph.layers)):
            return None  # (a pullback's structure holds functions, which a cached program cannot)
        described = describe_graph(self._graph, self._program.kernels)
        if described is None:
            return None
        parts = ["net", kind, repr((start, end, self.channels_last, variant))]
        if kind.startswith("backward"):
            # Which diffs the pass computes: decided by force_backward and the inputs as well as the layers.
            parts.append(repr([(layer.need_backward, layer.bottom_need_backward, layer.param_need_backward,
                                layer.loss_weights) for layer in self._graph.layers]))
        return [*parts, *described]

    def _sync_shapes(self, learn_host_layers: bool = True) -> bool:
        """Caffe reshapes every layer on each forward: rebuild if a fed blob's shape changed. Returns whether the
        rebuilt net runs on the host a layer it compiled before (:meth:`_learn_layers_reading_changing_feeds`,
        unless not ``learn_host_layers``)."""
        wanted = {}
        for layer in self._graph.layers:
            if layer.is_input:
                for top, value in zip(layer.tops, layer.top_values):
                    if self.blobs[top].shape != self._graph.value_shapes[value] and not self._never_fed(top, value):
                        wanted[top] = self.blobs[top].shape
        learnt = bool(wanted) and learn_host_layers and self._learn_layers_reading_changing_feeds(set(wanted))
        for top in self._staged_blobs():  # what a host layer made this pass shapes the layers after it
            if self.blobs[top].shape != self._graph.blob_shape(top):
                wanted[top] = self.blobs[top].shape
        changed_values = any(not np.array_equal(self.blobs[blob].data, self._graph.concrete[value])
                             for value, blob in self._concrete_blobs().items())
        if wanted or changed_values:
            self.reshape()
        return learnt

    def _learn_layers_reading_changing_feeds(self, changed: set[str]) -> bool:
        """Where the fed blobs that changed shape (``changed``, by name) are read only by Python layers, through
        Splits (py-faster-rcnn's ground-truth boxes, a new count each image, read by its anchor and proposal
        target layers): run the compiled ones among those layers on the host from now on, so that the program
        before them does not read those blobs (build's Splits on the host) and is not compiled again for each of
        their shapes. At a fixed image size py-faster-rcnn's anchor target layer otherwise stays compiled (its
        tops, shaped by the score map, never change), and each new number of boxes compiled the backbone's
        forward and backward again. Not when a fed blob a compiled layer reads changed too (a new batch size):
        that program is compiled again anyway; nor when a Python loss layer reads one: a layer run on the host
        carries no loss weight. Returns whether any was newly learnt (the caller rebuilds)."""
        graph = self._graph
        if not any(layer.runs_on_host or calls_back(layer) for layer in graph.layers):
            return False  # (no layer could be moved: the walk below, at every reshape, finds none)
        readers = readers_by_value(graph.layers)

        def reading(value: str) -> list:  # the layers reading a value, through Splits (which follow them)
            return [last for layer in readers.get(value, []) for last in (
                [r for top in layer.top_values for r in reading(top)]
                if get_rule(layer.type).host_when_read_on_host else [layer])]

        def movable(layer) -> bool:  # (a loss has no gradient on the host: Caffe's backward starts from it)
            return layer.runs_on_host or (calls_back(layer) and not any(layer.loss_weights)
                                          and may_size_tops_by_data(layer.proto, layer.params, layer.is_input))
        found = [layer for top in changed if top in graph.fed for layer in reading(graph.fed[top])]
        if not all(movable(layer) for layer in found):
            return False
        compiled = [layer for layer in found if not layer.runs_on_host]
        for layer in compiled:
            self._python_layers.read_changing_feeds(layer.proto)
        return bool(compiled)

    def _require_shapes(self, layers, doing: str, then: str = "") -> None:
        """Caffe opens every data layer's source when it builds a net. caffejax builds a net whose source is
        missing too (to inspect it, draw it, or feed the data by hand), with every shape downstream unknown.
        Running those layers, or giving them weights, raises the data layer's own error, naming the layer that
        needed the shapes."""
        graph = self._graph
        if not self._shapes_unknown:
            return
        unknown = next((layer for layer in layers if any(graph.value_shapes.get(v) is None
                                                         for v in (*layer.bottom_values, *layer.top_values))), None)
        if unknown is None:
            return
        position = graph.layers.index(unknown)
        deferred = next((graph.deferred_errors[layer.name][0] for layer in graph.layers[:position + 1]
                         if layer.name in graph.deferred_errors), None)
        if deferred is not None:  # its bottoms did not fit although the layers sizing them by the data have run
            raise deferred
        hint = (f"so the shapes of layer '{unknown.name}' are unknown and it cannot {doing}. To feed the data "
                f"by hand, reshape the data layer's tops (net.blobs[name].reshape(...)) and call net.reshape(){then}")
        for layer in graph.layers:
            if layer.is_input and any(graph.value_shapes.get(v) is None for v in layer.top_values):
                try:
                    self._data_source(layer)
                except DataSourceUnavailable as e:
                    raise DataSourceUnavailable(f"{e}; {hint}") from None
                raise layer_error(ShapeError, layer.name, layer.type, f"its tops have no batch yet (run a forward "
                                  f"from the first layer, which reads one); {hint}")
        raise layer_error(ShapeError, unknown.name, unknown.type, "its shapes are unknown")

    def reshape(self) -> None:
        """Re-infer every shape from the fed blobs' current shapes (Caffe's Net::Reshape)."""
        with self._passes:
            shapes = self._fed_shapes()
            key = tuple(sorted(shapes.items()))
            graph = self._graphs_by_fed_shapes.get(key)
            if graph is not None:  # (adopted before, its learnable blobs made then)
                self._set_graph(graph)
                return
            self._set_graph(self._build(shapes))
            if _shaped_by_feeds_alone(self._graph):
                self._graphs_by_fed_shapes[key] = self._graph
            if any(slot.is_owner and slot.key not in self._param_blobs
                   for layer in self._graph.layers for slot in layer.params):
                # Shapes that were unknown (a data layer without its source, now fed by hand): their layers'
                # learnable blobs are made and filled now, as Caffe's LayerSetUp would have.
                self._init_params()

    # -- passes ---------------------------------------------------------------------------------------------
    def _data_source(self, layer):
        """The layer's DataSource, opened on first use and kept for the net's lifetime."""
        source = self._sources.get(layer.name)
        if source is None and layer.type == "Python":
            source = self._sources[layer.name] = HostDataLayer(layer.proto, self._phase, self._python_layers,
                                                               self._dtype)
        elif source is None:
            factory = get_rule(layer.type).data_source
            source = self._sources[layer.name] = factory(layer.proto, self._phase, self._base_dir)
        return source

    def close(self) -> None:
        """Stop the data layers' prefetching and close their databases and files. The net stays usable: a
        data layer opens its source again, from the start, on the next forward."""
        sources, self._sources = self._sources, {}
        for source in sources.values():
            source.close()

    def __enter__(self) -> "Net":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def set_input_arrays(self, data: np.ndarray, labels: np.ndarray) -> None:
        """pycaffe's set_input_arrays: the arrays the first layer, a MemoryData, serves batch by batch (float32,
        C-contiguous, used in place; labels 1-D or N x 1 x 1 x 1)."""
        first = self._graph.layers[0] if self._graph.layers else None
        if first is None or first.type != "MemoryData":
            raise CaffejaxError("set_input_arrays may only be called if the first layer is a MemoryDataLayer")
        self._data_source(first).reset(data, labels)

    _set_input_arrays = set_input_arrays  # pycaffe's name for the C++ call its set_input_arrays wraps

    def _pull_batches(self, layers) -> None:
        """Caffe's data layers produce a new batch on every forward: write it into their top blobs."""
        for layer in layers:
            if pulls_batches(layer):
                for top, array in zip(layer.tops, self._data_source(layer).next_batch()):
                    blob = self.blobs[top]
                    if blob.shape != tuple(array.shape):
                        blob.reshape(*array.shape)
                    blob._data.set(np.asarray(array, self._dtype))

    def _forward(self, start: int, end: int, keep_inputs: bool = False, pull: bool = True,
                 blobs: Iterable[str] = ()) -> float:
        """Caffe's ForwardFromTo(start, end) as one compiled pass: it hands back the range's outputs, ``blobs``
        (forward(blobs=...)'s) and the blobs read after each of the last two passes over the range
        (:meth:`_handed_back`); the others are recomputed when read (:meth:`_defer_blobs`)."""
        if pull:
            self._pull_batches(self._program.layers_between(start, end))
        if self._sync_shapes() and start != end:  # layers it compiled run on the host now, in stages around them
            return self._forward_in_stages(start, end, pull=False)
        if self._graph.deferred_errors and self._learn_layers_sizing_by_data():
            return self._forward_sized_by_data(start, end, keep_inputs)
        plan = self._pass_plan(start, end)
        layers = plan.layers
        self._require_shapes(layers, "run")
        program = self._program
        # The blobs read after each of the last two passes over the range: a blob read once (a script printing
        # every blob's shape) costs its recompute; one read after every pass (features taken from fc7) is handed
        # back from the third pass on, at the cost of one program more.
        watched, extra = self._handed_back(plan, blobs, self._learnt_blobs(start, end))
        returned = sorted({*plan.returned, *extra}) if extra else plan.returned
        # A pass that can run again folds the chains whose inner values blobs hold: those blobs are recomputed
        # layer by layer when read (_defer_blobs). Other chains' inner values are never made.
        reruns = plan.reruns

        def outputs_only(params, env, key, prepared):
            values, updates = program.run_layers(layers, params, env, key, kernels=program.forward_kernels,
                                                 fold_visible=reruns, prepared=prepared)
            return {v: values[v] for v in returned if v in values}, updates, program.loss(values, layers)

        wanted = self._wants_pullback(start, end)  # (first: it drops the pullbacks this pass supersedes)
        pullback_of = self._pullback_inputs(layers) if wanted and not keep_inputs else None
        if pullback_of is not None:
            seeded = tuple(self._backward_seeds([layer for layer in layers if not layer.runs_on_host]))
            returned = sorted({*returned, *seeded})
            fn = self._jitted("forward-pullback", start, end, self._with_concrete(
                _folding_key(self._forward_with_pullback(layers, returned, seeded, pullback_of))),
                variant=tuple(extra))
        else:
            fn = self._jitted("forward", start, end, self._with_concrete(_folding_key(outputs_only)),
                              variant=tuple(extra))
        seed_key, count = self._next_pass()
        # What this pass sees, kept for a deferred blob's recompute: device values, and private copies of host
        # arrays (ArraySlot.value), which the program call moves to the device (_jitted).
        params = self.param_arrays()
        env = self._blob_values(plan.feed)
        if plan.state:
            env.update(self._read_state(layers))
        host_fed = self._host_feed(layers) if self._host_layers else {}
        # (Not layer by layer: there each layer's program prepares its own weights, as one program more per layer
        # would cost a compile and a call and save nothing.)
        arguments = (params, env, seed_key, count) if pullback_of is not None else (
            params, env, seed_key, count,
            {} if keep_inputs else self._prepared_weights(start, end, layers, params, reruns))
        try:  # a Python layer's failure inside the program surfaces here, typed, once the program has run
            with self._python_layers:
                values, updates, loss, *pullback = jax.block_until_ready(fn(*arguments))
        except TopsSizedByData:
            return self._forward_sized_by_data(start, end, keep_inputs)
        key = _PassKey(seed_key, count)
        self._note_pass_key(start, end, key)
        if keep_inputs:  # one layer run on its own: its backward reads what it read (not the blobs' later data),
            self._layer_inputs[start] = (env, key)  # with its key (the same Dropout mask)
        if pullback:
            self._pullbacks[(start, end)] = _Pullback(
                pullback[0], pullback_of, None if self._keep_every_pullback else jax.tree.leaves((params, env)),
                {v: jax.ShapeDtypeStruct(np.shape(values[v]), values[v].dtype) for v in seeded},
                self._range_key(start, end))
        made_on_host = self._run_host_layers(layers, values, {**host_fed, **env})
        # A Python layer's tops, for a backward that must not run its forward again (Caffe's Backward reads the
        # tops Forward left; a pass over a Python layer hands back every value).
        self._recorded_tops.update((v, values[v]) for v in plan.python_tops if v in values)
        self._state.update((v, values[out]) for v, out in plan.state)
        final = self._note_pass(start, end, env)
        for top, value in final.items():
            if value in values:
                self.blobs[top]._data.set(values[value])
        self._watch_reads([top for top in watched if final[top] in values], self._reads_after(start, end))
        self._defer_blobs(start, end, {top: value for top, value in final.items()
                                       if value not in values and value not in made_on_host}, params, env, key)
        for owner, changed in updates.items():
            for i, value in changed.items():
                self._param_blobs[(owner, i)]._data.set(value)
        return float(loss) if plan.weighs_loss else 0.0

    def _reads_after(self, start: int, end: int) -> set[str]:
        """The blobs read since the last pass over layers start..end (see :meth:`_handed_back`), noted as read."""
        return self._blobs_read.setdefault((start, end), set())

    def _learnt_blobs(self, start: int, end: int) -> set[str]:
        """The blobs read after each of the last two passes over layers start..end, called as a pass begins: the
        reads since the last pass become those before it. At most LEARNT_SETS_PER_RANGE sets of them over one
        range of one graph (its passes, and a solver's iterations over the whole net): past those, the largest of
        them that the blobs read hold."""
        read = self._blobs_read.pop((start, end), set())
        learnt = read & self._blobs_read_before.get((start, end), set())
        self._blobs_read_before[(start, end)] = read
        if not learnt:
            return learnt
        used, learnt = self._facts.learnt_sets.setdefault((start, end), []), frozenset(learnt)
        if learnt not in used:
            if len(used) >= LEARNT_SETS_PER_RANGE:
                return set(max((blobs for blobs in used if blobs <= learnt), key=len, default=()))
            used.append(learnt)
        return set(learnt)

    def _watch_reads(self, blobs: Iterable[str], read: set[str]) -> None:
        """Note in ``read`` the first read of each of ``blobs``, which hold their values (ArraySlot.defer)."""
        for blob in blobs:
            self.blobs[blob]._data.defer(functools.partial(_noting_read, read, blob))

    @staticmethod
    def _handed_back(plan: _PassPlan, blobs: Iterable[str], learnt: set[str]) -> tuple[set[str], list[str]]:
        """What a forward hands back besides the outputs (the value ids its program returns besides
        ``plan.returned``, sorted): those of ``blobs`` and of the ``learnt`` blobs (read after the last two passes
        over its range), which it writes; and which of the latter to watch for a read (returned for as long as
        they are read). A script reading ``net.blobs['fc7'].data`` after each forward (feature extraction) had
        every pass run twice, the second time writing every blob out: AlexNet at batch 1 took 47-49 ms so, and
        forward(blobs=['fc7']) 49-50 ms, against 23 for the forward alone; now 22-23 both (2 AMD EPYC cores,
        alternating processes)."""
        final, returned = plan.writes[0], set(plan.returned)
        extra = {final[blob] for blob in (*blobs, *learnt) if blob in final} - returned
        return {blob for blob in learnt if final.get(blob) in extra} - set(blobs), sorted(extra)

    def _pass_plan(self, start: int, end: int) -> _PassPlan:
        """The :class:`_PassPlan` of a forward over layers start..end of the current graph."""
        plan = self._facts.pass_plans.get((start, end))
        if plan is None:
            layers = self._program.layers_between(start, end)
            plan = self._facts.pass_plans[(start, end)] = _PassPlan(
                layers, sorted(self._returned_values(layers)), self._reruns(layers),
                self._feed_sources(layers, read_only=True), _python_top_values(layers),
                [(v, out) for layer in layers for v, out in zip(layer.state_in, layer.state_out)],
                bool(self._program.loss_weighted_values(layers)), self._writes_of(layers))
        return plan

    def _prepared_weights(self, start: int, end: int, layers, params, fold_visible: bool) -> dict[str, list]:
        """The weights a forward's kernels read, in their form (NetProgram.prepare_weights: channels-last
        filters, BatchNorm folded into them), made by a program of their own and kept while the weights are the
        very arrays they were made from: a forward over the same weights does not make them again. ResNet-50's
        Net.forward at batch 1 spent 15 ms of its 80 laying out 102 MB of filters, every call (2 AMD EPYC cores).
        The weights are held weakly: the arrays made from them are all that is kept of them.

        The program for other input shapes takes them too where its preparation computes the same
        (:meth:`_preparation_digest`), and compiles none of its own. Made again on every forward where the shape
        changed, fed batches of 1 and 2 in turn ResNet-50 took 138-141 ms at batch 1 and 207 ms at batch 2,
        then 92-107 and 146-176 ms; VGG16's Faster R-CNN fed 300x400 and 400x300 images in turn (py-faster-rcnn's
        test feeds two orientations) 1037-1041 ms, then 988-1004 ms (2 AMD EPYC cores, alternating processes).
        Each form is kept (one entry per range and preparation): with one entry, ResNet-50's batches of 1 and 2 (3x3
        layers as Winograd from batch 2) laid the weights out again at every switch, 106-133 and 145-197 ms, now
        64-86 and 110-141 (2 AMD EPYC Zen 3 cores, alternating processes)."""
        program = self._program
        leaves = jax.tree.leaves(params)
        range_key = (start, end, fold_visible)
        kept = self._prepared.get(range_key, [])
        for entry in kept:
            if entry.program is program and entry.made_from(leaves):
                return entry.arrays
        lays_out = any(layer.params and (kernel := program.forward_kernels.get(layer.name)) is not None
                       and (kernel.prepares or kernel.chain is not None) for layer in layers)
        prepared = {}
        if lays_out and PREPARE_WEIGHTS_APART:
            # Another program's (other input shapes) preparation of the range may compute the same: compared only
            # then, its arrays or its compiled program serve this one.
            digest = self._preparation_digest(program, layers, range_key, params) if kept else None
            same = next((i for i, entry in enumerate(kept) if entry.arrays and entry.made_from(leaves) and digest
                         == self._preparation_digest(entry.program, entry.layers, range_key, params)), None)
            if same is not None:  # (an entry of its own, the same arrays: found at once next time)
                kept.append(dataclasses.replace(kept[same], program=program, layers=layers))
                return kept[same].arrays
            prepare = self._preparations.get(digest) if digest is not None else None
            if prepare is None:
                prepare = self._jitted("prepare", start, end, lambda params: program.prepare_weights(
                    layers, params, fold_visible), variant=(fold_visible,))
                if digest is not None:
                    self._preparations[digest] = prepare
            prepared = prepare(params)
        # Per range (a net run in stages runs several, each stage a program of its own), one entry for each
        # preparation that computes something else (MTCNN's det1 lays its conv1 out for the shifted multiply-adds
        # on big pyramid scales and for XLA's convolution on small ones: kept apart, a pycaffe script's walk over
        # the scales made each again at every switch), none kept of weights since replaced.
        self._prepared = {k: [entry for entry in entries if entry.made_from(leaves)]
                          for k, entries in self._prepared.items()}
        self._prepared.setdefault(range_key, []).append(
            _PreparedWeights(program, layers, [weakref.ref(leaf) for leaf in leaves], prepared))
        return prepared

    def _preparation_digest(self, program: NetProgram, layers, range_key: tuple[int, int, bool], params) -> bytes:
        """A SHA-256 digest of what ``program.prepare_weights`` computes over ``layers`` from arrays shaped as
        ``params``: its jaxpr, constants and output structure. Equal digests, equal arrays from the same weights.
        Traced once per program and range, which costs less than compiling it: ResNet-50's first forward at a
        second batch size took 1.36-1.45 s so, 2.07-2.17 s compiling its own preparation."""
        digests = self._preparation_digests.setdefault(program, {})
        digest = digests.get(range_key)
        if digest is None:
            fold_visible = range_key[2]
            closed, shapes = jax.make_jaxpr(lambda params: program.prepare_weights(layers, params, fold_visible),
                                            return_shape=True)(params)
            hashed = hashlib.sha256(str(closed.jaxpr).encode())
            hashed.update(repr(jax.tree.structure(shapes)).encode())
            for const in closed.consts:
                hashed.update(bits_digest(np.asarray(const)))
            digest = digests[range_key] = hashed.digest()
        return digest

    def _note_pass_key(self, start: int, end: int, key: _PassKey) -> None:
        """Remember the key of a forward pass over layers start..end (it supersedes those of passes it overlaps)."""
        self._last_key = key
        self._pass_keys = {(a, b): k for (a, b), k in self._pass_keys.items() if b < start or a > end}
        self._pass_keys[(start, end)] = key

    def _key_of_forward(self, first: int, last: int) -> jax.Array:
        """The key of the last forward pass whose range holds layers first..last, which the layers' Dropout masks
        came from; else the last pass's (or a new one, before any forward)."""
        for (a, b), key in self._pass_keys.items():
            if a <= first and last <= b:
                return key()
        return self._last_key() if self._last_key is not None else self._next_key()

    @contextlib.contextmanager
    def _keeping_pullbacks(self):
        """A solver's iteration by passes (Net.forward, then Net.backward, nothing between them): every forward pass
        keeps its pullback (_wants_pullback), from the first iteration on; none is kept after it."""
        self._keep_every_pullback = True
        try:
            yield
        finally:
            self._keep_every_pullback = False
            self._pullbacks.clear()

    def _wants_pullback(self, start: int, end: int) -> bool:
        """Whether a forward pass over layers start..end keeps its pullback (jax.vjp's, holding what a backward needs
        of the forward), so that the backward over the same range runs from it instead of running the forward again
        (AlexNet at batch 16, Net.forward + Net.backward to the data 1.07 -> 0.81 s; GoogLeNet at 8, 0.82 -> 0.70;
        a VGG16 Faster R-CNN's stages at 300 x 400, 4.7 -> 3.7 s). It costs the forward about a tenth more and holds
        the residuals until that backward. So it is kept in a solver's iteration by passes, and for a range whose
        last forward a backward followed (pycaffe's loop of net.forward() and net.backward(), without the program
        cache), until a forward of it finds the last one's pullback unused: the user runs forwards alone now."""
        for overlapping in [r for r in self._pullbacks if not (r[1] < start or r[0] > end)]:
            del self._pullbacks[overlapping]
            if overlapping == (start, end) and not self._keep_every_pullback:
                self._pullback_ranges.discard(overlapping)
        return self._keep_every_pullback or (start, end) in self._pullback_ranges

    def _pullback_inputs(self, layers) -> tuple[str, ...] | None:
        """For a forward pass over ``layers`` that keeps its pullback: the values read from before them whose
        diffs a backward over the same range may hand on (the pullback's perturbed inputs). None where no
        backward will run from it: nothing there needs one, a layer run on the host needs one (the backward splits
        its range there), or the program calls back into a Python layer (the backward then makes every blob's
        diff at once, inner ones included, which a pullback of the inputs cannot give)."""
        compiled = [layer for layer in layers if not layer.runs_on_host]
        if (not any(layer.need_backward for layer in compiled) or not self._reruns(layers)
                or any(layer.runs_on_host and layer.need_backward for layer in layers)):
            return None
        made = {v for layer in compiled if not layer.is_input for v in layer.top_values}
        return tuple(dict.fromkeys(v for layer in compiled if layer.need_backward
                                   for v, need in zip(layer.bottom_values, layer.bottom_need_backward)
                                   if need and v not in made))

    def _forward_with_pullback(self, layers, returned: Sequence[str], seeded: Sequence[str], inputs: Sequence[str]):
        """A forward pass's program that also hands back its pullback: from the diffs of the values that seed a
        backward over the same layers (``seeded``: _backward_seeds) to the params' diffs and those of ``inputs``.
        Its forward is the backward's (Caffe's masks on), so its values are the plain forward's. Such a pass may
        run again (_pullback_inputs), so its visible chains fold, as the plain forward's do."""
        program = self._program

        def forward(params, env, key):
            def run(params, perturb):
                env_in = {v: (x + perturb[v] if v in perturb else x) for v, x in env.items()}
                values, updates = program.run_layers(layers, params, env_in, key, masks=True,
                                                     kernels=program.kernels, fold_visible=True)
                return ({v: values[v] for v in seeded},
                        ({v: values[v] for v in returned if v in values}, updates, program.loss(values, layers)))

            perturb = {v: jnp.zeros_like(env[v]) for v in inputs}
            _, pullback, (values, updates, loss) = jax.vjp(run, params, perturb, has_aux=True)
            return values, updates, loss, pullback

        return forward

    def _backward_seeds(self, layers) -> dict[str, str]:
        """The values whose diffs seed a backward over compiled ``layers``: their tops no layer among them reads
        (value id -> blob name): a loss top's diff (its weight), or what the layers after them handed back."""
        consumed = {v for layer in layers for v in layer.bottom_values}
        return {value: top for layer in layers if not layer.is_input
                for top, value in zip(layer.tops, layer.top_values) if value not in consumed and top in self.blobs}

    def _run_host_layers(self, layers, values: Mapping[str, Any], fed: Mapping[str, Any] | None = None) -> set[str]:
        """Run the layers among ``layers`` that run on the host (Layer.runs_on_host) on ``values`` and ``fed``
        (value id -> array: what a pass made and read) and write their tops into the blobs, reshaped to what they
        made, as their Forward reshapes them in Caffe. Returns the values written."""
        if not self._host_layers:  # most nets: nothing to look up on every pass
            return set()
        made = run_host_layers(layers, {**(fed or {}), **values}, self._python_layers)
        for layer in layers:
            for top, value in zip(layer.tops, layer.top_values):
                if value in made:
                    blob, array = self.blobs[top], made[value]
                    if blob.shape != array.shape:
                        blob.reshape(*array.shape)
                    blob._data.set(array)
        return set(made)

    def _note_pass(self, start: int, end: int, env: Mapping[str, Any]) -> dict[str, str]:
        """Note what a forward over layers start..end that read ``env`` left (this net's passes, and a solver's
        step over the whole net): which value each blob it wrote now holds, and what it read from blobs that a
        layer of the pass then overwrote in place. Returns the blobs it wrote -> their values."""
        final, overwritten, made = self._pass_plan(start, end).writes
        if self._overwritten_inputs:  # what this pass made or read afresh supersedes what an earlier pass read
            for value in made:
                self._overwritten_inputs.pop(value, None)
        self._overwritten_inputs.update((value, env[value]) for value in overwritten if value in env)
        self._blob_holds.update(final)
        return final

    def _writes_of(self, layers) -> tuple[dict[str, str], tuple[str, ...], tuple[str, ...]]:
        """What a forward over ``layers`` leaves (_PassPlan.writes): each blob it writes -> the value the blob then
        holds; the values it reads from blobs that a layer of the pass then overwrites in place; and every value
        its layers make or feed."""
        final: dict[str, str] = {}
        for layer in layers:
            if not layer.is_input:
                final.update((top, value) for top, value in zip(layer.tops, layer.top_values) if top in self.blobs)
        read = {value: blob for layer in layers if layer.is_input
                for blob, value in zip(layer.tops, layer.top_values)}
        produced = {value for layer in layers if not layer.is_input for value in layer.top_values}
        read.update((value, blob) for layer in layers for blob, value in zip(layer.bottoms, layer.bottom_values)
                    if value not in produced)
        overwritten = tuple(value for value, blob in read.items() if final.get(blob, value) != value)
        made = tuple(value for layer in layers for value in layer.top_values)
        return final, overwritten, made

    @staticmethod
    def _reruns(layers) -> bool:
        """Whether a pass over ``layers`` may run again to make the blobs it did not hand back: not over a Python
        layer the program calls back into, which may keep state between calls (a data layer's tops are fed)."""
        return not any(calls_back(layer) for layer in layers)

    def _returned_values(self, layers) -> set[str]:
        """The values a compiled pass over ``layers`` hands back: the outputs (values no layer there reads), the
        loss-weighted values and the carried state. The other blobs are recomputed when read
        (:meth:`_defer_blobs`), except where the pass may not run twice (:meth:`_reruns`): such a pass hands back
        every value."""
        tops = {v for layer in layers if not layer.is_input and not layer.runs_on_host for v in layer.top_values}
        state = {v for layer in layers for v in layer.state_out}
        host_reads = {v for layer in layers if layer.runs_on_host for v in layer.bottom_values} & tops
        if not self._reruns(layers):
            return tops | state
        consumed = {v for layer in layers for v in layer.bottom_values}
        return ({v for v in tops if v not in consumed} | set(self._program.loss_weighted_values(layers)) | state
                | host_reads)

    def _defer_blobs(self, start: int, end: int, deferred: Mapping[str, str], params, env, key: _PassKey) -> None:
        """Blobs (name -> value id) a pass over layers start..end computed without returning them: on the first
        read of any of them, the pass runs again over the same params, inputs and key (so the same Dropout
        masks), and sets them all; the blob read is noted for the next pass (:meth:`_handed_back`). Returning
        every blob makes a program write each one out."""
        if not deferred:
            return
        program = self._program
        layers = program.layers_between(start, end)
        all_values = self._jitted("forward-all", start, end, self._with_concrete(
            lambda params, env, key: program.run_layers(layers, params, env, key, kernels=program.forward_kernels)[0]))

        def materialize():
            computed = all_values(params, env, key())
            made = [top for top in deferred if self.blobs[top]._data._pending is loads[top]]
            for top in made:
                self.blobs[top]._data.set(computed[deferred[top]])
            self._watch_reads(made, read)  # (a later read of each is noted too)

        read = self._reads_after(start, end)
        loads = {top: functools.partial(_noting_read, read, top, materialize) for top in deferred}
        for top, load in loads.items():
            self.blobs[top]._data.defer(load)

    def _forget_deferred_blobs(self) -> None:
        """Drop every blob's pending recomputation (:meth:`_defer_blobs`): each keeps the value it held before."""
        for blob in self.blobs.values():
            blob._data._pending = None
            blob._diff._pending = None

    # -- pycaffe's layer callbacks ----------------------------------------------------------------------------
    def before_forward(self, callback) -> None:
        """pycaffe's ``net.before_forward(fn)``: ``fn(i)`` before layer i's forward (see :meth:`after_backward`)."""
        self._layer_callbacks["before_forward"].append(callback)

    def after_forward(self, callback) -> None:
        """pycaffe's ``net.after_forward(fn)``: ``fn(i)`` after layer i's forward."""
        self._layer_callbacks["after_forward"].append(callback)

    def before_backward(self, callback) -> None:
        """pycaffe's ``net.before_backward(fn)``: ``fn(i)`` before layer i's backward."""
        self._layer_callbacks["before_backward"].append(callback)

    def after_backward(self, callback) -> None:
        """pycaffe's ``net.after_backward(fn)``: ``fn(i)`` after layer i's backward (called for every layer in
        the range, as Caffe does, whether or not it needs one).

        With any of these set, forward and backward run the way Caffe's ForwardFromTo and BackwardFromTo do:
        one layer at a time, each its own compiled program (one compile per layer, the first time), with the
        callbacks around it. A callback sees the blobs the layers before it left, and what it writes into them
        is what the next layer reads. A layer's backward reads the bottoms its forward read, in-place chains
        included. Without callbacks a pass is one program."""
        self._layer_callbacks["after_backward"].append(callback)

    def _runs_layer_by_layer(self) -> bool:
        """Whether a pass must stop after every layer: for layer callbacks, or to log debug_info."""
        return self.debug_info or any(self._layer_callbacks.values())

    def _run_callbacks(self, when: str, index: int) -> None:
        for callback in self._layer_callbacks[when]:
            callback(index)

    def _learn_layers_sizing_by_data(self, graph: Graph | None = None) -> bool:
        """After a rebuild whose shapes did not fit downstream of Python layers that may size their tops by the
        data (Graph.deferred_errors: py-faster-rcnn's anchor target layer, its tops shaped in setup at the last
        image size and in forward at this one): run those layers on the host from now on, as one whose forward
        sized its tops does (TopsSizedByData), so that the layers after them are shaped by what they make.
        Returns whether any was newly learnt (the caller then rebuilds). ``graph``: a build of this net at other
        shapes (compile_inference's), else the net's own."""
        graph = self._graph if graph is None else graph
        named = {layer.name: layer for layer in graph.layers}
        learnt = False
        for _, sized_by in graph.deferred_errors.values():
            for name in sized_by:
                layer = named[name]
                if calls_back(layer) and not layer.runs_on_host:
                    self._python_layers.size_by_data(layer.proto)
                    learnt = True
        return learnt

    def _forward_sized_by_data(self, start: int, end: int, keep_inputs: bool) -> float:
        """The pass over layers start..end again, after a Python layer's forward in it sized its tops by the data
        (TopsSizedByData): the rebuilt net runs that layer on the host, in stages if compiled layers read its
        tops. The data layers keep the batch the pass read; the layer's first host call takes the tops that
        forward made."""
        self.reshape()
        if start == end:
            return self._forward(start, end, keep_inputs, pull=False)
        return self._forward_in_stages(start, end, pull=False)

    def _forward_in_stages(self, start: int, end: int, pull: bool = True) -> float:
        """Caffe's ForwardFromTo over a net where compiled layers read what a layer run on the host makes
        (Graph.staging_layers): the layers before that layer as one program, the layer on the host (its tops
        written into their blobs, reshaped as its Forward reshapes them), then the layers after it, which
        _forward reshapes to those tops (a program per shape, as for a new input shape)."""
        loss, begin = 0.0, start
        for stage in self._staging:
            if start <= stage <= end:
                if begin < stage:
                    loss += self._forward(begin, stage - 1, pull=pull)
                loss += self._forward(stage, stage, pull=pull)
                begin = stage + 1
        return loss + (self._forward(begin, end, pull=pull) if begin <= end else 0.0)

    def _forward_layer_by_layer(self, start: int, end: int) -> float:
        """Caffe's ForwardFromTo with callbacks or debug_info: layer by layer, the callbacks around each."""
        if self.debug_info:
            log_inputs(self)
        loss = 0.0
        for i in range(start, end + 1):
            self._run_callbacks("before_forward", i)
            loss += self._forward(i, i, keep_inputs=True)
            if self.debug_info:
                log_forward(self, i)
            self._run_callbacks("after_forward", i)
        return loss

    def _backward_layer_by_layer(self, start: int, end: int) -> None:
        """Caffe's BackwardFromTo with callbacks or debug_info: layer by layer, top down, the callbacks around
        each."""
        for i in range(start, end - 1, -1):
            self._run_callbacks("before_backward", i)
            layer = self._graph.layers[i]
            if layer.need_backward:
                if layer.runs_on_host:
                    self._host_backward(layer)
                else:
                    self._backward(i, i)
                if self.debug_info:
                    log_backward(self, i)
            self._run_callbacks("after_backward", i)

    def forward(self, blobs: Iterable[str] | None = None, start: str | None = None, end: str | None = None,
                **kwargs) -> dict[str, np.ndarray]:
        """pycaffe's forward: optional input arrays by name; returns the outputs (and ``blobs``) by name."""
        blobs = list(blobs or [])
        self._check_blob_names(blobs, "forward(blobs=...)")
        start_ind = 0 if start is None else self._layer_index(start)
        if end is not None:
            end_ind = self._layer_index(end)
            outputs = set(self.top_names[end] + blobs)
        else:
            end_ind = len(self._graph.layers) - 1
            outputs = set(self.outputs + blobs)
        arrays = {}
        if kwargs:
            if set(kwargs) != set(self.inputs):
                raise CaffejaxError(f"input blob arguments {sorted(kwargs)} do not match net inputs {self.inputs}")
            for name, array in kwargs.items():
                array = arrays[name] = as_numbers(name, array, self._dtype)
                expected = self.blobs[name].shape
                if array.shape != expected and (array.ndim != len(expected) or array.shape[0] != expected[0]
                                                or not _broadcasts(array.shape, expected)):
                    raise ShapeError(f"input '{name}' has shape {array.shape}; the net expects {expected} "
                                     f"(reshape the blob first)")
        with self._passes:
            for name, array in arrays.items():
                self.blobs[name].data[...] = array
            with self._python_layers:
                self._last_loss = (self._forward_layer_by_layer(start_ind, end_ind) if self._runs_layer_by_layer()
                                   else self._forward_in_stages(start_ind, end_ind) if self._staging
                                   else self._forward(start_ind, end_ind, blobs=blobs))
            if self.debug_nans:
                self._check_finite(outputs)
            return {name: self.blobs[name].data for name in outputs}

    def _check_finite(self, blobs) -> None:
        """With debug_nans: raise NumericalError naming the first layer that made NaN/Inf, if any output has."""
        if all(np.all(np.isfinite(self.blobs[name].data)) for name in blobs) and np.isfinite(self._last_loss):
            return
        from caffejax.runtime.debug_nans import find_first_nan

        found = find_first_nan(self, recorded=self._recorded_tops)
        raise NumericalError(f"forward of net '{self._graph.name}' produced NaN/Inf: "
                             + (str(found) if found else "no single layer does when replayed eagerly"))

    def _backward(self, start: int, end: int, returned: Iterable[str] = ()) -> None:
        """Caffe's BackwardFromTo(start, end): layers start down to end (indices, start >= end). The parameters'
        diffs and the ``returned`` blobs' diffs are made now; the other blobs' diffs when first read
        (:meth:`_defer_diffs`), as a forward's blobs are. A pass that writes every diff out cannot run the
        channels-last kernels (program.forward_backward), and compiles slower: with all three (the sums below
        too), GoogLeNet's Net.backward at batch 1 went from 179-195 to 151-163 ms and its first call from 19-21
        to 10-11 s; MobileNet v2's at batch 16 from 2.0-2.4 s to 0.87-0.99 s."""
        layers = self._program.layers_between(end, start)
        self._require_shapes(layers, "run")
        if self._host_layers:
            # Only one whose backward is not needed (_backward_around_host splits the others off): its bottoms'
            # diffs then seed the layers before it as they are, as Caffe's blobs keep them.
            assert not any(layer.runs_on_host and layer.need_backward for layer in layers)
            layers = [layer for layer in layers if not layer.runs_on_host]
        seeds = {value: self.blobs[top]._diff.value() for value, top in self._backward_seeds(layers).items()}
        final = {}  # blob -> the value whose diff it holds after the pass: of an in-place chain, its first bottom
        for layer in reversed(layers):
            if layer.need_backward:
                final.update((blob, value) for blob, value, need in
                             zip(layer.bottoms, layer.bottom_values, layer.bottom_need_backward) if need)
        rerun = self._reruns(layers) and start != end  # one layer (callbacks set): its diffs are read next
        # A blob that seeds the pass and that an in-place layer then writes (backward(start=...) from a ReLU
        # run in place) is made at once too: the next pass's seed is written into it, which would first make it.
        seeding = {top for layer in layers for top, value in zip(layer.tops, layer.top_values) if value in seeds}
        now = tuple(sorted({value for blob, value in final.items()
                            if blob in returned or blob in seeding or not rerun}))
        # Caffe adds each pass's parameter gradients to the diffs: the sums are made in the program (one add
        # each, eagerly, compiled a program per shape the first time: GoogLeNet's 116 took 0.8 s).
        # A blob shared by ParamSpec name has one diff (Net::ShareWeights shares it): each layer in the range
        # that uses it adds its part, so a range holding only a sharer (layer by layer) still adds to it.
        storages = dict.fromkeys(slot.storage for layer in layers if layer.need_backward
                                 for slot, need in zip(layer.params, layer.param_need_backward) if need)
        accumulated = [(owner, index, self._param_blobs[(owner, index)]._diff) for owner, index in storages]
        slots = [(owner, index) for owner, index, _ in accumulated]
        program = self._program

        def backward_pass(params, env, seeds, key, recorded, param_diffs):
            grads, value_diffs = program.forward_backward(params, env, seeds, key, start=end, end=start,
                                                          diff_values=now, recorded=recorded)[2:]
            return [diff + grads[owner][index] for (owner, index), diff in zip(slots, param_diffs)], value_diffs

        kept = self._layer_inputs.get(start) if start == end else None
        params = self.param_arrays()
        if kept is not None:
            env, key = kept[0], kept[1]()
        else:
            key = self._key_of_forward(end, start)
            env = {**self._last_forward_feed(layers, read_only=True), **self._state_feed(layers, self._state_seen)}
            env.update(self._recomputed_feed(end, layers, key))
        # The forward's pullback, where this pass's forward kept one (_wants_pullback), only diffs it can give are
        # wanted now, and the weights and inputs are the ones it was made from: the forward is not run again.
        pulled = self._pullbacks.pop((end, start), None)
        if pulled is not None and (not set(now) <= set(pulled.inputs)
                                   or pulled.signature != self._range_key(end, start)
                                   or (pulled.made_from is not None
                                       and not _same_arrays(pulled.made_from, (params, env)))):
            pulled = None
        if (pulled is None and (end, start) in self._pass_keys and self._pullback_inputs(layers) is not None
                and cache_directory() is None):
            # A backward followed that forward: the next one keeps its pullback. Not with the program cache on: its
            # programs hand a function from one to the other, which no cached program can, so every new process
            # would trace and compile them (GoogLeNet's backward at batch 1: 2.4 s, against 0.7 s loaded).
            self._pullback_ranges.add((end, start))
        recorded = {v: self._recorded_tops[v] for v in _python_top_values(layers) if v in self._recorded_tops}
        diffs_before = [diff.value() for _, _, diff in accumulated]
        if pulled is not None:
            avals = pulled.seeds

            def from_pullback(pullback, seeds, param_diffs):
                grads, value_diffs = pullback({v: jnp.asarray(seeds[v], aval.dtype).reshape(aval.shape)
                                               for v, aval in avals.items()})
                return ([diff + grads[owner][index] for (owner, index), diff in zip(slots, param_diffs)],
                        {v: value_diffs[v] for v in now})

            fn = self._jitted("backward-pullback", end, start, from_pullback, variant=now)
            param_diffs, value_diffs = fn(pulled.pullback, seeds, diffs_before)
        else:
            fn = self._jitted("backward", end, start, self._with_concrete(backward_pass), variant=now)
            param_diffs, value_diffs = fn(params, env, seeds, key, recorded, diffs_before)
        for blob, value in final.items():
            if value in value_diffs:
                self.blobs[blob]._diff.set(value_diffs[value])
        for (_, _, diff), summed in zip(accumulated, param_diffs):
            diff.set(summed)
        self._defer_diffs(start, end, {blob: value for blob, value in final.items() if value not in value_diffs},
                          (params, env, seeds, key, recorded))

    def _backward_around_host(self, start: int, end: int, returned: Iterable[str] = ()) -> None:
        """Caffe's BackwardFromTo(start, end) over layers among which some run on the host (Layer.runs_on_host)
        and either need a backward or make what a compiled layer in the range reads (Graph.staging_layers): one
        program can hold neither. The layers after such a layer first, as one program (handing back the diffs
        of the blobs they read from before them); then the layer's backward on the host (program.host_backward:
        py-faster-rcnn's Proposal propagates nothing, a Python layer runs its own backward), which writes its
        bottoms' diffs; then the layers before it, seeded by those diffs."""
        top = start
        for index in range(start, end - 1, -1):
            layer = self._graph.layers[index]
            if layer.runs_on_host and (layer.need_backward or index in self._staging):
                if index < top:
                    self._backward_in_passes(top, index + 1, [*returned, *self._read_from_before(index + 1, top)])
                if layer.need_backward:
                    self._host_backward(layer)
                top = index - 1
        if top >= end:
            self._backward_in_passes(top, end, returned)

    def _backward_in_passes(self, start: int, end: int, returned: Iterable[str] = ()) -> None:
        """Caffe's BackwardFromTo(start, end) over layers the last forwards ran in several passes
        (``forward(end=X)``, then ``forward(start=...)``, with the blobs written in between): one backward per
        pass's part, from the top, each handing the next the diffs of what it read from below. Each part then runs
        with its own forward's key (its Dropout masks), and reads the blobs it started from as that forward did;
        one backward over all of them recomputed every layer from the inputs with the last pass's key."""
        cuts = sorted({cut for first, last in self._pass_keys for cut in (first - 1, last) if end <= cut < start},
                      reverse=True)
        top = start
        for cut in cuts:
            self._backward(top, cut + 1, [*returned, *self._read_from_before(cut + 1, top)])
            top = cut
        self._backward(top, end, returned)

    def _read_from_before(self, begin: int, end: int) -> list[str]:
        """The blobs layers begin..end read that layers before them make: a split backward's diffs handed on."""
        layers = self._graph.layers[begin:end + 1]
        made = {value for layer in layers for value in layer.top_values}
        return list(dict.fromkeys(blob for layer in layers for blob, value in zip(layer.bottoms, layer.bottom_values)
                                  if value not in made))

    def _host_backward(self, layer) -> None:
        """A layer run on the host: its backward (program.host_backward) on the blobs, as Caffe's Backward reads
        them (tops with their diffs, bottoms as they are now), writing the diffs of the bottoms it propagates to."""
        backward = host_backward(layer, self._python_layers)
        bottoms = [np.asarray(self.blobs[blob].data) for blob in layer.bottoms]
        tops = [np.asarray(self.blobs[blob].data) for blob in layer.tops]
        top_diffs = [np.asarray(self.blobs[blob].diff) for blob in layer.tops]
        diffs = list(backward(layer.proto, bottoms, tops, top_diffs, list(layer.bottom_need_backward)))
        if len(diffs) != len(bottoms):
            raise layer_error(GraphError, layer.name, layer.type, f"its backward on the host gave {len(diffs)} "
                              f"diffs; the layer has {len(bottoms)} bottoms ({', '.join(layer.bottoms)})")
        for blob, diff, down in zip(layer.bottoms, diffs, layer.bottom_need_backward):
            if down and diff is not None:
                if np.shape(diff) != self.blobs[blob].shape:
                    raise layer_error(ShapeError, layer.name, layer.type,
                                      f"its backward gave bottom '{blob}' a diff of shape {np.shape(diff)}; the "
                                      f"blob is {self.blobs[blob].shape}")
                self.blobs[blob]._diff.set(np.asarray(diff, self.blobs[blob].data.dtype))

    def _defer_diffs(self, start: int, end: int, deferred: Mapping[str, str], arguments: tuple) -> None:
        """Blobs (name -> value id) whose diffs a backward over layers start..end did not hand back: on the first
        read of any of them, the pass runs again over the same ``arguments`` (params, inputs, seeds, key, recorded
        tops) and sets them all. The parameters' diffs it leaves alone: they were added to once."""
        if not deferred:
            return
        program = self._program
        every = tuple(sorted(set(deferred.values())))
        all_diffs = self._jitted("backward-all", end, start, self._with_concrete(
            lambda params, env, seeds, key, recorded: program.forward_backward(
                params, env, seeds, key, start=end, end=start, diff_values=every, recorded=recorded)[3]),
            variant=every)

        def materialize():
            computed = all_diffs(*arguments)
            for blob, value in deferred.items():
                if self.blobs[blob]._diff._pending is materialize:
                    self.blobs[blob]._diff.set(computed[value])

        for blob in deferred:
            self.blobs[blob]._diff.defer(materialize)

    def backward(self, diffs: Iterable[str] | None = None, start: str | None = None, end: str | None = None,
                 **kwargs) -> dict[str, np.ndarray]:
        """pycaffe's backward: optional top diffs by output name; returns the inputs' (and ``diffs``) diffs."""
        diffs = list(diffs or [])
        self._check_blob_names(diffs, "backward(diffs=...)")
        start_ind = len(self._graph.layers) - 1 if start is None else self._layer_index(start)
        if end is not None:
            end_ind = self._layer_index(end)
            outputs = set(self.bottom_names[end] + diffs)
        else:
            end_ind = 0
            outputs = set(self.inputs + diffs)
        diffs_given = {}
        if kwargs:
            if set(kwargs) != set(self.outputs):
                raise CaffejaxError(f"top diff arguments {sorted(kwargs)} do not match net outputs {self.outputs}")
            diffs_given = {name: as_numbers(name, diff, self._dtype, "diff for") for name, diff in kwargs.items()}
            for name, diff in diffs_given.items():  # all checked before any is written
                expected = self.blobs[name].shape
                if diff.shape != expected and (diff.shape[:1] != expected[:1] or not _broadcasts(diff.shape, expected)):
                    raise ShapeError(f"diff for '{name}' has shape {diff.shape}; the blob is {expected}")
        with self._passes:
            for name, diff in diffs_given.items():
                self.blobs[name].diff[...] = diff
            # A fed blob resized since the last pass re-infers every shape here too, as it does for a forward.
            self._sync_shapes()
            with self._python_layers:
                if self._runs_layer_by_layer():
                    self._backward_layer_by_layer(start_ind, end_ind)
                elif self._host_layers:
                    self._backward_around_host(start_ind, end_ind, returned=outputs)
                else:
                    self._backward_in_passes(start_ind, end_ind, returned=outputs)
            return {name: self.blobs[name].diff for name in outputs}

    def _batches(self, arrays: dict[str, np.ndarray]):
        """pycaffe's Net._batch: ``arrays`` (name -> N x ...) in batches of the net's batch size; the last
        one is zero-padded to full size. No arrays, no batches."""
        if not arrays:
            return
        num = len(next(iter(arrays.values())))
        first, blob = next(iter(self.blobs.items()))
        batch_size = blob.shape[0] if blob.shape else 0
        if batch_size == 0:  # pycaffe's range() would fail on its step (or its shape[0] on a 0-D blob)
            raise ShapeError(f"cannot run {num} items in batches of the net's batch size: its first blob "
                             f"'{first}' is {blob.shape}, no batch; reshape the inputs to a batch of at least 1")
        for start in range(0, num, batch_size):
            batch = {}
            for name, array in arrays.items():
                chunk = np.asarray(array[start:start + batch_size])
                padding = np.zeros((batch_size - len(chunk),) + chunk.shape[1:], chunk.dtype)
                batch[name] = np.concatenate([chunk, padding]) if len(padding) else chunk
            yield batch

    def _check_batchable(self, blobs: Sequence[str], caller: str) -> None:
        """pycaffe's batched calls join the batches' blobs item by item along axis 0, which a blob made on the
        host (SSD's detections: one row per detection, image ids counted within a batch) does not have."""
        made = self._graph.made_on_host
        for name in blobs:
            if name in made:
                layer = next(layer for layer in self._graph.layers if name in layer.tops and layer.runs_on_host)
                raise layer_error(UnsupportedError, layer.name, layer.type,
                                  f"{caller} cannot join its top '{name}' over batches: its rows depend on the data "
                                  "and number the images within one batch; call forward() on each batch")

    def forward_all(self, blobs: Iterable[str] | None = None, **kwargs) -> dict[str, np.ndarray]:
        """pycaffe's forward_all: run N items through the net in batches; outputs (and ``blobs``) for all N."""
        blobs = list(blobs or [])
        self._check_batchable(self.outputs + blobs, "forward_all")
        collected: dict[str, list[np.ndarray]] = {name: [] for name in set(self.outputs + blobs)}
        # Without input arrays (a net fed by its data layers) one forward, as forward_backward_all runs one.
        for batch in list(self._batches(kwargs)) or [{}]:
            for name, value in self.forward(blobs=blobs, **batch).items():
                _collect(collected[name], value)
        num = len(next(iter(kwargs.values()))) if kwargs else None
        return {name: _collected(values, num) for name, values in collected.items()}

    def forward_backward_all(self, blobs: Iterable[str] | None = None, diffs: Iterable[str] | None = None,
                             **kwargs) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """pycaffe's forward_backward_all: batched forward then backward; inputs and output diffs by name."""
        blobs, diffs = list(blobs or []), list(diffs or [])
        self._check_batchable(self.outputs + blobs, "forward_backward_all")
        outs: dict[str, list[np.ndarray]] = {name: [] for name in set(self.outputs + blobs)}
        grads: dict[str, list[np.ndarray]] = {name: [] for name in set(self.inputs + diffs)}
        # Without arrays (a net fed by its data layers, diffs already on the outputs): one forward and backward.
        forward_batches = list(self._batches({k: kwargs[k] for k in self.inputs if k in kwargs})) or [{}]
        backward_batches = list(self._batches({k: kwargs[k] for k in self.outputs if k in kwargs})) or [{}]
        for i in range(max(len(forward_batches), len(backward_batches))):
            fb = forward_batches[i] if i < len(forward_batches) else {}
            bb = backward_batches[i] if i < len(backward_batches) else {}
            for name, value in self.forward(blobs=blobs, **fb).items():
                _collect(outs[name], value)
            for name, value in self.backward(diffs=diffs, **bb).items():
                _collect(grads[name], value)
        num = len(next(iter(kwargs.values()))) if kwargs else None
        return ({name: _collected(v, num) for name, v in outs.items()},
                {name: _collected(v, num) for name, v in grads.items()})

    def clear_param_diffs(self) -> None:
        """Caffe's ClearParamDiffs: zero every learnable blob's diff. Host zeros: made eagerly on the device,
        each shape compiled a program the first time (GoogLeNet's 116 blobs: 2.2 s, then 28 ms a call)."""
        for blob in self._param_blobs.values():
            blob._diff.set(np.zeros(blob.shape, self._dtype))

    # -- weights --------------------------------------------------------------------------------------------
    def copy_from(self, path: str) -> None:
        """Net::CopyTrainedLayersFrom: layers matched by name; unknown layers ignored; shapes must agree."""
        self._copy_weights(read_weights(path))

    def _copy_weights(self, weights) -> None:
        # Every blob is checked before any is installed, so a file that does not fit leaves the net as it was;
        # then one device_put takes them all (one call per blob cost 0.1 ms each: MobileNet v2's 320, 34 ms).
        path = weights.path
        ours = {layer.name for layer in self._graph.layers}
        for source in (weights.net.layers if len(weights.net.layers) else weights.net.layer):
            if source.name not in ours:  # CopyTrainedLayersFrom's line for each layer of the file we lack
                log.info("Ignoring source layer %s", source.name)
        targets, arrays = [], []
        for layer in self._graph.layers:
            if layer.name not in weights.blobs:
                continue
            source = weights.blobs[layer.name]
            if source:
                self._require_shapes([layer], f"take its weights from {path}",
                                     then=", on a Net built without weights, before copy_from")
            source = _blobs_for_layer(weights, layer)
            for i, (slot, array) in enumerate(zip(layer.params, source)):
                if array is None:
                    continue
                if not _shape_matches(slot.shape, array.shape, weights.legacy_shaped(layer.name, i)):
                    raise WeightsError(
                        f"{path}: cannot copy param {i} weights from layer '{layer.name}'; shape mismatch: "
                        f"the file's blob is {tuple(array.shape)}, the net's is {tuple(slot.shape)}. To learn "
                        "this layer's parameters from scratch rather than copying them, rename the layer")
                targets.append(self._param_blobs[slot.storage])
                arrays.append(np.asarray(array, self._dtype).reshape(slot.shape))
        if not targets and any(slot.is_owner for layer in self._graph.layers for slot in layer.params):
            # Caffe copies nothing silently; a file whose layers all have other names (or that has none: a
            # protobuf of another kind parses as an empty NetParameter) is most likely the wrong file.
            what = "has no layers" if not weights.blobs and not len(weights.net.layer) and not len(
                weights.net.layers) else "has no layer with weights whose name is a layer of this net"
            log.warning("%s %s: no weights were copied into net '%s'", path, what, self._graph.name)
        # Waited for: device_put copies in the background, from the memory-mapped file, and a blob that keeps
        # the device value (no host copy held) would otherwise return before its weights are there (a loop of
        # copy_from calls queued 244 MB copies of AlexNet faster than they ran, until memory ran out).
        for blob, value in zip(targets, jax.block_until_ready(jax.device_put(arrays))):
            blob._data.set(value)

    copy_trained_layers_from = copy_from

    def share_with(self, other: "Net") -> None:
        """Net::ShareTrainedLayersWith: each layer of ``other`` lends its blobs' data to our layer of its name;
        ``other``'s layers we lack are ignored. As in Caffe, a matched pair must have as many blobs (a layer with
        none against one with some is refused too) of equal shapes; all are checked before any is shared."""
        ours = {layer.name: layer for layer in self._graph.layers}  # distinct: a repeated name is name#k
        shared = []
        for theirs in other.layers:
            layer = ours.get(theirs.name)
            if layer is None:
                continue
            if len(theirs.blobs) != len(layer.params):
                raise WeightsError(f"cannot share layer '{layer.name}': {len(theirs.blobs)} blobs there, "
                                   f"{len(layer.params)} here (incompatible number of blobs)")
            for i, (slot, blob) in enumerate(zip(layer.params, theirs.blobs)):
                if tuple(blob.shape) != tuple(slot.shape):
                    raise WeightsError(f"cannot share param {i} of layer '{layer.name}': shape "
                                       f"{tuple(blob.shape)} there, {tuple(slot.shape)} here")
                shared.append((slot.storage, blob))
        for storage, blob in shared:
            self._param_blobs[storage]._data = blob._data

    def to_proto(self):
        """Net::ToProto: the net's (filtered, split) layers with their current blobs, as a NetParameter."""
        from caffejax.proto import caffe_pb2

        return caffe_pb2.NetParameter.FromString(b"".join(encode_net(self._proto_for_save(), self._blob_arrays())))

    def _proto_for_save(self):
        net = self._graph.proto.__class__()
        net.CopyFrom(self._graph.proto)
        net.ClearField("state")
        return net

    def _blob_arrays(self) -> dict[str, list[np.ndarray]]:
        return {name: [np.asarray(b._data.value(), np.float32) for b in blobs] for name, blobs in self.params.items()}

    def save(self, path: str) -> None:
        """Write a binary caffemodel (current V2 format) that BVLC Caffe reads; atomic."""
        atomic_write(path, encode_net(self._proto_for_save(), self._blob_arrays()))

    def save_hdf5(self, path: str) -> None:
        """pycaffe's save_hdf5, Net::ToHDF5 without diffs: ``data/<layer>/<i>`` (:func:`write_model_hdf5`)."""
        write_model_hdf5(self, path, write_diff=False)

    def load_hdf5(self, path: str) -> None:
        self.copy_from(path)


def _blobs_for_layer(weights, layer) -> list:
    """The file's blobs for ``layer``, one per learnable blob (None where an HDF5 file leaves out a shared one),
    after Caffe's count checks: a binary file's layer has exactly the net layer's count (CopyTrainedLayersFrom);
    an HDF5 file's no more, and may lack only blobs the layer shares with another (CopyTrainedLayersFromHDF5)."""
    source, count, path = weights.blobs[layer.name], len(layer.params), weights.path
    if not weights.is_hdf5:
        if len(source) != count:
            raise WeightsError(f"{path}: layer '{layer.name}' has {len(source)} blobs in the file but {count} in "
                               "the net (incompatible number of blobs)")
        return source
    stored = [i for i, array in enumerate(source) if array is not None]
    if len(source) > count:
        raise WeightsError(f"{path}: layer '{layer.name}' has blobs {stored} in the file but {count} in the net "
                           "(incompatible number of blobs)")
    source = source + [None] * (count - len(source))
    missing = [i for i, (slot, array) in enumerate(zip(layer.params, source)) if array is None and slot.is_owner]
    if missing:
        raise WeightsError(f"{path}: layer '{layer.name}' has no blob {missing[0]} in the file ('data/{layer.name}/"
                           f"{missing[0]}'; it holds {stored} of the net's {count}); only blobs the layer shares "
                           "with another may be left out (incompatible number of blobs)")
    return source


def _shape_matches(net_shape, file_shape, legacy: bool = False) -> bool:
    """Caffe's Blob::ShapeEquals: the shapes are equal, or the file's blob is ``legacy`` (shaped by the old
    num/channels/height/width fields of a binary BlobProto) and equals the net's right-aligned, padded with 1s
    (a bias stored as 1x1x1xN). A new-style 4-D shape.dim, and an HDF5 dataset, must match exactly."""
    net_shape, file_shape = tuple(net_shape), tuple(file_shape)
    if net_shape == file_shape:
        return True
    if legacy and len(net_shape) <= 4:
        return (1,) * (4 - len(net_shape)) + net_shape == file_shape
    return False
