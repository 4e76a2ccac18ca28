"""The pipelined prefill (aviatorc/schedule/memory.py: `prefill_copies`): on a plan over several
cards, each layer's prefill runs on its home's card, reading its streamed tiles from a copy in
that card's LPDDR, so a pass's activations stay on the card; `auto` takes it where the workload's
prefill and decode steps take less time with it.

One shape-only Llama-like config (4 layers, hidden 2048) on 8 chiplets of a 2-card `corsair` (4 a
card) with 12 MiB of SRAM each, so that most of its weights stream; every figure comes from the
compile. The sim numerics use a random tiny Llama from `transformers` on a 2-card `mock`."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aviatorc
from aviatorc.errors import InfeasibleError, ModelFormatError
from aviatorc.models import llama_config
from aviatorc.plan.check import PlanCheckError, check_plan
from aviatorc.plan.ir import Load, Program, Send
from aviatorc.plan.plan import Plan
from aviatorc.runtime import Session
from aviatorc.schedule import memory as memory_module
from aviatorc.target import load_target

CONFIG = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 4, "num_attention_heads": 16,
          "num_key_value_heads": 4, "vocab_size": 8000, "bos_token_id": 1, "eos_token_id": 2}
CHIPLETS = (0, 1, 2, 3, 8, 9, 10, 11)  # 4 on each of 2 cards


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("pipelined")
    (folder / "config.json").write_text(json.dumps(llama_config("llama-3-8b") | CONFIG))
    target = load_target("corsair", cards=2, overrides={"chiplet.sram_bytes": 12 * 2**20})
    (folder / "target.toml").write_text(target.to_toml())
    return folder / "config.json", folder / "target.toml"


@pytest.fixture(scope="module")
def plans(setup: tuple[Path, Path]) -> dict[tuple[int, str], aviatorc.CompileResult]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(memory_module, "PIPELINE_BLOCK_TOKENS", 64)
        return {(batch, schedule): aviatorc.compile(str(setup[0]), target=str(setup[1]), quant="int4", batch=batch,
                                                    context=512, prompt=128, chiplets=CHIPLETS, sweep=False,
                                                    ranges=False, prefill=schedule)
                for batch in (1, 16) for schedule in ("auto", "stationary", "pipelined")}


def card_bytes(program: Program, target: Any) -> int:
    """Bytes the program sends from one card to another."""
    return sum(ins.bytes for c, _, ins in program.instructions()
               if isinstance(ins, Send) and target.card_of(c) != target.card_of(ins.to))


def whole_s(result: aviatorc.CompileResult) -> float:
    """The compiled workload's time: its prefill, then decode steps up to the context."""
    p, load = result.plan.prediction, result.plan.workload
    return p.ttft_s + (load.context - load.prompt) * p.time_per_token_s


def test_auto_takes_the_prefill_that_serves_the_workload_sooner(plans, setup):
    """16 prompts of 128 tokens: the pipelined prefill's TTFT is measurably lower (simulated, in one
    compile each), but its staging slows each decode step, and the 384 steps up to the context
    cost more than it saves: auto keeps the stationary prefill. Compiled for 16 steps past the
    prompt, the pipelined prefill serves the workload sooner and auto takes it. One prompt: its
    cards in turn cost more than the few activations it saves."""
    ttft = {key: result.plan.prediction.ttft_s for key, result in plans.items()}
    assert ttft[(16, "pipelined")] < 0.85 * ttft[(16, "stationary")]
    assert ttft[(1, "pipelined")] > ttft[(1, "stationary")]
    token = {key: result.plan.prediction.time_per_token_s for key, result in plans.items()}
    assert token[(16, "pipelined")] > 1.05 * token[(16, "stationary")]
    short = {schedule: aviatorc.compile(str(setup[0]), target=str(setup[1]), quant="int4", batch=16, context=144,
                                        prompt=128, chiplets=CHIPLETS, sweep=False, ranges=False, prefill=schedule,
                                        kv_cache="lpddr") for schedule in ("auto", "stationary", "pipelined")}
    for compiled in [{s: plans[(batch, s)] for s in ("auto", "stationary", "pipelined")} for batch in (1, 16)] + [short]:
        assert whole_s(compiled["auto"]) == min(whole_s(compiled["stationary"]), whole_s(compiled["pipelined"]))
    assert short["auto"].plan.memory.prefill_copies
    assert not plans[(16, "auto")].plan.memory.prefill_copies and not plans[(1, "auto")].plan.memory.prefill_copies


def test_auto_falls_back_to_the_stationary_prefill_where_the_pipelined_one_cannot_fit(setup, tmp_path, monkeypatch):
    """With 8 MiB a chiplet, a card's share of a layer (a quarter of it here) does not fit beside the
    caches: `--prefill pipelined` is refused with the SRAM it needs, and auto, which estimates the
    pipelined prefill pays at this batch, plans the stationary one instead of failing."""
    monkeypatch.setattr(memory_module, "PIPELINE_BLOCK_TOKENS", 64)
    target = tmp_path / "small.toml"
    target.write_text(load_target("corsair", cards=2, overrides={"chiplet.sram_bytes": 8 * 2**20}).to_toml())

    def compile_with(prefill: str) -> aviatorc.CompileResult:
        return aviatorc.compile(str(setup[0]), target=str(target), quant="int4", batch=16, context=512, prompt=128,
                                chiplets=CHIPLETS, sweep=False, ranges=False, prefill=prefill)

    with pytest.raises(InfeasibleError, match="weight staging"):
        compile_with("pipelined")
    assert not compile_with("auto").plan.memory.prefill_copies


