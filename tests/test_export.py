"""caffejax.export: StableHLO files that run with JAX alone, and Flax NNX modules holding Caffe's weights."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import caffejax
from caffejax import layers as L
from caffejax.errors import CaffejaxError, ShapeError
from caffejax.export import export_stablehlo, load_flax_state, load_stablehlo, save_flax_state, to_flax
from caffejax.lower import forks
from conftest import BUNDLED, layer_case, layer_cases
from test_batch_sizes import FORK_ROWS_APART
from test_batch_sizes import _net as one_layer_net

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
    for path, inputs in zip(sys.argv[1::2], sys.argv[2::2]):
        exported = export.deserialize(bytearray(open(path, "rb").read()))
        out = exported.call(dict(np.load(inputs + ".in.npz")))
        np.savez(inputs + ".out.npz", **{k: np.asarray(v) for k, v in out.items()})
""")


def test_stablehlo_runs_with_jax_alone(cases, tmp_path):
    """The file is the whole model: a fresh process with only jax (caffejax blocked) reproduces Net.forward, and a
    file with a symbolic batch runs at any batch size there."""
    runs = []
    for _, inputs, expected, path, _ in cases.values():
        np.savez(f"{path}.in.npz", **inputs)
        runs.append((path, str(path), expected))
    prototxt, weights, _ = NETS["lenet"]
    net = caffejax.Net(str(prototxt), str(weights), caffejax.TEST)
    export_stablehlo(net, str(tmp_path / "any.stablehlo"), batch="batch")
    for n in (1, 3):
        inputs = inputs_for({"data": (n, 1, 28, 28)}, seed=n)
        np.savez(tmp_path / f"any{n}.in.npz", **inputs)
        runs.append((tmp_path / "any.stablehlo", str(tmp_path / f"any{n}"), forward_at(net, inputs)))
    arguments = [str(a) for path, inputs, _ in runs for a in (path, inputs)]
    subprocess.run([sys.executable, "-c", JAX_ONLY_RUNNER, *arguments], check=True, timeout=120)
    for _, inputs, expected in runs:
        assert_outputs_close(dict(np.load(f"{inputs}.out.npz")), expected)


def forward_at(net, inputs):
    """Net.forward's outputs with the net reshaped to ``inputs``' shapes."""
    for blob, x in inputs.items():
        net.blobs[blob].reshape(*x.shape)
    return {k: np.array(v) for k, v in net.forward(**inputs).items()}


# ---- a symbolic batch --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(NETS))
def test_one_file_takes_every_batch_size(name, tmp_path):
    prototxt, weights, _ = NETS[name]
    net = caffejax.Net(str(prototxt), str(weights), caffejax.TEST)
    export_stablehlo(net, str(tmp_path / "net.stablehlo"), batch="batch")
    model = load_stablehlo(str(tmp_path / "net.stablehlo"))
    row = tuple(net.blobs["data"].data.shape[1:])
    assert model.input_shapes == {"data": ("batch", *row)}
    for n in (1, 3, 5, 3):
        inputs = inputs_for({"data": (n, *row)}, seed=n)
        assert_outputs_close(model(**inputs), forward_at(net, inputs))
    assert model.compile_count == 3  # once for each batch size
    assert model.warm_up(*({"data": (n, *row)} for n in (2, 3, 8))) == 2 and model.compile_count == 5
    model(**inputs_for({"data": (8, *row)}))
    assert model.compile_count == 5
    with pytest.raises(CaffejaxError, match=r"warm_up: shapes for \['image'\] do not match"):
        model.warm_up({"image": (1, *row)})


