"""Reports of a compiled artifact: an HTML page, JSON for machines, a terminal summary.

    from aviatorc.report import ReportSources, report_data, render_html
    data = report_data(ReportSources.from_artifact(aviatorc.load("build/model.avc")))
    Path("report.html").write_text(render_html(data))

`data.py` extracts what the report shows from the artifact's files (plan.json, report.json,
trace.json, target.toml); `html.py` (Jinja2 and Bokeh) and `text.py` (rich) render it. The
layer sits beside the backends: it reads plan data, and nothing below it imports it.
`aviatorc compile` writes the page into the artifact as report.html.
"""

from __future__ import annotations

from aviatorc.report.data import ReportSources, report_data
from aviatorc.report.html import render_html
from aviatorc.report.text import render_text

__all__ = ["ReportSources", "render_html", "render_text", "report_data"]
