"""Upgrading old Caffe net and solver definitions to the current format.

A port of BVLC Caffe's ``src/caffe/util/upgrade_proto.cpp``. A Caffe binary reads a prototxt or a caffemodel and
runs ``UpgradeNetAsNeeded`` on it before anything else looks at it. That function applies these steps in order,
each only when the net needs it:

1. **V0 -> V1** (:func:`upgrade_v0_to_v1`). ``layers { layer { type: 'conv' ... } }`` becomes
   ``layers { type: CONVOLUTION convolution_param { ... } }``. ``padding`` layers are folded into the conv or pool
   that reads them first (:func:`upgrade_v0_padding_layers`).
2. **Data transformation** (:func:`upgrade_data_transformation`). scale/mean_file/crop_size/mirror move out of
   the DATA, IMAGE_DATA and WINDOW_DATA params into ``transform_param``.
3. **V1 -> V2** (:func:`upgrade_v1_to_v2`). ``layers`` (with enum types) becomes ``layer`` (with string types).
   blobs_lr, weight_decay, the param names and blob_share_mode become ``param { ... }`` ParamSpecs.
4. **Input** (:func:`upgrade_input`). The ``input:``/``input_dim:``/``input_shape:`` header becomes a first
   layer named ``input`` of type ``Input``.
5. **BatchNorm** (:func:`upgrade_batch_norm`). A BatchNorm layer with exactly three ``param`` entries gets
   lr_mult 0 and decay_mult 0 on each one.

Every function returns an upgraded copy and leaves its argument alone.

Caffe's LOG(FATAL)/CHECK failures raise :class:`~caffejax.errors.SchemaError`. Caffe also logs an ERROR and
carries on when a V0 layer sets a field its type does not take (for example ``num_output`` on a ``relu``).
With ``strict=True``, the default, that case raises SchemaError too. With ``strict=False`` the field is
dropped as Caffe drops it, and an :class:`UpgradeWarning` is issued. Every other case where Caffe only logs
an error and continues gives an :class:`UpgradeWarning` and the upgrade goes on.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from caffejax.errors import SchemaError
from caffejax.proto import caffe_pb2

__all__ = [
    "UpgradeWarning",
    "net_needs_upgrade",
    "net_needs_v0_to_v1_upgrade",
    "net_needs_data_upgrade",
    "net_needs_v1_to_v2_upgrade",
    "net_needs_input_upgrade",
    "net_needs_batch_norm_upgrade",
    "upgrade_net_as_needed",
    "upgrade_v0_to_v1",
    "upgrade_v0_padding_layers",
    "upgrade_v0_layer",
    "upgrade_v0_layer_type",
    "upgrade_data_transformation",
    "upgrade_v1_to_v2",
    "upgrade_v1_layer",
    "upgrade_v1_layer_type",
    "upgrade_input",
    "upgrade_batch_norm",
    "solver_needs_type_upgrade",
    "upgrade_solver_as_needed",
    "upgrade_solver_net_params",
    "V1_TO_V2_LAYER_TYPE",
    "V0_TO_V1_LAYER_TYPE",
    "SOLVER_TYPE_NAMES",
]

log = logging.getLogger(__name__)


class UpgradeWarning(UserWarning):
    """A problem that Caffe's upgrade logs at ERROR level before it carries on."""


def _warn(message: str) -> None:
    warnings.warn(message, UpgradeWarning, stacklevel=3)


def _copy(message: Any) -> Any:
    duplicate = type(message)()
    duplicate.CopyFrom(message)
    return duplicate


def _where(source: str, layer_name: str) -> str:
    return f"{source}: layer '{layer_name}'"


# ---------------------------------------------------------------------------------------------------------------
# Tables transcribed from upgrade_proto.cpp.
# ---------------------------------------------------------------------------------------------------------------

