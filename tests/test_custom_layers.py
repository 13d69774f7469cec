"""Custom and fork layers: pure-JAX layer types (caffejax.register_layer), the rules for popular Caffe forks'
layers (caffejax.lower.forks) with their prototxt fields, and pycaffe Python layers when the user allows them."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import caffejax
from caffejax.export import export_stablehlo
from caffejax.frontend import prototxt
from caffejax.frontend.prototxt import ForkParam, ForkParamField, register_fork_param
from caffejax.lower import forks, registry
from caffejax.proto import caffe_pb2
from conftest import input_layer as _input


# ---- register_layer ---------------------------------------------------------------------------------------------

def _scaled_square(ctx, bottoms, params):
    (x,) = bottoms
    return [params[0] * x * x]


def test_register_layer_adds_a_pure_jax_layer(isolated_registry):
    caffejax.register_layer("ScaledSquare", _scaled_square, param_shapes=lambda layer, shapes: [shapes[0][1:]],
                             init_params=lambda layer, shapes, key: [np.full(shapes[0], 3, np.float32)],
                             bottoms=(1, 1), tops=(1, 1))
    net = caffejax.Net("force_backward: true\n" + _input(2, 3)
                       + 'layer { name: "sq" type: "ScaledSquare" bottom: "x" top: "y" loss_weight: 1 }',
                       caffejax.TRAIN)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_allclose(net.forward(x=x)["y"], 3 * x * x)
    net.backward()
    np.testing.assert_allclose(net.blobs["x"].diff, 6 * x)
    np.testing.assert_allclose(net.params["sq"][0].diff, (x * x).sum(0))


def positives_before_a_pass(ctx, bottoms, params):
    return [jnp.zeros((0,), bottoms[0].dtype)]


def positives(layer, bottoms):
    (x,) = bottoms
    return [x[x > 0]]


def positives_backward(layer, bottoms, tops, top_diffs, propagate_down):
    (x,), (diff,) = bottoms, top_diffs
    dx = np.zeros_like(x)
    dx[x > 0] = diff
    return [dx if propagate_down[0] else None]


def test_register_layer_with_host_forward_makes_a_top_whose_shape_depends_on_the_data(isolated_registry):
    """``host_forward`` (NumPy) runs such a layer on the host after the program; ``forward`` gives only its shape
    before the first pass. Its top takes each pass's shape, in Net.forward and compile_inference alike;
    ``host_backward`` is its backward."""
    caffejax.register_layer("Positives", positives_before_a_pass, host_forward=positives, bottoms=(1, 1),
                            tops=(1, 1), host_backward=positives_backward)
    text = (_input(5) + 'layer { name: "double" type: "Power" bottom: "x" top: "y" power_param { scale: 2 } }\n'
            + 'layer { name: "p" type: "Positives" bottom: "y" top: "p" }')
    net = caffejax.Net(text, caffejax.TEST)
    assert net.blobs["p"].shape == (0,)
    np.testing.assert_array_equal(net.forward(x=np.float32([-1, 2, -3, 4, 5]))["p"], [4, 8, 10])
    np.testing.assert_array_equal(net.forward(x=np.float32([1, -2, -3, -4, -5]))["p"], [2])
    assert net.blobs["p"].shape == (1,)
    infer = caffejax.compile_inference(net)
    np.testing.assert_array_equal(infer({"x": np.float32([3, 0, 1, -1, 2])})["p"], [6, 2, 4])
    with pytest.raises(caffejax.SchemaError, match="host_forward must be callable"):
        caffejax.register_layer("Bad", positives_before_a_pass, host_forward="positives")
    with pytest.raises(caffejax.SchemaError, match="host_backward .* needs host_forward"):
        caffejax.register_layer("Bad", positives_before_a_pass, host_backward=positives_backward)
    # ``host_backward`` is its Backward on the host, between the programs of the layers after it and before it.
    trained = caffejax.Net("force_backward: true\n" + text + '\nlayer { name: "half" type: "Power" bottom: "p" '
                           'top: "h" power_param { scale: 0.5 } loss_weight: 1 }', caffejax.TRAIN)
    trained.forward(x=np.float32([-1, 2, -3, 4, 5]))
    np.testing.assert_array_equal(trained.backward()["x"], [0, 1, 0, 1, 1])
    # A rule giving the wrong number of tops or diffs, or a diff of the wrong shape, is named.
    caffejax.register_layer("Positives", positives_before_a_pass, host_forward=lambda layer, bottoms: [],
                            host_backward=lambda *args: [], override=True)
    with pytest.raises(caffejax.GraphError, match=r"layer 'p' \(type Positives\): its forward on the host gave 0 "
                                                  r"tops; the layer has 1 \(p\)"):
        caffejax.Net(text, caffejax.TEST).forward(x=np.ones(5, np.float32))
    caffejax.register_layer("Positives", positives_before_a_pass, host_forward=positives,
                            host_backward=lambda *args: [], override=True)
    trained = caffejax.Net("force_backward: true\n" + text + '\nlayer { name: "half" type: "Power" bottom: "p" '
                           'top: "h" power_param { scale: 0.5 } loss_weight: 1 }', caffejax.TRAIN)
    trained.forward(x=np.ones(5, np.float32))
    with pytest.raises(caffejax.GraphError, match=r"layer 'p' \(type Positives\): its backward on the host gave 0 "
                                                  r"diffs; the layer has 1 bottoms \(y\)"):
        trained.backward()
    caffejax.register_layer("Positives", positives_before_a_pass, host_forward=positives,
                            host_backward=lambda layer, bottoms, *rest: [np.ones(2, np.float32)], override=True)
    with pytest.raises(caffejax.ShapeError, match=r"layer 'p' \(type Positives\): its backward gave bottom 'y' a "
                                                  r"diff of shape \(2,\); the blob is \(5,\)"):
        trained.backward()


def test_a_blob_only_layers_run_on_the_host_read_is_split_there(isolated_registry):
    """A blob that only layers run on the host read is split on the host too (LayerRule.host_when_read_on_host),
    so no program reads it for them. The Split's backward there sums their diffs into the blob's, in order, as
    SplitLayer::Backward does: in one pass, and layer by layer."""
    caffejax.register_layer("Positives", positives_before_a_pass, host_forward=positives, bottoms=(1, 1),
                            tops=(1, 1), host_backward=positives_backward)
    net = caffejax.Net("force_backward: true\n" + _input(5) + """
        layer { name: "p1" type: "Positives" bottom: "x" top: "p1" }
        layer { name: "p2" type: "Positives" bottom: "x" top: "p2" }
        layer { name: "half" type: "Power" bottom: "p1" top: "h" power_param { scale: 0.5 } loss_weight: 1 }
        layer { name: "double" type: "Power" bottom: "p2" top: "d" power_param { scale: 2 } loss_weight: 1 }""",
                       caffejax.TRAIN)
    assert [layer.name for layer in net.graph.layers if layer.runs_on_host] == ["x_in_x_0_split", "p1", "p2"]
    x = np.float32([-1, 2, -3, 4, 5])
    for layer_by_layer in (False, True):
        if layer_by_layer:
            net.after_backward(lambda i: None)
        outputs = net.forward(x=x)
        np.testing.assert_array_equal(outputs["h"], [1, 2, 2.5])
        np.testing.assert_array_equal(outputs["d"], [4, 8, 10])
        np.testing.assert_array_equal(net.backward()["x"], [0, 2.5, 0, 2.5, 2.5])
        np.testing.assert_array_equal(net.blobs["x_in_x_0_split_1"].diff, [0, 2, 0, 2, 2])


def test_nets_with_registered_rules_stay_out_of_the_program_cache(isolated_registry, tmp_path, monkeypatch):
    """The program cache's key digests caffejax's source, not the user's rule: such programs are not kept."""
    from caffejax.runtime import program_cache

    monkeypatch.setenv(program_cache.ENVIRONMENT, str(tmp_path))
    caffejax.register_layer("ScaledSquare", _scaled_square, param_shapes=lambda layer, shapes: [shapes[0][1:]],
                             bottoms=(1, 1), tops=(1, 1))
    net = caffejax.Net(_input(2, 3) + 'layer { name: "sq" type: "ScaledSquare" bottom: "x" top: "y" }',
                       caffejax.TEST)
    caffejax.compile_inference(net)({"x": np.ones((2, 3), np.float32)})
    plain = caffejax.Net(_input(2, 3) + 'layer { name: "r" type: "ReLU" bottom: "x" top: "y" }', caffejax.TEST)
    caffejax.compile_inference(plain)({"x": np.ones((2, 3), np.float32)})
    assert len(list(tmp_path.glob("*.program"))) == 1  # the ReLU net's only


def test_register_layer_refuses_what_it_should(isolated_registry):
    with pytest.raises(caffejax.SchemaError, match="'ReLU' is a BVLC Caffe layer type; pass override=True"):
        caffejax.register_layer("ReLU", _scaled_square)
    with pytest.raises(caffejax.SchemaError, match="'Python' is Caffe's own type"):
        caffejax.register_layer("Python", _scaled_square)
    with pytest.raises(caffejax.SchemaError, match="forward must be callable"):
        caffejax.register_layer("Bad", "not a function")
    with pytest.raises(caffejax.SchemaError, match="bottoms must be"):
        caffejax.register_layer("Bad", _scaled_square, bottoms=(2, 1))
    caffejax.register_layer("Mine", _scaled_square)
    with pytest.raises(caffejax.SchemaError, match="'Mine' is already registered"):
        caffejax.register_layer("Mine", _scaled_square)
    # Replacing a BVLC rule is possible when asked for explicitly.
    caffejax.register_layer("AbsVal", lambda ctx, bottoms, params: [-jnp.abs(bottoms[0])], override=True)
    net = caffejax.Net(_input(3) + 'layer { name: "a" type: "AbsVal" bottom: "x" top: "y" }', caffejax.TEST)
    np.testing.assert_array_equal(net.forward(x=np.array([-1, 2, -3], np.float32))["y"], [-1, -2, -3])


# ---- fork fields and fork layers ---------------------------------------------------------------------------------

def test_fork_fields_parse_only_once_registered(isolated_registry):
    text = _input(1, 2, 3, 3) + 'layer { name: "up" type: "Upsample" bottom: "x" top: "y" upsample_param { scale: 2 } }'
    with pytest.raises(caffejax.ParseError, match="register_upsample"):
        caffejax.Net(text, caffejax.TEST)
    forks.register_upsample()
    forks.register_upsample()  # again: a no-op
    assert caffejax.Net(text, caffejax.TEST).blobs["y"].shape == (1, 2, 6, 6)
    with pytest.raises(caffejax.ParseError, match=r'<string>:2:\d+: Message type "caffe.UpsampleParameter" has no '
                                                  r'field named "factor"'):
        caffejax.Net(text.replace("scale", "factor"), caffejax.TEST)


