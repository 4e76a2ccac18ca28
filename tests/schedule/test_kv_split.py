"""A KV cache too large for SRAM under `kv_cache="auto"`: it streams from LPDDR, except the blocks
the SRAM the weights leave can hold (`aviatorc.schedule.memory.kv_in_free_sram`).

- Each decode step reads every layer's cache exactly once: what its SRAM parts hold plus what it
  streams is the layer's bytes, no block read twice or left out.
- The parts are whole blocks of the runtime's pool, its first ones, and the session's pool knows
  how many of its blocks are on chip.
- Keeping them pays: the step is faster than the same plan streaming its whole cache, and the
  plan's bound stays below it.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

import aviatorc
from aviatorc import zoo
from aviatorc.compiler import plan_summary
from aviatorc.errors import ModelFormatError
from aviatorc.models import llama_config
from aviatorc.plan.ir import Compute, Load, Recv, Send
from aviatorc.plan.plan import Plan
from aviatorc.runtime import Session
from aviatorc.schedule.memory import KVPlan, MemoryPlan, kv_in_free_sram
from aviatorc.target import load_target
from tests.zoo_fixtures import zoo_dir, zoo_onnx  # noqa: F401


def compile_llama(zoo_onnx, **options):  # noqa: F811
    # tiny llama on mock: 2 layers; at batch 32 x 2,048 positions its cache (8 MiB) outgrows a
    # quarter of the SRAM, and the SRAM the weights leave holds less than half of it
    return aviatorc.compile(str(zoo_onnx("llama")), target="mock", quant="int8", batch=32, context=2048,
                            sweep=False, ranges=False, **options)


def test_each_layer_reads_its_cache_once_part_from_sram_part_streamed(zoo_onnx):  # noqa: F811
    art = compile_llama(zoo_onnx)
    memory, program = art.plan.memory, art.plan.programs["decode"]
    assert memory.kv_location == "lpddr" and memory.kv_sram_blocks
    per_layer = memory.kv_bytes // len(memory.kv_layer_chiplets)
    for layer in memory.kv_layer_chiplets:
        in_sram = {b.chiplet: b.bytes for b in program.buffers.values() if b.kind == "kv" and b.layer == layer}
        streamed = sum(ins.bytes for _, _, ins in program.instructions()
                       if isinstance(ins, Load) and program.buffers[ins.buf].layer == layer)
        assert 0 < sum(in_sram.values()) < per_layer and streamed > 0
        assert sum(in_sram.values()) + streamed == per_layer
        # whole blocks of the pool, on the chiplets the plan names
        block = per_layer // memory.kv_blocks
        assert {c: n * block for c, n in memory.kv_sram_blocks[layer].items()} == in_sram


@pytest.mark.parametrize("cards", [1, 2])
def test_an_attention_part_away_from_home_receives_only_the_query(tmp_path, cards):
    """A part of the decode step's attention attends over the blocks of the cache it reads, so it
    needs the query; the new tokens' keys and values (written at home, beside the newest
    positions) and the mask go to the home alone, where the node completes. Its partial output is
    as wide as the query (every head of its positions), reduced on the way home: each chiplet
    sends one, each other card one across. A config.json imports attention as one node (its
    query, keys, values and mask its inputs)."""
    config = llama_config("llama-3-8b") | {"num_hidden_layers": 2, "vocab_size": 256, "hidden_size": 64,
                                           "intermediate_size": 128, "num_attention_heads": 4,
                                           "num_key_value_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    art = aviatorc.compile(str(tmp_path / "config.json"), target="mock", cards=cards, batch=32, context=2048,
                           sweep=False, ranges=False)
    program, card_of = art.plan.programs["decode"], art.plan.target.card_of
    parts: dict[str, set[int]] = {}
    home: dict[str, int] = {}
    for c, _, ins in program.instructions():
        if isinstance(ins, Compute) and ins.part is not None and ins.part.kind == "kv":
            parts.setdefault(ins.node, set()).add(c)
            if ins.part.start == ins.part.stop - 1:
                home[ins.node] = c
    received: dict[str, set[int]] = {}
    for c, _, ins in program.instructions():
        if isinstance(ins, Recv):
            received.setdefault(ins.value.name, set()).add(c)
    nodes = [node for node in art.graph.nodes if node.name in parts]
    assert len(nodes) == 2 and all(node.op == "Attention" and len(node.inputs) >= 4 for node in nodes)
    for node in nodes:
        away = parts[node.name] - {home[node.name]}
        assert away and away <= received[node.inputs[0].name]  # every part away from home gets the query ...
        own = [v.name for v in node.inputs[1:] if v is not None and all(u is node for u in v.users)]
        assert len(own) >= 2  # the new tokens' keys and values (the mask is every layer's)
        for name in own:  # ... and not them
            assert not received.get(name, set()) & away, (node.name, name)
        query_bytes = {ins.bytes for _, _, ins in program.instructions()
                       if isinstance(ins, Recv) and ins.value.name == node.inputs[0].name}
        partials = [(c, ins) for c, _, ins in program.instructions()
                    if isinstance(ins, Send) and ins.value.name == node.outputs[0].name]
        senders = [c for c, _ in partials]
        assert sorted(set(senders)) == sorted(senders) == sorted(away)
        assert {ins.bytes for _, ins in partials} == query_bytes
        crossing = [c for c, ins in partials if card_of(c) != card_of(ins.to)]
        assert len(crossing) == len({card_of(c) for c in away} - {card_of(home[node.name])}) == cards - 1


def test_keeping_blocks_in_sram_beats_streaming_them_all(zoo_onnx):  # noqa: F811
    split, streamed = compile_llama(zoo_onnx), compile_llama(zoo_onnx, kv_cache="lpddr")
    assert not streamed.plan.memory.kv_sram_blocks
    kept = split.plan.memory.kv_sram_positions / (split.plan.memory.kv_blocks * split.plan.memory.kv_block_tokens)
    assert 0.2 < kept < 0.8
    ratio = split.plan.prediction.time_per_token_s / streamed.plan.prediction.time_per_token_s
    assert ratio < 1 - kept / 2  # the streamed bytes fall by `kept`; the step by at least half as much
    assert split.plan.prediction.bound.token_s <= split.plan.prediction.time_per_token_s
    # the compile's summary says so, from plan.json's memory section
    lines = [line for line in plan_summary(split.plan.to_dict()) if line.startswith("SRAM: KV cache")]
    per_layer = [n / split.plan.memory.kv_blocks for n in
                 (sum(parts.values()) for parts in split.plan.memory.kv_sram_blocks.values())]
    assert f"in lpddr, {min(per_layer):.0%}" in lines[0] and "of each layer's blocks kept in SRAM" in lines[0]
    assert not any("kept in SRAM" in line for line in plan_summary(streamed.plan.to_dict()))


def test_the_sessions_pool_knows_which_blocks_are_on_chip():
    # the torch module: a graph with its KV cache as inputs, which a session pages
    model = zoo.build_model("llama").inner.eval()
    art, streamed = (aviatorc.compile(model, target="mock", batch=1024, context=64, prompt=8, sweep=False, ranges=False,
                                      time_limit_s=1.0, kv_cache=kv) for kv in ("auto", "lpddr"))
    memory = art.plan.memory
    # parts away from the layers' homes too; the sim backend runs the program's reads as planned
    assert any(set(parts) - {memory.kv_layer_chiplets[layer]} for layer, parts in memory.kv_sram_blocks.items())
    prompt = np.array([5, 9, 2])
    assert list(Session(art).generate(prompt, max_new_tokens=6, eos_token_id=())) == list(
        Session(streamed).generate(prompt, max_new_tokens=6, eos_token_id=()))
    session = Session(art, block_size=8)
    assert session.kv.sram_blocks == memory.kv_sram_positions // 8 < session.kv.num_blocks
    # the lowest free block goes first: a sequence's blocks are on chip while they last
    table: list[int] = []
    session.kv.reserve(table, 0, 8 * 3)
    assert session.kv.used_sram_blocks == 3
    out = session.generate(np.array([5, 9, 2]), max_new_tokens=4, eos_token_id=())
    assert len(out) == 7 and session.kv.used_sram_blocks == 3  # its blocks were given back
    session.kv.release(table)
    assert session.kv.used_sram_blocks == 0


def test_a_plan_naming_blocks_on_a_chiplet_it_lacks_is_refused(zoo_onnx, tmp_path):  # noqa: F811
    art = compile_llama(zoo_onnx)
    data = art.plan.to_dict()
    layer = next(iter(data["memory"]["kv_sram_blocks"]))
    data["memory"]["kv_sram_blocks"][layer] = {"999": 1}
    with pytest.raises(ModelFormatError, match="kv_sram_blocks"):
        Plan.from_dict(json.loads(json.dumps(data)))
    data["memory"]["kv_sram_blocks"][layer] = {str(art.plan.chiplets[0]): data["memory"]["kv_blocks"] + 1}
    with pytest.raises(ModelFormatError, match="kv_sram_blocks"):
        Plan.from_dict(json.loads(json.dumps(data)))
    data["schema_version"] = 8  # a field newer than the plan's schema
    with pytest.raises(ModelFormatError, match="schema version 9 field"):
        Plan.from_dict(json.loads(json.dumps(data)))


@pytest.mark.parametrize("home_room", [0, 64 << 10])
def test_the_attention_completes_at_home(home_room):
    """The decode step's attention ends where its last part is read, at the layer's home: a cache
    that would be kept whole in SRAM away from a home with no room streams its last block (read at
    home); with room at home it keeps its last part there."""
    target = load_target("mock")  # 4 chiplets of 1 MiB
    sram = target.chiplet.sram_bytes
    kv = KVPlan(dtype="fp16", location="lpddr", bytes_per_layer={0: 256 << 10}, chiplet_of_layer={0: 0},
                chunk_bytes=16 << 10, tokens=512, batch=2, block_tokens=16, free_sram=True)  # 64 blocks of 4 KiB
    memory = MemoryPlan(kv=kv, scratch_bytes=0, prefill_chunk_tokens=8, staging_bytes=0, stage_chunk_bytes=16 << 10,
                        reserve_bytes=(sram - home_room, 0, 0, 0))
    placed = SimpleNamespace(chiplet_bytes=(0, sram - (512 << 10), sram, sram))  # chiplet 1: 512 KiB free
    settled = kv_in_free_sram(memory, placed, target, range(4)).kv  # type: ignore[arg-type]
    parts = settled.sram_parts(0)
    if home_room:
        assert 0 in parts and settled.streamed_bytes(0) == 0 and sum(parts.values()) == 256 << 10
    else:
        assert set(parts) == {1} and settled.streamed_bytes(0) == settled.block_bytes(0)  # one block streams
    assert all(c in (0, 1) for c in parts)  # chiplets 2 and 3 have no room
