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
    return [np.matmul(a, b)]


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
    axes = _reduce_axes(ctx.attrs, x.rank)
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


def _reduction(name: str, fn: Any) -> None:
    def kernel(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
        x = ins[0]
        axes = _reduce_axes(attrs, x.ndim)
        if axes is None:
            return [x]
        if x.size == 0 and name in ("ReduceMax", "ReduceMin"):
            fill = -np.inf if name == "ReduceMax" else np.inf
            shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
            out = np.full(shape, fill).astype(x.dtype)
            return [out if attrs["keepdims"] else out.reshape([d for i, d in enumerate(x.shape) if i not in axes])]
        return [np.asarray(fn(x, axis=axes, keepdims=bool(attrs["keepdims"]))).astype(x.dtype)]

    kernel.__doc__ = f"{name}(x) over `axes` (all when empty, unless noop_with_empty_axes)."
    register(name, inputs=1, infer=_reduce_rule, attrs={"axes": (), "keepdims": 1, "noop_with_empty_axes": 0})(kernel)


for _name, _fn in {
    "ReduceSum": np.sum, "ReduceMean": np.mean, "ReduceMax": np.max, "ReduceMin": np.min, "ReduceProd": np.prod,
    "ReduceL2": lambda x, axis, keepdims: np.sqrt(np.sum(x.astype(np.float64) ** 2, axis=axis, keepdims=keepdims)),
    "ReduceSumSquare": lambda x, axis, keepdims: np.sum(x * x, axis=axis, keepdims=keepdims),
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
