"""caffejax.draw: pycaffe's draw_net API; DOT text always, images through Graphviz's dot."""

from __future__ import annotations

import re
import shutil

import pytest

import caffejax
import caffejax.draw as draw
from caffejax.errors import CaffejaxError, SchemaError, UnsupportedError
from caffejax.frontend.prototxt import parse_net_text
from conftest import BUNDLED, MODELS

LENET_TRAIN_TEST = MODELS / "bvlc" / "examples" / "mnist" / "lenet_train_test.prototxt"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed")


@pytest.fixture(scope="module")
def lenet():
    return parse_net_text(str(LENET_TRAIN_TEST), is_path=True)


def node_labels(dot_text: str) -> list[str]:
    return re.findall(r'\[label="([^"]*)"', dot_text)


def test_dot_text_has_every_layer_and_blob(lenet):
    text = draw.get_dot_text(lenet, "LR")
    labels = node_labels(text)
    for layer in lenet.layer:
        assert any(label.startswith(f"{layer.name}\\n(") for label in labels), layer.name
    for blob in {b for layer in lenet.layer for b in list(layer.bottom) + list(layer.top)}:
        assert blob in labels
    assert 'label="conv1\\n(Convolution)\\nkernel size: 5\\nstride: 1\\npad: 0"' in text
    # BVLC master's pooling label: "(Pooling MAX)" (pycaffe before 1.0 wrote "(MAX Pooling)")
    assert 'label="pool1\\n(Pooling MAX)\\nkernel size: 2\\nstride: 2\\npad: 0"' in text
    assert '"layer conv1 (Convolution)" -> "blob conv1" [label="20"]' in text  # edges carry num_output
    assert '"layer mnist (Data)" -> "blob data" [label="Batch 64"]' in text
    assert "rankdir=LR" in text
    vertical = draw.get_dot_text(lenet, "TB")
    assert 'label="conv1 (Convolution) kernel size: 5 stride: 1 pad: 0"' in vertical


def test_phase_keeps_that_phases_layers(lenet):
    train = draw.get_dot_text(lenet, phase=caffejax.TRAIN)
    test = draw.get_dot_text(lenet, phase=caffejax.TEST)
    assert "accuracy\\n(Accuracy)" not in train and "accuracy\\n(Accuracy)" in test
    assert train.count("mnist\\n(Data)") == 1 and "Batch 64" in train and "Batch 100" in test


def test_in_place_layers_are_green(lenet):
    text = draw.get_dot_text(lenet)
    relu = next(line for line in text.splitlines() if line.strip().startswith('"layer relu1'))
    assert draw.NEURON_LAYER_COLOR in relu


@needs_dot
def test_draw_net_to_file_png(tmp_path, lenet):
    out = tmp_path / "lenet.png"
    draw.draw_net_to_file(lenet, str(out), "LR", phase=caffejax.TRAIN)
    assert out.read_bytes().startswith(PNG_MAGIC)
    svg = draw.draw_net(str(BUNDLED / "lenet" / "lenet.prototxt"), "TB", ext="svg").decode()
    assert "<svg" in svg and "conv1" in svg


@needs_dot
def test_record_labels_are_escaped(tmp_path):
    net = caffejax.to_proto(caffejax.layers.ReLU(caffejax.layers.Input(shape=dict(dim=[1]), name="a{b}|<c>")))
    svg = draw.draw_net(net, "LR", "svg").decode()
    assert "a{b}|&lt;c&gt;" in svg


def test_dot_output_needs_no_graphviz(tmp_path, monkeypatch, lenet):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    out = tmp_path / "lenet.dot"
    draw.draw_net_to_file(lenet, str(out))
    assert out.read_text().startswith('digraph "LeNet" {')
    with pytest.raises(UnsupportedError, match="install graphviz"):
        draw.draw_net_to_file(lenet, str(tmp_path / "lenet.png"))


def test_bad_arguments(tmp_path, lenet):
    with pytest.raises(CaffejaxError, match="rankdir"):
        draw.get_dot_text(lenet, "XY")
    with pytest.raises(CaffejaxError, match="extension"):
        draw.draw_net_to_file(lenet, str(tmp_path / "noext"))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # pydot on recent pyparsing
