"""Caffe's process-wide settings as pycaffe exposes them (``caffe.set_mode_cpu()``, ``set_random_seed``...).

pycaffe's API is global, so these are too; they only choose defaults (the JAX device, the seed of new
nets' fillers and random layers). Nothing else in caffejax keeps global state besides the layer registry.

Importing caffejax also asks JAX to run CPU programs inline, as Caffe does (see :func:`run_cpu_programs_inline`).
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax

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
