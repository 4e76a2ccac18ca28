"""GPTQ beats round-to-nearest on correlated inputs; 2:4 selection keeps the pattern; Wanda and
SparseGPT beat magnitude on the layer's output."""

from __future__ import annotations

import numpy as np

from aviatorc.formats import WeightFormat
from aviatorc.quant.gptq import GPTQConfig, gptq, gptq_pack
from aviatorc.quant.rtn import pack_weight
from aviatorc.quant.sparse import check_24, magnitude_mask, top2_of_4, wanda_mask
from tests.quant.tiny_models import correlated_inputs


def layer(seed: int = 0, k: int = 128, n: int = 64, tokens: int = 1024):
    rng = np.random.default_rng(seed)
    x = correlated_inputs(rng, tokens, k)
    w = rng.standard_normal((k, n)).astype(np.float32)
    return x, w, x.astype(np.float64).T @ x


def output_error(x: np.ndarray, w: np.ndarray, w_hat: np.ndarray) -> float:
    return float(np.linalg.norm(x @ w_hat - x @ w) / np.linalg.norm(x @ w))


def test_gptq_beats_rtn_on_correlated_inputs() -> None:
    x, w, h = layer()
    for fmt in (WeightFormat("int4", 32), WeightFormat("int4", 128, False), WeightFormat("mxint4", 32),
                WeightFormat("int8"), WeightFormat("int8", 32)):
        rtn_err = output_error(x, w, pack_weight(w, fmt).dequantize())
        gptq_err = output_error(x, w, gptq_pack(w, h, fmt).dequantize())
        assert gptq_err < 0.8 * rtn_err, (fmt.name, gptq_err, rtn_err)


def test_gptq_without_act_order_also_beats_rtn() -> None:
    x, w, h = layer(1)
    fmt = WeightFormat("int4", 32)
    assert output_error(x, w, gptq_pack(w, h, fmt, config=GPTQConfig(act_order=False, damp=0.01)).dequantize()) < \
        output_error(x, w, pack_weight(w, fmt).dequantize())


def test_gptq_stores_exactly_and_on_the_grid() -> None:
    x, w, h = layer(2, k=96)  # 96 with g64: a ragged last group
    fmt = WeightFormat("int4", 64)
    w_hat, scale, zero, _ = gptq(w, h, fmt)
    packed = pack_weight(w_hat, fmt, scale=scale, zero=zero)
    np.testing.assert_allclose(packed.dequantize(), w_hat, atol=1e-6)
    assert packed.nbytes == fmt.storage_bytes(96, 64)


def test_two_of_four_selection() -> None:
    score = np.array([[1, 5], [4, 1], [3, 2], [2, 6], [9, 0]], float)
    mask = top2_of_4(score)
    assert mask[:, 0].tolist() == [False, True, True, False, True]
    assert mask[:, 1].tolist() == [True, False, False, True, True]
    assert check_24(mask)


def test_activation_aware_pruning_beats_magnitude() -> None:
    x, w, h = layer(3)
    magnitude = output_error(x, w, w * magnitude_mask(w))
    wanda = output_error(x, w, w * wanda_mask(w, np.sqrt(np.diag(h))))
    w_sgpt, _, _, mask = gptq(w, h, None, prune_24=True, config=GPTQConfig(act_order=False))
    assert check_24(mask) and (w_sgpt[~mask] == 0).all()
    sparsegpt = output_error(x, w, w_sgpt)
    assert wanda < magnitude and sparsegpt < wanda, (magnitude, wanda, sparsegpt)


def test_joint_sparsegpt_and_quantization_keeps_the_pattern() -> None:
    x, w, h = layer(4)
    fmt = WeightFormat("int4", 32, True, "2:4")
    w_hat, scale, zero, mask = gptq(w, h, fmt, prune_24=True, config=GPTQConfig(act_order=False))
    packed = pack_weight(w_hat, fmt, mask=mask, scale=scale, zero=zero)
    np.testing.assert_allclose(packed.dequantize(), w_hat, atol=1e-6)
    assert check_24(mask) and packed.nbytes == fmt.storage_bytes(128, 64)


def test_gptq_group_scales_come_from_their_own_group() -> None:
    # Without act-order, each group's scale is set from that group's rows only: a last group
    # scaled x20 must not inflate the scales of the groups before it.
    x, w, h = layer(3, k=128, n=16)
    w[96:] *= 20
    fmt = WeightFormat("int4", 32)
    _, scale, _, _ = gptq(w, h, fmt, config=GPTQConfig(act_order=False, clip_search=False))
    assert scale is not None
    first, last = np.asarray(scale[0], np.float64), np.asarray(scale[3], np.float64)
    assert np.all(last > 5 * first), (first.mean(), last.mean())
