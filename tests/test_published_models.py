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
