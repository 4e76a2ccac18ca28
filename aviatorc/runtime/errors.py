"""Errors a run can raise: bad feeds, an artifact that cannot run, a plan that breaks a rule.

All derive from `AviatorError`, so a caller catches one base class. They carry structured
fields (`input`, `stream`, `step`, `rule`) so tests assert on fields, not on wording.
"""

from __future__ import annotations

from typing import Any

from aviatorc.errors import AviatorError


class RuntimeInputError(AviatorError):
    """A feed is missing, unknown, or of the wrong dtype or shape. `input` names it."""

    def __init__(self, message: str, *, input: str, **fields: Any) -> None:  # noqa: A002 - the input's name
        self.input = input
        super().__init__(message, input=input, **fields)


class NotRunnableError(AviatorError):
    """The artifact cannot be run here: compiled shape-only, or a device that is not implemented."""


class RuntimeFault(AviatorError):
    """The plan broke a rule while it ran (the same rules `aviatorc.plan.check` proves statically).

    `rule` names the rule (a `aviatorc.plan.check.CHECKS` key where one fits), `stream` (a
    chiplet) and `step` (an index into its stream) say where, when there is a where. No output
    is returned from a run that faulted."""

    def __init__(self, message: str, *, rule: str, stream: int | None = None, step: int | None = None,
                 **fields: Any) -> None:
        self.rule = rule
        self.stream = stream
        self.step = step
        where = f"stream {stream} step {step}: " if stream is not None and step is not None else ""
        super().__init__(where + message, rule=rule, stream=stream, step=step, **fields)


class RankFailed(RuntimeFault):
    """Another rank of a multi-card run failed (raised, died or went silent): `rank` names it, and
    `rule`, `stream` and `step` say what it reported, when it could."""

    def __init__(self, message: str, *, rank: int, rule: str = "rank-failed", stream: int | None = None,
                 step: int | None = None) -> None:
        self.rank = rank
        super().__init__(f"rank {rank}: {message}", rule=rule, stream=stream, step=step, rank=rank)
