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
from aviatorc.partition.tiling import (
    EXPERT_STRIP_BYTES,
    EXPERT_TILE_BYTES,
    EXPERT_TILES_MAX,
    WeightSpec,
    expert_tile_bytes,
    split_aligned,
    tile_weight,
    tile_weights,
)
from aviatorc.partition.weights import role_of, weights_from_config, weights_from_graph

FORMATS = [WeightFormat("fp16"), WeightFormat("int8"), WeightFormat("int4", 128), WeightFormat("int4", 32, False),
           WeightFormat("mxint8", 32), WeightFormat("mxint4", 32), WeightFormat("int8", sparsity="2:4"),
           WeightFormat("mxint4", 32, sparsity="2:4"), WeightFormat("int8", 128), WeightFormat("int8", 32, sparsity="2:4")]


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


def test_an_expert_is_one_tile_up_to_its_cap_and_strips_past_it():
    """Experts are placement units (one tile each), but a large one is cut so that, streamed, its
    strips load from several channels at once."""
    small = WeightSpec("e0", 0, "linear", 2048, 1536, WeightFormat("int4", 32), expert=0)  # 1.7 MB
    large = WeightSpec("e1", 0, "linear", 4096, 28672, WeightFormat("int4", 32), expert=1)  # 62 MB
    tiles = tile_weights([small, large], 128, 128, parts=8, max_tile_bytes=2**30)
    assert [t.weight for t in tiles].count("e0") == 1
    strips = [t for t in tiles if t.weight == "e1"]
    assert len(strips) >= 4 and all(t.storage_bytes <= EXPERT_TILE_BYTES and t.expert == 1 for t in strips)
    assert sum(t.n for t in strips) == 28672


