"""Caffe's fillers (filler.hpp), mirroring BVLC's test_filler.cpp: same distributions, not the same numbers."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from google.protobuf import text_format

from caffejax.errors import CaffejaxError
from caffejax.lower.fillers import fill
from caffejax.proto import caffe_pb2


def _filler(text: str = "") -> caffe_pb2.FillerParameter:
    return text_format.Parse(text, caffe_pb2.FillerParameter())


def _fill(text, shape, seed=0, dtype=np.float32):
    return np.asarray(fill(_filler(text), shape, jax.random.key(seed), dtype))


def test_default_is_constant_zero():
    data = _fill("", (2, 3, 4, 5))
    assert data.shape == (2, 3, 4, 5) and data.dtype == np.float32 and not np.any(data)


def test_constant():
    np.testing.assert_array_equal(_fill('type: "constant" value: 10', (2, 3, 4, 5)), 10)


def test_uniform_range():
    data = _fill('type: "uniform" min: 1 max: 2', (20, 30, 4, 5))
    assert data.min() >= 1 and data.max() <= 2
    assert abs(data.mean() - 1.5) < 0.01 and abs(data.std() - np.sqrt(1 / 12)) < 0.01


def test_positive_unitball_rows_sum_to_one():
    data = _fill('type: "positive_unitball"', (2, 3, 4, 5))
    assert data.min() >= 0 and data.max() <= 1
    np.testing.assert_allclose(data.reshape(2, -1).sum(axis=1), 1, rtol=1e-5)


def test_gaussian_mean_and_std():
    data = _fill('type: "gaussian" mean: 10 std: 0.1', (200, 3, 4, 5))
    assert abs(data.mean() - 10) < 0.1 * 0.05 and abs(data.std() - 0.1) < 0.1 * 0.05


def test_gaussian_sparse_keeps_sparse_over_num_outputs():
    # 20 outputs, sparse 5: each weight survives with probability 5 / 20.
    data = _fill('type: "gaussian" std: 1 sparse: 5', (20, 5000))
    assert abs(np.mean(data != 0) - 0.25) < 0.01


def test_gaussian_sparse_zero_is_all_zero_and_too_large_is_rejected():
    assert not np.any(_fill('type: "gaussian" sparse: 0', (4, 6)))
    with pytest.raises(CaffejaxError, match="sparse"):
        _fill('type: "gaussian" sparse: 5', (4, 6))


FAN_SHAPE = (1000, 2, 4, 5)  # fan_in = 40, fan_out = 20000 (test_filler.cpp's blob)


@pytest.mark.parametrize("norm,n", [("FAN_IN", 40), ("FAN_OUT", 20000), ("AVERAGE", (40 + 20000) / 2)])
def test_xavier_variance_norm(norm, n):
    data = _fill(f'type: "xavier" variance_norm: {norm}', FAN_SHAPE)
    scale = np.sqrt(3 / n)
    assert np.abs(data).max() <= scale
    assert abs(data.mean()) < 0.01 * scale
    assert abs(data.std() - np.sqrt(1 / n)) < 0.02 * np.sqrt(1 / n)  # U(-a, a) has std a / sqrt(3)


@pytest.mark.parametrize("norm,n", [("FAN_IN", 40), ("FAN_OUT", 20000), ("AVERAGE", (40 + 20000) / 2)])
def test_msra_variance_norm(norm, n):
    data = _fill(f'type: "msra" variance_norm: {norm}', FAN_SHAPE)
    std = np.sqrt(2 / n)
    assert abs(data.mean()) < 0.01 * std
    assert abs(data.std() - std) < 0.02 * std


@pytest.mark.parametrize("kind", ["xavier", "msra", "gaussian", "uniform", "positive_unitball", "constant"])
@pytest.mark.parametrize("shape", [(25,), (8, 3), (2, 3, 4, 5, 2)])
def test_fillers_work_on_1d_2d_and_5d_blobs(kind, shape):
    data = _fill(f'type: "{kind}"', shape)
    assert data.shape == shape and np.all(np.isfinite(data))


def test_xavier_1d_fans():
    # 1-D: fan_in = count / shape(0) = 1, fan_out = count.
    assert np.abs(_fill('type: "xavier"', (50,))).max() > np.sqrt(3 / 50)
    assert np.abs(_fill('type: "xavier" variance_norm: FAN_OUT', (50,))).max() <= np.sqrt(3 / 50)


@pytest.mark.parametrize("k", [7, 6, 4, 3])
def test_bilinear_exact_values(k):
    data = _fill('type: "bilinear"', (3, 2, k, k))
    f = np.ceil(k / 2.0)
    c = (k - 1) / (2.0 * f)
    t = np.arange(k)
    expected = np.outer(1 - np.abs(t / f - c), 1 - np.abs(t / f - c))
    for i in range(3):
        for j in range(2):
            np.testing.assert_allclose(data[i, j], expected, atol=1e-6)


def test_bilinear_rejects_non_square_and_non_4d():
    with pytest.raises(CaffejaxError, match="square"):
        _fill('type: "bilinear"', (1, 1, 4, 3))
    with pytest.raises(CaffejaxError, match="4-D"):
        _fill('type: "bilinear"', (1, 4, 4))


def test_unknown_type_is_named():
    with pytest.raises(CaffejaxError, match="'fancy'"):
        _fill('type: "fancy"', (2, 2))


@pytest.mark.parametrize("text,match", [
    ('type: "uniform" sparse: 2', "sparsity"),
    ('type: "xavier" sparse: 2', "sparsity"),
    ('type: "uniform" min: 2 max: 1', "min"),
    ('type: "gaussian" std: 0', "std"),
    ('type: "gaussian" sparse: -2', "sparse"),
])
def test_rejects_what_caffe_checks(text, match):
    with pytest.raises(CaffejaxError, match=match):
        _fill(text, (4, 4))


def test_rejects_empty_and_scalar_blobs_where_caffe_does():
    with pytest.raises(CaffejaxError, match="no elements"):
        _fill('type: "constant"', (0, 3))
    with pytest.raises(CaffejaxError, match="at least one axis"):
        _fill('type: "xavier"', ())
    np.testing.assert_array_equal(_fill('type: "constant" value: 0.25', ()), 0.25)


def test_keys_and_dtypes():
    a, b = _fill('type: "gaussian"', (10,), seed=1), _fill('type: "gaussian"', (10,), seed=2)
    assert not np.array_equal(a, b)
    np.testing.assert_array_equal(a, _fill('type: "gaussian"', (10,), seed=1))
    with jax.enable_x64(True):
        assert _fill('type: "msra"', (3, 4), dtype=np.float64).dtype == np.float64
