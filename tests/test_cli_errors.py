"""The CLI's last line of defence (issue 13): an exception that is not an AviatorError is a
bug, reported as one "internal error, please report" line with exit status 3 (its traceback
under --debug, before or after the command); control characters in messages are escaped."""

from __future__ import annotations

import pytest

from aviatorc import cli
from aviatorc.errors import ModelFormatError
from aviatorc.partition.check import PlacementCheckError


def raising(error: BaseException):
    def handler(args):
        raise error

    return handler


@pytest.mark.parametrize("error, text", [
    (RuntimeError("boom"), "RuntimeError: boom"),
    (ZeroDivisionError("division by zero"), "ZeroDivisionError: division by zero"),
    (PlacementCheckError("tiles leave a gap or overlap"), "PlacementCheckError: tiles leave a gap or overlap"),
    (RecursionError("maximum recursion depth exceeded"), "RecursionError: maximum recursion depth exceeded"),
    (MemoryError(), "out of memory"),
])
def test_internal_errors_exit_3_in_one_line(monkeypatch, capsys, error, text) -> None:
    monkeypatch.setattr(cli, "cmd_inspect", raising(error))
    assert cli.main(["inspect", "m.onnx"]) == cli.EXIT_INTERNAL_ERROR == 3
    err = capsys.readouterr().err
    assert err == f"aviatorc: internal error, please report: {text} (rerun with --debug for the traceback)\n"


@pytest.mark.parametrize("argv", [["--debug", "inspect", "m.onnx"], ["inspect", "m.onnx", "--debug"]])
def test_debug_shows_the_traceback_of_an_internal_error(monkeypatch, capsys, argv) -> None:
    monkeypatch.setattr(cli, "cmd_inspect", raising(KeyError("tile")))
    assert cli.main(argv) == 3
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert err.endswith("aviatorc: internal error, please report: KeyError: 'tile'\n")


def test_debug_after_the_command_reraises_user_errors(monkeypatch) -> None:
    monkeypatch.setattr(cli, "cmd_inspect", raising(ModelFormatError("bad")))
    with pytest.raises(ModelFormatError):
        cli.main(["inspect", "m.onnx", "--debug"])


def test_control_characters_in_a_message_are_escaped(monkeypatch, capsys) -> None:
    monkeypatch.setattr(cli, "cmd_inspect", raising(ModelFormatError("at 'w\x00\x1b[2J.bin'\nmore")))
    assert cli.main(["inspect", "m.onnx"]) == 1
    assert capsys.readouterr().err == "aviatorc: error: at 'w\\x00\\x1b[2J.bin'\\nmore\n"


def test_a_usage_error_is_one_line_with_status_2() -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "aviatorc", "compile", "m.onnx", "-o", "out", "--quant", "int3"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == cli.EXIT_USAGE_ERROR == 2
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("aviatorc: error: argument --quant: invalid choice")
    assert "aviatorc compile --help" in done.stderr and "usage:" not in done.stderr


def test_a_reader_that_stops_early_costs_no_traceback() -> None:
    import subprocess
    import sys

    # `aviatorc ops | head -0`: the pipe is closed before anything is written.
    proc = subprocess.Popen([sys.executable, "-m", "aviatorc", "ops"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_target_show_words_a_bad_card_count_as_compile_does(capsys) -> None:
    assert cli.main(["target", "show", "corsair", "--cards", "0"]) == 1
    err = capsys.readouterr().err
    assert err == "aviatorc: error: cards (--cards) must be at least 1, got 0\n"  # no internal TOML path
