"""The IR: plain dataclasses for a filtered, split, shape-inferred Caffe net.

Layers are in execution order. Caffe's blob names are kept for users (``Layer.bottoms``/``tops``), while
every write of a blob gets its own *value* (``Layer.bottom_values``/``top_values``), so in-place layers
(``top == bottom``) become ordinary SSA definitions: value ``conv1`` is the convolution's output, value
``conv1@relu1`` the ReLU's, and the blob ``conv1`` shows the last one, as Caffe's shared memory does.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Sequence

Shape = tuple[int, ...]


@dataclasses.dataclass
class ParamSlot:
    """One learnable blob of a layer, as Net::AppendParam sees it.

    ``owner`` is the (layer name, index) whose storage this slot uses: itself unless the blob is shared by
    ParamSpec name with an earlier layer. ``lr_mult``/``decay_mult`` are the owner's effective values.
    """

    layer: str
    index: int
    shape: Shape
    name: str = ""
    owner: tuple[str, int] | None = None
    lr_mult: float = 1.0
    decay_mult: float = 1.0
    has_lr_mult: bool = False
    has_decay_mult: bool = False
    share_mode: int = 0  # ParamSpec.DimCheckMode: STRICT = 0, PERMISSIVE = 1

    @property
    def key(self) -> tuple[str, int]:
        return (self.layer, self.index)

    @property
    def storage(self) -> tuple[str, int]:
        return self.owner or self.key

    @property
    def is_owner(self) -> bool:
        return self.owner is None


@dataclasses.dataclass
class Layer:
    name: str
    type: str
    proto: Any  # caffe_pb2.LayerParameter (the filtered, split, upgraded one)
    bottoms: list[str]
    tops: list[str]
    bottom_values: list[str]
    top_values: list[str]
    params: list[ParamSlot]
    loss_weights: list[float]          # one per top (0 for non-loss tops)
    need_backward: bool = False
    bottom_need_backward: list[bool] = dataclasses.field(default_factory=list)
    param_need_backward: list[bool] = dataclasses.field(default_factory=list)
    is_input: bool = False             # tops are fed from outside the compiled program
    # State the layer carries from one forward to the next (LayerRule.state_shapes): value ids it reads
    # before running (absent from the inputs: Caffe's zeros) and the ids of what it leaves for the next run.
    state_in: list[str] = dataclasses.field(default_factory=list)
    state_out: list[str] = dataclasses.field(default_factory=list)
    # Its top shapes depend on the data (LayerRule.host_forward): it runs on the host after the compiled program,
    # on the bottoms the program returns, and is no part of any program.
    runs_on_host: bool = False

    @property
    def in_place(self) -> list[bool]:
        return [i < len(self.bottoms) and t == self.bottoms[i] for i, t in enumerate(self.tops)]


@dataclasses.dataclass
class Graph:
    """A whole net, ready to lower.

    ``blobs`` are Caffe's blob names in Caffe's blob order; ``value_shapes`` maps every value to its
    shape (None where it depends on a data source that is not available); ``blob_value`` maps each blob to
    the value it holds after a full forward.
    """

    name: str
    phase: int
    level: int
    stages: tuple[str, ...]
    force_backward: bool
    layers: list[Layer]
    blobs: list[str]
    value_shapes: dict[str, Shape | None]
    blob_value: dict[str, str]
    blob_first_value: dict[str, str]
    inputs: list[str]
    outputs: list[str]
    blob_loss_weights: dict[str, float]
    proto: Any  # the NetParameter after upgrade, filter and splits
    # Fed values whose data decide shapes (Filter selectors): value id -> the data the shapes were built for.
    concrete: dict[str, Any] = dataclasses.field(default_factory=dict)
    # The net's pycaffe layer objects (lower.python_layer.PythonLayers), which its programs' Python layers call.
    python_layers: Any = None
    # Each layer's need_backward after Net::Init's backward sweep and before force_backward: what Caffe logs
    # as "<layer> needs backward computation." (force_backward then sets every layer's).
    swept_need_backward: tuple[bool, ...] = ()
    # Layers whose top shapes could not be inferred from bottoms that a layer sizing its tops by the data made
    # (its tops' shapes from its last forward, or from a Python layer's reshape, which its forward may change):
    # layer name -> (the ShapeError, the layers sizing by the data upstream). Their shapes are unknown (None)
    # until that layer has run: Caffe reshapes each layer just before its forward.
    deferred_errors: dict[str, tuple[Exception, tuple[str, ...]]] = dataclasses.field(default_factory=dict)

    def layer(self, name: str) -> Layer:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(name)

    def blob_shape(self, blob: str) -> Shape | None:
        return self.value_shapes[self.blob_value[blob]]

    @property
    def fed(self) -> dict[str, str]:
        """Blobs fed from outside the program (tops of Input and data layers): blob name -> value id."""
        return {top: value for layer in self.layers if layer.is_input
                for top, value in zip(layer.tops, layer.top_values)}

    @property
    def made_on_host(self) -> set[str]:
        """The blobs layers run on the host make (``Layer.runs_on_host``: their shapes depend on the data)."""
        return {top for layer in self.layers if layer.runs_on_host for top in layer.tops}

    @property
    def read_on_host(self) -> list[str]:
        """The blobs a program hands to the layers run on the host, which run on them after it."""
        made = self.made_on_host
        return list(dict.fromkeys(blob for layer in self.layers if layer.runs_on_host for blob in layer.bottoms
                                  if blob not in made))

    @property
    def staging_layers(self) -> list[int]:
        """The layers run on the host whose tops compiled layers read (py-faster-rcnn's proposals feeding
        ROIPooling), by index: Net.forward and compile_inference run the layers before each as one program, the
        layer on the host, then the layers after it, shaped by what it made (Net.backward the other way round)."""
        read = {id(host) for _, host in reads_after_host(self.layers)}
        return [i for i, layer in enumerate(self.layers) if id(layer) in read]

    @property
    def program_outputs(self) -> list[str]:
        """The blobs a program over the whole net hands back: the net's outputs but those made on the host, and
        the blobs read on the host."""
        made = self.made_on_host
        return list(dict.fromkeys([blob for blob in self.outputs if blob not in made] + self.read_on_host))

    @property
    def state(self) -> dict[str, str]:
        """Every layer's carried state: value read by a forward -> value it leaves for the next forward."""
        return {v: out for layer in self.layers for v, out in zip(layer.state_in, layer.state_out)}

    @property
    def param_slots(self) -> list[ParamSlot]:
        """Every layer's learnable blobs in Caffe's net param order (``net.params_``)."""
        return [slot for layer in self.layers for slot in layer.params]

    @property
    def learnable_slots(self) -> list[ParamSlot]:
        """The owners only (``net.learnable_params_``): what a solver updates."""
        return [slot for slot in self.param_slots if slot.is_owner]


