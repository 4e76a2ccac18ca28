"""Greedy generation of the current families on the sim runtime equals `transformers`' `generate`.

Each family's tiny model (`zoo.build_family_model`) is compiled from the module (the compiler
builds its step graph with the KV cache as inputs and outputs, `frontends.torch.decoder`) and
generates 32 tokens after an 8-token prompt: token for token what `model.generate` gives. The
prompt plus 32 tokens crosses the 6-token windows of gpt-oss's and Gemma-2's sliding layers and
Llama 4's chunks, so those masks are exercised; with multi-head latent attention (DeepSeek-V3)
the cache the runtime carries is the compressed latent and the rotary key, not per-head K and V.
"""

from __future__ import annotations

import numpy as np
import pytest

import aviatorc
from aviatorc import zoo
from aviatorc.runtime import Session
from tests.zoo_fixtures import transformers_greedy

NEW_TOKENS = 32
PROMPT = 8


@pytest.fixture(scope="module")
def compiled():
    cache: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in cache:
            model = zoo.build_family_model(arch)
            art = aviatorc.compile(model, target="mock", context=PROMPT + NEW_TOKENS, prompt=PROMPT, batch=1,
                                   time_limit_s=1.0)
            cache[arch] = (model, Session(art, device="sim"))
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", zoo.FAMILY_ARCHS)
def test_greedy_generation_equals_transformers_token_for_token(arch, compiled):
    model, session = compiled(arch)
    prompt = np.random.default_rng(0).integers(3, zoo.VOCAB_SIZE, PROMPT)
    ours = session.generate(prompt, NEW_TOKENS)
    np.testing.assert_array_equal(ours, transformers_greedy(model, prompt, NEW_TOKENS))
    assert len(set(ours[PROMPT:].tolist())) > 1  # a sequence, not one token repeated


def test_with_latent_attention_the_cache_holds_the_latent(compiled):
    _, session = compiled("deepseek_v3")
    cfg = zoo.family_config("deepseek_v3")
    inputs = {v.name: v.type.shape for v in session.graph.inputs}
    for layer in range(cfg["num_hidden_layers"]):
        # [batch, 1, past, kv_lora_rank] and [batch, 1, past, qk_rope_head_dim]: 20 values per token and
        # layer, where per-head K and V would hold heads x (qk_nope + qk_rope + v) = 4 x 20
        assert inputs[f"past_key_values.{layer}.key"][1::2] == (1, cfg["kv_lora_rank"])
        assert inputs[f"past_key_values.{layer}.value"][1::2] == (1, cfg["qk_rope_head_dim"])
    # the plan sizes the cache from the latent too: layers x (latent + rotary key) x context x batch x 2 bytes
    memory = session.artifact.report["plan"]["memory"]
    width = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    assert memory["kv_bytes"] == cfg["num_hidden_layers"] * width * (PROMPT + NEW_TOKENS) * 1 * 2
