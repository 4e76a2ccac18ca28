"""The IR's text form round-trips, use lists stay consistent, and sort rejects cycles."""

import numpy as np
import pytest

from aviatorc.errors import ModelFormatError
from aviatorc.ir import Graph, ShapeOnly, TensorType, add_op, add_value, evaluate, parse_graph, print_graph, verify


def small_graph() -> Graph:
    g = Graph("block")
    x = g.add_input("x", TensorType("float32", ("batch", "seq", 8)))
    w = g.add_initializer("layers.0.q_proj.weight", TensorType("float32", (8, 8)), ShapeOnly())
    b = g.add_constant(np.arange(8, dtype=np.float32), "bias")
    shape = g.add_constant(np.array([0, 0, 2, 4], np.int64), "shape")
    y = add_value(g, "MatMul", [x, w], name="q/MatMul")
    y = add_value(g, "Add", [y, b], name="q/Add")
    y = add_value(g, "Reshape", [y, shape], name="q/Reshape")
    parts = add_op(g, "Split", [y], {"axis": 2, "num_outputs": 2}, num_outputs=2, name="split")
    z = add_value(g, "Softmax", [parts.outputs[1]], {"axis": -1}, name="odd name!")
    g.outputs = [parts.outputs[0], z]
    g.metadata["source"] = "test"
    return g


def test_text_round_trip_is_identical():
    g = small_graph()
    verify(g)
    text = print_graph(g)
    again = parse_graph(text)
    verify(again)
    assert print_graph(again) == text
    assert '@"odd name!"' in text
    assert "weight %layers.0.q_proj.weight: float32[8, 8]" in text
    assert "const %shape: int64[4] = [0, 0, 2, 4]" in text


def test_types_are_inferred_with_symbolic_dims():
    g = small_graph()
    assert str(g.outputs[1].type) == "float32[batch, seq, 1, 4]"


def test_use_lists_follow_set_input_and_replace():
    g = Graph()
    x = g.add_input("x", TensorType("float32", (2,)))
    a = add_value(g, "Neg", [x])
    b = add_value(g, "Add", [a, a])
    g.outputs = [b]
    assert x.users == [a.producer]
    assert a.users == [b.producer, b.producer]
    c = add_value(g, "Abs", [x])
    g.replace_all_uses(a, c)
    assert a.users == [] and len(c.users) == 2
    g.remove_node(a.producer)
    g.sort()
    verify(g)
    out = evaluate(g, {"x": np.array([-1.0, 2.0], np.float32)})
    np.testing.assert_array_equal(out[b.name], [2.0, 4.0])


def test_sort_rejects_a_cycle():
    g = Graph()
    x = g.add_input("x", TensorType("float32", (2,)))
    a = add_value(g, "Neg", [x], name="a")
    b = add_value(g, "Neg", [a], name="b")
    a.producer.set_input(0, b)  # a <- b <- a
    with pytest.raises(ModelFormatError, match="cycle"):
        g.sort()


def test_parse_reports_line_of_undefined_value():
    text = 'graph "g" {\n  input %x: float32[2]\n  %y: float32[2] = Neg(%nope) @n\n}\n'
    with pytest.raises(ModelFormatError, match=r"line 3: value '%nope' is used before it is defined"):
        parse_graph(text)


def test_round_trip_of_awkward_names_and_values():
    g = Graph("t")
    x = g.add_input("information", TensorType("float32", ("info", 4)))
    g.add_constant(np.array([1.0, -np.inf, np.nan], np.float32), "a=b")
    g.add_constant(np.array([1, 2], np.int64), "nan_guard")
    g.outputs = [add_value(g, "Neg", [x], name="inference_out")]
    text = print_graph(g)
    assert print_graph(parse_graph(text)) == text
    again = parse_graph(text)
    np.testing.assert_array_equal(again.initializers["a=b"].const_value(), [1.0, -np.inf, np.nan])


def test_parse_reports_bad_const_values():
    text = 'graph "g" {\n  const %c: int64[2] = [1, \n}\n'
    with pytest.raises(ModelFormatError, match="line 2: const values are not valid JSON"):
        parse_graph(text)
