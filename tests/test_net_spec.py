"""caffejax.NetSpec: pycaffe's net_spec, checked against BVLC's own LeNet prototxt."""

from __future__ import annotations

import numpy as np
import pytest

import caffejax
from caffejax import layers as L, params as P
from caffejax.errors import GraphError, SchemaError
from caffejax.frontend.filter_net import filter_net, make_state
from caffejax.frontend.prototxt import parse_net_text
from caffejax.proto import caffe_pb2
from conftest import BUNDLED, MODELS

LENET_TRAIN_TEST = MODELS / "bvlc" / "examples" / "mnist" / "lenet_train_test.prototxt"


def notebook_lenet(lmdb, batch_size):
    """examples/01-learning-lenet.ipynb's ``lenet`` (the scale there is 1/255; the prototxt's 1/256)."""
    n = caffejax.NetSpec()
    n.data, n.label = L.Data(batch_size=batch_size, backend=P.Data.LMDB, source=lmdb,
                             transform_param=dict(scale=1. / 256), ntop=2)
    n.conv1 = L.Convolution(n.data, kernel_size=5, num_output=20, weight_filler=dict(type='xavier'))
    n.pool1 = L.Pooling(n.conv1, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.conv2 = L.Convolution(n.pool1, kernel_size=5, num_output=50, weight_filler=dict(type='xavier'))
    n.pool2 = L.Pooling(n.conv2, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.fc1 = L.InnerProduct(n.pool2, num_output=500, weight_filler=dict(type='xavier'))
    n.relu1 = L.ReLU(n.fc1, in_place=True)
    n.score = L.InnerProduct(n.relu1, num_output=10, weight_filler=dict(type='xavier'))
    n.loss = L.SoftmaxWithLoss(n.score, n.label)
    return n.to_proto()


def lenet_body(n, data, ip_lr=(dict(lr_mult=1), dict(lr_mult=2))):
    """LeNet as lenet_train_test.prototxt spells it (layer names, lr_mults, fillers)."""
    conv = dict(param=list(ip_lr), weight_filler=dict(type="xavier"), bias_filler=dict(type="constant"))
    n.conv1 = L.Convolution(data, num_output=20, kernel_size=5, stride=1, **conv)
    n.pool1 = L.Pooling(n.conv1, pool=P.Pooling.MAX, kernel_size=2, stride=2)
    n.conv2 = L.Convolution(n.pool1, num_output=50, kernel_size=5, stride=1, **conv)
    n.pool2 = L.Pooling(n.conv2, pool=P.Pooling.MAX, kernel_size=2, stride=2)
    n.ip1 = L.InnerProduct(n.pool2, num_output=500, **conv)
    n.relu1 = L.ReLU(n.ip1, in_place=True)
    n.ip2 = L.InnerProduct(n.ip1, num_output=10, **conv)
    return n.ip2


def reference_lenet(phase):
    """lenet_train_test.prototxt, phase by phase, written with NetSpec."""
    n = caffejax.NetSpec()
    source, batch = ("examples/mnist/mnist_train_lmdb", 64) if phase == caffejax.TRAIN else \
        ("examples/mnist/mnist_test_lmdb", 100)
    n.data, n.label = L.Data(name="mnist", include=dict(phase=phase), transform_param=dict(scale=0.00390625),
                             data_param=dict(source=source, batch_size=batch, backend=P.Data.LMDB), ntop=2)
    ip2 = lenet_body(n, n.data)
    if phase == caffejax.TEST:
        n.accuracy = L.Accuracy(ip2, n.label, include=dict(phase=caffejax.TEST))
    n.loss = L.SoftmaxWithLoss(ip2, n.label)
    proto = n.to_proto()
    proto.name = "LeNet"
    return proto


@pytest.fixture(scope="module")
def reference():
    return parse_net_text(str(LENET_TRAIN_TEST), is_path=True)


def set_fields(msg):
    return {field.name: value for field, value in msg.ListFields()}


def test_notebook_lenet_names_and_coinciding_layers(reference):
    net = notebook_lenet("examples/mnist/mnist_train_lmdb", 64)
    assert [layer.name for layer in net.layer] == ["data", "conv1", "pool1", "conv2", "pool2", "fc1", "relu1",
                                                  "score", "loss"]
    relu = net.layer[6]
    assert list(relu.bottom) == list(relu.top) == ["fc1"]  # in_place writes over the bottom
    assert list(net.layer[0].top) == ["data", "label"]
    theirs = {layer.name: layer for layer in filter_net(reference, make_state(caffejax.TRAIN)).layer}
    shared = [layer for layer in net.layer if layer.name in theirs]
    assert [layer.name for layer in shared] == ["conv1", "pool1", "conv2", "pool2", "relu1", "loss"]
    for layer in shared:
        ref = theirs[layer.name]
        assert layer.type == ref.type
        for name, value in set_fields(layer).items():
            if name.endswith("_param"):  # every field the notebook sets has BVLC's value
                ref_fields = set_fields(getattr(ref, name))
                for key, v in set_fields(value).items():
                    assert ref_fields[key] == v, (layer.name, name, key)
        if layer.name.startswith(("conv", "pool")):
            assert list(layer.bottom) == list(ref.bottom) and list(layer.top) == list(ref.top)
    data = net.layer[0]
    assert data.data_param.batch_size == 64 and data.data_param.backend == caffe_pb2.DataParameter.LMDB
    assert data.transform_param.scale == pytest.approx(1 / 256)


@pytest.mark.parametrize("phase", [caffejax.TRAIN, caffejax.TEST])
def test_regenerates_bvlc_lenet_exactly(reference, phase):
    expected = filter_net(reference, make_state(phase))
    generated = reference_lenet(phase)
    assert [layer.name for layer in generated.layer] == [layer.name for layer in expected.layer]
    for mine, theirs in zip(generated.layer, expected.layer):
        assert mine == theirs, f"layer {mine.name}:\n{mine}\nBVLC:\n{theirs}"


def test_generated_text_parses_back_and_builds():
    n = caffejax.NetSpec()
    n.data = L.Input(shape=dict(dim=[2, 1, 28, 28]))
    ip2 = lenet_body(n, n.data)
    n.prob = L.Softmax(ip2)
    text = str(n.to_proto())
    assert parse_net_text(text) == n.to_proto()
    weights = str(BUNDLED / "lenet" / "lenet_iter_10000.caffemodel")
    ours = caffejax.Net(text, caffejax.TEST, weights=weights)
    bundled = caffejax.Net(str(BUNDLED / "lenet" / "lenet.prototxt"), caffejax.TEST, weights=weights)
    x = np.random.default_rng(0).random((2, 1, 28, 28), dtype=np.float32)
    bundled.blobs["data"].reshape(2, 1, 28, 28)
    np.testing.assert_allclose(ours.forward(data=x)["prob"], bundled.forward(data=x)["prob"], rtol=1e-6,
                               atol=1e-7)


def test_to_proto_generates_names():
    top = L.ReLU(L.Convolution(L.Input(shape=dict(dim=[1, 3, 8, 8])), num_output=4, kernel_size=3), in_place=True)
    net = caffejax.to_proto(top)
    assert [(l.name, l.type, list(l.bottom), list(l.top)) for l in net.layer] == [
        ("Input1", "Input", [], ["Input1"]),
        ("Convolution1", "Convolution", ["Input1"], ["Convolution1"]),
        ("ReLU1", "ReLU", ["Convolution1"], ["Convolution1"]),  # in place: its own top is unnamed
    ]
    assert net.layer[1].convolution_param.kernel_size == [3]  # one value for a repeated field is a list


def test_ntop_zero_multiple_tops_and_generic_params():
    n = caffejax.NetSpec()
    n.a, n.b = L.DummyData(shape=[dict(dim=[2, 3]), dict(dim=[2])], ntop=2)
    silence = L.Silence(n.a, n.b, ntop=0)
    assert isinstance(silence, caffejax.net_spec.Function)
    n.ip = L.InnerProduct(n.a, num_output=2, param=[dict(lr_mult=0, name="w"), dict(lr_mult=0)],
                          loss_weight=0.5, propagate_down=[True])
    n["out"] = L.Eltwise(n.ip, n.ip, operation=P.Eltwise.SUM, coeff=[1.0, 2.0])
    proto = n.to_proto()
    ip = proto.layer[1]
    assert [p.name for p in ip.param] == ["w", ""] and [p.lr_mult for p in ip.param] == [0, 0]
    assert list(ip.loss_weight) == [0.5] and list(ip.propagate_down) == [True]
    eltwise = proto.layer[2]
    assert eltwise.name == "out" and eltwise.eltwise_param.operation == caffe_pb2.EltwiseParameter.SUM
    assert list(eltwise.eltwise_param.coeff) == [1.0, 2.0]
    assert n.keys() == ["a", "b", "ip", "out"] and n["ip"] is n.ip
    n.silence = silence  # a layer without tops is named by its attribute
    assert [(l.name, l.type, list(l.bottom)) for l in n.to_proto().layer][-1] == ("silence", "Silence", ["a", "b"])


def test_params_gives_enum_values():
    assert P.Pooling.MAX == caffe_pb2.PoolingParameter.MAX
    assert P.Data.LMDB == caffe_pb2.DataParameter.LMDB
    with pytest.raises(AttributeError, match="NoSuchParameter"):
        P.NoSuch.X
    with pytest.raises(AttributeError, match="no enum value"):
        P.Pooling.MAXIMUM


def test_bad_arguments_name_the_layer_and_field():
    n = caffejax.NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 2]))
    n.ip = L.InnerProduct(n.data, num_outputs=3)
    with pytest.raises(SchemaError, match=r"layer 'ip' \(type InnerProduct\).*no field 'num_outputs'"):
        n.to_proto()
    n.ip = L.InnerProduct(n.data, num_output="three")
    with pytest.raises(SchemaError, match="num_output"):
        n.to_proto()
    n.ip = L.InnerProduct(n.data, weight_filler="xavier")
    with pytest.raises(SchemaError, match="give a dict"):
        n.to_proto()
    with pytest.raises(TypeError, match="input 0 is not a Top"):
        L.ReLU("data")


