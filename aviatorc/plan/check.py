"""The plan checker: a program re-read against its placement and target, apart from the scheduler.

    check_program(program, placement, target, chiplets=plan.chiplets)   # one phase
    check_plan(plan, target)                                            # every phase

It goes after `schedule` (and before anything writes or runs a plan). It shares no code with
`aviatorc.schedule`: everything is re-derived from the program text's meaning (see
`aviatorc.plan.ir`), the placement and the target, so a scheduler bug cannot hide behind the
same bug here. It proves, in this order (the first broken rule is raised):

1. Chiplets: the allowed chiplets exist; no resident tile, compute chiplet, buffer or stream
   lies outside them; a streamed tile comes from a real card and computes on that card.
2. Buffers: a resident buffer holds a tile resident on its chiplet, and every resident tile
   has one; the resident, KV and scratch buffers of a chiplet fit its SRAM.
3. Each stream, in order: every buffer it names is declared and on its chiplet; a `load`
   fills a staging buffer from the card the placement streams its tile from, is not repeated
   while the buffer is live, and keeps the chiplet within its SRAM; a `compute` reads a
   staging buffer only after its `load` and a `wait` on it and before its `free`, a resident
   tile only where it is resident, a staged tile only on its compute chiplet; every staging
   buffer loaded is freed by the end of the stream; sends go to allowed chiplets.
4. Transfers: each `recv` has exactly one `send` of the same value and bytes from its source
   to it, and each `send` one `recv`; a `wait` is on a load of its own stream or on a signal.
5. Deadlock: the streams run symbolically (sends, signals and loads release; recvs and waits
   block) until nothing moves; a stream left unfinished is blocked forever.

Time is not modelled (the simulator does that): a load's event counts as fired once the load
is issued, since the copy always lands. Everything runs in one pass per rule over the
instructions, linear in the program's size.
A failure is a bug in aviatorc (the scheduler made a plan the machine cannot run): it raises
`PlanCheckError` with the rule (`check`), the stream and step, and the program around it.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aviatorc.errors import AviatorError
from aviatorc.partition.placement import Placement
from aviatorc.plan.ir import Buffer, Instr, Program, format_instr
from aviatorc.plan.plan import Plan
from aviatorc.target import Target

# Every rule the checker raises, by its `check` name: what a plan breaking it did.
CHECKS: dict[str, str] = {
    "unknown-chiplet": "the allowed chiplets name one the target does not have",
    "wrong-target": "the placement was made for a machine of another size",
    "outside-chiplets": "a stream, buffer, transfer, resident tile or compute chiplet outside the allowed chiplets",
    "unknown-tile": "a weight buffer names a tile the placement does not have",
    "missing-resident": "a tile the placement keeps resident has no resident buffer (its SRAM is not counted)",
    "undeclared-buffer": "an instruction names a buffer the program does not declare",
    "wrong-chiplet": "a buffer is used on another chiplet than its own, or a tile where it does not compute",
    "not-staging": "a load or free names a buffer that is not a staging buffer",
    "wrong-card": "a load from a card that does not exist or does not stream the tile",
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
_WEIGHT_TILE = re.compile(r"t(\d+)\Z")


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
    """Check every program of `plan` against its placement on `target`, within `plan.chiplets`."""
    for phase in sorted(plan.programs):
        check_program(plan.programs[phase], plan.placement, target, chiplets=plan.chiplets)


def check_program(program: Program, placement: Placement, target: Target, *, chiplets: Sequence[int]) -> None:
    """Raise `PlanCheckError` for the first rule `program` breaks (see the module docstring)."""
    checker = _Checker(program, placement, target, frozenset(chiplets))
    checker.check_chiplets()
    checker.check_buffers()
    streams = [checker.check_stream(c) for c in sorted(program.streams)]
    checker.check_transfers(streams)
    checker.check_deadlock()


@dataclass
class _StreamFacts:
    """What one stream sends, receives, signals and waits on (beyond its own loads)."""

    chiplet: int
    sends: list[tuple[int, Instr]] = field(default_factory=list)
    recvs: list[tuple[int, Instr]] = field(default_factory=list)
    signals: list[tuple[int, Instr]] = field(default_factory=list)
    waits: list[tuple[int, Instr]] = field(default_factory=list)  # waits not on this stream's own staging buffers


class _Checker:
    def __init__(self, program: Program, placement: Placement, target: Target, allowed: frozenset[int]) -> None:
        self.program, self.placement, self.target, self.allowed = program, placement, target, allowed
        self.sram_bytes = target.chiplet.sram_bytes
        self.held = self._held_bytes()
        # The weight tile each buffer holds (None: a KV block, scratch, or no tile).
        self.tile_of: dict[str, int | None] = {name: _weight_tile(b, len(placement.tiles))
                                               for name, b in program.buffers.items()}

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

    def _allowed_text(self) -> str:
        return _list(self.allowed)

    # -- 1. chiplets ---------------------------------------------------------------------

    def check_chiplets(self) -> None:
        placement, target = self.placement, self.target
        unknown = sorted(c for c in self.allowed if not 0 <= c < target.num_chiplets)
        if unknown:
            raise self.fail("unknown-chiplet", f"allowed chiplet {unknown[0]} does not exist: the target "
                            f"'{target.name}' has chiplets 0..{target.num_chiplets - 1}")
        if (placement.num_chiplets, placement.num_cards) != (target.num_chiplets, target.cards):
            raise self.fail("wrong-target", f"the placement is for {placement.num_chiplets} chiplets on "
                            f"{placement.num_cards} card(s) but the target '{target.name}' has "
                            f"{target.num_chiplets} on {target.cards}")
        num_c = placement.num_chiplets
        for t, (w, c) in enumerate(zip(placement.where, placement.compute_chiplet, strict=True)):
            if w < num_c and w not in self.allowed:
                raise self.fail("outside-chiplets", f"tile t{t} is resident on chiplet {w}, outside the allowed "
                                f"chiplets {self._allowed_text()}", stream=w)
            if c not in self.allowed:
                raise self.fail("outside-chiplets", f"tile t{t} computes on chiplet {c}, outside the allowed "
                                f"chiplets {self._allowed_text()}", stream=c)
            if w >= num_c:
                card = w - num_c
                if card >= target.cards:
                    raise self.fail("wrong-card", f"tile t{t} streams from card {card} but the target has "
                                    f"{target.cards} card(s)")
                if target.card_of(c) != card:  # the staging buffer sits on a chiplet of the streaming card
                    raise self.fail("wrong-card", f"tile t{t} streams from card {card} but computes on chiplet {c} "
                                    f"of card {target.card_of(c)}", stream=c)
        for b in self.program.buffers.values():
            if b.chiplet not in self.allowed:
                raise self.fail("outside-chiplets", f"buffer '{b.name}' lies on chiplet {b.chiplet}, outside the "
                                f"allowed chiplets {self._allowed_text()}", stream=b.chiplet)
        for c in sorted(self.program.streams):
            if c not in self.allowed:
                raise self.fail("outside-chiplets", f"stream {c} runs on a chiplet outside the allowed chiplets "
                                f"{self._allowed_text()}", stream=c)

    # -- 2. buffers ----------------------------------------------------------------------

    def check_buffers(self) -> None:
        placement = self.placement
        num_c = placement.num_chiplets
        has_buffer: set[int] = set()
        for name, b in self.program.buffers.items():
            tile = self.tile_of[name]
            if b.tile and _WEIGHT_TILE.match(b.tile) and tile is None:
                raise self.fail("unknown-tile", f"buffer '{name}' holds tile {b.tile} but the placement has "
                                f"tiles t0..t{len(placement.tiles) - 1}", stream=b.chiplet)
            if b.kind != "resident":
                continue
            if tile is None:
                raise self.fail("unknown-tile", f"resident buffer '{name}' names no tile of the placement "
                                f"(tile='{b.tile}')", stream=b.chiplet)
            w = placement.where[tile]
            if w != b.chiplet:
                where = f"resident on chiplet {w}" if w < num_c else f"streamed from card {w - num_c}"
                raise self.fail("wrong-chiplet", f"resident buffer '{name}' holds tile t{tile} on chiplet "
                                f"{b.chiplet} but the placement has it {where}", stream=b.chiplet)
            has_buffer.add(tile)
        for t, w in enumerate(placement.where):
            if w < num_c and t not in has_buffer:
                raise self.fail("missing-resident", f"tile t{t} is resident on chiplet {w} but the program "
                                f"declares no resident buffer for it", stream=w)
        for c in sorted(self.held):
            if self.held[c] > self.sram_bytes:
                by_kind: dict[str, int] = {}
                for b in self.program.buffers.values():
                    if b.chiplet == c and b.kind != "staging":
                        by_kind[b.kind] = by_kind.get(b.kind, 0) + b.bytes
                parts = ", ".join(f"{kind} {n:,}" for kind, n in sorted(by_kind.items()))
                raise self.fail("over-capacity", f"chiplet {c} holds {self.held[c]:,} bytes for the whole program "
                                f"({parts}) but has {self.sram_bytes:,} bytes of SRAM", stream=c)

    def _held_bytes(self) -> dict[int, int]:
        """Per chiplet: the buffers held for the whole program (everything but staging)."""
        held: dict[int, int] = {}
        for b in self.program.buffers.values():
            if b.kind != "staging":
                held[b.chiplet] = held.get(b.chiplet, 0) + b.bytes
        return held

    # -- 3. one stream -------------------------------------------------------------------

    def check_stream(self, c: int) -> _StreamFacts:
        facts = _StreamFacts(c)
        live: dict[str, int] = {}  # staging buffer -> step of its load
        waited: set[str] = set()  # live buffers waited for
        freed: dict[str, int] = {}  # staging buffer -> step of its last free
        staged_bytes = 0
        instructions = self.program.streams[c]
        for step, ins in enumerate(instructions):
            op = ins.op
            if op == "load":
                name = ins["buf"]
                b = self._use(c, step, ins, name)
                self._check_load(c, step, ins, b)
                if name in live:
                    raise self.fail("double-load", f"load '{name}' again while it is live (loaded at step "
                                    f"{live[name]}, not freed)", c, step)
                live[name] = step
                waited.discard(name)
                staged_bytes += b.bytes
                if self.held.get(c, 0) + staged_bytes > self.sram_bytes:
                    raise self.fail("over-capacity", f"load '{name}' ({b.bytes:,} bytes) brings chiplet {c} to "
                                    f"{self.held.get(c, 0) + staged_bytes:,} bytes ({self.held.get(c, 0):,} held, "
                                    f"{staged_bytes:,} staged in {len(live)} buffer(s)) but it has "
                                    f"{self.sram_bytes:,} bytes of SRAM", c, step)
            elif op == "wait":
                name = ins["event"]
                event_buffer = self.program.buffers.get(name)
                if event_buffer is None or event_buffer.kind != "staging" or event_buffer.chiplet != c:
                    facts.waits.append((step, ins))  # a signal's event (or a bad wait): matched later
                elif name in live:
                    waited.add(name)
                elif name not in freed:
                    raise self.fail("missing-load", f"wait for staging buffer '{name}' "
                                    f"{self._load_after(c, step, name)}", c, step)
            elif op == "compute":
                for name in ins["bufs"]:
                    b = self._use(c, step, ins, name)
                    if b.kind != "staging":
                        continue
                    what = f"compute '{ins['node']}' reads staging buffer '{name}'"
                    if name in live:
                        if name not in waited:
                            raise self.fail("missing-wait", f"{what} (loaded at step {live[name]}) with no wait "
                                            f"on its load before it", c, step)
                    elif name in freed:
                        raise self.fail("use-after-free", f"{what} that was freed at step {freed[name]}", c, step)
                    else:
                        raise self.fail("missing-load", f"{what} {self._load_after(c, step, name)}", c, step)
            elif op == "free":
                name = ins["buf"]
                b = self._use(c, step, ins, name)
                if b.kind != "staging":
                    raise self.fail("not-staging", f"free '{name}' of a {b.kind} buffer: only staging buffers "
                                    f"are freed", c, step)
                if name not in live:
                    if name in freed:
                        raise self.fail("double-free", f"free '{name}' again (freed at step {freed[name]})", c, step)
                    raise self.fail("missing-load", f"free of staging buffer '{name}' "
                                    f"{self._load_after(c, step, name)}", c, step)
                del live[name]
                waited.discard(name)
                freed[name] = step
                staged_bytes -= b.bytes
            elif op == "send":
                if ins["to"] not in self.allowed:
                    raise self.fail("outside-chiplets", f"send '{ins['value']}' to chiplet {ins['to']}, outside the "
                                    f"allowed chiplets {self._allowed_text()}", c, step)
                facts.sends.append((step, ins))
            elif op == "recv":
                if ins["src"] not in self.allowed:
                    raise self.fail("outside-chiplets", f"recv '{ins['value']}' from chiplet {ins['src']}, outside "
                                    f"the allowed chiplets {self._allowed_text()}", c, step)
                facts.recvs.append((step, ins))
            elif op == "signal":
                facts.signals.append((step, ins))
        if live:
            name, step = min(live.items(), key=lambda item: item[1])
            raise self.fail("unfreed-buffer", f"staging buffer '{name}' loaded here is never freed "
                            f"({len(live)} buffer(s) live at the end of stream {c})", c, step)
        return facts

    def _use(self, c: int, step: int, ins: Instr, name: str) -> Buffer:
        """The buffer `ins` names, declared, on this chiplet, and with its tile where it belongs."""
        b = self.program.buffers.get(name)
        if b is None:
            raise self.fail("undeclared-buffer", f"{ins.op} names buffer '{name}' that the program does not "
                            f"declare", c, step)
        if b.chiplet != c:
            raise self.fail("wrong-chiplet", f"{ins.op} names buffer '{name}' of chiplet {b.chiplet} on "
                            f"chiplet {c}", c, step)
        tile = self.tile_of[name]
        if tile is not None and b.kind == "staging" and self.placement.compute_chiplet[tile] != c:
            raise self.fail("wrong-chiplet", f"{ins.op} uses tile t{tile} (buffer '{name}') on chiplet {c} but it "
                            f"computes on chiplet {self.placement.compute_chiplet[tile]}", c, step)
        if tile is not None and b.kind == "resident" and self.placement.where[tile] != c:
            raise self.fail("wrong-chiplet", f"{ins.op} reads resident tile t{tile} on chiplet {c} but it is "
                            f"resident on {self.placement.where[tile]}", c, step)
        return b

    def _check_load(self, c: int, step: int, ins: Instr, b: Buffer) -> None:
        name, card = b.name, ins["card"]
        if b.kind != "staging":
            raise self.fail("not-staging", f"load '{name}' into a {b.kind} buffer: loads fill staging buffers",
                            c, step)
        if not 0 <= card < self.target.cards:
            raise self.fail("wrong-card", f"load '{name}' from card {card} but the target has "
                            f"{self.target.cards} card(s)", c, step)
        tile = self.tile_of[name]
        if tile is not None:
            streamed_from = self.placement.streaming_card(tile)
            if streamed_from is None:
                raise self.fail("wrong-card", f"load '{name}' streams tile t{tile} from card {card} but the placement "
                                f"keeps it resident on chiplet {self.placement.where[tile]}", c, step)
            if card != streamed_from:
                raise self.fail("wrong-card", f"load '{name}' streams tile t{tile} from card {card} but the "
                                f"placement streams it from card {streamed_from}", c, step)
        if ins["bytes"] > b.bytes:
            raise self.fail("load-size", f"load '{name}' brings {ins['bytes']:,} bytes into a buffer of "
                            f"{b.bytes:,}", c, step)

    def _load_after(self, c: int, step: int, name: str) -> str:
        """How a buffer used at `step` lacks its load: none at all, or one only later (error path only)."""
        for later, ins in enumerate(self.program.streams[c][step + 1:], start=step + 1):
            if ins.op == "load" and ins["buf"] == name:
                return f"before its load at step {later}"
        return "that is never loaded"

    # -- 4. transfers and events ---------------------------------------------------------

    def check_transfers(self, streams: list[_StreamFacts]) -> None:
        # (value, src, dst) -> [(step, bytes)] of the sends and of the recvs.
        sends: dict[tuple[str, int, int], list[tuple[int, int]]] = {}
        recvs: dict[tuple[str, int, int], list[tuple[int, int]]] = {}
        signals: set[str] = set()
        for s in streams:
            for step, ins in s.sends:
                sends.setdefault((ins["value"], s.chiplet, ins["to"]), []).append((step, ins["bytes"]))
            for step, ins in s.recvs:
                recvs.setdefault((ins["value"], ins["src"], s.chiplet), []).append((step, ins["bytes"]))
            signals.update(ins["event"] for _, ins in s.signals)
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
        for s in streams:
            for step, ins in s.waits:
                event = ins["event"]
                if event in signals:
                    continue
                b = self.program.buffers.get(event)
                why = (f"it is a staging buffer of chiplet {b.chiplet}: a stream waits only on its own loads"
                       if b is not None and b.kind == "staging" and b.chiplet != s.chiplet
                       else "no stream signals it and it is not a load of this stream")
                raise self.fail("unmatched-wait", f"wait '{event}' can never fire: {why}", s.chiplet, step)

    # -- 5. deadlock ---------------------------------------------------------------------

    def check_deadlock(self) -> None:
        """Run the streams without time: each runs until it blocks on something not yet released.
        Releases are permanent, so the order the streams run in does not change which finish;
        each instruction is executed once, so this is linear."""
        streams = self.program.streams
        pc = dict.fromkeys(streams, 0)
        released: set[tuple[Any, ...]] = set()
        waiting: dict[tuple[Any, ...], list[int]] = {}
        runnable = deque(sorted(streams))

        def release(key: tuple[Any, ...]) -> None:
            released.add(key)
            runnable.extend(waiting.pop(key, ()))

        while runnable:
            c = runnable.popleft()
            instructions = streams[c]
            while pc[c] < len(instructions):
                ins = instructions[pc[c]]
                if ins.op in ("recv", "wait"):
                    key = _block_key(c, ins)
                    if key not in released:
                        waiting.setdefault(key, []).append(c)
                        break
                elif ins.op in ("send", "signal", "load"):
                    release(_release_key(c, ins))
                pc[c] += 1
        blocked = {c: pc[c] for c in sorted(streams) if pc[c] < len(streams[c])}
        if blocked:
            raise self._deadlock(blocked)

    def _deadlock(self, blocked: dict[int, int]) -> PlanCheckError:
        """Name the cycle: each blocked stream waits on the stream that would release it (the
        sender, or a signaller). That one is blocked too (transfers and waits were matched
        before), so following the edges from any blocked stream ends in a cycle."""
        streams = self.program.streams
        signallers: dict[str, list[int]] = {}
        for c in sorted(streams):
            for ins in streams[c]:
                if ins.op == "signal":
                    signallers.setdefault(ins["event"], []).append(c)

        def waits_on(c: int) -> int:
            ins = streams[c][blocked[c]]
            if ins.op == "recv":
                return int(ins["src"])
            return next((s for s in signallers.get(ins["event"], []) if s in blocked), c)

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


def _block_key(c: int, ins: Instr) -> tuple[Any, ...]:
    if ins.op == "recv":
        return ("transfer", ins["value"], ins["src"], c)
    return ("event", ins["event"])


def _release_key(c: int, ins: Instr) -> tuple[Any, ...]:
    if ins.op == "send":
        return ("transfer", ins["value"], c, ins["to"])
    if ins.op == "load":
        return ("event", ins["buf"])
    return ("event", ins["event"])


def _weight_tile(b: Buffer, num_tiles: int) -> int | None:
    """The weight tile a buffer holds ("tN"), or None (KV blocks, scratch, tiles out of range)."""
    match = _WEIGHT_TILE.match(b.tile)
    return int(match.group(1)) if match and int(match.group(1)) < num_tiles else None


def _list(chiplets: Iterable[int]) -> str:
    return ", ".join(str(c) for c in sorted(chiplets))
