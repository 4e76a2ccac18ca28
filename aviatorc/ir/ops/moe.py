"""Mixture-of-experts ops: the router, the dispatch of tokens to one expert, and the combine.

A MoE block in the IR is

    routing = MoERouter(logits, bias?)                  # [T, E]: each token's weight per expert, 0 if unrouted
    for each expert e:                                  # in expert order, one expert's nodes after another
        x_e = MoEDispatch(x, routing, expert=e)         # the rows routed to e (x, or x scaled by its weight)
        y_e = <expert e's MLP: MatMul(x_e, W_gate_up_e) ... MatMul(h_e, W_down_e)>   # ordinary weights
        acc = MoECombine(routing, y_e, acc?, expert=e)  # acc + weight (or routed mask) x y_e
    out = acc                                           # (+ shared experts: ordinary MatMuls beside it)

so each expert's projections are ordinary 2-D MatMul weights (one per expert per projection) that
the partitioner tiles, the quantizer quantizes and the scheduler streams on their own, and the
router's logits come from an ordinary MatMul (its weight kept at FP16 by the quantizer).

What runs densely: the dispatch passes every token to every expert (an unrouted token's weight
is 0), so these kernels compute all experts on all tokens, and the combine multiplies the
unrouted ones by 0: numerically the sparse result (exact zeros added), at E / top_k times the
sparse FLOPs. The chain of `MoECombine` nodes keeps one partial sum live (not E expert outputs),
and expert e's subgraph is exactly the nodes between its `MoEDispatch` and its `MoECombine`, so
the sim runtime skips the experts no token of a run is routed to (`backends/sim.py`).

Routing variants (`MoERouter` attributes), as the released models route:

    score        "softmax" | "sigmoid"
    select       "scores": top-k of the scores (Mixtral, Qwen3-MoE, DeepSeek-V3)
                 "logits": top-k of the logits, then the score of the chosen ones only
                           (gpt-oss: softmax over the k; Llama 4: sigmoid of each)
    top_k        experts per token
    n_group, topk_group, group_top
                 group-limited selection (DeepSeek-V3): experts in n_group groups, a group's
                 score is the sum of its group_top best choice scores, only the topk_group best
                 groups compete
    normalize, normalize_epsilon
                 the chosen weights divided by their sum (+ epsilon)
    scale        multiplies the chosen weights (DeepSeek-V3's routed_scaling_factor)
    bias input   a correction added to the scores for selection only (DeepSeek-V3's
                 e_score_correction_bias): the weights are the uncorrected scores

Ties in the top-k go to the lower expert index (a stable sort), as `torch.topk` gives on CPU for
distinct values; random weights make exact ties vanishingly rare.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from aviatorc.errors import ModelFormatError
from aviatorc.ir.ops.registry import REQUIRED, InferContext, register
from aviatorc.ir.types import TensorType, broadcast_shapes, dims_compatible, format_shape

SCORES = ("softmax", "sigmoid")
SELECTS = ("scores", "logits")


def _experts(t: TensorType, what: str) -> int | str | None:
    if t.rank < 1:
        raise ModelFormatError(f"{what} must have an experts axis, got a scalar")
    return t.shape[-1]


def _router_rule(ctx: InferContext) -> list[TensorType]:
    logits = ctx.type(0)
    if logits.dtype not in ("float32", "float16", "bfloat16", "float64"):
        raise ModelFormatError(f"router logits must be floating point, got {logits.dtype}")
    experts = _experts(logits, "router logits")
    a = ctx.attrs
    if a["score"] not in SCORES:
        raise ModelFormatError(f"router score '{a['score']}' is not one of {', '.join(SCORES)}")
    if a["select"] not in SELECTS:
        raise ModelFormatError(f"router select '{a['select']}' is not one of {', '.join(SELECTS)}")
    groups, top_k = a["n_group"], a["top_k"]
    if isinstance(experts, int):
        if not 1 <= top_k <= experts:
            raise ModelFormatError(f"top_k {top_k} is not in [1, {experts}] experts")
        if groups < 1 or experts % groups:
            raise ModelFormatError(f"{experts} experts do not split into {groups} groups")
        if not 1 <= a["topk_group"] <= groups:
            raise ModelFormatError(f"topk_group {a['topk_group']} is not in [1, {groups}] groups")
        if groups > 1 and top_k > a["topk_group"] * (experts // groups):
            raise ModelFormatError(f"top_k {top_k} exceeds the {a['topk_group']} x {experts // groups} experts "
                                   "of the selected groups")
    if ctx.has(1):
        bias = ctx.type(1)
        if bias.rank != 1 or not dims_compatible(bias.shape[0], experts):
            raise ModelFormatError(f"router bias {format_shape(bias.shape)} does not match {experts} experts")
    return [logits]


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return (1 / (1 + np.exp(-x.astype(np.float64)))).astype(x.dtype)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return e / np.sum(e, axis=-1, keepdims=True)


def _score(x: np.ndarray, kind: str) -> np.ndarray:
    return _softmax(x) if kind == "softmax" else _sigmoid(x)


def _top_indices(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest along the last axis (ties to the lower index)."""
    return np.argsort(-values, axis=-1, kind="stable")[..., :k]


