"""Model-zoo parity through ONNX: each tiny transformers model (aviatorc.zoo) exported with the
dynamo exporter (opsets 18, 20, 23; static and dynamic shapes) and the legacy TorchScript
exporter (opset 17), imported, run by the IR interpreter, and compared with onnxruntime and
eager torch in fp32 (max abs diff <= 1e-4). A decode step with a KV cache (dynamic past
length) is checked the same way.

GPT-2 and Llama with the default exporters run in the fast suite; the full matrix is slow
(each export takes seconds).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
import transformers  # noqa: F401

from aviatorc import zoo  # noqa: E402
from aviatorc.frontends.onnx import import_onnx  # noqa: E402
from aviatorc.ir import evaluate  # noqa: E402

if str(Path(__file__).resolve().parents[2]) not in sys.path:  # `tests` is not a package on pytest's path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.zoo_fixtures import decode_onnx_path, zoo_dir, zoo_onnx  # noqa: E402, F401

TOLERANCE = 1e-4
FAST = {("gpt2", "dynamo", 18), ("gpt2", "legacy", 17), ("llama", "dynamo", 18), ("llama", "legacy", 17)}


def _cases() -> list:
    cases = []
    for arch in zoo.ZOO_ARCHS:
        for exporter, opset in (("dynamo", 18), ("legacy", 17)):
            marks = () if (arch, exporter, opset) in FAST else (pytest.mark.slow,)
            cases.append(pytest.param(arch, exporter, opset, False, marks=marks, id=f"{arch}-{exporter}{opset}"))
    for arch in ("gpt2", "llama"):
        for exporter, opset, dynamic in (
            ("dynamo", 20, False),
            ("dynamo", 23, False),
            ("dynamo", 18, True),
            ("legacy", 17, True),
        ):
            cases.append(
                pytest.param(
                    arch,
                    exporter,
                    opset,
                    dynamic,
                    marks=pytest.mark.slow,
                    id=f"{arch}-{exporter}{opset}{'-dynamic' if dynamic else ''}",
                )
            )
    return cases


def _compare(path: Path, arch: str, inputs: dict) -> tuple[float, float]:
    """Max abs diff of the interpreter against onnxruntime and against eager torch."""
    graph = import_onnx(path)
    arrays = {k: v.numpy() for k, v in inputs.items()}
    out = zoo.output_name(arch)
    ours = evaluate(graph, {v.name: arrays[v.name] for v in graph.inputs})[out]
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    theirs = session.run([out], {i.name: arrays[i.name] for i in session.get_inputs()})[0]
    with torch.no_grad():
        eager = zoo.build_model(arch)(**inputs).numpy()
    assert ours.shape == theirs.shape == eager.shape
    return float(np.max(np.abs(ours - theirs))), float(np.max(np.abs(ours - eager)))


@pytest.mark.parametrize("arch,exporter,opset,dynamic", _cases())
def test_zoo_parity(zoo_onnx, arch: str, exporter: str, opset: int, dynamic: bool) -> None:  # noqa: F811
    path = zoo_onnx(arch, exporter, opset, dynamic)
    shapes = [(1, 8), (2, 5)] if dynamic else [(1, 8)]
    for batch, seq in shapes:
        vs_ort, vs_torch = _compare(path, arch, zoo.example_inputs(arch, batch=batch, seq=seq))
        print(f"{arch} {exporter} opset {opset} [{batch}x{seq}]: ort {vs_ort:.2e}, torch {vs_torch:.2e}")
        assert vs_ort <= TOLERANCE and vs_torch <= TOLERANCE
    if opset == 23:
        graph = import_onnx(path)
        print(f"opset 23 ops: {graph.op_census()}")
    if not dynamic:
        # Static exports fold their shape computations away.
        assert "Shape" not in import_onnx(path).op_census()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama"])
def test_zoo_decode_step_parity(zoo_dir: Path, arch: str) -> None:  # noqa: F811
    """One decode step (Range, Squeeze, comparisons, Cos/Sin, KV cache) at two past lengths."""
    path = decode_onnx_path(arch, zoo_dir)
    graph = import_onnx(path)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    model = zoo.build_decode_model(arch)
    in_names, out_names = zoo.decode_input_names(arch)
    for past in (3, 9):
        inputs = zoo.decode_example_inputs(arch, past=past)
        arrays = {k: v.numpy() for k, v in inputs.items()}
        ours = evaluate(graph, {v.name: arrays[v.name] for v in graph.inputs})
        theirs = dict(
            zip(out_names, session.run(out_names, {i.name: arrays[i.name] for i in session.get_inputs()}), strict=False)
        )
        with torch.no_grad():
            eager = dict(zip(out_names, (t.numpy() for t in model(*inputs.values())), strict=False))
        for name in out_names:
            assert ours[name].shape == theirs[name].shape == eager[name].shape
            assert float(np.max(np.abs(ours[name] - theirs[name]))) <= TOLERANCE, name
            assert float(np.max(np.abs(ours[name] - eager[name]))) <= TOLERANCE, name
