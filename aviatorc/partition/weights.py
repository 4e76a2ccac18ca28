"""The weights to place: read from an IR graph, or computed from a Llama-style config.

`weights_from_graph` walks the IR:
- `MatMul(x, W)` where W is an initializer (a dense weight, its format from its dtype), a
  `DequantizeWeight` output (the format from its attributes, the logical [k, n] from its
  output type) or a `Transpose` of a rank-2 initializer;
- `Gather(table, ids)` on an initializer: an embedding, looked up rather than multiplied.
A weight read by several MatMuls is placed once and lists every reader in `nodes`.

Tied embeddings: a head MatMul whose weight is the embedding table read transposed (a
`Transpose` of the table; or the frontends' lazy transposed initializer, named
`<table>.T` by the torch importer and `<table>_T` by the ONNX one, or holding a `Derived` of
the table's own data) is the same tensor. It becomes a linear `lm_head` spec with
`tied_to=<table>` that holds the bytes, and the table's embedding spec becomes an alias
(`tied_to=<head>`, 0 bytes, no tiles): see `tiling.py`. A quantized head (a `DequantizeWeight`
of its own packed bytes) is a separate tensor and is not tied.

Fused weights: a MatMul output (after an optional bias Add and column-keeping Reshapes) read
only by one `Split` on the
last axis (fuse-qkv, GPT-2's c_attn), or only by `Slice`s of the last axis that cover it
(Phi-3's qkv_proj), gives `splits`: (role, n_start, n_stop) per part, roles "q", "k", "v"
for a three-part attention projection, "gate", "up" for a two-part MLP one, else "" (a part
without a name of its own, such as MLA's latent / rotary-key split, has its weight's role).

Roles come from whole dotted name components (`qkv_proj` is not `v_proj`). The layer index
comes from the parameter name (`layers.N.`, `h.N.`, `layer.N.`, `blocks.N.`). Where names do
not give it (ONNX dynamo exports name weights `val_44`), it comes from the structure
(`_structural_layers`): the attention blocks (Softmax or Attention nodes) are counted in
topological order, a weight feeding the next one (q, k) or the MatMul that consumes its
probabilities (v) belongs to that block, any other weight (o, MLP) to the last block before
it, a head after the last block to the block count, the embedding to -1. Without either, a
weight gets -1 before the first block and the last block + 1 after it.

`weights_from_config` gives the same specs from a config alone, with synthetic node names:
the Hugging Face module paths (`model.embed_tokens` for the Gather, `model.layers.3.mlp.up_proj`,
`lm_head`), which the importer's node names do not follow (`linear_5`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

from aviatorc.formats import WeightFormat, dense_format
from aviatorc.ir import Derived, Graph, Node, Value
from aviatorc.partition.tiling import Part, WeightSpec

_LAYER = re.compile(r"(?:^|[._/])(?:layers|layer|h|blocks)[._/](\d+)(?:[._/]|$)")
_ROLES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head",
                    "c_attn", "c_proj", "c_fc", "qkv_proj", "gate_up_proj", "dense", "fc1", "fc2", "query", "key",
                    "value", "query_key_value", "embed_tokens", "wte",
                    # multi-head latent attention (DeepSeek-V3): the latent KV projection and the query's up-projection
                    "kv_a_proj_with_mqa", "q_b_proj"})
_COMPONENT = re.compile(r"[./:]")
# Roles whose weight fuses several projections, and what its parts are called.
_FUSED_PARTS = {3: ("q", "k", "v"), 2: ("gate", "up")}
_TRANSPOSED_NAME = re.compile(r"^(?P<table>.+?)(?:\.T|_T)(?:_\d+)?$")


def layer_of(name: str) -> int | None:
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


def role_of(name: str) -> str:
    """The role named by the last whole component of `name` that is one ("linear" if none):
    `model.layers.0.self_attn.qkv_proj.weight` is `qkv_proj`, never `v_proj`."""
    for component in reversed(_COMPONENT.split(name)):
        if component in _ROLES:
            return component
    return "linear"


@dataclass
class _Found:
    """A weight as the walk finds it; the layer may still be unknown."""

    name: str
    layer: int | None
    role: str
    k: int
    n: int
    format: WeightFormat
    input: str
    first: Node  # the first node reading it (for the structural layer inference)
    nodes: list[str] = field(default_factory=list)
    splits: tuple[Part, ...] = ()
    tied_to: str = ""
    expert: int = -1


@dataclass(frozen=True)
class _Linear:
    """A MatMul's weight operand resolved to what is stored."""

    name: str
    k: int
    n: int
    format: WeightFormat
    table: Value | None = None  # the embedding table it is (transposed), for a tied head


