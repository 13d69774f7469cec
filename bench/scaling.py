"""Throughput of data-parallel training and sharded inference on 1, 2 and 4 devices (README "Several devices").

    python -m bench.scaling                               # LeNet, batch 64 per device, 1 2 4 devices
    python -m bench.scaling --net resnet50 --batch 16 --devices 1 2

Weak scaling, as Caffe trains on several GPUs: every device runs ``--batch`` images, so N devices process N
times that per iteration (``get_solver(..., devices=N)``: one SGD iteration over the global batch, diffs
averaged over the devices); inference splits a batch of N x ``--batch`` over N devices
(``data_parallel_forward``). The first row is one device without a mesh (the plain solver and
``Net.forward``), the baseline of the efficiency column (images/s over N x the baseline's).

JAX's GPUs are used where it sees them. Otherwise the devices are virtual CPU devices
(``--xla_force_host_platform_device_count``, set here before JAX starts) that share the machine's cores:
those numbers show what splitting costs, not a speed-up. Times are medians of ``--repeats`` runs after two
warm-up runs (the warm-up compiles). Prints a table and writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import pathlib
import sys


def _virtual_cpu_devices(count: int) -> None:
    """Let the CPU platform show ``count`` devices (only read when JAX starts; GPUs are unaffected)."""
    if "jax" in sys.modules:
        return
    flag = f"--xla_force_host_platform_device_count={count}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--net", default="lenet", help="a net of bench.nets (default lenet)")
    parser.add_argument("--batch", type=int, default=64, help="images per device (default 64)")
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4], help="device counts (default 1 2 4)")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per measurement (default 10)")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="JSON path (default bench/results/)")
    args = parser.parse_args(argv)
    _virtual_cpu_devices(max(args.devices))

    import jax
    import numpy as np

    import caffejax
    from bench.measure import timed
    from bench.nets import NETS, ROOT, randomize_weights, training_net_param
    from caffejax.proto import caffe_pb2
    from caffejax.runtime.distributed import data_parallel_forward

    logging.getLogger("caffejax").setLevel(logging.WARNING)
    bench_net = NETS[args.net]
    platform = jax.devices()[0].platform
    counts = [n for n in args.devices if n <= jax.device_count()]
    skipped = sorted(set(args.devices) - set(counts))
    if skipped:
        print(f"skipping {skipped}: JAX sees {jax.device_count()} {platform} device(s)", file=sys.stderr)

    net = caffejax.Net(str(bench_net.prototxt), caffejax.TEST,
                       weights=str(bench_net.weights) if bench_net.weights else None)
    if bench_net.weights is None:
        randomize_weights(net)
    image_shape = tuple(net.blobs[net.inputs[0]].shape[1:])
    rng = np.random.default_rng(0)

    def solver_for(devices):
        param = caffe_pb2.SolverParameter(type="SGD", base_lr=0.01, momentum=0.9, weight_decay=5e-4,
                                          lr_policy="fixed", max_iter=10 ** 9, display=0, random_seed=1)
        param.net_param.CopyFrom(training_net_param(bench_net.prototxt, args.batch))
        solver = caffejax.get_solver(param, devices=devices)
        rows = solver.net.blobs["data"].shape[0]
        solver.net.blobs["data"].data[...] = rng.random((rows,) + image_shape, dtype=np.float32)
        solver.net.blobs["label"].data[...] = rng.integers(0, 10, rows)
        return solver

    def train_step(solver):
        solver.step(1)
        return solver.net.param_arrays()  # the new weights: waiting on them waits for the iteration

    def inference(devices, rows):
        x = rng.random((rows,) + image_shape, dtype=np.float32)
        if devices is None:
            net.blobs[net.inputs[0]].reshape(*x.shape)
            return lambda: net.forward(**{net.inputs[0]: x})
        forward = data_parallel_forward(net, devices)
        return lambda: forward(**{net.inputs[0]: x})

    rows = []
    for devices in [None] + counts:
        n = devices or 1
        train = timed(lambda solver=solver_for(devices): train_step(solver), args.repeats)
        infer = timed(inference(devices, n * args.batch), args.repeats)
        rows.append({"devices": n, "mesh": devices is not None, "global_batch": n * args.batch,
                     "train_ms": train["median_ms"], "train_images_s": n * args.batch / train["median_ms"] * 1e3,
                     "infer_ms": infer["median_ms"], "infer_images_s": n * args.batch / infer["median_ms"] * 1e3})
    base = rows[0]
    for row in rows:
        row["train_efficiency"] = row["train_images_s"] / (row["devices"] * base["train_images_s"])
        row["infer_efficiency"] = row["infer_images_s"] / (row["devices"] * base["infer_images_s"])

    print(f"{args.net}, {args.batch} images per device, {platform} ({jax.device_count()} devices visible)")
    print(f"{'devices':>8} {'mesh':>5} {'batch':>6} {'train ms':>9} {'train img/s':>12} {'eff':>5} "
          f"{'infer ms':>9} {'infer img/s':>12} {'eff':>5}")
    for r in rows:
        print(f"{r['devices']:>8} {'yes' if r['mesh'] else 'no':>5} {r['global_batch']:>6} {r['train_ms']:>9.2f} "
              f"{r['train_images_s']:>12.0f} {r['train_efficiency']:>5.2f} {r['infer_ms']:>9.2f} "
              f"{r['infer_images_s']:>12.0f} {r['infer_efficiency']:>5.2f}")
    out = args.out or ROOT / "bench" / "results" / f"scaling-{datetime.datetime.now():%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"net": args.net, "batch_per_device": args.batch, "platform": platform,
                               "device_kind": jax.devices()[0].device_kind, "repeats": args.repeats,
                               "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
