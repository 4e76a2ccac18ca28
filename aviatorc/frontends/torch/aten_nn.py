"""Converters for the compute of a transformer layer: linear and matmul, embedding,
normalization, softmax, attention, reductions.

`aten.linear(x, w, b)` becomes `MatMul(x, W_KN)` (+ `Add(b)`) with the weight stored as
its [in, out] transpose (see `Lowering.weight_kn`), as every frontend stores it.
`scaled_dot_product_attention` becomes one IR `Attention` node (4-D, GQA, bool or additive
mask, causal); both are top-left aligned when there is no KV cache.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from aviatorc.frontends.torch.aten import converts
from aviatorc.frontends.torch.importer import Lowering, Unsupported
from aviatorc.ir import Value


def _norm(axis: int, rank: int) -> int:
    return axis % max(rank, 1) if axis < 0 else axis


# -- matmul ----------------------------------------------------------------------------------


def _weight_kn(cx: Lowering, arg: Any) -> Value:
    """A linear layer's weight as [K, N]: the stored transpose for a parameter, else a Transpose."""
    weight = cx.weight_or_none(arg)
    if weight is not None and weight.tensor.dim() == 2:
        return cx.weight_kn(weight)
    w = cx.value(arg)
    return cx.op("Transpose", [w], {"perm": [1, 0]})


@converts("aten.linear")
def linear(cx: Lowering, node: Any) -> Value:
    a = cx.args()
    dtype = cx.out_dtype()
    y = cx.op("MatMul", [cx.value(a["input"], dtype), _weight_kn(cx, a["weight"])])
    if a.get("bias") is not None:
        y = cx.op("Add", [y, cx.value(a["bias"], dtype)])
    return y


@converts("aten.matmul", "aten.mm", "aten.bmm")
def matmul(cx: Lowering, node: Any) -> Value:
    dtype = cx.out_dtype()
    return cx.op("MatMul", [cx.value(node.args[0], dtype), cx.value(node.args[1], dtype)])


@converts("aten.addmm", "aten.baddbmm")
def addmm(cx: Lowering, node: Any) -> Value:
    """beta * self + alpha * (mat1 @ mat2) (GPT-2's Conv1D: weights already [in, out])."""
    a = cx.args()
    dtype = cx.out_dtype()
    first, second = ("mat1", "mat2") if "mat1" in a else ("batch1", "batch2")
    y = cx.op("MatMul", [cx.value(a[first], dtype), cx.value(a[second], dtype)])
    if a.get("alpha", 1) != 1:
        y = cx.op("Mul", [y, cx.const(a["alpha"], dtype)])
    beta = a.get("beta", 1)
    if beta == 0:
        return y
    bias = cx.value(a["self"], dtype)
    if beta != 1:
        bias = cx.op("Mul", [bias, cx.const(beta, dtype)])
    return cx.op("Add", [y, bias])


@converts("aten.embedding")
def embedding(cx: Lowering, node: Any) -> Value:
    a = cx.args()
    return cx.op("Gather", [cx.value(a["weight"]), cx.value(a["indices"], "int64")], {"axis": 0})


# -- normalization ---------------------------------------------------------------------------


def _scale(cx: Lowering, arg: Any, shape: list[int], dtype: str, fill: float) -> Value:
    if arg is not None:
        return cx.value(arg, dtype)
    return cx.const(np.full(shape, fill), dtype)


@converts("aten.layer_norm", "aten.native_layer_norm")
def layer_norm(cx: Lowering, node: Any) -> Any:
    a = cx.args()
    dtype = cx.out_dtype()
    shape = [int(s) for s in a["normalized_shape"]]
    x = cx.value(a["input"], dtype)
    scale = _scale(cx, a.get("weight"), shape, dtype, 1.0)
    bias = cx.value(a["bias"], dtype) if a.get("bias") is not None else None
    attrs = {"axis": -len(shape), "epsilon": float(a.get("eps") or 1e-5)}
    inputs = [x, scale] + ([bias] if bias is not None else [])
    if str(node.target).startswith("aten.native_layer_norm"):
        return cx.op("LayerNormalization", inputs, attrs, num_outputs=3)
    return cx.op("LayerNormalization", inputs, attrs)


