"""Speculative decoding: k tokens are drafted cheaply, the target checks them in one step.

    speculator = Speculator(target_session, DraftModel(Session("draft.avc"), target_session), k=4)
    speculator = Speculator(target_session, NgramDrafts(), k=4)          # prompt lookup: no draft model
    Engine(target_session, speculator=speculator)

Each engine step, for every running sequence sampled greedily (temperature 0):
1. the drafter proposes up to k tokens after the sequence's last one: a draft model decodes them
   greedily (batched across the sequences); n-gram lookup copies what followed the latest
   earlier occurrence of the sequence's last n tokens in its prompt and output (n from 4 down
   to 1), which proposes nothing when there is none;
2. the target runs [last, d1 .. dk] of every sequence in one step (`Session.extend_many`, the
   shorter ones padded; what `predicted_speedup` models) and takes its own greedy token at every
   position: t0 .. tk;
3. the drafts agree with the target up to the first i with d(i+1) != t(i): the sequence gets
   d1 .. di and then t(i) (the target's token where they differ, or t(k) when all agree);
4. the target's cache (and a draft model's) is cut back to the tokens accepted (`Session.truncate`).
Every token handed out is the target's own greedy choice given the tokens before it, so the
output is the target's alone (up to float rounding between one-token and k-token steps). Under a
structured-output grammar, drafts it refuses are cut before verification and the target's
choices are its masked ones, so the output equals constrained decoding without speculation.
Sequences that sample (temperature > 0), and those with nothing drafted, take their next token
from the same step (their first position): rejection sampling is not implemented.

Each request sets its draft length from its own acceptance (`Speculator.draft_length`) and stops
speculating when its drafts are mostly refused, or when they do not pay on this machine for the
time they add to a step (`Speculator.breakeven`, from steps timed as they run).

`predicted_speedup` turns a measured acceptance rate (and `speedup_on_target` a measured number
of tokens per verification) into the speedup on the plan's target, from the plans' simulated
steps (see their docstrings).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from aviatorc.errors import OptionError

if TYPE_CHECKING:
    from aviatorc.plan.plan import Plan
    from aviatorc.runtime import Session
    from aviatorc.serve.engine import Engine, GenerationRequest
    from aviatorc.serve.metrics import Metrics
    from aviatorc.serve.structured import Constraint

METHODS = ("draft", "ngram", "self")
SELF_DRAFT_QUANT = "int4"  # the self draft's format: half the bytes of an INT8 target, a quarter of FP16's
TRIAL_DRAFTS = 8  # drafts a request proposes before its own acceptance rate sets its draft length
MIN_ACCEPTANCE = 0.15  # below this, a request stops speculating: its verify steps would cost more than they give
Job = tuple[list[int], int]  # (the sequence so far: prompt and generated tokens, drafts wanted)


class Drafter(Protocol):
    """Where drafts come from; `sessions`: the sessions it runs (a prefill pauses them too)."""

    sessions: list[Session]

    def prefill(self, slot: int, ids: np.ndarray) -> None: ...
    def free(self, slot: int) -> None: ...
    def follow(self, slots: list[int], tokens: list[int]) -> None: ...
    def propose(self, jobs: dict[int, Job]) -> dict[int, list[int]]: ...
    def settle(self, kept: dict[int, int]) -> None: ...


class DraftModel:
    """A small model's greedy tokens; its KV cache is kept in step with the target's."""

    def __init__(self, draft: Session, target: Session) -> None:
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
        self.draft = draft
        self.sessions = [draft]
        self._proposed: dict[int, tuple[int, list[int]]] = {}  # slot -> (its cache length before, drafts)

    def prefill(self, slot: int, ids: np.ndarray) -> None:
        self.draft.prefill(slot, ids)

    def free(self, slot: int) -> None:
        self.draft.free(slot)

    def follow(self, slots: list[int], tokens: list[int]) -> None:
        """A plain step of the target: keep the draft's cache in step, for the sequences it still
        drafts for (one that stopped speculating was freed here)."""
        held = [(slot, token) for slot, token in zip(slots, tokens) if self.draft.slot_length(slot)]
        if held:
            self.draft.decode([slot for slot, _ in held], [token for _, token in held])

    def propose(self, jobs: dict[int, Job]) -> dict[int, list[int]]:
        drafts: dict[int, list[int]] = {slot: [] for slot in jobs}
        self._proposed = {slot: (self.draft.slot_length(slot), drafts[slot]) for slot in jobs}
        feed = {slot: history[-1] for slot, (history, _) in jobs.items()}
        for depth in range(max(k for _, k in jobs.values())):
            active = sorted(slot for slot, (_, k) in jobs.items() if k > depth)
            rows = self.draft.decode(active, [feed[slot] for slot in active])
            for slot, row in zip(active, rows):
                feed[slot] = int(np.argmax(row))
                drafts[slot].append(feed[slot])
        return {slot: list(d) for slot, d in drafts.items()}

    def settle(self, kept: dict[int, int]) -> None:
        """Per slot that proposed: how many of [last, d1 .. dk] the target kept (0: none; the slot
        then decodes plainly). The draft ran [last, d1 .. d(k-1)]: its cache is cut to the same
        tokens, or fed dk when the target kept all of them."""
        catch_up: dict[int, int] = {}
        for slot, n in kept.items():
            before, drafts = self._proposed.pop(slot)  # before >= 1: the slot holds its prompt
            if n <= len(drafts):
                self.draft.truncate(slot, before + n)
            else:
                catch_up[slot] = drafts[-1]
        if catch_up:
            slots = sorted(catch_up)
            self.draft.decode(slots, [catch_up[slot] for slot in slots])


def compile_self_draft(target: Session, out: Path) -> Path:
    """The target's own source compiled again at SELF_DRAFT_QUANT (round to nearest: a server has no
    calibration data) with the target's other compile options, onto its target, chiplets, KV slots
    and context; written to the artifact folder `out`. It shares the tokenizer and, being the same
    model at a coarser format, agrees with the target far more often than a smaller model does."""
    from aviatorc.compiler import compile as compile_model
    from aviatorc.options import CompileOptions

    where = str(target.artifact.path)
    report = target.artifact.report
    recorded = report.get("options")
    if not isinstance(recorded, dict):
        raise OptionError("the self draft compiles the target again with its options, but its report.json has none",
                          file=where, hint=f"compile it with --quant {SELF_DRAFT_QUANT} yourself and pass it with --draft")
    known = {f.name for f in dataclasses.fields(CompileOptions)} - {"extra"}
    options: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in recorded.items() if k in known}
    if options.get("quant") in (SELF_DRAFT_QUANT, "mxint4"):
        raise OptionError(f"the target is already {options['quant']}: a self draft at {SELF_DRAFT_QUANT} would cost "
                          "as much as the target", file=where, hint="use --speculative-method ngram, or a smaller "
                          "--draft model")
    source = Path(str(report.get("source", "")))
    if not source.is_file() and not source.is_dir():
        raise OptionError(f"the self draft compiles the target's source again, but '{source}' is not there",
                          file=where, hint=f"compile it with --quant {SELF_DRAFT_QUANT} yourself and pass it with "
                          "--draft")
    out.parent.mkdir(parents=True, exist_ok=True)
    target_file = out.with_name(out.name + ".target.toml")
    target_file.write_text(target.artifact.target_toml)
    options |= {"target": str(target_file), "quant": SELF_DRAFT_QUANT, "group_size": None, "symmetric": None,
                "quant_method": "rtn", "passes": None, "ranges": False, "sweep": False}
    logging.getLogger("aviatorc.serve").warning("compiling the %s self draft of %s (pass it as --draft next time: "
                                                "%s)", SELF_DRAFT_QUANT, where, out)
    compile_model(str(source), **options).save(out, html_report=False)
    return out


def same_model(draft: Session, target: Session) -> bool:
    """Whether both were compiled from one model: the imported graphs' summaries agree."""
    return bool(draft.artifact.report.get("model")) and \
        draft.artifact.report.get("model") == target.artifact.report.get("model")


