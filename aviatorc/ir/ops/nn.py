"""Matrix, normalization and reduction ops: the compute of a transformer layer."""

from __future__ import annotations

from typing import Any

import numpy as np

from aviatorc.errors import ModelFormatError
from aviatorc.ir.ops.elementwise import same_rule
from aviatorc.ir.ops.registry import InferContext, register
from aviatorc.ir.types import Dim, TensorType, broadcast_shapes, dims_compatible, format_shape


def normalize_axis(axis: int, rank: int, op: str = "") -> int:
    if not -rank <= axis < max(rank, 1):
        raise ModelFormatError(f"axis {axis} is out of range for rank {rank}", op=op or None)
    return axis % max(rank, 1)


# -- matmul ------------------------------------------------------------------------------


def _matmul_rule(ctx: InferContext) -> list[TensorType]:
    a, b = ctx.type(0), ctx.type(1)
    if a.dtype != b.dtype:
        raise ModelFormatError(f"operands have mismatched element types {a.dtype} and {b.dtype}")
    if a.rank == 0 or b.rank == 0:
        raise ModelFormatError("MatMul operands must have rank >= 1")
    a_shape = a.shape if a.rank > 1 else (1,) + a.shape
    b_shape = b.shape if b.rank > 1 else b.shape + (1,)
    if not dims_compatible(a_shape[-1], b_shape[-2]):
        raise ModelFormatError(
            f"reduction dims differ: {format_shape(a.shape)} @ {format_shape(b.shape)}"
        )
    batch = broadcast_shapes(a_shape[:-2], b_shape[:-2])
    if batch is None:
        raise ModelFormatError(f"batch dims do not broadcast: {format_shape(a.shape)} @ {format_shape(b.shape)}")
    shape: tuple[Dim, ...] = batch + (a_shape[-2], b_shape[-1])
    if a.rank == 1:
        shape = shape[:-2] + shape[-1:]
    if b.rank == 1:
        shape = shape[:-1]
    return [TensorType(a.dtype, shape)]


