"""pycaffe's ``caffe.io``: proto <-> array conversions, the input ``Transformer``, and image helpers.

Behaviour follows BVLC's python/caffe/io.py, with Pillow and NumPy in place of scikit-image and SciPy:

- ``load_image`` gives float32 H x W x 3 RGB in [0, 1] (or H x W x 1 with ``color=False``), as
  ``skimage.img_as_float(skimage.io.imread(...))`` does with scikit-image 0.13's PIL reader (BVLC's io.py of 2017
  ran on it): CMYK becomes RGB, LA becomes RGBA, palette images their colours, and ``as_grey`` drops alpha (today's
  scikit-image reads CMYK's raw channels, LA as 2 channels and a TIFF palette's indices, and blends alpha onto white).
- ``resize_image`` is skimage's ``resize(order=1, mode='constant')`` (pixel-centre mapping, zeros beyond the
  border, output clipped to the input's range, no anti-aliasing) for 1- and 3-channel images, and
  ``scipy.ndimage.zoom`` (corner-aligned; an integer image rounded as scipy rounds) for others. Orders 0 (nearest)
  and 1 (linear) are supported.

Deliberate differences:

- ``Transformer.preprocess`` never scales the caller's array in place (pycaffe's does when the input is already
  float32 and needs no resize or channel swap).
- Where pycaffe let a numpy error through, caffejax names the problem: data that does not fit a Transformer's
  settings and crops that do not fit in ``oversample`` raise ``ShapeError``; a BlobProto or Datum whose values do not
  fill its shape raises ``BlobProtoError`` / ``DatumError``, which are also the ``ValueError`` pycaffe raised.
- A BlobProto or Datum with a negative dim is refused: pycaffe's reshape happened to take one -1 as "infer it".
- ``blobproto_to_array`` reads ``double_data`` when the blob holds it, as Caffe's ``Blob::FromProto`` does (pycaffe's
  read only ``data``); ``Transformer.set_mean`` takes any array-like (pycaffe's needed an ndarray).
"""

from __future__ import annotations

import math
import os

import numpy as np

from caffejax.errors import BlobProtoError, DatumError, ImageFileError, ShapeError, UnsupportedError, WeightsError
from caffejax.frontend import caffemodel
from caffejax.proto import caffe_pb2

# ---- proto / datum / ndarray conversion ------------------------------------------------------------------


def blobproto_to_array(blob, return_diff: bool = False) -> np.ndarray:
    """A BlobProto's data (or diff) as a float64 array of its shape (legacy 4-D when num/channels/... are set)."""
    try:
        array = caffemodel.blobproto_to_array(blob, return_diff)
    except WeightsError as error:
        raise BlobProtoError(str(error)) from error
    return array.astype(np.float64)


def array_to_blobproto(arr, diff=None):
    """An array (and optionally its diff) as a BlobProto with ``shape`` and float ``data``/``diff``."""
    arr = np.asarray(arr)
    return caffemodel.array_to_blobproto(arr.astype(np.float32),
                                         None if diff is None else np.asarray(diff, np.float32))


def arraylist_to_blobprotovector_str(arraylist) -> bytes:
    """A list of arrays as a serialized BlobProtoVector."""
    vec = caffe_pb2.BlobProtoVector()
    vec.blobs.extend([array_to_blobproto(arr) for arr in arraylist])
    return vec.SerializeToString()


def blobprotovector_str_to_arraylist(serialized: bytes) -> list[np.ndarray]:
    """A serialized BlobProtoVector as a list of arrays."""
    vec = caffe_pb2.BlobProtoVector()
    vec.ParseFromString(serialized)
    return [blobproto_to_array(blob) for blob in vec.blobs]


def array_to_datum(arr, label=None):
    """A C x H x W array as a Datum: uint8 arrays go to ``data`` (bytes), others to ``float_data``."""
    arr = np.asarray(arr)
    if arr.ndim != 3:
        raise ValueError("Incorrect array shape.")
    datum = caffe_pb2.Datum()
    datum.channels, datum.height, datum.width = arr.shape
    if arr.dtype == np.uint8:
        datum.data = arr.tobytes()
    else:
        datum.float_data.extend(arr.astype(float).flat)
    if label is not None:
        datum.label = label
    return datum


