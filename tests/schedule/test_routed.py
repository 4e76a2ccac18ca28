"""A mixture of experts planned for its routing (issue 22): hot experts resident, loads on demand,
the decode step over sampled routings, the bound in expectation. The tiny Qwen3-MoE (2 layers of
8 experts, top-2) on the mock target with 64 KiB chiplets, so that some experts must stream."""

from __future__ import annotations

import json

import numpy as np
import pytest

import aviatorc
from aviatorc import zoo
from aviatorc.cli import main
from aviatorc.ir.experts import expert_nodes
from aviatorc.partition.weights import weights_from_graph
from aviatorc.plan.ir import Buffer, Compute, Free, Load, Program, Recv, Send, Wait, Workload
from aviatorc.routing import moe_blocks, routing_for
from aviatorc.schedule import bound_inputs, model_facts, simulate
from aviatorc.schedule.bound import physical_bound
from aviatorc.schedule.build import build_program
from aviatorc.schedule.memory import plan_memory
from aviatorc.schedule.routed import expert_members, routed_steps
from aviatorc.schedule.simulate import Activity
from aviatorc.target import load_target

TIGHT = {"chiplet.sram_bytes": 65536, "card.lpddr_attach": "chiplet"}
WORKLOAD = {"batch": 1, "context": 16, "prompt": 8, "time_limit_s": 1.0, "sweep": False, "ranges": False}


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return zoo.write_family_config("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"))


@pytest.fixture(scope="module")
def compiled(config):
    return aviatorc.compile(str(config), target=load_target("mock", overrides=TIGHT), routing="zipf:1.5", **WORKLOAD)


def shares(result) -> dict[tuple[int, int], float]:
    return {(int(layer), e): s for layer, block in result.report.data["routing"]["layers"].items()
            for e, s in enumerate(block["shares"])}


def residency(result) -> dict[tuple[int, int], list[bool]]:
    placement = result.placement
    found: dict[tuple[int, int], list[bool]] = {}
    for tile, w in zip(placement.tiles, placement.where, strict=True):
        if tile.expert >= 0:
            found.setdefault((tile.layer, tile.expert), []).append(w < placement.num_chiplets)
    return found


def test_the_experts_a_step_reads_most_are_the_resident_ones(compiled):
    share, where = shares(compiled), residency(compiled)
    for layer in (0, 1):
        resident = [share[key] for key, tiles in where.items() if key[0] == layer and all(tiles)]
        streamed = [share[key] for key, tiles in where.items() if key[0] == layer and not any(tiles)]
        assert resident and streamed  # the SRAM holds some of each layer's experts, not all
        assert min(resident) > max(streamed)
    # and the SRAM is used: what is left on every chiplet could not hold the smallest streamed expert tile
    placement, plan = compiled.placement, compiled.plan
    free = [plan.target.chiplet.sram_bytes - reserve - held
            for reserve, held in zip(plan.memory.reserve_bytes, placement.chiplet_bytes, strict=True)]
    smallest = min(t.storage_bytes for t, w in zip(placement.tiles, placement.where, strict=True)
                   if t.expert >= 0 and w >= placement.num_chiplets)
    assert max(free) < smallest


def test_a_predictor_that_names_the_routed_experts_hides_their_loads(compiled):
    """The same placement prefetching its experts ahead of their routing: the better the
    predictor, the shorter the step, and a perfect one beats loading on demand."""
    prefetch = compiled.plan.prediction.routing.prefetch
    assert set(prefetch) == {"0.5", "0.8", "1"}
    assert prefetch["0.5"] > prefetch["0.8"] > prefetch["1"]
    plan, routing = compiled.plan, routing_of(compiled)
    program = plan.programs["decode"]
    members = expert_members(compiled.graph, routing, program, compiled.placement, staging_bytes=staging_of(compiled))
    on_demand = routed_steps(program, plan.target, members, routing, 1, all_experts_s=0.0, samples=16)[0].mean_s
    assert prefetch["1"] < on_demand


