"""The compiler as one function of named stages: import, passes, accuracy, memory, placement,
schedule.

    art = aviatorc.compile("model.onnx", target="corsair", cards=4, quant="int4", calibration=batches)
    print(art.report.summary())
    art.save("build/model.avc")             # aviatorc.load("build/model.avc") reads it back

Why this order: the memory plan (KV cache, activations, staging) is sized from the model before
partitioning, so the partitioner places weights only in the SRAM that is really left; the
schedule then reads the placement. The artifact (`aviatorc.plan.artifact`) is written to a
temporary folder and renamed into place, so a failed compile never leaves half-written output.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from aviatorc.errors import AviatorError, OptionError
from aviatorc.ir import Graph, print_graph
from aviatorc.ir.interpreter import check_feeds
from aviatorc.options import CompileOptions
from aviatorc.progress import fan_out, stage
from aviatorc.workload import check_model_bounds, check_plan_bounds, estimate_plan

REPORT_VERSION = 1
_logger = logging.getLogger("aviatorc.compile")


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
        accuracy = self.data.get("accuracy", {})
        split = "held-out" if accuracy.get("data", {}).get("held_out") else "in-sample"
        for entry in accuracy.get("end_to_end", []):
            text = f"{split} accuracy of '{entry['output']}': cosine {entry['cosine']:.5f}, max |diff| {entry['max_abs_diff']:.4g}"
            if "perplexity" in entry:
                text += (f", top-1 agreement {entry['top1_agreement']:.3f}, perplexity {entry['perplexity']:.3f} "
                         f"(fp32 {entry['perplexity_reference']:.3f})")
            lines.append(text)
        if self.data.get("weights", {}).get("storage_note"):
            lines.append(self.data["weights"]["storage_note"])
        placement = self.data.get("placement")
        if placement:
            from aviatorc.partition.report import BOUND_LEAVES_OUT  # said where the gap is shown

            lines.append(f"placement on {placement['target']}: {placement['status']}, "
                         f"{placement['objective_s'] * 1e6:.3f} us per decode step (weights), "
                         f"{placement['gap_to_bound']:.2%} above the lower bound ({BOUND_LEAVES_OUT}); "
                         f"{placement['resident_bytes']:,} bytes resident, {placement['streamed_bytes']:,} streamed")
            if placement.get("solver", "greedy") != "greedy":
                lines.append(f"solver {placement['solver_note']}")
        plan = self.data.get("plan")
        if plan:
            lines += plan_summary(plan)
            if self.data.get("model", {}).get("shape_only"):
                lines.append("shape-only model: the artifact holds the plan but no weights (weights.safetensors "
                             "is not written)")
        return "\n".join(lines)


def plan_summary(plan: Mapping[str, Any]) -> list[str]:
    """The predicted figures, each with the range the target's assumed figures span and next to
    its physical bound (naming the term that sets it), and under them what the prediction leaves out."""
    from aviatorc.report.data import binding_term, binding_text, seconds

    p, memory = plan["prediction"], plan["memory"]
    bound = p["bound"]
    ranges = p.get("ranges", {})

    def largest(figure: str) -> str:  # the bound's largest term
        text = binding_text(binding_term(bound, figure))
        return f", {text}" if text else ""

    notes = [f"  (prediction: {note})" for note in plan.get("notes", [])]

    def span(key: str) -> str:
        r = ranges.get(key)
        if not r or r["low"] == r["high"]:
            return ""
        moved = {k: abs(b - a) for k, (a, b) in r["sensitivity"].items()}
        most = max(sorted(moved), key=lambda k: moved[k]) if moved else ""
        return (f" [{seconds(r['low'])} to {seconds(r['high'])} over the assumed figures"
                + (f"; most sensitive to {most}" if most and moved[most] > 0 else "") + "]")

    return [
        f"predicted decode: {seconds(p['time_per_token_s'])} per step{span('time_per_token_s')}, "
        f"{p['tokens_per_s']:,.1f} tokens/s; bound {seconds(bound['token_s'])}{largest('token_s')}; "
        f"efficiency {p['efficiency']:.3f}",
        *_routing_line(p.get("routing")),
        f"predicted time to first token: {seconds(p['ttft_s'])}{span('ttft_s')} (bound {seconds(bound['ttft_s'])}"
        f"{largest('ttft_s')})",
        f"cold start to first token {seconds(p['cold_start_s'])}{span('cold_start_s')} (bound {seconds(bound['cold_s'])}; "
        f"{seconds(p['cold_start_naive_order_s'])} loading in name order)",
        *notes,
        f"SRAM: KV cache {memory['kv_bytes']:,} bytes in {memory['kv_location']}{_kv_kept(memory)} ({memory['kv_dtype']}"
        + (f"; each sequence keeps its first {memory['kv_sinks']} and last {memory['kv_recent']:,} to "
           f"{2 * memory['kv_recent']:,} positions"
           if memory.get("kv_recent") else "") + "), "
        f"staging {memory['staging_bytes_per_chiplet']:,} "
        + (f"(prefill {memory['prefill_staging_bytes_per_chiplet']:,}) "
           if memory.get("prefill_staging_bytes_per_chiplet", 0) > memory['staging_bytes_per_chiplet'] else "")
        + f"and activations {memory['scratch_bytes_per_chiplet']:,} bytes per chiplet",
        f"prefill: {_prefill_schedule(p['prefill'], memory)}",
    ]


def _routing_line(routing: Mapping[str, Any] | None) -> list[str]:
    """A mixture of experts' decode step over its sampled routings (empty for other models)."""
    from aviatorc.report.data import seconds

    if not routing:
        return []
    return [f"  routing {routing['source']}: {routing['experts_per_step']:,.1f} of {routing['experts_total']:,} experts "
            f"a step in expectation; over {routing['samples']} sampled routings P50 {seconds(routing['p50_s'])}, "
            f"P99 {seconds(routing['p99_s'])} ({seconds(routing['all_experts_s'])} with every expert firing)"]


