"""Requests that cannot be placed, explained before any solving, with the numbers and the fixes.

- a weight format the target does not support;
- without streaming: the weights' bytes against the usable SRAM of the chiplets it may use
  (after the per-chiplet reserve for activations and the KV cache);
- with streaming: the weights' bytes against that SRAM plus the LPDDR of the cards it may use;
- a tile that cannot be split further (one matrix-unit strip) larger than a chiplet's usable SRAM.
A tied embedding's bytes are counted once (its alias spec stores none).
The fixes offered are the ones that would work: a smaller format (with its size), streaming,
or the number of cards (`--cards N`) that would hold the weights.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from aviatorc.errors import InfeasibleError
from aviatorc.formats import WeightFormat
from aviatorc.partition.problem import capacities, resolve_chiplets
from aviatorc.partition.tiling import WeightSpec, tile_weight
from aviatorc.target import Target


def human_bytes(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def explain_infeasible(weights: list[WeightSpec], target: Target, *, streaming: bool = True,
                       reserve_bytes: Sequence[int] | None = None, chiplets: Iterable[int] | None = None) -> None:
    """Raise `InfeasibleError` naming what does not fit, by how much, and what would fix it."""
    where = target.source
    allowed = resolve_chiplets(target, chiplets)
    capacity, _ = capacities(target, reserve_bytes, allowed)
    unsupported = sorted({w.format.kind for w in weights} - set(target.weight_formats))
    if unsupported:
        first = next(w for w in weights if w.format.kind in unsupported)
        raise InfeasibleError(
            f"target '{target.name}' does not support weight format(s) {', '.join(unsupported)} "
            f"(first: '{first.name}')", file=where, needed=unsupported,
            hint=f"quantize to one of {', '.join(target.weight_formats)}")
    weights = [w for w in weights if not w.is_alias]
    if not weights:
        return
    needed = sum(w.storage_bytes for w in weights)
    usable = sum(capacity)
    per_card = target.usable_sram_bytes_per_chiplet * target.chiplets_per_card
    subset = len(allowed) < target.num_chiplets
    reserve = ("the activation/KV reserve" if reserve_bytes is not None
               else f"a {target.activation_reserve_fraction:.0%} activation/KV reserve")

    # The smallest tile a weight can have is one matrix-unit strip; it must fit one chiplet.
    cap = max(capacity)
    largest = max(weights, key=lambda w: _min_tile_bytes(w, target))
    smallest_tile = _min_tile_bytes(largest, target)
    if smallest_tile > cap:
        raise InfeasibleError(
            f"weight '{largest.name}' cannot be split below {human_bytes(smallest_tile)} per tile (one "
            f"{target.matrix_unit_n}-wide strip) but a chiplet has {human_bytes(cap)} usable SRAM",
            file=where, needed_bytes=smallest_tile, available_bytes=cap,
            hint="use a smaller format (int4) or a target with more SRAM per chiplet")

    fixes = _fixes(weights, target, needed, per_card)
    if subset:
        fixes.append("allow more chiplets (--chiplets)")
    if not streaming and needed > usable:
        raise InfeasibleError(
            f"weights need {human_bytes(needed)} but {len(allowed)} chiplets have "
            f"{human_bytes(usable)} usable SRAM (after {reserve})",
            file=where, needed_bytes=needed, available_bytes=usable,
            hint="; ".join(["enable streaming from LPDDR"] + fixes))
    # Only the channels attached to an allowed chiplet stream (a channel shared with another
    # tenant of the same chiplets: that split is the caller's).
    stream_channels = len({target.channel_of(c) for c in allowed})
    lpddr = target.channel_bytes * stream_channels
    if streaming and needed > usable + lpddr:
        cards = math.ceil(needed / (per_card + target.lpddr_bytes_per_card))
        raise InfeasibleError(
            f"weights need {human_bytes(needed)} but SRAM and the {stream_channels} LPDDR channel(s) of the "
            f"allowed chiplets hold "
            f"{human_bytes(usable + lpddr)}", file=where, needed_bytes=needed, available_bytes=usable + lpddr,
            hint="; ".join([f for f in fixes if "streaming" not in f] + [f"use {cards} cards (--cards {cards})"]))


def _min_tile_bytes(w: WeightSpec, target: Target) -> int:
    extent = w.k if w.is_embedding else w.n
    unit = target.matrix_unit_k if w.is_embedding else target.matrix_unit_n
    return max(t.storage_bytes for t in tile_weight(w, target.matrix_unit_k, target.matrix_unit_n,
                                                      math.ceil(extent / unit)))


def _fixes(weights: list[WeightSpec], target: Target, needed: int, per_card: int) -> list[str]:
    fixes = []
    for fmt in (WeightFormat("int8"), WeightFormat("int4", group_size=128), WeightFormat("mxint4", group_size=32)):
        if fmt.kind not in target.weight_formats:
            continue
        smaller = sum(w.storage_bytes if w.is_embedding or w.format.bits <= fmt.bits else fmt.storage_bytes(w.k, w.n)
                      for w in weights)
        if smaller < needed:
            fixes.append(f"quantize to {fmt.name} ({human_bytes(smaller)})")
    cards = math.ceil(needed / per_card)
    fixes.append(f"use {cards} cards (--cards {cards}) to keep every weight in SRAM")
    return fixes