def datum_to_array(datum) -> np.ndarray:
    """A Datum's pixels as a C x H x W array (uint8 from ``data``, float64 from ``float_data``); not its label."""
    shape = (datum.channels, datum.height, datum.width)
    if len(datum.data):
        pixels, field = np.frombuffer(datum.data, dtype=np.uint8).copy(), "data bytes"  # writable, as fromstring's
    else:
        pixels, field = np.array(datum.float_data).astype(float), "float_data values"
    needed = math.prod(shape)  # exact; a negative dim is refused (pycaffe's reshape took a -1 as "infer")
    if pixels.size != needed or min(shape) < 0:
        raise DatumError(f"Datum holds {pixels.size} {field} but its shape {shape} needs {needed}")
    return pixels.reshape(shape)


# ---- pre-processing --------------------------------------------------------------------------------------


class Transformer:
    """Formats inputs for a Net and back: ``inputs`` maps input blob names to their shapes (N x K x H x W).

    ``preprocess``: to float32, resize to H x W, transpose, channel swap, ``*= raw_scale``, ``-= mean``,
    ``*= input_scale``. ``deprocess`` undoes them in reverse order (except the resize).
    """

    def __init__(self, inputs):
        self.inputs = {name: tuple(shape) for name, shape in inputs.items()}
        self.transpose = {}
        self.channel_swap = {}
        self.raw_scale = {}
        self.mean = {}
        self.input_scale = {}

    def __check_input(self, in_):
        if in_ not in self.inputs:
            raise Exception("{} is not one of the net inputs: {}".format(in_, self.inputs))

    def preprocess(self, in_, data):
        """An H' x W' x K image as the K x H x W array to write into input ``in_``."""
        self.__check_input(in_)
        caffe_in = np.array(data, dtype=np.float32)
        try:
            return self._preprocessed(in_, caffe_in)
        except (ValueError, IndexError) as error:  # numpy's axes / index / broadcast errors: the data does not fit
            raise self._misfit(in_, "preprocess", caffe_in.shape, error) from error

    def _preprocessed(self, in_, caffe_in):
        transpose = self.transpose.get(in_)
        channel_swap = self.channel_swap.get(in_)
        raw_scale = self.raw_scale.get(in_)
        mean = self.mean.get(in_)
        input_scale = self.input_scale.get(in_)
        in_dims = self.inputs[in_][2:]
        if caffe_in.shape[:2] != in_dims:
            caffe_in = resize_image(caffe_in, in_dims)
        if transpose is not None:
            caffe_in = caffe_in.transpose(transpose)
        if channel_swap is not None:
            caffe_in = caffe_in[channel_swap, :, :]
        if raw_scale is not None:
            caffe_in *= raw_scale
        if mean is not None:
            caffe_in -= mean
        if input_scale is not None:
            caffe_in *= input_scale
        return caffe_in

    def deprocess(self, in_, data):
        """Invert :meth:`preprocess`. Every axis of size 1 is squeezed first, as pycaffe does (meant for the batch
        axis of a single blob; a single-channel blob with a transpose or mean set does not fit once squeezed)."""
        self.__check_input(in_)
        decaf_in = data.copy().squeeze()
        try:
            return self._deprocessed(in_, decaf_in)
        except (ValueError, IndexError) as error:
            raise self._misfit(in_, "deprocess", np.shape(data), error, squeezed=decaf_in.shape) from error

    def _deprocessed(self, in_, decaf_in):
        transpose = self.transpose.get(in_)
        channel_swap = self.channel_swap.get(in_)
        raw_scale = self.raw_scale.get(in_)
        mean = self.mean.get(in_)
        input_scale = self.input_scale.get(in_)
        if input_scale is not None:
            decaf_in /= input_scale
        if mean is not None:
            decaf_in += mean
        if raw_scale is not None:
            decaf_in /= raw_scale
        if channel_swap is not None:
            decaf_in = decaf_in[np.argsort(channel_swap), :, :]
        if transpose is not None:
            decaf_in = decaf_in.transpose(np.argsort(transpose))
        return decaf_in

    def _misfit(self, in_, method, data_shape, error, squeezed=None) -> ShapeError:
        """The typed error for data that does not fit the input's settings (pycaffe let numpy's error through)."""
        mean = self.mean.get(in_)
        data = f"data of shape {tuple(data_shape)}"
        if squeezed is not None and squeezed != tuple(data_shape):
            data += f" (squeezed to {squeezed})"
        return ShapeError(f"Transformer.{method}('{in_}'): {data} does not fit the input {self.inputs[in_]} with "
                          f"transpose {self.transpose.get(in_)}, channel_swap {self.channel_swap.get(in_)}, "
                          f"mean of shape {None if mean is None else np.shape(mean)}: {error}")

    def set_transpose(self, in_, order):
        """The axis order taking the input image to K x H x W (e.g. (2, 0, 1) for H x W x K)."""
        self.__check_input(in_)
        if len(order) != len(self.inputs[in_]) - 1:
            raise Exception("Transpose order needs to have the same number of dimensions as the input.")
        self.transpose[in_] = order

    def set_channel_swap(self, in_, order):
        """The channel order to take after transposing ((2, 1, 0) turns RGB into BGR)."""
        self.__check_input(in_)
        if len(order) != self.inputs[in_][1]:
            raise Exception("Channel swap needs to have the same number of dimensions as the input channels.")
        self.channel_swap[in_] = order

    def set_raw_scale(self, in_, scale):
        """The factor applied before the mean (255 for models trained on [0, 255] images)."""
        self.__check_input(in_)
        self.raw_scale[in_] = scale

    def set_mean(self, in_, mean):
        """The mean to subtract: one value per channel (K,) or an image (K x H x W, or H x W)."""
        self.__check_input(in_)
        mean = np.asarray(mean)  # pycaffe needed an ndarray (a list raised AttributeError)
        ms = mean.shape
        if mean.ndim == 1:
            if ms[0] != self.inputs[in_][1]:
                raise ValueError("Mean channels incompatible with input.")
            mean = mean[:, np.newaxis, np.newaxis]
        else:
            if len(ms) == 2:
                ms = (1,) + ms
            if len(ms) != 3:
                raise ValueError("Mean shape invalid")
            if ms != self.inputs[in_][1:]:
                raise ValueError("Mean shape incompatible with input shape.")
        self.mean[in_] = mean

    def set_input_scale(self, in_, scale):
        """The factor applied after the mean is subtracted."""
        self.__check_input(in_)
        self.input_scale[in_] = scale


