"""The graph: values, nodes, and the use lists that tie them together.

A `Value` knows its producer and its users; the `Node` setters keep both up to date, so
passes never patch use lists by hand. Initializers (weights and constants) are values
with `data` and no producer. Nodes are kept in a topological order; `Graph.sort()`
restores it after a rewrite and rejects cycles.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from aviatorc.errors import ModelFormatError
from aviatorc.ir.data import ArrayData, TensorData
from aviatorc.ir.types import TensorType, dtype_name

AttrValue = int | float | str | tuple[int, ...] | tuple[float, ...] | tuple[str, ...]


class Value:
    """A tensor in the graph: a graph input, an initializer, or a node output."""

    __slots__ = ("name", "type", "producer", "users", "data")

    def __init__(self, name: str, type: TensorType, data: TensorData | None = None) -> None:
        self.name = name
        self.type = type
        self.producer: Node | None = None
        self.users: list[Node] = []  # one entry per use, so a node reading twice appears twice
        self.data = data

    @property
    def is_initializer(self) -> bool:
        return self.data is not None

    def const_value(self) -> np.ndarray | None:
        """The array of an initializer whose bytes are available, else None."""
        if self.data is None or not self.data.available:
            return None
        return self.data.load()

    def __repr__(self) -> str:
        return f"%{self.name}: {self.type}"


class Node:
    """One op application. Inputs may be None for an omitted optional input."""

    __slots__ = ("op", "name", "attrs", "_inputs", "outputs")

    def __init__(
        self,
        op: str,
        inputs: Sequence[Value | None],
        outputs: Sequence[Value],
        attrs: Mapping[str, Any] | None = None,
        name: str = "",
    ) -> None:
        self.op = op
        self.name = name
        self.attrs: dict[str, AttrValue] = {k: normalize_attr(v) for k, v in (attrs or {}).items()}
        self._inputs: list[Value | None] = []
        for value in inputs:
            self._inputs.append(value)
            if value is not None:
                value.users.append(self)
        self.outputs: list[Value] = list(outputs)
        for value in self.outputs:
            value.producer = self

    @property
    def inputs(self) -> tuple[Value | None, ...]:
        return tuple(self._inputs)

    def input(self, index: int) -> Value:
        """The input at `index`, which must be present."""
        value = self._inputs[index] if index < len(self._inputs) else None
        if value is None:
            raise ModelFormatError(f"input {index} is missing", node=self.name, op=self.op)
        return value

    def optional_input(self, index: int) -> Value | None:
        return self._inputs[index] if index < len(self._inputs) else None

    def set_input(self, index: int, value: Value | None) -> None:
        old = self._inputs[index]
        if old is not None:
            old.users.remove(self)
        self._inputs[index] = value
        if value is not None:
            value.users.append(self)

    def detach(self) -> None:
        """Drop this node's uses of its inputs (before removing it from a graph)."""
        for index in range(len(self._inputs)):
            self.set_input(index, None)

    def __repr__(self) -> str:
        return f"Node({self.op}, '{self.name}')"


def normalize_attr(value: Any) -> AttrValue:
    """Attributes are ints, floats, strings, or tuples of one of them (deterministic, hashable)."""
    if isinstance(value, (bool, np.bool_)):
        return int(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple, np.ndarray)):
        items = [normalize_attr(v) for v in value]
        return tuple(items)  # type: ignore[return-value]
    raise TypeError(f"unsupported attribute value {value!r}")


