"""A discrete-event simulation of a program's streams over the target's shared resources.

    timeline = simulate(program, target)
    timeline.makespan_s, timeline.spans, timeline.sram_samples

Resources, as on the hardware (every time comes from the target, none from the program):
- each stream (one per chiplet) runs its instructions in order; `compute` occupies the
  chiplet for max(FLOPs / peak of its format, bytes / SRAM bandwidth) on the matrix units, plus
  its vector bytes / the vector units' rate, plus the target's per-layer latency when flagged;
  `wait`, `recv` and `host` block the stream; `load`, `store`, `send`, `signal`, `free` do not;
- one queue per LPDDR channel (per chiplet on `corsair`): loads and stores on a channel are
  served one after another in the order they were issued (ties: lower chiplet first), each for
  bytes / the channel's bandwidth. A load into a chiplet the channel does not attach to then
  crosses the link between them, charged there (cut-through: the link finishes no earlier than
  the channel), and lands after the link's latency;
- links: one die-to-die link per package, one package-to-package link per card, and one
  card-to-card port per sending card (cards talk over bridges and a PCIe switch, not one shared
  wire), each serving one message at a time for its fixed message time plus bytes / bandwidth,
  with its latency added to the arrival (latency overlaps the next message);
- the host: `host` sends the output over its card's PCIe port (bytes / PCIe bandwidth), then the
  stream waits two PCIe crossings and the host's per-token work (sampling).

A mixture of experts' step runs only what its routing chose (`Activity`, from
`aviatorc.schedule.routed`): a skipped expert's computes, loads and sends take no time (their
events fire at once, so the streams walk past them), and a routed expert computes and sends only
its tokens' rows (its weights are read whole). Without an activity every expert runs on every
token, the dense step.

The simulator knows nothing of how the program was built (it walks the streams with the same
`StreamInterpreter` as the checker and the backends); the physical bound (`bound.py`) is
computed apart from it, so efficiency = bound / simulated is a measurement.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from aviatorc.plan.check import held_bytes
from aviatorc.plan.interpret import BLOCKED, StreamInterpreter
from aviatorc.plan.ir import (
    Compute,
    Free,
    Host,
    Load,
    Program,
    Recv,
    Send,
    Signal,
    Store,
    Wait,
    block_of,
    format_instr,
)
from aviatorc.plan.plan import Plan
from aviatorc.target import LinkLevel, Target


@dataclass(frozen=True)
class Activity:
    """What one routed step runs of a program: the share of rows each named node computes and each
    named value sends (0: skipped; a name not given: 1), and the staged buffers it does not load."""

    compute: Mapping[str, float]
    values: Mapping[str, float]
    skipped_buffers: frozenset[str]
    # Loads a predictor missed: each starts once its stream knows its block's routing (on demand),
    # instead of where the program issues it (`routed.predicted_steps`): at the stream's first wait
    # on a buffer of the block (`block_of`: buffer -> its expert's layer), or its own wait.
    deferred_buffers: frozenset[str] = frozenset()
    block_of: Mapping[str, int] = field(default_factory=dict)


NO_ACTIVITY = Activity({}, {}, frozenset())


class SimulationError(RuntimeError):
    """The program cannot run: a stream waits for something that never comes (an internal error)."""


@dataclass(frozen=True)
class Span:
    track: str  # "chiplet 3", "lpddr channel 5", "link die_to_die 1", "pcie card 0"
    kind: str  # compute, load, store, send, wait, host
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

    def busy_fraction_max(self, kind: str) -> float:
        """The busiest track of a kind ("chiplet", "lpddr", "link"), as a fraction of the makespan."""
        busiest = max((v for k, v in self.busy_s.items() if k.startswith(kind)), default=0.0)
        return busiest / self.makespan_s if self.makespan_s else 0.0


def simulate(program: Program | Plan, target: Target | None = None, *, phase: str = "decode",
             record: bool = True, activity: Activity = NO_ACTIVITY) -> Timeline:
    """Run `program` on `target`'s resources; with `record`, keep every span for the trace.
    Given a Plan, runs its `phase` program on the plan's own target. `activity`: one routing's
    step of a mixture of experts (module docstring)."""
    if isinstance(program, Plan):
        target = target or program.target
        program = program.programs[phase]
    if target is None:
        raise ValueError("simulate needs the target of a bare program")
    simulator = _Simulator(program, target, record, activity)
    simulator.run()
    end = max([simulator.end_s, *simulator.channel_free, *simulator.link_free.values()])
    return Timeline(end, simulator.spans, simulator.samples, simulator.busy)


class _Simulator(StreamInterpreter):
    def __init__(self, program: Program, target: Target, record: bool, activity: Activity) -> None:
        super().__init__(program)
        self.target, self.record, self.activity = target, record, activity
        self.deferred: dict[str, Load] = {}  # deferred loads not yet started, by buffer
        self.deferred_in: dict[tuple[int, int | None], list[str]] = {}  # the same by (chiplet, block)
        self.routing_known: set[tuple[int, int | None]] = set()  # (chiplet, layer): its stream has reached the block
        self.channel_free = [0.0] * target.num_channels
        self.channel_tracks = [f"lpddr channel {h}" for h in range(target.num_channels)]
        self.link_free: dict[tuple[int, int], float] = {}
        self.pcie_free = [0.0] * target.cards
        self.spans: list[Span] = []
        self.busy: dict[str, float] = {}
        held = held_bytes(program)
        self.held = {c: held.get(c, 0) for c in self.streams}
        self.links: dict[tuple[int, int], tuple[LinkLevel, tuple[int, int], str]] = {}
        self.samples: dict[int, list[tuple[float, int]]] = {c: [(0.0, self.held[c])] for c in self.streams}
        self.tracks = {c: f"chiplet {c}" for c in self.streams}
        self.busy.update(dict.fromkeys(self.tracks.values(), 0.0))

    def span(self, track: str, kind: str, name: str, start: float, end: float) -> None:
        if kind != "wait":
            self.busy[track] = self.busy.get(track, 0.0) + (end - start)
        if self.record:
            self.spans.append(Span(track, kind, name, start, end))

    def deadlock(self, blocked: dict[int, int]) -> Exception:
        stuck = {c: f"step {step}: {format_instr(self.streams[c][step])}" for c, step in blocked.items()}
        return SimulationError(f"deadlock: streams blocked forever: {stuck}")

    # -- the hooks ------------------------------------------------------------------------

    def on_compute(self, c: int, step: int, ins: Compute, now: float) -> float:
        t = self.target
        share = self.activity.compute.get(ins.node, 1.0)
        if share == 0.0:
            return now
        seconds = max(ins.flops * share / t.flops_per_s(ins.kind), ins.bytes / t.chiplet.sram_bytes_per_s) \
            + ins.vector_bytes * share / t.chiplet.vector_bytes_per_s \
            + (t.per_layer_latency_s if ins.layer_latency else 0.0)
        if seconds > 0:
            track = self.tracks[c]
            self.busy[track] += seconds
            if self.record:
                self.spans.append(Span(track, "compute", ins.node + (f" [{ins.part}]" if ins.part else ""), now,
                                       now + seconds))
        return now + seconds

    def _channel(self, channel: int, chiplet: int, nbytes: int, now: float, kind: str, name: str) -> float:
        """Move `nbytes` between `channel` and `chiplet`'s SRAM from `now`: when it is done."""
        t = self.target
        start = max(now, self.channel_free[channel])
        done = start + nbytes / t.channel_bytes_per_s
        self.channel_free[channel] = done
        self.span(self.channel_tracks[channel], kind, name, start, done)
        if t.channel_of(chiplet) == channel:
            return done
        link, resource, track = self.link(t.chiplets_of_channel(channel)[0], chiplet)
        link_start = max(start, self.link_free.get(resource, 0.0))
        link_done = max(link_start + link.occupancy_s(nbytes), done)
        self.link_free[resource] = link_done
        self.span(track, kind, name, link_start, link_done)
        return link_done + link.latency_s

    def on_load(self, c: int, step: int, ins: Load, now: float) -> float:
        if ins.buf in self.activity.skipped_buffers:
            landed = now
        elif ins.buf in self.activity.deferred_buffers and (c, self.activity.block_of.get(ins.buf)) \
                not in self.routing_known:
            self.deferred[ins.buf] = ins
            self.deferred_in.setdefault((c, self.activity.block_of.get(ins.buf)), []).append(ins.buf)
            landed = None
        else:
            landed = self._channel(ins.channel, c, ins.bytes, now, "load",
                                   f"{ins.buf} -> chiplet {c}" if self.record else "")
        if landed is not None:
            self.fire(ins.buf, landed)
        self.held[c] += self.program.buffers[ins.buf].bytes
        self.samples[c].append((now, self.held[c]))
        return now

    def on_store(self, c: int, step: int, ins: Store, now: float) -> float:
        self._channel(ins.channel, c, ins.bytes, now, "store", f"{ins.what} <- chiplet {c}")
        return now

    def on_wait(self, c: int, step: int, ins: Wait, now: float) -> float | None:
        layer = self.activity.block_of.get(ins.event)
        if layer is not None and (c, layer) not in self.routing_known:  # the block's routing is known here now
            self.routing_known.add((c, layer))
            for buf in self.deferred_in.pop((c, layer), ()):
                load = self.deferred.pop(buf, None)
                if load is not None:
                    self._on_demand(c, load, now)
        load = self.deferred.pop(ins.event, None)
        if load is not None:  # a missed prediction: the load starts now, when the stream needs it
            self._on_demand(c, load, now)
        when = self.await_key(c, ins.event, now)
        if self.record and when is not BLOCKED and when > now:
            self.span(self.tracks[c], "wait", ins.event, now, when)
        return when

    def _on_demand(self, c: int, load: Load, now: float) -> None:
        self.fire(load.buf, self._channel(load.channel, c, load.bytes, now, "load",
                                          f"{load.buf} -> chiplet {c} (on demand)" if self.record else ""))

    def on_recv(self, c: int, step: int, ins: Recv, now: float) -> float | None:
        when = self.await_key(c, (ins.value, ins.src, c), now)
        if self.record and when is not BLOCKED and when > now:
            self.span(self.tracks[c], "wait", f"recv {ins.value}", now, when)
        return when

    def on_signal(self, c: int, step: int, ins: Signal, now: float) -> float:
        self.fire(ins.event, now)
        return now

    def link(self, a: int, b: int) -> tuple[LinkLevel, tuple[int, int], str]:
        """The link level chiplets a and b talk over, the resource that carries it, and its track."""
        found = self.links.get((a, b))
        if found is None:
            level, resource = _link(self.target, a, b)
            link = self.target.links[level]
            found = self.links[(a, b)] = (link, resource, f"link {link.name} {resource[1]}")
        return found

    def on_send(self, c: int, step: int, ins: Send, now: float) -> float:
        share = self.activity.values.get(block_of(ins.value.name)[0], 1.0) if self.activity.values else 1.0
        if share == 0.0:
            self.fire((ins.value, c, ins.to), now)
            return now
        link, resource, track = self.link(c, ins.to)
        start = max(now, self.link_free.get(resource, 0.0))
        busy_until = start + link.occupancy_s(math.ceil(ins.bytes * share))
        self.link_free[resource] = busy_until
        self.span(track, "send", f"{ins.value} {c}->{ins.to}" if self.record else "", start, busy_until)
        self.fire((ins.value, c, ins.to), busy_until + link.latency_s)
        return now

    def on_free(self, c: int, step: int, ins: Free, now: float) -> float:
        self.held[c] -= self.program.buffers[ins.buf].bytes
        self.samples[c].append((now, self.held[c]))
        return now

    def on_host(self, c: int, step: int, ins: Host, now: float) -> float:
        t = self.target
        card = t.card_of(c)
        start = max(now, self.pcie_free[card])
        sent = start + ins.bytes / t.pcie_bytes_per_s_per_card
        self.pcie_free[card] = sent
        back = sent + 2 * t.pcie_latency_s + t.host.per_token_s  # out, sample, the token back in
        self.span(f"pcie card {card}", "host", f"{ins.value} -> host", start, sent)
        self.span(f"chiplet {c}", "wait", f"host round trip ({ins.value})", now, back)
        return back


def _link(target: Target, a: int, b: int) -> tuple[int, tuple[int, int]]:
    """The link level two chiplets use and the shared resource that carries it."""
    if target.package_of(a) == target.package_of(b):
        return 0, (0, target.package_of(a))
    if target.card_of(a) == target.card_of(b):
        return 1, (1, target.card_of(a))
    return 2, (2, target.card_of(a))