def test_the_loader_compiles_with_caffejaxs_options_for_the_work_at_each_size(tmp_path, monkeypatch):
    """The export records its products' work per row; the loader picks the XLA options compile_inference gives a
    forward of that much work (YNNPACK's dot fusions from 20 MFLOP: ResNet-50's batch-16 forward ran 1.7x faster
    than under XLA's defaults)."""
    import caffejax.export as export
    from caffejax.runtime.xla_options import matmul_flops

    prototxt, weights, _ = NETS["lenet"]
    net = caffejax.Net(str(prototxt), str(weights), caffejax.TEST)
    export_stablehlo(net, str(tmp_path / "any.stablehlo"), batch="batch")
    export_stablehlo(net, str(tmp_path / "four.stablehlo"), batch=4)
    asked = []
    monkeypatch.setattr(export, "forward_options", lambda flops, dtype: asked.append(flops) or {})
    for n in (1, 16):
        load_stablehlo(str(tmp_path / "any.stablehlo"))(**inputs_for({"data": (n, 1, 28, 28)}))
    load_stablehlo(str(tmp_path / "four.stablehlo"))(**inputs_for({"data": (4, 1, 28, 28)}))
    counted = []
    for n in (1, 16, 4):
        net.blobs["data"].reshape(n, 1, 28, 28)
        net.reshape()
        counted.append(matmul_flops(net.graph))
    assert asked == counted and counted[0] == 4_586_000


def test_a_loaded_program_with_zero_weights_multiplies_right(tmp_path):
    """An untrained product's zero weights become a broadcast constant, which YNNPACK's dot fusions multiply by
    wrongly (NaN or garbage, jaxlib 0.10.2): the loader then compiles without them, as compile_inference does."""
    n = caffejax.NetSpec()
    n.data = L.Input(shape=dict(dim=[64, 1024]))
    n.ip = L.InnerProduct(n.data, num_output=512, weight_filler=dict(type="constant", value=0),
                          bias_filler=dict(type="constant", value=0.5))
    net = caffejax.Net(n.to_proto(), caffejax.TEST)
    export_stablehlo(net, str(tmp_path / "zeros.stablehlo"), batch="batch")
    model = load_stablehlo(str(tmp_path / "zeros.stablehlo"))
    np.testing.assert_array_equal(np.asarray(model(data=np.ones((64, 1024), np.float32))["ip"]), 0.5)


def test_a_loaded_program_with_big_buffers_gets_its_numpy_inputs_on_the_device_first(tmp_path, monkeypatch):
    """As compile_inference's programs (see runtime.inference._maps_afresh_on_a_worker): a program whose scratch space
    a worker thread would map afresh on every call gets its NumPy inputs on the device first; a small one takes
    them as they are."""
    import caffejax.export as export

    calls = []
    to_device = export._inputs_to_device
    monkeypatch.setattr(export, "_inputs_to_device", lambda arrays: calls.append(sorted(arrays)) or to_device(arrays))
    prototxt, weights, _ = NETS["lenet"]
    net = caffejax.Net(str(prototxt), str(weights), caffejax.TEST)
    export_stablehlo(net, str(tmp_path / "any.stablehlo"), batch="batch")
    inputs = inputs_for({"data": (3, 1, 28, 28)})
    expected = forward_at(net, inputs)
    assert_outputs_close(load_stablehlo(str(tmp_path / "any.stablehlo"))(**inputs), expected)
    assert calls == []
    monkeypatch.setattr(export, "_maps_afresh_on_a_worker", lambda compiled: True)
    assert_outputs_close(load_stablehlo(str(tmp_path / "any.stablehlo"))(**inputs), expected)
    assert calls == [["data"]]


