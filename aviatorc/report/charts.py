"""The report's charts as Bokeh figures, one function per chart, each reading one section of
`report_data` (see data.py). Hover tools carry the detail; nothing here fetches anything.

Why Bokeh: its JavaScript ships inside the Python wheel (`bokeh.resources`), so the page embeds
it and opens offline; canvas rendering keeps a 13k-bar timeline responsive. Only the core
bundle is used (no widgets, tables or WebGL), about 1.3 MB.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
from bokeh.models import (
    BasicTicker,
    ColumnDataSource,
    CustomJSHover,
    DataRange1d,
    FactorRange,
    FixedTicker,
    HoverTool,
    LinearColorMapper,
    NumeralTickFormatter,
    Range1d,
)
from bokeh.models.annotations import ColorBar, Legend, LegendItem  # where bokeh's type stubs declare them
from bokeh.palettes import Category10_10, Turbo256, Viridis256
from bokeh.plotting import figure

TOOLS = "pan,box_zoom,wheel_zoom,reset"
KIND_COLORS = {"compute": "#1f77b4", "load": "#ff7f0e", "send": "#2ca02c", "wait": "#c7c7c7"}


def _bytes_axis() -> Any:
    """A fresh formatter per chart: a Bokeh model belongs to one document."""
    return NumeralTickFormatter(format="0.0 b")


def placement_heatmap(placement: Mapping[str, Any]) -> Any:
    """Chiplets by layer, colored by resident SRAM bytes; hover: tiles and their largest weights."""
    cells = placement["cells"]
    layers = list(placement["layers"])
    chiplets = [f"c{c}" for c in sorted({int(c) for c in placement["chiplets"]} | {c["chiplet"] for c in cells})]
    source = ColumnDataSource({
        "layer": [c["label"] for c in cells], "chiplet": [f"c{c['chiplet']}" for c in cells],
        "resident_bytes": np.array([c["resident_bytes"] for c in cells], dtype=np.float64),
        "streamed_bytes": np.array([c["streamed_bytes"] for c in cells], dtype=np.float64),
        "resident_tiles": np.array([c["resident_tiles"] for c in cells], dtype=np.int32),
        "streamed_tiles": np.array([c["streamed_tiles"] for c in cells], dtype=np.int32),
        "detail": [c["detail"] for c in cells],
    })
    high = max((c["resident_bytes"] for c in cells), default=0) or 1
    mapper = LinearColorMapper(palette=Viridis256, low=0, high=high)
    fig = figure(x_range=FactorRange(factors=layers), y_range=FactorRange(factors=chiplets[::-1]), tools=TOOLS,
                 height=min(1000, 150 + 22 * len(chiplets)), sizing_mode="stretch_width", toolbar_location="above",
                 x_axis_label="layer", y_axis_label="chiplet")
    fig.rect(x="layer", y="chiplet", width=0.95, height=0.95, source=source,
             fill_color={"field": "resident_bytes", "transform": mapper}, line_color=None)
    fig.add_tools(HoverTool(tooltips=[("layer", "@layer"), ("chiplet", "@chiplet"),
                                      ("resident", "@resident_bytes{0.0 b} in @resident_tiles tiles"),
                                      ("streamed through", "@streamed_bytes{0.0 b} in @streamed_tiles tiles"),
                                      ("weights", "@detail")]))
    fig.add_layout(ColorBar(color_mapper=mapper, formatter=_bytes_axis(), ticker=BasicTicker(), width=14,
                            title="resident"), "right")
    fig.xaxis.major_label_orientation = 1.2 if len(layers) > 20 else 0
    _style(fig)
    return fig


def sram_over_time(sram: Mapping[str, Any], capacity_bytes: int | None) -> Any:
    """Bytes in use on each chiplet through the decode step, as step lines."""
    xs, ys, names, colors = [], [], [], []
    series = sram["series"]
    for i, (chiplet, points) in enumerate(sorted(series.items(), key=lambda kv: int(kv[0]))):
        t = np.array([p[0] for p in points], dtype=np.float64)
        b = np.array([p[1] for p in points], dtype=np.float64)
        xs.append(np.repeat(t, 2)[1:])  # a step: each value held until the next sample
        ys.append(np.repeat(b, 2)[:-1])
        names.append(f"chiplet {chiplet}")
        colors.append(Turbo256[(i * 255) // max(1, len(series) - 1)] if len(series) > 10 else Category10_10[i])
    fig = figure(tools=TOOLS, height=320, sizing_mode="stretch_width", toolbar_location="above", y_range=DataRange1d(start=0),
                 x_axis_label="time in the decode step (us)", y_axis_label="SRAM in use")
    lines = fig.multi_line(xs="xs", ys="ys", line_color="color", line_width=2, source=ColumnDataSource(
        {"xs": xs, "ys": ys, "chiplet": names, "color": colors}))
    items = [_entry(name, lines, index=i) for i, name in enumerate(names)] if len(names) <= 16 else []
    if capacity_bytes:
        cap = fig.line([0, sram["makespan_us"] or 1], [capacity_bytes, capacity_bytes], line_dash="dashed",
                       line_color="#d62728")
        items.append(_entry("SRAM per chiplet", cap))
    if items:
        fig.add_layout(Legend(items=items, orientation="horizontal", click_policy="hide"), "above")
    fig.add_tools(HoverTool(tooltips=[("", "@chiplet"), ("time", "$x{0.000} us"), ("in use", "$y{0.0 b}")],
                            line_policy="nearest"))
    fig.yaxis.formatter = _bytes_axis()
    _style(fig)
    return fig


def timeline_chart(timeline: Mapping[str, Any]) -> Any:
    """Load / compute / send / wait bars per chiplet, LPDDR channel and link.

    Tracks are numbers on the y axis (labelled with their names), not categories: a bar then
    costs a few bytes of a binary column instead of its track's name."""
    tracks = list(timeline["tracks"])
    top = len(tracks) - 1
    fig = figure(tools=TOOLS, height=min(1400, 120 + 16 * len(tracks)), y_range=Range1d(start=top + 0.6, end=-0.6),
                 sizing_mode="stretch_width", toolbar_location="above", x_axis_label="time in the decode step (us)")
    items = []
    for kind in timeline["kinds"]:  # one renderer per kind: its legend entry hides it on click
        rows = [i for i, k in enumerate(timeline["kind"]) if k == kind]
        source = ColumnDataSource({
            "y": np.array([timeline["track"][i] for i in rows], dtype=np.int32),
            "name": [timeline["name"][i] for i in rows],
            "start": np.array([timeline["start_us"][i] for i in rows], dtype=np.float64),
            "end": np.array([timeline["end_us"][i] for i in rows], dtype=np.float64),
            "count": np.array([timeline["count"][i] for i in rows], dtype=np.int32)})
        bars = fig.hbar(y="y", left="start", right="end", height=0.8, source=source, line_color=None,
                        fill_color=KIND_COLORS.get(kind, "#9467bd"), name=kind)
        items.append(_entry(kind, bars))
    track_name = CustomJSHover(code=f"return {json.dumps(tracks)}[value] ?? String(value)")
    fig.add_tools(HoverTool(tooltips=[("", "@y{track}: $name"), ("what", "@name"), ("start", "@start{0.000} us"),
                                      ("end", "@end{0.000} us"), ("spans", "@count")], formatters={"@y": track_name}))
    fig.yaxis.ticker = FixedTicker(ticks=list(range(len(tracks))))
    fig.yaxis.major_label_overrides = {i: name for i, name in enumerate(tracks)}
    fig.ygrid.grid_line_color = None
    fig.add_layout(Legend(items=items, orientation="horizontal", click_policy="hide"), "above")
    _style(fig)
    return fig


