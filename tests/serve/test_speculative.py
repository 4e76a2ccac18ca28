"""Speculative decoding: a draft proposes k tokens, the target verifies them in one step.

- greedy output equals the target alone (`Session.generate`), with a draft that agrees with it
  (the target itself: every draft accepted) and one that mostly does not (a different model);
- the acceptance counts are what the verification saw: all k with the target as its own draft;
- `Session.extend` gives the logits a token-by-token `decode` gives, and `truncate` rolls back;
- the predicted speedup follows the acceptance rate on the plan's simulated steps.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import aviatorc
from aviatorc.runtime import Session
from aviatorc.serve.engine import Engine, GenerationRequest
from aviatorc.serve.speculative import Speculator, predicted_speedup
from tests.serve.test_engine import alone, prompts, serve


@pytest.fixture(scope="module")
def target(artifacts) -> Session:
    return Session(artifacts["llama"])


def speculate(target: Session, draft: Session, k: int, reqs: list[GenerationRequest]) -> Speculator:
    speculator = Speculator(draft, target, k)
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


def test_the_predicted_speedup_follows_acceptance(artifacts):
    plan = aviatorc.load(artifacts["llama"]).plan
    draft = aviatorc.load(artifacts["draft"]).plan
    rates = [0.0, 0.5, 0.9, 1.0]
    speedups = [predicted_speedup(a, 4, plan, draft) for a in rates]
    assert speedups == sorted(speedups) and speedups[0] < 1.0  # rejecting everything only costs
    # A draft as costly as the target gains nothing even when it is always right: k+1 tokens cost
    # k draft steps of a target step each, and one verify step of at least a decode's cost.
    assert predicted_speedup(1.0, 4, plan, plan) <= 1.0
