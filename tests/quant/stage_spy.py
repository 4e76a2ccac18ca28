"""A spy on the calibration driver the passes call: what each stage's rewrite saw."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from aviatorc.passes import _weights

from aviatorc.ir import Graph
from aviatorc.quant.calibration import ActivationStats
from aviatorc.quant.sequential import SequentialRun


@dataclass
class StageSeen:
    dequantized: int  # DequantizeWeight nodes in the graph when the stage's statistics arrived
    stats: dict[str, ActivationStats]


@dataclass
class DriverCall:
    graph: Graph
    reference: Graph | None
    stages: list[StageSeen]
    run: SequentialRun | None = None


def watch_driver(monkeypatch: pytest.MonkeyPatch) -> list[DriverCall]:
    """Record every call the passes make to `calibrate_sequentially` (it still runs)."""
    calls: list[DriverCall] = []
    driver = _weights.calibrate_sequentially

    def spy(graph, batches, stages, rewrite, **kw):
        call = DriverCall(graph, kw.get("reference"), [])
        calls.append(call)

        def watched(index: int, stats: dict[str, ActivationStats]) -> None:
            call.stages.append(StageSeen(sum(n.op == "DequantizeWeight" for n in graph.nodes), stats))
            rewrite(index, stats)

        call.run = driver(graph, batches, stages, watched, **kw)
        return call.run

    monkeypatch.setattr(_weights, "calibrate_sequentially", spy)
    return calls
