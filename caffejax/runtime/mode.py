"""Caffe's process-wide settings as pycaffe exposes them (``caffe.set_mode_cpu()``, ``set_random_seed``...).

pycaffe's API is global, so these are too; they only choose defaults (the JAX device, the seed of new
nets' fillers and random layers). Nothing else in caffejax keeps global state besides the layer registry.

Importing caffejax also asks JAX to run CPU programs inline, as Caffe does (see :func:`run_cpu_programs_inline`),
and takes glog's ``GLOG_minloglevel`` for Caffe's log (:func:`apply_glog_level`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time

import jax

from caffejax.errors import UnsupportedError

log = logging.getLogger("caffejax")

# Set to 1 (true/on/yes), caffejax leaves JAX's CPU dispatch as JAX has it (see run_cpu_programs_inline).
ASYNC_DISPATCH_ENVIRONMENT = "CAFFEJAX_CPU_ASYNC_DISPATCH"


@dataclasses.dataclass
class _Mode:
    device_kind: str = "cpu"
    device_id: int = 0
    seed: int = 1701


_MODE = _Mode()


def environment_switch(name: str) -> bool | None:
    """An on/off switch from the environment: True for 1/true/on/yes, False for 0/false/off/no (any case,
    surrounding spaces ignored), None when unset or anything else."""
    value = os.environ.get(name, "").strip().lower()
    return True if value in ("1", "true", "on", "yes") else False if value in ("0", "false", "off", "no") else None


def set_mode_cpu() -> None:
    _MODE.device_kind = "cpu"


def set_mode_gpu() -> None:
    _MODE.device_kind = "gpu"


def set_device(device_id: int) -> None:
    _MODE.device_id = int(device_id)


def set_random_seed(seed: int) -> None:
    _MODE.seed = int(seed)


def random_seed() -> int:
    return _MODE.seed


# -- pycaffe's multi-GPU calls. Caffe trains over several GPUs with one process (and one solver) per GPU, joined
# by NCCL; caffejax trains over several devices in one program of one process (Solver(..., devices=N),
# ``caffejax train --devices N``). The one-solver settings are accepted, the others refused by name.
_ONE_PROGRAM = ("caffejax trains over several devices in one process and one program: SGDSolver(path, devices=N) "
                "or `caffejax train --devices N` (README, 'Several devices')")


def solver_count() -> int:
    """pycaffe's ``caffe.solver_count()``: 1, the one solver of this process."""
    return 1


def set_solver_count(count: int) -> None:
    """pycaffe's ``caffe.set_solver_count``: 1 is accepted; more solvers, one per process, are refused."""
    if int(count) != 1:
        raise UnsupportedError(f"caffe.set_solver_count({count}): {_ONE_PROGRAM}")


def solver_rank() -> int:
    """pycaffe's ``caffe.solver_rank()``: 0, the one solver of this process."""
    return 0


def set_solver_rank(rank: int) -> None:
    if int(rank) != 0:
        raise UnsupportedError(f"caffe.set_solver_rank({rank}): {_ONE_PROGRAM}")


def set_multiprocess(multiprocess: bool) -> None:
    if multiprocess:
        raise UnsupportedError(f"caffe.set_multiprocess(True): {_ONE_PROGRAM}")


def has_nccl() -> bool:
    """pycaffe's ``caffe.has_nccl()``: False; caffejax joins devices through XLA's collectives, not NCCL calls."""
    return False


class NCCL:
    """pycaffe's ``caffe.NCCL(solver, uid)``: refused (see :data:`_ONE_PROGRAM`), as in a Caffe built without
    NCCL."""

    def __init__(self, *args, **kwargs):
        raise UnsupportedError(f"caffe.NCCL: {_ONE_PROGRAM}")

    @staticmethod
    def new_uid():
        raise UnsupportedError(f"caffe.NCCL.new_uid: {_ONE_PROGRAM}")


# -- pycaffe's glog calls and timer -------------------------------------------------------------------------
_GLOG_LEVELS = (logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL)


class GlogFormatter(logging.Formatter):
    """Log lines in glog's form, as Caffe's tools print them, so that scripts reading Caffe's logs read these
    (tools/extra/parse_log.py takes its times from the first two fields, to the microsecond):
    ``I1204 10:43:44.399123 18910 solver.py:611] message``: the severity letter (I, W, E, F), month and day,
    local time to the microsecond, the thread's id (where the record is formatted, which is the logging thread
    for a plain handler), and the caffejax source file and line that logged it."""

    def __init__(self):
        super().__init__("%(glog_prefix)s%(message)s")

    def format(self, record: logging.LogRecord) -> str:
        letter = "F" if record.levelno >= logging.CRITICAL else "E" if record.levelno >= logging.ERROR else \
            "W" if record.levelno >= logging.WARNING else "I"
        record.glog_prefix = (f"{letter}{time.strftime('%m%d %H:%M:%S', time.localtime(record.created))}."
                              f"{int(record.created % 1 * 1e6):06d} {threading.get_native_id():5d} "
                              f"{record.filename}:{record.lineno}] ")
        return super().format(record)


