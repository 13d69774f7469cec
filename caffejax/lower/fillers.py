"""Caffe's weight fillers (filler.hpp): ``FillerParameter`` + blob shape -> initial values.

Each filler draws from the same distribution as Caffe's (not the same random numbers: Caffe uses boost's
mt19937, we use ``jax.random``). The fan of a blob follows filler.hpp: ``fan_in = count / shape(0)`` and
``fan_out = count / shape(1)`` (``count`` for a 1-D blob). Settings Caffe CHECK-fails on (a sparse
non-gaussian filler, an unknown type, an empty blob, ...) raise :class:`SchemaError`.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from caffejax.errors import SchemaError

Shape = tuple[int, ...]

# caffe.proto's FillerParameter.VarianceNorm values.
FAN_IN, FAN_OUT, AVERAGE = 0, 1, 2


class HostKey:
    """A NumPy random stream standing in for a ``jax.random`` key.

    Initialising a net runs every layer's fillers once, on the host: drawing with NumPy there costs
    nothing to compile, where the same draws in JAX cost an XLA compilation per net. Fillers and
    ``init_params`` accept either kind of key; use :func:`split` and :func:`fold_in` to derive keys.
    """

    def __init__(self, seed: np.random.SeedSequence | int):
        self.seed = seed if isinstance(seed, np.random.SeedSequence) else np.random.SeedSequence(seed)
        self.rng = np.random.default_rng(self.seed)


def split(key, n: int) -> list:
    """``n`` independent keys from ``key`` (a jax key or a HostKey)."""
    if isinstance(key, HostKey):
        return [HostKey(s) for s in key.seed.spawn(max(n, 1))]
    return list(jax.random.split(key, max(n, 1)))


def fold_in(key, data: int):
    """A key for item ``data`` of ``key`` (a jax key or a HostKey)."""
    if isinstance(key, HostKey):
        return HostKey(np.random.SeedSequence(list(key.seed.generate_state(2)) + [int(data)]))
    return jax.random.fold_in(key, data)


def fill(filler_param: Any, shape: Sequence[int], key, dtype=np.float32):
    """Caffe's ``GetFiller(filler_param)->Fill(blob)`` for a blob of ``shape``.

    With a jax key the result is a ``jax.Array`` (traceable); with a :class:`HostKey`, a NumPy array.
    """
    shape = tuple(int(d) for d in shape)
    kind = filler_param.type
    if kind not in _FILLERS:
        raise SchemaError(f"unknown filler type {kind!r} (Caffe knows {', '.join(sorted(_FILLERS))})")
    if count(shape) == 0:
        raise SchemaError(f"{kind} filler: blob of shape {shape} has no elements")
    if filler_param.sparse < -1:
        raise SchemaError(f"{kind} filler: sparse must be >= -1, got {filler_param.sparse}")
    if kind != "gaussian" and filler_param.sparse != -1:
        raise SchemaError(f"{kind} filler: sparsity is only supported by the gaussian filler "
                          f"(sparse: {filler_param.sparse})")
    values = _FILLERS[kind](filler_param, shape, key, dtype)
    return np.asarray(values, dtype) if isinstance(key, HostKey) else jnp.asarray(values, dtype=dtype)


def _xp(key):
    """The array module for ``key``'s side: NumPy on the host, jax.numpy in a program."""
    return np if isinstance(key, HostKey) else jnp


