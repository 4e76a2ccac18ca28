"""Elementwise ops: numpy broadcasting, ONNX semantics (integer division truncates)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from aviatorc.errors import ModelFormatError
from aviatorc.ir.ops.registry import REQUIRED, InferContext, register
from aviatorc.ir.types import FLOAT_DTYPES, TensorType, broadcast_shapes, format_shape, numpy_dtype


def broadcast_rule(out_dtype: str | None = None, first: int = 0):
    """Type rule: broadcast all present inputs from `first` on; dtype of input `first` unless given."""

    def infer(ctx: InferContext) -> list[TensorType]:
        types = [t for t in ctx.types[first:] if t is not None]
        shape = broadcast_shapes(*(t.shape for t in types))
        if shape is None:
            shapes = ", ".join(format_shape(t.shape) for t in types)
            raise ModelFormatError(f"shapes {shapes} do not broadcast")
        data_types = {t.dtype for t in types}
        if out_dtype is None and len(data_types) > 1:
            raise ModelFormatError(f"inputs have mismatched element types {sorted(data_types)}")
        return [TensorType(out_dtype or types[0].dtype, shape)]

    return infer


def same_rule(ctx: InferContext) -> list[TensorType]:
    return [ctx.type(0)]


def _int_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if np.issubdtype(a.dtype, np.integer):
        return (np.trunc(a / b)).astype(a.dtype)  # ONNX: truncate toward zero
    return a / b


def _binary(name: str, fn: Any, dtype: str | None = None) -> None:
    def kernel(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
        a, b = ins
        return [np.asarray(fn(a, b)).astype(a.dtype if dtype is None else dtype, copy=False)]

    kernel.__doc__ = f"{name}(a, b), broadcasting."
    register(name, inputs=2, infer=broadcast_rule(dtype))(kernel)


for _name, _fn in {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": _int_div,
                   # integers (ONNX opset 18): attention masks built from bit flags (CPM-Ant)
                   "BitwiseAnd": np.bitwise_and, "BitwiseOr": np.bitwise_or, "BitwiseXor": np.bitwise_xor}.items():
    _binary(_name, _fn)
for _name, _fn in {
    "Equal": np.equal, "Less": np.less, "LessOrEqual": np.less_equal,
    "Greater": np.greater, "GreaterOrEqual": np.greater_equal,
    "And": np.logical_and, "Or": np.logical_or, "Xor": np.logical_xor,
}.items():
    _binary(_name, _fn, "bool")


def _pow_rule(ctx: InferContext) -> list[TensorType]:
    shape = broadcast_shapes(ctx.type(0).shape, ctx.type(1).shape)
    if shape is None:
        raise ModelFormatError("shapes do not broadcast")
    return [TensorType(ctx.type(0).dtype, shape)]


@register("Pow", inputs=2, infer=_pow_rule)
def pow_(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """Pow(base, exponent): result has the base's element type."""
    a, b = ins
    if np.issubdtype(a.dtype, np.integer):
        return [np.power(a.astype(np.float64), b).astype(a.dtype)]
    return [np.power(a, b.astype(a.dtype)).astype(a.dtype)]


@register("Mod", inputs=2, infer=broadcast_rule(), attrs={"fmod": 0})
def mod(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """Mod(a, b): sign of the divisor (fmod=0) or of the dividend (fmod=1)."""
    a, b = ins
    return [(np.fmod(a, b) if attrs["fmod"] else np.mod(a, b)).astype(a.dtype)]


def _variadic(name: str, fn: Any) -> None:
    def kernel(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
        out = ins[0]
        for x in ins[1:]:
            out = fn(out, x)
        return [np.asarray(out).astype(ins[0].dtype, copy=False)]

    kernel.__doc__ = f"{name}(x0, x1, ...), elementwise over all inputs, broadcasting."
    register(name, inputs=(1, -1), infer=broadcast_rule())(kernel)


_variadic("Max", np.maximum)
_variadic("Min", np.minimum)
_variadic("Sum", np.add)


def _where_rule(ctx: InferContext) -> list[TensorType]:
    """Where: x and y share an element type; the shape broadcasts all three inputs, cond included."""
    (value_type,) = broadcast_rule(first=1)(ctx)
    shape = broadcast_shapes(ctx.type(0).shape, value_type.shape)
    if shape is None:
        raise ModelFormatError(f"condition {format_shape(ctx.type(0).shape)} does not broadcast with {format_shape(value_type.shape)}")
    return [TensorType(value_type.dtype, shape)]


@register("Where", inputs=3, infer=_where_rule)
def where(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """Where(cond, x, y): x where cond holds, else y."""
    cond, x, y = ins
    shape = np.broadcast_shapes(cond.shape, x.shape, y.shape)
    return [np.where(cond, x, y).astype(x.dtype, copy=False).reshape(shape)]


def _erf(x: np.ndarray) -> np.ndarray:
    """erf in float64, vectorized by torch (a Python `math.erf` per element took seconds on BERT)."""
    import torch

    return torch.special.erf(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float64))).numpy()


def _gelu(x: np.ndarray, approximate: str) -> np.ndarray:
    if approximate == "tanh":
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1 + np.asarray(_erf(x / math.sqrt(2)), dtype=np.float64))


