"""Caffe's data layers (Data, ImageData, HDF5Data, HDF5Output, MemoryData, WindowData) and transform_param,
checked against numbers worked out by hand from Caffe's rules (data_transformer.cpp, data_layer.cpp, ...)."""

from __future__ import annotations

import io
import os
import sys

import numpy as np
import pytest

import caffejax
from caffejax.data import transform
from caffejax.data.images import resize_linear
from caffejax.errors import DataError, SchemaError, ShapeError
from caffejax.proto import caffe_pb2


def optional(module: str):
    """An optional backend, or skip the test that needs it."""
    return pytest.importorskip(module)


H, W = 5, 6


@pytest.fixture(autouse=True)
def _keep_seed():
    """Tests here set caffejax's seed; put it back for the rest of the suite."""
    from caffejax.runtime import mode

    seed = mode.random_seed()
    yield
    caffejax.set_random_seed(seed)


def raw_datum(image: np.ndarray, label: int) -> bytes:
    c, h, w = image.shape
    return caffe_pb2.Datum(channels=c, height=h, width=w, data=image.tobytes(), label=label).SerializeToString()


def png_bytes(rgb: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    optional("PIL.Image").fromarray(rgb).save(buffer, format="PNG")
    return buffer.getvalue()


def write_lmdb(path, values: list[bytes], keys: list[bytes] | None = None) -> str:
    env = optional("lmdb").open(str(path), map_size=1 << 24)
    with env.begin(write=True) as txn:
        for i, value in enumerate(values):
            txn.put(keys[i] if keys else f"{i:08d}".encode(), value)
    env.close()
    return str(path)


def write_mean(path, mean: np.ndarray) -> str:
    blob = caffe_pb2.BlobProto(num=1, channels=mean.shape[0], height=mean.shape[1], width=mean.shape[2])
    blob.data.extend(mean.ravel().tolist())
    path.write_bytes(blob.SerializeToString())
    return str(path)


def data_net(source, transform_param: str = "", batch_size: int = 2, extra: str = "", tops=("data", "label"),
             backend: str = "LMDB") -> str:
    tops_text = " ".join(f'top: "{t}"' for t in tops)
    return f'''name: "datanet"
layer {{ name: "data" type: "Data" {tops_text}
  transform_param {{ {transform_param} }}
  data_param {{ source: "{source}" backend: {backend} batch_size: {batch_size} {extra} }} }}
'''


def batches(net, count: int):
    out = []
    for _ in range(count):
        net.forward()
        out.append({name: net.blobs[name].data.copy() for name in net.inputs or net.blobs})
    return out


@pytest.fixture
def images():
    rng = np.random.default_rng(7)
    return rng.integers(0, 256, (5, 3, H, W), dtype=np.uint8)


@pytest.fixture
def raw_db(tmp_path, images):
    return write_lmdb(tmp_path / "raw_lmdb", [raw_datum(im, 10 + i) for i, im in enumerate(images)])


# ---- Data: reading, batching, wrap-around -----------------------------------------------------------------

TRAIN_VAL = '''name: "train_val"
layer {{ name: "mnist" type: "Data" top: "data" top: "label" include {{ phase: TRAIN }}
  transform_param {{ scale: 0.5 mean_value: 100 mean_value: 50 mean_value: 0 }}
  data_param {{ source: "{source}" backend: LMDB batch_size: 2 }} }}
layer {{ name: "mnist" type: "Data" top: "data" top: "label" include {{ phase: TEST }}
  transform_param {{ scale: 0.5 mean_value: 100 mean_value: 50 mean_value: 0 }}
  data_param {{ source: "{source}" backend: LMDB batch_size: 3 }} }}
layer {{ name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param {{ num_output: 16 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }}
'''


def test_data_layer_feeds_a_train_val_net_in_key_order_and_wraps(raw_db, images):
    mean = np.array([100, 50, 0], np.float32)[:, None, None]
    expected = (images.astype(np.float32) - mean) * np.float32(0.5)
    net = caffejax.Net(TRAIN_VAL.format(source=raw_db), caffejax.TRAIN)
    assert net.blobs["data"].shape == (2, 3, H, W) and net.blobs["label"].shape == (2,)
    order = [0, 1, 2, 3, 4, 0, 1, 2]  # 5 records, batches of 2: the cursor restarts after the last one
    for step in range(4):
        loss = net.forward()["loss"]
        rows = order[2 * step: 2 * step + 2]
        np.testing.assert_array_equal(net.blobs["data"].data, expected[rows])
        np.testing.assert_array_equal(net.blobs["label"].data, [10 + r for r in rows])
        assert np.isfinite(loss)
    test_net = caffejax.Net(TRAIN_VAL.format(source=raw_db), caffejax.TEST)
    test_net.forward()
    np.testing.assert_array_equal(test_net.blobs["label"].data, [10, 11, 12])


def test_keys_are_read_in_sorted_order_not_insertion_order(tmp_path, images):
    keys = [b"c", b"a", b"e", b"b", b"d"]
    db = write_lmdb(tmp_path / "db", [raw_datum(im, i) for i, im in enumerate(images)], keys)
    net = caffejax.Net(data_net(db, batch_size=5), caffejax.TEST)
    net.forward()
    np.testing.assert_array_equal(net.blobs["label"].data, [1, 3, 0, 4, 2])  # a b c d e


def test_single_top_has_no_labels_and_float_data_datums_are_read(tmp_path):
    values = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4) / 7
    datum = caffe_pb2.Datum(channels=2, height=3, width=4, label=1)
    datum.float_data.extend(values.ravel().tolist())
    db = write_lmdb(tmp_path / "db", [datum.SerializeToString()])
    net = caffejax.Net(data_net(db, "scale: 2", batch_size=2, tops=("data",)), caffejax.TEST)
    assert list(net.blobs) == ["data"]
    net.forward()
    np.testing.assert_array_equal(net.blobs["data"].data, np.stack([values * 2, values * 2]))


