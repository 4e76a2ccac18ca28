"""Models exported by others (fixtures: tests/frontends/exported.py), each compiled, run against
onnxruntime within 1e-4 at fp32 and generating what `transformers` generates:

- Phi-style blocks whose nodes an exporter named by module (a biased Linear's MatMul and Add
  share one name, which ONNX allows): the plan's streams, checker and runtime name nodes, so two
  nodes of one name made a value cross twice (`corsair` INT8/INT4) and the simulator compute the
  wrong node (`mock` fp32). Node names are now unique in the IR (the importer renames repeats,
  the verifier refuses them);
- a decoder-with-past export whose new-token axis is fixed at 1: the prompt is fed a token at a
  time, and the compile summary says prefill is per token;
- config.json families whose pad_token_id lies outside vocab_size (Phi-3, SmolLM3): the padding
  index is dropped with a warning;
- hybrid state-space and linear-attention families (Falcon-H1, Qwen3-Next) are refused, naming
  the layer kind, from config.json and from the module;
- Gemma-style tied embeddings (the head reads the scaled table) at INT8 and INT4 on `corsair`.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import onnx
import pytest

import aviatorc
from aviatorc.errors import UnsupportedModelError, VerificationError
from aviatorc.ir import Graph, TensorType
from aviatorc.ir.verifier import verify
from tests.frontends import exported

PROMPT = [5, 9, 17, 33, 8, 70]
NEW = 6


def ort_step(path, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))


def step_feeds(model, past: int, new: int, seed: int = 0) -> dict[str, np.ndarray]:
    from aviatorc.frontends.torch.decoder import cache_names, example_step

    tensors = example_step(model, new=new, past=past, batch=1, seed=seed)
    names = ["input_ids", "attention_mask", "position_ids", *cache_names(model.config.num_hidden_layers)[0]]
    return {name: t.numpy() for name, t in zip(names, tensors, strict=True)}


@pytest.fixture(scope="module")
def phi():
    return exported.phi()


@pytest.fixture(scope="module")
def phi_step(phi, tmp_path_factory):
    return exported.step_onnx(phi, tmp_path_factory.mktemp("phi") / "phi-step.onnx")


@pytest.fixture(scope="module")
def phi_module_named(phi_step):
    return exported.named_by_module(phi_step, phi_step.with_name("phi-step-by-module.onnx"))


def test_the_fixture_names_nodes_twice_as_module_named_exports_do(phi_module_named):
    names = [n.name for n in onnx.load(str(phi_module_named)).graph.node]
    assert len(names) > len(set(names))
    assert names.count("inner.model.layers.0.self_attn.q_proj") == 2  # the MatMul and the bias Add


def test_phi_blocks_named_by_module_run_and_generate_at_fp32(phi, phi_step, phi_module_named):
    result = aviatorc.compile(str(phi_module_named), target="mock", context=64, prompt=8, batch=1, time_limit_s=1.0)
    session = aviatorc.Session(result)
    feeds = step_feeds(phi, past=4, new=3)
    want = ort_step(phi_step, feeds)  # onnxruntime refuses repeated node names: the same graph as exported
    got = session.run(feeds)
    for name in ("logits", "present.1.value"):
        np.testing.assert_allclose(got[name], want[name], atol=1e-4, rtol=0)
    assert session.generate(PROMPT, NEW, eos_token_id=exported.EOS).tolist() == exported.generate_like_transformers(phi, PROMPT, NEW)


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_phi_blocks_named_by_module_plan_for_corsair(phi, phi_step, phi_module_named, quant):
    """The plan passes its checker (inside compile) and runs: the logits track fp32's."""
    result = aviatorc.compile(str(phi_module_named), target="corsair", quant=quant, context=64, prompt=8, batch=1,
                              time_limit_s=1.0)
    feeds = step_feeds(phi, past=4, new=3)
    got = aviatorc.Session(result).run(feeds)["logits"].ravel()
    want = ort_step(phi_step, feeds)["logits"].ravel()
    cosine = float(got @ want / np.linalg.norm(got) / np.linalg.norm(want))
    assert cosine > (0.999 if quant == "int8" else 0.99), cosine


