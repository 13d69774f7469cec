"""Caffe's process-wide settings as pycaffe exposes them (``caffe.set_mode_cpu()``, ``set_random_seed``...).

pycaffe's API is global, so these are too; they only choose defaults (the JAX device, the seed of new
nets' fillers and random layers). Nothing else in caffejax keeps global state besides the layer registry.
"""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass
class _Mode:
    device_kind: str = "cpu"
    device_id: int = 0
    seed: int = 1701


_MODE = _Mode()


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
