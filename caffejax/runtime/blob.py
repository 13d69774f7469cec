"""pycaffe's Blob: a named array with ``data`` and ``diff``, backed by device arrays.

Each of ``data``/``diff`` lives either on the device (a ``jax.Array`` the compiled program produced) or on
the host (a writable NumPy array handed to the user). Reading ``.data`` materialises the host copy once; from
then on the host copy is authoritative, so pycaffe idioms like ``net.blobs['data'].data[...] = x`` and net
surgery through ``net.params[name][i].data`` take effect on the next pass. When a pass produces a new value
for a blob whose host copy was handed out, the new value is copied into that same array, as pycaffe's views
onto Caffe's memory would show it.

A forward computes only what it must return (the blobs nothing later in the pass consumes, and the losses);
every other blob of the pass is *deferred*: its first read runs the pass again, from the same inputs,
params and random key, in a program that keeps all blobs. Serving pays for outputs only; pycaffe code that
inspects intermediate blobs still sees Caffe's values.
"""

from __future__ import annotations

import hashlib
import math
import sys

import jax
import numpy as np

from caffejax.errors import InputValueError, OutOfMemoryError, ShapeError
from caffejax.lower.registry import legacy_4d

# sys.getrefcount of a slot's host array that only the slot holds: the slot's reference and the call's own.
_UNHELD = 2


