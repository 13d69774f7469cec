"""XLA compiler options caffejax picks per compiled program, from what was measured on Caffe's nets.

``xla_cpu_experimental_ynn_fusion_type=dot`` (XLA_FLAGS spelling) sends XLA:CPU's dot products and
convolutions through YNNPACK. On 2 AVX2 cores it runs 3x3 convolutions twice as fast as XLA's own kernels and
their filter gradient (XLA: ~10 GFLOP/s) ten times as fast, with the same float32 results up to rounding;
ResNet-50's training step takes half the time. On tiny programs (LeNet at batch 1: 5 MFLOP a pass) its
per-call cost makes them slower; from LeNet at batch 16 (74 MFLOP) on it wins. So it is set per program,
through ``jax.jit(compiler_options=...)``, for programs with at least :data:`YNN_MIN_FLOPS` of convolution
and inner-product work per pass on the CPU; nothing process-wide changes.

Programs with a backward pass also send reductions through YNNPACK (``...,LIBRARY_FUSION_TYPE_REDUCE``): a
training step sums over batch and space for every bias and depthwise-filter gradient, and XLA's own
reductions that keep the minor (channel) axis run at 3-4 GB/s. Measured on 2 AVX2 cores, batch 16, one
training step: MobileNet v2 5.0 -> 2.4 s, AlexNet 1.1 -> 0.85 s, SqueezeNet 0.99 -> 0.88 s, ResNet-50
4.5 -> 4.1 s, LeNet 7.3 -> 6.2 ms, GoogLeNet unchanged. Forward-only programs keep dot fusions alone:
there it was no faster and at times slower. Element-wise fusions through YNNPACK made every step slower.

``CAFFEJAX_XLA_YNN=0`` (or ``1``) in the environment turns it off (on) for every program.
"""

from __future__ import annotations

import os

import jax

from caffejax.frontend.ir import Graph, Layer
from caffejax.lower.registry import count

YNN_OPTION = "xla_cpu_experimental_ynn_fusion_type"
YNN_DOT = "LIBRARY_FUSION_TYPE_DOT"  # XLA_FLAGS spells it "dot"; XLA:CPU then runs convolutions as YNN dots too
YNN_DOT_AND_REDUCE = f"{YNN_DOT},LIBRARY_FUSION_TYPE_REDUCE"
YNN_MIN_FLOPS = 20e6
ENVIRONMENT = "CAFFEJAX_XLA_YNN"


def matmul_flops(graph: Graph) -> int:
    """2 x the multiply-adds of the graph's direct convolutions and inner products, from its shapes."""
    return sum(layer_matmul_flops(graph, layer) for layer in graph.layers)


def layer_matmul_flops(graph: Graph, layer: Layer) -> int:
    """2 x the multiply-adds of one layer if it is a convolution or inner product, else 0."""
    if layer.type in ("Convolution", "Deconvolution") and layer.params:
        filters = layer.params[0].shape
        # Convolution: each top element takes C/g * k... multiply-adds; Deconvolution: each bottom element.
        values = layer.top_values if layer.type == "Convolution" else layer.bottom_values
        return sum(2 * count(graph.value_shapes[v] or ()) * count(filters, 1) for v in values)
    if layer.type == "InnerProduct" and layer.bottom_values:
        return 2 * count(graph.value_shapes[layer.bottom_values[0]] or ()) * layer.proto.inner_product_param.num_output
    return 0


def compiler_options(graph: Graph, backward: bool = False) -> dict[str, str]:
    """The options for one program running ``graph``: one forward, or with ``backward`` a program that also
    computes gradients (a backward pass, a training step)."""
    forced = os.environ.get(ENVIRONMENT, "").strip().lower()
    if jax.default_backend() != "cpu" or forced in ("0", "false", "off", "no"):
        return {}
    if forced in ("1", "true", "on", "yes") or matmul_flops(graph) >= YNN_MIN_FLOPS:
        return {YNN_OPTION: YNN_DOT_AND_REDUCE if backward else YNN_DOT}
    return {}
