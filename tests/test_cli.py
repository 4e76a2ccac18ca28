"""The command line end to end: inspect, compile (artifact written atomically), and one-line
errors with a non-zero exit and nothing written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from aviatorc.cli import main
from tests.zoo_fixtures import zoo_dir, zoo_onnx  # noqa: F401


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "aviatorc", *args], capture_output=True, text=True)


def mlp_onnx(path: Path, extra_ops: tuple[str, ...] = ()) -> Path:
    """x[2, 64] @ w1[64, 128] -> Relu -> @ w2[128, 64], plus optional unsupported nodes."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((64, 128)).astype(np.float32), "fc1.weight")
    w2 = numpy_helper.from_array(rng.standard_normal((128, 64)).astype(np.float32), "fc2.weight")
    nodes = [
        helper.make_node("MatMul", ["x", "fc1.weight"], ["h"], name="fc1"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "fc2.weight"], ["y0"], name="fc2"),
    ]
    last = "y0"
    for i, op in enumerate(extra_ops):
        nodes.append(helper.make_node(op, [last], [f"u{i}"], name=f"weird{i}"))
        last = f"u{i}"
    nodes.append(helper.make_node("Identity", [last], ["y"], name="out"))
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64])], [w1, w2])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def test_inspect_prints_census_and_parameters(tmp_path, capsys):
    path = mlp_onnx(tmp_path / "mlp.onnx")
    assert main(["inspect", str(path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["parameters"] == 64 * 128 * 2
    assert summary["op_census"]["MatMul"] == 2
    assert summary["bytes_by_dtype"]["float32"] == 64 * 128 * 2 * 4
    assert summary["inputs"] == [{"name": "x", "type": "float32[2, 64]"}]


def test_compile_writes_ir_and_report(tmp_path):
    path = mlp_onnx(tmp_path / "mlp.onnx")
    out = tmp_path / "mlp.avc"
    result = run_cli("compile", str(path), "-o", str(out), "--target", "mock", "--quant", "int8", "-q")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["graph.ir", "manifest.json", "plan.json", "report.html", "report.json", "target.toml", "trace.json", "weights.safetensors"]
    report = json.loads((out / "report.json").read_text())
    assert report["weights"]["bytes_by_format"] == {"int8": (64 * 128 + 128 * 2) + (128 * 64 + 64 * 2)}
    assert report["placement"]["status"] in ("optimal", "feasible", "greedy")
    assert "DequantizeWeight" in (out / "graph.ir").read_text()
    # No staging folders are left behind.
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_same_inputs_give_byte_identical_output(tmp_path):
    path = mlp_onnx(tmp_path / "mlp.onnx")
    outputs = []
    for name in ("a.avc", "b.avc"):
        assert run_cli("compile", str(path), "-o", str(tmp_path / name), "--target", "mock", "--quant", "int4",
                       "-q").returncode == 0
        outputs.append({f.name: f.read_bytes() for f in (tmp_path / name).iterdir()})
    assert len(outputs[0]) == 8 and outputs[0] == outputs[1]  # no wall-clock figure is written anywhere (report.html too)


def test_compile_never_deletes_a_folder_that_is_not_an_artifact(tmp_path):
    path = mlp_onnx(tmp_path / "mlp.onnx")
    project = tmp_path / "project"
    project.mkdir()
    (project / "notes.txt").write_text("mine")
    result = run_cli("compile", str(path), "-o", str(project))
    assert result.returncode == 1 and "is not an aviatorc artifact (it holds notes.txt)" in result.stderr
    assert (project / "notes.txt").read_text() == "mine"
    # An earlier artifact is replaced.
    out = tmp_path / "m.avc"
    assert run_cli("compile", str(path), "-o", str(out), "-q").returncode == 0
    assert run_cli("compile", str(path), "-o", str(out), "-q").returncode == 0
    assert sorted(p.name for p in out.iterdir()) == ["graph.ir", "manifest.json", "plan.json", "report.html", "report.json", "target.toml", "trace.json", "weights.safetensors"]


def test_compile_defaults_to_corsair_and_stores_fp32_weights_in_its_16_bit_format(tmp_path):
    path = mlp_onnx(tmp_path / "mlp.onnx")
    result = run_cli("compile", str(path), "-o", str(tmp_path / "d.avc"))
    assert result.returncode == 0, result.stderr
    assert "unquantized weights are stored as fp16" in result.stdout and "predicted decode" in result.stdout
    report = json.loads((tmp_path / "d.avc" / "report.json").read_text())
    # standard normal weights in fp16: about 2^-11 / sqrt(3) relative RMS rounding error
    error = float(report["weights"]["storage_note"].split("rounding error is ")[1].split(" ")[0])
    assert 1e-4 < error < 4e-4
    assert report["placement"]["target"] == "corsair"
    assert report["weights"]["bytes_by_format"] == {"fp16": (64 * 128 + 128 * 64) * 2}
    # A target that holds fp32 keeps the weights exact.
    assert run_cli("compile", str(path), "-o", str(tmp_path / "m.avc"), "--target", "mock", "-q").returncode == 0
    report = json.loads((tmp_path / "m.avc" / "report.json").read_text())
    assert report["weights"]["bytes_by_format"] == {"fp32": (64 * 128 + 128 * 64) * 4}


def test_an_output_that_cannot_be_written_is_refused_before_compiling(tmp_path):
    path = mlp_onnx(tmp_path / "mlp.onnx")
    (tmp_path / "notes.txt").write_text("a file, not a folder")
    result = run_cli("compile", str(path), "-o", str(tmp_path / "notes.txt" / "x.avc"), "-v")
    assert result.returncode == 1
    assert result.stderr == (f"aviatorc: error: cannot write the output '{tmp_path / 'notes.txt' / 'x.avc'}': "
                             f"'{tmp_path / 'notes.txt'}' is a file, not a folder\n")  # -v: no "importing" line came first


def test_unknown_api_option_gets_did_you_mean(tmp_path):
    import aviatorc
    from aviatorc.errors import OptionError

    with pytest.raises(OptionError, match="unknown compile option 'quantize'; did you mean 'quant'"):
        aviatorc.compile(mlp_onnx(tmp_path / "mlp.onnx"), quantize="int8")


def test_unsupported_ops_fail_in_one_line_and_write_nothing(tmp_path):
    path = mlp_onnx(tmp_path / "odd.onnx", extra_ops=("Celu", "Celu", "HardSwish"))
    out = tmp_path / "odd.avc"
    result = run_cli("compile", str(path), "-o", str(out))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Celu x2 (first: 'weird0')" in lines[0] and "HardSwish x1 (first: 'weird2')" in lines[0]
    assert str(path) in lines[0]
    assert not out.exists()
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--passes", "fuse-qvk"], "unknown pass 'fuse-qvk'; did you mean 'fuse-qkv'?"),
        (["--quant", "int4", "--group-size", "48"], "group size 48 is not supported"),
        (["--quant", "int4", "--group-size", "0"], "int4 weights need a group size; 0 (per output channel) is int8's alone"),
        (["--target", "corsiar"], "corsiar"),
        (["--batch", "0"], "batch (--batch) must be at least 1, got 0"),
    ],
)
def test_bad_options_get_clear_errors(tmp_path, args, message):
    path = mlp_onnx(tmp_path / "mlp.onnx")
    out = tmp_path / "bad.avc"
    result = run_cli("compile", str(path), "-o", str(out), *args)
    assert result.returncode == 1
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_calibration_file_must_match_inputs(tmp_path):
    path = mlp_onnx(tmp_path / "mlp.onnx")
    calib = tmp_path / "calib.npz"
    np.savez(calib, x=np.zeros((3, 2, 65), np.float32))  # 3 batches of the wrong width
    result = run_cli("compile", str(path), "-o", str(tmp_path / "c.avc"), "--quant", "int8", "--calibration", str(calib))
    assert result.returncode == 1
    assert "calibration batch 0 does not match the model" in result.stderr
    assert "expected [2, 64]" in result.stderr


def test_debug_shows_the_traceback(tmp_path):
    result = run_cli("--debug", "inspect", str(tmp_path / "missing.onnx"))
    assert result.returncode != 0 and "Traceback" in result.stderr


def test_passes_and_ops_listings(capsys):
    assert main(["passes"]) == 0
    listing = capsys.readouterr().out
    for name in ("fuse-qkv", "quantize", "sparsify-2to4", "dce"):
        assert name in listing
    assert main(["ops"]) == 0
    assert "MatMul" in capsys.readouterr().out


def test_compile_api_on_a_zoo_llama_reports_accuracy_and_placement(zoo_onnx, tmp_path):  # noqa: F811
    import aviatorc
    from aviatorc import zoo

    path = zoo_onnx("llama")
    feeds = {k: v.numpy() for k, v in zoo.example_inputs("llama").items()}
    art = aviatorc.compile(path, target="corsair", cards=4, quant="int8", calibration=[feeds])
    report = art.report.to_dict()
    records = {r["name"]: r for r in report["passes"]}
    assert records["fuse-qkv"]["stats"]["groups_fused"] == 2
    (end_to_end,) = report["accuracy"]["end_to_end"]
    assert end_to_end["output"] == "logits" and end_to_end["cosine"] > 0.999
    assert end_to_end["top1_agreement"] > 0.8
    assert report["placement"]["resident_bytes"] == report["weights"]["total_bytes"]
    assert "accuracy" in art.report.summary()
    saved = art.save(tmp_path / "llama.avc")
    assert json.loads((saved / "report.json").read_text())["options"]["quant"] == "int8"


@pytest.mark.parametrize("content, message", [
    (b"", "the model file is empty (0 bytes)"),
    (b"\x08\x07\x12\x04onnx\x1a\xff\xff", "not a valid ONNX protobuf"),
])
def test_hostile_files_fail_in_one_line_without_traceback(tmp_path, content, message):
    path = tmp_path / "bad.onnx"
    path.write_bytes(content)
    result = run_cli("compile", str(path), "-o", str(tmp_path / "bad.avc"))
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "bad.avc").exists()


