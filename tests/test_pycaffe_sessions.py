"""A pycaffe script's Net, driven through a random session, shows what a fresh net shows.

Net keeps much between calls to be fast (the graph and programs per fed shape, each range's prepared weights,
the blobs read after the last passes, blobs recomputed only when read). None of that may show: after any
sequence of reshapes, writes to the input, to intermediate blobs and to weights (at once or through an array
held since), forwards over the whole net or a range, and reads, every blob read must hold what a net built
afresh gives for the same weights and inputs. The fresh nets (one per input shape) are driven the plain way:
weights and blobs written, then one forward.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

import caffejax
from conftest import BUNDLED

NETS = {
    # PReLU in place after each convolution, two heads; any height and width.
    "mtcnn_det1": (BUNDLED / "mtcnn/det1.prototxt", BUNDLED / "mtcnn/det1.caffemodel",
                   [(1, 3, 20, 24), (1, 3, 31, 17), (2, 3, 20, 24)]),
    "lenet": (BUNDLED / "lenet/lenet.prototxt", BUNDLED / "lenet/lenet_iter_10000.caffemodel",
              [(1, 1, 28, 28), (2, 1, 28, 28)]),
}
OPERATIONS = ["reshape", "write input", "forward", "forward", "forward(blobs=)", "forward(data=)", "forward range",
              "read", "read", "read", "write blob", "scale weight", "hold weight", "write held weight",
              "read weight"]


class FreshNets:
    """The values a net built afresh computes: one net per input shape, given the weights and blobs each time."""

    def __init__(self, prototxt, weights):
        self.prototxt, self.weights, self.nets = str(prototxt), str(weights), {}

    def forward(self, weights, x, start=None, end=None, blobs_before=None) -> dict[str, np.ndarray]:
        net = self.nets.get(x.shape)
        if net is None:
            net = self.nets[x.shape] = caffejax.Net(self.prototxt, self.weights, caffejax.TEST)
            net.blobs["data"].reshape(*x.shape)
        for name, arrays in weights.items():
            for i, array in enumerate(arrays):
                net.params[name][i].data[...] = array
        for name, array in (blobs_before or {}).items():
            net.blobs[name].data[...] = array
        net.blobs["data"].data[...] = x
        net.forward(start=start, end=end)
        return {name: blob.data.copy() for name, blob in net.blobs.items()}


@pytest.mark.parametrize("name, seed", [("mtcnn_det1", 0), ("lenet", 1)])
def test_a_random_pycaffe_session_reads_what_a_fresh_net_computes(name, seed):
    prototxt, weights_file, shapes = NETS[name]
    choose, draw = random.Random(seed), np.random.default_rng(seed)
    net = caffejax.Net(str(prototxt), str(weights_file), caffejax.TEST)
    fresh = FreshNets(prototxt, weights_file)
    # The weights as the session changes them, read from a net of their own: reading the session's net's would
    # hand its arrays out, which changes what it does.
    weights = {layer: [blob.data.copy() for blob in blobs]
               for layer, blobs in caffejax.Net(str(prototxt), str(weights_file), caffejax.TEST).params.items()}
    layers = list(net._layer_names)
    x = draw.uniform(-1, 1, net.blobs["data"].shape).astype(np.float32)
    net.blobs["data"].data[...] = x
    expected, held, done = None, {}, []

    def check(what: str, got: np.ndarray, want: np.ndarray) -> None:
        assert got.shape == want.shape and np.allclose(got, want, rtol=1e-4, atol=1e-5), (
            f"{what} differs after: {'; '.join(done[-12:])}")

    def some_weight() -> tuple[str, int]:
        layer = choose.choice(list(weights))
        return layer, choose.randrange(len(weights[layer]))

    for _ in range(70):
        operation = choose.choice(OPERATIONS)
        done.append(operation)
        if operation == "reshape":
            shape = choose.choice(shapes)
            done[-1] += f" {shape}"
            net.blobs["data"].reshape(*shape)
            x = draw.uniform(-1, 1, shape).astype(np.float32)
            net.blobs["data"].data[...] = x
            expected = None  # Caffe leaves the other blobs' values unspecified after a reshape
        elif operation == "write input":
            x = draw.uniform(-1, 1, x.shape).astype(np.float32)
            net.blobs["data"].data[...] = x
        elif operation.startswith("forward") and not (operation == "forward range" and expected is None):
            start = end = None
            before = None
            if operation == "forward(data=)":
                x = draw.uniform(-1, 1, x.shape).astype(np.float32)
                outputs = net.forward(data=x)
            elif operation == "forward(blobs=)":
                blob = choose.choice(list(net.blobs))
                done[-1] += f" {blob}"
                outputs = net.forward(blobs=[blob])
            elif operation == "forward range":
                first, last = sorted(choose.sample(range(1, len(layers)), 2))
                start = layers[first] if choose.random() < 0.5 else None
                end = layers[last] if choose.random() < 0.5 else None
                done[-1] += f" start={start} end={end}"
                before = {blob: value for blob, value in expected.items() if blob != "data"}
                outputs = net.forward(start=start, end=end)
            else:
                outputs = net.forward()
            expected = fresh.forward(weights, x, start, end, before)
            for blob, value in outputs.items():
                check(f"output {blob}", value, expected[blob])
        elif operation == "read":
            blob = choose.choice(list(net.blobs))
            done[-1] += f" {blob}"
            if blob == "data":
                check("the input", net.blobs[blob].data, x)
            elif expected is not None:
                check(f"blob {blob}", net.blobs[blob].data, expected[blob])
        elif operation == "write blob" and expected is not None:
            blob = choose.choice([name for name in net.blobs if name != "data"])
            done[-1] += f" {blob}"
            expected[blob] = draw.uniform(-1, 1, net.blobs[blob].shape).astype(np.float32)
            net.blobs[blob].data[...] = expected[blob]
        elif operation == "scale weight":
            layer, i = some_weight()
            done[-1] += f" {layer}[{i}]"
            net.params[layer][i].data[...] *= 1.1
            weights[layer][i] *= np.float32(1.1)
        elif operation == "hold weight":
            layer, i = some_weight()
            done[-1] += f" {layer}[{i}]"
            held[(layer, i)] = net.params[layer][i].data
        elif operation == "write held weight" and held:
            (layer, i), array = choose.choice(list(held.items()))
            done[-1] += f" {layer}[{i}]"
            array += 0.01
            weights[layer][i] += np.float32(0.01)
        elif operation == "read weight":
            layer, i = some_weight()
            check(f"weight {layer}[{i}]", net.params[layer][i].data, weights[layer][i])
    assert sum(step.startswith("forward") for step in done) >= 10
