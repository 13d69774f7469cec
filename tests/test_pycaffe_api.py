"""caffejax.Net against pycaffe's and net.cpp's contract where they were found to differ: the constructor's
positional forms, a missing prototxt, top diffs of the wrong shape, Caffe's blob count and shape checks when
copying weights (binary and HDF5), and ShareTrainedLayersWith's checks."""

from __future__ import annotations

import numpy as np
import pytest

import caffejax
from caffejax.frontend.caffemodel import _encode_len_field
from caffejax.proto import caffe_pb2

# 'b' shares 'a''s weights by ParamSpec name; 'gated' exists only at level 1 in stage "deploy".
NET = """
name: "api"
input: "x" input_shape { dim: 2 dim: 3 }
layer { name: "a" type: "InnerProduct" bottom: "x" top: "a" param { name: "w" }
        inner_product_param { num_output: 4 weight_filler { type: "gaussian" } } }
layer { name: "b" type: "InnerProduct" bottom: "x" top: "b" param { name: "w" }
        inner_product_param { num_output: 4 bias_term: false weight_filler { type: "gaussian" } } }
layer { name: "c" type: "Eltwise" bottom: "a" bottom: "b" top: "c" }
layer { name: "gated" type: "ReLU" bottom: "c" top: "c" include { min_level: 1 stage: "deploy" } }
"""


def net(**kwargs):
    return caffejax.Net(NET, caffejax.TEST, **kwargs)


def weights_of(n):
    return {name: [np.array(b.data) for b in blobs] for name, blobs in n.params.items()}


def assert_weights_unchanged(n, before):
    for name, blobs in n.params.items():
        for blob, old in zip(blobs, before[name]):
            np.testing.assert_array_equal(blob.data, old)


# ---- the constructor ----------------------------------------------------------------------------------------

def test_positional_arguments_after_the_phase_are_pycaffes_level_stages_and_weights(tmp_path):
    """pycaffe's Net(file, phase, level=0, stages=None, weights=None): an int after the phase is the level, not
    a second phase (caffejax took Net(f, TEST, 0) for a TRAIN net)."""
    path = tmp_path / "w.caffemodel"
    net().save(str(path))
    assert caffejax.Net(NET, caffejax.TEST, 0).phase == caffejax.TEST
    gated = caffejax.Net(NET, caffejax.TEST, 1, ["deploy"], str(path))
    assert "gated" in gated._layer_names and gated.phase == caffejax.TEST
    assert "gated" not in caffejax.Net(NET, caffejax.TEST, 0, ["deploy"])._layer_names
    np.testing.assert_array_equal(gated.params["a"][0].data, caffejax.Net(NET, str(path), caffejax.TEST)
                                  .params["a"][0].data)
    with pytest.raises(TypeError):
        caffejax.Net(NET, caffejax.TEST, 0, ["deploy"], 3)


def test_a_missing_prototxt_is_named_as_a_missing_file():
    """pycaffe says "Could not open file ..."; caffejax parsed the path as prototxt text ("no field named")."""
    with pytest.raises(caffejax.ParseError, match=r"nope/deploy\.prototxt: cannot read file"):
        caffejax.Net("nope/deploy.prototxt", caffejax.TEST)
    # One-line prototxt text is still text.
    assert caffejax.Net('input: "x" input_shape { dim: 1 }', caffejax.TEST).inputs == ["x"]


# ---- passes ---------------------------------------------------------------------------------------------------

def test_a_top_diff_of_the_wrong_shape_is_a_shape_error_and_writes_nothing():
    """backward(**diffs) checked only the batch dim, so a diff that does not fit failed in NumPy (ValueError)."""
    n = net()
    n.forward(x=np.ones((2, 3), np.float32))
    with pytest.raises(caffejax.ShapeError, match=r"'c' has shape \(2, 5\); the blob is \(2, 4\)"):
        n.backward(c=np.ones((2, 5), np.float32))
    np.testing.assert_array_equal(n.blobs["c"].diff, 0.0)
    assert n.backward(c=np.ones((2, 1), np.float32))["x"].shape == (2, 3)  # broadcasts, as NumPy's [...] = does


# ---- weights: Caffe's count and shape checks -------------------------------------------------------------------

def test_an_hdf5_layer_missing_an_owned_blob_names_the_blob(tmp_path):
    """CopyTrainedLayersFromHDF5 may skip only shared blobs; the message said "2 blobs in the file but 2"."""
    h5py = pytest.importorskip("h5py")
    path = tmp_path / "w.caffemodel.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("data/a/1", data=np.zeros(4, np.float32))
    n = net()
    before = weights_of(n)
    with pytest.raises(caffejax.WeightsError, match=r"layer 'a' has no blob 0 in the file \('data/a/0'; it holds "
                                                     r"\[1\] of the net's 2\)"):
        n.copy_from(str(path))
    assert_weights_unchanged(n, before)
    # 'b''s only blob is 'a''s: a file without it (as Caffe's ToHDF5 writes it) loads.
    with h5py.File(path, "w") as f:
        f.create_dataset("data/a/0", data=np.full((4, 3), 2, np.float32))
        f.create_dataset("data/a/1", data=np.zeros(4, np.float32))
        f.create_group("data/b")
    n.load_hdf5(str(path))
    np.testing.assert_array_equal(n.params["b"][0].data, 2.0)


