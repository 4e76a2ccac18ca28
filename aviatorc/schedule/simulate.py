"""A discrete-event simulation of a program's streams over the target's shared resources.

    timeline = simulate(program, target)
    timeline.makespan_s, timeline.spans, timeline.sram_samples

Resources, as on the hardware:
- each stream (one per chiplet) runs its instructions in order; `compute` occupies the
  chiplet's matrix units for max(FLOPs / peak of its format, bytes / SRAM bandwidth) plus its
  fixed latency; `wait` and `recv` block the stream; `load`, `send`, `signal`, `free` do not;
- one LPDDR channel per card: loads from a card are served one after another, in the order
  they were issued (ties: lower chiplet first), each for bytes / the card's LPDDR bandwidth;
- links: one die-to-die link per package, one package-to-package link per card, and one
  card-to-card port per sending card (cards talk over bridges and a PCIe switch, not one shared
  wire), each serving one transfer at a time for bytes / bandwidth, with its latency added to
  the arrival (latency overlaps the next transfer).

The simulator knows nothing of how the program was built; the physical bound (`bound.py`) is
computed apart from it, so efficiency = bound / simulated is a measurement.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from aviatorc.plan.ir import Program
from aviatorc.plan.plan import Plan
from aviatorc.target import Target


class SimulationError(RuntimeError):
    """The program cannot run: a stream waits for something that never comes (an internal error)."""


@dataclass(frozen=True)
class Span:
    track: str  # "chiplet 3", "lpddr card 0", "link die_to_die 1"
    kind: str  # compute, load, send, wait
    name: str
    start_s: float
    end_s: float


@dataclass
class Timeline:
    makespan_s: float
    spans: list[Span]
    sram_samples: dict[int, list[tuple[float, int]]]  # chiplet -> (time, bytes in use) after each change
    busy_s: dict[str, float] = field(default_factory=dict)  # track -> busy seconds

    def peak_sram_bytes(self) -> dict[int, int]:
        return {c: max((b for _, b in samples), default=0) for c, samples in self.sram_samples.items()}

    def summary(self) -> dict[str, float]:
        lpddr = [v for k, v in self.busy_s.items() if k.startswith("lpddr")]
        compute = [v for k, v in self.busy_s.items() if k.startswith("chiplet")]
        span = self.makespan_s or 1.0
        return {"makespan_s": self.makespan_s,
                "lpddr_busy_fraction_max": max(lpddr, default=0.0) / span,
                "compute_busy_fraction_max": max(compute, default=0.0) / span}


def simulate(program: Program | Plan, target: Target | None = None, *, phase: str = "decode",
             record: bool = True) -> Timeline:
    """Run `program` on `target`'s resources; with `record`, keep every span for the trace.
    Given a Plan, runs its `phase` program on the plan's own target."""
    if isinstance(program, Plan):
        target = target or program.target
        program = program.programs[phase]
    if target is None:
        raise ValueError("simulate needs the target of a bare program")
    streams = {c: program.streams[c] for c in sorted(program.streams)}
    pc = dict.fromkeys(streams, 0)
    events: dict[str, float] = {}  # event (a loaded buffer, a signal) -> when it fired
    arrivals: dict[tuple[str, int, int], float] = {}  # (value, src, dst) -> arrival
    waiting: dict[object, list[int]] = {}  # key a stream blocks on -> streams
    lpddr_free = [0.0] * target.cards
    link_free: dict[tuple[int, int], float] = {}
    spans: list[Span] = []
    busy: dict[str, float] = {}
    held = {c: sum(b.bytes for b in program.buffers.values() if b.kind != "staging" and b.chiplet == c) for c in streams}
    samples: dict[int, list[tuple[float, int]]] = {c: [(0.0, held[c])] for c in streams}
    sram_bw = target.chiplet.sram_bytes_per_s

    def span(track: str, kind: str, name: str, start: float, end: float) -> None:
        if kind != "wait":
            busy[track] = busy.get(track, 0.0) + (end - start)
        if record:
            spans.append(Span(track, kind, name, start, end))

    queue = [(0.0, c) for c in streams]
    heapq.heapify(queue)
    parked: dict[int, float] = {}  # a blocked stream -> its clock when it blocked
    finished = 0
    end_time = 0.0

    def wake(key: object, when: float) -> None:
        for s in waiting.pop(key, []):
            heapq.heappush(queue, (max(when, parked.pop(s)), s))

    while queue:
        now, c = heapq.heappop(queue)
        stream = streams[c]
        track = f"chiplet {c}"
        blocked = False
        while pc[c] < len(stream):
            ins = stream[pc[c]]
            op = ins.op
            if op in ("load", "send", "signal") and queue and queue[0][0] < now:
                # A shared resource is claimed in time order: let streams behind this clock go first.
                heapq.heappush(queue, (now, c))
                blocked = True
                break
            if op == "compute":
                seconds = max(ins["flops"] / target.flops_per_s(ins["kind"]), ins["bytes"] / sram_bw) \
                    + ins["fixed_ns"] * 1e-9
                if seconds > 0:
                    span(track, "compute", ins["node"] + (f" [{ins['part']}]" if ins["part"] else ""), now, now + seconds)
                now += seconds
            elif op == "load":
                card = ins["card"]
                start = max(now, lpddr_free[card])
                done = start + ins["bytes"] / target.lpddr_bytes_per_s_per_card
                lpddr_free[card] = done
                span(f"lpddr card {card}", "load", f"{ins['buf']} -> chiplet {c}", start, done)
                events[ins["buf"]] = done
                held[c] += program.buffers[ins["buf"]].bytes
                samples[c].append((now, held[c]))
            elif op in ("wait", "recv"):
                key: object
                if op == "wait":
                    key, when = ins["event"], events.get(ins["event"])
                else:
                    key = (ins["value"], ins["src"], c)
                    when = arrivals.get(key)  # type: ignore[call-overload]
                if when is None:
                    waiting.setdefault(key, []).append(c)
                    parked[c] = now
                    blocked = True
                    break
                if when > now:
                    span(track, "wait", ins["event"] if op == "wait" else f"recv {ins['value']}", now, when)
                    now = when
            elif op == "signal":
                events[ins["event"]] = now
                wake(ins["event"], now)
            elif op == "send":
                dst = ins["to"]
                level, resource = _link(target, c, dst)
                link = target.links[level]
                start = max(now, link_free.get(resource, 0.0))
                busy_until = start + ins["bytes"] / link.bytes_per_s
                link_free[resource] = busy_until
                span(f"link {link.name} {resource[1]}", "send", f"{ins['value']} {c}->{dst}", start, busy_until)
                arrival = (ins["value"], c, dst)
                arrivals[arrival] = busy_until + link.latency_s
                wake(arrival, arrivals[arrival])
            elif op == "free":
                held[c] -= program.buffers[ins["buf"]].bytes
                samples[c].append((now, held[c]))
            pc[c] += 1
        if not blocked:
            finished += 1
            end_time = max(end_time, now)
    if finished != len(streams):
        stuck = {c: f"step {pc[c]}: {streams[c][pc[c]].op} {streams[c][pc[c]].operand}"
                 for c in streams if pc[c] < len(streams[c])}
        raise SimulationError(f"deadlock: streams blocked forever: {stuck}")
    end_time = max([end_time, *lpddr_free, *(t + 0.0 for t in link_free.values())])
    return Timeline(end_time, spans, samples, busy)


def _link(target: Target, a: int, b: int) -> tuple[int, tuple[int, int]]:
    """The link level two chiplets use and the shared resource that carries it."""
    if target.package_of(a) == target.package_of(b):
        return 0, (0, target.package_of(a))
    if target.card_of(a) == target.card_of(b):
        return 1, (1, target.card_of(a))
    return 2, (2, target.card_of(a))