def test_batch_inputs_names_the_inputs_with_a_batch(tmp_path):
    """A second input whose first axis is not the batch (Scale's operand) keeps its shape."""
    n = caffejax.NetSpec()
    n.x = L.Input(shape=dict(dim=[2, 3, 4, 5]))
    n.s = L.Input(shape=dict(dim=[3, 4]))
    n.y = L.Scale(n.x, n.s, axis=1)
    net = caffejax.Net(n.to_proto(), caffejax.TEST)
    with pytest.raises(ShapeError, match=r"cannot export with the symbolic batch 'n' of inputs \['s', 'x'\]: "
                                         r"layer 'y' \(type Scale\): operand of shape \(n, 4\)"):
        export_stablehlo(net, str(tmp_path / "scale.stablehlo"), batch="n")
    export_stablehlo(net, str(tmp_path / "scale.stablehlo"), batch="n", batch_inputs=["x"])
    model = load_stablehlo(str(tmp_path / "scale.stablehlo"))
    assert model.input_shapes == {"x": ("n", 3, 4, 5), "s": (3, 4)}
    for rows in (1, 4):
        inputs = inputs_for({"x": (rows, 3, 4, 5), "s": (3, 4)}, seed=rows)
        assert_outputs_close(model(**inputs), forward_at(net, inputs))


def test_a_symbolic_batch_is_refused_where_the_net_fixes_it(tmp_path, isolated_registry):
    # a learnable blob of the export's batch size, added to the input
    n = caffejax.NetSpec()
    n.x = L.Input(shape=dict(dim=[2, 3]))
    n.p = L.Parameter(parameter_param=dict(shape=dict(dim=[2, 3])))
    n.m = L.Eltwise(n.p, n.x)
    net = caffejax.Net(n.to_proto(), caffejax.TEST)
    with pytest.raises(ShapeError, match=r"symbolic batch 'b' of inputs \['x'\]: layer 'm' \(type Eltwise\): "
                                         r"bottom\[0\] \(2, 3\) and bottom\[1\] \(b, 3\) differ"):
        export_stablehlo(net, str(tmp_path / "p.stablehlo"), batch="b")
    export_stablehlo(net, str(tmp_path / "p.stablehlo"))  # at its own batch it exports

    # a user's rule that takes the batch as a number
    caffejax.register_layer("TimesRows", lambda ctx, bottoms, params: [bottoms[0] * int(bottoms[0].shape[0])])
    net = caffejax.Net('name: "rows"\n' + 'layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 2 '
                       'dim: 3 } } }\nlayer { name: "t" type: "TimesRows" bottom: "x" top: "y" }', caffejax.TEST)
    with pytest.raises(caffejax.UnsupportedError, match=r"layer 't' \(type TimesRows\): its rule cannot take the "
                                                        r"symbolic batch of a batch-polymorphic export"):
        export_stablehlo(net, str(tmp_path / "t.stablehlo"), batch="b")
    export_stablehlo(net, str(tmp_path / "t.stablehlo"), batch=3)
    np.testing.assert_array_equal(np.asarray(load_stablehlo(str(tmp_path / "t.stablehlo"))(
        x=np.ones((3, 3), np.float32))["y"]), 3)


# Reference cases a symbolic batch cannot take, and why: a top made at a fixed size meets the batch (DummyData's,
# Parameter's, a Scale operand along axis 0), or a number of rows the data decides (Filter).
FIXED_BATCH_CASES = {"dummy_data_constant": "needs random numbers", "filter": "the number of rows Filter outputs",
                     "parameter": r"bottom\[0\] \(2, 3\) and bottom\[1\] \(b, 3\) differ",
                     "scale_axis0_numaxes": r"operand of shape \(2, 3\) does not match"}


