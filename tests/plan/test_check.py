"""The plan checker: real plans pass; each way of corrupting one is rejected with its rule and place.

Every negative case starts from a copy of a real plan of the tiny llama (see conftest.py),
breaks one thing (an instruction of a program, or a tile of the plan, through
`dataclasses.replace`), and asserts the `check` field, the stream and the step, and for several
the whole message.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from aviatorc.errors import AviatorError
from aviatorc.plan.check import CHECKS, PlanCheckError, check_plan, check_program, held_bytes
from aviatorc.plan.ir import (
    Buffer,
    Compute,
    Free,
    Instruction,
    Load,
    Part,
    Program,
    Recv,
    Send,
    Signal,
    Store,
    ValueRef,
    Wait,
    format_instr,
    tile_name,
)
from aviatorc.plan.plan import PlannedTile
from aviatorc.target import Target, load_target
from tests.plan.plans import CASES, Built

PlanFor = Callable[[str], Built]


# -- helpers ----------------------------------------------------------------------------------


def program_of(built: Built, phase: str = "decode") -> Program:
    """A copy to corrupt: the session's plans are shared."""
    return copy.deepcopy(built.plan.programs[phase])


def check(built: Built, program: Program, *, target: Target | None = None, chiplets: Any = None,
          tiles: Sequence[PlannedTile] | None = None) -> None:
    check_program(program, built.plan.tiles if tiles is None else tiles, target or built.target,
                  chiplets=built.plan.chiplets if chiplets is None else chiplets)


def rejected(built: Built, program: Program, **kwargs: Any) -> PlanCheckError:
    with pytest.raises(PlanCheckError) as info:
        check(built, program, **kwargs)
    return info.value


def with_tile(built: Built, index: int, **changes: Any) -> tuple[PlannedTile, ...]:
    """The plan's tiles with tile `index` changed."""
    tiles = built.plan.tiles
    return tiles[:index] + (dataclasses.replace(tiles[index], **changes),) + tiles[index + 1:]


def another_channel(built: Built, channel: int | None) -> int:
    """A channel of the plan's target other than `channel`."""
    return next(h for h in range(built.target.num_channels) if h != channel)


def step_of(program: Program, chiplet: int, kind: type[Instruction], operand: Any = None, *, after: int = -1) -> int:
    """The first step of stream `chiplet` after `after` of this kind (and operand)."""
    for step, ins in enumerate(program.streams[chiplet]):
        if step > after and isinstance(ins, kind) and (operand is None or ins.operand_value == operand):
            return step
    raise LookupError(f"no {kind.op} {operand} in stream {chiplet}")


@dataclasses.dataclass(frozen=True)
class StagedUse:
    chiplet: int
    buffer: str
    tile: int | None
    load: int
    wait: int
    compute: int
    free: int


def first_staged(program: Program, *, weight: bool = True) -> StagedUse:
    """The first staging buffer loaded (a weight tile's, or with weight=False a KV block's)."""
    for c, step, ins in program.instructions():
        if not isinstance(ins, Load) or (program.buffers[ins.buf].tile is not None) != weight:
            continue
        name = ins.buf
        wait = step_of(program, c, Wait, name, after=step)
        compute = next(s for s, i in enumerate(program.streams[c]) if isinstance(i, Compute) and name in i.bufs)
        return StagedUse(c, name, program.buffers[name].tile, step, wait, compute,
                         step_of(program, c, Free, name, after=compute))
    raise LookupError("the plan stages no buffer")


def sole_transfer(program: Program) -> tuple[int, int, Send, int, int]:
    """A send whose value goes to one chiplet only: (src, send step, send, dst, recv step)."""
    destinations: dict[tuple[ValueRef, int], int] = {}
    for c, _, ins in program.instructions():
        if isinstance(ins, Send):
            destinations[(ins.value, c)] = destinations.get((ins.value, c), 0) + 1
    for c, step, ins in program.instructions():
        if isinstance(ins, Send) and destinations[(ins.value, c)] == 1:
            dst = ins.to
            recv = next(s for s, i in enumerate(program.streams[dst])
                        if isinstance(i, Recv) and i.value == ins.value and i.src == c)
            return c, step, ins, dst, recv
    raise LookupError("no transfer")


# -- valid plans ------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_real_plans_pass(plan_for: PlanFor, case: str) -> None:
    built = plan_for(case)
    check_plan(built.plan, built.target)


@pytest.mark.parametrize("case", ["streaming", "streaming-kv", "no-prefetch", "two-cards", "subset-streaming",
                                  "chiplet-channels"])
