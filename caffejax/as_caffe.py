"""Run a pycaffe script unchanged: caffejax under the module names pycaffe has.

``import caffejax as caffe`` covers ``caffe.Net(...)``, but a script's other imports name pycaffe's modules:
``from caffe import layers as L``, ``from caffe.proto import caffe_pb2``, ``import caffe.draw``,
``from caffe.coord_map import crop``. :func:`install` registers caffejax under those names, so they import
caffejax's; ``python -m caffejax.as_caffe SCRIPT [ARGS...]`` installs and runs a script as ``python SCRIPT``
would. It is opt-in: importing caffejax never claims the name ``caffe``, and a real pycaffe already imported
in the process is refused rather than shadowed.
"""

from __future__ import annotations

import importlib
import runpy
import sys

from caffejax.errors import CaffejaxError

# pycaffe's module -> caffejax's.
MODULES = {
    "caffe": "caffejax",
    "caffe.proto": "caffejax.proto",
    "caffe.proto.caffe_pb2": "caffejax.proto.caffe_pb2",
    "caffe.io": "caffejax.io",
    "caffe.draw": "caffejax.draw",
    "caffe.net_spec": "caffejax.net_spec",
    "caffe.coord_map": "caffejax.coord_map",
    "caffe.classifier": "caffejax.classifier",
    "caffe.detector": "caffejax.classifier",
    "caffe.pycaffe": "caffejax",
}


def install() -> None:
    """Make ``import caffe`` (and its submodules above) import caffejax. Idempotent; refuses a process that
    already imported another ``caffe``."""
    present = sys.modules.get("caffe")
    if present is not None and present is not importlib.import_module("caffejax"):
        raise CaffejaxError(f"another 'caffe' module is already imported ({getattr(present, '__file__', present)}); "
                            "caffejax will not shadow it")
    for name, target in MODULES.items():
        module = importlib.import_module(target)
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:  # ``import caffe.io`` binds caffe.io as an attribute of the parent, as a package does
            setattr(sys.modules[parent], child, module)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m caffejax.as_caffe SCRIPT [ARGS...]\n\n" + __doc__.strip())
        return 0 if argv else 2
    install()
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
