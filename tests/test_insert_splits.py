"""InsertSplits, following BVLC Caffe's src/caffe/test/test_split_layer.cpp (SplitLayerInsertionTest).

The input and expected nets are Caffe's test strings (quotes and concatenation changed by hand). Like
Caffe's RunInsertionTest, each case compares the result with the expected NetParameter and checks that
inserting splits again changes nothing.
"""

from __future__ import annotations

import pytest
from google.protobuf import text_format

from caffejax.errors import GraphError
from caffejax.frontend import insert_splits, load_net_param
from caffejax.proto import caffe_pb2


def net(text: str) -> caffe_pb2.NetParameter:
    return text_format.Parse(text, caffe_pb2.NetParameter())


def run_insertion_test(input_text: str, expected_text: str) -> None:
    actual, expected = insert_splits(net(input_text)), net(expected_text)
    assert text_format.MessageToString(actual) == text_format.MessageToString(expected)
    assert actual == expected
    assert insert_splits(actual) == actual  # idempotence


def test_no_insertion1():
    source = """
        name: 'TestNetwork'
        layer { name: 'data' type: 'Data' top: 'data' top: 'label' }
        layer { name: 'innerprod' type: 'InnerProduct' bottom: 'data' top: 'innerprod' }
        layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'innerprod' bottom: 'label' }
    """
    run_insertion_test(source, source)


def test_no_insertion2():
    # An explicit Split already fans 'data' out: nothing to insert.
    source = """
        name: 'TestNetwork'
        layer { name: 'data' type: 'Data' top: 'data' top: 'label' }
        layer { name: 'data_split' type: 'Split' bottom: 'data' top: 'data_split_0' top: 'data_split_1' }
        layer { name: 'innerprod1' type: 'InnerProduct' bottom: 'data_split_0' top: 'innerprod1' }
        layer { name: 'innerprod2' type: 'InnerProduct' bottom: 'data_split_1' top: 'innerprod2' }
        layer { name: 'loss' type: 'EuclideanLoss' bottom: 'innerprod1' bottom: 'innerprod2' }
    """
    run_insertion_test(source, source)


def test_no_insertion_imagenet():
    # Caffe's CaffeNet train net: every blob is read once (ReLU and Dropout run in place).
    params = "param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 2 decay_mult: 0 }"

    def conv(name, bottom, num_output, extra, bias):
        return (f"layer {{ name: '{name}' type: 'Convolution' convolution_param {{ num_output: {num_output} {extra} "
                f"weight_filler {{ type: 'gaussian' std: 0.01 }} bias_filler {{ type: 'constant' value: {bias} }} }} "
                f"{params} bottom: '{bottom}' top: '{name}' }}\n")

    def fc(name, bottom, num_output, std, bias):
        return (f"layer {{ name: '{name}' type: 'InnerProduct' inner_product_param {{ num_output: {num_output} "
                f"weight_filler {{ type: 'gaussian' std: {std} }} bias_filler {{ type: 'constant' value: {bias} }} }} "
                f"{params} bottom: '{bottom}' top: '{name}' }}\n")

    def inplace(name, type_, blob, body=""):
        return f"layer {{ name: '{name}' type: '{type_}' {body} bottom: '{blob}' top: '{blob}' }}\n"

    def pool(name, bottom):
        return (f"layer {{ name: '{name}' type: 'Pooling' pooling_param {{ pool: MAX kernel_size: 3 stride: 2 }} "
                f"bottom: '{bottom}' top: '{name}' }}\n")

    def lrn(name, bottom):
        return (f"layer {{ name: '{name}' type: 'LRN' lrn_param {{ local_size: 5 alpha: 0.0001 beta: 0.75 }} "
                f"bottom: '{bottom}' top: '{name}' }}\n")

    dropout = "dropout_param { dropout_ratio: 0.5 }"
    source = (
        "name: 'CaffeNet' "
        "layer { name: 'data' type: 'Data' "
        "  data_param { source: '/home/jiayq/Data/ILSVRC12/train-leveldb' batch_size: 256 } "
        "  transform_param { crop_size: 227 mirror: true "
        "    mean_file: '/home/jiayq/Data/ILSVRC12/image_mean.binaryproto' } "
        "  top: 'data' top: 'label' }\n"
        + conv("conv1", "data", 96, "kernel_size: 11 stride: 4", "0.") + inplace("relu1", "ReLU", "conv1")
        + pool("pool1", "conv1") + lrn("norm1", "pool1")
        + conv("conv2", "norm1", 256, "group: 2 kernel_size: 5 pad: 2", "1.") + inplace("relu2", "ReLU", "conv2")
        + pool("pool2", "conv2") + lrn("norm2", "pool2")
        + conv("conv3", "norm2", 384, "kernel_size: 3 pad: 1", "0.") + inplace("relu3", "ReLU", "conv3")
        + conv("conv4", "conv3", 384, "group: 2 kernel_size: 3 pad: 1", "1.") + inplace("relu4", "ReLU", "conv4")
        + conv("conv5", "conv4", 256, "group: 2 kernel_size: 3 pad: 1", "1.") + inplace("relu5", "ReLU", "conv5")
        + pool("pool5", "conv5")
        + fc("fc6", "pool5", 4096, 0.005, "1.") + inplace("relu6", "ReLU", "fc6")
        + inplace("drop6", "Dropout", "fc6", dropout)
        + fc("fc7", "fc6", 4096, 0.005, "1.") + inplace("relu7", "ReLU", "fc7")
        + inplace("drop7", "Dropout", "fc7", dropout)
        + fc("fc8", "fc7", 1000, 0.01, "0")
        + "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'fc8' bottom: 'label' }"
    )
    assert len(net(source).layer) == 24
    run_insertion_test(source, source)


