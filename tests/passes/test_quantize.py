"""quantize: structure (DequantizeWeight over exact packed bytes, fp16 embeddings and kept
layers), numerics against the fp32 graph, shape-only graphs, and OptionErrors with pinned text."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from aviatorc.passes.manager import PassContext, get_pass, run_passes

from aviatorc.accuracy import accuracy_report
from aviatorc.errors import OptionError
from aviatorc.formats import WeightFormat
from aviatorc.ir import evaluate
from aviatorc.options import CompileOptions
from tests.quant.stage_spy import watch_driver
from tests.quant.tiny_models import correlated_inputs, lm_batches, single_linear, tiny_lm


def run(graph, target=None, calibration=None, names=("quantize",), **options):
    ctx = PassContext(options=CompileOptions(**options), target=target, calibration=calibration)
    return run_passes(graph, [get_pass(n) for n in names], ctx)


def dequant_nodes(graph):
    return [n for n in graph.nodes if n.op == "DequantizeWeight"]


def stored_bytes(graph, node) -> int:
    return sum(v.type.nbytes() for v in node.inputs if v is not None)


@pytest.mark.parametrize("options", [dict(quant="int8"), dict(quant="int8", group_size=32),
                                     dict(quant="int4", group_size=64),
                                     dict(quant="int4", group_size=32, symmetric=False),
                                     dict(quant="mxint4"), dict(quant="mxint8")], ids=str)
def test_structure_and_exact_bytes(options) -> None:
    g = tiny_lm()
    run(g, quant_method="rtn", **options)
    nodes = dequant_nodes(g)
    assert len(nodes) == 3
    for node in nodes:
        fmt = WeightFormat.from_attrs(node.attrs)
        data_free_int4_head = options["quant"] == "int4" and "symmetric" not in options and node.name.startswith("lm_head")
        assert fmt.kind == ("int8" if data_free_int4_head else options["quant"])  # the head: output_head_format
        k, n = node.outputs[0].type.shape
        assert all(v.is_initializer for v in node.inputs if v is not None)
        assert stored_bytes(g, node) == fmt.storage_bytes(k, n)
        assert [u.op for u in node.outputs[0].users] == ["MatMul"]
    assert "embed.weight" not in g.initializers and g.initializers["embed.weight.fp16"].type.dtype == "float16"
    assert g.outputs[0].name == "logits"


def test_numerics_int8_close_to_fp32() -> None:
    g, batches = tiny_lm(), lm_batches()
    ref = g.clone()
    run(g, quant="int8")
    for feed in batches:
        a, b = evaluate(ref, feed)["logits"], evaluate(g, feed)["logits"]
        cos = float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b))
        assert cos > 0.9999


def test_gptq_is_the_default_with_calibration_and_beats_rtn() -> None:
    batches = lm_batches()
    ref = tiny_lm()
    results = {}
    for method in ("rtn", None):
        g = tiny_lm()
        records = run(g, calibration=batches, quant="int4", quant_method=method)
        results[records[0].stats["method"]] = accuracy_report(ref, g, batches)["end_to_end"][0]["sqnr_db"]
    assert set(results) == {"rtn", "gptq"} and results["gptq"] > results["rtn"] + 1.0


def test_keep_fp16_and_embeddings() -> None:
    g = tiny_lm()
    run(g, quant="int4", quant_method="rtn", keep_fp16=("lm_head*",))
    formats = {n.name: WeightFormat.from_attrs(n.attrs).kind for n in dequant_nodes(g)}
    assert formats == {"lm_head.weight.dequant": "fp16", "mlp.up.weight.dequant": "int4",
                       "mlp.down.weight.dequant": "int4"}
    gather = next(n for n in g.nodes if n.op == "Gather")
    assert gather.input(0).type.dtype == "float16" and gather.outputs[0].users[0].op == "Cast"


def test_w8a8_inserts_activation_quantization() -> None:
    g, batches = tiny_lm(), lm_batches()
    ref = g.clone()
    records = run(g, calibration=batches, quant="int8", activations="percentile")
    assert records[0].stats["activations_quantized"] == 3
    assert [n.inputs[0].producer.op for n in g.nodes if n.op == "MatMul"] == ["QuantizeActivation"] * 3
    report = accuracy_report(ref, g, batches)
    assert report["end_to_end"][0]["cosine"] > 0.999


def test_shape_only_graph_gets_exact_packed_shapes() -> None:
    g = tiny_lm(shape_only=True)
    run(g, quant="int4", group_size=128, symmetric=True)
    total = 0
    for node in dequant_nodes(g):
        k, n = node.outputs[0].type.shape
        assert stored_bytes(g, node) == WeightFormat("int4", 128).storage_bytes(k, n)
        assert all(not v.data.available for v in node.inputs if v is not None)
        total += stored_bytes(g, node)
    # up [64, 128] + down [128, 64] + head [64, 96]: ragged K = 64 pads to one group of 128.
    assert total == sum(WeightFormat("int4", 128).storage_bytes(k, n) for k, n in ((64, 128), (128, 64), (64, 96)))


def test_ragged_group_is_padded() -> None:
    w = np.random.default_rng(0).standard_normal((576, 16)).astype(np.float32)
    g = single_linear(576, 16, w)
    run(g, quant="int4", group_size=128, quant_method="rtn")
    node = dequant_nodes(g)[0]
    assert node.input(0).type.shape == (320, 16)  # 5 groups of 128 rows, two codes per byte
    x = correlated_inputs(np.random.default_rng(1), 8, 576)
    y = evaluate(g, {"x": x})["y"]
    assert np.abs(y - x @ w).max() / np.abs(x @ w).max() < 0.1


MOCK = SimpleNamespace(name="mock", matrix_unit_k=64, weight_formats=("int8", "mxint8", "mxint4"))


@pytest.mark.parametrize("options, target, calibration, message", [
    (dict(quant="int4"), MOCK, None, "target 'mock' does not support int4 weights; it supports int8, mxint8, mxint4"),
    (dict(quant="mxint4", group_size=32), SimpleNamespace(name="mock", matrix_unit_k=48, weight_formats=("mxint4",)),
     None, "group size 32 does not align with the matrix-unit depth 48 of target 'mock'; choose a group size that "
     "divides it or is a multiple of it"),
    (dict(quant="int4", quant_method="gptq"), None, None, "quantization method 'gptq' needs calibration data"),
    (dict(quant="int4", quant_method="awq"), None, None, "quantization method 'awq' needs calibration data"),
    (dict(quant="int4", activations="minmax"), None, None, "activation quantization (W8A8) needs int8 weights, not int4"),
    (dict(quant="int8", activations="minmax"), None, None, "activation ranges ('minmax') need calibration data"),
    (dict(quant="int8"), None, [{"input_ids": np.zeros((1, 4), np.int64)}, {"input_ids": np.zeros((1, 4), np.float32)}],
     "calibration batch 1 does not match the model: input 'input_ids' is float32, expected int64"),
    (dict(quant="int8"), None, [{"ids": np.zeros((1, 4), np.int64)}],
     "calibration batch 0 does not match the model: missing input(s): input_ids"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_options_are_option_errors(options, target, calibration, message) -> None:
    g = tiny_lm()
    before = len(g.nodes)
    with pytest.raises(OptionError) as info:
        run(g, target=target, calibration=calibration, **options)
    assert message in str(info.value)
    assert len(g.nodes) == before  # nothing rewritten


def test_unsupported_group_size_is_an_option_error() -> None:
    with pytest.raises(OptionError, match="group size 48 is not supported; choose one of 32, 64, 128"):
        CompileOptions(quant="int4", group_size=48)


@pytest.mark.parametrize("options, group, name", [
    (dict(quant="int8"), 0, "int8"),  # no group size: int8 stays per output channel
    (dict(quant="int8", group_size=0), 0, "int8"),
    (dict(quant="int8", group_size=128), 128, "int8-g128"),
    (dict(quant="int4", symmetric=True), 32, "int4-g32"),  # int4 and MX keep their default of 32
    (dict(quant="int4", group_size=64, symmetric=False), 64, "int4-g64-asym"),
    (dict(quant="mxint8"), 32, "mxint8-g32"),
], ids=str)
def test_group_size_defaults_per_format(options, group, name) -> None:
    opts = CompileOptions(**options)
    assert opts.weight_group_size == group
    g = tiny_lm()
    (record,) = run(g, quant_method="rtn", **options)
    assert record.stats["format"] == name
    assert {WeightFormat.from_attrs(n.attrs).name for n in dequant_nodes(g)} == {name}


def test_a_zero_group_size_is_int8s_alone() -> None:
    with pytest.raises(OptionError, match=r"int4 weights need a group size; 0 \(per output channel\) is int8's alone"):
        CompileOptions(quant="int4", group_size=0)
    with pytest.raises(OptionError, match="choose one of 32, 64, 128, or 0 for per output channel"):
        CompileOptions(quant="int8", group_size=16)


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_group_wise_int8_beats_per_channel_on_outlier_rows(method) -> None:
    """A weight with outlier input channels: group-wise scales confine their coarse step to one
    group, through the pass (RTN, and GPTQ with calibration), with exact stored bytes."""
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((256, 32)) * 0.02).astype(np.float32)
    w[[7, 9]] *= 50
    x = correlated_inputs(rng, 64, 256)
    errors = {}
    for group in (None, 32):
        g = single_linear(256, 32, w)
        batches = [{"x": x[i:i + 16]} for i in range(0, 64, 16)] if method == "gptq" else None
        run(g, calibration=batches, quant="int8", group_size=group, quant_method=method)
        node = dequant_nodes(g)[0]
        assert stored_bytes(g, node) == WeightFormat("int8", group or 0).storage_bytes(256, 32)
        y = evaluate(g, {"x": x})["y"]
        errors[group] = float(np.linalg.norm(y - x @ w) / np.linalg.norm(x @ w))
    assert errors[32] < 0.5 * errors[None], errors


def test_weight_read_by_another_op_is_left_alone() -> None:
    g = tiny_lm()
    head = g.initializers["lm_head.weight"]
    from aviatorc.ir import add_value

    extra = add_value(g, "Transpose", [head], {"perm": (1, 0)}, name="tied")
    g.outputs.append(extra)
    records = run(g, quant="int8")
    assert "lm_head.weight" in g.initializers
    assert any("also read by Transpose 'tied'" in note for note in records[0].notes)


def test_calibration_stages_follow_the_data_flow() -> None:
    from aviatorc.passes._weights import calibration_stages, find_linear_weights

    g = tiny_lm()
    weights, _ = find_linear_weights(g)
    stages = calibration_stages(g, weights)
    assert [[lw.name for lw in stage] for stage in stages] == [["mlp.up.weight"], ["mlp.down.weight"],
                                                               ["lm_head.weight"]]


def test_calibration_is_sequential(monkeypatch: pytest.MonkeyPatch) -> None:
    """The second layer's GPTQ Hessian comes from the first layer already quantized: when a
    stage's statistics reach the pass, every earlier stage has been rewritten."""
    calls = watch_driver(monkeypatch)
    run(tiny_lm(), calibration=lm_batches(), quant="int4")
    assert [seen.dequantized for seen in calls[0].stages] == [0, 1, 2]


def test_float16_model_quantized_weights_reach_the_partitioner() -> None:
    # A float16 model reads the dequantized weight through a Cast: both the quantize pass (after
    # sparsify) and the partitioner's weight walk must look through it.
    from aviatorc.passes.manager import PassContext, get_pass, run_passes

    from aviatorc.ir import Graph, TensorType, add_value
    from aviatorc.partition.weights import weights_from_graph

    g = Graph()
    x = g.add_input("x", TensorType("float16", (4, 64)))
    w = g.add_constant(np.random.default_rng(0).standard_normal((64, 32)).astype(np.float16), "fc.weight")
    g.outputs = [add_value(g, "MatMul", [x, w], name="fc")]
    ctx = PassContext(options=CompileOptions(quant="int8", sparsity="2:4"))
    records = run_passes(g, [get_pass("sparsify-2to4"), get_pass("quantize"), get_pass("dce")], ctx)
    assert records[1].stats["weights_quantized"] == 1
    (spec,) = weights_from_graph(g)
    assert (spec.k, spec.n, spec.format.kind, spec.format.sparsity) == (64, 32, "int8", "2:4")
