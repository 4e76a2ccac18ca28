"""Accuracy of a transformed (quantized, sparsified) graph against the fp32 reference.

Metrics (numpy only): SQNR in dB, max abs error, cosine similarity, Pearson correlation
(PCC, as tt-mlir's golden checks use), top-1 agreement and perplexity for language models.

`accuracy_report(reference, transformed, batches)` runs both graphs on `batches` (the compiler
gives it batches calibration did not see: `aviatorc.compiler.evaluation_split`) and reports:
- per layer, for each MatMul whose weight the passes rewrote (matched by node name, which
  the passes keep): `sqnr_db` / `max_abs_error` of the layer's own error (the reference
  layer input times the stored weight, against the fp32 layer), and `sqnr_db_in_model` of
  the output as the transformed model computes it (errors of earlier layers included);
- end to end, per graph output: cosine, PCC, max abs difference; for an output that looks
  like logits ([batch, seq, vocab] with `input_ids` among the inputs) also top-1 agreement
  and the perplexity of both models on the batches' own next tokens;
- for a mixture of experts, per expert (`experts`): its output against the reference's on the
  tokens the reference routes to it (SQNR, cosine weighted by tokens, max error; an expert no
  token reached lists 0 tokens and nothing else), and per block (`routing`) the fraction of
  tokens both graphs send to the same experts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def sqnr_db(reference: np.ndarray, test: np.ndarray) -> float:
    """10 log10(signal power / error power); inf when equal."""
    ref = np.asarray(reference, np.float64)
    noise = float(np.sum((ref - np.asarray(test, np.float64)) ** 2))
    signal = float(np.sum(ref**2))
    if noise == 0:
        return math.inf
    return 10 * math.log10(max(signal, 1e-300) / noise)


def max_abs_error(reference: np.ndarray, test: np.ndarray) -> float:
    return float(np.max(np.abs(np.asarray(reference, np.float64) - np.asarray(test, np.float64)), initial=0.0))


def cosine(reference: np.ndarray, test: np.ndarray, axis: int | None = None) -> np.ndarray | float:
    """Cosine similarity of the flattened arrays, or along `axis` (per row)."""
    a, b = np.asarray(reference, np.float64), np.asarray(test, np.float64)
    if axis is None:
        a, b = a.reshape(-1), b.reshape(-1)
        denominator = np.linalg.norm(a) * np.linalg.norm(b)
        return float(a @ b / denominator) if denominator else float(np.array_equal(a, b))
    denominator = np.linalg.norm(a, axis=axis) * np.linalg.norm(b, axis=axis)
    return np.sum(a * b, axis=axis) / np.where(denominator == 0, 1.0, denominator)


def pcc(reference: np.ndarray, test: np.ndarray) -> float:
    a = np.asarray(reference, np.float64).reshape(-1)
    b = np.asarray(test, np.float64).reshape(-1)
    if a.std() == 0 or b.std() == 0:
        return float(np.allclose(a, b))
    return float(np.corrcoef(a, b)[0, 1])


def top1_agreement(reference_logits: np.ndarray, test_logits: np.ndarray) -> float:
    """Fraction of positions where both models predict the same next token."""
    return float(np.mean(np.argmax(reference_logits, axis=-1) == np.argmax(test_logits, axis=-1)))


def nll_sum(logits_BSV: np.ndarray, ids_BS: np.ndarray) -> tuple[float, int]:
    """Summed negative log-likelihood of each next token, and how many tokens were scored."""
    logits = np.asarray(logits_BSV[:, :-1], np.float64)
    target = np.asarray(ids_BS[:, 1:], np.int64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_z = np.log(np.exp(shifted).sum(axis=-1))
    picked = np.take_along_axis(shifted, target[..., None], axis=-1)[..., 0]
    return float(np.sum(log_z - picked)), int(target.size)


def perplexity(logits_BSV: np.ndarray, ids_BS: np.ndarray) -> float:
    total, count = nll_sum(logits_BSV, ids_BS)
    return math.exp(total / max(count, 1))


# -- the report --------------------------------------------------------------------------


def _rewritten_matmuls(graph: Any) -> list[Any]:
    """MatMuls reading a DequantizeWeight (directly or through a Cast)."""
    found = []
    for node in graph.nodes:
        if node.op != "MatMul" or node.inputs[1] is None:
            continue
        producer = node.inputs[1].producer
        if producer is not None and producer.op == "Cast" and producer.inputs[0] is not None:
            producer = producer.inputs[0].producer
        if producer is not None and producer.op == "DequantizeWeight":
            found.append((node, producer))
    return found


class _Accumulator:
    """Signal and noise power and max error over batches."""

    def __init__(self) -> None:
        self.signal = self.noise = 0.0
        self.max_error = 0.0

    def add(self, reference: np.ndarray, test: np.ndarray) -> None:
        ref = np.asarray(reference, np.float64)
        diff = ref - np.asarray(test, np.float64)
        self.signal += float(np.sum(ref**2))
        self.noise += float(np.sum(diff**2))
        self.max_error = max(self.max_error, float(np.max(np.abs(diff), initial=0.0)))

    @property
    def sqnr_db(self) -> float:
        return math.inf if self.noise == 0 else 10 * math.log10(max(self.signal, 1e-300) / self.noise)


def _finite(x: float) -> float | str:
    return round(x, 4) if math.isfinite(x) else ("inf" if x > 0 else "-inf")


def accuracy_report(reference: Any, transformed: Any, batches: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per-layer and end-to-end accuracy of `transformed` against `reference` on `batches`."""
    from aviatorc.ir.interpreter import evaluate

    layers = _rewritten_matmuls(transformed)
    ref_nodes = {node.name: node for node in reference.nodes if node.op == "MatMul"}
    pairs = [(mm, deq, ref_nodes[mm.name]) for mm, deq in layers if mm.name in ref_nodes]
    experts = _ExpertAccuracy(reference, transformed)
    ref_keep = tuple(dict.fromkeys([r.outputs[0].name for _, _, r in pairs] + [r.input(0).name for _, _, r in pairs]
                                   + experts.reference_values))
    test_keep = tuple(dict.fromkeys([mm.outputs[0].name for mm, _, _ in pairs] + [mm.input(1).name for mm, _, _ in pairs]
                                    + experts.transformed_values))
    ref_keep = tuple(n for n in ref_keep if n not in {v.name for v in reference.inputs})

    own = {mm.name: _Accumulator() for mm, _, _ in pairs}
    in_model = {mm.name: _Accumulator() for mm, _, _ in pairs}
    outputs = {v.name: _Accumulator() for v in reference.outputs}
    cosines: dict[str, list[float]] = {name: [] for name in outputs}
    pccs: dict[str, list[float]] = {name: [] for name in outputs}
    lm: dict[str, dict[str, float]] = {}
    for feed in batches:
        ref = evaluate(reference, feed, keep=ref_keep)
        test = evaluate(transformed, feed, keep=test_keep)
        for mm, _, ref_mm in pairs:
            x = ref[ref_mm.input(0).name] if ref_mm.input(0).name in ref else feed[ref_mm.input(0).name]
            y_ref = ref[ref_mm.outputs[0].name]
            own[mm.name].add(y_ref, np.matmul(x, test[mm.input(1).name]))
            in_model[mm.name].add(y_ref, test[mm.outputs[0].name])
        experts.add(ref, test)
        for ref_out, test_out in zip(reference.outputs, transformed.outputs, strict=True):
            a, b = ref[ref_out.name], test[test_out.name]
            outputs[ref_out.name].add(a, b)
            cosines[ref_out.name].append(float(cosine(a, b)))
            pccs[ref_out.name].append(pcc(a, b))
            ids = feed.get("input_ids")
            # Logits over the vocabulary: [batch, seq, V] with every id < V. An encoder's hidden
            # states have the same leading shape (MiniLM: width 384, ids up to 30,522): no perplexity.
            if (ids is not None and a.ndim == 3 and np.asarray(ids).ndim == 2
                    and a.shape[:2] == np.asarray(ids).shape and int(np.max(ids)) < a.shape[-1]):
                entry = lm.setdefault(ref_out.name, {"agree": 0.0, "positions": 0.0, "nll_ref": 0.0,
                                                     "nll_test": 0.0, "tokens": 0.0})
                entry["agree"] += top1_agreement(a, b) * a.shape[0] * a.shape[1]
                entry["positions"] += a.shape[0] * a.shape[1]
                for key, logits in (("nll_ref", a), ("nll_test", b)):
                    total, count = nll_sum(logits, np.asarray(ids))
                    entry[key] += total
                entry["tokens"] += count

    per_layer = []
    for mm, deq, _ in pairs:
        per_layer.append({"node": mm.name, "format": _format_name(deq), "k": int(deq.attrs["k"]),
                          "n": int(deq.attrs["n"]), "sqnr_db": _finite(own[mm.name].sqnr_db),
                          "max_abs_error": round(own[mm.name].max_error, 6),
                          "sqnr_db_in_model": _finite(in_model[mm.name].sqnr_db),
                          "max_abs_error_in_model": round(in_model[mm.name].max_error, 6)})
    end_to_end = []
    for name, acc in outputs.items():
        result: dict[str, Any] = {"output": name, "cosine": round(float(np.mean(cosines[name])), 6),
                                  "pcc": round(float(np.mean(pccs[name])), 6), "max_abs_diff": round(acc.max_error, 6),
                                  "sqnr_db": _finite(acc.sqnr_db)}
        if name in lm and lm[name]["tokens"] > 0:  # one-token batches score no next token
            stats = lm[name]
            result["top1_agreement"] = round(stats["agree"] / stats["positions"], 4)
            result["perplexity_reference"] = round(math.exp(stats["nll_ref"] / stats["tokens"]), 4)
            result["perplexity"] = round(math.exp(stats["nll_test"] / stats["tokens"]), 4)
        end_to_end.append(result)
    report = {"batches": len(batches), "layers": per_layer, "end_to_end": end_to_end}
    if experts.pairs:
        report["experts"] = experts.entries()
        report["routing"] = experts.routing_entries()
    return report


