"""The compiler as one function of named stages: import, passes, accuracy, placement.

    art = aviatorc.compile("model.onnx", target="corsair", cards=4, quant="int4", calibration=batches)
    print(art.report.summary())
    art.save("build/model.avc")

The artifact directory holds the transformed IR (`graph.ir`) and `report.json`; later stages
(schedule, plan, runtime) add their files beside them. Saving writes to a temporary folder
and renames it into place, so a failed compile never leaves half-written output.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from aviatorc.errors import AviatorError, OptionError
from aviatorc.ir import Graph, print_graph
from aviatorc.ir.interpreter import check_feeds
from aviatorc.options import CompileOptions

REPORT_VERSION = 1
ARTIFACT_FILES = frozenset({"graph.ir", "report.json", "timings.json"})


@dataclass
class Report:
    """Everything the compile measured, as JSON-ready data; `summary()` is the short text form."""

    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return self.data

    def to_json(self) -> str:
        return json.dumps(self.data, indent=2, sort_keys=True) + "\n"

    def summary(self) -> str:
        model = self.data.get("model", {})
        lines = [f"model: {model.get('name', '?')}, {model.get('nodes', 0)} nodes, "
                 f"{model.get('parameters', 0):,} parameters"]
        for record in self.data.get("passes", []):
            stats = ", ".join(f"{k}={v}" for k, v in sorted(record["stats"].items()) if not isinstance(v, (dict, list)))
            lines.append(f"pass {record['name']}: {'changed' if record['changed'] else 'no change'}"
                         + (f" ({stats})" if stats else ""))
        weights = self.data.get("weights")
        if weights:
            lines.append(f"weights: {weights['total_bytes']:,} bytes ({weights['fp32_bytes']:,} at fp32)")
        for entry in self.data.get("accuracy", {}).get("end_to_end", []):
            text = f"accuracy of '{entry['output']}': cosine {entry['cosine']:.5f}, max |diff| {entry['max_abs_diff']:.4g}"
            if "perplexity" in entry:
                text += (f", top-1 agreement {entry['top1_agreement']:.3f}, perplexity {entry['perplexity']:.3f} "
                         f"(fp32 {entry['perplexity_reference']:.3f})")
            lines.append(text)
        placement = self.data.get("placement")
        if placement:
            lines.append(f"placement on {placement['target']}: {placement['status']}, "
                         f"{placement['objective_s'] * 1e6:.3f} us per decode step (weights), "
                         f"{placement['gap_to_bound']:.2%} above the lower bound; "
                         f"{placement['resident_bytes']:,} bytes resident, {placement['streamed_bytes']:,} streamed")
        return "\n".join(lines)


@dataclass
class CompileResult:
    """The transformed graph, its report, and (with a target) the placement."""

    graph: Graph
    report: Report
    options: CompileOptions
    placement: Any = None
    timings: dict[str, Any] = field(default_factory=dict)  # wall clock: kept out of report.json

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the artifact directory atomically: a temp folder renamed into place."""
        files = {"graph.ir": print_graph(self.graph), "report.json": self.report.to_json(),
                 "timings.json": json.dumps(self.timings, indent=2, sort_keys=True) + "\n"}
        return write_directory_atomically(Path(path), files)


