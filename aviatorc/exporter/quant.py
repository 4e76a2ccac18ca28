"""A packed weight as standard ONNX: `DequantizeLinear` (QDQ), or `com.microsoft.MatMulNBits`.

`weight_codes` turns a `DequantizeWeight`'s stored arrays (layouts in `aviatorc.quant.rtn`)
into the integer codes, scales and zero points they hold, unchanged:

- int8 (per output channel): int8 codes [K, N], one scale per column: `DequantizeLinear(axis=1)`.
- int8 g (group-wise: int8 codes), int4 g (symmetric int4 codes -8..7, or asymmetric uint4 codes
  0..15 with uint4 zero points), mxint8 / mxint4 (int8 / int4 codes): a scale per block of g rows
  of a column,
  `DequantizeLinear(axis=0, block_size=g)` (opset 21). An MX block's shared exponent e is the
  scale 2^(e - 127), exactly representable in float32.
- int4 with fp16 offsets (w = code * scale + offset): uint4 codes through `DequantizeLinear`
  (zero point 0), then the offset of each block added (`offset_GN`, broadcast along its rows);
  in `MatMulNBits`, a float zero point -offset / scale per block (equal up to float rounding).
- 2:4 sparse weights are exported dense-equivalent: the kept codes go back to their rows and
  the pruned ones become the zero point (0, or the group's zero point), so they dequantize to
  exactly 0. A group of g kept values spans 2g dense rows, so the block size doubles.

Scales are float32 (the fp16 scales widen exactly): with an fp16 scale, DequantizeLinear's
output would be fp16 and the products would round, where the IR's kernel multiplies in float32.

`MatMulNBits` (`--matmul-nbits`) takes B as uint8 [N, blocks, block * bits / 8]: 4-bit codes
packed two per byte along K, low nibble first, or (bits=8: group-wise int8 and mxint8) one code
per byte; scales [N, blocks]; optional uint8 zero points (4-bit: [N * ceil(blocks / 2)], two
blocks per byte along K, low nibble first) or float zero points in the scales' type ([N * blocks]); with no zero points the zero point is 2^(bits - 1)
(8 or 128), so symmetric codes are stored as code + 8 or code + 128. Its block size must be a
power of two, at least 16, so per-channel int8 (no block) stays QDQ. The 8-bit form runs on
onnxruntime's CPU provider (checked on 1.32: parity with the IR's kernel in the exporter tests);
older releases and other providers may take 4-bit only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from aviatorc.formats import WeightFormat
from aviatorc.ir.ops.quant import _FLOAT_DTYPES, expand_24, stored_rows, unpack_bits_k, unpack_nibbles_k
from aviatorc.quant.rtn import pack_bits_k


@dataclass(frozen=True, eq=False)
class WeightCodes:
    """A quantized [k, n] weight as ONNX sees it: dense codes, scales, zero points."""

    codes_KN: np.ndarray  # int16 [k, n], dense-equivalent (2:4 pruned slots hold the zero point)
    scale: np.ndarray  # float32 [blocks, n] (blocked) or [n] (per channel)
    zero_GN: np.ndarray | None  # uint8 [blocks, n]: asymmetric int4 only
    block_size: int  # 0: per output channel
    onnx_type: str  # "int8", "int4" or "uint4": the element type of the codes
    offset_GN: np.ndarray | None = None  # float32 [blocks, n]: int4 with fp16 offsets, added after the codes

    @property
    def signed(self) -> bool:
        return self.onnx_type != "uint4"

    @property
    def bits(self) -> int:
        return 8 if self.onnx_type == "int8" else 4


def weight_codes(fmt: WeightFormat, arrays: list[np.ndarray | None], k: int, n: int) -> WeightCodes:
    """The codes, scales and zero points of a `DequantizeWeight`'s stored arrays (not a float format)."""
    arrays = list(arrays) + [None] * (4 - len(arrays))
    values, scale, zero, indices = arrays
    assert values is not None and scale is not None  # the IR's type rule checked the layout
    ks = stored_rows(fmt, k)
    zero_GN: np.ndarray | None = None
    offset_GN: np.ndarray | None = None
    if fmt.kind == "int8" and not fmt.grouped:  # per output channel
        codes, scales, block, onnx_type = values.astype(np.int16), scale.astype(np.float32), 0, "int8"
    else:
        if fmt.bits == 4:
            signed = fmt.kind == "mxint4" or fmt.symmetric
            codes = unpack_nibbles_k(values, signed=signed)
            onnx_type = "int4" if signed else "uint4"
        else:
            codes, onnx_type = values.astype(np.int16), "int8"
        codes = codes[:ks]  # the rows padding the last group are not part of the weight
        if fmt.kind.startswith("mx"):
            scales = np.exp2(scale.astype(np.float32) - np.float32(127.0)).astype(np.float32)
        else:
            scales = scale.astype(np.float32)
        if fmt.float_zero:
            assert zero is not None
            offset_GN = zero.astype(np.float32)
        elif fmt.kind == "int4" and not fmt.symmetric:
            assert zero is not None
            zero_GN = unpack_bits_k(zero, 4, scale.shape[0])
        block = fmt.group_size
    if fmt.sparsity == "2:4":
        assert indices is not None
        index = unpack_bits_k(indices, 2, ks)
        kept = expand_24(np.ones(codes.shape, bool), index, k)
        codes = expand_24(codes, index, k)
        if zero_GN is not None:  # a pruned slot must read back as 0: the zero point of its group
            codes = np.where(kept, codes, np.repeat(zero_GN, 2 * block, axis=0)[:k].astype(np.int16))
        block *= 2  # g kept values span 2g dense rows
    return WeightCodes(np.ascontiguousarray(codes, dtype=np.int16), scales, zero_GN, block, onnx_type, offset_GN)


