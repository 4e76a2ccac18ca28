"""The plan: tiles and where they live, the programs for each phase, and what they predict.

`Plan.to_dict()` is the body of `plan.json` (schema in docs/plan-format.md): sorted keys, no
timestamps, no absolute paths, so the same inputs give the same bytes. The programs are the
executable part (see `aviatorc.plan.ir`); `prediction` holds the simulated figures next to the
physical bound they are judged against.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aviatorc.partition.placement import Placement
from aviatorc.plan.ir import Program, Workload

PLAN_SCHEMA_VERSION = 1


@dataclass
class Plan:
    target_name: str
    target_sha256: str  # of the resolved target TOML written beside the plan
    placement: Placement
    workload: Workload
    chiplets: tuple[int, ...]  # the chiplets this model may use
    programs: dict[str, Program]  # "decode", "prefill"
    memory: dict[str, Any]  # the memory plan's figures (KV, scratch, staging, reserve)
    prediction: dict[str, Any]  # simulated TTFT, time per token, bound, efficiency, sweeps
    cold_start: dict[str, Any]
    prefetch: bool = True
    notes: list[str] = field(default_factory=list)
    decode_timeline: Any = None  # the simulated decode step (not serialized: trace.json is its export)
    target: Any = None  # the resolved Target (serialized as target.toml beside plan.json)

    def tile_records(self) -> list[dict[str, Any]]:
        num_c = self.placement.num_chiplets
        out = []
        for t, (tile, w) in enumerate(zip(self.placement.tiles, self.placement.where, strict=True)):
            record: dict[str, Any] = {
                "id": f"t{t}", "weight": tile.weight, "layer": tile.layer, "role": tile.role,
                "rows": [tile.k_start, tile.k_stop], "cols": [tile.n_start, tile.n_stop],
                "format": tile.format.to_attrs(), "bytes": tile.storage_bytes,
                "compute_chiplet": self.placement.compute_chiplet[t], "nodes": list(tile.nodes),
            }
            if w < num_c:
                record["resident_chiplet"] = w
            else:
                record["streamed_from_card"] = w - num_c
            out.append(record)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": PLAN_SCHEMA_VERSION,
            "target": {"name": self.target_name, "sha256": self.target_sha256, "file": "target.toml"},
            "workload": {"batch": self.workload.batch, "context": self.workload.context,
                         "prompt": self.workload.prompt},
            "chiplets": list(self.chiplets),
            "prefetch": self.prefetch,
            "tiles": self.tile_records(),
            "memory": self.memory,
            "programs": {phase: program.to_dict() for phase, program in sorted(self.programs.items())},
            "cold_start": self.cold_start,
            "prediction": self.prediction,
            "notes": list(self.notes),
        }
