"""The continuous-batching engine on a real compiled decoder (in process, no HTTP):

- sequences admitted and decoded together give, token for token, what `Session.generate` gives
  each prompt alone (greedy), with more requests than KV slots;
- fcfs serves in arrival order; under `priority` a more important arrival preempts the least
  important running sequence, which later resumes (its cache swapped out to host memory and back,
  or computed again without room for it) and still ends with its own greedy tokens;
- deadlines, cancellation and a full queue end requests with the right outcome and free the slot;
- with a pool of KV blocks smaller than the plan's slots, short sequences run many at once, the
  ones that outgrow it are preempted (swapped or recomputed) and still end as alone, and a request
  larger than the whole pool is refused with the numbers.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from aviatorc.errors import OptionError
from aviatorc.runtime import Session
from aviatorc.serve.engine import Engine, Finished, GenerationRequest, QueueFull
from tests.serve.servers import CONTEXT


@pytest.fixture(scope="module")
def session(artifacts) -> Session:
    return Session(artifacts["llama"])


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(6, 128, size=int(rng.integers(2, 12))).tolist() for _ in range(count)]


def alone(session: Session, prompt: list[int], new: int) -> list[int]:
    return session.generate(prompt, new, eos_token_id=())[len(prompt):].tolist()  # the engine's requests: no stop ids


async def serve(engine: Engine, requests: list[GenerationRequest], *, stagger_steps: int = 0) -> list[GenerationRequest]:
    """Submit `requests` (one more every `stagger_steps` engine steps), run until all finish; the order they finished in."""
    order: list[GenerationRequest] = []
    task = asyncio.create_task(engine.run())

    async def follow(request: GenerationRequest) -> None:
        await request.result()
        order.append(request)

    followers = []
    try:
        for request in requests:
            followers.append(asyncio.create_task(follow(engine.submit(request))))
            start = engine.steps
            while engine.steps < start + stagger_steps:
                await asyncio.sleep(0.001)
        await asyncio.wait_for(asyncio.gather(*followers), timeout=120)
    finally:
        task.cancel()
    return order


def test_batched_sequences_give_what_each_prompt_gives_alone(session):
    new = 12
    reqs = [GenerationRequest(prompt=p, max_tokens=new) for p in prompts(7)]  # 7 requests, 4 slots
    engine = Engine(session)
    asyncio.run(serve(engine, reqs, stagger_steps=1))  # arrivals while others decode
    for request in reqs:
        assert request.finished == Finished("length")
        assert request.generated == alone(session, request.prompt, new)
    assert not engine.running and not engine.waiting


def test_fcfs_finishes_in_arrival_order_on_one_slot(session):
    reqs = [GenerationRequest(prompt=p, max_tokens=4, priority=-i) for i, p in enumerate(prompts(3, seed=1))]
    order = asyncio.run(serve(Engine(session, max_num_seqs=1, policy="fcfs"), reqs))
    assert order == reqs  # priorities are ignored under fcfs


class Preemptions:
    """An observer of preemptions and swap space (the rest of the hooks do nothing)."""

    def __init__(self) -> None:
        self.swapped: list[bool] = []
        self.held: list[int] = []

    def preempted(self, swapped: bool) -> None:
        self.swapped.append(swapped)

    def swap_space(self, held_bytes: int) -> None:
        self.held.append(held_bytes)

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


@pytest.mark.parametrize("swap_bytes", [4 << 30, 1, 0])
def test_a_more_important_request_preempts_and_the_preempted_one_resumes(session, monkeypatch, swap_bytes):
    """Preempted after some tokens, the background request ends as it would alone: with swap space
    for its cache, restored and only its last token computed; with too little (1 byte) or none,
    prefilled again with its tokens so far. The swap space is empty again at the end."""
    computed: list[int] = []  # tokens each prefill or resume computed
    prefill, resume = session.prefill, session.resume
    monkeypatch.setattr(session, "prefill", lambda slot, ids, **kw: computed.append(len(ids)) or prefill(slot, ids, **kw))
    monkeypatch.setattr(session, "resume", lambda slot, cache, n, ids, **kw: computed.append(len(ids)) or
                        resume(slot, cache, n, ids, **kw))
    low, high = prompts(2, seed=2)
    background = GenerationRequest(prompt=low, max_tokens=20, priority=5)
    interactive = GenerationRequest(prompt=high, max_tokens=3, priority=0)
    observer = Preemptions()
    engine = Engine(session, max_num_seqs=1, policy="priority", observer=observer, swap_bytes=swap_bytes)
    order = asyncio.run(serve(engine, [background, interactive], stagger_steps=4))
    assert order == [interactive, background]
    assert background.preemptions == 1 and interactive.preemptions == 0
    assert background.generated == alone(session, low, 20)
    assert interactive.generated == alone(session, high, 3)
    again = computed[2]  # the background's prompt, the interactive's, then the background's readmission
    if swap_bytes > 1:
        assert observer.swapped == [True] and again == 1  # its cache came back: only the token it had not fed
        assert observer.held[0] > 0 and observer.held[-1] == 0
    else:
        assert observer.swapped == [False] and observer.held == []
        assert again > len(low)  # computed again: its prompt and the tokens it had
    assert engine.swapped_bytes == 0 and background._swapped is None


def test_equal_priorities_are_served_first_come_first_served(session):
    reqs = [GenerationRequest(prompt=p, max_tokens=3, priority=1) for p in prompts(3, seed=3)]
    order = asyncio.run(serve(Engine(session, max_num_seqs=1, policy="priority"), reqs, stagger_steps=1))
    assert order == reqs
    assert all(r.preemptions == 0 for r in reqs)


def test_a_deadline_ends_the_request_and_frees_its_slot(session):
    slow = GenerationRequest(prompt=[5, 6, 7], max_tokens=CONTEXT - 4, timeout_s=0.001)
    quick = GenerationRequest(prompt=[8, 9], max_tokens=2)
    engine = Engine(session, max_num_seqs=1)
    asyncio.run(serve(engine, [slow, quick]))
    assert slow.finished is not None and slow.finished.reason == "timeout"
    assert len(slow.generated) < CONTEXT - 4
    assert quick.finished == Finished("length") and quick.generated == alone(session, [8, 9], 2)


def test_the_server_wide_timeout_caps_a_longer_request_timeout(session):
    engine = Engine(session, request_timeout_s=0.001)
    request = GenerationRequest(prompt=[5, 6], max_tokens=CONTEXT - 4, timeout_s=100.0)
    asyncio.run(serve(engine, [request]))
    assert request.timeout_s == 0.001 and request.finished is not None and request.finished.reason == "timeout"


def test_a_cancelled_request_frees_its_slot_at_the_next_step(session):
    async def scenario() -> tuple[GenerationRequest, Engine]:
        engine = Engine(session, max_num_seqs=1)
        task = asyncio.create_task(engine.run())
        request = engine.submit(GenerationRequest(prompt=[5, 6, 7], max_tokens=CONTEXT - 4))
        async for _ in request.events():
            if len(request.generated) == 2:
                request.cancel()
                engine.wake()
        task.cancel()
        return request, engine

    request, engine = asyncio.run(scenario())
    assert request.finished is not None and request.finished.reason == "cancelled"
    assert 2 <= len(request.generated) <= 3  # at most the step already running when it cancelled
    assert not engine.running


def test_a_full_queue_refuses_at_once(session):
    async def scenario() -> None:
        engine = Engine(session, max_queue=2)  # not running: nothing leaves the queue
        engine.submit(GenerationRequest(prompt=[5], max_tokens=1))
        engine.submit(GenerationRequest(prompt=[6], max_tokens=1))
        with pytest.raises(QueueFull, match="2 requests waiting"):
            engine.submit(GenerationRequest(prompt=[7], max_tokens=1))

    asyncio.run(scenario())


def test_a_stop_token_ends_the_sequence(session):
    prompt = prompts(1, seed=4)[0]
    free_run = alone(session, prompt, 10)
    stop = free_run[4]
    request = GenerationRequest(prompt=prompt, max_tokens=10, stop_ids=frozenset({stop}))
    asyncio.run(serve(Engine(session), [request]))
    assert request.finished == Finished("stop")
    assert request.generated == free_run[:free_run.index(stop) + 1]


def test_a_prompt_the_context_cannot_hold_is_refused(session):
    engine = Engine(session)
    with pytest.raises(Exception, match=f"context is {CONTEXT}"):
        engine.submit(GenerationRequest(prompt=list(range(CONTEXT)), max_tokens=1))


def test_a_request_ending_in_the_turn_it_is_admitted_leaves_its_neighbours_alone(session):
    """B times out while A prefills in the same turn: B ends as a timeout, A as if alone."""
    a = GenerationRequest(prompt=[5, 6, 7], max_tokens=6)
    b = GenerationRequest(prompt=[8, 9], max_tokens=6, timeout_s=1e-6)
    asyncio.run(serve(Engine(session), [a, b]))
    assert b.finished is not None and b.finished.reason == "timeout"
    assert a.finished == Finished("length") and a.generated == alone(session, [5, 6, 7], 6)


def test_under_priority_an_arrival_that_outranks_everything_starts_during_a_decode_step(session):
    """Two slots: one background request runs, a second waits (the last slot is kept); an
    interactive arrival takes the kept slot during a decode step, preempting nobody."""
    async def scenario() -> tuple[list[GenerationRequest], int]:
        engine = Engine(session, max_num_seqs=2, policy="priority")
        task = asyncio.create_task(engine.run())
        first = engine.submit(GenerationRequest(prompt=[5, 6, 7], max_tokens=30, priority=5))
        second = engine.submit(GenerationRequest(prompt=[8, 9], max_tokens=3, priority=5))
        while len(first.generated) < 3:
            await asyncio.sleep(0.001)
        kept_free = len(engine.running) == 1 and second in engine.waiting
        urgent = engine.submit(GenerationRequest(prompt=[10, 11], max_tokens=3, priority=0))
        order: list[GenerationRequest] = []

        async def follow(request: GenerationRequest) -> None:
            await request.result()
            order.append(request)

        await asyncio.wait_for(asyncio.gather(*(follow(r) for r in (first, second, urgent))), timeout=120)
        task.cancel()
        return order, kept_free

    order, kept_free = asyncio.run(scenario())
    first, second, urgent = sorted(order, key=lambda r: r.arrival)
    assert kept_free  # the second background request waited: the last slot was kept
    assert order.index(urgent) < order.index(second)
    assert all(r.preemptions == 0 for r in order)
    assert urgent.generated == alone(session, [10, 11], 3) and first.generated == alone(session, [5, 6, 7], 30)
    assert second.generated == alone(session, [8, 9], 3)


class Recording:
    """The session, with each step the engine asks of it logged: (kind, tokens computed)."""

    def __init__(self, session: Session) -> None:
        self.session, self.log = session, []

    def __getattr__(self, name: str):
        return getattr(self.session, name)

    def prefill(self, slot, ids, adapter=None):
        self.log.append(("prompt", len(ids)))
        return self.session.prefill(slot, ids, adapter=adapter)

    def extend(self, slot, ids):
        self.log.append(("prompt", len(ids)))
        return self.session.extend(slot, ids)

    def decode(self, slots, tokens):
        self.log.append(("decode", len(slots)))
        return self.session.decode(slots, tokens)


@pytest.mark.parametrize("budget", [8, None])
def test_chunked_prefill_keeps_the_running_sequences_decoding_while_a_long_prompt_arrives(session, budget):
    """With --max-num-batched-tokens 8, a 60-token prompt arriving beside a decoding sequence is
    prefilled in chunks of at most 7 (8 less the one decoding token), each followed by a decode
    step of the running sequence; without it, in one step of 60 while the decode waits. Both give
    each request its own greedy tokens."""
    short, long = [5, 9, 17, 33, 8], np.random.default_rng(4).integers(6, 128, size=60).tolist()
    recording = Recording(session)
    engine = Engine(recording, max_num_batched_tokens=budget)
    running = GenerationRequest(prompt=short, max_tokens=24)
    arriving = GenerationRequest(prompt=long, max_tokens=4)
    asyncio.run(serve(engine, [running, arriving], stagger_steps=2))
    assert running.generated == alone(session, short, 24) and arriving.generated == alone(session, long, 4)
    chunks = [n for kind, n in recording.log if kind == "prompt"][1:]  # the first is the short prompt's
    if budget is None:
        assert chunks == [60]
        return
    assert sum(chunks) == 60 and max(chunks) <= budget - 1, chunks
    kinds = [kind for kind, _ in recording.log]
    first = kinds.index("prompt", 1)
    last = len(kinds) - 1 - kinds[::-1].index("prompt")
    between = kinds[first:last + 1]
    assert all(a != b for a, b in zip(between, between[1:])), between  # a decode between every two chunks


def test_a_batched_token_budget_below_1_is_refused(session):
    with pytest.raises(OptionError, match="--max-num-batched-tokens must be >= 1, not 0"):
        Engine(session, max_num_batched_tokens=0)


class Occupancy(Preemptions):
    """Preemptions, and the most sequences running at once and the pool's blocks after each turn."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = 0
        self.blocks: list[tuple[int, int, int]] = []
        self.sram: list[int] = []

    def queued(self, waiting: int, running: int, slots: int) -> None:
        self.peak = max(self.peak, running)

    def kv_blocks(self, used: int, total: int, swapped: int, sram: int = 0) -> None:
        self.blocks.append((used, total, swapped))
        self.sram.append(sram)


