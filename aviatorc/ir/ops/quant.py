"""Quantization ops: a packed weight read back as float32, and fake-quantized activations.

`DequantizeWeight(values, scale?, zero?, indices?)` turns a weight stored in one of the
`WeightFormat` layouts (see `aviatorc.quant.rtn`) into the float32 [k, n] matrix a MatMul
reads. Its inputs are initializers holding the stored bytes exactly, so their sizes add up
to `WeightFormat.storage_bytes(k, n)`; the partitioner reads the format back with
`WeightFormat.from_attrs(node.attrs)`. The type rule checks every input against the layout.
Every stored array keeps whole output columns in its last axis, zero points and 2:4 indices
included, so a column strip of the weight is a plain slice of each array (`aviatorc.quant.tiles`).

`QuantizeActivation(x)` rounds x to an 8-bit grid (scale and zero point from calibration)
and returns it dequantized: the numerics of a W8A8 MatMul without integer kernels.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from aviatorc.errors import ModelFormatError
from aviatorc.formats import WeightFormat
from aviatorc.ir.ops.elementwise import same_rule
from aviatorc.ir.ops.registry import REQUIRED, InferContext, register
from aviatorc.ir.types import FLOAT_DTYPES, Dim, TensorType, format_shape

ROLES = ("values", "scale", "zero", "indices")
_FLOAT_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


# -- the stored layout (documented in aviatorc.quant.rtn, which writes it) ---------------
#
# Every stored array is [rows, N] (or [N]) with whole output columns in its last axis, so a
# column strip [n0, n1) of a weight is `arr[..., n0:n1]` of each array and is itself the
# layout of a [K, n1 - n0] weight (`aviatorc.quant.tiles` slices them).


def stored_rows(fmt: WeightFormat, k: int) -> int:
    """Rows of K actually stored: K, or the kept rows under 2:4."""
    return math.ceil(k / 4) * 2 if fmt.sparsity == "2:4" else k


def packed_layout(fmt: WeightFormat, k: int, n: int) -> list[tuple[str, str, tuple[int, ...]] | None]:
    """(role, dtype, shape) of each stored array in `DequantizeWeight` input order; None where absent."""
    ks = stored_rows(fmt, k)
    slots: list[tuple[str, str, tuple[int, ...]] | None] = [None, None, None, None]
    if fmt.kind in _FLOAT_DTYPES:
        slots[0] = ("values", _FLOAT_DTYPES[fmt.kind], (ks, n))
    elif not fmt.grouped:  # int8 per output channel
        slots[0] = ("values", "int8", (ks, n))
        slots[1] = ("scale", "float16", (n,))
    else:
        groups = math.ceil(ks / fmt.group_size)
        k_pad = groups * fmt.group_size
        if fmt.bits == 4:
            slots[0] = ("values", "uint8", (math.ceil(k_pad / 2), n))
        else:
            slots[0] = ("values", "int8", (k_pad, n))
        slots[1] = ("scale", "uint8" if fmt.kind.startswith("mx") else "float16", (groups, n))
        if fmt.float_zero:
            slots[2] = ("zero", "float16", (groups, n))  # an fp16 offset per (group, column)
        elif fmt.kind == "int4" and not fmt.symmetric:
            slots[2] = ("zero", "uint8", (math.ceil(groups / 2), n))  # two groups per byte, along G
    if fmt.sparsity == "2:4":
        slots[3] = ("indices", "uint8", (math.ceil(ks / 4), n))  # four kept rows per byte, along Ks
    while slots and slots[-1] is None:
        slots.pop()
    return slots


def layout_mismatch(fmt: WeightFormat, k: int, n: int,
                    stored: Sequence[tuple[str, tuple[Dim, ...]] | None]) -> str | None:
    """Why stored (dtype, shape) pairs, in input order, are not the layout of a [k, n] weight in
    `fmt`; None when they are. Shared by the type rule and the tile readers."""
    layout = packed_layout(fmt, k, n)
    for index in range(max(len(layout), len(stored))):
        slot = layout[index] if index < len(layout) else None
        got = stored[index] if index < len(stored) else None
        if slot is None and got is not None:
            return f"format {fmt.name} takes no '{ROLES[index]}' input (input {index})"
        if slot is None:
            continue
        role, dtype, shape = slot
        if got is None:
            return f"format {fmt.name} needs the '{role}' input (input {index})"
        if got != (dtype, shape):
            return (f"'{role}' input is {got[0]}{format_shape(got[1])} but format {fmt.name} "
                    f"of a [{k}, {n}] weight stores {dtype}{format_shape(shape)}")
    return None


def _np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def unpack_bits_k(packed: np.ndarray, bits: int, rows: int) -> np.ndarray:
    """Inverse of `aviatorc.quant.rtn.pack_bits_k`: uint8 [ceil(rows * bits / 8), N] -> uint8
    [rows, N]; row r sits in byte row r // (8 / bits), bits (r % (8 / bits)) * bits up."""
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    out = np.empty((packed.shape[0] * per_byte,) + packed.shape[1:], dtype=np.uint8)
    for i in range(per_byte):
        out[i::per_byte] = (packed >> (bits * i)) & mask
    return out[:rows]


