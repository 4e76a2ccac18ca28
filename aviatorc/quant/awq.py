"""AWQ: activation-aware weight quantization by per-input-channel scales (Lin et al., 2023).

A linear layer y = x W (W laid out [K, N]) computes the same y as (x / s) (diag(s) W) for any
positive per-input-channel s [K]. Scaling up the rows that meet large activations before
rounding shrinks their relative rounding error, which the large activations would otherwise
amplify, at the cost of the other rows. AWQ takes s = m^alpha, m the mean |x| of each
channel on the calibration tokens, normalized so that sqrt(max(s) min(s)) = 1, and searches
alpha on a grid of `AWQConfig.grid` points in [0, 1) for the least output error

    err(alpha) = sum over the weights reading x of tr(E^T H E),  E = T - diag(1/s) Q(diag(s) W)

with H = X^T X the calibration Hessian (the same statistic GPTQ uses, so no activations are
kept) and T the weight's target (W, or `corrected_target`'s fit to the unquantized graph).
The weights reading one activation (q / k / v, or a fused QKV) share one s, since one
x / s feeds them all. alpha = 0 is s = 1, round-to-nearest itself: on the calibration data
the search never does worse than RTN with the same clip search.

Q is round-to-nearest with a clip search per group weighted by the scaled input's channel
energies (diag(H) / s^2). Where the quantize pass puts 1 / s (folded into the LayerNorm /
RMSNorm that feeds only these weights, else a `Mul` by a [K] constant in front of them) is
the pass's business (`aviatorc.passes.quantize`); this module is the numerics.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from aviatorc.formats import WeightFormat
from aviatorc.quant.gptq import GPTQConfig, gptq_pack
from aviatorc.quant.rtn import PackedWeight, pack_weight, quant_params


@dataclass(frozen=True)
class AWQConfig:
    grid: int = 20  # alpha in {0, 1/grid, ..., (grid - 1)/grid}, as the AWQ paper's search
    clip_search: bool = True  # each group's range shrunk where that lowers the weighted error
    min_magnitude: float = 1e-4  # channels no token ever touched still get a finite scale


@dataclass(frozen=True, eq=False)
class AWQResult:
    """The chosen scales and the weights stored with them: x / scale_K feeds `packed[i]`."""

    alpha: float
    scale_K: np.ndarray  # float32 [K]: W' = diag(s) W is what is stored
    packed: tuple[PackedWeight, ...]
    errors: tuple[float, ...]  # err(alpha) for each grid point, in grid order

    @property
    def inverse_scale_K(self) -> np.ndarray:
        """What the activation is multiplied by: 1 / s, float32."""
        return (1.0 / self.scale_K).astype(np.float32)


def awq_scale(mean_abs_K: np.ndarray, alpha: float, *, min_magnitude: float = 1e-4) -> np.ndarray:
    """s = m^alpha normalized to sqrt(max(s) min(s)) = 1 (the paper's normalization), float32 [K]."""
    s = np.maximum(np.asarray(mean_abs_K, np.float64), min_magnitude) ** alpha
    s = s / np.sqrt(s.max() * s.min())
    return s.astype(np.float32)


def quantize_scaled(w_KN: np.ndarray, s_K: np.ndarray, hessian_diag_K: np.ndarray, fmt: WeightFormat, *,
                    mask: np.ndarray | None = None, clip_search: bool = True) -> PackedWeight:
    """diag(s) W stored in `fmt` by round-to-nearest, its clip search weighted by the scaled
    input's channel energies diag(H) / s^2."""
    ws = (np.asarray(w_KN, np.float32) * s_K[:, None]).astype(np.float32)
    if mask is not None:
        ws = np.where(mask, ws, 0.0).astype(np.float32)
    if fmt.sparsity == "2:4" or not clip_search:
        return pack_weight(ws, fmt, mask=mask)  # a 2:4 weight's groups run along its kept rows
    scale, zero = quant_params(ws, fmt, clip_search=True, row_weight=hessian_diag_K / np.maximum(s_K, 1e-30) ** 2)
    return pack_weight(ws, fmt, mask=mask, scale=scale, zero=zero)


def gptq_scaled(target_KN: np.ndarray, s_K: np.ndarray, hessian_KK: np.ndarray, fmt: WeightFormat, *,
                mask: np.ndarray | None = None, config: GPTQConfig = GPTQConfig()) -> PackedWeight:
    """diag(s) T stored by GPTQ: the scaled layer's inputs are X diag(1/s), so its Hessian is
    diag(1/s) H diag(1/s) (`awq-gptq`: AWQ's scales, GPTQ's error compensation)."""
    inv = 1.0 / s_K.astype(np.float64)
    h_scaled = hessian_KK * inv[:, None] * inv[None, :]
    return gptq_pack((np.asarray(target_KN, np.float32) * s_K[:, None]).astype(np.float32), h_scaled, fmt,
                     mask=mask, config=config)


def output_error(target_KN: np.ndarray, w_eff_KN: np.ndarray, hessian_KK: np.ndarray) -> float:
    """tr(E^T H E) for E = target - w_eff: the squared output error on the calibration inputs."""
    import torch  # numpy's bundled BLAS is many times slower for [K, K] x [K, N]

    e = torch.from_numpy(np.asarray(target_KN, np.float64) - np.asarray(w_eff_KN, np.float64))
    return float(((torch.from_numpy(np.asarray(hessian_KK, np.float64)) @ e) * e).sum())


def awq(
    weights_KN: list[np.ndarray],
    hessian_KK: np.ndarray,
    mean_abs_K: np.ndarray,
    fmt: WeightFormat,
    *,
    targets_KN: list[np.ndarray] | None = None,
    masks: list[np.ndarray | None] | None = None,
    config: AWQConfig = AWQConfig(),
    gptq: GPTQConfig | None = None,
) -> AWQResult:
    """Search one s for the weights reading one activation (statistics `hessian_KK`, `mean_abs_K`)
    and store each weight as diag(s) W in `fmt`. `targets_KN` (default: the weights) are what
    the scaled, quantized weights should reproduce; `masks` keep 2:4 patterns. With `gptq`, the
    search is the same (round-to-nearest errors) and the chosen s's weights are then stored by
    GPTQ on the scaled weight (`gptq_scaled`) instead."""
    targets = targets_KN if targets_KN is not None else weights_KN
    masks = masks if masks is not None else [None] * len(weights_KN)
    h_diag = np.diag(hessian_KK).astype(np.float32)
    best: tuple[float, float, np.ndarray, tuple[PackedWeight, ...]] | None = None
    errors = []
    for step in range(config.grid):
        alpha = step / config.grid
        s = awq_scale(mean_abs_K, alpha, min_magnitude=config.min_magnitude)
        packed = tuple(quantize_scaled(w, s, h_diag, fmt, mask=m, clip_search=config.clip_search)
                       for w, m in zip(weights_KN, masks))
        err = sum(output_error(t, p.dequantize() / s[:, None], hessian_KK) for t, p in zip(targets, packed))
        errors.append(err)
        if best is None or err < best[0]:
            best = (err, alpha, s, packed)
    assert best is not None  # grid >= 1
    _, alpha, s, packed = best
    if gptq is not None:
        packed = tuple(gptq_scaled(t, s, hessian_KK, fmt, mask=m, config=gptq) for t, m in zip(targets, masks))
    return AWQResult(alpha, s, packed, tuple(errors))
