"""Drawing a net's graph, as pycaffe's ``caffe.draw`` does (``draw_net``, ``draw_net_to_file``).

Layers are records (convolutions red, pooling orange, inner products purple, in-place layers green, the
rest blue), blobs octagons; an edge from a layer to its top is labelled with the layer's output count
(num_output, or the batch size of a Data layer). ``phase`` keeps only the layers the net has in that phase
(caffejax applies Caffe's whole NetState rule, as the net would be built: pycaffe compared only the phase,
and read a rule without one, such as ``include { stage: "deploy" }``, as TRAIN).

caffejax writes the Graphviz DOT text itself and renders it with Graphviz's ``dot`` program (as pydot
would); ``.dot``/``.gv``/``.raw`` files get the DOT text and need nothing installed. :func:`get_pydot_graph`
returns a ``pydot.Dot`` for code that wants one, and needs pydot.

Other differences from pycaffe's drawing, on purpose: every blob is an octagon (pycaffe lost the style of a
blob last mentioned as a top, the loss for one, and drew it as a plain ellipse); the net is upgraded as Caffe
would first (pycaffe drew only ``layer``: nothing of a V1 net, and no layer for ``input:`` fields, which
caffejax draws as the Input layer Caffe makes of them); record labels escape ``{}|<>``; rankdir must be one
of LR, RL, TB, BT; :func:`get_pydot_graph`'s node names are ``layer <name> (<type>)`` and ``blob <name>``
with pycaffe's text as their labels (pycaffe used the label as the name).
"""

from __future__ import annotations

import os
import shutil
import subprocess

from caffejax.errors import CaffejaxError, LrMultError, UnsupportedError
from caffejax.fileio import atomic_write
from caffejax.frontend.build import load_net_param
from caffejax.frontend.filter_net import filter_net, make_state
from caffejax.proto import caffe_pb2

__all__ = ["get_dot_text", "get_pydot_graph", "draw_net", "draw_net_to_file", "DOT_TEXT_FORMATS"]

LAYER_STYLE = {"shape": "record", "style": "filled"}
NEURON_LAYER_COLOR = "#90EE90"  # an in-place layer (ReLU, Dropout...)
LAYER_COLORS = {"Convolution": "#FF5050", "Deconvolution": "#FF5050", "Pooling": "#FF9900",
                "InnerProduct": "#CC33FF"}
DEFAULT_LAYER_COLOR = "#6495ED"
BLOB_STYLE = {"shape": "octagon", "fillcolor": "#E0E0E0", "style": "filled"}

RANKDIRS = ("LR", "RL", "TB", "BT")

# Extensions written as DOT text rather than rendered (pycaffe suggests '.raw' for that).
DOT_TEXT_FORMATS = ("dot", "gv", "raw")


def _net_param(caffe_net) -> caffe_pb2.NetParameter:
    """pycaffe takes a NetParameter; caffejax also takes a prototxt path or text (upgraded as Caffe would)."""
    return load_net_param(caffe_net, is_path=True if isinstance(caffe_net, os.PathLike) else None)


def _phase_layers(net: caffe_pb2.NetParameter, phase: int | None) -> list:
    if phase is None:
        return list(net.layer)
    return list(filter_net(net, make_state(phase)).layer)


def _first(values, default: int) -> int:
    return values[0] if len(values) else default


_LEARNING_TYPES = ("Convolution", "Deconvolution", "InnerProduct")


def layer_lr_mult(layer) -> tuple[float, float]:
    """The lr_mult of a Convolution, Deconvolution or InnerProduct's weights and bias (1 where unset)."""
    if layer.type not in _LEARNING_TYPES:
        raise ValueError(f"{layer.type} layers do not have a learning rate multiplier")
    if len(layer.param) > 2:  # Caffe refuses such a net too
        raise LrMultError(f"layer '{layer.name}' (type {layer.type}) has {len(layer.param)} param specs; its "
                          "learnable blobs are only weights and bias")
    mults = [spec.lr_mult if spec.HasField("lr_mult") else 1.0 for spec in layer.param]
    return tuple(mults + [1.0] * (2 - len(mults)))


