"""A compiled net called from several threads at once, as a threaded server calls it: each shape's program is
built once however many first calls wait for it, and every call gets its own inputs' outputs."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import caffejax
from caffejax.export import StableHLOModel, export_stablehlo, load_stablehlo
from caffejax.runtime.inference import InferenceFunction
from conftest import BUNDLED

LENET = (str(BUNDLED / "lenet/lenet.prototxt"), str(BUNDLED / "lenet/lenet_iter_10000.caffemodel"))


@pytest.fixture(scope="module")
def lenet():
    return caffejax.Net(*LENET, caffejax.TEST)


def _in_threads(call, inputs: list) -> list:
    """``call(x)`` for each of ``inputs``, each in a thread of its own, all started together; their results."""
    results, errors = [None] * len(inputs), []
    start = threading.Barrier(len(inputs))

    def work(i):
        try:
            start.wait()
            results[i] = np.asarray(call(inputs[i]))
        except Exception as error:  # (handed to the test's thread)
            errors.append(error)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def _counted(monkeypatch, owner, name: str) -> list:
    """Count the calls of ``owner.name`` (a method that builds a program), each made slower by 0.2 s: without a
    lock every thread's first call would be inside it before the first build ended."""
    calls, method = [], getattr(owner, name)

    def slow(self, *args):
        calls.append(args)
        time.sleep(0.2)
        return method(self, *args)
    monkeypatch.setattr(owner, name, slow)
    return calls


def _images(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random((n, 1, 28, 28), dtype=np.float32)


def test_threads_first_calls_at_one_shape_wait_for_one_program(lenet, monkeypatch):
    builds = _counted(monkeypatch, InferenceFunction, "_build_program")
    infer = caffejax.compile_inference(lenet)
    xs = [_images(2, seed) for seed in range(4)]
    got = _in_threads(lambda x: infer({"data": x})["prob"], xs)
    assert len(builds) == 1 and infer.compile_count == 1
    exact = caffejax.compile_inference(lenet)
    for x, y in zip(xs, got):
        np.testing.assert_array_equal(y, np.asarray(exact({"data": x})["prob"]))


def test_threads_at_several_shapes_get_their_own_outputs_and_one_copy_of_the_weights(lenet, monkeypatch):
    builds = _counted(monkeypatch, InferenceFunction, "_build_program")
    infer = caffejax.compile_inference(lenet)
    xs = [_images(n, n) for n in (1, 2, 3, 1, 2, 3)]
    got = _in_threads(lambda x: infer({"data": x})["prob"], xs)
    assert len(builds) == 3 and infer.compile_count == 3
    # The prepared weights are the same at each batch size: held once for the three programs (SharedWeights).
    assert all(len(kept) == 1 for kept in infer._shared._kept.values())
    exact = caffejax.compile_inference(lenet)
    for x, y in zip(xs, got):
        np.testing.assert_array_equal(y, np.asarray(exact({"data": x})["prob"]))


def test_a_loaded_export_compiles_once_for_threads_calling_at_once(lenet, tmp_path, monkeypatch):
    export_stablehlo(lenet, str(tmp_path / "lenet.stablehlo"), batch="batch")
    compiles = _counted(monkeypatch, StableHLOModel, "_compile")
    model = load_stablehlo(str(tmp_path / "lenet.stablehlo"))
    xs = [_images(n, seed) for seed, n in enumerate((2, 2, 2, 5, 5))]
    got = _in_threads(lambda x: model(data=x)["prob"], xs)
    assert len(compiles) == 2 and model.compile_count == 2
    exact = caffejax.compile_inference(lenet)
    for x, y in zip(xs, got):
        np.testing.assert_allclose(y, np.asarray(exact({"data": x})["prob"]), rtol=1e-5, atol=1e-7)


def test_a_net_s_pass_from_a_second_thread_is_refused_while_one_runs():
    """A Net holds one set of blobs, as Caffe's: a second thread's forward, backward or reshape while a pass runs
    would fill them under it (and the arrays its forward returned), so it raises NetInUseError; the first pass
    ends with its own outputs, and the net takes calls again once it has."""
    from caffejax.errors import NetInUseError

    net = caffejax.Net(*LENET, caffejax.TEST)
    x, y = _images(64, 1), _images(64, 2)
    expected = {"x": np.array(net.forward(data=x)["prob"]), "y": np.array(net.forward(data=y)["prob"])}
    inside, release = threading.Event(), threading.Event()

    def hold(index):  # (called after each layer, in the pass's thread)
        if index == 0 and not release.is_set():
            inside.set()
            release.wait(30)
    net.after_forward(hold)
    got = {}
    first = threading.Thread(target=lambda: got.update(x=np.array(net.forward(data=x)["prob"])))
    first.start()
    assert inside.wait(30)
    for call in (lambda: net.forward(data=y), net.backward, net.reshape):
        with pytest.raises(NetInUseError, match="running a pass in another thread"):
            call()
    release.set()
    first.join()
    np.testing.assert_array_equal(got["x"], expected["x"])
    np.testing.assert_array_equal(net.forward(data=y)["prob"], expected["y"])
