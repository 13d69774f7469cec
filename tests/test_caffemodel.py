"""The caffemodel reader and writer (caffejax.frontend.caffemodel).

The mmap reader walks the wire format itself, so protobuf's own decode (NetParameter.FromString, then the
arrays Caffe's Blob::FromProto would build) is the oracle: every stored caffemodel must read identically.
Damaged files must fail with a WeightsError naming the file, never with a protobuf/numpy traceback.
"""

from __future__ import annotations

import glob
import mmap
import pathlib
import time

import numpy as np
import pytest

from caffejax.errors import WeightsError
from caffejax.frontend.caffemodel import (_encode_len_field, _encode_varint, _plain_blob_array, encode_blob,
                                          encode_net, read_binary_net, read_blobproto, read_weights, write_hdf5)
from caffejax.frontend.upgrade import upgrade_net_as_needed
from caffejax.proto import caffe_pb2
from conftest import BUNDLED, FIXTURES

# Every well-formed caffemodel we ship (tests/fixtures/malformed holds deliberately broken ones).
CAFFEMODELS = sorted(p for p in glob.glob(str(FIXTURES / "**" / "*.caffemodel"), recursive=True)
                     + glob.glob(str(BUNDLED / "**" / "*.caffemodel"), recursive=True)
                     if "malformed" not in pathlib.Path(p).parts)
SMALL_MODEL = FIXTURES / "reference" / "layers" / "inner_product_transpose.caffemodel"


def caffe_from_proto(blob: caffe_pb2.BlobProto) -> np.ndarray:
    """What Blob<float>::FromProto builds: legacy 4-D dims win over shape.dim; double_data is read as float."""
    legacy = any(blob.HasField(f) for f in ("num", "channels", "height", "width"))
    shape = (blob.num, blob.channels, blob.height, blob.width) if legacy else tuple(blob.shape.dim)
    values = blob.double_data if len(blob.double_data) else blob.data
    return np.asarray(values, dtype=np.float32).reshape(shape)


def protobuf_decode(data: bytes) -> dict[str, list[np.ndarray]]:
    net = caffe_pb2.NetParameter.FromString(data)
    out: dict[str, list[np.ndarray]] = {}
    for layer in list(net.layer) + list(net.layers):
        if len(layer.blobs) or layer.name not in out:
            out[layer.name] = [caffe_from_proto(b) for b in layer.blobs]
    return out


def assert_same_blobs(actual: dict[str, list[np.ndarray]], expected: dict[str, list[np.ndarray]]) -> None:
    assert list(actual) == list(expected)
    for name in expected:
        assert len(actual[name]) == len(expected[name]), name
        for got, want in zip(actual[name], expected[name]):
            assert got.dtype == np.float32 and got.shape == want.shape, name
            np.testing.assert_array_equal(got, want, err_msg=name)


def write_model(tmp_path, data: bytes, name: str = "model.caffemodel"):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def one_layer_model(*blobs: bytes, v1: bool = False) -> bytes:
    """A NetParameter holding one layer 'ip' whose blobs are the given BlobProto bytes."""
    if v1:
        layer = caffe_pb2.V1LayerParameter(name="ip", type=caffe_pb2.V1LayerParameter.INNER_PRODUCT)
        return _encode_len_field(2, layer.SerializeToString() + b"".join(_encode_len_field(6, b) for b in blobs))
    layer = caffe_pb2.LayerParameter(name="ip", type="InnerProduct")
    return _encode_len_field(100, layer.SerializeToString() + b"".join(_encode_len_field(7, b) for b in blobs))


@pytest.fixture
def write_model_bytes(tmp_path):
    counter = iter(range(1_000_000))
    return lambda data: write_model(tmp_path, data, f"m{next(counter)}.caffemodel")


# ---- the stored caffemodels -------------------------------------------------------------------------------------

