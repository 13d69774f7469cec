"""Tests for the Caffe protobuf schema (caffejax/proto).

(a) the committed caffe_pb2.py is in sync with caffe.proto;
(b) spot checks of field numbers / defaults / enums against BVLC Caffe master;
(c) text and binary round trips;
(d) wire compatibility with files written by real BVLC Caffe (skipped when the
    shared reference data is not available).
"""

from __future__ import annotations

import glob
import os
import pathlib
import struct

import pytest
from google.protobuf import descriptor_pb2, text_format

from caffejax.proto import caffe_pb2

PROTO_DIR = pathlib.Path(caffe_pb2.__file__).resolve().parent
PROTO_FILE = PROTO_DIR / "caffe.proto"


# ---------------------------------------------------------------------------
# (a) generated code is in sync with the schema


def _normalize(messages):
    """Drop what differs only in spelling between protoc's descriptor set and
    the descriptor embedded by the Python generator: json_name (omitted by the
    gencode) and float defaults (re-printed there with 9 significant digits)."""
    for msg in messages:
        for field in msg.field:
            field.ClearField("json_name")
            if field.type == field.TYPE_FLOAT and field.HasField("default_value"):
                value = struct.unpack("<f", struct.pack("<f", float(field.default_value)))[0]
                field.default_value = repr(value)
            elif field.type == field.TYPE_DOUBLE and field.HasField("default_value"):
                field.default_value = repr(float(field.default_value))
        _normalize(msg.nested_type)


def test_generated_code_matches_proto(tmp_path):
    protoc = pytest.importorskip("grpc_tools.protoc")
    out = tmp_path / "caffe.pb"
    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"--descriptor_set_out={out}",
            str(PROTO_FILE),
        ]
    )
    assert rc == 0, "protoc failed to compile caffe.proto"
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    assert len(fds.file) == 1
    compiled = fds.file[0]

    generated = descriptor_pb2.FileDescriptorProto.FromString(
        caffe_pb2.DESCRIPTOR.serialized_pb
    )
    _normalize(compiled.message_type)
    _normalize(generated.message_type)
    assert compiled == generated, (
        "caffe_pb2.py is stale: run `python -m caffejax.proto.regenerate`"
    )


def test_file_descriptor_basics():
    d = caffe_pb2.DESCRIPTOR
    assert d.package == "caffe"
    assert d.name == "caffe.proto"
    fdp = descriptor_pb2.FileDescriptorProto.FromString(d.serialized_pb)
    assert fdp.syntax in ("", "proto2")


# ---------------------------------------------------------------------------
# (b) spot checks against BVLC master

OPT = descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL
REP = descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED
REQ = descriptor_pb2.FieldDescriptorProto.LABEL_REQUIRED


def _field(msg, name):
    fd = msg.DESCRIPTOR.fields_by_name.get(name)
    assert fd is not None, f"{msg.DESCRIPTOR.name} has no field {name!r}"
    return fd


def _label(fd):
    if fd.is_repeated:
        return REP
    if fd.is_required:
        return REQ
    return OPT


LAYER_FIELDS = {
    "name": 1,
    "type": 2,
    "bottom": 3,
    "top": 4,
    "loss_weight": 5,
    "param": 6,
    "blobs": 7,
    "include": 8,
    "exclude": 9,
    "phase": 10,
    "propagate_down": 11,
    "transform_param": 100,
    "loss_param": 101,
    "accuracy_param": 102,
    "argmax_param": 103,
    "concat_param": 104,
    "contrastive_loss_param": 105,
    "convolution_param": 106,
    "data_param": 107,
    "dropout_param": 108,
    "dummy_data_param": 109,
    "eltwise_param": 110,
    "exp_param": 111,
    "hdf5_data_param": 112,
    "hdf5_output_param": 113,
    "hinge_loss_param": 114,
    "image_data_param": 115,
    "infogain_loss_param": 116,
    "inner_product_param": 117,
    "lrn_param": 118,
    "memory_data_param": 119,
    "mvn_param": 120,
    "pooling_param": 121,
    "power_param": 122,
    "relu_param": 123,
    "sigmoid_param": 124,
    "softmax_param": 125,
    "slice_param": 126,
    "tanh_param": 127,
    "threshold_param": 128,
    "window_data_param": 129,
    "python_param": 130,
    "prelu_param": 131,
    "spp_param": 132,
    "reshape_param": 133,
    "log_param": 134,
    "flatten_param": 135,
    "reduction_param": 136,
    "embed_param": 137,
    "tile_param": 138,
    "batch_norm_param": 139,
    "elu_param": 140,
    "bias_param": 141,
    "scale_param": 142,
    "input_param": 143,
    "crop_param": 144,
    "parameter_param": 145,
    "recurrent_param": 146,
    "swish_param": 147,
    "clip_param": 148,
}


