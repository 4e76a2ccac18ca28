"""GPTQ: error-compensating quantization with the Hessian of the layer's inputs; SparseGPT on top.

For a linear layer y = x W (W laid out [K, N]) and calibration inputs X, the output error of
a change E of W is tr(E^T H E) with H = X^T X. GPTQ (Frantar et al., 2022) quantizes one row
of W (one input channel) at a time and spreads that row's rounding error over the rows not
yet quantized, using the inverse Hessian's Cholesky factor, so the error the outputs see
shrinks far below round-to-nearest. The same loop prunes: SparseGPT (Frantar and Alistarh,
2023) chooses the 2:4 pattern of each group of four rows by w^2 / [H^-1]_kk^2 as it reaches
it and compensates the pruned weights the same way; with a format too, pruning and
quantization happen jointly.

Scales come from the weights as they are when the loop reaches a group (not the original
ones), as GPTQ does; with act-order (rows by decreasing H_kk) groups are fixed up front
("static groups") so a group's rows still share one scale in storage. Damping adds
`damp * mean(diag H)` to the diagonal; rows no calibration input ever touched (H_kk = 0)
are treated as unconstrained.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from aviatorc.formats import WeightFormat
from aviatorc.quant.rtn import PackedWeight, fake_quant, pack_weight, quant_params


@dataclass(frozen=True)
class GPTQConfig:
    # Measured on all-MiniLM-L6-v2 INT4 g32 (embedding cosine): damp 0.01 0.9808, with act-order
    # 0.9838, act-order and damp 0.1 0.9874: a few hundred calibration tokens against K up to
    # 1536 leave H nearly singular, and the stronger damping keeps GPTQ from overfitting them.
    damp: float = 0.1  # fraction of the mean Hessian diagonal added for stability
    act_order: bool = True
    block: int = 128  # rows updated lazily together (speed only; same result)
    clip_search: bool = True  # shrink each group's range where that lowers the H-weighted error


def gptq(
    w_KN: np.ndarray,
    hessian_KK: np.ndarray,
    fmt: WeightFormat | None,
    *,
    mask: np.ndarray | None = None,
    prune_24: bool = False,
    config: GPTQConfig = GPTQConfig(),
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """Quantize (fmt) and/or prune (mask given, or prune_24) w with error compensation.

    Returns (w_hat [K, N] float32, scale [G, N] or None, zero [G, N] or None, mask [K, N] or None);
    w_hat is on the format's grid, zero where pruned. `pack_weight(w_hat, fmt, mask=..., scale=...,
    zero=...)` stores it exactly.
    """
    k, n = w_KN.shape
    W = np.array(w_KN.T, dtype=np.float64)  # [N, K]: GPTQ's row-vector layout
    H = np.array(hessian_KK, dtype=np.float64)
    dead = np.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    sparse = prune_24 or mask is not None
    M = np.ones((n, k), bool) if mask is None else np.array(mask.T, dtype=bool)
    if prune_24 and config.act_order:
        raise ValueError("2:4 pruning needs rows in their natural order: disable act_order")

    perm = np.argsort(-np.diag(H), kind="stable") if config.act_order else np.arange(k)
    inv_perm = np.argsort(perm)
    W, M, H = W[:, perm], M[:, perm], H[np.ix_(perm, perm)]
    H[np.diag_indices(k)] += config.damp * float(np.mean(np.diag(H)))
    Hinv = _inverse_cholesky_upper(H)
    diag_h = np.diag(H)

    # Rows of the dense weight sharing one scale: a group of g stored values covers 2g rows
    # under 2:4 (two of every four kept); per-channel int8 is one group per column.
    if fmt is None:
        rows_per_group = k
    elif fmt.grouped:
        rows_per_group = fmt.group_size * (2 if fmt.sparsity == "2:4" else 1)
    else:
        rows_per_group = k
    groups = math.ceil(k / rows_per_group)
    scale = np.zeros((groups, n), np.float32)
    zero = np.zeros((groups, n), np.float32)
    have = np.zeros(groups, bool)

    def params(group: int, cols_W: np.ndarray, rw: np.ndarray) -> None:
        assert fmt is not None  # only called when quantizing
        s, z = quant_params(cols_W.T, fmt, clip_search=config.clip_search, row_weight=rw,
                            rows_per_group=cols_W.shape[1])
        scale[group], zero[group] = s[0], z[0]
        have[group] = True

    if fmt is not None and (config.act_order or not fmt.grouped):
        # Static groups: parameters from the (masked) weights before any update.
        W_nat, M_nat = W[:, inv_perm], M[:, inv_perm]
        for group in range(groups):
            lo, hi = group * rows_per_group, min(k, (group + 1) * rows_per_group)
            params(group, (W_nat * M_nat)[:, lo:hi], np.diag(hessian_KK)[lo:hi])

    # A block holds whole groups, so a group's scale sees every update made before it.
    block = max(config.block, rows_per_group if fmt is not None and fmt.grouped else 0)
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        W1 = W[:, b0:b1].copy()
        Err1 = np.zeros_like(W1)
        Hinv1 = Hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            row = perm[col]
            if prune_24 and row % 4 == 0:
                # SparseGPT: keep the two of four with the largest w^2 / [H^-1]_kk^2.
                span = min(4, b1 - b0 - i)
                score = W1[:, i : i + span] ** 2 / np.diag(Hinv1)[i : i + span] ** 2
                keep = np.argsort(-score, axis=1, kind="stable")[:, :2]
                M[:, col : col + span] = False
                np.put_along_axis(M[:, col : col + span], keep, True, axis=1)
            w = W1[:, i]
            if fmt is not None:
                group = row // rows_per_group
                if not have[group]:
                    lo = col
                    hi = min(k, col + rows_per_group)
                    params(group, W1[:, i : hi - b0] if hi <= b1 else np.concatenate([W1[:, i:], W[:, b1:hi]], axis=1),
                           diag_h[lo:hi])
                q = fake_quant(w.astype(np.float32), scale[group], zero[group], fmt).astype(np.float64)
            else:
                q = w.copy()
            q = np.where(M[:, col], q, 0.0)
            err = (w - q) / Hinv1[i, i]
            W1[:, i:] -= np.outer(err, Hinv1[i, i:])
            W1[:, i] = q
            Err1[:, i] = err
        W[:, b0:b1] = W1
        W[:, b1:] -= Err1 @ Hinv[b0:b1, b1:]

    w_hat = W[:, inv_perm].T.astype(np.float32)
    mask_out = M[:, inv_perm].T.copy() if sparse else None
    if fmt is None:
        return w_hat, None, None, mask_out
    return w_hat, scale, zero, mask_out


def _inverse_cholesky_upper(H: np.ndarray) -> np.ndarray:
    """Upper Cholesky factor of H^-1, adding damping until H is positive definite.

    torch's LAPACK is used: numpy's bundled one measured 6.6 s for one 1536 x 1536 Cholesky
    on this machine, torch's a few milliseconds."""
    import torch

    h = torch.from_numpy(H)
    extra = 0.0
    mean_diag = float(np.mean(np.diag(H)))
    for _ in range(8):
        L, info = torch.linalg.cholesky_ex(h + extra * torch.eye(h.shape[0], dtype=h.dtype))
        if int(info) == 0:
            U, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)
            if int(info) == 0:
                return U.numpy()
        extra = max(extra * 10, 1e-4 * mean_diag)
    raise np.linalg.LinAlgError("the calibration Hessian is not positive definite even after damping")


def gptq_pack(w_KN: np.ndarray, hessian_KK: np.ndarray, fmt: WeightFormat, *, mask: np.ndarray | None = None,
              prune_24: bool = False, config: GPTQConfig = GPTQConfig()) -> PackedWeight:
    """GPTQ (and SparseGPT when `fmt` is 2:4) straight to the stored layout."""
    w_hat, scale, zero, mask_out = gptq(w_KN, hessian_KK, fmt, mask=mask, prune_24=prune_24, config=config)
    return pack_weight(w_hat, fmt, mask=mask_out, scale=scale, zero=zero)
