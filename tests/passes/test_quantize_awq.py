"""quantize with AWQ (`quant_method="awq"`): where 1 / s goes (folded into the norm that feeds only
the scaled MatMuls, else a Mul in front of them), that the rewrite is exact before rounding, and
that AWQ beats round-to-nearest on held-out batches through the pass."""

from __future__ import annotations

import numpy as np
import pytest
from aviatorc.passes._awq import scale_input
from aviatorc.passes.manager import PassContext, get_pass, run_passes

from aviatorc.errors import OptionError
from aviatorc.ir import ArrayData, evaluate
from aviatorc.ir.verifier import verify
from aviatorc.options import CompileOptions
from aviatorc.quant.awq import AWQResult
from tests.quant.tiny_models import encoder_batches, tiny_encoder


def run(graph, calibration=None, **options):
    ctx = PassContext(options=CompileOptions(**options), calibration=calibration)
    return run_passes(graph, [get_pass("quantize")], ctx)


def relative_error(ref, graph, batches) -> float:
    out = []
    for feed in batches:
        a, b = evaluate(ref, feed)[ref.outputs[0].name], evaluate(graph, feed)[graph.outputs[0].name]
        out.append(float(np.linalg.norm(a - b) / np.linalg.norm(a)))
    return float(np.mean(out))


def test_scales_fold_into_the_norm_or_become_a_mul() -> None:
    g = tiny_encoder(2)
    (record,) = run(g, calibration=encoder_batches(), quant="int4", quant_method="awq")
    assert record.stats["method"] == "awq" and record.stats["weights_quantized"] == 12
    muls = [n for n in g.nodes if n.op == "Mul"]
    # o reads the attention output, down the Gelu's: a Mul each; q/k/v and up read a norm that feeds
    # nothing else (pre-norm): folded, no node.
    assert sorted(next(u.name for u in n.outputs[0].users) for n in muls) == \
        ["layer0.down", "layer0.o", "layer1.down", "layer1.o"]
    for layer in ("layer0", "layer1"):
        for norm in ("ln1", "ln2"):
            node = next(n for n in g.nodes if n.name == f"{layer}.{norm}")
            assert node.input(1).name == f"{layer}.{norm}.scale.awq"
    assert not {"layer0.ln1.scale", "layer1.ln2.scale"} & set(g.initializers)  # the old scales are gone


@pytest.mark.parametrize("fold", [True, False], ids=["folded", "mul"])
def test_scaling_alone_is_exact(fold: bool) -> None:
    """x / s into diag(s) W without rounding: the same outputs (float32 rounding only)."""
    g = tiny_encoder(1)
    ref = g.clone()
    rng = np.random.default_rng(0)
    names = ["layer0.q", "layer0.k", "layer0.v"] if fold else ["layer0.down"]
    readers = [n for n in g.nodes if n.name in names]
    s = np.exp(rng.standard_normal(readers[0].input(1).type.shape[0])).astype(np.float32)
    for mm in readers:
        w = mm.input(1)
        w.data = ArrayData((w.data.load() * s[:, None]).astype(np.float32))
    how = scale_input(g, readers[0].input(0), readers, AWQResult(0.5, s, (), ()))
    assert how == ("folded" if fold else "mul")
    verify(g)
    for feed in encoder_batches(2):
        np.testing.assert_allclose(evaluate(g, feed)[g.outputs[0].name], evaluate(ref, feed)[ref.outputs[0].name],
                                   rtol=1e-4, atol=1e-5)


# Measured: symmetric 0.0494 -> 0.0439 relative error, asymmetric 0.0407 -> 0.0390 (the zero point
# already absorbs part of what the scales buy on these mildly uneven channels).
@pytest.mark.parametrize("symmetric, factor", [(True, 0.95), (False, 0.99)])
def test_awq_beats_rtn_held_out(symmetric: bool, factor: float) -> None:
    cal, held = encoder_batches(4, seed=1), encoder_batches(4, seed=7)
    errors = {}
    for method in ("rtn", "awq"):
        g = tiny_encoder(2)
        ref = g.clone()
        run(g, calibration=cal, quant="int4", symmetric=symmetric, quant_method=method)
        errors[method] = relative_error(ref, g, held)
    assert errors["awq"] < factor * errors["rtn"], errors


def test_awq_refuses_activation_quantization() -> None:
    g = tiny_encoder(1)
    with pytest.raises(OptionError, match="AWQ scales the activations the W8A8 ranges would be taken from"):
        run(g, calibration=encoder_batches(), quant="int8", quant_method="awq", activations="minmax")
