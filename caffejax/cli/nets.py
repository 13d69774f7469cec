"""The commands that read nets: ``train``, ``test``, ``time``, ``device-query`` (Caffe's ``caffe`` tool),
``draw``, ``upgrade`` and ``export``."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time as clock
from typing import Callable

import numpy as np

from caffejax.errors import CaffejaxError, ParseError
from caffejax.fileio import atomic_write, read_bytes
from caffejax.runtime.mode import log_float

log = logging.getLogger("caffejax")

PHASES = {"TRAIN": 0, "TEST": 1}


def add_commands(commands, parents) -> None:
    def command(name: str, run: Callable, help: str, description: str | None = None, **kwargs):
        parser = commands.add_parser(name, parents=parents, help=help, description=description or help, **kwargs)
        parser.set_defaults(run=run)
        return parser

    p = command("train", train, "train or finetune a model",
                "Train a net with the solver's settings (Caffe's 'caffe train'). -weights finetunes from "
                "caffemodels; -snapshot resumes from a .solverstate.")
    _flag(p, "solver", required=True, help="the solver definition (prototxt)")
    _flag(p, "weights", help="caffemodels to finetune from, separated by ','; cannot be used with -snapshot")
    _flag(p, "snapshot", help="a .solverstate to resume training from")
    _net_state_flags(p)
    p.add_argument("--devices", type=int, default=1, metavar="N",
                   help="train data-parallel on the first N devices JAX sees (default 1); each device runs the "
                        "prototxt's batch, as caffe train -gpu 0,1,... does")
    _flag(p, "sigint_effect", default="stop", choices=SIGNAL_EFFECTS,
          help="what a SIGINT (Ctrl-C) does while training: stop (after the current iteration, with a final "
               "snapshot; the default), snapshot, or none (ignored)")
    _flag(p, "sighup_effect", default="snapshot", choices=SIGNAL_EFFECTS,
          help="what a SIGHUP does while training: snapshot (the default), stop or none")
    _gpu_flag(p)
    _debug_nans_flag(p)
    _python_layers_flag(p)

    p = command("test", test, "score a model",
                "Run the TEST-phase net for -iterations batches and print every output averaged over them "
                "(Caffe's 'caffe test').")
    _flag(p, "model", required=True, help="the model definition (prototxt)")
    _flag(p, "weights", required=True, help="the trained weights (caffemodel)")
    _flag(p, "iterations", type=int, default=50, help="the number of batches to score (default 50)")
    _flag(p, "phase", type=_phase, default=1, help="TRAIN or TEST (default TEST)")
    _net_state_flags(p)
    _gpu_flag(p)
    _debug_nans_flag(p)
    _python_layers_flag(p)

    p = command("time", time, "benchmark model execution time",
                "Time the net's forward and backward passes (Caffe's 'caffe time'): the whole compiled net, and "
                "each layer compiled on its own.")
    _flag(p, "model", required=True, help="the model definition (prototxt)")
    _flag(p, "weights", help="optional trained weights (caffemodel); fillers are used otherwise")
    _flag(p, "iterations", type=int, default=50, help="the number of timed passes (default 50)")
    _flag(p, "phase", type=_phase, default=0, help="TRAIN or TEST (default TRAIN, as Caffe)")
    _net_state_flags(p)
    _gpu_flag(p)
    _python_layers_flag(p)

    p = command("device-query", device_query, "show the devices JAX can use", aliases=["device_query"])
    _gpu_flag(p)

    p = command("draw", draw, "draw a net's graph",
                "Draw a net (python/draw_net.py): the image format is OUT's extension (.png, .svg, .pdf; .dot "
                "writes Graphviz text and needs nothing installed).")
    p.add_argument("prototxt", help="the net definition")
    p.add_argument("output", help="the image file to write")
    p.add_argument("--rankdir", default="LR", choices=("LR", "RL", "TB", "BT"),
                   help="direction of the graph layout (default LR)")
    p.add_argument("--phase", default="ALL", choices=("TRAIN", "TEST", "ALL"),
                   help="draw only the layers of this phase (default ALL)")
    p.add_argument("--display_lrm", "--display-lrm", action="store_true",
                   help="show the learning layers' lr_mult (python/draw_net.py's --display_lrm)")

    p = command("upgrade", upgrade, "upgrade an old net, solver or caffemodel to the current format",
                "Upgrade a V0/V1 net prototxt, a solver prototxt (solver_type), or a binary caffemodel (its "
                "blobs kept) to the current format (Caffe's upgrade_net_proto_text, upgrade_net_proto_binary, "
                "upgrade_solver_proto_text).")
    p.add_argument("input", help="prototxt (net or solver) or binary caffemodel")
    p.add_argument("output", help="where to write the upgraded file (same kind as the input)")

    p = command("export", export, "export a net to StableHLO or Flax",
                "Export a trained net. stablehlo: one file holding the forward with its weights, loadable with "
                "jax.export.deserialize (caffejax.export.load_stablehlo). flax: the variables of "
                "caffejax.export.to_flax's module, Flax msgpack (caffejax.export.load_flax_state).")
    _flag(p, "model", required=True, help="the model definition (prototxt)")
    _flag(p, "weights", required=True, help="the trained weights (caffemodel)")
    _flag(p, "output", required=True, help="the file to write")
    p.add_argument("--format", default="stablehlo", choices=("stablehlo", "flax"), help="default stablehlo")
    p.add_argument("--batch", type=_export_batch,
                   help="stablehlo: the batch size the program takes (default: the prototxt's), or a name (e.g. "
                        "batch) for a symbolic batch: one program for every batch size")
    p.add_argument("--batch-inputs", help="stablehlo: the inputs whose first axis --batch sets, separated by ',' "
                                          "(default: all)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"),
                   help="stablehlo: the weights' and activations' dtype (default float32; bfloat16: the bf16 mode, "
                        "compile_inference(dtype=jnp.bfloat16)'s program, float32 in and out)")
    p.add_argument("--platforms", help="stablehlo: the backends to lower for, separated by ',' (cpu, cuda, rocm, "
                                       "tpu; default: this machine's)")
    _flag(p, "phase", type=_phase, default=1, help="TRAIN or TEST (default TEST)")
    _net_state_flags(p)


def _flag(parser, name: str, **kwargs) -> None:
    """A flag spelled as Caffe's gflags (-model) and as GNU style (--model)."""
    parser.add_argument(f"-{name}", f"--{name}", dest=name, metavar=name.upper(), **kwargs)


