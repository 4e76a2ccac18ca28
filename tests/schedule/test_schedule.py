"""The scheduler, its simulation and the bound: on real (tiny) models and on hand-built programs
whose timing can be worked out by hand (the machine model's channels, links, latencies and the
bound of every regime are in test_machine.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import aviatorc
from aviatorc.errors import InfeasibleError
from aviatorc.plan.ir import Buffer, Compute, Free, Host, Load, Program, Recv, Send, Store, ValueRef, Wait, Workload
from aviatorc.schedule import model_facts, simulate
from aviatorc.schedule.build import build_program
from aviatorc.schedule.memory import kv_beside_weights, kv_bytes_per_token, plan_memory
from aviatorc.target import load_target
from tests.zoo_fixtures import zoo_dir, zoo_onnx  # noqa: F401

TINY_SRAM = """schema_version = 2
extends = "mock"
name = "mock-tiny"
description = "mock with 12 KiB of SRAM per chiplet, so the tiny zoo models must stream"

[chiplet]
sram_bytes = 12288
"""


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("targets") / "mock-tiny.toml"
    path.write_text(TINY_SRAM)
    return path


def compile_llama(zoo_onnx, target, **options):  # noqa: F811
    # The KV cache (2 layers x 32 values x 256 tokens x 2 bytes) streams from LPDDR too.
    return aviatorc.compile(str(zoo_onnx("llama")), target=str(target), quant="int8", context=256, prompt=8,
                            kv_cache="lpddr", **options)


# -- the simulator, by hand ---------------------------------------------------------------


def test_loads_of_one_pooled_channel_serialize_and_compute_overlaps_them():
    target = load_target("mock")  # one pooled LPDDR channel per card, 10 GB/s; SRAM 1 TB/s, mxint8 1 TFLOP/s
    program = Program("decode", Workload(1, 0, 1))
    for c in (0, 1):
        program.add_buffer(Buffer(f"s{c}", c, 10_000, "staging", tile=c))
        program.add_buffer(Buffer(f"r{c}", c, 10_000, "staging", tile=2 + c))
        program.emit(c, Load(f"s{c}", 0, 10_000))
        program.emit(c, Load(f"r{c}", 0, 10_000))
        program.emit(c, Wait(f"s{c}"))
        # 2e6 FLOPs at 1e12 FLOP/s: 2 us of compute, overlapping the second load
        program.emit(c, Compute("mm", (f"s{c}",), 2_000_000, 10_000, 0, "int8", None, False))
        program.emit(c, Free(f"s{c}"))
        program.emit(c, Wait(f"r{c}"))
        program.emit(c, Free(f"r{c}"))
    timeline = simulate(program, target)
    # Four 1 us loads serialized on card 0's channel in issue order (chiplet 0 first on a tie).
    loads = sorted((s.start_s, s.end_s, s.name) for s in timeline.spans if s.kind == "load")
    assert [round(a * 1e6, 6) for a, _, _ in loads] == [0.0, 1.0, 2.0, 3.0]
    assert loads[0][2].startswith("s0") and loads[1][2].startswith("r0")
    # Chiplet 1's first tile lands at 3 us (behind both of chiplet 0's loads), then 2 us of compute.
    assert timeline.makespan_s == pytest.approx(5e-6)
    assert timeline.peak_sram_bytes() == {0: 20_000, 1: 20_000}


def test_sends_pay_link_latency_and_share_the_link():
    target = load_target("mock")  # die-to-die 100 GB/s, 100 ns; chiplets 0 and 1 share a package
    program = Program("decode", Workload(1, 0, 1))
    program.emit(0, Send(ValueRef("a"), 1, 100_000))
    program.emit(0, Send(ValueRef("b"), 1, 100_000))
    program.emit(1, Recv(ValueRef("b"), 0, 100_000))
    timeline = simulate(program, target)
    # b waits for a on the one die-to-die link: 2 x 1 us of bytes, plus 100 ns of latency.
    assert timeline.makespan_s == pytest.approx(2.1e-6)


def test_a_stream_waiting_for_a_send_that_never_comes_is_a_deadlock():
    from aviatorc.schedule import SimulationError

    program = Program("decode", Workload(1, 0, 1))
    program.emit(0, Recv(ValueRef("x"), 1, 8))
    program.emit(1, Recv(ValueRef("y"), 0, 8))
    with pytest.raises(SimulationError, match="deadlock"):
        simulate(program, load_target("mock"))


# -- plans of real models -----------------------------------------------------------------


@pytest.fixture(scope="module")
def streamed(zoo_onnx, tiny_target):  # noqa: F811
    return compile_llama(zoo_onnx, tiny_target), compile_llama(zoo_onnx, tiny_target, prefetch=False)


def test_the_tiny_target_really_streams(streamed):
    art, _ = streamed
    assert art.placement.streamed_bytes > 0.2 * (art.placement.streamed_bytes + art.placement.resident_bytes)
    loads = art.plan.programs["decode"].count()["load"]
    assert loads >= sum(1 for w in art.placement.where if w >= art.placement.num_chiplets)


def test_prefetch_beats_loading_on_demand_and_neither_beats_the_bound(streamed):
    art, on_demand = streamed
    fast, slow = art.plan.prediction, on_demand.plan.prediction
    assert fast.time_per_token_s < 0.9 * slow.time_per_token_s
    assert fast.bound == slow.bound  # the bound knows nothing of the schedule
    for prediction in (fast, slow):  # the bound is computed apart from the simulator: it must hold
        assert prediction.bound.token_s <= prediction.time_per_token_s
        assert prediction.bound.ttft_s <= prediction.ttft_s
        assert 0 < prediction.efficiency <= 1


def test_sram_occupancy_stays_within_capacity_at_every_step(streamed, tiny_target):
    target = load_target(tiny_target)
    budget = streamed[0].plan.memory.staging_bytes_per_chiplet
    for art in streamed:
        for program in art.plan.programs.values():
            peaks = simulate(program, target).peak_sram_bytes()
            assert max(peaks.values()) <= target.chiplet.sram_bytes
            for c, peak in peaks.items():
                static = sum(b.bytes for b in program.buffers.values() if b.kind != "staging" and b.chiplet == c)
                assert peak - static <= budget
        # so the budget, not luck, kept staging in: some chiplet stages more than it may hold at once
        program = art.plan.programs["decode"]
        assert max(sum(b.bytes for b in program.buffers.values() if b.kind == "staging" and b.chiplet == c)
                   for c in range(4)) > budget


def test_every_placed_tile_is_computed_on_its_compute_chiplet(streamed):
    art, _ = streamed
    program = art.plan.programs["decode"]
    seen: dict[int, set[int]] = {}
    for chiplet, _, ins in program.instructions():
        if isinstance(ins, Compute):
            for name in ins.bufs:
                tile = program.buffers[name].tile
                if tile is not None:
                    seen.setdefault(tile, set()).add(chiplet)
    assert set(seen) == set(range(len(art.placement.tiles)))
    assert all(chips == {art.placement.compute_chiplet[t]} for t, chips in seen.items())


def test_a_value_crosses_to_each_other_card_once_and_is_forwarded_there(zoo_onnx, tiny_target):  # noqa: F811
    art = compile_llama(zoo_onnx, tiny_target, cards=2)  # the KV chunks spread over both cards
    target = load_target(tiny_target)
    for program in [art.plan.programs["decode"]]:
        crossings: dict[tuple[str, int], int] = {}
        readers: dict[tuple[str, int], set[int]] = {}
        for chiplet, _, ins in program.instructions():
            if isinstance(ins, Send) and target.card_of(ins.to) != target.card_of(chiplet):
                key = (str(ins.value), target.card_of(ins.to))
                crossings[key] = crossings.get(key, 0) + 1
            if isinstance(ins, Recv):
                readers.setdefault((str(ins.value), target.card_of(chiplet)), set()).add(chiplet)
        # A copy per reader would cross the slow card-to-card port once per reader: the tree crosses once.
        assert crossings and max(crossings.values()) == 1
        assert any(len(readers[key]) > 1 for key in crossings)  # values that reach several chiplets there
    assert art.plan.prediction.bound.token_s <= art.plan.prediction.time_per_token_s


def test_kv_cache_in_lpddr_streams_exactly_its_bytes(zoo_onnx):  # noqa: F811
    art = aviatorc.compile(str(zoo_onnx("llama")), target="mock", quant="int8", context=256, kv_cache="lpddr")
    program = art.plan.programs["decode"]
    kv_loaded = sum(ins.bytes for _, _, ins in program.instructions()
                    if isinstance(ins, Load) and program.buffers[ins.buf].layer is not None)
    # tiny llama: 2 layers, 2 kv heads x 8 dims for K and for V, fp16
    assert kv_loaded == 2 * (16 + 16) * 256 * 2 == art.plan.memory.kv_bytes
    sram = aviatorc.compile(str(zoo_onnx("llama")), target="mock", quant="int8", context=256, kv_cache="sram")
    assert not any(b.kind == "staging" and b.layer is not None for b in sram.plan.programs["decode"].buffers.values())
    assert sum(b.bytes for b in sram.plan.programs["decode"].buffers.values() if b.kind == "kv") == kv_loaded


def test_int8_kv_cache_halves_its_bytes_and_adds_its_scales():
    assert kv_bytes_per_token(2048, "fp16") == 4096
    # 2048 = K + V of 8 heads of 128: one fp16 scale per head, for K and for V
    assert kv_bytes_per_token(2048, "int8") == 2048 + 2 * 2 * 8


def test_batch_and_context_sweep_grows_with_the_kv_cache(zoo_onnx):  # noqa: F811
    # kv_cache="lpddr": every point streams its whole cache (under "auto" a point's cache also takes
    # the SRAM the weights leave, so how much streams differs from point to point)
    art = aviatorc.compile(str(zoo_onnx("llama")), target="mock", quant="int8", context=512, kv_cache="lpddr")
    points = art.plan.prediction.sweep
    sweep = {(p.batch, p.context): p for p in points if p.fits}
    # The context points keep the compiled batch: same activations, so they all fit this placement.
    assert sweep[(1, 32768)].time_per_token_s > sweep[(1, 8192)].time_per_token_s > sweep[(1, 512)].time_per_token_s
    # A larger batch fits only if its activations fit the SRAM this compile reserved; say why otherwise.
    # With the cache in the same place, a larger batch gives more tokens per second.
    by_batch = sorted(((b, p) for (b, t), p in sweep.items() if t == 512 and p.kv_location == "lpddr"),
                      key=lambda bp: bp[0])
    assert len(by_batch) >= 2
    assert all(p2.tokens_per_s > p1.tokens_per_s for (_, p1), (_, p2) in zip(by_batch, by_batch[1:]))
    refused = [p for p in points if not p.fits]
    assert all(p.batch > 1 and "SRAM" in p.reason for p in refused)
    assert all(p.bound_s <= p.time_per_token_s for p in sweep.values())


def test_an_activation_no_chiplet_can_hold_is_refused_before_anything_is_written(tmp_path):
    huge = helper.make_tensor("shape", TensorProto.INT64, [2], [2**20, 2**20])
    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "fc.weight")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "fc.weight"], ["h"], name="fc"),
         helper.make_node("ConstantOfShape", ["shape"], ["big"], name="blowup"),
         helper.make_node("ReduceSum", ["big"], ["s"], name="sum", keepdims=0),
         helper.make_node("Add", ["h", "s"], ["y"], name="add")],
        "huge", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], [w, huge])
    path = tmp_path / "huge.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    with pytest.raises(InfeasibleError) as caught:
        aviatorc.compile(str(path), target="mock")
    assert caught.value.node == "blowup" and caught.value.op == "ConstantOfShape"
    assert "needs 2048.00 GiB" in str(caught.value) or "activation 'big'" in str(caught.value)


def test_the_decode_step_is_no_faster_than_its_busiest_channel_and_link(streamed, tiny_target):
    """Worked out from the program alone, apart from the simulator: the bytes each LPDDR channel
    serves and each die-to-die link carries; the simulated step cannot beat the busiest of them."""
    target = load_target(tiny_target)
    for art in streamed:
        program = art.plan.programs["decode"]
        per_channel: dict[int, int] = {}
        for _, _, ins in program.instructions():
            if isinstance(ins, Load):
                per_channel[ins.channel] = per_channel.get(ins.channel, 0) + ins.bytes
        busiest_s = max(per_channel.values()) / target.channel_bytes_per_s
        assert busiest_s > 0
        step = simulate(art.plan, target).makespan_s
        assert step >= busiest_s
        # Half the channel bandwidth: a streaming plan's step grows, by at most the channel time added.
        slow = simulate(art.plan, load_target(tiny_target, overrides={"card.lpddr_bytes_per_s": 5e9})).makespan_s
        assert step < slow <= step + busiest_s * (1 + 1e-9)


@pytest.fixture(scope="module")
def decode_programs(zoo_onnx):  # noqa: F811
    """A llama plan at batch 4 whose cache streams, and its decode program built for any workload."""
    art = aviatorc.compile(str(zoo_onnx("llama")), target="mock", quant="int8", context=2048, batch=4,
                           kv_cache="lpddr")
    facts = model_facts(art.graph, art.placement.tiles)
    target, chiplets = art.plan.target, art.plan.chiplets

    def program(load: Workload):
        memory = kv_beside_weights(plan_memory(facts, art.placement.tiles, target, load, chiplets=chiplets,
                                               kv="lpddr"), art.placement, facts, target)
        return build_program(facts, art.placement, target, memory, load, "decode", chiplets=chiplets)

    return art, program


def test_a_verify_step_reads_each_sequences_cache_once_for_all_its_positions(decode_programs):
    """Verifying k drafts runs k + 1 positions per sequence: the FLOPs and KV writes of a decode
    step at k + 1 times the batch, but each sequence's cache is read once, not k + 1 times."""
    art, program = decode_programs
    target = art.plan.target

    def totals(p):
        kv = sum(i.bytes for _, _, i in p.instructions() if isinstance(i, Load) and p.buffers[i.buf].layer is not None)
        flops = sum(i.flops for _, _, i in p.instructions() if isinstance(i, Compute))
        stored = sum(i.bytes for _, _, i in p.instructions() if isinstance(i, Store))
        return kv, flops, stored

    verify, wide, plain = (program(Workload(4, 2048, 128, 5)), program(Workload(20, 2048, 128)),
                           program(Workload(4, 2048, 128)))
    assert program(Workload(4, 2048, 128, 1)).to_text() == art.plan.programs["decode"].to_text()
    (kv_v, flops_v, stored_v), (kv_w, flops_w, stored_w), (kv_p, _, _) = totals(verify), totals(wide), totals(plain)
    assert kv_v == kv_p == art.plan.memory.kv_bytes and kv_w == 5 * kv_p
    assert flops_v == flops_w and stored_v == stored_w > 0
    assert simulate(verify, target).makespan_s < simulate(wide, target).makespan_s
    # The plan times these steps: each more draft costs more, none less than a plain step.
    timed = {p.positions: p.time_per_token_s for p in art.plan.prediction.verify if p.fits}
    assert sorted(timed) == [2, 3, 5, 9]
    steps = [art.plan.prediction.time_per_token_s, *(timed[n] for n in sorted(timed))]
    assert steps == sorted(steps) and steps[0] < steps[-1]
    assert timed[5] == pytest.approx(simulate(verify, target).makespan_s, rel=1e-9)