def test_datums_of_varying_shape_reshape_the_batch_like_caffes_test_reshape(tmp_path):
    """test_data_layer.cpp's TestReshape: with batch_size 1 each forward takes the shape of its own Datum."""
    values = []
    for i in range(5):
        shape = (2, i % 2 + 1, i % 4 + 1)
        values.append(raw_datum(np.arange(np.prod(shape), dtype=np.uint8).reshape(shape), i))
    net = caffejax.Net(data_net(write_lmdb(tmp_path / "db", values), batch_size=1), caffejax.TEST)
    for i, batch in enumerate(batches(net, 5)):
        shape = (2, i % 2 + 1, i % 4 + 1)
        assert batch["data"].shape == (1,) + shape and batch["label"][0] == i
        np.testing.assert_array_equal(batch["data"][0].ravel(), np.arange(np.prod(shape)))


def test_force_color_and_force_gray_together_are_ignored_for_raw_datums(raw_db, images):
    """Caffe checks the pair only when it decodes an encoded Datum; a raw Datum is read as it is."""
    net = caffejax.Net(data_net(raw_db, "force_color: true force_gray: true", batch_size=1), caffejax.TEST)
    net.forward()
    np.testing.assert_array_equal(net.blobs["data"].data[0], images[0])


def test_force_color_and_force_gray_together_are_rejected_for_encoded_datums(tmp_path):
    rgb = np.zeros((2, 2, 3), np.uint8)
    db = write_lmdb(tmp_path / "db", [caffe_pb2.Datum(data=png_bytes(rgb), encoded=True).SerializeToString()])
    with pytest.raises(SchemaError, match="force_color and force_gray"):
        caffejax.Net(data_net(db, "force_color: true force_gray: true", batch_size=1), caffejax.TEST)


# ---- transform_param ------------------------------------------------------------------------------------------

def test_test_phase_takes_the_centre_crop_and_the_mean_file_under_it(tmp_path, raw_db, images):
    rng = np.random.default_rng(1)
    mean = (rng.random((3, H, W)) * 255).astype(np.float32)
    mean_file = write_mean(tmp_path / "mean.binaryproto", mean)
    net = caffejax.Net(data_net(raw_db, f'crop_size: 3 scale: 0.25 mean_file: "{mean_file}"', batch_size=5),
                       caffejax.TEST)
    assert net.blobs["data"].shape == (5, 3, 3, 3)
    net.forward()
    h_off, w_off = (H - 3) // 2, (W - 3) // 2  # (5-3)/2 = 1, (6-3)/2 = 1
    window = (slice(None), slice(None), slice(h_off, h_off + 3), slice(w_off, w_off + 3))
    expected = (images.astype(np.float32)[window] - mean[None][window]) * np.float32(0.25)
    np.testing.assert_array_equal(net.blobs["data"].data, expected)


def _candidates(image, mean, crop, scale):
    """Every output Caffe's TRAIN transform may give: each crop offset, mirrored or not."""
    out = []
    for h in range(image.shape[1] - crop + 1):
        for w in range(image.shape[2] - crop + 1):
            region = (image[:, h:h + crop, w:w + crop].astype(np.float32) - mean[:, h:h + crop, w:w + crop]) * scale
            out.append(((h, w, False), region))
            out.append(((h, w, True), region[:, :, ::-1]))
    return out


def test_train_phase_crops_and_mirrors_at_random_with_the_mean_cropped_alike(tmp_path, raw_db, images):
    mean = np.random.default_rng(2).random((3, H, W)).astype(np.float32) * 100
    mean_file = write_mean(tmp_path / "mean.binaryproto", mean)
    prototxt = data_net(raw_db, f'crop_size: 4 mirror: true scale: 0.5 mean_file: "{mean_file}"', batch_size=5)
    caffejax.set_random_seed(11)
    got = batches(caffejax.Net(prototxt, caffejax.TRAIN), 6)
    seen = set()
    for batch in got:
        for i, item in enumerate(batch["data"]):
            matches = [how for how, want in _candidates(images[i], mean, 4, np.float32(0.5))
                       if np.array_equal(item, want)]
            assert matches, f"item {i} is no crop/mirror of its image"
            seen.update(matches)
    assert {m for _, _, m in seen} == {True, False}
    assert len({(h, w) for h, w, _ in seen}) > 2
    # The random stream comes from caffejax's seed: the same seed gives the same batches, another seed others.
    np.testing.assert_array_equal(batches(caffejax.Net(prototxt, caffejax.TRAIN), 2)[1]["data"], got[1]["data"])
    caffejax.set_random_seed(12)
    assert not np.array_equal(batches(caffejax.Net(prototxt, caffejax.TRAIN), 2)[1]["data"], got[1]["data"])


