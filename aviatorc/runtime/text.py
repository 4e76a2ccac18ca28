"""Tokenizers for text in and out of `generate`: a local Hugging Face tokenizer folder.

    tokenizer = load_tokenizer("path/to/model")   # tokenizer.json (+ tokenizer_config.json)
    tokenizer = load_tokenizer("model.gguf")      # the tokenizer inside a GGUF file
    source_tokenizer(session.graph)                # a model compiled from a GGUF: that file
    ids = tokenizer.encode("Hello"); text = tokenizer.decode(ids)

Read with `transformers.AutoTokenizer` from local files only (nothing is downloaded, no code
from the folder runs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aviatorc.errors import OptionError


def source_tokenizer(graph: Any) -> str | None:
    """The file holding the tokenizer of a compiled model's source (a GGUF file carries its own),
    from the graph's metadata; None when the source had none or it is no longer there."""
    path = graph.metadata.get("tokenizer")
    return path if path and Path(path).is_file() else None


def load_tokenizer(folder: str | Path) -> Any:
    path = Path(folder)
    if path.suffix == ".gguf" and path.is_file():
        from aviatorc.frontends.gguf import load_gguf_tokenizer

        return load_gguf_tokenizer(path)
    if not path.is_dir():
        raise OptionError(f"tokenizer folder '{path}' does not exist",
                          hint="give the folder holding tokenizer.json, or a .gguf file")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as error:
        raise OptionError(f"{path}: cannot load a tokenizer: {str(error).splitlines()[0]}",
                          hint="the folder needs a tokenizer.json or the files of a slow tokenizer") from None
