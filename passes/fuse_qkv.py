"""fuse-qkv: one MatMul for the q, k and v projections of an attention block.

Before (weights [K, N], biases optional but all-or-none):

    %q = MatMul(%h, %wq)   %q_b = Add(%q, %bq)
    %k = MatMul(%h, %wk)   %k_b = Add(%k, %bk)
    %v = MatMul(%h, %wv)   %v_b = Add(%v, %bv)

After:

    %qkv = MatMul(%h, %wqkv)          # wqkv = concat([wq, wk, wv], axis=1), named *.qkv_proj.weight
    %qkv_b = Add(%qkv, %bqkv)
    %q_b, %k_b, %v_b = Split(%qkv_b, [Nq, Nk, Nv]) {axis = -1}

The Split's outputs are the old output values themselves, so everything downstream (and
any graph output) keeps its name. Widths may differ: grouped-query attention makes k and v
narrower than q (SmolLM2: 576 + 192 + 192).

Structure: `find` returns groups of projections reading one hidden state, `check` returns
a reason tied to a node when a group cannot fuse, `rewrite` fuses one group. Projections
are identified by parameter names when the exporter kept them (`q_proj`, `query`,
`q_lin`, ...), else by structure: projections of one value that reach the q, k and v
operands of attention (the two sides of the score MatMul before a Softmax and the value
side of the MatMul after it, or an `Attention` node's inputs).

Where it goes: after cleanup and before sparsify-2to4 and quantize, while weights are
still plain initializers; one fused matrix then gets one set of masks and scales.
Does not handle: weights that come through `DequantizeWeight` (quantization ran first),
computed weights, and projections already fused by the exporter (GPT-2's `c_attn` with a
Split, Phi-3's `qkv_proj` with Slices): those have nothing to fuse and are left alone.
With a target, a fused weight larger than the largest chiplet's SRAM (in the format the
pipeline will store it in) is refused, so fusion never creates a weight no chiplet holds.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from aviatorc.passes.manager import Note, Pass, PassContext, PassResult, register_pass
from aviatorc.passes.quantize import weight_format

from aviatorc.formats import WeightFormat, dense_format
from aviatorc.ir import ArrayData, Graph, Node, ShapeOnly, TensorData, TensorType, Value, add_op, add_value
from aviatorc.options import CompileOptions

ROLES = ("q", "k", "v")

# Parameter-name tokens of q/k/v projections -> (role, the token naming the fused one).
ROLE_TOKENS: dict[str, tuple[str, str]] = {}
for _q, _k, _v, _fused in (
    ("q_proj", "k_proj", "v_proj", "qkv_proj"),  # Llama, Mistral, Qwen2, OPT, Phi
    ("query", "key", "value", "query_key_value"),  # BERT
    ("q_lin", "k_lin", "v_lin", "qkv_lin"),  # DistilBERT
    ("wq", "wk", "wv", "wqkv"),  # Meta's reference Llama
    ("to_q", "to_k", "to_v", "to_qkv"),  # diffusion transformers
    ("q", "k", "v", "qkv"),  # T5
):
    ROLE_TOKENS.update({_q: ("q", _fused), _k: ("k", _fused), _v: ("v", _fused)})

# A token counts only between separators: torch.export names params `p_layers_0_attn_q_proj_weight`,
# ONNX keeps `layers.0.attn.q_proj.weight`. Longest tokens first so `q_proj` wins over `q`.
_ROLE_RE = re.compile(
    r"(?<![A-Za-z0-9])(" + "|".join(sorted(map(re.escape, ROLE_TOKENS), key=len, reverse=True)) + r")(?![A-Za-z0-9])"
)

# How far to follow a projection's output (reshapes, transposes, rotary embedding, the
# repeat of GQA's k/v heads, scaling) before it must reach an attention operand.
ATTENTION_SEARCH_NODES = 64
SOFTMAX_SEARCH_DEPTH = 6  # score MatMul -> (scale, mask, cast) -> Softmax -> (cast) -> context MatMul

# Ops that read weights but not activations when producing a weight operand, by name,
# so a note can say why such a weight is not fused.
DEQUANTIZE_OPS = ("DequantizeWeight",)


@dataclass
class Projection:
    """One linear projection: MatMul(x, W) and an optional Add of a bias initializer."""

    matmul: Node
    bias_add: Node | None = None
    bias: Value | None = None
    role: str = ""

    @property
    def x(self) -> Value:
        return self.matmul.input(0)

    @property
    def weight(self) -> Value:
        return self.matmul.input(1)

    @property
    def out(self) -> Value:
        """The value downstream reads: the bias Add's output, or the MatMul's."""
        return (self.bias_add or self.matmul).outputs[0]


@dataclass
class Group:
    """A q, k and v projection found together (by names, or by the attention structure)."""

    q: Projection
    k: Projection
    v: Projection
    found_by: str  # "names" or "structure"
    index: int = 0  # position among the graph's groups, in graph order: names anonymous groups

    @property
    def projections(self) -> tuple[Projection, Projection, Projection]:
        return (self.q, self.k, self.v)


# -- find -------------------------------------------------------------------------------------


def find(graph: Graph) -> tuple[list[Group], list[Note]]:
    """Groups of q/k/v projections, in graph order; notes for near-misses (incomplete groups)."""
    activations = _activation_ids(graph)
    projections = [p for node in graph.nodes if (p := _projection(graph, node, activations)) is not None]
    groups, claimed = _groups_by_name(projections)
    rest = [p for p in projections if id(p.matmul) not in claimed]
    structural, notes = _groups_by_structure(graph, rest, activations)
    groups += structural
    order = {id(node): i for i, node in enumerate(graph.nodes)}
    groups.sort(key=lambda g: min(order[id(p.matmul)] for p in g.projections))
    for index, group in enumerate(groups):
        group.index = index
    return groups, notes


def _activation_ids(graph: Graph) -> set[int]:
    """Values that depend on a graph input (the rest are weights or computed from weights)."""
    ids = {id(v) for v in graph.inputs}
    for node in graph.nodes:
        if any(v is not None and id(v) in ids for v in node.inputs):
            ids.update(id(v) for v in node.outputs)
    return ids


def _projection(graph: Graph, node: Node, activations: set[int]) -> Projection | None:
    """`node` as a linear projection MatMul(activation, [K, N] weight), with its bias if any."""
    if node.op != "MatMul" or len(node.inputs) != 2 or None in node.inputs:
        return None
    x, w = node.input(0), node.input(1)
    if id(x) not in activations or id(w) in activations or w.type.rank != 2:
        return None
    projection = Projection(node)
    out = node.outputs[0]
    if len(out.users) == 1 and out not in graph.outputs and out.users[0].op == "Add":
        add = out.users[0]
        a, b = add.inputs
        other = b if a is out else a
        if other is not None and other is not out and other.is_initializer and _is_bias_shape(other, w, out):
            projection.bias_add, projection.bias = add, other
    return projection


def _is_bias_shape(bias: Value, weight: Value, out: Value) -> bool:
    """A bias broadcasts along the output channels only: [N] or [1, ..., 1, N]."""
    shape = bias.type.shape
    return 0 < len(shape) <= out.type.rank and shape[-1] == weight.type.shape[1] and all(d == 1 for d in shape[:-1])


def _names(projection: Projection) -> Iterator[str]:
    """Names that may carry a parameter name, most telling first."""
    yield _weight_root(projection.weight).name
    yield projection.matmul.name
    if projection.bias is not None:
        yield projection.bias.name


def _weight_root(value: Value) -> Value:
    """The initializer a weight operand comes from (through a dequantize, cast or transpose)."""
    while value.producer is not None and value.producer.inputs and value.producer.inputs[0] is not None:
        value = value.producer.inputs[0]
    return value


def _role_in_name(name: str) -> tuple[str, str, str] | None:
    """(role, group key, fused name) from a parameter name, using its last role token."""
    matches = list(_ROLE_RE.finditer(name))
    if not matches:
        return None
    match = matches[-1]
    role, fused_token = ROLE_TOKENS[match.group(1)]
    key = name[: match.start()] + "{}" + name[match.end() :]
    return role, key, name[: match.start()] + fused_token + name[match.end() :]


def _groups_by_name(projections: list[Projection]) -> tuple[list[Group], set[int]]:
    by_key: dict[str, dict[str, list[Projection]]] = {}
    for projection in projections:
        for name in _names(projection):
            found = _role_in_name(name)
            if found is not None:
                role, key, _ = found
                by_key.setdefault(key, {}).setdefault(role, []).append(projection)
                break
    groups, claimed = [], set()
    for roles in by_key.values():
        if all(len(roles.get(role, [])) == 1 for role in ROLES):
            q, k, v = (roles[role][0] for role in ROLES)
            for projection, role in ((q, "q"), (k, "k"), (v, "v")):
                projection.role = role
                claimed.add(id(projection.matmul))
            groups.append(Group(q, k, v, "names"))
    return groups, claimed


def _groups_by_structure(
    graph: Graph, projections: list[Projection], activations: set[int]
) -> tuple[list[Group], list[Note]]:
    sinks = _attention_operands(graph, activations)
    by_input: dict[int, list[Projection]] = {}
    for projection in projections:
        role = _reached_role(projection.out, sinks)
        if role is not None:
            projection.role = role
            by_input.setdefault(id(projection.x), []).append(projection)
    groups, notes = [], []
    for members in by_input.values():
        roles = {role: [p for p in members if p.role == role] for role in ROLES}
        if all(len(found) == 1 for found in roles.values()):
            groups.append(Group(roles["q"][0], roles["k"][0], roles["v"][0], "structure"))
            continue
        if len(members) < 2:  # a lone projection into attention (cross-attention's q) is no near-miss
            continue
        counts = ", ".join(f"{len(found)} {role}" for role, found in roles.items())
        notes.append(
            Note(
                members[0].matmul.name,
                f"projections of '{members[0].x.name}' reach attention as {counts}: "
                "need exactly one each of q, k and v",
            )
        )
    return groups, notes


def _attention_operands(graph: Graph, activations: set[int]) -> dict[tuple[int, int], str]:
    """(node id, input index) -> role, for the q, k and v operands of every attention."""
    sinks: dict[tuple[int, int], str] = {}
    for node in graph.nodes:
        if node.op == "Attention":
            sinks.update({(id(node), 0): "q", (id(node), 1): "k", (id(node), 2): "v"})
        elif node.op == "Softmax":
            for score in _search(node, forward=False):
                if all(v is not None and id(v) in activations for v in score.inputs):
                    sinks.update({(id(score), 0): "q", (id(score), 1): "k"})
            for context in _search(node, forward=True):
                if _feeds(node, context.inputs[0]):
                    sinks[(id(context), 1)] = "v"
    return sinks


def _search(start: Node, *, forward: bool) -> list[Node]:
    """MatMuls within SOFTMAX_SEARCH_DEPTH nodes of `start`, downstream or upstream."""
    found, frontier, seen = [], [start], {id(start)}
    for _ in range(SOFTMAX_SEARCH_DEPTH):
        step = []
        for node in frontier:
            if forward:
                neighbours = [user for out in node.outputs for user in out.users]
            else:
                neighbours = [v.producer for v in node.inputs if v is not None and v.producer is not None]
            for neighbour in neighbours:
                if id(neighbour) in seen:
                    continue
                seen.add(id(neighbour))
                if neighbour.op == "MatMul":
                    found.append(neighbour)
                elif neighbour.op != "Softmax":
                    step.append(neighbour)
        frontier = step
    return found


def _feeds(node: Node, value: Value | None) -> bool:
    """Whether `value` is computed from `node`'s outputs within SOFTMAX_SEARCH_DEPTH steps."""
    frontier: list[Value | None] = [value]
    for _ in range(SOFTMAX_SEARCH_DEPTH):
        step: list[Value | None] = []
        for v in frontier:
            if v is None or v.producer is None:
                continue
            if v.producer is node:
                return True
            step.extend(v.producer.inputs)
        frontier = step
    return False


