"""One fresh process: build the net with its weights, compile its inference program, run it once.

Run by ``bench.run`` twice per net and batch with the same JAX persistent compilation cache directory:
the first run compiles from scratch (cold) and fills the cache, the second loads the program from it
(warm start). Prints one JSON object: the phases' seconds and the process's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import time

START = time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prototxt", required=True)
    parser.add_argument("--weights", required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--cache-dir", required=True)
    args = parser.parse_args()

    import jax
    import numpy as np

    jax.config.update("jax_compilation_cache_dir", args.cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    import caffejax
    from bench.measure import once, peak_rss_mb

    imported = time.perf_counter()
    net = caffejax.Net(args.prototxt, args.weights, caffejax.TEST)
    built = time.perf_counter()
    infer = caffejax.compile_inference(net)
    name = net.inputs[0]
    x = np.random.default_rng(0).random((args.batch,) + tuple(net.blobs[name].shape[1:]), dtype=np.float32)
    _, first_call = once(lambda: infer({name: x}))
    _, second_call = once(lambda: infer({name: x}))  # the run alone: first_call - second_call is the start-up
    print(json.dumps({"import_s": imported - START, "net_build_s": built - imported, "first_call_s": first_call,
                      "second_call_s": second_call,
                      "total_s": time.perf_counter() - START, "peak_rss_mb": peak_rss_mb()}))


if __name__ == "__main__":
    main()