def test_layer_parameter_field_numbers():
    fields = caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name
    got = {name: fd.number for name, fd in fields.items()}
    assert got == LAYER_FIELDS  # exact: no missing and no extra fields
    for name in ("bottom", "top", "loss_weight", "param", "blobs",
                 "propagate_down", "include", "exclude"):
        assert _label(fields[name]) == REP, name


def test_layer_parameter_phase_type():
    fd = _field(caffe_pb2.LayerParameter, "phase")
    assert fd.enum_type.full_name == "caffe.Phase"
    assert caffe_pb2.TRAIN == 0 and caffe_pb2.TEST == 1


def test_net_parameter_fields():
    expected = {
        "name": (1, OPT),
        "layers": (2, REP),
        "input": (3, REP),
        "input_dim": (4, REP),
        "force_backward": (5, OPT),
        "state": (6, OPT),
        "debug_info": (7, OPT),
        "input_shape": (8, REP),
        "layer": (100, REP),
    }
    fields = caffe_pb2.NetParameter.DESCRIPTOR.fields_by_name
    assert {n: (f.number, _label(f)) for n, f in fields.items()} == expected
    assert fields["layers"].message_type.name == "V1LayerParameter"
    assert fields["input_dim"].type == fields["input_dim"].TYPE_INT32
    net = caffe_pb2.NetParameter()
    assert net.force_backward is False and net.debug_info is False


def test_blob_proto():
    fields = caffe_pb2.BlobProto.DESCRIPTOR.fields_by_name
    assert {n: f.number for n, f in fields.items()} == {
        "num": 1, "channels": 2, "height": 3, "width": 4,
        "data": 5, "diff": 6, "shape": 7, "double_data": 8, "double_diff": 9,
    }
    for name in ("data", "diff", "double_data", "double_diff"):
        fd = fields[name]
        assert _label(fd) == REP
        assert fd.GetOptions().packed, name
    assert fields["double_data"].type == fields["double_data"].TYPE_DOUBLE
    assert fields["double_diff"].type == fields["double_diff"].TYPE_DOUBLE
    assert fields["data"].type == fields["data"].TYPE_FLOAT
    assert fields["num"].type == fields["num"].TYPE_INT32
    dim = _field(caffe_pb2.BlobShape, "dim")
    assert dim.number == 1 and dim.type == dim.TYPE_INT64
    assert dim.GetOptions().packed


def test_pooling_round_mode():
    fd = _field(caffe_pb2.PoolingParameter, "round_mode")
    assert fd.number == 13
    assert caffe_pb2.PoolingParameter.CEIL == 0
    assert caffe_pb2.PoolingParameter.FLOOR == 1
    p = caffe_pb2.PoolingParameter()
    assert p.round_mode == caffe_pb2.PoolingParameter.CEIL
    assert p.pool == caffe_pb2.PoolingParameter.MAX
    assert p.stride == 1 and p.pad == 0 and not p.global_pooling
    assert _field(caffe_pb2.PoolingParameter, "global_pooling").number == 12
    # Fork-only field: must not exist in the BVLC schema.
    assert "ceil_mode" not in caffe_pb2.PoolingParameter.DESCRIPTOR.fields_by_name