def test_streaming_cases_really_stream(plan_for: PlanFor, case: str) -> None:
    """The positive cases above cover staging only if their plans stage something."""
    counts = plan_for(case).plan.programs["decode"].count()
    assert counts.get("load", 0) > 0 and counts["load"] == counts["wait"] == counts["free"]


def test_resident_spread_case_is_resident_on_several_chiplets(plan_for: PlanFor) -> None:
    """The resident cases below corrupt transfers and streams of a plan that streams nothing: they
    rest on this one holding every tile in SRAM on more than one chiplet, with sends between them."""
    plan = plan_for("resident-spread").plan
    assert not any(t.streamed for t in plan.tiles)
    program = plan.programs["decode"]
    assert len({t.chiplet for t in plan.tiles}) > 1 and len(program.streams) > 1
    assert program.count().get("send", 0) > 0


def test_chiplet_channels_case_has_a_channel_per_chiplet(plan_for: PlanFor) -> None:
    """The per-chiplet-channel case really has several channels, and its loads name one of them
    (the pooled mock has one): the wrong-channel cases below rest on it."""
    built = plan_for("chiplet-channels")
    assert built.target.num_channels == built.target.num_chiplets == 4
    assert plan_for("streaming").target.num_channels == 1
    program = built.plan.programs["decode"]
    loads = [(c, ins) for c, _, ins in program.instructions() if isinstance(ins, Load)]
    assert loads
    for _, ins in loads:
        tile = program.buffers[ins.buf].tile
        assert tile is not None and ins.channel == built.plan.tiles[tile].channel


def test_prefetch_off_loads_just_before_the_wait(plan_for: PlanFor) -> None:
    program = plan_for("no-prefetch").plan.programs["decode"]
    loads = 0
    for c, step, ins in program.instructions():
        if isinstance(ins, Load):
            assert program.streams[c][step + 1] == Wait(ins.buf)
            loads += 1
    assert loads > 0


def test_check_plan_is_fast(plan_for: PlanFor) -> None:
    built = plan_for("streaming-kv")
    start = time.perf_counter()
    for _ in range(10):
        check_plan(built.plan, built.target)
    assert (time.perf_counter() - start) / 10 < 0.1


def test_linear_on_a_hundred_thousand_instructions(plan_for: PlanFor) -> None:
    """A staging buffer reloaded after each free (allowed) and a long ping-pong of transfers."""
    built = plan_for("streaming")
    program = program_of(built)
    use = first_staged(program)
    stream = program.streams[use.chiplet]
    load, compute = stream[use.load], stream[use.compute]
    for _ in range(20_000):
        stream += [load, Wait(use.buffer), compute, Free(use.buffer)]
    a, b = sorted(program.streams)[:2]
    for i in range(10_000):
        program.streams[a].append(Send(ValueRef(f"ping.{i}"), to=b, bytes=2))
        program.streams[b].append(Recv(ValueRef(f"ping.{i}"), src=a, bytes=2))
    assert sum(len(s) for s in program.streams.values()) > 100_000
    start = time.perf_counter()
    check(built, program)
    assert time.perf_counter() - start < 5.0  # well under a second: a quadratic pass would take minutes


def test_error_type_fields_and_context(plan_for: PlanFor) -> None:
    built = plan_for("streaming")
    program = program_of(built)
    use = first_staged(program)
    del program.streams[use.chiplet][use.wait]
    error = rejected(built, program)
    assert isinstance(error, AviatorError)
    assert error.fields == {"check": "missing-wait", "stream": use.chiplet, "step": use.compute - 1}
    bad_line = next(line for line in error.context.splitlines() if line.startswith(">>"))
    assert bad_line.split()[1] == str(use.compute - 1) and "compute node=" in bad_line
    assert error.details().startswith(str(error) + "\n")


def test_check_names_are_kebab_case() -> None:
    assert all(re.fullmatch(r"[a-z]+(-[a-z]+)*", name) for name in CHECKS)
    assert "wrong-channel" in CHECKS and "wrong-card" not in CHECKS
    with pytest.raises(ValueError, match="unknown plan check"):
        PlanCheckError("x", check="no-such-rule")


# -- 2. loads, waits and frees ----------------------------------------------------------------


def test_missing_load(plan_for: PlanFor) -> None:
    built = plan_for("streaming")
    program = program_of(built)
    use = first_staged(program)
    del program.streams[use.chiplet][use.load]
    error = rejected(built, program)
    assert (error.check, error.stream, error.step) == ("missing-load", use.chiplet, use.wait - 1)
    assert str(error) == (f"stream {use.chiplet} step {use.wait - 1}: wait for staging buffer '{use.buffer}' "
                          "with no live load (it is never loaded)")


