"""Reading and writing trained weights: binary ``.caffemodel`` / ``.binaryproto`` and Caffe's HDF5 layout.

A caffemodel is a NetParameter whose layers carry their learnable blobs. Parsing hundreds of MB of floats
through protobuf's repeated fields would copy every weight twice and walk it in Python, so the blob
payloads are located directly in the wire format: the file is memory-mapped, each BlobProto's packed
``data`` field becomes a NumPy view of the mapping (no copy), and only the small remainder of every layer
(name, type, params) goes through protobuf. Legacy V1 files (NetParameter field ``layers``) are read the
same way; the caller upgrades them.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
from typing import Iterator

import numpy as np
from google.protobuf import message

from caffejax.errors import CaffejaxError, ParseError, WeightsError
from caffejax.fileio import read_bytes
from caffejax.proto import caffe_pb2

# Field numbers from caffe.proto.
_NET_LAYER, _NET_LAYERS_V1 = 100, 2
_LAYER_NAME, _LAYER_BLOBS = 1, 7          # LayerParameter
_V1_NAME, _V1_BLOBS = 4, 6                # V1LayerParameter
_BLOB_NUM, _BLOB_CHANNELS, _BLOB_HEIGHT, _BLOB_WIDTH = 1, 2, 3, 4
_BLOB_DATA, _BLOB_DIFF, _BLOB_SHAPE, _BLOB_DOUBLE_DATA, _BLOB_DOUBLE_DIFF = 5, 6, 7, 8, 9

_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5


@dataclasses.dataclass
class Weights:
    """The weights of a caffemodel: ``net`` is the NetParameter with blob payloads stripped (layer names,
    types and params are kept, for upgrading and matching), ``blobs`` maps layer name -> arrays in order."""

    net: caffe_pb2.NetParameter
    blobs: dict[str, list[np.ndarray | None]]
    path: str
    is_hdf5: bool = False  # HDF5 files leave out shared blobs: their lists hold None there
    # (layer name, blob index) of the blobs whose shape came from the legacy num/channels/height/width fields:
    # only those may match a net blob of fewer axes right-aligned (Blob::ShapeEquals); see legacy_shaped().
    legacy: set[tuple[str, int]] = dataclasses.field(default_factory=set)

    def legacy_shaped(self, layer: str, index: int) -> bool:
        return (layer, index) in self.legacy


def blob_shape(blob: caffe_pb2.BlobProto) -> tuple[int, ...]:
    """A BlobProto's shape: ``shape.dim`` if present, else the legacy 4-D num/channels/height/width."""
    if any(blob.HasField(f) for f in ("num", "channels", "height", "width")):
        return (blob.num, blob.channels, blob.height, blob.width)
    return tuple(int(d) for d in blob.shape.dim)


def blobproto_to_array(blob: caffe_pb2.BlobProto, return_diff: bool = False) -> np.ndarray:
    """A BlobProto as a float32 array (float64 if it holds double_data)."""
    shape = blob_shape(blob)
    if return_diff:
        values = blob.double_diff if len(blob.double_diff) else blob.diff
    else:
        values = blob.double_data if len(blob.double_data) else blob.data
    dtype = np.float64 if (len(blob.double_diff) if return_diff else len(blob.double_data)) else np.float32
    if any(d < 0 for d in shape):
        raise WeightsError(f"BlobProto has a negative dimension in its shape {shape}")
    expected = math.prod(shape)  # exact: a corrupted dim must not wrap around to a plausible count
    if len(values) != expected:
        raise WeightsError(f"BlobProto holds {len(values)} values but its shape {shape} needs {expected}")
    return np.asarray(values, dtype=dtype).reshape(shape)


def array_to_blobproto(arr: np.ndarray, diff: np.ndarray | None = None) -> caffe_pb2.BlobProto:
    blob = caffe_pb2.BlobProto()
    arr = np.asarray(arr)
    blob.shape.dim.extend(int(d) for d in arr.shape)
    if arr.dtype == np.float64:
        blob.double_data.extend(arr.ravel().tolist())
    else:
        blob.data.extend(np.asarray(arr, np.float32).ravel().tolist())
    if diff is not None:
        blob.diff.extend(np.asarray(diff, np.float32).ravel().tolist())
    return blob


