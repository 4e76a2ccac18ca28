"""Benchmark: the released mixtures of experts planned for their routing on corsair (issue 22).

For each model (`examples/<model>/config.json`, shape-only), card count and routing, a fresh
subprocess runs `aviatorc.compile(config, target="corsair", cards=C, quant="mxint4", routing=R,
batch=B)` (no sweep, no ranges) and reports, from the plan:

- the decode step over 64 sampled routings: mean (the plan's time per token), P50, P99, and the
  step with every expert firing; the bound in expectation and the efficiency (bound / mean);
- TTFT (every expert runs in a prefill, each on its share of the prompt) and its bound;
- the experts a step reads in expectation, the experts resident, and the share of a step's
  expected expert bytes that are resident (what the hot/cold placement buys);
- SRAM use (resident weight bytes over the cards' SRAM), the compile's wall time and its peak memory (the
  compiling process's maximum resident set);
- where experts stream, the same placement prefetching experts ahead of their routing, by a
  predictor's hit rate (a missed expert is loaded on demand, a wrong guess for nothing), and the
  lowest hit rate of those at which the step is within 10% of a perfect predictor's.

A second table measures the hit rate of one such predictor, pre-gating (a block's router run on
the hidden state the block before it routed), on the tiny random-weight models of
`aviatorc.zoo.FAMILY_ARCHS` with more than one MoE block: the only MoE weights at hand.

Figures are simulated. The routings are assumed (`uniform`, `zipf:S`), not measured: these
configs have no trained weights. Rows are kept in `tools/results/bench_moe.json` by case, so
running a subset updates those rows and keeps the others (each row names the commit it ran at);
the page `tools/results/bench_moe.md` is rendered from all of them.

    python tools/bench_moe.py                                   # the default cases
    python tools/bench_moe.py --models qwen3-30b-a3b --cards 4 8 --routing uniform zipf:1.2
    python tools/bench_moe.py --models --add ../other/tools/results/bench_moe.json   # merge, run nothing
    python tools/bench_moe.py --models mixtral-8x7b --routing uniform --solver greedy cpsat   # both placements
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "tools" / "results"
MODELS = ("qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-120b", "deepseek-v3")

_CHILD = """
import json, resource, sys, time
start = time.perf_counter()
import aviatorc
name, cards, quant, routing, batch, solver = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6]
result = aviatorc.compile(name, target="corsair", cards=cards, quant=quant, routing=routing, batch=batch,
                          sweep=False, ranges=False, solver=solver)
wall = time.perf_counter() - start
plan, placement = result.plan, result.placement
p = plan.prediction
layers = result.report.data["routing"]["layers"]
shares = {(int(layer), e): s for layer, block in layers.items() for e, s in enumerate(block["shares"])}
top_k = {int(layer): block["top_k"] for layer, block in layers.items()}
resident, expected, expected_resident = set(), 0.0, 0.0
held = {}
for tile, where in zip(placement.tiles, placement.where):
    if tile.expert < 0 or (tile.layer, tile.expert) not in shares:
        continue
    key = (tile.layer, tile.expert)
    fires = 1 - (1 - shares[key]) ** batch
    expected += fires * tile.storage_bytes
    if where < placement.num_chiplets:
        expected_resident += fires * tile.storage_bytes
        held.setdefault(key, []).append(True)
    else:
        held.setdefault(key, []).append(False)