# UpgradeV0LayerType: V0 lower-case type string -> V1LayerParameter.LayerType enum name. Any other string
# (including 'padding', which only UpgradeV0PaddingLayers knows) is LOG(FATAL) "Unknown layer name".
V0_TO_V1_LAYER_TYPE: dict[str, str] = {
    "accuracy": "ACCURACY",
    "bnll": "BNLL",
    "concat": "CONCAT",
    "conv": "CONVOLUTION",
    "data": "DATA",
    "dropout": "DROPOUT",
    "euclidean_loss": "EUCLIDEAN_LOSS",
    "flatten": "FLATTEN",
    "hdf5_data": "HDF5_DATA",
    "hdf5_output": "HDF5_OUTPUT",
    "im2col": "IM2COL",
    "images": "IMAGE_DATA",
    "infogain_loss": "INFOGAIN_LOSS",
    "innerproduct": "INNER_PRODUCT",
    "lrn": "LRN",
    "multinomial_logistic_loss": "MULTINOMIAL_LOGISTIC_LOSS",
    "pool": "POOLING",
    "relu": "RELU",
    "sigmoid": "SIGMOID",
    "softmax": "SOFTMAX",
    "softmax_loss": "SOFTMAX_LOSS",
    "split": "SPLIT",
    "tanh": "TANH",
    "window_data": "WINDOW_DATA",
}

# UpgradeV1LayerType: V1LayerParameter.LayerType enum name -> V2 type string. Anything else is LOG(FATAL).
V1_TO_V2_LAYER_TYPE: dict[str, str] = {
    "NONE": "",
    "ABSVAL": "AbsVal",
    "ACCURACY": "Accuracy",
    "ARGMAX": "ArgMax",
    "BNLL": "BNLL",
    "CONCAT": "Concat",
    "CONTRASTIVE_LOSS": "ContrastiveLoss",
    "CONVOLUTION": "Convolution",
    "DECONVOLUTION": "Deconvolution",
    "DATA": "Data",
    "DROPOUT": "Dropout",
    "DUMMY_DATA": "DummyData",
    "EUCLIDEAN_LOSS": "EuclideanLoss",
    "ELTWISE": "Eltwise",
    "EXP": "Exp",
    "FLATTEN": "Flatten",
    "HDF5_DATA": "HDF5Data",
    "HDF5_OUTPUT": "HDF5Output",
    "HINGE_LOSS": "HingeLoss",
    "IM2COL": "Im2col",
    "IMAGE_DATA": "ImageData",
    "INFOGAIN_LOSS": "InfogainLoss",
    "INNER_PRODUCT": "InnerProduct",
    "LRN": "LRN",
    "MEMORY_DATA": "MemoryData",
    "MULTINOMIAL_LOGISTIC_LOSS": "MultinomialLogisticLoss",
    "MVN": "MVN",
    "POOLING": "Pooling",
    "POWER": "Power",
    "RELU": "ReLU",
    "SIGMOID": "Sigmoid",
    "SIGMOID_CROSS_ENTROPY_LOSS": "SigmoidCrossEntropyLoss",
    "SILENCE": "Silence",
    "SOFTMAX": "Softmax",
    "SOFTMAX_LOSS": "SoftmaxWithLoss",
    "SPLIT": "Split",
    "SLICE": "Slice",
    "TANH": "TanH",
    "WINDOW_DATA": "WindowData",
    "THRESHOLD": "Threshold",
}

# UpgradeSolverType: SolverParameter.SolverType enum name -> the `type` string.
SOLVER_TYPE_NAMES: dict[str, str] = {
    "SGD": "SGD",
    "NESTEROV": "Nesterov",
    "ADAGRAD": "AdaGrad",
    "RMSPROP": "RMSProp",
    "ADADELTA": "AdaDelta",
    "ADAM": "Adam",
}

