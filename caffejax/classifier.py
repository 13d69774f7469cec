"""pycaffe's ``caffe.Classifier`` and ``caffe.Detector`` (python/caffe/classifier.py, detector.py): Nets in TEST
phase that take H x W x K images (as ``caffe.io.load_image`` gives them), preprocess them with a
``caffe.io.Transformer`` and return the first output's predictions.
"""

from __future__ import annotations

import numpy as np

from caffejax import io as caffe_io
from caffejax.errors import ShapeError, UnsupportedError
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
    ``context_pad`` pixels of context filled with the mean, is warped to the net's input size."""

    def __init__(self, model_file, pretrained_file, mean=None, input_scale=None, raw_scale=None,
                 channel_swap=None, context_pad=None):
        Net.__init__(self, model_file, pretrained_file, TEST)
        self.transformer = _transformer(self, mean, input_scale, raw_scale, channel_swap)
        self.configure_crop(context_pad)

    def detect_windows(self, images_windows):
        """For (image filename, windows) pairs: a dict per window with its ``window``, ``prediction`` and
        ``filename``."""
        images_windows = [(fname, list(windows)) for fname, windows in images_windows]
        window_inputs = []
        for image_fname, windows in images_windows:
            image = caffe_io.load_image(image_fname).astype(np.float32)
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

    def detect_selective_search(self, image_fnames):
        raise UnsupportedError("Detector.detect_selective_search needs the external MATLAB selective search "
                               "tool (selective_search_ijcv_with_python); compute windows yourself and call "
                               "detect_windows")

    def crop(self, im, window):
        """The window of ``im`` (H x W x K), with context padding when configured."""
        window = np.asarray(window)
        crop = im[int(window[0]):int(window[2]), int(window[1]):int(window[3])]
        if self.context_pad:
            box = window.copy()
            crop_size = self.blobs[self.inputs[0]].width  # assumes square
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
            assert clip_h > 0 and clip_w > 0
            crop_h = round(clip_h * scale_h)
            crop_w = round(clip_w * scale_w)
            if pad_y + crop_h > crop_size:
                crop_h = crop_size - pad_y
            if pad_x + crop_w > crop_size:
                crop_w = crop_size - pad_x
            # collect with context padding and place in input with mean padding
            context_crop = im[int(box[0]):int(box[2]), int(box[1]):int(box[3])]
            context_crop = caffe_io.resize_image(context_crop, (crop_h, crop_w))
            crop = np.ones(self.crop_dims, dtype=np.float32) * self.crop_mean
            crop[int(pad_y):int(pad_y + crop_h), int(pad_x):int(pad_x + crop_w)] = context_crop
        return crop

    def configure_crop(self, context_pad):
        """The crop size in image layout, and the mean in unprocessed image space for context padding."""
        in_ = self.inputs[0]
        tpose = self.transformer.transpose[in_]
        inv_tpose = [tpose[t] for t in tpose]
        self.crop_dims = np.array(self.blobs[in_].data.shape[1:])[inv_tpose]
        self.context_pad = context_pad
        if self.context_pad:
            transpose = self.transformer.transpose.get(in_)
            channel_order = self.transformer.channel_swap.get(in_)
            raw_scale = self.transformer.raw_scale.get(in_)
            # Padding context crops needs the mean in unprocessed input space.
            mean = self.transformer.mean.get(in_)
            if mean is not None:
                inv_transpose = [transpose[t] for t in transpose]
                crop_mean = mean.copy().transpose(inv_transpose)
                if channel_order is not None:
                    channel_order_inverse = [list(channel_order).index(i) for i in range(crop_mean.shape[2])]
                    crop_mean = crop_mean[:, :, channel_order_inverse]
                if raw_scale is not None:
                    crop_mean /= raw_scale
                self.crop_mean = crop_mean
            else:
                self.crop_mean = np.zeros(self.crop_dims, dtype=np.float32)
