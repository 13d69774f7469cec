"""pycaffe's ``caffe.coord_map``: how a NetSpec top's spatial coordinates map onto another's, and ``crop``,
which spells the Crop layer that aligns them (FCN's net definitions: ``n.score = crop(n.upscore, n.data)``).

A layer's map is (axis, scale a, shift b): output coordinate i corresponds to input coordinate a * i + b along
every spatial axis from ``axis`` on (axis None: any; the map of a point-wise layer is (None, 1, 0)). Maps
compose along a path of layers and invert for the way back; ``coord_map_from_to`` walks back from both tops
to a common ancestor. The arithmetic is pycaffe's, element-wise over the spatial axes (NumPy arrays).

Differences from pycaffe, on purpose:

- The walk visits each top once, following the first path that reaches it, depth first: pycaffe's answer
  where two paths disagree (an Eltwise of differently placed inputs) depended on the order of a set, and
  following every path took time exponential in the number of residual blocks.
- A Pooling's kernel is read from ``pooling_param`` too (pycaffe's conv_params says so, but read only
  ``convolution_param`` and failed with a KeyError); a global pooling has no map, like an InnerProduct
  (pycaffe: KeyError).
- Legacy ``kernel_h``-style fields are refused inside ``convolution_param``/``pooling_param`` as well as at
  the top level (pycaffe looked only at the top level and mapped such a layer as if they were not there).
- ``crop`` also works when only Crop and pass-through layers lie between the tops (pycaffe's scale there is a
  Python number, and its check ``(a == 1).all()`` failed).
- Errors are typed: UnsupportedError for legacy fields (pycaffe: AssertionError), SchemaError for a missing
  kernel_size (KeyError), ShapeError for per-axis values that disagree on the number of axes (NumPy's
  ValueError) and for crop's checks (AssertionError), GraphError for tops that do not meet (RuntimeError).
"""

from __future__ import annotations

import numpy as np

from caffejax.errors import CaffejaxError, GraphError, SchemaError, ShapeError, UnsupportedError
from caffejax.net_spec import Top, layers as L

# Layers whose output coordinate i is input coordinate i (pycaffe's list).
PASS_THROUGH_LAYERS = ["AbsVal", "BatchNorm", "Bias", "BNLL", "Dropout", "Eltwise", "ELU", "Log", "LRN", "Exp",
                       "MVN", "Power", "ReLU", "PReLU", "Scale", "Sigmoid", "Split", "TanH", "Threshold"]


class UndefinedMapException(CaffejaxError):
    """A layer without a coordinate map (an InnerProduct, a Concat of differently placed inputs...)."""


class AxisMismatchException(CaffejaxError):
    """Two maps along a path start at different axes."""


LEGACY_SPATIAL_KEYS = {"pad_h", "pad_w", "kernel_h", "kernel_w", "stride_h", "stride_w"}


def _spatial_message(fn) -> dict:
    """The keyword arguments holding a layer's kernel: its own parameter message given as a dict, else the
    top-level ones (pycaffe read only ``convolution_param``; a Pooling's is ``pooling_param``)."""
    key = "pooling_param" if fn.type_name == "Pooling" else "convolution_param"
    return fn.params.get(key, fn.params)


def conv_params(fn) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """(axis, stride, extent of the dilated kernel, pad) of a Convolution, Deconvolution, Im2col or Pooling,
    from its ``convolution_param`` (or ``pooling_param``) or its top-level keyword arguments.

    A global pooling has no map (:class:`UndefinedMapException`); legacy ``kernel_h``-style fields anywhere in
    the arguments and a missing kernel_size are errors, as pycaffe stopped there too (assert, KeyError):
    skipping such a layer would let the walk report a wrong or a misleading answer."""
    params = _spatial_message(fn)
    legacy = LEGACY_SPATIAL_KEYS & (set(params) | set(fn.params))
    if legacy:
        raise UnsupportedError(f"{fn.type_name}: coordinate maps take kernel_size/stride/pad, not the legacy "
                               f"{sorted(legacy)}")
    if params.get("global_pooling", False):
        raise UndefinedMapException(f"a global {fn.type_name} has no coordinate map")
    if "kernel_size" not in params:
        raise SchemaError(f"{fn.type_name} without kernel_size: no coordinate map can be computed")
    spatial = {name: np.array(params.get(name, default), ndmin=1)
               for name, default in (("kernel_size", None), ("stride", 1), ("pad", 0), ("dilation", 1))}
    _check_axis_counts(f"{fn.type_name}'s kernel_size/stride/pad/dilation", spatial.values())
    extent = (spatial["kernel_size"] - 1) * spatial["dilation"] + 1
    return params.get("axis", 1), spatial["stride"], extent, spatial["pad"]


