"""A checker for placements that shares no code with the solver or the cost model.

From the weight specs and the target alone it re-derives: every tile's layer, role, group,
nodes and parts (from its weight's spec, never from the solver's tiles); the tiles cover each
weight exactly and follow the matrix units, and a tied embedding has none of its own (its
head holds them); each tile's bytes are `storage_bytes` of its own [k, n]; every tile is
resident on one chiplet or streamed from one LPDDR channel, and computes on its own chiplet or
on one its channel attaches to; nothing lands outside the allowed chiplets; no chiplet holds more than
its SRAM less its reserve; the objective, recomputed here from first principles (compute
including streamed tiles, streaming, broadcast trees, collection, trips to each layer's home and
hand-offs; see `problem.py` for the model), is the one reported; and the bound is not above it.
A failure is a bug in aviatorc, not a user error: it raises `PlacementCheckError` with what broke.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from aviatorc.partition.placement import Placement
from aviatorc.partition.tiling import Tile, WeightSpec
from aviatorc.routing import Routing
from aviatorc.target import Target


class PlacementCheckError(RuntimeError):
    """A placement breaks an invariant (an internal error, reported with the tile at fault)."""


def check_placement(placement: Placement, weights: list[WeightSpec], target: Target, *, batch_tokens: int = 1,
                    reserve_bytes: Sequence[int] | None = None, chiplets: Iterable[int] | None = None,
                    homes: Mapping[int, int] | None = None, routing: Routing | None = None) -> None:
    specs = {w.name: w for w in weights}
    tiles = placement.tiles
    where = placement.where
    compute = placement.compute_chiplet
    num_c = target.num_chiplets
    allowed = set(range(num_c) if chiplets is None else chiplets)
    if len(where) != len(tiles) or len(compute) != len(tiles):
        raise PlacementCheckError(f"{len(tiles)} tiles but {len(where)} locations and {len(compute)} compute chiplets")
    _check_specs(specs, tiles)
    _check_coverage(specs, tiles, target)

    # Assignment, compute chiplets, subset and capacity.
    sram = target.chiplet.sram_bytes
    reserve = (list(reserve_bytes) if reserve_bytes is not None
               else [sram - int(sram * (1.0 - target.activation_reserve_fraction))] * num_c)
    held = [0] * num_c
    for index, (tile, w, c) in enumerate(zip(tiles, where, compute, strict=True)):
        if not 0 <= w < num_c + target.num_channels:
            raise PlacementCheckError(f"tile {index} of '{tile.weight}' has no valid location ({w})")
        if not 0 <= c < num_c or c not in allowed:
            raise PlacementCheckError(f"tile {index} of '{tile.weight}' computes on chiplet {c}, outside the "
                                      f"allowed {sorted(allowed)[:4]}...")
        if w < num_c:
            if w not in allowed:
                raise PlacementCheckError(f"tile {index} of '{tile.weight}' is resident on chiplet {w}, outside the subset")
            if c != w:
                raise PlacementCheckError(f"resident tile {index} of '{tile.weight}' on chiplet {w} computes on {c}")
            held[w] += specs[tile.weight].format.storage_bytes(tile.k_stop - tile.k_start, tile.n_stop - tile.n_start)
        elif c // target.chiplets_per_channel != w - num_c:
            raise PlacementCheckError(f"tile {index} of '{tile.weight}' streams from channel {w - num_c} but computes "
                                      f"on chiplet {c}, which the channel does not attach to")
    for c, nbytes in enumerate(held):
        if nbytes > sram - reserve[c]:
            raise PlacementCheckError(f"chiplet {c} holds {nbytes} bytes, over its usable {sram - reserve[c]} "
                                      f"({reserve[c]} reserved)")
    if list(placement.chiplet_bytes) != held:
        raise PlacementCheckError("reported per-chiplet bytes differ from the recount")

    # Objective from first principles, and the bound below it.
    homes = {layer: c for layer, c in (homes or {}).items() if any(t.layer == layer for t in tiles)}
    if any(c not in allowed for c in homes.values()):
        raise PlacementCheckError(f"layer homes {homes} outside the allowed chiplets")
    if dict(placement.layer_homes) != homes:
        raise PlacementCheckError(f"placement costed layer homes {dict(placement.layer_homes)}, given {homes}")
    expected = _objective(placement, weights, target, batch_tokens, homes, routing)
    if expected != placement.objective_ps:
        raise PlacementCheckError(f"reported objective {placement.objective_ps} ps, recomputed {expected} ps")
    if placement.bound_ps > placement.objective_ps:
        raise PlacementCheckError(f"lower bound {placement.bound_ps} ps is above the objective {placement.objective_ps} ps")


def _group(spec: WeightSpec) -> str:
    return f"{spec.layer}:{spec.input or spec.name}"


def _check_specs(specs: dict[str, WeightSpec], tiles: Sequence[Tile]) -> None:
    """Each tile agrees with its spec; tied pairs point at each other; aliases have no tiles."""
    named = {t.weight for t in tiles}
    unknown = sorted(named - set(specs))
    if unknown:
        raise PlacementCheckError(f"tiles of unknown weights: {unknown[:5]}")
    for name, spec in specs.items():
        alias = spec.role == "embedding" and bool(spec.tied_to)
        if spec.tied_to:
            other = specs.get(spec.tied_to)
            if other is None or other.tied_to != name:
                raise PlacementCheckError(f"weight '{name}' is tied to '{spec.tied_to}', which is not tied back")
        if alias and name in named:
            raise PlacementCheckError(f"tied embedding '{name}' has tiles of its own (its head holds its bytes)")
        if not alias and name not in named:
            raise PlacementCheckError(f"weight '{name}' has no tiles")
    for index, tile in enumerate(tiles):
        spec = specs[tile.weight]
        if (tile.layer, tile.role, tile.group, tile.nodes, tile.format) != (spec.layer, spec.role, _group(spec),
                                                                           spec.nodes, spec.format):
            raise PlacementCheckError(f"tile {index} of '{tile.weight}' disagrees with its spec on layer, role, "
                                      "group, nodes or format")
        clipped = tuple((r, max(a, tile.n_start), min(b, tile.n_stop)) for r, a, b in spec.splits
                        if a < tile.n_stop and b > tile.n_start)
        if tile.parts != clipped:
            raise PlacementCheckError(f"tile {index} of '{tile.weight}' has parts {tile.parts}, expected {clipped}")


def _check_coverage(specs: dict[str, WeightSpec], tiles: Sequence[Tile], target: Target) -> None:
    """Each weight's tiles tile its [k, n] exactly, along one dim, on matrix-unit boundaries."""
    by_weight: dict[str, list[Tile]] = defaultdict(list)
    for tile in tiles:
        by_weight[tile.weight].append(tile)
    for name, pieces in by_weight.items():
        spec = specs[name]
        along_k = spec.role == "embedding"
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


