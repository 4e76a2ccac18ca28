"""The scheduler, its simulation, and the physical bound: a placement becomes a plan.

    memory = plan_memory(model_facts(graph, tiles), tiles, target, workload, chiplets=allowed)
    placement = partition(weights, target, reserve_bytes=memory.reserve_bytes, chiplets=allowed)
    plan = schedule(graph, placement, weights, target, workload, memory)
    plan.prediction["decode"]["time_per_token_s"], plan.prediction["efficiency"]

Stages: the model's facts (`model.py`), SRAM sizing before partitioning (`memory.py`), one
program per phase (`build.py`), its discrete-event simulation (`simulate.py`), the cold start
(`cold.py`) and the bound (`bound.py`), computed apart from the simulation.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from aviatorc.errors import InfeasibleError
from aviatorc.ir import Graph
from aviatorc.partition.placement import Placement
from aviatorc.partition.tiling import WeightSpec
from aviatorc.plan.ir import Program, Workload
from aviatorc.plan.plan import Plan
from aviatorc.progress import stage
from aviatorc.schedule.bound import Bound, physical_bound
from aviatorc.schedule.build import build_program
from aviatorc.schedule.cold import cold_start
from aviatorc.schedule.memory import MemoryPlan, plan_memory
from aviatorc.schedule.model import ModelFacts, model_facts
from aviatorc.schedule.simulate import SimulationError, Timeline, simulate
from aviatorc.target import Target

__all__ = ["MemoryPlan", "ModelFacts", "Plan", "SimulationError", "Timeline", "Workload", "model_facts",
           "plan_memory", "schedule", "simulate"]

_logger = logging.getLogger("aviatorc.schedule")

SWEEP_BATCHES = (1, 4, 16, 64)
SWEEP_CONTEXTS = (512, 2048, 8192, 32768)


def schedule(graph: Graph, placement: Placement, weights: Sequence[WeightSpec], target: Target, workload: Workload,
             memory: MemoryPlan, *, facts: ModelFacts | None = None, chiplets: Sequence[int] | None = None,
             prefetch: bool = True, sweep: bool = True, target_sha256: str = "") -> Plan:
    """Build the decode and prefill programs, simulate them, and judge them against the bound."""
    facts = facts or model_facts(graph, placement.tiles)
    allowed = tuple(sorted(chiplets if chiplets is not None else range(target.num_chiplets)))
    programs = {phase: build_program(facts, placement, target, memory, workload, phase, chiplets=allowed,
                                     prefetch=prefetch) for phase in ("decode", "prefill")}
    with stage(_logger, "simulating decode and prefill"):
        decode = simulate(programs["decode"], target)  # recorded: the artifact's trace.json
        prefill = simulate(programs["prefill"], target, record=False)
    chunks = math.ceil(workload.tokens("prefill") / memory.prefill_chunk_tokens)
    ttft = prefill.makespan_s * chunks
    bound = _bound(weights, target, workload, memory, facts, allowed)
    cold = cold_start(placement, target, ttft, _flops_by_layer(programs["prefill"], facts))
    prediction = {
        "decode": _phase_figures(decode, workload.batch),
        "prefill": {"chunk_s": prefill.makespan_s, "chunks": chunks, "chunk_tokens": memory.prefill_chunk_tokens,
                    **prefill.summary()},
        "ttft_s": ttft,
        "time_per_token_s": decode.makespan_s,
        "tokens_per_s": workload.batch / decode.makespan_s if decode.makespan_s else 0.0,
        "cold_start_s": cold.first_token_s,
        "cold_start_naive_order_s": cold.naive_first_token_s,
        "bound": bound.to_dict(),
        "efficiency": bound.token_s / decode.makespan_s if decode.makespan_s else 0.0,
        "ttft_efficiency": bound.ttft_s / ttft if ttft else 0.0,
        "sram_peak_bytes": {str(c): b for c, b in sorted(decode.peak_sram_bytes().items())},
    }
    if sweep:
        prediction["sweep"] = _sweep(facts, placement, weights, target, workload, memory, allowed, prefetch)
    notes = ["costs modelled: matrix units per format, SRAM and LPDDR bandwidth, links, per-layer latency; "
             "vector ops (norms, elementwise) are folded into the per-layer latency",
             "KV writes of the new tokens and prefill's KV write-back to LPDDR are not charged"]
    if not facts.kv_width:
        notes.append("no k/v projections recognized: the KV cache is not modelled")
    return Plan(target.name, target_sha256, placement, workload, allowed, programs, memory.describe(), prediction,
                cold.to_dict(), prefetch, notes, decode, target)


def _phase_figures(timeline: Timeline, batch: int) -> dict[str, float]:
    return {"step_s": timeline.makespan_s, "tokens_per_s": batch / timeline.makespan_s if timeline.makespan_s else 0.0,
            **timeline.summary()}


def _bound(weights: Sequence[WeightSpec], target: Target, workload: Workload, memory: MemoryPlan, facts: ModelFacts,
           allowed: Sequence[int]) -> Bound:
    q_total = sum(facts.q_width.get(layer, facts.kv_width.get(layer, 0)) for layer in facts.attention.values())
    return physical_bound(weights, target, workload, kv_bytes=memory.kv.total_bytes, q_width_total=q_total,
                          chiplets=allowed)


def _flops_by_layer(program: Program, facts: ModelFacts) -> dict[int, float]:
    out: dict[int, float] = {}
    for _, _, ins in program.instructions():
        if ins.op == "compute":
            layer = facts.layer_of_node.get(ins["node"], -1)
            out[layer] = out.get(layer, 0.0) + ins["flops"]
    return out


def _sweep(facts: ModelFacts, placement: Placement, weights: Sequence[WeightSpec], target: Target,
           workload: Workload, memory: MemoryPlan, allowed: Sequence[int], prefetch: bool) -> list[dict[str, object]]:
    """Time per token over batch (at the compiled context) and context (at the compiled batch), on
    this placement: a point whose KV cache outgrows the SRAM the compile reserved streams it."""
    points = sorted({(b, workload.context) for b in SWEEP_BATCHES} | {(workload.batch, t) for t in SWEEP_CONTEXTS})
    out = []
    with stage(_logger, "simulating the batch and context sweep", total=len(points)) as task:
        for batch, context in points:
            out.append(_sweep_point(facts, placement, weights, target, Workload(batch, context, workload.prompt),
                                    memory, allowed, prefetch))
            task.advance()
    return out


def _sweep_point(facts: ModelFacts, placement: Placement, weights: Sequence[WeightSpec], target: Target,
                 load: Workload, memory: MemoryPlan, allowed: Sequence[int], prefetch: bool) -> dict[str, object]:
    batch, context = load.batch, load.context
    try:
        trial = plan_memory(facts, placement.tiles, target, load, chiplets=allowed, kv="lpddr",
                            kv_dtype=memory.kv.dtype)
    except InfeasibleError as error:  # this point's activations or staging do not fit beside the weights
        return {"batch": batch, "context": context, "fits": False, "reason": error.message}
    if any(t > m for t, m in zip(trial.reserve_bytes, memory.reserve_bytes, strict=True)):
        return {"batch": batch, "context": context, "fits": False,
                "reason": "needs more SRAM beside the weights than this compile reserved"}
    if memory.kv.location == "sram" and trial.kv.total_bytes <= memory.kv.total_bytes:
        trial = plan_memory(facts, placement.tiles, target, load, chiplets=allowed, kv="sram",
                            kv_dtype=memory.kv.dtype)
    program = build_program(facts, placement, target, trial, load, "decode", chiplets=allowed, prefetch=prefetch)
    step = simulate(program, target, record=False).makespan_s
    bound = _bound(weights, target, load, trial, facts, allowed)
    return {"batch": batch, "context": context, "fits": True, "kv_location": trial.kv.location,
            "time_per_token_s": step,
            "tokens_per_s": batch / step if step else 0.0, "bound_s": bound.token_s,
            "efficiency": bound.token_s / step if step else 0.0}