def write_directory_atomically(out: Path, files: Mapping[str, str]) -> Path:
    """Write `files` into a fresh staging folder beside `out`, then rename it to `out`.

    An existing `out` is replaced only when it holds nothing but artifact files: a compile must
    never delete a user's folder."""
    out = Path(os.path.abspath(out))
    if out.exists() and not out.is_dir():
        raise OptionError(f"output '{out}' exists and is not a directory")
    if out.is_dir():
        foreign = sorted(p.name for p in out.iterdir() if p.name not in ARTIFACT_FILES)
        if foreign:
            raise OptionError(f"output '{out}' is a directory that is not an aviatorc artifact "
                              f"(it holds {', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''})",
                              hint="choose a new output path; only an earlier artifact is replaced")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for name, text in files.items():
            (staging / name).write_text(text)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
            os.replace(staging, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return out


def compile(  # noqa: A001 - the public verb is `aviatorc.compile`
    source: Any,
    example_inputs: Any = None,
    *,
    calibration: Iterable[Mapping[str, Any]] | None = None,
    log: Callable[[str], None] | None = None,
    **options: Any,
) -> CompileResult:
    """Import `source`, run the pass pipeline, measure accuracy, and place weights on the target.

    Options (see `CompileOptions`): target, cards, quant, group_size, symmetric, sparsity,
    sparsity_method, quant_method, keep_fp16, activations, fuse_qkv, passes,
    print_ir_after_change, seed; and for the partitioner: time_limit_s.
    """
    from aviatorc.frontends import import_model
    from aviatorc.inspect import summarize
    from aviatorc.passes.manager import PassContext, run_passes
    from aviatorc.passes.pipeline import build_pipeline

    log = log or (lambda text: None)
    time_limit_s = float(options.pop("time_limit_s", 30.0))
    if "keep_fp16" in options and options["keep_fp16"] is not None:
        options["keep_fp16"] = tuple(options["keep_fp16"])
    opts = make_options(options)
    target = _load_target(opts)
    log(f"importing {_describe(source)}")
    started = time.perf_counter()
    graph = import_model(source, example_inputs)
    timings: dict[str, Any] = {"import_s": round(time.perf_counter() - started, 3)}
    log(f"imported {len(graph.nodes)} nodes, {len(graph.initializers)} initializers in {timings['import_s']:.1f} s")
    batches = check_calibration(graph, calibration)
    reference = graph.clone() if batches and (opts.quant or opts.sparsity) else None

    report = Report({"report_version": REPORT_VERSION, "source": _describe(source),
                     "options": _options_dict(opts), "model": summarize(graph).to_dict()})
    ctx = PassContext(options=opts, target=target, calibration=batches, log=log)
    records = run_passes(graph, build_pipeline(opts), ctx)
    # Wall-clock figures go to timings.json, so report.json is byte-identical across runs.
    report.data["passes"] = [{k: v for k, v in r.to_dict().items() if k != "seconds"} for r in records]
    timings["passes_s"] = {f"{i}:{r.name}": round(r.seconds, 4) for i, r in enumerate(records)}
    report.data["weights"] = _weight_accounting(graph)
    if reference is not None:
        from aviatorc.accuracy import accuracy_report

        log("measuring accuracy against the fp32 model")
        report.data["accuracy"] = accuracy_report(reference, graph, batches or [])
    placement = None
    if target is not None:
        from aviatorc.partition import partition
        from aviatorc.partition.weights import weights_from_graph

        log(f"partitioning onto {target.name}")
        placement = partition(weights_from_graph(graph), target, time_limit_s=time_limit_s, seed=opts.seed)
        report.data["placement"] = {k: v for k, v in placement.to_dict().items() if k != "solve_time_s"}
        timings["partition_s"] = placement.solve_time_s
    return CompileResult(graph, report, opts, placement, timings)


def make_options(options: dict[str, Any]) -> CompileOptions:
    """CompileOptions from keyword options; an unknown keyword gets a did-you-mean."""
    import dataclasses
    import difflib

    known = {f.name for f in dataclasses.fields(CompileOptions) if f.name != "extra"}
    for key in options:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known | {"time_limit_s"}), n=1)
            raise OptionError(f"unknown compile option '{key}'",
                              hint=f"did you mean '{close[0]}'?" if close else f"options are {', '.join(sorted(known))}")
    return CompileOptions(**options)


def _load_target(opts: CompileOptions) -> Any:
    if opts.target is None:
        if opts.cards is not None:
            raise OptionError("cards (--cards) needs a target", hint="add target='corsair' (--target corsair)")
        return None
    from aviatorc.target import load_target

    return load_target(opts.target, cards=opts.cards)


def check_calibration(graph: Graph, batches: Iterable[Mapping[str, Any]] | None) -> list[dict[str, np.ndarray]] | None:
    """Calibration batches as checked feed dicts; a mismatch names the batch and the input."""
    if batches is None:
        return None
    checked = []
    for index, batch in enumerate(batches):
        try:
            checked.append(check_feeds(graph, batch))
        except AviatorError as error:
            raise OptionError(f"calibration batch {index} does not match the model: {error.message}",
                              hint=error.hint) from None
    if not checked:
        raise OptionError("calibration data holds no batches")
    return checked


def load_calibration_npz(path: str | os.PathLike[str]) -> list[dict[str, np.ndarray]]:
    """Calibration batches from an .npz file: each key is an input name, its first axis indexes batches."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files}
    except (OSError, ValueError) as error:
        raise OptionError(f"cannot read calibration data: {error}", file=str(path)) from None
    if not arrays:
        raise OptionError("calibration file holds no arrays", file=str(path))
    counts = {key: a.shape[0] if a.ndim else 0 for key, a in arrays.items()}
    if len(set(counts.values())) != 1 or 0 in counts.values():
        raise OptionError(f"calibration arrays disagree on the number of batches (first axis): {counts}",
                          file=str(path))
    n = next(iter(counts.values()))
    return [{key: a[i] for key, a in arrays.items()} for i in range(n)]


def _weight_accounting(graph: Graph) -> dict[str, Any]:
    """Bytes of every weight in its stored format, counted by the partitioner's own tiling code."""
    from aviatorc.partition.weights import weights_from_graph

    weights = weights_from_graph(graph)
    by_format: dict[str, int] = {}
    for w in weights:
        by_format[w.format.name] = by_format.get(w.format.name, 0) + w.format.storage_bytes(w.k, w.n)
    return {
        "count": len(weights),
        "total_bytes": sum(by_format.values()),
        "fp32_bytes": sum(w.k * w.n * 4 for w in weights),
        "bytes_by_format": dict(sorted(by_format.items())),
    }


def _describe(source: Any) -> str:
    if isinstance(source, (str, os.PathLike)):
        return str(source)
    return type(source).__name__


def _options_dict(opts: CompileOptions) -> dict[str, Any]:
    out = {}
    for key, value in vars(opts).items():
        if key == "extra":
            continue
        out[key] = list(value) if isinstance(value, tuple) else value
    return out
