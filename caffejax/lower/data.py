"""Data family: layers whose tops enter the net from outside (Input, MemoryData and the file-reading data
layers), are generated in it (DummyData), or leave it (HDF5Output).

Fed layers carry ``input_shapes``: their tops are arguments of the compiled program, filled by the runtime
(``net.blobs[...].data[...] = x`` for Input; for the others, one batch per forward from the layer's
DataSource, see :mod:`caffejax.data`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from caffejax.data import data_layer, hdf5_data, image_data, memory_data, window_data
from caffejax.errors import SchemaError, layer_error
from caffejax.lower.registry import LayerRule, register


def _fed(layer, bottoms, params):
    raise AssertionError(f"layer '{layer.name}' is fed by the runtime; its forward is never traced")


def input_shapes(layer, phase, base_dir):
    """Input: one shape for every top, or one shape per top (input_layer.cpp)."""
    shapes = [tuple(int(d) for d in s.dim) for s in layer.input_param.shape]
    num_top = len(layer.top)
    if len(shapes) not in (0, 1, num_top):
        raise layer_error(SchemaError, layer.name, layer.type,
                          f"input_param gives {len(shapes)} shapes; give 0, 1 or one per top ({num_top})")
    if not shapes:
        return [()] * num_top
    return shapes * num_top if len(shapes) == 1 else shapes


def hdf5_output(ctx, bottoms, params):
    """HDF5Output: every forward writes bottom 0 as dataset ``data`` and bottom 1 as ``label`` of file_name.

    Caffe creates the file at set-up and fails on its second forward (the datasets exist); caffejax rewrites
    the file on each forward, so it holds the last batch. No tops, no gradient.
    """
    from jax.experimental import io_callback

    from caffejax.data.hdf5_data import write_output

    file_name = ctx.layer.hdf5_output_param.file_name
    if not file_name:
        raise ctx.error("hdf5_output_param.file_name is empty", SchemaError)
    data, label = bottoms
    for name, b in (("data", data), ("label", label)):
        if b.ndim > 4:
            raise ctx.error(f"the {name} bottom is {b.ndim}-D {b.shape}; HDF5Output writes at most 4-D blobs")
    if data.shape[:1] != label.shape[:1]:
        raise ctx.error(f"data and label must have the same num: {data.shape} vs {label.shape}")
    io_callback(functools.partial(write_output, file_name), None, jax.lax.stop_gradient(data),
                jax.lax.stop_gradient(label), ordered=True)
    return []


register(LayerRule("Input", forward=_fed, input_shapes=input_shapes, bottoms=(0, 0), tops=(1, None)))
for _type, _module, _tops in (("Data", data_layer, (1, 2)), ("ImageData", image_data, (2, 2)),
                              ("HDF5Data", hdf5_data, (1, None)), ("MemoryData", memory_data, (2, 2)),
                              ("WindowData", window_data, (2, 2))):
    register(LayerRule(_type, forward=_fed, input_shapes=_module.top_shapes, data_source=_module.open_source,
                       bottoms=(0, 0), tops=_tops))
register(LayerRule("HDF5Output", forward=hdf5_output, bottoms=(2, 2), tops=(0, 0)))


def _dummy_shapes(layer) -> list[tuple[int, ...]]:
    p = layer.dummy_data_param
    num_top = len(layer.top)
    if len(p.shape):
        shapes = [tuple(int(d) for d in s.dim) for s in p.shape]
    else:
        legacy = [list(p.num), list(p.channels), list(p.height), list(p.width)]
        n = max(len(v) for v in legacy)
        if any(len(v) not in (1, n) for v in legacy):
            raise layer_error(SchemaError, layer.name, layer.type,
                              "num, channels, height and width must each be given once or once per top")
        shapes = [tuple(v[i if len(v) > 1 else 0] for v in legacy) for i in range(n)]
    if len(shapes) not in (1, num_top):
        raise layer_error(SchemaError, layer.name, layer.type,
                          f"{len(shapes)} shapes given for {num_top} tops; give 1 or one per top")
    return shapes * num_top if len(shapes) == 1 else shapes


def dummy_data(ctx, bottoms, params):
    """DummyData: each top filled by its filler (constant 0 by default), drawn anew on every forward."""
    import jax

    from caffejax.lower.fillers import fill
    from caffejax.proto import caffe_pb2

    p = ctx.layer.dummy_data_param
    shapes = _dummy_shapes(ctx.layer)
    fillers = list(p.data_filler) or [caffe_pb2.FillerParameter(type="constant", value=0)]
    if len(fillers) not in (1, len(shapes)):
        raise ctx.error(f"{len(fillers)} data_fillers for {len(shapes)} tops; give 0, 1 or one per top",
                        SchemaError)
    if len(fillers) == 1:
        fillers = fillers * len(shapes)
    keys = jax.random.split(ctx.rng(), len(shapes))
    return [jnp.asarray(fill(f, s, k, ctx.dtype)) for f, s, k in zip(fillers, shapes, keys)]


register(LayerRule("DummyData", forward=dummy_data, bottoms=(0, 0), tops=(1, None)))