def test_load_after_its_wait(plan_for: PlanFor) -> None:
    built = plan_for("streaming")
    program = program_of(built)
    use = first_staged(program)
    stream = program.streams[use.chiplet]
    load = stream.pop(use.load)
    stream.insert(use.wait, load)  # now just after the wait
    error = rejected(built, program)
    assert (error.check, error.stream, error.step) == ("missing-load", use.chiplet, use.wait - 1)
    assert str(error).endswith(f"wait for staging buffer '{use.buffer}' before its load at step {use.wait}")


def test_compute_without_load_or_wait(plan_for: PlanFor) -> None:
    built = plan_for("streaming")
    program = program_of(built)
    use = first_staged(program)
    stream = program.streams[use.chiplet]
    del stream[use.wait]
    del stream[use.load]
    error = rejected(built, program)
    assert (error.check, error.stream, error.step) == ("missing-load", use.chiplet, use.compute - 2)
    assert "reads staging buffer" in str(error) and str(error).endswith("(it is never loaded)")


def test_missing_wait(plan_for: PlanFor) -> None:
    built = plan_for("streaming-kv")
    program = program_of(built)
    use = first_staged(program, weight=False)  # a KV block: the rule is the same as for a weight tile
    assert use.tile is None and program.buffers[use.buffer].layer is not None
    del program.streams[use.chiplet][use.wait]
    error = rejected(built, program)
    assert (error.check, error.stream, error.step) == ("missing-wait", use.chiplet, use.compute - 1)
    assert f"reads staging buffer '{use.buffer}' (loaded at step {use.load}) with no wait" in str(error)


def test_use_after_free(plan_for: PlanFor) -> None:
    built = plan_for("streaming")
    program = program_of(built)
    use = first_staged(program)
    stream = program.streams[use.chiplet]
    free = stream.pop(use.free)
    stream.insert(use.compute, free)  # the free now comes right before its compute
    compute = stream[use.compute + 1]
    assert isinstance(compute, Compute)
    error = rejected(built, program)
    assert (error.check, error.stream, error.step) == ("use-after-free", use.chiplet, use.compute + 1)
    assert str(error) == (f"stream {use.chiplet} step {use.compute + 1}: compute '{compute.node}' reads staging "
                          f"buffer '{use.buffer}' after its free at step {use.compute}")


def test_unfreed_buffer(plan_for: PlanFor) -> None:
    built = plan_for("no-prefetch")
    program = program_of(built)
    use = first_staged(program)
    del program.streams[use.chiplet][use.free]
    error = rejected(built, program)
    assert (error.check, error.stream, error.step) == ("unfreed-buffer", use.chiplet, use.load)
    assert f"staging buffer '{use.buffer}' loaded here is never freed" in str(error)


def test_double_load(plan_for: PlanFor) -> None:
    built = plan_for("streaming")
    program = program_of(built)
    use = first_staged(program)
    stream = program.streams[use.chiplet]
    stream.insert(use.load + 1, stream[use.load])
    error = rejected(built, program)
    assert (error.check, error.stream, error.step) == ("double-load", use.chiplet, use.load + 1)
    assert f"(loaded at step {use.load}, not freed)" in str(error)


def test_double_free(plan_for: PlanFor) -> None:
    built = plan_for("streaming")
    program = program_of(built)
    use = first_staged(program)
    stream = program.streams[use.chiplet]
    stream.insert(use.free + 1, stream[use.free])
    error = rejected(built, program)
    assert (error.check, error.stream, error.step) == ("double-free", use.chiplet, use.free + 1)


def test_load_and_free_of_a_non_staging_buffer(plan_for: PlanFor) -> None:
    built = plan_for("streaming")
    program = program_of(built)
    use = first_staged(program)
    stream = program.streams[use.chiplet]
    scratch = f"scratch.{use.chiplet}"
    load = stream[use.load]
    assert isinstance(load, Load)
    stream[use.load] = dataclasses.replace(load, buf=scratch)
    error = rejected(built, program)
    assert (error.check, error.stream, error.step) == ("not-staging", use.chiplet, use.load)
    assert str(error).endswith(f"load '{scratch}' into a scratch buffer: loads fill staging buffers")

    program = program_of(built)
    program.streams[use.chiplet].insert(0, Free(scratch))
    error = rejected(built, program)
    assert (error.check, error.stream, error.step) == ("not-staging", use.chiplet, 0)


