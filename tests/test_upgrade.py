"""Tests for caffejax.frontend.upgrade, following BVLC Caffe's src/caffe/test/test_upgrade_proto.cpp.

The expected protos in tests/fixtures/upgrade/ were copied by hand from the strings in test_upgrade_proto.cpp.
The other expected values here were written by reading upgrade_proto.cpp. None of them came from running
this code.
"""

from __future__ import annotations

import pathlib
import warnings

import pytest
from google.protobuf import text_format

from caffejax.errors import SchemaError
from caffejax.frontend import upgrade
from caffejax.frontend.upgrade import (
    UpgradeWarning,
    net_needs_upgrade,
    upgrade_batch_norm,
    upgrade_data_transformation,
    upgrade_input,
    upgrade_net_as_needed,
    upgrade_solver_as_needed,
    upgrade_solver_net_params,
    upgrade_v0_padding_layers,
    upgrade_v0_to_v1,
    upgrade_v1_layer_type,
    upgrade_v1_to_v2,
)
from caffejax.proto import caffe_pb2

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "upgrade"


def net_from_text(text: str) -> caffe_pb2.NetParameter:
    return text_format.Parse(text, caffe_pb2.NetParameter())


def net_fixture(name: str) -> caffe_pb2.NetParameter:
    return net_from_text((FIXTURES / name).read_text())


def assert_same_proto(actual, expected) -> None:
    # Caffe's tests compare DebugString(); comparing text dumps gives a readable diff on failure.
    assert text_format.MessageToString(actual) == text_format.MessageToString(expected)
    assert actual == expected


# ---- PaddingLayerUpgradeTest ----------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["simple", "twotops", "imagenet"])
def test_padding_layer_upgrade(case):
    source = net_fixture(f"{case}_v0.prototxt")
    expected = net_fixture(f"{case}_v0_padded.prototxt")
    actual = upgrade_v0_padding_layers(source)
    assert_same_proto(actual, expected)
    # Also idempotent, as Caffe's test checks.
    assert_same_proto(upgrade_v0_padding_layers(actual), actual)


def test_padding_layer_into_pool_reading_net_input():
    net = net_from_text("""
        input: 'data'
        layers { layer { name: 'pad' type: 'padding' pad: 3 } bottom: 'data' top: 'padded' }
        layers { layer { name: 'pool' type: 'pool' kernelsize: 2 } bottom: 'padded' top: 'pool' }
    """)
    padded = upgrade_v0_padding_layers(net)
    assert [layer.layer.name for layer in padded.layers] == ["pool"]
    assert list(padded.layers[0].bottom) == ["data"]
    assert padded.layers[0].layer.pad == 3
    v1 = upgrade_v0_to_v1(net)
    assert v1.layers[0].pooling_param.pad == 3
    assert v1.layers[0].pooling_param.kernel_size == 2


def test_padding_layer_feeding_non_conv_is_an_error():
    net = net_from_text("""
        input: 'data'
        layers { layer { name: 'pad' type: 'padding' pad: 1 } bottom: 'data' top: 'padded' }
        layers { layer { name: 'relu' type: 'relu' } bottom: 'padded' top: 'relu' }
    """)
    with pytest.raises(SchemaError, match="relu"):
        upgrade_v0_padding_layers(net)


def test_padding_layer_conv_with_two_bottoms_is_an_error():
    net = net_from_text("""
        input: 'data'
        input: 'other'
        layers { layer { name: 'pad' type: 'padding' pad: 1 } bottom: 'data' top: 'padded' }
        layers { layer { name: 'conv' type: 'conv' } bottom: 'padded' bottom: 'other' top: 'conv' }
    """)
    with pytest.raises(SchemaError, match="conv"):
        upgrade_v0_padding_layers(net)


def test_v0_unknown_bottom_is_an_error():
    net = net_from_text("""
        layers { layer { name: 'relu' type: 'relu' } bottom: 'nowhere' top: 'relu' }
    """)
    with pytest.raises(SchemaError, match="relu.*nowhere"):
        upgrade_net_as_needed(net)


# ---- NetUpgradeTest: V0 -> V1 -> V2 ---------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["simple", "imagenet"])
def test_v0_to_v1_to_v2(case):
    v0 = net_fixture(f"{case}_v0.prototxt")
    v1 = net_fixture(f"{case}_v1.prototxt")
    v2 = net_fixture(f"{case}_v2.prototxt")
    assert_same_proto(upgrade_v0_to_v1(v0), v1)
    assert_same_proto(upgrade_v1_to_v2(v1), v2)
    # The whole pipeline takes V0 straight to V2 (no data, input or BatchNorm step applies to these nets).
    assert_same_proto(upgrade_net_as_needed(v0), v2)
    assert_same_proto(upgrade_net_as_needed(v1), v2)


