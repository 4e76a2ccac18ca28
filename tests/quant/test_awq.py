"""AWQ numerics (`aviatorc.quant.awq`): the scale search against a numpy reference that measures
the output error on the activations themselves, alpha = 0 as round-to-nearest, and AWQ beating
round-to-nearest on held-out inputs with outlier channels."""

from __future__ import annotations

import numpy as np
import pytest

from aviatorc.formats import WeightFormat
from aviatorc.quant.awq import AWQConfig, awq, awq_scale
from aviatorc.quant.rtn import fake_quant, pack_weight, quant_params
from tests.quant.tiny_models import correlated_inputs

FORMATS = [WeightFormat("int4", 32), WeightFormat("int4", 32, False), WeightFormat("mxint4", 32)]


def outlier_layer(seed: int = 0, k: int = 96, n: int = 48, tokens: int = 512):
    """Correlated activations with a few channels 20x larger than the rest (what AWQ is for),
    split into calibration and held-out rows, and a weight."""
    rng = np.random.default_rng(seed)
    x = correlated_inputs(rng, 2 * tokens, k)
    x[:, rng.choice(k, 4, replace=False)] *= 20.0
    w = (rng.standard_normal((k, n)) * k**-0.5).astype(np.float32)
    return x[:tokens], x[tokens:], w


def reference_search(x: np.ndarray, w: np.ndarray, fmt: WeightFormat, grid: int) -> tuple[float, list[float], np.ndarray]:
    """The search written out on the activations: for each alpha, s = mean|x|^alpha normalized,
    Q(diag(s) W) by round-to-nearest with the clip search weighted by the scaled inputs' channel
    energies, and the error ||x W - (x / s) Q||^2 computed from x itself (float64)."""
    errors, best = [], None
    h_diag = (x.astype(np.float64) ** 2).sum(axis=0)
    for step in range(grid):
        alpha = step / grid
        m = np.maximum(np.abs(x.astype(np.float64)).mean(axis=0), 1e-4) ** alpha
        s = (m / np.sqrt(m.max() * m.min())).astype(np.float32)
        ws = w * s[:, None]
        scale, zero = quant_params(ws, fmt, clip_search=True, row_weight=(h_diag / s.astype(np.float64) ** 2))
        g = fmt.group_size
        q = fake_quant(ws, np.repeat(scale, g, axis=0)[: w.shape[0]], np.repeat(zero, g, axis=0)[: w.shape[0]], fmt)
        y = x.astype(np.float64) @ w
        y_hat = (x.astype(np.float64) / s) @ q.astype(np.float64)
        errors.append(float(((y - y_hat) ** 2).sum()))
        if best is None or errors[-1] < best[0]:
            best = (errors[-1], alpha, q / s[:, None])
    assert best is not None
    return best[1], errors, best[2]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_search_matches_the_numpy_reference(fmt: WeightFormat) -> None:
    x, _, w = outlier_layer()
    h = x.astype(np.float64).T @ x.astype(np.float64)
    result = awq([w], h, np.abs(x.astype(np.float64)).mean(axis=0), fmt, config=AWQConfig(grid=10))
    alpha, errors, w_eff = reference_search(x, w, fmt, 10)
    np.testing.assert_allclose(result.errors, errors, rtol=1e-6)
    assert result.alpha == alpha > 0
    np.testing.assert_allclose(result.packed[0].dequantize() / result.scale_K[:, None], w_eff, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(result.scale_K, awq_scale(np.abs(x.astype(np.float64)).mean(axis=0), alpha))


def test_alpha_zero_is_round_to_nearest() -> None:
    x, _, w = outlier_layer(1)
    h = x.astype(np.float64).T @ x.astype(np.float64)
    fmt = WeightFormat("int4", 32)
    result = awq([w], h, np.abs(x).mean(axis=0), fmt, config=AWQConfig(grid=1))
    assert result.alpha == 0.0 and np.all(result.scale_K == 1.0)
    scale, zero = quant_params(w, fmt, clip_search=True, row_weight=np.diag(h))
    np.testing.assert_array_equal(result.packed[0].dequantize(), pack_weight(w, fmt, scale=scale, zero=zero).dequantize())


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_awq_beats_round_to_nearest_held_out(fmt: WeightFormat) -> None:
    """Calibrated on one half of the rows, measured on the other: AWQ's output error well below RTN's."""
    cal, held, w = outlier_layer(2)
    h = cal.astype(np.float64).T @ cal.astype(np.float64)
    result = awq([w], h, np.abs(cal).mean(axis=0), fmt)
    y = held.astype(np.float64) @ w

    def error(w_eff: np.ndarray) -> float:
        return float(np.linalg.norm(held.astype(np.float64) @ w_eff - y) / np.linalg.norm(y))

    awq_err = error(result.packed[0].dequantize() / result.scale_K[:, None])
    rtn_err = error(pack_weight(w, fmt).dequantize())
    assert awq_err < 0.8 * rtn_err, (awq_err, rtn_err)


def test_weights_reading_one_input_share_one_scale() -> None:
    x, _, w = outlier_layer(3)
    h = x.astype(np.float64).T @ x.astype(np.float64)
    w2 = np.ascontiguousarray(w[:, ::-1] * 0.5)
    fmt = WeightFormat("int4", 32)
    both = awq([w, w2], h, np.abs(x).mean(axis=0), fmt, config=AWQConfig(grid=5))
    alone = [awq([v], h, np.abs(x).mean(axis=0), fmt, config=AWQConfig(grid=5)) for v in (w, w2)]
    np.testing.assert_allclose(both.errors, np.add(alone[0].errors, alone[1].errors), rtol=1e-9)
    assert len(both.packed) == 2
