"""Where the time goes: every layer of a net's inference plan timed alone, jitted on its real inputs, or the
whole compiled program traced.

    python -m bench.profile resnet50 --batch 16                 # the default passes
    python -m bench.profile resnet50 --batch 16 --passes none   # Caffe's rules as Net.forward runs them
    python -m bench.profile googlenet --passes fold_batchnorm,nhwc --top 20
    python -m bench.profile mobilenet_v2 --batch 16 --train  # the training step: forward and backward
    python -m bench.profile lenet --batch 16 --whole         # the whole program, its operations by layer
    python -m bench.profile mobilenet_v2 --batch 16 --train --whole
    python -m bench.profile mobilenet_v2 --batch 16 --compare-bf16  # where bfloat16 pays and where it does not

Each layer runs its chosen kernel (or Caffe's rule) on random inputs of its real shapes and layouts, so
the sum is an upper bound of the whole program (XLA fuses across layers there). Prints the slowest layers,
the time per kernel kind, and each convolution's GFLOP/s. ``--whole`` instead traces the program the bench
times (``compile_inference``'s, or the training step's without donated weights) and charges each XLA
operation to the layers it computes (:mod:`caffejax.runtime.program_profile`): fused layers show up
together, XLA's own re-layouts apart. ``--compare-bf16`` traces the float32 and the bfloat16 programs and sets
each layer's share of the one against the other's, the layers that hold the bfloat16 speed-up furthest below
the issue's target first.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from bench.measure import timed
from bench.nets import NETS, deploy_net, randomize_weights
from caffejax.runtime.program_profile import warm_up


def profile(net_name: str, batch: int, passes, repeats: int = 5, dtype=jnp.float32) -> list[dict]:
    import caffejax
    from caffejax.lower.optimize import prepare_params
    from caffejax.runtime.xla_options import compiler_options, layer_matmul_flops

    spec = NETS[net_name]
    net = deploy_net(spec)
    name = net.inputs[0]
    shape = (batch,) + tuple(net.blobs[name].shape[1:])
    infer = caffejax.compile_inference(net, passes=passes, dtype=dtype)
    plan = infer.plan({name: shape})
    options = compiler_options(plan.graph, dtype=dtype)  # each layer compiled as the whole program is
    params = prepare_params(plan, dtype)  # (a small net's program holds them as constants: not in its arguments)
    graph = plan.graph
    rows = []
    for layer, kernel, forward, bottoms in _layers_as_in_the_net(graph, plan.kernels, dtype, key=None):
        run = jax.jit(forward, compiler_options=options)
        blobs = params.get(layer.name, [])
        # Its buffers paged in first (program_profile.warm_up). Over five runs after one, the first of MobileNet v2's
        # layers on 16x112x112x96 to run read 124-135 ms (relu2_2/expand or conv2_2/dwise), 6-9 ms warmed up; the
        # sum of its layers at batch 16 read 321-478 ms, 163-169 ms warmed up.
        warm_up(lambda: run(bottoms, blobs))
        t = timed(lambda: run(bottoms, blobs), repeats, warmup=0)
        flops = layer_matmul_flops(graph, layer)
        rows.append(_row(graph, layer, kernel, ms=t["median_ms"],
                         gflops=flops / t["median_ms"] / 1e6 if flops else None))
    return rows


def profile_training(net_name: str, batch: int, repeats: int = 5) -> list[dict]:
    """Every layer of the training step (TRAIN phase, the kernels Net and the solvers run), timed alone: its
    forward, and its forward + backward (``jax.vjp`` pulled back on a random top diff), jitted on real shapes."""
    import caffejax
    from bench.nets import training_net_param
    from caffejax.lower.optimize import layout_kernels, make_plan
    from caffejax.runtime.xla_options import compiler_options

    spec = NETS[net_name]
    net = caffejax.Net(training_net_param(spec.prototxt, batch), caffejax.TRAIN)
    randomize_weights(net)
    graph = net.graph
    kernels = layout_kernels(graph)
    params = make_plan(graph, net.param_arrays()).params
    rng = np.random.default_rng(1)
    rows = []
    for layer, kernel, forward, bottoms in _layers_as_in_the_net(graph, kernels, jnp.float32, key=jax.random.key(0),
                                                                 prepare=True):
        if not layer.need_backward:
            continue
        blobs = [jnp.asarray(a) for a in params.get(layer.name, [])]
        diffs = [jnp.asarray(rng.random(t.shape, dtype=np.float32)) for t in jax.eval_shape(forward, bottoms, blobs)]
        run_forward = jax.jit(forward, compiler_options=compiler_options(graph))
        run_both = jax.jit(functools.partial(_pull_back, forward, _needed(layer.bottom_need_backward),
                                             _needed(layer.param_need_backward)),
                           compiler_options=compiler_options(graph, backward=True))
        warm_up(lambda: run_forward(bottoms, blobs))
        fwd = timed(lambda: run_forward(bottoms, blobs), repeats, warmup=0)["median_ms"]
        warm_up(lambda: run_both(bottoms, blobs, diffs))
        both = timed(lambda: run_both(bottoms, blobs, diffs), repeats, warmup=0)["median_ms"]
        rows.append(_row(graph, layer, kernel, fwd_ms=fwd, ms=both, bwd_ms=max(both - fwd, 0.0), gflops=None))
    return rows


def profile_whole(net_name: str, batch: int, passes, train: bool, runs: int = 10, dtype=jnp.float32):
    """The whole program traced (:func:`caffejax.runtime.program_profile.profile_program`): the inference
    program of ``compile_inference``, or with ``train`` the training step of ``bench.run.train_step``."""
    import pathlib
    import tempfile

    import caffejax
    from bench.run import training_step_program
    from caffejax.runtime.program_profile import profile_program

    spec = NETS[net_name]
    net = deploy_net(spec)
    if train:
        with tempfile.TemporaryDirectory() as tmp:
            weights = pathlib.Path(tmp) / f"{net_name}.caffemodel"
            net.save(str(weights))
            step, options, (params, inputs, key), graph = training_step_program(spec, weights, batch)
        args = (params, inputs, key, np.uint32(1))
        compiled = jax.jit(step, compiler_options=options).lower(*args).compile()  # no donation: run again
        return profile_program(compiled, args, [layer.name for layer in graph.layers], runs)
    name = net.inputs[0]
    shape = (batch,) + tuple(net.blobs[name].shape[1:])
    infer = caffejax.compile_inference(net, passes=passes, dtype=dtype)
    x = np.random.default_rng(0).random(shape, dtype=np.float32)
    infer({name: x})
    program = infer._programs[infer._signature({name: shape})]
    args = (program.params, {value: jax.device_put(x) for _, value in program.feeds})  # float32, as compiled
    return profile_program(program.run, args, [layer.name for layer in program.plan.graph.layers], runs)


def layer_shares(traced) -> dict[str, float]:
    """Seconds per run by layer, from a traced program (:func:`profile_whole`): an operation's time split evenly
    over the layers it computes; operations of no layer and the executor's idle time under their own labels."""
    shares: dict[str, float] = {}
    for row in traced.rows():
        for layer in row.layers or (row.label,):
            shares[layer] = shares.get(layer, 0.0) + row.seconds / max(1, len(row.layers))
    return shares


