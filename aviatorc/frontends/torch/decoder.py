"""A causal language model as one step graph that takes and returns its KV cache.

    graph = import_decoder(model)            # a transformers causal LM, real or on the meta device

The graph runs `new` tokens after a cache of `past` positions for `batch` sequences, all three
symbolic, so the same graph serves the prompt (an empty past) and each decode step (one new
token), one sequence or a batch of them:

    inputs:  input_ids [batch, new], attention_mask [batch, past + new], position_ids [batch, new],
             past_key_values.N.key / .value [batch, kv_heads, past, head_dim] for each layer N
    outputs: logits [batch, new, vocab], present.N.key / .value [batch, kv_heads, past + new, head_dim]

(with multi-head latent attention, DeepSeek-V3, "key" is the compressed latent [batch, 1, past,
kv_lora_rank] and "value" the shared rotary key [batch, 1, past, qk_rope_head_dim]: what the
model caches; see `cache_shapes`)

(the names of Hugging Face's ONNX exporters, which `aviatorc.runtime.cache` recognizes). The
model is wrapped so the cache is plain tensors (`DecodeStep` rebuilds a `DynamicCache` from
them) and exported with `torch.export`.

Position ids are an input because the sequences of a batch stand at different lengths: the
runtime pads each one's past to the longest, with attention_mask 0 on the padded positions, and
gives each its own positions. The model's causal mask is built from cache indices (the new
tokens after all `past` slots) and its padding mask from attention_mask, so a padded position
is excluded whatever its place in the past.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from aviatorc.errors import ModelFormatError, OptionError

if TYPE_CHECKING:
    import torch

    from aviatorc.ir import Graph

# Example sizes: neither 0 nor 1 (torch.export specializes those), and unequal, so the
# exporter keeps `batch`, `new`, `past` and `past + new` apart.
EXAMPLE_BATCH = 2
EXAMPLE_NEW = 3
EXAMPLE_PAST = 4


def is_decoder(module: Any) -> bool:
    """A transformers model that generates (a causal-LM head over a decoder)."""
    can_generate = getattr(module, "can_generate", None)
    config = getattr(module, "config", None)
    return bool(callable(can_generate) and can_generate() and getattr(config, "num_hidden_layers", None))


@functools.cache
def decode_step_class() -> type[torch.nn.Module]:
    import torch
    from transformers import DynamicCache

    class DecodeStep(torch.nn.Module):
        """`forward(input_ids, attention_mask, position_ids, *past_kv) -> (logits, *present_kv)`,
        the cache flat: key_0, value_0, key_1, ... each [batch, kv_heads, past, head_dim]."""

        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner
            self.position_offset = position_offset(inner)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                    *past_kv: torch.Tensor) -> tuple[torch.Tensor, ...]:
            cfg: Any = self.inner.config
            # Full-length layers for every layer type: a sliding-window or chunked layer of the
            # config's own cache keeps only its window, but present = past + new for the runtime;
            # the model's masks apply the window, as they do over a static cache.
            cache = DynamicCache()
            for layer in range(cfg.num_hidden_layers):
                cache.update(past_kv[2 * layer], past_kv[2 * layer + 1], layer)
            if self.position_offset:
                position_ids = position_ids + self.position_offset
            out = self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             cache=cache, use_cache=True)
            present = [t for layer in cache.layers for t in (layer.keys, layer.values)]  # type: ignore[union-attr]
            return (out.logits, *present)

    return DecodeStep


def position_offset(model: Any) -> int:
    """Where the model's learned positions start. RoBERTa's family (CamemBERT, XLM-RoBERTa,
    Data2Vec-text, ...) numbers them from padding_idx + 1, as its `create_position_ids_from_input_ids`
    does when no position ids are given; the runtime's position ids count from 0."""
    import torch

    for module in model.modules():
        table = getattr(module, "position_embeddings", None)
        padding = getattr(module, "padding_idx", None)
        if isinstance(table, torch.nn.Embedding) and table.padding_idx is not None and padding is not None:
            return int(padding) + 1
    return 0


