"""Errors a run can raise: bad feeds, an artifact that cannot run, a plan that breaks a rule.

All derive from `AviatorError`, so a caller catches one base class. They carry structured
fields (`input`, `stream`, `step`, `rule`) so tests assert on fields, not on wording. The faults
the backends raise are defined with the backend contract (`aviatorc.backends.contract`).
"""

from __future__ import annotations

from typing import Any

from aviatorc.backends.contract import NotRunnableError, RankFailed, RuntimeFault
from aviatorc.errors import AviatorError

__all__ = ["NotRunnableError", "RankFailed", "RuntimeFault", "RuntimeInputError"]


class RuntimeInputError(AviatorError):
    """A feed is missing, unknown, or of the wrong dtype or shape. `input` names it."""

    def __init__(self, message: str, *, input: str, **fields: Any) -> None:  # noqa: A002 - the input's name
        self.input = input
        super().__init__(message, input=input, **fields)
