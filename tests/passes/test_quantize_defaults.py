"""The quantize pass's defaults (tools/bench_defaults.py measures them held out): a calibrated int4
compile is asymmetric GPTQ (damping 0.3 at any amount of text), an uncalibrated one symmetric round-to-nearest, an explicit
`symmetric` wins either way; fuse-qkv's size estimate agrees with quantize's choice."""

from __future__ import annotations

import pytest
from aviatorc.passes.fuse_qkv import storage_format
from aviatorc.passes.manager import PassContext, get_pass, run_passes
from aviatorc.passes.quantize import gptq_config, int4_symmetric, weight_format

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
    (True, {}, ({"int4-g32-asym"}, "gptq")),
    (False, {}, ({"int4-g32"}, "rtn")),
    (True, {"symmetric": True}, ({"int4-g32"}, "gptq")),
    (False, {"symmetric": False}, ({"int4-g32-asym"}, "rtn")),
], ids=["calibrated", "uncalibrated", "calibrated-symmetric", "uncalibrated-asymmetric"])
def test_int4_defaults(calibrated, options, expected) -> None:
    assert formats_after(lm_batches() if calibrated else None, quant="int4", **options) == expected


def test_other_formats_ignore_the_int4_default() -> None:
    for quant, name in (("int8", "int8"), ("mxint4", "mxint4-g32")):
        assert weight_format(CompileOptions(quant=quant), calibrated=True).name == name


def test_fuse_qkv_estimates_the_format_quantize_stores() -> None:
    opts = CompileOptions(quant="int4")
    for calibrated in (True, False):
        assert storage_format("float32", opts, calibrated=calibrated) == weight_format(opts, calibrated=calibrated)
    assert int4_symmetric(opts, calibrated=True) is False and int4_symmetric(opts, calibrated=False) is True


def test_gptq_damping_is_strong_at_any_amount_of_text() -> None:
    assert gptq_config(616, 384).damp == gptq_config(616, 1536).damp == gptq_config(100_000, 384).damp == 0.3
    assert gptq_config(616, 384).act_order
