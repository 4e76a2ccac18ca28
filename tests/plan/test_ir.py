"""The plan IR as a typed contract: its serial forms round-trip real plans (a program's text and
JSON, a whole plan's plan.json), malformed input is a ModelFormatError, references have one text
form defined in `aviatorc.plan.ir`, and every reader walks the streams with the one interpreter."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import aviatorc
from aviatorc.errors import ModelFormatError
from aviatorc.plan.artifact import to_json_bytes
from aviatorc.plan.check import check_program
from aviatorc.plan.interpret import StreamInterpreter
from aviatorc.plan.ir import (
    INSTRUCTIONS,
    Buffer,
    Compute,
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
    Workload,
    make,
    parse_program,
    parse_tile_name,
    tile_name,
)
from aviatorc.plan.plan import Plan
from tests.plan.plans import CASES, Built

PlanFor = Callable[[str], Built]
PHASES = ("decode", "prefill")
ROOT = Path(aviatorc.__file__).resolve().parent.parent  # the repository: aviatorc/ and backends/


# -- round trips of real plans ------------------------------------------------------------------


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_text_round_trip(plan_for: PlanFor, case: str, phase: str) -> None:
    built = plan_for(case)
    program = built.plan.programs[phase]
    text = program.to_text()
    parsed = parse_program(text)
    assert parsed.to_text() == text
    assert parsed.streams == program.streams and parsed.buffers == program.buffers  # the same program
    check_program(parsed, built.plan.tiles, built.target, chiplets=built.plan.chiplets)


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_dict_round_trip(plan_for: PlanFor, case: str, phase: str) -> None:
    program = plan_for(case).plan.programs[phase]
    data = program.to_dict()
    again = Program.from_dict(json.loads(json.dumps(data)))  # as plan.json holds it
    assert again.to_dict() == data
    assert again.to_text() == program.to_text()
    assert again.streams == program.streams and again.buffers == program.buffers
    assert again.workload == program.workload and again.phase == program.phase


@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_json_round_trip(plan_for: PlanFor, case: str) -> None:
    """A whole plan written as plan.json, read back and written again: the same bytes, and the
    same typed plan (tiles, programs, memory plan, prediction, cold start)."""
    plan = plan_for(case).plan
    data = to_json_bytes(plan.to_dict(), compact=True)
    again = Plan.from_dict(json.loads(data))
    assert to_json_bytes(again.to_dict(), compact=True) == data
    assert again.tiles == plan.tiles and again.chiplets == plan.chiplets
    assert {p: (g.streams, g.buffers) for p, g in again.programs.items()} == {
        p: (g.streams, g.buffers) for p, g in plan.programs.items()}
    assert (again.memory, again.prediction, again.cold_start) == (plan.memory, plan.prediction, plan.cold_start)


def test_plan_json_shares_names_between_programs(plan_for: PlanFor) -> None:
    """The decode and prefill programs share one table of names and one of buffers: the plan's
    tables hold each buffer once, fewer than the two programs' buffers together."""
    plan = plan_for("streaming-kv").plan
    data = plan.to_dict()
    names = data["tables"]["strings"]
    assert len(names) == len(set(names))
    programs = data["programs"]
    assert len(data["tables"]["buffers"]) < sum(len(p["buffers"]) for p in programs.values())
    assert all(isinstance(item, int) for p in programs.values() for s in p["streams"].values() for item in s)


# -- the text form ------------------------------------------------------------------------------


