"""Converters for elementwise ATen ops: arithmetic, comparisons, logic, activations, casts.

Arithmetic runs in the dtype torch gives the result (inputs and scalars are cast to it);
comparisons run in torch's promoted dtype of their operands. Casting ops (`to`,
`_to_copy`, `type_as`) and copies (`clone`, `alias`, `dropout` in eval) return their input:
the importer casts any result whose dtype differs from torch's.
"""

from __future__ import annotations

from typing import Any

from aviatorc.frontends.torch.aten import converts
from aviatorc.frontends.torch.importer import Lowering, Unsupported, dtype_of, same_weight
from aviatorc.ir import Value


def result_dtype(cx: Lowering, a: Any, b: Any) -> str:
    """torch's type promotion of two operands (FX tensor nodes or Python scalars)."""
    import torch

    def standin(x: Any) -> Any:
        if isinstance(x, torch.fx.Node):
            val = x.meta.get("val")
            if isinstance(val, torch.Tensor):
                return torch.empty([1] * min(val.dim(), 1), dtype=val.dtype, device="meta")
            if isinstance(val, torch.SymFloat):
                return 1.0
            if isinstance(val, torch.SymBool):
                return True
            return 1
        return x

    sa, sb = standin(a), standin(b)
    if not isinstance(sa, torch.Tensor) and not isinstance(sb, torch.Tensor):
        sa = torch.tensor(sa, device="meta")
    return dtype_of(torch.result_type(sa, sb))


def _operands(cx: Lowering) -> tuple[Any, Any]:
    args = cx.node.args
    return args[0], args[1]


# -- arithmetic ----------------------------------------------------------------------------


def _arith(op: str) -> Any:
    def convert(cx: Lowering, node: Any) -> Value:
        a = cx.args()
        x, y = a.get("self", node.args[0]), a.get("other", node.args[1] if len(node.args) > 1 else None)
        dtype = cx.out_dtype()
        alpha = a.get("alpha", 1)
        yv = cx.value(y, dtype)
        if alpha is not None and alpha != 1:
            yv = cx.op("Mul", [yv, cx.const(alpha, dtype)])
        return cx.op(op, [cx.value(x, dtype), yv])

    return convert


converts("aten.add")(_arith("Add"))
converts("aten.sub")(_arith("Sub"))
converts("aten.mul")(_arith("Mul"))


def _in_place(convert: Any) -> Any:
    """An in-place op (`add_`) as its functional form, when no later node reads the tensor it
    overwrote (`out.add_(bias)` in transformers' experts, Llama 4's `out.add_(routed)`); else
    unsupported, as the later reader would need the written value."""

    def converted(cx: Lowering, node: Any) -> Value:
        target = node.args[0]
        later = node.next
        while later.op != "root":
            if later in target.users:
                raise Unsupported(f"{node.target} on a tensor read again afterwards ('{later.name}')")
            later = later.next
        return convert(cx, node)  # type: ignore[no-any-return]

    return converted


converts("aten.add_")(_in_place(_arith("Add")))
converts("aten.sub_")(_in_place(_arith("Sub")))
converts("aten.mul_")(_in_place(_arith("Mul")))


@converts("aten.rsub")
def rsub(cx: Lowering, node: Any) -> Value:
    """rsub(self, other, alpha): other - alpha * self."""
    a = cx.args()
    dtype = cx.out_dtype()
    x = cx.value(a["self"], dtype)
    if a.get("alpha", 1) != 1:
        x = cx.op("Mul", [x, cx.const(a["alpha"], dtype)])
    return cx.op("Sub", [cx.value(a["other"], dtype), x])


@converts("aten.div")
def div(cx: Lowering, node: Any) -> Value:
    """div: true division, or rounded toward zero ("trunc") or down ("floor")."""
    a = cx.args()
    dtype = cx.out_dtype()
    mode = a.get("rounding_mode")
    x, y = cx.value(a["self"], dtype), cx.value(a["other"], dtype)
    if mode is None:
        return cx.op("Div", [x, y])
    if mode == "trunc":
        if dtype.startswith(("int", "uint")):
            return cx.op("Div", [x, y])  # IR integer division truncates
        q = cx.op("Div", [x, y])
        return cx.op("Mul", [cx.op("Sign", [q]), cx.op("Floor", [cx.op("Abs", [q])])])
    if dtype.startswith(("int", "uint")):
        return _floor_div_int(cx, x, y)
    return cx.op("Floor", [cx.op("Div", [x, y])])