def compare_bf16(net_name: str, batch: int, passes, top: int) -> list[str]:
    """Lines setting each layer's share of the float32 program against the bfloat16 one's (:func:`layer_shares`),
    sorted by how far the layer holds the speed-up below the target: bf16 ms - fp32 ms / target."""
    from bench.run import TARGET_BF16_SPEEDUP

    fp32 = profile_whole(net_name, batch, passes, False)
    bf16 = profile_whole(net_name, batch, passes, False, dtype=jnp.bfloat16)
    fp32_ms, bf16_ms = ({k: v * 1e3 for k, v in layer_shares(t).items()} for t in (fp32, bf16))
    held_back = {k: bf16_ms.get(k, 0.0) - fp32_ms.get(k, 0.0) / TARGET_BF16_SPEEDUP for k in {*fp32_ms, *bf16_ms}}
    lines = [f"{net_name} batch {batch}: float32 {fp32.seconds * 1e3:.1f} ms, bfloat16 {bf16.seconds * 1e3:.1f} ms "
             f"a run ({fp32.seconds / bf16.seconds:.2f}x); the {top} layers furthest below "
             f"{TARGET_BF16_SPEEDUP}x (bf16 ms - fp32 ms / {TARGET_BF16_SPEEDUP}):",
             f"  {'fp32 ms':>9s} {'bf16 ms':>9s} {'fp32/bf16':>9s} {'held back':>9s}  layer"]
    for layer in sorted(held_back, key=lambda k: -held_back[k])[:top]:
        a, b = fp32_ms.get(layer, 0.0), bf16_ms.get(layer, 0.0)
        lines.append(f"  {a:9.3f} {b:9.3f} {a / b if b else float('inf'):9.2f} {held_back[layer]:9.3f}  {layer}")
    return lines


def _needed(flags) -> tuple[int, ...]:
    return tuple(i for i, need in enumerate(flags) if need)


def _pull_back(forward, bottoms_needed, params_needed, bottoms, params, diffs):
    """The layer's tops and the diffs Caffe's Backward computes for one layer: of the bottoms and params that
    need them only (a net's first convolution has no input gradient to compute). The tops are returned so that
    the forward is timed too: a convolution's backward reads only its bottom and filters, and XLA drops a
    forward nobody reads (GoogLeNet's conv2/3x3 at batch 16 then read 142 ms "forward + backward" beside a
    58 ms forward: a backward alone, taken for forward + backward)."""
    def of(wanted_bottoms, wanted_params):
        b, p = list(bottoms), list(params)
        for i, value in zip(bottoms_needed, wanted_bottoms):
            b[i] = value
        for i, value in zip(params_needed, wanted_params):
            p[i] = value
        return forward(b, p)

    tops, pull_back = jax.vjp(of, [bottoms[i] for i in bottoms_needed], [params[i] for i in params_needed])
    return tops, pull_back(diffs)


