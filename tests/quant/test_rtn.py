"""Storage layouts: exact bytes, pack/unpack round trips, per-format error bounds."""

from __future__ import annotations

import numpy as np
import pytest

from aviatorc.formats import WeightFormat
from aviatorc.quant.rtn import (
    dequantize,
    expand_groups,
    layout_bytes,
    pack_bits_k,
    pack_nibbles_k,
    pack_weight,
    quant_params,
    unpack_bits_k,
    unpack_nibbles_k,
)
from aviatorc.quant.sparse import check_24, magnitude_mask

FORMATS = [
    WeightFormat("fp32"), WeightFormat("fp16"), WeightFormat("bf16"), WeightFormat("int8"),
    *[WeightFormat("int8", g) for g in (32, 64, 128)],
    *[WeightFormat("int4", g, sym) for g in (32, 64, 128) for sym in (True, False)],
    *[WeightFormat(kind, g) for kind in ("mxint8", "mxint4") for g in (32, 64, 128)],
]
SHAPES = [(64, 8), (576, 24), (70, 3), (130, 5)]  # 576 with g128 and 70 / 130 leave ragged groups


def sparse(fmt: WeightFormat) -> WeightFormat:
    return WeightFormat(fmt.kind, fmt.group_size, fmt.symmetric, "2:4")


