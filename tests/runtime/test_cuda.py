"""The cuda backend: the sim's instructions, rules and kernels, with the plan's loads on a copy
stream, its computes on a compute stream and its waits as events between them.

Everywhere (no GPU needed):
- without CUDA, `Session(..., device="cuda")` is refused and says what is missing;
- the CPU debug device (`CudaBackend(..., device="cpu")`: the same code path with the pool in
  host memory and host clocks for events) gives the sim's outputs and accounts every copy;
- the pool is laid out like the plan's SRAM: staging slots are reused, live ones never overlap;
- a broken plan faults with the sim's rule, before anything reaches the streams.

On a GPU only (skipped here without one): fp32 zoo plans on cuda against the sim, a streaming
plan's copy / compute / overlap figures, and greedy generation equal to the sim's tokens.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from aviatorc.backends.cuda import CudaBackend, _Slot

import aviatorc
from aviatorc.plan.ir import Compute, Free, Load
from aviatorc.runtime import NotRunnableError, RuntimeFault, Session

# The sim tests' compiles (keys "llama", "llama:stream": 24 KiB per chiplet, so tiles stream; "gpt2:int4").
from tests.runtime.test_session_sim import SOLVER_S, compiled, feeds_of  # noqa: F401
from tests.zoo_fixtures import decode_onnx_path, zoo_dir, zoo_onnx  # noqa: F401

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build of torch")

# The CPU debug device against the sim: every whole node runs the same numpy kernel; a strip's
# GEMM runs in torch's BLAS instead of numpy's, which orders float32 sums differently (measured
# 6.7e-8 on llama's logits of magnitude ~1).
CPU_ATOL = 1e-5
# A GPU against the sim, fp32: cuBLAS blocks its sums differently again (TF32 stays off: torch's
# default float32 matmul precision is "highest"); the brief's bound for fp32 plans.
GPU_ATOL = 1e-4


def on(session: Session, device: str) -> CudaBackend:
    """The cuda backend of the session's run program on `device` ("cuda", or "cpu" to debug)."""
    return CudaBackend(session.program, session.graph, session.weights, sram_bytes=session.target.chiplet.sram_bytes,
                       device=device)


# -- everywhere ---------------------------------------------------------------------------


@pytest.mark.skipif(HAS_CUDA, reason="this machine has CUDA: the device is not refused")
def test_without_cuda_the_cuda_device_is_refused_saying_what_is_missing(compiled):  # noqa: F811
    with pytest.raises(NotRunnableError, match=r"device 'cuda' needs a CUDA GPU and a CUDA build of torch; this "
                                               rf"torch is {re.escape(torch.__version__)} .*with no CUDA device") as info:
        Session(compiled("llama"), device="cuda")
    assert info.value.hint is not None and "device='sim'" in info.value.hint


@pytest.mark.parametrize("key", ["llama", "llama:stream", "gpt2:int4"])
def test_the_cpu_debug_device_runs_the_cuda_path_and_gives_the_sims_outputs(key, compiled):  # noqa: F811
    session = Session(compiled(key))
    feeds = feeds_of(key.split(":")[0])
    want = session.run(feeds)
    backend = on(session, "cpu")
    for _ in range(2):  # the second run reuses the pool and the pinned tiles of the first
        got, counts = backend.run(feeds)
        assert set(got) == set(want)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=0, atol=CPU_ATOL)
    assert counts.instructions == session.program.count()  # every instruction of the program, once
    figures = counts.extra["cuda"]
    # Every load of a weight tile is a copy (a staged KV chunk is not: the cache is the session's).
    tiles = [session.program.buffers[ins.buf].tile for _, _, ins in session.program.instructions()
             if isinstance(ins, Load) and session.program.buffers[ins.buf].tile is not None]
    assert figures["copies"] == len(tiles)
    assert figures["device_computes"] > 0 and figures["compute_ms"] > 0
    assert figures["device_computes"] + figures["host_computes"] == counts.instructions["compute"]
    assert figures["overlap"] == 0.0  # host work runs when issued: nothing overlaps
    assert figures["cold_start_ms"] == 0.0  # paid by the first run only
    assert figures["copied_bytes"] == sum(session.weights.tile(t).size * 4 for t in tiles)
    assert (figures["copy_ms"] > 0) == bool(tiles)