def _reached_role(value: Value, sinks: dict[tuple[int, int], str]) -> str | None:
    """The one attention role `value` flows into (None if none or several)."""
    roles: set[str] = set()
    frontier, seen = [value], {id(value)}
    while frontier and len(seen) < ATTENTION_SEARCH_NODES:
        current = frontier.pop()
        for user in current.users:
            if user.op in ("Shape", "Size"):  # metadata, not data: a reshape elsewhere may read it
                continue
            if user.op in ("MatMul", "Attention", "Softmax"):
                roles.update(
                    sinks[(id(user), i)] for i, v in enumerate(user.inputs) if v is current and (id(user), i) in sinks
                )
                continue
            for out in user.outputs:
                if id(out) not in seen:
                    seen.add(id(out))
                    frontier.append(out)
    return roles.pop() if len(roles) == 1 else None


# -- check ------------------------------------------------------------------------------------


def check(graph: Graph, group: Group, ctx: PassContext) -> Note | None:
    """None when `group` can fuse, else a Note saying why not, tied to the offending node."""
    q = group.q
    for p in group.projections:
        if p.x is not q.x:
            return Note(p.matmul.name, f"inputs differ: {p.role} reads '{p.x.name}' but q reads '{q.x.name}'")
    for p in group.projections:
        w = p.weight
        if w.producer is not None and w.producer.op in DEQUANTIZE_OPS:
            return Note(
                p.matmul.name,
                f"{p.role} weight comes from {w.producer.op} '{w.producer.name}': "
                "quantization ran before fusion; run fuse-qkv before quantize",
            )
        if not w.is_initializer:
            made_by = f" (computed by {w.producer.op} '{w.producer.name}')" if w.producer else ""
            return Note(p.matmul.name, f"{p.role} weight '{w.name}' is not an initializer{made_by}")
    # Unreachable for a verified graph (MatMul needs equal operand dtypes and the input is
    # shared), but check stays total: it may be called on a graph mid-rewrite.
    dtypes = {p.weight.type.dtype for p in group.projections}
    if len(dtypes) > 1:
        listing = ", ".join(f"{p.role} {p.weight.type.dtype}" for p in group.projections)
        odd = next(p for p in group.projections if p.weight.type.dtype != q.weight.type.dtype)
        return Note(odd.matmul.name, f"weights have different dtypes ({listing})")
    with_bias = [p for p in group.projections if p.bias is not None]
    without = [p for p in group.projections if p.bias is None]
    if with_bias and without:
        return Note(
            with_bias[0].matmul.name, f"{with_bias[0].role} projection has a bias but {without[0].role} does not"
        )
    if with_bias and len({(b.bias.type.dtype, b.bias.type.rank) for b in with_bias if b.bias}) > 1:
        return Note(group.k.matmul.name, "biases have different dtypes or ranks")
    return _check_fits(group, ctx)


