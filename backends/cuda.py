"""The `cuda` backend: a plan's instruction streams run on a GPU, with the plan's own weight traffic.

    backend = CudaBackend(program, graph, weights, sram_bytes=target.chiplet.sram_bytes)
    outputs, counts = backend.run(feeds)
    counts.extra["cuda"]        # copy_ms, compute_ms, busy_ms, wall_ms, overlap, ...

This is the sim backend (`aviatorc.backends.sim`) given memory and time. The sim's run executes
the same instructions in the same order and checks the same rules (`_CudaRun` subclasses its
`_Run`); this module only adds what each instruction does to the GPU, after the sim's checks:

- LPDDR: the tiles the `WeightStore` dequantizes (float32), held in pinned host memory, shared
  by every program of a session.
- SRAM: one device buffer pool. Each chiplet has a region of it: its resident tiles at fixed
  offsets, filled once before the first run (the cold start), then its staging slots, placed
  first-fit in the order its stream loads and frees them (placed once, at construction: a
  chiplet's loads and frees are all in its own stream, so the order is fixed). The pool holds
  float32 tiles, so for a quantized plan it is larger than the SRAM the plan budgets.
- `load BUF`: an asynchronous host-to-device copy on the copy stream, between two events; the
  second is BUF's event. `wait BUF`: the compute stream waits for that event.
- `free BUF`: an event on the compute stream; the next copy into memory overlapping BUF's slot
  waits for it, so a copy never overwrites a tile that a queued kernel still reads.
- `signal E` / `wait E`: an event recorded on / waited for by the compute stream.
- `compute` of a MatMul column strip or a Gather row range (the instructions that read weight
  buffers): the kernel on the compute stream, reading the tile's slot in the pool. Every other
  compute (whole nodes: norms, softmax, attention, shape ops) runs the IR's numpy kernel on the
  host exactly as the sim does, so those values are the sim's bit for bit. Activations are
  host arrays: a strip's input goes to the device and its result comes back.
- `send` / `recv`: host arrays, as in the sim (every chiplet shares the one GPU).

The figures (`counts.extra["cuda"]`) come from the events: `copy_ms` and `compute_ms` sum the
copies' and the strip kernels' spans, `busy_ms` is the union of all those spans and `wall_ms`
the span from the run's first event to its last. `overlap` = (copy + compute - busy) /
min(copy, compute): the share of the shorter activity hidden under the other (0 with no copies).
It uses `busy` rather than `wall` because the host-run nodes leave the GPU idle in gaps that
are neither copying nor computing, and the formula would count those as lost overlap.

`device="cpu"` is a debug switch: the same code path with the pool in host memory, the copies
and kernels run when issued and the events host clocks (overlap 0 by construction), so the
stream and event logic is exercised, and its outputs compared with the sim's, without a GPU.

torch is imported at module level: this module is only imported when a session asks for cuda.

Not handled: whole-node kernels on the GPU (they need a torch kernel per op), dequantizing on
the device (tiles are copied as float32, not in their stored format), the KV cache in device
memory (staged KV chunks are not copied: the cache lives in the session), a stream pair per
chiplet, and weight dtypes torch cannot take from numpy (bfloat16 strips run on the host).
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from aviatorc.backends.contract import NotRunnableError, WeightStore
from aviatorc.backends.sim import SimBackend, _Run

from aviatorc.ir import Graph
from aviatorc.plan.ir import Free, Load, Program, Signal, Wait

ALIGN = 64  # slot offsets in float32 elements (256 bytes): aligned copies and GEMM operands
STREAMS = ("copy", "compute")

# Pinned tiles by WeightStore: a session's programs (prefill, decode) share one host copy.
_PINNED: weakref.WeakKeyDictionary[WeightStore, dict[int, torch.Tensor]] = weakref.WeakKeyDictionary()


def cuda_missing() -> str | None:
    """Why the cuda device cannot run here, or None when it can."""
    if torch.cuda.is_available():
        return None
    build = f"a CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU-only build"
    return (f"device 'cuda' needs a CUDA GPU and a CUDA build of torch; this torch is {torch.__version__} "
            f"({build}) with no CUDA device")


# -- the two timelines: CUDA streams and events, or their host stand-ins ---------------------


class _Timeline(Protocol):
    """One run's events on the two streams. A mark is an index into the run's events."""

    def record(self, stream: str) -> int: ...
    def wait(self, stream: str, mark: int) -> None: ...
    def ms(self, first: int, then: int) -> float: ...
    def on(self, stream: str) -> contextlib.AbstractContextManager[Any]: ...
    def synchronize(self) -> None: ...


class _CudaTimeline:
    """CUDA events on the backend's copy and compute streams."""

    def __init__(self, streams: dict[str, torch.cuda.Stream], device: torch.device) -> None:
        self.streams, self.device = streams, device
        self.events: list[torch.cuda.Event] = []

    def record(self, stream: str) -> int:
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.streams[stream])
        self.events.append(event)
        return len(self.events) - 1

    def wait(self, stream: str, mark: int) -> None:
        self.streams[stream].wait_event(self.events[mark])

    def ms(self, first: int, then: int) -> float:
        return float(self.events[first].elapsed_time(self.events[then]))

    def on(self, stream: str) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(self.streams[stream])

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


