"""FilterNet, following BVLC Caffe's src/caffe/test/test_net.cpp (FilterNetTest and the AllInOneNet tests).

The nets are Caffe's test strings, turned into Python text by hand (quotes and concatenation only). Like
Caffe's RunFilterNetTest, every case filters with the net's own ``state``, compares the result with the
expected NetParameter, and checks that filtering again changes nothing.
"""

from __future__ import annotations

import pytest
from google.protobuf import text_format

from caffejax.errors import SchemaError
from caffejax.frontend import build_graph, filter_net, load_net_param
from caffejax.frontend.filter_net import make_state
from caffejax.proto import caffe_pb2
from conftest import MODELS

TRAIN, TEST = caffe_pb2.TRAIN, caffe_pb2.TEST


def net(text: str) -> caffe_pb2.NetParameter:
    return text_format.Parse(text, caffe_pb2.NetParameter())


def run_filter_net_test(input_text: str, expected_text: str) -> None:
    source, expected = net(input_text), net(expected_text)
    filtered = filter_net(source, source.state)
    assert text_format.MessageToString(filtered) == text_format.MessageToString(expected)
    assert filtered == expected
    assert filter_net(filtered, filtered.state) == filtered  # idempotence


# The three-layer net most FilterNet tests start from; each argument adds lines (rules) to one layer.
def three_layer_net(data: str = "", innerprod: str = "", loss: str = "", state: str = "") -> str:
    return f"""
        {state}
        name: 'TestNetwork'
        layer {{ name: 'data' type: 'Data' top: 'data' top: 'label' {data} }}
        layer {{ name: 'innerprod' type: 'InnerProduct' bottom: 'data' top: 'innerprod' {innerprod} }}
        layer {{ name: 'loss' type: 'SoftmaxWithLoss' bottom: 'innerprod' bottom: 'label' {loss} }}
    """


def test_no_filter():
    run_filter_net_test(three_layer_net(), three_layer_net())


# ---- TestFilterLeNetTrainTest -------------------------------------------------------------------------------

LENET_DATA_TRAIN = """
    layer {
      name: 'mnist' type: 'Data' top: 'data' top: 'label'
      data_param { source: 'mnist-train-leveldb' batch_size: 64 }
      transform_param { scale: 0.00390625 }
      include: { phase: TRAIN }
    }
"""
LENET_DATA_TEST = """
    layer {
      name: 'mnist' type: 'Data' top: 'data' top: 'label'
      data_param { source: 'mnist-test-leveldb' batch_size: 100 }
      transform_param { scale: 0.00390625 }
      include: { phase: TEST }
    }
"""
LENET_BODY = """
    layer {
      name: 'conv1' type: 'Convolution' bottom: 'data' top: 'conv1'
      param { lr_mult: 1 } param { lr_mult: 2 }
      convolution_param {
        num_output: 20 kernel_size: 5 stride: 1
        weight_filler { type: 'xavier' } bias_filler { type: 'constant' }
      }
    }
    layer {
      name: 'ip1' type: 'InnerProduct' bottom: 'conv1' top: 'ip1'
      param { lr_mult: 1 } param { lr_mult: 2 }
      inner_product_param {
        num_output: 10 weight_filler { type: 'xavier' } bias_filler { type: 'constant' }
      }
    }
"""
LENET_ACCURACY = """
    layer {
      name: 'accuracy' type: 'Accuracy' bottom: 'ip1' bottom: 'label' top: 'accuracy'
      include: { phase: TEST }
    }
"""
LENET_LOSS = """
    layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip2' bottom: 'label' top: 'loss' }
"""


def test_filter_lenet_train_test():
    lenet = "name: 'LeNet' " + LENET_DATA_TRAIN + LENET_DATA_TEST + LENET_BODY + LENET_ACCURACY + LENET_LOSS
    train = "name: 'LeNet' " + LENET_DATA_TRAIN + LENET_BODY + LENET_LOSS
    test = "name: 'LeNet' " + LENET_DATA_TEST + LENET_BODY + LENET_ACCURACY + LENET_LOSS
    run_filter_net_test("state: { phase: TRAIN } " + lenet, train + " state: { phase: TRAIN } ")
    run_filter_net_test("state: { phase: TEST } " + lenet, test + " state: { phase: TEST } ")


@pytest.mark.parametrize("phase, expected", [
    (TRAIN, ["mnist", "conv1", "pool1", "conv2", "pool2", "ip1", "relu1", "ip2", "loss"]),
    (TEST, ["mnist", "conv1", "pool1", "conv2", "pool2", "ip1", "relu1", "ip2", "accuracy", "loss"]),
])
def test_filter_lenet_train_test_file(phase, expected):
    lenet = load_net_param(MODELS / "bvlc/examples/mnist/lenet_train_test.prototxt")
    filtered = filter_net(lenet, make_state(phase))
    assert [layer.name for layer in filtered.layer] == expected
    source = filtered.layer[0].data_param.source
    assert source.endswith("mnist_train_lmdb" if phase == TRAIN else "mnist_test_lmdb")


