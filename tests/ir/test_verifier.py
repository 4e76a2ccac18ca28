"""The verifier catches each broken invariant and prints the IR around the bad node."""

import numpy as np
import pytest

from aviatorc.errors import ModelFormatError, VerificationError
from aviatorc.ir import Graph, TensorType, add_value, verify
from aviatorc.ir.graph import Node, Value


def chain() -> Graph:
    g = Graph()
    x = g.add_input("x", TensorType("float32", (4, 8)))
    w = g.add_constant(np.ones((8, 3), np.float32), "w")
    h = add_value(g, "MatMul", [x, w], name="mm")
    h = add_value(g, "Relu", [h], name="relu")
    g.outputs = [add_value(g, "Neg", [h], name="neg")]
    return g


def test_sound_graph_verifies():
    verify(chain())


def test_wrong_output_type_names_node_and_shows_context():
    g = chain()
    g.nodes[1].outputs[0].type = TensorType("float32", (4, 5))
    with pytest.raises(VerificationError) as info:
        verify(g)
    error = info.value
    assert error.node == "relu" and error.op == "Relu"
    assert "typed float32[4, 5] but the op gives float32[4, 3]" in error.message
    assert ">> %relu_out: float32[4, 5] = Relu(%mm_out) @relu" in error.context
    assert "@mm" in error.context and "@neg" in error.context


def test_unknown_op_and_arity():
    g = chain()
    g.nodes[2].op = "Frobnicate"
    with pytest.raises(VerificationError, match="'Frobnicate' is not in the IR's op set"):
        verify(g)
    g = chain()
    extra = g.inputs[0]
    g.nodes[1]._inputs.append(extra)
    extra.users.append(g.nodes[1])
    with pytest.raises(VerificationError, match="has 2 inputs, expected 1..1"):
        verify(g)


def test_use_before_definition():
    g = chain()
    g.nodes[0], g.nodes[1] = g.nodes[1], g.nodes[0]
    with pytest.raises(VerificationError, match="used before it is defined"):
        verify(g)


def test_stale_use_list():
    g = chain()
    g.inputs[0].users.clear()
    with pytest.raises(VerificationError, match="use list of 'x'"):
        verify(g)


def test_mismatched_dtype_is_a_type_error():
    g = Graph()
    a = g.add_input("a", TensorType("float32", (2,)))
    b = g.add_input("b", TensorType("int64", (2,)))
    with pytest.raises(ModelFormatError, match="mismatched element types"):
        add_value(g, "Add", [a, b], name="add")


def test_undefined_value_from_another_graph():
    g = chain()
    stranger = Value("stranger", TensorType("float32", (4, 3)))
    node = Node("Neg", [stranger], [Value("late", TensorType("float32", (4, 3)))], name="late")
    g.nodes.append(node)
    with pytest.raises(VerificationError, match="'stranger' is used before it is defined"):
        verify(g)


def test_huge_dimension_is_refused_before_allocation():
    with pytest.raises(ModelFormatError, match="out of range"):
        TensorType("float32", (2**40,))
    with pytest.raises(ModelFormatError, match="exceeds the limit"):
        TensorType("float32", (2**21, 2**21))
