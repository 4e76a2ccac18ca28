"""A slice of tools/arch_census.py (the whole census runs for hours; its table is
docs/arch_census.md): a dense decoder works from its config.json, a hybrid family is refused
from its config.json and its module in one line naming the layer kind, and the page says so."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def census():
    spec = importlib.util.spec_from_file_location("aviatorc_arch_census", ROOT / "tools" / "arch_census.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_a_tiny_config_cuts_the_sizes_and_the_per_layer_lists(census):
    config, fields = census.tiny_config("zamba2")  # its layer_types default is 54 entries long
    assert config.num_hidden_layers == 2 and len(config.layer_types) == 2
    assert config.hidden_size == 64 and fields["vocab_size"] == 128


def test_a_slice_of_the_census(census):
    rows = [census.one("qwen2", sources=("config",)), census.one("falcon_h1", sources=("config", "module"))]
    dense, hybrid = rows
    assert dense["kind"] == "dense" and dense["sources"]["config"]["status"] == "ok"
    assert hybrid["kind"] == "hybrid"
    for source in ("config", "module"):
        result = hybrid["sources"][source]
        assert result["status"] == "refused" and "state-space (Mamba) layers" in result["detail"], result
    for row in rows:  # the page lists every source; the ones not run here count as timeouts
        for source in census.SOURCES:
            row["sources"].setdefault(source, {"status": "timeout", "detail": ""})
    page = census.render(rows, "test", 1.0)
    assert "| falcon_h1 | hybrid | refused: " in page and "Dense decoders working from every source: 0 of 1" in page


def test_a_cache_with_more_than_keys_and_values_is_refused_in_one_line(census):
    """DeepSeek-V3.2's cache layers carry an indexer: transformers refuses a plain DynamicCache,
    which ended as an internal error (ValueError) from the module source."""
    row = census.one("deepseek_v32", sources=("module",))
    result = row["sources"]["module"]
    assert result["status"] == "refused" and "does not run with a plain key/value cache" in result["detail"], result


def test_large_logits_are_judged_against_float64_and_symbolic_pads_import(census):
    """CPM-Ant's logits (about 30) lose more than 1e-4 to fp32 rounding in transformers itself:
    the step is judged against a float64 copy of the module, and its real limit shows (torch.export
    fixes its new-token axis, so a longer prompt is refused). GIT pads by a symbolic length (was an
    internal TypeError). Lines name the config file without the census's temporary folder."""
    cpmant = census.one("cpmant", sources=("config", "module"))["sources"]
    assert cpmant["module"]["status"] == "refused" and "expected [" in cpmant["module"]["detail"], cpmant
    assert cpmant["config"]["detail"].startswith("config.json: torch.export failed"), cpmant
    git = census.one("git", sources=("module",))["sources"]["module"]
    assert git["status"] == "ok" and "6 tokens as transformers" in git["detail"], git
