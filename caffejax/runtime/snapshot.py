"""Caffe's snapshot files: the learned net and the solver state, binary protobuf or HDF5.

Solver::Snapshot writes ``<snapshot_prefix>_iter_<N>.caffemodel`` (or ``.caffemodel.h5``), then
SGDSolver::SnapshotSolverState writes ``<snapshot_prefix>_iter_<N>.solverstate`` (or ``.solverstate.h5``):
the iteration, the model file's name (``learned_net``), the lr schedule's ``current_step`` and the history
blobs in learnable-param order. Solvers with two history blobs per param (AdaDelta, Adam) store all first
blobs, then all second blobs, as Caffe appends its extra history after SGDSolver::PreSolve's.

Every file is written whole to a temporary file and renamed into place (caffejax.fileio.atomic_write), so a
crash never leaves a truncated snapshot behind. BVLC Caffe reads the files caffejax writes, and vice versa.
"""

from __future__ import annotations

import dataclasses
import io
import os

import numpy as np

from caffejax.errors import SolverError, WeightsError
from caffejax.fileio import atomic_write
from caffejax.frontend.caffemodel import (_h5py, blobproto_to_array, encode_blob, hdf5_blob, read_binary_proto,
                                         write_hdf5)
from caffejax.proto import caffe_pb2

BINARY_MODEL, BINARY_STATE = ".caffemodel", ".solverstate"
HDF5_MODEL, HDF5_STATE = ".caffemodel.h5", ".solverstate.h5"


@dataclasses.dataclass
class SolverStateData:
    """What a solverstate holds. ``history`` is flat, in Caffe's order (see the module docstring)."""

    iter: int
    current_step: int
    history: list[np.ndarray]
    learned_net: str | None = None


def snapshot_filename(prefix: str, iter: int, extension: str) -> str:
    """Solver::SnapshotFilename: ``<prefix>_iter_<N><extension>``."""
    return f"{prefix}_iter_{iter}{extension}"


def default_snapshot_prefix(solver_path: str, prefix: str | None) -> str:
    """UpgradeSnapshotPrefixProperty (Caffe's ReadSolverParamsFromTextFileOrDie).

    Without a snapshot_prefix, snapshots go beside the solver file, named after it; a prefix that is a
    directory gets the solver file's stem appended.
    """
    stem = os.path.splitext(solver_path)[0]
    if not prefix:
        return stem
    if os.path.isdir(prefix):
        return os.path.join(prefix, os.path.basename(stem))
    return prefix


# ---- the learned net ------------------------------------------------------------------------------------------

def write_model_binary(net, path: str, write_diff: bool) -> None:
    """Net::ToProto + WriteProtoToBinaryFile; with ``write_diff`` every blob carries its diff too."""
    if not write_diff:
        net.save(path)
        return
    proto = net.to_proto()
    for layer in proto.layer:
        for blob_proto, blob in zip(layer.blobs, net.params.get(layer.name, [])):
            blob_proto.diff.extend(np.asarray(blob.diff, np.float32).ravel().tolist())
    atomic_write(path, proto.SerializeToString())


def write_model_hdf5(net, path: str, write_diff: bool) -> None:
    """Net::ToHDF5: a group ``data/<layer>`` for every layer (empty for one without learnable blobs) holding
    ``<j>`` for the blobs the layer owns, and with ``write_diff`` ``diff/<layer>/<j>`` for all of them."""
    data: dict[str, list[np.ndarray | None]] = {}
    diffs: dict[str, list[np.ndarray]] = {}
    for layer in net.graph.layers:
        blobs = net.params.get(layer.name, [])
        data[layer.name] = [np.asarray(blob.data) if slot.is_owner else None
                            for slot, blob in zip(layer.params, blobs)]
        diffs[layer.name] = [np.asarray(blob.diff) for blob in blobs]
    buffer = io.BytesIO()
    write_hdf5(buffer, data, diffs if write_diff else None)
    atomic_write(path, buffer.getvalue())


# ---- the solver state ------------------------------------------------------------------------------------------

def write_state_binary(path: str, state: SolverStateData) -> None:
    """SGDSolver::SnapshotSolverStateToBinaryProto."""
    proto = caffe_pb2.SolverState(iter=state.iter, current_step=state.current_step)
    if state.learned_net is not None:
        proto.learned_net = state.learned_net
    for array in state.history:
        # encode_blob writes the packed floats without a Python loop; protobuf then parses them at C speed.
        proto.history.add().MergeFromString(encode_blob(np.asarray(array)))
    atomic_write(path, proto.SerializeToString())


