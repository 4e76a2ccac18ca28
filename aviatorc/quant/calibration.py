"""Calibration: statistics of each MatMul's input activations over the user's batches.

`ActivationStats` accumulates, per MatMul input, over the batches:
- the Hessian H = X^T X (for GPTQ / SparseGPT), X the activations flattened to [T, K];
- the squared norm of each input channel (Wanda's ||x_k||^2 = diag H, kept separately so it
  exists when Hessians are skipped);
- min, max and a high percentile of |x| (W8A8 activation ranges): the percentile is
  computed per batch and averaged, which bounds memory on long calibration sets.
- the sum of |x| per input channel (AWQ's activation magnitude).
Padding positions are not calibration data: where the graph has an `attention_mask` input
(`token_mask`), only the rows of real tokens are accumulated, so a batch of sentences padded
to one length gives the statistics of its sentences alone; `tokens` counts the rows kept.
The activations come from `aviatorc.quant.sequential.calibrate_sequentially`, which
evaluates the graph stage by stage (sequential calibration,
`aviatorc.passes._weights.calibration_stages`), so later layers see the inputs the
already-rewritten earlier layers produce. `check_batches` turns the user's batches into
checked feeds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aviatorc.errors import AviatorError, OptionError


@dataclass
class ActivationStats:
    """Running statistics of one activation of width K."""

    k: int
    tokens: int = 0
    sq_norm: np.ndarray | None = None  # [K]
    abs_sum: np.ndarray | None = None  # [K]: sum of |x| over the tokens
    hessian: np.ndarray | None = None  # [K, K] float64
    cross: np.ndarray | None = None  # [K, K] float64: X^T X_ref, X_ref the same input in the reference graph
    lo: float = float("inf")
    hi: float = float("-inf")
    pct_lo: list[float] = field(default_factory=list)
    pct_hi: list[float] = field(default_factory=list)

    def add(self, x: np.ndarray, *, hessian: bool, percentile: float, x_ref: np.ndarray | None = None,
            real: np.ndarray | None = None) -> None:
        """Accumulate activation `x` (any shape ending in K). `real` ([B, S] bool, from `token_mask`)
        keeps only the rows of real tokens, when x holds one row per position (x is [B, S, K]
        or [B * S, K]); an activation of another row count is taken whole."""
        x_TK = np.asarray(x, dtype=np.float64).reshape(-1, self.k)
        ref_TK = None if x_ref is None else np.asarray(x_ref, dtype=np.float64).reshape(-1, self.k)
        if real is not None and real.size == x_TK.shape[0]:
            rows = real.reshape(-1)
            x_TK = x_TK[rows]
            ref_TK = None if ref_TK is None else ref_TK[rows]
        if x_TK.shape[0] == 0:
            return  # a batch of padding only
        self.tokens += x_TK.shape[0]
        sq = (x_TK**2).sum(axis=0)
        self.sq_norm = sq if self.sq_norm is None else self.sq_norm + sq
        absolute = np.abs(x_TK).sum(axis=0)
        self.abs_sum = absolute if self.abs_sum is None else self.abs_sum + absolute
        if hessian:
            import torch  # numpy's bundled BLAS is many times slower here for [K, K] products

            xt = torch.from_numpy(x_TK)
            h = (xt.T @ xt).numpy()
            self.hessian = h if self.hessian is None else self.hessian + h
            if ref_TK is not None:
                c = (xt.T @ torch.from_numpy(ref_TK)).numpy()
                self.cross = c if self.cross is None else self.cross + c
        self.lo, self.hi = min(self.lo, float(x_TK.min())), max(self.hi, float(x_TK.max()))
        self.pct_lo.append(float(np.percentile(x_TK, 100.0 - percentile)))
        self.pct_hi.append(float(np.percentile(x_TK, percentile)))

    @property
    def mean_abs(self) -> np.ndarray:
        """Mean |x| per input channel over the tokens: AWQ's activation magnitude."""
        assert self.abs_sum is not None
        return self.abs_sum / max(self.tokens, 1)

    @property
    def x_norm(self) -> np.ndarray:
        assert self.sq_norm is not None
        return np.sqrt(self.sq_norm)

    def range(self, method: str) -> tuple[float, float]:
        """(lo, hi) of the activation: 'minmax' or 'percentile' (mean of per-batch percentiles)."""
        if method == "minmax":
            return self.lo, self.hi
        return float(np.mean(self.pct_lo)), float(np.mean(self.pct_hi))


MASK_INPUT = "attention_mask"  # the name transformers' exports and the torch frontend give it


def token_mask(graph: Any, feed: Mapping[str, np.ndarray]) -> np.ndarray | None:
    """The real (not padding) positions of a batch, [B, S] bool, from the graph's 2-D
    `attention_mask` input (nonzero: a real token); None when the graph has no such input."""
    names = {v.name: v for v in graph.inputs}
    value = names.get(MASK_INPUT)
    if value is None or value.type.rank != 2 or MASK_INPUT not in feed:
        return None
    return np.asarray(feed[MASK_INPUT]) != 0


def check_batches(graph: Any, batches: Sequence[Mapping[str, Any]] | None) -> list[dict[str, np.ndarray]]:
    """The batches as checked feed dicts; a mismatch is an OptionError naming the batch and input."""
    from aviatorc.ir.interpreter import check_feeds

    if batches is None:
        return []
    checked = []
    for index, batch in enumerate(batches):
        if not isinstance(batch, Mapping):
            raise OptionError(f"calibration batch {index} is a {type(batch).__name__}, not a dict of input arrays")
        try:
            checked.append(check_feeds(graph, batch))
        except AviatorError as error:
            raise OptionError(f"calibration batch {index} does not match the model: {error.message}",
                              hint=error.hint) from None
    return checked
