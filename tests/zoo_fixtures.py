"""Session-wide cache of exported zoo models, for any test that needs an ONNX file.

A plain module, not a conftest: import the fixtures into a test module (or a
conftest) with ``from tests.zoo_fixtures import zoo_dir, zoo_onnx  # noqa: F401``,
or call ``onnx_model_path`` directly with a directory of your own.

Each (arch, exporter, opset, dynamic) combination is exported once per session.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest

from aviatorc import zoo


@functools.cache
def onnx_model_path(
    arch: str,
    exporter: zoo.Exporter = "dynamo",
    opset: int | None = None,
    dynamic: bool = False,
    tmp_dir: Path | None = None,
) -> Path:
    """The exported ONNX file for this combination, exporting it on first request."""
    if tmp_dir is None:
        raise ValueError("onnx_model_path needs a tmp_dir (use the zoo_onnx fixture)")
    opset = zoo.DEFAULT_OPSET[exporter] if opset is None else opset
    name = f"{arch}-{exporter}-{opset}{'-dyn' if dynamic else ''}.onnx"
    return zoo.export_onnx(arch, tmp_dir / name, exporter=exporter, opset=opset, dynamic=dynamic)


@functools.cache
def decode_onnx_path(arch: str, tmp_dir: Path, naming: zoo.CacheNaming = "flat") -> Path:
    """The exported decode-step ONNX file for ``arch`` (see ``zoo.export_decode_onnx``)."""
    return zoo.export_decode_onnx(arch, tmp_dir / f"{arch}-decode-{naming}.onnx", naming=naming)


@pytest.fixture(scope="session")
def zoo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One directory for every zoo export of the session."""
    return tmp_path_factory.mktemp("zoo")


@pytest.fixture(scope="session")
def zoo_onnx(zoo_dir: Path) -> Callable[..., Path]:
    """``zoo_onnx(arch, exporter="dynamo", opset=None, dynamic=False) -> Path``, memoized."""

    def get(
        arch: str,
        exporter: zoo.Exporter = "dynamo",
        opset: int | None = None,
        dynamic: bool = False,
    ) -> Path:
        return onnx_model_path(arch, exporter, opset, dynamic, zoo_dir)

    return get


def transformers_greedy(model, prompt, new_tokens: int):
    """`model.generate`'s greedy ids (prompt and exactly `new_tokens` more) for a 1-D numpy prompt:
    the reference the sim runtime's generation is held to."""
    import torch

    ids = torch.from_numpy(prompt)[None]
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)[0].numpy()