def _layers_as_in_the_net(graph, kernels, dtype, key, prepare: bool = False):
    """(layer, kernel, forward(bottoms, params) -> tops, random bottoms) for each computed layer, the bottoms in
    the layouts the whole net makes them in. ``prepare``: forward lays its weights out itself, as NetProgram
    does with traced weights (inference plans hand over weights prepared once)."""
    from caffejax.lower.optimize import NCHW, resolve_layout, to_layout, value_layouts
    from caffejax.lower.registry import LayerContext, get_rule

    rng = np.random.default_rng(0)
    layouts = value_layouts(graph, kernels)
    for layer in graph.layers:
        if layer.is_input:
            continue
        kernel = kernels.get(layer.name)
        layout = resolve_layout(kernel, [layouts.get(v, NCHW) if len(graph.value_shapes[v]) == 4 else None
                                         for v in layer.bottom_values])
        bottoms = [to_layout(jnp.asarray(rng.random(graph.value_shapes[v], dtype=np.float32), dtype), NCHW, layout)
                   for v in layer.bottom_values]
        rule = kernel.forward if kernel is not None else get_rule(layer.type).forward
        lay_out = kernel.prepare if kernel is not None and prepare else list
        ctx = LayerContext(layer=layer.proto, phase=graph.phase, key=key, num_tops=len(layer.tops),
                           in_place=tuple(layer.in_place))

        def forward(b, p, rule=rule, ctx=ctx, lay_out=lay_out):
            return list(rule(ctx, b, lay_out(p)))

        yield layer, kernel, forward, bottoms


def _row(graph, layer, kernel, **timings) -> dict:
    return {"layer": layer.name, "type": layer.type, "kernel": kernel.name if kernel else f"caffe:{layer.type}",
            "shape": graph.value_shapes[layer.bottom_values[0]] if layer.bottom_values else (), **timings}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("net", choices=list(NETS))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--passes", default=None, help="comma-separated passes, 'none' for Caffe's rules")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--train", action="store_true",
                        help="the training step's layers: forward and forward + backward (ms = both)")
    parser.add_argument("--whole", action="store_true",
                        help="trace the whole program and charge its XLA operations to the layers they compute")
    parser.add_argument("--compare-bf16", action="store_true",
                        help="trace the float32 and bfloat16 programs and set each layer's time in one against "
                             "the other")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args(argv)
    if args.compare_bf16 and (args.train or args.bf16):
        parser.error("--compare-bf16 traces both inference programs: without --train and --bf16")
    passes = None if args.passes is None else (() if args.passes == "none" else tuple(args.passes.split(",")))
    if args.compare_bf16:
        print("\n".join(compare_bf16(args.net, args.batch, passes, args.top)))
        return 0
    if args.whole:
        from caffejax.runtime.program_profile import format_rows

        traced = profile_whole(args.net, args.batch, passes, args.train,
                               dtype=jnp.bfloat16 if args.bf16 else jnp.float32)
        print(f"{args.net} batch {args.batch}, {'training step' if args.train else 'inference'}: whole program "
              f"traced, {traced.seconds * 1e3:.1f} ms a run ({traced.runs} runs); slowest {args.top}:")
        print("\n".join(format_rows(traced, args.top)))
        return 0
    if args.train:
        rows = profile_training(args.net, args.batch)
        total = sum(r["ms"] for r in rows)
        print(f"{args.net} batch {args.batch}, training step: sum of layers' forward + backward {total:.1f} ms "
              f"(forward {sum(r['fwd_ms'] for r in rows):.1f} ms)")
    else:
        rows = profile(args.net, args.batch, passes, dtype=jnp.bfloat16 if args.bf16 else jnp.float32)
        total = sum(r["ms"] for r in rows)
        print(f"{args.net} batch {args.batch}, passes {'default' if passes is None else ','.join(passes) or 'none'}: "
              f"sum of layers {total:.1f} ms")
    by_kernel: dict[str, list[float]] = {}
    for r in rows:
        by_kernel.setdefault(r["kernel"], []).append(r["ms"])
    for kernel, times in sorted(by_kernel.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {kernel:28s} {len(times):4d} layers {sum(times):9.1f} ms ({100 * sum(times) / total:4.1f}%)")
    print(f"slowest {args.top}:")
    for r in sorted(rows, key=lambda r: -r["ms"])[:args.top]:
        gf = f"{r['gflops']:6.0f} GFLOP/s" if r["gflops"] else ""
        split = f"(fwd {r['fwd_ms']:7.2f}, bwd {r['bwd_ms']:7.2f})" if "fwd_ms" in r else ""
        print(f"  {r['ms']:8.2f} ms  {r['layer']:28s} {r['kernel']:24s} {str(tuple(r['shape'])):22s} {gf}{split}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
