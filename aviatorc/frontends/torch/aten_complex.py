"""Complex tensors as pairs of real ones: Llama 4's rotary embedding.

Llama 4 rotates queries and keys by multiplying `view_as_complex` pairs of features by unit
complex frequencies from `polar`, then reads the result back with `view_as_real`. The IR has no
complex element type, so a complex value is carried as `Complex(re, im)` and its ops become
real arithmetic:

    polar(r, theta)          -> (r cos theta, r sin theta)
    view_as_complex(x[.., 2]) -> (x[.., 0], x[.., 1])
    a * b                    -> (a.re b.re - a.im b.im, a.re b.im + a.im b.re)   (or a real factor)
    view_as_real(c)          -> stack(re, im) on a new last axis

Shape and copy ops (unsqueeze, views, casts, slices) apply to each part with their own
converters. Anything else on a complex value is reported unsupported by name.
"""

from __future__ import annotations

from typing import Any

from aviatorc.frontends.torch.aten import converts
from aviatorc.frontends.torch.importer import REAL_PARTS, Complex, Converter, Lowering, Unsupported, _settle, op_key
from aviatorc.ir import Value

# Ops whose meaning on a complex tensor is the same op on each part.
PER_PART = frozenset({"aten.unsqueeze", "aten.squeeze", "aten.view", "aten.reshape", "aten._unsafe_view",
                      "aten.expand", "aten.to", "aten._to_copy", "aten.clone", "aten.contiguous", "aten.alias",
                      "aten.detach", "aten.slice", "aten.select", "aten.permute", "aten.transpose",
                      "aten._assert_tensor_metadata", "aten.index", "aten.cat", "aten.flatten"})


@converts("aten.polar")
def polar(cx: Lowering, node: Any) -> Complex:
    dtype = REAL_PARTS[str(cx.meta().dtype)]
    r, theta = cx.value(node.args[0], dtype), cx.value(node.args[1], dtype)
    return Complex(cx.op("Mul", [r, cx.op("Cos", [theta])]), cx.op("Mul", [r, cx.op("Sin", [theta])]))


@converts("aten.view_as_complex")
def view_as_complex(cx: Lowering, node: Any) -> Complex:
    import numpy as np

    x = cx.value(node.args[0])
    parts = [cx.op("Gather", [x, cx.const(np.asarray(i, np.int64))], {"axis": x.type.rank - 1}) for i in (0, 1)]
    return Complex(parts[0], parts[1])


@converts("aten.view_as_real")
def view_as_real(cx: Lowering, node: Any) -> Value:
    c = cx.lookup(node.args[0])
    if not isinstance(c, Complex):
        raise Unsupported("aten.view_as_real of a real tensor")
    axis = cx.ints([-1])
    return cx.op("Concat", [cx.op("Unsqueeze", [c.re, axis]), cx.op("Unsqueeze", [c.im, axis])], {"axis": -1})


def convert_complex(cx: Lowering, node: Any, converter: Converter) -> Any:
    """A node reading a complex value: native complex ops, complex arithmetic, or per part."""
    key = op_key(node.target)
    if key == "aten.view_as_real":
        return _settle(cx, node, converter(cx, node))
    if key == "aten.mul":
        return _settle(cx, node, _multiply(cx, node))
    if key not in PER_PART:
        raise Unsupported(f"{node.target} on a complex tensor")
    complex_args = {arg: cx.lookup(arg) for arg in node.all_input_nodes if isinstance(cx.lookup(arg), Complex)}
    parts = []
    for part in ("re", "im"):
        values = {arg: getattr(c, part) for arg, c in complex_args.items()}
        parts.append(cx.convert_with(node, converter, values, settle=False))
    if parts[0] is None:  # an assertion
        return None
    return _settle(cx, node, Complex(parts[0], parts[1]))


def _multiply(cx: Lowering, node: Any) -> Complex:
    a, b = (cx.lookup(arg) for arg in node.args[:2])
    dtype = REAL_PARTS[str(cx.meta().dtype)]
    if isinstance(a, Complex) and isinstance(b, Complex):
        re = cx.op("Sub", [cx.op("Mul", [a.re, b.re]), cx.op("Mul", [a.im, b.im])])
        im = cx.op("Add", [cx.op("Mul", [a.re, b.im]), cx.op("Mul", [a.im, b.re])])
        return Complex(re, im)
    c, factor = (a, node.args[1]) if isinstance(a, Complex) else (b, node.args[0])
    if isinstance(cx.lookup(factor), Complex):
        raise Unsupported("aten.mul of complex values")
    f = cx.value(factor, dtype)
    return Complex(cx.op("Mul", [c.re, f]), cx.op("Mul", [c.im, f]))