def test_no_insertion_with_in_place():
    source = """
        name: 'TestNetwork'
        layer { name: 'data' type: 'Data' top: 'data' top: 'label' }
        layer { name: 'innerprod' type: 'InnerProduct' bottom: 'data' top: 'innerprod' }
        layer { name: 'relu' type: 'ReLU' bottom: 'innerprod' top: 'innerprod' }
        layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'innerprod' bottom: 'label' }
    """
    run_insertion_test(source, source)


UNSHARED_IP = """
    inner_product_param {{ num_output: 10 bias_term: false weight_filler {{ type: 'gaussian' std: 10 }} }}
    param {{ name: '{param}' }}
"""
DUMMY_DATA = """
    layer {
      name: 'data' type: 'DummyData'
      dummy_data_param { num: 5 channels: 2 height: 3 width: 4 data_filler { type: 'gaussian' std: 0.01 } }
      top: 'data'
    }
"""


def test_loss_insertion():
    # innerproduct1 is read by the loss AND carries loss_weight 2.5: the weight is one more use, so a Split
    # is inserted; it takes the weight on its first top, and the consumer reads the second.
    ip1 = UNSHARED_IP.format(param="unsharedweights1")
    ip2 = UNSHARED_IP.format(param="unsharedweights2")
    source = f"""
        name: 'UnsharedWeightsNetwork'
        force_backward: true
        {DUMMY_DATA}
        layer {{ name: 'innerproduct1' type: 'InnerProduct' {ip1}
                bottom: 'data' top: 'innerproduct1' loss_weight: 2.5 }}
        layer {{ name: 'innerproduct2' type: 'InnerProduct' {ip2} bottom: 'data' top: 'innerproduct2' }}
        layer {{ name: 'loss' type: 'EuclideanLoss' bottom: 'innerproduct1' bottom: 'innerproduct2' }}
    """
    expected = f"""
        name: 'UnsharedWeightsNetwork'
        force_backward: true
        {DUMMY_DATA}
        layer {{ name: 'data_data_0_split' type: 'Split' bottom: 'data'
                top: 'data_data_0_split_0' top: 'data_data_0_split_1' }}
        layer {{ name: 'innerproduct1' type: 'InnerProduct' {ip1}
                bottom: 'data_data_0_split_0' top: 'innerproduct1' }}
        layer {{ name: 'innerproduct1_innerproduct1_0_split' type: 'Split' bottom: 'innerproduct1'
                top: 'innerproduct1_innerproduct1_0_split_0' top: 'innerproduct1_innerproduct1_0_split_1'
                loss_weight: 2.5 loss_weight: 0 }}
        layer {{ name: 'innerproduct2' type: 'InnerProduct' {ip2}
                bottom: 'data_data_0_split_1' top: 'innerproduct2' }}
        layer {{ name: 'loss' type: 'EuclideanLoss'
                bottom: 'innerproduct1_innerproduct1_0_split_1' bottom: 'innerproduct2' }}
    """
    run_insertion_test(source, expected)