converts("aten.div_")(_in_place(div))


def _floor_div_int(cx: Lowering, x: Value, y: Value) -> Value:
    # (x - mod(x, y)) / y is exact, so the truncating IR division gives the floor.
    return cx.op("Div", [cx.op("Sub", [x, cx.op("Mod", [x, y])]), y])


@converts("aten.floor_divide")
def floor_divide(cx: Lowering, node: Any) -> Value:
    dtype = cx.out_dtype()
    x, y = (cx.value(v, dtype) for v in _operands(cx))
    if dtype.startswith(("int", "uint")):
        return _floor_div_int(cx, x, y)
    return cx.op("Floor", [cx.op("Div", [x, y])])


@converts("aten.remainder")
def remainder(cx: Lowering, node: Any) -> Value:
    dtype = cx.out_dtype()
    x, y = (cx.value(v, dtype) for v in _operands(cx))
    return cx.op("Mod", [x, y], {"fmod": 0})


@converts("aten.fmod")
def fmod(cx: Lowering, node: Any) -> Value:
    dtype = cx.out_dtype()
    x, y = (cx.value(v, dtype) for v in _operands(cx))
    return cx.op("Mod", [x, y], {"fmod": 1})


@converts("aten.pow")
def pow_(cx: Lowering, node: Any) -> Value:
    dtype = cx.out_dtype()
    base, exponent = _operands(cx)
    return cx.op("Pow", [cx.value(base, dtype), cx.value(exponent, dtype)])


@converts("aten.maximum", "aten.fmax")
def maximum(cx: Lowering, node: Any) -> Value:
    dtype = cx.out_dtype()
    return cx.op("Max", [cx.value(v, dtype) for v in _operands(cx)])


@converts("aten.minimum", "aten.fmin")
def minimum(cx: Lowering, node: Any) -> Value:
    dtype = cx.out_dtype()
    return cx.op("Min", [cx.value(v, dtype) for v in _operands(cx)])


@converts("aten.clamp", "aten.clamp_min", "aten.clamp_max", "aten.clip", "aten.hardtanh")
def clamp(cx: Lowering, node: Any) -> Value:
    a = cx.args()
    dtype = cx.out_dtype()
    key = str(node.target)
    if key.startswith("aten.hardtanh"):
        lo, hi = a["min_val"], a["max_val"]
    elif key.startswith("aten.clamp_min"):
        lo, hi = a["min"], None
    elif key.startswith("aten.clamp_max"):
        lo, hi = None, a["max"]
    else:
        lo, hi = a.get("min"), a.get("max")
    x = cx.value(a["self"], dtype)
    return cx.op("Clip", [x, cx.value(lo, dtype) if lo is not None else None,
                          cx.value(hi, dtype) if hi is not None else None])


@converts("aten.where")
def where(cx: Lowering, node: Any) -> Value:
    a = cx.args()
    if a.get("self") is None:
        raise Unsupported("aten.where (one-argument form: nonzero)")
    dtype = cx.out_dtype()
    cond = cx.value(a["condition"], "bool")
    return cx.op("Where", [cond, cx.value(a["self"], dtype), cx.value(a["other"], dtype)])


@converts("aten.masked_fill")
def masked_fill(cx: Lowering, node: Any) -> Value:
    a = cx.args()
    dtype = cx.out_dtype()
    mask = cx.value(a["mask"], "bool")
    return cx.op("Where", [mask, cx.value(a["value"], dtype), cx.value(a["self"], dtype)])


# -- comparisons and logic -----------------------------------------------------------------


def _compare(op: str, negate: bool = False) -> Any:
    def convert(cx: Lowering, node: Any) -> Value:
        x, y = _operands(cx)
        dtype = result_dtype(cx, x, y)
        out = cx.op(op, [cx.value(x, dtype), cx.value(y, dtype)])
        return cx.op("Not", [out]) if negate else out

    return convert


