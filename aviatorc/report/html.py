"""The report as one self-contained HTML page: a Jinja2 template, Bokeh charts, inline scripts.

    html = render_html(report_data(sources))

Offline: Bokeh's own JavaScript is inlined from the installed wheel, styles are inline, and the
page names no URL. Deterministic: the charts are embedded as one JSON document whose model
ids are renumbered in document order (Bokeh draws them from a process-wide counter, and its
`file_html` adds random document ids), so the same data gives the same bytes: the page can live
in an artifact beside its manifest hash.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from aviatorc.report.data import binding_text, human_bytes, seconds
from aviatorc.report.text import ACCURACY_HOW

SECTIONS = (  # (id, heading): the page's sections, in order; the browser test checks each one
    ("summary", "Summary"),
    ("latency", "Predicted latency against the physical bound"),
    ("placement", "Placement: chiplets by layer"),
    ("sram", "SRAM occupancy over the decode step"),
    ("timeline", "Timeline of the decode step"),
    ("accuracy", "Accuracy per layer"),
    ("sweeps", "Batch and context sweeps"),
    ("config", "Options, target and versions"),
)


def render_html(data: Mapping[str, Any]) -> str:
    """The page for `report_data`'s result."""
    import jinja2
    from bokeh import __version__ as bokeh_version
    from bokeh.resources import Resources

    charts = _charts(data)
    env = jinja2.Environment(loader=jinja2.PackageLoader("aviatorc.report", "templates"),
                             autoescape=jinja2.select_autoescape(default=True), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True)
    env.filters.update(bytes=_bytes, seconds=seconds, number=_number, percent=_percent, binding=binding_text)
    # Only Bokeh's core bundle: no widgets, tables, WebGL or MathJax (each a megabyte or more).
    bokeh_js = Resources(mode="inline", components=["bokeh"]).render_js()
    return env.get_template("report.html.j2").render(
        data=data, sections=SECTIONS, charts={name for name, _ in charts}, bokeh_js=bokeh_js, accuracy_how=ACCURACY_HOW,
        bokeh_version=bokeh_version, charts_json=_script_json(_document(charts)) if charts else "null")


def _charts(data: Mapping[str, Any]) -> list[tuple[str, Any]]:
    from aviatorc.report import charts

    out: list[tuple[str, Any]] = []
    if data["prediction"]["rows"]:
        out.append(("latency", charts.latency_chart(data["prediction"])))
    if data["placement"]["cells"]:
        out.append(("placement", charts.placement_heatmap(data["placement"])))
    if data["sram"]["series"]:
        out.append(("sram", charts.sram_over_time(data["sram"], data["target"]["sram_bytes_per_chiplet"])))
    if data["timeline"]["bars"]:
        out.append(("timeline", charts.timeline_chart(data["timeline"])))
    if data["accuracy"] and data["accuracy"]["layers"]:
        out.append(("accuracy", charts.accuracy_chart(data["accuracy"])))
    for axis in ("batch", "context"):
        if sum(1 for e in data["sweeps"][axis] if e.get("fits")) > 1:
            out.append((f"sweep-{axis}", charts.sweep_chart(data["sweeps"][axis], axis)))
    return out


def _document(charts: list[tuple[str, Any]]) -> dict[str, Any]:
    """One Bokeh document holding every chart, for `Bokeh.embed.embed_items`: its model ids
    renumbered `m<n>` in document order, each root drawn into the element `chart-<name>`.

    One document, not one per chart: each document costs the page its own setup (about 0.1 s
    per chart on this machine)."""
    from bokeh.document import Document
    from bokeh.embed.util import standalone_docs_json_and_render_items

    document = Document()
    for _, fig in charts:
        document.add_root(fig)
    docs_json, _ = standalone_docs_json_and_render_items(document, suppress_callback_warning=True)
    (doc,) = docs_json.values()
    ids: dict[str, str] = {}

    def collect(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("type") == "object" and isinstance(node.get("id"), str):
                ids.setdefault(node["id"], f"m{len(ids) + 1}")
            for value in node.values():
                collect(value)
        elif isinstance(node, (list, tuple)):  # Bokeh writes a map's entries as tuples
            for value in node:
                collect(value)

    def rename(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: (ids.get(v, v) if k == "id" and isinstance(v, str) else rename(v)) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return [rename(v) for v in node]
        return node

    collect(doc)
    roots = {ids[fig.id]: f"chart-{name}" for name, fig in charts}
    return {"docs": {"report": rename(doc)}, "items": [{"docid": "report", "roots": roots, "root_ids": list(roots)}]}


def _script_json(value: Any) -> str:
    """JSON safe inside a <script> element: no '<' (so no '</script>'), and no NaN."""
    # Key order kept: Bokeh defines each model where it first appears and refers to it after.
    text = json.dumps(value, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _bytes(value: Any) -> str:
    return "-" if value is None else human_bytes(value)


def _percent(value: Any) -> str:
    return "-" if value is None else f"{value:.2%}"


def _number(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.{digits}f}"
