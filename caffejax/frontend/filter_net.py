"""Caffe's FilterNet: keep the layers whose include/exclude rules accept the NetState (net.cpp:261-354)."""

from __future__ import annotations

from caffejax.errors import SchemaError, layer_error
from caffejax.proto import caffe_pb2


def make_state(phase: int, level: int = 0, stages=()) -> caffe_pb2.NetState:
    state = caffe_pb2.NetState(phase=phase, level=level)
    state.stage.extend(stages)
    return state


def with_state(net: caffe_pb2.NetParameter, phase: int, level: int = 0, stages=()) -> caffe_pb2.NetParameter:
    """A copy of ``net`` whose NetState is the one a Net of this phase, level and stages is made with (what
    FilterNet filters by, and what Caffe prints among the net's parameters)."""
    stated = caffe_pb2.NetParameter()
    stated.CopyFrom(net)
    stated.state.phase = phase
    stated.state.level = level
    stated.state.stage.extend(stages)
    return stated


def state_meets_rule(state: caffe_pb2.NetState, rule: caffe_pb2.NetStateRule) -> bool:
    """A rule matches only if every condition it states holds (phase, level range, stages, not_stages)."""
    return rule_failure(state, rule) is None


def rule_failure(state: caffe_pb2.NetState, rule: caffe_pb2.NetStateRule) -> str | None:
    """Why ``state`` fails ``rule``, in Net::StateMeetsRule's words (its first broken condition, checked in its
    order: phase, min_level, max_level, stages, not_stages), or None where the rule holds. Caffe's wording is
    kept, its "is above the min_level" for a level below it included."""
    if rule.HasField("phase") and rule.phase != state.phase:
        return f"The NetState phase ({state.phase}) differed from the phase ({rule.phase})"
    if rule.HasField("min_level") and state.level < rule.min_level:
        return f"The NetState level ({state.level}) is above the min_level ({rule.min_level})"
    if rule.HasField("max_level") and state.level > rule.max_level:
        return f"The NetState level ({state.level}) is above the max_level ({rule.max_level})"
    for stage in rule.stage:
        if stage not in state.stage:
            return f"The NetState did not contain stage '{stage}'"
    for stage in rule.not_stage:
        if stage in state.stage:
            return f"The NetState contained a not_stage '{stage}'"
    return None


def layer_included(layer, state: caffe_pb2.NetState, notes: list[str] | None = None) -> bool:
    """No include rules: kept unless an exclude rule matches. Include rules: kept iff one matches. ``notes``
    gets Net::FilterNet's log line for every rule it checks and finds broken (rules are checked in order, up
    to the first that decides)."""
    if len(layer.include) and len(layer.exclude):
        raise layer_error(SchemaError, layer.name, layer.type, "has both include and exclude rules; specify only "
                          "include or only exclude")
    rules, decides = (layer.include, True) if len(layer.include) else (layer.exclude, False)
    for rule in rules:
        failure = rule_failure(state, rule)
        if failure is None:
            return decides
        if notes is not None:
            notes.append(f"{failure} specified by a rule in layer {layer.name}")
    return not decides


def filter_net(net: caffe_pb2.NetParameter, state: caffe_pb2.NetState,
               notes: list[str] | None = None) -> caffe_pb2.NetParameter:
    """A copy of ``net`` holding only the layers that ``state`` includes (``notes``: see layer_included)."""
    filtered = caffe_pb2.NetParameter()
    filtered.CopyFrom(net)
    del filtered.layer[:]
    for layer in net.layer:
        if layer_included(layer, state, notes):
            filtered.layer.add().CopyFrom(layer)
    return filtered
