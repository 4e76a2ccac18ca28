"""Weights and their tiles: what the partitioner places.

A `WeightSpec` is one weight matrix as stored: a linear weight [k, n] (k the reduction dim,
n the output channels) or an embedding table [vocab, hidden] (role "embedding").

Tied embeddings (one table read by the embedding `Gather` and, transposed, by the `lm_head`
MatMul) are one tensor with two uses. Its bytes live in the head's spec: a linear
[hidden, vocab] weight with `tied_to` naming the embedding, whose column strips are exactly
row ranges of the table, so the lookup reads a token's row from the same tiles. The embedding's
own spec stays (it names the Gather and has layer -1) as an *alias*: `tied_to` names the head,
it stores 0 bytes and is not tiled.

Tiles follow the matrix units. A linear weight is split along n into column strips whose
widths are multiples of the matrix unit's n (the last one may be ragged): a strip holds
whole columns, so its per-channel scales, its K-groups and its 2:4 indices all stay inside
it and the strips' bytes add up exactly to the weight's. An embedding table is split along
its rows (a lookup reads one row), in multiples of the matrix unit's k. Bytes are always
`WeightFormat.storage_bytes` of the tile's own [k, n].
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from aviatorc.formats import WeightFormat

Part = tuple[str, int, int]  # (role, n_start, n_stop): one projection inside a fused weight


@dataclass(frozen=True)
class WeightSpec:
    """One weight matrix.

    `input` names the activation it reads (weights reading the same activation form a group:
    the activation is sent once to every chiplet computing one of them). `nodes` are the IR
    nodes that read it (its MatMuls; the Gather of an embedding; both for a tied head).
    `splits` are the parts of a fused weight (fuse-qkv's q/k/v, an exporter's fused c_attn),
    as (role, n_start, n_stop) in column order; empty for an unfused weight. `tied_to` names
    the other spec of a tied embedding/head pair (see the module docstring).
    """

    name: str
    layer: int
    role: str
    k: int
    n: int
    format: WeightFormat
    input: str = ""
    nodes: tuple[str, ...] = ()
    splits: tuple[Part, ...] = ()
    tied_to: str = ""
    expert: int = -1  # a mixture-of-experts expert's weight (its index): one placement unit

    @property
    def is_embedding(self) -> bool:
        return self.role == "embedding"

    @property
    def is_alias(self) -> bool:
        """A tied embedding: its bytes are the head's tiles, so it holds none of its own."""
        return self.is_embedding and bool(self.tied_to)

    @property
    def is_tied_head(self) -> bool:
        return not self.is_embedding and bool(self.tied_to)

    @property
    def storage_bytes(self) -> int:
        return 0 if self.is_alias else self.format.storage_bytes(self.k, self.n)

    @property
    def group(self) -> str:
        """"<layer>:<input>": the weights reading one activation."""
        return f"{self.layer}:{self.input or self.name}"


@dataclass(frozen=True)
class Tile:
    """A piece of one weight: rows [k_start, k_stop) x columns [n_start, n_stop).

    `nodes` are the weight's reading nodes; `parts` the fused parts this strip's columns
    overlap, clipped to the strip (weight column coordinates); `tied_to` as the weight's."""

    weight: str
    layer: int
    role: str
    group: str  # "<layer>:<input>": tiles reading the same activation
    k_start: int
    k_stop: int
    n_start: int
    n_stop: int
    format: WeightFormat
    nodes: tuple[str, ...] = ()
    parts: tuple[Part, ...] = ()
    tied_to: str = ""
    expert: int = -1  # the expert index of a mixture-of-experts weight's tile

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

    def reads_for(self, node: str) -> bool:
        """Whether IR node `node` reads this tile's bytes."""
        return node in self.nodes


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


def clip_parts(parts: tuple[Part, ...], start: int, stop: int) -> tuple[Part, ...]:
    """The parts overlapping columns [start, stop), clipped to them."""
    return tuple((role, max(a, start), min(b, stop)) for role, a, b in parts if a < stop and b > start)