def test_there_are_caffemodels_to_read():
    assert len(CAFFEMODELS) > 100
    assert any("lenet_iter_10000" in p for p in CAFFEMODELS) and any("det4" in p for p in CAFFEMODELS)


@pytest.mark.parametrize("path", CAFFEMODELS, ids=lambda p: p.split("/tests/fixtures/")[-1].split("/caffejax/")[-1])
def test_read_weights_equals_protobuf_decode_and_round_trips(path):
    raw = open(path, "rb").read()
    weights = read_weights(path)
    assert_same_blobs(weights.blobs, protobuf_decode(raw))
    # The stripped net keeps everything but the payloads.
    original = caffe_pb2.NetParameter.FromString(raw)
    assert [layer.name for layer in weights.net.layer] == [layer.name for layer in original.layer]
    assert all(len(layer.blobs) == 0 for layer in weights.net.layer)
    # Writing it back gives the same NetParameter (field order within a layer may differ; protobuf does not care).
    assert caffe_pb2.NetParameter.FromString(b"".join(encode_net(weights.net, weights.blobs))) == original


def test_zero_axis_blob_is_written_without_shape(write_model_bytes):
    # PReLU with channel_shared has a 0-axis blob; Blob::ToProto writes no shape for it, and Caffe's
    # ShapeEquals would refuse a shape (1,) when loading it back.
    encoded = caffe_pb2.BlobProto.FromString(encode_blob(np.float32(0.25)))
    assert not encoded.HasField("shape") and list(encoded.data) == [0.25]
    written = read_weights(write_model_bytes(one_layer_model(encode_blob(np.array(0.25, np.float32)))))
    assert written.blobs["ip"][0].shape == ()


def test_plain_blobs_are_read_as_views_in_either_field_order():
    # Caffe writes a blob's data (field 5) before its shape (field 7); caffejax writes the shape first. Both are
    # read without the general walk, as views of the file's bytes; anything else falls through to it.
    values = np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5
    shape = _encode_len_field(7, _encode_len_field(1, _encode_varint(2) + _encode_varint(3)))
    data = _encode_len_field(5, values.tobytes())
    for blob in (data + shape, shape + data, encode_blob(values)):
        buf = memoryview(bytearray(blob))
        arr = _plain_blob_array(buf, 0, len(buf))
        assert arr is not None and not arr.flags.owndata
        np.testing.assert_array_equal(arr, values)
        assert caffe_pb2.BlobProto.FromString(blob) == caffe_pb2.BlobProto.FromString(data + shape)
    wide = np.zeros((200, 3), np.float32)  # two-byte dims and lengths
    buf = memoryview(encode_blob(wide))
    assert _plain_blob_array(buf, 0, len(buf)).shape == (200, 3)
    legacy = caffe_pb2.BlobProto(num=1, channels=1, height=2, width=3, data=values.ravel()).SerializeToString()
    for other in (legacy, data, shape, data + data + shape, data + shape + shape,
                  _encode_len_field(7, b"") + data):
        assert _plain_blob_array(memoryview(other), 0, len(other)) is None


# ---- legacy and unusual encodings -------------------------------------------------------------------------------

def test_v1_caffemodel(tmp_path):
    net = caffe_pb2.NetParameter(name="v1net")
    conv = net.layers.add(name="conv1", type=caffe_pb2.V1LayerParameter.CONVOLUTION, bottom=["data"], top=["conv1"])
    conv.convolution_param.num_output = 2
    w = conv.blobs.add(num=2, channels=1, height=2, width=2)
    w.data.extend([1, 2, 3, 4, 5, 6, 7, 8])
    b = conv.blobs.add(num=1, channels=1, height=1, width=2)
    b.data.extend([0.5, -0.5])
    net.layers.add(name="relu1", type=caffe_pb2.V1LayerParameter.RELU, bottom=["conv1"], top=["conv1"])
    path = write_model(tmp_path, net.SerializeToString())

    weights = read_weights(path)
    assert_same_blobs(weights.blobs, protobuf_decode(path.read_bytes()))
    assert weights.blobs["conv1"][0].shape == (2, 1, 2, 2) and weights.blobs["conv1"][1].shape == (1, 1, 1, 2)
    assert weights.blobs["relu1"] == []
    assert len(weights.net.layers) == 2 and len(weights.net.layers[0].blobs) == 0
    upgraded = upgrade_net_as_needed(weights.net)
    assert [(layer.name, layer.type) for layer in upgraded.layer] == [("conv1", "Convolution"), ("relu1", "ReLU")]


