"""Calibration: statistics of each MatMul's input activations over the user's batches.

`collect_stats` runs the reference interpreter on each batch, keeping the inputs of the
MatMuls asked for (`evaluate(graph, feed, keep=...)`), and accumulates per layer:
- the Hessian H = X^T X (for GPTQ / SparseGPT), X the activations flattened to [T, K];
- the squared norm of each input channel (Wanda's ||x_k||^2 = diag H, kept separately so it
  exists when Hessians are skipped);
- min, max and a high percentile of |x| (W8A8 activation ranges): the percentile is
  computed per batch and averaged, which bounds memory on long calibration sets.
The passes call it once per calibration stage on the partially rewritten graph (sequential
calibration, `aviatorc.passes._weights.calibration_stages`), so later layers see the inputs
the already-quantized earlier layers produce. Each stage runs the graph only up to its own
MatMuls (`evaluate(..., only_kept=True)`); the unrewritten graph's activations, which GPTQ and
SparseGPT fit to, are the same for every stage and are evaluated once (`reference_activations`).
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
    hessian: np.ndarray | None = None  # [K, K] float64
    cross: np.ndarray | None = None  # [K, K] float64: X^T X_ref, X_ref the same input in the reference graph
    lo: float = float("inf")
    hi: float = float("-inf")
    pct_lo: list[float] = field(default_factory=list)
    pct_hi: list[float] = field(default_factory=list)

    def add(self, x: np.ndarray, *, hessian: bool, percentile: float, x_ref: np.ndarray | None = None) -> None:
        x_TK = np.asarray(x, dtype=np.float64).reshape(-1, self.k)
        self.tokens += x_TK.shape[0]
        sq = (x_TK**2).sum(axis=0)
        self.sq_norm = sq if self.sq_norm is None else self.sq_norm + sq
        if hessian:
            import torch  # numpy's bundled BLAS is many times slower here for [K, K] products

            xt = torch.from_numpy(x_TK)
            h = (xt.T @ xt).numpy()
            self.hessian = h if self.hessian is None else self.hessian + h
            if x_ref is not None:
                c = (xt.T @ torch.from_numpy(np.asarray(x_ref, dtype=np.float64).reshape(-1, self.k))).numpy()
                self.cross = c if self.cross is None else self.cross + c
        self.lo, self.hi = min(self.lo, float(x_TK.min())), max(self.hi, float(x_TK.max()))
        self.pct_lo.append(float(np.percentile(x_TK, 100.0 - percentile)))
        self.pct_hi.append(float(np.percentile(x_TK, percentile)))

    @property
    def x_norm(self) -> np.ndarray:
        assert self.sq_norm is not None
        return np.sqrt(self.sq_norm)

    def range(self, method: str) -> tuple[float, float]:
        """(lo, hi) of the activation: 'minmax' or 'percentile' (mean of per-batch percentiles)."""
        if method == "minmax":
            return self.lo, self.hi
        return float(np.mean(self.pct_lo)), float(np.mean(self.pct_hi))


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


def reference_activations(reference: Any, batches: Sequence[Mapping[str, Any]],
                          names: Sequence[str]) -> list[dict[str, np.ndarray]]:
    """The named values of the unrewritten graph on each batch, for `collect_stats(reference=)`:
    evaluated once, however many stages ask."""
    from aviatorc.ir.interpreter import evaluate

    return [evaluate(reference, feed, keep=tuple(dict.fromkeys(names)), only_kept=True)
            for feed in check_batches(reference, batches)]


def collect_stats(
    graph: Any,
    batches: Sequence[Mapping[str, Any]],
    value_names: Sequence[str],
    *,
    hessian: bool = True,
    percentile: float = 99.99,
    reference: Any = None,
) -> dict[str, ActivationStats]:
    """Statistics of the named values (MatMul inputs) over all batches.

    With `reference` and `hessian`, each statistic also gets the cross term X^T X_ref
    (`corrected_target`): `reference` is the graph before any rewriting, holding values of the
    same names, or its activations per batch from `reference_activations`."""
    from aviatorc.ir.interpreter import evaluate

    names = tuple(dict.fromkeys(value_names))
    stats: dict[str, ActivationStats] = {}
    feeds = check_batches(graph, batches)
    if reference is not None and hessian and not isinstance(reference, list):
        reference = reference_activations(reference, feeds, names)
    for index, feed in enumerate(feeds):
        kept = evaluate(graph, feed, keep=names, only_kept=True)
        kept_ref = reference[index] if reference is not None and hessian else {}
        for name in names:
            x = kept[name] if name in kept else feed[name]  # a graph input feeds the MatMul
            x_ref = kept_ref.get(name, feed.get(name)) if kept_ref else None
            if name not in stats:
                stats[name] = ActivationStats(int(x.shape[-1]))
            stats[name].add(x, hessian=hessian, percentile=percentile, x_ref=x_ref)
    return stats
