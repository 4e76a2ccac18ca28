"""Tiling: matrix-unit alignment and exact bytes; weights read from the IR and from configs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aviatorc.formats import WeightFormat
from aviatorc.ir import Graph
from aviatorc.ir.data import ShapeOnly
from aviatorc.ir.types import TensorType
from aviatorc.models import llama_config, param_count
from aviatorc.partition.tiling import WeightSpec, split_aligned, tile_weight, tile_weights
from aviatorc.partition.weights import weights_from_config, weights_from_graph

FORMATS = [WeightFormat("fp16"), WeightFormat("int8"), WeightFormat("int4", 128), WeightFormat("int4", 32, False),
           WeightFormat("mxint8", 32), WeightFormat("mxint4", 32), WeightFormat("int8", sparsity="2:4"),
           WeightFormat("mxint4", 32, sparsity="2:4")]


@given(length=st.integers(1, 5000), unit=st.sampled_from([16, 32, 64]), parts=st.integers(1, 70))
def test_split_aligned_covers_and_aligns(length, unit, parts):
    ranges = split_aligned(length, unit, parts)
    assert ranges[0][0] == 0 and ranges[-1][1] == length
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    assert all(start % unit == 0 for start, _ in ranges)
    assert len(ranges) <= parts
    widths = [b - a for a, b in ranges[:-1]]
    assert not widths or max(widths) - min(widths) <= unit


@settings(max_examples=60)
@given(k=st.integers(1, 3000), n=st.integers(1, 3000), fmt=st.sampled_from(FORMATS), parts=st.integers(1, 40))
def test_column_tiles_add_up_to_the_weight_exactly(k, n, fmt, parts):
    n = ((n + 63) // 64) * 64  # real output widths are unit multiples; a ragged one rounds up per tile
    spec = WeightSpec("w", 0, "linear", k, n, fmt)
    tiles = tile_weight(spec, 64, 64, parts)
    assert sum(t.storage_bytes for t in tiles) == fmt.storage_bytes(k, n)
    assert all(t.k == k for t in tiles)


def test_embedding_splits_rows():
    spec = WeightSpec("emb", -1, "embedding", 1000, 256, WeightFormat("fp16"))
    tiles = tile_weight(spec, 64, 64, 4)
    assert [t.k_start for t in tiles] == [0, 256, 512, 768] and tiles[-1].k_stop == 1000
    assert all(t.n == 256 for t in tiles)
    assert sum(t.storage_bytes for t in tiles) == spec.storage_bytes


def test_tiles_split_further_when_too_big():
    spec = WeightSpec("w", 0, "linear", 4096, 4096, WeightFormat("int8"))
    tiles = tile_weights([spec], 64, 64, 2, max_tile_bytes=3 * 2**20)
    assert max(t.storage_bytes for t in tiles) <= 3 * 2**20
    assert sum(t.storage_bytes for t in tiles) == spec.storage_bytes


@pytest.mark.parametrize("name", ["llama-3-8b", "llama-3-70b", "dense-120b"])
def test_weights_from_config_count_the_parameters(name):
    cfg = llama_config(name)
    specs = weights_from_config(cfg, WeightFormat("fp16"))
    norms = cfg["num_hidden_layers"] * 2 * cfg["hidden_size"] + cfg["hidden_size"]
    assert sum(s.k * s.n for s in specs) == param_count(cfg) - norms
    assert specs[0].is_embedding and specs[0].format.kind == "fp16"
    assert {s.layer for s in specs} == set(range(-1, cfg["num_hidden_layers"] + 1))


def test_weights_from_graph():
    g = Graph()
    ids = g.add_input("input_ids", TensorType("int64", (1, 8)))
    table = g.add_initializer("model.embed_tokens.weight", TensorType("float16", (100, 32)),
                              ShapeOnly())
    h = g.add_node("Gather", [table, ids], [TensorType("float16", (1, 8, 32))], {"axis": 0}).outputs[0]
    wq = g.add_initializer("model.layers.0.self_attn.q_proj.weight", TensorType("float16", (32, 32)),
                           ShapeOnly())
    q = g.add_node("MatMul", [h, wq], [TensorType("float16", (1, 8, 32))]).outputs[0]
    packed = g.add_initializer("model.layers.1.mlp.up_proj.packed", TensorType("uint8", (32, 32)),
                               ShapeOnly())
    fmt = WeightFormat("int4", 32)
    deq = g.add_node("DequantizeWeight", [packed], [TensorType("float32", (32, 64))],
                     {**fmt.to_attrs(), "k": 32, "n": 64}).outputs[0]
    up = g.add_node("MatMul", [q, deq], [TensorType("float32", (1, 8, 64))]).outputs[0]
    head = g.add_initializer("lm_head.weight", TensorType("float16", (64, 100)), ShapeOnly())
    g.add_node("MatMul", [up, head], [TensorType("float32", (1, 8, 100))])
    specs = weights_from_graph(g)
    assert [(s.name, s.layer, s.role, s.k, s.n, s.format.kind) for s in specs] == [
        ("model.embed_tokens.weight", -1, "embedding", 100, 32, "fp16"),
        ("model.layers.0.self_attn.q_proj.weight", 0, "q_proj", 32, 32, "fp16"),
        ("model.layers.1.mlp.up_proj.packed", 1, "up_proj", 32, 64, "int4"),
        ("lm_head.weight", 2, "lm_head", 64, 100, "fp16"),
    ]
    assert specs[2].format == fmt


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_layers_from_structure_match_the_named_import(arch, tmp_path_factory):
    """Dynamo ONNX exports lose parameter names (`val_44`): layers come from the attention blocks
    and must match the torch.export import, which keeps names. Both zoo models have 2 layers."""
    from collections import Counter

    import torch  # noqa: F401

    import aviatorc
    from aviatorc import zoo
    from aviatorc.frontends.torch import import_torch
    from tests.zoo_fixtures import onnx_model_path

    path = onnx_model_path(arch, "dynamo", tmp_dir=tmp_path_factory.mktemp("zoo"))
    onnx_specs = weights_from_graph(aviatorc.import_model(path))
    torch_specs = weights_from_graph(import_torch(zoo.build_model(arch), zoo.example_inputs(arch)))
    assert {s.layer for s in onnx_specs if not s.is_embedding} >= {0, 1}
    assert all(s.layer == -1 for s in onnx_specs if s.is_embedding)
    linear = Counter((s.layer, s.k, s.n) for s in onnx_specs if not s.is_embedding)
    assert linear == Counter((s.layer, s.k, s.n) for s in torch_specs if not s.is_embedding)


def test_weights_from_config_match_the_imported_graph(tmp_path):
    # The partition benchmark reads 70B/120B weights from their configs; the importer must agree.
    import json

    import aviatorc

    cfg = dict(llama_config("llama-3-8b"), num_hidden_layers=2, hidden_size=256, intermediate_size=512,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    graph = aviatorc.import_model(tmp_path / "config.json")
    from_graph = {(s.name, s.layer, s.k, s.n) for s in weights_from_graph(graph)}
    from_config = {(s.name, s.layer, s.k, s.n) for s in weights_from_config(cfg, WeightFormat("fp32"))}
    assert from_graph == from_config
