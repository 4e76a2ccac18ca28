"""`genai_config.json` for a decoder that carries its KV cache, so onnxruntime-genai can load the export.

Everything comes from the graph itself (`aviatorc.runtime.cache.find_cache`): the input and
output names (the cache names as printf patterns, "past_key_%d"), the layers (one key/value pair
each), KV heads and head size (the past's [batch, heads, past, head_size] dims), the vocabulary
(the logits' last dim), the hidden size (the token table's width), the query heads (an Attention
node's; where the graph spells attention out, hidden size / head size, as in the Llama, Mistral,
Qwen2, Phi-3 and GPT-2 families), and the context the plan was compiled for. Token ids are not
in an artifact: onnxruntime-genai needs an end-of-sequence id inside the vocabulary, so
`eos_token_id` defaults to 0, and the caller should pass the model's own.
"""

from __future__ import annotations

import re
from typing import Any

from aviatorc.ir import Graph
from aviatorc.runtime.cache import CacheLayout, find_cache


def genai_config(graph: Graph, model_file: str, context: int, *, eos_token_id: int = 0,
                 bos_token_id: int = 0, pad_token_id: int = 0, model_type: str = "llama") -> dict[str, Any] | None:
    """The onnxruntime-genai configuration of a decoder graph with a KV cache; None for any other graph."""
    layout = find_cache(graph)
    if layout is None:
        return None
    keys = [p for p in layout.pairs if p.kind == "key"]
    past_shape = layout.past_shapes[keys[0].past]
    kv_heads, head_size = (d if isinstance(d, int) else 0 for d in (past_shape[1], past_shape[-1]))
    logits = next(v for v in graph.outputs if v.name == layout.logits)
    vocab = logits.type.shape[-1]
    inputs: dict[str, str] = {"input_ids": layout.ids}
    if layout.attention_mask:
        inputs["attention_mask"] = layout.attention_mask
    if layout.position_ids:
        inputs["position_ids"] = layout.position_ids
    outputs: dict[str, str] = {"logits": layout.logits}
    for kind in ("key", "value"):
        inputs[f"past_{kind}_names"] = _pattern(layout, kind, past=True)
        outputs[f"present_{kind}_names"] = _pattern(layout, kind, past=False)
    hidden = _hidden_size(graph, layout)
    decoder = {"filename": model_file, "head_size": head_size, "hidden_size": hidden,
               "inputs": inputs, "outputs": outputs, "num_attention_heads": _query_heads(graph, hidden, head_size,
                                                                                           kv_heads),
               "num_hidden_layers": len(keys), "num_key_value_heads": kv_heads,
               "session_options": {"log_id": "onnxruntime-genai", "provider_options": []}}
    return {"model": {"bos_token_id": bos_token_id, "context_length": context, "decoder": decoder,
                      "eos_token_id": eos_token_id, "pad_token_id": pad_token_id, "type": model_type,
                      "vocab_size": vocab if isinstance(vocab, int) else 0},
            "search": {"do_sample": False, "max_length": context, "min_length": 0, "num_beams": 1,
                       "num_return_sequences": 1, "past_present_share_buffer": False, "repetition_penalty": 1.0,
                       "temperature": 1.0, "top_k": 1, "top_p": 1.0}}


def _pattern(layout: CacheLayout, kind: str, *, past: bool) -> str:
    """"past_key_%d" from past_key_0, past_key_1, ...: the layer number of every name replaced."""
    names = {p.layer: (p.past if past else p.present) for p in layout.pairs if p.kind == kind}
    layer, name = min(names.items())
    pattern = re.sub(rf"(?<!\d){layer}(?!\d)", "%d", name.replace("%", "%%"), count=1)
    if any(pattern % i != n for i, n in names.items()):
        raise ValueError(f"the cache names {sorted(names.values())} share no one pattern")
    return pattern


def _query_heads(graph: Graph, hidden: int, head_size: int, kv_heads: int) -> int:
    for node in graph.nodes:
        if node.op == "Attention":
            heads = node.attrs.get("q_num_heads") or node.input(0).type.shape[1]
            if isinstance(heads, int) and heads > 0:
                return heads
    return hidden // head_size if hidden and head_size and hidden % head_size == 0 else kv_heads


def _hidden_size(graph: Graph, layout: CacheLayout) -> int:
    ids = next(v for v in graph.inputs if v.name == layout.ids)
    for node in ids.users:
        if node.op == "Gather" and node.inputs[1] is ids:
            width = node.input(0).type.shape[-1]
            return width if isinstance(width, int) else 0
    return 0
