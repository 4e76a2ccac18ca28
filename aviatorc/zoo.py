"""Tiny, deterministic models of real architectures, for tests and the op census.

Each model is built from a ``transformers`` config object with random weights (no
download), at a size where an ONNX export takes seconds: hidden 32, 4 heads (2 kv
heads in the Llama family: grouped-query attention), 2 layers, vocab 128. Every
parameter is then perturbed with seeded noise, because the ONNX exporter's
optimizer deletes additions of all-zero biases and multiplications by all-one norm
weights, and a fixture without them would not exercise those ops.

The model is wrapped so that it takes plain tensors and returns one named tensor
(``logits`` for decoders, ``hidden`` for BERT), which keeps ``torch.export`` and
``torch.onnx.export`` calls simple.

torch, transformers and onnx are imported inside functions: importing
``aviatorc`` must not pull them in.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

ZOO_ARCHS: tuple[str, ...] = ("gpt2", "llama", "mistral", "qwen2", "phi3", "opt", "bert")

Exporter = Literal["dynamo", "legacy"]

# Opsets each exporter is asked for. The dynamo exporter silently writes 18 when
# asked for 17 (and a GPT-2 file onnxruntime refuses), so 18 is its floor.
DYNAMO_OPSETS: tuple[int, ...] = (18, 20, 23)
LEGACY_OPSET = 17
DEFAULT_OPSET: dict[str, int] = {"dynamo": 18, "legacy": LEGACY_OPSET}

VOCAB_SIZE = 128
HIDDEN = 32
LAYERS = 2
MAX_POSITIONS = 64

# Standard deviation of the noise added to every parameter after construction.
PERTURB_STD = 0.02

# Architectures whose decode step export_decode_onnx supports: the HF models that
# keep their KV cache in a DynamicCache with [batch, kv_heads, past, head_dim] layers.
DECODE_ARCHS: tuple[str, ...] = ("llama", "mistral", "qwen2", "phi3", "gpt2")


def _config(arch: str) -> Any:
    """The tiny ``transformers`` config for ``arch``."""
    import transformers as tf

    # Special tokens inside the tiny vocab (GPT-2 and Phi-3 default outside it and warn).
    common: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "use_cache": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if arch == "gpt2":
        return tf.GPT2Config(n_embd=HIDDEN, n_layer=LAYERS, n_head=4, n_positions=MAX_POSITIONS, **common)
    llama_like: dict[str, Any] = {
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,  # grouped-query attention: 2 query heads per kv head
        "intermediate_size": 2 * HIDDEN + 8,  # 72: not a multiple of hidden
        "max_position_embeddings": MAX_POSITIONS,
        **common,
    }
    if arch == "llama":
        return tf.LlamaConfig(**llama_like)
    if arch == "mistral":
        return tf.MistralConfig(sliding_window=None, **llama_like)
    if arch == "qwen2":
        return tf.Qwen2Config(**llama_like)
    if arch == "phi3":
        # Phi-3 fuses Q/K/V into one projection (qkv_proj) and gate/up into one.
        return tf.Phi3Config(pad_token_id=0, **llama_like)
    if arch == "opt":
        return tf.OPTConfig(
            hidden_size=HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=4,
            ffn_dim=2 * HIDDEN + 8,
            word_embed_proj_dim=HIDDEN,
            max_position_embeddings=MAX_POSITIONS,
            pad_token_id=1,
            **common,
        )
    if arch == "bert":
        return tf.BertConfig(
            hidden_size=HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=4,
            intermediate_size=2 * HIDDEN + 8,
            max_position_embeddings=MAX_POSITIONS,
            **common,
        )
    raise ValueError(f"unknown zoo architecture {arch!r}; choose one of {', '.join(ZOO_ARCHS)}")


def config(arch: str) -> Any:
    """The ``transformers`` config the zoo model for ``arch`` is built from."""
    cfg = _config(arch)
    cfg._attn_implementation = "eager"  # plain MatMul/Softmax, no SDPA kernel
    return cfg


def perturb(model: torch.nn.Module, seed: int) -> None:
    """Add seeded Gaussian noise to every parameter (biases and norm weights too)."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            param.add_(torch.randn(param.shape, generator=gen, dtype=param.dtype) * PERTURB_STD)


