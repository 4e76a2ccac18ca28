"""Multi-card plans across processes (torch.distributed, gloo on loopback): one rank per card.

The plans: a tiny Llama on a mock target of 2 and of 4 cards whose chiplets hold 32 KiB, so its
layers sit on several cards and activations cross the card links (checked on the plan itself),
with the KV cache in LPDDR.

- `Session(world=N).run` and `.generate` give exactly (bit for bit) the single-process sim's
  outputs and tokens on the same plan, for N = 2 and 4 (its checked runs: ranks check every run;
  a single-process replay fuses strip products, within 1e-5);
- `torchrun ... -m aviatorc.worker` gives the same outputs as the spawned ranks;
- the messages and bytes counted per chiplet-to-chiplet edge equal the plan's `send`s;
- a rank that raises, or is killed, makes rank 0 raise within the timeout naming the rank, and
  leaves no process behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import aviatorc
from aviatorc import zoo
from aviatorc.plan.artifact import MANIFEST, to_json_bytes
from aviatorc.plan.ir import Load, Send, Wait
from aviatorc.plan.plan import Plan
from aviatorc.runtime import RankFailed, RuntimeFault, Session

PER_CARD = 4  # the mock target's chiplets per card
TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("multicard")
    out = {}
    for cards in (2, 4):
        target = root / f"mock-x{cards}.toml"
        target.write_text(f'schema_version = 1\nextends = "mock"\nname = "mock-x{cards}"\n'
                          f'[chiplet]\nsram_bytes = 20480\n[server]\ncards = {cards}\n')
        result = aviatorc.compile(zoo.build_model("llama").inner.eval(), target=str(target), context=48, prompt=8,
                                  batch=2, time_limit_s=1.0, kv_cache="lpddr")
        out[cards] = result.save(root / f"llama-x{cards}.avc")
    return out


def feeds(session: Session, ids: list[int]) -> dict[str, np.ndarray]:
    n = len(ids)
    out = {"input_ids": np.array([ids]), "attention_mask": np.ones((1, n), np.int64), "position_ids": np.arange(n)[None]}
    return out | {name: session.kv.read([], name, 0) for name in session.kv.specs}  # empty pasts


def plan_sends(path: Path, phase: str) -> dict[str, tuple[int, int]]:
    """(messages, bytes) per chiplet edge as the plan's `send` instructions declare them."""
    program = Plan.from_dict(json.loads((path / "plan.json").read_text())).programs[phase]
    counts: Counter[str] = Counter()
    sizes: Counter[str] = Counter()
    for c, _, ins in program.instructions():
        if isinstance(ins, Send):
            counts[f"{c}->{ins.to}"] += 1
            sizes[f"{c}->{ins.to}"] += ins.bytes
    return {edge: (counts[edge], sizes[edge]) for edge in counts}


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_give_the_single_process_outputs_bit_for_bit(plans, world):
    crossing = [e for e in plan_sends(plans[world], "prefill") if int(e.split("->")[0]) // PER_CARD
                != int(e.split("->")[1]) // PER_CARD]
    assert crossing  # activations cross between cards (a pipeline: each card hands its layers' output on)
    alone = Session(plans[world], replay=False)
    inputs = feeds(alone, [5, 6, 7, 8, 9])
    want = alone.run(inputs)
    tokens = alone.generate([5, 6, 7], 12)
    fast = Session(plans[world])
    with Session(plans[world], world=world, timeout_s=TIMEOUT_S) as session:
        got = session.run(inputs)
        assert list(got) == list(want)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])  # bit-identical, not close
            np.testing.assert_allclose(fast.run(inputs)[name], got[name], rtol=0, atol=1e-5)
        np.testing.assert_array_equal(session.generate([5, 6, 7], 12), tokens)
        np.testing.assert_array_equal(fast.generate([5, 6, 7], 12), tokens)
        read = session.stats.extra["distributed"]["tile_bytes_read_by_rank"]
        assert len(read) == world and sum(1 for b in read if b) >= 2  # ranks read their own cards' tiles


def test_messages_per_edge_equal_the_plan(plans):
    with Session(plans[2], world=2, timeout_s=TIMEOUT_S) as session:
        session.run(feeds(session, [5, 6, 7]))
        edges = session.stats.extra["distributed"]["edges"]
        trace = session.run_trace()
    want = plan_sends(plans[2], "prefill")
    assert {e: (v["messages"], v["bytes"]) for e, v in edges.items()} == want
    assert trace["metadata"]["edges"] == edges
    ranks = {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert ranks == {0, 1}  # one Perfetto process per rank, merged
    sends = sum(1 for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] == "send")
    assert sends == sum(m for m, _ in want.values())


def test_torchrun_gives_what_the_spawned_ranks_give(plans, tmp_path):
    alone = Session(plans[2])
    inputs = feeds(alone, [9, 8, 7, 6])
    np.savez(tmp_path / "feeds.npz", **inputs)
    with Session(plans[2], world=2, timeout_s=TIMEOUT_S) as session:
        spawned = session.run(inputs)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "aviatorc.worker", str(plans[2]), "--inputs", str(tmp_path / "feeds.npz"),
                          "--output", str(tmp_path / "out.npz")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    with np.load(tmp_path / "out.npz") as data:
        assert sorted(data.files) == sorted(spawned)
        for name in spawned:
            np.testing.assert_array_equal(data[name], spawned[name])


