"""fuse-qkv: Before/Expected structure, numerics before and after, and one negative test per reason.

Negative tests assert that the graph text is unchanged (`print_graph` before and after) and
that the note names the node the reason is about.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from aviatorc.passes.fuse_qkv import ConcatData, check, find, largest_chiplet_sram_bytes, storage_format
from aviatorc.passes.manager import PassContext, get_pass, run_passes

from aviatorc.ir import (
    ArrayData,
    FileRegion,
    Graph,
    ShapeOnly,
    TensorType,
    Value,
    add_value,
    evaluate,
    parse_graph,
    print_graph,
    verify,
)
from aviatorc.ir.ops import OPS
from aviatorc.options import CompileOptions
from aviatorc.target import load_target

TOLERANCE = 1e-5  # one extra fp32 rounding per output at most: the fused MatMul reorders nothing else


def run_fuse(graph: Graph, ctx: PassContext | None = None):
    records = run_passes(graph, [get_pass("fuse-qkv")], ctx or PassContext())
    return records[0]


def assert_same_text(expected: str, graph: Graph) -> None:
    assert print_graph(graph) == print_graph(parse_graph(expected))


# -- Before / Expected ---------------------------------------------------------------------------

BEFORE = """
graph "attn" {
  input %h: float32[2, 3, 8]
  weight %layers.0.attn.q_proj.weight: float32[8, 16]
  weight %layers.0.attn.k_proj.weight: float32[8, 8]
  weight %layers.0.attn.v_proj.weight: float32[8, 8]
  %q: float32[2, 3, 16] = MatMul(%h, %layers.0.attn.q_proj.weight) @q_mm
  %k: float32[2, 3, 8] = MatMul(%h, %layers.0.attn.k_proj.weight) @k_mm
  %v: float32[2, 3, 8] = MatMul(%h, %layers.0.attn.v_proj.weight) @v_mm
  output %q
  output %k
  output %v
}
"""

EXPECTED = """
graph "attn" {
  input %h: float32[2, 3, 8]
  weight %layers.0.attn.qkv_proj.weight: float32[8, 32]
  const %layers.0.attn.qkv_proj.split_sizes: int64[3] = [16, 8, 8]
  %layers.0.attn.qkv_proj_out: float32[2, 3, 32] = MatMul(%h, %layers.0.attn.qkv_proj.weight) @layers.0.attn.qkv_proj
  %q: float32[2, 3, 16], %k: float32[2, 3, 8], %v: float32[2, 3, 8] = Split(%layers.0.attn.qkv_proj_out, %layers.0.attn.qkv_proj.split_sizes) {axis = -1} @layers.0.attn.qkv_proj.split
  output %q
  output %k
  output %v
}
"""

BEFORE_BIAS = """
graph "attn" {
  input %h: float32[2, 3, 8]
  weight %layers.0.attn.q_proj.weight: float32[8, 16]
  weight %layers.0.attn.q_proj.bias: float32[16]
  weight %layers.0.attn.k_proj.weight: float32[8, 8]
  weight %layers.0.attn.k_proj.bias: float32[8]
  weight %layers.0.attn.v_proj.weight: float32[8, 8]
  weight %layers.0.attn.v_proj.bias: float32[8]
  %q0: float32[2, 3, 16] = MatMul(%h, %layers.0.attn.q_proj.weight) @q_mm
  %q: float32[2, 3, 16] = Add(%q0, %layers.0.attn.q_proj.bias) @q_add
  %k0: float32[2, 3, 8] = MatMul(%h, %layers.0.attn.k_proj.weight) @k_mm
  %k: float32[2, 3, 8] = Add(%layers.0.attn.k_proj.bias, %k0) @k_add
  %v0: float32[2, 3, 8] = MatMul(%h, %layers.0.attn.v_proj.weight) @v_mm
  %v: float32[2, 3, 8] = Add(%v0, %layers.0.attn.v_proj.bias) @v_add
  %s: float32[2, 3, 8] = Add(%k, %v) @use
  output %q
  output %s
}
"""

EXPECTED_BIAS = """
graph "attn" {
  input %h: float32[2, 3, 8]
  weight %layers.0.attn.qkv_proj.weight: float32[8, 32]
  weight %layers.0.attn.qkv_proj.bias: float32[32]
  const %layers.0.attn.qkv_proj.split_sizes: int64[3] = [16, 8, 8]
  %layers.0.attn.qkv_proj_out: float32[2, 3, 32] = MatMul(%h, %layers.0.attn.qkv_proj.weight) @layers.0.attn.qkv_proj
  %layers.0.attn.qkv_proj.add_out: float32[2, 3, 32] = Add(%layers.0.attn.qkv_proj_out, %layers.0.attn.qkv_proj.bias) @layers.0.attn.qkv_proj.add
  %q: float32[2, 3, 16], %k: float32[2, 3, 8], %v: float32[2, 3, 8] = Split(%layers.0.attn.qkv_proj.add_out, %layers.0.attn.qkv_proj.split_sizes) {axis = -1} @layers.0.attn.qkv_proj.split
  %s: float32[2, 3, 8] = Add(%k, %v) @use
  output %q
  output %s
}
"""


def test_named_projections_fuse_without_bias():
    graph = parse_graph(BEFORE)  # parsed weights are shape-only: the fused one is too
    record = run_fuse(graph)
    assert record.changed and record.stats["groups_fused"] == 1 and record.stats["by_names"] == 1
    assert_same_text(EXPECTED, graph)
    assert isinstance(graph.initializers["layers.0.attn.qkv_proj.weight"].data, ShapeOnly)


def test_named_projections_fuse_with_bias_on_either_side_of_the_add():
    graph = parse_graph(BEFORE_BIAS)
    assert run_fuse(graph).stats["groups_fused"] == 1
    assert_same_text(EXPECTED_BIAS, graph)


def test_torch_export_style_parameter_names():
    text = BEFORE.replace("layers.0.attn.", "p_layers_0_attn_").replace("_proj.weight", "_proj_weight")
    graph = parse_graph(text)
    assert run_fuse(graph).stats["groups_fused"] == 1
    assert "p_layers_0_attn_qkv_proj.weight" in graph.initializers


# -- a whole attention block, built with data -----------------------------------------------------


@dataclass
class Attn:
    hidden: int = 16
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 4
    seq: int = 5
    batch: int = 2
    bias: tuple[bool, bool, bool] = (True, True, True)
    names: bool = True  # False: anonymous weights, as the ONNX exporter leaves them


def attention_block(
    cfg: Attn, seed: int = 0, *, graph: Graph | None = None, x: Value | None = None, layer: int = 0, weight_data=None
) -> Graph:
    """An attention block with GQA (k/v heads repeated by Concat), a scaled softmax and an MLP
    whose gate and up projections also share an input (two MatMuls that must not fuse)."""
    rng = np.random.default_rng(seed + layer)
    g = graph or Graph("attn")
    if x is None:
        x = g.add_input("hidden", TensorType("float32", (cfg.batch, cfg.seq, cfg.hidden)))
    weight_data = weight_data or (lambda name, array: ArrayData(array))

    def weight(name: str, shape: tuple[int, ...]) -> Value:
        array = rng.standard_normal(shape).astype(np.float32) * 0.3
        full = f"model.layers.{layer}.self_attn.{name}" if cfg.names else g.unique_name(f"val_{layer}")
        return g.add_initializer(full, TensorType("float32", shape), weight_data(full, array))

    def const(array, name: str) -> Value:
        return g.add_constant(np.asarray(array), name=f"l{layer}_{name}")

    def heads(value: Value, n: int, role: str) -> Value:
        shaped = add_value(
            g,
            "Reshape",
            [value, const([cfg.batch, cfg.seq, n, cfg.head_dim], f"{role}_shape")],
            name=f"l{layer}_{role}_reshape",
        )
        return add_value(g, "Transpose", [shaped], {"perm": (0, 2, 1, 3)}, name=f"l{layer}_{role}_heads")

    outs = {}
    for i, role, n, has_bias in zip(range(3), "qkv", (cfg.heads, cfg.kv_heads, cfg.kv_heads), cfg.bias, strict=True):
        width = n * cfg.head_dim
        tag = role if cfg.names else f"p{i}"  # anonymous: no q/k/v in any name, only structure
        y = add_value(g, "MatMul", [x, weight(f"{role}_proj.weight", (cfg.hidden, width))], name=f"l{layer}_{tag}_mm")
        if has_bias:
            y = add_value(g, "Add", [y, weight(f"{role}_proj.bias", (width,))], name=f"l{layer}_{tag}_bias")
        outs[role] = heads(y, n, tag)
    repeat = cfg.heads // cfg.kv_heads
    for role in "kv":  # grouped-query attention: each k/v head serves `repeat` q heads
        if repeat > 1:
            outs[role] = add_value(g, "Concat", [outs[role]] * repeat, {"axis": 1}, name=f"l{layer}_{role}_repeat")
    kt = add_value(g, "Transpose", [outs["k"]], {"perm": (0, 1, 3, 2)}, name=f"l{layer}_kt")
    scores = add_value(g, "MatMul", [outs["q"], kt], name=f"l{layer}_scores")
    scores = add_value(g, "Mul", [scores, const(np.float32(cfg.head_dim**-0.5), "scale")], name=f"l{layer}_scale")
    probs = add_value(g, "Softmax", [scores], {"axis": -1}, name=f"l{layer}_softmax")
    context = add_value(g, "MatMul", [probs, outs["v"]], name=f"l{layer}_context")
    context = add_value(g, "Transpose", [context], {"perm": (0, 2, 1, 3)}, name=f"l{layer}_merge")
    context = add_value(
        g,
        "Reshape",
        [context, const([cfg.batch, cfg.seq, cfg.heads * cfg.head_dim], "merge_shape")],
        name=f"l{layer}_merge_reshape",
    )
    h = add_value(
        g, "MatMul", [context, weight("o_proj.weight", (cfg.heads * cfg.head_dim, cfg.hidden))], name=f"l{layer}_o_mm"
    )
    h = add_value(g, "Add", [x, h], name=f"l{layer}_residual")
    gate = add_value(g, "MatMul", [h, weight("gate_proj.weight", (cfg.hidden, 24))], name=f"l{layer}_gate")
    up = add_value(g, "MatMul", [h, weight("up_proj.weight", (cfg.hidden, 24))], name=f"l{layer}_up")
    act = add_value(g, "Mul", [add_value(g, "Sigmoid", [gate], name=f"l{layer}_sig"), up], name=f"l{layer}_glu")
    out = add_value(g, "MatMul", [act, weight("down_proj.weight", (24, cfg.hidden))], name=f"l{layer}_down")
    out = add_value(g, "Add", [h, out], name=f"l{layer}_residual2")
    g.outputs = [out]
    return g


def feeds(cfg: Attn) -> dict[str, np.ndarray]:
    return {"hidden": np.random.default_rng(7).standard_normal((cfg.batch, cfg.seq, cfg.hidden)).astype(np.float32)}


def fuse_and_compare(graph: Graph, cfg: Attn, ctx: PassContext | None = None):
    before = evaluate(graph, feeds(cfg))
    record = run_fuse(graph, ctx)
    after = evaluate(graph, feeds(cfg))
    for name in before:
        np.testing.assert_allclose(after[name], before[name], atol=TOLERANCE, rtol=0)
    return record


@pytest.mark.parametrize("names", [True, False], ids=["by-names", "by-structure"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("kv_heads", [4, 1], ids=["mha", "gqa"])
def test_attention_block_fuses_exactly(names, bias, kv_heads):
    cfg = Attn(kv_heads=kv_heads, bias=(bias,) * 3, names=names)
    graph = attention_block(cfg)
    record = fuse_and_compare(graph, cfg)
    assert record.stats["groups_fused"] == 1
    assert record.stats["by_names" if names else "by_structure"] == 1
    census = graph.op_census()
    assert census["MatMul"] == 2 + 1 + 4  # scores and context; fused qkv; o, gate, up (kept apart), down
    assert census["Split"] == 1
    split = next(n for n in graph.nodes if n.op == "Split")
    assert split.input(1).const_value().tolist() == [16, 4 * kv_heads, 4 * kv_heads]  # GQA: narrower k and v
    if names:
        assert "model.layers.0.self_attn.qkv_proj.weight" in graph.initializers
        assert ("model.layers.0.self_attn.qkv_proj.bias" in graph.initializers) == bias
    else:
        assert "attn.0.qkv_proj.weight" in graph.initializers
    assert not any("q_proj" in name or "k_proj" in name for name in graph.initializers)  # old weights dropped


def test_two_layers_give_two_groups():
    cfg = Attn()
    graph = attention_block(cfg)
    attention_block(cfg, graph=graph, x=graph.outputs[0], layer=1)
    assert fuse_and_compare(graph, cfg).stats["groups_fused"] == 2


def test_lazily_loaded_weights_stay_lazy(tmp_path):
    cfg = Attn()
    blob = tmp_path / "weights.bin"
    blob.write_bytes(b"")

    def on_disk(name, array):
        offset = blob.stat().st_size
        with open(blob, "ab") as f:
            f.write(array.tobytes())
        return FileRegion(blob, offset, array.nbytes, TensorType("float32", array.shape))

    graph = attention_block(cfg, weight_data=on_disk)
    fuse_and_compare(graph, cfg)
    fused = graph.initializers["model.layers.0.self_attn.qkv_proj.weight"]
    assert isinstance(fused.data, ConcatData) and fused.data.available


def test_attention_op_operands_identify_roles():
    g = Graph("attn")
    x = g.add_input("x", TensorType("float32", (1, 3, 8)))
    rng = np.random.default_rng(0)
    qkv = [
        add_value(g, "MatMul", [x, g.add_constant(rng.standard_normal((8, w)).astype(np.float32), "w")], name=f"mm{i}")
        for i, w in enumerate((8, 4, 4))
    ]
    g.outputs = [add_value(g, "Attention", qkv, {"q_num_heads": 2, "kv_num_heads": 1}, name="attention")]
    feed = {"x": rng.standard_normal((1, 3, 8)).astype(np.float32)}
    before = evaluate(g, feed)["attention_out"]
    assert run_fuse(g).stats["by_structure"] == 1
    np.testing.assert_allclose(evaluate(g, feed)["attention_out"], before, atol=TOLERANCE, rtol=0)


# -- nothing to do -------------------------------------------------------------------------------


def already_fused_block() -> Graph:
    """GPT-2's c_attn: one MatMul + bias, then a Split into q, k and v."""
    cfg = Attn(kv_heads=4, names=False)
    g = Graph("gpt2")
    rng = np.random.default_rng(0)
    x = g.add_input("hidden", TensorType("float32", (cfg.batch, cfg.seq, cfg.hidden)))
    y = add_value(
        g, "MatMul", [x, g.add_constant(rng.standard_normal((16, 48)).astype(np.float32), "c_attn_w")], name="c_attn"
    )
    y = add_value(
        g, "Add", [y, g.add_constant(rng.standard_normal(48).astype(np.float32), "c_attn_b")], name="c_attn_b"
    )
    split = g.add_node(
        "Split",
        [y, g.add_constant(np.array([16, 16, 16]), "sizes")],
        [TensorType("float32", (2, 5, 16))] * 3,
        {"axis": 2},
        name="split",
    )
    q, k, v = split.outputs
    scores = add_value(g, "MatMul", [q, add_value(g, "Transpose", [k], {"perm": (0, 2, 1)}, name="kt")], name="scores")
    probs = add_value(g, "Softmax", [scores], name="softmax")
    g.outputs = [add_value(g, "MatMul", [probs, v], name="context")]
    return g


