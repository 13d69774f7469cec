"""pycaffe's net specification: write a net in Python, get its ``NetParameter`` (``caffe.NetSpec``).

Layers are made by calling attributes of :data:`layers` (``L.Convolution(bottom, kernel_size=5, ...)``),
which returns the layer's top (a :class:`Top`; a tuple of them with ``ntop=N``). Keyword arguments become
fields of the layer's own parameter message (``convolution_param`` for a Convolution) when that message
has the field, else fields of the LayerParameter itself; arguments ending in ``param`` always go to the
LayerParameter (``param=[dict(lr_mult=1)]``, ``transform_param=dict(scale=...)``). Dicts become messages,
lists repeated fields, and a single value given to a repeated field is a one-element list. ``ntop=N`` sets
the number of tops (0: the layer returns its :class:`Function`); ``in_place=True`` writes the top over the
bottom. :data:`params` gives enum values: ``P.Pooling.MAX``.

Names follow pycaffe: a :class:`NetSpec` names each top after the attribute it was assigned to, and a
layer after its first top; anything unnamed is ``<Type><count>`` (``Convolution1``). :func:`to_proto`
without a NetSpec names everything that way.

Differences from pycaffe, on purpose. Values pycaffe fails on (IndexError, TypeError, AttributeError) are
taken: a tuple is a list, an empty list leaves a repeated field empty, a protobuf message is copied into a
message field, and a list mixing dicts with values or messages is assigned item by item. A dict for a scalar
field is refused even when empty (pycaffe silently drops an empty one; it is always a slip). Errors pycaffe
leaves bare are :class:`SchemaError` or :class:`GraphError` naming the layer, field or NetSpec value (a
repeated scalar field given a dict, a top an in-place layer does not have, a tuple of tops or a Function
where a top is needed). A NetSpec's missing attribute raises AttributeError (pycaffe: KeyError), so hasattr,
copy and pickle work.

Example (pycaffe's LeNet)::

    from caffejax import layers as L, params as P
    n = caffejax.NetSpec()
    n.data, n.label = L.Data(batch_size=64, backend=P.Data.LMDB, source="mnist_train_lmdb",
                             transform_param=dict(scale=1. / 255), ntop=2)
    n.conv1 = L.Convolution(n.data, kernel_size=5, num_output=20, weight_filler=dict(type="xavier"))
    ...
    text = str(n.to_proto())
"""

from __future__ import annotations

import collections
import functools
from typing import Any

from google.protobuf import message

from caffejax.errors import GraphError, SchemaError
from caffejax.frontend.prototxt import fork_aware_class, fork_message_class
from caffejax.proto import caffe_pb2

__all__ = ["NetSpec", "Top", "Function", "layers", "params", "to_proto", "assign_proto", "param_name_dict"]


def param_name_dict() -> dict[str, str]:
    """Layer type -> the prefix of its parameter field: ``{"Convolution": "convolution", ...}``.

    Read off caffe.proto as pycaffe does: every ``<x>_param`` field of LayerParameter whose message is
    ``<Type>Parameter`` maps ``<Type>`` to ``<x>``; registered fork fields count too (``"PriorBox": "prior_box"``),
    as they do in a fork's own pycaffe.
    """
    return dict(_param_names(fork_aware_class(caffe_pb2.LayerParameter).DESCRIPTOR))


@functools.lru_cache(maxsize=8)
def _param_names(layer_descriptor) -> tuple[tuple[str, str], ...]:
    names = {}
    for field in layer_descriptor.fields:
        if field.name.endswith("_param") and field.message_type is not None:
            type_name = field.message_type.name
            if type_name.endswith("Parameter"):
                names[type_name[: -len("Parameter")]] = field.name[: -len("_param")]
    return tuple(names.items())


