"""fuse-qkv is exact on the model zoo, imported from ONNX (dynamo exporter at opset 18, legacy
at 17) and through torch.export: outputs before and after agree within 1e-5, and the number of fused
groups per model is what the architecture says (one per layer where q, k and v are
separate; none where the model already fuses them: GPT-2's c_attn, Phi-3's qkv_proj).

The anonymized variant strips every parameter and node name, so the groups must be found
by the attention structure alone, as for an ONNX file whose exporter dropped the names.
"""

from __future__ import annotations

import numpy as np
import pytest
import transformers  # noqa: F401
from aviatorc.passes.manager import PassContext, get_pass, run_passes  # noqa: E402
from aviatorc.passes.pipeline import build_pipeline  # noqa: E402

import aviatorc  # noqa: E402
from aviatorc import zoo  # noqa: E402
from aviatorc.ir import Graph, evaluate  # noqa: E402
from aviatorc.options import CompileOptions  # noqa: E402
from tests.zoo_fixtures import zoo_dir, zoo_onnx  # noqa: E402, F401

pytestmark = pytest.mark.slow

TOLERANCE = 1e-5
# Zoo models have 2 layers: one group per layer, or none where the exporter already fused q/k/v.
EXPECTED_GROUPS = {"gpt2": 0, "llama": 2, "mistral": 2, "qwen2": 2, "phi3": 0, "opt": 2, "bert": 2}


def feeds_for(graph: Graph, arch: str) -> dict[str, np.ndarray]:
    names = {v.name for v in graph.inputs}
    return {k: v.numpy() for k, v in zoo.example_inputs(arch).items() if k in names}


def fuse_and_compare(graph: Graph, arch: str, how: str) -> None:
    feeds = feeds_for(graph, arch)
    before = evaluate(graph, feeds)
    record = run_passes(graph, [get_pass("fuse-qkv")], PassContext())[0]
    after = evaluate(graph, feeds)
    diff = max(float(np.max(np.abs(after[k] - before[k]))) for k in before)
    print(
        f"{arch} ({how}): {record.stats['groups_fused']} fused group(s), max abs diff {diff:.3g}; "
        f"notes: {list(record.notes)}"
    )
    assert record.stats["groups_fused"] == EXPECTED_GROUPS[arch]
    assert record.stats["groups_found"] == EXPECTED_GROUPS[arch]  # nothing found and refused
    assert diff <= TOLERANCE
    assert graph.op_census().get("Split", 0) >= EXPECTED_GROUPS[arch]


def anonymized(graph: Graph) -> Graph:
    """A copy with every weight, node and internal value renamed: only structure is left."""
    copy = Graph(graph.name)
    mapping = {id(v): copy.add_input(v.name, v.type) for v in graph.inputs}
    for i, value in enumerate(graph.initializers.values()):
        assert value.data is not None
        mapping[id(value)] = copy.add_initializer(f"val_{i}", value.type, value.data)
    keep = {id(v) for v in graph.outputs}
    for i, node in enumerate(graph.nodes):
        names = [v.name if id(v) in keep else f"t{i}_{j}" for j, v in enumerate(node.outputs)]
        new = copy.add_node(
            node.op,
            [mapping[id(v)] if v is not None else None for v in node.inputs],
            [v.type for v in node.outputs],
            node.attrs,
            name=f"n{i}",
            output_names=names,
        )
        mapping.update({id(old): out for old, out in zip(node.outputs, new.outputs, strict=True)})
    copy.outputs = [mapping[id(v)] for v in graph.outputs]
    return copy


@pytest.mark.parametrize("exporter, opset", [("dynamo", 18), ("legacy", 17)])
@pytest.mark.parametrize("arch", zoo.ZOO_ARCHS)
def test_fuse_qkv_exact_on_onnx_import(arch, exporter, opset, zoo_onnx):  # noqa: F811
    graph = aviatorc.import_model(zoo_onnx(arch, exporter, opset))
    fuse_and_compare(graph, arch, f"onnx {exporter} opset {opset}")


@pytest.mark.parametrize("arch", zoo.ZOO_ARCHS)
def test_fuse_qkv_exact_on_torch_export(arch):
    graph = aviatorc.import_model(zoo.build_model(arch), zoo.example_inputs(arch))
    fuse_and_compare(graph, arch, "torch.export")


@pytest.mark.parametrize("arch", zoo.ZOO_ARCHS)
def test_fuse_qkv_finds_groups_by_structure_alone(arch):
    graph = anonymized(aviatorc.import_model(zoo.build_model(arch), zoo.example_inputs(arch)))
    fuse_and_compare(graph, arch, "torch.export, names stripped")
    assert all(name.startswith(("attn.", "val_", "const")) for name in graph.initializers)


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_default_pipeline_is_exact(arch):
    graph = aviatorc.import_model(zoo.build_model(arch), zoo.example_inputs(arch))
    feeds = feeds_for(graph, arch)
    before = evaluate(graph, feeds)
    run_passes(graph, build_pipeline(CompileOptions()), PassContext())
    after = evaluate(graph, feeds)
    for name in before:
        np.testing.assert_allclose(after[name], before[name], atol=TOLERANCE, rtol=0)
