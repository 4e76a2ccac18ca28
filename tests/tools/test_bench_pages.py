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
         ("bench_quant", "bench_quant_smollm2")]


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
