"""caffejax: Caffe nets compiled by XLA through JAX, with pycaffe's API (``import caffejax as caffe``)."""

from caffejax.errors import (CaffejaxError, DataError, GraphError, ParseError, SchemaError, ShapeError,
                             SolverError, UnsupportedError, WeightsError)
from caffejax.lower.registry import TEST, TRAIN
from caffejax.runtime.mode import set_device, set_mode_cpu, set_mode_gpu, set_random_seed
from caffejax.runtime.net import Net

__version__ = "0.1.0"

__all__ = ["Net", "TRAIN", "TEST", "CaffejaxError", "ParseError", "SchemaError", "GraphError", "ShapeError",
           "WeightsError", "DataError", "SolverError", "UnsupportedError", "set_mode_cpu", "set_mode_gpu",
           "set_device", "set_random_seed"]
