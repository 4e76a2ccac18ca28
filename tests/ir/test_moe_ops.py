"""The MoE ops' kernels against the routers `transformers` itself runs, and their type rules.

Each family's router module (Mixtral, Qwen3-MoE, DeepSeek-V3 with its selection bias and group
limit, gpt-oss, Llama 4) is built from the zoo's tiny config with random weights and run on
random tokens; `MoERouter` on the same logits must route every token to the same experts with
the same weights (tolerance 1e-6: both compute in float32). Dispatch and combine are checked
against a plain loop over the routed (token, expert) pairs: the sparse computation they stand for.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aviatorc import zoo
from aviatorc.errors import ModelFormatError
from aviatorc.ir import Graph, TensorType, add_value, evaluate
from aviatorc.ir.ops import infer_types

TOKENS = 64


def _transformers_router(arch: str) -> tuple[torch.nn.Module, dict, bool]:
    """(router module, our attributes, whether it returns dense scores)."""
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.llama4.modeling_llama4 import Llama4Router
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    fields = {k: v for k, v in zoo.family_config(arch).items() if k not in ("model_type", "architectures")}
    cfg = transformers.AutoConfig.for_model(arch, **fields)
    classes = {"mixtral": MixtralTopKRouter, "qwen3_moe": Qwen3MoeTopKRouter, "deepseek_v3": DeepseekV3TopkRouter,
               "gpt_oss": GptOssTopKRouter, "llama4_text": Llama4Router}
    attrs = {
        "mixtral": {"score": "softmax", "top_k": 2, "normalize": 1},
        "qwen3_moe": {"score": "softmax", "top_k": 2, "normalize": 1},
        "deepseek_v3": {"score": "sigmoid", "top_k": 2, "n_group": 2, "topk_group": 1, "normalize": 1,
                        "normalize_epsilon": 1e-20, "scale": 2.5},
        "gpt_oss": {"score": "softmax", "select": "logits", "top_k": 2},
        "llama4_text": {"score": "sigmoid", "select": "logits", "top_k": 1},
    }[arch]
    module = classes[arch](cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
        for b in module.buffers():
            b.copy_(torch.randn(b.shape, generator=gen) * 0.3)
    return module.eval(), attrs, arch == "llama4_text"


def _route(logits: np.ndarray, attrs: dict, bias: np.ndarray | None = None) -> np.ndarray:
    g = Graph()
    x = g.add_input("logits", TensorType("float32", ("tokens", logits.shape[1])))
    inputs = [x] + ([g.add_constant(bias, "bias")] if bias is not None else [])
    g.outputs = [add_value(g, "MoERouter", inputs, attrs, name="route")]
    return evaluate(g, {"logits": logits})["route_out"]


@pytest.mark.parametrize("arch", zoo.MOE_ARCHS)
def test_router_matches_the_transformers_router(arch):
    module, attrs, dense = _transformers_router(arch)
    x = torch.randn(TOKENS, zoo.HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = module(x)
    if dense:  # Llama 4: (scores [T, E] with 0 for the unrouted, logits)
        want, logits = out[0].numpy(), out[1].numpy()
    else:
        logits, weights, indices = (t.numpy() for t in out)
        want = np.zeros_like(logits)
        np.put_along_axis(want, indices, weights, axis=-1)
    bias = next((b.numpy() for n, b in module.named_buffers() if n.endswith("e_score_correction_bias")), None)
    got = _route(logits.astype(np.float32), attrs, bias)
    np.testing.assert_array_equal(got != 0, want != 0)  # the same experts
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert ((got != 0).sum(axis=-1) == attrs["top_k"]).all()


def test_group_limit_keeps_to_the_best_groups():
    # 4 experts in 2 groups; the top-2 group score favours group 1 although expert 0 is the best
    logits = np.array([[5.0, -9.0, 2.0, 2.0]], np.float32)
    attrs = {"score": "sigmoid", "top_k": 2, "n_group": 2, "topk_group": 1}
    routed = _route(logits, attrs)
    assert (routed[0] != 0).tolist() == [False, False, True, True]
    plain = _route(logits, {"score": "sigmoid", "top_k": 2})
    assert (plain[0] != 0).tolist() == [True, False, True, False]


def test_the_bias_changes_the_choice_not_the_weight():
    logits = np.array([[1.0, 0.0, -1.0]], np.float32)
    bias = np.array([0.0, 0.0, 5.0], np.float32)
    routed = _route(logits, {"score": "sigmoid", "top_k": 1}, bias)
    assert routed[0, 2] == pytest.approx(1 / (1 + np.exp(1.0)), rel=1e-6) and routed[0, :2].tolist() == [0, 0]


def test_dispatch_and_combine_are_the_sparse_sum():
    rng = np.random.default_rng(0)
    tokens, hidden, experts = 6, 5, 4
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    logits = rng.standard_normal((tokens, experts)).astype(np.float32)
    w = rng.standard_normal((experts, hidden, hidden)).astype(np.float32)
    for scale_input in (0, 1):
        g = Graph()
        xv = g.add_input("x", TensorType("float32", (tokens, hidden)))
        lv = g.add_input("logits", TensorType("float32", (tokens, experts)))
        routing = add_value(g, "MoERouter", [lv], {"score": "softmax", "top_k": 2, "normalize": 1})
        acc = None
        for e in range(experts):
            xe = add_value(g, "MoEDispatch", [xv, routing], {"expert": e, "scale": scale_input})
            ye = add_value(g, "MatMul", [xe, g.add_constant(w[e], f"w{e}")])
            acc = add_value(g, "MoECombine", [routing, ye] + ([acc] if acc is not None else []),
                            {"expert": e, "scale": 1 - scale_input})
        g.outputs = [acc, routing]
        out = evaluate(g, {"x": x, "logits": logits})
        got, weights = out[acc.name], out[routing.name]
        want = np.zeros_like(x)
        for t, e in zip(*np.nonzero(weights)):  # only the routed pairs: the sparse computation
            want[t] += (x[t] * weights[t, e]) @ w[e] if scale_input else weights[t, e] * (x[t] @ w[e])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op, types, attrs, message", [
    ("MoERouter", [TensorType("float32", (3, 4))], {"score": "softmax", "top_k": 5}, r"top_k 5 is not in \[1, 4\]"),
    ("MoERouter", [TensorType("float32", (3, 6))], {"score": "sigmoid", "top_k": 2, "n_group": 4},
     "6 experts do not split into 4 groups"),
    ("MoERouter", [TensorType("float32", (3, 4))], {"score": "relu", "top_k": 1}, "router score 'relu'"),
    ("MoERouter", [TensorType("float32", (3, 4)), TensorType("float32", (5,))], {"score": "softmax", "top_k": 1},
     r"router bias \[5\] does not match 4 experts"),
    ("MoERouter", [TensorType("int64", (3, 4))], {"score": "softmax", "top_k": 1}, "floating point"),
    ("MoEDispatch", [TensorType("float32", (3, 8)), TensorType("float32", (3, 4))], {"expert": 4},
     r"expert 4 is not in \[0, 4\)"),
    ("MoEDispatch", [TensorType("float32", (2, 8)), TensorType("float32", (3, 4))], {"expert": 0},
     "do not have the same tokens"),
    ("MoECombine", [TensorType("float32", (3, 4)), TensorType("float32", (3, 8)), TensorType("float32", (3, 6))],
     {"expert": 1}, "partial sum"),
])
def test_type_rules_name_the_broken_constraint(op, types, attrs, message):
    with pytest.raises(ModelFormatError, match=message):
        infer_types(op, list(types), [None] * len(types), attrs)


def test_type_rules_keep_symbolic_tokens():
    routing = TensorType("float32", ("tokens", 8))
    assert infer_types("MoERouter", [routing], [None], {"score": "softmax", "top_k": 2}) == [routing]
    x = TensorType("float32", ("tokens", 32))
    assert infer_types("MoEDispatch", [x, routing], [None, None], {"expert": 7}) == [x]
    assert infer_types("MoECombine", [routing, x, x], [None] * 3, {"expert": 0}) == [x]
