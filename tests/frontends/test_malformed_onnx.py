"""Well-formed protobufs that do not mean anything sensible (issue 13, classes 1, 2 and 6):
each is refused with one ModelFormatError naming the node and what is wrong, before any
type rule runs; none crashes and none is imported as a silently different model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import AttributeProto, TensorProto, helper, numpy_helper

from aviatorc.errors import AviatorError, ModelFormatError, UnsafePathError
from aviatorc.frontends.onnx import import_onnx
from aviatorc.frontends.onnx.importer import import_model_proto


def model(nodes, inputs, outputs, initializers=(), opset: int = 18) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def tensor(name: str, dims, dtype=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, dtype, dims)


def refused(proto: onnx.ModelProto, tmp_path: Path) -> ModelFormatError:
    path = tmp_path / "m.onnx"
    path.write_bytes(proto.SerializeToString())
    with pytest.raises(ModelFormatError) as info:
        import_onnx(path)
    assert "\n" not in str(info.value) and info.value.file == str(path)
    return info.value


def one_node(op: str, inputs, attrs: dict, x_dims=(2, 4), outputs=("y",), extra=(), opset: int = 18):
    node = helper.make_node(op, list(inputs), list(outputs), name="n", **attrs)
    return model([node], [tensor("x", list(x_dims))], [tensor(o, None) for o in outputs], extra, opset=opset)


# -- class 1: attributes of the wrong type -------------------------------------------------

INDICES = numpy_helper.from_array(np.array([0, 1], np.int64), "i")
GEMM_B = numpy_helper.from_array(np.ones((4, 3), np.float32), "b")


@pytest.mark.parametrize("op, inputs, attrs, extra, message", [
    ("Gather", ["x", "i"], {"axis": 0.5}, [INDICES], "attribute 'axis' is FLOAT, but Gather (opset 18) takes INT"),
    ("Cast", ["x"], {"to": [1, 10]}, [], "attribute 'to' is INTS, but Cast (opset 18) takes INT"),
    ("Transpose", ["x"], {"perm": 3}, [], "attribute 'perm' is INT, but Transpose (opset 18) takes INTS"),
    ("Gemm", ["x", "b"], {"alpha": [1.0, 2.0]}, [GEMM_B], "attribute 'alpha' is FLOATS, but Gemm (opset 18) takes FLOAT"),
    ("Split", ["x"], {"axis": [2], "num_outputs": 1}, [], "attribute 'axis' is INTS, but Split (opset 18) takes INT"),
    ("LayerNormalization", ["x", "b"], {"axis": 1.5}, [GEMM_B],
     "attribute 'axis' is FLOAT, but LayerNormalization (opset 18) takes INT"),
    # class 6: string values used to be kept in the IR
    ("Softmax", ["x"], {"axis": "minus one"}, [], "attribute 'axis' is STRING, but Softmax (opset 18) takes INT"),
    ("LayerNormalization", ["x", "b"], {"epsilon": "tiny"}, [GEMM_B],
     "attribute 'epsilon' is STRING, but LayerNormalization (opset 18) takes FLOAT"),
])
def test_attribute_of_the_wrong_type(tmp_path, op, inputs, attrs, extra, message) -> None:
    error = refused(one_node(op, inputs, attrs, extra=extra), tmp_path)
    assert message in str(error)
    assert error.node == "n" and error.op == op and error.fields["attribute"] == next(iter(attrs))


def test_attribute_of_type_undefined(tmp_path) -> None:
    proto = one_node("Softmax", ["x"], {})
    attr = proto.graph.node[0].attribute.add()
    attr.name, attr.type = "axis", AttributeProto.UNDEFINED
    assert "attribute 'axis' is UNDEFINED" in str(refused(proto, tmp_path))


def test_attribute_not_in_the_schema_and_given_twice(tmp_path) -> None:
    assert "attribute 'colour' is not defined for Relu" in str(refused(one_node("Relu", ["x"], {"colour": 1}), tmp_path))
    proto = one_node("Softmax", ["x"], {"axis": 1})
    proto.graph.node[0].attribute.append(helper.make_attribute("axis", 0))
    assert "attribute 'axis' is given twice" in str(refused(proto, tmp_path))


# -- class 6: accepted, but wrong -----------------------------------------------------------


def test_axis_far_outside_the_rank(tmp_path) -> None:
    error = refused(one_node("Softmax", ["x"], {"axis": 1 << 40}), tmp_path)
    assert f"axis {1 << 40} is out of range for an input of rank 2" in str(error)


def test_perm_that_is_not_a_permutation(tmp_path) -> None:
    error = refused(one_node("Transpose", ["x"], {"perm": [0, 0]}), tmp_path)
    assert "perm [0, 0] is not a permutation of the 2 axes" in str(error)


def test_gather_with_float_indices(tmp_path) -> None:
    floats = numpy_helper.from_array(np.array([0.0, 1.0], np.float32), "i")
    error = refused(one_node("Gather", ["x", "i"], {}, extra=[floats]), tmp_path)
    assert "input 1 ('indices') is float32, which Gather does not take there" in str(error)
    assert error.hint == "allowed: int32, int64"


@pytest.mark.parametrize("sizes, outputs, message", [
    ([2, 1, 1], ("a", "b"), "Split into 3 part(s) but the node has 2 output(s)"),
    ([1, 1], ("a", "b"), "split sizes [1, 1] do not fit 2 output(s) of an axis of size 4"),
    ([5, -1], ("a", "b"), "split sizes [5, -1] do not fit 2 output(s)"),
])
def test_split_sizes_that_disagree_with_the_outputs(tmp_path, sizes, outputs, message) -> None:
    split = numpy_helper.from_array(np.array(sizes, np.int64), "s")
    proto = one_node("Split", ["x", "s"], {"axis": 1}, outputs=outputs, extra=[split])
    assert message in str(refused(proto, tmp_path))


@pytest.mark.parametrize("num_outputs, outputs", [(4, ("a", "b")), (1, ("a", "b")),
                                                  (3, ("a", "b", "c", "d"))])  # the last aborted onnx inference
def test_split_num_outputs_that_disagrees_with_the_outputs(tmp_path, num_outputs, outputs) -> None:
    proto = one_node("Split", ["x"], {"axis": 1, "num_outputs": num_outputs}, x_dims=(2, 12), outputs=outputs)
    message = f"Split into {num_outputs} part(s) but the node has {len(outputs)} output(s)"
    assert message in str(refused(proto, tmp_path))


def test_constant_with_two_values(tmp_path) -> None:
    node = helper.make_node("Constant", [], ["c"], name="n", value_int=1, value_float=2.0)
    proto = model([node, helper.make_node("Add", ["x", "c"], ["y"])], [tensor("x", [2])], [tensor("y", None)])
    assert "Constant needs exactly one value attribute, got 2" in str(refused(proto, tmp_path))


def test_initializer_redeclared_as_an_input_of_another_shape(tmp_path) -> None:
    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    proto = model([helper.make_node("MatMul", ["x", "w"], ["y"])], [tensor("x", [2, 4]), tensor("w", [4, 8])],
                  [tensor("y", None)], [w])
    error = refused(proto, tmp_path)
    assert "initializer 'w' is float32[4, 4] but is also declared as a graph input of type float32[4, 8]" in str(error)


def test_initializer_redeclared_with_its_own_type_is_a_weight(tmp_path) -> None:
    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    proto = model([helper.make_node("MatMul", ["x", "w"], ["y"])], [tensor("x", [2, 4]), tensor("w", [4, 4])],
                  [tensor("y", None)], [w])
    graph = import_model_proto(proto, base_dir=tmp_path)
    assert [v.name for v in graph.inputs] == ["x"] and "w" in graph.initializers


def test_graph_input_listed_twice(tmp_path) -> None:
    proto = model([helper.make_node("Relu", ["x"], ["y"])], [tensor("x", [2]), tensor("x", [3])], [tensor("y", None)])
    assert "graph input 'x' is listed twice" in str(refused(proto, tmp_path))


@pytest.mark.parametrize("opset, message", [
    (1, "LayerNormalization is not defined in ai.onnx opset 1"),
    (7, "LayerNormalization is not defined in ai.onnx opset 7"),
    (999, "opset 999 is not an ONNX opset"),
])
def test_opsets_the_schemas_do_not_know_for_these_ops(tmp_path, opset, message) -> None:
    proto = one_node("LayerNormalization", ["x", "b"], {"axis": -1}, extra=[GEMM_B], opset=opset)
    error = refused(proto, tmp_path)
    assert message in str(error)
    if opset < 17:
        assert error.hint == "LayerNormalization was added in opset 17; the model declares " + str(opset)


def test_opset_7_reshape_takes_its_shape_as_an_attribute(tmp_path) -> None:
    shape = numpy_helper.from_array(np.array([8], np.int64), "s")
    proto = one_node("Reshape", ["x", "s"], {}, extra=[shape], opset=4)
    assert "has 2 input(s); Reshape takes 1" in str(refused(proto, tmp_path))


# -- class 2: external data locations ---------------------------------------------------------


def _external(location: str) -> TensorProto:
    weight = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[4, 4], data_location=TensorProto.EXTERNAL)
    for key, value in {"location": location, "offset": "0", "length": "64"}.items():
        entry = weight.external_data.add()
        entry.key, entry.value = key, value
    return weight


def _external_model(location: str) -> onnx.ModelProto:
    return model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [tensor("x", [2, 4])],
                 [tensor("y", None)], [_external(location)])


def test_external_data_name_too_long_for_the_file_system(tmp_path) -> None:
    path = tmp_path / "m.onnx"
    path.write_bytes(_external_model("d/" + "a" * 300).SerializeToString())
    with pytest.raises(UnsafePathError, match="has a path component longer than 255 bytes"):
        import_onnx(path)


def test_external_data_location_with_control_characters_is_escaped(tmp_path) -> None:
    path = tmp_path / "m.onnx"
    path.write_bytes(_external_model("w\x00\x1b[31m.bin").SerializeToString())
    with pytest.raises(UnsafePathError) as info:
        import_onnx(path)
    text = str(info.value)
    assert "\x00" not in text and "\x1b" not in text and "w\\x00\\x1b[31m.bin" in text


# -- a property: any attribute on any node gives an import or one AviatorError ----------------

ATTR_VALUES = st.one_of(
    st.integers(-(1 << 62), 1 << 62), st.floats(allow_nan=True), st.text(max_size=8),
    st.lists(st.integers(-8, 8), max_size=4), st.lists(st.floats(-2, 2), min_size=1, max_size=3),
)
NODES = [("Softmax", ["x"]), ("Gather", ["x", "i"]), ("Transpose", ["x"]), ("Split", ["x"]), ("Cast", ["x"]),
         ("Concat", ["x", "x"]), ("Flatten", ["x"]), ("LayerNormalization", ["x", "b4"]), ("ReduceSum", ["x"])]


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(node=st.sampled_from(NODES), name=st.sampled_from(["axis", "perm", "to", "epsilon", "num_outputs", "keepdims",
                                                          "split"]), value=ATTR_VALUES)
def test_any_attribute_value_imports_or_is_refused(tmp_path, node, name, value) -> None:
    op, inputs = node
    b4 = numpy_helper.from_array(np.ones(4, np.float32), "b4")
    try:
        proto = one_node(op, inputs, {name: value}, extra=[INDICES, b4])
    except (ValueError, TypeError):
        return  # onnx.helper cannot encode this value (a list of mixed types)
    try:
        import_model_proto(proto, base_dir=tmp_path)
    except AviatorError as error:
        assert "\n" not in str(error)


# -- onnx shape inference runs where its crashes cannot take the import down -----------------


def test_a_crash_or_hang_in_the_sandbox_costs_only_the_hints() -> None:
    import os
    import time

    from aviatorc.frontends.onnx.sandbox import run_in_child

    assert run_in_child(lambda: b"hints") == b"hints"
    assert run_in_child(lambda: b"x" * (3 << 20)) == b"x" * (3 << 20)  # more than a pipe buffer
    assert run_in_child(os.abort) is None  # onnx's C++ assertions abort the process
    assert run_in_child(lambda: time.sleep(30) or b"", timeout_s=0.5) is None


def test_a_name_that_is_not_utf8_is_refused(tmp_path) -> None:
    """protobuf returns bytes for a string field holding invalid UTF-8 (found by tools/fuzz.py)."""
    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "wias")
    proto = model([helper.make_node("MatMul", ["x", "wias"], ["y"])], [tensor("x", [2, 4])], [tensor("y", None)], [w])
    path = tmp_path / "m.onnx"
    path.write_bytes(proto.SerializeToString().replace(b"wias", b"\xe2ias"))
    with pytest.raises(ModelFormatError, match=r"initializer name b'\\xe2ias' is not valid UTF-8"):
        import_onnx(path)
