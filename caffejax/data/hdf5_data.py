"""Caffe's HDF5DataLayer and HDF5OutputLayer (hdf5_data_layer.cpp, hdf5_output_layer.cpp).

HDF5Data: ``source`` lists .h5 files (names separated by C whitespace, as ``std::istream >>`` reads them).
Each file holds one dataset per top, named like the top, all with the same number of rows; rows are served in
order (or a shuffled order, when ``shuffle``), batches run across file boundaries, and after the last file the
first comes again (the file order reshuffled when ``shuffle``). Values are read as float32; there is no
transform_param.

HDF5Output writes its two bottoms to ``file_name`` as the float datasets ``data`` and ``label``, with Caffe's
legacy 4-D shapes (num x channels x height x width, missing axes 1).
"""

from __future__ import annotations

import io
import os

import numpy as np

from caffejax.data.common import Batch, Prefetcher, c_tokens, layer_rng, lazy_import, positive_batch_size
from caffejax.data.common import require_source, resolve_path
from caffejax.errors import DataError, DataSourceUnavailable, SchemaError, layer_error
from caffejax.fileio import atomic_write
from caffejax.lower.registry import legacy_4d


class _HDF5Files:
    """The list of files, the current file's arrays, and the row cursor (HDF5DataLayer's state)."""

    def __init__(self, layer, phase: int, base_dir: str | None):
        if layer.HasField("transform_param"):
            raise layer_error(SchemaError, layer.name, layer.type, "HDF5Data does not transform data "
                              "(remove transform_param)")
        p = layer.hdf5_data_param
        self.h5py = lazy_import("h5py", layer)
        self.where = f"layer '{layer.name}' (type {layer.type})"
        self.tops = list(layer.top)
        self.shuffle = p.shuffle
        list_path = require_source(layer, p.source, base_dir, "HDF5 file list")
        with open(list_path, encoding="utf-8", errors="surrogateescape") as f:
            names = c_tokens(f.read())
        if not names:
            raise DataError(f"{self.where}: Must have at least 1 HDF5 filename listed in '{list_path}'")
        list_dir = os.path.dirname(os.path.abspath(list_path))
        self.files = []
        for name in names:
            found = resolve_path(name, base_dir, list_dir)
            if found is None:
                raise DataSourceUnavailable(f"{self.where}: HDF5 file '{name}' listed in '{list_path}' not found")
            self.files.append(found)
        self.rng = layer_rng(layer, phase)
        self.file_order = np.arange(len(self.files))
        if self.shuffle:
            self.rng.shuffle(self.file_order)
        self.current_file = 0
        self.row_shapes: list[tuple[int, ...]] | None = None

    def dataset_shapes(self, path: str) -> list[tuple[int, ...]]:
        """The shapes of the file's datasets for our tops, without reading their values."""
        with self._open(path) as f:
            return [tuple(self._dataset(f, path, top).shape) for top in self.tops]

    def load(self, path: str) -> None:
        """LoadHDF5FileData: every top's dataset as float32, and a fresh row order."""
        with self._open(path) as f:
            arrays = [np.asarray(self._dataset(f, path, top), dtype=np.float32) for top in self.tops]
        rows = arrays[0].shape[0]
        for top, array in zip(self.tops, arrays):
            if array.shape[0] != rows:
                raise DataError(f"{self.where}: {path}: dataset '{top}' has {array.shape[0]} rows but "
                                f"'{self.tops[0]}' has {rows}; every top's dataset needs the same number")
        shapes = [a.shape[1:] for a in arrays]
        if self.row_shapes is not None and shapes != self.row_shapes:
            raise DataError(f"{self.where}: {path}: rows of shapes {shapes} differ from the first file's "
                            f"{self.row_shapes}")
        if rows == 0:
            raise DataError(f"{self.where}: {path}: the datasets have no rows")
        self.row_shapes = shapes
        self.arrays = arrays
        self.row_order = np.arange(rows)
        if self.shuffle:
            self.rng.shuffle(self.row_order)
        self.current_row = 0

    def next_row(self) -> None:
        """HDF5DataLayer::Next: the next row, moving to the next file at the end of this one."""
        self.current_row += 1
        if self.current_row == self.arrays[0].shape[0]:
            if len(self.files) > 1:
                self.current_file += 1
                if self.current_file == len(self.files):
                    self.current_file = 0
                    if self.shuffle:
                        self.rng.shuffle(self.file_order)
                self.load(self.files[self.file_order[self.current_file]])
            self.current_row = 0
            if self.shuffle:
                self.rng.shuffle(self.row_order)

    def _open(self, path: str):
        try:
            return self.h5py.File(path, "r")
        except OSError as e:
            raise DataError(f"{self.where}: cannot open HDF5 file '{path}': {e}") from None

    def _dataset(self, f, path: str, top: str):
        if top not in f:
            raise DataError(f"{self.where}: {path} has no dataset '{top}' (HDF5Data reads one dataset per top, "
                            f"named like the top; the file has {sorted(f.keys())})")
        try:
            dataset = f[top]
        except (KeyError, OSError) as e:  # a soft or external link that leads nowhere
            raise DataError(f"{self.where}: {path}: dataset '{top}' cannot be opened ({e})") from None
        if not hasattr(dataset, "dtype") or dataset.dtype.kind not in "fiu":
            raise DataError(f"{self.where}: {path}: '{top}' is not a float or integer dataset")
        if dataset.ndim < 1:
            raise DataError(f"{self.where}: {path}: dataset '{top}' is a scalar; it needs at least 1 axis (rows)")
        return dataset


def top_shapes(layer, phase: int, base_dir: str | None):
    files = _HDF5Files(layer, phase, base_dir)
    batch_size = positive_batch_size(layer, layer.hdf5_data_param.batch_size)
    shapes = files.dataset_shapes(files.files[files.file_order[0]])
    return [(batch_size,) + shape[1:] for shape in shapes]


class _HDF5Batches:
    """HDF5DataLayer::Forward_cpu, run on the prefetch thread: batch_size rows, one per top."""

    def __init__(self, layer, files: _HDF5Files):
        self.files = files
        self.batch_size = positive_batch_size(layer, layer.hdf5_data_param.batch_size)
        self._loaded = False

    def __call__(self) -> Batch:
        files = self.files
        if not self._loaded:
            files.load(files.files[files.file_order[0]])
            self._loaded = True
        tops = [np.empty((self.batch_size,) + shape, np.float32) for shape in files.row_shapes]
        for i in range(self.batch_size):
            row = files.row_order[files.current_row]
            for top, array in zip(tops, files.arrays):
                top[i] = array[row]
            files.next_row()
        return tops


def open_source(layer, phase: int, base_dir: str | None) -> Prefetcher:
    return Prefetcher(_HDF5Batches(layer, _HDF5Files(layer, phase, base_dir)), layer.data_param.prefetch, layer.name)


# ---- HDF5Output ----------------------------------------------------------------------------------------------

def write_output(file_name: str, data: np.ndarray, label: np.ndarray) -> None:
    """HDF5OutputLayer::SaveBlobs: ``data`` and ``label`` as float datasets of ``file_name`` (atomically)."""
    try:
        import h5py
    except ImportError:
        raise DataError("HDF5Output needs h5py: pip install 'caffejax[hdf5]'") from None
    buffer = io.BytesIO()
    with h5py.File(buffer, "w") as f:
        f.create_dataset("data", data=np.asarray(data, np.float32).reshape(legacy_4d(data.shape)))
        f.create_dataset("label", data=np.asarray(label, np.float32).reshape(legacy_4d(label.shape)))
    atomic_write(file_name, buffer.getvalue())
