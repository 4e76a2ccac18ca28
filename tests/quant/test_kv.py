"""INT8 KV cache: exact round trip where the grid allows it, bounded error, and its bytes."""

import numpy as np

from aviatorc.quant.kv import attention_error, dequantize_kv, quantize_kv
from aviatorc.schedule.memory import kv_bytes_per_token


def test_values_on_the_grid_round_trip_exactly():
    x = np.array([[127.0, -127.0, 0.0, 64.0]], np.float32) * 0.5
    codes, scale = quantize_kv(x)
    np.testing.assert_array_equal(dequantize_kv(codes, scale), x)
    assert codes.dtype == np.int8 and scale.shape == (1, 1)


def test_error_is_within_half_a_step_per_vector():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 16, 4, 32)).astype(np.float32) * rng.uniform(0.1, 10, (2, 16, 4, 1))
    codes, scale = quantize_kv(x)
    step = scale.astype(np.float32)
    # half a step of rounding, plus the fp16 rounding of the scale itself times the largest code
    assert np.all(np.abs(dequantize_kv(codes, scale) - x) <= step * (0.5 + 127 * 2**-10))


def test_attention_with_an_int8_cache_stays_close_and_zero_vectors_survive():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 4, 3, 32)).astype(np.float32) for _ in range(3))
    k[0, 0, 1] = 0  # an all-zero head vector has scale 0 and must not divide by it
    error = attention_error(q, k, v)
    assert error["cosine"] > 0.9999 and error["relative_rms"] < 0.01


def test_bytes_per_token_count_the_scales():
    # 8 heads of 128 for K and for V: 2048 int8 codes and 16 fp16 scales
    assert kv_bytes_per_token(2048, "int8") == 2048 + 16 * 2
    assert kv_bytes_per_token(2048, "bf16") == kv_bytes_per_token(2048, "fp16") == 4096