# UpgradeV0LayerParameter, field by field and in its order. An entry is
#   (V0 field, {V0 type: (V1 sub-message, field in it)})
# with the V1 field None when the whole message is copied. _ANY_TYPE means the move happens for every layer
# type (the transform fields). A field set on a type its entry does not list is
# "Unknown parameter <field> for layer type <type>" (LOG(ERROR), the field is dropped).
_ANY_TYPE = "*"
_V0_FIELD_MOVES: tuple[tuple[str, dict[str, tuple[str, str | None]]], ...] = (
    ("num_output", {"conv": ("convolution_param", "num_output"),
                    "innerproduct": ("inner_product_param", "num_output")}),
    ("biasterm", {"conv": ("convolution_param", "bias_term"),
                  "innerproduct": ("inner_product_param", "bias_term")}),
    ("weight_filler", {"conv": ("convolution_param", "weight_filler"),
                       "innerproduct": ("inner_product_param", "weight_filler")}),
    ("bias_filler", {"conv": ("convolution_param", "bias_filler"),
                     "innerproduct": ("inner_product_param", "bias_filler")}),
    ("pad", {"conv": ("convolution_param", "pad"), "pool": ("pooling_param", "pad")}),
    ("kernelsize", {"conv": ("convolution_param", "kernel_size"), "pool": ("pooling_param", "kernel_size")}),
    ("group", {"conv": ("convolution_param", "group")}),
    ("stride", {"conv": ("convolution_param", "stride"), "pool": ("pooling_param", "stride")}),
    ("pool", {"pool": ("pooling_param", "pool")}),
    ("dropout_ratio", {"dropout": ("dropout_param", "dropout_ratio")}),
    ("local_size", {"lrn": ("lrn_param", "local_size")}),
    ("alpha", {"lrn": ("lrn_param", "alpha")}),
    ("beta", {"lrn": ("lrn_param", "beta")}),
    ("k", {"lrn": ("lrn_param", "k")}),
    ("source", {"data": ("data_param", "source"),
                "hdf5_data": ("hdf5_data_param", "source"),
                "images": ("image_data_param", "source"),
                "window_data": ("window_data_param", "source"),
                "infogain_loss": ("infogain_loss_param", "source")}),
    ("scale", {_ANY_TYPE: ("transform_param", "scale")}),
    ("meanfile", {_ANY_TYPE: ("transform_param", "mean_file")}),
    ("batchsize", {"data": ("data_param", "batch_size"),
                   "hdf5_data": ("hdf5_data_param", "batch_size"),
                   "images": ("image_data_param", "batch_size"),
                   "window_data": ("window_data_param", "batch_size")}),
    ("cropsize", {_ANY_TYPE: ("transform_param", "crop_size")}),
    ("mirror", {_ANY_TYPE: ("transform_param", "mirror")}),
    ("rand_skip", {"data": ("data_param", "rand_skip"), "images": ("image_data_param", "rand_skip")}),
    ("shuffle_images", {"images": ("image_data_param", "shuffle")}),
    ("new_height", {"images": ("image_data_param", "new_height")}),
    ("new_width", {"images": ("image_data_param", "new_width")}),
    ("concat_dim", {"concat": ("concat_param", "concat_dim")}),
    ("det_fg_threshold", {"window_data": ("window_data_param", "fg_threshold")}),
    ("det_bg_threshold", {"window_data": ("window_data_param", "bg_threshold")}),
    ("det_fg_fraction", {"window_data": ("window_data_param", "fg_fraction")}),
    ("det_context_pad", {"window_data": ("window_data_param", "context_pad")}),
    ("det_crop_mode", {"window_data": ("window_data_param", "crop_mode")}),
    ("hdf5_output_param", {"hdf5_output": ("hdf5_output_param", None)}),
)

# V0 fields UpgradeV0LayerParameter handles outside the table above (name, type and the repeated blob fields).
_V0_FIELDS_HANDLED_APART = ("name", "type", "blobs", "blobs_lr", "weight_decay")
# V0 fields UpgradeV0LayerParameter never reads: Caffe drops them without a word. We warn.
_V0_FIELDS_CAFFE_DROPS = ("new_num", "new_channels")

# UpgradeV1LayerParameter copies these sub-messages when they are present, in this order.
_V1_COPIED_MESSAGES = (
    "accuracy_param", "argmax_param", "concat_param", "contrastive_loss_param", "convolution_param",
    "data_param", "dropout_param", "dummy_data_param", "eltwise_param", "exp_param", "hdf5_data_param",
    "hdf5_output_param", "hinge_loss_param", "image_data_param", "infogain_loss_param",
    "inner_product_param", "lrn_param", "memory_data_param", "mvn_param", "pooling_param", "power_param",
    "relu_param", "sigmoid_param", "softmax_param", "slice_param", "tanh_param", "threshold_param",
    "window_data_param", "transform_param", "loss_param",
)
# ... and handles these V1 fields one by one.
_V1_FIELDS_HANDLED_APART = ("bottom", "top", "name", "include", "exclude", "type", "blobs", "param",
                            "blob_share_mode", "blobs_lr", "weight_decay", "loss_weight", "layer")

# NetNeedsDataUpgrade / UpgradeNetDataTransformation: V1 type -> the param holding the old transform fields.
_DATA_LAYER_PARAMS = (("DATA", "data_param"), ("IMAGE_DATA", "image_data_param"),
                      ("WINDOW_DATA", "window_data_param"))
