"""Target descriptions: shipped files, --cards, overrides, and one-line errors naming file and key."""

from __future__ import annotations

import tomllib
from dataclasses import replace

import pytest

from aviatorc.errors import OptionError, TargetError
from aviatorc.target import cli_list, cli_show, list_targets, load_target
from aviatorc.target.loader import _build

GiB = 2**30


def test_every_shipped_target_loads():
    assert set(list_targets()) >= {"corsair", "corsair-seed", "corsair-x4", "corsair-x8", "mock"}
    for name in list_targets():
        target = load_target(name)
        assert target.schema_version == 2
        assert target.num_chiplets == target.cards * target.chiplets_per_card
        assert target.usable_sram_bytes_per_chiplet < target.chiplet.sram_bytes


def test_public_figures_and_seed_article():
    corsair = load_target("corsair")
    assert corsair.chiplets_per_card == 8
    assert corsair.sram_bytes_total == 2 * GiB  # 2 GB per card, not per chiplet
    assert corsair.chiplet.mxint4_flops_per_s * 8 == pytest.approx(9.6e15)
    assert "card.lpddr_bytes_per_s" in {a.key for a in corsair.assumed}
    assert load_target("corsair-seed").chiplet.sram_bytes == 2 * GiB  # 2 GB per chiplet
    assert load_target("corsair-x4").num_chiplets == 32
    assert load_target("corsair-x8").sram_bytes_total == 16 * GiB


def test_cards_builds_a_server_from_the_card():
    built = load_target("corsair", cards=4)
    shipped = load_target("corsair-x4")
    assert built.cards == 4 and built.name == "corsair@4cards"
    strip = {"name", "description"}
    a = {k: v for k, v in built.resolved().items() if k not in strip}
    b = {k: v for k, v in shipped.resolved().items() if k not in strip}
    assert a == b


@pytest.mark.parametrize("cards", [0, -1, 2.5, True])
def test_bad_cards(cards):  # the user's option, worded as compile words it (not the TOML's error)
    with pytest.raises(OptionError, match=r"cards \(--cards\) must be at least 1"):
        load_target("corsair", cards=cards)


def test_overrides_dotted_and_nested():
    a = load_target("corsair", overrides={"card.lpddr_bytes_per_s": 1e12})
    b = load_target("corsair", overrides={"card": {"lpddr_bytes_per_s": 1e12}})
    assert a.lpddr_bytes_per_s_per_card == b.lpddr_bytes_per_s_per_card == 1e12


def test_unknown_override_key_says_did_you_mean():
    with pytest.raises(TargetError) as info:
        load_target("corsair", overrides={"card.lpddr_bytes_per_sec": 1e12})
    assert info.value.fields["key"] == "card.lpddr_bytes_per_sec"
    assert "did you mean 'card.lpddr_bytes_per_s'" in str(info.value)


def _write(tmp_path, text, name="t.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_unknown_key_in_a_file_names_file_key_and_suggestion(tmp_path):
    path = _write(tmp_path, 'schema_version = 1\nextends = "corsair"\nname = "x"\n[chiplet]\nsram_byts = 5\n')
    with pytest.raises(TargetError) as info:
        load_target(path)
    message = str(info.value)
    assert "\n" not in message
    assert str(path) in message and "chiplet.sram_byts" in message
    assert "did you mean 'chiplet.sram_bytes'?" in message


def test_unknown_table(tmp_path):
    path = _write(tmp_path, 'schema_version = 1\nextends = "corsair"\nname = "x"\n[chiplett]\nsram_bytes = 5\n')
    with pytest.raises(TargetError, match="did you mean 'chiplet'"):
        load_target(path)


def test_malformed_toml_names_the_file(tmp_path):
    path = _write(tmp_path, "schema_version = 1\n[chiplet\n")
    with pytest.raises(TargetError) as info:
        load_target(path)
    assert str(path) in str(info.value) and "malformed TOML" in str(info.value)


@pytest.mark.parametrize("snippet,key", [
    ("[chiplet]\nsram_bytes = -5\n", "chiplet.sram_bytes"),
    ("[chiplet]\nsram_bytes = \"big\"\n", "chiplet.sram_bytes"),
    ("[runtime]\nactivation_reserve_fraction = 1.5\n", "runtime.activation_reserve_fraction"),
    ("[weights]\nformats = [\"int3\"]\n", "weights.formats"),
    ("[links.card_to_card]\nbytes_per_s = 5e12\n", "links.card_to_card"),
    ("[links]\ndie_to_die = 3\n", "links.die_to_die"),
])
def test_bad_values_name_the_key(tmp_path, snippet, key):
    path = _write(tmp_path, f'schema_version = 1\nextends = "corsair"\nname = "x"\n{snippet}')
    with pytest.raises(TargetError) as info:
        load_target(path)
    assert info.value.fields["key"] == key
    assert str(path) in str(info.value)


def test_missing_key_and_schema_version(tmp_path):
    text = (load_target("mock").to_toml()).replace("sram_bytes_per_s = 1000000000000.0\n", "")
    with pytest.raises(TargetError, match="missing key 'chiplet.sram_bytes_per_s'"):
        load_target(_write(tmp_path, text))
    text = load_target("mock").to_toml().replace("schema_version = 2", "schema_version = 9")
    with pytest.raises(TargetError, match="schema_version 9"):
        load_target(_write(tmp_path, text, "v9.toml"))


def test_unknown_target_name_suggests():
    with pytest.raises(TargetError, match="did you mean 'corsair'"):
        load_target("corsiar")


def test_extends_cycle(tmp_path):
    _write(tmp_path, 'schema_version = 1\nextends = "b.toml"\nname = "a"\n', "a.toml")
    _write(tmp_path, 'schema_version = 1\nextends = "a.toml"\nname = "b"\n', "b.toml")
    with pytest.raises(TargetError, match="cycle"):
        load_target(tmp_path / "a.toml")


def test_resolved_toml_round_trips(tmp_path):
    for name in list_targets():
        target = load_target(name, cards=2)
        again = load_target(_write(tmp_path, target.to_toml(), f"{name}.toml"))
        assert replace(again, source="") == replace(target, source="")
        assert _build(tomllib.loads(target.to_toml()), "f") == replace(target, source="f")


def test_cli_text():
    listing = cli_list()
    for name in list_targets():
        assert name in listing
    shown = cli_show("corsair", cards=4, resolved=True)
    assert "cards = 4" in shown and "assumed figures" in shown
    assert "2 GB of SRAM" in cli_show("corsair", resolved=False) or "[chiplet]" in cli_show("corsair")


@pytest.mark.parametrize("overrides, message", [
    ({"chiplet": 5}, "'chiplet' must be a table, not 5"),
    ({"chiplet.sram_bytes.x": 1}, "'chiplet.sram_bytes' is a value, not a table"),
])
def test_malformed_overrides_are_target_errors(overrides, message):
    with pytest.raises(TargetError, match=message):
        load_target("mock", overrides=overrides)