def tile_weight(spec: WeightSpec, unit_k: int, unit_n: int, parts: int) -> list[Tile]:
    """Split one weight into at most `parts` tiles aligned to the matrix unit (none for an alias)."""
    if spec.is_alias:
        return []
    if spec.is_embedding:
        return [Tile(spec.name, spec.layer, spec.role, spec.group, a, b, 0, spec.n, spec.format, spec.nodes)
                for a, b in split_aligned(spec.k, unit_k, parts)]
    return [Tile(spec.name, spec.layer, spec.role, spec.group, 0, spec.k, a, b, spec.format, spec.nodes,
                 clip_parts(spec.splits, a, b), spec.tied_to, spec.expert)
            for a, b in split_aligned(spec.n, unit_n, parts)]


EXPERT_TILE_BYTES = 16 * 2**20  # an expert's weight is one tile up to this size (DeepSeek-V3's are 15.6 MB at 4 bits)
EXPERT_STRIP_BYTES = 2**20  # the smallest strip an expert's weight is cut into
EXPERT_TILES_MAX = 32_000  # expert tiles in all, past which strips grow: what the placement solves in minutes


def expert_tile_bytes(specs: Sequence[WeightSpec], unit_n: int) -> int:
    """How large an expert's strips may be. A step loads a streamed expert once its routing is
    known, so it waits for the channel with the most of the routed experts' strips: the smaller
    the strips, the more evenly they spread over the channels (Mixtral-8x7B on 4 cards, uniform
    routing: 22.2 ms a token with 16 MiB strips, 5.5 ms with 2 MiB, 4.1 ms with 1 MiB). Strips
    start at `EXPERT_STRIP_BYTES` and double until the experts make at most `EXPERT_TILES_MAX`
    tiles (DeepSeek-V3's 44,544 expert weights stay one tile each)."""
    sizes = [(s.storage_bytes, s.n) for s in specs if s.expert >= 0 and not s.is_alias]
    limit = EXPERT_STRIP_BYTES
    while limit < EXPERT_TILE_BYTES and sum(_strips(b, n, unit_n, limit) for b, n in sizes) > EXPERT_TILES_MAX:
        limit *= 2
    return min(limit, EXPERT_TILE_BYTES)


def _strips(nbytes: int, n: int, unit_n: int, limit: int) -> int:
    """About how many strips `tile_weights` cuts a weight of `nbytes` into: halving until under `limit`."""
    count = 1
    while -(-nbytes // count) > limit and count < -(-n // unit_n):
        count *= 2
    return count


def tile_weights(specs: list[WeightSpec], unit_k: int, unit_n: int, parts: int, max_tile_bytes: int,
                 expert_bytes: int = EXPERT_TILE_BYTES) -> list[Tile]:
    """Tiles of every weight: `parts` per weight, more where a tile would exceed `max_tile_bytes`
    (so it can be packed beside others), in the order of `specs`. An expert's weight starts as
    one tile: experts are the placement units of a mixture of experts (hundreds of them per layer
    place whole on the chiplets, where `parts` strips each would make DeepSeek-V3 a million tiles);
    it is cut into strips past `expert_bytes` (`expert_tile_bytes`)."""
    tiles: list[Tile] = []
    for spec in specs:
        if spec.is_alias:
            continue
        count = 1 if spec.expert >= 0 else parts
        pieces = tile_weight(spec, unit_k, unit_n, count)
        limit = spec.k if spec.is_embedding else spec.n
        unit = unit_k if spec.is_embedding else unit_n
        # A large expert is cut too: streamed, its strips load side by side from several channels
        # once its routing is known (one Mixtral-8x7B expert is 93 MB at 4 bits: 1.5 ms on one channel).
        largest = min(max_tile_bytes, expert_bytes) if spec.expert >= 0 else max_tile_bytes
        while max(t.storage_bytes for t in pieces) > largest and count < math.ceil(limit / unit):
            count *= 2
            pieces = tile_weight(spec, unit_k, unit_n, count)
        tiles.extend(pieces)
    return tiles


def lora_reachable(weight: WeightSpec | Tile) -> bool:
    """Whether a LoRA adapter may target this weight (or strip): a projection, not an embedding,
    a tied head or an expert (`aviatorc.runtime.lora` and the SRAM `--lora-rank` reserves)."""
    return not weight.is_embedding and not weight.tied_to and weight.expert < 0