class NgramDrafts:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's
    last n tokens (the longest n from `max_n` down to `min_n` that occurred before). No model, no
    cache: nothing to keep in step."""

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise OptionError(f"n-gram sizes must satisfy 1 <= min <= max, not {min_n} and {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.sessions: list[Session] = []

    def prefill(self, slot: int, ids: np.ndarray) -> None:
        pass

    def free(self, slot: int) -> None:
        pass

    def follow(self, slots: list[int], tokens: list[int]) -> None:
        pass

    def propose(self, jobs: dict[int, Job]) -> dict[int, list[int]]:
        return {slot: lookup(history, k, self.max_n, self.min_n) for slot, (history, k) in jobs.items()}

    def settle(self, kept: dict[int, int]) -> None:
        pass


def lookup(history: Sequence[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of history's last n tokens,
    for the largest n in [min_n, max_n] that has one; [] when none does."""
    tokens = list(history)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest first; not the tail itself
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []


class Speculator:
    """`by_time`: also switch a request off when, on the machine this runs on, its drafts do not
    pay for the time they cost (see `draft_length`); `clock` measures that time."""

    def __init__(self, target: Session, drafter: Drafter, k: int, metrics: Metrics | None = None, *,
                 by_time: bool = True, clock: Callable[[], float] = time.perf_counter) -> None:
        if k < 1:
            raise OptionError(f"--num-speculative-tokens must be >= 1, not {k}")
        self.target, self.drafter, self.k, self.metrics = target, drafter, k, metrics
        self.by_time, self.clock = by_time, clock
        self.proposed = self.accepted = self.verifications = 0
        # What this machine took, as moving averages by the number of sequences n in the step (the
        # cost of a step grows far less than n-fold here, so costs are compared at one n): a plain
        # decode step of n; and the break-even of a turn of n that speculated, the accepted drafts
        # per verification each speculating sequence had to bring to pay for its share of the turn.
        self.plain_at: dict[int, float] = {}
        self.breakeven_at: dict[int, float] = {}
        self.verify_at: dict[tuple[int, int], float] = {}  # (n, positions each) -> a verify step over a plain one
        self._batch = 0  # the sequences of the last turn that speculated
        self.held: set[int] = set()  # the slots the drafter was given (a draft model holds their caches)

    @property
    def sessions(self) -> list[Session]:
        return self.drafter.sessions

    def prefill(self, slot: int, ids: np.ndarray) -> None:
        """A new sequence, given to the drafter unless drafts lose time now (`losing`): one that is not
        never speculates, even once they would pay (a draft model holds no cache for it)."""
        if not self.losing():
            self.drafter.prefill(slot, ids)
            self.held.add(slot)

    def free(self, slot: int) -> None:
        self.drafter.free(slot)
        self.held.discard(slot)

    def losing(self, n: int | None = None) -> bool:
        """The verifications so far have accepted fewer drafts each (k, the most they can, before
        any) than a turn of n sequences (the last that speculated, by default) needs to break even:
        on this machine this draft loses time, so new requests no longer try it (nor prefill the
        draft model)."""
        needed = self.breakeven(n)
        brought = self.accepted / self.verifications if self.verifications else self.k
        return needed is not None and needed > brought

    def draft_length(self, request: GenerationRequest, n: int) -> int:
        """Drafts to propose for `request` in a turn of n sequences, from its own running acceptance
        rate a: k until it has proposed TRIAL_DRAFTS; then one more than the run of acceptances
        expected per turn, a / (1 - a), up to k; 0 below MIN_ACCEPTANCE: it decodes plainly from
        then on, and a draft model no longer runs for it. With `by_time`, also 0 once its
        verifications have accepted fewer drafts each than a turn of n needs to break even
        (`breakeven`), judged from its first verification: a draft that loses time is switched off;
        and 0 from the start once the verifications so far would not pay (`losing`). Once 0, always
        0 (`request.speculating`)."""
        if not request.speculating or request.temperature != 0 or (not request.verifications and self.losing(n)):
            return 0
        needed = self.breakeven(n)  # judged from its first verification: a trial that loses time is cut short
        if needed is not None and request.verifications and request.accepted_drafts / request.verifications < needed:
            return 0
        if request.drafted < TRIAL_DRAFTS:
            return self.k
        a = request.accepted_drafts / request.drafted
        if a < MIN_ACCEPTANCE:
            return 0
        return self.k if a >= 1 else max(1, min(self.k, round(a / (1 - a)) + 1))

    def breakeven(self, n: int | None = None) -> float | None:
        """With `by_time`: the accepted drafts per verification a speculating sequence needs in a
        turn of n (the last that speculated, by default) to hand out tokens at least as fast as
        plain steps do (between the sizes timed: linear, past them: the nearest); None before a
        turn that speculated was timed."""
        if not self.by_time or not self.breakeven_at:
            return None
        return _between(self.breakeven_at, n or self._batch)

    def _verify_pays(self, n: int, lengths: dict[int, int], rates: dict[int, float]) -> bool:
        """Whether a verify step of n sequences, `lengths` drafts each for the slots drafting, is
        expected to hand out tokens at least as fast as a plain step of n: the tokens expected of
        each (a run of accepted drafts at its acceptance rate a, then the target's own token:
        1 + a + .. + a^d) and one each from the rest, against the verify steps of n at as many
        positions timed so far over a plain step (not timed yet, or without `by_time`: yes)."""
        drafting = {slot: d for slot, d in lengths.items() if d}
        cost = self.verify_at.get((n, 1 + max(drafting.values(), default=0)))
        if not drafting or not self.by_time or cost is None:
            return bool(drafting)
        tokens = n - len(drafting) + sum(sum(rates.get(slot, 1.0) ** j for j in range(d + 1))
                                         for slot, d in drafting.items())
        return tokens >= cost * n

    async def step(self, engine: Engine, batch: Sequence[int]) -> None:
        """One turn for `batch` (the running slots): speculate for the greedy ones, decode the rest."""
        jobs: dict[int, Job] = {}
        plain: dict[int, int] = {}  # slot -> its last token
        constraints: dict[int, Constraint] = {}
        rates: dict[int, float] = {}  # slot -> the acceptance rate its drafts are expected to have
        probe = self.by_time and len(batch) not in self.plain_at  # a plain step of this many, to time it
        for slot in batch:
            request = engine.running[slot]
            length = len(request.prompt) + len(request.generated)  # the last token is not in the cache yet
            wanted = self.draft_length(request, len(batch)) if slot in self.held else 0
            if wanted == 0 and request.speculating:  # switched off for good: the draft model stops following it too
                request.speculating = False
                self.free(slot)
            elif probe:
                wanted = 0
            k = min(wanted, request.max_tokens - len(request.generated) - 1, self.target.context - length - 1)
            if request.temperature == 0 and k >= 1:
                jobs[slot] = (request.prompt + request.generated, k)
                rates[slot] = (request.accepted_drafts / request.drafted if request.drafted
                               else self.accepted / self.proposed if self.proposed else 1.0)
                if request.constraint is not None:
                    constraints[slot] = request.constraint
            else:
                plain[slot] = request.generated[-1]
        results = await asyncio.to_thread(self._speculate, jobs, plain, constraints, rates)
        for slot, (tokens, rows, proposed, accepted) in sorted(results.items()):
            request = engine.running[slot]
            if not tokens:  # decoded plainly: sample its next token as without speculation
                engine._take(request, rows[0])
                continue
            self.proposed += proposed
            self.accepted += accepted
            self.verifications += 1
            request.drafted += proposed
            request.accepted_drafts += accepted
            request.verifications += 1
            if self.metrics is not None:
                self.metrics.speculated(proposed, accepted)
            engine._accept(request, tokens, rows)
        engine.observer.decode_step(len(batch), engine.slots)

    def _speculate(self, jobs: dict[int, Job], plain: dict[int, int], constraints: dict[int, Constraint],
                   rates: dict[int, float] | None = None) -> dict[int, tuple[list[int], np.ndarray, int, int]]:
        """(tokens to hand out, the target's logits each was chosen from, drafts proposed, drafts
        accepted) per slot; for the slots decoded plainly (those asked to, and those with nothing
        drafted), no tokens and the logits of their next position. Under a grammar
        (`constraints`), drafts past the first token it refuses are dropped before verification,
        and the target's choices are its masked ones.

        The whole turn is one step of the target: every sequence's positions padded to the
        longest (the padding's logits unused, its cache cut back), since here, as on the target,
        a step costs about its weight reads, which one per draft length (and one more for the
        plain sequences) would repeat. A sequence within that many positions of the context's
        end shortens everyone's drafts for the turn. The turn verifies only where that is
        expected to pay (`_verify_pays`, from each sequence's acceptance rate in `rates`), judged
        before drafting and again on the drafts made."""
        started = self.clock()
        rates = rates or {}
        n = len(jobs) + len(plain)
        if not self._verify_pays(n, {slot: k for slot, (_, k) in jobs.items()}, rates):
            jobs, plain = {}, plain | {slot: history[-1] for slot, (history, _) in jobs.items()}
        drafts = self.drafter.propose(jobs) if jobs else {}
        for slot, grammar in constraints.items():
            if slot in drafts:
                drafts[slot] = drafts[slot][:grammar.matcher.validate_tokens(drafts[slot])]
        room = min(self.target.context - self.target.slot_length(slot) for slot in [*jobs, *plain])
        for slot in jobs:
            drafts[slot] = drafts[slot][:room - 1]
        if not self._verify_pays(n, {slot: len(d) for slot, d in drafts.items()}, rates):
            drafts = dict.fromkeys(drafts, [])
        undrafted = {slot: history[-1] for slot, (history, _) in jobs.items() if not drafts[slot]}
        self.drafter.settle(dict.fromkeys(undrafted, 0))  # nothing to verify: they decode plainly below
        plain = plain | undrafted
        slots = sorted(plain)
        if slots:
            self.drafter.follow(slots, [plain[slot] for slot in slots])
        out: dict[int, tuple[list[int], np.ndarray, int, int]] = {}
        verifying = sorted(slot for slot in jobs if drafts[slot])
        if not verifying:
            begun = self.clock()  # the target's step alone: a request switched off no longer runs the draft
            for slot, row in zip(slots, self.target.decode(slots, [plain[slot] for slot in slots])):
                out[slot] = ([], row[None], 0, 0)
            self.plain_at[len(slots)] = _average(self.plain_at.get(len(slots)), self.clock() - begun)
            return out
        fed = {slot: [jobs[slot][0][-1], *drafts[slot]] for slot in verifying} | {slot: [plain[slot]] for slot in slots}
        width = max(len(ids) for ids in fed.values())
        order = sorted(fed)
        before = {slot: self.target.slot_length(slot) for slot in order}
        begun = self.clock()
        rows_of = dict(zip(order, self.target.extend_many(order, [ids + ids[-1:] * (width - len(ids))
                                                                  for ids in (fed[slot] for slot in order)])))
        if self.plain_at:
            ratio = (self.clock() - begun) / _between(self.plain_at, n)
            self.verify_at[n, width] = _average(self.verify_at.get((n, width)), ratio)
        kept: dict[int, int] = {}
        for slot in slots:
            out[slot] = ([], rows_of[slot][:1], 0, 0)
            self.target.truncate(slot, before[slot] + 1)
        for slot in verifying:
            proposal, rows = drafts[slot], rows_of[slot]
            choices = (constraints[slot].greedy(rows[:len(proposal) + 1], proposal) if slot in constraints
                       else [int(np.argmax(row)) for row in rows[:len(proposal) + 1]])
            agree = min(len(proposal), len(choices))
            accepted = next((i for i in range(agree) if proposal[i] != choices[i]), agree)
            # Token i handed out (an accepted draft equals the target's choice) came from row i;
            # a grammar that completes inside the drafts ends the output there.
            tokens = [*proposal[:accepted], *choices[accepted:accepted + 1]]
            out[slot] = (tokens, rows[:len(tokens)], len(proposal), accepted)
            self.target.truncate(slot, before[slot] + 1 + accepted)  # [last, d1 .. d_accepted]; next feeds choices[accepted]
            kept[slot] = 1 + accepted
        self.drafter.settle(kept)
        self._batch = n
        if self.plain_at:  # the turn's time over a plain step of as many, shared by those that speculated
            extra = (self.clock() - started) / _between(self.plain_at, n) - 1
            self.breakeven_at[n] = _average(self.breakeven_at.get(n), extra * n / len(verifying))
        return out