sram = plan.target.chiplet.sram_bytes * len(plan.chiplets)
r = p.routing
print(json.dumps({
    "mean_s": r.mean_s, "p50_s": r.p50_s, "p99_s": r.p99_s, "all_experts_s": r.all_experts_s,
    "bound_s": p.bound.token_s, "efficiency": p.efficiency, "ttft_s": p.ttft_s, "ttft_bound_s": p.bound.ttft_s,
    "experts_per_step": r.experts_per_step, "experts_total": r.experts_total, "prefetch": r.prefetch,
    "experts_resident": sum(all(v) for v in held.values()),
    "expected_resident_share": expected_resident / expected if expected else 0.0,
    "sram_use": sum(t.storage_bytes for t, w in zip(placement.tiles, placement.where) if w < placement.num_chiplets) / sram,
    "compile_s": wall, "timings": result.timings, "placement_s": result.report.data["placement"]["objective_s"],
    "gap_to_bound": result.report.data["placement"]["gap_to_bound"],
    "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "aviatorc"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def measure(model: str, cards: int, routing: str, batch: int, quant: str, solver: str = "greedy") -> dict:
    config = ROOT / "examples" / model / "config.json"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(config), str(cards), quant, routing, str(batch), solver],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{model} x{cards} {routing} batch {batch} {solver}: compile failed:\n{proc.stderr[-3000:]}")
    row = json.loads(proc.stdout[proc.stdout.rindex('{"mean_s"'):])
    row.update(model=model, cards=cards, routing=routing, batch=batch, quant=quant, solver=solver,
               wall_s=time.perf_counter() - start, commit=commit())
    return row


def key(row: dict) -> tuple:
    return (MODELS.index(row["model"]), row["cards"], row["batch"], row["routing"], row["quant"], solver(row))


def solver(row: dict) -> str:
    return row.get("solver", "greedy")


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


def needed(prefetch: dict[str, float]) -> str:
    """The lowest hit rate timed whose step is within 10% of a perfect predictor's."""
    if not prefetch:
        return "-"
    perfect = prefetch["1"]
    return min((rate for rate, step in prefetch.items() if step <= 1.1 * perfect), key=float)


def table(rows: list[dict]) -> str:
    lines = ["| model | cards | batch | routing | mean | P50 | P99 | every expert | bound | efficiency | TTFT (bound) "
             "| experts a step | resident experts | expected expert bytes resident | SRAM use "
             "| prefetching at hit rate 0.5 / 0.8 / 1 | hit rate needed | compile | peak memory | commit |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in sorted((r for r in rows if solver(r) == "greedy"), key=key):
        ahead = r.get("prefetch") or {}
        lines.append(
            f"| {r['model']} | {r['cards']} | {r['batch']} | {r['routing']} | {ms(r['mean_s'])} | {ms(r['p50_s'])} "
            f"| {ms(r['p99_s'])} | {ms(r['all_experts_s'])} | {ms(r['bound_s'])} | {r['efficiency']:.3f} "
            f"| {ms(r['ttft_s'])} ({ms(r['ttft_bound_s'])}) | {r['experts_per_step']:,.0f} of {r['experts_total']:,} "
            f"| {r['experts_resident']:,} | {r['expected_resident_share']:.1%} | {r['sram_use']:.1%} "
            f"| {' / '.join(ms(ahead[k]) for k in ('0.5', '0.8', '1')) if ahead else '(no expert streams)'} "
            f"| {needed(ahead)} | {r['compile_s']:.0f} s | {gib(r)} | {r['commit']} |")
    return "\n".join(lines)


def solver_table(rows: list[dict]) -> str:
    """Each case compiled with both placements: the simulated step of each, and the placement
    objective's gap to its lower bound (`partition/bound.py`)."""
    greedy = {key(r)[:-1]: r for r in rows if solver(r) == "greedy"}
    lines = ["| model | cards | routing | greedy: mean step | CP-SAT: mean step | CP-SAT / greedy "
             "| greedy objective above its bound | CP-SAT objective above its bound | compile greedy / CP-SAT | commit |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in sorted((r for r in rows if solver(r) == "cpsat" and key(r)[:-1] in greedy), key=key):
        g = greedy[key(r)[:-1]]
        lines.append(f"| {r['model']} | {r['cards']} | {r['routing']} | {ms(g['mean_s'])} | {ms(r['mean_s'])} "
                     f"| {r['mean_s'] / g['mean_s']:.3f} | {gap(g)} | {gap(r)} "
                     f"| {g['compile_s']:.0f} s / {r['compile_s']:.0f} s | {r['commit']} |")
    return "\n".join(lines) if len(lines) > 2 else "(no case compiled with both)"


def gib(row: dict) -> str:
    return f"{row['peak_rss_bytes'] / 2**30:.1f} GiB" if "peak_rss_bytes" in row else "-"


def gap(row: dict) -> str:
    return f"{row['gap_to_bound']:.1%}" if "gap_to_bound" in row else "-"


def prediction_table() -> str:
    """Pre-gating's hit rate on the tiny family models (random weights): measured by the sim runtime
    while it generates (4 prompts of 8 tokens, 32 new tokens each, batch 1), and by the interpreter on
    4 batches of 2 x 32 tokens, with the chance a guess by the measured shares has."""
    import numpy as np

    import aviatorc
    from aviatorc import zoo
    from aviatorc.frontends.torch import import_hf_config
    from aviatorc.partition.weights import weights_from_graph
    from aviatorc.routing import measure_prediction, moe_blocks
    from aviatorc.runtime import Session

    lines = ["| model (tiny, random weights) | blocks predicted | experts, top-k | runtime: decode hit rate "
             "| runtime: experts run a block and step | interpreter: hit rate | chance |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for arch in zoo.MOE_ARCHS:
        with tempfile.TemporaryDirectory() as folder:
            graph = import_hf_config(zoo.write_family_config(arch, folder), shape_only=False)
        blocks = moe_blocks(graph, weights_from_graph(graph))
        if len(blocks) < 2:
            continue
        rng = np.random.default_rng(0)
        batches = [{"input_ids": rng.integers(3, zoo.VOCAB_SIZE, (2, 32))} for _ in range(4)]
        hits = measure_prediction(graph, blocks, batches)
        session = Session(aviatorc.compile(zoo.build_family_model(arch), target="mock", context=40, prompt=8,
                                           batch=1, time_limit_s=1.0, sweep=False, ranges=False), device="sim")
        for _ in range(4):
            session.generate(rng.integers(3, zoo.VOCAB_SIZE, 8), 32, eos_token_id=())
        decode = session.experts["decode"]
        lines.append(f"| {arch} | {len(hits)} | {blocks[0].experts}, {blocks[0].top_k} | {decode.hit_rate:.3f} "
                     f"| {decode.ran / decode.blocks:.2f} of {decode.experts / decode.blocks:.0f} "
                     f"| {np.mean([h.hit_rate for h in hits]):.3f} | {np.mean([h.chance for h in hits]):.3f} |")
    return "\n".join(lines)


def page(rows: list[dict], predicted: str) -> str:
    return (
        "# Mixtures of experts planned for their routing (`tools/bench_moe.py`)\n\n"
        "The released `config.json` files, shape-only, compiled for `corsair` (one LPDDR channel per chiplet) "
        "at mxint4 with the default workload (context 2048, prompt 128) and the routing shown: `uniform` (every "
        "expert top_k / E of the tokens) or `zipf:S` (the expert of rank r in proportion to 1 / r^S, ranks "
        "shuffled per layer). The routings are assumed, not measured: these configs carry no trained weights. "
        "A decode step reads only the experts its tokens route to; hot experts are kept resident (the "
        "placement's knapsack over the expected reads), and a streamed expert's weights, in strips of 1 MiB or "
        "more (`partition.tiling.expert_tile_bytes`) on channels of their own, are loaded once a stream reaches "
        "the expert's block and the routing is known: the runtime issues the routed experts' loads together, "
        "within the program's staging (`schedule.simulate.Activity`), first projections before second ones. "
        "Times are simulated: the mean, P50 and P99 over 64 sampled "
        "routings, and the same plan's step with every expert firing. The bound is in expectation over the "
        "routing. \"Expected expert bytes resident\": of the expert bytes a step reads in expectation, the "
        "share already in SRAM. Prefetching: the same placement with expert loads issued as early as staging "
        "allows, for the experts a predictor names, its names known when the step starts (as a guess from the "
        "previous token's routing is; \"hit rate needed\": the lowest timed at which the step is "
        "within 10% of a perfect predictor's).\n\n" + table(rows) + "\n\n"
        "## Greedy against CP-SAT\n\n"
        "The same cases placed by CP-SAT (`--solver cpsat`: the per-layer model of `partition/cpsat.py` over the "
        "expected costs, the greedy placement as its hint, kept only where it lowers the placement's objective) "
        "and simulated the same way. Neither solver sees the routing's variance: both place for the expectation, "
        "not over sampled routings.\n\n" + solver_table(rows) + "\n\n"
        "## A predictor's hit rate on the models at hand\n\n"
        "Pre-gating: block j's router run on the hidden state that entered block j - 1's router, its top-k experts "
        "per token against those block j then routes to (`aviatorc.routing.PreGating`). \"Runtime\": measured by "
        "the sim runtime (`Session.experts`) over 4 generations of 32 tokens at batch 1, which runs and loads only "
        "the experts its tokens are routed to; \"interpreter\": on 4 batches of 2 x 32 tokens "
        "(`aviatorc.routing.measure_prediction`). \"Chance\": a "
        "guess of top-k experts drawn by the block's measured shares. These tiny models have random weights, "
        "which route almost uniformly; a trained model's hidden state and routers differ, so this says the "
        "predictor runs, not what it achieves on a released model.\n\n" + predicted + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=MODELS)
    parser.add_argument("--cards", nargs="+", type=int, default=[4, 8])
    parser.add_argument("--routing", nargs="+", default=["uniform", "zipf:1.2"])
    parser.add_argument("--batch", nargs="+", type=int, default=[1])
    parser.add_argument("--quant", default="mxint4")
    parser.add_argument("--solver", nargs="+", default=["greedy"], choices=["greedy", "cpsat"])
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--add", type=Path, action="append", default=[], metavar="JSON",
                        help="also keep the rows of another run's bench_moe.json (a run in another checkout)")
    args = parser.parse_args(argv)
    store = RESULTS / "bench_moe.json"
    rows = {key(r): r for path in [store, *args.add] if path.exists() for r in json.loads(path.read_text())}
    predicted = prediction_table()
    print(predicted, flush=True)
    if args.add and not args.no_write:  # merged rows are written even when no case runs here
        RESULTS.mkdir(parents=True, exist_ok=True)
        store.write_text(json.dumps(sorted(rows.values(), key=key), indent=1) + "\n")
        (RESULTS / "bench_moe.md").write_text(page(list(rows.values()), predicted))
    for model in sorted(args.models, key=MODELS.index):
        for cards in args.cards:
            for batch in args.batch:
                for routing, how in [(r, h) for r in args.routing for h in args.solver]:
                    row = measure(model, cards, routing, batch, args.quant, how)
                    print(f"{model} x{cards} batch {batch} {routing} {how}: mean {ms(row['mean_s'])}, P99 "
                          f"{ms(row['p99_s'])}, every expert {ms(row['all_experts_s'])}, bound {ms(row['bound_s'])}, "
                          f"{row['expected_resident_share']:.1%} of expected expert bytes resident, "
                          f"compile {row['compile_s']:.0f} s", flush=True)
                    rows[key(row)] = row
                    if not args.no_write:  # after each case: a long run cut short keeps what it measured
                        RESULTS.mkdir(parents=True, exist_ok=True)
                        store.write_text(json.dumps(sorted(rows.values(), key=key), indent=1) + "\n")
                        (RESULTS / "bench_moe.md").write_text(page(list(rows.values()), predicted))
    print(table(list(rows.values())))
    print(solver_table(list(rows.values())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
