"""GGUF files (llama.cpp's format) -> the step graph of the causal LM they hold.

    graph = import_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")

`transformers` reads the file (its `gguf_file=` loader, which needs the `gguf` and
`accelerate` packages: `pip install 'aviatorc[gguf]'`) and dequantizes the weights to float32; the model is then imported as
its step graph with the KV cache as inputs and outputs (`aviatorc.frontends.torch.decoder`),
so the compiled plan generates. The file's own quantization is not kept: choose the plan's
with `quant=` (the GGUF's blocks are the reference it is measured against). GGUF holds no
code and no pickles; nothing is downloaded.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aviatorc.errors import ModelFormatError, OptionError
from aviatorc.extras import require

if TYPE_CHECKING:
    from aviatorc.ir import Graph


def load_gguf_model(path: str | Path) -> Any:
    """The transformers causal LM in a GGUF file, float32 weights, in eval mode."""
    path = Path(path)
    if not path.is_file():
        raise OptionError(f"model '{path}' does not exist")
    require("gguf", f"reading the GGUF file '{path}'")
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with _no_bars_off_a_terminal():
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                         local_files_only=True)
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        raise ModelFormatError(f"cannot read the GGUF model: {str(error).splitlines()[0]}", file=str(path)) from None
    return model.eval()


def import_gguf(path: str | Path, **options: Any) -> Graph:
    from aviatorc.frontends.torch.decoder import import_decoder

    graph = import_decoder(load_gguf_model(path), name=Path(path).stem, **options)
    # Where generate, chat and serve find the tokenizer (and its chat template) by default.
    graph.metadata[TOKENIZER_KEY] = str(Path(path).resolve())
    return graph


TOKENIZER_KEY = "tokenizer"  # graph metadata: the file holding the model's tokenizer


def load_gguf_tokenizer(path: str | Path) -> Any:
    """The tokenizer stored inside a GGUF file."""
    path = Path(path)
    require("gguf", f"reading the tokenizer in the GGUF file '{path}'")
    from transformers import AutoTokenizer

    try:
        with _no_bars_off_a_terminal():
            return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        raise ModelFormatError(f"cannot read the tokenizer in the GGUF file: {str(error).splitlines()[0]}",
                               file=str(path)) from None


@contextmanager
def _no_bars_off_a_terminal() -> Iterator[None]:
    """Off a terminal, no progress bars from transformers: its GGUF conversion and weight loading
    draw tqdm bars on stderr, which a log keeps as lines of carriage returns. On a terminal they
    draw as usual."""
    try:
        terminal = sys.stderr.isatty()
    except (AttributeError, ValueError):
        terminal = False
    if terminal:
        yield
        return
    import transformers.modeling_gguf_pytorch_utils as converter
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    # The converter calls tqdm itself, not transformers' switchable wrapper: disable=None is
    # tqdm's own "no bar unless on a terminal".
    tqdm = getattr(converter, "tqdm", None)
    if tqdm is not None:
        converter.tqdm = functools.partial(tqdm, disable=None)
    try:
        yield
    finally:
        if tqdm is not None:
            converter.tqdm = tqdm
        if bars:
            hf_logging.enable_progress_bar()
