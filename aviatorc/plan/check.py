"""The plan checker: a program re-read against the plan's tiles and target, apart from the scheduler.

    check_program(program, plan.tiles, target, chiplets=plan.chiplets)   # one phase
    check_plan(plan, target)                                              # every phase

It goes after `schedule` (and before anything writes or runs a plan). It shares no code with
`aviatorc.schedule`: everything is re-derived from the program's meaning (see
`aviatorc.plan.ir`), the tiles and the target, so a scheduler bug cannot hide behind the same
bug here. It proves, in this order (the first broken rule is raised):

1. Chiplets: the allowed chiplets exist; no resident tile, compute chiplet, buffer or stream
   lies outside them; a streamed tile comes from an LPDDR channel the target has.
2. Buffers: a resident buffer holds a tile resident on its chiplet, and every resident tile
   has one; the resident, KV and scratch buffers of a chiplet fit its SRAM.
3. Transfers: each `recv` has exactly one `send` of the same value and bytes from its source
   to it, and each `send` one `recv`; a `wait` is on a load of its own stream or on a signal.
4. Each stream, run as the machine would (`aviatorc.plan.interpret`): every buffer it names is
   declared and on its chiplet; a `load` fills a staging buffer from the channel the plan
   streams its tile from, is not repeated while the buffer is live, and keeps the chiplet
   within its SRAM; a `compute` reads a staging buffer only after its `load` and a `wait` on it
   and before its `free`, a resident tile only where it is resident, a staged tile only on its
   compute chiplet; every staging buffer loaded is freed by the end of the stream; sends go to
   allowed chiplets; loads and stores name real channels.
5. Deadlock: the run above ends with every stream finished; a stream left blocked is named,
   with the cycle of streams waiting on each other.

Time is not modelled (the simulator does that): a load's event fires when it is issued, since
the copy always lands. The staging rules (`StagingRules`) are the ones the sim backend proves
again on a real run. A failure is a bug in aviatorc (the scheduler made a plan the machine
cannot run), or a tampered plan: it raises `PlanCheckError` with the rule (`check`), the stream
and step, and the program around it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from aviatorc.errors import AviatorError
from aviatorc.plan.interpret import StreamInterpreter
from aviatorc.plan.ir import (
    Buffer,
    Compute,
    Free,
    Host,
    Load,
    Program,
    Recv,
    Send,
    Signal,
    Store,
    ValueRef,
    Wait,
    format_instr,
    tile_name,
)
from aviatorc.plan.plan import Plan, PlannedTile
from aviatorc.target import Target

# Every rule the checker raises, by its `check` name: what a plan breaking it did.
CHECKS: dict[str, str] = {
    "unknown-chiplet": "the allowed chiplets name one the target does not have",
    "wrong-target": "the tiles were placed for a machine of another size",
    "outside-chiplets": "a stream, buffer, transfer, resident tile or compute chiplet outside the allowed chiplets",
    "unknown-tile": "a weight buffer names a tile the plan does not have",
    "missing-resident": "a tile the plan keeps resident has no resident buffer (its SRAM is not counted)",
    "undeclared-buffer": "an instruction names a buffer the program does not declare",
    "wrong-chiplet": "a buffer is used on another chiplet than its own, or a tile where it does not compute",
    "not-staging": "a load or free names a buffer that is not a staging buffer",
    "wrong-channel": "a load from an LPDDR channel that does not exist or does not stream the tile",
    "load-size": "a load brings more bytes than its staging buffer holds",
    "double-load": "a staging buffer loaded again while still live",
    "missing-load": "a staging buffer waited for, read or freed with no load before it",
    "missing-wait": "a staging buffer read before a wait on its load",
    "use-after-free": "a staging buffer read after its free",
    "double-free": "a staging buffer freed twice",
    "unfreed-buffer": "a staging buffer still live at the end of its stream",
    "over-capacity": "a chiplet's buffers exceed its SRAM",
    "unmatched-recv": "a recv with no send of the same value and bytes from its source",
    "unmatched-send": "a send with no recv at its destination",
    "duplicate-transfer": "one value sent or received twice between the same two chiplets",
    "unmatched-wait": "a wait on an event no load of its stream and no signal fires",
    "deadlock": "streams that block forever on each other",
}

CONTEXT_LINES = 3  # instructions shown either side of the bad one
Fail = Callable[..., Exception]  # (check, message, stream, step, **fields) -> the error to raise


class PlanCheckError(AviatorError):
    """A program breaks a rule of the plan IR. `check` names the rule (a key of `CHECKS`);
    `stream` (a chiplet) and `step` (an index into its stream) say where, when there is a where;
    `context` is the stream's text around the step."""

    def __init__(self, message: str, *, check: str, stream: int | None = None, step: int | None = None,
                 context: str = "", **fields: Any) -> None:
        if check not in CHECKS:
            raise ValueError(f"unknown plan check '{check}'")  # a checker bug: every rule is in the table
        self.check = check
        self.stream = stream
        self.step = step
        self.context = context
        where = f"stream {stream} step {step}: " if stream is not None and step is not None else ""
        super().__init__(where + message, check=check, stream=stream, step=step, **fields)

    def details(self) -> str:
        return f"{self}\n{self.context}" if self.context else str(self)


def check_plan(plan: Plan, target: Target) -> None:
    """Check every program of `plan` against its tiles on `target`, within `plan.chiplets`."""
    for phase in sorted(plan.programs):
        check_program(plan.programs[phase], plan.tiles_in(phase, target), target, chiplets=plan.chiplets)


def check_program(program: Program, tiles: Sequence[PlannedTile], target: Target, *, chiplets: Sequence[int]) -> None:
    """Raise `PlanCheckError` for the first rule `program` breaks (see the module docstring)."""
    checker = _Checker(program, tuple(tiles), target, frozenset(chiplets))
    checker.check_chiplets()
    checker.check_buffers()
    checker.check_transfers()
    checker.run()


def held_bytes(program: Program) -> dict[int, int]:
    """Per chiplet: the buffers held for the whole program (everything but staging)."""
    held: dict[int, int] = {}
    for b in program.buffers.values():
        if b.kind != "staging":
            held[b.chiplet] = held.get(b.chiplet, 0) + b.bytes
    return held


def over_capacity(program: Program, sram_bytes: int, fail: Fail) -> None:
    """Raise `fail("over-capacity", ...)` for the first chiplet whose held buffers overflow its SRAM."""
    for c, held in sorted(held_bytes(program).items()):
        if held > sram_bytes:
            by_kind: dict[str, int] = {}
            for b in program.buffers.values():
                if b.chiplet == c and b.kind != "staging":
                    by_kind[b.kind] = by_kind.get(b.kind, 0) + b.bytes
            parts = ", ".join(f"{kind} {n:,}" for kind, n in sorted(by_kind.items()))
            raise fail("over-capacity", f"chiplet {c} holds {held:,} bytes for the whole program ({parts}) but has "
                       f"{sram_bytes:,} bytes of SRAM", c, None)


