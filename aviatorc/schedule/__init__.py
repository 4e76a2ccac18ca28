"""The scheduler, its simulation, and the physical bound: a placement becomes a plan.

    memory = plan_memory(model_facts(graph, tiles), tiles, target, workload, chiplets=allowed)
    placement = partition(weights, target, reserve_bytes=memory.reserve_bytes, chiplets=allowed,
                          homes=memory.kv.chiplet_of_layer)
    plan = schedule(graph, placement, weights, target, workload, memory)
    plan.prediction.time_per_token_s, plan.prediction.efficiency, plan.prediction.ranges

Stages: the model's facts (`model.py`), SRAM sizing before partitioning (`memory.py`), one
program per phase (`build.py`), its discrete-event simulation (`simulate.py`), the cold start
(`cold.py`), the bound (`bound.py`, computed apart from the simulation) and the ranges the
target's assumed figures span (`ranges.py`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence

from aviatorc.errors import InfeasibleError
from aviatorc.ir import Graph
from aviatorc.partition.placement import Placement
from aviatorc.partition.tiling import WeightSpec
from aviatorc.plan.ir import Compute, Program, Workload
from aviatorc.plan.plan import BoundFigures, PhaseFigures, Plan, PlannedTile, Prediction, SweepPoint
from aviatorc.progress import stage
from aviatorc.routing import Routing
from aviatorc.schedule.bound import BoundInputs, physical_bound
from aviatorc.schedule.build import build_program
from aviatorc.schedule.cold import cold_start
from aviatorc.schedule.forked import forked_map
from aviatorc.schedule.memory import (
    MemoryPlan,
    plan_memory,
    prefill_copies,
    settle_kv,
    with_prefill_copies,
)
from aviatorc.schedule.model import ModelFacts, model_facts
from aviatorc.schedule.ranges import figure_ranges
from aviatorc.schedule.routed import expert_members, predicted_steps, prefill_activity, routed_steps
from aviatorc.schedule.simulate import NO_ACTIVITY, Activity, SimulationError, Timeline, simulate
from aviatorc.schedule.trace import chrome_trace
from aviatorc.target import Target

__all__ = ["MemoryPlan", "ModelFacts", "Plan", "SimulationError", "Timeline", "Workload", "bound_inputs",
           "model_facts", "plan_memory", "planned_tiles", "schedule", "simulate"]

_logger = logging.getLogger("aviatorc.schedule")

SWEEP_BATCHES = (1, 4, 16, 64)
SWEEP_CONTEXTS = (512, 2048, 8192, 32768)
PREFETCH_HIT_RATES = (0.5, 0.8, 1.0)  # a predictor's hit rates the prefetching step is timed at
PREFETCH_SAMPLES = 16  # routings per hit rate (the first of those the routed step is timed on)
VERIFY_DRAFTS = (1, 2, 4, 8)  # drafted tokens per sequence the verify steps are timed at (speculative decoding)
MIXED_CHUNKS = (16, 64, 256)  # prompt tokens a decode step also prefills, the mixed steps timed (chunked prefill)
SWEEP_ROUTING_SAMPLES = 8  # routings per sweep point of a mixture of experts (the plan's own step: ROUTING_SAMPLES)
NOTES = ("costs modelled: matrix units per format, vector units, SRAM, LPDDR channels, links with their "
         "message overheads, the per-layer latency, KV writes, the host's per-token round trip",)
PREFILL_NOTES = {
    "stationary": "a weight-stationary prefill runs in passes over the prompt, each streaming the weights once "
                  "(its token blocks run through a layer while the layer's streamed tiles stay staged): TTFT is "
                  "passes x one pass's time",
    "pipelined": "a pipelined prefill runs in passes over the prompt, each streaming the weights once, each layer "
                 "on its home's card (reading its streamed tiles from a copy in that card's LPDDR), the cards in "
                 "turn: TTFT is passes x one pass's time",
    "chunked": "a chunked prefill runs in chunks, each streaming the weights again: TTFT is chunks x one chunk's time",
}


def schedule(graph: Graph, placement: Placement, weights: Sequence[WeightSpec], target: Target, workload: Workload,
             memory: MemoryPlan, *, facts: ModelFacts | None = None, chiplets: Sequence[int] | None = None,
             prefetch: bool = True, sweep: bool = True, ranges: bool = True, max_context: int | None = None,
             target_sha256: str = "", routing: Routing | None = None) -> Plan:
    """Build the decode and prefill programs, simulate them, and judge them against the bound. The
    sweep leaves out contexts beyond `max_context` (the positions the model was trained for).
    `routing`: a mixture of experts' routing (`aviatorc.routing`); its decode step is then the mean
    over sampled routings (`routed.py`), and the bound is in expectation."""
    facts = facts or model_facts(graph, placement.tiles)
    allowed = tuple(sorted(chiplets if chiplets is not None else range(target.num_chiplets)))
    memory = settle_kv(memory, placement, facts, target, allowed, workload.tokens("decode"))
    memory = dataclasses.replace(memory, prefill_copies=prefill_copies(placement, memory, target, allowed))
    routing = routing if routing is not None and routing.blocks else None
    placed = {"decode": placement, "prefill": with_prefill_copies(placement, memory.prefill_copies, target)}
    programs = {phase: build_program(facts, placed[phase], target, memory, workload, phase, chiplets=allowed,
                                     prefetch=prefetch, routed=routing is not None) for phase in ("decode", "prefill")}
    activities: dict[str, Activity] = {}
    routed = None
    with stage(_logger, "simulating decode and prefill"):
        if routing is not None:
            members = expert_members(graph, routing, programs["decode"], placement,
                                     staging_bytes=memory.staging_bytes if prefetch else 0)
            every = simulate(programs["decode"], target, record=False).makespan_s
            routed, activities["decode"] = routed_steps(programs["decode"], target, members, routing,
                                                        workload.tokens("decode"), all_experts_s=every)
            activities["prefill"] = prefill_activity(members, routing)
            if any(t.expert >= 0 and w >= placement.num_chiplets for t, w in zip(placement.tiles, placement.where,
                                                                                strict=True)):
                routed = dataclasses.replace(routed, prefetch=_prefetch(graph, facts, placement, target, memory,
                                                                          workload, allowed, routing))
        # recorded: the artifact's trace.json (a mixture of experts: its median routing's step)
        decode = simulate(programs["decode"], target, activity=activities.get("decode", NO_ACTIVITY))
        prefill = simulate(programs["prefill"], target, record=False, activity=activities.get("prefill", NO_ACTIVITY))
    step_s = routed.mean_s if routed is not None else decode.makespan_s
    chunks = math.ceil(workload.tokens("prefill") / memory.prefill_chunk_tokens)
    ttft = prefill.makespan_s * chunks
    inputs = bound_inputs(facts, weights, target, memory)
    bound = physical_bound(weights, target, workload, inputs, chiplets=allowed, routing=routing)
    flops = _flops_by_layer(programs["prefill"], facts)
    cold = cold_start(placement, target, ttft, flops)
    spans = {}
    swept = _sweep(facts, placement, weights, target, workload, memory, allowed, prefetch, max_context, graph,
                   routing) if sweep else None
    if ranges and target.assumed:
        with stage(_logger, f"timing the plan over the target's {len(target.assumed)} assumed figures"):
            spans = figure_ranges(programs, placement, target, chunks, flops,
                                  {"time_per_token_s": step_s, "ttft_s": ttft, "cold_start_s": cold.first_token_s},
                                  activities)
    prediction = Prediction(
        time_per_token_s=step_s,
        tokens_per_s=workload.batch / step_s if step_s else 0.0,
        ttft_s=ttft,
        cold_start_s=cold.first_token_s,
        cold_start_naive_order_s=cold.naive_first_token_s,
        decode=_phase_figures(decode, workload.batch, step_s=step_s),
        prefill=_phase_figures(prefill, memory.prefill_chunk_tokens, chunks=chunks,
                               chunk_tokens=memory.prefill_chunk_tokens),
        bound=bound,
        efficiency=bound.token_s / step_s if step_s else 0.0,
        ttft_efficiency=bound.ttft_s / ttft if ttft else 0.0,
        sram_peak_bytes=dict(sorted(decode.peak_sram_bytes().items())),
        ranges=spans,
        sweep=swept[1] if swept else (),
        routing=routed,
        verify=swept[0] if swept else (),
        mixed=swept[2] if swept else (),
    )
    notes = [*NOTES, PREFILL_NOTES[memory.prefill_schedule]]
    if not facts.kv_width:
        notes.append("no k/v projections recognized: the KV cache is not modelled")
    return Plan(target.name, target_sha256, workload, allowed, planned_tiles(placement), programs, memory.describe(),
                prediction, cold, prefetch, tuple(notes), target=target, trace=chrome_trace(decode))


def _prefetch(graph: Graph, facts: ModelFacts, placement: Placement, target: Target, memory: MemoryPlan,
              workload: Workload, allowed: Sequence[int], routing: Routing) -> dict[str, float]:
    """The decode step of this placement prefetching its streamed experts ahead of their routing,
    by the predictor's hit rate (`routed.predicted_steps`)."""
    ahead = build_program(facts, placement, target, memory, workload, "decode", chiplets=allowed)
    members = expert_members(graph, routing, ahead, placement, staging_bytes=memory.staging_bytes)
    return {f"{rate:g}": predicted_steps(ahead, target, members, routing, workload.tokens("decode"), rate,
                                         samples=PREFETCH_SAMPLES) for rate in PREFETCH_HIT_RATES}