def test_load_bigger_than_its_buffer(plan_for: PlanFor) -> None:
    built = plan_for("streaming")
    program = program_of(built)
    use = first_staged(program)
    stream = program.streams[use.chiplet]
    load = stream[use.load]
    assert isinstance(load, Load)
    stream[use.load] = dataclasses.replace(load, bytes=program.buffers[use.buffer].bytes + 1)
    error = rejected(built, program)
    assert (error.check, error.stream, error.step) == ("load-size", use.chiplet, use.load)


# -- 1. buffers, channels and chiplets --------------------------------------------------------


def test_load_from_a_channel_that_does_not_exist(plan_for: PlanFor) -> None:
    built = plan_for("streaming-kv")
    program = program_of(built)
    use = first_staged(program, weight=False)
    stream = program.streams[use.chiplet]
    load = stream[use.load]
    assert isinstance(load, Load)
    stream[use.load] = dataclasses.replace(load, channel=1)
    error = rejected(built, program)
    assert (error.check, error.stream, error.step) == ("wrong-channel", use.chiplet, use.load)
    assert str(error) == (f"stream {use.chiplet} step {use.load}: load '{use.buffer}' from LPDDR channel 1 but the "
                          "target has 1 channel(s)")


def test_store_to_a_channel_that_does_not_exist(plan_for: PlanFor) -> None:
    built = plan_for("streaming-kv")
    program = program_of(built)
    c, step, store = next((c, s, i) for c, s, i in program.instructions() if isinstance(i, Store))
    program.streams[c][step] = dataclasses.replace(store, channel=3)
    error = rejected(built, program)
    assert (error.check, error.stream, error.step) == ("wrong-channel", c, step)
    assert str(error).startswith(f"stream {c} step {step}: store '{store.what}' ")  # (a store goes *to* it)
    assert str(error).endswith("LPDDR channel 3 but the target has 1 channel(s)")


@pytest.mark.parametrize("case", ["two-cards", "chiplet-channels"])
def test_load_from_the_wrong_channel(plan_for: PlanFor, case: str) -> None:
    """A load naming a channel the target has, but not the one the plan streams its tile from:
    another card's (two pooled cards) or another chiplet's (LPDDR per chiplet)."""
    built = plan_for(case)
    program = program_of(built)
    use = first_staged(program)
    stream = program.streams[use.chiplet]
    load = stream[use.load]
    assert isinstance(load, Load) and use.tile is not None
    channel = load.channel
    assert channel == built.plan.tiles[use.tile].channel
    other = another_channel(built, channel)
    stream[use.load] = dataclasses.replace(load, channel=other)
    error = rejected(built, program)
    assert (error.check, error.stream, error.step) == ("wrong-channel", use.chiplet, use.load)
    assert str(error) == (f"stream {use.chiplet} step {use.load}: load '{use.buffer}' streams tile "
                          f"{tile_name(use.tile)} from channel {other} but the plan streams it from channel {channel}")


def test_tile_moved_to_another_channel(plan_for: PlanFor) -> None:
    """The same rule from the plan's side: the program unchanged, the tile's channel moved."""
    built = plan_for("chiplet-channels")
    program = program_of(built)
    use = first_staged(program)
    assert use.tile is not None
    channel = built.plan.tiles[use.tile].channel
    other = another_channel(built, channel)
    error = rejected(built, program, tiles=with_tile(built, use.tile, channel=other))
    assert (error.check, error.stream, error.step) == ("wrong-channel", use.chiplet, use.load)
    assert str(error).endswith(f"from channel {channel} but the plan streams it from channel {other}")


def test_load_across_the_link_from_another_chiplets_channel(plan_for: PlanFor) -> None:
    """A tile streamed from another chiplet's channel (it crosses the link) is a valid plan
    when the tile and the load agree on the channel: the rule is agreement, not locality."""
    built = plan_for("chiplet-channels")
    program = program_of(built)
    use = first_staged(program)
    assert use.tile is not None
    other = another_channel(built, built.plan.tiles[use.tile].channel)
    for c, step, ins in program.instructions():
        if isinstance(ins, Load) and ins.buf == use.buffer:
            program.streams[c][step] = dataclasses.replace(ins, channel=other)
    check(built, program, tiles=with_tile(built, use.tile, channel=other))


def test_tile_streamed_from_a_channel_that_does_not_exist(plan_for: PlanFor) -> None:
    built = plan_for("streaming")
    program = program_of(built)
    use = first_staged(program)
    assert use.tile is not None
    error = rejected(built, program, tiles=with_tile(built, use.tile, channel=5))
    assert (error.check, error.stream, error.step) == ("wrong-channel", None, None)
    assert str(error) == f"tile {tile_name(use.tile)} streams from LPDDR channel 5 but the target has 1 channel(s)"


