"""XLA compiler options caffejax picks per compiled program, from what was measured on Caffe's nets.

The main option is ``xla_cpu_experimental_ynn_fusion_type``: which instructions XLA:CPU hands to YNNPACK.
XLA's own default (the option unset; jaxlib 0.10) hands it dots *and all but small convolutions*, one by
one (``LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT`` and ``..._INDIVIDUAL_CONVOLUTION``; naming the first alone leaves
convolutions to XLA). On 2 AVX2 cores YNNPACK's forward convolutions were as fast as XLA's (Eigen) ones,
but the convolutions XLA builds for a filter gradient ran 2-3x slower there: a 3x3 convolution on
16x28x28x128, forward and filter gradient, took 122 ms under the default against 49-54 ms with any of the
settings below. On 2 AMD EPYC cores (AVX-512) its forward convolutions were slower too, at batch 16 (with
ReLU): 3x3 on 56x56x64 102 against 180 GFLOP/s, AlexNet's conv1 86 against 168, SqueezeNet's 46 against 69.

- ``LIBRARY_FUSION_TYPE_DOT`` (:data:`YNN_DOT`; XLA_FLAGS spells it ``dot``): dots, with the element-wise
  work around them, become YNNPACK fusions; convolutions stay XLA's, except one whose result is summed with
  a dot's (a fire module's input gradient), which joins that fusion. Forward programs with at least
  :data:`YNN_MIN_FLOPS` of convolution and inner-product work per pass get it. Smaller forward programs keep
  XLA's default, which there was fastest: LeNet at batch 1, 0.16 ms a forward, against 0.35-0.41 ms with
  dot fusions and 0.32-0.44 ms with YNNPACK off.
- ``...,LIBRARY_FUSION_TYPE_REDUCE`` (:data:`YNN_DOT_AND_REDUCE`): every program with a backward pass (a
  ``Net.backward``, a training step), whatever its size, but for 16-bit nets' (single dots, below). A training step
  sums over batch and space for every bias and depthwise-filter gradient, and XLA's own reductions that keep the
  minor (channel) axis run at 3-4 GB/s. Measured on 2 AVX2 cores, one training step at batch 16: MobileNet v2 5.0 ->
  2.4 s, AlexNet 1.1 -> 0.85 s, SqueezeNet 0.99 -> 0.88 s, ResNet-50 4.5 -> 4.1 s, LeNet 7.3 -> 6.2 ms, GoogLeNet
  unchanged; LeNet at batch 1, 1.26-1.28 ms against 1.39-1.64 ms under XLA's default and 1.47-1.91 ms with YNNPACK
  off. Element-wise fusions through YNNPACK made every step slower.

- ``LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT`` (:data:`YNN_INDIVIDUAL_DOT`): 16-bit programs, bfloat16 forwards
  (``compile_inference(dtype=jnp.bfloat16)``) with at least :data:`YNN_MIN_FLOPS` and every one with a backward (a
  ``Net(dtype=jnp.bfloat16)``'s). YNNPACK takes each dot on its own; convolutions, and the roundings to bfloat16
  around the dots, stay XLA's. On a CPU with bfloat16 matrix instructions (AVX512_BF16 or AMX-BF16,
  :func:`cpu_has_bf16_matrix_instructions`) each bfloat16 x bfloat16 -> float32 dot runs on those. Measured on 2
  Sapphire Rapids cores, a 2048^2 product: 570-980 GFLOP/s, against 140-200 inside dot fusions (:data:`YNN_DOT`)
  and 240 for float32. On 2 AMD EPYC cores with AVX512_BF16 but no AMX, bfloat16 products of ResNet-50's shapes
  ran at 240-360 GFLOP/s this way against 175-200 in dot fusions. XLA's default also sends convolutions to
  YNNPACK, where a float32 3x3 one ran at 175 GFLOP/s against 220-250 under this option. On a CPU without them
  (AVX2), where a bfloat16 program widens its values for float32 products, dot fusions are wrong for bfloat16:
  YNNPACK (jaxlib 0.10.2) drops the float32 -> bfloat16 roundings it takes into a fusion, on the dot's operands
  and on its result, so that ``x.astype(bfloat16).astype(float32) @ eye`` came back as ``x`` itself, and LeNet's
  bfloat16 forward gave 18 of its 160 probabilities other values than the rounding the program defines (2 AMD EPYC
  Zen 3 cores). Smaller bfloat16 forwards keep XLA's default, as float32 ones do; it hands their dots to YNNPACK
  one by one as well, and LeNet's 1-channel conv1 (widened to float32) runs faster there: LeNet's bfloat16 forward
  at batch 1 took 0.21 ms against 0.25-0.26 ms under this option, at batch 4 0.35 against 0.43 ms (paired A/B, 2
  AMD EPYC cores).

- ``xla_backend_optimization_level`` 1 (:data:`OPT_LEVEL_OPTION`; XLA's default is 3): float32 forward programs
  under :data:`QUICK_COMPILE_MAX_FLOPS`. Their time goes to library kernels (YNNPACK's, Eigen's) and a few small
  loops, and LLVM's optimisation of those loops is a good part of their compile: fresh processes on 2 AMD EPYC
  cores, two rounds, the first Net.forward (weights' preparation and the pass) at default / level 1: MTCNN's det1 at
  1x3x48x64 0.45-0.50 / 0.32-0.36 s, det2 at 8x3x24x24 0.67-0.75 / 0.49-0.57, det4 at 4x15x24x24 0.87-0.98 /
  0.70-0.75, det3 at 8x3x48x48 0.67-0.69 / 0.61-0.65, LeNet at batch 1 0.25 / 0.23; compile_inference's first call
  det1 0.26-0.33 / 0.15-0.20 s, det2 0.50-0.62 / 0.34-0.39, det4 0.77-0.84 / 0.58-0.66. Their steady forwards, both
  programs in one process in alternating blocks (10-14 rounds), level 1 over default: LeNet at batch 1 0.996 and 16
  1.01, det2 0.90, det3 0.97, det4 0.94, det1 even; the same bits. Bigger programs keep level 3: SqueezeNet v1.1 at
  batch 1 (775 MFLOP) read 1.02 and other bits. bfloat16 programs too: their conversions are LLVM's loops (det2's
  bfloat16 forward 1.10 at level 1, LeNet's at batch 1 1.03).

Options go through ``jax.jit(compiler_options=...)``; nothing process-wide changes. ``CAFFEJAX_XLA_YNN=0``
in the environment turns YNNPACK off for every program (an empty fusion list, not XLA's default);
``CAFFEJAX_XLA_YNN=1`` gives every program the settings above as if it were large.
"""

