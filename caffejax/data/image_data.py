"""Caffe's ImageDataLayer (image_data_layer.cpp): images named in a list file, one ``path label`` per line.

Lines end at ``\n`` only (std::getline) and each splits at its *last* space (paths may contain spaces); the
label is read like C's atoi: after C whitespace, ASCII digits only. Blank lines are skipped (Caffe keeps them as
images named "" and stops when it reaches one). Images are read as OpenCV would (BGR colour, or gray when
``is_color`` is false) from ``root_folder + path``, resized to new_height x new_width when both are set
(cv::resize, INTER_LINEAR), then transformed. The list is walked in order, from a random start below
``rand_skip`` when set, reshuffled at every pass when ``shuffle``. Tops: images (shaped by the first image of
each batch) and labels (batch_size).
"""

from __future__ import annotations

import os

import numpy as np

from caffejax.data.common import C_WHITESPACE, Batch, Prefetcher, c_atoi, layer_rng, positive_batch_size, require_source
from caffejax.data.common import resolve_path
from caffejax.data.images import read_image, resize_linear
from caffejax.data.transform import DataTransformer
from caffejax.errors import DataError, DataSourceUnavailable, SchemaError, layer_error


def parse_list(text: str) -> list[tuple[str, int]]:
    """The (path, label) pairs of a list file: each non-blank line split at its last space."""
    return [parse_line(line) for line in text.split("\n") if line.strip(C_WHITESPACE)]


def parse_line(line: str) -> tuple[str, int]:
    """One list line as (path, label), split at its last space."""
    pos = line.rfind(" ")
    # Without a space Caffe's substr(npos + 1) reads the whole line as the label and keeps it as the path.
    return (line, c_atoi(line)) if pos < 0 else (line[:pos], c_atoi(line[pos + 1:]))


class _ImageList:
    """The layer's list in reading order, and the cursor over it (lines_ and lines_id_)."""

    def __init__(self, layer, phase: int, base_dir: str | None):
        p = layer.image_data_param
        if (p.new_height == 0) != (p.new_width == 0):
            raise layer_error(SchemaError, layer.name, layer.type, "Current implementation requires new_height and "
                              f"new_width to be set at the same time (got {p.new_height} and {p.new_width})")
        self.where = f"layer '{layer.name}' (type {layer.type})"
        self.list_path = require_source(layer, p.source, base_dir, "image list")
        self.base_dirs = (base_dir, os.path.dirname(os.path.abspath(self.list_path)))
        # newline="": a lone "\r" is part of a line for std::getline, not a line break.
        with open(self.list_path, encoding="utf-8", errors="surrogateescape", newline="") as f:
            self.lines = parse_list(f.read())
        if not self.lines:
            raise DataError(f"{self.where}: image list '{self.list_path}' is empty")
        self.root_folder, self.shuffle = p.root_folder, p.shuffle
        self.size = (p.new_height, p.new_width) if p.new_height else None
        self.read_mode = "color" if p.is_color else "gray"
        list_rng, transform_rng = layer_rng(layer, phase).spawn(2)
        self.rng, self.transform_rng = list_rng, transform_rng
        if self.shuffle:
            self._shuffle()
        self.index = 0
        if p.rand_skip:
            skip = int(self.rng.integers(2**32)) % p.rand_skip
            if skip >= len(self.lines):
                raise DataError(f"{self.where}: Not enough points to skip ({skip} of {len(self.lines)})")
            self.index = skip

    def _shuffle(self) -> None:
        order = self.rng.permutation(len(self.lines))
        self.lines = [self.lines[i] for i in order]

    def image(self, index: int) -> np.ndarray:
        """The image of line ``index`` as C x H x W uint8 (ReadImageToCVMat)."""
        name = self.root_folder + self.lines[index][0]
        path = resolve_path(name, *self.base_dirs)
        if path is None:
            raise DataSourceUnavailable(f"{self.where}: Could not load {name} (listed in '{self.list_path}')")
        image = read_image(path, self.read_mode)
        if self.size is not None:
            image = resize_linear(image, *self.size)
        return image.transpose(2, 0, 1)

    def advance(self) -> None:
        self.index += 1
        if self.index >= len(self.lines):
            self.index = 0
            if self.shuffle:
                self._shuffle()


def _transformer(layer, phase: int, base_dir: str | None, rng) -> DataTransformer:
    return DataTransformer(layer.transform_param, phase, rng, base_dir, where=f"layer '{layer.name}' (type "
                           f"{layer.type})")


def top_shapes(layer, phase: int, base_dir: str | None):
    images = _ImageList(layer, phase, base_dir)
    batch_size = positive_batch_size(layer, layer.image_data_param.batch_size)
    shape = _transformer(layer, phase, base_dir, images.transform_rng).infer_shape(images.image(images.index).shape)
    return [(batch_size,) + shape, (batch_size,)]


class _ImageBatches:
    """ImageDataLayer::load_batch, run on the prefetch thread."""

    def __init__(self, layer, images: _ImageList, transformer: DataTransformer):
        self.images, self.transformer = images, transformer
        self.batch_size = positive_batch_size(layer, layer.image_data_param.batch_size)

    def __call__(self) -> Batch:
        images = self.images
        first = images.image(images.index)
        shape = self.transformer.infer_shape(first.shape)  # the first image of each batch shapes it
        data = np.empty((self.batch_size,) + shape, np.float32)
        labels = np.empty(self.batch_size, np.float32)
        for item in range(self.batch_size):
            image = first if item == 0 else images.image(images.index)
            if self.transformer.infer_shape(image.shape) != shape:
                raise DataError(f"{images.where}: {images.lines[images.index][0]} transforms to "
                                f"{self.transformer.infer_shape(image.shape)} but this batch's first image gave "
                                f"{shape}; set new_height/new_width or crop_size to give every image one shape")
            data[item] = self.transformer(image)
            labels[item] = images.lines[images.index][1]
            images.advance()
        return [data, labels]


def open_source(layer, phase: int, base_dir: str | None) -> Prefetcher:
    images = _ImageList(layer, phase, base_dir)
    batches = _ImageBatches(layer, images, _transformer(layer, phase, base_dir, images.transform_rng))
    return Prefetcher(batches, layer.data_param.prefetch, layer.name)
