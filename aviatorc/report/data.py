"""What the report shows, extracted from an artifact's files as JSON-ready data (no rendering here).

    data = report_data(ReportSources.from_artifact(aviatorc.load("build/model.avc")))

Sections, each a key of the result (the HTML page, the terminal summary and `--format data` all
read this one dict):
- `placement`: one cell per (layer, chiplet) holding tiles: SRAM bytes resident there, tiles
  streamed through it, and the largest weights in it (the heatmap's hover text). Cells, not
  tiles: a 70B plan has tens of thousands of tiles but only layers x chiplets cells.
- `sram`: bytes in use per chiplet over the simulated decode step (trace.json's counters),
  reduced to at most `MAX_SRAM_POINTS` per chiplet keeping each interval's peak.
- `timeline`: trace.json's spans (compute, load, send, wait) per chiplet, LPDDR channel and link;
  above `MAX_SPANS`, neighbouring spans of one kind on one track are merged into bars at least
  makespan / `TIMELINE_BINS` long (`count` says how many spans each bar stands for).
- `accuracy`: the compile's per-layer and end-to-end figures, and whether they were measured on
  held-out batches (report.json's `accuracy.data.held_out`) or in-sample, or that it is not said.
- `prediction` and `sweeps`: predicted TTFT, time per token and cold start, each next to its
  physical bound; the batch and context sweeps.
- `options`, `target`, `versions`, `passes`, `notes`.

Everything is sorted or in plan order and rounded where it is a float of our own making, so
the same artifact gives the same data, and the page rendered from it the same bytes.
"""

from __future__ import annotations

import json
import tomllib
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aviatorc.partition.feasibility import human_bytes
from aviatorc.plan.plan import PLAN_SCHEMA_VERSION, Plan
from aviatorc.plan.records import to_json

DATA_FORMAT = "aviatorc-report-data"
DATA_VERSION = 1
MAX_SPANS = 20_000  # Llama-3-8B on 4 cards has ~13.5k spans: drawn as they are
MAX_BARS = 40_000  # merged bars drawn at most: about 40 bytes each in the page
TIMELINE_BINS = 4_000  # a merged bar covers at least makespan / TIMELINE_BINS: about a pixel
MAX_SRAM_POINTS = 2_000  # per chiplet
DETAIL_WEIGHTS = 4  # weights named in a heatmap cell's hover text


@dataclass(frozen=True)
class ReportSources:
    """The artifact files a report reads, parsed: plan.json, report.json, trace.json, target.toml."""

    plan: Plan
    report: Mapping[str, Any]
    trace: Mapping[str, Any] | None
    target_toml: str
    shape_only: bool = False

    @classmethod
    def from_artifact(cls, artifact: Any) -> ReportSources:
        """From a loaded `aviatorc.plan.artifact.Artifact` (trace.json is optional)."""
        trace = json.loads(artifact.file_bytes("trace.json")) if "trace.json" in artifact.manifest["files"] else None
        return cls(artifact.plan, artifact.report, trace, artifact.target_toml, artifact.shape_only)

    @classmethod
    def from_files(cls, files: Mapping[str, bytes]) -> ReportSources:
        """From an artifact's files by name, before they are written (the compile's own report.html)."""
        trace = json.loads(files["trace.json"]) if "trace.json" in files else None
        return cls(Plan.from_dict(json.loads(files["plan.json"])), json.loads(files["report.json"]), trace,
                   files["target.toml"].decode(), "weights.safetensors" not in files)


def report_data(sources: ReportSources) -> dict[str, Any]:
    """Every section of the report, as JSON-ready data."""
    plan, report = sources.plan, sources.report
    prediction = to_json(plan.prediction)
    target = tomllib.loads(sources.target_toml)
    model = dict(report.get("model", {}))
    versions = {"aviatorc": _version("aviatorc"), "report_data": DATA_VERSION, "report_json": report.get("report_version"),
                "plan_schema": PLAN_SCHEMA_VERSION, "target_schema": target.get("schema_version")}
    versions |= {k: v for k, v in report.get("versions", {}).items() if isinstance(v, (str, int))}
    spans = trace_spans(sources.trace)
    makespan_us = max((end for _, _, _, _, end in spans), default=0.0)
    return {
        "format": DATA_FORMAT,
        "version": DATA_VERSION,
        "model": {"name": model.get("name", "?"), "source": report.get("source", "?"), "nodes": model.get("nodes"),
                  "parameters": model.get("parameters"), "shape_only": sources.shape_only},
        "target": target_summary(target, sources.target_toml),
        "workload": plan.workload.to_dict(),
        "options": dict(sorted(report.get("options", {}).items())),
        "versions": dict(sorted(versions.items())),
        "passes": [{"name": p["name"], "changed": p["changed"], "nodes_before": p.get("nodes_before"),
                    "nodes_after": p.get("nodes_after")} for p in report.get("passes", [])],
        "weights": dict(report.get("weights", {})),
        "placement": placement_cells(plan, report.get("placement", {}), target),
        "sram": sram_series(sources.trace, list(plan.chiplets), makespan_us),
        "timeline": timeline(spans, makespan_us),
        "accuracy": accuracy_section(report.get("accuracy")),
        "prediction": prediction_rows(prediction),
        "sweeps": sweeps(prediction.get("sweep", []), plan.workload.to_dict()),
        "memory": to_json(plan.memory),
        "notes": list(plan.notes) + list(report.get("placement", {}).get("warnings", [])),
    }


