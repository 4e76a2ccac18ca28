"""The side by side in onnxruntime for tools/bench_quant.py (issue 9): our quantization, compiled and
exported, against onnxruntime's own quantizers, on the same runtime and measured the same way.

Rows, all run in onnxruntime (CPU):
- the fp32 ONNX export every other row starts from (a sanity row: it should match torch);
- onnxruntime's `quantize_dynamic` (INT8 weights *and* activations, per tensor or per channel) and
  its weight-only `MatMulNBitsQuantizer` (round-to-nearest, 4 and 8 bits, blocks of 32 / 64 / 128,
  symmetric and asymmetric) applied to that export;
- ours: the same export compiled by `aviatorc.compile` (target `mock`, the calibration batches,
  the evaluation batch as `evaluation=`), saved, and written by `aviatorc.export` as QDQ and, where
  the weights are blocked, as `com.microsoft.MatMulNBits` too (the same codes in both).

Every row gets one session with the same options (`SESSION_CONFIG`): one intra-op and one inter-op
thread, sequential execution, and `session.qdq_matmulnbits_accuracy_level = 0`, without which
onnxruntime fuses a 4-bit DequantizeLinear + MatMul into MatMulNBits at accuracy level 4 and
quantizes the activations to int8 (docs/export.md); it changes nothing in a file without 4-bit QDQ.
Latency is the median of `runs` timed runs of the whole evaluation batch per row, after one warm-up
run; the rows take turns (round-robin), so a change in the machine's load reaches every row alike
and ratios within one run are meaningful. File bytes are the .onnx file plus any external data it
names.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

SESSION_CONFIG = {"session.qdq_matmulnbits_accuracy_level": "0"}
# onnxruntime's MatMulNBits rows: (bits, block, symmetric). The 8-bit block 128 / 32 and 4-bit
# block 32 / 128 rows of earlier runs keep their labels, so the page's before-and-after has them.
MATMUL_NBITS = ((8, 128, False), (8, 128, True), (8, 32, True), (4, 32, True), (4, 32, False), (4, 64, True),
                (4, 64, False), (4, 128, True), (4, 128, False))


@dataclass(frozen=True)
class Ours:
    """One of our compiles: `quant_method` None is the compile's default for the format."""

    label: str
    quant: str
    group_size: int | None  # None: per output channel (int8)
    quant_method: str | None = None

    @property
    def bits(self) -> int:
        return 4 if self.quant == "int4" else 8


OURS = (
    Ours("INT8 per channel", "int8", None),
    Ours("INT8 per channel", "int8", None, "gptq"),
    Ours("INT8 g128", "int8", 128),
    Ours("INT8 g128", "int8", 128, "gptq"),
    Ours("INT4 g32", "int4", 32),
    Ours("INT4 g64", "int4", 64),
    Ours("INT4 g128", "int4", 128),
)
QUICK = ("INT8 per channel", "INT4 g32")


@dataclass(frozen=True)
class Workload:
    """What one model brings to the side by side.

    `score` turns the session's first output on `feeds` into the row's figures (MiniLM: mean and
    worst cosine; SmolLM2: perplexity and top-1 agreement)."""

    onnx_path: Path  # the fp32 export
    feeds: dict[str, np.ndarray]  # the evaluation batch: scored, timed, and given as `evaluation=`
    score: Callable[[np.ndarray], dict[str, float]]
    calibration: list[dict[str, np.ndarray]]
    runs: int  # timed runs per row


@dataclass
class Measured:
    """A row and the session that timed it (kept open for the round-robin latency runs)."""

    row: dict[str, Any]
    session: Any
    times_s: list[float] = field(default_factory=list)


def session(path: Path) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    for key, value in SESSION_CONFIG.items():
        options.add_session_config_entry(key, value)
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def file_bytes(path: Path) -> int:
    """The ONNX file and every external data file its initializers name."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    locations = {entry.value for tensor in model.graph.initializer
                 if tensor.data_location == onnx.TensorProto.EXTERNAL
                 for entry in tensor.external_data if entry.key == "location"}
    return os.path.getsize(path) + sum(os.path.getsize(path.parent / name) for name in sorted(locations))


def token_table_dtype(path: Path) -> str:
    """How the file stores its largest Gather table (the token embedding): each tool chooses its own,
    and it is a large part of a small model's file."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    tensors = {t.name: t for t in model.graph.initializer}
    producers = {out: node for node in model.graph.node for out in node.output}
    best: tuple[int, str] = (0, "")
    for node in model.graph.node:
        if node.op_type != "Gather":
            continue
        name = node.input[0]
        while name not in tensors and name in producers and producers[name].op_type in ("Cast", "DequantizeLinear"):
            name = producers[name].input[0]  # through the graph's own Cast or a DequantizeLinear
        if name in tensors:
            size = math.prod(tensors[name].dims)
            best = max(best, (size, onnx.helper.tensor_dtype_to_np_dtype(tensors[name].data_type).name))
    return best[1]


