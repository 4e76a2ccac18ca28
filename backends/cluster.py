"""Multi-card plans across processes: one rank per card, on torch.distributed (gloo on the CPU).

    session = Session("build/model.avc", world=4)     # rank 0 here; ranks 1..3 spawned
    session.run(feeds); session.close()

    torchrun --standalone --nproc-per-node 4 -m aviatorc.worker build/model.avc --inputs f.npz --output o.npz

Rank r runs the streams of card r's chiplets (`aviatorc.backends.distributed.RankBackend`) and
reads only the tiles they use. Rank 0 drives: for each run it sends every rank a command (the
phase) and the graph inputs that rank's streams read (so each rank gets only its layers' KV
cache), runs its own streams, then collects each rank's report (instruction counts, bytes, the
messages per chiplet-to-chiplet edge, wall-clock spans) and the graph outputs, picking the
holder the single-process sim would pick, so outputs are bit-identical to it.

Faults: a rank whose run raises sends its error to rank 0, which raises a `RankFailed` naming
the rank, stream and step; a rank that dies is seen by rank 0 (its process exits) while it
waits; a wait past `timeout_s` is a fault. Rank 0 then tears the group down and kills the ranks
it spawned; the session cannot run again.

Message tags: each phase's cross-card sends use tags from `phase_index << 20`; the driver's
control messages live above `CONTROL`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
from aviatorc.backends.contract import NotRunnableError, RankFailed, RunCounts, RuntimeFault, WeightStore

from aviatorc.errors import OptionError
from aviatorc.ir import Graph
from aviatorc.plan.artifact import Artifact
from aviatorc.plan.ir import INSTRUCTIONS, Compute, Program, Send
from aviatorc.target import Target

CONTROL = 1 << 28
JOIN_S = 60.0  # the least time ranks are given to start and join
GROUP_TIMEOUT = timedelta(days=7)  # gloo's own limit on a wait; ours are `timeout_s`, polled
_REPORT, _FEEDS, _OUTPUTS = CONTROL + 2, CONTROL + (1 << 20), CONTROL + (2 << 20)
ERROR_LINE = "aviatorc-rank-error: "  # a failing rank's last stderr line, then JSON
LINK_DEATH_GRACE_S = 1.0  # how long a broken link waits to see which rank died (it may not be reaped yet)
_OPS = sorted(INSTRUCTIONS)
RUN, STOP = 1, 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def needed_inputs(program: Program, graph: Graph, chiplets: set[int]) -> list[str]:
    """The graph inputs the streams of `chiplets` read: what the driver sends that rank."""
    names = {v.name for v in graph.inputs}
    nodes = {n.name: n for n in graph.nodes}
    needed: set[str] = set()
    for c, _, ins in program.instructions():
        if c not in chiplets:
            continue
        if isinstance(ins, Compute):
            needed |= {v.name for v in nodes[ins.node].inputs if v is not None and v.name in names}
        elif isinstance(ins, Send) and ins.value.part is None and ins.value.name in names:
            needed.add(ins.value.name)
    return sorted(needed)


@dataclass
class RankReport:
    """What one rank's run did (sent to rank 0 as one int64 array)."""

    instructions: Counter[str] = field(default_factory=Counter)
    bytes_loaded: int = 0
    bytes_sent: int = 0
    tile_bytes_read: int = 0
    peak_sram_bytes: dict[int, int] = field(default_factory=dict)
    edges: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)  # (src, dst) -> (messages, bytes)
    spans: list[tuple[int, int, int, int]] = field(default_factory=list)  # chiplet, step, start ns, duration ns

    def encode(self) -> np.ndarray:
        out = [self.bytes_loaded, self.bytes_sent, self.tile_bytes_read, len(_OPS)]
        out += [self.instructions.get(op, 0) for op in _OPS]
        out += [len(self.peak_sram_bytes), *[x for c, b in sorted(self.peak_sram_bytes.items()) for x in (c, b)]]
        out += [len(self.edges), *[x for (s, d), (m, b) in sorted(self.edges.items()) for x in (s, d, m, b)]]
        out += [len(self.spans), *[x for span in self.spans for x in span]]
        return np.array(out, dtype=np.int64)

    @classmethod
    def decode(cls, data: np.ndarray) -> RankReport:
        values = [int(x) for x in data]
        report = cls(bytes_loaded=values[0], bytes_sent=values[1], tile_bytes_read=values[2])
        at = 4
        report.instructions = Counter({op: n for op, n in zip(_OPS, values[at:at + values[3]]) if n})
        at += values[3]
        count, at = values[at], at + 1
        report.peak_sram_bytes = {values[at + 2 * i]: values[at + 2 * i + 1] for i in range(count)}
        at += 2 * count
        count, at = values[at], at + 1
        report.edges = {(values[at + 4 * i], values[at + 4 * i + 1]): (values[at + 4 * i + 2], values[at + 4 * i + 3])
                        for i in range(count)}
        at += 4 * count
        count, at = values[at], at + 1
        report.spans = [tuple(values[at + 4 * i:at + 4 * i + 4]) for i in range(count)]  # type: ignore[misc]
        return report


