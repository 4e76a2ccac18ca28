"""Prefix caching: prompt blocks computed once, shared by later prompts that start the same way.

- a sequence resumed from a prefix (copied out, or its blocks shared) gives the logits a whole
  prefill gives (fp32, 1e-5), and greedy outputs equal those without the cache, while the shared
  blocks are counted as hits and no block is copied;
- blocks are reused only after the same prefix, whole blocks only, never the last prompt token;
- the least recently used chain is dropped first, from its end; a pool that runs short takes
  back the blocks only the cache holds before anything else;
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
    return Session(artifacts["llama"], block_size=4)  # small blocks: a 10-token system prompt fills two


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


def test_an_attached_prefix_shares_its_blocks_and_gives_the_logits_of_a_whole_prefill(session):
    prompt = SYSTEM + [40, 41, 42]
    whole = session.prefill(0, prompt)
    whole_next = session.decode([0], [7])[0]
    shared = session.blocks_of(0)[:2]  # positions 0..7
    attached = session.attach(1, shared, 8, prompt[8:])
    np.testing.assert_allclose(attached, whole, atol=1e-5)
    np.testing.assert_allclose(session.decode([1], [7])[0], whole_next, atol=1e-5)
    assert session.blocks_of(1)[:2] == shared and session.blocks_of(1)[2:] != session.blocks_of(0)[2:]
    assert list(session.kv.refs[shared]) == [2, 2]
    for slot in (0, 1):
        session.free(slot)
    assert session.kv.free_blocks == session.kv.num_blocks


def test_shared_prompts_reuse_whole_blocks_and_keep_the_greedy_outputs(session):
    prompts = [SYSTEM + [30 + i, 31 + i] for i in range(4)] + [[9, 10, 11, 99, 13, 14, 15, 16, 17, 18, 5]]
    cache = PrefixCache(session, capacity_tokens=64)
    reqs = [GenerationRequest(prompt=p, max_tokens=6) for p in prompts]
    asyncio.run(serve(Engine(session, prefix_cache=cache), reqs, stagger_steps=1))
    for request in reqs:
        assert request.generated == alone(session, request.prompt, 6)
    # The first prompt computed everything; the next three reuse SYSTEM's two whole blocks (8
    # tokens); the last differs in its first block, so nothing after it can be reused.
    assert cache.hits == 3 * 8
    assert cache.queries == sum(len(p) for p in prompts)
    # Every sequence gave its blocks back; the cache still holds its own.
    assert session.kv.used_blocks == len(cache.blocks) and all(session.kv.refs[b] == 1 for b in cache.blocks.values())
    held = len(cache.blocks)
    assert cache.evict(100) == held and session.kv.free_blocks == session.kv.num_blocks


def test_the_last_prompt_token_is_always_computed_and_blocks_need_their_prefix(session):
    cache = PrefixCache(session, capacity_tokens=64)
    session.prefill(0, SYSTEM[:8])
    cache.insert(0, SYSTEM[:8])
    session.free(0)
    assert cache.lookup(SYSTEM[:8])[0] == 4  # 8 tokens cached, but the 8th must run: one block
    assert cache.lookup(SYSTEM[:9])[0] == 8
    assert cache.lookup([1, 2, 3, 4] + SYSTEM[4:9])[0] == 0  # block 2 alone, after another prefix: no
    cache.evict(2)


def test_the_least_recently_used_chain_goes_first(session):
    cache = PrefixCache(session, capacity_tokens=12)  # three blocks
    a, b = SYSTEM[:9], [50, 51, 52, 53, 54, 55, 56, 57, 58]
    for slot, prompt in enumerate((a, b)):
        session.prefill(slot, prompt)
        cache.insert(slot, prompt)
        session.free(slot)
    # b's two blocks came last: a keeps its first block only (a chain loses its end first).
    assert cache.lookup(b)[0] == 8 and cache.lookup(a)[0] == 4
    assert session.kv.used_blocks == 3  # the dropped block went back to the pool
    cache.evict(3)
    assert session.kv.free_blocks == session.kv.num_blocks


def test_a_pool_running_short_takes_back_cached_blocks_before_preempting(artifacts):
    """A pool of 6 blocks of 4 tokens: a first request leaves 2 of its blocks cached; the next,
    unrelated, grows to 5 blocks and gets them back from the cache, never preempted."""
    session = Session(artifacts["llama"], block_size=4, kv_blocks=6)
    cache = PrefixCache(session)
    first = GenerationRequest(prompt=SYSTEM[:9], max_tokens=2)
    asyncio.run(serve(Engine(session, prefix_cache=cache), [first]))
    assert len(cache.blocks) == 2 and session.kv.used_blocks == 2
    firsts = set(cache.blocks)
    second = GenerationRequest(prompt=[70, 71, 72, 73, 74, 75, 76, 77, 78, 79], max_tokens=9)  # 19 positions: 5 blocks
    asyncio.run(serve(Engine(session, prefix_cache=cache), [second]))
    assert second.generated == alone(Session(artifacts["llama"]), second.prompt, 9) and second.preemptions == 0
    assert len(firsts & set(cache.blocks)) < 2  # evicted for it (its own prompt's blocks are cached since)


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
