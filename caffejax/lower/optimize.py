"""Inference optimisation: graph rewrites and kernel choices for ``caffejax.compile_inference``.

``Net.forward`` runs Caffe's rules as written (NCHW, every blob kept). For inference only the outputs matter,
so a compiler may rewrite the net as long as the outputs stay Caffe's (within the forward tolerance). A
:class:`Plan` is the net as the inference program runs it: the IR graph after rewrites, one list of arrays
per layer (sharing resolved, BatchNorm folded) and the kernel chosen for each layer. Each pass is a function
``Plan -> Plan`` registered in :data:`PASSES` by name; ``compile_inference(passes=...)`` picks them:

- ``fold_batchnorm``: BatchNorm with global statistics (and a Scale after it) folded into the Convolution or
  InnerProduct before it, or, without one, into one per-channel affine Scale.
- ``merge_concat_convolutions``: a channel Concat of centred convolutions of one input (each through the same
  ReLU, or none) as one convolution, the smaller kernels set in the middle of the largest (bfloat16 on CPUs
  with bfloat16 matrix instructions, where it becomes one im2col product).
- ``nhwc``: channels-last inside the program (XLA:CPU's convolutions are NHWC kernels; NCHW ones pay
  transposes around every call), NCHW at the boundary. Layers without a channels-last kernel get their
  input transposed back and run Caffe's rule; each transpose of a value is made once.
- ``conv_gemm``: 1x1 convolutions as one matrix product over all pixels (needs ``nhwc``). Not a default for
  inference (see :data:`DEFAULT_PASSES`); Net's own programs use it.
- ``winograd``: 3x3 stride-1 convolutions on small images, over at least 64 output tiles, as Winograd F(2x2, 3x3)
  (needs ``nhwc``).
- ``winograd_medium``: the same up to 28x28 images (bfloat16 on CPUs with bfloat16 matrix instructions).
- ``conv_im2col``: convolutions with many filters as Caffe computes them, im2col (each output pixel's window
  as a row) and one product per group (bfloat16 on CPUs with bfloat16 matrix instructions, where the products
  run on those; it takes its layers before the ``winograd`` passes).
- ``widen``: direct convolutions, pooling and LRN computed in float32 when the values are bfloat16 (XLA:CPU's
  bfloat16 versions of these are slower than its float32 ones).
- ``defer_rounding``: a product whose output only widened convolutions and poolings read (through element-wise
  layers) keeps its float32 sum; the widened kernel rounds once. One read by a plain ReLU alone keeps it too,
  and the ReLU rounds (the same bits); so does a sum of two values (an Eltwise SUM without coefficients).
- ``inner_product_nhwc``: an InnerProduct reads a channels-last value as it is, its weight's columns permuted
  once (StableHLO exports, where the weights are constants; not a default of compile_inference).

Grouped and depthwise convolutions run as Caffe's rule runs them (one convolution per group; depthwise as
shifted multiply-adds: ``vision.grouped_convolution``), in either layout.

Every kernel computes in the activations' dtype and accumulates in float32 (``preferred_element_type``),
so the same plan serves float32 and the opt-in bfloat16 mode. ``tests/test_optimize.py`` checks each pass
against the unoptimised program.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from caffejax.errors import CaffejaxError, ShapeError, UnsupportedError, layer_error
from caffejax.frontend.ir import Graph, Layer, producer_by_value, readers_by_value
from caffejax.lower import vision
from caffejax.lower.common import (accumulator_dtype, batch_norm_global_stats, matmul, transposed_copy,
                                   uses_global_stats)
from caffejax.lower.registry import LayerContext, canonical_axis, get_rule, is_symbolic
from caffejax.proto import caffe_pb2

NCHW, NHWC, ANY = "NCHW", "NHWC", "ANY"

ForwardFn = Callable[[LayerContext, Sequence[jax.Array], Sequence[jax.Array]], Sequence[jax.Array]]
ParamArrays = list[np.ndarray]


def _same_params(params: ParamArrays) -> ParamArrays:
    return list(params)


@dataclasses.dataclass(frozen=True)
class Kernel:
    """How one layer runs: ``forward(ctx, bottoms, params) -> tops`` with its 4-D bottoms and tops in
    ``layout`` (ANY: whatever layout its bottoms have, for element-wise layers), and ``prepare``, which turns
    the layer's Caffe-form arrays into the form ``forward`` reads (once, when the program is built)."""

    name: str
    forward: ForwardFn
    layout: str = NCHW
    prepare: Callable[[ParamArrays], ParamArrays] = _same_params
    chain: Chain | None = None

    @property
    def prepares(self) -> bool:
        """Whether ``forward`` reads the layer's arrays in a form of its own (``prepare`` is no identity)."""
        return self.prepare is not _same_params


@dataclasses.dataclass(frozen=True)
class Chain:
    """A kernel's layer and the layers right after it computed as one: ``prepare(params)`` turns every layer's
    arrays (Caffe's form, in layer order) into arrays of the first layer's form, which its kernel's ``forward``
    takes with the first layer's bottoms to give the last layer's tops; the values in between are never made.
    ``layers`` names the layers after the first.

    A program runs a chain only where all its layers run together and Caffe's backward sends a gradient
    through every link or through none (``NetProgram.run_layers``); elsewhere each layer runs its own kernel.
    ``visible``: a blob ends up holding a value inside the chain (a BatchNorm writing a new blob), so only
    programs that hand none of them back run it (``fold_visible``). ``differentiated``: whether programs with
    a backward pass run it too (where it saves more than it costs there)."""

    name: str
    layers: tuple[str, ...]
    prepare: Callable[[ParamArrays], ParamArrays]
    visible: bool = False
    differentiated: bool = True


@dataclasses.dataclass(frozen=True)
class Plan:
    """The net as the inference program runs it. ``params``: layer name -> its arrays in Caffe's form
    (after folding); ``kernels``: layer name -> kernel (absent: Caffe's rule, NCHW)."""

    graph: Graph
    params: dict[str, ParamArrays]
    kernels: dict[str, Kernel]


def make_plan(graph: Graph, owner_params: Mapping[str, Sequence[Any]]) -> Plan:
    """The unoptimised plan: every layer runs Caffe's rule; shared blobs resolved to per-layer arrays.

    ``owner_params`` are the weights (owner layer -> arrays); the graph's inputs may have other shapes than
    the ones they were made for, as long as every learnable blob keeps its shape.
    """
    params = {}
    for layer in graph.layers:
        arrays = []
        for slot in layer.params:
            array = np.asarray(owner_params[slot.storage[0]][slot.storage[1]])
            if tuple(array.shape) != tuple(slot.shape):
                raise ShapeError(f"layer '{layer.name}' ({layer.type}): at these input shapes its learnable blob "
                                 f"{slot.index} would be {tuple(slot.shape)}, but the weights are "
                                 f"{tuple(array.shape)}")
            arrays.append(array)
        if arrays:
            params[layer.name] = arrays
    return Plan(graph, params, {})


# ---- graph queries ----------------------------------------------------------------------------------------

def _output_values(graph: Graph) -> set[str]:
    return {graph.blob_value[blob] for blob in graph.program_outputs}


def _only_consumer(value: str, users, outputs) -> Layer | None:
    """The one layer reading ``value``, if exactly one does and the value is not a net output."""
    readers = users.get(value, [])
    return readers[0] if len(readers) == 1 and value not in outputs else None


def _shape(graph: Graph, value: str) -> tuple[int, ...]:
    return tuple(graph.value_shapes[value])


# ---- fold_batchnorm ---------------------------------------------------------------------------------------

def _batch_norm_affine(layer: Layer, params: ParamArrays) -> tuple[np.ndarray, np.ndarray]:
    """(a, b) with BatchNorm(x) = a x + b per channel, from the stored sums (batch_norm rule, global stats)."""
    mean_sum, var_sum, factor = (np.asarray(p, np.float64) for p in params)
    scale = 0.0 if factor.reshape(-1)[0] == 0 else 1.0 / factor.reshape(-1)[0]
    inv_std = 1.0 / np.sqrt(scale * var_sum + layer.proto.batch_norm_param.eps)
    return inv_std, -scale * mean_sum * inv_std


def _channel_scale_shape(layer: Layer, graph: Graph) -> bool:
    """Whether ``layer`` is a Scale with its own per-channel (axis 1) blob: y = s x (+ t)."""
    p = layer.proto.scale_param
    shape = _shape(graph, layer.bottom_values[0])
    return (len(layer.bottom_values) == 1 and len(shape) >= 2 and len(layer.params) >= 1
            and canonical_axis(layer.name, p.axis, len(shape)) == 1 and tuple(layer.params[0].shape) == (shape[1],))


def _channel_scale(layer: Layer, graph: Graph, params: ParamArrays) -> tuple[np.ndarray, np.ndarray] | None:
    """(s, t) if ``layer`` is a Scale with its own per-channel (axis 1) blob, y = s x + t; else None."""
    if not _channel_scale_shape(layer, graph):
        return None
    p = layer.proto.scale_param
    s = np.asarray(params[0], np.float64)
    t = np.asarray(params[1], np.float64) if p.bias_term else np.zeros_like(s)
    return s, t


def _folds_into(producer: Layer, graph: Graph) -> bool:
    """A single-top Convolution (channel axis 1) or InnerProduct (axis 1) whose output channels are axis 1."""
    if len(producer.bottom_values) != 1 or len(producer.top_values) != 1:
        return False
    ndim = len(_shape(graph, producer.bottom_values[0]))
    if producer.type == "Convolution":
        return canonical_axis(producer.name, producer.proto.convolution_param.axis, ndim) == 1
    if producer.type == "InnerProduct":
        return canonical_axis(producer.name, producer.proto.inner_product_param.axis, ndim) == 1
    return False


def _with_bias(producer: Layer, weight: np.ndarray, bias: np.ndarray) -> tuple[Any, ParamArrays]:
    proto = caffe_pb2.LayerParameter()
    proto.CopyFrom(producer.proto)
    field = proto.convolution_param if producer.type == "Convolution" else proto.inner_product_param
    field.bias_term = True
    return proto, [weight, bias.astype(np.float32)]


