"""Routing statistics of a mixture of experts (aviatorc/routing.py): shares, sampling, sources."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch

from aviatorc import zoo
from aviatorc.errors import ModelFormatError, OptionError
from aviatorc.frontends.torch import import_hf_config
from aviatorc.frontends.torch.hf import build_meta_model
from aviatorc.partition.weights import weights_from_graph
from aviatorc.routing import (
    BlockRouting,
    MoEBlock,
    Routing,
    capped_shares,
    measure_prediction,
    measure_routing,
    moe_blocks,
    routing_for,
)

BLOCKS = [MoEBlock("router0", 0, 8, 2), MoEBlock("router1", 3, 8, 2)]


def test_capped_shares_sum_to_top_k_and_none_is_above_one():
    shares = capped_shares([100.0, 1.0, 1.0, 2.0], 2)
    assert sum(shares) == pytest.approx(2.0)
    assert shares[0] == 1.0  # a token picks an expert once: its excess goes to the others in proportion
    assert shares[1:] == pytest.approx((0.25, 0.25, 0.5))
    with pytest.raises(ValueError):
        capped_shares([1.0, 0.0, 0.0], 2)  # two experts a token must pick, one that ever fires


def test_sampling_picks_top_k_distinct_experts_with_the_shares_as_probabilities():
    block = routing_for("zipf:1.2", BLOCKS).blocks[0]
    rng = np.random.default_rng(1)
    tokens = 20_000
    counts = block.sample(rng, tokens)
    assert counts.sum() == tokens * block.top_k
    assert np.abs(counts / tokens - np.asarray(block.shares)).max() < 0.015  # 3 sigma of 20k draws is 0.011
    # one token: exactly top_k distinct experts
    for _ in range(50):
        one = block.sample(rng, 1)
        assert one.sum() == 2 and one.max() == 1


def test_the_probability_a_step_fires_an_expert_matches_sampled_steps():
    block = BlockRouting(0, 2, capped_shares([8, 4, 2, 1, 1, 1, 1, 1], 2))
    rng = np.random.default_rng(2)
    steps = np.array([block.sample(rng, 4) > 0 for _ in range(4000)])
    for e in range(block.experts):
        assert steps[:, e].mean() == pytest.approx(block.fires(e, 4), abs=0.03)
    assert steps.sum(axis=1).mean() == pytest.approx(block.expected_active(4), abs=0.05)
    assert block.expected_active(1) == pytest.approx(2.0)  # one token reads top_k experts


def test_zipf_ranks_differ_by_layer_and_decay_with_the_exponent():
    routing = routing_for("zipf:1.5", BLOCKS)
    first, second = (np.asarray(b.shares) for b in routing.blocks)
    assert sorted(first) == pytest.approx(sorted(second))  # the same law...
    assert np.argmax(first) != np.argmax(second) or not np.allclose(first, second)  # ...on other experts
    flat = routing_for("zipf:0", BLOCKS).blocks[0].shares
    assert flat == pytest.approx(routing_for("uniform", BLOCKS).blocks[0].shares)


def test_a_routing_file_round_trips_through_the_report_form(tmp_path):
    routing = routing_for("zipf:1.1", BLOCKS)
    path = tmp_path / "routing.json"
    path.write_text(json.dumps(routing.to_dict()))
    again = routing_for(str(path), BLOCKS)
    for a, b in zip(routing.blocks, again.blocks, strict=True):
        assert a.shares == pytest.approx(b.shares, abs=1e-5)
    counts = tmp_path / "counts.json"  # plain counts per expert are scaled to top_k
    counts.write_text(json.dumps({"layers": {"0": [3, 1, 0, 0, 0, 0, 0, 0], "3": [1] * 8}}))
    read = routing_for(str(counts), BLOCKS)
    assert read.blocks[0].shares[:2] == pytest.approx((1.0, 1.0)) and sum(read.blocks[0].shares) == pytest.approx(2)
    assert read.source == "file:counts.json"


@pytest.mark.parametrize("text, message", [
    ('{"layers": {"0": [1, 1, 1, 1, 1, 1, 1, 1]}}', "no routing for MoE layer 3"),
    ('{"layers": {"0": [1, 1], "3": [1, 1]}}', "layer 0 must give 8 numbers"),
    ('[1, 2]', "an object with 'layers'"),
    ('{"layers": {', "not JSON"),
    ('{"layers": {"0": {"sets": [[[0, 0], 1]]}, "3": [1] * 8}}'.replace("[1] * 8", "[1, 1, 1, 1, 1, 1, 1, 1]"),
     r"layer 0 sets\[0\] must be \[\[2 distinct experts"),
    ('{"layers": {"0": {"sets": [[[0, 9], 1]]}, "3": [1, 1, 1, 1, 1, 1, 1, 1]}}', r"of 0..7\], a frequency"),
    ('{"layers": {"0": {"sets": [[[0, 1], -1]]}, "3": [1, 1, 1, 1, 1, 1, 1, 1]}}', "a frequency above 0"),
    ('{"layers": {"0": {"sets": []}, "3": [1, 1, 1, 1, 1, 1, 1, 1]}}', "non-empty list"),
])
def test_a_bad_routing_file_is_refused_naming_the_file_and_what_is_wrong(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ModelFormatError, match=message) as error:
        routing_for(str(path), BLOCKS)
    assert "bad.json" in str(error.value)


def test_experts_that_co_fire_are_sampled_together_and_round_trip_through_a_file(tmp_path):
    """A block whose tokens always pick the pairs (0, 4), (1, 5), (2, 6), (3, 7), 0 and 4 most:
    sampled steps route to both of a pair or neither, at the pairs' frequencies, and fire_together
    agrees; the shares are the sets'; the report form writes the sets and reads them back."""
    pairs = [((0, 4), 4.0), ((1, 5), 2.0), ((2, 6), 1.0), ((3, 7), 1.0)]
    block = BlockRouting.from_sets(0, 2, 8, pairs)
    assert block.shares == pytest.approx((0.5, 0.25, 0.125, 0.125) * 2)
    rng = np.random.default_rng(3)
    steps = np.array([block.sample(rng, 2) > 0 for _ in range(4000)])
    assert np.array_equal(steps[:, :4], steps[:, 4:])  # a pair fires whole or not at all
    assert steps[:, 0].mean() == pytest.approx(block.fires(0, 2), abs=0.03)
    together = (steps[:, 0] & steps[:, 1]).mean()
    assert together == pytest.approx(block.fire_together(0, 1, 2), abs=0.03)
    assert block.fire_together(0, 4, 2) == pytest.approx(block.fires(0, 2))  # always with its partner
    apart = BlockRouting(0, 2, block.shares)  # the same shares, choices independent
    assert apart.fire_together(1, 5, 2) < 0.5 * block.fire_together(1, 5, 2)
    routing = Routing("test", (block, routing_for("uniform", BLOCKS).blocks[1]))
    path = tmp_path / "sets.json"
    path.write_text(json.dumps(routing.to_dict()))
    again = routing_for(str(path), BLOCKS)
    assert again.blocks[0].sets == block.sets and again.blocks[0].shares == pytest.approx(block.shares)
    assert again.blocks[1].sets == ()


