"""Continuous batching over one `Session`: one scheduler task owns it and steps every sequence.

    engine = Engine(session, max_num_seqs=8, policy="priority")
    task = asyncio.create_task(engine.run())
    request = engine.submit(GenerationRequest(prompt=[1, 2, 3], max_tokens=16))
    async for event in request.events(): ...           # Token(id), then Finished(reason)

Each turn of `run`, on the event loop (so the state needs no locks):
1. drop what ended outside the loop: a request past its deadline, a client that went away;
2. admit waiting requests, by policy: `fcfs` (arrival order) or `priority` (lower `priority`
   first, ties by arrival, as vLLM), each given a free slot (at most `max_num_seqs` run) once the
   session's pool of KV blocks (`aviatorc.runtime.paged`) can give its prompt beside what the
   running sequences are about to need; under `priority` a waiting request may preempt the
   running one of the lowest priority, which goes back to the queue keeping its generated
   tokens: its KV cache is swapped out to host memory while `swap_bytes` has room and restored
   on readmission, else it is prefilled again with them (recompute, as vLLM). Before a decode
   step, a sequence without a block for its next token makes the last one in the policy's order
   step back the same way (cached prefix blocks are given back first); a request that could
   outgrow the whole pool is refused at `submit`;
3. prefill each admitted request (one at a time: prompts differ in length; the next one chosen
   again after each, so an arrival goes first) and sample its first token;
4. decode one token for every running sequence in one batched `Session.decode` step.
With `max_num_batched_tokens` (chunked prefill), a turn's prefills take at most that many tokens
less one per decoding sequence: a long prompt is prefilled a chunk per turn (`Session.extend`
after its first chunk), finishing the oldest one first, so the running sequences get a token
every turn while it arrives instead of waiting for its whole prefill.
Under `priority` one slot is kept free for a request that outranks everything running: one that
arrives during a decode step is prefilled at once, in its own worker thread (prefill and decode
touch different slots), while the step pauses at its next instruction (`Session.precedence`),
so its first token waits neither for the step nor beside it for the CPU.
The session's work runs in a worker thread (`asyncio.to_thread`), so the server keeps answering
while a step computes; a step's results are applied on the loop. With a draft session
(`aviatorc.serve.speculative`), step 4 drafts k tokens per sequence and the target verifies them.

A full queue refuses at `submit` (`QueueFull`); nothing waits without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from aviatorc.backends.contract import Precedence
from aviatorc.errors import AviatorError, OptionError
from aviatorc.runtime.paged import KVPool
from aviatorc.runtime.sampling import MAX_TOP_LOGPROBS, Logprobs, check_sampling, logprobs, sample
from aviatorc.serve.prefix import PrefixCache
from aviatorc.serve.structured import Constraint

POLICIES = ("fcfs", "priority")
log = logging.getLogger("aviatorc.serve")


class QueueFull(AviatorError):
    """The waiting queue holds `max_queue` requests: the server answers 429."""


# -- what a request receives ---------------------------------------------------------------


@dataclass(frozen=True)
class Token:
    id: int
    logprobs: Logprobs | None = None  # when the request asked for them


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" (a stop token), "length" (max_tokens or the context), "timeout", "cancelled", "error",
    # "shutdown" (the server stopped before the request finished)
    message: str = ""


Event = Token | Finished


@dataclass
class GenerationRequest:
    """One sequence to generate. Times are `time.monotonic()` seconds."""

    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_ids: frozenset[int] = frozenset()
    priority: int = 0
    timeout_s: float | None = None
    logprobs: int | None = None  # report each token's log-probability and this many of the most likely
    constraint: Constraint | None = None  # a structured-output grammar (`aviatorc.serve.structured`)
    adapter: str | None = None  # a LoRA adapter of the session to run with (None: the base alone)
    # Filled in by the engine.
    generated: list[int] = field(default_factory=list)
    reported: list[Logprobs] = field(default_factory=list)  # one per generated token, when `logprobs` is set
    drafted: int = 0  # speculative decoding: draft tokens proposed for this request, accepted, and the
    accepted_drafts: int = 0  # steps that verified them; whether it still speculates (off for good once off)
    verifications: int = 0
    speculating: bool = True
    arrival: int = -1
    submitted: float = 0.0
    first_token: float | None = None
    finished: Finished | None = None
    preemptions: int = 0
    _queue: asyncio.Queue[Event] = field(default_factory=asyncio.Queue, repr=False)
    _rng: np.random.Generator | None = field(default=None, repr=False)
    _end: Finished | None = None  # asked for from outside the engine; applied at its next turn
    _slot: int | None = None
    _prefill_left: int = 0  # tokens of prompt + generated not yet in its slot's cache (chunked prefill)
    _swapped: tuple[int, dict[str, np.ndarray]] | None = None  # preempted: (positions, its cache) in host memory

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_p)
        if not self.prompt:
            raise OptionError("the prompt is empty", hint="give at least one token")
        if self.max_tokens < 1:
            raise OptionError(f"max_tokens must be >= 1, not {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise OptionError(f"top logprobs must be between 0 and {MAX_TOP_LOGPROBS}, not {self.logprobs}")

    @property
    def deadline(self) -> float | None:
        return None if self.timeout_s is None else self.submitted + self.timeout_s

    def cancel(self) -> None:
        """The client went away: the engine frees the slot at its next turn (call `Engine.wake`)."""
        self._end = self._end or Finished("cancelled", "the client disconnected")

    def stop(self) -> None:
        """Finish as a stop (the text reached a stop string) at the engine's next turn."""
        self._end = self._end or Finished("stop")

    async def events(self) -> AsyncIterator[Event]:
        """Each generated token as it comes, then one `Finished`."""
        while True:
            event = await self._queue.get()
            yield event
            if isinstance(event, Finished):
                return

    async def result(self) -> Finished:
        """Wait for the end; the tokens are in `generated`."""
        async for event in self.events():
            if isinstance(event, Finished):
                return event
        raise AssertionError("unreachable: events() ends with Finished")


