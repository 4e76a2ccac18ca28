"""An INT8 KV cache: per token and head, a symmetric 8-bit code per element and one fp16 scale.

    codes, scales = quantize_kv(k_BSHD)          # int8 [B, S, H, D], float16 [B, S, H, 1]
    k_hat = dequantize_kv(codes, scales)

This is the layout `aviatorc.schedule.memory.kv_bytes_per_token` counts for `kv_dtype="int8"`
(D bytes plus a 2-byte scale per head and token, for K and for V). `attention_error` measures
what it costs on real K/V: the attention output with the dequantized cache against the exact one.
"""

from __future__ import annotations

import numpy as np


def quantize_kv(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Codes and scales of x [..., D]: one scale per vector along the last axis (a head of one token)."""
    x = x.astype(np.float32)
    scale = (np.abs(x).max(axis=-1, keepdims=True) / 127.0).astype(np.float16)
    safe = np.where(scale == 0, np.float16(1), scale).astype(np.float32)
    codes = np.clip(np.rint(x / safe), -127, 127).astype(np.int8)
    return codes, scale


def dequantize_kv(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return codes.astype(np.float32) * scale.astype(np.float32)


def attention(q_BHSD: np.ndarray, k_BHTD: np.ndarray, v_BHTD: np.ndarray) -> np.ndarray:
    scores = q_BHSD @ np.swapaxes(k_BHTD, -1, -2) / np.sqrt(q_BHSD.shape[-1])
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    return weights @ v_BHTD


def attention_error(q_BHSD: np.ndarray, k_BHTD: np.ndarray, v_BHTD: np.ndarray) -> dict[str, float]:
    """Cosine and max relative error of attention with an INT8 cache against the exact one."""
    exact = attention(q_BHSD, k_BHTD, v_BHTD)
    approx = attention(q_BHSD, dequantize_kv(*quantize_kv(k_BHTD)), dequantize_kv(*quantize_kv(v_BHTD)))
    a, b = exact.reshape(-1), approx.reshape(-1)
    cosine = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
    return {"cosine": cosine, "max_abs_diff": float(np.abs(a - b).max()),
            "relative_rms": float(np.linalg.norm(a - b) / np.linalg.norm(a))}
