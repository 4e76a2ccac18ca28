"""Cold start: copying the weights from the host onto the cards, and when the first token comes.

Each card receives its tiles over its own PCIe link (resident tiles into SRAM, streamed ones
into LPDDR), one after another. Layer L's prefill can start once every tile of layer L is on
its card and layer L - 1 has finished, so

    finish(L) = max(finish(L - 1), arrival(L)) + prefill_s(L)

and the first token comes at finish(last layer). Loading in first-use order (embedding, then
layers in order, the head last) lets the prefill of early layers overlap the copy of later
ones; the naive order (tensors by name, as a file lists them) delivers the first layers late.
prefill_s(L) is the predicted prefill time shared out by the layers' FLOPs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from aviatorc.partition.placement import Placement
from aviatorc.target import Target


@dataclass(frozen=True)
class ColdStart:
    order: tuple[int, ...]  # tile indices in load order (first use first)
    first_token_s: float  # with that order
    naive_first_token_s: float  # tensors in name order
    load_s: float  # until the last byte is on the cards

    def to_dict(self) -> dict[str, object]:
        return {"order": [f"t{t}" for t in self.order], "first_token_s": self.first_token_s,
                "naive_first_token_s": self.naive_first_token_s, "load_s": self.load_s}


def cold_start(placement: Placement, target: Target, prefill_s: float, flops_by_layer: dict[int, float]) -> ColdStart:
    tiles = placement.tiles
    first_use = sorted(range(len(tiles)), key=lambda t: (tiles[t].layer, t))
    by_name = sorted(range(len(tiles)), key=lambda t: (tiles[t].weight, tiles[t].n_start, tiles[t].k_start))
    layers = sorted({t.layer for t in tiles})
    total_flops = sum(flops_by_layer.get(layer, 0.0) for layer in layers) or 1.0
    share = {layer: prefill_s * flops_by_layer.get(layer, 0.0) / total_flops for layer in layers}
    first, load_s = _first_token(placement, target, first_use, layers, share)
    naive, _ = _first_token(placement, target, by_name, layers, share)
    return ColdStart(tuple(first_use), first, naive, load_s)


def _card(placement: Placement, target: Target, t: int) -> int:
    w = placement.where[t]
    return target.card_of(w) if w < placement.num_chiplets else w - placement.num_chiplets


def _first_token(placement: Placement, target: Target, order: Sequence[int], layers: list[int],
                 share: dict[int, float]) -> tuple[float, float]:
    clock = [0.0] * target.cards
    arrival: dict[int, float] = {}
    for t in order:
        card = _card(placement, target, t)
        clock[card] += placement.tiles[t].storage_bytes / target.pcie_bytes_per_s_per_card
        layer = placement.tiles[t].layer
        arrival[layer] = max(arrival.get(layer, 0.0), clock[card])
    finish = 0.0
    for layer in layers:
        finish = max(finish, arrival.get(layer, 0.0)) + share[layer]
    return finish, max(clock)
