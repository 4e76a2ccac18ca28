"""Cold start: copying the weights from the host onto the cards, and when the first token comes.

Each card receives its tiles over its own PCIe link (resident tiles into SRAM, streamed ones
into LPDDR), one after another, all of them read from the host's storage: a card's rate is its
PCIe bandwidth or its share of the storage's, whichever is less. Layer L's prefill can start once
every tile of layer L is on its card and layer L - 1 has finished, so

    finish(L) = max(finish(L - 1), arrival(L)) + prefill_s(L)

and the first token comes at finish(last layer). Loading in first-use order (embedding, then
layers in order, the head last) lets the prefill of early layers overlap the copy of later
ones; the naive order (tensors by name, as a file lists them) delivers the first layers late.
prefill_s(L) is the predicted prefill time shared out by the layers' FLOPs.
"""

from __future__ import annotations

from collections.abc import Sequence

from aviatorc.partition.placement import Placement
from aviatorc.plan.plan import ColdStartOrder
from aviatorc.target import Target


def cold_start(placement: Placement, target: Target, prefill_s: float, flops_by_layer: dict[int, float]
               ) -> ColdStartOrder:
    tiles = placement.tiles
    first_use = sorted(range(len(tiles)), key=lambda t: (tiles[t].layer, t))
    by_name = sorted(range(len(tiles)), key=lambda t: (tiles[t].weight, tiles[t].n_start, tiles[t].k_start))
    layers = sorted({t.layer for t in tiles})
    total_flops = sum(flops_by_layer.get(layer, 0.0) for layer in layers) or 1.0
    share = {layer: prefill_s * flops_by_layer.get(layer, 0.0) / total_flops for layer in layers}
    first, load_s = _first_token(placement, target, first_use, layers, share)
    naive, _ = _first_token(placement, target, by_name, layers, share)
    return ColdStartOrder(tuple(first_use), first, naive, load_s)


def _card(placement: Placement, target: Target, t: int) -> int:
    w = placement.where[t]
    return target.card_of(w) if w < placement.num_chiplets else target.card_of_channel(w - placement.num_chiplets)


def _first_token(placement: Placement, target: Target, order: Sequence[int], layers: list[int],
                 share: dict[int, float]) -> tuple[float, float]:
    clock = [0.0] * target.cards
    arrival: dict[int, float] = {}
    loading = len({_card(placement, target, t) for t in order}) or 1
    rate = min(target.pcie_bytes_per_s_per_card, target.host.storage_bytes_per_s / loading)
    for t in order:
        card = _card(placement, target, t)
        clock[card] += placement.tiles[t].storage_bytes / rate
        layer = placement.tiles[t].layer
        arrival[layer] = max(arrival.get(layer, 0.0), clock[card])
    finish = 0.0
    for layer in layers:
        finish = max(finish, arrival.get(layer, 0.0)) + share[layer]
    return finish, max(clock)
