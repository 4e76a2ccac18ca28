"""Layer by layer, with templates: how the partitioner scales to 70B-parameter models.

A monolithic CP-SAT model of every tile on every chiplet does not scale (measured:
presolve alone ate the budget at 0.4M booleans). Instead layers are placed one at a time,
each given the SRAM the layers before it left free:

1. Order: layers that save the most streaming per resident byte go first (linear layers
   all save one byte per byte; an embedding only the rows a token looks up, so it goes last
   and is the first to be streamed), then by layer index.
2. Templates: layers with the same signature (roles, shapes, formats, in order) reuse the
   last placement solved for that signature while it still fits; a 70B model with 80
   identical blocks is solved a handful of times (where SRAM runs out, and once streamed).
3. Each solve: the greedy layer placement, then CP-SAT hinted with it; the better is kept,
   so a layer is never worse than its greedy placement.
4. Budget: at most `max_solves` CP-SAT solves, the first ones in placement order; later
   layers keep their greedy placement. A count, not a clock, so the result depends on the
   input only. `wall_limit_s` is a safety net: past it no further solve starts and the
   result carries a warning saying so (the only way timing can change a placement).

The pure greedy run (same order, same templates, no CP-SAT) is the baseline the result is
compared with, and the final answer is never worse than it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from aviatorc.partition.greedy import greedy_layer
from aviatorc.partition.placement import LayerSolve
from aviatorc.partition.problem import Problem, layer_costs, total_cost

Solver = Callable[[Problem, list[int], list[int], list[int]], tuple[list[int] | None, str]]


@dataclass(frozen=True)
class Decomposed:
    where: list[int]
    cost_ps: int
    solves: list[LayerSolve]
    statuses: list[str]  # CP-SAT statuses of the solves that ran
    warnings: list[str]  # a wall-clock safety net fired: this result depended on timing


def layer_units(problem: Problem) -> list[list[int]]:
    """Tile indices per layer, in placement order."""
    by_layer: dict[int, list[int]] = {}
    for t, tile in enumerate(problem.tiles):
        by_layer.setdefault(tile.layer, []).append(t)

    def density(tiles: list[int]) -> float:
        return sum(problem.read_bytes[t] for t in tiles) / max(1, sum(problem.tile_bytes[t] for t in tiles))

    # Among equally dense layers, a low-discrepancy order (the golden-ratio sequence) rather than
    # layer order: when SRAM runs out part-way, the resident layers are spread evenly through the
    # model instead of bunched at its start, so a decode step never runs a long stretch of resident
    # layers while the LPDDR channels idle (their compute hides behind the next streamed layer's
    # prefetch). The placement's cost is about the same (more hand-offs between cards), the
    # schedule's time is not.
    # Where a tier of equally dense layers fits in the SRAM the denser tiers leave, none of it
    # streams and the spread buys nothing, while layer order keeps consecutive layers on the
    # same chiplets: the hand-off between layers on different cards is charged (problem.py),
    # and the golden-ratio order put nearly every pair of consecutive layers on different cards
    # (8B INT8 on 4 cards: 28 crossings instead of 3; only the embedding streams there).
    tiers: dict[float, int] = {}
    for tiles in by_layer.values():
        key = density(tiles)
        tiers[key] = tiers.get(key, 0) + sum(problem.tile_bytes[t] for t in tiles)
    room = sum(problem.capacity_bytes)
    spread_tiers = set()
    for key in sorted(tiers, reverse=True):
        if tiers[key] > room:
            spread_tiers.add(key)
        room -= tiers[key]

    def spread(layer: int) -> float:
        if density(by_layer[layer]) not in spread_tiers:
            return 0.0
        return (layer * 0.6180339887498949) % 1.0

    return [by_layer[layer] for layer in sorted(by_layer, key=lambda layer: (-density(by_layer[layer]), spread(layer),
                                                                              layer))]


def signature(problem: Problem, tiles: list[int]) -> tuple:
    """What makes two layers' placements interchangeable: their tiles in order and, since a template
    is reused on the same chiplets, their groups' homes (a layer reusing the placement of one whose
    home is on another card would pay trips to its own home every step)."""
    groups: dict[int, int] = {}
    parts = []
    for t in tiles:
        tile = problem.tiles[t]
        group = problem.group_of[t]
        g = groups.setdefault(group, len(groups))
        parts.append((tile.role, tile.k, tile.n, tile.format.name, g, problem.edge_ps[group], problem.home_of(group),
                      problem.read_bytes[t], problem.work_ps[t], t in problem.cold))  # so do hot and cold experts
    return tuple(parts)


def place_layers(problem: Problem, solver: Solver | None, *, max_solves: int | None = None,
                 wall_limit_s: float | None = None, anchored: bool = True) -> Decomposed:
    """Place every layer in order; `solver` improves on greedy, None gives the pure greedy run.

    `anchored`: each greedy layer sees the layers placed before it (hand-offs to them count,
    and it may sit beside them). Staying beside the previous layer is not always better in the
    end: it can leave a later layer split over two cards, so the partitioner also runs the pure
    greedy unanchored and keeps the better.

    At most `max_solves` layers (None: all) go to the solver. `wall_limit_s` is a safety net
    only: once that much wall time has passed no further solve starts, and a warning says so.
    """
    start = time.monotonic()  # through the module, so a test can make the clock jump
    num_c = problem.num_chiplets
    free = list(problem.capacity_bytes)
    where = [-1] * len(problem.tiles)
    templates: dict[tuple, list[int]] = {}  # signature -> relative placement (one entry per tile)
    solves: list[LayerSolve] = []
    statuses: list[str] = []
    warnings: list[str] = []
    for tiles in layer_units(problem):
        layer = problem.tiles[tiles[0]].layer
        sig = signature(problem, tiles)
        relative = templates.get(sig)
        if relative is not None and _fits(problem, tiles, relative, free):
            chosen = {t: r for t, r in zip(tiles, relative, strict=False)}
            cost = total_cost(problem, _as_where(problem, chosen), tiles)
            solves.append(LayerSolve(layer, "template", cost, cost))
        else:
            hint = greedy_layer(problem, tiles, free, where if anchored else None)
            greedy_cost = total_cost(problem, hint, tiles)
            chosen = {t: hint[t] for t in tiles}
            cost, method = greedy_cost, "greedy"
            wanted = (solver is not None and (max_solves is None or len(statuses) < max_solves)
                      and not _surely_optimal(problem, tiles, hint, greedy_cost, free))
            if wanted and wall_limit_s is not None and not warnings and time.monotonic() - start > wall_limit_s:
                warnings.append(f"wall-clock safety net ({wall_limit_s:.0f} s) reached at layer {layer}: "
                                "later layers kept their greedy placement, so this result depends on timing")
            if wanted and not warnings:
                assert solver is not None
                found, status = solver(problem, tiles, free, hint)
                if status != "skipped":  # a model too large to be worth solving costs no budget
                    statuses.append(status)
                if found is not None:
                    found_cost = total_cost(problem, found, tiles)
                    if found_cost < greedy_cost:
                        chosen = {t: found[t] for t in tiles}
                        cost, method = found_cost, f"cpsat-{status}"
            solves.append(LayerSolve(layer, method, cost, greedy_cost))
            templates[sig] = [chosen[t] for t in tiles]
        for t in tiles:
            where[t] = chosen[t]
            if chosen[t] < num_c:
                free[chosen[t]] -= problem.tile_bytes[t]
    return Decomposed(where, total_cost(problem, where), solves, statuses, warnings)


def _as_where(problem: Problem, chosen: dict[int, int]) -> list[int]:
    where = [-1] * len(problem.tiles)
    for t, w in chosen.items():
        where[t] = w
    return where


def _fits(problem: Problem, tiles: list[int], relative: list[int], free: list[int]) -> bool:
    need = [0] * problem.num_chiplets
    for t, w in zip(tiles, relative, strict=False):
        if w < problem.num_chiplets:
            need[w] += problem.tile_bytes[t]
    return all(n <= f for n, f in zip(need, free, strict=False))


def _surely_optimal(problem: Problem, tiles: list[int], hint: list[int], cost: int, free: list[int]) -> bool:
    """Skip the solver where nothing can beat the greedy layer: everything must stream (no chiplet
    has room for any tile) and the streams are already as even as the largest tile allows (the
    solver does not choose compute chiplets, so streaming balance is all it could improve)."""
    smallest = min(problem.tile_bytes[t] for t in tiles)
    if any(f >= smallest for f in free):
        return False
    total = sum(problem.stream_ps[t] for t in tiles)
    floor = max(-(-total // len(problem.stream_channels)), max(problem.stream_ps[t] for t in tiles))
    return sum(c.stream_ps for c in layer_costs(problem, hint, tiles)) <= floor
