"""XLA:CPU settings caffejax turns on, measured on Caffe's nets.

XLA reads ``XLA_FLAGS`` once, when JAX first creates its CPU backend, so ``import caffejax`` adds these to
the environment before that happens (it changes nothing if the process already ran JAX computations, or if
the user's ``XLA_FLAGS`` already sets the flag). ``CAFFEJAX_XLA_DEFAULTS=0`` in the environment leaves
``XLA_FLAGS`` alone.

- ``--xla_cpu_experimental_ynn_fusion_type=dot``: XLA's YNNPACK path for dot products and convolutions.
  On 2 AVX2 cores (bench/, ``bench/results``) it halves the forward time of 3x3 convolutions and makes
  their filter gradient ~10x faster (XLA's own filter-gradient convolution runs at ~10 GFLOP/s), with the
  same float32 results up to rounding (tests/test_xla_flags.py compares both against float64).
"""

from __future__ import annotations

import os

CPU_DEFAULTS: dict[str, str] = {
    "xla_cpu_experimental_ynn_fusion_type": "dot",
}

OPT_OUT = "CAFFEJAX_XLA_DEFAULTS"


def apply_cpu_defaults(environ=os.environ) -> list[str]:
    """Add :data:`CPU_DEFAULTS` the user has not set to ``XLA_FLAGS``; returns the flags added."""
    if environ.get(OPT_OUT, "1").strip().lower() in ("0", "false", "no", "off"):
        return []
    current = environ.get("XLA_FLAGS", "")
    added = [f"--{name}={value}" for name, value in CPU_DEFAULTS.items() if f"--{name}" not in current]
    if added:
        environ["XLA_FLAGS"] = " ".join([current.strip()] + added).strip()
    return added


def active() -> dict[str, bool]:
    """Which defaults the running process's XLA_FLAGS carries (meaningful once JAX's backend exists)."""
    current = os.environ.get("XLA_FLAGS", "")
    return {name: f"--{name}={value}" in current for name, value in CPU_DEFAULTS.items()}