def _check_fits(group: Group, ctx: PassContext) -> Note | None:
    """With a target, refuse a fused weight that no chiplet's SRAM can hold."""
    capacity = largest_chiplet_sram_bytes(ctx.target)
    if capacity is None:
        return None
    k = weight_kn(group.q.weight)[0]
    n = sum(weight_kn(p.weight)[1] for p in group.projections)
    fmt = storage_format(group.q.weight.type.dtype, ctx.options)
    fused_bytes = fmt.storage_bytes(k, n)
    if fused_bytes <= capacity:
        return None
    target = getattr(ctx.target, "name", "the target")
    return Note(
        group.q.matmul.name,
        f"fused weight of {fused_bytes} bytes ({fmt.name}, [{k}, {n}]) exceeds the largest chiplet "
        f"SRAM of {capacity} bytes on target {target}",
    )


def weight_kn(weight: Value) -> tuple[int, int]:
    """[K, N] of a projection weight (initializers have static shapes)."""
    k, n = weight.type.shape
    if not isinstance(k, int) or not isinstance(n, int):
        raise ValueError(f"weight '{weight.name}' has a symbolic shape {weight.type}")
    return k, n


def largest_chiplet_sram_bytes(target: Any) -> int | None:
    """SRAM bytes the target's largest chiplet can give to weights; None without a target.

    An `aviatorc.target.Target` has identical chiplets, and part of each chiplet's SRAM is
    reserved for activations and the KV cache, so only the usable part counts.
    """
    if target is None:
        return None
    return int(target.usable_sram_bytes_per_chiplet)