def test_the_cli_runs_a_world(plans, tmp_path):
    alone = Session(plans[2], replay=False)
    inputs = feeds(alone, [3, 4])
    np.savez(tmp_path / "feeds.npz", **inputs)
    out = subprocess.run([sys.executable, "-m", "aviatorc", "run", str(plans[2]), "--world", "2", "--inputs",
                          str(tmp_path / "feeds.npz"), "--output", str(tmp_path / "out.npz")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    with np.load(tmp_path / "out.npz") as data:
        np.testing.assert_array_equal(data["logits"], alone.run(inputs)["logits"])


def _break_a_card1_load(src: Path, out: Path) -> tuple[int, int]:
    """A copy of the plan with the first load of a card-1 stream removed, hashes made consistent;
    the (stream, step) of the wait that must fault."""
    shutil.copytree(src, out)
    plan = Plan.from_dict(json.loads((out / "plan.json").read_text()))
    program = plan.programs["prefill"]
    for c in sorted(program.streams):
        stream = program.streams[c]
        if c // PER_CARD != 1:
            continue
        first = next((i for i, ins in enumerate(stream) if isinstance(ins, Load)), None)
        if first is None:
            continue
        load = stream[first]
        assert isinstance(load, Load)
        wait = next(j for j in range(first, len(stream)) if stream[j] == Wait(load.buf))
        del stream[first]
        (out / "plan.json").write_bytes(to_json_bytes(plan.to_dict(), compact=True))
        manifest = json.loads((out / MANIFEST).read_text())
        data = (out / "plan.json").read_bytes()
        manifest["files"]["plan.json"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        (out / MANIFEST).write_text(json.dumps(manifest))
        return c, wait - 1
    raise AssertionError("no card-1 stream loads anything")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_broken_plan_is_refused_before_any_rank_starts(plans, tmp_path):
    """A card-1 load removed from plan.json (hashes made consistent): `load` runs the plan checker,
    so the fault is named, with its stream and step, before a rank is spawned. (A rank that fails
    at run time: the killed-rank test below.)"""
    broken = tmp_path / "broken.avc"
    stream, step = _break_a_card1_load(plans[2], broken)
    with pytest.raises(aviatorc.AviatorError, match="missing-load") as info:
        Session(broken, world=2, timeout_s=TIMEOUT_S)
    assert f"stream {stream} step {step}" in str(info.value)


def test_a_killed_rank_fails_the_run_within_the_timeout(plans):
    session = Session(plans[4], world=4, timeout_s=TIMEOUT_S)
    inputs = feeds(session, [5, 6, 7])
    session.run(inputs)
    children = session._cluster.children
    children[1].kill()  # rank 2
    started = time.monotonic()
    with pytest.raises(RuntimeFault) as info:
        session.run(inputs)
    assert time.monotonic() - started < TIMEOUT_S
    assert isinstance(info.value, RankFailed) and info.value.rank == 2 and "exited" in str(info.value)
    assert all(_gone(child.pid) for child in children)  # rank 0 tore the others down


def test_an_idle_session_outlives_its_timeout_and_a_dropped_one_leaves_nothing(plans):
    import gc

    session = Session(plans[2], world=2, timeout_s=2.0)
    inputs = feeds(session, [5, 6, 7])
    first = session.run(inputs)["logits"]
    time.sleep(3.0)  # idle past timeout_s: the ranks wait for commands as long as it takes
    np.testing.assert_array_equal(session.run(inputs)["logits"], first)
    pids = [child.pid for child in session._cluster.children]
    del session
    gc.collect()  # dropped without close(): its ranks are stopped and its group released
    assert all(_gone(pid) for pid in pids)
    with Session(plans[2], world=2, timeout_s=TIMEOUT_S) as again:
        np.testing.assert_array_equal(again.run(inputs)["logits"], first)
    with pytest.raises(aviatorc.AviatorError, match="closed"):
        again.run(inputs)


def test_int8_links_round_the_same_across_ranks(plans, tmp_path):
    """--link-dtype int8 on 2 cards: the ranks round what they send to each other as the single
    process rounds every send, so the outputs stay bit for bit its own, and differ from the
    fp16-link plan's (the rounding crosses the cards too)."""
    target = tmp_path / "mock-x2.toml"
    target.write_text('schema_version = 1\nextends = "mock"\nname = "mock-x2"\n'
                      '[chiplet]\nsram_bytes = 20480\n[server]\ncards = 2\n')
    rounded = aviatorc.compile(zoo.build_model("llama").inner.eval(), target=str(target), context=48, prompt=8,
                               batch=2, time_limit_s=1.0, kv_cache="lpddr", link_dtype="int8").save(tmp_path / "i8.avc")
    alone = Session(rounded, replay=False)
    inputs = feeds(alone, [5, 6, 7, 8, 9])
    want = alone.run(inputs)
    plain = Session(plans[2], replay=False).run(inputs)
    with Session(rounded, world=2, timeout_s=TIMEOUT_S) as session:
        got = session.run(inputs)
    logits = next(iter(want))
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
    assert not np.array_equal(want[logits], plain[logits])
