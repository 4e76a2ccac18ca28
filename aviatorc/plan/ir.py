"""The plan IR: one instruction stream per chiplet, the buffers they use, and their serial forms.

A `Program` is what one phase (a decode step or a prefill) does on the machine:

    program decode batch=1 context=2048 prompt=128
    buffer w.t0 chiplet=0 bytes=1048576 kind=resident tile=t0
    buffer s.t9.0 chiplet=1 bytes=524288 kind=staging tile=t9
    stream 1 {
      load s.t9.0 channel=1 bytes=524288
      recv h.3 src=0 bytes=8192
      wait s.t9.0
      compute node=layers.0.mlp.up bufs=s.t9.0 flops=1048576 bytes=524288 vector_bytes=0 kind=int4 part=cols:0:512 layer_latency=0
      free s.t9.0
      send up.3[cols:0:512] to=0 bytes=1024
    }

Semantics (what the checker, the simulator and every backend read; `aviatorc.plan.interpret`
is the one loop that walks the streams for all of them):
- `load BUF channel=H bytes=B`: asynchronous copy of B bytes from LPDDR channel H into the
  staging buffer BUF on this stream's chiplet (across the link between them when H attaches to
  another chiplet). BUF counts against SRAM from the moment the load is issued; event BUF fires
  when the copy lands. In a mixture of experts' step, the loads of experts its routing skips are
  not made, and the runtime may issue the others before their instruction: in program order,
  within the staging the program was built with, a routed expert's once its stream knows the
  block's routing (or a predictor named it) (`aviatorc.schedule.simulate.Activity`).
- `wait EVENT`: block until EVENT fired (a load of this stream, or a `signal` of another).
- `signal EVENT`: fire EVENT now.
- `compute node=N bufs=... flops=F bytes=B vector_bytes=V kind=K part=P layer_latency=L`: run graph
  node N (or part P of it) on this chiplet, reading weight buffers `bufs` (resident, or staged and
  waited for): F FLOPs on the matrix units at the peak of format K, B bytes read from SRAM, V bytes
  through the vector units, and with L=1 the target's per-layer latency (charged once per layer).
  `part` is empty (the whole node), `cols:A:B` (output columns [A, B) of a column strip), `rows:A:B`
  (table rows [A, B) of a lookup) or `kv:I:N` (chunk I of N of a streamed KV cache).
- `send VALUE to=D bytes=B`: asynchronous transfer of an activation (or a part of one, written
  `name[cols:A:B]`) to chiplet D over the link level the two share; `recv VALUE src=S bytes=B`
  blocks until it has arrived.
- `free BUF`: release a staging buffer.
- `store WHAT channel=H bytes=B`: asynchronous write of B bytes to LPDDR channel H (a KV cache
  kept in LPDDR gets its new tokens).
- `host VALUE bytes=B`: hand the output VALUE (B bytes) to the host and block until its next
  token is back: the PCIe round trip and the host's per-token work (sampling).

Each instruction kind is one frozen dataclass below, registered in `INSTRUCTIONS`: its fields
(with their types) define the text form, the JSON form and what `parse_program` accepts, so adding
an instruction is adding a class here and one hook per consumer of `StreamInterpreter`.

References have one text form each, defined here and nowhere else: a tile is `t<index>`
(`tile_name`), a part `cols:A:B` (`Part`), a sent value `name` or `name[part]` (`ValueRef`).

Resident weight buffers, the KV cache held in SRAM and each chiplet's activation scratch are
declared with their chiplet and bytes and live for the whole program (the cold start fills them).

The JSON form (`Program.to_dict`, inside plan.json) is compact: names are indices into a string
table and buffers indices into a buffer table, both shared by the plan's programs (`Tables`), and
each stream is one flat list of integers: per instruction its opcode, then its fields in
declaration order (a list of names as its length and the names, a part as kind, start, stop or
-1 for none, a value as its name and its part).
"""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from aviatorc.errors import ModelFormatError

PLAN_IR_VERSION = 2
BUFFER_KINDS = ("resident", "staging", "kv", "scratch")
PHASES = ("decode", "prefill")
PART_KINDS = ("cols", "rows", "kv")


