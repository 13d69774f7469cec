"""The layer registry: Caffe layer type name -> :class:`LayerRule`.

A rule is what Caffe's ``Layer`` subclass is, minus the state: the learnable blobs it allocates
(``param_shapes`` + ``init_params``, i.e. ``LayerSetUp``), its forward math as a pure JAX function
(``forward``; the top shapes, i.e. ``Reshape``, follow from it through ``jax.eval_shape``), and the few
flags the net assembly needs (``is_loss``, ``allow_force_backward``, blob-count limits).

This is the only global mutable state in caffejax: rules are registered once, at import of the family
modules (``vision``, ``neuron``, ``common``, ``loss``, ``recurrent``, ``data``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol, Sequence

import jax
import numpy as np

from caffejax.errors import CaffejaxError, ShapeError, layer_error

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
    those values as the new state.
    """

    layer: Any
    phase: int
    key: jax.Array | None = None
    num_tops: int = 1
    # in_place[i]: top i shares its bottom's memory in Caffe (``top: x`` with ``bottom: x``). A few of Caffe's
    # hand-written backwards read the overwritten bottom there; the rules reproducing that consult this.
    in_place: tuple[bool, ...] = ()
    param_updates: dict[int, jax.Array] = dataclasses.field(default_factory=dict)

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

    def error(self, message: str, cls: type[CaffejaxError] = ShapeError) -> CaffejaxError:
        """An error naming this layer; lowering code raises it for inputs Caffe would CHECK-fail on."""
        return layer_error(cls, self.name, self.type, message)


ForwardFn = Callable[[LayerContext, Sequence[jax.Array], Sequence[jax.Array]], Sequence[jax.Array]]
ParamShapesFn = Callable[[Any, Sequence[Shape]], Sequence[Shape]]
InitParamsFn = Callable[[Any, Sequence[Shape], jax.Array], Sequence[np.ndarray]]
InputShapesFn = Callable[[Any, int, str | None], Sequence[Shape]]


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


def get_rule(type_name: str) -> LayerRule:
    """The rule for a type name; KeyError if none is registered (the frontend turns that into a GraphError)."""
    _load_families()
    return _REGISTRY[type_name]


def registered_types() -> list[str]:
    _load_families()
    return sorted(_REGISTRY)


def _load_families() -> None:
    # Importing a family module registers its rules; imports are cached, so this is cheap after the first call.
    from caffejax.lower import common, data, loss, neuron, recurrent, vision  # noqa: F401


# ---- small helpers every family uses (Caffe's Blob::CanonicalAxisIndex and Blob::count) -------------------

def canonical_axis(ctx_or_name: LayerContext | str, axis: int, ndim: int) -> int:
    """Caffe's CanonicalAxisIndex: a negative axis counts from the end; out of range is an error."""
    if not -ndim <= axis < ndim:
        name = ctx_or_name.name if isinstance(ctx_or_name, LayerContext) else ctx_or_name
        raise ShapeError(f"layer '{name}': axis {axis} out of range for a {ndim}-D blob")
    return axis + ndim if axis < 0 else axis


def count(shape: Sequence[int], start: int = 0, end: int | None = None) -> int:
    """Caffe's Blob::count(start, end): product of the dims in [start, end)."""
    return int(np.prod(shape[start:end], dtype=np.int64))