def test_text_quotes_names_that_need_it() -> None:
    """Names with brackets, quotes, commas, '=' or nothing at all survive the text form, and
    operands (buffer, value and event names) with spaces too."""
    odd = 's"odd",=name'
    program = Program("prefill", Workload(2, 16, 4))
    program.add_buffer(Buffer(odd, 0, 8, "staging", tile=0))
    program.add_buffer(Buffer("kv.0", 1, 8, "kv", layer=0))
    program.emit(0, Load(odd, channel=0, bytes=8))
    program.emit(0, Wait(odd))
    program.emit(0, Compute('attn[0]"x"', (odd, "kv.0"), flops=1, bytes=8, vector_bytes=0, kind="int4",
                            part=None, layer_latency=False))
    program.emit(0, Compute("n", (), flops=0, bytes=0, vector_bytes=4, kind="fp16", part=Part.of("cols", 0, 16),
                            layer_latency=True))
    program.emit(0, Send(ValueRef("h x", Part.of("cols", 0, 16)), to=1, bytes=3))
    program.emit(0, Store("kv 0", channel=0, bytes=2))
    program.emit(1, Recv(ValueRef("h x", Part.of("cols", 0, 16)), src=0, bytes=3))
    program.emit(1, Signal("all done"))
    program.emit(1, Host(ValueRef(""), bytes=1))
    text = program.to_text()
    assert 'bufs="s\\"odd\\",=name",kv.0' in text and " part= " in text and "part=cols:0:16" in text
    assert 'send "h x"[cols:0:16] to=1' in text  # the name quoted, the part after it
    parsed = parse_program(text)
    assert parsed.to_text() == text
    assert parsed.streams == program.streams and parsed.buffers == program.buffers


@pytest.mark.parametrize("field", ["node", "bufs", "value", "event"])
def test_text_field_values_with_spaces(field: str) -> None:
    name = "a b"
    program = Program("decode", Workload(1, 1, 1))
    buf = name if field == "bufs" else "b"
    program.add_buffer(Buffer(buf, 0, 8, "staging", tile=0))
    program.emit(0, Compute(name if field == "node" else "n", (buf,), flops=0, bytes=0, vector_bytes=0,
                            kind="fp16", part=None, layer_latency=False))
    program.emit(0, Send(ValueRef(name if field == "value" else "v"), to=1, bytes=1))
    program.emit(0, Signal(name if field == "event" else "e"))
    parsed = parse_program(program.to_text())
    assert parsed.to_text() == program.to_text() and parsed.streams == program.streams


def test_text_keeps_a_value_named_like_a_part_apart_from_the_part() -> None:
    program = Program("decode", Workload(1, 1, 1))
    program.emit(0, Send(ValueRef("h[cols:0:16]"), to=1, bytes=3))  # a graph value with brackets in its name
    program.emit(0, Send(ValueRef("h", Part.of("cols", 0, 16)), to=2, bytes=3))
    parsed = parse_program(program.to_text())
    assert parsed.streams == program.streams


GOOD_TEXT = """\
program decode batch=1 context=4 prompt=2
buffer s chiplet=0 bytes=4 kind=staging tile=t0
stream 0 {
  load s channel=0 bytes=4
}
"""


def test_good_text_parses_to_typed_instructions() -> None:
    program = parse_program(GOOD_TEXT)
    assert program.buffers == {"s": Buffer("s", 0, 4, "staging", tile=0)}
    assert program.streams == {0: [Load("s", channel=0, bytes=4)]}
    assert program.to_text() == GOOD_TEXT


