"""The report as a terminal summary (rich): the predictions against their bounds, SRAM per
chiplet (chiplets with equal figures folded into one row), accuracy and its provenance, the
sweeps. Reads `report_data`'s result, like the HTML page."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aviatorc.report.data import binding_text, human_bytes, seconds, sweep_reason


def render_text(data: Mapping[str, Any], *, html_path: str | None = None) -> list[Any]:
    """Renderables for `rich.console.Console.print`, in order."""
    from rich.table import Table

    model, target, placement = data["model"], data["target"], data["placement"]
    out: list[Any] = [f"{model['name']} ({model['source']}) on {target['name']}: {placement['tiles']:,} tiles on "
                      f"{len(placement['chiplets'])} chiplets, placement {placement['status']}"
                      + (", shape-only" if model["shape_only"] else "")]
    latency = Table(title="predicted against the physical bound")
    for column in ("figure", "predicted", "bound", "predicted / bound", "the bound's largest term"):
        latency.add_column(column, justify="right" if column in ("predicted", "bound", "predicted / bound") else "left")
    for row in data["prediction"]["rows"]:
        latency.add_row(row["what"], seconds(row["predicted_s"]), seconds(row["bound_s"]),
                        f"{row['ratio']:.2f}" if row["ratio"] else "-", binding_text(row.get("binding")) or "-")
    out.append(latency)

    sram = Table(title="SRAM per chiplet")
    for column in ("chiplets", "weights resident", "reserved", "peak in decode", "of SRAM"):
        sram.add_column(column, justify="left" if column == "chiplets" else "right")
    for first, last, c in fold_chiplets(placement["chiplet_totals"]):
        share = c["peak_bytes"] / c["sram_bytes"] if c["sram_bytes"] else 0.0
        sram.add_row(str(first) if first == last else f"{first}-{last}", human_bytes(c["bytes"]),
                     human_bytes(c["reserve_bytes"]), human_bytes(c["peak_bytes"]), f"{share:.1%}")
    out.append(sram)

    accuracy = data["accuracy"]
    if accuracy:
        out.append(f"accuracy on {accuracy['batches']} batch(es), {accuracy['provenance']}")
        for e in accuracy["end_to_end"]:
            out.append(f"  {e['output']}: cosine {e['cosine']:.5f}, SQNR {e['sqnr_db']} dB"
                       + (f", perplexity {e['perplexity']:.3f} (fp32 {e['perplexity_reference']:.3f})"
                          if "perplexity" in e else ""))
        worst = sorted(accuracy["layers"], key=lambda e: _db(e["sqnr_db"]))[:5]
        if worst:
            out.append("  worst layers: " + ", ".join(f"{e['node']} {e['sqnr_db']} dB" for e in worst))
    else:
        out.append(f"accuracy: not measured; {ACCURACY_HOW}")

    sweeps = Table(title="sweeps: time per token")
    for column in ("batch", "context", "predicted", "bound", "tokens/s"):
        sweeps.add_column(column, justify="right")
    seen = set()
    for e in data["sweeps"]["batch"] + data["sweeps"]["context"]:
        key = (e["batch"], e["context"])
        if key in seen:
            continue
        seen.add(key)
        if e.get("fits"):
            sweeps.add_row(str(e["batch"]), str(e["context"]), seconds(e["time_per_token_s"]), seconds(e["bound_s"]),
                           f"{e['tokens_per_s']:,.1f}")
        else:
            sweeps.add_row(str(e["batch"]), str(e["context"]), sweep_reason(e), "", "")
    out.append(sweeps)
    if html_path:
        out.append(f"the HTML report (placement heatmap, SRAM over time, timeline): {html_path}")
    return out


# What a compile needs for accuracy figures: the same sentence in the terminal and on the page.
ACCURACY_HOW = ("compile with --quant (or --sparsity) and --calibration FILE.npz, or a decoder with --calibration-text "
                "FILE.txt: the figures are measured on held-out batches against the unquantized model")


def fold_chiplets(totals: list[Mapping[str, Any]]) -> list[tuple[int, int, Mapping[str, Any]]]:
    """Runs of consecutive chiplets with the same figures, as (first, last, figures)."""
    keys = ("bytes", "reserve_bytes", "peak_bytes", "sram_bytes")
    runs: list[tuple[int, int, Mapping[str, Any]]] = []
    for c in sorted(totals, key=lambda c: c["chiplet"]):
        if runs and runs[-1][1] == c["chiplet"] - 1 and all(runs[-1][2][k] == c[k] for k in keys):
            runs[-1] = (runs[-1][0], c["chiplet"], runs[-1][2])
        else:
            runs.append((c["chiplet"], c["chiplet"], c))
    return runs


def _db(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("inf")
