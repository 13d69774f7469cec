"""The log a net writes as it is built, against Caffe's: net.cpp's lines of a real BVLC Caffe run of
`caffe time -model examples/mnist/lenet_train_test.prototxt` (TRAIN phase), and Net::Init/FilterNet's rules."""

from __future__ import annotations

import logging
import shutil

import pytest

import caffejax
from caffejax.frontend.prototxt import parse_net_text
from caffejax.proto import caffe_pb2
from conftest import MODELS
from test_data_layers import write_lmdb

# net.cpp's lines in that run's log, in order (the layers' own set-up lines, which caffejax does not write, left
# out: layer_factory's "Creating layer", db_lmdb's "Opened lmdb", data_layer's "output data size").
CAFFE_LENET_TRAIN = """\
The NetState phase (0) differed from the phase (1) specified by a rule in layer mnist
The NetState phase (0) differed from the phase (1) specified by a rule in layer accuracy
Creating Layer mnist
mnist -> data
mnist -> label
Setting up mnist
Top shape: 64 1 28 28 (50176)
Top shape: 64 (64)
Memory required for data: 200960
Creating Layer conv1
conv1 <- data
conv1 -> conv1
Setting up conv1
Top shape: 64 20 24 24 (737280)
Memory required for data: 3150080
Creating Layer pool1
pool1 <- conv1
pool1 -> pool1
Setting up pool1
Top shape: 64 20 12 12 (184320)
Memory required for data: 3887360
Creating Layer conv2
conv2 <- pool1
conv2 -> conv2
Setting up conv2
Top shape: 64 50 8 8 (204800)
Memory required for data: 4706560
Creating Layer pool2
pool2 <- conv2
pool2 -> pool2
Setting up pool2
Top shape: 64 50 4 4 (51200)
Memory required for data: 4911360
Creating Layer ip1
ip1 <- pool2
ip1 -> ip1
Setting up ip1
Top shape: 64 500 (32000)
Memory required for data: 5039360
Creating Layer relu1
relu1 <- ip1
relu1 -> ip1 (in-place)
Setting up relu1
Top shape: 64 500 (32000)
Memory required for data: 5167360
Creating Layer ip2
ip2 <- ip1
ip2 -> ip2
Setting up ip2
Top shape: 64 10 (640)
Memory required for data: 5169920
Creating Layer loss
loss <- ip2
loss <- label
loss -> loss
Setting up loss
Top shape: (1)
    with loss weight 1
Memory required for data: 5169924
loss needs backward computation.
ip2 needs backward computation.
relu1 needs backward computation.
ip1 needs backward computation.
pool2 needs backward computation.
conv2 needs backward computation.
pool1 needs backward computation.
conv1 needs backward computation.
mnist does not need backward computation.
This network produces output loss
Network initialization done.""".splitlines()


def init_messages(caplog, make):
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="caffejax"):
        made = make()
    return made, [record.getMessage() for record in caplog.records]


def test_lenet_logs_what_caffe_logged(tmp_path, monkeypatch, caplog):
    pytest.importorskip("lmdb")
    shutil.copy(MODELS / "bvlc/examples/mnist/lenet_train_test.prototxt", tmp_path / "net.prototxt")
    digit = caffe_pb2.Datum(channels=1, height=28, width=28, data=bytes(784), label=3).SerializeToString()
    (tmp_path / "examples/mnist").mkdir(parents=True)
    write_lmdb(tmp_path / "examples/mnist/mnist_train_lmdb", [digit] * 2)
    monkeypatch.chdir(tmp_path)
    _, messages = init_messages(caplog, lambda: caffejax.Net("net.prototxt", caffejax.TRAIN))
    dump = next(m for m in messages if m.startswith("Initializing net from parameters: \n"))
    assert [m for m in messages if m is not dump] == CAFFE_LENET_TRAIN
    assert messages.index(dump) == 2  # after FilterNet's lines, before the layers', as in Caffe
    # The filtered NetParameter, with the state the net was made for (Caffe's also carried caffe.cpp's empty
    # stage, which caffejax's tool does not add).
    printed = parse_net_text(dump.split("\n", 1)[1])
    assert printed.name == "LeNet" and printed.state.phase == caffejax.TRAIN and printed.state.HasField("level")
    assert [layer.name for layer in printed.layer] == ["mnist", "conv1", "pool1", "conv2", "pool2", "ip1", "relu1",
                                                       "ip2", "loss"]
    assert not any(layer.HasField("phase") for layer in printed.layer)  # Init sets it after printing


