"""aviatorc's IR: a typed graph of a closed op set, with a verifier, a canonical text form and
a numpy reference interpreter. It imports neither torch, onnx nor OR-tools."""

from aviatorc.ir.build import add_op, add_value, merge_type
from aviatorc.ir.data import ArrayData, Derived, FileRegion, ShapeOnly, TensorData
from aviatorc.ir.fold import fold_constants
from aviatorc.ir.graph import Graph, Node, Value
from aviatorc.ir.interpreter import evaluate
from aviatorc.ir.ops import OPS, get_op
from aviatorc.ir.text import parse_graph, print_graph
from aviatorc.ir.types import DTYPES, TensorType, numpy_dtype
from aviatorc.ir.verifier import verify

__all__ = [
    "DTYPES", "OPS", "ArrayData", "Derived", "FileRegion", "Graph", "Node", "ShapeOnly", "TensorData",
    "TensorType", "Value", "add_op", "add_value", "evaluate", "fold_constants", "get_op", "merge_type",
    "numpy_dtype", "parse_graph", "print_graph", "verify",
]
