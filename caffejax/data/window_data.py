"""Caffe's WindowDataLayer (window_data_layer.cpp): R-CNN style windows cut out of images and warped to
crop_size x crop_size.

The window file repeats, in tokens separated by C whitespace (as ``std::istream >>`` reads them)::

    # image_index
    image_path
    channels height width
    num_windows
    class_index overlap x1 y1 x2 y2      (num_windows lines; pixel coordinates, inclusive)

A window's image is found by position: image_index n is the (n+1)-th image the file lists, whatever number
follows its ``#``. Every image is read in colour; the channels listed for the last image shape the data top
(so they must be 3), those listed for the others are not used, nor are the heights and widths.

A window with overlap >= fg_threshold is foreground (its class must be > 0); one with overlap < bg_threshold
is background (label 0); others are dropped. Each batch draws batch_size - int(batch_size * fg_fraction)
background windows and then the foreground ones, uniformly with replacement. A window is grown by
``context_pad`` pixels of context (as measured after warping) and, with crop_mode "square", made square;
the part outside the image stays zero. The warped pixels (OpenCV's BGR, cv::resize INTER_LINEAR), mirrored
at random when ``mirror``, get ``(pixel - mean) * scale`` where scale is window_data_param.scale (as in
Caffe) and the mean is transform_param's mean_file (its centre crop_size square) or mean_value.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from caffejax.data.common import Batch, Prefetcher, c_tokens, layer_rng, positive_batch_size, require_source
from caffejax.data.common import resolve_path
from caffejax.data.images import decode_image, read_image, resize_linear
from caffejax.data.transform import read_mean_file
from caffejax.errors import DataError, SchemaError, layer_error


@dataclasses.dataclass(frozen=True)
class Window:
    image_index: int
    label: int
    overlap: float
    x1: int
    y1: int
    x2: int
    y2: int


@dataclasses.dataclass
class WindowFile:
    images: list[tuple[str, tuple[int, int, int]]]  # (path, (channels, height, width)) in the file's order
    foreground: list[Window]
    background: list[Window]
    channels: int  # of the last image listed: Caffe shapes the data top with it


# What ``std::istream >> int`` and ``>> float`` take as a whole token (Python's int() and float() also take
# "1_0", "nan", "inf" and non-ASCII digits).
_C_INT = re.compile(r"[+-]?[0-9]+")
_C_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def parse_window_file(text: str, root_folder: str, fg_threshold: float, bg_threshold: float,
                      where: str) -> WindowFile:
    """The images and the foreground/background windows of a window file.

    As in Caffe, a window's ``image_index`` is a position in the list of images, in the order the file lists
    them: the number after ``#`` is not matched against the other images' numbers. An index past the list is
    an error (Caffe would read outside its image list).
    """
    tokens = c_tokens(text)
    position = 0

    def take(kind: str) -> str:
        nonlocal position
        if position >= len(tokens):
            raise DataError(f"{where}: window file ends early (expected {kind} at token {position + 1})")
        token = tokens[position]
        position += 1
        pattern = {"int": _C_INT, "float": _C_FLOAT}.get(kind)
        if pattern is not None and not pattern.fullmatch(token):
            raise DataError(f"{where}: window file token {position} is '{token}', expected {kind}")
        return token

    def take_int() -> int:
        return int(take("int"))

    if len(tokens) < 2:
        raise DataError(f"{where}: Window file is empty")
    images, foreground, background = [], [], []
    while position < len(tokens):
        hashtag = take("'#'")
        if hashtag != "#":
            raise DataError(f"{where}: window file token {position} is '{hashtag}', expected '#'")
        image_index = take_int()
        path = root_folder + take("image path")
        images.append((path, (take_int(), take_int(), take_int())))
        for _ in range(take_int()):
            label, overlap = take_int(), np.float32(take("float"))
            window = Window(image_index, label, float(overlap), take_int(), take_int(), take_int(), take_int())
            if overlap >= np.float32(fg_threshold):
                if label <= 0:
                    raise DataError(f"{where}: foreground window of image {image_index} has class {label}; "
                                    "foreground classes must be > 0")
                foreground.append(window)
            elif overlap < np.float32(bg_threshold):
                background.append(dataclasses.replace(window, label=0, overlap=0.0))
    for window in foreground + background:
        if not 0 <= window.image_index < len(images):
            raise DataError(f"{where}: a window of image '# {window.image_index}' refers to image "
                            f"{window.image_index}, but the file lists {len(images)} images (Caffe takes the "
                            "number as a position in the list: 0, 1, 2, ...)")
    return WindowFile(images, foreground, background, images[-1][1][0])


def _c_round(x) -> int:
    """C's round(): halves away from zero."""
    return int(math.copysign(math.floor(abs(float(x)) + 0.5), float(x)))


