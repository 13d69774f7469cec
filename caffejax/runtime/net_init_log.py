"""The log a Caffe net writes as it is built (Net::Init and Net::FilterNet in net.cpp), from caffejax's graph.

Caffe's tools and training logs show, for every net they make:

    The NetState phase (0) differed from the phase (1) specified by a rule in layer accuracy   (FilterNet)
    Initializing net from parameters:                                      the filtered NetParameter
    Creating Layer conv1 / conv1 <- data / conv1 -> conv1 / Setting up conv1
    Top shape: 64 20 24 24 (737280) / [    with loss weight 1] / Memory required for data: 3150080
    conv1 needs backward computation.                                      (last layer first)
    This network produces output loss / Network initialization done.

These lines come from the graph caffejax built (after FilterNet and InsertSplits, with its inferred shapes),
in Caffe's order. Caffe's layers also log from their own set-up (the layer factory's "Creating layer", a data
layer's "Opened lmdb", "output data size"); caffejax does not write those. The parameters are printed by
Python's protobuf, which writes a whole float as 1.0 where Caffe's C++ writes 1.
"""

from __future__ import annotations

import logging
import math

from caffejax.frontend.filter_net import filter_net, with_state
from caffejax.frontend.ir import Graph
from caffejax.frontend.prototxt import to_text
from caffejax.proto import caffe_pb2
from caffejax.runtime.mode import log_float

log = logging.getLogger("caffejax")


def log_net_init(net_param: caffe_pb2.NetParameter, graph: Graph, itemsize: int) -> None:
    """Log Net::Init's lines for ``graph``, built from ``net_param`` (upgraded, before FilterNet), at INFO;
    nothing is computed when INFO is not shown. ``itemsize``: the bytes of one blob value (Caffe's Dtype)."""
    if log.isEnabledFor(logging.INFO):
        for line in net_init_lines(net_param, graph, itemsize):
            log.info("%s", line, stacklevel=2)


def net_init_lines(net_param: caffe_pb2.NetParameter, graph: Graph, itemsize: int = 4) -> list[str]:
    stated = with_state(net_param, graph.phase, graph.level, graph.stages)
    lines: list[str] = []
    filtered = filter_net(stated, stated.state, notes=lines)
    lines.append("Initializing net from parameters: \n" + to_text(filtered).rstrip("\n"))
    memory = 0
    for layer in graph.layers:
        lines.append(f"Creating Layer {layer.name}")
        lines.extend(f"{layer.name} <- {bottom}" for bottom in layer.bottoms)
        lines.extend(f"{layer.name} -> {top}" + (" (in-place)" if in_place else "")
                     for top, in_place in zip(layer.tops, layer.in_place))
        lines.append(f"Setting up {layer.name}")
        for value, weight in zip(layer.top_values, layer.loss_weights):
            shape = graph.value_shapes.get(value)
            lines.append(f"Top shape: {shape_string(shape)}")
            if weight:
                lines.append(f"    with loss weight {log_float(weight)}")
            memory += math.prod(shape) if shape is not None else 0
        lines.append(f"Memory required for data: {memory * itemsize}")
    for layer, need in reversed(list(zip(graph.layers, graph.swept_need_backward))):
        lines.append(f"{layer.name} needs backward computation." if need
                     else f"{layer.name} does not need backward computation.")
    lines.extend(f"This network produces output {blob}" for blob in graph.outputs)
    lines.append("Network initialization done.")
    return lines


def shape_string(shape) -> str:
    """Blob::shape_string(): the axes, then the count in parentheses ("64 1 28 28 (50176)", a scalar "(1)")."""
    if shape is None:
        return "(unknown: the layer's data source could not be read)"
    return "".join(f"{d} " for d in shape) + f"({math.prod(shape)})"
