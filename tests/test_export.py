"""caffejax.export: StableHLO files that run with JAX alone, and Flax NNX modules holding Caffe's weights."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import caffejax
from caffejax import layers as L
from caffejax.errors import CaffejaxError, ShapeError
from caffejax.export import export_stablehlo, load_flax_state, load_stablehlo, save_flax_state, to_flax
from conftest import BUNDLED

pytest.importorskip("flatbuffers", reason="jax.export serialization needs flatbuffers")

NETS = {
    "lenet": (BUNDLED / "lenet" / "lenet.prototxt", BUNDLED / "lenet" / "lenet_iter_10000.caffemodel",
              {"data": (2, 1, 28, 28)}),
    "mtcnn_det2": (BUNDLED / "mtcnn" / "det2.prototxt", BUNDLED / "mtcnn" / "det2.caffemodel",
                   {"data": (2, 3, 24, 24)}),
}


def inputs_for(shapes, seed=0):
    rng = np.random.default_rng(seed)
    return {name: rng.random(shape, dtype=np.float32) for name, shape in shapes.items()}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """Per bundled model at batch 2: (net, inputs, Net.forward's outputs, exported file, loaded export)."""
    out = {}
    for name, (prototxt, weights, shapes) in NETS.items():
        net = caffejax.Net(str(prototxt), str(weights), caffejax.TEST)
        for blob, shape in shapes.items():
            net.blobs[blob].reshape(*shape)
        inputs = inputs_for(shapes)
        expected = {k: np.array(v) for k, v in net.forward(**inputs).items()}
        path = tmp_path_factory.mktemp("export") / f"{name}.stablehlo"
        export_stablehlo(net, str(path))
        out[name] = (net, inputs, expected, path, load_stablehlo(str(path)))
    return out


def run(model, inputs):
    """A to_flax module's forward, compiled (eager dispatch of a whole net is slow)."""
    from flax import nnx

    return _jitted("run", lambda: nnx.jit(lambda m, x: m(**x)))(model, inputs)


def loss_and_grads(model, inputs):
    from flax import nnx

    return _jitted("grad", lambda: nnx.jit(lambda m, x: nnx.value_and_grad(lambda m: m.loss(**x))(m)))(model, inputs)


_JITTED = {}


def _jitted(name, make):
    if name not in _JITTED:
        _JITTED[name] = make()
    return _JITTED[name]


def assert_outputs_close(got, expected):
    assert sorted(got) == sorted(expected)
    for name in expected:
        np.testing.assert_allclose(np.asarray(got[name]), expected[name], rtol=1e-5, atol=1e-5, err_msg=name)


def test_stablehlo_round_trip(cases):
    for name, (_, inputs, expected, _, model) in cases.items():
        assert model.input_shapes == {blob: x.shape for blob, x in inputs.items()}, name
        assert_outputs_close(model(**inputs), expected)


JAX_ONLY_RUNNER = textwrap.dedent("""
    import sys
    sys.modules["caffejax"] = None  # any import of caffejax now fails
    import numpy as np
    from jax import export
    for path in sys.argv[1:]:
        exported = export.deserialize(bytearray(open(path, "rb").read()))
        out = exported.call(dict(np.load(path + ".in.npz")))
        np.savez(path + ".out.npz", **{k: np.asarray(v) for k, v in out.items()})
""")


def test_stablehlo_runs_with_jax_alone(cases):
    """The file is the whole model: a fresh process with only jax (caffejax blocked) reproduces Net.forward."""
    for _, inputs, _, path, _ in cases.values():
        np.savez(f"{path}.in.npz", **inputs)
    paths = [str(path) for _, _, _, path, _ in cases.values()]
    subprocess.run([sys.executable, "-c", JAX_ONLY_RUNNER, *paths], check=True, timeout=120)
    for _, _, expected, path, _ in cases.values():
        assert_outputs_close(dict(np.load(f"{path}.out.npz")), expected)


def test_stablehlo_checks_inputs(cases, tmp_path):
    _, inputs, _, _, model = cases["lenet"]
    with pytest.raises(ShapeError, match="has shape"):
        model(data=np.concatenate([inputs["data"], inputs["data"]]))  # batch 4 given to a batch-2 program
    with pytest.raises(CaffejaxError, match="takes inputs"):
        model(image=inputs["data"])
    (tmp_path / "junk").write_bytes(b"not an export")
    with pytest.raises(CaffejaxError, match="not a caffejax StableHLO export"):
        load_stablehlo(str(tmp_path / "junk"))
    with pytest.raises(CaffejaxError, match="cannot read"):
        load_stablehlo(str(tmp_path / "missing"))


@pytest.mark.parametrize("name", sorted(NETS))
def test_flax_module_reproduces_forward(cases, name, tmp_path):
    nnx = pytest.importorskip("flax.nnx")

    net, inputs, expected, _, _ = cases[name]
    model = to_flax(net)
    assert_outputs_close(run(model, inputs), expected)
    params = nnx.state(model, nnx.Param)
    for layer, blobs in net.params.items():  # every learnable blob, under its layer's name
        for i, blob in enumerate(blobs):
            np.testing.assert_array_equal(np.asarray(params["params"][layer][i][...]), blob.data)
    path = tmp_path / "state.msgpack"
    save_flax_state(model, str(path))
    fresh = to_flax(net)
    first = next(iter(net.params))
    fresh.params[first][0][...] = fresh.params[first][0][...] * 0
    load_flax_state(fresh, str(path))
    assert_outputs_close(run(fresh, inputs), expected)


def small_train_net():
    """A small classifier with a BatchNorm (statistics as BatchStat) and a frozen blob (lr_mult 0)."""
    n = caffejax.NetSpec()
    n.data = L.Input(shape=dict(dim=[4, 3]))
    n.label = L.Input(shape=dict(dim=[4]))
    n.ip1 = L.InnerProduct(n.data, num_output=5, weight_filler=dict(type="gaussian", std=0.5),
                           bias_filler=dict(type="constant", value=0.1), param=[dict(lr_mult=1), dict(lr_mult=0)])
    n.bn = L.BatchNorm(n.ip1)
    n.relu = L.ReLU(n.bn, in_place=True)
    n.ip2 = L.InnerProduct(n.bn, num_output=3, weight_filler=dict(type="gaussian", std=0.5))
    n.loss = L.SoftmaxWithLoss(n.ip2, n.label)
    return caffejax.Net(n.to_proto(), caffejax.TRAIN)


def test_flax_trains_with_caffes_objective():
    nnx = pytest.importorskip("flax.nnx")
    optax = pytest.importorskip("optax")

    net = small_train_net()
    rng = np.random.default_rng(0)
    batch = {"data": rng.standard_normal((4, 3)).astype(np.float32),
             "label": np.array([0, 1, 2, 1], np.float32)}
    model = to_flax(net)
    assert isinstance(model.params["bn"][0], nnx.BatchStat)
    assert model.params["ip1"][1].lr_mult == 0 and model.params["ip1"][0].lr_mult == 1

    loss, grads = loss_and_grads(model, batch)
    want_loss, want_grads = jax.jit(caffejax.value_and_grad(net))(net.param_arrays(), batch)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    for layer in ("ip1", "ip2"):
        for i, want in enumerate(want_grads[layer]):
            np.testing.assert_allclose(np.asarray(grads["params"][layer][i][...]), np.asarray(want), rtol=1e-5,
                                       atol=1e-6, err_msg=f"{layer}[{i}]")
    assert not np.any(np.asarray(grads["params"]["ip1"][1][...]))  # lr_mult 0: Caffe's mask, no gradient

    # A forward in TRAIN (here the loss's) updates BatchNorm's statistics, as Net.forward does.
    net.forward(**batch)
    for i, blob in enumerate(net.params["bn"]):
        np.testing.assert_allclose(np.asarray(model.params["bn"][i][...]), blob.data, rtol=1e-6, atol=1e-7)

    @nnx.jit
    def train_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lambda m: m.loss(**batch))(model)
        optimizer.update(model, grads)
        return loss

    optimizer = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)
    losses = [float(train_step(model, optimizer, batch)) for _ in range(4)]
    assert losses[-1] < losses[0]


