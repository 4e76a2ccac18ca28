"""Least-squares refit of the kept weights of a pruned layer, for its fixed 2:4 pattern.

SparseGPT (`aviatorc.quant.gptq`, `prune_24=True`) chooses the pattern and updates the kept
weights in one left-to-right sweep: each pruned weight's error is spread over the rows not
yet reached, never back over the rows already passed. Once the pattern is fixed, the best
kept weights for the calibration data solve, per output column n with kept rows S,

    H_SS w_S = (H w_orig)_S,        H = X^T X + damp * mean(diag H) * I,

which minimizes ||X w - X w_orig||^2 (the layer's output error) over the kept entries. Every
column has its own S, so instead of one factorization per column, conjugate gradients run on
all columns at once: the masked operator w -> M * (H (M * w)) is symmetric positive definite
on each column's kept entries, one iteration is a single [K, K] x [K, N] product, and the
SparseGPT weights are the starting point, so a few dozen iterations (Jacobi-preconditioned)
reach the solution closely.

Measured on all-MiniLM-L6-v2 2:4 (embedding cosine, 2,865 calibration tokens): SparseGPT
alone 0.8676, with the exact per-column solve 0.8917.
"""

from __future__ import annotations

import numpy as np


def refit_masked(
    w_KN: np.ndarray,
    hessian_KK: np.ndarray,
    mask_KN: np.ndarray,
    *,
    start_KN: np.ndarray | None = None,
    damp: float = 0.1,
    iterations: int = 40,
) -> np.ndarray:
    """Kept weights (zero elsewhere) minimizing the output error against `w_KN` for `mask_KN`.

    `start_KN` (for example SparseGPT's result) is where the iterations begin; it must be
    zero where the mask is False. Rows no calibration input touched (H_kk = 0) keep w_KN's
    value if kept: the data says nothing about them.
    """
    import torch  # one [K, K] x [K, N] product per iteration; numpy's bundled BLAS is far slower

    k, n = w_KN.shape
    H = torch.from_numpy(np.array(hessian_KK, dtype=np.float64))
    diag = torch.diagonal(H)
    dead = diag == 0
    mean_diag = float(diag[~dead].mean()) if bool((~dead).any()) else 1.0
    H[dead, dead] = 1.0
    H += damp * mean_diag * torch.eye(k, dtype=H.dtype)
    M = torch.from_numpy(np.asarray(mask_KN, bool)).to(H.dtype)
    W = torch.from_numpy(np.asarray(w_KN, np.float64))
    x = M * (torch.from_numpy(np.asarray(start_KN, np.float64)) if start_KN is not None else W)
    b = M * (H @ W)
    inv_diag = (1.0 / torch.diagonal(H))[:, None] * M  # Jacobi preconditioner, on the kept entries
    r = b - M * (H @ x)
    z = inv_diag * r
    p = z.clone()
    rz = (r * z).sum(dim=0)
    tiny = torch.finfo(H.dtype).tiny
    for _ in range(iterations):
        Hp = M * (H @ p)
        alpha = rz / torch.clamp((p * Hp).sum(dim=0), min=tiny)
        x += alpha * p
        r -= alpha * Hp
        z = inv_diag * r
        rz_new = (r * z).sum(dim=0)
        p = z + (rz_new / torch.clamp(rz, min=tiny)) * p
        rz = rz_new
    out = x.numpy().astype(np.float32)
    out[dead.numpy()] = np.where(mask_KN[dead.numpy()], w_KN[dead.numpy()], 0.0)
    return out