def fold_batchnorm(plan: Plan) -> Plan:
    """Conv/IP -> BatchNorm(global stats) [-> Scale] becomes the Conv/IP with W' = a W, b' = a b + c (a, c
    the chain's per-channel affine map); a BatchNorm [-> Scale] chain after anything else becomes one
    per-channel Scale. Only values read by the next link alone (and not net outputs) are folded away."""
    graph = plan.graph
    users, outputs = readers_by_value(graph.layers), _output_values(graph)
    producer_of = producer_by_value(graph.layers)
    params = dict(plan.params)
    replaced: dict[str, Layer] = {}   # layer name -> its rewrite
    removed: set[str] = set()
    for bn in graph.layers:
        if (bn.type != "BatchNorm" or not uses_global_stats(bn.proto.batch_norm_param, graph.phase)
                or bn.name in removed):
            continue
        a, c = _batch_norm_affine(bn, params[bn.name])
        last = bn
        scale = _only_consumer(bn.top_values[0], users, outputs)
        if scale is not None and scale.type == "Scale":
            affine = _channel_scale(scale, graph, params[scale.name])
            if affine is not None:
                s, t = affine
                a, c = a * s, c * s + t
                last = scale
        chain = [bn] + ([last] if last is not bn else [])
        producer = producer_of.get(bn.bottom_values[0])
        x = bn.bottom_values[0]
        if (producer is not None and producer.name not in replaced and _folds_into(producer, graph)
                and _only_consumer(x, users, outputs) is bn):
            # The per-channel factors are worked out in float64; the weights take one float32 multiply each.
            weight = np.asarray(params[producer.name][0], np.float32)
            bias = (np.asarray(params[producer.name][1], np.float64) if len(params[producer.name]) > 1
                    else np.zeros(a.shape))
            transposed = producer.type == "InnerProduct" and producer.proto.inner_product_param.transpose
            w_scale = a.astype(np.float32).reshape((1, -1) if transposed else (-1,) + (1,) * (weight.ndim - 1))
            folded = np.multiply(weight, w_scale, out=aligned_empty(weight.shape, np.float32))
            proto, params[producer.name] = _with_bias(producer, folded, a * bias + c)
            replaced[producer.name] = dataclasses.replace(
                producer, proto=proto, tops=[last.tops[0]], top_values=[last.top_values[0]])
        else:
            proto = caffe_pb2.LayerParameter(name=bn.name, type="Scale", bottom=list(bn.bottoms),
                                             top=[last.tops[0]])
            proto.scale_param.axis, proto.scale_param.num_axes, proto.scale_param.bias_term = 1, 1, True
            params[bn.name] = [a.astype(np.float32), c.astype(np.float32)]
            replaced[bn.name] = dataclasses.replace(bn, type="Scale", proto=proto, tops=[last.tops[0]],
                                                    top_values=[last.top_values[0]], params=bn.params[:2])
            chain = chain[1:]
        removed.update(layer.name for layer in chain)
    layers = [replaced.get(layer.name, layer) for layer in graph.layers if layer.name not in removed]
    for name in removed:
        params.pop(name, None)
    return dataclasses.replace(plan, graph=dataclasses.replace(graph, layers=layers), params=params)


# ---- merge_concat_convolutions ------------------------------------------------------------------------------

# A Concat of convolutions of one input (SqueezeNet's fire modules: expand1x1 and expand3x3 of the squeeze
# layer, each through a ReLU) is one convolution with the filters side by side, the smaller kernels set in the
# middle of the largest one with zeros around them: one im2col product writes the joined channels, where the
# branches wrote theirs and a Concat read them back to write them again. The 1x1 filters then multiply the
# whole window, zeros included: k*k times their products. Alone, bfloat16 at batch 16 (2 AMX Xeon cores,
# alternating blocks), a fire module's two branches and join against the merged product: 55x55x16 (64 + 64
# filters) 5.31 -> 4.36 ms, but 27x27x32 (128 + 128) 2.60 -> 2.75, 13x13x48 1.27 -> 1.42, 13x13x64 1.69 -> 2.03.
# In SqueezeNet v1.1's whole bfloat16 forward, where a merged module that a MAX pooling reads also keeps its
# float32 sums (defer_rounding), it paid further: merging up to 16 input channels (fire2-3) took 0.85-0.89 of
# the time at batch 16 and 0.87-0.88 at batch 1, and up to 32 (fire2-5) was faster again: up to 16, 32 and 64
# channels took 48.9, 47.9, 48.7 ms and 46.7, 44.9, 45.7 ms at batch 16, 4.04, 3.81, 3.77 ms at batch 1. The
# outputs are the same bits as the branches' (the zeros add nothing). float32 programs, where XLA's convolution
# takes the merged layer, gained nothing clear (65-72 ms either way): a bfloat16 default only.
# Final code against no merging, alternating blocks: 49.5 -> 42.9 ms at batch 16, 4.65 -> 3.79 ms at batch 1.
MERGE_MAX_CHANNELS = 32


def _convolution_branch(value: str, users, outputs, producer_of) -> tuple[Layer, Layer | None] | None:
    """(layer, ReLU or None) where ``value`` is a one-top layer's top, or that of a ReLU of one, each link read by
    the next alone and no net output; else None. The caller checks that the layer is a 2-D Convolution."""
    relu = producer_of.get(value)
    conv = relu
    if relu is not None and relu.type == "ReLU" and len(relu.bottom_values) == 1:
        conv = producer_of.get(relu.bottom_values[0])
        if conv is None or _only_consumer(relu.bottom_values[0], users, outputs) is not relu:
            return None
    else:
        relu = None
    if conv is None or len(conv.top_values) != 1:
        return None
    return conv, relu