def assign_proto(proto: message.Message, name: str, value: Any) -> None:
    """Set field ``name`` of ``proto`` from a Python value: dicts are messages, lists repeated fields.

    A single value given to a repeated field becomes a one-element list; a message value is copied in.
    Raises :class:`SchemaError` naming the message and field when caffe.proto does not allow it.
    """
    where = proto.DESCRIPTOR.full_name
    if name not in proto.DESCRIPTOR.fields_by_name:
        raise SchemaError(f"{where} has no field '{name}'")
    field = proto.DESCRIPTOR.fields_by_name[name]
    is_message = field.message_type is not None
    try:
        if field.is_repeated:
            items = value if isinstance(value, (list, tuple)) else [value]
            target = getattr(proto, name)
            for item in items:
                if isinstance(item, dict):
                    if not is_message:
                        raise SchemaError(f"{where}.{name} is a repeated scalar field, got a dict")
                    _assign_dict(target.add(), item)
                elif is_message and isinstance(item, message.Message):
                    target.add().CopyFrom(item)
                else:
                    target.append(item)
        elif isinstance(value, dict):
            if not is_message:
                raise SchemaError(f"{where}.{name} is a scalar field, got a dict")
            # As in pycaffe, only the fields set mark the message present: an empty dict leaves it unset (a
            # Scale's filler={} keeps Caffe's identity default instead of becoming a present, zero filler).
            _assign_dict(getattr(proto, name), value)
        elif is_message:
            if not isinstance(value, message.Message):
                raise SchemaError(f"{where}.{name} is a message ({field.message_type.name}); give a dict")
            getattr(proto, name).CopyFrom(value)
        else:
            setattr(proto, name, value)
    except (TypeError, ValueError) as e:
        raise SchemaError(f"{where}.{name}: cannot assign {value!r}: {e}") from None


def _assign_dict(proto: message.Message, values: dict) -> None:
    for key, value in values.items():
        assign_proto(proto, key, value)


class Top:
    """One output blob of a layer (the ``n``-th top of ``fn``)."""

    def __init__(self, fn: "Function", n: int):
        self.fn = fn
        self.n = n

    def to_proto(self) -> caffe_pb2.NetParameter:
        """A NetParameter with every layer needed to compute this top (names generated)."""
        return to_proto(self)

    def _to_proto(self, layers, names, autonames) -> None:
        self.fn._to_proto(layers, names, autonames)

    def _update(self, params: dict) -> None:
        self.fn._update(params)

    def __repr__(self) -> str:
        return f"<Top {self.n} of {self.fn.type_name}>"


class Function:
    """A layer: its type, its inputs (tops of other layers) and its parameters."""

    def __init__(self, type_name: str, inputs, params: dict):
        for index, bottom in enumerate(inputs):
            if not isinstance(bottom, Top):
                raise TypeError(f"{type_name} input {index} is not a Top (type is {type(bottom).__name__})")
        self.type_name = type_name
        self.inputs = tuple(inputs)
        self.params = dict(params)
        self.ntop = self.params.pop("ntop", 1)
        self.in_place = self.params.pop("in_place", False)
        self.tops = tuple(Top(self, n) for n in range(self.ntop))

    def _update(self, params: dict) -> None:
        self.params.update(params)

    def _get_name(self, names, autonames) -> str:
        """The layer's name: its first top's, or ``<Type><count>`` for a layer without tops."""
        if self not in names:
            if self.ntop > 0:
                names[self] = self._get_top_name(self.tops[0], names, autonames)
            else:
                autonames[self.type_name] += 1
                names[self] = f"{self.type_name}{autonames[self.type_name]}"
        return names[self]

    @staticmethod
    def _get_top_name(top: Top, names, autonames) -> str:
        if top not in names:
            autonames[top.fn.type_name] += 1
            names[top] = f"{top.fn.type_name}{autonames[top.fn.type_name]}"
        return names[top]

    def _to_proto(self, layers, names, autonames) -> None:
        """Add this layer (after the layers its inputs need) to ``layers`` (Function -> LayerParameter)."""
        if self in layers:
            return
        bottom_names = []
        for bottom in self.inputs:
            bottom._to_proto(layers, names, autonames)
            bottom_names.append(_top_name(layers[bottom.fn], bottom))
        layer = fork_aware_class(caffe_pb2.LayerParameter)(type=self.type_name)
        layer.bottom.extend(bottom_names)
        if self.in_place:
            layer.top.extend(layer.bottom)
        else:
            layer.top.extend(self._get_top_name(top, names, autonames) for top in self.tops)
        layer.name = self._get_name(names, autonames)
        for key, value in self.params.items():
            self._assign(layer, key, value)
        layers[self] = layer

    def _assign(self, layer: caffe_pb2.LayerParameter, key: str, value: Any) -> None:
        """pycaffe's rule: ``*param`` keys go to the LayerParameter; others to the type's own parameter
        message if it has that field, else to the LayerParameter."""
        try:
            param_names = param_name_dict()
            if not key.endswith("param") and self.type_name in param_names:
                own = getattr(layer, param_names[self.type_name] + "_param")
                if key in own.DESCRIPTOR.fields_by_name:
                    assign_proto(own, key, value)
                    return
            assign_proto(layer, key, value)
        except SchemaError as e:
            raise SchemaError(f"layer '{layer.name}' (type {self.type_name}): argument {key}={value!r}: {e}") \
                from None


