"""The partitioner: weight tiles onto chiplet SRAM, resident or streamed from LPDDR.

    placement = partition(weights_from_graph(graph), load_target("corsair", cards=4), time_limit_s=30)

Stages: explain infeasible requests (before any solving), tile the weights to the matrix
units, cost the tiles on the target, place layer by layer (greedy, then CP-SAT hinted with
it, with templates for identical layers), keep the better of that and the pure greedy run,
check the result independently, and compute the gap to a problem-specific lower bound.
See docs/partition.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from aviatorc.options import SOLVER_CHOICES as SOLVERS
from aviatorc.partition.bound import Bound, lower_bound
from aviatorc.partition.check import PlacementCheckError, check_placement
from aviatorc.partition.cpsat import solve_layer
from aviatorc.partition.decompose import place_layers
from aviatorc.partition.feasibility import explain_infeasible
from aviatorc.partition.placement import LayerSolve, Placement
from aviatorc.partition.problem import (
    Problem,
    build_problem,
    capacities,
    compute_chiplets,
    layer_costs,
    resolve_chiplets,
)
from aviatorc.partition.tiling import Tile, WeightSpec, expert_tile_bytes, tile_weights
from aviatorc.progress import Stage, stage
from aviatorc.routing import Routing
from aviatorc.target import Target

_logger = logging.getLogger("aviatorc.partition")

__all__ = ["LayerSolve", "Placement", "PlacementCheckError", "Problem", "SolveBudget", "Tile", "WeightSpec",
           "make_problem", "partition", "solve_budget"]


@dataclass(frozen=True)
class SolveBudget:
    """How much solving `time_limit_s` buys, in load-independent units.

    `max_solves` CP-SAT layer solves, each stopped after `deterministic_time_per_solve` of
    CP-SAT's deterministic time (work units calibrated to about a second of one core, the same
    on a busy machine as on an idle one). The wall limits are safety nets only, generous enough
    that a healthy run never meets them; when one fires the placement carries a warning.
    """

    max_solves: int
    deterministic_time_per_solve: float
    wall_limit_per_solve_s: float
    wall_limit_s: float


# solver="auto" runs the CP-SAT layer solves only where the greedy placement is more than this far
# above the lower bound: below it, the bound proves no solver could gain more.
AUTO_GAP = 0.02
MAX_SOLVES = 6
# Deterministic time units per wall second, measured on the 2 shared cores this was tuned on: one
# unit took 3-6 s of wall time on 6k-25k-boolean layer models (presolve and model loading run
# at a fraction of the rate the units assume). Only used to size the budget, never read from a clock.
UNITS_PER_WALL_S = 0.2
# Larger layer models are not worth solving: at 25k booleans CP-SAT spent 7-20 s returning the
# hint or UNKNOWN (measured: a complete hint comes back but is improved by 0.1% at most).
MAX_SOLVER_BOOLEANS = 12_000


def solve_budget(time_limit_s: float) -> SolveBudget:
    """The budget for `time_limit_s`: `MAX_SOLVES` solves sharing half of it, converted to
    deterministic units at `UNITS_PER_WALL_S` (at least 0.05 units each; the other half is left
    for tiling, the greedy passes, the bound and the checker). The safety nets: 10x a solve's
    expected wall time (at least 10 s) per solve, and 5x the whole limit (at least 60 s) for
    starting any further solve."""
    share_s = time_limit_s / (2 * MAX_SOLVES)
    per_solve = max(0.05, share_s * UNITS_PER_WALL_S)
    return SolveBudget(MAX_SOLVES, per_solve, max(10.0, 10 * share_s), max(60.0, 5 * time_limit_s))


def make_problem(weights: list[WeightSpec], target: Target, *, batch_tokens: int = 1,
                 tiles_per_weight: int | None = None, reserve_bytes: Sequence[int] | None = None,
                 chiplets: Iterable[int] | None = None, homes: Mapping[int, int] | None = None,
                 routing: Routing | None = None) -> Problem:
    """Tile `weights` for `target` and cost the tiles (`homes`, `routing`: `build_problem`'s).

    Each weight is cut into `tiles_per_weight` strips (default: one per allowed chiplet, so a
    layer can spread over all of them), more where a strip would exceed half of the largest
    usable chiplet SRAM.
    """
    allowed = resolve_chiplets(target, chiplets)
    capacity, _ = capacities(target, reserve_bytes, allowed)
    parts = tiles_per_weight or len(allowed)
    tiles = tile_weights(weights, target.matrix_unit_k, target.matrix_unit_n, parts,
                         max_tile_bytes=max(1, max(capacity) // 2),
                         expert_bytes=expert_tile_bytes(weights, target.matrix_unit_n))
    # Rows a lookup chooses among: an embedding's k; a tied head's n (its columns are the table's rows).
    vocab_rows = {w.name: w.k if w.is_embedding else w.n for w in weights if w.is_embedding or w.is_tied_head}
    return build_problem(tiles, target, batch_tokens=batch_tokens, vocab_rows=vocab_rows, reserve_bytes=reserve_bytes,
                         chiplets=allowed, homes=homes, routing=routing)


def partition(weights: list[WeightSpec], target: Target, *, time_limit_s: float = 30.0, seed: int = 0,
              batch_tokens: int = 1, streaming: bool = True, tiles_per_weight: int | None = None,
              check: bool = True, deterministic: bool = True, reserve_bytes: Sequence[int] | None = None,
              chiplets: Iterable[int] | None = None, solver: str = "cpsat",
              homes: Mapping[int, int] | None = None, routing: Routing | None = None) -> Placement:
    """Place every weight tile on `target`: resident on a chiplet or (with `streaming`) streamed.

    `solver="greedy"` keeps the greedy placement and runs no CP-SAT solve (`tools/bench_plan.py`
    compares the two on simulated time per token); `"auto"` runs the solves only when the greedy
    placement is more than `AUTO_GAP` above the lower bound (`bound.py`), which otherwise proves
    that no placement is much cheaper. The placement's `solver_note` says which ran and why.

    `time_limit_s` buys a fixed number of CP-SAT solves with a deterministic time each
    (`solve_budget`), so the same input and options give the same placement on a loaded machine
    as on an idle one. Wall-clock limits are safety nets only; when one fires, the placement's
    `warnings` say so. `deterministic=False` trades reproducibility for CP-SAT's racing portfolio.

    `reserve_bytes`: per chiplet, the SRAM held back from weights (activations, KV cache,
    staging buffers); None keeps the target's `activation_reserve_fraction`. `chiplets`: the
    chiplets the placement may use (resident tiles and compute chiplets), e.g. `range(0, 8)`,
    so that models can share a server in isolation; None allows all. `homes`: layer -> the chiplet
    its attention and other non-weight work run on (its KV cache's, `schedule.plan_memory`): each
    group's trips to its home are part of the cost, so weights are placed beside it. `routing`:
    how often each expert fires (`aviatorc.routing`): an expert costs what a step reads of it in
    expectation, so the experts that fire most are the ones kept resident.
    """
    started = time.monotonic()
    if solver not in SOLVERS:
        from aviatorc.errors import OptionError

        raise OptionError(f"unknown partition solver '{solver}'", hint=f"choose one of {', '.join(SOLVERS)}")
    allowed = resolve_chiplets(target, chiplets)
    explain_infeasible(weights, target, streaming=streaming, reserve_bytes=reserve_bytes, chiplets=allowed)
    problem = make_problem(weights, target, batch_tokens=batch_tokens, tiles_per_weight=tiles_per_weight,
                           reserve_bytes=reserve_bytes, chiplets=allowed, homes=homes, routing=routing)
    budget = solve_budget(time_limit_s)
    warnings: list[str] = []
    task: Stage | None = None  # the CP-SAT stage's progress, while it runs

    def solve(prob: Problem, tiles: list[int], free: list[int], hint: list[int]) -> tuple[list[int] | None, str]:
        chiplets = _neighbourhood(prob, tiles, hint)
        if len(tiles) * len(chiplets) > MAX_SOLVER_BOOLEANS:
            return None, "skipped"
        layer = prob.tiles[tiles[0]].layer

        def on_solution(objective_ps: int, bound_ps: float) -> None:
            if task is not None:  # CP-SAT's objective for the layer (solve_layer's, see cpsat.py) and its gap
                gap = (objective_ps - bound_ps) / abs(objective_ps) if objective_ps else 0.0
                task.update(detail=f"layer {layer}: best {objective_ps / 1e6:,.3f} us, gap {gap:.1%}")

        result = solve_layer(prob, tiles, free, hint, seed=seed, deterministic_time=budget.deterministic_time_per_solve,
                             wall_limit_s=budget.wall_limit_per_solve_s, deterministic=deterministic,
                             chiplets=chiplets, on_solution=on_solution)
        if task is not None:
            task.advance()
        if result.wall_limited:
            warnings.append(f"layer {layer}: CP-SAT stopped by its wall-clock safety net "
                            f"({budget.wall_limit_per_solve_s:.0f} s) before its deterministic budget, "
                            "so this result depends on timing")
        return result.where, result.status

    greedy = min(place_layers(problem, None), place_layers(problem, None, anchored=False), key=lambda d: d.cost_ps)
    bound = lower_bound(problem)
    greedy_gap = (greedy.cost_ps - bound.value_ps) / bound.value_ps if bound.value_ps > 0 else 0.0
    if solver == "auto":
        run_solver = greedy_gap > AUTO_GAP
        note = (f"auto: the greedy placement is {greedy_gap:.2%} above the lower bound, "
                + (f"over {AUTO_GAP:.0%}: CP-SAT layer solves ran" if run_solver
                   else f"within {AUTO_GAP:.0%}: no CP-SAT solve"))
    else:
        run_solver = solver == "cpsat"
        note = f"{solver}: the greedy placement is {greedy_gap:.2%} above the lower bound"
    if not run_solver:
        solved = greedy
    else:
        with stage(_logger, "CP-SAT layer solves", total=budget.max_solves) as task:
            solved = place_layers(problem, solve, max_solves=budget.max_solves, wall_limit_s=budget.wall_limit_s)
            task.finish(f"{len(solved.statuses)} solved")
    warnings += solved.warnings
    best = solved if solved.cost_ps < greedy.cost_ps else greedy
    if best is solved and solved.statuses and any(m.startswith("cpsat") for m in (s.method for s in solved.solves)):
        status = "optimal" if all(s == "optimal" for s in solved.statuses) else "feasible"
    else:
        status = "greedy"
    if not streaming and any(w >= target.num_chiplets for w in best.where):
        from aviatorc.errors import InfeasibleError

        raise InfeasibleError("the weights fit in SRAM in total but not tile by tile without streaming",
                              file=target.source, hint="enable streaming, or use a finer tiling or more cards")
    placement = _assemble(problem, best.where, best.cost_ps, greedy.cost_ps, status, best.solves, seed,
                          time.monotonic() - started, bound)
    placement = replace(placement, warnings=tuple(warnings), solver=solver, solver_note=note)
    if check:
        check_placement(placement, weights, target, batch_tokens=batch_tokens, reserve_bytes=reserve_bytes,
                        chiplets=allowed, homes=homes, routing=routing)
    return placement


def _neighbourhood(problem: Problem, tiles: list[int], hint: list[int]) -> list[int]:
    """The chiplets CP-SAT may use for a layer: every allowed chiplet on the cards the greedy layer
    uses (all of them when it streams everything). Moving a layer to other cards is the greedy's job."""
    target = problem.target
    cards = {target.card_of(hint[t]) for t in tiles if hint[t] < problem.num_chiplets}
    if not cards:
        return list(problem.chiplets)
    return [c for c in problem.chiplets if target.card_of(c) in cards]


def _assemble(problem: Problem, where: list[int], cost: int, greedy_cost: int, status: str,
              solves: list[LayerSolve], seed: int, elapsed: float, bound: Bound) -> Placement:
    target = problem.target
    num_c = problem.num_chiplets
    compute = compute_chiplets(problem, where)
    held = [0] * num_c
    resident = streamed = streamed_read = 0
    holders: dict[int, set[int]] = {}  # group -> chiplets computing it (the activation goes there)
    for t, w in enumerate(where):
        holders.setdefault(problem.group_of[t], set()).add(compute[t])
        if w < num_c:
            held[w] += problem.tile_bytes[t]
            resident += problem.tile_bytes[t]
        else:
            streamed += problem.tile_bytes[t]
            streamed_read += problem.read_bytes[t]
    cut = [0, 0, 0]
    for g, chips in holders.items():
        packages = {target.package_of(c) for c in chips}
        cards = {target.card_of(c) for c in chips}
        for level, count in enumerate((len(chips) - len(packages), len(packages) - len(cards), len(cards) - 1)):
            cut[level] += count * problem.group_act_bytes[g]
    placement = Placement(
        target_name=target.name, num_chiplets=num_c, num_cards=problem.num_cards, tiles=problem.tiles,
        where=tuple(where), compute_chiplet=tuple(compute), status=status, objective_ps=cost, greedy_objective_ps=greedy_cost,
        bound_ps=bound.value_ps, solve_time_s=elapsed, chiplet_bytes=tuple(held),
        chiplet_capacity_bytes=problem.capacity_bytes, reserve_bytes=problem.reserve_bytes,
        chiplets=problem.chiplets, chiplet_sram_bytes=target.chiplet.sram_bytes,
        resident_bytes=resident, streamed_bytes=streamed, streamed_read_bytes_per_step=streamed_read,
        min_streamed_read_bytes=bound.min_streamed_bytes, layer_costs=tuple(layer_costs(problem, where, compute=compute)),
        cut_bytes_by_level=tuple(zip((link.name for link in target.links), cut, strict=True)), solves=tuple(solves),
        seed=seed, batch_tokens=problem.batch_tokens, layer_homes=tuple(sorted(problem.layer_homes().items())))
    return replace(placement, solve_time_s=round(elapsed, 3))
