"""Caffe's MemoryDataLayer (memory_data_layer.cpp) fed through pycaffe's ``net.set_input_arrays(data, labels)``.

The user's arrays are used in place, as Caffe points its tops at them: ``data`` is N x C x H x W float32,
C-contiguous, with C, H, W from memory_data_param; ``labels`` has N entries (1-D, or N x 1 x 1 x 1 as
pycaffe passes them on); N is a multiple of batch_size. Each forward takes the next batch_size rows, going
back to the first row after the last. No transform_param is applied (Caffe's Reset does not transform).
Tops: data (batch_size x C x H x W) and labels, which Caffe's Forward reshapes to batch_size x 1 x 1 x 1.
"""

from __future__ import annotations

import numpy as np

from caffejax.errors import DataError, InputArraysError, InputArraysShapeError, SchemaError, layer_error


def top_shapes(layer, phase: int, base_dir: str | None):
    """MemoryData's set-up shapes: data (batch, channels, height, width) and label (batch,)."""
    p = layer.memory_data_param
    dims = (p.batch_size, p.channels, p.height, p.width)
    if any(d <= 0 for d in dims):
        raise layer_error(SchemaError, layer.name, layer.type,
                          f"batch_size, channels, height and width must be positive, got {dims}")
    return [dims, (p.batch_size,)][: len(layer.top)]


class MemorySource:
    """The arrays last given to :meth:`reset` and the row position (MemoryDataLayer's data_, labels_, pos_)."""

    def __init__(self, layer):
        p = layer.memory_data_param
        self.where = f"layer '{layer.name}' (type {layer.type})"
        self.batch_size, self.item_shape = p.batch_size, (p.channels, p.height, p.width)
        self._data = self._labels = None
        self._pos = 0

    def reset(self, data, labels) -> None:
        """pycaffe's set_input_arrays checks (each a RuntimeError there, and here too), then
        MemoryDataLayer::Reset."""
        if not isinstance(data, np.ndarray) or not isinstance(labels, np.ndarray):
            raise InputArraysError(f"{self.where}: set_input_arrays takes NumPy arrays")
        if labels.ndim == 1:
            labels = np.ascontiguousarray(labels[:, np.newaxis, np.newaxis, np.newaxis])
        for name, array, dims in (("data array", data, self.item_shape), ("labels array", labels, (1, 1, 1))):
            if not array.flags.c_contiguous:
                raise InputArraysError(f"{self.where}: {name} must be C contiguous")
            if array.ndim != 4:
                raise InputArraysShapeError(f"{self.where}: {name} must be 4-d, got shape {array.shape}")
            if array.dtype != np.float32:
                raise InputArraysError(f"{self.where}: {name} must be float32, got {array.dtype}")
            if array.shape[1:] != dims:
                raise InputArraysShapeError(f"{self.where}: {name} is {array.shape}; its channels x height x width "
                                            f"must be {dims}")
        if data.shape[0] != labels.shape[0]:
            raise InputArraysShapeError(f"{self.where}: data and labels must have the same first dimension "
                                        f"({data.shape[0]} vs {labels.shape[0]})")
        if data.shape[0] == 0 or data.shape[0] % self.batch_size:
            raise InputArraysShapeError(f"{self.where}: first dimensions of input arrays must be a multiple of batch "
                                        f"size {self.batch_size}, got {data.shape[0]}")
        self._data, self._labels, self._pos = data, labels, 0

    def next_batch(self) -> list[np.ndarray]:
        if self._data is None:
            raise DataError(f"{self.where}: MemoryDataLayer needs to be initialized by calling Reset: call "
                            "net.set_input_arrays(data, labels) before forward")
        rows = slice(self._pos, self._pos + self.batch_size)
        self._pos = (self._pos + self.batch_size) % self._data.shape[0]
        return [self._data[rows], self._labels[rows]]

    def close(self) -> None:
        self._data = self._labels = None


def open_source(layer, phase: int, base_dir: str | None) -> MemorySource:
    return MemorySource(layer)
