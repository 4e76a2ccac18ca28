"""The current families (`zoo.FAMILY_ARCHS`): Mixtral, Qwen3-MoE, DeepSeek-V3, gpt-oss, Llama 4
text and Gemma-2, imported from their `config.json` and from the `transformers` module.

- Parity: the IR interpreter and `Session(device="sim")` give eager transformers' logits within
  1e-4 (the same float32 math summed in another order; measured <= 3e-7), from the config.json
  import (seeded weights: the config's own model, built the same way) and from the module.
- Structure: each MoE block becomes one `MoERouter` and per expert a `MoEDispatch`, its own 2-D
  projection weights and a `MoECombine`; what transformers emits for dispatch (sort, histc,
  grouped_mm_fallback, index_put, topk, polar, view_as_complex) is gone.
- Shape-only: the config.json imports and compiles without weights.
- A routing the importer does not know is refused with the op sequence it uses.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import aviatorc
from aviatorc import zoo
from aviatorc.errors import UnsupportedModelError
from aviatorc.frontends.torch import import_hf_config, import_torch
from aviatorc.frontends.torch.hf import build_meta_model
from aviatorc.ir import evaluate
from aviatorc.runtime import Session

TOL = 1e-4
# The compile's workload: within the zoo's trained positions (a context past them is refused).
WORKLOAD = {"context": zoo.MAX_POSITIONS, "prompt": 8}
# experts per MoE layer and MoE layers, per family (DeepSeek-V3 and Llama 4: layer 0 is dense)
EXPERTS = {"mixtral": (4, 2), "qwen3_moe": (8, 2), "deepseek_v3": (8, 1), "gpt_oss": (4, 2), "llama4_text": (4, 1),
           "gemma2": (0, 0)}


def ids(seed: int = 0, batch: int = 2, seq: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, zoo.VOCAB_SIZE, (batch, seq))


def eager_logits(model: torch.nn.Module, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(tokens), use_cache=False).logits.numpy()


@pytest.fixture(scope="module")
def config_graphs(tmp_path_factory):
    cache: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in cache:
            path = zoo.write_family_config(arch, tmp_path_factory.mktemp(arch))
            graph = import_hf_config(path, shape_only=False)
            cache[arch] = (path, graph, build_meta_model(zoo.family_config(arch), on_meta=False))
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", zoo.FAMILY_ARCHS)
def test_config_json_import_matches_transformers_in_the_interpreter_and_the_sim(arch, config_graphs):
    _, graph, model = config_graphs(arch)
    tokens = ids()
    want = eager_logits(model, tokens)
    (got,) = evaluate(graph, {"input_ids": tokens}).values()
    assert np.abs(got - want).max() <= TOL
    art = aviatorc.compile(graph, target="mock", time_limit_s=1.0, **WORKLOAD)
    (sim,) = Session(art, device="sim").run({"input_ids": tokens}).values()
    assert np.abs(sim - want).max() <= TOL
    # another batch and length through the same symbolic graph
    other = ids(seed=1, batch=1, seq=11)
    (again,) = evaluate(graph, {"input_ids": other}).values()
    assert np.abs(again - eager_logits(model, other)).max() <= TOL


@pytest.mark.parametrize("arch", zoo.FAMILY_ARCHS)
def test_module_import_matches_transformers(arch):
    model = zoo.build_family_model(arch)
    tokens = ids(seed=2)
    graph = import_torch(model, {"input_ids": torch.from_numpy(tokens), "use_cache": False})
    (got,) = evaluate(graph, {graph.inputs[0].name: tokens}).values()
    assert np.abs(got - eager_logits(model, tokens)).max() <= TOL


@pytest.mark.parametrize("arch", zoo.FAMILY_ARCHS)
def test_transformers_dispatch_is_recognized_as_moe_ops(arch, config_graphs):
    _, graph, model = config_graphs(arch)
    census = graph.op_census()
    experts, layers = EXPERTS[arch]
    assert census.get("MoERouter", 0) == layers
    assert census.get("MoEDispatch", 0) == census.get("MoECombine", 0) == experts * layers
    assert all(w.type.rank <= 2 for name, w in graph.initializers.items() if ".experts." in name)
    for layer in range(zoo.LAYERS):
        if f"model.layers.{layer}.{_mlp(arch)}.experts.0.down_proj" not in graph.initializers:
            continue  # a dense layer
        for e in range(experts):
            down = graph.initializers[f"model.layers.{layer}.{_mlp(arch)}.experts.{e}.down_proj"]
            assert down.type.rank == 2  # one [K, N] weight per expert per projection
            reader = down.users[0]
            assert reader.op == "MatMul" and reader.inputs[1] is down
    if experts:
        stacked = dict(model.named_parameters())[f"model.layers.{zoo.LAYERS - 1}.{_mlp(arch)}.experts.down_proj"]
        last = graph.initializers[f"model.layers.{zoo.LAYERS - 1}.{_mlp(arch)}.experts.{experts - 1}.down_proj"]
        stored = stacked.detach().numpy()[experts - 1]
        # [E, N, K] (transposed) or [E, K, N] as stored: either way the expert's [K, N]
        expected = stored if stored.shape == last.type.shape else stored.T
        np.testing.assert_array_equal(last.data.load(), expected)


def _mlp(arch: str) -> str:
    return "feed_forward" if arch == "llama4_text" else "mlp"


@pytest.mark.parametrize("arch", zoo.FAMILY_ARCHS)
def test_shape_only_config_json_compiles(arch, tmp_path):
    path = zoo.write_family_config(arch, tmp_path)
    art = aviatorc.compile(str(path), target="mock", time_limit_s=1.0, **WORKLOAD)
    assert art.graph.metadata.get("shape_only") == "true"
    assert art.report.data["plan"]["prediction"]["time_per_token_s"] > 0
    assert not any(w.data.available for w in art.graph.initializers.values() if w.type.rank == 2 and
                   ".experts." in w.name)


def test_a_routing_it_does_not_know_is_refused_with_its_ops(monkeypatch):
    from transformers.models.mixtral import modeling_mixtral

    def relu_router(self, hidden_states):  # a routing no released model uses
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(hidden_states, self.weight)
        values, indices = torch.topk(torch.relu(logits), self.top_k, dim=-1)
        return logits, values, indices

    monkeypatch.setattr(modeling_mixtral.MixtralTopKRouter, "forward", relu_router)
    model = zoo.build_family_model("mixtral")
    with pytest.raises(UnsupportedModelError, match=r"router uses relu -> topk; supported: softmax or sigmoid") as info:
        import_torch(model, {"input_ids": torch.from_numpy(ids()), "use_cache": False})
    assert "model.layers.0.mlp.experts" in str(info.value) and info.value.node == "relu"


@pytest.mark.parametrize("field, value, supported", [("topk_method", "greedy", "'noaux_tc'"),
                                                     ("scoring_func", "softmax", "'sigmoid'")])
def test_a_config_asking_for_a_routing_transformers_does_not_build_is_refused(field, value, supported, tmp_path):
    """DeepSeek-V2-style routing in a deepseek_v3 config: transformers' model would ignore the field
    and route as V3 does, a different model."""
    import json

    from aviatorc.cli import main

    config = zoo.family_config("deepseek_v3") | {field: value}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=rf"router uses {field} '{value}'; supported: {supported}") as info:
        import_hf_config(path)
    assert info.value.fields["field"] == field and info.value.file == str(path)
    assert main(["compile", str(path), "--target", "mock", "-o", str(tmp_path / "out.avc")]) != 0
    assert not (tmp_path / "out.avc").exists()


@pytest.mark.parametrize("implementation", ["eager", "batched_mm"])
def test_other_experts_implementations_export_through_the_grouped_one(implementation):
    """transformers' eager experts loop over the experts reached (data-dependent: torch.export
    cannot trace it) and batched_mm gathers weights per token: the export uses grouped_mm, the
    same function, and gives the module its own setting back."""
    model = zoo.build_family_model("mixtral")
    model.config._experts_implementation = implementation
    tokens = ids(seed=3)
    graph = import_torch(model, {"input_ids": torch.from_numpy(tokens), "use_cache": False})
    assert graph.op_census()["MoEDispatch"] == 8
    (got,) = evaluate(graph, {graph.inputs[0].name: tokens}).values()
    assert np.abs(got - eager_logits(model, tokens)).max() <= TOL
    assert model.config._experts_implementation == implementation
