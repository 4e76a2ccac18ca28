"""The command line's logging: progress on a terminal, warnings as lines, more with --verbose.

    with configure_logging(quiet=args.quiet, verbose=args.verbose):
        run the command

The library only logs (`aviatorc.progress`); this module is where handlers are installed, on
the "aviatorc" logger, and removed again when the command ends (tests run many commands in
one process). What each mode shows on stderr:

- default: warnings, one `aviatorc: warning:` line each; on a terminal also a live display of
  the stages running (rich, transient: it is gone when the stage ends, so nothing is printed
  twice). Piped, nothing else.
- `--verbose`: every record, the stages' starts and ends as lines with the time since the
  command began (a stage's updates only feed the live display).
- `--quiet`: warnings and errors only.

stdout is never touched here: a summary piped into a file stays there even while the display
draws on the terminal (rich's stdout redirection is off for that reason).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from aviatorc.progress import is_update, progress_of

LOGGER = "aviatorc"


class LineHandler(logging.Handler):
    """Records as `aviatorc: warning: ...` lines on stderr (looked up at each record, so a test's
    capture and the live display's console both see them)."""

    def __init__(self, started: float, display: ProgressHandler | None) -> None:
        super().__init__()
        self.started, self.display = started, display

    def emit(self, record: logging.LogRecord) -> None:
        if is_update(record):
            return
        try:
            text = self.format_line(record)
            if self.display is not None and self.display.live:
                self.display.progress.console.print(text, markup=False, highlight=False)
            else:
                sys.stderr.write(text + "\n")
                sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging's own rule: a broken handler must not stop the program
            self.handleError(record)

    def format_line(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.levelno >= logging.WARNING:
            return f"aviatorc: {record.levelname.lower()}: {message}"
        return f"[{time.perf_counter() - self.started:7.1f} s] {message}"


class ProgressHandler(logging.Handler):
    """Draws the running stages (`record.progress`) as rich progress rows on the terminal."""

    def __init__(self, stream: Any) -> None:
        super().__init__(logging.INFO)
        from rich.console import Console
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        console = Console(file=stream, highlight=False, markup=False)
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[count]}"),
                                 TimeElapsedColumn(), TextColumn("{task.fields[detail]}"), console=console,
                                 transient=True, redirect_stdout=False, redirect_stderr=False)
        self.tasks: dict[int, Any] = {}
        self.live = False

    def emit(self, record: logging.LogRecord) -> None:
        event = progress_of(record)
        if event is None:
            return
        try:
            if event.event == "start":
                if not self.live:  # started per stage, so stdout is never written under a live display
                    self.progress.start()
                    self.live = True
                self.tasks[event.key] = self.progress.add_task(event.description, total=event.total, detail="",
                                                               count=_count(event.completed, event.total))
            elif event.key in self.tasks:
                task = self.tasks[event.key]
                if event.event == "update":
                    self.progress.update(task, completed=event.completed, total=event.total, detail=event.detail,
                                         count=_count(event.completed, event.total))
                else:
                    self.progress.remove_task(self.tasks.pop(event.key))
                    if not self.tasks:
                        self.stop()
        except Exception:  # noqa: BLE001 - as LineHandler
            self.handleError(record)

    def stop(self) -> None:
        if self.live:
            self.progress.stop()
            self.live = False
        self.tasks.clear()


@contextmanager
def configure_logging(*, quiet: bool = False, verbose: bool = False, stream: Any = None) -> Iterator[None]:
    """Install the command line's handlers on the "aviatorc" logger for the duration of a command.

    `stream`: where the live display draws (default: stderr, and only when it is a terminal)."""
    logger = logging.getLogger(LOGGER)
    stream = sys.stderr if stream is None else stream
    terminal = not quiet and _is_terminal(stream)
    display = ProgressHandler(stream) if terminal else None
    lines = LineHandler(time.perf_counter(), display)
    lines.setLevel(logging.DEBUG if verbose else logging.WARNING)
    saved = logger.level, logger.propagate
    logger.setLevel(logging.DEBUG if verbose else logging.INFO if terminal else logging.WARNING)
    logger.propagate = False  # the command's own lines, not also a root handler's
    handlers: list[logging.Handler] = [lines] if display is None else [display, lines]
    for handler in handlers:
        logger.addHandler(handler)
    try:
        yield
    finally:
        if display is not None:
            display.stop()
        for handler in handlers:
            logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


def stdout_console() -> Any:
    """The rich console a command prints its result on: no markup (paths and model names are
    printed as they are: "[v2]" is not a style tag), and off a terminal as wide as its lines
    (a file or a pipe gets whole lines, not 80-column wrapping). A reader that stops early
    (`aviatorc report ART | head`) raises BrokenPipeError, which the command line answers with
    status 0, where rich's own handler would exit 1."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True
            raise BrokenPipeError

    wide = None if _is_terminal(sys.stdout) else UNWRAPPED_WIDTH
    return _Console(highlight=False, markup=False, width=wide)


UNWRAPPED_WIDTH = 100_000  # characters: rich needs a width; off a terminal no line comes near it


def _count(completed: int, total: int | None) -> str:
    return f"{completed}/{total}" if total is not None else ""  # a stage without a count shows only its time


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or file-like stream without isatty
        return False