def test_one_mean_value_serves_every_channel(raw_db, images):
    net = caffejax.Net(data_net(raw_db, "mean_value: 128", batch_size=1), caffejax.TEST)
    net.forward()
    np.testing.assert_array_equal(net.blobs["data"].data[0], images[0].astype(np.float32) - 128)


def test_mean_file_and_mean_value_together_are_rejected(tmp_path, raw_db):
    mean_file = write_mean(tmp_path / "mean.binaryproto", np.zeros((3, H, W), np.float32))
    with pytest.raises(SchemaError, match="mean_file and mean_value"):
        caffejax.Net(data_net(raw_db, f'mean_file: "{mean_file}" mean_value: 1'), caffejax.TEST)


def test_mean_file_of_another_size_is_a_data_error(tmp_path, raw_db):
    mean_file = write_mean(tmp_path / "mean.binaryproto", np.zeros((3, H + 1, W), np.float32))
    net = caffejax.Net(data_net(raw_db, f'mean_file: "{mean_file}"'), caffejax.TEST)
    with pytest.raises(DataError, match="mean_file"):
        net.forward()


def test_transformer_draws_mirror_before_the_crop_offsets():
    param = caffe_pb2.TransformationParameter(crop_size=2, mirror=True)
    image = np.arange(3 * 4 * 4, dtype=np.uint8).reshape(3, 4, 4)
    out = transform.DataTransformer(param, caffejax.TRAIN, np.random.default_rng(5))(image)
    draws = np.random.default_rng(5)
    mirror, h, w = draws.integers(2), draws.integers(3), draws.integers(3)
    want = image[:, h:h + 2, w:w + 2].astype(np.float32)
    np.testing.assert_array_equal(out, want[:, :, ::-1] if mirror else want)


def test_test_phase_mirrors_at_random_but_always_takes_the_centre_crop():
    """test_data_transformer.cpp's TestCropMirrorTest: mirror flips a coin in TEST too; the crop stays centred."""
    param = caffe_pb2.TransformationParameter(crop_size=2, mirror=True)
    image = np.arange(3 * 4 * 5, dtype=np.uint8).reshape(3, 4, 5)
    transformer = transform.DataTransformer(param, caffejax.TEST, np.random.default_rng(0))
    centre = image[:, 1:3, 1:3].astype(np.float32)  # offsets (4-2)/2 = 1 and (5-2)/2 = 1
    outs = [transformer(image) for _ in range(20)]
    assert all(np.array_equal(o, centre) or np.array_equal(o, centre[:, :, ::-1]) for o in outs)
    assert any(np.array_equal(o, centre) for o in outs) and any(np.array_equal(o, centre[:, :, ::-1]) for o in outs)


# ---- encoded Datums -----------------------------------------------------------------------------------------

def test_encoded_png_datums_decode_to_bgr_like_opencv(tmp_path):
    rgb = np.random.default_rng(3).integers(0, 256, (H, W, 3), dtype=np.uint8)
    datum = caffe_pb2.Datum(data=png_bytes(rgb), encoded=True, label=4)
    db = write_lmdb(tmp_path / "db", [datum.SerializeToString()])
    net = caffejax.Net(data_net(db, batch_size=1), caffejax.TEST)
    assert net.blobs["data"].shape == (1, 3, H, W)
    net.forward()
    np.testing.assert_array_equal(net.blobs["data"].data[0], rgb[:, :, ::-1].transpose(2, 0, 1))
    assert net.blobs["label"].data[0] == 4
    gray = caffejax.Net(data_net(db, "force_gray: true", batch_size=1), caffejax.TEST)
    gray.forward()
    r, g, b = (rgb[:, :, i].astype(np.float64) for i in range(3))
    luma = 0.299 * r + 0.587 * g + 0.114 * b
    assert gray.blobs["data"].shape == (1, 1, H, W)
    assert np.abs(gray.blobs["data"].data[0, 0] - luma).max() <= 1.0


def test_encoded_gray_png_keeps_one_channel_unless_force_color(tmp_path):
    gray = np.random.default_rng(4).integers(0, 256, (H, W), dtype=np.uint8)
    buffer = io.BytesIO()
    optional("PIL.Image").fromarray(gray).save(buffer, format="PNG")
    db = write_lmdb(tmp_path / "db", [caffe_pb2.Datum(data=buffer.getvalue(), encoded=True).SerializeToString()])
    native = caffejax.Net(data_net(db, batch_size=1), caffejax.TEST)
    assert native.blobs["data"].shape == (1, 1, H, W)
    color = caffejax.Net(data_net(db, "force_color: true", batch_size=1), caffejax.TEST)
    color.forward()
    np.testing.assert_array_equal(color.blobs["data"].data[0], np.stack([gray] * 3))


# ---- errors ---------------------------------------------------------------------------------------------------

def test_missing_database_builds_the_net_but_forward_names_it(tmp_path):
    net = caffejax.Net(data_net(str(tmp_path / "nowhere_lmdb")), caffejax.TEST)
    assert net.blobs["data"].shape == ()  # unknown until a batch arrives
    with pytest.raises(DataError, match="nowhere_lmdb"):
        net.forward()


