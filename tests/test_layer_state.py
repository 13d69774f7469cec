"""State layers carry between forwards: RNN/LSTM without expose_hidden continue from the last h_T (c_T).

Caffe's RecurrentLayer::Forward copies the unrolled net's h_T (c_T) into h_0 (c_0) before every forward, so
consecutive forwards over the chunks of a sequence equal one forward over the whole sequence (cont = 1 at
the chunk boundary). Backward treats h_0 as data: it matches the expose_hidden net fed the same h_0.
"""

from __future__ import annotations

import numpy as np
import pytest

import caffejax as caffe

N, I, H = 2, 3, 4


def _net_text(kind: str, t: int, expose: bool = False) -> str:
    hidden = ""
    tops = 'top: "y"'
    if expose:
        names = ["h0", "c0"][: 2 if kind == "LSTM" else 1]
        hidden = "".join(f'layer {{ name: "in_{n}" type: "Input" top: "{n}" '
                         f'input_param {{ shape {{ dim: 1 dim: {N} dim: {H} }} }} }}\n' for n in names)
        tops += "".join(f' top: "{n}_T"' for n in names)
    bottoms = 'bottom: "x" bottom: "cont"' + "".join(f' bottom: "{n}"' for n in (["h0", "c0"][: 2 if kind == "LSTM" else 1] if expose else []))
    return f"""name: "carry"
force_backward: true
layer {{ name: "in_x" type: "Input" top: "x" input_param {{ shape {{ dim: {t} dim: {N} dim: {I} }} }} }}
layer {{ name: "in_cont" type: "Input" top: "cont" input_param {{ shape {{ dim: {t} dim: {N} }} }} }}
{hidden}layer {{ name: "rec" type: "{kind}" {bottoms} {tops}
  recurrent_param {{ num_output: {H} expose_hidden: {str(expose).lower()}
    weight_filler {{ type: "gaussian" std: 0.4 }} bias_filler {{ type: "gaussian" std: 0.4 }} }} }}
"""


def _net(kind: str, t: int, expose: bool = False, phase=caffe.TEST):
    return caffe.Net(_net_text(kind, t, expose), phase)


def _copy_params(src, dst):
    for name, blobs in src.params.items():
        for a, b in zip(blobs, dst.params[name]):
            b.data[...] = a.data


@pytest.mark.parametrize("kind", ["LSTM", "RNN"])
def test_consecutive_forwards_continue_the_sequence(kind):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, N, I)).astype(np.float32)
    cont = np.ones((6, N), np.float32)
    cont[0] = 0
    whole = _net(kind, 6)
    chunked = _net(kind, 3)
    _copy_params(whole, chunked)
    expected = np.array(whole.forward(x=x, cont=cont)["y"])
    first = np.array(chunked.forward(x=x[:3], cont=cont[:3])["y"])
    second = np.array(chunked.forward(x=x[3:], cont=cont[3:])["y"])
    np.testing.assert_allclose(np.concatenate([first, second]), expected, rtol=1e-5, atol=1e-6)
    # cont = 0 at a chunk's start begins a new sequence whatever the carried state is.
    restart = np.array(chunked.forward(x=x[:3], cont=cont[:3])["y"])
    np.testing.assert_allclose(restart, first, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", ["LSTM", "RNN"])
def test_backward_uses_the_state_its_forward_read(kind):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(6, N, I)).astype(np.float32)
    cont = np.ones((6, N), np.float32)
    carried = _net(kind, 3)
    exposed = _net(kind, 3, expose=True)
    _copy_params(carried, exposed)
    hidden = ["h0", "c0"][: 2 if kind == "LSTM" else 1]
    zeros = {n: np.zeros((1, N, H), np.float32) for n in hidden}
    out = exposed.forward(x=x[:3], cont=cont[:3], **zeros)
    state = {n: np.array(out[f"{n}_T"]) for n in hidden}
    carried.forward(x=x[:3], cont=cont[:3])

    carried.forward(x=x[3:], cont=cont[3:])
    expected_y = np.array(exposed.forward(x=x[3:], cont=cont[3:], **state)["y"])
    np.testing.assert_allclose(np.array(carried.blobs["y"].data), expected_y, rtol=1e-5, atol=1e-6)
    top_diff = rng.normal(size=expected_y.shape).astype(np.float32)
    carried.blobs["y"].diff[...] = top_diff
    exposed.blobs["y"].diff[...] = top_diff
    for n in hidden:
        exposed.blobs[f"{n}_T"].diff[...] = 0
    carried.backward()
    exposed.backward()
    np.testing.assert_allclose(carried.blobs["x"].diff, exposed.blobs["x"].diff, rtol=1e-4, atol=1e-6)
    for a, b in zip(carried.params["rec"], exposed.params["rec"]):
        np.testing.assert_allclose(a.diff, b.diff, rtol=1e-4, atol=1e-6)