@pytest.mark.parametrize("name", layer_cases())
def test_every_layer_case_exports_with_a_symbolic_batch(name, tmp_path):
    """Each of Caffe's per-layer reference cases (tests/fixtures/reference) exported with a symbolic batch over the
    inputs with as many rows as its first gives Net.forward's outputs at its own batch and at one row more."""
    case = layer_case(name)
    net = case.make_net()
    case.feed(net)
    feeds = {blob: np.array(net.blobs[blob].data) for blob in net.graph.fed}
    rows = next(iter(feeds.values())).shape[0]
    batched = [blob for blob, x in feeds.items() if x.ndim and x.shape[0] == rows]
    path = str(tmp_path / "case.stablehlo")
    if name in FIXED_BATCH_CASES:
        with pytest.raises(CaffejaxError, match=FIXED_BATCH_CASES[name]):
            export_stablehlo(net, path, batch="b", batch_inputs=batched)
        return
    export_stablehlo(net, path, batch="b", batch_inputs=batched)
    model = load_stablehlo(path)
    more = {blob: np.concatenate([x, x[-1:]]) if blob in batched else x for blob, x in feeds.items()}
    for inputs in (feeds, more):
        expected = forward_at(net, inputs)
        got = model(**inputs)
        for blob in expected:
            np.testing.assert_allclose(np.asarray(got[blob]), expected[blob], rtol=1e-5, atol=1e-6, err_msg=blob)


@pytest.mark.parametrize("case", sorted(FORK_ROWS_APART))
def test_fork_layers_export_with_a_symbolic_batch(case, tmp_path, isolated_registry):
    forks.register_all()
    net = one_layer_net(*FORK_ROWS_APART[case], batch=3)
    export_stablehlo(net, str(tmp_path / "fork.stablehlo"), batch="b")
    model = load_stablehlo(str(tmp_path / "fork.stablehlo"))
    for rows in (2, 5):
        inputs = {blob: np.random.default_rng(rows).uniform(0.1, 1, (rows, *net.blobs[blob].data.shape[1:]))
                  .astype(np.float32) for blob in net.inputs}
        assert_outputs_close(model(**inputs), forward_at(net, inputs))


def test_a_loaded_file_pads_batches_to_its_batch_sizes(tmp_path):
    """load_stablehlo(batch_sizes=...) as compile_inference's: a call runs the program of the smallest size that
    holds its rows, the batched inputs padded and the outputs that carry the batch cut back, more rows than the
    largest in parts; a file whose layers mix rows, or one without a symbolic batch, is refused by name."""
    from caffejax.errors import UnsupportedError

    prototxt, weights, _ = NETS["lenet"]
    net = caffejax.Net(str(prototxt), str(weights), caffejax.TEST)
    export_stablehlo(net, str(tmp_path / "any.stablehlo"), batch="batch")
    plain = load_stablehlo(str(tmp_path / "any.stablehlo"))
    model = load_stablehlo(str(tmp_path / "any.stablehlo"), batch_sizes=(4, 2))
    assert model.batch_sizes == (2, 4) and model.warm_up() == 2
    for n in (1, 2, 3, 4, 9):
        inputs = inputs_for({"data": (n, 1, 28, 28)}, seed=n)
        got = model(**inputs)
        assert got["prob"].shape == (n, 10)
        np.testing.assert_allclose(np.asarray(got["prob"]), np.asarray(plain(**inputs)["prob"]), rtol=1e-5, atol=1e-6)
    assert model.compile_count == 2  # 9 rows ran as 4, 4 and 1 padded to 2
    with pytest.raises(ShapeError, match="same number of rows"):
        model(data=np.zeros((), np.float32))

    n = caffejax.NetSpec()
    n.data = L.Input(shape=dict(dim=[2, 3]))
    n.total = L.Reduction(n.data, axis=0)  # one sum over every row: padding would change it
    mixed = caffejax.Net(n.to_proto(), caffejax.TEST)
    export_stablehlo(mixed, str(tmp_path / "mixed.stablehlo"), batch="batch")
    with pytest.raises(UnsupportedError, match="each row"):
        load_stablehlo(str(tmp_path / "mixed.stablehlo"), batch_sizes=(2,))
    export_stablehlo(net, str(tmp_path / "fixed.stablehlo"), batch=2)
    with pytest.raises(UnsupportedError, match="symbolic batch"):
        load_stablehlo(str(tmp_path / "fixed.stablehlo"), batch_sizes=(2,))
    with pytest.raises(CaffejaxError, match="positive whole numbers"):
        load_stablehlo(str(tmp_path / "any.stablehlo"), batch_sizes=(0,))


