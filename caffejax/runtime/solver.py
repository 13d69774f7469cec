"""Caffe's solvers with pycaffe's API: ``caffejax.get_solver(path)``, ``SGDSolver(path)`` ... ``AdamSolver``.

A solver trains its net (``solver.net``) and scores its test nets (``solver.test_nets``) as Caffe's
Solver::Step does (solver.cpp, sgd_solver.cpp and the per-type ``*_solver.cpp``):

1. ClearParamDiffs; run the test nets every ``test_interval`` iterations.
2. ``iter_size`` forward/backward passes, accumulating the param diffs; the loss is their mean.
3. ApplyUpdate: the learning rate (host side, caffejax.runtime.lr_policy), ClipGradients on the accumulated
   diff, then per learnable blob Normalize (diff /= iter_size), Regularize (L2 or L1 weight decay times
   decay_mult), ComputeUpdateValue (the solver type's rule and its history), and ``data -= diff``.
4. ``++iter``; snapshot every ``snapshot`` iterations, or when the action function asks for one (below).

An action function (Caffe's SetActionFunction; :meth:`Solver.set_action_function`) is asked after every
iteration and before every test batch: ``"snapshot"`` snapshots, ``"stop"`` ends the training there (solve()
still takes its final snapshot). ``caffejax train`` hooks it to SIGINT and SIGHUP as ``caffe train`` does.

Steps 1-3 of one iteration are ONE jitted XLA program, ``(params, history, fed blobs, pulled batches, key,
rate scalars) -> (params, history, loss, update values, blob values)``, built on
:meth:`NetProgram.loss_and_grads` (Caffe's objective with its backward masks). The rate enters as a scalar,
so the program compiles once per input shape. Afterwards the params go back into the net's blobs: ``data``
holds the new weights and ``diff`` the update value, as Caffe leaves them after Net::Update.

Only learnable blobs (the owners of shared blobs, ``graph.learnable_slots``) are updated, with their effective
lr_mult and decay_mult. A blob with lr_mult 0 gets no gradient, but its update rule still runs with a local
rate of 0, as in Caffe (its history decays; its weights do not move).

``devices=N`` trains data-parallel over N devices with Caffe's multi-GPU rule: each device runs the
prototxt's batch and the diffs are averaged before ApplyUpdate (caffejax.runtime.distributed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import sys
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from caffejax.errors import (CaffejaxError, DataError, NumericalError, SolverError, TopsSizedByData, UnsupportedError,
                             WeightsError)
from caffejax.frontend.build import load_net_param, may_size_tops_by_data
from caffejax.frontend.ir import Graph
from caffejax.frontend.prototxt import (as_bvlc_message, locate_layer_error, locate_solver_error, parse_solver_text,
                                        to_text)
from caffejax.frontend.upgrade import upgrade_solver_as_needed
from caffejax.lower.program import check_one_program
from caffejax.lower.python_layer import calls_back
from caffejax.lower.registry import TEST, TRAIN
from caffejax.proto import caffe_pb2
from caffejax.runtime import lr_policy, mode, snapshot as snapshots
from caffejax.runtime.debug_info import log_param_norms
from caffejax.runtime.distributed import DataParallel, Devices
from caffejax.runtime.memory import DeviceMemoryErrors
from caffejax.runtime.mode import glog_level, log_float, log_to_stderr_unless_configured
from caffejax.runtime.net import Net, _folding_key, _PassKey, _python_top_values, pulls_batches, to_device
from caffejax.runtime.program_cache import describe_graph, jit_through_cache
from caffejax.runtime.xla_options import compiler_options

log = logging.getLogger("caffejax")

History = tuple[jax.Array, ...]  # one learnable blob's history: 1 array, or 2 for AdaDelta and Adam


@dataclasses.dataclass(frozen=True)
class Learnable:
    """One entry of Caffe's ``net.learnable_params_``: an owner blob with its effective multipliers."""

    layer: str
    index: int
    shape: tuple[int, ...]
    lr_mult: float
    decay_mult: float


def learnables_of(graph: Graph) -> list[Learnable]:
    return [Learnable(s.layer, s.index, tuple(s.shape), s.lr_mult, s.decay_mult) for s in graph.learnable_slots]


# ---- reading a solver ----------------------------------------------------------------------------------------

def read_solver_param(source) -> tuple[caffe_pb2.SolverParameter, str | None]:
    """A SolverParameter from a path (ReadSolverParamsFromTextFileOrDie) or a message; and the file's path."""
    _ensure_log_output()
    if isinstance(source, caffe_pb2.SolverParameter):
        return upgrade_solver_as_needed(source, "<SolverParameter>"), None
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"a solver is a prototxt path or a caffe_pb2.SolverParameter, not {type(source).__name__}")
    path = os.fspath(source)
    param = upgrade_solver_as_needed(parse_solver_text(path, is_path=True), path)
    prefix = snapshots.default_snapshot_prefix(path, param.snapshot_prefix if param.HasField("snapshot_prefix")
                                               else None)
    if prefix != param.snapshot_prefix:
        log.info("snapshot_prefix is set to %s", prefix)
        param.snapshot_prefix = prefix
    return param, path


def merged_state(phase: int, *states: caffe_pb2.NetState) -> caffe_pb2.NetState:
    """Solver's NetState: its phase, then each given state merged over it (later ones take precedence)."""
    state = caffe_pb2.NetState(phase=phase)
    for s in states:
        state.MergeFrom(s)
    return state


def get_solver(source, devices: Devices | None = None, *, allow_python_layers: bool = False) -> "Solver":
    """pycaffe's ``caffe.get_solver``: the solver class the file's ``type`` names (SolverRegistry).

    ``devices`` (a count, or a list of jax devices) trains data-parallel over them, as ``caffe train --gpu``
    with several GPUs: see caffejax.runtime.distributed. ``allow_python_layers``: the train and test nets may
    hold ``Python`` layers, which import and run their modules (only for a model you trust; see ``Net``).
    """
    return solver_for(*read_solver_param(source), devices, allow_python_layers=allow_python_layers)


def solver_for(param: caffe_pb2.SolverParameter, path: str | None, devices: Devices | None = None, *,
               allow_python_layers: bool = False) -> "Solver":
    """The solver ``param`` describes, read from the file ``path`` (None for a message made in code): the files
    it names are looked for beside ``path`` too, and its errors name ``path``'s lines. For a solver file whose
    settings are changed before the solver is made (as ``caffe train``'s flags do)."""
    cls = SOLVER_TYPES.get(param.type)
    if cls is None:
        raise locate_solver_error(SolverError(f"Unknown solver type: '{param.type}' (known types: "
                                              f"{', '.join(SOLVER_TYPES)})"), path)
    solver = cls.__new__(cls)
    solver._init(param, path, devices, allow_python_layers)
    return solver


# ---- the solvers -----------------------------------------------------------------------------------------------