@pytest.mark.parametrize(("text", "message"), [
    ("", "plan text must start with 'program PHASE ...'"),
    ("stream 0 {\n}\n", "plan text must start with 'program PHASE ...'"),
    (GOOD_TEXT.replace("load s", "jump s"), "plan text line 4: unknown instruction 'jump': jump s channel=0 bytes=4"),
    (GOOD_TEXT.replace(" bytes=4\n}", "\n}"), "plan text line 4: 'load' needs field 'bytes': load s channel=0"),
    (GOOD_TEXT.replace("bytes=4\n}", "bytes=4 speed=3\n}"), "plan text line 4: 'load' has no field 'speed'"),
    (GOOD_TEXT.replace("channel=0", "channel=zero"), "plan text line 4: invalid literal for int()"),
    (GOOD_TEXT.replace("channel=0", "channel=-1"), "plan text line 4: 'load' field 'channel' must be a count in [0, 2^53]"),
    (GOOD_TEXT.replace("stream 0 {\n", ""), "plan text line 3: instruction outside a stream"),
    (GOOD_TEXT.replace("kind=staging", "kind=dram"), "plan text line 2: buffer 's': unknown kind 'dram'"),
    (GOOD_TEXT.replace("tile=t0", "tile=x0"), "plan text line 2: 'x0' is not a tile reference (t<index>)"),
    (GOOD_TEXT.replace("tile=t0", "tile=t0 layer=1"), "plan text line 2: buffer 's' holds both a tile and a KV"),
    (GOOD_TEXT.replace("stream 0", "buffer s chiplet=0 bytes=4 kind=staging\nstream 0"),
     "plan text line 3: buffer 's' declared twice"),
    (GOOD_TEXT.replace("stream 0", "stream x"), "plan text line 3: invalid literal for int()"),
    (GOOD_TEXT.replace("load s", 'load "s\\q"'), "plan text line 4: Invalid \\escape"),
    (GOOD_TEXT.replace("load s channel=0 bytes=4", "compute node=n bufs= flops=0 bytes=0 vector_bytes=0 kind=fp16 "
                       "part=cols:4:4 layer_latency=0"), "plan text line 4: part cols:4:4 is empty or negative"),
    (GOOD_TEXT.replace("load s channel=0 bytes=4", "compute node=n bufs= flops=0 bytes=0 vector_bytes=0 kind=fp16 "
                       "part=heads:0:4 layer_latency=0"), "plan text line 4: unknown part kind 'heads'"),
    (GOOD_TEXT.replace("load s channel=0 bytes=4", "compute node=n bufs= flops=0 bytes=0 vector_bytes=0 kind=fp16 "
                       "part= layer_latency=2"), "plan text line 4: expected 0 or 1, not '2'"),
    (GOOD_TEXT.replace("}", ""), "plan text: stream 0 is not closed with '}'"),
])
def test_malformed_text(text: str, message: str) -> None:
    with pytest.raises(ModelFormatError) as info:
        parse_program(text)
    assert str(info.value).startswith(message), str(info.value)


@pytest.mark.parametrize("header", ["program decode batch=x context=4 prompt=2", "program decode batch=1",
                                    "program decode batch"])
def test_malformed_text_header(header: str) -> None:
    with pytest.raises(ModelFormatError, match="plan text line 1: malformed header"):
        parse_program(GOOD_TEXT.replace("program decode batch=1 context=4 prompt=2", header))


def test_text_with_an_unknown_phase() -> None:
    with pytest.raises(ModelFormatError, match="unknown plan phase 'bogus'"):
        parse_program(GOOD_TEXT.replace("program decode", "program bogus"))


def test_text_with_a_stream_declared_twice() -> None:
    with pytest.raises(ModelFormatError, match="plan text line 6: stream 0 appears twice"):
        parse_program(GOOD_TEXT + "stream 0 {\n}\n")


# -- the JSON form ------------------------------------------------------------------------------


def good_dict() -> dict[str, Any]:
    data = parse_program(GOOD_TEXT).to_dict()
    # The compact form: the buffer is row 0 of the tables, the stream one flat list of integers.
    assert data["tables"] == {"strings": ["s"], "buffers": [[0, 0, 4, 1, 0, -1]]}
    assert data["buffers"] == [0] and data["streams"] == {"0": [0, 0, 0, 4]}
    return data


def with_stream(items: list[Any]) -> Callable[[dict[str, Any]], Any]:
    return lambda d: {**d, "streams": {"0": items}}


def with_buffer_rows(rows: list[Any]) -> Callable[[dict[str, Any]], Any]:
    return lambda d: {**d, "tables": {**d["tables"], "buffers": rows}}


