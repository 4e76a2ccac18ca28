"""Mixture-of-experts blocks in an exported `transformers` program -> the IR's MoE ops.

`transformers` writes a MoE block as a router module and an experts module, and what its
experts module emits under `torch.export` is recognized here (not traced around):

- the *grouped* dispatch (`transformers.integrations.moe.grouped_mm_experts_forward`, the
  default experts implementation of Mixtral, Qwen3-MoE, DeepSeek-V3 and gpt-oss): the
  (token, slot) pairs sorted by expert (`sort`), counted per expert (`histc`, `cumsum`: the
  offsets), the tokens gathered in that order (`index` by perm // k), each projection one
  `transformers.grouped_mm_fallback` (or `aten._grouped_mm`) over a 3-D weight [E, ...] (bias
  rows gathered by the sorted ids), the gate between them, the outputs scaled by the routing
  weights, put back in token order (`index_put_` of the inverse permutation, `index`) and
  summed over the k slots;
- Llama 4's *dense* experts: every token repeated for every expert (`repeat`), scaled by its
  score (0 where unrouted), `bmm` over the stacked 3-D weights, summed over the experts.

The router is whatever lies between the router's logits (a linear's output) and the top-k
indices and weights (or dense scores) the experts read: its op sequence, casts and views left
out, must be one of the routings `ROUTINGS` names, else the model is refused with the sequence
it uses. Each recognized block is lowered to `MoERouter`, then per expert `MoEDispatch`, its own
2-D weights (`<experts>.<e>.gate_up_proj`, sliced from the 3-D parameter lazily: a shape-only
weight stays shape-only), its gate re-emitted from the program's own nodes, and `MoECombine`
(see `aviatorc.ir.ops.moe`, which says what runs densely).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aviatorc.errors import UnsupportedModelError
from aviatorc.frontends.torch.importer import Lowering, dtype_of, op_key
from aviatorc.ir import ArrayData, Derived, ShapeOnly, TensorType, Value, add_value

GROUPED_MM = frozenset({"transformers.grouped_mm_fallback", "aten._grouped_mm", "aten.grouped_mm"})
# Ops that keep a value's meaning (casts, views, asserts): left out of a router's op sequence.
NOISE = frozenset({"aten.to", "aten._to_copy", "aten._assert_tensor_metadata", "aten.view", "aten.reshape",
                   "aten._unsafe_view", "aten.unsqueeze", "aten.expand", "aten.clone", "aten.contiguous",
                   "operator.getitem", "aten.type_as", "aten.alias", "aten.detach", "aten.lift_fresh_copy"})
# Ops an expert's gate may use between its projections: each works on a token's row alone.
ROW_WISE = frozenset({
    "aten.add", "aten.add_", "aten.sub", "aten.sub_", "aten.mul", "aten.mul_", "aten.div", "aten.div_",
    "aten.neg", "aten.silu", "aten.gelu", "aten.sigmoid", "aten.tanh", "aten.relu", "aten.exp", "aten.pow",
    "aten.clamp", "aten.clamp_min", "aten.clamp_max", "aten.clip", "aten.minimum", "aten.maximum",
    "aten.to", "aten._to_copy", "aten.type_as", "aten.clone", "aten.contiguous", "aten.alias",
    "aten._assert_tensor_metadata", "operator.getitem", "aten.chunk", "aten.split", "aten.split_with_sizes",
    "aten.slice", "aten.rms_norm", "aten.layer_norm", "aten.rsqrt", "aten.mean", "aten.square",
})
_LAST_AXIS_OPS = ("aten.chunk", "aten.split", "aten.split_with_sizes", "aten.slice", "aten.mean")


# -- routings ----------------------------------------------------------------------------------

_GROUP = "topk sum topk zeros_like scatter bitwise_not masked_fill "
ROUTINGS: dict[str, re.Pattern[str]] = {
    # softmax or sigmoid scores, an optional selection bias and group limit, top-k, the chosen
    # scores (re)gathered, optional renormalization and scaling: Mixtral, Qwen3-MoE, DeepSeek-V3
    "scores": re.compile(rf"^(?P<score>softmax|sigmoid) (?P<bias>add )?(?P<group>{_GROUP})?topk "
                         r"(?P<gather>gather )?(?P<norm>sum (?P<eps>add )?div )?(?P<scale>mul )?$"),
    # top-k of the logits, then softmax over the k (gpt-oss)
    "logits": re.compile(r"^topk (?P<score>softmax) $"),
    # top-k of the logits written into a -inf row, then sigmoid: dense scores (Llama 4)
    "logits-dense": re.compile(r"^topk full_like scatter (?P<score>sigmoid) $"),
}
SUPPORTED_ROUTINGS = ("softmax or sigmoid scores then top-k, with optional renormalization and scaling "
                      "(Mixtral, Qwen3-MoE); sigmoid with a selection bias and group-limited top-k "
                      "(DeepSeek-V3); top-k of the logits then softmax over the k (gpt-oss) or sigmoid "
                      "of each (Llama 4)")


@dataclass(frozen=True)
class Router:
    """The routing of one block: MoERouter's input, bias and attributes."""

    logits: Any  # fx.Node: the router's linear, converted as usual (its casts are the router's)
    dtype: str  # the element type the routing computes in
    bias: Any  # fx.Node | None: a parameter or buffer added to the scores for selection
    attrs: dict[str, Any]
    nodes: frozenset[Any]


