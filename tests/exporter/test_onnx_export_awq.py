"""An AWQ compile exports like any other: its scales (folded into the RMSNorms, or a Mul by a
constant in front of a MatMul) are ordinary ops, so onnxruntime gives `Session(device="sim")`'s
outputs within the parity tolerance (tests/exporter/test_onnx_parity.py)."""

from __future__ import annotations

import pytest

from aviatorc import zoo
from tests.exporter.test_onnx_parity import TOLERANCE, compile_and_export, max_relative_error, zoo_feeds
from tests.zoo_fixtures import zoo_dir, zoo_onnx  # noqa: F401


@pytest.mark.parametrize("method", ["awq", "awq-gptq"])
def test_awq_export_matches_the_sim_runtime(method, zoo_onnx, tmp_path):  # noqa: F811
    calibration = [{k: v.numpy() for k, v in zoo.example_inputs("llama", seed=seed).items()} for seed in range(3)]
    path, art = compile_and_export(str(zoo_onnx("llama", "legacy")), tmp_path, f"int4-{method}", context=64, prompt=8,
                                   quant="int4", quant_method=method, calibration=calibration)
    assert max_relative_error(path, art, zoo_feeds("llama")) <= TOLERANCE
