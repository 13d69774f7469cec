"""Caffe's data layers on the host: the readers behind Data (LMDB/LevelDB), ImageData, HDF5Data, MemoryData and
WindowData, and ``transform_param`` (Caffe's DataTransformer).

Each layer module offers ``top_shapes(layer, phase, base_dir)`` (the set-up shapes, from a peek at the first
record) and ``open_source(layer, phase, base_dir)`` (a DataSource: ``next_batch()`` gives one array per top,
prefetched on a background thread); :mod:`caffejax.lower.data` registers them as the layers' rules.
"""

from caffejax.data.transform import DataTransformer

__all__ = ["DataTransformer"]