# ---- stages ---------------------------------------------------------------------------------------------------

def test_filter_out_by_stage():
    run_filter_net_test(
        three_layer_net(data="include: { stage: 'mystage' }"),
        """
        name: 'TestNetwork'
        layer { name: 'innerprod' type: 'InnerProduct' bottom: 'data' top: 'innerprod' }
        layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'innerprod' bottom: 'label' }
        """)


NO_INNERPROD = """
    name: 'TestNetwork'
    layer { name: 'data' type: 'Data' top: 'data' top: 'label' }
    layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'innerprod' bottom: 'label' }
"""


def test_filter_out_by_stage2():
    run_filter_net_test(three_layer_net(innerprod="include: { stage: 'mystage' }"), NO_INNERPROD)


def test_filter_in_by_stage():
    source = three_layer_net(state="state: { stage: 'mystage' }", innerprod="include: { stage: 'mystage' }")
    run_filter_net_test(source, source)


def test_filter_in_by_stage2():
    source = three_layer_net(innerprod="exclude: { stage: 'mystage' }")
    run_filter_net_test(source, source)


def test_filter_out_by_multiple_stage():
    run_filter_net_test(
        three_layer_net(state="state: { stage: 'mystage' }",
                     innerprod="include: { stage: 'mystage' stage: 'myotherstage' }",
                     loss="include: { stage: 'mystage' }"),
        """
        state: { stage: 'mystage' }
        name: 'TestNetwork'
        layer { name: 'data' type: 'Data' top: 'data' top: 'label' }
        layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'innerprod' bottom: 'label'
                include: { stage: 'mystage' } }
        """)


def test_filter_in_by_multiple_stage():
    source = three_layer_net(state="state: { stage: 'mystage' }",
                          innerprod="include: { stage: 'myotherstage' } include: { stage: 'mystage' }",
                          loss="include: { stage: 'mystage' }")
    run_filter_net_test(source, source)


def test_filter_in_by_multiple_stage2():
    source = three_layer_net(state="state: { stage: 'mystage' stage: 'myotherstage' }",
                          innerprod="include: { stage: 'mystage' stage: 'myotherstage' }",
                          loss="include: { stage: 'mystage' }")
    run_filter_net_test(source, source)


def test_filter_in_by_not_stage():
    source = three_layer_net(state="state: { stage: 'mystage' }",
                          innerprod="include: { not_stage: 'myotherstage' }",
                          loss="include: { not_stage: 'myotherstage' }")
    run_filter_net_test(source, source)


def test_filter_out_by_not_stage():
    run_filter_net_test(
        three_layer_net(state="state: { stage: 'mystage' }",
                     innerprod="include: { not_stage: 'mystage' }",
                     loss="include: { not_stage: 'mystage' }"),
        """
        state: { stage: 'mystage' }
        name: 'TestNetwork'
        layer { name: 'data' type: 'Data' top: 'data' top: 'label' }
        """)


# ---- levels ---------------------------------------------------------------------------------------------------

def test_filter_out_by_min_level():
    run_filter_net_test(three_layer_net(innerprod="include: { min_level: 3 }"), NO_INNERPROD)


def test_filter_out_by_max_level():
    run_filter_net_test(three_layer_net(innerprod="include: { max_level: -3 }"), NO_INNERPROD)


@pytest.mark.parametrize("state, rule", [
    ("", "include: { min_level: 0 }"),
    ("state: { level: 7 }", "include: { min_level: 3 }"),
    ("", "include: { max_level: 0 }"),
    ("state: { level: -7 }", "include: { max_level: -3 }"),
], ids=["min_level", "min_level2", "max_level", "max_level2"])
def test_filter_in_by_level(state, rule):
    source = three_layer_net(state=state, innerprod=rule)
    run_filter_net_test(source, source)


# ---- several rules --------------------------------------------------------------------------------------------

