"""Errors a user can cause.

Every error that bad input, a bad option or an impossible request can raise derives from
`AviatorError`. It carries structured fields (file, node, op, hint) so tests can assert on
them and the CLI can print one line without a traceback. Internal bugs stay ordinary
exceptions and keep their tracebacks.
"""

from __future__ import annotations

from typing import Any


class AviatorError(Exception):
    """Base class for everything a user can cause: one readable line, structured fields."""

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        node: str | None = None,
        op: str | None = None,
        hint: str | None = None,
        **fields: Any,
    ) -> None:
        self.message = message
        self.file = file
        self.node = node
        self.op = op
        self.hint = hint
        self.fields = fields
        super().__init__(self.__str__())

    def __str__(self) -> str:
        where = []
        if self.file:
            where.append(str(self.file))
        if self.node is not None:
            where.append(f"node '{self.node}'" + (f" ({self.op})" if self.op else ""))
        elif self.op:
            where.append(f"op {self.op}")
        text = (": ".join(where) + ": " if where else "") + self.message
        if self.hint:
            text += f"; {self.hint}"
        return text

    def with_file(self, file: str) -> AviatorError:
        """Attach the file being processed when the raiser did not know it."""
        if self.file is None:
            self.file = file
            self.args = (self.__str__(),)
        return self


class ModelFormatError(AviatorError):
    """The model file is malformed: truncated, empty, inconsistent, cyclic."""


class UnsafePathError(AviatorError):
    """A path inside a model points outside the model's folder, or through a link."""


class UnsupportedOpsError(AviatorError):
    """The model uses ops outside aviatorc's op set. `ops` maps op type -> (count, first node)."""

    def __init__(self, ops: dict[str, tuple[int, str]], *, file: str | None = None) -> None:
        self.ops = dict(sorted(ops.items()))
        listing = ", ".join(f"{op} x{count} (first: '{node}')" for op, (count, node) in self.ops.items())
        total = sum(count for count, _ in self.ops.values())
        super().__init__(
            f"{total} node(s) use {len(self.ops)} unsupported op type(s): {listing}",
            file=file,
            hint="see `aviatorc ops` for the supported set",
        )


class VerificationError(AviatorError):
    """The IR breaks an invariant. `context` is the IR text around the bad node."""

    def __init__(self, message: str, *, context: str = "", **kwargs: Any) -> None:
        self.context = context
        super().__init__(message, **kwargs)

    def details(self) -> str:
        return f"{self}\n{self.context}" if self.context else str(self)


class EvaluationError(AviatorError):
    """The interpreter cannot run the graph on these feeds (missing input, shape-only weight)."""


class OptionError(AviatorError):
    """A compile option or argument is invalid."""


class TargetError(AviatorError):
    """A target description is malformed or unknown."""


class InfeasibleError(AviatorError):
    """The request cannot be satisfied on the target (capacity, tile size)."""


class PassError(AviatorError):
    """A pass failed; `history` names the passes that ran before it."""

    def __init__(self, message: str, *, pass_name: str, history: list[str], **kwargs: Any) -> None:
        self.pass_name = pass_name
        self.history = list(history)
        ran = ", ".join(self.history) if self.history else "none"
        super().__init__(f"pass '{pass_name}' failed: {message} (passes before it: {ran})", **kwargs)


class UnsupportedModelError(AviatorError):
    """The model is well-formed but of a kind aviatorc does not build (a model type or class)."""