# -- references ---------------------------------------------------------------------------------


def tile_name(index: int) -> str:
    """The text form of a weight tile reference (also the prefix of its tensors in the weights file)."""
    return f"t{index}"


def parse_tile_name(text: str) -> int:
    if len(text) < 2 or text[0] != "t" or not text[1:].isdigit():
        raise ValueError(f"'{text}' is not a tile reference (t<index>)")
    return int(text[1:])


class Part(NamedTuple):
    """A piece of a node's output: output columns, table rows, or a chunk of the KV cache.
    (A named tuple: it is hashed for every transfer a run matches.)"""

    kind: str  # one of PART_KINDS
    start: int
    stop: int

    @classmethod
    def of(cls, kind: str, start: int, stop: int) -> Part:
        """A checked part (the constructor itself does not check)."""
        if kind not in PART_KINDS:
            raise ValueError(f"unknown part kind '{kind}' (expected one of {', '.join(PART_KINDS)})")
        if not 0 <= start < stop:
            raise ValueError(f"part {kind}:{start}:{stop} is empty or negative")
        return cls(kind, start, stop)

    def __str__(self) -> str:
        return f"{self.kind}:{self.start}:{self.stop}"

    @classmethod
    def parse(cls, text: str) -> Part:
        kind, _, rest = text.partition(":")
        start, _, stop = rest.partition(":")
        if not start.isdigit() or not stop.isdigit():
            raise ValueError(f"'{text}' is not a part (kind:start:stop)")
        return cls.of(kind, int(start), int(stop))


class ValueRef(NamedTuple):
    """An activation a stream sends or receives: a whole value, or one part of it."""

    name: str
    part: Part | None = None

    def __str__(self) -> str:
        return self.name if self.part is None else f"{self.name}[{self.part}]"

    @classmethod
    def parse(cls, text: str) -> ValueRef:
        match = _PART_SUFFIX.match(text)
        if match:
            return cls(match.group(1), Part.parse(match.group(2)))
        return cls(text)


_PART_SUFFIX = re.compile(r"(.*)\[((?:cols|rows|kv):\d+:\d+)\]\Z", re.DOTALL)
_BLOCK_SUFFIX = re.compile(r"(.*)@(\d+)\Z", re.DOTALL)


def block_value(name: str, block: int) -> str:
    """Value `name` as token block `block` of a prefill pass has it (`name@block`)."""
    return f"{name}@{block}"


def block_of(name: str) -> tuple[str, int | None]:
    """A value's graph name and its token block (None: not a block's)."""
    match = _BLOCK_SUFFIX.match(name)
    return (match.group(1), int(match.group(2))) if match else (name, None)


# -- instructions -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Instruction:
    """The base of every instruction kind. Class attributes say how a stream treats it."""

    op: ClassVar[str]
    operand: ClassVar[str | None]  # the field written first without its name, if any
    blocking: ClassVar[bool] = False  # the stream waits for something outside itself
    claims: ClassVar[bool] = False  # it claims a shared resource (a channel, a link, the host)

    @property
    def operand_value(self) -> Any:
        return getattr(self, self.operand) if self.operand else None


INSTRUCTIONS: dict[str, type[Instruction]] = {}


def _instruction(op: str, operand: str | None = None, *, blocking: bool = False,
                 claims: bool = False) -> Callable[[type[Instruction]], type[Instruction]]:
    def register(cls: type[Instruction]) -> type[Instruction]:
        cls.op, cls.operand, cls.blocking, cls.claims = op, operand, blocking, claims
        INSTRUCTIONS[op] = cls
        return cls

    return register


@_instruction("load", "buf", claims=True)
@dataclass(frozen=True, slots=True)
class Load(Instruction):
    """Copy bytes from an LPDDR channel into a staging buffer (asynchronous; its event is the buffer)."""

    buf: str
    channel: int
    bytes: int


@_instruction("wait", "event", blocking=True)
@dataclass(frozen=True, slots=True)
class Wait(Instruction):
    """Block until an event has fired."""

    event: str


