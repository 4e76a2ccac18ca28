"""The contract between the runtime and its backends: the one module of `backends/` the runtime imports.

    backend = backend_class("sim")(program, graph, WeightStore(artifact, graph), sram_bytes=...)
    outputs, counts = backend.run(feeds)          # RunCounts; a RuntimeFault names stream and step
    with backend.precedence.first(): ...          # this thread's steps go before the others'

- faults: `RuntimeFault` (a plan broke a rule while it ran), `RankFailed` (another rank of a
  multi-card run did), `NotRunnableError` (this artifact or device cannot run here);
- `WeightStore`: the tiles and initializers a run reads, from the artifact, each read once;
- `Precedence`: how the serving engine lets one step go before the steps in flight;
- `RunCounts`: what a run did;
- `backend_class(device)` and `open_cluster(...)`: the backends themselves, imported only when
  asked for (the cuda backend imports torch).

Imports run one way: `aviatorc.runtime` -> this module -> the backend modules.
"""

from __future__ import annotations

import importlib
import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from aviatorc.errors import AviatorError, OptionError
from aviatorc.ir import Graph
from aviatorc.ir.ops.quant import ROLES
from aviatorc.plan.artifact import Artifact
from aviatorc.plan.ir import Program, tile_name
from aviatorc.plan.plan import PlannedTile
from aviatorc.quant.tiles import dequantize_packed

if TYPE_CHECKING:
    from aviatorc.target import Target

# -- faults ---------------------------------------------------------------------------------------


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


# -- what a run did -------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockRun:
    """One mixture-of-experts block in one run: the experts that ran (those some token was routed
    to) and, from the second block on, how well pre-gating named them (`aviatorc.routing.PreGating`:
    this block's router on the hidden state that entered the block before's)."""

    layer: int
    experts: int
    ran: int
    routed: int  # (token, expert) pairs the router chose
    predicted: int | None = None  # of those, the pairs pre-gating named; None: not predicted here


@dataclass
class RunCounts:
    """What one run did: instructions by op, bytes moved, peak SRAM per chiplet, the MoE blocks'
    experts, and figures only some backends have (`extra`: the cuda backend's timings under "cuda")."""

    instructions: dict[str, int] = field(default_factory=dict)
    bytes_loaded: int = 0
    bytes_sent: int = 0
    peak_sram_bytes: dict[int, int] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    experts: tuple[BlockRun, ...] = ()


# -- precedence -----------------------------------------------------------------------------------