class Solver:
    """What every Caffe solver shares: nets, the training loop, testing, snapshots. See the module docstring.

    ``Solver(path_or_SolverParameter, devices=None, *, allow_python_layers=False)`` (see :func:`get_solver`).
    Subclasses give the update rule (``compute_update_value``).
    """

    type = ""
    history_per_param = 1  # history blobs per learnable blob

    def __init__(self, source, devices: Devices | None = None, *, allow_python_layers: bool = False):
        self._init(*read_solver_param(source), devices, allow_python_layers)

    def _init(self, param: caffe_pb2.SolverParameter, path: str | None, devices: Devices | None = None,
              allow_python_layers: bool = False) -> None:
        self.param, self._path = param, path
        self._allow_python_layers = allow_python_layers
        self._dir = os.path.dirname(os.path.abspath(self._path)) if self._path else None
        self.debug_nans = False  # check every iteration for NaN/Inf (caffejax train --debug-nans)
        try:
            self._check_param()
            log.info("Initializing solver from parameters: \n%s", to_text(self.param).rstrip("\n"))
            if self.param.random_seed >= 0:
                mode.set_random_seed(self.param.random_seed)
            self.net = self._init_train_net()
            self.test_nets = self._init_test_nets()
            log.info("Solver scaffolding done.")
        except SolverError as e:  # name the solver file and the offending field's line
            raise locate_solver_error(e, self._path) from None
        # Data parallelism: the train net's blobs hold the global batch (the test nets run on one device).
        self._parallel = DataParallel(devices) if devices is not None else None
        if self._parallel is not None:
            python = [layer.name for layer in self.net.graph.layers if calls_back(layer)]
            if python and self._parallel.mesh.size > 1:
                # Each device's part of the program would call the one layer object, in no set order: a layer
                # that keeps state (a sampler) would see the devices' calls in a different order on every run.
                # Python data layers run on the host before the program and are dealt out like other data layers.
                raise UnsupportedError(f"Python layers {python} run on the host, where one object serves every "
                                       f"device; train a net holding them on one device, not "
                                       f"{self._parallel.mesh.size}")
            if self.param.debug_info:
                raise UnsupportedError(f"debug_info with devices={devices!r}: it logs every layer's blobs between "
                                       "layers, and data-parallel training runs one fused program; train with "
                                       "debug_info without devices=")
            self._parallel.use_global_batch(self.net)
        self.iter = 0
        self.current_step = 0
        self.mean_scores: list[list[float]] = [[] for _ in self.test_nets]
        self.compile_count = 0  # traces of this solver's own programs (each trace is one XLA compile)
        self._learnables = learnables_of(self.net.graph)
        self._history: list[History] = [tuple(jnp.zeros(l.shape, jnp.float32) for _ in range(self.history_per_param))
                                        for l in self._learnables]
        self._spare = None  # the weights the last iteration started from: _spare_weights
        self._programs: dict[Any, Any] = {}
        self._losses = SmoothedLoss(self.param.average_loss)
        self._callbacks: list[tuple[Any, Any]] = []  # pycaffe's add_callback: (on_start, on_gradients_ready)
        self._progress: _Progress | None = None
        self._action_function = None  # set_action_function
        self._requested_early_exit = False

    # -- set-up (Solver::Init) -------------------------------------------------------------------------------
    def _check_param(self) -> None:
        p = self.param
        for field, value in p.ListFields():
            if field.type in (field.TYPE_FLOAT, field.TYPE_DOUBLE) and not np.all(np.isfinite(value)):
                raise SolverError(f"{field.name} must be a finite number, got {value}")
        if p.average_loss < 1:
            raise SolverError(f"average_loss should be at least 1, got {p.average_loss}")
        if p.iter_size < 1:
            raise SolverError(f"iter_size should be at least 1, got {p.iter_size}")
        if p.regularization_type not in ("L1", "L2"):
            raise SolverError(f"Unknown regularization type: '{p.regularization_type}' (use L1 or L2)")
        lr_policy.check_policy(p)
        if p.snapshot > 0:
            self._check_snapshot_write_permissions()

    def _check_snapshot_write_permissions(self) -> None:
        prefix = self.param.snapshot_prefix
        if not self.param.HasField("snapshot_prefix"):
            raise SolverError("In solver params, snapshot is specified but snapshot_prefix is not")
        directory = os.path.dirname(os.path.abspath(prefix))
        if not (os.path.isdir(directory) and os.access(directory, os.W_OK)):
            raise SolverError(f"Cannot write to snapshot prefix '{prefix}'. Make sure that the directory exists "
                              "and is writeable.")

    def _resolve(self, path: str, what: str) -> str:
        """A file named by the solver: relative to the CWD as in Caffe, else beside the solver file."""
        if os.path.exists(path) or self._dir is None:
            return path
        beside = os.path.join(self._dir, path)
        if os.path.exists(beside):
            return beside
        raise SolverError(f"{what} '{path}' not found (looked in the current directory and beside the solver "
                          "file)")

    def _net_param(self, field: str, value) -> tuple[caffe_pb2.NetParameter, Any]:
        """The net's NetParameter, and its source (its file, for messages)."""
        value = as_bvlc_message(value, caffe_pb2.NetParameter)  # a NetSpec's, with fork fields
        if isinstance(value, caffe_pb2.NetParameter):
            copy = caffe_pb2.NetParameter()
            copy.CopyFrom(value)
            return copy, copy
        path = self._resolve(value, field)
        return load_net_param(path, is_path=True), path

    def _make_net(self, net_param: caffe_pb2.NetParameter, state: caffe_pb2.NetState, source=None) -> Net:
        net_param.ClearField("state")  # the merged state is given explicitly
        # LoadNetWeights: each `weights` entry is a comma-separated list of caffemodels, copied in order. The
        # first goes to the constructor, which then skips the fillers of the layers it covers.
        files = [self._resolve(name.strip(), "weights") for entry in self.param.weights for name in entry.split(",")]
        for name in files:
            log.info("Finetuning from %s", name)
        try:
            net = Net(net_param, state.phase, weights=files[0] if files else None, level=state.level,
                      stages=list(state.stage), allow_python_layers=self._allow_python_layers)
        except CaffejaxError as e:  # a layer's error gets the line of its definition in the net's file
            raise locate_layer_error(e, source) from None
        for name in files[1:]:
            net.copy_from(name)
        return net

    def _init_train_net(self) -> Net:
        p = self.param
        fields = [f for f in ("net", "net_param", "train_net", "train_net_param") if p.HasField(f)]
        if len(fields) != 1:
            raise SolverError("SolverParameter must specify exactly one train net using one of these fields: "
                              f"net, net_param, train_net, train_net_param (found {fields or 'none'})")
        net_param, source = self._net_param(fields[0], getattr(p, fields[0]))
        if fields[0].endswith("_param"):
            log.info("Creating training net specified in %s.", fields[0])
        else:
            log.info("Creating training net from %s file: %s", fields[0], getattr(p, fields[0]))
        return self._make_net(net_param, merged_state(TRAIN, net_param.state, p.train_state), source)

    def _init_test_nets(self) -> list[Net]:
        p = self.param
        sources = [("test_net_param", net) for net in p.test_net_param] + [("test_net", f) for f in p.test_net]
        num_specific = len(sources)
        generic = [f for f in ("net_param", "net") if p.HasField(f)]
        if generic:
            if len(p.test_iter) < num_specific:
                raise SolverError("test_iter must be specified for each test network")
            sources += [(generic[0], getattr(p, generic[0]))] * (len(p.test_iter) - num_specific)
        elif len(p.test_iter) != num_specific:
            raise SolverError(f"test_iter must be specified for each test network ({num_specific} test nets, "
                              f"{len(p.test_iter)} test_iter values)")
        if len(p.test_state) and len(p.test_state) != len(sources):
            raise SolverError("test_state must be unspecified or specified once per test net")
        if sources and p.test_interval <= 0:
            raise SolverError("test_interval must be positive when the solver has test nets")
        nets = []
        for i, (field, value) in enumerate(sources):
            net_param, source = self._net_param(field, value)
            states = [net_param.state] + ([p.test_state[i]] if len(p.test_state) else [])
            log.info("Creating test net (#%d) specified by %s", i,
                     field if field.endswith("_param") else f"{field} file: {value}")
            nets.append(self._make_net(net_param, merged_state(TEST, *states), source))
            nets[-1].debug_info = p.debug_info  # InitTestNets: the solver's setting, whatever the net's
        return nets

    # -- the update rule (ComputeUpdateValue), overridden per solver type --------------------------------------
    def compute_update_value(self, diff: jax.Array, history: History, local_rate: jax.Array,
                             scalars: dict[str, jax.Array]) -> tuple[jax.Array, History]:
        """(the value Net::Update subtracts from the weights, the new history). Traced inside the step."""
        raise NotImplementedError

    def step_scalars(self, rate: float) -> dict[str, np.float32]:
        """The per-iteration scalars the update rule reads (the rate; Adam adds its bias correction)."""
        return {"rate": np.float32(rate)}

    # -- ApplyUpdate, as a pure function of arrays ------------------------------------------------------------
    def _learning_rate(self) -> float:
        """GetLearningRate: this iteration's rate; advances the schedule's current_step."""
        rate, step = lr_policy.learning_rate(self.param, self.iter, self.current_step)
        if self.param.lr_policy == "multistep" and step != self.current_step:
            self._say("MultiStep Status: Iteration %d, step = %d", self.iter, step)
        self.current_step = step
        return rate

    def _apply_update(self, params, diffs: Sequence[jax.Array], history: Sequence[History], scalars):
        """ClipGradients, then per learnable blob Normalize, Regularize, ComputeUpdateValue and Update.

        ``diffs`` are the accumulated param diffs in learnable order. Returns (new params, new history,
        update values, the diffs' L2 norm before clipping). Only clipping reads the norm: without it the norm is
        0, not summed (its squares cost LeNet's iteration at batch 1 a fifth of its time: 5.7 -> 4.5 ms).
        """
        p = self.param
        norm = jnp.zeros((), jnp.float32)
        if p.clip_gradients >= 0:
            norm = jnp.sqrt(sum((jnp.sum(d * d) for d in diffs), norm))
            clip = np.float32(p.clip_gradients)
            scale = jnp.where(norm > clip, clip / norm, np.float32(1))
            diffs = [d * scale for d in diffs]
        new_params = {name: list(blobs) for name, blobs in params.items()}
        new_history, updates = [], []
        for learnable, diff, hist in zip(self._learnables, diffs, history):
            weights = params[learnable.layer][learnable.index]
            if p.iter_size != 1:
                diff = diff * np.float32(1.0 / p.iter_size)
            diff = self._regularize(diff, weights, learnable)
            local_rate = scalars["rate"] * np.float32(learnable.lr_mult)
            update, hist = self.compute_update_value(diff, hist, local_rate, scalars)
            new_params[learnable.layer][learnable.index] = weights - update
            new_history.append(tuple(hist))
            updates.append(update)
        return new_params, new_history, updates, norm

    def _regularize(self, diff, weights, learnable: Learnable):
        local_decay = np.float32(self.param.weight_decay) * np.float32(learnable.decay_mult)
        if not local_decay:
            return diff
        if self.param.regularization_type == "L2":
            return diff + local_decay * weights
        return diff + local_decay * jnp.sign(weights)

    # -- one training iteration as one program -----------------------------------------------------------------
    def _step_program(self, learnt: frozenset[str] = frozenset()):
        """The jitted iteration for the net's current graph (one per input-shape signature), handing back the
        ``learnt`` blobs too (:meth:`_learnt_reads`)."""
        net = self.net
        cache_key = ("step", net._signature(net.graph), learnt)
        fn = self._programs.get(cache_key)
        if fn is None:
            def counted_step(program, device_axis=None, returned=None):
                build = _train_step_fn(program, self, device_axis, returned)

                def counted(*args):
                    self.compile_count += 1
                    return build(*args)

                return counted

            # The history is the solver's alone: the step writes the new one over it (AlexNet's iteration at
            # batch 1 peaked at 2.8 GB RSS instead of 3.3). The weights are not given up: the blobs the step
            # deferred are recomputed from them when read. The new weights go into the buffers of the weights
            # before them instead (_spare_weights), given up as an argument the step does not read.
            if self._parallel is not None:
                fn = self._parallel.train_step(net, counted_step)
            else:
                # Not the history where a Python layer may size its tops by the data: the step then fails
                # (TopsSizedByData) after giving it up, and the iteration runs again by passes.
                # It folds the pass count into the seed's key itself (net._folding_key): (params, history, fed,
                # pulled, seed key, count, scalars, spare).
                step = _folding_key(counted_step(net._program, returned=self._returned_blobs(learnt)), 4)
                fn = jit_through_cache(_into_spare(step), options=compiler_options(net.graph, backward=True,
                                                                                   dtype=net._dtype),
                                       describe=lambda: self._step_description(learnt), keep_unused=True,
                                       donate_argnums=(7,) if self._tops_may_be_sized_by_data else (1, 7))
            self._programs[cache_key] = fn
        return fn

    def _step_description(self, learnt: frozenset[str] = frozenset()) -> list[bytes | str] | None:
        """What one iteration's program computes, for the program cache: a new process then loads it instead of
        tracing the step (GoogLeNet at batch 16: about 2 s). None where its arguments may change structure
        (carried RNN state present or not), or where code outside caffejax decides it (a solver subclass)."""
        net = self.net
        if type(self).__module__ != __name__ or any(layer.state_in for layer in net.graph.layers):
            return None
        described = describe_graph(net.graph, net._program.kernels)
        if described is None:
            return None
        returned = self._returned_blobs(learnt)
        return ["solver-step", type(self).__name__, self.param.SerializeToString(deterministic=True),
                repr(None if returned is None else sorted(returned)), repr(net.channels_last), *described]

    def _returned_blobs(self, learnt: frozenset[str] = frozenset()) -> set[str] | None:
        """The blobs one iteration's program hands back (None: all): with one pass an iteration, what a forward
        would (``Net._returned_values``) and the ``learnt`` ones; the others are recomputed when read. Written out
        by the step, every blob made MobileNet v2's iteration at batch 16 take 2.1x the time (1.3x with their
        buffers reused)."""
        if self.param.iter_size != 1:
            return None  # the last pass's inputs include the state the passes before it carried
        values = self.net._returned_values(self.net.graph.layers)
        return {blob for blob, value in self.net.graph.blob_value.items() if value in values or blob in learnt}

    def _learnt_reads(self) -> frozenset[str]:
        """The train net's blobs read after each of the last two passes over the whole net (its iterations and
        forwards), which this iteration hands back, as Net.forward does (Net._handed_back): a training loop
        reading a blob after every step had the step's forward run again for it each time. Empty where the
        iteration hands back every blob anyway (iter_size above 1, several devices)."""
        net = self.net
        learnt = net._learnt_blobs(0, len(net.graph.layers) - 1)
        if self._parallel is not None or self.param.iter_size != 1:
            return frozenset()
        return frozenset(blob for blob in learnt if blob in net.graph.blob_value)

    def _pull_batches(self) -> list[dict[str, np.ndarray]] | None:
        """iter_size batches from the train net's data layers, one per pass (Caffe pulls one per pass): top ->
        array. None where the net has no data layer that reads its own batches.

        Over several devices, a pass's batch is one per device, and the net's blobs get the last of them.
        """
        net = self.net
        pulled = _pulled_layers(net.graph)
        if not pulled:
            return None

        def pull():
            net._pull_batches(pulled)
            return {top: np.array(net.blobs[top].data) for layer in pulled for top in layer.tops}

        batches = []
        for _ in range(self.param.iter_size):
            batches.append(pull() if self._parallel is None else self._parallel.pass_batch(pull))
        if self._parallel is not None:
            for top, array in batches[-1].items():
                net.blobs[top].reshape(array.shape)
                net.blobs[top]._data.set(array)
        return batches

    def _train_iteration(self, rate: float):
        """Forward/backward iter_size times and apply the update; returns (loss, gradient norm) on device. Passes
        whose batches differ in shape (a data layer serving images of their own size) run one by one."""
        net = self.net
        batches = self._pull_batches()
        if net._staging:
            # Compiled layers read what a layer run on the host makes (Faster R-CNN's ROI pooling): the passes run
            # in stages around it (Net.forward, Net.backward), then the update.
            if self._parallel is not None:
                check_one_program(net.graph.layers)  # each device would run the host layer on its rows
            return self._train_iteration_by_passes(rate, batches)
        stacked = {}
        for top in batches[0] if batches else ():
            shapes = {b[top].shape for b in batches}
            if len(shapes) > 1 and self._parallel is None:
                return self._train_iteration_by_passes(rate, batches)
            if len(shapes) > 1:
                raise DataError(f"iter_size {self.param.iter_size}: the batches of '{top}' differ in shape "
                                f"({sorted(shapes)}); over several devices one iteration needs equal shapes")
            stacked[top] = np.stack([b[top] for b in batches])
        # (Over several devices no layer moves to the host for reading fed blobs of new shapes: one program runs.)
        moved = net._sync_shapes(learn_host_layers=self._parallel is None)
        if net.graph.deferred_errors and net._learn_layers_sizing_by_data():
            net.reshape()
            moved = True
        if moved:  # they run on the host now, in stages around them: so does this iteration
            return self._train_iteration_by_passes(rate, batches)
        graph = net.graph
        pulled_values = {top: value for layer in _pulled_layers(graph)
                         for top, value in zip(layer.tops, layer.top_values)}
        fed = {v: a for v, a in net._feed(graph.layers).items() if v not in pulled_values.values()}
        if self._parallel is None:  # carried layer state (RNN/LSTM's h_T) is kept per net on one device
            fed.update(net._read_state(graph.layers))
        pulled = {pulled_values[top]: array for top, array in stacked.items()}
        learnt = self._learnt_reads()
        fn = self._step_program(learnt)
        before = net.param_arrays()
        scalars = self.step_scalars(rate)
        if self._parallel is None:
            seed_key, count = net._next_pass()
            key = _PassKey(seed_key, count)
            before, fed, pulled, scalars, count = to_device((before, fed, pulled, scalars, count))
            spare = self._spare_weights(before)
            try:
                with net._python_layers:
                    outputs = fn(before, self._history, fed, pulled, seed_key, count, scalars, spare)
                    if self._tops_may_be_sized_by_data:
                        jax.block_until_ready(outputs)  # a Python layer's failure surfaces here, typed
            except TopsSizedByData:
                # A Python layer's forward sized its tops by the data (py-faster-rcnn's ProposalLayer): the net
                # rebuilt runs it on the host, and this iteration by passes around it, on the batches pulled
                # (its first host call takes the tops that forward made). The history was not given up.
                net._forget_deferred_blobs()
                net.reshape()
                return self._train_iteration_by_passes(rate, batches)
            except BaseException:
                net._forget_deferred_blobs()  # the last iteration's, computed from the weights given up
                raise
            self._spare = before
        else:
            key = net._next_key()
            outputs = fn(before, self._history, fed, pulled, key, scalars)
        params, history, loss, updates, blobs, state, norm = outputs
        self._history = history
        self._write_back(params, [new[0] if update is None else update for update, new in zip(updates, history)])
        for name, value in blobs.items():
            net.blobs[name]._data.set(value)
        net._watch_reads(learnt & blobs.keys(), net._reads_after(0, len(graph.layers) - 1))  # (see _learnt_reads)
        read = {**fed, **{v: a[0] for v, a in pulled.items()}}
        made_on_host = net._run_host_layers(graph.layers, {graph.blob_value[name]: value for name, value in
                                                           blobs.items()}, read) if net._host_layers else set()
        # The Python layers' tops the blobs hold, as Net.forward records them: debug_nans' replay and a
        # net.backward() after the step take them instead of running those layers again.
        python_tops = set(_python_top_values(graph.layers))
        if python_tops:
            net._recorded_tops = {value: blobs[blob] for blob, value in graph.blob_value.items()
                                  if value in python_tops and blob in blobs}
        # Blobs the program did not hand back (_returned_blobs: only ever with one pass an iteration, whose key
        # train_step folds 0 into) are recomputed when read.
        unreturned = {blob: value for blob, value in graph.blob_value.items()
                      if blob not in blobs and value not in fed and value not in pulled and value not in made_on_host}
        # The key of that pass, as Net.forward notes its own: a net.backward() after the step, and find_first_nan's
        # replay, run the layers again with it (Dropout's masks of the step).
        pass_key = _PassKey(key, 0)
        net._defer_blobs(0, len(graph.layers) - 1, unreturned, before, read, pass_key)
        net._note_pass(0, len(graph.layers) - 1, read)
        net._note_pass_key(0, len(graph.layers) - 1, pass_key)
        net._state.update(state)
        return loss, norm

    @property
    def _tops_may_be_sized_by_data(self) -> bool:
        """Whether a Python layer of the train net not yet run on the host may find its tops sized by the data
        in a step (build.may_size_tops_by_data)."""
        return any(not layer.runs_on_host and may_size_tops_by_data(layer.proto, layer.params, layer.is_input)
                   for layer in self.net.graph.layers)

    def _spare_weights(self, weights) -> list:
        """Buffers for the iteration's new learnable weights, given up to it: those the last iteration started
        from (``self._spare``, held otherwise only by the blobs it deferred, which this iteration sets anew), or
        new ones where there are none (the first iteration) or something else holds them (the user, e.g.
        through ``param_arrays()``).

        Written into fresh buffers, the new weights were paged in on every iteration: Solver.step(1) of AlexNet
        at batch 16 took 60 thousand page faults (its 244 MB of weights) and 420-470 ms, and after another big
        program had run in the process, 205 thousand and 756-786 ms; into these, 2.4 thousand (its input batch)
        and 386-398 ms. Giving up the weights themselves instead made XLA copy them first (the update would
        overwrite them while the backward still reads them), and the deferred blobs need them."""
        last, self._spare = self._spare, None
        spare = []
        for learnable in self._learnables:
            new = weights[learnable.layer][learnable.index]
            try:
                old = last[learnable.layer][learnable.index]
            except (KeyError, IndexError, TypeError):  # none yet, or the net's params changed since
                old = None
            # References to an unheld one: its list in ``last``, ``old`` and getrefcount's argument.
            unheld = (isinstance(old, jax.Array) and old.shape == new.shape and old.dtype == new.dtype
                      and sys.getrefcount(old) <= _UNHELD_SPARE)
            spare.append(old if unheld else jnp.zeros_like(new))
        return spare

    def _write_back(self, params, updates) -> None:
        """New weights into the blobs' data, the update values into their diffs (as after Net::Update)."""
        for learnable, update in zip(self._learnables, updates):
            blob = self.net.params[learnable.layer][learnable.index]
            blob._data.set(params[learnable.layer][learnable.index])
            blob._diff.set(update)

    def _train_iteration_by_passes(self, rate: float, batches: list[dict[str, np.ndarray]] | None = None):
        """One iteration as Caffe's Solver::Step runs it: on_start, iter_size forward and backward passes of the
        net accumulating the param diffs, on_gradients_ready, the update. For the callbacks, and for passes whose
        batches differ in shape: ``batches`` holds each pass's batch, already pulled (else each forward pulls its
        own)."""
        net = self.net
        if self._parallel is not None:  # layer callbacks set on the train net after the solver was made
            raise UnsupportedError("layer callbacks on a solver's net over several devices: the devices run one "
                                   "fused program, with no point between layers to call back")
        net.clear_param_diffs()
        for on_start, _ in self._callbacks:
            on_start()
        loss = 0.0
        for k in range(self.param.iter_size):
            with net._keeping_pullbacks():  # each backward pass runs from its forward's pullback
                with _serving(net, batches[k]) if batches else contextlib.nullcontext():
                    net.forward()
                net.backward()
            if net.debug_info:
                log_param_norms(net)  # the end of Net::Backward(), which ForwardBackward calls
            loss += net._last_loss
        for _, on_gradients_ready in self._callbacks:
            on_gradients_ready()
        norm = self._update_from_diffs(rate)
        return np.float32(loss / self.param.iter_size), norm

    def apply_update(self) -> None:
        """Caffe's ApplyUpdate on the diffs already in the net's param blobs (after net.backward())."""
        rate = self._learning_rate()
        if self._displays(self.iter):
            self._say("Iteration %d, lr = %s", self.iter, log_float(rate))
        self._log_clipping(self._update_from_diffs(rate))

    def _update_from_diffs(self, rate: float):
        """The update from the param blobs' diffs: new weights, and the update values in the diffs; returns the
        gradient's norm (for clip_gradients' log)."""
        cache_key = ("apply_update",)
        fn = self._programs.get(cache_key)
        if fn is None:
            def counted(*args):
                self.compile_count += 1
                return self._apply_update(*args)

            fn = self._programs[cache_key] = jax.jit(counted)
        diffs = [self.net.params[l.layer][l.index]._diff.value() for l in self._learnables]
        params, self._history, updates, norm = fn(self.net.param_arrays(), diffs, self._history,
                                                  self.step_scalars(rate))
        self._write_back(params, updates)
        return norm

    # -- action requests (Solver::GetRequestedAction) -----------------------------------------------------------
    ACTIONS = ("none", "snapshot", "stop")

    def set_action_function(self, function) -> None:
        """Solver::SetActionFunction: ``function()`` is asked after every iteration and before every test batch
        and returns ``"none"``, ``"snapshot"`` (snapshot now) or ``"stop"`` (end the training: step() returns
        and solve() takes its final snapshot and says "Optimization stopped early."). None removes it."""
        if function is not None and not callable(function):
            raise CaffejaxError(f"set_action_function takes a function returning one of {self.ACTIONS}, got "
                                f"{function!r}")
        self._action_function = function

    def _requested_action(self) -> str:
        if self._action_function is None:
            return "none"
        action = self._action_function()
        if action not in self.ACTIONS:
            raise CaffejaxError(f"the solver's action function returned {action!r}; it must return one of "
                                f"{self.ACTIONS}")
        return action

    @property
    def requested_early_exit(self) -> bool:
        """Whether the action function stopped the last step() or solve() early."""
        return self._requested_early_exit

    # -- the loop (Solver::Step / Solve) ------------------------------------------------------------------------
    def step(self, iters: int) -> None:
        """Run ``iters`` training iterations (testing, displaying and snapshotting on the way)."""
        p = self.param
        stop_iter = self.iter + int(iters)
        self._losses = SmoothedLoss(p.average_loss)
        self._requested_early_exit = False
        timer, iterations_last = time.perf_counter(), self.iter
        while self.iter < stop_iter:
            if p.test_interval and self.iter % p.test_interval == 0 and (self.iter > 0 or p.test_initialization):
                self.test_all()
                if self._requested_early_exit:
                    break  # a stop asked for while testing
            # Solver::Step: the solver's debug_info logs the train net's layers on display iterations only.
            self.net.debug_info = p.debug_info and self._displays(self.iter)
            rate = self._learning_rate()
            start_params = self.net.param_arrays() if self.debug_nans else None
            with self.net._passes, self.net._python_layers, DeviceMemoryErrors(self.net.graph):
                loss, norm = (self._train_iteration_by_passes(rate)
                              if self._callbacks or self.net._runs_layer_by_layer() else self._train_iteration(rate))
                if any(calls_back(layer) for layer in self.net.graph.layers):
                    jax.block_until_ready(loss)  # a Python layer's failure surfaces here, as its typed error
            if self.debug_nans:
                self._check_finite(loss, start_params)
            self._losses.add(loss)
            if self._displays(self.iter):
                lapse = time.perf_counter() - timer
                per_s = (self.iter - iterations_last) / (lapse or 1)
                self._say("Iteration %d (%s iter/s, %ss/%d iters), loss = %s", self.iter, log_float(per_s),
                          log_float(lapse), p.display, log_float(self.smoothed_loss))
                timer, iterations_last = time.perf_counter(), self.iter
                self._log_outputs(self.net, "Train", output_scores(self.net))
                self._say("Iteration %d, lr = %s", self.iter, log_float(rate))
                self._log_clipping(norm)
            self.iter += 1
            request = self._requested_action()
            if (p.snapshot and self.iter % p.snapshot == 0 or request == "snapshot") and self._is_root_process:
                self.snapshot()
            if self._progress is not None:
                self._progress.update(self.iter)
            if request == "stop":
                self._requested_early_exit = True
                break

    def _check_finite(self, loss, start_params) -> None:
        """debug_nans: raise NumericalError naming where NaN/Inf first appeared in this iteration."""
        from caffejax.runtime.debug_nans import find_first_nan

        if not np.isfinite(float(loss)):
            found = find_first_nan(self.net, params=start_params, recorded=self.net._recorded_tops)
            raise NumericalError(f"iteration {self.iter}: the loss is {float(loss)}: "
                                 + (str(found) if found else "no single layer does when replayed eagerly"))
        for learnable in self._learnables:
            if not np.all(np.isfinite(np.asarray(self.net.params[learnable.layer][learnable.index].data))):
                raise NumericalError(f"iteration {self.iter}: the update made learnable blob {learnable.index} of "
                                     f"layer '{learnable.layer}' NaN/Inf with a finite loss (a too large base_lr? "
                                     "try clip_gradients)")

    def solve(self, resume_file: str | None = None) -> None:
        """Train to ``max_iter`` (after restoring ``resume_file``), then snapshot, display and test."""
        p = self.param
        self._say("Solving %s", self.net.graph.name)
        self._say("Learning Rate Policy: %s", p.lr_policy)
        if resume_file:
            self._say("Restoring previous solver status from %s", resume_file)
            self.restore(resume_file)
        self._progress = _Progress.for_stderr(self.iter, p.max_iter)
        try:
            self.step(p.max_iter - self.iter)
        finally:
            if self._progress is not None:
                self._progress.clear()
            self._progress = None
        if p.snapshot_after_train and (not p.snapshot or self.iter % p.snapshot != 0) and self._is_root_process:
            self.snapshot()
        if self._requested_early_exit:
            self._say("Optimization stopped early.")
            return
        if self._displays(self.iter):
            self.net.forward()  # only to display the loss of the final weights
            self._losses.add(self.net._last_loss)
            self._say("Iteration %d, loss = %s", self.iter, log_float(self.smoothed_loss))
        if p.test_interval and self.iter % p.test_interval == 0:
            self.test_all()
        self._say("Optimization Done.")

    @property
    def smoothed_loss(self) -> float:
        """The loss of the last ``average_loss`` iterations of this step() call, averaged as Caffe's
        UpdateSmoothedLoss does (:class:`SmoothedLoss`)."""
        return self._losses.value

    @property
    def _is_root_process(self) -> bool:
        """Over several hosts only the first process writes snapshots (Caffe: the root solver)."""
        return self._parallel is None or self._parallel.is_root_process

    def _displays(self, iter: int) -> bool:
        return bool(self.param.display) and iter % self.param.display == 0

    # -- testing (Solver::Test) ------------------------------------------------------------------------------------
    def test_all(self) -> list[list[float]]:
        """Test every test net, in order; a stop requested while testing skips the nets after it."""
        scores, self._requested_early_exit = [], False
        for i in range(len(self.test_nets)):
            if self._requested_early_exit:
                break
            scores.append(self.test(i))
        return scores

    def test(self, test_net_id: int = 0) -> list[float]:
        """Score test net ``test_net_id`` over test_iter batches; returns the mean of every output element."""
        p = self.param
        self._say("Iteration %d, Testing net (#%d)", self.iter, test_net_id)
        test_net = self.test_nets[test_net_id]
        test_net.share_with(self.net)
        iters = p.test_iter[test_net_id]
        totals, loss = None, np.float32(0)
        for batch in range(iters):
            # One request per batch: Caffe asks until the answer is "none", which never ends for a function that
            # always asks for a snapshot; a second pending signal is seen at the next batch instead.
            request = self._requested_action()
            if request == "snapshot" and self._is_root_process:
                self.snapshot()
            if request == "stop":
                self._requested_early_exit = True
                self._say("Test interrupted.")
                return self.mean_scores[test_net_id]
            test_net.forward()
            if p.test_compute_loss:
                loss += np.float32(test_net._last_loss)
            scores = output_scores(test_net)
            totals = summed_scores(totals, scores, batch)
        if p.test_compute_loss:
            self._say("Test loss: %s", log_float(loss / iters))
        names = [(name, weight) for name, weight, _ in scores] if totals is not None else []  # the last batch's
        means = [] if totals is None else [float(v) for v in totals / np.float32(iters)]
        self.mean_scores[test_net_id] = means
        self._log_outputs(test_net, "Test", [(n, w, m) for (n, w), m in zip(names, means)])
        return means

    def _log_outputs(self, net: Net, kind: str, scores) -> None:
        for i, (name, weight, value) in enumerate(scores):
            weighted = np.float32(weight) * np.float32(value)
            suffix = f" (* {log_float(weight)} = {log_float(weighted)} loss)" if weight else ""
            self._say("    %s net output #%d: %s = %s%s", kind, i, name, log_float(value), suffix)

    def _log_clipping(self, norm) -> None:
        clip = self.param.clip_gradients
        if clip >= 0 and self.param.display:
            norm = float(norm)
            if norm > clip:
                self._say("Gradient clipping: scaling down gradients (L2 norm %s > %s) by scale factor %s",
                          log_float(norm), log_float(clip), log_float(clip / norm))

    # -- snapshots ------------------------------------------------------------------------------------------------
    def snapshot(self) -> str:
        """Write ``<prefix>_iter_N.caffemodel`` and ``.solverstate`` (or the HDF5 pair); returns the state path."""
        p = self.param
        hdf5 = p.snapshot_format == caffe_pb2.SolverParameter.HDF5
        model_ext, state_ext = ((snapshots.HDF5_MODEL, snapshots.HDF5_STATE) if hdf5
                                else (snapshots.BINARY_MODEL, snapshots.BINARY_STATE))
        model_file = snapshots.snapshot_filename(p.snapshot_prefix, self.iter, model_ext)
        state_file = snapshots.snapshot_filename(p.snapshot_prefix, self.iter, state_ext)
        kind = "HDF5 file" if hdf5 else "binary proto file"
        self._say("Snapshotting to %s %s", kind, model_file)
        (snapshots.write_model_hdf5 if hdf5 else snapshots.write_model_binary)(self.net, model_file,
                                                                                 p.snapshot_diff)
        self._say("Snapshotting solver state to %s %s", kind, state_file)
        state = snapshots.SolverStateData(iter=self.iter, current_step=self.current_step,
                                          history=self._flat_history(), learned_net=model_file)
        (snapshots.write_state_hdf5 if hdf5 else snapshots.write_state_binary)(state_file, state)
        return state_file

    def _flat_history(self) -> list[np.ndarray]:
        # Caffe's history_: the first blob of every param, then (AdaDelta, Adam) the second of every param.
        return [np.asarray(hist[k]) for k in range(self.history_per_param) for hist in self._history]

    def restore(self, state_file: str) -> None:
        """Solver::Restore: the iteration, the lr schedule's step, the history and the learned weights."""
        state_file = os.fspath(state_file)
        state = snapshots.read_state(state_file)
        n = len(self._learnables)
        if len(state.history) != n * self.history_per_param:
            raise SolverError(f"{state_file}: Incorrect length of history blobs: the file has {len(state.history)}, "
                              f"a {self.type} solver of this net needs {n * self.history_per_param}")
        history = []
        for i, learnable in enumerate(self._learnables):
            blobs = []
            for k in range(self.history_per_param):
                array = state.history[k * n + i]
                if array.size != math.prod(learnable.shape):
                    raise SolverError(f"{state_file}: history blob {k * n + i} has shape {array.shape}; param "
                                      f"{learnable.index} of layer '{learnable.layer}' is {learnable.shape}")
                blobs.append(jax.device_put(np.asarray(array, np.float32).reshape(learnable.shape)))
            history.append(tuple(blobs))
        if state.learned_net:
            model_file = snapshots.resolve_learned_net(state.learned_net, state_file)
            try:
                self.net.copy_from(model_file)
            except WeightsError as e:  # the model file's own message, said to come from this state
                raise type(e)(f"{state_file}: its learned_net: {e}") from None
        self.iter, self.current_step, self._history = state.iter, state.current_step, history

    # -- pycaffe odds and ends ----------------------------------------------------------------------------------
    def share_weights(self, net: Net) -> None:
        """pycaffe's ``solver.share_weights(net)``: ``net`` uses the train net's weights."""
        net.share_with(self.net)

    def add_callback(self, on_start, on_gradients_ready=None) -> None:
        """pycaffe's ``solver.add_callback(on_start, on_gradients_ready)``: each iteration calls ``on_start()``
        before its forward/backward passes and ``on_gradients_ready()`` once the param diffs hold the gradient,
        before the update (Solver::Step). An object with those two methods (Caffe's callback) works too.

        An iteration is one program, with no point between its backward and its update to call back into
        Python; with callbacks set, an iteration runs as Caffe's does instead: ``net.forward()`` and
        ``net.backward()`` per pass (layer by layer if the net has layer callbacks), then the update from the
        param diffs (``apply_update``). The arithmetic is the same; it is slower, and a pass's Dropout masks
        are drawn from the net's own stream rather than the fused program's."""
        if self._parallel is not None:
            raise UnsupportedError(f"solver.add_callback over several devices: {self._parallel.mesh.size} devices "
                                   "run one fused program; there is no point between passes to call back")
        if on_gradients_ready is None and hasattr(on_start, "on_gradients_ready"):
            on_start, on_gradients_ready = on_start.on_start, on_start.on_gradients_ready
        for name, fn in (("on_start", on_start), ("on_gradients_ready", on_gradients_ready)):
            if not callable(fn):
                raise TypeError(f"solver.add_callback: {name} must be callable, got {type(fn).__name__}")
        self._callbacks.append((on_start, on_gradients_ready))

    def _say(self, fmt: str, *args) -> None:
        if self._progress is not None:
            self._progress.clear()
        log.info(fmt, *args, stacklevel=2)  # the line that said it, in the log's file:line