def test_new_batch_size_and_reset_state_start_from_zeros():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(3, N, I)).astype(np.float32)
    cont = np.ones((3, N), np.float32)
    net = _net("LSTM", 3)
    fresh = np.array(net.forward(x=x, cont=cont)["y"])
    continued = np.array(net.forward(x=x, cont=cont)["y"])
    assert not np.allclose(continued, fresh)
    net.reset_state()
    np.testing.assert_allclose(np.array(net.forward(x=x, cont=cont)["y"]), fresh, rtol=1e-6)
    # A different number of streams: the old state no longer fits and the layer starts from zeros.
    net.blobs["x"].reshape(3, 1, I)
    net.blobs["cont"].reshape(3, 1)
    one = np.array(net.forward(x=x[:, :1], cont=cont[:, :1])["y"])
    np.testing.assert_allclose(one, fresh[:, :1], rtol=1e-5, atol=1e-6)


def test_solver_iterations_carry_the_state(tmp_path):
    """Each training iteration's forward continues from the previous one, as Caffe's Solver::Step does."""
    net_text = _net_text("LSTM", 3).replace('force_backward: true\n', "") + (
        'layer { name: "loss" type: "EuclideanLoss" bottom: "y" bottom: "target" top: "loss" }\n'
        f'layer {{ name: "in_t" type: "Input" top: "target" input_param {{ shape {{ dim: 3 dim: {N} dim: {H} }} }} }}\n')
    # Input layers must come first: move the target's Input before the loss.
    lines = net_text.splitlines()
    target = [line for line in lines if '"in_t"' in line]
    lines = [line for line in lines if '"in_t"' not in line]
    lines.insert(2, target[0])
    (tmp_path / "net.prototxt").write_text("\n".join(lines) + "\n")
    (tmp_path / "solver.prototxt").write_text(
        'net: "net.prototxt"\nbase_lr: 0.0\nlr_policy: "fixed"\nmax_iter: 10\ndisplay: 0\n')
    solver = caffe.SGDSolver(str(tmp_path / "solver.prototxt"))
    rng = np.random.default_rng(3)
    x = rng.normal(size=(3, N, I)).astype(np.float32)
    net = solver.net
    net.blobs["x"].data[...] = x
    net.blobs["cont"].data[...] = 1
    net.blobs["target"].data[...] = 0
    reference = caffe.Net(str(tmp_path / "net.prototxt"), caffe.TEST)
    _copy_params(net, reference)
    losses = []
    for _ in range(2):
        solver.step(1)  # base_lr 0: the weights stay, only the carried state differs between iterations
        losses.append(float(net.blobs["loss"].data))
    expected = [float(reference.forward(x=x, cont=np.ones((3, N), np.float32),
                                        target=np.zeros((3, N, H), np.float32))["loss"]) for _ in range(2)]
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert abs(expected[0] - expected[1]) > 1e-6


def test_dummy_data_makes_the_nets_float_type():
    """DummyData draws its tops in the net's dtype (ctx.dtype), so a float64 net stays float64 throughout."""
    import jax

    text = """name: "dummy"
layer { name: "d" type: "DummyData" top: "a" dummy_data_param { shape { dim: 2 dim: 3 }
        data_filler { type: "gaussian" std: 1 } } }
layer { name: "s" type: "Scale" bottom: "a" top: "b" param { lr_mult: 0 } scale_param { filler { value: 3 } } }
"""
    with jax.enable_x64(True):
        net = caffe.Net(text, caffe.TEST, dtype=np.float64)
        out = net.forward()
        a = net.blobs["a"].data
        assert a.dtype == np.float64
        assert np.any(a.astype(np.float32).astype(np.float64) != a), "drawn in float32, then widened"
        assert out["b"].dtype == np.float64
        np.testing.assert_allclose(out["b"], 3 * net.blobs["a"].data, rtol=1e-15)
