"""pycaffe's caffe.io: conversions, Transformer, load_image, resize_image, oversample."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import caffejax as caffe
from caffejax.proto import caffe_pb2

Image = pytest.importorskip("PIL.Image")


# ---- proto conversions -----------------------------------------------------------------------------------------

def test_blobproto_round_trip_keeps_shape_and_values():
    arr = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4) / 3
    diff = -arr
    blob = caffe.io.array_to_blobproto(arr, diff)
    assert list(blob.shape.dim) == [2, 3, 4] and not blob.HasField("num")
    back = caffe.io.blobproto_to_array(blob)
    assert back.dtype == np.float64  # pycaffe's np.array of the repeated floats
    np.testing.assert_array_equal(back, arr)
    np.testing.assert_array_equal(caffe.io.blobproto_to_array(blob, return_diff=True), diff)
    # float64 input is still stored in the float field, as pycaffe does
    assert len(caffe.io.array_to_blobproto(arr.astype(np.float64)).data) == arr.size


def test_legacy_4d_blobproto_reads_num_channels_height_width():
    blob = caffe_pb2.BlobProto(num=1, channels=2, height=1, width=3)
    blob.data.extend([1, 2, 3, 4, 5, 6])
    np.testing.assert_array_equal(caffe.io.blobproto_to_array(blob), np.arange(1, 7).reshape(1, 2, 1, 3))


def test_blobproto_whose_values_do_not_fill_its_shape_is_a_value_error():
    # BVLC's python/caffe/test/test_io.py (test_no_shape, test_scalar): no shape holds one value, and pycaffe's
    # reshape raised ValueError for more; caffejax's error is a WeightsError and that ValueError.
    blob = caffe_pb2.BlobProto()
    blob.data.extend([0.0] * 100)
    with pytest.raises(ValueError, match="100 values"):
        caffe.io.blobproto_to_array(blob)
    with pytest.raises(caffe.WeightsError):
        caffe.io.blobproto_to_array(blob)
    scalar = caffe_pb2.BlobProto()
    scalar.data.append(123)
    assert caffe.io.blobproto_to_array(scalar) == 123


def test_blobprotovector_string_round_trip():
    arrays = [np.ones((2, 2), np.float32), np.arange(3, dtype=np.float32)]
    serialized = caffe.io.arraylist_to_blobprotovector_str(arrays)
    assert isinstance(serialized, bytes)
    back = caffe.io.blobprotovector_str_to_arraylist(serialized)
    assert len(back) == 2
    for a, b in zip(arrays, back):
        np.testing.assert_array_equal(a, b)


def test_datum_round_trip_uint8_and_float():
    pixels = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    datum = caffe.io.array_to_datum(pixels, label=3)
    assert (datum.channels, datum.height, datum.width, datum.label) == (2, 3, 4, 3)
    assert datum.data == pixels.tobytes() and not len(datum.float_data)
    back = caffe.io.datum_to_array(datum)
    assert back.dtype == np.uint8
    np.testing.assert_array_equal(back, pixels)
    back[0, 0, 0] = 99  # a writable copy, as np.fromstring gave
    values = pixels.astype(np.float32) / 2
    datum = caffe.io.array_to_datum(values)
    assert not datum.HasField("label") and not len(datum.data)
    np.testing.assert_array_equal(caffe.io.datum_to_array(datum), values)
    with pytest.raises(ValueError):
        caffe.io.array_to_datum(np.zeros((2, 2)))


def test_datum_whose_pixels_do_not_fill_its_shape_is_a_data_error():
    datum = caffe.io.array_to_datum(np.zeros((2, 3, 4), np.uint8))
    datum.height = 4  # 24 bytes for a 2 x 4 x 4 shape: pycaffe's reshape raised a bare ValueError
    with pytest.raises(caffe.DataError, match="24 data bytes .* needs 32"):
        caffe.io.datum_to_array(datum)
    with pytest.raises(ValueError):
        caffe.io.datum_to_array(datum)
    floats = caffe.io.array_to_datum(np.zeros((1, 2, 2), np.float32))
    floats.channels = -1  # pycaffe's reshape took -1 as "infer"; a negative dim is a corrupted datum
    with pytest.raises(caffe.DataError, match="float_data"):
        caffe.io.datum_to_array(floats)


# ---- Transformer -------------------------------------------------------------------------------------------------

def imagenet_style_transformer(shape=(1, 3, 4, 5)):
    t = caffe.io.Transformer({"data": shape})
    t.set_transpose("data", (2, 0, 1))
    t.set_channel_swap("data", (2, 1, 0))
    t.set_raw_scale("data", 255)
    t.set_mean("data", np.array([104.0, 117.0, 123.0]))
    t.set_input_scale("data", 0.5)
    return t


def test_preprocess_is_transpose_swap_raw_scale_mean_input_scale_in_that_order():
    image = np.random.default_rng(0).random((4, 5, 3)).astype(np.float32)
    before = image.copy()
    t = imagenet_style_transformer()
    got = t.preprocess("data", image)
    expected = (image.transpose(2, 0, 1)[::-1] * 255 - np.array([104, 117, 123])[:, None, None]) * 0.5
    assert got.dtype == np.float32 and got.shape == (3, 4, 5)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-4)
    np.testing.assert_array_equal(image, before)  # the caller's image is untouched
    np.testing.assert_allclose(t.deprocess("data", got[None]), image, atol=1e-6)


def test_preprocess_resizes_to_the_input_size():
    t = caffe.io.Transformer({"data": (1, 3, 4, 6)})
    t.set_transpose("data", (2, 0, 1))
    image = np.random.default_rng(1).random((8, 12, 3)).astype(np.float32)
    np.testing.assert_allclose(t.preprocess("data", image),
                               caffe.io.resize_image(image, (4, 6)).transpose(2, 0, 1))


def test_transformer_rejects_what_pycaffe_rejects():
    t = caffe.io.Transformer({"data": (1, 3, 4, 5)})
    with pytest.raises(Exception, match="not one of the net inputs"):
        t.set_raw_scale("label", 1)
    with pytest.raises(Exception, match="Transpose order"):
        t.set_transpose("data", (1, 0))
    with pytest.raises(Exception, match="Channel swap"):
        t.set_channel_swap("data", (1, 0))
    with pytest.raises(ValueError, match="Mean channels"):
        t.set_mean("data", np.zeros(4))
    with pytest.raises(ValueError, match="incompatible with input shape"):
        t.set_mean("data", np.zeros((3, 2, 2)))
    t.set_mean("data", np.ones((3, 4, 5)))  # an elementwise mean of the input's shape is fine
    np.testing.assert_array_equal(t.mean["data"], np.ones((3, 4, 5)))


def test_set_mean_takes_a_list():
    t = caffe.io.Transformer({"data": (1, 3, 2, 2)})
    t.set_transpose("data", (2, 0, 1))
    t.set_mean("data", [1.0, 2.0, 3.0])  # pycaffe's mean.shape raised AttributeError
    np.testing.assert_array_equal(t.preprocess("data", np.zeros((2, 2, 3), np.float32))[:, 0, 0], [-1, -2, -3])


def test_data_that_does_not_fit_the_transformer_is_a_shape_error():
    t = imagenet_style_transformer()
    gray = np.zeros((4, 5, 1), np.float32)  # pycaffe: IndexError from the channel swap
    with pytest.raises(caffe.ShapeError, match=r"preprocess\('data'\): data of shape \(4, 5, 1\)"):
        t.preprocess("data", gray)
    single_channel = caffe.io.Transformer({"data": (1, 1, 4, 5)})
    single_channel.set_transpose("data", (2, 0, 1))
    blob = single_channel.preprocess("data", gray)[np.newaxis]
    # pycaffe's deprocess squeezes the channel axis too, then its transpose raised a bare ValueError
    with pytest.raises(caffe.ShapeError, match=r"squeezed to \(4, 5\)"):
        single_channel.deprocess("data", blob)


# ---- images --------------------------------------------------------------------------------------------------------

def test_load_image_gives_float_rgb_in_unit_range(tmp_path):
    rgba = np.random.default_rng(2).integers(0, 256, (3, 4, 4), dtype=np.uint8)
    Image.fromarray(rgba).save(tmp_path / "rgba.png")
    Image.fromarray(rgba[:, :, 0]).save(tmp_path / "gray.png")
    color = caffe.io.load_image(str(tmp_path / "rgba.png"))
    assert color.dtype == np.float32 and color.shape == (3, 4, 3)  # alpha dropped
    np.testing.assert_allclose(color, rgba[:, :, :3] / 255.0, rtol=1e-6)
    gray_as_color = caffe.io.load_image(str(tmp_path / "gray.png"))
    np.testing.assert_allclose(gray_as_color, np.repeat(rgba[:, :, :1], 3, axis=2) / 255.0, rtol=1e-6)
    gray = caffe.io.load_image(str(tmp_path / "gray.png"), color=False)
    assert gray.shape == (3, 4, 1)
    as_gray = caffe.io.load_image(str(tmp_path / "rgba.png"), color=False)
    luma = rgba[:, :, :3] / 255.0 @ np.array([0.2125, 0.7154, 0.0721])  # skimage's rgb2gray
    np.testing.assert_allclose(as_gray[:, :, 0], luma, rtol=1e-6)


def test_resize_image_upsamples_with_pixel_centres_and_zero_beyond_the_border():
    im = np.array([[[2.0], [4.0]]], np.float32)  # 1 x 2 x 1
    got = caffe.io.resize_image(im, (1, 4))[0, :, 0]
    # Standardised to [0, 1]: sources at x = -0.25, 0.25, 0.75, 1.25; outside pixels count as 0.
    np.testing.assert_allclose(got, 2 + 2 * np.array([0.0, 0.25, 0.75, 0.75]), rtol=1e-6)
    flat = caffe.io.resize_image(np.full((2, 2, 3), 5.0), (3, 3))
    assert flat.shape == (3, 3, 3) and (flat == 5).all()


def test_resize_image_matches_scipy_ndimage():
    ndimage = pytest.importorskip("scipy.ndimage")
    rng = np.random.default_rng(3)
    im = rng.random((5, 7, 3)).astype(np.float32) * 10 - 2
    lo, hi = im.min(), im.max()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = ndimage.zoom((im - lo) / (hi - lo), (9 / 5, 4 / 7, 1), order=1, mode="grid-constant", grid_mode=True)
    np.testing.assert_allclose(caffe.io.resize_image(im, (9, 4)), np.clip(ref, 0, 1) * (hi - lo) + lo,
                               rtol=1e-5, atol=1e-5)
    two_channels = rng.random((5, 7, 2)).astype(np.float32)
    np.testing.assert_allclose(caffe.io.resize_image(two_channels, (8, 3)),
                               ndimage.zoom(two_channels, (8 / 5, 3 / 7, 1), order=1), rtol=1e-5, atol=1e-6)


def test_resize_image_rounds_integer_images_as_scipy_zoom():
    im = np.array([[[208, 33], [96, 156]]], np.uint8)  # 2 channels: scipy.ndimage.zoom's path
    got = caffe.io.resize_image(im, (1, 7))
    # scipy.ndimage.zoom(im, (1, 3.5, 1), order=1)'s result: rounded, not truncated (170.67 is 171), and the tie
    # 33 * 5/6 + 156 / 6 = 53.5 is 53, as scipy sums it with its weights (1 - 1/6, and 1 minus that).
    np.testing.assert_array_equal(got[0, :, 0], [208, 189, 171, 152, 133, 115, 96])
    np.testing.assert_array_equal(got[0, :, 1], [33, 53, 74, 95, 115, 136, 156])


def test_oversample_crops_that_do_not_fit_are_a_shape_error():
    im = np.zeros((4, 4, 1), np.float32)
    with pytest.raises(caffe.ShapeError, match="image 0 of shape"):
        caffe.io.oversample([im], (5, 2))  # pycaffe: a bare numpy broadcast error
    with pytest.raises(caffe.ShapeError, match=r"image 1 of shape \(2, 4, 1\)"):
        caffe.io.oversample([im, im[:2]], (2, 2))  # the crops are placed by the first image's shape
    with pytest.raises(caffe.ShapeError, match="crop_dims"):
        caffe.io.oversample([im], (2, -1))
    # A size-1 axis broadcasts across a larger crop in pycaffe, so that still works.
    column = np.arange(2, dtype=np.float32).reshape(2, 1, 1)
    np.testing.assert_array_equal(caffe.io.oversample([column], (1, 3))[0, :, :, 0], [[0, 0, 0]])


def test_oversample_takes_corners_centre_and_their_mirrors():
    im = np.arange(4 * 4, dtype=np.float32).reshape(4, 4, 1)
    crops = caffe.io.oversample([im, im + 100], (2, 2))
    assert crops.shape == (20, 2, 2, 1)
    corners = [im[0:2, 0:2], im[0:2, 2:4], im[2:4, 0:2], im[2:4, 2:4], im[1:3, 1:3]]
    for k, want in enumerate(corners):
        np.testing.assert_array_equal(crops[k], want)
        np.testing.assert_array_equal(crops[5 + k], want[:, ::-1])
        np.testing.assert_array_equal(crops[10 + k], want + 100)


def test_load_image_names_a_missing_or_unreadable_file(tmp_path):
    """An ImageFileError (an OSError, as pycaffe's was) naming the file, not PIL's own error from inside it."""
    pytest.importorskip("PIL")
    from caffejax.errors import ImageFileError

    (tmp_path / "notes.jpg").write_bytes(b"not an image")
    for path, reason in ((tmp_path / "missing.png", "No such file or directory"),
                         (tmp_path / "notes.jpg", "cannot identify")):
        with pytest.raises(ImageFileError, match=f"cannot read image '{path}': {reason}") as error:
            caffe.io.load_image(str(path))
        assert isinstance(error.value, OSError)