class StepSession(Protocol):
    """What the engine needs of a `Session` (the step API of `aviatorc.runtime`)."""

    @property
    def num_slots(self) -> int: ...
    @property
    def context(self) -> int: ...
    @property
    def precedence(self) -> Precedence: ...
    def prefill(self, slot: int, ids: Any, *, adapter: str | None = None) -> np.ndarray: ...
    def decode(self, slots: Sequence[int], tokens: Sequence[int]) -> np.ndarray: ...
    def free(self, slot: int) -> None: ...
    def resume(self, slot: int, cache: Any, length: int, ids: Any, *, adapter: str | None = None) -> np.ndarray: ...
    def attach(self, slot: int, blocks: Sequence[int], length: int, ids: Any, *,
               adapter: str | None = None) -> np.ndarray: ...
    def blocks_of(self, slot: int) -> list[int]: ...
    def extend(self, slot: int, ids: Any) -> np.ndarray: ...
    def slot_length(self, slot: int) -> int: ...
    def prefix(self, slot: int, start: int, stop: int) -> dict[str, np.ndarray]: ...
    @property
    def kv(self) -> KVPool | None: ...
    def blocks_needed(self, slot: int, new: int) -> int: ...


class Observer(Protocol):
    """Metrics hooks (`aviatorc.serve.metrics.Metrics` implements them)."""

    def queued(self, waiting: int, running: int, slots: int) -> None: ...
    def first_token(self, request: GenerationRequest) -> None: ...
    def tokens(self, count: int) -> None: ...
    def decode_step(self, batch: int, slots: int) -> None: ...
    def finished(self, request: GenerationRequest) -> None: ...
    def speculated(self, proposed: int, accepted: int) -> None: ...
    def prefix_cache(self, queried: int, hit: int) -> None: ...
    def preempted(self, swapped: bool) -> None: ...
    def swap_space(self, held_bytes: int) -> None: ...
    def kv_blocks(self, used: int, total: int, swapped: int, sram: int = 0) -> None: ...


class _NoObserver:
    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


# -- the engine ------------------------------------------------------------------------------


