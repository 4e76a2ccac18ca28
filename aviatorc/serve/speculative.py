"""Speculative decoding: a small draft model proposes k tokens, the target checks them in one step.

    speculator = Speculator(Session("draft.avc"), target_session, k=4, metrics)
    Engine(target_session, speculator=speculator)

Each engine step, for every running sequence sampled greedily (temperature 0):
1. the draft decodes k tokens after the sequence's last one (batched across the sequences);
2. the target runs [last, d1 .. dk] in one step per sequence (`Session.extend`; on the plan's
   hardware all sequences' verification is one step, which is what `predicted_speedup` models)
   and takes its own greedy token at every position: t0 .. tk;
3. the drafts agree with the target up to the first i with d(i+1) != t(i): the sequence gets
   d1 .. di and then t(i) (the target's token where they differ, or t(k) when all agree);
4. both caches are cut back to the tokens accepted (`Session.truncate`).
Every token handed out is the target's own greedy choice given the tokens before it, so the
output is the target's alone (up to float rounding between one-token and k-token steps).
Sequences that sample (temperature > 0) decode normally in the same turn: rejection sampling
is not implemented.

`predicted_speedup` turns a measured acceptance rate into the speedup on the plan's target,
from the two plans' simulated steps (see its docstring).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from aviatorc.errors import OptionError

if TYPE_CHECKING:
    from aviatorc.plan.plan import Plan
    from aviatorc.runtime import Session
    from aviatorc.serve.engine import Engine
    from aviatorc.serve.metrics import Metrics


class Speculator:
    def __init__(self, draft: Session, target: Session, k: int, metrics: Metrics | None = None) -> None:
        if k < 1:
            raise OptionError(f"--num-speculative-tokens must be >= 1, not {k}")
        if draft.cache is None:
            raise OptionError("the draft model cannot generate: it has no KV cache", file=str(draft.artifact.path))
        if draft.num_slots < target.num_slots:
            raise OptionError(f"the draft has {draft.num_slots} KV slots but the target {target.num_slots}",
                              file=str(draft.artifact.path), hint=f"compile the draft with --batch {target.num_slots}")
        if draft.context < target.context:
            raise OptionError(f"the draft's context ({draft.context}) is shorter than the target's ({target.context})",
                              file=str(draft.artifact.path), hint=f"compile the draft with --context {target.context}")
        if vocabulary(draft) != vocabulary(target):
            raise OptionError(f"the draft's vocabulary ({vocabulary(draft)} tokens) is not the target's "
                              f"({vocabulary(target)})", file=str(draft.artifact.path),
                              hint="a draft must share the target's tokenizer")
        self.draft, self.target, self.k, self.metrics = draft, target, k, metrics
        self.proposed = self.accepted = 0

    def prefill(self, slot: int, ids: np.ndarray) -> None:
        self.draft.prefill(slot, ids)

    def free(self, slot: int) -> None:
        self.draft.free(slot)

    async def step(self, engine: Engine, batch: Sequence[int]) -> None:
        """One turn for `batch` (the running slots): speculate for the greedy ones, decode the rest."""
        jobs: dict[int, tuple[int, int]] = {}  # slot -> (last token, drafts to propose)
        plain: list[int] = []
        for slot in batch:
            request = engine.running[slot]
            length = len(request.prompt) + len(request.generated)  # the last token is not in the cache yet
            k = min(self.k, request.max_tokens - len(request.generated) - 1, self.target.context - length - 1)
            if request.temperature == 0 and k >= 1:
                jobs[slot] = (request.generated[-1], k)
            else:
                plain.append(slot)
        if plain:
            tokens = [engine.running[slot].generated[-1] for slot in plain]
            logits = await asyncio.to_thread(self._decode_both, plain, tokens)
            for slot, row in zip(plain, logits):
                engine._accept(engine.running[slot], [engine._sample(engine.running[slot], row)], [row])
        if jobs:
            results = await asyncio.to_thread(self._speculate, jobs)
            for slot, (tokens, rows, proposed, accepted) in results.items():
                self.proposed += proposed
                self.accepted += accepted
                if self.metrics is not None:
                    self.metrics.speculated(proposed, accepted)
                engine._accept(engine.running[slot], tokens, rows)
        engine.observer.decode_step(len(batch), engine.slots)

    def _decode_both(self, slots: list[int], tokens: list[int]) -> np.ndarray:
        self.draft.decode(slots, tokens)  # keeps the draft's cache in step
        return self.target.decode(slots, tokens)

    def _speculate(self, jobs: dict[int, tuple[int, int]]) -> dict[int, tuple[list[int], np.ndarray, int, int]]:
        """(tokens to hand out, the target's logits each was chosen from, drafts proposed, drafts
        accepted) per slot."""
        drafts: dict[int, list[int]] = {slot: [] for slot in jobs}
        feed = {slot: last for slot, (last, _) in jobs.items()}
        for depth in range(max(k for _, k in jobs.values())):
            active = sorted(slot for slot, (_, k) in jobs.items() if k > depth)
            rows = self.draft.decode(active, [feed[slot] for slot in active])
            for slot, row in zip(active, rows):
                feed[slot] = int(np.argmax(row))
                drafts[slot].append(feed[slot])
        out: dict[int, tuple[list[int], np.ndarray, int, int]] = {}
        catch_up: list[int] = []
        for slot, (last, k) in jobs.items():
            before = self.target.slot_length(slot)
            rows = self.target.extend(slot, [last, *drafts[slot]])
            choices = [int(np.argmax(row)) for row in rows]
            accepted = next((i for i in range(k) if drafts[slot][i] != choices[i]), k)
            # Token i handed out (an accepted draft equals the target's choice) came from row i.
            out[slot] = ([*drafts[slot][:accepted], choices[accepted]], rows[:accepted + 1], k, accepted)
            # Both caches keep [last, d1 .. d_accepted]; the next turn feeds choices[accepted].
            self.target.truncate(slot, before + 1 + accepted)
            if accepted < k:
                self.draft.truncate(slot, before + 1 + accepted)
            else:
                catch_up.append(slot)  # the draft never ran d_k: feed it now
        if catch_up:
            self.draft.decode(catch_up, [drafts[slot][-1] for slot in catch_up])
        return out


def vocabulary(session: Session) -> int | str | None:
    """The width of a decoder's logits."""
    name = session.cache.logits if session.cache else None
    return next((v.type.shape[-1] for v in session.graph.outputs if v.name == name), None)


