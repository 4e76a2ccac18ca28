"""Calibration statistics leave padding out: with an `attention_mask` input, a batch padded to one
length gives the statistics of its real tokens alone (the same as the sentences unpadded), the
walk and the quantize pass say how many real tokens there were, and a graph without a mask
counts every position."""

from __future__ import annotations

import numpy as np
from aviatorc.passes.manager import PassContext, get_pass, run_passes

from aviatorc.ir import ArrayData, Graph, TensorType, add_value
from aviatorc.options import CompileOptions
from aviatorc.quant.calibration import ActivationStats, token_mask
from aviatorc.quant.sequential import calibrate_sequentially
from tests.quant.tiny_models import correlated_inputs

D, N = 32, 16


def masked_linear() -> Graph:
    """x [batch, seq, D] and attention_mask [batch, seq] -> Gelu(x) @ W."""
    rng = np.random.default_rng(0)
    g = Graph("masked_linear")
    x = g.add_input("x", TensorType("float32", ("batch", "seq", D)))
    g.add_input("attention_mask", TensorType("int64", ("batch", "seq")))
    w = g.add_initializer("w", TensorType("float32", (D, N)), ArrayData(rng.standard_normal((D, N)).astype(np.float32)))
    h = add_value(g, "Gelu", [x], name="act")
    g.outputs = [add_value(g, "MatMul", [h, w], name="linear", output_names=["y"])]
    return g


def sentences(rng: np.random.Generator, lengths: list[int]) -> list[np.ndarray]:
    return [correlated_inputs(rng, n, D) for n in lengths]


def padded_batch(xs: list[np.ndarray], seq: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The sentences padded to `seq` positions, the padding holding large junk (what a padded
    position's activations are: computed, but not data)."""
    x = (rng.standard_normal((len(xs), seq, D)) * 50).astype(np.float32)
    mask = np.zeros((len(xs), seq), np.int64)
    for i, s in enumerate(xs):
        x[i, : len(s)], mask[i, : len(s)] = s, 1
    return {"x": x, "attention_mask": mask}


def collect(graph: Graph, batches: list[dict[str, np.ndarray]]):
    seen: dict[str, ActivationStats] = {}

    def keep(index: int, stats: dict[str, ActivationStats]) -> None:
        seen.update(stats)

    name = next(n for n in graph.nodes if n.name == "linear").input(0).name
    run = calibrate_sequentially(graph, batches, [[name]], keep, hessian=True)
    return run, seen[name]


def test_padding_is_left_out_of_every_statistic() -> None:
    rng = np.random.default_rng(1)
    xs = sentences(rng, [5, 9, 3])
    g = masked_linear()
    run_padded, padded = collect(g, [padded_batch(xs, 12, rng)])
    run_alone, alone = collect(g, [{"x": s[None], "attention_mask": np.ones((1, len(s)), np.int64)} for s in xs])
    assert padded.tokens == alone.tokens == run_padded.tokens == run_alone.tokens == 17
    assert (run_padded.padding, run_alone.padding) == (3 * 12 - 17, 0)
    np.testing.assert_allclose(padded.hessian, alone.hessian, rtol=1e-9)
    np.testing.assert_allclose(padded.sq_norm, alone.sq_norm, rtol=1e-9)
    np.testing.assert_allclose(padded.mean_abs, alone.mean_abs, rtol=1e-9)
    assert (padded.lo, padded.hi) == (alone.lo, alone.hi)  # the junk's range is not the activation's


def test_a_graph_without_a_mask_counts_every_position() -> None:
    g = masked_linear()
    g.inputs = [v for v in g.inputs if v.name != "attention_mask"]
    batch = {"x": np.ones((2, 7, D), np.float32)}
    assert token_mask(g, batch) is None
    run, stats = collect(g, [batch])
    assert stats.tokens == run.tokens == 14 and run.padding == 0


def test_quantize_reports_the_real_tokens() -> None:
    rng = np.random.default_rng(2)
    g = masked_linear()
    batches = [padded_batch(sentences(rng, [4, 6]), 8, rng), padded_batch(sentences(rng, [8, 2]), 8, rng)]
    notes: list[str] = []
    ctx = PassContext(options=CompileOptions(quant="int4", quant_method="gptq"), calibration=batches, log=notes.append)
    (record,) = run_passes(g, [get_pass("quantize")], ctx)
    assert record.stats["calibration_tokens"] == 20
    assert record.stats["calibration_padding_excluded"] == 12
    assert any("20 real token(s); 12 padding position(s) left out" in line for line in notes)
