"""caffejax's XLA:CPU defaults: added to XLA_FLAGS at import unless the user set them or opted out, and the
YNNPACK convolutions they switch on compute what XLA's own do (both checked against float64)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from caffejax import xla_flags


def test_defaults_are_added_once_and_respect_the_user():
    env = {}
    added = xla_flags.apply_cpu_defaults(env)
    assert added == ["--xla_cpu_experimental_ynn_fusion_type=dot"]
    assert env["XLA_FLAGS"] == "--xla_cpu_experimental_ynn_fusion_type=dot"
    assert xla_flags.apply_cpu_defaults(env) == []  # idempotent

    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2 --xla_cpu_experimental_ynn_fusion_type=eltwise"}
    assert xla_flags.apply_cpu_defaults(env) == []
    assert env["XLA_FLAGS"].endswith("=eltwise")  # the user's choice stays

    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", xla_flags.OPT_OUT: "0"}
    assert xla_flags.apply_cpu_defaults(env) == []
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"


def test_this_process_runs_with_the_defaults():
    assert all(xla_flags.active().values()) or os.environ.get(xla_flags.OPT_OUT) == "0"


CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    import caffejax  # applies (or, with CAFFEJAX_XLA_DEFAULTS=0, skips) the defaults before JAX starts
    import jax
    from jax import lax

    rng = np.random.default_rng(0)
    worst = 0.0
    for n, c, h, o, k, s in [(4, 16, 14, 24, 3, 1), (2, 3, 32, 8, 7, 2), (2, 32, 9, 16, 1, 2)]:
        x = rng.standard_normal((n, h, h, c)); w = rng.standard_normal((k, k, c, o))
        dy = rng.standard_normal((n, (h + 2 * (k // 2) - k) // s + 1, (h + 2 * (k // 2) - k) // s + 1, o))

        def conv(x, w):
            return lax.conv_general_dilated(x, w, (s, s), [(k // 2, k // 2)] * 2, dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                            precision=lax.Precision.HIGHEST)

        def run(dtype):
            y, vjp = jax.vjp(conv, x.astype(dtype), w.astype(dtype))
            return [np.asarray(a, np.float64) for a in (y, *jax.jit(vjp)(dy.astype(dtype)))]

        got = run(np.float32)
        with jax.enable_x64(True):
            want = run(np.float64)
        worst = max(worst, *(np.abs(a - b).max() / np.abs(b).max() for a, b in zip(got, want)))
    print(worst)
""")


def _child_error(opt_out: str) -> float:
    env = {**os.environ, xla_flags.OPT_OUT: opt_out}
    env.pop("XLA_FLAGS", None)
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return float(done.stdout.strip().splitlines()[-1])


def test_ynnpack_convolutions_and_gradients_match_float64_as_xlas_own_do():
    with_defaults, without = _child_error("1"), _child_error("0")
    assert with_defaults < 1e-5 and without < 1e-5, (with_defaults, without)