def _prefill_schedule(prefill: dict[str, Any], memory: dict[str, Any]) -> str:
    passes, tokens = prefill.get("chunks", 1), prefill.get("chunk_tokens", 0)
    copies = memory.get("prefill_copies") or {}
    by_card = f"; each layer on its home's card, {len(copies):,} streamed tile(s) read from a copy there" if copies else ""
    if memory.get("prefill_block_tokens"):
        return (f"weight-stationary, {passes} pass(es) of {tokens:,} tokens, each streaming the weights once "
                f"(blocks of {memory['prefill_block_tokens']:,} tokens){by_card}")
    return f"chunked, {passes} chunk(s) of {tokens:,} tokens, each streaming the weights again"


@dataclass
class CompileResult:
    """The transformed graph, its report, the placement and the plan."""

    graph: Graph
    report: Report
    options: CompileOptions
    placement: Any = None
    plan: Any = None
    target: Any = None
    timings: dict[str, Any] = field(default_factory=dict)  # wall clock: never written, so the artifact is reproducible

    def artifact_files(self, *, html_report: bool = True) -> dict[str, bytes]:
        """The artifact's files by name (see `aviatorc.plan.artifact`); with `html_report`, also
        report.html (`aviatorc.report`), rendered from what the other files hold so that `aviatorc
        report -o` on the saved artifact gives the same bytes."""
        from aviatorc.plan.artifact import WEIGHTS, encode_tensors, to_json_bytes
        from aviatorc.plan.weights import pack_weights

        files = {"graph.ir": print_graph(self.graph).encode(), "report.json": self.report.to_json().encode()}
        if self.plan is None:
            return files
        tensors = pack_weights(self.graph, self.placement)
        if tensors is not None:
            files[WEIGHTS], self.plan.tensor_dtypes = encode_tensors(tensors)
        files["plan.json"] = to_json_bytes(self.plan.to_dict(), compact=True)
        files["target.toml"] = self.target.to_toml().encode()
        files["trace.json"] = to_json_bytes(self.plan.trace or {}, compact=True)
        if html_report:
            from aviatorc.report import ReportSources, render_html, report_data

            # The plan in memory is the one plan.json holds (loading gives it back field for field),
            # so the page is not read back from the bytes just written.
            sources = ReportSources(self.plan, json.loads(files["report.json"]), json.loads(files["trace.json"]),
                                    files["target.toml"].decode(), WEIGHTS not in files)
            files["report.html"] = render_html(report_data(sources)).encode()
        return files

    def save(self, path: str | os.PathLike[str], *, html_report: bool = True) -> Path:
        """Write the artifact directory atomically: a temp folder renamed into place."""
        from aviatorc.plan.artifact import write_artifact

        return write_artifact(path, self.artifact_files(html_report=html_report))


