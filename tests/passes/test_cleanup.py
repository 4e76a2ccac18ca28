"""Cleanup passes: dce, fold-constants, eliminate-identity (Before/Expected, numerics, no-ops)."""

from __future__ import annotations

import numpy as np
from aviatorc.passes.manager import PassContext, get_pass, run_passes

from aviatorc.ir import Graph, evaluate, parse_graph, print_graph


def run(name: str, graph: Graph):
    return run_passes(graph, [get_pass(name)], PassContext())[0]


def assert_same_text(expected: str, graph: Graph) -> None:
    assert print_graph(graph) == print_graph(parse_graph(expected))


# -- dce ---------------------------------------------------------------------------------------

DCE_BEFORE = """
graph "g" {
  input %x: float32[2, 4]
  input %unused: float32[2]
  weight %w: float32[4, 4]
  weight %w_dead: float32[4, 4]
  %a: float32[2, 4] = MatMul(%x, %w) @mm
  %dead: float32[2, 4] = MatMul(%x, %w_dead) @mm_dead
  %dead2: float32[2, 4] = Relu(%dead) @relu_dead
  %b: float32[2, 4] = Relu(%a) @relu
  output %b
}
"""

DCE_EXPECTED = """
graph "g" {
  input %x: float32[2, 4]
  input %unused: float32[2]
  weight %w: float32[4, 4]
  %a: float32[2, 4] = MatMul(%x, %w) @mm
  %b: float32[2, 4] = Relu(%a) @relu
  output %b
}
"""


def test_dce_removes_dead_chains_and_their_weights_but_keeps_inputs():
    graph = parse_graph(DCE_BEFORE)
    record = run("dce", graph)
    assert record.changed and record.stats == {"nodes_removed": 2, "initializers_removed": 1}
    assert_same_text(DCE_EXPECTED, graph)


def test_dce_keeps_a_split_with_one_used_output_and_is_a_no_op_on_clean_graphs():
    text = """
graph "g" {
  input %x: float32[4]
  const %sizes: int64[2] = [2, 2]
  %a: float32[2], %b: float32[2] = Split(%x, %sizes) @split
  output %a
}
"""
    graph = parse_graph(text)
    assert not run("dce", graph).changed
    assert_same_text(text, graph)


# -- fold-constants ------------------------------------------------------------------------------

FOLD_BEFORE = """
graph "g" {
  input %x: float32[2, 3]
  const %two: float32[] = 2.0
  const %three: float32[] = 3.0
  %six: float32[] = Mul(%two, %three) @mul
  %shape: int64[2] = Shape(%x) @shape
  %y: float32[2, 3] = Mul(%x, %six) @scale
  %z: float32[?, ?] = Reshape(%y, %shape) @reshape
  output %z
}
"""

FOLD_EXPECTED = """
graph "g" {
  input %x: float32[2, 3]
  const %six_c: float32[] = 6.0
  const %shape_c: int64[2] = [2, 3]
  %y: float32[2, 3] = Mul(%x, %six_c) @scale
  %z: float32[?, ?] = Reshape(%y, %shape_c) @reshape
  output %z
}
"""


def test_fold_constants_evaluates_constant_nodes_and_static_shapes():
    graph = parse_graph(FOLD_BEFORE)
    feed = {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}
    before = evaluate(graph, feed)["z"]
    record = run("fold-constants", graph)
    assert record.changed and record.stats["nodes_folded"] == 2
    assert_same_text(FOLD_EXPECTED, graph)
    np.testing.assert_array_equal(evaluate(graph, feed)["z"], before)


def test_fold_constants_leaves_weights_alone():
    text = """
graph "g" {
  input %x: float32[2, 4]
  weight %w: float32[4, 4]
  %wt: float32[4, 4] = Transpose(%w) {perm = [1, 0]} @t
  %y: float32[2, 4] = MatMul(%x, %wt) @mm
  output %y
}
"""
    graph = parse_graph(text)  # shape-only weight: nothing to evaluate, and nothing loaded
    assert not run("fold-constants", graph).changed
    assert_same_text(text, graph)


# -- eliminate-identity ------------------------------------------------------------------------

IDENTITY_BEFORE = """
graph "g" {
  input %x: float32[2]
  %a: float32[2] = Identity(%x) @id
  %b: float32[2] = Cast(%a) {to = "float32"} @same_cast
  %c: float16[2] = Cast(%b) {to = "float16"} @real_cast
  %d: float16[2] = Identity(%c) @out_id
  output %d
}
"""

IDENTITY_EXPECTED = """
graph "g" {
  input %x: float32[2]
  %c: float16[2] = Cast(%x) {to = "float16"} @real_cast
  %d: float16[2] = Identity(%c) @out_id
  output %d
}
"""


def test_eliminate_identity_keeps_graph_output_names():
    graph = parse_graph(IDENTITY_BEFORE)
    feed = {"x": np.array([1.5, -2.0], np.float32)}
    before = evaluate(graph, feed)["d"]
    record = run("eliminate-identity", graph)
    assert record.changed and record.stats["nodes_removed"] == 2
    assert_same_text(IDENTITY_EXPECTED, graph)
    np.testing.assert_array_equal(evaluate(graph, feed)["d"], before)
    assert not run("eliminate-identity", graph).changed  # the output Identity stays
