"""A KV cache kept in SRAM, read in parts beside its layer's home (`kv_split_in_sram`).

Reading a large layer's cache at one chiplet's SRAM speed is on every layer's critical path; its
blocks spread over the chiplets nearest the home are read at once, each part costing the query
out and a partial result back. The split is taken where it makes the attention sooner, and the
plan that has it still runs, token for token, on the sim backend.
"""

from __future__ import annotations

import json

import numpy as np

import aviatorc
from aviatorc.compiler import plan_summary
from aviatorc.models import llama_config
from aviatorc.plan.ir import Compute
from aviatorc.runtime import Session
from aviatorc.schedule import memory as memory_module

TINY = {"num_hidden_layers": 2, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2}


def compile_tiny(tmp_path, batch, context):
    (tmp_path / "config.json").write_text(json.dumps(llama_config("llama-3-8b") | TINY))
    return aviatorc.compile(str(tmp_path / "config.json"), target="mock", kv_cache="sram", batch=batch,
                            context=context, prompt=8, sweep=False, ranges=False)


def test_a_large_cache_in_sram_is_read_in_parts_beside_its_home(tmp_path, monkeypatch):
    # 8 sequences x 512 positions x 128 bytes: 512 KiB a layer, read at 1 TB/s in 0.5 us; a query and
    # a partial (8 x 64 x 2 bytes each) cross a die-to-die link in 10 ns
    art = compile_tiny(tmp_path, batch=8, context=512)
    memory, program, target = art.plan.memory, art.plan.programs["decode"], art.plan.target
    assert memory.kv_location == "sram" and set(memory.kv_sram_blocks) == set(memory.kv_layer_chiplets)
    per_layer = memory.kv_bytes // len(memory.kv_layer_chiplets)
    for layer, parts in memory.kv_sram_blocks.items():
        home = memory.kv_layer_chiplets[layer]
        assert len(parts) >= 2 and home in parts and sum(parts.values()) == memory.kv_blocks
        assert {target.card_of(c) for c in parts} == {target.card_of(home)}
        held = {b.chiplet: b.bytes for b in program.buffers.values() if b.kind == "kv" and b.layer == layer}
        assert set(held) == set(parts) and sum(held.values()) == per_layer
        read = {c: ins.bytes for c, _, ins in program.instructions() if isinstance(ins, Compute)
                and ins.part is not None and ins.part.kind == "kv" and program.buffers[ins.bufs[0]].layer == layer}
        assert read == held  # each part read once, where it is held
        last = [c for c, _, ins in program.instructions() if isinstance(ins, Compute) and ins.part is not None
                and ins.part.kind == "kv" and ins.part.start == ins.part.stop - 1
                and program.buffers[ins.bufs[0]].layer == layer]
        assert last == [home]
    line = next(line for line in plan_summary(art.plan.to_dict()) if line.startswith("SRAM: KV cache"))
    counts = sorted({len(parts) for parts in memory.kv_sram_blocks.values()})
    assert f"in sram, 2 of 2 layers' caches read in {counts[0]}" in line
    # the same placement with each cache whole at its home: a slower step
    monkeypatch.setattr(memory_module, "kv_split_in_sram", lambda memory, *args: memory)
    whole = compile_tiny(tmp_path, batch=8, context=512)
    assert not whole.plan.memory.kv_sram_blocks
    assert art.plan.prediction.time_per_token_s < whole.plan.prediction.time_per_token_s


def test_a_small_cache_stays_whole_at_home(tmp_path):
    # 1 sequence x 32 positions: 4 KiB a layer, read in 4 ns; a second part would save 2 ns and
    # cost 2.6 ns of messages
    art = compile_tiny(tmp_path, batch=1, context=32)
    memory, program = art.plan.memory, art.plan.programs["decode"]
    assert memory.kv_location == "sram" and not memory.kv_sram_blocks
    for layer, home in memory.kv_layer_chiplets.items():
        held = [b for b in program.buffers.values() if b.kind == "kv" and b.layer == layer]
        assert [(b.name, b.chiplet) for b in held] == [(f"kv.{layer}", home)]


def test_a_plan_reading_its_cache_in_parts_generates_the_same_tokens(monkeypatch):
    """The sim backend runs the parts as planned (each a read of its blocks, the node whole at the
    last, at home): the tokens equal those of the same model with each cache whole at home."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**TINY, max_position_embeddings=512, use_cache=False)
    model = transformers.LlamaForCausalLM(config).eval()

    def tokens():
        art = aviatorc.compile(model, target="mock", kv_cache="sram", batch=8, context=512, prompt=8, sweep=False,
                               ranges=False, time_limit_s=1.0)
        return art.plan.memory.kv_sram_blocks, list(Session(art).generate(np.array([5, 9, 2]), max_new_tokens=6,
                                                                          eos_token_id=()))

    split, split_tokens = tokens()
    monkeypatch.setattr(memory_module, "kv_split_in_sram", lambda memory, *args: memory)
    whole, whole_tokens = tokens()
    assert split and not whole
    assert split_tokens == whole_tokens