def test_malformed_target_names_file_and_key(tmp_path):
    target = tmp_path / "board.toml"
    target.write_text("[chiplet]\nsram_byte = 5\n")
    result = run_cli("target", "show", str(target))
    assert result.returncode == 1
    assert result.stderr.strip() == (f"aviatorc: error: {target}: unknown key 'chiplet.sram_byte'; "
                                     "did you mean 'chiplet.sram_bytes'?")


def test_zero_point_flags(tmp_path):
    """--asymmetric / --symmetric choose int4's zero points (neither: the data-free default, an fp16
    offset per group and the output head at int8); both at once is a usage error."""
    path = mlp_onnx(tmp_path / "mlp.onnx")
    formats = {}
    for flag in ("--asymmetric", "--symmetric", None):
        out = tmp_path / f"{flag}.avc"
        args = ["compile", str(path), "-o", str(out), "--target", "mock", "--quant", "int4", "-q"]
        assert run_cli(*args, *([flag] if flag else [])).returncode == 0
        formats[flag] = sorted(json.loads((out / "report.json").read_text())["weights"]["bytes_by_format"])
    assert formats == {"--asymmetric": ["int4-g32-asym"], "--symmetric": ["int4-g32"], None: ["int4-g32-asym-fp16zero", "int8-g32"]}
    both = run_cli("compile", str(path), "-o", str(tmp_path / "x.avc"), "--quant", "int4", "--symmetric",
                   "--asymmetric")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr
