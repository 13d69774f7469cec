"""Where a whole compiled program spends its time, charged to the Caffe layers its XLA operations come from.

Timing each layer compiled on its own (``caffejax time``'s per-layer lines, ``bench.profile``) misses what XLA
does to the whole program: it fuses element-wise layers into their neighbours (a ReLU into a convolution's
bias add, LeNet's first convolution into the max pooling after it), moves values between layouts, and runs
independent operations side by side. This module runs the compiled program under JAX's profiler and reads,
for every operation of the program's entry computation, when it ran:

- the program's optimised HLO (``compiled.as_text()``) names, for each operation, the JAX operations it was
  made of; their ``op_name`` metadata carries the ``jax.named_scope`` of the layer that traced them
  (``NetProgram.run_layers`` and ``run_plan`` open one per layer, ``conv+bn+scale`` for a folded chain), and
  ``transpose(...)`` around the scope marks the backward pass;
- the trace gives each operation's span on the CPU. XLA:CPU hands its own (Eigen) convolutions and dots to
  its thread pool and their span covers the hand-over only: such an operation is taken to run until the
  first operation reading its result starts. At each moment the operations running share the wall time
  equally, so the rows add up to the run's length; moments with none running are the executor's own.

``profile_program(compiled, args, layer_names)`` returns a :class:`ProgramProfile`; ``rows()`` sums it by
group of layers (the layers one operation fuses) and pass.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re
import tempfile
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

from caffejax.errors import CaffejaxError

FORWARD, BACKWARD, BOTH = "forward", "backward", "forward+backward"
NO_LAYER = "(no layer: the update of the weights, XLA's own copies, ...)"
IDLE = "(no operation running: the executor's own time)"

_COMPUTATION = re.compile(r"^(ENTRY )?%([^\s(]+) ")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%([^\s=]+) = ")
_OPCODE = re.compile(r" ([a-z][a-z0-9_-]*)\(")
_REFERENCE = re.compile(r"%([^\s,(){}=]+)")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
# The op_name of a program argument in a layer's entry of the params dict: params['conv1'][0].
_WEIGHTS = re.compile(r"^params\['((?:[^'\\]|\\.)*)'\]")
# Operations XLA:CPU runs on its thread pool and returns from at once (Eigen's convolutions and dots).
_ASYNC_OPCODES = frozenset({"convolution", "dot"})


class ProfileUnavailable(CaffejaxError):
    """The profiler gave no timings for the program's operations (no trace, or a backend whose trace does not
    name XLA's operations)."""


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    opcode: str
    op_name: str
    references: tuple[str, ...]  # operands and called computations


@dataclasses.dataclass(frozen=True)
class OpSource:
    """One operation of a program's entry computation: the layers whose JAX operations it computes (in the
    net's order; empty for code outside any layer) and the pass they belong to ("" where nothing names it)."""

    op: str
    layers: tuple[str, ...]
    part: str


@dataclasses.dataclass(frozen=True)
class ProfileRow:
    layers: tuple[str, ...]
    part: str
    seconds: float          # per run of the program
    ops: tuple[str, ...]    # the XLA operations charged

    @property
    def label(self) -> str:
        if not self.ops:
            return IDLE
        return "+".join(self.layers) if self.layers else NO_LAYER


@dataclasses.dataclass(frozen=True)
class ProgramProfile:
    runs: int
    seconds: float                      # one run, from its first operation's start to its last one's end
    op_seconds: dict[str, float]        # each operation's charged time per run
    idle_seconds: float                 # per run, with no operation running
    sources: dict[str, OpSource]

    def rows(self) -> list[ProfileRow]:
        """The charged times summed by (layers, pass), slowest first; the idle time as a row of no operation."""
        groups: dict[tuple[tuple[str, ...], str], list[str]] = collections.defaultdict(list)
        for op in self.op_seconds:
            source = self.sources.get(op) or OpSource(op, (), "")
            groups[source.layers, source.part].append(op)
        rows = [ProfileRow(layers, part, sum(self.op_seconds[op] for op in ops), tuple(ops))
                for (layers, part), ops in groups.items()]
        rows.append(ProfileRow((), "", self.idle_seconds, ()))
        return sorted(rows, key=lambda row: -row.seconds)


