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


# -- the artifact fuzzer (tools/fuzz.py --artifacts) --------------------------------------------

@pytest.fixture(scope="module")
def artifact_files(fuzz, tmp_path_factory):
    artifacts = fuzz.artifacts_module()
    return artifacts, artifacts.read_files(artifacts.seed_artifact(tmp_path_factory.mktemp("seed")))


def test_every_artifact_mutation_kind_is_one_line_from_load(artifact_files, tmp_path) -> None:
    """One mutant of every kind (seed 0), loaded in process: an `ArtifactError` or `AviatorError`,
    never another exception; every kind invalid by construction is refused."""
    import aviatorc
    from aviatorc.errors import AviatorError

    artifacts, files = artifact_files
    accepted, refused = [], []
    for index in range(len(artifacts.KINDS)):
        kind, detail, invalid, mutated, manifest = artifacts.make_mutant(index, 0, files)
        art = artifacts.write_mutant(tmp_path / f"m{index}", mutated, manifest)
        try:
            aviatorc.load(art)
        except AviatorError as error:
            assert "\n" not in str(error), kind
            refused.append(kind)
            continue
        accepted.append(kind)
    assert set(refused) | set(accepted) == set(artifacts.KINDS)
    invalid = [k for k in accepted if artifacts.KINDS[k][1]]
    assert invalid == [], invalid
    assert "st-data-flip" in accepted  # other weight values, well formed: valid


def test_fifty_random_edits_of_plan_json_load_and_run_or_are_refused(artifact_files, tmp_path) -> None:
    """Seeded edits anywhere in plan.json (a value of another type or size, a key or item dropped),
    the manifest rehashed: each loads and generates, or is one line of aviatorc's own error."""
    import random

    import aviatorc
    from aviatorc.errors import AviatorError

    artifacts, files = artifact_files
    mutation, _ = artifacts.KINDS["plan-random-edit"]
    outcomes = []
    for index in range(50):
        mutated, detail = mutation(random.Random(f"edit:{index}"), dict(files))
        art = artifacts.write_mutant(tmp_path / f"m{index}", mutated, None)
        try:
            loaded = aviatorc.load(art)
        except AviatorError as error:  # load names the artifact
            assert "\n" not in str(error) and str(error).startswith(str(art)), (detail, str(error))
            outcomes.append("refused")
            continue
        try:  # what load accepts may still fail to run (a dataflow the checker does not prove): cleanly
            aviatorc.Session(loaded).generate([5, 6, 7], 2)
            outcomes.append("ok")
        except AviatorError as error:
            assert "\n" not in str(error), (detail, str(error))
            outcomes.append("refused when run")
    assert outcomes.count("refused") >= 25, outcomes  # most edits break the plan


@pytest.mark.slow
def test_fixed_seed_artifact_slice_through_the_cli(fuzz, artifact_files) -> None:
    """A few kinds through the child-process probes, `aviatorc generate` and `aviatorc serve`."""
    artifacts, _ = artifact_files
    kinds = list(artifacts.KINDS)
    picks = [kinds.index(k) for k in ("st-huge-elements", "plan-batch", "manifest-deep", "st-data-flip")]
    results = artifacts.campaign(fuzz, len(picks), seed=0, jobs=2, timeout_s=120, serve_every=len(kinds),
                                 kinds=picks)
    totals = results["totals"]
    assert totals["mutants"] == len(picks) and results["runs"] == 2 * len(picks) + 1  # serve for index 0
    bad = {k: totals.get(k, 0) for k in ("traceback", "hang", "killed", "internal", "accepted-invalid")}
    assert bad == dict.fromkeys(bad, 0), results["findings"]
    assert totals["refused"] == 3 and totals["ok"] == 1, results["rows"]
