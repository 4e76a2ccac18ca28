"""What the command line prints (issue 10, items 2-4): progress only on a terminal (stderr),
--quiet and --verbose, each pass once in the summary, the limitations beside the figures they
qualify, defaults in `compile --help`, and errors worded alike across commands."""

from __future__ import annotations

import json
import logging
import os
import pty
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from aviatorc import cli
from tests.test_cli import mlp_onnx, run_cli


def run_on_a_terminal(*args: str) -> tuple[int, str, bytes]:
    """Run the CLI with stderr on a pseudo-terminal and stdout piped: (status, stdout, stderr bytes)."""
    master, slave = pty.openpty()
    env = dict(os.environ, COLUMNS="160", LINES="40")
    proc = subprocess.Popen([sys.executable, "-m", "aviatorc", *args], stdout=subprocess.PIPE, stderr=slave, env=env)
    os.close(slave)
    chunks: list[bytes] = []

    def read() -> None:  # drained as it comes, so a full pty buffer never blocks the child
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed its end
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read)
    reader.start()
    assert proc.stdout is not None
    out = proc.stdout.read().decode()
    status = proc.wait(timeout=300)
    reader.join(timeout=30)
    os.close(master)
    return status, out, b"".join(chunks)


def test_a_piped_compile_prints_no_progress_and_each_pass_once(tmp_path):
    # Before: "importing ..." and one "<pass>: changed in 0.01 s" line per pass went to stdout,
    # and the summary listed every pass again.
    path = mlp_onnx(tmp_path / "mlp.onnx")
    result = run_cli("compile", str(path), "-o", str(tmp_path / "m.avc"), "--target", "mock", "--quant", "int8")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert "importing" not in result.stdout and "in 0.0" not in result.stdout
    assert len(re.findall(r"^(?:pass )?quantize: changed", result.stdout, re.M)) == 1
    assert re.search(r"^pass quantize: changed \(", result.stdout, re.M)


def test_a_terminal_shows_the_stages_on_stderr_only(tmp_path):
    path = mlp_onnx(tmp_path / "mlp.onnx")
    status, out, err = run_on_a_terminal("compile", str(path), "-o", str(tmp_path / "m.avc"), "--target", "mock",
                                         "--quant", "int8", "--solver", "cpsat")
    assert status == 0, err.decode(errors="replace")
    for stage in (f"importing {path}", "pass quantize", "partitioning onto mock (4 chiplets)", "CP-SAT layer solves",
                  "scheduling decode (batch 1, context 2048) and prefill (prompt 128)"):
        assert stage.encode() in err, stage
    assert "importing" not in out and out.startswith("model: mlp, 4 nodes")  # the summary stays on stdout


def test_quiet_on_a_terminal_draws_nothing(tmp_path):
    path = mlp_onnx(tmp_path / "mlp.onnx")
    status, out, err = run_on_a_terminal("compile", str(path), "-o", str(tmp_path / "m.avc"), "--target", "mock",
                                         "-q")
    assert (status, out, err) == (0, "", b"")


def test_verbose_logs_each_stage_as_a_timed_line(tmp_path):
    path = mlp_onnx(tmp_path / "mlp.onnx")
    result = run_cli("compile", str(path), "-o", str(tmp_path / "m.avc"), "--target", "mock", "--quant", "int8", "-v")
    assert result.returncode == 0, result.stderr
    lines = [re.sub(r"^\[ *\d+\.\d s\] ", "", line) for line in result.stderr.splitlines()]
    assert len(lines) == len(result.stderr.splitlines()) and all(line != raw for line, raw
                                                                  in zip(lines, result.stderr.splitlines()))
    assert lines[0] == f"importing {path}"
    assert re.fullmatch(rf"importing {re.escape(str(path))}: 4 nodes, 2 initializers, \d+\.\d s", lines[1])
    assert "pass quantize" in lines and any(re.fullmatch(r"pass quantize: changed, \d+\.\d s", x) for x in lines)
    assert "partitioning onto mock (4 chiplets)" in lines


def test_quiet_and_verbose_exclude_each_other(tmp_path):
    result = run_cli("compile", "m.onnx", "-o", str(tmp_path / "m.avc"), "-q", "-v")
    assert result.returncode == 2 and "not allowed with argument" in result.stderr


def test_the_command_line_leaves_logging_as_it_found_it(tmp_path, capsys):
    logger = logging.getLogger("aviatorc")
    before = (logger.level, logger.propagate, list(logger.handlers))
    assert cli.main(["compile", str(mlp_onnx(tmp_path / "mlp.onnx")), "-o", str(tmp_path / "m.avc"), "--target",
                     "mock", "-v"]) == 0
    assert (logger.level, logger.propagate, list(logger.handlers)) == before
    assert "importing" in capsys.readouterr().err


