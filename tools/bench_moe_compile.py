"""Benchmark: compiling the released mixtures of experts from their `config.json`, shape-only, for corsair.

For each of `examples/mixtral-8x7b`, `qwen3-30b-a3b`, `gpt-oss-120b` and `deepseek-v3`, a fresh
subprocess runs `aviatorc.compile(config.json, target="corsair", cards=C, quant="mxint4")` and
saves the artifact (what `aviatorc compile ... -o` does), and reports each stage's wall time;
the parent measures the child's wall time, CPU time and peak RSS
(`getrusage(RUSAGE_CHILDREN).ru_maxrss`, smallest model first so the running maximum is each
child's own). Prints a table and writes `tools/results/bench_moe_compile.md`.

    python tools/bench_moe_compile.py                          # all four, 4 cards
    python tools/bench_moe_compile.py --models deepseek-v3 --cards 8

Goal (issue 22): DeepSeek-V3 compiles in 10 minutes or less and under 16 GB of memory.
The plan is the dense one (every expert's weights read each step: docs/moe.md), so its predicted
time per token is an upper bound on what routing would read, not a prediction of a routed step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "tools" / "results" / "bench_moe_compile.md"
MODELS = ("qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-120b", "deepseek-v3")  # smallest first
GOAL = {"deepseek-v3": (600.0, 16.0)}  # seconds, GiB

_CHILD = """
import json, sys, tempfile, time
start = time.perf_counter()
import aviatorc
result = aviatorc.compile(sys.argv[1], target="corsair", cards=int(sys.argv[2]), quant=sys.argv[3])
compiled = time.perf_counter()
with tempfile.TemporaryDirectory() as tmp:
    result.save(tmp + "/model.avc")
saved = time.perf_counter()
census = result.graph.op_census()
plan = result.report.data["plan"]
print(json.dumps({"timings": result.timings, "compile_s": compiled - start, "save_s": saved - compiled,
                  "nodes": len(result.graph.nodes), "experts": census.get("MoEDispatch", 0),
                  "routers": census.get("MoERouter", 0), "tiles": result.report.data["placement"]["tiles"],
                  "instructions": sum(sum(p.values()) for p in plan["instructions"].values()),
                  "weight_bytes": result.report.data["weights"]["total_bytes"],
                  "kv_bytes": plan["memory"]["kv_bytes"], "token_s": plan["prediction"]["time_per_token_s"],
                  "bound_s": plan["prediction"]["bound"]["token_s"]}))
"""


def measure(name: str, cards: int, quant: str) -> dict:
    config = ROOT / "examples" / name / "config.json"
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    before, cpu_before = usage.ru_maxrss, usage.ru_utime + usage.ru_stime
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(config), str(cards), quant], capture_output=True,
                          text=True)
    wall_s = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: compile failed:\n{proc.stderr[-3000:]}")
    if usage.ru_maxrss <= before:
        print(f"warning: {name}: peak RSS not above an earlier child's; figure is an upper bound", file=sys.stderr)
    row = json.loads(proc.stdout[proc.stdout.rindex("{\"timings\""):])
    row.update(model=name, wall_s=wall_s, cpu_s=usage.ru_utime + usage.ru_stime - cpu_before,
               peak_rss_gib=usage.ru_maxrss / 2**20)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--cards", type=int, default=4)
    parser.add_argument("--quant", default="mxint4")
    parser.add_argument("--no-write", action="store_true", help="do not write tools/results/bench_moe_compile.md")
    args = parser.parse_args(argv)
    rows = []
    for name in sorted(args.models, key=MODELS.index):
        rows.append(measure(name, args.cards, args.quant))
        r = rows[-1]
        print(f"{name}: {r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} s CPU, {r['peak_rss_gib']:.2f} GiB, "
              f"{r['nodes']} nodes, {r['tiles']} tiles", flush=True)
    table = _table(rows)
    print(table)
    if not args.no_write:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(_report(table, args.cards, args.quant))
        print(f"wrote {RESULTS}")
    return 1 if any(_verdict(r) == "MISSED" for r in rows) else 0


def _verdict(r: dict) -> str:
    goal = GOAL.get(r["model"])
    if goal is None:
        return "-"
    return "met" if r["wall_s"] <= goal[0] and r["peak_rss_gib"] <= goal[1] else "MISSED"


def _table(rows: list[dict]) -> str:
    lines = ["| model | wall | CPU | peak RSS | import | passes | partition | schedule | save | IR nodes | experts "
             "| tiles | instructions | weights | KV cache | dense step (bound) | goal |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        t = r["timings"]
        goal = GOAL.get(r["model"])
        goal_text = "" if goal is None else f" (< {goal[0]:.0f} s, < {goal[1]:.0f} GiB)"
        lines.append(
            f"| {r['model']} | {r['wall_s']:.0f} s | {r['cpu_s']:.0f} s | {r['peak_rss_gib']:.2f} GiB "
            f"| {t['import_s']:.0f} s | {sum(t['passes_s'].values()):.0f} s | {t['partition_s']:.0f} s "
            f"| {t['schedule_s']:.0f} s | {r['save_s']:.0f} s | {r['nodes']:,} | {r['experts']:,} | {r['tiles']:,} "
            f"| {r['instructions']:,} | {r['weight_bytes'] / 2**30:.1f} GiB | {r['kv_bytes'] / 2**20:.0f} MiB "
            f"| {r['token_s'] * 1e3:.1f} ms ({r['bound_s'] * 1e3:.1f} ms) | {_verdict(r)}{goal_text} |")
    return "\n".join(lines)


def _report(table: str, cards: int, quant: str) -> str:
    return (
        "# Compiling the released mixtures of experts (`tools/bench_moe_compile.py`)\n\n"
        f"Each `examples/<model>/config.json` compiled shape-only for `corsair` at {cards} cards, {quant}, "
        "default workload (batch 1, context 2048, prompt 128), and saved, in a fresh subprocess: wall and CPU "
        "time and peak RSS of that child (CPU time is what the compile costs on an idle machine; the machine "
        "is shared). Stage times are the compile's own (`CompileResult.timings`). The plan is the dense one "
        "(every expert read each step, docs/moe.md): its step time bounds a routed step from above.\n\n"
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs visible (shared with other jobs), Python "
        f"{platform.python_version()}.\n\n{table}\n"
    )


if __name__ == "__main__":
    raise SystemExit(main())