def test_an_empty_dict_leaves_a_message_unset_as_in_pycaffe():
    """pycaffe's assign_proto sets nothing for ``filler={}``: the message stays absent, so Caffe's Scale keeps
    its identity default (a present, empty filler would be a constant 0). pycaffe's text for this program:
    scale_param holds bias_term only, and the Dropout has no dropout_param."""
    n = caffejax.NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 2, 4, 4]))
    n.scale = L.Scale(n.data, filler={}, bias_term=True)
    n.drop = L.Dropout(n.scale, dropout_param=dict())
    scale, drop = n.to_proto().layer[1:]
    assert str(scale.scale_param) == "bias_term: true\n" and not scale.scale_param.HasField("filler")
    assert not drop.HasField("dropout_param")


def test_errors_pycaffe_left_bare_are_typed():
    """Programs pycaffe fails on with a bare AttributeError or IndexError raise caffejax's errors, naming what
    is wrong."""
    n = caffejax.NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 2]))
    n.conv = L.Convolution(n.data, kernel_size=dict(h=3))  # a dict for a repeated scalar field
    with pytest.raises(SchemaError, match=r"layer 'conv'.*kernel_size is a repeated scalar field, got a dict"):
        n.to_proto()

    n = caffejax.NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 2]))
    _, second = L.Dropout(n.data, ntop=2, in_place=True)  # in place: its only top is 'data'
    n.relu = L.ReLU(second)
    with pytest.raises(GraphError, match=r"'Dropout1' \(type Dropout\) has 1 top\(s\) \(in place.*top 1"):
        n.to_proto()

    n = caffejax.NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 2]))
    n.pair = L.Slice(n.data, ntop=2)  # a tuple of tops where a top belongs
    with pytest.raises(GraphError, match="NetSpec value 'pair' is a tuple.*assign each top"):
        n.to_proto()
    with pytest.raises(GraphError, match="NetSpec value 'pair' is a tuple"):
        n.update("pair", dict(axis=1))
    with pytest.raises(GraphError, match="to_proto argument 0 is a Function.*ntop=0"):
        caffejax.to_proto(L.Silence(n.data, ntop=0))