def test_already_fused_model_is_untouched():
    graph = already_fused_block()
    text = print_graph(graph)
    record = run_fuse(graph)
    assert not record.changed and record.stats["groups_found"] == 0
    assert print_graph(graph) == text
    assert any("already fused" in note for note in record.notes)


def test_mlp_pairs_do_not_count_as_attention():
    g = Graph("mlp")
    x = g.add_input("x", TensorType("float32", (2, 8)))
    ys = [
        add_value(g, "MatMul", [x, g.add_constant(np.ones((8, 8), np.float32), "w")], name=f"mm{i}") for i in range(3)
    ]
    g.outputs = [add_value(g, "Sum", ys, name="sum")]
    text = print_graph(g)
    assert not run_fuse(g).changed
    assert print_graph(g) == text


# -- negative tests: one per reason ----------------------------------------------------------------


def assert_refused(graph: Graph, node: str, words: str, ctx: PassContext | None = None) -> None:
    text = print_graph(graph)
    record = run_fuse(graph, ctx)
    assert not record.changed
    assert print_graph(graph) == text
    assert f"{node}: " in "\n".join(record.notes) and words in "\n".join(record.notes), record.notes


@pytest.mark.parametrize("names", [True, False], ids=["by-names", "by-structure"])
def test_bias_on_k_but_not_q(names):
    cfg = Attn(bias=(False, True, True), names=names)
    assert_refused(attention_block(cfg), "l0_k_mm" if names else "l0_p1_mm", "k projection has a bias but q does not")


