"""caffe.Detector's windows and their errors, against pycaffe's detector.py arithmetic."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

import caffejax as caffe
from caffejax.errors import DetectorWindowError, ImageFileError, UnsupportedError

Image = pytest.importorskip("PIL.Image")


def tiny_net(tmp_path, channels=3, height=6, width=6):
    prototxt = tmp_path / f"tiny{channels}{height}{width}.prototxt"
    prototxt.write_text(f'''name: "tiny"
layer {{ name: "data" type: "Input" top: "data"
  input_param {{ shape {{ dim: 2 dim: {channels} dim: {height} dim: {width} }} }} }}
layer {{ name: "fc" type: "InnerProduct" bottom: "data" top: "fc"
  inner_product_param {{ num_output: 4 weight_filler {{ type: "gaussian" std: 0.5 }} }} }}
layer {{ name: "prob" type: "Softmax" bottom: "fc" top: "prob" }}
''')
    weights = tmp_path / f"tiny{channels}{height}{width}.caffemodel"
    caffe.Net(str(prototxt), caffe.TEST).save(str(weights))
    return str(prototxt), str(weights)


def scene(tmp_path, mode="RGB"):
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (10, 12, 3) if mode == "RGB" else (10, 12), dtype=np.uint8)
    path = tmp_path / f"scene_{mode}.png"
    Image.fromarray(pixels).save(path)
    return str(path)


def test_bad_windows_and_files_are_typed_errors(tmp_path):
    # pycaffe failed with IndexError (no windows), FileNotFoundError, or numpy/skimage errors on empty crops
    detector = caffe.Detector(*tiny_net(tmp_path))
    image_file = scene(tmp_path)
    with pytest.raises(DetectorWindowError, match="no windows"):
        detector.detect_windows([])
    with pytest.raises(DetectorWindowError, match="no windows"):
        detector.detect_windows([(image_file, [])])
    with pytest.raises(ImageFileError, match="missing.png"):
        detector.detect_windows([(str(tmp_path / "missing.png"), [np.array([0, 0, 2, 2])])])
    with pytest.raises(DetectorWindowError, match="out of order"):
        detector.detect_windows([(image_file, [np.array([5, 1, 2, 4])])])
    with pytest.raises(DetectorWindowError, match="four finite numbers"):
        detector.detect_windows([(image_file, [np.array([0, 1, 2])])])
    with pytest.raises(DetectorWindowError, match="no pixel of the 10 x 12 image"):
        detector.detect_windows([(image_file, [np.array([11, 0, 15, 4])])])


def test_negative_window_coordinates_are_clipped_not_wrapped(tmp_path):
    detector = caffe.Detector(*tiny_net(tmp_path))
    image = np.arange(10 * 12 * 3, dtype=np.float32).reshape(10, 12, 3)
    # pycaffe's im[-2:4] wrapped around to the empty rows 8:4
    np.testing.assert_array_equal(detector.crop(image, np.array([-2, -3, 4, 5])), image[0:4, 0:5])


def test_context_window_outside_the_image_is_a_typed_error(tmp_path):
    detector = caffe.Detector(*tiny_net(tmp_path, height=8, width=8), context_pad=1)
    image = np.random.default_rng(0).random((10, 12, 3)).astype(np.float32)
    for window in ([12, 0, 15, 4], [-9, -9, -7, -7], [3, 3, 1, 1]):  # pycaffe: ValueError, AssertionError, ...
        with pytest.raises(DetectorWindowError):
            detector.crop(image, np.array(window))
    assert detector.crop(image, np.array([-3, -3, 0, 0])).shape == (8, 8, 3)  # its context reaches the image


def test_context_pad_needs_a_square_input_wider_than_twice_the_pad(tmp_path):
    # pycaffe's crop "assumes square": a wide input failed with a broadcast error when cropping
    with pytest.raises(caffe.ShapeError, match="square"):
        caffe.Detector(*tiny_net(tmp_path, height=5, width=8), context_pad=1)
    with pytest.raises(caffe.ShapeError, match="under half the width"):
        caffe.Detector(*tiny_net(tmp_path), context_pad=3)  # pycaffe: ZeroDivisionError


def test_context_mean_may_be_integer_or_h_by_w(tmp_path):
    # pycaffe divided an integer mean in place (a numpy casting error) and transposed an H x W mean as 3-D
    detector = caffe.Detector(*tiny_net(tmp_path), mean=np.array([10, 20, 30]), raw_scale=255,
                              channel_swap=(2, 1, 0), context_pad=1)
    np.testing.assert_allclose(detector.crop_mean.reshape(3), np.array([30, 20, 10]) / 255)
    gray_mean = np.arange(36.0).reshape(6, 6)
    detector = caffe.Detector(*tiny_net(tmp_path, channels=1), mean=gray_mean, context_pad=1)
    assert detector.crop_mean.shape == (6, 6, 1)
    np.testing.assert_array_equal(detector.crop_mean[:, :, 0], gray_mean)


def test_one_channel_net_detects_on_gray_images(tmp_path):
    prototxt, weights = tiny_net(tmp_path, channels=1)
    image_file = scene(tmp_path, mode="L")
    detector = caffe.Detector(prototxt, weights, raw_scale=255)
    detections = detector.detect_windows([(image_file, [np.array([1, 2, 7, 8])])])  # pycaffe loaded 3 channels
    gray = np.asarray(Image.open(image_file), np.float32)[1:7, 2:8]
    want = caffe.Net(prototxt, weights, caffe.TEST).forward(data=np.stack([gray[None], gray[None]]))["prob"][0]
    np.testing.assert_allclose(detections[0]["prediction"], want, rtol=1e-4, atol=1e-6)


def test_selective_search_uses_the_module_when_installed(tmp_path, monkeypatch):
    detector = caffe.Detector(*tiny_net(tmp_path))
    image_file = scene(tmp_path)
    monkeypatch.setitem(sys.modules, "selective_search_ijcv_with_python", None)  # not installed
    with pytest.raises(UnsupportedError, match="selective_search_ijcv_with_python"):
        detector.detect_selective_search([image_file])
    calls = []

    def get_windows(fnames, cmd):
        calls.append((fnames, cmd))
        return [np.array([[0, 0, 6, 6], [2, 2, 9, 9]])]

    monkeypatch.setitem(sys.modules, "selective_search_ijcv_with_python", types.SimpleNamespace(get_windows=get_windows))
    detections = detector.detect_selective_search([image_file])
    assert calls == [([image_file], "selective_search_rcnn")]
    assert [d["window"].tolist() for d in detections] == [[0, 0, 6, 6], [2, 2, 9, 9]]
