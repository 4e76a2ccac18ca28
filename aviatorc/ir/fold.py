"""Constant folding: evaluate nodes whose inputs are all known, and shape queries of
statically shaped values. Shape subgraphs of static exports collapse to constants."""

from __future__ import annotations

import numpy as np

from aviatorc.ir.build import CONST_READ_LIMIT
from aviatorc.ir.data import ArrayData
from aviatorc.ir.graph import Graph, Node, Value
from aviatorc.ir.ops import get_op
from aviatorc.ir.types import dtype_name

FOLD_MAX_ELEMENTS = 1 << 16  # larger results stay as nodes: folding must not bloat the graph
# Ops whose inputs are stored formats: folding them would undo quantization or sparsity.
NEVER_FOLD = frozenset({"DequantizeWeight", "QuantizeActivation"})


def fold_constants(graph: Graph) -> int:
    """Replace foldable nodes by constants; return how many nodes were folded."""
    folded = 0
    for node in list(graph.nodes):
        arrays = _fold(node)
        if arrays is None:
            continue
        for value, array in zip(node.outputs, arrays):
            const = graph.add_constant(np.asarray(array).astype(_np_dtype(value)), name=value.name + "_c")
            graph.replace_all_uses(value, const)
        if all(not v.users and v not in graph.outputs for v in node.outputs):
            graph.remove_node(node)
            folded += 1
    _drop_unused_constants(graph)
    return folded


def _np_dtype(value: Value) -> np.dtype:
    from aviatorc.ir.types import numpy_dtype

    return numpy_dtype(value.type.dtype)


def _fold(node: Node) -> list[np.ndarray] | None:
    if node.op in NEVER_FOLD:
        return None
    if node.op == "Shape" and node.inputs[0] is not None and node.inputs[0].type.is_static:
        dims = node.inputs[0].type.shape
        start, end = node.attrs.get("start", 0), node.attrs.get("end", None)
        sl = slice(*slice(start, end if end is not None else len(dims)).indices(len(dims)))  # type: ignore[arg-type]
        return [np.array(dims[sl], dtype=np.int64)]
    if node.op == "Size" and node.inputs[0] is not None and node.inputs[0].type.is_static:
        return [np.array(node.inputs[0].type.numel(), dtype=np.int64)]
    if any(not v.type.is_static or v.type.numel() > FOLD_MAX_ELEMENTS for v in node.outputs):
        return None
    ins: list[np.ndarray | None] = []
    for value in node.inputs:
        if value is None:
            ins.append(None)
            continue
        if value.data is None or not value.data.available or not isinstance(value.data, ArrayData):
            return None
        if value.type.numel() > CONST_READ_LIMIT:
            return None
        ins.append(value.data.array)
    opdef = get_op(node.op)
    attrs = opdef.resolve_attrs(node.attrs, node.name)
    attrs["_num_outputs"] = len(node.outputs)
    outs = opdef.kernel(ins, attrs)
    for value, array in zip(node.outputs, outs):
        if dtype_name(np.asarray(array).dtype) != value.type.dtype and np.asarray(array).size:
            return None
    return list(outs)


def _drop_unused_constants(graph: Graph) -> None:
    for value in list(graph.initializers.values()):
        if not value.users and value not in graph.outputs and isinstance(value.data, ArrayData):
            graph.remove_initializer(value)