def test_all_params_v0_to_v1():
    v0 = net_fixture("allparams_v0.prototxt")
    assert_same_proto(upgrade_v0_to_v1(v0), net_fixture("allparams_v1.prototxt"))


def test_all_params_full_upgrade():
    upgraded = upgrade_net_as_needed(net_fixture("allparams_v0.prototxt"))
    assert len(upgraded.layers) == 0
    assert list(upgraded.input) == [] and list(upgraded.input_dim) == [] and len(upgraded.input_shape) == 0
    names_types = [(layer.name, layer.type) for layer in upgraded.layer]
    assert names_types == [
        ("input", "Input"),
        ("data", "Data"),
        ("images", "ImageData"),
        ("window_data", "WindowData"),
        ("hdf5data", "HDF5Data"),
        ("conv1", "Convolution"),
        ("pool1ave", "Pooling"),
        ("pool1stoch", "Pooling"),
        ("concat", "Concat"),
        ("norm1", "LRN"),
        ("fc6", "InnerProduct"),
        ("relu6", "ReLU"),
        ("drop6", "Dropout"),
        ("loss", "InfogainLoss"),
        ("accuracy", "Accuracy"),
        ("bnll", "BNLL"),
        ("euclidean_loss", "EuclideanLoss"),
        ("flatten", "Flatten"),
        ("hdf5_output", "HDF5Output"),
        ("im2col", "Im2col"),
        ("images", "ImageData"),
        ("multinomial_logistic_loss", "MultinomialLogisticLoss"),
        ("sigmoid", "Sigmoid"),
        ("softmax", "Softmax"),
        ("split", "Split"),
        ("tanh", "TanH"),
    ]
    layers = {layer.name: layer for layer in upgraded.layer}
    assert list(layers["input"].top) == ["input_data"]
    assert [list(shape.dim) for shape in layers["input"].input_param.shape] == [[64, 3, 32, 32]]
    data = layers["data"]
    assert data.data_param.source == "/home/jiayq/Data/ILSVRC12/train-leveldb"
    assert data.data_param.batch_size == 256 and data.data_param.rand_skip == 73
    assert data.transform_param.scale == 0.25 and data.transform_param.crop_size == 227
    assert data.transform_param.mirror is True
    assert data.transform_param.mean_file == "/home/jiayq/Data/ILSVRC12/image_mean.binaryproto"
    conv = layers["conv1"]
    assert conv.convolution_param.bias_term is False
    assert list(conv.convolution_param.pad) == [4]
    assert list(conv.convolution_param.kernel_size) == [11]
    assert list(conv.convolution_param.stride) == [4]
    assert [(p.lr_mult, p.decay_mult) for p in conv.param] == [(1, 1), (2, 0)]
    assert layers["pool1stoch"].pooling_param.pool == caffe_pb2.PoolingParameter.STOCHASTIC
    window = layers["window_data"].window_data_param
    assert (window.fg_threshold, window.bg_threshold, window.fg_fraction) == (0.25, 0.75, 0.5)
    assert (window.context_pad, window.crop_mode) == (16, "square")
    assert layers["loss"].infogain_loss_param.source == "/my/infogain/matrix"
    assert layers["hdf5_output"].hdf5_output_param.file_name == "/my/hdf5/output/file"


def test_every_v0_field_is_handled():
    # Each V0LayerParameter field is moved, handled separately, or dropped the way Caffe drops it.
    moved = {field for field, _ in upgrade._V0_FIELD_MOVES}
    known = moved | set(upgrade._V0_FIELDS_HANDLED_APART) | set(upgrade._V0_FIELDS_CAFFE_DROPS)
    assert {f.name for f in caffe_pb2.V0LayerParameter.DESCRIPTOR.fields} == known


def test_every_v1_field_is_handled():
    known = set(upgrade._V1_COPIED_MESSAGES) | set(upgrade._V1_FIELDS_HANDLED_APART)
    assert {f.name for f in caffe_pb2.V1LayerParameter.DESCRIPTOR.fields} == known


def test_unknown_v0_layer_type_is_an_error():
    net = net_from_text("layers { layer { name: 'weird' type: 'frobnicate' } }")
    with pytest.raises(SchemaError, match=r"weird.*'type'.*frobnicate"):
        upgrade_net_as_needed(net)