from __future__ import annotations

import functools
import pathlib
import re

import jax
import jax.numpy as jnp

from caffejax.frontend.ir import Graph, Layer
from caffejax.lower.registry import count
from caffejax.runtime.mode import environment_switch
from caffejax.runtime.program_profile import parse_hlo

YNN_OPTION = "xla_cpu_experimental_ynn_fusion_type"
YNN_DOT = "LIBRARY_FUSION_TYPE_DOT"
YNN_OFF = ""  # no fusion type at all (unset, the option keeps XLA's default: individual dots and convolutions)
YNN_DOT_AND_REDUCE = f"{YNN_DOT},LIBRARY_FUSION_TYPE_REDUCE"
YNN_INDIVIDUAL_DOT = "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"
YNN_MIN_FLOPS = 20e6
ENVIRONMENT = "CAFFEJAX_XLA_YNN"
OPT_LEVEL_OPTION = "xla_backend_optimization_level"
QUICK_COMPILE_MAX_FLOPS = 250e6


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


@functools.cache
def cpu_has_bf16_matrix_instructions() -> bool:
    """Whether this CPU multiplies bfloat16 matrices natively (AVX512_BF16 or AMX-BF16 in /proc/cpuinfo):
    where it does not, bfloat16 products are widened and a bfloat16 program is no faster than a float32 one."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return "avx512_bf16" in flags or "amx_bf16" in flags


def bf16_matrix_programs(dtype) -> bool:
    """Whether programs computing in ``dtype`` get the bfloat16 matrix path: XLA:CPU, a bfloat16 dtype and a
    CPU with bfloat16 matrix instructions."""
    return (jnp.dtype(dtype) == jnp.bfloat16 and jax.default_backend() == "cpu"
            and cpu_has_bf16_matrix_instructions())


def compiler_options(graph: Graph, backward: bool = False, dtype=jnp.float32) -> dict[str, str]:
    """The options for one program running ``graph`` in ``dtype``: one forward, or with ``backward`` a
    program that also computes gradients (a backward pass, a training step)."""
    if backward:
        return _options(YNN_INDIVIDUAL_DOT if _is_16_bit(dtype) else YNN_DOT_AND_REDUCE)
    return forward_options(matmul_flops(graph), dtype)


def xla_options_for(net, backward: bool = False, dtype=None) -> dict[str, str]:
    """The XLA options caffejax compiles ``net``'s programs with (:func:`compiler_options`; ``dtype`` by default the
    net's own), for programs a user jits: ``jax.jit(caffejax.value_and_grad(net),
    compiler_options=caffejax.xla_options_for(net, backward=True))``, or a Flax training step jitted through
    ``nnx.split``/``nnx.merge`` (``nnx.jit`` takes no options). Empty off the CPU. Under ``jax.jit``'s defaults
    SqueezeNet v1.1's value_and_grad at batch 16 took 445 against 364 ms (2 AMD EPYC cores)."""
    return compiler_options(net.graph, backward=backward, dtype=net._dtype if dtype is None else dtype)