def test_corrupted_record_is_a_data_error_naming_its_key(tmp_path, images):
    values = [raw_datum(images[0], 0), b"\xff\xff\xff not a datum", raw_datum(images[1], 1)]
    db = write_lmdb(tmp_path / "db", values, [b"k0", b"k1-broken", b"k2"])
    net = caffejax.Net(data_net(db, batch_size=1), caffejax.TEST)
    net.forward()
    with pytest.raises(DataError, match="k1-broken"):
        net.forward()
    with pytest.raises(DataError, match="k1-broken"):  # the failure sticks
        net.forward()


def test_datum_with_too_few_bytes_is_a_data_error(tmp_path):
    short = caffe_pb2.Datum(channels=3, height=2, width=2, data=b"\x00" * 5).SerializeToString()
    db = write_lmdb(tmp_path / "db", [short], [b"short-one"])
    with pytest.raises(DataError, match="short-one.*5 bytes"):
        caffejax.Net(data_net(db, batch_size=1), caffejax.TEST)


def test_missing_lmdb_package_names_the_pip_extra(raw_db, monkeypatch):
    monkeypatch.setitem(sys.modules, "lmdb", None)  # as if not installed
    net = caffejax.Net(data_net(raw_db), caffejax.TEST)  # builds, with the data shapes unknown
    with pytest.raises(DataError, match=r"caffejax\[data\]"):
        net.forward()


def test_hdf5_output_needs_bottoms_of_one_num():
    prototxt = '''layer { name: "in" type: "Input" top: "a" top: "b"
  input_param { shape { dim: 2 dim: 3 } shape { dim: 3 } } }
layer { name: "out" type: "HDF5Output" bottom: "a" bottom: "b" hdf5_output_param { file_name: "x.h5" } }'''
    with pytest.raises(ShapeError, match="same num"):
        caffejax.Net(prototxt, caffejax.TEST)


def test_relative_source_is_found_beside_the_prototxt(tmp_path, images, monkeypatch):
    folder = tmp_path / "model"
    folder.mkdir()
    write_lmdb(folder / "train_lmdb", [raw_datum(images[0], 3)])
    prototxt = folder / "train.prototxt"
    prototxt.write_text(data_net("train_lmdb", batch_size=1))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    net = caffejax.Net(str(prototxt), caffejax.TEST)
    net.forward()
    assert net.blobs["label"].data[0] == 3


def test_leveldb_backend(tmp_path, images):
    plyvel = pytest.importorskip("plyvel")
    db = plyvel.DB(str(tmp_path / "leveldb"), create_if_missing=True)
    for i, im in enumerate(images[:3]):
        db.put(f"{i:08d}".encode(), raw_datum(im, i))
    db.close()
    net = caffejax.Net(data_net(str(tmp_path / "leveldb"), batch_size=2, backend="LEVELDB"), caffejax.TEST)
    labels = [b["label"].tolist() for b in batches(net, 2)]
    assert labels == [[0, 1], [2, 0]]
    np.testing.assert_array_equal(net.blobs["data"].data[0], images[2])


def test_prefetcher_queues_batches_ahead_and_stops_on_close():
    from caffejax.data.common import Prefetcher

    calls = []

    def load():
        calls.append(len(calls))
        return [np.full(1, len(calls), np.float32)]

    source = Prefetcher(load, depth=3, name="t")
    assert source.next_batch()[0][0] == 1 and source.next_batch()[0][0] == 2
    source.close()
    assert not source._thread.is_alive()
    assert len(calls) <= 2 + 3 + 1  # two taken, at most `depth` queued, one in flight


# ---- ImageData ---------------------------------------------------------------------------------------------------

def write_images(folder, count: int, size=(H, W)):
    rng = np.random.default_rng(9)
    rgbs = rng.integers(0, 256, (count,) + size + (3,), dtype=np.uint8)
    for i, rgb in enumerate(rgbs):
        optional("PIL.Image").fromarray(rgb).save(folder / f"img {i}.png")
    return rgbs


def image_data_net(list_file, root: str, params: str = "", transform_param: str = "", batch_size: int = 2) -> str:
    return f'''name: "images"
layer {{ name: "images" type: "ImageData" top: "data" top: "label"
  transform_param {{ {transform_param} }}
  image_data_param {{ source: "{list_file}" root_folder: "{root}" batch_size: {batch_size} {params} }} }}
'''


def test_image_data_reads_the_list_with_labels_after_the_last_space(tmp_path):
    rgbs = write_images(tmp_path, 3)
    list_file = tmp_path / "list.txt"
    list_file.write_text("img 0.png 7\nimg 1.png 8\nimg 2.png 9\n")
    net = caffejax.Net(image_data_net(list_file, f"{tmp_path}/"), caffejax.TEST)
    assert net.blobs["data"].shape == (2, 3, H, W)
    got = batches(net, 2)
    np.testing.assert_array_equal(got[0]["label"], [7, 8])
    np.testing.assert_array_equal(got[1]["label"], [9, 7])  # wraps to the first line
    np.testing.assert_array_equal(got[1]["data"][0], rgbs[2][:, :, ::-1].transpose(2, 0, 1))


def test_image_data_resizes_like_cv_resize_and_reads_gray(tmp_path):
    rgbs = write_images(tmp_path, 2)
    list_file = tmp_path / "list.txt"
    list_file.write_text("img 0.png 0\nimg 1.png 1\n")
    net = caffejax.Net(image_data_net(list_file, f"{tmp_path}/", "new_height: 3 new_width: 4 is_color: false"),
                       caffejax.TEST)
    assert net.blobs["data"].shape == (2, 1, 3, 4)
    net.forward()
    gray = np.asarray(optional("PIL.Image").fromarray(rgbs[1]).convert("L"))[:, :, None]
    np.testing.assert_array_equal(net.blobs["data"].data[1, 0], resize_linear(gray, 3, 4)[:, :, 0])


