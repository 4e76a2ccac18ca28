"""Vector nodes run fused where one makes a value only the next reads, in the same layer
(`ModelFacts.vector_values`): that value never leaves the vector units, and a fused chain reads
each of its inputs once. The decode program's vector bytes are checked against what a fused
kernel moves, counted by hand from the model's sizes."""

from __future__ import annotations

import json

import pytest

import aviatorc
from aviatorc.models import llama_config
from aviatorc.plan.ir import Compute

HIDDEN, INTERMEDIATE, BATCH = 64, 128, 4
TINY = {"num_hidden_layers": 2, "vocab_size": 256, "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
        "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fusion")
    (folder / "config.json").write_text(json.dumps(llama_config("llama-3-8b") | TINY))
    art = aviatorc.compile(str(folder / "config.json"), target="mock", batch=BATCH, context=64, prompt=8,
                           sweep=False, ranges=False)
    charged: dict[str, int] = {}
    for _, _, ins in art.plan.programs["decode"].instructions():
        if isinstance(ins, Compute) and ins.part is None:
            charged[ins.node] = charged.get(ins.node, 0) + ins.vector_bytes
    return art.graph, charged


def test_silu_times_up_reads_gate_and_up_and_writes_the_product_once(compiled):
    graph, charged = compiled
    sigmoids = [node for node in graph.nodes if node.op == "Sigmoid"]
    assert len(sigmoids) == TINY["num_hidden_layers"]
    for sigmoid in sigmoids:
        silu = sigmoid.outputs[0].users[0]  # gate x sigmoid(gate)
        product = silu.outputs[0].users[0]  # silu x up
        assert silu.op == product.op == "Mul"
        moved = sum(charged[node.name] for node in (sigmoid, silu, product))
        assert moved == 3 * BATCH * INTERMEDIATE * 2  # gate, up, product: 16-bit activations


def test_an_rmsnorm_reads_its_input_and_writes_its_output_once(compiled):
    graph, charged = compiled
    means = [node for node in graph.nodes if node.op == "ReduceMean"]
    assert len(means) == 2 * TINY["num_hidden_layers"] + 1  # two a layer, and the final norm
    for mean in means:
        square = mean.inputs[0].producer
        assert square is not None and square.op == "Pow"
        chain, node = [square, mean], mean
        while not any(user.op == "MatMul" for user in node.outputs[0].users):
            node = node.outputs[0].users[0]  # add eps, sqrt, reciprocal, x * rsqrt, x weight
            chain.append(node)
        assert len(chain) == 7
        # its input (the residual stream, read by the norm and the next residual add) is written by
        # the node making it and read once by the norm; the normalized output written once
        assert sum(charged[n.name] for n in chain) == 2 * BATCH * HIDDEN * 2
        source = square.inputs[0].producer
        assert source is not None and len({u.name for u in square.inputs[0].users}) > 1
        if source.op == "Add":  # a residual add writes it (the first norm's comes from the lookup)
            assert charged[source.name] >= 3 * BATCH * HIDDEN * 2
