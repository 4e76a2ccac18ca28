"""The weights to place: read from an IR graph, or computed from a Llama-style config.

`weights_from_graph` walks the IR:
- `MatMul(x, W)` where W is an initializer (a dense weight, its format from its dtype), a
  `DequantizeWeight` output (the format from its attributes, the logical [k, n] from its
  output type) or a `Transpose` of a rank-2 initializer;
- `Gather(table, ids)` on an initializer: an embedding, looked up rather than multiplied.
A weight used twice (tied) is placed once. The layer index comes from the parameter name
(`layers.N.`, `h.N.`, `layer.N.`, `blocks.N.`). Where names do not give it (ONNX dynamo
exports name weights `val_44`), it comes from the structure (`_structural_layers`): the
attention blocks (Softmax or Attention nodes) are counted in topological order, a weight
feeding the next one (q, k) or the MatMul that consumes its probabilities (v) belongs to
that block, any other weight (o, MLP) to the last block before it, a head after the last
block to the block count, the embedding to -1. Without either, a weight gets -1 before the
first block and the last block + 1 after it.
"""

from __future__ import annotations

import re
from typing import Any

from aviatorc.formats import WeightFormat, dense_format
from aviatorc.partition.tiling import WeightSpec

_LAYER = re.compile(r"(?:^|[._/])(?:layers|layer|h|blocks)[._/](\d+)(?:[._/]|$)")
_ROLES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head", "c_attn",
          "c_proj", "c_fc", "qkv_proj", "gate_up_proj", "dense", "fc1", "fc2", "query", "key", "value")


def layer_of(name: str) -> int | None:
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


def role_of(name: str) -> str:
    for role in _ROLES:
        if role in name:
            return role
    return "linear"


def weights_from_graph(graph: Any) -> list[WeightSpec]:
    """Every weight of `graph` the partitioner places, in graph order."""
    found: list[tuple[str, int | None, str, int, int, WeightFormat, str]] = []
    seen: set[str] = set()
    consumers: dict[str, Any] = {}  # weight name -> the node that reads it
    for node in graph.nodes:
        if node.op == "MatMul" and len(node.inputs) >= 2 and node.inputs[1] is not None:
            weight = _linear_weight(node.inputs[1])
            if weight is None or weight[0] in seen:
                continue
            name, k, n, fmt = weight
            seen.add(name)
            consumers[name] = node
            x = node.inputs[0]
            found.append((name, layer_of(name), role_of(name), k, n, fmt, x.name if x is not None else name))
        elif node.op == "Gather" and node.inputs[0] is not None and node.inputs[0].is_initializer:
            table = node.inputs[0]
            shape = table.type.shape
            if len(shape) != 2 or not all(isinstance(d, int) for d in shape) or int(node.attrs.get("axis", 0)) != 0:
                continue
            if table.name in seen:
                continue
            seen.add(table.name)
            consumers[table.name] = node
            found.append((table.name, layer_of(table.name), "embedding", int(shape[0]), int(shape[1]),
                          dense_format(table.type.dtype), node.inputs[1].name if node.inputs[1] else table.name))
    if any(layer is None for _, layer, *_ in found):
        inferred = _structural_layers(graph, consumers)
        found = [(name, inferred.get(name) if layer is None else layer, role, k, n, fmt, x)
                 for name, layer, role, k, n, fmt, x in found]
    return _with_layers(found)


_ATTENTION = ("Softmax", "Attention")  # one per attention block, in topological order
# Data flow that is not a layer's: shapes read off a tensor (a causal mask built from the hidden
# states' shape must not tie the embedding to the first block's softmax).
_SHAPE_ONLY = ("Shape", "Size", "ConstantOfShape")


def _structural_layers(graph: Any, consumers: dict[str, Any]) -> dict[str, int]:
    """Layer indices from the attention blocks; {} when the graph has none.

    `after[v]`: the index of the last attention block among v's ancestors (-1: none). A weight
    read at `after = j` belongs to block j + 1 when its cone (what its output reaches before the
    next weight) holds block j + 1's Softmax or a weightless MatMul reading that block's
    probabilities (v); otherwise to block j (o, MLP), except a head (cone reaches a graph output
    and no weight) after the last block, which gets the block count.
    """
    nodes = list(graph.nodes)
    blocks = [node for node in nodes if node.op in _ATTENTION]
    if not blocks:
        return {}
    index = {id(node): i for i, node in enumerate(blocks)}
    weight_nodes = {id(node) for node in consumers.values()}
    after: dict[int, int] = {}  # id(value) -> last block among its ancestors
    for node in nodes:
        level = index.get(id(node), max((after.get(id(v), -1) for v in node.inputs if v is not None), default=-1))
        for out in node.outputs:
            after[id(out)] = level
    outputs = {id(v) for v in graph.outputs}
    layers: dict[str, int] = {}
    for name, node in consumers.items():
        if node.op == "Gather":
            layers[name] = -1
            continue
        x = node.inputs[0]
        base = after.get(id(x), -1) if x is not None else -1
        bumped, reaches_output, reaches_weight = _cone(node, base, index, weight_nodes, after, outputs)
        if bumped:
            layers[name] = base + 1
        elif base == len(blocks) - 1 and reaches_output and not reaches_weight:
            layers[name] = len(blocks)  # the head
        else:
            layers[name] = base
    return layers


