"""Batched decode across KV slots: `Session.decode` runs all its slots as one step of a graph
with a symbolic batch, the shorter caches padded to the longest and masked out.

- three slots prefilled with prompts of 8, 3 and 5 tokens, then batched decode steps: each
  row's logits equal transformers' own cached step for that sequence alone, and the greedy
  continuations equal `Session.generate` of each prompt (tiny GPT-2, Llama, Qwen2 compiled from
  the torch module; Llama and Qwen2 from an ONNX decode export, both cache namings);
- the step graph excludes padded positions: garbage in them changes nothing, while the same
  zeros left unmasked move the logits far past the tolerance (so these tests can fail);
- a batch-1 graph keeps stepping slot by slot, with the same results.

Tolerance: 1e-4 absolute on fp32 logits (of size ~1). The padded step computes the same sums as
the unpadded one except for the masked terms, whose softmax weight is exactly 0 (exp of the
dtype's min, or of -inf); what remains is fp32 reassociation in GEMMs of other shapes, measured
at ~2e-7 on these models. A leaked padded position moves the logits by ~1e-2 or more.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import aviatorc
from aviatorc import zoo
from aviatorc.errors import OptionError
from aviatorc.frontends.torch.decoder import decode_step_class, import_decoder
from aviatorc.ir.interpreter import evaluate
from aviatorc.runtime import Session
from tests.zoo_fixtures import decode_onnx_path, zoo_dir  # noqa: F401

ATOL = 1e-4
SLOTS = 3
PROMPT_LENGTHS = (8, 3, 5)  # unequal, so every batched step pads two of the three caches
STEPS = 6
CONTEXT = 32

SOURCES = [("gpt2", "torch"), ("llama", "torch"), ("qwen2", "torch"), ("llama", "flat"), ("qwen2", "hf")]


@pytest.fixture(scope="module")
def sessions(zoo_dir):  # noqa: F811
    cache: dict[tuple[str, str], Session] = {}

    def get(arch: str, source: str) -> Session:
        """`source`: "torch" (the zoo's module), or the cache naming of an ONNX decode export."""
        if (arch, source) not in cache:
            model = zoo.build_model(arch).inner.eval() if source == "torch" else str(
                decode_onnx_path(arch, zoo_dir, source))
            cache[arch, source] = Session(aviatorc.compile(model, target="mock", context=CONTEXT, prompt=8,
                                                           batch=SLOTS, time_limit_s=1.0))
        return cache[arch, source]

    return get


def prompts(arch: str) -> list[np.ndarray]:
    return [zoo.example_inputs(arch, seed=seed)["input_ids"][0].numpy()[:length]
            for seed, length in enumerate(PROMPT_LENGTHS, start=1)]


def batched_greedy(session: Session, ids: list[np.ndarray], steps: int) -> tuple[list[list[int]], list[np.ndarray]]:
    """Prefill slot i with ids[i], then `steps` batched greedy decode steps over all slots: the
    tokens of each slot and the logits [slots, vocab] each step returned."""
    logits = np.stack([session.prefill(slot, x) for slot, x in enumerate(ids)])
    tokens: list[list[int]] = [[] for _ in ids]
    history = []
    try:
        for _ in range(steps):
            chosen = [int(np.argmax(row)) for row in logits]
            for slot, token in enumerate(chosen):
                tokens[slot].append(token)
            logits = session.decode(list(range(len(ids))), chosen)
            history.append(logits)
    finally:
        for slot in range(len(ids)):
            session.free(slot)
    return tokens, history


def transformers_steps(arch: str, ids: np.ndarray, tokens: list[int]) -> list[np.ndarray]:
    """transformers' logits after each of `tokens`, fed one at a time through its own cache."""
    model = zoo.build_model(arch).inner.eval()
    out = []
    with torch.no_grad():
        state = model(input_ids=torch.from_numpy(ids)[None, :], use_cache=True)
        for token in tokens:
            state = model(input_ids=torch.tensor([[token]]), cache=state.cache, use_cache=True)
            out.append(state.logits[0, -1].numpy())
    return out


@pytest.mark.parametrize("arch, source", SOURCES)
def test_batched_steps_equal_each_sequence_alone(arch, source, sessions):
    session = sessions(arch, source)
    layout = session.cache
    assert layout is not None and isinstance(layout.batch, str) and layout.position_ids == "position_ids"
    ids = prompts(arch)
    tokens, history = batched_greedy(session, ids, STEPS)
    assert session.stats is not None and session.stats.phase == "decode" and session.stats.extra["batch"] == SLOTS
    for slot, x in enumerate(ids):
        want = transformers_steps(arch, x, tokens[slot])
        worst = max(float(np.abs(step[slot] - ref).max()) for step, ref in zip(history, want, strict=True))
        assert worst <= ATOL, f"slot {slot}: max |logits - transformers| = {worst:.3g}"
        alone = session.generate(x, STEPS + 1)[len(x):].tolist()
        assert tokens[slot] + [int(np.argmax(history[-1][slot]))] == alone


def test_a_batch_one_graph_steps_slot_by_slot_with_the_same_results(sessions):
    session = sessions("llama", "torch")
    ids = prompts("llama")
    batched, batched_logits = batched_greedy(session, ids, 3)
    layout = session.cache
    assert layout is not None
    session.cache = dataclasses.replace(layout, batch=1)  # as a batch-1 export declares it
    try:
        looped, looped_logits = batched_greedy(session, ids, 3)
        assert session.stats is not None and "batch" not in session.stats.extra
    finally:
        session.cache = layout
    assert looped == batched
    np.testing.assert_allclose(np.stack(looped_logits), np.stack(batched_logits), atol=ATOL, rtol=0)


def test_decode_refuses_a_slot_given_twice(sessions):
    session = sessions("llama", "torch")
    session.prefill(0, prompts("llama")[0])
    try:
        with pytest.raises(OptionError, match="a slot twice"):
            session.decode([0, 0], [5, 6])
        assert session.slot_length(0) == PROMPT_LENGTHS[0]
    finally:
        session.free(0)


# -- the step graph's mask ------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_the_step_graph_excludes_padded_positions(arch, attention):
    model = zoo.build_model(arch).inner.eval()
    model.config._attn_implementation = attention
    graph = import_decoder(model)
    step = decode_step_class()(model).eval()
    layers = model.config.num_hidden_layers
    past_names = [v.name for v in graph.inputs[3:]]
    gen = torch.Generator().manual_seed(0)

    # Each sequence's cache alone (batch 1), from its prompt.
    caches = []
    for length in PROMPT_LENGTHS:
        ids = torch.randint(3, zoo.VOCAB_SIZE, (1, length), generator=gen)
        empty = [torch.zeros(1, *v.type.shape[1:2], 0, *v.type.shape[3:]) for v in graph.inputs[3:]]
        with torch.no_grad():
            caches.append([t.numpy() for t in step(ids, torch.ones_like(ids), torch.arange(length)[None], *empty)[1:]])
    tokens = torch.randint(3, zoo.VOCAB_SIZE, (SLOTS, 1), generator=gen).numpy()
    alone = []
    for slot, length in enumerate(PROMPT_LENGTHS):
        feeds = {"input_ids": tokens[slot:slot + 1], "attention_mask": np.ones((1, length + 1), np.int64),
                 "position_ids": np.array([[length]]), **dict(zip(past_names, caches[slot], strict=True))}
        alone.append(evaluate(graph, feeds)["logits"][0, -1])

    def padded(fill: float, masked: bool) -> np.ndarray:
        longest = max(PROMPT_LENGTHS)
        mask = np.ones((SLOTS, longest + 1), np.int64)
        past = {}
        for index, name in enumerate(past_names):
            shape = caches[0][index].shape
            array = np.full((SLOTS, shape[1], longest, shape[3]), fill, np.float32)
            for slot, length in enumerate(PROMPT_LENGTHS):
                array[slot, :, :length] = caches[slot][index][0]
                mask[slot, length:longest] = 0 if masked else 1
            past[name] = array
        feeds = {"input_ids": tokens, "attention_mask": mask, "position_ids": np.array(PROMPT_LENGTHS)[:, None],
                 **past}
        return evaluate(graph, feeds)["logits"][:, -1]

    assert len(past_names) == 2 * layers
    for fill in (0.0, 1e3):  # zeros, as the session pads, and garbage that would dominate a leak
        got = padded(fill, masked=True)
        for slot in range(SLOTS):
            assert float(np.abs(got[slot] - alone[slot]).max()) <= ATOL, (fill, slot)
    leaked = padded(0.0, masked=False)
    assert float(np.abs(leaked[1] - alone[1]).max()) > 100 * ATOL  # the check above can fail


def test_sequences_of_very_different_lengths_step_in_groups_with_the_same_results(monkeypatch, sessions):
    """Padding a short cache to a long one's length costs what real positions do, so the step
    groups sequences by length (`_length_groups`): a group grows while the positions it pads with
    stay within PADDING_LIMIT. With the limit at 4 positions, the prompts of 8, 3 and 5 tokens
    step as [8, 5] and [3]; the logits are each sequence's own either way."""
    from aviatorc.runtime import session as session_module

    assert session_module._length_groups([8, 3, 5], 1, 16) == [[0, 2, 1]]  # 5 + 3 = 8 positions padded <= 512
    assert session_module._length_groups([30, 30, 1500, 30, 30], 1, 16) == [[2], [0, 1, 3, 4]]
    assert session_module._length_groups([1500, 900, 1490], 1, 16) == [[0, 2], [1]]  # 10 padded; with 900: 610
    assert session_module._length_groups([30, 30, 30, 30, 30], 1, 2) == [[0, 1], [2, 3], [4]]  # the plan's batch
    session = sessions("llama", "torch")
    ids = prompts("llama")
    together, together_logits = batched_greedy(session, ids, 3)
    steps: list[int] = []
    batched_step = session._batched_step
    monkeypatch.setattr(session, "_batched_step", lambda seqs, *a: steps.append(len(seqs)) or batched_step(seqs, *a))
    monkeypatch.setattr(session_module, "PADDING_LIMIT", 4)
    grouped, grouped_logits = batched_greedy(session, ids, 3)
    assert steps == [2, 1] * 3  # [8, 5] pads 3 positions; adding the 3-token one would pad 8
    assert grouped == together
    np.testing.assert_allclose(np.stack(grouped_logits), np.stack(together_logits), atol=ATOL, rtol=0)


def test_a_long_prompt_runs_in_pieces_with_the_same_logits(monkeypatch, sessions):
    """A prompt longer than PIECE_TOKENS runs through the graph that many tokens a step (each
    step's attention then holds a piece's scores, not the whole prompt's); the logits are the
    one-step ones within the tolerance above. Here PIECE_TOKENS is 5 and the prompt 16 tokens."""
    from aviatorc.runtime import session as session_module

    session = sessions("llama", "torch")
    ids = np.concatenate(prompts("llama"))
    whole = session.prefill(0, ids)  # 16 tokens <= 256: one step
    session.free(0)
    steps: list[int] = []
    execute = session._execute
    monkeypatch.setattr(session, "_execute", lambda feeds, *a: steps.append(feeds["input_ids"].shape[1]) or
                        execute(feeds, *a))
    monkeypatch.setattr(session_module, "PIECE_TOKENS", 5)
    pieces = session.prefill(0, ids)
    session.free(0)
    assert steps == [5, 5, 5, 1]
    np.testing.assert_allclose(pieces, whole, atol=ATOL, rtol=0)
