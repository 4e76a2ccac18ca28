"""The conversion table: ONNX node -> IR nodes.

Most IR ops follow ONNX semantics exactly (inputs and attribute names), so an ONNX node of
such an op passes through unchanged (`passthrough`). The ops below need a conversion:
attributes that old opsets kept where newer ones take inputs (Reduce axes, Split sizes,
Squeeze axes, Slice bounds, Clip bounds, Pad pads), dtype enums, and ops the IR does not
have that rewrite into ones it does (Gemm, Dropout, CastLike, Mean, Constant).

A converter reads the node through a `NodeContext` and emits IR nodes with `ctx.emit`; the
last emit of a converter passes `final=True` so the IR values keep the ONNX output names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from aviatorc.errors import ModelFormatError
from aviatorc.ir import OPS, Value
from aviatorc.ir.data import ArrayData, Derived
from aviatorc.ir.types import TensorType, numpy_dtype

if TYPE_CHECKING:
    from aviatorc.frontends.onnx.importer import Builder

# ONNX TensorProto.DataType -> IR element type. The rest (string, complex, float8, int4,
# float4, ...) are outside the IR's closed set.
ONNX_DTYPES: dict[int, str] = {
    1: "float32",
    2: "uint8",
    3: "int8",
    4: "uint16",
    5: "int16",
    6: "int32",
    7: "int64",
    9: "bool",
    10: "float16",
    11: "float64",
    12: "uint32",
    13: "uint64",
    16: "bfloat16",
}

# ONNX attributes that the IR op does not carry because they only matter for element
# types outside the IR (float8 saturation and rounding).
IGNORED_ATTRS: dict[str, frozenset[str]] = {
    "Cast": frozenset({"saturate", "round_mode"}),
}


def ir_dtype(enum: int, what: str) -> str:
    """The IR element type of an ONNX dtype enum; a clear error for the ones outside the IR."""
    if enum in ONNX_DTYPES:
        return ONNX_DTYPES[enum]
    import onnx

    try:
        name = onnx.TensorProto.DataType.Name(enum)
    except ValueError:
        name = str(enum)
    raise ModelFormatError(
        f"{what} has element type {name}, which aviatorc does not support",
        hint=f"supported: {', '.join(sorted(set(ONNX_DTYPES.values())))}",
    )


@dataclass
class NodeContext:
    """One ONNX node being converted: its decoded attributes, inputs and the builder."""

    builder: Builder
    proto: Any  # onnx.NodeProto
    name: str
    attrs: dict[str, Any]
    opset: int

    @property
    def op_type(self) -> str:
        return str(self.proto.op_type)

    @property
    def num_outputs(self) -> int:
        names = list(self.proto.output)
        while names and not names[-1]:
            names.pop()
        return len(names)

    def input(self, index: int) -> Value | None:
        names = self.proto.input
        if index >= len(names) or not names[index]:
            return None
        return self.builder.values[names[index]]

    def inputs(self) -> list[Value | None]:
        return [self.input(i) for i in range(len(self.proto.input))]

    def required(self, index: int) -> Value:
        """Input `index`, which the op needs: a malformed model gets a clear error, not a crash."""
        value = self.input(index)
        if value is None:
            raise ModelFormatError(f"required input {index} is missing", node=self.name, op=self.op_type)
        return value

    def required_attr(self, name: str) -> Any:
        if name not in self.attrs:
            raise ModelFormatError(f"required attribute '{name}' is missing", node=self.name, op=self.op_type)
        return self.attrs[name]

    def const(self, index: int) -> np.ndarray | None:
        """The value of a constant input (an initializer, or computed from constants at import)."""
        return self.builder.const_of(self.input(index))

    def constant(self, array: Any, suffix: str) -> Value:
        return self.builder.constant(np.asarray(array), f"{self.name}/{suffix}")

    def emit(
        self,
        op: str,
        inputs: list[Value | None],
        attrs: dict[str, Any] | None = None,
        *,
        final: bool = False,
        num_outputs: int = 1,
        suffix: str = "",
    ) -> list[Value]:
        """Add an IR node; `final` gives it the ONNX node's name and output names."""
        while inputs and inputs[-1] is None:
            inputs = inputs[:-1]
        return self.builder.emit(
            self, op, inputs, attrs or {}, final=final, num_outputs=num_outputs, suffix=suffix or op.lower()
        )


Converter = Callable[[NodeContext], list[Value]]
CONVERTERS: dict[str, Converter] = {}


def converts(*op_types: str) -> Callable[[Converter], Converter]:
    def decorate(fn: Converter) -> Converter:
        for op_type in op_types:
            CONVERTERS[op_type] = fn
        return fn

    return decorate


