"""caffejax against the figures real BVLC Caffe produced (tests/fixtures/reference, copied from ../shared).

For every per-layer case and every whole net: Caffe's blob order and shapes, the weights as loaded, every
blob after forward, and every blob and param diff after backward, within the reference tolerances.
"""

from __future__ import annotations

import numpy as np
import pytest

import caffejax
from caffejax.frontend.caffemodel import blobproto_to_array
from caffejax.proto import caffe_pb2

from conftest import (DIFF_ATOL, DIFF_RTOL, FORWARD_ATOL, FORWARD_RTOL, NET_CASES, assert_close, layer_case,
                      layer_cases, net_case)

CASES = [pytest.param(layer_case, name, id=f"layers/{name}") for name in layer_cases()] + \
        [pytest.param(net_case, name, id=f"nets/{name}") for name in NET_CASES]

# Cases whose caffemodel Caffe wrote after a TRAIN forward had updated BatchNorm's running statistics, so
# the file holds the updated blobs while param/ holds those before forward (checked by the test below).
WRITTEN_AFTER_FORWARD = {"batchnorm_train"}

# Blobs whose values are integers in Caffe (indices, counts): compared exactly.
EXACT_LAYER_TYPES = {"ArgMax", "Accuracy"}


class Run:
    """One case run once: the net as loaded, then after Caffe's forward (and backward, if Caffe ran one)."""

    def __init__(self, make, name):
        self.case = case = make(name)
        net = self.net = case.make_net()
        case.feed(net)
        net.reshape()
        self.blob_order = list(net.blobs)
        self.shapes = {b: net.blobs[b].shape for b in net.blobs}
        self.loaded = {layer: [np.array(b.data) for b in blobs] for layer, blobs in net.params.items()}
        net.forward()
        self.forward = {b: np.array(net.blobs[b].data) for b in net.blobs}
        self.loss = net._last_loss
        if case.keys("diff/"):
            for blob in case.keys("topdiff/"):
                net.blobs[blob].diff[...] = case.figures["topdiff/" + blob]
            net.backward()


@pytest.fixture(scope="module")
def ran():
    cache = {}

    def get(make, name) -> Run:
        if name not in cache:
            cache[name] = Run(make, name)
        return cache[name]

    return get


@pytest.mark.parametrize("make,name", CASES)
def test_blob_order_and_shapes(make, name, ran):
    run = ran(make, name)
    assert run.blob_order == run.case.keys("data/")
    for blob in run.case.keys("data/"):
        assert run.shapes[blob] == run.case.figures["data/" + blob].shape, blob


@pytest.mark.parametrize("make,name", CASES)
def test_weights_load(make, name, ran):
    """The caffemodel's blobs load as protobuf itself decodes them, and equal Caffe's param/ figures."""
    run = ran(make, name)
    case = run.case
    decoded = caffe_pb2.NetParameter.FromString(case.weights.read_bytes())
    for layer in decoded.layer:
        if layer.name not in run.loaded:
            continue  # Caffe ignores layers the net does not have (det2's file has an extra one)
        for i, blob in enumerate(layer.blobs):
            np.testing.assert_array_equal(run.loaded[layer.name][i], blobproto_to_array(blob),
                                          err_msg=f"{layer.name}/{i}")
    if name in WRITTEN_AFTER_FORWARD:
        return
    for key in case.keys("param/"):
        layer, i = key.rsplit("/", 1)
        np.testing.assert_array_equal(run.loaded[layer][int(i)], case.figures["param/" + key])


def test_batchnorm_train_updates_running_stats():
    """batchnorm_train.caffemodel was written after Caffe's TRAIN forward: it holds the updated statistics."""
    case = layer_case("batchnorm_train")
    net = caffejax.Net(str(case.prototxt), caffejax.TRAIN)
    for i in range(3):
        net.params["l"][i].data[...] = case.figures[f"param/l/{i}"]
    case.feed(net)
    net.forward()
    decoded = caffe_pb2.NetParameter.FromString(case.weights.read_bytes())
    for i, blob in enumerate(decoded.layer[1].blobs):
        assert_close(net.params["l"][i].data, blobproto_to_array(blob), FORWARD_RTOL, FORWARD_ATOL, f"blob {i}")


@pytest.mark.parametrize("make,name", CASES)
def test_forward(make, name, ran):
    run = ran(make, name)
    exact = {t for layer in run.net.graph.layers if layer.type in EXACT_LAYER_TYPES
             and not (layer.type == "ArgMax" and layer.proto.argmax_param.out_max_val) for t in layer.tops}
    for blob in run.case.keys("data/"):
        ref = run.case.figures["data/" + blob]
        if blob in exact:
            np.testing.assert_array_equal(run.forward[blob], ref, err_msg=f"data/{blob}")
        else:
            assert_close(run.forward[blob], ref, FORWARD_RTOL, FORWARD_ATOL, f"data/{blob}")
    if "loss" in run.case.figures:
        assert_close(np.float32(run.loss), run.case.figures["loss"], FORWARD_RTOL, FORWARD_ATOL, "loss")


@pytest.mark.parametrize("make,name", CASES)
def test_backward(make, name, ran):
    run = ran(make, name)
    case, net = run.case, run.net
    if not case.keys("diff/"):
        pytest.skip("Caffe ran forward only for this case")
    for blob in case.keys("diff/"):
        assert_close(net.blobs[blob].diff, case.figures["diff/" + blob], DIFF_RTOL, DIFF_ATOL, f"diff/{blob}")
    for key in case.keys("paramdiff/"):
        layer, i = key.rsplit("/", 1)
        assert_close(net.params[layer][int(i)].diff, case.figures["paramdiff/" + key], DIFF_RTOL, DIFF_ATOL,
                     f"paramdiff/{key}")
