"""Session fixtures: the tiny llama compiled to int8 with calibration (so accuracy exists) onto a
mock target whose 16 KiB chiplets make some weights stream (so the timeline has loads), saved
as an artifact with its report.html."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import aviatorc
from aviatorc import zoo
from tests.zoo_fixtures import zoo_dir, zoo_onnx  # noqa: F401

SMALL_MOCK = """extends = "mock"
name = "mock-small"
description = "the mock target with 16 KiB of SRAM per chiplet: some weights stream"

[chiplet]
sram_bytes = 16384
"""


@dataclass(frozen=True)
class Compiled:
    result: Any  # the CompileResult
    path: Path  # the saved artifact


@pytest.fixture(scope="session")
def small_artifact(zoo_onnx: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Compiled:  # noqa: F811
    folder = tmp_path_factory.mktemp("report")
    target = folder / "mock-small.toml"
    target.write_text(SMALL_MOCK)
    batches = [{k: v.numpy() for k, v in zoo.example_inputs("llama", seed=seed).items()} for seed in range(4)]
    result = aviatorc.compile(str(zoo_onnx("llama")), target=str(target), quant="int8", calibration=batches,
                              context=64, prompt=8)
    return Compiled(result, result.save(folder / "llama.avc"))
