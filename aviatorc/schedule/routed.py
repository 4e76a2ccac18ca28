"""A mixture of experts' decode step over sampled routings: its expected time, P50 and P99.

A plan is one program for every routing: each expert's instructions are in it, a streamed
expert's loads issued on demand (`build.py`). A step runs the experts its tokens route to, so
its time is a random variable. `routed_steps` draws `ROUTING_SAMPLES` routings from the
`Routing` (a fixed seed: the same plan gives the same figures), simulates the decode program
under each (`Activity`), and gives the mean (the plan's time per token), the median and the 99th
percentile (interpolated between the sampled steps), beside the step in which every expert
fires on every token (the plan's worst routing) and the experts a step reads in expectation.

A prefill runs every expert: at hundreds of tokens nearly all of them fire, each on its share
of the tokens (`prefill_activity`: expected shares, no sampling).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from aviatorc.ir import Graph
from aviatorc.ir.experts import expert_index, expert_nodes
from aviatorc.partition.placement import Placement
from aviatorc.plan.ir import Program
from aviatorc.plan.plan import RoutingFigures
from aviatorc.routing import Routing, moe_blocks
from aviatorc.schedule.simulate import Activity, simulate
from aviatorc.target import Target

ROUTING_SAMPLES = 64
ROUTING_SEED = 0


@dataclass(frozen=True)
class ExpertMembers:
    """Which expert (layer, index) each node, value and staged buffer of a program belongs to."""

    nodes: dict[str, tuple[int, int]]
    values: dict[str, tuple[int, int]]
    buffers: dict[str, tuple[int, int]]
    staging_bytes: int  # the program's staging budget per chiplet (0: loads where the program issues them)

    def activity(self, shares: dict[int, np.ndarray], predicted: dict[int, np.ndarray] | None = None) -> Activity:
        """The step in which expert e of layer L computes `shares[L][e]` of the tokens (0: it is skipped).

        Without `predicted`, every routed expert is loaded on demand: once its stream knows its
        block's routing. `predicted` (per layer, a mask of experts): a program that prefetches
        experts ahead of their routing loads the predicted ones as early as its staging allows (a
        predicted expert no token routes to is loaded for nothing) and a routed one the prediction
        missed on demand. Either way the runtime issues the loads of the experts that run, within
        the staging budget (`Activity`)."""
        def share(key: tuple[int, int]) -> float:
            return float(shares[key[0]][key[1]])

        def guessed(key: tuple[int, int]) -> bool:
            return predicted is not None and bool(predicted[key[0]][key[1]])

        return Activity({n: share(k) for n, k in self.nodes.items()}, {v: share(k) for v, k in self.values.items()},
                        frozenset(b for b, k in self.buffers.items() if share(k) == 0.0 and not guessed(k)),
                        frozenset(b for b, k in self.buffers.items()
                                  if predicted is not None and share(k) > 0.0 and not guessed(k)),
                        {b: k[0] for b, k in self.buffers.items()}, self.staging_bytes,
                        frozenset(b for b, k in self.buffers.items() if guessed(k)))


def expert_members(graph: Graph, routing: Routing, program: Program, placement: Placement, *,
                   staging_bytes: int) -> ExpertMembers:
    """An expert's nodes are its subgraph (`aviatorc.ir.experts`) and its combine; its buffers, its
    tiles' staged ones. Blocks are matched to the routing's layers by their experts' tiles.
    `staging_bytes`: the budget the program was built with, which the runtime keeps too."""
    by_block = {block.router: block.layer for block in moe_blocks(graph, placement.tiles)}
    nodes: dict[str, tuple[int, int]] = {}
    for node, ref in expert_nodes(graph).items():
        if ref.block in by_block and routing.of_layer(by_block[ref.block]) is not None:
            nodes[node.name] = (by_block[ref.block], ref.expert)
    for node in graph.nodes:
        if node.op == "MoECombine":
            routing_value = node.input(0)
            block = routing_value.producer.name if routing_value.producer is not None else routing_value.name
            if block in by_block and routing.of_layer(by_block[block]) is not None:
                nodes[node.name] = (by_block[block], expert_index(node))
    values = {out.name: nodes[node.name] for node in graph.nodes if node.name in nodes for out in node.outputs}
    buffers = {}
    for name, buffer in program.buffers.items():
        tile = placement.tiles[buffer.tile] if buffer.kind == "staging" and buffer.tile is not None else None
        if tile is not None and tile.expert >= 0 and routing.of_layer(tile.layer) is not None:
            buffers[name] = (tile.layer, tile.expert)
    return ExpertMembers(nodes, values, buffers, staging_bytes)


def routed_steps(program: Program, target: Target, members: ExpertMembers, routing: Routing, tokens: int, *,
                 all_experts_s: float, samples: int = ROUTING_SAMPLES) -> tuple[RoutingFigures, Activity]:
    """The decode step's figures over `samples` routings of `tokens` tokens, and the median one's
    activity (the plan's trace shows that step)."""
    rng = np.random.default_rng(ROUTING_SEED)
    activities: list[Activity] = []
    times: list[float] = []
    for _ in range(samples):
        shares = {b.layer: b.sample(rng, tokens) / tokens for b in routing.blocks}
        activity = members.activity(shares)
        activities.append(activity)
        times.append(simulate(program, target, record=False, activity=activity).makespan_s)
    median = int(np.argsort(times, kind="stable")[len(times) // 2])
    figures = RoutingFigures(
        source=routing.source, samples=samples, mean_s=float(np.mean(times)),
        p50_s=float(np.percentile(times, 50)), p99_s=float(np.percentile(times, 99)), all_experts_s=all_experts_s,
        experts_per_step=sum(b.expected_active(tokens) for b in routing.blocks),
        experts_total=sum(b.experts for b in routing.blocks))
    return figures, activities[median]


def prefill_activity(members: ExpertMembers, routing: Routing) -> Activity:
    """A prefill's experts each on their expected share of the tokens (all of them loaded)."""
    activity = members.activity({b.layer: np.asarray(b.shares) for b in routing.blocks})
    return Activity(activity.compute, activity.values, frozenset())  # every expert, loaded where the program says


def predicted_steps(program: Program, target: Target, members: ExpertMembers, routing: Routing, tokens: int,
                    hit_rate: float, *, samples: int = ROUTING_SAMPLES) -> float:
    """The mean decode step of a program that prefetches experts ahead of their routing (built
    without `routed`, so expert loads are issued as early as staging allows), under a predictor
    that names each routed expert with probability `hit_rate` and, for each it misses, a wrong
    one (drawn by the routing's shares among the experts not routed): as many predicted as routed."""
    rng = np.random.default_rng(ROUTING_SEED)  # the routings `routed_steps` draws, in the same order
    guesses = np.random.default_rng(ROUTING_SEED + 1)
    times = []
    for _ in range(samples):
        counts_by_layer = {b.layer: b.sample(rng, tokens) for b in routing.blocks}
        shares, predicted = {}, {}
        for b in routing.blocks:
            counts = counts_by_layer[b.layer]
            routed = counts > 0
            hits = routed & (guesses.random(b.experts) < hit_rate)
            wrong = np.zeros(b.experts, dtype=bool)
            others = np.flatnonzero(~routed)
            misses = min(int(routed.sum() - hits.sum()), len(others))
            if misses:
                weights = np.asarray(b.shares)[others]
                wrong[guesses.choice(others, misses, replace=False, p=weights / weights.sum())] = True
            shares[b.layer], predicted[b.layer] = counts / tokens, hits | wrong
        times.append(simulate(program, target, record=False, activity=members.activity(shares, predicted)).makespan_s)
    return float(np.mean(times))
