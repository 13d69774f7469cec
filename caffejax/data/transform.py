"""Caffe's DataTransformer (data_transformer.cpp): what ``transform_param`` does to each image a data layer
reads, before it enters the net.

For one C x H x W image ``x`` (uint8 or float), with crop offsets (h_off, w_off) and crop size c (H x W when
no crop):

    top[ch, h, w'] = (x[ch, h_off + h, w_off + w] - mean[ch, h_off + h, w_off + w]) * scale
    w' = c - 1 - w when mirrored, else w

The mean is the mean_file image (indexed at the *uncropped* position, so the crop offsets apply to it too)
or one mean_value per channel; subtraction comes before scaling. Random draws, in Caffe's order: the mirror
coin (only when ``mirror``; in both phases), then the crop offsets (only when ``crop_size`` and TRAIN; TEST
takes the centre crop). Arithmetic is float32, as Caffe's Dtype.
"""

from __future__ import annotations

import os

import numpy as np

from caffejax.errors import CaffejaxError, DataError, SchemaError
from caffejax.lower.registry import TRAIN


class DataTransformer:
    """``transform_param`` applied to C x H x W images; ``where`` names the layer in error messages."""

    def __init__(self, param, phase: int, rng: np.random.Generator, base_dir: str | None = None,
                 where: str = "transform_param"):
        self.where = where
        self.phase = phase
        self.rng = rng
        self.scale = np.float32(param.scale)
        self.mirror = bool(param.mirror)
        self.crop_size = int(param.crop_size)
        self.force_color, self.force_gray = bool(param.force_color), bool(param.force_gray)
        if param.HasField("mean_file") and len(param.mean_value):
            raise SchemaError(f"{where}: Cannot specify mean_file and mean_value at the same time")
        self.mean_image = read_mean_file(param.mean_file, base_dir, where) if param.HasField("mean_file") else None
        self.mean_values = np.asarray(param.mean_value, np.float32)

    def read_mode(self) -> str:
        """How an encoded Datum is decoded: force_color, force_gray, or the file's own channels."""
        if self.force_color and self.force_gray:
            raise SchemaError(f"{self.where}: cannot set both force_color and force_gray")
        return "color" if self.force_color else "gray" if self.force_gray else "unchanged"

    def infer_shape(self, image_shape: tuple[int, int, int]) -> tuple[int, int, int]:
        """InferBlobShape without the batch axis: (C, crop, crop) when cropping, else the image's shape."""
        channels, height, width = image_shape
        self._check_size(channels, height, width)
        if self.crop_size:
            return (channels, self.crop_size, self.crop_size)
        return (channels, height, width)

    def __call__(self, image: np.ndarray) -> np.ndarray:
        """Transform one C x H x W image (uint8 or float) into a float32 C x h x w array."""
        channels, height, width = image.shape
        self._check_size(channels, height, width)
        do_mirror = self.mirror and bool(self.rng.integers(2))
        h_off = w_off = 0
        out_h, out_w = height, width
        if self.crop_size:
            out_h = out_w = self.crop_size
            if self.phase == TRAIN:
                h_off = int(self.rng.integers(height - self.crop_size + 1))
                w_off = int(self.rng.integers(width - self.crop_size + 1))
            else:
                h_off = (height - self.crop_size) // 2
                w_off = (width - self.crop_size) // 2
        window = (slice(None), slice(h_off, h_off + out_h), slice(w_off, w_off + out_w))
        pixels = image[window].astype(np.float32)
        mean = self._mean(channels, height, width, window)
        if mean is not None:
            pixels = pixels - mean
        out = pixels * self.scale
        return np.ascontiguousarray(out[:, :, ::-1] if do_mirror else out)

    def _check_size(self, channels: int, height: int, width: int) -> None:
        if channels <= 0:
            raise DataError(f"{self.where}: image has {channels} channels")
        if height < self.crop_size or width < self.crop_size:
            raise DataError(f"{self.where}: crop_size {self.crop_size} is larger than the {height}x{width} image")

    def _mean(self, channels: int, height: int, width: int, window) -> np.ndarray | None:
        """The mean to subtract: the mean_file's pixels under the crop window, or one mean_value per channel
        (C x 1 x 1); None without either."""
        if self.mean_image is not None:
            if self.mean_image.shape != (channels, height, width):
                raise DataError(f"{self.where}: the mean_file is {self.mean_image.shape} (C x H x W) but the image "
                                f"is {(channels, height, width)}; they must be equal")
            return self.mean_image[window]
        if len(self.mean_values):
            if len(self.mean_values) not in (1, channels):
                raise DataError(f"{self.where}: Specify either 1 mean_value or as many as channels: {channels} "
                                f"(got {len(self.mean_values)})")
            return np.broadcast_to(self.mean_values, (channels,)).reshape(channels, 1, 1)
        return None


def read_mean_file(path: str, base_dir: str | None, where: str) -> np.ndarray:
    """A mean .binaryproto as C x H x W float32: the first image of a num x channels x height x width blob.

    Deliberately lenient: a blob of fewer than 4 axes is read as its trailing axes, so a C x H x W blob (what
    caffe.io.array_to_blobproto writes for one image) is one image. Caffe's legacy accessors would read it as
    num=C, channels=H, height=W, width=1 and refuse it for not matching the image.
    """
    from caffejax.data.common import resolve_path
    from caffejax.frontend.caffemodel import blobproto_to_array, read_blobproto

    found = resolve_path(path, base_dir)
    if found is None:
        raise DataError(f"{where}: mean_file '{path}' not found (looked at '{os.path.abspath(path)}'"
                        + (f" and '{os.path.join(base_dir, path)}')" if base_dir else ")"))
    try:
        mean = blobproto_to_array(read_blobproto(found))
    except CaffejaxError as e:
        raise DataError(f"{where}: mean_file: {e}") from None
    if mean.ndim > 4:
        raise DataError(f"{where}: mean_file {found} holds a {mean.ndim}-D blob {mean.shape}; Caffe reads it as "
                        "num x channels x height x width")
    mean = mean.reshape((1,) * (4 - mean.ndim) + mean.shape)
    return np.ascontiguousarray(mean[0], dtype=np.float32)