def test_a_bfloat16_export_takes_every_batch_size(tmp_path, monkeypatch):
    """The bf16 mode exported: compile_inference(dtype=bfloat16)'s program (float32 in and out), with a symbolic
    batch; a join of two bfloat16 convolutions (paired as 32-bit values on integer views,
    optimize.paired_concatenate, where no bitcast of a symbolic shape would refine) among its layers."""
    import caffejax.export as export

    n = caffejax.NetSpec()
    n.data = L.Input(shape=dict(dim=[2, 3, 8, 8]))
    filler = dict(weight_filler=dict(type="gaussian", std=0.3), bias_filler=dict(type="gaussian", std=0.1))
    n.a = L.Convolution(n.data, num_output=4, kernel_size=1, **filler)
    n.ra = L.ReLU(n.a, in_place=True)
    n.b = L.Convolution(n.a, num_output=6, kernel_size=3, pad=1, **filler)
    n.rb = L.ReLU(n.b, in_place=True)
    n.join = L.Concat(n.a, n.b)
    n.c = L.Convolution(n.join, num_output=5, kernel_size=3, **filler)
    net = caffejax.Net(n.to_proto(), caffejax.TEST)
    export_stablehlo(net, str(tmp_path / "bf16.stablehlo"), batch="batch", dtype=jnp.bfloat16)
    model = load_stablehlo(str(tmp_path / "bf16.stablehlo"))
    asked = []
    monkeypatch.setattr(export, "forward_options", lambda flops, dtype: asked.append(dtype) or {})
    infer = caffejax.compile_inference(net, dtype=jnp.bfloat16)
    for rows in (1, 3):
        inputs = inputs_for({"data": (rows, 3, 8, 8)}, seed=rows)
        got = np.asarray(model(**inputs)["c"])
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, np.asarray(infer(inputs)["c"]), rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(got, forward_at(net, inputs)["c"], rtol=5e-2, atol=5e-2)  # float32's
    assert asked == [jnp.bfloat16, jnp.bfloat16]
    with pytest.raises(CaffejaxError, match="needs a floating dtype, got int32"):
        export_stablehlo(net, str(tmp_path / "int.stablehlo"), dtype=jnp.int32)


@pytest.mark.slow
@pytest.mark.parametrize("name,dtype", [("googlenet", "float32"), ("resnet50", "float32"), ("inception_v3", "float32"),
                                        ("densenet121", "float32"), ("mobilenet_v2", "bfloat16"),
                                        ("squeezenet", "bfloat16")])
def test_published_nets_export_with_a_symbolic_batch(name, dtype, tmp_path):
    """A published prototxt (random weights of realistic scale) exported with a symbolic batch gives
    compile_inference's outputs at batch 1 and 3: float32 within 1e-4 of the largest output, bfloat16 within 3e-2
    (XLA fuses the symbolic program otherwise)."""
    import pathlib

    from test_batch_sizes import PUBLISHED
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    from bench.nets import randomize_weights

    if not PUBLISHED[name].exists():
        pytest.skip(f"{PUBLISHED[name]} is not here")
    net = caffejax.Net(str(PUBLISHED[name]), caffejax.TEST)
    randomize_weights(net)
    export_stablehlo(net, str(tmp_path / "net.stablehlo"), batch="batch", dtype=jnp.dtype(dtype))
    model = load_stablehlo(str(tmp_path / "net.stablehlo"))
    infer = caffejax.compile_inference(net, dtype=jnp.dtype(dtype))
    blob = net.inputs[0]
    tolerance = 1e-4 if dtype == "float32" else 3e-2
    for rows in (1, 3):
        inputs = inputs_for({blob: (rows, *net.blobs[blob].data.shape[1:])}, seed=rows)
        got, expected = model(**inputs), infer(inputs)
        for output, want in expected.items():
            want = np.asarray(want)
            np.testing.assert_allclose(np.asarray(got[output]), want, rtol=0,
                                       atol=tolerance * float(np.abs(want).max()), err_msg=output)


