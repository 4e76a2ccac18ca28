"""Greedy placement of one layer: the CP-SAT hint and the fallback.

For each spread the hierarchy offers (one chiplet, one package, one card, 2, 4, ... cards),
take the aligned block of chiplets with the most free SRAM and place the layer's tiles in
decreasing work order on the least-loaded chiplet of the block that still has room; a tile
that fits nowhere is streamed from the LPDDR channel streaming least so far (one attached to the
block on a tie, so its compute chiplet is near the others). Keep the spread with the lowest cost,
streaming everything included. Narrow spreads save activation transfers, wide ones balance compute and hold
more: which wins depends on the layer and the target, so all are tried.

The same is also done group by group (largest work first, each group on its own best spread
and block given what the groups before it took), since groups run one after another and each
is balanced on its own: on Llama-3-8B the q/k/v and down projections want a package while gate
and up want a card. The cheaper of the two layer placements is kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from aviatorc.partition.problem import Problem, compute_of, group_cost_ps, next_handoff_ps, total_cost


def spreads(problem: Problem) -> list[int]:
    """Block sizes aligned to the hierarchy, smallest first."""
    target = problem.target
    sizes = [1, target.chiplets_per_package, target.chiplets_per_card]
    # Parts of a package too: collecting a group's outputs costs a transfer per extra chiplet,
    # so small groups can prefer 2 chiplets to a whole package (8B INT4 q/k/v on corsair).
    part = 2
    while part < target.chiplets_per_package:
        sizes.append(part)
        part *= 2
    cards = 2
    while cards < target.cards:
        sizes.append(cards * target.chiplets_per_card)
        cards *= 2
    sizes.append(target.num_chiplets)
    # Aligned blocks must tile the machine: 3 cards get blocks of 1 card and of all 3, not of 2.
    return sorted({s for s in sizes if s <= target.num_chiplets and target.num_chiplets % s == 0})


def greedy_layer(problem: Problem, tiles: Sequence[int], free_bytes: Sequence[int],
                 placed: Sequence[int] | None = None) -> list[int]:
    """A complete assignment of `tiles` (entries for other tiles are -1) within `free_bytes`.

    `placed`: the assignment of the layers placed before (-1 elsewhere). The groups next to this
    layer's (the previous layer's last, the next layer's first) are anchors: hand-offs to them
    count, and blocks beside them are candidates, so consecutive layers stay together. So are the
    blocks beside the layer's home, whose trips are part of every group's cost."""
    anchors = _anchors(problem, tiles, placed)
    homes = _homes(problem, tiles)
    best: list[int] | None = None
    best_cost = 0
    # An empty block streams everything: better than scattering tiles over SRAM fragments
    # when their transfers and compute would cost more than the streaming they save.
    # Streaming everything from one channel keeps the compute chiplets together (an embedding,
    # whose lookups cost next to nothing, should not pay transfers between cards).
    options: list[tuple[range, Sequence[int] | None]] = [(range(0), None), (range(0), problem.stream_channels[:1])]
    for size in spreads(problem):
        options.append((_best_block(free_bytes, size), None))
        for root in sorted(set(anchors.values()) | homes):
            home = (range(root - root % size, root - root % size + size), None)
            if home not in options:
                options.append(home)
    for block, channels in options:
        where = _place_in_block(problem, tiles, free_bytes, block, channels)
        cost = total_cost(problem, where, tiles) + _boundary_ps(problem, where, tiles, anchors)
        if best is None or cost < best_cost:
            best, best_cost = where, cost
    assert best is not None
    by_group = _place_by_group(problem, tiles, free_bytes, anchors)
    if total_cost(problem, by_group, tiles) + _boundary_ps(problem, by_group, tiles, anchors) < best_cost:
        return by_group
    return best


def _homes(problem: Problem, tiles: Sequence[int]) -> set[int]:
    """The homes of the groups of `tiles`."""
    return {problem.home_of(problem.group_of[t]) for t in tiles} - {-1}


def _root(problem: Problem, where: Sequence[int], members: Sequence[int]) -> int:
    """The lowest chiplet computing one of `members` (-1 when none is placed)."""
    return min(compute_of(problem, where, members).values(), default=-1)


def _anchors(problem: Problem, tiles: Sequence[int], placed: Sequence[int] | None) -> dict[int, int]:
    """Placed groups just before and after the groups of `tiles` -> their roots."""
    if placed is None:
        return {}
    mine = {problem.group_of[t] for t in tiles}
    before = {after: g for g, after in enumerate(problem.next_group) if after >= 0}
    outside = {nb for g in mine for nb in (before.get(g, -1), problem.next_group[g]) if nb >= 0 and nb not in mine}
    anchors = {}
    for nb in sorted(outside):
        members = [t for t in range(len(problem.tiles)) if problem.group_of[t] == nb and placed[t] >= 0]
        if members:
            anchors[nb] = _root(problem, placed, members)
    return anchors


def _boundary_ps(problem: Problem, where: Sequence[int], tiles: Sequence[int], anchors: dict[int, int]) -> int:
    """Hand-offs between the groups of `tiles` and their anchors."""
    if not anchors:
        return 0
    members: dict[int, list[int]] = {}
    for t in tiles:
        members.setdefault(problem.group_of[t], []).append(t)
    cost = 0
    for g, group_tiles in members.items():
        root = _root(problem, where, group_tiles)
        after = problem.next_group[g]
        if after in anchors:
            cost += next_handoff_ps(problem, g, root, after, anchors[after])
        for nb, root_nb in anchors.items():
            if problem.next_group[nb] == g:
                cost += next_handoff_ps(problem, nb, root_nb, g, root)
    return cost


def _place_by_group(problem: Problem, tiles: Sequence[int], free_bytes: Sequence[int],
                    anchors: dict[int, int] | None = None) -> list[int]:
    """Each group on its own cheapest spread, largest group first. A group's candidates at each
    spread are the block with the most free SRAM and the blocks holding the roots of the groups
    placed so far; hand-offs to its placed neighbours (the groups before and after it) are part
    of its cost."""
    members: dict[int, list[int]] = {}
    for t in tiles:
        members.setdefault(problem.group_of[t], []).append(t)
    before = {after: g for g, after in enumerate(problem.next_group) if after >= 0}

    def order_key(g: int) -> tuple[int, float, int]:
        """In execution order, each group next to the one before it; experts (side by side between
        their router and their combine) after the rest, the ones a step reads most per byte first."""
        if any(problem.tiles[t].expert < 0 for t in members[g]):
            return (0, 0.0, g)
        return (1, -sum(problem.read_bytes[t] for t in members[g]) / max(1, sum(problem.tile_bytes[t] for t in members[g])), g)

    order = sorted(members, key=order_key)
    where = [-1] * len(problem.tiles)
    free = list(free_bytes)
    stream = [0] * problem.num_channels
    sizes = [0, *spreads(problem)]
    roots: dict[int, int] = dict(anchors or {})  # placed group -> its root (lowest computing chiplet)
    nearest = _Nearest(problem, [*roots.values(), *sorted(_homes(problem, tiles))])
    # An expert's candidate blocks beside others are those beside the layer's anchors and homes
    # (where its input comes from and its output goes): the experts run side by side, so being
    # beside each other buys nothing, and DeepSeek-V3's 768 expert groups a layer would each try
    # blocks beside every chiplet the ones before them took.
    fixed = sorted(nearest.chips)
    for g in order:
        neighbours = [(nb, nb == before.get(g)) for nb in (before.get(g), problem.next_group[g]) if nb in roots]
        best: tuple[tuple[int, int], list[int], list[int], list[int]] | None = None
        beside = fixed if problem.fires_of(g) < 1.0 else sorted(nearest.chips)
        for size in sizes:
            blocks: list[tuple[range, Sequence[int] | None]] = [(_best_block(free, size), None)] if size else [
                (range(0), None)] + [(range(0), [h]) for h in sorted({problem.stream_channels[0]} | {
                    problem.target.channel_of(r) for r in beside} & set(problem.stream_channels))]
            for root in beside if size else ():  # beside the groups placed so far
                home = range(root - root % size, root - root % size + size)
                if (home, None) not in blocks:
                    blocks.append((home, None))
            for block, channels in blocks:
                # A trial writes only this group's entries of `where`: they are read back, then reset.
                trial_free, trial_stream = list(free), list(stream)
                _fill(problem, members[g], where, trial_free, trial_stream, block, channels)
                cost = group_cost_ps(problem, where, members[g]) + max(trial_stream)
                root = _root(problem, where, members[g])
                for nb, is_before in neighbours:
                    cost += (next_handoff_ps(problem, nb, roots[nb], g, root) if is_before
                             else next_handoff_ps(problem, g, root, nb, roots[nb]))
                # On a tie, nearest the groups placed so far (their hand-offs come later).
                near = nearest.distance(root)
                if best is None or (cost, near) < best[0]:
                    best = ((cost, near), [where[t] for t in members[g]], trial_free, trial_stream)
                for t in members[g]:
                    where[t] = -1
        assert best is not None
        _, chosen, free, stream = best
        for t, w in zip(members[g], chosen, strict=True):
            where[t] = w
        roots[g] = _root(problem, where, members[g])
        nearest.add(roots[g])
    return where


class _Nearest:
    """min(_distance(c, r) for r in the roots placed so far), without the loop: the distance to a root
    depends only on how c relates to it (same chiplet, same package, same card, another card), so
    it is the least of the level distances of the relations present (a layer of a mixture of
    experts places a thousand groups, each trial asking against all of them)."""

    def __init__(self, problem: Problem, roots: Iterable[int]) -> None:
        self.target = problem.target
        links = self.target.links
        self.by_level = [1 + links.index(links[level]) for level in range(3)]  # as `_distance` counts
        self.chips: set[int] = set()
        self.packages: set[int] = set()
        self.card_packages: dict[int, set[int]] = {}  # card -> the packages holding a root on it
        for root in roots:
            self.add(root)

    def add(self, root: int) -> None:
        self.chips.add(root)
        self.packages.add(self.target.package_of(root))
        self.card_packages.setdefault(self.target.card_of(root), set()).add(self.target.package_of(root))

    def distance(self, c: int) -> int:
        if not self.chips or c in self.chips:
            return 0
        package, card = self.target.package_of(c), self.target.card_of(c)
        levels = []
        if package in self.packages:
            levels.append(self.by_level[0])
        if self.card_packages.get(card, set()) - {package}:
            levels.append(self.by_level[1])
        if any(other != card for other in self.card_packages):
            levels.append(self.by_level[2])
        return min(levels)


def _distance(problem: Problem, a: int, b: int) -> int:
    """0 for the same chiplet, else 1 + the link level between them."""
    link = problem.target.link_between(a, b)
    return 0 if link is None else 1 + problem.target.links.index(link)


def _best_block(free_bytes: Sequence[int], size: int) -> range:
    """The aligned block of `size` chiplets with the most free bytes (the first on a tie); chiplets
    outside the placement's subset have none, so a block of them is never the best while another has room."""
    blocks = [range(start, start + size) for start in range(0, len(free_bytes), size)]
    return max(blocks, key=lambda b: (sum(free_bytes[c] for c in b), -b.start))


