"""The `sim` backend: a plan's instruction streams executed on the CPU, computing real outputs.

    backend = SimBackend(program, graph, weights, sram_bytes=target.chiplet.sram_bytes)
    outputs, counts = backend.run(feeds)

Each chiplet has its own values (a dict of name -> array); graph inputs and initializers are
on every chiplet. Streams run in an order the plan's events allow: a stream runs until it
blocks on a `recv` whose `send` has not run yet (or a `wait` on a `signal` not yet fired), then
the next stream runs; a round in which no stream moves is a deadlock. Time is not modelled
here (`aviatorc.schedule.simulate` does that); a `load` lands when it is issued.

What each instruction does (`aviatorc.plan.ir` defines the plan IR):
- `compute node=N part=""`: graph node N with its IR kernel (`aviatorc.ir.ops`) on the values
  on this chiplet; `part=cols:A:B` of a MatMul: `x @ W[:, A:B]` with W the tile of its weight
  buffer, dequantized once per session; `part=rows:A:B` of a Gather: the lookup of the ids in
  [A, B) (zeros for the others); `part=kv:I:N` (chunk I of the KV cache): the node runs whole
  with its last chunk. Parts are kept apart until a reader needs the value on that chiplet;
  then they are assembled (columns concatenated in order, row partials summed), and all of
  the node's parts in the program must be there by then.
- `send V to=D` / `recv V src=S`: V is a value, or a part `name[cols:A:B]`; its array moves.
- `load` / `wait` / `free`: a staging buffer's life, checked as it runs.

Rules enforced as it runs, each a `RuntimeFault` naming the stream and step (the checks of
`aviatorc.plan.check`, re-proved on the real run): a staging buffer read before its `load` and
a `wait` on it, or after its `free`; a chiplet's SRAM over capacity (resident, KV and scratch
buffers for the whole program, plus the live staging buffers); a `recv` with no `send`; a value
read where no instruction brought it; a staging buffer left live; a deadlock. A run that
faults returns nothing.

The first run of a program is the checked one: it executes every instruction as above and
records, in the order it ran them, each computation it made (a kernel, a strip product, a table
lookup, the assembly of parts) with the slots its operands came from. Every rule above depends
only on the program, never on the values, so a run that keeps them once keeps them always; later
runs replay the recorded computations on the new feeds, and the moves between chiplets (send,
recv) and the buffer bookkeeping (load, wait, free) cost nothing there. The first run returns
its replay's outputs as well (computed once more), so that the same feeds give the same outputs
on every run: a replay runs the strip products that read one activation as one GEMM. What does depend on the
values is still checked on every run: a kernel that fails on them, an index outside its table.
`SimBackend(..., replay=False)` checks every run in full.

Not handled: tiles that split a MatMul weight's K rows (the partitioner cuts column strips).
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aviatorc.errors import AviatorError
from aviatorc.ir import Graph, Node, Value
from aviatorc.ir.ops import get_op
from aviatorc.ir.types import numpy_dtype
from aviatorc.plan.ir import Buffer, Instr, Program, format_instr
from aviatorc.runtime.errors import RuntimeFault
from aviatorc.runtime.precedence import Precedence
from aviatorc.runtime.weights import WeightStore

_PART_LABEL = re.compile(r"(.*)\[((?:cols|rows|kv):\d+:\d+)\]\Z")  # a sent part: "value[cols:A:B]"
_PART = re.compile(r"(cols|rows|kv):(\d+):(\d+)\Z")


@functools.cache
def _split_label(label: str) -> tuple[str, str] | None:
    """(value, part) of a sent part's label, None for a whole value (parsed once per label)."""
    match = _PART_LABEL.match(label)
    return (match.group(1), match.group(2)) if match else None


@functools.cache
def _parse_part(part: str) -> tuple[str, int, int] | None:
    """(kind, start, stop) of a compute's part, None if it is not one (parsed once per part)."""
    match = _PART.match(part)
    return (match.group(1), int(match.group(2)), int(match.group(3))) if match else None


