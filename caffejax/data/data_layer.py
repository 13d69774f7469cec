"""Caffe's DataLayer (data_layer.cpp): batches of ``Datum`` records read in key order from an LMDB or LevelDB,
wrapping around to the first record at the end, each passed through ``transform_param``.

A Datum holds C x H x W pixels as raw uint8 bytes (``data``), as floats (``float_data``), or as an encoded
image file (``encoded``: decoded like OpenCV, so colour channels are BGR). Tops: the images
(batch_size x C x H x W, shaped by the first record of each batch) and, with a second top, the labels
(batch_size).
"""

from __future__ import annotations

import numpy as np
from google.protobuf import message

from caffejax.data.common import Batch, Prefetcher, layer_rng, positive_batch_size, require_source
from caffejax.data.db import BACKEND_NAMES, Database, describe_key
from caffejax.data.images import decode_image
from caffejax.data.transform import DataTransformer
from caffejax.errors import DataError


def _open_database(layer, base_dir: str | None) -> Database:
    p = layer.data_param
    path = require_source(layer, p.source, base_dir, f"{BACKEND_NAMES.get(p.backend, 'database')} source")
    return Database(layer, path, p.backend)


def _transformer(layer, phase: int, base_dir: str | None) -> DataTransformer:
    return DataTransformer(layer.transform_param, phase, layer_rng(layer, phase), base_dir,
                           where=f"layer '{layer.name}' (type {layer.type})")


def datum_image(value: bytes, read_mode: str, where: str) -> tuple[np.ndarray, int]:
    """A serialized Datum as (C x H x W image, label): uint8 for raw or encoded data, float32 for float_data."""
    return datum_pixels(parse_datum(value, where), read_mode, where)


def parse_datum(value: bytes, where: str):
    from caffejax.proto import caffe_pb2

    try:
        return caffe_pb2.Datum.FromString(value)
    except message.DecodeError as e:
        raise DataError(f"{where}: not a valid Datum ({e})") from None


def datum_pixels(datum, read_mode: str, where: str) -> tuple[np.ndarray, int]:
    """A parsed Datum as (C x H x W image, label); ``read_mode`` decodes an encoded one."""
    if datum.encoded:
        return decode_image(datum.data, read_mode, where).transpose(2, 0, 1), datum.label
    shape = (datum.channels, datum.height, datum.width)
    if min(shape) <= 0:
        raise DataError(f"{where}: Datum has non-positive channels x height x width {shape}")
    count = shape[0] * shape[1] * shape[2]
    if len(datum.data):
        if len(datum.data) != count:
            raise DataError(f"{where}: Datum holds {len(datum.data)} bytes of data but channels x height x width "
                            f"{shape} needs {count}")
        return np.frombuffer(datum.data, np.uint8).reshape(shape), datum.label
    if len(datum.float_data) != count:
        raise DataError(f"{where}: Datum holds {len(datum.float_data)} float_data values but channels x height x "
                        f"width {shape} needs {count}")
    return np.asarray(datum.float_data, np.float32).reshape(shape), datum.label


def _record_image(value: bytes, transformer: DataTransformer, where: str) -> tuple[np.ndarray, int]:
    """One record as (image, label). Like Caffe, force_color/force_gray (and setting both) matter only for
    encoded Datums: a raw Datum is read as it is."""
    datum = parse_datum(value, where)
    return datum_pixels(datum, transformer.read_mode() if datum.encoded else "unchanged", where)


def top_shapes(layer, phase: int, base_dir: str | None):
    """DataLayerSetUp: the shapes the first record implies."""
    db = _open_database(layer, base_dir)
    try:
        key, value = db.first()
    finally:
        db.close()
    batch_size = positive_batch_size(layer, layer.data_param.batch_size)
    transformer = _transformer(layer, phase, base_dir)
    image, _ = _record_image(value, transformer, f"{db.where}: record {describe_key(key)}")
    shapes = [(batch_size,) + transformer.infer_shape(image.shape), (batch_size,)]
    return shapes[: len(layer.top)]


class _DatumBatches:
    """DataLayer::load_batch, run on the prefetch thread: the next batch_size records through the cursor."""

    def __init__(self, layer, db: Database, transformer: DataTransformer):
        self.db, self.transformer = db, transformer
        self.batch_size = positive_batch_size(layer, layer.data_param.batch_size)
        self.with_labels = len(layer.top) > 1
        self._cursor = None

    def __call__(self) -> Batch:
        if self._cursor is None:  # created here so it lives in the thread that advances it
            self._cursor = self.db.records()
        images, labels, shape = [], [], None
        for _ in range(self.batch_size):
            key, value = next(self._cursor)
            where = f"{self.db.where}: record {describe_key(key)}"
            image, label = _record_image(value, self.transformer, where)
            item_shape = self.transformer.infer_shape(image.shape)
            if shape is None:
                shape = item_shape  # the first record of each batch shapes it
            elif item_shape != shape:
                raise DataError(f"{where}: transforms to {item_shape} but this batch's first record gave {shape}; "
                                "every record of a batch must have the same shape")
            images.append(self.transformer(image))
            labels.append(label)
        batch = [np.stack(images)]
        if self.with_labels:
            batch.append(np.asarray(labels, np.float32))
        return batch


def open_source(layer, phase: int, base_dir: str | None) -> Prefetcher:
    db = _open_database(layer, base_dir)
    batches = _DatumBatches(layer, db, _transformer(layer, phase, base_dir))
    return Prefetcher(batches, layer.data_param.prefetch, layer.name, on_close=db.close)