class Precedence:
    """One thread's step has a session's device before the steps in flight on others.

        with session.precedence.first():        # in the thread that must not wait
            logits = session.prefill(slot, ids)

    The backends call `checkpoint()` between instructions: it returns at once unless another
    thread holds precedence, and then waits until that thread is done. The serving engine
    prefills an interactive arrival this way while a background decode step is in flight: on the
    target the step would end within a millisecond and the prefill would follow it; on the
    simulator the step takes hundreds, so it pauses at its next instruction instead of sharing the
    CPU with the prefill. Nothing is held across a checkpoint, so a paused step cannot block the
    one that goes first."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._holders = Counter[int]()  # thread id -> nesting depth
        self.held = False  # read without the lock on the hot path: a stale False only delays a pause

    @contextmanager
    def first(self) -> Iterator[None]:
        """While inside, steps of this session running on other threads pause at their next instruction."""
        me = threading.get_ident()
        with self._changed:
            self._holders[me] += 1
            self.held = True
        try:
            yield
        finally:
            with self._changed:
                self._holders[me] -= 1
                if not self._holders[me]:
                    del self._holders[me]
                self.held = bool(self._holders)
                self._changed.notify_all()

    def checkpoint(self) -> None:
        """Wait while another thread holds precedence (a no-op when none does)."""
        if not self.held:
            return
        me = threading.get_ident()
        with self._changed:
            while self._holders and me not in self._holders:
                self._changed.wait()


# -- weights ----------------------------------------------------------------------------------------


class WeightStore:
    """The weights a run reads: tiles (float32, dequantized) and the graph's other initializers,
    each read once per session.

    A tile is stored as the `DequantizeWeight` slots of its own [k, n] layout (`t<i>.values`,
    `t<i>.scale`, ...; see `aviatorc.plan.weights`), so one tile is dequantized without the rest
    of its weight, with the IR's own kernel (`aviatorc.quant.tiles.dequantize_packed`): a tile
    read back here is exactly those columns (or rows) of the whole weight read back by the
    interpreter."""

    def __init__(self, artifact: Artifact, graph: Graph) -> None:
        self.artifact = artifact
        self.graph = graph
        self.tiles: tuple[PlannedTile, ...] = artifact.plan.tiles
        self.names = set(artifact.tensor_names())
        self._tiles: dict[int, np.ndarray] = {}
        self._initializers: dict[str, np.ndarray | None] = {}
        self._columns: dict[tuple[tuple[tuple[int, int, int], ...], np.dtype], np.ndarray] = {}
        self.tile_bytes_read = 0

    def tile(self, index: int) -> np.ndarray:
        """The tile's float32 [k1 - k0, n1 - n0] matrix (an embedding tile: its table rows)."""
        cached = self._tiles.get(index)
        if cached is None:
            self.prefetch([index])
            cached = self._tiles[index]
        return cached

    def prefetch(self, indices: Iterable[int]) -> None:
        """Read and dequantize the tiles `indices` not read yet, under one opening of the weights file."""
        wanted = sorted(set(indices) - set(self._tiles))
        stored = {i: [name if name in self.names else None for name in (f"{tile_name(i)}.{role}" for role in ROLES)]
                  for i in wanted}
        # One tile's arrays at a time, in the order asked for: the packed model is never all in memory.
        with closing(self.artifact.tensors(name for i in wanted for name in stored[i] if name is not None)) as arrays:
            for i in wanted:
                info = self.tiles[i]
                packed: list[np.ndarray | None] = [next(arrays)[1] if name is not None else None for name in stored[i]]
                while packed and packed[-1] is None:
                    packed.pop()
                self.tile_bytes_read += sum(a.nbytes for a in packed if a is not None)
                k, n = info.rows[1] - info.rows[0], info.cols[1] - info.cols[0]
                self._tiles[i] = np.asarray(dequantize_packed(info.format, packed, k, n))

    def columns(self, strips: tuple[tuple[int, int, int], ...], dtype: np.dtype) -> np.ndarray:
        """Columns [a, b) of each tile of `strips` ((tile, a, b), ...) side by side, as one
        contiguous matrix of `dtype`: the weight of one GEMM, cached for the session (a plan's
        programs read the same strips)."""
        key = (strips, np.dtype(dtype))
        found = self._columns.get(key)
        if found is None:
            parts = [self.tile(t)[:, a:b] for t, a, b in strips]
            if len(parts) == 1 and parts[0].dtype == dtype and parts[0].flags.c_contiguous:
                found = parts[0]  # a whole tile at its own dtype: the tile itself, no second copy
            else:
                found = np.concatenate(parts, axis=1, dtype=dtype, casting="unsafe")
            self._columns[key] = found
        return found

    def initializer(self, name: str) -> np.ndarray | None:
        """An initializer's array: a constant printed in graph.ir, or `init.<name>` of the weights
        file; None for a weight the tiles stand for (only its tiles are stored)."""
        if name not in self._initializers:
            value = self.graph.initializers.get(name)
            array: np.ndarray | None = None
            if value is not None and value.data is not None and value.data.available:
                array = value.data.load()
            elif f"init.{name}" in self.names:
                array = self.artifact.tensor(f"init.{name}")
            self._initializers[name] = array
        return self._initializers[name]


# -- the backends -------------------------------------------------------------------------------------


class Backend(Protocol):
    """What a session drives: one program of a plan, run as often as asked."""

    precedence: Precedence
    link_dtype: str  # the plan's `--link-dtype`: "int8" rounds every activation sent between chiplets

    def run(self, feeds: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], RunCounts]: ...


class BackendFactory(Protocol):
    def __call__(self, program: Program, graph: Graph, weights: WeightStore, *, sram_bytes: int,
                 replay: bool = True) -> Backend: ...


# The backends by device, named rather than imported: a backend module imports this contract, and
# loading one (the cuda backend imports torch) waits until a session asks for its device.
BACKENDS = {"sim": "aviatorc.backends.sim:SimBackend", "cuda": "aviatorc.backends.cuda:CudaBackend"}
CLUSTER = "aviatorc.backends.cluster:Cluster"
DEVICES = tuple(BACKENDS)


def _resolve(spec: str) -> Any:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def backend_class(device: str) -> BackendFactory:
    """The backend that runs a plan's programs on `device` ("sim" or "cuda")."""
    if device not in BACKENDS:
        raise OptionError(f"unknown device '{device}'", hint=f"choose one of {', '.join(DEVICES)}")
    factory: BackendFactory = _resolve(BACKENDS[device])
    return factory


def open_cluster(artifact: Artifact, graph: Graph, target: Target, weights: WeightStore, world: int, *,
                 timeout_s: float) -> Any:
    """A multi-card run: one rank per card on torch.distributed (`aviatorc.backends.cluster`)."""
    return _resolve(CLUSTER)(artifact, graph, target, weights, world, timeout_s=timeout_s)
