"""sparsify-2to4: two of every four consecutive weights along K become zero, stored compressed.

What it rewrites: `MatMul(x, W)` with W a float [K, N] initializer becomes
`MatMul(x, DequantizeWeight(values, indices))` in W's float format with sparsity "2:4": the
kept values [K/2, N] plus a 2-bit position per kept value (exact bytes:
`WeightFormat("fp32", sparsity="2:4").storage_bytes(K, N)`). `quantize` after it stores the
kept values in int8 / int4 / mx and keeps the pattern.

Groups of four start at row 0 and K is padded with zeros to a multiple of 4, so every group
lies inside one matrix-unit tile of the target (its depth must be a multiple of 4; a K
that is not a multiple of the tile depth leaves a partial last tile, whose groups are still
whole).

Selection (`sparsity_method`): `magnitude` (largest |w|), `wanda` (largest |w| * ||x_k||
over the calibration activations), `sparsegpt` (pattern by w^2 / [H^-1]_kk^2 with the kept
weights updated to compensate, from the calibration Hessian, as SparseGPT does; then the
kept weights are refit by least squares for that pattern, `aviatorc.quant.refit`).
Calibration is sequential: weights are pruned stage by stage (`calibration_stages`), each
stage's statistics taken from the graph with the earlier stages already pruned, evaluating
only the nodes between one stage and the next (`aviatorc.quant.sequential`); SparseGPT
is given the weight that best reproduces the unpruned graph's output from those inputs
(`aviatorc.quant.refit.corrected_target`). Weights matching `keep_fp16`
stay dense.

Where it goes: after fusions, before `quantize` (scales are then computed on kept values).
Does not handle: weights read by anything but MatMul input 1 (noted), N:M patterns other
than 2:4, and sparsity along N.
"""

from __future__ import annotations

import numpy as np
from aviatorc.passes._weights import (
    LinearWeight,
    add_packed_weight,
    find_linear_weights,
    rewrite_by_stage,
    target_name,
    tile_depth,
)
from aviatorc.passes.manager import Note, Pass, PassContext, PassResult, register_pass

from aviatorc.errors import OptionError
from aviatorc.formats import WeightFormat
from aviatorc.ir import Graph
from aviatorc.quant.calibration import ActivationStats, check_batches
from aviatorc.quant.gptq import GPTQConfig, gptq
from aviatorc.quant.refit import corrected_target, refit_masked
from aviatorc.quant.rtn import PackedWeight, pack_weight
from aviatorc.quant.sparse import magnitude_mask, wanda_mask

# SparseGPT: rows in their natural order (the 2:4 groups are consecutive rows).
SPARSEGPT = GPTQConfig(act_order=False)
# Conjugate-gradient steps of the least-squares refit after SparseGPT's sweep. MiniLM 2:4
# (embedding cosine): SparseGPT alone 0.8676; refit 10 steps 0.8929, 40 steps 0.8918, the
# exact per-column solve 0.8917 (damp 0.1 throughout; 0.03 gave 0.8918, 0.01 0.8895, 0.3 0.8863).
REFIT_ITERATIONS = 10


@register_pass
class Sparsify2to4(Pass):
    name = "sparsify-2to4"
    summary = "2:4 structured sparsity along K (magnitude, Wanda or SparseGPT), stored compressed"
    exact = False

    def requires(self, graph: Graph, ctx: PassContext) -> None:
        opts = ctx.options
        if opts.sparsity is None:
            return
        depth = tile_depth(ctx.target) if ctx.target is not None else None
        if depth is not None and depth % 4:
            raise OptionError(f"2:4 sparsity needs a matrix-unit depth that is a multiple of 4; target "
                              f"'{target_name(ctx.target)}' has {depth}")
        batches = check_batches(graph, ctx.calibration)
        if opts.sparsity_method in ("wanda", "sparsegpt") and not batches:
            raise OptionError(f"sparsity method '{opts.sparsity_method}' needs calibration data",
                              hint="pass calibration= (Python) or --calibration FILE.npz (CLI), or use magnitude")

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        opts = ctx.options
        if opts.sparsity is None:
            return PassResult(False, notes=[Note(graph.name, "no sparsity requested")])
        weights, notes = find_linear_weights(graph)
        todo = []
        for lw in weights:
            if lw.source is not None:
                notes.append(Note(lw.matmuls[0].name, f"weight '{lw.name}' is already stored as {lw.fmt.name}"))
            elif opts.keep_fp16 and lw.matches(opts.keep_fp16):
                notes.append(Note(lw.matmuls[0].name, f"weight '{lw.name}' matches keep_fp16: left dense"))
            else:
                todo.append(lw)
        method = opts.sparsity_method
        # SparseGPT fits each weight to the unpruned graph's output (`corrected_target`): keep it.
        reference = graph.clone() if method == "sparsegpt" and any(lw.has_data for lw in todo) else None
        bytes_before = bytes_after = 0

        def rewrite(stage: list[LinearWeight], stats: dict[str, ActivationStats]) -> None:
            nonlocal bytes_before, bytes_after
            for lw in stage:
                fmt = WeightFormat(lw.fmt.kind, 0, True, "2:4")
                packed = self._prune_one(lw, fmt, method, stats) if lw.has_data else None
                bytes_before += lw.fmt.storage_bytes(lw.k, lw.n)
                add_packed_weight(graph, lw, fmt, packed)
                bytes_after += fmt.storage_bytes(lw.k, lw.n)

        # Sequential calibration, as in `quantize`: each stage's statistics come from the graph
        # with the earlier stages already pruned (and compensated, for SparseGPT).
        rewrite_by_stage(graph, ctx, todo, rewrite, calibrate=method != "magnitude", hessian=method == "sparsegpt",
                         reference=reference, label=self.name)
        return PassResult(bool(todo), {"weights_sparsified": len(todo), "method": method,
                                       "weight_bytes_before": bytes_before, "weight_bytes_after": bytes_after}, notes)

    def _prune_one(self, lw: LinearWeight, fmt: WeightFormat, method: str,
                   stats: dict[str, ActivationStats]) -> PackedWeight:
        """The 2:4 weight `method` chooses from the statistics of the weight's MatMul inputs
        (magnitude when there are none)."""
        w = lw.dense()
        mm_stats = [stats[mm.input(0).name] for mm in lw.matmuls if mm.input(0).name in stats]
        if method == "wanda" and mm_stats:
            sq = _total([s.sq_norm for s in mm_stats])
            mask = wanda_mask(w, sq**0.5)
        elif method == "sparsegpt" and mm_stats:
            hessian = _total([s.hessian for s in mm_stats])
            crosses = [s.cross for s in mm_stats]
            if all(c is not None for c in crosses):
                w = corrected_target(w, hessian, _total(crosses))
            w_swept, _, _, pruned = gptq(w, hessian, None, prune_24=True, config=SPARSEGPT)
            assert pruned is not None  # prune_24 always returns the mask
            mask = pruned
            w = refit_masked(w, hessian, mask, start_KN=w_swept, damp=SPARSEGPT.damp, iterations=REFIT_ITERATIONS)
        else:
            mask = magnitude_mask(w)
        return pack_weight(w, fmt, mask=mask)


def _total(arrays: list[np.ndarray | None]) -> np.ndarray:
    """The sum of per-MatMul statistics of one weight (collected, so never None here)."""
    present = [a for a in arrays if a is not None]
    assert len(present) == len(arrays)
    return np.sum(present, axis=0)