def weights_from_graph(graph: Graph) -> list[WeightSpec]:
    """Every weight of `graph` the partitioner places, in graph order."""
    from aviatorc.ir.experts import expert_nodes

    experts = expert_nodes(graph)
    tables = {node.input(0).name: node.input(0) for node in graph.nodes if _is_lookup(node)}
    found: dict[str, _Found] = {}
    heads: dict[str, str] = {}  # table name -> name of the tied head spec
    for node in graph.nodes:
        if _is_lookup(node):
            table = node.input(0)
            entry = found.get(table.name)
            if entry is None:
                ids = node.inputs[1]
                entry = found[table.name] = _Found(table.name, layer_of(table.name), "embedding",
                                                   int(table.type.shape[0]), int(table.type.shape[1]),  # type: ignore[arg-type]
                                                   dense_format(table.type.dtype),
                                                   ids.name if ids is not None else table.name, node)
            entry.nodes.append(node.name)
        elif node.op == "MatMul" and len(node.inputs) >= 2 and node.inputs[1] is not None:
            weight = _linear_weight(node.input(1), tables)
            if weight is None:
                continue
            entry = found.get(weight.name)
            if entry is None:
                x = node.inputs[0]
                entry = found[weight.name] = _Found(
                    weight.name, layer_of(weight.name), "lm_head" if weight.table is not None else role_of(weight.name),
                    weight.k, weight.n, weight.format, x.name if x is not None else weight.name, node)
                entry.splits = _splits(node, weight.n, entry.role)
                entry.expert = experts[node].expert if node in experts else -1
                if weight.table is not None:
                    entry.tied_to = weight.table.name
                    heads[weight.table.name] = weight.name
            entry.nodes.append(node.name)
    for table_name, head in heads.items():  # the tied pair: the head holds the bytes, the table is an alias
        if table_name in found:
            found[table_name].tied_to = head
            found[head].nodes += [n for n in found[table_name].nodes if n not in found[head].nodes]
    entries = list(found.values())
    if any(e.layer is None for e in entries):
        inferred = _structural_layers(graph, {e.name: e.first for e in entries},
                                      wanted={e.name for e in entries if e.layer is None})
        for e in entries:
            if e.layer is None:
                e.layer = inferred.get(e.name)
    return _with_layers(entries)


def _is_lookup(node: Node) -> bool:
    """A Gather of rows (axis 0) from a rank-2 initializer with static dims: an embedding."""
    if node.op != "Gather" or not node.inputs or node.inputs[0] is None or not node.inputs[0].is_initializer:
        return False
    shape = node.inputs[0].type.shape
    return len(shape) == 2 and all(isinstance(d, int) for d in shape) and int(node.attrs.get("axis", 0)) == 0  # type: ignore[arg-type]


def _splits(matmul: Node, n: int, role: str) -> tuple[Part, ...]:
    """The parts of a fused weight from what reads the MatMul's output (see the module docstring)."""
    out = matmul.outputs[0]
    if len(out.users) == 1 and out.users[0].op == "Add":  # a bias
        add = out.users[0]
        other = add.inputs[1] if add.inputs[0] is out else add.inputs[0]
        if other is not None and other.is_initializer:
            out = add.outputs[0]
    # A view that keeps the columns ([B*S, N] -> [B, S, N], GPT-2's addmm then view).
    while len(out.users) == 1 and out.users[0].op == "Reshape" and out.users[0].outputs[0].type.shape[-1:] == (n,):
        out = out.users[0].outputs[0]
    users = out.users
    if not users:
        return ()
    ranges: list[tuple[int, int]] | None = None
    if len(users) == 1 and users[0].op == "Split" and users[0].inputs[0] is out:
        ranges = _split_ranges(users[0], out, n)
    elif all(u.op == "Slice" and u.inputs[0] is out for u in users):
        ranges = _slice_ranges(users, out, n)
    if not ranges or len(ranges) < 2:
        return ()
    names = _FUSED_PARTS.get(len(ranges)) if role in ("qkv_proj", "c_attn", "query_key_value", "gate_up_proj") else None
    if names is not None and role == "gate_up_proj" and len(ranges) != 2:
        names = None
    if names is not None and role != "gate_up_proj" and len(ranges) != 3:
        names = None
    if names is None:
        names = ("",) * len(ranges)
    return tuple((name, a, b) for name, (a, b) in zip(names, ranges, strict=True))