def test_legacy_4d_blob(write_model_bytes):
    blob = caffe_pb2.BlobProto(num=1, channels=1, height=2, width=3, data=[1, 2, 3, 4, 5, 6])
    arr = read_weights(write_model_bytes(one_layer_model(blob.SerializeToString()))).blobs["ip"][0]
    np.testing.assert_array_equal(arr, np.arange(1, 7, dtype=np.float32).reshape(1, 1, 2, 3))


def test_legacy_dims_win_over_shape(write_model_bytes):
    # Blob::FromProto reads num/channels/height/width whenever one is set.
    blob = caffe_pb2.BlobProto(num=1, channels=2, height=1, width=1, data=[1, 2])
    blob.shape.dim.extend([2])
    arr = read_weights(write_model_bytes(one_layer_model(blob.SerializeToString()))).blobs["ip"][0]
    assert arr.shape == (1, 2, 1, 1)


def test_blobs_shaped_by_the_legacy_fields_are_marked(write_model_bytes):
    # Only those may match a net blob of fewer axes right-aligned (Blob::ShapeEquals); a 4-D shape.dim may not.
    legacy = caffe_pb2.BlobProto(num=1, channels=1, height=1, width=2, data=[1, 2])
    modern = caffe_pb2.BlobProto(data=[1, 2])
    modern.shape.dim.extend([1, 1, 1, 2])
    weights = read_weights(write_model_bytes(one_layer_model(modern.SerializeToString(), legacy.SerializeToString())))
    assert [a.shape for a in weights.blobs["ip"]] == [(1, 1, 1, 2)] * 2
    assert weights.legacy == {("ip", 1)} and weights.legacy_shaped("ip", 1) and not weights.legacy_shaped("ip", 0)


def test_partial_legacy_dims_default_to_zero(write_model_bytes):
    blob = caffe_pb2.BlobProto(num=3)  # channels/height/width unset: 0, so the blob is empty
    arr = read_weights(write_model_bytes(one_layer_model(blob.SerializeToString()))).blobs["ip"][0]
    assert arr.shape == (3, 0, 0, 0)


def test_double_data_is_read_as_float(write_model_bytes):
    values = [1.0, 1e-50, 3.141592653589793, -2.5e38]
    blob = caffe_pb2.BlobProto(double_data=values)
    blob.shape.dim.extend([2, 2])
    arr = read_weights(write_model_bytes(one_layer_model(blob.SerializeToString()))).blobs["ip"][0]
    assert arr.dtype == np.float32
    np.testing.assert_array_equal(arr, np.array(values, np.float64).astype(np.float32).reshape(2, 2))


def test_unpacked_and_split_float_fields(write_model_bytes):
    # Writers without [packed=true] emit one fixed32 field per float; packed runs may also be split.
    # Parsers must accept both and concatenate.
    values = np.array([0.5, -1.0, 2.0, 7.25, 1e-3], np.float32)
    shape = _encode_len_field(7, _encode_len_field(1, _encode_varint(5)))
    unpacked = b"".join(_encode_varint((5 << 3) | 5) + v.tobytes() for v in values)
    split = _encode_len_field(5, values[:2].tobytes()) + _encode_len_field(5, values[2:].tobytes())
    mixed = unpacked[:10] + _encode_len_field(5, values[2:].tobytes())  # two unpacked, then a packed run
    for payload in (unpacked, split, mixed):
        data = one_layer_model(shape + payload)
        arr = read_weights(write_model_bytes(data)).blobs["ip"][0]
        np.testing.assert_array_equal(arr, values)
        np.testing.assert_array_equal(arr, protobuf_decode(data)["ip"][0])


