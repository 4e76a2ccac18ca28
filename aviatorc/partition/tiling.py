"""Weights and their tiles: what the partitioner places.

A `WeightSpec` is one weight matrix as stored: a linear weight [k, n] (k the reduction dim,
n the output channels) or an embedding table [vocab, hidden] (role "embedding").

Tiles follow the matrix units. A linear weight is split along n into column strips whose
widths are multiples of the matrix unit's n (the last one may be ragged): a strip holds
whole columns, so its per-channel scales, its K-groups and its 2:4 indices all stay inside
it and the strips' bytes add up exactly to the weight's. An embedding table is split along
its rows (a lookup reads one row), in multiples of the matrix unit's k. Bytes are always
`WeightFormat.storage_bytes` of the tile's own [k, n].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from aviatorc.formats import WeightFormat


@dataclass(frozen=True)
class WeightSpec:
    """One weight matrix. `input` names the activation it reads (weights reading the same
    activation form a group: the activation is sent once to every chiplet holding one of them)."""

    name: str
    layer: int
    role: str
    k: int
    n: int
    format: WeightFormat
    input: str = ""

    @property
    def is_embedding(self) -> bool:
        return self.role == "embedding"

    @property
    def storage_bytes(self) -> int:
        return self.format.storage_bytes(self.k, self.n)


@dataclass(frozen=True)
class Tile:
    """A piece of one weight: rows [k_start, k_stop) x columns [n_start, n_stop)."""

    weight: str
    layer: int
    role: str
    group: str  # "<layer>:<input>": tiles reading the same activation
    k_start: int
    k_stop: int
    n_start: int
    n_stop: int
    format: WeightFormat

    @property
    def k(self) -> int:
        return self.k_stop - self.k_start

    @property
    def n(self) -> int:
        return self.n_stop - self.n_start

    @property
    def storage_bytes(self) -> int:
        return self.format.storage_bytes(self.k, self.n)

    @property
    def is_embedding(self) -> bool:
        return self.role == "embedding"


def split_aligned(length: int, unit: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) ranges covering [0, length), each a whole number of `unit`s (the last may be
    ragged), as even as the units allow, at most `parts` of them."""
    units = math.ceil(length / unit)
    parts = max(1, min(parts, units))
    base, extra = divmod(units, parts)
    ranges = []
    start = 0
    for index in range(parts):
        width = (base + (1 if index < extra else 0)) * unit
        stop = min(length, start + width)
        ranges.append((start, stop))
        start = stop
    return ranges


def tile_weight(spec: WeightSpec, unit_k: int, unit_n: int, parts: int) -> list[Tile]:
    """Split one weight into at most `parts` tiles aligned to the matrix unit."""
    group = f"{spec.layer}:{spec.input or spec.name}"
    if spec.is_embedding:
        return [Tile(spec.name, spec.layer, spec.role, group, a, b, 0, spec.n, spec.format)
                for a, b in split_aligned(spec.k, unit_k, parts)]
    return [Tile(spec.name, spec.layer, spec.role, group, 0, spec.k, a, b, spec.format)
            for a, b in split_aligned(spec.n, unit_n, parts)]


def tile_weights(specs: list[WeightSpec], unit_k: int, unit_n: int, parts: int, max_tile_bytes: int) -> list[Tile]:
    """Tiles of every weight: `parts` per weight, more where a tile would exceed `max_tile_bytes`
    (so it can be packed beside others), in the order of `specs`."""
    tiles: list[Tile] = []
    for spec in specs:
        count = parts
        pieces = tile_weight(spec, unit_k, unit_n, count)
        limit = spec.k if spec.is_embedding else spec.n
        unit = unit_k if spec.is_embedding else unit_n
        while max(t.storage_bytes for t in pieces) > max_tile_bytes and count < math.ceil(limit / unit):
            count *= 2
            pieces = tile_weight(spec, unit_k, unit_n, count)
        tiles.extend(pieces)
    return tiles
