"""Per-program XLA options: YNNPACK for programs with enough convolution work, and its numerics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import caffejax
from caffejax.runtime import xla_options
from conftest import BUNDLED

LENET = BUNDLED / "lenet" / "lenet.prototxt"


def test_matmul_flops_counts_convolutions_and_inner_products():
    graph = caffejax.Net(str(LENET), caffejax.TEST).graph
    batch = graph.value_shapes[graph.fed["data"]][0]
    # conv1 20x24x24 x 25, conv2 50x8x8 x 500, ip1 800 -> 500, ip2 500 -> 10; multiply-adds x 2 per image
    per_image = 2 * (20 * 24 * 24 * 25 + 50 * 8 * 8 * 500 + 800 * 500 + 500 * 10)
    assert xla_options.matmul_flops(graph) == batch * per_image


def test_ynnpack_dot_fusions_for_big_forwards_and_every_backward(monkeypatch):
    monkeypatch.delenv(xla_options.ENVIRONMENT, raising=False)
    net = caffejax.Net(str(LENET), caffejax.TEST)
    big = net.graph  # batch 64: 294 MFLOP
    net.blobs["data"].reshape(1, 1, 28, 28)
    net.reshape()
    small = net.graph  # 5 MFLOP
    cpu = jax.default_backend() == "cpu"
    expected = {xla_options.YNN_OPTION: xla_options.YNN_DOT} if cpu else {}
    with_backward = {xla_options.YNN_OPTION: xla_options.YNN_DOT_AND_REDUCE} if cpu else {}
    quick = {xla_options.OPT_LEVEL_OPTION: "1"} if cpu else {}  # (a small float32 forward's, below)
    assert xla_options.compiler_options(big) == expected
    assert xla_options.compiler_options(big, backward=True) == with_backward
    assert xla_options.compiler_options(small) == quick  # YNNPACK at XLA's default: fastest for tiny forwards
    assert xla_options.compiler_options(small, backward=True) == with_backward
    off = {xla_options.YNN_OPTION: ""} if cpu else {}  # an empty list: unset would mean XLA's default
    for spelling in ("0", "off"):
        monkeypatch.setenv(xla_options.ENVIRONMENT, spelling)
        assert xla_options.compiler_options(big) == xla_options.compiler_options(big, backward=True) == off
        assert xla_options.compiler_options(small) == {**off, **quick}
        assert xla_options.compiler_options(small, backward=True) == off
    monkeypatch.setenv(xla_options.ENVIRONMENT, "1")
    assert xla_options.compiler_options(small) == {**expected, **quick}
    assert xla_options.compiler_options(small, backward=True) == with_backward


def test_small_float32_forwards_compile_at_llvm_level_1(monkeypatch):
    """Float32 forward programs under QUICK_COMPILE_MAX_FLOPS compile at xla_backend_optimization_level 1: MTCNN's
    nets' first forwards took 20-40% less time, their steady forwards as long or less. Bigger forwards, bfloat16
    ones and every program with a backward keep XLA's level. LeNet's outputs are the same bits at either level."""
    monkeypatch.delenv(xla_options.ENVIRONMENT, raising=False)
    level = xla_options.OPT_LEVEL_OPTION
    net = caffejax.Net(str(LENET), str(BUNDLED / "lenet" / "lenet_iter_10000.caffemodel"), caffejax.TEST)
    big = net.graph  # batch 64: 294 MFLOP
    net.blobs["data"].reshape(2, 1, 28, 28)
    net.reshape()
    small = net.graph  # 9 MFLOP
    cpu = jax.default_backend() == "cpu"
    assert (xla_options.compiler_options(small).get(level) == "1") == cpu
    assert xla_options.forward_options(xla_options.QUICK_COMPILE_MAX_FLOPS - 1).get(level) == ("1" if cpu else None)
    assert level not in xla_options.forward_options(xla_options.QUICK_COMPILE_MAX_FLOPS)
    assert level not in xla_options.compiler_options(big)
    assert level not in xla_options.compiler_options(small, backward=True)
    assert level not in xla_options.compiler_options(small, dtype=jnp.bfloat16)
    x = np.random.default_rng(0).random((2, 1, 28, 28), dtype=np.float32)
    quick = np.asarray(caffejax.compile_inference(net)({"data": x})["prob"])
    monkeypatch.setattr(xla_options, "QUICK_COMPILE_MAX_FLOPS", 0)  # every program at XLA's level
    assert level not in xla_options.compiler_options(small)
    np.testing.assert_array_equal(np.asarray(caffejax.compile_inference(net)({"data": x})["prob"]), quick)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="an XLA:CPU option")
def test_ynnpack_convolutions_and_gradients_are_as_exact_as_xlas_own():
    """Forward, input and filter gradients of convolutions (3x3, 7x7 stride 2, 1x1 stride 2) in float32, with
    and without YNNPACK, against float64: both within float32 rounding."""
    rng = np.random.default_rng(0)
    for n, c, h, o, k, s in [(4, 16, 14, 24, 3, 1), (2, 3, 32, 8, 7, 2), (2, 32, 9, 16, 1, 2)]:
        x, w = rng.standard_normal((n, h, h, c)), rng.standard_normal((k, k, c, o))
        size = (h + 2 * (k // 2) - k) // s + 1
        dy = rng.standard_normal((n, size, size, o))

        def conv(x, w):
            return lax.conv_general_dilated(x, w, (s, s), [(k // 2, k // 2)] * 2,
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=lax.Precision.HIGHEST)

        def forward_backward(x, w, dy):
            y, vjp = jax.vjp(conv, x, w)
            return (y, *vjp(dy))

        with jax.enable_x64(True):
            want = [np.asarray(a) for a in jax.jit(forward_backward)(x, w, dy)]
        for options in ({}, {xla_options.YNN_OPTION: xla_options.YNN_OFF},
                        {xla_options.YNN_OPTION: xla_options.YNN_DOT},
                        {xla_options.YNN_OPTION: xla_options.YNN_DOT_AND_REDUCE}):
            got = jax.jit(forward_backward, compiler_options=options)(*(a.astype(np.float32) for a in (x, w, dy)))
            for name, a, b in zip(("y", "dx", "dw"), got, want):
                error = np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max()
                assert error < 1e-5, (options, (n, c, h, o, k, s), name, error)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="an XLA:CPU option")
def test_ynnpack_off_means_no_ynnpack_fusions(monkeypatch):
    """``CAFFEJAX_XLA_YNN=0`` leaves no YNNPACK fusion in a program: the option is set to an empty list,
    since leaving it unset keeps XLA's default, which sends every dot to YNNPACK."""
    graph = caffejax.Net(str(LENET), caffejax.TEST).graph
    x = np.ones((16, 800), np.float32)
    w = np.ones((800, 500), np.float32)

    def compiled_text(options):
        return jax.jit(lambda x, w: jax.nn.relu(x @ w), compiler_options=options).lower(x, w).compile().as_text()

    monkeypatch.setenv(xla_options.ENVIRONMENT, "0")
    assert "__ynn_fusion" not in compiled_text(xla_options.compiler_options(graph))
    assert "__ynn_fusion" not in compiled_text(xla_options.compiler_options(graph, backward=True))
    monkeypatch.setenv(xla_options.ENVIRONMENT, "1")
    assert "__ynn_fusion" in compiled_text(xla_options.compiler_options(graph))


