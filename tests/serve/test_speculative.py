"""Speculative decoding: a draft proposes k tokens, the target verifies them in one step.

- greedy output equals the target alone (`Session.generate`), with a draft that agrees with it
  (the target itself: every draft accepted) and one that mostly does not (a different model);
- the acceptance counts are what the verification saw: all k with the target as its own draft;
- `Session.extend` gives the logits a token-by-token `decode` gives, and `truncate` rolls back;
- the predicted speedup follows the acceptance rate on the plan's simulated steps, its verify
  steps among them;
- a draft that costs a request more time per token than plain decoding is switched off for it
  (on a clock the test controls);
- n-gram drafts (prompt lookup, no draft model): the lookup itself, the same greedy output, and
  drafts accepted on text that repeats.
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

import aviatorc
from aviatorc.runtime import Session
from aviatorc.serve.engine import Engine, GenerationRequest
from aviatorc.serve.speculative import (
    MIN_ACCEPTANCE,
    TRIAL_DRAFTS,
    DraftModel,
    NgramDrafts,
    Speculator,
    drafts_beside,
    lookup,
    predicted_speedup,
    verify_step_s,
)
from tests.serve.test_engine import alone, prompts, serve


@pytest.fixture(scope="module")
def target(artifacts) -> Session:
    return Session(artifacts["llama"])


def speculate(target: Session, draft: Session, k: int, reqs: list[GenerationRequest]) -> Speculator:
    """The acceptance rules alone (the time rule has a test of its own, on a clock it controls)."""
    speculator = Speculator(target, DraftModel(draft, target), k, by_time=False)
    asyncio.run(serve(Engine(target, speculator=speculator), reqs, stagger_steps=1))
    return speculator


@pytest.mark.parametrize("draft_name, k", [("llama", 4), ("draft", 3)])
def test_greedy_output_is_the_targets_alone(target, artifacts, draft_name, k):
    draft = Session(artifacts[draft_name])
    new = 14
    reqs = [GenerationRequest(prompt=p, max_tokens=new) for p in prompts(5, seed=7)]
    speculator = speculate(target, draft, k, reqs)
    for request in reqs:
        assert request.generated == alone(target, request.prompt, new)
    assert speculator.proposed > 0
    if draft_name == "llama":  # the target drafting for itself agrees every time
        assert speculator.accepted == speculator.proposed
    else:  # an unrelated model: most drafts are refused, so the check really rejects
        assert speculator.accepted < speculator.proposed


def test_sampled_requests_decode_normally_beside_speculating_ones(target, artifacts):
    draft = Session(artifacts["draft"])
    greedy = GenerationRequest(prompt=[9, 10, 11], max_tokens=10)
    sampled = GenerationRequest(prompt=[12, 13], max_tokens=10, temperature=1.0, seed=3)
    speculate(target, draft, 3, [greedy, sampled])
    assert greedy.generated == alone(target, [9, 10, 11], 10)
    assert sampled.generated == target.generate([12, 13], 10, temperature=1.0, seed=3)[2:].tolist()


def test_extend_gives_decodes_logits_and_truncate_rolls_back(target):
    prompt, more = [20, 21, 22], [23, 24, 25]
    target.prefill(0, prompt)
    stepwise = np.stack([target.decode([0], [t])[0] for t in more])
    target.free(0)
    target.prefill(0, prompt)
    together = target.extend(0, more)
    np.testing.assert_allclose(together, stepwise, atol=1e-4)  # fp32; one 3-token step vs three 1-token steps
    target.truncate(0, len(prompt) + 1)
    assert target.slot_length(0) == 4
    np.testing.assert_allclose(target.decode([0], [more[1]])[0], stepwise[1], atol=1e-4)
    target.free(0)


def test_extend_many_verifies_sequences_of_different_lengths_in_one_step(target):
    prompts_ = [[20, 21, 22], [30, 31, 32, 33, 34, 35], [40]]
    more = [[5, 6, 7], [8, 9, 10], [11, 12, 13]]
    alone_rows = []
    for slot, (prompt, extra) in enumerate(zip(prompts_, more)):
        target.prefill(slot, prompt)
        alone_rows.append(target.extend(slot, extra))
        target.free(slot)
    for slot, prompt in enumerate(prompts_):
        target.prefill(slot, prompt)
    together = target.extend_many([0, 1, 2], more)
    np.testing.assert_allclose(together, np.stack(alone_rows), atol=1e-4)  # fp32: padded batch vs one at a time
    assert [target.slot_length(s) for s in range(3)] == [6, 9, 4]
    nxt = target.decode([0, 1, 2], [1, 2, 3])  # and the caches it left behind are each sequence's own
    for slot, (prompt, extra) in enumerate(zip(prompts_, more)):
        target.free(slot)
        target.prefill(slot, prompt + extra)
        np.testing.assert_allclose(target.decode([slot], [slot + 1])[0], nxt[slot], atol=1e-4)
        target.free(slot)


def test_the_predicted_speedup_follows_acceptance(artifacts):
    plan = aviatorc.load(artifacts["llama"]).plan
    draft = aviatorc.load(artifacts["draft"]).plan
    rates = [0.0, 0.5, 0.9, 1.0]
    speedups = [predicted_speedup(a, 4, plan, draft) for a in rates]
    assert speedups == sorted(speedups) and speedups[0] < 1.0  # rejecting everything only costs
    # A draft as costly as the target gains nothing even when it is always right: k+1 tokens cost
    # k draft steps of a target step each, and one verify step of at least a decode's cost.
    assert predicted_speedup(1.0, 4, plan, plan) <= 1.0


def test_a_draft_on_chiplets_of_its_own_is_predicted_beside_the_target(artifacts):
    """Two tenants of one target (llama on chiplets 0-1, qwen2 on 2-3): as a draft for the other,
    the tenant drafts while the target verifies, so the prediction charges the longer of the two,
    not their sum; the same draft on the target's chiplets is charged in series."""
    target = aviatorc.load(artifacts["left"]).plan
    draft = aviatorc.load(artifacts["right"]).plan
    shared = dataclasses.replace(draft, chiplets=target.chiplets)
    assert drafts_beside(target, draft) and not drafts_beside(target, shared)
    for a in (0.3, 0.7, 1.0):
        beside, series = predicted_speedup(a, 4, target, draft), predicted_speedup(a, 4, target, shared)
        assert beside > 1.2 * series