def test_stablehlo_batch_and_several_inputs(tmp_path):
    net = small_train_net()
    path = tmp_path / "small.stablehlo"
    export_stablehlo(net, str(path), batch=7)
    model = load_stablehlo(str(path))
    assert model.input_shapes == {"data": (7, 3), "label": (7,)}
    out = model(data=np.ones((7, 3), np.float32), label=np.zeros(7, np.float32))
    assert sorted(out) == ["loss"] and np.isfinite(float(out["loss"]))


def test_flax_module_checks_inputs():
    pytest.importorskip("flax")
    prototxt, weights, _ = NETS["lenet"]
    model = to_flax(caffejax.Net(str(prototxt), str(weights), caffejax.TEST))
    with pytest.raises(CaffejaxError, match=r"missing \['data'\]"):
        model(image=np.zeros((1, 1, 28, 28), np.float32))


def test_flax_shared_blobs_live_with_their_owner():
    nnx = pytest.importorskip("flax.nnx")
    n = caffejax.NetSpec()
    n.data = L.Input(shape=dict(dim=[2, 3]))
    n.a = L.InnerProduct(n.data, num_output=3, weight_filler=dict(type="gaussian"), param=[dict(name="w"), {}])
    n.b = L.InnerProduct(n.a, num_output=3, param=[dict(name="w"), {}], bias_filler=dict(type="constant", value=1))
    net = caffejax.Net(n.to_proto(), caffejax.TEST)
    model = to_flax(net)
    assert [path for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))] == [
        ("params", "a", 0), ("params", "a", 1), ("params", "b", 1)]
    x = np.random.default_rng(0).random((2, 3), dtype=np.float32)
    assert_outputs_close(run(model, {"data": x}), {"b": np.array(net.forward(data=x)["b"])})