def _net_state_flags(parser) -> None:
    _flag(parser, "level", type=int, default=0, help="the net's level (default 0)")
    _flag(parser, "stage", default="", help="the net's stages, separated by ','")


def _gpu_flag(parser) -> None:
    _flag(parser, "gpu", type=_gpu_ids, default=None,
          help="Caffe's device choice: '0', '0,1,...' or 'all'. caffejax runs where JAX runs (a GPU when jaxlib "
               "has one); for train, several ids mean data-parallel training on that many devices (--devices)")


def _gpu_ids(text: str) -> list[int] | str:
    if text.strip().lower() == "all":
        return "all"
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"-gpu takes device ids separated by ',' or 'all', got '{text}'") from None
    if not ids or any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"-gpu takes device ids separated by ',' or 'all', got '{text}'")
    return ids


def _use_gpu_flag(args) -> int:
    """Apply -gpu as Caffe does (mode GPU, device = the first id); returns how many devices it names."""
    from caffejax.runtime import mode

    ids = getattr(args, "gpu", None)
    if ids is None:
        return 1
    import jax

    count = jax.device_count() if ids == "all" else len(ids)
    mode.set_mode_gpu()
    mode.set_device(0 if ids == "all" else ids[0])
    if jax.default_backend() != "gpu":
        log.warning("-gpu %s: JAX sees no GPU (backend '%s'); running on %s", ",".join(map(str, ids))
                    if ids != "all" else "all", jax.default_backend(), jax.devices()[0].device_kind)
    return count


def _debug_nans_flag(parser) -> None:
    parser.add_argument("--debug-nans", action="store_true",
                        help="stop at the first NaN/Inf and name the layer that produced it (slower: checks every "
                             "pass)")


def _python_layers_flag(parser) -> None:
    parser.add_argument("--allow-python-layers", action="store_true",
                        help="run the nets' Python layers, importing their modules (only for a model you trust; "
                             "refused otherwise)")


def _phase(text: str) -> int:
    try:
        return PHASES[text.upper()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"phase must be TRAIN or TEST, got '{text}'") from None


def _export_batch(text: str) -> int | str:
    """export's --batch: a whole number, or the name of a symbolic dimension."""
    if text.isdigit():
        return int(text)
    if text.isidentifier():
        return text
    raise argparse.ArgumentTypeError(f"--batch takes a whole number or a name (a symbolic batch), got '{text}'")


def _stages(args) -> list[str]:
    """caffe.cpp's get_stages_from_flags: boost::split of -stage at ',', so no -stage is one empty stage (its
    nets log ``stage: ""``, and a rule naming ``stage: ""`` or ``not_stage: ""`` sees it, as in Caffe)."""
    return args.stage.split(",")


def _model_file(path: str) -> str:
    """A prototxt path given on the command line (caffejax.Net would read a missing path as prototxt text)."""
    if not os.path.isfile(path):
        raise CaffejaxError(f"{path}: no such model file")
    return path


