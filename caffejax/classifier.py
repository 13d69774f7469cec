"""pycaffe's ``caffe.Classifier`` and ``caffe.Detector`` (python/caffe/classifier.py, detector.py): Nets in TEST
phase that take H x W x K images (as ``caffe.io.load_image`` gives them), preprocess them with a
``caffe.io.Transformer`` and return the first output's predictions.
"""

from __future__ import annotations

import os

import numpy as np

from caffejax import io as caffe_io
from caffejax.errors import DetectorWindowError, ShapeError, UnsupportedError
from caffejax.lower.registry import TEST
from caffejax.runtime.net import Net


def _transformer(net: Net, mean, input_scale, raw_scale, channel_swap) -> caffe_io.Transformer:
    """The Transformer both classes configure: H x W x K images in, the first input's layout out."""
    in_ = net.inputs[0]
    transformer = caffe_io.Transformer({in_: net.blobs[in_].data.shape})
    transformer.set_transpose(in_, (2, 0, 1))
    if mean is not None:
        transformer.set_mean(in_, mean)
    if input_scale is not None:
        transformer.set_input_scale(in_, input_scale)
    if raw_scale is not None:
        transformer.set_raw_scale(in_, raw_scale)
    if channel_swap is not None:
        transformer.set_channel_swap(in_, channel_swap)
    return transformer


