"""Prefix caching: prompt blocks computed once, reused by later prompts that start the same way.

- a sequence resumed from cached blocks gives the logits a whole prefill gives (fp32, 1e-5), and
  greedy outputs equal those without the cache, while the shared blocks are counted as hits;
- blocks are reused only after the same prefix, whole blocks only, never the last prompt token;
- the least recently used chain is dropped first, from its end;
- `aviatorc serve --enable-prefix-caching` reports the hits in /metrics.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from aviatorc.runtime import Session
from aviatorc.serve.engine import Engine, GenerationRequest
from aviatorc.serve.prefix import PrefixCache
from tests.serve.servers import start_server
from tests.serve.test_engine import alone, serve
from tests.serve.test_server import metric

SYSTEM = [9, 10, 11, 12, 13, 14, 15, 16, 17, 18]  # a shared "system prompt" of 10 tokens


@pytest.fixture(scope="module")
def session(artifacts) -> Session:
    return Session(artifacts["llama"])


def test_a_resumed_prefix_gives_the_logits_of_a_whole_prefill(session):
    prompt = SYSTEM + [40, 41, 42]
    whole = session.prefill(0, prompt)
    whole_next = session.decode([0], [7])[0]
    cached = session.prefix(0, 0, 8)
    session.free(0)
    resumed = session.resume(1, cached, 8, prompt[8:])
    np.testing.assert_allclose(resumed, whole, atol=1e-5)
    np.testing.assert_allclose(session.decode([1], [7])[0], whole_next, atol=1e-5)  # and the cache after it
    assert session.slot_length(1) == len(prompt) + 1
    session.free(1)


def test_shared_prompts_reuse_whole_blocks_and_keep_the_greedy_outputs(session):
    prompts = [SYSTEM + [30 + i, 31 + i] for i in range(4)] + [[9, 10, 11, 99, 13, 14, 15, 16, 17, 18, 5]]
    cache = PrefixCache(session, block_tokens=4, capacity_tokens=64)
    reqs = [GenerationRequest(prompt=p, max_tokens=6) for p in prompts]
    asyncio.run(serve(Engine(session, prefix_cache=cache), reqs, stagger_steps=1))
    for request in reqs:
        assert request.generated == alone(session, request.prompt, 6)
    # The first prompt computed everything; the next three reuse SYSTEM's two whole blocks (8
    # tokens); the last differs in its first block, so nothing after it can be reused.
    assert cache.hits == 3 * 8
    assert cache.queries == sum(len(p) for p in prompts)


def test_the_last_prompt_token_is_always_computed_and_blocks_need_their_prefix(session):
    cache = PrefixCache(session, block_tokens=4, capacity_tokens=64)
    session.prefill(0, SYSTEM[:8])
    cache.insert(0, SYSTEM[:8])
    session.free(0)
    assert cache.lookup(SYSTEM[:8])[0] == 4  # 8 tokens cached, but the 8th must run: one block
    assert cache.lookup(SYSTEM[:9])[0] == 8
    assert cache.lookup([1, 2, 3, 4] + SYSTEM[4:9])[0] == 0  # block 2 alone, after another prefix: no


def test_the_least_recently_used_chain_goes_first(session):
    cache = PrefixCache(session, block_tokens=4, capacity_tokens=12)  # three blocks
    a, b = SYSTEM[:9], [50, 51, 52, 53, 54, 55, 56, 57, 58]
    for slot, prompt in enumerate((a, b)):
        session.prefill(slot, prompt)
        cache.insert(slot, prompt)
        session.free(slot)
    # b's two blocks came last: a keeps its first block only (a chain loses its end first).
    assert cache.lookup(b)[0] == 8 and cache.lookup(a)[0] == 4


def test_the_server_reports_prefix_cache_hits(artifacts, tmp_path):
    import httpx

    with start_server(str(artifacts["llama"]), "--enable-prefix-caching", log=tmp_path / "log") as server:
        prompt = SYSTEM * 4  # 40 tokens: two full 16-token blocks
        outs = [httpx.post(server.url + "/v1/completions", json={"prompt": prompt + [i + 60], "max_tokens": 4,
                                                                  "temperature": 0, "ignore_eos": True}, timeout=60).json()
                for i in range(2)]
        assert all("choices" in o for o in outs), outs
        assert metric(server, "aviatorc_prefix_cache_hits_total") == 32
        assert metric(server, "aviatorc_prefix_cache_queries_total") == 2 * 41