def _make_net(args):
    import caffejax

    return caffejax.Net(_model_file(args.model), args.phase, weights=args.weights, level=args.level,
                        stages=_stages(args), debug_nans=getattr(args, "debug_nans", False),
                        allow_python_layers=getattr(args, "allow_python_layers", False))


def _positive_iterations(args) -> int:
    if args.iterations <= 0:
        raise CaffejaxError(f"-iterations must be positive, got {args.iterations}")
    return args.iterations


# ---- train ------------------------------------------------------------------------------------------------

def train(args) -> int:
    """Caffe's train. As there, the flags rewrite the solver's settings before the solver is made: -level and
    -stage its ``train_state`` (the level always, so a solver file's train_state level gives way to -level's
    default 0), -weights replaces its ``weights`` field and -snapshot clears it (the state's learned net is
    what the training resumes from)."""
    from caffejax.runtime.solver import read_solver_param, solver_for

    if args.snapshot and args.weights:
        raise CaffejaxError("give -snapshot to resume training or -weights to finetune, but not both")
    if args.devices < 1:
        raise CaffejaxError(f"--devices must be at least 1, got {args.devices}")
    gpus = _use_gpu_flag(args)
    if gpus > 1 and args.devices == 1:
        args.devices = gpus
    devices = args.devices if args.devices > 1 else None  # data-parallel, as caffe train --gpu 0,1,...
    if not args.solver:
        raise CaffejaxError("Need a solver definition to train (-solver)")
    param, path = read_solver_param(args.solver)
    _log_device(args, training_devices=devices or 1)
    param.train_state.level = args.level
    param.train_state.stage.extend(_stages(args))
    if args.snapshot or args.weights:
        param.ClearField("weights")
    if args.weights:
        # One entry holding the comma-separated list, as Caffe adds it; the solver's LoadNetWeights splits it
        # and copies each file into the train and test nets.
        names = [w.strip() for w in args.weights.split(",") if w.strip()]
        if not names:
            raise CaffejaxError(f"-weights '{args.weights}' names no caffemodel")
        param.weights.append(",".join(names))
    solver = solver_for(param, path, devices, allow_python_layers=args.allow_python_layers)
    solver.debug_nans = args.debug_nans
    if args.snapshot:
        log.info("Resuming from %s", args.snapshot)
        solver.restore(args.snapshot)
    log.info("Starting Optimization")
    with SignalActions(args.sigint_effect, args.sighup_effect) as actions:
        if actions.installed:
            solver.set_action_function(actions)
        solver.solve()
    log.info("Optimization Done.")  # after a stop too, as caffe train says it
    return 0


SIGNAL_EFFECTS = ("stop", "snapshot", "none")


class SignalActions:
    """caffe.cpp's SignalHandler: while training, SIGINT and SIGHUP are noted instead of acted on at once, and
    the solver, asking after each iteration (its action function), gets the effect the flags give them.

    Differs from Caffe: a second SIGINT before the solver has seen the first raises KeyboardInterrupt, so an
    iteration that takes long can still be cut short. Nothing is installed outside the main thread (Python
    handles signals there only) or over several processes, where one process stopping alone would leave the
    others waiting in a collective; there Ctrl-C interrupts as in any Python program.
    """

    def __init__(self, sigint_effect: str, sighup_effect: str):
        self.effects = {signal.SIGINT: sigint_effect}
        if hasattr(signal, "SIGHUP"):  # not on Windows
            self.effects[signal.SIGHUP] = sighup_effect
        self._pending: set[int] = set()
        self._previous: dict[int, object] = {}
        self.installed = False

    def __enter__(self) -> "SignalActions":
        import jax

        if threading.current_thread() is threading.main_thread() and jax.process_count() == 1:
            for signum in self.effects:
                self._previous[signum] = signal.signal(signum, self._note)
            self.installed = True
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)  # None: not set from Python
        self._previous.clear()
        self.installed = False

    def _note(self, signum: int, frame) -> None:
        if signum == signal.SIGINT and signum in self._pending and self.effects[signum] != "none":
            raise KeyboardInterrupt
        self._pending.add(signum)

    def __call__(self) -> str:
        """The effect of a signal received since the last call (SIGHUP's first, as Caffe's CheckForSignals),
        or "none"."""
        for signum in (getattr(signal, "SIGHUP", None), signal.SIGINT):
            if signum in self._pending:
                self._pending.discard(signum)
                return self.effects[signum]
        return "none"


# ---- test -------------------------------------------------------------------------------------------------

