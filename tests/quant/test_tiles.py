"""Tiles of packed weights: a column strip is a slice of every stored array, dequantizes to
exactly the whole weight's columns, and costs exactly `storage_bytes` of its own shape; row
ranges for dense tables; refusals with pinned text; the 2-D zero / index layouts."""

from __future__ import annotations

import numpy as np
import pytest

from aviatorc.errors import ModelFormatError, OptionError
from aviatorc.formats import WeightFormat
from aviatorc.ir import get_op
from aviatorc.ir.ops.registry import InferContext
from aviatorc.ir.types import TensorType
from aviatorc.quant.rtn import pack_weight
from aviatorc.quant.sparse import magnitude_mask
from aviatorc.quant.tiles import dequantize_packed, slice_packed

UNIT_N = 16  # matrix-unit width the strips are aligned to
DENSE = [
    WeightFormat("fp32"),
    WeightFormat("fp16"),
    WeightFormat("bf16"),
    WeightFormat("int8"),
    *[WeightFormat("int8", g) for g in (32, 128)],
    *[WeightFormat("int4", g, sym) for g in (32, 64, 128) for sym in (True, False)],
    *[WeightFormat(kind, g) for kind in ("mxint8", "mxint4") for g in (32, 128)],
]
FORMATS = DENSE + [WeightFormat(f.kind, f.group_size, f.symmetric, "2:4") for f in DENSE]
# K = 72: a ragged last group of 32 (and of 64 / 128), three groups (an odd count: a padding
# nibble in the zero points), 36 kept rows under 2:4. K = 70 is not a multiple of 4.
# N = 40 and 21 are ragged against the 16-wide unit.
SHAPES = [(72, 40), (70, 21)]


def strips(n: int, unit: int) -> list[list[tuple[int, int]]]:
    """A few ways to cut [0, n) into unit-aligned strips (the last ragged): one strip, one per
    unit, and uneven ones."""
    bounds = list(range(0, n, unit)) + [n]
    per_unit = list(zip(bounds, bounds[1:], strict=False))
    cuts = [[(0, n)], per_unit]
    if len(bounds) > 2:
        cuts.append([(0, bounds[1]), (bounds[1], n)])
        cuts.append([(0, bounds[-2]), (bounds[-2], n)])
    return cuts


def packed(fmt: WeightFormat, k: int, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((k, n)) * np.linspace(0.1, 2.0, n)).astype(np.float32)
    return w, pack_weight(w, fmt, mask=magnitude_mask(w) if fmt.sparsity else None)


