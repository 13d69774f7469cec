"""Where the time goes: every layer of a net's inference plan timed alone, jitted on its real inputs.

    python -m bench.profile resnet50 --batch 16                 # the default passes
    python -m bench.profile resnet50 --batch 16 --passes none   # Caffe's rules as Net.forward runs them
    python -m bench.profile googlenet --passes fold_batchnorm,nhwc --top 20

Each layer runs its chosen kernel (or Caffe's rule) on random inputs of its real shapes and layouts, so
the sum is an upper bound of the whole program (XLA fuses across layers there). Prints the slowest layers,
the time per kernel kind, and each convolution's GFLOP/s.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from bench.measure import timed
from bench.nets import NETS, randomize_weights


def profile(net_name: str, batch: int, passes, repeats: int = 5, dtype=jnp.float32) -> list[dict]:
    import caffejax
    from caffejax.lower.optimize import NCHW, resolve_layout, to_layout
    from caffejax.lower.registry import LayerContext, count, get_rule
    from caffejax.runtime.xla_options import compiler_options

    spec = NETS[net_name]
    net = caffejax.Net(str(spec.prototxt), caffejax.TEST, **({"weights": str(spec.weights)} if spec.weights else {}))
    if spec.weights is None:
        randomize_weights(net)
    name = net.inputs[0]
    shape = (batch,) + tuple(net.blobs[name].shape[1:])
    infer = caffejax.compile_inference(net, passes=passes, dtype=dtype)
    plan = infer.plan({name: shape})
    options = compiler_options(plan.graph)  # each layer compiled as the whole program is
    params = infer._programs[infer._signature({name: shape})].params
    graph = plan.graph
    rng = np.random.default_rng(0)
    layouts = {}
    rows = []
    for layer in graph.layers:
        if layer.is_input:
            layouts.update((v, NCHW) for v in layer.top_values)
            continue
        kernel = plan.kernels.get(layer.name)
        layout = resolve_layout(kernel, [layouts[v] if len(graph.value_shapes[v]) == 4 else None
                                         for v in layer.bottom_values])
        bottoms = [to_layout(jnp.asarray(rng.random(graph.value_shapes[v], dtype=np.float32), dtype), NCHW, layout)
                   for v in layer.bottom_values]
        forward = kernel.forward if kernel is not None else get_rule(layer.type).forward
        ctx = LayerContext(layer=layer.proto, phase=graph.phase, key=None, num_tops=len(layer.tops),
                           in_place=tuple(layer.in_place))
        run = jax.jit(lambda b, p, forward=forward, ctx=ctx: forward(ctx, b, p), compiler_options=options)
        blobs = params.get(layer.name, [])
        t = timed(lambda: run(bottoms, blobs), repeats, warmup=1)
        flops = 0
        if layer.type == "Convolution":
            flops = 2 * count(graph.value_shapes[layer.top_values[0]]) * count(layer.params[0].shape, 1)
        elif layer.type == "InnerProduct":
            flops = 2 * count(graph.value_shapes[layer.bottom_values[0]]) * layer.proto.inner_product_param.num_output
        rows.append({"layer": layer.name, "type": layer.type, "kernel": kernel.name if kernel else f"caffe:{layer.type}",
                     "shape": graph.value_shapes[layer.bottom_values[0]] if layer.bottom_values else (),
                     "ms": t["median_ms"], "gflops": flops / t["median_ms"] / 1e6 if flops else None})
        layouts.update((v, layout) for v in layer.top_values)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("net", choices=list(NETS))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--passes", default=None, help="comma-separated passes, 'none' for Caffe's rules")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args(argv)
    from caffejax.lower.optimize import DEFAULT_PASSES

    passes = DEFAULT_PASSES if args.passes is None else (() if args.passes == "none" else tuple(args.passes.split(",")))
    rows = profile(args.net, args.batch, passes, dtype=jnp.bfloat16 if args.bf16 else jnp.float32)
    total = sum(r["ms"] for r in rows)
    print(f"{args.net} batch {args.batch}, passes {','.join(passes) or 'none'}: sum of layers {total:.1f} ms")
    by_kernel: dict[str, list[float]] = {}
    for r in rows:
        by_kernel.setdefault(r["kernel"], []).append(r["ms"])
    for kernel, times in sorted(by_kernel.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {kernel:28s} {len(times):4d} layers {sum(times):9.1f} ms ({100 * sum(times) / total:4.1f}%)")
    print(f"slowest {args.top}:")
    for r in sorted(rows, key=lambda r: -r["ms"])[:args.top]:
        gf = f"{r['gflops']:6.0f} GFLOP/s" if r["gflops"] else ""
        print(f"  {r['ms']:8.2f} ms  {r['layer']:28s} {r['kernel']:24s} {str(tuple(r['shape'])):22s} {gf}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