def test(args) -> int:
    """Caffe's test: forward -iterations times; log every output element per batch, then their means.

    The sums, means and weighted losses are float32, as caffe.cpp keeps them: what it prints is rounded from
    those (summing 1e8, 1 and -1e8 gives 0 there, not 1)."""
    from caffejax.runtime.solver import output_scores, summed_scores

    iterations = _positive_iterations(args)
    _use_gpu_flag(args)
    net = _make_net(args)
    _log_device(args)  # after the net is made (Caffe says it before), so that bad input is the only line
    log.info("Running for %d iterations.", iterations)
    totals, loss = None, np.float32(0)
    for i in range(iterations):
        net.forward()
        loss += np.float32(net._last_loss)  # Net::Forward's loss
        scores = output_scores(net)
        for name, _, score in scores:
            log.info("Batch %d, %s = %s", i, name, log_float(score))
        totals = summed_scores(totals, scores, i)
    log.info("Loss: %s", log_float(loss / np.float32(iterations)))
    for (name, weight, _), total in zip(scores, totals):
        mean = total / np.float32(iterations)
        weight = np.float32(weight)
        suffix = f" (* {log_float(weight)} = {log_float(weight * mean)} loss)" if weight else ""
        log.info("%s = %s%s", name, log_float(mean), suffix)
    return 0


# ---- time -------------------------------------------------------------------------------------------------

def time(args) -> int:
    """Caffe's time: average forward and backward time per layer and for the whole net, in caffe.cpp's log lines
    (scripts read "Average Forward pass: ... ms." and its siblings), each caffejax addition on a line of its own.

    Differs from Caffe, which times its layer-by-layer sweeps: the whole-net figures are the two compiled
    programs a net runs (the forward, and the forward-backward, where XLA fuses across layers); the backward
    pass is the second's time less the first's, so the forward timed runs the forward-backward's kernels
    (Net.forward alone runs NetProgram.forward_kernels, faster where they differ). A net run in stages around a
    layer on the host (Graph.staging_layers: Faster R-CNN's proposals) is timed as Net.forward and Net.backward
    run it, a program per stage and the host layers between; each stage's forward and backward programs are
    traced. Each layer is timed alone, compiled on its own with the kernel and layouts it has in the whole net,
    so the layers' times do not add up to the whole net's. A layer fed from outside the programs (Input: 0; a data
    layer: reading one batch on the host) and a layer whose backward computes no diff (0) are reported as such."""
    import jax

    from caffejax.lower.optimize import value_layouts
    from caffejax.runtime.xla_options import compiler_options

    iterations = _positive_iterations(args)
    _use_gpu_flag(args)
    net = _make_net(args)
    _log_device(args)  # after the net is made (Caffe says it before), so that bad input is the only line
    log.info("Performing Forward")
    net.forward()  # also pulls a batch into the data layers' tops, which the timed programs then read
    log.info("Initial loss: %s", log_float(np.float32(net._last_loss)))

    graph, program = net.graph, net._program
    params = net.param_arrays()
    fed = {value: net.blobs[name].data for name, value in graph.fed.items()}
    key = jax.random.key(0)
    if graph.staging_layers:
        timed_forward, forward_backward = _passes_in_stages(net)
    else:
        forward, forward_backward = whole_net_programs(net)
        # Caffe's forward runs every layer: the whole-net forward timed ends with the layers run on the host.
        timed_forward = _then_on_host(graph, forward, net._python_layers) if graph.made_on_host else forward
    log.info("Performing Backward")
    jax.block_until_ready(forward_backward(params, fed, key))  # compiled here, so no timed iteration compiles

    log.info("*** Benchmark begins ***")
    log.info("Testing for %d iterations.", iterations)
    whole_forward = _mean_seconds(timed_forward, (params, fed, key), iterations)
    iteration_seconds = []
    for j in range(iterations):
        start = clock.perf_counter()
        jax.block_until_ready(forward_backward(params, fed, key))
        iteration_seconds.append(clock.perf_counter() - start)
        log.info("Iteration: %d forward-backward time: %s ms.", j + 1, log_float(iteration_seconds[-1] * 1e3))
    whole_forward_backward = sum(iteration_seconds) / iterations

    env = _every_value(net, params, fed, key)  # each layer's inputs, for the per-layer timings
    log.info("Average time per layer: ")
    log.info("(each layer compiled on its own, with the kernel and layouts it has in the whole net; there XLA "
             "fuses layers, so these do not add up to the whole-net figures)")
    layouts = value_layouts(graph, program.kernels)
    for layer in graph.layers:
        if layer.is_input:
            fwd, bwd = _fed_layer_seconds(net, layer, iterations), None
        elif layer.runs_on_host:
            fwd, bwd = _host_layer_seconds(layer, env, iterations, net._python_layers), None
        else:
            fwd, bwd = _layer_times(program, layer, params, env, layouts, key, iterations)
        log.info("%10s\tforward: %s ms.", layer.name, log_float(fwd * 1e3))
        log.info("%10s\tbackward: %s ms.", layer.name, log_float((bwd or 0.0) * 1e3))
    profiled = (_stage_programs(net, params, env, key) if graph.staging_layers else
                {"Forward pass": (forward, (params, fed, key)),
                 "Forward-Backward": (forward_backward, (params, fed, key))})
    _log_program_profiles(graph, profiled, iterations)
    if not any(net.blob_loss_weights.values()):
        log.info("The net has no loss, so its backward pass is empty.")
    log.info("Average Forward pass: %s ms.", log_float(whole_forward * 1e3))
    log.info("Average Backward pass: %s ms.", log_float(max(whole_forward_backward - whole_forward, 0.0) * 1e3))
    log.info("Average Forward-Backward: %s ms.", log_float(whole_forward_backward * 1e3))
    log.info("Total Time: %s ms.", log_float(sum(iteration_seconds) * 1e3))
    log.info("*** Benchmark ends ***")
    return 0


