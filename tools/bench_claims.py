"""Benchmark: the published claims about Corsair, next to what our machine model predicts for them.

Each claim is compiled as stated (shape-only configs from `aviatorc.models`, INT4 weights) and
predicted with the range the target's assumed figures span; beside each, the assumption that
explains the gap. Nothing here is fitted to the claim it is compared with, with one exception
that is said where it matters: the per-layer latency (28 us, 25-31 us) is the vendor's own
figure, derived from its Llama-3-8B claim, so that row is not an independent check.

- vendor: Llama-3-8B on one 8-card server at batch 48-64, about 60,000 tokens/s at about 1 ms/token;
- vendor: Llama-3-70B at about 2 ms/token on a rack (8 servers of 8 cards: 64 cards);
- seed article (`corsair-seed`: 2 GB of SRAM per chiplet): a 120B dense model on a 4-card server
  at 35 ms/token; cold start 18 s -> 4 s by loading the first token's weights first; P99 under
  50 ms at 16 concurrent requests; latency within +-15% at 16k context.

    python tools/bench_claims.py            # everything (about an hour on 2 cores)
    python tools/bench_claims.py --render   # the page again from tools/results/bench_claims.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aviatorc
from aviatorc.models import llama_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_plan import SEED_120B, describe_run, ms, range_columns  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "bench_claims.md"
CONTEXT, PROMPT = 2048, 128
SEED_CONTEXTS = (1024, 4096, 8192, 16384)


def config(folder: Path, name: str, base: str, **overrides: Any) -> str:
    path = folder / name / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(llama_config(base) | overrides))
    return str(path)


def predict(source: str, target: str, cards: int, batch: int, context: int = CONTEXT, *,
            ranges: bool = True) -> dict[str, Any]:
    started = time.perf_counter()
    result = aviatorc.compile(source, target=target, cards=cards, quant="int4", batch=batch, context=context,
                              prompt=PROMPT, ranges=ranges, sweep=False)
    p = result.plan.prediction
    row: dict[str, Any] = {"target": target, "cards": cards, "batch": batch, "context": context,
                           "token_s": p.time_per_token_s, "tokens_per_s": p.tokens_per_s, "bound_s": p.bound.token_s,
                           "binding": p.bound.token_binding, "cold_s": p.cold_start_s,
                           "cold_naive_s": p.cold_start_naive_order_s, "cold_bound_s": p.bound.cold_s,
                           "token_terms": dict(p.bound.token_terms), "layers": json.loads(Path(source).read_text())["num_hidden_layers"],
                           "compile_s": time.perf_counter() - started}
    row |= range_columns(p, {"time_per_token_s": "token", "cold_start_s": "cold"})
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--render", action="store_true", help="rewrite the page from the saved JSON")
    args = parser.parse_args(argv)
    saved = RESULTS.with_suffix(".json")
    if args.render:
        RESULTS.write_text(render(json.loads(saved.read_text())))
        return 0
    data: dict[str, Any] = {"run": describe_run()}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        l8 = config(folder, "llama-3-8b", "llama-3-8b")
        l70 = config(folder, "llama-3-70b", "llama-3-70b")
        seed = config(folder, "dense-120b", "dense-120b", **SEED_120B)
        data["l8"] = [predict(l8, "corsair", 8, batch) for batch in (1, 48, 64)]
        data["l70"] = [predict(l70, "corsair", 64, 1)]
        data["seed"] = [predict(seed, "corsair-seed", 4, batch) for batch in (1, 16)]
        data["seed_context"] = [predict(seed, "corsair-seed", 4, 1, context, ranges=False) for context in SEED_CONTEXTS]
    saved.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    RESULTS.write_text(render(data))
    print(f"wrote {RESULTS}")
    return 0


def span(row: dict[str, Any], name: str, scale: float = 1e3) -> str:
    low, high = row.get(f"{name}_low_s"), row.get(f"{name}_high_s")
    return "-" if low is None else f"{low * scale:,.3f} - {high * scale:,.3f}"


def against(row: dict[str, Any], claim_s: float, name: str = "token") -> str:
    """Where a claimed time sits against the predicted range: inside it, or how far outside."""
    low, high = row.get(f"{name}_low_s"), row.get(f"{name}_high_s")
    if low is None:
        low = high = row[f"{name}_s"]
    if low <= claim_s <= high:
        return "the claim is inside the range"
    side = "below" if claim_s < low else "above"
    return f"the claim is {(low / claim_s if claim_s < low else claim_s / high):.1f}x {side} the range"


def render(data: dict[str, Any]) -> str:
    run = data.get("run", {})
    lines = ["## Published claims against the machine model (`tools/bench_claims.py`)", "",
             f"Run at {run.get('commit', '?')}{' with uncommitted changes' if run.get('dirty') else ''}. Shape-only "
             "configs, INT4 (g32) weights; each prediction with the range the target's assumed figures span and the "
             "assumption it is most sensitive to.", "",
             "| claim | configuration | predicted | range | most sensitive to | bound (binds) | what explains the gap |",
             "|---|---|---|---|---|---|---|"]
    by_batch = {r["batch"]: r for r in data["l8"]}
    for batch in (48, 64):
        r = by_batch[batch]
        lines.append(f"| vendor: Llama-3-8B, 8-card server, batch 48-64: ~60,000 tok/s at ~1 ms/token | corsair x8, "
                     f"batch {batch} | {ms(r['token_s'])} ms/token, {r['tokens_per_s']:,.0f} tok/s | {span(r, 'token')} ms "
                     f"| {r.get('token_sensitive') or '-'} | {ms(r['bound_s'])} ms ({r['binding']}) | "
                     f"{against(r, 1e-3)}; the bound is {r['bound_s'] / 1e-3:.1f}x the claim and the plan "
                     f"{r['token_s'] / r['bound_s']:.1f}x its bound, so the schedule, more than the hardware figures, "
                     "makes the gap; the per-layer latency is the vendor's own figure from this claim, so this row is "
                     "not an independent check |")
    r = by_batch[1]
    lines.append(f"| (same, batch 1) | corsair x8, batch 1 | {ms(r['token_s'])} ms/token | {span(r, 'token')} ms | "
                 f"{r.get('token_sensitive') or '-'} | {ms(r['bound_s'])} ms ({r['binding']}) | {against(r, 1e-3)} |")
    r = data["l70"][0]
    floor = r["token_terms"].get("latency", 0.0)
    lines.append(f"| vendor: Llama-3-70B ~2 ms/token on a rack | corsair x64 (8 servers of 8 cards), batch 1 | "
                 f"{ms(r['token_s'])} ms/token | {span(r, 'token')} ms | {r.get('token_sensitive') or '-'} | "
                 f"{ms(r['bound_s'])} ms ({r['binding']}) | {against(r, 2e-3)}; the bound's latency floor alone "
                 f"({r['layers']} layers at the target's per-layer latency, and the card crossings) is {ms(floor)} ms: "
                 f"{'the claim is below it, so either the per-layer latency is lower for this model or layers overlap' if floor > 2e-3 else 'the claim is above it'} |")
    seed = {r["batch"]: r for r in data["seed"]}
    r = seed[1]
    lines.append(f"| seed: 120B dense, 4-card server, 35 ms/token | corsair-seed x4, batch 1 | {ms(r['token_s'])} "
                 f"ms/token | {span(r, 'token')} ms | {r.get('token_sensitive') or '-'} | {ms(r['bound_s'])} ms "
                 f"({r['binding']}) | {against(r, 35e-3)}; the article gives 2 GB of SRAM per chiplet (`corsair-seed`: "
                 "64 GB on 4 cards beside about 60 GB of INT4 weights); what its 35 ms includes beyond a decode step "
                 "is not stated |")
    lines.append(f"| seed: cold start 18 s -> 4 s, first token's weights first | corsair-seed x4 | "
                 f"{r['cold_s']:.2f} s first-use order, {r['cold_naive_s']:.2f} s name order | "
                 f"{span(r, 'cold', 1.0)} s | {r.get('cold_sensitive') or '-'} | {r['cold_bound_s']:.2f} s | "
                 "storage bandwidth (assumed 7-28 GB/s) sets it; first-use order helps only while the first layers' "
                 "prefill overlaps the copy |")
    r = seed[16]
    lines.append(f"| seed: P99 < 50 ms at 16 concurrent requests | corsair-seed x4, batch 16 | {ms(r['token_s'])} "
                 f"ms/token | {span(r, 'token')} ms (the high end as a worst case) | {r.get('token_sensitive') or '-'} "
                 f"| {ms(r['bound_s'])} ms ({r['binding']}) | a decode step of 16 sequences; queueing is the "
                 "server's (bench_serve), not in this figure |")
    contexts = data["seed_context"]
    steps = [c["token_s"] for c in contexts]
    mean = sum(steps) / len(steps)
    spread = max(abs(s / mean - 1) for s in steps)
    lines.append(f"| seed: latency within +-15% at 16k context | corsair-seed x4, batch 1, context "
                 f"{', '.join(str(c['context']) for c in contexts)} | "
                 f"{', '.join(ms(s) for s in steps)} ms/token | +-{spread:.1%} around the mean | - | - | the KV cache "
                 "of one sequence is small beside 60 GB of weights; a compressed cache is the KV issue's |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