@_instruction("signal", "event", claims=True)
@dataclass(frozen=True, slots=True)
class Signal(Instruction):
    """Fire an event."""

    event: str


@_instruction("compute")
@dataclass(frozen=True, slots=True)
class Compute(Instruction):
    """Run (a part of) a graph node on this chiplet's matrix and vector units."""

    node: str
    bufs: tuple[str, ...]
    flops: int
    bytes: int
    vector_bytes: int
    kind: str
    part: Part | None
    layer_latency: bool


@_instruction("send", "value", claims=True)
@dataclass(frozen=True, slots=True)
class Send(Instruction):
    """Send an activation to another chiplet (asynchronous)."""

    value: ValueRef
    to: int
    bytes: int


@_instruction("recv", "value", blocking=True)
@dataclass(frozen=True, slots=True)
class Recv(Instruction):
    """Receive an activation another chiplet sends."""

    value: ValueRef
    src: int
    bytes: int


@_instruction("free", "buf")
@dataclass(frozen=True, slots=True)
class Free(Instruction):
    """Release a staging buffer."""

    buf: str


@_instruction("store", "what", claims=True)
@dataclass(frozen=True, slots=True)
class Store(Instruction):
    """Write bytes to an LPDDR channel (asynchronous): a KV cache in LPDDR gets its new tokens."""

    what: str
    channel: int
    bytes: int


@_instruction("host", "value", blocking=True, claims=True)
@dataclass(frozen=True, slots=True)
class Host(Instruction):
    """Hand an output to the host and wait for the next token: PCIe both ways and the host's work."""

    value: ValueRef
    bytes: int


# Each kind's fields with their types, in declaration order: what the serial forms walk.
_FIELDS: dict[str, tuple[tuple[str, Any], ...]] = {
    op: tuple((f.name, typing.get_type_hints(cls)[f.name]) for f in dataclasses.fields(cls))
    for op, cls in INSTRUCTIONS.items()
}
OPCODES = {op: index for index, op in enumerate(INSTRUCTIONS)}
_OPS = list(INSTRUCTIONS)


def fields_of(op: str) -> tuple[tuple[str, Any], ...]:
    return _FIELDS[op]


# -- buffers and programs -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Buffer:
    """SRAM on one chiplet: a resident or staged weight tile, a KV-cache block, or scratch.
    `tile` is the weight tile it holds; `layer` the layer whose KV cache it holds."""

    name: str
    chiplet: int
    bytes: int
    kind: str
    tile: int | None = None
    layer: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in BUFFER_KINDS:
            raise ValueError(f"buffer '{self.name}': unknown kind '{self.kind}'")
        if self.bytes < 0 or self.chiplet < 0:
            raise ValueError(f"buffer '{self.name}': negative bytes or chiplet")
        if self.tile is not None and self.layer is not None:
            raise ValueError(f"buffer '{self.name}' holds both a tile and a KV cache")

    @property
    def holds(self) -> str:
        """What it holds, as text: 't12', 'kv.3', or ''."""
        if self.tile is not None:
            return tile_name(self.tile)
        return f"kv.{self.layer}" if self.layer is not None else ""


@dataclass(frozen=True)
class Workload:
    """What a program is compiled for: `batch` sequences, `context` tokens of KV cache each
    (decode), a prompt of `prompt` tokens (prefill). `positions`: the new tokens each sequence
    brings to a decode step: 1, or k + 1 when the step verifies k drafted tokens (each reads its
    sequence's cache once for all its positions). `lora_rank`, `max_loras`: LoRA adapters of up to
    that rank, that many at once, beside the weights (`aviatorc.runtime.lora`; 0: none). `chunk`:
    in a mixed step of chunked prefill, one of the batch's sequences is a prompt arriving and brings
    that many of its tokens while the others decode (0: none)."""

    batch: int = 1
    context: int = 2048
    prompt: int = 128
    positions: int = 1
    lora_rank: int = 0
    max_loras: int = 0
    chunk: int = 0

    def tokens(self, phase: str) -> int:
        """Tokens one program processes: `positions` per sequence (and a mixed step's chunk) in
        decode, the prompts in prefill."""
        if phase == "prefill":
            return self.batch * self.prompt
        return self.batch * self.positions if not self.chunk else (self.batch - 1) * self.positions + self.chunk

    def outputs(self) -> int:
        """Logits a decode step hands the host: one per position, and one for a mixed step's chunk
        (its last token's, which the next token comes from once the prompt is in)."""
        return self.batch * self.positions if not self.chunk else (self.batch - 1) * self.positions + 1

    def to_dict(self) -> dict[str, int]:
        out = {"batch": self.batch, "context": self.context, "prompt": self.prompt}
        optional = {"positions": (self.positions, 1), "lora_rank": (self.lora_rank, 0), "max_loras": (self.max_loras, 0),
                    "chunk": (self.chunk, 0)}
        return out | {key: value for key, (value, default) in optional.items() if value != default}