def test_compile_help_shows_defaults_and_explains_every_option(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "250")
    with pytest.raises(SystemExit) as done:
        cli.main(["compile", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for expected in (
        "--seed SEED the partitioner's random seed (the same seed and inputs give a byte-identical artifact) "
        "(default: 0)",
        "--sparsity-method {magnitude,wanda,sparsegpt} how --sparsity chooses the pruned weights: by magnitude, Wanda "
        "(magnitude x activation norm; needs --calibration) or SparseGPT (with error correction; needs --calibration) "
        "(default: magnitude)",
        "-q, --quiet print nothing but warnings and errors (no progress, no summary)",
        "--time-limit TIME_LIMIT partitioner time budget in seconds (default: 30.0)",
        "--batch BATCH sequences decoded together (default: 1)",
        "--keep-fp16 PATTERN keep weights whose name matches this fnmatch pattern in FP16 (repeatable) --",
    ):
        assert expected in text, expected


def test_the_summary_states_what_the_figures_leave_out(tmp_path):
    path = mlp_onnx(tmp_path / "mlp.onnx")
    result = run_cli("compile", str(path), "-o", str(tmp_path / "m.avc"), "--target", "mock")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert ("above the lower bound (the bound leaves out collecting outputs, the hand-offs between layers and the "
            "trips to each layer's home);") in text
    # the scheduler's note, right under the predicted figures it qualifies
    assert text.index("predicted time to first token") < text.index("(prediction: costs modelled") \
        < text.index("SRAM: KV cache")
    assert "(prediction: a weight-stationary prefill runs in passes over the prompt, each streaming the weights once" \
        in text


def test_solver_auto_says_whether_cp_sat_ran_and_why(tmp_path):
    path = mlp_onnx(tmp_path / "mlp.onnx")
    result = run_cli("compile", str(path), "-o", str(tmp_path / "m.avc"), "--target", "mock", "--solver", "auto")
    assert result.returncode == 0, result.stderr
    found = re.search(r"^solver auto: the greedy placement is ([0-9.]+)% above the lower bound, (over|within) 2%",
                      result.stdout, re.M)
    assert found, result.stdout
    report = json.loads((tmp_path / "m.avc" / "report.json").read_text())["placement"]
    greedy_gap = (report["greedy_objective_ps"] - report["lower_bound_ps"]) / report["lower_bound_ps"]
    assert float(found[1]) == pytest.approx(100 * greedy_gap, abs=0.006)
    assert (found[2] == "over") == (greedy_gap > 0.02)


def test_a_bad_card_count_is_worded_alike_by_compile_and_target_show(tmp_path):
    path = mlp_onnx(tmp_path / "mlp.onnx")
    compiled = run_cli("compile", str(path), "-o", str(tmp_path / "m.avc"), "--cards", "0")
    shown = run_cli("target", "show", "corsair", "--cards", "0")
    assert compiled.returncode == shown.returncode == 1
    assert compiled.stderr == shown.stderr == "aviatorc: error: cards (--cards) must be at least 1, got 0\n"


def test_the_readme_exit_status_table_is_the_cli_s():
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    statuses = [int(m) for m in re.findall(r"^\| (\d+) \| ", readme, re.M)]
    assert statuses == [0, cli.EXIT_USER_ERROR, cli.EXIT_USAGE_ERROR, cli.EXIT_INTERNAL_ERROR, 130]


def test_a_config_json_left_to_the_defaults_is_warned_about_on_stderr(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
              "max_position_embeddings": 256, "tie_word_embeddings": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    result = run_cli("inspect", str(path), "--json")
    assert result.returncode == 0, result.stderr
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("aviatorc:")]
    assert line.startswith(f"aviatorc: warning: {path}: the config does not set intermediate_size, so transformers' "
                           "defaults for 'llama' are used (intermediate_size 11,008)")


def test_print_ir_after_change_prints_the_ir_on_stdout_once(tmp_path):
    path = mlp_onnx(tmp_path / "mlp.onnx")
    result = run_cli("compile", str(path), "-o", str(tmp_path / "m.avc"), "--target", "mock", "--quant", "int8",
                     "--print-ir-after-change", "-v")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith('// IR after quantize\ngraph "mlp" {\n')
    assert result.stdout.count("// IR after") == 1 and "// IR" not in result.stderr