class Engine:
    """Continuous batching over `session`'s KV slots (see the module docstring)."""

    def __init__(self, session: StepSession, *, max_num_seqs: int | None = None, policy: str = "fcfs",
                 max_queue: int = 256, request_timeout_s: float | None = None, observer: Observer | None = None,
                 speculator: Any = None, prefix_cache: PrefixCache | None = None,
                 max_num_batched_tokens: int | None = None, swap_bytes: int = 4 << 30) -> None:
        if policy not in POLICIES:
            raise OptionError(f"unknown scheduling policy '{policy}'", hint=f"choose one of {', '.join(POLICIES)}")
        if max_num_seqs is not None and max_num_seqs < 1:
            raise OptionError(f"--max-num-seqs must be >= 1, not {max_num_seqs}")
        if swap_bytes < 0:
            raise OptionError(f"--swap-space must be >= 0, not {swap_bytes} bytes")
        if max_num_batched_tokens is not None and max_num_batched_tokens < 1:
            raise OptionError(f"--max-num-batched-tokens must be >= 1, not {max_num_batched_tokens}")
        if session.num_slots < 1:  # nothing could ever be admitted: every request would wait for ever
            raise OptionError(f"the plan has {session.num_slots} KV slots: it cannot serve a sequence",
                              hint="compile with --batch 1 or more")
        self.session = session
        self.slots = min(max_num_seqs or session.num_slots, session.num_slots)
        self.policy = policy
        self.max_queue = max_queue
        self.request_timeout_s = request_timeout_s
        self.observer: Observer = observer or _NoObserver()  # type: ignore[assignment]
        self.speculator = speculator
        self.prefix_cache = prefix_cache
        self.max_num_batched_tokens = max_num_batched_tokens
        self.swap_bytes = swap_bytes  # host memory for the caches of preempted sequences
        self.swapped_bytes = 0  # what they hold now
        self.waiting: list[GenerationRequest] = []
        self.running: dict[int, GenerationRequest] = {}  # slot -> request
        self._decoding_blocks = 0  # blocks the decode step in flight will take (`_room_to_decode`)
        self._arrivals = itertools.count()
        self._wake = asyncio.Event()
        self.steps = 0

    # -- the request side ------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> GenerationRequest:
        """Queue `request`; raises `QueueFull`, or `OptionError` for a prompt the context cannot hold."""
        if len(request.prompt) >= self.session.context:
            raise OptionError(f"the prompt has {len(request.prompt)} tokens but the model's context is "
                              f"{self.session.context}: no room to generate", hint="shorten the prompt")
        self._fits_the_pool(request)
        if len(self.waiting) >= self.max_queue:
            raise QueueFull(f"the queue is full ({self.max_queue} requests waiting)", hint="retry later")
        request.arrival = next(self._arrivals)
        request.submitted = time.monotonic()
        if request.timeout_s is None:
            request.timeout_s = self.request_timeout_s
        elif self.request_timeout_s is not None:
            request.timeout_s = min(request.timeout_s, self.request_timeout_s)
        request._rng = np.random.default_rng(request.seed)
        self.waiting.append(request)
        self._observe()
        self._wake.set()
        return request

    def _fits_the_pool(self, request: GenerationRequest) -> None:
        """Refuse a request whose sequence could outgrow the whole pool of KV blocks: alone it would
        still run out of room, and no preemption could give it more."""
        kv = self.session.kv
        if kv is None:
            return
        tokens = min(len(request.prompt) + request.max_tokens, self.session.context)
        if kv.blocks_for(tokens) > kv.num_blocks:
            raise OptionError(f"the request needs {kv.blocks_for(tokens)} KV blocks of {kv.block_size} tokens "
                              f"(a {len(request.prompt)}-token prompt and up to {request.max_tokens} new) but the pool "
                              f"has {kv.num_blocks}", hint="shorten the prompt or max_tokens, or serve with more "
                              "--kv-blocks")

    def wake(self) -> None:
        """Call after `request.cancel()` so an idle engine notices."""
        self._wake.set()

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def end_all(self, end: Finished) -> None:
        """End every waiting and running request with `end` at the next turn (a step in flight
        completes first: its slots are in use until then)."""
        for request in [*self.waiting, *self.running.values()]:
            request._end = request._end or end
        self.wake()

    # -- the loop --------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve forever (cancel the task to stop). A step that fails ends the requests it held
        with an error, never the loop: a request must not wait on a dead engine."""
        while True:
            self._drop_ended()
            if self.idle:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self.step()
            except Exception as error:  # noqa: BLE001 - reported to every request it touched, and logged
                log.exception("engine step failed")
                message = str(error) if isinstance(error, AviatorError) else f"internal error: {type(error).__name__}: {error}"
                for request in list(self.running.values()):
                    self._finish(request, Finished("error", message))
            # A turn need not suspend (every request it touched may end without a step): yield, so
            # the server answers /health and signals whatever the plan and the requests do.
            await asyncio.sleep(0)

    async def step(self) -> None:
        """One turn: admit and prefill (the most important waiting request first, chosen again
        after each prefill, so an arrival jumps the queue), then one decode step for every
        sequence that was running. Under `priority`, a request that outranks every running one
        and arrives during that step is prefilled beside it in the kept slot."""
        fresh: set[int] = set()  # requests prefilled this turn: they have their next token already
        budget = self._prefill_budget()
        for partial in sorted((r for r in self.running.values() if r._prefill_left), key=lambda r: r.arrival):
            if budget is not None and budget < 1:
                break
            fresh.add(id(partial))
            budget = await self._prefill(partial, budget)
        while (budget is None or budget > 0) and (request := self._admit_one()) is not None:
            fresh.add(id(request))
            if request.finished is None:  # one admitted before it may have ended it (a preemption)
                budget = await self._prefill(request, budget)
            self._drop_ended()
        batch = [slot for slot, request in sorted(self.running.items())
                 if id(request) not in fresh and not request._prefill_left]
        batch = self._room_to_decode(batch)
        if batch:
            decoding = asyncio.ensure_future(self._decode(batch))
            while not decoding.done():
                self._wake.clear()
                urgent = self._admit_one(during_step=True)
                if urgent is not None:
                    await self._prefill(urgent, first=True)  # the decode step pauses meanwhile
                    continue
                woken = asyncio.ensure_future(self._wake.wait())
                await asyncio.wait({decoding, woken}, return_when=asyncio.FIRST_COMPLETED)
                woken.cancel()
            try:
                await decoding  # its error, if it failed
            finally:
                self._decoding_blocks = 0
        self.steps += 1
        self._observe()

    async def _decode(self, batch: list[int]) -> None:
        if self.speculator is not None:
            await self.speculator.step(self, batch)
            return
        tokens = [self.running[slot].generated[-1] for slot in batch]
        step = asyncio.to_thread(self.session.decode, batch, tokens)
        constraints = [r.constraint for slot in batch if (r := self.running[slot]).constraint is not None]
        if constraints:  # their next masks while the step computes: off its critical path
            logits, _ = await asyncio.gather(step, asyncio.to_thread(lambda: [c.allowed() for c in constraints]))
        else:
            logits = await step
        self.observer.decode_step(len(batch), self.slots)
        for slot, row in zip(batch, logits):
            self._take(self.running[slot], row)

    def _room_to_decode(self, batch: list[int]) -> list[int]:
        """The sequences of `batch` still running once the pool has a block for each one's next
        token (and its drafts: `speculator.k`): while it has not, the one that comes last in the
        policy's order is preempted (swapped out or recomputed later, as `_preempt_for`)."""
        kv = self.session.kv
        if kv is None or not batch:
            return batch
        ahead = 1 + (self.speculator.k if self.speculator is not None else 0)
        while batch and (short := sum(self.session.blocks_needed(slot, ahead) for slot in batch) - kv.free_blocks) > 0:
            if self.prefix_cache is not None and self.prefix_cache.evict(short):
                continue  # cached prompt blocks go before any sequence
            if len(self.running) == 1 and ahead > 1:
                ahead = 1  # alone, it may still decode one token at a time
                continue
            victim = max(self.running.values(), key=self._order)
            self._preempt(victim)
            batch = [slot for slot in batch if slot in self.running]
        self._decoding_blocks = sum(self.session.blocks_needed(slot, ahead) for slot in batch)
        return batch

    def _pending_blocks(self) -> int:
        """Blocks the running sequences are owed before anyone new is admitted: the rest of each
        prompt being prefilled in chunks, each decoding sequence's next token (so an admission
        does not take the block a running sequence is about to need, and preempt it), and the
        decode step in flight."""
        owed = sum(self.session.blocks_needed(r._slot, r._prefill_left + 1)
                   for r in self.running.values() if r._slot is not None)
        return owed + self._decoding_blocks

    def _blocks_free_for(self, request: GenerationRequest, *, evict: bool = True) -> bool:
        """Whether the pool can give `request` its whole prompt (and its first new token) beside
        what the running sequences are owed, once cached prompt blocks are evicted where that
        helps (`evict`: not while a decode step runs, whose urgent prefill may insert into the cache)."""
        kv = self.session.kv
        if kv is None:
            return True
        short = kv.blocks_for(len(request.prompt) + len(request.generated) + 1) + self._pending_blocks() - kv.free_blocks
        if short > 0 and evict and self.prefix_cache is not None:
            short -= self.prefix_cache.evict(short)
        return short <= 0

    def _prefill_budget(self) -> int | None:
        """Prompt tokens this turn may prefill: the batched-token budget less one token per sequence
        that decodes (at least 1, so a prompt always advances); None without chunked prefill."""
        if self.max_num_batched_tokens is None:
            return None
        decoding = sum(1 for r in self.running.values() if not r._prefill_left)
        return max(1, self.max_num_batched_tokens - decoding)

    async def _prefill(self, request: GenerationRequest, budget: int | None = None, *, first: bool = False) -> int | None:
        """Prefill `request` in its slot, at most `budget` tokens of it (None: all of it), and sample
        its first token once all of it is in; the budget left. `first`: while a decode step is in
        flight, which pauses until this prefill is done (`Precedence`), as the step would end first
        on the target."""
        slot = request._slot
        if slot is None:
            raise RuntimeError(f"request {request.arrival} was admitted without a slot")
        ids = np.array(request.prompt + request.generated, dtype=np.int64)
        done = len(ids) - request._prefill_left  # admission sets it to all of ids: 0 done
        swapped = self._swap_in(request)
        try:
            stop, computed, logits = await asyncio.to_thread(self._prefill_now, request, slot, ids, done, budget, first,
                                                             swapped)
        except Exception as error:  # noqa: BLE001 - this request's own failure ends it alone
            if not isinstance(error, AviatorError):
                log.exception("prefill of request %d failed", request.arrival)
            self._finish(request, Finished("error", str(error) if isinstance(error, AviatorError)
                                           else f"internal error: {type(error).__name__}: {error}"))
            return budget
        request._prefill_left = len(ids) - stop
        if not request._prefill_left:
            self._take(request, logits)
        return None if budget is None else budget - computed

    def _prefill_now(self, request: GenerationRequest, slot: int, ids: np.ndarray, done: int, budget: int | None,
                     first: bool, swapped: tuple[int, dict[str, np.ndarray]] | None = None
                     ) -> tuple[int, int, np.ndarray]:
        """Prefill ids[done:] of `request`'s sequence in `slot`, at most `budget` computed tokens: (tokens in its
        cache after, tokens computed, the logits after the last of them). `swapped`: its cache as it was
        preempted (positions, arrays), restored instead of computed again."""
        sessions = [self.session] + (self.speculator.sessions if self.speculator is not None else [])
        with contextlib.ExitStack() as held:
            if first:
                for session in sessions:
                    held.enter_context(session.precedence.first())
            adapter = request.adapter
            cache = self.prefix_cache if adapter is None else None  # cached blocks hold the base's keys and values
            if done:  # a later chunk
                start = done
                stop = len(ids) if budget is None else min(len(ids), start + budget)
                logits = self.session.extend(slot, ids[start:stop])[-1]
            else:  # the first chunk, after its swapped-out cache or the longest cached prefix
                start, blocks = 0, list[int]()
                arrays: dict[str, np.ndarray] = {}
                if swapped is not None:
                    start, arrays = swapped
                elif cache is not None:
                    start, blocks = cache.lookup(ids.tolist())
                    self.observer.prefix_cache(len(ids), start)
                stop = len(ids) if budget is None else min(len(ids), start + budget)
                rest = ids[start:stop]
                if arrays:
                    logits = self.session.resume(slot, arrays, start, rest, adapter=adapter)
                elif blocks:
                    logits = self.session.attach(slot, blocks, start, rest, adapter=adapter)
                else:
                    logits = self.session.prefill(slot, rest, adapter=adapter)
            if stop == len(ids):
                if cache is not None:
                    cache.insert(slot, ids.tolist())
                if self.speculator is not None and request.temperature == 0 and request.speculating:
                    self.speculator.prefill(slot, ids)  # only a request that may still draft (greedy, not off)
        return stop, stop - start, logits

    def _take(self, request: GenerationRequest, logits: np.ndarray) -> None:
        """Sample the request's next token from its row of logits and hand it over."""
        try:
            token = self._sample(request, logits)
        except OptionError as error:  # its grammar allows no token of this vocabulary: end it alone
            self._finish(request, Finished("error", str(error)))
            return
        self._accept(request, [token], [logits])

    def _sample(self, request: GenerationRequest, logits: np.ndarray) -> int:
        if request.constraint is not None:  # only what the grammar allows
            logits = request.constraint.mask(logits)
        return sample(logits, temperature=request.temperature, top_p=request.top_p, rng=request._rng)

    def _accept(self, request: GenerationRequest, tokens: Sequence[int], rows: Sequence[np.ndarray] | np.ndarray) -> None:
        """Hand `tokens` to the request in order (each chosen from its row of logits), finishing it
        at a stop token, at max_tokens, or when its sequence fills the context."""
        if request.finished is not None:
            return
        for token, row in zip(tokens, rows, strict=True):
            if request.first_token is None:
                request.first_token = time.monotonic()
                self.observer.first_token(request)
            request.generated.append(token)
            reported = None
            if request.logprobs is not None:
                reported = logprobs(row, token, request.logprobs)
                request.reported.append(reported)
            request._queue.put_nowait(Token(token, reported))
            self.observer.tokens(1)
            if request.constraint is not None:
                try:
                    request.constraint.accept(token)
                except OptionError as error:  # cannot happen for a masked choice: end this request alone
                    self._finish(request, Finished("error", str(error)))
                    return
                if request.constraint.done:  # the structure is complete
                    self._finish(request, Finished("stop"))
                    return
            if token in request.stop_ids:
                self._finish(request, Finished("stop"))
                return
            # The next step feeds this token: the cache must have room for it.
            if len(request.generated) >= request.max_tokens or \
                    len(request.prompt) + len(request.generated) >= self.session.context:
                self._finish(request, Finished("length"))
                return

    def _finish(self, request: GenerationRequest, end: Finished) -> None:
        if request.finished is not None:
            return
        request.finished = end
        self._release(request)
        self._swap_in(request)  # a preempted request that ends waiting: its cache is dropped
        if request in self.waiting:
            self.waiting.remove(request)
        request._queue.put_nowait(end)
        self.observer.finished(request)
        self._observe()

    def _drop_ended(self) -> None:
        now = time.monotonic()
        for request in [*self.waiting, *self.running.values()]:
            if request._end is not None:
                self._finish(request, request._end)
            elif request.deadline is not None and now >= request.deadline:
                self._finish(request, Finished("timeout", f"the request timed out after {request.timeout_s:g} s"))

    def _order(self, request: GenerationRequest) -> tuple[int, int]:
        return (request.priority, request.arrival) if self.policy == "priority" else (0, request.arrival)

    def _admit_one(self, *, during_step: bool = False) -> GenerationRequest | None:
        """The most important waiting request, given a free KV slot (or, between steps, the slot of
        a sequence it preempts); None if it must wait.

        Under `priority` (with more than one slot) the last free slot is kept for a request that
        outranks every running sequence: such an arrival then starts at once, even during a
        decode step (`during_step`: only those are admitted, only into free slots)."""
        if not self.waiting:
            return None
        self.waiting.sort(key=self._order)
        request = self.waiting[0]
        free = [slot for slot in range(self.slots) if slot not in self.running]
        outranks = not self.running or request.priority < min(r.priority for r in self.running.values())
        keep = self.policy == "priority" and self.slots > 1 and len(free) == 1 and not outranks
        if during_step and (not outranks or not free or not self._blocks_free_for(request, evict=False)):
            return None
        if keep:
            return None
        if not free:
            if not self._preempt_for(request):
                return None
            free = [slot for slot in range(self.slots) if slot not in self.running]
        while not self._blocks_free_for(request):
            if not self.running:  # the pool is spent by nothing running (a cached prefix would be
                break             # evicted by then): the prefill's own refusal ends it
            if not self._preempt_for(request):
                return None
        self.waiting.pop(0)
        request._slot = min(free)
        request._prefill_left = len(request.prompt) + len(request.generated)
        self.running[request._slot] = request
        return request

    def _preempt_for(self, request: GenerationRequest) -> bool:
        """Under `priority`, free the slot of the least important running sequence if `request`
        comes strictly before it. Its tokens so far stay; it is prefilled again later."""
        if self.policy != "priority" or not self.running:
            return False
        victim = max(self.running.values(), key=self._order)
        if self._order(request) >= self._order(victim) or request.priority >= victim.priority:
            return False
        self._preempt(victim)
        return True

    def _preempt(self, victim: GenerationRequest) -> None:
        """Send a running sequence back to the queue with its tokens so far, its cache swapped out
        where the swap space has room (else computed again on readmission)."""
        self._swap_out(victim)
        self._release(victim)
        victim.preemptions += 1
        self.waiting.append(victim)
        self.waiting.sort(key=self._order)

    def _swap_out(self, request: GenerationRequest) -> None:
        """Keep a preempted sequence's cache in host memory, while `swap_bytes` has room, so that its
        readmission restores it instead of computing it again (recompute otherwise, as vLLM does
        without swap space; also for a bounded cache that evicted positions)."""
        assert request._slot is not None
        length = self.session.slot_length(request._slot)
        arrays: dict[str, np.ndarray] = {}
        with contextlib.suppress(OptionError):  # a bounded cache's evicted positions cannot be handed out
            arrays = self.session.prefix(request._slot, 0, length) if length else {}
        size = sum(a.nbytes for a in arrays.values())
        swapped = bool(arrays) and self.swapped_bytes + size <= self.swap_bytes
        if swapped:
            request._swapped = (length, arrays)
            self.swapped_bytes += size
            self.observer.swap_space(self.swapped_bytes)
        self.observer.preempted(swapped)

    def _swap_in(self, request: GenerationRequest) -> tuple[int, dict[str, np.ndarray]] | None:
        """Take back a request's swapped-out cache (None if it has none), freeing its swap space."""
        swapped, request._swapped = request._swapped, None
        if swapped is not None:
            self.swapped_bytes -= sum(a.nbytes for a in swapped[1].values())
            self.observer.swap_space(self.swapped_bytes)
        return swapped

    def _release(self, request: GenerationRequest) -> None:
        """Free the request's KV slot (in the session, and the draft's) if it holds one."""
        if request._slot is None:
            return
        self.running.pop(request._slot, None)
        self.session.free(request._slot)
        if self.speculator is not None:
            self.speculator.free(request._slot)
        request._slot = None

    def _observe(self) -> None:
        self.observer.queued(len(self.waiting), len(self.running), self.slots)
        kv = self.session.kv
        if kv is not None:
            swapped = sum(kv.blocks_for(r._swapped[0]) for r in self.waiting if r._swapped is not None)
            self.observer.kv_blocks(kv.used_blocks, kv.num_blocks, swapped, kv.used_sram_blocks)