# A compute of node "s" (string 0) reading no buffer: opcode 3, then node, bufs, flops, bytes,
# vector_bytes, kind, part, layer_latency.
COMPUTE = [3, 0, 0, 0, 0, 0, 0]


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: [], "malformed plan program: ValueError: must be an object"),
    (lambda d: {k: v for k, v in d.items() if k != "phase"}, "malformed plan program: KeyError: 'phase'"),
    (lambda d: {k: v for k, v in d.items() if k != "tables"}, "malformed plan program: KeyError: 'tables'"),
    (lambda d: {**d, "phase": "bogus"}, "malformed plan program 'bogus': ValueError: unknown phase 'bogus'"),
    (lambda d: {**d, "workload": {"batch": 1, "tokens": 3}}, "malformed plan program 'decode': KeyError: 'context'"),
    (with_buffer_rows([[0, 0, 4, 9, 0, -1]]), "malformed plan program: ValueError: unknown buffer kind 9"),
    (with_buffer_rows([[0, 0, 4]]), "malformed plan program: ValueError: not enough values to unpack"),
    (with_buffer_rows([[0, 0, 4, 1, 0, 2]]), "malformed plan program: ValueError: buffer 's' holds both a tile"),
    (with_buffer_rows([[3, 0, 4, 1, 0, -1]]), "malformed plan program: ValueError: string index 3 is outside"),
    (lambda d: {**d, "tables": {**d["tables"], "strings": [5]}}, "malformed plan program: ValueError: the string "
     "table holds a non-string"),
    (lambda d: {**d, "buffers": [0, 0]}, "malformed plan program 'decode': ValueError: buffer 's' declared twice"),
    (lambda d: {**d, "buffers": [3]}, "malformed plan program 'decode': ValueError: buffer index 3 is outside"),
    (with_stream([99, 0, 0, 4]), "malformed plan program 'decode', stream 0: ValueError: unknown opcode 99"),
    (with_stream([0, 0, 0]), "malformed plan program 'decode', stream 0: ValueError: the stream ends inside an "
     "instruction"),
    (with_stream([0, 7, 0, 4]), "malformed plan program 'decode', stream 0: ValueError: string index 7 is outside"),
    (with_stream([0, 0, -1, 4]), "malformed plan program 'decode', stream 0: ValueError: 'load' field 'channel' "
     "must be a count in [0, 2^53]"),
    (with_stream([0, 0, "x", 4]), "malformed plan program 'decode', stream 0: ValueError: expected an integer"),
    (with_stream([0, 0, True, 4]), "malformed plan program 'decode', stream 0: ValueError: expected an integer"),
    (with_stream([[]]), "malformed plan program 'decode', stream 0: ValueError: expected an integer"),
    (with_stream([3, 0, 99, 0]), "malformed plan program 'decode', stream 0: ValueError: a list of 99 names"),
    (with_stream([*COMPUTE, 5, 0, 4, 0]), "malformed plan program 'decode', stream 0: ValueError: unknown part "
     "kind 5"),
    (with_stream([*COMPUTE, 0, 4, 4, 0]), "malformed plan program 'decode', stream 0: ValueError: part cols:4:4 "
     "is empty"),
    (lambda d: {**d, "streams": {"x": []}}, "malformed plan program 'decode': ValueError: stream key 'x' is not"),
    (lambda d: {**d, "streams": []}, "malformed plan program 'decode': ValueError: streams must be a dict"),
])
def test_malformed_dict(change: Callable[[dict[str, Any]], Any], message: str) -> None:
    with pytest.raises(ModelFormatError) as info:
        Program.from_dict(change(good_dict()))
    assert str(info.value).startswith(message), str(info.value)


def test_dict_codec_of_every_field_type() -> None:
    """A compute with a part and the latency flag, a send of a part: decoded to equal instructions."""
    items = [*COMPUTE, 1, 2, 6, 1, 4, 0, 0, 0, 16, 1, 1]
    program = Program.from_dict({**good_dict(), "streams": {"0": items}})
    assert program.streams[0] == [
        Compute("s", (), 0, 0, 0, "s", Part("rows", 2, 6), True),
        Send(ValueRef("s", Part("cols", 0, 16)), to=1, bytes=1),
    ]
    assert program.to_dict()["streams"] == {"0": items}


# -- instructions and references -----------------------------------------------------------------