def test_filter_in_out_by_include_multi_rule():
    body = dict(innerprod="include: { min_level: 2  phase: TRAIN }", loss="include: { min_level: 2  phase: TEST }")
    train_state, test_state = "state: { level: 4  phase: TRAIN }", "state: { level: 4  phase: TEST }"
    run_filter_net_test(
        three_layer_net(state=train_state, **body),
        f"""
        {train_state}
        name: 'TestNetwork'
        layer {{ name: 'data' type: 'Data' top: 'data' top: 'label' }}
        layer {{ name: 'innerprod' type: 'InnerProduct' bottom: 'data' top: 'innerprod'
                include: {{ min_level: 2  phase: TRAIN }} }}
        """)
    run_filter_net_test(
        three_layer_net(state=test_state, **body),
        f"""
        {test_state}
        name: 'TestNetwork'
        layer {{ name: 'data' type: 'Data' top: 'data' top: 'label' }}
        layer {{ name: 'loss' type: 'SoftmaxWithLoss' bottom: 'innerprod' bottom: 'label'
                include: {{ min_level: 2  phase: TEST }} }}
        """)


def test_filter_in_by_include_multi_rule():
    body = dict(innerprod="include: { min_level: 2  phase: TRAIN } include: { phase: TEST }",
                loss="include: { min_level: 2  phase: TEST } include: { phase: TRAIN }")
    for state in ("state: { level: 2  phase: TRAIN }", "state: { level: 2  phase: TEST }"):
        source = three_layer_net(state=state, **body)
        run_filter_net_test(source, source)


def test_filter_in_out_by_exclude_multi_rule():
    body = dict(innerprod="exclude: { min_level: 2  phase: TRAIN }", loss="exclude: { min_level: 2  phase: TEST }")
    train_state, test_state = "state: { level: 4  phase: TRAIN }", "state: { level: 4  phase: TEST }"
    run_filter_net_test(
        three_layer_net(state=train_state, **body),
        f"""
        {train_state}
        name: 'TestNetwork'
        layer {{ name: 'data' type: 'Data' top: 'data' top: 'label' }}
        layer {{ name: 'loss' type: 'SoftmaxWithLoss' bottom: 'innerprod' bottom: 'label'
                exclude: {{ min_level: 2  phase: TEST }} }}
        """)
    run_filter_net_test(
        three_layer_net(state=test_state, **body),
        f"""
        {test_state}
        name: 'TestNetwork'
        layer {{ name: 'data' type: 'Data' top: 'data' top: 'label' }}
        layer {{ name: 'innerprod' type: 'InnerProduct' bottom: 'data' top: 'innerprod'
                exclude: {{ min_level: 2  phase: TRAIN }} }}
        """)


def test_include_and_exclude_on_one_layer_is_an_error():
    source = net(three_layer_net(innerprod="include: { phase: TRAIN } exclude: { stage: 'x' }"))
    with pytest.raises(SchemaError, match="'innerprod'.*include.*exclude"):
        filter_net(source, source.state)


def test_default_state_is_test_phase_level_zero():
    # NetState's phase defaults to TEST: a phase-TEST rule matches a net that sets no state at all.
    source = net(three_layer_net(innerprod="include: { phase: TEST max_level: 0 min_level: 0 }"))
    assert [layer.name for layer in filter_net(source, source.state).layer] == ["data", "innerprod", "loss"]


# ---- AllInOneNet: one prototxt for train, val and deploy, chosen by phase and stage -----------------------------

ALL_IN_ONE = """
    name: 'All-in-one Network'
    layer {
      name: 'train-data' type: 'DummyData' top: 'data' top: 'label'
      dummy_data_param { shape { dim: 1 dim: 10 } shape { dim: 1 dim: 1 } }
      include { phase: TRAIN stage: 'train' }
    }
    layer {
      name: 'val-data' type: 'DummyData' top: 'data' top: 'label'
      dummy_data_param { shape { dim: 1 dim: 10 } shape { dim: 1 dim: 1 } }
      include { phase: TEST stage: 'val' }
    }
    layer {
      name: 'deploy-data' type: 'Input' top: 'data'
      input_param { shape { dim: 1 dim: 10 } }
      include { phase: TEST stage: 'deploy' }
    }
    layer {
      name: 'ip' type: 'InnerProduct' bottom: 'data' top: 'ip'
      inner_product_param { num_output: 2 }
    }
    layer {
      name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss'
      include { phase: TRAIN stage: 'train' }
      include { phase: TEST stage: 'val' }
    }
"""


@pytest.mark.parametrize("phase, stage, expected", [
    (TRAIN, "train", ["train-data", "ip", "loss"]),
    (TEST, "val", ["val-data", "ip", "loss"]),
    (TEST, "deploy", ["deploy-data", "ip"]),
])
def test_all_in_one_net(phase, stage, expected):
    # Caffe's test builds the Net (Net(file, phase, level, stages)); so do we, which also shows each
    # selection is a well-formed net.
    graph = build_graph(net(ALL_IN_ONE), phase, 0, (stage,))
    assert [layer.name for layer in graph.layers] == expected
    assert graph.stages == (stage,)
    assert graph.blob_shape("ip") == (1, 2)