def readers_by_value(layers: Sequence[Layer]) -> dict[str, list[Layer]]:
    """Each value id -> the layers among ``layers`` that read it as a bottom, in order."""
    readers: dict[str, list[Layer]] = {}
    for layer in layers:
        for value in layer.bottom_values:
            readers.setdefault(value, []).append(layer)
    return readers


def producer_by_value(layers: Sequence[Layer]) -> dict[str, Layer]:
    """Each value id -> the layer among ``layers`` that makes it (a top)."""
    return {value: layer for layer in layers for value in layer.top_values}


def reads_after_host(layers: Sequence[Layer]) -> Iterator[tuple[Layer, Layer]]:
    """(reader, host) for each compiled layer among ``layers`` that reads a top of a layer run on the host
    (``Layer.runs_on_host``) among them, in order: the reads that need the net run in stages."""
    made: dict[str, Layer] = {}
    for layer in layers:
        if layer.runs_on_host:
            made.update((v, layer) for v in layer.top_values)
            continue
        for v in layer.bottom_values:
            if v in made:
                yield layer, made[v]


def stage_interface(graph: Graph, begin: int, end: int, outputs: set[str]
                    ) -> tuple[list[Layer], list[str], set[str]]:
    """One stage of a net run in stages (layers begin..end-1): its compiled layers, the values they read from
    outside them (fed tops first, then earlier layers' in the order read; not the fed tops only later stages or
    layers run on the host read, which would key the stage's program by their shapes), and the values later
    needed: read by the layers after the stage or by its layers run on the host, or among ``outputs`` (value
    ids)."""
    layers = [layer for layer in graph.layers[begin:end] if not layer.runs_on_host]
    made = {v for layer in layers if not layer.is_input for v in layer.top_values}
    read = [v for layer in layers for v in layer.bottom_values if v not in made]
    reads = list(dict.fromkeys([*(v for layer in layers if layer.is_input for v in layer.top_values if v in read),
                                *read]))
    needed = {v for layer in graph.layers[end:] for v in layer.bottom_values}
    needed |= {v for layer in graph.layers[begin:end] if layer.runs_on_host for v in layer.bottom_values}
    return layers, reads, needed | outputs