class _ExpertAccuracy:
    """Each expert's output (the input of its `MoECombine`) against the reference's, on the tokens
    the reference routes to it; and per block, how often both graphs route a token to the same
    experts. Experts are matched by their combine node's name, which the passes keep."""

    def __init__(self, reference: Any, transformed: Any) -> None:
        from aviatorc.ir.experts import expert_combines, expert_index

        self.index = expert_index

        test = {node.name: node for node in expert_combines(transformed)}
        self.pairs = [(r, test[r.name]) for r in expert_combines(reference) if r.name in test]
        self.errors = {r.name: _Accumulator() for r, _ in self.pairs}
        self.cosines: dict[str, list[float]] = {r.name: [] for r, _ in self.pairs}
        self.tokens = {r.name: 0 for r, _ in self.pairs}
        self.agree: dict[str, list[int]] = {}  # block -> [tokens routed alike, tokens]

    @property
    def reference_values(self) -> list[str]:
        return [v.name for r, _ in self.pairs for v in (r.input(0), r.input(1))]

    @property
    def transformed_values(self) -> list[str]:
        return [v.name for _, t in self.pairs for v in (t.input(0), t.input(1))]

    def add(self, ref: Mapping[str, np.ndarray], test: Mapping[str, np.ndarray]) -> None:
        blocks_done: set[str] = set()
        for r, t in self.pairs:
            expert = self.index(r)
            routing = ref[r.input(0).name]
            rows = routing[..., expert].reshape(-1) != 0
            width = ref[r.input(1).name].shape[-1]
            y_ref = ref[r.input(1).name].reshape(-1, width)[rows]
            y_test = test[t.input(1).name].reshape(-1, width)[rows]
            if rows.any():
                self.errors[r.name].add(y_ref, y_test)
                self.cosines[r.name].append(float(cosine(y_ref, y_test)) * int(rows.sum()))
            self.tokens[r.name] += int(rows.sum())
            block = r.input(0).name
            if block not in blocks_done:
                blocks_done.add(block)
                alike = (ref[r.input(0).name] != 0) == (test[t.input(0).name] != 0)
                counts = self.agree.setdefault(block, [0, 0])
                counts[0] += int(alike.reshape(-1, routing.shape[-1]).all(axis=-1).sum())
                counts[1] += int(np.prod(routing.shape[:-1]))

    def entries(self) -> list[dict[str, Any]]:
        out = []
        for r, _ in self.pairs:
            tokens = self.tokens[r.name]
            entry: dict[str, Any] = {"combine": r.name, "routing": r.input(0).name, "expert": self.index(r),
                                     "tokens": tokens}
            if tokens:
                entry.update(sqnr_db=_finite(self.errors[r.name].sqnr_db), cosine=round(sum(self.cosines[r.name]) / tokens, 6),
                             max_abs_error=round(self.errors[r.name].max_error, 6))
            out.append(entry)
        return out

    def routing_entries(self) -> list[dict[str, Any]]:
        return [{"routing": block, "tokens": total, "same_experts": round(alike / total, 4) if total else None}
                for block, (alike, total) in self.agree.items()]