def _group_mask(choice: np.ndarray, groups: int, keep: int, per_group_top: int) -> np.ndarray:
    """True for the experts of each token's `keep` best groups (a group scores the sum of its
    `per_group_top` best choice scores)."""
    *lead, experts = choice.shape
    grouped = choice.reshape(*lead, groups, experts // groups)
    best = np.sort(grouped, axis=-1)[..., ::-1][..., :per_group_top]
    chosen = _top_indices(best.sum(axis=-1), keep)
    mask = np.zeros((*lead, groups), dtype=bool)
    np.put_along_axis(mask, chosen, True, axis=-1)
    return np.repeat(mask, experts // groups, axis=-1)


@register("MoERouter", inputs=(1, 2), infer=_router_rule,
          attrs={"score": REQUIRED, "select": "scores", "top_k": REQUIRED, "n_group": 1, "topk_group": 1,
                 "group_top": 2, "normalize": 0, "normalize_epsilon": 0.0, "scale": 1.0})
def moe_router(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """MoERouter(logits [.., E], bias? [E]): each token's weight per expert, 0 for the unrouted."""
    logits = ins[0]
    bias = ins[1] if len(ins) > 1 else None
    k = attrs["top_k"]
    if attrs["select"] == "scores":
        scores = _score(logits, attrs["score"])
        choice = scores + bias.astype(scores.dtype) if bias is not None else scores
    else:
        scores = logits
        choice = logits + bias.astype(logits.dtype) if bias is not None else logits
    if attrs["n_group"] > 1:
        keep = _group_mask(choice, attrs["n_group"], attrs["topk_group"], attrs["group_top"])
        choice = np.where(keep, choice, -np.inf)
    chosen = _top_indices(choice, k)
    weights = np.take_along_axis(scores, chosen, axis=-1)
    if attrs["select"] == "logits":
        weights = _score(weights, attrs["score"])
    if attrs["normalize"]:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + weights.dtype.type(attrs["normalize_epsilon"]))
    if attrs["scale"] != 1.0:
        weights = weights * weights.dtype.type(attrs["scale"])
    routing = np.zeros(logits.shape, dtype=logits.dtype)
    np.put_along_axis(routing, chosen, weights.astype(logits.dtype), axis=-1)
    return [routing]


# -- dispatch and combine -----------------------------------------------------------------


def _expert_index(ctx: InferContext, routing: TensorType) -> None:
    experts = _experts(routing, "routing")
    e = ctx.attrs["expert"]
    if isinstance(experts, int) and not 0 <= e < experts:
        raise ModelFormatError(f"expert {e} is not in [0, {experts})")


def _rows_match(rows: TensorType, routing: TensorType, what: str) -> None:
    if rows.rank != routing.rank or broadcast_shapes(rows.shape[:-1], routing.shape[:-1]) is None:
        raise ModelFormatError(f"{what} {format_shape(rows.shape)} and routing {format_shape(routing.shape)} "
                               "do not have the same tokens")


def _dispatch_rule(ctx: InferContext) -> list[TensorType]:
    x, routing = ctx.type(0), ctx.type(1)
    _expert_index(ctx, routing)
    _rows_match(x, routing, "tokens")
    return [x]


def _column(routing: np.ndarray, expert: int) -> np.ndarray:
    return routing[..., expert : expert + 1]


@register("MoEDispatch", inputs=2, infer=_dispatch_rule, attrs={"expert": REQUIRED, "scale": 0})
def moe_dispatch(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """MoEDispatch(x [.., H], routing [.., E]): the tokens expert `expert` runs on (scaled by their weight with `scale`)."""
    x, routing = ins
    if attrs["scale"]:
        return [(x * _column(routing, attrs["expert"]).astype(x.dtype)).astype(x.dtype)]
    return [x]


def _combine_rule(ctx: InferContext) -> list[TensorType]:
    routing, y = ctx.type(0), ctx.type(1)
    _expert_index(ctx, routing)
    _rows_match(y, routing, "expert output")
    if ctx.has(2):
        acc = ctx.type(2)
        if acc.dtype != y.dtype or acc.rank != y.rank or broadcast_shapes(acc.shape, y.shape) is None:
            raise ModelFormatError(f"partial sum {acc} does not match expert output {y}")
    return [y]


@register("MoECombine", inputs=(2, 3), infer=_combine_rule, attrs={"expert": REQUIRED, "scale": 1})
def moe_combine(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """MoECombine(routing [.., E], y [.., H], acc?): acc + y x (the token's weight with `scale`, else 1 where routed, 0 elsewhere)."""
    routing, y = ins[0], ins[1]
    acc = ins[2] if len(ins) > 2 else None
    column = _column(routing, attrs["expert"])
    factor = column if attrs["scale"] else (column != 0)
    term = y * factor.astype(y.dtype)
    return [(term if acc is None else acc + term).astype(y.dtype)]