class StagingRules:
    """The life of each chiplet's staging buffers and its SRAM at every step: loaded before it is
    waited for, waited for before it is read, not read after its free, freed once, and the held
    buffers plus the live staging ones within the SRAM. The checker proves them on the program;
    the sim backend proves them again on each checked run. `fail(check, message, stream, step)`
    makes the error each raises."""

    def __init__(self, program: Program, sram_bytes: int, fail: Fail) -> None:
        self.program, self.sram_bytes, self.fail = program, sram_bytes, fail
        self.held = held_bytes(program)
        self.live: dict[int, dict[str, int]] = {}  # chiplet -> staging buffer -> step of its load
        self.waited: dict[int, set[str]] = {}
        self.freed: dict[int, dict[str, int]] = {}  # chiplet -> staging buffer -> step of its free
        self.staged: dict[int, int] = {}
        self.peak: dict[int, int] = dict(self.held)

    def buffer(self, c: int, step: int, op: str, name: str) -> Buffer:
        """The buffer an instruction names: declared, and on this chiplet."""
        b = self.program.buffers.get(name)
        if b is None:
            raise self.fail("undeclared-buffer", f"{op} names buffer '{name}' that the program does not declare",
                            c, step)
        if b.chiplet != c:
            raise self.fail("wrong-chiplet", f"{op} names buffer '{name}' of chiplet {b.chiplet} on chiplet {c}",
                            c, step)
        return b

    def load(self, c: int, step: int, b: Buffer) -> None:
        live = self.live.setdefault(c, {})
        if b.kind != "staging":
            raise self.fail("not-staging", f"load '{b.name}' into a {b.kind} buffer: loads fill staging buffers",
                            c, step)
        if b.name in live:
            raise self.fail("double-load", f"load '{b.name}' again while it is live (loaded at step "
                            f"{live[b.name]}, not freed)", c, step)
        total = self.held.get(c, 0) + self.staged.get(c, 0) + b.bytes
        if total > self.sram_bytes:
            raise self.fail("over-capacity", f"load '{b.name}' ({b.bytes:,} bytes) brings chiplet {c} to {total:,} "
                            f"bytes ({self.held.get(c, 0):,} held, {self.staged.get(c, 0):,} staged in {len(live)} "
                            f"buffer(s)) but it has {self.sram_bytes:,} bytes of SRAM", c, step)
        live[b.name] = step
        self.freed.setdefault(c, {}).pop(b.name, None)
        self.waited.setdefault(c, set()).discard(b.name)
        self.staged[c] = self.staged.get(c, 0) + b.bytes
        self.peak[c] = max(self.peak.get(c, 0), total)

    def own_staging(self, c: int, event: str) -> bool:
        """Whether `event` is one of this chiplet's staging buffers (a wait on its own load)."""
        b = self.program.buffers.get(event)
        return b is not None and b.kind == "staging" and b.chiplet == c

    def wait(self, c: int, step: int, name: str) -> None:
        if name not in self.live.get(c, {}):
            raise self.fail("missing-load", f"wait for staging buffer '{name}' {self._load_after(c, step, name)}",
                            c, step)
        self.waited.setdefault(c, set()).add(name)

    def read(self, c: int, step: int, b: Buffer, what: str) -> None:
        if b.kind != "staging":
            return
        live = self.live.get(c, {})
        if b.name in live:
            if b.name not in self.waited.get(c, set()):
                raise self.fail("missing-wait", f"{what} reads staging buffer '{b.name}' (loaded at step "
                                f"{live[b.name]}) with no wait on its load before it", c, step)
        elif b.name in self.freed.get(c, {}):
            raise self.fail("use-after-free", f"{what} reads staging buffer '{b.name}' after its free at step "
                            f"{self.freed[c][b.name]}", c, step)
        else:
            raise self.fail("missing-load", f"{what} reads staging buffer '{b.name}' {self._load_after(c, step, b.name)}",
                            c, step)

    def free(self, c: int, step: int, b: Buffer) -> None:
        if b.kind != "staging":
            raise self.fail("not-staging", f"free '{b.name}' of a {b.kind} buffer: only staging buffers are freed",
                            c, step)
        live = self.live.get(c, {})
        if b.name not in live:
            freed = self.freed.get(c, {})
            if b.name in freed:
                raise self.fail("double-free", f"free '{b.name}' again (freed at step {freed[b.name]})", c, step)
            raise self.fail("missing-load", f"free of staging buffer '{b.name}' {self._load_after(c, step, b.name)}",
                            c, step)
        del live[b.name]
        self.waited.get(c, set()).discard(b.name)
        self.freed.setdefault(c, {})[b.name] = step
        self.staged[c] -= b.bytes

    def finish(self, c: int) -> None:
        """The end of stream c: nothing it loaded is still live."""
        live = self.live.get(c, {})
        if live:
            name, step = min(live.items(), key=lambda item: item[1])
            raise self.fail("unfreed-buffer", f"staging buffer '{name}' loaded here is never freed "
                            f"({len(live)} buffer(s) live at the end of stream {c})", c, step)

    def _load_after(self, c: int, step: int, name: str) -> str:
        """How a buffer used at `step` lacks its load: none at all, or one only later (error path only)."""
        for later, ins in enumerate(self.program.streams.get(c, [])[step + 1:], start=step + 1):
            if isinstance(ins, Load) and ins.buf == name:
                return f"before its load at step {later}"
        return "with no live load (it is never loaded)"


