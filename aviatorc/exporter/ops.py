"""The IR -> ONNX conversion table: one converter per IR op.

Most IR ops are ONNX ops with ONNX's inputs and attributes (the ONNX frontend passes them
through unchanged), so they go back the same way (`same`), with the attributes the IR spells
differently put back: dtype names as TensorProto enums (Cast, ConstantOfShape, Attention's
softmax_precision), Reduce axes as an input (opset 18), Split's output count, and the IR's
"unset" values (None, an empty perm, 0 heads) left out. The rest:

- `DequantizeWeight`: standard QDQ (`aviatorc.exporter.quant`), or with `matmul_nbits` its MatMul
  as one `com.microsoft.MatMulNBits`;
- `QuantizeActivation`: its arithmetic, op for op (Div, Round, Add, Clip, Sub, Mul), which is
  its kernel: `clip(round(x / scale) + zero, qmin, qmax)` read back.

An op without a converter is refused by name, every such op at once (`ExportError.ops`).
onnx is imported inside functions only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aviatorc.errors import AviatorError
from aviatorc.exporter.quant import (
    WeightCodes,
    codes_array,
    dense_values,
    matmul_nbits_arrays,
    matmul_nbits_ok,
    weight_codes,
)
from aviatorc.formats import WeightFormat
from aviatorc.frontends.onnx.ops import ONNX_DTYPES
from aviatorc.ir import Graph, Node, Value
from aviatorc.ir.ops.quant import _FLOAT_DTYPES
from aviatorc.ir.types import numpy_dtype

BASE_OPSET = 21  # blocked and int4 DequantizeLinear
DTYPE_ENUMS: dict[str, int] = {name: enum for enum, name in ONNX_DTYPES.items()}
MS_DOMAIN = "com.microsoft"


class ExportError(AviatorError):
    """The graph cannot be written as ONNX. `ops` lists IR ops with no ONNX mapping."""

    def __init__(self, message: str, *, ops: tuple[str, ...] = (), **kwargs: Any) -> None:
        self.ops = ops
        super().__init__(message, **kwargs)


@dataclass
class OnnxBuilder:
    """What the converters write: ONNX nodes, the initializers they read, the opset they need.

    `emit` takes a node name the caller made unique: the IR node's own, or `fresh(...)`."""

    graph: Graph
    arrays: dict[str, np.ndarray]  # every IR initializer's whole stored array
    nodes: list[Any] = field(default_factory=list)  # onnx.NodeProto
    initializers: dict[str, np.ndarray] = field(default_factory=dict)
    opset: int = BASE_OPSET
    domains: set[str] = field(default_factory=set)
    formats: dict[str, int] = field(default_factory=dict)  # weight format name -> weights exported in it
    fused: dict[str, Node] = field(default_factory=dict)  # MatMul node -> the DequantizeWeight it absorbs
    _codes: dict[str, WeightCodes] = field(default_factory=dict)
    _names: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._names = {v.name for v in self.graph.values()} | {n.name for n in self.graph.nodes}

    def name(self, value: Value | None) -> str:
        """The ONNX name of an input ("" for an omitted one); an IR initializer is written on first use."""
        if value is None:
            return ""
        if value.name in self.graph.initializers and value.name not in self.initializers:
            self.initializers[value.name] = self.arrays[value.name]
        return value.name

    def fresh(self, base: str) -> str:
        name, index = base, 0
        while name in self._names:
            index += 1
            name = f"{base}_{index}"
        self._names.add(name)
        return name

    def constant(self, array: np.ndarray, base: str) -> str:
        name = self.fresh(base)
        self.initializers[name] = np.asarray(array)
        return name

    def emit(self, op: str, inputs: list[str], outputs: list[str], name: str, *, domain: str = "",
             **attrs: Any) -> None:
        from onnx import helper

        while inputs and not inputs[-1]:
            inputs = inputs[:-1]
        self.nodes.append(helper.make_node(op, inputs, outputs, name=name, domain=domain,
                                           **dict(sorted(attrs.items()))))
        if domain:
            self.domains.add(domain)

    def codes(self, node: Node) -> WeightCodes:
        """The codes of a quantized DequantizeWeight node, computed once."""
        if node.name not in self._codes:
            fmt, (k, n) = WeightFormat.from_attrs(node.attrs), weight_shape(node)
            arrays = [self.arrays[v.name] if v is not None else None for v in node.inputs]
            self._codes[node.name] = weight_codes(fmt, arrays, k, n)
        return self._codes[node.name]