class SGDSolver(Solver):
    """Stochastic gradient descent with momentum: ``V = momentum V + lr g``; ``w -= V``."""

    type = "SGD"

    def compute_update_value(self, diff, history, local_rate, scalars):
        momentum = np.float32(self.param.momentum)
        velocity = local_rate * diff + momentum * history[0]
        return velocity, (velocity,)


class NesterovSolver(SGDSolver):
    """Nesterov's accelerated gradient: ``V' = momentum V + lr g``; ``w -= (1 + momentum) V' - momentum V``."""

    type = "Nesterov"

    def compute_update_value(self, diff, history, local_rate, scalars):
        momentum = np.float32(self.param.momentum)
        velocity = local_rate * diff + momentum * history[0]
        return (momentum + np.float32(1)) * velocity - momentum * history[0], (velocity,)


class AdaGradSolver(SGDSolver):
    """AdaGrad: ``H += g^2``; ``w -= lr g / (sqrt(H) + delta)``."""

    type = "AdaGrad"

    def _check_param(self) -> None:
        super()._check_param()
        if self.param.momentum != 0:
            raise SolverError("Momentum cannot be used with AdaGrad.")

    def compute_update_value(self, diff, history, local_rate, scalars):
        squares = history[0] + diff * diff
        return _rms_scaled(diff, squares, local_rate, self.param.delta), (squares,)