class _Checker(StreamInterpreter):
    def __init__(self, program: Program, tiles: tuple[PlannedTile, ...], target: Target,
                 allowed: frozenset[int]) -> None:
        super().__init__(program)
        self.tiles, self.target, self.allowed = tiles, target, allowed
        self.rules = StagingRules(program, target.chiplet.sram_bytes, self.fail)
        self.signals = {ins.event for _, _, ins in program.instructions() if isinstance(ins, Signal)}

    # -- errors --------------------------------------------------------------------------

    def fail(self, check: str, message: str, stream: int | None = None, step: int | None = None,
             **fields: Any) -> PlanCheckError:
        context = self._context(stream, step) if stream is not None and step is not None else ""
        return PlanCheckError(message, check=check, stream=stream, step=step, context=context, **fields)

    def _context(self, stream: int, step: int) -> str:
        instructions = self.program.streams.get(stream, [])
        lines = [f"stream {stream} {{"]
        for i in range(max(0, step - CONTEXT_LINES), min(len(instructions), step + CONTEXT_LINES + 1)):
            lines.append(f"{'>>' if i == step else '  '} {i:6d}  {format_instr(instructions[i])}")
        return "\n".join(lines + ["}"])

    def _tile(self, b: Buffer) -> PlannedTile | None:
        return self.tiles[b.tile] if b.tile is not None and 0 <= b.tile < len(self.tiles) else None

    # -- 1. chiplets ---------------------------------------------------------------------

    def check_chiplets(self) -> None:
        target = self.target
        unknown = sorted(c for c in self.allowed if not 0 <= c < target.num_chiplets)
        if unknown:
            raise self.fail("unknown-chiplet", f"allowed chiplet {unknown[0]} does not exist: the target "
                            f"'{target.name}' has chiplets 0..{target.num_chiplets - 1}")
        for t, tile in enumerate(self.tiles):
            for c in (tile.chiplet, tile.compute_chiplet):
                if c is not None and not 0 <= c < target.num_chiplets:
                    raise self.fail("wrong-target", f"tile {tile_name(t)} names chiplet {c} but the target "
                                    f"'{target.name}' has chiplets 0..{target.num_chiplets - 1}")
            if tile.chiplet is not None and tile.chiplet not in self.allowed:
                raise self.fail("outside-chiplets", f"tile {tile_name(t)} is resident on chiplet {tile.chiplet}, "
                                f"outside the allowed chiplets {_list(self.allowed)}", stream=tile.chiplet)
            if tile.compute_chiplet not in self.allowed:
                raise self.fail("outside-chiplets", f"tile {tile_name(t)} computes on chiplet {tile.compute_chiplet}, "
                                f"outside the allowed chiplets {_list(self.allowed)}", stream=tile.compute_chiplet)
            if tile.channel is not None and not 0 <= tile.channel < target.num_channels:
                raise self.fail("wrong-channel", f"tile {tile_name(t)} streams from LPDDR channel {tile.channel} but "
                                f"the target has {target.num_channels} channel(s)")
        for b in self.program.buffers.values():
            if b.chiplet not in self.allowed:
                raise self.fail("outside-chiplets", f"buffer '{b.name}' lies on chiplet {b.chiplet}, outside the "
                                f"allowed chiplets {_list(self.allowed)}", stream=b.chiplet)
        for c in sorted(self.program.streams):
            if c not in self.allowed:
                raise self.fail("outside-chiplets", f"stream {c} runs on a chiplet outside the allowed chiplets "
                                f"{_list(self.allowed)}", stream=c)

    # -- 2. buffers ----------------------------------------------------------------------

    def check_buffers(self) -> None:
        has_buffer: set[int] = set()
        for name, b in self.program.buffers.items():
            tile = self._tile(b)
            if b.tile is not None and tile is None:
                raise self.fail("unknown-tile", f"buffer '{name}' holds tile {tile_name(b.tile)} but the plan has "
                                f"tiles t0..t{len(self.tiles) - 1}", stream=b.chiplet)
            if b.kind != "resident":
                continue
            if tile is None or b.tile is None:
                raise self.fail("unknown-tile", f"resident buffer '{name}' names no tile of the plan",
                                stream=b.chiplet)
            if tile.chiplet != b.chiplet:
                where = (f"resident on chiplet {tile.chiplet}" if tile.chiplet is not None
                         else f"streamed from channel {tile.channel}")
                raise self.fail("wrong-chiplet", f"resident buffer '{name}' holds tile {tile_name(b.tile)} on chiplet "
                                f"{b.chiplet} but the plan has it {where}", stream=b.chiplet)
            has_buffer.add(b.tile)
        for t, tile in enumerate(self.tiles):
            if tile.chiplet is not None and t not in has_buffer:
                raise self.fail("missing-resident", f"tile {tile_name(t)} is resident on chiplet {tile.chiplet} but "
                                "the program declares no resident buffer for it", stream=tile.chiplet)
        over_capacity(self.program, self.target.chiplet.sram_bytes,
                      lambda check, message, c, step: self.fail(check, message, stream=c))

    # -- 3. transfers and events ---------------------------------------------------------

    def check_transfers(self) -> None:
        # (value, src, dst) -> [(step, bytes)] of the sends and of the recvs.
        sends: dict[tuple[ValueRef, int, int], list[tuple[int, int]]] = {}
        recvs: dict[tuple[ValueRef, int, int], list[tuple[int, int]]] = {}
        waits: list[tuple[int, int, Wait]] = []
        for c, step, ins in self.program.instructions():
            if isinstance(ins, Send):
                if ins.to not in self.allowed:
                    raise self.fail("outside-chiplets", f"send '{ins.value}' to chiplet {ins.to}, outside the allowed "
                                    f"chiplets {_list(self.allowed)}", c, step)
                sends.setdefault((ins.value, c, ins.to), []).append((step, ins.bytes))
            elif isinstance(ins, Recv):
                if ins.src not in self.allowed:
                    raise self.fail("outside-chiplets", f"recv '{ins.value}' from chiplet {ins.src}, outside the "
                                    f"allowed chiplets {_list(self.allowed)}", c, step)
                recvs.setdefault((ins.value, ins.src, c), []).append((step, ins.bytes))
            elif isinstance(ins, Wait) and not self.rules.own_staging(c, ins.event):
                waits.append((c, step, ins))
        for (value, src, dst), got in recvs.items():
            step, nbytes = got[0]
            sent = sends.get((value, src, dst))
            if len(got) > 1:
                raise self.fail("duplicate-transfer", f"recv '{value}' src={src} again (first at step {step}): "
                                f"one value crosses between two chiplets once", dst, got[1][0])
            if not sent:
                elsewhere = sorted(d for (v, s, d) in sends if v == value and s == src)
                why = (f"stream {src} sends it to {_list(elsewhere)} only" if elsewhere
                       else f"stream {src} never sends it")
                raise self.fail("unmatched-recv", f"recv '{value}' src={src} bytes={nbytes} has no matching send: "
                                f"{why}", dst, step)
            if len(sent) > 1:
                raise self.fail("duplicate-transfer", f"send '{value}' to={dst} again (first at step {sent[0][0]}): "
                                f"one value crosses between two chiplets once", src, sent[1][0])
            if sent[0][1] != nbytes:
                raise self.fail("unmatched-recv", f"recv '{value}' src={src} bytes={nbytes} but stream {src} sends "
                                f"it with bytes={sent[0][1]} (step {sent[0][0]})", dst, step)
        for (value, src, dst), sent in sends.items():
            if (value, src, dst) not in recvs:
                where = f"stream {dst} never receives it" if dst in self.program.streams else f"chiplet {dst} has no stream"
                raise self.fail("unmatched-send", f"send '{value}' to={dst} bytes={sent[0][1]} has no matching recv: "
                                f"{where}", src, sent[0][0])
        for c, step, ins in waits:
            if ins.event in self.signals:
                continue
            b = self.program.buffers.get(ins.event)
            why = (f"it is a staging buffer of chiplet {b.chiplet}: a stream waits only on its own loads"
                   if b is not None and b.kind == "staging" else "no stream signals it and it is not a load of this stream")
            raise self.fail("unmatched-wait", f"wait '{ins.event}' can never fire: {why}", c, step)

    # -- 4. the streams, run -------------------------------------------------------------

    def _channel(self, c: int, step: int, what: str, channel: int) -> None:
        if not 0 <= channel < self.target.num_channels:
            raise self.fail("wrong-channel", f"{what} LPDDR channel {channel} but the target has "
                            f"{self.target.num_channels} channel(s)", c, step)

    def _end_of(self, c: int, step: int, now: float) -> float:
        if step == len(self.streams[c]) - 1:
            self.rules.finish(c)
        return now

    def on_load(self, c: int, step: int, ins: Load, now: float) -> float:
        b = self.rules.buffer(c, step, "load", ins.buf)
        if b.kind == "staging":
            self._channel(c, step, f"load '{b.name}' from", ins.channel)
            tile = self._tile(b)
            if tile is not None:
                if tile.channel is None:
                    raise self.fail("wrong-channel", f"load '{b.name}' streams tile {tile_name(b.tile or 0)} from "
                                    f"channel {ins.channel} but the plan keeps it resident on chiplet {tile.chiplet}",
                                    c, step)
                if ins.channel != tile.channel:
                    raise self.fail("wrong-channel", f"load '{b.name}' streams tile {tile_name(b.tile or 0)} from "
                                    f"channel {ins.channel} but the plan streams it from channel {tile.channel}", c, step)
                if tile.compute_chiplet != c:
                    raise self.fail("wrong-chiplet", f"load uses tile {tile_name(b.tile or 0)} (buffer '{b.name}') on "
                                    f"chiplet {c} but it computes on chiplet {tile.compute_chiplet}", c, step)
            if ins.bytes > b.bytes:
                raise self.fail("load-size", f"load '{b.name}' brings {ins.bytes:,} bytes into a buffer of "
                                f"{b.bytes:,}", c, step)
        self.rules.load(c, step, b)
        self.fire(ins.buf, now)
        return self._end_of(c, step, now)

    def on_wait(self, c: int, step: int, ins: Wait, now: float) -> float | None:
        if self.rules.own_staging(c, ins.event):
            self.rules.wait(c, step, ins.event)
        after = self.await_key(c, ins.event, now)
        return after if after is None else self._end_of(c, step, after)

    def on_signal(self, c: int, step: int, ins: Signal, now: float) -> float:
        self.fire(ins.event, now)
        return self._end_of(c, step, now)

    def on_compute(self, c: int, step: int, ins: Compute, now: float) -> float:
        what = f"compute '{ins.node}'"
        for name in ins.bufs:
            b = self.rules.buffer(c, step, "compute", name)
            tile = self._tile(b)
            if tile is not None and b.kind == "staging" and tile.compute_chiplet != c:
                raise self.fail("wrong-chiplet", f"compute uses tile {tile_name(b.tile or 0)} (buffer '{name}') on "
                                f"chiplet {c} but it computes on chiplet {tile.compute_chiplet}", c, step)
            if tile is not None and b.kind == "resident" and tile.chiplet != c:
                raise self.fail("wrong-chiplet", f"compute reads resident tile {tile_name(b.tile or 0)} on chiplet {c} "
                                f"but it is resident on {tile.chiplet}", c, step)
            self.rules.read(c, step, b, what)
        return self._end_of(c, step, now)

    def on_send(self, c: int, step: int, ins: Send, now: float) -> float:
        self.fire(self.transfer_key(ins.value, c, ins.to), now)
        return self._end_of(c, step, now)

    def on_recv(self, c: int, step: int, ins: Recv, now: float) -> float | None:
        after = self.await_key(c, self.transfer_key(ins.value, ins.src, c), now)
        return after if after is None else self._end_of(c, step, after)

    def on_free(self, c: int, step: int, ins: Free, now: float) -> float:
        self.rules.free(c, step, self.rules.buffer(c, step, "free", ins.buf))
        return self._end_of(c, step, now)

    def on_store(self, c: int, step: int, ins: Store, now: float) -> float:
        self._channel(c, step, f"store '{ins.what}' to", ins.channel)
        return self._end_of(c, step, now)

    def on_host(self, c: int, step: int, ins: Host, now: float) -> float:
        return self._end_of(c, step, now)

    # -- 5. deadlock ---------------------------------------------------------------------

    def deadlock(self, blocked: dict[int, int]) -> PlanCheckError:
        """Name the cycle: each blocked stream waits on the stream that would release it (the
        sender, or a signaller). That one is blocked too (transfers and waits were matched
        before), so following the edges from any blocked stream ends in a cycle."""
        streams = self.program.streams
        signallers: dict[str, list[int]] = {}
        for c in sorted(streams):
            for ins in streams[c]:
                if isinstance(ins, Signal):
                    signallers.setdefault(ins.event, []).append(c)

        def waits_on(c: int) -> int:
            ins = streams[c][blocked[c]]
            if isinstance(ins, Recv):
                return ins.src
            event = ins.event if isinstance(ins, Wait) else ""
            return next((s for s in signallers.get(event, []) if s in blocked), c)

        walk: list[int] = []
        c = min(blocked)
        while c not in walk:
            walk.append(c)
            c = waits_on(c)
        cycle = walk[walk.index(c):]
        start = cycle.index(min(cycle))
        cycle = cycle[start:] + cycle[:start]

        def at(c: int) -> str:
            return f"stream {c} at step {blocked[c]} ({format_instr(streams[c][blocked[c]])})"

        message = "deadlock: " + ", ".join(f"{at(c)} waits on stream {waits_on(c)}" for c in cycle)
        behind = [c for c in blocked if c not in cycle]
        if behind:
            message += "; blocked behind them: " + ", ".join(at(c) for c in behind)
        return self.fail("deadlock", message, cycle[0], blocked[cycle[0]], blocked=blocked, cycle=cycle)


def _list(chiplets: Iterable[int]) -> str:
    return ", ".join(str(c) for c in sorted(chiplets))