def test_image_data_shuffle_is_a_seeded_permutation(tmp_path):
    write_images(tmp_path, 6, size=(2, 2))
    list_file = tmp_path / "list.txt"
    list_file.write_text("".join(f"img {i}.png {i}\n" for i in range(6)))
    prototxt = image_data_net(list_file, f"{tmp_path}/", "shuffle: true")
    caffejax.set_random_seed(3)
    first = [b["label"].tolist() for b in batches(caffejax.Net(prototxt, caffejax.TRAIN), 3)]
    caffejax.set_random_seed(3)
    again = [b["label"].tolist() for b in batches(caffejax.Net(prototxt, caffejax.TRAIN), 3)]
    assert first == again
    assert sorted(sum(first, [])) == list(range(6))


def test_image_data_missing_image_is_a_data_error(tmp_path):
    write_images(tmp_path, 1)
    list_file = tmp_path / "list.txt"
    list_file.write_text("img 0.png 0\nmissing.png 1\n")
    net = caffejax.Net(image_data_net(list_file, f"{tmp_path}/"), caffejax.TEST)
    with pytest.raises(DataError, match="missing.png"):
        net.forward()


def test_image_list_labels_are_read_like_atoi():
    """atoi skips only C whitespace and reads only ASCII digits; glibc saturates at a long, then keeps 32 bits."""
    from caffejax.data.image_data import parse_list

    text = "a.png \u00a05\nb.png \u0663\nc c.png \t-7x\nd.png 4294967297\ne.png\n"
    assert parse_list(text) == [("a.png", 0), ("b.png", 0), ("c c.png", -7), ("d.png", 1), ("e.png", 0)]


def test_image_list_lines_end_at_newline_only(tmp_path):
    """std::getline ends a line at "\n" only: a "\r" inside a line is part of the path."""
    name = "a\rb.png"
    rgb = np.random.default_rng(5).integers(0, 256, (2, 3, 3), dtype=np.uint8)
    optional("PIL.Image").fromarray(rgb).save(tmp_path / "x.png")
    os.rename(tmp_path / "x.png", tmp_path / name)
    (tmp_path / "list.txt").write_bytes(f"{name} 3\n".encode())
    net = caffejax.Net(image_data_net(tmp_path / "list.txt", f"{tmp_path}/"), caffejax.TEST)
    net.forward()
    assert net.blobs["label"].data.tolist() == [3, 3]
    np.testing.assert_array_equal(net.blobs["data"].data[0], rgb[:, :, ::-1].transpose(2, 0, 1))


def test_image_data_images_of_varying_size_reshape_each_batch(tmp_path):
    """test_image_data_layer.cpp's TestReshape: with batch_size 1 each batch takes its image's size."""
    for i, size in enumerate([(3, 4), (5, 2)]):
        optional("PIL.Image").fromarray(np.full(size + (3,), i, np.uint8)).save(tmp_path / f"im{i}.png")
    (tmp_path / "list.txt").write_text("im0.png 0\nim1.png 1\n")
    net = caffejax.Net(image_data_net(tmp_path / "list.txt", f"{tmp_path}/", batch_size=1), caffejax.TEST)
    got = batches(net, 3)
    assert [b["data"].shape for b in got] == [(1, 3, 3, 4), (1, 3, 5, 2), (1, 3, 3, 4)]
    assert [b["label"].tolist() for b in got] == [[0], [1], [0]]


def test_resize_linear_follows_opencv_pixel_centres():
    row = np.array([[[0], [255]]], np.uint8)  # 1 x 2, one channel
    # OpenCV: x_src = (x + 0.5) / 2 - 0.5 = -0.25, 0.25, 0.75, 1.25; clamped at both ends.
    np.testing.assert_array_equal(resize_linear(row, 1, 4)[0, :, 0], [0, 64, 191, 255])
    block = np.arange(16, dtype=np.uint8).reshape(4, 4, 1) * 10
    halved = resize_linear(block, 2, 2)[:, :, 0]  # exact halving averages 2 x 2 blocks
    np.testing.assert_array_equal(halved, [[25, 45], [105, 125]])


# ---- HDF5Data and HDF5Output --------------------------------------------------------------------------------