class RMSPropSolver(SGDSolver):
    """RMSProp: ``H = rms_decay H + (1 - rms_decay) g^2``; ``w -= lr g / (sqrt(H) + delta)``."""

    type = "RMSProp"

    def _check_param(self) -> None:
        super()._check_param()
        if self.param.momentum != 0:
            raise SolverError("Momentum cannot be used with RMSProp.")
        if not 0 <= self.param.rms_decay < 1:
            raise SolverError(f"rms_decay should lie between 0 and 1, got {self.param.rms_decay}")

    def compute_update_value(self, diff, history, local_rate, scalars):
        decay = np.float32(self.param.rms_decay)
        squares = (np.float32(1) - decay) * (diff * diff) + decay * history[0]
        return _rms_scaled(diff, squares, local_rate, self.param.delta), (squares,)


def _rms_scaled(diff, squares, local_rate, delta):
    """AdaGrad's and RMSProp's step: ``lr g / (sqrt(H) + delta)``."""
    return local_rate * (diff / (jnp.sqrt(squares) + np.float32(delta)))


class AdaDeltaSolver(SGDSolver):
    """AdaDelta: history of squared gradients and of squared updates, both decaying by ``momentum``."""

    type = "AdaDelta"
    history_per_param = 2

    def compute_update_value(self, diff, history, local_rate, scalars):
        momentum, delta = np.float32(self.param.momentum), np.float32(self.param.delta)
        one = np.float32(1)
        gradient_squares = (one - momentum) * (diff * diff) + momentum * history[0]
        step = diff * jnp.sqrt((delta + history[1]) / (delta + gradient_squares))
        update_squares = (one - momentum) * (step * step) + momentum * history[1]
        return local_rate * step, (gradient_squares, update_squares)