# ---- the optimised HLO: which layers each operation comes from ------------------------------------------------

def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", r"\1", text)


def parse_hlo(text: str) -> tuple[str, dict[str, list[Instruction]]]:
    """The entry computation's name, and every computation's instructions."""
    computations: dict[str, list[Instruction]] = {}
    entry: str | None = None
    current: list | None = None
    for line in text.splitlines():
        head = _COMPUTATION.match(line)
        if head and line.rstrip().endswith("{"):
            current = computations.setdefault(head.group(2), [])
            if head.group(1):
                entry = head.group(2)
            continue
        if line.startswith("}"):
            current = None
            continue
        instruction = _INSTRUCTION.match(line) if current is not None else None
        if instruction:
            rest = line[instruction.end():]
            opcode = _OPCODE.search(rest)
            op_name = _OP_NAME.search(rest)
            current.append(Instruction(instruction.group(1), opcode.group(1) if opcode else "",
                                       _unescape(op_name.group(1)) if op_name else "",
                                       tuple(_REFERENCE.findall(rest))))
    if entry is None:
        raise ProfileUnavailable("the compiled program's HLO has no entry computation")
    return entry, computations


def _layer_pattern(layer_names: Iterable[str]) -> re.Pattern | None:
    names = sorted(set(layer_names), key=len, reverse=True)  # the longest name first: conv2_2/dwise, not conv2_2
    if not names:
        return None
    # A scope sits between '/', '(' or '+' (a chain's scope joins its layers) and '/', ')' or '+'.
    return re.compile(r"(?<![^/(+])(?:" + "|".join(map(re.escape, names)) + r")(?![^/)+])")


def _scopes(op_name: str) -> str:
    """The scope part of an op_name: without the outer ``jit(...)`` and the primitive's own name."""
    if op_name.startswith("jit(") and "/" in op_name:
        op_name = op_name.split("/", 1)[1]
    return op_name.rsplit("/", 1)[0] if "/" in op_name else ""


def op_sources(entry: str, computations: Mapping[str, Sequence[Instruction]],
               layer_names: Sequence[str]) -> dict[str, OpSource]:
    """For each operation of the entry computation, the layers (in ``layer_names``' order) and pass of the JAX
    operations it was made from, through the computations it calls (fusions, loops); for one no JAX operation
    names, those of the operations that make its operands."""
    pattern = _layer_pattern(layer_names)
    order = {name: i for i, name in enumerate(layer_names)}

    def op_names(instruction: Instruction, seen: set[str]) -> list[str]:
        names = [instruction.op_name] if instruction.op_name else []
        for ref in instruction.references:
            if ref in computations and ref not in seen and ref != entry:
                seen.add(ref)
                for inner in computations[ref]:
                    names += op_names(inner, seen)
        return names

    sources: dict[str, OpSource] = {}
    owners: dict[str, str] = {}  # a layer's weights (arguments params['conv1'][0], and views of them) -> the layer
    for instruction in computations[entry]:
        layers: set[str] = set()
        backward = forward = False
        for op_name in op_names(instruction, set()):
            scopes = _scopes(op_name)
            layers.update(pattern.findall(scopes) if pattern else ())
            if "transpose(" in scopes:
                backward = True
            else:
                forward = True
        part = BOTH if forward and backward else BACKWARD if backward else FORWARD if forward else ""
        if not part:
            # XLA made it without metadata (a product or a filter gradient's convolution rewritten, a copy for
            # a layout): it works for the layer whose weights it reads, else for the layers that made its
            # operands; in the backward pass if any operand is. The entry computation lists operands first.
            made = [sources[ref] for ref in instruction.references if ref in sources]
            layers = {owners[ref] for ref in instruction.references if ref in owners} or \
                {layer for source in made for layer in source.layers}
            parts = {source.part for source in made}
            part = (BACKWARD if parts & {BACKWARD, BOTH} else FORWARD) if layers else ""
        sources[instruction.name] = OpSource(instruction.name, tuple(sorted(layers, key=order.__getitem__)), part)
        weights = _WEIGHTS.match(instruction.op_name)
        if weights and weights.group(1) in order:
            owners[instruction.name] = weights.group(1)
    return sources


