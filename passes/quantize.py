"""quantize: linear weights to INT8 / INT4 / MXINT8 / MXINT4; embeddings and chosen layers to FP16.

What it rewrites:
- `MatMul(x, W)` with W a float [K, N] initializer (or the fp32 2:4 `DequantizeWeight` that
  `sparsify-2to4` leaves) becomes `MatMul(x, DequantizeWeight(values, scale, zero?, indices?))`
  whose inputs are the packed bytes exactly as stored (layouts in `aviatorc.quant.rtn`); a 2:4
  weight keeps its pattern and only its kept values are quantized.
- INT8 is symmetric, per output channel by default or group-wise along K with a `group_size`
  (32/64/128, fp16 scales). INT4 is group-wise along K (`group_size` 32/64/128,
  symmetric or asymmetric, fp16 scales, two codes per byte); MX formats share a power-of-two
  exponent per block of `group_size` (32 by default). A ragged last group along K is padded.
- Method: round-to-nearest, or GPTQ (Hessian from calibration activations; the default for
  4-bit formats when calibration data is given); under 2:4 GPTQ keeps the pattern.
  Calibration is sequential: weights are quantized stage by stage (`calibration_stages`:
  the MatMuls reading one activation form a stage), each stage's Hessians taken from the
  graph with every earlier stage already quantized. Each stage evaluates only the nodes
  between the previous stage and its own MatMuls (`aviatorc.quant.sequential`), so the
  calibration batches go through the graph about once. GPTQ is given the weight that best
  reproduces the *unquantized* graph's output from those inputs
  (`aviatorc.quant.refit.corrected_target`; the unquantized graph is kept and run beside,
  also once), so each layer also makes up for the error of the layers before it.
  Padding is not calibration data: with an `attention_mask` input only real tokens' rows
  enter the statistics (the pass's stats say how many: `calibration_tokens`).
- AWQ (`quant_method="awq"`, `aviatorc.quant.awq`): per input channel scales s searched per
  activation from its mean |x| and the Hessian, the weights stored as diag(s) W by
  round-to-nearest, and the MatMuls made to read x / s: folded into the norm that feeds only
  them, else a `Mul` by a [K] constant (`aviatorc.passes._awq`). Exact before rounding.
- Weights matching `keep_fp16` (fnmatch on the weight or the MatMul name, e.g. `*lm_head*`,
  `*attention.output*`) become `DequantizeWeight` in fp16, and so do the routers' weights of a
  mixture of experts (`aviatorc.ir.experts.router_matmuls`: a changed routing sends a token to
  other experts). Each expert's projections are quantized on their own, calibrated on the tokens
  routed to that expert (`calibrate_sequentially`'s `routed`); an expert no calibration token
  reaches is quantized by RTN, and the stats (`experts`: per expert weight, its tokens and
  method) and a note say so. Embedding tables read only by
  `Gather` become float16 initializers, with a `Cast` to float32 after the `Gather`.
- With `activations` ("minmax" / "percentile", W8A8 with int8 weights) a `QuantizeActivation`
  (8-bit, per tensor, range from calibration) goes in front of each quantized MatMul.
- Shape-only weights get shape-only packed initializers of the exact stored sizes, so a
  70B model can be planned in its quantized bytes without loading anything.

Where it goes: after fusions (one fused QKV matrix gets one set of scales) and after
`sparsify-2to4`; cleanup (dce) after it drops what it replaced.
Does not handle: weights read by anything but MatMul input 1 (a transposed tied lm_head
stays float and is noted), Gemm (the importer lowers it to MatMul), convolutions, int4 with
`activations` (W4A8 is not modelled), AWQ with `activations` (the scaled activations' ranges
are not the ones calibrated), and folding AWQ's scales into a preceding linear (a Mul is used).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from aviatorc.passes._awq import awq_stage
from aviatorc.passes._weights import (
    LinearWeight,
    add_packed_weight,
    find_linear_weights,
    rewrite_by_stage,
    target_formats,
    target_name,
    tile_depth,
)
from aviatorc.passes.manager import Note, Pass, PassContext, PassResult, register_pass

from aviatorc.errors import OptionError
from aviatorc.formats import WeightFormat
from aviatorc.ir import ArrayData, Graph, ShapeOnly, TensorType, add_value
from aviatorc.ir.experts import ExpertRef, expert_nodes, router_matmuls
from aviatorc.options import CompileOptions
from aviatorc.quant.calibration import ActivationStats, check_batches
from aviatorc.quant.gptq import GPTQConfig, gptq_pack
from aviatorc.quant.refit import corrected_target
from aviatorc.quant.rtn import pack_weight

FOUR_BIT = ("int4", "mxint4")
CALIBRATED = ("gptq", "awq", "awq-gptq")  # methods that need the calibration Hessians


SIXTEEN_BIT = ("fp16", "bf16")  # plain 16-bit storage: what a target without fp32 holds unquantized


def weight_format(options: CompileOptions, sparsity: str = "") -> WeightFormat:
    """The format `options` ask for: the one place options become a `WeightFormat` (fuse-qkv's size
    estimate asks it too). int8 and mx are symmetric; int8 is per output channel unless a group
    size is given (`CompileOptions.weight_group_size`); int4's zero points: `int4_zero`."""
    kind = options.quant
    assert kind is not None  # callers quantize only when asked to
    if kind in SIXTEEN_BIT:
        return WeightFormat(kind, 0, True, sparsity)
    if kind != "int4":
        return WeightFormat(kind, options.weight_group_size, True, sparsity)
    symmetric, zero = int4_zero(options, sparsity)
    return WeightFormat(kind, options.weight_group_size, symmetric, sparsity, zero)


