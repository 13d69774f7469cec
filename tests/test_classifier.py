"""pycaffe's Classifier and Detector on caffejax nets."""

from __future__ import annotations

import numpy as np
import pytest

import caffejax as caffe
from caffejax.errors import UnsupportedError

from conftest import BUNDLED

LENET = (str(BUNDLED / "lenet" / "lenet.prototxt"), str(BUNDLED / "lenet" / "lenet_iter_10000.caffemodel"))


def drawn_one() -> np.ndarray:
    im = np.zeros((28, 28, 1), np.float32)
    im[4:24, 13:16] = 1.0
    return im


def drawn_zero() -> np.ndarray:
    yy, xx = np.mgrid[:28, :28]
    r = np.hypot((yy - 14) / 9.0, (xx - 14) / 6.5)
    return ((r > 0.7) & (r < 1.05)).astype(np.float32)[:, :, None]


def drawn_seven() -> np.ndarray:
    im = np.zeros((28, 28, 1), np.float32)
    im[5:8, 7:21] = 1.0
    for y in range(8, 24):
        x = int(20 - (y - 8) * 0.5)
        im[y, x - 1:x + 2] = 1.0
    return im


@pytest.fixture(scope="module")
def lenet_classifier():
    # LeNet was trained on MNIST scaled to [0, 1): white digits on black, as caffe.io images are.
    return caffe.Classifier(*LENET, image_dims=(30, 30))


def test_classifier_reads_drawn_digits(lenet_classifier):
    digits = [drawn_one(), drawn_zero(), drawn_seven()]
    centre = lenet_classifier.predict(digits, oversample=False)
    assert centre.shape == (3, 10)
    assert centre.argmax(1).tolist() == [1, 0, 7]
    np.testing.assert_allclose(centre.sum(1), 1, rtol=1e-5)
    assert lenet_classifier.predict(digits).argmax(1).tolist() == [1, 0, 7]


def test_oversampled_prediction_is_the_mean_over_ten_crops(lenet_classifier):
    image = drawn_seven()
    resized = caffe.io.resize_image(image, (30, 30))
    crops = caffe.io.oversample([resized], (28, 28))
    batch = np.zeros((64, 1, 28, 28), np.float32)
    batch[:10] = [lenet_classifier.transformer.preprocess("data", c) for c in crops]
    direct = lenet_classifier.forward(data=batch)["prob"][:10].mean(0)
    np.testing.assert_allclose(lenet_classifier.predict([image])[0], direct, rtol=1e-5, atol=1e-7)


def test_image_dims_smaller_than_the_net_input_is_a_shape_error():
    classifier = caffe.Classifier(*LENET, image_dims=(27, 30))  # LeNet's input is 28 x 28
    digit = drawn_one()
    # pycaffe failed with numpy broadcast errors, in the centre crop's copy and in oversample
    with pytest.raises(caffe.ShapeError, match=r"image_dims \(27, 30\) is smaller than the net's input \(28, 28\)"):
        classifier.predict([digit], oversample=False)
    with pytest.raises(caffe.ShapeError, match="oversample"):
        classifier.predict([digit], oversample=True)


TINY = '''name: "tiny"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 6 dim: 6 } } }
layer { name: "fc" type: "InnerProduct" bottom: "data" top: "fc"
  inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "prob" type: "Softmax" bottom: "fc" top: "prob" }
'''


@pytest.fixture
def tiny_model(tmp_path):
    prototxt = tmp_path / "tiny.prototxt"
    prototxt.write_text(TINY)
    weights = tmp_path / "tiny.caffemodel"
    caffe.Net(str(prototxt), caffe.TEST).save(str(weights))
    Image = pytest.importorskip("PIL.Image")
    rgb = np.random.default_rng(0).integers(0, 256, (10, 12, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(tmp_path / "scene.png")
    return str(prototxt), str(weights), str(tmp_path / "scene.png"), rgb / np.float32(255)


def test_detector_classifies_each_window(tiny_model):
    prototxt, weights, scene, image = tiny_model
    detector = caffe.Detector(prototxt, weights, raw_scale=255, channel_swap=(2, 1, 0))
    windows = np.array([[0, 0, 6, 6], [2, 3, 8, 9], [4, 6, 10, 12]])
    detections = detector.detect_windows([(scene, windows)])
    assert [d["filename"] for d in detections] == [scene] * 3
    reference = caffe.Net(prototxt, weights, caffe.TEST)
    for detection, (y0, x0, y1, x1) in zip(detections, windows):
        crop = image[y0:y1, x0:x1].transpose(2, 0, 1)[::-1] * 255
        want = reference.forward(data=np.stack([crop, crop]))["prob"][0]
        np.testing.assert_allclose(detection["prediction"], want, rtol=1e-4, atol=1e-6)
        np.testing.assert_array_equal(detection["window"], [y0, x0, y1, x1])


def test_detector_context_pad_fills_beyond_the_image_with_the_mean(tiny_model):
    prototxt, weights, _, image = tiny_model
    mean = np.array([10.0, 20.0, 30.0])  # BGR, in the net's [0, 255] space
    detector = caffe.Detector(prototxt, weights, mean=mean, raw_scale=255, channel_swap=(2, 1, 0), context_pad=1)
    crop = detector.crop(image, np.array([0, 0, 3, 3]))
    # The 4 x 4 corner box grows by 6/4 around its centre to rows/cols -1..5: one padded row and column,
    # filled with the mean in RGB [0, 1] space; the rest is image rows/cols 0..4.
    assert crop.shape == (6, 6, 3)
    np.testing.assert_allclose(crop[0, 0], mean[::-1] / 255)
    np.testing.assert_allclose(crop[0, 3], mean[::-1] / 255)
    np.testing.assert_allclose(crop[1:, 1:], image[0:5, 0:5], rtol=1e-6)
    with pytest.raises(UnsupportedError, match="selective search"):
        detector.detect_selective_search(["x.png"])