def test_hdf5_data_batches_run_across_files(tmp_path):
    rows = np.arange(5 * 3, dtype=np.float32).reshape(5, 3)
    for name, part in (("a.h5", slice(0, 3)), ("b.h5", slice(3, 5))):
        with optional("h5py").File(tmp_path / name, "w") as f:
            f["data"] = rows[part].astype(np.float64)  # doubles are read as float
            f["label"] = np.arange(5)[part]
    (tmp_path / "list.txt").write_text(f"{tmp_path / 'a.h5'}\n{tmp_path / 'b.h5'}\n")
    prototxt = f'''name: "h5"
layer {{ name: "h5" type: "HDF5Data" top: "data" top: "label"
  hdf5_data_param {{ source: "{tmp_path / 'list.txt'}" batch_size: 2 }} }}
layer {{ name: "out" type: "HDF5Output" bottom: "data" bottom: "label"
  hdf5_output_param {{ file_name: "{tmp_path / 'out.h5'}" }} }}
'''
    net = caffejax.Net(prototxt, caffejax.TEST)
    assert net.blobs["data"].shape == (2, 3) and net.blobs["label"].shape == (2,)
    got = batches(net, 3)
    for batch, order in zip(got, ([0, 1], [2, 3], [4, 0])):
        np.testing.assert_array_equal(batch["data"], rows[order])
        np.testing.assert_array_equal(batch["label"], order)
    # HDF5Output wrote the last batch, as Caffe's 4-D legacy blobs.
    with optional("h5py").File(tmp_path / "out.h5", "r") as f:
        np.testing.assert_array_equal(f["data"][...], rows[[4, 0]].reshape(2, 3, 1, 1))
        np.testing.assert_array_equal(f["label"][...], np.array([4, 0], np.float32).reshape(2, 1, 1, 1))
        assert f["data"].dtype == np.float32


def test_hdf5_data_missing_dataset_names_the_top(tmp_path):
    with optional("h5py").File(tmp_path / "a.h5", "w") as f:
        f["data"] = np.zeros((2, 3))
    (tmp_path / "list.txt").write_text(str(tmp_path / "a.h5"))
    prototxt = f'''layer {{ name: "h5" type: "HDF5Data" top: "data" top: "target"
  hdf5_data_param {{ source: "{tmp_path / 'list.txt'}" batch_size: 1 }} }}'''
    with pytest.raises(DataError, match="no dataset 'target'"):
        caffejax.Net(prototxt, caffejax.TEST)


def test_hdf5_data_shuffle_visits_every_row_each_pass(tmp_path):
    with optional("h5py").File(tmp_path / "a.h5", "w") as f:
        f["data"] = np.arange(6, dtype=np.float32)[:, None]
    (tmp_path / "list.txt").write_text(str(tmp_path / "a.h5"))
    prototxt = f'''layer {{ name: "h5" type: "HDF5Data" top: "data"
  hdf5_data_param {{ source: "{tmp_path / 'list.txt'}" batch_size: 3 shuffle: true }} }}'''
    got = [b["data"].ravel().tolist() for b in batches(caffejax.Net(prototxt, caffejax.TRAIN), 4)]
    assert sorted(got[0] + got[1]) == list(range(6)) and sorted(got[2] + got[3]) == list(range(6))


def hdf5_net(list_file, tops=("data",), batch_size: int = 2) -> str:
    tops_text = " ".join(f'top: "{t}"' for t in tops)
    return f'''layer {{ name: "h5" type: "HDF5Data" {tops_text}
  hdf5_data_param {{ source: "{list_file}" batch_size: {batch_size} }} }}'''


def test_hdf5_list_splits_names_at_c_whitespace_only_and_takes_any_bytes(tmp_path):
    """The list is read with ``std::istream >> std::string``: U+00A0 is part of a name, and names need not be
    UTF-8."""
    names = ["a\u00a0b.h5", os.fsdecode(b"\xff.h5")]
    for i, name in enumerate(names):
        with optional("h5py").File(tmp_path / name, "w") as f:
            f["data"] = np.full((1, 2), i, np.float32)
    (tmp_path / "list.txt").write_bytes(b"\n".join(os.fsencode(tmp_path / name) for name in names))
    net = caffejax.Net(hdf5_net(tmp_path / "list.txt"), caffejax.TEST)
    net.forward()
    np.testing.assert_array_equal(net.blobs["data"].data, [[0, 0], [1, 1]])


def test_hdf5_dataset_that_is_a_dangling_link_is_a_data_error(tmp_path):
    h5py = optional("h5py")
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f["data"] = h5py.SoftLink("/nowhere")
    (tmp_path / "list.txt").write_text(str(tmp_path / "a.h5"))
    with pytest.raises(DataError, match="dataset 'data' cannot be opened"):
        caffejax.Net(hdf5_net(tmp_path / "list.txt"), caffejax.TEST)


# ---- MemoryData ----------------------------------------------------------------------------------------------------

MEMORY = '''name: "memory"
layer { name: "mem" type: "MemoryData" top: "data" top: "label"
  memory_data_param { batch_size: 2 channels: 1 height: 2 width: 3 } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 2 } }
'''


def test_memory_data_walks_the_arrays_given_to_set_input_arrays():
    net = caffejax.Net(MEMORY, caffejax.TEST)
    with pytest.raises(DataError, match="set_input_arrays"):
        net.forward()
    data = np.arange(4 * 6, dtype=np.float32).reshape(4, 1, 2, 3)
    labels = np.array([5, 6, 7, 8], np.float32)
    net.set_input_arrays(data, labels)
    for rows in ([0, 1], [2, 3], [0, 1]):
        net.forward()
        np.testing.assert_array_equal(net.blobs["data"].data, data[rows])
        # Caffe's Forward reshapes the label top to batch x 1 x 1 x 1.
        np.testing.assert_array_equal(net.blobs["label"].data, labels[rows].reshape(2, 1, 1, 1))