@pytest.mark.parametrize("spec", ["zipf:x", "zipf:-1", "normal", "missing.json"])
def test_an_unknown_routing_is_an_option_error(spec):
    with pytest.raises(OptionError):
        routing_for(spec, BLOCKS)


def test_measured_routing_counts_the_experts_transformers_routes_to(tmp_path):
    """Against the transformers model's own router logits (top-k of their softmax), per layer."""
    path = zoo.write_family_config("qwen3_moe", tmp_path)
    graph = import_hf_config(path, shape_only=False)
    model = build_meta_model(zoo.family_config("qwen3_moe"), on_meta=False)
    tokens = np.random.default_rng(0).integers(3, zoo.VOCAB_SIZE, (2, 9))
    blocks = moe_blocks(graph, weights_from_graph(graph))
    assert [(b.layer, b.experts, b.top_k) for b in blocks] == [(0, 8, 2), (1, 8, 2)]
    measured = measure_routing(graph, blocks, [{"input_ids": tokens}])
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(tokens), use_cache=False, output_router_logits=True)
    for block, logits in zip(measured.blocks, out.router_logits, strict=True):
        chosen = torch.topk(torch.softmax(logits.float(), dim=-1), 2, dim=-1).indices.numpy()
        want = np.bincount(chosen.ravel(), minlength=8) / chosen.shape[0]
        floor = 0.01 * 2 / 8  # an expert no token reached keeps a hundredth of a uniform share
        got = np.asarray(block.shares)
        assert np.abs(got - np.maximum(want, floor) * 2 / np.maximum(want, floor).sum()).max() < 1e-9
    assert measured.source == "measured on 18 calibration tokens"
    # Enough tokens that each expert is reached: the sets the routers chose are kept, exactly.
    tokens = np.random.default_rng(1).integers(3, zoo.VOCAB_SIZE, (4, 32))
    measured = measure_routing(graph, blocks, [{"input_ids": tokens}])
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(tokens), use_cache=False, output_router_logits=True)
    for block, logits in zip(measured.blocks, out.router_logits, strict=True):
        chosen = torch.topk(torch.softmax(logits.float(), dim=-1), 2, dim=-1).indices.numpy()
        want = Counter(tuple(sorted(int(e) for e in row)) for row in chosen)
        assert {s: f * len(chosen) for s, f in block.sets} == pytest.approx(dict(want))


def test_the_measured_prediction_hit_rate_is_transformers_own_routers_one_block_ahead(tmp_path):
    """Pre-gating on the tiny Qwen3-MoE: layer 1's router on the hidden state layer 0's router saw,
    against layer 1's router on its own, recomputed with the transformers model's gates."""
    path = zoo.write_family_config("qwen3_moe", tmp_path)
    graph = import_hf_config(path, shape_only=False)
    model = build_meta_model(zoo.family_config("qwen3_moe"), on_meta=False)
    tokens = np.random.default_rng(3).integers(3, zoo.VOCAB_SIZE, (3, 11))
    (hits,) = measure_prediction(graph, moe_blocks(graph, weights_from_graph(graph)), [{"input_ids": tokens}])
    seen: dict[int, torch.Tensor] = {}
    gates = [layer.mlp.gate for layer in model.model.layers]
    handles = [gate.register_forward_hook(lambda mod, args, out, i=i: seen.__setitem__(i, args[0].detach()))
               for i, gate in enumerate(gates)]
    with torch.no_grad():
        model(input_ids=torch.from_numpy(tokens), use_cache=False)
        for handle in handles:
            handle.remove()

        def chosen(x: torch.Tensor) -> set[tuple[int, int]]:
            logits = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), gates[1].weight)
            top = torch.topk(torch.softmax(logits, dim=-1), 2, dim=-1).indices
            return {(row, int(e)) for row in range(top.shape[0]) for e in top[row]}

        predicted, actual = chosen(seen[0]), chosen(seen[1])
    assert hits.layer == 1
    assert hits.hit_rate == pytest.approx(len(predicted & actual) / len(actual))
    assert 0.0 < hits.chance < hits.hit_rate  # random weights, yet one block ahead names most experts
