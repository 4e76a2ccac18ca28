"""The machine model: LPDDR channels as the hardware has them, the fixed latencies, the bound of
every regime, and the ranges the assumed figures span. Hand-built programs are timed by hand
from the mock target (aviatorc/target/descriptions/mock.toml): LPDDR 10 GB/s per card, SRAM
1 TB/s and vector units 1 TB/s per chiplet, die-to-die 100 GB/s and 100 ns, PCIe 1 GB/s and 1 us.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import aviatorc
from aviatorc.errors import TargetError
from aviatorc.models import llama_config
from aviatorc.plan.ir import Buffer, Compute, Free, Host, Load, Program, Send, Store, ValueRef, Wait, Workload
from aviatorc.schedule import simulate
from aviatorc.target import load_target
from tests.zoo_fixtures import zoo_dir, zoo_onnx  # noqa: F401

PER_CHIPLET = {"card.lpddr_attach": "chiplet"}  # mock: 4 channels of 2.5 GB/s, one per chiplet


def target_file(folder: Path, base: str = "mock", **overrides: object) -> str:
    """A target file: `base` with `overrides` (dotted keys), resolved, as a user would write it."""
    path = folder / f"{base}-{abs(hash(tuple(sorted(overrides.items()))))}.toml"
    path.write_text(load_target(base, overrides=dict(overrides) or None).to_toml())
    return str(path)


def staged(program: Program, chiplet: int, name: str, channel: int, nbytes: int) -> None:
    """Load a staging buffer from `channel` into `chiplet`, wait for it, free it."""
    program.add_buffer(Buffer(name, chiplet, nbytes, "staging", tile=len(program.buffers)))
    program.emit(chiplet, Load(name, channel, nbytes))
    program.emit(chiplet, Wait(name))
    program.emit(chiplet, Free(name))


# -- LPDDR channels ---------------------------------------------------------------------------


def test_a_load_from_another_chiplets_channel_crosses_the_link_and_is_charged_there():
    target = load_target("mock", overrides=PER_CHIPLET)
    near, far = Program("decode", Workload()), Program("decode", Workload())
    staged(near, 1, "s", 1, 25_000)  # chiplet 1's own channel: 25 KB at 2.5 GB/s = 10 us
    staged(far, 1, "s", 0, 25_000)  # chiplet 0's channel, into chiplet 1 over their die-to-die link
    near_t, far_t = simulate(near, target), simulate(far, target)
    assert near_t.makespan_s == pytest.approx(10e-6)
    assert not [s for s in near_t.spans if s.track.startswith("link")]
    link = [s for s in far_t.spans if s.track.startswith("link die_to_die")]
    assert len(link) == 1 and link[0].kind == "load"  # charged on the link, not only on the channel
    # Cut-through: the link (25 KB at 100 GB/s = 0.25 us) finishes with the channel, then 100 ns of latency.
    assert far_t.makespan_s == pytest.approx(10e-6 + 100e-9)
    # Pooled per card (schema 1's model), the same load crosses nothing.
    pooled = simulate(far, load_target("mock"))
    assert pooled.makespan_s == pytest.approx(25_000 / 10e9) and not [s for s in pooled.spans if s.track.startswith("link")]


def test_two_tiles_on_one_channel_serialize_and_on_two_channels_overlap():
    target = load_target("mock", overrides=PER_CHIPLET)
    one, two = Program("decode", Workload()), Program("decode", Workload())
    staged(one, 0, "a", 0, 25_000)
    staged(one, 1, "b", 0, 25_000)  # both from channel 0
    staged(two, 0, "a", 0, 25_000)
    staged(two, 1, "b", 1, 25_000)  # each from its own
    assert simulate(one, target).makespan_s == pytest.approx(20e-6 + 100e-9)  # 2 x 10 us, then b's link latency
    assert simulate(two, target).makespan_s == pytest.approx(10e-6)
    assert simulate(two, target).busy_fraction_max("lpddr") == pytest.approx(1.0)


def test_the_placement_records_each_streamed_tiles_channel_and_balances_them(zoo_onnx, tmp_path):  # noqa: F811
    target = target_file(tmp_path, **{"chiplet.sram_bytes": 8192, **PER_CHIPLET})
    # The chunked prefill: at 8 KiB a chiplet, the stationary prefill's SRAM (a layer's staged tiles,
    # the hand-off) leaves the weights so little that a few whole tiles decide the balance.
    art = aviatorc.compile(str(zoo_onnx("llama")), target=target, quant="int8", prompt=8, prefill="chunked")
    streamed = [t for t in art.plan.tiles if t.channel is not None]
    assert streamed and all(t.chiplet is None for t in streamed)
    assert {t.channel for t in streamed} == {0, 1, 2, 3}  # all four channels stream
    # Each load names its tile's channel (the checker proves it; here it is read off the program), and
    # what a decode step reads (an embedding tile: only its looked-up row) is spread over the channels.
    program = art.plan.programs["decode"]
    per_channel: dict[int, int] = {}
    for _, _, ins in program.instructions():
        if isinstance(ins, Load) and program.buffers[ins.buf].tile is not None:
            assert ins.channel == art.plan.tiles[program.buffers[ins.buf].tile].channel  # type: ignore[index]
            per_channel[ins.channel] = per_channel.get(ins.channel, 0) + ins.bytes
    assert max(per_channel.values()) < 0.4 * sum(per_channel.values())


# -- the fixed latencies ----------------------------------------------------------------------


def test_vector_ops_host_round_trip_and_message_overheads_are_charged():
    target = load_target("mock", overrides={"links.die_to_die.message_s": 50e-9})
    program = Program("decode", Workload())
    program.emit(0, Compute("norm", (), 0, 0, 1_000_000, "fp16", None, False))  # 1 MB through 1 TB/s: 1 us
    program.emit(0, Send(ValueRef("h"), 1, 100_000))  # 50 ns + 1 us on the link, 100 ns latency
    program.emit(0, Host(ValueRef("logits"), 2_000))  # 2 KB at 1 GB/s + 2 x 1 us + 1 us of host work
    timeline = simulate(program, target)
    assert timeline.makespan_s == pytest.approx(1e-6 + 2e-6 + 2e-6 + 1e-6)
    link = next(s for s in timeline.spans if s.track.startswith("link"))
    assert link.end_s - link.start_s == pytest.approx(50e-9 + 1e-6)


def test_a_kv_write_to_lpddr_takes_its_channel():
    target = load_target("mock", overrides=PER_CHIPLET)
    program = Program("decode", Workload())
    program.emit(0, Store("kv.0", 0, 25_000))
    staged(program, 0, "s", 0, 25_000)  # queued behind the store on channel 0
    assert simulate(program, target).makespan_s == pytest.approx(20e-6)


@pytest.fixture(scope="module")
def resident(zoo_onnx, tmp_path_factory):  # noqa: F811
    """The tiny llama held in SRAM (2 layers) at the mock's per-layer latency, and with it 0."""
    path = str(zoo_onnx("llama"))
    free = target_file(tmp_path_factory.mktemp("targets"), **{"runtime.per_layer_latency_s": 0.0})
    return (aviatorc.compile(path, target="mock", quant="int8", prompt=8),
            aviatorc.compile(path, target=free, quant="int8", prompt=8))


