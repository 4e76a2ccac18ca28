"""Benchmark: plans against the physical bound on the machine model, in every regime.

Every figure comes from `aviatorc.compile` (the pipeline itself: memory plan, partition,
schedule, simulation, bound, ranges) on shape-only Llama-architecture configs
(`aviatorc.models`): Llama-3-8B, Llama-3-70B and a dense 120B model, INT4, on `corsair` at 1, 4
and 8 cards and batch 1 and 16. For each, decode (time per token) and prefill (TTFT):

- simulated, on the machine model (an LPDDR channel per chiplet, per-layer latency, vector
  units, link message overheads, the host's per-token round trip);
- the physical bound (computed apart from the simulator) and the term that binds it;
- efficiency = bound / simulated;
- the range the target's assumed figures span, and the assumption the figure is most sensitive to;
- beside it, the same model compiled with the chunked prefill (`prefill="chunked"`, the schedule
  before the weight-stationary one: every chunk streams every weight again, and no SRAM beyond a
  decode step's staging is taken from the weights), so each case shows what the stationary
  prefill gains in TTFT and what its SRAM costs the decode step, in one run.

Then the compile time of the Llama-3-70B config.json (INT4, 4 cards) in a fresh process, and
the size of its plan.json.

    python tools/bench_plan.py            # everything (about an hour on 2 cores)
    python tools/bench_plan.py --quick    # Llama-3-8B only
    python tools/bench_plan.py --render   # the page again from tools/results/bench_plan.json

Writes `tools/results/bench_plan.{json,md}`; `python tools/update_benchmarks.py` puts it in BENCHMARKS.md.
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
from aviatorc.models import llama_config
from aviatorc.target import load_target

RESULTS = Path(__file__).resolve().parent / "results" / "bench_plan.md"
CONTEXT, PROMPT = 2048, 128
# A dense 120B Llama-like model (hidden 10240, 96 layers, GQA 80/8, FFN 32768): the seed article's "120B".
SEED_120B = {"hidden_size": 10240, "num_hidden_layers": 96, "num_attention_heads": 80, "num_key_value_heads": 8,
             "intermediate_size": 32768}
MODELS = {"llama-3-8b": ("llama-3-8b", {}), "llama-3-70b": ("llama-3-70b", {}),
          "dense-120b": ("dense-120b", SEED_120B)}
CARDS = (1, 4, 8)
BATCHES = (1, 16)


def config_path(name: str, folder: Path) -> Path:
    base, overrides = MODELS[name]
    path = folder / name / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(llama_config(base) | overrides))
    return path


def target_path(folder: Path, cards: int) -> str:
    """corsair at `cards` cards."""
    path = folder / f"corsair-{cards}.toml"
    path.write_text(load_target("corsair", cards=cards).to_toml())
    return str(path)


def compile_case(config: Path, folder: Path, cards: int, batch: int, *, prefill: str = "auto") -> dict[str, Any]:
    started = time.perf_counter()
    try:
        result = aviatorc.compile(str(config), target=target_path(folder, cards), quant="int4", batch=batch,
                                  context=CONTEXT, prompt=PROMPT, ranges=prefill == "auto", sweep=False,
                                  prefill=prefill)
    except aviatorc.AviatorError as error:  # a case the machine cannot hold: say why
        return {"cards": cards, "batch": batch, "prefill": prefill, "refused": error.message}
    p, memory = result.plan.prediction, result.plan.memory
    taken = "pipelined" if memory.prefill_copies else "stationary" if memory.prefill_block_tokens else "chunked"
    row: dict[str, Any] = {
        "cards": cards, "batch": batch, "prefill": taken, "compile_s": time.perf_counter() - started,
        "token_s": p.time_per_token_s, "token_bound_s": p.bound.token_s, "token_binding": p.bound.token_binding,
        "token_efficiency": p.efficiency, "ttft_s": p.ttft_s, "ttft_bound_s": p.bound.ttft_s,
        "ttft_binding": p.bound.ttft_binding, "ttft_efficiency": p.ttft_efficiency, "bound_cards": p.bound.cards,
        "prefill_chunks": p.prefill.chunks, "kv_location": result.plan.memory.kv_location,
        "kv_sram_share": memory.kv_sram_positions / max(1, memory.kv_blocks * memory.kv_block_tokens),
        "streamed_bytes": result.placement.streamed_bytes, "lpddr_busy": p.decode.lpddr_busy_fraction_max,
    }
    return row | range_columns(p, {"time_per_token_s": "token", "ttft_s": "ttft"})


def range_columns(prediction: Any, figures: dict[str, str]) -> dict[str, Any]:
    """Each figure's range as `<name>_low_s`, `<name>_high_s` and `<name>_sensitive` columns."""
    out: dict[str, Any] = {}
    for key, name in figures.items():
        r = prediction.ranges.get(key)
        if r is not None:
            out |= {f"{name}_low_s": r.low, f"{name}_high_s": r.high, f"{name}_sensitive": r.most_sensitive}
    return out