def test_insertion():
    # A 3-way split of 'data', and a 2-way split of 'innerprod2' read by both losses.
    source = """
        name: 'TestNetwork'
        layer { name: 'data' type: 'Data' top: 'data' top: 'label' }
        layer { name: 'innerprod1' type: 'InnerProduct' bottom: 'data' top: 'innerprod1' }
        layer { name: 'innerprod2' type: 'InnerProduct' bottom: 'data' top: 'innerprod2' }
        layer { name: 'innerprod3' type: 'InnerProduct' bottom: 'data' top: 'innerprod3' }
        layer { name: 'loss1' type: 'EuclideanLoss' bottom: 'innerprod1' bottom: 'innerprod2' }
        layer { name: 'loss2' type: 'EuclideanLoss' bottom: 'innerprod2' bottom: 'innerprod3' }
    """
    expected = """
        name: 'TestNetwork'
        layer { name: 'data' type: 'Data' top: 'data' top: 'label' }
        layer { name: 'data_data_0_split' type: 'Split' bottom: 'data'
                top: 'data_data_0_split_0' top: 'data_data_0_split_1' top: 'data_data_0_split_2' }
        layer { name: 'innerprod1' type: 'InnerProduct' bottom: 'data_data_0_split_0' top: 'innerprod1' }
        layer { name: 'innerprod2' type: 'InnerProduct' bottom: 'data_data_0_split_1' top: 'innerprod2' }
        layer { name: 'innerprod2_innerprod2_0_split' type: 'Split' bottom: 'innerprod2'
                top: 'innerprod2_innerprod2_0_split_0' top: 'innerprod2_innerprod2_0_split_1' }
        layer { name: 'innerprod3' type: 'InnerProduct' bottom: 'data_data_0_split_2' top: 'innerprod3' }
        layer { name: 'loss1' type: 'EuclideanLoss' bottom: 'innerprod1' bottom: 'innerprod2_innerprod2_0_split_0' }
        layer { name: 'loss2' type: 'EuclideanLoss' bottom: 'innerprod2_innerprod2_0_split_1' bottom: 'innerprod3' }
    """
    run_insertion_test(source, expected)


def test_insertion_two_top():
    # Both tops of 'data' are read twice; the second split is named after top index 1.
    source = """
        name: 'TestNetwork'
        layer { name: 'data' type: 'Data' top: 'data' top: 'label' }
        layer { name: 'innerprod1' type: 'InnerProduct' bottom: 'data' top: 'innerprod1' }
        layer { name: 'innerprod2' type: 'InnerProduct' bottom: 'label' top: 'innerprod2' }
        layer { name: 'innerprod3' type: 'InnerProduct' bottom: 'data' top: 'innerprod3' }
        layer { name: 'innerprod4' type: 'InnerProduct' bottom: 'label' top: 'innerprod4' }
        layer { name: 'loss1' type: 'EuclideanLoss' bottom: 'innerprod1' bottom: 'innerprod3' }
        layer { name: 'loss2' type: 'EuclideanLoss' bottom: 'innerprod2' bottom: 'innerprod4' }
    """
    expected = """
        name: 'TestNetwork'
        layer { name: 'data' type: 'Data' top: 'data' top: 'label' }
        layer { name: 'data_data_0_split' type: 'Split' bottom: 'data'
                top: 'data_data_0_split_0' top: 'data_data_0_split_1' }
        layer { name: 'label_data_1_split' type: 'Split' bottom: 'label'
                top: 'label_data_1_split_0' top: 'label_data_1_split_1' }
        layer { name: 'innerprod1' type: 'InnerProduct' bottom: 'data_data_0_split_0' top: 'innerprod1' }
        layer { name: 'innerprod2' type: 'InnerProduct' bottom: 'label_data_1_split_0' top: 'innerprod2' }
        layer { name: 'innerprod3' type: 'InnerProduct' bottom: 'data_data_0_split_1' top: 'innerprod3' }
        layer { name: 'innerprod4' type: 'InnerProduct' bottom: 'label_data_1_split_1' top: 'innerprod4' }
        layer { name: 'loss1' type: 'EuclideanLoss' bottom: 'innerprod1' bottom: 'innerprod3' }
        layer { name: 'loss2' type: 'EuclideanLoss' bottom: 'innerprod2' bottom: 'innerprod4' }
    """
    run_insertion_test(source, expected)


