"""caffe.coord_map: the Crop offsets FCN's net definitions compute, checked against the published FCN-8s
deploy prototxt (whose offsets BVLC's coord_map wrote) and against the values a net computes."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

import caffejax
from caffejax import coord_map
from caffejax.frontend.prototxt import parse_net_text
from caffejax.net_spec import NetSpec, layers as L

FCN8S = pathlib.Path(__file__).parent / "fixtures/models/fcn/voc-fcn8s/deploy.prototxt"


def _first(values, default):
    return list(values)[0] if len(values) else default


def _tops_of(net_param) -> dict:
    """The prototxt as NetSpec tops, with the spatial parameters coord_map reads, by top name."""
    tops = {}
    for layer in net_param.layer:
        params = {}
        if layer.type in ("Convolution", "Deconvolution"):
            p = layer.convolution_param
            params["convolution_param"] = dict(kernel_size=_first(p.kernel_size, 1), stride=_first(p.stride, 1),
                                               pad=_first(p.pad, 0), num_output=p.num_output)
        elif layer.type == "Pooling":
            p = layer.pooling_param
            params.update(kernel_size=p.kernel_size, stride=p.stride, pad=p.pad)
        elif layer.type == "Crop":
            params["crop_param"] = dict(axis=layer.crop_param.axis, offset=list(layer.crop_param.offset))
        top = getattr(L, layer.type)(*[tops[b] for b in layer.bottom], **params)
        tops[layer.top[0]] = top
    return tops


@pytest.mark.parametrize("cropped,reference,offset", [("score_pool4", "upscore2", 5),
                                                       ("score_pool3", "upscore_pool4", 9),
                                                       ("upscore8", "data", 31)])
def test_crop_gives_the_published_fcn8s_offsets(cropped, reference, offset):
    tops = _tops_of(parse_net_text(str(FCN8S), is_path=True))
    layer = coord_map.crop(tops[cropped], tops[reference])
    assert layer.fn.type_name == "Crop" and layer.fn.inputs == (tops[cropped], tops[reference])
    assert layer.fn.params["crop_param"] == {"axis": 2, "offset": [offset]}


def test_the_crop_aligns_what_the_padding_moved():
    """A 3x3 convolution padded by 100 with a centre-tap filter moves the image 99 cells in; the crop coord_map
    computes cuts it back out exactly."""
    n = NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 1, 9, 7]))
    n.conv = L.Convolution(n.data, kernel_size=3, pad=100, num_output=1, bias_term=False)
    n.relu = L.ReLU(n.conv, in_place=True)
    n.crop = coord_map.crop(n.relu, n.data)
    assert n.crop.fn.params["crop_param"] == {"axis": 2, "offset": [99]}
    net = caffejax.Net(n.to_proto(), caffejax.TEST)
    net.params["conv"][0].data[...] = 0
    net.params["conv"][0].data[0, 0, 1, 1] = 1
    x = np.random.default_rng(0).random((1, 1, 9, 7)).astype(np.float32)
    np.testing.assert_array_equal(net.forward(data=x)["crop"], x)


def test_maps_compose_and_invert_and_refuse_what_they_cannot_map():
    n = NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 1, 8, 8]))
    n.pool = L.Pooling(n.data, kernel_size=2, stride=2)
    n.up = L.Deconvolution(n.pool, convolution_param=dict(kernel_size=4, stride=2, num_output=1))
    ax, a, b = coord_map.coord_map_from_to(n.up, n.data)
    assert ax == 1 and a == pytest.approx(1) and b == pytest.approx(-1)  # up is 1 cell bigger on each side
    assert coord_map.compose((None, 1, 0), (1, 2, 3)) == (1, 2, 3)
    assert coord_map.inverse((1, 2.0, 3.0)) == (1, 0.5, -1.5)
    with pytest.raises(coord_map.AxisMismatchException):
        coord_map.compose((1, 1, 0), (2, 1, 0))
    n.fc = L.InnerProduct(n.data, num_output=3)
    with pytest.raises(caffejax.GraphError, match="do not meet"):
        coord_map.coord_map_from_to(n.fc, n.pool)
    with pytest.raises(caffejax.ShapeError, match="different scales"):
        coord_map.crop(n.pool, n.data)
    with pytest.raises(caffejax.GraphError, match="share coordinates"):
        coord_map.crop(L.ReLU(n.data), n.data)


def test_the_walk_is_linear_in_the_graph_and_still_checks_every_edge(monkeypatch):
    """Residual blocks (Eltwise(x, f(x))) double the paths back to the data each time: following every path
    (4096 here) made a ResNet-101's 33 blocks take hours. pycaffe's answer for this net is (1, 1, 0); each
    layer's map is asked for once."""
    n = NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 1, 32, 32]))
    x = L.Convolution(n.data, kernel_size=3, pad=1, num_output=1)
    for _ in range(12):
        x = L.Eltwise(x, L.ReLU(L.Convolution(x, kernel_size=3, pad=1, num_output=1)))
    calls = []
    real_coord_map = coord_map.coord_map
    monkeypatch.setattr(coord_map, "coord_map", lambda fn: calls.append(fn) or real_coord_map(fn))
    ax, a, b = coord_map.coord_map_from_to(x, n.data)
    assert ax == 1 and a == pytest.approx(1) and b == pytest.approx(0)
    assert len(calls) == len(set(calls)) <= 4 * 12 + 2
    # A top reached again is not walked again, but the edge to it is still composed: pycaffe raises here.
    n.crop = L.Crop(n.data, n.data, axis=3)
    n.elt = L.Eltwise(L.Convolution(n.crop, kernel_size=1, num_output=1), n.data)
    with pytest.raises(coord_map.AxisMismatchException):
        coord_map.coord_map_from_to(n.elt, n.data)


