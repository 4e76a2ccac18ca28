"""The report's data and its renderings without a browser: what each section holds, that the
page is self-contained and deterministic, the command line, and the aggregation that keeps a
70B plan's page small."""

from __future__ import annotations

import hashlib
import json
import re

import pytest

import aviatorc
from aviatorc.cli import main
from aviatorc.plan.records import to_json
from aviatorc.report import ReportSources, render_html, report_data
from aviatorc.report import data as report_module
from aviatorc.report.data import accuracy_section, layer_labels, sram_series, timeline, trace_spans
from aviatorc.report.html import SECTIONS


@pytest.fixture(scope="module")
def data(small_artifact):
    return report_data(ReportSources.from_artifact(aviatorc.load(small_artifact.path)))


def test_placement_cells_account_for_every_tile(data, small_artifact):
    placement = small_artifact.result.placement
    cells = data["placement"]["cells"]
    assert sum(c["resident_tiles"] + c["streamed_tiles"] for c in cells) == len(placement.tiles)
    assert sum(c["resident_bytes"] for c in cells) == placement.resident_bytes
    assert sum(c["streamed_bytes"] for c in cells) == placement.streamed_bytes > 0
    assert data["placement"]["layers"] == ["embed", "L0", "L1", "head"]
    # per chiplet, the cells' resident bytes are the partitioner's own per-chiplet figures
    for total in data["placement"]["chiplet_totals"]:
        assert sum(c["resident_bytes"] for c in cells if c["chiplet"] == total["chiplet"]) == total["bytes"]


def test_layer_labels_name_the_embedding_and_the_head():
    roles = {-1: {"embedding"}, 0: {"qkv_proj", "o_proj"}, 1: {"qkv_proj", "o_proj"}, 2: {"lm_head"}}
    assert layer_labels(roles) == {-1: "embed", 0: "L0", 1: "L1", 2: "head"}
    # the last block is not a head because it is last
    assert layer_labels({0: {"qkv_proj"}, 1: {"o_proj", "down_proj"}}) == {0: "L0", 1: "L1"}


def test_timeline_and_sram_come_from_the_trace(data, small_artifact):
    trace = json.loads((small_artifact.path / "trace.json").read_bytes())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    t = data["timeline"]
    assert (t["spans"], t["bars"], t["aggregated"]) == (len(spans), len(spans), False)
    assert "load" in t["kinds"] and "compute" in t["kinds"]
    assert any(track.startswith("lpddr") for track in t["tracks"])
    assert t["makespan_us"] == pytest.approx(small_artifact.result.plan.prediction.time_per_token_s * 1e6, rel=1e-6)
    peaks = small_artifact.result.plan.prediction.sram_peak_bytes
    for chiplet, points in data["sram"]["series"].items():
        assert max(b for _, b in points) == peaks.get(int(chiplet), 0)
        assert points[-1][0] == data["sram"]["makespan_us"]


def test_many_spans_are_merged_per_track_and_kind(monkeypatch):
    monkeypatch.setattr(report_module, "MAX_SPANS", 100)
    monkeypatch.setattr(report_module, "TIMELINE_BINS", 50)
    # 2 tracks x 1000 back-to-back compute spans of 1 us, then a gap, then one load
    spans = [(f"chiplet {c}", "compute", f"op{i}", float(i), i + 1.0) for c in range(2) for i in range(1000)]
    spans.append(("lpddr card 0", "load", "t3", 1500.0, 1600.0))
    out = timeline(spans, 1600.0)
    assert out["aggregated"] and out["spans"] == 2001
    assert out["bars"] == 3  # each chiplet's run is one bar; the lone load stays itself
    assert sum(out["count"]) == 2001
    assert out["name"][out["kind"].index("load")] == "t3"
    assert out["tracks"] == ["chiplet 0", "chiplet 1", "lpddr card 0"]
    assert sorted(zip(out["track"], out["start_us"], out["end_us"]))[:2] == [(0, 0.0, 1000.0), (1, 0.0, 1000.0)]


def test_sram_samples_are_reduced_to_interval_peaks(monkeypatch):
    monkeypatch.setattr(report_module, "MAX_SRAM_POINTS", 10)
    events = [{"ph": "C", "name": "SRAM chiplet 0", "ts": float(i), "args": {"bytes": 1000 + (i % 7) * 10}}
              for i in range(100)]
    events.append({"ph": "C", "name": "SRAM chiplet 0", "ts": 55.5, "args": {"bytes": 99999}})
    out = sram_series({"traceEvents": events}, [0, 1], 100.0)
    points = out["series"]["0"]
    assert out["reduced"] and len(points) <= 11
    assert max(b for _, b in points) == 99999  # the peak survives the reduction
    assert out["series"]["1"] == [[0.0, 0], [100.0, 0]]  # a chiplet with no samples holds nothing


