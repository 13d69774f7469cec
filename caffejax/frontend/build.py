"""From a NetParameter to the shape-inferred :class:`~caffejax.frontend.ir.Graph`, as Caffe's Net::Init does.

Order as in Caffe: upgrade, set the NetState, FilterNet, InsertSplits, then one pass over the layers that
wires bottoms/tops (AppendBottom/AppendTop), allocates learnable blobs and resolves sharing (AppendParam),
infers top shapes (each rule's forward under ``jax.eval_shape``), and finally the two backward-need sweeps.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from caffejax.errors import (CaffejaxError, DataSourceUnavailable, GraphError, SchemaError, ShapeError,
                             UnsupportedError, layer_error)
from caffejax.frontend.filter_net import filter_net, with_state
from caffejax.frontend.insert_splits import insert_splits
from caffejax.frontend.ir import Graph, Layer, ParamSlot, Shape, readers_by_value
from caffejax.frontend.prototxt import as_bvlc_message, parse_net_text
from caffejax.frontend.upgrade import upgrade_net_as_needed
from caffejax.lower.registry import LayerContext, LayerRule, get_rule
from caffejax.proto import caffe_pb2

AUTOMATIC_TOP = "(automatic)"
MAX_BLOB_ELEMENTS = 2 ** 34  # 64 GiB of float32: anything larger is a typo or a hostile file


def load_net_param(source, *, is_path: bool | None = None) -> caffe_pb2.NetParameter:
    """Read a prototxt (path or text, or a NetParameter) and upgrade it as Caffe's UpgradeNetAsNeeded does."""
    source = as_bvlc_message(source, caffe_pb2.NetParameter)  # a NetSpec's, with fork fields
    if isinstance(source, caffe_pb2.NetParameter):
        net = source
        where = "<NetParameter>"
    else:
        net = parse_net_text(source, is_path=is_path)
        where = os.fspath(source) if is_path or isinstance(source, os.PathLike) else "<string>"
    return upgrade_net_as_needed(net, where)


def build_graph(net: caffe_pb2.NetParameter, phase: int, level: int = 0, stages: Sequence[str] = (),
                input_shapes: Mapping[str, Shape] | None = None, base_dir: str | None = None,
                allow_python_layers: bool = False, concrete_inputs: Mapping[str, np.ndarray] | None = None,
                python_layers: Any = None, defer_shape_errors: bool = True) -> Graph:
    """Filter, split, wire and shape-infer an (already upgraded) NetParameter.

    ``input_shapes`` overrides the shapes of Input tops (``net.reshape`` after a user resized an input), and of
    the tops of layers run on the host (what their last forward made).
    ``base_dir`` resolves relative data-source paths. ``concrete_inputs`` (fed blob name -> data) gives the
    values of blobs whose data decide shapes (Filter's selector); absent ones count as zeros, the data a
    fresh Caffe blob holds. ``python_layers``: the net's pycaffe layer objects (PythonLayers), which
    ``Python`` layers' setup and reshape run on. ``defer_shape_errors``: where layers after one sizing its tops
    by the data do not fit, leave their shapes unknown until it has run (Graph.deferred_errors) instead of
    raising (Net::Init's first Reshape raises; a rebuild for new inputs waits, as Caffe's Forward reshapes).
    """
    param = with_state(net, phase, level, stages)
    param = filter_net(param, param.state)
    distinct_layer_names(param)
    param = insert_splits(param)
    builder = _Builder(param, phase, dict(input_shapes or {}), base_dir, allow_python_layers,
                       dict(concrete_inputs or {}), python_layers, defer_shape_errors)
    for index, layer_param in enumerate(param.layer):
        builder.add_layer(index, layer_param)
    return builder.finish()


