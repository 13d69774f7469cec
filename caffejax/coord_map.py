"""pycaffe's ``caffe.coord_map``: how a NetSpec top's spatial coordinates map onto another's, and ``crop``,
which spells the Crop layer that aligns them (FCN's net definitions: ``n.score = crop(n.upscore, n.data)``).

A layer's map is (axis, scale a, shift b): output coordinate i corresponds to input coordinate a * i + b along
every spatial axis from ``axis`` on (axis None: any; the map of a point-wise layer is (None, 1, 0)). Maps
compose along a path of layers and invert for the way back; ``coord_map_from_to`` walks back from both tops
to a common ancestor. The arithmetic is pycaffe's, element-wise over the spatial axes (NumPy arrays).
"""

from __future__ import annotations

import numpy as np

from caffejax.errors import CaffejaxError, GraphError, ShapeError
from caffejax.net_spec import Top, layers as L

# Layers whose output coordinate i is input coordinate i (pycaffe's list).
PASS_THROUGH_LAYERS = ["AbsVal", "BatchNorm", "Bias", "BNLL", "Dropout", "Eltwise", "ELU", "Log", "LRN", "Exp",
                       "MVN", "Power", "ReLU", "PReLU", "Scale", "Sigmoid", "Split", "TanH", "Threshold"]


class UndefinedMapException(CaffejaxError):
    """A layer without a coordinate map (an InnerProduct, a Concat of differently placed inputs...)."""


class AxisMismatchException(CaffejaxError):
    """Two maps along a path start at different axes."""


def conv_params(fn) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """(axis, stride, extent of the dilated kernel, pad) of a Convolution, Deconvolution, Im2col or Pooling,
    from its ``convolution_param`` (or ``pooling_param``) or its top-level keyword arguments."""
    params = fn.params.get("convolution_param", fn.params.get("pooling_param", fn.params))
    legacy = {"pad_h", "pad_w", "kernel_h", "kernel_w", "stride_h", "stride_w"} & set(params)
    if legacy:
        raise UndefinedMapException(f"{fn.type_name}: coordinate maps take kernel_size/stride/pad, not the "
                                    f"legacy {sorted(legacy)}")
    if "kernel_size" not in params:
        raise UndefinedMapException(f"{fn.type_name} without kernel_size has no coordinate map here")
    kernel = np.array(params["kernel_size"], ndmin=1)
    dilation = np.array(params.get("dilation", 1), ndmin=1)
    return (params.get("axis", 1), np.array(params.get("stride", 1), ndmin=1), (kernel - 1) * dilation + 1,
            np.array(params.get("pad", 0), ndmin=1))


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
    in the order they are reached (pycaffe's walk, without its set's arbitrary order)."""
    maps, frontier = {start: (None, 1, 0)}, [start]
    while frontier:
        top = frontier.pop()
        yield top, maps[top]
        try:
            step = coord_map(top.fn)
        except UndefinedMapException:
            continue
        for bottom in _mapped_bottoms(top):
            maps[bottom] = compose(maps[top], step)
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
