"""`--kv-dtype int8` at run time: each sequence's cache is kept as int8 codes with one fp16 scale
per head and token (the layout the prediction counts), and the graph reads it dequantized.

- Reference: the same step graph run by the IR interpreter, step by step, with each step's new
  cache positions quantized and dequantized by `aviatorc.quant.kv` and the older ones left as they
  were: the session's logits equal it within 1e-4 (fp32; sim against interpreter).
- The cost, measured here and not assumed: against the same plan compiled with an fp16 cache
  (kept in fp32 by the runtime) the logits move, by less than 2% of their range on the tiny
  Llama; and the stored bytes are 1/4 of fp32 plus 2 bytes per head and token.
- Batched decode over slots of different lengths, truncation and prefix / resume keep the codes
  (the session's blocks, `aviatorc.runtime.paged`):
  equal to stepping each sequence alone within 1e-3. Not 1e-4: a padded or multi-token step's K/V
  differ from the single-token step's by fp32 reassociation (~2e-7), which is enough to move a value that sits on a
  rounding boundary to the next code, one scale step (measured 1.6e-4 on the logits).
"""

from __future__ import annotations

import numpy as np
import pytest

import aviatorc
from aviatorc import zoo
from aviatorc.errors import OptionError
from aviatorc.ir.interpreter import evaluate
from aviatorc.quant.kv import dequantize_kv, quantize_kv
from aviatorc.runtime import Session

ATOL = 1e-4
BATCHED_ATOL = 1e-3
CONTEXT = 32
PROMPTS = ([5, 9, 17, 33, 8, 70, 3, 12], [7, 2, 40])
STEPS = 5


@pytest.fixture(scope="module")
def compiled():
    model = zoo.build_model("llama").inner.eval()
    return {kv: aviatorc.compile(model, target="mock", context=CONTEXT, prompt=8, batch=2, kv_dtype=kv,
                                 time_limit_s=1.0) for kv in ("int8", "fp16")}


@pytest.fixture(scope="module")
def sessions(compiled) -> dict[str, Session]:
    return {kv: Session(result) for kv, result in compiled.items()}


def interpreter_greedy(session: Session, graph, prompt: list[int], steps: int) -> list[np.ndarray]:
    """Logits after the prompt and after each greedy token, the cache quantized position by position."""
    layout = session.cache
    assert layout is not None
    types = {v.name: v.type for v in graph.inputs}
    cache = {p.past: np.zeros([0 if i == p.axis else (d if isinstance(d, int) else 1)
                               for i, d in enumerate(types[p.past].shape)], np.float32) for p in layout.pairs}
    ids, length, rows = np.array([prompt], np.int64), 0, []
    for _ in range(steps + 1):
        total = length + ids.shape[1]
        feeds = {layout.ids: ids, **cache}
        if layout.attention_mask:
            feeds[layout.attention_mask] = np.ones((1, total), np.int64)
        if layout.position_ids:
            feeds[layout.position_ids] = np.arange(length, total, dtype=np.int64)[None, :]
        out = evaluate(graph, feeds)
        for p in layout.pairs:
            new = np.take(out[p.present], range(length, total), axis=p.axis)
            cache[p.past] = np.concatenate([cache[p.past], dequantize_kv(*quantize_kv(new))], axis=p.axis)
        rows.append(out[layout.logits][0, -1])
        ids, length = np.array([[int(rows[-1].argmax())]], np.int64), total
    return rows


def session_greedy(session: Session, prompt: list[int], steps: int, slot: int = 0) -> list[np.ndarray]:
    rows = [session.prefill(slot, prompt)]
    for _ in range(steps):
        rows.append(session.decode([slot], [int(rows[-1].argmax())])[0])
    return rows


def test_the_session_keeps_int8_codes_and_matches_the_interpreter_with_a_quantized_cache(sessions, compiled):
    session = sessions["int8"]
    assert session.kv_dtype == "int8"
    got = session_greedy(session, PROMPTS[0], STEPS)
    int8_bytes = session.cache_bytes(0)
    session.free(0)
    want = interpreter_greedy(session, compiled["int8"].graph, PROMPTS[0], STEPS)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, atol=ATOL)

    plain = sessions["fp16"]
    exact = session_greedy(plain, PROMPTS[0], STEPS)
    fp32_bytes = plain.cache_bytes(0)
    plain.free(0)
    moved = max(float(np.abs(a - b).max()) for a, b in zip(got, exact, strict=True))
    spread = max(float(np.ptp(b)) for b in exact)
    assert 0 < moved < 0.02 * spread, (moved, spread)  # it is really quantized, and the cost is small
    layout = plain.cache
    assert layout is not None
    head_dim = {v.name: v.type.shape[-1] for v in plain.graph.inputs}[layout.pairs[0].past]
    assert isinstance(head_dim, int)
    assert int8_bytes == fp32_bytes // 4 + fp32_bytes // 4 // head_dim * 2  # a code per value, a scale per head and token