_OLD_TRANSFORM_FIELDS = ("scale", "mean_file", "crop_size", "mirror")


def _v1_type_value(name: str) -> int:
    return caffe_pb2.V1LayerParameter.LayerType.Value(name)


def _assign(message: Any, field_name: str, value: Any) -> None:
    """Set a field the way Caffe's generated setter would: add_* for repeated, CopyFrom for messages.

    Which it is depends on the bindings: ConvolutionParameter's pad/kernel_size/stride are repeated, while
    PoolingParameter's are single values.
    """
    field = message.DESCRIPTOR.fields_by_name[field_name]
    if field.message_type is not None:
        if field.is_repeated:
            getattr(message, field_name).add().CopyFrom(value)
        else:
            getattr(message, field_name).CopyFrom(value)
    elif field.is_repeated:
        getattr(message, field_name).append(value)
    else:
        setattr(message, field_name, value)


# ---------------------------------------------------------------------------------------------------------------
# What needs upgrading.
# ---------------------------------------------------------------------------------------------------------------

def net_needs_v0_to_v1_upgrade(net: caffe_pb2.NetParameter) -> bool:
    """NetNeedsV0ToV1Upgrade: some ``layers`` entry holds a V0 ``layer``."""
    return any(layer.HasField("layer") for layer in net.layers)


def net_needs_data_upgrade(net: caffe_pb2.NetParameter) -> bool:
    """NetNeedsDataUpgrade: a V1 data layer sets scale/mean_file/crop_size/mirror in its own param."""
    for layer in net.layers:
        for type_name, param_name in _DATA_LAYER_PARAMS:
            if layer.type == _v1_type_value(type_name):
                param = getattr(layer, param_name)
                if any(param.HasField(field) for field in _OLD_TRANSFORM_FIELDS):
                    return True
    return False


def net_needs_v1_to_v2_upgrade(net: caffe_pb2.NetParameter) -> bool:
    """NetNeedsV1ToV2Upgrade: the net has any ``layers`` entries."""
    return len(net.layers) > 0


def net_needs_input_upgrade(net: caffe_pb2.NetParameter) -> bool:
    """NetNeedsInputUpgrade: the net has an ``input:`` header."""
    return len(net.input) > 0


def net_needs_batch_norm_upgrade(net: caffe_pb2.NetParameter) -> bool:
    """NetNeedsBatchNormUpgrade: a BatchNorm layer declares exactly three ``param`` entries."""
    return any(layer.type == "BatchNorm" and len(layer.param) == 3 for layer in net.layer)


def net_needs_upgrade(net: caffe_pb2.NetParameter) -> bool:
    """NetNeedsUpgrade: any of the steps of :func:`upgrade_net_as_needed` would apply."""
    return (net_needs_v0_to_v1_upgrade(net) or net_needs_v1_to_v2_upgrade(net) or net_needs_data_upgrade(net)
            or net_needs_input_upgrade(net) or net_needs_batch_norm_upgrade(net))


# ---------------------------------------------------------------------------------------------------------------
# The whole upgrade.
# ---------------------------------------------------------------------------------------------------------------

def upgrade_net_as_needed(net: caffe_pb2.NetParameter, source: str = "<string>", *,
                          strict: bool = True) -> caffe_pb2.NetParameter:
    """UpgradeNetAsNeeded: bring a NetParameter of any vintage to the current format.

    ``source`` names the file in messages. ``strict`` decides what happens when a V0 layer sets a field its
    type does not take: True raises SchemaError, False drops the field with an UpgradeWarning as Caffe does.
    Returns a new message. A caffemodel's blobs stay with their layers, in order.
    """
    upgraded = _copy(net)
    if net_needs_v0_to_v1_upgrade(upgraded):
        log.info("%s: upgrading deprecated V0LayerParameter layers", source)
        upgraded = upgrade_v0_to_v1(upgraded, source=source, strict=strict)
    if net_needs_data_upgrade(upgraded):
        log.info("%s: upgrading deprecated data transformation parameters", source)
        upgraded = upgrade_data_transformation(upgraded)
    if net_needs_v1_to_v2_upgrade(upgraded):
        log.info("%s: upgrading deprecated V1LayerParameter layers", source)
        upgraded = upgrade_v1_to_v2(upgraded, source=source)
    if net_needs_input_upgrade(upgraded):
        log.info("%s: upgrading deprecated input fields", source)
        upgraded = upgrade_input(upgraded, source=source)
    if net_needs_batch_norm_upgrade(upgraded):
        log.info("%s: upgrading BatchNorm layers with deprecated params", source)
        upgraded = upgrade_batch_norm(upgraded)
    return upgraded