def test_staging_a_resident_tile(plan_for: PlanFor) -> None:
    built = plan_for("streaming")
    program = program_of(built)
    use = first_staged(program)
    assert use.tile is not None
    resident = with_tile(built, use.tile, chiplet=use.chiplet, channel=None)
    program.add_buffer(dataclasses.replace(program.buffers[use.buffer], name=f"w.{tile_name(use.tile)}",
                                           kind="resident"))
    error = rejected(built, program, tiles=resident)
    assert (error.check, error.stream, error.step) == ("wrong-channel", use.chiplet, use.load)
    assert str(error).endswith(f"but the plan keeps it resident on chiplet {use.chiplet}")


def test_undeclared_buffer(plan_for: PlanFor) -> None:
    built = plan_for("resident-spread")
    program = program_of(built)
    c, step, ins = next((c, s, i) for c, s, i in program.instructions() if isinstance(i, Compute) and i.bufs)
    program.streams[c][step] = dataclasses.replace(ins, bufs=("w.nowhere",))
    error = rejected(built, program)
    assert (error.check, error.stream, error.step) == ("undeclared-buffer", c, step)
    assert str(error).endswith("compute names buffer 'w.nowhere' that the program does not declare")


def test_resident_tile_read_on_another_chiplet(plan_for: PlanFor) -> None:
    built = plan_for("resident-spread")
    program = program_of(built)
    c, _, ins = next((c, s, i) for c, s, i in program.instructions() if isinstance(i, Compute) and i.bufs
                     and program.buffers[i.bufs[0]].kind == "resident")
    other = next(o for o in sorted(program.streams) if o != c)
    program.streams[other].append(ins)
    error = rejected(built, program)
    step = len(program.streams[other]) - 1
    assert (error.check, error.stream, error.step) == ("wrong-chiplet", other, step)
    assert str(error) == (f"stream {other} step {step}: compute names buffer '{ins.bufs[0]}' of chiplet {c} "
                          f"on chiplet {other}")


def test_resident_buffer_where_the_plan_does_not_keep_it(plan_for: PlanFor) -> None:
    built = plan_for("resident-spread")
    program = program_of(built)
    buffer = next(b for b in program.buffers.values() if b.kind == "resident")
    assert buffer.tile is not None
    other = next(c for c in sorted(program.streams) if c != buffer.chiplet)
    program.buffers[buffer.name] = dataclasses.replace(buffer, chiplet=other)
    error = rejected(built, program)
    assert (error.check, error.stream, error.step) == ("wrong-chiplet", other, None)
    assert str(error) == (f"resident buffer '{buffer.name}' holds tile {tile_name(buffer.tile)} on chiplet {other} "
                          f"but the plan has it resident on chiplet {buffer.chiplet}")


def test_staged_tile_computed_off_its_compute_chiplet(plan_for: PlanFor) -> None:
    built = plan_for("streaming")
    program = program_of(built)
    use = first_staged(program)
    assert use.tile is not None
    other = next(c for c in built.plan.chiplets if c != use.chiplet)  # one pooled channel: any chiplet streams
    error = rejected(built, program, tiles=with_tile(built, use.tile, compute_chiplet=other))
    assert (error.check, error.stream, error.step) == ("wrong-chiplet", use.chiplet, use.load)
    assert str(error).endswith(f"load uses tile {tile_name(use.tile)} (buffer '{use.buffer}') on chiplet "
                               f"{use.chiplet} but it computes on chiplet {other}")


def test_missing_resident_buffer(plan_for: PlanFor) -> None:
    built = plan_for("resident-spread")
    program = program_of(built)
    buffer = next(b for b in program.buffers.values() if b.kind == "resident")
    del program.buffers[buffer.name]
    error = rejected(built, program)
    assert (error.check, error.stream, error.step) == ("missing-resident", buffer.chiplet, None)


def test_buffer_of_an_unknown_tile(plan_for: PlanFor) -> None:
    built = plan_for("streaming")
    program = program_of(built)
    use = first_staged(program)
    program.buffers[use.buffer] = dataclasses.replace(program.buffers[use.buffer], tile=9999)
    error = rejected(built, program)
    assert (error.check, error.stream) == ("unknown-tile", use.chiplet)
    assert str(error) == (f"buffer '{use.buffer}' holds tile t9999 but the plan has tiles "
                          f"t0..t{len(built.plan.tiles) - 1}")


# -- 3. capacity ------------------------------------------------------------------------------


def test_held_bytes_counts_everything_but_staging(plan_for: PlanFor) -> None:
    program = plan_for("streaming-kv").plan.programs["decode"]
    by_hand: dict[int, int] = {}
    for b in program.buffers.values():
        if b.kind in ("resident", "kv", "scratch"):
            by_hand[b.chiplet] = by_hand.get(b.chiplet, 0) + b.bytes
    assert held_bytes(program) == by_hand


