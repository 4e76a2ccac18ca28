"""What a graph holds: inputs, outputs, op census, parameters and bytes by element type."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aviatorc.ir import Graph
from aviatorc.ir.data import Derived
from aviatorc.ir.text import format_type
from aviatorc.ir.types import FLOAT_DTYPES, itemsize


@dataclass(frozen=True)
class GraphSummary:
    name: str
    inputs: tuple[tuple[str, str], ...]
    outputs: tuple[tuple[str, str], ...]
    op_census: dict[str, int]
    num_nodes: int
    num_parameters: int  # elements of floating-point initializers, a tied copy (the transposed table of a tied head) once
    bytes_by_dtype: dict[str, int]
    shape_only: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "inputs": [{"name": n, "type": t} for n, t in self.inputs],
            "outputs": [{"name": n, "type": t} for n, t in self.outputs],
            "nodes": self.num_nodes,
            "op_census": self.op_census,
            "parameters": self.num_parameters,
            "bytes_by_dtype": self.bytes_by_dtype,
            "shape_only": self.shape_only,
        }


def summarize(graph: Graph) -> GraphSummary:
    bytes_by_dtype: dict[str, int] = {}
    params = 0
    shape_only = False
    counted: set[int] = set()  # the bytes already counted as parameters, by the identity of their source
    for value in graph.initializers.values():
        if not value.type.is_static:
            continue
        numel = value.type.numel()
        bytes_by_dtype[value.type.dtype] = bytes_by_dtype.get(value.type.dtype, 0) + numel * itemsize(value.type.dtype)
        source = root_data(value.data)
        if value.type.dtype in FLOAT_DTYPES and (source is None or id(source) not in counted):
            params += numel
            if source is not None:
                counted.add(id(source))
        shape_only = shape_only or (value.data is not None and not value.data.available)
    return GraphSummary(
        name=graph.name,
        inputs=tuple((v.name, format_type(v.type)) for v in graph.inputs),
        outputs=tuple((v.name, format_type(v.type)) for v in graph.outputs),
        op_census=graph.op_census(),
        num_nodes=len(graph.nodes),
        num_parameters=params,
        bytes_by_dtype=dict(sorted(bytes_by_dtype.items())),
        shape_only=shape_only,
    )


def root_data(data: object) -> object | None:
    """The stored bytes `data` is computed from (a lazy transpose's source), or None."""
    while isinstance(data, Derived):
        data = data.source
    return data


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def human_count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)