def test_the_per_layer_latency_adds_to_an_sram_resident_plan_once_per_layer(resident):
    art, free = resident
    assert not any(t.channel is not None for t in art.plan.tiles)
    latency = art.target.per_layer_latency_s
    layers = 2  # the tiny llama's transformer layers
    for key in ("time_per_token_s", "ttft_s"):
        got = getattr(art.plan.prediction, key) - getattr(free.plan.prediction, key)
        assert got == pytest.approx(layers * latency, rel=1e-9), key
    # The bound agrees: its latency floor moves by the same amount.
    assert (art.plan.prediction.bound.token_terms["latency"] - free.plan.prediction.bound.token_terms["latency"]
            == pytest.approx(layers * latency, rel=1e-12))


def test_an_sram_resident_plan_is_judged_against_its_latency_floor(resident):
    art, _ = resident
    p = art.plan.prediction
    assert p.bound.token_binding == "latency"
    assert p.bound.token_terms["latency"] >= 2 * art.target.per_layer_latency_s + art.target.host.per_token_s
    # Before the latency floor the bound was the SRAM read time, nanoseconds: efficiency 0.001. What is
    # left between the two here is the activations' hops between chiplets (100 ns each on the mock).
    assert 0.25 < p.efficiency <= 1.0


# -- the bound --------------------------------------------------------------------------------


