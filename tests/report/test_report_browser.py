"""The HTML report in a real browser: headless Chromium (Debian's `chromium`, driven by
playwright) opens the compiled tiny llama's report.html from disk with every network request
refused, and must find each section, draw each chart, and log no error. The screenshot is kept
as a test artifact: build/test-artifacts/report.png."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from aviatorc.report.browser import offline_page
from aviatorc.report.data import sweeps as sweeps_of
from aviatorc.report.html import SECTIONS

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "build" / "test-artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (Debian: apt-get install chromium; "
                                ".ci/run installs it)")


def test_report_renders_offline_in_chromium(small_artifact):
    with offline_page(small_artifact.path / "report.html", CHROMIUM) as opened:
        page = opened.page
        drawn = opened.wait_for_charts(timeout_ms=30_000)
        charts = page.locator("div.chart")
        # latency, placement, SRAM, timeline, accuracy, and a sweep chart per axis where more than one point fits
        plan = small_artifact.result.plan
        sweeps = sweeps_of(plan.to_dict()["prediction"].get("sweep", []), plan.workload.to_dict())
        swept = sum(sum(1 for e in sweeps[axis] if e.get("fits")) > 1 for axis in sweeps)
        assert swept >= 1 and drawn == charts.count() == 5 + swept
        for section, heading in SECTIONS:
            assert page.locator(f"section#{section} h2").inner_text() == heading
        for i in range(charts.count()):  # Bokeh draws into a canvas inside each chart's shadow root
            chart = charts.nth(i)
            assert chart.locator("canvas").count() >= 1, chart.get_attribute("id")
            assert chart.bounding_box()["height"] > 100, chart.get_attribute("id")
        assert "held-out" in page.locator("section#accuracy").inner_text()
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "report.png"), full_page=True)
    assert opened.problems == []  # no console error, no page error, nothing fetched
    assert (ARTIFACTS / "report.png").stat().st_size > 50_000