def test_over_capacity_with_less_sram(plan_for: PlanFor) -> None:
    built = plan_for("resident-spread")
    program = program_of(built)
    held = held_bytes(program)
    sram = max(held.values()) - 1
    fullest = min(c for c, n in held.items() if n > sram)
    small = load_target("mock", overrides={"chiplet.sram_bytes": sram})
    error = rejected(built, program, target=small)
    assert (error.check, error.stream, error.step) == ("over-capacity", fullest, None)
    assert re.fullmatch(rf"chiplet {fullest} holds {held[fullest]:,} bytes for the whole program \(.*resident "
                        rf"[0-9,]+, scratch [0-9,]+\) but has {sram:,} bytes of SRAM", str(error)), str(error)


def test_over_capacity_with_a_larger_staging_buffer(plan_for: PlanFor) -> None:
    built = plan_for("streaming")
    program = program_of(built)
    use = first_staged(program)
    sram = built.target.chiplet.sram_bytes
    program.buffers[use.buffer] = dataclasses.replace(program.buffers[use.buffer], bytes=sram)
    stream = program.streams[use.chiplet]
    load = stream[use.load]
    assert isinstance(load, Load)
    stream[use.load] = dataclasses.replace(load, bytes=sram)
    error = rejected(built, program)
    assert (error.check, error.stream, error.step) == ("over-capacity", use.chiplet, use.load)
    assert str(error).startswith(f"stream {use.chiplet} step {use.load}: load '{use.buffer}' ({sram:,} bytes) "
                                 f"brings chiplet {use.chiplet} to ")
    assert str(error).endswith(f"but it has {sram:,} bytes of SRAM")


def test_staging_within_capacity_is_counted_from_load_to_free(plan_for: PlanFor) -> None:
    """A target with just enough SRAM for the held buffers plus the plan's peak staging passes;
    one byte less fails at the load that reaches the peak (this plan's KV blocks set it)."""
    built = plan_for("streaming-kv")
    program = program_of(built)
    held = held_bytes(program)
    peaks: dict[int, tuple[int, int]] = {}  # chiplet -> (peak bytes, step of the first load reaching it)
    for c, stream in program.streams.items():
        live = 0
        for step, ins in enumerate(stream):
            if isinstance(ins, Load | Free):
                live += program.buffers[ins.buf].bytes * (1 if isinstance(ins, Load) else -1)
                if isinstance(ins, Load) and held.get(c, 0) + live > peaks.get(c, (0, 0))[0]:
                    peaks[c] = (held.get(c, 0) + live, step)
    sram = max(p for p, _ in peaks.values())
    assert sram > max(held.values()), "staging should set this plan's peak"
    check(built, program, target=load_target("mock", overrides={"chiplet.sram_bytes": sram}))
    c, (_, step) = min((c, p) for c, p in peaks.items() if p[0] == sram)
    error = rejected(built, program, target=load_target("mock", overrides={"chiplet.sram_bytes": sram - 1}))
    assert (error.check, error.stream, error.step) == ("over-capacity", c, step)


# -- 4. transfers and events ------------------------------------------------------------------


def test_unmatched_recv(plan_for: PlanFor) -> None:
    built = plan_for("resident-spread")
    program = program_of(built)
    src, send_step, send, dst, recv_step = sole_transfer(program)
    del program.streams[src][send_step]
    error = rejected(built, program)
    assert (error.check, error.stream, error.step) == ("unmatched-recv", dst, recv_step)
    assert str(error) == (f"stream {dst} step {recv_step}: recv '{send.value}' src={src} bytes={send.bytes} "
                          f"has no matching send: stream {src} never sends it")


def test_recv_of_another_part(plan_for: PlanFor) -> None:
    """A value and a part of it are different transfers: a recv of the whole value does not
    match a send of its columns (and the other way round)."""
    built = plan_for("resident-spread")
    program = program_of(built)
    src, send_step, send, dst, recv_step = sole_transfer(program)
    recv = program.streams[dst][recv_step]
    assert isinstance(recv, Recv)
    other = ValueRef(send.value.name, None if send.value.part is not None else Part.of("cols", 0, 1))
    program.streams[dst][recv_step] = dataclasses.replace(recv, value=other)
    error = rejected(built, program)
    assert (error.check, error.stream, error.step) == ("unmatched-recv", dst, recv_step)
    assert str(error).startswith(f"stream {dst} step {recv_step}: recv '{other}' src={src}")