def test_input_insertion_after_upgrade():
    # Caffe's TestInputInsertion reads a legacy `input:` net; Caffe now upgrades that to an Input layer named
    # 'input' before InsertSplits, which gives the same split names ('data_input_0_split').
    source = load_net_param("""
        name: 'TestNetwork'
        input: 'data' input_dim: 10 input_dim: 3 input_dim: 227 input_dim: 227
        layer { name: 'innerprod1' type: 'InnerProduct' bottom: 'data' top: 'innerprod1' }
        layer { name: 'innerprod2' type: 'InnerProduct' bottom: 'data' top: 'innerprod2' }
        layer { name: 'loss' type: 'EuclideanLoss' bottom: 'innerprod1' bottom: 'innerprod2' }
    """)
    actual = insert_splits(source)
    expected = net("""
        name: 'TestNetwork'
        layer { name: 'input' type: 'Input' top: 'data'
                input_param { shape { dim: 10 dim: 3 dim: 227 dim: 227 } } }
        layer { name: 'data_input_0_split' type: 'Split' bottom: 'data'
                top: 'data_input_0_split_0' top: 'data_input_0_split_1' }
        layer { name: 'innerprod1' type: 'InnerProduct' bottom: 'data_input_0_split_0' top: 'innerprod1' }
        layer { name: 'innerprod2' type: 'InnerProduct' bottom: 'data_input_0_split_1' top: 'innerprod2' }
        layer { name: 'loss' type: 'EuclideanLoss' bottom: 'innerprod1' bottom: 'innerprod2' }
    """)
    assert text_format.MessageToString(actual) == text_format.MessageToString(expected)
    assert insert_splits(actual) == actual


def test_with_in_place():
    # The split of an in-place output is named after the layer that wrote the blob last (relu1).
    source = """
        name: 'TestNetwork'
        layer { name: 'data' type: 'Data' top: 'data' top: 'label' }
        layer { name: 'innerprod1' type: 'InnerProduct' bottom: 'data' top: 'innerprod1' }
        layer { name: 'relu1' type: 'ReLU' bottom: 'innerprod1' top: 'innerprod1' }
        layer { name: 'innerprod2' type: 'InnerProduct' bottom: 'innerprod1' top: 'innerprod2' }
        layer { name: 'loss1' type: 'EuclideanLoss' bottom: 'innerprod1' bottom: 'label' }
        layer { name: 'loss2' type: 'EuclideanLoss' bottom: 'innerprod2' bottom: 'data' }
    """
    expected = """
        name: 'TestNetwork'
        layer { name: 'data' type: 'Data' top: 'data' top: 'label' }
        layer { name: 'data_data_0_split' type: 'Split' bottom: 'data'
                top: 'data_data_0_split_0' top: 'data_data_0_split_1' }
        layer { name: 'innerprod1' type: 'InnerProduct' bottom: 'data_data_0_split_0' top: 'innerprod1' }
        layer { name: 'relu1' type: 'ReLU' bottom: 'innerprod1' top: 'innerprod1' }
        layer { name: 'innerprod1_relu1_0_split' type: 'Split' bottom: 'innerprod1'
                top: 'innerprod1_relu1_0_split_0' top: 'innerprod1_relu1_0_split_1' }
        layer { name: 'innerprod2' type: 'InnerProduct' bottom: 'innerprod1_relu1_0_split_0' top: 'innerprod2' }
        layer { name: 'loss1' type: 'EuclideanLoss' bottom: 'innerprod1_relu1_0_split_1' bottom: 'label' }
        layer { name: 'loss2' type: 'EuclideanLoss' bottom: 'innerprod2' bottom: 'data_data_0_split_1' }
    """
    run_insertion_test(source, expected)