def layer_label(layer, rankdir: str, display_lrm: bool = False) -> str:
    """The node text: name, type, kernel/stride/pad for convolutions and pooling, and with ``display_lrm`` the
    learning layers' lr_mult (as pycaffe writes it, unless both are 0)."""
    # Vertical graphs have room across, horizontal ones down (pycaffe's choice of separator).
    sep = " " if rankdir in ("TB", "BT") else "\n"
    if layer.type in ("Convolution", "Deconvolution"):
        p = layer.convolution_param
        label = (f"{layer.name}{sep}({layer.type}){sep}kernel size: {_first(p.kernel_size, 1)}{sep}"
                 f"stride: {_first(p.stride, 1)}{sep}pad: {_first(p.pad, 0)}")
    elif layer.type == "Pooling":
        p = layer.pooling_param
        method = caffe_pb2.PoolingParameter.PoolMethod.Name(p.pool)
        # BVLC master writes "(Pooling MAX)"; "(MAX Pooling)" was pycaffe's older (rc) label
        label = (f"{layer.name}{sep}({layer.type} {method}){sep}kernel size: {p.kernel_size}{sep}"
                 f"stride: {p.stride}{sep}pad: {p.pad}")
    else:
        label = f"{layer.name}{sep}({layer.type})"
    if display_lrm and layer.type in _LEARNING_TYPES:
        mults = layer_lr_mult(layer)
        if any(mults):
            label += sep + "lr mult: %.1f, %.1f" % mults
    return label


def layer_color(layer_type: str) -> str:
    """The fill colour of a layer that is not an in-place neuron layer."""
    return LAYER_COLORS.get(layer_type, DEFAULT_LAYER_COLOR)


def edge_label(layer) -> str:
    if layer.type == "Data":
        return f"Batch {layer.data_param.batch_size}"
    if layer.type in ("Convolution", "Deconvolution"):
        return str(layer.convolution_param.num_output)
    if layer.type == "InnerProduct":
        return str(layer.inner_product_param.num_output)
    return ""


def _quote(text: str, record: bool = False) -> str:
    """A DOT string; in a record shape's label, braces, bars and angle brackets are escaped too."""
    escaped = text.replace("\\", "\\\\")
    if record:
        for special in "{}|<>":
            escaped = escaped.replace(special, "\\" + special)
    escaped = escaped.replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def _attrs(attrs: dict) -> str:
    record = attrs.get("shape") == "record"
    return ", ".join(f"{key}={_quote(str(value), record and key == 'label')}" for key, value in attrs.items())


def get_dot_text(caffe_net, rankdir: str = "LR", label_edges: bool = True, phase: int | None = None,
                 display_lrm: bool = False) -> str:
    """The net as Graphviz DOT text: one node per layer and per blob, an edge per bottom and top."""
    if rankdir not in RANKDIRS:
        raise CaffejaxError(f"rankdir must be one of {', '.join(RANKDIRS)}, got {rankdir!r}")
    net = _net_param(caffe_net)
    nodes: dict[str, dict] = {}  # node id -> attributes; dict keeps first-seen order
    edges: list[tuple[str, str, str]] = []
    for layer in _phase_layers(net, phase):
        node = f"layer {layer.name} ({layer.type})"
        in_place = len(layer.bottom) == 1 and len(layer.top) == 1 and layer.bottom[0] == layer.top[0]
        color = NEURON_LAYER_COLOR if in_place else layer_color(layer.type)
        nodes[node] = {"label": layer_label(layer, rankdir, display_lrm), **LAYER_STYLE, "fillcolor": color}
        for bottom in layer.bottom:
            nodes.setdefault(f"blob {bottom}", {"label": bottom, **BLOB_STYLE})
            edges.append((f"blob {bottom}", node, ""))
        for top in layer.top:
            nodes.setdefault(f"blob {top}", {"label": top, **BLOB_STYLE})
            edges.append((node, f"blob {top}", edge_label(layer) if label_edges else ""))
    lines = [f"digraph {_quote(net.name or 'Net')} {{", f"  rankdir={rankdir};"]
    lines += [f"  {_quote(node)} [{_attrs(attrs)}];" for node, attrs in nodes.items()]
    lines += [f"  {_quote(src)} -> {_quote(dst)}" + (f" [label={_quote(label)}]" if label else "") + ";"
              for src, dst, label in edges]
    lines.append("}")
    return "\n".join(lines) + "\n"


