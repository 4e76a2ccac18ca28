"""Write docs/op_census.md: every ONNX and ATen op the zoo models produce.

For each zoo architecture it exports the model under every exporter setting we
support, counts ONNX op types and the attribute/arity variants each op is used
with, and counts the ATen ops of ``torch.export`` graphs before and after
``run_decompositions()``. It also measures a shape-only (meta device) export of
Llama-3-8B in a subprocess, so the peak RSS is that export's alone.

This census is what the IR's op set must cover.

Usage: python tools/op_census.py [--out docs/op_census.md] [--arch llama ...]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aviatorc import zoo  # noqa: E402

# (label, exporter, opset, dynamic) for each ONNX column of the census.
SETTINGS: tuple[tuple[str, zoo.Exporter, int, bool], ...] = (
    ("dynamo-18", "dynamo", 18, False),
    ("dynamo-20", "dynamo", 20, False),
    ("dynamo-23", "dynamo", 23, False),
    ("legacy-17", "legacy", 17, False),
    ("dynamo-18-dyn", "dynamo", 18, True),
    ("legacy-17-dyn", "legacy", 17, True),
)
DECODE_LABEL = "decode-dynamo-18"

# The DESIGN's Llama-3-8B config, for the shape-only export measurement.
LLAMA3_8B = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
}

# Hand-written findings from building the zoo; the generator prints them verbatim.
ODDITIES = (
    "The dynamo exporter silently writes opset 18 when asked for 17; "
    "`zoo.export_onnx` refuses dynamo opsets below 18.",
    "Static exports bake the sequence length into the causal mask and rotary tables: "
    "the static dynamo graphs have no Range/Cos/Sin (constant-folded into initializers); "
    "dynamic-shape and decode graphs compute them (Range, Cos, Sin, comparisons, Squeeze).",
    "Legacy (TorchScript) exports keep `Constant` nodes (dozens to hundreds) and "
    "Shape/Gather/Unsqueeze/Concat shape arithmetic, even in static exports; "
    "the dynamo exporter folds them into initializers.",
    "Legacy export on Llama-family models needs an explicit `attention_mask` "
    "(otherwise `aten::diff` fails); the zoo always passes one, for every arch.",
    "With zero biases the dynamo optimizer deletes the bias additions; "
    "`zoo.build_model` perturbs every parameter (std 0.02, seeded) so they stay.",
    "With dynamo=True an output named like an internal value (e.g. `embedding`) silently "
    "yields an invalid file (a value defined twice): the zoo names outputs `logits` / "
    "`hidden` and runs `onnx.checker.check_model(full_check=True)` on every file.",
    "Opset 23 (dynamo) emits `RMSNormalization` for Llama-family norms, but no `Attention` "
    "op: attention stays MatMul/Softmax with eager attention (`attn_implementation='eager'`).",
    "Opset 20+ (dynamo) emits `Gelu` for BERT's erf-GELU; opset 18 writes Div/Erf/Add/Mul. "
    "GPT-2's tanh-GELU stays Pow/Tanh/Mul/Add at every opset.",
    "GPT-2 (HF Conv1D) and OPT linear layers export as `Gemm` on 2-D reshaped activations "
    "(Reshape before and after); other linears are `MatMul` against an [in, out] initializer "
    "(weights stored transposed, parameter names lost).",
    "Q/K/V: three MatMuls sharing an input (Llama, Mistral, Qwen2, OPT, BERT); one MatMul "
    "then Slices (Phi-3 qkv_proj; its gate_up_proj is MatMul then Split); Gemm then Split "
    "(GPT-2 c_attn).",
    "Grouped-query attention (4 heads / 2 kv heads) shows up as Unsqueeze/Expand/Reshape "
    "of K and V (`repeat_kv`), not as a dedicated op.",
    "transformers 5 renamed the cache kwarg to `cache` (`past_key_values` still works but "
    "warns); the decode wrapper rebuilds a `DynamicCache` from flat tensors and returns "
    "`cache.layers[i].keys/values`.",
    "torch.export needs `dynamic_shapes` to mirror the argument structure exactly: for "
    "`forward(ids, mask, *past)` it is `({}, {1: past + 1}, tuple(...))` (a tuple, not a list); "
    "`Dim` min must be >= 2 because sizes 0 and 1 are specialized.",
    "Attributes that differ by exporter (see the variants section): Split is `num_outputs` "
    "(dynamo, opset 18+) vs a `split` sizes input (legacy); Reshape carries `allowzero=1`, "
    "`allowzero=0` or nothing; Gemm has `transB=1` (OPT, transposed weight) or `transB=0` "
    "(GPT-2 Conv1D), and legacy omits default attributes (transA); ReduceMean takes axes as "
    "an input in dynamo (opset 18) and as an attribute in legacy (opset 17); Shape gets "
    "`start`/`end` in dynamo dynamic graphs; Softmax is always `axis=-1`; LayerNormalization "
    "and RMSNormalization are always `axis=-1` (`stash_type=1` from dynamo); Slice comes with "
    "4 or 5 inputs; Gelu is `approximate=none`. No Trilu anywhere: causal masks are built from "
    "Range/LessOrEqual/And/Where (dynamic) or folded into initializers (static).",
    "Static BERT dynamo exports print `Evaluation failed: cannot reshape array of size 1 into "
    "shape (1,8)` twice: the onnxscript optimizer's constant folding gives up on a node; "
    "harmless (the file checks and matches eager torch).",
    "Dynamic dynamo exports warn `axis name: seq will not be used, since it shares the same "
    "shape constraints with another axis`: input_ids and attention_mask share `Dim('seq')`; "
    "the ONNX dim is named `seq` anyway.",
    "`torch.export` graphs contain `aten._assert_tensor_metadata` nodes (val None) and, for "
    "the meta-device Llama-3-8B, the `use_cache` placeholder (val bool): every other node "
    "has a FakeTensor `meta['val']` with its shape.",
    "The zoo sets eager attention on the config (`cfg._attn_implementation = 'eager'`), so "
    "attention is plain matmul/softmax in both ATen and ONNX (SDPA exports were not tried).",
    "onnxruntime matches eager torch within 1.2e-6 on every export here (tests/test_zoo.py).",
)


@dataclass
class OnnxCensus:
    """Op counts and attribute/arity variants of one ONNX file."""

    opset: int
    ops: collections.Counter[str]
    # op type -> set of variant strings such as "inputs=2 axis=-1".
    variants: dict[str, set[str]] = field(default_factory=dict)
    functions: int = 0


def _attr_text(attr: Any) -> str:
    import onnx
    from onnx import helper

    if attr.type == onnx.AttributeProto.TENSOR:
        t = attr.t
        dtype = helper.tensor_dtype_to_np_dtype(t.data_type).name
        return f"{attr.name}=<{dtype}{list(t.dims)}>"
    if attr.type == onnx.AttributeProto.GRAPH:
        return f"{attr.name}=<graph>"
    value = helper.get_attribute_value(attr)
    if isinstance(value, bytes):
        value = value.decode()
    if attr.name == "to":  # Cast target: name the dtype, not its enum number
        value = helper.tensor_dtype_to_np_dtype(value).name
    return f"{attr.name}={value}"


def _node_variant(node: Any) -> str:
    # Arity matters: Split with a `split` input vs num_outputs, Slice with axes/steps.
    inputs = ",".join("x" if name else "_" for name in node.input)
    parts = [f"in({inputs})", f"out={len(node.output)}"]
    parts += sorted(_attr_text(a) for a in node.attribute)
    return " ".join(parts)


def census_onnx(path: Path) -> OnnxCensus:
    """Count op types (and variants) in ``path``, including local functions."""
    import onnx

    model = onnx.load(str(path))
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    ops: collections.Counter[str] = collections.Counter()
    variants: dict[str, set[str]] = collections.defaultdict(set)
    nodes = list(model.graph.node) + [n for f in model.functions for n in f.node]
    for node in nodes:
        op = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
        ops[op] += 1
        variants[op].add(_node_variant(node))
    return OnnxCensus(opset, ops, dict(variants), len(model.functions))


def census_aten(arch: str) -> tuple[collections.Counter[str], collections.Counter[str]]:
    """ATen op counts of torch.export of ``arch``: (as exported, after run_decompositions)."""
    import torch

    model = zoo.build_model(arch)
    kwargs = zoo.example_inputs(arch)
    program = torch.export.export(model, (), kwargs, strict=False)
    raw = _count_targets(program.graph_module.graph)
    decomposed = _count_targets(program.run_decompositions().graph_module.graph)
    return raw, decomposed


def _count_targets(graph: Any) -> collections.Counter[str]:
    return collections.Counter(str(n.target) for n in graph.nodes if n.op == "call_function")


def llama3_8b_probe() -> dict[str, Any]:
    """Shape-only torch.export of Llama-3-8B on the meta device (run in a fresh process)."""
    import resource

    import torch
    import transformers as tf

    start = time.perf_counter()
    cfg = tf.LlamaConfig(**LLAMA3_8B)
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(cfg)
    built_s = time.perf_counter() - start
    ids = torch.zeros(1, 8, dtype=torch.int64, device="meta")
    program = torch.export.export(model, (), {"input_ids": ids, "use_cache": False}, strict=False)
    export_s = time.perf_counter() - start - built_s
    from torch._subclasses.fake_tensor import FakeTensor

    nodes = list(program.graph.nodes)
    missing: collections.Counter[str] = collections.Counter()
    for node in nodes:
        val = node.meta.get("val")
        vals = val if isinstance(val, (list, tuple)) else [val]
        if node.op == "output":
            continue
        if not vals or not all(isinstance(v, FakeTensor) for v in vals):
            missing[f"{node.op} {node.target} (val is {type(val).__name__})"] += 1
    out_val = program.graph.output_node().args[0][0].meta["val"]
    return {
        "build_s": round(built_s, 2),
        "export_s": round(export_s, 2),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "nodes": len(nodes),
        "call_function_nodes": sum(n.op == "call_function" for n in nodes),
        "placeholders": sum(n.op == "placeholder" for n in nodes),
        "nodes_without_fake_tensor_val": sum(missing.values()),
        "which_nodes_lack_fake_tensor_val": dict(sorted(missing.items())),
        "output_shape": list(out_val.shape),
        "output_device": str(out_val.device),
    }


def _run_probe() -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--llama8b-probe"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _quiet() -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    return stack


def _fmt_counts(counts: collections.Counter[str]) -> str:
    return ", ".join(f"{op} {n}" for op, n in sorted(counts.items()))


def _render(
    archs: list[str],
    onnx_results: dict[tuple[str, str], OnnxCensus | str],
    aten_results: dict[str, tuple[collections.Counter[str], collections.Counter[str]] | str],
    probe: dict[str, Any] | str,
    elapsed_s: float,
) -> str:
    import onnx
    import torch
    import transformers

    labels = [s[0] for s in SETTINGS] + [DECODE_LABEL]
    lines = [
        "# Op census of the zoo models",
        "",
        "Generated by `python tools/op_census.py` (do not edit by hand). "
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"onnx {onnx.__version__}; took {elapsed_s:.0f} s.",
        "",
        "Models: `aviatorc.zoo` (hidden 32, 2 layers, 4 heads, 2 kv heads for the "
        "Llama family, vocab 128, seq 8, eager attention, every parameter perturbed). "
        "Settings: `dynamo-N` = `torch.onnx.export(dynamo=True, opset_version=N)`; "
        "`legacy-17` = `dynamo=False, opset_version=17`; `-dyn` = dynamic batch and seq axes; "
        f"`{DECODE_LABEL}` = `zoo.export_decode_onnx` (one token, dynamic past length KV cache).",
        "",
        "## ONNX op union",
        "",
        "Cell: number of archs whose graph has the op under that setting.",
        "",
        "| op | " + " | ".join(labels) + " | archs |",
        "|---|" + "---|" * (len(labels) + 1),
    ]
    union: dict[str, dict[str, int]] = collections.defaultdict(lambda: collections.Counter())
    op_archs: dict[str, set[str]] = collections.defaultdict(set)
    for (arch, label), res in onnx_results.items():
        if isinstance(res, OnnxCensus):
            for op in res.ops:
                union[op][label] += 1
                op_archs[op].add(arch)
    for op in sorted(union):
        cells = [str(union[op][lb]) if union[op][lb] else "-" for lb in labels]
        lines.append(f"| {op} | " + " | ".join(cells) + f" | {', '.join(sorted(op_archs[op]))} |")
    lines += ["", f"Union ({len(union)} ops): " + ", ".join(sorted(union)), ""]

    lines += [
        "## ONNX attribute and arity variants",
        "",
        "`in(x,_,x)`: inputs given (`x`) or empty (`_`); `out=N`: outputs; then attributes. "
        "Tensor attributes show dtype and shape. Settings where each variant appears follow it.",
        "",
    ]
    variant_where: dict[str, dict[str, set[str]]] = collections.defaultdict(lambda: collections.defaultdict(set))
    for (_arch, label), res in onnx_results.items():
        if isinstance(res, OnnxCensus):
            for op, vs in res.variants.items():
                for v in vs:
                    variant_where[op][v].add(label)
    for op in sorted(variant_where):
        lines.append(f"- **{op}**")
        for v in sorted(variant_where[op]):
            where = ", ".join(lb for lb in labels if lb in variant_where[op][v])
            lines.append(f"  - `{v}` ({where})")
    lines.append("")

    lines += ["## ONNX ops per architecture", ""]
    for arch in archs:
        lines += [f"### {arch}", ""]
        for label in labels:
            res = onnx_results.get((arch, label))
            if res is None:
                continue
            if isinstance(res, str):
                lines.append(f"- {label}: FAILED: {res}")
                continue
            total = sum(res.ops.values())
            fn = f", {res.functions} local functions" if res.functions else ""
            lines.append(f"- {label} (opset {res.opset}, {total} nodes{fn}): {_fmt_counts(res.ops)}")
        lines.append("")

    lines += [
        "## ATen ops (torch.export, strict=False)",
        "",
        "`node.target` of call_function nodes; counts. *Exported* is the graph "
        "`torch.export.export` returns (pre-dispatch ATen); *decomposed* is after "
        "`run_decompositions()` (core ATen).",
        "",
    ]
    aten_union: dict[str, set[str]] = collections.defaultdict(set)
    for arch in archs:
        res = aten_results[arch]
        lines += [f"### {arch}", ""]
        if isinstance(res, str):
            lines += [f"FAILED: {res}", ""]
            continue
        raw, dec = res
        for op in raw:
            aten_union[op].add("exported")
        for op in dec:
            aten_union[op].add("decomposed")
        lines.append(f"- exported ({sum(raw.values())}): {_fmt_counts(raw)}")
        lines.append(f"- decomposed ({sum(dec.values())}): {_fmt_counts(dec)}")
        lines.append("")
    lines += ["### ATen union", ""]
    for kind in ("exported", "decomposed"):
        ops = sorted(op for op, kinds in aten_union.items() if kind in kinds)
        lines.append(f"- {kind} ({len(ops)}): " + ", ".join(ops))
    lines.append("")

    lines += [
        "## Llama-3-8B shape-only export (meta device)",
        "",
        "`with torch.device('meta'): AutoModelForCausalLM.from_config(cfg)`, then "
        "`torch.export.export(model, (), {'input_ids': meta_ids [1, 8], 'use_cache': False}, "
        "strict=False)`, in a fresh process (peak RSS includes importing torch). "
        f"Config: `{json.dumps(LLAMA3_8B)}`.",
        "",
    ]
    if isinstance(probe, str):
        lines.append(f"FAILED: {probe}")
    else:
        for key, value in probe.items():
            lines.append(f"- {key}: {value}")
    lines += ["", "## Oddities and workarounds", ""]
    lines += [f"- {note}" for note in ODDITIES]
    for (arch, label), res in sorted(onnx_results.items()):
        if isinstance(res, str):
            lines.append(f"- {arch} {label} failed: {res}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/op_census.md"))
    parser.add_argument("--arch", nargs="*", default=list(zoo.ZOO_ARCHS), choices=zoo.ZOO_ARCHS)
    parser.add_argument("--skip-8b", action="store_true", help="skip the Llama-3-8B probe")
    parser.add_argument("--llama8b-probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.llama8b_probe:
        with _quiet():
            result = llama3_8b_probe()
        print(json.dumps(result))
        return 0

    start = time.perf_counter()
    onnx_results: dict[tuple[str, str], OnnxCensus | str] = {}
    aten_results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.arch:
            for label, exporter, opset, dynamic in SETTINGS:
                path = Path(tmp) / f"{arch}-{label}.onnx"
                try:
                    with _quiet():
                        zoo.export_onnx(arch, path, exporter=exporter, opset=opset, dynamic=dynamic)
                    onnx_results[(arch, label)] = census_onnx(path)
                except Exception as exc:  # the census records failures instead of stopping
                    onnx_results[(arch, label)] = f"{type(exc).__name__}: {str(exc)[:200]}"
            if arch in zoo.DECODE_ARCHS:
                path = Path(tmp) / f"{arch}-decode.onnx"
                try:
                    with _quiet():
                        zoo.export_decode_onnx(arch, path)
                    onnx_results[(arch, DECODE_LABEL)] = census_onnx(path)
                except Exception as exc:
                    onnx_results[(arch, DECODE_LABEL)] = f"{type(exc).__name__}: {str(exc)[:200]}"
            try:
                with _quiet():
                    aten_results[arch] = census_aten(arch)
            except Exception as exc:
                aten_results[arch] = f"{type(exc).__name__}: {str(exc)[:200]}"
            print(f"{arch}: done at {time.perf_counter() - start:.0f} s", file=sys.stderr)
    probe: dict[str, Any] | str = "skipped (--skip-8b)"
    if not args.skip_8b:
        try:
            probe = _run_probe()
        except subprocess.CalledProcessError as exc:
            probe = f"probe process failed: {exc.stderr[-300:]}"
    text = _render(args.arch, onnx_results, aten_results, probe, time.perf_counter() - start)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