@dataclass
class RunCounts:
    """What one run did: instructions by op, bytes moved, peak SRAM per chiplet, and figures
    only some backends have (`extra`: the cuda backend's timings under "cuda")."""

    instructions: dict[str, int] = field(default_factory=dict)
    bytes_loaded: int = 0
    bytes_sent: int = 0
    peak_sram_bytes: dict[int, int] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Chiplet:
    """One chiplet's state during a run; values and parts are slots of the run's `env`."""

    values: dict[str, int] = field(default_factory=dict)
    parts: dict[str, dict[str, int]] = field(default_factory=dict)  # value -> part -> slot
    live: dict[str, int] = field(default_factory=dict)  # staging buffer -> step of its load
    waited: set[str] = field(default_factory=set)
    freed: dict[str, int] = field(default_factory=dict)  # staging buffer -> step of its free
    staged_bytes: int = 0
    peak_bytes: int = 0


class SimBackend:
    """Runs one program of a plan on the CPU. Build once per session; `run` as often as needed."""

    replays = True  # backends whose runs do more than compute (timings, messages) check every run

    def __init__(self, program: Program, graph: Graph, weights: WeightStore, *, sram_bytes: int,
                 replay: bool = True) -> None:
        self.program, self.graph, self.weights, self.sram_bytes = program, graph, weights, sram_bytes
        self.replay = replay and self.replays
        self._replay: _Replay | None = None
        self.nodes: dict[str, Node] = {n.name: n for n in graph.nodes}
        self.streams = {c: program.streams[c] for c in sorted(program.streams)}
        self.held = {c: 0 for c in self.streams}  # bytes held for the whole program
        for b in program.buffers.values():
            if b.kind != "staging":
                self.held[b.chiplet] = self.held.get(b.chiplet, 0) + b.bytes
        self._check_held()
        # Every part of each node, across all streams: what the value's home must collect.
        self.parts_of: dict[str, set[str]] = {}
        self.kv_chunks: dict[str, int] = {}
        sends: set[tuple[str, int, int]] = set()
        self.signalled: set[str] = set()
        for c, _, ins in program.instructions():
            if ins.op == "compute" and ins["part"]:
                self.parts_of.setdefault(self._output(ins["node"]).name, set()).add(ins["part"])
            elif ins.op == "send":
                sends.add((ins["value"], c, ins["to"]))
            elif ins.op == "signal":
                self.signalled.add(ins["event"])
        self.sends = frozenset(sends)
        self.attrs = {n.name: self._attrs(n) for n in graph.nodes}
        self.kernels = {n.name: get_op(n.op).kernel for n in graph.nodes}
        self._strips: dict[tuple[str, int, int], np.ndarray] = {}
        self.precedence = Precedence()  # a session shares one across its programs' backends

    # -- set-up --------------------------------------------------------------------------

    def _check_held(self) -> None:
        for c, held in sorted(self.held.items()):
            if held > self.sram_bytes:
                by_kind = Counter[str]()
                for b in self.program.buffers.values():
                    if b.chiplet == c and b.kind != "staging":
                        by_kind[b.kind] += b.bytes
                parts = ", ".join(f"{kind} {n:,}" for kind, n in sorted(by_kind.items()))
                raise RuntimeFault(f"chiplet {c} holds {held:,} bytes for the whole program ({parts}) but has "
                                   f"{self.sram_bytes:,} bytes of SRAM", rule="over-capacity", chiplet=c,
                                   hint="recompile for this target: the plan was made for a larger SRAM")

    def _attrs(self, node: Node) -> dict[str, Any]:
        attrs = get_op(node.op).resolve_attrs(node.attrs, node.name)
        attrs["_num_outputs"] = len(node.outputs)
        return attrs

    def strip(self, tile_id: str, a: int, b: int, dtype: np.dtype) -> np.ndarray:
        """Columns [a, b) of a tile's dequantized matrix, contiguous, cached for the session."""
        key = (tile_id, a, b)
        found = self._strips.get(key)
        if found is None:
            found = self._strips[key] = np.ascontiguousarray(self.weights.tile(tile_id)[:, a:b], dtype=dtype)
        return found

    def _output(self, name: str) -> Value:
        node = self.nodes[name]
        return node.outputs[0]

    # -- the run -------------------------------------------------------------------------

    def run(self, feeds: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], RunCounts]:
        """Run every stream to its end on `feeds` (checked arrays, by graph input name); return the
        graph's outputs. Raises `RuntimeFault` for the first rule the plan breaks."""
        if self._replay is not None:
            return self._replay.run(feeds, self.precedence.checkpoint)
        run = self._start_run(dict(feeds))
        run.execute()
        slots = run.output_slots()
        if run.tape is None:
            return {name: run.env[slot] for name, slot in slots.items()}, run.counts
        self._replay = _Replay(run, slots)
        self._strips.clear()  # the replay holds the strips it reads (fused ones in one matrix each)
        # The first run's outputs are the replay's too: fused products may round differently from
        # the checked run's strips, and the same feeds must give the same outputs on every run.
        return self._replay.run(feeds, self.precedence.checkpoint)

    def fault(self, c: int, step: int, rule: str, message: str, **fields: Any) -> RuntimeFault:
        """A fault at step `step` of stream `c`, the instruction quoted."""
        stream = self.streams.get(c, [])
        text = f"{format_instr(stream[step])}: " if 0 <= step < len(stream) else ""
        return RuntimeFault(text + message, rule=rule, stream=c, step=step, **fields)

    # -- the computations a run records (pure: their arrays in, their result out) ---------------

    def kernel(self, c: int, step: int, node: Node, *ins: np.ndarray | None) -> list[np.ndarray]:
        """A whole node's outputs: its IR kernel on its inputs."""
        try:
            outs = self.kernels[node.name](list(ins), dict(self.attrs[node.name]))
        except AviatorError as error:
            raise self.fault(c, step, "kernel", f"node '{node.name}' ({node.op}): {error}") from error
        except Exception as error:  # a kernel failing on these values: name the node and the step
            raise self.fault(c, step, "kernel", f"node '{node.name}' ({node.op}): {type(error).__name__}: "
                             f"{error}") from error
        return [np.asarray(array) for array in outs]

    def lookup(self, c: int, step: int, node: Node, take: Any, buf: str, rows: np.ndarray, first: int, start: int,
               stop: int, ids: np.ndarray) -> np.ndarray:
        """A Gather's rows [start, stop) of a table tile (its rows from `first` on): the ids inside
        looked up by `take`, zeros for the others."""
        table = node.inputs[0]
        assert table is not None
        vocab = table.type.shape[0]
        ids = ids.astype(np.int64)
        if isinstance(vocab, int):
            if ids.size and (ids.min() < -vocab or ids.max() >= vocab):
                raise self.fault(c, step, "kernel", f"Gather '{node.name}': an index lies outside [-{vocab}, {vocab})")
            ids = np.where(ids < 0, ids + vocab, ids)
        inside = (ids >= start) & (ids < stop)
        out = np.zeros(ids.shape + rows.shape[1:], dtype=numpy_dtype(table.type.dtype))
        out[inside] = take(c, buf, rows, ids[inside] - first)
        return out

    def _start_run(self, feeds: dict[str, np.ndarray]) -> _Run:
        """A run's state; a backend that executes the same instructions elsewhere returns its own."""
        return _Run(self, feeds)