def test_set_input_arrays_checks_like_pycaffe():
    net = caffejax.Net(MEMORY, caffejax.TEST)
    good = np.zeros((2, 1, 2, 3), np.float32)
    labels = np.zeros(2, np.float32)
    with pytest.raises(DataError, match="float32"):
        net.set_input_arrays(good.astype(np.float64), labels)
    with pytest.raises(ShapeError, match="multiple of batch size"):
        net.set_input_arrays(np.zeros((3, 1, 2, 3), np.float32), np.zeros(3, np.float32))
    with pytest.raises(ShapeError, match="channels x height x width"):
        net.set_input_arrays(np.zeros((2, 2, 2, 3), np.float32), labels)
    with pytest.raises(DataError, match="C contiguous"):
        net.set_input_arrays(np.zeros((2, 1, 3, 2), np.float32).transpose(0, 1, 3, 2), labels)
    input_net = caffejax.Net('layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 1 } } }',
                             caffejax.TEST)
    with pytest.raises(caffejax.CaffejaxError, match="MemoryDataLayer"):
        input_net.set_input_arrays(good, labels)


def test_set_input_arrays_errors_are_runtime_errors_as_in_pycaffe():
    """pycaffe's checks throw std::runtime_error, which boost.python raises as RuntimeError."""
    net = caffejax.Net(MEMORY, caffejax.TEST)
    labels = np.zeros(2, np.float32)
    for data in (np.zeros((2, 1, 2, 3)), np.zeros((2, 1, 2), np.float32), np.zeros((3, 1, 2, 3), np.float32),
                 np.zeros((2, 1, 3, 2), np.float32).transpose(0, 1, 3, 2)):
        with pytest.raises(RuntimeError):
            net.set_input_arrays(data, labels)


# ---- WindowData ------------------------------------------------------------------------------------------------------

def window_net(window_file, params: str, transform_param: str = "crop_size: 4 mean_value: 10") -> str:
    return f'''name: "windows"
layer {{ name: "win" type: "WindowData" top: "data" top: "label"
  transform_param {{ {transform_param} }}
  window_data_param {{ source: "{window_file}" batch_size: 4 fg_threshold: 0.5 bg_threshold: 0.3
    fg_fraction: 0.5 {params} }} }}
'''


def test_window_data_samples_background_then_foreground_windows(tmp_path):
    rgb = np.random.default_rng(6).integers(0, 256, (10, 12, 3), dtype=np.uint8)
    optional("PIL.Image").fromarray(rgb).save(tmp_path / "scene.png")
    # Windows are exactly crop_size wide, so warping them is the identity.
    (tmp_path / "windows.txt").write_text(
        "# 0\nscene.png\n3 10 12\n3\n"
        "2 0.9 1 2 4 5\n"      # foreground, class 2: x 1..4, y 2..5
        "5 0.4 0 0 3 3\n"      # between thresholds: dropped
        "7 0.1 6 4 9 7\n")     # background: label forced to 0
    net = caffejax.Net(window_net(tmp_path / "windows.txt", f'root_folder: "{tmp_path}/"'), caffejax.TRAIN)
    assert net.blobs["data"].shape == (4, 3, 4, 4)
    net.forward()
    np.testing.assert_array_equal(net.blobs["label"].data, [0, 0, 2, 2])
    bgr = rgb[:, :, ::-1].transpose(2, 0, 1).astype(np.float32)
    np.testing.assert_array_equal(net.blobs["data"].data[0], bgr[:, 4:8, 6:10] - 10)
    np.testing.assert_array_equal(net.blobs["data"].data[3], bgr[:, 2:6, 1:5] - 10)


def test_window_data_context_pad_leaves_the_outside_of_the_image_zero(tmp_path):
    rgb = np.full((8, 8, 3), 200, np.uint8)
    optional("PIL.Image").fromarray(rgb).save(tmp_path / "flat.png")
    (tmp_path / "windows.txt").write_text(f"# 0\n{tmp_path / 'flat.png'}\n3 8 8\n2\n1 1.0 0 0 3 3\n3 0.0 0 0 3 3\n")
    net = caffejax.Net(window_net(tmp_path / "windows.txt", "context_pad: 1",
                                  "crop_size: 6 mean_value: 0"), caffejax.TRAIN)
    net.forward()
    # The 4 x 4 box at the corner grows by 6/4 to 6 x 6 around its centre (2, 2): x, y from -1 to 5, so one
    # warped pixel on the top and left lies outside the image and stays 0; the rest is the flat colour.
    item = net.blobs["data"].data[0]
    assert (item[:, 0, :] == 0).all() and (item[:, :, 0] == 0).all()
    np.testing.assert_array_equal(item[:, 1:, 1:], 200)


def test_window_file_with_bad_foreground_class_is_rejected(tmp_path):
    (tmp_path / "windows.txt").write_text("# 0\nx.png\n3 4 4\n1\n0 0.9 0 0 1 1\n")
    with pytest.raises(DataError, match="foreground"):
        caffejax.Net(window_net(tmp_path / "windows.txt", ""), caffejax.TRAIN)