def test_diff_is_not_read_as_weights(write_model_bytes):
    blob = caffe_pb2.BlobProto(data=[1, 2], diff=[9, 9], double_diff=[8, 8])
    blob.shape.dim.extend([2])
    arr = read_weights(write_model_bytes(one_layer_model(blob.SerializeToString()))).blobs["ip"][0]
    np.testing.assert_array_equal(arr, [1, 2])


# ---- damaged files ----------------------------------------------------------------------------------------------

def test_empty_file(tmp_path):
    with pytest.raises(WeightsError, match=r"model\.caffemodel: empty file"):
        read_weights(write_model(tmp_path, b""))


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(WeightsError, match="no such weights file"):
        read_weights(tmp_path / "absent.caffemodel")
    with pytest.raises(WeightsError, match="no such weights file"):
        read_weights(tmp_path)


@pytest.mark.parametrize("reader, kind", [(read_binary_net, "binary NetParameter"), (read_blobproto, "BlobProto")])
def test_whole_proto_readers_name_the_file_they_cannot_read_or_parse(tmp_path, reader, kind):
    """read_binary_net and read_blobproto (a mean file): a WeightsError naming the file, for one missing and for
    bytes that are not such a message; a valid one reads back."""
    with pytest.raises(WeightsError, match=r"absent\.bin: cannot read"):
        reader(str(tmp_path / "absent.bin"))
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(b"\xff\xff\xff\xff not a proto")
    with pytest.raises(WeightsError, match=rf"garbage\.bin: not a valid {kind}"):
        reader(str(garbage))
    proto = caffe_pb2.BlobProto(shape=caffe_pb2.BlobShape(dim=[2]), data=[1.0, 2.0])
    if reader is read_binary_net:
        proto = caffe_pb2.NetParameter(name="n", layer=[caffe_pb2.LayerParameter(name="l", blobs=[proto])])
    valid = tmp_path / "valid.bin"
    valid.write_bytes(proto.SerializeToString())
    assert reader(str(valid)) == proto


def test_truncated_file(tmp_path):
    raw = open(CAFFEMODELS[-1], "rb").read()  # a real model
    path = write_model(tmp_path, raw[: len(raw) - 3])
    with pytest.raises(WeightsError, match=r"model\.caffemodel.*(truncated|past the end)"):
        read_weights(path)


def small_model_bytes(writer: str) -> bytes:
    """The small model as BVLC Caffe wrote it (a blob's data before its shape), or as caffejax writes it."""
    raw = SMALL_MODEL.read_bytes()
    if writer == "caffe":
        return raw
    weights = read_weights(SMALL_MODEL)
    return b"".join(encode_net(weights.net, weights.blobs))


@pytest.mark.parametrize("writer", ["caffe", "caffejax"])
def test_every_truncation_fails_cleanly_or_reads_a_prefix(tmp_path, writer):
    # Cut inside a field: WeightsError. Cut exactly between fields: a valid (shorter) NetParameter, which
    # must then read exactly as protobuf reads it.
    raw = small_model_bytes(writer)
    path = tmp_path / "cut.caffemodel"
    valid = 0
    for n in range(1, len(raw)):
        path.write_bytes(raw[:n])
        try:
            weights = read_weights(path)
        except WeightsError as e:
            assert str(path) in str(e)
            continue
        valid += 1
        assert_same_blobs(weights.blobs, protobuf_decode(raw[:n]))
    assert valid < 5


