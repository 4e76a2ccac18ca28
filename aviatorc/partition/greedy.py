"""Greedy placement of one layer: the CP-SAT hint and the fallback.

For each spread the hierarchy offers (one chiplet, one package, one card, 2, 4, ... cards),
take the aligned block of chiplets with the most free SRAM and place the layer's tiles in
decreasing work order on the least-loaded chiplet of the block that still has room; a tile
that fits nowhere is streamed from the card streaming least so far. Keep the spread with the
lowest cost, streaming everything included. Narrow spreads save activation transfers, wide ones balance compute and hold
more: which wins depends on the layer and the target, so all are tried.

The same is also done group by group (largest work first, each group on its own best spread
and block given what the groups before it took), since groups run one after another and each
is balanced on its own: on Llama-3-8B the q/k/v and down projections want a package while gate
and up want a card. The cheaper of the two layer placements is kept.
"""

from __future__ import annotations

from collections.abc import Sequence

from aviatorc.partition.problem import Problem, total_cost, tree_ps


def spreads(problem: Problem) -> list[int]:
    """Block sizes aligned to the hierarchy, smallest first."""
    target = problem.target
    sizes = [1, target.chiplets_per_package, target.chiplets_per_card]
    cards = 2
    while cards < target.cards:
        sizes.append(cards * target.chiplets_per_card)
        cards *= 2
    sizes.append(target.num_chiplets)
    # Aligned blocks must tile the machine: 3 cards get blocks of 1 card and of all 3, not of 2.
    return sorted({s for s in sizes if s <= target.num_chiplets and target.num_chiplets % s == 0})


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
    by_group = _place_by_group(problem, tiles, free_bytes)
    if total_cost(problem, by_group, tiles) < best_cost:
        return by_group
    return best


def _place_by_group(problem: Problem, tiles: Sequence[int], free_bytes: Sequence[int]) -> list[int]:
    """Each group on its own cheapest spread, largest group first."""
    members: dict[int, list[int]] = {}
    for t in tiles:
        members.setdefault(problem.group_of[t], []).append(t)
    order = sorted(members, key=lambda g: (-sum(problem.work_ps[t] for t in members[g]), g))
    where = [-1] * len(problem.tiles)
    free = list(free_bytes)
    stream = [0] * problem.num_cards
    sizes = [0, *spreads(problem)]
    for g in order:
        best: tuple[int, list[int], list[int], list[int]] | None = None
        for size in sizes:
            block = _best_block(free, size) if size else range(0)
            trial_where, trial_free, trial_stream = list(where), list(free), list(stream)
            _fill(problem, members[g], trial_where, trial_free, trial_stream, block)
            cost = _group_cost(problem, members[g], trial_where, g) + max(trial_stream)
            if best is None or cost < best[0]:
                best = (cost, trial_where, trial_free, trial_stream)
        assert best is not None
        _, where, free, stream = best
    return where


def _group_cost(problem: Problem, members: Sequence[int], where: Sequence[int], g: int) -> int:
    load: dict[int, int] = {}
    for t in members:
        if where[t] < problem.num_chiplets:
            load[where[t]] = load.get(where[t], 0) + problem.work_ps[t]
    return max(load.values(), default=0) + tree_ps(set(load), problem.target, problem.edge_ps[g])


def _best_block(free_bytes: Sequence[int], size: int) -> range:
    """The aligned block of `size` chiplets with the most free bytes (the first on a tie)."""
    blocks = [range(start, start + size) for start in range(0, len(free_bytes), size)]
    return max(blocks, key=lambda b: (sum(free_bytes[c] for c in b), -b.start))


def _place_in_block(problem: Problem, tiles: Sequence[int], free_bytes: Sequence[int], block: range) -> list[int]:
    where = [-1] * len(problem.tiles)
    _fill(problem, tiles, where, list(free_bytes), [0] * problem.num_cards, block)
    return where


def _fill(problem: Problem, tiles: Sequence[int], where: list[int], free: list[int], stream: list[int],
          block: range) -> None:
    """Place `tiles` in `block` (updating `where`, `free` and `stream` in place)."""
    num_c = problem.num_chiplets
    load = {c: 0 for c in block}
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
