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


# -- issue 26: the first hour of a new user, one line each ---------------------------------------

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

TINY_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
              "max_position_embeddings": 16_777_216, "tie_word_embeddings": False, "torch_dtype": "float32"}


def run_cli(*args: str, cwd: Path | None = None) -> tuple[int, str]:
    """(exit status, stderr) of `aviatorc ARGS` as a user runs it."""
    done = subprocess.run([sys.executable, "-m", "aviatorc", *args], capture_output=True, text=True, timeout=600, cwd=cwd)
    return done.returncode, done.stderr


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("aviatorc: ")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return path


@pytest.fixture(scope="module")
def decoder_artifact(tmp_path_factory) -> Path:
    """A tiny decoder (random weights, an ONNX file: no tokenizer anywhere), compiled for mock."""
    from aviatorc import zoo

    folder = tmp_path_factory.mktemp("dec")
    onnx_path = zoo.export_decode_onnx("llama", folder / "d.onnx")
    assert cli.main(["compile", str(onnx_path), "--target", "mock", "--context", "64", "--prompt", "8", "-o",
                     str(folder / "d.avc"), "-q"]) == 0
    return folder / "d.avc"


@pytest.fixture(scope="module")
def encoder_artifact(tmp_path_factory) -> Path:
    """An encoder: input_ids -> last_hidden_state (a Gather from a table), compiled for mock."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    folder = tmp_path_factory.mktemp("enc")
    table = numpy_helper.from_array(np.random.default_rng(0).standard_normal((32, 16)).astype(np.float32), "embed")
    graph = helper.make_graph([helper.make_node("Gather", ["embed", "input_ids"], ["last_hidden_state"])], "bert",
                              [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, 8])],
                              [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, [1, 8, 16])],
                              [table])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), folder / "bert.onnx")
    assert cli.main(["compile", str(folder / "bert.onnx"), "--target", "mock", "-o", str(folder / "bert.avc"), "-q"]) == 0
    return folder / "bert.avc"


def test_an_unknown_option_names_the_commands_own_help() -> None:
    status, err = run_cli("compile", "m.onnx", "-o", "out.avc", "--bogus")
    assert status == 2
    assert one_line(err) == "aviatorc: error: unrecognized arguments: --bogus (see `aviatorc compile --help`)"
    status, err = run_cli("target", "show", "corsair", "--bogus")
    assert (status, one_line(err)) == (2, "aviatorc: error: unrecognized arguments: --bogus (see `aviatorc target show "
                                          "--help`)")


def test_a_model_id_is_answered_with_the_accepted_sources(capsys) -> None:
    assert cli.main(["compile", "HuggingFaceTB/SmolLM2-135M", "-o", "x.avc"]) == 1
    assert capsys.readouterr().err == (
        "aviatorc: error: model 'HuggingFaceTB/SmolLM2-135M' does not exist; aviatorc reads local files and downloads "
        "nothing: pass an .onnx file, a .gguf file, or a Hugging Face config.json (or the folder holding it; planned "
        "shape-only, without weights)\n")


@pytest.mark.parametrize("out, why", [("/proc/x.avc", "No such file or directory"), ("/sys/x/y.avc", None)])
def test_an_output_where_no_file_can_be_made_is_a_user_error(tiny_config, capsys, out, why) -> None:
    assert cli.main(["compile", str(tiny_config), "-o", out]) == 1
    err = capsys.readouterr().err
    parent = str(Path(out).parents[len(Path(out).parts) - 3])
    assert err.startswith(f"aviatorc: error: cannot write the output '{out}': '{parent}' takes no new files (")
    assert err.endswith("; choose a folder on a normal file system, such as one under your home or the current "
                        "folder\n") and err.count("\n") == 1 and (why is None or why in err)


def test_run_output_under_proc_is_a_user_error(decoder_artifact, tmp_path, capsys) -> None:
    import numpy as np

    np.savez(tmp_path / "f.npz", input_ids=np.zeros((1, 2), np.int64))
    assert cli.main(["run", str(decoder_artifact), "--inputs", str(tmp_path / "f.npz"), "--output", "/proc/o.npz"]) == 1
    assert capsys.readouterr().err.startswith("aviatorc: error: cannot write the output '/proc/o.npz': '/proc' takes no "
                                              "new files")


def test_context_zero_is_refused(tiny_config, tmp_path, capsys) -> None:
    assert cli.main(["compile", str(tiny_config), "--context", "0", "-o", str(tmp_path / "a.avc")]) == 1
    assert capsys.readouterr().err == "aviatorc: error: context (--context) must be at least 1, got 0\n"
    assert not (tmp_path / "a.avc").exists()


def test_a_context_past_the_models_positions_is_refused(tiny_config, tmp_path, capsys) -> None:
    config = json.loads(tiny_config.read_text()) | {"max_position_embeddings": 4096}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert cli.main(["compile", str(tmp_path / "config.json"), "--context", "100000000", "-o", str(tmp_path / "a.avc")]) == 1
    assert capsys.readouterr().err == (
        "aviatorc: error: context (--context) 100,000,000 is more than the 4,096 positions model 'LlamaForCausalLM' "
        "was trained for (its max_position_embeddings); choose a context of at most 4,096\n")


def test_a_context_too_large_to_plan_is_refused_with_the_estimate(tiny_config, tmp_path, capsys) -> None:
    # 2 layers x (K + V: 2 heads x 16 wide, twice) x 2 bytes = 256 bytes a token: 4 x 16M tokens = 15.3 GiB
    assert cli.main(["compile", str(tiny_config), "--context", "16000000", "--batch", "4", "-o",
                     str(tmp_path / "a.avc")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("aviatorc: error: a context of 16,000,000 streams a KV cache of 15.3 GiB from LPDDR in about ")
    assert "instructions per decode step: building that plan would take about " in err and err.count("\n") == 1
    assert "choose a context of at most " in err and not (tmp_path / "a.avc").exists()


def test_a_kv_cache_larger_than_the_machine_is_refused_with_the_numbers(tiny_config, tmp_path, capsys) -> None:
    assert cli.main(["compile", str(tiny_config), "--context", "16000000", "--batch", "100", "-o",
                     str(tmp_path / "a.avc")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("aviatorc: error: batch 100 x context 16,000,000 needs a KV cache of 381.5 GiB, which with ")
    assert "of weights is more than the " in err and " of SRAM and LPDDR on corsair (1 card(s)); choose a context of at " \
        "most 10,083,879, a smaller batch, an INT8 KV cache (--kv-dtype int8), or more cards\n" in err


def test_a_missing_extra_is_named(tmp_path, monkeypatch, capsys) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    assert cli.main(["compile", str(model), "-o", str(tmp_path / "m.avc")]) == 1
    assert capsys.readouterr().err == (f"aviatorc: error: reading the GGUF file '{model}' needs the gguf package; pip "
                                       "install 'aviatorc[gguf]' (from a checkout: pip install '.[gguf]')\n")


@pytest.mark.parametrize("command", ["inspect", "report"])
def test_a_reader_that_stops_early_exits_0(command, tiny_config, decoder_artifact) -> None:
    """`aviatorc inspect X | head -1` and `aviatorc report X | head -1` exit 0, saying nothing more."""
    target = str(tiny_config if command == "inspect" else decoder_artifact)
    proc = subprocess.Popen([sys.executable, "-m", "aviatorc", command, target], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()
    proc.stdout.close()  # what `head -1` does after its line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0 and err == "", err


def test_an_encoder_is_said_to_be_one(encoder_artifact, capsys) -> None:
    assert cli.main(["generate", str(encoder_artifact), "--prompt-ids", "1,2"]) == 1
    assert capsys.readouterr().err == (
        f"aviatorc: error: {encoder_artifact}: this model cannot generate: it is an encoder (its output is "
        "'last_hidden_state', not next-token logits): an encoder such as BERT reads a whole input at once and predicts "
        "no next token, so it cannot generate; run() computes its outputs; export a decode step that takes and "
        "returns its KV cache (see aviatorc.zoo.export_decode_onnx), or use run() on the graph's own shapes\n")


def test_text_without_a_tokenizer_says_how_to_give_one(decoder_artifact, capsys) -> None:
    assert cli.main(["generate", str(decoder_artifact), "--prompt", "hello"]) == 1
    assert capsys.readouterr().err == ("aviatorc: error: --prompt TEXT needs a tokenizer; give --tokenizer DIR, or token "
                                       "ids with --prompt-ids 1,2,3\n")
    assert cli.main(["chat", str(decoder_artifact)]) == 1
    assert capsys.readouterr().err == ("aviatorc: error: chat needs a tokenizer with a chat template; give --tokenizer "
                                       "DIR (a folder with tokenizer.json) or a .gguf file\n")


def test_calibration_text_needs_the_models_tokenizer(tmp_path, capsys) -> None:
    from aviatorc import zoo

    onnx_path = zoo.export_decode_onnx("llama", tmp_path / "d.onnx")
    capsys.readouterr()  # the exporter's own warnings
    (tmp_path / "cal.txt").write_text("Some text to calibrate on.")
    assert cli.main(["compile", str(onnx_path), "--target", "mock", "--quant", "int4", "--calibration-text",
                     str(tmp_path / "cal.txt"), "-o", str(tmp_path / "d.avc")]) == 1
    assert capsys.readouterr().err == (
        "aviatorc: error: calibration text needs the model's tokenizer, and this model's source carries none; pass its "
        "tokenizer (--tokenizer DIR or a .gguf file), or calibration batches (--calibration FILE.npz)\n")


def test_set_overrides_a_target_figure_and_names_an_unknown_key(capsys) -> None:
    assert cli.main(["target", "show", "mock", "--set", "runtime.per_layer_latency_s=0"]) == 0  # a what-if, not invalid
    assert "per_layer_latency_s = 0.0" in capsys.readouterr().out
    assert cli.main(["target", "show", "mock", "--set", "runtime.per_layer_latency=0"]) == 1
    err = capsys.readouterr().err
    assert err.endswith("mock.toml (overrides): unknown key 'runtime.per_layer_latency'; did you mean "
                        "'runtime.per_layer_latency_s'?\n") and err.count("\n") == 1
    assert cli.main(["target", "show", "mock", "--set", "nonsense"]) == 1
    assert capsys.readouterr().err == ("aviatorc: error: --set 'nonsense' is not KEY=VALUE; like --set "
                                       "runtime.per_layer_latency_s=0\n")


def test_the_report_says_why_a_sweep_point_does_not_fit_and_how_to_get_accuracy(decoder_artifact, capsys) -> None:
    from aviatorc.report.data import sweep_reason

    assert sweep_reason({"fits": False, "reason": "chiplet 0 needs 3 MiB"}) == "does not fit: chiplet 0 needs 3 MiB"
    assert cli.main(["report", str(decoder_artifact)]) == 0
    out = capsys.readouterr().out
    assert ("accuracy: not measured; compile with --quant (or --sparsity) and --calibration FILE.npz, or a decoder with "
            "--calibration-text FILE.txt: the figures are measured on held-out batches against the unquantized model") in out
    assert "the bound's largest term" in out and "set by " in out


def test_a_bounded_kv_cache_plans_a_context_no_full_cache_fits(tiny_config, tmp_path, capsys) -> None:
    """The context above needs 381.5 GiB of KV cache; a window of 4 + 1024 (at most 2,052 positions
    held) plans it. --kv-sinks alone bounds nothing and is refused."""
    assert cli.main(["compile", str(tiny_config), "--kv-sinks", "8", "-o", str(tmp_path / "a.avc")]) == 1
    assert capsys.readouterr().err == ("aviatorc: error: --kv-sinks bounds nothing without --kv-recent; add "
                                       "--kv-recent N\n")
    assert cli.main(["compile", str(tiny_config), "--context", "16000000", "--batch", "100", "--kv-recent", "1024",
                     "--no-sweep", "--no-ranges", "-q", "-o", str(tmp_path / "b.avc")]) == 0
    from aviatorc import load

    memory = load(tmp_path / "b.avc").plan.memory
    assert (memory.kv_sinks, memory.kv_recent) == (4, 1024) and memory.kv_bytes < (381 << 30) / 7000
