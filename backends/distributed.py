"""One card's share of a plan, in its own process: the sim backend's run over torch.distributed.

    link = Link(rank_of_chiplet=lambda c: c // chiplets_per_card, watchdog=..., timeout_s=60)
    backend = RankBackend(program, graph, weights, sram_bytes=..., rank=r, link=link, tag_base=...)
    outputs, counts = backend.run(feeds)       # this rank's streams only

A rank runs the streams of its card's chiplets with the sim's semantics and checks
(`aviatorc.backends.sim`); within the card, `send`/`recv` pass arrays in memory as there. A
`send` to a chiplet on another card becomes `torch.distributed.isend` and the matching `recv` an
`irecv` polled as the streams run, so a stream waiting on another card lets this card's other
streams go on (the sim's cooperative order). Each plan message travels as two tensors: a fixed
header (dtype and shape, 80 bytes) and the payload bytes, received into a buffer allocated from
the header. Tags come from the message's place in the sorted list of the program's cross-card
sends (every rank reads the same plan, so they agree), so messages never match out of order.

A recv that waits longer than `timeout_s`, or a `watchdog` that reports a failed peer, ends
the run with a `RuntimeFault` naming the stream and step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from aviatorc.backends.contract import RankFailed, RuntimeFault, WeightStore
from aviatorc.backends.sim import SimBackend, _Run

from aviatorc.ir import Graph
from aviatorc.plan.interpret import BLOCKED
from aviatorc.plan.ir import Instruction, Program, Recv, Send

_DTYPES = ("float32", "float16", "float64", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")
_MAX_RANK = 8
HEADER_LEN = 2 + _MAX_RANK  # dtype code, ndim, dims


def _dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def encode_header(array: np.ndarray) -> np.ndarray:
    if array.ndim > _MAX_RANK or array.dtype.name not in _DTYPES:
        raise ValueError(f"cannot send a {array.dtype}{list(array.shape)} array between ranks")
    header = np.zeros(HEADER_LEN, dtype=np.int64)
    header[0], header[1] = _DTYPES.index(array.dtype.name), array.ndim
    header[2:2 + array.ndim] = array.shape
    return header


def decode_header(header: np.ndarray) -> tuple[np.dtype, tuple[int, ...]]:
    ndim = int(header[1])
    return _dtype(_DTYPES[int(header[0])]), tuple(int(d) for d in header[2:2 + ndim])


@dataclass
class _Pending:
    """A message being received by a helper thread (gloo's p2p works do not report completion
    before `wait`, so a thread waits and the streams poll its flag)."""

    done: threading.Event = field(default_factory=threading.Event)
    array: np.ndarray | None = None
    error: BaseException | None = None


@dataclass
class Link:
    """Messages between this rank and the others. `rank_of_chiplet` maps a chiplet to the rank that
    runs it; `watchdog` raises when a peer has failed (checked while waiting)."""

    rank_of_chiplet: Callable[[int], int]
    watchdog: Callable[[], None] = lambda: None
    timeout_s: float = 60.0
    _sends: list[Any] = field(default_factory=list)
    _pending: dict[tuple[int, int], _Pending] = field(default_factory=dict)

    def send(self, array: np.ndarray, dst: int, tag: int) -> None:
        """Queue `array` to rank `dst` (header on `tag`, payload on `tag + 1`)."""
        import torch
        import torch.distributed as dist

        array = np.ascontiguousarray(array)
        header = torch.from_numpy(encode_header(array))
        self._sends.append((dist.isend(header, dst, tag=tag), header))
        if array.nbytes:
            payload = torch.from_numpy(array.reshape(-1).view(np.uint8).copy())
            self._sends.append((dist.isend(payload, dst, tag=tag + 1), payload))

    def poll(self, src: int, tag: int) -> np.ndarray | None:
        """The array sent on `tag` by rank `src` if it has arrived, else None (its receive started)."""
        key = (src, tag)
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = _Pending()
            threading.Thread(target=_receive, args=(pending, src, tag), daemon=True,
                             name=f"recv {src}:{tag}").start()
        if not pending.done.is_set():
            return None
        del self._pending[key]
        if pending.error is not None:
            # A peer that died explains a broken connection best: give its exit a moment to show.
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                self.watchdog()
                time.sleep(0.02)
            raise RuntimeFault(f"receiving from rank {src} failed: {pending.error}", rule="link")
        return pending.array

    def receive(self, src: int, tag: int, what: str) -> np.ndarray:
        """Block until `poll` gives the array (the watchdog and the timeout apply)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            array = self.poll(src, tag)
            if array is not None:
                return array
            self.pause(deadline, what)

    def pause(self, deadline: float, what: str) -> None:
        """Let a little time pass while waiting; raise at the deadline or when a peer failed."""
        self.watchdog()
        if time.monotonic() > deadline:
            raise RuntimeFault(f"waited {self.timeout_s:g} s for {what}", rule="timeout")
        time.sleep(0.0002)

    def flush(self) -> None:
        """Wait until every queued send has been taken (so its tensors may be dropped)."""
        self.watchdog()
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()


def _receive(pending: _Pending, src: int, tag: int) -> None:
    import torch
    import torch.distributed as dist

    try:
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        dist.recv(header, src, tag=tag)
        dtype, shape = decode_header(header.numpy())
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        payload = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            dist.recv(payload, src, tag=tag + 1)
        pending.array = payload.numpy().view(dtype).reshape(shape)
    except BaseException as error:  # noqa: BLE001 - handed to the stream that polls for it
        pending.error = error
    finally:
        pending.done.set()