def count(shape: Shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _leading(kind: str, shape: Shape) -> int:
    """shape(0), which Caffe's fillers read (a CHECK failure for a 0-D blob)."""
    if not shape:
        raise SchemaError(f"{kind} filler needs a blob with at least one axis, got shape ()")
    return shape[0]


def _constant(p, shape: Shape, key, dtype):
    """x = value."""
    return _xp(key).full(shape, p.value, dtype)


def _uniform(p, shape: Shape, key, dtype):
    """x ~ U(min, max)."""
    return _rng_uniform("uniform", shape, key, dtype, p.min, p.max)


def _gaussian(p, shape: Shape, key, dtype):
    """x ~ N(mean, std^2); with sparse >= 0 each weight survives with probability sparse / shape(0)."""
    value_key, mask_key = split(key, 2)
    data = _rng_gaussian("gaussian", shape, value_key, dtype, p.mean, p.std)
    if p.sparse >= 0:
        # filler.hpp: "the mean number of non-zero input weights for a given output", num_outputs = shape(0).
        probability = float(np.float32(p.sparse) / np.float32(_leading("gaussian", shape)))
        if probability > 1:
            raise SchemaError(f"gaussian filler: sparse {p.sparse} exceeds the blob's {shape[0]} outputs "
                              f"(keep probability {probability} > 1)")
        data = data * _rng_bernoulli(mask_key, probability, shape).astype(dtype)
    return data


def _positive_unitball(p, shape: Shape, key, dtype):
    """x ~ U(0, 1), then every row (the count / shape(0) values of one output) is divided by its sum."""
    rows = _leading("positive_unitball", shape)
    data = _rng_uniform("positive_unitball", (rows, count(shape) // rows), key, dtype, 0.0, 1.0)
    return (data / data.sum(axis=1, keepdims=True)).reshape(shape)


def _xavier(p, shape: Shape, key, dtype):
    """x ~ U(-sqrt(3/n), sqrt(3/n)) with n the fan chosen by variance_norm."""
    scale = math.sqrt(3.0 / _fan("xavier", p, shape))
    return _rng_uniform("xavier", shape, key, dtype, -scale, scale)


def _msra(p, shape: Shape, key, dtype):
    """x ~ N(0, 2/n) with n the fan chosen by variance_norm."""
    return _rng_gaussian("msra", shape, key, dtype, 0.0, math.sqrt(2.0 / _fan("msra", p, shape)))


def _bilinear(p, shape: Shape, key, dtype):
    """The (K x K) bilinear upsampling kernel, f = ceil(K/2), c = (K-1)/(2f), in every (n, c) slot."""
    if len(shape) != 4:
        raise SchemaError(f"bilinear filler: blob must be 4-D, got shape {shape}")
    if shape[2] != shape[3]:
        raise SchemaError(f"bilinear filler: filter must be square, got {shape[2]}x{shape[3]}")
    k = shape[3]
    f = math.ceil(k / 2.0)
    c = (k - 1) / (2.0 * f)
    # filler.hpp evaluates this in float; x and y are the column and row within the kernel.
    t = np.arange(k, dtype=np.float32)
    profile = (np.float32(1) - np.abs(t / np.float32(f) - np.float32(c))).astype(np.float32)
    kernel = np.outer(profile, profile).astype(np.float32)
    xp = _xp(key)
    return xp.broadcast_to(xp.asarray(kernel, dtype), shape)


def _fan(kind: str, p, shape: Shape) -> float:
    n = count(shape)
    fan_in = n // _leading(kind, shape)
    fan_out = n // shape[1] if len(shape) > 1 else n
    if p.variance_norm == AVERAGE:
        return (fan_in + fan_out) / 2.0
    if p.variance_norm == FAN_OUT:
        return float(fan_out)
    return float(fan_in)


def _rng_uniform(kind: str, shape: Shape, key, dtype, low: float, high: float):
    if not low <= high:  # caffe_rng_uniform: CHECK_LE(a, b)
        raise SchemaError(f"{kind} filler: min {low} must not exceed max {high}")
    if isinstance(key, HostKey):
        return key.rng.uniform(low, high, shape).astype(dtype)
    return jax.random.uniform(key, shape, dtype, low, high)


def _rng_gaussian(kind: str, shape: Shape, key, dtype, mean: float, std: float):
    if not std > 0:  # caffe_rng_gaussian: CHECK_GT(sigma, 0)
        raise SchemaError(f"{kind} filler: std must be > 0, got {std}")
    if isinstance(key, HostKey):
        return (mean + std * key.rng.standard_normal(shape)).astype(dtype)
    return mean + std * jax.random.normal(key, shape, dtype)


def _rng_bernoulli(key, probability: float, shape: Shape):
    if isinstance(key, HostKey):
        return key.rng.random(shape) < probability
    return jax.random.bernoulli(key, probability, shape)


_FILLERS: dict[str, Callable[[Any, Shape, jax.Array, Any], jax.Array]] = {
    "constant": _constant,
    "uniform": _uniform,
    "gaussian": _gaussian,
    "positive_unitball": _positive_unitball,
    "xavier": _xavier,
    "msra": _msra,
    "bilinear": _bilinear,
}
