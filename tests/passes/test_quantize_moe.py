"""quantize and fuse-qkv on mixtures of experts: per-expert weights, the router kept at FP16,
GPTQ calibrated on the tokens routed to each expert, RTN (and said so) for an expert calibration
never reaches, and the accuracy report per expert on held-out batches.

- Row selection: `calibrate_sequentially` with `routed` keeps exactly the routed rows of an
  expert's input (its Hessian is X_routed^T X_routed, to float64 rounding).
- End to end on tiny gpt-oss (4 experts, top-2) whose router bias keeps expert 3 of layer 0 from
  every token: its two weights are stored as RTN's codes bit for bit, the pass's stats and notes
  name it, and every other expert was calibrated on the tokens routed to it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from aviatorc.passes.manager import PassContext, get_pass, run_passes

import aviatorc
from aviatorc import zoo
from aviatorc.formats import WeightFormat
from aviatorc.ir import Graph, TensorType, add_value, evaluate
from aviatorc.ir.experts import expert_nodes, router_matmuls
from aviatorc.options import CompileOptions
from aviatorc.quant.rtn import pack_weight
from aviatorc.quant.sequential import calibrate_sequentially


def moe_graph(experts: int = 4, hidden: int = 8, seed: int = 0) -> Graph:
    """x -> router MatMul -> MoERouter; per expert dispatch -> MatMul -> combine."""
    rng = np.random.default_rng(seed)
    g = Graph("moe")
    x = g.add_input("x", TensorType("float32", ("tokens", hidden)))
    logits = add_value(g, "MatMul", [x, g.add_constant(rng.standard_normal((hidden, experts)).astype(np.float32),
                                                       "router.weight")], name="router")
    routing = add_value(g, "MoERouter", [logits], {"score": "softmax", "top_k": 2, "normalize": 1}, name="route")
    acc = None
    for e in range(experts):
        xe = add_value(g, "MoEDispatch", [x, routing], {"expert": e}, name=f"dispatch{e}")
        w = g.add_constant(rng.standard_normal((hidden, hidden)).astype(np.float32), f"experts.{e}.down_proj")
        ye = add_value(g, "MatMul", [xe, w], name=f"expert{e}")
        acc = add_value(g, "MoECombine", [routing, ye] + ([acc] if acc is not None else []), {"expert": e},
                        name=f"combine{e}")
    g.outputs = [acc]
    return g


def test_expert_statistics_keep_only_the_routed_rows():
    g = moe_graph()
    experts = expert_nodes(g)
    matmuls = [n for n in g.nodes if n.op == "MatMul" and n in experts]
    assert [experts[m].expert for m in matmuls] == [0, 1, 2, 3] and router_matmuls(g)[0].name == "router"
    batches = [{"x": np.random.default_rng(b).standard_normal((16, 8)).astype(np.float32)} for b in range(3)]
    routed = {m.input(0).name: (experts[m].routing.name, experts[m].expert) for m in matmuls}
    seen: dict = {}
    calibrate_sequentially(g, batches, [[m.input(0).name for m in matmuls]], lambda i, stats: seen.update(stats),
                           hessian=True, routed=routed)
    for m in matmuls:
        e = experts[m].expert
        rows = [b["x"][evaluate(g, b, keep=["route_out"])["route_out"][:, e] != 0] for b in batches]
        x = np.concatenate(rows).astype(np.float64)
        stat = seen[m.input(0).name]
        assert stat.tokens == len(x) and 0 < len(x) < 48
        np.testing.assert_allclose(stat.hessian, x.T @ x, rtol=1e-12)
    # every token goes to top_k = 2 experts
    assert sum(seen[m.input(0).name].tokens for m in matmuls) == 2 * 48


@pytest.fixture(scope="module")
def gpt_oss_int4():
    model = zoo.build_family_model("gpt_oss")
    with torch.no_grad():
        model.model.layers[0].mlp.router.bias[3] = -1e4  # no token reaches expert 3 of layer 0
    rng = np.random.default_rng(0)
    batches = [{"input_ids": rng.integers(3, zoo.VOCAB_SIZE, (2, 8))} for _ in range(4)]
    art = aviatorc.compile(model, {"input_ids": torch.from_numpy(batches[0]["input_ids"]), "use_cache": False},
                           target="mock", time_limit_s=1.0, quant="int4", calibration=batches[:3],
                           evaluation=batches[3:])
    record = next(r for r in art.report.data["passes"] if r["name"] == "quantize")
    return model, art, record


def test_router_stays_fp16_and_every_expert_weight_is_quantized_on_its_own(gpt_oss_int4):
    _, art, record = gpt_oss_int4
    graph = art.graph
    routers = router_matmuls(graph)
    assert len(routers) == 2 and record["stats"]["routers_kept_fp16"] == 2
    for mm in routers:
        assert WeightFormat.from_attrs(mm.input(1).producer.attrs).kind == "fp16"
    experts = expert_nodes(graph)
    quantized = [mm for mm in graph.nodes if mm.op == "MatMul" and mm in experts]
    assert len(quantized) == 2 * 4 * 2  # (gate_up, down) x 4 experts x 2 layers, each its own weight
    assert len({mm.input(1).producer.name for mm in quantized}) == len(quantized)
    assert all(WeightFormat.from_attrs(mm.input(1).producer.attrs).kind == "int4" for mm in quantized)


def test_an_expert_calibration_never_reaches_is_rtn_and_the_report_says_so(gpt_oss_int4):
    model, art, record = gpt_oss_int4
    stats = record["stats"]
    unrouted = sorted(name for name, r in stats["experts"].items() if r["unrouted"])
    assert unrouted == ["model.layers.0.mlp.experts.3.down_proj", "model.layers.0.mlp.experts.3.gate_up_proj"]
    assert stats["experts_rtn_unrouted"] == 2 and stats["experts_calibrated"] == 14
    assert all(r["method"] == "gptq" and r["calibration_tokens"] > 0 for name, r in stats["experts"].items()
               if name not in unrouted)
    # per layer, the routed tokens add up to top_k x the calibration tokens
    layer1 = [r["calibration_tokens"] for n, r in stats["experts"].items() if ".layers.1." in n and "down" in n]
    assert sum(layer1) == 2 * stats["calibration_tokens"]
    notes = " ".join(record["notes"])
    assert "no calibration token was routed to expert 3" in notes and "quantized by RTN, not gptq" in notes
    # RTN's codes, bit for bit: the stored weight is [H, 2I] as the model's stacked [E, H, 2I] slice
    stacked = model.model.layers[0].mlp.experts.gate_up_proj.detach().numpy()[3]
    deq = art.graph.value("model.layers.0.mlp.experts.3.gate_up_proj.dequant_out").producer
    fmt = WeightFormat.from_attrs(deq.attrs)
    expected = pack_weight(stacked.astype(np.float32), fmt)
    for stored, want in zip(deq.inputs, expected.arrays, strict=False):
        if stored is not None:
            np.testing.assert_array_equal(stored.data.load(), want)


def test_accuracy_is_reported_per_expert_on_held_out_batches(gpt_oss_int4):
    _, art, _ = gpt_oss_int4
    accuracy = art.report.data["accuracy"]
    assert accuracy["data"]["held_out"]
    experts = accuracy["experts"]
    assert len(experts) == 8
    for block in {e["routing"] for e in experts}:
        tokens = [e["tokens"] for e in experts if e["routing"] == block]
        assert sum(tokens) == 2 * 16  # one held-out batch of 2 x 8 tokens, top-2
    unreached = [e for e in experts if e["expert"] == 3 and "layers.0" in e["combine"]]
    assert unreached[0]["tokens"] == 0 and "sqnr_db" not in unreached[0]
    measured = [e for e in experts if e["tokens"]]
    assert all(0.9 < e["cosine"] <= 1.0 and float(e["sqnr_db"]) > 10 for e in measured)
    assert all(0.0 <= r["same_experts"] <= 1.0 for r in accuracy["routing"])
    from aviatorc.accuracy import format_accuracy

    assert "experts: 7 of 8 reached by these batches; worst SQNR" in format_accuracy(accuracy)


@pytest.mark.parametrize("arch, fused", [("mixtral", 2), ("gpt_oss", 2), ("deepseek_v3", 0)])
def test_qkv_fusion_applies_where_it_can_and_mla_keeps_its_own(arch, fused):
    model = zoo.build_family_model(arch)
    tokens = np.random.default_rng(0).integers(3, zoo.VOCAB_SIZE, (2, 7))
    graph = aviatorc.frontends.import_model(model, {"input_ids": torch.from_numpy(tokens), "use_cache": False})
    before = evaluate(graph, {graph.inputs[0].name: tokens})
    ctx = PassContext(options=CompileOptions(fuse_qkv=True))
    (result,) = run_passes(graph, [get_pass("fuse-qkv")], ctx)
    assert result.stats["groups_fused"] == fused
    if arch == "deepseek_v3":  # MLA's q_a / kv_a projections are not q, k and v
        assert any(n.name.endswith("kv_a_proj_with_mqa.weight") for n in graph.initializers.values())
    after = evaluate(graph, {graph.inputs[0].name: tokens})
    for name in before:
        np.testing.assert_allclose(after[name], before[name], rtol=1e-5, atol=1e-5)
