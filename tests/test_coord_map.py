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