def test_bfloat16_programs_get_single_dots_and_bfloat16_passes_where_the_cpu_multiplies_bfloat16(monkeypatch):
    """A big bfloat16 forward sends each dot to YNNPACK alone: on a CPU with bfloat16 matrix instructions it
    runs bfloat16 -> float32 products on them, and there the passes conv_gemm, conv_im2col, winograd_medium,
    widen and defer_rounding run besides the default ones; elsewhere dot fusions would drop its roundings (see
    test_ynnpack_fusions_keep_no_bfloat16_rounding). A small one keeps XLA's default, as a float32 one does
    (it hands dots, and convolutions, to YNNPACK one by one). A 16-bit program with a backward takes single
    dots and no reductions; float32 programs take dot (and reduction) fusions on either CPU."""
    from caffejax.lower.optimize import DEFAULT_PASSES
    from caffejax.runtime.inference import default_passes

    monkeypatch.delenv(xla_options.ENVIRONMENT, raising=False)
    net = caffejax.Net(str(LENET), caffejax.TEST)
    big = net.graph  # batch 64: 294 MFLOP
    net.blobs["data"].reshape(1, 1, 28, 28)
    net.reshape()
    small = net.graph
    cpu = jax.default_backend() == "cpu"
    dots = {xla_options.YNN_OPTION: xla_options.YNN_DOT} if cpu else {}
    with_backward = {xla_options.YNN_OPTION: xla_options.YNN_DOT_AND_REDUCE} if cpu else {}
    single = {xla_options.YNN_OPTION: xla_options.YNN_INDIVIDUAL_DOT} if cpu else {}
    for has in (True, False):
        monkeypatch.setattr(xla_options, "cpu_has_bf16_matrix_instructions", lambda has=has: has)
        matrix = has and cpu
        assert xla_options.bf16_matrix_programs(jnp.bfloat16) == matrix
        assert not xla_options.bf16_matrix_programs(jnp.float32)
        assert xla_options.compiler_options(big, dtype=jnp.bfloat16) == single
        assert xla_options.compiler_options(big, dtype=jnp.float32) == dots
        assert xla_options.compiler_options(small, dtype=jnp.bfloat16) == {}
        assert xla_options.compiler_options(small, dtype=jnp.float32) == (
            {xla_options.OPT_LEVEL_OPTION: "1"} if cpu else {})
        for graph in (big, small):
            assert xla_options.compiler_options(graph, backward=True, dtype=jnp.bfloat16) == single
            assert xla_options.compiler_options(graph, backward=True, dtype=jnp.float16) == single
            assert xla_options.compiler_options(graph, backward=True) == with_backward
        assert default_passes(jnp.float32) == DEFAULT_PASSES
        assert default_passes(jnp.bfloat16) == (
            DEFAULT_PASSES + ("merge_concat_convolutions", "conv_gemm", "conv_im2col", "winograd_medium", "widen",
                              "defer_rounding")
            if matrix else DEFAULT_PASSES)
        monkeypatch.setenv(xla_options.ENVIRONMENT, "1")  # every program as if it were big
        assert xla_options.compiler_options(small, dtype=jnp.bfloat16) == single
        monkeypatch.delenv(xla_options.ENVIRONMENT)
    monkeypatch.setenv(xla_options.ENVIRONMENT, "0")
    assert xla_options.compiler_options(small, dtype=jnp.bfloat16) == ({xla_options.YNN_OPTION: ""} if cpu else {})


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="an XLA:CPU option")
def test_ynnpack_fusions_keep_no_bfloat16_rounding():
    """The options a bfloat16 net's programs get keep every rounding to bfloat16 the program defines. Inside
    YNNPACK's dot and reduction fusions XLA:CPU (jaxlib 0.10.2) dropped them on a CPU without bfloat16
    instructions (2 AMD EPYC Zen 3 cores: x rounded to bfloat16 and widened, times the identity, came back as
    x itself). A forward big enough for YNNPACK and a backward, each through caffejax's options for it."""
    net = caffejax.Net(str(LENET), caffejax.TEST)
    net.blobs["data"].reshape(64, 1, 28, 28)
    net.reshape()
    x = np.random.default_rng(6).standard_normal((64, 800)).astype(np.float32) * 10
    rounded = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)

    def forward(x, w):  # rounded in, rounded out, around a float32 product
        y = jnp.asarray(x, jnp.bfloat16).astype(jnp.float32) @ w
        return y.astype(jnp.bfloat16).astype(jnp.float32)

    for backward in (False, True):
        options = xla_options.compiler_options(net.graph, backward=backward, dtype=jnp.bfloat16)
        np.testing.assert_array_equal(np.asarray(jax.jit(forward, compiler_options=options)(x, jnp.eye(800))),
                                      rounded, err_msg=f"backward={backward}")
    sums = jax.jit(lambda x: jnp.sum(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), axis=0),
                   compiler_options=xla_options.compiler_options(net.graph, backward=True, dtype=jnp.bfloat16))
    np.testing.assert_allclose(np.asarray(sums(x)), rounded.sum(axis=0), rtol=1e-6, atol=1e-5)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="an XLA:CPU option")