def test_v0_field_on_wrong_layer_type():
    net = net_from_text("layers { layer { name: 'r' type: 'relu' num_output: 10 } }")
    with pytest.raises(SchemaError, match=r"layer 'r'.*num_output"):
        upgrade_net_as_needed(net)
    # Caffe logs the problem, drops the field and carries on. strict=False does the same.
    with pytest.warns(UpgradeWarning, match="num_output"):
        upgraded = upgrade_net_as_needed(net, strict=False)
    assert text_format.MessageToString(upgraded.layer[0]) == text_format.MessageToString(
        text_format.Parse("name: 'r' type: 'ReLU'", caffe_pb2.LayerParameter()))


def test_v0_net_keeps_only_name_input_and_force_backward():
    net = net_from_text("""
        name: 'n' input: 'x' input_dim: 1 input_dim: 2 input_dim: 3 input_dim: 4 force_backward: true
        state { phase: TEST }
        layers { layer { name: 'r' type: 'relu' } bottom: 'x' top: 'y' }
    """)
    v1 = upgrade_v0_to_v1(net)
    assert v1.name == "n" and list(v1.input) == ["x"] and list(v1.input_dim) == [1, 2, 3, 4]
    assert v1.HasField("force_backward") and v1.force_backward
    assert not v1.HasField("state")


def test_v0_blobs_are_kept_in_order():
    net = caffe_pb2.NetParameter()
    connection = net.layers.add()
    connection.layer.name = "ip"
    connection.layer.type = "innerproduct"
    connection.layer.num_output = 2
    for value in (1.0, 2.0):
        connection.layer.blobs.add().data.extend([value, value])
    restored = caffe_pb2.NetParameter.FromString(net.SerializeToString())
    upgraded = upgrade_net_as_needed(restored, "old.caffemodel")
    assert [list(blob.data) for blob in upgraded.layer[0].blobs] == [[1.0, 1.0], [2.0, 2.0]]


# ---- UpgradeV1LayerType ---------------------------------------------------------------------------------------

# The V2 type for every V1 LayerType, read off the switch in UpgradeV1LayerType.
EXPECTED_V1_TO_V2 = {
    "NONE": "", "ABSVAL": "AbsVal", "ACCURACY": "Accuracy", "ARGMAX": "ArgMax", "BNLL": "BNLL",
    "CONCAT": "Concat", "CONTRASTIVE_LOSS": "ContrastiveLoss", "CONVOLUTION": "Convolution",
    "DECONVOLUTION": "Deconvolution", "DATA": "Data", "DROPOUT": "Dropout", "DUMMY_DATA": "DummyData",
    "EUCLIDEAN_LOSS": "EuclideanLoss", "ELTWISE": "Eltwise", "EXP": "Exp", "FLATTEN": "Flatten",
    "HDF5_DATA": "HDF5Data", "HDF5_OUTPUT": "HDF5Output", "HINGE_LOSS": "HingeLoss", "IM2COL": "Im2col",
    "IMAGE_DATA": "ImageData", "INFOGAIN_LOSS": "InfogainLoss", "INNER_PRODUCT": "InnerProduct", "LRN": "LRN",
    "MEMORY_DATA": "MemoryData", "MULTINOMIAL_LOGISTIC_LOSS": "MultinomialLogisticLoss", "MVN": "MVN",
    "POOLING": "Pooling", "POWER": "Power", "RELU": "ReLU", "SIGMOID": "Sigmoid",
    "SIGMOID_CROSS_ENTROPY_LOSS": "SigmoidCrossEntropyLoss", "SILENCE": "Silence", "SOFTMAX": "Softmax",
    "SOFTMAX_LOSS": "SoftmaxWithLoss", "SPLIT": "Split", "SLICE": "Slice", "TANH": "TanH",
    "WINDOW_DATA": "WindowData", "THRESHOLD": "Threshold",
}