def test_the_pool_reuses_staging_slots_and_never_overlaps_live_ones(compiled):  # noqa: F811
    session = Session(compiled("llama:stream"))
    layout = on(session, "cpu").layout
    program = session.program
    staged_total = 0
    for c, stream in sorted(program.streams.items()):
        live: dict[str, _Slot] = {}
        staged = 0
        for step, ins in enumerate(stream):
            if isinstance(ins, Load) and (c, step) in layout.staging:
                slot = layout.staging[(c, step)]
                staged += slot.rows * slot.cols
                for other in live.values():
                    assert slot.stop <= other.offset or other.stop <= slot.offset, f"chiplet {c} step {step}"
                live[ins.buf] = slot
            elif isinstance(ins, Free):
                live.pop(ins.buf, None)
        resident = sum(s.rows * s.cols for (chiplet, _), s in layout.resident.items() if chiplet == c)
        assert resident <= layout.per_chiplet[c] <= resident + staged + 64 * len(stream)  # 64: alignment
        staged_total += resident + staged
    # A chiplet's region holds its resident tiles and what it stages at once, not all it stages.
    assert sum(layout.per_chiplet.values()) == layout.elements < staged_total


def test_a_broken_plan_faults_with_the_sims_rule(compiled, tmp_path):  # noqa: F811
    artifact = aviatorc.load(compiled("llama:stream").save(tmp_path / "llama.avc"))
    stream = next(s for _, s in sorted(artifact.programs["prefill"].streams.items())
                  if any(isinstance(i, Free) for i in s))
    j = next(j for j, ins in enumerate(stream) if isinstance(ins, Free))
    freed = stream[j]
    assert isinstance(freed, Free)
    i = max(k for k in range(j) if isinstance(stream[k], Compute) and freed.buf in stream[k].bufs)  # type: ignore[union-attr]
    free = stream.pop(j)
    stream.insert(i, free)  # freed before the compute that reads it
    session = Session(artifact)
    with pytest.raises(RuntimeFault) as info:
        on(session, "cpu").run(feeds_of("llama"))
    assert info.value.rule == "use-after-free" and info.value.step == i + 1


# -- on a GPU -----------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("key", ["llama", "gpt2", "llama:stream", "gpt2:int4"])
def test_zoo_plans_on_cuda_give_the_sims_outputs(key, compiled):  # noqa: F811
    feeds = feeds_of(key.split(":")[0])
    want = Session(compiled(key)).run(feeds)
    got = Session(compiled(key), device="cuda").run(feeds)
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=GPU_ATOL)


@needs_cuda
def test_a_streaming_plan_on_cuda_measures_copy_compute_and_overlap(compiled):  # noqa: F811
    session = Session(compiled("llama:stream"))
    backend = on(session, "cuda")
    backend.run(feeds_of("llama"))  # the cold start
    _, counts = backend.run(feeds_of("llama"))
    figures = counts.extra["cuda"]
    assert figures["copies"] == counts.instructions["load"] > 0
    assert figures["copy_ms"] > 0 and figures["compute_ms"] > 0
    assert 0.0 <= figures["overlap"] <= 1.0
    assert figures["busy_ms"] <= figures["copy_ms"] + figures["compute_ms"] + 1e-6
    assert figures["busy_ms"] <= figures["wall_ms"] + 1e-6


@needs_cuda
def test_greedy_generation_on_cuda_equals_the_sims_tokens(zoo_dir):  # noqa: F811
    result = aviatorc.compile(str(decode_onnx_path("llama", zoo_dir, "flat")), target="mock", context=48, prompt=8,
                              time_limit_s=SOLVER_S)
    ids = feeds_of("llama")["input_ids"][0]
    want = Session(result).generate(ids, 16)
    np.testing.assert_array_equal(Session(result, device="cuda").generate(ids, 16), want)