@pytest.mark.parametrize("fmt", FORMATS + [sparse(f) for f in FORMATS], ids=lambda f: f.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_stored_bytes_are_exact(fmt: WeightFormat, shape: tuple[int, int]) -> None:
    k, n = shape
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    mask = magnitude_mask(w) if fmt.sparsity else None
    packed = pack_weight(w, fmt, mask=mask)
    assert packed.nbytes == fmt.storage_bytes(k, n) == layout_bytes(fmt, k, n)
    assert packed.dequantize().shape == (k, n)


def test_nibble_and_bit_packing_round_trip() -> None:
    rng = np.random.default_rng(1)
    codes = rng.integers(-8, 8, (64, 7))
    assert np.array_equal(unpack_nibbles_k(pack_nibbles_k(codes), signed=True), codes)
    unsigned = rng.integers(0, 16, (32, 3))
    assert np.array_equal(unpack_nibbles_k(pack_nibbles_k(unsigned), signed=False), unsigned)
    for bits in (2, 4):
        codes_RN = rng.integers(0, 1 << bits, (37, 5))  # 37 rows: the last byte row is padded
        packed = pack_bits_k(codes_RN, bits)
        assert packed.shape == (-(-37 * bits // 8), 5) and packed.dtype == np.uint8
        assert np.array_equal(unpack_bits_k(packed, bits, 37), codes_RN)
    # The documented layouts: row 2i in the low nibble; 2-bit row 4j + i at bits 2i of byte row j.
    assert pack_nibbles_k(np.array([[1], [2]]))[0, 0] == 0x21
    assert pack_bits_k(np.array([[1], [2], [3], [0], [2]]), 2).tolist() == [[0b00111001], [0b10]]


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f.kind not in ("fp32", "fp16", "bf16")], ids=lambda f: f.name)
def test_error_is_at_most_half_a_step(fmt: WeightFormat) -> None:
    """|w - w_hat| <= scale / 2 for the stored scale (per channel for int8, per group otherwise)."""
    k, n = 576, 16
    w = (np.random.default_rng(2).standard_normal((k, n)) * np.linspace(0.01, 3, n)).astype(np.float32)
    packed = pack_weight(w, fmt)
    scale, _ = quant_params(w, fmt)
    g = fmt.group_size if fmt.grouped else k
    step = expand_groups(scale, k, g)
    err = np.abs(packed.dequantize() - w)
    assert (err <= step / 2 * (1 + 1e-3) + 1e-7).all(), float((err / step).max())


def test_int8_stores_what_the_spec_says() -> None:
    w = np.array([[1.0, -2.0], [0.5, 1.0], [-1.0, 0.0]], np.float32)
    packed = pack_weight(w, WeightFormat("int8"))
    values, scale = packed.arrays
    assert values.dtype == np.int8 and values.shape == (3, 2) and scale.dtype == np.float16
    np.testing.assert_allclose(scale.astype(np.float32), [1 / 127, 2 / 127], rtol=1e-3)
    assert values[0].tolist() == [127, -127]


def test_mx_exponents_are_powers_of_two() -> None:
    w = np.random.default_rng(3).standard_normal((64, 4)).astype(np.float32)
    values, exponents = pack_weight(w, WeightFormat("mxint8", 32)).arrays
    assert exponents.dtype == np.uint8 and exponents.shape == (2, 4)
    assert values.dtype == np.int8 and np.abs(values.astype(int)).max() <= 127
    scale = np.exp2(exponents.astype(np.float64) - 127)
    assert (scale >= np.abs(w).reshape(2, 32, 4).max(axis=1) / 127).all()  # no clipping


@pytest.mark.parametrize("fmt", [WeightFormat("fp32", sparsity="2:4"), WeightFormat("int8", sparsity="2:4"),
                                 WeightFormat("int4", 32, False, "2:4")], ids=lambda f: f.name)
def test_sparse_round_trip_keeps_the_pattern(fmt: WeightFormat) -> None:
    w = np.random.default_rng(4).standard_normal((70, 6)).astype(np.float32)
    mask = magnitude_mask(w)
    assert check_24(mask) and mask.sum() == 18 * 2 * 6  # K = 70: the last group has 2 real rows, both kept
    w_hat = pack_weight(w, fmt, mask=mask).dequantize()
    assert (w_hat[~mask] == 0).all()
    if fmt.kind == "fp32":
        np.testing.assert_array_equal(w_hat[mask], w[mask])


def test_dequantize_of_stored_arrays_matches_packed() -> None:
    w = np.random.default_rng(5).standard_normal((128, 8)).astype(np.float32)
    fmt = WeightFormat("int4", 64, False)
    packed = pack_weight(w, fmt)
    np.testing.assert_array_equal(dequantize(packed.arrays, fmt, 128, 8), packed.dequantize())


# -- group-wise INT8 -----------------------------------------------------------------------


def group_int8_reference(w_KN: np.ndarray, group: int) -> np.ndarray:
    """Group-wise symmetric INT8 in plain numpy, written from the spec (not from `rtn`): K padded
    with zeros to whole groups, scale = amax / 127 per (group, column) rounded to fp16 (a zero
    group gets scale 1), codes round(w / scale) clipped to -127..127, read back as codes * scale."""
    k, n = w_KN.shape
    groups = -(-k // group)
    w = np.zeros((groups * group, n), np.float32)
    w[:k] = w_KN
    w_GgN = w.reshape(groups, group, n)
    amax = np.abs(w_GgN).max(axis=1, keepdims=True)
    scale = np.where(amax > 0, np.maximum(amax / 127, 2.0**-14), 1.0).astype(np.float16).astype(np.float32)
    codes = np.clip(np.round(w_GgN / scale), -127, 127)
    return (codes * scale).reshape(-1, n)[:k]


@pytest.mark.parametrize("group", [32, 64, 128])
def test_group_wise_int8_bytes_and_layout(group: int) -> None:
    """One fp16 scale per (group, channel): Kp * N code bytes + G * N * 2 (K = 576, N = 24)."""
    fmt = WeightFormat("int8", group)
    groups = -(-576 // group)
    assert fmt.grouped and fmt.name == f"int8-g{group}"
    assert fmt.storage_bytes(576, 24) == groups * group * 24 + groups * 24 * 2
    values, scale = pack_weight(np.ones((576, 24), np.float32), fmt).arrays
    assert values.dtype == np.int8 and values.shape == (groups * group, 24)
    assert scale.dtype == np.float16 and scale.shape == (groups, 24)
    assert WeightFormat("int8").name == "int8" and not WeightFormat("int8").grouped  # group 0: per channel
    assert WeightFormat.from_attrs(fmt.to_attrs()) == fmt


@pytest.mark.parametrize("group", [32, 64, 128])
def test_group_wise_int8_matches_a_numpy_reference_and_beats_per_channel_on_outlier_rows(group: int) -> None:
    rng = np.random.default_rng(6)
    k, n = 300, 16  # 300: a ragged last group for every group size
    w = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)
    w[[5, 10]] *= 40  # two outlier input channels (rows): per channel, they set the step of every row
    got = pack_weight(w, WeightFormat("int8", group)).dequantize()
    np.testing.assert_array_equal(got, group_int8_reference(w, group))
    per_channel = pack_weight(w, WeightFormat("int8")).dequantize()
    err_group, err_channel = np.linalg.norm(got - w), np.linalg.norm(per_channel - w)
    # Only the outliers' group keeps the coarse step, so the error falls to about sqrt(group / K) of
    # per-channel's (measured 0.320 / 0.465 / 0.652 against 0.327 / 0.462 / 0.653); 10% margin.
    assert err_group < 1.1 * np.sqrt(group / k) * err_channel, (err_group, err_channel)


def test_fp16_offsets_hold_a_q4_1_weight_exactly_and_beat_a_zero_point() -> None:
    """int4 with fp16 offsets (the data-free default): a weight already on llama.cpp's Q4_1 grid (codes 0..15,
    an fp16 scale and an fp16 offset per 32 rows, both ends of the code range used) comes back bit for bit,
    where a 4-bit zero point re-rounds it; the stored bytes are the format's."""
    import numpy as np

    from aviatorc.formats import WeightFormat
    from aviatorc.quant.rtn import pack_weight

    rng = np.random.default_rng(0)
    k, n, g = 96, 40, 32
    d = rng.uniform(0.001, 0.02, (k // g, n)).astype(np.float16).astype(np.float32)
    m = rng.uniform(-0.2, 0.05, (k // g, n)).astype(np.float16).astype(np.float32)
    q = rng.integers(0, 16, (k, n)).astype(np.float32)
    q[::g], q[1::g] = 0, 15  # each group spans the whole code range, as Q4_1's own quantizer makes it
    w = q * np.repeat(d, g, axis=0) + np.repeat(m, g, axis=0)
    offset = WeightFormat("int4", g, False, "", "fp16")
    packed = pack_weight(w, offset)
    assert packed.nbytes == offset.storage_bytes(k, n) == k * n // 2 + 2 * (k // g) * n * 2
    np.testing.assert_allclose(packed.dequantize(), w, rtol=0, atol=1e-6)
    zero_point = pack_weight(w, WeightFormat("int4", g, False)).dequantize()
    assert np.abs(zero_point - w).max() > 100 * np.abs(packed.dequantize() - w).max()
