"""A lower bound on the placement cost, computed for this problem (CP-SAT's own is 0 or a plain
average here). Two relaxations, both valid for every placement; the bound is the larger:

1. Capacity knapsack. Per layer max_h stream >= streamed time / H. A group whose resident tiles
   (work w) sit on k chiplets costs at least w/k + tree(k) (busiest chiplet plus the cheapest
   tree over k), so at least phi_g(w) = min_k (w/k + tree(k)): a minimum of lines through the
   origin's neighbourhood, concave with phi_g(0) = 0, hence phi_g(w) >= (w / W_g) phi_g(W_g) for
   w <= W_g (above its chord). Each resident tile t of group g so costs at least
   work_t * phi_g(W_g) / W_g (>= work_t / C), linear per tile; minimizing that plus streamed
   time / H subject to the total usable SRAM is a fractional knapsack: the streaming regime's
   bound, which also charges the resident layers their activation trees.

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
    capacity = float(problem.capacity_bytes * num_c)
    base = 0.0  # everything streamed
    items = []
    rate = _resident_rate(problem)
    for t in range(len(problem.tiles)):
        stream_cost = problem.stream_ps[t] / num_h
        base += stream_cost
        gain = stream_cost - problem.work_ps[t] * rate[problem.group_of[t]]  # saved by keeping it resident
        if gain > 0:
            items.append((gain / problem.tile_bytes[t], problem.tile_bytes[t], gain))
    items.sort(reverse=True)
    cost = base
    for _density, nbytes, gain in items:
        share = min(1.0, capacity / nbytes) if nbytes else 1.0
        if share <= 0:
            break
        cost -= gain * share
        capacity -= nbytes * share
    # Not-worth-keeping tiles (gain <= 0) are streamed here; the bound stays valid for placements
    # that keep them, since each such tile costs at least as much resident. Rounded down with a
    # relative margin so float error never lifts the bound above an integer objective.
    return math.floor(cost * (1 - 1e-12)), _min_streamed_bytes(problem)


def _min_streamed_bytes(problem: Problem) -> int:
    """Read bytes per step no placement avoids: keep the most read per stored byte resident,
    fractionally, until the usable SRAM is full; the rest is read from LPDDR."""
    capacity = float(problem.capacity_bytes * problem.num_chiplets)
    streamed = float(sum(problem.read_bytes))
    order = sorted(range(len(problem.tiles)), key=lambda t: -problem.read_bytes[t] / max(1, problem.tile_bytes[t]))
    for t in order:
        if capacity <= 0:
            break
        share = min(1.0, capacity / problem.tile_bytes[t]) if problem.tile_bytes[t] else 1.0
        streamed -= problem.read_bytes[t] * share
        capacity -= problem.tile_bytes[t] * share
    return max(0, math.ceil(streamed - 1e-6))


def _resident_rate(problem: Problem) -> dict[int, float]:
    """Per group g, phi_g(W_g) / W_g: the least cost per unit of resident work (see the docstring)."""
    work: dict[int, int] = {}
    count: dict[int, int] = {}
    for t, g in enumerate(problem.group_of):
        work[g] = work.get(g, 0) + problem.work_ps[t]
        count[g] = count.get(g, 0) + 1
    rate = {}
    for g, whole in work.items():
        edge = problem.edge_ps[g]
        phi = min(whole / k + tree_min_ps(k, problem, edge) for k in range(1, min(problem.num_chiplets, count[g]) + 1))
        rate[g] = phi / whole
    return rate


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
