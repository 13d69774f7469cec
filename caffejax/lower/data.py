"""Data family: layers whose tops enter the net from outside (Input, MemoryData and the file-reading data
layers) or are generated in it (DummyData).

Fed layers carry ``input_shapes``: their tops are arguments of the compiled program, filled by the runtime
(``net.blobs[...].data[...] = x``, ``net.set_input_arrays``, or a data-source reader prefetching batches).
"""

from __future__ import annotations

import jax.numpy as jnp

from caffejax.errors import DataSourceUnavailable, SchemaError, layer_error
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


def memory_data_shapes(layer, phase, base_dir):
    """MemoryData: data (batch, channels, height, width) and label (batch,)."""
    p = layer.memory_data_param
    dims = (p.batch_size, p.channels, p.height, p.width)
    if any(d <= 0 for d in dims):
        raise layer_error(SchemaError, layer.name, layer.type,
                          f"batch_size, channels, height and width must be positive, got {dims}")
    return [dims, (p.batch_size,)][: len(layer.top)]


def unavailable_source(kind: str):
    def shapes(layer, phase, base_dir):
        raise DataSourceUnavailable(f"layer '{layer.name}' (type {layer.type}): reading {kind} sources is not "
                                    "available yet, so its top shapes are unknown")
    return shapes


register(LayerRule("Input", forward=_fed, input_shapes=input_shapes, bottoms=(0, 0), tops=(1, None)))
register(LayerRule("MemoryData", forward=_fed, input_shapes=memory_data_shapes, bottoms=(0, 0), tops=(2, 2)))
for _type, _kind in (("Data", "LMDB/LevelDB"), ("ImageData", "image list"), ("HDF5Data", "HDF5 list"),
                     ("WindowData", "window file")):
    register(LayerRule(_type, forward=_fed, input_shapes=unavailable_source(_kind), bottoms=(0, 0),
                       tops=(1, None)))


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
    return [jnp.asarray(fill(f, s, k)) for f, s, k in zip(fillers, shapes, keys)]


register(LayerRule("DummyData", forward=dummy_data, bottoms=(0, 0), tops=(1, None)))