def test_a_load_the_predictor_missed_starts_when_its_stream_needs_it():
    target = load_target("mock", overrides={"card.lpddr_attach": "chiplet"})  # 2.5 GB/s a channel
    program = Program("decode", Workload())
    program.add_buffer(Buffer("s", 0, 25_000, "staging", tile=0))
    program.emit(0, Load("s", 0, 25_000))  # 10 us
    program.emit(0, Compute("before", (), 0, 0, 5_000_000, "fp16", None, False))  # 5 us of vector work
    program.emit(0, Wait("s"))
    program.emit(0, Free("s"))
    ahead = simulate(program, target).makespan_s
    missed = simulate(program, target, activity=Activity({}, {}, frozenset(), frozenset({"s"}))).makespan_s
    assert ahead == pytest.approx(10e-6) and missed == pytest.approx(15e-6)


def test_a_missed_load_starts_once_its_stream_reaches_its_block():
    """Experts a and b of one block, both 10 us loads on one channel: the predictor named a and
    missed b. With room for both in the staging budget, b starts when the stream first waits on the
    block (a's wait), not at its own wait after a's 5 us of compute: 20 us, not 25."""
    target = load_target("mock", overrides={"card.lpddr_attach": "chiplet"})  # 2.5 GB/s a channel
    program = Program("decode", Workload())
    for buf in ("a", "b"):
        program.add_buffer(Buffer(buf, 0, 25_000, "staging", tile=0))
        program.emit(0, Load(buf, 0, 25_000))
    program.emit(0, Wait("a"))
    program.emit(0, Compute("expert a", (), 0, 0, 5_000_000, "fp16", None, False))
    program.emit(0, Wait("b"))
    for buf in ("a", "b"):
        program.emit(0, Free(buf))
    missed = Activity({}, {}, frozenset(), frozenset({"b"}), {"a": 3, "b": 3}, staging_bytes=50_000)
    assert simulate(program, target, activity=missed).makespan_s == pytest.approx(20e-6)
    no_room = Activity({}, {}, frozenset(), frozenset({"b"}), {"a": 3, "b": 3}, staging_bytes=25_000)
    assert simulate(program, target, activity=no_room).makespan_s == pytest.approx(25e-6)
    unknown = Activity({}, {}, frozenset(), frozenset({"b"}))  # no blocks given: at its own wait
    assert simulate(program, target, activity=unknown).makespan_s == pytest.approx(25e-6)


def test_the_runtime_issues_the_routed_experts_loads_together_within_its_staging():
    """A stream holding strips of experts a, x and b of one block (10 us loads on one channel,
    5 us of compute each), with room in the program's staging for one at a time. The step routes
    to a and b, not x. The program loads b after x's strip is freed, hence after a's compute (30
    us); the runtime skips x, so with room for two it loads b beside a: 25 us. With room for one
    it cannot: b starts when a is freed, 30 us."""
    target = load_target("mock", overrides={"card.lpddr_attach": "chiplet"})  # 2.5 GB/s a channel
    program = Program("decode", Workload())
    for buf in ("a", "x", "b"):
        program.add_buffer(Buffer(buf, 0, 25_000, "staging", tile=0))
    for buf in ("a", "x", "b"):
        program.emit(0, Load(buf, 0, 25_000))
        program.emit(0, Wait(buf))
        program.emit(0, Compute(f"expert {buf}", (), 0, 0, 5_000_000, "fp16", None, False))
        program.emit(0, Free(buf))
    routed = {"compute": {"expert x": 0.0}, "values": {}, "skipped_buffers": frozenset({"x"}),
              "block_of": {"a": 3, "x": 3, "b": 3}}
    assert simulate(program, target, activity=Activity(**routed)).makespan_s == pytest.approx(30e-6)
    assert simulate(program, target, activity=Activity(**routed, staging_bytes=50_000)).makespan_s == \
        pytest.approx(25e-6)
    assert simulate(program, target, activity=Activity(**routed, staging_bytes=25_000)).makespan_s == \
        pytest.approx(30e-6)