@converts("aten.rms_norm")
def rms_norm(cx: Lowering, node: Any) -> Value:
    import torch

    a = cx.args()
    dtype = cx.out_dtype()
    shape = [int(s) for s in a["normalized_shape"]]
    eps = a.get("eps")
    if eps is None:
        eps = torch.finfo(cx.meta().dtype).eps
    x = cx.value(a["input"], dtype)
    scale = _scale(cx, a.get("weight"), shape, dtype, 1.0)
    return cx.op("RMSNormalization", [x, scale], {"axis": -len(shape), "epsilon": float(eps)})


@converts("aten.softmax", "aten._softmax", "aten._safe_softmax")
def softmax(cx: Lowering, node: Any) -> Value:
    a = cx.args()
    dtype = cx.out_dtype()
    x = cx.value(a["self"], dtype)
    y = cx.op("Softmax", [x], {"axis": _norm(int(a["dim"]), x.type.rank)})
    if str(node.target).startswith("aten._safe_softmax"):
        # Rows with every score masked give zeros rather than NaN.
        y = cx.op("Where", [cx.op("IsNaN", [y]), cx.const(0.0, dtype), y])
    return y


@converts("aten.log_softmax", "aten._log_softmax")
def log_softmax(cx: Lowering, node: Any) -> Value:
    a = cx.args()
    x = cx.value(a["self"], cx.out_dtype())
    return cx.op("LogSoftmax", [x], {"axis": _norm(int(a["dim"]), x.type.rank)})


# -- attention -------------------------------------------------------------------------------


@converts("aten.scaled_dot_product_attention")
def sdpa(cx: Lowering, node: Any) -> Value:
    """SDPA -> Attention(Q, K, V, mask?). 3-D torch inputs ([N, L, E], no head axis) get one head."""
    a = cx.args()
    if a.get("dropout_p", 0.0):
        raise Unsupported("aten.scaled_dot_product_attention with dropout")
    dtype = cx.out_dtype()
    q, k, v = (cx.value(a[name], dtype) for name in ("query", "key", "value"))
    rank = q.type.rank
    if rank not in (3, 4):
        raise Unsupported(f"aten.scaled_dot_product_attention on rank-{rank} inputs")
    if rank == 3:
        one = cx.ints([1])
        q, k, v = (cx.op("Unsqueeze", [t, one]) for t in (q, k, v))
    mask = a.get("attn_mask")
    mask_value = None
    if mask is not None:
        mask_value = cx.value(mask)
        if mask_value.type.dtype != "bool":
            mask_value = cx.cast(mask_value, dtype)
        if rank == 3 and mask_value.type.rank == 3:
            mask_value = cx.op("Unsqueeze", [mask_value, cx.ints([1])])
    attrs: dict[str, Any] = {"is_causal": int(bool(a.get("is_causal")))}
    if a.get("scale") is not None:
        attrs["scale"] = float(a["scale"])
    y = cx.op("Attention", [q, k, v] + ([mask_value] if mask_value is not None else []), attrs)
    if rank == 3:
        y = cx.op("Squeeze", [y, cx.ints([1])])
    return y


# -- reductions ------------------------------------------------------------------------------


def _axes(dims: Any, rank: int) -> list[int]:
    if dims is None:
        return []
    if isinstance(dims, int):
        dims = [dims]
    return [_norm(int(d), rank) for d in dims]


def _reduce(op: str, bool_input: bool = False) -> Any:
    def convert(cx: Lowering, node: Any) -> Value:
        a = cx.args()
        x = cx.value(a["self"], "bool" if bool_input else cx.out_dtype())
        axes = _axes(a.get("dim"), x.type.rank)
        keep = int(bool(a.get("keepdim", False)))
        if x.type.rank == 0:
            return x
        return cx.op(op, [x], {"axes": axes, "keepdims": keep})

    return convert