def test_weight_that_is_not_an_initializer():
    graph = parse_graph(
        BEFORE.replace(
            "  %k: float32[2, 3, 8] = MatMul(%h, %layers.0.attn.k_proj.weight) @k_mm",
            "  %wk: float32[8, 8] = Neg(%layers.0.attn.k_proj.weight) @k_neg\n"
            "  %k: float32[2, 3, 8] = MatMul(%h, %wk) @k_mm",
        )
    )
    assert_refused(graph, "k_mm", "k weight 'wk' is not an initializer (computed by Neg 'k_neg')")


@pytest.mark.skipif("DequantizeWeight" not in OPS, reason="the quantization ops are not registered")
def test_weight_through_dequantize_is_left_for_the_pipeline_order():
    graph = parse_graph(
        BEFORE.replace(
            "  %v: float32[2, 3, 8] = MatMul(%h, %layers.0.attn.v_proj.weight) @v_mm",
            "  %wv: float32[8, 8] = DequantizeWeight(%layers.0.attn.v_proj.weight) "
            '{format = "fp32", k = 8, n = 8} @v_dq\n'
            "  %v: float32[2, 3, 8] = MatMul(%h, %wv) @v_mm",
        )
    )
    verify(graph)
    assert_refused(graph, "v_mm", "run fuse-qkv before quantize")


