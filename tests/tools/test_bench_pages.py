"""Each benchmark page holds only what its script writes: the page is its script's `render`
applied to the figures the script saved beside it, so rerunning the script loses nothing
(tools/bench_pages.py)."""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "tools" / "results"
PAGES = [("bench_partition", "bench_partition"), ("bench_quant", "bench_quant_minilm"),
         ("bench_quant", "bench_quant_smollm2"), ("bench_defaults", "bench_defaults"),
         ("bench_int4_default", "bench_int4_default"), ("bench_plan", "bench_plan"), ("bench_claims", "bench_claims")]


def script(name: str) -> ModuleType:
    """A tools/ script as a module, without letting its import-time settings leak into the tests."""
    saved = dict(os.environ)
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "tools"))
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.parametrize(("name", "page"), PAGES)
def test_page_is_its_script_output(name: str, page: str) -> None:
    data = json.loads((RESULTS / f"{page}.json").read_text())
    rendered = script(name).render(data)
    text = (RESULTS / f"{page}.md").read_text()
    assert text == rendered, (f"tools/results/{page}.md differs from what tools/{name}.py writes from {page}.json: "
                              f"put the text in the script, then `python tools/{name}.py --render`")


def partition_row(cards: int, objective_ms: float) -> dict:
    return {"model": "llama-3-8b", "format": "int8", "target": "corsair", "cards": cards, "source": "config",
            "tiles": 10, "status": "greedy", "solve_s": 1.0, "objective_ms": objective_ms, "greedy_ms": objective_ms,
            "vs_greedy": 0.0, "bound_ms": 1.0, "gap": objective_ms - 1.0, "resident_gib": 1.0, "streamed_gib": 0.0,
            "min_streamed_gib": 0.0}


def test_partition_before_and_after_comes_from_the_previous_run() -> None:
    render = script("bench_partition").render
    data = {"time_limit_s": 30.0, "run": "commit new", "rows": [partition_row(1, 1.5), partition_row(4, 1.2)],
            "previous": None}
    assert "Before and after" not in render(data)
    data["previous"] = {"time_limit_s": 30.0, "run": "commit old", "rows": [partition_row(4, 1.0)]}
    page = render(data)
    assert "Before: commit old; after: this run. 1 of this run's 2 cases" in page
    assert "| llama-3-8b int8 corsair x4 | 1.000 → 1.200 (+20.0%) | 1.000 → 1.000 | 0.00% → 20.00% |" in page


def minilm_data(int4_mean: float) -> dict:
    row = {"who": "aviatorc", "config": "INT4 g32 sym (GPTQ)", "algorithm": "GPTQ", "mean": int4_mean,
           "worst": int4_mean - 0.01, "bytes": 14, "fp32_bytes": 100}
    return {"model": "minilm", "run": "commit new", "rows": [row], "compiled": [],
            "meta": {"eval_sentences": 60, "calibration_tokens": 2865, "calibration_batches": 100}}


def test_quant_goals_and_comparison_are_computed() -> None:
    render = script("bench_quant").render
    assert "- INT4 g32 mean cosine at least 0.99: met by INT4 g32 sym (GPTQ) 0.99200" in render(minilm_data(0.992))
    data = minilm_data(0.985)
    assert "- INT4 g32 mean cosine at least 0.99: not met; closest INT4 g32 sym (GPTQ) 0.98500" in render(data)
    assert "Compared with the previous run" not in render(data)
    data["previous"] = minilm_data(0.992) | {"run": "commit old"}
    page = render(data)
    assert "| INT4 g32 sym (GPTQ) | 0.99200 / 0.98200 | 0.98500 / 0.97500 | -0.00700 |" in page
    assert "Not measured in this run" in page  # no compile-path rows: said, not left blank
    data["compiled"] = [{"config": "INT4 g32 sym (GPTQ)", "mean": 0.99, "worst": 0.98, "seconds": 1.0}]
    assert "| INT4 g32 sym (GPTQ) | 0.99000 | 0.98000 | 0.98500 | 0.97500 |" in render(data)


