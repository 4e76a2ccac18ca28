"""The partitioner: invariants on random tile sets and targets, determinism, brute force on tiny
instances, hand-computed objectives, infeasible requests explained before solving, and the
8B / 4-card bound gap."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aviatorc.errors import InfeasibleError
from aviatorc.formats import WeightFormat
from aviatorc.models import llama_config
from aviatorc.partition import make_problem, partition
from aviatorc.partition.bound import lower_bound
from aviatorc.partition.check import check_placement
from aviatorc.partition.decompose import place_layers
from aviatorc.partition.report import render_table
from aviatorc.partition.tiling import WeightSpec
from aviatorc.partition.weights import weights_from_config
from aviatorc.target import load_target

FORMATS = [WeightFormat("fp16"), WeightFormat("int8"), WeightFormat("int4", 32), WeightFormat("mxint4", 32)]


@st.composite
def cases(draw):
    """A few layers of random weights and a mock-derived target small enough to force streaming sometimes."""
    layers = draw(st.integers(1, 3))
    specs = []
    if draw(st.booleans()):
        specs.append(WeightSpec("emb", -1, "embedding", draw(st.integers(16, 400)), 64, WeightFormat("fp16"), "ids"))
    for layer in range(layers):
        for i in range(draw(st.integers(1, 3))):
            k = 16 * draw(st.integers(1, 24))
            n = 16 * draw(st.integers(1, 24))
            group = draw(st.integers(0, 1))
            specs.append(WeightSpec(f"layers.{layer}.w{i}", layer, "linear", k, n, draw(st.sampled_from(FORMATS)),
                                    f"layers.{layer}.in{group}"))
    overrides = {
        "package.chiplets": draw(st.integers(1, 2)),
        "card.packages": draw(st.integers(1, 2)),
        "server.cards": draw(st.integers(1, 3)),
        "chiplet.sram_bytes": draw(st.integers(8, 256)) * 1024,
    }
    return specs, load_target("mock", overrides=overrides)


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_invariants_determinism_and_greedy(case):
    specs, target = case
    try:
        first = partition(specs, target, time_limit_s=0.5, check=False)
    except InfeasibleError as error:
        # Explained before solving, and only when a strip one matrix unit wide cannot fit anywhere.
        smallest = max(s.format.storage_bytes(s.k, target.matrix_unit_n) for s in specs if not s.is_embedding)
        assert "cannot be split below" in str(error) and smallest > target.usable_sram_bytes_per_chiplet
        return
    check_placement(first, specs, target)  # capacity, each tile once, bytes, objective, bound
    assert len(first.where) == len(first.tiles) == len(first.compute_chiplet)
    assert all(b <= target.usable_sram_bytes_per_chiplet for b in first.chiplet_bytes)
    for t, (w, c) in enumerate(zip(first.where, first.compute_chiplet, strict=True)):
        assert c == w if w < target.num_chiplets else target.card_of(c) == w - target.num_chiplets, t
    again = partition(specs, target, time_limit_s=0.5)
    assert again.where == first.where and again.objective_ps == first.objective_ps


def test_solver_improves_on_greedy_somewhere():
    # Unequal tiles on 4 chiplets: LPT is not optimal, and CP-SAT finds a cheaper layer than the
    # greedy run (computed apart, by the decomposition without a solver).
    specs, target = _solver_case()
    placement = _partition(specs, target)
    greedy = place_layers(make_problem(specs, target, tiles_per_weight=1), None)
    assert placement.objective_ps < greedy.cost_ps
    assert placement.bound_ps <= placement.objective_ps


def test_streaming_when_it_does_not_fit():
    specs = weights_from_config(_tiny_config(layers=6), WeightFormat("fp16"))
    target = load_target("mock")
    placement = partition(specs, target, time_limit_s=1)
    assert placement.streamed_bytes > 0
    assert placement.resident_bytes <= target.usable_sram_bytes_total
    assert placement.streamed_read_bytes_per_step >= placement.min_streamed_read_bytes
    table = render_table(placement)
    assert table.row_count > 5
    report = json.loads(json.dumps(placement.to_dict()))
    assert report["status"] in ("optimal", "feasible", "greedy")
    assert len(report["chiplets"]) == target.num_chiplets


def _tiny_config(layers=2):
    return dict(llama_config("llama-3-8b"), num_hidden_layers=layers, hidden_size=256, intermediate_size=512,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)


def test_infeasible_without_streaming_is_explained_with_fixes():
    specs = weights_from_config(_tiny_config(layers=6), WeightFormat("fp16"))
    with pytest.raises(InfeasibleError) as info:
        partition(specs, load_target("mock"), streaming=False)
    error = info.value
    assert error.fields["needed_bytes"] > error.fields["available_bytes"]
    text = str(error)
    assert "\n" not in text and "mock.toml" in text
    assert "int4" in text and "--cards" in text and "streaming" in text


def test_unsupported_format_is_refused():
    specs = [WeightSpec("w", 0, "linear", 64, 64, WeightFormat("fp32"))]
    with pytest.raises(InfeasibleError, match="does not support weight format"):
        partition(specs, load_target("corsair"))


def test_a_tile_larger_than_any_sram_is_explained():
    specs = [WeightSpec("w", 0, "linear", 200_000, 64, WeightFormat("fp16"))]
    with pytest.raises(InfeasibleError, match="cannot be split below"):
        partition(specs, load_target("mock"))


def test_lpddr_capacity_is_checked():
    specs = weights_from_config(llama_config("llama-3-8b"), WeightFormat("fp16"))  # 16 GB
    with pytest.raises(InfeasibleError, match="SRAM and the 8 LPDDR channel") as info:
        partition(specs, load_target("corsair", overrides={"card.lpddr_bytes": 10_000_000_000}))
    assert "--cards 2" in str(info.value)


def test_bound_is_below_greedy_on_llama_70b():
    specs = weights_from_config(llama_config("llama-3-70b"), WeightFormat("int4", 128))
    problem = make_problem(specs, load_target("corsair", cards=4))
    bound = lower_bound(problem)
    assert bound.min_streamed_bytes > 20 * 2**30  # 70B at INT4 streams on 4 cards
    greedy = place_layers(problem, None)
    assert 0.8 * greedy.cost_ps <= bound.value_ps <= greedy.cost_ps  # below, and not trivially


def test_llama_3_8b_on_four_cards_meets_its_bound_gap():
    specs = weights_from_config(llama_config("llama-3-8b"), WeightFormat("int4", 128))
    placement = partition(specs, load_target("corsair", cards=4), time_limit_s=2)
    # 8B at INT4 sits in SRAM on 4 cards; only the FP16 embedding may stream (a row per token).
    assert all(w < placement.num_chiplets for t, w in zip(placement.tiles, placement.where, strict=False) if not t.is_embedding)
    # 6.95% measured: the bound does not charge collection bytes or hand-offs (3 of them cross
    # cards where a card fills); before those were charged the gap was under 5%.
    assert placement.gap <= 0.08


def _without_time(placement):
    report = placement.to_dict()
    report.pop("solve_time_s")
    return report


def _solver_case():
    """Layers of unequal whole-weight tiles on 4 chiplets: LPT is not optimal and CP-SAT improves
    some layers, so a run that skipped solves would give another placement."""
    # k = 512: compute outweighs the transfers, so spreading a layer pays (at k = 64 every layer
    # is cheapest on one chiplet once the outputs' collection is charged).
    specs = [WeightSpec(f"layers.{layer}.w{i}", layer, "linear", 512, 16 * w, WeightFormat("fp16"), f"x{layer}")
             for layer in range(3) for i, w in enumerate([7, 5, 4, 4, 3, 3, 3][:7 - layer])]
    return specs, load_target("mock")


def _partition(specs, target):
    return partition(specs, target, time_limit_s=1, tiles_per_weight=1)


def test_two_runs_give_identical_placements():
    specs, target = _solver_case()
    first = _partition(specs, target)
    assert any(s.method.startswith("cpsat") for s in first.solves)
    assert _without_time(_partition(specs, target)) == _without_time(first)
    assert first.warnings == ()


def test_a_jumping_clock_does_not_change_the_placement(monkeypatch):
    """The old code stopped solving once `time_limit_s` of wall time had passed. Now the budget is
    a count of solves with deterministic time each: a clock that jumps well past `time_limit_s`
    (but not past the generous safety net) changes nothing."""
    import time

    from aviatorc.partition import solve_budget

    specs, target = _solver_case()
    steady = _partition(specs, target)
    real = time.monotonic
    calls = [0]
    jump = solve_budget(1).wall_limit_s / 100  # 100 calls' worth of jumps stay under the safety net

    def jumping() -> float:
        calls[0] += 1
        return real() + jump * calls[0]

    monkeypatch.setattr(time, "monotonic", jumping)
    jumped = _partition(specs, target)
    monkeypatch.setattr(time, "monotonic", real)
    assert 1 < calls[0] < 100 and jump * 2 > 1  # the clock did pass time_limit_s
    assert jumped.warnings == ()
    assert _without_time(jumped) == _without_time(steady)


def test_the_wall_clock_safety_net_is_reported(monkeypatch):
    import time

    specs, target = _solver_case()
    real = time.monotonic
    calls = [0]

    def runaway() -> float:
        calls[0] += 1
        return real() + 1e6 * calls[0]

    monkeypatch.setattr(time, "monotonic", runaway)
    placement = _partition(specs, target)
    monkeypatch.setattr(time, "monotonic", real)
    assert not any(s.method.startswith("cpsat") for s in placement.solves)
    assert placement.warnings and "safety net" in placement.warnings[0]
    assert placement.to_dict()["warnings"] == list(placement.warnings)
    assert placement.objective_ps == placement.greedy_objective_ps  # still complete and checked


def test_llama_3_8b_int8_gap_to_the_bound():
    """8B INT8 fills 4 cards: the head lands on SRAM scraps over all 32 chiplets (its broadcast
    and collection cost 12 us, still far below streaming it), and 7 layer boundaries cross a card
    or package. 13.2% above the bound measured (the bound charges neither)."""
    specs = weights_from_config(llama_config("llama-3-8b"), WeightFormat("int8"))
    placement = partition(specs, load_target("corsair", cards=4), time_limit_s=2)
    assert placement.gap <= 0.15


def test_three_cards_place_without_crashing():
    # Aligned blocks must tile the machine: spreads of 2 cards do not exist on 3.
    specs = weights_from_config(_tiny_config(layers=2), WeightFormat("int8"))
    target = load_target("mock", cards=3)
    placement = partition(specs, target, time_limit_s=0.5)  # checked: bound <= objective
    assert all(b <= target.usable_sram_bytes_per_chiplet for b in placement.chiplet_bytes)


def test_auto_runs_cp_sat_only_where_the_greedy_gap_is_above_its_threshold(monkeypatch):
    # The unequal-tiles case: the greedy placement is well above the bound, so auto solves and
    # gets CP-SAT's cheaper placement. Raising the threshold over that gap skips every solve.
    from aviatorc import partition as partition_module

    specs, target = _solver_case()
    greedy = partition(specs, target, tiles_per_weight=1, solver="greedy")
    gap = (greedy.objective_ps - greedy.bound_ps) / greedy.bound_ps
    assert gap > partition_module.AUTO_GAP
    auto = partition(specs, target, tiles_per_weight=1, solver="auto", time_limit_s=5)
    cpsat = partition(specs, target, tiles_per_weight=1, solver="cpsat", time_limit_s=5)
    assert auto.where == cpsat.where and auto.objective_ps < greedy.objective_ps
    assert "CP-SAT layer solves ran" in auto.solver_note and f"{gap:.2%}" in auto.solver_note
    monkeypatch.setattr(partition_module, "AUTO_GAP", gap + 0.01)
    skipped = partition(specs, target, tiles_per_weight=1, solver="auto", time_limit_s=5)
    assert skipped.where == greedy.where and skipped.status == "greedy" and not skipped.solves[0].method.startswith("cpsat")
    assert "no CP-SAT solve" in skipped.solver_note
