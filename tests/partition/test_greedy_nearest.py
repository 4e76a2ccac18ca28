"""The greedy's tie-break distance to the groups placed so far, in constant time, equals the loop
over every placed root it replaced (on corsair at 1, 2 and 4 cards, random roots)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from aviatorc.partition.greedy import _distance, _Nearest
from aviatorc.target import load_target


@pytest.mark.parametrize("cards", [1, 2, 4])
def test_nearest_equals_the_minimum_over_the_placed_roots(cards):
    target = load_target("corsair", cards=cards)
    problem = SimpleNamespace(target=target)
    rng = random.Random(cards)
    for _ in range(200):
        roots = [rng.randrange(target.num_chiplets) for _ in range(rng.randrange(0, 6))]
        nearest = _Nearest(problem, roots)  # type: ignore[arg-type]
        for c in range(target.num_chiplets):
            assert nearest.distance(c) == min((_distance(problem, c, r) for r in roots), default=0)  # type: ignore[arg-type]