def test_rules_backward_and_outputs_are_logged_as_net_init_decides(caplog):
    """FilterNet's line for each rule it finds broken (in its order, up to the rule that decides); the backward
    sweep's verdicts before force_backward, which Caffe logs and then overrides; an anonymous loss top; the
    outputs by name."""
    text = """force_backward: true
layer { name: "in" type: "Input" top: "x" top: "t" input_param { shape { dim: 2 dim: 3 } shape { dim: 2 dim: 2 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" inner_product_param { num_output: 2 } }
layer { name: "ex" type: "ReLU" bottom: "y" top: "y" exclude { stage: "deploy" } exclude { phase: TEST } }
layer { name: "only_test" type: "ReLU" bottom: "y" top: "y" include { phase: TEST } }
layer { name: "lvl" type: "ReLU" bottom: "y" top: "y" include { min_level: 2 } include { stage: "deploy" } }
layer { name: "gone" type: "ReLU" bottom: "y" top: "y" exclude { max_level: 5 } exclude { phase: TEST } }
layer { name: "side" type: "InnerProduct" bottom: "x" top: "z" inner_product_param { num_output: 2 } }
layer { name: "loss" type: "EuclideanLoss" bottom: "y" bottom: "t" }
"""
    net, messages = init_messages(caplog, lambda: caffejax.Net(text, caffejax.TRAIN))
    assert [m for m in messages if not m.startswith("Initializing net")] == [
        "The NetState did not contain stage 'deploy' specified by a rule in layer ex",
        "The NetState phase (0) differed from the phase (1) specified by a rule in layer ex",
        "The NetState phase (0) differed from the phase (1) specified by a rule in layer only_test",
        "The NetState level (0) is above the min_level (2) specified by a rule in layer lvl",
        "The NetState did not contain stage 'deploy' specified by a rule in layer lvl",
        # gone: its first exclude rule holds (level 0 <= 5), so it is dropped without a line
        "Creating Layer in", "in -> x", "in -> t", "Setting up in", "Top shape: 2 3 (6)", "Top shape: 2 2 (4)",
        "Memory required for data: 40",
        # InsertSplits' layer for x, which two layers read
        "Creating Layer x_in_0_split", "x_in_0_split <- x", "x_in_0_split -> x_in_0_split_0",
        "x_in_0_split -> x_in_0_split_1", "Setting up x_in_0_split", "Top shape: 2 3 (6)", "Top shape: 2 3 (6)",
        "Memory required for data: 88",
        "Creating Layer ip", "ip <- x_in_0_split_0", "ip -> y", "Setting up ip", "Top shape: 2 2 (4)",
        "Memory required for data: 104",
        "Creating Layer ex", "ex <- y", "ex -> y (in-place)", "Setting up ex", "Top shape: 2 2 (4)",
        "Memory required for data: 120",
        "Creating Layer side", "side <- x_in_0_split_1", "side -> z", "Setting up side", "Top shape: 2 2 (4)",
        "Memory required for data: 136",
        "Creating Layer loss", "loss <- y", "loss <- t", "loss -> (automatic)", "Setting up loss", "Top shape: (1)",
        "    with loss weight 1", "Memory required for data: 140",
        "loss needs backward computation.", "side does not need backward computation.",
        "ex needs backward computation.", "ip needs backward computation.",
        "x_in_0_split does not need backward computation.", "in does not need backward computation.",
        "This network produces output z", "Network initialization done."]
    assert all(layer.need_backward for layer in net.graph.layers)  # force_backward, after the lines


def test_nothing_is_logged_or_made_when_info_is_not_shown(caplog, monkeypatch):
    from caffejax.runtime import net_init_log

    monkeypatch.setattr(net_init_log, "net_init_lines", lambda *a, **k: pytest.fail("made the lines"))
    with caplog.at_level(logging.WARNING, logger="caffejax"):
        caffejax.Net('layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 1 } } }', caffejax.TEST)
    assert not caplog.records


