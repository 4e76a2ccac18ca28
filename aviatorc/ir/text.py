"""The canonical text form of a graph, and its parser.

    graph "main" {
      input %input_ids: int64[batch, seq]
      weight %wte: float32[256, 64]
      const %shape: int64[3] = [0, 0, -1]
      %h: float32[batch, seq, 64] = Gather(%wte, %input_ids) {axis = 0} @embed
      output %h
    }

One statement per line. Weights print their type only, so `parse(print_graph(g))` gives a
graph with the same structure, types and small constants and shape-only weights, which
prints to the same text. Names that are not plain identifiers are JSON-quoted.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from aviatorc.errors import ModelFormatError
from aviatorc.ir.data import ArrayData, ShapeOnly
from aviatorc.ir.graph import AttrValue, Graph, Node, Value
from aviatorc.ir.types import Dim, TensorType, numpy_dtype

INLINE_MAX_ELEMENTS = 16  # constants up to this size print their values
_PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*\Z")


def _name(name: str) -> str:
    return name if _PLAIN.match(name) else json.dumps(name)


def _dim(dim: Dim) -> str:
    if dim is None:
        return "?"
    return str(dim) if isinstance(dim, int) else _name(dim)


def format_type(type: TensorType) -> str:
    return f"{type.dtype}[{', '.join(_dim(d) for d in type.shape)}]"


def _attr(value: AttrValue) -> str:
    if isinstance(value, tuple):
        return "[" + ", ".join(_attr(v) for v in value) + "]"
    if isinstance(value, float):
        return repr(value) if np.isfinite(value) else {float("inf"): "inf", float("-inf"): "-inf"}.get(value, "nan")
    if isinstance(value, str):
        return json.dumps(value)
    return str(value)


def _inline_values(value: Value) -> str | None:
    if value.data is None or not value.data.available or not value.type.is_static:
        return None
    if value.type.numel() > INLINE_MAX_ELEMENTS:
        return None
    array = value.data.load()
    return json.dumps(array.astype(np.float64).tolist() if array.dtype.kind == "f" else array.tolist())


def format_node(node: Node) -> str:
    outs = ", ".join(f"%{_name(v.name)}: {format_type(v.type)}" for v in node.outputs)
    args = ", ".join("_" if v is None else f"%{_name(v.name)}" for v in node.inputs)
    text = f"{outs} = {node.op}({args})"
    if node.attrs:
        text += " {" + ", ".join(f"{k} = {_attr(v)}" for k, v in sorted(node.attrs.items())) + "}"
    return text + f" @{_name(node.name)}"


def print_graph(graph: Graph) -> str:
    """The canonical text of `graph`."""
    lines = [f"graph {json.dumps(graph.name)} {{"]
    for key, val in sorted(graph.metadata.items()):
        lines.append(f"  meta {json.dumps(key)} = {json.dumps(val)}")
    for value in graph.inputs:
        lines.append(f"  input %{_name(value.name)}: {format_type(value.type)}")
    for value in graph.initializers.values():
        inline = _inline_values(value)
        if inline is None:
            lines.append(f"  weight %{_name(value.name)}: {format_type(value.type)}")
        else:
            lines.append(f"  const %{_name(value.name)}: {format_type(value.type)} = {inline}")
    for node in graph.nodes:
        lines.append("  " + format_node(node))
    for value in graph.outputs:
        lines.append(f"  output %{_name(value.name)}")
    lines.append("}")
    return "\n".join(lines) + "\n"


# -- parsing ---------------------------------------------------------------------------------

_TOKEN = re.compile(
    r"""\s*(?:
        (?P<str>"(?:[^"\\]|\\.)*")
      | (?P<num>-?(?:\d+\.\d*(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+|\d+|inf|nan)(?![A-Za-z0-9_.]))
      | (?P<word>[A-Za-z_][A-Za-z0-9_.]*)
      | (?P<punct>[%@\[\](){}=,:?])
    )""",
    re.VERBOSE,
)


# A const line: the head is tokenized, the values after the type's "=" are JSON.
_CONST_LINE = re.compile(
    r'^(?P<head>\s*const\s+%(?:"(?:[^"\\]|\\.)*"|[A-Za-z_][A-Za-z0-9_.]*)\s*:\s*[A-Za-z0-9_]+\[(?:"(?:[^"\\]|\\.)*"|[^\]"])*\])'
    r"\s*=\s*(?P<values>.*)$"
)


class _Tokens:
    def __init__(self, line: str, lineno: int) -> None:
        self.items: list[tuple[str, str]] = []
        self.lineno = lineno
        pos = 0
        line = line.rstrip()
        while pos < len(line):
            match = _TOKEN.match(line, pos)
            if not match or match.end() == pos:
                raise self.error(f"unexpected text {line[pos:pos + 20]!r}")
            kind = match.lastgroup or ""
            self.items.append((kind, match.group(kind)))
            pos = match.end()
        self.pos = 0

    def error(self, message: str) -> ModelFormatError:
        return ModelFormatError(f"line {self.lineno}: {message}")

    def peek(self) -> str | None:
        return self.items[self.pos][1] if self.pos < len(self.items) else None

    def take(self, expected: str | None = None) -> tuple[str, str]:
        if self.pos >= len(self.items):
            raise self.error(f"unexpected end of line (expected {expected or 'more'})")
        kind, text = self.items[self.pos]
        if expected is not None and text != expected:
            raise self.error(f"expected '{expected}', found '{text}'")
        self.pos += 1
        return kind, text

    def name(self) -> str:
        kind, text = self.take()
        if kind == "str":
            return str(json.loads(text))
        if kind == "word":
            return text
        raise self.error(f"expected a name, found '{text}'")

    def value_name(self) -> str:
        self.take("%")
        return self.name()

    def type(self) -> TensorType:
        _, dtype = self.take()
        self.take("[")
        dims: list[Dim] = []
        while self.peek() != "]":
            kind, text = self.take()
            if text == "?":
                dims.append(None)
            elif kind == "num":
                dims.append(int(text))
            elif kind == "str":
                dims.append(json.loads(text))
            else:
                dims.append(text)
            if self.peek() == ",":
                self.take(",")
        self.take("]")
        return TensorType(dtype, tuple(dims))

    def attr(self) -> AttrValue:
        kind, text = self.take()
        if text == "[":
            items = []
            while self.peek() != "]":
                items.append(self.attr())
                if self.peek() == ",":
                    self.take(",")
            self.take("]")
            return tuple(items)  # type: ignore[return-value]
        if kind == "str":
            return str(json.loads(text))
        if kind == "num" or text in ("inf", "nan"):
            return int(text) if re.fullmatch(r"-?\d+", text) else float(text)
        if text == "-" and self.peek() == "inf":
            self.take()
            return float("-inf")
        raise self.error(f"bad attribute value '{text}'")

    def done(self) -> bool:
        return self.pos >= len(self.items)


def parse_graph(text: str) -> Graph:
    """Parse the canonical text form back into a graph."""
    lines = [(i + 1, line) for i, line in enumerate(text.splitlines()) if line.strip()]
    if not lines or not lines[0][1].startswith("graph "):
        raise ModelFormatError("text does not start with 'graph \"NAME\" {'")
    header = _Tokens(lines[0][1], lines[0][0])
    header.take("graph")
    graph = Graph(header.name())
    values: dict[str, Value] = {}

    def lookup(name: str, tokens: _Tokens) -> Value:
        if name not in values:
            raise tokens.error(f"value '%{name}' is used before it is defined")
        return values[name]

    for lineno, line in lines[1:]:
        const = _CONST_LINE.match(line)
        tokens = _Tokens(const["head"] if const else line, lineno)
        head = tokens.peek()
        if head == "}":
            break
        if head == "meta":
            tokens.take()
            key = tokens.name()
            tokens.take("=")
            graph.metadata[key] = tokens.name()
        elif head == "input":
            tokens.take()
            name = tokens.value_name()
            tokens.take(":")
            values[name] = graph.add_input(name, tokens.type())
        elif head in ("weight", "const"):
            tokens.take()
            name = tokens.value_name()
            tokens.take(":")
            type = tokens.type()
            data: Any = ShapeOnly("parsed from text")
            if head == "const":
                if const is None:
                    raise tokens.error("a const needs '= [values]' after its type")
                try:
                    raw = json.loads(const["values"])
                except json.JSONDecodeError as error:
                    raise tokens.error(f"const values are not valid JSON ({error.msg})") from None
                data = ArrayData(np.array(raw, dtype=numpy_dtype(type.dtype)).reshape(type.shape))  # type: ignore[arg-type]
            values[name] = graph.add_initializer(name, type, data)
        elif head == "output":
            tokens.take()
            graph.outputs.append(lookup(tokens.value_name(), tokens))
        else:
            _parse_node(tokens, graph, values, lookup)
    return graph


def _parse_node(tokens: _Tokens, graph: Graph, values: dict[str, Value], lookup: Any) -> None:
    outs: list[tuple[str, TensorType]] = []
    while True:
        name = tokens.value_name()
        tokens.take(":")
        outs.append((name, tokens.type()))
        if tokens.peek() != ",":
            break
        tokens.take(",")
    tokens.take("=")
    op = tokens.name()
    tokens.take("(")
    inputs: list[Value | None] = []
    while tokens.peek() != ")":
        if tokens.peek() == "_":
            tokens.take()
            inputs.append(None)
        else:
            inputs.append(lookup(tokens.value_name(), tokens))
        if tokens.peek() == ",":
            tokens.take(",")
    tokens.take(")")
    attrs: dict[str, AttrValue] = {}
    if tokens.peek() == "{":
        tokens.take("{")
        while tokens.peek() != "}":
            key = tokens.name()
            tokens.take("=")
            attrs[key] = tokens.attr()
            if tokens.peek() == ",":
                tokens.take(",")
        tokens.take("}")
    tokens.take("@")
    node_name = tokens.name()
    node = graph.add_node(op, inputs, [t for _, t in outs], attrs, name=node_name, output_names=[n for n, _ in outs])
    for value in node.outputs:
        values[value.name] = value
