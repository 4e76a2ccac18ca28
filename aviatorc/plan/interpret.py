"""The one loop that walks a program's streams: stream order, events, blocking.

    class Checker(StreamInterpreter):
        def on_load(self, c, step, ins, now): ...; self.fire(ins.buf, now); return now
    Checker(program).run()

Every consumer of a plan (the checker, the timing simulation, the sim, cuda and rank backends)
is a subclass that fills in one hook per instruction kind, `on_<op>(chiplet, step, instruction,
now)`, returning the stream's clock after it (untimed consumers keep every clock at 0), or
`BLOCKED` when the stream must wait. The loop is the same for all of them:

- each stream runs its instructions in order; the stream with the earliest clock goes next
  (ties: the lower chiplet), and runs until it blocks or ends;
- an instruction that claims a shared resource (`Instruction.claims`: a channel, a link, the
  host) waits while another stream stands at an earlier clock, so shared resources are claimed
  in time order (a subclass may add kinds for its run: `claims_also`);
- events: a hook fires a key (`fire`: a load's buffer, a signal's event, a sent value) at a
  time; a blocking hook asks `await_event` / `await_transfer`, which give the time it fired, or
  park the stream until it does;
- when every unfinished stream is parked, `on_stall` may bring something from outside (another
  process's messages) and the loop goes on; otherwise `deadlock` names what is stuck.

One dispatch site: `step` looks up the hook by the instruction's class.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable
from typing import Any

from aviatorc.plan.ir import INSTRUCTIONS, Instruction, Program, ValueRef

BLOCKED = None  # what a hook returns when its stream must wait


class StreamInterpreter:
    """Runs a program's streams; subclasses fill in `on_<op>` for every instruction kind."""

    def __init__(self, program: Program, chiplets: list[int] | None = None) -> None:
        self.program = program
        order = sorted(program.streams) if chiplets is None else sorted(chiplets)
        self.streams: dict[int, list[Instruction]] = {c: program.streams.get(c, []) for c in order}
        self.pc = dict.fromkeys(self.streams, 0)
        self.fired: dict[Hashable, float] = {}
        self._waiting: dict[Hashable, list[int]] = {}
        self._parked: dict[int, float] = {}
        self._queue: list[tuple[float, int]] = []
        self._hooks: dict[type[Instruction], Callable[[int, int, Any, float], float | None]] = {
            cls: getattr(self, f"on_{op}") for op, cls in INSTRUCTIONS.items()}
        self.end_s = 0.0  # the latest clock a stream ended at
        self.claims_also: tuple[type[Instruction], ...] = ()  # kinds that claim a resource in this run too

    # -- the loop ------------------------------------------------------------------------

    def run(self) -> None:
        """Run every stream to its end (or raise what a hook or `deadlock` raises)."""
        self._queue = [(0.0, c) for c in self.streams]
        heapq.heapify(self._queue)
        unfinished = {c for c, stream in self.streams.items() if stream}
        while True:
            while self._queue:
                start, c = heapq.heappop(self._queue)
                end = self._advance(c, start)
                if end is not None:
                    unfinished.discard(c)
                    self.end_s = max(self.end_s, end)
            if not unfinished:
                return
            blocked = {c: self.pc[c] for c in sorted(unfinished)}
            if not self.on_stall(blocked):
                raise self.deadlock(blocked)

    def _advance(self, c: int, now: float) -> float | None:
        """Run stream c from `now` until it blocks (None) or ends (its clock)."""
        stream, queue, step = self.streams[c], self._queue, self.step
        pc = self.pc[c]
        self._parked.pop(c, None)
        while pc < len(stream):
            ins = stream[pc]
            if (ins.claims or isinstance(ins, self.claims_also)) and queue and queue[0][0] < now:
                self.pc[c] = pc
                heapq.heappush(queue, (now, c))  # let the streams behind this clock go first
                return None
            after = step(c, pc, ins, now)
            if after is BLOCKED:
                self.pc[c] = pc
                self._parked[c] = now
                return None
            now = after
            pc += 1
        self.pc[c] = pc
        return now

    def step(self, c: int, step: int, ins: Instruction, now: float) -> float | None:
        """Execute one instruction: the one dispatch site."""
        return self._hooks[type(ins)](c, step, ins, now)

    # -- events --------------------------------------------------------------------------

    def fire(self, key: Hashable, when: float) -> None:
        """`key` happened at `when`: streams parked on it go on from then (or their own clock)."""
        self.fired[key] = when
        for s in self._waiting.pop(key, ()):
            heapq.heappush(self._queue, (max(when, self._parked.get(s, 0.0)), s))

    def await_key(self, c: int, key: Hashable, now: float) -> float | None:
        """The stream's clock once `key` has fired, or BLOCKED (parked until it fires)."""
        when = self.fired.get(key)
        if when is None:
            waiting = self._waiting.setdefault(key, [])
            if c not in waiting:
                waiting.append(c)
            return BLOCKED
        return max(now, when)

    @staticmethod
    def transfer_key(value: ValueRef, src: int, dst: int) -> tuple[ValueRef, int, int]:
        return (value, src, dst)

    def is_waiting(self, key: Hashable) -> bool:
        return key in self._waiting

    # -- what subclasses fill in -----------------------------------------------------------

    def on_stall(self, blocked: dict[int, int]) -> bool:
        """Every unfinished stream is parked (`blocked`: chiplet -> step). Return True if
        something was fired meanwhile (from outside this run), False for a deadlock."""
        return False

    def deadlock(self, blocked: dict[int, int]) -> Exception:
        raise NotImplementedError

    def on_load(self, c: int, step: int, ins: Any, now: float) -> float | None:
        raise NotImplementedError(f"{type(self).__name__} has no rule for 'load'")

    def on_wait(self, c: int, step: int, ins: Any, now: float) -> float | None:
        raise NotImplementedError(f"{type(self).__name__} has no rule for 'wait'")

    def on_signal(self, c: int, step: int, ins: Any, now: float) -> float | None:
        raise NotImplementedError(f"{type(self).__name__} has no rule for 'signal'")

    def on_compute(self, c: int, step: int, ins: Any, now: float) -> float | None:
        raise NotImplementedError(f"{type(self).__name__} has no rule for 'compute'")

    def on_send(self, c: int, step: int, ins: Any, now: float) -> float | None:
        raise NotImplementedError(f"{type(self).__name__} has no rule for 'send'")

    def on_recv(self, c: int, step: int, ins: Any, now: float) -> float | None:
        raise NotImplementedError(f"{type(self).__name__} has no rule for 'recv'")

    def on_free(self, c: int, step: int, ins: Any, now: float) -> float | None:
        raise NotImplementedError(f"{type(self).__name__} has no rule for 'free'")

    def on_store(self, c: int, step: int, ins: Any, now: float) -> float | None:
        raise NotImplementedError(f"{type(self).__name__} has no rule for 'store'")

    def on_host(self, c: int, step: int, ins: Any, now: float) -> float | None:
        raise NotImplementedError(f"{type(self).__name__} has no rule for 'host'")