def test_a_solver_logs_its_set_up_as_caffes_does(tmp_path, caplog):
    """Solver::Init: the parameters first, then the train net's and each test net's lines, then 'Solver
    scaffolding done.'"""
    (tmp_path / "net.prototxt").write_text(
        'layer { name: "d" type: "DummyData" top: "x" dummy_data_param { shape { dim: 2 dim: 3 } } }\n'
        'layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" inner_product_param { num_output: 1 } }\n'
        'layer { name: "loss" type: "Reduction" bottom: "y" top: "loss" loss_weight: 1 }\n')
    (tmp_path / "solver.prototxt").write_text('net: "net.prototxt"\nbase_lr: 0.1\nlr_policy: "fixed"\ntest_iter: 1\n'
                                              'test_interval: 10\n')
    _, messages = init_messages(caplog, lambda: caffejax.SGDSolver(str(tmp_path / "solver.prototxt")))
    steps = [m.split("\n")[0] for m in messages if m.startswith(("Initializing", "Creating", "Network init",
                                                                    "Solver scaffolding"))]
    assert steps == ["Initializing solver from parameters: ", "Creating training net from net file: net.prototxt",
                     "Initializing net from parameters: ", "Creating Layer d", "Creating Layer ip",
                     "Creating Layer loss", "Network initialization done.",
                     "Creating test net (#0) specified by net file: net.prototxt",
                     "Initializing net from parameters: ", "Creating Layer d", "Creating Layer ip",
                     "Creating Layer loss", "Network initialization done.", "Solver scaffolding done."]
    dump = next(m for m in messages if m.startswith("Initializing solver"))
    assert 'base_lr: 0.1' in dump and 'net: "net.prototxt"' in dump


def test_copying_weights_logs_the_files_layers_the_net_lacks(tmp_path, caplog):
    """CopyTrainedLayersFrom: 'Ignoring source layer X' for each layer of the file, in its order, that the net
    has none of (finetuning with a renamed classifier shows it this way), after the net's own lines."""
    full = ('layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 1 dim: 3 } } }\n'
            'layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" inner_product_param { num_output: 2 } }\n'
            'layer { name: "relu" type: "ReLU" bottom: "y" top: "y" }\n'
            'layer { name: "fc8" type: "InnerProduct" bottom: "y" top: "z" inner_product_param { num_output: 4 } }\n')
    caffejax.Net(full, caffejax.TEST).save(str(tmp_path / "w.caffemodel"))
    renamed = full.replace('"fc8"', '"fc8_new"').replace('"relu" type: "ReLU" bottom: "y" top: "y" ', '"relu2" '
                                                                     'type: "ReLU" bottom: "y" top: "y" ')
    net, messages = init_messages(caplog, lambda: caffejax.Net(renamed, str(tmp_path / "w.caffemodel"),
                                                               caffejax.TEST))
    assert [m for m in messages if m.startswith("Ignoring")] == ["Ignoring source layer relu",
                                                                 "Ignoring source layer fc8"]
    assert messages.index("Network initialization done.") < messages.index("Ignoring source layer relu")
    _, messages = init_messages(caplog, lambda: net.copy_from(str(tmp_path / "w.caffemodel")))
    assert messages == ["Ignoring source layer relu", "Ignoring source layer fc8"]


def test_a_weights_file_that_fills_nothing_is_warned_of(tmp_path, caplog):
    """Caffe copies nothing, silently, from a file none of whose layers the net has, or from one with no layers
    at all (bytes of another kind parse as an empty NetParameter). caffejax warns, naming the file and the net;
    a file that fills some of the net's layers (finetuning) gives no warning."""
    net_text = ('name: "small"\nlayer { name: "in" type: "Input" top: "x" input_param { shape { dim: 1 dim: 3 } } }\n'
                'layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" inner_product_param { num_output: 2 } }\n')
    caffejax.Net(net_text, caffejax.TEST).save(str(tmp_path / "w.caffemodel"))
    (tmp_path / "notes.caffemodel").write_bytes(b"x\n")  # field 15 = 10: a valid, empty NetParameter
    renamed = caffejax.Net(net_text.replace('"ip"', '"ip_new"'), caffejax.TEST)
    cases = [(renamed, "w.caffemodel", "has no layer with weights whose name is a layer of this net"),
             (caffejax.Net(net_text, caffejax.TEST), "notes.caffemodel", "has no layers")]
    for net, name, what in cases:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="caffejax"):
            net.copy_from(str(tmp_path / name))
        assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
            f"{tmp_path / name} {what}: no weights were copied into net 'small'"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="caffejax"):
        caffejax.Net(net_text, caffejax.TEST).copy_from(str(tmp_path / "w.caffemodel"))
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
