"""sparsify-2to4: the 2:4 pattern in every group of four along K, compressed storage with exact
bytes, selection methods, tile alignment, and composition with quantize."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from aviatorc.passes.manager import PassContext, get_pass, run_passes

from aviatorc.accuracy import accuracy_report
from aviatorc.errors import OptionError
from aviatorc.formats import WeightFormat
from aviatorc.ir import evaluate, get_op
from aviatorc.options import CompileOptions
from aviatorc.quant.sparse import check_24
from tests.quant.stage_spy import watch_driver
from tests.quant.tiny_models import correlated_inputs, lm_batches, single_linear, tiny_lm


def run(graph, names, target=None, calibration=None, **options):
    ctx = PassContext(options=CompileOptions(**options), target=target, calibration=calibration)
    return run_passes(graph, [get_pass(n) for n in names], ctx)


def dense_weights(graph):
    """name -> the float32 [K, N] weight each DequantizeWeight stands for, and its node."""
    out = {}
    opdef = get_op("DequantizeWeight")
    for node in graph.nodes:
        if node.op == "DequantizeWeight":
            arrays = [v.data.load() if v is not None else None for v in node.inputs]
            out[node.name] = (opdef.kernel(arrays, opdef.resolve_attrs(node.attrs))[0], node)
    return out


@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt"])
def test_pattern_and_bytes(method: str) -> None:
    g = tiny_lm()
    run(g, ["sparsify-2to4"], calibration=lm_batches(), sparsity="2:4", sparsity_method=method)
    weights = dense_weights(g)
    assert len(weights) == 3
    for w, node in weights.values():
        fmt = WeightFormat.from_attrs(node.attrs)
        assert fmt == WeightFormat("fp32", 0, True, "2:4")
        assert check_24(w != 0)
        k, n = w.shape
        assert sum(v.type.nbytes() for v in node.inputs if v is not None) == fmt.storage_bytes(k, n)


def test_activation_aware_beats_magnitude_on_the_layer_output() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((128, 32)).astype(np.float32)
    x = correlated_inputs(rng, 512, 128)
    errors = {}
    for method in ("magnitude", "wanda", "sparsegpt"):
        g = single_linear(128, 32, w)
        run(g, ["sparsify-2to4"], calibration=[{"x": x}], sparsity="2:4", sparsity_method=method)
        y = evaluate(g, {"x": x})["y"]
        errors[method] = float(np.linalg.norm(y - x @ w))
    assert errors["sparsegpt"] < errors["wanda"] < errors["magnitude"], errors


@pytest.mark.parametrize("quant", ["int8", "int4", "mxint4"])
def test_composes_with_quantize(quant: str) -> None:
    g, batches = tiny_lm(), lm_batches()
    ref = g.clone()
    run(g, ["sparsify-2to4", "quantize"], calibration=batches, sparsity="2:4", sparsity_method="sparsegpt", quant=quant)
    weights = dense_weights(g)
    assert len(weights) == 3
    for w, node in weights.values():
        fmt = WeightFormat.from_attrs(node.attrs)
        assert fmt.kind == quant and fmt.sparsity == "2:4"
        assert check_24(w != 0)
        k, n = w.shape
        assert sum(v.type.nbytes() for v in node.inputs if v is not None) == fmt.storage_bytes(k, n)
    assert accuracy_report(ref, g, batches)["end_to_end"][0]["cosine"] > 0.8


def test_odd_k_is_padded_to_groups_of_four() -> None:
    w = np.random.default_rng(1).standard_normal((70, 8)).astype(np.float32)
    g = single_linear(70, 8, w)
    run(g, ["sparsify-2to4"], sparsity="2:4")
    (w_hat, node), = dense_weights(g).values()
    assert w_hat.shape == (70, 8) and check_24(w_hat != 0)
    assert node.input(0).type.shape == (36, 8)  # 18 groups of four, two kept of each


def test_shape_only() -> None:
    g = tiny_lm(shape_only=True)
    run(g, ["sparsify-2to4", "quantize"], sparsity="2:4", quant="int4", group_size=32)
    for node in g.nodes:
        if node.op == "DequantizeWeight":
            k, n = node.outputs[0].type.shape
            assert sum(v.type.nbytes() for v in node.inputs if v is not None) == \
                WeightFormat("int4", 32, True, "2:4").storage_bytes(k, n)


def test_keep_fp16_layers_stay_dense() -> None:
    g = tiny_lm()
    records = run(g, ["sparsify-2to4"], sparsity="2:4", keep_fp16=("lm_head*",))
    assert "lm_head.weight" in g.initializers
    assert any("matches keep_fp16" in note for note in records[0].notes)


@pytest.mark.parametrize("options, target, message", [
    (dict(sparsity="2:4", sparsity_method="wanda"), None, "sparsity method 'wanda' needs calibration data"),
    (dict(sparsity="2:4"), SimpleNamespace(name="odd", matrix_unit_k=30),
     "2:4 sparsity needs a matrix-unit depth that is a multiple of 4; target 'odd' has 30"),
], ids=["wanda-without-data", "tile"])
def test_bad_options(options, target, message) -> None:
    g = tiny_lm()
    with pytest.raises(OptionError) as info:
        run(g, ["sparsify-2to4"], target=target, **options)
    assert message in str(info.value)


def test_sparsegpt_calibration_is_sequential(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each stage's statistics come from the graph with the earlier stages pruned, and carry the
    cross term with the unpruned graph."""
    calls = watch_driver(monkeypatch)
    run(tiny_lm(), ["sparsify-2to4"], calibration=lm_batches(), sparsity="2:4", sparsity_method="sparsegpt")
    assert [seen.dequantized for seen in calls[0].stages] == [0, 1, 2]
    assert all(s.cross is not None for seen in calls[0].stages for s in seen.stats.values())
