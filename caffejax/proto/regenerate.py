"""Regenerate ``caffe_pb2.py`` from ``caffe.proto``.

Usage: ``python -m caffejax.proto.regenerate`` (needs ``grpcio-tools``).
Equivalent to, from the repository root::

    python -m grpc_tools.protoc -I caffejax/proto \
        --python_out=caffejax/proto caffejax/proto/caffe.proto
"""

from __future__ import annotations

import os
import sys

PROTO_DIR = os.path.dirname(os.path.abspath(__file__))
PROTO_FILE = os.path.join(PROTO_DIR, "caffe.proto")


def protoc_args(out_flag: str, out_path: str) -> list[str]:
    """Arguments for grpc_tools.protoc compiling caffe.proto."""
    return ["grpc_tools.protoc", f"-I{PROTO_DIR}", f"{out_flag}={out_path}", PROTO_FILE]


def main() -> int:
    try:
        from grpc_tools import protoc
    except ImportError:
        print("grpcio-tools is required: pip install grpcio-tools", file=sys.stderr)
        return 1
    rc = protoc.main(protoc_args("--python_out", PROTO_DIR))
    if rc != 0:
        print(f"protoc failed with exit code {rc}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
