"""GGUF files (llama.cpp's format) -> the step graph of the causal LM they hold.

    graph = import_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")

`transformers` reads the file (its `gguf_file=` loader, which needs the `gguf` and
`accelerate` packages) and dequantizes the weights to float32; the model is then imported as
its step graph with the KV cache as inputs and outputs (`aviatorc.frontends.torch.decoder`),
so the compiled plan generates. The file's own quantization is not kept: choose the plan's
with `quant=` (the GGUF's blocks are the reference it is measured against). GGUF holds no
code and no pickles; nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from aviatorc.errors import ModelFormatError, OptionError

if TYPE_CHECKING:
    from aviatorc.ir import Graph


def load_gguf_model(path: str | Path) -> Any:
    """The transformers causal LM in a GGUF file, float32 weights, in eval mode."""
    path = Path(path)
    if not path.is_file():
        raise OptionError(f"model '{path}' does not exist")
    try:
        import accelerate  # noqa: F401 - transformers needs it to read GGUF
        import gguf  # noqa: F401
    except ImportError as error:
        raise OptionError(f"{path}: reading GGUF needs the '{error.name}' package",
                          hint="pip install gguf accelerate") from None
    import torch
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                     local_files_only=True)
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        raise ModelFormatError(f"cannot read the GGUF model: {str(error).splitlines()[0]}", file=str(path)) from None
    return model.eval()


def import_gguf(path: str | Path, **options: Any) -> Graph:
    from aviatorc.frontends.torch.decoder import import_decoder

    return import_decoder(load_gguf_model(path), name=Path(path).stem, **options)


def load_gguf_tokenizer(path: str | Path) -> Any:
    """The tokenizer stored inside a GGUF file."""
    path = Path(path)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        raise ModelFormatError(f"cannot read the tokenizer in the GGUF file: {str(error).splitlines()[0]}",
                               file=str(path)) from None