def test_a_fork_layer_met_unregistered_says_how_to_enable_it(isolated_registry, tmp_path, capsys):
    """By its field (a ParseError) or by its type alone (ReLU6 has no field): the function to call, and the
    command line's --fork-layers, which enables them all for any command."""
    from caffejax.cli import main

    with pytest.raises(caffejax.GraphError, match=r"unknown layer type 'ReLU6'\. It is a Caffe fork's layer "
                                                  r"\(MobileNet Caffe ports\): call caffejax\.lower\.forks\."
                                                  r"register_relu6\(\) .*\(on the command line, --fork-layers\)"):
        caffejax.Net(_input(1, 2) + 'layer { name: "r" type: "ReLU6" bottom: "x" top: "y" }', caffejax.TEST)
    text = _input(1, 2, 3, 3) + 'layer { name: "up" type: "Upsample" bottom: "x" top: "y" upsample_param { scale: 2 } }'
    (tmp_path / "up.prototxt").write_text(text)
    with pytest.raises(caffejax.ParseError, match=r"register_upsample\(\) .*--fork-layers"):
        caffejax.Net(text, caffejax.TEST)
    assert main(["time", "-model", str(tmp_path / "up.prototxt"), "-iterations", "1"]) == 1
    assert "--fork-layers" in capsys.readouterr().err
    assert main(["time", "--fork-layers", "-model", str(tmp_path / "up.prototxt"), "-iterations", "1"]) == 0
    assert main(["--fork-layers", "time", "-model", str(tmp_path / "up.prototxt"), "-iterations", "1"]) == 0


def test_register_fork_param_checks_the_declaration(isolated_registry):
    field = (ForkParamField("k", "int32", 1, default=2),)
    with pytest.raises(caffejax.SchemaError, match="number 143 is LayerParameter's 'input_param'"):
        register_fork_param(ForkParam("my_param", "MyParameter", 143, field))
    with pytest.raises(caffejax.SchemaError, match="'convolution_param' is not a new LayerParameter field"):
        register_fork_param(ForkParam("convolution_param", "MyParameter", 9001, field))
    with pytest.raises(caffejax.SchemaError, match="unknown type 'int33'"):
        register_fork_param(ForkParam("my_param", "MyParameter", 9001, (ForkParamField("k", "int33", 1),)))
    with pytest.raises(caffejax.SchemaError, match="message name 'FillerParameter' is taken"):
        register_fork_param(ForkParam("my_param", "FillerParameter", 9001, field))
    register_fork_param(ForkParam("my_param", "MyParameter", 9001, field))
    with pytest.raises(caffejax.SchemaError, match="already registered with another declaration"):
        register_fork_param(ForkParam("my_param", "MyParameter", 9002, field))

    # A user's own layer reading its own fork field.
    def times_k(ctx, bottoms, params):
        return [bottoms[0] * prototxt.fork_param(ctx.layer, "my_param").k]

    caffejax.register_layer("TimesK", times_k, bottoms=(1, 1), tops=(1, 1))
    net = caffejax.Net(_input(2) + 'layer { name: "a" type: "TimesK" bottom: "x" top: "y" my_param { k: 5 } }\n'
                       + 'layer { name: "b" type: "TimesK" bottom: "y" top: "z" }', caffejax.TEST)
    np.testing.assert_array_equal(net.forward(x=np.array([1, 2], np.float32))["z"], [10, 20])  # 5, then default 2
    # The field travels inside the layer (as a protobuf unknown field): into what Net.save writes, too.
    saved = {layer.name: layer for layer in net.to_proto().layer}
    assert prototxt.fork_param(saved["a"], "my_param").k == 5
    assert prototxt.fork_param(saved["b"], "my_param").k == 2


def _caffe_interp_axis(n_in: int, n_out: int, i: int):
    """caffe_cpu_interp2's sampling of output index i along one axis, in its float32 arithmetic:
    (input index, step to the next one (0 at the edge), weight of the first, weight of the second)."""
    ratio = np.float32(n_in - 1) / np.float32(n_out - 1) if n_out > 1 else np.float32(0)
    position = np.float32(ratio * np.float32(i))
    first = int(position)
    second_weight = np.float32(position - np.float32(first))
    return first, 1 if first < n_in - 1 else 0, np.float32(1) - second_weight, second_weight


def _caffe_interp2(x: np.ndarray, out: tuple[int, int]) -> np.ndarray:
    """DeepLab's caffe_cpu_interp2 (unpacked, no crop), its loops as written, in float32."""
    y = np.zeros(x.shape[:2] + tuple(out), np.float32)
    for i in range(out[0]):
        h, hp, h0, h1 = _caffe_interp_axis(x.shape[2], out[0], i)
        for j in range(out[1]):
            w, wp, w0, w1 = _caffe_interp_axis(x.shape[3], out[1], j)
            y[:, :, i, j] = (h0 * (w0 * x[:, :, h, w] + w1 * x[:, :, h, w + wp])
                             + h1 * (w0 * x[:, :, h + hp, w] + w1 * x[:, :, h + hp, w + wp]))
    return y


def _caffe_interp2_backward(g: np.ndarray, size_in: tuple[int, int]) -> np.ndarray:
    """DeepLab's caffe_cpu_interp2_backward (no crop), its loops as written: each top diff added to the four
    bottom cells it blends, in float32."""
    dx = np.zeros(g.shape[:2] + tuple(size_in), np.float32)
    for i in range(g.shape[2]):
        h, hp, h0, h1 = _caffe_interp_axis(size_in[0], g.shape[2], i)
        for j in range(g.shape[3]):
            w, wp, w0, w1 = _caffe_interp_axis(size_in[1], g.shape[3], j)
            dx[:, :, h, w] += h0 * w0 * g[:, :, i, j]
            dx[:, :, h, w + wp] += h0 * w1 * g[:, :, i, j]
            dx[:, :, h + hp, w] += h1 * w0 * g[:, :, i, j]
            dx[:, :, h + hp, w + wp] += h1 * w1 * g[:, :, i, j]
    return dx


@pytest.mark.parametrize("param, size", [("zoom_factor: 3", (10, 13)), ("shrink_factor: 2", (2, 3)),
                                         ("height: 7 width: 4", (7, 4)),
                                         ("zoom_factor: 2 shrink_factor: 2", (3, 5))])
def test_interp_is_deeplabs_bilinear_resize(isolated_registry, param, size):
    forks.register_interp()
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 5)).astype(np.float32)
    net = caffejax.Net("force_backward: true\n" + _input(2, 3, 4, 5)
                       + f'layer {{ name: "i" type: "Interp" bottom: "x" top: "y" interp_param {{ {param} }} }}',
                       caffejax.TEST)
    y = net.forward(x=x)["y"]
    assert y.shape[2:] == size
    np.testing.assert_allclose(y, _caffe_interp2(x, size), rtol=1e-6, atol=1e-6)
    # Caffe's backward is the adjoint of this linear map: <interp(x), g> = <x, interp^T(g)>.
    g = np.random.default_rng(1).standard_normal(y.shape).astype(np.float32)
    net.blobs["y"].diff[...] = g
    net.backward()
    np.testing.assert_allclose(np.sum(y * g), np.sum(x * net.blobs["x"].diff), rtol=1e-5)
    np.testing.assert_allclose(net.blobs["x"].diff, _caffe_interp2_backward(g, x.shape[2:]), rtol=1e-5, atol=1e-5)


def test_interp_crops_and_resizes_to_a_second_bottom(isolated_registry):
    forks.register_interp()
    x = np.random.default_rng(2).standard_normal((1, 2, 6, 6)).astype(np.float32)
    net = caffejax.Net(_input(1, 2, 6, 6) + _input(1, 1, 9, 9, name="ref")
                       + 'layer { name: "i" type: "Interp" bottom: "x" bottom: "ref" top: "y" '
                         'interp_param { pad_beg: -1 pad_end: -1 } }', caffejax.TEST)
    np.testing.assert_allclose(net.forward(x=x, ref=np.zeros((1, 1, 9, 9), np.float32))["y"],
                               _caffe_interp2(x[:, :, 1:5, 1:5], (9, 9)), rtol=1e-6, atol=1e-6)
    with pytest.raises(caffejax.ShapeError, match="larger than caffejax allows"):
        caffejax.Net(_input(1, 2, 6, 6) + 'layer { name: "i" type: "Interp" bottom: "x" top: "y" '
                                          'interp_param { zoom_factor: 100000000 } }', caffejax.TEST)


def test_ssd_normalize_permute_and_relu6(isolated_registry):
    forks.register_all()
    x = (np.random.default_rng(3).standard_normal((2, 3, 4, 5)) * 5).astype(np.float32)
    net = caffejax.Net(_input(2, 3, 4, 5)
                       + 'layer { name: "n" type: "Normalize" bottom: "x" top: "n" norm_param { across_spatial: '
                         'false channel_shared: false scale_filler { type: "constant" value: 20 } } }\n'
                       + 'layer { name: "s" type: "Normalize" bottom: "x" top: "s" }\n'
                       + 'layer { name: "p" type: "Permute" bottom: "x" top: "p" permute_param { order: 0 order: 2 '
                         'order: 3 order: 1 } }\n'
                       + 'layer { name: "r" type: "ReLU6" bottom: "x" top: "r" }', caffejax.TEST)
    assert net.params["n"][0].data.shape == (3,) and net.params["s"][0].data.shape == ()
    np.testing.assert_array_equal(net.params["n"][0].data, 20)
    out = net.forward(x=x)
    np.testing.assert_allclose(out["n"], 20 * x / np.sqrt((x * x).sum(1, keepdims=True) + 1e-10), rtol=1e-5)
    np.testing.assert_allclose(out["s"], x / np.sqrt((x * x).sum((1, 2, 3), keepdims=True) + 1e-10), rtol=1e-5)
    np.testing.assert_array_equal(out["p"], x.transpose(0, 2, 3, 1))
    np.testing.assert_array_equal(out["r"], np.clip(x, 0, 6))
    net.blobs["x"].reshape(0, 3, 4, 5)  # no image: Caffe's loops over num run zero times
    empty = net.forward(x=np.zeros((0, 3, 4, 5), np.float32))
    assert {name: value.shape for name, value in empty.items()} == {
        "n": (0, 3, 4, 5), "s": (0, 3, 4, 5), "p": (0, 4, 5, 3), "r": (0, 3, 4, 5)}
    with pytest.raises(caffejax.SchemaError, match="order lists axis 1 twice"):
        caffejax.Net(_input(2, 3) + 'layer { name: "p" type: "Permute" bottom: "x" top: "p" '
                                    'permute_param { order: 1 order: 1 } }', caffejax.TEST)