def _config(tmp: Path, **fields: object) -> Path:
    config = llama_config("llama-3-8b") | {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256,
                                           "num_attention_heads": 4, "num_key_value_heads": 2} | fields
    path = tmp / "config.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(("target", "cards", "quant", "overrides"), [
    ("mock", 1, "int8", {}),
    ("mock", 2, "int8", {"chiplet.sram_bytes": 1 << 22}),
    ("mock", 1, "int4", PER_CHIPLET),
    ("corsair", 1, "int4", {}),
    ("corsair", 2, "int8", {"chiplet.sram_bytes": 1 << 24}),
])
def test_the_ttft_bound_of_a_one_token_prompt_is_below_every_plans_ttft(tmp_path, target, cards, quant, overrides):
    # A large vocabulary (its fp16 table streams where SRAM is small): the bound counts the prompt's
    # row, not the table; it once counted the whole table and stood above the plan it bounds.
    path = _config(tmp_path, vocab_size=32000)
    art = aviatorc.compile(str(path), target=target_file(tmp_path, target, **overrides), cards=cards, quant=quant,
                           prompt=1, batch=1)
    p = art.plan.prediction
    assert p.bound.ttft_s <= p.ttft_s
    assert p.bound.token_s <= p.time_per_token_s
    assert p.bound.cold_s <= p.cold_start_s


# -- targets: channels, ranges, what-ifs --------------------------------------------------------


SCHEMA_1 = """schema_version = 1
name = "old"
description = "a description written for schema 1"
assumed = ["card.lpddr_bytes_per_s"]
[chiplet]
sram_bytes = 1048576
sram_bytes_per_s = 1.0e12
mxint4_flops_per_s = 4.0e12
mxint8_flops_per_s = 1.0e12
mxint16_flops_per_s = 0.25e12
[package]
chiplets = 2
[card]
packages = 2
lpddr_bytes = 1073741824
lpddr_bytes_per_s = 10e9
pcie_bytes_per_s = 1e9
[server]
cards = 1
[links.die_to_die]
bytes_per_s = 100e9
latency_s = 100e-9
[links.package_to_package]
bytes_per_s = 50e9
latency_s = 200e-9
[links.card_to_card]
bytes_per_s = 10e9
latency_s = 1e-6
[matrix_unit]
k = 16
n = 16
[weights]
formats = ["fp16", "int8"]
[runtime]
per_layer_latency_s = 1e-6
activation_reserve_fraction = 0.25
activation_bytes_per_element = 2
"""


def test_a_schema_1_target_keeps_its_pooled_lpddr_and_uncharged_costs(tmp_path):
    path = tmp_path / "old.toml"
    path.write_text(SCHEMA_1)
    target = load_target(path)
    assert target.lpddr_attach == "card" and target.num_channels == 1 and target.schema_version == 2
    assert target.host.per_token_s == 0 and target.chiplet.vector_bytes_per_s == float("inf")
    assert all(link.message_s == 0 for link in target.links)
    lpddr = target.assumption("card.lpddr_bytes_per_s")  # named without a range: it spans its value only
    assert lpddr is not None and lpddr.low == lpddr.high == 10e9


def test_an_override_keeps_an_assumed_range_relative_and_a_zero_latency_is_a_fair_question():
    base = load_target("corsair")
    faster = load_target("corsair", overrides={"card.lpddr_bytes_per_s": 1e12})
    a, b = base.assumption("card.lpddr_bytes_per_s"), faster.assumption("card.lpddr_bytes_per_s")
    assert a is not None and b is not None and (b.low, b.high) == pytest.approx((2 * a.low, 2 * a.high))
    zero = load_target("corsair", overrides={"runtime.per_layer_latency_s": 0})
    assert zero.per_layer_latency_s == 0 and zero.assumption("runtime.per_layer_latency_s").high == 0  # type: ignore[union-attr]


