"""A lower bound on the placement cost, computed for this problem (CP-SAT's own is 0 or a plain
average here). Two relaxations, both valid for every placement; the bound is the larger:

1. Capacity knapsack. Per group, max_c load >= resident work / C; per layer max_h stream >= streamed
   time / H; cuts >= 0. Minimizing that sum subject to the total usable SRAM is a fractional
   knapsack (resident costs work/C, streamed costs stream/H): the streaming regime's bound.

2. Structure per group, capacities dropped. When streaming any tile costs at least its work
   (stream/H >= work, true unless LPDDR is faster than a chiplet's SRAM), a relaxed optimum
   streams nothing (a streamed tile moved onto a chiplet its group already uses adds at most
   its work and removes at least as much stream time), so each group costs at least
       min over k of  max(work_g / k, largest tile, t_k + t_(k+1)) + tree(k)
   where k is the number of chiplets holding the group, t_i its i-th largest tile (with more
   tiles than chiplets two of the k + 1 largest share one), and tree(k) the cheapest tree over
   k chiplets: packed into the fewest packages and cards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from aviatorc.partition.problem import Problem


@dataclass(frozen=True)
class Bound:
    knapsack_ps: float
    structure_ps: float  # 0 when the relaxation's premise does not hold
    min_streamed_bytes: int  # bytes a placement must stream per step, at least

    @property
    def value_ps(self) -> float:
        return max(self.knapsack_ps, self.structure_ps)


def lower_bound(problem: Problem) -> Bound:
    knapsack, streamed = _knapsack(problem)
    return Bound(knapsack, _structure(problem), streamed)


def _knapsack(problem: Problem) -> tuple[float, int]:
    num_c, num_h = problem.num_chiplets, problem.num_cards
    capacity = problem.capacity_bytes * num_c
    base = 0.0  # everything streamed
    items = []
    for t in range(len(problem.tiles)):
        stream_cost = problem.stream_ps[t] / num_h
        base += stream_cost
        gain = stream_cost - problem.work_ps[t] / num_c  # saved by keeping it resident
        if gain > 0:
            items.append((gain / problem.tile_bytes[t], problem.tile_bytes[t], gain, problem.read_bytes[t]))
    items.sort(reverse=True)
    cost = base
    streamed = float(sum(problem.read_bytes))
    for _density, nbytes, gain, read in items:
        share = min(1.0, capacity / nbytes) if nbytes else 1.0
        if share <= 0:
            break
        cost -= gain * share
        streamed -= read * share
        capacity -= nbytes * share
    # Not-worth-keeping tiles (gain <= 0) are streamed here; the bound stays valid for placements
    # that keep them, since each such tile costs at least as much resident.
    return cost, max(0, math.ceil(streamed - 1e-6))


def tree_min_ps(k: int, problem: Problem, edge: tuple[int, int, int]) -> int:
    target = problem.target
    if k <= 1:
        return 0
    packages = math.ceil(k / target.chiplets_per_package)
    cards = math.ceil(k / target.chiplets_per_card)
    return (k - packages) * edge[0] + (packages - cards) * edge[1] + (cards - 1) * edge[2]


def _structure(problem: Problem) -> float:
    num_h = problem.num_cards
    if any(problem.stream_ps[t] / num_h < problem.work_ps[t] for t in range(len(problem.tiles))):
        return 0.0
    by_layer: dict[int, list[int]] = {}
    for t, tile in enumerate(problem.tiles):
        by_layer.setdefault(tile.layer, []).append(t)
    return float(sum(layer_structure_bound(problem, tiles) for tiles in by_layer.values()))


def layer_structure_bound(problem: Problem, tiles: list[int]) -> float:
    """Sum over the layer's groups of min over k chiplets of max(work/k, largest tile, pigeonhole) + tree(k)."""
    num_c = problem.num_chiplets
    by_group: dict[int, list[int]] = {}
    for t in tiles:
        by_group.setdefault(problem.group_of[t], []).append(problem.work_ps[t])
    total = 0.0
    for g, works in by_group.items():
        works.sort(reverse=True)
        whole = sum(works)
        best = math.inf
        for k in range(1, min(num_c, len(works)) + 1):
            load = max(whole / k, works[0])
            if len(works) > k:  # two of the k + 1 largest share a chiplet
                load = max(load, works[k - 1] + works[k])
            best = min(best, load + tree_min_ps(k, problem, problem.edge_ps[g]))
        total += best
    return total