def test_make_checks_names_counts_and_fields() -> None:
    assert make("load", buf="s", channel=1, bytes=4) == Load("s", 1, 4)
    with pytest.raises(ValueError, match="unknown plan instruction 'jump'"):
        make("jump", buf="s")
    with pytest.raises(ValueError, match=r"'load' has no field\(s\) \['speed'\]"):
        make("load", buf="s", channel=0, bytes=4, speed=3)
    with pytest.raises(ValueError, match="'load' needs field 'bytes'"):
        make("load", buf="s", channel=0)
    with pytest.raises(ValueError, match=r"'load' field 'bytes' must be a count in \[0, 2\^53\], not -4"):
        make("load", buf="s", channel=0, bytes=-4)
    with pytest.raises(ValueError, match=r"'load' field 'channel' must be a count in \[0, 2\^53\], not True"):
        make("load", buf="s", channel=True, bytes=4)
    with pytest.raises(ValueError, match="'wait' field 'event' must be a name, not 3"):
        make("wait", event=3)


@pytest.mark.parametrize(("op", "fields"), [
    ("send", {"value": "x", "to": 1, "bytes": 0}),
    ("compute", {"node": "n", "bufs": "ab", "flops": 0, "bytes": 0, "vector_bytes": 0, "kind": "fp16", "part": None,
                 "layer_latency": False}),
    ("compute", {"node": "n", "bufs": (), "flops": 0, "bytes": 0, "vector_bytes": 0, "kind": "fp16",
                 "part": "cols:0:4", "layer_latency": False}),
    ("compute", {"node": "n", "bufs": (), "flops": 0, "bytes": 0, "vector_bytes": 0, "kind": "fp16", "part": None,
                 "layer_latency": 2}),
])
def test_make_checks_typed_fields(op: str, fields: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=f"'{op}' field"):
        make(op, **fields)


