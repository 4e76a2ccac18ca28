"""The least-squares refit after SparseGPT: keeps the pattern, lowers the layer's output error,
and reaches the exact per-column solution."""

from __future__ import annotations

import numpy as np

from aviatorc.quant.gptq import GPTQConfig, gptq
from aviatorc.quant.refit import refit_masked
from aviatorc.quant.sparse import check_24
from tests.quant.test_gptq_sparse import layer, output_error


def test_refit_keeps_the_pattern_and_beats_the_sweep() -> None:
    x, w, h = layer(5)
    w_sweep, _, _, mask = gptq(w, h, None, prune_24=True, config=GPTQConfig(act_order=False))
    w_refit = refit_masked(w, h, mask, start_KN=w_sweep, damp=0.01, iterations=40)
    assert check_24(mask) and (w_refit[~mask] == 0).all()
    assert output_error(x, w, w_refit) < 0.97 * output_error(x, w, w_sweep)


def test_refit_matches_the_exact_solve() -> None:
    x, w, h = layer(6, k=32, n=8, tokens=256)
    _, _, _, mask = gptq(w, h, None, prune_24=True, config=GPTQConfig(act_order=False))
    damp = 0.05
    hd = h + damp * np.mean(np.diag(h)) * np.eye(32)
    got = refit_masked(w, h, mask, damp=damp, iterations=64)
    for col in range(8):
        kept = np.flatnonzero(mask[:, col])
        exact = np.linalg.solve(hd[np.ix_(kept, kept)], (hd @ w[:, col])[kept])
        np.testing.assert_allclose(got[kept, col], exact, rtol=1e-4, atol=1e-4)


def test_untouched_input_rows_keep_their_weights() -> None:
    x, w, h = layer(7, k=16, n=4, tokens=64)
    h[3, :] = h[:, 3] = 0.0  # input channel 3 never active
    mask = np.zeros((16, 4), bool)
    mask[::2] = True
    got = refit_masked(w, h, mask)
    np.testing.assert_array_equal(got[3], 0.0)  # row 3 pruned
    mask[3] = True
    mask[2] = False
    got = refit_masked(w, h, mask)
    np.testing.assert_array_equal(got[3], w[3])


def test_corrected_target_is_the_weight_when_inputs_agree() -> None:
    from aviatorc.quant.refit import corrected_target

    x, w, h = layer(8, k=32, n=8, tokens=256)
    np.testing.assert_allclose(corrected_target(w, h, h), w, rtol=1e-5, atol=1e-5)


def test_corrected_target_makes_up_for_upstream_error() -> None:
    """Inputs perturbed by an earlier layer's error: V reproduces the reference output better than W."""
    from aviatorc.quant.refit import corrected_target

    rng = np.random.default_rng(9)
    x_ref, w, _ = layer(9, k=64, n=16, tokens=2048)
    x = x_ref + 0.2 * x_ref @ (rng.standard_normal((64, 64)) * 0.1)  # a correlated upstream error
    h, c = x.T.astype(np.float64) @ x, x.T.astype(np.float64) @ x_ref
    v = corrected_target(w, h, c, damp=0.01)

    def err(weight):
        return float(np.linalg.norm(x @ weight - x_ref @ w))

    assert err(v) < 0.5 * err(w)
