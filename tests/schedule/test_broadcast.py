"""A value read on several cards crosses to them as a binomial tree (`build._broadcast`): each
card with a reader receives one copy across, and no chiplet sends more copies across than the
tree's rounds, where a copy per card from the source would send one per card in turn."""

from __future__ import annotations

import json
import math

import aviatorc
from aviatorc.models import llama_config
from aviatorc.plan.ir import Recv, Send

TINY = {"num_hidden_layers": 2, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2}


def test_a_query_read_on_many_cards_crosses_to_them_as_a_tree(tmp_path):
    # a decode step's cache streamed in chunks over the channels of 4 cards: each attention's
    # query goes to every chiplet reading one
    (tmp_path / "config.json").write_text(json.dumps(llama_config("llama-3-8b") | TINY))
    art = aviatorc.compile(str(tmp_path / "config.json"), target="mock", cards=4, batch=32, context=2048,
                           kv_cache="lpddr", sweep=False, ranges=False)
    program, card_of = art.plan.programs["decode"], art.plan.target.card_of
    attention = [node for node in art.graph.nodes if node.op == "Attention"]
    assert attention
    for node in attention:
        query = node.inputs[0].name
        crossings = [(c, ins.to) for c, _, ins in program.instructions()
                     if isinstance(ins, Send) and ins.value.name == query and card_of(c) != card_of(ins.to)]
        readers = {c for c, _, ins in program.instructions() if isinstance(ins, Recv) and ins.value.name == query}
        cards = {card_of(c) for c in readers} | {card_of(c) for c, _ in crossings}
        assert len(cards) == 4, cards  # the tree has work to do: 2 rounds, not 3
        # each card but the source's receives exactly one copy across
        received = [card_of(to) for _, to in crossings]
        assert sorted(received) == sorted(set(received)) and len(received) == len(cards) - 1
        # no chiplet sends more copies across than the tree's rounds
        rounds = math.ceil(math.log2(len(cards)))
        per_sender: dict[int, int] = {}
        for c, _ in crossings:
            per_sender[c] = per_sender.get(c, 0) + 1
        assert max(per_sender.values()) <= rounds < len(cards) - 1