def test_fork_layers_as_a_forks_pycaffe_writes_them(isolated_registry):
    """With fork fields registered, NetSpec writes them as SSD's pycaffe does (ssd_pascal.py's multibox head): a
    fork layer's own arguments go to its parameter, P gives the fork's enum values, and the text and the message
    both build (the message converts to caffe_pb2's with the fork fields kept)."""
    from caffejax.frontend.prototxt import as_bvlc_message, fork_param, to_text
    from caffejax.lower import forks

    with pytest.raises(AttributeError, match="no message PriorBoxParameter"):
        P.PriorBox.CENTER_SIZE
    forks.register_all()
    n = caffejax.NetSpec()
    n.data = L.Input(shape=dict(dim=[2, 3, 32, 32]))
    n.conv = L.Convolution(n.data, num_output=8, kernel_size=3, pad=1, stride=2)
    n.prior = L.PriorBox(n.conv, n.data, min_size=8.0, aspect_ratio=2.0, flip=False, variance=[0.1, 0.1, 0.2, 0.2])
    n.loc = L.Flatten(L.Permute(n.conv, order=[0, 2, 3, 1]))
    n.conf = L.Flatten(L.Permute(L.Convolution(n.data, num_output=6, kernel_size=3, pad=1, stride=2),
                                 order=[0, 2, 3, 1]))
    n.det = L.DetectionOutput(n.loc, n.conf, n.prior, include=dict(phase=caffejax.TEST), detection_output_param=dict(
        num_classes=3, nms_param=dict(nms_threshold=0.45, top_k=100), code_type=P.PriorBox.CENTER_SIZE,
        keep_top_k=50, save_output_param=dict(resize_param=dict(resize_mode=P.Resize.WARP))))
    proto = n.to_proto()
    text = str(proto)
    assert "prior_box_param {\n    min_size: 8\n    aspect_ratio: 2\n    flip: false" in text
    assert "permute_param {\n    order: 0" in text and "code_type: CENTER_SIZE" in text and "resize_mode: WARP" in text
    images = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    from_message = caffejax.Net(proto, caffejax.TEST)
    from_text = caffejax.Net(text, caffejax.TEST)
    for name, blobs in from_message.params.items():
        for mine, theirs in zip(blobs, from_text.params[name]):
            theirs.data[...] = mine.data
    np.testing.assert_array_equal(from_message.forward(data=images)["det"], from_text.forward(data=images)["det"])
    bvlc = as_bvlc_message(proto, caffe_pb2.NetParameter)
    assert type(bvlc) is caffe_pb2.NetParameter and "detection_output_param" not in str(bvlc)  # unknown fields
    assert fork_param(bvlc.layer[-1], "detection_output_param").nms_param.top_k == 100
    assert "code_type: CENTER_SIZE" in to_text(bvlc)
