"""Per-program XLA options: YNNPACK for programs with enough convolution work, and its numerics."""

from __future__ import annotations

import jax
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
    assert xla_options.compiler_options(big) == expected
    assert xla_options.compiler_options(big, backward=True) == with_backward
    assert xla_options.compiler_options(small) == {}  # XLA's default: fastest for tiny forwards
    assert xla_options.compiler_options(small, backward=True) == with_backward
    off = {xla_options.YNN_OPTION: ""} if cpu else {}  # an empty list: unset would mean XLA's default
    for spelling in ("0", "off"):
        monkeypatch.setenv(xla_options.ENVIRONMENT, spelling)
        for graph in (big, small):
            assert xla_options.compiler_options(graph) == xla_options.compiler_options(graph, backward=True) == off
    monkeypatch.setenv(xla_options.ENVIRONMENT, "1")
    assert xla_options.compiler_options(small) == expected
    assert xla_options.compiler_options(small, backward=True) == with_backward


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