def _place_in_block(problem: Problem, tiles: Sequence[int], free_bytes: Sequence[int], block: range,
                    channels: Sequence[int] | None = None) -> list[int]:
    where = [-1] * len(problem.tiles)
    _fill(problem, tiles, where, list(free_bytes), [0] * problem.num_channels, block, channels)
    return where


def _given_it_fires(problem: Problem, t: int, where: Sequence[int], stream: Sequence[int]) -> Sequence[float]:
    """Each channel's expected streaming, with co-activation known (`Problem.cofiring`) plus what
    the experts of tile t's layer that fire with it more often than apart add in the steps that
    run it. (Experts that fire with it less often are not counted as lighter: that would pile a
    step's others onto a few channels, balanced only for one token.)"""
    cofiring = problem.cofiring(t)
    if not cofiring:
        return stream
    num_c, layer = problem.num_chiplets, problem.tiles[t].layer
    load = [float(v) for v in stream]
    for other in problem.expert_tiles_of(layer):
        tile = problem.tiles[other]
        if where[other] >= num_c and cofiring.get(tile.expert, 0.0) > 0:
            raw = problem.stream_ps[other] / problem.fires_of(problem.group_of[other])
            load[where[other] - num_c] += cofiring[tile.expert] * raw
    return load


def _fill(problem: Problem, tiles: Sequence[int], where: list[int], free: list[int], stream: list[int],
          block: range, channels: Sequence[int] | None = None) -> None:
    """Place `tiles` in `block` (updating `where`, `free` and `stream` in place); what does not
    fit streams from `channels` (default: every channel that may stream), the least loaded first."""
    num_c = problem.num_chiplets
    load = {c: 0 for c in block}
    # An expert's tiles each on a channel of their own where one is left: when it fires, they load
    # side by side (`fired_stream_ps`), where the least-loaded channel alone would stack them.
    spread: dict[tuple[int, int], set[int]] = {}  # (layer, expert) -> the channels streaming its tiles so far
    # Largest work first (LPT); ties by index, so the result is a function of the input only.
    for t in sorted(tiles, key=lambda t: (-problem.work_ps[t], t)):
        nbytes = problem.tile_bytes[t]
        room = [c for c in block if free[c] >= nbytes] if t not in problem.cold else []
        if not room and problem.cold and problem.tiles[t].expert >= 0 and t not in problem.cold:
            # The routing's knapsack keeps this expert resident (`cold_experts`): outside the block
            # if need be, on the chiplet with the most room, rather than streamed.
            room = [max((c for c in problem.chiplets if free[c] >= nbytes), key=lambda c: (free[c], -c), default=-1)]
            room = [c for c in room if c >= 0]
            for c in room:
                load.setdefault(c, 0)
        if room:
            c = min(room, key=lambda c: (load[c], c))
            where[t] = c
            free[c] -= nbytes
            load[c] += problem.work_ps[t]
        else:
            near = {problem.target.channel_of(c) for c in block}
            tile = problem.tiles[t]
            taken = spread.setdefault((tile.layer, tile.expert), set()) \
                if problem.fires_of(problem.group_of[t]) < 1.0 else set()
            load_of = _given_it_fires(problem, t, where, stream)
            h = min(channels or problem.stream_channels, key=lambda h: (h in taken, load_of[h], h not in near, h))
            where[t] = num_c + h
            stream[h] += problem.stream_ps[t]
            taken.add(h)
