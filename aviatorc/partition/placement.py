"""The partitioner's result: where every tile lives, where it computes, what it costs, and how good that is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aviatorc.partition.problem import LayerCost
from aviatorc.partition.tiling import Tile


@dataclass(frozen=True)
class LayerSolve:
    """How one decomposition unit (a layer) was placed."""

    layer: int
    method: str  # "cpsat-optimal", "cpsat-feasible", "greedy", "template" (a copy of an identical layer)
    cost_ps: int
    greedy_cost_ps: int


@dataclass(frozen=True)
class Placement:
    """Tile t is resident on chiplet where[t] (< num_chiplets) or streamed from LPDDR channel
    where[t] - num_chiplets.

    Every tile computes on `compute_chiplet[t]`: where[t] for a resident tile; for a streamed one
    a chiplet the channel attaches to, which receives the tile's bytes into a staging buffer
    (inside its reserve) and computes with them."""

    target_name: str
    num_chiplets: int
    num_cards: int
    tiles: tuple[Tile, ...]
    where: tuple[int, ...]
    compute_chiplet: tuple[int, ...]
    status: str  # "optimal", "feasible" or "greedy" (the greedy fallback)
    objective_ps: int
    greedy_objective_ps: int
    bound_ps: float
    solve_time_s: float
    chiplet_bytes: tuple[int, ...]
    chiplet_capacity_bytes: tuple[int, ...]  # usable per chiplet: SRAM less the reserve (0 outside `chiplets`)
    reserve_bytes: tuple[int, ...]  # per chiplet: held back for activations, the KV cache and staging
    chiplets: tuple[int, ...]  # the chiplets the placement was confined to (all by default)
    chiplet_sram_bytes: int
    resident_bytes: int
    streamed_bytes: int  # stored bytes of streamed tiles
    streamed_read_bytes_per_step: int  # what streaming costs per decode step
    min_streamed_read_bytes: int  # the bound's share: no placement streams less
    layer_costs: tuple[LayerCost, ...]
    cut_bytes_by_level: tuple[tuple[str, int], ...]  # activation bytes per step crossing each link level
    solves: tuple[LayerSolve, ...]
    seed: int
    batch_tokens: int
    warnings: tuple[str, ...] = ()  # a wall-clock safety net fired: the result depended on timing
    layer_homes: tuple[tuple[int, int], ...] = ()  # (layer, chiplet its non-weight work runs on), as costed
    solver: str = "greedy"  # as asked: "greedy", "cpsat" or "auto"
    solver_note: str = ""  # what ran and why (auto: the greedy placement's gap to the bound)

    @property
    def gap(self) -> float:
        """(objective - bound) / bound: how far above the problem-specific lower bound."""
        return (self.objective_ps - self.bound_ps) / self.bound_ps if self.bound_ps > 0 else 0.0

    @property
    def improvement_over_greedy(self) -> float:
        return 1.0 - self.objective_ps / self.greedy_objective_ps if self.greedy_objective_ps else 0.0

    def is_streamed(self, tile_index: int) -> bool:
        return self.where[tile_index] >= self.num_chiplets

    def location(self, tile_index: int) -> tuple[str, int]:
        w = self.where[tile_index]
        return ("chiplet", w) if w < self.num_chiplets else ("streamed", w - self.num_chiplets)

    def streaming_channel(self, tile_index: int) -> int | None:
        """The LPDDR channel that streams the tile, or None for a resident tile."""
        w = self.where[tile_index]
        return w - self.num_chiplets if w >= self.num_chiplets else None

    def tiles_of_weight(self, weight: str) -> list[int]:
        """Indices of a weight's tiles, in column (or row) order."""
        return [t for t, tile in enumerate(self.tiles) if tile.weight == weight]

    def tiles_of_node(self, node: str) -> list[int]:
        """Indices of the tiles IR node `node` reads (a tied table's Gather reads the head's tiles)."""
        return [t for t, tile in enumerate(self.tiles) if node in tile.nodes]

    def tiles_per_layer(self) -> dict[int, tuple[int, int]]:
        """layer -> (resident tiles, streamed tiles)."""
        out: dict[int, list[int]] = {}
        for tile, w in zip(self.tiles, self.where, strict=True):
            counts = out.setdefault(tile.layer, [0, 0])
            counts[0 if w < self.num_chiplets else 1] += 1
        return {layer: (c[0], c[1]) for layer, c in sorted(out.items())}

    def to_dict(self) -> dict[str, Any]:
        """The `placement` section of report.json (sorted, deterministic)."""
        return {
            "target": self.target_name,
            "status": self.status,
            "objective_ps": self.objective_ps,
            "objective_s": self.objective_ps * 1e-12,
            "objective": self.objective_ps,
            "greedy_objective_ps": self.greedy_objective_ps,
            "improvement_over_greedy": round(self.improvement_over_greedy, 6),
            "lower_bound_ps": round(self.bound_ps),
            "gap_to_bound": round(self.gap, 6),
            "solve_time_s": round(self.solve_time_s, 3),
            "seed": self.seed,
            "solver": self.solver,
            "solver_note": self.solver_note,
            "batch_tokens": self.batch_tokens,
            "warnings": list(self.warnings),
            "tiles": len(self.tiles),
            "allowed_chiplets": list(self.chiplets),
            "resident_bytes": self.resident_bytes,
            "streamed_bytes": self.streamed_bytes,
            "streamed_read_bytes_per_step": self.streamed_read_bytes_per_step,
            "min_streamed_read_bytes_per_step": self.min_streamed_read_bytes,
            "chiplets": [
                {"chiplet": c, "bytes": b, "capacity_bytes": self.chiplet_capacity_bytes[c],
                 "reserve_bytes": self.reserve_bytes[c], "sram_bytes": self.chiplet_sram_bytes,
                 "utilization": round(b / self.chiplet_sram_bytes, 6)}
                for c, b in enumerate(self.chiplet_bytes)
            ],
            "layers": [
                {"layer": lc.layer, "resident_tiles": r, "streamed_tiles": s, "compute_ps": lc.compute_ps,
                 "stream_ps": lc.stream_ps, "cut_ps": lc.cut_ps, "collect_ps": lc.collect_ps,
                 "fired_stream_ps": lc.fired_ps}
                for lc, (r, s) in zip(self.layer_costs, self.tiles_per_layer().values(), strict=True)
            ],
            "cut_bytes_per_step": dict(self.cut_bytes_by_level),
            "layer_homes": [{"layer": layer, "chiplet": c} for layer, c in self.layer_homes],
            "solves": [{"layer": s.layer, "method": s.method, "cost_ps": s.cost_ps, "greedy_cost_ps": s.greedy_cost_ps}
                       for s in self.solves],
            "assignment": [
                {"weight": t.weight, "k": [t.k_start, t.k_stop], "n": [t.n_start, t.n_stop],
                 "chiplet" if w < self.num_chiplets else "streamed_from_channel":
                     w if w < self.num_chiplets else w - self.num_chiplets,
                 "compute_chiplet": c}
                for t, w, c in zip(self.tiles, self.where, self.compute_chiplet, strict=True)
            ],
        }
