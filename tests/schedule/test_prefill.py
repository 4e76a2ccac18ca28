"""The weight-stationary prefill (aviatorc/schedule/build.py, memory.py): every token block of a
pass runs through a layer while the layer's streamed tiles stay staged, so each streamed byte
crosses LPDDR once per pass, where the chunked schedule streamed it again for every chunk.

One shape-only Llama-like config (4 layers, hidden 2048) on 4 chiplets of `corsair` with 24 MiB
of SRAM each, so that most of its layers stream; every figure below comes from the compile. Its
256-token prompt is cut into the program's 4 pipeline blocks (`memory.PIPELINE_BLOCK_TOKENS` lowered to
64 here: by default a block has 256 tokens or more)."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aviatorc
from aviatorc import zoo
from aviatorc.errors import OptionError
from aviatorc.models import llama_config
from aviatorc.options import CompileOptions
from aviatorc.plan.check import check_plan
from aviatorc.plan.ir import Compute, Free, Load, Program, Send, block_of
from aviatorc.runtime import Session
from aviatorc.schedule import memory as memory_module
from aviatorc.schedule.model import layer_runs, model_facts
from aviatorc.schedule.simulate import simulate
from aviatorc.target import load_target

SRAM = 24 * 2**20
CONFIG = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 4, "num_attention_heads": 16,
          "num_key_value_heads": 4, "vocab_size": 8000, "bos_token_id": 1, "eos_token_id": 2}


@pytest.fixture(scope="module", autouse=True)
def small_blocks() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(memory_module, "PIPELINE_BLOCK_TOKENS", 64)
        yield


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("prefill")
    (folder / "config.json").write_text(json.dumps(llama_config("llama-3-8b") | CONFIG))
    (folder / "target.toml").write_text(load_target("corsair", overrides={"chiplet.sram_bytes": SRAM}).to_toml())
    return folder / "config.json", folder / "target.toml"


def compile_case(setup: tuple[Path, Path], batch: int = 2, **options: Any) -> aviatorc.CompileResult:
    config, target = setup
    return aviatorc.compile(str(config), target=str(target), quant="int4", batch=batch, context=512, prompt=128,
                            chiplets=(0, 1, 2, 3), sweep=False, ranges=False, **options)


@pytest.fixture(scope="module")
def plans(setup: tuple[Path, Path]) -> dict[str, aviatorc.CompileResult]:
    return {schedule: compile_case(setup, prefill=schedule) for schedule in ("stationary", "chunked")}


def loaded_bytes(program: Program) -> Counter[int]:
    """Bytes each weight tile's loads bring in over the program."""
    loaded: Counter[int] = Counter()
    for _, _, ins in program.instructions():
        tile = program.buffers[ins.buf].tile if isinstance(ins, Load) else None
        if tile is not None:
            loaded[tile] += ins.bytes
    return loaded


def streamed_layer_tiles(result: aviatorc.CompileResult) -> set[int]:
    """The streamed tiles of the layers (not the lookup table's rows, which each block reads on its own)."""
    return {t for t, tile in enumerate(result.plan.tiles) if tile.channel is not None and not tile.is_embedding}


def head_tiles(result: aviatorc.CompileResult) -> set[int]:
    """The output head's tiles: it runs once, in the last block (each sequence's last token)."""
    return {t for t, tile in enumerate(result.plan.tiles) if tile.role == "lm_head"}


def test_each_streamed_byte_is_loaded_once_per_prefill(plans):
    """Over the whole prefill (passes x the pass program), each streamed tile's bytes are loaded as
    often as one decode step loads them: once. The chunked schedule loads them once per chunk."""
    for schedule, result in plans.items():
        plan, prefill = result.plan, result.plan.prediction.prefill
        streamed = streamed_layer_tiles(result)
        assert len(streamed) > 20, "the case must stream its layers"
        once = loaded_bytes(plan.programs["decode"])
        per_pass = loaded_bytes(plan.programs["prefill"])
        whole_prefill = {t: prefill.chunks * per_pass[t] for t in streamed}
        if schedule == "stationary":
            assert prefill.chunks == 1 and plan.memory.prefill_block_tokens < prefill.chunk_tokens
            assert whole_prefill == {t: once[t] for t in streamed}
        else:
            assert prefill.chunks == 2 * 128 // plan.memory.prefill_chunk_tokens > 4
            assert whole_prefill == {t: prefill.chunks * once[t] for t in streamed}