def _version(package: str) -> str:
    """An installed package's version (the report layer sits below `aviatorc`'s own top level)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "unknown"


# -- target and placement ------------------------------------------------------------------


def target_summary(target: Mapping[str, Any], text: str) -> dict[str, Any]:
    card, server, chiplet = target.get("card", {}), target.get("server", {}), target.get("chiplet", {})
    per_card = int(card.get("packages", 1)) * int(target.get("package", {}).get("chiplets", 1))
    return {"name": target.get("name", "?"), "description": target.get("description", ""),
            "cards": int(server.get("cards", 1)), "chiplets_per_card": per_card,
            "sram_bytes_per_chiplet": chiplet.get("sram_bytes"), "lpddr_bytes_per_s": card.get("lpddr_bytes_per_s"),
            "assumed": sorted(target.get("assumed", {})), "toml": text}


def layer_labels(roles: Mapping[int, set[str]]) -> dict[int, str]:
    """'embed', 'L0'..'L31', 'head': the partitioner numbers what comes before the first block -1
    and what comes after the last block one past it (`aviatorc.partition.weights`)."""
    labels = {layer: f"L{layer}" for layer in roles}
    if -1 in roles:
        labels[-1] = "embed" if roles[-1] <= {"embedding"} else "before L0"
    last = max(roles, default=-1)
    # After the last block: a head, named `lm_head` by a torch import, a plain `linear` by ONNX names.
    if last > 0 and (roles[last] & {"lm_head", "head"} or roles[last] <= {"linear"}):
        labels[last] = "head"
    return labels


def placement_cells(plan: Plan, placement: Mapping[str, Any], target: Mapping[str, Any]) -> dict[str, Any]:
    """The heatmap: one cell per (layer, chiplet) with tiles, plus per-chiplet totals."""
    roles: dict[int, set[str]] = defaultdict(set)
    cells: dict[tuple[int, int], dict[str, Any]] = {}
    weights: dict[tuple[int, int], dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for tile in plan.tiles:
        layer = tile.layer
        roles[layer].add(tile.role)
        resident = tile.chiplet is not None
        chiplet = tile.chiplet if tile.chiplet is not None else tile.compute_chiplet
        cell = cells.setdefault((layer, chiplet), {"layer": layer, "chiplet": chiplet, "resident_bytes": 0,
                                                   "streamed_bytes": 0, "resident_tiles": 0, "streamed_tiles": 0})
        cell["resident_bytes" if resident else "streamed_bytes"] += tile.bytes
        cell["resident_tiles" if resident else "streamed_tiles"] += 1
        entry = weights[(layer, chiplet)][tile.weight]
        entry[0] += 1
        entry[1] += tile.bytes
    labels = layer_labels(roles)
    out = []
    for key in sorted(cells):
        cell = cells[key]
        ranked = sorted(weights[key].items(), key=lambda kv: (-kv[1][1], kv[0]))
        detail = [f"{name} x{count} ({human_bytes(nbytes)})" for name, (count, nbytes) in ranked[:DETAIL_WEIGHTS]]
        if len(ranked) > DETAIL_WEIGHTS:
            detail.append(f"+{len(ranked) - DETAIL_WEIGHTS} more weights")
        out.append(cell | {"label": labels[key[0]], "detail": "; ".join(detail)})
    sram = target.get("chiplet", {}).get("sram_bytes")
    chiplets = [{"chiplet": int(c["chiplet"]), "bytes": int(c["bytes"]), "reserve_bytes": int(c.get("reserve_bytes", 0)),
                 "sram_bytes": int(c.get("sram_bytes", sram or 0)), "utilization": c.get("utilization")}
                for c in placement.get("chiplets", [])]
    peak = plan.prediction.sram_peak_bytes
    for c in chiplets:
        c["peak_bytes"] = int(peak.get(c["chiplet"], 0))
    return {"layers": [labels[layer] for layer in sorted(labels)], "chiplets": list(plan.chiplets),
            "cells": out, "tiles": len(plan.tiles), "chiplet_totals": chiplets,
            "status": placement.get("status"), "gap_to_bound": placement.get("gap_to_bound"),
            "resident_bytes": placement.get("resident_bytes"), "streamed_bytes": placement.get("streamed_bytes"),
            "cut_bytes_per_step": dict(placement.get("cut_bytes_per_step", {}))}


# -- the simulated decode step ---------------------------------------------------------------


def trace_spans(trace: Mapping[str, Any] | None) -> list[tuple[str, str, str, float, float]]:
    """(track, kind, name, start_us, end_us) of every span in a Chrome trace, in the trace's order."""
    if not trace:
        return []
    events = trace.get("traceEvents", [])
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    return [(names.get(e["tid"], f"track {e['tid']}"), e.get("cat", ""), e.get("name", ""), float(e["ts"]),
             float(e["ts"]) + float(e["dur"])) for e in events if e.get("ph") == "X"]