# ---- the trace: when each operation ran --------------------------------------------------------------------

def _trace_events(run, runs: int) -> list[tuple[int, int, str]]:
    import jax

    with tempfile.TemporaryDirectory(prefix="caffejax-profile-") as directory:
        try:
            jax.profiler.start_trace(directory)
        except RuntimeError as e:  # one trace at a time: the caller's own, say
            raise ProfileUnavailable(f"JAX's profiler cannot start: {e}") from None
        try:
            for _ in range(runs):
                jax.block_until_ready(run())
        finally:
            jax.profiler.stop_trace()
        paths = glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True)
        if not paths:
            raise ProfileUnavailable("JAX's profiler wrote no trace")
        data = jax.profiler.ProfileData.from_file(paths[0])
    return [(event.start_ns, event.end_ns, event.name)
            for plane in data.planes for line in plane.lines for event in line.events]


def _readers(instructions: Sequence[Instruction], traced: set[str]) -> dict[str, set[str]]:
    """For each entry operation, the traced operations that read its result, looking through the untraced
    ones in between (bitcasts, tuples)."""
    direct: dict[str, set[str]] = collections.defaultdict(set)
    for instruction in instructions:
        for ref in instruction.references:
            direct[ref].add(instruction.name)

    def traced_readers(name: str, seen: set[str]) -> set[str]:
        found = set()
        for reader in direct.get(name, ()):
            if reader in seen:
                continue
            seen.add(reader)
            found |= {reader} if reader in traced else traced_readers(reader, seen)
        return found

    return {instruction.name: traced_readers(instruction.name, set()) for instruction in instructions}