def test_recv_of_other_bytes(plan_for: PlanFor) -> None:
    built = plan_for("resident-spread")
    program = program_of(built)
    src, send_step, send, dst, recv_step = sole_transfer(program)
    recv = program.streams[dst][recv_step]
    assert isinstance(recv, Recv)
    program.streams[dst][recv_step] = dataclasses.replace(recv, bytes=send.bytes + 1)
    error = rejected(built, program)
    assert (error.check, error.stream, error.step) == ("unmatched-recv", dst, recv_step)
    assert str(error).endswith(f"but stream {src} sends it with bytes={send.bytes} (step {send_step})")


def test_unmatched_send(plan_for: PlanFor) -> None:
    built = plan_for("resident-spread")
    program = program_of(built)
    src, send_step, _, dst, recv_step = sole_transfer(program)
    del program.streams[dst][recv_step]
    error = rejected(built, program)
    assert (error.check, error.stream, error.step) == ("unmatched-send", src, send_step)
    assert str(error).endswith(f"has no matching recv: stream {dst} never receives it")


def test_duplicate_transfer(plan_for: PlanFor) -> None:
    built = plan_for("resident-spread")
    program = program_of(built)
    src, send_step, _, dst, recv_step = sole_transfer(program)
    program.streams[dst].insert(recv_step + 1, program.streams[dst][recv_step])
    program.streams[src].insert(send_step + 1, program.streams[src][send_step])
    error = rejected(built, program)
    assert (error.check, error.stream, error.step) == ("duplicate-transfer", dst, recv_step + 1)


def test_unmatched_wait(plan_for: PlanFor) -> None:
    built = plan_for("resident-spread")
    program = program_of(built)
    c = min(program.streams)
    program.streams[c].insert(0, Wait("ghost"))
    error = rejected(built, program)
    assert (error.check, error.stream, error.step) == ("unmatched-wait", c, 0)
    assert str(error) == (f"stream {c} step 0: wait 'ghost' can never fire: no stream signals it and it is not a "
                          "load of this stream")


def test_wait_on_another_streams_load(plan_for: PlanFor) -> None:
    built = plan_for("streaming")
    program = program_of(built)
    use = first_staged(program)
    other = next(c for c in sorted(program.streams) if c != use.chiplet)
    program.streams[other].append(Wait(use.buffer))
    error = rejected(built, program)
    assert (error.check, error.stream, error.step) == ("unmatched-wait", other, len(program.streams[other]) - 1)
    assert "a stream waits only on its own loads" in str(error)


def test_signal_and_wait_across_streams(plan_for: PlanFor) -> None:
    built = plan_for("resident-spread")
    program = program_of(built)
    a, b = sorted(program.streams)[:2]
    program.streams[a].insert(0, Signal("ready"))
    program.streams[b].insert(0, Wait("ready"))
    check(built, program)


# -- 5. deadlock ------------------------------------------------------------------------------


def test_deadlock_two_streams_recv_before_they_send(plan_for: PlanFor) -> None:
    """Stream a sends x to b and later receives y from b, which b sends after receiving x.
    Moving a's recv of y before its send of x makes each wait for the other."""
    built = plan_for("streaming")  # with each layer beside its home, the resident cases send one way only
    program = program_of(built)
    streams = program.streams
    found = None
    for a, i, send in program.instructions():
        if not isinstance(send, Send) or found:
            continue
        b = send.to
        k = next(s for s, r in enumerate(streams[b]) if isinstance(r, Recv) and r.value == send.value and r.src == a)
        back = next((r for r in streams[b][k + 1:] if isinstance(r, Send) and r.to == a), None)
        if back is not None:
            j = next(s for s, r in enumerate(streams[a]) if isinstance(r, Recv) and r.value == back.value
                     and r.src == b)
            found = (a, i, j, b, k)
    assert found, "the plan has no round trip between two streams"
    a, i, j, b, k = found
    streams[a].insert(i, streams[a].pop(j))
    check_transfers_still_match = program.count()
    assert check_transfers_still_match == built.plan.programs["decode"].count()
    error = rejected(built, program)
    blocked = error.fields["blocked"]
    # The pair blocks where it was cut; streams downstream of it may block behind them.
    assert blocked[a] == i and blocked[b] == k
    assert sorted(error.fields["cycle"]) == sorted([a, b])
    first, second = sorted([(a, i), (b, k)])
    assert (error.check, error.stream, error.step) == ("deadlock", *first)
    recv_a, recv_b = (format_instr(program.streams[c][s]) for c, s in (first, second))
    assert str(error).startswith(f"stream {first[0]} step {first[1]}: deadlock: stream {first[0]} at step "
                                 f"{first[1]} ({recv_a}) waits on stream {second[0]}, stream {second[0]} at step "
                                 f"{second[1]} ({recv_b}) waits on stream {first[0]}")
    if len(blocked) > 2:
        assert "; blocked behind them: stream " in str(error)