class _Run:
    """The state of one run: every chiplet's values and buffers, the transfers in flight."""

    def __init__(self, backend: SimBackend, feeds: dict[str, np.ndarray]) -> None:
        self.b = backend
        self.env: list[Any] = [None]  # every array of the run, by slot; slot 0 is an absent input
        self.feeds = {name: self._new(array) for name, array in feeds.items()}
        self.initializers: dict[str, int] = {}
        self.chiplets = {c: _Chiplet(peak_bytes=backend.held.get(c, 0)) for c in backend.streams}
        self.mailbox: dict[tuple[str, int, int], int] = {}
        self.fired: set[str] = set()
        self.pc = dict.fromkeys(backend.streams, 0)
        self.counts = RunCounts()
        self.ops = Counter[str]()
        self.tape: list[_Op] | None = [] if backend.replay else None  # the computations, for replays

    def fault(self, c: int, step: int, rule: str, message: str, **fields: Any) -> RuntimeFault:
        return self.b.fault(c, step, rule, message, **fields)

    def _new(self, array: Any) -> int:
        self.env.append(array)
        return len(self.env) - 1

    def _apply(self, fn: Any, static: tuple[Any, ...], slots: tuple[int, ...], many: bool = False) -> Any:
        """`fn(*static, *arrays of slots)` into new slots (a list of them if `many`), recorded on the tape."""
        result = fn(*static, *[self.env[s] for s in slots])
        out: Any = [self._new(array) for array in result] if many else self._new(result)
        if self.tape is not None:
            self.tape.append((fn, static, slots, out, many))
        return out

    def execute(self) -> None:
        streams = self.b.streams
        unfinished = [c for c in streams if streams[c]]
        checkpoint = self.b.precedence.checkpoint
        while unfinished:
            moved = False
            for c in unfinished:
                stream = streams[c]
                while self.pc[c] < len(stream):
                    checkpoint()
                    if not self.step(c, self.pc[c], stream[self.pc[c]]):
                        break
                    self.pc[c] += 1
                    moved = True
            unfinished = [c for c in unfinished if self.pc[c] < len(streams[c])]
            if unfinished and not moved and not self._await_external():
                raise self._deadlock(unfinished)
        for c, chiplet in self.chiplets.items():
            if chiplet.live:
                name, step = min(chiplet.live.items(), key=lambda item: item[1])
                raise self.fault(c, step, "unfreed-buffer", f"staging buffer '{name}' is still live at the end of "
                                 f"stream {c} (no free after this load)")
        self.counts.instructions = dict(sorted(self.ops.items()))
        self.counts.peak_sram_bytes = {c: s.peak_bytes for c, s in sorted(self.chiplets.items())}

    def _await_external(self) -> bool:
        """Wait for something from outside this run (another process's sends); True if it came.
        Here every stream is in this run, so nothing can: a round without progress is a deadlock."""
        return False

    def _deadlock(self, blocked: list[int]) -> RuntimeFault:
        where = ", ".join(f"stream {c} at step {self.pc[c]} ({format_instr(self.b.streams[c][self.pc[c]])})"
                          for c in blocked)
        c = blocked[0]
        return self.fault(c, self.pc[c], "deadlock", f"deadlock: streams blocked forever: {where}",
                          blocked={c: self.pc[c] for c in blocked})

    def step(self, c: int, step: int, ins: Instr) -> bool:
        """Execute one instruction; False when the stream must wait for another stream."""
        op = ins.op
        if op == "recv":
            key = (ins["value"], ins["src"], c)
            if key not in self.mailbox:
                src = ins["src"]
                if key not in self.b.sends or self.pc.get(src, 0) >= len(self.b.streams.get(src, ())):
                    raise self.fault(c, step, "unmatched-recv", f"no stream sends '{ins['value']}' from chiplet "
                                     f"{src} to chiplet {c}")
                return False
            self._bind(c, ins["value"], self.mailbox.pop(key))
        elif op == "wait":
            if not self._wait(c, step, ins["event"]):
                return False
        elif op == "compute":
            self._compute(c, step, ins)
        elif op == "send":
            self.mailbox[(ins["value"], c, ins["to"])] = self._label_slot(c, step, ins["value"])
            self.counts.bytes_sent += int(ins["bytes"])
        elif op == "load":
            self._load(c, step, ins)
        elif op == "free":
            self._free(c, step, ins["buf"])
        elif op == "signal":
            self.fired.add(ins["event"])
        self.ops[op] += 1
        return True

    # -- buffers -------------------------------------------------------------------------

    def _buffer(self, c: int, step: int, name: str) -> Buffer:
        buffer = self.b.program.buffers.get(name)
        if buffer is None:
            raise self.fault(c, step, "undeclared-buffer", f"buffer '{name}' is not declared")
        if buffer.chiplet != c:
            raise self.fault(c, step, "wrong-chiplet", f"buffer '{name}' lies on chiplet {buffer.chiplet}, not {c}")
        return buffer

    def _load(self, c: int, step: int, ins: Instr) -> None:
        name = ins["buf"]
        buffer = self._buffer(c, step, name)
        state = self.chiplets[c]
        if buffer.kind != "staging":
            raise self.fault(c, step, "not-staging", f"'{name}' is a {buffer.kind} buffer, not a staging buffer")
        if name in state.live:
            raise self.fault(c, step, "double-load", f"'{name}' is loaded again while live (loaded at step "
                             f"{state.live[name]})")
        total = self.b.held.get(c, 0) + state.staged_bytes + buffer.bytes
        if total > self.b.sram_bytes:
            raise self.fault(c, step, "over-capacity", f"loading '{name}' ({buffer.bytes:,} bytes) brings chiplet {c} "
                             f"to {total:,} bytes ({self.b.held.get(c, 0):,} held, {state.staged_bytes:,} staged in "
                             f"{len(state.live)} buffer(s)) but it has {self.b.sram_bytes:,} bytes of SRAM")
        state.live[name] = step
        state.freed.pop(name, None)
        state.waited.discard(name)
        state.staged_bytes += buffer.bytes
        state.peak_bytes = max(state.peak_bytes, total)
        self.counts.bytes_loaded += int(ins["bytes"])

    def _wait(self, c: int, step: int, event: str) -> bool:
        state = self.chiplets[c]
        buffer = self.b.program.buffers.get(event)
        if buffer is not None and buffer.kind == "staging" and buffer.chiplet == c:
            if event not in state.live:  # a load is this stream's own: it must come before its wait
                after = f" (freed at step {state.freed[event]})" if event in state.freed else ""
                raise self.fault(c, step, "missing-load", f"wait on staging buffer '{event}' with no live load of "
                                 f"it{after}")
            state.waited.add(event)
            return True
        if event in self.fired:
            return True
        if event not in self.b.signalled:
            raise self.fault(c, step, "unmatched-wait", f"no load of this stream and no signal fires '{event}'")
        return False

    def _free(self, c: int, step: int, name: str) -> None:
        buffer = self._buffer(c, step, name)
        state = self.chiplets[c]
        if name not in state.live:
            rule = "double-free" if name in state.freed else "missing-load"
            raise self.fault(c, step, rule, f"free of '{name}', which is not live"
                             + (f" (freed at step {state.freed[name]})" if name in state.freed else " (never loaded)"))
        del state.live[name]
        state.waited.discard(name)
        state.freed[name] = step
        state.staged_bytes -= buffer.bytes

    def _check_bufs(self, c: int, step: int, bufs: tuple[str, ...]) -> None:
        state = self.chiplets[c]
        for name in bufs:
            buffer = self._buffer(c, step, name)
            if buffer.kind != "staging":
                continue
            if name in state.freed and name not in state.live:
                raise self.fault(c, step, "use-after-free", f"reads staging buffer '{name}' after its free at step "
                                 f"{state.freed[name]}")
            if name not in state.live:
                raise self.fault(c, step, "missing-load", f"reads staging buffer '{name}' with no load before it")
            if name not in state.waited:
                raise self.fault(c, step, "missing-wait", f"reads staging buffer '{name}' before a wait on its load "
                                 f"(step {state.live[name]})")

    # -- values --------------------------------------------------------------------------

    def _bind(self, c: int, label: str, slot: int) -> None:
        split = _split_label(label)
        if split:
            self.chiplets[c].parts.setdefault(split[0], {})[split[1]] = slot
        else:
            self.chiplets[c].values[label] = slot

    def _store(self, c: int, label: str, array: np.ndarray) -> None:
        """A value or part that arrived from outside the run (another process) onto chiplet c."""
        self._bind(c, label, self._new(array))

    def _label_slot(self, c: int, step: int, label: str) -> int:
        split = _split_label(label)
        if not split:
            return self._slot(c, step, label)
        part = self.chiplets[c].parts.get(split[0], {}).get(split[1])
        if part is None:
            raise self.fault(c, step, "missing-value", f"part {split[1]} of '{split[0]}' is not on chiplet {c}")
        return part

    def _read_label(self, c: int, step: int, label: str) -> np.ndarray:
        return self.env[self._label_slot(c, step, label)]

    def _read(self, c: int, step: int, name: str) -> np.ndarray:
        return self.env[self._slot(c, step, name)]

    def _slot(self, c: int, step: int, name: str) -> int:
        """The slot of value `name` as chiplet c reads it: computed or received there, a feed, its
        parts there assembled, or an initializer."""
        state = self.chiplets[c]
        found = state.values.get(name)
        if found is not None:
            return found
        found = self.feeds.get(name)
        if found is not None:
            return found
        if name in state.parts:
            found = state.values[name] = self._assemble(c, step, name)
            return found
        if name in self.b.graph.initializers:
            found = self.initializers.get(name)
            if found is None:
                array = self.b.weights.initializer(name)
                if array is None:
                    raise self.fault(c, step, "missing-value", f"reads weight '{name}' whole, but the plan stores "
                                     "it only as tiles")
                found = self.initializers[name] = self._new(array)
            return found
        producer = self.b.graph.value(name).producer if self._known(name) else None
        made = f" (made by '{producer.name}', a {producer.op} node the program does not run)" if producer else ""
        raise self.fault(c, step, "missing-value", f"reads '{name}', which is not on chiplet {c}: no compute there "
                         f"made it and no recv brought it{made}", value=name)

    def _known(self, name: str) -> bool:
        try:
            self.b.graph.value(name)
        except (KeyError, AviatorError):
            return False
        return True

    def _assemble(self, c: int, step: int, name: str) -> int:
        """A weight node's value from its parts on this chiplet: every part the program computes."""
        have = self.chiplets[c].parts[name]
        expected = self.b.parts_of.get(name, set())
        missing = sorted(expected - set(have))
        if missing:
            raise self.fault(c, step, "missing-value", f"reads '{name}' before all its parts are on chiplet {c}: "
                             f"missing {', '.join(missing)}", value=name)
        spans = sorted((p[1], p[2], p[0], part) for part in have for p in [_parse_part(part)] if p)
        kinds = {kind for _, _, kind, _ in spans}
        if len(kinds) != 1:
            raise self.fault(c, step, "missing-value", f"'{name}' has parts of mixed kinds {sorted(kinds)}")
        position = 0
        for start, stop, _, part in spans:
            if start != position:
                raise self.fault(c, step, "missing-value", f"parts of '{name}' do not tile it: {part} follows "
                                 f"[0, {position})")
            position = stop
        slots = tuple(have[part] for _, _, _, part in spans)
        return self._apply(_columns if kinds == {"cols"} else _total, (), slots)

    # -- compute -------------------------------------------------------------------------

    def _compute(self, c: int, step: int, ins: Instr) -> None:
        self._check_bufs(c, step, ins["bufs"])
        node = self.b.nodes[ins["node"]]
        part = ins["part"]
        parsed = _parse_part(part) if part else None
        if part and parsed is None:
            raise self.fault(c, step, "bad-part", f"unknown part '{part}'")
        kind, start, stop = parsed if parsed else ("", 0, 0)
        if kind == "kv":
            # The KV chunks stand for reads of the cache (possibly on other chiplets, whose partial
            # results are sent home); the node runs whole at the last chunk, on its home chiplet.
            if start != stop - 1:
                self.chiplets[c].parts.setdefault(node.outputs[0].name, {})[part] = self._new(np.zeros(0, np.float32))
                return
            kind = ""
        if kind == "":
            self._whole(c, step, node)
            return
        if not ins["bufs"]:
            raise self.fault(c, step, "missing-buffer", f"part {part} of '{node.name}' names no weight buffer")
        tile_id = self.b.program.buffers[ins["bufs"][0]].tile
        tile = self.b.weights.tiles.get(tile_id)
        if tile is None:
            raise self.fault(c, step, "unknown-tile", f"buffer '{ins['bufs'][0]}' holds '{tile_id}', not a weight tile")
        buf = ins["bufs"][0]
        if kind == "cols" and node.op == "MatMul":
            out = self._matmul_part(c, step, node, buf, tile_id, start, stop)
        elif kind == "rows" and node.op == "Gather":
            out = self._gather_part(c, step, node, buf, tile_id, start, stop)
        else:
            raise self.fault(c, step, "bad-part", f"part {part} of a {node.op} node is not something the sim can run")
        self.chiplets[c].parts.setdefault(node.outputs[0].name, {})[part] = out

    def _whole(self, c: int, step: int, node: Node) -> None:
        slots = tuple(self._slot(c, step, v.name) if v is not None else 0 for v in node.inputs)
        outs = self._apply(self.b.kernel, (c, step, node), slots, many=True)
        values = self.chiplets[c].values
        for value, slot in zip(node.outputs, outs):
            values[value.name] = slot

    def _weight_dtype(self, node: Node, index: int) -> np.dtype:
        value = node.inputs[index]
        assert value is not None  # a weight node always has its weight input
        return numpy_dtype(value.type.dtype)

    def _matmul_part(self, c: int, step: int, node: Node, buf: str, tile_id: str, start: int, stop: int) -> int:
        tile = self.b.weights.tiles[tile_id]
        (k0, k1), (n0, n1) = tile.rows, tile.cols
        weight = node.inputs[1]
        assert weight is not None
        full_k = weight.type.shape[-2]
        if tile.is_embedding or k0 != 0 or (isinstance(full_k, int) and k1 != full_k):
            raise self.fault(c, step, "bad-part", f"tile {tile_id} covers rows [{k0}, {k1}) of '{tile.weight}': the "
                             "sim runs column strips over all of K only")
        if not n0 <= start < stop <= n1:
            raise self.fault(c, step, "bad-part", f"columns [{start}, {stop}) lie outside tile {tile_id}'s "
                             f"[{n0}, {n1})")
        x = self._slot(c, step, self._input_name(node, 0))
        return self._strip_product(c, buf, x, tile_id, start - n0, stop - n0, self._weight_dtype(node, 1))

    def _strip_product(self, c: int, buf: str, x: int, tile_id: str, a: int, b: int, dtype: np.dtype) -> int:
        """The slot of env[x] @ columns [a, b) of the tile in buffer `buf`: the kernel of a MatMul
        column strip, the one a backend with its own memory replaces (the checks around it stay the sim's)."""
        return self._apply(_product, (self.b.strip(tile_id, a, b, dtype),), (x,))

    def _gather_part(self, c: int, step: int, node: Node, buf: str, tile_id: str, start: int, stop: int) -> int:
        tile = self.b.weights.tiles[tile_id]
        matrix = self.b.weights.tile(tile_id)
        # An embedding tile is stored as its table rows; a tied head's strip as [hidden, rows]: transposed.
        first, rows = (tile.rows[0], matrix) if tile.is_embedding else (tile.cols[0], matrix.T)
        if self.b.attrs[node.name]["axis"] != 0:
            raise self.fault(c, step, "bad-part", f"a row range of a Gather along axis {self.b.attrs[node.name]['axis']}")
        if not first <= start < stop <= first + rows.shape[0]:
            raise self.fault(c, step, "bad-part", f"rows [{start}, {stop}) lie outside tile {tile_id}'s rows "
                             f"[{first}, {first + rows.shape[0]})")
        ids = self._slot(c, step, self._input_name(node, 1))
        return self._apply(self.b.lookup, (c, step, node, self._table_rows, buf, rows, first, start, stop), (ids,))

    @staticmethod
    def _table_rows(c: int, buf: str, rows: np.ndarray, index: np.ndarray) -> np.ndarray:
        """`rows[index]`, rows the lookup table held in buffer `buf`: the kernel of a Gather row
        part, the one a backend with its own memory replaces (the checks around it stay the sim's)."""
        return rows[index]

    def _input_name(self, node: Node, index: int) -> str:
        value = node.inputs[index]
        assert value is not None
        return value.name

    # -- results -------------------------------------------------------------------------

    def output_slots(self) -> dict[str, int]:
        result: dict[str, int] = {}
        for value in self.b.graph.outputs:
            holders = [c for c, s in self.chiplets.items() if value.name in s.values or value.name in s.parts]
            if value.name in self.feeds:
                result[value.name] = self.feeds[value.name]
            elif holders:
                last = max(holders, key=lambda c: (value.name in self.chiplets[c].values, -c))
                result[value.name] = self._slot(last, len(self.b.streams[last]) - 1, value.name)
            else:
                raise RuntimeFault(f"the program never computes the graph output '{value.name}'", rule="missing-value",
                                   value=value.name)
        return result

    def outputs(self) -> dict[str, np.ndarray]:
        return {name: self.env[slot] for name, slot in self.output_slots().items()}


