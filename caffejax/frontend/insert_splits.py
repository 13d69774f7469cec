"""Caffe's InsertSplits (insert_splits.cpp): a blob consumed more than once is fanned out by a Split layer.

Caffe blobs have one diff, so a blob read by several layers gets a Split whose backward sums the diffs.
The names are Caffe's, because users (and caffemodels, and the reference figures) see them:
layer ``{blob}_{producer}_{top_index}_split`` with tops ``{blob}_{producer}_{top_index}_split_{k}``.
An explicit nonzero loss_weight on a top counts as one more use: the Split carries it on its first top.
Legacy net-level ``input:`` blobs count as the tops of a producer named ``input`` (index -1, as in Caffe); their
Splits come first, before every layer.
"""

from __future__ import annotations

from caffejax.errors import GraphError, layer_error
from caffejax.proto import caffe_pb2


def split_layer_name(layer_name: str, blob_name: str, blob_index: int) -> str:
    return f"{blob_name}_{layer_name}_{blob_index}_split"


def split_blob_name(layer_name: str, blob_name: str, blob_index: int, split_index: int) -> str:
    return f"{blob_name}_{layer_name}_{blob_index}_split_{split_index}"


def insert_splits(net: caffe_pb2.NetParameter) -> caffe_pb2.NetParameter:
    """A copy of ``net`` with Split layers inserted where Caffe inserts them (idempotent)."""
    last_top: dict[str, tuple[int, int]] = {}           # blob name -> (layer, top index) that last wrote it
    source_of_bottom: dict[tuple[int, int], tuple[int, int]] = {}
    uses: dict[tuple[int, int], int] = {}
    loss_weight: dict[tuple[int, int], float] = {}
    for j, blob in enumerate(net.input):
        last_top[blob] = (-1, j)
    for i, layer in enumerate(net.layer):
        for j, blob in enumerate(layer.bottom):
            if blob not in last_top:
                raise layer_error(GraphError, layer.name, layer.type, f"unknown bottom blob '{blob}' (bottom index "
                                  f"{j}); no earlier layer produces it")
            source_of_bottom[(i, j)] = last_top[blob]
            uses[last_top[blob]] = uses.get(last_top[blob], 0) + 1
        for j, blob in enumerate(layer.top):
            last_top[blob] = (i, j)
        for j in range(min(len(layer.loss_weight), len(layer.top))):
            top = last_top[layer.top[j]]
            loss_weight[top] = layer.loss_weight[j]
            if loss_weight[top]:
                uses[top] = uses.get(top, 0) + 1

    result = caffe_pb2.NetParameter()
    result.CopyFrom(net)
    del result.layer[:]
    next_split: dict[tuple[int, int], int] = {}

    def producer_name(index: int) -> str:
        return "input" if index == -1 else net.layer[index].name

    def add_split(producer: str, blob: str, top_index: int, count: int, weight: float) -> None:
        split = result.layer.add()
        split.name = split_layer_name(producer, blob, top_index)
        split.type = "Split"
        split.bottom.append(blob)
        for k in range(count):
            split.top.append(split_blob_name(producer, blob, top_index, k))
            if weight:
                split.loss_weight.append(weight if k == 0 else 0.0)

    for j, blob in enumerate(net.input):
        if uses.get((-1, j), 0) > 1:
            add_split("input", blob, j, uses[(-1, j)], 0.0)
    for i, original in enumerate(net.layer):
        layer = result.layer.add()
        layer.CopyFrom(original)
        for j, blob in enumerate(layer.bottom):
            top = source_of_bottom[(i, j)]
            if uses.get(top, 0) > 1:
                k = next_split.get(top, 0)
                layer.bottom[j] = split_blob_name(producer_name(top[0]), blob, top[1], k)
                next_split[top] = k + 1
        for j, blob in enumerate(layer.top):
            top = (i, j)
            count = uses.get(top, 0)
            if count > 1:
                weight = loss_weight.get(top, 0.0)
                add_split(layer.name, blob, j, count, weight)
                if weight:
                    del layer.loss_weight[:]
                    next_split[top] = next_split.get(top, 0) + 1
    return result