# ---- image IO --------------------------------------------------------------------------------------------

_RGB_TO_GRAY = np.array([0.2125, 0.7154, 0.0721])  # skimage's rgb2gray weights


def load_image(filename, color: bool = True) -> np.ndarray:
    """An image file as float32 in [0, 1]: H x W x 3 RGB, or H x W x 1 gray when ``color`` is false (colour
    images are converted with skimage's weights; alpha is dropped)."""
    try:
        from PIL import Image
    except ImportError:
        raise UnsupportedError("caffe.io.load_image needs Pillow: pip install 'caffejax[data]'") from None
    try:
        with Image.open(filename) as im:
            im.load()
            img = _image_as_float(im)
    except OSError as error:  # a missing file, or PIL's UnidentifiedImageError for a file that is no image
        raise ImageFileError(f"caffe.io.load_image: cannot read image {os.fspath(filename)!r}: "
                             f"{error.strerror or error}") from error
    if not color and img.ndim == 3:
        img = img[:, :, :3] @ _RGB_TO_GRAY
    img = img.astype(np.float32)
    if img.ndim == 2:
        img = img[:, :, np.newaxis]
        if color:
            img = np.tile(img, (1, 1, 3))
    elif img.shape[2] == 4:
        img = img[:, :, :3]
    return img