def int4_zero(options: CompileOptions, sparsity: str = "") -> tuple[bool, str]:
    """(symmetric, zero kind) of int4 weights: as asked (`symmetric`), else asymmetric with an fp16
    offset per group (llama.cpp's Q4_1 layout, 5 bits a weight at g32), with or without data.

    Without calibration data the scale and offset are fit by `aviatorc.quant.rtn.offset_params`;
    with it, GPTQ fits the codes on that grid. Measured on SmolLM2-135M from its GGUF against the
    FP16 plan (tools/bench_int4_default.py, BENCHMARKS.md, "INT4 without calibration data"): plain
    round-to-nearest lost the greedy answer of every prompt and +40% perplexity; GPTQ with 4-bit
    zero points, calibrated on 364 tokens of other text, +10.9% (a 4-bit zero point cannot hold a
    Q4_1 file's offsets, so a GGUF Q4_1 model re-rounds onto a coarser grid with one); see the page
    for the fp16 offsets' figures (+0.0% with or without the text). Held out on all-MiniLM-L6-v2
    (tools/bench_defaults.py, 40 sentences calibrating, 40 others evaluated) GPTQ reached a mean /
    worst cosine of 0.99458 / 0.99199 with fp16 offsets against 0.99337 / 0.98880 with 4-bit zero
    points and 0.99158 / 0.98727 symmetric. 2:4 sparse stays symmetric (a pruned weight must read back
    0, which an offset would move). `symmetric=False` (`--asymmetric`) asks for 4-bit zero points
    (4.625 bits a weight at g32)."""
    if options.symmetric is not None:
        return options.symmetric, "int"
    if sparsity:
        return True, "int"
    return False, "fp16"


def output_head_format(options: CompileOptions, target: Any) -> WeightFormat | None:
    """The format of the output head (`is_output_head`) beside data-free int4 (`int4_zero`'s fp16
    offsets): int8 with int4's groups, as llama.cpp's own 4-bit files keep it (SmolLM2's Q4_1 GGUF
    stores its tied head as Q8_0, blocks of 32: this layout holds it exactly). The head turns the last
    hidden state into every token's score, so its error decides the greedy answer more than any
    other layer's; measured on SmolLM2-135M (tools/bench_int4_default.py). None where the target
    stores no int8."""
    formats = target_formats(target) if target is not None else None
    if formats is not None and "int8" not in formats:
        return None
    return WeightFormat("int8", options.weight_group_size, True)


def is_output_head(graph: Graph, lw: LinearWeight) -> bool:
    """Whether one of `lw`'s MatMuls produces a graph output (the logits of a language model, a
    classifier's scores), through nothing but reshapes and casts."""
    outputs = {id(v) for v in graph.outputs}
    for mm in lw.matmuls:
        value = mm.outputs[0]
        while id(value) not in outputs and len(value.users) == 1 and value.users[0].op in ("Reshape", "Cast", "Identity"):
            value = value.users[0].outputs[0]
        if id(value) in outputs:
            return True
    return False


def quant_method(options: Any, has_calibration: bool) -> str:
    if options.quant_method is not None:
        return options.quant_method
    return "gptq" if options.quant in FOUR_BIT and has_calibration else "rtn"