def test_convolution_parameter():
    c = caffe_pb2.ConvolutionParameter()
    assert c.bias_term is True and c.group == 1 and c.axis == 1
    for name, num in [("num_output", 1), ("bias_term", 2), ("pad", 3),
                      ("kernel_size", 4), ("group", 5), ("stride", 6),
                      ("weight_filler", 7), ("bias_filler", 8), ("pad_h", 9),
                      ("pad_w", 10), ("kernel_h", 11), ("kernel_w", 12),
                      ("stride_h", 13), ("stride_w", 14), ("engine", 15),
                      ("axis", 16), ("force_nd_im2col", 17), ("dilation", 18)]:
        assert _field(caffe_pb2.ConvolutionParameter, name).number == num, name
    for name in ("pad", "kernel_size", "stride", "dilation"):
        fd = _field(caffe_pb2.ConvolutionParameter, name)
        assert _label(fd) == REP and not fd.GetOptions().packed
    # stride_h/stride_w have no explicit default upstream
    assert not _field(caffe_pb2.ConvolutionParameter, "stride_h").has_default_value


def test_v1_layer_type_enum():
    lt = caffe_pb2.V1LayerParameter.LayerType
    expected = {
        "NONE": 0, "ABSVAL": 35, "ACCURACY": 1, "ARGMAX": 30, "BNLL": 2,
        "CONCAT": 3, "CONTRASTIVE_LOSS": 37, "CONVOLUTION": 4, "DATA": 5,
        "DECONVOLUTION": 39, "DROPOUT": 6, "DUMMY_DATA": 32,
        "EUCLIDEAN_LOSS": 7, "ELTWISE": 25, "EXP": 38, "FLATTEN": 8,
        "HDF5_DATA": 9, "HDF5_OUTPUT": 10, "HINGE_LOSS": 28, "IM2COL": 11,
        "IMAGE_DATA": 12, "INFOGAIN_LOSS": 13, "INNER_PRODUCT": 14, "LRN": 15,
        "MEMORY_DATA": 29, "MULTINOMIAL_LOGISTIC_LOSS": 16, "MVN": 34,
        "POOLING": 17, "POWER": 26, "RELU": 18, "SIGMOID": 19,
        "SIGMOID_CROSS_ENTROPY_LOSS": 27, "SILENCE": 36, "SOFTMAX": 20,
        "SOFTMAX_LOSS": 21, "SPLIT": 22, "SLICE": 33, "TANH": 23,
        "WINDOW_DATA": 24, "THRESHOLD": 31,
    }
    assert dict(lt.items()) == expected
    v1 = caffe_pb2.V1LayerParameter.DESCRIPTOR.fields_by_name
    assert v1["layer"].number == 1 and v1["layer"].message_type.name == "V0LayerParameter"
    assert v1["bottom"].number == 2 and v1["top"].number == 3 and v1["name"].number == 4
    assert v1["type"].number == 5 and v1["blobs"].number == 6
    assert v1["blobs_lr"].number == 7 and v1["weight_decay"].number == 8
    assert v1["include"].number == 32 and v1["exclude"].number == 33
    assert v1["loss_weight"].number == 35
    assert v1["param"].number == 1001 and v1["blob_share_mode"].number == 1002
    assert v1["transform_param"].number == 36 and v1["loss_param"].number == 42
    v0 = caffe_pb2.V0LayerParameter.DESCRIPTOR.fields_by_name
    assert v0["hdf5_output_param"].number == 1001 and v0["concat_dim"].number == 65
    assert v0["k"].number == 22 and v0["blobs"].number == 50


