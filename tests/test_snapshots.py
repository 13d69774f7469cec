"""Solver snapshots against Caffe's file layouts (sgd_solver.cpp, hdf5.cpp): Caffe's HDF5 solver state, errors
that name the state file, and a restored run equal bit for bit to an uninterrupted one."""

from __future__ import annotations

import numpy as np
import pytest

import caffejax
from caffejax.errors import SolverError, WeightsError
from caffejax.proto import caffe_pb2
from conftest import REFERENCE

h5py = pytest.importorskip("h5py")

NET = """
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 2 dim: 3 dim: 3 dim: 3 } shape { dim: 2 dim: 3 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 2 kernel_size: 2 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def make_solver(tmp_path, solver_type="AdaDelta", **fields) -> caffejax.SGDSolver:
    (tmp_path / "net.prototxt").write_text(NET)
    param = caffe_pb2.SolverParameter(type=solver_type, base_lr=0.5, momentum=0.9, delta=1e-6, lr_policy="step",
                                      gamma=0.5, stepsize=2, max_iter=10, net=str(tmp_path / "net.prototxt"),
                                      snapshot_prefix=str(tmp_path / "snap"), random_seed=1, **fields)
    return caffejax.get_solver(param)


def batches(n: int):
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((2, 3, 3, 3), dtype=np.float32), rng.standard_normal((2, 3), dtype=np.float32))
            for _ in range(n)]


def feed_and_step(solver, batch) -> None:
    solver.net.blobs["data"].data[...] = batch[0]
    solver.net.blobs["label"].data[...] = batch[1]
    solver.step(1)


def weights(solver) -> dict[str, list[np.ndarray]]:
    return {name: [np.array(b.data) for b in blobs] for name, blobs in solver.net.params.items()}


def write_caffe_hdf5_state(path, state: caffe_pb2.SolverState, history) -> None:
    """A solverstate.h5 laid out as SGDSolver::SnapshotSolverStateToHDF5 writes it: hdf5_save_int makes 1-D
    datasets of one element (H5LTmake_dataset_int, rank 1), hdf5_save_string a NUL-terminated scalar string."""
    with h5py.File(path, "w") as f:
        f.create_dataset("iter", data=np.array([state.iter], np.int32))
        name = state.learned_net.encode()
        string_type = h5py.h5t.C_S1.copy()
        string_type.set_size(len(name) + 1)
        string_type.set_strpad(h5py.h5t.STR_NULLTERM)
        dataset = h5py.h5d.create(f.id, b"learned_net", string_type, h5py.h5s.create(h5py.h5s.SCALAR))
        dataset.write(h5py.h5s.ALL, h5py.h5s.ALL, np.array(name + b"\0", dtype=f"S{len(name) + 1}"))
        f.create_dataset("current_step", data=np.array([state.current_step], np.int32))
        group = f.create_group("history")
        for i, array in enumerate(history):
            group.create_dataset(str(i), data=np.asarray(array, np.float32))


def test_restores_caffes_hdf5_solver_state(tmp_path):
    """Caffe's hdf5_save_int writes iter and current_step 1-D; caffejax read them as scalars (int() of a 1-D
    array fails under NumPy 2) and called Caffe's file corrupted. It now also writes them as Caffe does."""
    data = batches(5)
    solver = make_solver(tmp_path)
    for batch in data[:3]:
        feed_and_step(solver, batch)
    binary_state = solver.snapshot()
    for batch in data[3:]:
        feed_and_step(solver, batch)
    expected = weights(solver)

    state = caffe_pb2.SolverState.FromString(open(binary_state, "rb").read())
    history = [np.array(blob.data, np.float32).reshape(blob.shape.dim) for blob in state.history]
    caffe_file = tmp_path / "caffe_iter_3.solverstate.h5"
    write_caffe_hdf5_state(caffe_file, state, history)
    fresh = make_solver(tmp_path)
    fresh.restore(str(caffe_file))
    assert (fresh.iter, fresh.current_step) == (3, 1)
    for batch in data[3:]:
        feed_and_step(fresh, batch)
    for name, arrays in expected.items():
        for i, array in enumerate(arrays):
            np.testing.assert_array_equal(fresh.net.params[name][i].data, array, err_msg=f"{name}/{i}")

    # caffejax's own HDF5 state has Caffe's layout.
    solver.param.snapshot_format = caffe_pb2.SolverParameter.HDF5
    with h5py.File(solver.snapshot(), "r") as f:
        assert f["iter"].shape == f["current_step"].shape == (1,)
        assert f["iter"][0] == 5
        assert f["learned_net"][()].rstrip(b"\0").decode() == str(tmp_path / "snap_iter_5.caffemodel.h5")


def test_hdf5_state_with_a_bad_int_names_it(tmp_path):
    solver = make_solver(tmp_path, "SGD")
    solver.param.snapshot_format = caffe_pb2.SolverParameter.HDF5
    path = solver.snapshot()
    with h5py.File(path, "a") as f:
        del f["iter"]
        f.create_dataset("iter", data=np.array([1, 2], np.int32))
    with pytest.raises(SolverError, match=r"solverstate\.h5: 'iter' should be one integer, got 2"):
        make_solver(tmp_path, "SGD").restore(path)


