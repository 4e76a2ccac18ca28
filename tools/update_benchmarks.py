"""Rebuild BENCHMARKS.md from the results each benchmark writes under tools/results/.

    python tools/bench_import.py && python tools/onnx_conformance.py && ... && python tools/fuzz.py --budget 2000 \
        && python tools/fuzz.py --artifacts --budget 1000 && python tools/update_benchmarks.py

Each benchmark prints its figures and writes `tools/results/<name>.md` whole (some also save
the figures as `<name>.json` and render the page from them: `tools/bench_pages.py`); this script
only concatenates the pages, in a fixed order, under a header that says how to rerun each one.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "tools" / "results"
ORDER = [
    ("onnx_conformance", "python tools/onnx_conformance.py"),
    ("bench_import", "python tools/bench_import.py"),
    ("bench_quant_minilm", "python tools/bench_quant.py --only minilm"),
    ("bench_quant_smollm2", "python tools/bench_quant.py --only smollm2"),
    ("bench_defaults", "python tools/bench_defaults.py"),
    ("bench_int4_default", "python tools/bench_int4_default.py"),
    ("bench_kv_window", "python tools/bench_kv_window.py"),
    ("bench_partition", "python tools/bench_partition.py"),
    ("bench_plan", "python tools/bench_plan.py"),
    ("bench_prefill_cards", "python tools/bench_prefill_cards.py"),
    ("bench_moe", "python tools/bench_moe.py"),
    ("bench_claims", "python tools/bench_claims.py"),
    ("bench_runtime", "python tools/bench_runtime.py"),
    ("bench_serve", "python tools/bench_serve.py --draft --ngram"),
    ("bench_report", "python tools/bench_report.py"),
    ("fuzz", "python tools/fuzz.py --budget 2000"),
    ("fuzz_artifacts", "python tools/fuzz.py --artifacts --budget 1000"),
]


def main() -> None:
    parts = [
        "# Benchmarks\n",
        "Measured on the project's 2-core, 24 GB CPU machine. Every figure comes from a script in `tools/`;",
        "rerun it, then `python tools/update_benchmarks.py` to rebuild this page.\n",
    ]
    known = {name for name, _ in ORDER}
    # A campaign still running writes `<name>.partial.md`: not a result yet.
    extra = sorted(p.stem for p in RESULTS.glob("*.md") if p.stem not in known and not p.stem.endswith(".partial"))
    for name, command in ORDER + [(n, f"python tools/{n}.py") for n in extra]:
        path = RESULTS / f"{name}.md"
        if not path.exists():
            continue
        parts.append(f"\n<!-- rerun: {command} -->\n")
        parts.append(path.read_text().strip() + "\n")
    (ROOT / "BENCHMARKS.md").write_text("\n".join(parts))
    print(f"wrote {ROOT / 'BENCHMARKS.md'}")


if __name__ == "__main__":
    main()