@pytest.mark.parametrize("writer", ["caffe", "caffejax"])
def test_bit_flips_fail_cleanly_or_read_as_protobuf_reads(tmp_path, writer):
    # One bit flipped per byte (bit i % 8 at byte i) over a whole small model: structure bytes (tags,
    # lengths, shapes) must give a WeightsError; flips that leave a valid file must read as protobuf does.
    raw = small_model_bytes(writer)
    path = tmp_path / "flipped.caffemodel"
    errors = 0
    for i in range(len(raw)):
        flipped = bytearray(raw)
        flipped[i] ^= 1 << (i % 8)
        path.write_bytes(bytes(flipped))
        try:
            weights = read_weights(path)
        except WeightsError:
            errors += 1
            continue
        try:
            expected = protobuf_decode(bytes(flipped))
        except Exception:  # protobuf refuses something our reader does not look at (e.g. a bad enum)
            continue
        assert_same_blobs(weights.blobs, expected)
    assert errors > 0


def test_invalid_wire_type_names_the_file(tmp_path):
    raw = bytearray(SMALL_MODEL.read_bytes())
    raw[0] = (raw[0] & ~7) | 7  # wire type 7 does not exist
    with pytest.raises(WeightsError, match=r"model\.caffemodel: not a valid caffemodel.*wire type"):
        read_weights(write_model(tmp_path, bytes(raw)))


@pytest.mark.parametrize("blob, match", [
    (caffe_pb2.BlobProto(num=-1, channels=1, height=1, width=1, data=[1]), r"negative dimension.*\(-1, 1, 1, 1\)"),
    (caffe_pb2.BlobProto(shape=caffe_pb2.BlobShape(dim=[2, -3]), data=[1] * 6), r"negative dimension.*\(2, -3\)"),
    (caffe_pb2.BlobProto(shape=caffe_pb2.BlobShape(dim=[2, 3]), data=[1, 2, 3]), r"\(2, 3\) should hold 6.*holds 3"),
    # 2**32 * 2**32 wraps to 0 in int64: the count must be exact, not a wrapped product.
    (caffe_pb2.BlobProto(shape=caffe_pb2.BlobShape(dim=[2**32, 2**32])), r"should hold 18446744073709551616 "),
], ids=["negative_dim", "negative_shape_dim", "count", "overflowing_dims"])
def test_blob_that_does_not_fit_its_shape(write_model_bytes, blob, match):
    with pytest.raises(WeightsError, match=r"m\d\.caffemodel: layer 'ip', blob 0: .*" + match):
        read_weights(write_model_bytes(one_layer_model(blob.SerializeToString())))


def test_duplicate_layer_with_weights_is_refused(write_model_bytes):
    blob = caffe_pb2.BlobProto(data=[1], shape=caffe_pb2.BlobShape(dim=[1])).SerializeToString()
    with pytest.raises(WeightsError, match="'ip' appears twice"):
        read_weights(write_model_bytes(one_layer_model(blob) + one_layer_model(blob)))


# ---- large files are mapped, not copied -------------------------------------------------------------------------

def _base_chain(arr: np.ndarray) -> list:
    chain, obj = [], arr
    while obj is not None:
        chain.append(obj)
        obj = getattr(obj, "base", None) if isinstance(obj, np.ndarray) else getattr(obj, "obj", None)
    return chain


