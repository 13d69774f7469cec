"""BVLC's pycaffe tutorials, step by step as their notebooks write them, with ``import caffejax as caffe``:

- 00-classification: ``caffe.io.load_image`` + ``caffe.io.Transformer`` feeding a net, and ``caffe.Classifier``
  (on the bundled LeNet with digits drawn into PNG files);
- net_surgery: the "designer filters" (conv weights set by hand through ``net.params``) and casting CaffeNet
  into a fully-convolutional net by transplanting fc6/fc7/fc8 into fc6-conv/fc7-conv/fc8-conv with
  ``.flat``; the trained CaffeNet is not bundled, so its weights are seeded random ones saved to a caffemodel.

01-learning-lenet's NetSpec flow (regenerating BVLC's LeNet prototxt) is tests/test_net_spec.py, and the
draw_net example (``caffe.draw.draw_net_to_file`` to a PNG) is tests/test_draw.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import caffejax as caffe
from conftest import BUNDLED, MODELS

LENET = str(BUNDLED / "lenet" / "lenet.prototxt")
LENET_WEIGHTS = str(BUNDLED / "lenet" / "lenet_iter_10000.caffemodel")
LENET_SCALE = 0.00390625  # lenet_train_test.prototxt's transform_param: LeNet was trained on pixels / 256
NET_SURGERY = MODELS / "bvlc" / "examples" / "net_surgery"
CAFFENET_DEPLOY = str(MODELS / "bvlc" / "models" / "bvlc_reference_caffenet" / "deploy.prototxt")
CAFFENET_FULL_CONV = str(NET_SURGERY / "bvlc_caffenet_full_conv.prototxt")
ILSVRC_MEAN_BGR = np.array([104.00698793, 116.66876762, 122.67891434])  # ilsvrc_2012_mean.npy .mean(1).mean(1)


@pytest.fixture(scope="module")
def Image():
    return pytest.importorskip("PIL.Image")


# ---- 00-classification ---------------------------------------------------------------------------------------

def draw_digits(Image, folder) -> dict[int, str]:
    """A 1, a 0 and a 7 drawn white on black into 28x28 gray PNG files, as MNIST writes digits."""
    from PIL import ImageDraw

    strokes = {
        1: lambda d: d.line([(14, 4), (14, 23)], fill=255, width=3),
        0: lambda d: d.ellipse([(8, 4), (20, 23)], outline=255, width=3),
        7: lambda d: (d.line([(7, 6), (20, 6)], fill=255, width=3), d.line([(20, 6), (12, 23)], fill=255, width=3)),
    }
    paths = {}
    for digit, draw in strokes.items():
        image = Image.new("L", (28, 28))
        draw(ImageDraw.Draw(image))
        paths[digit] = str(folder / f"drawn_{digit}.png")
        image.save(paths[digit])
    return paths


def test_classification_with_transformer_and_classifier(Image, tmp_path):
    paths = draw_digits(Image, tmp_path)
    digits = list(paths)
    images = [caffe.io.load_image(paths[d], color=False) for d in digits]
    assert images[0].shape == (28, 28, 1) and images[0].dtype == np.float32 and images[0].max() == 1.0

    caffe.set_mode_cpu()
    net = caffe.Net(LENET, LENET_WEIGHTS, caffe.TEST)
    transformer = caffe.io.Transformer({"data": net.blobs["data"].data.shape})
    transformer.set_transpose("data", (2, 0, 1))  # H x W x K -> K x H x W
    transformer.set_raw_scale("data", 255)  # load_image's [0, 1] -> [0, 255], what the net was trained on...
    transformer.set_input_scale("data", LENET_SCALE)  # ...after the Data layer's scale
    net.blobs["data"].reshape(len(images), 1, 28, 28)
    net.blobs["data"].data[...] = [transformer.preprocess("data", image) for image in images]
    output = net.forward()
    probs = output["prob"]
    assert probs.shape == (3, 10) and probs.argmax(1).tolist() == digits
    np.testing.assert_allclose(probs.sum(1), 1, rtol=1e-5)

    # preprocess gives exactly what lenet_train_test.prototxt's Data layer makes of the PNG's pixels.
    pixels = np.asarray(Image.open(paths[7]), np.float32)
    np.testing.assert_allclose(net.blobs["data"].data[2, 0], pixels * np.float32(LENET_SCALE), rtol=1e-6)

    classifier = caffe.Classifier(LENET, LENET_WEIGHTS, image_dims=(28, 28), raw_scale=255,
                                  input_scale=LENET_SCALE)
    np.testing.assert_allclose(classifier.predict(images, oversample=False), probs, rtol=1e-5, atol=1e-7)
    assert classifier.predict(images).argmax(1).tolist() == digits  # mean over corners, centre and mirrors


# ---- net_surgery: designer filters ----------------------------------------------------------------------------

def test_designer_filters(Image, tmp_path):
    """A gray image through a one-convolution net, its filters and bias set by hand (the notebook's cells)."""
    yy, xx = np.mgrid[:60, :80]
    scene = np.where((abs(yy - 30) < 14) & (abs(xx - 25) < 14), 220, 40)  # a bright square
    scene = np.where(np.hypot(yy - 30, xx - 58) < 12, 160, scene).astype(np.uint8)  # and a grey disc
    Image.fromarray(scene).save(tmp_path / "scene_gray.png")

    net = caffe.Net(str(NET_SURGERY / "conv.prototxt"), caffe.TEST)
    assert list(net.blobs.keys()) == ["data", "conv"] and list(net.params.keys()) == ["conv"]
    im = np.array(Image.open(tmp_path / "scene_gray.png"))
    im_input = im[np.newaxis, np.newaxis, :, :]
    net.blobs["data"].reshape(*im_input.shape)
    net.blobs["data"].data[...] = im_input
    net.forward()  # the notebook's show_filters

    conv0 = net.blobs["conv"].data[0, 0]  # a view that later passes fill, as pycaffe's views onto Caffe's memory
    pre_surgery = conv0.mean()
    net.params["conv"][1].data[0] = 1.
    net.forward()
    assert conv0.mean() == pytest.approx(pre_surgery + 1, abs=1e-4)

    ksize = net.params["conv"][0].data.shape[2:]
    sigma = 1.
    y, x = np.mgrid[-ksize[0] // 2 + 1:ksize[0] // 2 + 1, -ksize[1] // 2 + 1:ksize[1] // 2 + 1]
    g = np.exp(-((x ** 2 + y ** 2) / (2.0 * sigma ** 2)))
    gaussian = (g / g.sum()).astype(np.float32)
    net.params["conv"][0].data[0] = gaussian
    net.params["conv"][0].data[1:] = 0.
    sobel = np.array((-1, -2, -1, 0, 0, 0, 1, 2, 1), dtype=np.float32).reshape((3, 3))
    net.params["conv"][0].data[1, 0, 1:-1, 1:-1] = sobel  # horizontal
    net.params["conv"][0].data[2, 0, 1:-1, 1:-1] = sobel.T  # vertical
    net.forward()

    windows = np.lib.stride_tricks.sliding_window_view(im.astype(np.float64), (5, 5))  # 56 x 76 x 5 x 5
    weights = net.params["conv"][0].data[:, 0]
    expected = np.einsum("yxij,cij->cyx", windows, weights) + np.array([1., 0., 0.])[:, None, None]
    np.testing.assert_allclose(net.blobs["conv"].data[0], expected, rtol=1e-5, atol=1e-3)
    blurred, horizontal, vertical = net.blobs["conv"].data[0]
    # The square (220 on 40) spans input rows and columns 17..43 and 12..38; output (y, x) filters from (y, x).
    assert horizontal[15, 25] == pytest.approx(4 * 180) and vertical[15, 25] == 0  # its top edge
    assert vertical[28, 10] == pytest.approx(4 * 180) and horizontal[28, 10] == 0  # its left edge
    assert horizontal[28, 25] == vertical[28, 25] == 0 and blurred[28, 25] == pytest.approx(220 + 1)  # inside


# ---- net_surgery: casting a classifier into a fully convolutional network -----------------------------------

@pytest.fixture(scope="module")
def caffenet_weights(tmp_path_factory):
    """CaffeNet's deploy net with seeded random weights (LeCun-normal, small biases), saved as a caffemodel."""
    net = caffe.Net(CAFFENET_DEPLOY, caffe.TEST)
    rng = np.random.default_rng(0)
    for weights, biases in net.params.values():
        fan_in = np.prod(weights.data.shape[1:])
        weights.data[...] = rng.standard_normal(weights.data.shape, np.float32) / np.float32(np.sqrt(fan_in))
        biases.data[...] = rng.standard_normal(biases.data.shape, np.float32) * np.float32(0.01)
    path = tmp_path_factory.mktemp("caffenet") / "bvlc_reference_caffenet.caffemodel"
    net.save(str(path))
    return str(path)


def test_fully_convolutional_caffenet(Image, tmp_path, caffenet_weights):
    # Load the original network and extract the fully connected layers' parameters.
    net = caffe.Net(CAFFENET_DEPLOY, caffenet_weights, caffe.TEST)
    params = ["fc6", "fc7", "fc8"]
    fc_params = {pr: (net.params[pr][0].data, net.params[pr][1].data) for pr in params}
    assert [fc_params[pr][0].shape for pr in params] == [(4096, 9216), (4096, 4096), (1000, 4096)]

    # Load the fully convolutional network to transplant the parameters.
    net_full_conv = caffe.Net(CAFFENET_FULL_CONV, caffenet_weights, caffe.TEST)
    params_full_conv = ["fc6-conv", "fc7-conv", "fc8-conv"]
    conv_params = {pr: (net_full_conv.params[pr][0].data, net_full_conv.params[pr][1].data)
                   for pr in params_full_conv}
    assert [conv_params[pr][0].shape for pr in params_full_conv] == [(4096, 256, 6, 6), (4096, 4096, 1, 1),
                                                                    (1000, 4096, 1, 1)]
    for pr, pr_conv in zip(params, params_full_conv):
        conv_params[pr_conv][0].flat = fc_params[pr][0].flat  # flat unrolls the arrays
        conv_params[pr_conv][1][...] = fc_params[pr][1]

    # load input and configure preprocessing
    rgb = np.random.default_rng(1).integers(0, 256, (451, 451, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(tmp_path / "scene.png")
    im = caffe.io.load_image(str(tmp_path / "scene.png"))
    transformer = caffe.io.Transformer({"data": net_full_conv.blobs["data"].data.shape})
    transformer.set_mean("data", ILSVRC_MEAN_BGR)
    transformer.set_transpose("data", (2, 0, 1))
    transformer.set_channel_swap("data", (2, 1, 0))
    transformer.set_raw_scale("data", 255.0)
    # make classification map by forward and print prediction indices at each location (pool5 and fc8-conv
    # are asked for too, to be compared below)
    out = net_full_conv.forward_all(data=np.asarray([transformer.preprocess("data", im)]), blobs=["pool5", "fc8-conv"])
    assert out["prob"].shape == (1, 1000, 8, 8) and out["prob"][0].argmax(axis=0).shape == (8, 8)
    assert out["pool5"].shape == (1, 256, 13, 13)

    # Each position of the map is the classifier's head (fc6 on) applied to a 6x6 window of pool5, stride 1.
    net.blobs["data"].reshape(1, 3, 227, 227)
    net.reshape()
    for i, j in [(0, 0), (3, 6), (7, 7)]:
        net.blobs["pool5"].data[...] = out["pool5"][:, :, i:i + 6, j:j + 6]
        head = net.forward(start="fc6", blobs=["fc8"])
        np.testing.assert_allclose(head["fc8"][0], out["fc8-conv"][0, :, i, j], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(head["prob"][0], out["prob"][0, :, i, j], rtol=1e-4, atol=1e-7)

    # The classifier on the top-left 227x227 crop sees nearly what the map's top-left position sees: not
    # exactly, because inside the crop net conv3..5 (pad 1) and conv2 (pad 2) pad the crop's right and bottom
    # borders with zeros where the full-image net has the neighbouring pixels' features.
    crop = transformer.preprocess("data", im)[np.newaxis, :, :227, :227]
    classified = net.forward(data=crop, blobs=["fc8"])
    assert np.corrcoef(classified["fc8"][0], out["fc8-conv"][0, :, 0, 0])[0, 1] > 0.9

    # On a 227x227 image alone, the fully convolutional net gives a 1x1 map: the classifier's output.
    net_full_conv.blobs["data"].reshape(1, 3, 227, 227)
    whole = net_full_conv.forward(data=crop)["prob"]
    assert whole.shape == (1, 1000, 1, 1)
    np.testing.assert_allclose(whole[0, :, 0, 0], classified["prob"][0], rtol=1e-4, atol=1e-7)
