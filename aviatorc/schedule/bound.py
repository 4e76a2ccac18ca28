"""The physical bound a plan is measured against (see this module: what it counts and what it leaves out).

Computed from the weights, the KV cache size and the target alone: nothing here reads a
program, a placement or the simulator. Per decode step, with W weight bytes read, KV cache
bytes read, S the SRAM of the chiplets the model may use, spread over n cards:

    LPDDR bytes >= max(0, W + KV - S)
    t_token >= max(LPDDR bytes / (n BW_lpddr), (W + KV) / (C BW_sram_chiplet), FLOPs / (C peak))
    t_TTFT  >= max(prefill FLOPs / (C peak), (W_all - S)+ / (n BW_lpddr))
    t_cold  >= total weight bytes / (n BW_pcie)

C is the number of chiplets and peak the chiplet's peak for each weight's format (a mixed
model adds its formats' times). An embedding lookup reads one row per token, so W counts
`batch` rows of it; every other weight is read whole.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from aviatorc.partition.tiling import WeightSpec
from aviatorc.plan.ir import Workload
from aviatorc.target import Target


@dataclass(frozen=True)
class Bound:
    token_s: float
    ttft_s: float
    cold_s: float
    terms: dict[str, float]  # each term of the token bound, for the report

    def to_dict(self) -> dict[str, float]:
        return {"token_s": self.token_s, "ttft_s": self.ttft_s, "cold_s": self.cold_s,
                **{f"token_{k}_s": v for k, v in sorted(self.terms.items())}}


def physical_bound(weights: Sequence[WeightSpec], target: Target, workload: Workload, *, kv_bytes: int,
                   q_width_total: int, chiplets: Sequence[int]) -> Bound:
    """`kv_bytes`: the whole cache at the workload's batch and context; `q_width_total`: the sum
    over layers of heads x head dim (attention reads K and V once per query head group)."""
    count = len(chiplets)
    cards = len({target.card_of(c) for c in chiplets})
    sram = target.chiplet.sram_bytes * count
    stored = [w for w in weights if w.storage_bytes > 0]
    b, t, p = workload.batch, workload.context, workload.prompt

    def read_bytes(w: WeightSpec, tokens: int) -> float:
        return min(w.storage_bytes, w.storage_bytes * tokens / w.k) if w.is_embedding else w.storage_bytes

    def matrix_s(tokens: int) -> float:
        seconds = sum(0.0 if w.is_embedding else 2.0 * tokens * w.k * w.n / target.flops_per_s(w.format.kind)
                      for w in stored)
        return seconds / count

    attention_decode_s = 4.0 * b * t * q_width_total / target.flops_per_s("fp16") / count
    weight_read = sum(read_bytes(w, b) for w in stored)
    terms = {
        "lpddr": max(0.0, weight_read + kv_bytes - sram) / (cards * target.lpddr_bytes_per_s_per_card),
        "sram": (weight_read + kv_bytes) / (count * target.chiplet.sram_bytes_per_s),
        "compute": matrix_s(b) + attention_decode_s,
    }
    prefill_tokens = b * p
    attention_prefill_s = 2.0 * b * p * p * q_width_total / target.flops_per_s("fp16") / count
    all_bytes = sum(w.storage_bytes for w in stored)
    ttft = max(matrix_s(prefill_tokens) + attention_prefill_s,
               max(0.0, all_bytes - sram) / (cards * target.lpddr_bytes_per_s_per_card))
    cold = all_bytes / (cards * target.pcie_bytes_per_s_per_card)
    return Bound(max(terms.values()), ttft, cold, terms)


def tokens_per_s(batch: int, step_s: float) -> float:
    return batch / step_s if step_s > 0 else math.inf
