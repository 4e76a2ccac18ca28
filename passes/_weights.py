"""Shared by `quantize` and `sparsify-2to4`: finding linear-layer weights, rewriting them to
`DequantizeWeight` over packed initializers, and the order both rewrite them in
(`rewrite_by_stage`: sequential calibration through `aviatorc.quant.sequential`).

A linear weight is a [K, N] float value read as input 1 of MatMul nodes only: either a
plain initializer, or the output of a `DequantizeWeight` in a float format (what
`sparsify-2to4` leaves: kept values in fp32 plus 2-bit indices), whose stored arrays are
initializers. Anything else (a weight also read by a Transpose, a weight already in an
integer format) is left alone with a note saying why.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from aviatorc.passes.manager import Note, PassContext

from aviatorc.formats import WeightFormat
from aviatorc.ir import ArrayData, Graph, Node, ShapeOnly, TensorType, Value, add_value
from aviatorc.progress import stage
from aviatorc.quant.calibration import ActivationStats, check_batches
from aviatorc.quant.rtn import PackedWeight, dequantize, expand_24, packed_layout, stored_rows, unpack_bits_k
from aviatorc.quant.sequential import SequentialRun, calibrate_sequentially

_logger = logging.getLogger("aviatorc.passes.weights")

FLOAT_KINDS = ("fp32", "fp16", "bf16")


@dataclass
class LinearWeight:
    """One weight matrix and the MatMuls reading it."""

    value: Value  # what the MatMuls read: an initializer, or a DequantizeWeight output
    source: Node | None  # the DequantizeWeight producing `value`, if any
    matmuls: list[Node]
    fmt: WeightFormat  # as stored now
    k: int
    n: int

    @property
    def name(self) -> str:
        """The weight's name for patterns and reports: the initializer's, or the stored values'."""
        if self.source is not None:
            return self.source.input(0).name.removesuffix(".values")
        return self.value.name

    @property
    def has_data(self) -> bool:
        arrays = self.stored_values()
        return all(v.data is not None and v.data.available for v in arrays)

    def stored_values(self) -> list[Value]:
        if self.source is None:
            return [self.value]
        return [v for v in self.source.inputs if v is not None]

    def dense(self) -> np.ndarray:
        """The float32 [K, N] weight (pruned entries are zero)."""
        if self.source is None:
            return np.asarray(self.value.data.load(), dtype=np.float32)  # type: ignore[union-attr]
        return dequantize([v.data.load() if v is not None else None for v in self.source.inputs],  # type: ignore[union-attr]
                          self.fmt, self.k, self.n)

    def mask(self) -> np.ndarray | None:
        """Kept entries of a 2:4 weight, from its stored indices; None when dense."""
        if self.fmt.sparsity != "2:4" or self.source is None:
            return None
        indices = self.source.input(3).data.load()  # type: ignore[union-attr]
        ks = stored_rows(self.fmt, self.k)
        return expand_24(np.ones((ks, self.n), bool), unpack_bits_k(indices, 2, ks), self.k)

    def matches(self, patterns: tuple[str, ...]) -> bool:
        names = [self.name, self.value.name] + [m.name for m in self.matmuls]
        return any(fnmatch.fnmatchcase(name, pattern) for name in names for pattern in patterns)


def find_linear_weights(graph: Graph) -> tuple[list[LinearWeight], list[Note]]:
    """Every linear weight of the graph, in node order, and notes on the ones left alone."""
    found: dict[int, LinearWeight] = {}
    notes: list[Note] = []
    for node in graph.nodes:
        if node.op != "MatMul":
            continue
        w = node.inputs[1]
        if w is None or id(w) in found:
            if w is not None:
                found[id(w)].matmuls.append(node)
            continue
        reason, candidate = _classify(w, node)
        if candidate is None:
            if reason:
                notes.append(Note(node.name, reason))
            continue
        found[id(w)] = candidate
    weights = []
    for lw in found.values():
        other = [u for u in lw.value.users if u.op != "MatMul" or u.inputs[1] is not lw.value or u.inputs[0] is lw.value]
        if other or lw.value in graph.outputs:
            what = f"{other[0].op} '{other[0].name}'" if other else "a graph output"
            notes.append(Note(lw.matmuls[0].name, f"weight '{lw.name}' is also read by {what}: left as it is"))
            continue
        weights.append(lw)
    return weights, notes


