"""Choosing the next token from logits: greedy, temperature, nucleus (top-p), seeded.

    rng = np.random.default_rng(seed)
    token = sample(logits, temperature=0.7, top_p=0.9, rng=rng)

Temperature 0 is greedy (argmax, ties to the lowest id, as `torch.argmax`). Otherwise the
logits are divided by the temperature, the smallest set of tokens whose probability reaches
`top_p` is kept (always at least the most likely one), and a token is drawn from it.
"""

from __future__ import annotations

import numpy as np

from aviatorc.errors import OptionError


def check_sampling(temperature: float, top_p: float) -> None:
    if not (temperature >= 0 and np.isfinite(temperature)):
        raise OptionError(f"temperature must be a finite number >= 0, not {temperature}")
    if not 0 < top_p <= 1:
        raise OptionError(f"top_p must be in (0, 1], not {top_p}")


def sample(logits: np.ndarray, *, temperature: float = 0.0, top_p: float = 1.0,
           rng: np.random.Generator | None = None) -> int:
    """One token id from a [vocab] row of logits."""
    check_sampling(temperature, top_p)
    row = np.asarray(logits, dtype=np.float64).reshape(-1)
    if temperature == 0:
        return int(np.argmax(row))
    scaled = row / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    cumulative = np.cumsum(probs[order])
    keep = order[: int(np.searchsorted(cumulative, top_p - 1e-9)) + 1]  # 1e-9: rounding in the cumsum
    kept = probs[keep] / probs[keep].sum()
    rng = rng if rng is not None else np.random.default_rng()
    return int(keep[rng.choice(len(keep), p=kept)])