# ---------------------------------------------------------------------------------------------------------------
# V0 -> V1.
# ---------------------------------------------------------------------------------------------------------------

def upgrade_v0_to_v1(net: caffe_pb2.NetParameter, *, source: str = "<string>",
                     strict: bool = True) -> caffe_pb2.NetParameter:
    """UpgradeV0Net: fold the padding layers, then rewrite each V0 layer as a V1 layer.

    Like Caffe, the result keeps only the net's name, input, input_dim and force_backward besides the
    layers.
    """
    padded = upgrade_v0_padding_layers(net, source=source)
    upgraded = caffe_pb2.NetParameter()
    if padded.HasField("name"):
        upgraded.name = padded.name
    for connection in padded.layers:
        upgraded.layers.add().CopyFrom(upgrade_v0_layer(connection, source=source, strict=strict))
    upgraded.input.extend(padded.input)
    upgraded.input_dim.extend(padded.input_dim)
    if padded.HasField("force_backward"):
        upgraded.force_backward = padded.force_backward
    return upgraded


def upgrade_v0_padding_layers(net: caffe_pb2.NetParameter, *,
                              source: str = "<string>") -> caffe_pb2.NetParameter:
    """UpgradeV0PaddingLayers: drop each V0 ``padding`` layer and move its pad into its reader.

    A layer that reads a padding layer's top must be a conv or pool layer with one bottom. The padding layer
    must have one bottom and one top. The reader then takes the padding layer's bottom and pad. Any other
    arrangement is a CHECK failure in Caffe, and so is a bottom that no earlier layer or input produces.
    """
    upgraded = _copy(net)
    del upgraded.layers[:]
    # Which layer last wrote each blob: -1 for the net's inputs.
    last_writer: dict[str, int] = {blob: -1 for blob in net.input}
    for index, connection in enumerate(net.layers):
        v0_layer = connection.layer
        if v0_layer.type != "padding":
            upgraded.layers.add().CopyFrom(connection)
        for bottom_index, blob in enumerate(connection.bottom):
            if blob not in last_writer:
                raise SchemaError(f"{_where(source, v0_layer.name)}: unknown blob input '{blob}' "
                                  f"(bottom {bottom_index}) -- no earlier layer or input produces it")
            writer_index = last_writer[blob]
            if writer_index == -1:
                continue
            writer = net.layers[writer_index]
            if writer.layer.type != "padding":
                continue
            if v0_layer.type not in ("conv", "pool"):
                raise SchemaError(f"{_where(source, v0_layer.name)}: field 'type': padding layer "
                                  f"'{writer.layer.name}' feeds a non-convolution / non-pooling layer of "
                                  f"type '{v0_layer.type}'")
            if len(connection.bottom) != 1:
                raise SchemaError(f"{_where(source, v0_layer.name)}: field 'bottom': a layer fed by padding "
                                  f"layer '{writer.layer.name}' must take a single bottom, not "
                                  f"{len(connection.bottom)}")
            if len(writer.bottom) != 1:
                raise SchemaError(f"{_where(source, writer.layer.name)}: field 'bottom': a padding layer "
                                  f"takes a single bottom, not {len(writer.bottom)}")
            if len(writer.top) != 1:
                raise SchemaError(f"{_where(source, writer.layer.name)}: field 'top': a padding layer "
                                  f"produces a single top, not {len(writer.top)}")
            reader = upgraded.layers[len(upgraded.layers) - 1]
            reader.layer.pad = writer.layer.pad
            reader.bottom[bottom_index] = writer.bottom[0]
        for blob in connection.top:
            last_writer[blob] = index
    return upgraded


def upgrade_v0_layer_type(type_name: str, *, layer_name: str = "", source: str = "<string>") -> int:
    """UpgradeV0LayerType: a V0 type string -> its V1LayerParameter.LayerType value."""
    try:
        return _v1_type_value(V0_TO_V1_LAYER_TYPE[type_name])
    except KeyError:
        raise SchemaError(f"{_where(source, layer_name)}: field 'type': unknown V0 layer type "
                          f"'{type_name}'") from None


