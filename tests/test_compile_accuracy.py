"""The compile report's accuracy is measured out of sample and covers every quantized weight.

- without evaluation batches the last quarter of the calibration batches is held out: the
  compile equals one given the first three batches as calibration and the fourth as
  evaluation (same weights, same figures), and differs from one that calibrates on all four;
- one calibration batch can only be in-sample, and the report says so;
- the per-layer table has a row for every MatMul reading a quantized weight, the fused QKV
  projection among them (the reference is the graph after the exact passes), and that row's
  own error is the fused weight's: SQNR at INT4 far below INT8's on the same layer.
"""

from __future__ import annotations

import numpy as np
import pytest

import aviatorc
from aviatorc import zoo
from aviatorc.accuracy import format_accuracy
from tests.zoo_fixtures import zoo_dir, zoo_onnx  # noqa: F401


def batches(n: int) -> list[dict[str, np.ndarray]]:
    return [{k: v.numpy() for k, v in zoo.example_inputs("llama", seed=seed).items()} for seed in range(n)]


def compile_llama(path, **options):
    return aviatorc.compile(path, target="mock", quant="int4", group_size=32, time_limit_s=1.0, **options)


def quantized_weights(result) -> dict[str, np.ndarray]:
    """Every packed array a DequantizeWeight reads (codes, scales, zero points), by name."""
    return {v.name: v.data.load() for n in result.graph.nodes if n.op == "DequantizeWeight"
            for v in n.inputs if v is not None and v.data is not None}


@pytest.fixture(scope="module")
def llama(zoo_onnx):  # noqa: F811
    return zoo_onnx("llama")


def test_the_last_quarter_of_calibration_is_held_out(llama):
    data = batches(4)
    split = compile_llama(llama, calibration=data)
    given = compile_llama(llama, calibration=data[:3], evaluation=data[3:])
    everything = compile_llama(llama, calibration=data, evaluation=data[3:])

    accuracy = split.report.data["accuracy"]
    assert accuracy["batches"] == 1
    assert accuracy["data"] == {"held_out": True, "batches": 1,
                                "note": "the last 1 of 4 calibration batches, held out of calibration"}
    assert accuracy["end_to_end"] == given.report.data["accuracy"]["end_to_end"]
    ours, theirs = quantized_weights(split), quantized_weights(given)
    assert ours.keys() == theirs.keys() and ours
    assert all(np.array_equal(ours[name], theirs[name]) for name in ours)
    # GPTQ on four batches is another result: the fourth batch really was left out above.
    assert any(not np.array_equal(ours[name], array) for name, array in quantized_weights(everything).items())
    assert "held-out accuracy" in split.report.summary()
    assert format_accuracy(accuracy).startswith("accuracy on 1 held-out batch(es) (the last 1 of 4")


def test_one_calibration_batch_is_in_sample_and_says_so(llama):
    accuracy = compile_llama(llama, calibration=batches(1)).report.data["accuracy"]
    assert accuracy["data"]["held_out"] is False and accuracy["data"]["note"].startswith("in-sample")
    assert format_accuracy(accuracy).startswith("accuracy on 1 in-sample batch(es)")


def test_every_quantized_matmul_has_a_row_the_fused_qkv_too(llama):
    int4 = compile_llama(llama, evaluation=batches(2), quant_method="rtn")
    int8 = aviatorc.compile(llama, target="mock", quant="int8", time_limit_s=1.0, evaluation=batches(2))
    fused = [n.name for n in int4.graph.nodes if n.op == "MatMul" and "qkv" in n.name]
    assert len(fused) == 2  # the zoo llama's two attention blocks
    quantized = sorted(n.name for n in int4.graph.nodes if n.op == "MatMul" and n.inputs[1].producer is not None
                       and n.inputs[1].producer.op in ("DequantizeWeight", "Cast"))
    rows4 = {row["node"]: row for row in int4.report.data["accuracy"]["layers"]}
    rows8 = {row["node"]: row for row in int8.report.data["accuracy"]["layers"]}
    assert sorted(rows4) == quantized and set(fused) <= set(rows4)
    nodes = {n.name: n for n in int4.graph.nodes}
    for name in fused:  # 4 bits lose ~24 dB against 8 (6 dB a bit): the row measures the weight
        assert float(rows8[name]["sqnr_db"]) - float(rows4[name]["sqnr_db"]) > 15
        assert rows4[name]["n"] == nodes[name].inputs[1].type.shape[-1]


def test_awq_compiles_to_a_checked_plan_and_beats_rtn(llama, tmp_path):
    """AWQ through the whole compile: its scales folded into the RMSNorms or a Mul in front of the
    MatMuls, the plan placed, scheduled and checked, the artifact saved; held out, closer to fp32
    than round-to-nearest, both with 4-bit zero points. (With the default fp16 offsets, whose
    least-squares fit already lowers the error of every group, RTN measured 0.998142 and AWQ
    0.997667 end-to-end cosine here: AWQ's scales earn nothing on this tiny model.)"""
    data = batches(4)
    awq = compile_llama(llama, calibration=data, quant_method="awq", symmetric=False)
    rtn = compile_llama(llama, calibration=data, quant_method="rtn", symmetric=False)
    stats = next(r["stats"] for r in awq.report.data["passes"] if r["name"] == "quantize")
    assert stats["method"] == "awq" and stats["calibration_tokens"] > 0
    assert any(n.op == "Mul" and n.name.endswith(".awq_scale") for n in awq.graph.nodes)
    assert any(v.endswith(".awq") for v in awq.graph.initializers)  # a norm's scale folded
    awq.save(tmp_path / "awq.avc")
    cos = {name: result.report.data["accuracy"]["end_to_end"][0]["cosine"] for name, result in
           (("awq", awq), ("rtn", rtn))}
    assert cos["awq"] > cos["rtn"], cos
