"""Let glibc's malloc keep freed memory for reuse instead of returning it (on by default; opt out below).

glibc serves blocks above its mmap threshold (at most 32 MB) with a fresh ``mmap`` and unmaps them on free.
XLA:CPU allocates every large activation (and a training step's whole scratch space) anew on every call, so
each call page-faults those buffers in again. On the 2-core benchmark VM an element-wise pass over a 34 MB
buffer ran at 4.4 GB/s against 22 GB/s for a 17 MB one. :func:`keep_freed_memory` turns that off for the
whole process: no mmap for large blocks (``M_MMAP_MAX = 0``) and no trimming of the heap's top
(``M_TRIM_THRESHOLD`` at its maximum), so freed buffers are reused, as the caching allocators of other deep
learning frameworks reuse theirs. The price is that the process keeps its peak memory: its peak is the same,
but it does not shrink back after a big call.

Measured on that VM at batch 16, training step (bench.run's, two runs each, ms): MobileNet v2 1678/1958 ->
1112/1076, ResNet-50 3416/3324 -> 2743/2711, GoogLeNet 1694/1533 -> 1252/1310, AlexNet 707/790 -> 577/579,
SqueezeNet 559/596 -> 444/409. Inference (means of 2 runs without and 6 with it): ResNet-50 1145 -> 975,
GoogLeNet 509 -> 481, SqueezeNet 152 -> 136, MobileNet v2 267 -> 255. Over 30 MobileNet training steps the
resident set stayed at the peak (2.3 GB), which is the peak without it too, and did not grow.

Importing caffejax applies it (:func:`apply_environment`); ``CAFFEJAX_KEEP_FREED_MEMORY=0`` in the
environment keeps glibc's own behaviour, for a process that must give memory back (it changes the
allocator of the whole process, caffejax's user's code included). It changes nothing but speed and
resident memory.

:func:`garbage_collection_paused` keeps Python's cyclic garbage collector out of building a program.
:class:`DeviceMemoryErrors` reports a program whose buffers do not fit the device as the net's blobs that do not.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import math
from typing import Iterator

import jax

from caffejax.errors import OutOfMemoryError
from caffejax.frontend.ir import Graph
from caffejax.runtime.mode import environment_switch

ENVIRONMENT = "CAFFEJAX_KEEP_FREED_MEMORY"
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's malloc.h


def keep_freed_memory() -> bool:
    """Make this process's malloc reuse freed large blocks (see the module docstring). True where it took
    effect (glibc), False where the C library has no ``mallopt`` (musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2 ** 31 - 1))


def apply_environment() -> bool:
    """keep_freed_memory() unless ``CAFFEJAX_KEEP_FREED_MEMORY`` says no (0/false/off/no). True where it
    took effect."""
    if environment_switch(ENVIRONMENT) is False:
        return False
    return keep_freed_memory()


# Building a program from the caches (the plan, its weights in their kernels' forms, the executable read back)
# allocates many objects that all live on, and the allocations set off Python's cyclic garbage collector, whose
# full passes walk every object of the process (JAX's own included) and find nothing to free. Warm start of
# ResNet-50 at batch 16 on 2 AVX2 cores (bench.coldstart, fresh processes alternating, 6 and 7 runs): the first
# call minus the second 0.90-1.37 s (median 1.14) -> 0.78-0.95 s (median 0.85); the program's build alone
# 0.79-1.03 -> 0.62-0.80 s. Peak resident memory the same (0.92-1.07 GB). Cold compiles took as long either
# way (3.6-4.5 s, 3 pairs).
@contextlib.contextmanager
def garbage_collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (reference counting still frees what it can) and
    back on after it, unless it was off already. Process-wide while it lasts, as ``gc.disable`` is: for short
    bursts of allocation whose objects outlive them, such as building a program."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class DeviceMemoryErrors:
    """Run a net's compiled programs inside it (``with DeviceMemoryErrors(graph):``): XLA's RESOURCE_EXHAUSTED,
    a program's buffers not fitting the device's memory, comes out as an OutOfMemoryError that names the net's
    biggest blobs (from a mistyped dim in an untrusted prototxt, say, rather than a JaxRuntimeError from inside
    JAX). A class with ``__exit__``, as PythonLayers is: a contextlib generator costs microseconds a call."""

    __slots__ = ("graph",)

    def __init__(self, graph: Graph):
        self.graph = graph

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, traceback) -> bool:
        if kind is None or not issubclass(kind, jax.errors.JaxRuntimeError) or "RESOURCE_EXHAUSTED" not in str(error):
            return False
        sizes = sorted(((math.prod(shape), blob, shape) for blob in self.graph.blobs
                        if (shape := self.graph.blob_shape(blob)) is not None), reverse=True)
        biggest = ", ".join(f"'{blob}' {shape} ({count * 4 / 2 ** 30:.3g} GiB in float32)"
                            for count, blob, shape in sizes[:3] if count * 4 >= 2 ** 20)
        net = f"net '{self.graph.name}'" if self.graph.name else "the net"
        xla = str(error).strip().splitlines()[0]
        raise OutOfMemoryError(f"{net}: a compiled program needs more memory than the device has ({xla}); its "
                               f"biggest blobs: {biggest or 'none over 1 MiB'}. Is a dim mistyped, or the batch "
                               "too big?") from None