def test_accuracy_says_where_it_was_measured(data):
    accuracy = data["accuracy"]
    assert accuracy["held_out"] is True and accuracy["provenance"].startswith("held-out")
    assert accuracy["batches"] == 1  # the last of the 4 calibration batches
    assert {e["node"] for e in accuracy["layers"]} >= {"attn.0.qkv_proj", "attn.1.qkv_proj"}
    in_sample = accuracy_section({"batches": 2, "layers": [], "end_to_end": [], "data": {"held_out": False}})
    assert in_sample["held_out"] is False and in_sample["provenance"].startswith("in-sample")
    unknown = accuracy_section({"batches": 2, "layers": [], "end_to_end": []})  # an artifact from before the split
    assert unknown["held_out"] is None and "not stated" in unknown["provenance"]
    assert accuracy_section(None) is None


def test_predictions_and_sweeps(data, small_artifact):
    prediction = to_json(small_artifact.result.plan.prediction)
    rows = {r["what"]: r for r in data["prediction"]["rows"]}
    assert rows["time per token (decode)"]["predicted_s"] == prediction["time_per_token_s"]
    assert rows["time per token (decode)"]["bound_s"] == prediction["bound"]["token_s"]
    assert rows["time to first token"]["bound_s"] == prediction["bound"]["ttft_s"]
    assert [e["batch"] for e in data["sweeps"]["batch"]] == sorted({e["batch"] for e in prediction["sweep"]
                                                                   if e["context"] == 64})
    assert all(e["batch"] == 1 for e in data["sweeps"]["context"]) and len(data["sweeps"]["context"]) >= 2


def test_compile_writes_a_deterministic_self_contained_page(small_artifact, tmp_path):
    page = (small_artifact.path / "report.html").read_bytes()
    manifest = json.loads((small_artifact.path / "manifest.json").read_bytes())
    assert manifest["files"]["report.html"]["sha256"] == hashlib.sha256(page).hexdigest()
    assert small_artifact.result.artifact_files()["report.html"] == page  # rendered again: the same bytes
    # `aviatorc report -o` on the saved artifact renders the very page the compile wrote
    out = tmp_path / "again.html"
    assert main(["report", str(small_artifact.path), "-o", str(out)]) == 0
    assert out.read_bytes() == page
    text = page.decode()
    assert not re.search(r"<(script|link|img|iframe)[^>]*\b(src|href)=", text)  # nothing to fetch
    assert not re.search(r'"id":"p\d+"', text)  # every Bokeh id renumbered: none from the process-wide counter
    for section, _ in SECTIONS:
        assert f'<section id="{section}">' in text
    for chart in ("placement", "sram", "timeline", "accuracy", "latency", "sweep-context"):
        assert f'id="chart-{chart}"' in text
    assert "held-out" in text and "mock-small" in text
    assert "report.html" not in small_artifact.result.artifact_files(html_report=False)


def test_cli_json_and_text(small_artifact, capsys):
    assert main(["report", str(small_artifact.path), "--format", "data"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(json.dumps(report_data(ReportSources.from_artifact(aviatorc.load(small_artifact.path)))))
    # --format json is the artifact's report.json itself: one shape for the file and the command
    assert main(["report", str(small_artifact.path), "--format", "json"]) == 0
    assert capsys.readouterr().out == (small_artifact.path / "report.json").read_text()
    assert main(["report", str(small_artifact.path)]) == 0
    text = capsys.readouterr().out
    assert "predicted against the physical bound" in text and "held-out" in text
    assert str(small_artifact.path / "report.html") in text.replace("\n", "")
    assert main(["report", str(small_artifact.path), "--format", "html"]) == 1
    assert "an HTML report needs an output file" in capsys.readouterr().err


def test_a_huge_trace_keeps_the_page_small(small_artifact):
    """Sizes, not times: 300k spans (more than a 70B plan's) draw as at most tracks x kinds x bins bars."""
    files = small_artifact.result.artifact_files(html_report=False)
    sources = ReportSources.from_files(files)
    tracks = [f"chiplet {c}" for c in range(32)]
    events = [{"ph": "M", "name": "thread_name", "pid": 0, "tid": i, "args": {"name": t}} for i, t in enumerate(tracks)]
    events += [{"ph": "X", "pid": 0, "tid": i % 32, "name": f"compute n{i}", "cat": "compute" if i % 3 else "send",
                "ts": i * 0.01, "dur": 0.004} for i in range(300_000)]
    huge = ReportSources(sources.plan, sources.report, {"traceEvents": events}, sources.target_toml)
    data = report_data(huge)
    assert len(trace_spans(huge.trace)) == 300_000
    assert data["timeline"]["aggregated"] and sum(data["timeline"]["count"]) == 300_000
    assert data["timeline"]["bars"] <= report_module.MAX_BARS
    page = render_html(data).encode()
    small = (small_artifact.path / "report.html").read_bytes()
    assert len(page) < 5_000_000 and len(page) < 4 * len(small)
