"""The pass manager: registry, did-you-mean, verification after each pass with the pass
history in the error, print-IR-after-change, and the default pipeline."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from aviatorc.passes.manager import (
    PASSES,
    Note,
    Pass,
    PassContext,
    PassResult,
    get_pass,
    list_passes,
    register_pass,
    run_passes,
)
from aviatorc.passes.pipeline import CLEANUP, FINAL_CLEANUP, build_pipeline, pipeline_names

from aviatorc.errors import InfeasibleError, OptionError, PassError
from aviatorc.ir import ArrayData, Graph, parse_graph
from aviatorc.options import CompileOptions

GRAPH = """
graph "g" {
  input %x: float32[2]
  %a: float32[2] = Identity(%x) @id
  %b: float32[2] = Relu(%a) @relu
  output %b
}
"""


@pytest.fixture
def temporary_passes() -> Iterator[list[str]]:
    """Passes registered by a test are removed afterwards: the registry is global."""
    names: list[str] = []
    yield names
    for name in names:
        PASSES.pop(name, None)


def register(temporary_passes: list[str], cls: type[Pass]) -> type[Pass]:
    temporary_passes.append(cls.name)
    return register_pass(cls)


# -- registry ------------------------------------------------------------------------------------


def test_registry_lists_the_shipped_passes_with_summaries():
    listed = dict(list_passes())
    for name in ("dce", "fold-constants", "eliminate-identity", "fuse-qkv"):
        assert name in listed and listed[name]
    assert get_pass("fuse-qkv").name == "fuse-qkv"


def test_unknown_pass_suggests_the_closest_name():
    with pytest.raises(OptionError) as info:
        get_pass("fuse-kqv")
    assert info.value.message == "unknown pass 'fuse-kqv'"
    assert info.value.hint == "did you mean 'fuse-qkv'?"


def test_a_name_registered_twice_is_refused(temporary_passes):
    class Twice(Pass):
        name = "dce"

    with pytest.raises(RuntimeError, match="unique name"):
        register_pass(Twice)


# -- verification and history --------------------------------------------------------------------


def test_a_pass_that_breaks_the_graph_is_caught_with_the_history(temporary_passes):
    class Breaks(Pass):
        name = "test-breaks-graph"
        summary = "retypes a value wrongly"

        def run(self, graph: Graph, ctx: PassContext) -> PassResult:
            from aviatorc.ir import TensorType

            graph.nodes[-1].outputs[0].type = TensorType("float32", (3,))
            return PassResult(changed=True)

    register(temporary_passes, Breaks)
    graph = parse_graph(GRAPH)
    passes = [get_pass("eliminate-identity"), get_pass("dce"), get_pass("test-breaks-graph")]
    with pytest.raises(PassError) as info:
        run_passes(graph, passes, PassContext())
    error = info.value
    assert error.pass_name == "test-breaks-graph"
    assert error.history == ["eliminate-identity", "dce"]
    assert error.node == "relu" and error.op == "Relu"
    assert "(passes before it: eliminate-identity, dce)" in str(error)


def test_a_user_error_inside_a_pass_becomes_a_pass_error(temporary_passes):
    class Refuses(Pass):
        name = "test-refuses"

        def requires(self, graph: Graph, ctx: PassContext) -> None:
            raise InfeasibleError("needs a target", hint="add --target")

    register(temporary_passes, Refuses)
    with pytest.raises(PassError) as info:
        run_passes(parse_graph(GRAPH), [get_pass("dce"), get_pass("test-refuses")], PassContext())
    assert info.value.history == ["dce"] and "needs a target" in str(info.value)


def test_records_say_what_each_pass_did():
    graph = parse_graph(GRAPH)
    records = run_passes(graph, [get_pass("eliminate-identity"), get_pass("fuse-qkv")], PassContext())
    assert [(r.name, r.changed, r.nodes_before, r.nodes_after) for r in records] == [
        ("eliminate-identity", True, 2, 1),
        ("fuse-qkv", False, 1, 1),
    ]
    assert records[0].to_dict()["stats"] == {"nodes_removed": 1}
    assert str(Note("mm", "why")) == "mm: why"


def test_print_ir_after_change_prints_only_after_a_change():
    lines: list[str] = []
    ctx = PassContext(options=CompileOptions(print_ir_after_change=True), log=lines.append)
    run_passes(parse_graph(GRAPH), [get_pass("eliminate-identity"), get_pass("dce")], ctx)
    dumps = [line for line in lines if line.startswith("// IR after")]
    assert len(dumps) == 1 and dumps[0].startswith('// IR after eliminate-identity\ngraph "g" {')
    assert "Identity" not in dumps[0]


# -- the pipeline --------------------------------------------------------------------------------


def test_default_pipeline_is_cleanup_fusion_cleanup():
    assert pipeline_names(CompileOptions()) == [*CLEANUP, "fuse-qkv", *FINAL_CLEANUP]
    assert pipeline_names(CompileOptions(fuse_qkv=False)) == [*CLEANUP, *FINAL_CLEANUP]
    assert [p.name for p in build_pipeline(CompileOptions())] == [*CLEANUP, "fuse-qkv", *FINAL_CLEANUP]


def test_sparsify_runs_before_quantize():
    options = CompileOptions(quant="int4", sparsity="2:4")
    expected = [*CLEANUP, "fuse-qkv", "sparsify-2to4", "quantize", *FINAL_CLEANUP]
    assert pipeline_names(options) == expected
    assert [p.name for p in build_pipeline(options)] == expected


QUANTIZABLE = """
graph "g" {
  input %x: float32[2, 64]
  weight %w: float32[64, 64]
  %y: float32[2, 64] = MatMul(%x, %w) @mm
  output %y
}
"""


def test_cleanup_after_quantize_keeps_small_weights_quantized():
    # A 64x64 weight is small enough for fold-constants to fold its DequantizeWeight back into
    # a float constant: the cleanup after the rewrites must not fold.
    graph = parse_graph(QUANTIZABLE)
    graph.initializers["w"].data = ArrayData(np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32))
    options = CompileOptions(quant="int8")
    run_passes(graph, build_pipeline(options), PassContext(options=options))
    assert graph.op_census().get("DequantizeWeight") == 1


def test_explicit_passes_override_the_options():
    options = CompileOptions(quant="int8", passes=("dce", "fuse-qkv"))
    assert [p.name for p in build_pipeline(options)] == ["dce", "fuse-qkv"]


def test_unknown_name_in_an_explicit_pipeline_suggests_a_fix():
    with pytest.raises(OptionError, match="did you mean 'fold-constants'"):
        build_pipeline(CompileOptions(passes=("dce", "fold-constant")))