def may_size_tops_by_data(lp, params, is_input: bool) -> bool:
    """Whether a layer's forward may size its tops by the data although the build shaped them (TopsSizedByData):
    a Python layer with bottoms, no learnable blobs (``params``: their shapes or slots) and no top in place."""
    # The type first: a solver step asks this of every layer, and reading the protobuf's repeated fields for the
    # in-place scan first cost GoogLeNet's 169 layers 222 us a step (now 21 us), LeNet's 9 12 us (now 1.4 us).
    if lp.type != "Python" or is_input or not lp.bottom or params:
        return False
    return not any(i < len(lp.bottom) and top == lp.bottom[i] for i, top in enumerate(lp.top))


def distinct_layer_names(net: caffe_pb2.NetParameter) -> None:
    """Renames, in place, each layer whose name an earlier layer of ``net`` has to ``name#k`` (the k-th layer of
    that name).

    Caffe runs such a net and tells its layers apart by index (BVLC's mnist_autoencoder names two loss layers
    'loss'; Caffe's test_net.cpp TrickyNet, two InnerProduct layers 'innerproduct'). caffejax keys a layer's
    kernel, learnable blobs, data source and fused chain by its name: with two Pooling layers named alike, the
    second ran with the first's window. Weights go by name in a caffemodel too: a file Caffe saved from such a
    net holds two layers of one name, which Net.copy_from refuses (Caffe copies both into the first), and one
    caffejax saved names the later layer ``name#k``, which Caffe ignores when it reads it into the prototxt.
    """
    taken = {lp.name for lp in net.layer}
    seen: dict[str, int] = {}
    for lp in net.layer:
        count = seen[lp.name] = seen.get(lp.name, 0) + 1
        if count > 1:
            name = f"{lp.name}#{count}"
            while name in taken:
                count += 1
                name = f"{lp.name}#{count}"
            taken.add(name)
            lp.name = name


