"""caffejax: Caffe nets compiled by XLA through JAX, with pycaffe's API (``import caffejax as caffe``)."""

import gc as _gc

# Python's cyclic collector ran ~250 times over the import (JAX's and caffejax's modules make many objects, few of
# them garbage): 0.07-0.1 s of a 0.68-0.84 s import (2 AMD EPYC Zen 3 cores). It is paused over the imports below
# and given back as it was.
_collecting = _gc.isenabled()
_gc.disable()
try:
    from caffejax.errors import (CaffejaxError, DataError, DataSourceUnavailable, GraphError, NumericalError,
                                 OutOfMemoryError, ParseError, SchemaError, ShapeError, SolverError, TopsSizedByData,
                                 UnsupportedError, WeightsError)
    from caffejax.grad import value_and_grad
    from caffejax.lower.python_layer import Layer  # pycaffe's caffe.Layer, for (trusted) Python layers
    from caffejax.lower.registry import TEST, TRAIN, register_layer
    from caffejax.lower.registry import registered_types as layer_type_list  # pycaffe's caffe.layer_type_list
    from caffejax.net_spec import NetSpec, layers, params, to_proto
    from caffejax.runtime.mode import apply_glog_level as _apply_glog_level
    from caffejax.runtime.mode import run_cpu_programs_inline as _run_cpu_programs_inline
    from caffejax.runtime.mode import set_device, set_mode_cpu, set_mode_gpu, set_random_seed
    from caffejax.runtime.mode import (NCCL, Timer, has_nccl, init_log, set_multiprocess, set_solver_count,
                                       set_solver_rank, solver_count, solver_rank)
    from caffejax.runtime.mode import log_info as log  # pycaffe's caffe.log
    from caffejax.runtime.debug_nans import find_first_nan
    from caffejax.runtime.inference import compile_inference
    from caffejax.runtime.net import Net
    from caffejax.runtime.xla_options import xla_options_for
    from caffejax.runtime.solver import (AdaDeltaSolver, AdaGradSolver, AdamSolver, NesterovSolver, RMSPropSolver,
                                         SGDSolver, get_solver)
    from caffejax import io  # pycaffe's caffe.io
    from caffejax.runtime import memory as _memory
    from caffejax.classifier import Classifier, Detector
finally:
    if _collecting:
        _gc.enable()

__version__ = "0.1.0"

_memory.apply_environment()  # malloc keeps freed memory; CAFFEJAX_KEEP_FREED_MEMORY=0 opts out
_run_cpu_programs_inline()  # as Caffe runs; CAFFEJAX_CPU_ASYNC_DISPATCH=1 keeps JAX's worker thread
_apply_glog_level()  # GLOG_minloglevel, as glog reads it when Caffe's library loads

__all__ = ["Net", "TRAIN", "TEST", "CaffejaxError", "ParseError", "SchemaError", "GraphError", "ShapeError",
           "WeightsError", "DataError", "DataSourceUnavailable", "SolverError", "UnsupportedError", "set_mode_cpu",
           "set_mode_gpu", "set_device", "set_random_seed", "value_and_grad", "get_solver", "SGDSolver",
           "NesterovSolver", "AdaGradSolver", "RMSPropSolver", "AdaDeltaSolver", "AdamSolver", "NetSpec", "layers",
           "params", "to_proto", "io", "Classifier", "Detector", "compile_inference", "NumericalError",
           "OutOfMemoryError", "TopsSizedByData", "register_layer", "find_first_nan", "Layer", "layer_type_list",
           "Timer", "log", "init_log", "NCCL", "has_nccl", "solver_count", "set_solver_count", "solver_rank",
           "set_solver_rank", "set_multiprocess", "xla_options_for"]
