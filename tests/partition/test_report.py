"""The placement table (issue 10, item 4) and the partitioner's progress (item 2): empty
chiplets folded into one row, the embedding and the head named, the bound's limitation beside
its gap; CP-SAT's best objective and gap reported as it solves."""

from __future__ import annotations

import logging
import re

from aviatorc.formats import WeightFormat
from aviatorc.models import llama_config
from aviatorc.partition import make_problem, partition
from aviatorc.partition.cpsat import solve_layer
from aviatorc.partition.decompose import layer_units
from aviatorc.partition.greedy import greedy_layer
from aviatorc.partition.report import BOUND_LEAVES_OUT, layer_runs, render_table
from aviatorc.partition.weights import weights_from_config
from aviatorc.progress import progress_of
from aviatorc.target import load_target


def _tiny(layers: int = 3) -> dict:
    return dict(llama_config("llama-3-8b"), num_hidden_layers=layers, hidden_size=256, intermediate_size=512,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)


def _rows(placement) -> dict[str, tuple[str, str]]:
    table = render_table(placement)
    names, values, details = ([str(cell) for cell in column._cells] for column in table.columns)
    assert len(set(names)) == len(names)
    return {name: (value, detail) for name, value, detail in zip(names, values, details, strict=True)}


def test_empty_chiplets_are_one_row_and_the_embedding_and_head_are_named():
    specs = weights_from_config(_tiny(), WeightFormat("int8"), embedding_format=WeightFormat("fp16"))
    placement = partition(specs, load_target("corsair", cards=4), time_limit_s=1, solver="greedy")
    rows = _rows(placement)
    empty = [c for c, nbytes in enumerate(placement.chiplet_bytes) if nbytes == 0]
    held = [c for c, nbytes in enumerate(placement.chiplet_bytes) if nbytes]
    assert len(empty) >= 16 and held  # before: one "0 B" row per empty chiplet, 32 chiplet rows in all
    assert [name for name in rows if name.startswith("chiplet ")] == [f"chiplet {c} (card {c // 8})" for c in held]
    runs = [[empty[0], empty[0]]]
    for c in empty[1:]:
        if c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    assert rows[f"{len(empty)} empty chiplets"] == ("0 B", "chiplets " + ",".join(
        str(a) if a == b else f"{a}-{b}" for a, b in runs))
    # before: "layer -1" and "layer 3"
    assert [name for name, _ in layer_runs(placement)] == ["embedding", "layers 0..2", "head"]
    assert "layer -1" not in rows and "layer 3" not in rows
    assert rows["lower bound"][1] == f"gap {placement.gap:.2%}; {BOUND_LEAVES_OUT}"


def test_a_model_without_layers_is_not_called_an_embedding():
    from aviatorc.partition.tiling import WeightSpec

    specs = [WeightSpec("fc1.weight", -1, "linear", 64, 128, WeightFormat("fp16"), "x"),
             WeightSpec("fc2.weight", -1, "linear", 128, 64, WeightFormat("fp16"), "h")]
    placement = partition(specs, load_target("mock"), time_limit_s=1, solver="greedy")
    assert [name for name, _ in layer_runs(placement)] == ["weights outside any layer"]


def test_cp_sat_reports_each_solution_with_its_bound():
    specs = weights_from_config(_tiny(1), WeightFormat("int8"), embedding_format=WeightFormat("fp16"))
    target = load_target("corsair", cards=2)
    problem = make_problem(specs, target)
    tiles = next(t for t in layer_units(problem) if problem.tiles[t[0]].layer == 0)
    free = list(problem.capacity_bytes)
    hint = greedy_layer(problem, tiles, free, None)
    seen: list[tuple[int, float]] = []
    result = solve_layer(problem, tiles, free, hint, deterministic_time=0.2, on_solution=lambda o, b: seen.append((o, b)))
    assert result.status in ("optimal", "feasible") and seen
    assert seen[-1][0] == result.objective_ps  # the last solution reported is the one returned
    assert all(bound <= objective for objective, bound in seen)  # a bound, below every solution
    assert [o for o, _ in seen] == sorted((o for o, _ in seen), reverse=True)  # each one better (or equal)
    quiet = solve_layer(problem, tiles, free, hint, deterministic_time=0.2)
    assert quiet.where == result.where  # observing does not change the search


def test_the_partition_logs_cp_sat_progress_with_objective_and_gap(caplog, monkeypatch):
    import aviatorc.progress

    monkeypatch.setattr(aviatorc.progress, "UPDATES_PER_S", 1e9)  # every update, not ten a second
    specs = weights_from_config(_tiny(2), WeightFormat("int8"), embedding_format=WeightFormat("fp16"))
    with caplog.at_level(logging.INFO, logger="aviatorc"):
        partition(specs, load_target("corsair", cards=2), time_limit_s=2, solver="cpsat")
    events = [progress_of(r) for r in caplog.records if r.name == "aviatorc.partition"]
    assert [e.event for e in events if e is not None and e.event != "update"] == ["start", "end"]
    details = [e.detail for e in events if e is not None and e.event == "update" and "best" in e.detail]
    assert details and all(re.fullmatch(r"layer -?\d+: best -?[\d,]+\.\d{3} us, gap [\d,]+\.\d%", d) for d in details)
    assert events[0].description == "CP-SAT layer solves" and events[0].total == 6


def test_a_fully_streamed_layer_costs_its_streaming_and_no_less():
    # No chiplet has room: every tile of the layer streams from the one card. The objective is
    # then exactly the streaming time; it once went below it (a group could claim the resident
    # tree's "- 1 card" discount without a resident tile).
    specs = weights_from_config(_tiny(1), WeightFormat("int8"), embedding_format=WeightFormat("fp16"))
    target = load_target("corsair", cards=1, overrides={"card.lpddr_attach": "card"})  # one pooled channel
    problem = make_problem(specs, target)
    tiles = next(t for t in layer_units(problem) if problem.tiles[t[0]].layer == 0)
    free = [0] * problem.num_chiplets
    hint = [problem.num_chiplets] * len(problem.tiles)  # everything streams from card 0
    result = solve_layer(problem, tiles, free, hint, deterministic_time=0.2)
    assert result.status == "optimal"
    assert result.objective_ps == sum(problem.stream_ps[t] for t in tiles)