def test_batched_decode_truncate_and_resume_keep_the_codes(sessions):
    session = sessions["int8"]
    alone = []
    for prompt in PROMPTS:
        alone.append(session_greedy(session, prompt, STEPS))
        session.free(0)
    rows = [[session.prefill(slot, p)] for slot, p in enumerate(PROMPTS)]
    for _ in range(STEPS):  # unequal lengths: every step pads the shorter cache
        step = session.decode([0, 1], [int(r[-1].argmax()) for r in rows])
        for r, logits in zip(rows, step, strict=True):
            r.append(logits)
    for got, want in zip(rows, alone, strict=True):
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, atol=BATCHED_ATOL)

    # Drop the last two positions and run them again: the same logits as before.
    tokens = [int(r.argmax()) for r in alone[0]]
    length = session.slot_length(0)
    session.truncate(0, length - 2)
    again = session.extend(0, tokens[-3:-1])
    np.testing.assert_allclose(again[-1], alone[0][-1], atol=BATCHED_ATOL)

    # A prefix handed out (dense) and resumed into another slot is the same cache.
    prefix = session.prefix(0, 0, len(PROMPTS[0]))
    session.free(1)
    resumed = session.resume(1, prefix, len(PROMPTS[0]), tokens[:1])
    np.testing.assert_allclose(resumed, alone[0][1], atol=BATCHED_ATOL)
    # Its blocks hold codes and scales, not the prefix's floats: a block's bytes against the floats'.
    blocks = session.kv.blocks_for(session.slot_length(1))
    assert session.cache_bytes(1) == blocks * session.kv.block_bytes
    floats_per_position = sum(a.nbytes for a in prefix.values()) / len(PROMPTS[0])
    assert session.kv.block_bytes < floats_per_position * session.kv.block_size / 3
    for slot in (0, 1):
        session.free(slot)
    assert session.kv.free_blocks == session.kv.num_blocks


@pytest.mark.parametrize("kv", ["int8", "fp16"])
def test_truncate_rolls_back_by_length_and_gives_back_whole_blocks(sessions, kv):
    """Speculative decoding drops rejected drafts with `truncate`: the blocks past the kept
    positions go back to the pool, the kept ones stay where they were (nothing copied), and
    stepping on from there gives what a sequence that never held the dropped tokens gives."""
    session = sessions[kv]
    pool = session.kv
    prompt = [*PROMPTS[0], *PROMPTS[0], *PROMPTS[1]]  # 19 positions: two blocks of 16
    session.prefill(0, prompt)
    table = list(session._slots[0].table)
    assert len(table) == 2 and pool.free_blocks == pool.num_blocks - 2
    session.truncate(0, 5)
    assert session._slots[0].table == table[:1] and pool.free_blocks == pool.num_blocks - 1
    got = session.extend(0, [11, 12])
    session.free(0)
    assert pool.free_blocks == pool.num_blocks
    session.prefill(0, prompt[:5])
    want = session.extend(0, [11, 12])
    session.free(0)
    np.testing.assert_allclose(got, want, atol=BATCHED_ATOL if kv == "int8" else ATOL)


def test_a_session_may_keep_an_fp16_plans_cache_in_int8(compiled, sessions):
    """`Session(kv_dtype="int8")` (a server's --kv-dtype int8) on a plan compiled with an fp16
    cache stores int8 blocks, and gives what the plan compiled with an int8 cache gives."""
    override = Session(compiled["fp16"], kv_dtype="int8")
    assert override.kv.int8 and not sessions["fp16"].kv.int8
    for prompt in PROMPTS:
        np.testing.assert_allclose(session_greedy(override, prompt, STEPS), session_greedy(sessions["int8"], prompt, STEPS),
                                   atol=1e-6)
        override.free(0)
        sessions["int8"].free(0)
    assert override.kv.block_bytes == sessions["int8"].kv.block_bytes
    with pytest.raises(OptionError, match="unknown KV cache type 'fp8'"):
        Session(compiled["fp16"], kv_dtype="fp8")