class Classifier(Net):
    """Classify images: resize to ``image_dims``, take the centre crop (or the 10 oversampled crops) of the
    net's input size, preprocess, and average the predictions over the crops.

    ``mean``, ``input_scale``, ``raw_scale`` and ``channel_swap`` configure the Transformer (see caffe.io).
    ``image_dims`` may also be an array (pycaffe's ``if not image_dims`` raised for one).
    """

    def __init__(self, model_file, pretrained_file, image_dims=None, mean=None, input_scale=None,
                 raw_scale=None, channel_swap=None):
        Net.__init__(self, model_file, pretrained_file, TEST)
        self.transformer = _transformer(self, mean, input_scale, raw_scale, channel_swap)
        self.crop_dims = np.array(self.blobs[self.inputs[0]].data.shape[2:])
        if image_dims is None or len(image_dims) == 0:
            image_dims = self.crop_dims
        self.image_dims = image_dims

    def predict(self, inputs, oversample: bool = True) -> np.ndarray:
        """Predictions (N x classes) for an iterable of H x W x K images."""
        input_ = np.zeros((len(inputs), self.image_dims[0], self.image_dims[1], inputs[0].shape[2]),
                          dtype=np.float32)
        for ix, in_ in enumerate(inputs):
            input_[ix] = caffe_io.resize_image(in_, self.image_dims)
        if oversample:
            input_ = caffe_io.oversample(input_, self.crop_dims)
        else:
            self._check_centre_crop_fits()
            center = np.array(self.image_dims) / 2.0
            crop = np.tile(center, (1, 2))[0] + np.concatenate([-self.crop_dims / 2.0, self.crop_dims / 2.0])
            crop = crop.astype(int)
            input_ = input_[:, crop[0]:crop[2], crop[1]:crop[3], :]
        caffe_in = np.zeros(np.array(input_.shape)[[0, 3, 1, 2]], dtype=np.float32)
        for ix, in_ in enumerate(input_):
            caffe_in[ix] = self.transformer.preprocess(self.inputs[0], in_)
        out = self.forward_all(**{self.inputs[0]: caffe_in})
        predictions = out[self.outputs[0]]
        if oversample:
            predictions = predictions.reshape((len(predictions) // 10, 10, -1)).mean(1)
        return predictions

    def _check_centre_crop_fits(self):
        """The centre crop of the net's input size is taken from the images resized to image_dims, so those must
        hold it (pycaffe failed with a numpy broadcast error; the oversampled crops are checked by oversample)."""
        if (np.asarray(self.image_dims[:2]) < self.crop_dims).any():
            raise ShapeError(f"Classifier.predict: image_dims {tuple(int(d) for d in self.image_dims)} is smaller "
                             f"than the net's input {tuple(self.crop_dims.tolist())}: no centre crop of that size")


class Detector(Net):
    """Classify windows of images (R-CNN style): each window (ymin, xmin, ymax, xmax), optionally grown by
    ``context_pad`` pixels of context filled with the mean, is warped to the net's input size.

    Deliberate differences from pycaffe: a window's negative coordinates are clipped to the image (pycaffe's
    numpy slicing wrapped them around to the far side); images for a one-channel net are loaded as gray
    (pycaffe always loaded colour, which a one-channel net cannot take); bad windows and unreadable images
    raise :class:`~caffejax.errors.DetectorWindowError` and :class:`~caffejax.errors.ImageFileError` where
    pycaffe failed in numpy, skimage or an assert; context padding needs a square input wider than twice the
    pad (pycaffe's crop "assumes square" and miscropped or failed otherwise).
    """

    def __init__(self, model_file, pretrained_file, mean=None, input_scale=None, raw_scale=None,
                 channel_swap=None, context_pad=None):
        Net.__init__(self, model_file, pretrained_file, TEST)
        self.transformer = _transformer(self, mean, input_scale, raw_scale, channel_swap)
        self.configure_crop(context_pad)

    def detect_windows(self, images_windows):
        """For (image filename, windows) pairs: a dict per window with its ``window``, ``prediction`` and
        ``filename``."""
        # Listed once: pycaffe walked images_windows twice, so an iterator (a zip) gave no detections.
        images_windows = [(fname, list(windows)) for fname, windows in images_windows]
        if not any(windows for _, windows in images_windows):
            raise DetectorWindowError("Detector.detect_windows: no windows to detect in")
        window_inputs = []
        for image_fname, windows in images_windows:
            image = self._load_image(image_fname)
            for window in windows:
                window_inputs.append(self.crop(image, window))
        in_ = self.inputs[0]
        caffe_in = np.zeros((len(window_inputs), window_inputs[0].shape[2]) + self.blobs[in_].data.shape[2:],
                            dtype=np.float32)
        for ix, window_in in enumerate(window_inputs):
            caffe_in[ix] = self.transformer.preprocess(in_, window_in)
        out = self.forward_all(**{in_: caffe_in})
        predictions = out[self.outputs[0]]
        detections = []
        ix = 0
        for image_fname, windows in images_windows:
            for window in windows:
                detections.append({"window": window, "prediction": predictions[ix], "filename": image_fname})
                ix += 1
        return detections

    def _load_image(self, image_fname) -> np.ndarray:
        """The image as caffe.io loads it: colour, or gray for a net whose input has one channel."""
        color = self.blobs[self.inputs[0]].data.shape[1] != 1
        return caffe_io.load_image(image_fname, color=color).astype(np.float32)  # ImageFileError names the file

    def detect_selective_search(self, image_fnames):
        """Detections over the Selective Search proposals of each image (R-CNN's ``selective_search_rcnn``),
        computed by the external selective_search_ijcv_with_python package (which runs MATLAB)."""
        try:
            import selective_search_ijcv_with_python as selective_search
        except ImportError:
            raise UnsupportedError("Detector.detect_selective_search needs the selective search module "
                                   "selective_search_ijcv_with_python (github.com/sergeyk/"
                                   "selective_search_ijcv_with_python, which runs MATLAB); without it, compute "
                                   "windows yourself and call detect_windows") from None
        # Absolute paths, so MATLAB finds the files.
        image_fnames = [os.path.abspath(f) for f in image_fnames]
        windows_list = selective_search.get_windows(image_fnames, cmd="selective_search_rcnn")
        return self.detect_windows(zip(image_fnames, windows_list))

    def crop(self, im, window):
        """The window of ``im`` (H x W x K), with context padding when configured. Without context the window
        is the slice [ymin:ymax, xmin:xmax]; with it, R-CNN's inclusive box [ymin..ymax, xmin..xmax]."""
        window = self._checked_window(window)
        if not self.context_pad:
            ymin, xmin, ymax, xmax = (max(0, int(c)) for c in window)
            crop = im[ymin:ymax, xmin:xmax]
            if crop.shape[0] == 0 or crop.shape[1] == 0:
                raise self._outside_error(window, im, "")
            return crop
        box = window.astype(np.float64)
        crop_size = self.blobs[self.inputs[0]].width  # square (configure_crop checks)
        scale = crop_size / (1. * crop_size - self.context_pad * 2)
        # Crop a box + surrounding context.
        half_h = (box[2] - box[0] + 1) / 2.
        half_w = (box[3] - box[1] + 1) / 2.
        center = (box[0] + half_h, box[1] + half_w)
        scaled_dims = scale * np.array((-half_h, -half_w, half_h, half_w))
        box = np.round(np.tile(center, 2) + scaled_dims)
        full_h = box[2] - box[0] + 1
        full_w = box[3] - box[1] + 1
        scale_h = crop_size / full_h
        scale_w = crop_size / full_w
        pad_y = round(max(0, -box[0]) * scale_h)  # amount out-of-bounds
        pad_x = round(max(0, -box[1]) * scale_w)
        # Clip box to image dimensions.
        im_h, im_w = im.shape[:2]
        box = np.clip(box, 0., [im_h, im_w, im_h, im_w])
        clip_h = box[2] - box[0] + 1
        clip_w = box[3] - box[1] + 1
        crop_h = round(clip_h * scale_h)
        crop_w = round(clip_w * scale_w)
        if pad_y + crop_h > crop_size:
            crop_h = crop_size - pad_y
        if pad_x + crop_w > crop_size:
            crop_w = crop_size - pad_x
        # collect with context padding and place in input with mean padding
        context_crop = im[int(box[0]):int(box[2]), int(box[1]):int(box[3])]
        if context_crop.shape[0] == 0 or context_crop.shape[1] == 0 or crop_h < 1 or crop_w < 1:
            # pycaffe failed in its assert, or in skimage's resize of an empty crop or to an empty size
            raise self._outside_error(window, im, f" with its context ({self.context_pad} pixels)")
        context_crop = caffe_io.resize_image(context_crop, (crop_h, crop_w))
        crop = np.ones(self.crop_dims, dtype=np.float32) * self.crop_mean
        crop[int(pad_y):int(pad_y + crop_h), int(pad_x):int(pad_x + crop_w)] = context_crop
        return crop

    @staticmethod
    def _checked_window(window) -> np.ndarray:
        """The window as an array of four coordinates in order (ymin <= ymax, xmin <= xmax)."""
        coords = np.asarray(window)
        if coords.shape != (4,) or not np.issubdtype(coords.dtype, np.number) or not np.isfinite(coords).all():
            raise DetectorWindowError(f"Detector: a window is four finite numbers (ymin, xmin, ymax, xmax); "
                                      f"got {window!r}")
        if coords[0] > coords[2] or coords[1] > coords[3]:
            raise DetectorWindowError(f"Detector: window {coords.tolist()} is out of order: it must be "
                                      f"(ymin, xmin, ymax, xmax) with ymin <= ymax and xmin <= xmax")
        return coords

    @staticmethod
    def _outside_error(window, im, context) -> DetectorWindowError:
        return DetectorWindowError(f"Detector: window {window.tolist()}{context} has no pixel of the "
                                   f"{im.shape[0]} x {im.shape[1]} image to crop (or too few for the net's input)")

    def configure_crop(self, context_pad):
        """The crop size in image layout, and the mean in unprocessed image space for context padding."""
        in_ = self.inputs[0]
        tpose = self.transformer.transpose[in_]
        inv_tpose = [tpose[t] for t in tpose]
        self.crop_dims = np.array(self.blobs[in_].data.shape[1:])[inv_tpose]
        self.context_pad = context_pad
        if self.context_pad:
            self._check_context_fits()
            transpose = self.transformer.transpose.get(in_)
            channel_order = self.transformer.channel_swap.get(in_)
            raw_scale = self.transformer.raw_scale.get(in_)
            # Padding context crops needs the mean in unprocessed input space.
            mean = self.transformer.mean.get(in_)
            if mean is not None:
                # As floats (an integer mean could not be divided in place), with the channel axis an H x W
                # mean lacks.
                crop_mean = np.array(mean, dtype=np.float64).reshape((-1,) + mean.shape[-2:])
                inv_transpose = [transpose[t] for t in transpose]
                crop_mean = crop_mean.transpose(inv_transpose)
                if channel_order is not None:
                    channel_order_inverse = [list(channel_order).index(i) for i in range(crop_mean.shape[2])]
                    crop_mean = crop_mean[:, :, channel_order_inverse]
                if raw_scale is not None:
                    crop_mean /= raw_scale
                self.crop_mean = crop_mean
            else:
                self.crop_mean = np.zeros(self.crop_dims, dtype=np.float32)

    def _check_context_fits(self):
        """Context padding warps each box to a square crop_size = the input's width, with context_pad pixels of
        context on every side, so the input must be square and wider than twice the pad."""
        height, width = self.blobs[self.inputs[0]].data.shape[2:]
        if height != width:
            raise ShapeError(f"Detector: context_pad needs a square input; the net's is {height} x {width}")
        if 2 * self.context_pad >= width:
            raise ShapeError(f"Detector: context_pad {self.context_pad} leaves no room for the window in the "
                             f"net's {height} x {width} input (it must be under half the width)")