def planned_tiles(placement: Placement) -> tuple[PlannedTile, ...]:
    """The placement's tiles as the plan records them."""
    num_c = placement.num_chiplets
    return tuple(PlannedTile(tile.weight, tile.layer, tile.role, (tile.k_start, tile.k_stop), (tile.n_start, tile.n_stop),
                             tile.format, tile.storage_bytes, placement.compute_chiplet[t], tuple(tile.nodes),
                             chiplet=w if w < num_c else None, channel=w - num_c if w >= num_c else None)
                 for t, (tile, w) in enumerate(zip(placement.tiles, placement.where, strict=True)))


def bound_inputs(facts: ModelFacts, weights: Sequence[WeightSpec], target: Target, memory: MemoryPlan) -> BoundInputs:
    """What the bound reads off the model, from the same facts the scheduler reads."""
    abpe = target.activation_bytes_per_element
    q_total = sum(facts.q_width.get(layer, facts.kv_width.get(layer, 0)) for layer in facts.attention.values())
    hidden = max((w.n for w in weights if w.is_embedding), default=0)
    first_output = facts.output_order[0] if facts.output_order else ""
    return BoundInputs(kv_bytes=memory.kv.total_bytes, kv_tokens=memory.kv.tokens, q_width_total=q_total,
                       layers=len(set(facts.attention.values())),
                       attention_kind="int8" if memory.kv.dtype == "int8" else "fp16",
                       vector_bytes_per_token=facts.vector_elements_per_token() * abpe,
                       handoff_bytes_per_token=hidden * abpe,
                       output_bytes_per_token=facts.elements_per_token(first_output) * abpe if first_output else 0.0)