def _image_as_float(im) -> np.ndarray:
    """skimage.img_as_float of what skimage reads: 2-D for gray, H x W x 3 or 4 for colour; [0, 1] floats."""
    if im.mode == "P":
        palette = np.asarray(im.convert("RGB"))
        if "transparency" in im.info:
            im = im.convert("RGBA")
        elif (palette[:, :, 0] == palette[:, :, 1]).all() and (palette[:, :, 1] == palette[:, :, 2]).all():
            im = im.convert("L")
        else:
            im = im.convert("RGB")
    if im.mode == "1":
        return np.asarray(im, dtype=np.float64)
    if im.mode.startswith("I;16") or im.mode == "I":
        return np.asarray(im).astype(np.float64) / 65535.0
    if im.mode == "F":
        return np.asarray(im, dtype=np.float64)
    if im.mode not in ("L", "RGB", "RGBA"):
        im = im.convert("RGBA" if "A" in im.mode else "RGB")
    return np.asarray(im).astype(np.float64) / 255.0


def resize_image(im, new_dims, interp_order: int = 1) -> np.ndarray:
    """An H x W x K image resized to ``new_dims`` (height, width), as float32."""
    if interp_order not in (0, 1):
        raise UnsupportedError(f"resize_image: interp_order {interp_order} (only 0 and 1 are implemented)")
    new_dims = (int(new_dims[0]), int(new_dims[1]))
    if im.shape[-1] == 1 or im.shape[-1] == 3:
        im_min, im_max = im.min(), im.max()
        if im_max > im_min:
            # skimage only understands {1,3} channel images in [0, 1], so pycaffe scales into that range.
            im_std = (im - im_min) / (im_max - im_min)
            resized_std = _resize_pixel_centres(np.asarray(im_std, np.float64), new_dims, interp_order)
            resized_im = resized_std * (im_max - im_min) + im_min
        else:
            # the image is a constant -- avoid divide by 0
            ret = np.empty((new_dims[0], new_dims[1], im.shape[-1]), dtype=np.float32)
            ret.fill(im_min)
            return ret
    else:
        resized_im = _zoom_corners(np.asarray(im), new_dims, interp_order)
    return resized_im.astype(np.float32)


def _interpolate(a: np.ndarray, axis: int, src: np.ndarray, order: int) -> np.ndarray:
    """Sample ``a`` along ``axis`` at the (fractional) source positions ``src``, zero beyond the border."""
    n = a.shape[axis]
    shape = [1] * a.ndim
    shape[axis] = len(src)

    def take(index):
        values = np.take(a, np.clip(index, 0, n - 1), axis=axis)
        return values * ((index >= 0) & (index < n)).reshape(shape)

    if order == 0:
        return take(np.floor(src + 0.5).astype(np.int64))
    low = np.floor(src).astype(np.int64)
    weight = (src - low).reshape(shape)
    return take(low) * (1 - weight) + take(low + 1) * weight


def _resize_pixel_centres(im: np.ndarray, new_dims, order: int) -> np.ndarray:
    """skimage.transform.resize(im, new_dims, order, mode='constant'): clipped to [0, 1] (its input range)."""
    out = im
    for axis, size in enumerate(new_dims):
        n = im.shape[axis]
        src = (np.arange(size) + 0.5) * (n / size) - 0.5
        out = _interpolate(out, axis, src, order)
    return np.clip(out, 0.0, 1.0)


def _zoom_corners(im: np.ndarray, new_dims, order: int) -> np.ndarray:
    """scipy.ndimage.zoom(im, new_dims / old_dims + (1,), order): first and last pixels map onto each other.

    Summed as scipy sums, bit for bit: each neighbour's value times its row weight times its column weight, so
    that an integer image rounds its exact halves the same way."""
    values = im.astype(np.float64)
    row_taps, col_taps = (_corner_taps(n, wanted, order) for n, wanted in zip(im.shape[:2], new_dims))
    out = 0.0
    for rows, row_weights in row_taps:
        for cols, col_weights in col_taps:
            neighbours = values[rows][:, cols]
            out = out + neighbours * _along(row_weights, 0, values.ndim) * _along(col_weights, 1, values.ndim)
    return _as_dtype_rounded(out, im.dtype)