def test_a_pipelined_prefill_reads_each_layer_on_its_homes_card(plans):
    """Every load of a layer's streamed tile in the prefill comes from a channel of its layer's
    home's card, into a chiplet of that card; the copies spread over the card's channels; the
    decode step reads the tiles where the plan placed them; and a pass sends far fewer bytes
    between cards than the stationary prefill."""
    result = plans[(16, "pipelined")]
    plan, target = result.plan, result.plan.target
    homes = plan.memory.kv_layer_chiplets
    prefill = plan.programs["prefill"]
    copied = Counter()
    layer_loads = 0
    for c, _, ins in prefill.instructions():
        tile = prefill.buffers[ins.buf].tile if isinstance(ins, Load) else None
        if tile is None or plan.tiles[tile].layer not in homes:
            continue
        layer_loads += 1
        card = target.card_of(homes[plan.tiles[tile].layer])
        assert target.card_of_channel(ins.channel) == card and target.card_of(c) == card
        if tile in plan.memory.prefill_copies:
            assert ins.channel != plan.tiles[tile].channel  # the copy, not the decode step's tile
            copied[ins.channel] += 1
    assert layer_loads > 50 and len(copied) == 8  # every channel of the 2 cards serves copies
    decode = plan.programs["decode"]
    for _, _, ins in decode.instructions():
        tile = decode.buffers[ins.buf].tile if isinstance(ins, Load) else None
        if tile is not None:
            assert ins.channel == plan.tiles[tile].channel
    stationary = plans[(16, "stationary")].plan.programs["prefill"]
    assert card_bytes(prefill, target) < 0.25 * card_bytes(stationary, target)


def test_each_copied_byte_is_loaded_once_per_pass(plans):
    """Each copied tile is loaded once per pass of the prompt, as a decode step loads it once (the
    2,048 prompt tokens here run in passes whose hand-off fits the SRAM)."""
    plan = plans[(16, "pipelined")].plan
    per_pass: Counter[int] = Counter()
    for _, _, ins in plan.programs["prefill"].instructions():
        tile = plan.programs["prefill"].buffers[ins.buf].tile if isinstance(ins, Load) else None
        if tile is not None:
            per_pass[tile] += ins.bytes
    copied = plan.memory.prefill_copies
    assert copied and all(per_pass[t] == plan.tiles[t].bytes for t in copied if plan.tiles[t].role != "lm_head")


def test_the_checker_and_the_plan_file_hold_the_copies(plans, setup):
    """The checker reads a prefill program against the copies (without them its loads come from
    channels that do not stream those tiles), plan.json keeps them, and a copy of a resident tile
    read back from a tampered plan.json is refused, naming the field."""
    plan = plans[(16, "pipelined")].plan
    target = load_target(str(setup[1]))
    check_plan(plan, target)
    with pytest.raises(PlanCheckError, match="streams tile .* but the plan streams it from channel"):
        check_plan(replace(plan, memory=replace(plan.memory, prefill_copies={})), target)
    data = plan.to_dict()
    assert Plan.from_dict(json.loads(json.dumps(data))).memory.prefill_copies == plan.memory.prefill_copies
    resident = next(t for t, tile in enumerate(plan.tiles) if tile.channel is None)
    data["memory"]["prefill_copies"][str(resident)] = CHIPLETS[0]
    with pytest.raises(ModelFormatError, match="prefill_copies"):
        Plan.from_dict(json.loads(json.dumps(data)))


def test_a_pipelined_prefill_runs_on_the_sim_as_the_stationary_one(tmp_path, monkeypatch):
    """A random tiny Llama on a 2-card `mock` whose SRAM makes layers stream: the sim runs the
    pipelined prefill (its copies loaded on the home's card) and gives the stationary plan's logits
    (1e-6: the same kernels on the same values) and greedy tokens."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(memory_module, "PIPELINE_BLOCK_TOKENS", 2)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    target = tmp_path / "mock2.toml"
    target.write_text(load_target("mock", cards=2, overrides={"chiplet.sram_bytes": 448 * 1024}).to_toml())
    plans = {schedule: aviatorc.compile(model, target=str(target), context=32, prompt=8, batch=4, prefill=schedule,
                                        sweep=False, ranges=False) for schedule in ("stationary", "pipelined")}
    assert len(plans["pipelined"].plan.memory.prefill_copies) > 10
    prompt = np.arange(3, 11)
    logits = {schedule: Session(result).prefill(0, prompt) for schedule, result in plans.items()}
    np.testing.assert_allclose(logits["pipelined"], logits["stationary"], rtol=0, atol=1e-6)
    tokens = {schedule: Session(result).generate(prompt, 8) for schedule, result in plans.items()}
    assert np.array_equal(tokens["pipelined"], tokens["stationary"])