def _last_axis(axis: int, rank: int) -> bool:
    return axis in (-1, rank - 1)


def _split_ranges(split: Node, out: Value, n: int) -> list[tuple[int, int]] | None:
    if not _last_axis(int(split.attrs.get("axis", 0)), out.type.rank):  # type: ignore[arg-type]
        return None
    sizes_value = split.inputs[1] if len(split.inputs) > 1 else None
    if sizes_value is not None:
        array = sizes_value.const_value()
        if array is None:
            return None
        sizes = [int(s) for s in array.reshape(-1)]
    else:
        parts = int(split.attrs.get("num_outputs", 0)) or len(split.outputs)  # type: ignore[arg-type]
        chunk = -(-n // parts)
        sizes = [min(chunk, n - i * chunk) for i in range(parts)]
    if sum(sizes) != n:
        return None
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(a, a + s) for a, s in zip(starts, sizes, strict=True)]


def _slice_ranges(slices: list[Node], out: Value, n: int) -> list[tuple[int, int]] | None:
    """Column ranges of Slices of the last axis (step 1) that cover [0, n) without overlap."""
    ranges = set()
    for node in slices:
        consts = [v.const_value() if v is not None else None for v in node.inputs[1:]]
        if len(consts) < 2 or consts[0] is None or consts[1] is None:
            return None
        starts, ends = consts[0].reshape(-1), consts[1].reshape(-1)
        axes = consts[2].reshape(-1) if len(consts) > 2 and consts[2] is not None else range(len(starts))
        steps = consts[3].reshape(-1) if len(consts) > 3 and consts[3] is not None else [1] * len(starts)
        if len(starts) != 1 or not _last_axis(int(list(axes)[0]), out.type.rank) or int(steps[0]) != 1:
            return None
        ranges.add(slice(int(starts[0]), int(ends[0])).indices(n)[:2])
    ordered = sorted(ranges)
    if ordered[0][0] != 0 or ordered[-1][1] != n or any(a[1] != b[0] for a, b in zip(ordered, ordered[1:])):
        return None
    return ordered


_ATTENTION = ("Softmax", "Attention")  # one per attention block, in topological order
# Data flow that is not a layer's: shapes read off a tensor (a causal mask built from the hidden
# states' shape must not tie the embedding to the first block's softmax).
_SHAPE_ONLY = ("Shape", "Size", "ConstantOfShape")


def _structural_layers(graph: Graph, consumers: dict[str, Node], wanted: set[str] | None = None) -> dict[str, int]:
    """Layer indices from the attention blocks, of the weights in `wanted` (default all); {} when
    the graph has none. Every weight in `consumers` still ends the cones of the others (the
    embedding and head of a model whose other weights are named: a cone each, not one per weight).

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
        if wanted is not None and name not in wanted:
            continue
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


def _cone(start: Node, base: int, index: dict[int, int], weight_nodes: set[int], after: dict[int, int],
          outputs: set[int]) -> tuple[bool, bool, bool]:
    """Walk forward from `start`'s outputs up to the next weight: (reaches block base + 1 as q, k
    or v, reaches a graph output, reaches another weight)."""
    stack = list(start.outputs)
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


def _linear_weight(value: Value, tables: dict[str, Value]) -> _Linear | None:
    """What a MatMul's weight operand stores, or None when it is not a placeable weight."""
    shape = value.type.shape
    if value.is_initializer:
        if len(shape) != 2 or not all(isinstance(d, int) for d in shape):
            return None
        k, n = int(shape[0]), int(shape[1])  # type: ignore[arg-type]
        return _Linear(value.name, k, n, dense_format(value.type.dtype), _tied_table(value, tables))
    producer = value.producer
    if producer is not None and producer.op == "Cast" and producer.inputs[0] is not None:
        producer = producer.inputs[0].producer  # a float16 model casts the dequantized weight
    if producer is None:
        return None
    if producer.op == "DequantizeWeight":
        fmt = WeightFormat.from_attrs(producer.attrs)
        k, n = (int(d) for d in value.type.shape[-2:])  # type: ignore[arg-type]
        stored = producer.inputs[0]
        return _Linear(stored.name if stored is not None else value.name, k, n, fmt)
    if producer.op == "Transpose" and producer.inputs[0] is not None and producer.inputs[0].is_initializer:
        source = producer.inputs[0]
        if len(source.type.shape) == 2 and all(isinstance(d, int) for d in shape) and len(shape) == 2:
            k, n = int(shape[0]), int(shape[1])  # type: ignore[arg-type]
            if source.name in tables:  # the embedding table read transposed: a tied head
                return _Linear(value.name, k, n, dense_format(source.type.dtype), source)
            return _Linear(source.name, k, n, dense_format(source.type.dtype))
    return None