def init_log(level: int = 0, stderr: bool | None = None) -> None:
    """pycaffe's ``caffe.init_log([level[, stderr]])``: Caffe's log (the ``caffejax`` logger) shown from glog's
    ``level`` up (0 INFO, 1 WARNING, 2 ERROR, 3 FATAL), on stderr. glog never writes its log to stdout: with
    ``stderr`` (FLAGS_logtostderr) it writes to stderr, without it to log files under /tmp, which caffejax does
    not write, so ``stderr`` changes nothing here. An application that configured logging itself keeps its
    handlers."""
    if not 0 <= int(level) < len(_GLOG_LEVELS):
        raise ValueError(f"init_log: level {level} is not one of glog's 0 (INFO) .. 3 (FATAL)")
    log.setLevel(_GLOG_LEVELS[int(level)])
    log_to_stderr_unless_configured()


def log_to_stderr_unless_configured() -> bool:
    """Caffe's log on stderr in glog's form, where glog writes it, unless the application configured logging
    itself (a handler on the ``caffejax`` logger or the root one): whether the handler was added."""
    if log.handlers or logging.getLogger().handlers:
        return False
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(GlogFormatter())
    log.addHandler(handler)
    return True


# glog reads its minimum level from the environment as the library loads; pycaffe scripts set it before
# ``import caffe`` to keep Caffe's INFO (and WARNING) lines out of their output.
GLOG_LEVEL_ENVIRONMENT = "GLOG_minloglevel"


def glog_level() -> int:
    """The least level Caffe's log shows: glog's ``GLOG_minloglevel`` (0 INFO, 1 WARNING, 2 ERROR, 3 FATAL;
    above 3 as 3, below 0 as 0), INFO when it is unset or not a whole number."""
    try:
        level = int(os.environ.get(GLOG_LEVEL_ENVIRONMENT, "").strip())
    except ValueError:
        return logging.INFO
    return _GLOG_LEVELS[min(max(level, 0), len(_GLOG_LEVELS) - 1)]


def apply_glog_level() -> None:
    """At import: a ``GLOG_minloglevel`` above INFO becomes the ``caffejax`` logger's level, so that nothing
    below it shows wherever the log goes. INFO leaves the logger unset: a Net then makes no log lines that
    nothing shows (net_init_log), and the solvers and the tool turn INFO on themselves (at glog_level())."""
    level = glog_level()
    if level > logging.INFO:
        log.setLevel(level)


def log_float(value) -> str:
    """A number as Caffe's log prints a float: C++'s ostream default, 6 significant digits."""
    return f"{float(value):g}"


def log_info(message: str) -> None:
    """pycaffe's ``caffe.log(s)``: ``LOG(INFO) << s``, into Caffe's log (the ``caffejax`` logger)."""
    log.info("%s", message)


class Timer:
    """pycaffe's ``caffe.Timer``: ``start()``, ``stop()``, and ``ms``, the milliseconds from the last start to
    the stop after it. As in Caffe, starting a running timer or stopping a stopped one does nothing, and reading
    ``ms`` stops a running timer. Host wall-clock time: a program still running on an accelerator is not waited
    for (pycaffe's own readings of a net's forward, which hands back host arrays, include it)."""

    def __init__(self):
        self._start = self._stop = None
        self._running = False

    def start(self) -> None:
        if not self._running:
            self._start, self._running = time.perf_counter(), True

    def stop(self) -> None:
        if self._running:
            self._stop, self._running = time.perf_counter(), False

    @property
    def ms(self) -> float:
        if self._start is None:
            log.warning("Timer has never been run before reading time.")
            return 0.0
        self.stop()
        return (self._stop - self._start) * 1e3


def device() -> jax.Device:
    """The JAX device the current mode selects (falls back to the CPU when no GPU is present)."""
    try:
        devices = jax.devices(_MODE.device_kind)
    except RuntimeError:
        devices = jax.devices("cpu")
    return devices[min(_MODE.device_id, len(devices) - 1)]


def run_cpu_programs_inline() -> bool:
    """Have JAX run CPU programs on the calling thread (``jax_cpu_enable_async_dispatch=False``), unless
    ``CAFFEJAX_CPU_ASYNC_DISPATCH=1`` is in the environment or JAX's backends have already started (JAX reads
    the flag when it makes the CPU client). True where it took effect.

    JAX's default hands every CPU program to a worker thread and wakes the caller when it is done. Caffe and
    pycaffe run synchronously, and so does caffejax's facade: ``Net.forward`` fills the blobs, and a served
    forward is read as soon as it returns. There the hand-off only adds two thread wake-ups, which cost more
    than a small net's whole forward on a 2-core VM: LeNet at batch 1 took 0.33-0.35 ms with the hand-off and
    0.16-0.27 ms inline; the ImageNet nets measured the same either way. What inline execution gives up is
    overlapping the caller's Python with a program still running; ``CAFFEJAX_CPU_ASYNC_DISPATCH=1`` keeps it
    (so does ``jax.config.update("jax_cpu_enable_async_dispatch", True)`` after importing caffejax, before
    the first JAX computation).
    """
    if environment_switch(ASYNC_DISPATCH_ENVIRONMENT):
        return False
    try:
        from jax._src import xla_bridge

        started = xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):  # another JAX: without knowing, leave the client as the user made it
        return False
    if started:
        log.debug("caffejax: JAX's backends already started; CPU programs keep JAX's dispatch setting")
        return False
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    return True