def run_side_by_side(work: Workload, folder: Path, quick: bool) -> dict[str, Any]:
    """Every row of the side by side, measured; `folder` receives the files."""
    import onnxruntime as ort

    start = time.time()
    measured = [measure(work, "onnxruntime", "fp32 export (sanity)", work.onnx_path, bits=32, block=None,
                        encoding="fp32")]
    measured += onnxruntime_rows(work, folder)
    measured += our_rows(work, folder, quick)
    load_before = os.getloadavg()
    time_round_robin(work, measured)
    meta = {"runs": work.runs, "threads": 1, "onnxruntime": ort.__version__, "session_config": SESSION_CONFIG,
            "feed_shapes": {n: list(a.shape) for n, a in sorted(work.feeds.items())},
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
            "seconds": time.time() - start}
    return {"meta": meta, "rows": [m.row for m in measured]}


def measure(work: Workload, who: str, config: str, path: Path, *, bits: int, block: int | None, encoding: str,
            **extra: Any) -> Measured:
    """Open `path`, score it on the evaluation batch (this first run also warms the session)."""
    sess = session(path)
    scores = work.score(sess.run(None, work.feeds)[0])
    row = {"who": who, "config": config, "bits": bits, "block": block, "encoding": encoding,
           "file_bytes": file_bytes(path), "token_table": token_table_dtype(path), **scores, **extra}
    shown = "  ".join(f"{k} {v:.5f}" for k, v in scores.items())
    print(f"  ort {who:<11} {config:<52} {shown}  {row['file_bytes'] / 1e6:6.1f} MB", flush=True)
    return Measured(row, sess)