def _classify(w: Value, matmul: Node) -> tuple[str, LinearWeight | None]:
    if w.type.rank != 2 or not w.type.is_static:
        return "", None  # an activation-by-activation MatMul (attention scores): not a weight
    k, n = w.type.shape  # type: ignore[misc]
    assert isinstance(k, int) and isinstance(n, int)  # static: checked above
    if w.is_initializer:
        if w.type.dtype not in ("float32", "float16", "bfloat16"):
            return f"weight '{w.name}' is {w.type.dtype}: only float weights are rewritten", None
        return "", LinearWeight(w, None, [matmul], WeightFormat({"float32": "fp32", "float16": "fp16",
                                                                 "bfloat16": "bf16"}[w.type.dtype]), int(k), int(n))
    producer = w.producer
    if producer is not None and producer.op == "Cast" and producer.inputs[0] is not None:
        producer = producer.inputs[0].producer  # a float16 model casts the dequantized weight
    if producer is None or producer.op != "DequantizeWeight":
        return "", None
    fmt = WeightFormat.from_attrs(producer.attrs)
    if fmt.kind not in FLOAT_KINDS or (fmt.kind == "fp16" and not fmt.sparsity):
        return f"weight '{w.name}' is already stored as {fmt.name}", None
    if any(v is not None and not v.is_initializer for v in producer.inputs):
        return f"weight '{w.name}' is computed, not stored", None
    return "", LinearWeight(w, producer, [matmul], fmt, int(k), int(n))


def add_packed_weight(graph: Graph, lw: LinearWeight, fmt: WeightFormat, packed: PackedWeight | None) -> Value:
    """Add `DequantizeWeight` over new initializers (shape-only when `packed` is None) before the
    first MatMul, point the MatMuls at it, and drop what fed them before. Returns the new weight."""
    base = lw.name
    inputs: list[Value | None] = []
    for index, slot in enumerate(packed_layout(fmt, lw.k, lw.n)):
        if slot is None:
            inputs.append(None)
            continue
        role, dtype, shape = slot
        name = graph.unique_name(f"{base}.{role}")
        if packed is not None:
            array = packed.arrays[index]
            assert array is not None and array.dtype == np.dtype(dtype) and array.shape == shape, (role, array, shape)
            inputs.append(graph.add_initializer(name, TensorType(dtype, shape), ArrayData(array)))
        else:
            inputs.append(graph.add_initializer(name, TensorType(dtype, shape), ShapeOnly("quantized shape-only")))
    first = min(lw.matmuls, key=graph.position)
    attrs = dict(fmt.to_attrs(), k=lw.k, n=lw.n)
    out = add_value(graph, "DequantizeWeight", inputs, attrs, name=graph.unique_name(f"{base}.dequant"), before=first)
    target_dtype = lw.value.type.dtype
    if target_dtype != "float32":  # a float16 model's MatMul reads float16
        out = add_value(graph, "Cast", [out], {"to": target_dtype}, name=graph.unique_name(f"{base}.cast"), before=first)
    for mm in lw.matmuls:
        mm.set_input(1, out)
    _drop_old(graph, lw)
    return out


def _drop_old(graph: Graph, lw: LinearWeight) -> None:
    if lw.source is not None:
        stored = lw.stored_values()
        cast = lw.value.producer
        if cast is not None and cast is not lw.source and not lw.value.users:
            graph.remove_node(cast)  # the float16 model's Cast of the old weight
        graph.remove_node(lw.source)
        for value in stored:
            if not value.users and value.name in graph.initializers:
                graph.remove_initializer(value)
    elif not lw.value.users and lw.value.name in graph.initializers:
        graph.remove_initializer(lw.value)