def _zeros(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """np.zeros, with an allocation the host cannot make as an OutOfMemoryError naming the shape."""
    try:
        return np.zeros(shape, dtype)
    except MemoryError:
        gib = math.prod(shape) * dtype.itemsize / 2 ** 30
        raise OutOfMemoryError(f"an array of shape {shape} ({dtype}) needs {gib:.3g} GiB, more than the host "
                               f"could allocate; is a dim mistyped?") from None


def as_numbers(name: str, x, dtype, what: str = "input") -> np.ndarray:
    """The ``what`` (an input, a diff) ``x`` of blob ``name`` as a NumPy array of ``dtype``; an InputValueError
    naming the blob where it is no array of numbers."""
    try:
        return np.asarray(x, dtype)
    except (ValueError, TypeError) as error:
        raise InputValueError(f"{what} '{name}' is not an array of numbers: {error}") from None


def same_bits(a: np.ndarray, b: np.ndarray, chunk: int = 1 << 18) -> bool:
    """Whether two arrays of one shape and dtype hold the same bits (NaNs and -0.0 included), stopping at the
    first chunk that differs: new data written over a held array costs one chunk to tell apart. Two views of the
    same memory are the same without a read (compile_inference's programs adopt the weights its kernels read as
    they are: a new program's are the kept ones' memory)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.strides == b.strides:
        return True
    bits = np.dtype(f"u{a.dtype.itemsize}") if a.dtype.itemsize in (1, 2, 4, 8) else None
    a, b = a.reshape(-1), b.reshape(-1)
    if bits is not None:
        a, b = a.view(bits), b.view(bits)
    return all(np.array_equal(a[i:i + chunk], b[i:i + chunk]) for i in range(0, a.size, chunk))


def bits_digest(a: np.ndarray) -> bytes:
    """A SHA-256 digest of an array's shape, dtype and bits: equal digests, arrays of :func:`same_bits`."""
    a = np.ascontiguousarray(a)
    digest = hashlib.sha256(repr((a.shape, a.dtype.str)).encode())
    digest.update(a.reshape(-1).view(np.uint8))
    return digest.digest()


# A held host array of at least this size is handed to programs as a device copy, smaller ones as a NumPy copy
# (ArraySlot.value). A device copy is made once while the bits stay, where a NumPy argument is copied onto the
# device by every program given it: AlexNet at batch 16 with its 244 MB of weights held took 335 -> 215 ms a
# forward (2 AMD EPYC cores). But jax.device_put costs about 90 us more than NumPy's copy, which is more than a
# NumPy argument's transfer under 1 MB: LeNet's forward at batch 1 with its held data rewritten each pass took
# 500 -> 670-780 us with every held array handed on the device.
HANDED_ON_DEVICE_MIN_BYTES = 1 << 20


class ArraySlot:
    """One array that is either on the device, on the host, or both (host wins)."""

    __slots__ = ("_device", "_host", "_shape", "_dtype", "_pending", "_handed")

    def __init__(self, shape, dtype=np.float32):
        self._device = None
        self._host = None
        # The private copy of a held host array last handed to a program (value()): one more copy of each held
        # array, kept until its bits change, a new value is set, or nobody holds it any more.
        self._handed = None
        self._shape = tuple(shape)
        self._dtype = np.dtype(dtype)
        self._pending = None

    def defer(self, loader) -> None:
        """The value exists but was not computed yet: ``loader()`` will ``set`` it on first read."""
        self._pending = loader

    def _resolve(self) -> None:
        if self._pending is not None:
            self._pending()  # sets this slot (and its siblings deferred with it), which clears _pending
            self._pending = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    def host(self) -> np.ndarray:
        """The writable host array (materialised from the device value, or zeros)."""
        self._resolve()
        if self._host is None:
            if self._device is not None:
                self._host = np.array(self._device, dtype=self._dtype, copy=True)
            else:
                self._host = _zeros(self._shape, self._dtype)
        return self._host

    def value(self):
        """What a compiled program should read: the host copy if one was handed out, else the device value.

        The host array is handed over as a private copy: JAX may compute from a NumPy argument's memory without
        copying it, and asynchronously, so the user's next ``blob.data[...] = x`` would otherwise race with the
        pass still reading it (training then silently depends on timing). A big one goes to the device then
        (HANDED_ON_DEVICE_MIN_BYTES). While the held array's bits stay as they were, the same copy is handed
        again: a held weight is neither copied again nor moved to the device on every pass, and a backward knows
        its forward's inputs by identity (Net._pullbacks).
        """
        self._resolve()
        if self._host is None and self._device is None:
            self._host = _zeros(self._shape, self._dtype)
        if self._host is not None:
            if sys.getrefcount(self._host) > _UNHELD:
                # (A program may have been given the device value it holds, and used up its buffer: donated.)
                if (self._handed is None or (isinstance(self._handed, jax.Array) and self._handed.is_deleted())
                        or not same_bits(np.asarray(self._handed), self._host)):
                    self._handed = np.array(self._host)
                    if self._handed.nbytes >= HANDED_ON_DEVICE_MIN_BYTES:
                        # Of the private copy: JAX's CPU client may alias the NumPy memory it is given.
                        self._handed = jax.device_put(self._handed).block_until_ready()
                return self._handed
            # Nobody holds the array handed out any more, so nobody can write to it: it is the value as it is.
            self._device, self._host, self._handed = self._host, None, None
        return self._device

    def set(self, value) -> None:
        """Store a new value (device or host array) of this slot's shape. A host array handed out earlier and
        still held (by the user, or by a view of it) gets the new value copied in, as a view onto Caffe's
        memory would show it; one nobody holds any more is dropped instead, so that the value stays where the
        program made it (a solver whose weights were once written through ``.data`` would otherwise copy
        every weight and diff to the host and back on every iteration)."""
        self._pending = None
        self._handed = None
        shape = tuple(value.shape)
        if self._host is not None and self._host.shape == shape and sys.getrefcount(self._host) > _UNHELD:
            np.copyto(self._host, np.asarray(value))
            self._device = None
            if isinstance(value, jax.Array) and value.dtype == self._host.dtype:
                # The held array now holds its bits: the next pass is handed the value itself, not a new copy
                # of it (a solver's new weights, held by the user, on every iteration).
                self._handed = value
        else:
            self._host = None
            self._device = value
            self._shape = shape

    def reshape(self, shape) -> None:
        shape = tuple(int(d) for d in shape)
        if shape != self._shape:
            self._shape = shape
            self._device = None
            self._host = None
            self._handed = None
            self._pending = None

    def on_host(self) -> bool:
        return self._host is not None


class Blob:
    """A Caffe blob as pycaffe shows it: ``data``, ``diff``, ``shape``, ``count``, ``reshape``."""

    def __init__(self, shape, dtype=np.float32):
        self._data = ArraySlot(shape, dtype)
        self._diff = ArraySlot(shape, dtype)

    @property
    def data(self) -> np.ndarray:
        return self._data.host()

    @data.setter
    def data(self, value) -> None:
        self.data[...] = value

    @property
    def diff(self) -> np.ndarray:
        return self._diff.host()

    @diff.setter
    def diff(self, value) -> None:
        self.diff[...] = value

    @property
    def shape(self) -> tuple[int, ...]:
        return self._data.shape

    @property
    def count(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def _legacy(self, i: int) -> int:
        # pycaffe's num/channels/height/width: Caffe's LegacyShape, 1 beyond the blob's axes.
        return legacy_4d(self.shape)[i]

    @property
    def num(self) -> int:
        return self._legacy(0)

    @property
    def channels(self) -> int:
        return self._legacy(1)

    @property
    def height(self) -> int:
        return self._legacy(2)

    @property
    def width(self) -> int:
        return self._legacy(3)

    def reshape(self, *shape) -> None:
        """Change the shape (data and diff are reset); the net picks it up on the next forward/reshape."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        try:
            bad = [d for d in shape if d < 0 or int(d) != d]
        except (TypeError, ValueError):
            bad = [d for d in shape if not isinstance(d, (int, np.integer))]
        if bad:  # Blob::Reshape's CHECK_GE(shape[i], 0); a fraction would be cut silently
            raise ShapeError(f"Blob.reshape{tuple(shape)}: every dim must be a whole number >= 0, got {bad}")
        self._data.reshape(shape)
        self._diff.reshape(shape)

    def __repr__(self) -> str:
        return f"Blob(shape={self.shape})"
