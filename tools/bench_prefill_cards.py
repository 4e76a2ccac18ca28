"""Benchmark: the pipelined prefill on several cards against the stationary one, in one run.

On several cards the stationary prefill spreads every layer's weights over all of them, so each
weight node's input crosses from the layer's home card to the others and its output comes back:
at 16 prompts of 128 tokens those activations, not the weights, set the TTFT. The pipelined
prefill (`--prefill pipelined`, `aviatorc/schedule/memory.py`) runs each layer on its home's card
and reads its streamed tiles from a copy in that card's LPDDR; `auto` (the default) takes it
where it estimates that the compiled workload, the prefill and the decode steps up to the
context, takes less time with it (its staging slows each decode step). Per case, from `aviatorc.compile` (shape-only configs, INT4, `corsair`,
context 2048, prompt 128, the figures simulated on the machine model): TTFT and time per token of
the stationary plan and of the default (`auto`) one, the schedule auto took, and the bound; at
batch 1 also the pipelined plan that auto turned down; and the default with `--link-dtype int8`
(activations between chiplets at 8 bits: its accuracy cost is measured in
tests/runtime/test_link_int8.py).

    python tools/bench_prefill_cards.py           # about 15 minutes on 2 cores
    python tools/bench_prefill_cards.py --render  # the page again from its saved JSON

Writes `tools/results/bench_prefill_cards.{json,md}`; `python tools/update_benchmarks.py` puts it in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_plan import CONTEXT, PROMPT, config_path, describe_run, ms, ratio, target_path  # noqa: E402

import aviatorc  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "bench_prefill_cards.md"
CASES = [(model, cards, batch) for model in ("llama-3-70b", "dense-120b") for cards in (4, 8) for batch in (1, 16)]


def compile_case(config: Path, folder: Path, cards: int, batch: int, prefill: str,
                 link_dtype: str = "fp16") -> dict[str, Any]:
    started = time.perf_counter()
    result = aviatorc.compile(str(config), target=target_path(folder, cards), quant="int4", batch=batch,
                              context=CONTEXT, prompt=PROMPT, ranges=False, sweep=False, prefill=prefill,
                              link_dtype=link_dtype)
    p = result.plan.prediction
    return {"schedule": "pipelined" if result.plan.memory.prefill_copies else "stationary",
            "copies": len(result.plan.memory.prefill_copies), "ttft_s": p.ttft_s, "token_s": p.time_per_token_s,
            "ttft_bound_s": p.bound.ttft_s, "token_bound_s": p.bound.token_s, "passes": p.prefill.chunks,
            "compile_s": time.perf_counter() - started}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--render", action="store_true", help="rewrite the page from the saved JSON")
    if parser.parse_args(argv).render:
        RESULTS.write_text(render(json.loads(RESULTS.with_suffix(".json").read_text())))
        return 0
    data: dict[str, Any] = {"rows": [], "run": describe_run()}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for model, cards, batch in CASES:
            config = config_path(model, folder)
            auto = compile_case(config, folder, cards, batch, "auto")
            other = "stationary" if auto["schedule"] == "pipelined" else "pipelined"
            row = {"model": model, "cards": cards, "batch": batch, "auto": auto,
                   other: compile_case(config, folder, cards, batch, other),
                   "auto_int8_links": compile_case(config, folder, cards, batch, "auto", "int8")}
            row.setdefault("stationary", auto)
            row.setdefault("pipelined", auto)
            print(json.dumps(row), flush=True)
            data["rows"].append(row)
    RESULTS.with_suffix(".json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    RESULTS.write_text(render(data))
    print(f"wrote {RESULTS}")
    return 0


def whole_s(case: dict[str, Any]) -> float:
    """The compiled workload's time: the prefill, then the decode steps up to the context."""
    return case["ttft_s"] + (CONTEXT - PROMPT) * case["token_s"]


def render(data: dict[str, Any]) -> str:
    run = data["run"]
    lines = ["## The pipelined prefill on several cards (`tools/bench_prefill_cards.py`)", "",
             f"Run at {run['commit']}{' with uncommitted changes' if run['dirty'] else ''}. Shape-only configs, INT4, "
             f"`corsair`, context {CONTEXT}, prompt {PROMPT}; simulated on the machine model. *Stationary*: every "
             "layer's weights spread over all cards (the prefill before this one); *pipelined*: each layer on its "
             "home's card, its streamed tiles read from a copy in that card's LPDDR; *default*: what `--prefill "
             "auto` took. The pipelined plan stages a card's share of a layer on each chiplet, SRAM the weights "
             "then lack, which the decode step pays for; auto weighs the workload's whole time, *workload s*: the "
             f"TTFT and {CONTEXT - PROMPT} decode steps. *Int8 links*: the default compiled with `--link-dtype int8`.",
             "",
             "| model | cards | batch | default takes | TTFT stationary ms | TTFT pipelined ms | stationary / "
             "pipelined | TTFT bound ms | default within 1.5x of the bound | token stationary ms | token pipelined "
             "ms | workload s stationary | workload s pipelined | tiles copied | TTFT default, int8 links ms | "
             "default / int8 links |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        s, p, a, i = r["stationary"], r["pipelined"], r["auto"], r.get("auto_int8_links")
        lines.append(f"| {r['model']} | {r['cards']} | {r['batch']} | {a['schedule']} | {ms(s['ttft_s'])} | "
                     f"{ms(p['ttft_s'])} | {ratio(s['ttft_s'], p['ttft_s'])} | {ms(a['ttft_bound_s'])} | "
                     f"{'yes' if a['ttft_s'] <= 1.5 * a['ttft_bound_s'] else 'no'} | {ms(s['token_s'])} | "
                     f"{ms(p['token_s'])} | {whole_s(s):.3f} | {whole_s(p):.3f} | {p['copies']:,} | {ms(i['ttft_s']) if i else '-'} | "
                     f"{ratio(a['ttft_s'], i['ttft_s']) if i else '-'} |")
    rows = data["rows"]
    faster = sum(1 for r in rows if r["auto"]["ttft_s"] == min(r["stationary"]["ttft_s"], r["pipelined"]["ttft_s"]))
    sooner = sum(1 for r in rows if whole_s(r["auto"]) == min(whole_s(r["stationary"]), whole_s(r["pipelined"])))
    lines += ["", f"The default took the schedule that serves the workload sooner in {sooner} of {len(rows)} cases, "
              f"the one with the lower TTFT in {faster}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
