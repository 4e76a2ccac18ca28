"""Reference model configurations: Hugging Face `config.json` dicts for the models the
benchmarks and the seed article's claims are about.

`llama_config(name)` gives a dict ready to write as `config.json` and import shape-only
(`aviatorc.import_model(path)`); `param_count(config)` counts its parameters from the
dimensions alone, so a planner can check sizes without building anything.

- "llama-3-8b", "llama-3-70b": Meta's published configs (the fields that shape the graph).
- "dense-120b": a dense Llama-architecture model of about 123B parameters with the
  published dimensions of Mistral-Large-Instruct-2407 (hidden 12288, 88 layers, 96 heads,
  8 KV heads, intermediate 28672, vocab 32768). Its architecture (RMSNorm, rotary, GQA,
  SwiGLU, no biases) is Llama's, so it is written as a `LlamaForCausalLM` config. It stands
  in for the seed article's "120B" model.
"""

from __future__ import annotations

import copy
from typing import Any

_LLAMA_COMMON: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.02,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "use_cache": True,
}

_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    },
    "llama-3-70b": {
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    },
    "dense-120b": {
        "hidden_size": 12288,
        "intermediate_size": 28672,
        "num_hidden_layers": 88,
        "num_attention_heads": 96,
        "num_key_value_heads": 8,
        "vocab_size": 32768,
        "max_position_embeddings": 131072,
        "rope_theta": 1000000.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}

MODEL_NAMES: tuple[str, ...] = tuple(_CONFIGS)


def llama_config(name: str) -> dict[str, Any]:
    """A fresh `config.json` dict for `name` (one of MODEL_NAMES)."""
    if name not in _CONFIGS:
        from aviatorc.errors import OptionError

        raise OptionError(f"unknown model '{name}'", hint=f"known: {', '.join(MODEL_NAMES)}")
    return {**copy.deepcopy(_LLAMA_COMMON), **copy.deepcopy(_CONFIGS[name])}


def param_count(config: dict[str, Any]) -> int:
    """Parameters of a Llama-architecture config, from its dimensions (no biases)."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv_dim = config.get("num_key_value_heads", heads) * head_dim
    attn = hidden * heads * head_dim * 2 + hidden * kv_dim * 2  # q, o, k, v
    mlp = 3 * hidden * config["intermediate_size"]  # gate, up, down
    norms = 2 * hidden
    per_layer = attn + mlp + norms
    embed = config["vocab_size"] * hidden
    head = 0 if config.get("tie_word_embeddings") else embed
    return config["num_hidden_layers"] * per_layer + embed + head + hidden  # + final norm
