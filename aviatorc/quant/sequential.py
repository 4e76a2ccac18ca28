"""Sequential calibration: one walk over the calibration stages of a graph rewritten as it goes.

GPTQ's sequential scheme calibrates a model stage by stage (`aviatorc.passes._weights.
calibration_stages`: the MatMuls reading one activation form a stage), each stage's statistics
taken from the graph with every earlier stage already rewritten. `calibrate_sequentially`
drives it for `quantize` and `sparsify-2to4` (and so for `tools/bench_quant.py`, which runs
those passes):

1. For each batch it holds the live values at the stage frontier: the values computed so far
   that a node not yet evaluated still reads (`Frontier`).
2. For a stage it evaluates only the nodes between that frontier and the stage's MatMul
   inputs (`evaluate_nodes`, the reference interpreter's kernels), accumulates their
   `ActivationStats`, then calls the pass's `rewrite` for the stage.
3. After the rewrite the frontier moves through the rewritten nodes: the next stage evaluates
   the new `DequantizeWeight` and the stage's MatMuls on its way.

Padding positions are left out of every statistic: where the graph has an `attention_mask`
input, each batch's real positions (`aviatorc.quant.calibration.token_mask`) select the rows
accumulated, and `SequentialRun` says how many real tokens and padding positions there were.

Each node is evaluated once per batch (plus once in the unrewritten reference graph, for the
cross term GPTQ and SparseGPT fit to), so calibration costs a few forward passes, linear in
the layer count, where evaluating the graph up to each stage was quadratic. The statistics are
the same arrays: the same kernels on the same inputs, accumulated in the same order (batch by
batch, then the stage's values in order).

A rewrite changes the graph through nodes and their inputs (new nodes, `set_input`, removed
nodes), never the data of a value already evaluated. An evaluated node whose inputs a rewrite
changed (a weight shared by MatMuls of different stages) is evaluated again, and so is what
was computed from it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from aviatorc.ir import Graph, Node, Value
from aviatorc.ir.interpreter import evaluate_nodes
from aviatorc.quant.calibration import ActivationStats, check_batches, token_mask

# The pass's rewrite of one stage: its index and the statistics of its MatMul inputs.
StageRewrite = Callable[[int, dict[str, ActivationStats]], None]


@dataclass(frozen=True)
class SequentialRun:
    """What a calibration walk cost (node evaluations per batch, in the rewritten graph and the
    reference) and what it saw: positions of real tokens, and padding positions left out (0 when
    the graph has no attention mask: then every position counts as a token)."""

    stages: int
    evaluations: int
    reference_evaluations: int
    tokens: int = 0
    padding: int = 0


@dataclass(frozen=True)
class StagePlan:
    """The nodes one stage evaluates, in graph order, and the values they read that outlive them."""

    nodes: list[Node]
    keep: set[Value]


class Frontier:
    """The live values of one graph on each calibration batch, advanced stage by stage.

    `done` holds the nodes evaluated and still valid, with the inputs they were evaluated on;
    `live` the values held for every batch (the same set for each: every batch is advanced
    through the same nodes)."""

    def __init__(self, graph: Graph, feeds: Sequence[Mapping[str, np.ndarray]]) -> None:
        self.graph = graph
        self.feeds = feeds
        self.values: list[dict[Value, np.ndarray]] = [{v: feed[v.name] for v in graph.inputs} for feed in feeds]
        self.live: set[Value] = set(graph.inputs)
        self.done: dict[Node, tuple[Value | None, ...]] = {}
        self.evaluations = 0  # node evaluations per batch, over all stages

    def find(self, names: Sequence[str]) -> list[Value]:
        """The graph's values of these names (as the graph is now: a rewrite adds values)."""
        by_name = {v.name: v for v in self.graph.values()}
        return [by_name[name] for name in names]

    def plan(self, targets: Sequence[Value]) -> StagePlan:
        """The nodes to evaluate so that every target is live, in graph order; marks them done."""
        needed: set[Node] = set()
        seen: set[Value] = set()
        stack = list(targets)
        while stack:
            value = stack.pop()
            if value in seen or value in self.live or value.data is not None:
                continue
            seen.add(value)
            node = value.producer
            if node is None:  # a graph input dropped once its readers were done: read from the feed again
                for values, feed in zip(self.values, self.feeds):
                    values[value] = feed[value.name]
                self.live.add(value)
            elif node not in needed:
                needed.add(node)
                stack.extend(v for v in node.inputs if v is not None)
        order = [node for node in self.graph.nodes if node in needed]
        for node in order:
            self.done[node] = node.inputs
        # What the stage reads outlives it if it is a target or a node not yet done reads it;
        # the rest is dropped after its last read (`evaluate_nodes`).
        read = {v for node in order for v in node.inputs if v is not None and v.data is None}
        keep = set(targets) | {v for v in read if any(u not in self.done for u in v.users)}
        self.live.update(v for node in order for v in node.outputs)
        self.live.difference_update(read - keep)
        self.evaluations += len(order)
        return StagePlan(order, keep)

    def run(self, batch: int, plan: StagePlan, targets: Sequence[Value]) -> list[np.ndarray]:
        """Evaluate the plan on one batch; the targets' arrays, in order."""
        evaluate_nodes(plan.nodes, self.values[batch], keep=plan.keep)
        return [self.values[batch][v] for v in targets]

    def rewritten(self) -> None:
        """Bring the frontier up to date after a rewrite: nodes removed or with changed inputs are
        no longer done (nor what was computed from them), and values no node still needs are dropped."""
        present = set(self.graph.nodes)
        stale = [node for node, inputs in self.done.items() if node not in present or node.inputs != inputs]
        while stale:
            node = stale.pop()
            if self.done.pop(node, None) is None:
                continue
            for out in node.outputs:
                self._drop(out)
                stale.extend(u for u in out.users if u in self.done)
        for value in list(self.live):
            if all(u in self.done for u in value.users):
                self._drop(value)

    def _drop(self, value: Value) -> None:
        self.live.discard(value)
        for values in self.values:
            values.pop(value, None)


