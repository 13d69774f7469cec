"""Every published prototxt under tests/fixtures/models builds its IR in TRAIN and TEST (build_graph only).

Deploy nets (fed by Input) must come out with every blob shape known; nets whose data layers read sources
(LMDB, image lists, HDF5 lists) build with unknown shapes exactly below those layers; nets with Python
layers are refused with an error naming the module and class. A few well-known blob shapes of the reference
models are checked against the values their papers and Caffe's logs give.
"""

from __future__ import annotations

import math

import pytest

from caffejax.errors import UnsupportedError
from caffejax.frontend import build_graph, load_net_param
from caffejax.frontend.build import MAX_BLOB_ELEMENTS
from caffejax.proto import caffe_pb2
from conftest import MODELS

TRAIN, TEST = caffe_pb2.TRAIN, caffe_pb2.TEST
MODEL_FILES = sorted(str(p.relative_to(MODELS)) for p in MODELS.rglob("*.prototxt") if "solver" not in p.name)

# Layers whose tops come from a source file: their shapes are unknown until the source is read.
SOURCE_LAYER_TYPES = {"Data", "ImageData", "HDF5Data", "WindowData"}

# Nets holding Python layers: (layer, module, class) named by the UnsupportedError, in both phases.
PYTHON_LAYER_NETS = {
    "bvlc/examples/pycaffe/linreg.prototxt": ("loss", "pyloss", "EuclideanLossLayer"),
    "fcn/siftflow-fcn8s/trainval.prototxt": ("data", "siftflow_layers", "SIFTFlowSegDataLayer"),
    "fcn/voc-fcn32s/val.prototxt": ("data", "voc_layers", "VOCSegDataLayer"),
    "fcn/voc-fcn8s/train.prototxt": ("data", "voc_layers", "SBDDSegDataLayer"),
    "fcn/voc-fcn8s/val.prototxt": ("data", "voc_layers", "VOCSegDataLayer"),
}

# The NetState stages Caffe's solver gives a phase (mnist_autoencoder_solver.prototxt's test_state).
STAGES = {("bvlc/examples/mnist/mnist_autoencoder.prototxt", TEST): ("test-on-test",)}


def test_model_files_are_found():
    assert len(MODEL_FILES) >= 50
    assert set(PYTHON_LAYER_NETS) <= set(MODEL_FILES)


@pytest.mark.parametrize("phase", [TRAIN, TEST], ids=["TRAIN", "TEST"])
@pytest.mark.parametrize("path", MODEL_FILES)
def test_model_builds(path, phase):
    net = load_net_param(MODELS / path)
    stages = STAGES.get((path, phase), ())
    if path in PYTHON_LAYER_NETS:
        layer, module, cls = PYTHON_LAYER_NETS[path]
        with pytest.raises(UnsupportedError, match=rf"layer '{layer}' \(type Python\).*'{module}'.*'{cls}'"):
            build_graph(net, phase, stages=stages)
        return
    g = build_graph(net, phase, stages=stages)
    assert g.layers and g.stages == stages
    sources = [layer for layer in g.layers if layer.type in SOURCE_LAYER_TYPES]
    if sources:
        check_unknown_exactly_below_sources(g)
    else:
        check_every_shape_known(g)


def check_every_shape_known(g) -> None:
    for value, shape in g.value_shapes.items():
        assert shape is not None, f"value '{value}' has no shape"
        assert all(isinstance(d, int) and d >= 1 for d in shape), f"value '{value}': {shape}"
        assert math.prod(shape) <= MAX_BLOB_ELEMENTS
    for slot in g.param_slots:
        assert slot.shape is not None and all(d >= 1 for d in slot.shape), slot


def check_unknown_exactly_below_sources(g) -> None:
    """Source layers' tops are unknown; a layer's tops are unknown iff one of its bottoms is."""
    for layer in g.layers:
        tops = [g.value_shapes[v] for v in layer.top_values]
        if layer.type in SOURCE_LAYER_TYPES:
            assert all(t is None for t in tops), layer.name
            continue
        if layer.is_input:  # Input / MemoryData declare their shapes
            assert all(t is not None for t in tops), layer.name
            continue
        below_unknown = any(g.value_shapes[v] is None for v in layer.bottom_values)
        assert all((t is None) == below_unknown for t in tops), (layer.name, tops)
        if not below_unknown:
            assert all(slot.shape is not None for slot in layer.params), layer.name


def test_autoencoder_test_phase_needs_a_stage():
    # Without the solver's test_state stage, both TEST data layers are filtered out, as in Caffe.
    from caffejax.errors import GraphError

    net = load_net_param(MODELS / "bvlc/examples/mnist/mnist_autoencoder.prototxt")
    with pytest.raises(GraphError, match=r"unknown bottom blob 'data'"):
        build_graph(net, TEST)
    for stage, source in (("test-on-train", "mnist_train_lmdb"), ("test-on-test", "mnist_test_lmdb")):
        g = build_graph(net, TEST, stages=(stage,))
        assert g.layers[0].proto.data_param.source.endswith(source)


@pytest.mark.parametrize("path, expected", [
    ("bvlc/models/bvlc_alexnet/deploy.prototxt",
     {"data": (10, 3, 227, 227), "conv1": (10, 96, 55, 55), "pool1": (10, 96, 27, 27), "pool2": (10, 256, 13, 13),
      "pool5": (10, 256, 6, 6), "fc6": (10, 4096), "prob": (10, 1000)}),
    ("bvlc/models/bvlc_googlenet/deploy.prototxt",
     {"pool1/3x3_s2": (10, 64, 56, 56), "inception_3a/output": (10, 256, 28, 28),
      "inception_5b/output": (10, 1024, 7, 7), "pool5/7x7_s1": (10, 1024, 1, 1), "prob": (10, 1000)}),
    ("resnet/ResNet-50-deploy.prototxt",
     {"pool1": (1, 64, 56, 56), "res2c": (1, 256, 56, 56), "res5c": (1, 2048, 7, 7), "prob": (1, 1000)}),
    # v1.0's conv10 has pad 1 with a 1x1 kernel: 13 -> 15 before the global pooling.
    ("squeezenet/v1.0/deploy.prototxt", {"pool1": (10, 96, 55, 55), "conv10": (10, 1000, 15, 15),
                                         "pool10": (10, 1000, 1, 1)}),
    ("squeezenet/v1.1/deploy.prototxt", {"pool1": (10, 64, 56, 56), "conv10": (10, 1000, 14, 14)}),
    ("fcn/voc-fcn8s/deploy.prototxt", {"data": (1, 3, 500, 500), "score": (1, 21, 500, 500)}),
    ("mtcnn/det1.prototxt", {"data": (1, 3, 12, 12), "conv4-2": (1, 4, 1, 1), "prob1": (1, 2, 1, 1)}),
])
def test_well_known_shapes(path, expected):
    g = build_graph(load_net_param(MODELS / path), TEST)
    assert {blob: g.blob_shape(blob) for blob in expected} == expected