def test_layers_pycaffe_cannot_map_raise_typed_errors_instead_of_being_skipped():
    """pycaffe stops with an AssertionError or KeyError on legacy kernel_h-style fields and on a missing
    kernel_size; treated as unmapped layers the walk reported that the tops 'do not meet'. Per-axis values
    that disagree on the number of axes were NumPy's bare ValueError."""
    n = NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 1, 8, 8]))
    n.legacy = L.Convolution(n.data, kernel_h=3, kernel_w=3, num_output=1)
    with pytest.raises(caffejax.UnsupportedError, match=r"legacy \['kernel_h', 'kernel_w'\]"):
        coord_map.coord_map_from_to(n.legacy, n.data)
    n.nested = L.Pooling(n.data, pooling_param=dict(kernel_size=2, stride_h=2, stride_w=2))
    with pytest.raises(caffejax.UnsupportedError, match="legacy"):
        coord_map.coord_map_from_to(n.nested, n.data)
    n.kernelless = L.Convolution(n.data, num_output=1)
    with pytest.raises(caffejax.SchemaError, match="without kernel_size"):
        coord_map.coord_map_from_to(n.kernelless, n.data)
    n.axes = L.Convolution(n.data, kernel_size=[3, 3], stride=[1, 1, 1], num_output=1)
    with pytest.raises(caffejax.ShapeError, match=r"different numbers of spatial axes: \[2, 3\]"):
        coord_map.coord_map_from_to(n.axes, n.data)
    n.conv3d = L.Convolution(n.data, kernel_size=[3, 3, 3], num_output=1)
    n.up = L.Deconvolution(n.conv3d, kernel_size=[2, 2], stride=[2, 2], num_output=1)
    with pytest.raises(caffejax.ShapeError, match="maps along the path"):
        coord_map.coord_map_from_to(n.up, n.data)
    n.global_pool = L.Pooling(n.data, global_pooling=True)  # no map, as an InnerProduct
    with pytest.raises(caffejax.GraphError, match="do not meet"):
        coord_map.coord_map_from_to(n.global_pool, n.data)