class AdamSolver(SGDSolver):
    """Adam: ``m``, ``v`` with beta1 = momentum, beta2 = momentum2; bias correction with t = iter + 1."""

    type = "Adam"
    history_per_param = 2

    def _check_param(self) -> None:
        super()._check_param()
        # Caffe does not check these; outside the ranges its bias correction divides by 0 or takes sqrt(< 0).
        if not 0 <= self.param.momentum < 1 or not 0 <= self.param.momentum2 <= 1:
            raise SolverError(f"Adam needs 0 <= momentum < 1 and 0 <= momentum2 <= 1 (momentum "
                              f"{self.param.momentum}, momentum2 {self.param.momentum2})")

    def step_scalars(self, rate: float) -> dict[str, np.float32]:
        # Caffe computes the correction in double from float betas, then keeps it as a float.
        t = self.iter + 1
        beta1, beta2 = self.param.momentum, self.param.momentum2
        correction = math.sqrt(1.0 - beta2 ** t) / (1.0 - beta1 ** t)
        return {"rate": np.float32(rate), "correction": np.float32(correction)}

    def compute_update_value(self, diff, history, local_rate, scalars):
        one = np.float32(1)
        beta1, beta2 = np.float32(self.param.momentum), np.float32(self.param.momentum2)
        m = (one - beta1) * diff + beta1 * history[0]
        v = (one - beta2) * (diff * diff) + beta2 * history[1]
        update = (local_rate * scalars["correction"]) * (m / (jnp.sqrt(v) + np.float32(self.param.delta)))
        return update, (m, v)


