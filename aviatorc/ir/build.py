"""Adding typed nodes: output types come from the op's type rule, with hints for the dims a
rule cannot know (from the source model's own shape inference)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from aviatorc.ir.graph import Graph, Node, Value
from aviatorc.ir.ops import infer_types
from aviatorc.ir.types import Dim, TensorType

CONST_READ_LIMIT = 1 << 16  # type rules may read constant inputs up to this many elements


def merge_type(inferred: TensorType, hint: TensorType | None) -> TensorType:
    """The inferred type, with unknown dims taken from `hint` when the ranks agree."""
    if hint is None or hint.rank != inferred.rank:
        return inferred
    dims: list[Dim] = []
    for ours, theirs in zip(inferred.shape, hint.shape):
        if ours is None or (isinstance(ours, str) and isinstance(theirs, int)):
            dims.append(theirs)
        else:
            dims.append(ours)
    return TensorType(inferred.dtype, tuple(dims))


def readable_const(value: Value | None) -> Any:
    if value is None or value.data is None or not value.data.available:
        return None
    if not value.type.is_static or value.type.numel() > CONST_READ_LIMIT:
        return None
    return value.data.load()


def add_op(
    graph: Graph,
    op: str,
    inputs: Sequence[Value | None],
    attrs: Mapping[str, Any] | None = None,
    *,
    name: str = "",
    num_outputs: int = 1,
    hints: Sequence[TensorType | None] | None = None,
    output_names: Sequence[str] | None = None,
    before: Node | None = None,
) -> Node:
    """Append (or insert before `before`) a node whose output types are inferred."""
    attrs = dict(attrs or {})
    types = infer_types(
        op,
        [v.type if v is not None else None for v in inputs],
        [readable_const(v) for v in inputs],
        attrs,
        num_outputs,
        name,
    )[:num_outputs]
    hints = list(hints or [])
    types = [merge_type(t, hints[i] if i < len(hints) else None) for i, t in enumerate(types)]
    return graph.add_node(op, inputs, types, attrs, name=name, output_names=output_names, before=before)


def add_value(graph: Graph, op: str, inputs: Sequence[Value | None], attrs: Mapping[str, Any] | None = None,
              **kwargs: Any) -> Value:
    """`add_op` for a single-output op; returns the output value."""
    return add_op(graph, op, inputs, attrs, **kwargs).outputs[0]
