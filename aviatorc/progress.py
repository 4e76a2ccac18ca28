"""Progress of long stages, through standard `logging`.

    _logger = logging.getLogger("aviatorc.partition")
    with stage(_logger, "partitioning onto corsair (32 chiplets)", total=len(layers)) as task:
        for layer in layers:
            ...
            task.advance(detail=f"layer {layer}: best 12.3 us, gap 0.8%")
        task.finish("3 CP-SAT solves")

A stage is INFO records on its module's logger: its start (the description), updates (at most
`UPDATES_PER_S` a second, so a tight loop pays a clock read, not a record), and its end (with
the seconds it took). Each carries a `Progress` as `record.progress`: a display (the command
line's, on a terminal: `aviatorc.terminal`) draws it; a plain handler prints the start and end
as lines and skips the updates (`is_update`).

The library never configures logging. With no handler, Python drops INFO records and a stage
costs a level check. `echo` hands the start and end lines to a callback as well: the Python
API's `aviatorc.compile(..., log=print)`, which predates logging.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

UPDATES_PER_S = 10.0
_keys = itertools.count()


@dataclass(frozen=True)
class Progress:
    """One event of a stage, as `record.progress`."""

    key: int  # tells apart stages that run at once (a pass inside the compile)
    event: str  # "start", "update" or "end"
    description: str
    completed: int = 0
    total: int | None = None  # None: a stage without a count (a spinner, no bar)
    detail: str = ""  # the latest figure, like "layer 3: best 12.3 us, gap 0.8%"
    seconds: float = 0.0


def progress_of(record: logging.LogRecord) -> Progress | None:
    """The `Progress` a record carries, None for an ordinary record."""
    value = record.__dict__.get("progress")
    return value if isinstance(value, Progress) else None


def is_update(record: logging.LogRecord) -> bool:
    """An update between a stage's start and end: for a display, not for a log file."""
    event = progress_of(record)
    return event is not None and event.event == "update"


class Stage:
    """A running stage: `advance` or `update` it, `finish` names its result."""

    def __init__(self, logger: logging.Logger, description: str, total: int | None,
                 echo: Callable[[str], None] | None) -> None:
        self.logger, self.description, self.total, self.echo = logger, description, total, echo
        self.key = next(_keys)
        self.completed = 0
        self.detail = ""
        self.result = ""
        self.started = time.perf_counter()
        self._last_update = 0.0

    def advance(self, steps: int = 1, *, detail: str | None = None) -> None:
        self.update(completed=self.completed + steps, detail=detail)

    def update(self, *, completed: int | None = None, total: int | None = None, detail: str | None = None) -> None:
        self.completed = self.completed if completed is None else completed
        self.total = self.total if total is None else total
        self.detail = self.detail if detail is None else detail
        if not self.logger.isEnabledFor(logging.INFO):
            return
        now = time.perf_counter()
        if now - self._last_update < 1.0 / UPDATES_PER_S and self.completed != self.total:
            return
        self._last_update = now
        self._emit("update", f"{self.description}: {self.detail or self.completed}")

    def finish(self, result: str) -> None:
        """What the end line says besides the time, like "3 CP-SAT solves, 1 improved"."""
        self.result = result

    def _emit(self, event: str, message: str) -> None:
        seconds = time.perf_counter() - self.started
        self.logger.info(message, extra={"progress": Progress(self.key, event, self.description, self.completed,
                                                              self.total, self.detail, seconds)})
        if self.echo is not None and event != "update":
            self.echo(message)


@contextmanager
def stage(logger: logging.Logger, description: str, *, total: int | None = None,
          echo: Callable[[str], None] | None = None) -> Iterator[Stage]:
    """Log `description` as a stage's start, then (unless it raises) its end with the time taken."""
    task = Stage(logger, description, total, echo)
    if logger.isEnabledFor(logging.INFO) or echo is not None:
        task._emit("start", description)
    try:
        yield task
    except BaseException:
        if logger.isEnabledFor(logging.INFO):  # the display drops the row; the error says what happened
            task.logger.info(f"{description}: failed", extra={"progress": Progress(
                task.key, "end", description, task.completed, task.total, "failed",
                time.perf_counter() - task.started)})
        raise
    if logger.isEnabledFor(logging.INFO) or echo is not None:
        seconds = time.perf_counter() - task.started
        task._emit("end", f"{description}: {task.result + ', ' if task.result else ''}{seconds:.1f} s")


def fan_out(logger: logging.Logger, echo: Callable[[str], None] | None) -> Callable[[str], None]:
    """A `log(text)` that logs `text` at INFO on `logger` and hands it to `echo` too."""

    def log(text: str) -> None:
        logger.info(text)
        if echo is not None:
            echo(text)

    return log
