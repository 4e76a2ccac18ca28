"""The weights a run reads: tiles dequantized once per session, and the graph's other initializers.

A tile is stored as the `DequantizeWeight` slots of its own [k, n] layout (`t<i>.values`,
`t<i>.scale`, ...; see `aviatorc.plan.weights`), so one tile is dequantized without the rest of
its weight, with the IR's own kernel (`aviatorc.quant.tiles.dequantize_packed`): a tile read
back here is exactly those columns (or rows) of the whole weight read back by the interpreter.
Each is read and dequantized on first use and cached for the session's life.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from aviatorc.formats import WeightFormat
from aviatorc.ir import Graph
from aviatorc.ir.ops.quant import ROLES
from aviatorc.plan.artifact import Artifact
from aviatorc.quant.tiles import dequantize_packed


@dataclass(frozen=True)
class TileInfo:
    """One tile of `plan.json`: rows [k0, k1) x columns [n0, n1) of its weight's [k, n] layout."""

    id: str
    weight: str
    role: str
    rows: tuple[int, int]
    cols: tuple[int, int]
    format: WeightFormat

    @property
    def is_embedding(self) -> bool:
        """A row range of a lookup table, stored as its rows (not a column strip)."""
        return self.role == "embedding"

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> TileInfo:
        rows, cols = record["rows"], record["cols"]
        return cls(str(record["id"]), str(record["weight"]), str(record["role"]), (int(rows[0]), int(rows[1])),
                   (int(cols[0]), int(cols[1])), WeightFormat.from_attrs(record["format"]))


class WeightStore:
    """Tiles (float32, dequantized) and initializers of one artifact, each read once."""

    def __init__(self, artifact: Artifact, graph: Graph) -> None:
        self.artifact = artifact
        self.graph = graph
        self.tiles = {t["id"]: TileInfo.from_record(t) for t in artifact.plan["tiles"]}
        self.names = set(artifact.tensor_names())
        self._tiles: dict[str, np.ndarray] = {}
        self._initializers: dict[str, np.ndarray | None] = {}
        self.tile_bytes_read = 0

    def tile(self, tile_id: str) -> np.ndarray:
        """The tile's float32 [k1 - k0, n1 - n0] matrix (an embedding tile: its table rows)."""
        cached = self._tiles.get(tile_id)
        if cached is None:
            info = self.tiles[tile_id]
            arrays: list[np.ndarray | None] = [self.artifact.tensor(f"{tile_id}.{role}")
                                               if f"{tile_id}.{role}" in self.names else None for role in ROLES]
            while arrays and arrays[-1] is None:
                arrays.pop()
            self.tile_bytes_read += sum(a.nbytes for a in arrays if a is not None)
            k, n = info.rows[1] - info.rows[0], info.cols[1] - info.cols[0]
            cached = self._tiles[tile_id] = np.asarray(dequantize_packed(info.format, arrays, k, n))
        return cached

    def initializer(self, name: str) -> np.ndarray | None:
        """An initializer's array: a constant printed in graph.ir, or `init.<name>` of the weights
        file; None for a weight the tiles stand for (only its tiles are stored)."""
        if name not in self._initializers:
            value = self.graph.initializers.get(name)
            array: np.ndarray | None = None
            if value is not None and value.data is not None and value.data.available:
                array = value.data.load()
            elif f"init.{name}" in self.names:
                array = self.artifact.tensor(f"init.{name}")
            self._initializers[name] = array
        return self._initializers[name]