def routing_of(result):
    """The routing the compile used, built again from the same spec."""
    return routing_for("zipf:1.5", moe_blocks(result.graph, weights_from_graph(result.graph)))


def staging_of(result) -> int:
    """The staging budget a compile's decode program was built with."""
    return result.plan.memory.staging_bytes_per_chiplet


def plan_parts(result):
    facts = model_facts(result.graph, result.placement.tiles)
    memory = plan_memory(facts, result.placement.tiles, result.plan.target, result.plan.workload,
                         chiplets=result.plan.chiplets)
    return facts, memory


def test_a_skipped_expert_loads_and_computes_nothing(compiled):
    plan, graph = compiled.plan, compiled.graph
    routing = routing_of(compiled)
    members = expert_members(graph, routing, plan.programs["decode"], compiled.placement,
                             staging_bytes=staging_of(compiled))
    streamed = {(t.layer, t.expert) for t, w in zip(compiled.placement.tiles, compiled.placement.where, strict=True)
                if t.expert >= 0 and w >= compiled.placement.num_chiplets}
    layer, expert = sorted(streamed)[0]
    only = {b.layer: np.eye(b.experts)[expert if b.layer == layer else 0] for b in routing.blocks}
    timeline = simulate(plan.programs["decode"], plan.target, activity=members.activity(only))
    buffers = plan.programs["decode"].buffers
    loaded = {buffers[s.name.split(" -> ")[0]].tile for s in timeline.spans if s.kind == "load"}
    tiles = compiled.placement.tiles
    experts_loaded = {(tiles[t].layer, tiles[t].expert) for t in loaded if tiles[t].expert >= 0}
    assert experts_loaded == {(layer, expert)} | ({(1 - layer, 0)} & streamed)
    owner = {n.name: ref.expert for n, ref in expert_nodes(graph).items()}
    computed = {s.name.split(" [")[0] for s in timeline.spans if s.kind == "compute"}
    ran = {owner[name] for name in computed if name in owner}
    assert ran <= {expert, 0}


def test_every_expert_firing_is_the_program_run_whole(compiled):
    """With nothing skipped, the runtime's issuing of loads within the staging budget is the
    program's own: the same step, and the same SRAM held at every moment."""
    plan = compiled.plan
    routing = routing_of(compiled)
    members = expert_members(compiled.graph, routing, plan.programs["decode"], compiled.placement,
                             staging_bytes=staging_of(compiled))
    assert members.staging_bytes > 0
    every = members.activity({b.layer: np.ones(b.experts) for b in routing.blocks})
    program = plan.programs["decode"]
    pulled, whole = simulate(program, plan.target, activity=every), simulate(program, plan.target)
    assert pulled.makespan_s == whole.makespan_s == plan.prediction.routing.all_experts_s
    assert pulled.peak_sram_bytes() == whole.peak_sram_bytes()


def test_the_runtime_holds_only_the_sram_of_what_it_loads(compiled):
    """A step that skips experts never holds more staged SRAM than the program does with every
    expert running, on any chiplet, though the runtime issues routed loads ahead of their place."""
    plan = compiled.plan
    routing = routing_of(compiled)
    program = plan.programs["decode"]
    members = expert_members(compiled.graph, routing, program, compiled.placement, staging_bytes=staging_of(compiled))
    whole = simulate(program, plan.target).peak_sram_bytes()
    rng = np.random.default_rng(7)
    for _ in range(8):
        shares = {b.layer: b.sample(rng, 1) / 1 for b in routing.blocks}
        step = simulate(program, plan.target, activity=members.activity(shares)).peak_sram_bytes()
        assert all(step[c] <= whole[c] for c in whole)