class _HostTimeline:
    """The CPU debug device: work runs when issued, so a wait has nothing to wait for and an
    event is the host clock when it was recorded."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def record(self, stream: str) -> int:
        self.times.append(time.perf_counter())
        return len(self.times) - 1

    def wait(self, stream: str, mark: int) -> None:
        pass

    def ms(self, first: int, then: int) -> float:
        return (self.times[then] - self.times[first]) * 1e3

    def on(self, stream: str) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def synchronize(self) -> None:
        pass


# -- the pool ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Slot:
    """Where a tile lies in the pool: `offset` (float32 elements) and its [rows, cols] shape."""

    offset: int
    rows: int
    cols: int

    @property
    def stop(self) -> int:
        return self.offset + self.rows * self.cols


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _first_fit(live: list[_Slot], base: int, size: int) -> int:
    """The lowest offset >= base where `size` elements fit between the live slots."""
    at = base
    for slot in sorted(live, key=lambda s: s.offset):
        if slot.offset - at >= size:
            return at
        at = max(at, _aligned(slot.stop))
    return at


@dataclass
class _Layout:
    """The pool's plan: resident slots by (chiplet, buffer), staging slots by (chiplet, step of
    the load), and the elements the whole pool needs."""

    resident: dict[tuple[int, str], _Slot]
    staging: dict[tuple[int, int], _Slot]
    elements: int
    per_chiplet: dict[int, int]


def _layout(program: Program, weights: WeightStore) -> _Layout:
    """Place every weight tile the program holds or stages. A malformed sequence (a double load,
    a free of what is not live) is skipped here: the run faults on it with the sim's rule."""
    resident: dict[tuple[int, str], _Slot] = {}
    staging: dict[tuple[int, int], _Slot] = {}
    per_chiplet: dict[int, int] = {}
    base = 0
    for c in sorted({b.chiplet for b in program.buffers.values()} | set(program.streams)):
        at = base
        for b in sorted(program.buffers.values(), key=lambda b: b.name):
            tile = _tile_of(weights, b.tile)
            if b.chiplet == c and b.kind == "resident" and tile is not None:
                slot = _Slot(at, tile.rows[1] - tile.rows[0], tile.cols[1] - tile.cols[0])
                resident[(c, b.name)] = slot
                at = _aligned(slot.stop)
        staged_from, end = at, at
        live: dict[str, _Slot] = {}
        for step, ins in enumerate(program.streams.get(c, [])):
            if not isinstance(ins, (Load, Free)):
                continue
            buffer = program.buffers.get(ins.buf)
            tile = _tile_of(weights, buffer.tile) if buffer is not None else None
            if buffer is None or tile is None or buffer.chiplet != c or buffer.kind != "staging":
                continue
            if isinstance(ins, Free):
                live.pop(buffer.name, None)
            elif buffer.name not in live:
                rows, cols = tile.rows[1] - tile.rows[0], tile.cols[1] - tile.cols[0]
                slot = _Slot(_first_fit(list(live.values()), staged_from, rows * cols), rows, cols)
                live[buffer.name] = staging[(c, step)] = slot
                end = max(end, _aligned(slot.stop))
        per_chiplet[c] = end - base
        base = end
    return _Layout(resident, staging, base, per_chiplet)


def _tile_of(weights: WeightStore, tile: int | None) -> Any:
    """The plan's record of a weight tile (None for a KV block, scratch, or an index out of range)."""
    return weights.tiles[tile] if tile is not None and 0 <= tile < len(weights.tiles) else None


# -- the backend ---------------------------------------------------------------------------