def test_single_bfloat16_dots_sum_in_float32():
    """Under YNN_INDIVIDUAL_DOT a bfloat16 x bfloat16 -> float32 product (on bfloat16 matrix instructions where
    the CPU has them) sums in float32: within float32 rounding of the float64 product of the same operands."""
    rng = np.random.default_rng(3)
    a = np.asarray(jnp.asarray(rng.standard_normal((96, 4096)), jnp.bfloat16))
    b = np.asarray(jnp.asarray(rng.standard_normal((4096, 80)), jnp.bfloat16))
    product = jax.jit(lambda a, b: lax.dot(a, b, preferred_element_type=jnp.float32),
                      compiler_options={xla_options.YNN_OPTION: xla_options.YNN_INDIVIDUAL_DOT})
    got = np.asarray(product(a, b), np.float64)
    want = a.astype(np.float64) @ b.astype(np.float64)
    scale = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64))
    assert np.abs(got - want).max() / scale.max() < 1e-5


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="YNNPACK fusions are XLA:CPU's")
def test_a_ynnpack_dot_of_a_broadcast_is_found_in_the_compiled_program():
    """XLA:CPU's YNNPACK dot fusions (jaxlib 0.10.2) multiply by a broadcast operand wrongly; a constant of one
    value in all is a broadcast to XLA. The check finds such a dot in a compiled program's HLO, through the
    bitcasts and transposes between, and only inside a YNNPACK fusion: XLA's own dot of it is right."""
    dot_fusions = {xla_options.YNN_OPTION: xla_options.YNN_DOT}
    x, w = jnp.ones((64, 1024)), jnp.ones((32, 1024))

    def found(fn, *args, options=dot_fusions):
        return xla_options.ynn_multiplies_a_broadcast(jax.jit(fn, compiler_options=options).lower(*args)
                                                     .compile().as_text())

    assert found(lambda x: jnp.maximum(x, 0.2) @ jnp.zeros((32, 1024)).T + 1, x)
    assert found(lambda x: x @ jnp.broadcast_to(x[0, 0], (1024, 32)), x)
    assert not found(lambda x: jnp.maximum(x, 0.2) @ jnp.zeros((32, 1024)).T + 1, x, options={})
    assert not found(lambda x, w: jnp.maximum(x, 0.2) @ w.T + 1, x, w)  # (the maximum's 0.2 is a broadcast too)
    assert not xla_options.ynn_multiplies_a_broadcast("")