def test_solver_parameter():
    s = caffe_pb2.SolverParameter()
    assert s.type == "SGD"
    assert s.solver_type == caffe_pb2.SolverParameter.SGD
    assert s.momentum2 == pytest.approx(0.999)
    assert s.rms_decay == pytest.approx(0.99)
    assert s.delta == pytest.approx(1e-8)
    assert s.regularization_type == "L2"
    assert s.clip_gradients == -1
    assert s.random_seed == -1
    assert s.average_loss == 1 and s.iter_size == 1
    assert s.test_initialization is True and s.snapshot_after_train is True
    assert s.layer_wise_reduce is True
    assert s.solver_mode == caffe_pb2.SolverParameter.GPU
    assert s.snapshot_format == caffe_pb2.SolverParameter.BINARYPROTO
    f = caffe_pb2.SolverParameter.DESCRIPTOR.fields_by_name
    numbers = {
        "train_net": 1, "test_net": 2, "test_iter": 3, "test_interval": 4,
        "base_lr": 5, "display": 6, "max_iter": 7, "lr_policy": 8, "gamma": 9,
        "power": 10, "momentum": 11, "weight_decay": 12, "stepsize": 13,
        "snapshot": 14, "snapshot_prefix": 15, "snapshot_diff": 16,
        "solver_mode": 17, "device_id": 18, "test_compute_loss": 19,
        "random_seed": 20, "train_net_param": 21, "test_net_param": 22,
        "debug_info": 23, "net": 24, "net_param": 25, "train_state": 26,
        "test_state": 27, "snapshot_after_train": 28,
        "regularization_type": 29, "solver_type": 30, "delta": 31,
        "test_initialization": 32, "average_loss": 33, "stepvalue": 34,
        "clip_gradients": 35, "iter_size": 36, "snapshot_format": 37,
        "rms_decay": 38, "momentum2": 39, "type": 40,
        "layer_wise_reduce": 41, "weights": 42,
    }
    assert {n: fd.number for n, fd in f.items()} == numbers
    assert _label(f["weights"]) == REP and _label(f["stepvalue"]) == REP
    st = caffe_pb2.SolverParameter.SolverType
    assert dict(st.items()) == {"SGD": 0, "NESTEROV": 1, "ADAGRAD": 2,
                                "RMSPROP": 3, "ADADELTA": 4, "ADAM": 5}
    assert dict(caffe_pb2.SolverParameter.SolverMode.items()) == {"CPU": 0, "GPU": 1}
    assert dict(caffe_pb2.SolverParameter.SnapshotFormat.items()) == {
        "HDF5": 0, "BINARYPROTO": 1}


def test_solver_state():
    f = caffe_pb2.SolverState.DESCRIPTOR.fields_by_name
    assert {n: fd.number for n, fd in f.items()} == {
        "iter": 1, "learned_net": 2, "history": 3, "current_step": 4}
    assert f["history"].message_type.name == "BlobProto"


def test_net_state_and_rules():
    assert caffe_pb2.NetState().phase == caffe_pb2.TEST
    f = caffe_pb2.NetStateRule.DESCRIPTOR.fields_by_name
    assert {n: fd.number for n, fd in f.items()} == {
        "phase": 1, "min_level": 2, "max_level": 3, "stage": 4, "not_stage": 5}


def test_param_spec_and_loss():
    p = caffe_pb2.ParamSpec()
    assert p.lr_mult == 1.0 and p.decay_mult == 1.0
    assert dict(caffe_pb2.ParamSpec.DimCheckMode.items()) == {"STRICT": 0, "PERMISSIVE": 1}
    assert _field(caffe_pb2.ParamSpec, "share_mode").number == 2
    lp = caffe_pb2.LossParameter()
    assert lp.normalization == caffe_pb2.LossParameter.VALID
    assert dict(caffe_pb2.LossParameter.NormalizationMode.items()) == {
        "FULL": 0, "VALID": 1, "BATCH_SIZE": 2, "NONE": 3}
    assert _field(caffe_pb2.LossParameter, "normalize").number == 2
    assert _field(caffe_pb2.LossParameter, "normalization").number == 3


def test_filler_and_misc_defaults():
    f = caffe_pb2.FillerParameter()
    assert f.type == "constant" and f.std == 1 and f.max == 1 and f.sparse == -1
    assert f.variance_norm == caffe_pb2.FillerParameter.FAN_IN
    assert dict(caffe_pb2.FillerParameter.VarianceNorm.items()) == {
        "FAN_IN": 0, "FAN_OUT": 1, "AVERAGE": 2}
    assert caffe_pb2.BatchNormParameter().moving_average_fraction == pytest.approx(0.999)
    assert caffe_pb2.BatchNormParameter().eps == pytest.approx(1e-5)
    assert caffe_pb2.MVNParameter().eps == pytest.approx(1e-9)
    assert caffe_pb2.LRNParameter().beta == pytest.approx(0.75)
    assert caffe_pb2.LRNParameter().local_size == 5
    assert caffe_pb2.ConcatParameter().axis == 1
    assert _field(caffe_pb2.ConcatParameter, "axis").number == 2
    assert _field(caffe_pb2.SliceParameter, "axis").number == 3
    assert caffe_pb2.CropParameter().axis == 2
    assert caffe_pb2.FlattenParameter().end_axis == -1
    assert caffe_pb2.ReshapeParameter().num_axes == -1
    assert caffe_pb2.ExpParameter().base == -1.0
    assert caffe_pb2.EltwiseParameter().operation == caffe_pb2.EltwiseParameter.SUM
    assert caffe_pb2.EltwiseParameter().stable_prod_grad is True
    assert caffe_pb2.ReductionParameter.SUM == 1  # ReductionOp starts at 1
    assert caffe_pb2.HingeLossParameter.L1 == 1
    assert caffe_pb2.DataParameter().prefetch == 4
    assert caffe_pb2.InfogainLossParameter().axis == 1
    assert caffe_pb2.SwishParameter().beta == 1
    clip_min = _field(caffe_pb2.ClipParameter, "min")
    assert clip_min.number == 1 and _label(clip_min) == REQ
    assert _field(caffe_pb2.ClipParameter, "max").number == 2
    assert _field(caffe_pb2.InnerProductParameter, "transpose").number == 6
    assert _field(caffe_pb2.ScaleParameter, "bias_term").number == 4
    assert _field(caffe_pb2.PythonParameter, "param_str").number == 3
    assert _field(caffe_pb2.Datum, "encoded").number == 7


