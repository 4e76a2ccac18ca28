"""The plan IR: one instruction stream per chiplet, the buffers they use, and the text form.

A `Program` is what one phase (a decode step or a prefill) does on the machine:

    program decode batch=1 context=2048 prompt=128
    buffer w.t0 chiplet=0 bytes=1048576 kind=resident tile=t0
    buffer s.t9 chiplet=1 bytes=524288 kind=staging tile=t9
    stream 1 {
      load s.t9 card=0 bytes=524288
      recv h.3 src=0 bytes=8192
      wait s.t9
      compute node=layers.0.mlp.up bufs=s.t9 flops=1048576 bytes=524288 kind=int4 part=cols:0:512 fixed_ns=0
      free s.t9
      send up.3 to=0 bytes=1024
    }

Semantics (what the simulator, the checker and the runtime all read):
- `load BUF card=H bytes=B`: asynchronous copy of B bytes from card H's LPDDR into the staging
  buffer BUF on this stream's chiplet. BUF is allocated (counts against SRAM) from the moment
  the load is issued; its event BUF fires when the copy lands.
- `wait EVENT`: block until EVENT fired (a load of this stream, or a `signal` of another).
- `signal EVENT`: fire EVENT now.
- `compute node=N bufs=... flops=F bytes=B kind=K part=P fixed_ns=L`: run graph node N on this
  chiplet, reading weight buffers `bufs` (resident, or staged and waited for): F FLOPs on the
  matrix units at the peak of format kind K, B bytes read from SRAM, plus a fixed L ns (the
  target's per-layer latency, charged once per layer). `part` says which piece of the node
  this is: "" (the whole node), "cols:A:B" (output columns [A, B) of a weight's column strip),
  "rows:A:B" (the embedding rows [A, B) of a lookup), "kv:I:N" (chunk I of N of the KV cache).
- `send VALUE to=D bytes=B`: asynchronous transfer of an activation to chiplet D over the link
  level the two chiplets share; `recv VALUE src=S bytes=B` blocks until it has arrived.
- `free BUF`: release a staging buffer.

Resident weight buffers, the KV cache held in SRAM and each chiplet's activation scratch are
declared with their chiplet and bytes and live for the whole program (the cold start fills
them). Instruction kinds are one table (`INSTRUCTIONS`): adding one means adding a row there.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from aviatorc.errors import ModelFormatError

PLAN_IR_VERSION = 1
BUFFER_KINDS = ("resident", "staging", "kv", "scratch")
PHASES = ("decode", "prefill")


@dataclass(frozen=True)
class InstrSpec:
    """One instruction kind: its operand (positional, if any) and its named fields with types."""

    name: str
    operand: str | None  # the positional field ("buf", "event", "value"), or None
    fields: tuple[tuple[str, type], ...]
    blocking: bool  # the stream waits for something outside itself
    doc: str

    @property
    def field_names(self) -> frozenset[str]:
        return _FIELD_NAMES[self.name]


INSTRUCTIONS: dict[str, InstrSpec] = {spec.name: spec for spec in (
    InstrSpec("load", "buf", (("card", int), ("bytes", int)), False,
              "copy bytes from a card's LPDDR into a staging buffer (asynchronous; its event is the buffer)"),
    InstrSpec("wait", "event", (), True, "block until an event has fired"),
    InstrSpec("signal", "event", (), False, "fire an event"),
    InstrSpec("compute", None, (("node", str), ("bufs", tuple), ("flops", int), ("bytes", int), ("kind", str),
                                ("part", str), ("fixed_ns", int)), False,
              "run (a part of) a graph node on this chiplet's matrix units"),
    InstrSpec("send", "value", (("to", int), ("bytes", int)), False, "send an activation to another chiplet"),
    InstrSpec("recv", "value", (("src", int), ("bytes", int)), True, "receive an activation"),
    InstrSpec("free", "buf", (), False, "release a staging buffer"),
)}


_FIELD_NAMES = {spec.name: frozenset(name for name, _ in spec.fields) for spec in INSTRUCTIONS.values()}


@dataclass(frozen=True)
class Instr:
    """One instruction. `args` holds the spec's operand and fields by name."""

    op: str
    args: dict[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.args[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.args.get(key, default)

    @property
    def operand(self) -> Any:
        spec = INSTRUCTIONS[self.op]
        return self.args[spec.operand] if spec.operand else None


def instr(op: str, operand: Any = None, **fields: Any) -> Instr:
    """Build an instruction, checking it against its spec (unknown op or field, missing field)."""
    spec = INSTRUCTIONS.get(op)
    if spec is None:
        raise ValueError(f"unknown plan instruction '{op}'")
    args: dict[str, Any] = {}
    if spec.operand:
        if operand is None:
            raise ValueError(f"'{op}' needs its {spec.operand}")
        args[spec.operand] = operand
    unknown = fields.keys() - spec.field_names
    if unknown:
        raise ValueError(f"'{op}' has no field(s) {sorted(unknown)}")
    for name, kind in spec.fields:
        if name not in fields:
            raise ValueError(f"'{op}' needs field '{name}'")
        value = fields[name]
        if kind is tuple and not isinstance(value, (list, tuple)):
            raise ValueError(f"'{op}' field '{name}' must be a list, not {value!r}")
        args[name] = tuple(str(v) for v in value) if kind is tuple else kind(value)
    return Instr(op, args)


@dataclass(frozen=True)
class Buffer:
    """SRAM on one chiplet: a resident or staged weight tile, a KV-cache block, or scratch."""

    name: str
    chiplet: int
    bytes: int
    kind: str
    tile: str = ""  # the tile (or KV chunk) it holds

    def __post_init__(self) -> None:
        if self.kind not in BUFFER_KINDS:
            raise ValueError(f"buffer '{self.name}': unknown kind '{self.kind}'")


@dataclass(frozen=True)
class Workload:
    """What a program is compiled for: `batch` sequences, `context` tokens of KV cache each
    (decode), a prompt of `prompt` tokens (prefill)."""

    batch: int = 1
    context: int = 2048
    prompt: int = 128

    def tokens(self, phase: str) -> int:
        """Tokens one program processes: one per sequence in decode, the prompts in prefill."""
        return self.batch * (self.prompt if phase == "prefill" else 1)


@dataclass
class Program:
    """One phase on the machine: buffers and one instruction stream per chiplet."""

    phase: str
    workload: Workload
    buffers: dict[str, Buffer] = field(default_factory=dict)
    streams: dict[int, list[Instr]] = field(default_factory=dict)

    def add_buffer(self, buffer: Buffer) -> Buffer:
        if buffer.name in self.buffers:
            raise ValueError(f"buffer '{buffer.name}' declared twice")
        self.buffers[buffer.name] = buffer
        return buffer

    def emit(self, chiplet: int, instruction: Instr) -> None:
        self.streams.setdefault(chiplet, []).append(instruction)

    def instructions(self) -> Iterator[tuple[int, int, Instr]]:
        """(chiplet, step, instruction) over every stream, streams in chiplet order."""
        for chiplet in sorted(self.streams):
            for step, ins in enumerate(self.streams[chiplet]):
                yield chiplet, step, ins

    def count(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for _, _, ins in self.instructions():
            counts[ins.op] = counts.get(ins.op, 0) + 1
        return dict(sorted(counts.items()))

    # -- JSON ----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "workload": {"batch": self.workload.batch, "context": self.workload.context,
                         "prompt": self.workload.prompt},
            "buffers": [[b.name, b.chiplet, b.bytes, b.kind, b.tile] for b in self.buffers.values()],
            "streams": {str(c): [_instr_list(i) for i in self.streams[c]] for c in sorted(self.streams)},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Program:
        try:
            program = cls(str(data["phase"]), Workload(**{k: int(v) for k, v in data["workload"].items()}))
            for name, chiplet, nbytes, kind, tile in data["buffers"]:
                program.add_buffer(Buffer(str(name), int(chiplet), int(nbytes), str(kind), str(tile)))
            for chiplet, items in data["streams"].items():
                program.streams[int(chiplet)] = [_instr_from_list(item) for item in items]
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as error:
            raise ModelFormatError(f"malformed plan program: {error}") from None
        if program.phase not in PHASES:
            raise ModelFormatError(f"unknown plan phase '{program.phase}'")
        return program

    # -- text ----------------------------------------------------------------------------

    def to_text(self) -> str:
        w = self.workload
        lines = [f"program {self.phase} batch={w.batch} context={w.context} prompt={w.prompt}"]
        for b in self.buffers.values():
            lines.append(f"buffer {_word(b.name)} chiplet={b.chiplet} bytes={b.bytes} kind={b.kind}"
                         + (f" tile={_word(b.tile)}" if b.tile else ""))
        for c in sorted(self.streams):
            lines.append(f"stream {c} {{")
            lines += ["  " + format_instr(i) for i in self.streams[c]]
            lines.append("}")
        return "\n".join(lines) + "\n"


def _instr_list(ins: Instr) -> list[Any]:
    spec = INSTRUCTIONS[ins.op]
    out: list[Any] = [ins.op]
    if spec.operand:
        out.append(ins.args[spec.operand])
    out += [list(ins.args[n]) if k is tuple else ins.args[n] for n, k in spec.fields]
    return out


def _instr_from_list(item: list[Any]) -> Instr:
    op, rest = item[0], list(item[1:])
    spec = INSTRUCTIONS.get(op)
    if spec is None:
        raise ValueError(f"unknown instruction '{op}'")
    operand = rest.pop(0) if spec.operand else None
    if len(rest) != len(spec.fields):
        raise ValueError(f"'{op}' takes {len(spec.fields)} fields, got {len(rest)}")
    return instr(op, operand, **{name: value for (name, _), value in zip(spec.fields, rest, strict=True)})


_PLAIN = re.compile(r"[A-Za-z0-9_.:/\-]+\Z")


def _word(text: str) -> str:
    return text if _PLAIN.match(text) else json.dumps(text)


def format_instr(ins: Instr) -> str:
    spec = INSTRUCTIONS[ins.op]
    parts = [ins.op]
    if spec.operand:
        parts.append(_word(str(ins.args[spec.operand])))
    for name, kind in spec.fields:
        value = ins.args[name]
        parts.append(f"{name}=" + (",".join(_word(v) for v in value) if kind is tuple else _word(str(value))))
    return " ".join(parts)


# A token runs to the next space outside quotes: `node="a b"` and `bufs="x y",z` are one token each.
_TOKEN = re.compile(r'(?:"(?:[^"\\]|\\.)*"|[^\s"])+')


def _unword(text: str) -> str:
    return json.loads(text) if text.startswith('"') else text


def parse_program(text: str) -> Program:
    """The inverse of `Program.to_text`: `parse_program(p.to_text()).to_text() == p.to_text()`."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines or not lines[0].startswith("program "):
        raise ModelFormatError("plan text must start with 'program PHASE ...'")
    head = lines[0].split()
    try:
        kv = dict(part.split("=", 1) for part in head[2:])
        program = Program(head[1], Workload(int(kv["batch"]), int(kv["context"]), int(kv["prompt"])))
    except (KeyError, ValueError, IndexError) as error:
        raise ModelFormatError(f"plan text line 1: malformed header ({error}): {lines[0]}") from None
    if program.phase not in PHASES:
        raise ModelFormatError(f"plan text line 1: unknown plan phase '{program.phase}' (expected one of {', '.join(PHASES)})")
    chiplet: int | None = None
    for number, line in enumerate(lines[1:], start=2):
        try:
            if line.startswith("buffer "):
                tokens = _TOKEN.findall(line)
                fields = dict(t.split("=", 1) for t in tokens[2:])
                program.add_buffer(Buffer(_unword(tokens[1]), int(fields["chiplet"]), int(fields["bytes"]),
                                          fields["kind"], _unword(fields.get("tile", ""))))
            elif line.startswith("stream "):
                if chiplet is not None:
                    raise ValueError(f"stream {chiplet} is not closed")
                chiplet = int(line.split()[1])
                if chiplet in program.streams:
                    raise ValueError(f"stream {chiplet} appears twice")
                program.streams[chiplet] = []
            elif line == "}":
                chiplet = None
            elif chiplet is not None:
                program.streams[chiplet].append(_parse_instr(line))
            else:
                raise ValueError("instruction outside a stream")
        except (KeyError, ValueError, IndexError) as error:
            raise ModelFormatError(f"plan text line {number}: {error}: {line}") from None
    if chiplet is not None:
        raise ModelFormatError(f"plan text: stream {chiplet} is not closed with '}}'")
    return program


def _parse_instr(line: str) -> Instr:
    tokens = _TOKEN.findall(line)
    op = tokens[0]
    spec = INSTRUCTIONS.get(op)
    if spec is None:
        raise ValueError(f"unknown instruction '{op}'")
    rest = tokens[1:]
    operand = _unword(rest.pop(0)) if spec.operand else None
    kinds = dict(spec.fields)
    fields: dict[str, Any] = {}
    for token in rest:
        name, _, raw = token.partition("=")
        if kinds.get(name) is tuple:
            fields[name] = tuple(_unword(v) for v in _split_list(raw))
        else:
            fields[name] = _unword(raw)
    return instr(op, operand, **fields)


def _split_list(raw: str) -> list[str]:
    if not raw:
        return []
    return [m.group(0) for m in re.finditer(r'"(?:[^"\\]|\\.)*"|[^,]+', raw)]
