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


CALIBRATION_CHUNK_TOKENS = 128  # tokens per calibration batch: one prompt's worth, each a fresh sequence


def text_batches(graph: Any, text: str, tokenizer: Any, *, chunk: int = CALIBRATION_CHUNK_TOKENS) -> list[dict[str, Any]]:
    """Calibration batches for a decoder step graph from plain text: the text tokenized with the
    model's tokenizer, cut into prompts of `chunk` tokens, each fed as a fresh sequence (empty KV
    cache), so calibration sees the activations a prompt produces."""
    import numpy as np

    from aviatorc.ir.types import numpy_dtype
    from aviatorc.runtime.cache import find_cache, static_reason

    layout = find_cache(graph)
    if layout is None:
        raise OptionError(f"--calibration-text calibrates a decoder that carries its KV cache, and this model cannot "
                          f"generate: {static_reason(graph)}", hint="give --calibration FILE.npz (one array per input)")
    ids = [int(t) for t in tokenizer.encode(text)]
    if len(ids) < 2:
        raise OptionError(f"the calibration text holds {len(ids)} token(s)", hint="give a few hundred tokens of text")
    types = {v.name: v.type for v in graph.inputs}
    batches = []
    for start in range(0, len(ids), chunk):
        piece = np.array([ids[start:start + chunk]], dtype=np.int64)
        n = piece.shape[1]
        feeds: dict[str, Any] = {layout.ids: piece}
        if layout.attention_mask:
            feeds[layout.attention_mask] = np.ones((1, n), dtype=np.int64)
        if layout.position_ids:
            feeds[layout.position_ids] = np.arange(n, dtype=np.int64)[None, :]
        for pair in layout.pairs:
            shape = [0 if i == pair.axis else (d if isinstance(d, int) else 1) for i, d in enumerate(types[pair.past].shape)]
            feeds[pair.past] = np.zeros(shape, dtype=numpy_dtype(types[pair.past].dtype))
        batches.append(feeds)
    return batches
