"""How fast an exported StableHLO file runs, against compile_inference (README "The caffejax tool ... export").

    python -m bench.export                                        # SqueezeNet v1.1 and ResNet-50 at batch 16
    python -m bench.export --nets lenet,alexnet --batch 1 --repeats 50
    python -m bench.export --dtype bfloat16                       # the bf16 mode, exported

Per net, one file is exported with a symbolic batch (``export_stablehlo(net, path, batch="batch")``) and one as
exports were built before passes and the loader's options (``passes=()``), and these run in one process, timed in
alternating blocks (bench.measure.timed_alternating), at --batch:

- ``loaded``: the file through ``caffejax.export.load_stablehlo`` (compiled with caffejax's XLA options);
- ``jax_only``: the same file through ``jax.jit(exported.call)`` under XLA's defaults, as a program with
  JAX alone runs it (XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=dot gives such a process the options);
- ``unoptimised``: the ``passes=()`` file through ``jax.jit(exported.call)`` (Caffe's rules, XLA's defaults);
- ``compile_inference``: the net's own inference function.

Prints median ms per forward and each one's ratio to compile_inference, and writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
import tempfile


def _measure(name: str, batch: int, repeats: int, dtype: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import caffejax
    from bench.measure import timed_alternating
    from bench.nets import NETS, deploy_net
    from caffejax.export import export_stablehlo, load_stablehlo

    net = deploy_net(NETS[name])
    blob = net.inputs[0]
    x = np.random.default_rng(0).random((batch,) + tuple(net.blobs[blob].shape[1:]), dtype=np.float32)
    with tempfile.TemporaryDirectory() as directory:
        any_batch, unoptimised = pathlib.Path(directory, "any.stablehlo"), pathlib.Path(directory, "raw.stablehlo")
        export_stablehlo(net, str(any_batch), batch="batch", dtype=jnp.dtype(dtype))
        export_stablehlo(net, str(unoptimised), batch=batch, passes=(), dtype=jnp.dtype(dtype))
        loaded = load_stablehlo(str(any_batch))
        jax_only = jax.jit(jax.export.deserialize(bytearray(any_batch.read_bytes())).call)
        raw = jax.jit(jax.export.deserialize(bytearray(unoptimised.read_bytes())).call)
        infer = caffejax.compile_inference(net, dtype=jnp.dtype(dtype))
        fns = {"loaded": lambda: loaded(**{blob: x}), "jax_only": lambda: jax_only({blob: x}),
               "unoptimised": lambda: raw({blob: x}), "compile_inference": lambda: infer({blob: x})}
        expected = np.asarray(infer({blob: x})[net.outputs[0]])
        tolerance = 1e-4 if dtype == "float32" else 5e-2
        for label in ("loaded", "jax_only", "unoptimised"):
            got = np.asarray(fns[label]()[net.outputs[0]])
            np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance * float(np.abs(expected).max()),
                                       err_msg=label)
        times = timed_alternating(fns, repeats)
    return {"net": name, "batch": batch, "dtype": dtype, **{label: t["median_ms"] for label, t in times.items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nets", default="squeezenet_v1.1,resnet50", help="nets of bench.nets, separated by ','")
    parser.add_argument("--batch", type=int, default=16, help="the batch the files are run at (default 16)")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs of each (default 10)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the programs' dtype, compile_inference's and the exports' (default float32)")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="JSON path (default bench/results/)")
    args = parser.parse_args(argv)

    from bench.nets import ROOT

    names = [name.strip() for name in args.nets.split(",") if name.strip()]
    rows = [_measure(name, args.batch, args.repeats, args.dtype) for name in names]
    labels = ("loaded", "jax_only", "unoptimised", "compile_inference")
    print(f"median ms per forward at batch {args.batch}, {args.dtype} (ratio to compile_inference)")
    print(f"{'net':>16} " + " ".join(f"{label:>20}" for label in labels))
    for r in rows:
        print(f"{r['net']:>16} " + " ".join(f"{r[label]:>12.2f} ({r[label] / r['compile_inference']:.2f})"
                                            for label in labels))
    out = args.out or ROOT / "bench" / "results" / f"export-{datetime.datetime.now():%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"batch": args.batch, "dtype": args.dtype, "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
