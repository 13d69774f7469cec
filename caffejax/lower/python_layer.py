"""Caffe's ``Python`` layer (python_layer.hpp): a pycaffe ``Layer`` subclass named by ``python_param``.

A model file must never run code it was not asked to: the frontend (caffejax.frontend.build) refuses a
Python layer, before anything is imported, unless the user passes ``allow_python_layers=True``. Only then does
this rule run, and it runs the layer as pycaffe does:

- ``python_param.module`` is imported and ``python_param.layer`` constructed with the LayerParameter; the
  object gets ``param_str`` and ``phase``, then ``setup(bottom, top)`` and ``reshape(bottom, top)`` run once,
  at net build, on host blobs of the bottom shapes (zeros, as a fresh Caffe blob holds). The tops' shapes
  after ``reshape`` are the layer's top shapes: the compiled program has fixed shapes.
- A data layer (no bottoms, no learnable blobs) runs on the host before each pass instead, as the net reads
  the built-in data layers' batches (:class:`HostDataLayer`); its tops are fed to the program, so their shapes
  may change from batch to batch (the net compiles a program per shape signature).
- In the program, forward is a ``jax.pure_callback`` to ``reshape`` + ``forward`` on host copies of the
  bottoms, given the pass's key too so that it runs once per pass; backward (a ``jax.custom_vjp``) is a
  callback to the layer's ``backward(top, propagate_down, bottom)``, which fills the diffs of the bottoms
  whose ``propagate_down`` is true: as in Caffe, those the gradient reaches (not a label). An in-place top
  (``top: x`` over ``bottom: x``) is its bottom's blob in both calls, as Caffe shares it. JAX reports a
  failure inside a callback as its own runtime error; programs run inside their net's
  :class:`PythonLayers`, which raises the layer's typed error instead.
- A layer whose tops' size depends on the data (py-faster-rcnn's ProposalLayer reshapes its rois in forward
  to the proposals it kept) cannot be a callback of fixed shapes. When its reshape or forward in a program
  gives its tops other shapes than the build's, the callback raises :class:`TopsSizedByData`, and the net's
  builds run the layer on the host from then on (``Layer.runs_on_host``, :meth:`PythonLayers.host_forward`),
  as OpenCV's Proposal layer runs: Net.forward and compile_inference catch it and run the pass again in stages
  around the layer (that forward's tops are not lost: the host's first call on the same bottoms takes them).
  Net.backward calls its ``backward`` there too (:meth:`PythonLayers.host_backward`), between the programs of
  the layers after it and before it; a solver's step that finds it out runs that iteration again by passes
  (Net.forward, Net.backward), on the same batch. Such a layer has bottoms, no learnable blobs and no top in
  place; one program over it (an export, several devices) raises the error.
- Such a layer also runs on the host once it reads a fed blob that only Python layers read, when that blob
  changes shape and the other fed blobs keep theirs (:meth:`PythonLayers.read_changing_feeds`): the program
  of the layers before it then neither reads that blob nor is compiled again for each of its shapes.

Each net has its own layer objects, as Caffe makes one per layer per net (:class:`PythonLayers`, which the
net hands its graph and programs through ``LayerContext.python_layers``): the net's rebuilds and all its
programs, ``compile_inference``'s among them, call the same object, so a data layer serves one sequence of
batches per net.

Learnable blobs (``self.blobs.add_blob(*shape)`` in ``setup``) are the layer's params, as Caffe's Net::AppendParam
makes them: the solver trains them by their ParamSpecs (lr_mult 1 by default), caffemodels save and load them
under the layer's name, and they start from the data ``setup`` wrote (Caffe runs no filler on them). Both
callbacks get their current values in ``self.blobs[i].data``: each program passes them in, since the solver
changes them between calls. What ``forward`` writes there is the params' new value (as BatchNorm's statistics
are), which the solver's update then starts from; ``backward`` starts each pass from zero diffs, and the
``self.blobs[i].diff`` it leaves are the params' diffs, summed over an iteration's passes.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from caffejax.errors import CaffejaxError, GraphError, ShapeError, TopsSizedByData, layer_error
from caffejax.lower.registry import LayerContext, layer
from caffejax.runtime.blob import Blob

Shape = tuple[int, ...]


class Phase(int):
    """A Python layer's ``self.phase``: the int BVLC's python_layer.hpp sets (0 TRAIN, 1 TEST), printed by
    name as pycaffe's Phase enum prints, since layers written for older pycaffe key tables by it
    (py-faster-rcnn's ``cfg[str(self.phase)]``)."""

    def __str__(self) -> str:
        return ("TRAIN", "TEST")[self] if 0 <= self <= 1 else int.__repr__(self)

    __repr__ = __str__


class Layer:
    """pycaffe's ``caffe.Layer``: subclass it and override ``setup``, ``reshape``, ``forward``, ``backward``.

    caffejax sets ``param_str`` (python_param.param_str) and ``phase`` (caffejax.TRAIN or TEST; its str() is
    "TRAIN" or "TEST", see :class:`Phase`) before ``setup``, and ``param_str_`` too: the name older pycaffe
    (and forks such as py-faster-rcnn's) gave it, which their layers read. ``bottom``/``top`` are lists of
    blobs with ``data``, ``diff``, ``shape``, ``count`` and ``reshape(*shape)``, as in pycaffe.
    """

    def __init__(self, param: Any = None):
        self.blobs: _LayerBlobs = _LayerBlobs()
        self.param_str = self.param_str_ = ""
        self.phase = 0

    def setup(self, bottom, top) -> None:
        pass

    def reshape(self, bottom, top) -> None:
        pass

    def forward(self, bottom, top) -> None:
        pass

    def backward(self, top, propagate_down, bottom) -> None:
        pass


class _LayerBlobs(list):
    """pycaffe's ``self.blobs`` of a Python layer, with its ``add_blob(*shape)``: the layer's learnable blobs."""

    def add_blob(self, *shape: int) -> None:
        self.append(Blob(tuple(int(d) for d in shape)))


@dataclasses.dataclass
class _Instance:
    """One user layer object and the top shapes its reshape gave, per bottom shapes."""

    obj: Any
    top_shapes: dict[tuple[Shape, ...], list[Shape]] = dataclasses.field(default_factory=dict)
    blob_shapes: list[Shape] | None = None  # the learnable blobs its setup added; None until setup ran
    # The tops' shapes the next reshape starts from: Caffe's top blobs keep their shapes between calls (a data
    # layer that shapes its tops in setup may leave reshape empty).
    last_top_shapes: list[Shape] = dataclasses.field(default_factory=list)
    failure: CaffejaxError | None = None  # raised on the host inside a program; PythonLayers re-raises it
    # Its forward sized its tops by the data (TopsSizedByData): the net's builds run it on the host since, and
    # ``made`` keeps that forward's (bottoms, tops), which the host's first call hands back instead of calling
    # forward on the same bottoms again (Caffe calls forward once a pass).
    sized_by_data: bool = False
    made: tuple[list[np.ndarray], list[np.ndarray]] | None = None
    # It reads fed blobs whose shapes change from pass to pass and that no compiled layer reads
    # (:meth:`PythonLayers.read_changing_feeds`): the net's builds run it on the host since.
    reads_changing_feeds: bool = False


class PythonLayers:
    """One net's pycaffe layer objects, by layer definition. Run the net's compiled programs inside it
    (``with python_layers:``): a layer's failure on the host, which JAX reports as a JaxRuntimeError around
    the traceback's text, comes out as the typed error naming the layer, caused by the user's own exception
    (its traceback ends in the layer's code). A class with ``__exit__``, not a contextlib generator, which
    costs 2 us on entering and leaving (a tenth of the Python around LeNet's batch-1 inference call)."""

    def __init__(self):
        self.objects: dict[bytes, _Instance] = {}

    def object_of(self, layer_param) -> Any:
        """The user's layer object for this layer definition (made when the net's build first ran its setup),
        or None where none was made yet."""
        instance = self.objects.get(_object_key(layer_param))
        return instance.obj if instance is not None else None

    def runs_on_host(self, layer_param) -> bool:
        """Whether the layer's forward has sized its tops by the data (TopsSizedByData), or it reads fed blobs of
        changing shapes (:meth:`read_changing_feeds`): the net's builds run it on the host (Layer.runs_on_host),
        between programs, as OpenCV's Proposal layer is."""
        instance = self.objects.get(_object_key(layer_param))
        return instance is not None and (instance.sized_by_data or instance.reads_changing_feeds)

    def read_changing_feeds(self, layer_param) -> None:
        """Run the layer on the host from the net's next build on (:meth:`runs_on_host`): it reads fed blobs whose
        shapes change from pass to pass and which only Python layers read (py-faster-rcnn's ground-truth boxes,
        a new count each image, read by its anchor target layer), so that the program of the layers before it
        does not read them, and is not compiled again for each of their shapes."""
        self.objects[_object_key(layer_param)].reads_changing_feeds = True

    def size_by_data(self, layer_param) -> None:
        """Run the layer on the host from the net's next build on (:meth:`runs_on_host`), its tops shaped by its
        forward: the build found the shapes its reshape gave do not fit the layers after it
        (Graph.deferred_errors), which its forward may change, as py-faster-rcnn's layers do."""
        self.objects[_object_key(layer_param)].sized_by_data = True

    def host_forward(self, layer_param, bottoms: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The tops of a layer run on the host (:meth:`runs_on_host`): ``reshape`` and ``forward`` on host blobs of
        ``bottoms``, the tops starting from the shapes they last had (Caffe's top blobs keep theirs); the tops of
        the forward that found the layer sized by the data, if ``bottoms`` are the ones it ran on."""
        instance = self.objects[_object_key(layer_param)]
        made, instance.made = instance.made, None
        if made is not None and len(made[0]) == len(bottoms) and all(
                np.array_equal(a, b) for a, b in zip(made[0], bottoms)):
            tops = made[1]
        else:
            dtype = np.dtype(bottoms[0].dtype) if len(bottoms) else np.dtype(np.float32)
            name, obj = layer_param.name, instance.obj
            bottom = [_holding(b, dtype) for b in bottoms]
            top = [Blob(shape, dtype) for shape in instance.last_top_shapes]
            _checked(name, "Python", "reshape", obj.reshape, bottom, top)
            _checked(name, "Python", "forward", obj.forward, bottom, top)
            tops = [np.array(t.data, dtype) for t in top]
        instance.last_top_shapes = [t.shape for t in tops]
        return tops

    def host_backward(self, layer_param, bottoms: Sequence[np.ndarray], tops: Sequence[np.ndarray],
                      top_diffs: Sequence[np.ndarray], propagate_down: Sequence[bool]) -> list[np.ndarray | None]:
        """The bottoms' diffs from the ``backward`` of a layer run on the host (:meth:`runs_on_host`), on host blobs
        of its last forward's bottoms and tops, the tops holding ``top_diffs``; None for a bottom
        ``propagate_down`` leaves out (its diff stays as it is, as Caffe's blob keeps it)."""
        instance = self.objects[_object_key(layer_param)]
        dtype = np.dtype(tops[0].dtype) if len(tops) else np.dtype(np.float32)
        top = [_holding(y, dtype, diff=g) for y, g in zip(tops, top_diffs)]
        bottom = [_holding(x, dtype) for x in bottoms]
        _checked(layer_param.name, "Python", "backward", instance.obj.backward, top, list(propagate_down), bottom)
        return [np.array(b.diff, dtype) if down else None for b, down in zip(bottom, propagate_down)]

    def learnable_values(self, layer_param) -> list[np.ndarray]:
        """Copies of the data a Python layer's learnable blobs hold now (after its setup: their initial values)."""
        instance = self.objects[_object_key(layer_param)]
        return [np.array(blob.data, copy=True) for blob in instance.obj.blobs]

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, traceback) -> bool:
        if kind is None or not self.objects or not issubclass(kind, jax.errors.JaxRuntimeError):
            return False
        failures = [instance.failure for instance in self.objects.values() if instance.failure is not None]
        for instance in self.objects.values():
            instance.failure = None
        if not failures:
            return False
        # The layer's error already has the user's exception as its cause; JAX's error only repeats it as text.
        failure = failures[0].with_traceback(None)
        failure.__suppress_context__ = True
        raise failure


@layer("Python")
def python(ctx: LayerContext, bottoms, params):
    """Run the user's pycaffe layer on the host (see the module docstring)."""
    dtype = np.dtype((bottoms or params)[0].dtype) if (bottoms or params) else np.dtype(np.float32)
    bottom_shapes = tuple(tuple(int(d) for d in b.shape) for b in bottoms)
    instance = _instance(ctx)
    top_shapes = _top_shapes(ctx, instance, bottom_shapes, dtype)
    param_shapes = [tuple(int(d) for d in p.shape) for p in params]
    if param_shapes != instance.blob_shapes:
        raise ctx.error(f"the layer's setup made learnable blobs of shapes {instance.blob_shapes}, the net holds "
                        f"{param_shapes}")
    tops, blobs = _on_host(ctx, instance, top_shapes, dtype, bottoms, params)
    for i, value in enumerate(blobs):  # what forward left in self.blobs (no change, for most layers)
        ctx.update_param(i, value)
    return tops


def learnable_blob_shapes(layer_param, phase: int, bottom_shapes: Sequence[Shape], python_layers) -> list[Shape]:
    """The shapes of the learnable blobs a Python layer's setup adds, for the net's build (Caffe's LayerSetUp,
    then Net::AppendParam). Runs the setup on the net's object (``python_layers``), once."""
    ctx = LayerContext(layer=layer_param, phase=phase, num_tops=len(layer_param.top), python_layers=python_layers)
    instance = _instance(ctx)
    _set_up(ctx, instance, tuple(tuple(int(d) for d in s) for s in bottom_shapes), np.dtype(np.float32))
    return list(instance.blob_shapes)


def _object_key(layer_param) -> bytes:
    """A layer object's key in its net's PythonLayers: the layer's definition."""
    return layer_param.SerializeToString(deterministic=True)


def _instance(ctx: LayerContext) -> _Instance:
    # Outside a net (a rule called on its own) the object lives for this call only.
    objects = ctx.python_layers.objects if ctx.python_layers is not None else {}
    key = _object_key(ctx.layer)
    instance = objects.get(key)
    if instance is None:
        p = ctx.layer.python_param
        if not p.module or not p.layer:
            raise ctx.error("python_param must name a module and a layer class", GraphError)
        try:
            module = importlib.import_module(p.module)
        except Exception as e:  # noqa: BLE001 -- an import failure of any kind is the model's problem
            raise ctx.error(f"cannot import module '{p.module}': {type(e).__name__}: {e}", GraphError) from None
        cls = getattr(module, p.layer, None)
        if not callable(cls):
            raise ctx.error(f"module '{p.module}' has no layer class '{p.layer}'", GraphError)
        obj = _call(ctx, f"{p.layer}(layer_param)", cls, ctx.layer)
        obj.param_str = obj.param_str_ = p.param_str
        obj.phase = Phase(ctx.phase)
        if not isinstance(getattr(obj, "blobs", None), _LayerBlobs):  # an __init__ that skipped caffejax.Layer's
            obj.blobs = _LayerBlobs()
        instance = objects[key] = _Instance(obj)
    return instance


def _set_up(ctx: LayerContext, instance: _Instance, bottom_shapes: tuple[Shape, ...], dtype) -> None:
    """Caffe's LayerSetUp, once per layer object: ``setup`` on host blobs of the bottom shapes. The blobs it
    added to ``self.blobs`` are the layer's learnable blobs; the tops' shapes it left start the first reshape."""
    if instance.blob_shapes is not None:
        return
    bottom = [Blob(shape, dtype) for shape in bottom_shapes]
    top = [Blob((), dtype) for _ in range(ctx.num_tops)]
    _call(ctx, "setup", instance.obj.setup, bottom, top)
    blobs = instance.obj.blobs
    for i, blob in enumerate(blobs):
        if not isinstance(blob, Blob):
            raise ctx.error(f"learnable blob {i} is a {type(blob).__name__}; add blobs with "
                            "self.blobs.add_blob(*shape)", GraphError)
    instance.blob_shapes = [tuple(int(d) for d in blob.shape) for blob in blobs]
    instance.last_top_shapes = [tuple(int(d) for d in t.shape) for t in top]


def _top_shapes(ctx: LayerContext, instance: _Instance, bottom_shapes: tuple[Shape, ...], dtype) -> list[Shape]:
    """setup (once per layer object) and reshape on host blobs of these bottom shapes: the tops' shapes."""
    shapes = instance.top_shapes.get(bottom_shapes)
    if shapes is None:
        _set_up(ctx, instance, bottom_shapes, dtype)
        bottom = [Blob(shape, dtype) for shape in bottom_shapes]
        top = [Blob(shape, dtype) for shape in instance.last_top_shapes]
        _call(ctx, "reshape", instance.obj.reshape, bottom, top)
        if len(top) != ctx.num_tops:
            raise ctx.error(f"the layer's reshape gave {len(top)} tops, the prototxt names {ctx.num_tops}",
                            GraphError)
        shapes = instance.top_shapes[bottom_shapes] = instance.last_top_shapes = \
            [tuple(int(d) for d in t.shape) for t in top]
    return shapes


# ---- data layers: run on the host before each pass ------------------------------------------------------------

def data_layer_top_shapes(layer_param, phase: int, python_layers: PythonLayers | None) -> list[Shape] | None:
    """The top shapes of a Python data layer after its setup and first reshape (Caffe's SetUp at net build), or
    None for any other Python layer. A data layer has no bottoms and no learnable blobs: the net runs it on the
    host before each pass (:class:`HostDataLayer`), as it reads the built-in data layers' batches, and feeds its
    tops to the compiled program. So its tops may change shape from batch to batch, the program being compiled
    once per shape signature as for any fed blob: FCN's VOC and SBDD layers serve one image of its own size a
    batch, py-faster-rcnn's RoIDataLayer one scaled image."""
    if len(layer_param.bottom):
        return None
    ctx = LayerContext(layer=layer_param, phase=phase, num_tops=len(layer_param.top), python_layers=python_layers)
    instance = _instance(ctx)
    _set_up(ctx, instance, (), np.dtype(np.float32))
    if instance.blob_shapes:
        return None
    return _top_shapes(ctx, instance, (), np.dtype(np.float32))


def calls_back(layer) -> bool:
    """Whether an IR layer is a Python layer the compiled program calls back into: every one but a data layer,
    whose tops are fed (it runs on the host before the pass)."""
    return layer.type == "Python" and not layer.is_input


class HostDataLayer:
    """A Python data layer as its net's data source: each ``next_batch`` runs the layer's ``reshape`` and
    ``forward`` on its top blobs (kept from batch to batch, as Caffe's are) and hands back copies of their
    data. A failure in the layer's code is a GraphError naming the layer, caused by the layer's exception."""

    def __init__(self, layer_param, phase: int, python_layers: PythonLayers | None, dtype=np.float32):
        ctx = LayerContext(layer=layer_param, phase=phase, num_tops=len(layer_param.top), python_layers=python_layers)
        self._name, self._type, self._dtype = ctx.name, ctx.type, np.dtype(dtype)
        self._instance = _instance(ctx)
        _set_up(ctx, self._instance, (), self._dtype)
        self._top = [Blob(shape, self._dtype) for shape in self._instance.last_top_shapes]

    def next_batch(self) -> list[np.ndarray]:
        obj, top = self._instance.obj, self._top
        _checked(self._name, self._type, "reshape", obj.reshape, [], top)
        _checked(self._name, self._type, "forward", obj.forward, [], top)
        self._instance.last_top_shapes = [tuple(int(d) for d in t.shape) for t in top]
        return [np.array(t.data, self._dtype) for t in top]

    def close(self) -> None:
        """Nothing to close: the layer object lives as long as its net (a later pass goes on from where it is)."""


class _QuietLayerFailures(logging.Filter):
    """Drops JAX's log record of a callback failure that is a Python layer's typed error: JAX logs the whole
    traceback to stderr as it turns the failure into its runtime error, and the net's PythonLayers then raises
    the layer's error itself. Every other callback failure is logged as JAX logs it."""

    def filter(self, record: logging.LogRecord) -> bool:
        failure = record.exc_info[1] if record.exc_info else None
        return not (isinstance(failure, CaffejaxError) and getattr(failure, "python_layer_failure", False))


_CALLBACK_LOGGER = "jax._src.callback"  # where jax.pure_callback / io_callback log their failures


def _quiet_layer_failures() -> None:
    """Install the filter on JAX's callback logger, once per process (the first time a Python layer runs)."""
    logger = logging.getLogger(_CALLBACK_LOGGER)
    if not any(isinstance(f, _QuietLayerFailures) for f in logger.filters):
        logger.addFilter(_QuietLayerFailures())


def _recording(instance: _Instance, fn: Callable) -> Callable:
    """``fn`` as a host callback: its typed failure is kept on the instance, for its net's PythonLayers."""
    _quiet_layer_failures()

    def run(*arrays):
        try:
            return fn(*arrays)
        except CaffejaxError as error:
            error.python_layer_failure = True
            instance.failure = error
            raise
    return run


def _on_host(ctx: LayerContext, instance: _Instance, top_shapes: list[Shape], dtype, bottoms: Sequence[jax.Array],
             params: Sequence[jax.Array]) -> tuple[list[jax.Array], list[jax.Array]]:
    """The tops of the layer on ``bottoms``, and what its learnable blobs hold after its forward (given ``params``
    before it): a host callback, differentiable through the layer's backward."""
    name, type_name, obj = ctx.name, ctx.type, instance.obj
    blob_shapes = instance.blob_shapes
    out_types = tuple(jax.ShapeDtypeStruct(shape, dtype) for shape in (*top_shapes, *blob_shapes))
    n_bottoms = len(bottoms)
    # A layer with bottoms, no learnable blobs and no top in place may run on the host instead (runs_on_host,
    # build.may_size_tops_by_data).
    sizes_by_data = n_bottoms > 0 and not blob_shapes and not any(_in_place(ctx, i) for i in range(len(top_shapes)))

    @functools.partial(_recording, instance)
    def forward_on_host(*arrays):
        bottom = [_holding(a, dtype) for a in arrays[:n_bottoms]]
        _hand_blobs(obj, arrays[n_bottoms:])
        # An in-place top is its bottom's blob, as in Caffe: it starts out holding the bottom's data.
        top = [bottom[i] if _in_place(ctx, i) else Blob(shape, dtype) for i, shape in enumerate(top_shapes)]
        _checked(name, type_name, "reshape", obj.reshape, bottom, top)
        if not sizes_by_data:
            _check_shapes(name, type_name, "reshape", "top", top, top_shapes)
        _checked(name, type_name, "forward", obj.forward, bottom, top)
        if sizes_by_data and [tuple(t.shape) for t in top] != top_shapes:
            instance.sized_by_data = True
            instance.made = ([np.array(a) for a in arrays[:n_bottoms]], [np.array(t.data, dtype) for t in top])
            raise layer_error(TopsSizedByData, name, type_name, f"its reshape or forward changed the top shapes to "
                              f"{[tuple(t.shape) for t in top]} after the net was built for {top_shapes}: their "
                              "size depends on the data (py-faster-rcnn's ProposalLayer). Net.forward, a solver's "
                              "step and compile_inference run such a layer on the host between compiled programs "
                              "from their first forward on; one program over it (an export, "
                              "caffejax.grad.value_and_grad, several devices) cannot")
        _check_shapes(name, type_name, "forward", "top", top, top_shapes)
        _check_shapes(name, type_name, "forward", "learnable blob", obj.blobs, blob_shapes)
        return tuple(np.asarray(b.data, dtype) for b in (*top, *obj.blobs))

    if ctx.recorded_tops is not None:  # a backward pass after the net's forward: the tops that forward left
        return _replayed(ctx, instance, top_shapes, dtype, bottoms, params)

    # A data layer (no bottoms, no learnable blobs) never gets here: its tops are fed (HostDataLayer).
    # The pass's key goes to the callback too, unused: a pure callback whose operands are the same in every pass
    # of a solver's scan over iter_size passes (bottoms from an Input) is loop-invariant to XLA, which hoisted
    # it, so the layer's forward ran once an iteration. Each pass has its own key (Caffe calls forward per pass).
    pass_key = () if ctx.key is None else (jax.random.key_data(ctx.key),)

    def forward_with_key(*arrays):
        return forward_on_host(*arrays[len(pass_key):])

    def forward_program(key, *xs):
        return jax.pure_callback(forward_with_key, out_types, *key, *xs)

    return _through_backward(ctx, instance, dtype, forward_program, pass_key, bottoms, params)


def _replayed(ctx: LayerContext, instance: _Instance, top_shapes: list[Shape], dtype, bottoms, params):
    """The tops the net's last forward recorded, differentiable through the layer's backward: Caffe's Backward
    reads the tops Forward left and never runs forward again (a data layer would serve the next batch, a layer
    that samples would sample again). The learnable blobs hold what that forward left: the net's params now."""
    recorded = tuple(jnp.asarray(t, dtype).reshape(shape) for t, shape in zip(ctx.recorded_tops, top_shapes))

    def given(tops, *xs):
        return (*tops, *xs[len(bottoms):])

    return _through_backward(ctx, instance, dtype, given, recorded, bottoms, params)


def _through_backward(ctx: LayerContext, instance: _Instance, dtype, outputs_of: Callable, extra: tuple, bottoms,
                      params) -> tuple[list[jax.Array], list[jax.Array]]:
    """``outputs_of(extra, *bottoms, *params)``: the layer's tops and its blobs after forward, differentiable
    through the layer's ``backward`` (the blobs' new values carry no gradient, as BatchNorm's statistics);
    ``extra`` (the pass's key, or the recorded tops) gets none either.

    With symbolic zeros, the forward learns which bottoms and params the gradient reaches (perturbed): for the
    bottoms, Caffe's propagate_down for the layer's backward, which is false for a label (a loss layer may refuse
    to backpropagate to it, as Caffe's own do), and whose other bottoms get no diff computed; for the params,
    which diffs the solver reads (not those of lr_mult 0)."""
    n_extra = len(extra)

    @jax.custom_vjp
    def run(extra, *xs):
        return outputs_of(extra, *xs)

    def run_forward(extra, *xs):
        values = tuple(x.value for x in xs)
        ys = run(tuple(e.value for e in extra), *values)
        return ys, (values, ys, _PropagateDown(tuple(x.perturbed for x in xs)))

    def run_backward(residuals, gs):
        xs, ys, propagate_down = residuals
        return ((None,) * n_extra,
                *_backward_on_host(ctx, instance, dtype, xs, ys, gs, propagate_down, len(bottoms)))

    run.defvjp(run_forward, run_backward, symbolic_zeros=True)
    outputs = list(run(extra, *bottoms, *params))
    n_tops = len(outputs) - len(params)
    return outputs[:n_tops], outputs[n_tops:]


def _backward_on_host(ctx: LayerContext, instance: _Instance, dtype, xs, ys, gs, propagate_down: "_PropagateDown",
                      n_bottoms: int):
    """The diffs of the bottoms and params from the layer's ``backward`` on the host; None for the bottoms
    ``propagate_down`` leaves out (Caffe's propagate_down: the bottoms the gradient reaches) and for the params
    no gradient is asked of. ``ys`` are the tops and then the blobs as forward left them."""
    name, type_name, obj, flags = ctx.name, ctx.type, instance.obj, propagate_down.flags
    down, param_down = flags[:n_bottoms], flags[n_bottoms:]
    n_tops = len(ys) - len(param_down)
    tops, blobs = ys[:n_tops], ys[n_tops:]
    gs = [jnp.zeros(y.shape, y.dtype) if isinstance(g, SymbolicZero) else g for g, y in zip(gs[:n_tops], tops)]

    @functools.partial(_recording, instance)
    def on_host(*arrays):
        bottoms, arrays = arrays[:n_bottoms], arrays[n_bottoms:]
        top_data, top_diffs, blob_data = arrays[:n_tops], arrays[n_tops:2 * n_tops], arrays[2 * n_tops:]
        top = [_holding(y, dtype, diff=g) for y, g in zip(top_data, top_diffs)]
        # In place, Caffe's bottom is the top's blob: its data is the forward's output, its diff the top's.
        bottom = [top[i] if _in_place(ctx, i) else _holding(x, dtype) for i, x in enumerate(bottoms)]
        _hand_blobs(obj, blob_data, zero_diffs=True)  # this pass's param diffs start from zero
        _checked(name, type_name, "backward", obj.backward, top, list(down), bottom)
        _check_shapes(name, type_name, "backward", "learnable blob", obj.blobs, instance.blob_shapes)
        return (*(np.asarray(b.diff, dtype) for b, d in zip(bottom, down) if d),
                *(np.asarray(b.diff, dtype) for b, d in zip(obj.blobs, param_down) if d))

    diff_types = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x, d in zip(xs, flags) if d)
    diffs = iter(jax.pure_callback(on_host, diff_types, *xs[:n_bottoms], *tops, *gs, *blobs)
                 if diff_types else ())
    return tuple(next(diffs) if d else None for d in flags)


def _hand_blobs(obj, values, zero_diffs: bool = False) -> None:
    """Put the learnable blobs' current values (the program's) into the layer's ``self.blobs``."""
    for blob, value in zip(obj.blobs, values):
        blob.data[...] = np.asarray(value)
        if zero_diffs:
            blob.diff[...] = 0


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _PropagateDown:
    """Which bottoms a Python layer's backward computes diffs for, kept static among the residuals."""

    flags: tuple[bool, ...]


def _in_place(ctx: LayerContext, i: int) -> bool:
    """Whether top i is written over bottom i (``top: x`` with ``bottom: x``)."""
    return i < len(ctx.in_place) and ctx.in_place[i]


def _check_shapes(name: str, type_name: str, what: str, kind: str, blobs, expected: list[Shape]) -> None:
    got = [tuple(b.shape) for b in blobs]
    if got != list(expected):
        hint = ""
        if kind == "top":  # sized by the data, but with learnable blobs or a top in place (else TopsSizedByData)
            hint = ("; a layer whose tops' size depends on the data runs on the host between programs only without "
                    "learnable blobs and tops in place")
        raise layer_error(ShapeError, name, type_name,
                          f"its {what} changed the {kind} shapes to {got} after the net was built for {expected}; "
                          f"caffejax compiles fixed shapes (reshape the net's inputs instead){hint}")


def _holding(array, dtype, diff=None) -> Blob:
    """A host blob holding a copy of ``array`` (and ``diff``), as the layer's pycaffe code expects."""
    blob = Blob(np.shape(array), dtype)
    blob.data[...] = np.asarray(array)
    if diff is not None:
        blob.diff[...] = np.asarray(diff)
    return blob


def _call(ctx: LayerContext, what: str, fn: Callable, *args):
    return _checked(ctx.name, ctx.type, what, fn, *args)


def _checked(name: str, type_name: str, what: str, fn: Callable, *args):
    """Call into the user's layer; its failures name the layer (the user's own error stays the cause)."""
    try:
        return fn(*args)
    except CaffejaxError:
        raise
    except Exception as e:  # noqa: BLE001 -- any failure of user code
        raise layer_error(GraphError, name, type_name, f"the Python layer's {what} failed: "
                          f"{type(e).__name__}: {e}") from e
