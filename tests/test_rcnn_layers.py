"""The R-CNN forks' layers: ROIPooling (caffe-fast-rcnn's roi_pooling_layer.cpp) and SmoothL1Loss (py-faster-rcnn's,
Fast R-CNN's and SSD's smooth_L1_loss_layer.cpp), against loop transcriptions of their Forward_cpu/Backward_cpu
and against OpenCV's reading of ROIPooling; a Fast R-CNN test net fed its ROIs as fast-rcnn's test.py does."""

from __future__ import annotations

import functools
import importlib
import logging
import math
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import caffejax
from caffejax.errors import CaffejaxError, ShapeError
from caffejax.export import export_stablehlo
from caffejax.frontend.prototxt import parse_net_text
from caffejax.lower import forks
from caffejax.proto import caffe_pb2
from conftest import input_layer

FLT_MAX = np.finfo(np.float32).max


def _c_round(v: np.float32) -> int:
    """C's round(): halves away from zero."""
    v = float(v)
    return int(math.copysign(math.floor(abs(v) + 0.5), v)) if abs(v) % 1 != 0.5 else int(v + math.copysign(0.5, v))


def _roi_pooling_loops(x: np.ndarray, rois: np.ndarray, pooled_h: int, pooled_w: int, scale: float):
    """ROIPoolingLayer::Forward_cpu, loop for loop in float32: the top and the argmax (-1: none)."""
    n, channels, height, width = x.shape
    rois = rois.reshape(-1, 5).astype(np.float32)
    top = np.full((len(rois), channels, pooled_h, pooled_w), -FLT_MAX, np.float32)
    argmax = np.full(top.shape, -1, np.int64)
    for r, roi in enumerate(rois):
        image = int(roi[0])
        start_w, start_h, end_w, end_h = (_c_round(roi[i] * np.float32(scale)) for i in (1, 2, 3, 4))
        bin_h = np.float32(max(end_h - start_h + 1, 1)) / np.float32(pooled_h)
        bin_w = np.float32(max(end_w - start_w + 1, 1)) / np.float32(pooled_w)
        for c in range(channels):
            for ph in range(pooled_h):
                for pw in range(pooled_w):
                    hstart = min(max(int(np.floor(np.float32(ph) * bin_h)) + start_h, 0), height)
                    hend = min(max(int(np.ceil(np.float32(ph + 1) * bin_h)) + start_h, 0), height)
                    wstart = min(max(int(np.floor(np.float32(pw) * bin_w)) + start_w, 0), width)
                    wend = min(max(int(np.ceil(np.float32(pw + 1) * bin_w)) + start_w, 0), width)
                    if hend <= hstart or wend <= wstart:
                        top[r, c, ph, pw] = 0
                    for h in range(hstart, hend):
                        for w in range(wstart, wend):
                            if x[image, c, h, w] > top[r, c, ph, pw]:
                                top[r, c, ph, pw] = x[image, c, h, w]
                                argmax[r, c, ph, pw] = h * width + w
    return top, argmax