def compile(  # noqa: A001 - the public verb is `aviatorc.compile`
    source: Any,
    example_inputs: Any = None,
    *,
    calibration: Iterable[Mapping[str, Any]] | None = None,
    evaluation: Iterable[Mapping[str, Any]] | None = None,
    calibration_text: str | None = None,
    tokenizer: str | os.PathLike[str] | None = None,
    log: Callable[[str], None] | None = None,
    **options: Any,
) -> CompileResult:
    """Import `source`, run the pass pipeline, measure accuracy, and place weights on the target.

    Options (see `CompileOptions`): target, cards, quant, group_size, symmetric, sparsity,
    sparsity_method, quant_method, keep_fp16, activations, fuse_qkv, passes,
    print_ir_after_change, seed; and for the partitioner: time_limit_s.

    Progress is logged with `logging` (loggers under "aviatorc"; records of long stages carry
    `aviatorc.progress.Progress`); nothing is configured here. `log`, when given, is also handed
    each line, and the IR that print_ir_after_change prints (to stdout without `log`).

    `calibration_text` (plain text) calibrates a decoder instead of `calibration` batches: it is
    tokenized with the model's own tokenizer (a GGUF source's, or `tokenizer`: a folder or .gguf
    file) and cut into prompts (`aviatorc.runtime.text.text_batches`).

    Accuracy is measured on `evaluation` (feed dicts, as `calibration`) when given; otherwise on
    the last quarter of the calibration batches, which calibration then does not see
    (`evaluation_split`); with one calibration batch, on that batch, and the report says it is
    in-sample.
    """
    from aviatorc.frontends import import_model
    from aviatorc.inspect import summarize
    from aviatorc.passes.manager import PassContext, run_passes
    from aviatorc.passes.pipeline import build_pipeline

    # Progress goes to `logging` (the CLI draws it); `log` also gets each line, as it always has.
    echo = log
    log = fan_out(_logger, echo)
    time_limit_s = float(options.pop("time_limit_s", 30.0))
    if "keep_fp16" in options and options["keep_fp16"] is not None:
        options["keep_fp16"] = tuple(options["keep_fp16"])
    opts = make_options(options)
    target = _load_target(opts)
    storage_note = None
    if opts.quant is None and "fp32" not in target.weight_formats:
        # The card has no fp32 storage: keep unquantized weights in its native 16-bit format.
        native = "fp16" if "fp16" in target.weight_formats else "bf16"
        opts = dataclasses.replace(opts, quant=native)
        storage_note = (f"target '{target.name}' has no fp32 weights: unquantized weights are stored as {native} "
                        "(pass quant= / --quant to choose a format)")
        log(storage_note)
    started = time.perf_counter()
    with stage(_logger, f"importing {_describe(source)}", echo=echo) as task:
        graph = import_model(source, example_inputs)
        task.finish(f"{len(graph.nodes)} nodes, {len(graph.initializers)} initializers")
    check_model_bounds(graph, context=opts.context, prompt=opts.prompt, decoder=False)  # before the passes' time
    if calibration_text is not None:
        if calibration is not None:
            raise OptionError("give calibration batches or calibration text, not both")
        calibration = _text_calibration(graph, calibration_text, tokenizer)
    timings: dict[str, Any] = {"import_s": round(time.perf_counter() - started, 3)}
    batches, held_out, split = evaluation_split(check_calibration(graph, calibration),
                                                check_calibration(graph, evaluation, what="evaluation"))
    rounding = _sixteen_bit_error(graph, opts.quant) if storage_note is not None else None

    report = Report({"report_version": REPORT_VERSION, "source": _describe(source),
                     "options": _options_dict(opts), "model": summarize(graph).to_dict()})
    ctx = PassContext(options=opts, target=target, calibration=batches, log=echo)
    pipeline = build_pipeline(opts)
    lossy = next((i for i, p in enumerate(pipeline) if not p.exact), len(pipeline))
    records = run_passes(graph, pipeline[:lossy], ctx)
    # The reference: the graph after the exact passes (cleanup, fuse-qkv), so that every weight
    # the lossy ones rewrite, a fused one too, has a same-named float MatMul to compare with.
    reference = graph.clone() if held_out and lossy < len(pipeline) else None
    records += run_passes(graph, pipeline[lossy:], ctx, history=[r.name for r in records])
    # Wall-clock figures go to timings.json, so report.json is byte-identical across runs.
    report.data["passes"] = [{k: v for k, v in r.to_dict().items() if k != "seconds"} for r in records]
    timings["passes_s"] = {f"{i}:{r.name}": round(r.seconds, 4) for i, r in enumerate(records)}
    report.data["weights"] = _weight_accounting(graph)
    if storage_note is not None:
        if rounding is not None:
            storage_note += (f"; measured: the worst weight's relative RMS rounding error is {rounding:.2e}"
                             + ("" if held_out else " (pass calibration data for the end-to-end accuracy)"))
        report.data["weights"]["storage_note"] = storage_note
    if reference is not None:
        from aviatorc.accuracy import accuracy_report

        with stage(_logger, f"measuring accuracy against the fp32 model on {len(held_out or [])} batch(es): "
                   f"{split.note}", echo=echo):
            report.data["accuracy"] = accuracy_report(reference, graph, held_out or []) | {"data": split.to_dict()}
    placement, plan = _place_and_schedule(graph, target, opts, time_limit_s, report, timings, echo, batches)
    return CompileResult(graph, report, opts, placement, plan, target, timings)