@dataclass
class Program:
    """One phase on the machine: buffers and one instruction stream per chiplet."""

    phase: str
    workload: Workload
    buffers: dict[str, Buffer] = field(default_factory=dict)
    streams: dict[int, list[Instruction]] = field(default_factory=dict)

    def add_buffer(self, buffer: Buffer) -> Buffer:
        if buffer.name in self.buffers:
            raise ValueError(f"buffer '{buffer.name}' declared twice")
        self.buffers[buffer.name] = buffer
        return buffer

    def emit(self, chiplet: int, instruction: Instruction) -> None:
        self.streams.setdefault(chiplet, []).append(instruction)

    def instructions(self) -> Iterator[tuple[int, int, Instruction]]:
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

    def to_dict(self, tables: Tables | None = None) -> dict[str, Any]:
        """The compact JSON form. Names and buffers go into `tables`, which the plan's programs
        share (a program alone keeps its own, under "tables")."""
        own = tables is None
        table = Tables() if tables is None else tables
        out: dict[str, Any] = {
            "phase": self.phase,
            "workload": self.workload.to_dict(),
            "buffers": [table.buffer(b) for b in self.buffers.values()],
            "streams": {str(c): _encode_stream(self.streams[c], table) for c in sorted(self.streams)},
        }
        if own:
            out["tables"] = table.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Any, tables: Tables | None = None) -> Program:
        """The inverse of `to_dict`; anything malformed is a ModelFormatError saying where."""
        where = "plan program"
        try:
            if not isinstance(data, dict):
                raise ValueError("must be an object")
            table = Tables.from_dict(data["tables"]) if tables is None else tables
            phase = _expect(data["phase"], str, "phase")
            where = f"plan program '{phase}'"
            if phase not in PHASES:
                raise ValueError(f"unknown phase '{phase}' (expected one of {', '.join(PHASES)})")
            program = cls(phase, _workload(data["workload"]))
            for index in _expect(data["buffers"], list, "buffers"):
                program.add_buffer(table.buffer_at(_int(index)))
            for chiplet, items in _expect(data["streams"], dict, "streams").items():
                if not chiplet.isdigit():
                    raise ValueError(f"stream key '{chiplet}' is not a chiplet number")
                where = f"plan program '{phase}', stream {chiplet}"
                program.streams[int(chiplet)] = _decode_stream(_expect(items, list, "a stream"), table.strings)
        except ModelFormatError:
            raise
        except (KeyError, TypeError, ValueError, IndexError) as error:
            raise ModelFormatError(f"malformed {where}: {type(error).__name__}: {error}") from None
        return program

    # -- text ----------------------------------------------------------------------------

    def to_text(self) -> str:
        fields = " ".join(f"{key}={value}" for key, value in self.workload.to_dict().items())
        lines = [f"program {self.phase} {fields}"]
        for b in self.buffers.values():
            holds = f" tile={tile_name(b.tile)}" if b.tile is not None else (
                f" layer={b.layer}" if b.layer is not None else "")
            lines.append(f"buffer {_word(b.name)} chiplet={b.chiplet} bytes={b.bytes} kind={b.kind}{holds}")
        for c in sorted(self.streams):
            lines.append(f"stream {c} {{")
            lines += ["  " + format_instr(i) for i in self.streams[c]]
            lines.append("}")
        return "\n".join(lines) + "\n"