# The layer types BVLC Caffe registers (REGISTER_LAYER_CLASS / REGISTER_LAYER_CREATOR in src/caffe/layers
# and layer_factory.cpp).
CAFFE_REGISTERED_LAYER_TYPES = {
    "AbsVal", "Accuracy", "ArgMax", "BatchNorm", "BatchReindex", "Bias", "BNLL", "Clip", "Concat",
    "ContrastiveLoss", "Convolution", "Crop", "Data", "Deconvolution", "Dropout", "DummyData", "Eltwise", "ELU",
    "Embed", "EuclideanLoss", "Exp", "Filter", "Flatten", "HDF5Data", "HDF5Output", "HingeLoss", "Im2col",
    "ImageData", "InfogainLoss", "InnerProduct", "Input", "Log", "LRN", "LSTM", "LSTMUnit", "MemoryData",
    "MultinomialLogisticLoss", "MVN", "Parameter", "Pooling", "Power", "PReLU", "Python", "Reduction", "ReLU",
    "Reshape", "RNN", "Scale", "Sigmoid", "SigmoidCrossEntropyLoss", "Silence", "Slice", "Softmax",
    "SoftmaxWithLoss", "Split", "SPP", "Swish", "TanH", "Threshold", "Tile", "WindowData",
}


def test_upgrade_v1_layer_type_every_enum_value():
    enum = caffe_pb2.V1LayerParameter.LayerType
    values = caffe_pb2.V1LayerParameter.LayerType.DESCRIPTOR.values
    # Like Caffe's test, every value in [0, ARRAYSIZE) is a valid LayerType.
    assert sorted(v.number for v in values) == list(range(len(values)))
    assert {v.name for v in values} == set(EXPECTED_V1_TO_V2)
    for value in values:
        v2_type = upgrade_v1_layer_type(value.number)
        assert v2_type == EXPECTED_V1_TO_V2[value.name]
        if v2_type == "":
            assert value.number == enum.Value("NONE")
        else:
            assert v2_type in CAFFE_REGISTERED_LAYER_TYPES


def test_upgrade_v1_layer_type_unknown_value():
    with pytest.raises(SchemaError):
        upgrade_v1_layer_type(1000)


# ---- V1 -> V2 details -----------------------------------------------------------------------------------------

def test_v1_param_names_share_mode_lr_and_decay():
    net = net_from_text("""
        layers {
          name: 'ip' type: INNER_PRODUCT bottom: 'x' top: 'y'
          param: 'w' param: 'b'
          blob_share_mode: PERMISSIVE blob_share_mode: STRICT
          blobs_lr: 1 blobs_lr: 2
          weight_decay: 1 weight_decay: 0
          inner_product_param { num_output: 3 }
        }
        layers {
          name: 'ip2' type: INNER_PRODUCT bottom: 'y' top: 'z'
          param: 'shared'
          blobs_lr: 3 blobs_lr: 4 blobs_lr: 5
        }
    """)
    upgraded = upgrade_net_as_needed(net)
    expected = net_from_text("""
        layer {
          name: 'ip' type: 'InnerProduct' bottom: 'x' top: 'y'
          param { name: 'w' share_mode: PERMISSIVE lr_mult: 1 decay_mult: 1 }
          param { name: 'b' share_mode: STRICT lr_mult: 2 decay_mult: 0 }
          inner_product_param { num_output: 3 }
        }
        layer {
          name: 'ip2' type: 'InnerProduct' bottom: 'y' top: 'z'
          param { name: 'shared' lr_mult: 3 }
          param { lr_mult: 4 }
          param { lr_mult: 5 }
        }
    """)
    assert_same_proto(upgraded, expected)


def test_v1_layer_fields_are_copied():
    net = net_from_text("""
        name: 'net' force_backward: true state { phase: TEST stage: 's' }
        layers {
          name: 'loss' type: SOFTMAX_LOSS bottom: 'a' bottom: 'b' top: 'l'
          include { phase: TRAIN } exclude { stage: 'deploy' }
          loss_weight: 2.5
          loss_param { ignore_label: 7 normalize: false }
          softmax_param { axis: 2 }
        }
        layers {
          name: 'd' type: DATA top: 'a' top: 'b'
          data_param { source: 'db' batch_size: 4 backend: LMDB }
          transform_param { scale: 0.5 mirror: true }
        }
        layers { name: 'e' type: ELTWISE eltwise_param { operation: MAX } }
        layers { name: 'dc' type: DECONVOLUTION convolution_param { num_output: 4 kernel_size: 2 } }
        layers { name: 'th' type: THRESHOLD threshold_param { threshold: 0.3 } }
        layers { name: 'dd' type: DUMMY_DATA dummy_data_param { shape { dim: 1 dim: 2 } } }
    """)
    expected = net_from_text("""
        name: 'net' force_backward: true state { phase: TEST stage: 's' }
        layer {
          name: 'loss' type: 'SoftmaxWithLoss' bottom: 'a' bottom: 'b' top: 'l'
          include { phase: TRAIN } exclude { stage: 'deploy' }
          loss_weight: 2.5
          loss_param { ignore_label: 7 normalize: false }
          softmax_param { axis: 2 }
        }
        layer {
          name: 'd' type: 'Data' top: 'a' top: 'b'
          data_param { source: 'db' batch_size: 4 backend: LMDB }
          transform_param { scale: 0.5 mirror: true }
        }
        layer { name: 'e' type: 'Eltwise' eltwise_param { operation: MAX } }
        layer { name: 'dc' type: 'Deconvolution' convolution_param { num_output: 4 kernel_size: 2 } }
        layer { name: 'th' type: 'Threshold' threshold_param { threshold: 0.3 } }
        layer { name: 'dd' type: 'DummyData' dummy_data_param { shape { dim: 1 dim: 2 } } }
    """)
    assert_same_proto(upgrade_net_as_needed(net), expected)


