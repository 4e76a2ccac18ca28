"""Model-zoo parity through torch.export: every tiny transformers architecture imported into
the IR and run by the numpy interpreter matches eager torch in fp32.

Tolerance 1e-4 max abs diff: the same fp32 math summed in a different order (measured
differences are around 1e-6 on logits of these sizes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers  # noqa: F401

from aviatorc import zoo  # noqa: E402
from aviatorc.frontends.torch import import_torch  # noqa: E402
from aviatorc.ir import evaluate  # noqa: E402

TOL = 1e-4


def _eager(model, inputs):
    with torch.no_grad():
        out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("arch", zoo.ZOO_ARCHS)
def test_static_export_matches_eager(arch):
    model, inputs = zoo.build_model(arch), zoo.example_inputs(arch)
    graph = import_torch(model, inputs)
    assert [v.name for v in graph.inputs] == list(inputs)
    assert "Attention" in graph.op_census() or "Softmax" in graph.op_census()
    got = evaluate(graph, {k: v.numpy() for k, v in inputs.items()})
    (expected,) = _eager(model, inputs)
    (out,) = got.values()
    assert out.shape == tuple(expected.shape)
    assert np.abs(out - expected.numpy()).max() <= TOL


@pytest.mark.parametrize("arch", zoo.ZOO_ARCHS)
def test_dynamic_batch_and_seq_with_padding(arch):
    """Exported with symbolic batch/seq, run at another size with a left-padded row."""
    model = zoo.build_model(arch)
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq", max=zoo.MAX_POSITIONS)
    spec = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}
    graph = import_torch(model, zoo.example_inputs(arch, batch=2, seq=8), dynamic_shapes=spec)
    assert graph.inputs[0].type.shape == ("batch", "seq")
    inputs = zoo.example_inputs(arch, batch=3, seq=11, seed=1)
    inputs["attention_mask"][0, :3] = 0
    (out,) = evaluate(graph, {k: v.numpy() for k, v in inputs.items()}).values()
    (expected,) = _eager(model, inputs)
    # Fully masked query rows (the padded positions) differ by convention (NaN vs zeros).
    diff = np.abs(out - expected.numpy())
    valid = np.isfinite(expected.numpy())
    assert np.nanmax(np.where(valid, diff, 0)) <= TOL


@pytest.mark.parametrize("arch", zoo.DECODE_ARCHS)
def test_decode_step_with_kv_cache_matches_eager(arch):
    model, inputs = zoo.build_decode_model(arch), zoo.decode_example_inputs(arch)
    tensors = tuple(inputs.values())
    graph = import_torch(model, tensors)
    got = evaluate(graph, {v.name: t.numpy() for v, t in zip(graph.inputs, tensors, strict=True)})
    expected = _eager(model, tensors)
    assert len(got) == len(expected)
    for out, ref in zip(got.values(), expected, strict=True):
        assert np.abs(out - ref.numpy()).max() <= TOL


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_compilers_step_graph_converts_without_decomposing(arch):
    """Any op outside the converters sends the whole program through `run_decompositions`, which
    re-traces it with symbolic shapes: about 45 s of SmolLM2-135M's compile, for two `detach_` of
    constants the step's forward makes per layer, before `detach_` was converted."""
    from aviatorc.frontends.torch import aten, decoder, exporter
    from aviatorc.frontends.torch.importer import unconvertible

    model = zoo.build_model(arch).inner.eval()
    step = decoder.decode_step_class()(model)
    ep = exporter.export(step, decoder.example_step(model), {},
                         dynamic_shapes=decoder.step_dynamic_shapes(model.config.num_hidden_layers))
    assert unconvertible(ep, aten.load()) == {}
