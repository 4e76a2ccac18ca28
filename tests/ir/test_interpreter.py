"""The reference interpreter: feeds are checked, shape-only weights refuse to run, kernels
follow ONNX semantics where numpy's differ."""

import numpy as np
import pytest

from aviatorc.errors import EvaluationError
from aviatorc.ir import Graph, ShapeOnly, TensorType, add_value, evaluate


def linear(shape_only: bool = False) -> Graph:
    g = Graph()
    x = g.add_input("x", TensorType("float32", ("batch", 4)))
    if shape_only:
        w = g.add_initializer("w", TensorType("float32", (4, 2)), ShapeOnly())
    else:
        w = g.add_constant(np.arange(8, dtype=np.float32).reshape(4, 2), "w")
    g.outputs = [add_value(g, "MatMul", [x, w], name="mm")]
    return g


def test_matmul_matches_numpy():
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    out = evaluate(linear(), {"x": x})["mm_out"]
    np.testing.assert_allclose(out, x @ np.arange(8, dtype=np.float32).reshape(4, 2), rtol=1e-6)


def test_shape_only_weight_refuses_to_run():
    with pytest.raises(EvaluationError, match="weight 'w' has no data"):
        evaluate(linear(shape_only=True), {"x": np.zeros((1, 4), np.float32)})


@pytest.mark.parametrize(
    "feeds, message",
    [
        ({}, "missing input"),
        ({"x": np.zeros((1, 4), np.float64)}, "is float64, expected float32"),
        ({"x": np.zeros((1, 5), np.float32)}, r"has shape \[1, 5\], expected \[batch, 4\]"),
        ({"x": np.zeros((1, 4), np.float32), "y": 1}, "unknown input"),
    ],
)
def test_feeds_are_checked(feeds, message):
    with pytest.raises(EvaluationError, match=message):
        evaluate(linear(), feeds)


def test_symbolic_dims_bind_consistently():
    g = Graph()
    a = g.add_input("a", TensorType("float32", ("n",)))
    b = g.add_input("b", TensorType("float32", ("n",)))
    g.outputs = [add_value(g, "Add", [a, b])]
    with pytest.raises(EvaluationError, match="dim 'n' is 3 here but 2 elsewhere"):
        evaluate(g, {"a": np.zeros(2, np.float32), "b": np.zeros(3, np.float32)})


def test_integer_division_truncates_like_onnx():
    g = Graph()
    a = g.add_input("a", TensorType("int64", (4,)))
    b = g.add_constant(np.array([2, 2, 2, 2], np.int64), "b")
    g.outputs = [add_value(g, "Div", [a, b])]
    out = evaluate(g, {"a": np.array([-3, -1, 1, 3], np.int64)})
    np.testing.assert_array_equal(
        next(iter(out.values())), [-1, 0, 0, 1]
    )  # numpy's // gives [-2, -1, 0, 1]


def test_kernel_failure_names_the_node():
    g = Graph()
    ids = g.add_input("ids", TensorType("int64", (2,)))
    table = g.add_constant(np.zeros((3, 2), np.float32), "table")
    g.outputs = [add_value(g, "Gather", [table, ids], name="embed")]
    with pytest.raises(EvaluationError) as info:
        evaluate(g, {"ids": np.array([0, 7], np.int64)})
    assert info.value.node == "embed" and info.value.op == "Gather"
    assert "index out of range" in str(info.value)


def test_keep_returns_intermediates():
    g = Graph()
    x = g.add_input("x", TensorType("float32", (2,)))
    h = add_value(g, "Neg", [x], name="neg")
    g.outputs = [add_value(g, "Exp", [h], name="exp")]
    out = evaluate(g, {"x": np.array([0.0, 1.0], np.float32)}, keep=(h.name,))
    np.testing.assert_allclose(out[h.name], [0.0, -1.0])


def test_only_kept_returns_the_kept_values_and_runs_nothing_after_them():
    g = Graph()
    x = g.add_input("x", TensorType("float32", ("batch", 4)))
    w = g.add_constant(np.arange(8, dtype=np.float32).reshape(4, 2), "w")
    h = add_value(g, "MatMul", [x, w], name="mm")
    bad = g.add_constant(np.array([7], np.int64), "bad")
    g.outputs = [add_value(g, "Gather", [h, bad], {"axis": 1}, name="after")]  # column 7 of 2: fails if it runs
    feed = {"x": np.ones((2, 4), np.float32)}
    kept = evaluate(g, feed, keep=("mm_out", "x"), only_kept=True)
    assert sorted(kept) == ["mm_out", "x"]
    np.testing.assert_array_equal(kept["mm_out"], feed["x"] @ np.arange(8, dtype=np.float32).reshape(4, 2))
    with pytest.raises(EvaluationError):  # the whole graph does run the failing node
        evaluate(g, feed, keep=("mm_out",))