class Tables:
    """The names and buffers a plan's programs use, each stored once: an instruction holds the
    index of a name, a program the indices of its buffers."""

    def __init__(self, strings: Sequence[str] = (), buffers: Sequence[Buffer] = ()) -> None:
        self.strings: list[str] = list(strings)
        self.buffers: list[Buffer] = list(buffers)
        self._strings = {name: i for i, name in enumerate(self.strings)}
        self._buffers = {b: i for i, b in enumerate(self.buffers)}

    def index(self, name: str) -> int:
        found = self._strings.get(name)
        if found is None:
            found = self._strings[name] = len(self.strings)
            self.strings.append(name)
        return found

    def buffer(self, b: Buffer) -> int:
        found = self._buffers.get(b)
        if found is None:
            found = self._buffers[b] = len(self.buffers)
            self.buffers.append(b)
        return found

    def buffer_at(self, index: int) -> Buffer:
        if not 0 <= index < len(self.buffers):
            raise ValueError(f"buffer index {index} is outside the table of {len(self.buffers)}")
        return self.buffers[index]

    def to_dict(self) -> dict[str, Any]:
        # A buffer row: [name, chiplet, bytes, kind, tile or -1, layer or -1].
        rows = [[self.index(b.name), b.chiplet, b.bytes, BUFFER_KINDS.index(b.kind),
                 -1 if b.tile is None else b.tile, -1 if b.layer is None else b.layer] for b in self.buffers]
        return {"strings": self.strings, "buffers": rows}

    @classmethod
    def from_dict(cls, data: Any) -> Tables:
        data = _expect(data, dict, "tables")
        strings = _expect(data["strings"], list, "strings")
        if not all(isinstance(n, str) for n in strings):
            raise ValueError("the string table holds a non-string")
        buffers = []
        for row in _expect(data["buffers"], list, "buffers"):
            name, chiplet, nbytes, kind, tile, layer = _expect(row, list, "a buffer")
            kind = _int(kind)
            if not 0 <= kind < len(BUFFER_KINDS):
                raise ValueError(f"unknown buffer kind {kind}")
            buffers.append(Buffer(_string(strings, name), _int(chiplet), _int(nbytes), BUFFER_KINDS[kind],
                                  None if _int(tile) < 0 else tile, None if _int(layer) < 0 else layer))
        return cls(strings, buffers)


# -- the JSON codec: a stream is one flat list of integers, one rule per field type ---------------


def _encode_stream(stream: Sequence[Instruction], table: Tables) -> list[int]:
    out: list[int] = []
    for ins in stream:
        out.append(OPCODES[ins.op])
        for name, kind in _FIELDS[ins.op]:
            value = getattr(ins, name)
            if kind is str:
                out.append(table.index(value))
            elif kind is int:
                out.append(value)
            elif kind is bool:
                out.append(1 if value else 0)
            elif kind == tuple[str, ...]:
                out += [len(value), *(table.index(v) for v in value)]
            elif kind == Part | None:
                out += [-1] if value is None else [PART_KINDS.index(value.kind), value.start, value.stop]
            elif kind is ValueRef:
                out.append(table.index(value.name))
                part = value.part
                out += [-1] if part is None else [PART_KINDS.index(part.kind), part.start, part.stop]
            else:  # pragma: no cover - a field type without a rule is a bug in this module
                raise TypeError(f"no JSON rule for field '{name}' of '{ins.op}'")
    return out