def test_a_layers_staged_tiles_serve_every_block_within_the_sram(plans, setup):
    """A stationary buffer is loaded once and computed from in every block of the pass; the staged
    bytes held at once exceed a decode step's staging (they are held across blocks) but stay within
    the prefill's, and the plan passes the checker and its simulated SRAM stays within capacity."""
    result = plans["stationary"]
    plan, memory = result.plan, result.plan.memory
    program = plan.programs["prefill"]
    blocks = min(math.ceil(memory.prefill_chunk_tokens / memory.prefill_block_tokens), 4)
    assert blocks == 4
    uses = Counter(buf for _, _, ins in program.instructions() if isinstance(ins, Compute) for buf in ins.bufs
                   if program.buffers[buf].kind == "staging")
    layers = streamed_layer_tiles(result) - head_tiles(result)
    layer_buffers = [b for b in uses if program.buffers[b].tile in layers]
    assert layer_buffers and all(uses[b] == blocks for b in layer_buffers)
    most_staged = 0
    for stream in program.streams.values():
        held = 0
        for ins in stream:
            if isinstance(ins, Load):
                held += program.buffers[ins.buf].bytes
            elif isinstance(ins, Free):
                held -= program.buffers[ins.buf].bytes
            most_staged = max(most_staged, held)
    assert memory.staging_bytes_per_chiplet < most_staged <= memory.prefill_staging_bytes_per_chiplet
    check_plan(plan, load_target(str(setup[1])))
    peaks = simulate(program, plan.target).peak_sram_bytes()
    assert 0 < max(peaks.values()) <= SRAM


def test_the_stationary_prefill_is_faster_and_pays_for_it_in_resident_sram(plans):
    """In one run: TTFT falls by more than 5x against the chunked schedule, and stays above the bound
    (computed apart from the simulator); the SRAM it holds for a layer's tiles and the pass's hand-off
    comes out of the resident weights, so the decode step streams more."""
    stationary, chunked = (plans[s].plan.prediction for s in ("stationary", "chunked"))
    assert stationary.ttft_s < chunked.ttft_s / 5
    assert stationary.bound.ttft_s == chunked.bound.ttft_s <= stationary.ttft_s
    assert plans["stationary"].placement.resident_bytes < plans["chunked"].placement.resident_bytes
    assert stationary.time_per_token_s >= chunked.time_per_token_s


def test_a_chiplet_that_cannot_hold_its_share_reloads_it_per_block(setup, monkeypatch):
    """With no SRAM beyond a decode step's staging for the prefill, no chiplet can hold a layer's
    tiles for the pass: each is loaded once per block, and the plan still checks."""
    monkeypatch.setattr(memory_module, "PREFILL_STAGING_LAYERS", 0.0)
    result = compile_case(setup)
    plan = result.plan
    assert plan.memory.prefill_staging_bytes_per_chiplet == plan.memory.staging_bytes_per_chiplet
    once = loaded_bytes(plan.programs["decode"])
    per_pass = loaded_bytes(plan.programs["prefill"])
    layers = streamed_layer_tiles(result) - head_tiles(result)
    assert layers and all(per_pass[t] == 4 * once[t] for t in layers)
    check_plan(plan, load_target(str(setup[1])))