def test_instruction_table() -> None:
    """One frozen dataclass per instruction kind, registered under its op, with its operand a field."""
    assert set(INSTRUCTIONS) == {"load", "wait", "signal", "compute", "send", "recv", "free", "store", "host"}
    for op, cls in INSTRUCTIONS.items():
        assert issubclass(cls, Instruction) and cls.op == op
        names = [f.name for f in dataclasses.fields(cls)]
        assert cls.operand is None or cls.operand in names
    ins = Load("s", 0, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ins.bytes = 5  # type: ignore[misc]
    assert dataclasses.replace(ins, bytes=5) == Load("s", 0, 5) and ins.bytes == 4
    assert {cls.op for cls in INSTRUCTIONS.values() if cls.blocking} == {"wait", "recv", "host"}


def test_reference_text_forms() -> None:
    assert tile_name(12) == "t12" and parse_tile_name("t12") == 12
    for bad in ("t", "12", "tx", "t-1", "w.t12"):
        with pytest.raises(ValueError, match="is not a tile reference"):
            parse_tile_name(bad)
    part = Part.of("kv", 1, 4)
    assert str(part) == "kv:1:4" and Part.parse("kv:1:4") == part
    for bad in ("cols:0", "cols:a:4", "cols:4:2", "heads:0:4"):
        with pytest.raises(ValueError):
            Part.parse(bad)
    assert str(ValueRef("up.3", Part.of("cols", 0, 512))) == "up.3[cols:0:512]"
    assert ValueRef.parse("up.3[cols:0:512]") == ValueRef("up.3", Part("cols", 0, 512))
    assert ValueRef.parse("up.3[x]") == ValueRef("up.3[x]") and ValueRef.parse("up.3") == ValueRef("up.3")
    assert Buffer("w", 0, 4, "resident", tile=7).holds == "t7" and Buffer("k", 0, 4, "kv", layer=3).holds == "kv.3"


# -- one contract: no string parsing of plan references, one interpreter -------------------------


def _sources() -> list[Path]:
    files = sorted((ROOT / "aviatorc").rglob("*.py")) + sorted((ROOT / "backends").rglob("*.py"))
    assert len(files) > 50 and any(p.name == "sim.py" for p in files)
    return files


def _regex_literals(path: Path) -> list[tuple[int, str]]:
    """The string patterns passed to a `re.` function in one module: (line, pattern)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "re" and node.args):
            pattern = node.args[0]
            parts = pattern.values if isinstance(pattern, ast.JoinedStr) else [pattern]
            text = "".join(p.value for p in parts if isinstance(p, ast.Constant) and isinstance(p.value, str))
            found.append((node.lineno, text))
    return found


# What a regex that parses a plan reference looks like: a part kind, or a tile 't' before digits.
PLAN_REFERENCE_REGEX = re.compile(r"cols|rows|\bkv\b|(?<![A-Za-z\\])t\(?\\d")


def test_plan_reference_regex_detector_finds_what_it_should() -> None:
    """The detector below catches the patterns the old code parsed plan strings with."""
    for old in (r"t(\d+)", r"(.*)\[cols:(\d+):(\d+)\]", r"\[(?:cols|rows|kv):\d+:\d+\]", r"^t\d+$", r"kv:(\d+):(\d+)"):
        assert PLAN_REFERENCE_REGEX.search(old), old
    for other in (r"(?:^|[._/])(?:layers|layer|h|blocks)[._/](\d+)(?:[._/]|$)", r"[A-Za-z_][A-Za-z0-9_.]*\Z",
                  r"past_key_values\.(\d+)\.(key|value)\Z", r"(\d+)(?:\s*-\s*(\d+))?"):
        assert not PLAN_REFERENCE_REGEX.search(other), other


def test_regex_literals_are_found_in_a_module(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text('import re\n_PART = re.compile(r"(.*)\\[(cols|rows):(\\d+):(\\d+)\\]")\n'
                      'def tile(s, kind):\n    return re.fullmatch(rf"t(\\d+)\\.{kind}", s)\n')
    found = _regex_literals(module)
    assert [line for line, _ in found] == [2, 4]
    assert all(PLAN_REFERENCE_REGEX.search(pattern) for _, pattern in found)


def test_no_regex_parses_plan_references_outside_the_ir() -> None:
    """Tile and part names are parsed only in aviatorc/plan/ir.py, where their text form lives."""
    ir = ROOT / "aviatorc" / "plan" / "ir.py"
    assert any(PLAN_REFERENCE_REGEX.search(p) for _, p in _regex_literals(ir))  # the one place that may
    offenders = [f"{path.relative_to(ROOT)}:{line}: {pattern}" for path in _sources() if path != ir
                 for line, pattern in _regex_literals(path) if PLAN_REFERENCE_REGEX.search(pattern)]
    assert offenders == []
    # Nor by hand: outside the IR nothing calls the reference parsers.
    parsers = re.compile(r"\b(parse_tile_name|Part\.parse|ValueRef\.parse)\(")
    callers = [str(path.relative_to(ROOT)) for path in _sources() if path != ir and parsers.search(path.read_text())]
    assert callers == []


HOOK_LOOKUP = re.compile(r"_hooks\[|\[type\((ins|instr|instruction)\)\]")
HOOK_TABLE = re.compile(r"""f["']on_\{""")
OP_STRING = re.compile(r"\bop\s*(==|!=|in|not\s+in)\s*[(\[{]?\s*[\"'](load|wait|signal|compute|send|recv|free|store|host)[\"']")


def _lines(pattern: re.Pattern[str]) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{n}" for path in _sources()
            for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]


def test_one_dispatch_site() -> None:
    """Exactly one place looks an instruction's hook up (`StreamInterpreter.step`) and one builds
    the table it looks in; nothing dispatches on an instruction's op string or on most of its kinds."""
    lookups, tables = _lines(HOOK_LOOKUP), _lines(HOOK_TABLE)
    assert len(lookups) == 1 and lookups[0].startswith("aviatorc/plan/interpret.py:"), lookups
    assert len(tables) == 1 and tables[0].startswith("aviatorc/plan/interpret.py:"), tables
    assert [str(p.relative_to(ROOT)) for p in _sources() if OP_STRING.search(p.read_text())] == []
    dispatchers = [f"{path.relative_to(ROOT)}:{line} {name} {kinds}" for path in _sources()
                   for line, name, kinds in _kind_dispatchers(path.read_text())]
    assert dispatchers == []


