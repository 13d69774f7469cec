"""Caffe's debug_info (net.cpp's InputDebugInfo, ForwardDebugInfo, BackwardDebugInfo and Backward's norms;
solver.cpp's set_debug_info on display iterations and for the test nets)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import caffejax
from caffejax.frontend.prototxt import parse_net_text
from caffejax.proto import caffe_pb2

NET = """
layer { name: "data" type: "Input" top: "data" top: "target"
        input_param { shape { dim: 2 dim: 3 } shape { dim: 2 dim: 2 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" param { name: "w" } param { lr_mult: 0 }
        inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.5 }
                              bias_filler { type: "constant" value: 0.5 } } }
layer { name: "relu" type: "ReLU" bottom: "ip" top: "ip" }
layer { name: "loss" type: "EuclideanLoss" bottom: "ip" bottom: "target" top: "loss" }
"""


def abs_mean(array) -> str:
    return f"{float(np.abs(np.asarray(array, np.float32)).mean()):g}"


def messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "[Forward]" in r.getMessage() or "[Backward]" in r.getMessage()]


def test_a_net_with_debug_info_logs_every_layers_blobs_as_caffe_does(caplog):
    net = caffejax.Net("debug_info: true\n" + NET, caffejax.TRAIN)
    rng = np.random.default_rng(0)
    net.blobs["data"].data[...] = rng.standard_normal((2, 3))
    net.blobs["target"].data[...] = rng.standard_normal((2, 2))
    caplog.set_level(logging.INFO, logger="caffejax")
    net.forward()
    w, b = (net.params["ip"][i].data for i in range(2))
    assert messages(caplog) == [
        f"    [Forward] Input data data: {abs_mean(net.blobs['data'].data)}",  # Input layers' tops are net inputs
        f"    [Forward] Input target data: {abs_mean(net.blobs['target'].data)}",
        f"    [Forward] Layer data, top blob data data: {abs_mean(net.blobs['data'].data)}",
        f"    [Forward] Layer data, top blob target data: {abs_mean(net.blobs['target'].data)}",
        f"    [Forward] Layer ip, top blob ip data: {abs_mean(net.blobs['data'].data @ w.T + b)}",
        f"    [Forward] Layer ip, param blob w data: {abs_mean(w)}",  # the ParamSpec name, else the index
        f"    [Forward] Layer ip, param blob 1 data: 0.5",
        f"    [Forward] Layer relu, top blob ip data: {abs_mean(net.blobs['ip'].data)}",
        f"    [Forward] Layer loss, top blob loss data: {abs_mean(net.blobs['loss'].data)}",
    ]
    caplog.clear()
    net.backward()
    # Only the bottoms that need a diff (not the data, not the target) and params with lr_mult != 0.
    assert messages(caplog) == [
        # EuclideanLoss: (ip - target) / num
        f"    [Backward] Layer loss, bottom blob ip diff: "
        f"{abs_mean((net.blobs['ip'].data - net.blobs['target'].data) / 2)}",
        f"    [Backward] Layer relu, bottom blob ip diff: {abs_mean(net.blobs['ip'].diff)}",
        f"    [Backward] Layer ip, param blob 0 diff: {abs_mean(net.params['ip'][0].diff)}",
    ]


def test_without_debug_info_a_pass_is_one_program_and_logs_nothing(caplog):
    net = caffejax.Net(NET, caffejax.TRAIN)
    assert not net.debug_info and not net._runs_layer_by_layer()
    caplog.set_level(logging.INFO, logger="caffejax")
    net.forward()
    net.backward()
    assert messages(caplog) == []
    net.debug_info = True  # as Net::set_debug_info
    net.forward()
    assert len(messages(caplog)) == 9


def test_a_solvers_debug_info_logs_the_train_net_on_display_iterations_and_the_test_nets_always(caplog):
    param = caffe_pb2.SolverParameter(type="SGD", base_lr=1.0, lr_policy="fixed", display=2, max_iter=3,
                                      debug_info=True, test_iter=[1], test_interval=10, test_initialization=False)
    param.net_param.CopyFrom(parse_net_text(NET))
    solver = caffejax.get_solver(param)
    assert solver.test_nets[0].debug_info
    rng = np.random.default_rng(1)
    solver.net.blobs["data"].data[...] = rng.standard_normal((2, 3))
    solver.net.blobs["target"].data[...] = rng.standard_normal((2, 2))
    caplog.set_level(logging.INFO, logger="caffejax")
    before = [np.array(b.data) for b in solver.net.params["ip"]]
    solver.step(1)  # iteration 0: displayed
    norms = [r for r in caplog.records if "All net params" in r.getMessage()]
    assert len(norms) == 1 and norms[0].levelno == logging.ERROR  # Caffe logs it with LOG(ERROR)
    # base_lr 1, no momentum or decay: the update left in the diffs is the gradient the line summed.
    grads = [np.asarray(b.diff, np.float32) for b in solver.net.params["ip"]]
    grads[1] = np.zeros_like(grads[1])  # lr_mult 0: no gradient (its update is 0 too)
    l1 = (sum(float(np.abs(a).sum()) for a in before), sum(float(np.abs(g).sum()) for g in grads))
    l2 = tuple(np.sqrt(sum(float(np.square(a).sum()) for a in arrays)) for arrays in (before, grads))
    assert norms[0].getMessage() == (f"    [Backward] All net params (data, diff): L1 norm = ({l1[0]:g}, {l1[1]:g}); "
                                     f"L2 norm = ({l2[0]:g}, {l2[1]:g})")
    assert any("[Forward] Layer ip, top blob ip data" in m for m in messages(caplog))
    caplog.clear()
    solver.step(1)  # iteration 1: not displayed, so not logged, and run as one program
    assert messages(caplog) == [] and not solver.net.debug_info
    solver.test(0)
    assert "    [Forward] Layer loss, top blob loss data: " in "\n".join(messages(caplog))


def test_debug_info_is_refused_for_data_parallel_training():
    param = caffe_pb2.SolverParameter(type="SGD", base_lr=1.0, lr_policy="fixed", display=1, max_iter=1,
                                      debug_info=True)
    param.net_param.CopyFrom(parse_net_text(NET))
    with pytest.raises(caffejax.UnsupportedError, match="debug_info with devices=1"):
        caffejax.get_solver(param, devices=1)
