"""Quantization ops: a packed weight read back as float32, and fake-quantized activations.

`DequantizeWeight(values, scale?, zero?, indices?)` turns a weight stored in one of the
`WeightFormat` layouts (see `aviatorc.quant.rtn`) into the float32 [k, n] matrix a MatMul
reads. Its inputs are initializers holding the stored bytes exactly, so their sizes add up
to `WeightFormat.storage_bytes(k, n)`; the partitioner reads the format back with
`WeightFormat.from_attrs(node.attrs)`. The type rule checks every input against the layout.

`QuantizeActivation(x)` rounds x to an 8-bit grid (scale and zero point from calibration)
and returns it dequantized: the numerics of a W8A8 MatMul without integer kernels.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from aviatorc.errors import ModelFormatError
from aviatorc.ir.ops.elementwise import same_rule
from aviatorc.ir.ops.registry import REQUIRED, InferContext, register
from aviatorc.ir.types import FLOAT_DTYPES, TensorType, format_shape

ROLES = ("values", "scale", "zero", "indices")


def _weight_format(attrs: dict[str, Any]):  # -> WeightFormat (import kept local: formats is above the IR)
    from aviatorc.formats import WeightFormat

    return WeightFormat.from_attrs(attrs)


def _dequantize_rule(ctx: InferContext) -> list[TensorType]:
    from aviatorc.quant.rtn import packed_layout

    fmt = _weight_format(ctx.attrs)
    k, n = int(ctx.attrs["k"]), int(ctx.attrs["n"])
    layout = packed_layout(fmt, k, n)
    for index in range(max(len(layout), len(ctx.types))):
        slot = layout[index] if index < len(layout) else None
        present = ctx.has(index)
        if slot is None and present:
            raise ModelFormatError(f"format {fmt.name} takes no '{ROLES[index]}' input (input {index})")
        if slot is None:
            continue
        role, dtype, shape = slot
        if not present:
            raise ModelFormatError(f"format {fmt.name} needs the '{role}' input (input {index})")
        actual = ctx.type(index)
        if actual.dtype != dtype or actual.shape != shape:
            raise ModelFormatError(
                f"'{role}' input is {actual.dtype}{format_shape(actual.shape)} but format {fmt.name} "
                f"of a [{k}, {n}] weight stores {dtype}{format_shape(shape)}"
            )
    return [TensorType("float32", (k, n))]


@register(
    "DequantizeWeight",
    inputs=(1, 4),
    infer=_dequantize_rule,
    attrs={"format": REQUIRED, "group_size": 0, "symmetric": 1, "sparsity": "", "k": REQUIRED, "n": REQUIRED},
)
def dequantize_weight(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """DequantizeWeight(values, scale?, zero?, indices?): the float32 [k, n] weight of a packed layout."""
    from aviatorc.quant.rtn import dequantize

    return [dequantize(ins, _weight_format(attrs), int(attrs["k"]), int(attrs["n"]))]


def _activation_rule(ctx: InferContext) -> list[TensorType]:
    t = ctx.type(0)
    if t.dtype not in FLOAT_DTYPES:
        raise ModelFormatError(f"QuantizeActivation needs a float input, got {t.dtype}")
    return same_rule(ctx)


@register("QuantizeActivation", inputs=1, infer=_activation_rule,
          attrs={"scale": REQUIRED, "zero_point": 0, "qmin": -128, "qmax": 127})
def quantize_activation(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """QuantizeActivation(x): x rounded to the integer grid (scale, zero_point, qmin..qmax), dequantized."""
    x = ins[0]
    scale, zero = float(attrs["scale"]), float(attrs["zero_point"])
    q = np.clip(np.round(x / scale) + zero, attrs["qmin"], attrs["qmax"])
    return [((q - zero) * scale).astype(x.dtype)]