@dataclass(frozen=True)
class Role:
    """What a node of an experts region becomes for one expert.

    dispatch: the expert's tokens (MoEDispatch); project: a MatMul with the expert's slice of
    `param` ([E, K, N], or [E, N, K] when `transposed`); expert_param: the expert's slice of a
    [E, N] parameter (a bias); scale: the routing-weight multiply (the combine applies it);
    pass: the first argument's value; stack / unstack: it with a leading axis of 1 added /
    removed (dense experts); combine: the sum the MoECombine chain replaces."""

    kind: str
    param: Any = None
    transposed: bool = False
    scale: int = 0


@dataclass
class Block:
    """A recognized MoE block."""

    name: str  # the experts' module path (from its weights' names)
    router: Router
    hidden: Any  # fx.Node: the tokens [T, H]
    num_experts: int
    roles: dict[Any, Role]
    order: list[Any]  # the experts region, in program order
    output: Any  # fx.Node whose value the block computes
    scale_output: int  # 1: the combine weighs each output by its routing weight; 0: the dispatch did
    nodes: frozenset[Any] = field(default_factory=frozenset)

    @property
    def op_keys(self) -> set[str]:
        return {op_key(n.target) for n in self.nodes if n.op == "call_function"}


# -- graph helpers ------------------------------------------------------------------------------


def _key(node: Any) -> str:
    return op_key(node.target) if getattr(node, "op", None) == "call_function" else ""


def _short(node: Any) -> str:
    """The op name without namespace or in-place underscore: `aten.div_` -> `div`."""
    return _key(node).split(".")[-1].rstrip("_")


def _strip(node: Any) -> Any:
    """Back through casts and views to the node that computed the value."""
    while _key(node) in NOISE and _key(node) != "operator.getitem" and node.args and _is_node(node.args[0]):
        node = node.args[0]
    return node


def _is_node(value: Any) -> bool:
    import torch.fx

    return isinstance(value, torch.fx.Node)


def _descendants(seeds: Iterable[Any]) -> set[Any]:
    seen: set[Any] = set()
    stack = list(seeds)
    while stack:
        node = stack.pop()
        for user in node.users:
            if user not in seen:
                seen.add(user)
                stack.append(user)
    return seen


def _ancestors(seeds: Iterable[Any]) -> set[Any]:
    seen: set[Any] = set()
    stack = list(seeds)
    while stack:
        node = stack.pop()
        for arg in node.all_input_nodes:
            if arg not in seen:
                seen.add(arg)
                stack.append(arg)
    return seen


