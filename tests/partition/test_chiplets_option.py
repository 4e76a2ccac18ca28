"""`--chiplets` / `chiplets=`: one parser for the CLI and the API, checked against the target."""

from __future__ import annotations

import json

import pytest

from aviatorc.cli import main
from aviatorc.errors import OptionError
from aviatorc.options import CompileOptions, parse_chiplets
from tests.test_cli import mlp_onnx


def test_parse_ranges_ids_and_ranges():
    assert parse_chiplets("0-7,12") == (0, 1, 2, 3, 4, 5, 6, 7, 12)
    assert parse_chiplets(" 3 , 1-2 ") == (1, 2, 3)
    assert parse_chiplets(range(0, 8)) == tuple(range(8))
    assert parse_chiplets((5, 4, 4)) == (4, 5)
    assert parse_chiplets(None) is None
    assert CompileOptions(chiplets="0-3").chiplets == CompileOptions(chiplets=range(4)).chiplets == (0, 1, 2, 3)


@pytest.mark.parametrize("spec, message", [
    ("0-", "cannot read '0-'"), ("7-3", "runs backwards"), ("", "cannot read ''"), ([1.5], "not a chiplet id"),
    ([-1], "not a chiplet id"), ((), "names no chiplet"),
])
def test_bad_chiplets_are_option_errors(spec, message):
    with pytest.raises(OptionError, match=message):
        CompileOptions(chiplets=spec)


def test_chiplets_are_checked_against_the_target():
    with pytest.raises(OptionError, match=r"chiplets \(--chiplets\) 4-5,9 not on the target, which has chiplets 0-3"):
        parse_chiplets("0,4-5,9", 4)


def test_compile_confines_the_placement(tmp_path, capsys):
    path = mlp_onnx(tmp_path / "mlp.onnx")
    out = tmp_path / "mlp.avc"
    assert main(["compile", str(path), "-o", str(out), "--target", "mock", "--chiplets", "2-3", "-q"]) == 0
    placement = json.loads((out / "report.json").read_text())["placement"]
    assert placement["allowed_chiplets"] == [2, 3]
    assert {a.get("chiplet", 2) for a in placement["assignment"]} <= {2, 3}
    assert {a["compute_chiplet"] for a in placement["assignment"]} <= {2, 3}
    assert main(["compile", str(path), "-o", str(tmp_path / "b.avc"), "--target", "mock", "--chiplets", "0-4",
                 "-q"]) != 0
    assert "not on the target" in capsys.readouterr().err
