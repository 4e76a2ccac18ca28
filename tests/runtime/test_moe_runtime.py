"""The sim runtime runs a mixture of experts as routed (issue 22): only the experts some token is
routed to compute and load, and pre-gating's hit rate is measured on the run.

The tiny Qwen3-MoE (2 layers of 8 experts, top-2) on the mock target with 64 KiB chiplets and an
LPDDR channel per chiplet, so that some experts stream. The references are the `transformers`
model's own gates: which experts its routers choose for each token, and which experts layer 1's
router would choose on the hidden state layer 0's router saw (pre-gating)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import aviatorc
from aviatorc import zoo
from aviatorc.ir.experts import expert_nodes
from aviatorc.plan.ir import Load
from aviatorc.runtime import Session
from aviatorc.target import load_target
from tests.zoo_fixtures import transformers_greedy

TIGHT = {"chiplet.sram_bytes": 65536, "card.lpddr_attach": "chiplet"}
PROMPT, NEW_TOKENS, TOP_K = 8, 16, 2


@pytest.fixture(scope="module")
def model():
    return zoo.build_family_model("qwen3_moe")


def compiled(model, sram_bytes: int = TIGHT["chiplet.sram_bytes"], **options) -> Session:
    target = load_target("mock", overrides={**TIGHT, "chiplet.sram_bytes": sram_bytes})
    art = aviatorc.compile(model, target=target, context=PROMPT + NEW_TOKENS,
                           prompt=PROMPT, batch=1, routing="zipf:1.5", time_limit_s=1.0, sweep=False, ranges=False,
                           **options)
    return Session(art, device="sim")


@pytest.fixture(scope="module")
def session(model):
    return compiled(model)


def gate_inputs(model, ids: np.ndarray) -> list[torch.Tensor]:
    """The hidden state entering each layer's router, one row per token of `ids`."""
    seen: dict[int, torch.Tensor] = {}
    gates = [layer.mlp.gate for layer in model.model.layers]
    handles = [gate.register_forward_hook(lambda mod, args, out, i=i: seen.__setitem__(i, args[0].detach()))
               for i, gate in enumerate(gates)]
    with torch.no_grad():
        model(input_ids=torch.from_numpy(ids)[None], use_cache=False)
    for handle in handles:
        handle.remove()
    return [seen[i].reshape(-1, seen[i].shape[-1]) for i in range(len(gates))]


def chosen(model, layer: int, x: torch.Tensor) -> np.ndarray:
    """[tokens, experts]: the experts layer `layer`'s router chooses for the rows of x."""
    logits = torch.nn.functional.linear(x, model.model.layers[layer].mlp.gate.weight)
    top = torch.topk(torch.softmax(logits, dim=-1), TOP_K, dim=-1).indices.numpy()
    mask = np.zeros((x.shape[0], logits.shape[-1]), dtype=bool)
    np.put_along_axis(mask, top, True, axis=1)
    return mask


def expert_load_bytes(session) -> tuple[int, dict[tuple[int, int], int]]:
    """From the decode program's loads: the bytes of loads of no expert, and per (layer, expert)."""
    program, plan = session.artifact.programs["decode"], session.artifact.plan
    expert_of = {node.name: ref.expert for node, ref in expert_nodes(session.graph).items()}
    others, experts = 0, {}
    for _, _, ins in program.instructions():
        if not isinstance(ins, Load):
            continue
        tile = plan.tiles[program.buffers[ins.buf].tile]
        expert = next((expert_of[n] for n in tile.nodes if n in expert_of), None)
        if expert is None:
            others += ins.bytes
        else:
            experts[(tile.layer, expert)] = experts.get((tile.layer, expert), 0) + ins.bytes
    return others, experts


def test_some_experts_stream(session):
    _, experts = expert_load_bytes(session)
    assert {layer for layer, _ in experts} == {0, 1} and len(experts) < 16  # streamed ones in each layer, not all


def test_greedy_generation_with_routed_experts_equals_transformers(model, session):
    prompt = np.random.default_rng(0).integers(3, zoo.VOCAB_SIZE, PROMPT)
    ours = session.generate(prompt, NEW_TOKENS)
    np.testing.assert_array_equal(ours, transformers_greedy(model, prompt, NEW_TOKENS))
    decode = session.experts["decode"]
    assert decode.runs == NEW_TOKENS - 1 and decode.ran == TOP_K * decode.blocks  # one token: top-2 of 8 a block


@pytest.mark.parametrize("quant", [None, "int8"])
def test_a_decode_step_loads_only_the_experts_its_token_is_routed_to(model, session, quant):
    """Quantized, an expert's tiles hold its weight's codes (read through a DequantizeWeight)."""
    session = session if quant is None else compiled(model, 16 * 1024, quant=quant)  # int8: a quarter of the bytes
    others, per_expert = expert_load_bytes(session)
    tokens = np.random.default_rng(1).integers(3, zoo.VOCAB_SIZE, PROMPT + 3)
    session.prefill(0, tokens[:PROMPT])
    inputs = gate_inputs(model, tokens)
    try:
        for position in range(PROMPT, len(tokens)):
            session.decode([0], [int(tokens[position])])
            routed = {(layer, int(e)) for layer, x in enumerate(inputs)
                      for e in np.flatnonzero(chosen(model, layer, x[position : position + 1])[0])}
            assert session.stats.bytes_loaded == others + sum(per_expert.get(key, 0) for key in routed)
            assert session.stats.bytes_loaded < others + sum(per_expert.values())
    finally:
        session.free(0)


def test_the_runtime_measures_pre_gating_as_transformers_gates_give_it(model, session):
    """The prefill's hits: layer 1's router on layer 0's router input names what layer 1 then routes."""
    tokens = np.random.default_rng(2).integers(3, zoo.VOCAB_SIZE, PROMPT)
    session.experts.clear()
    session.prefill(0, tokens)
    session.free(0)
    inputs = gate_inputs(model, tokens)
    predicted, actual = chosen(model, 1, inputs[0]), chosen(model, 1, inputs[1])
    tally = session.experts["prefill"]
    assert (tally.routed, tally.hits) == (int(actual.sum()), int((predicted & actual).sum()))
    assert tally.ran == int(chosen(model, 0, inputs[0]).any(axis=0).sum() + actual.any(axis=0).sum())


def test_a_run_that_computes_as_it_walks_skips_the_same_experts(session):
    """replay=False (as the cuda and rank backends run): the gate is decided during the walk."""
    prompt = np.random.default_rng(4).integers(3, zoo.VOCAB_SIZE, PROMPT)
    walking = Session(session.artifact, device="sim", replay=False)
    session.experts.clear()
    np.testing.assert_array_equal(walking.generate(prompt, 6), session.generate(prompt, 6))
    assert walking.experts == session.experts
    assert walking.stats.bytes_loaded == session.stats.bytes_loaded


def test_aviatorc_generate_says_how_many_experts_ran_and_the_hit_rate(session, tmp_path, capsys):
    from aviatorc.cli import main

    path = session.artifact.path
    prompt = np.random.default_rng(5).integers(3, zoo.VOCAB_SIZE, PROMPT)
    assert main(["generate", str(path), "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "8"]) == 0
    err = capsys.readouterr().err
    again = Session(path, device="sim")
    again.generate(prompt, 8, eos_token_id=again.eos_token_ids)
    decode = again.experts["decode"]
    assert f"experts: a decode step ran {TOP_K:.1f} of 8 a block" in err  # one token: its top-2 of 8
    assert f"pre-gating one block ahead named {decode.hit_rate:.0%} of them" in err