for _key, _op, _neg in [("aten.eq", "Equal", False), ("aten.ne", "Equal", True), ("aten.lt", "Less", False),
                        ("aten.le", "LessOrEqual", False), ("aten.gt", "Greater", False),
                        ("aten.ge", "GreaterOrEqual", False)]:
    converts(_key)(_compare(_op, _neg))


def _logical(op: str, bitwise: bool) -> Any:
    def convert(cx: Lowering, node: Any) -> Value:
        x, y = _operands(cx)
        dtype = cx.out_dtype()
        if bitwise and dtype != "bool":  # on integers: bit by bit
            return cx.op("Bitwise" + op, [cx.value(x, dtype), cx.value(y, dtype)])
        return cx.op(op, [cx.value(x, "bool"), cx.value(y, "bool")])

    return convert


for _key, _op in [("and", "And"), ("or", "Or"), ("xor", "Xor")]:
    converts(f"aten.logical_{_key}")(_logical(_op, False))
    converts(f"aten.bitwise_{_key}", f"aten.__{_key}__")(_logical(_op, True))


@converts("aten.logical_not", "aten.bitwise_not")
def logical_not(cx: Lowering, node: Any) -> Value:
    if str(node.target).startswith("aten.bitwise_not") and cx.out_dtype() != "bool":
        raise Unsupported(f"{node.target} on integers")
    return cx.op("Not", [cx.value(node.args[0], "bool")])


@converts("aten.isnan")
def isnan(cx: Lowering, node: Any) -> Value:
    return cx.op("IsNaN", [cx.value(node.args[0])])


@converts("aten.isinf")
def isinf(cx: Lowering, node: Any) -> Value:
    return cx.op("IsInf", [cx.value(node.args[0])])


# -- unary math and activations --------------------------------------------------------------

_UNARY = {
    "neg": "Neg", "abs": "Abs", "exp": "Exp", "log": "Log", "sqrt": "Sqrt", "reciprocal": "Reciprocal",
    "tanh": "Tanh", "cos": "Cos", "sin": "Sin", "floor": "Floor", "ceil": "Ceil", "sign": "Sign",
    "relu": "Relu", "sigmoid": "Sigmoid", "erf": "Erf",
}


def _unary(op: str) -> Any:
    def convert(cx: Lowering, node: Any) -> Value:
        return cx.op(op, [cx.value(node.args[0], cx.out_dtype())])

    return convert


for _name, _op in _UNARY.items():
    converts(f"aten.{_name}")(_unary(_op))


@converts("aten.round")
def round_(cx: Lowering, node: Any) -> Value:
    if cx.args().get("decimals", 0):
        raise Unsupported("aten.round with decimals")
    return cx.op("Round", [cx.value(node.args[0], cx.out_dtype())])


@converts("aten.rsqrt")
def rsqrt(cx: Lowering, node: Any) -> Value:
    return cx.op("Reciprocal", [cx.op("Sqrt", [cx.value(node.args[0], cx.out_dtype())])])


@converts("aten.square")
def square(cx: Lowering, node: Any) -> Value:
    x = cx.value(node.args[0], cx.out_dtype())
    return cx.op("Mul", [x, x])


@converts("aten.log1p")
def log1p(cx: Lowering, node: Any) -> Value:
    dtype = cx.out_dtype()
    return cx.op("Log", [cx.op("Add", [cx.value(node.args[0], dtype), cx.const(1, dtype)])])


@converts("aten.expm1")
def expm1(cx: Lowering, node: Any) -> Value:
    dtype = cx.out_dtype()
    return cx.op("Sub", [cx.op("Exp", [cx.value(node.args[0], dtype)]), cx.const(1, dtype)])


@converts("aten.trunc")
def trunc(cx: Lowering, node: Any) -> Value:
    x = cx.value(node.args[0], cx.out_dtype())
    return cx.op("Mul", [cx.op("Sign", [x]), cx.op("Floor", [cx.op("Abs", [x])])])


@converts("aten.silu")
def silu(cx: Lowering, node: Any) -> Value:
    """silu(x) = x * sigmoid(x): the form ONNX exports produce too."""
    x = cx.value(node.args[0], cx.out_dtype())
    return cx.op("Mul", [x, cx.op("Sigmoid", [x])])


