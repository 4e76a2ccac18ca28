"""The placement problem as data, and the one cost model every part agrees on.

Each tile is either resident on one chiplet or streamed per token from one LPDDR channel.
An assignment is a tuple `where` with one entry per tile: `0 <= where[t] < C` is a chiplet,
`C + h` means streamed from channel h (`Target.channel_of`: on `corsair` each chiplet has its
own). Every tile also computes somewhere: a resident tile on its own chiplet, a streamed one on
a *compute chiplet* the channel attaches to, which receives its bytes from LPDDR into a staging
buffer (crossing no link) and multiplies with them there.
`compute_chiplets(problem, where)` chooses those deterministically (below), so the cost is a
function of `where` alone. Costs are integer picoseconds per decode step:

    cost = sum over layers of  sum over groups g of max_c load(c, g)   compute: the busiest chiplet
                             + max_h stream(h)                          LPDDR: the busiest channel streams
                             + sum over groups g of cut(g)              activation sent to g's chiplets
                             + sum over groups g of collect(g)          g's outputs gathered and handed on

- a group is the weights reading one activation (q, k, v; o; gate, up; down): groups run one
  after another (each needs the one before), so each is balanced on its own; their order is
  the order of the weights (layer by layer, graph order inside a layer);
- load(c, g): g's tiles computing on c, resident or streamed, each max(FLOPs / peak of its
  format, bytes / SRAM bandwidth) (a streamed tile is read from its staging buffer);
- stream(h): per-token bytes read from channel h / its bandwidth (a linear tile is read
  whole every step; an embedding row range only when a token falls in it; a tied head's tile
  both ways: whole for the head, a row per token for the lookup);
- cut(g): the activation a group reads goes along a tree over the hierarchy to every chiplet
  computing one of the group's tiles: each extra chiplet in a package costs one die-to-die
  transfer, each extra package on a card one package-to-package transfer, each extra card
  one card-to-card transfer (latency + bytes / bandwidth);
- collect(g): each chiplet computing g's tiles holds an output slice (batch_tokens rows x the
  columns it computed x activation bytes; an embedding tile the expected share of the looked-up
  rows). The slices go back up the same tree to the group's root, its lowest-numbered
  chiplet: each non-head chiplet of a package sends its slice to the package's head (die to
  die), each non-head package its package's slices to the card's head package, each non-root
  card its card's slices to the root card; then the whole output is handed to the next
  group's root (one transfer over the link level between the two roots, none when they are
  the same chiplet). The last group of a layer hands on to the next layer's first group, so
  consecutive layers on different cards pay a card-to-card transfer. A hand-off is charged to
  the layer of the group that sends it, and only when both groups are in the tiles costed.
- home(g): where the layer's attention, norms and other non-weight work run (the chiplet holding
  its KV cache, known before the weights are placed: `memory.py`), when the caller gives one. The
  scheduler sends each group's input from there and collects its output there, so a group with a
  home pays a transfer of its activation from the home to its root and of its output back, and
  its hand-off to the next group leaves from the home (and reaches the next group's home, if it
  has one, else its root). Weights placed away from their layer's home pay for it every step.

Compute chiplets: per group, resident tiles first, then streamed tiles in decreasing work
(ties by index), each onto the allowed chiplet its channel attaches to where it adds least to
the group's cost (the rise of the busiest chiplet's load plus the broadcast edge it adds),
then the least loaded, then the lowest index.

Capacity: chiplet c gives `sram_bytes - reserve_bytes[c]` to resident weights (the reserve
holds activations, the KV cache and staging buffers; by default the target's
`activation_reserve_fraction`). A placement may be confined to `chiplets`: the others hold
nothing and compute nothing, and only channels attached to an allowed chiplet stream.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

from aviatorc.errors import InfeasibleError, OptionError
from aviatorc.partition.tiling import Tile
from aviatorc.routing import Routing
from aviatorc.target import Target

PS = 1e12  # picoseconds per second


@dataclass(frozen=True)
class Problem:
    """Tiles with their costs on one target. Index-aligned tuples keep the solver loops plain."""

    target: Target
    tiles: tuple[Tile, ...]
    tile_bytes: tuple[int, ...]
    work_ps: tuple[int, ...]  # time on the chiplet computing it, per step
    stream_ps: tuple[int, ...]  # time to stream its per-step bytes from one LPDDR channel
    read_bytes: tuple[int, ...]  # bytes it reads from memory per step
    out_bytes: tuple[int, ...]  # bytes of the output slice it produces per step
    groups: tuple[str, ...]  # group names, in execution order
    group_of: tuple[int, ...]  # tile -> group index
    next_group: tuple[int, ...]  # group -> the group after it (-1 for the last)
    edge_ps: tuple[tuple[int, int, int], ...]  # group -> cost of one broadcast transfer at each link level
    group_act_bytes: tuple[int, ...]  # group -> bytes of the activation it reads, per step
    group_out_bytes: tuple[int, ...]  # group -> bytes of its whole output, per step
    layers: tuple[int, ...]  # sorted distinct layer indices
    capacity_bytes: tuple[int, ...]  # per chiplet: SRAM for weights (0 outside `chiplets`)
    reserve_bytes: tuple[int, ...]  # per chiplet: SRAM held back for activations, KV cache, staging
    chiplets: tuple[int, ...]  # the chiplets this placement may use, sorted
    stream_channels: tuple[int, ...]  # the channels that may stream (attached to an allowed chiplet)
    batch_tokens: int
    group_home: tuple[int, ...] = ()  # group -> its layer's home chiplet, -1 for none (empty: no homes given)
    cold: frozenset[int] = frozenset()  # expert tiles the routing leaves out of SRAM (`cold_experts`)
    group_fires: tuple[float, ...] = ()  # group -> the probability a step runs it (empty: always)
    routing: Routing | None = None  # what the expert costs came from

    def cofiring(self, tile: int) -> dict[int, float] | None:
        """For an expert tile of a block whose routing knows co-activation (`BlockRouting.sets`):
        each other expert of its layer -> the probability it runs in a step given that this
        tile's expert runs, less its probability unconditioned (what the tile's channel adds when
        they share one). None without co-activation."""
        tile_ = self.tiles[tile]
        block = self.routing.of_layer(tile_.layer) if self.routing is not None and tile_.expert >= 0 else None
        if block is None or not block.sets:
            return None
        e, tokens = tile_.expert, self.batch_tokens
        fires = block.fires(e, tokens)
        return {other: block.fire_together(e, other, tokens) / fires - block.fires(other, tokens)
                for other in range(block.experts) if other != e and fires > 0}

    def expert_tiles_of(self, layer: int) -> tuple[int, ...]:
        return self._expert_tiles.get(layer, ())

    @cached_property
    def _expert_tiles(self) -> dict[int, tuple[int, ...]]:
        found: dict[int, list[int]] = {}
        for t, tile in enumerate(self.tiles):
            if tile.expert >= 0:
                found.setdefault(tile.layer, []).append(t)
        return {layer: tuple(ts) for layer, ts in found.items()}

    def fires_of(self, group: int) -> float:
        """The probability that a step runs `group` (an expert's: its routing's; else 1): what its
        transfers cost is charged in expectation."""
        return self.group_fires[group] if self.group_fires else 1.0

    def home_of(self, group: int) -> int:
        return self.group_home[group] if self.group_home else -1

    def layer_homes(self) -> dict[int, int]:
        """layer -> its home, for the layers with tiles and a home."""
        return {self.tiles[t].layer: self.home_of(g) for t, g in enumerate(self.group_of) if self.home_of(g) >= 0}

    @property
    def num_chiplets(self) -> int:
        return self.target.num_chiplets

    @property
    def num_cards(self) -> int:
        return self.target.cards

    @property
    def num_channels(self) -> int:
        return self.target.num_channels

    def chiplets_of_channel(self, channel: int) -> tuple[int, ...]:
        """The allowed chiplets `channel` attaches to: where a tile it streams may compute."""
        return self._by_channel.get(channel, ())

    @cached_property
    def _by_channel(self) -> dict[int, tuple[int, ...]]:
        by_channel: dict[int, list[int]] = {}
        for c in self.chiplets:
            by_channel.setdefault(self.target.channel_of(c), []).append(c)
        return {h: tuple(chips) for h, chips in by_channel.items()}


def resolve_chiplets(target: Target, chiplets: Iterable[int] | None) -> tuple[int, ...]:
    """The allowed chiplets, sorted; every chiplet by default. Out-of-range ids are an OptionError."""
    if chiplets is None:
        return tuple(range(target.num_chiplets))
    chosen = tuple(sorted({int(c) for c in chiplets}))
    bad = [c for c in chosen if not 0 <= c < target.num_chiplets]
    if not chosen or bad:
        raise OptionError(f"chiplets {list(bad) if bad else '(none)'} not on target '{target.name}', which has "
                          f"chiplets 0-{target.num_chiplets - 1}", hint="choose chiplets like '0-7' (--chiplets)")
    return chosen


def capacities(target: Target, reserve_bytes: Sequence[int] | None, chiplets: Sequence[int]) -> tuple[tuple[int, ...],
                                                                                                   tuple[int, ...]]:
    """(usable bytes, reserve bytes) per chiplet; chiplets outside `chiplets` hold nothing."""
    sram = target.chiplet.sram_bytes
    if reserve_bytes is None:
        reserve = [sram - target.usable_sram_bytes_per_chiplet] * target.num_chiplets
    else:
        reserve = [int(r) for r in reserve_bytes]
        if len(reserve) != target.num_chiplets:
            raise OptionError(f"reserve_bytes has {len(reserve)} entries but target '{target.name}' has "
                              f"{target.num_chiplets} chiplets", hint="give one reserve per chiplet")
    over = [c for c in chiplets if not 0 <= reserve[c] <= sram]
    if over:
        c = over[0]
        raise InfeasibleError(f"chiplet {c} needs a reserve of {reserve[c]} bytes for activations and the KV cache "
                              f"but has {sram} bytes of SRAM", file=target.source, needed_bytes=reserve[c],
                              available_bytes=sram, hint="shorten the context or batch, or use more chiplets")
    allowed = set(chiplets)
    usable = tuple(sram - reserve[c] if c in allowed else 0 for c in range(target.num_chiplets))
    return usable, tuple(reserve)


def build_problem(tiles: Sequence[Tile], target: Target, *, batch_tokens: int = 1,
                  vocab_rows: dict[str, int] | None = None, reserve_bytes: Sequence[int] | None = None,
                  chiplets: Iterable[int] | None = None, homes: Mapping[int, int] | None = None,
                  routing: Routing | None = None) -> Problem:
    """Cost every tile on `target` for a decode step of `batch_tokens` tokens.

    `vocab_rows`: the table rows of each embedding and tied head (the lookup reads one per token).
    `homes`: layer -> the chiplet its non-weight work runs on (module docstring); an allowed chiplet.
    `routing`: how often each expert fires (`aviatorc.routing`); an expert's tile then costs what a
    step reads and computes in expectation: its bytes when the expert fires, its FLOPs on the
    tokens routed to it. Without it every expert runs on every token."""
    vocab_rows = vocab_rows or {}
    allowed = resolve_chiplets(target, chiplets)
    capacity, reserve = capacities(target, reserve_bytes, allowed)
    abpe = target.activation_bytes_per_element
    tile_bytes, work, stream, read, out = [], [], [], [], []
    group_act: dict[str, int] = {}
    group_out: dict[str, int] = {}
    order: dict[str, tuple[int, int]] = {}  # group -> (layer, first tile)
    fires: dict[str, float] = {}  # an expert's groups -> the probability a step runs them
    for index, tile in enumerate(tiles):
        nbytes = tile.storage_bytes
        if tile.is_embedding:
            rows = vocab_rows.get(tile.weight, tile.k_stop)
            # Expected bytes read: each of the batch's tokens reads one row, in this tile with
            # probability k / rows, so batch * (nbytes / k) * (k / rows) = batch * nbytes / rows.
            per_step = min(nbytes, -(-nbytes * batch_tokens // rows))
            flops = 0.0
            act = tile.n * abpe * batch_tokens
            produced = -(-tile.n * abpe * batch_tokens * tile.k // rows)
        else:
            per_step = nbytes
            if tile.tied_to:  # the lookup reads a token's row (a column here) from the same tile
                rows = vocab_rows.get(tile.weight, tile.n_stop)
                per_step += min(nbytes, -(-nbytes * batch_tokens // rows))
            flops = 2.0 * tile.k * tile.n * batch_tokens
            act = tile.k * abpe * batch_tokens
            produced = tile.n * abpe * batch_tokens
            if routing is not None and routing.routes(tile.layer, tile.expert):
                # expected: read when the expert fires, computed on its routed tokens
                fires[tile.group] = routing.fires(tile.layer, tile.expert, batch_tokens)
                per_step = math.ceil(per_step * fires[tile.group])
                share = routing.share(tile.layer, tile.expert)
                flops *= share
                act = math.ceil(act * share)
                produced = math.ceil(produced * share)
        seconds = max(flops / target.flops_per_s(tile.format.kind), per_step / target.chiplet.sram_bytes_per_s)
        tile_bytes.append(nbytes)
        read.append(per_step)
        out.append(produced)
        work.append(max(1, round(seconds * PS)))
        stream.append(max(1, round(per_step / target.channel_bytes_per_s * PS)))
        group_act[tile.group] = max(group_act.get(tile.group, 0), act)
        group_out[tile.group] = group_out.get(tile.group, 0) + produced
        order.setdefault(tile.group, (tile.layer, index))
    groups = tuple(sorted(order, key=lambda g: order[g]))
    index_of = {g: i for i, g in enumerate(groups)}
    homes = dict(homes or {})
    outside = sorted(c for c in homes.values() if c not in allowed)
    if outside:
        raise OptionError(f"layer homes on chiplets {outside} outside the placement's chiplets",
                          hint="give each layer a home among the allowed chiplets")
    edge = tuple(tuple(round(link.transfer_s(group_act[g]) * PS * fires.get(g, 1.0)) for link in target.links)
                 for g in groups)
    return Problem(
        target=target,
        tiles=tuple(tiles),
        tile_bytes=tuple(tile_bytes),
        work_ps=tuple(work),
        stream_ps=tuple(stream),
        read_bytes=tuple(read),
        out_bytes=tuple(out),
        groups=groups,
        group_of=tuple(index_of[t.group] for t in tiles),
        next_group=tuple(range(1, len(groups))) + ((-1,) if groups else ()),
        edge_ps=edge,  # type: ignore[arg-type]
        group_act_bytes=tuple(group_act[g] for g in groups),
        group_out_bytes=tuple(group_out[g] for g in groups),
        layers=tuple(sorted({t.layer for t in tiles})),
        capacity_bytes=capacity,
        reserve_bytes=reserve,
        chiplets=allowed,
        stream_channels=tuple(sorted({target.channel_of(c) for c in allowed})),
        batch_tokens=batch_tokens,
        group_home=tuple(homes.get(order[g][0], -1) for g in groups) if homes else (),
        cold=cold_experts(tiles, tile_bytes, read, sum(capacity)) if routing is not None else frozenset(),
        group_fires=tuple(fires.get(g, 1.0) for g in groups) if fires else (),
        routing=routing,
    )


def cold_experts(tiles: Sequence[Tile], tile_bytes: Sequence[int], read_bytes: Sequence[int],
                 capacity: int) -> frozenset[int]:
    """The expert tiles that stream when SRAM goes to the tiles a step reads most per stored byte
    (the knapsack over the routing's expectation; an embedding table, read a row per token, comes
    last): a layer placed early must not fill SRAM with its cold experts while a later layer's hot
    ones stream. Only experts are marked; the other tiles are the greedy's to place."""
    room = capacity
    cold = set()
    for t in sorted(range(len(tiles)), key=lambda t: (-read_bytes[t] / max(1, tile_bytes[t]), t)):
        if tile_bytes[t] <= room:
            room -= tile_bytes[t]
        elif tiles[t].expert >= 0:
            cold.add(t)
    return frozenset(cold)