SOLVER_TYPES: dict[str, type[Solver]] = {cls.type: cls for cls in (SGDSolver, NesterovSolver, AdaGradSolver,
                                                                   RMSPropSolver, AdaDeltaSolver, AdamSolver)}


# ---- the traced iteration ----------------------------------------------------------------------------------------

def _pulled_layers(graph: Graph):
    """Data layers whose batches come from a DataSource (not written by the user)."""
    return [layer for layer in graph.layers if pulls_batches(layer)]


class _Served:
    """A data source that hands out one batch already pulled (a top's arrays, in the layer's top order)."""

    def __init__(self, arrays: list[np.ndarray]):
        self.arrays = arrays

    def next_batch(self) -> list[np.ndarray]:
        return self.arrays

    def close(self) -> None:
        pass


@contextlib.contextmanager
def _serving(net: Net, batch: dict[str, np.ndarray]):
    """The net's data layers serve ``batch`` (top -> array) on the next forward instead of reading their own."""
    layers = _pulled_layers(net.graph)
    sources = {layer.name: net._data_source(layer) for layer in layers}  # their own, put back after
    for layer in layers:
        net._sources[layer.name] = _Served([batch[top] for top in layer.tops])
    try:
        yield
    finally:
        net._sources.update(sources)


_UNHELD_SPARE = 3