def _log_device(args, training_devices: int | None = None) -> None:
    """caffe.cpp's "Use CPU." or, on GPUs, test's and time's "Use GPU with device ID N" and train's "Using GPUs
    0, 1" with a "GPU i: <name>" line each (``training_devices``: how many train uses), for where the programs
    actually run."""
    import jax

    if jax.default_backend() != "gpu":
        log.info("Use CPU.")
        return
    ids = getattr(args, "gpu", None)
    if training_devices is None:
        log.info("Use GPU with device ID %d", ids[0] if ids not in (None, "all") else 0)
        return
    ids = list(range(training_devices)) if ids in (None, "all") else ids
    log.info("Using GPUs %s", ", ".join(map(str, ids)))
    devices = jax.devices()
    for i in ids:
        log.info("GPU %d: %s", i, devices[i].device_kind if i < len(devices) else "(not seen by JAX)")


def _fed_layer_seconds(net, layer, iterations: int) -> float:
    """A layer whose tops are fed to the programs: an Input layer does nothing (0); a data layer's forward is
    reading its next batch on the host (the records move on, as Caffe's timed Forward moves them)."""
    from caffejax.runtime.net import pulls_batches

    if not pulls_batches(layer):
        return 0.0
    source = net._data_source(layer)
    start = clock.perf_counter()
    for _ in range(iterations):
        source.next_batch()
    return (clock.perf_counter() - start) / iterations


# Runs of each whole-net program traced at most (a trace of a big net's run holds thousands of events).
TRACED_RUNS = 10


def _log_program_profiles(graph, programs, iterations: int) -> None:
    """Each whole-net program (title -> (jitted program, its arguments)) traced: its XLA operations' time charged
    to the layers they compute (:mod:`caffejax.runtime.program_profile`), where fusion puts layers together and
    backward passes run."""
    from caffejax.runtime.program_profile import ProfileUnavailable, format_rows, profile_program

    names = [layer.name for layer in graph.layers]
    for title, (program, args) in programs.items():
        try:
            profile = profile_program(program.lower(*args).compile(), args, names,
                                      runs=min(iterations, TRACED_RUNS))
        except ProfileUnavailable as e:
            log.warning("No profile of the whole net's %s: %s", title, e)
            continue
        log.info("Whole net's %s, traced (%d run%s, %s ms each), by the layers each XLA operation computes "
                 "(layers joined by '+' are fused into one operation):", title, profile.runs,
                 "s" if profile.runs != 1 else "", log_float(profile.seconds * 1e3))
        for line in format_rows(profile):
            log.info("%s", line)


def _program_output_values(graph) -> list[str]:
    """The values ``time``'s whole-net programs return: the net's outputs (for layers run on the host, what they
    read: Graph.program_outputs) and the blobs silenced. Caffe's Forward runs every layer. A blob only a Silence
    layer reads is no output, so it is returned too: else XLA drops the layers that make it."""
    silenced = [v for layer in graph.layers if not layer.is_input and not layer.top_values for v in layer.bottom_values]
    return list(dict.fromkeys([graph.blob_value[name] for name in graph.program_outputs] + silenced))