def _decode_stream(items: list[Any], names: list[str]) -> list[Instruction]:
    stream: list[Instruction] = []
    at = 0

    def take() -> int:
        nonlocal at
        if at >= len(items):
            raise ValueError(f"the stream ends inside an instruction (at item {at})")
        value = _int(items[at])
        at += 1
        return value

    def part() -> Part | None:
        kind = take()
        if kind == -1:
            return None
        if not 0 <= kind < len(PART_KINDS):
            raise ValueError(f"unknown part kind {kind}")
        return Part.of(PART_KINDS[kind], take(), take())

    while at < len(items):
        opcode = take()
        if not 0 <= opcode < len(_OPS):
            raise ValueError(f"unknown opcode {opcode} (item {at - 1})")
        op = _OPS[opcode]
        values: dict[str, Any] = {}
        for name, kind in _FIELDS[op]:
            if kind is str:
                values[name] = _string(names, take())
            elif kind is int:
                values[name] = take()
            elif kind is bool:
                values[name] = bool(take())
            elif kind == tuple[str, ...]:
                count = take()
                if not 0 <= count <= len(items) - at:
                    raise ValueError(f"a list of {count} names where {len(items) - at} items are left")
                values[name] = tuple(_string(names, take()) for _ in range(count))
            elif kind == Part | None:
                values[name] = part()
            elif kind is ValueRef:
                values[name] = ValueRef(_string(names, take()), part())
        stream.append(make(op, **values))
    return stream


# A count (a channel, chiplet, byte or flop count) is at most 2^53: the largest integer every JSON
# reader holds exactly, and far above one instruction's bytes or flops on any target.
MAX_COUNT = 1 << 53


def make(op: str, **values: Any) -> Instruction:
    """An instruction of kind `op` from its fields by name, checked against their types."""
    cls = INSTRUCTIONS.get(op)
    if cls is None:
        raise ValueError(f"unknown plan instruction '{op}'")
    spec = dict(_FIELDS[op])
    unknown = values.keys() - spec.keys()
    if unknown:
        raise ValueError(f"'{op}' has no field(s) {sorted(unknown)}")
    for name, kind in spec.items():
        if name not in values:
            raise ValueError(f"'{op}' needs field '{name}'")
        value = values[name]
        if kind is int and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT):
            raise ValueError(f"'{op}' field '{name}' must be a count in [0, 2^53], not {value!r}")
        if kind is str and not isinstance(value, str):
            raise ValueError(f"'{op}' field '{name}' must be a name, not {value!r}")
        if kind is bool and not isinstance(value, bool):
            raise ValueError(f"'{op}' field '{name}' must be true or false, not {value!r}")
        if kind == tuple[str, ...] and not (isinstance(value, tuple) and all(isinstance(v, str) for v in value)):
            raise ValueError(f"'{op}' field '{name}' must be a tuple of names, not {value!r}")
        if kind == Part | None and not (value is None or isinstance(value, Part)):
            raise ValueError(f"'{op}' field '{name}' must be a Part or None, not {value!r}")
        if kind is ValueRef and not (isinstance(value, ValueRef) and isinstance(value.name, str)
                                     and (value.part is None or isinstance(value.part, Part))):
            raise ValueError(f"'{op}' field '{name}' must be a ValueRef, not {value!r}")
    return cls(**values)


def _workload(raw: Any) -> Workload:
    data = _expect(raw, dict, "workload")
    positions, rank, loras = _int(data.get("positions", 1)), _int(data.get("lora_rank", 0)), _int(data.get("max_loras", 0))
    chunk = _int(data.get("chunk", 0))
    if positions < 1 or rank < 0 or loras < 0 or chunk < 0:
        raise ValueError(f"workload positions must be >= 1 and LoRA figures and chunk >= 0, not {positions}, {rank}, "
                         f"{loras}, {chunk}")
    return Workload(_int(data["batch"]), _int(data["context"]), _int(data["prompt"]), positions, rank, loras, chunk)


def _expect(value: Any, kind: type, what: str) -> Any:
    if not isinstance(value, kind):
        raise ValueError(f"{what} must be a {kind.__name__}, not {type(value).__name__}")
    return value


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer, not {value!r}")
    return value


def _string(names: list[str], index: Any) -> str:
    i = _int(index)
    if not 0 <= i < len(names):
        raise ValueError(f"string index {i} is outside the table of {len(names)}")
    return names[i]


# -- the text form ------------------------------------------------------------------------------

_PLAIN = re.compile(r"[A-Za-z0-9_.:/\[\]\-]+\Z")


