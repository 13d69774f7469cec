"""Caffe's ``debug_info``: the mean absolute value of every blob a layer writes, logged as the net runs.

Net::ForwardFromTo, BackwardFromTo and Backward (net.cpp) log, when the net's ``debug_info`` is set:

    [Forward] Input data data: 0.5                    every input blob, at the start of a forward
    [Forward] Layer conv1, top blob conv1 data: 0.3   each top after the layer's forward, then each of
    [Forward] Layer conv1, param blob 0 data: 0.02    its param blobs (by ParamSpec name, else index)
    [Backward] Layer conv1, bottom blob data diff: 1e-05   after a layer's backward: the bottoms that need a
    [Backward] Layer conv1, param blob 0 diff: 0.001       diff, and the params with lr_mult != 0 (by index)
    [Backward] All net params (data, diff): L1 norm = (a, b); L2 norm = (c, d)   after a whole Backward()

Each figure is asum / count in float. A net's ``debug_info`` comes from its NetParameter; a solver's
``debug_info`` turns it on for the train net on display iterations and for the test nets always, as
Solver::Step and InitTestNets do. The figures need every layer's output, so a net with debug_info on runs
layer by layer, like a net with layer callbacks: slow, for debugging only.
"""

from __future__ import annotations

import logging

import numpy as np

from caffejax.runtime.mode import log_float

log = logging.getLogger("caffejax")


def abs_mean(array) -> np.float32:
    """Blob::asum_data() / count() in float."""
    array = np.asarray(array, np.float32)
    return np.float32(np.abs(array).sum(dtype=np.float32) / np.float32(max(array.size, 1)))


def log_inputs(net) -> None:
    """Net::InputDebugInfo for every input blob."""
    for name in net.inputs:
        log.info("    [Forward] Input %s data: %s", name, log_float(abs_mean(net.blobs[name].data)))


def log_forward(net, index: int) -> None:
    """Net::ForwardDebugInfo: layer ``index``'s tops, then its param blobs, after its forward."""
    layer = net.graph.layers[index]
    for top in layer.tops:
        log.info("    [Forward] Layer %s, top blob %s data: %s", layer.name, top,
                 log_float(abs_mean(net.blobs[top].data)))
    for slot, blob in zip(layer.params, net.layers[index].blobs):
        log.info("    [Forward] Layer %s, param blob %s data: %s", layer.name, slot.name or slot.index,
                 log_float(abs_mean(blob.data)))


def log_backward(net, index: int) -> None:
    """Net::BackwardDebugInfo: layer ``index``'s bottom diffs and param diffs, after its backward (BackwardFromTo
    calls it only for a layer that needs one)."""
    layer = net.graph.layers[index]
    for bottom, needed in zip(layer.bottoms, layer.bottom_need_backward):
        if needed:
            log.info("    [Backward] Layer %s, bottom blob %s diff: %s", layer.name, bottom,
                     log_float(abs_mean(net.blobs[bottom].diff)))
    for slot, blob, needed in zip(layer.params, net.layers[index].blobs, layer.param_need_backward):
        if needed:
            log.info("    [Backward] Layer %s, param blob %d diff: %s", layer.name, slot.index,
                     log_float(abs_mean(blob.diff)))


def log_param_norms(net) -> None:
    """The end of Net::Backward(): L1 and L2 norms of every param blob that owns its storage, data and diff,
    summed in float. Caffe logs it at ERROR level; so does this."""
    sums = np.zeros(4, np.float32)  # asum data, asum diff, sumsq data, sumsq diff
    for layer, blobs in zip(net.graph.layers, (view.blobs for view in net.layers)):
        for slot, blob in zip(layer.params, blobs):
            if slot.is_owner:
                data, diff = (np.asarray(a, np.float32) for a in (blob.data, blob.diff))
                sums += np.array([np.abs(data).sum(dtype=np.float32), np.abs(diff).sum(dtype=np.float32),
                                  np.square(data).sum(dtype=np.float32), np.square(diff).sum(dtype=np.float32)],
                                 np.float32)
    log.error("    [Backward] All net params (data, diff): L1 norm = (%s, %s); L2 norm = (%s, %s)",
              log_float(sums[0]), log_float(sums[1]), log_float(np.sqrt(sums[2])), log_float(np.sqrt(sums[3])))
