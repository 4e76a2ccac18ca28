"""Partitioner benchmark: Llama-3-8B, Llama-3-70B and a 120B dense Llama-like model, shape-only,
at INT8 and INT4, on `corsair` with 1, 4 and 8 cards and on `corsair-seed` with 4 cards.

    python tools/bench_partition.py [--time-limit 30] [--models llama-3-8b,...] [--importer]

Weights come from the model configs (`weights_from_config`); with `--importer` Llama-3-8B goes
through the real shape-only importer (`aviatorc.import_model(config.json)`) instead. Prints a
table, and writes its figures to tools/results/bench_partition.json and the page rendered from
them to tools/results/bench_partition.md. The JSON the run replaces becomes the page's "before"
column (the before-and-after table), so a rerun keeps the comparison with the run before it:

    python tools/bench_partition.py --render     # the page again from the saved JSON, nothing run
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_pages import describe_run, previous_run, rerender, write_results

from aviatorc.formats import WeightFormat
from aviatorc.models import llama_config
from aviatorc.partition import partition
from aviatorc.partition.weights import weights_from_config, weights_from_graph, with_formats
from aviatorc.target import load_target

FORMATS = {"int8": WeightFormat("int8"), "int4": WeightFormat("int4", group_size=128)}
TARGETS = [("corsair", 1), ("corsair", 4), ("corsair", 8), ("corsair-seed", 4)]
GiB = 2**30


def weights_for(model: str, fmt: WeightFormat, importer: bool):
    if importer and model == "llama-3-8b":
        import aviatorc

        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "config.json")
            with open(path, "w") as handle:
                json.dump(llama_config(model), handle)
            graph = aviatorc.import_model(path)
        return with_formats(weights_from_graph(graph), fmt), "importer"
    return weights_from_config(llama_config(model), fmt), "config"


COLUMNS = ("model", "format", "target", "cards", "source", "tiles", "status", "solve s", "objective ms", "greedy ms",
           "vs greedy", "bound ms", "gap", "resident GiB", "streamed GiB", "min streamed GiB")


def run_case(model: str, fmt: WeightFormat, weights, source: str, target_name: str, cards: int,
             time_limit_s: float) -> dict[str, Any]:
    """Partition one case; its figures, unrounded (the page rounds)."""
    target = load_target(target_name, cards=cards)
    started = time.monotonic()
    p = partition(weights, target, time_limit_s=time_limit_s)
    wall = time.monotonic() - started
    for warning in p.warnings:
        print(f"  warning: {warning}", flush=True)
    return {"model": model, "format": fmt.name, "target": target_name, "cards": cards, "source": source,
            "tiles": len(p.tiles), "status": p.status, "solve_s": wall, "objective_ms": p.objective_ps / 1e9,
            "greedy_ms": p.greedy_objective_ps / 1e9, "vs_greedy": p.improvement_over_greedy,
            "bound_ms": p.bound_ps / 1e9, "gap": p.gap, "resident_gib": p.resident_bytes / GiB,
            "streamed_gib": p.streamed_bytes / GiB, "min_streamed_gib": p.min_streamed_read_bytes / GiB}


def table_row(r: dict[str, Any]) -> str:
    return (f"| {r['model']} | {r['format']} | {r['target']} | {r['cards']} | {r['source']} | {r['tiles']} "
            f"| {r['status']} | {r['solve_s']:.1f} | {r['objective_ms']:.3f} | {r['greedy_ms']:.3f} "
            f"| {r['vs_greedy']:+.2%} | {r['bound_ms']:.3f} | {r['gap']:.2%} | {r['resident_gib']:.2f} "
            f"| {r['streamed_gib']:.2f} | {r['min_streamed_gib']:.2f} |")


def case_key(r: dict[str, Any]) -> tuple[str, str, str, int]:
    return (r["model"], r["format"], r["target"], r["cards"])


def render(data: dict[str, Any]) -> str:
    """The page, from the saved figures alone: every number on it comes from `data`."""
    header = "| " + " | ".join(COLUMNS) + " |"
    lines = [
        "## Partitioner (tools/bench_partition.py)",
        "",
        f"Shape-only Llama-family weights, linear layers at the given format, embedding FP16; decode step, batch 1; "
        f"CP-SAT 2 workers, deterministic; time limit {data['time_limit_s']:.0f} s per case, spent as a fixed budget "
        "(`solve_budget`: 6 layer solves, deterministic time each; wall clock only as a safety net), so the "
        "placements do not depend on the machine's load; `solve s` is this run's wall time on 2 shared CPU cores. "
        "Objective: per-step compute + LPDDR streaming + activation transfers (docs/partition.md). "
        "`vs greedy`: how much lower than the greedy layer-by-layer placement; `gap`: above the problem-specific "
        "lower bound; `min streamed`: the bytes per step no placement can avoid streaming.",
        "",
        f"Run: {data['run']}.",
        "",
        header,
        "|" + "---|" * len(COLUMNS),
        *(table_row(r) for r in data["rows"]),
        "",
    ]
    previous = data.get("previous")
    if previous:
        lines += before_and_after(data["rows"], previous)
    return "\n".join(lines)


def before_and_after(rows: list[dict[str, Any]], previous: dict[str, Any]) -> list[str]:
    """This run's cases beside the same cases of the run it replaced."""
    before = {case_key(r): r for r in previous["rows"]}
    matched = [(before[case_key(r)], r) for r in rows if case_key(r) in before]
    lines = ["### Before and after", "",
             f"Before: {previous['run']}; after: this run. {len(matched)} of this run's {len(rows)} cases were in "
             "the previous run; `objective` and `bound` are in ms per decode step.", "",
             "| case | objective before → after | bound before → after | gap before → after "
             "| solve s before → after |",
             "|---|---|---|---|---|"]
    for old, new in matched:
        case = f"{new['model']} {new['format']} {new['target']} x{new['cards']}"
        lines.append(f"| {case} | {old['objective_ms']:.3f} → {new['objective_ms']:.3f} "
                     f"({new['objective_ms'] / old['objective_ms'] - 1:+.1%}) "
                     f"| {old['bound_ms']:.3f} → {new['bound_ms']:.3f} | {old['gap']:.2%} → {new['gap']:.2%} "
                     f"| {old['solve_s']:.1f} → {new['solve_s']:.1f} |")
    lines.append("")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=30.0)
    parser.add_argument("--models", default="llama-3-8b,llama-3-70b,dense-120b")
    parser.add_argument("--importer", action="store_true", help="import Llama-3-8B through aviatorc.import_model")
    parser.add_argument("--out", default="tools/results/bench_partition.md",
                        help="the page; its figures go beside it as .json")
    parser.add_argument("--render", action="store_true", help="rewrite the page from the saved .json; run nothing")
    args = parser.parse_args()
    out = Path(args.out)
    if args.render:
        rerender(out, render)
        return
    print("| " + " | ".join(COLUMNS) + " |")
    rows = []
    for model in args.models.split(","):
        for _fmt_name, fmt in FORMATS.items():
            weights, source = weights_for(model, fmt, args.importer)
            for target_name, cards in TARGETS:
                rows.append(run_case(model, fmt, weights, source, target_name, cards, args.time_limit))
                print(table_row(rows[-1]), flush=True)
    data = {"time_limit_s": args.time_limit, "run": describe_run(), "rows": rows,
            "previous": previous_run(out.with_suffix(".json"))}
    write_results(out, data, render)


if __name__ == "__main__":
    main()
