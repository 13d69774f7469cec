"""BVLC's LeNet example (examples/mnist/readme.md) end to end, run as a user runs it with Caffe's tools:

    caffejax convert-imageset --gray --resize_height 28 --resize_width 28 ./ train.txt examples/mnist/mnist_train_lmdb
    caffejax train -solver examples/mnist/lenet_solver.prototxt
    caffejax test -model examples/mnist/lenet_train_test.prototxt -weights examples/mnist/lenet_iter_N.caffemodel

from a temporary Caffe root holding BVLC's unmodified lenet_train_test.prototxt and lenet_solver.prototxt.

The digits are real handwriting: scikit-learn's bundled ``load_digits`` (1797 images, 8x8, values 0..16),
written as 8-bit PNGs and resized to 28x28 by convert-imageset (MNIST itself is not bundled). The solver's
own schedule (10000 iterations, 100 test batches) takes about ten minutes on a CPU, so the default test
trains on a copy of the solver with fewer iterations (every other setting, and the net, are BVLC's); the
unmodified solver runs in a ``slow`` test.
"""

from __future__ import annotations

import contextlib
import io
import re
import shutil

import numpy as np
import pytest

from caffejax.cli import main
from conftest import MODELS

MNIST_EXAMPLE = MODELS / "bvlc" / "examples" / "mnist"
TEST_IMAGES = 400     # held-out digits: 4 test batches of 100 (the test net's batch) cover them exactly
TEST_BATCHES = TEST_IMAGES // 100
SPLIT_SEED = 0

ITERATION_LOSS = re.compile(r"Iteration (\d+) \(.*\), loss = (\S+)")
TEST_ACCURACY = re.compile(r"Test net output #0: accuracy = (\S+)")


def caffe(root, *argv) -> tuple[int, str]:
    """One ``caffejax`` command run from the Caffe root ``root``: its exit status and its log (stderr)."""
    log = io.StringIO()
    with contextlib.chdir(root), contextlib.redirect_stderr(log):
        status = main([str(a) for a in argv])
    return status, log.getvalue()


def write_digits(root) -> None:
    """load_digits as PNGs under root/digits, listed as 'path label' in root/train.txt and root/test.txt."""
    datasets = pytest.importorskip("sklearn.datasets")
    Image = pytest.importorskip("PIL.Image")
    digits = datasets.load_digits()
    pixels = np.round(digits.images * (255 / 16)).astype(np.uint8)  # 0..16 -> 0..255, white ink on black
    order = np.random.default_rng(SPLIT_SEED).permutation(len(pixels))
    (root / "digits").mkdir()
    for split, indices in (("test", order[:TEST_IMAGES]), ("train", order[TEST_IMAGES:])):
        lines = []
        for i in indices:
            name = f"digits/{i:04d}.png"
            Image.fromarray(pixels[i], mode="L").save(root / name)
            lines.append(f"{name} {digits.target[i]}\n")
        (root / f"{split}.txt").write_text("".join(lines))


@pytest.fixture(scope="module")
def caffe_root(tmp_path_factory):
    """A Caffe root: BVLC's LeNet files in examples/mnist, with the LMDBs where lenet_train_test.prototxt
    looks for them, built by convert-imageset."""
    pytest.importorskip("lmdb")
    root = tmp_path_factory.mktemp("caffe_root")
    write_digits(root)
    example = root / "examples" / "mnist"
    example.mkdir(parents=True)
    for name in ("lenet_train_test.prototxt", "lenet_solver.prototxt"):
        shutil.copy(MNIST_EXAMPLE / name, example / name)
    for split in ("train", "test"):
        status, log = caffe(root, "convert-imageset", "--gray", "--resize_height", 28, "--resize_width", 28,
                            "./", f"{split}.txt", f"examples/mnist/mnist_{split}_lmdb")
        assert status == 0, log
    return root


def solver_copy(root, name: str, **overrides) -> str:
    """BVLC's lenet_solver.prototxt with some fields replaced, written beside it; its path from the root."""
    from google.protobuf import text_format

    from caffejax.frontend.prototxt import parse_solver_text

    param = parse_solver_text(str(root / "examples/mnist/lenet_solver.prototxt"), is_path=True)
    for field, value in overrides.items():
        if isinstance(value, list):
            del getattr(param, field)[:]
            getattr(param, field).extend(value)
        else:
            setattr(param, field, value)
    (root / "examples/mnist" / name).write_text(text_format.MessageToString(param))
    return f"examples/mnist/{name}"


