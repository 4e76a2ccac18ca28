"""The placement as a terminal table (rich) and as the `placement` section of report.json.

`render_table(placement)` shows the summary (status, objective, greedy, bound, gap, solve
time, resident and streamed bytes, cut traffic), then one row per chiplet that holds weights
(bytes and utilization of its SRAM) and one row for all the empty ones, and the layers grouped
into runs with the same tile counts. `weights.py` numbers the weights before the first block
-1 and a head after the last block N: they are shown as the embedding and the head.
"""

from __future__ import annotations

from typing import Any

from aviatorc.options import format_chiplets
from aviatorc.partition.feasibility import human_bytes
from aviatorc.partition.placement import Placement

# What the lower bound leaves out (docs/partition.md: most of the gap on SRAM-resident models).
BOUND_LEAVES_OUT = ("the bound leaves out collecting outputs, the hand-offs between layers and the trips to "
                    "each layer's home")


def placement_dict(placement: Placement) -> dict[str, Any]:
    return placement.to_dict()


def _us(ps: float) -> str:
    return f"{ps / 1e6:,.1f} us"


def render_table(placement: Placement) -> Any:
    """A rich Table of the placement (import of rich kept local: the report layer is optional)."""
    from rich.table import Table

    p = placement
    table = Table(title=f"placement on {p.target_name}: {p.status}", show_lines=False)
    table.add_column("item")
    table.add_column("value", justify="right")
    table.add_column("detail")
    table.add_row("objective / step", _us(p.objective_ps), "compute + LPDDR streaming + activation transfers")
    table.add_row("greedy", _us(p.greedy_objective_ps), f"solver {p.improvement_over_greedy:.2%} better")
    table.add_row("lower bound", _us(p.bound_ps), f"gap {p.gap:.2%}; {BOUND_LEAVES_OUT}")
    table.add_row("solve time", f"{p.solve_time_s:.1f} s", f"seed {p.seed}")
    for warning in p.warnings:
        table.add_row("warning", "timing", warning)
    table.add_row("resident", human_bytes(p.resident_bytes), f"{sum(1 for w in p.where if w < p.num_chiplets)} tiles")
    table.add_row("streamed", human_bytes(p.streamed_bytes),
                  f"{human_bytes(p.streamed_read_bytes_per_step)} read per step (at least "
                  f"{human_bytes(p.min_streamed_read_bytes)})")
    for level, nbytes in p.cut_bytes_by_level:
        table.add_row(f"cut: {level}", human_bytes(nbytes), "activation bytes per step")
    per_card = max(1, p.num_chiplets // max(1, p.num_cards))
    empty = [c for c, nbytes in enumerate(p.chiplet_bytes) if nbytes == 0]
    for c, nbytes in enumerate(p.chiplet_bytes):
        if nbytes:
            table.add_row(f"chiplet {c} (card {c // per_card})", human_bytes(nbytes),
                          f"{nbytes / p.chiplet_sram_bytes:.1%} of SRAM")
    if empty:  # one row, not 29 rows of 0 B
        table.add_row(f"{len(empty)} empty chiplet{'s' if len(empty) > 1 else ''}", "0 B",
                      f"chiplets {format_chiplets(empty)}")
    for name, (resident, streamed) in layer_runs(p):
        table.add_row(name, f"{resident} + {streamed}", "tiles resident + streamed, each")
    return table


def layer_runs(p: Placement) -> list[tuple[str, tuple[int, int]]]:
    """(name, (resident, streamed) tiles per layer) for runs of consecutive layers with the same
    counts: "layers 0..31", with the embedding and the head named and never merged into a run."""
    roles: dict[int, set[str]] = {}
    for tile in p.tiles:
        roles.setdefault(tile.layer, set()).add(tile.role)
    numbered = [layer for layer in roles if layer >= 0]
    runs: list[tuple[int, int, tuple[int, int]]] = []
    for layer, counts in p.tiles_per_layer().items():
        special = layer_name(layer, roles[layer], numbered) != f"layer {layer}"
        previous_special = runs and layer_name(runs[-1][1], roles[runs[-1][1]], numbered) != f"layer {runs[-1][1]}"
        if runs and not special and not previous_special and runs[-1][2] == counts and runs[-1][1] == layer - 1:
            runs[-1] = (runs[-1][0], layer, counts)
        else:
            runs.append((layer, layer, counts))
    return [(layer_name(first, roles[first], numbered) if first == last else f"layers {first}..{last}", counts)
            for first, last, counts in runs]


def layer_name(layer: int, roles: set[str], numbered: list[int]) -> str:
    """The embedding (layer -1), the head (the last layer, after the blocks), or "layer N"."""
    if layer == -1:
        if roles == {"embedding"}:
            return "embedding"
        return f"before layer 0 ({', '.join(sorted(roles))})" if numbered else "weights outside any layer"
    if roles == {"lm_head"} and layer == max(numbered) and len(numbered) > 1:
        return "head"
    return f"layer {layer}"
