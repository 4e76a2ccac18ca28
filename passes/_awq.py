"""AWQ in the quantize pass: one scale search per activation, and 1 / s put where the graph stays exact.

`awq_stage` takes a calibration stage's weights, groups them by the activation their MatMuls
read (q / k / v share one), runs `aviatorc.quant.awq.awq` on each group and rewrites the graph
so that the MatMuls read x / s (`scale_input`):

- folded into the LayerNormalization / RMSNormalization producing x (or the `Mul` by a [K]
  initializer that ends a decomposed norm, as exported RMSNorms do), when x feeds nothing but
  these MatMuls and the norm's scale (and bias) are [K] initializers: new initializers scaled by
  1 / s, no new node (a pre-norm transformer's q / k / v and gate / up);
- otherwise a `Mul(x, 1/s)` by a [K] constant in front of them (a post-norm BERT, whose norm
  output also feeds the residual; the o projection after attention; the down projection after
  the activation function). Exact as well, at the cost of one elementwise op.

A new initializer, not new data in an old one: sequential calibration
(`aviatorc.quant.sequential`) sees the norm's changed input and evaluates it again.
Weights whose MatMuls read different activations (a weight shared across depths), or that
have no data or no statistics, are left to the caller (round-to-nearest).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from aviatorc.passes._weights import LinearWeight

from aviatorc.formats import WeightFormat
from aviatorc.ir import ArrayData, Graph, Node, TensorType, Value, add_value
from aviatorc.quant.awq import AWQResult, awq
from aviatorc.quant.calibration import ActivationStats
from aviatorc.quant.gptq import GPTQConfig
from aviatorc.quant.refit import corrected_target
from aviatorc.quant.rtn import PackedWeight

NORMS = ("LayerNormalization", "RMSNormalization")


def awq_stage(graph: Graph, stage: list[LinearWeight], stats: dict[str, ActivationStats],
              format_of: Callable[[LinearWeight], WeightFormat],
              gptq: Callable[[int, int], GPTQConfig] | None = None) -> dict[int, PackedWeight]:
    """AWQ for the weights of one stage (each stored in `format_of(weight)`): {id(weight): its packed
    arrays}; the graph's MatMuls then read x / s. With `gptq` (the GPTQ setup for a weight's
    calibration tokens and K), the scaled weights are stored by GPTQ."""
    groups: dict[tuple[str, WeightFormat], list[LinearWeight]] = {}
    for lw in stage:
        names = {mm.input(0).name for mm in lw.matmuls}
        stat = stats.get(next(iter(names))) if len(names) == 1 else None
        if lw.has_data and stat is not None and stat.hessian is not None and stat.tokens:
            groups.setdefault((names.pop(), format_of(lw)), []).append(lw)
    packed: dict[int, PackedWeight] = {}
    for (name, fmt), lws in groups.items():
        stat = stats[name]
        assert stat.hessian is not None
        dense = [lw.dense() for lw in lws]
        targets = [corrected_target(w, stat.hessian, stat.cross) if stat.cross is not None else w for w in dense]
        result = awq(dense, stat.hessian, stat.mean_abs, fmt,
                     targets_KN=targets, masks=[lw.mask() for lw in lws],
                     gptq=gptq(stat.tokens, lws[0].k) if gptq is not None else None)
        scale_input(graph, lws[0].matmuls[0].input(0), [mm for lw in lws for mm in lw.matmuls], result)
        packed.update({id(lw): p for lw, p in zip(lws, result.packed)})
    return packed


def scale_input(graph: Graph, x: Value, readers: list[Node], result: AWQResult) -> str:
    """Make `readers` (MatMuls reading x at input 0) read x / s: folded into the norm that
    produces x where that is exact, else through a new Mul. Returns "folded" or "mul"."""
    inv_s = result.inverse_scale_K
    if _fold_into_norm(graph, x, readers, inv_s):
        return "folded"
    dtype = x.type.dtype
    const = graph.add_initializer(graph.unique_name(f"{x.name}.awq_inv_scale"), TensorType(dtype, (inv_s.size,)),
                                  ArrayData(inv_s.astype(dtype)))
    first = min(readers, key=graph.position)
    scaled = add_value(graph, "Mul", [x, const], name=graph.unique_name(f"{first.name}.awq_scale"), before=first)
    for mm in readers:
        mm.set_input(0, scaled)
    return "mul"


def _fold_into_norm(graph: Graph, x: Value, readers: list[Node], inv_s: np.ndarray) -> bool:
    norm = x.producer
    if norm is None or norm.outputs[0] is not x or x in graph.outputs:
        return False
    if any(u not in readers for u in x.users):
        return False  # x also feeds something that must see it unscaled (a post-norm residual)
    if norm.op in NORMS:
        params = [(i, v) for i, v in enumerate(norm.inputs) if i in (1, 2) and v is not None]
    elif norm.op == "Mul":  # a decomposed norm's last step, x = normalized * gamma (an exported RMSNorm)
        params = [(i, v) for i, v in enumerate(norm.inputs) if v is not None and v.is_initializer]
        if len(params) != 1:
            return False
    else:
        return False
    for _, v in params:
        if not v.is_initializer or v.data is None or not v.data.available or v.type.shape != (inv_s.size,):
            return False
    for index, v in params:
        data = v.data.load()  # type: ignore[union-attr]
        scaled = (np.asarray(data, np.float32) * inv_s).astype(data.dtype)
        new = graph.add_initializer(graph.unique_name(f"{v.name}.awq"), v.type, ArrayData(scaled))
        norm.set_input(index, new)
        if not v.users and v.name in graph.initializers:
            graph.remove_initializer(v)
    return True