def step_clock(monkeypatch, sessions: dict[str, tuple[Session, float]]) -> list[float]:
    """A clock that charges each call of `name` on its session a fixed cost, whatever the number
    of sequences in it (as this machine's steps nearly do); the clock's reading."""
    now = [0.0]
    for name, (session, cost) in sessions.items():
        def charged(*args, _step=getattr(session, name.split(".")[-1]), _cost=cost, **kw):
            now[0] += _cost
            return _step(*args, **kw)
        monkeypatch.setattr(session, name.split(".")[-1], charged)
    return now


@pytest.mark.parametrize("sampled, stays_on", [(0, True), (3, False)])
def test_a_turn_is_one_target_step_and_its_cost_is_shared_by_the_sequences_that_speculate(
        artifacts, monkeypatch, sampled, stays_on):
    """Four sequences, the target drafting for itself (every draft accepted), on a clock that
    charges a step a fixed cost whatever its size: a plain step 1, a verification 2, a draft step
    0.1 (a turn 2.5 with the catch-up step). Every turn is one target step however the drafts and
    the plain sequences mix. With all four speculating, each needs (2.5 - 1) x 4 / 4 = 1.5 of its 4
    drafts accepted to break even: they stay on. With three of them sampling (plain), the one left
    must pay for the turn alone: 6 > 4, so it stops after its first verification."""
    target, draft = Session(artifacts["llama"]), Session(artifacts["llama"])
    calls: list[str] = []
    for session, name in ((target, "decode"), (target, "extend_many")):
        original = getattr(session, name)
        monkeypatch.setattr(session, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
    now = step_clock(monkeypatch, {"target.decode": (target, 1.0), "target.extend_many": (target, 2.0),
                                   "draft.decode": (draft, 0.1)})
    new = 20
    reqs = [GenerationRequest(prompt=p, max_tokens=new, temperature=1.0 if i < sampled else 0.0, seed=i)
            for i, p in enumerate(prompts(4, seed=13))]
    speculator = Speculator(target, DraftModel(draft, target), 4, clock=lambda: now[0])
    turns = [0]
    speculate_turn = speculator._speculate
    monkeypatch.setattr(speculator, "_speculate", lambda *a: turns.__setitem__(0, turns[0] + 1) or speculate_turn(*a))
    asyncio.run(serve(Engine(target, speculator=speculator), reqs))
    greedy = reqs[sampled:]
    for request in greedy:
        assert request.generated == alone(target, request.prompt, new)
    for request in reqs[:sampled]:
        assert request.generated == target.generate(request.prompt, new, temperature=1.0, seed=request.seed,
                                                    eos_token_id=())[len(request.prompt):].tolist()
    assert len(calls) == turns[0] and "extend_many" in calls  # one step of the target a turn
    assert speculator.breakeven_at[4] == pytest.approx(1.5 * 4 / len(greedy), rel=0.05)  # the last turns: fewer drafts
    if stays_on:
        assert all(r.speculating and r.drafted >= 12 for r in greedy)
    else:
        assert not greedy[0].speculating and greedy[0].drafted == 4


def test_a_turn_verifies_only_where_it_is_expected_to_pay(artifacts, monkeypatch):
    """A verify step of n sequences at w positions costs `verify_at[n, w]` plain steps of n: it
    runs only where the tokens expected (1 + a + .. + a^d for a sequence drafting d at acceptance
    rate a, 1 for the rest) are at least that many times n. Where none would pay, the turns decode
    plainly: no verification, no draft step, the same output."""
    target, draft = Session(artifacts["llama"]), Session(artifacts["llama"])
    speculator = Speculator(target, DraftModel(draft, target), 4)
    speculator.verify_at[4, 5] = 2.0
    one_of_four = {0: 4, 1: 0, 2: 0, 3: 0}
    assert not speculator._verify_pays(4, one_of_four, {0: 0.5})  # 3 + 1.94 tokens < 8
    assert not speculator._verify_pays(4, dict.fromkeys(range(4), 4), dict.fromkeys(range(4), 0.5))  # 7.75 < 8
    assert speculator._verify_pays(4, dict.fromkeys(range(4), 4), dict.fromkeys(range(4), 0.8))  # 13.4 >= 8
    assert speculator._verify_pays(4, {0: 2}, {0: 0.0})  # (4, 3) not timed yet: verify, to time it
    assert not speculator._verify_pays(4, dict.fromkeys(range(4), 0), {})  # nothing drafted
    speculator.by_time = False
    assert speculator._verify_pays(4, one_of_four, {0: 0.0})  # --keep-speculating: always

    verifications = []
    extend_many = target.extend_many
    monkeypatch.setattr(target, "extend_many", lambda *a: verifications.append(a) or extend_many(*a))
    speculator = Speculator(target, DraftModel(draft, target), 4)
    speculator.plain_at = dict.fromkeys(range(1, 5), 1.0)
    speculator.verify_at = {(n, w): 100.0 for n in range(1, 5) for w in range(2, 6)}
    reqs = [GenerationRequest(prompt=p, max_tokens=12) for p in prompts(2, seed=17)]
    asyncio.run(serve(Engine(target, speculator=speculator), reqs))
    for request in reqs:
        assert request.generated == alone(target, request.prompt, 12)
    assert verifications == [] and speculator.proposed == 0


def test_a_request_admitted_while_drafts_lose_never_drafts_even_once_they_would_pay(artifacts, monkeypatch):
    """The verdict can change with the batch (the break-even is kept per batch size): a request
    admitted while drafts lose time was never given to the draft model, so it decodes plainly to
    the end instead of drafting from a cache the draft does not hold."""
    target, draft = Session(artifacts["llama"]), Session(artifacts["llama"])
    speculator = Speculator(target, DraftModel(draft, target), 4)
    verdicts = iter([True])  # losing when it is admitted, never after
    monkeypatch.setattr(speculator, "losing", lambda n=None: next(verdicts, False))
    request = GenerationRequest(prompt=[9, 10, 11], max_tokens=8)
    asyncio.run(serve(Engine(target, speculator=speculator), [request]))
    assert request.finished is not None and request.finished.reason == "length"
    assert request.generated == alone(target, [9, 10, 11], 8)
    assert request.drafted == 0 and draft.slot_length(0) == 0 and not speculator.held


# -- n-gram drafts (prompt lookup) -----------------------------------------------------------------


def test_lookup_copies_what_followed_the_latest_longest_match():
    # The last two tokens (3, 4) occurred twice before: the latest occurrence's continuation wins.
    assert lookup([3, 4, 9, 9, 3, 4, 7, 8, 3, 4], 3) == [7, 8, 3]
    assert lookup([3, 4, 9, 9, 3, 4, 7, 8, 3, 4], 1) == [7]
    # A longer match beats a later shorter one: (1, 2, 3) occurred at the start; 3 alone later.
    assert lookup([1, 2, 3, 5, 6, 3, 0, 1, 2, 3], 2) == [5, 6]
    assert lookup([1, 2, 3], 4) == []  # nothing repeats
    assert lookup([5, 5], 3) == [5]  # a run continues itself
    assert lookup([1, 2, 1], 2, min_n=2) == []  # only n >= 2 counts


def test_ngram_drafts_keep_the_greedy_output_and_are_accepted_on_repeating_text(target):
    new = 16
    loop = [40, 41, 42, 43, 44] * 3  # a prompt that repeats: lookup has something to propose at once
    reqs = [GenerationRequest(prompt=p, max_tokens=new) for p in [loop, *prompts(3, seed=11)]]
    speculator = Speculator(target, NgramDrafts(), 4, by_time=False)
    asyncio.run(serve(Engine(target, speculator=speculator), reqs, stagger_steps=1))
    for request in reqs:
        assert request.generated == alone(target, request.prompt, new)
    assert speculator.proposed > 0 and 0 < speculator.accepted <= speculator.proposed
    # Nothing drafted costs nothing: with no repeats at all, every step is a plain decode.
    plain = GenerationRequest(prompt=[60, 61, 62], max_tokens=2)
    quiet = Speculator(target, NgramDrafts(max_n=4, min_n=4), 4)
    asyncio.run(serve(Engine(target, speculator=quiet), [plain]))
    assert quiet.proposed == 0 and plain.generated == alone(target, [60, 61, 62], 2)


def test_ngram_speculation_is_predicted_without_a_draft_step(artifacts):
    plan = aviatorc.load(artifacts["llama"]).plan
    assert predicted_speedup(1.0, 4, plan) > predicted_speedup(1.0, 4, plan, aviatorc.load(artifacts["draft"]).plan)
    assert predicted_speedup(0.0, 4, plan) < 1.0  # verifying only rejected drafts still costs


def test_each_request_sets_its_draft_length_from_its_own_acceptance(target, artifacts):
    new, k = 30, 4
    agreeing = [GenerationRequest(prompt=p, max_tokens=new) for p in prompts(2, seed=5)]
    speculate(target, Session(artifacts["llama"]), k, agreeing)  # always right: k drafts every turn
    for request in agreeing:
        assert request.accepted_drafts == request.drafted >= new - k - 1 - k  # every turn but the last few speculated
    unrelated = [GenerationRequest(prompt=p, max_tokens=new) for p in prompts(6, seed=5)]
    speculate(target, Session(artifacts["draft"]), k, unrelated)
    for request in unrelated:
        assert request.generated == alone(target, request.prompt, new)
        rate = request.accepted_drafts / request.drafted
        if rate < MIN_ACCEPTANCE:  # switched off once its trial drafts were judged: no more proposals after
            assert request.drafted < TRIAL_DRAFTS + k
        else:  # kept on, with drafts no longer than its acceptance earns
            assert request.drafted >= TRIAL_DRAFTS
    assert any(r.accepted_drafts / r.drafted < MIN_ACCEPTANCE for r in unrelated)  # the rule was exercised


def test_a_request_switched_off_no_longer_runs_the_draft_model(target, artifacts):
    draft = Session(artifacts["draft"])
    stepped: list[list[int]] = []
    original = draft.decode

    def counting(slots, tokens):
        stepped.append(list(slots))
        return original(slots, tokens)

    draft.decode = counting  # type: ignore[method-assign]
    request = GenerationRequest(prompt=[9, 10, 11], max_tokens=12)
    request.drafted = TRIAL_DRAFTS  # as if every draft of its trial had been refused
    asyncio.run(serve(Engine(target, speculator=Speculator(target, DraftModel(draft, target), 4, by_time=False)),
                      [request]))
    assert request.generated == alone(target, [9, 10, 11], 12)
    assert stepped == [] and draft.slot_length(0) == 0  # prefilled once, then freed: no draft step at all


def test_the_speedup_is_predicted_from_the_plans_verify_steps(artifacts):
    plan = aviatorc.load(artifacts["llama"]).plan
    timed = {p.positions: p.time_per_token_s for p in plan.prediction.verify if p.fits}
    assert verify_step_s(plan, 4) == timed[5] and timed[3] < verify_step_s(plan, 3) < timed[5]
    # A plan compiled before verify steps were timed reads its sweep at 5x the batch instead,
    # which reads every sequence's cache 5 times: a slower verify, a lower speedup.
    older = dataclasses.replace(plan, prediction=dataclasses.replace(plan.prediction, verify=()))
    assert verify_step_s(older, 4) > verify_step_s(plan, 4)
    assert predicted_speedup(0.8, 4, older) < predicted_speedup(0.8, 4, plan)


@pytest.mark.parametrize("draft_cost, verify_cost, stays_on", [(0.1, 1.5, True), (1.0, 2.0, False)])
def test_a_draft_that_costs_more_time_than_it_saves_is_switched_off(artifacts, monkeypatch, draft_cost, verify_cost,
                                                                    stays_on):
    """The target drafts for itself (every draft accepted: 5 tokens a verification at k = 4) on a
    clock that charges each sequence 1 for a plain step, `verify_cost` for a verification and
    `draft_cost` for each draft step (4, then 1 to catch up): 0.1 and 1.5 cost 2 for 5 tokens,
    worth it (a turn needs 1 accepted draft of the 4 to break even); 1.0 and 2.0 cost 7, more
    than 5 plain steps (it would need 6), so it stops after its first verification."""
    target, draft = Session(artifacts["llama"]), Session(artifacts["llama"])
    now = [0.0]

    def charged(session: Session, name: str, cost: float) -> None:
        original = getattr(session, name)

        def step(slots, *args):
            now[0] += cost * len(slots)
            return original(slots, *args)

        monkeypatch.setattr(session, name, step)

    charged(target, "decode", 1.0)
    charged(target, "extend_many", verify_cost)
    charged(draft, "decode", draft_cost)
    new = 30
    request = GenerationRequest(prompt=[9, 10, 11], max_tokens=new)
    speculator = Speculator(target, DraftModel(draft, target), 4, clock=lambda: now[0])
    asyncio.run(serve(Engine(target, speculator=speculator), [request]))
    assert request.generated == alone(target, [9, 10, 11], new)
    assert speculator.plain_at == {1: 1.0}  # its first step decoded plainly, to time a plain step of one
    assert speculator.breakeven_at[1] == pytest.approx(5 * draft_cost + verify_cost - 1, rel=0.05)  # the last: fewer drafts
    assert request.accepted_drafts == request.drafted
    if stays_on:
        assert request.drafted > 20
    else:
        assert request.drafted == 4 and draft.slot_length(0) == 0  # one verification, then the draft was freed


def test_a_request_switched_off_by_time_stays_off_when_plain_steps_grow_dearer(artifacts, monkeypatch):
    """The time rule's averages keep moving after a request stops speculating: here plain steps
    cost 1, then 50 from the fifth on, which would make speculating worth it again. The request
    stays off (its draft model's cache was freed: drafting again from it would fail)."""
    target, draft = Session(artifacts["llama"]), Session(artifacts["llama"])
    now, plain_steps = [0.0], [0]
    decode, extend_many, draft_decode = target.decode, target.extend_many, draft.decode

    def plain(slots, tokens):
        plain_steps[0] += 1
        now[0] += (1.0 if plain_steps[0] < 5 else 50.0) * len(slots)
        return decode(slots, tokens)

    def verify(slots, ids):
        now[0] += 8.0 * len(slots)
        return extend_many(slots, ids)

    monkeypatch.setattr(target, "decode", plain)
    monkeypatch.setattr(target, "extend_many", verify)
    monkeypatch.setattr(draft, "decode", draft_decode)
    request = GenerationRequest(prompt=[9, 10, 11], max_tokens=24)
    speculator = Speculator(target, DraftModel(draft, target), 4, clock=lambda: now[0])
    asyncio.run(serve(Engine(target, speculator=speculator), [request]))
    assert request.generated == alone(target, [9, 10, 11], 24)
    assert not request.speculating and request.drafted == 4  # off after its first verification, and for good
    assert speculator.plain_at[1] > 8.0  # plain steps grew dearer than a verification, yet it stayed off


def test_once_the_drafts_lose_time_a_new_request_does_not_run_the_draft_model(artifacts, monkeypatch):
    """A verification costing 8 plain steps a sequence (the draft free) against the 5 tokens each
    verification has handed out (every draft accepted): after the first request's, a later request
    is neither prefilled in the draft model nor drafted for."""
    target, draft = Session(artifacts["llama"]), Session(artifacts["llama"])
    now, drafted_slots = [0.0], []
    decode, extend_many, draft_decode, draft_prefill = target.decode, target.extend_many, draft.decode, draft.prefill

    def charge(cost, step):
        def charged(slots, *args):
            now[0] += cost * len(slots)
            return step(slots, *args)
        return charged

    monkeypatch.setattr(target, "decode", charge(1.0, decode))
    monkeypatch.setattr(target, "extend_many", charge(8.0, extend_many))
    monkeypatch.setattr(draft, "prefill", lambda slot, ids, **kw: drafted_slots.append(slot) or draft_prefill(slot, ids))
    monkeypatch.setattr(draft, "decode", draft_decode)
    speculator = Speculator(target, DraftModel(draft, target), 4, clock=lambda: now[0])
    engine = Engine(target, speculator=speculator)
    first = GenerationRequest(prompt=[9, 10, 11], max_tokens=12)
    asyncio.run(serve(engine, [first]))
    assert first.drafted == 4 and speculator.losing() and drafted_slots == [0]
    later = GenerationRequest(prompt=[20, 21, 22], max_tokens=12)
    asyncio.run(serve(engine, [later]))
    assert later.generated == alone(target, [20, 21, 22], 12)
    assert later.drafted == 0 and drafted_slots == [0]  # its prompt never went to the draft model
