"""`Session`: run a compiled plan on its inputs and get the model's outputs.

    session = aviatorc.Session("build/model.avc")          # a path, an Artifact or a CompileResult
    outputs = session.run({"input_ids": ids, "attention_mask": mask})
    session.stats.wall_s, session.stats.predicted_prefill_s, session.stats.instructions

A session opens the artifact once (`aviatorc.load` checks its hashes and references), reads
its target and graph, and builds the device's backend. `run` checks the feeds against the
graph's inputs (names, dtypes, shapes: the plan was compiled for the graph's own shapes) and
executes the plan's `prefill` program, which processes the whole prompt the graph was built
for. Weight tiles are read and dequantized on first use and kept for the session.

Devices: `sim` (`aviatorc.backends.sim`, the instruction streams on the CPU, checking every
rule of the plan as it runs). `cuda` is not implemented yet.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from aviatorc.errors import OptionError
from aviatorc.ir import Graph
from aviatorc.ir.types import format_shape, numpy_dtype
from aviatorc.plan.artifact import Artifact, load
from aviatorc.runtime.errors import NotRunnableError, RuntimeInputError
from aviatorc.runtime.weights import WeightStore
from aviatorc.target import Target, load_target

DEVICES = ("sim", "cuda")
RUN_PHASE = "prefill"  # a run processes the graph's whole prompt: the prefill program


@runtime_checkable
class SavesArtifact(Protocol):
    """What `aviatorc.compile` returns, as far as a session needs it: it writes its artifact."""

    def save(self, path: str | os.PathLike[str]) -> Path: ...


@dataclass
class RunStats:
    """The last run: what it executed, what it took, and what the plan predicts for the machine."""

    phase: str
    wall_s: float  # this process, on the CPU: not a prediction of the accelerator
    instructions: dict[str, int]  # executed, by op
    bytes_loaded: int  # LPDDR -> SRAM, as the program's loads declare
    bytes_sent: int  # over the links, as the program's sends declare
    peak_sram_bytes: dict[int, int]  # per chiplet: held buffers plus the most staging live at once
    sram_bytes: int  # each chiplet's capacity
    predicted_prefill_s: float  # `aviatorc.schedule.simulate` of the prefill program (one chunk)
    predicted_decode_s: float  # the same of the decode step
    tile_bytes_read: int = 0  # stored tile bytes read from the artifact so far this session
    extra: dict[str, Any] = field(default_factory=dict)


class Session:
    """A compiled plan ready to run. `source`: an artifact path, an `Artifact`, or a
    `CompileResult` (saved to a temporary artifact first: one loading path for all three)."""

    def __init__(self, source: str | os.PathLike[str] | Artifact | SavesArtifact, device: str = "sim") -> None:
        if device not in DEVICES:
            raise OptionError(f"unknown device '{device}'", hint=f"choose one of {', '.join(DEVICES)}")
        if device == "cuda":
            raise NotRunnableError("device 'cuda' is not implemented yet", hint="use device='sim'")
        self._scratch: tempfile.TemporaryDirectory[str] | None = None
        self.artifact = self._open(source)
        if self.artifact.shape_only:
            raise NotRunnableError("compiled shape-only: no weights to run", file=str(self.artifact.path),
                                   hint="compile from a model with its weights")
        if RUN_PHASE not in self.artifact.programs:
            raise NotRunnableError(f"the plan has no {RUN_PHASE} program", file=str(self.artifact.path))
        self.device = device
        self.graph: Graph = self.artifact.graph()
        self.target: Target = load_target(self.artifact.path / "target.toml")
        self.program = self.artifact.programs[RUN_PHASE]
        self.weights = WeightStore(self.artifact, self.graph)
        from aviatorc.backends.sim import SimBackend

        self._backend = SimBackend(self.program, self.graph, self.weights, sram_bytes=self.target.chiplet.sram_bytes)
        self._predicted: dict[str, float] | None = None
        self.stats: RunStats | None = None

    def _open(self, source: str | os.PathLike[str] | Artifact | SavesArtifact) -> Artifact:
        if isinstance(source, Artifact):
            return source
        if isinstance(source, (str, os.PathLike)):
            return load(source)
        if isinstance(source, SavesArtifact):
            self._scratch = tempfile.TemporaryDirectory(prefix="aviatorc-session-")
            return load(source.save(Path(self._scratch.name) / "model.avc"))
        raise OptionError(f"a Session runs an artifact path, an Artifact or a CompileResult, not {type(source).__name__}")

    # -- the model's interface -----------------------------------------------------------

    @property
    def input_names(self) -> list[str]:
        return [v.name for v in self.graph.inputs]

    @property
    def output_names(self) -> list[str]:
        return [v.name for v in self.graph.outputs]

    def run(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """The graph's outputs by name for `feeds` (input name -> array of the input's dtype and
        shape). Raises `RuntimeInputError` for bad feeds and `RuntimeFault` when the plan breaks
        a rule; either way nothing half-run is returned."""
        arrays = self._check_feeds(feeds)
        start = time.perf_counter()
        outputs, counts = self._backend.run(arrays)
        wall_s = time.perf_counter() - start
        predicted = self._predictions()
        self.stats = RunStats(RUN_PHASE, wall_s, counts.instructions, counts.bytes_loaded, counts.bytes_sent,
                              counts.peak_sram_bytes, self.target.chiplet.sram_bytes, predicted.get("prefill", 0.0),
                              predicted.get("decode", 0.0), self.weights.tile_bytes_read)
        return outputs

    def _predictions(self) -> dict[str, float]:
        """Each phase's simulated step on the plan's target (computed once, after a run succeeded)."""
        if self._predicted is None:
            from aviatorc.schedule import simulate

            self._predicted = {phase: simulate(program, self.target, record=False).makespan_s
                               for phase, program in sorted(self.artifact.programs.items())}
        return self._predicted

    def _check_feeds(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        names = self.input_names
        for name in names:
            if name not in feeds:
                raise RuntimeInputError(f"missing input '{name}'", input=name, hint=f"the inputs are {', '.join(names)}")
        for name in sorted(feeds):
            if name not in names:
                raise RuntimeInputError(f"unknown input '{name}'", input=name, hint=f"the inputs are {', '.join(names)}")
        arrays: dict[str, np.ndarray] = {}
        bound: dict[str, int] = {}
        for value in self.graph.inputs:
            array = np.asarray(feeds[value.name])
            expected = numpy_dtype(value.type.dtype)
            if array.dtype != expected:
                raise RuntimeInputError(f"input '{value.name}' is {array.dtype}, expected {value.type.dtype}",
                                        input=value.name, hint=f"convert it with .astype('{expected}')")
            shape = list(array.shape)
            wrong = array.ndim != value.type.rank
            for size, dim in zip(array.shape, value.type.shape):
                wrong |= isinstance(dim, int) and size != dim
                wrong |= isinstance(dim, str) and bound.setdefault(dim, size) != size
            if wrong:
                raise RuntimeInputError(f"input '{value.name}' has shape {shape}, expected "
                                        f"{format_shape(value.type.shape)}", input=value.name,
                                        hint="the plan runs the shapes it was compiled for; recompile for others")
            arrays[value.name] = array
        return arrays
