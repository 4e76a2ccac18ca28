"""The zoo fixtures themselves: every arch exports both ways, passes the ONNX
checker, and onnxruntime matches eager torch.

Tolerance 1e-4: both sides compute in float32 with the same op order up to
fusion; differences seen here are below 1.2e-6 (tiny hidden sizes).
"""

# Fixtures imported from tests/zoo_fixtures.py are redefined as test parameters (F811).
# ruff: noqa: F811

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from aviatorc import zoo

try:  # `python -m pytest` from the repo root puts the root on sys.path ...
    from tests.zoo_fixtures import decode_onnx_path, zoo_dir, zoo_onnx  # noqa: F401
except ImportError:  # ... plain `pytest` (rootdir-less import mode) puts tests/ there instead.
    from zoo_fixtures import decode_onnx_path, zoo_dir, zoo_onnx  # type: ignore[no-redef]  # noqa: F401

import onnx
import onnxruntime as ort
import torch

ATOL = 1e-4


def _run_ort(path: Path, inputs: dict[str, torch.Tensor]) -> list[np.ndarray]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feed = {i.name: inputs[i.name].numpy() for i in session.get_inputs()}
    return session.run(None, feed)


def _eager(arch: str, inputs: dict[str, torch.Tensor]) -> np.ndarray:
    with torch.no_grad():
        return zoo.build_model(arch)(**inputs).numpy()


@pytest.mark.parametrize("exporter", ["dynamo", "legacy"])
@pytest.mark.parametrize("arch", zoo.ZOO_ARCHS)
def test_export_matches_eager(arch: str, exporter: zoo.Exporter, zoo_onnx: Callable[..., Path]) -> None:
    path = zoo_onnx(arch, exporter)
    model = onnx.load(str(path))
    assert [o.name for o in model.graph.output] == [zoo.output_name(arch)]
    inputs = zoo.example_inputs(arch)
    (got,) = _run_ort(path, inputs)
    np.testing.assert_allclose(got, _eager(arch, inputs), atol=ATOL, rtol=0)


@pytest.mark.slow
# Only the pairs where the opset changes the graph: RMSNormalization (23), Gelu (20).
@pytest.mark.parametrize(("arch", "opset"), [("llama", 23), ("bert", 20)])
def test_newer_opsets(arch: str, opset: int, zoo_onnx: Callable[..., Path]) -> None:
    path = zoo_onnx(arch, "dynamo", opset)
    assert onnx.load(str(path)).opset_import[0].version == opset
    inputs = zoo.example_inputs(arch)
    (got,) = _run_ort(path, inputs)
    np.testing.assert_allclose(got, _eager(arch, inputs), atol=ATOL, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "exporter"), [("llama", "dynamo"), ("bert", "legacy")])
def test_dynamic_shapes(arch: str, exporter: zoo.Exporter, zoo_onnx: Callable[..., Path]) -> None:
    path = zoo_onnx(arch, exporter, dynamic=True)
    # A batch and length other than the ones traced with.
    inputs = zoo.example_inputs(arch, batch=2, seq=5, seed=3)
    (got,) = _run_ort(path, inputs)
    assert got.shape[:2] == (2, 5)
    np.testing.assert_allclose(got, _eager(arch, inputs), atol=ATOL, rtol=0)


@pytest.mark.slow
def test_decode_step_matches_eager(zoo_dir: Path) -> None:
    path = decode_onnx_path("llama", zoo_dir)
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert {"Range", "Cos", "Sin"} <= ops
    model = zoo.build_decode_model("llama")
    for past in (3, 11):  # the past length is a dynamic axis
        inputs = zoo.decode_example_inputs("llama", past=past, seed=past)
        got = _run_ort(path, inputs)
        with torch.no_grad():
            want = model(*inputs.values())
        assert got[1].shape[2] == past + 1
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w.numpy(), atol=ATOL, rtol=0)


def test_build_is_deterministic_and_perturbed() -> None:
    a, b = zoo.build_model("gpt2", seed=0), zoo.build_model("gpt2", seed=0)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
    biases = [p for n, p in a.named_parameters() if n.endswith("bias")]
    assert biases and all(p.abs().sum() > 0 for p in biases)
    c = zoo.build_model("gpt2", seed=1)
    assert not torch.equal(next(a.parameters()), next(c.parameters()))


def test_unknown_arch_and_low_dynamo_opset(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown zoo architecture 'gptj'"):
        zoo.build_model("gptj")
    with pytest.raises(ValueError, match="ask for >= 18"):
        zoo.export_onnx("gpt2", tmp_path / "x.onnx", exporter="dynamo", opset=17)


def test_zoo_module_does_not_import_torch() -> None:
    code = "import sys, aviatorc.zoo; sys.exit('torch' in sys.modules)"
    root = Path(__file__).resolve().parents[1]
    assert subprocess.run([sys.executable, "-c", code], cwd=root).returncode == 0
