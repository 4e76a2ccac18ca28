"""The `sim` backend: a plan's instruction streams executed on the CPU, computing real outputs.

    backend = SimBackend(program, graph, weights, sram_bytes=target.chiplet.sram_bytes)
    outputs, counts = backend.run(feeds)

Each chiplet has its own values (a dict of name -> array); graph inputs and initializers are
on every chiplet. Streams run in an order the plan's events allow: a stream runs until it
blocks on a `recv` whose `send` has not run yet (or a `wait` on a `signal` not yet fired), then
the next stream runs; a round in which no stream moves is a deadlock. Time is not modelled
here (`aviatorc.schedule.simulate` does that); a `load` lands when it is issued.

What each instruction does (`aviatorc.plan.ir` defines the plan IR):
- `compute node=N` (no part): graph node N with its IR kernel (`aviatorc.ir.ops`) on the values
  on this chiplet; part `cols:A:B` of a MatMul: `x @ W[:, A:B]` with W the tile of its weight
  buffer, dequantized once per session; part `rows:A:B` of a Gather: the lookup of the ids in
  [A, B) (zeros for the others); part `kv:I:N` (chunk I of the KV cache): the node runs whole
  with its last chunk. Parts are kept apart until a reader needs the value on that chiplet;
  then they are assembled (columns concatenated in order, row partials summed), and all of
  the node's parts in the program must be there by then.
- `send V to=D` / `recv V src=S`: V is a value, or a part of one; its array moves.
- A weight-stationary prefill names each token block's values `V@b`: here a block's value is the
  whole value (every block's compute of a node gives the same array, so a node computed once on a
  chiplet is not computed again there): every block's sends, receives and staging are checked as
  they run, at no extra arithmetic. A later block's missing receive goes unseen when the first
  block already brought the value (the arrays are the whole values, not the blocks' rows).
- `load` / `wait` / `free`: a staging buffer's life, checked as it runs.
- A mixture of experts runs as routed: the computations of an expert (`aviatorc.ir.experts`) are
  gated by its block's routing, and run only when some token of the run is routed to it (decided
  per run, in a replay too); a skipped expert's combine passes the partial sum on, and its loads
  are left out of the run's `bytes_loaded`. `RunCounts.experts` says which ran and how well
  pre-gating named them (`aviatorc.routing.PreGating`, on the run's own values).
- `store` / `host`: nothing to compute (the session keeps the KV cache and samples).

Rules enforced as it runs, each a `RuntimeFault` naming the stream and step: the staging rules
of `aviatorc.plan.check.StagingRules` re-proved on the real run (a staging buffer read before
its `load` and a `wait` on it, or after its `free`; a chiplet's SRAM over capacity: resident,
KV and scratch buffers for the whole program, plus the live staging buffers; a staging buffer
left live), a `recv` with no `send`, a value read where no instruction brought it, a deadlock.
The streams are walked by `aviatorc.plan.interpret.StreamInterpreter`, as the checker and the
simulator walk them. A run that faults returns nothing.

Every rule above depends only on the program, never on the values, so a program that keeps
them once keeps them always. The first run of a program therefore walks its instructions with
every check but computes nothing: it records, in the order the walk meets them, the computations
the instructions stand for (a kernel, a strip product, a table lookup, the assembly of parts),
each with the slots its operands come from. That tape then runs on the feeds (the first run's
outputs), and again on every later run's: the moves between chiplets (send, recv) and the buffer
bookkeeping (load, wait, free) cost nothing there, and the strip products that read one
activation run as one GEMM. So the first run costs a walk of the program (no arithmetic) more
than a later one, and gives the same outputs for the same feeds. What does depend on the values
is checked on every run: a kernel that fails on them (named by stream and step), an index outside
its table. `SimBackend(..., replay=False)` computes as it checks, on every run (the cuda and the
rank backends build on that: their runs do more than compute).

Not handled: tiles that split a MatMul weight's K rows (the partitioner cuts column strips).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from aviatorc.backends.contract import BlockRun, Precedence, RunCounts, RuntimeFault, WeightStore

from aviatorc.errors import AviatorError
from aviatorc.ir import Graph, Node, Value
from aviatorc.ir.experts import ExpertRef, expert_nodes
from aviatorc.ir.ops import get_op
from aviatorc.ir.types import numpy_dtype
from aviatorc.plan.check import StagingRules, over_capacity
from aviatorc.plan.interpret import BLOCKED, StreamInterpreter
from aviatorc.plan.ir import (
    Compute,
    Free,
    Host,
    Instruction,
    Load,
    Part,
    Program,
    Recv,
    Send,
    Signal,
    Store,
    ValueRef,
    Wait,
    block_of,
    format_instr,
)
from aviatorc.quant.link import int8_groups
from aviatorc.routing import MoEBlock, PreGating, moe_blocks

__all__ = ["RunCounts", "SimBackend"]


@dataclass
class _Chiplet:
    """One chiplet's values during a run; values and parts are slots of the run's `env`."""

    values: dict[str, int] = field(default_factory=dict)
    parts: dict[str, dict[Part, int]] = field(default_factory=dict)  # value -> part -> slot


class SimBackend:
    """Runs one program of a plan on the CPU. Build once per session; `run` as often as needed."""

    replays = True  # backends whose runs do more than compute (timings, messages) check every run
    link_dtype = "fp16"  # the plan's `--link-dtype`, set by a session: "int8" rounds what is sent (`int8_groups`)

    def __init__(self, program: Program, graph: Graph, weights: WeightStore, *, sram_bytes: int,
                 replay: bool = True) -> None:
        self.program, self.graph, self.weights, self.sram_bytes = program, graph, weights, sram_bytes
        self.replay = replay and self.replays
        self._replay: _Replay | None = None
        self.nodes: dict[str, Node] = {n.name: n for n in graph.nodes}
        self.streams = {c: program.streams[c] for c in sorted(program.streams)}
        over_capacity(program, sram_bytes, self._held_fault)
        # Every part of each node, across all streams: what the value's home must collect.
        self.parts_of: dict[str, set[Part]] = {}
        sends: set[tuple[ValueRef, int, int]] = set()
        self.signalled: set[str] = set()
        for c, _, ins in program.instructions():
            if isinstance(ins, Compute) and ins.part is not None:
                self.parts_of.setdefault(self._output(ins.node).name, set()).add(ins.part)
            elif isinstance(ins, Send):
                sends.add((ins.value, c, ins.to))
            elif isinstance(ins, Signal):
                self.signalled.add(ins.event)
        self.sends = frozenset(sends)
        self.attrs = {n.name: self._attrs(n) for n in graph.nodes}
        self.kernels = {n.name: get_op(n.op).kernel for n in graph.nodes}
        self.precedence = Precedence()  # a session shares one across its programs' backends
        # LoRA adapters (`aviatorc.runtime.lora.Adapters`), set by a session that runs them: each
        # MatMul strip then adds the low-rank products of its step's sequences' adapters.
        self.lora: Any = None
        # Mixture of experts: each expert's nodes and weights, to run (and load) only routed experts.
        self.expert_of: dict[str, ExpertRef] = {n.name: ref for n, ref in expert_nodes(graph).items()}
        self.expert_of_tile: dict[int, ExpertRef] = {  # by the nodes reading it: a quantized weight's too
            t: self.expert_of[name] for t, tile in enumerate(weights.tiles) for name in tile.nodes if name in self.expert_of}
        self.blocks: list[MoEBlock] = moe_blocks(graph, weights.tiles) if self.expert_of else []
        self.gating = PreGating(graph, self.blocks) if len(self.blocks) > 1 else None

    # -- set-up --------------------------------------------------------------------------

    @staticmethod
    def _held_fault(rule: str, message: str, c: int, step: int | None) -> RuntimeFault:
        return RuntimeFault(message, rule=rule, chiplet=c,
                            hint="recompile for this target: the plan was made for a larger SRAM")

    def _attrs(self, node: Node) -> dict[str, Any]:
        attrs = get_op(node.op).resolve_attrs(node.attrs, node.name)
        attrs["_num_outputs"] = len(node.outputs)
        return attrs

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
            run.counts.experts, skipped = _Experts(run).count(run.env)
            run.counts.bytes_loaded -= skipped
            return {name: run.env[slot] for name, slot in slots.items()}, run.counts
        self._replay = _Replay(run, slots, self.weights)
        return self._replay.run(feeds, self.precedence.checkpoint)

    def fault(self, c: int, step: int, rule: str, message: str, **fields: Any) -> RuntimeFault:
        """A fault at step `step` of stream `c`, the instruction quoted."""
        stream = self.streams.get(c, [])
        text = f"{format_instr(stream[step])}: " if 0 <= step < len(stream) else ""
        return RuntimeFault(text + message, rule=rule, stream=c, step=step, **fields)

    # -- the computations a run records (pure: their arrays in, their result out) ---------------

    def kernel(self, c: int, step: int, node: Node, *ins: np.ndarray | None) -> list[np.ndarray]:
        """A whole node's outputs: its IR kernel on its inputs."""
        if node.op == "MoECombine" and ins[1] is None:  # its expert did not run: no token was routed to it
            return [self._partial_sum(node, ins)]
        try:
            outs = self.kernels[node.name](list(ins), dict(self.attrs[node.name]))
        except AviatorError as error:
            raise self.fault(c, step, "kernel", f"node '{node.name}' ({node.op}): {error}") from error
        except Exception as error:  # a kernel failing on these values: name the node and the step
            raise self.fault(c, step, "kernel", f"node '{node.name}' ({node.op}): {type(error).__name__}: "
                             f"{error}") from error
        return [np.asarray(array) for array in outs]

    @staticmethod
    def _partial_sum(node: Node, ins: tuple[np.ndarray | None, ...]) -> np.ndarray:
        """A MoECombine's partial sum passed on (zeros before the first expert that ran)."""
        if len(ins) > 2 and ins[2] is not None:
            return ins[2]
        routing, out = ins[0], node.outputs[0].type
        assert routing is not None
        hidden = out.shape[-1]
        assert isinstance(hidden, int)  # an expert's output width is its weight's
        return np.zeros((*routing.shape[:-1], hidden), dtype=numpy_dtype(out.dtype))

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