def predicted_speedup(acceptance: float, k: int, target_plan: Plan, draft_plan: Plan) -> float:
    """Tokens per second with speculation over tokens per second without, on the plan's target.

    With a per-token acceptance rate a, a turn hands out E = (1 - a^(k+1)) / (1 - a) tokens per
    sequence (the accepted drafts and the target's own token) and costs k draft steps plus one
    target step over k+1 tokens per sequence. The steps come from each plan's simulated decode:
    the draft's at its batch, the target's k+1-token step read off its batch sweep at batch
    B(k+1) (linear between the swept batches, extrapolated along the last two past the largest
    that fits). That point also reads the KV cache k+1 times where a verify reads it once: an
    overestimate of the verify step, so the speedup is a low one.
    """
    batch = target_plan.workload.batch
    step_s = target_plan.prediction.time_per_token_s
    draft_s = draft_plan.prediction.time_per_token_s
    verify_s = _step_at(target_plan, batch * (k + 1)) or step_s * (k + 1)
    a = min(max(acceptance, 0.0), 1.0)
    tokens = k + 1 if a == 1.0 else (1 - a ** (k + 1)) / (1 - a)
    return tokens * step_s / (k * draft_s + verify_s)


def _step_at(plan: Plan, batch: int) -> float | None:
    """The decode step at `batch` from the plan's sweep (at its compiled context): linear between
    the swept batches, and past the last one that fits, along the line through the last two."""
    context = plan.workload.context
    swept = {p.batch: p.time_per_token_s for p in plan.prediction.sweep if p.fits and p.context == context}
    swept[plan.workload.batch] = plan.prediction.time_per_token_s  # the compiled point itself
    points = sorted(swept.items())
    if batch <= points[-1][0]:
        return float(np.interp(batch, [b for b, _ in points], [s for _, s in points]))
    if len(points) < 2:
        return None
    (b0, s0), (b1, s1) = points[-2:]
    return s1 + max(0.0, (s1 - s0) / (b1 - b0)) * (batch - b1)
