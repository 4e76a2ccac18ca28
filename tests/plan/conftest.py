"""Session fixtures: the tiny llama compiled once, and `plan_for(case)` building (and caching)
the plan of one named case of `tests.plan.plans.CASES`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

import aviatorc
from aviatorc.ir import Graph
from tests.plan.plans import CASES, Built, build
from tests.zoo_fixtures import zoo_dir, zoo_onnx  # noqa: F401


@pytest.fixture(scope="session")
def llama_graph(zoo_onnx: Callable[..., Path]) -> Graph:  # noqa: F811
    return aviatorc.compile(str(zoo_onnx("llama")), quant="int8").graph


@pytest.fixture(scope="session")
def plan_for(llama_graph: Graph) -> Callable[[str], Built]:
    cache: dict[str, Built] = {}

    def get(name: str) -> Built:
        if name not in cache:
            cache[name] = build(llama_graph, CASES[name])
        return cache[name]

    return get