def timeline(spans: list[tuple[str, str, str, float, float]], makespan_us: float) -> dict[str, Any]:
    """Columns of the timeline's bars (`track` indexes `tracks`); spans merged per track and kind
    when there are more than MAX_SPANS, at the finest bar width that keeps MAX_BARS or fewer."""
    tracks = list(dict.fromkeys(track for track, *_ in spans))
    aggregated = len(spans) > MAX_SPANS
    width_us = 0.0
    if aggregated:
        width_us = makespan_us / TIMELINE_BINS
        bars = _merge(spans, width_us)
        while len(bars) > MAX_BARS and width_us < makespan_us:
            width_us *= 2
            bars = _merge(spans, width_us)
    else:
        bars = [(*s, 1) for s in spans]
    index = {track: i for i, track in enumerate(tracks)}
    kinds = sorted({kind for _, kind, *_ in bars})
    return {"tracks": tracks, "kinds": kinds, "makespan_us": round(makespan_us, 6), "spans": len(spans),
            "aggregated": aggregated, "bars": len(bars), "bar_us": round(width_us, 6),
            "track": [index[b[0]] for b in bars], "kind": [b[1] for b in bars],
            "name": [b[2][:80] if b[5] == 1 else "" for b in bars],  # a merged bar is named by its count
            "start_us": [round(b[3], 6) for b in bars], "end_us": [round(b[4], 6) for b in bars],
            "count": [b[5] for b in bars]}


def _merge(spans: list[tuple[str, str, str, float, float]], width_us: float) -> list[tuple[str, str, str, float, float, int]]:
    by_track: dict[tuple[str, str], list[tuple[float, float, str]]] = defaultdict(list)
    for track, kind, name, start, end in spans:
        by_track[(track, kind)].append((start, end, name))
    bars: list[tuple[str, str, str, float, float, int]] = []
    for (track, kind), items in by_track.items():
        items.sort()
        start, end, name, count = items[0][0], items[0][1], items[0][2], 1
        for s, e, n in items[1:]:
            # Merge across a gap under the width, and into a bar younger than the width: each bar
            # then starts a width after the last, so a track holds at most makespan / width + 1
            # bars per kind.
            if s - end <= width_us or s - start < width_us:
                end, count = max(end, e), count + 1
                continue
            bars.append((track, kind, name, start, end, count))
            start, end, name, count = s, e, n, 1
        bars.append((track, kind, name, start, end, count))
    return bars


def sram_series(trace: Mapping[str, Any] | None, chiplets: list[int], makespan_us: float) -> dict[str, Any]:
    """Bytes in use per chiplet over the decode step, as step points [time_us, bytes]."""
    samples: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for e in (trace or {}).get("traceEvents", []):
        if e.get("ph") == "C" and str(e.get("name", "")).startswith("SRAM chiplet "):
            samples[int(e["name"].rsplit(" ", 1)[1])].append((float(e["ts"]), int(e["args"]["bytes"])))
    series = {}
    reduced = False
    for chiplet in sorted(set(chiplets) | set(samples)):
        points = sorted(samples.get(chiplet, [(0.0, 0)]))
        if len(points) > MAX_SRAM_POINTS:
            points, reduced = _peaks(points, makespan_us or points[-1][0]), True
        if makespan_us > points[-1][0]:
            points.append((makespan_us, points[-1][1]))  # held to the end of the step
        series[str(chiplet)] = [[round(t, 6), b] for t, b in points]
    return {"series": series, "reduced": reduced, "makespan_us": round(makespan_us, 6)}