def _max_positions(graph: Graph) -> int | None:
    """The positions the model was trained for, when its graph says."""
    from aviatorc.workload import MAX_POSITIONS_KEY

    limit = graph.metadata.get(MAX_POSITIONS_KEY)
    return int(limit) if limit is not None else None


def _place_and_schedule(graph: Graph, target: Any, opts: CompileOptions, time_limit_s: float, report: Report,
                        timings: dict[str, Any], echo: Callable[[str], None] | None,
                        calibration: Sequence[Mapping[str, Any]] | None = None) -> tuple[Any, Any]:
    """Memory plan, partition, schedule and check: the placement and the plan."""
    import hashlib

    from aviatorc.options import parse_chiplets
    from aviatorc.partition import make_problem, partition
    from aviatorc.partition.weights import weights_from_graph
    from aviatorc.plan.check import check_plan
    from aviatorc.plan.plan import KVWindow
    from aviatorc.plan.records import to_json
    from aviatorc.report.data import seconds
    from aviatorc.runtime.cache import find_cache
    from aviatorc.schedule import Workload, model_facts, plan_memory, schedule

    weights = weights_from_graph(graph)
    routing = _routing(graph, weights, opts, calibration)
    if routing is not None:
        report.data["routing"] = routing.to_dict()
    workload = Workload(opts.batch, opts.context, opts.prompt, lora_rank=opts.lora_rank,
                        max_loras=opts.max_loras if opts.lora_rank else 0)
    allowed = list(parse_chiplets(opts.chiplets, target.num_chiplets) or range(target.num_chiplets))
    tiles = make_problem(weights, target, chiplets=allowed).tiles
    facts = model_facts(graph, tiles)
    check_model_bounds(graph, context=opts.context, prompt=opts.prompt, decoder=any(facts.kv_width.values()))
    layout = find_cache(graph)
    if opts.kv_recent is not None and layout is not None and not layout.position_ids:
        raise OptionError("--kv-recent evicts cache positions, but this graph takes no position_ids, so the "
                          "positions after an evicted one would move", hint="compile without --kv-recent")
    window = None if opts.kv_recent is None else KVWindow(opts.kv_sinks, opts.kv_recent)
    memory = plan_memory(facts, tiles, target, workload, chiplets=allowed, kv=opts.kv_cache, kv_dtype=opts.kv_dtype,
                         kv_window=window, prefill=opts.prefill, link_dtype=opts.link_dtype, routing=routing)
    estimate = estimate_plan(memory, report.data["weights"]["total_bytes"])
    _logger.info(f"KV cache {estimate.kv_bytes:,} bytes in {estimate.kv_location}; the plan streams it in about "
                 f"{estimate.instructions:,} instructions per decode step")
    check_plan_bounds(estimate, target, batch=opts.batch, context=opts.context)  # before anything is built
    with stage(_logger, f"partitioning onto {target.name} ({len(allowed)} chiplets)", echo=echo) as task:
        placement = partition(weights, target, time_limit_s=time_limit_s, seed=opts.seed,
                              reserve_bytes=memory.reserve_bytes, chiplets=allowed, solver=opts.solver,
                              homes=memory.kv.chiplet_of_layer, routing=routing)
        task.finish(f"{placement.status}, {placement.gap:.2%} above the lower bound")
    report.data["placement"] = {k: v for k, v in placement.to_dict().items() if k != "solve_time_s"}
    timings["partition_s"] = placement.solve_time_s
    started = time.perf_counter()
    with stage(_logger, f"scheduling decode (batch {workload.batch}, context {workload.context}) and prefill "
               f"(prompt {workload.prompt})", echo=echo):
        plan = schedule(graph, placement, weights, target, workload, memory, chiplets=allowed, prefetch=opts.prefetch,
                        ranges=opts.ranges, sweep=opts.sweep, max_context=_max_positions(graph),
                        target_sha256=hashlib.sha256(target.to_toml().encode()).hexdigest(), routing=routing)
        check_plan(plan, target)  # independent of the scheduler: a failure here is an aviatorc bug
    if layout is not None and layout.per_token:
        steps_s = workload.prompt * plan.prediction.time_per_token_s
        note = (f"prefill is per token: the graph takes one new token per step (input_ids [batch, 1]), so a prompt "
                f"of {workload.prompt} tokens runs as {workload.prompt} decode steps, about {seconds(steps_s)}; the "
                "time to first token above assumes the prompt in chunks")
        plan.notes = (*plan.notes, note)
    timings["schedule_s"] = round(time.perf_counter() - started, 3)
    report.data["plan"] = {"memory": to_json(plan.memory), "prediction": to_json(plan.prediction),
                           "notes": list(plan.notes),
                           "instructions": {phase: p.count() for phase, p in sorted(plan.programs.items())}}
    return placement, plan


