"""The placement problem as data, and the one cost model every part agrees on.

Each tile is either resident on one chiplet or streamed per token from one card's LPDDR.
An assignment is a tuple `where` with one entry per tile: `0 <= where[t] < C` is a chiplet,
`C + h` means streamed from card h. Costs are integer picoseconds per decode step:

    cost = sum over layers of  sum over groups g of max_c load(c, g)   compute: the busiest chiplet
                             + max_h stream(h)                          LPDDR: the busiest card streams
                             + sum over groups g of cut(g)              activations sent to g's chiplets

- a group is the weights reading one activation (q, k, v; o; gate, up; down): groups run one
  after another (each needs the one before), so each is balanced on its own;
- load(c, g): g's resident tiles on c, each max(FLOPs / peak of its format, bytes / SRAM bandwidth);
- stream(h): per-token bytes read from card h's LPDDR / its bandwidth (a linear tile is read
  whole every step; an embedding row range only when a token falls in it);
- cut(g): the activation a group reads goes along a tree over the hierarchy to every chiplet
  holding one of the group's tiles: each extra chiplet in a package costs one die-to-die
  transfer, each extra package on a card one package-to-package transfer, each extra card
  one card-to-card transfer (latency + bytes / bandwidth).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from aviatorc.partition.tiling import Tile
from aviatorc.target import Target

PS = 1e12  # picoseconds per second


@dataclass(frozen=True)
class Problem:
    """Tiles with their costs on one target. Index-aligned tuples keep the solver loops plain."""

    target: Target
    tiles: tuple[Tile, ...]
    tile_bytes: tuple[int, ...]
    work_ps: tuple[int, ...]  # time on the chiplet holding it, per step
    stream_ps: tuple[int, ...]  # time to stream its per-step bytes from one card's LPDDR
    read_bytes: tuple[int, ...]  # bytes it reads from memory per step
    groups: tuple[str, ...]  # group names, sorted
    group_of: tuple[int, ...]  # tile -> group index
    edge_ps: tuple[tuple[int, int, int], ...]  # group -> cost of one transfer at each link level
    group_act_bytes: tuple[int, ...]  # group -> bytes of the activation it reads, per step
    layers: tuple[int, ...]  # sorted distinct layer indices
    capacity_bytes: int  # usable SRAM per chiplet for weights
    batch_tokens: int

    @property
    def num_chiplets(self) -> int:
        return self.target.num_chiplets

    @property
    def num_cards(self) -> int:
        return self.target.cards


def build_problem(tiles: Sequence[Tile], target: Target, *, batch_tokens: int = 1,
                  vocab_rows: dict[str, int] | None = None) -> Problem:
    """Cost every tile on `target` for a decode step of `batch_tokens` tokens."""
    vocab_rows = vocab_rows or {}
    tile_bytes, work, stream, read = [], [], [], []
    group_act_bytes: dict[str, int] = {}
    for tile in tiles:
        nbytes = tile.storage_bytes
        if tile.is_embedding:
            rows = vocab_rows.get(tile.weight, tile.k_stop)
            # Expected bytes read: each of the batch's tokens reads one row, in this tile with
            # probability k / rows, so batch * (nbytes / k) * (k / rows) = batch * nbytes / rows.
            per_step = min(nbytes, -(-nbytes * batch_tokens // rows))
            flops = 0.0
            act = tile.n * target.activation_bytes_per_element * batch_tokens
        else:
            per_step = nbytes
            flops = 2.0 * tile.k * tile.n * batch_tokens
            act = tile.k * target.activation_bytes_per_element * batch_tokens
        seconds = max(flops / target.flops_per_s(tile.format.kind), per_step / target.chiplet.sram_bytes_per_s)
        tile_bytes.append(nbytes)
        read.append(per_step)
        work.append(max(1, round(seconds * PS)))
        stream.append(max(1, round(per_step / target.lpddr_bytes_per_s_per_card * PS)))
        group_act_bytes[tile.group] = max(group_act_bytes.get(tile.group, 0), act)
    groups = tuple(sorted(group_act_bytes))
    index = {g: i for i, g in enumerate(groups)}
    edge = tuple(tuple(round(link.transfer_s(group_act_bytes[g]) * PS) for link in target.links) for g in groups)
    return Problem(
        target=target,
        tiles=tuple(tiles),
        tile_bytes=tuple(tile_bytes),
        work_ps=tuple(work),
        stream_ps=tuple(stream),
        read_bytes=tuple(read),
        groups=groups,
        group_of=tuple(index[t.group] for t in tiles),
        edge_ps=edge,  # type: ignore[arg-type]
        group_act_bytes=tuple(group_act_bytes[g] for g in groups),
        layers=tuple(sorted({t.layer for t in tiles})),
        capacity_bytes=target.usable_sram_bytes_per_chiplet,
        batch_tokens=batch_tokens,
    )


def tree_ps(chiplets: set[int], target: Target, edge: tuple[int, int, int]) -> int:
    """Cost of sending one activation to every chiplet in `chiplets` along the hierarchy."""
    if not chiplets:
        return 0
    packages = {target.package_of(c) for c in chiplets}
    cards = {target.card_of(c) for c in chiplets}
    return (len(chiplets) - len(packages)) * edge[0] + (len(packages) - len(cards)) * edge[1] + (len(cards) - 1) * edge[2]


@dataclass(frozen=True)
class LayerCost:
    layer: int
    compute_ps: int
    stream_ps: int
    cut_ps: int

    @property
    def total_ps(self) -> int:
        return self.compute_ps + self.stream_ps + self.cut_ps


def layer_costs(problem: Problem, where: Sequence[int], tiles: Sequence[int] | None = None) -> list[LayerCost]:
    """Per-layer costs of an assignment (over `tiles`, default all), sorted by layer."""
    target = problem.target
    num_c = problem.num_chiplets
    indices = range(len(problem.tiles)) if tiles is None else tiles
    load: dict[int, dict[int, int]] = {}  # group -> chiplet -> ps
    stream: dict[int, dict[int, int]] = {}  # layer -> card -> ps
    used: dict[int, set[int]] = {}  # group -> chiplets
    layer_groups: dict[int, set[int]] = {}
    for t in indices:
        layer = problem.tiles[t].layer
        g = problem.group_of[t]
        layer_groups.setdefault(layer, set()).add(g)
        w = where[t]
        if w < num_c:
            per = load.setdefault(g, {})
            per[w] = per.get(w, 0) + problem.work_ps[t]
            used.setdefault(g, set()).add(w)
        else:
            per = stream.setdefault(layer, {})
            per[w - num_c] = per.get(w - num_c, 0) + problem.stream_ps[t]
    out = []
    for layer in sorted(layer_groups):
        groups = layer_groups[layer]
        compute = sum(max(load[g].values()) for g in groups if g in load)
        cut = sum(tree_ps(used[g], target, problem.edge_ps[g]) for g in groups if g in used)
        out.append(LayerCost(layer, compute, max(stream.get(layer, {0: 0}).values()), cut))
    return out


def total_cost(problem: Problem, where: Sequence[int], tiles: Sequence[int] | None = None) -> int:
    return sum(c.total_ps for c in layer_costs(problem, where, tiles))