def is_hdf5(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(8) == b"\x89HDF\r\n\x1a\n"
    except OSError:
        return False


def read_weights(path: str) -> Weights:
    """Read a ``.caffemodel`` (binary NetParameter) or ``.caffemodel.h5`` into :class:`Weights`."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise WeightsError(f"{path}: no such weights file")
    if is_hdf5(path):
        return _read_hdf5(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise WeightsError(f"{path}: empty file, not a caffemodel")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _read_binary(memoryview(buf), path)
    except (ParseError, WeightsError):
        raise
    except (IndexError, ValueError, message.DecodeError) as e:
        raise WeightsError(f"{path}: not a valid caffemodel (corrupted or truncated?): {e}") from None


def read_binary_net(path: str) -> caffe_pb2.NetParameter:
    """A whole binary NetParameter, blobs included (for files that are small or must be edited as protos)."""
    return read_binary_proto(path, caffe_pb2.NetParameter(), "binary NetParameter")


def read_blobproto(path: str) -> caffe_pb2.BlobProto:
    """A ``.binaryproto`` (e.g. a mean file)."""
    return read_binary_proto(path, caffe_pb2.BlobProto(), "BlobProto")


def read_binary_proto(path: str, proto, kind: str, error: type[CaffejaxError] = WeightsError):
    """``proto`` parsed from the file at ``path``; an ``error`` naming the file where it cannot be read or is not
    a valid ``kind``."""
    data = read_bytes(path, error)
    try:
        proto.ParseFromString(data)
    except message.DecodeError as e:
        raise error(f"{path}: not a valid {kind}: {e}") from None
    return proto


# ---- the wire-format walk ----------------------------------------------------------------------------------

def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _fields(buf: memoryview, start: int, end: int) -> Iterator[tuple[int, int, int, int, int]]:
    """Yield (field number, wire type, value or payload start, payload end, field start) over buf[start:end]."""
    pos = start
    while pos < end:
        field_start = pos
        key = buf[pos]  # one-byte varints (field numbers below 16, short lengths) without the call: most of them
        key, pos = (key, pos + 1) if key < 0x80 else _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise ValueError(f"invalid field number 0 at byte {field_start}")
        if wire == _VARINT:
            value, pos = _varint(buf, pos)
            yield number, wire, value, pos, field_start
        elif wire == _LEN:
            length = buf[pos]
            length, pos = (length, pos + 1) if length < 0x80 else _varint(buf, pos)
            if pos + length > end:
                raise ValueError(f"field {number} at byte {field_start} runs past the end of its message")
            yield number, wire, pos, pos + length, field_start
            pos += length
        elif wire == _FIXED32:
            yield number, wire, pos, pos + 4, field_start
            pos += 4
        elif wire == _FIXED64:
            yield number, wire, pos, pos + 8, field_start
            pos += 8
        else:
            raise ValueError(f"unsupported wire type {wire} at byte {field_start}")
    if pos != end:
        raise ValueError("message is truncated")


def _read_binary(buf: memoryview, path: str) -> Weights:
    # Each layer, less its blobs, is parsed straight into the net (repeated fields keep their order); the
    # net's other fields are parsed last, merged, which gives what one parse of the whole file would.
    net = caffe_pb2.NetParameter()
    net_rest = bytearray()
    blobs: dict[str, list[np.ndarray]] = {}
    legacy: set[tuple[str, int]] = set()
    for number, wire, a, b, field_start in _fields(buf, 0, len(buf)):
        if wire == _LEN and number in (_NET_LAYER, _NET_LAYERS_V1):
            v1 = number == _NET_LAYERS_V1
            layer_bytes, blob_ranges = _split_layer(buf, a, b, v1)
            layer = (net.layers if v1 else net.layer).add()
            layer.MergeFromString(layer_bytes)
            layer_blobs, legacy_indices = _layer_blobs(buf, blob_ranges, path, layer.name)
            if layer.name in blobs and layer_blobs:
                raise WeightsError(f"{path}: layer '{layer.name}' appears twice with weights")
            if layer_blobs or layer.name not in blobs:
                blobs[layer.name] = layer_blobs
                legacy.update((layer.name, i) for i in legacy_indices)
        else:
            net_rest += buf[field_start:b]
    net.MergeFromString(bytes(net_rest))
    return Weights(net=net, blobs=blobs, path=path, legacy=legacy)


def _split_layer(buf: memoryview, start: int, end: int, v1: bool) -> tuple[bytes, list[tuple[int, int]]]:
    """A layer's bytes without its blobs, and where each blob's BlobProto lies in ``buf``."""
    blobs_field = _V1_BLOBS if v1 else _LAYER_BLOBS
    rest = bytearray()
    blobs = []
    kept = start  # the fields from here up to the next blob are kept, copied as one run
    for number, wire, a, b, field_start in _fields(buf, start, end):
        if number == blobs_field and wire == _LEN:
            rest += buf[kept:field_start]
            kept = b
            blobs.append((a, b))
    rest += buf[kept:end]
    return bytes(rest), blobs


def _layer_blobs(buf: memoryview, ranges: list[tuple[int, int]], path: str,
                 layer_name: str) -> tuple[list[np.ndarray], list[int]]:
    """The layer's blobs as arrays (views into ``buf`` where possible), and the indices of those shaped by the
    legacy 4-D fields; errors name the file, layer and blob."""
    arrays, legacy = [], []
    for i, (a, b) in enumerate(ranges):
        try:
            arr = _plain_blob_array(buf, a, b)
            if arr is None:
                arr = _any_blob_array(buf, a, b)
                if arr.ndim == 4 and _has_legacy_dims(buf, a, b):
                    legacy.append(i)
            arrays.append(arr)
        except (IndexError, ValueError, message.DecodeError) as e:
            raise WeightsError(f"{path}: layer '{layer_name}', blob {i}: {e} (corrupted or truncated caffemodel?)") \
                from None
    return arrays, legacy


def _has_legacy_dims(buf: memoryview, start: int, end: int) -> bool:
    """Whether the BlobProto sets any of num/channels/height/width (Caffe's BlobProto has_num() || ...)."""
    return any(number in (_BLOB_NUM, _BLOB_CHANNELS, _BLOB_HEIGHT, _BLOB_WIDTH) and wire == _VARINT
               for number, wire, *_ in _fields(buf, start, end))


_DATA_KEY, _SHAPE_KEY, _DIM_KEY = (_BLOB_DATA << 3) | _LEN, (_BLOB_SHAPE << 3) | _LEN, (1 << 3) | _LEN


def _plain_blob_array(buf: memoryview, start: int, end: int) -> np.ndarray | None:
    """The blob as a view of ``buf`` if it is one packed ``data`` field and one ``shape`` in either order (Caffe
    writes data first, caffejax shape first) and they agree; None for anything else, which the general walk
    reads or reports. Nearly every blob is this, and a model of many small blobs (MobileNet's 320) spends
    most of its load in the walk's per-field generator."""
    data = shape = None
    pos = start
    while pos < end:
        key = buf[pos]
        if key != _DATA_KEY and key != _SHAPE_KEY:
            return None
        length = buf[pos + 1]
        length, pos = (length, pos + 2) if length < 0x80 else _varint(buf, pos + 1)
        if key == _DATA_KEY and data is None:
            data = pos, pos + length
        elif key == _SHAPE_KEY and shape is None:
            shape = pos, pos + length
        else:
            return None
        pos += length
    if data is None or shape is None or pos != end or shape[0] == shape[1] or buf[shape[0]] != _DIM_KEY:
        return None
    dims_end, pos = _varint(buf, shape[0] + 1)
    dims_end += pos
    if dims_end != shape[1]:
        return None
    dims = []
    while pos < dims_end:
        dim = buf[pos]
        dim, pos = (dim, pos + 1) if dim < 0x80 else _varint(buf, pos)
        dims.append(dim)
    a, b = data  # both fields end within the blob: the walk above ended exactly at its end
    if pos != dims_end or any(d >= 1 << 63 for d in dims) or (b - a) != 4 * math.prod(dims):
        return None  # negative dims (int64 as 10-byte varints) and a wrong count are the general walk's to report
    return np.frombuffer(buf[a:b], dtype="<f4").reshape(dims)


def _any_blob_array(buf: memoryview, start: int, end: int) -> np.ndarray:
    legacy = {}
    shape = None
    chunks: list[np.ndarray] = []
    double_chunks: list[np.ndarray] = []
    for number, wire, a, b, _ in _fields(buf, start, end):
        if number in (_BLOB_NUM, _BLOB_CHANNELS, _BLOB_HEIGHT, _BLOB_WIDTH) and wire == _VARINT:
            legacy[number] = _int32(a)
        elif number == _BLOB_SHAPE and wire == _LEN:
            shape = tuple(int(d) for d in caffe_pb2.BlobShape.FromString(bytes(buf[a:b])).dim)
        elif number == _BLOB_DATA:
            chunks.append(_floats(buf, a, b, wire, np.dtype("<f4")))
        elif number == _BLOB_DOUBLE_DATA:
            double_chunks.append(_floats(buf, a, b, wire, np.dtype("<f8")))
        # diff and double_diff are not weights: skipped.
    # Caffe's Blob::FromProto: the legacy 4-D num/channels/height/width if any is set (they win over
    # shape.dim), else shape.dim (absent: a 0-axis blob holding one value).
    if legacy:
        shape = tuple(legacy.get(k, 0) for k in (_BLOB_NUM, _BLOB_CHANNELS, _BLOB_HEIGHT, _BLOB_WIDTH))
    elif shape is None:
        shape = ()
    parts = double_chunks or chunks
    if not parts:
        arr = np.zeros(0, np.float32)
    elif len(parts) == 1:
        arr = parts[0]
    else:
        arr = np.concatenate(parts)
    if double_chunks:
        arr = arr.astype(np.float32)  # Blob<float>::FromProto reads double_data into floats
    if any(d < 0 for d in shape):
        raise ValueError(f"negative dimension in blob shape {shape}")
    expected = math.prod(shape)  # exact: a corrupted dim must not wrap around to a plausible count
    if arr.size != expected:
        raise ValueError(f"a blob of shape {shape} should hold {expected} values but holds {arr.size}")
    return arr.reshape(shape)


def _int32(varint: int) -> int:
    """An int32 field's value from its varint (negative int32s are written as 64-bit two's complement)."""
    value = varint & 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def _floats(buf: memoryview, a: int, b: int, wire: int, dtype: np.dtype) -> np.ndarray:
    if wire == _LEN:  # packed
        if (b - a) % dtype.itemsize:
            raise ValueError("packed float field has a partial element")
        return np.frombuffer(buf[a:b], dtype=dtype)
    if wire in (_FIXED32, _FIXED64) and (b - a) == dtype.itemsize:  # one unpacked element
        return np.frombuffer(buf[a:b], dtype=dtype)
    raise ValueError("float field with the wrong wire type")


def _encode_len_field(number: int, payload: bytes) -> bytes:
    return _encode_varint((number << 3) | _LEN) + _encode_varint(len(payload)) + payload


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def encode_blob(arr: np.ndarray) -> bytes:
    """A BlobProto's bytes: shape, then the data as one packed float field (written without a Python loop)."""
    return b"".join(_blob_pieces(arr))


def _blob_pieces(arr: np.ndarray) -> list:
    """A BlobProto as [its shape and the data field's header, the float payload]; the payload is the array's own
    buffer (a memoryview), so writing a large model copies nothing."""
    arr = np.asarray(arr, dtype="<f4")  # not ascontiguousarray: it turns a 0-axis blob into shape (1,)
    payload = memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
    dims = b"".join(_encode_varint(int(d)) for d in arr.shape)
    # BlobShape.dim is packed (field 1). Like Blob::ToProto, a 0-axis blob is written without a shape.
    shape = _encode_len_field(_BLOB_SHAPE, _encode_len_field(1, dims)) if arr.ndim else b""
    header = _encode_varint((_BLOB_DATA << 3) | _LEN) + _encode_varint(payload.nbytes)
    return [shape + header, payload]


def encode_net(net: caffe_pb2.NetParameter, blobs: dict[str, list[np.ndarray]]) -> Iterator[bytes | memoryview]:
    """A binary caffemodel in chunks: ``net``'s own fields, then each layer with ``blobs[layer.name]`` appended.

    Protobuf parsers accept fields in any order, so a layer is its serialized params followed by its blob
    fields; BVLC Caffe reads the result like any caffemodel. The float payloads are yielded as views of the
    arrays, not copies.
    """
    head = caffe_pb2.NetParameter()
    head.CopyFrom(net)
    del head.layer[:]
    del head.layers[:]
    yield head.SerializeToString()
    for layer in net.layer:
        stripped = caffe_pb2.LayerParameter()
        stripped.CopyFrom(layer)
        del stripped.blobs[:]
        params = stripped.SerializeToString()
        pieces = []
        for arr in blobs.get(layer.name, []):
            blob = _blob_pieces(arr)
            size = sum(map(len, blob))  # the payload is a 1-D byte view: len() is its size
            pieces += [_encode_varint((_LAYER_BLOBS << 3) | _LEN) + _encode_varint(size), *blob]
        body = len(params) + sum(map(len, pieces))
        yield _encode_varint((_NET_LAYER << 3) | _LEN) + _encode_varint(body) + params
        yield from pieces


# ---- HDF5 -----------------------------------------------------------------------------------------------------

def _h5py():
    try:
        import h5py
    except ImportError:
        raise WeightsError("reading/writing HDF5 weights needs h5py: pip install 'caffejax[hdf5]'") from None
    return h5py


def _read_hdf5(path: str) -> Weights:
    """Caffe's HDF5 layout: ``data/<layer>/<i>`` datasets (only owners of shared params are stored).

    A layer name holding '/' (``inception_3a/1x1``) is a nested group path in HDF5, so layers are found by
    walking the whole ``data`` tree: every group holding numbered datasets (or nothing at all) is a layer.
    A corrupted file fails with a WeightsError (HDF5's own errors come as OSError, RuntimeError, KeyError or
    ValueError), and a dataset's declared size is checked before it is read.
    """
    h5py = _h5py()
    blobs: dict[str, list[np.ndarray]] = {}
    net = caffe_pb2.NetParameter()
    try:
        with h5py.File(path, "r") as f:
            if "data" not in f:
                raise WeightsError(f"{path}: HDF5 file has no 'data' group (not a Caffe HDF5 caffemodel)")
            layer_groups: list[tuple[str, object]] = []
            f["data"].visititems(lambda name, obj: _collect_layer_group(h5py, name, obj, layer_groups))
            for layer_name, group in layer_groups:
                indices = sorted(int(k) for k in group if k.isdigit())
                if indices and indices[-1] >= _MAX_LAYER_BLOBS:
                    raise WeightsError(f"{path}: layer '{layer_name}' has a blob numbered {indices[-1]} (corrupted?)")
                arrays: list[np.ndarray | None] = [None] * (indices[-1] + 1 if indices else 0)
                for j in indices:  # gaps are shared blobs, which Caffe writes only under their owner
                    arrays[j] = hdf5_blob(h5py, group[str(j)], f"{path}: layer '{layer_name}', blob {j}")
                blobs[layer_name] = arrays
                net.layer.add(name=layer_name)
    except (OSError, RuntimeError, KeyError, ValueError, TypeError) as e:
        raise WeightsError(f"{path}: cannot read HDF5 weights (corrupted or truncated?): {e}") from None
    return Weights(net=net, blobs=blobs, path=path, is_hdf5=True)


# No Caffe layer has more than a handful of learnable blobs; a bigger index is a corrupted name.
_MAX_LAYER_BLOBS = 1024


def hdf5_blob(h5py, dataset, where: str) -> np.ndarray:
    """An HDF5 dataset holding a blob, as float32, after checking what it declares (kind, element count);
    ``where`` names it in errors."""
    from caffejax.frontend.build import MAX_BLOB_ELEMENTS

    if not isinstance(dataset, h5py.Dataset) or dataset.dtype.kind not in "fiu":
        raise WeightsError(f"{where}: not a numeric dataset")
    if dataset.size > MAX_BLOB_ELEMENTS:
        raise WeightsError(f"{where}: declares shape {dataset.shape} ({dataset.size} elements), more than caffejax "
                           f"allows ({MAX_BLOB_ELEMENTS}); the file is corrupted")
    return np.asarray(dataset, dtype=np.float32)


def _collect_layer_group(h5py, name: str, obj, layer_groups: list) -> None:
    if isinstance(obj, h5py.Group) and (len(obj) == 0 or any(isinstance(v, h5py.Dataset) for v in obj.values())):
        layer_groups.append((name, obj))


def write_hdf5(path: str, params: dict[str, list[np.ndarray]], diffs: dict[str, list[np.ndarray]] | None = None):
    """Write Caffe's HDF5 layout: ``data/<layer>/<i>`` (and ``diff/<layer>/<i>`` if diffs are given)."""
    h5py = _h5py()
    with h5py.File(path, "w") as f:
        for group_name, content in (("data", params), ("diff", diffs)):
            if content is None:
                continue
            group = f.create_group(group_name)
            for layer_name, arrays in content.items():
                layer_group = group.require_group(layer_name)  # "a/b" may already exist as a path prefix
                for j, arr in enumerate(arrays):
                    if arr is not None:
                        layer_group.create_dataset(str(j), data=np.asarray(arr, np.float32))