def _routing(graph: Graph, weights: Any, opts: CompileOptions,
             calibration: Sequence[Mapping[str, Any]] | None) -> Any:
    """A mixture of experts' routing (`aviatorc.routing`): `opts.routing`, else measured on the
    calibration batches, else uniform; None for a model without experts."""
    from aviatorc.routing import measure_routing, moe_blocks, routing_for

    blocks = moe_blocks(graph, weights)
    if not blocks:
        if opts.routing is not None:
            _logger.warning(f"--routing {opts.routing} ignored: the model has no mixture of experts")
        return None
    if opts.routing is None and calibration:
        with stage(_logger, f"measuring the routing of {len(blocks)} MoE blocks on {len(calibration)} "
                   "calibration batch(es)"):
            return measure_routing(graph, blocks, calibration)
    return routing_for(opts.routing or "uniform", blocks)


def _text_calibration(graph: Graph, text: str, tokenizer: Any) -> list[dict[str, np.ndarray]]:
    from aviatorc.runtime.text import load_tokenizer, source_tokenizer, text_batches

    path = tokenizer or source_tokenizer(graph)
    if path is None:
        raise OptionError("calibration text needs the model's tokenizer, and this model's source carries none",
                          hint="pass its tokenizer (--tokenizer DIR or a .gguf file), or calibration batches "
                               "(--calibration FILE.npz)")
    return text_batches(graph, text, load_tokenizer(path))


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
    """The target `opts.target` names (a shipped name, a TOML path, or a `Target` a pipeline built,
    for instance with `load_target(..., overrides=...)`), with --cards applied."""
    from aviatorc.target import DEFAULT_TARGET, load_target

    return load_target(opts.target or DEFAULT_TARGET, cards=opts.cards)


def check_calibration(graph: Graph, batches: Iterable[Mapping[str, Any]] | None, *,
                      what: str = "calibration") -> list[dict[str, np.ndarray]] | None:
    """Calibration (or evaluation) batches as checked feed dicts; a mismatch names the batch and the input."""
    if batches is None:
        return None
    checked = []
    for index, batch in enumerate(batches):
        try:
            checked.append(check_feeds(graph, batch))
        except AviatorError as error:
            raise OptionError(f"{what} batch {index} does not match the model: {error.message}",
                              hint=error.hint) from None
    if not checked:
        raise OptionError(f"{what} data holds no batches")
    return checked


@dataclass(frozen=True)
class EvaluationSplit:
    """Which batches the accuracy figures come from, for the report."""

    held_out: bool  # False: measured on data calibration saw
    batches: int
    note: str

    def to_dict(self) -> dict[str, Any]:
        return {"held_out": self.held_out, "batches": self.batches, "note": self.note}