def _kind_dispatchers(source: str) -> list[tuple[int, str, list[str]]]:
    """Functions that tell apart most instruction kinds (by isinstance or a match on their
    classes), or a table keyed by most of their op names: each is a second dispatcher."""
    kinds = {cls.__name__ for cls in INSTRUCTIONS.values()}
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            ops = {k.value for k in node.keys if isinstance(k, ast.Constant) and k.value in INSTRUCTIONS}
            if len(ops) > len(INSTRUCTIONS) // 2:
                found.append((node.lineno, "a table keyed by op names", sorted(ops)))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            tested = {n.id for test in ast.walk(node)
                      if (isinstance(test, ast.Call) and isinstance(test.func, ast.Name)
                          and test.func.id == "isinstance") or isinstance(test, ast.MatchClass)
                      for n in ast.walk(test) if isinstance(n, ast.Name) and n.id in kinds}
            if len(tested) > len(kinds) // 2:
                found.append((node.lineno, node.name, sorted(tested)))
    return found


def test_dispatch_detectors_find_what_they_should() -> None:
    """The detectors above catch the ways the old interpreters dispatched."""
    assert OP_STRING.search('        if op == "load":') and OP_STRING.search('if ins.op not in ("load", "free"):')
    assert not OP_STRING.search('if node.op == "Gather":')
    assert HOOK_LOOKUP.search("self._hooks[type(ins)](c)") and HOOK_LOOKUP.search("h = table[type(ins)]")
    table = "{" + ", ".join(f'"{op}": self.{op}' for op in ["load", "wait", "send", "recv", "free"]) + "}"
    assert [name for _, name, _ in _kind_dispatchers(f"def run(self, ins):\n    return {table}[ins.op]\n")] == [
        "a table keyed by op names"]
    chain = "\n".join(f"    {'if' if i == 0 else 'elif'} isinstance(ins, {k}):\n        pass"
                      for i, k in enumerate(["Load", "Wait", "Signal", "Compute", "Send"]))
    assert [name for _, name, _ in _kind_dispatchers(f"def run(ins):\n{chain}\n")] == ["run"]
    cases = "\n".join(f"        case {k}():\n            pass" for k in ["Load", "Wait", "Recv", "Send", "Free"])
    assert [name for _, name, _ in _kind_dispatchers(f"def run(ins):\n    match ins:\n{cases}\n")] == ["run"]
    few = "def f(ins):\n    return isinstance(ins, Load) or isinstance(ins, Free)\n"
    assert _kind_dispatchers(few) == []


RUNS = [("aviatorc.plan.check", "_Checker"), ("aviatorc.schedule.simulate", "_Simulator"),
        ("aviatorc.backends.sim", "_Run"), ("aviatorc.backends.cuda", "_CudaRun"),
        ("aviatorc.backends.distributed", "_RankRun")]


@pytest.mark.parametrize(("module", "name"), RUNS)
def test_every_reader_runs_on_the_one_interpreter(module: str, name: str) -> None:
    """The checker, the simulator and the sim, cuda and rank backends each fill in the hooks of
    `StreamInterpreter` and keep its loop: none overrides it, and a `step` that wraps it calls it."""
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, StreamInterpreter)
    for loop in ("run", "_advance", "fire", "await_key"):
        assert getattr(cls, loop) is getattr(StreamInterpreter, loop), f"{name} overrides {loop}"
    if cls.step is not StreamInterpreter.step:
        assert "super().step(" in inspect.getsource(cls.step)
    for op in INSTRUCTIONS:  # every hook filled in somewhere along the class's bases
        owner = next(k for k in cls.__mro__ if f"on_{op}" in vars(k))
        assert owner is not StreamInterpreter, f"{name} has no rule for '{op}'"