def test_zero_loss_weight_is_not_a_use():
    # Only a nonzero loss_weight counts as a use (insert_splits.cpp), so loss_weight: 0 inserts nothing.
    source = """
        name: 'TestNetwork'
        layer { name: 'data' type: 'Data' top: 'data' }
        layer { name: 'ip' type: 'InnerProduct' bottom: 'data' top: 'ip' loss_weight: 0 }
        layer { name: 'loss' type: 'EuclideanLoss' bottom: 'ip' bottom: 'data' }
    """
    actual = insert_splits(net(source))
    assert [layer.name for layer in actual.layer] == ["data", "data_data_0_split", "ip", "loss"]
    assert list(actual.layer[2].loss_weight) == [0.0]


def test_dangling_bottom_names_layer_and_blob():
    source = net("""
        name: 'TestNetwork'
        layer { name: 'data' type: 'Data' top: 'data' }
        layer { name: 'ip' type: 'InnerProduct' bottom: 'dtaa' top: 'ip' }
    """)
    with pytest.raises(GraphError, match=r"layer 'ip'.*'dtaa'.*bottom index 0"):
        insert_splits(source)


def test_input_insertion_legacy_input_field():
    # Caffe's InsertSplits itself handles the legacy net-level `input:` blobs (producer index -1, named
    # 'input'): their Splits come first, before every layer, and the `input:` fields stay as they are.
    source = """
        name: 'TestNetwork'
        input: 'data' input: 'label' input_dim: 10 input_dim: 3 input_dim: 227 input_dim: 227
        input_dim: 10 input_dim: 1 input_dim: 1 input_dim: 1
        layer { name: 'innerprod1' type: 'InnerProduct' bottom: 'data' top: 'innerprod1' }
        layer { name: 'innerprod2' type: 'InnerProduct' bottom: 'data' top: 'innerprod2' }
        layer { name: 'loss1' type: 'EuclideanLoss' bottom: 'innerprod1' bottom: 'label' }
        layer { name: 'loss2' type: 'EuclideanLoss' bottom: 'innerprod2' bottom: 'label' }
    """
    expected = """
        name: 'TestNetwork'
        input: 'data' input: 'label' input_dim: 10 input_dim: 3 input_dim: 227 input_dim: 227
        input_dim: 10 input_dim: 1 input_dim: 1 input_dim: 1
        layer { name: 'data_input_0_split' type: 'Split' bottom: 'data'
                top: 'data_input_0_split_0' top: 'data_input_0_split_1' }
        layer { name: 'label_input_1_split' type: 'Split' bottom: 'label'
                top: 'label_input_1_split_0' top: 'label_input_1_split_1' }
        layer { name: 'innerprod1' type: 'InnerProduct' bottom: 'data_input_0_split_0' top: 'innerprod1' }
        layer { name: 'innerprod2' type: 'InnerProduct' bottom: 'data_input_0_split_1' top: 'innerprod2' }
        layer { name: 'loss1' type: 'EuclideanLoss' bottom: 'innerprod1' bottom: 'label_input_1_split_0' }
        layer { name: 'loss2' type: 'EuclideanLoss' bottom: 'innerprod2' bottom: 'label_input_1_split_1' }
    """
    run_insertion_test(source, expected)


def test_legacy_input_used_once_and_in_place_gets_no_input_split():
    # A legacy input read once needs no Split; after an in-place layer the blob's producer is that layer.
    source = """
        name: 'TestNetwork'
        input: 'data' input_dim: 1 input_dim: 3 input_dim: 4 input_dim: 4
        layer { name: 'relu' type: 'ReLU' bottom: 'data' top: 'data' }
        layer { name: 'ip1' type: 'InnerProduct' bottom: 'data' top: 'ip1' }
        layer { name: 'ip2' type: 'InnerProduct' bottom: 'data' top: 'ip2' }
    """
    expected = """
        name: 'TestNetwork'
        input: 'data' input_dim: 1 input_dim: 3 input_dim: 4 input_dim: 4
        layer { name: 'relu' type: 'ReLU' bottom: 'data' top: 'data' }
        layer { name: 'data_relu_0_split' type: 'Split' bottom: 'data'
                top: 'data_relu_0_split_0' top: 'data_relu_0_split_1' }
        layer { name: 'ip1' type: 'InnerProduct' bottom: 'data_relu_0_split_0' top: 'ip1' }
        layer { name: 'ip2' type: 'InnerProduct' bottom: 'data_relu_0_split_1' top: 'ip2' }
    """
    run_insertion_test(source, expected)