def test_no_fork_messages():
    names = set(caffe_pb2.DESCRIPTOR.message_types_by_name)
    for fork_only in ("LabelMap", "AnnotatedDatum", "PriorBoxParameter",
                      "DetectionOutputParameter", "UpsampleParameter",
                      "PermuteParameter", "NormalizeParameter"):
        assert fork_only not in names


# ---------------------------------------------------------------------------
# (c) round trips

NET_TXT = """
name: "tiny"
layer {
  name: "data" type: "Input" top: "data"
  input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } }
}
layer {
  name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  param { lr_mult: 1 decay_mult: 1 }
  param { lr_mult: 2 decay_mult: 0 }
  convolution_param {
    num_output: 4 kernel_size: 3 pad: 1 stride: 1
    weight_filler { type: "xavier" }
    bias_filler { type: "constant" value: 0.1 }
  }
}
layer {
  name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param { pool: AVE kernel_size: 2 stride: 2 round_mode: FLOOR }
}
layer {
  name: "loss" type: "SoftmaxWithLoss" bottom: "pool1" bottom: "label"
  top: "loss" loss_weight: 1
  include { phase: TRAIN }
  loss_param { ignore_label: 255 normalization: BATCH_SIZE }
  propagate_down: true propagate_down: false
}
"""


def test_text_and_binary_round_trip():
    net = caffe_pb2.NetParameter()
    text_format.Parse(NET_TXT, net)
    assert net.name == "tiny"
    assert [l.name for l in net.layer] == ["data", "conv1", "pool1", "loss"]
    assert list(net.layer[0].input_param.shape[0].dim) == [2, 3, 8, 8]
    conv = net.layer[1].convolution_param
    assert list(conv.kernel_size) == [3] and conv.num_output == 4
    assert net.layer[2].pooling_param.round_mode == caffe_pb2.PoolingParameter.FLOOR
    assert net.layer[3].include[0].phase == caffe_pb2.TRAIN
    assert list(net.layer[3].propagate_down) == [True, False]

    blob = net.layer[1].blobs.add()
    blob.shape.dim.extend([4, 3, 3, 3])
    blob.data.extend(float(i) for i in range(108))
    blob.double_data.extend([0.5, -1.25])

    data = net.SerializeToString()
    back = caffe_pb2.NetParameter.FromString(data)
    assert back == net
    assert back.SerializeToString() == data
    assert list(back.layer[1].blobs[0].double_data) == [0.5, -1.25]

    again = caffe_pb2.NetParameter()
    text_format.Parse(text_format.MessageToString(back), again)
    assert again == net


def test_legacy_v1_text_parses():
    txt = """
    name: "old"
    input: "data"
    input_dim: 1 input_dim: 3 input_dim: 4 input_dim: 4
    layers {
      name: "ip" type: INNER_PRODUCT bottom: "data" top: "ip"
      blobs_lr: 1 blobs_lr: 2
      inner_product_param { num_output: 10 }
    }
    """
    net = text_format.Parse(txt, caffe_pb2.NetParameter())
    assert net.layers[0].type == caffe_pb2.V1LayerParameter.INNER_PRODUCT
    assert list(net.input_dim) == [1, 3, 4, 4]
    assert caffe_pb2.NetParameter.FromString(net.SerializeToString()) == net


