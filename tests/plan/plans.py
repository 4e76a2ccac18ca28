"""Real plans of the tiny llama for the plan checker and plan IR tests (fixtures: conftest.py).

`CASES` names each plan: the default mock target (everything resident), SRAM small enough that
the resident tiles spread over several chiplets (with transfers between them), small SRAM so that
tiles stream, the KV cache streamed from LPDDR, prefetch off, two cards, plans confined
to a subset of the chiplets, and LPDDR with one channel per chiplet (the mock target pools one
channel per card; `corsair` has one per chiplet).
"""

from __future__ import annotations

from dataclasses import dataclass

from aviatorc.ir import Graph
from aviatorc.partition import make_problem, partition
from aviatorc.partition.weights import weights_from_graph
from aviatorc.plan.plan import Plan
from aviatorc.schedule import Workload, model_facts, plan_memory, schedule
from aviatorc.target import Target, load_target

# At the mock target's own SRAM the tiny llama, its KV cache and its home share one chiplet (no
# transfers); at this size every tile is still resident, on three chiplets that send to each other.
SPREAD_SRAM_BYTES = 30720
STREAMING_SRAM_BYTES = 13312  # the tiny llama's ~35 KB of int8 weights stream at this size on 4 chiplets
WORKLOAD = Workload(batch=1, context=64, prompt=8)


@dataclass(frozen=True)
class Case:
    cards: int = 1
    sram_bytes: int | None = None  # None: the mock target's own
    chiplets: tuple[int, ...] | None = None  # None: all
    kv: str = "auto"
    prefetch: bool = True
    lpddr_attach: str | None = None  # None: the mock target's own (one pooled channel per card)


CASES: dict[str, Case] = {
    "resident": Case(),
    "resident-spread": Case(sram_bytes=SPREAD_SRAM_BYTES),
    "streaming": Case(sram_bytes=STREAMING_SRAM_BYTES),
    "streaming-kv": Case(sram_bytes=STREAMING_SRAM_BYTES, kv="lpddr"),
    "no-prefetch": Case(sram_bytes=STREAMING_SRAM_BYTES, kv="lpddr", prefetch=False),
    "two-cards": Case(cards=2, sram_bytes=STREAMING_SRAM_BYTES),
    "subset": Case(sram_bytes=SPREAD_SRAM_BYTES, chiplets=(0, 1)),  # on both, sending between them
    "subset-streaming": Case(sram_bytes=28672, chiplets=(1, 2)),
    "chiplet-channels": Case(sram_bytes=STREAMING_SRAM_BYTES, lpddr_attach="chiplet"),
}


@dataclass(frozen=True)
class Built:
    plan: Plan
    target: Target


def case_target(case: Case) -> Target:
    overrides: dict[str, object] = {}
    if case.sram_bytes:
        overrides["chiplet.sram_bytes"] = case.sram_bytes
    if case.lpddr_attach:
        overrides["card.lpddr_attach"] = case.lpddr_attach
    return load_target("mock", cards=case.cards, overrides=overrides or None)


def build(graph: Graph, case: Case) -> Built:
    """The recipe the compiler follows: memory sizing, then the partition, then the schedule."""
    target = case_target(case)
    allowed = case.chiplets or tuple(range(target.num_chiplets))
    weights = weights_from_graph(graph)
    problem = make_problem(weights, target)
    memory = plan_memory(model_facts(graph, problem.tiles), problem.tiles, target, WORKLOAD, chiplets=allowed,
                         kv=case.kv)
    placement = partition(weights, target, reserve_bytes=memory.reserve_bytes, chiplets=allowed,
                          homes=memory.kv.chiplet_of_layer)
    plan = schedule(graph, placement, weights, target, WORKLOAD, memory, chiplets=allowed, prefetch=case.prefetch,
                    sweep=False)
    return Built(plan, target)