def accuracy_chart(accuracy: Mapping[str, Any]) -> Any:
    """Per-layer SQNR: the layer's own error (bars) and as the whole model computes it (dots)."""
    layers = accuracy["layers"]
    own = np.array([_db(e["sqnr_db"]) for e in layers], dtype=np.float64)
    in_model = np.array([_db(e.get("sqnr_db_in_model")) for e in layers], dtype=np.float64)
    source = ColumnDataSource({"i": np.arange(len(layers)), "node": [e["node"] for e in layers],
                               "format": [e["format"] for e in layers],
                               "shape": [f"{e['k']} x {e['n']}" for e in layers], "own": own, "in_model": in_model})
    fig = figure(tools=TOOLS, height=300, sizing_mode="stretch_width", toolbar_location="above",
                 x_axis_label="quantized layer, in graph order", y_axis_label="SQNR (dB)")
    bars = fig.vbar(x="i", top="own", width=0.8, source=source, fill_color="#1f77b4", line_color=None)
    dots = fig.scatter(x="i", y="in_model", size=7, source=source, fill_color="#ff7f0e", line_color=None)
    fig.add_tools(HoverTool(tooltips=[("node", "@node"), ("format", "@format"), ("k x n", "@shape"),
                                      ("SQNR", "@own{0.00} dB"), ("in model", "@in_model{0.00} dB")]))
    fig.add_layout(Legend(items=[_entry("the layer's own error", bars),
                                 _entry("in the model (earlier layers' errors included)", dots)],
                          orientation="horizontal"), "above")
    _style(fig)
    return fig


