"""The sensitivity table: each assumed figure of a target at either end of its range, and what the
plan's time per token, time to first token and cold start become (the rest nominal), under the
nominal figures and the range they all span at once (`aviatorc target show --sensitivity`)."""

from __future__ import annotations

from collections.abc import Mapping

from aviatorc.plan.plan import FigureRange
from aviatorc.report.data import seconds
from aviatorc.target import Target

COLUMNS = {"time_per_token_s": "time per token", "ttft_s": "time to first token", "cold_start_s": "cold start"}


def sensitivity_table(ranges: Mapping[str, FigureRange], target: Target) -> list[list[str]]:
    """Rows of text cells: a header, the nominal figures, one row per assumption (its low and high
    value, each figure at low / at high), the range all assumptions span, and the assumption each
    figure is most sensitive to."""
    figures = [f for f in COLUMNS if f in ranges]
    rows = [["assumption", "range", *(COLUMNS[f] for f in figures)],
            ["(nominal)", "", *(seconds(ranges[f].nominal) for f in figures)]]
    for a in target.assumed:
        cells = []
        for f in figures:
            low, high = ranges[f].sensitivity.get(a.key, (ranges[f].nominal, ranges[f].nominal))
            cells.append("-" if low == high == ranges[f].nominal else f"{seconds(low)} / {seconds(high)}")
        rows.append([a.key, f"{a.low:g} .. {a.high:g}", *cells])
    rows.append(["(all at once)", "", *(f"{seconds(ranges[f].low)} .. {seconds(ranges[f].high)}" for f in figures)])
    rows.append(["(most sensitive to)", "", *(ranges[f].most_sensitive or "-" for f in figures)])
    return rows


def render_table(rows: list[list[str]]) -> str:
    """Left-aligned columns two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)