def _format_name(deq: Any) -> str:
    from aviatorc.formats import WeightFormat

    return WeightFormat.from_attrs(deq.attrs).name


def format_accuracy(report: Mapping[str, Any], max_layers: int = 20) -> str:
    """A terminal table of `accuracy_report`'s result: worst layers first."""
    data = report.get("data", {})
    kind = "held-out" if data.get("held_out") else "in-sample"
    lines = [f"accuracy on {report['batches']} {kind} batch(es)" + (f" ({data['note']})" if data.get("note") else "")]
    for entry in report["end_to_end"]:
        text = f"  output {entry['output']}: cosine {entry['cosine']:.5f}, PCC {entry['pcc']:.5f}, max |diff| {entry['max_abs_diff']:.4g}"
        if "perplexity" in entry:
            text += (f", top-1 agreement {entry['top1_agreement']:.3f}, perplexity {entry['perplexity']:.3f} "
                     f"(reference {entry['perplexity_reference']:.3f})")
        lines.append(text)
    experts = [e for e in report.get("experts", []) if e["tokens"]]
    if report.get("experts"):
        worst = min(experts, key=lambda e: float(e["sqnr_db"]) if e["sqnr_db"] != "inf" else math.inf, default=None)
        text = f"  experts: {len(experts)} of {len(report['experts'])} reached by these batches"
        if worst is not None:
            text += (f"; worst SQNR {worst['sqnr_db']} dB (expert {worst['expert']} of {worst['routing']}, "
                     f"{worst['tokens']} token(s))")
        same = [r["same_experts"] for r in report.get("routing", []) if r["same_experts"] is not None]
        if same:
            text += f"; tokens routed to the same experts: {min(same):.3f} (worst block)"
        lines.append(text)
    layers = sorted(report["layers"], key=lambda e: float(e["sqnr_db"]) if e["sqnr_db"] != "inf" else math.inf)
    if layers:
        lines.append(f"  {'layer':<40} {'format':<16} {'SQNR dB':>8} {'max err':>10} {'in model':>9}")
        for e in layers[:max_layers]:
            lines.append(f"  {e['node'][:40]:<40} {e['format']:<16} {str(e['sqnr_db']):>8} "
                         f"{e['max_abs_error']:>10.4g} {str(e['sqnr_db_in_model']):>9}")
        if len(layers) > max_layers:
            lines.append(f"  ... {len(layers) - max_layers} more layer(s)")
    return "\n".join(lines)
