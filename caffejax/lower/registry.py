"""The layer registry: Caffe layer type name -> :class:`LayerRule`.

A rule is what Caffe's ``Layer`` subclass is, minus the state: the learnable blobs it allocates
(``param_shapes`` + ``init_params``, i.e. ``LayerSetUp``), its forward math as a pure JAX function
(``forward``; the top shapes, i.e. ``Reshape``, follow from it through ``jax.eval_shape``), and the few
flags the net assembly needs (``is_loss``, ``allow_force_backward``, blob-count limits).

This is the only global mutable state in caffejax: rules are registered once, at import of the family
modules (``vision``, ``neuron``, ``common``, ``loss``, ``recurrent``, ``data``, and ``python_layer``, whose
rule the frontend uses only when the user allows Python layers). Users add their own layer types, written as
pure JAX functions, with :func:`register_layer`; ``caffejax.lower.forks`` registers popular forks' layers on
request.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Protocol, Sequence

import jax
import numpy as np

from caffejax.errors import CaffejaxError, SchemaError, ShapeError, layer_error

Shape = tuple[int, ...]

# caffe.proto's Phase enum values, repeated here so lowering code does not import the bindings for two ints.
TRAIN = 0
TEST = 1


@dataclasses.dataclass
class LayerContext:
    """What a layer's forward sees besides its bottoms and params.

    ``layer`` is the layer's ``caffe_pb2.LayerParameter`` (read fields exactly as Caffe does, e.g.
    ``layer.convolution_param.num_output``). ``key`` is a ``jax.random`` key private to this layer and
    this forward call, or None when the net runs without randomness. Layers that rewrite their own blobs
    during forward (BatchNorm's running statistics in TRAIN) call :meth:`update_param`; the program returns
    those values as the new state. Layers that carry state from one forward to the next (RNN/LSTM's last
    hidden state, see ``LayerRule.state_shapes``) read ``state`` (None: start from Caffe's zeros) and call
    :meth:`update_state`. ``dtype`` is the net's float type, for layers that make values from nothing
    (DummyData's fillers). ``python_layers`` holds the net's pycaffe layer objects (``Python`` layers; None
    outside a net).
    """

    layer: Any
    phase: int
    key: jax.Array | None = None
    num_tops: int = 1
    # in_place[i]: top i shares its bottom's memory in Caffe (``top: x`` with ``bottom: x``). A few of Caffe's
    # hand-written backwards read the overwritten bottom there; the rules reproducing that consult this.
    in_place: tuple[bool, ...] = ()
    param_updates: dict[int, jax.Array] = dataclasses.field(default_factory=dict)
    dtype: Any = np.float32
    state: Sequence[jax.Array] | None = None
    state_updates: dict[int, jax.Array] = dataclasses.field(default_factory=dict)
    python_layers: Any = None
    # The tops this layer made in the net's last forward, given to a backward pass that must not run its forward
    # again (a Python layer's forward may change its state: a data layer would serve the next batch); None:
    # compute them.
    recorded_tops: Sequence[jax.Array] | None = None

    @property
    def name(self) -> str:
        return self.layer.name

    @property
    def type(self) -> str:
        return self.layer.type

    def rng(self) -> jax.Array:
        if self.key is None:
            raise layer_error(CaffejaxError, self.name, self.type,
                              "needs random numbers but the net was run without a PRNG key")
        return self.key

    def update_param(self, index: int, value: jax.Array) -> None:
        self.param_updates[index] = value

    def update_state(self, index: int, value: jax.Array) -> None:
        self.state_updates[index] = value

    def error(self, message: str, cls: type[CaffejaxError] = ShapeError) -> CaffejaxError:
        """An error naming this layer; lowering code raises it for inputs Caffe would CHECK-fail on."""
        return rejected(self.layer, message, cls)


def rejected(layer_param: Any, message: str, cls: type[CaffejaxError] = ShapeError) -> CaffejaxError:
    """The error for a configuration Caffe rejects, naming the layer by its LayerParameter: for shape rules and
    ``param_shapes``, where no LayerContext is at hand. The same message as the forward's ``ctx.error``."""
    return layer_error(cls, layer_param.name, layer_param.type, message)


ForwardFn = Callable[[LayerContext, Sequence[jax.Array], Sequence[jax.Array]], Sequence[jax.Array]]
ParamShapesFn = Callable[[Any, Sequence[Shape]], Sequence[Shape]]
InitParamsFn = Callable[[Any, Sequence[Shape], jax.Array], Sequence[np.ndarray]]
InputShapesFn = Callable[[Any, int, str | None], Sequence[Shape]]
TopShapesFn = Callable[[Any, Sequence[Shape], Sequence[Shape], int], Sequence[Shape]]
RowsApartFn = Callable[[Any, int, Sequence["Shape | None"]], bool]


class DataSource(Protocol):
    """Where a data layer's batches come from (an LMDB, an image list, arrays set by the user...).

    ``next_batch()`` returns one array per top, in Caffe's order, already transformed (transform_param);
    implementations prefetch in the background so the compiled program never waits on I/O.
    """

    def next_batch(self) -> Sequence[np.ndarray]: ...

    def close(self) -> None: ...


DataSourceFactory = Callable[[Any, int, str | None], DataSource]


def no_params(layer: Any, bottom_shapes: Sequence[Shape]) -> list[Shape]:
    return []


@dataclasses.dataclass(frozen=True)
class LayerRule:
    """One Caffe layer type.

    - ``forward(ctx, bottoms, params) -> tops``: pure; must work under ``jax.jit``/``jax.eval_shape`` and for
      any float dtype. Raise ``ctx.error(...)`` for configurations Caffe rejects.
    - ``param_shapes(layer, bottom_shapes) -> shapes`` of the learnable blobs, as Caffe's LayerSetUp allocates
      them (order matters: it is the caffemodel's blob order).
    - ``init_params(layer, shapes, key) -> arrays``: Caffe's fillers for those blobs.
    - ``input_shapes(layer, phase, base_dir) -> shapes``: set for layers whose tops are fed from outside the
      compiled program (Input, and the data layers that read files); ``forward`` is then unused.
    - ``data_source(layer, phase, base_dir) -> DataSource``: for fed layers that produce their own batches
      (Data, ImageData, HDF5Data, MemoryData, WindowData); the runtime pulls one batch per forward.
    - ``is_loss``: Caffe's LossLayer (top 0 gets loss_weight 1 unless the prototxt says otherwise).
    - ``allow_force_backward(layer, bottom_index)``: False for bottoms force_backward must not reach
      (labels of loss layers).
    - ``bottoms``/``tops``: (min, max) counts, max None for unbounded; checked at net build.
    - ``shape_from_values(layer) -> bottom indices`` whose values (not just shapes) decide the top shapes
      (Filter's selector). Those bottoms must be fed blobs; the runtime passes their data to the program as
      constants and compiles once per distinct value.
    - ``in_place``: False where Caffe forbids top == bottom. ``frozen_params``: blobs without a ParamSpec get
      lr_mult 0, as BatchNorm's LayerSetUp adds them (its statistics are not learned by gradient).
    - ``top_shapes(layer, bottom_shapes, param_shapes, num_tops) -> shapes``: Caffe's Reshape written out,
      for the most common layers, so that building a net does not trace them; it must raise every error
      ``forward`` raises for those shapes (share the checking code). Without it, the top shapes come from
      abstract evaluation of ``forward``. ``tests/test_shape_rules.py`` checks each against that.
    - ``host_forward(layer, bottoms) -> tops``: for a layer whose top shapes depend on the data (SSD's
      DetectionOutput), Forward on host NumPy arrays, run after the compiled program on the bottoms it
      returned (at least one top per top the layer has; more are optional tops it was not given, dropped).
      Such a layer is no part of any program: ``forward`` then only gives the top shapes Caffe's Reshape sets
      before the first forward, and compiled layers reading its tops run in a later program
      (Graph.staging_layers).
    - ``host_backward(layer, bottoms, tops, top_diffs, propagate_down) -> bottom diffs``: such a layer's Backward
      on host arrays, a diff or None (the bottom's diff left as it is) per bottom. Without it the layer has no
      backward (Caffe's NOT_IMPLEMENTED): a backward that needs one raises.
    - ``state_shapes(layer, bottom_shapes) -> shapes`` of non-learnable state the layer carries from one
      forward to the next (RNN/LSTM without expose_hidden copy the last h_T/c_T into h_0/c_0). The program
      passes it in as ``ctx.state`` and returns what ``ctx.update_state`` wrote; the runtime keeps it.
    - ``host_when_read_on_host``: ``host_forward``/``host_backward`` are not the layer's only form but one it runs
      in where every layer reading its tops runs on the host (Split: a program would otherwise read the blob it
      copies only to hand the copies back, so that a program over the layers before py-faster-rcnn's anchor
      target layer read the ground-truth boxes, and was compiled again for each number of boxes). Elsewhere it
      is compiled.
    - ``rows_apart``: whether row i (along axis 0) of every top is computed from row i of the bottoms alone (and
      the params), so that rows added to a batch, or a batch cut in parts, leave each row's values as they were
      (``compile_inference(batch_sizes=...)`` pads batches so). True, False (the default: not known to), or
      ``rows_apart(layer_param, phase, bottom_shapes)`` where it depends on the settings (an axis, the phase; a
      bottom shape is None where unknown: answer for the settings alone).
    """

    type: str
    forward: ForwardFn
    param_shapes: ParamShapesFn = no_params
    init_params: InitParamsFn | None = None
    input_shapes: InputShapesFn | None = None
    is_loss: bool = False
    allow_force_backward: Callable[[Any, int], bool] = lambda layer, i: True
    bottoms: tuple[int, int | None] = (0, None)
    tops: tuple[int, int | None] = (0, None)
    data_source: "DataSourceFactory | None" = None
    shape_from_values: Callable[[Any], Sequence[int]] | None = None
    in_place: bool = True
    frozen_params: bool = False  # learnable blobs default to lr_mult 0 (BatchNorm's statistics)
    state_shapes: ParamShapesFn | None = None
    top_shapes: TopShapesFn | None = None
    host_forward: Callable[[Any, Sequence[np.ndarray]], list[np.ndarray]] | None = None
    host_backward: Callable[..., list[np.ndarray | None]] | None = None
    host_when_read_on_host: bool = False
    rows_apart: bool | RowsApartFn = False

    def keeps_rows_apart(self, layer_param: Any, phase: int, bottom_shapes: Sequence[Shape | None]) -> bool:
        """``rows_apart`` for one layer of this type."""
        return self.rows_apart if isinstance(self.rows_apart, bool) else bool(
            self.rows_apart(layer_param, phase, bottom_shapes))


def param_axis(param_field: str) -> Callable[[Any, int], int]:
    """The canonical ``axis`` of a layer's ``param_field`` (``softmax_param``) for a bottom of ``ndim`` axes, for
    :func:`rows_apart_off_axis_0`."""
    return lambda layer_param, ndim: canonical_axis(layer_param, getattr(layer_param, param_field).axis, ndim)


def rows_apart_off_axis_0(axis_of: Callable[[Any, int], int]) -> RowsApartFn:
    """``LayerRule.rows_apart`` for a layer that works along one axis, ``axis_of(layer_param, ndim)`` (canonical,
    for a first bottom of ``ndim`` axes): its rows stay apart unless that axis is the batch axis."""
    def rows_apart(layer_param: Any, phase: int, bottom_shapes: Sequence[Shape | None]) -> bool:
        shape = bottom_shapes[0] if bottom_shapes else None
        return shape is None or axis_of(layer_param, len(shape)) != 0

    return rows_apart


_REGISTRY: dict[str, LayerRule] = {}


def register(rule: LayerRule) -> LayerRule:
    if rule.type in _REGISTRY:
        raise ValueError(f"layer type {rule.type!r} registered twice")
    _REGISTRY[rule.type] = rule
    return rule


def layer(type: str, **kwargs) -> Callable[[ForwardFn], ForwardFn]:
    """Decorator form: ``@layer("ReLU")`` over the forward function registers a rule for it."""

    def wrap(forward: ForwardFn) -> ForwardFn:
        register(LayerRule(type=type, forward=forward, **kwargs))
        return forward

    return wrap


def register_layer(type_name: str, forward: ForwardFn, param_shapes: ParamShapesFn | None = None,
                   init_params: InitParamsFn | None = None, *, bottoms: tuple[int, int | None] = (0, None),
                   tops: tuple[int, int | None] = (0, None), is_loss: bool = False, in_place: bool = True,
                   allow_force_backward: Callable[[Any, int], bool] | None = None, frozen_params: bool = False,
                   host_forward: Callable | None = None, host_backward: Callable | None = None,
                   rows_apart: bool | RowsApartFn = False, override: bool = False) -> LayerRule:
    """Add a layer type written as a pure JAX function: the safe replacement for Caffe's Python layers.

    ``forward(ctx, bottoms, params) -> tops`` must be pure and jit-able; it reads its settings from
    ``ctx.layer`` (the LayerParameter, e.g. ``ctx.layer.python_param.param_str`` or a fork parameter, see
    caffejax.frontend.prototxt.fork_param). ``param_shapes(layer, bottom_shapes) -> shapes`` declares learnable
    blobs (none by default) and ``init_params(layer, shapes, key) -> arrays`` fills them (zeros if absent and no
    weights are loaded). ``bottoms``/``tops`` are (min, max) counts, max None for unbounded. ``host_forward``
    makes it a layer run on the host after the program, ``host_backward`` gives it a backward there (see
    :class:`LayerRule`). ``rows_apart`` declares that each row of the batch is computed apart from the others
    (:class:`LayerRule`; ``compile_inference(batch_sizes=...)`` needs it of every layer). Replacing a
    registered type, BVLC's included, needs ``override=True``.
    """
    _load_families()
    problems = []
    if not isinstance(type_name, str) or not type_name.strip():
        problems.append(f"type name must be a non-empty string, got {type_name!r}")
    elif type_name == "Python":
        problems.append("'Python' is Caffe's own type for pycaffe layers (run only with allow_python_layers=True); "
                        "give your layer its own type name")
    for name, fn in (("forward", forward), ("param_shapes", param_shapes), ("init_params", init_params),
                     ("allow_force_backward", allow_force_backward), ("host_forward", host_forward),
                     ("host_backward", host_backward)):
        if fn is not None and not callable(fn):
            problems.append(f"{name} must be callable, got {type(fn).__name__}")
    if not (isinstance(rows_apart, bool) or callable(rows_apart)):
        problems.append(f"rows_apart must be True, False or callable, got {type(rows_apart).__name__}")
    if host_backward is not None and host_forward is None:
        problems.append("host_backward is the backward of a layer run on the host: it needs host_forward")
    for name, limits in (("bottoms", bottoms), ("tops", tops)):
        lo, hi = limits if isinstance(limits, tuple) and len(limits) == 2 else (None, None)
        if not (isinstance(lo, int) and lo >= 0 and (hi is None or (isinstance(hi, int) and hi >= lo))):
            problems.append(f"{name} must be (min, max) with 0 <= min <= max (max None for unbounded), got {limits!r}")
    if not problems and type_name in _REGISTRY and not override:
        what = "a BVLC Caffe layer type" if type_name in _BVLC_TYPES else "already registered"
        problems.append(f"'{type_name}' is {what}; pass override=True to replace its rule")
    if problems:
        raise SchemaError(f"register_layer({type_name!r}): " + "; ".join(problems))
    options = {} if allow_force_backward is None else {"allow_force_backward": allow_force_backward}
    rule = LayerRule(type=type_name, forward=forward, param_shapes=param_shapes or no_params,
                     init_params=init_params, is_loss=is_loss, bottoms=bottoms, tops=tops, in_place=in_place,
                     frozen_params=frozen_params, host_forward=host_forward, host_backward=host_backward,
                     rows_apart=rows_apart, **options)
    _REGISTRY[type_name] = rule
    return rule


def get_rule(type_name: str) -> LayerRule:
    """The rule for a type name; KeyError if none is registered (the frontend turns that into a GraphError)."""
    _load_families()
    return _REGISTRY[type_name]


def registered_types() -> list[str]:
    _load_families()
    return sorted(_REGISTRY)


_BVLC_TYPES: frozenset[str] = frozenset()


def _load_families() -> None:
    # Importing a family module registers its rules; imports are cached, so this is cheap after the first call.
    global _BVLC_TYPES
    if _BVLC_TYPES:
        return
    from caffejax.lower import common, data, loss, neuron, python_layer, recurrent, vision  # noqa: F401

    _BVLC_TYPES = frozenset(_REGISTRY)


# ---- small helpers every family uses (Caffe's Blob::CanonicalAxisIndex, LegacyShape and count) ---------------

def canonical_axis(where: LayerContext | Any | str, axis: int, ndim: int) -> int:
    """Caffe's CanonicalAxisIndex: a negative axis counts from the end; out of range is an error.

    ``where`` names the layer in that error: its LayerContext or LayerParameter (a forward and the shape rule
    beside it then raise the same message), or only its name."""
    if not -ndim <= axis < ndim:
        message = f"axis {axis} out of range for a {ndim}-D blob"
        if not isinstance(where, str):
            raise rejected(where.layer if isinstance(where, LayerContext) else where, message)
        error = ShapeError(f"layer '{where}': {message}")
        error.layer = where
        raise error
    return axis + ndim if axis < 0 else axis


def legacy_4d(shape: Sequence[int]) -> tuple[int, ...]:
    """Caffe's Blob::LegacyShape for every index: (num, channels, height, width), 1 past the blob's axes (also
    Blob::Reshape(num(), channels(), height(), width())). Callers check the at most 4 axes Caffe's CHECK asks
    for; a longer shape comes back as it is."""
    return tuple(shape) + (1,) * (4 - len(shape))


def is_symbolic(dim) -> bool:
    """Whether ``dim`` is a symbolic dimension (an export's batch, jax.export.symbolic_shape) rather than a
    number: rules that pick a kernel by size take their general form for it."""
    return not isinstance(dim, (int, np.integer))


def count(shape: Sequence[int], start: int = 0, end: int | None = None) -> int:
    """Caffe's Blob::count(start, end): product of the dims in [start, end). A symbolic dim (an export's
    batch, jax.export.symbolic_shape) stays symbolic in the product."""
    return math.prod(dim if is_symbolic(dim) else int(dim) for dim in shape[start:end])