def nbytes(arrays) -> int:
    return sum(int(a.nbytes) for a in arrays if a is not None)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_column_strips_dequantize_to_the_whole_weights_columns(fmt: WeightFormat, shape: tuple[int, int]) -> None:
    k, n = shape
    w, whole = packed(fmt, k, n)
    w_hat = dequantize_packed(fmt, whole.arrays, k, n)
    np.testing.assert_array_equal(w_hat, whole.dequantize())
    assert whole.nbytes == fmt.storage_bytes(k, n)
    for cut in strips(n, UNIT_N):
        total = 0
        for n0, n1 in cut:
            tile = slice_packed(fmt, whole.arrays, k, n, cols=(n0, n1))
            np.testing.assert_array_equal(dequantize_packed(fmt, tile, k, n1 - n0), w_hat[:, n0:n1])
            assert nbytes(tile) == fmt.storage_bytes(k, n1 - n0)
            assert all(a is None or a.flags.c_contiguous for a in tile)
            total += nbytes(tile)
        assert total == fmt.storage_bytes(k, n), cut


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_a_strip_is_the_packing_of_its_columns(fmt: WeightFormat) -> None:
    """Scales, zero points and 2:4 patterns are per column: packing the strip's columns alone
    stores the same bytes as slicing the whole weight."""
    k, n, n0, n1 = 72, 40, 16, 40
    w, whole = packed(fmt, k, n)
    mask = magnitude_mask(w)[:, n0:n1] if fmt.sparsity else None
    alone = pack_weight(w[:, n0:n1], fmt, mask=mask)
    tile = slice_packed(fmt, whole.arrays, k, n, cols=(n0, n1))
    assert len(tile) == len(alone.arrays)
    for a, b in zip(tile, alone.arrays, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


def test_dequantize_packed_is_the_ir_kernel() -> None:
    fmt = WeightFormat("int4", 32, False, "2:4")
    _, whole = packed(fmt, 72, 40)
    opdef = get_op("DequantizeWeight")
    kernel = opdef.kernel(list(whole.arrays), opdef.resolve_attrs(dict(fmt.to_attrs(), k=72, n=40)))[0]
    np.testing.assert_array_equal(dequantize_packed(fmt, whole.arrays, 72, 40), kernel)


@pytest.mark.parametrize(
    "fmt", [WeightFormat("fp32"), WeightFormat("fp16"), WeightFormat("bf16")], ids=lambda f: f.name
)
def test_dense_tables_split_by_rows(fmt: WeightFormat) -> None:
    k, n = 100, 24
    _, table = packed(fmt, k, n)
    full = dequantize_packed(fmt, table.arrays, k, n)
    total = 0
    for k0, k1 in [(0, 32), (32, 64), (64, 100)]:
        tile = slice_packed(fmt, table.arrays, k, n, rows=(k0, k1))
        np.testing.assert_array_equal(dequantize_packed(fmt, tile, k1 - k0, n), full[k0:k1])
        assert nbytes(tile) == fmt.storage_bytes(k1 - k0, n)
        total += nbytes(tile)
    assert total == fmt.storage_bytes(k, n)
    corner = slice_packed(fmt, table.arrays, k, n, rows=(32, 64), cols=(16, 24))
    np.testing.assert_array_equal(dequantize_packed(fmt, corner, 32, 8), full[32:64, 16:24])


def test_all_rows_is_no_row_split() -> None:
    fmt = WeightFormat("int8")
    _, whole = packed(fmt, 72, 40)
    tile = slice_packed(fmt, whole.arrays, 72, 40, rows=(0, 72), cols=(0, 16))
    assert nbytes(tile) == fmt.storage_bytes(72, 16)


@pytest.mark.parametrize(
    "fmt", [WeightFormat("int8"), WeightFormat("int4", 32), WeightFormat("fp32", sparsity="2:4")], ids=lambda f: f.name
)
def test_row_ranges_of_other_formats_are_refused(fmt: WeightFormat) -> None:
    _, whole = packed(fmt, 72, 40)
    with pytest.raises(OptionError) as info:
        slice_packed(fmt, whole.arrays, 72, 40, rows=(0, 32))
    assert f"rows [0, 32) of a [72, 40] {fmt.name} weight are not a tile of their own" in str(info.value)
    assert "column strips" in (info.value.hint or "")


@pytest.mark.parametrize("cols", [(16, 16), (-1, 8), (32, 41)], ids=str)
def test_bad_column_ranges_are_refused(cols: tuple[int, int]) -> None:
    fmt = WeightFormat("int8")
    _, whole = packed(fmt, 72, 40)
    with pytest.raises(OptionError) as info:
        slice_packed(fmt, whole.arrays, 72, 40, cols=cols)
    assert f"cols [{cols[0]}, {cols[1]}) is not a non-empty range inside [0, 40)" in str(info.value)


def test_arrays_that_are_not_the_layout_are_refused() -> None:
    fmt = WeightFormat("int4", 32, False)
    _, whole = packed(fmt, 72, 40)
    values, scale, zero = whole.arrays
    assert zero is not None
    flat_zero = zero.reshape(-1)  # the old flat layout
    with pytest.raises(ModelFormatError) as info:
        dequantize_packed(fmt, [values, scale, flat_zero], 72, 40)
    assert "'zero' input is uint8[80] but format int4-g32-asym of a [72, 40] weight stores uint8[2, 40]" in str(
        info.value
    )
    with pytest.raises(ModelFormatError, match="needs the 'zero' input"):
        slice_packed(fmt, [values, scale], 72, 40, cols=(0, 16))
    # A strip's arrays are not the whole weight's.
    tile = slice_packed(fmt, whole.arrays, 72, 40, cols=(0, 16))
    with pytest.raises(ModelFormatError, match=r"stores uint8\[48, 40\]"):
        dequantize_packed(fmt, tile, 72, 40)


def test_the_type_rule_checks_the_2d_layouts() -> None:
    fmt = WeightFormat("int4", 32, True, "2:4")
    opdef = get_op("DequantizeWeight")
    attrs = opdef.resolve_attrs(dict(fmt.to_attrs(), k=72, n=40))
    good = [TensorType("uint8", (32, 40)), TensorType("float16", (2, 40)), None, TensorType("uint8", (9, 40))]
    assert opdef.infer(InferContext("DequantizeWeight", good, [None] * 4, attrs, 1)) == [
        TensorType("float32", (72, 40))
    ]
    flat = good[:3] + [TensorType("uint8", (360,))]
    with pytest.raises(ModelFormatError, match=r"'indices' input is uint8\[360\] but .* stores uint8\[9, 40\]"):
        opdef.infer(InferContext("DequantizeWeight", flat, [None] * 4, attrs, 1))


def test_zero_points_and_indices_are_packed_along_k_per_column() -> None:
    """The documented bytes: zero points of groups 2j and 2j + 1 of one column share a byte
    (2j low); 2:4 positions of kept rows 4j .. 4j + 3 of one column share a byte (4j lowest)."""
    k, n = 96, 2  # three groups of 32
    w = np.zeros((k, n), np.float32)
    w[:, 0] = np.repeat([[-1.0], [-3.0], [-7.0]], 32, axis=0)[:, 0]  # min < 0: zero points differ
    w[0, :] = 1.0
    w[:, 1] = 1.0
    fmt = WeightFormat("int4", 32, False)
    _, scale, zero = pack_weight(w, fmt).arrays
    assert zero is not None and zero.shape == (2, 2)
    z = np.clip(np.round(-np.minimum(w.reshape(3, 32, 2).min(axis=1), 0) / scale.astype(np.float32)), 0, 15)
    assert zero[0, 0] == int(z[0, 0]) | int(z[1, 0]) << 4 and zero[1, 0] == int(z[2, 0])
    assert zero[0, 1] == 0 and zero[1, 1] == 0  # all-positive column: zero point 0

    w24 = np.arange(1, 17, dtype=np.float32).reshape(16, 1) * np.array([[1.0, -1.0]], np.float32)
    mask = np.zeros((16, 2), bool)
    mask[[1, 3, 4, 6, 8, 9, 14, 15], 0] = True  # positions (1, 3), (0, 2), (0, 1), (2, 3)
    mask[[0, 1, 4, 5, 8, 9, 12, 13], 1] = True  # all (0, 1)
    indices = pack_weight(w24, WeightFormat("fp32", sparsity="2:4"), mask=mask).arrays[3]
    assert indices is not None and indices.shape == (2, 2)
    # column 0, kept rows 0..3 -> positions 1, 3, 0, 2; rows 4..7 -> 0, 1, 2, 3
    assert indices[0, 0] == 1 | 3 << 2 | 0 << 4 | 2 << 6 and indices[1, 0] == 0 | 1 << 2 | 2 << 4 | 3 << 6
    assert indices[0, 1] == indices[1, 1] == 0 | 1 << 2 | 0 << 4 | 1 << 6