converts("aten.mean")(_reduce("ReduceMean"))
converts("aten.sum")(_reduce("ReduceSum"))
converts("aten.amax")(_reduce("ReduceMax"))
converts("aten.amin")(_reduce("ReduceMin"))
converts("aten.logsumexp")(_reduce("ReduceLogSumExp"))
converts("aten.any")(_reduce("ReduceMax", bool_input=True))
converts("aten.all")(_reduce("ReduceMin", bool_input=True))


@converts("aten.prod")
def prod(cx: Lowering, node: Any) -> Value:
    a = cx.args()
    x = cx.value(a["self"], cx.out_dtype())
    axes = _axes(a.get("dim"), x.type.rank)
    return cx.op("ReduceProd", [x], {"axes": axes, "keepdims": int(bool(a.get("keepdim", False)))})


def _minmax(reduce_op: str, arg_op: str) -> Any:
    def convert(cx: Lowering, node: Any) -> Any:
        a = cx.args()
        overload = node.target._overloadname
        if overload == "other":
            dtype = cx.out_dtype()
            return cx.op("Max" if reduce_op == "ReduceMax" else "Min",
                         [cx.value(node.args[0], dtype), cx.value(node.args[1], dtype)])
        x = cx.value(a["self"])
        if overload == "default":
            return cx.op(reduce_op, [x], {"axes": [], "keepdims": 0})
        if overload != "dim":
            raise Unsupported(str(node.target))
        axis = _norm(int(a["dim"]), x.type.rank)
        keep = int(bool(a.get("keepdim", False)))
        values = cx.op(reduce_op, [x], {"axes": [axis], "keepdims": keep})
        indices = cx.op(arg_op, [x], {"axis": axis, "keepdims": keep})
        return [values, indices]

    return convert


converts("aten.max")(_minmax("ReduceMax", "ArgMax"))
converts("aten.min")(_minmax("ReduceMin", "ArgMin"))


def _arg(op: str) -> Any:
    def convert(cx: Lowering, node: Any) -> Value:
        a = cx.args()
        x = cx.value(a["self"])
        keep = int(bool(a.get("keepdim", False)))
        if a.get("dim") is None:
            flat = cx.op("Reshape", [x, cx.ints([-1])])
            return cx.op(op, [flat], {"axis": 0, "keepdims": 0})
        return cx.op(op, [x], {"axis": _norm(int(a["dim"]), x.type.rank), "keepdims": keep})

    return convert


converts("aten.argmax")(_arg("ArgMax"))
converts("aten.argmin")(_arg("ArgMin"))


@converts("aten.var", "aten.std")
def var(cx: Lowering, node: Any) -> Value:
    """var/std with a correction: mean of squared deviations * n / (n - correction)."""
    a = cx.args()
    dtype = cx.out_dtype()
    x = cx.value(a["self"], dtype)
    axes = _axes(a.get("dim"), x.type.rank) or list(range(x.type.rank))
    sizes = [x.type.shape[i] for i in axes]
    static = [s for s in sizes if isinstance(s, int)]
    if len(static) != len(sizes):
        raise Unsupported(f"{node.target} over a symbolic dim")
    n = math.prod(static)
    correction = a.get("correction")
    if correction is None:
        correction = 1 if a.get("unbiased", True) else 0
    keep = int(bool(a.get("keepdim", False)))
    mean = cx.op("ReduceMean", [x], {"axes": axes, "keepdims": 1})
    dev = cx.op("Sub", [x, mean])
    out = cx.op("ReduceMean", [cx.op("Mul", [dev, dev])], {"axes": axes, "keepdims": keep})
    if correction:
        out = cx.op("Mul", [out, cx.const(n / max(n - float(correction), 0.0), dtype)])
    if str(node.target).startswith("aten.std"):
        out = cx.op("Sqrt", [out])
    return out