def test_expert_strips_are_small_within_a_tile_budget():
    mixtral = [WeightSpec(f"e{e}", 0, "linear", 4096, 14336, WeightFormat("int4", 32), expert=e) for e in range(8)]
    assert expert_tile_bytes(mixtral, 128) == EXPERT_STRIP_BYTES
    strips = [t for t in tile_weights(mixtral, 128, 128, 8, 2**30, EXPERT_STRIP_BYTES) if t.weight == "e0"]
    size = mixtral[0].storage_bytes  # 31 MB: at least 30 strips of 1 MiB, at most twice that (halvings)
    assert 30 <= len(strips) <= 2 * -(-size // EXPERT_STRIP_BYTES) and sum(t.n for t in strips) == 14336
    assert all(t.storage_bytes <= EXPERT_STRIP_BYTES for t in strips)
    # So many experts that 1 MiB strips would pass the tile budget: strips double until they fit it
    many = [WeightSpec(f"x{e}", 0, "linear", 2048, 2048, WeightFormat("int4", 32), expert=e)
            for e in range(EXPERT_TILES_MAX // 2)]  # 2.2 MB each: 4 strips of 1 MiB
    limit = expert_tile_bytes(many, 128)
    assert limit > EXPERT_STRIP_BYTES
    assert EXPERT_TILES_MAX // 2 <= len(tile_weights(many, 128, 128, 8, 2**30, limit)) <= EXPERT_TILES_MAX
    assert len(tile_weights(many, 128, 128, 8, 2**30, limit // 2)) > EXPERT_TILES_MAX  # the smallest that fits


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
    assert [s.nodes for s in specs] == [(n.name,) for n in g.nodes if n.op in ("Gather", "MatMul")]
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


@pytest.mark.parametrize("tied", [False, True])
def test_weights_from_config_match_the_imported_graph(tmp_path, tied):
    # The partition benchmark reads 70B/120B weights from their configs; the importer must agree.
    # A tied pair's names follow the exporter (torch.export keeps one name for the one tensor,
    # `lm_head.weight`, and the importer stores its transpose as `lm_head.weight.T`), so the pair
    # is compared by shape, role, layer and bytes; every other weight by name too.
    import json

    import aviatorc

    cfg = dict(llama_config("llama-3-8b"), num_hidden_layers=2, hidden_size=256, intermediate_size=512,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=tied)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    graph = aviatorc.import_model(tmp_path / "config.json")
    fp32 = WeightFormat("fp32")
    graph_specs = weights_from_graph(graph)
    config_specs = weights_from_config(cfg, fp32, embedding_format=fp32)

    def key(s):
        name = "" if s.tied_to else s.name
        return (name, s.layer, s.role, s.k, s.n, s.storage_bytes, bool(s.tied_to), len(s.nodes))

    assert sorted(map(key, graph_specs)) == sorted(map(key, config_specs))
    assert sum(s.storage_bytes for s in graph_specs) == sum(s.storage_bytes for s in config_specs)
    if tied:  # one tensor: counted once, read by the head's MatMul and the embedding's Gather
        (head,) = [s for s in graph_specs if s.role == "lm_head"]
        (table,) = [s for s in graph_specs if s.is_embedding]
        assert head.tied_to == table.name and table.tied_to == head.name and table.storage_bytes == 0
        assert set(table.nodes) < set(head.nodes) and len(head.nodes) == 2


def test_roles_match_whole_name_components():
    assert role_of("model.layers.0.self_attn.qkv_proj.weight") == "qkv_proj"  # was v_proj
    assert role_of("model.layers.0.mlp.gate_up_proj.weight") == "gate_up_proj"  # was up_proj
    assert role_of("model.layers.1.mlp.up_proj.packed") == "up_proj"
    assert role_of("lm_head.weight.T") == "lm_head"
    assert role_of("transformer.h.0.attn.c_attn.weight") == "c_attn"
    assert role_of("encoder.layer.0.attention.self.query.weight") == "query"
    assert role_of("my_q_proj_like.weight") == "linear"


def _fused_graph(split_by: str) -> Graph:
    """x @ W[32, 64] + b, then a Split (fuse-qkv's form) or three Slices (Phi-3's) into 32 + 16 + 16."""
    import numpy as np

    g = Graph()
    x = g.add_input("x", TensorType("float32", (1, 4, 32)))
    w = g.add_initializer("model.layers.0.self_attn.qkv_proj.weight", TensorType("float32", (32, 64)), ShapeOnly())
    b = g.add_initializer("model.layers.0.self_attn.qkv_proj.bias", TensorType("float32", (64,)), ShapeOnly())
    y = g.add_node("MatMul", [x, w], [TensorType("float32", (1, 4, 64))], name="qkv").outputs[0]
    y = g.add_node("Add", [y, b], [TensorType("float32", (1, 4, 64))], name="qkv.add").outputs[0]
    widths = [32, 16, 16]
    if split_by == "split":
        sizes = g.add_constant(np.array(widths, dtype=np.int64), "sizes")
        g.add_node("Split", [y, sizes], [TensorType("float32", (1, 4, n)) for n in widths], {"axis": -1}, name="split")
    else:
        for start, stop in ((32, 48), (0, 32), (48, 64)):
            args = [g.add_constant(np.array([v], dtype=np.int64), "c") for v in (start, stop, -1)]
            g.add_node("Slice", [y, *args], [TensorType("float32", (1, 4, stop - start))], name=f"slice{start}")
    return g


@pytest.mark.parametrize("split_by", ["split", "slices"])
def test_fused_weights_keep_their_split_points_and_nodes(split_by):
    (spec,) = weights_from_graph(_fused_graph(split_by))
    assert spec.role == "qkv_proj" and spec.nodes == ("qkv",)
    assert spec.splits == (("q", 0, 32), ("k", 32, 48), ("v", 48, 64))
    tiles = tile_weight(spec, 16, 16, 2)  # strips [0, 32) and [32, 64)
    assert [t.parts for t in tiles] == [(("q", 0, 32),), (("k", 32, 48), ("v", 48, 64))]
    assert all(t.nodes == ("qkv",) for t in tiles)


def test_an_unfused_weight_has_no_splits():
    g = _fused_graph("split")
    split = next(n for n in g.nodes if n.op == "Split")
    split.attrs["axis"] = 1  # not the last axis: not a column split
    (spec,) = weights_from_graph(g)
    assert spec.splits == ()


def test_zoo_models_keep_their_fused_parts_and_tied_heads():
    """GPT-2's c_attn (addmm, view, Split) has q/k/v parts and its head is tied to wte; a Llama
    after fuse-qkv has one qkv_proj per layer (its role, not v_proj) split into 32 + 16 + 16."""
    from aviatorc.passes.manager import PassContext, get_pass, run_passes

    from aviatorc import zoo
    from aviatorc.frontends.torch import import_torch
    from aviatorc.options import CompileOptions

    gpt2 = weights_from_graph(import_torch(zoo.build_model("gpt2"), zoo.example_inputs("gpt2")))
    c_attn = [s for s in gpt2 if s.role == "c_attn"]
    assert c_attn and all(s.splits == (("q", 0, 32), ("k", 32, 64), ("v", 64, 96)) for s in c_attn)
    (head,) = [s for s in gpt2 if s.role == "lm_head"]
    (table,) = [s for s in gpt2 if s.is_embedding]
    assert head.tied_to == table.name and table.is_alias and len(head.nodes) == 2

    graph = import_torch(zoo.build_model("llama"), zoo.example_inputs("llama"))
    run_passes(graph, [get_pass("fuse-qkv")], PassContext(options=CompileOptions()))
    fused = [s for s in weights_from_graph(graph) if "qkv_proj" in s.name]
    assert len(fused) == 2 and all(s.role == "qkv_proj" for s in fused)
    assert all(s.splits == (("q", 0, 32), ("k", 32, 48), ("v", 48, 64)) and len(s.nodes) == 1 for s in fused)
