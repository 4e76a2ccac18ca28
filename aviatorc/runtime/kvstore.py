"""A sequence's KV cache as the runtime keeps it, one entry per cache input: the graph's own
array (`DenseKV`), or, for a plan compiled with `--kv-dtype int8`, int8 codes with one fp16 scale
per head and token (`Int8KV`). Both answer the same calls:

    entry = Int8KV.of(present, axis)          # quantize a cache input (axis: its sequence axis)
    entry = entry.grown(present, length)      # a step's present: only positions >= length are new
    entry.dense()                             # what the graph is fed: codes x scales, its dtype
    entry.window(start, stop)                 # positions [start, stop), a view (rollback by length)
    entry.without(start, stop)                # those positions evicted (a bounded cache)

The int8 layout is the one the cost model counts for `kv_dtype="int8"` (`aviatorc.quant.kv`:
a head's D values of one token share a scale, so the last axis must be the head's width). Only
the positions a step adds are quantized; the ones before stay the codes they were, so a long
sequence does not drift by requantizing its past. Dequantized values requantize to the same codes,
so a prefix handed out dense (`Session.prefix`) comes back the same (`Session.resume`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from aviatorc.quant.kv import dequantize_kv, quantize_kv


def _along(axis: int, start: int, stop: int | None) -> tuple[slice, ...]:
    return (slice(None),) * axis + (slice(start, stop),)


@dataclass(frozen=True)
class DenseKV:
    """One cache input of one sequence as the graph's own array."""

    array: np.ndarray
    axis: int  # the sequence axis

    @property
    def length(self) -> int:
        return int(self.array.shape[self.axis])

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    def dense(self) -> np.ndarray:
        return self.array

    def window(self, start: int, stop: int) -> DenseKV:
        return DenseKV(self.array[_along(self.axis, start, stop)], self.axis)

    def without(self, start: int, stop: int) -> DenseKV:
        parts = (self.array[_along(self.axis, 0, start)], self.array[_along(self.axis, stop, None)])
        return DenseKV(np.concatenate(parts, axis=self.axis), self.axis)

    def grown(self, present: np.ndarray, length: int) -> DenseKV:
        """The step's present holds the `length` positions before and the new ones."""
        return DenseKV(present, self.axis)


@dataclass(frozen=True)
class Int8KV:
    """One cache input of one sequence: codes [..., D] int8 and scales [..., 1] fp16 along `axis`."""

    codes: np.ndarray
    scales: np.ndarray
    axis: int  # the sequence axis
    dtype: np.dtype  # what the graph reads

    @classmethod
    def of(cls, x: np.ndarray, axis: int) -> Int8KV:
        """`x` quantized; `axis`, its sequence axis, is not the last (the session checks)."""
        codes, scales = quantize_kv(x)
        return cls(codes, scales, axis, x.dtype)

    @property
    def length(self) -> int:
        return int(self.codes.shape[self.axis])

    @property
    def nbytes(self) -> int:
        return int(self.codes.nbytes + self.scales.nbytes)

    def dense(self) -> np.ndarray:
        return dequantize_kv(self.codes, self.scales).astype(self.dtype, copy=False)

    def window(self, start: int, stop: int) -> Int8KV:
        """Positions [start, stop): views, not copies."""
        at = _along(self.axis, start, stop)
        return Int8KV(self.codes[at], self.scales[at], self.axis, self.dtype)

    def without(self, start: int, stop: int) -> Int8KV:
        """Positions [start, stop) evicted (a bounded cache's middle)."""
        head, tail = self.window(0, start), self.window(stop, self.length)
        return Int8KV(np.concatenate([head.codes, tail.codes], axis=self.axis),
                      np.concatenate([head.scales, tail.scales], axis=self.axis), self.axis, self.dtype)

    def grown(self, present: np.ndarray, length: int) -> Int8KV:
        """These `length` positions, then `present`'s positions from `length` on, quantized."""
        new = Int8KV.of(present[_along(self.axis, length, None)], self.axis)
        kept = self.window(0, length)
        return Int8KV(np.concatenate([kept.codes, new.codes], axis=self.axis),
                      np.concatenate([kept.scales, new.scales], axis=self.axis), self.axis, self.dtype)


KVEntry = DenseKV | Int8KV
