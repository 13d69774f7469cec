"""Shared test fixtures: where the copied Caffe reference figures and model prototxts live."""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest

HERE = pathlib.Path(__file__).resolve().parent
FIXTURES = HERE / "fixtures"
REFERENCE = FIXTURES / "reference"
MODELS = FIXTURES / "models"
BUNDLED = HERE.parent / "caffejax" / "models"
SHARED = pathlib.Path(os.environ.get("CAFFEJAX_SHARED", HERE.parent.parent / "shared"))

# Caffe's users often export GLOG_minloglevel=2 to keep its log quiet; caffejax honours it from its import on, so
# the suite's checks of the log lines (caffe's tools, the solvers) would fail under it. Dropped before caffejax is
# imported (and from what the tests' subprocesses inherit); the tests of the variable set it themselves.
os.environ.pop("GLOG_minloglevel", None)
# So too the caches a shell may turn on for every process (caffejax's program cache, JAX's persistent cache,
# beside which caffejax keeps its programs): the suite counts compiles from a cold start, and a program loaded
# from a cache is no compile. The cache's own tests set theirs.
os.environ.pop("CAFFEJAX_PROGRAM_CACHE", None)
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)

if "PYTEST_XDIST_WORKER" in os.environ:
    # One process per core (README's -n auto): on a GPU each would otherwise claim 75% of its memory up front.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

@pytest.fixture
def isolated_registry(monkeypatch):
    """Registrations made by a test (layer rules, fork fields) disappear after it (the registry is process-wide)."""
    from caffejax.frontend import prototxt
    from caffejax.lower import registry

    registry.registered_types()  # the BVLC families are in before the copy
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(prototxt, "_FORK_PARAMS", dict(prototxt._FORK_PARAMS))


def input_layer(*shape, name: str = "x") -> str:
    """An Input layer's prototxt: top ``name`` of ``shape``."""
    dims = " ".join(f"dim: {d}" for d in shape)
    return f'layer {{ name: "in_{name}" type: "Input" top: "{name}" input_param {{ shape {{ {dims} }} }} }}\n'


# Tolerances of ../shared/reference/README.md (mixed: rtol, and atol scaled to the blob's magnitude).
FORWARD_RTOL, FORWARD_ATOL = 1e-4, 1e-5
DIFF_RTOL, DIFF_ATOL = 1e-3, 1e-4


def layer_cases() -> list[str]:
    return sorted(p.stem for p in (REFERENCE / "layers").glob("*.prototxt"))


# Weights of the whole-net cases: in nets/ or, for the real trained models, bundled with caffejax.
NET_CASES = {
    "lenet_trained": (BUNDLED / "lenet" / "lenet.prototxt", BUNDLED / "lenet" / "lenet_iter_10000.caffemodel"),
    "mtcnn_det1": (BUNDLED / "mtcnn" / "det1.prototxt", BUNDLED / "mtcnn" / "det1.caffemodel"),
    "mtcnn_det2": (BUNDLED / "mtcnn" / "det2.prototxt", BUNDLED / "mtcnn" / "det2.caffemodel"),
    "mtcnn_det3": (BUNDLED / "mtcnn" / "det3.prototxt", BUNDLED / "mtcnn" / "det3.caffemodel"),
    "mtcnn_det4": (BUNDLED / "mtcnn" / "det4.prototxt", BUNDLED / "mtcnn" / "det4.caffemodel"),
    "cifar10_quick": (MODELS / "bvlc/examples/cifar10/cifar10_quick.prototxt",
                      REFERENCE / "nets/cifar10_quick.caffemodel"),
    "cifar10_full": (MODELS / "bvlc/examples/cifar10/cifar10_full.prototxt",
                     REFERENCE / "nets/cifar10_full.caffemodel"),
    "mnist_siamese": (MODELS / "bvlc/examples/siamese/mnist_siamese.prototxt",
                      REFERENCE / "nets/mnist_siamese.caffemodel"),
    "lenet_bvlc": (MODELS / "bvlc/examples/mnist/lenet.prototxt", REFERENCE / "nets/lenet_bvlc.caffemodel"),
}


class Case:
    """One reference case: its prototxt, weights and Caffe's figures (npz)."""

    def __init__(self, name: str, prototxt: pathlib.Path, weights: pathlib.Path, npz: pathlib.Path,
                 force_backward: bool = False):
        self.name, self.prototxt, self.weights = name, prototxt, weights
        self.figures = dict(np.load(npz))
        self.force_backward = force_backward

    @property
    def phase(self) -> int:
        # Whole nets have no phase key: they all ran in TEST.
        return 0 if str(self.figures.get("phase", "TEST")) == "TRAIN" else 1

    def keys(self, prefix: str) -> list[str]:
        return [k[len(prefix):] for k in self.figures if k.startswith(prefix)]

    def net_source(self):
        """The prototxt (as text, with force_backward prepended for whole nets, as the figures were made)."""
        text = self.prototxt.read_text()
        return ("force_backward: true\n" + text) if self.force_backward else str(self.prototxt)

    def make_net(self):
        import caffejax

        return caffejax.Net(self.net_source(), self.phase, weights=str(self.weights))

    def feed(self, net) -> None:
        for blob in self.keys("input/"):
            net.blobs[blob].reshape(*self.figures["input/" + blob].shape)
        for blob in self.keys("input/"):
            net.blobs[blob].data[...] = self.figures["input/" + blob]


def layer_case(name: str) -> Case:
    base = REFERENCE / "layers" / name
    return Case(name, base.with_suffix(".prototxt"), base.with_suffix(".caffemodel"), base.with_suffix(".npz"))


def net_case(name: str) -> Case:
    prototxt, weights = NET_CASES[name]
    return Case(name, prototxt, weights, REFERENCE / "nets" / f"{name}.npz", force_backward=True)


def assert_close(got, ref, rtol: float, atol_scale: float, what: str) -> None:
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.shape == ref.shape, f"{what}: shape {got.shape}, Caffe's is {ref.shape}"
    atol = atol_scale * max(float(np.abs(ref).max()) if ref.size else 0.0, 1e-30)
    if not np.allclose(got, ref, rtol=rtol, atol=atol):
        err = np.abs(got - ref)
        worst = np.unravel_index(np.argmax(err - rtol * np.abs(ref)), err.shape)
        raise AssertionError(f"{what}: max abs error {err.max():.3g} (at {worst}: got {got[worst]!r}, Caffe "
                             f"{ref[worst]!r}); tolerance rtol {rtol}, atol {atol:.3g}")


needs_shared = pytest.mark.skipif(not (SHARED / "models").is_dir(), reason="../shared is not present")


def program_calls(monkeypatch, kind: str, note=lambda net: None) -> list:
    """The calls of a Net's programs of one ``kind`` (Net._jitted's: "prepare" lays the weights out, "forward-all"
    recomputes the blobs a pass did not hand back), each as ``note(net)`` at the call, in a list that grows."""
    import caffejax

    calls, jitted = [], caffejax.Net._jitted

    def counting(self, program_kind, *args, **kwargs):
        fn = jitted(self, program_kind, *args, **kwargs)
        return (lambda *a: calls.append(note(self)) or fn(*a)) if program_kind == kind else fn

    monkeypatch.setattr(caffejax.Net, "_jitted", counting)
    return calls