def tree_ps(chiplets: set[int], target: Target, edge: tuple[int, int, int]) -> int:
    """Cost of sending one activation to every chiplet in `chiplets` along the hierarchy."""
    if not chiplets:
        return 0
    packages = {target.package_of(c) for c in chiplets}
    cards = {target.card_of(c) for c in chiplets}
    return (len(chiplets) - len(packages)) * edge[0] + (len(packages) - len(cards)) * edge[1] + (len(cards) - 1) * edge[2]


def _transfer_ps(target: Target, level: int, nbytes: int) -> int:
    return round(target.links[level].transfer_s(nbytes) * PS)


def gather_ps(slices: dict[int, int], target: Target) -> int:
    """Cost of collecting output slices (chiplet -> bytes) up the hierarchy to the lowest chiplet."""
    if len(slices) <= 1:
        return 0
    cost = 0
    by_package: dict[int, list[int]] = {}
    for c in slices:
        by_package.setdefault(target.package_of(c), []).append(c)
    package_bytes: dict[int, int] = {}
    for package, chips in by_package.items():
        head = min(chips)
        cost += sum(_transfer_ps(target, 0, slices[c]) for c in chips if c != head)
        package_bytes[package] = sum(slices[c] for c in chips)
    by_card: dict[int, list[int]] = {}
    for package in package_bytes:
        by_card.setdefault(package // target.packages_per_card, []).append(package)
    card_bytes: dict[int, int] = {}
    for card, packages in by_card.items():
        head = min(packages)
        cost += sum(_transfer_ps(target, 1, package_bytes[p]) for p in packages if p != head)
        card_bytes[card] = sum(package_bytes[p] for p in packages)
    root = min(card_bytes)
    return cost + sum(_transfer_ps(target, 2, b) for h, b in card_bytes.items() if h != root)


def handoff_ps(source: int, dest: int, nbytes: int, target: Target) -> int:
    """One transfer of `nbytes` from chiplet `source` to `dest` (0 on the same chiplet)."""
    link = target.link_between(source, dest)
    return 0 if link is None else round(link.transfer_s(nbytes) * PS)


def home_trips_ps(problem: Problem, group: int, root: int) -> int:
    """A group's input from its home to its root and its output back (0 without a home)."""
    home = problem.home_of(group)
    if home < 0:
        return 0
    return round((handoff_ps(home, root, problem.group_act_bytes[group], problem.target)
                  + handoff_ps(root, home, problem.group_out_bytes[group], problem.target)) * problem.fires_of(group))


def next_handoff_ps(problem: Problem, group: int, root: int, after: int, after_root: int) -> int:
    """`group`'s output handed on to the group `after` it: from its home (its root without one) to
    the next group's home (its root without one)."""
    def where(g: int, g_root: int) -> int:
        home = problem.home_of(g)
        return home if home >= 0 else g_root

    return round(handoff_ps(where(group, root), where(after, after_root), problem.group_out_bytes[group],
                            problem.target) * problem.fires_of(group))


def _marginal_edge(problem: Problem, c: int, used: set[int], packages: set[int], cards: set[int],
                   edge: tuple[int, int, int]) -> int:
    """What adding chiplet c to `used` (on `packages` and `cards`) adds to the broadcast tree."""
    if not used or c in used:
        return 0
    if problem.target.package_of(c) in packages:
        return edge[0]
    if problem.target.card_of(c) in cards:
        return edge[1]
    return edge[2]


def compute_chiplets(problem: Problem, where: Sequence[int], tiles: Sequence[int] | None = None) -> list[int]:
    """The chiplet each tile computes on (-1 for tiles not in `tiles` or not placed): its own for
    a resident tile, one its channel attaches to for a streamed one (module docstring)."""
    compute = [-1] * len(problem.tiles)
    for t, c in compute_of(problem, where, range(len(problem.tiles)) if tiles is None else tiles).items():
        compute[t] = c
    return compute


def compute_of(problem: Problem, where: Sequence[int], indices: Sequence[int]) -> dict[int, int]:
    """`compute_chiplets` of the placed tiles among `indices` only, as {tile: chiplet}: in time
    linear in `indices`, not in the whole model (the greedy asks it per group and per trial)."""
    num_c = problem.num_chiplets
    compute: dict[int, int] = {}
    members: dict[int, list[int]] = {}
    for t in indices:
        if where[t] < 0:
            continue
        if where[t] < num_c:
            compute[t] = where[t]
        else:
            members.setdefault(problem.group_of[t], []).append(t)
    if not members:
        return compute
    resident_load: dict[int, dict[int, int]] = {}
    for t in indices:
        if 0 <= where[t] < num_c:
            per = resident_load.setdefault(problem.group_of[t], {})
            per[where[t]] = per.get(where[t], 0) + problem.work_ps[t]
    for g in sorted(members):
        load = dict(resident_load.get(g, {}))
        used = set(load)
        packages = {problem.target.package_of(c) for c in used}
        cards = {problem.target.card_of(c) for c in used}
        edge = problem.edge_ps[g]
        for t in sorted(members[g], key=lambda t: (-problem.work_ps[t], t)):
            busiest = max(load.values(), default=0)
            work = problem.work_ps[t]
            c = min(problem.chiplets_of_channel(where[t] - num_c),
                    key=lambda c: (max(0, load.get(c, 0) + work - busiest)  # noqa: B023 - used at once, in the loop
                                   + _marginal_edge(problem, c, used, packages, cards, edge), load.get(c, 0), c))
            compute[t] = c
            load[c] = load.get(c, 0) + work
            used.add(c)
            packages.add(problem.target.package_of(c))
            cards.add(problem.target.card_of(c))
    return compute


@dataclass(frozen=True)
class LayerCost:
    layer: int
    compute_ps: int
    stream_ps: int  # the busiest channel's expected streaming
    cut_ps: int
    collect_ps: int = 0  # output slices gathered, and handed on to the next group
    # What the busiest expert group's own channel (`fired_stream_ps`) adds above the balance: the
    # expected maximum over channels is at least each of the two.
    fired_ps: int = 0

    @property
    def total_ps(self) -> int:
        return self.compute_ps + self.stream_ps + self.cut_ps + self.collect_ps + self.fired_ps


def layer_costs(problem: Problem, where: Sequence[int], tiles: Sequence[int] | None = None,
                compute: Sequence[int] | None = None) -> list[LayerCost]:
    """Per-layer costs of an assignment (over `tiles`, default all), sorted by layer.

    `compute`: the compute chiplets, when already known (default: `compute_chiplets`)."""
    target = problem.target
    num_c = problem.num_chiplets
    indices = list(range(len(problem.tiles)) if tiles is None else tiles)
    chiplet: Mapping[int, int] | Sequence[int] = compute if compute is not None else compute_of(problem, where, indices)
    load: dict[int, dict[int, int]] = {}  # group -> chiplet -> ps
    slices: dict[int, dict[int, int]] = {}  # group -> chiplet -> output bytes
    stream: dict[int, dict[int, int]] = {}  # layer -> channel -> ps
    fired: dict[int, dict[int, int]] = {}  # expert group -> where (a channel's index past the chiplets) -> ps
    layer_groups: dict[int, set[int]] = {}
    for t in indices:
        w = where[t]
        if w < 0:
            continue
        layer = problem.tiles[t].layer
        g = problem.group_of[t]
        layer_groups.setdefault(layer, set()).add(g)
        c = chiplet[t]
        per = load.setdefault(g, {})
        per[c] = per.get(c, 0) + problem.work_ps[t]
        out = slices.setdefault(g, {})
        out[c] = out.get(c, 0) + problem.out_bytes[t]
        if w >= num_c:
            channels = stream.setdefault(layer, {})
            channels[w - num_c] = channels.get(w - num_c, 0) + problem.stream_ps[t]
            if problem.fires_of(g) < 1.0:
                per_channel = fired.setdefault(g, {})
                per_channel[w] = per_channel.get(w, 0) + problem.stream_ps[t]
    result = []
    for layer in sorted(layer_groups):
        groups = layer_groups[layer]
        compute_ps = sum(max(load[g].values()) for g in groups)
        cut = sum(tree_ps(set(load[g]), target, problem.edge_ps[g]) for g in groups)
        collect = 0
        for g in groups:
            collect += round(gather_ps(slices[g], target) * problem.fires_of(g)) + home_trips_ps(problem, g, min(load[g]))
            after = problem.next_group[g]
            if after >= 0 and after in load:
                collect += next_handoff_ps(problem, g, min(load[g]), after, min(load[after]))
        balance = max(stream.get(layer, {0: 0}).values())
        own = max((max(fired[g].values()) for g in groups if g in fired), default=0)
        result.append(LayerCost(layer, compute_ps, balance, cut, collect, max(0, own - balance)))
    return result


def group_cost_ps(problem: Problem, where: Sequence[int], members: Sequence[int]) -> int:
    """One group's compute, broadcast, gather, trips to its home and, for an expert, its own busiest
    channel (not the layer's channel balance, nor the hand-off to another group): the greedy's
    yardstick."""
    compute = compute_of(problem, where, members)
    load: dict[int, int] = {}
    slices: dict[int, int] = {}
    g = problem.group_of[members[0]]
    for t in members:
        if where[t] < 0:
            continue
        load[compute[t]] = load.get(compute[t], 0) + problem.work_ps[t]
        slices[compute[t]] = slices.get(compute[t], 0) + problem.out_bytes[t]
    return (max(load.values(), default=0) + tree_ps(set(load), problem.target, problem.edge_ps[g])
            + round(gather_ps(slices, problem.target) * problem.fires_of(g))
            + (home_trips_ps(problem, g, min(load)) if load else 0) + fired_stream_ps(problem, where, members))


def fired_stream_ps(problem: Problem, where: Sequence[int], members: Sequence[int]) -> int:
    """An expert group's own streaming, in expectation: when it fires, its tiles load from their
    channels side by side, so it waits for its busiest channel (`stream_ps` is already weighted by
    how often it fires). The layer's channel balance (`layer_costs`) is a maximum of expectations
    and cannot see this: an expert whose strips share one channel costs it the same as one spread
    over many, yet loads several times slower when routed. A dense group (which always runs): 0,
    its streaming is the layer's. Each is a lower bound on the layer's expected busiest channel (it
    is that channel's load in the steps the expert fires, and no more than it in the others), and
    so is the channel balance: a layer is charged the larger (`layer_costs`). The greedy adds it
    per group as an expert's marginal cost, which is what spreads each expert's strips."""
    if problem.fires_of(problem.group_of[members[0]]) >= 1.0:
        return 0
    channels: dict[int, int] = {}
    for t in members:
        if where[t] >= problem.num_chiplets:
            channels[where[t]] = channels.get(where[t], 0) + problem.stream_ps[t]
    return max(channels.values(), default=0)


def total_cost(problem: Problem, where: Sequence[int], tiles: Sequence[int] | None = None) -> int:
    return sum(c.total_ps for c in layer_costs(problem, where, tiles))