class CudaBackend(SimBackend):
    """Runs one program of a plan on a GPU (`device="cuda"`), or on the CPU through the same
    streams-and-events code (`device="cpu"`, a debug switch). Same constructor and `run` as the
    sim; `counts.extra["cuda"]` holds the run's figures."""

    replays = False  # every run issues its copies and kernels and times them

    def __init__(self, program: Program, graph: Graph, weights: WeightStore, *, sram_bytes: int,
                 replay: bool = False, device: str = "cuda") -> None:
        if device not in ("cuda", "cpu"):
            raise NotRunnableError(f"the cuda backend runs on 'cuda' (or 'cpu' to debug), not '{device}'")
        if device == "cuda" and (missing := cuda_missing()):
            raise NotRunnableError(missing, hint="use device='sim' to run the same plan on the CPU")
        super().__init__(program, graph, weights, sram_bytes=sram_bytes)
        self.device = torch.device(device)
        self.layout = _layout(program, weights)
        self.pool = torch.empty(self.layout.elements, dtype=torch.float32, device=self.device)
        self.resident = {key: self._view(slot) for key, slot in self.layout.resident.items()}
        # Named apart from the sim's `streams` (the program's instruction streams, by chiplet).
        self.cuda_streams = {name: torch.cuda.Stream(self.device) for name in STREAMS} if device == "cuda" else {}
        self._cold_start_ms: float | None = None

    def _view(self, slot: _Slot) -> torch.Tensor:
        return self.pool[slot.offset:slot.stop].view(slot.rows, slot.cols)

    def pinned(self, tile: int) -> torch.Tensor:
        """The tile's float32 matrix in host memory the copy engine reads (pinned on a GPU)."""
        tiles = _PINNED.setdefault(self.weights, {})
        found = tiles.get(tile)
        if found is None:
            host = torch.from_numpy(np.ascontiguousarray(self.weights.tile(tile), dtype=np.float32))
            found = tiles[tile] = host.pin_memory() if self.device.type == "cuda" else host
        return found

    def tile_of(self, buffer: str) -> int:
        tile = self.program.buffers[buffer].tile
        assert tile is not None  # only weight buffers get slots (`_layout`)
        return tile

    def timeline(self) -> _Timeline:
        return _CudaTimeline(self.cuda_streams, self.device) if self.cuda_streams else _HostTimeline()

    def _cold_start(self) -> None:
        """Before the first run: resident tiles into their slots, every staged tile pinned (its
        first copy would otherwise wait for the host to read, dequantize and pin it)."""
        start = time.perf_counter()
        for (_, name), view in self.resident.items():
            view.copy_(self.pinned(self.tile_of(name)))
        for (c, step) in self.layout.staging:
            load = self.program.streams[c][step]
            assert isinstance(load, Load)
            self.pinned(self.tile_of(load.buf))
        if self.cuda_streams:
            torch.cuda.synchronize(self.device)
        self._cold_start_ms = (time.perf_counter() - start) * 1e3

    def _start_run(self, feeds: dict[str, np.ndarray]) -> _Run:
        cold_ms = 0.0
        if self._cold_start_ms is None:
            self._cold_start()
            cold_ms = self._cold_start_ms or 0.0
        return _CudaRun(self, feeds, cold_ms)


