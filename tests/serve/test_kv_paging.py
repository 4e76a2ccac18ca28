"""Everything the KV pool does at once, checked against each request alone (greedy, token for token):

64 concurrent requests, half starting with one of two shared system prompts and half distinct,
whole sequences from 1 to the plan's 512-token context, served with a pool smaller than they need
together (so sequences are preempted and swapped out, and cached prompt blocks are taken back),
prefix caching on and chunked prefill (64 tokens a turn). Each ends with the tokens
`Session.generate` gives its prompt alone; the pool and the swap space end empty but for the
blocks the prefix cache holds, and those go back when it lets them go.
"""

from __future__ import annotations

import asyncio

import numpy as np

from aviatorc.runtime import Session
from aviatorc.serve.engine import Engine, Finished, GenerationRequest
from aviatorc.serve.prefix import PrefixCache
from tests.serve.servers import CONTEXT
from tests.serve.test_engine import Occupancy, alone, serve

REQUESTS = 64


def workload(rng: np.random.Generator) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens): shared and distinct prefixes, whole lengths from 1 to the context."""
    systems = [rng.integers(6, 128, size=40).tolist(), rng.integers(6, 128, size=70).tolist()]
    out = []
    for i in range(REQUESTS):
        length = int(rng.integers(1, 40)) if i % 4 else int(rng.integers(40, CONTEXT - 16))
        own = rng.integers(6, 128, size=length).tolist()
        prompt = (systems[i % 2] + own)[:CONTEXT - 16] if i % 2 == 0 or i % 3 == 0 else own
        out.append((prompt, min(int(rng.integers(1, 40)), CONTEXT - len(prompt))))
    out[0] = ([7], 1)  # a whole sequence of 1 token
    prompt = out[1][0][:CONTEXT - 7]
    out[1] = (prompt + [9] * (CONTEXT - 7 - len(prompt)), 7)  # to the context's last position
    return out


def test_64_requests_with_every_feature_on_give_what_each_gives_alone(artifacts):
    reference = Session(artifacts["llama"])
    load = workload(np.random.default_rng(23))
    want = [alone(reference, prompt, new) for prompt, new in load]

    session = Session(artifacts["llama"], kv_blocks=40, max_seqs=16)  # 640 positions for 64 requests
    cache = PrefixCache(session)
    observer = Occupancy()
    engine = Engine(session, observer=observer, prefix_cache=cache, max_num_batched_tokens=64)
    reqs = [GenerationRequest(prompt=prompt, max_tokens=new) for prompt, new in load]
    asyncio.run(serve(engine, reqs))

    for request, tokens in zip(reqs, want, strict=True):
        assert request.finished.reason in ("length", "stop") and request.finished != Finished("error")
        assert request.generated == tokens
    assert len(reqs[1].prompt) + len(reqs[1].generated) == CONTEXT  # it ran to the context's end
    assert observer.swapped and any(observer.swapped)  # sequences were preempted, their caches swapped out
    assert cache.hits > 0 and observer.peak > session.step_batch
    assert engine.swapped_bytes == 0 and observer.blocks[-1][2] == 0
    assert session.kv.used_blocks == len(cache.blocks)  # only the cache holds blocks now
    cache.evict(len(cache.blocks))
    assert session.kv.free_blocks == session.kv.num_blocks and not session.kv.refs.any()
