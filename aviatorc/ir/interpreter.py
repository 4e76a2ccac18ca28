"""The numpy reference interpreter: the executable meaning of every IR op.

`evaluate(graph, feeds)` runs the nodes in order with the registry's kernels and returns
the graph outputs. Values are freed after their last use, so a model whose activations do
not all fit at once can still be evaluated. `evaluate_nodes(nodes, values)` runs a subset of
the nodes from values already computed, with the same kernels.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, MutableMapping, Sequence
from typing import Any

import numpy as np

from aviatorc.errors import EvaluationError
from aviatorc.ir.graph import Graph, Node, Value
from aviatorc.ir.ops import get_op
from aviatorc.ir.types import format_shape, numpy_dtype


def check_feeds(graph: Graph, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Feeds as arrays of the inputs' types; symbolic dims must bind consistently."""
    missing = [v.name for v in graph.inputs if v.name not in feeds]
    if missing:
        raise EvaluationError(f"missing input(s): {', '.join(missing)}")
    unknown = sorted(set(feeds) - {v.name for v in graph.inputs})
    if unknown:
        raise EvaluationError(f"unknown input(s): {', '.join(unknown)}",
                              hint=f"inputs are {', '.join(v.name for v in graph.inputs)}")
    bound: dict[str, int] = {}
    arrays = {}
    for value in graph.inputs:
        array = np.asarray(feeds[value.name])
        expected = value.type
        if array.dtype != numpy_dtype(expected.dtype):
            raise EvaluationError(f"input '{value.name}' is {array.dtype}, expected {expected.dtype}")
        if array.ndim != expected.rank:
            raise EvaluationError(f"input '{value.name}' has shape {list(array.shape)}, expected {format_shape(expected.shape)}")
        for size, dim in zip(array.shape, expected.shape):
            if isinstance(dim, int) and size != dim:
                raise EvaluationError(f"input '{value.name}' has shape {list(array.shape)}, expected {format_shape(expected.shape)}")
            if isinstance(dim, str) and bound.setdefault(dim, size) != size:
                raise EvaluationError(f"input '{value.name}': dim '{dim}' is {size} here but {bound[dim]} elsewhere")
        arrays[value.name] = array
    return arrays


def evaluate(graph: Graph, feeds: Mapping[str, Any], *, keep: Sequence[str] = (),
             only_kept: bool = False) -> dict[str, np.ndarray]:
    """Run `graph` on `feeds` (name -> array); return its outputs (and any values named in `keep`).
    With `only_kept`, return just the kept values, and stop once the last of them is computed
    (calibration asks for the inputs of a few MatMuls: what follows them is not run)."""
    env: dict[int, np.ndarray] = {}
    arrays = check_feeds(graph, feeds)
    for value in graph.inputs:
        env[id(value)] = arrays[value.name]
    last_use = _last_uses(graph)
    keep = tuple(keep)
    wanted = {id(graph.value(n)) for n in keep} | (set() if only_kept else {id(v) for v in graph.outputs})
    kept: dict[str, np.ndarray] = {n: arrays[n] for n in keep if n in arrays}
    nodes = graph.nodes
    if only_kept:
        producers = [i for i, node in enumerate(nodes) if any(v.name in keep for v in node.outputs)]
        nodes = nodes[: max(producers) + 1] if producers else []
    for step, node in enumerate(nodes):
        outs = _run_node(node, [_read(env, v, node.name) if v is not None else None for v in node.inputs])
        for value, array in zip(node.outputs, outs):
            env[id(value)] = np.asarray(array)
            if value.name in keep:
                kept[value.name] = env[id(value)]
        for read in node.inputs:
            if read is not None and last_use.get(id(read)) == step and id(read) not in wanted:
                env.pop(id(read), None)
    if only_kept:
        return kept
    result = {v.name: _read(env, v, "output") for v in graph.outputs}
    result.update(kept)
    return result


def evaluate_nodes(nodes: Sequence[Node], values: MutableMapping[Value, np.ndarray], *,
                   keep: Collection[Value] = ()) -> None:
    """Run `nodes` (a topologically ordered subset of one graph) on `values`, adding their outputs.

    `values` maps each value computed so far, the graph inputs among them, to its array; an
    initializer is read from its data. A value these nodes read is dropped from `values` after
    its last read here unless it is in `keep`: the caller keeps what other nodes still read
    (sequential calibration evaluates a graph stage by stage from the live values it holds,
    `aviatorc.quant.sequential`). The kernels are `evaluate`'s, so the arrays are the same.
    """
    last_read: dict[Value, int] = {}
    for step, node in enumerate(nodes):
        for value in node.inputs:
            if value is not None and value.data is None:
                last_read[value] = step
    for step, node in enumerate(nodes):
        ins: list[np.ndarray | None] = []
        for value in node.inputs:
            if value is None:
                ins.append(None)
            elif value in values:
                ins.append(values[value])
            elif value.data is not None:
                ins.append(_read({}, value, node.name))
            else:
                raise EvaluationError(f"value '{value.name}' is read by '{node.name}' but was not given or computed")
        for value, array in zip(node.outputs, _run_node(node, ins)):
            values[value] = np.asarray(array)
        for value in node.inputs:
            if value is not None and last_read.get(value) == step and value not in keep:
                values.pop(value, None)


def _run_node(node: Node, ins: list[np.ndarray | None]) -> Sequence[Any]:
    """The node's kernel on its input arrays; a kernel's failure becomes an EvaluationError naming the node."""
    opdef = get_op(node.op)
    attrs = opdef.resolve_attrs(node.attrs, node.name)
    attrs["_num_outputs"] = len(node.outputs)
    try:
        return opdef.kernel(ins, attrs)
    except EvaluationError:
        raise
    except Exception as error:  # a kernel failing on these feeds: name the node
        raise EvaluationError(f"{type(error).__name__}: {error}", node=node.name, op=node.op) from error


def _read(env: dict[int, np.ndarray], value: Value, where: str) -> np.ndarray:
    if id(value) in env:
        return env[id(value)]
    if value.data is not None:
        if not value.data.available:
            raise EvaluationError(f"weight '{value.name}' has no data (imported shape-only)",
                                  hint="import the model with its weights to evaluate it")
        return value.data.load()
    raise EvaluationError(f"value '{value.name}' is read by '{where}' before it is computed")


def _last_uses(graph: Graph) -> dict[int, int]:
    last: dict[int, int] = {}
    for step, node in enumerate(graph.nodes):
        for value in node.inputs:
            if value is not None and value.producer is not None:
                last[id(value)] = step
    return last