class _Builder:
    def __init__(self, param, phase, input_shapes, base_dir, allow_python_layers, concrete_inputs, python_layers,
                 defer_shape_errors: bool = True):
        self.param = param
        self.defer_shape_errors = defer_shape_errors
        self.python_layers = python_layers
        self.concrete_inputs = concrete_inputs
        self.concrete: dict[str, np.ndarray] = {}
        self.fed_values: dict[str, str] = {}  # value id -> fed blob name
        self.phase = phase
        self.input_shapes = input_shapes
        self.base_dir = base_dir
        self.allow_python_layers = allow_python_layers
        self.layers: list[Layer] = []
        self.blobs: list[str] = []
        self.blob_value: dict[str, str] = {}
        self.blob_first_value: dict[str, str] = {}
        self.value_shapes: dict[str, Shape | None] = {}
        self.available: set[str] = set()
        self.blob_need_backward: dict[str, bool] = {}
        self.inputs: list[str] = []
        self.named_params: dict[str, ParamSlot] = {}
        self.slots: dict[tuple[str, int], ParamSlot] = {}
        self.loss_weights: dict[str, float] = {}
        self.top_shapes_by_config: dict[tuple, list[Shape]] = {}
        self.rules: list[LayerRule] = []  # one per layer, in order (layer names need not be unique)
        # Values whose shapes a layer sizing its tops by the data decides (Graph.deferred_errors): value id -> the
        # names of those layers upstream.
        self.sized_by: dict[str, tuple[str, ...]] = {}
        self.deferred_errors: dict[str, tuple[Exception, tuple[str, ...]]] = {}

    # -- one layer ------------------------------------------------------------------------------------------
    def add_layer(self, index: int, lp) -> None:
        if not lp.HasField("phase"):
            lp.phase = self.phase
        rule = self._rule(lp)
        self._check_counts(lp, rule)
        on_host = self._runs_on_host(lp, rule)
        if len(lp.propagate_down) not in (0, len(lp.bottom)):
            raise layer_error(SchemaError, lp.name, lp.type,
                              f"propagate_down has {len(lp.propagate_down)} entries; it must be empty or have "
                              f"one per bottom ({len(lp.bottom)})")

        bottom_values, bottom_need = [], []
        need_backward = False
        for j, blob in enumerate(lp.bottom):
            if blob not in self.available:
                raise layer_error(GraphError, lp.name, lp.type,
                                  f"unknown bottom blob '{blob}' (bottom index {j}): no earlier layer produces "
                                  "it, or it was already consumed")
            self.available.discard(blob)
            bottom_values.append(self.blob_value[blob])
            need = self.blob_need_backward[blob]
            need_backward |= need
            bottom_need.append(bool(lp.propagate_down[j]) if len(lp.propagate_down) else need)

        tops = list(lp.top)
        if rule.is_loss and not tops:
            tops = [AUTOMATIC_TOP]  # Caffe's anonymous top for a loss layer without one
        top_values = []
        for j, blob in enumerate(tops):
            if blob == AUTOMATIC_TOP:
                # Caffe lists the anonymous top among the blobs (pycaffe shows one '(automatic)' entry) but
                # never lets another layer consume it.
                value = f"{AUTOMATIC_TOP}@{index}"
                if AUTOMATIC_TOP not in self.blob_first_value:
                    self.blobs.append(AUTOMATIC_TOP)
                    self.blob_first_value[AUTOMATIC_TOP] = value
                    self.blob_need_backward[AUTOMATIC_TOP] = False
            elif j < len(lp.bottom) and blob == lp.bottom[j]:
                if not rule.in_place or on_host:
                    raise layer_error(GraphError, lp.name, lp.type, f"cannot run in place (top '{blob}')")
                value = f"{blob}@{index}"
            elif blob in self.blob_value:
                raise layer_error(GraphError, lp.name, lp.type,
                                  f"top blob '{blob}' is produced by multiple sources (a top may reuse a name "
                                  "only in place, as the bottom at the same index)")
            else:
                value = blob
                self.blobs.append(blob)
                self.blob_first_value[blob] = value
                self.blob_need_backward[blob] = False
            top_values.append(value)

        bottom_shapes = [self.value_shapes[v] for v in bottom_values]
        concrete = self._concrete_bottoms(lp, rule, bottom_values, bottom_shapes)
        sized_by = tuple(dict.fromkeys(name for v in bottom_values for name in self.sized_by.get(v, ())))
        param_shapes, top_shapes, is_input = self._shapes(lp, rule, tops, bottom_shapes, concrete, on_host, sized_by)
        if on_host or may_size_tops_by_data(lp, param_shapes, is_input):
            sized_by = (*sized_by, lp.name)
        self.sized_by.update((value, sized_by) for value in top_values if sized_by)
        for j, (blob, shape) in enumerate(zip(tops, top_shapes)):
            if (j < len(lp.bottom) and blob == lp.bottom[j] and None not in (shape, bottom_shapes[j])
                    and tuple(shape) != tuple(bottom_shapes[j])):
                raise layer_error(ShapeError, lp.name, lp.type,
                                  f"runs in place on blob '{blob}' but changes its shape {tuple(bottom_shapes[j])} "
                                  f"-> {tuple(shape)}: Caffe reshapes the shared blob to the top's shape, which the "
                                  "layer's next pass reads as its bottom; give the top a name of its own")
        if rule.frozen_params:
            while len(lp.param) < len(param_shapes):
                lp.param.add(lr_mult=0)  # BatchNorm::LayerSetUp masks its statistics from the solver
        params = [self._append_param(lp, i, shape) for i, shape in enumerate(param_shapes)]
        if len(lp.param) > len(params) and all(s is not None for s in bottom_shapes):
            raise layer_error(SchemaError, lp.name, lp.type,
                              f"{len(lp.param)} param specs given but the layer has {len(params)} learnable blobs")
        # Net::Init decides param_propagate_down from the layer's own ParamSpec (lr_mult defaults to 1), not
        # from the shared owner's: a sharer without lr_mult still backpropagates into the shared diff.
        own_specs = [lp.param[i] if i < len(lp.param) else caffe_pb2.ParamSpec() for i in range(len(params))]
        param_need = [spec.lr_mult != 0 for spec in own_specs]
        need_backward |= any(param_need)

        for blob, value, shape in zip(tops, top_values, top_shapes):
            self.value_shapes[value] = shape
            self.blob_value[blob] = value
            if blob != AUTOMATIC_TOP:
                self.available.add(blob)
        if lp.type == "Input":
            self.inputs.extend(tops)
        if is_input:
            self.fed_values.update(zip(top_values, tops))

        state_in, state_out = self._state_values(lp, rule, bottom_shapes)
        loss_weights = self._loss_weights(lp, rule, len(tops))
        if on_host and any(loss_weights):
            raise layer_error(SchemaError, lp.name, lp.type, "runs on the host after the compiled program and has "
                              f"no gradient, so its tops cannot carry a loss_weight (got {loss_weights})")
        for blob, weight in zip(tops, loss_weights):
            self.loss_weights[blob] = weight
        layer = Layer(name=lp.name, type=lp.type, proto=lp, bottoms=list(lp.bottom), tops=tops,
                      bottom_values=bottom_values, top_values=top_values, params=params,
                      loss_weights=loss_weights, need_backward=need_backward,
                      bottom_need_backward=bottom_need, param_need_backward=param_need, is_input=is_input,
                      state_in=state_in, state_out=state_out, runs_on_host=on_host)
        if need_backward:
            for blob in tops:
                self.blob_need_backward[blob] = True
        self.layers.append(layer)
        self.rules.append(rule)

    def _rule(self, lp) -> LayerRule:
        if lp.type == "Python" and not self.allow_python_layers:
            from caffejax.lower import forks  # lazy: forks imports this module

            p = lp.python_param
            raise layer_error(UnsupportedError, lp.name, lp.type,
                              f"Python layer (module '{p.module}', class '{p.layer}') is not run: model files must "
                              "not execute code. Register a pure-JAX replacement with caffejax.register_layer, or "
                              "pass allow_python_layers=True (on the command line, --allow-python-layers) if you "
                              "trust this model." + forks.python_layer_hint(p.module, p.layer, p.param_str))
        try:
            return get_rule(lp.type)
        except KeyError:
            from caffejax.lower import forks  # the fork layers caffejax ships (lazy: forks imports this module)

            fork = forks.of_type(lp.type)
            hint = f". {forks.enabling_hint(fork)}" if fork is not None else ""
            raise layer_error(GraphError, lp.name, lp.type or "<empty>",
                              f"unknown layer type '{lp.type}'{hint}") from None

    def _check_counts(self, lp, rule: LayerRule) -> None:
        for what, got, (lo, hi) in (("bottom", len(lp.bottom), rule.bottoms), ("top", len(lp.top), rule.tops)):
            if what == "top" and rule.is_loss and got == 0:
                continue  # the anonymous loss top
            if got < lo or (hi is not None and got > hi):
                want = f"exactly {lo}" if lo == hi else (f"at least {lo}" if hi is None else f"{lo} to {hi}")
                raise layer_error(SchemaError, lp.name, lp.type, f"takes {want} {what} blob(s), got {got}")

    def _concrete_bottoms(self, lp, rule: LayerRule, bottom_values, bottom_shapes) -> dict[int, np.ndarray]:
        """Bottoms whose data decide this layer's top shapes: their (fed) data, by bottom index."""
        if rule.shape_from_values is None:
            return {}
        concrete = {}
        for j in rule.shape_from_values(lp):
            value = bottom_values[j]
            if value not in self.fed_values:
                raise layer_error(UnsupportedError, lp.name, lp.type,
                                  f"bottom '{lp.bottom[j]}' decides the top shapes by its values, so it must be "
                                  "a fed blob (an Input or data layer's top); here a layer computes it")
            if bottom_shapes[j] is None:
                continue
            data = self.concrete_inputs.get(self.fed_values[value])
            data = np.zeros(bottom_shapes[j], np.float32) if data is None else np.asarray(data, np.float32)
            if data.shape != tuple(bottom_shapes[j]):
                raise layer_error(ShapeError, lp.name, lp.type, f"data for '{lp.bottom[j]}' has shape "
                                  f"{data.shape}, the blob is {tuple(bottom_shapes[j])}")
            concrete[j] = self.concrete[value] = data
        return concrete

    def _runs_on_host(self, lp, rule: LayerRule) -> bool:
        """Whether the layer's top shapes depend on the data, so that it runs on the host (Layer.runs_on_host): its
        rule's host_forward says so, or a Python layer's forward sized its tops by the data in an earlier pass of
        this net (PythonLayers.runs_on_host)."""
        if rule.host_forward is not None and not rule.host_when_read_on_host:
            return True
        return lp.type == "Python" and self.python_layers is not None and self.python_layers.runs_on_host(lp)

    def _shapes(self, lp, rule: LayerRule, tops, bottom_shapes, concrete, on_host: bool, sized_by=()):
        """(param shapes, top shapes, is_input) of one layer; shapes are None downstream of unknown data, and
        where bottoms that layers sizing their tops by the data (``sized_by``) made do not fit (deferred)."""
        shapes = None  # the shapes of a fed layer's tops (is_input)
        if lp.type == "Python":  # a data layer's tops are fed: it runs on the host before each pass
            from caffejax.lower.python_layer import data_layer_top_shapes  # noqa: PLC0415 (runtime imports build)
            shapes = data_layer_top_shapes(lp, self.phase, self.python_layers)
        elif rule.input_shapes is not None:
            try:
                shapes = _declared(rule, lp, self.phase, self.base_dir, len(tops))
            except DataSourceUnavailable:
                shapes = [None] * len(tops)
        if shapes is not None:
            shapes = [tuple(self.input_shapes[t]) if t in self.input_shapes else s for t, s in zip(tops, shapes)]
            for s in shapes:
                if s is not None:
                    _check_shape(lp, s)
            return [], shapes, True
        if any(s is None for s in bottom_shapes):
            return [], [None] * len(tops), False
        try:
            if lp.type == "Python":  # its learnable blobs are those its setup adds: run it now, as LayerSetUp does
                from caffejax.lower.python_layer import learnable_blob_shapes  # noqa: PLC0415 (runtime imports build)
                param_shapes = learnable_blob_shapes(lp, self.phase, bottom_shapes, self.python_layers)
            else:
                param_shapes = [tuple(int(d) for d in s) for s in rule.param_shapes(lp, bottom_shapes)]
        except CaffejaxError:
            raise
        except Exception as e:  # a rule's shape code tripped on a configuration it did not anticipate
            raise layer_error(ShapeError, lp.name, lp.type,
                              f"cannot allocate learnable blobs for bottom shapes {bottom_shapes}: "
                              f"{type(e).__name__}: {_first_line(e)}") from None
        for i, s in enumerate(param_shapes):
            _check_shape(lp, s)
            if rule.init_params is not None and 0 in s:
                # Caffe's fillers CHECK that a blob has elements; say which blob before any filler runs.
                raise layer_error(ShapeError, lp.name, lp.type,
                                  f"learnable blob {i} would have shape {tuple(s)}, with no elements (bottom "
                                  f"shapes {[tuple(b) for b in bottom_shapes]}); is num_output or a dim 0?")
        if on_host and tops and all(t in self.input_shapes for t in tops):
            # What its last forward on the host made (Net keeps them: layers after it are shaped by the data)
            top_shapes = [tuple(self.input_shapes[t]) for t in tops]
        else:
            try:
                top_shapes = self._infer_top_shapes(lp, rule, bottom_shapes, param_shapes, len(tops), concrete)
            except ShapeError as e:
                if not sized_by or not self.defer_shape_errors:
                    raise
                # Bottoms a layer sizing its tops by the data made, as its last forward (or a Python layer's
                # reshape) left them: that layer's next forward may give them the shapes that fit.
                self.deferred_errors[lp.name] = (e, sized_by)
                return param_shapes, [None] * len(tops), False
        for s in top_shapes:
            _check_shape(lp, s)
        return param_shapes, top_shapes, False

    def _infer_top_shapes(self, lp, rule: LayerRule, bottom_shapes, param_shapes, num_tops: int, concrete):
        """infer_top_shapes, traced once per distinct layer configuration: deep nets repeat a few blocks
        (ResNet-152's 720 layers have 60 configurations), and each trace costs milliseconds. Not for Python
        layers: each has its own object, whose setup and reshape Caffe runs at build, however alike two are."""
        if concrete or lp.type == "Python":
            return infer_top_shapes(lp, rule, self.phase, bottom_shapes, param_shapes, num_tops, concrete=concrete,
                                    python_layers=self.python_layers)
        if rule.top_shapes is not None:
            try:
                return [tuple(int(d) for d in s) for s in rule.top_shapes(lp, bottom_shapes, param_shapes, num_tops)]
            except CaffejaxError:
                raise
            except Exception as e:
                raise _shapes_do_not_fit(lp, bottom_shapes, param_shapes, e) from None
        config = caffe_pb2.LayerParameter()
        config.CopyFrom(lp)
        config.ClearField("name")  # names only label errors; the wiring enters through shapes and in_place
        del config.bottom[:], config.top[:]
        in_place = tuple(i < len(lp.bottom) and t == lp.bottom[i] for i, t in enumerate(lp.top))
        key = (config.SerializeToString(deterministic=True), tuple(tuple(s) for s in bottom_shapes),
               tuple(param_shapes), num_tops, in_place)
        if key not in self.top_shapes_by_config:
            self.top_shapes_by_config[key] = infer_top_shapes(lp, rule, self.phase, bottom_shapes, param_shapes,
                                                              num_tops, python_layers=self.python_layers)
        return list(self.top_shapes_by_config[key])

    def _state_values(self, lp, rule: LayerRule, bottom_shapes) -> tuple[list[str], list[str]]:
        """Value ids (and shapes) of the state the layer carries between forwards, if its rule has any."""
        if rule.state_shapes is None or any(s is None for s in bottom_shapes):
            return [], []
        shapes = [tuple(int(d) for d in s) for s in rule.state_shapes(lp, bottom_shapes)]
        state_in = [f"{lp.name}@@state{i}" for i in range(len(shapes))]
        state_out = [f"{v}@@next" for v in state_in]
        for value_in, value_out, shape in zip(state_in, state_out, shapes):
            self.value_shapes[value_in] = self.value_shapes[value_out] = shape
        return state_in, state_out

    def _append_param(self, lp, index: int, shape: Shape) -> ParamSlot:
        spec = lp.param[index] if index < len(lp.param) else caffe_pb2.ParamSpec()
        slot = ParamSlot(layer=lp.name, index=index, shape=shape, name=spec.name, lr_mult=spec.lr_mult,
                         decay_mult=spec.decay_mult, has_lr_mult=spec.HasField("lr_mult"),
                         has_decay_mult=spec.HasField("decay_mult"), share_mode=spec.share_mode)
        owner = self.named_params.get(spec.name) if spec.name else None
        if owner is None:
            if spec.name:
                self.named_params[spec.name] = slot
        else:
            self._check_share(lp, slot, owner)
            slot.owner = owner.key
            for attr in ("lr_mult", "decay_mult"):
                has = f"has_{attr}"
                if getattr(slot, has):
                    if getattr(owner, has) and getattr(owner, attr) != getattr(slot, attr):
                        raise layer_error(SchemaError, lp.name, lp.type,
                                          f"shared param '{spec.name}' has mismatched {attr} "
                                          f"({getattr(slot, attr)} here, {getattr(owner, attr)} in layer "
                                          f"'{owner.layer}')")
                    setattr(owner, has, True)
                    setattr(owner, attr, getattr(slot, attr))
                for s in self.slots.values():  # every sharer sees the owner's effective multiplier
                    if s.owner == owner.key:
                        setattr(s, attr, getattr(owner, attr))
                setattr(slot, attr, getattr(owner, attr))
        self.slots[slot.key] = slot
        return slot

    def _check_share(self, lp, slot: ParamSlot, owner: ParamSlot) -> None:
        if slot.shape is None or owner.shape is None:
            return
        if slot.share_mode == caffe_pb2.ParamSpec.PERMISSIVE:
            ok = int(np.prod(slot.shape)) == int(np.prod(owner.shape))
            what = "count"
        else:
            ok = tuple(slot.shape) == tuple(owner.shape)
            what = "shape"
        if not ok:
            raise layer_error(ShapeError, lp.name, lp.type,
                              f"cannot share param '{slot.name}' owned by layer '{owner.layer}': {what} mismatch "
                              f"(owner shape {owner.shape}, this layer's shape {slot.shape})")

    def _loss_weights(self, lp, rule: LayerRule, num_tops: int) -> list[float]:
        weights = list(lp.loss_weight)
        if rule.is_loss and not weights:
            weights = [1.0]  # LossLayer::LayerSetUp
        if weights and len(weights) != num_tops:
            raise layer_error(SchemaError, lp.name, lp.type,
                              f"loss_weight must be unspecified or given once per top blob ({len(weights)} "
                              f"given, {num_tops} tops)")
        return weights or [0.0] * num_tops

    # -- the whole net --------------------------------------------------------------------------------------
    def finish(self) -> Graph:
        self._sweep_backward()
        swept = tuple(layer.need_backward for layer in self.layers)
        if self.param.force_backward:
            for layer, rule in zip(self.layers, self.rules):
                layer.need_backward = True
                for j, blob in enumerate(layer.bottoms):
                    layer.bottom_need_backward[j] = (layer.bottom_need_backward[j]
                                                     or rule.allow_force_backward(layer.proto, j))
                    self.blob_need_backward[blob] = (self.blob_need_backward[blob]
                                                     or layer.bottom_need_backward[j])
                layer.param_need_backward = [True] * len(layer.params)
        self._run_on_host_with_readers()
        return Graph(name=self.param.name, phase=self.phase, level=self.param.state.level,
                     stages=tuple(self.param.state.stage), force_backward=self.param.force_backward,
                     layers=self.layers, blobs=self.blobs, value_shapes=self.value_shapes,
                     blob_value=self.blob_value, blob_first_value=self.blob_first_value, inputs=self.inputs,
                     outputs=sorted(self.available), blob_loss_weights=self.loss_weights, proto=self.param,
                     concrete=self.concrete, python_layers=self.python_layers, swept_need_backward=swept,
                     deferred_errors=self.deferred_errors)

    def _run_on_host_with_readers(self) -> None:
        """Layers with a host form (LayerRule.host_when_read_on_host: Split) run on the host where only layers run
        there read their tops (the last first, so that one read only by another such layer follows it there). A
        program then neither reads their bottoms for them nor hands back their tops: py-faster-rcnn's ground-truth
        boxes, which its anchor and proposal target layers read through a Split, no longer key the program of the
        layers before them."""
        readers = readers_by_value(self.layers)
        for layer, rule in zip(reversed(self.layers), reversed(self.rules)):
            if (rule.host_when_read_on_host and not any(layer.loss_weights)
                    and all(readers.get(v) and all(r.runs_on_host for r in readers[v]) for v in layer.top_values)):
                layer.runs_on_host = True

    def _sweep_backward(self) -> None:
        """Net::Init's backward sweep: layers not under a loss, or whose tops all skip backprop, need none."""
        under_loss: set[str] = set()
        skip_backprop: set[str] = set()
        for layer in reversed(self.layers):
            contributes = any(w != 0 or blob in under_loss for blob, w in zip(layer.tops, layer.loss_weights))
            skip = all(blob in skip_backprop for blob in layer.tops)
            if layer.need_backward and skip:
                layer.need_backward = False
                layer.bottom_need_backward = [False] * len(layer.bottoms)
            if not contributes:
                layer.need_backward = False
            for j, blob in enumerate(layer.bottoms):
                if contributes:
                    under_loss.add(blob)
                else:
                    layer.bottom_need_backward[j] = False
                if not layer.bottom_need_backward[j]:
                    skip_backprop.add(blob)