@pytest.mark.parametrize("batch,batch_inputs,message", [
    ("2x", None, "batch must be a whole number or the name of a symbolic dimension"),
    (0, None, "batch must be a positive whole number"),
    (2.5, None, "batch must be a positive whole number"),
    (None, ["data"], "no batch was given"),
    ("b", ["image"], r"batch_inputs \['image'\] are not inputs of the net; its inputs are \['data'\]"),
    ("b", "data", "batch_inputs must be a non-empty list"),
])
def test_export_checks_its_batch(batch, batch_inputs, message, tmp_path):
    prototxt, weights, _ = NETS["lenet"]
    net = caffejax.Net(str(prototxt), str(weights), caffejax.TEST)
    with pytest.raises(CaffejaxError, match=message):
        export_stablehlo(net, str(tmp_path / "x.stablehlo"), batch=batch, batch_inputs=batch_inputs)
    assert not (tmp_path / "x.stablehlo").exists()


def test_a_symbolic_batch_takes_one_size_per_call(tmp_path):
    net = caffejax.Net('name: "two"\n' + "".join(
        f'layer {{ name: "{x}" type: "Input" top: "{x}" input_param {{ shape {{ dim: 2 dim: 3 }} }} }}\n'
        for x in "ab") + 'layer { name: "sum" type: "Eltwise" bottom: "a" bottom: "b" top: "y" }', caffejax.TEST)
    export_stablehlo(net, str(tmp_path / "two.stablehlo"), batch="rows")
    model = load_stablehlo(str(tmp_path / "two.stablehlo"))
    ones = np.ones((4, 3), np.float32)
    np.testing.assert_array_equal(np.asarray(model(a=ones, b=ones)["y"]), 2 * ones)
    with pytest.raises(ShapeError, match=r"inputs 'a' and 'b' give the symbolic dimension 'rows' sizes 4 and 2"):
        model(a=ones, b=ones[:2])
    with pytest.raises(ShapeError, match=r"symbolic dimension 'rows' takes sizes of 1 or more"):
        model(a=ones[:0], b=ones[:0])
    with pytest.raises(ShapeError, match=r"input 'a' has shape \(4, 2\); the exported net takes \('rows', 3\)"):
        model(a=ones[:, :2], b=ones)


def test_an_exported_classifier_reads_channels_last_values_as_they_are(tmp_path):
    """Export adds inner_product_nhwc: the weights are constants there, and a transpose of the activations back
    to NCHW before the product was folded by XLA into the constant weight as it compiled (AlexNet's fc6: 1.5 s,
    logged as a slow operation)."""
    from caffejax.runtime.inference import default_passes

    n = caffejax.NetSpec()
    n.data = L.Input(shape=dict(dim=[2, 3, 8, 8]))
    n.conv = L.Convolution(n.data, num_output=4, kernel_size=3, weight_filler=dict(type="gaussian", std=0.3))
    n.pool = L.Pooling(n.conv, kernel_size=2, stride=2)
    n.fc = L.InnerProduct(n.pool, num_output=5, weight_filler=dict(type="gaussian", std=0.3),
                          bias_filler=dict(type="gaussian", std=0.1))
    net = caffejax.Net(n.to_proto(), caffejax.TEST)
    inputs = inputs_for({"data": (2, 3, 8, 8)})
    expected = forward_at(net, inputs)
    back_to_nchw = "dims = [0, 3, 1, 2]"
    for passes, transposed in ((None, False), (default_passes(jnp.float32), True)):
        exported = export_stablehlo(net, str(tmp_path / "fc.stablehlo"), passes=passes)
        assert (back_to_nchw in exported.mlir_module()) == transposed
        assert_outputs_close(load_stablehlo(str(tmp_path / "fc.stablehlo"))(**inputs), expected)