def test_a_mixed_step_prefills_a_chunk_beside_the_decodes_for_one_weight_read(decode_programs):
    """Chunked prefill's mixed step: three sequences decode while the fourth, a prompt arriving,
    brings 64 of its tokens, in one step. Its weights and caches are read once (the same bytes as a
    plain step), its FLOPs are those of 3 + 64 tokens, and it hands the host one row of logits per
    sequence, not 64 for the chunk. The plan times it at MIXED_CHUNKS: each larger chunk costs more,
    and the step costs less than the plain step and a chunk's own step taken one after the other."""
    from aviatorc.schedule import MIXED_CHUNKS

    art, program = decode_programs
    target = art.plan.target

    def totals(p):
        weights = sum(i.bytes for _, _, i in p.instructions() if isinstance(i, Load) and p.buffers[i.buf].layer is None)
        kv = sum(i.bytes for _, _, i in p.instructions() if isinstance(i, Load) and p.buffers[i.buf].layer is not None)
        flops = sum(i.flops for _, _, i in p.instructions() if isinstance(i, Compute))
        host = sum(i.bytes for _, _, i in p.instructions() if isinstance(i, Host))
        return weights, kv, flops, host

    plain, mixed, wide = program(Workload(4, 2048, 128)), program(Workload(4, 2048, 128, chunk=64)), \
        program(Workload(67, 2048, 128))
    (w_p, kv_p, _, host_p), (w_m, kv_m, flops_m, host_m), (_, _, flops_w, _) = totals(plain), totals(mixed), totals(wide)
    assert w_m == w_p and kv_m == kv_p and host_m == host_p
    assert flops_m < flops_w  # the wide step's logits are 67 rows, the mixed step's 4
    timed = {p.chunk: p.time_per_token_s for p in art.plan.prediction.mixed if p.fits}
    assert sorted(timed) == list(MIXED_CHUNKS)
    steps = [art.plan.prediction.time_per_token_s, *(timed[c] for c in MIXED_CHUNKS)]
    assert steps == sorted(steps) and steps[0] < steps[-1]
    assert timed[64] == pytest.approx(simulate(mixed, target).makespan_s, rel=1e-9)
    apart = simulate(plain, target).makespan_s + simulate(program(Workload(1, 2048, 128, 64)), target).makespan_s
    assert timed[64] < apart
