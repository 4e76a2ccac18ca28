"""The physical bound a plan is measured against (see this module: what it counts and what it leaves out).

Computed from the model's bytes, FLOPs and activation sizes (`BoundInputs`) and the target
alone: nothing here reads a program, a placement or the simulator, so efficiency = bound /
simulated is a measurement. It holds in every regime, streaming or SRAM-resident.

A plan may compute on any number k of the cards its chiplets span. On k cards it has n_k
chiplets and S_k bytes of SRAM; it may stream from every LPDDR channel m of its chiplets (a
channel on a card that computes nothing still reaches the others over links). Per decode step,
with W weight bytes read (an embedding: the rows the batch looks up; with a routing, an expert:
its bytes times the probability the step's tokens fire it, its FLOPs on its share), KV the cache:

    lpddr    = (bytes left to stream once S_k bytes are resident, densest first) / (m BW_channel)
    sram     = (W + KV) / (n_k BW_sram)
    compute  = FLOPs / (n_k peak of each weight's format)   (+ attention at the KV cache's format)
    vector   = activation bytes through the vector units / (n_k BW_vector)
    latency  = layers x the target's per-layer latency      (additive per layer: target file)
               + (k - 1) card crossings of the activation    (each: message + bytes / BW + latency)
               + the host: the logits over PCIe, two PCIe crossings, the host's per-token work
    t_token >= min over k of max(those terms)

With LoRA adapters reserved (`workload.lora_rank`, `max_loras`), each projection an adapter may
reach adds its low-rank products (2 x tokens x r x (k + n) FLOPs at fp16) to `compute`, and the
adapters' A and B of as many adapters as the step's sequences can run (r x (k + n) x 2 bytes
each) to the bytes read, an item of the knapsack like any weight.

The TTFT bound is the same over the prefill's tokens: the prompt's embedding rows (not the
table) and every other weight once, all prompt FLOPs, the prompt's vector bytes. The cold start:
all weight bytes over min(cards x PCIe, storage). `Bound` keeps each term at the best k, so the
report can say which one binds. Left out (so the bound stays below any plan): the KV write-back,
link crossings inside a card, and any wait between layers beyond their fixed latency.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from aviatorc.partition.tiling import WeightSpec, lora_reachable
from aviatorc.plan.ir import Workload
from aviatorc.plan.plan import BoundFigures
from aviatorc.routing import Routing
from aviatorc.target import Target


@dataclass(frozen=True)
class BoundInputs:
    """What the bound reads off the model (`aviatorc.schedule.model.ModelFacts` has it all)."""

    kv_bytes: int  # the whole cache at the workload's batch and the positions each sequence holds
    kv_tokens: int  # the positions each sequence holds, which a decode step attends to
    q_width_total: int  # sum over layers of heads x head dim (attention reads K and V per query head group)
    layers: int  # transformer layers (with attention): each pays the per-layer latency
    attention_kind: str  # the format attention runs at (the KV cache's: "fp16" or "int8")
    vector_bytes_per_token: float  # activation bytes a token moves through the vector units
    handoff_bytes_per_token: float  # the activation one layer hands to the next
    output_bytes_per_token: float  # the logits of one token


def physical_bound(weights: Sequence[WeightSpec], target: Target, workload: Workload, model: BoundInputs, *,
                   chiplets: Sequence[int], routing: Routing | None = None) -> BoundFigures:
    """With `routing`, a mixture of experts' bound is in expectation over routings: an expert's
    bytes weighted by the probability that a step's tokens fire it, its FLOPs by its routed share
    (every term is convex in the bytes and FLOPs, so this is below the expected time of any plan)."""
    b, p = workload.batch, workload.prompt
    stored = [w for w in weights if w.storage_bytes > 0]
    cards = _cards_by_size(target, chiplets)
    channels = len({target.channel_of(c) for c in chiplets})
    lpddr_s_per_byte = 1.0 / (channels * target.channel_bytes_per_s)

    def read_bytes(w: WeightSpec, tokens: int) -> float:
        if w.is_embedding:
            return min(w.storage_bytes, w.storage_bytes * tokens / w.k)
        return w.storage_bytes * (routing.fires(w.layer, w.expert, tokens) if routing is not None else 1.0)

    def share(w: WeightSpec) -> float:
        return routing.share(w.layer, w.expert) if routing is not None else 1.0

    adapted = [w for w in stored if lora_reachable(w)] if workload.lora_rank and workload.max_loras else []
    lora_width = workload.lora_rank * sum(w.k + w.n for w in adapted)  # r x (k + n) summed over the projections

    def matrix_flop_s(tokens: int) -> float:  # on one chiplet
        return sum(0.0 if w.is_embedding else 2.0 * tokens * share(w) * w.k * w.n / target.flops_per_s(w.format.kind)
                   for w in stored) + 2.0 * tokens * lora_width / target.flops_per_s("fp16")

    def host_s(tokens: int) -> float:
        return (model.output_bytes_per_token * tokens / target.pcie_bytes_per_s_per_card
                + 2 * target.pcie_latency_s + target.host.per_token_s)

    def crossing_s(tokens: int) -> float:
        return target.links[2].transfer_s(model.handoff_bytes_per_token * tokens)

    def streamed(items: list[tuple[float, float]], sram: float) -> float:
        """The fewest bytes a step streams with `sram` bytes resident: (read, stored) items kept
        most read per stored byte first (the fractional knapsack; a cold expert or an embedding
        table saves less than its size when resident)."""
        left = sram
        total = 0.0
        for read, size in sorted(items, key=lambda item: -item[0] / item[1]):
            kept = min(size, max(0.0, left))
            left -= kept
            total += read * (1.0 - kept / size)
        return total

    def terms(k: int, tokens: int, outputs: int, items: list[tuple[float, float]], kv_bytes: float,
              attention_flops: float) -> dict[str, float]:
        n = sum(cards[:k])
        sram = target.chiplet.sram_bytes * n
        weight_bytes = sum(read for read, _ in items)
        return {
            "lpddr": streamed(items + ([(kv_bytes, kv_bytes)] if kv_bytes else []), sram) * lpddr_s_per_byte,
            "sram": (weight_bytes + kv_bytes) / (n * target.chiplet.sram_bytes_per_s),
            "compute": (matrix_flop_s(tokens) + attention_flops / target.flops_per_s(model.attention_kind)) / n,
            "vector": model.vector_bytes_per_token * tokens / (n * target.chiplet.vector_bytes_per_s),
            "latency": model.layers * target.per_layer_latency_s + (k - 1) * crossing_s(tokens) + host_s(outputs),
        }

    def best(make: dict[int, dict[str, float]]) -> tuple[float, dict[str, float], int]:
        k = min(make, key=lambda k: (max(make[k].values()), k))
        return max(make[k].values()), make[k], k

    def items(tokens: int) -> list[tuple[float, float]]:
        adapters = [(2.0 * lora_width * min(workload.batch, workload.max_loras),
                     2.0 * lora_width * workload.max_loras)] if lora_width else []
        return [(read_bytes(w, tokens), float(w.storage_bytes)) for w in stored] + adapters

    t = workload.tokens("decode")  # each sequence's cache is read once for all the positions it brings
    decode = {k: terms(k, t, workload.outputs(), items(t), model.kv_bytes, 4.0 * t * model.kv_tokens * model.q_width_total)
              for k in range(1, len(cards) + 1)}
    prefill = {k: terms(k, b * p, b, items(b * p), 0.0, 2.0 * b * p * p * model.q_width_total)
               for k in range(1, len(cards) + 1)}
    token_s, token_terms, k_token = best(decode)
    ttft_s, ttft_terms, _ = best(prefill)
    total = sum(w.storage_bytes for w in stored)
    cold = total / min(len(cards) * target.pcie_bytes_per_s_per_card, target.host.storage_bytes_per_s)
    return BoundFigures(token_s, ttft_s, cold, token_terms, ttft_terms, k_token)


def _cards_by_size(target: Target, chiplets: Sequence[int]) -> list[int]:
    """Allowed chiplets per card, largest first (a plan on k cards takes the k fullest)."""
    per_card: dict[int, int] = {}
    for c in chiplets:
        per_card[target.card_of(c)] = per_card.get(target.card_of(c), 0) + 1
    return sorted(per_card.values(), reverse=True)


def tokens_per_s(batch: int, step_s: float) -> float:
    return batch / step_s if step_s > 0 else math.inf
