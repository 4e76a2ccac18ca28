"""Pass infrastructure: a pass base class, a registry, and a manager that verifies after each pass.

A pass declares a kebab-case `name` and a one-line `summary`, and implements `run(graph, ctx)`
returning a `PassResult` that says whether it changed the graph, counts what it did, and
notes (tied to nodes) why it left something alone. The manager times each pass, verifies
the graph after it, prints the IR after a change when asked, and wraps a failure in a
`PassError` naming the passes that ran before it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from aviatorc.errors import AviatorError, OptionError, PassError, VerificationError
from aviatorc.ir import Graph, print_graph, verify
from aviatorc.options import CompileOptions
from aviatorc.progress import stage

_logger = logging.getLogger("aviatorc.passes")


@dataclass(frozen=True)
class Note:
    """Why a pass did or did not do something at a node: answers 'why didn't it fuse?'."""

    node: str
    message: str

    def __str__(self) -> str:
        return f"{self.node}: {self.message}"


@dataclass
class PassResult:
    changed: bool
    stats: dict[str, Any] = field(default_factory=dict)  # counts and figures for the report
    notes: list[Note] = field(default_factory=list)


@dataclass
class PassContext:
    """What passes may read besides the graph: options, the target, calibration data, instruments."""

    options: CompileOptions = field(default_factory=CompileOptions)
    target: Any = None  # aviatorc.target.Target when one is given
    calibration: list[dict[str, Any]] | None = None
    # Each progress line (also logged) and the IR that print_ir_after_change prints (to stdout
    # when no callback is given: the option asks for it to be printed).
    log: Callable[[str], None] | None = None

    def note(self, text: str) -> None:
        """A progress line from a pass: logged at INFO and handed to `log`."""
        _logger.info(text)
        if self.log is not None:
            self.log(text)


class Pass:
    """Base class: subclasses set `name` and `summary` and implement `run`."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    # Whether the graph computes the same function after the pass, up to float rounding. The
    # compiler's accuracy reference is the graph after the exact passes, so that a lossy pass's
    # every rewritten weight (a fused one included) has a same-named float node to compare with.
    exact: ClassVar[bool] = True

    def requires(self, graph: Graph, ctx: PassContext) -> None:
        """Raise an AviatorError when the pass cannot run on this graph with these options."""

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        raise NotImplementedError

    def ensures(self, graph: Graph, ctx: PassContext) -> None:
        """Check the pass's own postcondition (the manager verifies IR invariants anyway)."""


PASSES: dict[str, type[Pass]] = {}


def register_pass(cls: type[Pass]) -> type[Pass]:
    if not cls.name or cls.name in PASSES:
        raise RuntimeError(f"pass {cls.__name__} needs a unique name (got '{cls.name}')")
    PASSES[cls.name] = cls
    return cls


def get_pass(name: str) -> Pass:
    _load_all()
    if name not in PASSES:
        import difflib

        close = difflib.get_close_matches(name, PASSES, n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"known passes: {', '.join(sorted(PASSES))}"
        raise OptionError(f"unknown pass '{name}'", hint=hint)
    return PASSES[name]()


def list_passes() -> list[tuple[str, str]]:
    _load_all()
    return sorted((name, cls.summary) for name, cls in PASSES.items())


def _load_all() -> None:
    """Import the pass modules so they register (kept lazy: passes import heavy helpers)."""
    import importlib
    import pkgutil

    import aviatorc.passes as package

    for module in pkgutil.iter_modules(package.__path__):
        if module.name not in ("manager", "pipeline"):
            importlib.import_module(f"aviatorc.passes.{module.name}")


@dataclass(frozen=True)
class PassRecord:
    """What one pass did: for the compile report."""

    name: str
    seconds: float
    changed: bool
    nodes_before: int
    nodes_after: int
    stats: dict[str, Any]
    notes: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "seconds": round(self.seconds, 4), "changed": self.changed,
                "nodes_before": self.nodes_before, "nodes_after": self.nodes_after,
                "stats": self.stats, "notes": list(self.notes)}


def run_passes(graph: Graph, passes: Sequence[Pass] | Iterable[Pass], ctx: PassContext, *,
               history: Sequence[str] = ()) -> list[PassRecord]:
    """Run passes in order, verifying after each; return a record per pass. `history`: the
    passes that ran on the graph before these (an error names them too)."""
    records: list[PassRecord] = []
    history = list(history)
    for p in passes:
        before = len(graph.nodes)
        start = time.perf_counter()
        try:
            with stage(_logger, f"pass {p.name}") as task:
                p.requires(graph, ctx)
                result = p.run(graph, ctx)
                p.ensures(graph, ctx)
                verify(graph)
                task.finish("changed" if result.changed else "no change")
        except VerificationError as error:
            raise PassError(f"left the graph invalid: {error}", pass_name=p.name, history=history,
                            node=error.node, op=error.op) from error
        except AviatorError as error:
            if isinstance(error, OptionError):
                raise
            raise PassError(str(error), pass_name=p.name, history=history) from error
        seconds = time.perf_counter() - start
        records.append(PassRecord(p.name, seconds, result.changed, before, len(graph.nodes), dict(result.stats),
                                  tuple(str(n) for n in result.notes)))
        history.append(p.name)
        if ctx.log is not None:  # logging has the line already: the stage's end
            ctx.log(f"{p.name}: {'changed' if result.changed else 'no change'} in {seconds:.2f} s")
        if result.changed and ctx.options.print_ir_after_change:
            (ctx.log or print)(f"// IR after {p.name}\n{print_graph(graph)}")
    return records
