"""Faults during training: a process killed while it writes a snapshot loses nothing, and NaN/Inf is traced
to the layer that produced it (--debug-nans, Net(debug_nans=True), caffejax.find_first_nan)."""

from __future__ import annotations

import os
import pathlib
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import caffejax
from caffejax import fileio
from caffejax.cli import main as cli_main
from caffejax.frontend.caffemodel import read_weights
from caffejax.runtime import snapshot as snapshots
from conftest import REFERENCE

REPO = pathlib.Path(__file__).resolve().parent.parent
NET = REFERENCE / "solvers" / "adagrad_fixed_net.prototxt"  # conv, relu, pool, ip, softmax loss
MAX_ITER = 10

# The child trains with a snapshot after every iteration. Its writes are slowed down (the bytes trickle through
# caffejax.fileio.atomic_write, which stays the real one), so that a kill lands in the middle of a write.
CHILD = textwrap.dedent("""
    import sys, time
    import numpy as np
    import caffejax
    from caffejax import fileio
    from caffejax.runtime import net as net_module, snapshot

    real_atomic_write = fileio.atomic_write

    def trickling_atomic_write(path, chunks):
        def trickle():
            for chunk in ([chunks] if isinstance(chunks, (bytes, bytearray, memoryview)) else chunks):
                view = memoryview(chunk).cast("B")
                for start in range(0, len(view), 256):
                    time.sleep(0.004)
                    yield view[start:start + 256]
        real_atomic_write(path, trickle())

    snapshot.atomic_write = net_module.atomic_write = trickling_atomic_write
    solver_path, resume = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    solver = caffejax.get_solver(solver_path)
    if resume:
        solver.restore(resume)
    sys.path.insert(0, sys.argv[3] if len(sys.argv) > 3 else ".")
    from test_faults import feed
    while solver.iter < solver.param.max_iter:
        feed(solver.net, solver.iter)
        solver.step(1)
""")


def feed(net, iteration: int) -> None:
    """The batch of an iteration: a function of the iteration alone, so a resumed run sees the same data."""
    rng = np.random.default_rng(iteration)
    net.blobs["data"].data[...] = rng.standard_normal(net.blobs["data"].shape).astype(np.float32)
    net.blobs["label"].data[...] = rng.integers(0, 5, net.blobs["label"].shape)


def _solver_file(directory: pathlib.Path) -> pathlib.Path:
    path = directory / "solver.prototxt"
    path.write_text(f'net: "{NET}"\ntype: "Adam"\nbase_lr: 0.01\nmomentum: 0.9\nlr_policy: "multistep"\n'
                    f'gamma: 0.5\nstepvalue: 3\nstepvalue: 7\nmax_iter: {MAX_ITER}\nsnapshot: 1\n'
                    f'snapshot_prefix: "{directory / "snap"}"\nrandom_seed: 11\ndisplay: 0\n')
    return path


def _complete_pairs(directory: pathlib.Path) -> list[int]:
    """Iterations with both a caffemodel and a solverstate on disk."""
    iterations = []
    for state in directory.glob("snap_iter_*.solverstate"):
        n = int(state.name[len("snap_iter_"):-len(".solverstate")])
        if (directory / f"snap_iter_{n}.caffemodel").exists():
            iterations.append(n)
    return sorted(iterations)


def _check_every_snapshot_loads(directory: pathlib.Path) -> None:
    for model in directory.glob("*.caffemodel"):
        read_weights(str(model))
    for state in directory.glob("*.solverstate"):
        data = snapshots.read_state(str(state))
        assert os.path.exists(snapshots.resolve_learned_net(data.learned_net, str(state)))