def _report_of(run: Any, weights: WeightStore) -> RankReport:
    return RankReport(Counter(run.ops), run.counts.bytes_loaded, run.counts.bytes_sent, weights.tile_bytes_read,
                      {c: run.rules.peak.get(c, 0) for c in run.chiplets},
                      {edge: (m, b) for edge, (m, b) in run.edges.items()}, list(run.spans))


class _Rank:
    """One rank's backends (one per phase) and its link, built the same way on every rank."""

    def __init__(self, artifact: Artifact, graph: Graph, target: Target, weights: WeightStore, rank: int, world: int,
                 timeout_s: float, watchdog: Any) -> None:
        from aviatorc.backends.distributed import Link, RankBackend

        per_card = target.chiplets_per_card
        self.rank, self.world, self.graph, self.weights = rank, world, graph, weights
        self.link = Link(lambda c: c // per_card, watchdog=watchdog, timeout_s=timeout_s)
        self.phases = sorted(artifact.programs)
        self.backends = {phase: RankBackend(artifact.programs[phase], graph, weights, sram_bytes=target.chiplet.sram_bytes,
                                            rank=rank, link=self.link, tag_base=index << 20)
                         for index, phase in enumerate(self.phases)}
        for backend in self.backends.values():
            backend.record = True
            backend.link_dtype = artifact.plan.memory.link_dtype
        self.needed = {phase: {r: needed_inputs(artifact.programs[phase], graph,
                                                {c for c in artifact.programs[phase].streams if c // per_card == r})
                               for r in range(world)} for phase in self.phases}

    def run(self, phase: str, feeds: dict[str, np.ndarray]) -> tuple[Any, RankReport]:
        run = self.backends[phase].run_local(feeds)
        return run, _report_of(run, self.weights)

    def send_outputs(self, run: Any) -> None:
        """Each graph output to rank 0: its holder key (absent, or whole-before-parts and -chiplet), then the array."""
        held = run.local_outputs()
        for j, value in enumerate(self.graph.outputs):
            found = held.get(value.name)
            key = np.array([0, 0, 0] if found is None else [1, int(found[0][0]), found[0][1]], dtype=np.int64)
            self.link.send(key, 0, _OUTPUTS + 4 * j)
            if found is not None:
                self.link.send(found[1], 0, _OUTPUTS + 4 * j + 2)


# -- rank 0: the driver ------------------------------------------------------------------------


class Cluster:
    """Rank 0 of a world of `world` ranks, one per card of the plan's target. Ranks 1.. are spawned
    (`python -m aviatorc.worker`), unless torch.distributed is already up (torchrun)."""

    def __init__(self, artifact: Artifact, graph: Graph, target: Target, weights: WeightStore, world: int, *,
                 timeout_s: float = 60.0, backend: str = "auto") -> None:
        import torch.distributed as dist

        if world != target.cards:
            raise OptionError(f"world={world} but the plan's target has {target.cards} card(s): one rank runs each card",
                              file=str(artifact.path), hint=f"use world={target.cards}")
        # The sim device computes on the host, so its messages are host arrays: gloo carries them.
        # NCCL belongs to a multi-card cuda device, which does not exist yet.
        if backend == "auto":
            backend = "gloo"
        if backend != "gloo":
            raise NotRunnableError(f"the '{backend}' backend is not implemented for multi-card runs yet",
                                   hint="backend='gloo' (the sim device's arrays live on the host)")
        self.world, self.timeout_s = world, timeout_s
        self.failed: str | None = None
        self.closed = False
        self.children: list[subprocess.Popen[bytes]] = []
        self.logs: list[Any] = []
        # Attach only to the group torchrun made for this process; any other open group belongs to
        # another multi-card session here, whose ranks serve another plan.
        self.attached = dist.is_initialized() and "TORCHELASTIC_RUN_ID" in os.environ
        if dist.is_initialized() and not self.attached:
            raise OptionError("another multi-card session is open in this process", hint="close() it first")
        if self.attached:
            if dist.get_world_size() != world or dist.get_rank() != 0:
                raise OptionError(f"torch.distributed runs {dist.get_world_size()} ranks (this is rank "
                                  f"{dist.get_rank()}), not {world} with this one as rank 0")
        self._finalizer = weakref.finalize(self, _stop, self.children, not self.attached)
        if not self.attached:
            self._spawn(artifact.path)
        self.rank = _Rank(artifact, graph, target, weights, 0, world, timeout_s, self._watchdog)
        self.last: list[RankReport] = []
        self.last_phase = self.rank.phases[0]

    def _spawn(self, path: Path) -> None:
        """Start ranks 1.. and join them in a group; a rank that exits before joining fails it at once."""
        import threading

        import torch.distributed as dist

        init = f"tcp://127.0.0.1:{_free_port()}"
        for r in range(1, self.world):
            log = tempfile.TemporaryFile()
            self.logs.append(log)
            self.children.append(subprocess.Popen(
                [sys.executable, "-m", "aviatorc.worker", str(path), "--rank", str(r), "--world", str(self.world),
                 "--init", init, "--timeout", str(self.timeout_s), "--parent", str(os.getpid())],
                stdout=subprocess.DEVNULL, stderr=log))
        joined: list[BaseException | None] = []

        def join() -> None:
            try:  # the group's own timeout is long: waits are timed here, so an idle session stays up
                dist.init_process_group("gloo", init_method=init, rank=0, world_size=self.world,
                                        timeout=GROUP_TIMEOUT)
                joined.append(None)
            except BaseException as error:  # noqa: BLE001 - reported below
                joined.append(error)

        thread = threading.Thread(target=join, daemon=True, name="join ranks")
        thread.start()
        # A rank imports torch before it joins: seconds on a busy machine, whatever the run's timeout.
        join_s = max(self.timeout_s, JOIN_S)
        deadline = time.monotonic() + join_s
        try:
            while not joined:
                self._watchdog()
                if time.monotonic() > deadline:
                    raise RuntimeFault(f"the ranks did not join within {join_s:g} s", rule="rank-failed")
                thread.join(0.02)
            if joined[0] is not None:
                raise RuntimeFault(f"the ranks did not join: {joined[0]}", rule="rank-failed")
        except BaseException:
            self._teardown()
            raise

    def backend(self, phase: str) -> DriverBackend:
        return DriverBackend(self, phase)

    def _watchdog(self) -> None:
        """Raise `RankFailed` for a spawned rank that exited."""
        failed = self._exited_rank()
        if failed is not None:
            raise failed

    def _exited_rank(self, grace_s: float = 0.0) -> RankFailed | None:
        """A `RankFailed` for the first spawned rank that exited: with its own error, which a rank that
        fails writes as one `ERROR_LINE` JSON line on stderr before it exits; None while all run
        (after waiting up to `grace_s` for one to be seen exiting)."""
        deadline = time.monotonic() + grace_s
        while True:
            found = self._first_exited()
            if found is not None or time.monotonic() >= deadline:
                return found
            time.sleep(0.01)

    def _first_exited(self) -> RankFailed | None:
        for r, child in enumerate(self.children, start=1):
            code = child.poll()
            if code is None:
                continue
            log = self.logs[r - 1]
            log.seek(0)
            lines = log.read().decode(errors="replace").splitlines()
            reported = [line[len(ERROR_LINE):] for line in lines if line.startswith(ERROR_LINE)]
            if reported:
                info = json.loads(reported[-1])
                return RankFailed(info["message"], rank=r, rule=info.get("rule") or "rank-failed",
                                  stream=info.get("stream"), step=info.get("step"))
            tail = f": {lines[-1].strip()}" if lines else ""
            return RankFailed(f"its process exited with status {code}{tail}", rank=r)
        return None

    def run(self, phase: str, feeds: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], Any]:

        if self.failed is not None or self.closed:
            raise NotRunnableError(f"this multi-card session stopped after a fault ({self.failed})" if self.failed
                                   else "this multi-card session is closed", hint="open a new Session")
        try:
            link, index = self.rank.link, self.rank.phases.index(phase)
            for r in range(1, self.world):
                link.send(np.array([RUN, index], dtype=np.int64), r, CONTROL)
                for i, name in enumerate(self.rank.needed[phase][r]):
                    link.send(feeds[name], r, _FEEDS + 2 * i)
            run, own = self.rank.run(phase, feeds)
            reports = [own] + [RankReport.decode(link.receive(r, _REPORT, f"rank {r}'s report"))
                               for r in range(1, self.world)]
            outputs = self._outputs(run)
            link.flush()
        except BaseException as error:  # a fault, a broken link, Ctrl-C: the ranks' state is unknown now
            self.failed = str(error) or type(error).__name__
            # A link that broke because a rank died (gloo may notice before the watchdog, and even
            # before the dead process can be reaped): that rank's failure, read before the teardown
            # ends the others too.
            died = self._exited_rank(grace_s=LINK_DEATH_GRACE_S) \
                if isinstance(error, Exception) and not isinstance(error, RuntimeFault) else None
            self._teardown()
            if died is not None:
                raise died from error
            if isinstance(error, RuntimeFault) or not isinstance(error, Exception):
                raise
            raise RuntimeFault(f"the multi-card run failed: {type(error).__name__}: {error}", rule="link") from error
        self.last, self.last_phase = reports, phase
        counts = RunCounts(instructions=dict(sorted(sum((r.instructions for r in reports), Counter()).items())),
                           bytes_loaded=sum(r.bytes_loaded for r in reports),
                           bytes_sent=sum(r.bytes_sent for r in reports),
                           peak_sram_bytes={c: b for r in reports for c, b in sorted(r.peak_sram_bytes.items())})
        counts.extra["distributed"] = {
            "world": self.world, "backend": "gloo",
            "edges": {f"{s}->{d}": {"messages": m, "bytes": b}
                      for r in reports for (s, d), (m, b) in sorted(r.edges.items())},
            "tile_bytes_read_by_rank": [r.tile_bytes_read for r in reports]}
        return outputs, counts

    def _outputs(self, run: Any) -> dict[str, np.ndarray]:
        """Each graph output from the rank holding it the way the sim would pick (see `_Rank.send_outputs`)."""
        link = self.rank.link
        held = run.local_outputs()
        result = {}
        for j, value in enumerate(self.rank.graph.outputs):
            candidates = []
            if value.name in held:
                candidates.append((held[value.name][0], held[value.name][1]))
            for r in range(1, self.world):
                key = link.receive(r, _OUTPUTS + 4 * j, f"rank {r}'s output '{value.name}'")
                if key[0]:
                    array = link.receive(r, _OUTPUTS + 4 * j + 2, f"rank {r}'s output '{value.name}'")
                    candidates.append(((bool(key[1]), int(key[2])), array))
            if value.name in run.feeds:
                result[value.name] = run.feeds[value.name]
            elif candidates:
                result[value.name] = max(candidates, key=lambda item: item[0])[1]
            else:
                raise RuntimeFault(f"the program never computes the graph output '{value.name}'", rule="missing-value",
                                   value=value.name)
        return result

    def trace(self) -> dict[str, Any]:
        """The last run as Chrome trace / Perfetto JSON: a process per rank, a track per chiplet,
        each instruction a span of its measured wall time; the messages per edge in its metadata."""
        from aviatorc.plan.ir import format_instr

        events: list[dict[str, Any]] = []
        start = min((s[2] for r in self.last for s in r.spans), default=0)
        for rank, report in enumerate(self.last):
            events.append({"ph": "M", "pid": rank, "name": "process_name", "args": {"name": f"rank {rank}"}})
            for c in sorted({s[0] for s in report.spans}):
                events.append({"ph": "M", "pid": rank, "tid": c, "name": "thread_name", "args": {"name": f"chiplet {c}"}})
            for c, step, begin, duration in report.spans:
                ins = self.rank.backends[self.last_phase].program.streams[c][step]
                events.append({"ph": "X", "pid": rank, "tid": c, "ts": (begin - start) / 1e3,
                               "dur": max(duration / 1e3, 0.001), "name": ins.op, "args": {"instr": format_instr(ins)}})
        edges = {f"{s}->{d}": {"messages": m, "bytes": b} for r in self.last for (s, d), (m, b) in r.edges.items()}
        return {"traceEvents": events, "displayTimeUnit": "ns", "metadata": {"edges": edges, "world": self.world}}

    def close(self) -> None:
        """Stop the ranks (a no-op the second time)."""
        if self.closed:
            return
        graceful = self.failed is None
        if graceful:
            try:
                for r in range(1, self.world):
                    self.rank.link.send(np.array([STOP, 0], dtype=np.int64), r, CONTROL)
                self.rank.link.flush()
            except Exception:  # noqa: BLE001 - a rank already gone: stopping it is moot
                graceful = False
        self._teardown(graceful=graceful)

    def _teardown(self, graceful: bool = False) -> None:
        self.closed = True
        self._finalizer.detach()
        _stop(self.children, not self.attached, grace_s=10.0 if graceful else 0.0)


def _stop(children: list[subprocess.Popen[bytes]], owns_group: bool, grace_s: float = 0.0) -> None:
    """End the spawned ranks (after `grace_s` to exit by themselves), reap them, and drop the group
    this process made. Also the finalizer of a cluster dropped without `close()`."""
    import torch.distributed as dist

    for child in children:
        if grace_s:
            try:
                child.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        if child.poll() is None:
            child.kill()
        child.wait()
    if owns_group and dist.is_initialized():
        dist.destroy_process_group()


class DriverBackend:
    """A phase of a multi-card plan as a Session backend: `run(feeds) -> (outputs, counts)`."""

    def __init__(self, cluster: Cluster, phase: str) -> None:
        self.cluster, self.phase = cluster, phase

    def run(self, feeds: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], Any]:
        return self.cluster.run(self.phase, dict(feeds))


# -- ranks 1..N-1 ------------------------------------------------------------------------------


def serve_rank(path: str | Path, rank: int, world: int, *, init: str | None, timeout_s: float,
               parent: int | None = None) -> None:
    """Run rank `rank` until rank 0 says stop: each command, a run of one phase on the fed inputs."""
    import torch.distributed as dist

    from aviatorc.plan.artifact import load

    def watchdog() -> None:
        if parent is not None and os.getppid() != parent:  # the driver died: nobody will stop us
            os._exit(1)

    watchdog()
    if init is not None:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=GROUP_TIMEOUT)

    artifact = load(path)
    graph = artifact.graph()
    weights = WeightStore(artifact, graph)
    me = _Rank(artifact, graph, artifact.target(), weights, rank, world, timeout_s, watchdog)
    link = me.link
    while True:
        command = _wait_for_command(link, watchdog)
        if int(command[0]) == STOP:
            break
        phase = me.phases[int(command[1])]
        try:
            feeds = {name: link.receive(0, _FEEDS + 2 * i, f"input '{name}'")
                     for i, name in enumerate(me.needed[phase][rank])}
            run, report = me.run(phase, feeds)
            link.send(report.encode(), 0, _REPORT)
            me.send_outputs(run)
            link.flush()
        except Exception as error:  # noqa: BLE001 - reported to the driver, which raises it
            fields = {"message": str(error) if isinstance(error, RuntimeFault) else f"{type(error).__name__}: {error}",
                      "rule": getattr(error, "rule", None), "stream": getattr(error, "stream", None),
                      "step": getattr(error, "step", None)}
            print(ERROR_LINE + json.dumps(fields), file=sys.stderr, flush=True)
            os._exit(1)  # the driver sees the exit and reads the line; nothing here can be trusted to finish
    link.flush()
    dist.destroy_process_group()


def _wait_for_command(link: Any, watchdog: Any) -> np.ndarray:
    """The next command from rank 0; idle as long as it takes (a session may sit between runs)."""
    while True:
        command = link.poll(0, CONTROL)
        if command is not None:
            return command
        watchdog()
        time.sleep(0.002)