def unpack_nibbles_k(packed: np.ndarray, signed: bool) -> np.ndarray:
    """Inverse of pack_nibbles_k: uint8 [Kp/2, N] -> int16 [Kp, N] (sign-extended when `signed`)."""
    out = unpack_bits_k(packed, 4, packed.shape[0] * 2).astype(np.int16)
    if signed:
        out = np.where(out >= 8, out - 16, out).astype(np.int16)
    return out


def expand_24(values_KsN: np.ndarray, idx_KsN: np.ndarray, k: int) -> np.ndarray:
    """Inverse of compress_24: scatter kept values back to a dense [K, N] with zeros."""
    ks, n = values_KsN.shape
    dense = np.zeros((ks // 2, 4, n), values_KsN.dtype)
    np.put_along_axis(dense, idx_KsN.reshape(-1, 2, n).astype(np.int64), values_KsN.reshape(-1, 2, n), axis=1)
    return dense.reshape(-1, n)[:k]


def expand_groups(p_GN: np.ndarray, rows: int, g: int) -> np.ndarray:
    """Per-group parameters repeated to per-row, cut to `rows`."""
    return np.repeat(p_GN, g, axis=0)[:rows]


def dequantize(arrays: tuple[np.ndarray | None, ...] | list[np.ndarray | None], fmt: WeightFormat,
               k: int, n: int) -> np.ndarray:
    """The float32 [K, N] weight the stored arrays stand for: the `DequantizeWeight` kernel, and
    what `aviatorc.quant.tiles.dequantize_packed` runs on one tile's arrays."""
    arrays = list(arrays) + [None] * (4 - len(arrays))
    values, scale, zero, indices = arrays
    assert values is not None  # the type rule checked the inputs against the layout
    ks = stored_rows(fmt, k)
    if fmt.kind in _FLOAT_DTYPES:
        w = values.astype(np.float32)
    elif not fmt.grouped:  # int8 per output channel
        assert scale is not None
        w = values.astype(np.float32) * scale.astype(np.float32)[None, :]
    else:
        assert scale is not None
        g = fmt.group_size
        if fmt.bits == 4:
            codes = unpack_nibbles_k(values, signed=fmt.kind == "mxint4" or fmt.symmetric)
        else:
            codes = values.astype(np.int16)
        rows = scale.shape[0] * g  # Kp: an odd Kp leaves a padding nibble in the last byte row
        codes = codes[:rows]
        if fmt.kind.startswith("mx"):
            s = np.exp2(scale.astype(np.float32) - 127.0)
            z = np.zeros_like(s)
        else:
            s = scale.astype(np.float32)
            z = np.zeros_like(s)
            if fmt.float_zero:  # w = code * scale + offset
                assert zero is not None
                offset = expand_groups(zero.astype(np.float32), rows, g)
                w = codes.astype(np.float32) * expand_groups(s, rows, g) + offset
            elif not fmt.symmetric:
                assert zero is not None
                z = unpack_bits_k(zero, 4, s.shape[0]).astype(np.float32)
        if not fmt.float_zero:
            w = (codes.astype(np.float32) - expand_groups(z, rows, g)) * expand_groups(s, rows, g)
        w = w[:ks]
    if fmt.sparsity == "2:4":
        assert indices is not None
        w = expand_24(w, unpack_bits_k(indices, 2, ks), k)
    return np.ascontiguousarray(w[:k], dtype=np.float32)


def _weight_format(attrs: dict[str, Any]) -> WeightFormat:
    return WeightFormat.from_attrs(attrs)


def _dequantize_rule(ctx: InferContext) -> list[TensorType]:
    fmt = _weight_format(ctx.attrs)
    k, n = int(ctx.attrs["k"]), int(ctx.attrs["n"])
    stored = [(ctx.type(i).dtype, ctx.type(i).shape) if ctx.has(i) else None for i in range(len(ctx.types))]
    problem = layout_mismatch(fmt, k, n, stored)
    if problem:
        raise ModelFormatError(problem)
    return [TensorType("float32", (k, n))]


@register(
    "DequantizeWeight",
    inputs=(1, 4),
    infer=_dequantize_rule,
    attrs={"format": REQUIRED, "group_size": 0, "symmetric": 1, "sparsity": "", "zero": "int", "k": REQUIRED,
           "n": REQUIRED},
)
def dequantize_weight(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """DequantizeWeight(values, scale?, zero?, indices?): the float32 [k, n] weight of a packed layout."""
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
