"""Choosing the next token from logits: greedy, temperature, nucleus (top-p), seeded.

    rng = np.random.default_rng(seed)
    token = sample(logits, temperature=0.7, top_p=0.9, rng=rng)

Temperature 0 is greedy (argmax, ties to the lowest id, as `torch.argmax`). Otherwise the
logits are divided by the temperature, the smallest set of tokens whose probability reaches
`top_p` is kept (always at least the most likely one), and a token is drawn from it.

`logprobs` reports the log-probability of the chosen token and of the most likely ones, from
the model's own distribution (log-softmax of the raw logits, before temperature or top-p), as
vLLM does by default and as OpenAI's `logprobs` fields are read.
"""

from __future__ import annotations

from dataclasses import dataclass

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


MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs


@dataclass(frozen=True)
class Logprobs:
    """The chosen token's log-probability and the `top` most likely tokens' (id, log-probability),
    most likely first (ties to the lower id)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def logprobs(logits: np.ndarray, token: int, top: int = 0) -> Logprobs:
    """Log-softmax of a [vocab] row of logits (in float64) at `token`, and its `top` largest."""
    row = np.asarray(logits, dtype=np.float64).reshape(-1)
    shifted = row - row.max()
    log_probs = shifted - np.log(np.exp(shifted).sum())
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        order = np.argsort(-log_probs, kind="stable")[:top]
        best = tuple((int(i), float(log_probs[i])) for i in order)
    return Logprobs(int(token), float(log_probs[token]), best)
