"""Frontends: ONNX files, PyTorch modules and graphs, Hugging Face config.json -> IR Graph.

Each frontend imports its heavy library (onnx, torch, transformers) inside functions, so
`import aviatorc` stays light.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aviatorc.errors import OptionError
from aviatorc.ir import Graph

# Where a model comes from, for the errors that name the choices: local files only (nothing is
# downloaded, so a hub id such as HuggingFaceTB/SmolLM2-135M is not a source).
ACCEPTED_SOURCES = ("aviatorc reads local files and downloads nothing: pass an .onnx file, a .gguf file, or a Hugging "
                    "Face config.json (or the folder holding it; planned shape-only, without weights)")


def import_model(source: Any, example_inputs: Any = None, **options: Any) -> Graph:
    """Import `source` into a verified IR graph.

    source: a path to an `.onnx` file, a Hugging Face `config.json` (or a folder holding one;
    imported shape-only), a `.gguf` file (its causal LM, as a step graph that generates), a `torch.nn.Module` (with `example_inputs`: a tuple of positional
    tensors or a dict of keyword tensors), a `torch.fx.GraphModule`, or an aviatorc IR `Graph`
    (verified and copied, so a pipeline that already holds the IR can compile it several ways).
    A transformers causal LM given without example inputs imports as its step graph with the
    KV cache as inputs and outputs (`aviatorc.frontends.torch.decoder`), ready to generate.
    """
    if isinstance(source, Graph):
        from aviatorc.ir import verify

        verify(source)
        return source.clone()
    if isinstance(source, (str, Path)):
        path = Path(source)
        if path.is_dir() and (path / "config.json").is_file():
            path = path / "config.json"
        if path.suffix == ".onnx":
            from aviatorc.frontends.onnx import import_onnx

            return import_onnx(path, **options)
        if path.suffix == ".gguf":
            from aviatorc.frontends.gguf import import_gguf

            return import_gguf(path, **options)
        if path.suffix == ".json":
            from aviatorc.frontends.torch import import_hf_config

            return import_hf_config(path, **options)
        raise OptionError(f"cannot tell the model format of '{path}'",
                          hint=ACCEPTED_SOURCES + " (from Python also a torch module)")
    from aviatorc.frontends.torch import import_torch
    from aviatorc.frontends.torch.decoder import import_decoder, is_decoder

    if example_inputs is None and is_decoder(source):
        return import_decoder(source, **options)
    return import_torch(source, example_inputs, **options)