def _users(node: Any, key: str) -> list[Any]:
    return [u for u in node.users if _key(u) == key]


def _getitem(node: Any, index: int) -> Any:
    found = [u for u in node.users if _key(u) == "operator.getitem" and u.args[1] == index]
    return found[0] if found else None


def _shape(node: Any) -> tuple[int, ...]:
    val = node.meta.get("val")
    return tuple(val.shape) if val is not None else ()


def _refuse(block: str, message: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"MoE block '{block}': {message}")


# -- finding blocks ----------------------------------------------------------------------------


def find_blocks(ep: Any) -> list[Block]:
    """Every MoE block of the program (grouped and dense forms), in program order."""
    params = {spec.arg.name: spec.target for spec in ep.graph_signature.input_specs
              if spec.target is not None and hasattr(spec.arg, "name")}
    nodes = list(ep.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    blocks = _grouped_blocks(nodes, params, position) + _dense_blocks(nodes, params, position)
    for block in blocks:
        _check_closed(block)
    return sorted(blocks, key=lambda b: position[b.output])


_WEIGHT_CHAIN = ("aten.transpose", "aten.to", "aten._to_copy", "aten._assert_tensor_metadata")


def _weight_chain(node: Any) -> list[Any]:
    """The casts and transposes between a stacked weight and the matmul reading it."""
    chain = []
    while _key(node) in _WEIGHT_CHAIN:
        chain.append(node)
        node = node.args[0]
    return chain


def _param(node: Any, params: Mapping[str, str]) -> tuple[Any, bool] | None:
    """(placeholder, transposed) for a weight argument: a parameter, maybe cast, maybe with its
    last two axes swapped."""
    chain = _weight_chain(node)
    source = chain[-1].args[0] if chain else node
    if source.op != "placeholder" or source.name not in params:
        return None
    transposed = False
    for step in chain:
        if _key(step) == "aten.transpose":
            rank = len(_shape(step))
            if {int(d) % rank for d in step.args[1:3]} != {rank - 2, rank - 1}:
                return None
            transposed = not transposed
    return source, transposed


def _grouped_blocks(nodes: list[Any], params: Mapping[str, str], position: Mapping[Any, int]) -> list[Block]:
    by_offsets: dict[Any, list[Any]] = {}
    for node in nodes:
        if _key(node) in GROUPED_MM:
            by_offsets.setdefault(node.args[2], []).append(node)
    blocks = []
    for offsets, mms in by_offsets.items():
        blocks.append(_grouped_block(offsets, mms, params, position))
    return blocks


def _grouped_block(offsets: Any, mms: list[Any], params: Mapping[str, str], position: Mapping[Any, int]) -> Block:
    first = _param(mms[0].args[1], params)
    name = params[first[0].name].rsplit(".", 1)[0] if first else mms[0].name
    cumsum = _strip(offsets)
    histc = _strip(cumsum.args[0]) if _key(cumsum) == "aten.cumsum" else None
    if histc is None or _key(histc) != "aten.histc":
        raise _refuse(name, "the grouped matmul's offsets are not a cumsum of a histc of the sorted expert ids")
    sorted_ids = _strip(histc.args[0])
    sort = sorted_ids.args[0] if _key(sorted_ids) == "operator.getitem" else None
    if sort is None or _key(sort) != "aten.sort":
        raise _refuse(name, "the expert counts are not taken from sorted expert ids")
    num_experts = int(histc.args[1])
    perm = _getitem(sort, 1)
    ids = _strip(sort.args[0])
    divides = _users(perm, "aten.floor_divide")
    dispatch = [u for d in divides for u in _users(d, "aten.index")]
    weight_rows = [u for u in _users(perm, "aten.index") if u.args[1] == [perm]]
    inverse = [u for e in _users(perm, "aten.empty_like") for u in e.users if _short(u) == "index_put"]
    if len(divides) != 1 or len(dispatch) != 1 or len(weight_rows) != 1 or len(inverse) != 1:
        raise _refuse(name, "the sorted tokens, their routing weights or the inverse order were not found")
    slots = int(divides[0].args[1])  # perm // k: the token of each (token, slot) pair
    hidden = dispatch[0].args[0]
    weights = _strip(weight_rows[0].args[0])
    unpermute = [u for u in _users(inverse[0], "aten.index")]
    if len(unpermute) != 1:
        raise _refuse(name, "the outputs are not put back in token order")
    output = _follow_to_sum(unpermute[0], 1, name)
    roles: dict[Any, Role] = {dispatch[0]: Role("dispatch"), unpermute[0]: Role("pass"), output: Role("combine")}
    for mm in mms:
        found = _param(mm.args[1], params)
        if found is None:
            raise _refuse(name, f"grouped matmul '{mm.name}' does not read a 3-D expert weight")
        # the grouped matmul reads [E, K, N]; a transpose of the stored [E, N, K] gives it
        roles[mm] = Role("project", found[0], transposed=found[1])
    for user in sorted_ids.users:
        if _key(user) == "aten.index" and user.args[0].op == "placeholder" and user.args[0].name in params:
            roles[user] = Role("expert_param", user.args[0])
    routing_weights = {weight_rows[0]} | _noise_descendants(weight_rows[0])
    for node in _descendants([mms[-1]]) & _ancestors([output]):
        if _short(node) == "mul" and any(a in routing_weights for a in node.args if _is_node(a)):
            roles[node] = Role("scale")
    for view in _ancestors([output]) & _descendants([unpermute[0]]):
        roles[view] = Role("pass")
    router = find_router([ids, weights], name, position)
    if router.attrs["top_k"] != slots:
        raise _refuse(name, f"the experts take {slots} slots per token but the router chooses {router.attrs['top_k']}")
    region = (_descendants(router.nodes | {ids, weights}) & (_ancestors([output]) | {output})) | {
        n for mm in mms for n in _weight_chain(mm.args[1])}
    region -= _ancestors([hidden]) | {hidden}
    return _block(name, router, hidden, num_experts, roles, region | router.nodes, output, 1, position)


def _noise_descendants(node: Any) -> set[Any]:
    out: set[Any] = set()
    for user in node.users:
        if _key(user) in NOISE:
            out |= {user} | _noise_descendants(user)
    return out


def _follow_to_sum(node: Any, axis: int, name: str) -> Any:
    """From `node` through views to the `sum` over `axis` that ends the block."""
    current = node
    for _ in range(4):
        users = list(current.users)
        if len(users) != 1:
            break
        current = users[0]
        if _key(current) == "aten.sum":
            dims = current.args[1] if len(current.args) > 1 else None
            rank = len(_shape(current.args[0]))
            if dims is not None and [int(d) % rank for d in dims] == [axis]:
                return current
            break
        if _key(current) not in NOISE:
            break
    raise _refuse(name, f"the expert outputs are not summed over axis {axis}")


def _dense_blocks(nodes: list[Any], params: Mapping[str, str], position: Mapping[Any, int]) -> list[Block]:
    """Llama 4: bmm chains over stacked [E, K, N] weights whose input repeats the tokens per expert."""
    seen: set[Any] = set()
    blocks = []
    for node in nodes:
        if _key(node) != "aten.bmm" or node in seen:
            continue
        found = _param(node.args[1], params)
        if found is None or len(_shape(found[0])) != 3:
            continue
        name = params[found[0].name].rsplit(".", 1)[0]
        stacked = _strip(node.args[0])
        if _short(stacked) != "mul":
            raise _refuse(name, "the stacked expert inputs are not the repeated tokens times their scores")
        repeat = next((a for a in stacked.args if _is_node(a) and _key(a) == "aten.repeat"), None)
        scores_arg = next((a for a in stacked.args if _is_node(a) and a is not repeat), None)
        if repeat is None or scores_arg is None:
            raise _refuse(name, "the stacked expert inputs are not the repeated tokens times their scores")
        num_experts = int(_shape(found[0])[0])
        if [int(r) for r in repeat.args[1]] != [num_experts, 1]:
            raise _refuse(name, f"the tokens are repeated {list(repeat.args[1])} times, not once per expert")
        scores = _strip(scores_arg)
        if _key(scores) == "aten.transpose":
            scores = _strip(scores.args[0])
        chain = [node]
        while True:
            nxt = [u for u in _descendants([chain[-1]]) if _key(u) == "aten.bmm" and _param(u.args[1], params)]
            nxt = sorted(nxt, key=lambda n: position[n])
            if not nxt:
                break
            chain.append(nxt[0])
        seen.update(chain)
        output = _follow_to_sum(chain[-1], 0, name)
        roles: dict[Any, Role] = {stacked: Role("dispatch", scale=1), output: Role("combine")}
        for mm in chain:
            param, transposed = _param(mm.args[1], params)  # type: ignore[misc]
            roles[mm] = Role("project", param, transposed=transposed)
        # Between the stacking and the last bmm an expert's values keep a leading axis of 1 where
        # the program's have the E experts, so the program's own shapes still describe them.
        for view in _ancestors([chain[0]]) & _descendants([stacked]):
            roles[view] = Role("stack")
        current, first = chain[-1], True
        while current is not output:
            current = next(iter(current.users))
            if current is not output:
                roles[current] = Role("unstack" if first else "pass")
                first = False
        router = find_router([scores], name, position)
        region = (_descendants(router.nodes | {scores, repeat}) & (_ancestors([output]) | {output})) | {repeat} | {
            n for mm in chain for n in _weight_chain(mm.args[1])}
        hidden = repeat.args[0]
        blocks.append(_block(name, router, hidden, num_experts, roles, region | router.nodes, output, 0, position))
    return blocks


def _block(name: str, router: Router, hidden: Any, num_experts: int, roles: dict[Any, Role], region: set[Any],
           output: Any, scale_output: int, position: Mapping[Any, int]) -> Block:
    region = region | _dead_hangers(region, output)
    order = sorted((n for n in region if n not in router.nodes), key=lambda n: position[n])
    return Block(name, router, hidden, num_experts, roles, order, output, scale_output, frozenset(region))


def _dead_hangers(region: set[Any], output: Any) -> set[Any]:
    """Nodes reading the region whose results nothing outside it uses (the group top-k's unused
    indices): they go with the block."""
    dead: dict[Any, bool] = {}

    def is_dead(node: Any) -> bool:
        if node not in dead:
            dead[node] = False  # a cycle guard; FX graphs are acyclic
            dead[node] = node.op != "output" and all(u in region and u is not output or is_dead(u)
                                                     for u in node.users)
        return dead[node]

    return {u for n in region if n is not output for u in n.users if u not in region and is_dead(u)}


def _check_closed(block: Block) -> None:
    """Only the block's output may be read outside it (the router's logits lie outside)."""
    for node in block.nodes:
        if node is block.output:
            continue
        outside = [u for u in node.users if u not in block.nodes]
        if outside:
            raise _refuse(block.name, f"'{node.name}' inside the block is also read by '{outside[0].name}' outside "
                          "it (router logits returned as an output are not supported)")


# -- routers -------------------------------------------------------------------------------------


def find_router(outputs: list[Any], block: str, position: Mapping[Any, int]) -> Router:
    """The routing that computes `outputs` (top-k ids and weights, or dense scores)."""
    before = _ancestors(outputs)
    linears = [n for n in before if _key(n) in ("aten.linear", "aten.mm", "aten.addmm", "aten.matmul")]
    if not linears:
        raise _refuse(block, "no linear layer computes the router's logits")
    linear = max(linears, key=lambda n: position[n])
    nodes = (_descendants([linear]) & (before | set(outputs)))
    ordered = sorted(nodes, key=lambda n: position[n])
    semantic = [n for n in ordered if _key(n) not in NOISE]
    sequence = " ".join(_short(n) for n in semantic) + " "
    for kind, pattern in ROUTINGS.items():
        match = pattern.match(sequence)
        if match:
            val = semantic[0].meta.get("val")  # the routing computes in its first op's element type
            val = val[0] if isinstance(val, (list, tuple)) else val
            attrs, bias = _router_attrs(kind, match, semantic, block)
            return Router(linear, dtype_of(val.dtype), bias, attrs, frozenset(nodes))
    shown = " -> ".join(_short(n) for n in semantic) or "no ops"
    raise UnsupportedModelError(f"MoE block '{block}': router uses {shown}; supported: {SUPPORTED_ROUTINGS}",
                                node=semantic[0].name if semantic else None)


def _scalar(node: Any, block: str, what: str) -> float:
    scalars = [a for a in node.args if isinstance(a, (int, float)) and not isinstance(a, bool)]
    if len(scalars) != 1:
        raise _refuse(block, f"the router's {what} ('{node.name}') is not a constant")
    return float(scalars[0])


def _topk_k(node: Any, block: str) -> int:
    args = list(node.args) + [None] * 5
    k, dim, largest = args[1], args[2], args[3]
    rank = len(_shape(node.args[0]))
    if dim is not None and int(dim) % rank != rank - 1 or largest is False:
        raise _refuse(block, f"the router's top-k '{node.name}' is not the largest along the last axis")
    return int(k)


def _router_attrs(kind: str, match: re.Match[str], semantic: list[Any], block: str) -> tuple[dict[str, Any], Any]:
    by_op: dict[str, list[Any]] = {}
    for node in semantic:
        by_op.setdefault(_short(node), []).append(node)
    topks = by_op["topk"]
    attrs: dict[str, Any] = {"score": match.group("score"), "top_k": _topk_k(topks[-1], block)}
    bias = None
    if kind != "scores":
        attrs["select"] = "logits"
        return attrs, bias
    if match.group("bias"):
        add = by_op["add"][0]
        bias = next((a for a in add.args if _is_node(a) and a.op == "placeholder"), None)
        if bias is None:
            raise _refuse(block, "the router adds a computed value to its scores, not a bias")
        if not match.group("gather"):
            raise _refuse(block, "the router weighs tokens by the bias-corrected scores")
    if match.group("group"):
        grouped = _shape(topks[0].args[0])
        attrs.update(n_group=int(grouped[-2]), group_top=_topk_k(topks[0], block),
                     topk_group=_topk_k(topks[1], block))
    if match.group("norm"):
        attrs["normalize"] = 1
        if match.group("eps"):
            attrs["normalize_epsilon"] = _scalar(by_op["add"][-1], block, "normalization epsilon")
    if match.group("scale"):
        attrs["scale"] = _scalar(by_op["mul"][-1], block, "scaling factor")
    return attrs, bias


# -- lowering --------------------------------------------------------------------------------------


def emit_block(cx: Lowering, block: Block, table: Mapping[str, Any]) -> Value:
    """The block's IR: the router, then expert after expert its dispatch, weights, gate and combine."""
    router = block.router
    inputs = [cx.value(router.logits, router.dtype)]
    if router.bias is not None:
        inputs.append(cx.value(router.bias, router.dtype))
    routing = add_value(cx.graph, "MoERouter", inputs, router.attrs, name=cx.graph.unique_name(f"{block.name}.router"))
    hidden = cx.value(block.hidden)
    acc: Value | None = None
    for expert in range(block.num_experts):
        local: dict[Any, Any] = {}
        for node in block.order:
            role = block.roles.get(node)
            if role is None:
                if any(arg in local for arg in node.all_input_nodes):
                    local[node] = _row_wise(cx, node, local, table, block)
                continue
            if role.kind == "dispatch":
                local[node] = add_value(cx.graph, "MoEDispatch", [hidden, routing],
                                        {"expert": expert, "scale": role.scale},
                                        name=cx.graph.unique_name(f"{block.name}.{expert}.dispatch"))
            elif role.kind == "project":
                weight = _expert_weight(cx, role.param, expert, role.transposed)
                x = cx.cast(_local_arg(node, 0, local, block), weight.type.dtype)
                local[node] = add_value(cx.graph, "MatMul", [x, weight], name=cx.graph.unique_name(weight.name))
            elif role.kind == "expert_param":
                local[node] = _expert_weight(cx, role.param, expert, False)
            elif role.kind == "scale":
                local[node] = next(local[a] for a in node.args if _is_node(a) and a in local)
            elif role.kind == "pass":
                local[node] = _local_arg(node, 0, local, block)
            elif role.kind in ("stack", "unstack"):
                op = "Unsqueeze" if role.kind == "stack" else "Squeeze"
                local[node] = add_value(cx.graph, op, [_local_arg(node, 0, local, block), cx.ints([0])],
                                        name=cx.graph.unique_name(f"{block.name}.{expert}.{role.kind}"))
            elif role.kind == "combine":
                y = _local_arg(node, 0, local, block)
                acc = add_value(cx.graph, "MoECombine", [routing, y] + ([acc] if acc is not None else []),
                                {"expert": expert, "scale": block.scale_output},
                                name=cx.graph.unique_name(f"{block.name}.{expert}.combine"))
    assert acc is not None
    return acc


def _local_arg(node: Any, index: int, local: Mapping[Any, Any], block: Block) -> Value:
    arg = node.args[index]
    if arg not in local:
        raise _refuse(block.name, f"'{node.name}' reads '{getattr(arg, 'name', arg)}', which no expert computes")
    return local[arg]  # type: ignore[no-any-return]


def _row_wise(cx: Lowering, node: Any, local: Mapping[Any, Any], table: Mapping[str, Any], block: Block) -> Any:
    """A gate node re-emitted for one expert, its expert-computed inputs read from `local`."""
    key = _key(node)
    if key not in ROW_WISE or key not in table:
        raise _refuse(block.name, f"the experts use {node.target} ('{node.name}'), which aviatorc does not split "
                      "per expert")
    if key in _LAST_AXIS_OPS:
        args = cx.args(node)
        dim = args.get("dim")
        rank = len(_shape(node.args[0]))
        dims = dim if isinstance(dim, (list, tuple)) else [dim]
        if any(d is None or int(d) % rank != rank - 1 for d in dims):
            raise _refuse(block.name, f"'{node.name}' ({key}) works across tokens, not on each token's row")
    for arg in node.all_input_nodes:
        if arg not in local and arg in block.nodes:
            raise _refuse(block.name, f"'{node.name}' reads '{arg.name}', which no expert computes")
    return cx.convert_with(node, table[key], {arg: local[arg] for arg in node.all_input_nodes if arg in local})


def _expert_weight(cx: Lowering, placeholder: Any, expert: int, transposed: bool) -> Value:
    """Expert `expert`'s slice of a stacked parameter as its own initializer: [K, N] for a
    projection (the stored [E, N, K] transposed when `transposed`), [N] for a bias."""
    w = cx.lookup(placeholder)
    tensor = w.tensor
    stem, _, leaf = w.name.rpartition(".")
    name = f"{stem}.{expert}.{leaf}" if stem else f"{leaf}.{expert}"
    if name in cx.graph.initializers:
        return cx.graph.initializers[name]
    shape = tuple(int(d) for d in tensor.shape[1:])
    if transposed:
        shape = shape[::-1]
    type_ = TensorType(dtype_of(tensor.dtype), shape)
    if w.shape_only or tensor.device.type == "meta":
        data: Any = ShapeOnly("imported shape-only from PyTorch")
    else:
        from aviatorc.frontends.torch.importer import tensor_to_numpy

        stacked = tensor_to_numpy(tensor)
        data = ArrayData(stacked[expert]) if not transposed else Derived(ArrayData(stacked[expert]), _transpose)
    return cx.graph.add_initializer(name, type_, data)


def _transpose(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array.T)


def unsupported_in_blocks(blocks: Iterable[Block]) -> set[Any]:
    """Every node a block replaces: the importer converts none of them on its own."""
    return {n for b in blocks for n in b.nodes}