def _phase_figures(timeline: Timeline, tokens: int, *, chunks: int = 1, chunk_tokens: int = 0,
                   step_s: float | None = None) -> PhaseFigures:
    """The figures of a phase's step; `step_s` when it is not the timeline's (a routed mean)."""
    step = timeline.makespan_s if step_s is None else step_s
    return PhaseFigures(step, tokens / step if step else 0.0, timeline.busy_fraction_max("lpddr"),
                        timeline.busy_fraction_max("chiplet"), timeline.busy_fraction_max("link"), chunks, chunk_tokens)


def _flops_by_layer(program: Program, facts: ModelFacts) -> dict[int, float]:
    out: dict[int, float] = {}
    for _, _, ins in program.instructions():
        if isinstance(ins, Compute):
            layer = facts.layer_of_node.get(ins.node, -1)
            out[layer] = out.get(layer, 0.0) + ins.flops
    return out


def _sweep(facts: ModelFacts, placement: Placement, weights: Sequence[WeightSpec], target: Target,
           workload: Workload, memory: MemoryPlan, allowed: Sequence[int], prefetch: bool,
           max_context: int | None = None, graph: Graph | None = None,
           routing: Routing | None = None
           ) -> tuple[tuple[SweepPoint, ...], tuple[SweepPoint, ...], tuple[SweepPoint, ...]]:
    """The steps verifying VERIFY_DRAFTS drafts per sequence, time per token over batch (at the
    compiled context) and context (at the compiled batch, up to the model's trained positions), and
    the mixed steps prefilling MIXED_CHUNKS prompt tokens beside the compiled batch's decodes, on
    this placement: a point whose KV cache outgrows the SRAM the compile reserved streams it."""
    contexts = [t for t in SWEEP_CONTEXTS if max_context is None or t <= max_context]
    points = sorted({(b, workload.context, 1, 0) for b in SWEEP_BATCHES} | {(workload.batch, t, 1, 0) for t in contexts}
                    | {(workload.batch, workload.context, k + 1, 0) for k in VERIFY_DRAFTS}
                    | {(workload.batch, workload.context, 1, c) for c in MIXED_CHUNKS})
    def point(at: tuple[int, int, int, int]) -> SweepPoint:
        load = dataclasses.replace(workload, batch=at[0], context=at[1], positions=at[2], chunk=at[3])
        return _sweep_point(facts, placement, weights, target, load, memory, allowed, prefetch, graph, routing)

    with stage(_logger, f"simulating the batch and context sweep, the verify and the mixed steps ({len(points)} points)"):
        timed = forked_map(point, points)
    return (tuple(p for p in timed if p.positions > 1), tuple(p for p in timed if p.positions == 1 and not p.chunk),
            tuple(p for p in timed if p.chunk))