def test_learned_net_errors_name_the_state_file(tmp_path):
    solver = make_solver(tmp_path, "SGD")
    state_file = solver.snapshot()
    (tmp_path / "snap_iter_0.caffemodel").write_bytes(b"\x08\x01 truncated")
    with pytest.raises(WeightsError) as info:
        make_solver(tmp_path, "SGD").restore(state_file)
    assert str(info.value).startswith(f"{state_file}: its learned_net: {tmp_path / 'snap_iter_0.caffemodel'}: ")


@pytest.mark.parametrize("fmt", ["BINARYPROTO", "HDF5"])
def test_restored_run_equals_uninterrupted_bit_for_bit(tmp_path, fmt):
    """Adam (two history sets) with iter_size 2: the snapshot the `snapshot` interval took at iteration 2,
    restored in a fresh solver, continues exactly as the uninterrupted run (no float noise: same programs)."""
    data = batches(4)
    kwargs = dict(iter_size=2, snapshot=2, snapshot_format=getattr(caffe_pb2.SolverParameter, fmt),
                  weight_decay=0.01, clip_gradients=1.0)
    solver = make_solver(tmp_path, "Adam", momentum2=0.999, **kwargs)
    for batch in data:
        feed_and_step(solver, batch)
    suffix = ".solverstate.h5" if fmt == "HDF5" else ".solverstate"
    assert not (tmp_path / f"snap_iter_0{suffix}").exists()  # no snapshot before the first update
    fresh = make_solver(tmp_path, "Adam", momentum2=0.999, **kwargs)
    fresh.restore(str(tmp_path / f"snap_iter_2{suffix}"))
    for batch in data[2:]:
        feed_and_step(fresh, batch)
    for name, arrays in weights(solver).items():
        for i, array in enumerate(arrays):
            np.testing.assert_array_equal(fresh.net.params[name][i].data, array, err_msg=f"{name}/{i}")
    for a, b in zip(fresh._flat_history(), solver._flat_history()):
        np.testing.assert_array_equal(a, b)


def test_caffes_snapshot_converted_to_hdf5_restores(tmp_path):
    """A real Caffe snapshot (../shared/reference) in Caffe's HDF5 layout restores as its binary form does."""
    solvers = REFERENCE / "solvers"
    state_path = solvers / "adam_poly_iter_3.solverstate"
    if not state_path.is_file():
        pytest.skip("../shared/reference is absent")
    state = caffe_pb2.SolverState.FromString(state_path.read_bytes())
    history = [np.array(blob.data, np.float32).reshape(blob.shape.dim) for blob in state.history]
    state.learned_net = str(solvers / state.learned_net)
    write_caffe_hdf5_state(tmp_path / "adam.solverstate.h5", state, history)
    from_binary = caffejax.get_solver(str(solvers / "adam_poly_solver.prototxt"))
    from_binary.restore(str(state_path))
    from_hdf5 = caffejax.get_solver(str(solvers / "adam_poly_solver.prototxt"))
    from_hdf5.restore(str(tmp_path / "adam.solverstate.h5"))
    assert from_hdf5.iter == from_binary.iter == 3
    for name, arrays in weights(from_binary).items():
        for i, array in enumerate(arrays):
            np.testing.assert_array_equal(from_hdf5.net.params[name][i].data, array)
    for a, b in zip(from_hdf5._flat_history(), from_binary._flat_history()):
        np.testing.assert_array_equal(a, b)


# ---- action requests (Solver::GetRequestedAction): snapshot or stop on request -----------------------------------

def test_a_stop_request_ends_solve_with_its_final_snapshot(tmp_path, caplog):
    """As Solver::Step: the request is asked after ++iter; "stop" breaks out, and Solve still takes the
    snapshot_after_train snapshot, says "Optimization stopped early." and skips the final display and test."""
    solver = make_solver(tmp_path, "SGD", display=1)
    answers = iter(["none", "snapshot", "none", "stop"])
    solver.set_action_function(lambda: next(answers))
    caplog.set_level("INFO", logger="caffejax")
    solver.solve()
    assert solver.iter == 4 and solver.requested_early_exit
    assert sorted(p.name for p in tmp_path.glob("snap_iter_*.solverstate")) == ["snap_iter_2.solverstate",
                                                                                 "snap_iter_4.solverstate"]
    lines = [r.getMessage() for r in caplog.records]
    assert "Optimization stopped early." in lines and "Optimization Done." not in lines
    assert "Iteration 4, loss = " not in "\n".join(lines)  # the display after training is skipped


def test_a_stop_request_while_testing_interrupts_the_test_and_the_training(tmp_path, caplog):
    solver = make_solver(tmp_path, "SGD", test_interval=2, test_iter=[3], test_initialization=False)
    answers = iter(["none", "none", "stop"])  # iterations 1 and 2, then the first test batch at iter 2
    tests_run, test_net = [], solver.test_nets[0]  # the train net's file, in TEST phase
    forward = test_net.forward
    test_net.forward = lambda *a, **k: (tests_run.append(1), forward(*a, **k))[1]
    solver.set_action_function(lambda: next(answers))
    caplog.set_level("INFO", logger="caffejax")
    solver.step(5)
    assert solver.iter == 2 and solver.requested_early_exit and tests_run == []
    assert "Test interrupted." in [r.getMessage() for r in caplog.records]


def test_an_action_function_must_answer_an_action(tmp_path):
    solver = make_solver(tmp_path, "SGD")
    with pytest.raises(caffejax.CaffejaxError, match="takes a function"):
        solver.set_action_function("stop")
    solver.set_action_function(lambda: "halt")
    with pytest.raises(caffejax.CaffejaxError, match="returned 'halt'"):
        solver.step(1)