def weight_shape(node: Node) -> tuple[int, int]:
    """A DequantizeWeight's [k, n], from its attributes (the IR's type rule checked them)."""
    k, n = node.attrs["k"], node.attrs["n"]
    assert isinstance(k, int) and isinstance(n, int)
    return k, n


Converter = Callable[[OnnxBuilder, Node], None]
CONVERTERS: dict[str, Converter] = {}
# Ops that need an opset above BASE_OPSET.
MIN_OPSET: dict[str, int] = {"RMSNormalization": 23, "Attention": 23, "BitwiseAnd": 18, "BitwiseOr": 18,
                             "BitwiseXor": 18}


def converts(*ops: str) -> Callable[[Converter], Converter]:
    def decorate(fn: Converter) -> Converter:
        for op in ops:
            CONVERTERS[op] = fn
        return fn

    return decorate


def _onnx_attrs(node: Node, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """The node's attributes as ONNX attribute values; None (unset) and `drop` left out."""
    out: dict[str, Any] = {}
    for key, value in node.attrs.items():
        if value is None or key in drop:
            continue
        out[key] = list(value) if isinstance(value, tuple) else value
    return out


def _outputs(node: Node) -> list[str]:
    return [v.name for v in node.outputs]


def _emit_same(b: OnnxBuilder, node: Node, attrs: dict[str, Any], inputs: list[str] | None = None) -> None:
    b.emit(node.op, inputs if inputs is not None else [b.name(v) for v in node.inputs], _outputs(node),
           node.name, **attrs)
    b.opset = max(b.opset, MIN_OPSET.get(node.op, BASE_OPSET))


@converts("Abs", "Add", "And", "ArgMax", "ArgMin", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "Ceil", "Clip", "Concat", "Cos", "CumSum", "Div", "Equal",
          "Erf", "Exp", "Expand", "Flatten", "Floor", "Gather", "GatherElements", "GatherND", "Gelu",
          "Greater", "GreaterOrEqual", "Identity", "IsInf", "IsNaN", "LayerNormalization", "LeakyRelu", "Less",
          "LessOrEqual", "Log", "LogSoftmax", "MatMul", "Max", "Min", "Mod", "Mul", "Neg", "Not", "Or", "Pad",
          "Pow", "RMSNormalization", "Range", "Reciprocal", "Relu", "Reshape", "Round", "ScatterElements",
          "ScatterND", "Shape", "Sigmoid", "Sign", "Sin", "Size", "Slice", "Softmax", "Softplus", "Sqrt",
          "Squeeze", "Sub", "Sum", "Tanh", "Tile", "Trilu", "Unsqueeze", "Where", "Xor")
def same(b: OnnxBuilder, node: Node) -> None:
    """An op with ONNX's own inputs and attributes."""
    if node.op == "MatMul" and node.name in b.fused:
        _matmul_nbits(b, node, b.fused[node.name])
        return
    _emit_same(b, node, _onnx_attrs(node))


@converts("Transpose")
def transpose(b: OnnxBuilder, node: Node) -> None:
    _emit_same(b, node, _onnx_attrs(node, drop=() if node.attrs.get("perm") else ("perm",)))


@converts("Split")
def split(b: OnnxBuilder, node: Node) -> None:
    """Opset 18 Split takes sizes or num_outputs; the IR's 0 means "one part per output"."""
    attrs = _onnx_attrs(node, drop=("num_outputs",))
    if node.optional_input(1) is None:
        attrs["num_outputs"] = len(node.outputs)
    _emit_same(b, node, attrs)


@converts("Cast")
def cast(b: OnnxBuilder, node: Node) -> None:
    _emit_same(b, node, {"to": DTYPE_ENUMS[str(node.attrs["to"])]})


@converts("ConstantOfShape")
def constant_of_shape(b: OnnxBuilder, node: Node) -> None:
    from onnx import numpy_helper

    dtype = numpy_dtype(str(node.attrs.get("dtype", "float32")))
    value = numpy_helper.from_array(np.array([node.attrs.get("value", 0.0)]).astype(dtype), "value")
    _emit_same(b, node, {"value": value})


@converts("ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin", "ReduceProd",
          "ReduceSum", "ReduceSumSquare")
def reduce(b: OnnxBuilder, node: Node) -> None:
    """Reduce* (opset 18): the IR's axes attribute becomes the axes input."""
    inputs = [b.name(v) for v in node.inputs]
    axes = tuple(node.attrs.get("axes", ()))  # type: ignore[arg-type]
    if axes and len(inputs) < 2:
        inputs.append(b.constant(np.array(axes, np.int64), f"{node.name}/axes"))
    _emit_same(b, node, _onnx_attrs(node, drop=("axes",)), inputs)


@converts("Attention")
def attention(b: OnnxBuilder, node: Node) -> None:
    """Attention (opset 23; 25 for the window attributes); the IR's unset values are left out."""
    attrs = _onnx_attrs(node, drop=("softmax_precision",))
    for key, unset in (("q_num_heads", 0), ("kv_num_heads", 0), ("left_window_size", -1), ("right_window_size", -1)):
        if attrs.get(key) == unset:
            attrs.pop(key)
    if node.attrs.get("softmax_precision"):
        attrs["softmax_precision"] = DTYPE_ENUMS[str(node.attrs["softmax_precision"])]
    _emit_same(b, node, attrs)
    if "left_window_size" in attrs or "right_window_size" in attrs:
        b.opset = max(b.opset, 25)


# -- mixture of experts: standard ONNX ops (TopK, GatherElements, ScatterElements) ------------------


def _step(b: OnnxBuilder, node: Node, op: str, inputs: list[str], out: str | None = None, **attrs: Any) -> str:
    """One ONNX node of a decomposition: a fresh output (or `out`), its name derived from the IR node's."""
    name = out or b.fresh(f"{node.name}/{op.lower()}")
    b.emit(op, inputs, [name], b.fresh(f"{node.name}/{op.lower()}"), **attrs)
    return name


def _ints(b: OnnxBuilder, node: Node, values: list[int]) -> str:
    return b.constant(np.array(values, np.int64), f"{node.name}/ints")


def _attr(node: Node, key: str) -> Any:
    """An attribute with the op's default filled in."""
    from aviatorc.ir.ops import get_op

    return get_op(node.op).resolve_attrs(node.attrs, node.name)[key]


def _int_attr(node: Node, key: str) -> int:
    value = _attr(node, key)
    assert isinstance(value, int)
    return value


def _score(b: OnnxBuilder, node: Node, x: str) -> str:
    if _attr(node, "score") == "softmax":
        return _step(b, node, "Softmax", [x], axis=-1)
    return _step(b, node, "Sigmoid", [x])


def _top(b: OnnxBuilder, node: Node, x: str, k: int) -> tuple[str, str]:
    """(values, indices) of the k largest along the last axis."""
    values, indices = b.fresh(f"{node.name}/values"), b.fresh(f"{node.name}/indices")
    b.emit("TopK", [x, _ints(b, node, [k])], [values, indices], b.fresh(f"{node.name}/topk"), axis=-1)
    return values, indices


@converts("MoERouter")
def moe_router(b: OnnxBuilder, node: Node) -> None:
    """The router's kernel, op for op: scores, the group limit, TopK, the chosen weights, written
    into a zero row with ScatterElements (ONNX TopK puts the lower index first on ties, as the
    kernel does). The logits are flattened to [tokens, experts] and the result shaped back."""
    logits = node.input(0)
    dtype = numpy_dtype(logits.type.dtype)
    experts = logits.type.shape[-1]
    assert isinstance(experts, int)

    def scalar(value: Any, label: str) -> str:
        return b.constant(np.array(value, dtype), f"{node.name}/{label}")

    x = _step(b, node, "Reshape", [b.name(logits), _ints(b, node, [-1, experts])])
    scores = _score(b, node, x) if _attr(node, "select") == "scores" else x
    choice = scores
    if node.optional_input(1) is not None:
        choice = _step(b, node, "Add", [scores, b.name(node.input(1))])
    groups = _int_attr(node, "n_group")
    if groups > 1:
        per = experts // groups
        grouped = _step(b, node, "Reshape", [choice, _ints(b, node, [-1, groups, per])])
        best, _ = _top(b, node, grouped, _int_attr(node, "group_top"))
        group_scores = _step(b, node, "ReduceSum", [best, _ints(b, node, [-1])], keepdims=0)
        _, kept = _top(b, node, group_scores, _int_attr(node, "topk_group"))
        zeros = _step(b, node, "Mul", [group_scores, scalar(0, "zero")])
        ones = _step(b, node, "Add", [_step(b, node, "GatherElements", [zeros, kept], axis=-1), scalar(1, "one")])
        mask = _step(b, node, "ScatterElements", [zeros, kept, ones], axis=-1)
        mask = _step(b, node, "Expand", [_step(b, node, "Unsqueeze", [mask, _ints(b, node, [-1])]),
                                         _ints(b, node, [1, groups, per])])
        mask = _step(b, node, "Reshape", [mask, _ints(b, node, [-1, experts])])
        mask = _step(b, node, "Cast", [mask], to=DTYPE_ENUMS["bool"])
        choice = _step(b, node, "Where", [mask, choice, scalar(-np.inf, "ninf")])
    _, chosen = _top(b, node, choice, _int_attr(node, "top_k"))
    weights = _step(b, node, "GatherElements", [scores, chosen], axis=-1)
    if _attr(node, "select") == "logits":
        weights = _score(b, node, weights)
    if _attr(node, "normalize"):
        total = _step(b, node, "ReduceSum", [weights, _ints(b, node, [-1])], keepdims=1)
        total = _step(b, node, "Add", [total, scalar(_attr(node, "normalize_epsilon"), "eps")])
        weights = _step(b, node, "Div", [weights, total])
    if _attr(node, "scale") != 1.0:
        weights = _step(b, node, "Mul", [weights, scalar(_attr(node, "scale"), "scale")])
    # x * 0 is NaN where a logit is infinite; such a row routes nowhere meaningful anyway
    zero_row = _step(b, node, "Mul", [x, scalar(0, "zero")])
    routed = _step(b, node, "ScatterElements", [zero_row, chosen, weights], axis=-1)
    _step(b, node, "Reshape", [routed, _step(b, node, "Shape", [b.name(logits)])], out=node.outputs[0].name)


def _column(b: OnnxBuilder, node: Node, routing: Value, dtype: str) -> str:
    """routing[..., e : e + 1] in `dtype`."""
    e = _int_attr(node, "expert")
    col = _step(b, node, "Slice", [b.name(routing), _ints(b, node, [e]), _ints(b, node, [e + 1]), _ints(b, node, [-1])])
    return col if routing.type.dtype == dtype else _step(b, node, "Cast", [col], to=DTYPE_ENUMS[dtype])


@converts("MoEDispatch")
def moe_dispatch(b: OnnxBuilder, node: Node) -> None:
    x, out = node.input(0), node.outputs[0].name
    if _attr(node, "scale"):
        _step(b, node, "Mul", [b.name(x), _column(b, node, node.input(1), x.type.dtype)], out=out)
    else:
        _step(b, node, "Identity", [b.name(x)], out=out)


@converts("MoECombine")
def moe_combine(b: OnnxBuilder, node: Node) -> None:
    routing, y, acc = node.input(0), node.input(1), node.optional_input(2)
    factor = _column(b, node, routing, y.type.dtype)
    if not _attr(node, "scale"):  # 1 where routed
        zero = b.constant(np.array(0, numpy_dtype(y.type.dtype)), f"{node.name}/zero")
        routed = _step(b, node, "Not", [_step(b, node, "Equal", [factor, zero])])
        factor = _step(b, node, "Cast", [routed], to=DTYPE_ENUMS[y.type.dtype])
    out = node.outputs[0].name
    term = _step(b, node, "Mul", [b.name(y), factor], out=None if acc is not None else out)
    if acc is not None:
        _step(b, node, "Add", [b.name(acc), term], out=out)


@converts("QuantizeActivation")
def quantize_activation(b: OnnxBuilder, node: Node) -> None:
    """x -> (clip(round(x / scale) + zero, qmin, qmax) - zero) * scale, in x's element type: the kernel."""
    x = node.input(0)
    dtype = numpy_dtype(x.type.dtype)
    scale, zero, lo, hi = (b.constant(np.array(node.attrs[key], dtype), f"{node.name}/{key}")
                           for key in ("scale", "zero_point", "qmin", "qmax"))
    steps: list[tuple[str, list[str]]] = [("Div", [scale]), ("Round", []), ("Add", [zero]), ("Clip", [lo, hi]),
                                          ("Sub", [zero]), ("Mul", [scale])]
    previous = b.name(x)
    for index, (op, operands) in enumerate(steps):
        out = node.outputs[0].name if index == len(steps) - 1 else b.fresh(f"{node.name}/{op.lower()}")
        b.emit(op, [previous, *operands], [out], b.fresh(f"{node.name}/{op.lower()}"))
        previous = out


@converts("DequantizeWeight")
def dequantize_weight(b: OnnxBuilder, node: Node) -> None:
    """A packed weight -> DequantizeLinear of its exact codes (float formats: their values, Cast)."""
    if any(fused is node for fused in b.fused.values()):
        return  # its MatMul reads the codes itself (MatMulNBits)
    fmt, (k, _) = WeightFormat.from_attrs(node.attrs), weight_shape(node)
    out = node.outputs[0].name
    b.formats[fmt.name] = b.formats.get(fmt.name, 0) + 1
    if fmt.kind in _FLOAT_DTYPES:
        values = dense_values(fmt, [b.arrays[v.name] if v is not None else None for v in node.inputs], k)
        name = b.constant(values, f"{node.inputs[0].name}.dense" if fmt.sparsity else node.inputs[0].name)  # type: ignore[union-attr]
        if fmt.kind == "fp32":
            b.emit("Identity", [name], [out], node.name)
        else:
            b.emit("Cast", [name], [out], node.name, to=DTYPE_ENUMS["float32"])
        return
    codes = b.codes(node)
    base = node.inputs[0].name.removesuffix(".values")  # type: ignore[union-attr]
    inputs = [b.constant(codes_array(codes), f"{base}.codes"), b.constant(codes.scale, f"{base}.scale_f32")]
    if codes.zero_GN is not None:
        import ml_dtypes

        inputs.append(b.constant(codes.zero_GN.astype(ml_dtypes.uint4), f"{base}.zero_point"))
    if codes.offset_GN is not None:  # code * scale, then each block's offset: [G, 1, N] -> [G, g, N] -> [K, N]
        scaled = b.fresh(f"{out}/scaled")
        b.emit("DequantizeLinear", inputs, [scaled], node.name, axis=0, block_size=codes.block_size)
        _add_block_offsets(b, scaled, codes, k, base, out, node.name)
    elif codes.block_size:
        b.emit("DequantizeLinear", inputs, [out], node.name, axis=0, block_size=codes.block_size)
    else:
        b.emit("DequantizeLinear", inputs, [out], node.name, axis=1)


def _add_block_offsets(b: OnnxBuilder, scaled: str, codes: WeightCodes, k: int, base: str, out: str, name: str) -> None:
    """out = scaled + each block's offset repeated along its rows (the ragged last block cut at k)."""
    assert codes.offset_GN is not None
    blocks, n = codes.offset_GN.shape
    block = codes.block_size
    offset = b.constant(codes.offset_GN.reshape(blocks, 1, n), f"{base}.offset")
    tiled = b.fresh(f"{out}/offset_rows")
    b.emit("Expand", [offset, b.constant(np.array([blocks, block, n], np.int64), f"{base}.offset_shape")], [tiled],
           b.fresh(f"{name}/expand"))
    flat = b.fresh(f"{out}/offset_flat")
    b.emit("Reshape", [tiled, b.constant(np.array([blocks * block, n], np.int64), f"{base}.offset_flat_shape")], [flat],
           b.fresh(f"{name}/reshape"))
    rows = flat
    if blocks * block != k:
        rows = b.fresh(f"{out}/offset_cut")
        b.emit("Slice", [flat, b.constant(np.array([0], np.int64), f"{base}.offset_start"),
                         b.constant(np.array([k], np.int64), f"{base}.offset_end")], [rows], b.fresh(f"{name}/slice"))
    b.emit("Add", [scaled, rows], [out], b.fresh(f"{name}/offset"))


def plan_matmul_nbits(b: OnnxBuilder) -> list[str]:
    """Pick the MatMuls that become MatMulNBits: their weight is a blocked (4-bit, group-wise int8 or
    mxint8) DequantizeWeight read only by MatMuls as input 1. Returns why each other quantized weight stays QDQ."""
    outputs = {v.name for v in b.graph.outputs}
    reasons = []
    for node in b.graph.nodes:
        if node.op != "DequantizeWeight" or WeightFormat.from_attrs(node.attrs).kind in _FLOAT_DTYPES:
            continue
        why = matmul_nbits_ok(b.codes(node))
        value = node.outputs[0]
        if why is None and (value.name in outputs or not value.users or any(
                u.op != "MatMul" or u.inputs[1] is not value or u.inputs[0] is value or
                u.input(0).type.dtype not in ("float32", "float16") for u in value.users)):
            why = "its weight is read by something other than a MatMul's second operand"
        if why is None:
            for user in value.users:
                b.fused[user.name] = node
        else:
            reasons.append(f"{node.name}: {why}")
    return reasons


def _matmul_nbits(b: OnnxBuilder, matmul: Node, dq: Node) -> None:
    codes = b.codes(dq)
    fmt = WeightFormat.from_attrs(dq.attrs)
    b.formats[fmt.name] = b.formats.get(fmt.name, 0) + 1
    weight, scales, zeros = matmul_nbits_arrays(codes)
    base = dq.inputs[0].name.removesuffix(".values")  # type: ignore[union-attr]
    a = matmul.input(0)
    dtype = numpy_dtype(a.type.dtype)
    inputs = [b.name(a), b.constant(weight, f"{base}.nbits"), b.constant(scales.astype(dtype), f"{base}.nbits_scale")]
    if zeros is not None:  # packed uint8, or float zero points in the scales' type
        zeros = zeros.astype(dtype) if zeros.dtype.kind == "f" else zeros
        inputs.append(b.constant(zeros, f"{base}.nbits_zero_point"))
    k, n = weight_shape(dq)
    b.emit("MatMulNBits", inputs, _outputs(matmul), matmul.name, domain=MS_DOMAIN, K=k, N=n, bits=codes.bits,
           block_size=codes.block_size)


def check_supported(graph: Graph) -> None:
    """Refuse every op of the graph that has no ONNX mapping, all of them in one error."""
    missing = sorted({node.op for node in graph.nodes if node.op not in CONVERTERS})
    if missing:
        first = {op: next(n.name for n in graph.nodes if n.op == op) for op in missing}
        listing = ", ".join(f"{op} (first: '{first[op]}')" for op in missing)
        raise ExportError(f"no ONNX mapping for IR op(s) {listing}", ops=tuple(missing),
                          hint="add a converter to aviatorc.exporter.ops.CONVERTERS")
