"""Serving requests of many batch sizes: compile_inference with and without ``batch_sizes`` (README "Serving").

    python -m bench.batch_sizes                                   # SqueezeNet v1.1, 40 requests of 1-16 images
    python -m bench.batch_sizes --net resnet50 --max 32 --requests 60
    python -m bench.batch_sizes --threads 4                       # the stream sent from 4 threads at once

A stream of requests, their batch sizes drawn uniformly from 1..--max (seed 0), goes through compile_inference
in two modes, each in a fresh process (so that no compiled program is shared): "exact" compiles a program for
each batch size it meets; "padded" is given --sizes (default: the powers of two up to --max, and --max) and pads
each request to the next of them. Per mode: the programs compiled, the first pass over the stream (its compiles
included), the median of --passes more passes, and the images per second of those. With --threads N the stream
is dealt out to N threads that send their requests at once, as a threaded server's handlers do (the first pass's
first requests then wait for one compile of each program). Prints a table and writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import subprocess
import sys
import threading
import time

MODES = ("exact", "padded")


def _powers_of_two_to(largest: int) -> list[int]:
    sizes = [1 << k for k in range(largest.bit_length()) if 1 << k < largest]
    return sizes + [largest]


def _serve(args) -> dict:
    """One mode in this process: the stream's first pass and then ``args.passes`` more."""
    import jax
    import numpy as np

    import caffejax
    from bench.nets import NETS, deploy_net

    net = deploy_net(NETS[args.net])
    name = net.inputs[0]
    rng = np.random.default_rng(0)
    stream = [int(n) for n in rng.integers(1, args.max + 1, args.requests)]
    images = rng.random((args.max,) + tuple(net.blobs[name].shape[1:]), dtype=np.float32)
    infer = caffejax.compile_inference(net, batch_sizes=args.sizes if args.child == "padded" else None)

    def send(requests: list[int], failures: list) -> None:
        try:
            for n in requests:
                jax.block_until_ready(infer({name: images[:n]}))
        except Exception as error:  # (raised again in the main thread)
            failures.append(error)

    def one_pass() -> float:
        failures: list = []
        threads = [threading.Thread(target=send, args=(stream[i::args.threads], failures))
                   for i in range(args.threads)]
        began = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - began
        if failures:
            raise failures[0]
        return elapsed

    first = one_pass()
    passes = [one_pass() for _ in range(args.passes)]
    return {"mode": args.child, "threads": args.threads, "programs": infer.compile_count, "first_pass_s": first,
            "pass_s": statistics.median(passes), "images": sum(stream), "requests": len(stream),
            "distinct_sizes": len(set(stream)), "images_per_s": sum(stream) / statistics.median(passes)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--net", default="squeezenet_v1.1", help="a net of bench.nets (default squeezenet_v1.1)")
    parser.add_argument("--max", type=int, default=16, help="the largest request (default 16)")
    parser.add_argument("--requests", type=int, default=40, help="requests in the stream (default 40)")
    parser.add_argument("--sizes", type=int, nargs="+", default=None,
                        help="the padded mode's batch sizes (default: powers of two below --max, and --max)")
    parser.add_argument("--passes", type=int, default=3, help="timed passes after the first (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="threads sending the stream at once (default 1)")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="JSON path (default bench/results/)")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads must be 1 or more, got {args.threads}")
    args.sizes = args.sizes or _powers_of_two_to(args.max)
    if args.child:
        print(json.dumps(_serve(args)))
        return 0

    from bench.nets import ROOT

    rows = []
    for mode in MODES:
        command = [sys.executable, "-m", "bench.batch_sizes", "--child", mode, "--net", args.net, "--max",
                   str(args.max), "--requests", str(args.requests), "--passes", str(args.passes), "--threads",
                   str(args.threads), "--sizes", *map(str, args.sizes)]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        if done.returncode:
            print(done.stdout + done.stderr, file=sys.stderr)
            return done.returncode
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first = rows[0]
    print(f"{args.net}: {first['requests']} requests of 1-{args.max} images ({first['images']} images, "
          f"{first['distinct_sizes']} batch sizes) from {args.threads} thread(s); padded to {args.sizes}")
    print(f"{'mode':>7} {'programs':>9} {'first pass s':>13} {'pass s':>8} {'images/s':>9}")
    for r in rows:
        print(f"{r['mode']:>7} {r['programs']:>9} {r['first_pass_s']:>13.2f} {r['pass_s']:>8.3f} "
              f"{r['images_per_s']:>9.1f}")
    out = args.out or ROOT / "bench" / "results" / f"batch-sizes-{datetime.datetime.now():%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"net": args.net, "max": args.max, "sizes": args.sizes, "threads": args.threads,
                               "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