@register("MatMul", inputs=2, infer=_matmul_rule)
def matmul(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """MatMul(a, b): numpy matmul semantics; a weight operand is laid out [K, N]."""
    a, b = ins
    if a.dtype.kind in "iu":
        return [np.matmul(a.astype(np.int64), b.astype(np.int64)).astype(a.dtype)]
    return [np.matmul(a, b).astype(a.dtype, copy=False)]  # numpy computes bfloat16 in float32


# -- softmax and normalization -----------------------------------------------------------


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    shifted = x - np.max(x, axis=axis, keepdims=True)
    exp = np.exp(shifted)
    return exp / np.sum(exp, axis=axis, keepdims=True)


@register("Softmax", inputs=1, infer=same_rule, attrs={"axis": -1})
def softmax(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """Softmax(x) along `axis`."""
    x = ins[0]
    return [_softmax(x, attrs["axis"]).astype(x.dtype)]


@register("LogSoftmax", inputs=1, infer=same_rule, attrs={"axis": -1})
def log_softmax(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """LogSoftmax(x) along `axis`."""
    x = ins[0]
    shifted = x - np.max(x, axis=attrs["axis"], keepdims=True)
    return [(shifted - np.log(np.sum(np.exp(shifted), axis=attrs["axis"], keepdims=True))).astype(x.dtype)]


def _norm_axes(x: np.ndarray, axis: int) -> tuple[int, ...]:
    return tuple(range(axis % x.ndim, x.ndim))


def _layer_norm_rule(ctx: InferContext) -> list[TensorType]:
    x = ctx.type(0)
    axis = normalize_axis(ctx.attrs["axis"], x.rank)
    stat_shape = x.shape[:axis] + (1,) * (x.rank - axis)
    stat_dtype = "float32" if ctx.attrs.get("stash_type", 1) == 1 else x.dtype
    return [x, TensorType(stat_dtype, stat_shape), TensorType(stat_dtype, stat_shape)][: ctx.num_outputs]


@register("LayerNormalization", inputs=(2, 3), infer=_layer_norm_rule,
          attrs={"axis": -1, "epsilon": 1e-5, "stash_type": 1},
          outputs=lambda attrs, n: 1, max_outputs=3)
def layer_norm(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """LayerNormalization(x, scale, bias?) over the axes from `axis` on; Mean and InvStdDev optional."""
    x, scale = ins[0], ins[1]
    bias = ins[2] if len(ins) > 2 else None
    compute = np.float32 if attrs["stash_type"] == 1 else x.dtype
    xc = x.astype(compute)
    axes = _norm_axes(x, attrs["axis"])
    mean = xc.mean(axis=axes, keepdims=True)
    var = ((xc - mean) ** 2).mean(axis=axes, keepdims=True)
    inv_std = 1 / np.sqrt(var + np.asarray(attrs["epsilon"], compute))
    y = (xc - mean) * inv_std * scale.astype(compute)
    if bias is not None:
        y = y + bias.astype(compute)
    return [y.astype(x.dtype), mean.astype(compute), inv_std.astype(compute)]


@register("RMSNormalization", inputs=2, infer=same_rule, attrs={"axis": -1, "epsilon": 1e-5, "stash_type": 1})
def rms_norm(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """RMSNormalization(x, scale): x / sqrt(mean(x^2) + epsilon) * scale over the axes from `axis` on."""
    x, scale = ins
    compute = np.float32 if attrs["stash_type"] == 1 else x.dtype
    xc = x.astype(compute)
    ms = (xc * xc).mean(axis=_norm_axes(x, attrs["axis"]), keepdims=True)
    return [(xc / np.sqrt(ms + np.asarray(attrs["epsilon"], compute)) * scale.astype(compute)).astype(x.dtype)]


# -- reductions --------------------------------------------------------------------------


def _reduce_rule(ctx: InferContext) -> list[TensorType]:
    x = ctx.type(0)
    attrs = dict(ctx.attrs)
    if ctx.has(1):  # axes fed as an input: known when constant
        axes_value = ctx.const(1)
        if axes_value is None:
            count = ctx.type(1).shape[0] if ctx.type(1).rank == 1 else None
            if ctx.attrs["keepdims"]:
                return [TensorType(x.dtype, (None,) * x.rank)]
            if not isinstance(count, int):
                raise ModelFormatError("reduction axes of unknown count with keepdims=0 give an unknown rank")
            return [TensorType(x.dtype, (None,) * (x.rank - count))]
        attrs["axes"] = tuple(int(a) for a in np.asarray(axes_value).reshape(-1))
    axes = _reduce_axes(attrs, x.rank)
    if axes is None:
        return [x]
    if ctx.attrs["keepdims"]:
        shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
    else:
        shape = tuple(d for i, d in enumerate(x.shape) if i not in axes)
    return [TensorType(x.dtype, shape)]


def _reduce_axes(attrs: dict[str, Any], rank: int) -> tuple[int, ...] | None:
    """Normalized axes; None means 'no reduction' (empty axes with noop_with_empty_axes)."""
    axes = tuple(attrs["axes"])
    if not axes:
        return None if attrs["noop_with_empty_axes"] else tuple(range(rank))
    return tuple(sorted(normalize_axis(a, rank) for a in axes))


def _log_sum_exp(x: np.ndarray, axis: tuple[int, ...], keepdims: bool) -> np.ndarray:
    """log(sum(exp(x))) in float64, shifted by the maximum so that large inputs do not overflow exp
    (the caller casts back to x's type)."""
    x = x.astype(np.float64)
    top = np.max(x, axis=axis, keepdims=True, initial=-np.inf)  # an empty set sums to log(0)
    top = np.where(np.isfinite(top), top, 0)  # all -inf (or an inf) passes through unshifted
    with np.errstate(divide="ignore"):  # log(0) = -inf is the answer for all -inf and empty
        out = np.log(np.sum(np.exp(x - top), axis=axis, keepdims=True)) + top
    return out if keepdims else np.squeeze(out, axis=axis)


def _reduction(name: str, fn: Any) -> None:
    def kernel(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
        x = ins[0]
        if len(ins) > 1 and ins[1] is not None:
            attrs = dict(attrs, axes=tuple(int(a) for a in ins[1]))
        axes = _reduce_axes(attrs, x.ndim)
        if axes is None:
            return [x]
        if x.size == 0 and name in ("ReduceMax", "ReduceMin"):
            fill = -np.inf if name == "ReduceMax" else np.inf
            if x.dtype == np.bool_:  # the identity of max over bools is False, of min True
                fill = name == "ReduceMin"
            shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
            out = np.full(shape, fill).astype(x.dtype)
            return [out if attrs["keepdims"] else out.reshape([d for i, d in enumerate(x.shape) if i not in axes])]
        return [np.asarray(fn(x, axis=axes, keepdims=bool(attrs["keepdims"]))).astype(x.dtype)]

    kernel.__doc__ = f"{name}(x, axes?) over `axes` (input or attribute; all when empty, unless noop_with_empty_axes)."
    register(name, inputs=(1, 2), infer=_reduce_rule, attrs={"axes": (), "keepdims": 1, "noop_with_empty_axes": 0})(kernel)


for _name, _fn in {
    "ReduceSum": np.sum, "ReduceMean": np.mean, "ReduceMax": np.max, "ReduceMin": np.min, "ReduceProd": np.prod,
    "ReduceL2": lambda x, axis, keepdims: np.sqrt(np.sum(x.astype(np.float64) ** 2, axis=axis, keepdims=keepdims)),
    "ReduceSumSquare": lambda x, axis, keepdims: np.sum(x * x, axis=axis, keepdims=keepdims),
    "ReduceL1": lambda x, axis, keepdims: np.sum(np.abs(x), axis=axis, keepdims=keepdims),
    "ReduceLogSum": lambda x, axis, keepdims: np.log(np.sum(x, axis=axis, keepdims=keepdims)),
    "ReduceLogSumExp": lambda x, axis, keepdims: _log_sum_exp(x, axis, keepdims),
}.items():
    _reduction(_name, _fn)


def _arg_rule(ctx: InferContext) -> list[TensorType]:
    x = ctx.type(0)
    axis = normalize_axis(ctx.attrs["axis"], x.rank)
    if ctx.attrs["keepdims"]:
        shape = tuple(1 if i == axis else d for i, d in enumerate(x.shape))
    else:
        shape = tuple(d for i, d in enumerate(x.shape) if i != axis)
    return [TensorType("int64", shape)]


def _arg(name: str, fn: Any) -> None:
    def kernel(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
        x = ins[0]
        axis = normalize_axis(attrs["axis"], x.ndim)
        if attrs["select_last_index"]:
            flipped = np.flip(x, axis=axis)
            out = x.shape[axis] - 1 - fn(flipped, axis=axis)
        else:
            out = fn(x, axis=axis)
        if attrs["keepdims"]:
            out = np.expand_dims(out, axis)
        return [np.asarray(out, dtype=np.int64)]

    kernel.__doc__ = f"{name}(x) along `axis`: int64 indices."
    register(name, inputs=1, infer=_arg_rule, attrs={"axis": 0, "keepdims": 1, "select_last_index": 0})(kernel)


_arg("ArgMax", np.argmax)
_arg("ArgMin", np.argmin)


# -- attention (ONNX Attention, opsets 23-25) ----------------------------------------------
#
# Q, K, V are 4-D [batch, heads, seq, head_size] or 3-D [batch, seq, heads * head_size]
# (then q_num_heads and kv_num_heads say how to split them). Grouped-query attention
# repeats each KV head q_num_heads / kv_num_heads times. The KV cache is past_key /
# past_value (4-D) concatenated with K / V along the sequence axis; present_* return it.
# Causal masking is bottom-right aligned: query i of the block attends key j iff
# j <= i + past_len. A fully masked row yields zeros, as in the ONNX reference.


def _dim_add(a: Dim, b: Dim) -> Dim:
    if isinstance(a, int) and isinstance(b, int):
        return a + b
    if a == 0:
        return b
    return a if b == 0 else None


def _dim_div(a: Dim, b: int) -> Dim:
    if isinstance(a, int) and b:
        if a % b:
            raise ModelFormatError(f"hidden size {a} is not divisible by {b} heads")
        return a // b
    return None


def _dim_mul(a: Dim, b: int) -> Dim:
    return a * b if isinstance(a, int) else None


def _attention_rule(ctx: InferContext) -> list[TensorType]:
    q, k, v = ctx.type(0), ctx.type(1), ctx.type(2)
    if len({q.dtype, k.dtype, v.dtype}) > 1:
        raise ModelFormatError(f"Q, K, V have mismatched element types {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.rank == k.rank == v.rank or q.rank not in (3, 4):
        raise ModelFormatError(f"Q, K, V must all be 3-D or all 4-D, got ranks {q.rank}, {k.rank}, {v.rank}")
    batch = q.shape[0]
    if q.rank == 3:
        hq, hkv = ctx.attrs["q_num_heads"], ctx.attrs["kv_num_heads"]
        if not hq or not hkv:
            raise ModelFormatError("3-D Attention needs the q_num_heads and kv_num_heads attributes")
        sq, skv = q.shape[1], k.shape[1]
        dk, dv = _dim_div(k.shape[2], hkv), _dim_div(v.shape[2], hkv)
        _dim_div(q.shape[2], hq)
        y_shape: tuple[Dim, ...] = (batch, sq, _dim_mul(dv, hq) if dv is not None else None)
        hq_dim: Dim = hq
        hkv_dim: Dim = hkv
    else:
        hq_dim, sq, hkv_dim, skv = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
        dk, dv = k.shape[3], v.shape[3]
        y_shape = (batch, hq_dim, sq, dv)
    if isinstance(hq_dim, int) and isinstance(hkv_dim, int) and hkv_dim and hq_dim % hkv_dim:
        raise ModelFormatError(f"{hq_dim} query heads are not a multiple of {hkv_dim} KV heads")
    past = ctx.type(4).shape[2] if ctx.has(4) and ctx.type(4).rank == 4 else 0
    total = _dim_add(past, skv)
    out = [
        TensorType(q.dtype, y_shape),
        TensorType(q.dtype, (batch, hkv_dim, total, dk)),
        TensorType(q.dtype, (batch, hkv_dim, total, dv)),
        TensorType(q.dtype, (batch, hq_dim, sq, total)),
    ]
    return out[: ctx.num_outputs]


def _to_heads(x: np.ndarray, heads: int) -> np.ndarray:
    """[B, S, H*D] -> [B, H, S, D]."""
    b, s, hidden = x.shape
    return x.reshape(b, s, heads, hidden // heads).transpose(0, 2, 1, 3)


def _masked_softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis; an all -inf row gives zeros instead of NaN."""
    x_max = np.max(x, axis=-1, keepdims=True)
    safe_max = np.where(np.isneginf(x_max), 0, x_max).astype(x.dtype)
    e = np.exp(x - safe_max)
    s = np.sum(e, axis=-1, keepdims=True)
    return e / np.where(s == 0, 1, s).astype(x.dtype)


def _attention_bias(q_len: int, kv_len: int, dtype: np.dtype, mask: np.ndarray | None, is_causal: bool,
                    offset: Any, left: int, right: int) -> np.ndarray:
    """The additive bias [.., q_len, kv_len]: mask (bool or additive), causal and window terms."""
    neg_inf = dtype.type(-np.inf)
    bias = np.zeros((q_len, kv_len), dtype)
    if mask is not None:
        pad_width = kv_len - mask.shape[-1]
        if pad_width > 0:  # a mask shorter than the keys masks the rest
            fill = False if mask.dtype == np.bool_ else -np.inf
            mask = np.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, pad_width)], constant_values=fill)
        if mask.dtype == np.bool_:
            mask = np.where(mask, dtype.type(0), neg_inf)
        bias = bias + mask.astype(dtype)
    i_idx = np.arange(q_len).reshape(q_len, 1)
    j_idx = np.arange(kv_len).reshape(1, kv_len)
    per_batch = np.ndim(offset) > 0
    pos = i_idx + (np.reshape(offset, (-1, 1, 1)) if per_batch else int(offset))  # absolute query position
    allowed = np.ones(np.shape(pos - j_idx), dtype=bool)
    if is_causal:
        allowed &= j_idx <= pos
    if left >= 0:
        allowed &= pos - j_idx <= left
    if right >= 0:
        allowed &= j_idx - pos <= right
    term = np.where(allowed, dtype.type(0), neg_inf)
    if per_batch:
        term = term.reshape(term.shape[0], 1, q_len, kv_len)
    return bias + term


@register("Attention", inputs=(3, 7), infer=_attention_rule,
          attrs={"is_causal": 0, "kv_num_heads": 0, "q_num_heads": 0, "qk_matmul_output_mode": 0,
                 "scale": None, "softcap": 0.0, "softmax_precision": "", "left_window_size": -1,
                 "right_window_size": -1},
          outputs=lambda attrs, n: 1, max_outputs=4)
def attention(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """Attention(Q, K, V, attn_mask?, past_key?, past_value?, nonpad_kv_seqlen?): ONNX scaled dot-product attention with GQA and a KV cache."""
    q, k, v = ins[0], ins[1], ins[2]
    mask, past_k, past_v, nonpad = (ins[i] if len(ins) > i else None for i in range(3, 7))
    rank3 = q.ndim == 3
    if rank3:
        q = _to_heads(q, attrs["q_num_heads"])
        k = _to_heads(k, attrs["kv_num_heads"])
        v = _to_heads(v, attrs["kv_num_heads"])
    dtype = q.dtype
    scale = attrs["scale"] if attrs["scale"] is not None else 1 / np.sqrt(q.shape[3])
    # The reference scales Q and K by sqrt(scale) each (as its function body does).
    root = dtype.type(np.sqrt(scale))
    k_all = np.concatenate((past_k, k), axis=2) if past_k is not None else k
    v_all = np.concatenate((past_v, v), axis=2) if past_v is not None else v
    q_len, kv_len = q.shape[2], k_all.shape[2]
    if past_k is not None:
        offset: Any = past_k.shape[2]
    elif nonpad is not None:
        offset = np.asarray(nonpad).reshape(-1) - q_len
    else:
        offset = 0
    bias = _attention_bias(q_len, kv_len, dtype, mask, bool(attrs["is_causal"]), offset,
                           attrs["left_window_size"], attrs["right_window_size"])
    if nonpad is not None:
        valid = np.arange(kv_len) < np.asarray(nonpad).reshape(-1, 1)
        bias = bias + np.where(valid, 0, -np.inf).astype(dtype).reshape(-1, 1, 1, kv_len)
    groups = q.shape[1] // k_all.shape[1]
    k_rep = np.repeat(k_all, groups, axis=1) if groups > 1 else k_all
    v_rep = np.repeat(v_all, groups, axis=1) if groups > 1 else v_all
    scores = np.matmul(q * root, np.swapaxes(k_rep * root, -1, -2)).astype(dtype, copy=False)
    if attrs["softcap"] > 0:  # before the mask, so masked scores stay -inf
        cap = dtype.type(attrs["softcap"])
        scores = np.tanh(scores / cap) * cap
    qk_out = scores
    biased = scores + bias
    if attrs["qk_matmul_output_mode"] == 2:
        qk_out = biased
    if attrs["softmax_precision"]:
        from aviatorc.ir.types import numpy_dtype

        biased = biased.astype(numpy_dtype(attrs["softmax_precision"]))
    probs = _masked_softmax(biased)
    probs = np.where(np.isneginf(np.max(bias, axis=-1, keepdims=True)), 0, probs).astype(probs.dtype)
    if attrs["qk_matmul_output_mode"] == 3:
        qk_out = probs
    y = np.matmul(probs.astype(dtype), v_rep).astype(dtype, copy=False)
    if rank3:
        y = y.transpose(0, 2, 1, 3).reshape(y.shape[0], y.shape[2], -1)
    return [y.astype(dtype), k_all, v_all, np.asarray(qk_out).astype(dtype)]