def test_deadlock_on_signals(plan_for: PlanFor) -> None:
    built = plan_for("resident-spread")
    program = program_of(built)
    a, b = sorted(program.streams)[:2]
    program.streams[a][0:0] = [Wait("e1"), Signal("e2")]
    program.streams[b][0:0] = [Wait("e2"), Signal("e1")]
    error = rejected(built, program)
    assert (error.check, error.stream, error.step) == ("deadlock", a, 0)
    assert str(error).startswith(f"stream {a} step 0: deadlock: stream {a} at step 0 (wait e1) waits on stream {b}, "
                                 f"stream {b} at step 0 (wait e2) waits on stream {a}")


# -- 6. allowed chiplets ----------------------------------------------------------------------


def test_tile_outside_the_allowed_chiplets(plan_for: PlanFor) -> None:
    built = plan_for("subset")
    assert built.plan.chiplets == (0, 1)
    tile = next(t for t, planned in enumerate(built.plan.tiles) if planned.chiplet is not None)
    error = rejected(built, program_of(built), tiles=with_tile(built, tile, chiplet=3))
    assert (error.check, error.stream, error.step) == ("outside-chiplets", 3, None)
    assert str(error) == f"tile {tile_name(tile)} is resident on chiplet 3, outside the allowed chiplets 0, 1"


def test_compute_chiplet_outside_the_allowed_chiplets(plan_for: PlanFor) -> None:
    built = plan_for("subset-streaming")
    tile = next(t for t, planned in enumerate(built.plan.tiles) if planned.streamed)
    error = rejected(built, program_of(built), tiles=with_tile(built, tile, compute_chiplet=0))
    assert (error.check, error.stream, error.step) == ("outside-chiplets", 0, None)
    assert str(error) == f"tile {tile_name(tile)} computes on chiplet 0, outside the allowed chiplets 1, 2"


def test_plan_checked_against_fewer_chiplets(plan_for: PlanFor) -> None:
    built = plan_for("subset")
    error = rejected(built, program_of(built), chiplets=(0,))
    assert (error.check, error.stream) == ("outside-chiplets", 1)
    assert "outside the allowed chiplets 0" in str(error)


def test_buffer_outside_the_allowed_chiplets(plan_for: PlanFor) -> None:
    built = plan_for("subset")
    program = program_of(built)
    program.add_buffer(Buffer("scratch.3", 3, 8, "scratch"))
    error = rejected(built, program)
    assert (error.check, error.stream, error.step) == ("outside-chiplets", 3, None)
    assert str(error) == "buffer 'scratch.3' lies on chiplet 3, outside the allowed chiplets 0, 1"


def test_stream_outside_the_allowed_chiplets(plan_for: PlanFor) -> None:
    built = plan_for("subset")
    program = program_of(built)
    program.streams[3] = []
    error = rejected(built, program)
    assert (error.check, error.stream, error.step) == ("outside-chiplets", 3, None)
    assert str(error) == "stream 3 runs on a chiplet outside the allowed chiplets 0, 1"


def test_send_outside_the_allowed_chiplets(plan_for: PlanFor) -> None:
    built = plan_for("subset")
    program = program_of(built)
    src, send_step, send, dst, recv_step = sole_transfer(program)
    program.streams[src][send_step] = dataclasses.replace(send, to=3)
    del program.streams[dst][recv_step]
    error = rejected(built, program)
    assert (error.check, error.stream, error.step) == ("outside-chiplets", src, send_step)
    assert str(error).endswith("to chiplet 3, outside the allowed chiplets 0, 1")


def test_unknown_chiplet_and_wrong_target(plan_for: PlanFor) -> None:
    built = plan_for("resident-spread")
    error = rejected(built, program_of(built), chiplets=(0, 1, 2, 3, 4))
    assert error.check == "unknown-chiplet"
    assert str(error) == "allowed chiplet 4 does not exist: the target 'mock' has chiplets 0..3"
    # Tiles placed for a bigger machine (two cards): a tile computes on chiplet 6 of a one-card target.
    error = rejected(built, program_of(built), tiles=with_tile(built, 0, compute_chiplet=6))
    assert (error.check, error.stream, error.step) == ("wrong-target", None, None)
    assert str(error) == "tile t0 names chiplet 6 but the target 'mock' has chiplets 0..3"