def test_a_decode_step_with_one_new_token_generates_a_token_at_a_time(phi, tmp_path):
    path = exported.step_onnx(phi, tmp_path / "phi-one.onnx", one_token=True)
    ids = next(i for i in onnx.load(str(path)).graph.input if i.name == "input_ids")
    assert ids.type.tensor_type.shape.dim[1].dim_value == 1  # fixed at 1, as the exporters write it
    result = aviatorc.compile(str(path), target="mock", context=64, prompt=8, batch=2, time_limit_s=1.0)
    assert "prefill is per token" in result.report.summary()
    session = aviatorc.Session(result)
    want = exported.generate_like_transformers(phi, PROMPT, NEW)
    assert session.generate(PROMPT, NEW, eos_token_id=exported.EOS).tolist() == want
    # The step API the server drives: a prompt in one prefill call, then batched decode steps.
    first = [int(np.argmax(session.prefill(slot, PROMPT))) for slot in (0, 1)]
    assert first == [want[len(PROMPT)]] * 2
    logits = session.decode([0, 1], first)
    assert [int(np.argmax(row)) for row in logits] == [want[len(PROMPT) + 1]] * 2
    steps = session.extend(0, want[len(PROMPT) + 1:len(PROMPT) + 3])  # every position's logits
    assert steps.shape == (2, exported.TINY["vocab_size"])
    assert int(np.argmax(steps[0])) == want[len(PROMPT) + 2]


@pytest.mark.parametrize("model_type", ["phi3", "smollm3"])
def test_a_pad_token_outside_the_vocabulary_is_dropped_with_a_warning(model_type, tmp_path, caplog):
    config = {"model_type": model_type, **{k: v for k, v in exported.TINY.items() if "token" not in k}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING, logger="aviatorc"):
        result = aviatorc.compile(str(path), target="corsair", quant="int4", context=64, prompt=8, time_limit_s=1.0)
    assert any("pad_token_id" in r.getMessage() and "outside vocab_size 128" in r.getMessage() for r in caplog.records)
    assert result.plan is not None and result.report.data["model"]["parameters"] > 0


@pytest.mark.parametrize(("model_type", "kind", "module"), [
    ("falcon_h1", "state-space (Mamba) layers", "FalconH1Mixer"),
    ("qwen3_next", "linear-attention (gated DeltaNet) layers", "Qwen3NextGatedDeltaNet"),
])
def test_hybrid_families_are_refused_naming_the_layer_kind(model_type, kind, module, tmp_path):
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    fields = {k: v for k, v in exported.TINY.items() if "token" not in k}
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": model_type, **fields}))
    want = f"'{model_type}' has {kind} ({module} at 'model.layers.0."
    with pytest.raises(UnsupportedModelError) as refused:
        aviatorc.compile(str(path), target="corsair", quant="int4", time_limit_s=1.0)
    assert want in str(refused.value) and str(path) in str(refused.value)
    model = transformers.AutoModelForCausalLM.from_config(CONFIG_MAPPING[model_type](**fields)).eval()
    with pytest.raises(UnsupportedModelError) as refused:
        aviatorc.compile(model, target="mock", time_limit_s=1.0)
    assert want in str(refused.value)


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_a_gemma_style_tied_head_is_quantized_for_corsair(quant, tmp_path):
    model = exported.gemma()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    result = aviatorc.compile(model, target="corsair", quant=quant, context=64, prompt=8, batch=1, time_limit_s=1.0)
    head = [t for t in result.plan.tiles if t.role == "lm_head"]
    # Quantized, not left at fp32; data-free int4 keeps the output head at int8 (with int4's groups).
    assert head and {t.format.kind for t in head} == {"int8"}
    if quant == "int8":
        assert aviatorc.Session(result).generate(PROMPT, NEW, eos_token_id=exported.EOS).tolist() == \
            exported.generate_like_transformers(model, PROMPT, NEW)


def test_the_verifier_refuses_two_nodes_of_one_name():
    graph = Graph()
    x = graph.add_input("x", TensorType("float32", (2,)))
    a = graph.add_node("Neg", [x], [TensorType("float32", (2,))], name="same")
    graph.add_node("Neg", [a.outputs[0]], [TensorType("float32", (2,))], name="same")
    with pytest.raises(VerificationError, match="node name 'same' is used twice"):
        verify(graph)


@pytest.mark.parametrize("config_class", ["CamembertConfig", "XLMRobertaConfig", "Data2VecTextConfig"])
def test_roberta_family_decoders_number_positions_from_the_padding_index(config_class):
    """RoBERTa's family counts learned positions from padding_idx + 1 (found by
    tools/arch_census.py: camembert and data2vec-text generated other tokens than transformers;
    their steps fed positions from 0). Compiled from the module, they generate what the model's
    own forward gives, token by token over the whole sequence. (transformers' `generate` passes
    position ids counted from 0 to these models, so its tokens differ from its own forward's.)"""
    import torch
    import transformers

    config = getattr(transformers, config_class)(is_decoder=True, pad_token_id=0, **exported.TINY)
    model = exported.built(config)
    result = aviatorc.compile(model, target="mock", context=48, prompt=8, time_limit_s=1.0)
    want = list(PROMPT)
    with torch.no_grad():
        for _ in range(NEW):
            want.append(int(model(input_ids=torch.tensor([want]), use_cache=False).logits[0, -1].argmax()))
    assert aviatorc.Session(result).generate(PROMPT, NEW, eos_token_id=()).tolist() == want