def _into_spare(step):
    """``step`` taking one argument more, last, ``spare``: arrays shaped as its new weights, which it does not
    read. Given up (donated, and kept although unused), their buffers take the new weights: XLA writes outputs
    into donated buffers of their shape (Solver._spare_weights; bench.run's training step too)."""
    def step_into_spare(*args):
        return step(*args[:-1])

    return step_into_spare


def _train_step_fn(program, solver: Solver, device_axis: str | None = None, returned=None):
    """``(params, history, fed, pulled, key, scalars) -> (params, history, loss, updates, blobs, state, norm)``.
    Without ``device_axis``, an update that is its blob's new history (SGD's) comes back as None.

    ``fed`` holds the blobs the user wrote (every pass reads the same ones) and the state layers carry
    between forwards; ``pulled`` holds one batch per pass, stacked along a leading axis of length iter_size.
    ``blobs`` are the values the last pass left in the net's blobs (only those named in ``returned``, if given),
    ``state`` what it left for the next forward (each pass reads the one before it, as Caffe's consecutive
    ForwardBackward calls do).

    With ``device_axis`` this is one device's iteration inside ``shard_map`` (caffejax.runtime.distributed):
    the device's index is folded into the key, and the accumulated diffs, the loss and the params forward
    rewrote (BatchNorm's statistics) are averaged over the devices before ApplyUpdate, as Caffe's P2PSync does.
    Carried layer state is not kept across iterations there (each starts from zeros): ``state`` is empty.
    """
    iter_size = solver.param.iter_size
    graph = program.graph
    fed_values = {v for layer in graph.layers if layer.is_input for v in layer.top_values}
    made_on_host = graph.made_on_host  # run after the step (Solver._train_iteration)
    produced = {blob: value for blob, value in graph.blob_value.items()
                if value not in fed_values and blob not in made_on_host}
    concrete = dict(graph.concrete)  # shape-deciding values (Filter's selector): constants of this program

    def device_mean(tree):
        return tree if device_axis is None else jax.lax.pmean(tree, device_axis)

    def one_pass(params, inputs, key):
        """Net::ForwardBackward: the loss and param diffs, with the params forward rewrote (BatchNorm)."""
        # A step that hands back only some blobs folds the chains whose inner values blobs hold (they are among
        # the blobs recomputed when read).
        loss, grads, (env, rewritten) = program.loss_and_grads(params, inputs, key, fold_visible=returned is not None)
        params = {name: list(blobs) for name, blobs in params.items()}
        for owner, changed in rewritten.items():
            for index, value in changed.items():
                params[owner][index] = device_mean(value)
        state = {} if device_axis is not None else {v: env[out] for v, out in graph.state.items() if out in env}
        return params, grads, loss, {blob: env[value] for blob, value in produced.items()
                                     if returned is None or blob in returned}, state

    def train_step(params, history, fed, pulled, key, scalars):
        fed = {**fed, **concrete}
        if device_axis is not None:
            key = jax.random.fold_in(key, jax.lax.axis_index(device_axis))
        if iter_size == 1:
            inputs = {**fed, **{v: a[0] for v, a in pulled.items()}}
            params, grads, loss, blobs, state = one_pass(params, inputs, jax.random.fold_in(key, 0))
        else:
            def accumulate(carry, xs):
                params, grads, loss, _, state = carry
                i, batch = xs
                params, pass_grads, pass_loss, blobs, state = one_pass(params, {**fed, **state, **batch},
                                                                       jax.random.fold_in(key, i))
                return (params, jax.tree.map(jnp.add, grads, pass_grads), loss + pass_loss, blobs, state), None

            first = {**fed, **{v: a[0] for v, a in pulled.items()}}
            blob_shapes, state_shapes = jax.eval_shape(one_pass, params, first, key)[3:]
            zeros = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)  # noqa: E731
            # A state the net has not produced yet enters the first pass as Caffe's zeros.
            state = {**zeros(state_shapes), **{v: fed[v] for v in state_shapes if v in fed}}
            init = (params, jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32),
                    zeros(blob_shapes), state)
            (params, grads, loss, blobs, state), _ = jax.lax.scan(
                accumulate, init, (jnp.arange(iter_size), pulled), length=iter_size)
        diffs = [grads[l.layer][l.index] for l in solver._learnables]
        diffs, loss = device_mean((diffs, loss))  # P2PSync: the sum over devices, scaled by 1 / devices
        params, history, updates, norm = solver._apply_update(params, diffs, history, scalars)
        if device_axis is None:
            # SGD's update is its new history (Caffe copies history_ into the diff): handed back once, as the
            # history (None here). A second output of the same value is a copy XLA makes, into fresh memory:
            # AlexNet's 244 MB every iteration.
            updates = [None if update is new[0] else update for update, new in zip(updates, history)]
        return params, history, loss / np.float32(iter_size), updates, blobs, state, norm

    return train_step