def gptq_damp(tokens: int, k: int) -> float:
    """GPTQ's damping (fraction of the mean Hessian diagonal) for `tokens` calibration rows of width k.

    0.3 whatever the tokens: measured held out (tools/bench_defaults.py, INT4 g32 asym GPTQ) it
    was the best damping tried on all-MiniLM-L6-v2 at both amounts of text and near the best on
    SmolLM2. MiniLM, mean / worst cosine of 40 sentences never calibrated on: on 616 real tokens
    0.3 0.99336 / 0.98769, the rule before (0.1 below k tokens, else 0.03) 0.99248 / 0.98616,
    0.1 0.99292, 1.0 0.99275, 0.01 0.99062; on 2,865 tokens 0.3 0.99366 / 0.99105 against
    0.99321 / 0.99037. SmolLM2-135M (2,222 tokens, K = 576 and 1536) perplexity vs fp32: +10.8%
    with 0.3, +10.3% with the rule before (0.03 for all its layers), and +14.4% with 0.3 only where
    there were fewer than 2k tokens (its K = 1536 down projections): a rule by tokens per channel
    did worse than either constant there, so none is used."""
    return 0.3


def gptq_config(tokens: int, k: int) -> GPTQConfig:
    """The GPTQ setup for a weight of width k calibrated on `tokens` rows."""
    return GPTQConfig(damp=gptq_damp(tokens, k))


def check_quant_options(options: Any, target: Any, has_calibration: bool) -> None:
    """OptionErrors for requests the target or the data cannot satisfy."""
    formats = target_formats(target) if target is not None else None
    if options.quant and formats is not None and options.quant not in formats:
        raise OptionError(f"target '{target_name(target)}' does not support {options.quant} weights",
                          hint=f"it supports {', '.join(formats)}")
    depth = tile_depth(target) if target is not None else None
    # A group must not straddle a tile boundary: it divides the matrix-unit depth, or spans whole tiles.
    group = options.weight_group_size  # 0: per output channel (int8), nothing to straddle
    if group and depth is not None and depth % group and group % depth:
        raise OptionError(f"group size {group} does not align with the matrix-unit depth {depth} "
                          f"of target '{target_name(target)}'",
                          hint="choose a group size that divides it or is a multiple of it, "
                               "so no group straddles two tiles")
    method = quant_method(options, has_calibration)
    if method in CALIBRATED and not has_calibration:
        raise OptionError(f"quantization method '{method}' needs calibration data",
                          hint="pass calibration= (Python) or --calibration FILE.npz (CLI), or use rtn")
    if method.startswith("awq") and options.activations is not None:
        raise OptionError("AWQ scales the activations the W8A8 ranges would be taken from",
                          hint="drop --activations, or use --quant-method gptq or rtn")
    if options.activations is not None:
        if options.quant != "int8":
            raise OptionError(f"activation quantization (W8A8) needs int8 weights, not {options.quant}",
                              hint="use --quant int8 or drop --activations")
        if not has_calibration:
            raise OptionError(f"activation ranges ('{options.activations}') need calibration data",
                              hint="pass calibration= (Python) or --calibration FILE.npz (CLI)")