def supported_op(op_type: str) -> bool:
    return op_type in CONVERTERS or op_type in OPS


def convert(ctx: NodeContext) -> list[Value]:
    converter = CONVERTERS.get(ctx.op_type, passthrough)
    return converter(ctx)


def passthrough(ctx: NodeContext) -> list[Value]:
    """An ONNX op with the IR's semantics: same inputs, same attributes."""
    opdef = OPS[ctx.op_type]
    attrs = {}
    for key, value in ctx.attrs.items():
        if key in opdef.attrs:
            attrs[key] = value
        elif key not in IGNORED_ATTRS.get(ctx.op_type, ()):
            raise ModelFormatError(
                f"attribute '{key}' of {ctx.op_type} is not supported", node=ctx.name, op=ctx.op_type
            )
    return ctx.emit(ctx.op_type, ctx.inputs(), attrs, final=True, num_outputs=ctx.num_outputs)


def _attrs_except(ctx: NodeContext, *drop: str) -> dict[str, Any]:
    return {k: v for k, v in ctx.attrs.items() if k not in drop}


# -- constants ---------------------------------------------------------------------------


@converts("Constant")
def constant(ctx: NodeContext) -> list[Value]:
    """Constant -> an initializer named like the node's output."""
    attrs = ctx.attrs
    if "value" in attrs:
        array = ctx.builder.tensor_array(attrs["value"], f"value of Constant '{ctx.name}'")
    elif "value_float" in attrs:
        array = np.array(attrs["value_float"], np.float32)
    elif "value_floats" in attrs:
        array = np.array(attrs["value_floats"], np.float32)
    elif "value_int" in attrs:
        array = np.array(attrs["value_int"], np.int64)
    elif "value_ints" in attrs:
        array = np.array(attrs["value_ints"], np.int64)
    else:
        raise ModelFormatError(
            f"Constant with attribute(s) {sorted(attrs)} is not supported", node=ctx.name, op="Constant"
        )
    return [ctx.builder.named_constant(array, ctx.proto.output[0])]


@converts("ConstantOfShape")
def constant_of_shape(ctx: NodeContext) -> list[Value]:
    """ConstantOfShape: the value tensor becomes the attributes value and dtype."""
    attrs: dict[str, Any] = {}
    if "value" in ctx.attrs:
        array = ctx.builder.tensor_array(ctx.attrs["value"], f"value of ConstantOfShape '{ctx.name}'")
        if array.size != 1:
            raise ModelFormatError(f"value has {array.size} elements, expected 1", node=ctx.name, op="ConstantOfShape")
        attrs = {
            "value": array.reshape(()).item(),
            "dtype": str(array.dtype) if array.dtype.name != "bfloat16" else "bfloat16",
        }
    return ctx.emit("ConstantOfShape", ctx.inputs(), attrs, final=True)


# -- casts -------------------------------------------------------------------------------


@converts("Cast")
def cast(ctx: NodeContext) -> list[Value]:
    to = ir_dtype(int(ctx.required_attr("to")), f"Cast '{ctx.name}'")
    return ctx.emit("Cast", ctx.inputs()[:1], {"to": to}, final=True)


@converts("CastLike")
def cast_like(ctx: NodeContext) -> list[Value]:
    """CastLike(x, like) -> Cast(x) to like's element type."""
    like = ctx.required(1)
    return ctx.emit("Cast", [ctx.input(0)], {"to": like.type.dtype}, final=True)


# -- rewrites into IR ops ------------------------------------------------------------------


def _lazy_transpose(ctx: NodeContext, value: Value) -> Value:
    """A transposed 2-D operand: a lazy initializer for a weight, else a Transpose node."""
    if value.data is not None and value.type.rank == 2:
        source = value.data
        type = TensorType(value.type.dtype, value.type.shape[::-1])
        data = (
            ArrayData(np.ascontiguousarray(source.array.T))
            if isinstance(source, ArrayData)
            else Derived(source, lambda a: np.ascontiguousarray(a.T))
        )
        return ctx.builder.initializer(type, data, f"{value.name}_T")
    return ctx.emit("Transpose", [value], {"perm": (1, 0)}, suffix="transpose")[0]