class Graph:
    """A typed dataflow graph of a closed op set."""

    def __init__(self, name: str = "main") -> None:
        self.name = name
        self.inputs: list[Value] = []
        self.outputs: list[Value] = []
        self.initializers: dict[str, Value] = {}
        self.nodes: list[Node] = []
        self.metadata: dict[str, str] = {}
        self._names: set[str] = set()
        self._counter = itertools.count()
        # During `batched_inserts`: nodes waiting to go before an anchor, and the positions then.
        self._pending: dict[int, list[Node]] | None = None
        self._pending_anchor: dict[int, Node] = {}
        self._positions: dict[int, int] = {}

    # -- building -----------------------------------------------------------------------

    def unique_name(self, base: str) -> str:
        """A value name not yet used in this graph, derived from `base`."""
        name = base or "v"
        while name in self._names:
            name = f"{base}_{next(self._counter)}"
        return name

    def unique_node_name(self, base: str) -> str:
        """A node name not yet used in this graph (and no value's name), derived from `base`."""
        taken = {node.name for node in self.nodes}
        name = base or "node"
        while name in taken or name in self._names:
            name = f"{base}_{next(self._counter)}"
        return name

    def _claim(self, name: str) -> str:
        if name in self._names:
            raise ModelFormatError(f"value name '{name}' is defined twice")
        self._names.add(name)
        return name

    def rename(self, value: Value, name: str) -> None:
        """Give `value` (an input, initializer or node output of this graph) a new, unused name."""
        if name == value.name:
            return
        self._claim(name)
        self._names.discard(value.name)
        if self.initializers.get(value.name) is value:
            del self.initializers[value.name]
            self.initializers[name] = value
        value.name = name

    def add_input(self, name: str, type: TensorType) -> Value:
        value = Value(self._claim(name), type)
        self.inputs.append(value)
        return value

    def add_initializer(self, name: str, type: TensorType, data: TensorData) -> Value:
        value = Value(self._claim(name), type, data)
        self.initializers[name] = value
        return value

    def add_constant(self, array: np.ndarray, name: str = "const") -> Value:
        """A new initializer holding `array` under a fresh name."""
        array = np.asarray(array)
        type = TensorType(dtype_name(array.dtype), tuple(int(d) for d in array.shape))
        return self.add_initializer(self.unique_name(name), type, ArrayData(array))

    def add_node(
        self,
        op: str,
        inputs: Sequence[Value | None],
        output_types: Sequence[TensorType],
        attrs: Mapping[str, Any] | None = None,
        *,
        name: str = "",
        output_names: Sequence[str] | None = None,
        before: Node | None = None,
    ) -> Node:
        """Create a node with fresh output values; append it, or insert it before `before`."""
        base = name or op
        names = output_names or [self.unique_name(f"{base}_out{i}" if i else f"{base}_out") for i in range(len(output_types))]
        outputs = [Value(self._claim(n), t) for n, t in zip(names, output_types)]
        node = Node(op, inputs, outputs, attrs, name or names[0])
        if before is None:
            self.nodes.append(node)
        elif self._pending is not None:
            anchor = self._anchor(before)
            waiting = self._pending.setdefault(id(anchor), [])
            # just before `before` when it is itself waiting in this batch, else last before the anchor
            waiting.insert(waiting.index(before) if before is not anchor else len(waiting), node)
            self._pending_anchor[id(node)] = anchor
        else:
            self.nodes.insert(self.nodes.index(before), node)
        return node

    @contextlib.contextmanager
    def batched_inserts(self) -> Iterator[None]:
        """Within it, nodes added `before=` a node are placed in one pass over the node list on
        exit, in the order added (so a pass rewriting thousands of weights, each inserted before
        its MatMul, costs one pass, not one per weight); `position` answers from the order at
        entry. Only appends and `before=` inserts may change the node list meanwhile."""
        if self._pending is not None:
            yield
            return
        self._pending, self._pending_anchor = {}, {}
        self._positions = {id(node): i for i, node in enumerate(self.nodes)}
        try:
            yield
        finally:
            pending, self._pending = self._pending, None
            self._positions, self._pending_anchor = {}, {}
            placed: list[Node] = []
            for node in self.nodes:
                placed.extend(pending.pop(id(node), ()))
                placed.append(node)
            if pending:
                raise RuntimeError("batched_inserts: an anchor node was removed before its inserts were placed")
            self.nodes = placed

    def _anchor(self, before: Node) -> Node:
        """The node of the list a batched insert goes in front of (`before` itself, or the anchor of
        a node inserted in this batch)."""
        return self._pending_anchor.get(id(before), before)

    def position(self, node: Node) -> int:
        """The node's index in the node list (during `batched_inserts`, in the list at entry; a node
        inserted in the batch answers its anchor's)."""
        if self._pending is not None:
            return self._positions[id(self._anchor(node))]
        return self.nodes.index(node)

    def remove_node(self, node: Node) -> None:
        """Remove a node whose outputs are no longer used."""
        for out in node.outputs:
            if out.users or out in self.outputs:
                raise ValueError(f"cannot remove {node!r}: output '{out.name}' is still used")
        node.detach()
        self.nodes.remove(node)
        for out in node.outputs:
            self._names.discard(out.name)

    def remove_initializer(self, value: Value) -> None:
        if value.users or value in self.outputs:
            raise ValueError(f"cannot remove initializer '{value.name}': still used")
        del self.initializers[value.name]
        self._names.discard(value.name)

    def replace_all_uses(self, old: Value, new: Value) -> None:
        """Make every user of `old` (and the graph outputs) read `new` instead."""
        for user in list(old.users):
            for index, value in enumerate(user.inputs):
                if value is old:
                    user.set_input(index, new)
        self.outputs = [new if v is old else v for v in self.outputs]

    # -- queries ------------------------------------------------------------------------

    def values(self) -> Iterator[Value]:
        """Every value: inputs, initializers, then node outputs in order."""
        yield from self.inputs
        yield from self.initializers.values()
        for node in self.nodes:
            yield from node.outputs

    def value(self, name: str) -> Value:
        for value in self.values():
            if value.name == name:
                return value
        raise KeyError(name)

    def op_census(self) -> dict[str, int]:
        census: dict[str, int] = {}
        for node in self.nodes:
            census[node.op] = census.get(node.op, 0) + 1
        return dict(sorted(census.items()))

    def clone(self) -> Graph:
        """A structural copy; initializer bytes are shared, not copied (they are never mutated)."""
        copy = Graph(self.name)
        copy.metadata = dict(self.metadata)
        mapping: dict[int, Value] = {}
        for value in self.inputs:
            mapping[id(value)] = copy.add_input(value.name, value.type)
        for value in self.initializers.values():
            assert value.data is not None
            mapping[id(value)] = copy.add_initializer(value.name, value.type, value.data)
        for node in self.nodes:
            inputs = [mapping[id(v)] if v is not None else None for v in node.inputs]
            new = copy.add_node(node.op, inputs, [v.type for v in node.outputs], node.attrs, name=node.name,
                                output_names=[v.name for v in node.outputs])
            for old_out, new_out in zip(node.outputs, new.outputs):
                mapping[id(old_out)] = new_out
        copy.outputs = [mapping[id(v)] for v in self.outputs]
        return copy

    # -- order --------------------------------------------------------------------------

    def sort(self) -> None:
        """Order nodes topologically, stably (ties keep the current order); reject cycles."""
        position = {id(node): i for i, node in enumerate(self.nodes)}
        pending: dict[int, int] = {}
        dependents: dict[int, list[Node]] = {}
        for node in self.nodes:
            producers = {id(v.producer) for v in node.inputs if v is not None and v.producer is not None}
            pending[id(node)] = len(producers)
            for producer in producers:
                dependents.setdefault(producer, []).append(node)
        ready = [(position[id(n)], n) for n in self.nodes if pending[id(n)] == 0]
        heapq.heapify(ready)
        ordered: list[Node] = []
        while ready:
            _, node = heapq.heappop(ready)
            ordered.append(node)
            for dependent in dependents.get(id(node), []):
                pending[id(dependent)] -= 1
                if pending[id(dependent)] == 0:
                    heapq.heappush(ready, (position[id(dependent)], dependent))
        if len(ordered) != len(self.nodes):
            stuck = [n for n in self.nodes if pending[id(n)] > 0]
            raise ModelFormatError(
                f"the graph has a cycle through {len(stuck)} node(s)", node=stuck[0].name, op=stuck[0].op
            )
        self.nodes = ordered

    def __repr__(self) -> str:
        return f"Graph('{self.name}', {len(self.nodes)} nodes, {len(self.initializers)} initializers)"


def iter_initializer_bytes(values: Iterable[Value]) -> int:
    """Total bytes of the given initializers by their types (shape-only ones count too)."""
    return sum(v.type.nbytes() for v in values if v.type.is_static)