def _between(timed: dict[int, float], n: int) -> float:
    """The value at batch size n from the sizes timed: linear between them, past them the nearest."""
    sizes = sorted(timed)
    return float(np.interp(n, sizes, [timed[m] for m in sizes]))


def _average(mean: float | None, sample: float, weight: float = 0.2) -> float:
    """An exponential moving average: recent steps count most (the batch changes as requests come and go)."""
    return sample if mean is None else (1 - weight) * mean + weight * sample


def vocabulary(session: Session) -> int | str | None:
    """The width of a decoder's logits."""
    name = session.cache.logits if session.cache else None
    return next((v.type.shape[-1] for v in session.graph.outputs if v.name == name), None)


def predicted_speedup(acceptance: float, k: int, target_plan: Plan, draft_plan: Plan | None = None) -> float:
    """Tokens per second with speculation over tokens per second without, on the plan's target,
    at a per-token acceptance rate a and k drafts a step: a step hands out E = (1 - a^(k+1)) /
    (1 - a) tokens per sequence (the accepted drafts and the target's own token); see
    `speedup_on_target`."""
    a = min(max(acceptance, 0.0), 1.0)
    tokens = k + 1 if a == 1.0 else (1 - a ** (k + 1)) / (1 - a)
    return speedup_on_target(tokens, k, target_plan, draft_plan)