def compile_time(config: Path, folder: Path) -> tuple[float, int]:
    """`aviatorc compile` of a config end to end in a fresh process: wall seconds and plan.json bytes."""
    out = folder / "l70.avc"
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "aviatorc", "compile", str(config), "--cards", "4", "--quant", "int4",
                    "-o", str(out), "-q"], check=True)
    return time.perf_counter() - started, (out / "plan.json").stat().st_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only Llama-3-8B")
    parser.add_argument("--render", action="store_true", help="rewrite the page from the saved JSON")
    args = parser.parse_args(argv)
    saved = RESULTS.with_suffix(".json")
    if args.render:
        RESULTS.write_text(render(json.loads(saved.read_text())))
        return 0
    data: dict[str, Any] = {"rows": [], "run": describe_run()}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name in (["llama-3-8b"] if args.quick else list(MODELS)):
            config = config_path(name, folder)
            for cards in CARDS:
                for batch in BATCHES:
                    new = compile_case(config, folder, cards, batch)
                    old = compile_case(config, folder, cards, batch, prefill="chunked")
                    row = {"model": name, **new, "chunked_token_s": old.get("token_s"),
                           "chunked_ttft_s": old.get("ttft_s"), "chunked_chunks": old.get("prefill_chunks")}
                    print(json.dumps(row), flush=True)
                    data["rows"].append(row)
                    saved.with_suffix(".partial.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        if not args.quick:
            seconds, size = compile_time(config_path("llama-3-70b", folder), folder)
            data["compile_s"], data["plan_json_bytes"] = seconds, size
            print(f"compile time, Llama-3-70B INT4 x4: {seconds:.1f} s, plan.json {size:,} bytes", flush=True)
    saved.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    saved.with_suffix(".partial.json").unlink(missing_ok=True)
    RESULTS.write_text(render(data))
    print(f"wrote {RESULTS}")
    return 0


def describe_run() -> dict[str, Any]:
    """The tree this run measured (commit and whether it had uncommitted changes)."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()

    return {"commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(git("status", "--porcelain", "--", "aviatorc",
                                                                            "backends", "passes"))}


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.3f}"


def kv_cell(row: dict[str, Any]) -> str:
    """Where the KV cache lives: SRAM, or LPDDR with the share of its blocks kept in SRAM."""
    where, share = row.get("kv_location", "?"), row.get("kv_sram_share", 0.0)
    return f"lpddr, {share:.0%} in SRAM" if where == "lpddr" and share else where


def render(data: dict[str, Any]) -> str:
    run = data.get("run", {})
    lines = ["## Plans against the physical bound, on the machine model (`tools/bench_plan.py`)", "",
             f"Run at {run.get('commit', '?')}{' with uncommitted changes' if run.get('dirty') else ''}. Shape-only "
             f"configs, INT4 (g32) weights, FP16 embeddings, context {CONTEXT}, prompt {PROMPT}, `corsair` (an LPDDR "
             "channel per chiplet, 1/8 of the card's assumed 0.5 TB/s each). Simulated: the plan's decode step and "
             "prefill on the simulator; bound: computed apart from it (`aviatorc/schedule/bound.py`), with the term "
             "that binds; efficiency = bound / simulated. The range is what the target's assumed figures span "
             "(every one at its favourable end, every one at its unfavourable end), with the assumption that "
             "moves the figure most. Each plan is compiled with the default prefill (`--prefill auto`: the "
             "weight-stationary one, or on several cards the pipelined one, each layer on its home's card, where "
             "the prefill and the decode steps up to the context take less time with it; *prefill* says which). *Chunked* is the same model compiled with `--prefill chunked`, "
             "the prefill schedule before the weight-stationary one (each chunk streams every weight again); the "
             "default's prefill holds a layer's streamed tiles and the pass's hand-off in SRAM the weights then "
             "lack, which the decode step pays for. *KV cache*: where it lives; a cache in LPDDR keeps as many of "
             "its blocks in SRAM as the SRAM the weights leave holds (`--kv-cache auto`), and the share says how "
             "many.", "",
             "### Time per token (decode)", "",
             "| model | cards | batch | simulated ms | range ms | most sensitive to | bound ms | binds | efficiency | "
             "KV cache | chunked ms | default / chunked |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = data["rows"]
    for r in rows:
        if "refused" in r:
            lines.append(f"| {r['model']} | {r['cards']} | {r['batch']} | refused: {r['refused']} ||||||||||")
            continue
        lines.append(f"| {r['model']} | {r['cards']} | {r['batch']} | {ms(r['token_s'])} | "
                     f"{ms(r.get('token_low_s'))} - {ms(r.get('token_high_s'))} | {r.get('token_sensitive') or '-'} | "
                     f"{ms(r['token_bound_s'])} | {r['token_binding']} | {r['token_efficiency']:.3f} | {kv_cell(r)} | "
                     f"{ms(r.get('chunked_token_s'))} | {ratio(r['token_s'], r.get('chunked_token_s'))} |")
    lines += ["", "### Time to first token (prefill)", "",
              "| model | cards | batch | prefill | simulated ms | range ms | most sensitive to | bound ms | binds | "
              "efficiency | passes | chunked ms | chunks | chunked / default | within 1.5x of the bound |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "refused" in r:
            continue
        lines.append(f"| {r['model']} | {r['cards']} | {r['batch']} | {r.get('prefill', 'stationary')} | "
                     f"{ms(r['ttft_s'])} | {ms(r.get('ttft_low_s'))} - {ms(r.get('ttft_high_s'))} | {r.get('ttft_sensitive') or '-'} | "
                     f"{ms(r['ttft_bound_s'])} | {r['ttft_binding']} | {r['ttft_efficiency']:.3f} | "
                     f"{r['prefill_chunks']} | {ms(r.get('chunked_ttft_s'))} | {r.get('chunked_chunks', '-')} | "
                     f"{ratio(r.get('chunked_ttft_s'), r['ttft_s'])} | "
                     f"{'yes' if r['ttft_s'] <= 1.5 * r['ttft_bound_s'] else 'no'} |")
    done = [r for r in rows if "refused" not in r]
    if done:
        worst = min(done, key=lambda r: r["token_efficiency"])
        paired = [r for r in done if r.get("chunked_ttft_s") and r.get("chunked_token_s")] or [
            {"ttft_s": 1.0, "chunked_ttft_s": 1.0, "token_s": 1.0, "chunked_token_s": 1.0}]
        lines += ["", f"Lowest decode efficiency: {worst['token_efficiency']:.3f} ({worst['model']}, {worst['cards']} "
                      f"card(s), batch {worst['batch']}); no row rounds to 0: "
                      f"{'yes' if all(round(r['token_efficiency'], 3) > 0 for r in done) else 'NO'}. "
                      f"Prefill: TTFT within 1.5x of its bound in {sum(r['ttft_s'] <= 1.5 * r['ttft_bound_s'] for r in done)} "
                      f"of {len(done)} cases; the default prefill's TTFT against the chunked one's: "
                      f"{min(r['chunked_ttft_s'] / r['ttft_s'] for r in paired):.1f}x to "
                      f"{max(r['chunked_ttft_s'] / r['ttft_s'] for r in paired):.1f}x lower; its decode step "
                      f"{min(r['token_s'] / r['chunked_token_s'] for r in paired):.3f}x to "
                      f"{max(r['token_s'] / r['chunked_token_s'] for r in paired):.3f}x the chunked plan's "
                      f"({len(paired)} cases compiled both ways)."]
    if data.get("compile_s") is not None:
        lines += ["", f"Compile time: `aviatorc compile` of the Llama-3-70B config.json (shape-only, INT4, 4 cards, "
                      f"ranges included) end to end in a fresh process: {data['compile_s']:.1f} s wall (goal <= 120 s: "
                      f"{'met' if data['compile_s'] <= 120 else 'NOT met'}); its plan.json "
                      f"{data['plan_json_bytes'] / 1e6:.2f} MB (goal <= 8 MB: "
                      f"{'met' if data['plan_json_bytes'] <= 8e6 else 'NOT met'})."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