def latency_chart(prediction: Mapping[str, Any]) -> Any:
    """Each predicted figure next to its physical bound, on a log axis (they span us to s)."""
    rows = prediction["rows"]
    pairs = [(r["what"], which) for r in rows for which in ("predicted", "bound")]
    seconds = np.array([r["predicted_s" if which == "predicted" else "bound_s"] for r in rows
                        for which in ("predicted", "bound")], dtype=np.float64)
    unit, scale = next(((u, f) for u, f in (("s", 1.0), ("ms", 1e-3)) if seconds.max(initial=0) >= f), ("us", 1e-6))
    values = seconds / scale
    labels = [f"{what}: {which}" for what, which in pairs]
    source = ColumnDataSource({"y": labels, "value": values, "which": [w for _, w in pairs],
                               "color": ["#1f77b4" if w == "predicted" else "#7f7f7f" for _, w in pairs]})
    low = float(values[values > 0].min()) / 3 if (values > 0).any() else 1e-6
    fig = figure(y_range=FactorRange(factors=labels[::-1]), x_axis_type="log", tools=TOOLS, height=80 + 26 * len(labels),
                 sizing_mode="stretch_width", toolbar_location="above", x_axis_label=f"{unit} (log)")
    fig.hbar(y="y", left=low, right="value", height=0.7, fill_color="color", line_color=None, source=source)
    fig.add_tools(HoverTool(tooltips=[("", "@y"), (unit, "@value{0.000}")]))
    _style(fig)
    return fig


def sweep_chart(entries: list[Mapping[str, Any]], axis: str) -> Any:
    """Time per token and its bound across a sweep of `axis` ("batch" or "context")."""
    fits = [e for e in entries if e.get("fits") and "time_per_token_s" in e]
    source = ColumnDataSource({"x": np.array([e[axis] for e in fits], dtype=np.float64),
                               "ms": np.array([e["time_per_token_s"] for e in fits], dtype=np.float64) * 1e3,
                               "bound": np.array([e["bound_s"] for e in fits], dtype=np.float64) * 1e3,
                               "tps": np.array([e.get("tokens_per_s", 0.0) for e in fits], dtype=np.float64),
                               "kv": [e.get("kv_location", "") for e in fits]})
    fig = figure(x_axis_type="log", y_axis_type="log", tools=TOOLS, height=300, sizing_mode="stretch_width",
                 toolbar_location="above", x_axis_label=axis, y_axis_label="ms per decode step (log)")
    fig.line("x", "ms", source=source, line_width=2, legend_label="predicted")
    fig.scatter("x", "ms", source=source, size=7)
    fig.line("x", "bound", source=source, line_width=2, line_dash="dashed", line_color="#7f7f7f", legend_label="bound")
    fig.scatter("x", "bound", source=source, size=6, fill_color="#7f7f7f", line_color="#7f7f7f")
    fig.add_tools(HoverTool(tooltips=[(axis, "@x"), ("predicted", "@ms{0.000} ms"), ("bound", "@bound{0.000} ms"),
                                      ("tokens/s", "@tps{0,0}"), ("KV cache in", "@kv")]))
    # Ticks at the sweep's own points, in a short form ("32K"): the log axis's own labels for
    # contexts such as 131072 ran into each other.
    xs = sorted({int(e[axis]) for e in fits})
    if xs:
        fig.xaxis.ticker = FixedTicker(ticks=xs)
        fig.xaxis.major_label_overrides = {x: short_count(x) for x in xs}
        fig.xaxis.major_label_orientation = 0.7 if len(xs) > 8 else 0
    fig.legend.location = "top_left"
    _style(fig)
    return fig


def short_count(n: int) -> str:
    """131072 -> "128K", 2048 -> "2K", 1000 -> "1000", 3 -> "3": a tick label that stays short."""
    for unit, scale in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def _entry(label: str, renderer: Any, **fields: Any) -> Any:
    """A legend entry (bokeh's stubs type `renderers` too narrowly for a list of one glyph renderer)."""
    return LegendItem(label=label, renderers=[renderer], **fields)


def _db(value: Any) -> float:
    """A report SQNR ("inf" where the error is zero) as a number to draw: infinite is not drawn."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        return float("nan")
    return x if np.isfinite(x) else float("nan")


def _style(fig: Any) -> None:
    fig.toolbar.logo = None
    fig.grid.grid_line_alpha = 0.3
    fig.outline_line_color = None
