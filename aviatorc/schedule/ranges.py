"""The range a plan's predictions span over the target's assumed figures.

Every figure the vendor does not publish carries a range in the target file (`[assumed]`). The
plan is fixed; only the machine it is timed on varies (`aviatorc.target.loader.vary`):

- sensitivity: each assumption alone at its low and at its high end, the rest nominal;
- the range: every assumption at once at the end that helps (low) and at the end that hurts
  (high). Which end helps is read off the sensitivity runs, so nothing assumes that a faster
  link can only help.

Time per token is the decode program's makespan, TTFT the prefill program's times its chunks,
cold start the copy of the weights plus that TTFT. An assumption the programs never exercise
(a card-to-card link in a one-card plan) moves nothing and is not simulated.
"""

from __future__ import annotations

from aviatorc.partition.placement import Placement
from aviatorc.plan.ir import Load, Program, Send
from aviatorc.plan.plan import FigureRange
from aviatorc.schedule.cold import cold_start
from aviatorc.schedule.simulate import simulate
from aviatorc.target import LINK_LEVELS, Target
from aviatorc.target.loader import vary

FIGURES = ("time_per_token_s", "ttft_s", "cold_start_s")


def figure_ranges(programs: dict[str, Program], placement: Placement, target: Target, chunks: int,
                  flops_by_layer: dict[int, float]) -> dict[str, FigureRange]:
    """Each of FIGURES with its range and its sensitivity to each assumption of `target`."""

    seen: dict[tuple[tuple[str, float], ...], dict[str, float]] = {}

    def figures(figures: dict[str, float]) -> dict[str, float]:
        key = tuple(sorted(figures.items()))
        if key not in seen:
            machine = vary(target, figures) if figures else target
            token = simulate(programs["decode"], machine, record=False).makespan_s
            ttft = simulate(programs["prefill"], machine, record=False).makespan_s * chunks
            cold = cold_start(placement, machine, ttft, flops_by_layer).first_token_s
            seen[key] = {"time_per_token_s": token, "ttft_s": ttft, "cold_start_s": cold}
        return seen[key]

    nominal = figures({})
    used = _links_used(programs, target)
    sensitivity: dict[str, dict[str, tuple[float, float]]] = {f: {} for f in FIGURES}
    for a in target.assumed:
        if _unused(a.key, used):
            for f in FIGURES:
                sensitivity[f][a.key] = (nominal[f], nominal[f])
            continue
        low, high = figures({a.key: a.low}), figures({a.key: a.high})
        for f in FIGURES:
            sensitivity[f][a.key] = (low[f], high[f])
    out = {}
    for f in FIGURES:
        helps = {key: (a if lo <= hi else b) for key, (lo, hi) in sensitivity[f].items()
                 for a, b in [(_end(target, key, "low"), _end(target, key, "high"))]}
        hurts = {key: (_end(target, key, "high") if lo <= hi else _end(target, key, "low"))
                 for key, (lo, hi) in sensitivity[f].items()}
        best, worst = figures(helps)[f], figures(hurts)[f]
        out[f] = FigureRange(nominal[f], min(best, nominal[f]), max(worst, nominal[f]), sensitivity[f])
    return out


def _end(target: Target, key: str, which: str) -> float:
    a = target.assumption(key)
    assert a is not None
    return a.low if which == "low" else a.high


def _links_used(programs: dict[str, Program], target: Target) -> set[str]:
    """The link levels any message or cross-link load of the programs travels over."""
    used: set[str] = set()
    for program in programs.values():
        for c, _, ins in program.instructions():
            link = (target.link_between(c, ins.to) if isinstance(ins, Send)
                    else target.channel_link(ins.channel, c) if isinstance(ins, Load) else None)
            if link is not None:
                used.add(link.name)
    return used


def _unused(key: str, links: set[str]) -> bool:
    parts = key.split(".")
    return parts[0] == "links" and parts[1] in LINK_LEVELS and parts[1] not in links

