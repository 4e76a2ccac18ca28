"""The placement as a terminal table (rich) and as the `placement` section of report.json.

`render_table(placement)` shows the summary (status, objective, greedy, bound, gap, solve
time, resident and streamed bytes, cut traffic), then one row per chiplet (bytes and
utilization of its SRAM) and the layers grouped into runs with the same tile counts.
"""

from __future__ import annotations

from typing import Any

from aviatorc.partition.feasibility import human_bytes
from aviatorc.partition.placement import Placement


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
    table.add_row("lower bound", _us(p.bound_ps), f"gap {p.gap:.2%}")
    table.add_row("solve time", f"{p.solve_time_s:.1f} s", f"seed {p.seed}")
    for warning in p.warnings:
        table.add_row("warning", "timing", warning)
    table.add_row("resident", human_bytes(p.resident_bytes), f"{sum(1 for w in p.where if w < p.num_chiplets)} tiles")
    table.add_row("streamed", human_bytes(p.streamed_bytes),
                  f"{human_bytes(p.streamed_read_bytes_per_step)} read per step (at least "
                  f"{human_bytes(p.min_streamed_read_bytes)})")
    for level, nbytes in p.cut_bytes_by_level:
        table.add_row(f"cut: {level}", human_bytes(nbytes), "activation bytes per step")
    used = [b for b in p.chiplet_bytes]
    for c, nbytes in enumerate(used):
        card, rest = divmod(c, max(1, p.num_chiplets // max(1, p.num_cards)))
        table.add_row(f"chiplet {c} (card {card})", human_bytes(nbytes), f"{nbytes / p.chiplet_sram_bytes:.1%} of SRAM")
    for first, last, (resident, streamed) in _layer_runs(p):
        name = f"layer {first}" if first == last else f"layers {first}..{last}"
        table.add_row(name, f"{resident} + {streamed}", "tiles resident + streamed, each")
    return table


def _layer_runs(p: Placement) -> list[tuple[int, int, tuple[int, int]]]:
    runs: list[tuple[int, int, tuple[int, int]]] = []
    for layer, counts in p.tiles_per_layer().items():
        if runs and runs[-1][2] == counts and runs[-1][1] == layer - 1:
            runs[-1] = (runs[-1][0], layer, counts)
        else:
            runs.append((layer, layer, counts))
    return runs