def whole_net_programs(net):
    """``time``'s two whole-net programs, ``(params, fed values, key) -> ...``: the forward, which returns the net's
    outputs as ``Net.forward`` does (its other blobs are not copied out) and the blobs silenced, and
    Net::ForwardBackward, which returns the loss, the gradients and those values."""
    import jax

    from caffejax.runtime.xla_options import compiler_options

    graph, program = net.graph, net._program
    # Caffe's Forward runs every layer. A blob only a Silence layer reads is no output, so it is returned too:
    # else XLA drops the layers that make it.
    outputs = _program_output_values(graph)

    # Only outputs come back, so Convolution -> BatchNorm chains whose inner values are blobs fold, as in
    # Net.forward's pass and a solver's iteration (not over a Python layer: Net._reruns). Both run the kernels
    # of programs with a backward (program.kernels), so that the backward pass, the forward-backward's time less
    # the forward's, leaves the same forward out; Net.forward alone runs forward_kernels, faster where they differ.
    fold_visible = net._reruns(graph.layers)

    def forward(p, env, k):
        values = program.run_layers(graph.layers, p, env, k, kernels=program.kernels, fold_visible=fold_visible)[0]
        return [values[v] for v in outputs]

    def forward_backward(p, env, k):
        # ForwardBackward runs the whole forward even where no loss needs it. A deploy net's gradients are all
        # zero, and XLA would drop the forward with them, were the outputs not returned too.
        loss, grads, (values, _) = program.loss_and_grads(p, env, k, fold_visible=fold_visible)
        return loss, grads, [values[v] for v in outputs]

    return (jax.jit(forward, compiler_options=compiler_options(graph)),
            jax.jit(forward_backward, compiler_options=compiler_options(graph, backward=True)))


def _then_on_host(graph, forward, python_layers):
    """``forward`` (a whole-net program) followed by the layers run on the host, on what it returned."""
    from caffejax.lower.program import run_host_layers

    values = _program_output_values(graph)

    def run(*args):
        outputs = forward(*args)
        run_host_layers(graph.layers, dict(zip(values, outputs)), python_layers)
        return outputs

    return run


def _stage_ranges(graph) -> list[list]:
    """The layers of a net run in stages (Graph.staging_layers), cut after each staging layer: each piece its
    compiled layers, then the layers run on the host (the staging one last)."""
    cuts = [0, *(index + 1 for index in graph.staging_layers), len(graph.layers)]
    return [graph.layers[begin:end] for begin, end in zip(cuts, cuts[1:]) if begin < end]


def _every_value(net, params, fed, key) -> dict:
    """Every value of the net's forward (value id -> array), for the per-layer timings: one program over all its
    layers, or over each stage's of a net run in stages, the layers run on the host after each."""
    import functools

    import jax

    from caffejax.lower.program import run_host_layers
    from caffejax.runtime.xla_options import compiler_options

    graph, program = net.graph, net._program

    def run(layers, p, env, k):
        return program.run_layers(layers, p, env, k, kernels=program.kernels)[0]

    env = dict(fed)
    for layers in _stage_ranges(graph) if graph.staging_layers else [graph.layers]:
        env = dict(jax.jit(functools.partial(run, layers), compiler_options=compiler_options(graph))(params, env, key))
        if graph.staging_layers:
            env.update(run_host_layers(layers, env, net._python_layers))
    return env


def _passes_in_stages(net):
    """``time``'s whole-net passes of a net run in stages (Graph.staging_layers), ``(params, fed, key) -> arrays``
    to wait on, arguments unused: Net.forward's and Net.backward's own, a program per stage and the layers run on
    the host between (the data layers keep the batch they read); the backward's diffs add up, as in Caffe's."""
    last = len(net.graph.layers) - 1

    def forward(*_):
        with net._python_layers:
            net._forward_in_stages(0, last, pull=False)
        return [net.blobs[name]._data.value() for name in net.outputs]

    def forward_backward(*_):
        outputs = forward()
        with net._python_layers:
            net._backward_around_host(last, 0)
        return outputs, [blob._diff.value() for blob in net._param_blobs.values()]

    return forward, forward_backward