def test_xla_options_for_a_net_are_its_programs_and_jit_takes_them():
    """caffejax.xla_options_for(net): the options caffejax's own programs of the net get, for programs a user jits
    (caffejax.value_and_grad, a Flax step); the values are the same under either."""
    n = caffejax.NetSpec()
    n.data = caffejax.layers.Input(shape=dict(dim=[4, 1, 12, 12]))
    n.label = caffejax.layers.Input(shape=dict(dim=[4]))
    n.conv = caffejax.layers.Convolution(n.data, num_output=8, kernel_size=3,
                                         weight_filler=dict(type="gaussian", std=0.3))
    n.ip = caffejax.layers.InnerProduct(n.conv, num_output=3, weight_filler=dict(type="gaussian", std=0.1))
    n.loss = caffejax.layers.SoftmaxWithLoss(n.ip, n.label)
    net = caffejax.Net(n.to_proto(), caffejax.TRAIN)
    assert caffejax.xla_options_for(net, backward=True) == xla_options.compiler_options(net.graph, backward=True)
    assert caffejax.xla_options_for(net) == xla_options.compiler_options(net.graph)
    if jax.default_backend() == "cpu":
        assert caffejax.xla_options_for(net, backward=True) == {xla_options.YNN_OPTION: xla_options.YNN_DOT_AND_REDUCE}
    rng = np.random.default_rng(0)
    batch = {"data": rng.random((4, 1, 12, 12), dtype=np.float32), "label": np.array([0, 1, 2, 1], np.float32)}
    f = caffejax.value_and_grad(net)
    loss, grads = jax.jit(f, compiler_options=caffejax.xla_options_for(net, backward=True))(net.param_arrays(), batch)
    want_loss, want = jax.jit(f)(net.param_arrays(), batch)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    assert float(loss) > 0
    for layer in want:
        for got, expected in zip(grads[layer], want[layer]):
            np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-7, err_msg=layer)