def test_v1_caffemodel_blobs_are_kept_in_order():
    net = caffe_pb2.NetParameter()
    net.name = "trained"
    net.input.append("data")  # a legacy caffemodel's bare input header
    conv = net.layers.add()
    conv.name = "conv1"
    conv.type = caffe_pb2.V1LayerParameter.CONVOLUTION
    conv.bottom.append("data")
    conv.top.append("conv1")
    weights = conv.blobs.add()
    weights.num, weights.channels, weights.height, weights.width = 2, 1, 1, 1
    weights.data.extend([0.5, -0.5])
    bias = conv.blobs.add()
    bias.shape.dim.append(2)
    bias.data.extend([1.0, 2.0])
    relu = net.layers.add()
    relu.name = "relu1"
    relu.type = caffe_pb2.V1LayerParameter.RELU
    restored = caffe_pb2.NetParameter.FromString(net.SerializeToString())

    upgraded = upgrade_net_as_needed(restored, "model.caffemodel")

    assert [(layer.name, layer.type) for layer in upgraded.layer] == [("conv1", "Convolution"), ("relu1", "ReLU")]
    blobs = upgraded.layer[0].blobs
    assert len(blobs) == 2
    assert list(blobs[0].data) == [0.5, -0.5] and blobs[0].num == 2
    assert list(blobs[1].data) == [1.0, 2.0] and list(blobs[1].shape.dim) == [2]
    assert len(upgraded.layer[1].blobs) == 0
    # The bare input (no dims) is stripped, not turned into a layer.
    assert list(upgraded.input) == []


def test_layer_and_layers_together_is_an_error():
    net = net_from_text("""
        layer { name: 'a' type: 'ReLU' }
        layers { name: 'b' type: RELU }
    """)
    with pytest.raises(SchemaError, match="both 'layer' and 'layers'"):
        upgrade_net_as_needed(net)
    with pytest.raises(SchemaError):
        upgrade_v1_to_v2(net)


def test_v1_layer_still_holding_v0_layer_warns():
    layer = caffe_pb2.V1LayerParameter()
    layer.name = "x"
    layer.type = caffe_pb2.V1LayerParameter.RELU
    layer.layer.name = "old"
    with pytest.warns(UpgradeWarning, match="V0 layer"):
        upgraded = upgrade.upgrade_v1_layer(layer)
    assert upgraded.name == "x" and upgraded.type == "ReLU"


# ---- Data transformation --------------------------------------------------------------------------------------

def test_data_transformation_upgrade():
    net = net_from_text("""
        layers {
          name: 'd' type: DATA top: 'a'
          data_param { source: 'db' scale: 0.5 mean_file: 'm.binaryproto' crop_size: 9 mirror: true }
        }
        layers {
          name: 'i' type: IMAGE_DATA top: 'b'
          image_data_param { source: 'list.txt' crop_size: 5 }
        }
        layers {
          name: 'w' type: WINDOW_DATA top: 'c'
          window_data_param { source: 'win.txt' mirror: false }
        }
        layers { name: 'h' type: HDF5_DATA top: 'e' hdf5_data_param { source: 'h5.txt' } }
    """)
    assert upgrade.net_needs_data_upgrade(net)
    expected_v1 = net_from_text("""
        layers {
          name: 'd' type: DATA top: 'a'
          data_param { source: 'db' }
          transform_param { scale: 0.5 mean_file: 'm.binaryproto' crop_size: 9 mirror: true }
        }
        layers {
          name: 'i' type: IMAGE_DATA top: 'b'
          image_data_param { source: 'list.txt' }
          transform_param { crop_size: 5 }
        }
        layers {
          name: 'w' type: WINDOW_DATA top: 'c'
          window_data_param { source: 'win.txt' }
          transform_param { mirror: false }
        }
        layers { name: 'h' type: HDF5_DATA top: 'e' hdf5_data_param { source: 'h5.txt' } }
    """)
    v1 = upgrade_data_transformation(net)
    assert_same_proto(v1, expected_v1)
    assert not upgrade.net_needs_data_upgrade(v1)
    v2 = upgrade_net_as_needed(net)
    assert [layer.type for layer in v2.layer] == ["Data", "ImageData", "WindowData", "HDF5Data"]
    assert v2.layer[0].transform_param.scale == 0.5
    assert not v2.layer[0].data_param.HasField("scale")