def test_an_experts_loads_wait_until_the_stream_has_its_routing(compiled, config):
    """Each streamed expert load comes after an instruction of an expert of its block in its
    stream (the input its router's block sent, or a dispatch): from there the routing is known.
    A plan built without the routing prefetches some of them before (so this can fail). (That the
    routed experts' loads then go out together is the runtime's: the test below.)"""
    def loads(program) -> tuple[int, int]:
        """(loads before their block is reached, loads before their own expert is reached)"""
        layer_of = {b.router: b.layer for b in moe_blocks(compiled.graph, compiled.placement.tiles)}
        owner = {n.name: (layer_of[ref.block], ref.expert) for n, ref in expert_nodes(compiled.graph).items()}
        value_owner = {out.name: owner[n.name] for n in expert_nodes(compiled.graph) for out in n.outputs}
        tiles = compiled.placement.tiles
        early_block = early_expert = 0
        for stream in program.streams.values():
            seen: set[tuple[int, int]] = set()
            for ins in stream:
                who = owner.get(ins.node) if isinstance(ins, Compute) else (
                    value_owner.get(ins.value.name) if isinstance(ins, Recv) else None)
                if who is not None:
                    seen.add(who)
                elif isinstance(ins, Load):
                    tile = tiles[program.buffers[ins.buf].tile]
                    if tile.expert >= 0:
                        early_block += all(layer != tile.layer for layer, _ in seen)
                        early_expert += (tile.layer, tile.expert) not in seen
        return early_block, early_expert

    on_demand = loads(compiled.plan.programs["decode"])
    assert on_demand[0] == 0
    facts, memory = plan_parts(compiled)
    prefetching = build_program(facts, compiled.placement, compiled.plan.target, memory, compiled.plan.workload,
                                "decode", chiplets=compiled.plan.chiplets, routed=False)
    assert loads(prefetching)[0] > 0


def test_the_routed_step_lies_between_its_bound_and_every_expert_firing(compiled):
    p = compiled.plan.prediction
    r = p.routing
    assert r.source == "zipf:1.5" and r.samples == 64
    assert p.time_per_token_s == r.mean_s
    assert p.bound.token_s <= min(r.p50_s, r.mean_s)
    assert r.p50_s <= r.p99_s and r.mean_s < r.all_experts_s
    assert r.experts_per_step == pytest.approx(4.0)  # batch 1: top-2 of each of 2 blocks
    # in expectation the bound reads fewer bytes than one reading every expert
    facts, memory = plan_parts(compiled)
    weights = weights_from_graph(compiled.graph)
    target = compiled.plan.target
    inputs = bound_inputs(facts, weights, target, memory)
    dense = physical_bound(weights, target, compiled.plan.workload, inputs, chiplets=compiled.plan.chiplets)
    routed = physical_bound(weights, target, compiled.plan.workload, inputs, chiplets=compiled.plan.chiplets,
                            routing=routing_of(compiled))
    for term in ("sram", "compute"):  # the bytes and FLOPs a step reads and runs
        assert routed.token_terms[term] < 0.8 * dense.token_terms[term]


def test_the_same_routing_gives_a_byte_identical_plan(config, compiled):
    again = aviatorc.compile(str(config), target=load_target("mock", overrides=TIGHT), routing="zipf:1.5", **WORKLOAD)
    assert json.dumps(again.plan.to_dict(), sort_keys=True) == json.dumps(compiled.plan.to_dict(), sort_keys=True)