def _centred(conv: ConvShape) -> bool:
    """Odd kernels padded by half their extent: every kernel size then has the same outputs and centre."""
    g = conv.geometry
    return all(k % 2 == 1 and p == d * (k - 1) // 2 for k, p, d in zip(g.kernel, g.pad, g.dilation))


def _merged_filters(convs: Sequence[ConvShape], params: Sequence[ParamArrays]) -> ParamArrays:
    """The branches' O_i x C x kh_i x kw_i filters as one (sum O_i) x C x kh x kw array (the largest kernel),
    each set in the middle, and their biases (zeros for a branch without one) side by side."""
    kh, kw = (max(c.geometry.kernel[axis] for c in convs) for axis in (0, 1))
    total = sum(c.num_output for c in convs)
    weight = aligned_empty((total, convs[0].channels, kh, kw), np.float32)
    weight[...] = 0
    bias = np.zeros(total, np.float32)
    start = 0
    for conv, arrays in zip(convs, params):
        h, w = conv.geometry.kernel
        top, left = (kh - h) // 2, (kw - w) // 2
        weight[start:start + conv.num_output, :, top:top + h, left:left + w] = arrays[0]
        if len(arrays) > 1:
            bias[start:start + conv.num_output] = np.asarray(arrays[1], np.float32).reshape(-1)
        start += conv.num_output
    return [weight, bias]


def merge_concat_convolutions(plan: Plan) -> Plan:
    """A channel Concat of convolutions of one input (directly or through a Split), each alone or through a
    ReLU (the same slope for all), becomes one convolution and one ReLU: kernels odd and centred (Caffe's
    "same" padding) and each within the largest, one stride and dilation, one group, at most
    :data:`MERGE_MAX_CHANNELS` input channels."""
    graph = plan.graph
    users, outputs = readers_by_value(graph.layers), _output_values(graph)
    producer_of = producer_by_value(graph.layers)

    def source(value: str) -> str:  # a Split's tops are its bottom's value
        layer = producer_of.get(value)
        return layer.bottom_values[0] if layer is not None and layer.type == "Split" else value

    params = dict(plan.params)
    value_shapes = dict(graph.value_shapes)
    replaced: dict[str, list[Layer]] = {}  # the concat's name -> the layers computing it now
    removed: set[str] = set()
    for concat in graph.layers:
        p = concat.proto.concat_param
        if (concat.type != "Concat" or len(concat.bottom_values) < 2 or len(_shape(graph, concat.top_values[0])) != 4
                or p.HasField("concat_dim") or canonical_axis(concat.name, p.axis, 4) != 1):
            continue
        branches = [_convolution_branch(v, users, outputs, producer_of) for v in concat.bottom_values]
        if any(b is None or _only_consumer(v, users, outputs) is not concat
               for b, v in zip(branches, concat.bottom_values)):
            continue
        convs = [_conv_shape(conv, graph) for conv, _ in branches]
        if None in convs:
            continue
        relus = [relu for _, relu in branches]
        first = convs[0]
        if (len({source(conv.bottom_values[0]) for conv, _ in branches}) != 1
                or any(c.group != 1 or not _centred(c) or (c.geometry.stride, c.geometry.dilation)
                       != (first.geometry.stride, first.geometry.dilation) for c in convs)
                or first.channels > MERGE_MAX_CHANNELS
                or len({None if r is None else r.proto.relu_param.negative_slope for r in relus}) != 1):
            continue
        largest = max(range(len(convs)), key=lambda i: math.prod(convs[i].geometry.kernel))
        if any(k > biggest for c in convs for k, biggest in zip(c.geometry.kernel, convs[largest].geometry.kernel)):
            continue  # (a 1x5 and a 5x1 kernel: no one of them holds the others)
        base = branches[largest][0]
        proto = caffe_pb2.LayerParameter()
        proto.CopyFrom(base.proto)
        proto.name = "+".join(conv.name for conv, _ in branches)
        proto.convolution_param.num_output = sum(c.num_output for c in convs)
        proto.convolution_param.bias_term = True
        del proto.bottom[:], proto.top[:]
        proto.bottom.extend(branches[0][0].bottoms)
        proto.top.extend(concat.tops)
        arrays = params[proto.name] = _merged_filters(convs, [params[conv.name] for conv, _ in branches])
        slots = [dataclasses.replace(base.params[0], layer=proto.name, index=i, shape=a.shape, name="", owner=None)
                 for i, a in enumerate(arrays)]
        joined = concat.top_values[0]
        made = joined if relus[0] is None else f"{joined}@merged"
        layers = [dataclasses.replace(base, name=proto.name, proto=proto, tops=list(concat.tops), top_values=[made],
                                      bottoms=list(branches[0][0].bottoms), params=slots,
                                      bottom_values=list(branches[0][0].bottom_values))]
        if relus[0] is not None:
            value_shapes[made] = value_shapes[joined]
            relu = relus[0]
            layers.append(dataclasses.replace(relu, bottoms=list(concat.tops), tops=list(concat.tops),
                                              bottom_values=[made], top_values=[joined]))
        replaced[concat.name] = layers
        removed.update(layer.name for branch in branches for layer in branch if layer is not None)
    if not replaced:
        return plan
    layers = []
    for layer in graph.layers:
        if layer.name in replaced:
            layers.extend(replaced[layer.name])
        elif layer.name not in removed:
            layers.append(layer)
    for name in removed:
        params.pop(name, None)
    return dataclasses.replace(plan, graph=dataclasses.replace(graph, layers=layers, value_shapes=value_shapes),
                               params=params)


# ---- channels-last kernels --------------------------------------------------------------------------------

def to_layout(x: jax.Array, have: str, want: str) -> jax.Array:
    """A 4-D value moved between NCHW and NHWC (anything else is returned as is)."""
    if x.ndim != 4 or have == want or want == ANY:
        return x
    return jnp.transpose(x, (0, 2, 3, 1) if want == NHWC else (0, 3, 1, 2))


def _accumulating(x: jax.Array) -> dict[str, Any]:
    """Products in the activations' dtype, summed in float32 (Caffe's float math; bf16 mode's accumulation),
    or in the activations' own dtype where that is wider (a float64 net)."""
    wide = jnp.promote_types(x.dtype, jnp.float32)
    return dict(preferred_element_type=wide, precision=lax.Precision.HIGHEST if wide == x.dtype else None)


def _add_bias(y: jax.Array, params: Sequence[jax.Array], dtype, layout: str = NHWC) -> jax.Array:
    """y (float32 accumulator, 4-D in ``layout``) + bias, rounded to the activations' dtype once."""
    if len(params) > 1:
        bias = params[1].astype(y.dtype)
        y = y + (bias if layout == NHWC else bias.reshape(-1, 1, 1))
    return y.astype(dtype)


@dataclasses.dataclass(frozen=True)
class ConvShape:
    """One NHWC Convolution's static geometry (from Caffe's NCHW shapes in the IR)."""

    geometry: vision.ConvGeometry
    group: int
    channels: int
    num_output: int
    out: tuple[int, ...]
    padding: tuple[tuple[int, int], ...]
    batch: int

    @property
    def is_pointwise(self) -> bool:
        g = self.geometry
        return g.kernel == (1, 1) and g.pad == (0, 0) and self.group == 1


def _conv_shape(layer: Layer, graph: Graph) -> ConvShape | None:
    """The NHWC geometry of a 2-D, single-bottom Convolution with its channels on axis 1; else None."""
    if layer.type != "Convolution" or len(layer.bottom_values) != 1:
        return None
    shape = _shape(graph, layer.bottom_values[0])
    if len(shape) != 4:
        return None
    g = vision.conv_geometry(layer.proto, shape)
    if g.channel_axis != 1:
        return None
    channels, num_output, group = vision.conv_channels(layer.proto, shape, g)
    out = vision.conv_out_shape(layer.proto, g, shape[2:])
    return ConvShape(g, group, channels, num_output, out, tuple(vision.conv_padding(g, out, shape[2:])), shape[0])


def _hwio(params: ParamArrays) -> ParamArrays:
    """Caffe's O x I/g x kh x kw filters as kh x kw x I/g x O (XLA's channels-last filter layout). Array
    methods only, so it serves NumPy weights (inference, prepared once) and traced ones (training)."""
    return [params[0].transpose(2, 3, 1, 0)] + list(params[1:])


def _direct_conv_kernel(conv: ConvShape) -> Kernel:
    g = conv.geometry
    # A strided 1x1 convolution reads every s-th pixel. Taken out first, those pixels go through a 1x1
    # convolution of stride 1, which XLA rewrites into a plain product (as it does ResNet's other 1x1 layers);
    # a strided one it runs as a convolution. Same values, bit for bit. Measured on 2 AVX2 cores, ResNet-50's
    # stride-2 pairs (branch1 + branch2a, one input) alone at batch 16: 56x56x256 80 -> 38 ms, 28x28x512 45 ->
    # 42 ms, 14x14x1024 55 -> 51 ms. Inside the whole forward, where they run beside the branch2 chain, less
    # (program_profile, 3 rounds): the six layers 181-195 -> 169-179 ms at batch 16 (the subsampling copies,
    # fused into the layers before, add about 8 ms), 14.7-21.3 -> 11.6-15.2 ms at batch 1.
    subsample = g.stride if conv.is_pointwise and g.stride != (1, 1) else None
    if subsample:
        g = dataclasses.replace(g, stride=(1, 1))

    def forward(ctx, bottoms, params):
        (x,) = bottoms
        if subsample:
            x = x[:, ::subsample[0], ::subsample[1], :]
        y = vision.grouped_convolution(x, params[0].astype(x.dtype), g, conv.padding, conv.out, conv.group,
                                       channels_last=True, **_accumulating(x))
        return [_add_bias(y, params, x.dtype)]

    return Kernel("conv_nhwc", forward, NHWC, _hwio)


def _matrix(params: ParamArrays) -> ParamArrays:
    """1x1 filters O x C x 1 x 1 as the O x C matrix W of the product pixels @ W^T (contracting both minor
    axes, the layout XLA:CPU's GEMM takes without a copy)."""
    w = params[0]
    return [w.reshape(w.shape[0], w.shape[1])] + list(params[1:])


# The filter gradient of pixels @ W^T is dy^T pixels, a product contracting the leading (pixel) axis of both
# factors. On the CPU that form runs slowly when the product widens its input (more filters than channels:
# ResNet's branch2c and branch1 layers): alone, 50176 pixels 64 -> 256 at 60-100 GFLOP/s, against 150-166 with
# dy first written out as C_out x pixels (both with XLA's dot and with OpenBLAS; 2 AMD EPYC cores). The copy
# costs a pass over dy (6.4 ms there); the product, transpose included, took 29 -> 17 ms, 12544 pixels
# 128 -> 512 19 -> 15 ms. With as many or more channels than filters the plain form was as fast or faster
# (50176 pixels 64 -> 64: 6.5 against 7.5 ms), and so it was from few channels (SqueezeNet's 48400 pixels
# 16 -> 64: 2.2 against 3.2 ms, 11664 pixels 32 -> 128: 1.1 against 1.5 ms) and over fewer pixels, where the
# plain form is already fast (2704 pixels 512 -> 1000, SqueezeNet's conv10: 15.3 against 17.6 ms; 784
# pixels 512 -> 2048 and 1024 -> 2048 even). From 3136 pixels it won throughout ResNet's widening shapes
# (256 -> 1024 15.5 -> 13.1 ms, 512 -> 1024 25.0 -> 21.5 ms). ResNet-50's training step at batch 16, four
# paired runs: 0.977-0.986 of the time (median; minimum 0.93-0.97). The copy is common.transposed_copy (without
# its barriers XLA fused the transpose into dy's producer as a slow transposed write: 59 ms).
WIDENING_MIN_CHANNELS = 64
WIDENING_MIN_PIXELS = 3136


def _pixels_times_filters(pixels: jax.Array, w: jax.Array) -> jax.Array:
    """pixels (P x C) @ W^T for 1x1 filters W (O x C), contracting both minor axes."""
    return lax.dot_general(pixels, w, (((1,), (1,)), ((), ())), **_accumulating(pixels))


def _widening_product_bwd(residuals, dy):
    pixels, w = residuals
    dy_by_filter = transposed_copy(dy)
    return matmul(dy, w).astype(pixels.dtype), matmul(dy_by_filter, pixels).astype(w.dtype)


_widening_product = jax.custom_vjp(_pixels_times_filters)
_widening_product.defvjp(lambda pixels, w: (_pixels_times_filters(pixels, w), (pixels, w)), _widening_product_bwd)


def _filter_gradient_by_filter_rows(conv: ConvShape, dtype) -> bool:
    """Whether a 1x1 product's filter gradient reads dy as C_out x pixels (see above): float32 on the CPU,
    more filters than channels, at least :data:`WIDENING_MIN_CHANNELS` channels and
    :data:`WIDENING_MIN_PIXELS` pixels."""
    return (WIDENING_MIN_CHANNELS <= conv.channels < conv.num_output
            and conv.batch * math.prod(conv.out) >= WIDENING_MIN_PIXELS
            and dtype == jnp.float32 and jax.default_backend() == "cpu")


def _pointwise_conv_kernel(conv: ConvShape, rounded: bool = True) -> Kernel:
    stride = conv.geometry.stride

    def forward(ctx, bottoms, params):
        (x,) = bottoms
        if stride != (1, 1):
            x = x[:, ::stride[0], ::stride[1], :]
        pixels = x.reshape(-1, x.shape[-1])
        product = _widening_product if _filter_gradient_by_filter_rows(conv, x.dtype) else _pixels_times_filters
        y = product(pixels, params[0].astype(x.dtype))
        return [_add_bias(y, params, x.dtype if rounded else y.dtype).reshape(x.shape[:3] + (conv.num_output,))]

    return Kernel("conv_1x1_gemm", forward, NHWC, _matrix)


# Winograd F(2x2, 3x3) (Lavin & Gray 2016): Y = A^T [(G g G^T) . (B^T d B)] A per 4x4 input tile d.
_WINOGRAD_BT = np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], np.float64)
_WINOGRAD_G = np.array([[1, 0, 0], [.5, .5, .5], [.5, -.5, .5], [0, 0, 1]], np.float64)
_WINOGRAD_AT = np.array([[1, 1, 1, 0], [0, 1, -1, -1]], np.float64)


def _winograd_filters(params: ParamArrays) -> ParamArrays:
    """3x3 filters O x C x 3 x 3 as U = G g G^T: 16 matrices C x O, one per point of the 4x4 tile. NumPy
    filters (compile_inference's, prepared once) give a NumPy result the device can adopt; traced ones (a Net's
    forward, BatchNorm folded into them first: layout_kernels) a traced one."""
    w = params[0]
    o, c = w.shape[:2]
    # (G g G^T)[a, b] = sum_kl G[a, k] G[b, l] g[k, l]: one float32 product of kron(G, G) (16 x 9, entries
    # 0, +-1/4, +-1/2, 1: exact) with the 9 taps of every filter, 16 x (O*C).
    # The taps go to (C, O) order first: moving 9-tap rows is cheap, transposing the 16 results is not.
    gg = np.kron(_WINOGRAD_G, _WINOGRAD_G).astype(np.float32)
    if isinstance(w, np.ndarray):
        taps = np.ascontiguousarray(np.asarray(w, np.float32).reshape(o, c, 9).transpose(1, 0, 2)).reshape(c * o, 9)
        u = np.matmul(gg, taps.T, out=aligned_empty((16, c * o), np.float32))
    else:
        taps = w.astype(jnp.promote_types(w.dtype, jnp.float32)).reshape(o, c, 9).transpose(1, 0, 2)
        u = jnp.matmul(gg, taps.reshape(c * o, 9).T, precision=lax.Precision.HIGHEST)
    return [u.reshape(16, c, o)] + list(params[1:])


def _combine(terms: Sequence[jax.Array], coefficients: np.ndarray) -> jax.Array:
    """sum_k c_k terms_k over the non-zero c_k (all of B^T, A^T's entries are 0, 1/2 or +-1)."""
    total = None
    for term, c in zip(terms, coefficients):
        if c == 0:
            continue
        term = term if c == 1 else (-term if c == -1 else c * term)
        total = term if total is None else total + term
    return total


