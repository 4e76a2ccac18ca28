"""The plan IR's two serial forms: text and dict round-trip real plans; malformed input is a ModelFormatError."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from aviatorc.errors import ModelFormatError
from aviatorc.plan.check import check_program
from aviatorc.plan.ir import Buffer, Program, Workload, instr, parse_program
from tests.plan.plans import CASES, Built

PlanFor = Callable[[str], Built]
PHASES = ("decode", "prefill")


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_text_round_trip(plan_for: PlanFor, case: str, phase: str) -> None:
    built = plan_for(case)
    program = built.plan.programs[phase]
    text = program.to_text()
    parsed = parse_program(text)
    assert parsed.to_text() == text
    assert parsed.to_dict() == program.to_dict()  # the same program, not only the same text
    check_program(parsed, built.plan.placement, built.target, chiplets=built.plan.chiplets)


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_dict_round_trip(plan_for: PlanFor, case: str, phase: str) -> None:
    program = plan_for(case).plan.programs[phase]
    data = program.to_dict()
    again = Program.from_dict(json.loads(json.dumps(data)))  # as plan.json holds it
    assert again.to_dict() == data
    assert again.to_text() == program.to_text()
    assert again.streams == program.streams and again.buffers == program.buffers


def test_text_quotes_names_that_need_it() -> None:
    """Names with brackets, quotes, commas, '=' or nothing at all survive the text form, and
    operands (buffer, value and event names) with spaces too."""
    odd = 's"odd",=name'
    program = Program("prefill", Workload(2, 16, 4))
    program.add_buffer(Buffer(odd, 0, 8, "staging", "t0"))
    program.add_buffer(Buffer("kv.0", 1, 8, "kv", "kv.0"))
    program.emit(0, instr("load", odd, card=0, bytes=8))
    program.emit(0, instr("wait", odd))
    program.emit(0, instr("compute", node='attn[0]"x"', bufs=(odd, "kv.0"), flops=1, bytes=8, kind="int4",
                          part="", fixed_ns=0))
    program.emit(0, instr("compute", node="n", bufs=(), flops=0, bytes=0, kind="fp16", part="cols:0:16", fixed_ns=5))
    program.emit(0, instr("send", "h [cols:0:16]", to=1, bytes=3))
    program.emit(1, instr("recv", "h [cols:0:16]", src=0, bytes=3))
    program.emit(1, instr("signal", "all done"))
    text = program.to_text()
    assert 'bufs="s\\"odd\\",=name",kv.0' in text and 'part=""' in text
    parsed = parse_program(text)
    assert parsed.to_text() == text
    assert parsed.streams == program.streams and parsed.buffers == program.buffers


@pytest.mark.parametrize("field", ["node", "bufs", "tile"])
def test_text_field_values_with_spaces(field: str) -> None:
    name = "a b"
    program = Program("decode", Workload(1, 1, 1))
    program.add_buffer(Buffer(name if field == "bufs" else "b", 0, 8, "staging", name if field == "tile" else "t0"))
    program.emit(0, instr("compute", node=name if field == "node" else "n", bufs=(name if field == "bufs" else "b",),
                          flops=0, bytes=0, kind="fp16", part="", fixed_ns=0))
    assert parse_program(program.to_text()).to_text() == program.to_text()


GOOD_TEXT = """\
program decode batch=1 context=4 prompt=2
buffer s chiplet=0 bytes=4 kind=staging tile=t0
stream 0 {
  load s card=0 bytes=4
}
"""


@pytest.mark.parametrize(("text", "message"), [
    ("", "plan text must start with 'program PHASE ...'"),
    ("stream 0 {\n}\n", "plan text must start with 'program PHASE ...'"),
    (GOOD_TEXT.replace("load s", "jump s"), "plan text line 4: unknown instruction 'jump': jump s card=0 bytes=4"),
    (GOOD_TEXT.replace(" bytes=4\n}", "\n}"), "plan text line 4: 'load' needs field 'bytes': load s card=0"),
    (GOOD_TEXT.replace("bytes=4\n}", "bytes=4 speed=3\n}"), "plan text line 4: 'load' has no field(s) ['speed']"),
    (GOOD_TEXT.replace("card=0", "card=zero"), "plan text line 4: invalid literal for int()"),
    (GOOD_TEXT.replace("stream 0 {\n", ""), "plan text line 3: instruction outside a stream"),
    (GOOD_TEXT.replace("kind=staging", "kind=dram"), "plan text line 2: buffer 's': unknown kind 'dram'"),
    (GOOD_TEXT.replace("stream 0", "buffer s chiplet=0 bytes=4 kind=staging\nstream 0"),
     "plan text line 3: buffer 's' declared twice"),
    (GOOD_TEXT.replace("stream 0", "stream x"), "plan text line 3: invalid literal for int()"),
    (GOOD_TEXT.replace("load s", 'load "s\\q"'), "plan text line 4: Invalid \\escape"),
])
def test_malformed_text(text: str, message: str) -> None:
    with pytest.raises(ModelFormatError) as info:
        parse_program(text)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize("header", ["program decode batch=x context=4 prompt=2", "program decode batch=1",
                                    "program decode batch"])
def test_malformed_text_header(header: str) -> None:
    with pytest.raises(ModelFormatError):
        parse_program(GOOD_TEXT.replace("program decode batch=1 context=4 prompt=2", header))


def test_text_with_an_unknown_phase() -> None:
    with pytest.raises(ModelFormatError, match="unknown plan phase 'bogus'"):
        parse_program(GOOD_TEXT.replace("program decode", "program bogus"))


def test_text_with_a_stream_declared_twice() -> None:
    with pytest.raises(ModelFormatError):
        parse_program(GOOD_TEXT + "stream 0 {\n}\n")


def good_dict() -> dict[str, Any]:
    return parse_program(GOOD_TEXT).to_dict()


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: [], "malformed plan program"),
    (lambda d: {k: v for k, v in d.items() if k != "phase"}, "malformed plan program: 'phase'"),
    (lambda d: {**d, "phase": "bogus"}, "unknown plan phase 'bogus'"),
    (lambda d: {**d, "workload": {"batch": 1, "tokens": 3}}, "malformed plan program: Workload.__init__()"),
    (lambda d: {**d, "buffers": [["s", 0, 4, "dram", ""]]}, "malformed plan program: buffer 's': unknown kind 'dram'"),
    (lambda d: {**d, "buffers": [["s", 0, 4]]}, "malformed plan program: not enough values to unpack"),
    (lambda d: {**d, "buffers": d["buffers"] * 2}, "malformed plan program: buffer 's' declared twice"),
    (lambda d: {**d, "streams": {"0": [["jump", "s", 0, 4]]}}, "malformed plan program: unknown instruction 'jump'"),
    (lambda d: {**d, "streams": {"0": [["load", "s", 0]]}}, "malformed plan program: 'load' takes 2 fields, got 1"),
    (lambda d: {**d, "streams": {"0": [5]}}, "malformed plan program"),
    (lambda d: {**d, "streams": {"x": []}}, "malformed plan program: invalid literal for int()"),
])
def test_malformed_dict(change: Callable[[dict[str, Any]], Any], message: str) -> None:
    with pytest.raises(ModelFormatError) as info:
        Program.from_dict(change(good_dict()))
    assert str(info.value).startswith(message)


@pytest.mark.parametrize("streams", [{"0": [[]]}, []])
def test_malformed_dict_streams(streams: Any) -> None:
    with pytest.raises(ModelFormatError):
        Program.from_dict({**good_dict(), "streams": streams})
