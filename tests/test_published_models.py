"""Every published deploy/test net builds, compiles and runs forward at batch 1 and 4 with finite outputs.

Weights come from Caffe's fillers with a fixed seed (the trained files of these models are not bundled),
BatchNorm statistics set to those of unit activations;
the point is that each real-world architecture lowers, compiles and produces outputs of the shapes Caffe
infers. The big ImageNet nets take tens of seconds each to compile on 2 cores: they are marked ``slow``.
"""

from __future__ import annotations

import numpy as np
import pytest

import caffejax
from conftest import BUNDLED, MODELS

SMALL = {
    "lenet": BUNDLED / "lenet/lenet.prototxt",
    "cifar10_quick": MODELS / "bvlc/examples/cifar10/cifar10_quick.prototxt",
    "cifar10_full": MODELS / "bvlc/examples/cifar10/cifar10_full.prototxt",
    "mtcnn_det1": BUNDLED / "mtcnn/det1.prototxt",
    "mtcnn_det4": BUNDLED / "mtcnn/det4.prototxt",
}
LARGE = {
    "alexnet": MODELS / "bvlc/models/bvlc_alexnet/deploy.prototxt",
    "caffenet": MODELS / "bvlc/models/bvlc_reference_caffenet/deploy.prototxt",
    "googlenet": MODELS / "bvlc/models/bvlc_googlenet/deploy.prototxt",
    "resnet50": MODELS / "resnet/ResNet-50-deploy.prototxt",
    "resnet101": MODELS / "resnet/ResNet-101-deploy.prototxt",
    "resnet152": MODELS / "resnet/ResNet-152-deploy.prototxt",
    "mobilenet_v1": MODELS / "mobilenet/mobilenet_v1_deploy.prototxt",
    "mobilenet_v2": MODELS / "mobilenet/mobilenet_v2_deploy.prototxt",
    "squeezenet_v1.0": MODELS / "squeezenet/v1.0/deploy.prototxt",
    "squeezenet_v1.1": MODELS / "squeezenet/v1.1/deploy.prototxt",
    "densenet121": MODELS / "densenet/DenseNet_121.prototxt",
    "fcn8s": MODELS / "fcn/voc-fcn8s/deploy.prototxt",
    "inception_v3": MODELS / "soeaver/deploy_inception-v3.prototxt",
    "inception_v4": MODELS / "soeaver/deploy_inception-v4.prototxt",
    "xception": MODELS / "soeaver/deploy_xception.prototxt",
    "resnext50": MODELS / "soeaver/deploy_resnext50-32x4d.prototxt",
    "vgg16": MODELS / "soeaver/deploy_vgg16-pytorch.prototxt",
    "resnet101_v2": MODELS / "soeaver/deploy_resnet101-v2.prototxt",
    "mtcnn_det2": BUNDLED / "mtcnn/det2.prototxt",
    "mtcnn_det3": BUNDLED / "mtcnn/det3.prototxt",
}
PARAMS = [pytest.param(path, id=name) for name, path in SMALL.items()] + \
         [pytest.param(path, id=name, marks=pytest.mark.slow) for name, path in LARGE.items()]


@pytest.mark.parametrize("prototxt", PARAMS)
def test_builds_compiles_and_runs_at_batch_1_and_4(prototxt):
    net = caffejax.Net(str(prototxt), caffejax.TEST)
    # Fillers leave BatchNorm's statistics at zero (Caffe does too): normalising by var 0 and eps multiplies
    # activations by ~300 per layer, which overflows deep nets. Give them the statistics of unit activations,
    # as trained weights would hold.
    for layer in net.layers:
        if layer.type == "BatchNorm":
            layer.blobs[0].data[...], layer.blobs[1].data[...], layer.blobs[2].data[...] = 0.0, 1.0, 1.0
    rng = np.random.default_rng(0)
    for batch in (1, 4):
        for name in net.inputs:
            net.blobs[name].reshape(batch, *net.blobs[name].shape[1:])
        net.reshape()
        expected = {name: net.graph.blob_shape(name) for name in net.outputs}
        out = net.forward(**{name: rng.standard_normal(net.blobs[name].shape).astype(np.float32)
                             for name in net.inputs})
        assert set(out) == set(net.outputs)
        for name, value in out.items():
            assert value.shape == expected[name] and value.shape[0] == batch, name
            assert np.isfinite(value).all(), f"{name} has non-finite values at batch {batch}"


@pytest.mark.parametrize("prototxt", PARAMS)
def test_compile_inference_keeps_caffes_values_on_each_architecture(prototxt):
    """compile_inference with every default pass (BatchNorm folded, channels-last, Winograd, ...) and Net.forward
    (its own kernels, prepared weights) against Caffe's rules unchanged (``passes=()``), on each real
    architecture at batch 2: the outputs, the blobs the last three layers read (the logits before a Softmax)
    and a blob half way. BatchNorm and Scale get random statistics and factors, so folding them changes
    something."""
    from conftest import FORWARD_ATOL, FORWARD_RTOL, assert_close

    net = caffejax.Net(str(prototxt), caffejax.TEST)
    rng = np.random.default_rng(1)
    for layer in net.layers:
        if layer.type == "BatchNorm":
            channels = layer.blobs[0].data.shape
            layer.blobs[0].data[...] = rng.normal(0, 0.1, channels)
            layer.blobs[1].data[...], layer.blobs[2].data[...] = rng.uniform(0.5, 1.5, channels), 1.0
        elif layer.type == "Scale":
            for blob in layer.blobs:
                blob.data[...] = rng.uniform(0.5, 1.5, blob.data.shape)
    feeds = {}
    for name in net.inputs:
        net.blobs[name].reshape(2, *net.blobs[name].shape[1:])
        feeds[name] = rng.standard_normal(net.blobs[name].shape).astype(np.float32)
    net.reshape()
    layers = net.graph.layers
    inner = {b for layer in layers[-3:] for b in layer.proto.bottom} | {layers[len(layers) // 2].proto.top[0]}
    blobs = sorted(inner - set(net.inputs) - set(net.outputs))
    plain = caffejax.compile_inference(net, passes=(), blobs=blobs)(feeds)
    optimised = caffejax.compile_inference(net, blobs=blobs)(feeds)
    forward = net.forward(**feeds, blobs=blobs)
    assert set(plain) == set(net.outputs) | set(blobs)
    for name, reference in plain.items():
        assert_close(optimised[name], reference, FORWARD_RTOL, FORWARD_ATOL, f"compile_inference: {name}")
        assert_close(forward[name], reference, FORWARD_RTOL, FORWARD_ATOL, f"Net.forward: {name}")