def forward_options(flops: float, dtype=jnp.float32) -> dict[str, str]:
    """The options for a forward program of ``flops`` (:func:`matmul_flops`) in ``dtype``: also those a loaded
    StableHLO export (caffejax.export) is compiled with, from the count the export recorded."""
    quick = flops < QUICK_COMPILE_MAX_FLOPS and jnp.dtype(dtype) == jnp.float32
    if not (environment_switch(ENVIRONMENT) or flops >= YNN_MIN_FLOPS):
        return _options(None, quick)
    return _options(YNN_INDIVIDUAL_DOT if _is_16_bit(dtype) else YNN_DOT, quick)


def _is_16_bit(dtype) -> bool:
    """Whether a program computing in ``dtype`` rounds its values to 16 bits (bfloat16, float16): YNNPACK's
    fusions other than single dots drop those roundings (see the module's note on :data:`YNN_INDIVIDUAL_DOT`)."""
    return jnp.dtype(dtype).itemsize == 2


def _options(fusion_type: str | None, quick_compile: bool = False) -> dict[str, str]:
    """``fusion_type`` as the option on XLA:CPU (None: XLA's default), unless ``CAFFEJAX_XLA_YNN=0`` turns
    YNNPACK off, and with ``quick_compile`` the backend's optimisation level 1; no options on other backends."""
    if jax.default_backend() != "cpu":
        return {}
    if environment_switch(ENVIRONMENT) is False:
        options = {YNN_OPTION: YNN_OFF}
    else:
        options = {} if fusion_type is None else {YNN_OPTION: fusion_type}
    return {**options, OPT_LEVEL_OPTION: "1"} if quick_compile else options


# A YNNPACK fusion's call of its computation, in a compiled program's HLO text.
_YNN_FUSION_CALL = re.compile(r'calls=%([\w.\-]+).*"kind":"__ynn_fusion"')
_SAME_VALUES = frozenset({"bitcast", "reshape", "transpose", "copy"})  # what a broadcast stays through


def ynn_multiplies_a_broadcast(hlo: str) -> bool:
    """Whether a compiled program (its optimised HLO text, ``compiled.as_text()``) has a dot inside a YNNPACK
    fusion with an operand that is a broadcast. XLA:CPU's YNNPACK dot fusions (jaxlib 0.10.2, :data:`YNN_DOT`)
    multiply by one wrongly: ``x @ jnp.zeros((32, 1024)).T`` gives NaN, by a broadcast of 0.25 values near 1e34,
    while XLA's own dot is right. XLA makes a broadcast of a constant whose values are all one value, and of a
    slice of a constant that is so (the zeroed group of held filters that one group's product takes), so a
    program holding weights as constants can meet it."""
    fused = set(_YNN_FUSION_CALL.findall(hlo))
    if not fused:
        return False
    _, computations = parse_hlo(hlo)
    for name in fused:
        made_by = {instruction.name: instruction for instruction in computations.get(name, [])}
        if any(instruction.opcode == "dot" and any(_producer(made_by, v) == "broadcast" for v in instruction.references)
               for instruction in made_by.values()):
            return True
    return False


def _producer(made_by: dict, value: str) -> str:
    """The opcode that makes ``value`` in one computation (``made_by``: its instructions by name), through the
    instructions that keep its values; "parameter" for what comes from outside it."""
    while value in made_by and made_by[value].opcode in _SAME_VALUES:
        value = made_by[value].references[0]
    return made_by[value].opcode if value in made_by else "parameter"
