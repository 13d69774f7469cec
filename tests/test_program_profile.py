"""caffejax.runtime.program_profile: a whole compiled program's time, charged to the layers its operations
come from."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import caffejax
from caffejax.runtime import program_profile
from caffejax.runtime.program_profile import (BACKWARD, BOTH, FORWARD, IDLE, NO_LAYER, Instruction,
                                              ProfileUnavailable, _share, charge, format_rows, op_sources,
                                              parse_hlo, profile_program)
from conftest import BUNDLED

LENET = BUNDLED / "lenet" / "lenet.prototxt"
LENET_WEIGHTS = BUNDLED / "lenet" / "lenet_iter_10000.caffemodel"


def _scoped_loss(w, x):
    with jax.named_scope("conv2_2/dwise"):  # a layer name with a '/' in it
        y = jnp.tanh(x @ w)
    with jax.named_scope("conv2_2"):        # a prefix of it, as a layer of its own
        y = jnp.sin(y)
    with jax.named_scope("conv+bn+scale"):  # a folded chain's scope
        y = y * 3.0
    return jnp.sum(y * y)


def _sources(fn, *args, layers):
    entry, computations = parse_hlo(jax.jit(fn).lower(*args).compile().as_text())
    return op_sources(entry, computations, layers)


def test_operations_are_charged_to_the_layers_and_pass_their_scopes_name():
    layers = ["conv2_2/dwise", "conv2_2", "conv", "bn", "scale", "unused"]
    args = (jnp.ones((8, 8)), jnp.ones((4, 8)))
    forward = _sources(_scoped_loss, *args, layers=layers)
    seen = {layer for source in forward.values() for layer in source.layers}
    assert seen == {"conv2_2/dwise", "conv2_2", "conv", "bn", "scale"}
    assert {source.part for source in forward.values() if source.layers} == {FORWARD}
    # Layers come in the net's order, whatever the order their operations were fused in.
    for source in forward.values():
        assert list(source.layers) == sorted(source.layers, key=layers.index)

    gradient = _sources(jax.grad(_scoped_loss), *args, layers=layers)
    parts = {source.part for source in gradient.values() if source.layers}
    assert BACKWARD in parts or BOTH in parts
    assert any("conv2_2/dwise" in source.layers and source.part in (BACKWARD, BOTH) for source in gradient.values())


def test_a_layer_named_like_a_primitive_or_a_prefix_is_not_matched_by_accident():
    def fn(x):
        with jax.named_scope("ip1"):
            return jnp.tanh(x) * 2.0
    sources = _sources(fn, jnp.ones(4), layers=["ip", "tanh", "mul", "ip1"])
    assert {layer for s in sources.values() for layer in s.layers} == {"ip1"}


def test_an_operation_xla_made_without_metadata_works_for_its_operands_layers():
    entry = [Instruction("x", "parameter", "inputs['data']", ()),
             Instruction("y", "fusion", "jit(f)/jvp(conv2)/mul", ("x",)),
             Instruction("dy", "fusion", "jit(f)/transpose(jvp(relu2))/mul", ("y",)),
             Instruction("dw", "convolution", "", ("y", "dy")),   # a filter gradient XLA rewrote
             Instruction("copy", "copy", "", ("x",)),               # a copy of the input: no layer
             Instruction("w", "parameter", "params['ip1'][0]", ()),
             Instruction("wt", "bitcast", "params['ip1'][0]", ("w",)),
             Instruction("product", "dot", "", ("y", "wt")),          # ip1's product, rewritten
             Instruction("update", "fusion", "jit(f)/sub", ("w", "dw"))]  # the weights' update: no layer
    sources = op_sources("main", {"main": entry}, ["data", "conv2", "relu2", "ip1"])
    assert sources["y"].layers == ("conv2",) and sources["y"].part == FORWARD
    assert sources["dw"].layers == ("conv2", "relu2") and sources["dw"].part == BACKWARD
    assert sources["copy"].layers == () and sources["copy"].part == ""
    assert sources["product"].layers == ("ip1",) and sources["product"].part == FORWARD
    assert sources["update"].layers == () and sources["update"].part == FORWARD


def test_share_splits_overlaps_and_counts_idle_time():
    shares, idle = _share({"a": (0, 10), "b": (5, 15), "c": (20, 30), "empty": (12, 12)})
    assert shares == pytest.approx({"a": 7.5, "b": 7.5, "c": 10.0, "empty": 0.0})
    assert idle == 5  # 15 -> 20


def test_an_asynchronous_convolution_runs_until_its_reader_starts():
    instructions = [Instruction("p", "parameter", "", ()),
                    Instruction("conv", "convolution", "", ("p",)),
                    Instruction("view", "bitcast", "", ("conv",)),  # untraced: looked through
                    Instruction("relu", "fusion", "", ("view",))]
    events = []
    for run in range(2):
        t = run * 1000
        events += [(t, t + 5, "conv"), (t + 100, t + 110, "relu"), (t + 50, t + 60, "unrelated event")]
    lengths, charged, idle = charge(events, instructions, runs=2)
    assert lengths == pytest.approx([110e-9, 110e-9])
    assert charged == [pytest.approx({"conv": 100e-9, "relu": 10e-9})] * 2
    assert idle == [0, 0]

    # A synchronous operation keeps its own span: the gap before the reader is the executor's.
    instructions[1] = Instruction("conv", "fusion", "", ("p",))
    lengths, charged, idle = charge(events, instructions, runs=2)
    assert charged[0] == pytest.approx({"conv": 5e-9, "relu": 10e-9})
    assert idle[0] == pytest.approx(95e-9)


@pytest.fixture(scope="module")
def lenet_program():
    net = caffejax.Net(str(LENET), str(LENET_WEIGHTS), caffejax.TEST)
    infer = caffejax.compile_inference(net)
    x = np.random.default_rng(0).random((4, 1, 28, 28), dtype=np.float32)
    infer({"data": x})
    program = infer._programs[infer._signature({"data": x.shape})]
    args = (program.params, {value: jax.device_put(x) for _, value in program.feeds})
    return program, args


def test_the_inference_program_of_lenet_is_charged_to_its_layers(lenet_program):
    program, args = lenet_program
    names = [layer.name for layer in program.plan.graph.layers]
    profile = profile_program(program.run, args, names, runs=3)
    assert profile.runs == 3 and profile.seconds > 0
    rows = profile.rows()
    # The rows share out each run: together they are its length.
    assert sum(row.seconds for row in rows) == pytest.approx(profile.seconds, rel=1e-6)
    charged = {layer for row in rows for layer in row.layers}
    assert {"conv1", "conv2", "ip1", "ip2", "prob"} <= charged
    assert all(row.part == FORWARD for row in rows if row.layers)
    assert rows[0].layers  # a layer's operation takes the most time, not XLA's copies nor the executor
    lines = format_rows(profile, top=3)
    assert len(lines) == 3 and all(" ms " in line for line in lines)
    assert NO_LAYER not in lines[0] and IDLE not in lines[0]


def test_profile_program_needs_a_run_and_the_profiler(lenet_program, tmp_path):
    program, args = lenet_program
    with pytest.raises(ValueError, match="runs must be >= 1"):
        profile_program(program.run, args, [], runs=0)
    with jax.profiler.trace(str(tmp_path)):  # the caller's own trace holds the profiler
        with pytest.raises(ProfileUnavailable, match="profiler cannot start"):
            profile_program(program.run, args, [], runs=1)


def test_a_program_is_traced_once_its_runs_page_nothing_in(lenet_program, monkeypatch):
    """A program's first calls in a process can page its big buffers in (a ReLU alone on 16x112x112x96: 100 ms a
    call over its first six, 5 ms after). The untraced runs go on until one pages in fewer than
    SETTLED_PAGE_FAULTS, and at least two run."""
    program, args = lenet_program
    faults_per_run = iter([5000, 5000, 5000, 3] + [0] * 100)
    counted = {"calls": 0, "faults": 0, "before_trace": None}

    def run(*a):
        counted["calls"] += 1
        counted["faults"] += next(faults_per_run)
        return program.run(*a)

    class Compiled:  # the program as profile_program sees it: its text, and calls counted
        as_text = staticmethod(lambda: program.run.as_text())
        __call__ = staticmethod(run)

    start_trace = jax.profiler.start_trace

    def noting_start(directory):
        counted["before_trace"] = counted["calls"]
        return start_trace(directory)

    monkeypatch.setattr(program_profile, "_page_faults", lambda: counted["faults"])
    monkeypatch.setattr(jax.profiler, "start_trace", noting_start)
    profile_program(Compiled(), args, ["conv1"], runs=2)
    assert counted["before_trace"] == 4 and counted["calls"] == 6
    # At least two untraced runs, even where the first pages in nothing; at most WARMUP_MAX_SECONDS of them.
    assert program_profile.warm_up(lambda: program.run(*args)) == 2
    faults_per_run = iter([5000] * 100000)
    began = time.perf_counter()
    assert program_profile.warm_up(lambda: run(*args), max_seconds=0.2) > 2
    assert 0.2 <= time.perf_counter() - began < 5
