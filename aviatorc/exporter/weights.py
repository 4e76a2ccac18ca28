"""The whole stored arrays of every initializer of an artifact's graph, put back together from its tiles.

An artifact stores a weight as the packed arrays of its tiles (`aviatorc.plan.weights`): a
linear weight as column strips, each strip the `DequantizeWeight` slots of its own [k, n]
layout; an embedding table as row ranges; a dense weight read through a Transpose (a torch
linear, a tied head) as strips of its [k, n] view. Every stored array keeps whole columns in its
last axis (`aviatorc.quant.tiles`), so the strips of one weight, side by side in column order,
are exactly the weight's own arrays: the codes and scales the compile chose, not re-quantized.
Every other initializer is `init.<name>` in the weights file or a constant printed in graph.ir.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from aviatorc.errors import OptionError
from aviatorc.ir import Graph, Value
from aviatorc.ir.ops.quant import ROLES
from aviatorc.plan.artifact import Artifact, ArtifactError
from aviatorc.plan.ir import tile_name


@dataclass(frozen=True)
class _Piece:
    """One tile's part of a weight: where it sits, and which stored arrays hold it."""

    start: int  # first column (a strip) or row (an embedding tile)
    stop: int
    tile: str


def initializer_arrays(artifact: Artifact, graph: Graph) -> dict[str, np.ndarray]:
    """Every initializer of `graph` (the artifact's graph.ir) -> its whole stored array."""
    if artifact.shape_only:
        raise OptionError("this artifact was compiled shape-only: it holds no weights to export",
                          file=str(artifact.path), hint="compile from a model with weights (an ONNX file or "
                          "an nn.Module, not a config.json), then export that artifact")
    names = set(artifact.tensor_names())
    arrays: dict[str, np.ndarray] = {}
    for name, value in graph.initializers.items():
        if value.data is not None and value.data.available:
            arrays[name] = value.data.load()
        elif f"init.{name}" in names:
            arrays[name] = artifact.tensor(f"init.{name}")
    for target, pieces in _tile_groups(artifact, graph).items():
        arrays.update(_assemble(artifact, names, target, pieces))
    missing = sorted(set(graph.initializers) - set(arrays))
    if missing:
        raise ArtifactError(f"the weights file holds neither a tile nor 'init.<name>' for {len(missing)} "
                            f"initializer(s), first '{missing[0]}'", file=str(artifact.path),
                            hint="recompile the model: the artifact is incomplete")
    return arrays


# A weight's tiles, keyed by what they stand for: ("packed", DequantizeWeight node name), or
# ("rows" | "cols" | "cols_t", dense initializer name).
_Key = tuple[str, str]


def _tile_groups(artifact: Artifact, graph: Graph) -> dict[tuple[_Key, Any], list[_Piece]]:
    nodes = {n.name: n for n in graph.nodes}
    groups: dict[tuple[_Key, Any], dict[int, _Piece]] = {}
    for index, record in enumerate(artifact.plan.tiles):
        tile_id = tile_name(index)
        node = nodes.get(record.nodes[0]) if record.nodes else None
        if node is None:
            raise ArtifactError(f"tile {tile_id} names node '{record.nodes[0] if record.nodes else ''}', which graph.ir "
                                "does not have", file=str(artifact.path))
        lookup = node.op == "Gather"
        source = node.inputs[0] if lookup else node.inputs[1]
        if source is None:
            raise ArtifactError(f"tile {tile_id}'s node '{node.name}' has no weight input", file=str(artifact.path))
        value, transposed = _through_views(source)
        rows, cols = record.rows, record.cols
        target: tuple[_Key, Any]
        if value.producer is not None and value.producer.op == "DequantizeWeight":
            target = (("packed", value.producer.name), value.producer)
            span = (int(cols[0]), int(cols[1]))
        elif record.role == "embedding":
            target, span = (("rows", value.name), value), (int(rows[0]), int(rows[1]))
        else:
            kind = "cols_t" if transposed or lookup else "cols"  # stored [n, k]: the tiles are strips of its .T
            target, span = ((kind, value.name), value), (int(cols[0]), int(cols[1]))
        groups.setdefault(target, {})[span[0]] = _Piece(span[0], span[1], tile_id)
    return {target: sorted(pieces.values(), key=lambda p: p.start) for target, pieces in groups.items()}


def _through_views(value: Value) -> tuple[Value, bool]:
    """The value a weight operand reads through Casts and Transposes, and whether it is transposed."""
    transposed = False
    while value.producer is not None and value.producer.op in ("Cast", "Transpose"):
        transposed ^= value.producer.op == "Transpose"
        value = value.producer.input(0)
    return value, transposed


def _assemble(artifact: Artifact, names: set[str], target: tuple[_Key, Any],
              pieces: list[_Piece]) -> dict[str, np.ndarray]:
    (kind, name), owner = target
    where = str(artifact.path)
    stop = 0
    for piece in pieces:  # the tiles must cover the weight once, in order
        if piece.start != stop:
            raise ArtifactError(f"the tiles of '{name}' leave a gap or overlap at {stop} (tile {piece.tile} "
                                f"starts at {piece.start})", file=where)
        stop = piece.stop
    if kind == "packed":
        out: dict[str, np.ndarray] = {}
        for index, role in enumerate(ROLES):
            stored = [f"{p.tile}.{role}" for p in pieces]
            present = [s in names for s in stored]
            if not any(present):
                continue
            if not all(present):
                raise ArtifactError(f"some tiles of '{name}' lack their '{role}' array", file=where)
            source = owner.inputs[index]
            if source is None:
                raise ArtifactError(f"tiles of '{name}' store a '{role}' array its DequantizeWeight does not read",
                                    file=where)
            out[source.name] = np.concatenate([artifact.tensor(s) for s in stored], axis=-1)
        return out
    strips = [artifact.tensor(f"{p.tile}.values") for p in pieces]
    if kind == "rows":
        return {name: np.concatenate(strips, axis=0)}
    whole = np.concatenate(strips, axis=1)
    return {name: np.ascontiguousarray(whole.T) if kind == "cols_t" else whole}
