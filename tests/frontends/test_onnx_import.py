"""The ONNX importer on small hand-built models: each imported graph is evaluated by the IR
interpreter and compared with onnxruntime (fp32, within 1e-5), plus structural checks of
the conversions (Gemm, Dropout, CastLike, Split, Reduce axes, folding, names)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from aviatorc.frontends.onnx import import_onnx
from aviatorc.ir import ArrayData, Derived, ShapeOnly, evaluate

TOL = 1e-5
RNG = np.random.default_rng(0)


def _model(nodes, inputs, outputs, initializers=(), opset: int = 18) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10 if opset >= 21 else 8
    return model


def _vi(name: str, dtype: int, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def _w(name: str, *shape: int, dtype=np.float32) -> TensorProto:
    return numpy_helper.from_array(RNG.standard_normal(shape).astype(dtype), name)


def _compare(model: onnx.ModelProto, feeds: dict[str, np.ndarray], tmp_path: Path, **options):
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    graph = import_onnx(path, **options)
    ours = evaluate(graph, feeds)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    theirs = dict(zip(names, session.run(names, feeds), strict=False))
    for name in names:
        assert ours[name].dtype == theirs[name].dtype, name
        assert ours[name].shape == theirs[name].shape, name
        np.testing.assert_allclose(ours[name], theirs[name], rtol=TOL, atol=TOL, err_msg=name)
    return graph


def test_gemm_mlp(tmp_path: Path) -> None:
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], transB=1, alpha=0.5, beta=2.0, name="fc1"),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Gemm", ["r", "w2"], ["logits"], name="fc2"),
        helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
    ]
    model = _model(
        nodes,
        [_vi("x", TensorProto.FLOAT, [3, 8])],
        [_vi("probs", TensorProto.FLOAT, [3, 5])],
        [_w("w1", 16, 8), _w("b1", 16), _w("w2", 16, 5)],
    )
    graph = _compare(model, {"x": RNG.standard_normal((3, 8)).astype(np.float32)}, tmp_path)
    assert "Gemm" not in graph.op_census() and graph.op_census()["MatMul"] == 2
    # transB on a weight becomes a transposed initializer, not a Transpose node
    assert "Transpose" not in graph.op_census() and "w1_T" in graph.initializers
    assert [n.name for n in graph.nodes if n.op == "Add"] == ["fc1"]


def test_gemm_transposed_activation(tmp_path: Path) -> None:
    nodes = [helper.make_node("Gemm", ["a", "b", "c"], ["y"], transA=1, transB=1)]
    inputs = [
        _vi("a", TensorProto.FLOAT, [4, 3]),
        _vi("b", TensorProto.FLOAT, [5, 4]),
        _vi("c", TensorProto.FLOAT, [5]),
    ]
    feeds = {
        "a": RNG.standard_normal((4, 3)).astype(np.float32),
        "b": RNG.standard_normal((5, 4)).astype(np.float32),
        "c": RNG.standard_normal(5).astype(np.float32),
    }
    graph = _compare(_model(nodes, inputs, [_vi("y", TensorProto.FLOAT, [3, 5])]), feeds, tmp_path)
    assert graph.op_census()["Transpose"] == 2


def test_layer_block_opset17_legacy_style(tmp_path: Path) -> None:
    """Constant, Shape chains and ConstantOfShape, as the TorchScript exporter writes them."""
    nodes = [
        helper.make_node("Constant", [], ["eps"], value=numpy_helper.from_array(np.array(1e-5, np.float32))),
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Constant", [], ["idx"], value=numpy_helper.from_array(np.array([0, 1], np.int64))),
        helper.make_node("Gather", ["shape", "idx"], ["bs"]),
        helper.make_node("Constant", [], ["minus1"], value=numpy_helper.from_array(np.array([-1], np.int64))),
        helper.make_node("Concat", ["bs", "minus1"], ["target"], axis=0),
        helper.make_node("ReduceMean", ["x"], ["mean"], axes=[-1]),
        helper.make_node("Sub", ["x", "mean"], ["xc"]),
        helper.make_node("Mul", ["xc", "xc"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["var"], axes=[-1]),
        helper.make_node("Add", ["var", "eps"], ["ve"]),
        helper.make_node("Sqrt", ["ve"], ["std"]),
        helper.make_node("Div", ["xc", "std"], ["norm"]),
        helper.make_node("Reshape", ["norm", "target"], ["flat"]),
        helper.make_node(
            "ConstantOfShape", ["target_len"], ["ones"], value=numpy_helper.from_array(np.array([2.0], np.float32))
        ),
        helper.make_node("Shape", ["target"], ["target_len"]),
        helper.make_node("Dropout", ["flat"], ["dropped"]),
        helper.make_node("Mul", ["dropped", "scale"], ["y"]),
    ]
    # ConstantOfShape is listed before the node computing its input: the importer sorts
    nodes = nodes[:14] + [nodes[15], nodes[14]] + nodes[16:]
    scale = numpy_helper.from_array(np.array(3.0, np.float32), "scale")
    model = _model(
        nodes, [_vi("x", TensorProto.FLOAT, [2, 3, 4])], [_vi("y", TensorProto.FLOAT, None)], [scale], opset=17
    )
    graph = _compare(model, {"x": RNG.standard_normal((2, 3, 4)).astype(np.float32)}, tmp_path)
    census = graph.op_census()
    assert "Shape" not in census and "Gather" not in census and "Concat" not in census  # folded
    assert "Dropout" not in census and census.get("Identity", 0) <= 1
    assert graph.value("y").type.shape == (2, 3, 4)


def test_dynamic_shapes_keep_symbols(tmp_path: Path) -> None:
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Slice", ["shape", "zero", "two", "zero"], ["bs"]),
        helper.make_node("Concat", ["bs", "heads", "minus1"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["split"]),
        helper.make_node("Transpose", ["split"], ["t"], perm=[0, 2, 1, 3]),
    ]
    inits = [
        numpy_helper.from_array(np.array(v, np.int64), n)
        for n, v in [("zero", [0]), ("two", [2]), ("heads", [2]), ("minus1", [-1])]
    ]
    model = _model(
        nodes, [_vi("x", TensorProto.FLOAT, ["batch", "seq", 8])], [_vi("t", TensorProto.FLOAT, None)], inits
    )
    for seq in (3, 5):
        graph = _compare(model, {"x": RNG.standard_normal((2, seq, 8)).astype(np.float32)}, tmp_path)
    assert graph.inputs[0].type.shape == ("batch", "seq", 8)
    assert graph.value("t").type.shape[:3] == ("batch", 2, "seq")  # the last is onnx's unk__N symbol
    assert "Shape" in graph.op_census()  # dynamic: not folded


def test_opset18_conversions(tmp_path: Path) -> None:
    nodes = [
        helper.make_node("Split", ["x"], ["a", "b", "c"], axis=1, num_outputs=3, name="split"),
        helper.make_node("ReduceSum", ["a", "axes"], ["s"], keepdims=0),
        helper.make_node("ReduceMax", ["b", "axes"], ["m"], keepdims=0),
        helper.make_node("CastLike", ["ids", "s"], ["ids_f"]),
        helper.make_node("Add", ["s", "ids_f"], ["sum1"]),
        helper.make_node("Sub", ["sum1", "m"], ["y"]),
        helper.make_node("Cast", ["c"], ["c16"], to=TensorProto.FLOAT16),
    ]
    inits = [numpy_helper.from_array(np.array([1], np.int64), "axes")]
    model = _model(
        nodes,
        [_vi("x", TensorProto.FLOAT, [2, 9]), _vi("ids", TensorProto.INT64, [2])],
        [_vi("y", TensorProto.FLOAT, None), _vi("c16", TensorProto.FLOAT16, None)],
        inits,
    )
    feeds = {"x": RNG.standard_normal((2, 9)).astype(np.float32), "ids": np.array([3, -4], np.int64)}
    graph = _compare(model, feeds, tmp_path)
    assert graph.op_census()["Cast"] == 2
    reduce_sum = next(n for n in graph.nodes if n.op == "ReduceSum")
    assert reduce_sum.attrs["axes"] == (1,) and len(reduce_sum.inputs) == 1


def test_decode_step_with_kv_cache(tmp_path: Path) -> None:
    """Range, Squeeze, comparisons, Cos/Sin and a concatenated KV cache, as in decode graphs."""
    nodes = [
        helper.make_node("Shape", ["past"], ["pshape"], start=2, end=3),
        helper.make_node("Squeeze", ["pshape", "zero"], ["past_len"]),
        helper.make_node("Add", ["past_len", "one"], ["total"]),
        helper.make_node("Range", ["past_len", "total", "one"], ["pos"]),
        helper.make_node("Cast", ["pos"], ["pos_f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["pos_f", "one1d"], ["pos_col"]),
        helper.make_node("Mul", ["pos_col", "inv_freq"], ["angles"]),
        helper.make_node("Cos", ["angles"], ["cos"]),
        helper.make_node("Sin", ["angles"], ["sin"]),
        helper.make_node("Concat", ["cos", "sin"], ["rot"], axis=-1),
        helper.make_node("Mul", ["k", "rot"], ["k_rot"]),
        helper.make_node("Concat", ["past", "k_rot"], ["present"], axis=2),
        helper.make_node("Range", ["zero_s", "total", "one"], ["kpos"]),
        helper.make_node("LessOrEqual", ["kpos", "past_len"], ["visible"]),
        helper.make_node("MatMul", ["q", "present_t"], ["scores"]),
        helper.make_node("Transpose", ["present"], ["present_t"], perm=[0, 1, 3, 2]),
        helper.make_node("Where", ["visible", "scores", "neg"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["attn"], axis=-1),
    ]
    nodes = nodes[:14] + [nodes[15], nodes[14]] + nodes[16:]
    inits = [
        numpy_helper.from_array(np.array([0], np.int64), "zero"),
        numpy_helper.from_array(np.array(0, np.int64), "zero_s"),
        numpy_helper.from_array(np.array(1, np.int64), "one"),
        numpy_helper.from_array(np.array([1], np.int64), "one1d"),
        numpy_helper.from_array(np.array([1.0, 0.5, 0.25, 0.125], np.float32), "inv_freq"),
        numpy_helper.from_array(np.array(-1e9, np.float32), "neg"),
    ]
    inputs = [
        _vi("q", TensorProto.FLOAT, [1, 2, 1, 8]),
        _vi("k", TensorProto.FLOAT, [1, 2, 1, 8]),
        _vi("past", TensorProto.FLOAT, [1, 2, "past_seq", 8]),
    ]
    model = _model(
        nodes, inputs, [_vi("attn", TensorProto.FLOAT, None), _vi("present", TensorProto.FLOAT, None)], inits
    )
    feeds = {
        "q": RNG.standard_normal((1, 2, 1, 8)).astype(np.float32),
        "k": RNG.standard_normal((1, 2, 1, 8)).astype(np.float32),
        "past": RNG.standard_normal((1, 2, 5, 8)).astype(np.float32),
    }
    _compare(model, feeds, tmp_path)


def _attention_case(rank: int, past: bool, mask: str | None, causal: bool, softcap: float = 0.0):
    b, hq, hkv, s, d, p = 2, 4, 2, 3, 8, 5
    if rank == 4:
        shapes = {"q": [b, hq, s, d], "k": [b, hkv, s, d], "v": [b, hkv, s, d]}
        attrs: dict = {}
    else:
        shapes = {"q": [b, s, hq * d], "k": [b, s, hkv * d], "v": [b, s, hkv * d]}
        attrs = {"q_num_heads": hq, "kv_num_heads": hkv}
    total = s + (p if past else 0)
    names = ["q", "k", "v", "mask" if mask else "", "past_k" if past else "", "past_v" if past else ""]
    inputs = [_vi(n, TensorProto.FLOAT, shapes[n]) for n in ("q", "k", "v")]
    feeds = {n: RNG.standard_normal(shapes[n]).astype(np.float32) for n in ("q", "k", "v")}
    if mask == "bool":
        inputs.append(_vi("mask", TensorProto.BOOL, [s, total]))
        feeds["mask"] = RNG.random((s, total)) > 0.3
        feeds["mask"][:, 0] = True
    elif mask == "float":
        inputs.append(_vi("mask", TensorProto.FLOAT, [s, total]))
        feeds["mask"] = RNG.standard_normal((s, total)).astype(np.float32)
    if past:
        for n in ("past_k", "past_v"):
            inputs.append(_vi(n, TensorProto.FLOAT, [b, hkv, p, d]))
            feeds[n] = RNG.standard_normal((b, hkv, p, d)).astype(np.float32)
    while not names[-1]:
        names.pop()
    outs = ["y", "present_k", "present_v"] if past else ["y"]
    if causal:
        attrs["is_causal"] = 1
    if softcap:
        attrs["softcap"] = softcap
    node = helper.make_node("Attention", names, outs, **attrs)
    model = _model([node], inputs, [_vi(o, TensorProto.FLOAT, None) for o in outs], opset=23)
    return model, feeds


@pytest.mark.parametrize(
    "rank,past,mask,causal,softcap",
    [
        (4, False, None, False, 0.0),
        (4, False, None, True, 0.0),
        (4, True, None, True, 0.0),
        (4, True, "bool", False, 0.0),
        (4, False, "float", False, 2.0),
        (3, False, None, True, 0.0),
        (3, True, "float", False, 0.0),
    ],
)
def test_attention_opset23(tmp_path: Path, rank, past, mask, causal, softcap) -> None:
    model, feeds = _attention_case(rank, past, mask, causal, softcap)
    graph = _compare(model, feeds, tmp_path)
    assert graph.op_census() == {"Attention": 1}


def test_names_and_shape_only(tmp_path: Path) -> None:
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="proj"), helper.make_node("Relu", ["h"], ["y"])]
    model = _model(
        nodes, [_vi("x", TensorProto.FLOAT, [1, 256])], [_vi("y", TensorProto.FLOAT, [1, 256])], [_w("w", 256, 256)]
    )
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    graph = import_onnx(path)
    assert [n.name for n in graph.nodes] == ["proj", "Relu_1"]  # unnamed: op and position
    assert [v.name for v in graph.inputs] == ["x"] and [v.name for v in graph.outputs] == ["y"]
    assert isinstance(graph.initializers["w"].data, (ArrayData, Derived))
    shape_only = import_onnx(path, shape_only=True)
    assert isinstance(shape_only.initializers["w"].data, ShapeOnly)
    assert shape_only.initializers["w"].type.shape == (256, 256)
