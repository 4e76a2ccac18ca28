"""accuracy_report on an encoder: hidden states [batch, seq, D] with token ids above D are not
logits, so no perplexity is computed (it used to index past D and fail)."""

from __future__ import annotations

import numpy as np

from aviatorc.accuracy import accuracy_report
from aviatorc.ir import ArrayData, Graph, TensorType, add_value


def encoder(vocab: int = 200, d: int = 8) -> Graph:
    g = Graph("encoder")
    ids = g.add_input("input_ids", TensorType("int64", ("batch", "seq")))
    table = g.add_initializer("embed", TensorType("float32", (vocab, d)),
                              ArrayData(np.random.default_rng(0).standard_normal((vocab, d)).astype(np.float32)))
    g.outputs = [add_value(g, "Gather", [table, ids], {"axis": 0}, name="embed_lookup", output_names=["hidden"])]
    return g


def test_hidden_states_get_no_perplexity() -> None:
    batches = [{"input_ids": np.array([[3, 150, 199]], np.int64)}]
    report = accuracy_report(encoder(), encoder(), batches)
    entry = report["end_to_end"][0]
    assert entry["cosine"] == 1.0 and "perplexity_reference" not in entry
