"""Timing, FLOP counting and the machine's GEMM rate, as the benchmark uses them."""

from __future__ import annotations

import resource
import statistics
import time
from typing import Any, Callable, Mapping

import jax
import numpy as np


def timed(fn: Callable[[], Any], repeats: int, warmup: int = 2, min_seconds: float = 0.0,
          max_runs: int = 2000) -> dict[str, float]:
    """Median and min wall ms of ``fn()`` (results blocked on) over ``repeats`` runs after ``warmup``, and
    more runs until ``min_seconds`` have passed (at most ``max_runs``): five samples of a 0.2 ms forward
    measure the machine's hiccups, not the forward. (:func:`timed_alternating` with one function, one block.)"""
    return timed_alternating({"fn": fn}, repeats, rounds=1, warmup=warmup, min_seconds=min_seconds,
                             max_runs=max_runs)["fn"]


def timed_alternating(fns: Mapping[str, Callable[[], Any]], repeats: int, rounds: int = 5, warmup: int = 2,
                      min_seconds: float = 0.0, max_runs: int = 2000) -> dict[str, dict[str, float]]:
    """:func:`timed` for several functions, measured in alternating blocks (the order reversed every other
    round), so that each sees the same machine: on a shared VM two times taken a minute apart move with the
    neighbours, and so does their ratio. Each function gets at least ``repeats`` runs and, over all its
    blocks, at least ``min_seconds`` (at most ``max_runs`` runs)."""
    for fn in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(fn())
    times: dict[str, list[float]] = {name: [] for name in fns}
    spent = dict.fromkeys(fns, 0.0)
    runs_per_block = -(-repeats // rounds)
    order, done = list(fns), 0
    while done < rounds or any(spent[n] < min_seconds and len(times[n]) < max_runs for n in fns):
        for name in order if done % 2 == 0 else order[::-1]:
            began = time.perf_counter()
            block = 0
            while block < runs_per_block or (time.perf_counter() - began < min_seconds / rounds
                                             and len(times[name]) < max_runs):
                start = time.perf_counter()
                jax.block_until_ready(fns[name]())
                times[name].append((time.perf_counter() - start) * 1e3)
                block += 1
            spent[name] += time.perf_counter() - began
        done += 1
    return {name: {"median_ms": statistics.median(t), "min_ms": min(t), "runs": len(t)} for name, t in times.items()}


def once(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    result = jax.block_until_ready(fn())
    return result, time.perf_counter() - start


# The GEMM a run's GFLOP/s are set against, by JAX's backend: on the CPU the host's BLAS (OpenBLAS through
# NumPy: what Caffe itself multiplies with), elsewhere XLA's own fp32 dot on the accelerator, at full fp32
# precision as caffejax multiplies (no TF32 passes), on a size that fills it (2048^2 takes 0.3 ms on an H200).
GEMM_SIZE = {"cpu": 2048}
GEMM_SIZE_ACCELERATOR = 8192


def gemm_gflops(n: int | None = None, repeats: int = 5) -> dict[str, float | str]:
    """Dense fp32 n x n matmul, GFLOP/s of the median run: OpenBLAS through NumPy (on the host) and XLA's dot
    at full fp32 precision on JAX's default device; ``reference`` names the one to compare against
    (:func:`reference_gemm`)."""
    import jax.numpy as jnp

    backend = jax.default_backend()
    n = n or GEMM_SIZE.get(backend, GEMM_SIZE_ACCELERATOR)
    a = np.random.default_rng(0).random((n, n), dtype=np.float32)
    flops = 2.0 * n ** 3
    blas = timed(lambda: a @ a, repeats)
    ja = jnp.asarray(a)
    xla_dot = jax.jit(lambda x: jnp.matmul(x, x, precision=jax.lax.Precision.HIGHEST))
    xla = timed(lambda: xla_dot(ja), repeats)
    return {"numpy_openblas": flops / blas["median_ms"] / 1e6, "xla": flops / xla["median_ms"] / 1e6,
            "numpy_openblas_best": flops / blas["min_ms"] / 1e6, "xla_best": flops / xla["min_ms"] / 1e6,
            "n": n, "backend": backend, "reference": "numpy_openblas" if backend == "cpu" else "xla"}


def reference_gemm(gemm: dict, gemm_end: dict | None = None) -> tuple[float, str]:
    """(GFLOP/s, label) of the GEMM a run compares against; runs saved before ``reference`` was recorded were
    CPU runs against OpenBLAS at 2048^2. With ``gemm_end`` (the same GEMM measured as the run ends), the
    faster of the two: a neighbour on a shared VM slows one reading, never speeds it up. One run's opening
    OpenBLAS reading was 106 GFLOP/s, its closing one 200 (2 AMD EPYC cores; 186-203 in fresh processes
    there), and every %GEMM of that run read nearly twice what it was."""
    key = gemm.get("reference", "numpy_openblas")
    label = "OpenBLAS" if key == "numpy_openblas" else f"XLA fp32 on {gemm.get('backend', '?')}"
    label = f"{label} {gemm.get('n', 2048)}^2"
    if gemm_end is not None and gemm_end.get(key) is not None:
        return max(gemm[key], gemm_end[key]), f"{label}, the faster of the run's first and last reading"
    return gemm[key], label


def model_flops(graph) -> int:
    """Multiply-adds x 2 of the net's direct convolutions and inner products, from the IR's shapes."""
    from caffejax.runtime.xla_options import matmul_flops

    return matmul_flops(graph)


def training_flops(graph) -> int:
    """Multiply-adds x 2 of one training step's products: each convolution and inner product once forward,
    once more for its weight gradient where a weight needs one, and once more for its input gradient where
    its bottom needs one (a net's first layer has none: the data is not differentiated)."""
    from caffejax.runtime.xla_options import layer_matmul_flops

    total = 0
    for layer in graph.layers:
        flops = layer_matmul_flops(graph, layer)
        if flops:
            passes = 1 + any(layer.param_need_backward[:1]) + any(layer.bottom_need_backward)
            total += passes * flops
    return total


def peak_rss_mb(status: str = "/proc/self/status") -> float:
    """This process's peak resident set size in MB: Linux's VmHWM, the high-water mark of the memory the
    process has had since it was started (KiB), else ``getrusage``'s ``ru_maxrss``.

    Not ``ru_maxrss`` on Linux: a process started from another one keeps its parent's peak there (the kernel
    carries the old memory's high-water mark over ``exec``), so the bench's cold- and warm-start processes
    reported the bench's own peak, 5 GB for SqueezeNet after GoogLeNet had run in the parent."""
    try:
        with open(status) as lines:
            for line in lines:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
