"""Caffe's FilterNet: keep the layers whose include/exclude rules accept the NetState (net.cpp:261-354)."""

from __future__ import annotations

from caffejax.errors import SchemaError, layer_error
from caffejax.proto import caffe_pb2


def make_state(phase: int, level: int = 0, stages=()) -> caffe_pb2.NetState:
    state = caffe_pb2.NetState(phase=phase, level=level)
    state.stage.extend(stages)
    return state


def state_meets_rule(state: caffe_pb2.NetState, rule: caffe_pb2.NetStateRule) -> bool:
    """A rule matches only if every condition it states holds (phase, level range, stages, not_stages)."""
    if rule.HasField("phase") and rule.phase != state.phase:
        return False
    if rule.HasField("min_level") and state.level < rule.min_level:
        return False
    if rule.HasField("max_level") and state.level > rule.max_level:
        return False
    if any(stage not in state.stage for stage in rule.stage):
        return False
    if any(stage in state.stage for stage in rule.not_stage):
        return False
    return True


def layer_included(layer, state: caffe_pb2.NetState) -> bool:
    """No include rules: kept unless an exclude rule matches. Include rules: kept iff one matches."""
    if len(layer.include) and len(layer.exclude):
        raise layer_error(SchemaError, layer.name, layer.type, "has both include and exclude rules; specify only "
                          "include or only exclude")
    if len(layer.include):
        return any(state_meets_rule(state, rule) for rule in layer.include)
    return not any(state_meets_rule(state, rule) for rule in layer.exclude)


def filter_net(net: caffe_pb2.NetParameter, state: caffe_pb2.NetState) -> caffe_pb2.NetParameter:
    """A copy of ``net`` holding only the layers that ``state`` includes."""
    filtered = caffe_pb2.NetParameter()
    filtered.CopyFrom(net)
    del filtered.layer[:]
    for layer in net.layer:
        if layer_included(layer, state):
            filtered.layer.add().CopyFrom(layer)
    return filtered