def test_data_transformation_marks_params_present_like_caffe():
    # Caffe calls mutable_data_param() and mutable_transform_param() on every DATA layer it visits.
    net = net_from_text("layers { name: 'd' type: DATA top: 'a' }")
    v1 = upgrade_data_transformation(net)
    assert v1.layers[0].HasField("data_param") and v1.layers[0].HasField("transform_param")


# ---- Input header ---------------------------------------------------------------------------------------------

def test_input_dim_groups_of_four():
    net = net_from_text("""
        name: 'n'
        input: 'data' input: 'label'
        input_dim: 10 input_dim: 3 input_dim: 227 input_dim: 227
        input_dim: 10 input_dim: 1 input_dim: 1 input_dim: 1
        layer { name: 'conv' type: 'Convolution' bottom: 'data' top: 'conv' }
        layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'conv' bottom: 'label' }
    """)
    expected = net_from_text("""
        name: 'n'
        layer {
          name: 'input' type: 'Input' top: 'data' top: 'label'
          input_param { shape { dim: 10 dim: 3 dim: 227 dim: 227 } shape { dim: 10 dim: 1 dim: 1 dim: 1 } }
        }
        layer { name: 'conv' type: 'Convolution' bottom: 'data' top: 'conv' }
        layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'conv' bottom: 'label' }
    """)
    assert_same_proto(upgrade_input(net), expected)
    assert_same_proto(upgrade_net_as_needed(net), expected)


def test_input_shape():
    net = net_from_text("""
        input: 'data'
        input_shape { dim: 1 dim: 2 }
        layer { name: 'r' type: 'ReLU' bottom: 'data' top: 'r' }
    """)
    expected = net_from_text("""
        layer { name: 'input' type: 'Input' top: 'data' input_param { shape { dim: 1 dim: 2 } } }
        layer { name: 'r' type: 'ReLU' bottom: 'data' top: 'r' }
    """)
    assert_same_proto(upgrade_net_as_needed(net), expected)


def test_input_shape_wins_over_input_dim():
    net = net_from_text("""
        input: 'data'
        input_shape { dim: 5 }
        input_dim: 1 input_dim: 2 input_dim: 3 input_dim: 4
    """)
    expected = net_from_text(
        "layer { name: 'input' type: 'Input' top: 'data' input_param { shape { dim: 5 } } }")
    assert_same_proto(upgrade_net_as_needed(net), expected)


def test_bare_input_is_stripped():
    net = net_from_text("""
        input: 'data'
        layer { name: 'r' type: 'ReLU' bottom: 'data' top: 'r' }
    """)
    expected = net_from_text("layer { name: 'r' type: 'ReLU' bottom: 'data' top: 'r' }")
    assert_same_proto(upgrade_net_as_needed(net), expected)


def test_too_few_input_dims_is_an_error():
    net = net_from_text("input: 'a' input: 'b' input_dim: 1 input_dim: 2 input_dim: 3 input_dim: 4")
    with pytest.raises(SchemaError, match="input_dim"):
        upgrade_net_as_needed(net)
    net = net_from_text("input: 'a' input: 'b' input_shape { dim: 1 }")
    with pytest.raises(SchemaError, match="input_shape"):
        upgrade_net_as_needed(net)


def test_v1_net_with_input_dims_ends_with_input_layer_first():
    net = net_from_text("""
        input: 'data' input_dim: 1 input_dim: 1 input_dim: 2 input_dim: 2
        layers { name: 'r' type: RELU bottom: 'data' top: 'r' }
    """)
    upgraded = upgrade_net_as_needed(net)
    assert [(layer.name, layer.type) for layer in upgraded.layer] == [("input", "Input"), ("r", "ReLU")]
    assert list(upgraded.layer[0].input_param.shape[0].dim) == [1, 1, 2, 2]


# ---- BatchNorm ------------------------------------------------------------------------------------------------