def calibrate_sequentially(
    graph: Graph,
    batches: Sequence[Mapping[str, np.ndarray]],
    stages: Sequence[Sequence[str]],
    rewrite: StageRewrite,
    *,
    hessian: bool,
    reference: Graph | None = None,
    percentile: float = 99.99,
    routed: Mapping[str, tuple[str, int]] | None = None,
) -> SequentialRun:
    """Statistics of each stage's named values (MatMul inputs) over all batches, from `graph` with
    every earlier stage rewritten; `rewrite(index, stats)` rewrites the stage before the next one.

    With `reference` (the graph before any rewriting, holding values of the same names) and
    `hessian`, each statistic also gets the cross term X^T X_ref (`corrected_target`).
    `routed` maps a value inside an expert (`aviatorc.ir.experts`) to its block's routing value and
    the expert's index: its statistics keep only the rows of the tokens that routing sends to
    the expert (in this graph, as rewritten so far), so GPTQ fits each expert to the tokens that
    reach it; an expert no token reaches gets statistics of 0 tokens."""
    routed = routed or {}
    feeds = check_batches(graph, batches)
    walk = Frontier(graph, feeds)
    masks = [token_mask(graph, feed) for feed in feeds]
    tokens = 0
    ref_walk = Frontier(reference, check_batches(reference, batches)) if reference is not None and hessian else None
    for index, stage in enumerate(stages):
        names = tuple(dict.fromkeys(stage))
        routings = tuple(dict.fromkeys(routed[name][0] for name in names if name in routed))
        targets = walk.find(names + routings)
        plan = walk.plan(targets)
        if ref_walk is not None:
            ref_targets = ref_walk.find(names)
            ref_plan = ref_walk.plan(ref_targets)
        stats: dict[str, ActivationStats] = {}
        for batch in range(len(feeds)):  # batch by batch, then the stage's values in order: as accumulated before
            arrays = walk.run(batch, plan, targets)
            xs, routing = arrays[: len(names)], dict(zip(routings, arrays[len(names):], strict=True))
            xs_ref = ref_walk.run(batch, ref_plan, ref_targets) if ref_walk is not None else [None] * len(xs)
            for name, x, x_ref in zip(names, xs, xs_ref):
                if name not in stats:
                    stats[name] = ActivationStats(int(x.shape[-1]))
                stats[name].add(x, hessian=hessian, percentile=percentile, x_ref=x_ref,
                                real=_rows(masks[batch], routing, routed.get(name)))
        if index == 0 and stats:
            tokens = next(iter(stats.values())).tokens  # the rows every stage's statistics hold
        rewrite(index, stats)
        walk.rewritten()
        if ref_walk is not None:
            ref_walk.rewritten()  # nothing rewrites the reference: this only drops what no stage needs now
    return SequentialRun(len(stages), walk.evaluations, ref_walk.evaluations if ref_walk is not None else 0,
                         tokens, sum(int(m.size - m.sum()) for m in masks if m is not None))


def _rows(real: np.ndarray | None, routing: Mapping[str, np.ndarray], expert: tuple[str, int] | None) -> np.ndarray | None:
    """The rows a statistic keeps: real tokens (`real`, [B, S]), and of those, for a value inside an
    expert, the ones its routing sends there (routing [tokens, E], one row per position)."""
    if expert is None:
        return real
    name, index = expert
    chosen = np.asarray(routing[name])[..., index].reshape(-1) != 0
    if real is None or real.size != chosen.size:
        return chosen
    return real.reshape(-1) & chosen