def _word(text: str) -> str:
    return text if _PLAIN.match(text) else json.dumps(text)


def _value_text(ref: ValueRef) -> str:
    """A value's name as a word (quoted when it would read as a part: `"h[cols:0:4]"` is a name,
    `h[cols:0:4]` a part of h), then its part."""
    name = json.dumps(ref.name) if _PART_SUFFIX.match(ref.name) else _word(ref.name)
    return name if ref.part is None else f"{name}[{ref.part}]"


def _parse_value(raw: str) -> ValueRef:
    if not raw.startswith('"'):
        return ValueRef.parse(raw)
    name, end = json.JSONDecoder().raw_decode(raw)
    rest = raw[end:]
    if not rest:
        return ValueRef(name)
    if not (rest.startswith("[") and rest.endswith("]")):
        raise ValueError(f"'{raw}' is not a value (name or name[part])")
    return ValueRef(name, Part.parse(rest[1:-1]))


def _text_of(kind: Any, value: Any) -> str:
    if kind is bool:
        return "1" if value else "0"
    if kind == tuple[str, ...]:
        return ",".join(_word(v) for v in value)
    if kind == Part | None:
        return "" if value is None else str(value)
    if kind is ValueRef:
        return _value_text(value)
    return _word(str(value))


def format_instr(ins: Instruction) -> str:
    parts = [ins.op]
    for name, kind in _FIELDS[ins.op]:
        text = _text_of(kind, getattr(ins, name))
        parts.append(text if name == ins.operand else f"{name}={text}")
    return " ".join(parts)


# A token runs to the next space outside quotes: `node="a b"` and `bufs="x y",z` are one token each.
_TOKEN = re.compile(r'(?:"(?:[^"\\]|\\.)*"|[^\s"])+')


def _unword(text: str) -> str:
    return json.loads(text) if text.startswith('"') else text


def _value_of(kind: Any, raw: str) -> Any:
    if kind is int:
        return int(raw)
    if kind is bool:
        if raw not in ("0", "1"):
            raise ValueError(f"expected 0 or 1, not '{raw}'")
        return raw == "1"
    if kind == tuple[str, ...]:
        return tuple(_unword(v) for v in _split_list(raw))
    if kind == Part | None:
        return Part.parse(raw) if raw else None
    if kind is ValueRef:
        return _parse_value(raw)
    return _unword(raw)


def parse_program(text: str) -> Program:
    """The inverse of `Program.to_text`: `parse_program(p.to_text()).to_text() == p.to_text()`."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines or not lines[0].startswith("program "):
        raise ModelFormatError("plan text must start with 'program PHASE ...'")
    head = lines[0].split()
    try:
        program = Program(head[1], _workload({key: int(value) for key, value in (part.split("=", 1) for part in head[2:])}))
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
                tile = fields.get("tile")
                layer = fields.get("layer")
                program.add_buffer(Buffer(_unword(tokens[1]), int(fields["chiplet"]), int(fields["bytes"]),
                                          fields["kind"], None if tile is None else parse_tile_name(tile),
                                          None if layer is None else int(layer)))
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


def _parse_instr(line: str) -> Instruction:
    tokens = _TOKEN.findall(line)
    op = tokens[0]
    cls = INSTRUCTIONS.get(op)
    if cls is None:
        raise ValueError(f"unknown instruction '{op}'")
    kinds = dict(_FIELDS[op])
    rest = tokens[1:]
    values: dict[str, Any] = {}
    if cls.operand:
        if not rest:
            raise ValueError(f"'{op}' needs its {cls.operand}")
        values[cls.operand] = _value_of(kinds[cls.operand], rest.pop(0))
    for token in rest:
        name, _, raw = token.partition("=")
        if name not in kinds:
            raise ValueError(f"'{op}' has no field '{name}'")
        values[name] = _value_of(kinds[name], raw)
    return make(op, **values)


def _split_list(raw: str) -> list[str]:
    if not raw:
        return []
    return [m.group(0) for m in re.finditer(r'"(?:[^"\\]|\\.)*"|[^,]+', raw)]