def _corner_taps(n: int, wanted: int, order: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The (source indices, weights) pairs scipy's corner-aligned zoom reads along one axis: one for nearest, two
    for linear, whose second weight is 1 minus the first (as scipy computes it, not the fraction itself)."""
    size = int(round(n * (wanted / n)))
    src = np.arange(size) * ((n - 1) / (size - 1)) if size > 1 else np.zeros(size)
    if order == 0:
        return [(np.floor(src + 0.5).astype(np.int64), np.ones(size))]
    low = np.floor(src).astype(np.int64)
    low_weight = 1.0 - (src - low)
    return [(low, low_weight), (np.minimum(low + 1, n - 1), 1.0 - low_weight)]


def _along(weights: np.ndarray, axis: int, ndim: int) -> np.ndarray:
    """``weights`` shaped to broadcast along ``axis`` of an ``ndim``-dimensional array."""
    shape = [1] * ndim
    shape[axis] = -1
    return weights.reshape(shape)


def _as_dtype_rounded(values: np.ndarray, dtype) -> np.ndarray:
    """``values`` as ``dtype`` the way scipy.ndimage stores interpolated values: into an integer type rounded half
    away from zero and clipped to its range (a plain cast would truncate: 135.9 would be 135, not scipy's 136)."""
    dtype = np.dtype(dtype)
    if not np.issubdtype(dtype, np.integer):
        return values.astype(dtype)
    limits = np.iinfo(dtype)
    return np.clip(np.trunc(values + np.copysign(0.5, values)), limits.min, limits.max).astype(dtype)


def oversample(images, crop_dims) -> np.ndarray:
    """The four corner crops and the centre crop of each H x W x K image, then the same five mirrored:
    (10 * N) x h x w x K."""
    if len(images) == 0:
        raise ShapeError("oversample: no images to crop")
    im_shape = np.array(images[0].shape)
    crop_dims = np.array(crop_dims)
    _check_crop_dims(crop_dims)
    im_center = im_shape[:2] / 2.0
    h_indices = (0, im_shape[0] - crop_dims[0])
    w_indices = (0, im_shape[1] - crop_dims[1])
    crops_ix = np.empty((5, 4), dtype=int)
    curr = 0
    for i in h_indices:
        for j in w_indices:
            crops_ix[curr] = (i, j, i + crop_dims[0], j + crop_dims[1])
            curr += 1
    crops_ix[4] = np.tile(im_center, (1, 2)) + np.concatenate([-crop_dims / 2.0, crop_dims / 2.0])
    crops_ix = np.tile(crops_ix, (2, 1))
    crops = np.empty((10 * len(images), crop_dims[0], crop_dims[1], im_shape[-1]), dtype=np.float32)
    ix = 0
    for n, im in enumerate(images):
        try:
            for crop in crops_ix:
                crops[ix] = im[crop[0]:crop[2], crop[1]:crop[3], :]
                ix += 1
        except (ValueError, IndexError) as error:  # a crop larger than the image, or not an H x W x K image
            raise ShapeError(f"oversample: image {n} of shape {np.shape(im)} does not hold the {crop_dims.tolist()} "
                             f"crops placed by the first image's shape {tuple(im_shape)}: {error}") from error
        crops[ix - 5:ix] = crops[ix - 5:ix, :, ::-1, :]  # flip for mirrors
    return crops


def _check_crop_dims(crop_dims) -> None:
    """pycaffe's oversample failed on these with a numpy index or allocation error."""
    if crop_dims.shape != (2,) or (crop_dims < 0).any():
        raise ShapeError(f"oversample: crop_dims {crop_dims.tolist()} is not a (height, width)")