def _check_axis_counts(what: str, values) -> None:
    """Values given per spatial axis must agree on how many axes there are (one value applies to all); pycaffe
    failed on a mismatch with NumPy's bare broadcast ValueError."""
    counts = sorted({np.size(v) for v in values} - {1})
    if len(counts) > 1:
        raise ShapeError(f"{what} give different numbers of spatial axes: {counts}")


def crop_params(fn) -> tuple[int, np.ndarray]:
    """(axis, offset) of a Crop, with Caffe's defaults (axis 2: the spatial axes of N x C x H x W)."""
    params = fn.params.get("crop_param", fn.params)
    return params.get("axis", 2), np.array(params.get("offset", 0), ndmin=1)


def coord_map(fn) -> tuple:
    """The (axis, scale, shift) of one layer, output coordinates in terms of its input's; raises
    :class:`UndefinedMapException` for a layer that has none."""
    if fn.type_name in ("Convolution", "Pooling", "Im2col"):
        axis, stride, extent, pad = conv_params(fn)
        return axis, 1 / stride, (pad - (extent - 1) / 2) / stride
    if fn.type_name == "Deconvolution":
        axis, stride, extent, pad = conv_params(fn)
        return axis, stride, (extent - 1) / 2 - pad
    if fn.type_name in PASS_THROUGH_LAYERS:
        return None, 1, 0
    if fn.type_name == "Crop":
        axis, offset = crop_params(fn)
        return axis - 1, 1, -offset  # the map's axis is the last one the crop leaves alone
    raise UndefinedMapException(f"no coordinate map for a {fn.type_name} layer")


def compose(base_map: tuple, next_map: tuple) -> tuple:
    """``base_map`` followed by ``next_map``: the scales multiply, the further shift is scaled by the first."""
    ax1, a1, b1 = base_map
    ax2, a2, b2 = next_map
    _check_axis_counts("the maps along the path", (a1, b1, a2, b2))
    if ax1 is None:
        ax = ax2
    elif ax2 is None or ax1 == ax2:
        ax = ax1
    else:
        raise AxisMismatchException(f"coordinate maps along axes {ax1} and {ax2} do not compose")
    return ax, a1 * a2, a1 * b2 + b1


def inverse(mapping: tuple) -> tuple:
    """The map back: de-scaled and un-shifted."""
    ax, a, b = mapping
    return ax, 1 / a, -b / a


def _mapped_bottoms(top: Top) -> tuple:
    """The bottoms a walk back from ``top`` follows: all of them, but only a Crop's first (the second only
    gives the size)."""
    bottoms = top.fn.inputs
    return bottoms[:1] if top.fn.type_name == "Crop" else bottoms


def _walk_back(start: Top):
    """Every top reachable backwards from ``start`` through mapped layers, with the map from it to ``start``,
    depth first. Each top is visited once, with the map of the first path that reaches it (pycaffe's walk gave
    one of the paths' maps too, which one depending on its set's order); following every path took time
    exponential in the number of residual blocks (Eltwise(x, f(x))) above the tops."""
    maps, frontier = {start: (None, 1, 0)}, [start]
    while frontier:
        top = frontier.pop()
        yield top, maps[top]
        try:
            step = coord_map(top.fn)
        except UndefinedMapException:
            continue
        for bottom in _mapped_bottoms(top):
            mapped = compose(maps[top], step)  # on every edge, as pycaffe: maps that do not compose raise
            if bottom not in maps:
                maps[bottom] = mapped
                frontier.append(bottom)


def coord_map_from_to(top_from: Top, top_to: Top) -> tuple:
    """The map from ``top_from``'s coordinates to ``top_to``'s, through their nearest common ancestor."""
    from_maps = dict(_walk_back(top_from))
    for top, to_map in _walk_back(top_to):
        if top in from_maps:
            return compose(to_map, inverse(from_maps[top]))
    raise GraphError("no coordinate map between the two tops: they do not meet through spatial layers")


def crop(top_from: Top, top_to: Top) -> Top:
    """A Crop layer cutting ``top_from`` to ``top_to``'s coordinates: its axis and offsets from the map
    between them, which must be a pure shift by whole, non-negative offsets."""
    ax, a, b = coord_map_from_to(top_from, top_to)
    if ax is None:
        raise GraphError("crop: no spatial layer lies between the two tops; they share coordinates already")
    a, b = np.asarray(a, float), np.asarray(b, float)
    if not (a == 1).all():
        raise ShapeError(f"crop: the two tops are at different scales (scale {a}); crop needs 1")
    if not (b <= 0).all():
        raise ShapeError(f"crop: {top_from} would need a negative offset (shift {b}); it is smaller than the target")
    if not (np.round(b) == b).all():
        raise ShapeError(f"crop: the offsets are not whole (shift {b})")
    return L.Crop(top_from, top_to, crop_param=dict(axis=ax + 1, offset=list(-np.round(b).astype(int))))