class RankBackend(SimBackend):
    """The streams of rank `rank`'s chiplets; messages to other ranks' chiplets go over `link`."""

    replays = False  # a run's messages to other ranks are part of what it does

    def __init__(self, program: Program, graph: Graph, weights: WeightStore, *, sram_bytes: int, rank: int,
                 link: Link, tag_base: int = 0) -> None:
        super().__init__(program, graph, weights, sram_bytes=sram_bytes)
        self.rank, self.link = rank, link
        self.streams = {c: stream for c, stream in sorted(program.streams.items()) if link.rank_of_chiplet(c) == rank}
        cross = sorted((k for k in self.sends if link.rank_of_chiplet(k[1]) != link.rank_of_chiplet(k[2])),
                       key=lambda k: (str(k[0]), k[1], k[2]))
        self.tags = {key: tag_base + 2 * i for i, key in enumerate(cross)}
        self.record = False  # per-instruction wall-clock spans, for the merged trace

    def _start_run(self, feeds: dict[str, np.ndarray]) -> _RankRun:
        return _RankRun(self, feeds)

    def run_local(self, feeds: dict[str, np.ndarray]) -> _RankRun:
        """Run this rank's streams to their end; the run, for its outputs and counts."""
        run = self._start_run(dict(feeds))
        run.execute()
        self.link.flush()
        return run


class _RankRun(_Run):
    b: RankBackend

    def __init__(self, backend: RankBackend, feeds: dict[str, np.ndarray]) -> None:
        super().__init__(backend, feeds)
        self.edges: dict[tuple[int, int], list[int]] = {}  # (src, dst) chiplet -> [messages, declared bytes]
        self.spans: list[tuple[int, int, int, int]] = []  # (chiplet, step, start ns, duration ns)
        self._waiting_since: float | None = None

    def step(self, c: int, step: int, ins: Instruction, now: float) -> float | None:
        start = time.time_ns() if self.b.record else 0
        after = super().step(c, step, ins, now)
        if after is not BLOCKED and self.b.record:
            self.spans.append((c, step, start, time.time_ns() - start))
        return after

    def _remote(self, chiplet: int) -> int | None:
        """The rank running `chiplet`, when it is not this one."""
        rank = self.b.link.rank_of_chiplet(chiplet)
        return rank if rank != self.b.rank else None

    def on_send(self, c: int, step: int, ins: Send, now: float) -> float:
        edge = self.edges.setdefault((c, ins.to), [0, 0])
        edge[0] += 1
        edge[1] += ins.bytes
        rank = self._remote(ins.to)
        if rank is None:
            return super().on_send(c, step, ins, now)
        self.b.link.send(self.env[self._outgoing(c, step, ins.value)], rank, self.b.tags[(ins.value, c, ins.to)])
        self.counts.bytes_sent += ins.bytes
        return now

    def on_recv(self, c: int, step: int, ins: Recv, now: float) -> float | None:
        rank = self._remote(ins.src)
        key = self.transfer_key(ins.value, ins.src, c)
        if rank is not None and key not in self.mailbox:
            if key not in self.b.tags:
                raise self.fault(c, step, "unmatched-recv", f"no stream sends '{ins.value}' from chiplet "
                                 f"{ins.src} to chiplet {c}")
            self._poll(c, step, ins)  # starts the receive; it is picked up while the streams are stalled
        return super().on_recv(c, step, ins, now)

    def _poll(self, c: int, step: int, ins: Recv) -> bool:
        """Whether the message `ins` waits for has arrived (it is then in the mailbox)."""
        rank = self.b.link.rank_of_chiplet(ins.src)
        key = self.transfer_key(ins.value, ins.src, c)
        try:
            array = self.b.link.poll(rank, self.b.tags[key])
        except RankFailed:
            raise
        except RuntimeFault as error:
            raise self.fault(c, step, error.rule, error.message) from None
        if array is None:
            return False
        self.mailbox[key] = self._new(array)
        self.fire(key, 0.0)
        return True

    def on_stall(self, blocked: dict[int, int]) -> bool:
        """Every stream here is blocked: if one waits on another rank, take what has arrived, or
        wait a little for it (a fault past the timeout); otherwise nothing can come, and the sim
        reports the deadlock."""
        remote = [(c, step, ins) for c, step in blocked.items()
                  for ins in [self.b.streams[c][step]] if isinstance(ins, Recv) and self._remote(ins.src) is not None]
        if not remote:
            return False
        if any([self._poll(c, step, ins) for c, step, ins in remote]):
            self._waiting_since = None
            return True
        if self._waiting_since is None:
            self._waiting_since = time.monotonic()
        c, step, ins = remote[0]
        try:
            self.b.link.pause(self._waiting_since + self.b.link.timeout_s,
                              f"'{ins.value}' from chiplet {ins.src} (rank {self.b.link.rank_of_chiplet(ins.src)})")
        except RankFailed:
            raise
        except RuntimeFault as error:
            raise self.fault(c, step, error.rule, error.message) from None
        return True

    def local_outputs(self) -> dict[str, tuple[tuple[bool, int], np.ndarray]]:
        """The graph outputs this rank holds, each with the sim's preference key (a whole value
        before parts, then the lowest chiplet), so the driver picks the holder the sim would."""
        out = {}
        for value in self.b.graph.outputs:
            holders = [c for c, s in self.chiplets.items() if value.name in s.values or value.name in s.parts]
            if holders:
                best = max(holders, key=lambda c: (value.name in self.chiplets[c].values, -c))
                array = self._read(best, len(self.b.streams[best]) - 1, value.name)
                out[value.name] = ((value.name in self.chiplets[best].values, -best), array)
        return out