def test_batch_norm_with_three_params():
    net = net_from_text("""
        layer {
          name: 'bn' type: 'BatchNorm' bottom: 'x' top: 'x'
          param { lr_mult: 1 decay_mult: 1 } param { name: 'shared_var' lr_mult: 1 } param { }
          batch_norm_param { use_global_stats: false }
        }
        layer { name: 'bn2' type: 'BatchNorm' bottom: 'x' top: 'y' param { lr_mult: 1 } param { lr_mult: 1 } }
        layer { name: 'sc' type: 'Scale' bottom: 'y' top: 'y' param { lr_mult: 1 } param { lr_mult: 1 }
                param { lr_mult: 1 } }
    """)
    assert net_needs_upgrade(net)
    expected = net_from_text("""
        layer {
          name: 'bn' type: 'BatchNorm' bottom: 'x' top: 'x'
          param { lr_mult: 0 decay_mult: 0 } param { name: 'shared_var' lr_mult: 0 decay_mult: 0 }
          param { lr_mult: 0 decay_mult: 0 }
          batch_norm_param { use_global_stats: false }
        }
        layer { name: 'bn2' type: 'BatchNorm' bottom: 'x' top: 'y' param { lr_mult: 1 } param { lr_mult: 1 } }
        layer { name: 'sc' type: 'Scale' bottom: 'y' top: 'y' param { lr_mult: 1 } param { lr_mult: 1 }
                param { lr_mult: 1 } }
    """)
    assert_same_proto(upgrade_batch_norm(net), expected)
    assert_same_proto(upgrade_net_as_needed(net), expected)
    # Applying it again changes nothing.
    assert_same_proto(upgrade_net_as_needed(expected), expected)


# ---- What needs upgrading, and not mutating the input -----------------------------------------------------------

def test_net_needs_upgrade():
    assert net_needs_upgrade(net_fixture("simple_v0.prototxt"))
    assert net_needs_upgrade(net_fixture("simple_v1.prototxt"))
    assert net_needs_upgrade(net_from_text("input: 'x'"))
    assert net_needs_upgrade(net_from_text(
        "layers { name: 'd' type: DATA data_param { mirror: true } }"))
    assert not net_needs_upgrade(net_fixture("simple_v2.prototxt"))
    assert not net_needs_upgrade(upgrade_net_as_needed(net_fixture("allparams_v0.prototxt")))


def test_current_net_is_returned_unchanged():
    net = net_fixture("imagenet_v2.prototxt")
    upgraded = upgrade_net_as_needed(net)
    assert_same_proto(upgraded, net)
    assert upgraded is not net


@pytest.mark.parametrize("name", ["simple_v0.prototxt", "allparams_v0.prototxt", "imagenet_v1.prototxt"])
def test_input_is_not_mutated(name):
    net = net_fixture(name)
    before = net.SerializeToString()
    upgrade_net_as_needed(net)
    for step in (upgrade_v0_padding_layers, upgrade_data_transformation, upgrade_input, upgrade_batch_norm):
        step(net)
    if upgrade.net_needs_v0_to_v1_upgrade(net):
        upgrade_v0_to_v1(net)
    else:
        upgrade_v1_to_v2(net)
    assert net.SerializeToString() == before


def test_upgrade_emits_no_warnings_for_clean_nets():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        upgrade_net_as_needed(net_fixture("allparams_v0.prototxt"))
        upgrade_net_as_needed(net_fixture("imagenet_v0.prototxt"))


# ---- Solver ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("enum_name, type_name", [
    ("SGD", "SGD"), ("NESTEROV", "Nesterov"), ("ADAGRAD", "AdaGrad"), ("RMSPROP", "RMSProp"),
    ("ADADELTA", "AdaDelta"), ("ADAM", "Adam"),
])
def test_solver_type_upgrade(enum_name, type_name):
    solver = text_format.Parse(f"base_lr: 0.01 solver_type: {enum_name}", caffe_pb2.SolverParameter())
    upgraded = upgrade_solver_as_needed(solver)
    assert upgraded.HasField("type") and upgraded.type == type_name
    assert not upgraded.HasField("solver_type")
    assert upgraded.base_lr == pytest.approx(0.01)
    assert solver.HasField("solver_type") and not solver.HasField("type")  # input untouched


def test_solver_type_and_solver_type_both_set_is_an_error():
    solver = text_format.Parse("solver_type: ADAM type: 'Adam'", caffe_pb2.SolverParameter())
    with pytest.raises(SchemaError, match="solver_type"):
        upgrade_solver_as_needed(solver)