def _winograd_tiles(conv: ConvShape) -> tuple[int, int]:
    """The 2x2 output tiles along the height and the width of one image (the last ones cropped)."""
    return -(-conv.out[0] // 2), -(-conv.out[1] // 2)


def _winograd_conv_kernel(conv: ConvShape, rounded: bool = True) -> Kernel:
    (pad_h, _), (pad_w, _) = conv.padding
    oh, ow = conv.out
    th, tw = _winograd_tiles(conv)

    def forward(ctx, bottoms, params):
        (x,) = bottoms
        n, h, w, c = x.shape
        # Enough padding that every 4x4 tile (stride 2) lies inside; cells past Caffe's output are cropped.
        xpad = vision._pad(x, 1, [(pad_h, 2 * th + 2 - h - pad_h), (pad_w, 2 * tw + 2 - w - pad_w)], 0)
        d = [[xpad[:, i:i + 2 * th:2, j:j + 2 * tw:2, :] for j in range(4)] for i in range(4)]
        rows = [[_combine([d[i][j] for i in range(4)], _WINOGRAD_BT[a]) for j in range(4)] for a in range(4)]
        v = jnp.stack([_combine(rows[a], _WINOGRAD_BT[b]) for a in range(4) for b in range(4)])
        m = lax.dot_general(v.reshape(16, n * th * tw, c), params[0].astype(x.dtype),
                            (((2,), (1,)), ((0,), (0,))), **_accumulating(x))
        m = m.reshape(4, 4, n, th, tw, conv.num_output)
        cols = [[_combine([m[a, b] for b in range(4)], _WINOGRAD_AT[s]) for s in range(2)] for a in range(4)]
        y = jnp.stack([jnp.stack([_combine([cols[a][s] for a in range(4)], _WINOGRAD_AT[r]) for s in range(2)],
                                 axis=3) for r in range(2)], axis=2)  # n, th, 2, tw, 2, O
        y = y.reshape(n, 2 * th, 2 * tw, conv.num_output)[:, :oh, :ow, :]
        return [_add_bias(y, params, x.dtype if rounded else y.dtype)]

    return Kernel("conv_winograd_f2x2_3x3", forward, NHWC, _winograd_filters)


def _pooling_kernel(layer: Layer, graph: Graph, differentiated_top_by_window: bool = False) -> Kernel | None:
    """MAX and AVE pooling, channels-last. ``differentiated_top_by_window`` (MAX only): a differentiated
    program takes the top from reduce_window (:func:`caffejax.lower.vision.max_pool`)."""
    shape = _shape(graph, layer.bottom_values[0])
    if len(shape) != 4 or len(layer.top_values) != 1:
        return None
    g = vision.pooling_geometry(layer.proto, shape)
    if g.method not in (vision.POOL_MAX, vision.POOL_AVE):
        return None

    def forward(ctx, bottoms, params):
        (x,) = bottoms
        if g.method == vision.POOL_MAX:
            return [vision.max_pool(x, g, first_axis=1,
                                    differentiated_top_by_window=differentiated_top_by_window)[0]]
        return [vision.ave_pool(x, g, first_axis=1)]

    return Kernel("pool_nhwc_window_top" if differentiated_top_by_window else "pool_nhwc", forward, NHWC)


def _per_channel_kernel(rule_forward: ForwardFn) -> Kernel:
    """A layer acting per channel of axis 1 (BatchNorm, per-channel Scale/Bias, PReLU) run on NHWC data as
    Caffe's rule on the (N*H*W, C) view, whose axis 1 is the channel axis."""

    def forward(ctx, bottoms, params):
        (x,) = bottoms
        (y,) = rule_forward(ctx, [x.reshape(-1, x.shape[-1])], params)
        return [y.reshape(x.shape)]

    return Kernel("per_channel_nhwc", forward, NHWC)


def _is_per_channel(layer: Layer, graph: Graph, params: ParamArrays) -> bool:
    if len(layer.bottom_values) != 1 or len(_shape(graph, layer.bottom_values[0])) != 4:
        return False
    if layer.type in ("BatchNorm", "PReLU"):
        return True
    if layer.type in ("Scale", "Bias"):
        p = layer.proto.scale_param if layer.type == "Scale" else layer.proto.bias_param
        channels = _shape(graph, layer.bottom_values[0])[1]
        # The (N*H*W, C) view has 2 axes, so only a blob given by axis 1 keeps its meaning there.
        return p.axis == 1 and all(np.shape(a) == (channels,) for a in params)
    return False


def _concat_kernel(layer: Layer, graph: Graph, readers: Sequence[Layer]) -> Kernel | None:
    """Concat along channels (the last axis channels-last). 16-bit values move as 32-bit pairs
    (:func:`paired_concatenate`) unless a pooling reads the join (``readers``), which XLA then fuses into its
    windows."""
    p = layer.proto.concat_param
    shape = _shape(graph, layer.bottom_values[0])
    if len(shape) != 4 or p.HasField("concat_dim") or canonical_axis(layer.name, p.axis, 4) != 1:
        return None
    join = jnp.concatenate if any(reader.type == "Pooling" for reader in readers) else paired_concatenate
    return Kernel("concat_nhwc", lambda ctx, bottoms, params: [join(bottoms, axis=3)], NHWC)


def _lrn_kernel(layer: Layer, graph: Graph) -> Kernel | None:
    p = layer.proto.lrn_param
    if p.norm_region != vision.LRN_ACROSS_CHANNELS or len(_shape(graph, layer.bottom_values[0])) != 4:
        return None
    return Kernel("lrn_nhwc", lambda ctx, bottoms, params: [vision.lrn_across_channels(bottoms[0], p, 3)], NHWC)


# Layers that act element by element (or pass values through): they run in whatever layout they are fed.
ELEMENTWISE_TYPES = frozenset({"ReLU", "Sigmoid", "TanH", "AbsVal", "BNLL", "ELU", "Exp", "Log", "Power", "Clip",
                               "Swish", "Threshold", "Dropout", "Eltwise", "Split", "Silence"})


def resolve_layout(kernel: Kernel | None, bottom_layouts: Sequence[str | None]) -> str:
    """The layout a layer runs in: its kernel's, or for ANY, its 4-D bottoms' common one (else NCHW)."""
    if kernel is None:
        return NCHW
    if kernel.layout != ANY:
        return kernel.layout
    seen = {layout for layout in bottom_layouts if layout is not None}
    return seen.pop() if len(seen) == 1 else NCHW


def nhwc(plan: Plan) -> Plan:
    """Channels-last kernels for every layer that has one; element-wise layers follow their bottoms."""
    graph = plan.graph
    kernels = dict(plan.kernels)
    readers = readers_by_value(graph.layers)
    for layer in graph.layers:
        kernel = None if layer.is_input else kernels.get(layer.name) or _nhwc_kernel(layer, plan, readers)
        if kernel is not None:
            kernels[layer.name] = kernel
    return dataclasses.replace(plan, kernels=kernels)


def _nhwc_kernel(layer: Layer, plan: Plan, readers: Mapping[str, Sequence[Layer]]) -> Kernel | None:
    graph = plan.graph
    if layer.type in ELEMENTWISE_TYPES:
        return Kernel("elementwise", get_rule(layer.type).forward, ANY)
    if not layer.bottom_values or graph.value_shapes.get(layer.bottom_values[0]) is None:
        return None
    if layer.type == "Convolution":
        conv = _conv_shape(layer, graph)
        return None if conv is None else _direct_conv_kernel(conv)
    if layer.type == "Pooling":
        return _pooling_kernel(layer, graph)
    if layer.type == "Concat":
        return _concat_kernel(layer, graph, readers.get(layer.top_values[0], []))
    if layer.type == "LRN":
        return _lrn_kernel(layer, graph)
    if _is_per_channel(layer, graph, plan.params.get(layer.name, [])):
        return _per_channel_kernel(get_rule(layer.type).forward)
    return None


# ---- convolution kernel choices (on top of nhwc) ----------------------------------------------------------

def _replace_conv_kernels(plan: Plan, choose: Callable[[ConvShape], Kernel | None]) -> Plan:
    """Swap the direct NHWC kernel of each Convolution for ``choose(shape)`` where that gives one."""
    kernels = dict(plan.kernels)
    for layer in plan.graph.layers:
        kernel = kernels.get(layer.name)
        if kernel is None or kernel.name != "conv_nhwc":
            continue
        better = choose(_conv_shape(layer, plan.graph))
        if better is not None:
            kernels[layer.name] = better
    return dataclasses.replace(plan, kernels=kernels)


def conv_gemm(plan: Plan) -> Plan:
    """1x1 convolutions (any stride, no pad, one group) as pixels (N*H*W x C) @ W (C x O)."""
    return _replace_conv_kernels(plan, lambda conv: _pointwise_conv_kernel(conv) if conv.is_pointwise else None)


# A convolution over one input channel (a first layer on a gray image) with at most this many kernel terms,
# and at least this many outputs, runs as shifted multiply-adds (vision.few_channel_convolution). Measured in
# whole programs on 2 AVX2 cores, two series of alternating processes: LeNet's forward at batch 16 (conv1,
# 1 x 5x5 -> 16x24x24x20) 1.28-1.69 -> 1.13-1.39 ms (minimum 1.18-1.21 -> 0.97-1.04). Slower at batch 1
# (11520 outputs; minimum 0.158 -> 0.185 ms) and for SqueezeNet v1.1's 3-channel conv1 (batch 16: 112 ->
# 122-136 ms); MobileNet v2's 3-channel conv1 within noise.
# Over up to TAPS_MAX_CHANNELS channels (a colour image) with at most TAPS_MAX_FILTERS filters, too: XLA's
# convolution ran MTCNN's det1 conv1 (3 x 3x3 -> 10) at about 8 GFLOP/s. compile_inference, alternating
# blocks, 2 AMD EPYC (Zen 3) cores, taps over XLA's convolution: det1 at 480x640 0.70 of the time (25.0 ->
# 17.5 ms; OpenCV 4.14 23.0 ms), at 240x320 0.59, at 120x160 0.69; a 3 x 3x3 -> N conv, ReLU, 2x2 pool, 3x3 ->
# 16 conv at 240x320: N = 8 0.46, 16 0.71, 24 1.00; at 16x48x48 N = 8 0.57, 16 0.84. With 28-32 filters on
# small images they lost: det2 (32x24x24, 28 filters) 1.24, det3 (16x48x48, 32 filters) 1.10.
# Those take the taps from TAPS_FEW_CHANNELS_MIN_OUTPUTS outputs: on small images XLA's convolution over 3
# channels ran at 3-5 GFLOP/s (det1's conv1 at 1x3x49x37, 160-250 us; LeNet's one-channel conv1 at batch 1,
# which keeps TAPS_MIN_OUTPUTS, is a YNNPACK convolution in its program).
# det1's pyramid scales below 65536 outputs, compile_inference, alternating blocks, 2 AMD EPYC (Zen 3) cores,
# taps over XLA's convolution: 52x69 (33500 outputs) 0.73, 37x49 (16450) 0.79, 30x40 (10640) 0.83, 26x35
# (7920) 0.83-0.91, 24x31 (6380) 1.06-1.46, 22x29 (5400) 1.08-1.48; a forward and backward (a PReLU and a
# 3x3 max pool after it, XLA's options for training): 1x3x49x37 0.64, 1x3x35x26 0.68, 16x3x12x12 (16000) 0.92,
# 48x3x12x12 1.00, 64x3x12x12 1.08.
TAPS_MAX_TERMS = 32
TAPS_MIN_OUTPUTS = 1 << 16
TAPS_FEW_CHANNELS_MIN_OUTPUTS = 1 << 13
TAPS_MAX_CHANNELS = 3
TAPS_MAX_FILTERS = 16


def _taps_applies(conv: ConvShape) -> bool:
    outputs = conv.batch * math.prod(conv.out) * conv.num_output
    if conv.channels == 1:
        enough = outputs >= TAPS_MIN_OUTPUTS
    else:
        enough = (conv.channels <= TAPS_MAX_CHANNELS and conv.num_output <= TAPS_MAX_FILTERS
                  and outputs >= TAPS_FEW_CHANNELS_MIN_OUTPUTS)
    return conv.group == 1 and enough and math.prod(conv.geometry.kernel) * conv.channels <= TAPS_MAX_TERMS


def _taps_conv_kernel(conv: ConvShape, rounded: bool = True) -> Kernel:
    g = conv.geometry

    # Channels first (the fed input's layout): see vision.few_channel_convolution for why.
    def forward(ctx, bottoms, params):
        (x,) = bottoms
        y = vision.few_channel_convolution(x, params[0].astype(x.dtype), g, conv.padding, conv.out,
                                           tuple(sorted(_accumulating(x).items())))
        return [_add_bias(y, params, x.dtype if rounded else y.dtype, NCHW)]

    return Kernel("conv_taps", forward, NCHW)


def conv_taps(plan: Plan) -> Plan:
    """Big convolutions over one input channel (a first layer on a gray image), or over a few with few filters
    (MTCNN's det1 on a colour image), as shifted multiply-adds."""
    return _replace_conv_kernels(plan, lambda conv: _taps_conv_kernel(conv) if _taps_applies(conv) else None)


# Winograd pays a transform per tile and 16 skinny products; measured on 2 AVX2 cores it beats XLA's direct
# NHWC convolution for 3x3 layers on images up to 14x14 (ResNet stages 4-5, the tail of GoogLeNet) and loses
# on bigger ones, where the direct convolution is already near its best.
WINOGRAD_MAX_SIZE = 14
# Each of the 16 products has one row per 2x2 output tile of the batch. With fewer rows than this they cost
# more than they save: at batch 1 (16-49 tiles) whole forwards were slower with Winograd (paired A/B, 10-12
# rounds: ResNet-50 +5% to +19%, GoogLeNet +12%) and compiled 1.5-3.5 s longer; from batch 2 (ResNet-50's
# 14x14 layers: 98 tiles) they were faster (-3% to -8%).
WINOGRAD_MIN_TILES = 64


# With bfloat16 values on a CPU with bfloat16 matrix instructions, Winograd's 16 products run on those and it
# wins on bigger images too (2 Sapphire Rapids cores, 3x3 at batch 16, Winograd against XLA's convolution):
# 14x14x256 -> 256 8.9 against 17.8 ms, 28x28x128 -> 192 18.0 against 26.8 ms, 56x56x64 -> 64 41 against 26 ms.
# In float32 there, 28x28 was even (23.5 against 24.4 ms). See :func:`winograd_medium`.
WINOGRAD_MEDIUM_MAX_SIZE = 28


def _winograd_applies(conv: ConvShape, max_size: int = WINOGRAD_MAX_SIZE) -> bool:
    g = conv.geometry
    tiles = conv.batch * math.prod(_winograd_tiles(conv))
    return (g.kernel == (3, 3) and g.stride == (1, 1) and g.dilation == (1, 1) and conv.group == 1
            and max(conv.out) <= max_size and tiles >= WINOGRAD_MIN_TILES)


def winograd(plan: Plan) -> Plan:
    """3x3 stride-1 convolutions on small images, over enough tiles, as Winograd F(2x2, 3x3): 2.25x fewer
    multiplications."""
    return _replace_conv_kernels(plan, lambda conv: _winograd_conv_kernel(conv) if _winograd_applies(conv) else None)


def winograd_medium(plan: Plan) -> Plan:
    """``winograd`` on images up to :data:`WINOGRAD_MEDIUM_MAX_SIZE` as well (a bfloat16 default where the CPU
    multiplies bfloat16 matrices)."""
    return _replace_conv_kernels(plan, lambda conv: (_winograd_conv_kernel(conv)
                                                     if _winograd_applies(conv, WINOGRAD_MEDIUM_MAX_SIZE) else None))


# With bfloat16 values on a CPU with bfloat16 matrix instructions, a convolution as Caffe computes it (im2col:
# each output pixel's window as one row, then one product with the filters) runs its product on those
# instructions: a 16x27x27x48 window matrix (11664 x 1200) times 1200 x 128 took 2.6 ms (1.4 TFLOP/s), where
# XLA's float32 convolution took 9.2 ms (2 Sapphire Rapids cores). Writing and reading the window matrix costs
# a pass over k*k copies of the input, which the product repays when each row meets enough filters. Alone, at
# batch 16, against the widened convolution: 3x3 56x56x64 -> 64 8.1 against 11.5 ms, SqueezeNet's fire2
# expand3x3 (55x55x16 -> 64) 2.5 against 3.4, LeNet's conv2 (12x12x20 -> 50, 5x5) 0.58 against 0.73,
# 14x14x16 -> 48 (5x5) even; slower with 32 filters (28x28x16 -> 32, 5x5: 2.2 against 1.5 ms) and with a
# window matrix of 116M values (112x112x64 -> 64: 59 against 50 ms).
IM2COL_MIN_FILTERS = 48
IM2COL_MAX_WINDOW_VALUES = 1 << 26


# It runs before the ``winograd`` passes and takes the layers it applies to: against bfloat16 Winograd alone
# at batch 16, im2col was faster up to 320 input channels (27x27x32 -> 128 1.5 against 3.2 ms, 14x14x256 ->
# 256 4.4 against 5.0) and even at 512 (7x7x512 -> 512 3.9 against 3.8); ResNet-50's whole forward took 0.975
# of the time with its 3x3 layers this way, and its output moved closer to float32's (largest difference
# 0.024 against 0.027 of the largest output).
def _im2col_applies(conv: ConvShape) -> bool:
    """Enough filters per group, an even number of channels per group (moved in pairs) and a window matrix
    of at most :data:`IM2COL_MAX_WINDOW_VALUES`."""
    per_group = conv.channels // conv.group
    windows = conv.batch * math.prod(conv.out) * per_group * math.prod(conv.geometry.kernel)
    return (not conv.is_pointwise and conv.group < conv.channels and per_group % 2 == 0
            and conv.num_output // conv.group >= IM2COL_MIN_FILTERS and windows <= IM2COL_MAX_WINDOW_VALUES)


def _grouped_matrices(group: int, params: ParamArrays) -> ParamArrays:
    """Caffe's O x C/g x kh x kw filters as g matrices (kh*kw*C/g) x O/g, rows in the order of
    :func:`window_rows`' columns (kernel offset major, channel minor). Array methods only."""
    w = params[0]
    o, cg, kh, kw = w.shape
    w = w.reshape(group, o // group, cg, kh, kw).transpose(0, 3, 4, 2, 1)
    return [w.reshape(group, kh * kw * cg, o // group)] + list(params[1:])


def paired_concatenate(arrays: Sequence[jax.Array], axis: int) -> jax.Array:
    """jnp.concatenate, moving 16-bit values (bfloat16) as 32-bit pairs of neighbours along the last axis where
    every array's last axis has an even size: the same values, and the plain concatenation's derivative.
    XLA:CPU gathers 16-bit elements slowly (:func:`window_rows`). Alone, joining two 16x55x55x64 bfloat16 ReLU
    outputs took 1.7 ms paired against 5.2. A Concat layer read by a pooling stays jnp.concatenate, which XLA
    fuses into the pooling's windows: with every Concat paired, whole bfloat16 forwards at batch 16 took 0.944-0.979
    (SqueezeNet v1.1) and 1.033 (GoogLeNet) of the time; paired only where no pooling reads the join, 0.936-0.941
    and 0.967-0.977, at batch 1 0.890 and 0.989 (the outputs the same bits; alternating blocks, 2 AMX Xeon
    cores). An earlier build had measured every Concat paired at 1.05 and 1.02."""
    arrays = tuple(arrays)
    dtype = arrays[0].dtype
    if (dtype.itemsize != 2 or arrays[0].ndim == 0 or any(a.dtype != dtype for a in arrays)
            or any(a.shape[-1] % 2 for a in arrays)):
        return jnp.concatenate(arrays, axis)
    return _paired_concatenate(arrays, axis % arrays[0].ndim)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _paired_concatenate(arrays: tuple[jax.Array, ...], axis: int) -> jax.Array:
    if any(is_symbolic(d) for d in arrays[0].shape):
        return _unpack_pairs(jnp.concatenate([_packed_pairs(a) for a in arrays], axis), arrays[0].dtype)
    pairs = [lax.bitcast_convert_type(a.reshape(a.shape[:-1] + (a.shape[-1] // 2, 2)), jnp.uint32) for a in arrays]
    joined = lax.bitcast_convert_type(jnp.concatenate(pairs, axis), arrays[0].dtype)
    return joined.reshape(joined.shape[:-2] + (-1,))


# A symbolic batch (an export's) cannot take the bitcast of 16-bit pairs to 32 bits: a bitcast that changes the
# rank of a dynamic shape does not refine (jax.export's call and caffejax's loader raise "Error refining shapes").
# There the pairs are packed and unpacked with integer operations on same-width views: the same bits, the join
# still moving 32-bit values, but the unpacking a pass of its own over the joined array where the bitcast is free.
# bf16 exports with a symbolic batch at batch 16, against compile_inference(dtype=bfloat16) (2 AMD EPYC cores,
# one process, alternating): plain joins -> packed pairs, SqueezeNet v1.1 1.40 -> 1.08, GoogLeNet 1.28 -> 1.12,
# ResNet-50 1.24 -> 1.10, AlexNet 1.29 -> 1.21, LeNet 1.22 -> 1.06; the bitcast (a fixed batch) 0.94-1.01.
def _packed_pairs(a: jax.Array) -> jax.Array:
    """A 16-bit array's neighbours along the last axis as one uint32 each, the first in the low half."""
    halves = lax.bitcast_convert_type(a, jnp.uint16).reshape(a.shape[:-1] + (a.shape[-1] // 2, 2))
    halves = halves.astype(jnp.uint32)
    return halves[..., 0] | (halves[..., 1] << 16)


def _unpack_pairs(pairs: jax.Array, dtype) -> jax.Array:
    """:func:`_packed_pairs`'s inverse: a uint32 array as the 16-bit ``dtype`` values of its halves."""
    halves = jnp.stack([pairs.astype(jnp.uint16), (pairs >> 16).astype(jnp.uint16)], axis=-1)
    return lax.bitcast_convert_type(halves.reshape(halves.shape[:-2] + (-1,)), dtype)


@_paired_concatenate.defjvp
def _paired_concatenate_jvp(axis, primals, tangents):
    (arrays,), (dots,) = primals, tangents
    return _paired_concatenate(arrays, axis), jnp.concatenate(dots, axis)


def window_rows(x: jax.Array, g: vision.ConvGeometry, padding, out: tuple[int, ...]) -> jax.Array:
    """Caffe's im2col for a channels-last 2-D x (N, H, W, C): one row per output pixel (N*OH*OW rows), its
    kernel offsets' channels side by side (offset major, channel minor)."""
    # bfloat16 channels move in pairs (:func:`paired_concatenate`): a 16x27x27x48 input's 5x5 windows took
    # 3.6 ms so, 7.9 ms one by one, 4.6 ms in float32; whole bfloat16 forwards at batch 16 took 0.71 (GoogLeNet)
    # and 0.65 (AlexNet) of the time they took with unpaired windows.
    taps = vision.convolution_taps(x, 1, g, padding, out)
    return paired_concatenate(taps, axis=-1).reshape(-1, math.prod(g.kernel) * x.shape[-1])


# XLA:CPU builds a bfloat16 window matrix from k*k tap arrays it writes out one by one, and a concatenation that
# reads them back: two passes over k*k copies of the input. The taps of one kernel row it concatenates in one
# pass. So where a kernel row's columns (kw x C/g values) are enough, and the rows (N*OH*OW) too, the product
# is summed over kernel rows instead: kh products of kw*C/g columns, added in float32. Alone, in bfloat16 at
# batch 16 (2 Sapphire Rapids cores), whole matrix -> by kernel rows: AlexNet's conv2 per group (27x27x48 ->
# 128, 5x5) 7.8 -> 5.0 ms, 28x28x128 -> 128 (3x3) 8.2 -> 5.1 ms, 56x56x64 -> 64 13.8 -> 10.5 ms, 7x7x512 -> 512
# 4.8 -> 4.4 ms, 27x27x48 -> 128 (5x5) at batch 1 0.89 -> 0.73 ms. Shorter kernel rows were slower: LeNet's
# conv2 (5 x 20) 0.43 -> 0.63 ms, SqueezeNet's 55x55x16 -> 64 (3 x 16) 4.0 -> 5.7 ms, 14x14x24 -> 64 (5 x 24) 1.4
# -> 2.0 ms, 14x14x32 -> 64 (5 x 32) 0.88 -> 0.93 ms; so were few rows: 13x13x256 -> 384 at batch 1 (169 rows)
# 0.56 -> 0.78 ms. Whole bfloat16 forwards at batch 16 (paired A/B), with every im2col layer so: AlexNet 0.87,
# ResNet-50 0.88, GoogLeNet 0.93, SqueezeNet 1.05, LeNet 1.35 of the time; with this rule: AlexNet 0.88,
# ResNet-50 0.91, GoogLeNet, SqueezeNet and LeNet even (GoogLeNet's 28x28x32 -> 96 5x5 layer, 5 x 32, alone
# 5.1 -> 3.2 ms, is left out with the 14x14 ones of its kind, which were even or slower).
IM2COL_ROW_MIN_COLUMNS = 192
IM2COL_ROW_MIN_ROWS = 512


def _im2col_by_kernel_rows(conv: ConvShape) -> bool:
    """Whether the im2col product is summed over kernel rows (see IM2COL_ROW_MIN_COLUMNS)."""
    kh, kw = conv.geometry.kernel
    return (kh > 1 and kw * (conv.channels // conv.group) >= IM2COL_ROW_MIN_COLUMNS
            and conv.batch * math.prod(conv.out) >= IM2COL_ROW_MIN_ROWS)


def _windows_times_filters(x: jax.Array, w: jax.Array, conv: ConvShape, by_kernel_rows: bool) -> jax.Array:
    """window_rows(x) . w (one group: x's channels are that group's), summed in float32; with
    ``by_kernel_rows``, as the sum over kernel rows of their columns times their rows of w."""
    g = conv.geometry
    if not by_kernel_rows:
        return lax.dot_general(window_rows(x, g, conv.padding, conv.out), w, (((1,), (0,)), ((), ())),
                               **_accumulating(x))
    taps = vision.convolution_taps(x, 1, g, conv.padding, conv.out)
    kw = g.kernel[1]
    width = kw * x.shape[-1]
    y = None
    for r in range(g.kernel[0]):
        columns = paired_concatenate(taps[r * kw:(r + 1) * kw], axis=-1).reshape(-1, width)
        term = lax.dot_general(columns, w[r * width:(r + 1) * width], (((1,), (0,)), ((), ())), **_accumulating(x))
        y = term if y is None else y + term
    return y


def _im2col_conv_kernel(conv: ConvShape, rounded: bool = True) -> Kernel:
    cg = conv.channels // conv.group
    by_kernel_rows = _im2col_by_kernel_rows(conv)

    def forward(ctx, bottoms, params):
        (x,) = bottoms
        w = params[0].astype(x.dtype)
        ys = [_windows_times_filters(x[..., k * cg:(k + 1) * cg], w[k], conv, by_kernel_rows)
              for k in range(conv.group)]
        y = ys[0] if conv.group == 1 else jnp.concatenate(ys, axis=-1)
        y = _add_bias(y, params, x.dtype if rounded else y.dtype)
        return [y.reshape((x.shape[0],) + conv.out + (conv.num_output,))]

    return Kernel("conv_im2col", forward, NHWC, functools.partial(_grouped_matrices, conv.group))


def conv_im2col(plan: Plan) -> Plan:
    """Direct convolutions with many filters per group as Caffe's im2col and one product per group (a
    bfloat16 default where the CPU multiplies bfloat16 matrices)."""
    return _replace_conv_kernels(plan, lambda conv: _im2col_conv_kernel(conv) if _im2col_applies(conv) else None)


# ---- layout kernels for Caffe's own programs (Net.forward, training) ----------------------------------------

def layout_kernels(graph: Graph, differentiated: bool = True) -> dict[str, Kernel]:
    """The layout kernels (``nhwc``, ``conv_gemm``, ``conv_taps``) for running a net's own program: the
    same values as Caffe's rules up to float rounding, with traced weights, so forward, backward and training
    use them; Convolution -> BatchNorm [-> Scale] chains get their folded form as well (:func:`batch_norm_chains`).

    Nothing is folded for good and every blob keeps its meaning; layers drawing random numbers (Dropout) keep
    Caffe's layout, so their masks are the ones the NCHW program draws.

    ``differentiated=False``: the kernels for programs without a backward, as ``compile_inference`` picks them
    (see :data:`DEFAULT_PASSES`): 1x1 convolutions left to ``nhwc``'s kernel (no ``conv_gemm``), small 3x3 ones
    as Winograd (``winograd``; in training XLA's convolution is the faster).
    """
    shapes = {layer.name: [jax.ShapeDtypeStruct(slot.shape, jnp.float32) for slot in layer.params]
              for layer in graph.layers}
    plan = nhwc(Plan(graph, shapes, {}))
    plan = conv_taps(conv_gemm(plan)) if differentiated else winograd(conv_taps(plan))
    random = {layer.name for layer in graph.layers if layer.type == "Dropout"}
    kernels = {name: kernel for name, kernel in plan.kernels.items() if name not in random}
    return batch_norm_chains(graph, max_pools_into_split_groups(graph, kernels))


def max_pools_into_split_groups(graph: Graph, kernels: Mapping[str, Kernel]) -> dict[str, Kernel]:
    """``kernels`` with each channels-last MAX pooling whose top a convolution split into groups reads
    (:func:`caffejax.lower.vision.runs_group_by_group`, AlexNet's pool1 -> conv2) taking its differentiated
    top from reduce_window: see :func:`caffejax.lower.vision._row_major_scan_fwd` for why, and why only these."""
    users = readers_by_value(graph.layers)
    out = dict(kernels)
    for layer in graph.layers:
        kernel = kernels.get(layer.name)
        if (kernel is None or kernel.name != "pool_nhwc" or layer.proto.pooling_param.pool != vision.POOL_MAX):
            continue
        readers = [_conv_shape(reader, graph) for reader in users.get(layer.top_values[0], [])
                   if reader.name in kernels and kernels[reader.name].name == "conv_nhwc"]
        if any(conv is not None and vision.runs_group_by_group(conv.group, conv.channels, conv.geometry.kernel)
               for conv in readers):
            out[layer.name] = _pooling_kernel(layer, graph, differentiated_top_by_window=True)
    return out


# Differentiated, a chain adds passes over the filters (the fold, the filter gradient's factor, the gradient's
# per-filter sum d a) and saves passes over the convolution's output. It is run in backward passes where the
# output has at least this many values per filter value (batch x output pixels >= C/g x kh x kw). Measured on
# ResNet-50's training step (paired A/B against no chains, 2 AVX2 cores): every chain at batch 1 1.046 of the
# time, at batch 16 0.953; with this rule 0.980 and 0.956.
CHAIN_BACKWARD_MIN_RATIO = 1.0


def _conv_batch_norm_chain(head: Kernel, conv: Layer, bn: Layer, scale: Layer | None, visible: bool,
                           differentiated: bool) -> Chain:
    """Convolution -> BatchNorm (global statistics) [-> per-channel Scale] as the convolution with the chain's
    per-channel map a y + c folded into its arrays in the program: W' = a W, b' = a b + c.

    Its derivative is the point: the convolution's input and filter gradients take the top diff dz itself,
    where the layers one by one write dy = a dz out and read it twice, and the Scale's gradient comes from the
    filter gradient (d gamma = inv_std (sum W o dW' + (b - mean) sum dz)) instead of a pass over dz and the
    BatchNorm's output."""
    n_conv, eps = len(conv.params), bn.proto.batch_norm_param.eps

    def prepare(params):
        weight = params[0]
        wide = jnp.promote_types(weight.dtype, jnp.float32)
        mean, a = batch_norm_global_stats(params[n_conv: n_conv + 3], eps, wide)
        c = -mean * a
        if scale is not None:
            s = params[n_conv + 3].astype(wide)
            a, c = a * s, c * s
            if len(params) > n_conv + 4:
                c = c + params[n_conv + 4].astype(wide)
        if n_conv > 1:
            c = c + a * params[1].astype(wide)
        # Folded in a 2-D view: the gradient's sum over each filter (d a) is then a row sum of two matrices. On
        # the 4-D O x C x 1 x 1 filters XLA:CPU reduced over the trailing axes at 0.3-0.8 GB/s (ResNet-50's
        # res5a_branch1: 21 ms, against under 1 ms for the 2-D sum).
        rows = weight.reshape(weight.shape[0], -1).astype(wide)
        folded = (rows * a[:, None]).astype(weight.dtype).reshape(weight.shape)
        return head.prepare([folded, c])

    return Chain("conv_batch_norm_scale" if scale is not None else "conv_batch_norm",
                 (bn.name,) + ((scale.name,) if scale is not None else ()), prepare, visible, differentiated)


def batch_norm_chains(graph: Graph, kernels: Mapping[str, Kernel]) -> dict[str, Kernel]:
    """``kernels`` with a chain on each Convolution with a kernel (channels-last, or ``conv_taps``) that a
    BatchNorm with global statistics follows (and a per-channel Scale after that), where each value in between
    is read by the next link alone and is no net output. A chain is ``visible`` where such a value is also a
    blob's final value (written to a new blob); the in-place chains ResNet writes are not."""
    users, outputs = readers_by_value(graph.layers), _output_values(graph)
    final = set(graph.blob_value.values())
    out = dict(kernels)
    for conv in graph.layers:
        head = kernels.get(conv.name)
        # A value inside a chain is never made, so none may carry a loss weight.
        if conv.type != "Convolution" or head is None or len(conv.top_values) != 1 or any(conv.loss_weights):
            continue
        bn = _only_consumer(conv.top_values[0], users, outputs)
        if (bn is None or bn.type != "BatchNorm" or not uses_global_stats(bn.proto.batch_norm_param, graph.phase)
                or len(bn.top_values) != 1):
            continue
        inner = [conv.top_values[0]]
        scale = _only_consumer(bn.top_values[0], users, outputs)
        if (scale is not None and scale.type == "Scale" and _channel_scale_shape(scale, graph)
                and not any(bn.loss_weights)):
            inner.append(bn.top_values[0])
        else:
            scale = None
        visible = any(value in final for value in inner)
        shape = _conv_shape(conv, graph)
        per_filter = shape.batch * math.prod(shape.out) / (shape.channels // shape.group
                                                           * math.prod(shape.geometry.kernel))
        chain = _conv_batch_norm_chain(head, conv, bn, scale, visible, per_filter >= CHAIN_BACKWARD_MIN_RATIO)
        out[conv.name] = dataclasses.replace(head, chain=chain)
    return out


# ---- float32 compute for narrow storage ---------------------------------------------------------------------

# Kernels that ``widen`` runs in float32 when the values are stored narrower (bfloat16). XLA:CPU's bfloat16
# convolutions, pooling windows and LRN sums are slower than its float32 ones (2 Sapphire Rapids cores: a 3x3
# convolution on 16x56x56x64 42 ms against 23 ms; GoogLeNet's 14 poolings 52 against 33 ms); products as dots
# are not (conv_gemm, winograd, inner products run on the CPU's bfloat16 matrix instructions).
WIDENED_KERNELS = frozenset({"conv_nhwc", "pool_nhwc", "lrn_nhwc"})


def _widened(kernel: Kernel) -> Kernel:
    """``kernel`` computing in float32 at least: bottoms and arrays widened (exactly), tops rounded once to the
    program's storage dtype (``ctx.dtype``; bottoms may come unrounded, see :func:`defer_rounding`). A float32
    program runs the kernel unchanged."""
    return dataclasses.replace(kernel, name=f"{kernel.name}_widened",
                               forward=functools.partial(_widened_forward, kernel.forward, True))


def _widened_forward(forward: ForwardFn, rounded: bool, ctx, bottoms, params):
    dtype = ctx.dtype
    wide = accumulator_dtype(dtype)
    if wide == dtype:
        return forward(ctx, bottoms, params)
    tops = forward(dataclasses.replace(ctx, dtype=wide), [b.astype(wide) for b in bottoms],
                   [a.astype(wide) for a in params])
    return [t.astype(dtype) for t in tops] if rounded else tops


def widen(plan: Plan) -> Plan:
    """Direct convolutions, pooling and LRN computed in float32 when values are stored in bfloat16."""
    kernels = {name: _widened(kernel) if kernel.name in WIDENED_KERNELS else kernel
               for name, kernel in plan.kernels.items()}
    return dataclasses.replace(plan, kernels=kernels)


# ---- rounding deferred into widened kernels -----------------------------------------------------------------

# A product's float32 sum, rounded to bfloat16 for storage, is widened again right away where element-wise
# layers alone lead it into a widened kernel (MobileNet's expand -> ReLU -> depthwise, SqueezeNet's conv10 ->
# ReLU -> global pooling). Left unrounded, XLA fuses the bias, the element-wise layers and the widening into one
# pass over the product's output instead of writing bfloat16 and reading it back; the widened kernel rounds
# once, for storage. bfloat16 forwards at batch 16 (alternating blocks, 2 Sapphire Rapids cores): MobileNet v2
# 0.91-0.95 of the time, SqueezeNet v1.1 0.95, ResNet-50, AlexNet and LeNet even. Into LRN (GoogLeNet's conv2 ->
# ReLU -> norm2, whose window fusion recomputes the unrounded chain per channel) GoogLeNet took 1.04 of the time,
# so LRN is left out.
# The shifted multiply-adds of a one-channel first layer (conv_taps) sum in float32 too. Written out apart
# (vision.few_channel_convolution), LeNet's conv1 sum was rounded by pool1's loop, four values a window: 98 us
# there against 52 us pooling the float32 sums and rounding the maximum (traced); LeNet's bfloat16 forward
# took 0.91-0.96 of the time at batch 16 and 0.91 at batch 64, the same bits (alternating blocks, 2 Sapphire
# Rapids cores).
_ROUNDING_PRODUCTS = {"conv_1x1_gemm": _pointwise_conv_kernel, "conv_im2col": _im2col_conv_kernel,
                      "conv_winograd_f2x2_3x3": _winograd_conv_kernel, "conv_taps": _taps_conv_kernel}
# A widened convolution's float32 result is the same case (SqueezeNet's conv1 -> ReLU -> pool1, ResNet-50's and
# GoogLeNet's conv1 -> ReLU -> pool1: the 3-channel first layers, which no product takes). SqueezeNet v1.1's
# bfloat16 forward at batch 16 took 0.963-0.983 of the time (three paired runs; its conv1 -> pool1 fusion 3.0
# -> 1.9 ms traced), at batch 1 0.990; ResNet-50's and GoogLeNet's even (alternating blocks, 2 AMX Xeon cores).
# Into a MAX pooling the outputs are the rounding program's, bit for bit.
_ROUNDING_WIDENED = frozenset({"conv_nhwc_widened"})
_DEFERRED_INTO = frozenset({"conv_nhwc_widened", "conv_nhwc_widened_unrounded", "pool_nhwc_widened"})


def _runs_caffes_rule(kernel: Kernel | None) -> bool:
    """Whether an element-wise layer with ``kernel`` computes Caffe's rule as it is (no kernel, or ``nhwc``'s
    layout-free one), not one of this pass's rewrites."""
    return kernel is None or kernel.name == "elementwise"


def _only_into_widened(value: str, kernels: Mapping[str, Kernel], users, outputs) -> bool:
    """Whether ``value`` reaches nothing but widened kernels, through one-input element-wise layers only."""
    readers = users.get(value, [])
    if not readers or value in outputs:
        return False
    for layer in readers:
        kernel = kernels.get(layer.name)
        if kernel is not None and kernel.name in _DEFERRED_INTO:
            continue
        if (layer.type in ELEMENTWISE_TYPES and _runs_caffes_rule(kernel)
                and layer.type != "Silence" and len(layer.bottom_values) == 1
                and all(_only_into_widened(v, kernels, users, outputs) for v in layer.top_values)):
            continue
        return False
    return True


# Else, a product's or widened convolution's output that only a plain ReLU reads (MobileNet's depthwise layers,
# the products before ResNet's, GoogLeNet's and SqueezeNet's ReLUs) was rounded, widened again for the ReLU (its
# bfloat16 maximum runs in float32 on XLA:CPU) and rounded again. Rounding is monotonic and keeps 0, so the ReLU
# of the rounded sum is the rounded ReLU of the sum, bit for bit (NaN too): the ReLU rounds once instead
# (kernel ``elementwise_rounding``). Alone, MobileNet v2's depthwise layer fusion at batch 16 (2 AMX Xeon cores,
# traced): 28x28x384 2.98 -> 1.87 ms, 56x56x144 4.37 -> 2.40 ms.
def _plain_relu_alone(value: str, kernels: Mapping[str, Kernel], users, outputs) -> Layer | None:
    """The ReLU without a negative slope that alone reads ``value`` (not an output), where it runs Caffe's rule."""
    relu = _only_consumer(value, users, outputs)
    if relu is None:
        return None
    kernel = kernels.get(relu.name)
    plain = (relu.type == "ReLU" and relu.proto.relu_param.negative_slope == 0
             and _runs_caffes_rule(kernel))
    return relu if plain else None


def _forward_and_layout(layer: Layer, kernel: Kernel | None) -> tuple[ForwardFn, str]:
    """How an element-wise layer runs: its kernel's forward and layout, or Caffe's rule (NCHW) where it has none."""
    return (kernel.forward, kernel.layout) if kernel is not None else (get_rule(layer.type).forward, NCHW)


def _rounding_elementwise(layer: Layer, kernel: Kernel | None) -> Kernel:
    """An element-wise layer's kernel that rounds its tops to the program's storage dtype (``ctx.dtype``)."""
    forward, layout = _forward_and_layout(layer, kernel)

    def rounding(ctx, bottoms, params):
        return [top.astype(ctx.dtype) for top in forward(ctx, bottoms, params)]

    return Kernel("elementwise_rounding", rounding, layout)


# So is the sum of two values (an Eltwise SUM without coefficients: ResNet's joins, each read by a ReLU alone):
# XLA:CPU computes a bfloat16 sum in float32 and rounds it, so summed in float32 and rounded by the ReLU it is
# the same bits. ResNet-50's bf16 forward (alternating blocks, 2 AMX Xeon cores): 0.954-0.974 of the time at
# batch 16, 0.963 at batch 1. (Three or more values, or coefficients, round between the terms: left alone.)
def _sums_two(layer: Layer, kernel: Kernel | None) -> bool:
    """Whether a layer is an Eltwise SUM of two values without coefficients, run by Caffe's rule."""
    p = layer.proto.eltwise_param
    return (layer.type == "Eltwise" and len(layer.bottom_values) == 2 and len(layer.top_values) == 1
            and p.operation == caffe_pb2.EltwiseParameter.SUM and all(c == 1 for c in p.coeff)
            and _runs_caffes_rule(kernel))


def _summing_in_float32(layer: Layer, kernel: Kernel | None) -> Kernel:
    """An element-wise layer's kernel that computes on its bottoms widened to float32 at least, unrounded."""
    forward, layout = _forward_and_layout(layer, kernel)

    def unrounded(ctx, bottoms, params):
        return forward(ctx, [b.astype(accumulator_dtype(b.dtype)) for b in bottoms], params)

    return Kernel("elementwise_unrounded", unrounded, layout)


def defer_rounding(plan: Plan) -> Plan:
    """Products (1x1 GEMM, im2col, Winograd), taps and widened convolutions whose output only widened
    convolutions and poolings read, through one-input element-wise layers, keep it in float32 (kernel
    ``<name>_unrounded``): the widened kernel rounds it. Those whose output only a plain ReLU reads keep it in
    float32 too, and the ReLU rounds; so does a sum of two values. Runs after ``widen``; a no-op in float32
    programs."""
    users, outputs = readers_by_value(plan.graph.layers), _output_values(plan.graph)
    kernels = dict(plan.kernels)
    deferrable = _ROUNDING_PRODUCTS.keys() | _ROUNDING_WIDENED
    for layer in plan.graph.layers:
        kernel = kernels.get(layer.name)
        if _sums_two(layer, kernel):
            relu = _plain_relu_alone(layer.top_values[0], kernels, users, outputs)
            if relu is not None:
                kernels[layer.name] = _summing_in_float32(layer, kernel)
                kernels[relu.name] = _rounding_elementwise(relu, kernels.get(relu.name))
            continue
        if kernel is None or kernel.name not in deferrable or len(layer.top_values) != 1:
            continue
        if not _only_into_widened(layer.top_values[0], kernels, users, outputs):
            relu = _plain_relu_alone(layer.top_values[0], kernels, users, outputs)
            if relu is None:
                continue
            kernels[relu.name] = _rounding_elementwise(relu, kernels.get(relu.name))
        if kernel.name in _ROUNDING_WIDENED:
            forward, _ = kernel.forward.args  # (_widened's partial)
            unrounded = dataclasses.replace(kernel, forward=functools.partial(_widened_forward, forward, False))
        else:
            unrounded = _ROUNDING_PRODUCTS[kernel.name](_conv_shape(layer, plan.graph), rounded=False)
        kernels[layer.name] = dataclasses.replace(unrounded, name=f"{kernel.name}_unrounded")
    return dataclasses.replace(plan, kernels=kernels)


# ---- an InnerProduct reading channels-last values -------------------------------------------------------------

def inner_product_nhwc(plan: Plan) -> Plan:
    """An InnerProduct over a 4-D channels-last value (a classifier after the last convolution or pooling) reads
    it as it is, its weight's columns permuted once from Caffe's (C, H, W) order to (H, W, C). Not a default of
    compile_inference, whose programs read the net's own weights (a permuted copy held AlexNet's fc6, 151 MB,
    twice, for forwards within 2%: tests/test_optimize.py); caffejax.export runs it, its weights being constants of
    the program anyway: there XLA folded the activations' transpose into the constant weight as it compiled
    (AlexNet's fc6: 1.5 s, logged as a slow operation)."""
    graph = plan.graph
    kernels = dict(plan.kernels)
    layouts = value_layouts(graph, kernels)
    for layer in graph.layers:
        if (layer.type == "InnerProduct" and layer.name not in kernels and len(layer.bottom_values) == 1
                and layouts.get(layer.bottom_values[0]) == NHWC
                and canonical_axis(layer.name, layer.proto.inner_product_param.axis, 4) == 1):
            kernels[layer.name] = _inner_product_nhwc_kernel(_shape(graph, layer.bottom_values[0]),
                                                             layer.proto.inner_product_param.transpose)
    return dataclasses.replace(plan, kernels=kernels)


def _inner_product_nhwc_kernel(shape: Sequence[int], transpose: bool) -> Kernel:
    _, channels, height, width = shape

    def prepare(params: ParamArrays) -> ParamArrays:
        weight = params[0]
        if transpose:  # (C*H*W, outputs)
            permuted = weight.reshape(channels, height, width, -1).transpose(1, 2, 0, 3).reshape(weight.shape)
        else:  # (outputs, C*H*W)
            permuted = weight.reshape(-1, channels, height, width).transpose(0, 2, 3, 1).reshape(weight.shape)
        return [permuted, *params[1:]]

    def forward(ctx, bottoms, params):
        (x,) = bottoms
        return get_rule("InnerProduct").forward(ctx, [x.reshape(x.shape[0], -1)], params)

    return Kernel("inner_product_nhwc", forward, NHWC, prepare)


PASSES: dict[str, Callable[[Plan], Plan]] = {
    "fold_batchnorm": fold_batchnorm,
    "merge_concat_convolutions": merge_concat_convolutions,
    "nhwc": nhwc,
    "conv_gemm": conv_gemm,
    "conv_taps": conv_taps,
    "conv_im2col": conv_im2col,
    "winograd": winograd,
    "winograd_medium": winograd_medium,
    "widen": widen,
    "defer_rounding": defer_rounding,
    "inner_product_nhwc": inner_product_nhwc,
}
# conv_gemm is not a default for inference. Its products go to YNNPACK with the element-wise work around them
# (the forward programs' compiler option); left as convolutions, XLA rewrites 1x1 convolutions into plain dots
# itself, and those ran faster. Paired A/B of whole forwards (4-12 alternating rounds), conv_gemm off against
# on: SqueezeNet v1.1 0.80-0.81 at batch 1 and 0.93 at batch 16, MobileNet v2 0.83-0.87 / 0.91, ResNet-50
# 0.85 / 0.92, GoogLeNet 0.90 / 0.89. Training programs keep it (layout_kernels): MobileNet v2's step was 9%
# slower without it, SqueezeNet's the same. Net's programs without a backward leave it out too
# (layout_kernels(differentiated=False), Net._net_program).
# conv_im2col, winograd_medium, widen and defer_rounding pay only with bfloat16 values
# (caffejax.runtime.inference.default_passes).
# inner_product_nhwc: caffejax.export's (see the pass).
DEFAULT_PASSES: tuple[str, ...] = tuple(name for name in PASSES if name not in (
    "merge_concat_convolutions", "conv_gemm", "winograd_medium", "conv_im2col", "widen", "defer_rounding",
    "inner_product_nhwc"))


def check_passes(passes: Sequence[str]) -> None:
    unknown = [name for name in passes if name not in PASSES]
    if unknown:
        raise CaffejaxError(f"unknown optimisation pass(es) {unknown}; known: {list(PASSES)}")


def optimize(plan: Plan, passes: Sequence[str] = DEFAULT_PASSES) -> Plan:
    """Run the named passes in :data:`PASSES` order (the kernel choices refine what ``nhwc`` picked)."""
    check_passes(passes)
    for name in PASSES:
        if name in passes:
            plan = PASSES[name](plan)
    return plan


# ---- running a plan ---------------------------------------------------------------------------------------

def prepare_params(plan: Plan, dtype, adopt: Callable[[str, int, np.ndarray], jax.Array] | None = None
                   ) -> dict[str, list[jax.Array]]:
    """Every layer's arrays in its kernel's form and the compute dtype (done once per program). ``adopt(layer,
    index, host array)`` puts each on the device (default: :func:`adopted_by_device`; compile_inference's
    programs share theirs, ``inference.SharedWeights``)."""
    if adopt is None:
        adopt = lambda layer, index, a: adopted_by_device(a, dtype)  # noqa: E731
    out = {}
    for name, arrays in plan.params.items():
        kernel = plan.kernels.get(name)
        prepared = kernel.prepare(arrays) if kernel is not None else arrays
        out[name] = [adopt(name, i, a) for i, a in enumerate(map(np.asarray, prepared))]
    return out


# XLA:CPU takes a host array whose data starts on this boundary as its own buffer, without copying it.
_DEVICE_ALIGNMENT = 64


def aligned_empty(shape: Sequence[int], dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a 64-byte boundary (NumPy's own start on 16)."""
    dtype = np.dtype(dtype)
    size = math.prod(shape) * dtype.itemsize
    raw = np.empty(size + _DEVICE_ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % _DEVICE_ALIGNMENT
    return raw[start:start + size].view(dtype).reshape(tuple(shape))


def aligned_copy(a: Any, dtype=None) -> np.ndarray:
    """A copy of ``a`` (in ``dtype``, default its own) in :func:`aligned_empty` memory."""
    a = np.asarray(a)
    copy = aligned_empty(a.shape, a.dtype if dtype is None else dtype)
    copy[...] = a
    return copy


def adopted_by_device(a: np.ndarray, dtype) -> jax.Array:
    """``a`` in ``dtype`` as a device array that, on the CPU, is ``a``'s own memory (or, where ``a`` is not in
    that dtype, contiguous and aligned, one copy's): jax.device_put copies an unaligned host array, at about
    1 GB/s on the 2-core VM. The host array is made read-only: its memory is the program's weight from now on.
    (Not jnp.asarray: that compiles a conversion per new shape, ~25 ms each, cold.)"""
    if a.dtype != dtype or not a.flags.c_contiguous or a.ctypes.data % _DEVICE_ALIGNMENT:
        a = aligned_copy(a, dtype)
    a.flags.writeable = False
    return jax.device_put(a)


def value_layouts(graph: Graph, kernels: Mapping[str, Kernel]) -> dict[str, str]:
    """The layout each value is made in when the whole graph runs with ``kernels`` (absent: NCHW): the
    :class:`Layouts` bookkeeping of a run, driven by the graph's shapes. For timing one layer as it runs
    inside the net."""
    shapes = {v: jax.ShapeDtypeStruct(s, jnp.float32) for v, s in graph.value_shapes.items() if s is not None}
    tracked = Layouts(shapes)
    for layer in graph.layers:
        if not layer.is_input:
            layout = tracked.layout_for(kernels.get(layer.name), layer.bottom_values)
            tracked.produced(layer.top_values, [shapes[v] for v in layer.top_values], layout)
    return dict(tracked.layout)


class Layouts:
    """Which layout each value of one program run is in (absent: Caffe's NCHW), over ``env`` (value id ->
    array), and the moves made: a reader gets a value in its layout, each (value, layout) transpose once."""

    def __init__(self, env: dict[str, jax.Array], layouts: Mapping[str, str] | None = None):
        self.env = env
        self.layout: dict[str, str] = {v: layout for v, layout in (layouts or {}).items() if layout != NCHW}
        self.moved: dict[tuple[str, str], jax.Array] = {}

    def layout_for(self, kernel: Kernel | None, bottom_values: Sequence[str]) -> str:
        return resolve_layout(kernel, [self.layout.get(v, NCHW) if np.ndim(self.env[v]) == 4 else None
                                       for v in bottom_values])

    def fetch(self, value: str, layout: str) -> jax.Array:
        x, have = self.env[value], self.layout.get(value, NCHW)
        if np.ndim(x) != 4 or have == layout:
            return x
        if (value, layout) not in self.moved:
            self.moved[(value, layout)] = to_layout(x, have, layout)
        return self.moved[(value, layout)]

    def produced(self, values: Sequence[str], tops: Sequence[jax.Array], layout: str) -> None:
        for value, top in zip(values, tops):
            if layout != NCHW and np.ndim(top) == 4:
                self.layout[value] = layout
            else:
                self.layout.pop(value, None)

    def restore_caffe_layout(self) -> None:
        """Every value back in NCHW for the caller (XLA drops the moves nobody reads)."""
        for value in list(self.layout):
            self.env[value] = self.fetch(value, NCHW)
        self.layout.clear()


def run_plan(plan: Plan, params: Mapping[str, Sequence[jax.Array]], inputs: Mapping[str, jax.Array]
             ) -> dict[str, jax.Array]:
    """The plan's forward: inputs by value id (NCHW) -> the net's outputs by blob name (NCHW): its
    ``Graph.program_outputs``, which a layer run on the host then finishes (lower.program.run_host_layers).

    Values live in the layout their layer ran in; a layer reading a value in another layout gets it
    transposed, and each (value, layout) transpose is made once.
    """
    graph = plan.graph
    env: dict[str, jax.Array] = dict(inputs)
    layouts = Layouts(env)
    dtype = jnp.result_type(*inputs.values()) if inputs else jnp.float32
    for layer in graph.layers:
        if layer.is_input or layer.runs_on_host:  # a host layer runs on what the program returns
            continue
        kernel = plan.kernels.get(layer.name)
        layout = layouts.layout_for(kernel, layer.bottom_values)
        forward = kernel.forward if kernel is not None else get_rule(layer.type).forward
        ctx = LayerContext(layer=layer.proto, phase=graph.phase, key=None, num_tops=len(layer.tops),
                           in_place=tuple(layer.in_place), dtype=dtype, python_layers=graph.python_layers)
        bottoms = [layouts.fetch(v, layout) for v in layer.bottom_values]
        with jax.named_scope(layer.name):  # profiles name the layer each operation comes from (program_profile)
            try:
                tops = forward(ctx, bottoms, params.get(layer.name, []))
            except CaffejaxError:
                raise
            except Exception as e:  # a rule that needs a number where an export's batch is symbolic
                if not any(is_symbolic(d) for b in bottoms for d in np.shape(b)):
                    raise
                raise layer_error(UnsupportedError, layer.name, layer.type, "its rule cannot take the symbolic "
                                  f"batch of a batch-polymorphic export ({type(e).__name__}: {e})") from e
        layouts.produced(layer.top_values, tops, layout)
        env.update(zip(layer.top_values, tops))
    return {blob: layouts.fetch(graph.blob_value[blob], NCHW) for blob in graph.program_outputs}