class _Run(StreamInterpreter):
    """One run: every chiplet's values, the transfers in flight, the staging rules; the streams
    walked by the interpreter skeleton with one hook per instruction."""

    def __init__(self, backend: SimBackend, feeds: dict[str, np.ndarray]) -> None:
        super().__init__(backend.program, list(backend.streams))
        self.b = backend
        self.env: list[Any] = [None]  # every array of the run, by slot; slot 0 is an absent input
        self.feeds = {name: self._new(array) for name, array in feeds.items()}
        self.initializers: dict[str, int] = {}
        self.chiplets = {c: _Chiplet() for c in backend.streams}
        self.rules = StagingRules(backend.program, backend.sram_bytes, self._rule_fault)
        self.mailbox: dict[tuple[ValueRef, int, int], int] = {}
        self.counts = RunCounts()
        self.ops = Counter[str]()
        # A replaying backend's run walks the program without computing: the tape is what it records.
        self.tape: list[_Op] | None = [] if backend.replay else None
        self.computed: set[tuple[int, str, Part | None]] = set()  # a node's values are the same in every block
        # Mixture of experts: each block's routing by value name, the expert the computation being
        # recorded belongs to (its routing's slot, its index), each expert weight load's bytes.
        self.routing_slots: dict[str, int] = {}
        self.gate: tuple[int, int] | None = None
        self.expert_loads: list[tuple[ExpertRef, int]] = []

    def _rule_fault(self, rule: str, message: str, c: int, step: int) -> RuntimeFault:
        return self.b.fault(c, step, rule, message)

    def fault(self, c: int, step: int, rule: str, message: str, **fields: Any) -> RuntimeFault:
        return self.b.fault(c, step, rule, message, **fields)

    def _new(self, array: Any) -> int:
        self.env.append(array)
        return len(self.env) - 1

    def _apply(self, fn: Any, static: tuple[Any, ...], slots: tuple[int, ...], many: int = 0) -> Any:
        """`fn(*static, *arrays of slots)` into a new slot, or into `many` new slots (a list) for a
        list of results. On a walk that records the tape, the slots stay empty: the replay fills them."""
        if self.tape is not None:
            out: Any = [self._new(None) for _ in range(many)] if many else self._new(None)
            self.tape.append((fn, static, slots, out, bool(many), self.gate))
            return out
        result = fn(*static, *[self.env[s] for s in slots])
        return [self._new(array) for array in result] if many else self._new(result)

    def execute(self) -> None:
        self.run()
        for c in self.b.streams:
            self.rules.finish(c)
        self.counts.instructions = dict(sorted(self.ops.items()))
        self.counts.peak_sram_bytes = {c: self.rules.peak.get(c, 0) for c in sorted(self.chiplets)}

    def step(self, c: int, step: int, ins: Instruction, now: float) -> float | None:
        self.b.precedence.checkpoint()
        after = super().step(c, step, ins, now)
        if after is not BLOCKED:
            self.ops[ins.op] += 1
        return after

    def on_stall(self, blocked: dict[int, int]) -> bool:
        """Every stream is blocked: something from outside this run (another process's sends)
        may still come. Here every stream is in this run, so nothing can."""
        return False

    def deadlock(self, blocked: dict[int, int]) -> RuntimeFault:
        for c, step in blocked.items():
            ins = self.b.streams[c][step]
            if isinstance(ins, Recv) and (ins.value, ins.src, c) not in self.b.sends:
                return self.fault(c, step, "unmatched-recv", f"no stream sends '{ins.value}' from chiplet "
                                  f"{ins.src} to chiplet {c}")
            if isinstance(ins, Wait) and ins.event not in self.b.signalled and not self.rules.own_staging(c, ins.event):
                return self.fault(c, step, "unmatched-wait", f"no load of this stream and no signal fires "
                                  f"'{ins.event}'")
        where = ", ".join(f"stream {c} at step {step} ({format_instr(self.b.streams[c][step])})"
                          for c, step in blocked.items())
        c = next(iter(blocked))
        return self.fault(c, blocked[c], "deadlock", f"deadlock: streams blocked forever: {where}", blocked=blocked)

    # -- the hooks ------------------------------------------------------------------------

    def on_recv(self, c: int, step: int, ins: Recv, now: float) -> float | None:
        key = self.transfer_key(ins.value, ins.src, c)
        if self.await_key(c, key, now) is BLOCKED:
            return BLOCKED
        self._bind(c, ins.value, self.mailbox.pop(key))
        return now

    def on_wait(self, c: int, step: int, ins: Wait, now: float) -> float | None:
        if self.rules.own_staging(c, ins.event):
            self.rules.wait(c, step, ins.event)
        return self.await_key(c, ins.event, now)

    def on_compute(self, c: int, step: int, ins: Compute, now: float) -> float:
        self._compute(c, step, ins)
        return now

    def on_send(self, c: int, step: int, ins: Send, now: float) -> float:
        key = self.transfer_key(ins.value, c, ins.to)
        self.mailbox[key] = self._outgoing(c, step, ins.value)
        self.counts.bytes_sent += ins.bytes
        self.fire(key, now)
        return now

    def on_load(self, c: int, step: int, ins: Load, now: float) -> float:
        buffer = self.rules.buffer(c, step, "load", ins.buf)
        self.rules.load(c, step, buffer)
        self.counts.bytes_loaded += ins.bytes
        ref = self.b.expert_of_tile.get(buffer.tile) if buffer.tile is not None else None
        if ref is not None:  # a run whose tokens route elsewhere skips it
            self.expert_loads.append((ref, ins.bytes))
        self.fire(ins.buf, now)
        return now

    def on_free(self, c: int, step: int, ins: Free, now: float) -> float:
        self.rules.free(c, step, self.rules.buffer(c, step, "free", ins.buf))
        return now

    def on_signal(self, c: int, step: int, ins: Signal, now: float) -> float:
        self.fire(ins.event, now)
        return now

    def on_store(self, c: int, step: int, ins: Store, now: float) -> float:
        return now  # the session keeps the KV cache

    def on_host(self, c: int, step: int, ins: Host, now: float) -> float:
        self._label_slot(c, step, ins.value)  # the output must be here; the session samples
        return now

    # -- values --------------------------------------------------------------------------

    def _graph_name(self, name: str) -> str:
        """A block's value as the whole value it computes (`V@b` is V), unless the graph names it so."""
        graph_name, block = block_of(name)
        return graph_name if block is not None and not self._known(name) else name

    def _bind(self, c: int, label: ValueRef, slot: int) -> None:
        name = self._graph_name(label.name)
        if label.part is not None:
            self.chiplets[c].parts.setdefault(name, {})[label.part] = slot
        else:
            self.chiplets[c].values[name] = slot

    def _store(self, c: int, label: ValueRef, array: np.ndarray) -> None:
        """A value or part that arrived from outside the run (another process) onto chiplet c."""
        self._bind(c, label, self._new(array))

    def _outgoing(self, c: int, step: int, label: ValueRef) -> int:
        """The slot a send carries: the value, or with `--link-dtype int8` its rounding (`aviatorc.quant.link.int8_groups`)."""
        slot = self._label_slot(c, step, label)
        return self._apply(int8_groups, (), (slot,)) if self.b.link_dtype == "int8" else slot

    def _label_slot(self, c: int, step: int, label: ValueRef) -> int:
        name = self._graph_name(label.name)
        if label.part is None:
            return self._slot(c, step, name)
        part = self.chiplets[c].parts.get(name, {}).get(label.part)
        if part is None:
            raise self.fault(c, step, "missing-value", f"part {label.part} of '{label.name}' is not on chiplet {c}")
        return part

    def _read_label(self, c: int, step: int, label: ValueRef) -> np.ndarray:
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
        """A weight node's value from its parts on this chiplet, gated as its node is."""
        outer = self.gate
        self.gate = self._gate(self.b.graph.value(name).producer)
        try:
            if self._skipped():
                return self._new(None)
            return self._assemble_parts(c, step, name)
        finally:
            self.gate = outer

    def _assemble_parts(self, c: int, step: int, name: str) -> int:
        """A weight node's value from its parts on this chiplet: every part the program computes."""
        have = self.chiplets[c].parts[name]
        expected = self.b.parts_of.get(name, set())
        missing = sorted(expected - set(have))
        if missing:
            raise self.fault(c, step, "missing-value", f"reads '{name}' before all its parts are on chiplet {c}: "
                             f"missing {', '.join(map(str, missing))}", value=name)
        spans = sorted(have, key=lambda p: (p.start, p.stop, p.kind))
        kinds = {p.kind for p in spans}
        if len(kinds) != 1:
            raise self.fault(c, step, "missing-value", f"'{name}' has parts of mixed kinds {sorted(kinds)}")
        position = 0
        for part in spans:
            if part.start != position:
                raise self.fault(c, step, "missing-value", f"parts of '{name}' do not tile it: {part} follows "
                                 f"[0, {position})")
            position = part.stop
        slots = tuple(have[part] for part in spans)
        return self._apply(_columns if kinds == {"cols"} else _total, (), slots)

    # -- compute -------------------------------------------------------------------------

    def _compute(self, c: int, step: int, ins: Compute) -> None:
        bufs = [self.rules.buffer(c, step, "compute", name) for name in ins.bufs]
        for b in bufs:
            self.rules.read(c, step, b, f"compute '{ins.node}'")
        if (c, ins.node, ins.part) in self.computed:  # another block's: the same arrays
            return
        self.computed.add((c, ins.node, ins.part))
        node = self.b.nodes[ins.node]
        self.gate = self._gate(node)
        try:
            if self._skipped():
                self._skip(c, node, ins.part)
            else:
                self._compute_node(c, step, ins, node, bufs)
        finally:
            self.gate = None

    def _gate(self, node: Node | None) -> tuple[int, int] | None:
        """(the slot of its block's routing, its index) for a node of an expert whose routing this
        run computed; None for any other node."""
        ref = self.b.expert_of.get(node.name) if node is not None else None
        slot = self.routing_slots.get(ref.routing.name) if ref is not None else None
        return None if ref is None or slot is None else (slot, ref.expert)

    def _skipped(self) -> bool:
        """A run that computes as it walks: the computation at hand is an expert no token is routed
        to. (A recording walk records it gated: the replay decides per run.)"""
        return self.tape is None and self.gate is not None and not _routed(self.env, self.gate)

    def _skip(self, c: int, node: Node, part: Part | None) -> None:
        state = self.chiplets[c]
        for value in node.outputs:
            if part is None:
                state.values[value.name] = self._new(None)
            else:
                state.parts.setdefault(value.name, {})[part] = self._new(None)

    def _compute_node(self, c: int, step: int, ins: Compute, node: Node, bufs: list[Any]) -> None:
        part = ins.part
        if part is not None and part.kind == "kv":
            # The KV chunks stand for reads of the cache (possibly on other chiplets, whose partial
            # results are sent home); the node runs whole at the last chunk, on its home chiplet.
            if part.start != part.stop - 1:
                self.chiplets[c].parts.setdefault(node.outputs[0].name, {})[part] = self._new(np.zeros(0, np.float32))
                return
            part = None
        if part is None:
            self._whole(c, step, node)
            return
        if not bufs or bufs[0].tile is None:
            raise self.fault(c, step, "missing-buffer", f"part {part} of '{node.name}' names no weight buffer")
        tile = bufs[0].tile
        if not 0 <= tile < len(self.b.weights.tiles):
            raise self.fault(c, step, "unknown-tile", f"buffer '{bufs[0].name}' holds tile {tile}, not a weight tile")
        buf = bufs[0].name
        if part.kind == "cols" and node.op == "MatMul":
            out = self._matmul_part(c, step, node, buf, tile, part.start, part.stop)
        elif part.kind == "rows" and node.op == "Gather":
            out = self._gather_part(c, step, node, buf, tile, part.start, part.stop)
        else:
            raise self.fault(c, step, "bad-part", f"part {part} of a {node.op} node is not something the sim can run")
        self.chiplets[c].parts.setdefault(node.outputs[0].name, {})[part] = out

    def _whole(self, c: int, step: int, node: Node) -> None:
        slots = tuple(self._slot(c, step, v.name) if v is not None else 0 for v in node.inputs)
        outs = self._apply(self.b.kernel, (c, step, node), slots, many=len(node.outputs))
        if node.op == "MoERouter":
            self.routing_slots.setdefault(node.outputs[0].name, outs[0])
        values = self.chiplets[c].values
        for value, slot in zip(node.outputs, outs):
            values[value.name] = slot

    def _weight_dtype(self, node: Node, index: int) -> np.dtype:
        value = node.inputs[index]
        assert value is not None  # a weight node always has its weight input
        return numpy_dtype(value.type.dtype)

    def _matmul_part(self, c: int, step: int, node: Node, buf: str, tile: int, start: int, stop: int) -> int:
        info = self.b.weights.tiles[tile]
        (k0, k1), (n0, n1) = info.rows, info.cols
        weight = node.inputs[1]
        assert weight is not None
        full_k = weight.type.shape[-2]
        if info.is_embedding or k0 != 0 or (isinstance(full_k, int) and k1 != full_k):
            raise self.fault(c, step, "bad-part", f"tile t{tile} covers rows [{k0}, {k1}) of '{info.weight}': the "
                             "sim runs column strips over all of K only")
        if not n0 <= start < stop <= n1:
            raise self.fault(c, step, "bad-part", f"columns [{start}, {stop}) lie outside tile t{tile}'s "
                             f"[{n0}, {n1})")
        x = self._slot(c, step, self._input_name(node, 0))
        out = self._strip_product(c, buf, x, tile, start - n0, stop - n0, self._weight_dtype(node, 1))
        lora = self.b.lora
        if lora is not None and node.name in lora.nodes:
            out = self._apply(lora.add, (node.name, start, stop), (out, x))
        return out

    def _strip_product(self, c: int, buf: str, x: int, tile: int, a: int, b: int, dtype: np.dtype) -> int:
        """The slot of env[x] @ columns [a, b) of the tile in buffer `buf`: the kernel of a MatMul
        column strip, the one a backend with its own memory replaces (the checks around it stay the sim's).
        The tape names the strip; the replay reads it (with the strips it runs beside in one matrix)."""
        strip = _Strip(tile, a, b, dtype) if self.tape is not None else self.b.weights.columns(((tile, a, b),), dtype)
        return self._apply(_product, (strip,), (x,))

    def _gather_part(self, c: int, step: int, node: Node, buf: str, tile: int, start: int, stop: int) -> int:
        info = self.b.weights.tiles[tile]
        matrix = self.b.weights.tile(tile)
        # An embedding tile is stored as its table rows; a tied head's strip as [hidden, rows]: transposed.
        first, rows = (info.rows[0], matrix) if info.is_embedding else (info.cols[0], matrix.T)
        if self.b.attrs[node.name]["axis"] != 0:
            raise self.fault(c, step, "bad-part", f"a row range of a Gather along axis {self.b.attrs[node.name]['axis']}")
        if not first <= start < stop <= first + rows.shape[0]:
            raise self.fault(c, step, "bad-part", f"rows [{start}, {stop}) lie outside tile t{tile}'s rows "
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


# fn, static arguments, operand slots, result slot(s), many, gate (an expert's: its routing's slot and index)
_Op = tuple[Any, tuple[Any, ...], tuple[int, ...], Any, bool, "tuple[int, int] | None"]


def _routed(env: list[Any], gate: tuple[int, int]) -> bool:
    """Some token of the run is routed to the gate's expert (its weight in the routing is not 0)."""
    slot, expert = gate
    return bool(np.any(env[slot][..., expert]))


class _Experts:
    """What a run's MoE blocks did, read from its slots (so a replay reads its own): the experts
    that ran, the load bytes of those that did not, and pre-gating's hits (`PreGating`, on the
    hidden states and routings of the run; its router weights from the weight store)."""

    def __init__(self, run: _Run) -> None:
        b = run.b
        self.blocks = [(block, run.routing_slots[name]) for block in b.blocks
                       if (name := b.nodes[block.router].outputs[0].name) in run.routing_slots]
        self.loads = [(run.routing_slots[ref.routing.name], ref.expert, size) for ref, size in run.expert_loads
                      if ref.routing.name in run.routing_slots]
        self.gating = b.gating
        self.slots: dict[Value, int] = {}
        self.arrays: dict[Value, np.ndarray] = {}
        for value in b.gating.needs if b.gating is not None else ():
            slot = run.feeds.get(value.name) or next(
                (state.values[value.name] for state in run.chiplets.values() if value.name in state.values), None)
            if slot is not None:
                self.slots[value] = slot
                continue
            array = _whole_weight(b.weights, value) if value.is_initializer else None
            if array is None:  # not in this run (another rank's): no prediction here
                self.gating = None
                break
            self.arrays[value] = array

    def count(self, env: list[Any]) -> tuple[tuple[BlockRun, ...], int]:
        """The blocks' figures and the bytes of expert loads the run skipped."""
        predicted: dict[int, int] = {}
        if self.gating is not None:
            values = {**self.arrays, **{v: env[slot] for v, slot in self.slots.items()}}
            predicted = {hits.layer: hits.hits for hits in self.gating.hits(values)}
        found = []
        for block, slot in self.blocks:
            routed = env[slot].reshape(-1, block.experts) != 0
            found.append(BlockRun(block.layer, block.experts, int(routed.any(axis=0).sum()), int(routed.sum()),
                                  predicted.get(block.layer)))
        skipped = sum(size for slot, expert, size in self.loads if not _routed(env, (slot, expert)))
        return tuple(found), skipped


def _whole_weight(weights: WeightStore, value: Value) -> np.ndarray | None:
    """A weight as the graph's [K, N], from its initializer or its column tiles; None if it has
    neither (or tiles that split K)."""
    array = weights.initializer(value.name)
    if array is not None:
        return array
    tiles = sorted((t.cols, i) for i, t in enumerate(weights.tiles) if t.weight == value.name)
    k = value.type.shape[-2]
    if not tiles or any(weights.tiles[i].rows != (0, k) for _, i in tiles):
        return None
    return weights.columns(tuple((i, 0, n1 - n0) for (n0, n1), i in tiles), numpy_dtype(value.type.dtype))


@dataclass(frozen=True)
class _Strip:
    """Columns [a, b) of weight tile `tile` as `dtype`: the weight of a strip product on the tape."""

    tile: int
    a: int
    b: int
    dtype: np.dtype


class _Replay:
    """A checked run's computations, in the order it made them, to run again on new feeds.

    The slots of feeds and results are empty in the template; the others hold the walk's
    constants (initializers, empty KV parts)."""

    def __init__(self, run: _Run, outputs: dict[str, int], weights: WeightStore) -> None:
        assert run.tape is not None
        self.ops = _read_strips(run.tape, weights)
        self.feeds = run.feeds
        self.outputs = outputs
        self.counts = run.counts
        self.experts = _Experts(run)
        filled = set(run.feeds.values())
        for _, _, _, out, many, _ in self.ops:
            filled.update(out if many else (out,))
        self.template: list[Any] = [None if slot in filled else array for slot, array in enumerate(run.env)]

    def run(self, feeds: Mapping[str, np.ndarray], checkpoint: Any) -> tuple[dict[str, np.ndarray], RunCounts]:
        env = self.template.copy()
        for name, slot in self.feeds.items():
            if name not in feeds:
                raise RuntimeFault(f"the program reads the graph input '{name}', which the feeds lack",
                                   rule="missing-value", value=name)
            env[slot] = feeds[name]
        gates: dict[tuple[int, int], bool] = {}
        for fn, static, slots, out, many, gate in self.ops:
            if gate is not None:  # an expert's: it runs if some token is routed to it
                ran = gates.get(gate)
                if ran is None:
                    ran = gates[gate] = _routed(env, gate)
                if not ran:
                    continue
            checkpoint()
            result = fn(*static, *[env[s] for s in slots])
            if many:
                for slot, array in zip(out, result):
                    env[slot] = array
            else:
                env[out] = result
        counts = self.counts
        experts, skipped = self.experts.count(env)
        return ({name: env[slot] for name, slot in self.outputs.items()},
                RunCounts(dict(counts.instructions), counts.bytes_loaded - skipped, counts.bytes_sent,
                          dict(counts.peak_sram_bytes), {}, experts))


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


def _read_strips(ops: list[_Op], weights: WeightStore) -> list[_Op]:
    """The tape with its strip products' weights read, and the products that read the same
    activation (one weight's strips across chiplets, or q, k and v of one norm) as one GEMM over
    their strips side by side, at the first one's place: a product depends on its activation
    alone, so each result only becomes ready earlier. One wide GEMM reads the weights at a higher
    rate than many narrow ones. The side-by-side matrices are the weight store's, which the
    programs of a session share."""
    weights.prefetch(static[0].tile for fn, static, *_ in ops if fn is _product)
    groups: dict[tuple[int, np.dtype, int, tuple[int, int] | None], list[int]] = {}
    for i, (fn, static, slots, _, _, gate) in enumerate(ops):
        if fn is _product:
            strip: _Strip = static[0]
            rows = weights.tiles[strip.tile].rows
            groups.setdefault((slots[0], strip.dtype, rows[1] - rows[0], gate), []).append(i)
    read: dict[int, _Op] = {}
    dropped: set[int] = set()
    for (_, dtype, _, gate), members in groups.items():
        strips: list[_Strip] = [ops[i][1][0] for i in members]
        w_kn = weights.columns(tuple((s.tile, s.a, s.b) for s in strips), dtype)
        first = ops[members[0]]
        if len(members) == 1:
            read[members[0]] = (_product, (w_kn,), first[2], first[3], False, gate)
            continue
        edges = np.cumsum([0] + [s.b - s.a for s in strips]).tolist()
        read[members[0]] = (_products, (w_kn, tuple(zip(edges[:-1], edges[1:]))), first[2],
                            [ops[i][3] for i in members], True, gate)
        dropped.update(members[1:])
    return [read.get(i, op) for i, op in enumerate(ops) if i not in dropped]


def _columns(*parts: np.ndarray) -> np.ndarray:
    return np.concatenate(parts, axis=-1)


def _total(first: np.ndarray, *rest: np.ndarray) -> np.ndarray:
    total = first.copy()
    for part in rest:
        total += part
    return total