def side_row(who: str, config: str, bits: int, block: int | None, mean: float, **extra) -> dict:
    return {"who": who, "config": config, "bits": bits, "block": block, "encoding": "QDQ", "mean": mean,
            "worst": mean - 0.01, "file_bytes": 1000, "latency_s": 0.5, "token_table": "float16", **extra}


def side_by_side(ours_g32: float) -> dict:
    meta = {"runs": 10, "threads": 1, "onnxruntime": "1.32.0", "cpus": 2, "seconds": 1.0,
            "session_config": {"session.qdq_matmulnbits_accuracy_level": "0"}, "feed_shapes": {"input_ids": [60, 18]},
            "load_average_before": [2.0, 2.0, 2.0], "load_average_after": [2.1, 2.0, 2.0]}
    rows = [side_row("onnxruntime", "fp32 export (sanity)", 32, None, 1.0) | {"latency_s": 0.4},
            side_row("onnxruntime", "MatMulNBits 8-bit block 128 sym (weight-only)", 8, 128, 0.9998),
            side_row("onnxruntime", "MatMulNBits 4-bit block 32 sym (weight-only)", 4, 32, 0.97),
            side_row("onnxruntime", "MatMulNBits 4-bit block 128 sym (weight-only)", 4, 128, 0.96),
            side_row("aviatorc", "INT8 g128 RTN (default), QDQ", 8, 128, 0.9999, calibrated=False, default=True),
            side_row("aviatorc", "INT4 g32 GPTQ sym (default), QDQ", 4, 32, ours_g32, calibrated=True, default=True),
            side_row("aviatorc", "INT4 g128 GPTQ sym (default), QDQ", 4, 128, 0.95, calibrated=True, default=True)]
    return {"meta": meta, "rows": rows}


def test_quant_side_by_side_goals_are_computed_from_its_rows() -> None:
    render = script("bench_quant").render
    data = minilm_data(0.992) | {"side_by_side": side_by_side(0.991)}
    page = render(data)
    assert "| aviatorc | INT4 g32 GPTQ sym (default), QDQ | 4 | 32 | 0.99100 | 0.98100 | 1,000 | 500.0 | 1.25x | float16 |" in page
    assert ("- Our best 8-bit at or above onnxruntime's best 8-bit (by mean): met; ours INT8 g128 RTN (default), "
            "QDQ 0.99990 / 0.98990, theirs MatMulNBits 8-bit block 128 sym (weight-only) 0.99980 / 0.98980.") in page
    assert ("- Our calibrated INT4 above onnxruntime's best 4-bit at every block size (by mean): not met; block 32: "
            "ours INT4 g32 GPTQ sym (default), QDQ 0.99100 / 0.98100, theirs MatMulNBits 4-bit block 32 sym "
            "(weight-only) 0.97000 / 0.96000; block 128: ours INT4 g128 GPTQ sym (default), QDQ 0.95000 / 0.94000, "
            "theirs MatMulNBits 4-bit block 128 sym (weight-only) 0.96000 / 0.95000.") in page
    assert ("- The default calibrated INT4 g32 at 0.99 mean cosine or better on the held-out sentences: met; "
            "INT4 g32 GPTQ sym (default), QDQ 0.99100 / 0.98100.") in page
    assert "at 0.99 mean cosine or better on the held-out sentences: not met" in render(
        minilm_data(0.992) | {"side_by_side": side_by_side(0.985)})
    # A side-by-side row is compared with the same row of the run before, as the passes' rows are.
    data["previous"] = minilm_data(0.992) | {"run": "commit old", "side_by_side": side_by_side(0.989)}
    assert "| INT4 g32 GPTQ sym (default), QDQ | 0.98900 / 0.97900 | 0.99100 / 0.98100 | +0.00200 |" in render(data)