@converts("Gemm")
def gemm(ctx: NodeContext) -> list[Value]:
    """Gemm -> MatMul (+ Transpose for transA/transB, + Mul for alpha/beta != 1, + Add for C)."""
    a, b, c = ctx.required(0), ctx.required(1), ctx.input(2)
    alpha, beta = float(ctx.attrs.get("alpha", 1.0)), float(ctx.attrs.get("beta", 1.0))
    if ctx.attrs.get("transA", 0):
        a = _lazy_transpose(ctx, a)
    if ctx.attrs.get("transB", 0):
        b = _lazy_transpose(ctx, b)
    dtype = numpy_dtype(a.type.dtype)
    has_c = c is not None and beta != 0.0
    out = ctx.emit("MatMul", [a, b], final=not has_c and alpha == 1.0, suffix="matmul")[0]
    if alpha != 1.0:
        out = ctx.emit("Mul", [out, ctx.constant(np.array(alpha, dtype), "alpha")], final=not has_c, suffix="alpha")[0]
    if has_c:
        assert c is not None
        if beta != 1.0:
            c = ctx.emit("Mul", [c, ctx.constant(np.array(beta, dtype), "beta")], suffix="beta")[0]
        out = ctx.emit("Add", [out, c], final=True)[0]
    return [out]


@converts("Dropout")
def dropout(ctx: NodeContext) -> list[Value]:
    """Dropout (inference) -> Identity; the optional mask output is all true."""
    training = ctx.input(2)
    if training is not None:
        flag = ctx.const(2)
        if flag is None or bool(np.asarray(flag).reshape(-1)[0]):
            raise ModelFormatError(
                "training-mode Dropout is not supported (training_mode must be a constant false)",
                node=ctx.name,
                op="Dropout",
            )
    x = ctx.required(0)
    if ctx.num_outputs < 2:
        return ctx.emit("Identity", [x], final=True)
    shape = ctx.emit("Shape", [x], suffix="shape")[0]
    out = ctx.builder.emit(ctx, "Identity", [x], {}, final=True, num_outputs=1, suffix="identity", output_index=0)[0]
    mask = ctx.builder.emit(
        ctx,
        "ConstantOfShape",
        [shape],
        {"value": 1, "dtype": "bool"},
        final=True,
        num_outputs=1,
        suffix="mask",
        output_index=1,
    )[0]
    return [out, mask]


@converts("Mean")
def mean(ctx: NodeContext) -> list[Value]:
    """Mean(x0, x1, ...) -> Sum / n."""
    inputs = ctx.inputs()
    first = ctx.required(0)
    total = ctx.emit("Sum", inputs, suffix="sum")[0]
    n = ctx.constant(np.array(len(inputs), numpy_dtype(first.type.dtype)), "count")
    return ctx.emit("Div", [total, n], final=True)


# -- attributes that became inputs -------------------------------------------------------


def _const_ints(ctx: NodeContext, index: int, what: str) -> tuple[int, ...] | None:
    """A constant int input as a tuple (None when omitted); a clear error when it is computed."""
    value = ctx.input(index)
    if value is None:
        return None
    array = ctx.const(index)
    if array is None:
        raise ModelFormatError(
            f"{what} (input {index}, '{value.name}') must be a constant",
            node=ctx.name,
            op=ctx.op_type,
            hint="export with static shapes, or fold the computation of this input",
        )
    return tuple(int(v) for v in np.asarray(array).reshape(-1))


@converts("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2", "ReduceSumSquare",
          "ReduceL1", "ReduceLogSum", "ReduceLogSumExp")
def reduce(ctx: NodeContext) -> list[Value]:
    """Reduce*: constant axes given as an input (opset 18; ReduceSum from 13) become the axes
    attribute; axes computed at run time stay an input."""
    attrs = dict(ctx.attrs)
    axes = ctx.input(1) if len(ctx.inputs()) > 1 else None
    if "axes" in attrs or axes is None:
        return ctx.emit(ctx.op_type, [ctx.input(0)], attrs, final=True)
    if ctx.const(1) is None:
        return ctx.emit(ctx.op_type, [ctx.input(0), axes], attrs, final=True)
    attrs["axes"] = _const_ints(ctx, 1, "axes") or ()
    return ctx.emit(ctx.op_type, [ctx.input(0)], attrs, final=True)