class _WindowSampler:
    """WindowDataLayer's set-up state and its load_batch (run on the prefetch thread)."""

    def __init__(self, layer, phase: int, base_dir: str | None):
        p, t = layer.window_data_param, layer.transform_param
        self.where = f"layer '{layer.name}' (type {layer.type})"
        self.windows = _load_window_file(layer, base_dir)
        if p.crop_mode not in ("warp", "square"):
            raise layer_error(SchemaError, layer.name, layer.type, f"crop_mode '{p.crop_mode}' is not warp or square")
        if 2 * p.context_pad >= t.crop_size:
            raise layer_error(SchemaError, layer.name, layer.type,
                              f"context_pad {p.context_pad} leaves nothing of a {t.crop_size} crop")
        self.batch_size = positive_batch_size(layer, p.batch_size)
        self.crop_size, self.context_pad, self.square = int(t.crop_size), int(p.context_pad), p.crop_mode == "square"
        self.mirror, self.scale, self.fg_fraction = bool(t.mirror), np.float32(p.scale), np.float32(p.fg_fraction)
        self.base_dir = base_dir
        self.rng = layer_rng(layer, phase)
        self.cache = [self._file_bytes(image_path) for image_path, _ in self.windows.images] \
            if p.cache_images else None
        self.mean_image, self.mean_values = None, None
        if t.HasField("mean_file") and len(t.mean_value):
            raise layer_error(SchemaError, layer.name, layer.type,
                              "Cannot specify mean_file and mean_value at the same time")
        if t.HasField("mean_file"):
            self.mean_image = read_mean_file(t.mean_file, base_dir, self.where)
            self.mean_off = (self.mean_image.shape[2] - self.crop_size) // 2
            if self.mean_image.shape[0] != 3 or self.mean_off < 0 \
                    or self.mean_off + self.crop_size > min(self.mean_image.shape[1:]):
                raise DataError(f"{self.where}: the mean_file is {self.mean_image.shape} (C x H x W); WindowData "
                                f"needs 3 channels and a centre {self.crop_size}x{self.crop_size} square")
        elif len(t.mean_value):
            if len(t.mean_value) not in (1, 3):
                raise DataError(f"{self.where}: Specify either 1 mean_value or as many as channels: 3")
            self.mean_values = np.broadcast_to(np.asarray(t.mean_value, np.float32), (3,)).reshape(3, 1, 1)

    def _file_bytes(self, image_path: str) -> bytes:
        found = resolve_path(image_path, self.base_dir)
        if found is None:
            raise DataError(f"{self.where}: Could not open or find file {image_path}")
        with open(found, "rb") as f:
            return f.read()

    def _image(self, index: int) -> np.ndarray:
        image_path = self.windows.images[index][0]
        if self.cache is not None:
            return decode_image(self.cache[index], "color", image_path)
        found = resolve_path(image_path, self.base_dir)
        if found is None:
            raise DataError(f"{self.where}: Could not open or find file {image_path}")
        return read_image(found, "color")

    def __call__(self) -> Batch:
        crop = self.crop_size
        data = np.zeros((self.batch_size, 3, crop, crop), np.float32)
        labels = np.empty(self.batch_size, np.float32)
        num_fg = int(np.float32(self.batch_size) * self.fg_fraction)
        item = 0
        for pool, count, kind in ((self.windows.background, self.batch_size - num_fg, "background"),
                                  (self.windows.foreground, num_fg, "foreground")):
            for _ in range(count):
                if not pool:
                    raise DataError(f"{self.where}: the window file has no {kind} windows to sample")
                window = pool[int(self.rng.integers(2**32)) % len(pool)]
                do_mirror = self.mirror and int(self.rng.integers(2**32)) % 2 == 1
                self._warp(window, do_mirror, data[item])
                labels[item] = window.label
                item += 1
        return [data, labels]

    def _warp(self, window: Window, do_mirror: bool, out: np.ndarray) -> None:
        """Cut the window (with context) out of its image, warp it and write it into ``out`` (3 x crop x crop)."""
        image = self._image(window.image_index)
        rows, cols = image.shape[:2]
        crop = self.crop_size
        x1, y1, x2, y2 = window.x1, window.y1, window.x2, window.y2
        pad_w = pad_h = 0
        crop_w = crop_h = crop
        if self.context_pad > 0 or self.square:
            f32 = np.float32
            # Grow the box so that after warping to crop x crop exactly context_pad pixels of context surround it.
            context_scale = f32(crop) / f32(crop - 2 * self.context_pad)
            half_height, half_width = f32(y2 - y1 + 1) / f32(2), f32(x2 - x1 + 1) / f32(2)
            center_x, center_y = f32(x1) + half_width, f32(y1) + half_height
            if self.square:
                half_height = half_width = max(half_height, half_width)
            x1 = _c_round(center_x - half_width * context_scale)
            x2 = _c_round(center_x + half_width * context_scale)
            y1 = _c_round(center_y - half_height * context_scale)
            y2 = _c_round(center_y + half_height * context_scale)
            # The grown box may leave the image: clip it, and remember how much was cut off on each side.
            unclipped_height, unclipped_width = y2 - y1 + 1, x2 - x1 + 1
            pad_x1, pad_y1 = max(0, -x1), max(0, -y1)
            pad_x2, pad_y2 = max(0, x2 - cols + 1), max(0, y2 - rows + 1)
            x1, x2, y1, y2 = x1 + pad_x1, x2 - pad_x2, y1 + pad_y1, y2 - pad_y2
            if not (x1 > -1 and y1 > -1 and x2 < cols and y2 < rows and x2 >= x1 and y2 >= y1):
                raise DataError(f"{self.where}: window {window} lies outside its {cols}x{rows} image")
            scale_x, scale_y = f32(crop) / f32(unclipped_width), f32(crop) / f32(unclipped_height)
            crop_w = _c_round(f32(x2 - x1 + 1) * scale_x)
            crop_h = _c_round(f32(y2 - y1 + 1) * scale_y)
            pad_x1, pad_x2 = _c_round(f32(pad_x1) * scale_x), _c_round(f32(pad_x2) * scale_x)
            pad_h = _c_round(f32(pad_y1) * scale_y)
            pad_w = pad_x2 if do_mirror else pad_x1  # mirroring moves the cut-off margin to the other side
            crop_h = min(crop_h, crop - pad_h)  # rounding may overshoot the crop
            crop_w = min(crop_w, crop - pad_w)
        if not (0 <= x1 <= x2 < cols and 0 <= y1 <= y2 < rows) or crop_w <= 0 or crop_h <= 0:
            raise DataError(f"{self.where}: window {window} does not fit its {cols}x{rows} image")
        warped = resize_linear(image[y1:y2 + 1, x1:x2 + 1], crop_h, crop_w)
        if do_mirror:
            warped = warped[:, ::-1]
        pixels = warped.transpose(2, 0, 1).astype(np.float32)
        if self.mean_image is not None:
            top, left = self.mean_off + pad_h, self.mean_off + pad_w
            pixels = pixels - self.mean_image[:, top:top + crop_h, left:left + crop_w]
        elif self.mean_values is not None:
            pixels = pixels - self.mean_values
        out[:, pad_h:pad_h + crop_h, pad_w:pad_w + crop_w] = pixels * self.scale


