"""The prefill's stages (aviatorc/schedule/build.py: `_Builder._stages`): layers whose weights are
all resident and whose homes span cards are walked by the prompt's blocks as a pipeline, each
block a share of the stage behind the one before, so another card's chiplets work on the first
blocks while the earlier layers take the rest. A random tiny Llama at INT8 on a 2-card `mock` of
512 KiB chiplets, whose SRAM holds every weight only over both cards."""

from __future__ import annotations

import numpy as np
import pytest

import aviatorc
from aviatorc.runtime import Session
from aviatorc.schedule import build as build_module
from aviatorc.schedule import memory as memory_module
from aviatorc.target import load_target


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, aviatorc.CompileResult], dict[str, list]]:
    """Each plan, and the stages (nodes, lag) its prefill was built from."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=8,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    target = tmp_path_factory.mktemp("stages") / "mock2.toml"
    target.write_text(load_target("mock", cards=2, overrides={"chiplet.sram_bytes": 512 * 1024}).to_toml())
    out, stages, found_by_plan = {}, [], {}
    built = build_module._Builder._stages

    def spy(builder: build_module._Builder) -> list[tuple[list, int]]:
        found = built(builder)
        if builder.blocks > 1:
            stages.append([(len(run), lag) for run, lag in found])
        return found

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(memory_module, "PIPELINE_BLOCK_TOKENS", 2)
        patch.setattr(build_module._Builder, "_stages", spy)
        for name, lag in (("pipeline", build_module.RESIDENT_LAG), ("in step", 0.0)):
            patch.setattr(build_module, "RESIDENT_LAG", lag)  # 0: each block one node behind, as a streamed run
            out[name] = aviatorc.compile(model, target=str(target), context=32, prompt=8, batch=4, sweep=False,
                                         ranges=False, quant="int8")
            found_by_plan[name] = stages.pop()
    return out, found_by_plan


def test_resident_layers_whose_homes_span_cards_are_one_stage(compiled):
    """Nothing streams and the homes take both cards: the prefill walks the whole model as one
    stage, its 4 blocks an eighth of it apart."""
    result = compiled[0]["pipeline"]
    assert result.placement.streamed_bytes == 0
    [(nodes, lag)] = compiled[1]["pipeline"]
    assert lag == round(nodes * build_module.RESIDENT_LAG) > 1
    assert {result.plan.target.card_of(c) for c in result.placement.compute_chiplet} == {0, 1}


def test_the_pipelined_stage_is_faster_and_the_sim_gives_the_same_tokens(compiled):
    """The pipeline's first tokens come sooner (simulated: 2% on a model this small, 30% on
    Llama-3-8B x4 at batch 16, `tools/bench_plan.py`); on the sim backend its prefill gives
    the in-step plan's logits (1e-6: the same kernels on the same values) and greedy tokens."""
    plans = compiled[0]
    ttft = {name: result.plan.prediction.ttft_s for name, result in plans.items()}
    assert ttft["pipeline"] < ttft["in step"]
    prompt = np.arange(3, 11)
    logits = {name: Session(result).prefill(0, prompt) for name, result in plans.items()}
    np.testing.assert_allclose(logits["pipeline"], logits["in step"], rtol=0, atol=1e-6)
    tokens = {name: Session(result).generate(prompt, 8) for name, result in plans.items()}
    assert np.array_equal(tokens["pipeline"], tokens["in step"])