def charge(events: Sequence[tuple[int, int, str]], instructions: Sequence[Instruction], runs: int
           ) -> tuple[list[float], list[dict[str, float]], list[float]]:
    """Per run: its length (first operation's start to last operation's end, in seconds), each operation's
    share of it, and the time no operation ran.

    The k-th of an operation's events in time belongs to the k-th run (runs do not overlap: each is waited
    for; the client's own spans cannot delimit them, as XLA:CPU runs a program on the calling thread or on a
    worker as it judges the program's cost). An operation runs from its first event's start to its last
    event's end, an asynchronous one (:data:`_ASYNC_OPCODES`) at least until its first traced reader starts."""
    names = {instruction.name for instruction in instructions}
    by_op: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
    for start, end, name in events:
        if name in names:
            by_op[name].append((start, end))
    per_run: list[dict[str, tuple[int, int]]] = [{} for _ in range(runs)]
    for name, spans in by_op.items():
        spans.sort()
        for j, (start, end) in enumerate(spans):
            run = per_run[j * runs // len(spans)]
            seen = run.get(name)
            run[name] = (min(start, seen[0]), max(end, seen[1])) if seen else (start, end)
    readers = _readers(instructions, set(by_op))
    asynchronous = {i.name for i in instructions if i.opcode in _ASYNC_OPCODES}
    lengths, charged, idle = [], [], []
    for spans in per_run:
        if not spans:
            continue
        last = max(end for _, end in spans.values())
        intervals = {}
        for name, (start, end) in spans.items():
            if name in asynchronous:
                after = [spans[r][0] for r in readers.get(name, ()) if r in spans and spans[r][0] >= start]
                end = max(end, min(after) if after else last)
            intervals[name] = (start, end)
        shares, nothing = _share(intervals)
        lengths.append((last - min(start for start, _ in intervals.values())) / 1e9)
        charged.append({name: seconds / 1e9 for name, seconds in shares.items()})
        idle.append(nothing / 1e9)
    return lengths, charged, idle


def _share(intervals: Mapping[str, tuple[int, int]]) -> tuple[dict[str, float], float]:
    """The time covered by the intervals, each moment shared equally among the intervals covering it; and the
    time between the first start and the last end that none covers."""
    points = sorted({t for span in intervals.values() for t in span})
    starts = collections.defaultdict(list)
    ends = collections.defaultdict(list)
    for name, (start, end) in intervals.items():
        starts[start].append(name)
        ends[end].append(name)
    shares = dict.fromkeys(intervals, 0.0)
    active: set[str] = set()
    idle = 0.0
    for t, following in zip(points, points[1:]):
        active.difference_update(ends[t])
        active.update(name for name in starts[t] if intervals[name][1] > t)
        if active:
            for name in active:
                shares[name] += (following - t) / len(active)
        else:
            idle += following - t
    return shares, idle


# A program's first calls in a process can page its big buffers in while malloc's arenas grow: a ReLU alone on
# 16x112x112x96 (MobileNet v2's relu2_2/expand at batch 16) took about 13,000 page faults and 100 ms a call over
# its first six calls, then none and 5 ms (2 Sapphire Rapids cores); timed over five runs after one, bench.profile
# put it at 124 ms. A whole forward pages in less (MobileNet v2's bfloat16 one, 254 faults on its first call and
# none after). So a program runs untraced until one run pages in fewer than SETTLED_PAGE_FAULTS, at least twice and
# for at most WARMUP_MAX_SECONDS: given host arrays, a program runs on a worker thread, which may map its big
# buffers afresh on every call (net.to_device) and never settle (that ReLU given a NumPy array: 18,800 faults and
# 29 ms every call, against 4.4 ms given a device array).
SETTLED_PAGE_FAULTS = 64
WARMUP_MAX_SECONDS = 1.0


def _page_faults() -> int:
    """This process's minor page faults so far (0 where the platform does not count them)."""
    try:
        import resource
    except ImportError:  # Windows
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def warm_up(run: Callable[[], Any], max_seconds: float = WARMUP_MAX_SECONDS) -> int:
    """Call ``run()`` (waiting for its results) until a call pages in (nearly) nothing, at least twice and for at
    most ``max_seconds``; returns the number of calls."""
    import jax

    began, calls = time.perf_counter(), 0
    while True:
        before = _page_faults()
        jax.block_until_ready(run())
        calls += 1
        if calls >= 2 and (_page_faults() - before < SETTLED_PAGE_FAULTS
                           or time.perf_counter() - began >= max_seconds):
            return calls


def profile_program(compiled, args: Sequence[Any], layer_names: Sequence[str], runs: int = 10) -> ProgramProfile:
    """Run ``compiled(*args)`` (a ``jax.stages.Compiled``) ``runs`` times under the profiler, once it has warmed
    up (:func:`warm_up`), and charge its operations' time to the layers in ``layer_names``."""
    import jax

    if runs < 1:
        raise ValueError(f"profile_program: runs must be >= 1, got {runs}")
    entry, computations = parse_hlo(compiled.as_text())
    sources = op_sources(entry, computations, layer_names)
    warm_up(lambda: compiled(*args))
    lengths, charged, idle = charge(_trace_events(lambda: compiled(*args), runs), computations[entry], runs)
    if not charged:
        raise ProfileUnavailable(f"the trace names none of the program's {len(sources)} operations "
                                 f"({jax.default_backend()} backend)")
    totals: dict[str, float] = collections.defaultdict(float)
    for times in charged:
        for op, seconds in times.items():
            totals[op] += seconds / len(charged)
    return ProgramProfile(len(charged), sum(lengths) / len(lengths), dict(totals), sum(idle) / len(idle), sources)


def format_rows(profile: ProgramProfile, top: int | None = None) -> list[str]:
    """One line per (layers, pass): ms per run, share of the run, operations charged."""
    lines = []
    rows = profile.rows()
    for row in rows[:top] if top else rows:
        share = 100 * row.seconds / profile.seconds if profile.seconds else 0.0
        count = f"  ({len(row.ops)} op{'s' if len(row.ops) != 1 else ''})" if row.ops else ""
        lines.append(f"{row.seconds * 1e3:9.3f} ms {share:5.1f}%  {row.part:16s} {row.label}{count}")
    return lines
