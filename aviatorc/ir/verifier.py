"""The verifier: every invariant of a graph, with errors that show the IR around the bad node."""

from __future__ import annotations

from aviatorc.errors import ModelFormatError, VerificationError
from aviatorc.ir.data import ArrayData
from aviatorc.ir.graph import Graph, Node, Value
from aviatorc.ir.ops import OPS, infer_types
from aviatorc.ir.text import format_node, format_type
from aviatorc.ir.types import TensorType, numpy_dtype

CONTEXT_LINES = 3


def verify(graph: Graph) -> None:
    """Raise VerificationError on the first broken invariant; return None when the graph is sound."""
    defined: set[int] = set()
    names: set[str] = set()

    def define(value: Value, where: str) -> None:
        if value.name in names:
            raise VerificationError(f"value name '{value.name}' is defined twice ({where})")
        names.add(value.name)
        defined.add(id(value))

    for value in graph.inputs:
        define(value, "graph input")
    for name, value in graph.initializers.items():
        if name != value.name:
            raise VerificationError(f"initializer key '{name}' names value '{value.name}'")
        define(value, "initializer")
        _check_initializer(value)

    uses: dict[int, int] = {}
    node_names: set[str] = set()
    for index, node in enumerate(graph.nodes):
        if node.name in node_names:  # plans, reports and the runtime name nodes
            raise VerificationError(f"node name '{node.name}' is used twice", node=node.name, op=node.op,
                                    hint="give each node its own name (Graph.unique_node_name)",
                                    context=_context(graph, index))
        node_names.add(node.name)
        try:
            _check_node(node, defined)
        except ModelFormatError as error:
            raise VerificationError(
                error.message, node=node.name, op=node.op, hint=error.hint, context=_context(graph, index)
            ) from None
        for read in node.inputs:
            if read is not None:
                uses[id(read)] = uses.get(id(read), 0) + 1
        for value in node.outputs:
            if value.producer is not node:
                raise VerificationError(f"output '{value.name}' does not point back to its producer",
                                        node=node.name, op=node.op, context=_context(graph, index))
            define(value, f"output of '{node.name}'")

    for value in graph.values():
        if len(value.users) != uses.get(id(value), 0):
            raise VerificationError(
                f"use list of '{value.name}' holds {len(value.users)} entries but the graph has "
                f"{uses.get(id(value), 0)} uses", hint="edit inputs with Node.set_input, not by hand"
            )
    for out in graph.outputs:
        if id(out) not in defined:
            raise VerificationError(f"graph output '{out.name}' is not defined")


def _check_initializer(value: Value) -> None:
    if value.producer is not None:
        raise VerificationError(f"initializer '{value.name}' has a producer")
    if isinstance(value.data, ArrayData):
        array = value.data.array
        if array.dtype != numpy_dtype(value.type.dtype) or tuple(array.shape) != value.type.shape:
            raise VerificationError(
                f"initializer '{value.name}' holds {array.dtype}{list(array.shape)} but is typed {format_type(value.type)}"
            )


def _check_node(node: Node, defined: set[int]) -> None:
    if node.op not in OPS:
        raise ModelFormatError(f"op '{node.op}' is not in the IR's op set")
    opdef = OPS[node.op]
    n_in = len(node.inputs)
    if n_in < opdef.min_inputs or (opdef.max_inputs >= 0 and n_in > opdef.max_inputs):
        bound = f"{opdef.min_inputs}..{opdef.max_inputs if opdef.max_inputs >= 0 else 'n'}"
        raise ModelFormatError(f"has {n_in} inputs, expected {bound}")
    for i, value in enumerate(node.inputs):
        if value is None:
            if i < opdef.min_inputs:
                raise ModelFormatError(f"required input {i} is missing")
            continue
        if id(value) not in defined:
            raise ModelFormatError(f"input '{value.name}' is used before it is defined (or not in the graph)")
    if not 1 <= len(node.outputs) <= opdef.max_outputs:
        raise ModelFormatError(f"has {len(node.outputs)} outputs, at most {opdef.max_outputs} allowed")
    inferred = infer_types(
        node.op,
        [v.type if v is not None else None for v in node.inputs],
        [v.const_value() if v is not None and _small(v) else None for v in node.inputs],
        node.attrs,
        len(node.outputs),
        node.name,
    )
    for value, expected in zip(node.outputs, inferred):
        if not types_agree(value.type, expected):
            raise ModelFormatError(f"output '{value.name}' is typed {format_type(value.type)} but the op gives {format_type(expected)}")


def _small(value: Value) -> bool:
    return value.type.is_static and value.type.numel() <= 64


def types_agree(actual: TensorType, inferred: TensorType) -> bool:
    """Same element type and rank; static dims equal where both sides know them."""
    if actual.dtype != inferred.dtype or actual.rank != inferred.rank:
        return False
    return all(not (isinstance(a, int) and isinstance(b, int)) or a == b for a, b in zip(actual.shape, inferred.shape))


def _context(graph: Graph, index: int) -> str:
    lo, hi = max(0, index - CONTEXT_LINES), min(len(graph.nodes), index + CONTEXT_LINES + 1)
    lines = []
    for i in range(lo, hi):
        marker = ">>" if i == index else "  "
        lines.append(f"{marker} {format_node(graph.nodes[i])}")
    return "\n".join(lines)