def test_inputs_differ_cross_attention():
    graph = parse_graph(
        BEFORE.replace("input %h: float32[2, 3, 8]", "input %h: float32[2, 3, 8]\n  input %enc: float32[2, 3, 8]")
        .replace("MatMul(%h, %layers.0.attn.k_proj", "MatMul(%enc, %layers.0.attn.k_proj")
        .replace("MatMul(%h, %layers.0.attn.v_proj", "MatMul(%enc, %layers.0.attn.v_proj")
    )
    assert_refused(graph, "k_mm", "inputs differ: k reads 'enc' but q reads 'h'")


def test_weights_with_different_dtypes_are_refused_by_check():
    # A verified graph cannot reach this reason (MatMul needs equal dtypes and the input is
    # shared); check() is total anyway, so build the group's graph without verifying it.
    graph = parse_graph(BEFORE)
    v_weight = graph.initializers["layers.0.attn.v_proj.weight"]
    v_weight.type = TensorType("float16", (8, 8))
    groups, _ = find(graph)
    note = check(graph, groups[0], PassContext())
    assert note is not None and note.node == "v_mm"
    assert note.message == "weights have different dtypes (q float32, k float32, v float16)"


def wide_projections() -> Graph:
    """BEFORE at hidden 256: the fused [256, 1024] fp32 weight is 1 MiB, over the mock
    target's 768 KiB of usable SRAM per chiplet (1 MiB less a quarter reserved)."""
    text = (
        BEFORE.replace("8, 16]", "256, 512]")
        .replace("8, 8]", "256, 256]")
        .replace("[2, 3, 8]", "[2, 3, 256]")
        .replace("[2, 3, 16]", "[2, 3, 512]")
    )
    return parse_graph(text)


