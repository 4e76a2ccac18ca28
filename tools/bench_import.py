"""Benchmark: shape-only import of Llama-3 `config.json` files at full size.

For each model (aviatorc.models: Llama-3-8B, Llama-3-70B, a dense 123B Llama-architecture
model), writes its `config.json` (from `aviatorc.models.llama_config`) to a temporary
folder and runs `aviatorc inspect --json` on it in a fresh subprocess, measuring wall time
and the child's peak RSS (`getrusage(RUSAGE_CHILDREN).ru_maxrss`, one child per
measurement). Prints a table and writes `tools/results/bench_import.md`.

    python tools/bench_import.py                    # llama-3-8b, llama-3-70b, dense-120b
    python tools/bench_import.py --models llama-3-8b
    python tools/bench_import.py --static           # batch 1, seq 128 instead of symbolic

Goal (from the design): Llama-3-8B in under 60 s and 2 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from aviatorc.models import MODEL_NAMES, llama_config, param_count

RESULTS = Path(__file__).resolve().parent / "results" / "bench_import.md"
GOAL = {"llama-3-8b": (60.0, 2.0)}  # seconds, GiB

# The child imports the config (as `aviatorc inspect` does) and reports node counts as JSON.
_CHILD = """
import json, sys, time
start = time.perf_counter()
from aviatorc.frontends.torch import import_hf_config
kwargs = json.loads(sys.argv[2])
graph = import_hf_config(sys.argv[1], **kwargs)
seconds = time.perf_counter() - start
print(json.dumps({"nodes": len(graph.nodes), "op_census": graph.op_census(),
                  "parameters": sum(v.type.numel() for v in graph.initializers.values() if v.type.is_static),
                  "import_seconds": seconds}))
"""


def measure(name: str, folder: Path, static: bool, use_cli: bool) -> dict:
    """Import one model in a subprocess; wall time and peak RSS of that child."""
    config = llama_config(name)
    path = folder / name / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2))
    kwargs = {"batch": 1, "seq_len": 128} if static else {}
    if use_cli and not static:
        command = [sys.executable, "-m", "aviatorc", "inspect", "--json", str(path)]
    else:
        command = [sys.executable, "-c", _CHILD, str(path), json.dumps(kwargs)]
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    before, cpu_before = usage.ru_maxrss, usage.ru_utime + usage.ru_stime
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    wall_s = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    peak_kib, cpu_s = usage.ru_maxrss, usage.ru_utime + usage.ru_stime - cpu_before
    if proc.returncode != 0:
        raise SystemExit(f"{name}: import failed:\n{proc.stderr[-3000:]}")
    if peak_kib <= before:
        print(f"warning: {name}: peak RSS not above an earlier child's; figure is an upper bound", file=sys.stderr)
    row = {"model": name, "params_b": param_count(config) / 1e9, "wall_s": wall_s, "cpu_s": cpu_s,
           "peak_rss_gib": peak_kib / 2**20, "command": " ".join(command[:4])}
    report = json.loads(proc.stdout[proc.stdout.index("{"):])  # `inspect --json` and the child agree on keys
    row["nodes"] = report["nodes"]
    row["parameters_b"] = report["parameters"] / 1e9
    row["attention"] = report["op_census"].get("Attention", 0)
    row["matmul"] = report["op_census"].get("MatMul", 0)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODEL_NAMES), choices=MODEL_NAMES)
    parser.add_argument("--static", action="store_true", help="batch 1, seq 128 instead of symbolic dims")
    parser.add_argument("--no-cli", action="store_true", help="import in-process code instead of `aviatorc inspect`")
    parser.add_argument("--no-write", action="store_true", help="do not write tools/results/bench_import.md")
    args = parser.parse_args(argv)
    use_cli = not args.no_cli and _cli_available()
    rows = []
    # One fresh folder per model; each model's child process is measured on its own, and the
    # smaller model goes first so RUSAGE_CHILDREN's running maximum is that child's own peak.
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            rows.append(measure(name, Path(tmp), args.static, use_cli))
            print(f"{name}: {rows[-1]['wall_s']:.1f} s, {rows[-1]['peak_rss_gib']:.2f} GiB, "
                  f"{rows[-1]['nodes']} nodes", flush=True)
    table = _table(rows, args.static)
    print(table)
    if not args.no_write:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(_report(table, use_cli, args.static))
        print(f"wrote {RESULTS}")
    failed = [r["model"] for r in rows if r["model"] in GOAL
              and (r["wall_s"] > GOAL[r["model"]][0] or r["peak_rss_gib"] > GOAL[r["model"]][1])]
    return 1 if failed else 0


def _cli_available() -> bool:
    try:
        import aviatorc.cli  # noqa: F401
    except ImportError:
        return False
    return True


def _table(rows: list[dict], static: bool) -> str:
    lines = ["| model | params (config) | params (graph) | wall time | CPU time | peak RSS | IR nodes | MatMul | Attention | goal |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        goal = GOAL.get(r["model"])
        verdict = "-" if goal is None else (
            "met" if r["wall_s"] <= goal[0] and r["peak_rss_gib"] <= goal[1] else "MISSED")
        goal_text = "" if goal is None else f" (< {goal[0]:.0f} s, < {goal[1]:.0f} GiB)"
        lines.append(f"| {r['model']} | {r['params_b']:.2f} B | {r['parameters_b']:.2f} B | {r['wall_s']:.1f} s "
                     f"| {r['cpu_s']:.1f} s | {r['peak_rss_gib']:.2f} GiB | {r['nodes']} | {r['matmul']} | {r['attention']} "
                     f"| {verdict}{goal_text} |")
    return "\n".join(lines)


def _report(table: str, use_cli: bool, static: bool) -> str:
    how = "`aviatorc inspect --json <config.json>`" if use_cli and not static else "`import_hf_config` in a child"
    dims = "batch 1, seq 128 (static)" if static else "symbolic batch and seq"
    cpus = os.cpu_count()
    return (
        "# Shape-only import of full-size configs\n\n"
        f"Generated by `tools/bench_import.py`: each config.json is imported by {how} in a fresh "
        f"subprocess ({dims}); wall time includes starting Python and importing torch and transformers; "
        "CPU time is the child's user + system time (what the import costs on an idle machine); "
        "peak RSS is the child's `ru_maxrss`.\n\n"
        f"Machine: {platform.machine()}, {cpus} CPUs visible (shared with other jobs), Python "
        f"{platform.python_version()}.\n\n{table}\n"
    )


if __name__ == "__main__":
    raise SystemExit(main())
