"""Test order: the longest modules first, so that with several workers (pytest-xdist) none of them
is left running one long test after the others have finished the rest."""

from __future__ import annotations

import pytest

# The slowest modules, longest first (`--durations` on CI's runs): the README after its user install
# (about 5 minutes), SmolLM2 through the command line, the ONNX node conformance suite.
LONGEST_FIRST = ("tests/test_install.py", "tests/runtime/test_smollm2.py", "tests/frontends/test_onnx_conformance.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        module = item.nodeid.split("::")[0]
        return LONGEST_FIRST.index(module) if module in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: each module keeps its own order, and its fixtures their scope