def onnxruntime_rows(work: Workload, folder: Path) -> list[Measured]:
    """onnxruntime's quantizers on the fp32 export: `quantize_dynamic` and `MatMulNBitsQuantizer`."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)  # a line a node
    rows = []
    for per_channel in (False, True):
        out = folder / f"ort_dynamic_{'channel' if per_channel else 'tensor'}.onnx"
        quantize_dynamic(str(work.onnx_path), str(out), weight_type=QuantType.QInt8, per_channel=per_channel)
        rows.append(measure(work, "onnxruntime", f"quantize_dynamic INT8 W+A {'per channel' if per_channel else 'per tensor'}",
                            out, bits=8, block=None, encoding="QOperator (MatMulInteger)", calibrated=False))
    for bits, block, sym in MATMUL_NBITS:
        out = folder / f"ort_nbits_{bits}_{block}_{'sym' if sym else 'asym'}.onnx"
        label = f"MatMulNBits {bits}-bit block {block} {'sym' if sym else 'asym'} (weight-only)"
        quantizer = MatMulNBitsQuantizer(onnx.load(str(work.onnx_path)), bits=bits, block_size=block, is_symmetric=sym)
        quantizer.process()
        quantizer.model.save_model_to_file(str(out), use_external_data_format=False)
        rows.append(measure(work, "onnxruntime", label, out, bits=bits, block=block, encoding="MatMulNBits",
                            calibrated=False))
    return rows


def our_rows(work: Workload, folder: Path, quick: bool) -> list[Measured]:
    """Each of `OURS` compiled, saved and exported: QDQ, and MatMulNBits where the weights are blocked."""
    import aviatorc

    rows = []
    for spec in OURS:
        if quick and (spec.label not in QUICK or spec.quant_method is not None):
            continue
        start = time.time()
        result = aviatorc.compile(str(work.onnx_path), target="mock", quant=spec.quant, group_size=spec.group_size,
                                  quant_method=spec.quant_method, calibration=work.calibration,
                                  evaluation=[work.feeds])
        seconds = time.time() - start
        stats = next(r["stats"] for r in result.report.data["passes"] if r["name"] == "quantize")
        method = str(stats["method"])
        zero_points = " asym" if "-asym" in str(stats["format"]) else " sym"  # as the passes chose (int4_zero)
        name = f"{spec.label} {method.upper()}{zero_points if spec.quant == 'int4' else ''}"
        name += " (default)" if spec.quant_method is None else ""
        artifact = result.save(folder / f"{spec.quant}_{spec.group_size}_{method}.avc", html_report=False)
        extra = {"calibrated": method != "rtn", "default": spec.quant_method is None, "method": method,
                 "format": stats["format"], "compile_s": seconds}
        encodings = ("QDQ", "MatMulNBits") if spec.group_size else ("QDQ",)
        for encoding in encodings:
            path = folder / f"{artifact.stem}_{encoding.lower()}" / "model.onnx"
            aviatorc.export(artifact, path, matmul_nbits=encoding == "MatMulNBits")
            rows.append(measure(work, "aviatorc", f"{name}, {encoding}", path, bits=spec.bits, block=spec.group_size,
                                encoding=encoding, **extra))
    return rows


def time_round_robin(work: Workload, measured: list[Measured]) -> None:
    """One warm-up run each, then `work.runs` rounds in which every row runs the batch once."""
    for m in measured:
        m.session.run(None, work.feeds)
    for _ in range(work.runs):
        for m in measured:
            start = time.perf_counter()
            m.session.run(None, work.feeds)
            m.times_s.append(time.perf_counter() - start)
    for m in measured:
        m.row["latency_s"] = statistics.median(m.times_s)
        m.row["latency_runs_s"] = [round(t, 6) for t in m.times_s]


# -- the page: the table and the goals, from the saved rows alone --------------------------------


@dataclass(frozen=True)
class Score:
    """The figure a model's rows are ranked by, and the held-out goal for its default INT4 g32."""

    key: str  # "mean" (cosine) or "ppl"
    higher_is_better: bool
    default_goal: str  # the third goal's words
    default_met: Callable[[dict[str, Any], dict[str, Any]], bool]  # (row, fp32 export row) -> met

    def show(self, r: dict[str, Any]) -> str:
        """The row's figures: mean / worst cosine, or perplexity and top-1 agreement."""
        if self.key == "mean":
            return f"{r['mean']:.5f} / {r['worst']:.5f}"
        return f"{r['ppl']:.3f} (top-1 {r['top1']:.3f})"

    def better(self, a: dict[str, Any], b: dict[str, Any]) -> bool:
        return a[self.key] > b[self.key] if self.higher_is_better else a[self.key] < b[self.key]

    def best(self, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
        usable = [r for r in rows if not math.isnan(r[self.key])]
        if not usable:
            return None
        return max(usable, key=lambda r: r[self.key]) if self.higher_is_better else min(usable, key=lambda r: r[self.key])


COSINE = Score("mean", True, "the default calibrated INT4 g32 at 0.99 mean cosine or better on the held-out sentences",
               lambda row, fp32: row["mean"] >= 0.99)
PERPLEXITY = Score("ppl", False, "the default calibrated INT4 g32 within 10% of the fp32 export's perplexity on the "
                   "held-out text", lambda row, fp32: row["ppl"] <= 1.10 * fp32["ppl"])


def render_table(side: dict[str, Any], columns: tuple[tuple[str, str, int], ...], held_out: str) -> list[str]:
    """The side-by-side section; `columns` are (key, heading, digits) of the model's figures."""
    meta, rows = side["meta"], side["rows"]
    fp32 = rows[0]
    shapes = ", ".join(f"{n} {'x'.join(map(str, s))}" for n, s in meta["feed_shapes"].items())
    config = ", ".join(f"`{k} = {v}`" for k, v in meta["session_config"].items())
    lines = ["## Side by side in onnxruntime", "",
             "One runtime, our weights against onnxruntime's: every row is an ONNX file run by onnxruntime "
             f"{meta['onnxruntime']} (CPU). The fp32 export (legacy exporter, opset 17) is what onnxruntime's "
             "`quantize_dynamic` (INT8 weights and activations) and `MatMulNBitsQuantizer` (weight-only, "
             "round-to-nearest) quantize, and what `aviatorc.compile` compiles (target `mock`, the calibration "
             "batches above, the evaluation batch as `evaluation=`, so calibration keeps all its batches); "
             "`aviatorc.export` then writes the artifact's exact codes and scales as QDQ (DequantizeLinear) and, "
             "where the weights are blocked, as MatMulNBits (the same codes and scales). Our rows leave "
             "`symmetric` at the compile's default; those marked (default) leave `quant_method` to it too, and "
             f"the label names the method it chose. {held_out}", "",
             f"Every session is the same: one intra-op and one inter-op thread, sequential, and {config}: without "
             "it onnxruntime fuses our 4-bit DequantizeLinear + MatMul into MatMulNBits at accuracy level 4, "
             "which quantizes the activations to int8 (docs/export.md); files without 4-bit QDQ are unaffected. "
             f"Latency: median of {meta['runs']} runs of the whole evaluation batch ({shapes}) after a warm-up "
             f"run, the rows taking turns; the machine has {meta['cpus']} CPUs shared with other jobs (load "
             f"average {meta['load_average_before'][0]:.2f} before the timed runs, "
             f"{meta['load_average_after'][0]:.2f} after), so compare latencies as ratios within this run. "
             "File bytes: the .onnx file with any external data; how each file stores its token table (the "
             "largest Gather table, a large part of a small model's bytes) is each tool's own choice, shown in "
             "the last column.", "",
             "| who | config | bits | block | " + " | ".join(c[1] for c in columns)
             + " | file bytes | latency ms | vs fp32 latency | token table |",
             "|---|---|---:|---:|" + "---:|" * len(columns) + "---:|---:|---:|---|"]
    for r in rows:
        figures = " | ".join(number(r[key], digits) for key, _, digits in columns)
        lines.append(f"| {r['who']} | {r['config']} | {r['bits']} | {r['block'] or '-'} | {figures} "
                     f"| {r['file_bytes']:,} | {r['latency_s'] * 1e3:.1f} | {r['latency_s'] / fp32['latency_s']:.2f}x "
                     f"| {r['token_table']} |")
    lines.append("")
    return lines


def goal_lines(side: dict[str, Any] | None, score: Score) -> list[str]:
    """The issue's three side-by-side goals, each computed from the rows."""
    if not side:
        return ["- Not measured in this run."]
    rows = side["rows"]
    ours = [r for r in rows if r["who"] == "aviatorc"]
    theirs = [r for r in rows if r["who"] == "onnxruntime" and r["bits"] < 32]

    def show(r: dict[str, Any] | None) -> str:
        return "none" if r is None else f"{r['config']} {score.show(r)}"

    lines = []
    best_ours = score.best([r for r in ours if r["bits"] == 8])
    best_theirs = score.best([r for r in theirs if r["bits"] == 8])
    met = best_ours is not None and best_theirs is not None and not score.better(best_theirs, best_ours)
    lines.append(f"- Our best 8-bit at or above onnxruntime's best 8-bit (by {score.key}): {'met' if met else 'not met'}; "
                 f"ours {show(best_ours)}, theirs {show(best_theirs)}.")
    blocks = sorted({r["block"] for r in theirs if r["bits"] == 4})
    verdicts = []
    for block in blocks:
        mine = score.best([r for r in ours if r["bits"] == 4 and r["block"] == block and r.get("calibrated")])
        peer = score.best([r for r in theirs if r["bits"] == 4 and r["block"] == block])
        ok = mine is not None and peer is not None and score.better(mine, peer)
        verdicts.append((ok, f"block {block}: ours {show(mine)}, theirs {show(peer)}"))
    met = bool(verdicts) and all(ok for ok, _ in verdicts)
    lines.append(f"- Our calibrated INT4 above onnxruntime's best 4-bit at every block size (by {score.key}): "
                 f"{'met' if met else 'not met'}; " + "; ".join(text for _, text in verdicts) + ".")
    defaults = [r for r in ours if r.get("default") and r["bits"] == 4 and r["block"] == 32]
    met = bool(defaults) and all(score.default_met(r, rows[0]) for r in defaults)
    lines.append(f"- {score.default_goal[0].upper()}{score.default_goal[1:]}: {'met' if met else 'not met'}; "
                 + ("; ".join(f"{r['config']} {score.show(r)}" for r in defaults) or "no such row") + ".")
    return lines


def number(x: float | None, digits: int = 5) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x:.{digits}f}"