def _roi_pooling_backward_loops(shape, rois: np.ndarray, argmax: np.ndarray, dtop: np.ndarray) -> np.ndarray:
    """Backward_cpu: each top diff added at its argmax (summed in float64 here)."""
    dx = np.zeros(shape, np.float64)
    width = shape[3]
    for r, roi in enumerate(rois.reshape(-1, 5)):
        for (c, ph, pw), at in np.ndenumerate(argmax[r]):
            if at >= 0:
                dx[int(roi[0]), c, at // width, at % width] += dtop[r, c, ph, pw]
    return dx


def _random_rois(rng, count: int, images: int, size: float) -> np.ndarray:
    corner = rng.uniform(-0.2 * size, size, (count, 2))
    rois = np.column_stack([rng.integers(0, images, count), corner, corner + rng.uniform(-2, size, (count, 2))])
    rois[::4, 1:] = np.round(rois[::4, 1:] * 2) / 2  # halves, where C's round and NumPy's differ
    return rois.astype(np.float32)


def _roi_net(images: int, channels: int, height: int, width: int, rois: int, param: str) -> str:
    return (input_layer(images, channels, height, width, name="data") + input_layer(rois, 5, name="rois")
            + 'layer { name: "roi" type: "ROIPooling" bottom: "data" bottom: "rois" top: "pool" '
              f'roi_pooling_param {{ {param} }} }}\n')


def test_roi_pooling_gives_caffes_loops_forward_and_backward():
    """Random maps (integers: ties; NaN and -inf, which Caffe's strict > never takes), ROIs inside, across and
    outside the map, inverted and tiny (forced to 1 x 1), halves (C's round), bins empty after clipping (0)."""
    rng = np.random.default_rng(0)

    @functools.partial(jax.jit, static_argnums=(2, 3))
    def forward_backward(x, rois, pooled, scale, dtop):
        top, pull = jax.vjp(lambda v: forks._roi_pool(v, rois, pooled, scale), x)
        return top, pull(dtop)[0]

    for case in range(16):
        shape = (2, 3, 13, 19) if case % 2 else (2, 2, 19, 7)  # two shapes, few compiles
        x = (rng.integers(-3, 4, shape) if case % 4 < 2 else rng.standard_normal(shape)).astype(np.float32)
        if case % 3 == 0:
            x[:, 0, 0, 0], x[:, -1, -1, -1] = np.nan, -np.inf
        scale = float(np.float32([1, 0.5, 1 / 16, 0.3][case % 4]))
        pooled = [(7, 7), (3, 2), (1, 1), (2, 5)][case // 4]
        rois = _random_rois(rng, 12, 2, max(shape[2:]) / scale)
        want, argmax = _roi_pooling_loops(x, rois, *pooled, scale)
        dtop = rng.standard_normal(want.shape).astype(np.float32)
        top, dx = forward_backward(x, rois, pooled, scale, dtop)
        np.testing.assert_array_equal(np.asarray(top), want, err_msg=f"case {case}")
        np.testing.assert_allclose(np.asarray(dx), _roi_pooling_backward_loops(x.shape, rois, argmax, dtop),
                                   rtol=1e-5, atol=1e-5, err_msg=f"case {case}")


def test_roi_pooling_bin_edges_use_exact_division():
    """A 14-row ROI in 6 bins: 14 / 6 is 2.3333333 in float32 and bin 2 ends at ceil(3 x 2.3333333) = 7. XLA turns
    a division by a broadcast into a multiply by the reciprocal, 2.3333335, whose bin ends at 8."""
    x = np.arange(2 * 1 * 20 * 3, dtype=np.float32).reshape(2, 1, 20, 3)
    rois = np.float32([[0, 0, 0, 0, 13], [1, 0, 0, 0, 13]])  # two ROIs: a vector division
    want, _ = _roi_pooling_loops(x, rois, 6, 1, 1.0)
    got = jax.jit(lambda v, r: forks._roi_pool(v, r, (6, 1), 1.0))(x, rois)
    np.testing.assert_array_equal(np.asarray(got), want)
    assert want[0, 0, 2, 0] == x[0, 0, 6, 0]  # rows 2..6 of bin 2: its maximum is row 6, not row 7


def test_roi_pooling_matches_opencv(isolated_registry, tmp_path):
    cv2 = pytest.importorskip("cv2")
    forks.register_roi_pooling()
    rng = np.random.default_rng(1)
    for case, (param, scale) in enumerate([("pooled_h: 7 pooled_w: 7 spatial_scale: 0.0625", 1 / 16),
                                           ("pooled_h: 3 pooled_w: 2 spatial_scale: 0.5", 0.5),
                                           ("pooled_h: 6 pooled_w: 6", 1.0), ("pooled_h: 2 pooled_w: 5 "
                                                                             "spatial_scale: 0.3", 0.3)]):
        text = _roi_net(2, 5, 19, 23, 40, param)
        path = tmp_path / f"roi{case}.prototxt"
        path.write_text(text)
        x = rng.standard_normal((2, 5, 19, 23)).astype(np.float32)
        x = np.maximum(x, 0) if case % 2 else x  # ReLU's zeros: ties
        rois = _random_rois(rng, 40, 2, 23 / scale)
        got = caffejax.Net(text, caffejax.TEST).forward(data=x, rois=rois)["pool"]
        reference = cv2.dnn.readNetFromCaffe(str(path))
        reference.setInput(x, "data")
        reference.setInput(rois, "rois")
        np.testing.assert_array_equal(got, reference.forward("roi"), err_msg=param)


FAST_RCNN_TEST = """name: "FastRCNN-small"
input: "data"
input_shape { dim: 1 dim: 3 dim: 32 dim: 32 }
input: "rois"
input_shape {
  dim: 1 # to be changed on-the-fly to num ROIs
  dim: 5 # [batch ind, x1, y1, x2, y2] zero-based indexing
}
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 8 kernel_size: 3 stride: 2 pad: 1 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "roi_pool5" type: "ROIPooling" bottom: "conv1" bottom: "rois" top: "pool5"
  roi_pooling_param { pooled_w: 3 pooled_h: 3 spatial_scale: 0.5 } }
layer { name: "fc6" type: "InnerProduct" bottom: "pool5" top: "fc6"
  inner_product_param { num_output: 16 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "relu6" type: "ReLU" bottom: "fc6" top: "fc6" }
layer { name: "cls_score" type: "InnerProduct" bottom: "fc6" top: "cls_score"
  inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "bbox_pred" type: "InnerProduct" bottom: "fc6" top: "bbox_pred"
  inner_product_param { num_output: 16 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "cls_prob" type: "Softmax" bottom: "cls_score" top: "cls_prob" }
"""


def test_fast_rcnn_test_net_takes_a_new_number_of_rois_each_image(isolated_registry):
    """fast-rcnn's test.py: reshape data and rois to the image's blobs, then forward(data=..., rois=...); each
    ROI's scores are those of a net given that ROI alone, and compile_inference gives the same."""
    forks.register_roi_pooling()
    net = caffejax.Net(FAST_RCNN_TEST, caffejax.TEST)
    rng = np.random.default_rng(2)
    per_roi = None
    for count in (5, 3):
        image = rng.standard_normal((1, 3, 32, 32)).astype(np.float32)
        rois = _random_rois(rng, count, 1, 32)
        net.blobs["data"].reshape(*image.shape)
        net.blobs["rois"].reshape(*rois.shape)
        out = net.forward(data=image, rois=rois)
        assert out["cls_prob"].shape == (count, 4) and net.blobs["bbox_pred"].data.shape == (count, 16)
        scores = out["cls_prob"].copy()
        infer = caffejax.compile_inference(net)
        np.testing.assert_allclose(np.asarray(infer({"data": image, "rois": rois})["cls_prob"]), scores, rtol=1e-5, atol=1e-6)
        net.blobs["rois"].reshape(1, 5)
        per_roi = [net.forward(data=image, rois=rois[i:i + 1])["cls_prob"][0].copy() for i in range(count)]
        np.testing.assert_allclose(scores, per_roi, rtol=1e-5, atol=1e-6)


def test_roi_pooling_in_a_trained_net_sends_no_gradient_to_the_rois(isolated_registry):
    """force_backward reaches the ROIs (ROIPooling allows it), but Backward writes only the map's diff; the map's
    diff is the loops' routing of the top diff."""
    forks.register_roi_pooling()
    text = ("force_backward: true\n" + _roi_net(1, 2, 9, 11, 4, "pooled_h: 2 pooled_w: 3 spatial_scale: 0.5"))
    net = caffejax.Net(text, caffejax.TRAIN)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 2, 9, 11)).astype(np.float32)
    rois = _random_rois(rng, 4, 1, 22)
    net.forward(data=x, rois=rois)
    dtop = rng.standard_normal((4, 2, 2, 3)).astype(np.float32)
    net.blobs["pool"].diff[...] = dtop
    net.backward()
    _, argmax = _roi_pooling_loops(x, rois, 2, 3, 0.5)
    np.testing.assert_allclose(net.blobs["data"].diff, _roi_pooling_backward_loops(x.shape, rois, argmax, dtop),
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(net.blobs["rois"].diff, 0)


def test_roi_pooling_errors_name_the_layer(isolated_registry):
    forks.register_roi_pooling()
    with pytest.raises(ShapeError, match=r"roi.*pooled_h and pooled_w must be > 0"):
        caffejax.Net(_roi_net(1, 2, 8, 8, 3, "pooled_w: 2"), caffejax.TEST)
    with pytest.raises(ShapeError, match=r"roi.*C x H x W must be 5.*\(3, 4\)"):
        caffejax.Net(input_layer(1, 2, 8, 8, name="data") + input_layer(3, 4, name="rois")
                     + 'layer { name: "roi" type: "ROIPooling" bottom: "data" bottom: "rois" top: "pool" '
                       'roi_pooling_param { pooled_h: 2 pooled_w: 2 } }\n', caffejax.TEST)
    with pytest.raises(CaffejaxError, match=r"roi.*ROIPooling.*bottom"):
        caffejax.Net(input_layer(1, 2, 8, 8, name="data")
                     + 'layer { name: "roi" type: "ROIPooling" bottom: "data" top: "pool" '
                       'roi_pooling_param { pooled_h: 2 pooled_w: 2 } }\n', caffejax.TEST)


def test_roi_of_an_image_outside_the_batch_gives_nan_rows(isolated_registry):
    """Caffe stops at CHECK_LT(roi_batch_ind, batch_size); a compiled program cannot, so that ROI's rows are NaN
    (as an out-of-range Embed index is) and the others are unaffected."""
    forks.register_roi_pooling()
    net = caffejax.Net(_roi_net(2, 1, 6, 6, 3, "pooled_h: 2 pooled_w: 2"), caffejax.TEST)
    x = np.arange(72, dtype=np.float32).reshape(2, 1, 6, 6)
    top = net.forward(data=x, rois=np.float32([[0, 0, 0, 5, 5], [2, 0, 0, 5, 5], [-1, 0, 0, 5, 5]]))["pool"]
    np.testing.assert_array_equal(top[0, 0], [[14, 17], [32, 35]])
    assert np.isnan(top[1:]).all()


# ---- PSROIPooling --------------------------------------------------------------------------------------------------

def _psroi_edges(first: float, last: float, index: int, group: int, scale: np.float32) -> tuple[int, int]:
    """Forward_cpu's [start, end) of bin ``index`` along one axis, before clipping, in float32 (no fused
    multiply-add: NumPy rounds each product)."""
    f32 = np.float32
    start = f32(_c_round(first)) * scale
    end = f32(_c_round(last) + 1.0) * scale
    size = max(f32(end - start), f32(0.1)) / f32(group)
    return int(math.floor(f32(f32(index) * size) + start)), int(math.ceil(f32(f32(index + 1) * size) + start))


def _psroi_pooling_loops(x: np.ndarray, rois: np.ndarray, output_dim: int, group: int, scale: float):
    """R-FCN's PSROIPoolingForward_cpu, loop by loop (float32 sums in its order), and Backward_gpu's spread of
    each top diff (``dtop``) over its bin."""
    n, channels, height, width = x.shape
    scale = np.float32(scale)
    top = np.zeros((len(rois), output_dim, group, group), np.float32)
    bins = []
    for r, roi in enumerate(rois):
        image = int(roi[0])
        for d in range(output_dim):
            for i in range(group):
                for j in range(group):
                    h0, h1 = _psroi_edges(roi[2], roi[4], i, group, scale)
                    w0, w1 = _psroi_edges(roi[1], roi[3], j, group, scale)
                    h0, h1, w0, w1 = (min(max(v, 0), size) for v, size in
                                      ((h0, height), (h1, height), (w0, width), (w1, width)))
                    c = (d * group + i) * group + j
                    total = np.float32(0)
                    for h in range(h0, h1):
                        for w in range(w0, w1):
                            total = np.float32(total + x[image, c, h, w])
                    area = (h1 - h0) * (w1 - w0)
                    top[r, d, i, j] = 0 if h1 <= h0 or w1 <= w0 else total / np.float32(area)
                    bins.append((r, d, i, j, image, c, h0, h1, w0, w1, area))
    return top, bins


def _psroi_backward_loops(shape, bins, dtop: np.ndarray) -> np.ndarray:
    dx = np.zeros(shape, np.float32)
    for r, d, i, j, image, c, h0, h1, w0, w1, area in bins:
        if h1 > h0 and w1 > w0:
            dx[image, c, h0:h1, w0:w1] += dtop[r, d, i, j] / np.float32(area)
    return dx


def _fused_edges_differ(first: float, last: float, group: int, scale: np.float32) -> bool:
    """Whether a fused multiply-add (one rounding of index * size + start) moves a bin edge of this ROI."""
    f32 = np.float32
    start = f32(_c_round(first)) * scale
    size = max(f32(f32(_c_round(last) + 1.0) * scale - start), f32(0.1)) / f32(group)
    for index in range(group + 1):
        fused = f32(np.float64(index) * np.float64(size) + np.float64(start))
        separate = f32(f32(index) * size) + start
        if math.floor(fused) != math.floor(separate) or math.ceil(fused) != math.ceil(separate):
            return True
    return False


def test_psroi_pooling_gives_r_fcns_loops_forward_and_backward():
    """Random maps, ROIs inside, across and outside the map, inverted and tiny (0.1 wide), halves (C's round),
    scales whose products round, and ROIs where a fused multiply-add would move a bin edge (XLA:CPU fuses a
    multiply feeding an add; Caffe's CPU build rounds the product first)."""
    rng = np.random.default_rng(3)

    @functools.partial(jax.jit, static_argnums=(2, 3, 4))
    def forward_backward(x, rois, output_dim, group, scale, dtop):
        top, pull = jax.vjp(lambda v: forks._psroi_pool(v, rois, output_dim, group, scale), x)
        return top, pull(dtop)[0]

    for case, (output_dim, group, scale) in enumerate([(2, 3, 0.5), (1, 7, 1 / 16), (2, 5, 0.3), (2, 3, 1 / 3)]):
        shape = (2, output_dim * group * group) + ((11, 14) if case % 2 else (14, 11))  # each axis first
        x = rng.standard_normal(shape).astype(np.float32)
        scale = float(np.float32(scale))
        rois = _random_rois(rng, 10, 2, max(shape[2:]) / scale)
        candidates = _random_rois(rng, 2000, 2, max(shape[2:]) / scale)  # ~1% of them move an edge when fused
        found = [roi for roi in candidates if _fused_edges_differ(roi[2], roi[4], group, np.float32(scale))][:3]
        assert len(found) == 3
        rois = np.concatenate([rois, np.stack(found)])
        want, bins = _psroi_pooling_loops(x, rois, output_dim, group, scale)
        dtop = rng.standard_normal(want.shape).astype(np.float32)
        top, dx = forward_backward(x, rois, output_dim, group, scale, dtop)
        np.testing.assert_allclose(np.asarray(top), want, rtol=1e-5, atol=1e-6, err_msg=f"case {case}")
        np.testing.assert_allclose(np.asarray(dx), _psroi_backward_loops(shape, bins, dtop), rtol=1e-5,
                                   atol=1e-6, err_msg=f"case {case}")
        # The same bins: the mean of a map of ones is 1 in every bin with places, 0 in the empty ones.
        ones = np.asarray(forks._psroi_pool(np.ones(shape, np.float32), rois, output_dim, group, scale))
        np.testing.assert_array_equal(ones, (want != 0) | (_psroi_pooling_loops(
            np.ones(shape, np.float32), rois, output_dim, group, scale)[0] == 1), err_msg=f"case {case}")


def test_psroi_pooling_reads_no_value_outside_a_bin():
    """NaN and infinities outside a bin leave it alone (a masked sum would spread them); inside, the bin gets
    what Caffe's float sum gives: NaN for a NaN or both infinities, else the infinity."""
    x = np.ones((1, 4, 6, 6), np.float32)  # output_dim 1, 2 x 2 groups
    x[0, 0, 5, 5] = np.nan  # channel 0 is bin (0, 0)'s, which the ROI keeps to rows and columns 0..2
    x[0, 1, 0, 0] = np.inf  # bin (0, 1) reads columns 3..5 of channel 1
    x[0, 2, 4, 1], x[0, 2, 5, 0] = np.inf, np.nan  # bin (1, 0): rows 3..5, columns 0..2
    x[0, 3, 4, 4], x[0, 3, 5, 5] = np.inf, -np.inf  # bin (1, 1)
    top = np.asarray(forks._psroi_pool(x, np.float32([[0, 0, 0, 5, 5]]), 1, 2, 1.0))
    np.testing.assert_array_equal(top[0, 0], [[1, 1], [np.nan, np.nan]])
    x[0, 2, 5, 0] = 1
    top = np.asarray(forks._psroi_pool(x, np.float32([[0, 0, 0, 5, 5]]), 1, 2, 1.0))
    np.testing.assert_array_equal(top[0, 0], [[1, 1], [np.inf, np.nan]])


def _psroi_net(images: int, channels: int, height: int, width: int, rois: int, param: str) -> str:
    return (input_layer(images, channels, height, width, name="data") + input_layer(rois, 5, name="rois")
            + 'layer { name: "psroi" type: "PSROIPooling" bottom: "data" bottom: "rois" top: "pool" '
              f'psroi_pooling_param {{ {param} }} }}\n')


def test_psroi_pooling_matches_opencv(isolated_registry, tmp_path):
    """OpenCV 4.x reads R-FCN's PSROIPooling (its psroi_pooling_param, by name in the prototxt)."""
    cv2 = pytest.importorskip("cv2")
    forks.register_psroi_pooling()
    rng = np.random.default_rng(4)
    for case, (output_dim, group, scale) in enumerate([(21, 7, 1 / 16), (2, 3, 0.5), (8, 7, 0.0625)]):
        param = f"spatial_scale: {scale} output_dim: {output_dim} group_size: {group}"
        text = _psroi_net(1, output_dim * group * group, 19, 23, 30, param)
        path = tmp_path / f"psroi{case}.prototxt"
        path.write_text(text)
        x = rng.standard_normal((1, output_dim * group * group, 19, 23)).astype(np.float32)
        rois = _random_rois(rng, 30, 1, 23 / scale)
        rois[:, 1:] = np.abs(rois[:, 1:])  # OpenCV rounds x + 1 where Caffe adds 1 to round(x): the same above 0
        got = caffejax.Net(text, caffejax.TEST).forward(data=x, rois=rois)["pool"]
        reference = cv2.dnn.readNetFromCaffe(str(path))
        reference.setInput(x, "data")
        reference.setInput(rois, "rois")
        np.testing.assert_allclose(got, reference.forward("psroi"), rtol=1e-5, atol=1e-6, err_msg=param)


def test_psroi_pooling_errors_name_the_layer(isolated_registry):
    forks.register_psroi_pooling()
    with pytest.raises(ShapeError, match=r"layer 'psroi' \(type PSROIPooling\): input channel number does not "
                                         r"match layer parameters: bottom 0 has 18 channels, output_dim x "
                                         r"group_size\^2 = 3 x 3\^2 = 27"):
        caffejax.Net(_psroi_net(1, 18, 8, 8, 2, "spatial_scale: 1 output_dim: 3 group_size: 3"), caffejax.TEST)
    with pytest.raises(CaffejaxError, match=r"layer 'psroi' \(type PSROIPooling\): psroi_pooling_param needs "
                                            r"group_size \(required"):
        caffejax.Net(_psroi_net(1, 18, 8, 8, 2, "spatial_scale: 1 output_dim: 2"), caffejax.TEST)
    with pytest.raises(CaffejaxError, match=r"output_dim and group_size must be > 0"):
        caffejax.Net(_psroi_net(1, 18, 8, 8, 2, "spatial_scale: 1 output_dim: 0 group_size: 3"), caffejax.TEST)


# ---- SmoothL1Loss ------------------------------------------------------------------------------------------------

def _smooth_l1_loops(diff: np.ndarray, sigma2: float) -> np.ndarray:
    size = np.abs(diff.astype(np.float64))
    return np.where(size < 1.0 / sigma2, 0.5 * diff * diff * sigma2, size - 0.5 / sigma2)


def _smooth_l1_slope(diff: np.ndarray, sigma2: float) -> np.ndarray:
    return np.where(np.abs(diff) < 1.0 / sigma2, sigma2 * diff, np.sign(diff))


def _loss_net(bottoms: int, param: str = "", extra: str = "") -> str:
    names = ["pred", "target", "w_in", "w_out"][:bottoms]
    return (extra + "".join(input_layer(3, 8, name=name) for name in names)
            + 'layer { name: "loss" type: "SmoothL1Loss" ' + " ".join(f'bottom: "{n}"' for n in names)
            + f' top: "loss" {param} }}\n')


@pytest.mark.parametrize("bottoms,sigma", [(2, 1.0), (2, 3.0), (4, 3.0), (4, 1.0), (3, 1.0)])
def test_smooth_l1_loss_matches_each_forks_loops(isolated_registry, bottoms, sigma):
    """2 bottoms: Σ f(a - b) / num; py-faster-rcnn's 4: Σ w_out f(w_in (a - b)) / num, its gradient times both
    weights; Fast R-CNN's and SSD's 3: Σ f(w (a - b)) / num, its gradient f'(w (a - b)) without the w. No diff
    reaches the weights; the loss's weight is 1 unless given (a LossLayer)."""
    forks.register_smooth_l1_loss()
    param = f"smooth_l1_loss_param {{ sigma: {sigma} }}" if sigma != 1 else ""
    net = caffejax.Net("force_backward: true\n" + _loss_net(bottoms, param), caffejax.TRAIN)
    rng = np.random.default_rng(4)
    a, b = (rng.standard_normal((3, 8)).astype(np.float32) * 2 for _ in range(2))
    w_in, w_out = rng.uniform(0, 2, (2, 3, 8)).astype(np.float32)
    feed = dict(zip(["pred", "target", "w_in", "w_out"], [a, b, w_in, w_out][:bottoms]))
    loss = net.forward(**feed)["loss"]
    sigma2 = float(np.float32(sigma) ** 2)
    diff = (a - b) * (w_in if bottoms > 2 else 1)
    errors = _smooth_l1_loops(diff, sigma2) * (w_out if bottoms == 4 else 1)
    np.testing.assert_allclose(loss, errors.sum() / 3, rtol=1e-5)
    net.backward()
    slope = _smooth_l1_slope(diff, sigma2) / 3 * (w_in * w_out if bottoms == 4 else 1)
    np.testing.assert_allclose(net.blobs["pred"].diff, slope, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(net.blobs["target"].diff, 0)  # a label: force_backward does not reach it
    for name in ("w_in", "w_out")[:bottoms - 2]:
        np.testing.assert_array_equal(net.blobs[name].diff, 0)


def test_smooth_l1_loss_errors_name_the_layer(isolated_registry):
    forks.register_smooth_l1_loss()
    with pytest.raises(ShapeError, match=r"loss.*sigma 3.*3 bottoms"):
        caffejax.Net(_loss_net(3, "smooth_l1_loss_param { sigma: 3 }"), caffejax.TRAIN)
    mismatched = (input_layer(3, 8, name="pred") + input_layer(3, 4, name="target")
                  + 'layer { name: "loss" type: "SmoothL1Loss" bottom: "pred" bottom: "target" top: "loss" }\n')
    with pytest.raises(ShapeError, match=r"loss.*bottom 1 \(3, 4\) must have bottom 0's shape \(3, 8\)"):
        caffejax.Net(mismatched, caffejax.TRAIN)


# ---- Proposal, and a net run in stages around it ------------------------------------------------------------------

FASTER_RCNN_TEST = """name: "FasterRCNN-small"
input: "data"
input_shape { dim: 1 dim: 3 dim: 64 dim: 80 }
input: "im_info"
input_shape { dim: 1 dim: 3 }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 8 kernel_size: 3 stride: 4 pad: 1 weight_filler { type: "gaussian" std: 0.3 }
                      bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "rpn_cls_score" type: "Convolution" bottom: "conv1" top: "rpn_cls_score"
  convolution_param { num_output: 18 kernel_size: 1 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "rpn_bbox_pred" type: "Convolution" bottom: "conv1" top: "rpn_bbox_pred"
  convolution_param { num_output: 36 kernel_size: 1 weight_filler { type: "gaussian" std: 0.05 } } }
layer { bottom: "rpn_cls_score" top: "rpn_cls_score_reshape" name: "rpn_cls_score_reshape" type: "Reshape"
  reshape_param { shape { dim: 0 dim: 2 dim: -1 dim: 0 } } }
layer { name: "rpn_cls_prob" type: "Softmax" bottom: "rpn_cls_score_reshape" top: "rpn_cls_prob" }
layer { name: "rpn_cls_prob_reshape" type: "Reshape" bottom: "rpn_cls_prob" top: "rpn_cls_prob_reshape"
  reshape_param { shape { dim: 0 dim: 18 dim: -1 dim: 0 } } }
layer { name: "proposal" type: "Proposal" bottom: "rpn_cls_prob_reshape" bottom: "rpn_bbox_pred" bottom: "im_info"
  top: "rois" proposal_param { PROPOSAL } }
layer { name: "roi_pool" type: "ROIPooling" bottom: "conv1" bottom: "rois" top: "pool"
  roi_pooling_param { pooled_w: 3 pooled_h: 3 spatial_scale: 0.25 } }
layer { name: "fc" type: "InnerProduct" bottom: "pool" top: "fc"
  inner_product_param { num_output: 16 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "cls_score" type: "InnerProduct" bottom: "fc" top: "cls_score"
  inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "cls_prob" type: "Softmax" bottom: "cls_score" top: "cls_prob" }
"""
SMALL_ANCHORS = ("ratio: 0.5 ratio: 1 ratio: 2 scale: 2 scale: 4 scale: 8 base_size: 4 feat_stride: 4 min_size: 4 "
                 "pre_nms_topn: 200 post_nms_topn: 30")


def _faster_rcnn(proposal: str = SMALL_ANCHORS) -> str:
    forks.register_all()
    return FASTER_RCNN_TEST.replace("PROPOSAL", proposal)


def _image(rng, height: int, width: int) -> dict[str, np.ndarray]:
    return {"data": rng.standard_normal((1, 3, height, width)).astype(np.float32),
            "im_info": np.float32([[height, width, 1.0]])}


def test_faster_rcnn_test_net_matches_opencv(isolated_registry, tmp_path):
    """OpenCV 4.14 runs py-faster-rcnn's nets with the Python ProposalLayer written as its Proposal layer: the
    same ROIs in the same order, and the same class scores, at each image size, for several settings. OpenCV
    drops no small boxes (it ignores min_size), so min_size is 0 here (test_proposals_by_hand covers it), and
    pads the ROIs to post_nms_topn rows of zeros."""
    cv2 = pytest.importorskip("cv2")
    rng = np.random.default_rng(5)
    for proposal in (SMALL_ANCHORS, SMALL_ANCHORS.replace("post_nms_topn: 30", "post_nms_topn: 500 nms_thresh: 0.5"),
                     "ratio: 1 ratio: 2 ratio: 3 scale: 1 scale: 3 scale: 5 base_size: 8 feat_stride: 4 "
                     "pre_nms_topn: 40 post_nms_topn: 25"):
        text = _faster_rcnn(proposal.replace("min_size: 4", "") + " min_size: 0")  # OpenCV has no min_size
        net = caffejax.Net(text, caffejax.TEST)
        (tmp_path / "net.prototxt").write_text(text)
        net.save(str(tmp_path / "net.caffemodel"))
        reference = cv2.dnn.readNetFromCaffe(str(tmp_path / "net.prototxt"), str(tmp_path / "net.caffemodel"))
        for height, width in ((64, 80), (48, 64)):
            feed = _image(rng, height, width)
            net.blobs["data"].reshape(1, 3, height, width)
            scores = net.forward(**feed)["cls_prob"]
            for name, array in feed.items():
                reference.setInput(array, name)
            rois, want = reference.forward(["proposal", "cls_prob"])
            found = len(scores)  # OpenCV pads its rois with zero rows to post_nms_topn; the Python layer does not
            np.testing.assert_array_equal(rois.reshape(-1, 5)[found:], 0)
            np.testing.assert_allclose(net.blobs["rois"].data, rois.reshape(-1, 5)[:found], rtol=1e-5, atol=1e-4,
                                       err_msg=proposal)
            np.testing.assert_allclose(scores, want.reshape(-1, 4)[:found], rtol=1e-4, atol=1e-6, err_msg=proposal)


R_FCN_HEAD = """
layer { name: "rfcn_cls" type: "Convolution" bottom: "conv1" top: "rfcn_cls"
  convolution_param { num_output: 36 kernel_size: 1 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "rfcn_bbox" type: "Convolution" bottom: "conv1" top: "rfcn_bbox"
  convolution_param { num_output: 72 kernel_size: 1 weight_filler { type: "gaussian" std: 0.1 } } }
layer { bottom: "rfcn_cls" bottom: "rois" top: "psroipooled_cls_rois" name: "psroipooled_cls_rois"
  type: "PSROIPooling" psroi_pooling_param { spatial_scale: 0.25 output_dim: 4 group_size: 3 } }
layer { bottom: "psroipooled_cls_rois" top: "cls_score" name: "ave_cls_score_rois" type: "Pooling"
  pooling_param { pool: AVE kernel_size: 3 stride: 3 } }
layer { bottom: "rfcn_bbox" bottom: "rois" top: "psroipooled_loc_rois" name: "psroipooled_loc_rois"
  type: "PSROIPooling" psroi_pooling_param { spatial_scale: 0.25 output_dim: 8 group_size: 3 } }
layer { bottom: "psroipooled_loc_rois" top: "bbox_pred_pre" name: "ave_bbox_pred_rois" type: "Pooling"
  pooling_param { pool: AVE kernel_size: 3 stride: 3 } }
layer { name: "cls_prob_pre" type: "Softmax" bottom: "cls_score" top: "cls_prob_pre" }
layer { name: "cls_prob_reshape" type: "Reshape" bottom: "cls_prob_pre" top: "cls_prob"
  reshape_param { shape { dim: -1 dim: 4 } } }
layer { name: "bbox_pred_reshape" type: "Reshape" bottom: "bbox_pred_pre" top: "bbox_pred"
  reshape_param { shape { dim: -1 dim: 8 } } }
"""


def test_r_fcn_test_net_matches_opencv(isolated_registry, tmp_path):
    """py-R-FCN's class-agnostic test net in small (position-sensitive maps pooled per ROI and averaged): in
    stages around the proposals, the same class probabilities and box deltas as OpenCV 4.x's."""
    cv2 = pytest.importorskip("cv2")
    text = _faster_rcnn(SMALL_ANCHORS.replace("min_size: 4", "min_size: 0"))
    text = text[:text.index('layer { name: "roi_pool"')] + R_FCN_HEAD
    net = caffejax.Net(text, caffejax.TEST)
    (tmp_path / "rfcn.prototxt").write_text(text)
    net.save(str(tmp_path / "rfcn.caffemodel"))
    reference = cv2.dnn.readNetFromCaffe(str(tmp_path / "rfcn.prototxt"), str(tmp_path / "rfcn.caffemodel"))
    rng = np.random.default_rng(9)
    for height, width in ((64, 80), (48, 72)):
        feed = _image(rng, height, width)
        net.blobs["data"].reshape(1, 3, height, width)
        out = net.forward(**feed)
        for name, array in feed.items():
            reference.setInput(array, name)
        probabilities, deltas = reference.forward(["cls_prob_reshape", "bbox_pred_reshape"])  # layer names
        found = len(out["cls_prob"])  # OpenCV pads its ROIs to post_nms_topn with zero rows
        assert found > 5 and out["bbox_pred"].shape == (found, 8)
        np.testing.assert_allclose(out["cls_prob"], probabilities[:found], rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(out["bbox_pred"], deltas[:found], rtol=1e-4, atol=1e-5)


def test_faster_rcnn_test_net_runs_in_stages(isolated_registry):
    """The layers before the proposals are one program, the proposals run on the host, the layers after them
    another program shaped by the ROIs found: a new count or image size compiles once, a repeat none; a forward
    split at the proposals gives the whole forward's scores; im_detect's blobs read as py-faster-rcnn reads them."""
    net = caffejax.Net(_faster_rcnn(SMALL_ANCHORS.replace("post_nms_topn: 30", "post_nms_topn: 0")), caffejax.TEST)
    assert net.graph.staging_layers == [list(net._layer_names).index("proposal")]
    rng = np.random.default_rng(6)
    feed = _image(rng, 64, 80)
    scores = net.forward(**feed)["cls_prob"].copy()
    # Four programs: before and its convolutions' weights prepared, the (empty) host step, after. What a later
    # stage reads, an earlier one hands back (InsertSplits gives each reader its own top), not recomputed by a
    # program over the whole first stage.
    assert net.compile_count == 4
    count = net.blobs["rois"].data.shape[0]
    assert scores.shape == (count, 4) and net.blobs["pool"].data.shape == (count, 8, 3, 3) and count > 30
    compiled = net.compile_count
    np.testing.assert_array_equal(net.forward(**feed)["cls_prob"], scores)
    assert net.compile_count == compiled
    net.forward(end="proposal", **feed)
    np.testing.assert_array_equal(net.forward(start="roi_pool")["cls_prob"], scores)
    # Scores of each ROI alone: the ROIs after the proposals are the rows of one batch.
    rois = net.blobs["rois"].data.copy()
    fed_rois = caffejax.Net(FAST_RCNN_ROIS.replace("NUM", "1"), caffejax.TEST)
    fed_rois.share_with(net)
    for i in (0, count - 1):
        got = fed_rois.forward(data=feed["data"], rois=rois[i:i + 1])["cls_prob"][0]
        np.testing.assert_allclose(got, scores[i], rtol=1e-5, atol=1e-6)


PROPOSAL_MODULE = """
import caffejax
from caffejax.lower import forks

SETTINGS = None  # the LayerParameter of a Proposal layer (proposal_param), set by the test


class ProposalLayer(caffejax.Layer):
    \"\"\"py-faster-rcnn's rpn.proposal_layer.ProposalLayer in its form: the settings read in setup, rois shaped
    (1, 5) there and the scores (1, 1), reshape empty, both reshaped in forward to the proposals kept; these
    computed by caffejax's Proposal code.\"\"\"

    def setup(self, bottom, top):
        self.feat_stride = int(self.param_str_.split(":")[1])  # "'feat_stride': 4", YAML in py-faster-rcnn
        assert str(self.phase) == "TEST"
        top[0].reshape(1, 5)
        if len(top) > 1:
            top[1].reshape(1, 1)

    def forward(self, bottom, top):
        assert bottom[0].data.shape[0] == 1, "Only single item batches are supported"
        made = forks.propose(SETTINGS, [b.data for b in bottom])
        for blob, array in zip(top, made):
            blob.reshape(*array.shape)
            blob.data[...] = array

    def reshape(self, bottom, top):
        pass
"""


def test_py_faster_rcnns_python_proposal_layer_runs_in_stages(isolated_registry, tmp_path, monkeypatch):
    """py-faster-rcnn's test.prototxt as it is, its ProposalLayer a Python layer: its first forward sizes the
    rois by the data, and from then on the net runs it on the host between two programs, as the Proposal layer
    (the same ROIs and class scores, the same weights); the forward that found it out counts as the pass's."""
    (tmp_path / "caffejax_test_rpn.py").write_text(PROPOSAL_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "caffejax_test_rpn", raising=False)
    text = _faster_rcnn()
    reference = caffejax.Net(text, caffejax.TEST)
    python = ('layer { name: "proposal" type: "Python" bottom: "rpn_cls_prob_reshape" bottom: "rpn_bbox_pred" '
              'bottom: "im_info" top: "rois" top: "roi_scores" python_param { module: "caffejax_test_rpn" '
              'layer: "ProposalLayer" param_str: "\'feat_stride\': 4" } }')
    start = text.index('layer { name: "proposal"')
    text = text[:start] + python + text[text.index("\n", text.index("top: \"rois\"")):]
    net = caffejax.Net(text, caffejax.TEST, allow_python_layers=True)
    net.share_with(reference)
    module = importlib.import_module("caffejax_test_rpn")
    module.SETTINGS = reference.graph.layers[list(reference._layer_names).index("proposal")].proto
    calls = []
    propose = forks.propose
    monkeypatch.setattr(forks, "propose", lambda *args: calls.append(1) or propose(*args))
    rng = np.random.default_rng(8)
    for height, width in ((64, 80), (48, 64), (64, 80)):
        feed = _image(rng, height, width)
        for each in (net, reference):
            each.blobs["data"].reshape(1, 3, height, width)
        scores = net.forward(**feed)["cls_prob"]
        np.testing.assert_array_equal(scores, reference.forward(**feed)["cls_prob"])
        np.testing.assert_array_equal(net.blobs["rois"].data, reference.blobs["rois"].data)
        assert net.blobs["roi_scores"].shape == (len(scores), 1) and len(scores) > 1
    assert len(calls) == 3  # the Python layer's forward, once a pass (the Proposal rule's host_forward is its own)
    # Without allow_python_layers, py-faster-rcnn's own module and class are refused, naming caffejax's Proposal.
    own = text.replace('module: "caffejax_test_rpn"', 'module: "rpn.proposal_layer"')
    with pytest.raises(caffejax.UnsupportedError, match=r"layer 'proposal' \(type Python\): Python layer \(module "
                       r"'rpn.proposal_layer', class 'ProposalLayer'\) is not run.*change this layer to type: "
                       r"\"Proposal\" with proposal_param \{ feat_stride: 4 \}"):
        caffejax.Net(own, caffejax.TEST)
    assert net.graph.staging_layers == [list(net._layer_names).index("proposal")]
    # (its stages hold the net's few weights as constants, which XLA may sum in another order: a few ulps apart)
    np.testing.assert_allclose(caffejax.compile_inference(net)(feed)["cls_prob"], scores, rtol=1e-6, atol=1e-7)
    assert len(calls) == 4


FAST_RCNN_ROIS = """name: "same-head-fed-rois"
input: "data"
input_shape { dim: 1 dim: 3 dim: 64 dim: 80 }
input: "rois"
input_shape { dim: NUM dim: 5 }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 8 kernel_size: 3 stride: 4 pad: 1 } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "roi_pool" type: "ROIPooling" bottom: "conv1" bottom: "rois" top: "pool"
  roi_pooling_param { pooled_w: 3 pooled_h: 3 spatial_scale: 0.25 } }
layer { name: "fc" type: "InnerProduct" bottom: "pool" top: "fc" inner_product_param { num_output: 16 } }
layer { name: "cls_score" type: "InnerProduct" bottom: "fc" top: "cls_score" inner_product_param { num_output: 4 } }
layer { name: "cls_prob" type: "Softmax" bottom: "cls_score" top: "cls_prob" }
"""


def test_proposals_by_hand(isolated_registry):
    """One 16 x 16 anchor per position of a 2 x 2 map (stride 16) on a 32 x 30 image: zero deltas keep the
    anchors (a pixel larger), clipped to the image; those 8 pixels high after clipping are under min_size; the
    rest by score, a box overlapping a kept one by more than nms_thresh dropped."""
    forks.register_proposal()
    net = caffejax.Net(input_layer(1, 2, 2, 2, name="scores") + input_layer(1, 4, 2, 2, name="deltas")
                       + input_layer(1, 3, name="info")
                       + 'layer { name: "p" type: "Proposal" bottom: "scores" bottom: "deltas" bottom: "info" '
                         'top: "rois" top: "roi_scores" proposal_param { ratio: 1 scale: 1 min_size: 10 '
                         'nms_thresh: 0.7 } }\n', caffejax.TEST)
    foreground = np.float32([[0.2, 0.9], [0.5, 0.7]])  # positions (y, x)
    scores = np.stack([1 - foreground, foreground])[None]
    out = net.forward(scores=scores, deltas=np.zeros((1, 4, 2, 2), np.float32), info=np.float32([[24, 30, 1]]))
    # Anchors [0, 0, 15, 15] + 16 (x, y), each a pixel wider and higher (bbox_transform_inv's x2 = center + w / 2
    # with w = 16, not 15), clipped to [0, 29] x [0, 23]: (0,1) -> [16, 0, 29, 16], (1,1) -> [16, 16, 29, 23] and
    # (1,0) -> [0, 16, 16, 23] are 8 high (dropped), (0,0) -> [0, 0, 16, 16].
    np.testing.assert_array_equal(out["rois"], [[0, 16, 0, 29, 16], [0, 0, 0, 16, 16]])
    np.testing.assert_array_equal(out["roi_scores"], np.float32([[0.9], [0.2]]))
    info = np.float32([[40, 40, 1]])  # nothing clipped: all four, and none overlaps another
    out = net.forward(scores=scores, deltas=np.zeros((1, 4, 2, 2), np.float32), info=info)
    np.testing.assert_array_equal(out["roi_scores"].ravel(), np.float32([0.9, 0.7, 0.5, 0.2]))
    deltas = np.zeros((1, 4, 2, 2), np.float32)
    deltas[0, 0, 0, 0] = 16 / 16  # (0,0) moved one anchor width right: onto (0,1), which scores more
    out = net.forward(scores=scores, deltas=deltas, info=info)
    np.testing.assert_array_equal(out["roi_scores"].ravel(), np.float32([0.9, 0.7, 0.5]))


def test_compile_inference_runs_in_stages(isolated_registry):
    """compile_inference of a Faster R-CNN or R-FCN test net: the layers before the proposals one optimised
    program, the proposals on the host, the layers after them another, built for the ROIs found; the outputs
    are Net.forward's. A stage compiles once per shapes it reads: here the ROI count stays post_nms_topn, so
    once per image size."""
    for head in (None, R_FCN_HEAD):
        text = _faster_rcnn()
        text = text if head is None else text[:text.index('layer { name: "roi_pool"')] + head
        net = caffejax.Net(text, caffejax.TEST)
        infer = caffejax.compile_inference(net, blobs=["rois"])  # im_detect's boxes are the ROIs moved by deltas
        rng = np.random.default_rng(10)
        for height, width in ((64, 80), (48, 64), (64, 80)):
            feed = _image(rng, height, width)
            got = infer(feed)
            net.blobs["data"].reshape(1, 3, height, width)
            want = net.forward(blobs=["rois"], **feed)
            assert got.keys() == want.keys()
            for blob in want:
                np.testing.assert_allclose(np.asarray(got[blob]), want[blob], rtol=1e-5, atol=1e-6, err_msg=blob)
        assert infer.compile_count == 4
        with pytest.raises(caffejax.UnsupportedError, match="runs in stages"):
            infer.plan({"data": (1, 3, 64, 80), "im_info": (1, 3)})


def test_a_net_run_in_stages_refuses_one_program(isolated_registry, tmp_path):
    """An export and an inference function over devices name the layers; a Proposal that does not see one image
    a batch is refused as py-faster-rcnn's layer refuses it."""
    text = _faster_rcnn()
    net = caffejax.Net(text, caffejax.TEST)
    with pytest.raises(caffejax.UnsupportedError, match=r"layer 'proposal' \(type Proposal\) makes a top whose "
                                                        r"shape depends on the data"):
        export_stablehlo(net, str(tmp_path / "net.stablehlo"))
    with pytest.raises(caffejax.UnsupportedError, match="reads the top of layer 'proposal'"):
        caffejax.compile_inference(net, devices=1)  # each device would run the proposals on its rows
    with pytest.raises(ShapeError, match=r"proposal.*one image a batch"):
        caffejax.Net(text.replace("dim: 1 dim: 3 dim: 64", "dim: 2 dim: 3 dim: 64"), caffejax.TEST)


SUMSQ_LOSS = ('layer { name: "loss" type: "Reduction" bottom: "cls_score" top: "loss" '
              'reduction_param { operation: SUMSQ } loss_weight: 1 }\n')


def test_backward_through_a_net_run_in_stages(isolated_registry, caplog):
    """Net.backward over a Faster R-CNN with a loss after its ROIs runs in parts, as Caffe's Backward runs layer by
    layer: the layers after the proposals (one program, handing on the diff of the feature map they read), the
    Proposal layer's backward (py-faster-rcnn's passes: nothing reaches the RPN), the layers before. Its
    gradients are those of the same head fed the same ROIs; force_backward takes them down to the image; layer
    by layer (callbacks) gives the same; a test net with no loss backpropagates nothing."""
    net = caffejax.Net(_faster_rcnn() + SUMSQ_LOSS, caffejax.TRAIN)
    assert net.graph.layers[list(net._layer_names).index("proposal")].need_backward
    feed = _image(np.random.default_rng(7), 64, 80)
    net.forward(**feed)
    rois = net.blobs["rois"].data.copy()
    fed = caffejax.Net(FAST_RCNN_ROIS.replace("NUM", str(len(rois))) + SUMSQ_LOSS, caffejax.TRAIN)
    fed.share_with(net)
    fed.forward(data=feed["data"], rois=rois)
    np.testing.assert_array_equal(net.blobs["loss"].data, fed.blobs["loss"].data)
    fed.backward()
    diffs = net.backward(diffs=["conv1"])
    for name in fed.params:
        for mine, want in zip(net.params[name], fed.params[name]):
            np.testing.assert_allclose(mine.diff, want.diff, rtol=1e-6, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(diffs["conv1"], fed.blobs["conv1"].diff, rtol=1e-6, atol=1e-6)
    assert np.abs(fed.params["conv1"][0].diff).max() > 0
    for rpn in ("rpn_cls_score", "rpn_bbox_pred"):
        assert not net.params[rpn][0].diff.any()
    # force_backward: the image's diff, as the fed head's; layer by layer (a callback), the same diffs again.
    forced = caffejax.Net("force_backward: true\n" + _faster_rcnn() + SUMSQ_LOSS, caffejax.TRAIN)
    forced.share_with(net)
    fed = caffejax.Net("force_backward: true\n" + FAST_RCNN_ROIS.replace("NUM", str(len(rois))) + SUMSQ_LOSS,
                       caffejax.TRAIN)
    fed.share_with(net)
    fed.forward(data=feed["data"], rois=rois)
    want = fed.backward()["data"]
    forced.forward(**feed)
    np.testing.assert_allclose(forced.backward()["data"], want, rtol=1e-5, atol=1e-6)
    assert np.abs(want).max() > 0
    called = []
    forced.after_backward(called.append)
    forced.clear_param_diffs()
    np.testing.assert_allclose(forced.backward()["data"], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(forced.params["conv1"][0].diff, fed.params["conv1"][0].diff, rtol=1e-5, atol=1e-6)
    assert called == list(range(len(forced.layers) - 1, -1, -1))
    forced.debug_info = True  # Caffe's BackwardDebugInfo lines, the host layer's among them
    with caplog.at_level(logging.INFO, logger="caffejax"):
        forced.backward()
    assert "[Backward] Layer proposal, bottom blob rpn_cls_prob_reshape diff: 0" in caplog.text
    assert float(re.search(r"\[Backward\] Layer roi_pool, bottom blob conv1_relu1_0_split_2 diff: (\S+)",
                           caplog.text).group(1)) > 0
    # A test net: nothing needs a backward, and none runs.
    test = caffejax.Net(_faster_rcnn(), caffejax.TEST)
    test.forward(**feed)
    assert not test.backward()["data"].any()


def _solver_and_twin(tmp_path, text: str, seed: int):
    """An SGD solver (lr 0.001) over ``text``, a Net of it with the solver's initial weights, and an image fed to the
    solver's net (returned, to feed the twin)."""
    (tmp_path / "train.prototxt").write_text(text)
    (tmp_path / "solver.prototxt").write_text(f'net: "{tmp_path / "train.prototxt"}" base_lr: 0.001 '
                                              'lr_policy: "fixed" max_iter: 2 snapshot_after_train: false')
    solver = caffejax.SGDSolver(str(tmp_path / "solver.prototxt"))
    net = caffejax.Net(text, caffejax.TRAIN)
    for name in net.params:
        for mine, theirs in zip(net.params[name], solver.net.params[name]):
            mine.data[...] = theirs.data
    feed = _image(np.random.default_rng(seed), 64, 80)
    for blob, array in feed.items():
        solver.net.blobs[blob].data[...] = array
    return solver, net, feed


def test_a_solver_step_makes_the_proposals_that_end_its_net(isolated_registry, tmp_path):
    """An RPN trained with its Proposal layer at the end (nothing compiled reads the ROIs, so one fused program a
    step): the step's program hands the proposal layer the score maps, and the layer reads im_info, a fed blob,
    as it is (the step used to fail with a KeyError on it). The ROIs are those of the step's forward."""
    text = (_faster_rcnn().split('layer { name: "roi_pool"')[0]
            + 'layer { name: "loss" type: "Reduction" bottom: "rpn_bbox_pred" top: "loss" '
              'reduction_param { operation: SUMSQ } loss_weight: 1 }\n')
    solver, net, feed = _solver_and_twin(tmp_path, text, seed=1)
    assert [layer.name for layer in solver.net.graph.layers if layer.runs_on_host] == ["proposal"]
    assert not solver.net.graph.staging_layers
    solver.step(1)
    net.forward(**feed)
    assert net.blobs["rois"].shape[0] > 1
    np.testing.assert_allclose(solver.net.blobs["rois"].data, net.blobs["rois"].data, rtol=1e-5, atol=1e-4)


def test_a_backward_in_stages_takes_each_stages_dropout_masks(isolated_registry):
    """Net.backward runs each stage's backward with the key of that stage's forward pass, so a Dropout before the
    proposals drops in its backward what it dropped in its forward (it took the key of the last stage's pass):
    where conv1 is not 0, its diff is twice the dropped blob's where that was kept, else 0."""
    text = (_faster_rcnn() + SUMSQ_LOSS).replace(
        'layer { name: "rpn_cls_score" type: "Convolution" bottom: "conv1"',
        'layer { name: "drop1" type: "Dropout" bottom: "conv1" top: "dropped" }\n'
        'layer { name: "rpn_cls_score" type: "Convolution" bottom: "dropped"').replace(
        'bottom: "conv1" top: "rpn_bbox_pred"', 'bottom: "dropped" top: "rpn_bbox_pred"').replace(
        'bottom: "conv1" bottom: "rois"', 'bottom: "dropped" bottom: "rois"')
    net = caffejax.Net(text, caffejax.TRAIN)
    net.forward(**_image(np.random.default_rng(7), 64, 80))
    net.backward()
    conv1, dropped = net.blobs["conv1"], net.blobs["dropped"]
    kept = conv1.data != 0
    assert 0.2 < (dropped.data[kept] != 0).mean() < 0.8 and np.abs(dropped.diff).max() > 0
    np.testing.assert_allclose(conv1.diff[kept], (2 * dropped.diff * (dropped.data != 0))[kept], rtol=1e-6)


def test_a_solver_trains_a_net_run_in_stages(isolated_registry, tmp_path):
    """A solver's step through a Faster R-CNN with a loss after its ROIs runs Solver::Step's passes in stages
    (Net.forward, Net.backward) and then its update: two SGD steps give the weights those passes and the update
    by hand give, although the solver's backward passes run from its forward passes' pullbacks. Over several
    devices the step is refused by name."""
    solver, net, feed = _solver_and_twin(tmp_path, _faster_rcnn() + SUMSQ_LOSS, seed=11)
    for _ in range(2):
        solver.step(1)
        net.forward(**feed)
        net.clear_param_diffs()
        net.backward()
        for name in net.params:
            for mine, theirs in zip(net.params[name], solver.net.params[name]):
                mine.data[...] -= np.float32(0.001) * mine.diff
                np.testing.assert_allclose(theirs.data, mine.data, rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(solver.net.blobs["loss"].data, net.blobs["loss"].data, rtol=1e-5)
    assert np.abs(net.params["fc"][0].diff).max() > 0
    # The solver's backward passes ran from their forwards' pullbacks (Net._keeping_pullbacks), not running the
    # stages' forwards again as Net.backward on its own does.
    proposal, last = list(net._layer_names).index("proposal"), len(net._layer_names) - 1
    ran = {key[1:4] for key in solver.net._compiled}
    for first, end in ((0, proposal - 1), (proposal + 1, last)):
        assert ("forward-pullback", first, end) in ran and ("backward-pullback", first, end) in ran
        assert ("backward", first, end) not in ran and ("backward", first, end) in {k[1:4] for k in net._compiled}
    assert not solver.net._pullbacks  # none kept after the iteration
    with pytest.raises(caffejax.UnsupportedError, match="reads the top of layer 'proposal'"):
        caffejax.SGDSolver(str(tmp_path / "solver.prototxt"), devices=1).step(1)


def test_caffejax_time_runs_a_net_in_stages(isolated_registry, tmp_path, capsys):
    """caffejax time of a Faster R-CNN with a loss after its ROIs: its passes as Net.forward and Net.backward run
    them, a program per stage and the proposals on the host between; every layer timed on the inputs its stage
    gave it; each stage's forward and backward programs traced."""
    from caffejax.cli import main

    (tmp_path / "net.prototxt").write_text(_faster_rcnn() + SUMSQ_LOSS)
    status = main(["time", "-model", str(tmp_path / "net.prototxt"), "-phase", "TRAIN", "-iterations", "2",
                   "--fork-layers"])
    err = capsys.readouterr().err
    assert status == 0, err
    number = r"([\d.]+(?:e[-+]\d+)?)"
    seconds = {}
    for name in caffejax.Net(_faster_rcnn() + SUMSQ_LOSS, caffejax.TRAIN)._layer_names:
        for way in ("forward", "backward"):
            seconds[name, way] = float(re.search(rf"\] +{name}\t{way}: {number} ms\.$", err, re.M).group(1))
    assert all(seconds[name, "forward"] > 0 for name in ("proposal", "roi_pool", "fc"))
    assert seconds["fc", "backward"] > 0 and seconds["proposal", "backward"] == 0
    for title in ("stage 1 \\(input to rpn_cls_prob_reshape\\)", "stage 2 \\(roi_pool to loss\\)"):
        for program in ("Forward pass", "Forward-Backward"):
            assert re.search(rf"Whole net's {program}, {title}, traced \(2 runs", err), (program, title)
    assert re.search(r"backward +(\S+\+)?fc(\+\S+)?  \(\d+ ops?\)", err)
    assert re.search(r"forward +roi_pool  \(\d+ ops?\)", err)
    averages = {name: float(re.search(rf"\] Average {name}: {number} ms\.$", err, re.M).group(1))
                for name in ("Forward pass", "Backward pass", "Forward-Backward")}
    assert averages["Forward pass"] > 0 and averages["Backward pass"] > 0


def test_a_stage_compiles_again_only_for_the_shapes_it_reads(isolated_registry):
    """An input only the layers after the proposals read (py-faster-rcnn's training reads gt_boxes, of a new count
    each image, only after them): a new shape of it compiles the stage that reads it, not the stage before the
    proposals (VGG16's convolutions there). Its backward likewise."""
    text = (_faster_rcnn() + 'input: "side" input_shape { dim: 2 dim: 4 }\n'
            'layer { name: "side_sum" type: "Reduction" bottom: "side" top: "side_sum" }\n'
            'layer { name: "scaled" type: "Scale" bottom: "cls_score" bottom: "side_sum" top: "both" '
            'scale_param { axis: 0 num_axes: 0 } }\n'
            + SUMSQ_LOSS.replace('bottom: "cls_score" top: "loss"', 'bottom: "both" top: "loss"'))
    net = caffejax.Net(text, caffejax.TRAIN)
    proposal = list(net._layer_names).index("proposal")
    feed = _image(np.random.default_rng(12), 64, 80)
    ranges = []  # the layer ranges of the programs each pass compiled
    for count in (2, 2, 3, 5):  # (the second: the programs of a forward keeping its pullback for the backward)
        before, compiled = set(net._compiled), net.compile_count
        net.blobs["side"].reshape(count, 4)
        net.forward(side=np.ones((count, 4), np.float32), **feed)
        np.testing.assert_allclose(net.blobs["both"].data, net.blobs["cls_score"].data * 4 * count, rtol=1e-6)
        net.backward()
        ranges.append({tuple(sorted(key[2:4])) for key in set(net._compiled) - before})
        assert net.compile_count > compiled
    assert (0, proposal - 1) in ranges[0] and (proposal, proposal) in ranges[0]
    assert all(first > proposal for new in ranges[2:] for first, _ in new), ranges


def _append_boxes(layer, bottoms):
    """proposal_target_layer's appending of the ground-truth boxes to the ROIs, on the host."""
    rois, gt = bottoms
    return [np.concatenate([rois, np.column_stack([np.zeros(len(gt)), gt[:, :4]])]).astype(np.float32)]


def _faster_rcnn_with_boxes(extra_layers: str = "") -> str:
    """The Faster R-CNN test net with a gt_boxes input, which a host layer appends to the ROIs the head pools."""
    caffejax.register_layer("AppendBoxes", lambda ctx, bottoms, params: [bottoms[0]], host_forward=_append_boxes,
                            bottoms=(2, 2), tops=(1, 1))
    return (_faster_rcnn().replace('input: "im_info"', 'input: "gt_boxes"\ninput_shape { dim: 1 dim: 5 }\n'
                                   'input: "im_info"')
            .replace('bottom: "conv1" bottom: "rois" top: "pool"', 'bottom: "conv1" bottom: "all_rois" top: "pool"')
            .replace('layer { name: "roi_pool"', 'layer { name: "with_gt" type: "AppendBoxes" bottom: "rois" '
                     f'bottom: "gt_boxes" top: "all_rois" }}\n{extra_layers}layer {{ name: "roi_pool"'))


def _boxes(count: int) -> np.ndarray:
    return np.float32([[4 * i, 2 * i, 4 * i + 20, 2 * i + 30, 1] for i in range(count)])


def test_a_host_layers_tops_keep_their_data_through_a_later_stages_rebuild(isolated_registry):
    """py-faster-rcnn's proposals are read only by its proposal target layer, run on the host, whose ROIs the head
    reads (a stage after it). A new number of ROIs rebuilds the net for the head in the middle of the forward;
    the proposals' ROIs keep what the Proposal layer made (Caffe reshapes a top only in its layer's forward).
    Here a host layer appends the ground-truth boxes to the ROIs, as the proposal target layer does."""
    net = caffejax.Net(_faster_rcnn_with_boxes(), caffejax.TEST)
    feed = _image(np.random.default_rng(3), 64, 80)
    for count in (1, 2, 3, 1):
        gt = _boxes(count)
        net.blobs["gt_boxes"].reshape(*gt.shape)
        net.forward(gt_boxes=gt, **feed)
        np.testing.assert_array_equal(net.blobs["all_rois"].data[-count:, 1:], gt[:, :4])
        np.testing.assert_array_equal(net.blobs["all_rois"].data[:-count], net.blobs["rois"].data)
        assert len(net.blobs["cls_prob"].data) == len(net.blobs["all_rois"].data)


def test_a_fed_blob_only_host_layers_read_is_split_on_the_host(isolated_registry):
    """py-faster-rcnn's ground-truth boxes, of a new count each image, are read by its anchor and proposal target
    layers (run on the host) through a Split. The Split runs on the host with them, so the program before the
    proposals does not read the boxes and is not compiled again for each count, in Net.forward and in
    compile_inference. Here two host layers read the boxes: one appends them to the ROIs (as the proposal target
    layer does), one counts them."""
    caffejax.register_layer("CountBoxes", lambda ctx, bottoms, params: [jnp.zeros((1,))],
                            host_forward=lambda layer, bottoms: [np.float32([len(bottoms[0])])],
                            bottoms=(1, 1), tops=(1, 1))
    net = caffejax.Net(_faster_rcnn_with_boxes('layer { name: "count" type: "CountBoxes" bottom: "gt_boxes" '
                                               'top: "count" }\n'), caffejax.TEST)
    split = net.graph.layer("gt_boxes_input_1_split")
    assert split.runs_on_host and [net._layer_names[i] for i in net.graph.staging_layers] == ["with_gt"]
    with_gt = list(net._layer_names).index("with_gt")
    infer = caffejax.compile_inference(net)
    feed = _image(np.random.default_rng(3), 64, 80)
    for count, new_programs in ((1, 2), (2, 1), (3, 1), (1, 0)):  # compile_inference's: a new count, the head's
        gt = _boxes(count)
        before, compiled = set(net._compiled), infer.compile_count
        inferred = infer({**feed, "gt_boxes": gt})
        assert infer.compile_count == compiled + new_programs, count
        net.blobs["gt_boxes"].reshape(*gt.shape)
        outputs = net.forward(gt_boxes=gt, **feed)
        for name in ("count", "cls_prob"):  # (a few ulps apart: the stages' weights are constants, as above)
            np.testing.assert_allclose(inferred[name], outputs[name], rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(outputs["count"], [count])
        first_ranges = {min(key[2:4]) for key in set(net._compiled) - before}
        assert count == 1 or all(first > with_gt for first in first_ranges), count


END2END_MODULE = """
import numpy as np
import caffejax


def _overlaps(boxes, gt):
    x1 = np.maximum(boxes[:, None, 0], gt[None, :, 0]); y1 = np.maximum(boxes[:, None, 1], gt[None, :, 1])
    x2 = np.minimum(boxes[:, None, 2], gt[None, :, 2]); y2 = np.minimum(boxes[:, None, 3], gt[None, :, 3])
    inter = np.clip(x2 - x1 + 1, 0, None) * np.clip(y2 - y1 + 1, 0, None)
    area = lambda b: (b[:, 2] - b[:, 0] + 1) * (b[:, 3] - b[:, 1] + 1)
    return inter / (area(boxes)[:, None] + area(gt)[None, :] - inter)


class RoIData(caffejax.Layer):
    \"\"\"roi_data_layer's form: one image a batch, its size and its number of boxes changing batch to batch.\"\"\"
    def setup(self, bottom, top):
        self.count = 0
        top[0].reshape(1, 3, 64, 80); top[1].reshape(1, 3); top[2].reshape(1, 5)

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        rng = np.random.default_rng(self.count)
        height, width = ((64, 80), (48, 64))[self.count % 2 if self.param_str != "one size" else 0]
        boxes = 1 + self.count % 3
        self.count += 1
        corner = rng.uniform(0, [width - 24, height - 24], (boxes, 2))
        gt = np.column_stack([corner, corner + rng.uniform(8, 20, (boxes, 2)),
                              rng.integers(1, 3, boxes)]).astype(np.float32)
        for blob, array in zip(top, (rng.standard_normal((1, 3, height, width)),
                                     np.float32([[height, width, 1]]), gt)):
            blob.reshape(*array.shape); blob.data[...] = array

    def backward(self, top, propagate_down, bottom):
        pass


class AnchorTarget(caffejax.Layer):
    \"\"\"anchor_target_layer's form: tops shaped by the score map's size in setup and again in forward; one
    anchor per position here, labelled 1 where it overlaps a box by more than 0.3, -1 (ignored) at odd x.\"\"\"
    def setup(self, bottom, top):
        self._shape(bottom, top)

    def _shape(self, bottom, top):
        height, width = bottom[0].data.shape[-2:]
        top[0].reshape(1, 1, height, width)
        for blob in top[1:]:
            blob.reshape(1, 4, height, width)

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        self._shape(bottom, top)
        height, width = bottom[0].data.shape[-2:]
        ys, xs = np.mgrid[0:height, 0:width] * 4
        anchors = np.column_stack([xs.ravel(), ys.ravel(), xs.ravel() + 11, ys.ravel() + 11]).astype(np.float32)
        best = _overlaps(anchors, bottom[1].data[:, :4]).max(1)
        labels = (best > 0.3).astype(np.float32)
        labels[(xs.ravel() // 4) % 2 == 1] = -1
        top[0].data[...] = labels.reshape(1, 1, height, width)
        top[1].data[...] = 0.1
        top[2].data[...] = (labels >= 0).reshape(1, 1, height, width)
        top[3].data[...] = 1.0 / max(1, (labels >= 0).sum())

    def backward(self, top, propagate_down, bottom):
        pass


class ProposalTarget(caffejax.Layer):
    \"\"\"proposal_target_layer's form: the proposals and the boxes as ROIs, labelled by their best box's class
    where they overlap it by 0.5, else background; as many as there are.\"\"\"
    def setup(self, bottom, top):
        top[0].reshape(1, 5); top[1].reshape(1); top[2].reshape(1, 12); top[3].reshape(1, 12); top[4].reshape(1, 12)

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        gt = bottom[1].data
        rois = np.vstack([bottom[0].data, np.column_stack([np.zeros(len(gt)), gt[:, :4]])]).astype(np.float32)
        overlaps = _overlaps(rois[:, 1:], gt[:, :4])
        labels = np.where(overlaps.max(1) >= 0.5, gt[overlaps.argmax(1), 4], 0).astype(np.float32)
        targets = np.zeros((len(rois), 12), np.float32)
        weights = np.zeros((len(rois), 12), np.float32)
        for i, label in enumerate(labels.astype(int)):
            targets[i, 4 * label:4 * label + 4] = 0.2
            weights[i, 4 * label:4 * label + 4] = 1 if label else 0
        for blob, array in zip(top, (rois, labels, targets, weights, weights)):
            blob.reshape(*array.shape); blob.data[...] = array

    def backward(self, top, propagate_down, bottom):
        pass
"""

END2END_TRAIN = """name: "FasterRCNN-end2end-small"
layer { name: "input-data" type: "Python" top: "data" top: "im_info" top: "gt_boxes"
  python_param { module: "caffejax_test_end2end" layer: "RoIData" } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 8 kernel_size: 3 stride: 4 pad: 1 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "rpn_cls_score" type: "Convolution" bottom: "conv1" top: "rpn_cls_score"
  convolution_param { num_output: 18 kernel_size: 1 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "rpn_cls_score_1" type: "Convolution" bottom: "conv1" top: "rpn_cls_score_1"
  convolution_param { num_output: 2 kernel_size: 1 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "rpn_bbox_pred" type: "Convolution" bottom: "conv1" top: "rpn_bbox_pred"
  convolution_param { num_output: 36 kernel_size: 1 weight_filler { type: "gaussian" std: 0.05 } } }
layer { name: "rpn_bbox_pred_1" type: "Convolution" bottom: "conv1" top: "rpn_bbox_pred_1"
  convolution_param { num_output: 4 kernel_size: 1 weight_filler { type: "gaussian" std: 0.05 } } }
layer { name: "rpn-data" type: "Python" bottom: "rpn_cls_score_1" bottom: "gt_boxes" bottom: "im_info"
  top: "rpn_labels" top: "rpn_bbox_targets" top: "rpn_bbox_inside_weights" top: "rpn_bbox_outside_weights"
  python_param { module: "caffejax_test_end2end" layer: "AnchorTarget" } }
layer { name: "rpn_loss_cls" type: "SoftmaxWithLoss" bottom: "rpn_cls_score_1" bottom: "rpn_labels"
  top: "rpn_cls_loss" loss_weight: 1 propagate_down: 1 propagate_down: 0
  loss_param { ignore_label: -1 normalize: true } }
layer { name: "rpn_loss_bbox" type: "SmoothL1Loss" bottom: "rpn_bbox_pred_1" bottom: "rpn_bbox_targets"
  bottom: "rpn_bbox_inside_weights" bottom: "rpn_bbox_outside_weights" top: "rpn_loss_bbox" loss_weight: 1
  smooth_l1_loss_param { sigma: 3.0 } }
layer { bottom: "rpn_cls_score" top: "rpn_cls_score_reshape" name: "rpn_cls_score_reshape" type: "Reshape"
  reshape_param { shape { dim: 0 dim: 2 dim: -1 dim: 0 } } }
layer { name: "rpn_cls_prob" type: "Softmax" bottom: "rpn_cls_score_reshape" top: "rpn_cls_prob" }
layer { name: "rpn_cls_prob_reshape" type: "Reshape" bottom: "rpn_cls_prob" top: "rpn_cls_prob_reshape"
  reshape_param { shape { dim: 0 dim: 18 dim: -1 dim: 0 } } }
layer { name: "proposal" type: "Proposal" bottom: "rpn_cls_prob_reshape" bottom: "rpn_bbox_pred" bottom: "im_info"
  top: "rpn_rois" proposal_param { PROPOSAL } }
layer { name: "roi-data" type: "Python" bottom: "rpn_rois" bottom: "gt_boxes" top: "rois" top: "labels"
  top: "bbox_targets" top: "bbox_inside_weights" top: "bbox_outside_weights"
  python_param { module: "caffejax_test_end2end" layer: "ProposalTarget" } }
layer { name: "roi_pool" type: "ROIPooling" bottom: "conv1" bottom: "rois" top: "pool"
  roi_pooling_param { pooled_w: 3 pooled_h: 3 spatial_scale: 0.25 } }
layer { name: "fc" type: "InnerProduct" bottom: "pool" top: "fc"
  inner_product_param { num_output: 16 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "relu_fc" type: "ReLU" bottom: "fc" top: "fc" }
layer { name: "cls_score" type: "InnerProduct" bottom: "fc" top: "cls_score"
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "bbox_pred" type: "InnerProduct" bottom: "fc" top: "bbox_pred"
  inner_product_param { num_output: 12 weight_filler { type: "gaussian" std: 0.01 } } }
layer { name: "loss_cls" type: "SoftmaxWithLoss" bottom: "cls_score" bottom: "labels" propagate_down: 1
  propagate_down: 0 top: "loss_cls" loss_weight: 1 }
layer { name: "loss_bbox" type: "SmoothL1Loss" bottom: "bbox_pred" bottom: "bbox_targets"
  bottom: "bbox_inside_weights" bottom: "bbox_outside_weights" top: "loss_bbox" loss_weight: 1 }
"""


def test_python_layers_reading_only_fed_blobs_of_new_shapes_run_on_the_host(isolated_registry, tmp_path,
                                                                           monkeypatch):
    """py-faster-rcnn's end2end net on images of one size (a camera's): its anchor target layer shapes its tops by
    the score map, so they never change and it stays compiled, a callback reading the ground-truth boxes. A new
    number of boxes then compiled the program of every layer before it again (VGG16's, forward and backward).
    Once the boxes, which only Python layers read, change shape while the other fed blobs keep theirs, the layer
    runs on the host instead: the layers before it are compiled once, in a solver's steps and Net.forward alike,
    and train as before."""
    (tmp_path / "caffejax_test_end2end.py").write_text(END2END_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "caffejax_test_end2end", raising=False)
    forks.register_all()
    text = END2END_TRAIN.replace("PROPOSAL", SMALL_ANCHORS).replace(
        'layer: "RoIData" }', 'layer: "RoIData" param_str: "one size" }')
    (tmp_path / "train.prototxt").write_text(text)
    (tmp_path / "solver.prototxt").write_text(f'net: "{tmp_path / "train.prototxt"}" base_lr: 0.001 '
                                              'lr_policy: "fixed" momentum: 0.9 max_iter: 9 snapshot_after_train: false')
    # Not with the image's shape changing too: conv1 reads it, so the program before the anchor targets is
    # compiled again anyway (the anchor targets then learn to run on the host as they size their tops by the data).
    net = caffejax.Net(str(tmp_path / "train.prototxt"), caffejax.TRAIN, allow_python_layers=True)
    assert not net._learn_layers_reading_changing_feeds({"data", "gt_boxes"})
    assert not net.graph.layer("rpn-data").runs_on_host
    solver = caffejax.SGDSolver(str(tmp_path / "solver.prototxt"), allow_python_layers=True)
    net = solver.net
    names = list(net._layer_names)
    anchors = names.index("rpn-data")
    weights = np.array(net.params["conv1"][0].data)
    losses = []
    for _ in range(6):  # 1, 2, 3, 1, 2, 3 boxes
        solver.step(1)
        losses.append(float(net.blobs["rpn_cls_loss"].data) + float(net.blobs["loss_cls"].data))
    assert np.isfinite(losses).all() and not np.array_equal(net.params["conv1"][0].data, weights)
    assert net.graph.layer("rpn-data").runs_on_host
    assert [names[i] for i in net.graph.staging_layers] == ["rpn-data", "roi-data"]
    before_anchors = [key for key in net._compiled if key[1] in ("forward", "forward-pullback")
                      and key[2] == 0 and key[3] < anchors]
    assert len(before_anchors) == 1, before_anchors
    # Whole programs over the layers before the anchor targets (the first step's fused one): that step's alone.
    assert len([key for key in net._compiled if key[2:4] == (0, len(names) - 1)]) <= 1
    compiled = set(net._compiled)
    for _ in range(3):  # Net.forward, 1, 2, 3 boxes: the same stages, the one before the anchor targets compiled once
        assert np.isfinite(float(net.forward()["rpn_cls_loss"]))
    assert sorted(key[1] for key in set(net._compiled) - compiled if key[2] < anchors) == ["forward", "prepare"]


CHANGING_LABELS_MODULE = """
import numpy as np
import caffejax


class Data(caffejax.Layer):
    \"\"\"An input of one shape and 1, 2, 3, 1, ... labels.\"\"\"
    def setup(self, bottom, top):
        self.count = 0
        top[0].reshape(2, 3); top[1].reshape(1)

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        count, self.count = 1 + self.count % 3, self.count + 1
        top[0].data[...] = np.arange(6).reshape(2, 3) / 6.0
        top[1].reshape(count); top[1].data[...] = np.arange(count)

    def backward(self, top, propagate_down, bottom):
        pass


class Loss(caffejax.Layer):
    \"\"\"0.5 * sum(x^2) * the number of labels.\"\"\"
    def setup(self, bottom, top):
        top[0].reshape(1)

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        top[0].data[...] = 0.5 * np.sum(bottom[0].data ** 2) * len(bottom[1].data)

    def backward(self, top, propagate_down, bottom):
        bottom[0].diff[...] = bottom[0].data * len(bottom[1].data) * top[0].diff[0]
"""


def test_a_python_loss_reading_fed_blobs_of_new_shapes_stays_compiled(isolated_registry, tmp_path, monkeypatch):
    """A Python loss layer reading labels of a new count each batch is not moved to the host as layers reading only
    such blobs are (test above): a layer run there has no gradient to start Caffe's backward from. It stays
    compiled, a program per count, and trains."""
    (tmp_path / "caffejax_test_labels.py").write_text(CHANGING_LABELS_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "caffejax_test_labels", raising=False)
    param = caffe_pb2.SolverParameter(base_lr=0.1, lr_policy="fixed", max_iter=6)
    param.net_param.CopyFrom(parse_net_text("""
layer { name: "data" type: "Python" top: "x" top: "label" python_param { module: "caffejax_test_labels" layer: "Data" } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "ip"
  inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "Python" bottom: "ip" bottom: "label" top: "loss" loss_weight: 1
  python_param { module: "caffejax_test_labels" layer: "Loss" } }"""))
    solver = caffejax.SGDSolver(param, allow_python_layers=True)
    for count in (1, 2, 3, 1):
        before = np.array(solver.net.params["ip"][0].data)
        solver.step(1)
        assert solver.net.blobs["label"].shape == (count,) and not solver.net.graph.layer("loss").runs_on_host
        assert not np.array_equal(solver.net.params["ip"][0].data, before)


def test_py_faster_rcnns_end2end_training_net_trains(isolated_registry, tmp_path, monkeypatch):
    """py-faster-rcnn's end2end train.prototxt in its form: a Python data layer serving one image of its own size
    with its own number of boxes, Python anchor and proposal target layers sizing their tops by the data (the
    anchor targets shaped in setup at the first size: at the second, the build finds the RPN loss's labels do
    not fit, and the layer runs on the host from then on, as Caffe reshapes it in its forward), the Proposal
    layer, the losses of the RPN and of the head. A solver trains it in stages around the three host layers:
    every loss finite, every trained layer moved but the RPN convolutions only the proposals read (they send
    nothing back)."""
    (tmp_path / "caffejax_test_end2end.py").write_text(END2END_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "caffejax_test_end2end", raising=False)
    forks.register_all()
    text = END2END_TRAIN.replace("PROPOSAL", SMALL_ANCHORS)
    (tmp_path / "train.prototxt").write_text(text)
    (tmp_path / "solver.prototxt").write_text(f'net: "{tmp_path / "train.prototxt"}" base_lr: 0.001 '
                                              'lr_policy: "fixed" momentum: 0.9 max_iter: 6 snapshot_after_train: false')
    solver = caffejax.SGDSolver(str(tmp_path / "solver.prototxt"), allow_python_layers=True)
    weights = {name: [np.array(b.data) for b in blobs] for name, blobs in solver.net.params.items()}
    losses = []
    for _ in range(4):
        solver.step(1)
        net = solver.net
        losses.append([float(net.blobs[name].data) for name in ("rpn_cls_loss", "rpn_loss_bbox", "loss_cls",
                                                               "loss_bbox")])
    assert np.isfinite(losses).all() and all(loss > 0 for loss in np.sum(losses, 1))
    names = list(net._layer_names)
    assert [names[i] for i in net.graph.staging_layers] == ["rpn-data", "roi-data"]  # the proposals feed roi-data
    assert [layer.name for layer in net.graph.layers if layer.runs_on_host] == [
        "im_info_input-data_1_split", "gt_boxes_input-data_2_split", "rpn-data", "proposal", "roi-data"]
    # The layers before the anchor targets were compiled once per image size, not per number of boxes: the boxes
    # reach the Python layers through a Split run on the host.
    before_anchors = [key for key in net._compiled if key[1] in ("forward", "forward-pullback")
                      and key[2:4] == (0, names.index("rpn-data") - 1)]
    assert len(before_anchors) == 2
    for name in ("conv1", "rpn_cls_score_1", "rpn_bbox_pred_1", "fc", "cls_score", "bbox_pred"):
        assert not np.array_equal(net.params[name][0].data, weights[name][0]), name
    for name in ("rpn_cls_score", "rpn_bbox_pred"):  # only the proposals read them, which send back nothing
        np.testing.assert_array_equal(net.params[name][0].data, weights[name][0])
    losses = solver.net.forward()  # the next image, as Net.forward runs it: the same net, the same stages
    assert set(losses) == {"rpn_cls_loss", "rpn_loss_bbox", "loss_cls", "loss_bbox"}
    assert all(np.isfinite(float(loss)) for loss in losses.values())
