"""A bounded KV cache (`--kv-recent N --kv-sinks S`, StreamingLLM's attention sinks plus a recent
window, evicted N positions at a time): the plan sizes and times the cache at the most it holds,
and the runtime evicts the rest.

- Reference: eager `transformers` with a `DynamicCache` evicted by hand by the same rule (once k x N
  tokens are seen, keep the first S and the positions from (k - 1) x N on; position ids count every
  token seen; a prompt cut where positions are multiples of N): the session's logits equal it
  within 1e-4 at every step, and the greedy tokens are the same. Without eviction the tokens
  differ, so the test sees the policy.
- A sequence holds between S + N and S + 2N - 1 positions however long it runs, and the engine's
  chunked prefill (other cuts) gives the tokens `generate` gives.
- The plan: a windowed cache at context C is sized and timed as an unbounded one at context S + 2N.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import DynamicCache

import aviatorc
from aviatorc import zoo
from aviatorc.errors import ModelFormatError, OptionError
from aviatorc.runtime import Session

ATOL = 1e-4
CONTEXT = 48
SINKS, RECENT = 2, 5
PROMPT = [5, 9, 17, 33, 8, 70, 3, 12, 44, 21, 7, 2, 90]  # 13 tokens: more than the window, fed in chunks
STEPS = 14


@pytest.fixture(scope="module")
def model():
    return zoo.build_model("llama").inner.eval()


@pytest.fixture(scope="module")
def windowed(model) -> Session:
    return Session(aviatorc.compile(model, target="mock", context=CONTEXT, prompt=8, batch=2, kv_recent=RECENT,
                                    kv_sinks=SINKS, time_limit_s=1.0))


def _evict(cache: DynamicCache, seen: int) -> None:
    keep = seen - (seen // RECENT - 1) * RECENT  # the positions from the previous multiple of N on
    for layer in cache.layers:
        if layer.keys.shape[2] > SINKS + keep:
            layer.keys = torch.cat([layer.keys[:, :, :SINKS], layer.keys[:, :, -keep:]], dim=2)
            layer.values = torch.cat([layer.values[:, :, :SINKS], layer.values[:, :, -keep:]], dim=2)


def eager_streaming(model, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and the logits before each, from transformers with the cache evicted by hand."""
    cache = DynamicCache(config=model.config)
    seen, logits, tokens = 0, [], []
    chunks = [prompt[i:i + RECENT] for i in range(0, len(prompt), RECENT)]
    with torch.no_grad():
        for step in range(len(chunks) + steps - 1):
            ids = chunks[step] if step < len(chunks) else [tokens[-1]]
            held = cache.get_seq_length()
            out = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True,
                        position_ids=torch.arange(seen, seen + len(ids))[None, :],
                        attention_mask=torch.ones(1, held + len(ids), dtype=torch.long))
            seen += len(ids)
            _evict(cache, seen)
            if step >= len(chunks) - 1:
                logits.append(out.logits[0, -1].numpy())
                tokens.append(int(np.argmax(logits[-1])))
    return tokens, logits


def test_generation_evicts_as_the_reference_does(model, windowed):
    want_tokens, want_logits = eager_streaming(model, PROMPT, STEPS)
    slot = 0
    got = [windowed.prefill(slot, PROMPT)]
    tokens = [int(np.argmax(got[-1]))]
    held = []
    for _ in range(STEPS - 1):
        got.append(windowed.decode([slot], [tokens[-1]])[0])
        tokens.append(int(np.argmax(got[-1])))
        held.append(windowed.slot_length(slot))
    windowed.free(slot)
    assert tokens == want_tokens
    np.testing.assert_allclose(np.stack(got), np.stack(want_logits), atol=ATOL, rtol=0)
    assert (min(held), max(held)) == (SINKS + RECENT, SINKS + 2 * RECENT - 1)  # bounded, however long it runs
    # generate() takes the same path; and the policy matters: the unbounded cache gives other tokens.
    assert windowed.generate(PROMPT, STEPS, eos_token_id=()).tolist()[len(PROMPT):] == want_tokens
    full = Session(aviatorc.compile(model, target="mock", context=CONTEXT, prompt=8, time_limit_s=1.0))
    assert full.generate(PROMPT, STEPS, eos_token_id=()).tolist()[len(PROMPT):] != want_tokens


def test_batched_decode_of_evicted_slots_matches_each_alone(windowed):
    prompts = (PROMPT, PROMPT[:4])
    alone = [windowed.generate(p, 9, eos_token_id=()).tolist()[len(p):] for p in prompts]
    tokens = [[int(np.argmax(windowed.prefill(slot, p)))] for slot, p in enumerate(prompts)]
    for _ in range(8):
        logits = windowed.decode([0, 1], [t[-1] for t in tokens])
        for row, t in zip(logits, tokens, strict=True):
            t.append(int(np.argmax(row)))
    assert tokens == alone
    with pytest.raises(OptionError, match="evicted"):  # rollback and prefix sharing need every position
        windowed.truncate(0, 3)
    with pytest.raises(OptionError, match="evicted"):
        windowed.prefix(0, 0, 2)
    for slot in (0, 1):
        windowed.free(slot)


