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
