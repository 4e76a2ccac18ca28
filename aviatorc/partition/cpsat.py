"""CP-SAT placement of one layer's tiles, given the SRAM still free on each chiplet.

In the OR-tools sample order: data, variables, constraints, objective, hint, solve, extract.
The objective is `problem.py`'s cost restricted to this layer for its resident tiles (busiest
chiplet per group, busiest card's stream, broadcast trees). It leaves out what the streamed
tiles compute on their compute chiplets and the output collection (both need the compute
chiplets, a choice made after the assignment; the collection's transfers are approximated on
the broadcast tree's edges, a mean tile's output slice each), the hand-offs and the trips to
each layer's home (they depend on a group's lowest chiplet), and an expert group's own busiest
channel (`problem.fired_stream_ps`): the caller re-costs every solution with `total_cost` and keeps
it only when it beats the greedy layer. The greedy assignment is given
as a complete hint; when CP-SAT returns no solution in its time, the caller keeps the greedy one.

Determinism: a fixed seed, a deterministic time limit (work units, not wall seconds) and
interleaved search (CP-SAT's deterministic parallel mode, independent of timing); the wall
clock limit is a safety net several times larger that a healthy run never reaches. When it
does fire, the result says so (`wall_limited`) and the partitioner records a warning.
`deterministic=False` lets the two workers race (a portfolio): on Llama-3-8B it found a
0.7% better layer where interleaved search found none in the same work budget.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aviatorc.partition.problem import Problem


@dataclass(frozen=True)
class SolveResult:
    where: list[int] | None  # None when CP-SAT found no solution
    status: str  # "optimal", "feasible", "unknown", "infeasible"
    objective_ps: int
    best_bound_ps: float
    wall_s: float
    wall_limited: bool = False  # the wall-clock safety net stopped it (timing decided the result)


def solve_layer(problem: Problem, tiles: Sequence[int], free_bytes: Sequence[int], hint: Sequence[int], *,
                seed: int = 0, deterministic_time: float = 2.0, wall_limit_s: float = 30.0,
                deterministic: bool = True, chiplets: Sequence[int] | None = None,
                on_solution: Callable[[int, float], None] | None = None) -> SolveResult:
    """Improve on `hint` for `tiles`; with `chiplets`, tiles may only be resident on those
    (a neighbourhood of the hint: it must hold every chiplet the hint uses).

    `on_solution(objective_ps, best_bound_ps)` is called at each solution CP-SAT finds (progress:
    the current best and its gap). It only observes: the search is the same with or without it."""
    from ortools.sat.python import cp_model

    # -- data ----------------------------------------------------------------------------------
    target = problem.target
    num_c, num_h = problem.num_chiplets, problem.num_cards
    tiles = sorted(tiles)
    groups = sorted({problem.group_of[t] for t in tiles})
    chiplets = sorted(set(problem.chiplets if chiplets is None else chiplets) & set(problem.chiplets))
    channels = list(problem.stream_channels)  # only channels attached to an allowed chiplet stream

    model = cp_model.CpModel()
    # -- variables -----------------------------------------------------------------------------
    x = {(t, c): model.new_bool_var(f"x{t}_{c}") for t in tiles for c in chiplets
         if problem.tile_bytes[t] <= free_bytes[c]}
    s = {(t, h): model.new_bool_var(f"s{t}_{h}") for t in tiles for h in channels}
    u = {(g, c): model.new_bool_var(f"u{g}_{c}") for g in groups for c in chiplets}  # g's activation goes to c
    p = {(g, k): model.new_bool_var(f"p{g}_{k}") for g in groups for k in range(target.num_packages)}
    q = {(g, h): model.new_bool_var(f"q{g}_{h}") for g in groups for h in range(num_h)}
    y = {g: model.new_bool_var(f"y{g}") for g in groups}
    max_load = {g: model.new_int_var(0, sum(problem.work_ps[t] for t in tiles if problem.group_of[t] == g), f"m{g}")
                for g in groups}  # each group's busiest chiplet
    max_stream = model.new_int_var(0, sum(problem.stream_ps[t] for t in tiles), "max_stream")

    # -- constraints ---------------------------------------------------------------------------
    for t in tiles:  # each tile resident on exactly one chiplet or streamed from exactly one channel
        model.add_exactly_one([x[t, c] for c in chiplets if (t, c) in x] + [s[t, h] for h in channels])
    for c in chiplets:
        on_c = [t for t in tiles if (t, c) in x]
        if sum(problem.tile_bytes[t] for t in on_c) > free_bytes[c]:
            model.add(sum(problem.tile_bytes[t] * x[t, c] for t in on_c) <= free_bytes[c])
        for g in groups:
            of_g = [t for t in on_c if problem.group_of[t] == g]
            if of_g:
                model.add(sum(problem.work_ps[t] * x[t, c] for t in of_g) <= max_load[g])
    for h in channels:
        model.add(sum(problem.stream_ps[t] * s[t, h] for t in tiles) <= max_stream)
    # A group's activation reaches every chiplet, package and card holding one of its tiles.
    for (t, c), var in x.items():
        model.add_implication(var, u[problem.group_of[t], c])
    for g in groups:
        for c in chiplets:
            model.add_implication(u[g, c], p[g, target.package_of(c)])
        for k in range(target.num_packages):
            model.add_implication(p[g, k], q[g, k // target.packages_per_card])
        model.add_bool_or([q[g, h] for h in range(num_h)]).only_enforce_if(y[g])
        # y (which earns back one e2) only for a group with a resident tile: without this a fully
        # streamed group could set y and one free q, and the objective would go below its cost.
        resident = [var for (t, c), var in x.items() if problem.group_of[t] == g]
        model.add_bool_or(resident).only_enforce_if(y[g]) if resident else model.add(y[g] == 0)

    # -- objective -----------------------------------------------------------------------------
    # Tree edges: (chiplets - packages) * e0 + (packages - cards) * e1 + (cards - 1) * e2, where the
    # "- 1" applies only to a group with a resident tile (y). Coefficients are >= 0 because outer
    # link levels are never cheaper (the target loader checks it).
    terms: list[cp_model.LinearExprT] = [*max_load.values(), max_stream]
    # Collecting the outputs uses one transfer per edge of the same tree; each is charged here
    # with a mean tile's output slice (the exact bytes depend on the split, see problem.py).
    count = {g: sum(1 for t in tiles if problem.group_of[t] == g) for g in groups}
    for g in groups:
        slice_bytes = problem.group_out_bytes[g] // max(1, count[g])
        collect = [round(link.transfer_s(slice_bytes) * 1e12) for link in target.links]
        e0, e1, e2 = (edge + extra for edge, extra in zip(problem.edge_ps[g], collect, strict=True))
        terms.append(e0 * sum(u[g, c] for c in chiplets))
        terms.append((e1 - e0) * sum(p[g, k] for k in range(target.num_packages)))
        terms.append((e2 - e1) * sum(q[g, h] for h in range(num_h)))
        terms.append(-e2 * y[g])
    model.minimize(sum(terms))

    # -- hint: the greedy assignment, complete -------------------------------------------------
    _hint(model, problem, tiles, groups, chiplets, hint, x, s, u, p, q, y, max_load, max_stream)

    # -- solve ---------------------------------------------------------------------------------
    solver = cp_model.CpSolver()
    params = solver.parameters
    params.num_workers = 2
    params.random_seed = seed
    params.max_deterministic_time = deterministic_time
    params.max_time_in_seconds = wall_limit_s
    # Interleaved search is CP-SAT's deterministic parallel mode. Without it the two workers race
    # and share solutions as they come: sometimes better plans, not always the same ones.
    params.interleave_search = deterministic
    params.log_search_progress = False
    # Symmetry detection alone spent the whole deterministic budget on 64-chiplet layers (and
    # then returned UNKNOWN); the hint is complete, so search from it instead.
    params.symmetry_level = 0
    code = solver.solve(model, _observer(on_solution) if on_solution is not None else None)
    status = {cp_model.OPTIMAL: "optimal", cp_model.FEASIBLE: "feasible",
              cp_model.INFEASIBLE: "infeasible"}.get(code, "unknown")
    # Stopped before its deterministic budget and before proving optimality: the wall clock did it.
    wall_limited = (status not in ("optimal", "infeasible") and solver.wall_time >= 0.99 * wall_limit_s
                    and solver.deterministic_time < deterministic_time)

    # -- extract -------------------------------------------------------------------------------
    if status not in ("optimal", "feasible"):
        return SolveResult(None, status, 0, solver.best_objective_bound, solver.wall_time, wall_limited)
    where = [-1] * len(problem.tiles)
    for t in tiles:
        chosen = [c for c in chiplets if (t, c) in x and solver.value(x[t, c])]
        where[t] = chosen[0] if chosen else num_c + next(h for h in channels if solver.value(s[t, h]))
    return SolveResult(where, status, round(solver.objective_value), solver.best_objective_bound, solver.wall_time,
                       wall_limited)


def _observer(callback: Callable[[int, float], None]) -> Any:
    """A solution callback handing each solution's objective and CP-SAT's best bound to `callback`
    (its class is made here: ortools is imported only when solving)."""
    from ortools.sat.python import cp_model

    class Observer(cp_model.CpSolverSolutionCallback):  # type: ignore[misc]
        def on_solution_callback(self) -> None:
            callback(round(self.objective_value), self.best_objective_bound)

    return Observer()


def _hint(model, problem, tiles, groups, chiplets, hint, x, s, u, p, q, y, max_load, max_stream) -> None:  # type: ignore[no-untyped-def]
    target = problem.target
    num_c = problem.num_chiplets
    used: dict[int, set[int]] = {g: set() for g in groups}
    load = {g: [0] * num_c for g in groups}
    stream = [0] * problem.num_channels
    for t in tiles:
        w = hint[t]
        for c in chiplets:
            if (t, c) in x:
                model.add_hint(x[t, c], w == c)
        for h in problem.stream_channels:
            model.add_hint(s[t, h], w == num_c + h)
        if w < num_c:
            used[problem.group_of[t]].add(w)
            load[problem.group_of[t]][w] += problem.work_ps[t]
        else:
            stream[w - num_c] += problem.stream_ps[t]
    for g in groups:
        chips = used[g]
        packages = {target.package_of(c) for c in chips}
        cards = {target.card_of(c) for c in chips}
        for c in chiplets:
            model.add_hint(u[g, c], c in chips)
        for k in range(target.num_packages):
            model.add_hint(p[g, k], k in packages)
        for h in range(problem.num_cards):
            model.add_hint(q[g, h], h in cards)
        model.add_hint(y[g], bool(chips))
    for g in groups:
        model.add_hint(max_load[g], max(load[g]))
    model.add_hint(max_stream, max(stream))