def _load_window_file(layer, base_dir: str | None) -> WindowFile:
    """The layer's window file, parsed and checked (crop_size set, the data top 3 channels deep)."""
    p, t = layer.window_data_param, layer.transform_param
    if t.crop_size <= 0:
        raise layer_error(SchemaError, layer.name, layer.type, "transform_param.crop_size must be positive")
    path = require_source(layer, p.source, base_dir, "window file")
    where = f"layer '{layer.name}' (type {layer.type}): {path}"
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        windows = parse_window_file(f.read(), p.root_folder, p.fg_threshold, p.bg_threshold, where)
    if windows.channels != 3:
        # Only the last image's channels count: they shape the data top, into which Caffe writes every image
        # in colour (3 channels); a gray image listed earlier with 1 channel is read in colour all the same.
        image_path = windows.images[-1][0]
        raise DataError(f"{where}: the last image, {image_path}, is listed with {windows.channels} channels, "
                        "which shape the data top; WindowData reads every image in colour (3 channels)")
    return windows


def top_shapes(layer, phase: int, base_dir: str | None):
    """(batch_size, channels of the last listed image, crop_size, crop_size) and labels (batch_size,)."""
    windows = _load_window_file(layer, base_dir)
    batch_size = positive_batch_size(layer, layer.window_data_param.batch_size)
    crop = layer.transform_param.crop_size
    return [(batch_size, windows.channels, crop, crop), (batch_size,)]


def open_source(layer, phase: int, base_dir: str | None) -> Prefetcher:
    return Prefetcher(_WindowSampler(layer, phase, base_dir), layer.data_param.prefetch, layer.name)