@register_pass
class Quantize(Pass):
    name = "quantize"
    summary = "weights to int8 / int4 / mxint8 / mxint4 (RTN or GPTQ); embeddings and chosen layers to fp16"
    exact = False

    def requires(self, graph: Graph, ctx: PassContext) -> None:
        if ctx.options.quant is None:
            return
        batches = check_batches(graph, ctx.calibration)
        check_quant_options(ctx.options, ctx.target, bool(batches))

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        opts = ctx.options
        if opts.quant is None:
            return PassResult(False, notes=[Note(graph.name, "no quantization requested")])
        weights, notes = find_linear_weights(graph)
        batches = check_batches(graph, ctx.calibration)
        method = quant_method(opts, bool(batches))
        routers = set(router_matmuls(graph))
        experts = expert_nodes(graph)
        keep = [lw for lw in weights if opts.quant in SIXTEEN_BIT or opts.keep_fp16 and lw.matches(opts.keep_fp16)
                or any(mm in routers for mm in lw.matmuls)]
        quantize = [lw for lw in weights if lw not in keep]
        per_expert: dict[str, dict[str, Any]] = {}

        counts = {"weights_quantized": 0, "weights_kept_fp16": 0, "embeddings_fp16": 0, "activations_quantized": 0,
                  "output_heads_int8": 0,
                  "routers_kept_fp16": sum(1 for lw in keep if any(mm in routers for mm in lw.matmuls))}
        # A graph of one linear layer has no head apart from its body: it stays int4.
        head_format = output_head_format(opts, ctx.target) if len(quantize) > 1 else None
        bytes_before = bytes_after = 0
        # GPTQ fits each weight to the unquantized graph's output (`corrected_target`): keep it.
        reference = graph.clone() if method in CALIBRATED and any(lw.has_data for lw in quantize) else None
        with graph.batched_inserts():
            for lw in keep:
                fmt = WeightFormat(opts.quant if opts.quant in SIXTEEN_BIT else "fp16", 0, True, lw.fmt.sparsity)
                bytes_before += lw.fmt.storage_bytes(lw.k, lw.n)
                packed = pack_weight(lw.dense(), fmt, mask=lw.mask()) if lw.has_data else None
                add_packed_weight(graph, lw, fmt, packed)
                bytes_after += fmt.storage_bytes(lw.k, lw.n)
                counts["weights_kept_fp16"] += 1

        def format_of(lw: LinearWeight) -> WeightFormat:
            fmt = weight_format(opts, lw.fmt.sparsity)
            if fmt.float_zero and head_format is not None and is_output_head(graph, lw):
                return head_format
            return fmt

        def rewrite(stage: list[LinearWeight], stats: dict[str, ActivationStats]) -> None:
            with graph.batched_inserts():  # thousands of weights (a mixture of experts): one pass
                rewrite_stage(stage, stats)

        def rewrite_stage(stage: list[LinearWeight], stats: dict[str, ActivationStats]) -> None:
            nonlocal bytes_before, bytes_after
            # AWQ: one scale search per activation, the graph's MatMuls then read x / s (`_awq`).
            scaled = (awq_stage(graph, stage, stats, format_of, gptq=gptq_config if method == "awq-gptq" else None)
                      if method.startswith("awq") else {})
            for lw in stage:
                fmt = format_of(lw)
                counts["output_heads_int8"] += fmt == head_format
                bytes_before += lw.fmt.storage_bytes(lw.k, lw.n)
                matmuls = list(lw.matmuls)
                packed = scaled.get(id(lw)) or (self._quantize_one(lw, fmt, method, stats, ctx) if lw.has_data else None)
                ref = next((experts[mm] for mm in matmuls if mm in experts), None)
                if ref is not None:
                    per_expert[lw.name] = _expert_record(lw, ref, stats, method, bool(stats), fmt, notes)
                add_packed_weight(graph, lw, fmt, packed)
                bytes_after += fmt.storage_bytes(lw.k, lw.n)
                counts["weights_quantized"] += 1
                if opts.activations:
                    for mm in matmuls:
                        x = mm.input(0)
                        if x.name in stats:
                            self._quantize_activation(graph, mm, stats[x.name], opts.activations)
                            counts["activations_quantized"] += 1

        # Sequential calibration: each stage's statistics come from the graph with every
        # earlier stage already quantized (see `rewrite_by_stage`).
        run = rewrite_by_stage(graph, ctx, quantize, rewrite, calibrate=bool(method in CALIBRATED or opts.activations),
                               hessian=method in CALIBRATED, reference=reference, label=self.name)
        embed_before, embed_after = embeddings_to_fp16(graph, notes)
        counts["embeddings_fp16"] = len(embed_before)
        changed = any(counts.values())
        result_stats: dict[str, Any] = dict(counts, format=weight_format(opts).name, method=method,
                                            weight_bytes_before=bytes_before + sum(embed_before),
                                            weight_bytes_after=bytes_after + sum(embed_after))
        if run is not None:  # how much calibration text the statistics really saw (padding left out)
            result_stats.update(calibration_tokens=run.tokens, calibration_padding_excluded=run.padding)
        if per_expert:
            result_stats.update(experts=dict(sorted(per_expert.items())),
                                experts_calibrated=sum(1 for r in per_expert.values() if r["method"] != "rtn"
                                                       and r["calibration_tokens"]),
                                experts_rtn_unrouted=sum(1 for r in per_expert.values() if r["unrouted"]))
        return PassResult(changed, result_stats, notes)

    def _quantize_one(self, lw: LinearWeight, fmt: WeightFormat, method: str,
                      stats: dict[str, ActivationStats], ctx: PassContext):
        w, mask = lw.dense(), lw.mask()
        if method == "gptq":
            hessian = cross = None
            tokens = 0
            for mm in lw.matmuls:  # a shared weight: its inputs' Hessians add up
                s = stats.get(mm.input(0).name)
                if s is not None and s.hessian is not None:
                    hessian = s.hessian if hessian is None else hessian + s.hessian
                    if s.cross is not None:
                        cross = s.cross if cross is None else cross + s.cross
                    tokens += s.tokens
            if hessian is not None:
                target = corrected_target(w, hessian, cross) if cross is not None else w
                return gptq_pack(target, hessian, fmt, mask=mask, config=gptq_config(tokens, lw.k))
        return pack_weight(w, fmt, mask=mask)

    def _quantize_activation(self, graph: Graph, mm: Any, stat: ActivationStats, method: str) -> None:
        lo, hi = stat.range(method)
        lo, hi = min(lo, 0.0), max(hi, 0.0)  # zero stays exact (padding, ReLU outputs)
        scale = max((hi - lo) / 255.0, 1e-12)
        zero_point = int(np.clip(np.round(-lo / scale) - 128, -128, 127))
        q = add_value(graph, "QuantizeActivation", [mm.input(0)],
                      {"scale": float(scale), "zero_point": zero_point, "qmin": -128, "qmax": 127},
                      name=graph.unique_name(f"{mm.name}.act_quant"), before=mm)
        mm.set_input(0, q)