def test_get_pydot_graph(lenet):
    pytest.importorskip("pydot")
    graph = draw.get_pydot_graph(lenet, "LR")
    layer_nodes = [n for n in graph.get_nodes() if n.get_name().startswith('"layer ')]
    assert len(layer_nodes) == len(lenet.layer) - 1  # the two 'mnist' Data layers are one node


def test_display_lrm_shows_the_learning_layers_multipliers(tmp_path):
    """python/draw_net.py --display_lrm: "lr mult: w, b" on Convolution/InnerProduct nodes, unless both are 0."""
    text = ('layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 1 dim: 1 dim: 4 dim: 4 } } }\n'
            'layer { name: "c" type: "Convolution" bottom: "x" top: "c" param { lr_mult: 1 } param { lr_mult: 2 } '
            'convolution_param { num_output: 2 kernel_size: 3 } }\n'
            'layer { name: "f" type: "InnerProduct" bottom: "c" top: "f" param { lr_mult: 0 } param { lr_mult: 0 } '
            'inner_product_param { num_output: 2 } }\n'
            'layer { name: "g" type: "InnerProduct" bottom: "f" top: "g" inner_product_param { num_output: 2 } }\n')
    net = parse_net_text(text, is_path=False)
    assert "lr mult" not in draw.get_dot_text(net)
    shown = draw.get_dot_text(net, display_lrm=True)
    assert "lr mult: 1.0, 2.0" in shown and "lr mult: 1.0, 1.0" in shown and shown.count("lr mult") == 2
    assert draw.get_layer_lr_mult(net.layer[1]) == (1.0, 2.0) and draw.get_layer_lr_mult(net.layer[3]) == (1.0, 1.0)
    with pytest.raises(ValueError, match="Input layers do not have"):
        draw.get_layer_lr_mult(net.layer[0])
    assert draw.choose_color_by_layertype("Pooling") == "#FF9900" and draw.choose_color_by_layertype("X") == "#6495ED"
    assert draw.get_pooling_types_dict() == {0: "MAX", 1: "AVE", 2: "STOCHASTIC"}
    assert draw.get_layer_label(net.layer[1], "TB", display_lrm=True).endswith(' lr mult: 1.0, 2.0"')
    prototxt, out = tmp_path / "net.prototxt", tmp_path / "net.dot"
    prototxt.write_text(text)
    from caffejax.cli import main
    assert main(["draw", str(prototxt), str(out), "--display_lrm"]) == 0
    assert out.read_text().count("lr mult") == 2


def test_pycaffe_label_helpers_return_pycaffe_strings(lenet):
    """pycaffe's get_layer_label returns a pydot node name: quoted, with backslash-n between the lines, and
    get_edge_label '""' when there is no label (pycaffe's values for LeNet's conv1, pool1 and relu1)."""
    conv1, pool1, relu1 = (next(layer for layer in lenet.layer if layer.name == name)
                           for name in ("conv1", "pool1", "relu1"))
    assert draw.get_layer_label(conv1, "LR") == '"conv1\\n(Convolution)\\nkernel size: 5\\nstride: 1\\npad: 0"'
    assert draw.get_layer_label(pool1, "TB") == '"pool1 (Pooling MAX) kernel size: 2 stride: 2 pad: 0"'
    assert draw.get_layer_label(relu1, "LR", display_lrm=True) == '"relu1\\n(ReLU)"'
    assert draw.get_edge_label(conv1) == "20" and draw.get_edge_label(relu1) == '""'


def test_display_lrm_refuses_more_than_two_param_specs():
    """pycaffe's get_layer_lr_mult: "Could not parse the learning rate multiplier" for a third param spec (a
    Convolution has weights and bias only; Caffe refuses the net too)."""
    net = caffejax.to_proto(caffejax.layers.Convolution(caffejax.layers.Input(shape=dict(dim=[1, 1, 4, 4])),
                                                        num_output=1, kernel_size=1, param=[{}, {}, {}]))
    assert "(Convolution)" in draw.get_dot_text(net)
    with pytest.raises(SchemaError, match="'Convolution1'.*3 param specs"):
        draw.get_dot_text(net, display_lrm=True)
    with pytest.raises(ValueError):  # what pycaffe raised
        draw.get_layer_lr_mult(net.layer[1])