def cache_shapes(model: Any) -> list[tuple[int, int]]:
    """(heads, width) of each cache tensor (key_0, value_0, key_1, ...), as the model writes them.

    Read off one token run through the model with an empty cache (on the meta device when the
    model is there), so every layout comes out right: grouped-query K and V [kv_heads, head_dim],
    and DeepSeek-V3's multi-head latent attention, whose cache holds the compressed latent
    [1, kv_lora_rank] and the shared rotary key [1, qk_rope_head_dim] instead of per-head K and V."""
    import torch
    from transformers import DynamicCache

    from aviatorc.frontends.torch import exporter

    device = "meta" if exporter.parameter_device(model) == "meta" else "cpu"
    cache = DynamicCache()
    ids = torch.zeros((1, 1), dtype=torch.int64, device=device)
    try:
        with torch.no_grad():
            model(input_ids=ids, cache=cache, use_cache=True)
    except Exception as error:  # noqa: BLE001 - transformers' own refusal, said as the model's
        raise ModelFormatError(f"'{model.config.model_type}' does not run with a plain key/value cache "
                               f"(transformers: {type(error).__name__}: {str(error).splitlines()[0][:200]})",
                               hint="aviatorc's decode step keeps one key and one value tensor per layer; "
                                    "caches with extra per-layer state (indexers, compressed blocks) are not "
                                    "supported") from None
    shapes = []
    for layer in cache.layers:
        layer_any: Any = layer  # a DynamicLayer: keys and values [batch, heads, seq, width]
        for tensor in (layer_any.keys, layer_any.values):
            shapes.append((int(tensor.shape[1]), int(tensor.shape[3])))
    return shapes


def example_step(model: Any, new: int = EXAMPLE_NEW, past: int = EXAMPLE_PAST, seed: int = 0,
                 batch: int = EXAMPLE_BATCH) -> tuple[torch.Tensor, ...]:
    """Inputs of one step of `model`: `new` tokens after `past` cached positions, for `batch`
    sequences (input_ids, attention_mask, position_ids, *cache)."""
    import torch

    from aviatorc.frontends.torch import exporter

    device = "meta" if exporter.parameter_device(model) == "meta" else "cpu"
    dtype = next(model.parameters()).dtype
    gen = torch.Generator().manual_seed(seed)
    vocab = int(model.config.vocab_size)
    ids = torch.randint(0, vocab, (batch, new), generator=gen, dtype=torch.int64)
    mask = torch.ones(batch, past + new, dtype=torch.int64)
    positions = torch.arange(past, past + new, dtype=torch.int64).expand(batch, new).contiguous()
    cache = [torch.randn(batch, heads, past, width, generator=gen).to(dtype) for heads, width in cache_shapes(model)]
    return tuple(t.to(device) for t in (ids, mask, positions, *cache))


def step_dynamic_shapes(layers: int) -> tuple[Any, ...]:
    """`torch.export` dynamic shapes of a step's inputs: batch, new and past all `Dim.AUTO` (the
    exporter infers that the mask is past + new long; named Dims cannot add two Dims)."""
    import torch

    auto = torch.export.Dim.AUTO
    tokens = {0: auto, 1: auto}
    return (tokens, tokens, tokens, tuple({0: auto, 2: auto} for _ in range(2 * layers)))


def cache_names(layers: int) -> tuple[list[str], list[str]]:
    """(past input names, present output names), layer by layer, key before value."""
    pairs = [(i, kv) for i in range(layers) for kv in ("key", "value")]
    return [f"past_key_values.{i}.{kv}" for i, kv in pairs], [f"present.{i}.{kv}" for i, kv in pairs]


def import_decoder(model: torch.nn.Module, *, name: str | None = None) -> Graph:
    """The step graph of a transformers causal LM (see the module docstring)."""
    from aviatorc.frontends.hf_config import check_layer_kinds
    from aviatorc.frontends.torch import import_torch

    if not is_decoder(model):
        raise OptionError(f"{type(model).__name__} is not a transformers causal language model",
                          hint="pass example_inputs to import its forward instead")
    check_layer_kinds(model)
    step = decode_step_class()(model).eval()
    inputs = example_step(model)
    layers = int(model.config.num_hidden_layers)  # type: ignore[union-attr, arg-type]
    graph = import_torch(step, inputs, dynamic_shapes=step_dynamic_shapes(layers), name=name or type(model).__name__)
    past, present = cache_names(layers)
    for value, new_name in zip(graph.inputs, ["input_ids", "attention_mask", "position_ids", *past], strict=True):
        graph.rename(value, new_name)
    for value, new_name in zip(graph.outputs, ["logits", *present], strict=True):
        graph.rename(value, new_name)
    graph.metadata["decoder"] = "kv-cache-io"
    from aviatorc.frontends.torch.hf import record_model_facts

    generation = getattr(model, "generation_config", None)  # its eos ids can name more than the config's
    record_model_facts(graph, model.config, getattr(generation, "eos_token_id", None))
    return graph