_UNARY: dict[str, Any] = {
    "Neg": np.negative, "Abs": np.abs, "Exp": np.exp, "Log": np.log, "Sqrt": np.sqrt,
    "Reciprocal": np.reciprocal, "Tanh": np.tanh, "Cos": np.cos, "Sin": np.sin,
    "Floor": np.floor, "Ceil": np.ceil, "Round": np.round, "Sign": np.sign,
    "Relu": lambda x: np.maximum(x, 0),
    "Sigmoid": lambda x: 1 / (1 + np.exp(-x.astype(np.float64))),
    "Erf": lambda x: _erf(x.astype(np.float64)).astype(np.float64),
    "Softplus": lambda x: np.logaddexp(0, x.astype(np.float64)),
    "Identity": lambda x: x,
    "Not": np.logical_not,
}


def _unary(name: str, fn: Any) -> None:
    def kernel(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
        (x,) = ins
        with np.errstate(all="ignore"):
            return [np.asarray(fn(x)).astype(x.dtype, copy=False)]

    kernel.__doc__ = f"{name}(x), elementwise."
    register(name, inputs=1, infer=same_rule)(kernel)


for _name, _fn in _UNARY.items():
    _unary(_name, _fn)


@register("IsNaN", inputs=1, infer=lambda ctx: [TensorType("bool", ctx.type(0).shape)])
def isnan(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """IsNaN(x): elementwise test."""
    return [np.isnan(ins[0])]


@register("IsInf", inputs=1, infer=lambda ctx: [TensorType("bool", ctx.type(0).shape)],
          attrs={"detect_negative": 1, "detect_positive": 1})
def isinf(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """IsInf(x): elementwise test for +inf and/or -inf."""
    x = ins[0]
    return [(np.isposinf(x) & bool(attrs["detect_positive"])) | (np.isneginf(x) & bool(attrs["detect_negative"]))]


@register("Gelu", inputs=1, infer=same_rule, attrs={"approximate": "none"})
def gelu(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """Gelu(x): exact (erf) or tanh approximation."""
    x = ins[0]
    return [_gelu(x.astype(np.float64), attrs["approximate"]).astype(x.dtype)]


@register("LeakyRelu", inputs=1, infer=same_rule, attrs={"alpha": 0.01})
def leaky_relu(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """LeakyRelu(x): x if x >= 0 else alpha * x."""
    x = ins[0]
    return [np.where(x >= 0, x, x * np.asarray(attrs["alpha"], x.dtype)).astype(x.dtype)]


@register("Clip", inputs=(1, 3), infer=same_rule)
def clip(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """Clip(x, min?, max?): clamp to the optional bounds."""
    x = ins[0]
    lo = ins[1] if len(ins) > 1 and ins[1] is not None else None
    hi = ins[2] if len(ins) > 2 and ins[2] is not None else None
    out = x
    if lo is not None:
        out = np.maximum(out, lo)
    if hi is not None:
        out = np.minimum(out, hi)
    return [np.asarray(out).astype(x.dtype)]


def _cast_rule(ctx: InferContext) -> list[TensorType]:
    return [TensorType(ctx.attrs["to"], ctx.type(0).shape)]


@register("Cast", inputs=1, infer=_cast_rule, attrs={"to": REQUIRED})
def cast(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """Cast(x) to the element type `to` (float to int truncates, as ONNX does)."""
    x = ins[0]
    target = numpy_dtype(attrs["to"])
    if attrs["to"] not in FLOAT_DTYPES and x.dtype.kind == "f":
        with np.errstate(invalid="ignore"):
            return [np.trunc(x).astype(target)]
    return [x.astype(target)]