def dense_values(fmt: WeightFormat, arrays: list[np.ndarray | None], k: int) -> np.ndarray:
    """A float-format (fp32 / fp16 / bf16) `DequantizeWeight`'s [k, n] values, 2:4 expanded, dtype kept."""
    assert fmt.kind in _FLOAT_DTYPES
    values = arrays[0]
    assert values is not None
    if fmt.sparsity == "2:4":
        indices = arrays[3]
        assert indices is not None
        return expand_24(values, unpack_bits_k(indices, 2, stored_rows(fmt, k)), k)
    return values[:k]


def codes_array(codes: WeightCodes) -> np.ndarray:
    """The codes in their ONNX element type (ml_dtypes int4 / uint4 for 4-bit)."""
    import ml_dtypes

    kind = {"int8": np.int8, "int4": ml_dtypes.int4, "uint4": ml_dtypes.uint4}[codes.onnx_type]
    return codes.codes_KN.astype(kind)


def matmul_nbits_ok(codes: WeightCodes) -> str | None:
    """Why MatMulNBits cannot hold these codes; None when it can."""
    block = codes.block_size
    if codes.offset_GN is not None and np.any((codes.scale == 0) & (codes.offset_GN != 0)):
        return "a block with a zero scale and a nonzero offset has no MatMulNBits zero point"
    if not block:
        return "per-channel int8 has no block along K, which MatMulNBits needs (compile with --group-size)"
    if block < 16 or block & (block - 1):
        return f"MatMulNBits needs a power-of-two block size of at least 16, not {block}"
    return None


def matmul_nbits_arrays(codes: WeightCodes) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """B uint8 [N, blocks, block * bits / 8], scales float32 [N, blocks], zero points: uint8
    [N * ceil(blocks / 2)] (asymmetric 4-bit), or float32 [N * blocks] for fp16 offsets
    (code * scale + offset = (code - zero) * scale with zero = -offset / scale)."""
    k, n = codes.codes_KN.shape
    block, bits = codes.block_size, codes.bits
    blocks = codes.scale.shape[0]
    zero = 1 << (bits - 1)  # MatMulNBits' zero point when none is given: 8, or 128 for 8 bits
    unsigned = codes.codes_KN + zero if codes.signed else codes.codes_KN
    pad = np.full((blocks * block - k, n), zero, np.int16)
    if codes.zero_GN is not None:  # padding rows read back as 0: their block's zero point
        pad = np.repeat(codes.zero_GN, block, axis=0)[k:].astype(np.int16)
    rows = np.concatenate([unsigned, pad], axis=0)
    packed_KN = pack_bits_k(rows, 4) if bits == 4 else rows.astype(np.uint8)  # [blocks * block * bits / 8, n]
    b = np.ascontiguousarray(packed_KN.T.reshape(n, blocks, block * bits // 8))
    scales = np.ascontiguousarray(codes.scale.T)
    zeros = None
    if codes.zero_GN is not None:
        zeros = np.ascontiguousarray(pack_bits_k(codes.zero_GN, 4).T).reshape(-1)
    elif codes.offset_GN is not None:
        with np.errstate(divide="ignore", invalid="ignore"):  # a zero scale with a zero offset: any zero point
            zero_GN = np.where(codes.scale == 0, 0, -codes.offset_GN / codes.scale).astype(np.float32)
        zeros = np.ascontiguousarray(zero_GN.T).reshape(-1)
    return b, scales, zeros