def test_the_cli_takes_a_routing_file_and_prints_the_routed_step(config, compiled, tmp_path, capsys):
    path = tmp_path / "routing.json"
    path.write_text(json.dumps(compiled.report.data["routing"]))
    out = tmp_path / "model.avc"
    assert main(["compile", str(config), "--target", "mock", "--context", "16", "--prompt", "8", "--no-sweep",
                 "--no-ranges", "--routing", str(path), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "routing file:routing.json: 4.0 of 16 experts a step in expectation" in printed
    assert "P99" in printed
    assert main(["compile", str(config), "--target", "mock", "--routing", "zipf", "-o", str(tmp_path / "x.avc")]) != 0
    assert "unknown routing 'zipf'" in capsys.readouterr().err
    assert not (tmp_path / "x.avc").exists()


def test_a_blocks_home_sends_every_expert_its_input_before_it_waits_on_any(compiled):
    """Dispatches first, then the experts, then the combines: the experts run side by side."""
    program, graph = compiled.plan.programs["decode"], compiled.graph
    inputs = {out.name for n in expert_nodes(graph) if n.op == "MoEDispatch" for out in n.outputs}
    outputs = {c.input(1).name for c in graph.nodes if c.op == "MoECombine"}
    checked = 0
    for stream in program.streams.values():
        sends = [i for i, ins in enumerate(stream) if isinstance(ins, Send) and ins.value.name in inputs]
        waits = [i for i, ins in enumerate(stream) if isinstance(ins, Recv) and ins.value.name in outputs]
        if sends and waits:
            for layer in (0, 1):  # per block: its last send of an expert's input before its first wait
                mine = [i for i in sends if f"layers.{layer}." in stream[i].value.name]
                theirs = [i for i in waits if f"layers.{layer}." in stream[i].value.name]
                if mine and theirs:
                    assert max(mine) < min(theirs)
                    checked += 1
    assert checked


def test_an_expert_on_one_chiplet_runs_there_start_to_end(compiled):
    """Its activation function computes on its weights' chiplet, not at the layer's home."""
    program, placement = compiled.plan.programs["decode"], compiled.placement
    chips: dict[tuple[int, int], set[int]] = {}
    for t, tile in enumerate(placement.tiles):
        if tile.expert >= 0:
            chips.setdefault((tile.layer, tile.expert), set()).add(placement.compute_chiplet[t])
    where = {ins.node: c for c, stream in program.streams.items() for ins in stream if isinstance(ins, Compute)}
    facts = model_facts(compiled.graph, placement.tiles)
    moved = 0
    for node, ref in expert_nodes(compiled.graph).items():
        home = chips[(facts.layer_of_node[node.name], ref.expert)]
        if node.op not in ("MoEDispatch", "MatMul") and len(home) == 1 and node.name in where:
            assert where[node.name] in home
            moved += 1
    assert moved


def test_streamed_experts_cut_in_strips_load_from_every_channel(tmp_path, monkeypatch):
    """Mixtral-shaped experts (gate_up 2048 x 14336, down 7168 x 2048: 23 MB at int4), 4 layers, on
    one corsair card whose chiplets hold 48 MiB: about half the experts stream. Cut in 1 MiB
    strips, a step's two routed experts a layer load side by side from all 8 channels; one tile
    per weight, they queue on a few."""
    import json

    import aviatorc.partition as partition
    from aviatorc.partition.tiling import EXPERT_STRIP_BYTES, EXPERT_TILE_BYTES

    config = {**zoo.family_config("mixtral"), "hidden_size": 2048, "intermediate_size": 7168,
              "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 4,
              "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    target = load_target("corsair", overrides={"chiplet.sram_bytes": 48 * 2**20})
    options = {**WORKLOAD, "quant": "int4", "routing": "uniform"}
    cut = aviatorc.compile(str(path), target=target, **options)
    monkeypatch.setattr(partition, "expert_tile_bytes", lambda *args: EXPERT_TILE_BYTES)
    whole = aviatorc.compile(str(path), target=target, **options)
    strips = [t for t in cut.placement.tiles if t.expert == 0 and t.layer == 0]
    # each weight in strips of at most 1 MiB, more than the card's 8 channels; else one tile or two each
    assert all(len([t for t in strips if t.role == role]) > 8 for role in ("gate_up_proj", "down_proj"))
    assert all(t.storage_bytes <= EXPERT_STRIP_BYTES for t in strips)
    assert len([t for t in whole.placement.tiles if t.expert == 0 and t.layer == 0]) <= 3
    # each streamed expert on as many channels as it has strips (up to all 8): the least-loaded
    # channel alone would stack a routed expert's strips on the few channels streaming least so far
    channels: dict[tuple[int, int], list[int]] = {}
    num_c = cut.placement.num_chiplets
    for tile, w in zip(cut.placement.tiles, cut.placement.where, strict=True):
        if tile.expert >= 0 and w >= num_c:
            channels.setdefault((tile.layer, tile.expert), []).append(w - num_c)
    num_h = cut.plan.target.num_channels
    assert channels and all(len(set(hs)) == min(len(hs), num_h) for hs in channels.values())
    # the same bound (the same bytes and FLOPs), a step at least 2x faster
    assert cut.plan.prediction.bound.token_s == pytest.approx(whole.plan.prediction.bound.token_s,
                                                                      rel=1e-3)
    assert cut.plan.prediction.time_per_token_s < 0.5 * whole.plan.prediction.time_per_token_s


def test_a_routing_file_with_co_activation_plans_with_it_and_reports_it(config, tmp_path):
    """Tokens that pick experts 0 and 4 or 1 and 5 (of 8, top 2), half the time each: the compile
    samples each step's tokens from those sets (a step of one token runs exactly one pair), and its
    report keeps them, so the file it wrote plans the same again."""
    sets = [[[0, 4], 1], [[1, 5], 1]]
    path = tmp_path / "sets.json"
    path.write_text(json.dumps({"layers": {"0": {"sets": sets}, "1": {"sets": sets}}}))
    result = aviatorc.compile(str(config), target=load_target("mock", overrides=TIGHT), routing=str(path), **WORKLOAD)
    layers = result.report.data["routing"]["layers"]
    assert [block["sets"] for block in layers.values()] == [[[[0, 4], 0.5], [[1, 5], 0.5]]] * 2
    assert layers["0"]["shares"] == [0.5, 0.5, 0, 0, 0.5, 0.5, 0, 0]
    assert result.plan.prediction.routing.experts_per_step == pytest.approx(2 * 2)  # one pair per layer, 2 layers
    again_path = tmp_path / "again.json"
    again_path.write_text(json.dumps(result.report.data["routing"]))
    again = aviatorc.compile(str(config), target=load_target("mock", overrides=TIGHT), routing=str(again_path),
                             **WORKLOAD)
    assert again.plan.prediction.routing.mean_s == result.plan.prediction.routing.mean_s


def test_the_prefill_estimate_counts_an_experts_activations_on_its_routed_tokens(compiled):
    """Auto's choice of prefill (`memory._card_crossing_s`): the activations a stationary prefill
    sends between cards are, for an expert's nodes, those of the tokens routed to it. With every
    share 0 only the dense nodes remain; uniform top-2 of 8 adds a quarter of what the experts
    would send if every token reached every expert (the estimate before: gpt-oss-120b x4 at batch
    16 took the pipelined prefill, 6x slower to the first token than the stationary one)."""
    from aviatorc.routing import BlockRouting, Routing
    from aviatorc.schedule.memory import _card_crossing_s

    facts = model_facts(compiled.graph, compiled.placement.tiles)
    target = load_target("corsair", cards=2)
    uniform = routing_for("uniform", moe_blocks(compiled.graph, weights_from_graph(compiled.graph)))
    silent = Routing("none", tuple(BlockRouting(b.layer, b.top_k, (0.0,) * b.experts) for b in uniform.blocks))
    every, routed, dense = (_card_crossing_s(facts, target, 256, 2, routing=r) for r in (None, uniform, silent))
    assert {b.top_k / b.experts for b in uniform.blocks} == {0.25}
    assert every > routed > dense > 0
    assert routed - dense == pytest.approx(0.25 * (every - dense), rel=1e-9)
