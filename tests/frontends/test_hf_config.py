"""Hugging Face config.json import: built on the meta device, shape-only, counts and shapes
checked against the config."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers  # noqa: F401

import aviatorc  # noqa: E402
from aviatorc.errors import EvaluationError, ModelFormatError, OptionError  # noqa: E402
from aviatorc.frontends.torch import import_hf_config  # noqa: E402
from aviatorc.frontends.torch.hf import build_meta_model  # noqa: E402
from aviatorc.ir import evaluate  # noqa: E402
from aviatorc.models import param_count  # noqa: E402

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 128,
    "max_position_embeddings": 256, "tie_word_embeddings": False,
}
BERT = {
    "architectures": ["BertModel"], "model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 100, "max_position_embeddings": 64,
}


def write(tmp_path, config):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def llama_graph(tmp_path_factory):
    return import_hf_config(write(tmp_path_factory.mktemp("llama"), LLAMA))


def weights(graph):
    """The parameters (not the rotary inv_freq buffer, which is an initializer too)."""
    return {v.name: v for v in graph.initializers.values()
            if v.name.startswith(("model.", "lm_head.")) and "rotary_emb" not in v.name}


def test_llama_is_shape_only_with_symbolic_batch_and_seq(llama_graph):
    graph = llama_graph
    assert [(v.name, str(v.type)) for v in graph.inputs] == [("input_ids", "int64[batch, seq]")]
    assert [(v.name, str(v.type)) for v in graph.outputs] == [("logits", "float32[batch, seq, 128]")]
    assert not any(v.data.available for v in weights(graph).values())  # no bytes behind any weight
    assert graph.metadata["shape_only"] == "true"


def test_llama_weights_match_the_config(llama_graph):
    w = weights(llama_graph)
    hidden, heads, kv, inter, layers = 64, 4, 2, 96, 2
    head_dim = hidden // heads
    shapes = {name: v.type.shape for name, v in w.items()}
    # Linear weights are [in, out] under their parameter names.
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (hidden, heads * head_dim)
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (hidden, kv * head_dim)
    assert shapes["model.layers.1.self_attn.v_proj.weight"] == (hidden, kv * head_dim)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (heads * head_dim, hidden)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (hidden, inter)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (inter, hidden)
    assert shapes["model.embed_tokens.weight"] == (128, hidden)
    assert shapes["lm_head.weight"] == (hidden, 128)
    assert len(w) == layers * 9 + 3  # 7 projections + 2 norms per layer; embed, final norm, head
    assert sum(v.type.numel() for v in w.values()) == param_count(LLAMA)


def test_llama_node_counts(llama_graph):
    census = llama_graph.op_census()
    assert census["MatMul"] == 2 * 7 + 1
    assert census["Attention"] == 2
    matmul_weights = [n.inputs[1].name for n in llama_graph.nodes if n.op == "MatMul"]
    assert matmul_weights[:3] == [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]


def test_evaluating_a_shape_only_graph_fails_cleanly(llama_graph):
    with pytest.raises(EvaluationError, match="shape-only"):
        evaluate(llama_graph, {"input_ids": np.zeros((1, 4), np.int64)})


def test_static_batch_and_seq(tmp_path):
    graph = import_hf_config(write(tmp_path, LLAMA), batch=1, seq_len=16)
    assert graph.inputs[0].type.shape == (1, 16)
    assert graph.outputs[0].type.shape == (1, 16, 128)


def test_bert_encoder(tmp_path):
    graph = import_hf_config(write(tmp_path, BERT))
    census = graph.op_census()
    assert census["Attention"] == 2
    assert census["LayerNormalization"] == 2 * 2 + 1  # two per layer, one after the embeddings
    assert census["MatMul"] >= 2 * 6
    w = {v.name: v.type.shape for v in graph.initializers.values()}
    assert w["embeddings.word_embeddings.weight"] == (100, 32)
    assert w["encoder.layer.0.attention.self.query.weight"] == (32, 32)
    assert w["encoder.layer.1.intermediate.dense.weight"] == (32, 64)
    assert graph.outputs[0].name == "last_hidden_state"
    assert graph.outputs[0].type.shape == ("batch", "seq", 32)


def test_with_weights_matches_torch(tmp_path):
    """shape_only=False builds seeded random weights: the graph then runs and matches torch."""
    graph = import_hf_config(write(tmp_path, LLAMA), shape_only=False)
    model = build_meta_model(LLAMA, on_meta=False, seed=0)
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits.numpy()
    got = evaluate(graph, {"input_ids": ids.numpy()})["logits"]
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


def test_dispatch_through_import_model(tmp_path):
    path = write(tmp_path, LLAMA)
    graph = aviatorc.import_model(tmp_path)  # a folder holding config.json
    assert graph.outputs[0].name == "logits"
    assert aviatorc.import_model(path, batch=1, seq_len=4).inputs[0].type.shape == (1, 4)


def test_bad_configs(tmp_path):
    with pytest.raises(ModelFormatError, match="model_type"):
        import_hf_config(write(tmp_path, {"hidden_size": 4}))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelFormatError, match="not valid JSON"):
        import_hf_config(tmp_path / "config.json")
    with pytest.raises(OptionError, match="seq_len"):
        import_hf_config(write(tmp_path, LLAMA), seq_len=0)


def test_encoder_without_architectures_imports_the_bare_encoder(tmp_path):
    config = {k: v for k, v in BERT.items() if k != "architectures"}
    graph = import_hf_config(write(tmp_path, config))
    assert graph.metadata["architecture"] == "BertModel"


@pytest.mark.parametrize("arch", ["gpt2", "phi3", "opt"])
def test_zoo_configs_import_shape_only(tmp_path, arch):
    from aviatorc import zoo

    config = zoo.config(arch).to_dict()
    graph = import_hf_config(write(tmp_path, config))
    assert graph.inputs[0].type.shape == ("batch", "seq")
    assert graph.outputs[0].type.shape == ("batch", "seq", zoo.VOCAB_SIZE)
    assert graph.op_census()["Attention"] == zoo.LAYERS
    assert not any(v.data.available for v in weights(graph).values())  # no bytes behind any weight


def test_per_layer_configs_have_no_single_default_to_warn_about():
    """Heterogeneous configs (dots3's) raise on a per-layer attribute read globally, as
    transformers' AmbiguousGlobalPerLayerAttributeError does (found by tools/arch_census.py as an
    internal error): the defaulted-size warning skips such fields, and still reports the others."""
    from transformers import LlamaConfig

    from aviatorc.frontends.hf_config import defaulted_sizes

    class PerLayerHeads(LlamaConfig):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.built = True

        def __getattribute__(self, key):
            if key == "num_attention_heads" and super().__getattribute__("__dict__").get("built"):
                raise RuntimeError("'num_attention_heads' is a per-layer attribute and may vary across layers")
            return super().__getattribute__(key)

    sizes = defaulted_sizes({"model_type": "llama"}, PerLayerHeads)
    assert "num_attention_heads" not in sizes
    assert sizes["hidden_size"] == LlamaConfig().hidden_size