@converts("Split")
def split(ctx: NodeContext) -> list[Value]:
    """Split: sizes from the attribute (opset < 13) or input; else num_outputs equal parts.

    The sizes must name every output and cover the axis exactly: the IR's rule gives one
    type per size, and a size with no output would drop its columns unnoticed."""
    x = ctx.required(0)
    sizes = ctx.input(1)
    count = len(ctx.proto.output)  # trailing outputs may be unnamed, but they still take a part
    attrs = {"axis": ctx.attrs.get("axis", 0)}
    if "split" in ctx.attrs:
        sizes = ctx.constant(np.array(ctx.attrs["split"], np.int64), "split")
    known = ctx.builder.const_of(sizes) if sizes is not None else None
    if sizes is not None and "num_outputs" in ctx.attrs:
        raise ModelFormatError("Split takes sizes or num_outputs, not both", node=ctx.name, op="Split")
    if known is not None:
        parts = [int(v) for v in np.asarray(known).reshape(-1)]
        dim = x.type.shape[int(attrs["axis"]) % max(x.type.rank, 1)]
        if len(parts) != count or any(p < 0 for p in parts) or (isinstance(dim, int) and sum(parts) != dim):
            raise ModelFormatError(
                f"split sizes {parts} do not fit {count} output(s) of an axis of size {dim}",
                node=ctx.name, op="Split", hint="give one non-negative size per output, adding up to the axis",
            )
    if sizes is None:
        parts_n = ctx.attrs.get("num_outputs", count)
        if parts_n != count:
            raise ModelFormatError(f"num_outputs is {parts_n} but the node has {count} output(s)",
                                   node=ctx.name, op="Split")
        attrs["num_outputs"] = parts_n
    return ctx.emit("Split", [x, sizes], attrs, final=True, num_outputs=count)


def _axes_input(ctx: NodeContext) -> list[Value | None]:
    if "axes" in ctx.attrs:  # opset < 13
        return [ctx.input(0), ctx.constant(np.array(ctx.attrs["axes"], np.int64), "axes")]
    return ctx.inputs()


@converts("Squeeze", "Unsqueeze")
def squeeze(ctx: NodeContext) -> list[Value]:
    return ctx.emit(ctx.op_type, _axes_input(ctx), {}, final=True)


@converts("Slice")
def slice_(ctx: NodeContext) -> list[Value]:
    if "starts" not in ctx.attrs:
        return ctx.emit("Slice", ctx.inputs(), {}, final=True)
    inputs: list[Value | None] = [ctx.input(0)]  # opset < 10: bounds are attributes
    for key in ("starts", "ends", "axes"):
        inputs.append(ctx.constant(np.array(ctx.attrs[key], np.int64), key) if key in ctx.attrs else None)
    return ctx.emit("Slice", inputs, {}, final=True)


@converts("Clip")
def clip(ctx: NodeContext) -> list[Value]:
    x = ctx.required(0)
    if "min" not in ctx.attrs and "max" not in ctx.attrs:
        return ctx.emit("Clip", ctx.inputs(), {}, final=True)
    dtype = numpy_dtype(x.type.dtype)  # opset < 11: bounds are attributes
    lo = ctx.constant(np.array(ctx.attrs["min"], dtype), "min") if "min" in ctx.attrs else None
    hi = ctx.constant(np.array(ctx.attrs["max"], dtype), "max") if "max" in ctx.attrs else None
    return ctx.emit("Clip", [x, lo, hi], {}, final=True)


@converts("Pad")
def pad(ctx: NodeContext) -> list[Value]:
    mode = ctx.attrs.get("mode", "constant")
    if "pads" not in ctx.attrs:
        return ctx.emit("Pad", ctx.inputs(), {"mode": mode}, final=True)
    x = ctx.required(0)  # opset < 11: pads and value are attributes
    pads = ctx.constant(np.array(ctx.attrs["pads"], np.int64), "pads")
    value = ctx.constant(np.array(ctx.attrs.get("value", 0.0), numpy_dtype(x.type.dtype)), "value")
    return ctx.emit("Pad", [x, pads, value], {"mode": mode}, final=True)


@converts("Softmax", "LogSoftmax")
def softmax(ctx: NodeContext) -> list[Value]:
    """Softmax: opset >= 13 passes through. Before 13 the input is coerced to 2-D at `axis`
    (default 1); that equals the IR op only on the last axis, else Flatten / op / Reshape."""
    x = ctx.required(0)
    if ctx.opset >= 13:
        return ctx.emit(ctx.op_type, [x], {"axis": ctx.attrs.get("axis", -1)}, final=True)
    axis = int(ctx.attrs.get("axis", 1)) % max(x.type.rank, 1)
    if axis == x.type.rank - 1:
        return ctx.emit(ctx.op_type, [x], {"axis": -1}, final=True)
    flat = ctx.emit("Flatten", [x], {"axis": axis})[0]
    soft = ctx.emit(ctx.op_type, [flat], {"axis": -1})[0]
    shape = ctx.emit("Shape", [x])[0]
    return ctx.emit("Reshape", [soft, shape], final=True)


@converts("Attention")
def attention(ctx: NodeContext) -> list[Value]:
    attrs = dict(ctx.attrs)
    if "softmax_precision" in attrs:
        attrs["softmax_precision"] = ir_dtype(int(attrs["softmax_precision"]), f"softmax_precision of '{ctx.name}'")
    return ctx.emit("Attention", ctx.inputs(), attrs, final=True, num_outputs=ctx.num_outputs)
