"""Where layer homes (each layer's KV cache, attention and norms) go before the weights are placed:
evenly in layer order over the fewest cards that hold the model (`memory._home_chiplets`)."""

from __future__ import annotations

from aviatorc.schedule.memory import HOME_CARDS_FILL, _home_chiplets
from aviatorc.target import load_target

TARGET = load_target("corsair", cards=4)
SRAM = TARGET.chiplet.sram_bytes
PER_CARD = TARGET.chiplets_per_card
ALL = list(range(TARGET.num_chiplets))


def test_the_fewest_cards_that_hold_the_bytes_at_the_fill():
    room = SRAM - 1000  # a chiplet's SRAM less a 1000-byte reserve
    one_card = int(HOME_CARDS_FILL * PER_CARD * room)
    assert _home_chiplets(TARGET, ALL, one_card, 1000, 32, 0) == list(range(PER_CARD))
    assert _home_chiplets(TARGET, ALL, one_card + 1, 1000, 32, 0) == list(range(2 * PER_CARD))
    assert _home_chiplets(TARGET, ALL, 10 * one_card, 1000, 32, 0) == ALL  # none hold it: every chiplet


def test_a_chiplet_dealt_several_caches_must_hold_them():
    # Twelve caches of 0.55 of a chiplet's room: one card holds their bytes (6.6 of its 6.8
    # chiplets' worth at 85%), but dealt over its 8 chiplets four would hold two, which no
    # chiplet can; two cards give each chiplet one.
    reserve = 1 << 20
    cache = int(0.55 * (SRAM - reserve))
    assert 12 * cache <= HOME_CARDS_FILL * PER_CARD * (SRAM - reserve)
    assert _home_chiplets(TARGET, ALL, 12 * cache, reserve, 12, cache) == list(range(2 * PER_CARD))


def test_a_subset_counts_only_its_own_chiplets():
    subset = [4, 5, 6, 7, 8, 9]  # half of card 0, then part of card 1
    room = SRAM - 1000
    assert _home_chiplets(TARGET, subset, int(HOME_CARDS_FILL * 4 * room), 1000, 4, 0) == [4, 5, 6, 7]
    assert _home_chiplets(TARGET, subset, int(HOME_CARDS_FILL * 4 * room) + 1, 1000, 4, 0) == subset
