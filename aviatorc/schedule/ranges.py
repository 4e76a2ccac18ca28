"""The range a plan's predictions span over the target's assumed figures.

Every figure the vendor does not publish carries a range in the target file (`[assumed]`). The
plan is fixed; only the machine it is timed on varies (`aviatorc.target.loader.vary`):

- sensitivity: each assumption alone at its low and at its high end, the rest nominal;
- the range: every assumption at once at the end that helps (low) and at the end that hurts
  (high). Which end helps is read off the sensitivity runs, so nothing assumes that a faster
  link can only help.

Time per token is the decode program's makespan, TTFT the prefill program's times its chunks,
cold start the copy of the weights plus that TTFT. An assumption the programs never exercise
(a card-to-card link in a one-card plan) moves nothing and is not simulated; one only the cold
start reads (storage) is not simulated either. The variations are timed on the machine's cores
at once (forked workers), each the same deterministic simulation as alone.
"""

from __future__ import annotations

from collections.abc import Mapping

from aviatorc.partition.placement import Placement
from aviatorc.plan.ir import Load, Program, Send
from aviatorc.plan.plan import FigureRange
from aviatorc.schedule.cold import cold_start
from aviatorc.schedule.forked import forked_map
from aviatorc.schedule.simulate import NO_ACTIVITY, Activity, simulate
from aviatorc.target import LINK_LEVELS, Target
from aviatorc.target.loader import vary

FIGURES = ("time_per_token_s", "ttft_s", "cold_start_s")


COLD_ONLY = frozenset({"host.storage_bytes_per_s"})  # figures only the cold start reads, not the simulator
Variation = tuple[tuple[str, float], ...]  # (dotted key, value) pairs, sorted


def figure_ranges(programs: dict[str, Program], placement: Placement, target: Target, chunks: int,
                  flops_by_layer: dict[int, float], nominal: dict[str, float],
                  activities: Mapping[str, Activity] | None = None) -> dict[str, FigureRange]:
    """Each of FIGURES with its range and its sensitivity to each assumption of `target`;
    `nominal`: FIGURES on `target` itself, as the plan predicts them. `activities`: per phase, the
    routed step a mixture of experts is timed on (its median routing's, for decode)."""
    timer = _Timer(programs, placement, target, chunks, flops_by_layer, nominal, dict(activities or {}))
    used = _links_used(programs, target)
    varied = [a for a in target.assumed if not _unused(a.key, used)]
    ends: list[Variation] = [((a.key, value),) for a in varied for value in (a.low, a.high)]
    seen: dict[Variation, dict[str, float]] = {(): nominal} | timer.many(ends)
    sensitivity: dict[str, dict[str, tuple[float, float]]] = {f: {} for f in FIGURES}
    for a in target.assumed:
        low, high = seen.get(((a.key, a.low),), nominal), seen.get(((a.key, a.high),), nominal)
        for f in FIGURES:
            sensitivity[f][a.key] = (low[f], high[f])
    corners: dict[str, tuple[Variation, Variation]] = {}
    for f in FIGURES:
        helps = tuple(sorted((key, _end(target, key, "low" if lo <= hi else "high"))
                             for key, (lo, hi) in sensitivity[f].items()))
        hurts = tuple(sorted((key, _end(target, key, "high" if lo <= hi else "low"))
                             for key, (lo, hi) in sensitivity[f].items()))
        corners[f] = (helps, hurts)
    seen |= timer.many(sorted({v for pair in corners.values() for v in pair} - set(seen)))
    out = {}
    for f in FIGURES:
        best, worst = seen[corners[f][0]][f], seen[corners[f][1]][f]
        out[f] = FigureRange(nominal[f], min(best, nominal[f]), max(worst, nominal[f]), sensitivity[f])
    return out


class _Timer:
    """The plan's figures on the target with some figures varied; several variations at once."""

    def __init__(self, programs: dict[str, Program], placement: Placement, target: Target, chunks: int,
                 flops_by_layer: dict[int, float], nominal: dict[str, float], activities: dict[str, Activity]) -> None:
        self.programs, self.placement, self.target = programs, placement, target
        self.chunks, self.flops_by_layer, self.nominal = chunks, flops_by_layer, nominal
        self.activities = activities

    def one(self, variation: Variation) -> dict[str, float]:
        machine = vary(self.target, dict(variation)) if variation else self.target
        if all(key in COLD_ONLY for key, _ in variation):
            token, ttft = self.nominal["time_per_token_s"], self.nominal["ttft_s"]  # the simulator reads none of them
        else:
            token, ttft = (simulate(self.programs[phase], machine, record=False,
                                    activity=self.activities.get(phase, NO_ACTIVITY)).makespan_s
                           for phase in ("decode", "prefill"))
            ttft *= self.chunks
        cold = cold_start(self.placement, machine, ttft, self.flops_by_layer).first_token_s
        return {"time_per_token_s": token, "ttft_s": ttft, "cold_start_s": cold}

    def many(self, variations: list[Variation]) -> dict[Variation, dict[str, float]]:
        return dict(zip(variations, forked_map(self.one, variations), strict=True))


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

