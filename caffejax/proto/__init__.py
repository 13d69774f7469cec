"""Caffe protobuf schema and generated Python bindings.

``caffe.proto`` mirrors BVLC Caffe master's schema (wire and text format);
``caffe_pb2`` is generated from it by grpcio-tools' bundled protoc and is
committed.  Regenerate after editing the schema with::

    python -m caffejax.proto.regenerate

which runs ``python -m grpc_tools.protoc -I caffejax/proto
--python_out=caffejax/proto caffejax/proto/caffe.proto``.  The generated code
checks its protobuf runtime at import time (see ``caffe_pb2.py``).
"""