def evaluation_split(calibration: list[dict[str, np.ndarray]] | None, evaluation: list[dict[str, np.ndarray]] | None
                     ) -> tuple[list[dict[str, np.ndarray]] | None, list[dict[str, np.ndarray]] | None, EvaluationSplit]:
    """(batches to calibrate on, batches to measure accuracy on, how they were chosen).

    Accuracy measured on the calibration data itself flatters a calibrated method (GPTQ fits
    those very activations), so without evaluation batches the last quarter of the calibration
    batches (at least one) is held out of calibration; a single batch can only be in-sample."""
    if evaluation is not None:
        return calibration, evaluation, EvaluationSplit(True, len(evaluation), "evaluation batches given apart "
                                                        "from calibration")
    if not calibration:
        return calibration, None, EvaluationSplit(False, 0, "no data")
    if len(calibration) == 1:
        return calibration, calibration, EvaluationSplit(False, 1, "in-sample: the only calibration batch (give "
                                                         "evaluation batches, --eval, for a held-out figure)")
    held = max(1, len(calibration) // 4)
    return calibration[:-held], calibration[-held:], EvaluationSplit(
        True, held, f"the last {held} of {len(calibration)} calibration batches, held out of calibration")


def load_calibration_npz(path: str | os.PathLike[str], *, what: str = "calibration") -> list[dict[str, np.ndarray]]:
    """Calibration (or evaluation) batches from an .npz file: each key is an input name, its first
    axis indexes batches."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files}
    except (OSError, ValueError) as error:
        raise OptionError(f"cannot read {what} data: {error}", file=str(path)) from None
    if not arrays:
        raise OptionError(f"{what} file holds no arrays", file=str(path))
    counts = {key: a.shape[0] if a.ndim else 0 for key, a in arrays.items()}
    if len(set(counts.values())) != 1 or 0 in counts.values():
        raise OptionError(f"{what} arrays disagree on the number of batches (first axis): {counts}",
                          file=str(path))
    n = next(iter(counts.values()))
    return [{key: a[i] for key, a in arrays.items()} for i in range(n)]


def _sixteen_bit_error(graph: Graph, kind: str | None) -> float | None:
    """The worst relative RMS error that storing each float32 MatMul weight in `kind` introduces
    (None for a shape-only graph)."""
    worst = None
    for node in graph.nodes:
        value = node.inputs[1] if node.op == "MatMul" and len(node.inputs) > 1 else None
        if value is None or value.data is None or value.type.dtype != "float32" or not value.data.available:
            continue
        w = value.data.load().astype(np.float32)
        if kind == "bf16":
            import ml_dtypes

            rounded = w.astype(ml_dtypes.bfloat16).astype(np.float32)
        else:
            rounded = w.astype(np.float16).astype(np.float32)
        norm = float(np.linalg.norm(w))
        error = float(np.linalg.norm(w - rounded)) / norm if norm else 0.0
        worst = error if worst is None else max(worst, error)
    return worst


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
    from aviatorc.target import Target

    out = {}
    for key, value in vars(opts).items():
        if key == "extra":
            continue
        if isinstance(value, Target):  # a pipeline's own target: its name (target.toml holds every figure)
            value = value.name
        out[key] = list(value) if isinstance(value, tuple) else value
    return out


def _kv_kept(memory: dict[str, Any]) -> str:
    """A cache in LPDDR keeping some of its blocks in SRAM: how many; a cache in SRAM read in parts:
    in how many (plan.json's memory section)."""
    blocks = memory.get("kv_sram_blocks", {})
    if memory["kv_location"] == "sram" and blocks:
        parts = sorted({len(held) for held in blocks.values()})
        count = f"{parts[0]}" if len(parts) == 1 else f"{parts[0]} to {parts[-1]}"
        return f", {len(blocks)} of {len(memory['kv_layer_chiplets'])} layers' caches read in {count} parts beside their homes"
    kept = [sum(parts.values()) for parts in blocks.values()]
    if memory["kv_location"] != "lpddr" or not kept or not memory.get("kv_blocks"):
        return ""
    low, high = min(kept) / memory["kv_blocks"], max(kept) / memory["kv_blocks"]
    share = f"{low:.0%}" if round(low, 2) == round(high, 2) else f"{low:.0%} to {high:.0%}"
    return f", {share} of each layer's blocks kept in SRAM"
