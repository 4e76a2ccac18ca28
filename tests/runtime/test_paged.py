"""The paged KV pool (`aviatorc.runtime.paged`) and a session whose sequences share it.

- Reference: a dense array per sequence grown by concatenation (what the session kept before
  paging). Reads of a table equal it exactly (fp32 copies), across block boundaries and appends
  of any size; under int8, exactly `aviatorc.quant.kv`'s codes and scales of the same positions.
- Copy-on-write: a write into a shared block leaves the other holder's positions as they were.
- A reservation the pool cannot give raises `OutOfBlocks` with the numbers and changes nothing.
- A session holds more sequences than its plan's batch when they are short (`max_seqs`), steps
  them at most the batch at a time, and each gets what it gets alone.
"""

from __future__ import annotations

import numpy as np
import pytest

import aviatorc
from aviatorc import zoo
from aviatorc.quant.kv import dequantize_kv, quantize_kv
from aviatorc.runtime import Session
from aviatorc.runtime.paged import CacheSpec, KVPool, OutOfBlocks

SPECS = {"k": CacheSpec((1, 2, 0, 8), 2, np.dtype(np.float32)), "v": CacheSpec((1, 2, 0, 8), 2, np.dtype(np.float32))}


def grow(pool: KVPool, table: list[int], dense: dict[str, np.ndarray], length: int, new: int,
         rng: np.random.Generator) -> int:
    pool.reserve(table, length, length + new)
    for name in SPECS:
        values = rng.standard_normal((1, 2, new, 8)).astype(np.float32)
        pool.write(table, name, length, values)
        dense[name] = np.concatenate([dense[name], values], axis=2)
    return length + new


@pytest.mark.parametrize("int8", [False, True])
def test_reads_equal_the_dense_cache_across_blocks(int8):
    rng = np.random.default_rng(0)
    pool = KVPool(SPECS, num_blocks=12, block_size=4, int8=int8)
    table: list[int] = []
    dense = {name: np.zeros((1, 2, 0, 8), np.float32) for name in SPECS}
    length = 0
    for new in (3, 1, 1, 6, 4, 9):  # within a block, onto its edge, across several
        length = grow(pool, table, dense, length, new, rng)
        assert len(table) == -(-length // 4) and pool.used_blocks == len(table)
        for name in SPECS:
            got = pool.read(table, name, length)
            want = dequantize_kv(*quantize_kv(dense[name])) if int8 else dense[name]
            assert got.shape == (1, 2, length, 8) and got.dtype == np.float32
            np.testing.assert_array_equal(got, want)
    pool.release(table, keep=5)
    assert len(table) == 2 and pool.free_blocks == 10
    np.testing.assert_array_equal(pool.read(table, "k", 5)[:, :, :5],
                                  (dequantize_kv(*quantize_kv(dense["k"])) if int8 else dense["k"])[:, :, :5])
    pool.release(table)
    assert table == [] and pool.free_blocks == 12 and not pool.refs.any()


def test_a_write_into_a_shared_block_copies_it_first():
    rng = np.random.default_rng(1)
    pool = KVPool(SPECS, num_blocks=8, block_size=4)
    first: list[int] = []
    dense = {name: np.zeros((1, 2, 0, 8), np.float32) for name in SPECS}
    grow(pool, first, dense, 0, 6, rng)  # a full block and half of one
    second = pool.share(first)
    assert list(pool.refs[first]) == [2, 2]
    other = {name: dense[name][:, :, :6] for name in SPECS}
    grow(pool, second, other, 6, 3, rng)  # into the shared half block, and on
    assert second[0] == first[0] and second[1] != first[1]  # the full block still shared, the written one copied
    assert list(pool.refs[first]) == [2, 1]
    for name in SPECS:
        np.testing.assert_array_equal(pool.read(first, name, 6), dense[name])
        np.testing.assert_array_equal(pool.read(second, name, 9), other[name])
    pool.release(first)
    pool.release(second)
    assert pool.free_blocks == 8


def test_a_reservation_it_cannot_give_changes_nothing():
    pool = KVPool(SPECS, num_blocks=3, block_size=4)
    table: list[int] = []
    pool.reserve(table, 0, 9)
    shared = pool.share(table)
    with pytest.raises(OutOfBlocks) as error:
        pool.reserve(shared, 9, 13)  # one new block, and a copy of the shared last one: 2, with 0 free
    assert (error.value.needed, error.value.free, error.value.total) == (2, 0, 3)
    assert "2 more block(s) of 4 tokens but 0 of 3 are free" in error.value.message
    assert shared == table and list(pool.refs[table]) == [2, 2, 2] and pool.free_blocks == 0


@pytest.fixture(scope="module")
def compiled():
    model = zoo.build_model("llama").inner.eval()
    return aviatorc.compile(model, target="mock", context=64, prompt=8, batch=2, time_limit_s=1.0)


def greedy_alone(session: Session, prompt: list[int], steps: int) -> list[int]:
    out = session.generate(np.array(prompt), max_new_tokens=steps, eos_token_id=())
    return [int(t) for t in out[len(prompt):]]


def test_a_session_holds_more_short_sequences_than_its_batch(compiled):
    """A plan of batch 2 and context 64 reserves 2 x 64 positions: its pool is 8 blocks of 16 (or
    16 of 8). Five sequences of at most 16 positions fit in 7 of them; each decode step runs at most 2."""
    assert (compiled.plan.memory.kv_blocks, compiled.plan.memory.kv_block_tokens) == (8, 16)
    assert Session(compiled).kv.num_blocks == 8 and Session(compiled, block_size=8).kv.num_blocks == 16
    session = Session(compiled, max_seqs=5, kv_blocks=7)
    assert session.step_batch == 2
    prompts = [[3 + i, 9, 17 + 2 * i, 4][: 2 + i % 3] for i in range(5)]
    steps = 6
    alone = [greedy_alone(session, p, steps) for p in prompts]
    tokens = [[int(session.prefill(slot, p).argmax())] for slot, p in enumerate(prompts)]
    for _ in range(steps - 1):
        rows = session.decode(list(range(5)), [t[-1] for t in tokens])
        assert session.stats.extra["batch"] <= 2
        for t, row in zip(tokens, rows):
            t.append(int(row.argmax()))
    assert tokens == alone
    assert session.kv.used_blocks == 5 and session.blocks_needed(0, 16) == 1
    session.free(4)
    with pytest.raises(OutOfBlocks) as error:  # 3 blocks free: a 49-token prompt needs 4
        session.prefill(4, [1] * 49)
    assert (error.value.needed, error.value.free) == (4, 3)
    assert session.kv.used_blocks == 4 and session.slot_length(4) == 0  # the refused prompt took nothing
    for slot in range(4):
        session.free(slot)
    assert session.kv.free_blocks == session.kv.num_blocks
