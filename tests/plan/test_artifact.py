"""The plan artifact: reproducible bytes, readable by other accounts, and refused when tampered
with, from an unknown version, or pointing outside itself."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest

import aviatorc
from aviatorc.formats import WeightFormat
from aviatorc.plan.artifact import MANIFEST, ArtifactError, to_json_bytes
from aviatorc.plan.ir import Compute, Load, tile_name
from aviatorc.plan.plan import Plan
from aviatorc.quant.tiles import dequantize_packed
from aviatorc.target import load_target
from tests.zoo_fixtures import zoo_dir, zoo_onnx  # noqa: F401


@pytest.fixture(scope="module")
def compiled(zoo_onnx, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("art")
    source = str(zoo_onnx("llama"))
    first = aviatorc.compile(source, target="mock", quant="int4", group_size=32, context=64, prompt=8)
    first.save(out / "a.avc")
    aviatorc.compile(source, target="mock", quant="int4", group_size=32, context=64, prompt=8).save(out / "b.avc")
    return first, out


def test_two_compiles_of_the_same_input_are_byte_identical(compiled):
    _, out = compiled
    names = sorted(p.name for p in (out / "a.avc").iterdir())
    assert names == ["graph.ir", "manifest.json", "plan.json", "report.html", "report.json", "target.toml",
                     "trace.json", "weights.safetensors"]
    for name in names:
        assert (out / "a.avc" / name).read_bytes() == (out / "b.avc" / name).read_bytes(), name


def test_files_are_readable_by_other_users(compiled):
    _, out = compiled
    assert stat.S_IMODE((out / "a.avc").stat().st_mode) == 0o755
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in (out / "a.avc").iterdir())


def test_plan_json_has_no_absolute_paths_or_times(compiled):
    _, out = compiled
    text = (out / "a.avc" / "plan.json").read_text()
    assert str(out) not in text and "/tmp" not in text and "time_s\"" not in text.replace("cold_start", "")


@pytest.fixture(scope="module")
def streamed(zoo_onnx, tmp_path_factory):  # noqa: F811
    """An artifact whose plan streams weights and the KV cache, on LPDDR with a channel per chiplet."""
    out = tmp_path_factory.mktemp("streamed")
    target = load_target("mock", overrides={"card.lpddr_attach": "chiplet", "chiplet.sram_bytes": 16384})
    (out / "target.toml").write_text(target.to_toml())
    result = aviatorc.compile(str(zoo_onnx("llama")), target=str(out / "target.toml"), quant="int8", context=64,
                              prompt=8, kv_cache="lpddr")
    result.save(out / "s.avc")
    return out / "s.avc"


def _rewritten(plan_json: bytes) -> bytes:
    return to_json_bytes(Plan.from_dict(json.loads(plan_json)).to_dict(), compact=True)


@pytest.mark.parametrize("which", ["resident", "streamed"])
def test_loading_and_writing_a_plan_again_gives_identical_bytes(compiled, streamed, which):
    """plan.json read back into the typed Plan and written again: byte for byte the same, by
    `Plan.from_dict` alone and through `aviatorc.load`."""
    path = compiled[1] / "a.avc" if which == "resident" else streamed
    data = (path / "plan.json").read_bytes()
    assert _rewritten(data) == data
    art = aviatorc.load(path)
    assert to_json_bytes(art.plan.to_dict(), compact=True) == data
    loads = [ins for _, _, ins in art.programs["decode"].instructions() if isinstance(ins, Load)]
    assert bool(loads) == (which == "streamed")  # the streamed plan exercises loads and channels
    assert art.plan.target_name == "mock" and b"\n" not in data[:-1] and b'": ' not in data  # compact


def test_a_plan_json_written_with_indentation_is_read_and_rewritten_compact(compiled):
    """The bytes do not depend on how the JSON read was laid out: only on the plan."""
    data = (compiled[1] / "a.avc" / "plan.json").read_bytes()
    indented = json.dumps(json.loads(data), indent=2).encode()
    assert indented != data and _rewritten(indented) == data


def test_a_changed_plan_writes_other_bytes(compiled):
    """The round trip above would hold for a writer that ignored its input: one changed field
    (the chiplet a tile computes on) must show in the bytes, and round-trip in turn."""
    data = (compiled[1] / "a.avc" / "plan.json").read_bytes()
    plan = Plan.from_dict(json.loads(data))
    plan.tiles = (dataclasses.replace(plan.tiles[0], compute_chiplet=plan.tiles[0].compute_chiplet + 1),
                  *plan.tiles[1:])
    changed = to_json_bytes(plan.to_dict(), compact=True)
    assert changed != data and _rewritten(changed) == changed


def test_load_gives_each_tile_its_own_packed_arrays(compiled):
    result, out = compiled
    art = aviatorc.load(out / "a.avc")
    assert not art.shape_only and set(art.programs) == {"decode", "prefill"}
    # Every tile's stored arrays dequantize to its columns of the graph's own weight.
    from aviatorc.ir import evaluate  # noqa: F401  (the graph's DequantizeWeight outputs are the reference)

    graph = result.graph
    nodes = {n.name: n for n in graph.nodes}
    checked = 0
    for index, tile in enumerate(art.plan.tiles):
        node = nodes[tile.nodes[0]]
        if node.op != "MatMul" or node.inputs[1].producer is None or node.inputs[1].producer.op != "DequantizeWeight":
            continue
        deq = node.inputs[1].producer
        from aviatorc.ir.ops.quant import dequantize

        fmt = WeightFormat.from_attrs(deq.attrs)
        k, n = (int(d) for d in deq.outputs[0].type.shape)
        whole = dequantize([v.data.load() if v is not None and v.data is not None else None for v in deq.inputs], fmt,
                           k, n)
        tid = tile_name(index)
        arrays = [art.tensor(f"{tid}.{r}") if f"{tid}.{r}" in art.tensor_names() else None
                  for r in ("values", "scale", "zero", "indices")]
        while arrays and arrays[-1] is None:
            arrays.pop()
        n0, n1 = tile.cols
        np.testing.assert_array_equal(dequantize_packed(fmt, arrays, k, n1 - n0), whole[:, n0:n1])
        checked += 1
    assert checked >= 10


def _copy(compiled, tmp_path: Path) -> Path:
    _, out = compiled
    dest = tmp_path / "copy.avc"
    shutil.copytree(out / "a.avc", dest)
    return dest


def test_a_tampered_weights_file_is_refused(compiled, tmp_path):
    art = _copy(compiled, tmp_path)
    data = bytearray((art / "weights.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (art / "weights.safetensors").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="'weights.safetensors' does not match its sha256"):
        aviatorc.load(art)


def test_an_unknown_version_is_refused(compiled, tmp_path):
    art = _copy(compiled, tmp_path)
    manifest = json.loads((art / MANIFEST).read_text())
    manifest["version"] = 99
    (art / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="artifact version 99 is not supported"):
        aviatorc.load(art)


@pytest.mark.parametrize("name", ["../outside.json", "/etc/passwd", "sub/plan.json", ".hidden"])
def test_names_that_point_outside_the_artifact_are_refused(compiled, tmp_path, name):
    art = _copy(compiled, tmp_path)
    manifest = json.loads((art / MANIFEST).read_text())
    manifest["files"][name] = {"sha256": "0" * 64, "bytes": 1}
    (art / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="is not a plain name inside the artifact"):
        aviatorc.load(art)


def test_a_file_replaced_by_a_link_is_refused(compiled, tmp_path):
    art = _copy(compiled, tmp_path)
    outside = tmp_path / "graph.ir"
    outside.write_bytes((art / "graph.ir").read_bytes())
    (art / "graph.ir").unlink()
    (art / "graph.ir").symlink_to(outside)
    with pytest.raises(ArtifactError, match="not a regular file"):
        aviatorc.load(art)


def test_a_plan_naming_a_node_the_graph_lacks_is_refused(compiled, tmp_path):
    art = _copy(compiled, tmp_path)
    plan = Plan.from_dict(json.loads((art / "plan.json").read_bytes()))
    stream = next(iter(plan.programs["decode"].streams.values()))
    step = next(i for i, ins in enumerate(stream) if isinstance(ins, Compute))
    stream[step] = dataclasses.replace(stream[step], node="no_such_node")
    data = to_json_bytes(plan.to_dict(), compact=True)
    (art / "plan.json").write_bytes(data)
    manifest = json.loads((art / MANIFEST).read_text())
    manifest["files"]["plan.json"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (art / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="'no_such_node', which graph.ir does not have"):
        aviatorc.load(art)


def test_a_shape_only_compile_writes_no_weights_and_says_so(tmp_path):
    from aviatorc.models import llama_config

    config = llama_config("llama-3-8b") | {"num_hidden_layers": 2, "vocab_size": 1024}
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = aviatorc.compile(str(tmp_path / "config.json"), target="corsair", quant="int4", group_size=128,
                              context=128, prompt=16)
    result.save(tmp_path / "cfg.avc")
    art = aviatorc.load(tmp_path / "cfg.avc")
    assert art.shape_only and not (tmp_path / "cfg.avc" / "weights.safetensors").exists()
    with pytest.raises(aviatorc.AviatorError, match="compiled shape-only and holds no weights"):
        art.tensor("t0.values")


def _logical_weight(value):
    """The [k, n] matrix (or lookup table) a node reads, walking Casts and Transposes by hand."""
    if value.producer is None:
        return value.data.load().astype(np.float32)
    inner = _logical_weight(value.producer.inputs[0])
    return inner.T if value.producer.op == "Transpose" else inner


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # gpt2: Gemm weights, read through a Transpose
def test_dense_tiles_are_their_slices_of_the_weight(zoo_onnx, tmp_path, arch):  # noqa: F811
    result = aviatorc.compile(str(zoo_onnx(arch)), target="mock", context=32, prompt=8)
    result.save(tmp_path / "d.avc")
    art = aviatorc.load(tmp_path / "d.avc")
    nodes = {n.name: n for n in result.graph.nodes}
    kinds = set()
    for index, tile in enumerate(art.plan.tiles):
        node = nodes[tile.nodes[-1]]
        stored = art.tensor(f"{tile_name(index)}.values").astype(np.float32)
        (k0, k1), (n0, n1) = tile.rows, tile.cols
        if node.op == "Gather":
            expected = _logical_weight(node.inputs[0])[k0:k1]
            kinds.add("rows")
        else:
            expected = _logical_weight(node.inputs[1])[:, n0:n1]
            kinds.add("tied" if tile.role == "lm_head" and len(tile.nodes) > 1 else "cols")
        np.testing.assert_array_equal(stored, expected)
    assert kinds >= {"cols", "rows"}