class _CudaRun(_Run):
    """The sim's run, each instruction also issued to the streams (after the sim's checks)."""

    def __init__(self, backend: CudaBackend, feeds: dict[str, np.ndarray], cold_start_ms: float) -> None:
        super().__init__(backend, feeds)
        self.gpu = backend
        self.cold_start_ms = cold_start_ms
        self.timeline = backend.timeline()
        self.slots: dict[tuple[int, str], torch.Tensor] = dict(backend.resident)
        self.placed: dict[tuple[int, str], _Slot] = {}
        self.landed: dict[tuple[int, str], int] = {}  # (chiplet, staging buffer) -> its copy's last mark
        self.signals: dict[str, int] = {}
        self.freed: dict[int, list[tuple[_Slot, int]]] = {}  # chiplet -> freed slots not yet reused
        self.copies: list[tuple[int, int]] = []
        self.kernels: list[tuple[int, int]] = []
        self.copied_bytes = 0
        self.start = self.timeline.record("compute")
        self.timeline.wait("copy", self.start)

    # -- the plan's memory and events --------------------------------------------------------

    def on_load(self, c: int, step: int, ins: Load, now: float) -> float:
        super().on_load(c, step, ins, now)
        slot = self.gpu.layout.staging.get((c, step))
        if slot is None:  # a staged KV chunk: the cache is the session's, nothing to copy
            return now
        name = ins.buf
        kept = []
        for freed, mark in self.freed.get(c, []):
            if freed.offset < slot.stop and slot.offset < freed.stop:  # reuses memory a kernel may still read
                self.timeline.wait("copy", mark)
            else:
                kept.append((freed, mark))
        self.freed[c] = kept
        source = self.gpu.pinned(self.gpu.tile_of(name))
        view = self.gpu._view(slot)
        with self.timeline.on("copy"):
            begin = self.timeline.record("copy")
            view.copy_(source, non_blocking=True)
            end = self.timeline.record("copy")
        self.copies.append((begin, end))
        self.copied_bytes += source.numel() * source.element_size()
        self.slots[(c, name)], self.placed[(c, name)], self.landed[(c, name)] = view, slot, end
        return now

    def on_wait(self, c: int, step: int, ins: Wait, now: float) -> float | None:
        after = super().on_wait(c, step, ins, now)
        if after is not None:
            mark = self.landed.get((c, ins.event), self.signals.get(ins.event))
            if mark is not None:
                self.timeline.wait("compute", mark)
        return after

    def on_free(self, c: int, step: int, ins: Free, now: float) -> float:
        super().on_free(c, step, ins, now)
        slot = self.placed.pop((c, ins.buf), None)
        self.slots.pop((c, ins.buf), None)
        self.landed.pop((c, ins.buf), None)
        if slot is not None:
            self.freed.setdefault(c, []).append((slot, self.timeline.record("compute")))
        return now

    def on_signal(self, c: int, step: int, ins: Signal, now: float) -> float:
        self.signals[ins.event] = self.timeline.record("compute")
        return super().on_signal(c, step, ins, now)

    # -- the kernels that read weight buffers ------------------------------------------------

    def _strip_product(self, c: int, buf: str, slot: int, tile: int, a: int, b: int, dtype: np.dtype) -> int:
        x = self.env[slot]
        out_dtype = np.result_type(x.dtype, dtype)
        if not (_torch_takes(x.dtype) and _torch_takes(dtype)):
            return super()._strip_product(c, buf, slot, tile, a, b, dtype)
        with self.timeline.on("compute"):
            x_d = self._to_device(x).to(_torch_dtype(out_dtype))
            begin = self.timeline.record("compute")
            # The weight rounded to its own dtype, then computed in the result's, as numpy does.
            w_kn = self.slots[(c, buf)][:, a:b].to(_torch_dtype(dtype)).to(_torch_dtype(out_dtype))
            y = torch.matmul(x_d.reshape(-1, x.shape[-1]), w_kn).reshape(*x.shape[:-1], b - a)
            end = self.timeline.record("compute")
            result = y.cpu().numpy()
        self.kernels.append((begin, end))
        return self._new(result.astype(x.dtype, copy=False))

    def _table_rows(self, c: int, buf: str, rows: np.ndarray, index: np.ndarray) -> np.ndarray:  # type: ignore[override]
        slot = self.slots[(c, buf)]
        table = slot if self.b.weights.tiles[self.gpu.tile_of(buf)].is_embedding else slot.T
        with self.timeline.on("compute"):
            index_d = self._to_device(index)
            begin = self.timeline.record("compute")
            found = table[index_d]
            end = self.timeline.record("compute")
            result = found.cpu().numpy()
        self.kernels.append((begin, end))
        return result

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        # A copy for arrays torch cannot share (read-only feeds, negative strides).
        host = array if array.flags.writeable and array.flags.c_contiguous else np.array(array)
        return torch.from_numpy(host).to(self.gpu.device, non_blocking=True)

    # -- the figures -------------------------------------------------------------------------

    def execute(self) -> None:
        try:
            super().execute()
            self.timeline.wait("compute", self.timeline.record("copy"))
            end = self.timeline.record("compute")
        finally:  # a faulted run too: nothing of it may still be queued when the next one starts
            self.timeline.synchronize()
        self.counts.extra["cuda"] = self._figures(end)

    def _figures(self, end: int) -> dict[str, Any]:
        ms = self.timeline.ms
        copies = [(ms(self.start, a), ms(self.start, b)) for a, b in self.copies]
        kernels = [(ms(self.start, a), ms(self.start, b)) for a, b in self.kernels]
        copy_ms = sum(b - a for a, b in copies)
        compute_ms = sum(b - a for a, b in kernels)
        busy_ms = _union_ms(copies + kernels)
        shorter = min(copy_ms, compute_ms)
        overlap = min(1.0, max(0.0, (copy_ms + compute_ms - busy_ms) / shorter)) if shorter > 0 else 0.0
        name = torch.cuda.get_device_name(self.gpu.device) if self.gpu.device.type == "cuda" else "cpu (debug)"
        return {"device": name, "copy_ms": copy_ms, "compute_ms": compute_ms, "busy_ms": busy_ms,
                "wall_ms": ms(self.start, end), "overlap": overlap, "copies": len(copies),
                "copied_bytes": self.copied_bytes, "device_computes": len(kernels),
                "host_computes": self.ops["compute"] - len(kernels),
                "pool_bytes": self.gpu.layout.elements * 4, "cold_start_ms": self.cold_start_ms}


def _union_ms(spans: list[tuple[float, float]]) -> float:
    """The length of the union of [start, stop) spans."""
    total, reach = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop > reach:
            total += stop - max(start, reach)
            reach = stop
    return total


@functools.cache
def _torch_takes(dtype: np.dtype) -> bool:
    try:
        torch.from_numpy(np.empty(0, dtype=dtype))
    except TypeError:
        return False
    return True


@functools.cache
def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype
