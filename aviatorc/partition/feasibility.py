"""Requests that cannot be placed, explained before any solving, with the numbers and the fixes.

- a weight format the target does not support;
- without streaming: the weights' bytes against the usable SRAM of all chiplets;
- with streaming: the weights' bytes against the LPDDR of all cards;
- a tile that cannot be split further (one matrix-unit strip) larger than a chiplet's SRAM.
The fixes offered are the ones that would work: a smaller format (with its size), streaming,
or the number of cards (`--cards N`) that would hold the weights.
"""

from __future__ import annotations

import math

from aviatorc.errors import InfeasibleError
from aviatorc.formats import WeightFormat
from aviatorc.partition.tiling import WeightSpec, tile_weight
from aviatorc.target import Target


def human_bytes(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def explain_infeasible(weights: list[WeightSpec], target: Target, *, streaming: bool = True) -> None:
    """Raise `InfeasibleError` naming what does not fit, by how much, and what would fix it."""
    where = target.source
    unsupported = sorted({w.format.kind for w in weights} - set(target.weight_formats))
    if unsupported:
        first = next(w for w in weights if w.format.kind in unsupported)
        raise InfeasibleError(
            f"target '{target.name}' does not support weight format(s) {', '.join(unsupported)} "
            f"(first: '{first.name}')", file=where, needed=unsupported,
            hint=f"quantize to one of {', '.join(target.weight_formats)}")
    if not weights:
        return
    needed = sum(w.storage_bytes for w in weights)
    usable = target.usable_sram_bytes_total
    per_card = target.usable_sram_bytes_per_chiplet * target.chiplets_per_card

    # The smallest tile a weight can have is one matrix-unit strip; it must fit one chiplet.
    cap = target.usable_sram_bytes_per_chiplet
    largest = max(weights, key=lambda w: _min_tile_bytes(w, target))
    smallest_tile = _min_tile_bytes(largest, target)
    if smallest_tile > cap:
        raise InfeasibleError(
            f"weight '{largest.name}' cannot be split below {human_bytes(smallest_tile)} per tile (one "
            f"{target.matrix_unit_n}-wide strip) but a chiplet has {human_bytes(cap)} usable SRAM",
            file=where, needed_bytes=smallest_tile, available_bytes=cap,
            hint="use a smaller format (int4) or a target with more SRAM per chiplet")

    fixes = _fixes(weights, target, needed, per_card)
    if not streaming and needed > usable:
        raise InfeasibleError(
            f"weights need {human_bytes(needed)} but {target.num_chiplets} chiplets x "
            f"{human_bytes(target.usable_sram_bytes_per_chiplet)} usable SRAM = {human_bytes(usable)} "
            f"(after a {target.activation_reserve_fraction:.0%} activation/KV reserve)",
            file=where, needed_bytes=needed, available_bytes=usable,
            hint="; ".join(["enable streaming from LPDDR"] + fixes))
    lpddr = target.lpddr_bytes_total
    if streaming and needed > usable + lpddr:
        cards = math.ceil(needed / (per_card + target.lpddr_bytes_per_card))
        raise InfeasibleError(
            f"weights need {human_bytes(needed)} but SRAM and LPDDR of {target.cards} card(s) hold "
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