def upgrade_v0_layer(connection: caffe_pb2.V1LayerParameter, *, source: str = "<string>",
                     strict: bool = True) -> caffe_pb2.V1LayerParameter:
    """UpgradeV0LayerParameter: one ``layers { layer { ... } bottom: top: }`` -> a new V1 layer.

    A connection without a V0 ``layer`` keeps only its bottoms and tops, as in Caffe.
    """
    out = caffe_pb2.V1LayerParameter()
    out.bottom.extend(connection.bottom)
    out.top.extend(connection.top)
    if not connection.HasField("layer"):
        return out
    v0 = connection.layer
    if v0.HasField("name"):
        out.name = v0.name
    v0_type = v0.type
    if v0.HasField("type"):
        out.type = upgrade_v0_layer_type(v0_type, layer_name=v0.name, source=source)
    for blob in v0.blobs:
        out.blobs.add().CopyFrom(blob)
    out.blobs_lr.extend(v0.blobs_lr)
    out.weight_decay.extend(v0.weight_decay)
    for v0_field, destinations in _V0_FIELD_MOVES:
        if not v0.HasField(v0_field):
            continue
        destination = destinations.get(_ANY_TYPE) or destinations.get(v0_type)
        if destination is None:
            message = (f"{_where(source, v0.name)}: field '{v0_field}': unknown parameter {v0_field} for V0 "
                       f"layer type '{v0_type}'")
            if strict:
                raise SchemaError(message)
            _warn(message + "; dropped, as Caffe does")
            continue
        param_name, field_name = destination
        value = getattr(v0, v0_field)
        if field_name is None:
            getattr(out, param_name).CopyFrom(value)
        elif v0_field == "pool":
            # V0's PoolMethod and PoolingParameter's have the same names (MAX, AVE, STOCHASTIC).
            pool_name = caffe_pb2.V0LayerParameter.PoolMethod.Name(value)
            out.pooling_param.pool = caffe_pb2.PoolingParameter.PoolMethod.Value(pool_name)
        else:
            _assign(getattr(out, param_name), field_name, value)
    for v0_field in _V0_FIELDS_CAFFE_DROPS:
        if v0.HasField(v0_field):
            _warn(f"{_where(source, v0.name)}: field '{v0_field}': Caffe's V0 upgrade ignores it; dropped")
    return out


# ---------------------------------------------------------------------------------------------------------------
# Data transformation fields.
# ---------------------------------------------------------------------------------------------------------------

def upgrade_data_transformation(net: caffe_pb2.NetParameter) -> caffe_pb2.NetParameter:
    """UpgradeNetDataTransformation: move the old transform fields of V1 data layers into transform_param.

    Like Caffe's mutable_*_param() calls, this leaves data_param (or image_data_param / window_data_param)
    and transform_param present on every DATA / IMAGE_DATA / WINDOW_DATA layer, even when they are empty.
    """
    upgraded = _copy(net)
    for layer in upgraded.layers:
        for type_name, param_name in _DATA_LAYER_PARAMS:
            if layer.type != _v1_type_value(type_name):
                continue
            param = getattr(layer, param_name)
            param.SetInParent()
            layer.transform_param.SetInParent()
            for field in _OLD_TRANSFORM_FIELDS:
                if param.HasField(field):
                    setattr(layer.transform_param, field, getattr(param, field))
                    param.ClearField(field)
    return upgraded


# ---------------------------------------------------------------------------------------------------------------
# V1 -> V2.
# ---------------------------------------------------------------------------------------------------------------

def upgrade_v1_to_v2(net: caffe_pb2.NetParameter, *, source: str = "<string>") -> caffe_pb2.NetParameter:
    """UpgradeV1Net: rewrite every ``layers`` entry as a ``layer`` entry. The net's other fields are kept.

    A net that has both ``layer`` and ``layers`` is refused, as in Caffe.
    """
    if len(net.layer) > 0:
        raise SchemaError(
            f"{source}: field 'layers': refusing to upgrade inconsistent NetParameter input; the definition "
            "includes both 'layer' and 'layers' fields. The current format defines 'layer' fields with string "
            "type like layer { type: 'Layer' ... } and not layers { type: LAYER ... }. Manually switch the "
            "definition to 'layer' format to continue.")
    upgraded = _copy(net)
    upgraded.ClearField("layers")
    upgraded.ClearField("layer")
    for v1_layer in net.layers:
        upgraded.layer.add().CopyFrom(upgrade_v1_layer(v1_layer, source=source))
    return upgraded


