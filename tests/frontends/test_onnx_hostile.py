"""Hostile and malformed ONNX files: each fails with one readable AviatorError whose fields
name the file, the node, the op or the value, before anything large is allocated."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from aviatorc.errors import AviatorError, ModelFormatError, UnsafePathError, UnsupportedOpsError
from aviatorc.frontends.onnx import import_onnx

W_SHAPE = (4, 4)
W_BYTES = 4 * 4 * 4


def _model(nodes, inputs, outputs, initializers=(), opset: int = 18) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _matmul_model(weight: TensorProto) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    return _model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [x], [y], [weight])


def _external_weight(location: str, offset: int = 0, length: int | None = W_BYTES) -> TensorProto:
    tensor = TensorProto()
    tensor.name = "w"
    tensor.data_type = TensorProto.FLOAT
    tensor.dims.extend(W_SHAPE)
    tensor.data_location = TensorProto.EXTERNAL
    entries = {"location": location, "offset": str(offset)}
    if length is not None:
        entries["length"] = str(length)
    for key, value in entries.items():
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor


def _save(model: onnx.ModelProto, path: Path) -> Path:
    path.write_bytes(model.SerializeToString())
    return path


def _weights_file(path: Path, nbytes: int = W_BYTES) -> Path:
    path.write_bytes(np.arange(nbytes // 4, dtype=np.float32).tobytes())
    return path


# -- external data that escapes the model's folder -----------------------------------------


def test_external_data_parent_dir(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    _weights_file(tmp_path / "secret.bin")
    path = _save(_matmul_model(_external_weight("../secret.bin")), tmp_path / "model" / "m.onnx")
    with pytest.raises(UnsafePathError) as info:
        import_onnx(path)
    error = info.value
    assert error.file == str(path)
    assert error.fields["location"] == "../secret.bin" and error.fields["tensor"] == "w"
    assert "escapes the model's folder ('..')" in str(error)
    assert "\n" not in str(error)


def test_external_data_absolute_path(tmp_path: Path) -> None:
    secret = _weights_file(tmp_path / "secret.bin")
    (tmp_path / "model").mkdir()
    path = _save(_matmul_model(_external_weight(str(secret))), tmp_path / "model" / "m.onnx")
    with pytest.raises(UnsafePathError, match="is an absolute path") as info:
        import_onnx(path)
    assert info.value.file == str(path)


def test_external_data_symlink(tmp_path: Path) -> None:
    secret = _weights_file(tmp_path / "secret.bin")
    (tmp_path / "model").mkdir()
    os.symlink(secret, tmp_path / "model" / "w.bin")
    path = _save(_matmul_model(_external_weight("w.bin")), tmp_path / "model" / "m.onnx")
    with pytest.raises(UnsafePathError, match="goes through a symbolic link"):
        import_onnx(path)


def test_external_data_symlinked_folder(tmp_path: Path) -> None:
    (tmp_path / "outside").mkdir()
    _weights_file(tmp_path / "outside" / "w.bin")
    (tmp_path / "model").mkdir()
    os.symlink(tmp_path / "outside", tmp_path / "model" / "data")
    path = _save(_matmul_model(_external_weight("data/w.bin")), tmp_path / "model" / "m.onnx")
    with pytest.raises(UnsafePathError, match="symbolic link"):
        import_onnx(path)


def test_external_data_hard_link(tmp_path: Path) -> None:
    secret = _weights_file(tmp_path / "secret.bin")
    (tmp_path / "model").mkdir()
    os.link(secret, tmp_path / "model" / "w.bin")
    path = _save(_matmul_model(_external_weight("w.bin")), tmp_path / "model" / "m.onnx")
    with pytest.raises(UnsafePathError, match="2 hard links"):
        import_onnx(path)


def test_external_data_past_end_of_file(tmp_path: Path) -> None:
    _weights_file(tmp_path / "w.bin", nbytes=W_BYTES)
    path = _save(_matmul_model(_external_weight("w.bin", offset=32)), tmp_path / "m.onnx")
    with pytest.raises(ModelFormatError, match=r"\[32, 96\) lies past the end of 'w.bin' \(64 bytes\)") as info:
        import_onnx(path)
    assert info.value.file == str(path) and info.value.fields["tensor"] == "w"


def test_external_data_length_disagrees_with_type(tmp_path: Path) -> None:
    _weights_file(tmp_path / "w.bin", nbytes=1 << 12)
    path = _save(_matmul_model(_external_weight("w.bin", length=1 << 12)), tmp_path / "m.onnx")
    with pytest.raises(ModelFormatError, match=r"is float32\[4, 4\] \(64 bytes\) but its external data length is 4096"):
        import_onnx(path)


def test_external_data_missing_file(tmp_path: Path) -> None:
    path = _save(_matmul_model(_external_weight("nowhere.bin")), tmp_path / "m.onnx")
    with pytest.raises(ModelFormatError, match="'nowhere.bin' of 'w' does not exist"):
        import_onnx(path)


def test_external_data_is_lazy_and_valid(tmp_path: Path) -> None:
    """The good case: a large external weight stays a FileRegion and evaluates correctly."""
    from aviatorc.ir import FileRegion, evaluate

    n = 64
    weight = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    (tmp_path / "w.bin").write_bytes(b"\0" * 16 + weight.tobytes())
    tensor = _external_weight("w.bin", offset=16, length=weight.nbytes)
    del tensor.dims[:]
    tensor.dims.extend([n, n])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, n])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, n])
    model = _model([helper.make_node("MatMul", ["x", "w"], ["y"])], [x], [y], [tensor])
    graph = import_onnx(_save(model, tmp_path / "m.onnx"))
    assert isinstance(graph.initializers["w"].data, FileRegion)
    feed = np.ones((2, n), np.float32)
    np.testing.assert_allclose(evaluate(graph, {"x": feed})["y"], feed @ weight, rtol=1e-5)


# -- malformed files -----------------------------------------------------------------------


def _valid_model_bytes() -> bytes:
    weight = numpy_helper.from_array(np.ones((64, 64), np.float32), "w")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64])
    return _model([helper.make_node("MatMul", ["x", "w"], ["y"])], [x], [y], [weight]).SerializeToString()


def test_truncated_file(tmp_path: Path) -> None:
    data = _valid_model_bytes()
    path = tmp_path / "m.onnx"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFormatError) as info:
        import_onnx(path)
    assert info.value.file == str(path)
    assert "truncated" in str(info.value) or "not a valid ONNX protobuf" in str(info.value)


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    path.write_bytes(b"")
    with pytest.raises(ModelFormatError, match=r"the model file is empty \(0 bytes\)") as info:
        import_onnx(path)
    assert info.value.file == str(path)


def test_cycle(tmp_path: Path) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("b", TensorProto.FLOAT, [2])
    nodes = [
        helper.make_node("Add", ["x", "b"], ["a"], name="first"),
        helper.make_node("Relu", ["a"], ["b"], name="second"),
    ]
    path = _save(_model(nodes, [x], [y]), tmp_path / "m.onnx")
    with pytest.raises(ModelFormatError, match="the graph has a cycle through 2 node") as info:
        import_onnx(path)
    assert (info.value.node, info.value.op) == ("first", "Add")


def test_undefined_input(tmp_path: Path) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    path = _save(
        _model([helper.make_node("MatMul", ["x", "missing_w"], ["y"], name="proj")], [x], [y]), tmp_path / "m.onnx"
    )
    with pytest.raises(ModelFormatError, match="input 'missing_w' is not defined") as info:
        import_onnx(path)
    error = info.value
    assert (error.file, error.node, error.op) == (str(path), "proj", "MatMul")
    assert str(error).startswith(f"{path}: node 'proj' (MatMul): input 'missing_w'")


def test_mismatched_dtype(tmp_path: Path) -> None:
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, [3])
    b = helper.make_tensor_value_info("b", TensorProto.INT64, [3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])
    path = _save(_model([helper.make_node("Add", ["a", "b"], ["y"], name="add0")], [a, b], [y]), tmp_path / "m.onnx")
    with pytest.raises(ModelFormatError, match=r"mismatched element types \['float32', 'int64'\]") as info:
        import_onnx(path)
    assert (info.value.file, info.value.node, info.value.op) == (str(path), "add0", "Add")


def test_huge_dimension_input(tmp_path: Path) -> None:
    x = helper.make_tensor_value_info("tokens", TensorProto.FLOAT, [2**40, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2**40, 4])
    path = _save(_model([helper.make_node("Relu", ["tokens"], ["y"])], [x], [y]), tmp_path / "m.onnx")
    with pytest.raises(ModelFormatError, match=r"value 'tokens': dimension 1099511627776 is out of range") as info:
        import_onnx(path)
    assert info.value.file == str(path)


def test_huge_dimension_initializer_is_refused_before_allocation(tmp_path: Path) -> None:
    weight = TensorProto()
    weight.name, weight.data_type = "w", TensorProto.FLOAT
    weight.dims.extend([2**40, 4])
    weight.raw_data = b"\0" * 16
    path = _save(_matmul_model(weight), tmp_path / "m.onnx")
    with pytest.raises(ModelFormatError, match=r"initializer 'w': dimension 1099511627776 is out of range"):
        import_onnx(path)


def test_inline_data_size_mismatch(tmp_path: Path) -> None:
    weight = TensorProto()
    weight.name, weight.data_type = "w", TensorProto.FLOAT
    weight.dims.extend(W_SHAPE)
    weight.raw_data = b"\0" * 12
    path = _save(_matmul_model(weight), tmp_path / "m.onnx")
    with pytest.raises(ModelFormatError, match=r"initializer 'w' is float32\[4, 4\] \(64 bytes\) but holds 12 bytes"):
        import_onnx(path)


def test_unsupported_ops_are_collected(tmp_path: Path) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="ok"),
        helper.make_node("MaxPool", ["a"], ["b"], kernel_shape=[2, 2], name="pool1"),
        helper.make_node("LRN", ["b"], ["c"], size=3, name="lrn"),
        helper.make_node("MaxPool", ["c"], ["d"], kernel_shape=[1, 1], name="pool2"),
        helper.make_node("FusedThing", ["d"], ["y"], domain="com.example", name=""),
    ]
    model = _model(nodes, [x], [y])
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    path = _save(model, tmp_path / "m.onnx")
    with pytest.raises(UnsupportedOpsError) as info:
        import_onnx(path)
    error = info.value
    assert error.ops == {"LRN": (1, "lrn"), "MaxPool": (2, "pool1"), "com.example::FusedThing": (1, "FusedThing_4")}
    assert error.file == str(path)
    assert "4 node(s) use 3 unsupported op type(s): LRN x1 (first: 'lrn'), MaxPool x2 (first: 'pool1')" in str(error)


def test_run_time_reduce_axes_stay_an_input(tmp_path: Path) -> None:
    # Axes computed at run time are not an error: they stay an input of the IR's Reduce op.
    import numpy as np

    from aviatorc.ir import evaluate

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    axes = helper.make_tensor_value_info("axes", TensorProto.INT64, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    node = helper.make_node("ReduceSum", ["x", "axes"], ["y"], name="rs")
    path = _save(_model([node], [x, axes], [y]), tmp_path / "m.onnx")
    graph = import_onnx(path)
    data = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = evaluate(graph, {"x": data, "axes": np.array([1], np.int64)})
    np.testing.assert_array_equal(out["y"], data.sum(axis=1, keepdims=True))


def test_every_error_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    path.write_bytes(b"")
    with pytest.raises(AviatorError) as info:
        import_onnx(path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("node, message", [
    (helper.make_node("CastLike", ["x", ""], ["y"], name="n"), "required input 1 is missing"),
    (helper.make_node("Gemm", ["", "x"], ["y"], name="n"), "required input 0 is missing"),
    (helper.make_node("Cast", ["x"], ["y"], name="n"), "required attribute 'to' is missing"),
])
def test_malformed_nodes_are_model_errors(tmp_path: Path, node, message) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    path = _save(_model([node], [x], [y]), tmp_path / "m.onnx")
    with pytest.raises(ModelFormatError) as info:
        import_onnx(path)
    assert message in str(info.value) and info.value.node == "n" and "\n" not in str(info.value)


def test_external_data_swapped_for_a_link_after_import_is_refused(tmp_path: Path) -> None:
    import os

    import numpy as np

    from aviatorc.errors import UnsafePathError
    from aviatorc.ir.data import FileRegion
    from aviatorc.ir.types import TensorType

    data = tmp_path / "w.bin"
    data.write_bytes(np.arange(4, dtype=np.float32).tobytes())
    region = FileRegion(data, 0, 16, TensorType("float32", (4,)))
    np.testing.assert_array_equal(region.load(), np.arange(4, dtype=np.float32))
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"\x01" * 16)
    data.unlink()
    os.symlink(secret, data)
    with pytest.raises(ModelFormatError, match="cannot read external data"):
        region.load()
    data.unlink()
    secret.rename(data)  # a different file at the same path
    with pytest.raises(UnsafePathError, match="was replaced after import"):
        region.load()