def test_window_image_index_is_a_position_in_the_listed_images(tmp_path):
    """Caffe looks a window's image up as image_database_[image_index]: the images in the file's order, whatever
    number follows their '#'."""
    for name, value in (("first.png", 50), ("second.png", 150)):
        optional("PIL.Image").fromarray(np.full((4, 4, 3), value, np.uint8)).save(tmp_path / name)
    (tmp_path / "windows.txt").write_text("# 1\nfirst.png\n3 4 4\n1\n1 0.9 0 0 3 3\n"
                                          "# 0\nsecond.png\n3 4 4\n1\n0 0.1 0 0 3 3\n")
    net = caffejax.Net(window_net(tmp_path / "windows.txt", f'root_folder: "{tmp_path}/"', "crop_size: 4"),
                       caffejax.TRAIN)
    net.forward()
    np.testing.assert_array_equal(net.blobs["label"].data, [0, 0, 1, 1])
    # The background window ('# 0') is on the first listed image, the foreground one ('# 1') on the second.
    np.testing.assert_array_equal(net.blobs["data"].data[:2], 50)
    np.testing.assert_array_equal(net.blobs["data"].data[2:], 150)


def test_window_image_index_past_the_listed_images_is_a_data_error(tmp_path):
    (tmp_path / "windows.txt").write_text("# 1\nx.png\n3 4 4\n1\n1 0.9 0 0 3 3\n")
    with pytest.raises(DataError, match="refers to image 1.*lists 1 images"):
        caffejax.Net(window_net(tmp_path / "windows.txt", ""), caffejax.TRAIN)


def test_window_channels_of_images_but_the_last_are_not_used(tmp_path):
    """Every image is read in colour; only the last listed image's channels shape the data top (R-CNN's window
    files list gray images with 1 channel)."""
    optional("PIL.Image").fromarray(np.full((4, 4), 80, np.uint8)).save(tmp_path / "gray.png")
    (tmp_path / "windows.txt").write_text("# 0\ngray.png\n1 4 4\n1\n1 0.9 0 0 3 3\n"
                                          "# 1\ngray.png\n3 4 4\n1\n0 0.1 0 0 3 3\n")
    net = caffejax.Net(window_net(tmp_path / "windows.txt", f'root_folder: "{tmp_path}/"', "crop_size: 4"),
                       caffejax.TRAIN)
    assert net.blobs["data"].shape == (4, 3, 4, 4)
    net.forward()
    np.testing.assert_array_equal(net.blobs["data"].data, 80)
    (tmp_path / "windows.txt").write_text("# 0\ngray.png\n3 4 4\n1\n1 0.9 0 0 3 3\n"
                                          "# 1\ngray.png\n1 4 4\n1\n0 0.1 0 0 3 3\n")
    with pytest.raises(DataError, match="last image.*1 channels"):
        caffejax.Net(window_net(tmp_path / "windows.txt", ""), caffejax.TRAIN)


def test_window_file_is_read_as_istream_reads_it(tmp_path):
    """Tokens end at C whitespace only (a path may hold U+00A0), and numbers are what ``>> int`` and
    ``>> float`` take whole ("1_0", "nan" and non-ASCII digits are not numbers)."""
    name = "my\u00a0scene.png"
    optional("PIL.Image").fromarray(np.full((4, 4, 3), 9, np.uint8)).save(tmp_path / name)
    (tmp_path / "windows.txt").write_text(f"# 0\n{name}\n3 4 4\n2\n1 0.9 0 0 3 3\n0 .1e0 0 0 3 3\n")
    net = caffejax.Net(window_net(tmp_path / "windows.txt", f'root_folder: "{tmp_path}/"', "crop_size: 4"),
                       caffejax.TRAIN)
    net.forward()
    np.testing.assert_array_equal(net.blobs["data"].data, 9)
    for bad in ("1_0", "\u0663"):
        (tmp_path / "windows.txt").write_text(f"# 0\n{name}\n3 4 4\n1\n1 0.9 0 0 {bad} 3\n")
        with pytest.raises(DataError, match="expected int"):
            caffejax.Net(window_net(tmp_path / "windows.txt", ""), caffejax.TRAIN)
    (tmp_path / "windows.txt").write_text(f"# 0\n{name}\n3 4 4\n1\n1 nan 0 0 3 3\n")
    with pytest.raises(DataError, match="'nan', expected float"):
        caffejax.Net(window_net(tmp_path / "windows.txt", ""), caffejax.TRAIN)


def test_data_sources_leave_no_thread_running_after_close(raw_db):
    net = caffejax.Net(data_net(raw_db), caffejax.TEST)
    net.forward()
    for source in net._sources.values():
        source.close()
        assert not source._thread.is_alive()


def test_paths_are_resolved_from_the_working_directory_first(tmp_path, images, monkeypatch):
    write_lmdb(tmp_path / "db", [raw_datum(images[0], 1)])
    monkeypatch.chdir(tmp_path)
    net = caffejax.Net(data_net("db", batch_size=1), caffejax.TEST)
    net.forward()
    assert net.blobs["label"].data[0] == 1
    assert os.path.exists("db")


def test_net_close_stops_prefetching_and_the_next_forward_starts_over(tmp_path):
    write_images(tmp_path, 3)
    list_file = tmp_path / "list.txt"
    list_file.write_text("img 0.png 7\nimg 1.png 8\nimg 2.png 9\n")
    with caffejax.Net(image_data_net(list_file, f"{tmp_path}/"), caffejax.TEST) as net:
        first = batches(net, 2)
        threads = [s._thread for s in net._sources.values() if hasattr(s, "_thread")]
    assert net._sources == {} and threads and not any(t.is_alive() for t in threads)
    np.testing.assert_array_equal(batches(net, 1)[0]["label"], first[0]["label"])  # reopened from the start
    net.close()
