"""The quantize pass's defaults (tools/bench_defaults.py measures them held out): a calibrated int4
compile is GPTQ (damping 0.3 at any amount of text), an uncalibrated one round-to-nearest, both asymmetric with
fp16 offsets (tools/bench_int4_default.py measures it), an explicit `symmetric` wins either way; fuse-qkv's size estimate agrees with quantize's choice."""

from __future__ import annotations

import pytest
from aviatorc.passes.fuse_qkv import storage_format
from aviatorc.passes.manager import PassContext, get_pass, run_passes
from aviatorc.passes.quantize import gptq_config, int4_zero, weight_format

from aviatorc.formats import WeightFormat
from aviatorc.options import CompileOptions
from tests.quant.tiny_models import lm_batches, tiny_lm


def formats_after(calibration, **options) -> tuple[set[str], str]:
    g = tiny_lm()
    (record,) = run_passes(g, [get_pass("quantize")], PassContext(options=CompileOptions(**options),
                                                                 calibration=calibration))
    names = {WeightFormat.from_attrs(n.attrs).name for n in g.nodes if n.op == "DequantizeWeight"}
    return names, record.stats["method"]


@pytest.mark.parametrize("calibrated, options, expected", [
    (True, {}, ({"int4-g32-asym-fp16zero", "int8-g32"}, "gptq")),
    (False, {}, ({"int4-g32-asym-fp16zero", "int8-g32"}, "rtn")),  # the head (logits) at int8: output_head_format
    (True, {"symmetric": True}, ({"int4-g32"}, "gptq")),
    (False, {"symmetric": False}, ({"int4-g32-asym"}, "rtn")),
], ids=["calibrated", "uncalibrated", "calibrated-symmetric", "uncalibrated-asymmetric"])
def test_int4_defaults(calibrated, options, expected) -> None:
    assert formats_after(lm_batches() if calibrated else None, quant="int4", **options) == expected


def test_other_formats_ignore_the_int4_default() -> None:
    for quant, name in (("int8", "int8"), ("mxint4", "mxint4-g32")):
        assert weight_format(CompileOptions(quant=quant)).name == name


def test_fuse_qkv_estimates_the_format_quantize_stores() -> None:
    opts = CompileOptions(quant="int4")
    assert storage_format("float32", opts) == weight_format(opts)
    assert int4_zero(opts) == (False, "fp16")
    assert int4_zero(opts, sparsity="2:4") == (True, "int")  # a pruned weight must read 0
    assert int4_zero(CompileOptions(quant="int4", symmetric=False)) == (False, "int")


def test_gptq_damping_is_strong_at_any_amount_of_text() -> None:
    assert gptq_config(616, 384).damp == gptq_config(616, 1536).damp == gptq_config(100_000, 384).damp == 0.3
    assert gptq_config(616, 384).act_order


def test_without_data_only_the_output_head_is_8_bit() -> None:
    """The MatMul producing the logits keeps int8 with int4's groups; every other weight is int4."""
    from aviatorc.passes.quantize import is_output_head

    g = tiny_lm()
    (record,) = run_passes(g, [get_pass("quantize")], PassContext(options=CompileOptions(quant="int4")))
    heads = [n for n in g.nodes if n.op == "MatMul" and n.outputs[0] in g.outputs]
    assert len(heads) == 1 and record.stats["output_heads_int8"] == 1
    for node in g.nodes:
        if node.op == "MatMul" and node.input(1).producer is not None:
            name = WeightFormat.from_attrs(node.input(1).producer.attrs).name
            assert name == ("int8-g32" if node in heads else "int4-g32-asym-fp16zero"), node.name
    assert not is_output_head(g, type("LW", (), {"matmuls": [n for n in g.nodes if n.op == "MatMul"
                                                              and n not in heads][:1]})())