def _cone(start: Any, base: int, index: dict[int, int], weight_nodes: set[int], after: dict[int, int],
          outputs: set[int]) -> tuple[bool, bool, bool]:
    """Walk forward from `start`'s outputs up to the next weight: (reaches block base + 1 as q, k
    or v, reaches a graph output, reaches another weight)."""
    stack = [v for v in start.outputs]
    seen: set[int] = set()
    reaches_output = reaches_weight = False
    while stack:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        reaches_output |= id(value) in outputs
        for user in value.users:
            if id(user) in weight_nodes:
                reaches_weight = True
                continue
            if user.op in _SHAPE_ONLY:
                continue
            if index.get(id(user)) == base + 1:
                return True, reaches_output, reaches_weight  # q or k: feeds the block's softmax
            if user.op == "MatMul" and any(v is not None and after.get(id(v), -1) == base + 1 for v in user.inputs):
                return True, reaches_output, reaches_weight  # v: multiplied by the block's probabilities
            if any(after.get(id(out), -1) > base + 1 for out in user.outputs):
                continue  # past the next block: nothing there is this weight's
            stack.extend(user.outputs)
    return False, reaches_output, reaches_weight


def _linear_weight(value: Any) -> tuple[str, int, int, WeightFormat] | None:
    shape = value.type.shape
    if value.is_initializer:
        if len(shape) != 2 or not all(isinstance(d, int) for d in shape):
            return None
        return value.name, int(shape[0]), int(shape[1]), dense_format(value.type.dtype)
    producer = value.producer
    if producer is not None and producer.op == "Cast" and producer.inputs[0] is not None:
        producer = producer.inputs[0].producer  # a float16 model casts the dequantized weight
    if producer is None:
        return None
    if producer.op == "DequantizeWeight":
        fmt = WeightFormat.from_attrs(producer.attrs)
        k, n = (int(d) for d in value.type.shape[-2:])
        stored = producer.inputs[0]
        return (stored.name if stored is not None else value.name), k, n, fmt
    if producer.op == "Transpose" and producer.inputs[0] is not None and producer.inputs[0].is_initializer:
        source = producer.inputs[0]
        if len(source.type.shape) == 2 and all(isinstance(d, int) for d in shape) and len(shape) == 2:
            return source.name, int(shape[0]), int(shape[1]), dense_format(source.type.dtype)
    return None


def _with_layers(found: list[tuple[str, int | None, str, int, int, WeightFormat, str]]) -> list[WeightSpec]:
    """Fill in missing layer indices: -1 before the first numbered weight, last + 1 after it."""
    numbered = [layer for _, layer, *_ in found if layer is not None]
    last = max(numbered) if numbered else -1
    specs: list[WeightSpec] = []
    seen_numbered = False
    for name, layer, role, k, n, fmt, x in found:
        if layer is not None:
            seen_numbered = True
        else:
            layer = last + 1 if seen_numbered or role == "lm_head" else -1
        specs.append(WeightSpec(name, layer, role, k, n, fmt, x))
    return specs


def weights_from_config(config: dict[str, Any], linear_format: WeightFormat, *,
                        embedding_format: WeightFormat | None = None) -> list[WeightSpec]:
    """The weights of a Llama-architecture `config.json` dict, shape-only, without building a graph.

    Linear weights get `linear_format`; the embedding stays `embedding_format` (FP16 by default,
    as the quantize pass keeps it). Norm weights are vectors and are not placed.
    """
    embedding_format = embedding_format or WeightFormat("fp16")
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads", heads) * head_dim
    inter = config["intermediate_size"]
    layers = config["num_hidden_layers"]
    specs = [WeightSpec("model.embed_tokens.weight", -1, "embedding", config["vocab_size"], hidden,
                        embedding_format, "input_ids")]
    for i in range(layers):
        p = f"model.layers.{i}."
        specs += [
            WeightSpec(p + "self_attn.q_proj.weight", i, "q_proj", hidden, heads * head_dim, linear_format, p + "attn_in"),
            WeightSpec(p + "self_attn.k_proj.weight", i, "k_proj", hidden, kv, linear_format, p + "attn_in"),
            WeightSpec(p + "self_attn.v_proj.weight", i, "v_proj", hidden, kv, linear_format, p + "attn_in"),
            WeightSpec(p + "self_attn.o_proj.weight", i, "o_proj", heads * head_dim, hidden, linear_format, p + "attn_out"),
            WeightSpec(p + "mlp.gate_proj.weight", i, "gate_proj", hidden, inter, linear_format, p + "mlp_in"),
            WeightSpec(p + "mlp.up_proj.weight", i, "up_proj", hidden, inter, linear_format, p + "mlp_in"),
            WeightSpec(p + "mlp.down_proj.weight", i, "down_proj", inter, hidden, linear_format, p + "mlp_act"),
        ]
    if config.get("tie_word_embeddings"):
        return specs
    specs.append(WeightSpec("lm_head.weight", layers, "lm_head", hidden, config["vocab_size"], linear_format,
                            "final_norm"))
    return specs


def with_formats(specs: list[WeightSpec], linear_format: WeightFormat,
                 embedding_format: WeightFormat | None = None) -> list[WeightSpec]:
    """The same weights stored in other formats (what the quantize pass does to a graph)."""
    from dataclasses import replace

    embedding_format = embedding_format or WeightFormat("fp16")
    return [replace(s, format=embedding_format if s.is_embedding else linear_format) for s in specs]