def _sweep_point(facts: ModelFacts, placement: Placement, weights: Sequence[WeightSpec], target: Target,
                 load: Workload, memory: MemoryPlan, allowed: Sequence[int], prefetch: bool,
                 graph: Graph | None = None, routing: Routing | None = None) -> SweepPoint:
    batch, context = load.batch, load.context
    def sized(kv: str) -> MemoryPlan:
        return plan_memory(facts, placement.tiles, target, load, chiplets=allowed, kv=kv, kv_dtype=memory.kv.dtype,
                           kv_window=memory.kv.window, prefill=memory.prefill_schedule, link_dtype=memory.link_dtype)

    try:  # a cache that outgrows the SRAM reserved streams, taking what the weights leave as the compile's did
        trial = sized("lpddr")
        trial = dataclasses.replace(trial, kv=dataclasses.replace(trial.kv, free_sram=memory.kv.free_sram))
    except InfeasibleError as error:  # this point's activations or staging do not fit beside the weights
        return SweepPoint(batch, context, False, error.message, positions=load.positions, chunk=load.chunk)
    if memory.kv.location == "sram" and trial.kv.total_bytes <= memory.kv.total_bytes:
        try:
            trial = sized("sram")
        except InfeasibleError:  # its larger activations leave the cache no room: the cache streams
            pass
    trial = settle_kv(trial, placement, facts, target, allowed, load.tokens("decode"))
    sram = target.chiplet.sram_bytes
    if any(held + reserve > sram for held, reserve in zip(placement.chiplet_bytes, trial.reserve_bytes, strict=True)):
        return SweepPoint(batch, context, False, "needs more SRAM beside the weights than this placement leaves",
                          positions=load.positions, chunk=load.chunk)
    program = build_program(facts, placement, target, trial, load, "decode", chiplets=allowed, prefetch=prefetch,
                            routed=routing is not None)
    if routing is not None and graph is not None:
        members = expert_members(graph, routing, program, placement,
                                 staging_bytes=trial.staging_bytes if prefetch else 0)
        step = routed_steps(program, target, members, routing, load.tokens("decode"), all_experts_s=0.0,
                            samples=SWEEP_ROUTING_SAMPLES)[0].mean_s
    else:
        step = simulate(program, target, record=False).makespan_s
    bound: BoundFigures = physical_bound(weights, target, load, bound_inputs(facts, weights, target, trial),
                                         chiplets=allowed, routing=routing)
    return SweepPoint(batch, context, True, "", trial.kv.location, step, batch / step if step else 0.0, bound.token_s,
                      bound.token_s / step if step else 0.0, load.positions, load.chunk)