# ---- output ---------------------------------------------------------------------------------------------------

def _ensure_log_output() -> None:
    """Show the training log on stderr, where Caffe's shows (glog writes to stderr before InitGoogleLogging, and
    caffe.cpp sets alsologtostderr), unless the application configured logging itself. Not stdout: a script's
    own output there (``python train.py > scores.txt``) stays its own."""
    if log_to_stderr_unless_configured() and log.level == logging.NOTSET:
        log.setLevel(glog_level())


def output_scores(net: Net) -> list[tuple[str, float, float]]:
    """Every element of every output blob, in Caffe's order (outputs by name, then elements), with the blob's
    loss weight: what Caffe's Solver and caffe test log and average."""
    weights = net.blob_loss_weights
    return [(name, weights.get(name, 0.0), float(value)) for name in net.outputs
            for value in np.asarray(net.blobs[name].data).ravel()]


def summed_scores(totals: np.ndarray | None, scores, batch: int) -> np.ndarray:
    """``totals`` plus one batch's :func:`output_scores`, as Caffe's Solver::Test and caffe test sum them element by
    element. Outputs whose size changed between batches (SSD's detections) are a clear error, where Caffe would
    index past its sums."""
    values = np.asarray([score for _, _, score in scores], np.float32)
    if totals is None:
        return values
    if values.shape != totals.shape:
        raise CaffejaxError(f"batch {batch}: the outputs changed size ({values.size} values, {totals.size} before); "
                            "scoring needs the same output shapes on every batch")
    return totals + values


class SmoothedLoss:
    """Solver::UpdateSmoothedLoss in float32 (Caffe's Dtype): a running mean while fewer than ``average_loss``
    losses have come, then a running update that swaps the oldest loss for the newest. Its rounding is
    Caffe's: after losses 1e8, 1, 1 with average_loss 2 it shows 0 where the mean of the last two is 1.

    Losses may be device arrays still being computed; they are read when the value is (or every 1024 of
    them), so an iteration need not wait for the one before to finish.
    """

    FOLD_EVERY = 1024

    def __init__(self, average_loss: int):
        self.average_loss = int(average_loss)
        self._window: list[np.float32] = []  # losses_
        self._smoothed = np.float32(0)  # smoothed_loss_
        self._count = 0  # losses folded in: iter_ - start_iter when the next one comes
        self._pending: list[Any] = []

    def add(self, loss) -> None:
        self._pending.append(loss)
        if len(self._pending) >= self.FOLD_EVERY:
            self._fold()

    @property
    def value(self) -> float:
        self._fold()
        return float(self._smoothed)

    def _fold(self) -> None:
        for loss in self._pending:
            loss = np.float32(loss)
            if len(self._window) < self.average_loss:
                self._window.append(loss)
                size = np.float32(len(self._window))
                self._smoothed = (self._smoothed * (size - np.float32(1)) + loss) / size
            else:
                index = self._count % self.average_loss
                self._smoothed += (loss - self._window[index]) / np.float32(self.average_loss)
                self._window[index] = loss
            self._count += 1
        self._pending.clear()


class _Progress:
    """A one-line progress bar on a terminal's stderr for long solve() runs (cleared before log lines)."""

    WIDTH, INTERVAL_S = 30, 0.25

    def __init__(self, start: int, stop: int, stream):
        self.start, self.stop, self.stream = start, stop, stream
        self.began = self.shown = time.perf_counter()
        self.visible = False

    @classmethod
    def for_stderr(cls, start: int, stop: int) -> "_Progress | None":
        isatty = getattr(sys.stderr, "isatty", None)
        return cls(start, stop, sys.stderr) if stop > start and isatty is not None and isatty() else None

    def update(self, iter: int) -> None:
        now = time.perf_counter()
        if now - self.shown < self.INTERVAL_S and iter < self.stop:
            return
        self.shown = now
        done = (iter - self.start) / max(self.stop - self.start, 1)
        bar = "#" * int(done * self.WIDTH)
        rate = (iter - self.start) / max(now - self.began, 1e-9)
        self.stream.write(f"\r[{bar:<{self.WIDTH}}] {iter}/{self.stop} iters {rate:.1f} iter/s")
        self.stream.flush()
        self.visible = True

    def clear(self) -> None:
        if self.visible:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.visible = False