def _stage_programs(net, params, env, key) -> dict:
    """The programs of a net run in stages, to trace (title -> (program, arguments)), on ``env`` (every value of
    its forward, :func:`_every_value`) and the diffs its last backward left in the blobs. Per stage: the forward
    of its compiled layers, handing back what later layers and the outputs read, and Net.backward's program
    for it, seeded by the diffs of its tops that no layer of it reads (the losses', and what later stages and
    the host layer's backward wrote), handing back the diffs of what it read from before it."""
    import functools

    import jax

    from caffejax.frontend.ir import stage_interface
    from caffejax.runtime.xla_options import compiler_options

    graph, program = net.graph, net._program
    fold_visible = net._reruns(graph.layers)
    programs, begin = {}, 0

    def forward(layers, returned, p, env, k):
        values = program.run_layers(layers, p, env, k, kernels=program.forward_kernels, fold_visible=fold_visible)[0]
        return [values[v] for v in returned]

    def forward_backward(first, last, diff_values, p, env, seeds, k):
        return program.forward_backward(p, env, seeds, k, start=first, end=last, diff_values=diff_values)[2:]

    outputs = set(_program_output_values(graph))
    for stage, layers in enumerate(_stage_ranges(graph), 1):
        end = begin + len(layers)
        compiled, reads, needed = stage_interface(graph, begin, end, outputs)
        returned = [v for v in dict.fromkeys(v for layer in compiled if not layer.is_input for v in layer.top_values)
                    if v in needed]
        inputs = (params, {v: env[v] for v in reads}, key)
        names = f"{compiled[0].name} to {compiled[-1].name}" if compiled else ""
        if compiled and returned:
            programs[f"Forward pass, stage {stage} ({names})"] = (jax.jit(
                functools.partial(forward, compiled, returned), compiler_options=compiler_options(graph)), inputs)
        consumed = {v for layer in compiled for v in layer.bottom_values}
        seeds = {value: net.blobs[top].diff for layer in compiled if not layer.is_input
                 for top, value in zip(layer.tops, layer.top_values) if value not in consumed and top in net.blobs}
        diff_values = tuple(dict.fromkeys(v for layer in compiled if layer.need_backward
                                          for v, need in zip(layer.bottom_values, layer.bottom_need_backward)
                                          if need and v in reads))
        if any(layer.need_backward for layer in compiled):
            programs[f"Forward-Backward, stage {stage} ({names})"] = (jax.jit(
                functools.partial(forward_backward, begin, end - 1, diff_values),
                compiler_options=compiler_options(graph, backward=True)), (*inputs[:2], seeds, key))
        begin = end
    return programs


def _host_layer_seconds(layer, env, iterations: int, python_layers) -> float:
    """A layer run on the host (Layer.runs_on_host), on the bottoms the whole net gave it."""
    from caffejax.lower.program import host_forward

    forward = host_forward(layer, python_layers)
    bottoms = [np.asarray(env[value]) for value in layer.bottom_values]
    return _mean_seconds(lambda: forward(layer.proto, bottoms), (), iterations)


def _mean_seconds(fn, args, iterations: int) -> float:
    """Mean wall time of ``fn(*args)`` over ``iterations`` calls, after calls that compile it and page its
    buffers in (program_profile.warm_up)."""
    import jax

    from caffejax.runtime.program_profile import warm_up

    warm_up(lambda: fn(*args))
    start = clock.perf_counter()
    for _ in range(iterations):
        jax.block_until_ready(fn(*args))
    return (clock.perf_counter() - start) / iterations


def _layer_times(program, layer, params, env, layouts, key, iterations: int) -> tuple[float, float | None]:
    """One layer as the net runs it (its kernel, its bottoms in the layouts the net makes them in), jitted alone
    on its actual inputs: forward time, and backward time (a VJP giving the diffs Caffe's Backward computes:
    bottoms with propagate_down, blobs with lr_mult != 0), or None when the layer computes no diff."""
    import jax
    import jax.numpy as jnp

    from caffejax.lower.optimize import NCHW, to_layout

    layer_params = {owner: params[owner] for owner in {slot.storage[0] for slot in layer.params}}
    have = {value: layouts.get(value, NCHW) for value in layer.bottom_values}
    bottoms = {value: to_layout(env[value], NCHW, have[value]) for value in layer.bottom_values}
    wanted_params = [slot.storage for slot, need in zip(layer.params, layer.param_need_backward) if need]
    wanted_bottoms = [value for value, need in zip(layer.bottom_values, layer.bottom_need_backward) if need]

    def run(p, b, k):
        out, _ = program.run_layers([layer], p, b, k, kernels=program.kernels, layouts=have, restore_layout=False)
        return [out[value] for value in layer.top_values]

    forward = jax.jit(run)
    seconds_forward = _mean_seconds(forward, (layer_params, bottoms, key), iterations)
    if not (wanted_params or wanted_bottoms):
        return seconds_forward, None

    def backward(p, b, k, top_diffs):
        _, vjp = jax.vjp(lambda p, b: run(p, b, k), p, b)
        param_diffs, bottom_diffs = vjp(top_diffs)
        return ([param_diffs[owner][i] for owner, i in wanted_params], [bottom_diffs[v] for v in wanted_bottoms])

    top_diffs = [jnp.ones_like(top) for top in forward(layer_params, bottoms, key)]
    seconds_backward = _mean_seconds(jax.jit(backward), (layer_params, bottoms, key, top_diffs), iterations)
    return seconds_forward, seconds_backward


# ---- device-query -----------------------------------------------------------------------------------------