def speedup_on_target(tokens: float, drafts: float, target_plan: Plan, draft_plan: Plan | None = None) -> float:
    """The speedup on the plan's target of steps that each hand out `tokens` per sequence from
    `drafts` drafts (a server's measured means: 1 + accepted / verifications, and drafted /
    verifications). A step costs `drafts` draft steps plus one target step over drafts + 1
    positions per sequence: the draft's simulated decode at its batch, and the target's verify
    step (`Prediction.verify`: each sequence's cache read once for its positions), linear in
    the drafts between the timed counts. A plan compiled before verify steps were timed reads
    its batch sweep at B(drafts + 1) instead, which reads the cache drafts + 1 times: an
    overestimate of the verify, so the speedup is a low one.

    A draft compiled onto chiplets of its own (`drafts_beside`: the same target, no chiplet in
    common; a tenant, or another card, as in the Corsair drafting deployment) runs while the target
    verifies: the running sequences in two halves, one drafting while the other is verified, so a
    step costs the longer of the two instead of their sum (each at the full batch, an upper bound
    on the halves' cost)."""
    step_s = target_plan.prediction.time_per_token_s
    draft_s = draft_plan.prediction.time_per_token_s if draft_plan is not None else 0.0  # n-gram: host lookup
    verify_s = verify_step_s(target_plan, drafts)
    if draft_plan is not None and drafts_beside(target_plan, draft_plan):
        return tokens * step_s / max(drafts * draft_s, verify_s)
    return tokens * step_s / (drafts * draft_s + verify_s)