def test_fused_weight_larger_than_any_chiplet_is_refused():
    target = load_target("mock")
    assert largest_chiplet_sram_bytes(target) == 786432
    assert_refused(
        wide_projections(),
        "q_mm",
        "fused weight of 1048576 bytes (fp32, [256, 1024]) exceeds the "
        "largest chiplet SRAM of 786432 bytes on target mock",
        PassContext(target=target),
    )


def test_fused_weight_is_sized_in_the_format_quantize_will_store():
    # int8: 256 * 1024 bytes + 1024 fp16 scales = 264192 bytes: fits the mock chiplet.
    ctx = PassContext(options=CompileOptions(quant="int8"), target=load_target("mock"))
    assert run_fuse(wide_projections(), ctx).stats["groups_fused"] == 1
    assert storage_format("float32", CompileOptions(quant="int4", sparsity="2:4")).name == "int4-g32-sp24"
    assert largest_chiplet_sram_bytes(None) is None


def test_incomplete_structural_group_is_noted():
    # q and k of `hidden` reach attention, but v comes from another input: no group, a note.
    cfg = Attn(names=False, kv_heads=4)
    graph = attention_block(cfg)
    other = graph.add_input("other", TensorType("float32", (cfg.batch, cfg.seq, cfg.hidden)))
    v_mm = next(n for n in graph.nodes if n.name == "l0_p2_mm")
    v_mm.set_input(0, other)
    assert_refused(graph, "l0_p0_mm", "reach attention as 1 q, 1 k, 0 v: need exactly one each of q, k and v")