def build_model(arch: str, seed: int = 0) -> torch.nn.Module:
    """A tiny eval-mode model of ``arch`` with seeded, perturbed weights.

    Takes ``input_ids`` and ``attention_mask`` (both int64 [batch, seq]) and returns
    one tensor: logits [batch, seq, vocab] for decoders, the last hidden state
    [batch, seq, hidden] for BERT.
    """
    import torch
    import transformers as tf

    cfg = config(arch)
    torch.manual_seed(seed)
    if arch == "bert":
        inner = tf.BertModel(cfg, add_pooling_layer=False)
    else:
        inner = tf.AutoModelForCausalLM.from_config(cfg)
    perturb(inner, seed)
    field = "last_hidden_state" if arch == "bert" else "logits"
    return _single_output_class()(inner, field).eval()


@functools.cache
def _single_output_class() -> type[torch.nn.Module]:
    """The wrapper class, defined on first use so this module never imports torch at load."""
    import torch

    class SingleOutput(torch.nn.Module):
        """Calls a HF model with plain tensors and returns one field of its output."""

        def __init__(self, inner: torch.nn.Module, field: str) -> None:
            super().__init__()
            self.inner = inner
            self.field = field

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            out = self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            return out[self.field]

    return SingleOutput


def example_inputs(arch: str, batch: int = 1, seq: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded ``input_ids`` (int64) and an all-ones ``attention_mask`` (int64).

    Every arch gets an explicit ``attention_mask``: the legacy exporter fails on
    Llama-family models (``aten::diff``) without one.
    """
    import torch

    if arch not in ZOO_ARCHS:
        raise ValueError(f"unknown zoo architecture {arch!r}; choose one of {', '.join(ZOO_ARCHS)}")
    gen = torch.Generator().manual_seed(seed)
    # Token 0..2 are pad/bos/eos in some configs; stay clear of them.
    input_ids = torch.randint(3, VOCAB_SIZE, (batch, seq), generator=gen, dtype=torch.int64)
    attention_mask = torch.ones(batch, seq, dtype=torch.int64)
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def output_name(arch: str) -> str:
    """The name of the single ONNX graph output."""
    # Not "last_hidden_state"/"embedding"-like internal names: with dynamo=True an
    # output named like an internal value silently yields a file defining it twice.
    return "hidden" if arch == "bert" else "logits"


def export_onnx(
    arch: str,
    path: str | Path,
    *,
    exporter: Exporter = "dynamo",
    opset: int | None = None,
    dynamic: bool = False,
    seed: int = 0,
) -> Path:
    """Export the zoo model for ``arch`` to ``path`` and check it with the ONNX checker.

    ``dynamo`` defaults to opset 18 (20 and 23 also work); ``legacy`` to 17.
    ``dynamic=True`` makes the batch and sequence axes symbolic.
    """
    import onnx
    import torch

    if exporter not in DEFAULT_OPSET:
        raise ValueError(f"unknown exporter {exporter!r}; choose 'dynamo' or 'legacy'")
    opset = DEFAULT_OPSET[exporter] if opset is None else opset
    if exporter == "dynamo" and opset < 18:
        raise ValueError(f"dynamo exporter writes opset 18 when asked for {opset}; ask for >= 18")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    model = build_model(arch, seed)
    inputs = example_inputs(arch, seed=seed)
    names = list(inputs)
    out = output_name(arch)
    kwargs: dict[str, Any] = {}
    if dynamic:
        if exporter == "dynamo":
            batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
            kwargs["dynamic_shapes"] = {n: {0: batch, 1: seq} for n in names}
        else:
            axes = {0: "batch", 1: "seq"}
            kwargs["dynamic_axes"] = {**{n: axes for n in names}, out: axes}
    torch.onnx.export(
        model,
        (),
        str(path),
        kwargs=inputs,
        input_names=names,
        output_names=[out],
        opset_version=opset,
        dynamo=exporter == "dynamo",
        verbose=False,
        **kwargs,
    )
    onnx.checker.check_model(str(path), full_check=True)
    return path


CacheNaming = Literal["flat", "hf"]


def decode_input_names(arch: str, naming: CacheNaming = "flat") -> tuple[list[str], list[str]]:
    """(input names, output names) of the decode-step graph for ``arch``: ``input_ids``,
    ``attention_mask``, ``position_ids``, then the cache as ``past_key_0`` / ``present_key_0``
    (``flat``) or ``past_key_values.0.key`` / ``present.0.key`` (``hf``, as Hugging Face's
    exporters name it)."""
    layers = config(arch).num_hidden_layers
    pairs = [(i, kv) for i in range(layers) for kv in ("key", "value")]
    tokens = ["input_ids", "attention_mask", "position_ids"]
    if naming == "hf":
        return ([*tokens, *(f"past_key_values.{i}.{kv}" for i, kv in pairs)],
                ["logits", *(f"present.{i}.{kv}" for i, kv in pairs)])
    return ([*tokens, *(f"past_{kv}_{i}" for i, kv in pairs)],
            ["logits", *(f"present_{kv}_{i}" for i, kv in pairs)])


def decode_example_inputs(arch: str, past: int = 6, seed: int = 0, new: int = 1,
                          naming: CacheNaming = "flat", batch: int = 1) -> dict[str, torch.Tensor]:
    """Inputs of one step: ``new`` tokens after ``past`` cached positions, for ``batch``
    sequences, at positions ``past .. past + new - 1``."""
    import torch

    cfg = config(arch)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    names, _ = decode_input_names(arch, naming)
    gen = torch.Generator().manual_seed(seed)
    tensors = [
        torch.randint(3, VOCAB_SIZE, (batch, new), generator=gen, dtype=torch.int64),
        torch.ones(batch, past + new, dtype=torch.int64),
        torch.arange(past, past + new, dtype=torch.int64).expand(batch, new).contiguous(),
    ]
    tensors += [torch.randn(batch, kv_heads, past, head_dim, generator=gen) for _ in names[3:]]
    return dict(zip(names, tensors, strict=True))


def build_decode_model(arch: str, seed: int = 0) -> torch.nn.Module:
    """The zoo model of ``arch`` wrapped as one decode step with a flat KV cache.

    ``forward(input_ids [batch, new], attention_mask [batch, past + new], position_ids
    [batch, new], *past_kv)`` where ``past_kv`` is key_0, value_0, key_1, ... each
    [batch, kv_heads, past, head_dim]; returns (logits, *present_kv) with the cache grown by
    ``new`` positions.
    """
    if arch not in DECODE_ARCHS:
        raise ValueError(f"no decode-step export for {arch!r}; choose one of {', '.join(DECODE_ARCHS)}")
    inner = build_model(arch, seed).inner
    from aviatorc.frontends.torch.decoder import decode_step_class

    return decode_step_class()(inner).eval()


def export_decode_onnx(arch: str, path: str | Path, *, opset: int = 18, seed: int = 0,
                       naming: CacheNaming = "flat") -> Path:
    """Export a step of ``arch`` with its KV cache (dynamo exporter): ``new`` tokens after a
    ``past`` of any length, for any ``batch`` of sequences, all dynamic, so one graph serves
    the prompt (past 0) and each decode step (new 1), one sequence or a batch of them.

    Inputs: ``input_ids`` [batch, new], ``attention_mask`` [batch, past + new],
    ``position_ids`` [batch, new], the cache (``past_key_i`` / ``past_value_i``, or the ``hf``
    names) [batch, kv_heads, past, head_dim]; outputs ``logits`` [batch, new, vocab] and the
    cache grown by ``new`` positions. The sequences of a batch may stand at different lengths:
    pad the shorter pasts, with attention_mask 0 there, and give each its own positions.
    """
    in_names, out_names = decode_input_names(arch, naming)
    inner: Any = build_model(arch, seed).inner
    return export_step_onnx(inner, path, opset=opset, names=(in_names, out_names))


def export_step_onnx(model: Any, path: str | Path, *, opset: int = 18, one_token: bool = False,
                     names: tuple[list[str], list[str]] | None = None) -> Path:
    """Export one step of any ``transformers`` causal LM with its KV cache, as decoder-with-past
    exporters write it (inputs ``input_ids``, ``attention_mask``, ``position_ids``,
    ``past_key_values.N.key`` / ``.value``; outputs ``logits``, ``present.N.key`` / ``.value``,
    or ``names``). Batch, past and new tokens are dynamic; ``one_token`` fixes the new tokens at 1
    (past still dynamic), as many exporters of a decoder-with-past do."""
    import onnx
    import torch

    from aviatorc.frontends.torch.decoder import (
        EXAMPLE_BATCH,
        EXAMPLE_NEW,
        EXAMPLE_PAST,
        cache_names,
        decode_step_class,
        example_step,
        step_dynamic_shapes,
    )

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    layers = int(model.config.num_hidden_layers)
    step = decode_step_class()(model).eval()
    # The example sizes of the compiler's own step graph (none 0 or 1, all unequal), and its
    # dynamic shapes, so the two exports agree on what is symbolic.
    inputs = example_step(model, new=1 if one_token else EXAMPLE_NEW, past=EXAMPLE_PAST, batch=EXAMPLE_BATCH)
    dynamic = step_dynamic_shapes(layers)
    if one_token:  # ids and positions keep their batch axis only
        auto = torch.export.Dim.AUTO
        dynamic = ({0: auto}, dynamic[1], {0: auto}, dynamic[3])
    past, present = cache_names(layers)
    in_names, out_names = names or (["input_ids", "attention_mask", "position_ids", *past], ["logits", *present])
    torch.onnx.export(step, inputs, str(path), input_names=in_names, output_names=out_names, opset_version=opset,
                      dynamo=True, verbose=False, dynamic_shapes=dynamic)
    onnx.checker.check_model(str(path), full_check=True)
    return path


# -- the families of current models: mixtures of experts and attention variants -----------------
#
# Tiny configs of the released families, as config.json files hold them (so the same dict is
# written to disk for the config.json import and built as a transformers module), at the zoo's
# size: hidden 32, 4 heads (2 kv heads), 2 layers, vocab 128. Each keeps what makes its family
# different: experts and their routing, shared experts, multi-head latent attention, attention
# sinks and sliding-window layers, chunked attention, complex rotary, soft-capping, QK-norm.
# Windows and chunks are 6 tokens, so a 40-token generation crosses them.

FAMILY_ARCHS: tuple[str, ...] = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "llama4_text", "gemma2")
MOE_ARCHS: tuple[str, ...] = FAMILY_ARCHS[:5]

_FAMILY_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": MAX_POSITIONS, "bos_token_id": 1, "eos_token_id": 2,
    "pad_token_id": 0, "tie_word_embeddings": False, "torch_dtype": "float32",
}
_FAMILIES: dict[str, dict[str, Any]] = {
    # 4 experts, top-2, softmax then renormalized
    "mixtral": {"architectures": ["MixtralForCausalLM"], "intermediate_size": 24, "num_local_experts": 4,
                "num_experts_per_tok": 2},
    # 8 experts, top-2, QK-norm, head_dim apart from hidden / heads
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "intermediate_size": 48, "moe_intermediate_size": 24,
                  "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "head_dim": 8},
    # layer 0 dense, layer 1: 8 routed experts in 2 groups (1 kept), top-2, sigmoid with a selection
    # bias, scaled; a shared expert; multi-head latent attention (the cache holds the latent)
    "deepseek_v3": {"architectures": ["DeepseekV3ForCausalLM"], "num_key_value_heads": 4, "intermediate_size": 48,
                    "moe_intermediate_size": 16, "n_routed_experts": 8, "n_shared_experts": 1,
                    "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
                    "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 4, "qk_nope_head_dim": 8,
                    "v_head_dim": 8, "routed_scaling_factor": 2.5, "norm_topk_prob": True},
    # 4 experts with biases and the clamped gate, top-2 of the logits then softmax; attention sinks;
    # a sliding-window layer then a full one; YaRN rotary
    "gpt_oss": {"architectures": ["GptOssForCausalLM"], "intermediate_size": 24, "num_local_experts": 4,
                "num_experts_per_tok": 2, "head_dim": 8, "sliding_window": 6,
                "layer_types": ["sliding_attention", "full_attention"],
                "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "original_max_position_embeddings": 16},
                "rope_theta": 150000.0},
    # layer 0 dense with chunked attention, complex rotary and L2 QK-norm; layer 1: 4 experts, top-1
    # sigmoid, a shared expert, no rotary, full attention
    "llama4_text": {"architectures": ["Llama4ForCausalLM"], "intermediate_size": 24, "intermediate_size_mlp": 40,
                    "num_local_experts": 4, "num_experts_per_tok": 1, "head_dim": 8, "attention_chunk_size": 6,
                    "moe_layers": [1], "no_rope_layers": [1, 0], "use_qk_norm": True,
                    "layer_types": ["chunked_attention", "full_attention"]},
    # dense: logit soft-capping (attention and final), a sliding-window layer then a full one
    "gemma2": {"architectures": ["Gemma2ForCausalLM"], "intermediate_size": 48, "head_dim": 8, "sliding_window": 6,
               "layer_types": ["sliding_attention", "full_attention"], "query_pre_attn_scalar": 8,
               "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
}


def family_config(arch: str) -> dict[str, Any]:
    """The tiny config.json (a JSON-ready dict) of a current family (`FAMILY_ARCHS`)."""
    if arch not in _FAMILIES:
        raise ValueError(f"unknown family {arch!r}; choose one of {', '.join(FAMILY_ARCHS)}")
    return {"model_type": arch, **_FAMILY_COMMON, **_FAMILIES[arch]}


def write_family_config(arch: str, folder: str | Path) -> Path:
    """`family_config(arch)` written as `folder/config.json`."""
    import json

    path = Path(folder) / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(family_config(arch), indent=2, sort_keys=True) + "\n")
    return path


def build_family_model(arch: str, seed: int = 0) -> torch.nn.Module:
    """The tiny causal LM of `arch` (a `transformers` module, eval mode) with seeded, perturbed
    weights, in transformers' own attention (SDPA, or eager where the family refuses it)."""
    import torch

    from aviatorc.frontends.torch.hf import build_meta_model

    model = build_meta_model(family_config(arch), on_meta=False, seed=seed)
    perturb(model, seed)
    with torch.no_grad():  # a zero selection bias would leave DeepSeek's correction untested
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(seed + 2)) * 0.05)
    return model.eval()


__all__ = [
    "DECODE_ARCHS",
    "FAMILY_ARCHS",
    "MOE_ARCHS",
    "build_family_model",
    "family_config",
    "write_family_config",
    "DYNAMO_OPSETS",
    "LEGACY_OPSET",
    "ZOO_ARCHS",
    "build_decode_model",
    "build_model",
    "config",
    "decode_example_inputs",
    "decode_input_names",
    "example_inputs",
    "export_decode_onnx",
    "export_onnx",
    "export_step_onnx",
    "output_name",
    "perturb",
]