def write_state_hdf5(path: str, state: SolverStateData) -> None:
    """SGDSolver::SnapshotSolverStateToHDF5: ``iter``, ``learned_net``, ``current_step``, ``history/<i>``.

    The ints are 1-D datasets of one element, as Caffe's hdf5_save_int makes them (H5LTmake_dataset_int with
    rank 1), not scalars."""
    def fill(f):
        f.create_dataset("iter", data=np.array([state.iter], np.int32))
        if state.learned_net is not None:
            name = state.learned_net.encode()
            # H5LTmake_dataset_string: a fixed-size, NUL-terminated string (Caffe reads it into a C buffer).
            f.create_dataset("learned_net", data=np.array(name, dtype=f"S{len(name) + 1}"))
        f.create_dataset("current_step", data=np.array([state.current_step], np.int32))
        history = f.create_group("history")
        for i, array in enumerate(state.history):
            history.create_dataset(str(i), data=np.asarray(array, np.float32))

    h5py = _h5py()
    buffer = io.BytesIO()
    with h5py.File(buffer, "w") as f:
        fill(f)
    atomic_write(path, buffer.getvalue())


def read_state(path: str) -> SolverStateData:
    """Solver::Restore's reader: HDF5 when the name ends in ``.h5``, else a binary SolverState."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise SolverError(f"{path}: no such solver state file")
    return _read_state_hdf5(path) if path.endswith(".h5") else _read_state_binary(path)


def _read_state_binary(path: str) -> SolverStateData:
    proto = read_binary_proto(path, caffe_pb2.SolverState(), "binary SolverState", SolverError)
    try:
        history = [blobproto_to_array(blob) for blob in proto.history]
    except Exception as e:  # a WeightsError naming the blob's size/shape disagreement
        raise SolverError(f"{path}: bad history blob: {e}") from None
    learned_net = proto.learned_net if proto.HasField("learned_net") else None
    if isinstance(learned_net, bytes):  # protobuf hands back a string field that is not UTF-8 as bytes
        raise SolverError(f"{path}: learned_net is not UTF-8 text ({learned_net[:60]!r}): corrupted?")
    return SolverStateData(iter=proto.iter, current_step=proto.current_step, history=history,
                           learned_net=learned_net)


def _read_state_hdf5(path: str) -> SolverStateData:
    h5py = _h5py()
    try:
        with h5py.File(path, "r") as f:
            for name in ("iter", "current_step", "history"):
                if name not in f:
                    raise SolverError(f"{path}: HDF5 solver state has no '{name}'")
            learned_net = None
            if "learned_net" in f:
                raw = f["learned_net"][()]
                learned_net = (raw.decode() if isinstance(raw, bytes) else str(raw)).rstrip("\0")
            group = f["history"]
            history = []
            for i in range(len(group)):
                if str(i) not in group:
                    raise SolverError(f"{path}: history/{i} is missing")
                history.append(hdf5_blob(h5py, group[str(i)], f"{path}: history/{i}"))
            return SolverStateData(iter=_hdf5_int(f, "iter", path), current_step=_hdf5_int(f, "current_step", path),
                                   history=history, learned_net=learned_net)
    except (OSError, RuntimeError, KeyError, ValueError, TypeError, WeightsError) as e:
        raise SolverError(f"{path}: cannot read HDF5 solver state (corrupted or truncated?): {e}") from None


def _hdf5_int(f, name: str, path: str) -> int:
    """hdf5_load_int (H5LTread_dataset_int): the one int of a dataset, which Caffe writes 1-D, of shape (1,)
    (a scalar, as caffejax wrote before, reads too)."""
    values = np.asarray(f[name][()]).ravel()
    if values.size != 1 or values.dtype.kind not in "iu":
        raise SolverError(f"{path}: '{name}' should be one integer, got {values.size} value(s) of type "
                          f"{values.dtype}")
    return int(values[0])


def resolve_learned_net(learned_net: str, state_path: str) -> str:
    """Where the state's model file is: as written, else beside the state file (snapshots get moved)."""
    if os.path.exists(learned_net):
        return learned_net
    beside = os.path.dirname(os.path.abspath(state_path))
    for candidate in (os.path.join(beside, learned_net), os.path.join(beside, os.path.basename(learned_net))):
        if os.path.exists(candidate):
            return candidate
    raise SolverError(f"{state_path}: learned_net '{learned_net}' not found (looked as given and beside the "
                      "solver state)")