def _prior_box_net(prior_box_param: str, feature=(8, 6), image=(32, 24)) -> str:
    return (_input(1, 3, *image, name="data") + _input(1, 2, *feature, name="feat")
            + f'layer {{ name: "pb" type: "PriorBox" bottom: "feat" bottom: "data" top: "pb" '
              f'prior_box_param {{ {prior_box_param} }} }}\n')


def test_ssd_prior_box_follows_the_layers_formula(isolated_registry):
    """PriorBox (SSD's prior_box_layer.cpp) by hand: per cell, row-major, the min_size square, the
    sqrt(min_size * max_size) square, then min_size * sqrt(ar) by min_size / sqrt(ar) per new aspect ratio (its flip
    next); centres (x + offset) * step with step = image / feature size unless given; corners over img_w / img_h
    where given (OpenCV ignores img_size, img_h and img_w, and clips by default: Caffe does not); variances in
    channel 1. Repeated ratios are dropped; bad settings are SchemaErrors."""
    forks.register_prior_box()
    net = caffejax.Net(_prior_box_net("min_size: 6 max_size: 24 aspect_ratio: 4 aspect_ratio: 4 variance: 0.1 "
                                      "variance: 0.1 variance: 0.2 variance: 0.2 img_h: 40 img_w: 50 offset: 0.25"),
                       caffejax.TEST)
    top = np.asarray(net.forward()["pb"])
    assert top.shape == (1, 2, 8 * 6 * 4 * 4)
    sizes = [(6, 6), (12, 12), (12, 3), (3, 12)]  # min, sqrt(6 * 24), ar 4, its flip 1/4
    step_w, step_h = np.float32(50 / 6), np.float32(40 / 8)
    expected = []
    for h in range(8):
        for w in range(6):
            cx, cy = np.float32((w + 0.25) * step_w), np.float32((h + 0.25) * step_h)
            for bw, bh in sizes:
                expected += [(cx - bw / 2) / 50, (cy - bh / 2) / 40, (cx + bw / 2) / 50, (cy + bh / 2) / 40]
    np.testing.assert_allclose(top[0, 0], expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(top[0, 1], np.tile(np.float32([0.1, 0.1, 0.2, 0.2]), 8 * 6 * 4))
    clipped = caffejax.Net(_prior_box_net("min_size: 30 img_size: 100 step: 10 clip: true"), caffejax.TEST)
    corners = np.asarray(clipped.forward()["pb"])[0, 0].reshape(8, 6, 4)
    np.testing.assert_allclose(corners[0, 0], [0, 0, 0.2, 0.2], atol=1e-7)  # centre 5: -0.1 clipped to 0
    np.testing.assert_allclose(corners[7, 5], [0.4, 0.6, 0.7, 0.9], rtol=1e-6)  # centre (55, 75)
    for bad, message in (("", "must provide min_size"), ("min_size: 8 max_size: 4", "greater than min_size"),
                         ("min_size: 8 variance: 0.1 variance: 0.2", "give 1 or 4 positive variances"),
                         ("min_size: 8 img_size: 30 img_h: 20", "Either img_size or img_h/img_w"),
                         ("min_size: 8 step: 4 step_w: 2", "Either step or step_h/step_w")):
        with pytest.raises(caffejax.SchemaError, match=message):
            caffejax.Net(_prior_box_net(bad), caffejax.TEST)


@pytest.mark.parametrize("prior_box_param", [
    "min_size: 8 max_size: 16 aspect_ratio: 2 clip: false variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2",
    "min_size: 8 aspect_ratio: 2 aspect_ratio: 3 flip: false clip: true variance: 0.1",
    "min_size: 10 min_size: 20 max_size: 15 max_size: 30 aspect_ratio: 3 step: 5 offset: 0.25 clip: false "
    "variance: 0.2"])
def test_ssd_prior_box_matches_opencv(prior_box_param, isolated_registry, tmp_path):
    """OpenCV's PriorBox, another reading of the SSD layer, gives the same boxes where both read the same fields."""
    cv2 = pytest.importorskip("cv2")
    forks.register_prior_box()
    (tmp_path / "pb.prototxt").write_text(_prior_box_net(prior_box_param))
    net = caffejax.Net(str(tmp_path / "pb.prototxt"), caffejax.TEST)
    net.save(str(tmp_path / "pb.caffemodel"))
    theirs = cv2.dnn.readNetFromCaffe(str(tmp_path / "pb.prototxt"), str(tmp_path / "pb.caffemodel"))
    theirs.setInput(np.zeros((1, 3, 32, 24), np.float32), "data")
    theirs.setInput(np.zeros((1, 2, 8, 6), np.float32), "feat")
    np.testing.assert_allclose(np.asarray(net.forward()["pb"]), theirs.forward("pb"), rtol=1e-6, atol=1e-7)


def test_relu6_gradient_is_the_forks(isolated_registry):
    forks.register_relu6()
    rule = registry.get_rule("ReLU6")
    x = jnp.array([-1.0, 0.0, 3.0, 6.0, 7.0, jnp.nan])
    y, grad = jax.vjp(lambda v: rule.forward(None, [v], [])[0], x)
    np.testing.assert_array_equal(y, [0, 0, 3, 6, 6, np.nan])
    np.testing.assert_array_equal(grad(jnp.ones(6))[0], [0, 0, 1, 0, 0, 1])


# ---- Python layers, when allowed -----------------------------------------------------------------------------------

LAYERS_MODULE = '''
import numpy as np
import caffejax


class EuclideanLoss(caffejax.Layer):
    """pycaffe's examples/pycaffe/layers/pyloss.py."""

    def setup(self, bottom, top):
        if len(bottom) != 2:
            raise Exception("Need two inputs to compute distance.")

    def reshape(self, bottom, top):
        self.diff = np.zeros_like(bottom[0].data, dtype=np.float32)
        top[0].reshape(1)

    def forward(self, bottom, top):
        self.diff[...] = bottom[0].data - bottom[1].data
        top[0].data[...] = np.sum(self.diff ** 2) / bottom[0].num / 2.

    def backward(self, top, propagate_down, bottom):
        for i in range(2):
            sign = 1 if i == 0 else -1
            bottom[i].diff[...] = sign * self.diff / bottom[i].num


class Scale(caffejax.Layer):
    def setup(self, bottom, top):
        self.factor = float(self.param_str)

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] = bottom[0].data * self.factor

    def backward(self, top, propagate_down, bottom):
        bottom[0].diff[...] = top[0].diff * self.factor


class Counts(Scale):
    calls = 0

    def forward(self, bottom, top):
        Counts.calls += 1
        super().forward(bottom, top)


class Grows(Scale):
    def forward(self, bottom, top):
        top[0].reshape(7)


class KeepsPositives(caffejax.Layer):
    """Its top holds the bottom's positive entries, as many as there are: shaped in setup, reshaped in forward
    (reshape left empty), as py-faster-rcnn's ProposalLayer shapes its rois."""
    forwards = 0

    def setup(self, bottom, top):
        top[0].reshape(1)

    def forward(self, bottom, top):
        KeepsPositives.forwards += 1
        kept = bottom[0].data[bottom[0].data > 0]
        top[0].reshape(*kept.shape)
        top[0].data[...] = kept

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:  # each kept entry's diff back where it came from
            bottom[0].diff[...] = 0
            bottom[0].diff[bottom[0].data > 0] = top[0].diff


class Fails(caffejax.Layer):
    def setup(self, bottom, top):
        raise ValueError("bad param_str")


class FailsLater(Scale):
    def forward(self, bottom, top):
        raise KeyError("no such row")

    def backward(self, top, propagate_down, bottom):
        raise ZeroDivisionError("in backward")


class RefusesLabelDiff(EuclideanLoss):
    """A loss that, like Caffe's own, refuses to backpropagate to its labels; records propagate_down."""
    seen = []

    def backward(self, top, propagate_down, bottom):
        RefusesLabelDiff.seen.append(list(propagate_down))
        if propagate_down[1]:
            raise Exception("cannot backpropagate to label inputs")
        bottom[0].diff[...] = self.diff / bottom[0].num


class DoublesInPlace(caffejax.Layer):
    """Written for in-place use, as such pycaffe layers are: it scales the blob it shares with its bottom."""

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] *= 2

    def backward(self, top, propagate_down, bottom):
        assert np.array_equal(bottom[0].data, top[0].data)  # the same blob: the forward's output
        bottom[0].diff[...] *= 2


class Affine(caffejax.Layer):
    """A learnable InnerProduct written as a pycaffe layer (param_str: num_output): y = x W^T + b. Its backward
    accumulates into the param diffs, as Caffe's layers do."""

    def setup(self, bottom, top):
        n_out, n_in = int(self.param_str), bottom[0].count // bottom[0].num
        self.blobs.add_blob(n_out, n_in)
        self.blobs.add_blob(n_out)
        self.blobs[0].data[...] = np.cos(np.arange(n_out * n_in)).reshape(n_out, n_in) / 2
        self.blobs[1].data[...] = 0.1

    def reshape(self, bottom, top):
        top[0].reshape(bottom[0].num, self.blobs[0].data.shape[0])

    def forward(self, bottom, top):
        x = bottom[0].data.reshape(bottom[0].num, -1)
        top[0].data[...] = x @ self.blobs[0].data.T + self.blobs[1].data

    def backward(self, top, propagate_down, bottom):
        x = bottom[0].data.reshape(bottom[0].num, -1)
        self.blobs[0].diff[...] += top[0].diff.T @ x
        self.blobs[1].diff[...] += top[0].diff.sum(0)
        if propagate_down[0]:
            bottom[0].diff[...] = (top[0].diff @ self.blobs[0].data).reshape(bottom[0].data.shape)


class CountsInABlob(Scale):
    """Keeps the number of forwards it ran in a learnable blob (a running statistic, as BatchNorm's are)."""

    def setup(self, bottom, top):
        super().setup(bottom, top)
        self.blobs.add_blob(1)

    def forward(self, bottom, top):
        self.blobs[0].data[...] += 1
        super().forward(bottom, top)


class ShapedInSetup(caffejax.Layer):
    """Shapes its top in setup and leaves reshape empty, as py-faster-rcnn's data layers do."""

    def setup(self, bottom, top):
        top[0].reshape(2, 3)

    def forward(self, bottom, top):
        top[0].data[...] = bottom[0].data.sum()


class AddsAList(Scale):
    def setup(self, bottom, top):
        self.blobs.append([1.0, 2.0])


class GrowsABlob(Affine):
    def forward(self, bottom, top):
        super().forward(bottom, top)
        self.blobs[1].reshape(7)


class SecondSetupFails(Scale):
    setups = 0

    def setup(self, bottom, top):
        SecondSetupFails.setups += 1
        if SecondSetupFails.setups == 2:
            raise ValueError("the second object's setup")
        super().setup(bottom, top)


class BackwardFails(Scale):
    def backward(self, top, propagate_down, bottom):
        raise ZeroDivisionError("in backward")


class OldStyle(Scale):
    """As py-faster-rcnn's layers were written for the pycaffe of 2015: param_str_, with the underscore."""

    def setup(self, bottom, top):
        cfg = {"TRAIN": 1.0, "TEST": 1.0}  # py-faster-rcnn's ProposalLayer: cfg[str(self.phase)]
        self.factor = float(self.param_str_) * cfg[str(self.phase)]


class Images(caffejax.Layer):
    """A Python data layer serving one image a batch, each of its own size, with a label per pixel, as FCN's
    VOC and SBDD layers do (they load the image in reshape): the sizes cycle through param_str's "HxW" list."""

    def setup(self, bottom, top):
        self.sizes = [tuple(int(d) for d in size.split("x")) for size in self.param_str.split()]
        self.rng = np.random.default_rng(5)
        self.k = 0

    def reshape(self, bottom, top):
        h, w = self.sizes[self.k % len(self.sizes)]
        self.image = self.rng.normal(size=(1, 2, h, w))
        self.label = self.rng.integers(0, 3, (1, 1, h, w))
        top[0].reshape(*self.image.shape)
        top[1].reshape(*self.label.shape)

    def forward(self, bottom, top):
        top[0].data[...] = self.image
        top[1].data[...] = self.label
        self.k += 1


class Batches(caffejax.Layer):
    """A Python data layer: batch k is rows 4k..4k+3 of a table drawn from the seed in param_str."""
    forwards = 0

    def setup(self, bottom, top):
        rng = np.random.default_rng(int(float(self.param_str)))
        self.x = rng.normal(size=(16, 5)).astype(np.float32)
        self.y = rng.integers(0, 3, 16).astype(np.float32)
        self.k = 0

    def reshape(self, bottom, top):
        top[0].reshape(4, 5)
        top[1].reshape(4)

    def forward(self, bottom, top):
        Batches.forwards += 1
        rows = slice(4 * (self.k % 4), 4 * (self.k % 4) + 4)
        top[0].data[...] = self.x[rows]
        top[1].data[...] = self.y[rows]
        self.k += 1

    def backward(self, top, propagate_down, bottom):
        pass
'''


@pytest.fixture
def layers_module(tmp_path, monkeypatch, isolated_registry):
    (tmp_path / "caffejax_test_pylayers.py").write_text(LAYERS_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "caffejax_test_pylayers", raising=False)


def _python_layer(name: str, cls: str, bottoms, top: str, extra: str = "") -> str:
    wiring = "".join(f' bottom: "{b}"' for b in bottoms)
    return (f'layer {{ name: "{name}" type: "Python"{wiring} top: "{top}" {extra}python_param {{ '
            f'module: "caffejax_test_pylayers" layer: "{cls}" param_str: "2.5" }} }}\n')


def test_allowed_python_layers_run_forward_and_backward(layers_module):
    text = ("force_backward: true\n" + _input(2, 3, name="a") + _input(2, 3, name="b")
            + _python_layer("scale", "Scale", ["a"], "scaled")
            + _python_layer("loss", "EuclideanLoss", ["scaled", "b"], "loss", "loss_weight: 1 "))
    net = caffejax.Net(text, caffejax.TRAIN, allow_python_layers=True)
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.ones((2, 3), np.float32)
    np.testing.assert_allclose(net.forward(a=a, b=b)["loss"], [((2.5 * a - b) ** 2).sum() / 4])
    net.backward()
    np.testing.assert_allclose(net.blobs["a"].diff, (2.5 * a - b) / 2 * 2.5)
    np.testing.assert_allclose(net.blobs["b"].diff, -(2.5 * a - b) / 2)


def test_a_forward_over_a_python_layer_runs_it_once(layers_module):
    """A Python layer may keep state between calls (a Python data layer serves the next batch): a pass over one hands
    back every blob, where others recompute the blobs they did not hand back when read."""
    text = (_input(2, 3, name="a") + _python_layer("count", "Counts", ["a"], "counted")
            + 'layer { name: "relu" type: "ReLU" bottom: "counted" top: "out" }\n')
    net = caffejax.Net(text, caffejax.TEST, allow_python_layers=True)
    counts = sys.modules["caffejax_test_pylayers"].Counts
    start = counts.calls
    net.forward(a=np.full((2, 3), -1.0, np.float32))
    np.testing.assert_allclose(net.blobs["counted"].data, -2.5)
    np.testing.assert_allclose(net.blobs["out"].data, 0.0)
    assert counts.calls - start == 1


def test_a_forward_over_a_python_layer_hands_back_every_blob_a_chain_made(layers_module):
    """Such a pass hands back every blob: the values inside an in-place Convolution -> BatchNorm chain (folded,
    never made) are no blob's, and the blob they share holds the chain's output; a chain whose BatchNorm writes
    a new blob runs layer by layer, so that its convolution's blob comes back too."""
    def conv_bn(name, bottom, bn_top):
        return (f'layer {{ name: "{name}" type: "Convolution" bottom: "{bottom}" top: "{name}" convolution_param '
                f'{{ num_output: 3 kernel_size: 1 weight_filler {{ type: "gaussian" std: 0.5 }} }} }}\n'
                f'layer {{ name: "{name}_bn" type: "BatchNorm" bottom: "{name}" top: "{bn_top}" '
                f'batch_norm_param {{ use_global_stats: true }} }}\n')

    text = (_input(2, 3, 5, 5, name="a") + _python_layer("count", "Counts", ["a"], "counted")
            + conv_bn("conv", "counted", "conv") + conv_bn("conv2", "conv", "bn2"))
    nets = [caffejax.Net(text, caffejax.TEST, allow_python_layers=True, channels_last=cl) for cl in (False, True)]
    assert nets[1]._program.kernels["conv"].chain and nets[1]._program.kernels["conv2"].chain.visible
    counts = sys.modules["caffejax_test_pylayers"].Counts
    x = np.random.default_rng(0).normal(size=(2, 3, 5, 5)).astype(np.float32)
    for net in nets:
        for name in ("conv", "conv2"):
            net.params[name][0].data[...] = nets[0].params[name][0].data
            net.params[name + "_bn"][0].data[...] = [1, -2, 0.5]
            net.params[name + "_bn"][1].data[...] = [4, 1, 2]
            net.params[name + "_bn"][2].data[...] = 2
        start = counts.calls
        net.forward(a=x)
        assert all(blob._data._pending is None for blob in net.blobs.values())
        assert counts.calls - start == 1
    for name in ("conv", "conv2", "bn2"):
        np.testing.assert_allclose(nets[1].blobs[name].data, nets[0].blobs[name].data, rtol=1e-5, atol=1e-5)


PYTHON_DATA_LAYER = ('layer { name: "data" type: "Python" top: "data" top: "label" python_param { '
                     'module: "caffejax_test_pylayers" layer: "Batches" param_str: "3" } }\n')


def _batches_table() -> tuple[np.ndarray, np.ndarray]:
    """The rows Batches (param_str 3) serves, four a batch: data and labels."""
    rng = np.random.default_rng(3)
    return rng.normal(size=(16, 5)).astype(np.float32), rng.integers(0, 3, 16)


def test_each_net_has_its_own_python_layer_objects(layers_module):
    """Caffe makes one layer object per net: two nets from one prototxt serve their batches from the first one
    each, and a net keeps its object when it is rebuilt (reshape). An inference function takes the data layer's
    tops as inputs, as it takes any data layer's: it does not run the layer."""
    x_all, _ = _batches_table()
    first, second = (caffejax.Net(PYTHON_DATA_LAYER, caffejax.TEST, allow_python_layers=True) for _ in range(2))
    first.forward()
    first.forward()
    np.testing.assert_array_equal(first.blobs["data"].data, x_all[4:8])
    second.forward()
    np.testing.assert_array_equal(second.blobs["data"].data, x_all[0:4])
    first.reshape()
    first.forward()
    np.testing.assert_array_equal(first.blobs["data"].data, x_all[8:12])
    infer = caffejax.compile_inference(first)
    assert infer.inputs == ["data", "label"]
    given = np.full((2, 5), 7, np.float32)
    np.testing.assert_array_equal(infer({"data": given, "label": np.zeros(2, np.float32)})["data"], given)
    first.forward()
    np.testing.assert_array_equal(first.blobs["data"].data, x_all[12:16])


def test_older_pycaffe_layers_read_param_str_with_an_underscore(layers_module):
    """Layers written for older pycaffe read self.param_str_ and key tables by str(self.phase) (TRAIN / TEST)."""
    net = caffejax.Net(_input(2, 3, name="a") + _python_layer("old", "OldStyle", ["a"], "y"), caffejax.TEST,
                       allow_python_layers=True)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_allclose(net.forward(a=x)["y"], 2.5 * x)
    assert net.layers[1].param_str_ == net.layers[1].param_str == "2.5"
    phase = net.layers[1].phase
    assert phase == caffejax.TEST == 1 and str(phase) == "TEST" and isinstance(phase, int)


def test_a_python_layer_in_net_layers_is_the_users_object(layers_module):
    """pycaffe's net.layers[i] for a Python layer is the user's own object: scripts set a data layer's data
    through it (py-faster-rcnn: solver.net.layers[0].set_roidb(roidb)), and the next pass sees it; in the
    solver's net too. Its type is 'Python' and its blobs the net's."""
    from caffejax.proto import caffe_pb2
    from google.protobuf import text_format

    net = caffejax.Net(PYTHON_DATA_LAYER, caffejax.TEST, allow_python_layers=True)
    layer = net.layers[0]
    assert layer.type == "Python" and layer.name == "data" and layer.param_str == "3" and layer.phase == caffejax.TEST
    assert net.layer_dict["data"].x is layer.x  # the object's own attributes
    layer.x = np.full((16, 5), 7, np.float32)  # set through the view, on the object
    layer.k = 2
    net.forward()
    np.testing.assert_array_equal(net.blobs["data"].data, np.full((4, 5), 7))
    assert layer.k == 3  # the forward's change, seen through the view
    net.reshape()
    assert net.layers[0].k == 3  # the same object after a rebuild
    solver = caffejax.SGDSolver(text_format.Parse(PYTHON_DATA_SOLVER, caffe_pb2.SolverParameter()),
                                allow_python_layers=True)
    solver.net.layers[0].x = np.zeros((16, 5), np.float32)
    solver.step(1)
    np.testing.assert_array_equal(solver.net.blobs["data"].data, np.zeros((4, 5)))
    assert solver.net.layers[1].blobs is solver.net.params["ip"]  # other layers: views as before
    with pytest.raises(AttributeError, match="no_such"):
        layer.no_such


def test_an_in_place_python_layer_shares_its_blob(layers_module):
    """In place (``top: b`` over ``bottom: b``) the layer's top is its bottom's blob, data and diff, as in
    Caffe: a layer that scales the shared blob in place computes 2 a forward and 2 db backward."""
    text = ("force_backward: true\n" + _input(2, 3, name="a")
            + 'layer { name: "copy" type: "Power" bottom: "a" top: "b" }\n'
            + _python_layer("double", "DoublesInPlace", ["b"], "b"))
    net = caffejax.Net(text, caffejax.TRAIN, allow_python_layers=True)
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(net.forward(a=a)["b"], 2 * a)
    diffs = net.backward(b=np.full((2, 3), 3.0, np.float32))
    np.testing.assert_array_equal(diffs["a"], np.full((2, 3), 6.0))


def test_alike_python_layers_are_each_set_up_at_build(layers_module):
    """Two Python layers alike but for their names are two objects, each set up and reshaped as the net is
    built (Caffe's LayerSetUp), so the second's failure is the build's error naming it, not a later forward's."""
    alike = _python_layer("a", "Scale", ["x"], "y") + _python_layer("b", "Scale", ["x"], "z")
    net = caffejax.Net(_input(2) + alike, caffejax.TEST, allow_python_layers=True)
    assert len(net._python_layers.objects) == 2
    assert all(instance.top_shapes == {((2,),): [(2,)]} for instance in net._python_layers.objects.values())
    alike = _python_layer("a", "SecondSetupFails", ["x"], "y") + _python_layer("b", "SecondSetupFails", ["x"], "z")
    with pytest.raises(caffejax.GraphError, match="layer 'b' \\(type Python\\): the Python layer's setup failed: "
                                                  "ValueError: the second object's setup"):
        caffejax.Net(_input(2) + alike, caffejax.TEST, allow_python_layers=True)


PYTHON_DATA_SOLVER = '''
base_lr: 0.1 lr_policy: "fixed" momentum: 0.9 weight_decay: 0.01 max_iter: 3 snapshot_after_train: false
net_param {
  ''' + PYTHON_DATA_LAYER + '''
  layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
          inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 } } }
  layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
}
'''


@pytest.mark.parametrize("iter_size", [1, 2])
def test_a_solver_trains_a_net_fed_by_a_python_data_layer(layers_module, iter_size):
    """pycaffe's solvers run Python layers (Fast R-CNN's data layer is one): with allow_python_layers, each
    pass calls the layer's forward once (iter_size passes an iteration, each on the next batch), and three SGD
    steps with momentum and weight decay give the weights Caffe's update rule gives on the batches the layer
    served, in its order."""
    from caffejax.proto import caffe_pb2
    from google.protobuf import text_format

    param = text_format.Parse(PYTHON_DATA_SOLVER, caffe_pb2.SolverParameter())
    param.iter_size = iter_size
    with pytest.raises(caffejax.UnsupportedError, match="--allow-python-layers"):
        caffejax.get_solver(param)
    solver = caffejax.SGDSolver(param, allow_python_layers=True)
    batches = sys.modules["caffejax_test_pylayers"].Batches
    w, b = (np.array(blob.data, np.float64) for blob in solver.net.params["ip"])
    x_all, y_all = _batches_table()
    history = [np.zeros_like(w), np.zeros_like(b)]
    served = 0
    for _ in range(3):  # SGDSolver: diffs summed over the passes / iter_size, + decay w; v = momentum v + lr g
        grads = [np.zeros_like(w), np.zeros_like(b)]
        for _ in range(iter_size):
            rows = slice(4 * (served % 4), 4 * (served % 4) + 4)
            x, y = x_all[rows].astype(np.float64), y_all[rows]
            served += 1
            z = x @ w.T + b
            p = np.exp(z - z.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            p[np.arange(4), y] -= 1
            grads = [grads[0] + p.T @ x / 4 / iter_size, grads[1] + p.sum(0) / 4 / iter_size]
        grads = [grads[0] + 0.01 * w, grads[1] + 0.01 * b]
        history = [0.9 * h + 0.1 * g for h, g in zip(history, grads)]
        w, b = w - history[0], b - history[1]
    start = batches.forwards
    solver.solve()
    assert batches.forwards - start == 3 * iter_size
    np.testing.assert_allclose(solver.net.params["ip"][0].data, w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(solver.net.params["ip"][1].data, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(solver.net.blobs["data"].data, x_all[rows])


def test_a_python_layers_backward_gets_caffes_propagate_down(layers_module):
    """Caffe calls a layer's backward with propagate_down false for a bottom the gradient does not reach (a
    label), and loss layers refuse to backpropagate to labels; the bottom that needs it gets the layer's diff."""
    text = (_input(4, 5, name="x") + _input(4, 3, name="t")
            + 'layer { name: "ip" type: "InnerProduct" bottom: "x" top: "ip" '
              'inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 } } }\n'
            + _python_layer("loss", "RefusesLabelDiff", ["ip", "t"], "loss", extra="loss_weight: 1 "))
    net = caffejax.Net(text, caffejax.TRAIN, allow_python_layers=True)
    rng = np.random.default_rng(0)
    x, t = rng.normal(size=(4, 5)).astype(np.float32), rng.normal(size=(4, 3)).astype(np.float32)
    net.forward(x=x, t=t)
    net.backward()
    assert sys.modules["caffejax_test_pylayers"].RefusesLabelDiff.seen == [[True, False]]
    w, b = (np.asarray(blob.data, np.float64) for blob in net.params["ip"])
    dz = (x @ w.T + b - t) / 4  # EuclideanLoss: d/dz of sum((z - t)^2) / 2N
    np.testing.assert_allclose(net.params["ip"][0].diff, dz.T @ x, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(net.params["ip"][1].diff, dz.sum(0), rtol=1e-5, atol=1e-6)


PYTHON_DATA_NET = PYTHON_DATA_LAYER + '''
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
'''


# A fully convolutional net on a Python data layer serving one image of its own size a batch (FCN's way).
_FCN_HEAD = '''
layer { name: "score" type: "Convolution" bottom: "data" top: "score"
        convolution_param { num_output: 3 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "score" bottom: "label" top: "loss" }
'''
IMAGES_NET = ('layer { name: "data" type: "Python" top: "data" top: "label" python_param { '
              'module: "caffejax_test_pylayers" layer: "Images" param_str: "5x7 6x4" } }\n' + _FCN_HEAD)
FED_IMAGES_NET = ('layer { name: "data" type: "Input" top: "data" top: "label" input_param { '
                  'shape { dim: 1 dim: 2 dim: 5 dim: 7 } shape { dim: 1 dim: 1 dim: 5 dim: 7 } } }\n' + _FCN_HEAD)


def test_a_python_data_layer_serves_batches_of_changing_shapes(layers_module):
    """A Python data layer runs on the host before each pass, as Caffe's data layers do, and its tops are fed:
    the net reshapes to each batch (a program per shape) and gives the loss and gradients of the batch served,
    those of a net fed the same arrays by hand. caffejax ran it inside the program, whose shapes are fixed: the
    second image raised a ShapeError."""
    net = caffejax.Net(IMAGES_NET, caffejax.TRAIN, allow_python_layers=True)
    fed = caffejax.Net(FED_IMAGES_NET, caffejax.TRAIN)
    for blob, twin in zip(net.params["score"], fed.params["score"]):
        twin.data[...] = blob.data
    shapes = []
    for _ in range(3):
        loss = net.forward()["loss"]
        net.backward()
        x, y = np.array(net.blobs["data"].data), np.array(net.blobs["label"].data)
        shapes.append(x.shape)
        fed.blobs["data"].reshape(*x.shape)
        fed.blobs["label"].reshape(*y.shape)
        np.testing.assert_allclose(loss, fed.forward(data=x, label=y)["loss"], rtol=1e-6)
        fed.backward()
        for blob, twin in zip(net.params["score"], fed.params["score"]):
            np.testing.assert_allclose(blob.diff, twin.diff, rtol=1e-5, atol=1e-7)
    assert shapes == [(1, 2, 5, 7), (1, 2, 6, 4), (1, 2, 5, 7)]


def test_a_solver_trains_through_a_python_data_layer_of_changing_shapes(layers_module):
    """Three SGD steps over images of two sizes give the weights of three steps over the same arrays fed by hand
    (FCN's solve.py trains so: batch 1, each image its own size). With iter_size 2, the two passes of an
    iteration (one per image) run one by one, their gradients summed, as Caffe's Solver::Step runs them."""
    def solver_for(net_text, **extra):
        param = caffe_pb2.SolverParameter(type="SGD", base_lr=0.1, momentum=0.9, lr_policy="fixed", max_iter=10,
                                          **extra)
        param.net_param.CopyFrom(prototxt.parse_net_text(net_text))
        return caffejax.get_solver(param, allow_python_layers=True)

    solver, fed = solver_for(IMAGES_NET), solver_for(FED_IMAGES_NET)
    for blob, twin in zip(solver.net.params["score"], fed.net.params["score"]):
        twin.data[...] = blob.data
    for _ in range(3):
        solver.step(1)
        for name in ("data", "label"):
            served = np.array(solver.net.blobs[name].data)
            fed.net.blobs[name].reshape(*served.shape)
            fed.net.blobs[name].data[...] = served
        fed.step(1)
    for blob, twin in zip(solver.net.params["score"], fed.net.params["score"]):
        np.testing.assert_allclose(blob.data, twin.data, rtol=1e-5, atol=1e-6)
    solver, fed = solver_for(IMAGES_NET, iter_size=2), solver_for(FED_IMAGES_NET, iter_size=2)
    for blob, twin in zip(solver.net.params["score"], fed.net.params["score"]):
        twin.data[...] = blob.data
    images = _images_served("5x7 6x4")
    for _ in range(2):
        solver.step(1)
        fed.net.clear_param_diffs()
        for _ in range(2):  # Caffe's passes: the diffs add up, ApplyUpdate divides them by iter_size
            for name, array in zip(("data", "label"), next(images)):
                fed.net.blobs[name].reshape(*array.shape)
                fed.net.blobs[name].data[...] = array
            fed.net.forward()
            fed.net.backward()
        fed.apply_update()
    for blob, twin in zip(solver.net.params["score"], fed.net.params["score"]):
        np.testing.assert_allclose(blob.data, twin.data, rtol=1e-5, atol=1e-6)


def _images_served(sizes: str):
    """The batches a new net's Images layer with these sizes serves, one by one: (image, label). Caffe's SetUp
    runs reshape once before the first forward's (and Images draws its image there)."""
    from caffejax.runtime.blob import Blob

    images = sys.modules["caffejax_test_pylayers"].Images()
    images.param_str = sizes
    top = [Blob((1,)), Blob((1,))]
    images.setup([], top)
    images.reshape([], top)
    while True:
        images.reshape([], top)
        images.forward([], top)
        yield [np.array(t.data) for t in top]


def _softmax_loss_grads(net, x, y):
    """NumPy's gradient of the mean softmax loss of ``ip`` on a batch, for the net's current weights."""
    w, b = (np.asarray(blob.data, np.float64) for blob in net.params["ip"])
    z = x.astype(np.float64) @ w.T + b
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(len(y)), y.astype(int)] -= 1
    return p.T @ x / len(y), p.sum(0) / len(y)


def test_backward_after_forward_does_not_run_a_python_layer_again(layers_module):
    """Caffe's Backward reads the tops Forward left: net.backward() after net.forward() over a Python data
    layer differentiates the batch the forward served, and the layer serves no other (it did, computing the
    gradient of the next batch). forward_all and forward_backward_all without arrays run one pass each."""
    net = caffejax.Net(PYTHON_DATA_NET, caffejax.TRAIN, allow_python_layers=True)
    batches = sys.modules["caffejax_test_pylayers"].Batches
    x_all, y_all = _batches_table()
    start = batches.forwards
    net.forward()
    net.backward()
    assert batches.forwards - start == 1
    dw, db = _softmax_loss_grads(net, x_all[0:4], y_all[0:4])
    np.testing.assert_allclose(net.params["ip"][0].diff, dw, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(net.params["ip"][1].diff, db, rtol=1e-5, atol=1e-6)
    outs, diffs = net.forward_backward_all()
    assert batches.forwards - start == 2 and diffs == {} and outs["loss"].shape == (1,)
    np.testing.assert_array_equal(net.blobs["data"].data, x_all[4:8])
    assert net.forward_all()["loss"].shape == (1,) and batches.forwards - start == 3


def _solver_over_an_input(python_layer: str, iter_size: int) -> "caffejax.SGDSolver":
    """An SGD solver (base_lr 0.1) of a net: Input x (4 x 5) and label, ``python_layer`` from x to y, an
    InnerProduct and a softmax loss."""
    from caffejax.proto import caffe_pb2
    from google.protobuf import text_format

    net = ('layer { name: "x" type: "Input" top: "x" top: "label" '
           'input_param { shape { dim: 4 dim: 5 } shape { dim: 4 } } }\n' + python_layer
           + 'layer { name: "ip" type: "InnerProduct" bottom: "y" top: "ip" '
             'inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 } } }\n'
             'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }\n')
    param = text_format.Parse(f'base_lr: 0.1 lr_policy: "fixed" max_iter: 10 iter_size: {iter_size} '
                              f'net_param {{ {net} }}', caffe_pb2.SolverParameter())
    return caffejax.SGDSolver(param, allow_python_layers=True)


@pytest.mark.parametrize("iter_size", [1, 3])
def test_a_python_layer_on_an_input_runs_once_a_pass(layers_module, iter_size):
    """A Python layer whose bottom is the same in every pass of an iteration (an Input blob) still runs its
    forward once a pass, as Caffe calls it: as a pure callback of the same operands it was loop-invariant to
    XLA inside the scan over iter_size passes, and ran once an iteration."""
    solver = _solver_over_an_input(_python_layer("c", "Counts", ["x"], "y"), iter_size)
    solver.net.blobs["x"].data[...] = 1.0
    counts = sys.modules["caffejax_test_pylayers"].Counts
    counts.calls = 0
    solver.step(2)
    assert counts.calls == 2 * iter_size


def test_python_layer_failures_name_the_layer(layers_module):
    with pytest.raises(caffejax.GraphError, match="layer 'f' \\(type Python\\): the Python layer's setup failed: "
                                                  "ValueError: bad param_str"):
        caffejax.Net(_input(2) + _python_layer("f", "Fails", ["x"], "y"), caffejax.TEST, allow_python_layers=True)
    with pytest.raises(caffejax.GraphError, match="layer 'b' \\(type Python\\): learnable blob 0 is a list; add "
                                                  "blobs with self.blobs.add_blob"):
        caffejax.Net(_input(2) + _python_layer("b", "AddsAList", ["x"], "y"), caffejax.TEST, allow_python_layers=True)
    net = caffejax.Net(_input(4, 5) + _python_layer("g", "GrowsABlob", ["x"], "y").replace("2.5", "3"),
                       caffejax.TEST, allow_python_layers=True)
    with pytest.raises(caffejax.ShapeError, match="layer 'g' \\(type Python\\): its forward changed the learnable "
                                                  "blob shapes to \\[\\(3, 5\\), \\(7,\\)\\]"):
        net.forward(x=np.ones((4, 5), np.float32))
    with pytest.raises(caffejax.GraphError, match="has no layer class 'Nope'"):
        caffejax.Net(_input(2) + _python_layer("n", "Nope", ["x"], "y"), caffejax.TEST, allow_python_layers=True)
    # Tops sized by the data run on the host, but not a top in place (it is the bottom's blob, which the
    # compiled program keeps at its shape).
    net = caffejax.Net(_input(2) + _python_layer("g", "Grows", ["x"], "x"), caffejax.TEST, allow_python_layers=True)
    with pytest.raises(caffejax.ShapeError, match="layer 'g' \\(type Python\\): its forward changed the top "
                                                  "shapes to \\[\\(7,\\)\\].*only without learnable blobs and tops "
                                                  "in place"):
        net.forward(x=np.ones(2, np.float32))


@pytest.mark.parametrize("text, params, is_input, expected", [
    ('type: "Python" bottom: "x" top: "y"', [], False, True),
    ('type: "Python" bottom: "x" bottom: "z" top: "z" top: "y"', [], False, True),  # in place goes by index
    ('type: "Python" bottom: "x" top: "x"', [], False, False),  # in place
    ('type: "Python" bottom: "x" bottom: "z" top: "y" top: "z" top: "x"', [], False, False),  # top 1 in place
    ('type: "Python" bottom: "x" top: "y"', [(2,)], False, False),  # learnable blobs
    ('type: "Python" top: "y"', [], False, False),  # no bottoms
    ('type: "Python" bottom: "x" top: "y"', [], True, False),  # an input layer
    ('type: "ReLU" bottom: "x" top: "y"', [], False, False),
])
def test_which_layers_may_size_their_tops_by_the_data(text, params, is_input, expected):
    """build.may_size_tops_by_data: a Python layer with bottoms, no learnable blobs and no top in place."""
    from caffejax.frontend.build import may_size_tops_by_data
    from google.protobuf import text_format

    lp = text_format.Parse(text, caffe_pb2.LayerParameter())
    assert may_size_tops_by_data(lp, params, is_input) is expected


SIZED_BY_DATA = _input(6) + _python_layer("keep", "KeepsPositives", ["x"], "kept") + \
    'layer { name: "double" type: "Power" bottom: "kept" top: "doubled" power_param { scale: 2 } }\n'


def _positives(*values) -> np.ndarray:
    return np.float32([*values, *[-1] * (6 - len(values))])


def test_a_python_layer_sizing_its_tops_by_the_data_runs_on_the_host(layers_module):
    """py-faster-rcnn's ProposalLayer reshapes its tops in forward to the proposals it kept. Its first forward
    in the program finds that out: the net then runs it on the host, between two programs, and runs the pass
    again, its forward called once a pass all the same (that first forward's tops are kept)."""
    net = caffejax.Net(SIZED_BY_DATA, caffejax.TEST, allow_python_layers=True)
    counts = sys.modules["caffejax_test_pylayers"].KeepsPositives
    counts.forwards = 0
    assert net.blobs["kept"].shape == (1,) and not net.graph.staging_layers
    np.testing.assert_array_equal(net.forward(x=_positives(1, 2, 3))["doubled"], [2, 4, 6])
    assert counts.forwards == 1
    assert net.graph.staging_layers == [1] and net.blobs["kept"].shape == (3,)
    np.testing.assert_array_equal(net.forward(x=_positives(5))["doubled"], [10])
    np.testing.assert_array_equal(net.forward(x=_positives(4, 3, 2, 1, 7))["doubled"], [8, 6, 4, 2, 14])
    np.testing.assert_array_equal(net.forward(x=_positives())["doubled"], np.zeros(0))
    assert counts.forwards == 4
    # Layer by layer (callbacks), in a net that has not met the data yet: each callback once a layer.
    net = caffejax.Net(SIZED_BY_DATA, caffejax.TEST, allow_python_layers=True)
    called = []
    net.after_forward(called.append)
    np.testing.assert_array_equal(net.forward(x=_positives(1, 2))["doubled"], [2, 4])
    assert called == [0, 1, 2] and counts.forwards == 5
    # An inference function runs it in stages too, learning it as the net does when the net has not met it.
    for net in (caffejax.Net(SIZED_BY_DATA, caffejax.TEST, allow_python_layers=True), net):
        infer = caffejax.compile_inference(net)
        np.testing.assert_array_equal(infer({"x": _positives(1, 2)})["doubled"], [2, 4])
        np.testing.assert_array_equal(infer({"x": _positives(3, 1, 2)})["doubled"], [6, 2, 4])
    assert counts.forwards == 9


def test_threads_calling_an_inference_function_run_in_stages_each_get_their_own_tops(layers_module):
    """The layer's object (and its top blobs) is one for all calls: calls from several threads at once run the
    stages one call at a time, each its own pass, its forward once a call."""
    import threading

    net = caffejax.Net(SIZED_BY_DATA, caffejax.TEST, allow_python_layers=True)
    counts = sys.modules["caffejax_test_pylayers"].KeepsPositives
    counts.forwards = 0
    infer = caffejax.compile_inference(net)
    inputs = [_positives(*range(1, n + 1)) for n in (1, 2, 3, 4, 5, 6, 2, 4)]
    got, start = [None] * len(inputs), threading.Barrier(len(inputs))

    def work(i):
        start.wait()
        got[i] = [np.asarray(infer({"x": inputs[i]})["doubled"]) for _ in range(3)]
    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for x, tops in zip(inputs, got):
        for top in tops:
            np.testing.assert_array_equal(top, 2 * x[x > 0])
    assert counts.forwards == 3 * len(inputs)  # (the tops of the first, in the program, that found it kept)


def test_two_python_layers_sizing_their_tops_in_one_pass(layers_module):
    """The second layer sized by the data shows itself in the stage after the first: that stage runs again,
    split around it, in Net.forward and in an inference function, each layer's forward once a pass."""
    text = (SIZED_BY_DATA + 'layer { name: "less" type: "Power" bottom: "doubled" top: "less" power_param { '
            'shift: -5 } }\n' + _python_layer("keep2", "KeepsPositives", ["less"], "kept2"))
    x = _positives(1, 3, 2, 4)  # doubled 2 6 4 8, less -3 1 -1 3
    for run in (lambda net: net.forward(x=x), lambda net: caffejax.compile_inference(net)({"x": x})):
        net = caffejax.Net(text, caffejax.TEST, allow_python_layers=True)
        counts = sys.modules["caffejax_test_pylayers"].KeepsPositives
        counts.forwards = 0
        np.testing.assert_array_equal(run(net)["kept2"], [1, 3])
        assert counts.forwards == 2 and net.graph.staging_layers == [1]  # keep2 ends the net: after the program
        assert net.graph.layers[-1].runs_on_host
    # Backward through both (a loss weight after the second): each one's backward between three programs.
    net = caffejax.Net("force_backward: true\n" + text + 'layer { name: "sum" type: "Power" bottom: "kept2" '
                       'top: "summed" power_param { scale: 3 } loss_weight: 1 }\n', caffejax.TRAIN,
                       allow_python_layers=True)
    net.forward(x=x)
    assert net.graph.staging_layers == [1, 4]
    np.testing.assert_array_equal(net.backward()["x"], [0, 6, 0, 6, 0, 0])  # 3 x 2 where less > 0


def test_backward_through_a_python_layer_sizing_its_tops_by_the_data(layers_module):
    """Net.backward runs such a layer's own backward on the host, between the programs of the layers after it and
    before it (as Caffe's Backward calls it), whole and layer by layer: x -> x 3 -> the positives -> x 2 -> a loss
    weight, so x's diff is 6 where x > 0, else 0."""
    text = ("force_backward: true\n" + _input(6)
            + 'layer { name: "triple" type: "Power" bottom: "x" top: "tripled" power_param { scale: 3 } }\n'
            + _python_layer("keep", "KeepsPositives", ["tripled"], "kept")
            + 'layer { name: "double" type: "Power" bottom: "kept" top: "doubled" power_param { scale: 2 } '
              'loss_weight: 1 }\n')
    x = np.float32([1, -2, 3, -4, 5, -6])
    for by_layer in (False, True):
        net = caffejax.Net(text, caffejax.TRAIN, allow_python_layers=True)
        called = []
        if by_layer:
            net.after_backward(called.append)
        assert net.forward(x=x)["doubled"].tolist() == [6, 18, 30] and net.graph.staging_layers == [2]
        np.testing.assert_array_equal(net.backward()["x"], [6, 0, 6, 0, 6, 0])
        np.testing.assert_array_equal(net.blobs["kept"].diff, [2, 2, 2])
        assert called == ([3, 2, 1, 0] if by_layer else [])


def test_layers_after_a_python_layer_sizing_its_tops_are_shaped_after_its_forward(layers_module):
    """A build shapes the layer's tops by its setup and reshape. Where a rebuild for new inputs finds those do
    not fit a layer after it, that layer is shaped once the Python layer has run, as Caffe's Forward reshapes
    each layer just before it: the Python layer then runs on the host, and a genuine mismatch is the later
    layer's own ShapeError. At the net's first build (Net::Init's Reshape) a mismatch is an error at once."""
    layers = _python_layer("keep", "KeepsPositives", ["x"], "kept") + \
        'layer { name: "sum" type: "Eltwise" bottom: "kept" bottom: "x" top: "s" }\n'
    with pytest.raises(caffejax.ShapeError, match=r"layer 'sum' \(type Eltwise\)"):
        caffejax.Net(_input(6) + layers, caffejax.TEST, allow_python_layers=True)  # kept is (1,) at the build
    text = _input(1) + layers
    net = caffejax.Net(text, caffejax.TEST, allow_python_layers=True)
    net.blobs["x"].reshape(6)
    net.reshape()
    assert list(net.graph.deferred_errors) == ["sum"]
    x = np.arange(1, 7, dtype=np.float32)
    np.testing.assert_array_equal(net.forward(x=x)["s"], 2 * x)
    assert net.graph.staging_layers == [2] and not net.graph.deferred_errors
    with pytest.raises(caffejax.ShapeError, match=r"layer 'sum' \(type Eltwise\)"):
        net.forward(x=_positives(1, 2))  # two kept of six
    # An inference function of a net that has not met the data learns it the same way, in stages too (a second
    # such layer after the first: its Eltwise waits for it).
    infer = caffejax.compile_inference(caffejax.Net(text, caffejax.TEST, allow_python_layers=True))
    np.testing.assert_array_equal(infer({"x": x})["s"], 2 * x)
    second = (SIZED_BY_DATA + _python_layer("keep2", "KeepsPositives", ["doubled"], "kept2")
              + 'layer { name: "sum2" type: "Eltwise" bottom: "kept2" bottom: "kept" top: "s2" }\n')
    counts = sys.modules["caffejax_test_pylayers"].KeepsPositives
    for first in (_positives(1, 2), x):  # 2: the first layer learnt in the program, the second at a stage's build
        net = caffejax.Net(second, caffejax.TEST, allow_python_layers=True)
        infer = caffejax.compile_inference(net)
        counts.forwards = 0
        np.testing.assert_array_equal(infer({"x": first})["s2"], 3 * first[first > 0])
        assert counts.forwards == 2  # each layer's forward once: the pass goes on after the second is learnt
        np.testing.assert_array_equal(infer({"x": x})["s2"], 3 * x)
        np.testing.assert_array_equal(net.forward(x=_positives(3))["s2"], [9])
        assert counts.forwards == 6
    # Where nothing sizes its tops by the data, the build raises at once, as before.
    with pytest.raises(caffejax.ShapeError, match=r"layer 'sum' \(type Eltwise\)"):
        caffejax.Net(_input(6) + _input(2, name="y") + 'layer { name: "sum" type: "Eltwise" bottom: "x" '
                     'bottom: "y" top: "s" }\n', caffejax.TEST)


def test_a_solver_trains_through_a_python_layer_sizing_its_tops_by_the_data(layers_module):
    """The first step's program finds the layer sizing its tops: that iteration runs again by passes on the same
    batch (the layer's forward once), the momentum history kept; later steps run by passes around it. Loss 2 s
    (the positives of x), so s's gradient is 2 x 9 = 18 while s > 0; SGD with momentum 0.9 at lr 0.01."""
    from google.protobuf import text_format

    text = ('base_lr: 0.01 lr_policy: "fixed" momentum: 0.9 max_iter: 3 snapshot_after_train: false\nnet_param {\n'
            + _input(6)
            + 'layer { name: "s" type: "Scale" bottom: "x" top: "scaled" scale_param { axis: 0 num_axes: 0 '
              'filler { type: "constant" value: 3 } } }\n'
            + _python_layer("keep", "KeepsPositives", ["scaled"], "kept")
            + 'layer { name: "double" type: "Power" bottom: "kept" top: "doubled" power_param { scale: 2 } '
              'loss_weight: 1 }\n}')
    solver = caffejax.SGDSolver(text_format.Parse(text, caffe_pb2.SolverParameter()), allow_python_layers=True)
    counts = sys.modules["caffejax_test_pylayers"].KeepsPositives
    counts.forwards = 0
    solver.net.blobs["x"].data[...] = [1, -2, 3, -4, 5, -6]
    s, v = 3.0, 0.0
    for k in range(3):
        solver.step(1)
        np.testing.assert_allclose(solver.net.blobs["doubled"].data, 2 * np.float32([1, 3, 5]) * s, rtol=1e-6)
        v = 0.9 * v + 0.01 * 18
        s -= v
        np.testing.assert_allclose(solver.net.params["s"][0].data, [s], rtol=1e-6)
        assert counts.forwards == k + 1
    assert solver.net.graph.staging_layers == [2]


def test_a_python_layer_sizing_the_nets_output_runs_after_the_program(layers_module):
    """At the end of the net, the layer sized by the data runs on the host after the program, in Net.forward and in
    an inference function (which learns it as the net does), each forward once; the data layer before it serves
    one batch a pass."""
    text = PYTHON_DATA_LAYER + _python_layer("keep", "KeepsPositives", ["data"], "kept") + \
        'layer { name: "silence" type: "Silence" bottom: "label" }\n'
    net = caffejax.Net(text, caffejax.TEST, allow_python_layers=True)
    layers = sys.modules["caffejax_test_pylayers"]
    layers.KeepsPositives.forwards = layers.Batches.forwards = 0
    data, _ = _batches_table()
    for k in range(3):
        np.testing.assert_array_equal(net.forward()["kept"], data[4 * k:4 * k + 4][data[4 * k:4 * k + 4] > 0])
    assert layers.KeepsPositives.forwards == 3 and layers.Batches.forwards == 3
    assert net.graph.layers[1].runs_on_host and not net.graph.staging_layers
    for fresh in (True, False):
        net = caffejax.Net(text, caffejax.TEST, allow_python_layers=True) if fresh else net
        infer = caffejax.compile_inference(net)
        np.testing.assert_array_equal(infer({"data": data[:4], "label": np.zeros(4, np.float32)})["kept"],
                                      data[:4][data[:4] > 0])
    assert layers.KeepsPositives.forwards == 5


def test_python_layer_failures_inside_the_program_are_the_layers_typed_errors(layers_module, caplog):
    """JAX reports a host callback's failure as its own runtime error, and logs its traceback; the user gets
    the layer's error, caused by their own exception, and no log record."""
    net = caffejax.Net(_input(2) + _python_layer("f", "FailsLater", ["x"], "y"), caffejax.TEST,
                       allow_python_layers=True)
    with pytest.raises(caffejax.GraphError, match="layer 'f' \\(type Python\\): the Python layer's forward "
                                                  "failed: KeyError") as raised:
        net.forward(x=np.ones(2, np.float32))
    assert isinstance(raised.value.__cause__, KeyError)
    assert raised.value.__cause__.__traceback__.tb_next.tb_frame.f_code.co_name == "forward"  # the layer's own
    with pytest.raises(caffejax.GraphError, match="layer 'f' \\(type Python\\): the Python layer's forward") as raised:
        caffejax.compile_inference(net)({"x": np.ones(2, np.float32)})
    assert isinstance(raised.value.__cause__, KeyError)
    assert not [r for r in caplog.records if r.name.startswith("jax")], "JAX logged the layer's failure"
    text = "force_backward: true\n" + _input(2) + _python_layer("b", "BackwardFails", ["x"], "y")
    net = caffejax.Net(text, caffejax.TEST, allow_python_layers=True)
    net.forward(x=np.ones(2, np.float32))
    with pytest.raises(caffejax.GraphError, match="layer 'b' \\(type Python\\): the Python layer's backward "
                                                  "failed: ZeroDivisionError: in backward"):
        net.backward(y=np.ones(2, np.float32))
    net.forward(x=np.ones(2, np.float32))  # nothing left behind: the next pass runs


def test_prototxt_text_keeps_registered_fork_fields(isolated_registry):
    """protobuf's text output drops a BVLC message's unknown fields; to_text prints the fork's fields too."""
    from caffejax.frontend.prototxt import parse_net_text, to_text

    forks.register_all()
    text = (_input(1, 3, 2, 2) + 'layer { name: "n" type: "Normalize" bottom: "x" top: "n" norm_param { '
            'across_spatial: false scale_filler { type: "constant" value: 20 } } }\n')
    net = parse_net_text(text, is_path=False)
    written = to_text(net)
    assert "norm_param" in written and "value: 20" in written
    assert to_text(parse_net_text(written, is_path=False)) == written
    plain = parse_net_text(_input(1, 3), is_path=False)
    assert to_text(plain) == str(plain)  # nothing that prints differently from Python's protobuf (no float)


def _affine_solver(layer: str, iter_size: int) -> str:
    """PYTHON_DATA_SOLVER's net and update, with ``layer`` as its ip layer."""
    return f'''
base_lr: 0.1 lr_policy: "fixed" momentum: 0.9 weight_decay: 0.01 max_iter: 3 snapshot_after_train: false
iter_size: {iter_size}
net_param {{
  {PYTHON_DATA_LAYER}
  {layer}
  layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }}
}}
'''


@pytest.mark.parametrize("iter_size", [1, 2])
def test_a_python_layers_learnable_blobs_train_as_caffes_params(layers_module, iter_size):
    """Blobs a Python layer adds in setup are the layer's params, as Caffe's Net::AppendParam makes them: they
    start from what setup wrote (no filler), the solver trains them (momentum, weight decay, iter_size passes), and
    a pycaffe InnerProduct written as a Python layer trains exactly as BVLC's InnerProduct from the same weights."""
    from caffejax.proto import caffe_pb2
    from google.protobuf import text_format

    def solver(layer):
        param = text_format.Parse(_affine_solver(layer, iter_size), caffe_pb2.SolverParameter())
        return caffejax.SGDSolver(param, allow_python_layers=True)

    python = solver(_python_layer("ip", "Affine", ["data"], "ip").replace("2.5", "3"))
    native = solver('layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" '
                    'inner_product_param { num_output: 3 } }')
    w0 = np.cos(np.arange(15)).reshape(3, 5) / 2
    np.testing.assert_allclose(python.net.params["ip"][0].data, w0, rtol=1e-6)
    np.testing.assert_array_equal(python.net.params["ip"][1].data, np.full(3, 0.1, np.float32))
    assert python.net.layers[list(python.net._layer_names).index("ip")].blobs is python.net.params["ip"]
    for blob, start in zip(native.net.params["ip"], python.net.params["ip"]):
        blob.data[...] = start.data
    python.solve()
    native.solve()
    for trained, expected in zip(python.net.params["ip"], native.net.params["ip"]):
        assert not np.allclose(trained.data, [0.1, w0][trained.data.ndim - 1])
        np.testing.assert_allclose(trained.data, expected.data, rtol=1e-5, atol=1e-6)


def test_a_python_layers_blobs_are_saved_loaded_and_masked_as_params(layers_module, tmp_path):
    """A Python layer's blobs are in the caffemodel under its name (a BVLC InnerProduct of the same name loads
    them), copy_from fills them and the layer computes with what was loaded; net.backward gives their diffs, and
    with lr_mult 0 the solver leaves them as they are."""
    python_net = "force_backward: true\n" + _input(4, 5) + _python_layer("ip", "Affine", ["x"], "y").replace("2.5", "3")
    net = caffejax.Net(python_net, caffejax.TRAIN, allow_python_layers=True)
    path = str(tmp_path / "affine.caffemodel")
    net.save(path)
    native = caffejax.Net(_input(4, 5) + 'layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" '
                          'inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 1 } } }\n',
                          caffejax.TEST, weights=path)
    for loaded, saved in zip(native.params["ip"], net.params["ip"]):
        np.testing.assert_array_equal(loaded.data, saved.data)
    native.params["ip"][0].data[...] *= -2
    native.save(path)
    net.copy_from(path)
    x = np.random.default_rng(1).normal(size=(4, 5)).astype(np.float32)
    np.testing.assert_allclose(net.forward(x=x)["y"], native.forward(x=x)["y"], rtol=1e-5, atol=1e-6)
    dy = np.random.default_rng(2).normal(size=(4, 3)).astype(np.float32)
    diffs = net.backward(y=dy, diffs=["x"])
    w = native.params["ip"][0].data
    np.testing.assert_allclose(net.params["ip"][0].diff, dy.T @ x, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(net.params["ip"][1].diff, dy.sum(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(diffs["x"], dy @ w, rtol=1e-5, atol=1e-6)

    from caffejax.proto import caffe_pb2
    from google.protobuf import text_format

    frozen = (PYTHON_DATA_LAYER + _python_layer("ip", "Affine", ["data"], "ip", extra="param { lr_mult: 0 } "
                                                "param { lr_mult: 1 } ").replace("2.5", "3")
              + 'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }\n')
    param = text_format.Parse(f'base_lr: 0.1 lr_policy: "fixed" max_iter: 2 net_param {{ {frozen} }}',
                              caffe_pb2.SolverParameter())
    solver = caffejax.SGDSolver(param, allow_python_layers=True)
    solver.step(2)
    np.testing.assert_allclose(solver.net.params["ip"][0].data, np.cos(np.arange(15)).reshape(3, 5) / 2, rtol=1e-6)
    assert not np.allclose(solver.net.params["ip"][1].data, 0.1)


@pytest.mark.parametrize("iter_size", [1, 2])
def test_what_a_python_layers_forward_writes_in_its_blobs_stays(layers_module, iter_size):
    """A layer's forward may keep a running statistic in its blobs (as BatchNorm's are): what it writes is the
    param's new value, in Net.forward and through every pass of a solver's iteration."""
    counting = _python_layer("c", "CountsInABlob", ["x"], "y", extra="param { lr_mult: 0 } ")
    net = caffejax.Net(_input(2) + counting, caffejax.TEST, allow_python_layers=True)
    for _ in range(2):
        np.testing.assert_array_equal(net.forward(x=np.ones(2, np.float32))["y"], [2.5, 2.5])
    np.testing.assert_array_equal(net.params["c"][0].data, [2.0])
    solver = _solver_over_an_input(counting, iter_size)
    solver.step(3)
    np.testing.assert_array_equal(solver.net.params["c"][0].data, [3.0 * iter_size])


def test_a_net_with_python_layers_is_refused_by_stablehlo_export(layers_module, tmp_path):
    """A serialized program cannot hold host code: the export names the Python layers (it failed inside JAX's
    serializer with NotImplementedError)."""
    net = caffejax.Net(_input(2) + _python_layer("s", "Scale", ["x"], "y"), caffejax.TEST, allow_python_layers=True)
    with pytest.raises(caffejax.UnsupportedError, match="cannot export Python layers \\['s'\\] to StableHLO"):
        export_stablehlo(net, str(tmp_path / "net.stablehlo"))
    assert not (tmp_path / "net.stablehlo").exists()


def test_a_python_layers_tops_keep_their_shapes_between_reshapes(layers_module):
    """Caffe's top blobs keep their shapes: a layer that shapes its tops in setup, with an empty reshape, keeps
    them when the net is reshaped to new input shapes (they became () there, and the forward failed)."""
    net = caffejax.Net(_input(2) + _python_layer("s", "ShapedInSetup", ["x"], "y"), caffejax.TEST,
                       allow_python_layers=True)
    y = net.forward(x=np.ones(2, np.float32))["y"]
    assert y.shape == (2, 3) and np.all(y == 2.0)
    net.blobs["x"].reshape(5)
    net.reshape()
    y = net.forward(x=np.ones(5, np.float32))["y"]
    assert y.shape == (2, 3) and np.all(y == 5.0)


def test_debug_nans_replays_a_forward_without_running_its_python_layers_again(layers_module):
    """debug_nans finds the layer that made NaN by replaying the forward layer by layer; it takes the Python
    layers' tops from that forward (a Python data layer ran again there, served the next batch and looked for the
    NaN in data the forward never saw)."""
    text = PYTHON_DATA_LAYER + 'layer { name: "log" type: "Log" bottom: "data" top: "logs" }\n'
    net = caffejax.Net(text, caffejax.TEST, allow_python_layers=True, debug_nans=True)
    batches = sys.modules["caffejax_test_pylayers"].Batches
    start = batches.forwards
    with pytest.raises(caffejax.NumericalError, match="layer 'log' \\(type Log\\) produced [0-9]+ NaN"):
        net.forward()
    assert batches.forwards - start == 1


def test_debug_nans_in_training_replays_the_batch_the_python_data_layer_served(layers_module):
    """A solver's debug_nans replay takes the Python layers' tops the iteration made, as Net.forward's does."""
    from caffejax.proto import caffe_pb2
    from google.protobuf import text_format

    net = (PYTHON_DATA_LAYER + 'layer { name: "log" type: "Log" bottom: "data" top: "logs" }\n'
           'layer { name: "ip" type: "InnerProduct" bottom: "logs" top: "ip" '
           'inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 } } }\n'
           'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }\n')
    param = text_format.Parse(f'base_lr: 0.1 lr_policy: "fixed" max_iter: 1 net_param {{ {net} }}',
                              caffe_pb2.SolverParameter())
    solver = caffejax.SGDSolver(param, allow_python_layers=True)
    solver.debug_nans = True
    batches = sys.modules["caffejax_test_pylayers"].Batches
    start = batches.forwards
    with pytest.raises(caffejax.NumericalError, match="layer 'log' \\(type Log\\) produced [0-9]+ NaN"):
        solver.step(1)
    assert batches.forwards - start == 1