def test_solver_with_type_string_is_unchanged():
    solver = text_format.Parse("type: 'RMSProp' rms_decay: 0.9", caffe_pb2.SolverParameter())
    assert_same_proto(upgrade_solver_as_needed(solver), solver)
    plain = text_format.Parse("base_lr: 0.1", caffe_pb2.SolverParameter())
    upgraded = upgrade_solver_as_needed(plain)
    assert not upgraded.HasField("type") and upgraded.type == "SGD"


# ---- lenet_consolidated_solver.prototxt (BVLC examples/mnist) -------------------------------------------------

def lenet_solver() -> caffe_pb2.SolverParameter:
    text = (FIXTURES / "lenet_consolidated_solver.prototxt").read_text()
    return text_format.Parse(text, caffe_pb2.SolverParameter())


def check_upgraded_lenet(net: caffe_pb2.NetParameter) -> None:
    assert net.name == "LeNet"
    assert len(net.layers) == 0
    assert [(layer.name, layer.type) for layer in net.layer] == [
        ("mnist", "Data"), ("mnist", "Data"), ("mnist", "Data"),
        ("conv1", "Convolution"), ("pool1", "Pooling"), ("conv2", "Convolution"), ("pool2", "Pooling"),
        ("ip1", "InnerProduct"), ("relu1", "ReLU"), ("ip2", "InnerProduct"),
        ("accuracy", "Accuracy"), ("loss", "SoftmaxWithLoss"),
    ]
    expected_first = text_format.Parse("""
        name: "mnist" type: "Data" top: "data" top: "label"
        data_param { source: "examples/mnist/mnist_train_lmdb" backend: LMDB batch_size: 64 }
        transform_param { scale: 0.00390625 }
        include { phase: TRAIN }
    """, caffe_pb2.LayerParameter())
    assert_same_proto(net.layer[0], expected_first)
    assert [(rule.phase, list(rule.stage)) for rule in net.layer[1].include] == [
        (caffe_pb2.TEST, ["test-on-test-set"])]
    assert [(rule.phase, list(rule.stage)) for rule in net.layer[2].include] == [
        (caffe_pb2.TEST, ["test-on-train-set"])]
    assert net.layer[2].data_param.batch_size == 100
    expected_conv1 = text_format.Parse("""
        name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        param { lr_mult: 1 } param { lr_mult: 2 }
        convolution_param {
          num_output: 20 kernel_size: 5 stride: 1
          weight_filler { type: "xavier" } bias_filler { type: "constant" }
        }
    """, caffe_pb2.LayerParameter())
    assert_same_proto(net.layer[3], expected_conv1)
    for layer in net.layer[3:]:
        if layer.type in ("Convolution", "InnerProduct"):
            assert [(p.HasField("lr_mult"), p.lr_mult, p.HasField("decay_mult")) for p in layer.param] == [
                (True, 1.0, False), (True, 2.0, False)]
        else:
            assert len(layer.param) == 0
    assert net.layer[4].pooling_param.pool == caffe_pb2.PoolingParameter.MAX
    assert net.layer[4].pooling_param.kernel_size == 2 and net.layer[4].pooling_param.stride == 2
    assert net.layer[7].inner_product_param.num_output == 500
    assert net.layer[9].inner_product_param.num_output == 10
    assert list(net.layer[10].bottom) == ["ip2", "label"] and list(net.layer[10].top) == ["accuracy"]
    assert list(net.layer[11].bottom) == ["ip2", "label"] and list(net.layer[11].top) == ["loss"]


def test_lenet_consolidated_solver_inline_net():
    solver = lenet_solver()
    assert solver.HasField("net_param") and len(solver.net_param.layers) == 12
    check_upgraded_lenet(upgrade_net_as_needed(solver.net_param, "lenet_consolidated_solver.prototxt"))


def test_lenet_consolidated_solver_upgrades():
    solver = lenet_solver()
    upgraded = upgrade_solver_as_needed(solver)
    # No solver_type there: the solver upgrade leaves everything, the inline net included, as it was.
    assert_same_proto(upgraded, solver)
    assert not upgraded.HasField("type")
    with_nets = upgrade_solver_net_params(solver)
    check_upgraded_lenet(with_nets.net_param)
    assert [list(state.stage) for state in with_nets.test_state] == [["test-on-test-set"], ["test-on-train-set"]]
    assert list(with_nets.test_iter) == [100, 600]
    assert len(solver.net_param.layers) == 12 and len(solver.net_param.layer) == 0  # input untouched