def _declared(rule: LayerRule, lp, phase: int, base_dir: str | None, num_tops: int):
    shapes = list(rule.input_shapes(lp, phase, base_dir))
    if len(shapes) != num_tops:
        raise layer_error(SchemaError, lp.name, lp.type,
                          f"declares {len(shapes)} shapes for {num_tops} top blob(s)")
    return [tuple(int(d) for d in s) for s in shapes]


def _check_shape(lp, shape: Shape) -> None:
    if any(d < 0 for d in shape):
        raise layer_error(ShapeError, lp.name, lp.type, f"negative dimension in shape {tuple(shape)}")
    n = 1
    for d in shape:
        n *= d
    if n > MAX_BLOB_ELEMENTS:
        raise layer_error(ShapeError, lp.name, lp.type,
                          f"shape {tuple(shape)} has {n} elements, more than caffejax allows "
                          f"({MAX_BLOB_ELEMENTS}); is a dim mistyped?")


def infer_top_shapes(lp, rule: LayerRule, phase: int, bottom_shapes, param_shapes, num_tops: int,
                     dtype=np.float32, concrete: Mapping[int, np.ndarray] | None = None,
                     python_layers: Any = None) -> list[Shape]:
    """Caffe's Reshape for one layer: the shapes its forward produces, from abstract evaluation.

    ``concrete`` gives the data of bottoms whose values decide shapes; they enter as constants.
    """
    concrete = concrete or {}
    in_place = tuple(i < len(lp.bottom) and t == lp.bottom[i] for i, t in enumerate(lp.top))
    bottoms = [None if j in concrete else jax.ShapeDtypeStruct(tuple(s), dtype) for j, s in enumerate(bottom_shapes)]
    params = [jax.ShapeDtypeStruct(tuple(s), dtype) for s in param_shapes]

    def forward(b, p):
        # The key is made inside the trace: made outside, it would compile and run a seeding program.
        ctx = LayerContext(layer=lp, phase=phase, key=jax.random.key(0), num_tops=num_tops, in_place=in_place,
                           python_layers=python_layers)
        return list(rule.forward(ctx, [concrete[j] if j in concrete else x for j, x in enumerate(b)], p))

    try:
        tops = jax.eval_shape(forward, bottoms, params)
    except CaffejaxError:
        raise
    except Exception as e:
        raise _shapes_do_not_fit(lp, bottom_shapes, param_shapes, e) from None
    if len(tops) != num_tops:
        raise layer_error(SchemaError, lp.name, lp.type, f"produces {len(tops)} tops but {num_tops} are named")
    return [tuple(int(d) for d in t.shape) for t in tops]


def _shapes_do_not_fit(lp, bottom_shapes, param_shapes, e: Exception) -> ShapeError:
    """A layer's shape code (its written-out rule or its traced forward) tripped on these shapes."""
    bottoms_named = ", ".join(f"'{b}' {tuple(s)}" for b, s in zip(lp.bottom, bottom_shapes))
    return layer_error(ShapeError, lp.name, lp.type,
                       f"shapes do not fit: bottoms {bottoms_named or 'none'}, learnable blobs "
                       f"{[tuple(s) for s in param_shapes]}: {type(e).__name__}: {_first_line(e)}")


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""