@converts("aten.gelu")
def gelu(cx: Lowering, node: Any) -> Value:
    a = cx.args()
    return cx.op("Gelu", [cx.value(a["self"], cx.out_dtype())], {"approximate": a.get("approximate") or "none"})


@converts("aten.leaky_relu")
def leaky_relu(cx: Lowering, node: Any) -> Value:
    a = cx.args()
    return cx.op("LeakyRelu", [cx.value(a["self"], cx.out_dtype())], {"alpha": float(a["negative_slope"])})


@converts("aten.softplus")
def softplus(cx: Lowering, node: Any) -> Value:
    """softplus(x, beta, threshold) = log(1 + exp(beta x)) / beta, linear above threshold."""
    a = cx.args()
    dtype = cx.out_dtype()
    x = cx.value(a["self"], dtype)
    beta, threshold = float(a["beta"]), float(a["threshold"])
    bx = x if beta == 1 else cx.op("Mul", [x, cx.const(beta, dtype)])
    soft = cx.op("Softplus", [bx])
    if beta != 1:
        soft = cx.op("Div", [soft, cx.const(beta, dtype)])
    linear = cx.op("Greater", [bx, cx.const(threshold, dtype)])
    return cx.op("Where", [linear, x, soft])


@converts("aten.hardsigmoid")
def hardsigmoid(cx: Lowering, node: Any) -> Value:
    dtype = cx.out_dtype()
    x = cx.value(node.args[0], dtype)
    y = cx.op("Add", [cx.op("Div", [x, cx.const(6.0, dtype)]), cx.const(0.5, dtype)])
    return cx.op("Clip", [y, cx.const(0.0, dtype), cx.const(1.0, dtype)])


@converts("aten.hardswish")
def hardswish(cx: Lowering, node: Any) -> Value:
    x = cx.value(node.args[0], cx.out_dtype())
    return cx.op("Mul", [x, hardsigmoid(cx, node)])


@converts("aten.elu")
def elu(cx: Lowering, node: Any) -> Value:
    a = cx.args()
    dtype = cx.out_dtype()
    if a.get("scale", 1) != 1 or a.get("input_scale", 1) != 1:
        raise Unsupported("aten.elu with scale")
    x = cx.value(a["self"], dtype)
    neg = cx.op("Mul", [cx.op("Sub", [cx.op("Exp", [x]), cx.const(1.0, dtype)]), cx.const(float(a["alpha"]), dtype)])
    return cx.op("Where", [cx.op("Greater", [x, cx.const(0.0, dtype)]), x, neg])


# -- casts and copies ------------------------------------------------------------------------


@converts("aten.to", "aten._to_copy", "aten.type_as", "aten.clone", "aten.contiguous", "aten.alias",
          "aten.detach", "aten.detach_", "aten.lift_fresh_copy", "aten.dropout", "aten.feature_dropout", "aten.alpha_dropout",
          "aten._unsafe_view_copy", "aten.resolve_conj", "aten.resolve_neg", "aten.copy")
def passthrough(cx: Lowering, node: Any) -> Any:
    """Ops that keep the values: the importer casts to torch's dtype afterwards. (`detach_` is in
    place, but changes no value: the graph's other readers of its input see the same values.)"""
    key = str(node.target)
    if key.startswith("aten.copy."):
        return cx.value(node.args[1])  # copy(self, src): src's values in self's shape (same here)
    weight = cx.weight_or_none(node.args[0])
    if weight is not None and same_weight(node, node.args[0]):
        return weight  # still the parameter: a linear reading it gets the stored [K, N] form
    return cx.value(node.args[0])


@converts("aten._assert_tensor_metadata", "aten._assert_scalar", "aten.sym_constrain_range_for_size",
          "aten.sym_constrain_range", "aten._assert_async", "aten._functional_assert_async",
          "aten._functional_sym_constrain_range_for_size", "aten._functional_assert_scalar")
def assertion(cx: Lowering, node: Any) -> None:
    """Runtime checks torch.export leaves in the graph: nothing to compute."""
    return None


@converts("operator.getitem")
def getitem(cx: Lowering, node: Any) -> Any:
    items = cx.lookup(node.args[0])
    return items[node.args[1]]


@converts("aten.scalar_tensor")
def scalar_tensor(cx: Lowering, node: Any) -> Value:
    return cx.value(node.args[0], cx.out_dtype())
