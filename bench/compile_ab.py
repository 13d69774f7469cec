"""Compile time of the bench's training step under different XLA flags, each in a fresh process.

    python -m bench.compile_ab resnet50 --batch 16 --flags=--xla_gpu_autotune_level=0
    python -m bench.compile_ab lenet --flags=--xla_gpu_autotune_level=0 --flags="--xla_gpu_autotune_level=1" --steps 20

The first training program of a net took 68-103 s to compile on an H200 (README, "Measured once on an NVIDIA
H200"), and a second one of the same net in the same process 12-16 s: XLA's per-process autotuning of its GPU
kernels is the suspect. This runs the program ``bench.run`` times (``training_step_program``: forward, backward
and SGD update in one jit, random weights) once with XLA's flags as the environment has them and once per
``--flags`` setting added to them, each in a new process (no compile cache shared), and prints each setting's
trace-and-lower seconds, compile seconds and median step ms, so that what a flag saves at compile time is seen
beside what it costs at run time. Prints a table and one JSON line per setting.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def child(net_name: str, batch: int, steps: int) -> dict:
    """In this process: compile the training step once and time ``steps`` steps."""
    import pathlib
    import tempfile

    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench.measure import timed
    from bench.nets import NETS, deploy_net
    from bench.run import training_step_program
    from caffejax.runtime.solver import _into_spare

    spec = NETS[net_name]
    # Random weights for a net without bundled ones go to a folder removed once they are read (AlexNet's are
    # 244 MB, and each run is a new process).
    with tempfile.TemporaryDirectory(prefix="compile_ab-") as folder:
        weights = spec.weights
        if weights is None:
            weights = pathlib.Path(folder) / f"{net_name}.caffemodel"
            deploy_net(spec).save(str(weights))
        step, options, (params, inputs, key), _ = training_step_program(spec, weights, batch)
    params = jax.tree.map(jnp.asarray, params)
    spare = jax.tree.map(jnp.zeros_like, params)
    start = time.perf_counter()
    lowered = jax.jit(_into_spare(step), donate_argnums=4, keep_unused=True,
                      compiler_options=options).lower(params, inputs, key, np.uint32(1), spare)
    traced = time.perf_counter()
    compiled = lowered.compile()
    done = time.perf_counter()
    state = {"params": params, "spare": spare, "count": 1}

    def one():
        state["count"] += 1
        new, loss = compiled(state["params"], inputs, key, np.uint32(state["count"]), state.pop("spare"))
        state["spare"], state["params"] = state["params"], new
        return loss

    result = timed(one, steps)
    return {"backend": jax.default_backend(), "trace_lower_s": traced - start, "compile_s": done - traced,
            "step_ms": result["median_ms"], "step_min_ms": result["min_ms"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("net", help="a bench net: lenet, alexnet, googlenet, resnet50, mobilenet_v2, squeezenet_v1.1")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--flags", action="append", default=[],
                        help="XLA_FLAGS to add for one more run, written --flags=--xla_...; repeat for more settings")
    parser.add_argument("--steps", type=int, default=5, help="timed steps after the compile (default 5)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds allowed to each process")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.net, args.batch, args.steps)))
        return 0
    base = os.environ.get("XLA_FLAGS", "")
    rows = []
    for flags in ["", *args.flags]:
        env = {**os.environ, "XLA_FLAGS": f"{base} {flags}".strip()}
        command = [sys.executable, "-m", "bench.compile_ab", args.net, "--batch", str(args.batch),
                   "--steps", str(args.steps), "--child"]
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            rows.append({"flags": flags, "error": f"no result in {args.timeout:.0f} s"})
        else:
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            rows.append({"flags": flags, **json.loads(lines[-1])} if done.returncode == 0 and lines else
                        {"flags": flags, "error": (done.stderr.strip().splitlines() or ["no output"])[-1]})
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{args.net} batch {args.batch}, training step; XLA_FLAGS from the environment: {base or '(none)'}")
    for row in rows:
        label = row["flags"] or "(as the environment has them)"
        if "error" in row:
            print(f"  {label}: {row['error']}")
        else:
            print(f"  {label}: trace+lower {row['trace_lower_s']:.1f} s, compile {row['compile_s']:.1f} s, "
                  f"step {row['step_ms']:.1f} ms ({row['backend']})")
    return 0 if all("error" not in row for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