def _peaks(points: list[tuple[float, int]], span_us: float) -> list[tuple[float, int]]:
    """One point per interval of span / MAX_SRAM_POINTS: its largest value, at the interval's first sample."""
    width = span_us / MAX_SRAM_POINTS or 1.0
    buckets: dict[int, tuple[float, int]] = {}
    for t, b in points:
        key = int(t // width)
        if key not in buckets:
            buckets[key] = (t, b)
        elif b > buckets[key][1]:
            buckets[key] = (buckets[key][0], b)
    return [buckets[k] for k in sorted(buckets)]


# -- accuracy and predictions ------------------------------------------------------------------


def accuracy_section(accuracy: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The accuracy figures and where they were measured; None when the compile measured none."""
    if not accuracy:
        return None
    data = accuracy.get("data")
    split: Mapping[str, Any] = data if isinstance(data, Mapping) else {}
    held_out = split.get("held_out", accuracy.get("held_out"))
    note = split.get("note") or ""
    if held_out is True:
        provenance = "held-out: measured on batches calibration did not see"
    elif held_out is False:
        provenance = "in-sample: measured on the calibration batches themselves"
    else:
        provenance = "not stated by this artifact (its compile did not record whether the batches were held out)"
    return {"batches": accuracy.get("batches"), "held_out": held_out if isinstance(held_out, bool) else None,
            "provenance": provenance + (f"; {note}" if note else ""),
            "end_to_end": [dict(e) for e in accuracy.get("end_to_end", [])],
            "layers": [dict(layer) for layer in accuracy.get("layers", [])]}


PREDICTIONS = (  # (label, predicted key, bound key)
    ("time per token (decode)", "time_per_token_s", "token_s"),
    ("time to first token", "ttft_s", "ttft_s"),
    ("cold start to first token", "cold_start_s", "cold_s"),
)


def prediction_rows(prediction: Mapping[str, Any]) -> dict[str, Any]:
    bound = prediction.get("bound", {})
    rows = [{"what": label, "predicted_s": prediction[key], "bound_s": bound[bound_key],
             "ratio": prediction[key] / bound[bound_key] if bound[bound_key] else None,
             "binding": binding_term(bound, bound_key)}
            for label, key, bound_key in PREDICTIONS if key in prediction and bound_key in bound]
    return {"rows": rows, "efficiency": prediction.get("efficiency"), "ttft_efficiency": prediction.get("ttft_efficiency"),
            "tokens_per_s": prediction.get("tokens_per_s"),
            "cold_start_naive_order_s": prediction.get("cold_start_naive_order_s"),
            "bound_terms": dict(bound.get("token_terms", {})), "ttft_bound_terms": dict(bound.get("ttft_terms", {})),
            "ranges": {key: {k: r[k] for k in ("nominal", "low", "high")} for key, r in prediction.get("ranges", {}).items()}}


def binding_term(bound: Mapping[str, Any], figure: str) -> dict[str, Any] | None:
    """The largest term of a bounded figure ("token_s" or "ttft_s": the bound's `token_terms` or
    `ttft_terms`, whatever terms it holds), as {"term": "lpddr", "seconds": ..., "share": its share
    of the figure's bound}; None when the bound keeps no terms for that figure (the cold start)."""
    terms = bound.get(figure.removesuffix("_s") + "_terms")
    if not isinstance(terms, Mapping) or not terms:
        return None
    term, value = max(sorted(terms.items()), key=lambda kv: kv[1])  # sorted first: ties name the same term every run
    total = bound.get(figure)
    return {"term": str(term), "seconds": float(value), "share": value / total if total else None}


def binding_text(binding: Mapping[str, Any] | None) -> str:
    """"set by lpddr (1.234 ms)", or "" without a term."""
    return f"set by {binding['term']} ({seconds(binding['seconds'])})" if binding else ""


def sweep_reason(entry: Mapping[str, Any]) -> str:
    """Why a sweep point has no figures: "does not fit: <the reason the schedule gave>"."""
    reason = entry.get("reason")
    return f"does not fit: {reason}" if reason else "does not fit"


def sweeps(entries: list[Mapping[str, Any]], workload: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The batch sweep (at the compiled context) and the context sweep (at the compiled batch)."""
    context, batch = workload.get("context"), workload.get("batch")
    by_batch = sorted((dict(e) for e in entries if e.get("context") == context), key=lambda e: e["batch"])
    by_context = sorted((dict(e) for e in entries if e.get("batch") == batch), key=lambda e: e["context"])
    return {"batch": by_batch, "context": by_context}


def seconds(value: float | None) -> str:
    """A duration in the unit that reads best."""
    if value is None:
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(value) >= scale:
            return f"{value / scale:.3f} {unit}"
    return f"{value * 1e9:.1f} ns"