def upgrade_v1_layer_type(type_value: int, *, layer_name: str = "", source: str = "<string>") -> str:
    """UpgradeV1LayerType: a V1LayerParameter.LayerType value -> the V2 type string (NONE -> "")."""
    try:
        return V1_TO_V2_LAYER_TYPE[caffe_pb2.V1LayerParameter.LayerType.Name(type_value)]
    except (KeyError, ValueError):
        raise SchemaError(f"{_where(source, layer_name)}: field 'type': unknown V1LayerParameter layer type "
                          f"{type_value}") from None


def upgrade_v1_layer(v1_layer: caffe_pb2.V1LayerParameter, *,
                     source: str = "<string>") -> caffe_pb2.LayerParameter:
    """UpgradeV1LayerParameter: one V1 layer -> a new LayerParameter.

    A V0 ``layer`` still inside it is ignored with an UpgradeWarning, as Caffe ignores it with an error log.
    """
    out = caffe_pb2.LayerParameter()
    out.bottom.extend(v1_layer.bottom)
    out.top.extend(v1_layer.top)
    if v1_layer.HasField("name"):
        out.name = v1_layer.name
    for rule in v1_layer.include:
        out.include.add().CopyFrom(rule)
    for rule in v1_layer.exclude:
        out.exclude.add().CopyFrom(rule)
    if v1_layer.HasField("type"):
        out.type = upgrade_v1_layer_type(v1_layer.type, layer_name=v1_layer.name, source=source)
    for blob in v1_layer.blobs:
        out.blobs.add().CopyFrom(blob)

    def param_spec(i: int) -> caffe_pb2.ParamSpec:
        while len(out.param) <= i:
            out.param.add()
        return out.param[i]

    for i, name in enumerate(v1_layer.param):
        param_spec(i).name = name
    for i, mode in enumerate(v1_layer.blob_share_mode):
        mode_name = caffe_pb2.V1LayerParameter.DimCheckMode.Name(mode)
        if mode_name not in ("STRICT", "PERMISSIVE"):
            raise SchemaError(f"{_where(source, v1_layer.name)}: field 'blob_share_mode': unknown "
                              f"blob_share_mode {mode}")
        param_spec(i).share_mode = caffe_pb2.ParamSpec.DimCheckMode.Value(mode_name)
    for i, lr in enumerate(v1_layer.blobs_lr):
        param_spec(i).lr_mult = lr
    for i, decay in enumerate(v1_layer.weight_decay):
        param_spec(i).decay_mult = decay
    out.loss_weight.extend(v1_layer.loss_weight)
    for param_name in _V1_COPIED_MESSAGES:
        if v1_layer.HasField(param_name):
            getattr(out, param_name).CopyFrom(getattr(v1_layer, param_name))
    if v1_layer.HasField("layer"):
        _warn(f"{_where(source, v1_layer.name)}: input NetParameter has V0 layer -- ignoring")
    return out


# ---------------------------------------------------------------------------------------------------------------
# Input header, BatchNorm.
# ---------------------------------------------------------------------------------------------------------------