def storage_format(dtype: str, options: CompileOptions) -> WeightFormat:
    """The format the pipeline will store a weight in: fusion runs before quantize and sparsify."""
    sparsity = options.sparsity or ""
    if options.quant is None:
        return WeightFormat(dense_format(dtype).kind, sparsity=sparsity)
    return weight_format(options, sparsity)  # quantize's own choice of format


# -- rewrite ----------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class ConcatData:
    """Bytes of several sources concatenated along `axis`, read on load (lazy weights stay lazy)."""

    sources: tuple[TensorData, ...]
    axis: int

    @property
    def available(self) -> bool:
        return all(s.available for s in self.sources)

    def load(self) -> np.ndarray:
        return np.concatenate([s.load() for s in self.sources], axis=self.axis)


def concat_data(values: list[Value], axis: int) -> TensorData:
    """The data of concat(values): in memory if they are, lazy if any is, shape-only if any is."""
    sources: list[TensorData] = []
    for value in values:
        if value.data is None:
            raise ValueError(f"'{value.name}' is not an initializer")
        sources.append(value.data)
    if not all(s.available for s in sources):
        return ShapeOnly("concatenation of shape-only weights " + ", ".join(v.name for v in values))
    arrays = [s.array for s in sources if isinstance(s, ArrayData)]
    if len(arrays) == len(sources):
        return ArrayData(np.concatenate(arrays, axis=axis))
    return ConcatData(tuple(sources), axis)