def test_solver_text_round_trip():
    txt = """
    net: "train_val.prototxt"
    base_lr: 0.01 lr_policy: "multistep" stepvalue: 100 stepvalue: 200
    momentum: 0.9 momentum2: 0.995 type: "Adam" solver_mode: CPU
    weights: "a.caffemodel" weights: "b.caffemodel"
    test_iter: 10 test_interval: 50
    """
    s = text_format.Parse(txt, caffe_pb2.SolverParameter())
    assert list(s.stepvalue) == [100, 200] and list(s.weights) == ["a.caffemodel", "b.caffemodel"]
    assert s.solver_mode == caffe_pb2.SolverParameter.CPU
    assert caffe_pb2.SolverParameter.FromString(s.SerializeToString()) == s


def test_unknown_field_rejected_in_text():
    with pytest.raises(text_format.ParseError, match="ceil_mode"):
        text_format.Parse("pooling_param { ceil_mode: false }", caffe_pb2.LayerParameter())


# ---------------------------------------------------------------------------
# (d) wire compatibility with files written by BVLC Caffe


TESTS_DIR = pathlib.Path(__file__).resolve().parent


def _reference_dir():
    """Caffe-written reference files: the in-repo fixtures, else shared/."""
    root = TESTS_DIR.parent
    candidates = [
        TESTS_DIR / "fixtures" / "reference",
        os.environ.get("CAFFEJAX_SHARED") and pathlib.Path(os.environ["CAFFEJAX_SHARED"]) / "reference",
        root / "shared" / "reference",
        root.parent / "shared" / "reference",
        pathlib.Path("/work/shared/reference"),
    ]
    for c in candidates:
        if c and pathlib.Path(c).is_dir():
            return pathlib.Path(c)
    return None


REFERENCE = _reference_dir()
needs_reference = pytest.mark.skipif(REFERENCE is None, reason="reference data not found")


@needs_reference
def test_reference_caffemodels_byte_exact():
    """Caffe-written models decode with no unknown fields and re-encode identically."""
    from google.protobuf import unknown_fields

    def unknown(msg):
        if len(unknown_fields.UnknownFieldSet(msg)):
            return True
        for fd, value in msg.ListFields():
            if fd.message_type is not None:
                values = value if fd.is_repeated else [value]
                if any(unknown(v) for v in values):
                    return True
        return False

    files = sorted(glob.glob(str(REFERENCE / "**" / "*.caffemodel"), recursive=True))
    if not files:
        pytest.skip("no reference caffemodels")
    for path in files:
        raw = pathlib.Path(path).read_bytes()
        net = caffe_pb2.NetParameter.FromString(raw)
        assert not unknown(net), path
        assert net.SerializeToString() == raw, path


@needs_reference
def test_reference_solver_files():
    solvers = sorted(glob.glob(str(REFERENCE / "solvers" / "*_solver.prototxt")))
    states = sorted(glob.glob(str(REFERENCE / "solvers" / "*.solverstate")))
    if not solvers and not states:
        pytest.skip("no reference solver files")
    for path in solvers:
        text_format.Parse(pathlib.Path(path).read_text(), caffe_pb2.SolverParameter())
    for path in states:
        raw = pathlib.Path(path).read_bytes()
        state = caffe_pb2.SolverState.FromString(raw)
        assert state.SerializeToString() == raw, path
        assert len(state.history) > 0


UPGRADE_DIR = TESTS_DIR / "fixtures" / "upgrade"


@pytest.mark.skipif(not UPGRADE_DIR.is_dir(), reason="upgrade fixtures not found")
def test_legacy_upgrade_fixtures_parse():
    files = sorted(UPGRADE_DIR.glob("*.prototxt"))
    if not files:
        pytest.skip("no upgrade fixtures")
    for path in files:
        cls = caffe_pb2.SolverParameter if "solver" in path.name else caffe_pb2.NetParameter
        msg = text_format.Parse(path.read_text(), cls())
        if cls is caffe_pb2.NetParameter:
            assert len(msg.layers) + len(msg.layer) > 0, path
        assert cls.FromString(msg.SerializeToString()) == msg, path