def test_the_plan_sizes_and_times_the_window(model):
    """A window of S + N at context 48 is planned as an unbounded cache at context S + 2N; at context
    48 unbounded, the cache is larger and its terms of the bound too."""
    def plan(context: int, **window):
        return aviatorc.compile(model, target="corsair", context=context, prompt=4, time_limit_s=1.0, sweep=False,
                                ranges=False, **window).plan

    bounded, small, large = plan(CONTEXT, kv_recent=RECENT, kv_sinks=SINKS), plan(SINKS + 2 * RECENT), plan(CONTEXT)
    assert bounded.memory.kv_bytes == small.memory.kv_bytes < large.memory.kv_bytes
    assert bounded.prediction.time_per_token_s == pytest.approx(small.prediction.time_per_token_s, rel=1e-9)
    terms = [p.prediction.bound.token_terms for p in (bounded, small, large)]
    for term in ("sram", "compute"):  # the cache's bytes and the attention over it (this model is latency-bound)
        assert terms[0][term] == pytest.approx(terms[1][term], rel=1e-9) and terms[2][term] > terms[1][term]
    assert (bounded.memory.kv_sinks, bounded.memory.kv_recent) == (SINKS, RECENT)


def test_a_window_is_checked_where_it_enters(windowed):
    """Options and the plan loader refuse bad windows; plan.json's schema is the current one, and a
    version-2 plan (from before the window's fields) still loads as keeping every position."""
    from aviatorc.plan.plan import FIELDS_SINCE, PLAN_SCHEMA_VERSION, PREDICTION_FIELDS_SINCE, Plan

    with pytest.raises(OptionError, match="kv-recent"):
        aviatorc.compile(zoo.build_model("llama").inner.eval(), target="mock", kv_recent=0)
    plan = json.loads((windowed.artifact.path / "plan.json").read_text())
    assert plan["schema_version"] == PLAN_SCHEMA_VERSION and Plan.from_dict(plan).memory.kv_window.recent == RECENT
    # The plan's KV pool: each of 2 sequences holds SINKS + 2 x RECENT = 12 positions (one block of
    # 16) and a block more to step past before it evicts; the session's pool is that one.
    assert (plan["memory"]["kv_blocks"], plan["memory"]["kv_block_tokens"]) == (4, 16) == (windowed.kv.num_blocks, 16)
    with pytest.raises(ModelFormatError, match="kv_recent"):
        Plan.from_dict(plan | {"memory": plan["memory"] | {"kv_recent": -3}})
    with pytest.raises(ModelFormatError, match="memory.kv_recent is a schema version 3 field, not version 2's"):
        Plan.from_dict(plan | {"schema_version": 2, "memory": {
            k: v for k, v in plan["memory"].items() if FIELDS_SINCE.get(k, 0) <= 3}})
    older = plan | {"schema_version": 2,
                    "memory": {k: v for k, v in plan["memory"].items() if k not in FIELDS_SINCE},
                    "prediction": {k: v for k, v in plan["prediction"].items() if k not in PREDICTION_FIELDS_SINCE}}
    with pytest.raises(ModelFormatError, match="prediction.routing is a schema version 5 field, not version 4's"):
        Plan.from_dict(older | {"schema_version": 4, "prediction": {
            k: v for k, v in plan["prediction"].items() if PREDICTION_FIELDS_SINCE.get(k, 0) <= 5}})
    assert Plan.from_dict(older).memory.kv_window is None
    for version in (1, PLAN_SCHEMA_VERSION + 1, True, "3"):
        with pytest.raises(ModelFormatError, match="schema version"):
            Plan.from_dict(plan | {"schema_version": version})


def test_the_engine_serves_a_bounded_cache_and_the_server_refuses_what_needs_every_position(windowed):
    """Continuous batching (with chunked prefill) over evicting slots gives each prompt's own
    tokens; prefix caching and speculative decoding, which need every position, are refused at start."""
    import asyncio

    from aviatorc.serve.engine import Engine, GenerationRequest
    from aviatorc.serve.metrics import Registry
    from aviatorc.serve.tenants import EngineOptions, ModelSpec, load_models
    from tests.serve.test_engine import serve

    requests = [GenerationRequest(prompt=p, max_tokens=10) for p in (PROMPT, PROMPT[3:], PROMPT[:2])]
    asyncio.run(serve(Engine(windowed, max_num_batched_tokens=4), requests, stagger_steps=1))
    for request in requests:
        assert request.generated == windowed.generate(request.prompt, 10, eos_token_id=()).tolist()[len(request.prompt):]
    spec = ModelSpec(str(windowed.artifact.path))
    for options in (EngineOptions(prefix_cache_tokens=None), EngineOptions(speculative_method="ngram")):
        with pytest.raises(OptionError, match="bounded KV cache"):
            load_models([spec], options, Registry())