def test_the_pool_of_blocks_holds_as_many_sequences_as_their_lengths_allow(artifacts):
    """32 blocks of 16 tokens: the memory of one fixed slot of the plan's 512-token context. Short
    sequences (at most 23 positions: 2 blocks) fit 16 at once there, run 4 (the plan's batch) a step."""
    paged = Session(artifacts["llama"], kv_blocks=32, max_seqs=16)
    paged.kv.sram_blocks = 8  # as a plan keeping the pool's first 8 blocks in SRAM says
    new = 12
    reqs = [GenerationRequest(prompt=p, max_tokens=new) for p in prompts(16, seed=7)]
    observer = Occupancy()
    asyncio.run(serve(Engine(paged, observer=observer), reqs))
    for request in reqs:
        assert request.generated == alone(paged, request.prompt, new)
    assert observer.peak == 16 and observer.swapped == []  # 16 x the one a fixed slot of that memory holds
    assert observer.blocks[-1] == (0, 32, 0)
    # the blocks on chip are handed out first: from an empty pool, the first ones taken are all on chip
    first = next(i for i, (used, _, _) in enumerate(observer.blocks) if used)
    assert observer.sram[first] == min(8, observer.blocks[first][0])
    assert max(observer.sram) == 8 and observer.sram[-1] == 0


