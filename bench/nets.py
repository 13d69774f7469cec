"""The benchmarked nets: prototxts, Caffe/OpenCV anchors, weights and the training variant of each.

Anchors are the figures of the performance issue, measured on the benchmark machine (2 cores, fp32, median
ms per forward; Caffe = BVLC master CPU + OpenBLAS). OpenCV is also measured in every run; Caffe is not
installable here, so its fwd+bwd figure stays an anchor.
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODELS = ROOT / "tests" / "fixtures" / "models"


@dataclasses.dataclass(frozen=True)
class BenchNet:
    name: str
    prototxt: pathlib.Path
    weights: pathlib.Path | None           # real trained weights, where bundled
    caffe_fwd: dict[int, float]             # anchor ms by batch
    caffe_fwd_bwd: dict[int, float]
    opencv_fwd: dict[int, float]


NETS = {net.name: net for net in [
    BenchNet("lenet", ROOT / "caffejax/models/lenet/lenet.prototxt",
             ROOT / "caffejax/models/lenet/lenet_iter_10000.caffemodel",
             {1: 0.12, 16: 2.4}, {1: 0.33, 16: 4.8}, {1: 0.10, 16: 1.4}),
    BenchNet("alexnet", MODELS / "bvlc/models/bvlc_alexnet/deploy.prototxt", None,
             {1: 40, 16: 291}, {1: 95, 16: 730}, {1: 31, 16: 447}),
    BenchNet("googlenet", MODELS / "bvlc/models/bvlc_googlenet/deploy.prototxt", None,
             {1: 59, 16: 925}, {1: 122, 16: 1925}, {1: 44, 16: 680}),
    BenchNet("resnet50", MODELS / "resnet/ResNet-50-deploy.prototxt", None,
             {1: 83, 16: 1356}, {1: 233, 16: 4882}, {1: 46, 16: 727}),
    BenchNet("mobilenet_v2", MODELS / "mobilenet/mobilenet_v2_deploy.prototxt", None,
             {1: 43, 16: 730}, {1: 128, 16: 2023}, {1: 9.1, 16: 161}),
    BenchNet("squeezenet_v1.1", MODELS / "squeezenet/v1.1/deploy.prototxt", None,
             {1: 17, 16: 276}, {1: 39, 16: 622}, {1: 5.3, 16: 87}),
]}


def deploy_net(spec: BenchNet):
    """The net's deploy prototxt in the TEST phase, with its trained weights where bundled, else
    :func:`randomize_weights`."""
    import caffejax

    net = caffejax.Net(str(spec.prototxt), caffejax.TEST, **({"weights": str(spec.weights)} if spec.weights else {}))
    if spec.weights is None:
        randomize_weights(net)
    return net


def randomize_weights(net, seed: int = 0) -> None:
    """Random weights of realistic scale, whatever the prototxt's fillers (several deploy nets have none,
    which would leave zeros): He-normal filters, small biases, BatchNorm statistics near (0, 1) stored with
    a moving-average factor of 1, Scale near 1. Other learnable blobs keep their fillers."""
    rng = np.random.default_rng(seed)
    for layer in net.layers:
        blobs = layer.blobs
        if layer.type in ("Convolution", "InnerProduct", "Deconvolution") and blobs:
            w = blobs[0].data
            fan_in = w.size // w.shape[0]
            blobs[0].data[...] = rng.normal(0, np.sqrt(2.0 / fan_in), w.shape)
            for b in blobs[1:]:
                b.data[...] = rng.normal(0, 0.01, b.shape)
        elif layer.type == "BatchNorm":
            channels = blobs[0].shape
            blobs[0].data[...] = rng.normal(0, 0.1, channels)
            blobs[1].data[...] = rng.uniform(0.5, 1.5, channels)
            blobs[2].data[...] = 1.0
        elif layer.type == "Scale" and blobs:
            blobs[0].data[...] = rng.uniform(0.5, 1.0, blobs[0].shape)
            for b in blobs[1:]:
                b.data[...] = rng.normal(0, 0.01, b.shape)


def training_net_param(prototxt: pathlib.Path, batch: int):
    """The deploy net made trainable as ``caffe time`` would need it: a ``label`` Input and a
    SoftmaxWithLoss on the classifier's output (in place of the final Softmax, if any)."""
    from caffejax.frontend.build import load_net_param
    from caffejax.proto import caffe_pb2

    net = load_net_param(str(prototxt), is_path=True)  # upgraded: input/input_dim became an Input layer
    for layer in net.layer:
        if layer.type == "Input":
            for shape in layer.input_param.shape:
                shape.dim[0] = batch
    layers = list(net.layer)
    if layers and layers[-1].type == "Softmax":
        logits = layers[-1].bottom[0]
        del net.layer[-1]
    else:
        logits = layers[-1].top[0]
    label = net.layer.add(name="label", type="Input", top=["label"])
    label.input_param.shape.add().dim.append(batch)
    net.layer.add(name="loss", type="SoftmaxWithLoss", bottom=[logits, "label"], top=["loss"])
    return net