def tile_depth(target: object) -> int | None:
    """The target's matrix-unit depth along K, duck-typed (`matrix_unit_k`), or None."""
    for attr in ("matrix_unit_k", "tile_k"):
        value = getattr(target, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def target_formats(target: object) -> tuple[str, ...] | None:
    """Weight formats the target lists (`weight_formats`), or None when it lists none."""
    for attr in ("weight_formats", "supported_formats", "formats"):
        value = getattr(target, attr, None)
        if value:
            return tuple(str(v) for v in value)
    return None


def target_name(target: object) -> str:
    return str(getattr(target, "name", "the target"))


def calibration_stages(graph: Graph, weights: list[LinearWeight]) -> list[list[LinearWeight]]:
    """`weights` grouped for sequential calibration, earliest first.

    A weight's stage is the number of `weights` MatMuls on the longest path from the graph
    inputs to its activation input, so the MatMuls reading one activation (q / k / v; gate /
    up) share a stage and every weight upstream of a stage lies in an earlier one. A shared
    weight takes the latest stage of its MatMuls. Calibrating stage by stage on the graph with
    the earlier stages already rewritten is GPTQ's sequential scheme: each layer compensates
    the error of the ones before it instead of fitting inputs it will never see.
    """
    owner = {id(mm): lw for lw in weights for mm in lw.matmuls}
    depth: dict[int, int] = {}  # value id -> listed MatMuls on the longest path to it
    stage: dict[int, int] = {}
    for node in graph.nodes:
        lw = owner.get(id(node))
        if lw is not None:
            d = depth.get(id(node.inputs[0]), 0)
            stage[id(lw)] = max(stage.get(id(lw), 0), d)
            d += 1
        else:
            d = max((depth.get(id(v), 0) for v in node.inputs if v is not None), default=0)
        for out in node.outputs:
            depth[id(out)] = d
    stages: dict[int, list[LinearWeight]] = {}
    for lw in weights:
        stages.setdefault(stage.get(id(lw), 0), []).append(lw)
    return [stages[s] for s in sorted(stages)]


def routed_inputs(graph: Graph, weights: list[LinearWeight]) -> dict[str, tuple[str, int]]:
    """MatMul inputs inside an expert -> (its block's routing value, the expert's index): the rows
    their calibration statistics keep (`calibrate_sequentially`)."""
    from aviatorc.ir.experts import expert_nodes

    experts = expert_nodes(graph)
    return {mm.input(0).name: (experts[mm].routing.name, experts[mm].expert)
            for lw in weights for mm in lw.matmuls if mm in experts}


# A pass's rewrite of some weights, given the statistics of their MatMul inputs (empty when uncalibrated).
WeightRewrite = Callable[[list[LinearWeight], dict[str, ActivationStats]], None]


def rewrite_by_stage(graph: Graph, ctx: PassContext, weights: list[LinearWeight], rewrite: WeightRewrite, *,
                     calibrate: bool, hessian: bool, reference: Graph | None = None,
                     label: str) -> SequentialRun | None:
    """Rewrite `weights` in the order sequential calibration needs, `quantize`'s and `sparsify-2to4`'s.

    With `calibrate`, the weights with data go stage by stage (`calibration_stages`), each stage
    given the statistics of its MatMul inputs on `ctx.calibration` from the graph with every
    earlier stage already rewritten (`calibrate_sequentially`; `hessian` and the unrewritten
    `reference` for the cross term as it takes them). The rest (shape-only weights, or all of
    them without `calibrate`) are rewritten last, without statistics.
    """
    calibrated = [lw for lw in weights if lw.has_data] if calibrate else []
    stages = calibration_stages(graph, calibrated) if calibrated else []
    run = None
    if stages:
        batches = check_batches(graph, ctx.calibration)
        ctx.note(f"{label}: sequential calibration of {len(calibrated)} weight(s) in {len(stages)} "
                 f"stage(s) on {len(batches)} batch(es)")
        inputs = [[mm.input(0).name for lw in stage for mm in lw.matmuls] for stage in stages]
        with stage(_logger, f"{label}: calibrating", total=len(stages)) as task:
            def rewrite_stage(index: int, stats: dict[str, ActivationStats]) -> None:
                rewrite(stages[index], stats)
                task.advance(detail=f"stage {index + 1} of {len(stages)}")

            run = calibrate_sequentially(graph, batches, inputs, rewrite_stage, hessian=hessian, reference=reference,
                                         routed=routed_inputs(graph, calibrated))
        ctx.note(f"{label}: {run.evaluations} node evaluations per batch for {len(graph.nodes)} nodes"
                 + (f", {run.reference_evaluations} in the unrewritten graph" if reference is not None and hessian else ""))
        ctx.note(f"{label}: calibration statistics from {run.tokens:,} real token(s)"
                 + (f"; {run.padding:,} padding position(s) left out (attention_mask)" if run.padding else ""))
    rewrite([lw for lw in weights if lw not in calibrated], {})
    return run