def test_an_assumed_range_must_hold_its_figure(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text('schema_version = 2\nextends = "corsair"\nname = "x"\n[assumed]\n'
                    '"card.lpddr_bytes_per_s" = [1e12, 2e12]\n')
    with pytest.raises(TargetError, match="does not contain the figure's value"):
        load_target(path)
    path.write_text('schema_version = 2\nextends = "corsair"\nname = "x"\n[assumed]\n"card.packages" = "many"\n')
    with pytest.raises(TargetError, match="must be \\[low, high\\]"):
        load_target(path)


def test_predictions_come_with_the_range_their_assumptions_span(resident):
    art, _ = resident
    ranges = art.plan.prediction.ranges
    token = ranges["time_per_token_s"]
    assert token.low <= token.nominal == art.plan.prediction.time_per_token_s <= token.high
    # The mock's per-layer latency ranges over [0.5, 2] us: two layers move the step by up to 2 us.
    lo, hi = token.sensitivity["runtime.per_layer_latency_s"]
    assert hi - lo == pytest.approx(2 * (2e-6 - 0.5e-6), rel=1e-9)
    assert token.most_sensitive == "runtime.per_layer_latency_s"  # resident: LPDDR bandwidth moves nothing
    assert token.sensitivity["card.lpddr_bytes_per_s"][0] == token.sensitivity["card.lpddr_bytes_per_s"][1]
    assert token.high == pytest.approx(token.nominal + 2 * (2e-6 - art.target.per_layer_latency_s), rel=1e-9)


# -- homes beside the weights ---------------------------------------------------------------------


def test_each_layers_home_and_kv_cache_sit_on_a_chiplet_computing_its_weights(tmp_path):
    # Eight layers on two corsair cards: the caches were dealt round-robin before the weights were
    # placed, so most layers had their home (and their hand-offs) away from their weights.
    path = _config(tmp_path, num_hidden_layers=8, vocab_size=1024)
    art = aviatorc.compile(str(path), target="corsair", cards=2, quant="int8", prompt=8, context=256,
                           ranges=False, sweep=False)
    plan = art.plan
    assert plan.memory.kv_location == "sram"
    computing: dict[int, set[int]] = {}
    for tile in plan.tiles:
        computing.setdefault(tile.layer, set()).add(tile.compute_chiplet)
    homes = plan.memory.kv_layer_chiplets
    assert len(homes) == 8
    for layer, home in homes.items():
        assert home in computing[layer], (layer, home, computing[layer])
    # Each layer's cache buffer is where its attention runs.
    decode = plan.programs["decode"]
    for layer, home in homes.items():
        assert decode.buffers[f"kv.{layer}"].chiplet == home


def test_layers_are_spread_over_the_cards_with_their_weights_on_their_homes_card(tmp_path):
    # Eight layers on four corsair cards of 256 KiB chiplets, where weights and caches compete for
    # SRAM. The caches were dealt round-robin (all eight on card 0) before the weights were placed,
    # the weights took the roomier cards, and 7 of 8 layers had their home on a card holding none
    # of their weights (283 card-to-card messages a decode step, 0.358 ms; now 21 and 0.265 ms).
    path = _config(tmp_path, num_hidden_layers=8, hidden_size=256, intermediate_size=512, vocab_size=1024)
    art = aviatorc.compile(str(path), target=target_file(tmp_path, "corsair", **{"chiplet.sram_bytes": 1 << 18}),
                           cards=4, quant="int8", prompt=8, context=256, ranges=False, sweep=False)
    plan, target = art.plan, art.target
    assert plan.memory.kv_location == "sram"
    homes = plan.memory.kv_layer_chiplets
    home_cards = [target.card_of(homes[layer]) for layer in sorted(homes)]
    assert home_cards == sorted(home_cards) and set(home_cards) == set(range(4))  # two consecutive layers a card
    computing: dict[int, set[int]] = {}
    for tile in plan.tiles:
        computing.setdefault(tile.layer, set()).add(tile.compute_chiplet)
    for layer, home in homes.items():
        assert {target.card_of(c) for c in computing[layer]} == {target.card_of(home)}, layer


def test_target_show_sensitivity_prints_each_assumptions_ends_for_an_artifact_and_a_model(resident, zoo_onnx,  # noqa: F811
                                                                                          tmp_path, capsys):
    from aviatorc.cli import main
    from aviatorc.report.data import seconds

    art, _ = resident
    saved = art.save(tmp_path / "llama.avc", html_report=False)
    assert main(["target", "show", "mock", "--sensitivity", str(saved)]) == 0
    from_artifact = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line for line in from_artifact[2:]}
    lo, hi = art.plan.prediction.ranges["time_per_token_s"].sensitivity["runtime.per_layer_latency_s"]
    assert hi - lo == pytest.approx(2 * (2e-6 - 0.5e-6), rel=1e-9)  # two layers, the mock's 0.5-2 us
    assert f"{seconds(lo)} / {seconds(hi)}" in rows["runtime.per_layer_latency_s"]
    # The model source compiled here (the same options) gives the same table.
    assert main(["target", "show", "mock", "--sensitivity", str(zoo_onnx("llama")), "--quant", "int8",
                 "--prompt", "8"]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == from_artifact[1:]
    # An artifact is judged on the target it was compiled for, not another one.
    assert main(["target", "show", "corsair", "--sensitivity", str(saved)]) == 1
    assert "was compiled for target 'mock'" in capsys.readouterr().err
