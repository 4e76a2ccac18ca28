"""Greedy placement of one layer: the CP-SAT hint and the fallback.

For each spread the hierarchy offers (one chiplet, one package, one card, 2, 4, ... cards),
take the aligned block of chiplets with the most free SRAM and place the layer's tiles in
decreasing work order on the least-loaded chiplet of the block that still has room; a tile
that fits nowhere is streamed from the card streaming least so far. Keep the spread with the
lowest cost, streaming everything included. Narrow spreads save activation transfers, wide ones balance compute and hold
more: which wins depends on the layer and the target, so all are tried.
"""

from __future__ import annotations

from collections.abc import Sequence

from aviatorc.partition.problem import Problem, total_cost


def spreads(problem: Problem) -> list[int]:
    """Block sizes aligned to the hierarchy, smallest first."""
    target = problem.target
    sizes = [1, target.chiplets_per_package, target.chiplets_per_card]
    cards = 2
    while cards < target.cards:
        sizes.append(cards * target.chiplets_per_card)
        cards *= 2
    sizes.append(target.num_chiplets)
    return sorted({s for s in sizes if s <= target.num_chiplets})


def greedy_layer(problem: Problem, tiles: Sequence[int], free_bytes: Sequence[int]) -> list[int]:
    """A complete assignment of `tiles` (entries for other tiles are -1) within `free_bytes`."""
    best: list[int] | None = None
    best_cost = 0
    # An empty block streams everything: better than scattering tiles over SRAM fragments
    # when their transfers and compute would cost more than the streaming they save.
    for size in [0, *spreads(problem)]:
        block = _best_block(free_bytes, size) if size else range(0)
        where = _place_in_block(problem, tiles, free_bytes, block)
        cost = total_cost(problem, where, tiles)
        if best is None or cost < best_cost:
            best, best_cost = where, cost
    assert best is not None
    return best


def _best_block(free_bytes: Sequence[int], size: int) -> range:
    """The aligned block of `size` chiplets with the most free bytes (the first on a tie)."""
    blocks = [range(start, start + size) for start in range(0, len(free_bytes), size)]
    return max(blocks, key=lambda b: (sum(free_bytes[c] for c in b), -b.start))


def _place_in_block(problem: Problem, tiles: Sequence[int], free_bytes: Sequence[int], block: range) -> list[int]:
    num_c = problem.num_chiplets
    where = [-1] * len(problem.tiles)
    free = list(free_bytes)
    load = {c: 0 for c in block}
    stream = [0] * problem.num_cards
    # Largest work first (LPT); ties by index, so the result is a function of the input only.
    for t in sorted(tiles, key=lambda t: (-problem.work_ps[t], t)):
        nbytes = problem.tile_bytes[t]
        room = [c for c in block if free[c] >= nbytes]
        if room:
            c = min(room, key=lambda c: (load[c], c))
            where[t] = c
            free[c] -= nbytes
            load[c] += problem.work_ps[t]
        else:
            h = min(range(problem.num_cards), key=lambda h: (stream[h], h))
            where[t] = num_c + h
            stream[h] += problem.stream_ps[t]
    return where
