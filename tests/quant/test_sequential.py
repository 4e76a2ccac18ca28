"""Sequential calibration (`aviatorc.quant.sequential`): the same weights as evaluating the graph
up to each stage's MatMuls (the path the passes took before), each node evaluated once per
batch, and `evaluate_nodes` against `evaluate`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pytest
from aviatorc.passes import _weights
from aviatorc.passes.manager import PassContext, get_pass, run_passes

from aviatorc.ir import Graph, evaluate
from aviatorc.ir.interpreter import evaluate_nodes
from aviatorc.options import CompileOptions
from aviatorc.quant.calibration import ActivationStats, check_batches
from aviatorc.quant.sequential import SequentialRun, StageRewrite, calibrate_sequentially
from tests.quant.stage_spy import watch_driver
from tests.quant.tiny_models import encoder_batches, lm_batches, shared_weight, tiny_encoder, tiny_lm


def per_stage_evaluation(graph: Graph, batches: Sequence[Mapping[str, np.ndarray]], stages: Sequence[Sequence[str]],
                         rewrite: StageRewrite, *, hessian: bool, reference: Graph | None = None,
                         percentile: float = 99.99, routed: Mapping[str, tuple[str, int]] | None = None) -> SequentialRun:
    """The path the passes took before the driver: each stage runs the rewritten graph from its
    inputs up to the stage's MatMuls (`evaluate(..., only_kept=True)`), and the unrewritten
    graph once for all stages' values. Kept here as the oracle the driver must match bit for bit
    (on dense graphs: it keeps no expert's routed rows)."""
    assert not routed
    feeds = check_batches(graph, batches)
    every = tuple(dict.fromkeys(name for names in stages for name in names))
    kept_ref = ([evaluate(reference, feed, keep=every, only_kept=True) for feed in feeds]
                if reference is not None and hessian else [])
    for index, stage in enumerate(stages):
        names = tuple(dict.fromkeys(stage))
        stats: dict[str, ActivationStats] = {}
        for batch, feed in enumerate(feeds):
            kept = evaluate(graph, feed, keep=names, only_kept=True)
            for name in names:
                x = kept[name] if name in kept else feed[name]
                x_ref = kept_ref[batch].get(name, feed.get(name)) if kept_ref else None
                if name not in stats:
                    stats[name] = ActivationStats(int(x.shape[-1]))
                stats[name].add(x, hessian=hessian, percentile=percentile, x_ref=x_ref)
        rewrite(index, stats)
    return SequentialRun(len(stages), 0, 0)


def final_weights(graph: Graph) -> dict[str, bytes]:
    """Every initializer's bytes and every node's op, inputs and attributes: equal means the same rewrite."""
    out = {f"node {i}": f"{n.op} {n.name} {sorted(n.attrs.items())} {[v.name if v else None for v in n.inputs]}"
           .encode() for i, n in enumerate(graph.nodes)}
    out.update({name: np.ascontiguousarray(v.data.load()).tobytes()
                for name, v in graph.initializers.items() if v.data is not None and v.data.available})
    return out


MODELS = {
    "tiny_lm": (tiny_lm, lm_batches),
    "encoder": (lambda: tiny_encoder(2), encoder_batches),
    # The shared weight's second MatMul comes a stage after its first was evaluated: the driver
    # must evaluate that MatMul (and what follows it) again once the weight is rewritten.
    "shared_weight": (shared_weight, lambda: [{"x": np.random.default_rng(i).standard_normal((16, 32)).astype(np.float32)}
                                              for i in range(3)]),
}
CONFIGS = {
    "int4-gptq": (["quantize"], dict(quant="int4", group_size=32)),
    "int4-gptq-keep-fp16": (["quantize"], dict(quant="int4", group_size=32, keep_fp16=("*.v.weight", "mid", "lm_head*"))),
    "mxint4-gptq": (["quantize"], dict(quant="mxint4")),
    "int8-gptq-w8a8": (["quantize"], dict(quant="int8", quant_method="gptq", activations="percentile")),
    "int8-rtn-w8a8": (["quantize"], dict(quant="int8", activations="minmax")),
    "wanda": (["sparsify-2to4"], dict(sparsity="2:4", sparsity_method="wanda")),
    "sparsegpt": (["sparsify-2to4"], dict(sparsity="2:4", sparsity_method="sparsegpt")),
    "sparsegpt-then-int4-gptq": (["sparsify-2to4", "quantize"],
                                 dict(sparsity="2:4", sparsity_method="sparsegpt", quant="int4", group_size=32)),
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("model", list(MODELS))
def test_driver_gives_the_weights_of_per_stage_evaluation(model: str, config: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    make, batches = MODELS[model]
    names, options = CONFIGS[config]
    results = []
    for driver in (calibrate_sequentially, per_stage_evaluation):
        monkeypatch.setattr(_weights, "calibrate_sequentially", driver)
        graph = make()
        run_passes(graph, [get_pass(n) for n in names],
                   PassContext(options=CompileOptions(**options), calibration=batches()))
        results.append(final_weights(graph))
    new, old = results
    assert new.keys() == old.keys()
    assert [name for name in new if new[name] != old[name]] == []  # bit for bit


@pytest.mark.parametrize("layers", [2, 4, 8])
def test_each_node_is_evaluated_once_per_batch(layers: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The count that makes calibration linear in the layer count: every node of the quantized
    graph at most once per batch, and of the unquantized reference at most once."""
    calls = watch_driver(monkeypatch)
    graph = tiny_encoder(layers)
    nodes_before = len(graph.nodes)
    run_passes(graph, [get_pass("quantize")],
               PassContext(options=CompileOptions(quant="int4", group_size=32), calibration=encoder_batches(n=2)))
    (call,) = calls
    reference, run = call.reference, call.run
    assert reference is not None and run is not None and run.stages == 4 * layers
    assert run.evaluations <= len(graph.nodes) and run.reference_evaluations <= len(reference.nodes)
    assert run.evaluations + run.reference_evaluations <= 2 * len(graph.nodes)
    # Exactly: everything but the last block's down projection and residual, and in the quantized
    # graph one DequantizeWeight per weight on top (the last one is never evaluated).
    assert run.reference_evaluations == nodes_before - 2
    assert run.evaluations == nodes_before - 2 + 6 * layers - 1


def test_a_rewritten_weight_read_earlier_is_evaluated_again(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = watch_driver(monkeypatch)
    graph = shared_weight()
    run_passes(graph, [get_pass("quantize")], PassContext(options=CompileOptions(quant="int4", group_size=32),
                                                          calibration=[{"x": np.ones((4, 32), np.float32)}]))
    run = calls[0].run
    assert run is not None
    # Stages: mid, then shared (first and again), then last. Once `shared` is rewritten, first,
    # act0, mid and act1 (evaluated for the earlier stages) are evaluated again for the last one.
    assert run.stages == 3 and run.reference_evaluations == 6
    assert run.evaluations == 6 + 2 + 4 + 1  # the graph once, two DequantizeWeights, four again, one re-read


def test_each_stage_sees_the_earlier_stages_rewritten(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPTQ's sequential scheme: when a stage's statistics are handed over, every earlier stage is
    already quantized, and each statistic carries the cross term with the unquantized graph."""
    calls = watch_driver(monkeypatch)
    run_passes(tiny_encoder(2), [get_pass("quantize")],
               PassContext(options=CompileOptions(quant="int4", group_size=32), calibration=encoder_batches(n=2)))
    stages = calls[0].stages
    assert [seen.dequantized for seen in stages] == [0, 3, 4, 5, 6, 9, 10, 11]  # q/k/v together, then o, up, down
    assert [len(seen.stats) for seen in stages] == [1] * 8  # q, k and v read one activation
    assert all(s.cross is not None for seen in stages for s in seen.stats.values())


def test_evaluate_nodes_continues_from_given_values() -> None:
    graph, feed = tiny_encoder(2), encoder_batches(n=1)[0]
    whole = evaluate(graph, feed, keep=("layer0.res2_out",))
    values = {graph.inputs[0]: feed["x"]}
    first, rest = graph.nodes[:12], graph.nodes[12:]
    boundary = graph.value("layer0.res2_out")
    evaluate_nodes(first, values, keep={graph.inputs[0]})
    assert set(values) == {graph.inputs[0], boundary}  # what layer 0 read is dropped, unless kept
    np.testing.assert_array_equal(values[boundary], whole["layer0.res2_out"])
    evaluate_nodes(rest, values)
    np.testing.assert_array_equal(values[graph.outputs[0]], whole[graph.outputs[0].name])
    assert boundary not in values  # dropped after its last read


def test_evaluate_nodes_names_what_is_missing() -> None:
    from aviatorc.errors import EvaluationError

    graph = tiny_encoder(1)
    with pytest.raises(EvaluationError, match="value 'layer0.res1_out' is read by 'layer0.ln2' but was not given"):
        evaluate_nodes(graph.nodes[7:], {})
