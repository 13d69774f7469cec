"""Writing files so that a crash never leaves a half-written one in place of a good one."""

from __future__ import annotations

import os
import tempfile
from typing import Iterable


def atomic_write(path: str, chunks: Iterable[bytes] | bytes) -> None:
    """Write to a temporary file beside ``path``, fsync it, then rename it over ``path`` (atomic on POSIX)."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in ([chunks] if isinstance(chunks, (bytes, bytearray, memoryview)) else chunks):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass
