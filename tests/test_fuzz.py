"""The fuzzer's fixed-seed CI slice (tools/fuzz.py): one mutant of every kind, through the
real CLI, with no traceback, hang, internal error, output left behind, or invalid mutant
accepted. The full campaign (`--budget 2000`) is in BENCHMARKS.md."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import onnx
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fuzz():
    spec = importlib.util.spec_from_file_location("aviatorc_fuzz", ROOT / "tools" / "fuzz.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_mutants_are_reproducible_from_their_index(fuzz) -> None:
    onnx_seeds = {"attrs": fuzz.attribute_model().SerializeToString()}
    config_seeds = {"tiny": {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 64}}
    first = [fuzz.make_mutant(i, 7, 40, onnx_seeds, config_seeds) for i in range(40)]
    again = [fuzz.make_mutant(i, 7, 40, onnx_seeds, config_seeds) for i in reversed(range(40))][::-1]
    assert [m.data for m in first] == [m.data for m in again]
    assert {m.kind for m in first} == set(fuzz.ONNX_STRUCTURED + fuzz.BYTE_KINDS + fuzz.CONFIG_KINDS)


def test_the_attribute_seed_is_a_valid_model(fuzz, tmp_path) -> None:
    from aviatorc.frontends.onnx import import_model_proto

    model = fuzz.attribute_model()
    onnx.checker.check_model(model, full_check=True)
    graph = import_model_proto(model, base_dir=tmp_path)
    assert {n.op for n in graph.nodes} >= {"Gather", "LayerNormalization", "Softmax", "Split", "MatMul"}


def test_every_structured_onnx_mutation_applies_to_every_seed_kind(fuzz) -> None:
    seed = fuzz.attribute_model()
    for index, kind in enumerate(fuzz.ONNX_STRUCTURED):
        model, detail, _, _ = fuzz.mutate_onnx(kind, random.Random(index), seed)
        assert model.SerializeToString() != seed.SerializeToString() or kind in ("nodes", "inputs"), detail


@pytest.mark.slow
def test_fixed_seed_slice_through_the_cli(fuzz) -> None:
    kinds = len(fuzz.ONNX_STRUCTURED + fuzz.BYTE_KINDS)
    budget = kinds + len(fuzz.CONFIG_KINDS)  # every kind once
    results = fuzz.campaign(budget, seed=0, jobs=2, timeout_s=60, zoo_archs=(), config_archs=("gpt2",),
                            inspect_every=0, n_onnx=kinds)
    totals = results["totals"]
    assert totals["mutants"] == budget and totals["onnx:mutants"] == kinds
    bad = {k: totals.get(k, 0) for k in ("traceback", "hang", "killed", "internal", "left-output",
                                          "accepted-invalid")}
    assert bad == dict.fromkeys(bad, 0), [(f["kind"], f["detail"], f["runs"][-1]["stderr_tail"])
                                          for f in results["findings"]]
