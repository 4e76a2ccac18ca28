"""Models as others export them: tiny `transformers` models built from config objects (random,
seeded, perturbed weights) and written the way exporters other than ours write them.

- `phi()`: Phi-style blocks: q, k and v projections with biases, attention and MLP reading one
  norm output (a parallel block), partial rotary;
- `gemma()`: Gemma-style tied embeddings, the table scaled at the input, the head reading it;
- `step_onnx(model, path, one_token=...)`: a decoder-with-past export; with `one_token` its
  new-token axis is fixed at 1 (past dynamic), as many exporters write it;
- `named_by_module(path, out)`: each node named by the module it comes from (the exporter's
  name scopes), so a biased Linear's MatMul and Add share one name, as ONNX's checker allows.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from aviatorc import zoo

TINY = {"vocab_size": zoo.VOCAB_SIZE, "hidden_size": zoo.HIDDEN, "num_hidden_layers": zoo.LAYERS,
        "num_attention_heads": 4, "intermediate_size": 2 * zoo.HIDDEN + 8, "max_position_embeddings": zoo.MAX_POSITIONS,
        "bos_token_id": 1, "eos_token_id": 2}


def built(config: Any, seed: int = 0) -> Any:
    """An eval-mode causal LM for `config`, eager attention, seeded and perturbed weights."""
    import torch
    import transformers

    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    zoo.perturb(model, seed)
    return model.eval()


def phi() -> Any:
    import transformers

    return built(transformers.PhiConfig(partial_rotary_factor=0.5, **TINY))


def gemma() -> Any:
    import transformers

    return built(transformers.GemmaConfig(num_key_value_heads=2, head_dim=8, pad_token_id=0, **TINY))


def step_onnx(model: Any, path: Path, *, one_token: bool = False) -> Path:
    return zoo.export_step_onnx(model, path, one_token=one_token)


def named_by_module(source: Path, out: Path) -> Path:
    """`source` with each node named by the module it comes from (the exporter's name scopes):
    a biased Linear's MatMul and Add then share one name. ONNX's checker allows that;
    onnxruntime does not (run the source there)."""
    import onnx

    proto = onnx.load(str(source))
    for node in proto.graph.node:
        scopes = {p.key: p.value for p in node.metadata_props}.get("pkg.torch.onnx.name_scopes")
        if scopes:  # ['', 'model', ..., 'model.layers.0.self_attn.q_proj', 'linear_3']: the module's path
            node.name = ast.literal_eval(scopes)[-2] or node.name
    onnx.checker.check_model(proto, full_check=True)
    onnx.save(proto, str(out))
    return out


EOS = TINY["eos_token_id"]


def generate_like_transformers(model: Any, prompt: list[int], new: int) -> list[int]:
    """transformers' greedy `generate` (it stops at the eos: pass `eos_token_id=EOS` to ours)."""
    import torch

    return model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)[0].tolist()