@pytest.mark.parametrize("swap_bytes", [4 << 30, 0])
def test_sequences_that_outgrow_the_pool_are_preempted_and_end_as_alone(artifacts, swap_bytes):
    """6 blocks for 4 sequences of up to 3 blocks each: as they grow, the last to arrive is
    preempted (first come, first served), swapped out or computed again later, and every one
    still ends with the tokens it gets alone; the pool and the swap space end empty."""
    paged = Session(artifacts["llama"], kv_blocks=6, max_seqs=4)
    new = 30
    reqs = [GenerationRequest(prompt=p, max_tokens=new) for p in prompts(4, seed=8)]
    observer = Occupancy()
    engine = Engine(paged, observer=observer, swap_bytes=swap_bytes)
    asyncio.run(serve(engine, reqs))
    for request in reqs:
        assert request.finished == Finished("length")
        assert request.generated == alone(paged, request.prompt, new)
    assert observer.swapped and set(observer.swapped) == {swap_bytes > 0}
    assert sum(r.preemptions for r in reqs) == len(observer.swapped)
    assert observer.blocks[-1] == (0, 6, 0) and engine.swapped_bytes == 0


def test_a_request_larger_than_the_pool_is_refused_with_the_numbers(artifacts):
    engine = Engine(Session(artifacts["llama"], kv_blocks=2))
    with pytest.raises(OptionError, match=r"needs 3 KV blocks of 16 tokens \(a 10-token prompt and up to 30 new\) "
                                          r"but the pool has 2"):
        engine.submit(GenerationRequest(prompt=list(range(10)), max_tokens=30))
    engine.submit(GenerationRequest(prompt=list(range(10)), max_tokens=22))  # 32 positions: 2 blocks
