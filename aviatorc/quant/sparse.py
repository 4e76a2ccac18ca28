"""2:4 selection: which two of every four consecutive weights along K are kept.

Groups of four rows of a [K, N] weight (K padded with zeros to a multiple of 4) start at
row 0, so they stay inside any matrix-unit tile whose depth is a multiple of 4.

- magnitude: keep the two largest |w| of each group (no data needed).
- wanda (Sun et al., 2023): keep the two largest |w_kn| * ||x_k||, with ||x_k|| the norm of
  input channel k over the calibration activations; no weight update.
- sparsegpt (Frantar and Alistarh, 2023): see `aviatorc.quant.gptq` (`prune_24=True`):
  the pattern is chosen by w^2 / [H^-1]_kk^2 and the kept weights are updated to
  compensate the pruned ones.
"""

from __future__ import annotations

import math

import numpy as np


def top2_of_4(score_KN: np.ndarray) -> np.ndarray:
    """Boolean [K, N] mask keeping the two highest scores of each group of four rows (ties: lower row)."""
    k, n = score_KN.shape
    k4 = math.ceil(k / 4) * 4
    padded = np.full((k4, n), -np.inf)
    padded[:k] = score_KN
    order = np.argsort(-padded.reshape(-1, 4, n), axis=1, kind="stable")[:, :2, :]
    mask = np.zeros((k4 // 4, 4, n), bool)
    np.put_along_axis(mask, order, True, axis=1)
    return mask.reshape(k4, n)[:k]


def magnitude_mask(w_KN: np.ndarray) -> np.ndarray:
    return top2_of_4(np.abs(w_KN))


def wanda_mask(w_KN: np.ndarray, x_norm_K: np.ndarray) -> np.ndarray:
    """|w| scaled by the norm of each input channel over the calibration data."""
    return top2_of_4(np.abs(w_KN) * x_norm_K[:, None])


def check_24(mask_KN: np.ndarray) -> bool:
    """Whether every group of four rows keeps at most two entries (the zero padding counts as pruned)."""
    k, n = mask_KN.shape
    k4 = math.ceil(k / 4) * 4
    padded = np.zeros((k4, n), bool)
    padded[:k] = mask_KN
    return bool((padded.reshape(-1, 4, n).sum(axis=1) <= 2).all())
