"""The ONNX export's structure and errors: standard QDQ with the artifact's own codes, MatMulNBits
with its layout, FP16 tables kept, 2:4 stated, external data, atomic writes, and the refusals
(a shape-only artifact, an op with no mapping, an output that is a folder), through the API and
the CLI. Numerics against the sim runtime are in test_onnx_parity.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import aviatorc
from aviatorc import zoo
from aviatorc.cli import main
from aviatorc.errors import OptionError
from aviatorc.exporter import CONVERTERS, ExportError, export
from aviatorc.ir import get_op
from tests.zoo_fixtures import zoo_dir, zoo_onnx  # noqa: F401


@pytest.fixture(scope="module")
def artifacts(zoo_onnx, tmp_path_factory):  # noqa: F811
    """Artifacts of the tiny Llama by label, each compiled once for the module."""
    tmp = tmp_path_factory.mktemp("artifacts")
    options = {"int4": {"quant": "int4", "group_size": 32, "symmetric": True}, "int8": {"quant": "int8"},
               "int4-default": {"quant": "int4", "group_size": 32},  # data-free: fp16 offsets, an int8 head
               "int8-g64": {"quant": "int8", "group_size": 64},
               "mxint4": {"quant": "mxint4", "group_size": 32},
               "sparse": {"quant": "int4", "group_size": 32, "symmetric": False, "sparsity": "2:4"}}
    cache: dict[str, Path] = {}

    def get(label: str) -> Path:
        if label not in cache:
            cache[label] = tmp / f"{label}.avc"
            aviatorc.compile(str(zoo_onnx("llama", "legacy")), target="mock", context=64, prompt=8, time_limit_s=1.0,
                             **options[label]).save(cache[label], html_report=False)
        return cache[label]

    return get


def load(path: Path):
    import onnx

    return onnx.load(str(path))


def initializers(model) -> dict:
    from onnx import numpy_helper

    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def ir_weights(artifact: Path) -> dict[str, np.ndarray]:
    """Each DequantizeWeight output of the artifact's graph, read back by the IR's own kernel."""
    from aviatorc.exporter.weights import initializer_arrays

    art = aviatorc.load(artifact)
    graph = art.graph()
    arrays = initializer_arrays(art, graph)
    opdef = get_op("DequantizeWeight")
    return {node.outputs[0].name: opdef.kernel([arrays[v.name] if v is not None else None for v in node.inputs],
                                               node.attrs)[0]
            for node in graph.nodes if node.op == "DequantizeWeight"}


def test_int4_weights_are_blocked_dequantize_linear_of_the_artifacts_own_codes(artifacts, tmp_path):
    import onnx

    out = export(artifacts("int4"), tmp_path / "model.onnx")
    model = load(out.path)
    onnx.checker.check_model(model, full_check=True)
    assert out.opset >= 21 and model.opset_import[0].version == out.opset
    assert out.formats == {"int4-g32": 11}
    arrays = initializers(model)
    dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dq) == 11
    want = ir_weights(artifacts("int4"))
    for node in dq:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs == {"axis": 0, "block_size": 32}
        codes = next(t for t in model.graph.initializer if t.name == node.input[0])
        assert codes.data_type == onnx.TensorProto.INT4
        assert len(node.input) == 2  # symmetric: no zero point
        x, scale = arrays[node.input[0]].astype(np.float32), arrays[node.input[1]]
        assert scale.dtype == np.float32
        got = x * np.repeat(scale, 32, axis=0)[: x.shape[0]]
        np.testing.assert_array_equal(got, want[node.output[0]])  # the stored codes and scales, bit for bit


def test_int8_is_per_channel_and_the_fp16_table_stays_fp16(artifacts, tmp_path):
    import onnx

    model = load(export(artifacts("int8"), tmp_path / "model.onnx").path)
    for node in (n for n in model.graph.node if n.op_type == "DequantizeLinear"):
        assert {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute} == {"axis": 1}
    tables = [n for n in model.graph.node if n.op_type == "Gather" and "embed" in n.input[0]]
    assert tables, "the token table is read by a Gather"
    table = next(t for t in model.graph.initializer if t.name == tables[0].input[0])
    assert table.data_type == onnx.TensorProto.FLOAT16
    users = [n for n in model.graph.node if tables[0].output[0] in n.input]
    assert [n.op_type for n in users] == ["Cast"]


def test_group_wise_int8_is_blocked_dequantize_linear_or_8_bit_matmul_nbits(artifacts, tmp_path):
    """int8 g64: int8 codes with a float32 scale per 64 rows of a column, bit for bit the IR's weights;
    with --matmul-nbits, MatMulNBits bits=8 (one code + 128 per byte, no zero points)."""
    import onnx

    model = load(export(artifacts("int8-g64"), tmp_path / "qdq.onnx").path)
    onnx.checker.check_model(model, full_check=True)
    arrays, want = initializers(model), ir_weights(artifacts("int8-g64"))
    dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dq) == 11
    for node in dq:
        assert {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute} == {"axis": 0, "block_size": 64}
        codes, scale = arrays[node.input[0]], arrays[node.input[1]]
        assert codes.dtype == np.int8 and scale.shape == (-(-codes.shape[0] // 64), codes.shape[1])
        got = codes.astype(np.float32) * np.repeat(scale, 64, axis=0)[: codes.shape[0]]
        np.testing.assert_array_equal(got, want[node.output[0]])

    out = export(artifacts("int8-g64"), tmp_path / "nbits.onnx", matmul_nbits=True)
    model = load(out.path)
    assert out.matmul_nbits == 11 and not [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    arrays = initializers(model)
    graph = aviatorc.load(artifacts("int8-g64")).graph()
    weight_of = {n.name: n.inputs[1].name for n in graph.nodes if n.op == "MatMul" and n.inputs[1] is not None}
    for node in (n for n in model.graph.node if n.op_type == "MatMulNBits"):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["bits"] == 8 and attrs["block_size"] == 64 and len(node.input) == 3
        k, n = attrs["K"], attrs["N"]
        b, scale = arrays[node.input[1]], arrays[node.input[2]]
        assert b.dtype == np.uint8 and b.shape == (n, -(-k // 64), 64)
        w_NK = (b.reshape(n, -1)[:, :k].astype(np.float32) - 128) * np.repeat(scale, 64, axis=1)[:, :k]
        np.testing.assert_array_equal(w_NK.T, want[weight_of[node.name]])


def test_per_channel_int8_stays_qdq_under_matmul_nbits(artifacts, tmp_path):
    out = export(artifacts("int8"), tmp_path / "model.onnx", matmul_nbits=True)
    assert out.matmul_nbits == 0
    assert out.notes and all("per-channel int8 has no block along K" in note for note in out.notes)


def test_matmul_nbits_layout_and_attributes(artifacts, tmp_path):
    import onnx

    out = export(artifacts("int4"), tmp_path / "model.onnx", matmul_nbits=True)
    model = load(out.path)
    assert out.matmul_nbits == 11
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 11 and all(n.domain == "com.microsoft" for n in nbits)
    assert not [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    assert {o.domain: o.version for o in model.opset_import}["com.microsoft"] == 1
    arrays = initializers(model)
    for node in nbits:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["bits"] == 4 and attrs["block_size"] == 32
        k, n = attrs["K"], attrs["N"]
        blocks = -(-k // 32)
        assert arrays[node.input[1]].shape == (n, blocks, 16) and arrays[node.input[1]].dtype == np.uint8
        assert arrays[node.input[2]].shape == (n, blocks)
    assert json.loads({p.key: p.value for p in model.metadata_props}["aviatorc.weight_formats"]) == {"int4-g32": 11}


def test_matmul_nbits_dequantizes_to_the_artifacts_weights(artifacts, tmp_path):
    """The MatMulNBits arrays read back with the operator's documented formula give the IR's weights."""
    out = export(artifacts("sparse"), tmp_path / "model.onnx", matmul_nbits=True)
    model = load(out.path)
    arrays = initializers(model)
    want = ir_weights(artifacts("sparse"))
    graph = aviatorc.load(artifacts("sparse")).graph()
    weight_of = {n.name: n.inputs[1].name for n in graph.nodes if n.op == "MatMul" and n.inputs[1] is not None}
    import onnx

    for node in (n for n in model.graph.node if n.op_type == "MatMulNBits"):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        k, n, block = attrs["K"], attrs["N"], attrs["block_size"]
        b, scale, zero = (arrays[name] for name in node.input[1:4])
        low, high = b & 0x0F, b >> 4
        codes = np.stack([low, high], axis=-1).reshape(n, -1)[:, :k].astype(np.float32)  # [N, K]
        zero_nibbles = np.stack([zero & 0x0F, zero >> 4], axis=-1).reshape(n, -1)[:, : scale.shape[1]]
        w_nk = (codes - np.repeat(zero_nibbles, block, axis=1)[:, :k]) * np.repeat(scale, block, axis=1)[:, :k]
        np.testing.assert_array_equal(w_nk.T, want[weight_of[node.name]])


def test_fp16_offsets_are_float_matmul_nbits_zero_points(artifacts, tmp_path):
    """code * scale + offset = (code - zero) * scale with a float zero point: read back with the
    operator's documented formula, each weight is the artifact's up to float rounding (ORT parity:
    test_onnx_parity)."""
    want = ir_weights(artifacts("int4-default"))
    qdq = export(artifacts("int4-default"), tmp_path / "qdq" / "model.onnx")
    out = export(artifacts("int4-default"), tmp_path / "nbits" / "model.onnx", matmul_nbits=True)
    assert qdq.formats == out.formats == {"int4-g32-asym-fp16zero": 10, "int8-g32": 1}
    assert out.matmul_nbits == 11 and not out.notes
    import onnx

    model = load(out.path)
    arrays = initializers(model)
    graph = aviatorc.load(artifacts("int4-default")).graph()
    weight_of = {n.name: n.inputs[1].name for n in graph.nodes if n.op == "MatMul" and n.inputs[1] is not None}
    offsets = 0
    for node in (n for n in model.graph.node if n.op_type == "MatMulNBits"):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        k, n, block = attrs["K"], attrs["N"], attrs["block_size"]
        b, scale = arrays[node.input[1]], arrays[node.input[2]]
        if len(node.input) < 4 or arrays[node.input[3]].dtype != np.float32:
            continue  # the int8 head
        offsets += 1
        zero = arrays[node.input[3]].reshape(n, -1)
        codes = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(n, -1)[:, :k].astype(np.float32)  # [N, K]
        w_nk = (codes - np.repeat(zero, block, axis=1)[:, :k]) * np.repeat(scale, block, axis=1)[:, :k]
        target = want[weight_of[node.name]]
        np.testing.assert_allclose(w_nk.T, target, rtol=0, atol=1e-6 * float(np.abs(target).max()))
    assert offsets == 10


def test_sparse_weights_are_dense_equivalent_and_say_so(artifacts, tmp_path):
    out = export(artifacts("sparse"), tmp_path / "model.onnx")
    model = load(out.path)
    props = {p.key: p.value for p in model.metadata_props}
    assert "dense-equivalent" in props["aviatorc.sparsity"]
    assert any("dense-equivalent" in note for note in out.notes)
    arrays = initializers(model)
    want = ir_weights(artifacts("sparse"))
    for node in (n for n in model.graph.node if n.op_type == "DequantizeLinear"):
        x, scale, zero = (arrays[name].astype(np.float32) for name in node.input)
        block = 64  # groups of 32 kept values span 64 dense rows
        got = (x - np.repeat(zero, block, axis=0)[: x.shape[0]]) * np.repeat(scale, block, axis=0)[: x.shape[0]]
        np.testing.assert_array_equal(got, want[node.output[0]])
        assert (got.reshape(-1, 4, got.shape[1]) != 0).sum(axis=1).max() <= 2  # still 2:4


def test_external_data_gives_the_same_model(artifacts, tmp_path):
    import onnxruntime as ort

    inline = export(artifacts("mxint4"), tmp_path / "inline" / "model.onnx")
    external = export(artifacts("mxint4"), tmp_path / "external" / "model.onnx", external_data_bytes=0)
    assert inline.data_path is None and external.data_path == tmp_path / "external" / "model.onnx.data"
    import onnx

    header = onnx.load(str(external.path), load_external_data=False)
    moved = [t for t in header.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert moved and {e.value for t in moved for e in t.external_data if e.key == "location"} == {"model.onnx.data"}
    assert external.path.stat().st_size + external.data_path.stat().st_size > inline.path.stat().st_size * 0.9
    feeds = {k: v.numpy() for k, v in zoo.example_inputs("llama").items()}
    a, b = (ort.InferenceSession(str(r.path), providers=["CPUExecutionProvider"]).run(None, feeds)
            for r in (inline, external))
    np.testing.assert_array_equal(a[0], b[0])


def test_export_is_deterministic_and_leaves_no_staging_files(artifacts, tmp_path):
    first = aviatorc.export(str(artifacts("int4")), tmp_path / "a" / "model.onnx").path.read_bytes()  # the top-level API
    second = export(artifacts("int4"), tmp_path / "b" / "model.onnx").path.read_bytes()
    assert first == second
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["model.onnx"]  # an encoder-style graph: no genai


def test_a_shape_only_artifact_has_no_weights_to_export(tmp_path):
    config = tmp_path / "config.json"
    zoo.config("llama").to_json_file(str(config))
    art = tmp_path / "shape.avc"
    aviatorc.compile(str(config), target="mock", context=64, prompt=8, time_limit_s=1.0).save(art, html_report=False)
    with pytest.raises(OptionError, match="compiled shape-only: it holds no weights to export") as error:
        export(art, tmp_path / "out" / "model.onnx")
    assert error.value.file == str(art)
    assert not (tmp_path / "out" / "model.onnx").exists()
    assert main(["export", str(art), "--format", "onnx", "-o", str(tmp_path / "cli.onnx")]) == 1


def test_an_op_without_a_mapping_is_refused_by_name(artifacts, tmp_path, monkeypatch):
    monkeypatch.delitem(CONVERTERS, "Softmax")
    monkeypatch.delitem(CONVERTERS, "Sigmoid")
    with pytest.raises(ExportError, match=r"no ONNX mapping for IR op\(s\) Sigmoid \(first: '.*'\), Softmax") as error:
        export(artifacts("int4"), tmp_path / "model.onnx")
    assert error.value.ops == ("Sigmoid", "Softmax")
    assert not (tmp_path / "model.onnx").exists()


def test_an_output_that_is_a_folder_is_refused(artifacts, tmp_path):
    with pytest.raises(OptionError, match="exists and is a directory"):
        export(artifacts("int4"), tmp_path)


def test_cli_export(artifacts, tmp_path, capsys):
    out = tmp_path / "cli" / "model.onnx"
    assert main(["export", str(artifacts("int4")), "--format", "onnx", "-o", str(out), "--matmul-nbits"]) == 0
    text = capsys.readouterr().out
    assert f"wrote {out} (opset 21; weights: int4-g32 x11; 11 MatMulNBits)" in text
    assert out.exists()


def test_every_ir_op_has_an_onnx_mapping():
    from aviatorc.ir import OPS

    assert sorted(set(OPS) - set(CONVERTERS)) == []