def fused_base_name(group: Group) -> str:
    """What the fused projection is called: `layers.0.attn.q_proj.weight` -> `layers.0.attn.qkv_proj`,
    or `attn.3.qkv_proj` for the fourth group when no name says q.

    The fused weight and bias are this name plus `.weight` and `.bias`.
    """
    for name in _names(group.q):
        found = _role_in_name(name)
        if found is not None and found[0] == "q":
            return re.sub(r"[._](weight|bias)$", "", found[2])
    # No parameter names (the ONNX exporter drops them for transposed weights): say which
    # attention block it is, counted in graph order.
    return f"attn.{group.index}.qkv_proj"


def rewrite(graph: Graph, group: Group) -> Node:
    """Replace the group's three projections by one MatMul (+ Add) and a Split; return the MatMul."""
    projections = group.projections
    weights = [p.weight for p in projections]
    widths = [weight_kn(w)[1] for w in weights]
    k = weight_kn(weights[0])[0]
    order = {id(node): i for i, node in enumerate(graph.nodes)}
    first = min((p.matmul for p in projections), key=lambda n: order[id(n)])
    base = fused_base_name(group)

    w_fused = graph.add_initializer(
        graph.unique_name(f"{base}.weight"),
        TensorType(weights[0].type.dtype, (k, sum(widths))),
        concat_data(weights, axis=1),
    )
    matmul = add_op(graph, "MatMul", [group.q.x, w_fused], name=graph.unique_node_name(base), before=first)
    fused = matmul.outputs[0]
    biases = [p.bias for p in projections if p.bias is not None]
    if biases:
        rank = biases[0].type.rank
        b_fused = graph.add_initializer(
            graph.unique_name(f"{base}.bias"),
            TensorType(biases[0].type.dtype, (1,) * (rank - 1) + (sum(widths),)),
            concat_data(biases, axis=-1),
        )
        fused = add_value(graph, "Add", [fused, b_fused], name=graph.unique_node_name(f"{base}.add"), before=first)
    sizes = graph.add_constant(np.array(widths, dtype=np.int64), name=f"{base}.split_sizes")

    # Drop the old nodes but keep their final outputs: the Split produces those very values,
    # so downstream nodes and graph outputs keep their names and nothing else is touched.
    finals = [p.out for p in projections]
    for p in projections:
        if p.bias_add is not None:
            _unlink(graph, p.bias_add)
            graph.remove_node(p.matmul)
        else:
            _unlink(graph, p.matmul)
    split = Node("Split", [fused, sizes], finals, {"axis": -1}, name=graph.unique_node_name(f"{base}.split"))
    graph.nodes.insert(graph.nodes.index(_producer(fused)) + 1, split)

    for value in weights + biases:
        if not value.users and value not in graph.outputs and value.name in graph.initializers:
            graph.remove_initializer(value)
    return matmul


def _producer(value: Value) -> Node:
    if value.producer is None:
        raise ValueError(f"'{value.name}' has no producer")
    return value.producer


def _unlink(graph: Graph, node: Node) -> None:
    """Remove `node` from the graph but leave its output values alive for a new producer."""
    node.detach()
    graph.nodes.remove(node)


# -- the pass ---------------------------------------------------------------------------------


@register_pass
class FuseQKV(Pass):
    name = "fuse-qkv"
    summary = "fuse the q, k and v projections of each attention into one MatMul and a Split"

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        groups, notes = find(graph)
        fused = 0
        for group in groups:
            reason = check(graph, group, ctx)
            if reason is not None:
                notes.append(reason)
                continue
            rewrite(graph, group)
            fused += 1
        if not groups and not notes:
            notes.append(
                Note(
                    graph.name,
                    "no separate q, k and v projections found (no attention, or already fused by the exporter)",
                )
            )
        stats = {
            "groups_found": len(groups),
            "groups_fused": fused,
            "by_names": sum(g.found_by == "names" for g in groups),
            "by_structure": sum(g.found_by == "structure" for g in groups),
        }
        return PassResult(changed=fused > 0, stats=stats, notes=notes)