def test_an_hdf5_blob_must_have_the_nets_shape_exactly(tmp_path):
    """hdf5_load_nd_dataset(reshape=false) CHECKs equal dims: no right-aligned 4-D match as for legacy protos."""
    h5py = pytest.importorskip("h5py")
    path = tmp_path / "w.caffemodel.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("data/a/0", data=np.zeros((1, 1, 4, 3), np.float32))
        f.create_dataset("data/a/1", data=np.zeros(4, np.float32))
    with pytest.raises(caffejax.WeightsError, match=r"'a'.*\(1, 1, 4, 3\).*\(4, 3\)"):
        net().copy_from(str(path))


def blob(array, legacy: bool) -> caffe_pb2.BlobProto:
    proto = caffe_pb2.BlobProto(data=np.ravel(array).tolist())
    if legacy:
        proto.num, proto.channels, proto.height, proto.width = (1,) * (4 - array.ndim) + array.shape
    else:
        proto.shape.dim.extend((1,) * (4 - array.ndim) + array.shape)
    return proto


def write_layer_a(path, legacy: bool) -> None:
    """A caffemodel whose layer 'a' holds its weights and bias as 4-D BlobProtos (1x1x4x3, 1x1x1x4)."""
    layer = caffe_pb2.LayerParameter(name="a", type="InnerProduct")
    layer.blobs.extend([blob(np.full((4, 3), 5.0), legacy), blob(np.arange(4.0), legacy)])
    path.write_bytes(_encode_len_field(100, layer.SerializeToString()))


def test_only_legacy_4d_blob_protos_match_a_net_blob_of_fewer_axes(tmp_path):
    """Blob::ShapeEquals right-aligns only a proto that sets num/channels/height/width; a 4-D shape.dim must
    equal the net's shape (caffejax accepted both)."""
    legacy, modern = tmp_path / "legacy.caffemodel", tmp_path / "modern.caffemodel"
    write_layer_a(legacy, legacy=True)
    write_layer_a(modern, legacy=False)
    n = net()
    n.copy_from(str(legacy))
    np.testing.assert_array_equal(n.params["a"][0].data, 5.0)
    np.testing.assert_array_equal(n.params["a"][1].data, np.arange(4.0))
    before = weights_of(n)
    with pytest.raises(caffejax.WeightsError, match=r"'a'.*\(1, 1, 4, 3\).*\(4, 3\)"):
        n.copy_from(str(modern))
    assert_weights_unchanged(n, before)


# ---- share_with ---------------------------------------------------------------------------------------------

def test_share_with_checks_every_layer_of_the_other_net_as_caffe_does():
    """ShareTrainedLayersWith walks the source net's layers and CHECKs the blob counts of each one our net has
    too, a layer without blobs against one with them included; caffejax skipped such a pair silently, and
    shared the blobs before a later layer's mismatch."""
    blobless_a = caffejax.Net("""
        input: "x" input_shape { dim: 2 dim: 3 }
        layer { name: "b" type: "InnerProduct" bottom: "x" top: "b"
                inner_product_param { num_output: 4 bias_term: false } }
        layer { name: "a" type: "ReLU" bottom: "b" top: "a" }
    """, caffejax.TEST)
    n = net()
    before = weights_of(n)
    with pytest.raises(caffejax.WeightsError, match=r"cannot share layer 'a': 0 blobs there, 2 here"):
        n.share_with(blobless_a)
    blobless_a.params["b"][0].data[...] = 9.0
    assert_weights_unchanged(n, before)  # 'b', which fits and comes first, was not shared either
    other = net()
    n.share_with(other)
    other.params["a"][0].data[...] = 3.0
    np.testing.assert_array_equal(n.params["b"][0].data, 3.0)


def test_a_net_from_something_not_a_prototxt_says_what_it_takes():
    """Net(dict) or Net(bytes): a TypeError saying what a net comes from; it was AttributeError ("'dict' object has
    no attribute 'split'") or TypeError ("a bytes-like object is required") from inside the prototxt parser."""
    for source, extra in (({"layer": []}, "not a dict$"), (b'name: "x"', "not a bytes \\(decode the bytes first")):
        with pytest.raises(TypeError, match="a NetParameter comes from a prototxt path, prototxt text \\(str\\) or a "
                                            "caffe_pb2.NetParameter, " + extra):
            caffejax.Net(source, caffejax.TEST)


def test_blob_reshape_refuses_negative_and_fractional_dims():
    """Blob::Reshape CHECKs every dim >= 0. caffejax took -1 silently and failed later inside NumPy ('negative
    dimensions are not allowed') at the first read, and cut 2.5 to 2. Whole numbers of any type still do."""
    net = caffejax.Net('layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }',
                       caffejax.TEST)
    for dims in ((-1, 3), (2.5, 3), ("2", 3)):
        with pytest.raises(caffejax.ShapeError, match=r"every dim must be a whole number >= 0"):
            net.blobs["x"].reshape(*dims)
        assert net.blobs["x"].shape == (2, 3) and net.blobs["x"].data.shape == (2, 3)
    net.blobs["x"].reshape(np.int64(4), 3.0)
    assert net.blobs["x"].shape == (4, 3) and net.forward()["x"].shape == (4, 3)