def drafts_beside(target_plan: Plan, draft_plan: Plan) -> bool:
    """Whether the draft computes on chiplets of its own: both plans for the same target, none of
    their chiplets shared. (Plans for different targets may share a card: counted as in series.)"""
    return (target_plan.target_name == draft_plan.target_name
            and not set(target_plan.chiplets) & set(draft_plan.chiplets))


def verify_step_s(plan: Plan, k: float) -> float:
    """The target's step verifying k drafts per sequence at its compiled batch (see `speedup_on_target`)."""
    timed = {p.positions: p.time_per_token_s for p in plan.prediction.verify if p.fits}
    if timed:
        return _along({1: plan.prediction.time_per_token_s} | timed, k + 1)
    return _step_at(plan, plan.workload.batch * (k + 1)) or plan.prediction.time_per_token_s * (k + 1)


def _step_at(plan: Plan, batch: float) -> float | None:
    """The decode step at `batch` from the plan's sweep (at its compiled context); None past the
    last batch that fits when only one was swept."""
    context = plan.workload.context
    swept = {p.batch: p.time_per_token_s for p in plan.prediction.sweep if p.fits and p.context == context}
    swept[plan.workload.batch] = plan.prediction.time_per_token_s  # the compiled point itself
    return _along(swept, batch) if batch <= max(swept) or len(swept) >= 2 else None


def _along(points: dict[int, float], x: float) -> float:
    """Linear between the points, and past the last one along the line through the last two
    (never falling)."""
    xs = sorted(points)
    if x <= xs[-1] or len(xs) < 2:
        return float(np.interp(x, xs, [points[p] for p in xs]))
    x0, x1 = xs[-2:]
    return points[x1] + max(0.0, (points[x1] - points[x0]) / (x1 - x0)) * (x - x1)
