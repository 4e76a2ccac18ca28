"""Small graphs for the quantization tests: an embedding, two linear layers, an lm-head."""

from __future__ import annotations

import numpy as np

from aviatorc.ir import ArrayData, Graph, ShapeOnly, TensorType, add_value


def correlated_inputs(rng: np.random.Generator, rows: int, k: int) -> np.ndarray:
    """Activations with correlated channels and uneven channel scales, as real layers see."""
    mix = rng.standard_normal((k, k)) * 0.3 + np.eye(k)
    return ((rng.standard_normal((rows, k)) @ mix) * np.exp(rng.standard_normal(k) * 0.7)).astype(np.float32)


def tiny_lm(vocab: int = 96, d: int = 64, hidden: int = 128, shape_only: bool = False, seed: int = 0) -> Graph:
    """ids -> embed (Gather) -> up (MatMul) -> Gelu -> down (MatMul) -> lm_head (MatMul) -> logits."""
    rng = np.random.default_rng(seed)
    g = Graph("tiny_lm")
    ids = g.add_input("input_ids", TensorType("int64", ("batch", "seq")))

    def weight(name: str, shape: tuple[int, int], scale: float):
        t = TensorType("float32", shape)
        if shape_only:
            return g.add_initializer(name, t, ShapeOnly())
        return g.add_initializer(name, t, ArrayData((rng.standard_normal(shape) * scale).astype(np.float32)))

    table = weight("embed.weight", (vocab, d), 1.0)
    up = weight("mlp.up.weight", (d, hidden), d**-0.5)
    down = weight("mlp.down.weight", (hidden, d), hidden**-0.5)
    head = weight("lm_head.weight", (d, vocab), d**-0.5)
    h = add_value(g, "Gather", [table, ids], {"axis": 0}, name="embed")
    u = add_value(g, "MatMul", [h, up], name="mlp.up")
    a = add_value(g, "Gelu", [u], name="mlp.act")
    dn = add_value(g, "MatMul", [a, down], name="mlp.down")
    r = add_value(g, "Add", [h, dn], name="residual")
    logits = add_value(g, "MatMul", [r, head], name="lm_head", output_names=["logits"])
    g.outputs = [logits]
    return g


def lm_batches(n: int = 4, batch: int = 2, seq: int = 16, vocab: int = 96, seed: int = 1) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(0, vocab, (batch, seq)).astype(np.int64)} for _ in range(n)]


def single_linear(k: int, n: int, w: np.ndarray | None = None, shape_only: bool = False) -> Graph:
    """x [batch, k] -> MatMul(x, W [k, n])."""
    g = Graph("linear")
    x = g.add_input("x", TensorType("float32", ("batch", k)))
    t = TensorType("float32", (k, n))
    wv = g.add_initializer("w", t, ShapeOnly() if shape_only else ArrayData(np.asarray(w, np.float32)))
    g.outputs = [add_value(g, "MatMul", [x, wv], name="linear", output_names=["y"])]
    return g


def tiny_encoder(layers: int = 2, d: int = 32, hidden: int = 64, heads: int = 2, seed: int = 0) -> Graph:
    """x [batch, seq, d] -> `layers` pre-norm blocks (q/k/v, Attention, o, residual; up, Gelu,
    down, residual): four calibration stages per block, twelve nodes."""
    rng = np.random.default_rng(seed)
    g = Graph(f"tiny_encoder_{layers}")
    h = g.add_input("x", TensorType("float32", ("batch", "seq", d)))

    def weight(name: str, k: int, n: int):
        return g.add_initializer(name, TensorType("float32", (k, n)),
                                 ArrayData((rng.standard_normal((k, n)) * k**-0.5).astype(np.float32)))

    def norm(name: str, x):
        scale = g.add_initializer(f"{name}.scale", TensorType("float32", (d,)),
                                  ArrayData((1 + 0.1 * rng.standard_normal(d)).astype(np.float32)))
        return add_value(g, "LayerNormalization", [x, scale], name=name)

    for i in range(layers):
        p = f"layer{i}"
        n1 = norm(f"{p}.ln1", h)
        q, k, v = (add_value(g, "MatMul", [n1, weight(f"{p}.{w}.weight", d, d)], name=f"{p}.{w}") for w in "qkv")
        a = add_value(g, "Attention", [q, k, v], {"q_num_heads": heads, "kv_num_heads": heads}, name=f"{p}.attn")
        o = add_value(g, "MatMul", [a, weight(f"{p}.o.weight", d, d)], name=f"{p}.o")
        h = add_value(g, "Add", [h, o], name=f"{p}.res1")
        n2 = norm(f"{p}.ln2", h)
        u = add_value(g, "MatMul", [n2, weight(f"{p}.up.weight", d, hidden)], name=f"{p}.up")
        act = add_value(g, "Gelu", [u], name=f"{p}.act")
        dn = add_value(g, "MatMul", [act, weight(f"{p}.down.weight", hidden, d)], name=f"{p}.down")
        h = add_value(g, "Add", [h, dn], name=f"{p}.res2")
    g.outputs = [h]
    return g


def encoder_batches(n: int = 3, batch: int = 2, seq: int = 24, d: int = 32, seed: int = 1) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": correlated_inputs(rng, batch * seq, d).reshape(batch, seq, d)} for _ in range(n)]


def shared_weight(seed: int = 3) -> Graph:
    """A weight read by two MatMuls at different depths, so its stage (the later one) comes after
    a node that already read it: x -> first(S) -> Gelu -> mid(A) -> Gelu -> again(S) -> + -> last(B)."""
    rng = np.random.default_rng(seed)
    g = Graph("shared_weight")
    x = g.add_input("x", TensorType("float32", ("batch", 32)))

    def weight(name: str):
        return g.add_initializer(name, TensorType("float32", (32, 32)),
                                 ArrayData((rng.standard_normal((32, 32)) / 32**0.5).astype(np.float32)))

    s, a, b = weight("shared"), weight("a"), weight("b")
    h0 = add_value(g, "Gelu", [add_value(g, "MatMul", [x, s], name="first")], name="act0")
    h1 = add_value(g, "Gelu", [add_value(g, "MatMul", [h0, a], name="mid")], name="act1")
    r = add_value(g, "Add", [add_value(g, "MatMul", [h1, s], name="again"), h0], name="res")
    g.outputs = [add_value(g, "MatMul", [r, b], name="last", output_names=["y"])]
    return g
