"""A lower bound on the placement cost, computed for this problem (CP-SAT's own is 0 or a plain
average here). Every tile computes on some chiplet, resident or streamed (`problem.py`), so
the cost splits into two parts bounded apart and added:

1. Compute, broadcast and collection, per group, capacities dropped. A group computed on k
   chiplets costs at least
       max(work_g / k, largest tile, t_k + t_(k+1)) + tree(k) + gather(k)
   where t_i is its i-th largest tile (with more tiles than chiplets two of the k + 1 largest
   share one), tree(k) the cheapest broadcast tree over k chiplets (packed into the fewest
   packages and cards; valid on any subset of chiplets, since outer links are never cheaper)
   and gather(k) the latencies of the same tree's transfers (collecting the outputs takes one
   transfer per tree edge; its bytes are left out), times the chance a step runs the group (an
   expert's, `Problem.fires_of`). The bound takes the minimum over k, up to
   the group's tile count and the allowed chiplets. Hand-offs between groups cost >= 0.

2. Streaming, per layer max_h stream(h) >= (streamed time) / H over the H cards that may
   stream. Which tiles stream is bounded by a fractional knapsack: keep resident the tiles
   that save the most stream time per stored byte until the usable SRAM (after the reserve,
   on the allowed chiplets) is full; the rest stream. That is the streaming regime's bound.

The minimum bytes any placement must stream is a separate knapsack (most read per stored byte
kept resident).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from aviatorc.partition.problem import Problem


@dataclass(frozen=True)
class Bound:
    compute_ps: float  # part 1: compute, broadcast and collection latency, per group
    stream_ps: float  # part 2: the streaming knapsack
    min_streamed_bytes: int  # bytes a placement must stream per step, at least

    @property
    def value_ps(self) -> float:
        # Rounded down with a relative margin so float error never lifts the bound above an
        # integer objective.
        return math.floor((self.compute_ps + self.stream_ps) * (1 - 1e-12))


def lower_bound(problem: Problem) -> Bound:
    return Bound(_structure(problem), _stream_knapsack(problem), _min_streamed_bytes(problem))


def _stream_knapsack(problem: Problem) -> float:
    capacity = float(sum(problem.capacity_bytes))
    num_h = len(problem.stream_channels)
    cost = sum(problem.stream_ps) / num_h  # everything streamed
    items = sorted(((problem.stream_ps[t] / num_h / problem.tile_bytes[t], t) for t in range(len(problem.tiles))),
                   reverse=True)
    for _density, t in items:
        if capacity <= 0:
            break
        share = min(1.0, capacity / problem.tile_bytes[t])
        cost -= problem.stream_ps[t] / num_h * share
        capacity -= problem.tile_bytes[t] * share
    return max(0.0, cost)


def _min_streamed_bytes(problem: Problem) -> int:
    """Read bytes per step no placement avoids: keep the most read per stored byte resident,
    fractionally, until the usable SRAM is full; the rest is read from LPDDR."""
    capacity = float(sum(problem.capacity_bytes))
    streamed = float(sum(problem.read_bytes))
    order = sorted(range(len(problem.tiles)), key=lambda t: -problem.read_bytes[t] / max(1, problem.tile_bytes[t]))
    for t in order:
        if capacity <= 0:
            break
        share = min(1.0, capacity / problem.tile_bytes[t]) if problem.tile_bytes[t] else 1.0
        streamed -= problem.read_bytes[t] * share
        capacity -= problem.tile_bytes[t] * share
    return max(0, math.ceil(streamed - 1e-6))


def _packed(k: int, problem: Problem) -> tuple[int, int, int]:
    """(die-to-die, package-to-package, card-to-card) edges of a tree over k packed chiplets."""
    target = problem.target
    packages = math.ceil(k / target.chiplets_per_package)
    cards = math.ceil(k / target.chiplets_per_card)
    return k - packages, packages - cards, cards - 1


def tree_min_ps(k: int, problem: Problem, edge: tuple[int, int, int]) -> int:
    if k <= 1:
        return 0
    d2d, p2p, c2c = _packed(k, problem)
    return d2d * edge[0] + p2p * edge[1] + c2c * edge[2]


def _gather_min_ps(k: int, problem: Problem) -> int:
    if k <= 1:
        return 0
    # round() as the cost model rounds each transfer: rounding is monotone, so this is <= it.
    latency = [round((link.message_s + link.latency_s) * 1e12) for link in problem.target.links]
    d2d, p2p, c2c = _packed(k, problem)
    return d2d * latency[0] + p2p * latency[1] + c2c * latency[2]


def _structure(problem: Problem) -> float:
    by_layer: dict[int, list[int]] = {}
    for t, tile in enumerate(problem.tiles):
        by_layer.setdefault(tile.layer, []).append(t)
    return float(sum(layer_structure_bound(problem, tiles) for tiles in by_layer.values()))


def layer_structure_bound(problem: Problem, tiles: list[int]) -> float:
    """Sum over the layer's groups of min over k chiplets of max(work/k, largest tile, pigeonhole)
    + tree(k) + gather latency(k)."""
    num_c = len(problem.chiplets)
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
            # An expert's collection is charged when it fires (its tree edges already are, in edge_ps);
            # the cost model rounds that to the picosecond, so half of one is given back.
            gather = max(0.0, _gather_min_ps(k, problem) * problem.fires_of(g) - 0.5) if k > 1 else 0.0
            best = min(best, load + tree_min_ps(k, problem, problem.edge_ps[g]) + gather)
        total += best
    return total
