"""Storage layouts, packing and round-to-nearest quantization of [K, N] weights.

One layout per `WeightFormat`, laid out so the stored arrays' byte sizes add up exactly to
`WeightFormat.storage_bytes(K, N)` (tests pin this). The arrays are, in the order
`DequantizeWeight` takes them:

    values   fp32/fp16/bf16 [Ks, N] | int8 per channel [Ks, N] | int4 and mxint4: uint8 [ceil(Kp/2), N],
             two 4-bit codes per byte along K (row 2i in the low nibble) | int8 group-wise and
             mxint8: int8 [Kp, N]
    scale    int8 per channel: fp16 [N] | int4 and int8 group-wise: fp16 [G, N] | mx: uint8 [G, N]
             biased exponents (2^(e-127))
    zero     asymmetric int4 only: uint8 [ceil(G/2), N], the 4-bit zero points of two groups
             of one column per byte, along G (group 2j in the low nibble)
    indices  2:4 only: uint8 [ceil(Ks/4), N], the 2-bit position (0..3) of each kept value in
             its group of four, four kept rows of one column per byte, along Ks (kept row 4j
             in the low bits)

Every array holds whole columns in its last axis, so the stored arrays of a column strip
[n0, n1) are `arr[..., n0:n1]` of each, and they are the layout of a [K, n1 - n0] weight
(`aviatorc.quant.tiles` is the one place that slices them).

Ks is K, or the kept rows under 2:4 (two of every four, K padded to a multiple of 4); groups
of `group_size` run along Ks, and a ragged last group is padded to Kp = G * group_size with
zeros (SmolLM2's K = 576 with groups of 128). Under 2:4 a group of g kept values therefore
covers 2g rows of the dense weight.

Asymmetric int4 with an fp16 offset (`WeightFormat.zero == "fp16"`, the data-free default:
`offset_params`) stores the offset in the zero slot as fp16 [G, N], and w = code * scale + offset.

Grids: int8 is symmetric, codes -127..127, scale = amax / 127, per output channel or (with a
group size) per group along K, as int4's groups (the group-wise form keeps one outlier row from
setting the scale of every row of its column). int4 is
per group: symmetric codes -8..7 with scale = amax / 7, or asymmetric codes 0..15 with
scale = (max - min) / 15 and a zero point. mxint8 / mxint4 share a power-of-two scale per
group (the 8-bit exponent), codes -127..127 / -8..7. Scales are rounded to fp16 *before*
the codes are computed, so the stored scale is the one the codes were made with and
|w - dequant(w)| <= scale / 2 holds for the stored scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from aviatorc.formats import WeightFormat

# The layout and its reading live beside the DequantizeWeight op (the IR layer); re-exported here.
from aviatorc.ir.ops.quant import (  # noqa: F401
    _FLOAT_DTYPES,
    _np_dtype,
    dequantize,
    expand_24,
    expand_groups,
    packed_layout,
    stored_rows,
    unpack_bits_k,
    unpack_nibbles_k,
)

FP16_TINY = 2.0**-14  # smallest normal fp16: scales below it would lose precision


@dataclass(frozen=True)
class Grid:
    """The integer code range of a format and whether its scale is a power of two."""

    lo: int
    hi: int
    pow2: bool = False


def grid(fmt: WeightFormat) -> Grid:
    if fmt.kind == "int8":
        return Grid(-127, 127)
    if fmt.kind == "int4":
        return Grid(-8, 7) if fmt.symmetric else Grid(0, 15)
    if fmt.kind == "mxint8":
        return Grid(-127, 127, pow2=True)
    if fmt.kind == "mxint4":
        return Grid(-8, 7, pow2=True)
    raise ValueError(f"format {fmt.kind} has no integer grid")


# -- layout ------------------------------------------------------------------------------


def group_rows(fmt: WeightFormat, k: int) -> int:
    """Rows (of the stored K) sharing one scale: the whole column for per-channel int8, else the group."""
    return fmt.group_size if fmt.grouped else stored_rows(fmt, k)


def layout_bytes(fmt: WeightFormat, k: int, n: int) -> int:
    """Bytes of the stored arrays (equal to fmt.storage_bytes(k, n) by construction)."""
    total = 0
    for slot in packed_layout(fmt, k, n):
        if slot is not None:
            total += math.prod(slot[2]) * np.dtype(_np_dtype(slot[1])).itemsize
    return total


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """A weight as stored: the format, its dense shape, and the arrays in input order."""

    fmt: WeightFormat
    k: int
    n: int
    arrays: tuple[np.ndarray | None, ...]

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays if a is not None)

    def dequantize(self) -> np.ndarray:
        return dequantize(self.arrays, self.fmt, self.k, self.n)


# -- bit packing -------------------------------------------------------------------------


def pack_bits_k(codes: np.ndarray, bits: int) -> np.ndarray:
    """[R, N] codes (the low `bits` bits kept; 2 or 4) -> uint8 [ceil(R * bits / 8), N], packed
    along the rows of each column: row r in byte row r // (8 / bits), bits (r % (8 / bits)) * bits
    up. R is padded with zero codes to whole bytes."""
    per_byte = 8 // bits
    u = (codes.astype(np.int16) & ((1 << bits) - 1)).astype(np.uint8)
    u = _pad_rows(u, math.ceil(u.shape[0] / per_byte) * per_byte)
    out = np.zeros((u.shape[0] // per_byte,) + u.shape[1:], np.uint8)
    for i in range(per_byte):
        out |= u[i::per_byte] << (bits * i)
    return out


def pack_nibbles_k(codes: np.ndarray) -> np.ndarray:
    """[Kp, N] codes (any ints; the low 4 bits kept) -> uint8 [Kp/2, N], row 2i in the low nibble."""
    return pack_bits_k(codes, 4)


# -- 2:4 compression ---------------------------------------------------------------------


def compress_24(w_KN: np.ndarray, mask_KN: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Kept values [Ks, N] and their positions (0..3) in each group of four rows.

    `mask_KN` marks the kept entries; a group with fewer than two marked entries (only in
    the zero padding of a K that is not a multiple of 4) keeps its first unmarked ones.
    """
    k, n = w_KN.shape
    k4 = math.ceil(k / 4) * 4
    w = np.zeros((k4, n), w_KN.dtype)
    w[:k] = w_KN
    m = np.zeros((k4, n), bool)
    m[:k] = mask_KN
    w_G4N, m_G4N = w.reshape(-1, 4, n), m.reshape(-1, 4, n)
    if (m_G4N.sum(axis=1) > 2).any():
        raise ValueError("2:4 mask keeps more than two of four in some group")
    # Stable order: kept positions first (in position order), then the rest.
    order = np.argsort(~m_G4N, axis=1, kind="stable")[:, :2, :]
    order = np.sort(order, axis=1)
    values = np.take_along_axis(w_G4N, order, axis=1).reshape(-1, n)
    return values, order.reshape(-1, n).astype(np.uint8)


