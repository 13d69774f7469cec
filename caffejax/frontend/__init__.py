"""Reading Caffe's files and turning a NetParameter into the shape-inferred IR."""

from caffejax.frontend.build import build_graph, load_net_param
from caffejax.frontend.caffemodel import read_weights
from caffejax.frontend.filter_net import filter_net
from caffejax.frontend.insert_splits import insert_splits
from caffejax.frontend.prototxt import parse_net_text, parse_solver_text

__all__ = ["build_graph", "load_net_param", "read_weights", "filter_net", "insert_splits", "parse_net_text",
           "parse_solver_text"]