def _ps(seconds: float) -> int:
    return round(seconds * 1e12)


def _objective(placement: Placement, weights: list[WeightSpec], target: Target, batch_tokens: int,
               homes: Mapping[int, int], routing: Routing | None) -> int:
    specs = {w.name: w for w in weights}
    num_c = target.num_chiplets
    per_package = target.chiplets_per_package
    per_card = target.chiplets_per_package * target.packages_per_card
    abpe = target.activation_bytes_per_element
    # Group order: as the weights are listed, layer by layer (the order the groups run in).
    order: dict[tuple[int, str], tuple[int, int]] = {}
    for position, spec in enumerate(weights):
        if not (spec.role == "embedding" and spec.tied_to):
            order.setdefault((spec.layer, _group(spec)), (spec.layer, position))
    load: dict[tuple[int, str], dict[int, int]] = defaultdict(lambda: defaultdict(int))
    out: dict[tuple[int, str], dict[int, int]] = defaultdict(lambda: defaultdict(int))
    stream: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    own: dict[tuple[int, str], dict[int, int]] = defaultdict(lambda: defaultdict(int))  # an expert group's channels
    act: dict[tuple[int, str], int] = {}
    fires: dict[tuple[int, str], float] = {}  # an expert's groups: the chance a step runs them (else 1)
    for tile, w, c in zip(placement.tiles, placement.where, placement.compute_chiplet, strict=True):
        spec = specs[tile.weight]
        k, n = tile.k_stop - tile.k_start, tile.n_stop - tile.n_start
        nbytes = spec.format.storage_bytes(k, n)
        if spec.role == "embedding":
            read = min(nbytes, -(-nbytes * batch_tokens // spec.k))  # a token reads one of spec.k rows
            flops, a = 0.0, n * abpe * batch_tokens
            produced = -(-n * abpe * batch_tokens * k // spec.k)  # the expected share of the rows looked up
        else:
            read, flops, a = nbytes, 2.0 * k * n * batch_tokens, k * abpe * batch_tokens
            if spec.tied_to:  # the tied table's lookup reads a row per token from these columns
                read += min(nbytes, -(-nbytes * batch_tokens // spec.n))
            produced = n * abpe * batch_tokens
            if routing is not None and routing.routes(spec.layer, spec.expert):
                # a step reads the expert when one of its tokens routes to it
                share = routing.share(spec.layer, spec.expert)
                fires[(spec.layer, _group(spec))] = routing.fires(spec.layer, spec.expert, batch_tokens)
                read = int(-(-read * fires[(spec.layer, _group(spec))] // 1))
                flops, a, produced = flops * share, int(-(-a * share // 1)), int(-(-produced * share // 1))
        peak = target.flops_per_s(spec.format.kind)
        work = max(1, _ps(max(flops / peak, read / target.chiplet.sram_bytes_per_s)))
        key = (spec.layer, _group(spec))
        act[key] = max(act.get(key, 0), a)
        load[key][c] += work  # resident or staged: it computes on c either way
        out[key][c] += produced
        if w >= num_c:
            ps = max(1, _ps(read / target.channel_bytes_per_s))
            stream[spec.layer][w - num_c] += ps
            if fires.get(key, 1.0) < 1.0:  # an expert's tiles load side by side when it fires
                own[key][w - num_c] += ps
    # Per layer, the busiest channel's expected streaming, or an expert group's own busiest channel
    # at its chance of firing where that is more: each is a lower bound on the expected maximum.
    experts: dict[int, int] = defaultdict(int)  # layer -> its experts' largest own busiest channel
    for (layer, _), per_channel_ps in own.items():
        experts[layer] = max(experts[layer], max(per_channel_ps.values()))
    total = sum(max(max(per_channel_ps.values(), default=0), experts[layer])
                for layer, per_channel_ps in stream.items())
    keys = sorted(load, key=lambda key: order[key])
    for position, key in enumerate(keys):
        chips = set(load[key])
        total += max(load[key].values())  # groups run one after another, each balanced on its own
        # Broadcast: one transfer per extra chiplet in a package, package on a card, card.
        # Transfers happen when the group runs: an expert's are charged at the chance its routing runs it.
        f = fires.get(key, 1.0)
        cost = [round((link.message_s + act[key] / link.bytes_per_s + link.latency_s) * 1e12 * f)
                for link in target.links]
        packages = {c // per_package for c in chips}
        cards = {c // per_card for c in chips}
        total += (len(chips) - len(packages)) * cost[0] + (len(packages) - len(cards)) * cost[1] + (len(cards) - 1) * cost[2]
        total += round(_collect(out[key], target) * f)
        root = min(chips)
        if key[0] in homes:  # the input comes from the layer's home, the output goes back there
            home = homes[key[0]]
            total += round((_send(home, root, act[key], target) + _send(root, home, sum(out[key].values()), target)) * f)
        if position + 1 < len(keys):  # hand the whole output on: from the home (or lowest chiplet) to the next's
            after = keys[position + 1]
            src, dst = homes.get(key[0], root), homes.get(after[0], min(load[after]))
            total += round(_send(src, dst, sum(out[key].values()), target) * f)
    return total


def _send(src: int, dst: int, nbytes: int, target: Target) -> int:
    """One message from chiplet `src` to `dst` over the innermost link level joining them (0 for the same chiplet)."""
    per_package = target.chiplets_per_package
    per_card = per_package * target.packages_per_card
    if src == dst:
        return 0
    level = 0 if src // per_package == dst // per_package else 1 if src // per_card == dst // per_card else 2
    link = target.links[level]
    return _ps(link.message_s + nbytes / link.bytes_per_s + link.latency_s)


def _collect(slices: dict[int, int], target: Target) -> int:
    """Slices up the tree to the lowest chiplet: chiplets to their package's lowest, packages to
    their card's lowest, cards to the lowest card, each carrying what it gathered."""
    per_package = target.chiplets_per_package
    per_card = per_package * target.packages_per_card
    links = target.links
    total = 0
    package_bytes: dict[int, int] = defaultdict(int)
    for c, nbytes in slices.items():
        package_bytes[c // per_package] += nbytes
        if c != min(x for x in slices if x // per_package == c // per_package):
            total += _ps(links[0].message_s + nbytes / links[0].bytes_per_s + links[0].latency_s)
    card_bytes: dict[int, int] = defaultdict(int)
    for p, nbytes in package_bytes.items():
        card_bytes[p * per_package // per_card] += nbytes
        if p != min(x for x in package_bytes if x * per_package // per_card == p * per_package // per_card):
            total += _ps(links[1].message_s + nbytes / links[1].bytes_per_s + links[1].latency_s)
    root = min(card_bytes)
    for h, nbytes in card_bytes.items():
        if h != root:
            total += _ps(links[2].message_s + nbytes / links[2].bytes_per_s + links[2].latency_s)
    return total
