"""Reading files with a typed error, and writing them so that a crash never leaves a half-written one in place of a
good one."""

from __future__ import annotations

import glob
import os
import socket
import tempfile
from typing import Iterable

from caffejax.errors import CaffejaxError

# A temporary file is named PATH.caffejax.HOST.PID.RANDOM.tmp: the writer's host and process, so that a later write
# into the same directory can tell the leftovers of a killed process (SIGKILL mid-snapshot) from files still being
# written, and remove only those.
_MARKER = ".caffejax."


def read_bytes(path: str, error: type[CaffejaxError] = CaffejaxError, limit: int = -1) -> bytes:
    """The bytes of the file at ``path`` (its first ``limit``, or all); an ``error`` naming the file where it cannot
    be read (missing, a folder, no permission)."""
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError as e:
        raise error(f"{path}: cannot read: {e.strerror}") from None


def atomic_write(path: str, chunks: Iterable[bytes] | bytes) -> None:
    """Write to a temporary file beside ``path``, fsync it, then rename it over ``path`` (atomic on POSIX).
    Temporary files that processes of this host left in that directory when they were killed are removed."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    host = _host()
    _remove_leftovers(directory, host)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f"{os.path.basename(path)}{_MARKER}{host}.{os.getpid()}.", suffix=".tmp",
                                   dir=directory)
    except OSError as error:  # named as the file asked for, not the temporary one beside it (a missing folder)
        raise type(error)(error.errno, error.strerror, path) from None
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


def _host() -> str:
    """This host's name as it goes into a temporary file's name (no dots, no path separators)."""
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname()) or "host"


def _remove_leftovers(directory: str, host: str) -> None:
    """Remove the temporary files of this host's processes that no longer run (killed while writing). Files of
    running processes, and of other hosts (a shared filesystem), are left alone."""
    for leftover in glob.glob(os.path.join(glob.escape(directory), f"*{_MARKER}{host}.*.tmp")):
        pid = os.path.basename(leftover).rsplit(f"{_MARKER}{host}.", 1)[-1].split(".", 1)[0]
        if pid.isdigit() and not _running(int(pid)):
            try:
                os.unlink(leftover)
            except OSError:
                pass  # another writer removed it first


def _running(pid: int) -> bool:
    """Whether process ``pid`` of this host may still be writing (True where that cannot be told)."""
    if pid == os.getpid() or os.name != "posix":  # on Windows, os.kill(pid, 0) would send CTRL_C_EVENT
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except OSError:
        return True  # cannot tell: keep the file
    return True