def _run_child(solver: pathlib.Path, resume: str | None, kill_after_writes: int | None) -> bool:
    """Train in a child process; with ``kill_after_writes``, SIGKILL it while it writes the snapshot file that
    follows that many completed snapshot pairs. Returns whether it was killed."""
    args = [sys.executable, "-c", CHILD, str(solver), resume or "", str(pathlib.Path(__file__).parent)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    with open(solver.parent / "child.log", "ab") as log:
        child = subprocess.Popen(args, env=env, stdout=log, stderr=log, cwd=solver.parent)
        try:
            if kill_after_writes is None:
                assert child.wait(timeout=120) == 0, (solver.parent / "child.log").read_text()
                return False
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and child.poll() is None:
                if len(_complete_pairs(solver.parent)) >= kill_after_writes and list(solver.parent.glob("*.tmp")):
                    child.send_signal(signal.SIGKILL)
                    child.wait()
                    return True
                time.sleep(0.002)
            raise AssertionError(f"the child ended before it could be killed: {(solver.parent / 'child.log').read_text()}")
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()


def test_sigkill_during_snapshot_loses_nothing_and_resume_continues_the_trajectory(tmp_path):
    solver_file = _solver_file(tmp_path)
    rng = random.Random(0)
    resume = None
    partial_files = 0
    kills = sorted(rng.sample(range(2, MAX_ITER - 1), 2))
    for kill_after in kills:
        assert _run_child(solver_file, resume, kill_after)
        # What a crash leaves behind is a temporary file, never a snapshot.
        leftovers = list(tmp_path.glob("*.tmp"))
        partial_files += len(leftovers)
        if kill_after != kills[-1]:
            for partial in leftovers:  # (the next child's kill waits for a temporary file of its own)
                partial.unlink()
        _check_every_snapshot_loads(tmp_path)
        newest = _complete_pairs(tmp_path)[-1]
        assert newest >= kill_after
        resume = str(tmp_path / f"snap_iter_{newest}.solverstate")
    assert partial_files, "the kills should land while a snapshot is being written"
    _run_child(solver_file, resume, None)
    _check_every_snapshot_loads(tmp_path)
    assert not any(partial.exists() for partial in leftovers), "the next snapshot removes the killed child's files"

    # The same training without interruption, in this process: the resumed runs reached the same weights.
    (tmp_path / "reference").mkdir()
    solver = caffejax.get_solver(str(_solver_file(tmp_path / "reference")))
    solver.param.snapshot = 0
    while solver.iter < MAX_ITER:
        feed(solver.net, solver.iter)
        solver.step(1)
    final = read_weights(str(tmp_path / f"snap_iter_{MAX_ITER}.caffemodel")).blobs
    for layer, blobs in solver.net.params.items():
        for i, blob in enumerate(blobs):
            np.testing.assert_allclose(final[layer][i], blob.data, rtol=1e-6, atol=1e-7,
                                       err_msg=f"{layer}/{i} after resuming twice")


# ---- NaN / Inf -------------------------------------------------------------------------------------------------

NAN_NET = """name: "nan_net"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
  inner_product_param { num_output: 3 weight_filler { type: "constant" value: 1 } } }
layer { name: "log1" type: "Log" bottom: "ip1" top: "log1" }
layer { name: "ip2" type: "InnerProduct" bottom: "log1" top: "ip2"
  inner_product_param { num_output: 2 weight_filler { type: "constant" value: 1 } } }
"""


def test_find_first_nan_names_the_layer_that_produced_it():
    net = caffejax.Net(NAN_NET, caffejax.TEST)
    net.forward(data=np.ones((2, 3), np.float32))
    assert caffejax.find_first_nan(net) is None
    net.forward(data=-np.ones((2, 3), np.float32))  # log of a negative sum
    assert np.isnan(net.blobs["ip2"].data).all()
    found = caffejax.find_first_nan(net)
    assert (found.layer, found.type, found.kind, found.blob, found.nans) == ("log1", "Log", "top", "log1", 6)
    net.forward(data=np.full((2, 3), np.inf, np.float32))
    found = caffejax.find_first_nan(net)
    assert (found.layer, found.kind, found.blob, found.infs) == ("data", "input", "data", 6)

    checked = caffejax.Net(NAN_NET, caffejax.TEST, debug_nans=True)
    checked.forward(data=np.ones((2, 3), np.float32))
    with pytest.raises(caffejax.NumericalError, match="layer 'log1' \\(type Log\\) produced 6 NaN"):
        checked.forward(data=-np.ones((2, 3), np.float32))
    # After a rebuild at shapes the net has run before (net.reshape() here), the net's graph is the one its
    # program was made from: the replay walked the rebuilt graph's layers, which the program did not know (a
    # KeyError; found by fuzzing sequences of Net calls).
    checked.reshape()
    with pytest.raises(caffejax.NumericalError, match="layer 'log1' \\(type Log\\) produced 6 NaN"):
        checked.forward(data=-np.ones((2, 3), np.float32))


def test_find_first_nan_replays_the_input_a_layer_in_place_overwrote():
    """The replay starts from what the forward read, not from the input blob a layer in place overwrote: from
    the blob, Power's x + 1 ran twice (-1.5 -> 0.5) and the Log's NaN was not found."""
    net = caffejax.Net("""name: "p"
layer { name: "in" type: "Input" top: "data" input_param { shape { dim: 2 dim: 4 } } }
layer { name: "pre" type: "Power" bottom: "data" top: "data" power_param { shift: 1 } }
layer { name: "log" type: "Log" bottom: "data" top: "l" }""", caffejax.TEST)
    net.forward(data=np.full((2, 4), -1.5, np.float32))
    found = caffejax.find_first_nan(net)
    assert (found.layer, found.kind, found.blob, found.nans) == ("log", "top", "l", 8)


def test_debug_nans_in_training_and_on_the_command_line(tmp_path, capsys):
    net = tmp_path / "net.prototxt"
    net.write_text(NAN_NET.replace('top: "ip2"', 'top: "ip2" loss_weight: 1'))
    solver_file = tmp_path / "solver.prototxt"
    solver_file.write_text(f'net: "{net}" base_lr: 3e38 lr_policy: "fixed" max_iter: 3 display: 0\n')
    solver = caffejax.get_solver(str(solver_file))
    solver.debug_nans = True
    solver.net.blobs["data"].data[...] = 1
    # The first update sends the weights to -inf (base_lr 3e38 times a gradient > 2), with a finite loss.
    with pytest.raises(caffejax.NumericalError, match="iteration 0: the update made learnable blob 0 of layer"):
        solver.step(1)

    weights = tmp_path / "w.caffemodel"
    caffejax.Net(str(net), caffejax.TEST).save(str(weights))
    # Input blobs start at zero: log(0) = -inf in log1.
    assert cli_main(["test", "-model", str(net), "-weights", str(weights), "-iterations", "1", "--debug-nans"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("caffejax: error:") and "layer 'log1' (type Log) produced" in err, err
    assert cli_main(["test", "-model", str(net), "-weights", str(weights), "-iterations", "1"]) == 0


def test_a_write_removes_only_what_killed_writers_of_this_host_left(tmp_path):
    """A temporary file names its writer's host and process: the next write into the directory removes those of
    this host's processes that no longer run, and leaves the files of running processes, of other hosts (a shared
    filesystem) and of other programs."""
    dead_pid = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                                  text=True, check=True).stdout)
    host = fileio._host()
    stale = tmp_path / f"snap_iter_10.caffemodel.caffejax.{host}.{dead_pid}.k2j4.tmp"
    running = tmp_path / f"snap_iter_20.caffemodel.caffejax.{host}.{os.getpid()}.k2j4.tmp"
    other_host = tmp_path / f"snap_iter_30.caffemodel.caffejax.{host}x.{dead_pid}.k2j4.tmp"
    other_program = tmp_path / f"notes.{dead_pid}.tmp"
    for partial in (stale, running, other_host, other_program):
        partial.write_bytes(b"partial")
    fileio.atomic_write(str(tmp_path / "model.caffemodel"), b"whole")
    assert (tmp_path / "model.caffemodel").read_bytes() == b"whole"
    assert not stale.exists() and running.exists() and other_host.exists() and other_program.exists()
    assert sorted(p.name for p in tmp_path.glob("*.tmp")) == sorted(p.name for p in (running, other_host,
                                                                                      other_program))


def test_a_write_into_a_missing_folder_names_the_file_asked_for(tmp_path):
    """Net.save, snapshots and every other atomic write into a folder that does not exist: the OSError names
    the file asked for, not the temporary file beside it."""
    target = tmp_path / "no_such_folder" / "w.caffemodel"
    with pytest.raises(FileNotFoundError) as error:
        fileio.atomic_write(str(target), b"x")
    assert error.value.filename == str(target) and str(target) in str(error.value)
    net = caffejax.Net('layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 1 } } }', caffejax.TEST)
    with pytest.raises(FileNotFoundError, match="no_such_folder/w.caffemodel'$"):
        net.save(str(target))


def test_files_that_cannot_be_read_raise_the_readers_typed_error(tmp_path, capsys):
    """fileio.read_bytes, the one reader behind caffemodels, BlobProtos, solver states, StableHLO and Flax exports
    and the upgrade tool's kind check: a missing file or a folder is the caller's error type naming the file."""
    from caffejax.errors import CaffejaxError, SolverError, WeightsError
    from caffejax.export import load_flax_state, load_stablehlo

    (tmp_path / "head.bin").write_bytes(b"0123456789")
    assert fileio.read_bytes(str(tmp_path / "head.bin")) == b"0123456789"
    assert fileio.read_bytes(str(tmp_path / "head.bin"), limit=4) == b"0123"
    with pytest.raises(WeightsError, match=r"missing\.bin: cannot read: No such file"):
        fileio.read_bytes(str(tmp_path / "missing.bin"), WeightsError)
    with pytest.raises(CaffejaxError, match=r": cannot read: Is a directory"):
        fileio.read_bytes(str(tmp_path))
    gone = str(tmp_path / "gone")
    for reader, error in [(load_stablehlo, CaffejaxError), (lambda path: load_flax_state(None, path), CaffejaxError),
                          (snapshots._read_state_binary, SolverError)]:
        with pytest.raises(error, match=r"gone: cannot read: No such file"):
            reader(gone)
    assert cli_main(["upgrade", gone, str(tmp_path / "out")]) != 0
    assert f"{gone}: cannot read: No such file" in capsys.readouterr().err