# -- scales and codes --------------------------------------------------------------------


def _pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
    if x.shape[0] == rows:
        return x
    out = np.zeros((rows,) + x.shape[1:], x.dtype)
    out[: x.shape[0]] = x
    return out


def quant_params(
    values_KN: np.ndarray,
    fmt: WeightFormat,
    *,
    clip_search: bool = False,
    row_weight: np.ndarray | None = None,
    rows_per_group: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Scale and zero point per (group, column) for values laid out [K, N] along the stored K.

    Returns float32 arrays of shape [G, N] (G = 1 for per-channel int8); the scale is already rounded to
    what is stored (fp16, or a power of two for mx). With `clip_search`, each group tries
    ranges shrunk by up to 25% and keeps the one with the least squared error, weighted
    per row by `row_weight` (for example the diagonal of the activation Hessian).
    `rows_per_group` overrides the format's group (GPTQ passes one group at a time). With an fp16
    offset (`fmt.float_zero`) the zero is the offset, fit by `offset_params` (no clip search: the
    least-squares refit already trades range for error).
    """
    if fmt.float_zero:
        return offset_params(values_KN, fmt, row_weight=row_weight, rows_per_group=rows_per_group)
    g = rows_per_group or (fmt.group_size if fmt.grouped else values_KN.shape[0])
    groups = math.ceil(values_KN.shape[0] / g)
    x = _pad_rows(values_KN.astype(np.float32), groups * g).reshape(groups, g, -1)
    rw = None
    if row_weight is not None:
        rw = _pad_rows(row_weight.astype(np.float32), groups * g).reshape(groups, g, 1)
    ratios = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75) if clip_search else (1.0,)
    best_scale = best_zero = best_err = None
    for ratio in ratios:
        scale, zero = _params_for_range(x.min(axis=1) * ratio, x.max(axis=1) * ratio, fmt)
        if len(ratios) == 1:
            return scale, zero
        err = (fake_quant(x, scale[:, None, :], zero[:, None, :], fmt) - x) ** 2
        err = (err * rw if rw is not None else err).sum(axis=1)
        if best_err is None:
            best_scale, best_zero, best_err = scale, zero, err
        else:
            assert best_scale is not None and best_zero is not None
            better = err < best_err
            best_scale = np.where(better, scale, best_scale)
            best_zero = np.where(better, zero, best_zero)
            best_err = np.minimum(err, best_err)
    return best_scale, best_zero  # type: ignore[return-value]


def offset_params(values_KN: np.ndarray, fmt: WeightFormat, *, row_weight: np.ndarray | None = None,
                  rows_per_group: int | None = None, refits: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """Scale and fp16 offset per (group, column) of asymmetric int4 with an fp16 offset, chosen to
    minimise the squared error of each group (float32 [G, N] each, fp16-exact), each row's error
    weighted by `row_weight` where given (for example the diagonal of the activation Hessian).

    Starts from the group's range (scale (max - min) / 15, offset min: llama.cpp's Q4_1, which
    holds a Q4_1 weight exactly), then `refits` times: the codes of the current scale and offset,
    and the least-squares line through (code, weight) as the next scale and offset, kept per
    group only where it lowers the error (HQQ's alternating fit, in closed form for squared
    error). Measured on SmolLM2-135M (tools/bench_int4_default.py, BENCHMARKS.md)."""
    g = rows_per_group or fmt.group_size
    q = grid(fmt)
    groups = math.ceil(values_KN.shape[0] / g)
    x = _pad_rows(values_KN.astype(np.float64), groups * g).reshape(groups, g, -1)
    rw = np.ones((groups, g, 1)) if row_weight is None else _pad_rows(row_weight.astype(np.float64), groups * g).reshape(groups, g, 1)
    rw = np.where(rw.sum(axis=1, keepdims=True) > 0, rw, 1.0)  # a group no input reaches: plain squared error
    lo, hi = x.min(axis=1), x.max(axis=1)

    def fp16(a: np.ndarray) -> np.ndarray:
        return a.astype(np.float16).astype(np.float64)

    def fit(scale: np.ndarray, offset: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        codes = np.clip(np.round((x - offset[:, None, :]) / scale[:, None, :]), q.lo, q.hi)
        return codes, (rw * (codes * scale[:, None, :] + offset[:, None, :] - x) ** 2).sum(axis=1)

    scale = fp16(np.where(hi > lo, np.maximum((hi - lo) / q.hi, FP16_TINY), 1.0))
    offset = fp16(lo)
    codes, err = fit(scale, offset)
    for _ in range(refits):
        total = rw.sum(axis=1)
        mean_code, mean_x = (rw * codes).sum(axis=1) / total, (rw * x).sum(axis=1) / total
        dc = codes - mean_code[:, None, :]
        var = (rw * dc**2).sum(axis=1)
        slope = (rw * dc * (x - mean_x[:, None, :])).sum(axis=1) / np.where(var > 0, var, 1.0)
        new_scale = fp16(np.where((var > 0) & (slope > FP16_TINY), slope, scale))
        new_offset = fp16(mean_x - new_scale * mean_code)
        new_codes, new_err = fit(new_scale, new_offset)
        better = new_err < err
        scale, offset, err = np.where(better, new_scale, scale), np.where(better, new_offset, offset), np.minimum(err, new_err)
        codes = np.where(better[:, None, :], new_codes, codes)
    return scale.astype(np.float32), offset.astype(np.float32)


def _params_for_range(lo: np.ndarray, hi: np.ndarray, fmt: WeightFormat) -> tuple[np.ndarray, np.ndarray]:
    q = grid(fmt)
    if q.pow2:
        amax = np.maximum(np.abs(lo), np.abs(hi))
        with np.errstate(divide="ignore"):
            e = np.ceil(np.log2(amax / q.hi))
        e = np.where(amax > 0, e, -127.0)
        e = np.clip(e, -127, 127)
        return (2.0**e).astype(np.float32), np.zeros_like(e, dtype=np.float32)
    if q.lo < 0:  # symmetric
        amax = np.maximum(np.abs(lo), np.abs(hi))
        scale = amax / q.hi
        zero = np.zeros_like(scale)
    else:
        lo, hi = np.minimum(lo, 0), np.maximum(hi, 0)  # the grid holds 0 exactly
        scale = (hi - lo) / q.hi
        zero = None
    scale = np.where(scale > 0, np.maximum(scale, FP16_TINY), 1.0)
    scale = scale.astype(np.float16).astype(np.float32)
    if zero is None:
        zero = np.clip(np.round(-lo / scale), q.lo, q.hi).astype(np.float32)
    return scale.astype(np.float32), zero


def quantize_codes(x: np.ndarray, scale: np.ndarray, zero: np.ndarray, fmt: WeightFormat) -> np.ndarray:
    q = grid(fmt)
    return np.clip(np.round(x / scale) + zero, q.lo, q.hi)


def fake_quant(x: np.ndarray, scale: np.ndarray, zero: np.ndarray, fmt: WeightFormat) -> np.ndarray:
    """Quantize and dequantize `x` with broadcastable scale / zero (an fp16 offset where `fmt.float_zero`)."""
    if fmt.float_zero:
        q = grid(fmt)
        return (np.clip(np.round((x - zero) / scale), q.lo, q.hi) * scale + zero).astype(np.float32)
    return ((quantize_codes(x, scale, zero, fmt) - zero) * scale).astype(np.float32)


# -- pack and dequantize -----------------------------------------------------------------


def pack_weight(
    w_KN: np.ndarray,
    fmt: WeightFormat,
    *,
    mask: np.ndarray | None = None,
    scale: np.ndarray | None = None,
    zero: np.ndarray | None = None,
    clip_search: bool = False,
) -> PackedWeight:
    """Store a [K, N] weight in `fmt`.

    Under 2:4, `mask` marks the kept entries (at most two per group of four rows; pruned
    entries are dropped whatever their value). `scale` / `zero` ([G, N], as `quant_params`
    returns them) let a calibrated method (GPTQ) supply its own; values it already put on
    the grid are then stored exactly. Otherwise round-to-nearest picks them.
    """
    k, n = w_KN.shape
    w = np.asarray(w_KN, dtype=np.float32)
    indices = None
    if fmt.sparsity == "2:4":
        if mask is None:
            raise ValueError("a 2:4 format needs the mask of kept entries")
        w, idx = compress_24(w, mask)
        indices = pack_bits_k(idx, 2)
    if fmt.kind in _FLOAT_DTYPES:
        return PackedWeight(fmt, k, n, _trim((w.astype(_np_dtype(_FLOAT_DTYPES[fmt.kind])), None, None, indices)))
    ks = w.shape[0]
    g = group_rows(fmt, k)
    groups = math.ceil(ks / g)
    if scale is None:
        scale, zero = quant_params(w, fmt, clip_search=clip_search)
    assert zero is not None
    w_pad = _pad_rows(w, groups * g)
    if fmt.float_zero:  # zero holds the offset: code = round((w - offset) / scale)
        q = grid(fmt)
        codes = np.clip(np.round((w_pad - expand_groups(zero, groups * g, g)) / expand_groups(scale, groups * g, g)),
                        q.lo, q.hi)
    else:
        codes = quantize_codes(w_pad, expand_groups(scale, groups * g, g), expand_groups(zero, groups * g, g), fmt)
    codes = codes.astype(np.int16)
    arrays: tuple[np.ndarray | None, ...]
    if fmt.kind == "int8" and not fmt.grouped:
        arrays = (codes[:ks].astype(np.int8), scale.reshape(n).astype(np.float16), None, indices)
    elif fmt.kind == "int8":  # group-wise: codes padded to Kp rows, as mxint8's
        arrays = (codes.astype(np.int8), scale.astype(np.float16), None, indices)
    elif fmt.kind == "int4":
        zeros = (zero.astype(np.float16) if fmt.float_zero else None if fmt.symmetric
                 else pack_bits_k(zero.astype(np.uint8), 4))
        arrays = (pack_nibbles_k(codes), scale.astype(np.float16), zeros, indices)
    else:  # mx: exponents biased by 127
        exponents = (np.round(np.log2(scale)) + 127).astype(np.uint8)
        values = pack_nibbles_k(codes) if fmt.bits == 4 else codes.astype(np.int8)
        arrays = (values, exponents, None, indices)
    return PackedWeight(fmt, k, n, _trim(arrays))


def _trim(arrays: tuple[np.ndarray | None, ...]) -> tuple[np.ndarray | None, ...]:
    items = list(arrays)
    while items and items[-1] is None:
        items.pop()
    return tuple(items)


def rtn(w_KN: np.ndarray, fmt: WeightFormat, *, mask: np.ndarray | None = None,
        clip_search: bool = False) -> PackedWeight:
    """Round-to-nearest: the baseline every calibrated method is measured against."""
    return pack_weight(w_KN, fmt, mask=mask, clip_search=clip_search)