def _tied_table(value: Value, tables: dict[str, Value]) -> Value | None:
    """The embedding table `value` is a transposed copy of (the frontends' lazy transpose), or None."""
    table = None
    if isinstance(value.data, Derived):
        table = next((t for t in tables.values() if t.data is value.data.source), None)
    if table is None:
        match = _TRANSPOSED_NAME.match(value.name)
        table = tables.get(match.group("table")) if match else None
    if table is None or table is value:
        return None
    if tuple(table.type.shape[::-1]) != tuple(value.type.shape) or table.type.dtype != value.type.dtype:
        return None
    return table


def _with_layers(found: list[_Found]) -> list[WeightSpec]:
    """Fill in missing layer indices (-1 before the first numbered weight, last + 1 after it)
    and make the specs."""
    numbered = [f.layer for f in found if f.layer is not None]
    last = max(numbered) if numbered else -1
    specs: list[WeightSpec] = []
    seen_numbered = False
    for f in found:
        layer = f.layer
        if layer is not None:
            seen_numbered = True
        else:
            layer = last + 1 if seen_numbered or f.role == "lm_head" else -1
        specs.append(WeightSpec(f.name, layer, f.role, f.k, f.n, f.format, f.input, tuple(f.nodes), f.splits,
                                f.tied_to, f.expert))
    return specs


def weights_from_config(config: dict[str, Any], linear_format: WeightFormat, *,
                        embedding_format: WeightFormat | None = None) -> list[WeightSpec]:
    """The weights of a Llama-architecture `config.json` dict, shape-only, without building a graph.

    Linear weights get `linear_format`; the embedding stays `embedding_format` (FP16 by default,
    as the quantize pass keeps it). Norm weights are vectors and are not placed. With
    `tie_word_embeddings` the head is the embedding table read transposed: one tensor, in the
    embedding's format (the quantize pass leaves a tied head float), held by the head's spec.
    Node names are the module paths (see the module docstring).
    """
    embedding_format = embedding_format or WeightFormat("fp16")
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads", heads) * head_dim
    inter = config["intermediate_size"]
    layers = config["num_hidden_layers"]
    tied = bool(config.get("tie_word_embeddings"))
    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    specs = [WeightSpec(embed, -1, "embedding", config["vocab_size"], hidden, embedding_format, "input_ids",
                        ("model.embed_tokens",), tied_to=head if tied else "")]

    def linear(module: str, layer: int, k: int, n: int, x: str) -> WeightSpec:
        return WeightSpec(module + ".weight", layer, role_of(module), k, n, linear_format, x, (module,))

    for i in range(layers):
        p = f"model.layers.{i}."
        specs += [
            linear(p + "self_attn.q_proj", i, hidden, heads * head_dim, p + "attn_in"),
            linear(p + "self_attn.k_proj", i, hidden, kv, p + "attn_in"),
            linear(p + "self_attn.v_proj", i, hidden, kv, p + "attn_in"),
            linear(p + "self_attn.o_proj", i, heads * head_dim, hidden, p + "attn_out"),
            linear(p + "mlp.gate_proj", i, hidden, inter, p + "mlp_in"),
            linear(p + "mlp.up_proj", i, hidden, inter, p + "mlp_in"),
            linear(p + "mlp.down_proj", i, inter, hidden, p + "mlp_act"),
        ]
    if tied:
        specs.append(WeightSpec(head, layers, "lm_head", hidden, config["vocab_size"], embedding_format, "final_norm",
                                ("lm_head", "model.embed_tokens"), tied_to=embed))
    else:
        specs.append(linear("lm_head", layers, hidden, config["vocab_size"], "final_norm"))
    return specs


def with_formats(specs: list[WeightSpec], linear_format: WeightFormat,
                 embedding_format: WeightFormat | None = None) -> list[WeightSpec]:
    """The same weights stored in other formats (what the quantize pass does to a graph); a tied
    pair keeps the embedding's format, as the quantize pass leaves a tied head float."""
    embedding_format = embedding_format or WeightFormat("fp16")
    return [replace(s, format=embedding_format if s.is_embedding or s.tied_to else linear_format) for s in specs]