_Op = tuple[Any, tuple[Any, ...], tuple[int, ...], Any, bool]  # fn, static arguments, operand slots, result slot(s), many


class _Replay:
    """A checked run's computations, in the order it made them, to run again on new feeds.

    The slots the recorded run filled with feeds or with results are empty in the template; the
    others hold its constants (initializers, empty KV parts)."""

    def __init__(self, run: _Run, outputs: dict[str, int]) -> None:
        assert run.tape is not None
        self.ops = _fuse_products(run.tape)
        self.feeds = run.feeds
        self.outputs = outputs
        self.counts = run.counts
        filled = set(run.feeds.values())
        for _, _, _, out, many in self.ops:
            filled.update(out if many else (out,))
        self.template: list[Any] = [None if slot in filled else array for slot, array in enumerate(run.env)]

    def run(self, feeds: Mapping[str, np.ndarray], checkpoint: Any) -> tuple[dict[str, np.ndarray], RunCounts]:
        env = self.template.copy()
        for name, slot in self.feeds.items():
            if name not in feeds:
                raise RuntimeFault(f"the program reads the graph input '{name}', which the feeds lack",
                                   rule="missing-value", value=name)
            env[slot] = feeds[name]
        for fn, static, slots, out, many in self.ops:
            checkpoint()
            result = fn(*static, *[env[s] for s in slots])
            if many:
                for slot, array in zip(out, result):
                    env[slot] = array
            else:
                env[out] = result
        counts = self.counts
        return ({name: env[slot] for name, slot in self.outputs.items()},
                RunCounts(dict(counts.instructions), counts.bytes_loaded, counts.bytes_sent,
                          dict(counts.peak_sram_bytes), {}))


