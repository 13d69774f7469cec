"""What every data layer shares (Caffe's base_data_layer.cpp): where its files are, its random stream, and
the prefetch thread that keeps ready batches queued so the compiled program never waits on I/O.
"""

from __future__ import annotations

import os
import queue
import re
import threading
import weakref
import zlib
from typing import Callable, Sequence

import numpy as np

from caffejax.errors import CaffejaxError, DataError, DataSourceUnavailable, SchemaError, layer_error

Batch = list[np.ndarray]


def resolve_path(path: str, *base_dirs: str | None) -> str | None:
    """An existing file for ``path``: as Caffe opens it (relative to the working directory), else relative to
    each of ``base_dirs`` in turn (the prototxt's folder, a list file's folder); None when none exists."""
    if os.path.exists(path):
        return path
    if not os.path.isabs(path):
        for base_dir in base_dirs:
            if base_dir and os.path.exists(os.path.join(base_dir, path)):
                return os.path.join(base_dir, path)
    return None


def require_source(layer, path: str, base_dir: str | None, what: str) -> str:
    """``resolve_path`` or DataSourceUnavailable naming the layer and where it looked."""
    if not path:
        raise layer_error(DataSourceUnavailable, layer.name, layer.type, f"no {what} given (source is empty)")
    found = resolve_path(path, base_dir)
    if found is None:
        places = f"'{os.path.abspath(path)}'"
        if base_dir and not os.path.isabs(path):
            places += f" or '{os.path.join(base_dir, path)}'"
        raise layer_error(DataSourceUnavailable, layer.name, layer.type, f"{what} '{path}' not found (looked at "
                          f"{places})")
    return found


# What C's isspace() is true for in the "C" locale: the only separators Caffe's ``std::istream >>`` and ``atoi``
# know. Python's str.split() and re's \s also split at Unicode spaces (U+00A0, U+2003, U+001C, ...).
C_WHITESPACE = " \t\n\v\f\r"
_C_TOKEN = re.compile(f"[^{C_WHITESPACE}]+")
_C_ATOI = re.compile(f"[{C_WHITESPACE}]*([+-]?[0-9]+)")


def c_tokens(text: str) -> list[str]:
    """``text`` cut into words as ``std::istream >> std::string`` reads them (at runs of C whitespace)."""
    return _C_TOKEN.findall(text)


def c_atoi(text: str) -> int:
    """glibc's atoi: leading C whitespace, a sign, ASCII digits (0 when there are none); a value past a long
    saturates (strtol) and is then cut to an int's 32 bits."""
    match = _C_ATOI.match(text)
    if match is None:
        return 0
    value = max(-(2**63), min(2**63 - 1, int(match.group(1))))
    return (value + 2**31) % 2**32 - 2**31


def layer_rng(layer, phase: int) -> np.random.Generator:
    """The layer's own random stream (crops, mirrors, shuffles), seeded from caffejax's seed: reproducible
    under ``set_random_seed``, and different for every layer and phase."""
    from caffejax.runtime import mode

    return np.random.default_rng([mode.random_seed() & 0xFFFFFFFF, zlib.crc32(layer.name.encode()), phase])


def positive_batch_size(layer, batch_size: int) -> int:
    if batch_size <= 0:
        raise layer_error(SchemaError, layer.name, layer.type, f"batch_size must be positive, got {batch_size}")
    return int(batch_size)


def lazy_import(module: str, layer, extra: str = "data"):
    """Import an optional dependency, or say which pip extra provides it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise layer_error(DataSourceUnavailable, layer.name, layer.type,
                          f"needs the '{module}' package: pip install 'caffejax[{extra}]'") from None


class _Failure:
    """An exception raised while loading a batch, carried to the consumer's thread."""

    def __init__(self, error: BaseException):
        self.error = error


class Prefetcher:
    """Caffe's BasePrefetchingDataLayer: a thread runs ``load_batch`` ahead of use and keeps up to ``depth``
    ready batches (data_param.prefetch, Caffe's PREFETCH_COUNT) in a queue. ``on_close`` releases what the
    loader holds open (a database) once the thread has stopped.

    Batches come out in the order they were loaded, so the sequence is the same as without prefetching. An
    error in ``load_batch`` is raised from ``next_batch`` (and again on every later call).
    """

    def __init__(self, load_batch: Callable[[], Sequence[np.ndarray]], depth: int, name: str,
                 on_close: Callable[[], None] | None = None):
        self._on_close = on_close
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, int(depth)))
        self._stop = threading.Event()
        self._failure: BaseException | None = None
        # The thread holds the loader and the queue, never this object: when the net drops its source, the
        # finalizer stops the thread.
        self._thread = threading.Thread(target=_fill, args=(load_batch, self._queue, self._stop), daemon=True,
                                        name=f"caffejax-prefetch-{name}")
        self._thread.start()
        weakref.finalize(self, self._stop.set)

    def next_batch(self) -> Batch:
        if self._failure is not None:
            raise self._failure
        while True:
            try:
                item = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self._failure = DataError(f"the prefetch thread of '{self._thread.name}' stopped")
                    raise self._failure from None
        if isinstance(item, _Failure):
            self._failure = item.error
            raise item.error
        return item

    def close(self) -> None:
        self._failure = self._failure or DataError(f"'{self._thread.name}' was closed")
        self._stop.set()
        while True:  # unblock a put() in progress
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=5)
        if self._on_close is not None:
            self._on_close()
            self._on_close = None


def _fill(load_batch, batches: queue.Queue, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            item = list(load_batch())
        except Exception as e:  # noqa: BLE001 -- handed to the consumer, who raises it
            error = e
            if not isinstance(e, CaffejaxError):
                error = DataError(f"loading a batch failed: {type(e).__name__}: {e}")
                error.__cause__ = e
            item = _Failure(error)
        while not stop.is_set():
            try:
                batches.put(item, timeout=0.05)
                break
            except queue.Full:
                continue
        if isinstance(item, _Failure):
            return
