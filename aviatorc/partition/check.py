"""A checker for placements that shares no code with the solver or the cost model.

From the weight specs and the target alone it re-derives: the tiles cover each weight
exactly and follow the matrix units; each tile's bytes are `storage_bytes` of its own
[k, n]; every tile is resident on one chiplet or streamed from one card; no chiplet holds
more than its usable SRAM; and the objective, recomputed here from first principles, is
the one reported. A failure is a bug in aviatorc, not a user error: it raises
`PlacementCheckError` with what broke.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from aviatorc.partition.tiling import WeightSpec
from aviatorc.target import Target


class PlacementCheckError(RuntimeError):
    """A placement breaks an invariant (an internal error, reported with the tile at fault)."""


def check_placement(placement: Any, weights: list[WeightSpec], target: Target, *, batch_tokens: int = 1) -> None:
    specs = {w.name: w for w in weights}
    tiles = placement.tiles
    where = placement.where
    num_c = target.num_chiplets
    if len(where) != len(tiles):
        raise PlacementCheckError(f"{len(tiles)} tiles but {len(where)} assignments")
    if set(specs) != {t.weight for t in tiles}:
        missing = sorted(set(specs) - {t.weight for t in tiles})
        raise PlacementCheckError(f"weights without tiles: {missing[:5]}")

    # Coverage and alignment: each weight's tiles tile its [k, n] exactly, along one dim.
    by_weight: dict[str, list[Any]] = defaultdict(list)
    for tile in tiles:
        by_weight[tile.weight].append(tile)
    for name, pieces in by_weight.items():
        spec = specs[name]
        along_k = spec.is_embedding
        unit = target.matrix_unit_k if along_k else target.matrix_unit_n
        full = spec.k if along_k else spec.n
        spans = sorted((t.k_start, t.k_stop) if along_k else (t.n_start, t.n_stop) for t in pieces)
        others = {(t.n_start, t.n_stop) if along_k else (t.k_start, t.k_stop) for t in pieces}
        if others != {(0, spec.n if along_k else spec.k)}:
            raise PlacementCheckError(f"weight '{name}': tiles do not span the whole other dim: {sorted(others)}")
        position = 0
        for start, stop in spans:
            if start != position or stop <= start:
                raise PlacementCheckError(f"weight '{name}': tiles leave a gap or overlap at {position}")
            if start % unit or (stop % unit and stop != full):
                raise PlacementCheckError(f"weight '{name}': tile [{start}, {stop}) is not aligned to the {unit}-wide matrix unit")
            position = stop
        if position != full:
            raise PlacementCheckError(f"weight '{name}': tiles cover {position} of {full}")

    # Assignment and capacity.
    held = [0] * num_c
    for index, (tile, w) in enumerate(zip(tiles, where, strict=False)):
        if not 0 <= w < num_c + target.cards:
            raise PlacementCheckError(f"tile {index} of '{tile.weight}' has no valid location ({w})")
        nbytes = specs[tile.weight].format.storage_bytes(tile.k_stop - tile.k_start, tile.n_stop - tile.n_start)
        if w < num_c:
            held[w] += nbytes
    capacity = int(target.chiplet.sram_bytes * (1.0 - target.activation_reserve_fraction))
    for c, nbytes in enumerate(held):
        if nbytes > capacity:
            raise PlacementCheckError(f"chiplet {c} holds {nbytes} bytes, over its usable {capacity}")
    if list(placement.chiplet_bytes) != held:
        raise PlacementCheckError("reported per-chiplet bytes differ from the recount")

    # Objective from first principles.
    expected = _objective(placement, specs, target, batch_tokens)
    if expected != placement.objective_ps:
        raise PlacementCheckError(f"reported objective {placement.objective_ps} ps, recomputed {expected} ps")


def _objective(placement: Any, specs: dict[str, WeightSpec], target: Target, batch_tokens: int) -> int:
    num_c = target.num_chiplets
    load: dict[tuple[int, str], dict[int, int]] = defaultdict(lambda: defaultdict(int))
    stream: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    holders: dict[tuple[int, str], set[int]] = defaultdict(set)
    act: dict[tuple[int, str], int] = {}
    for tile, w in zip(placement.tiles, placement.where, strict=False):
        spec = specs[tile.weight]
        k, n = tile.k_stop - tile.k_start, tile.n_stop - tile.n_start
        nbytes = spec.format.storage_bytes(k, n)
        if spec.is_embedding:
            read = min(nbytes, -(-nbytes * batch_tokens // spec.k))  # a token reads one of spec.k rows
            flops, a = 0.0, n * target.activation_bytes_per_element * batch_tokens
        else:
            read, flops, a = nbytes, 2.0 * k * n * batch_tokens, k * target.activation_bytes_per_element * batch_tokens
        peak = target.flops_per_s(spec.format.kind)
        work = max(1, round(max(flops / peak, read / target.chiplet.sram_bytes_per_s) * 1e12))
        key = (tile.layer, tile.group)
        act[key] = max(act.get(key, 0), a)
        if w < num_c:
            load[key][w] += work
            holders[key].add(w)
        else:
            stream[tile.layer][w - num_c] += max(1, round(read / target.lpddr_bytes_per_s_per_card * 1e12))
    total = 0
    for layer in {t.layer for t in placement.tiles}:
        total += max(stream[layer].values(), default=0)
    for per_chiplet in load.values():  # groups run one after another, each balanced on its own
        total += max(per_chiplet.values())
    for key, chips in holders.items():
        cost = [round((link.latency_s + act[key] / link.bytes_per_s) * 1e12) for link in target.links]
        packages = {c // target.chiplets_per_package for c in chips}
        cards = {c // (target.chiplets_per_package * target.packages_per_card) for c in chips}
        total += (len(chips) - len(packages)) * cost[0] + (len(packages) - len(cards)) * cost[1] + (len(cards) - 1) * cost[2]
    return total