def test_large_caffemodel_is_memory_mapped(tmp_path, record_property):
    # 200 MB of float32 in four blobs, written with encode_net chunk by chunk.
    fc6 = np.arange(8704 * 4096, dtype=np.float32).reshape(8704, 4096)
    blobs = {"fc6": [fc6, -np.arange(8704, dtype=np.float32)],
             "fc7": [np.full((4096, 4096), 0.5, np.float32), np.linspace(-1, 1, 4096, dtype=np.float32)]}
    net = caffe_pb2.NetParameter(name="big")
    for name in blobs:
        net.layer.add(name=name, type="InnerProduct")
    path = tmp_path / "big.caffemodel"
    with open(path, "wb") as f:
        for chunk in encode_net(net, blobs):
            f.write(chunk)
    size_mb = path.stat().st_size / 2**20
    assert size_mb > 199

    start = time.perf_counter()
    weights = read_weights(path)
    seconds = time.perf_counter() - start
    record_property("caffemodel_read_MB_per_s", round(size_mb / seconds))
    print(f"\nread {size_mb:.0f} MB caffemodel in {seconds * 1e3:.1f} ms ({size_mb / seconds:.0f} MB/s)")

    for name, arrays in blobs.items():
        for got, want in zip(weights.blobs[name], arrays):
            assert not got.flags.owndata and not got.flags.writeable  # a read-only view...
            assert any(isinstance(obj, mmap.mmap) for obj in _base_chain(got))  # ...of the file mapping
            assert got.shape == want.shape and np.array_equal(got, want)
    path.unlink()  # pytest keeps the last runs' tmp dirs; 200 MB each is not worth keeping


def test_encode_net_yields_the_arrays_own_buffers():
    weights = np.arange(12, dtype=np.float32).reshape(3, 4)
    net = caffe_pb2.NetParameter()
    net.layer.add(name="ip", type="InnerProduct")
    chunks = list(encode_net(net, {"ip": [weights]}))
    views = [c for c in chunks if isinstance(c, memoryview)]
    assert len(views) == 1 and np.shares_memory(np.frombuffer(views[0], np.float32), weights)


# ---- HDF5 -----------------------------------------------------------------------------------------------------

h5py = pytest.importorskip("h5py")


def test_hdf5_caffemodel(tmp_path):
    # Caffe's Net::ToHDF5 layout, written with h5py directly: data/<layer>/<i>, diffs under diff/, a group
    # for every layer (empty for layers without params), '/' in layer names becoming nested groups.
    path = tmp_path / "net.caffemodel.h5"
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    with h5py.File(path, "w") as f:
        data, diff = f.create_group("data"), f.create_group("diff")
        data.create_dataset("ip/0", data=w)
        data.create_dataset("ip/1", data=np.ones(3, np.float64))
        diff.create_dataset("ip/0", data=-w)
        data.create_group("relu")
        data.create_dataset("inception_3a/1x1/0", data=np.full((2, 1, 1, 1), 7, np.float32))
    weights = read_weights(path)
    assert set(weights.blobs) == {"ip", "relu", "inception_3a/1x1"}
    np.testing.assert_array_equal(weights.blobs["ip"][0], w)
    assert weights.blobs["ip"][1].dtype == np.float32 and weights.blobs["ip"][1].tolist() == [1, 1, 1]
    assert weights.blobs["relu"] == []
    assert weights.blobs["inception_3a/1x1"][0].shape == (2, 1, 1, 1)
    assert sorted(layer.name for layer in weights.net.layer) == sorted(weights.blobs)


def test_write_hdf5_round_trip_with_nested_names(tmp_path):
    path = tmp_path / "out.caffemodel.h5"
    params = {"conv1/7x7_s2": [np.ones((2, 3, 1, 1), np.float32), np.zeros(2, np.float32)],
              "conv1": [np.full(4, 2.0, np.float32)], "pool": []}
    write_hdf5(path, params)
    weights = read_weights(path)
    assert set(weights.blobs) == set(params)
    for name, arrays in params.items():
        assert [a.shape for a in weights.blobs[name]] == [a.shape for a in arrays]


def test_hdf5_without_data_group(tmp_path):
    path = tmp_path / "other.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.ones(2))
    with pytest.raises(WeightsError, match="no 'data' group"):
        read_weights(path)


def test_damaged_hdf5(tmp_path):
    path = tmp_path / "net.caffemodel.h5"
    write_hdf5(path, {"ip": [np.ones((3, 4), np.float32)]})
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(WeightsError, match=r"net\.caffemodel\.h5"):
        read_weights(path)
