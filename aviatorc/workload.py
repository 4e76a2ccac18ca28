"""Bounds of the workload options (`--batch`, `--context`, `--prompt`), checked before a plan is
built, each refusal with the numbers behind it.

- From the model: a decoder's context is at most the positions it was trained for
  (`max_position_embeddings`, kept in the graph's metadata by the frontends that know it), and
  at least its prompt (the prompt is the first tokens of the context).
- From the target: the KV cache (batch x context tokens of every layer's K and V) and the
  weights must fit in the machine's memory, SRAM and LPDDR together.
- From this computer: a KV cache in LPDDR is streamed chunk by chunk each decode step, and each
  chunk is a handful of instructions in the plan, so a huge context makes a plan too large to
  build. `estimate_plan` counts them before building; past `MAX_PLAN_INSTRUCTIONS` the compile
  is refused with the estimate, instead of running for minutes and filling the memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from aviatorc.errors import InfeasibleError, OptionError
from aviatorc.ir import Graph

MAX_POSITIONS_KEY = "max_position_embeddings"  # graph metadata: the positions a decoder was trained for
# Measured on `compile` (the tiny zoo Llama, KV cache in LPDDR, context 5M): 799k instructions
# took 2.3 GB of peak memory and 97 s; 2.9 KB each, rounded up.
HOST_BYTES_PER_INSTRUCTION = 3 * 1024
INSTRUCTIONS_PER_KV_CHUNK = 6  # load, wait, compute, free, and a send / recv pair: counted on the same plans
MAX_PLAN_INSTRUCTIONS = 2_000_000  # about 6 GiB to build


def check_model_bounds(graph: Graph, *, context: int, prompt: int, decoder: bool) -> None:
    """Context against the model: at most its trained positions (when the graph says), and for a
    decoder (a graph with a KV cache) at least the prompt it starts with."""
    limit = graph.metadata.get(MAX_POSITIONS_KEY)
    if limit is not None and context > int(limit):
        raise OptionError(f"context (--context) {context:,} is more than the {int(limit):,} positions model "
                          f"'{graph.name}' was trained for (its max_position_embeddings)",
                          hint=f"choose a context of at most {int(limit):,}")
    if decoder and prompt > context:
        raise OptionError(f"prompt (--prompt) {prompt:,} is longer than the context (--context) {context:,} that "
                          "holds it", hint=f"choose a context of at least {prompt:,}, or a shorter prompt")


@dataclass(frozen=True)
class PlanEstimate:
    """What a plan will need, from the memory plan alone (before it is built)."""

    kv_bytes: int
    kv_location: str
    weight_bytes: int
    instructions: int  # of the streamed KV cache, the part that grows with the context

    @property
    def host_bytes(self) -> int:
        return self.instructions * HOST_BYTES_PER_INSTRUCTION


def estimate_plan(memory: Any, weight_bytes: int) -> PlanEstimate:
    """The estimate for a `MemoryPlan` (`aviatorc.schedule.memory`) and the weights' stored bytes."""
    kv = memory.kv
    chunks = math.ceil(kv.total_bytes / kv.chunk_bytes) if kv.location == "lpddr" and kv.chunk_bytes else 0
    return PlanEstimate(kv.total_bytes, kv.location, weight_bytes, chunks * INSTRUCTIONS_PER_KV_CHUNK)


def check_plan_bounds(estimate: PlanEstimate, target: Any, *, batch: int, context: int) -> None:
    """The KV cache and weights against the machine's memory, and the plan against this computer's."""
    capacity = target.sram_bytes_total + target.lpddr_bytes_total
    needed = estimate.kv_bytes + estimate.weight_bytes
    if needed > capacity:
        raise InfeasibleError(
            f"batch {batch} x context {context:,} needs a KV cache of {_gib(estimate.kv_bytes)}, which with "
            f"{_gib(estimate.weight_bytes)} of weights is more than the {_gib(capacity)} of SRAM and LPDDR on "
            f"{target.name} ({target.cards} card(s))",
            hint=f"choose a context of at most {_fitting_context(estimate, capacity, context):,}, a smaller batch, "
                 "an INT8 KV cache (--kv-dtype int8), or more cards")
    if estimate.instructions > MAX_PLAN_INSTRUCTIONS:
        raise InfeasibleError(
            f"a context of {context:,} streams a KV cache of {_gib(estimate.kv_bytes)} from LPDDR in about "
            f"{estimate.instructions:,} instructions per decode step: building that plan would take about "
            f"{_gib(estimate.host_bytes)} of memory on this computer (the most planned here is "
            f"{MAX_PLAN_INSTRUCTIONS:,} instructions)",
            hint=f"choose a context of at most {context * MAX_PLAN_INSTRUCTIONS // estimate.instructions:,}, "
                 "or a smaller batch")


def _fitting_context(estimate: PlanEstimate, capacity: int, context: int) -> int:
    per_token = estimate.kv_bytes / context if context else 0
    room = capacity - estimate.weight_bytes
    return max(0, int(room // per_token)) if per_token else context


def _gib(nbytes: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{int(nbytes)} bytes"