def upgrade_input(net: caffe_pb2.NetParameter, *, source: str = "<string>") -> caffe_pb2.NetParameter:
    """UpgradeNetInput: turn the ``input`` header into a first layer ``input`` of type ``Input``.

    ``input_shape`` is used when the net has any, one per input. Otherwise ``input_dim`` is read in groups of
    four, one group per input. An ``input`` with neither is a legacy caffemodel's header, and is only
    stripped. The input, input_shape and input_dim fields are always cleared. Caffe reads past the end when
    there are too few shapes or dims; here that raises SchemaError.
    """
    upgraded = _copy(net)
    has_shape = len(upgraded.input_shape) > 0
    has_dim = len(upgraded.input_dim) > 0
    if has_shape or has_dim:
        n_inputs = len(upgraded.input)
        if has_shape and len(upgraded.input_shape) < n_inputs:
            raise SchemaError(f"{source}: field 'input_shape': {n_inputs} inputs but only "
                              f"{len(upgraded.input_shape)} input_shape entries")
        if not has_shape and len(upgraded.input_dim) < 4 * n_inputs:
            raise SchemaError(f"{source}: field 'input_dim': {n_inputs} inputs need {4 * n_inputs} input_dim "
                              f"values (4 per input) but there are {len(upgraded.input_dim)}")
        input_layer = caffe_pb2.LayerParameter()
        input_layer.name = "input"
        input_layer.type = "Input"
        input_layer.input_param.SetInParent()
        for i, blob in enumerate(upgraded.input):
            input_layer.top.append(blob)
            shape = input_layer.input_param.shape.add()
            if has_shape:
                shape.CopyFrom(upgraded.input_shape[i])
            else:
                shape.dim.extend(upgraded.input_dim[4 * i:4 * i + 4])
        layers = [input_layer] + [_copy(layer) for layer in upgraded.layer]
        upgraded.ClearField("layer")
        for layer in layers:
            upgraded.layer.add().CopyFrom(layer)
    upgraded.ClearField("input")
    upgraded.ClearField("input_shape")
    upgraded.ClearField("input_dim")
    return upgraded


def upgrade_batch_norm(net: caffe_pb2.NetParameter) -> caffe_pb2.NetParameter:
    """UpgradeNetBatchNorm: on a BatchNorm layer with exactly 3 params, set lr_mult = decay_mult = 0 on each.

    The params' other fields (name, share_mode) are left as they are.
    """
    upgraded = _copy(net)
    for layer in upgraded.layer:
        if layer.type == "BatchNorm" and len(layer.param) == 3:
            for spec in layer.param:
                spec.lr_mult = 0.0
                spec.decay_mult = 0.0
    return upgraded


# ---------------------------------------------------------------------------------------------------------------
# Solver.
# ---------------------------------------------------------------------------------------------------------------

def solver_needs_type_upgrade(solver: caffe_pb2.SolverParameter) -> bool:
    """SolverNeedsTypeUpgrade: the deprecated ``solver_type`` enum is set."""
    return solver.HasField("solver_type")


def upgrade_solver_as_needed(solver: caffe_pb2.SolverParameter,
                             source: str = "<string>") -> caffe_pb2.SolverParameter:
    """UpgradeSolverAsNeeded: ``solver_type: ADAM`` -> ``type: "Adam"``, etc. Setting both is an error.

    As in Caffe, the nets embedded in the solver are not touched. See :func:`upgrade_solver_net_params`.
    """
    upgraded = _copy(solver)
    if solver_needs_type_upgrade(upgraded):
        if upgraded.HasField("type"):
            raise SchemaError(f"{source}: field 'solver_type': failed to upgrade solver: old solver_type field "
                              "(enum) and new type field (string) cannot be both specified in solver proto "
                              "text.")
        enum_name = caffe_pb2.SolverParameter.SolverType.Name(upgraded.solver_type)
        try:
            upgraded.type = SOLVER_TYPE_NAMES[enum_name]
        except KeyError:
            raise SchemaError(f"{source}: field 'solver_type': unknown SolverParameter solver_type "
                              f"{enum_name}") from None
        upgraded.ClearField("solver_type")
    return upgraded


def upgrade_solver_net_params(solver: caffe_pb2.SolverParameter, source: str = "<string>", *,
                              strict: bool = True) -> caffe_pb2.SolverParameter:
    """Run :func:`upgrade_net_as_needed` on each net written inline in a solver.

    Those are net_param, train_net_param and every test_net_param. This is a caffejax convenience, not a
    Caffe function. Caffe upgrades a net only when it reads it from a file (ReadNetParamsFromTextFileOrDie).
    The Solver builds inline nets with Net(const NetParameter&), which does not upgrade. Does not touch
    solver_type; use :func:`upgrade_solver_as_needed` for that.
    """
    upgraded = _copy(solver)
    for field in ("net_param", "train_net_param"):
        if upgraded.HasField(field):
            getattr(upgraded, field).CopyFrom(
                upgrade_net_as_needed(getattr(upgraded, field), f"{source}:{field}", strict=strict))
    for i, net in enumerate(upgraded.test_net_param):
        net.CopyFrom(upgrade_net_as_needed(net, f"{source}:test_net_param[{i}]", strict=strict))
    return upgraded