def test_export_runs_the_optimisation_passes(tmp_path):
    """By default the program is compile_inference's: a BatchNorm and Scale after a convolution are folded into its
    filters (no square root left to compute); ``passes=()`` keeps Caffe's rules."""
    n = caffejax.NetSpec()
    n.data = L.Input(shape=dict(dim=[2, 3, 8, 8]))
    n.conv = L.Convolution(n.data, num_output=4, kernel_size=3, weight_filler=dict(type="gaussian", std=0.3))
    n.bn = L.BatchNorm(n.conv, in_place=True)
    n.scale = L.Scale(n.bn, bias_term=True, in_place=True, filler=dict(type="uniform", min=0.5, max=1.5),
                      bias_filler=dict(type="gaussian", std=0.1))
    net = caffejax.Net(n.to_proto(), caffejax.TEST)
    rng = np.random.default_rng(0)
    net.params["bn"][0].data[...] = rng.normal(0, 0.1, 4)
    net.params["bn"][1].data[...] = rng.uniform(0.5, 1.5, 4)
    net.params["bn"][2].data[...] = 1
    inputs = inputs_for({"data": (2, 3, 8, 8)})
    expected = forward_at(net, inputs)
    texts = {}
    for passes in (None, ()):
        exported = export_stablehlo(net, str(tmp_path / "bn.stablehlo"), passes=passes)
        texts[passes] = exported.mlir_module()
        assert_outputs_close(load_stablehlo(str(tmp_path / "bn.stablehlo"))(**inputs), expected)
    assert "sqrt" in texts[()] and "sqrt" not in texts[None]


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


@pytest.mark.parametrize("bad, message", [
    (np.full((2, 1, 28, 28), "a"), "could not convert string to float"),
    ([[[[0.5]]], [[[0.5, 0.5]]]], "inhomogeneous shape"),  # ragged
])
def test_inputs_that_are_no_arrays_of_numbers_are_named(cases, bad, message):
    """Net.forward, compile_inference (with and without batch_sizes) and a loaded export alike: an InputValueError
    (also a ValueError, NumPy's own) naming the input, not NumPy's bare error."""
    from caffejax.errors import InputValueError

    net, _, _, _, model = cases["lenet"]
    calls = {"Net.forward": lambda: net.forward(data=bad),
             "compile_inference": lambda: caffejax.compile_inference(net)({"data": bad}),
             "batch_sizes": lambda: caffejax.compile_inference(net, batch_sizes=(2,))({"data": bad}),
             "load_stablehlo": lambda: model(data=bad)}
    for who, call in calls.items():
        with pytest.raises(InputValueError, match=f"input 'data' is not an array of numbers: .*{message}") as caught:
            call()
        assert isinstance(caught.value, ValueError), who
    bad_diff = bad[:, :, 0, :2].reshape(2, 2) if isinstance(bad, np.ndarray) else [[0.5], [0.5, 0.5]]
    with pytest.raises(InputValueError, match=f"diff for 'prob' is not an array of numbers: .*{message}"):
        net.backward(prob=bad_diff)


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


def test_flax_module_runs_the_layout_kernels_training_uses(cases):
    """The module's forward runs the net's training kernels (channels-last convolutions, Convolution -> BatchNorm
    chains), which its differentiated uses take: SqueezeNet v1.1's Flax training step at batch 16 took 661 -> 413
    ms (nnx.jit, A/B in one process, 2 AMD EPYC cores)."""
    pytest.importorskip("flax")
    net, inputs, expected, _, _ = cases["lenet"]
    model = to_flax(net)
    text = str(jax.make_jaxpr(lambda x: model(data=x))(inputs["data"]))
    assert text.count("conv_general_dilated") >= 1 and "lhs_spec=(0, 1, 2, 3)" not in text  # no NCHW convolution
    assert_outputs_close(run(model, inputs), expected)


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