def _product(w_kn: np.ndarray, x: np.ndarray) -> np.ndarray:
    """x @ w_kn in x's dtype (as the MatMul kernel: numpy's bf16 runs in fp32)."""
    if x.ndim > 2:  # one 2-D GEMM over all tokens: numpy loops a stacked matmul batch by batch
        rows = x.reshape(-1, x.shape[-1])
        return np.matmul(rows, w_kn).astype(x.dtype, copy=False).reshape(*x.shape[:-1], w_kn.shape[1])
    return np.matmul(x, w_kn).astype(x.dtype, copy=False)


def _products(w_kn: np.ndarray, bounds: tuple[tuple[int, int], ...], x: np.ndarray) -> list[np.ndarray]:
    """x @ w_kn, split into the column ranges `bounds`: several strip products in one GEMM."""
    y = _product(w_kn, x)
    return [y[..., a:b] for a, b in bounds]


def _fuse_products(ops: list[_Op]) -> list[_Op]:
    """The strip products that read the same activation (one weight's strips across chiplets, or
    q, k and v of one norm) as one GEMM over their strips side by side, at the first one's place:
    a product depends on its activation alone, so each result only becomes ready earlier. One
    wide GEMM reads the weights at a higher rate than many narrow ones."""
    groups: dict[tuple[int, np.dtype, int], list[int]] = {}
    for i, (fn, static, slots, _, _) in enumerate(ops):
        if fn is _product:
            groups.setdefault((slots[0], static[0].dtype, static[0].shape[0]), []).append(i)
    fused: dict[int, _Op] = {}
    dropped: set[int] = set()
    for members in groups.values():
        if len(members) < 2:
            continue
        strips = [ops[i][1][0] for i in members]
        edges = np.cumsum([0] + [w.shape[1] for w in strips]).tolist()
        bounds = tuple(zip(edges[:-1], edges[1:]))
        fused[members[0]] = (_products, (np.concatenate(strips, axis=1), bounds), ops[members[0]][2],
                             [ops[i][3] for i in members], True)
        dropped.update(members[1:])
    return [fused.get(i, op) for i, op in enumerate(ops) if i not in dropped]


def _columns(*parts: np.ndarray) -> np.ndarray:
    return np.concatenate(parts, axis=-1)


def _total(first: np.ndarray, *rest: np.ndarray) -> np.ndarray:
    total = first.copy()
    for part in rest:
        total += part
    return total
