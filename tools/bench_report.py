"""Benchmark: the HTML report of real-size plans, its size and how fast a browser opens it.

Llama-3-8B and Llama-3-70B, shape-only from their config.json (`aviatorc.models`), INT4 on 4
`corsair` cards, compiled and saved by `aviatorc.compile(...).save(...)`, which writes
report.html into the artifact. For each page: its size, the time to render it in Python, and
in headless Chromium (Debian's `chromium`, driven by playwright, every network request refused)
the time from navigation start to the load event and to the last chart drawn, median of 3 cold
page opens. Goal (issue 10): the 8B page opens in under 2 s and is under 5 MB; the 70B page
stays usable (its timeline is aggregated above `aviatorc.report.data.MAX_SPANS` spans).

    python tools/bench_report.py             # both models (about 3 minutes)
    python tools/bench_report.py --quick     # Llama-3-8B only

Writes `tools/results/bench_report.md`; `python tools/update_benchmarks.py` puts it in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aviatorc
from aviatorc.models import llama_config
from aviatorc.report import ReportSources, render_html, report_data

RESULTS = Path(__file__).resolve().parent / "results" / "bench_report.md"
CARDS = 4
OPENS = 3
GOAL_S, GOAL_BYTES = 2.0, 5_000_000


def measure(name: str, folder: Path, chromium: str) -> dict[str, Any]:
    config = folder / name / "config.json"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps(llama_config(name)))
    started = time.perf_counter()
    result = aviatorc.compile(config, target="corsair", cards=CARDS, quant="int4")
    compile_s = time.perf_counter() - started
    out = result.save(folder / f"{name}.avc")
    artifact = aviatorc.load(out)
    started = time.perf_counter()
    data = report_data(ReportSources.from_artifact(artifact))
    page = render_html(data)
    render_s = time.perf_counter() - started
    assert page.encode() == (out / "report.html").read_bytes()  # the compile's own page, byte for byte
    opens = [open_in_browser(out / "report.html", chromium) for _ in range(OPENS)]
    return {"model": name, "cards": CARDS, "tiles": data["placement"]["tiles"],
            "cells": len(data["placement"]["cells"]), "spans": data["timeline"]["spans"],
            "bars": data["timeline"]["bars"], "aggregated": data["timeline"]["aggregated"],
            "bar_us": data["timeline"]["bar_us"], "bytes": len(page.encode()), "compile_s": compile_s,
            "render_s": render_s, "load_s": statistics.median(o["load_s"] for o in opens),
            "charts_s": statistics.median(o["charts_s"] for o in opens), "charts": opens[0]["charts"]}


def open_in_browser(path: Path, chromium: str) -> dict[str, Any]:
    """One cold open in a fresh browser: seconds from navigation start to the load event and to
    the last chart drawn (the page sets body[data-charts] when Bokeh has rendered every item)."""
    from aviatorc.report.browser import offline_page

    with offline_page(path, chromium) as opened:
        charts = opened.wait_for_charts()
        charts_ms = opened.page.evaluate("performance.now()")
        load_ms = opened.page.evaluate("performance.getEntriesByType('navigation')[0].loadEventEnd")
    if opened.problems:
        raise RuntimeError(f"{path}: the page logged errors: {opened.problems[:3]}")
    return {"load_s": load_ms / 1e3, "charts_s": charts_ms / 1e3, "charts": charts}


def report(rows: list[dict[str, Any]]) -> str:
    lines = ["## The HTML report of real-size plans (`tools/bench_report.py`)", "",
             f"Shape-only Llama-3 configs, INT4, {CARDS} `corsair` cards; report.html as `aviatorc compile` writes it. "
             f"Open times: headless Chromium (Debian's package, via playwright), file:// with every network request "
             f"refused, median of {OPENS} cold opens; \"charts drawn\" is when Bokeh has rendered the last chart "
             "(measured in the page from navigation start, so it includes parsing the inlined 1.3 MB of Bokeh).", "",
             "| model | tiles | heatmap cells | trace spans | timeline bars | page MB | render s (Python) | "
             "load event s | charts drawn s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        bars = f"{r['bars']:,}" + (f" (merged, >= {r['bar_us']:.3f} us each)" if r["aggregated"] else "")
        lines.append(f"| {r['model']} | {r['tiles']:,} | {r['cells']:,} | {r['spans']:,} | {bars} | "
                     f"{r['bytes'] / 1e6:.2f} | {r['render_s']:.2f} | {r['load_s']:.3f} | {r['charts_s']:.3f} |")
    goal = next((r for r in rows if r["model"] == "llama-3-8b"), None)
    if goal:
        met = goal["charts_s"] < GOAL_S and goal["bytes"] < GOAL_BYTES
        lines += ["", f"Goal: the Llama-3-8B page under {GOAL_BYTES / 1e6:.0f} MB and drawn in under {GOAL_S:.0f} s: "
                      f"{goal['bytes'] / 1e6:.2f} MB, {goal['charts_s']:.2f} s: {'met' if met else 'NOT met'}."]
    lines += ["", "Measured on this 2-core machine, which other work shares: times vary by tens of percent between runs; "
                  "sizes are exact."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only Llama-3-8B")
    args = parser.parse_args(argv)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("no chromium on PATH: apt-get install chromium", file=sys.stderr)
        return 1
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in ["llama-3-8b"] if args.quick else ["llama-3-8b", "llama-3-70b"]:
            row = measure(name, Path(tmp), chromium)
            print(json.dumps(row), flush=True)
            rows.append(row)
    RESULTS.write_text(report(rows))
    RESULTS.with_suffix(".json").write_text(json.dumps({"rows": rows}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