def device_query(args) -> int:
    """Caffe's device_query (``caffe device_query -gpu 0``): the devices -gpu names, by their index among JAX's
    devices, or all of them. Differs from Caffe: without -gpu it lists every device (Caffe lists none)."""
    import jax

    devices = jax.devices()
    ids = args.gpu
    if ids is not None and ids != "all":
        log.info("Querying GPUs %s", ",".join(map(str, ids)))
        missing = [i for i in ids if i >= len(devices)]
        if missing:
            raise CaffejaxError(f"-gpu {','.join(map(str, missing))}: no such device; JAX sees {len(devices)} "
                                f"({', '.join(f'{d.id}: {d.device_kind}' for d in devices)})")
        devices = [devices[i] for i in ids]
    for device in devices:
        log.info("Device %d: %s (%s)", device.id, device.device_kind, device.platform)
    return 0


# ---- draw -------------------------------------------------------------------------------------------------

def draw(args) -> int:
    from caffejax import draw as drawing

    phase = None if args.phase == "ALL" else PHASES[args.phase]
    net = _read_net_file(args.prototxt)
    log.info("Drawing net to %s", args.output)
    drawing.draw_net_to_file(net, args.output, args.rankdir, phase, display_lrm=args.display_lrm)
    return 0


def _read_net_file(path: str):
    from caffejax.frontend.prototxt import parse_net_text

    return parse_net_text(_model_file(path), is_path=True)


# ---- upgrade ----------------------------------------------------------------------------------------------

def upgrade(args) -> int:
    """Caffe's three upgrade tools in one: the input's kind (binary caffemodel, net or solver prototxt)
    decides which."""
    from caffejax.frontend.caffemodel import read_binary_net
    from caffejax.frontend.prototxt import parse_net_text, parse_solver_text, read_text, to_text
    from caffejax.frontend.upgrade import (net_needs_upgrade, solver_needs_type_upgrade, upgrade_net_as_needed,
                                           upgrade_solver_as_needed, upgrade_solver_net_params)

    if _is_binary(args.input):
        net = read_binary_net(args.input)
        if not net_needs_upgrade(net):
            log.info("File already in latest proto format: %s", args.input)
        upgraded = upgrade_net_as_needed(net, args.input)
        atomic_write(args.output, upgraded.SerializeToString())
        log.info("Wrote upgraded NetParameter binary proto to %s", args.output)
        return 0
    read_text(args.input)  # a missing or unreadable file is reported as such, not as a parse failure
    try:
        net = parse_net_text(args.input, is_path=True)
    except ParseError as net_error:
        try:
            solver = parse_solver_text(args.input, is_path=True)
        except ParseError as solver_error:
            # Report the reading that got further: that is the kind of file this is meant to be.
            raise max(net_error, solver_error, key=lambda e: (e.line or 0, e.column or 0)) from None
        if not solver_needs_type_upgrade(solver):
            log.info("File already in latest proto format: %s", args.input)
        upgraded = upgrade_solver_net_params(upgrade_solver_as_needed(solver, args.input), args.input)
        atomic_write(args.output, to_text(upgraded).encode())
        log.info("Wrote upgraded SolverParameter text proto to %s", args.output)
        return 0
    if not net_needs_upgrade(net):
        log.info("File already in latest proto format: %s", args.input)
    upgraded = upgrade_net_as_needed(net, args.input)
    atomic_write(args.output, to_text(upgraded).encode())
    log.info("Wrote upgraded NetParameter text proto to %s", args.output)
    return 0


def _is_binary(path: str) -> bool:
    """A binary protobuf rather than text: not UTF-8, or holding control bytes text never has."""
    head = read_bytes(path, limit=4096)
    if b"\x00" in head:
        return True
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 3:  # not just a character cut by the 4096-byte window
            return True
    return any(b < 32 and b not in b"\t\n\r\f\v" for b in head)


# ---- export -----------------------------------------------------------------------------------------------

def export(args) -> int:
    from caffejax.export import export_stablehlo, save_flax_state, to_flax

    net = _make_net(args)
    if args.format == "stablehlo":
        platforms = [p.strip() for p in args.platforms.split(",") if p.strip()] if args.platforms else None
        batch_inputs = [name.strip() for name in args.batch_inputs.split(",") if name.strip()] \
            if args.batch_inputs else None
        exported = export_stablehlo(net, args.output, batch=args.batch, batch_inputs=batch_inputs,
                                    dtype=args.dtype or "float32", platforms=platforms)
        log.info("Wrote StableHLO for %s to %s", ", ".join(exported.platforms), args.output)
    else:
        if args.batch is not None or args.batch_inputs or args.dtype or args.platforms:
            raise CaffejaxError("--batch, --batch-inputs, --dtype and --platforms apply to --format stablehlo only (a "
                                "Flax module takes any batch, holds the weights as they are and runs where JAX runs)")
        save_flax_state(to_flax(net), args.output)
        log.info("Wrote the Flax module's variables (msgpack) to %s", args.output)
    return 0
