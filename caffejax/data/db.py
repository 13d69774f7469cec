"""Caffe's key-value databases (util/db_lmdb.cpp, util/db_leveldb.cpp), read-only: records in key order, and
a cursor that starts over at the first record when it runs off the end (DataLayer::Next).

LMDB needs the ``lmdb`` package, LevelDB the ``plyvel`` package (pip extras ``data`` and ``leveldb``).
"""

from __future__ import annotations

import os
import threading
from typing import Iterator

from caffejax.data.common import lazy_import
from caffejax.errors import DataError, DataSourceUnavailable, layer_error

LEVELDB, LMDB = 0, 1  # caffe.proto's DataParameter.DB
BACKEND_NAMES = {LEVELDB: "LevelDB", LMDB: "LMDB"}


class Database:
    """One opened database. ``first()`` peeks at the first record; ``records()`` is the endless cursor
    (create and advance it in a single thread: the prefetch thread)."""

    def __init__(self, layer, path: str, backend: int):
        self.path, self.backend = path, backend
        self.name = BACKEND_NAMES.get(backend)
        if self.name is None:
            raise layer_error(DataSourceUnavailable, layer.name, layer.type, f"unknown data_param.backend {backend}")
        self.where = f"layer '{layer.name}' (type {layer.type}): {self.name} '{path}'"
        try:
            if backend == LMDB:
                self._env = _SHARED_LMDB.acquire(lazy_import("lmdb", layer), path)
            else:
                plyvel = lazy_import("plyvel", layer, extra="leveldb")
                self._env = plyvel.DB(path, create_if_missing=False)
        except DataSourceUnavailable:
            raise
        except Exception as e:  # lmdb.Error / plyvel.Error: missing, not a database, locked
            raise DataSourceUnavailable(f"{self.where}: cannot open: {e}") from None

    def _scan(self) -> Iterator[tuple[bytes, bytes]]:
        """One pass over all records in key order."""
        if self.backend == LMDB:
            with self._env.begin(buffers=False) as txn:
                yield from txn.cursor().iternext(keys=True, values=True)
        else:
            yield from self._env.iterator()

    def first(self) -> tuple[bytes, bytes]:
        for record in self._scan():
            return record
        raise DataError(f"{self.where}: the database is empty")

    def records(self) -> Iterator[tuple[bytes, bytes]]:
        """Every record in key order, then again from the first, forever."""
        while True:
            empty = True
            for record in self._scan():
                empty = False
                yield record
            if empty:
                raise DataError(f"{self.where}: the database is empty")

    def close(self) -> None:
        if self.backend == LMDB:
            _SHARED_LMDB.release(self._env)
        else:
            self._env.close()


class _SharedEnvironments:
    """LMDB allows one open environment per database per process (a TRAIN and a TEST net often read the same
    one), so opened environments are shared, counted, and closed with their last user."""

    def __init__(self):
        self._lock = threading.Lock()
        self._open: dict[str, list] = {}  # real path -> [environment, users]

    def acquire(self, lmdb, path: str):
        key = os.path.realpath(path)
        with self._lock:
            entry = self._open.get(key)
            if entry is None:
                # Caffe opens read-only; lock=False also lets a read-only directory be read.
                env = lmdb.open(path, readonly=True, lock=False, readahead=False, max_readers=126)
                entry = self._open[key] = [env, 0]
            entry[1] += 1
            return entry[0]

    def release(self, env) -> None:
        with self._lock:
            for key, entry in self._open.items():
                if entry[0] is env:
                    entry[1] -= 1
                    if entry[1] == 0:
                        del self._open[key]
                        env.close()
                    return


_SHARED_LMDB = _SharedEnvironments()


def describe_key(key: bytes) -> str:
    """A record key as it can be printed in an error message."""
    try:
        return repr(key.decode("utf-8"))
    except UnicodeDecodeError:
        return repr(key)