def _expert_record(lw: LinearWeight, ref: ExpertRef, stats: dict[str, ActivationStats], method: str,
                   calibrating: bool, fmt: WeightFormat, notes: list[Note]) -> dict[str, Any]:
    """How an expert's weight was quantized: its block and index, the calibration tokens routed to
    it, and the method; a calibrated method finding no token routed there fell back to RTN (noted)."""
    tokens = sum(stats[mm.input(0).name].tokens for mm in lw.matmuls if mm.input(0).name in stats)
    unrouted = calibrating and method in CALIBRATED and tokens == 0
    if unrouted:
        notes.append(Note(lw.matmuls[0].name, f"no calibration token was routed to expert {ref.expert} of "
                          f"'{ref.block}': its weight '{lw.name}' was quantized by RTN, not {method}"))
    return {"block": ref.block, "expert": ref.expert, "format": fmt.name, "calibration_tokens": tokens,
            "method": "rtn" if unrouted or not calibrating else method, "unrouted": unrouted}


def embeddings_to_fp16(graph: Graph, notes: list[Note]) -> tuple[list[int], list[int]]:
    """Float32 tables read only by Gather (axis 0, as data) -> float16 + Cast after each Gather.

    Returns the bytes of each table before and after."""
    before, after = [], []
    for value in list(graph.initializers.values()):
        gathers = [u for u in value.users if u.op == "Gather"]
        if not gathers or value.type.dtype != "float32" or value.type.rank != 2:
            continue
        if len(gathers) != len(value.users) or any(g.inputs[0] is not value or g.attrs.get("axis", 0) != 0
                                                   for g in gathers):
            other = next((u for u in value.users if u not in gathers or u.inputs[0] is not value
                          or u.attrs.get("axis", 0) != 0), value.users[0])
            notes.append(Note(other.name, f"embedding table '{value.name}' is also read by {other.op}: left in fp32"))
            continue
        type16 = TensorType("float16", value.type.shape)
        data = ArrayData(value.data.load().astype(np.float16)) if value.data.available else ShapeOnly("fp16 table")  # type: ignore[union-attr]
        table16 = graph.add_initializer(graph.unique_name(f"{value.name}.fp16"), type16, data)
        for gather in gathers:
            out = gather.outputs[0]
            new_gather = add_value(graph, "Gather", [table16, gather.input(1)], dict(gather.attrs),
                                   name=graph.unique_name(f"{gather.name}.fp16"), before=gather)
            _redirect(graph, out, new_gather)
            graph.remove_node(gather)
            # The Cast takes the old output's name: graph outputs keep their names.
            assert new_gather.producer is not None
            position = graph.nodes.index(new_gather.producer) + 1
            after_node = graph.nodes[position] if position < len(graph.nodes) else None
            cast = add_value(graph, "Cast", [new_gather], {"to": "float32"}, name=graph.unique_name(f"{gather.name}.cast"),
                             output_names=[out.name], before=after_node)
            _redirect(graph, new_gather, cast, skip=cast.producer)
        graph.remove_initializer(value)
        before.append(value.type.nbytes())
        after.append(type16.nbytes())
    return before, after


def _redirect(graph: Graph, old: Any, new: Any, skip: Any = None) -> None:
    """Point every user of `old` (but `skip`) and the graph outputs at `new`."""
    for user in list(old.users):
        if user is skip:
            continue
        for i, v in enumerate(user.inputs):
            if v is old:
                user.set_input(i, new)
    graph.outputs = [new if v is old else v for v in graph.outputs]