def test_a_prompt_whose_hand_off_outgrows_its_share_runs_in_passes(setup):
    """What a pass holds between layers (each block's residual stream), spread over the blocks'
    chiplets (4 blocks on 4 chiplets: a chiplet holds at most two blocks', half the pass's), is at
    most PREFILL_HOLD_SHARE of a chiplet: a larger batch runs in passes, the largest halving of the
    prompt that fits, and its TTFT is the passes times one pass's simulated time."""
    result = compile_case(setup, batch=16)
    plan = result.plan
    facts = model_facts(result.graph, result.placement.tiles)
    per_token = layer_runs(facts).held_elements_per_token * plan.target.activation_bytes_per_element
    pass_tokens, total = plan.prediction.prefill.chunk_tokens, 16 * 128
    block = plan.memory.prefill_block_tokens

    def held(tokens: int) -> int:
        return memory_module.prefill_hold_bytes(facts, plan.target, tokens, block, 4)

    assert held(pass_tokens) == math.ceil(per_token * pass_tokens / 2)
    assert held(pass_tokens) <= memory_module.PREFILL_HOLD_SHARE * SRAM < held(2 * pass_tokens)
    assert plan.prediction.prefill.chunks == math.ceil(total / pass_tokens) > 1
    one_pass = simulate(plan.programs["prefill"], plan.target).makespan_s
    assert plan.prediction.ttft_s == pytest.approx(plan.prediction.prefill.chunks * one_pass, rel=1e-12)


def test_layer_boundaries_hold_the_residual_stream(plans):
    """The runs a prefill walks are whole layers (one attention each), cut where the fewest values
    cross: the residual stream and the rotary tables (2 x 128 per token), not also the next layer's
    normalized input (another hidden's worth)."""
    result = plans["stationary"]
    facts = model_facts(result.graph, result.placement.tiles)
    runs = layer_runs(facts)
    attention = [sum(1 for n in run if n.name in facts.attention) for run in runs.runs]
    assert sorted(attention, reverse=True)[:4] == [1, 1, 1, 1] and sum(attention) == 4
    hidden = CONFIG["hidden_size"]
    assert hidden <= runs.held_elements_per_token < 1.2 * hidden


def test_the_prefill_schedule_is_an_option_and_recorded_in_the_plan(plans):
    with pytest.raises(OptionError, match="prefill schedule"):
        CompileOptions(prefill="layerwise")
    stationary, chunked = (plans[s].plan.memory for s in ("stationary", "chunked"))
    assert stationary.prefill_block_tokens > 0 and stationary.prefill_staging_bytes_per_chiplet > 0
    assert chunked.prefill_block_tokens == 0


def test_a_multi_block_prefill_runs_on_the_sim_as_the_chunked_one_does(monkeypatch):
    """A decoder that returns its KV cache as graph outputs (the torch path's `present.N.*`), its
    prompt cut into four program blocks: the sim runs the block-tagged prefill program (every
    block's present K/V made, the logits in the last) and gives the chunked plan's logits and
    tokens (1e-5: the same kernels on the same values)."""
    monkeypatch.setattr(memory_module, "PREFILL_SCRATCH_SHARE", 1e-9)  # one-token blocks
    monkeypatch.setattr(memory_module, "PIPELINE_BLOCK_TOKENS", 2)
    model = zoo.build_model("llama").inner.eval()
    plans = {schedule: aviatorc.compile(model, target="mock", context=32, prompt=8, prefill=schedule, sweep=False,
                                        ranges=False) for schedule in ("stationary", "chunked")}
    program = plans["stationary"].plan.programs["prefill"]
    sent = {ins.value.name for _, _, ins in program.instructions() if isinstance(ins, Send)}
    assert {block_of(name)[1] for name in sent} >= {1, 2, 3}  # blocks 1-3 run beside the home (block 0's)
    assert any(v.name.startswith("present") for v in plans["stationary"].graph.outputs)
    prompt = np.arange(3, 11)
    logits = {schedule: Session(result).prefill(0, prompt) for schedule, result in plans.items()}
    np.testing.assert_allclose(logits["stationary"], logits["chunked"], rtol=0, atol=1e-5)
    tokens = {schedule: Session(result).generate(prompt, 6) for schedule, result in plans.items()}
    assert np.array_equal(tokens["stationary"], tokens["chunked"])