def _top_name(layer: caffe_pb2.LayerParameter, top: Top) -> str:
    """The name ``top`` has in its layer's proto. An in-place layer has only its bottoms as tops, so a later
    top of it (``ntop`` above its bottom count) names no blob: pycaffe failed there with a bare IndexError."""
    if top.n >= len(layer.top):
        in_place = f" (in place over {len(layer.bottom)} bottom(s))" if top.fn.in_place else ""
        raise GraphError(f"layer '{layer.name}' (type {layer.type}) has {len(layer.top)} top(s){in_place}: its top "
                         f"{top.n} cannot be a bottom")
    return layer.top[top.n]


def _check_top(value, what: str, functions_too: bool = False) -> None:
    """Refuse, before pycaffe's bare AttributeError, a value that is not a layer's top (e.g. the tuple of tops
    an ``ntop=2`` layer returns); a NetSpec also holds layers without tops (``ntop=0``)."""
    allowed = (Top, Function) if functions_too else (Top,)
    if isinstance(value, allowed):
        return
    if isinstance(value, tuple):
        hint = " (a layer with ntop > 1 returns a tuple: assign each top, n.a, n.b = L.Slice(..., ntop=2))"
    elif isinstance(value, Function):
        hint = f" (the {value.type_name} layer was made with ntop=0: it has no top)"
    else:
        hint = ""
    raise GraphError(f"{what} is a {type(value).__name__}, not a layer's top{hint}")


class NetSpec:
    """A set of named tops (assigned as attributes or items); ``to_proto()`` makes the net computing them."""

    def __init__(self):
        super().__setattr__("tops", collections.OrderedDict())

    def __setattr__(self, name: str, value) -> None:
        self.tops[name] = value

    def __getattr__(self, name: str):
        try:
            return self.tops[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setitem__(self, name: str, value) -> None:
        self.tops[name] = value

    def __getitem__(self, name: str):
        return self.tops[name]

    def __delitem__(self, name: str) -> None:
        del self.tops[name]

    def keys(self) -> list[str]:
        return list(self.tops)

    def vals(self) -> list:
        return list(self.tops.values())

    def update(self, name: str, params: dict) -> None:
        _check_top(self.tops[name], f"NetSpec value '{name}'", functions_too=True)
        self.tops[name]._update(params)

    def to_proto(self) -> caffe_pb2.NetParameter:
        for name, top in self.tops.items():
            _check_top(top, f"NetSpec value '{name}'", functions_too=True)
        names = {top: name for name, top in self.tops.items()}
        autonames: collections.Counter = collections.Counter()
        layers: collections.OrderedDict = collections.OrderedDict()
        for top in self.tops.values():
            top._to_proto(layers, names, autonames)
        net = fork_aware_class(caffe_pb2.NetParameter)()
        net.layer.extend(layers.values())
        return net


def to_proto(*tops: Top) -> caffe_pb2.NetParameter:
    """A NetParameter with every layer needed to compute ``tops``; all names generated."""
    layers: collections.OrderedDict = collections.OrderedDict()
    autonames: collections.Counter = collections.Counter()
    for index, top in enumerate(tops):
        _check_top(top, f"to_proto argument {index}")
        top.fn._to_proto(layers, {}, autonames)
    net = fork_aware_class(caffe_pb2.NetParameter)()
    net.layer.extend(layers.values())
    return net


class Layers:
    """``layers.Convolution(bottom, kernel_size=3)``: a layer of that type; returns its top(s)."""

    def __getattr__(self, type_name: str):
        if type_name.startswith("__"):
            raise AttributeError(type_name)  # keep copy/pickle protocol lookups from making layers

        def layer_fn(*args, **kwargs):
            fn = Function(type_name, args, kwargs)
            if fn.ntop == 0:
                return fn
            if fn.ntop == 1:
                return fn.tops[0]
            return fn.tops

        return layer_fn


class Parameters:
    """``params.Pooling.MAX``: the enum value ``PoolingParameter.MAX`` of caffe.proto."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        message_class = getattr(caffe_pb2, name + "Parameter", None) or fork_message_class(name + "Parameter")
        if message_class is None:
            raise AttributeError(f"caffe.proto has no message {name}Parameter (nor does a registered fork)")
        return _EnumValues(message_class)


class _EnumValues:
    def __init__(self, message_class):
        self._message_class = message_class

    def __getattr__(self, value_name: str):
        if value_name.startswith("__"):
            raise AttributeError(value_name)
        try:
            return getattr(self._message_class, value_name)
        except AttributeError:
            raise AttributeError(f"{self._message_class.DESCRIPTOR.name} has no enum value {value_name}") \
                from None


layers = Layers()
params = Parameters()