def get_pydot_graph(caffe_net, rankdir: str = "LR", label_edges: bool = True, phase: int | None = None,
                    display_lrm: bool = False):
    """pycaffe's ``get_pydot_graph``: the same graph as a ``pydot.Dot`` (needs pydot)."""
    try:
        import pydot
    except ImportError:
        raise UnsupportedError("get_pydot_graph needs pydot: pip install 'caffejax[draw]' (draw_net and "
                               "draw_net_to_file work without it)") from None
    graphs = pydot.graph_from_dot_data(get_dot_text(caffe_net, rankdir, label_edges, phase, display_lrm))
    return graphs[0]


def render_dot(dot_text: str, ext: str) -> bytes:
    """Render DOT text to an image format (png, svg, pdf...) with Graphviz's ``dot`` program."""
    if ext in DOT_TEXT_FORMATS:
        return dot_text.encode()
    dot = shutil.which("dot")
    if dot is None:
        raise UnsupportedError(f"drawing to '.{ext}' needs Graphviz's 'dot' program: install graphviz "
                               "(e.g. apt-get install graphviz, brew install graphviz); '.dot' output "
                               "works without it")
    done = subprocess.run([dot, f"-T{ext}"], input=dot_text.encode(), capture_output=True, check=False)
    if done.returncode != 0:
        message = done.stderr.decode(errors="replace").strip().splitlines()
        raise CaffejaxError(f"graphviz 'dot -T{ext}' failed: {message[-1] if message else done.returncode}")
    return done.stdout


def draw_net(caffe_net, rankdir: str = "LR", ext: str = "png", phase: int | None = None,
             display_lrm: bool = False) -> bytes:
    """The drawn net, encoded as ``ext`` (``png``, ``svg``, ``pdf``, ... or ``dot`` for DOT text)."""
    return render_dot(get_dot_text(caffe_net, rankdir, phase=phase, display_lrm=display_lrm),
                      ext.lower().lstrip("."))


def draw_net_to_file(caffe_net, filename: str, rankdir: str = "LR", phase: int | None = None,
                     display_lrm: bool = False) -> None:
    """Draw the net into ``filename``; the format is the file's extension (``.dot`` for DOT text)."""
    filename = os.fspath(filename)
    ext = os.path.splitext(filename)[1].lstrip(".").lower()
    if not ext:
        raise CaffejaxError(f"{filename}: give the output file an extension (.png, .svg, .pdf, .dot...)")
    atomic_write(filename, draw_net(caffe_net, rankdir, ext, phase, display_lrm))


def get_layer_label(layer, rankdir: str, display_lrm: bool = False) -> str:
    """pycaffe's ``get_layer_label``: :func:`layer_label` as pycaffe returns it, ready to be a pydot node name
    (double-quoted, line breaks as the two characters backslash and n)."""
    return '"%s"' % layer_label(layer, rankdir, display_lrm).replace("\n", "\\n")


def get_edge_label(layer) -> str:
    """pycaffe's ``get_edge_label``: :func:`edge_label`, with ``'""'`` (an empty DOT string) for no label."""
    return edge_label(layer) or '""'


# pycaffe's names for the pieces above.
get_layer_lr_mult = layer_lr_mult
choose_color_by_layertype = layer_color


def get_pooling_types_dict() -> dict[int, str]:
    """pycaffe's: PoolingParameter's method numbers -> names."""
    return {v.number: name for name, v in caffe_pb2.PoolingParameter.PoolMethod.DESCRIPTOR.values_by_name.items()}
