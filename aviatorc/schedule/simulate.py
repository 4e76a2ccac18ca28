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
    named value sends (0: skipped; a name not given: 1), and the staged buffers it does not load.

    How the step's runtime issues the loads of its routed experts (`block_of`: each routed expert's
    staged buffer -> its block's layer). A stream knows a block's routing once it has reached a
    wait on a buffer of that block or a later one. A load in `deferred_buffers` (one a predictor
    missed) cannot start before that: its `load` instruction, reached earlier, parks it. With
    `staging_bytes` (the program's staging budget per chiplet), the runtime issues each stream's
    expert loads itself, in program order, as soon as it may (the block's routing is known, or a
    predictor named the expert: `prefetched_buffers`) and the load fits the budget beside the
    stream's other staged loads in flight. A skipped expert occupies none of the budget, so the
    routed ones go out together instead of one budget's worth of the program at a time (the
    program's positions assume every expert runs). A load still not out by its own wait starts
    there, whatever the budget."""

    compute: Mapping[str, float]
    values: Mapping[str, float]
    skipped_buffers: frozenset[str]
    deferred_buffers: frozenset[str] = frozenset()
    block_of: Mapping[str, int] = field(default_factory=dict)
    staging_bytes: int = 0
    prefetched_buffers: frozenset[str] = frozenset()


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
        # The runtime's loads (`Activity`): the blocks each stream knows the routing of (the highest
        # rank, in block order), and with a staging budget each stream's loads in program order (the
        # next one not yet out) and the staged buffers it holds, loaded or loading, not yet freed.
        blocks = {layer: rank for rank, layer in enumerate(sorted(set(activity.block_of.values())))}
        self.rank = {buf: blocks[layer] for buf, layer in activity.block_of.items()}
        self.known_rank = dict.fromkeys(self.streams, -1)
        self.pending = {c: [ins for ins in stream if isinstance(ins, Load) and ins.buf not in activity.skipped_buffers]
                        for c, stream in self.streams.items()} if activity.staging_bytes else {}
        self.next_pending = dict.fromkeys(self.streams, 0)
        self.began: set[int] = set()  # loads (by instruction) that have started
        self.pulled: set[int] = set()  # the same, started ahead of their instruction
        self.parked: dict[str, Load] = {}  # loads reached but not yet allowed to start, by buffer
        self.live: set[str] = set()  # staged buffers held: loaded or loading, not yet freed
        self.live_bytes = dict.fromkeys(self.streams, 0)  # their bytes, per stream
        # A pull starts loads at a wait or a free: let the streams behind this clock claim their
        # channels first, as a load instruction does.
        self.claims_also = (Wait, Free) if activity.staging_bytes else ()
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
        if id(ins) in self.pulled:
            return now  # the runtime issued it already (`_pull`)
        if ins.buf in self.activity.skipped_buffers:
            self.fire(ins.buf, now)  # not loaded: it holds no SRAM
        elif ins.buf not in self.activity.deferred_buffers or self._known(c, ins.buf):
            self._start(c, ins, now)
        else:
            self.parked[ins.buf] = ins
        return now

    def _known(self, c: int, buf: str) -> bool:
        rank = self.rank.get(buf)
        return rank is not None and rank <= self.known_rank[c]  # no block given: never (at its own wait)

    def _start(self, c: int, load: Load, now: float) -> None:
        self.began.add(id(load))
        self.live.add(load.buf)
        nbytes = self.program.buffers[load.buf].bytes
        self.live_bytes[c] += nbytes
        self.held[c] += nbytes
        self.samples[c].append((now, self.held[c]))
        on_demand = " (on demand)" if load.buf in self.activity.deferred_buffers else ""
        self.fire(load.buf, self._channel(load.channel, c, load.bytes, now, "load",
                                          f"{load.buf} -> chiplet {c}{on_demand}" if self.record else ""))

    def _pull(self, c: int, now: float) -> None:
        """Start the stream's next loads, in program order, while each may start (an expert's once
        its block's routing is known or a predictor named it) and fits the staging budget."""
        pending = self.pending.get(c)
        if not pending:
            return
        i = self.next_pending[c]
        while i < len(pending):
            load = pending[i]
            if id(load) not in self.began:
                may = load.buf not in self.rank or load.buf in self.activity.prefetched_buffers \
                    or self._known(c, load.buf)
                nbytes = self.program.buffers[load.buf].bytes
                if not may or self.live_bytes[c] + nbytes > self.activity.staging_bytes:
                    break
                if self.parked.pop(load.buf, None) is None:
                    self.pulled.add(id(load))  # ahead of its instruction
                self._start(c, load, now)
            i += 1
        self.next_pending[c] = i

    def on_store(self, c: int, step: int, ins: Store, now: float) -> float:
        self._channel(ins.channel, c, ins.bytes, now, "store", f"{ins.what} <- chiplet {c}")
        return now

    def on_wait(self, c: int, step: int, ins: Wait, now: float) -> float | None:
        rank = self.rank.get(ins.event)
        if rank is not None and rank > self.known_rank[c]:  # the stream knows this block's routing now
            self.known_rank[c] = rank
        self._pull(c, now)
        parked = self.parked.pop(ins.event, None)
        if parked is not None:  # still not out: it starts now, when the stream needs it
            self._start(c, parked, now)
        when = self.await_key(c, ins.event, now)
        if self.record and when is not BLOCKED and when > now:
            self.span(self.tracks[c], "wait", ins.event, now, when)
        return when

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
        if ins.buf in self.live:  # a skipped expert's buffer was never held
            self.live.discard(ins.buf)
            nbytes = self.program.buffers[ins.buf].bytes
            self.live_bytes[c] -= nbytes
            self.held[c] -= nbytes
            self.samples[c].append((now, self.held[c]))
            self._pull(c, now)
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