def train(root, solver: str) -> str:
    """``caffejax train -solver <solver>`` from the Caffe root: its log."""
    status, train_log = caffe(root, "train", "-solver", solver)
    assert status == 0, train_log
    assert "Optimization Done." in train_log
    return train_log


def score_snapshot(root, iterations: int, batches: int) -> float:
    """``caffejax test`` on the snapshot of iteration ``iterations`` (which must exist with its solverstate),
    over ``batches`` test batches: the mean accuracy it reports."""
    snapshot = root / f"examples/mnist/lenet_iter_{iterations}.caffemodel"
    assert snapshot.is_file() and snapshot.with_suffix(".solverstate").is_file()
    status, test_log = caffe(root, "test", "-model", "examples/mnist/lenet_train_test.prototxt",
                             "-weights", snapshot.relative_to(root), "-iterations", batches)
    assert status == 0, test_log
    assert len(re.findall(r"Batch \d+, accuracy = ", test_log)) == batches
    return float(re.search(r"\] accuracy = (\S+)$", test_log, re.MULTILINE).group(1))  # the mean


def check_caffe_log(train_log: str, iterations: int, test_interval: int, display: int) -> list[float]:
    """The log reads like Caffe's: a loss every `display` iterations, falling; test scores at 0, every
    `test_interval` iterations and at the end; snapshot lines. Returns the test accuracies."""
    losses = {int(i): float(loss) for i, loss in ITERATION_LOSS.findall(train_log)}
    assert sorted(losses) == list(range(0, iterations, display))
    assert losses[max(losses)] < losses[0] / 4
    assert re.search(r"Iteration \d+, lr = ", train_log)
    assert train_log.count("Testing net (#0)") == iterations // test_interval + 1
    assert re.search(r"Test net output #1: loss = \S+ \(\* 1 = \S+ loss\)", train_log)
    assert f"Snapshotting to binary proto file examples/mnist/lenet_iter_{iterations}.caffemodel" in train_log
    accuracies = [float(a) for a in TEST_ACCURACY.findall(train_log)]
    assert len(accuracies) == iterations // test_interval + 1
    assert accuracies[0] < 0.3  # chance before training
    return accuracies


def test_lenet_example_trains_to_95_percent(caffe_root):
    """200 iterations of BVLC's LeNet (batch 64, lr 0.01 'inv', momentum 0.9) on real handwritten digits,
    through a solver copy that changes only the schedule; then `caffejax test` on the snapshot."""
    iterations = 200
    solver = solver_copy(caffe_root, "lenet_solver_short.prototxt", max_iter=iterations, snapshot=iterations,
                         test_interval=iterations, test_iter=[TEST_BATCHES])
    accuracies = check_caffe_log(train(caffe_root, solver), iterations, test_interval=iterations, display=100)
    assert accuracies[-1] >= 0.95, accuracies
    # The same weights on the same 400 digits as the solver's last test: the same score.
    assert score_snapshot(caffe_root, iterations, TEST_BATCHES) == pytest.approx(accuracies[-1], abs=1e-6)


@pytest.mark.slow
def test_lenet_example_with_bvlc_solver_unmodified(caffe_root):
    """BVLC's lenet_solver.prototxt as it is: 10000 iterations, tests of 100 batches every 500, snapshots at
    5000 and 10000 (about 10 minutes on two CPU cores)."""
    accuracies = check_caffe_log(train(caffe_root, "examples/mnist/lenet_solver.prototxt"), 10000,
                                 test_interval=500, display=100)
    assert min(accuracies[1:]) >= 0.95, accuracies
    # 100 batches of 100 cycle through the 400 held-out digits exactly 25 times.
    assert score_snapshot(caffe_root, 10000, 100) == pytest.approx(accuracies[-1], abs=1e-6)
    assert score_snapshot(caffe_root, 5000, 100) >= 0.95
