"""Mixture-of-experts graphs export to standard ONNX and onnxruntime runs them as the sim does.

`MoERouter` becomes scores, TopK (the lower index first on ties, as the kernel), GatherElements
and ScatterElements into a zero row; `MoEDispatch` an Identity (or a Mul by the expert's weight
column); `MoECombine` a Mul and an Add. Each expert's projections stay separate MatMuls. The
families cover a renormalized softmax (Mixtral), a group-limited sigmoid with a selection bias
and scaling (DeepSeek-V3) and input-scaled experts (Llama 4). Tolerance as in
test_onnx_parity.py: 1e-5 of the largest output (measured <= 3.3e-7).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

import aviatorc
from aviatorc import zoo
from aviatorc.exporter import export
from tests.exporter.test_onnx_parity import TOLERANCE, ort_session


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3", "llama4_text"])
def test_moe_model_exports_and_runs_in_onnxruntime(arch, tmp_path):
    tokens = np.random.default_rng(0).integers(3, zoo.VOCAB_SIZE, (2, 7))
    model = zoo.build_family_model(arch)
    art = tmp_path / "model.avc"
    aviatorc.compile(model, {"input_ids": torch.from_numpy(tokens), "use_cache": False}, target="mock",
                     time_limit_s=1.0).save(art, html_report=False)
    path = tmp_path / "onnx" / "model.onnx"
    export(art, path)
    onnx.checker.check_model(str(path), full_check=True)
    ops = {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}
    assert {"TopK", "GatherElements", "ScatterElements"} <= ops
    session = ort_session(path)
    feeds = {session.get_inputs()[0].name: tokens}
    (got,) = session.run(None, feeds)
    (want,) = aviatorc.Session(art, device="sim").run(feeds).values()
    assert np.abs(got - want).max() <= TOLERANCE * np.abs(want).max()
