"""What the scheduler reads off the IR graph: node order, layers, weight uses, attention, sizes.

- Every node gets a layer: a node reading a placed weight takes the weight's layer; any other
  node the largest layer among its inputs (graph inputs and constants are layer -1). So a
  block's input norm runs with the block before it, and its attention with its own QKV.
- A *weight use* is a node reading placed tiles: a MatMul reads column strips (`cols`), an
  embedding Gather reads row ranges (`rows`; of a tied head's strips, whose columns are the
  table's rows).
- Attention is where the KV cache is read: one Softmax (or Attention node) per block. The KV
  width per token of a layer comes from its k and v projections (fused or not): the widths of
  the `k` and `v` parts of a fused weight, or the n of the `k_proj`/`v_proj`-like weights.
- Activation sizes: elements per token are a value's element count over the tokens the graph
  itself was built for (symbolic dims count 1), scaled to the tokens a program processes.
  Attention scores (the Softmax's input and output) are assumed computed in tiles, flash-
  attention style, and take no activation buffer. A prefill needs the graph's outputs (the
  logits) for each sequence's last token only, as serving stacks compute them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from aviatorc.ir import Graph, Node, Value
from aviatorc.partition.tiling import Tile
from aviatorc.plan.ir import Part

ATTENTION_OPS = ("Softmax", "Attention")
# Views: on the machine they are addressing, not work for the vector units.
SHAPE_OPS = frozenset({"Reshape", "Flatten", "Unsqueeze", "Squeeze", "Transpose", "Expand", "Tile", "Concat", "Split",
                       "Slice", "Shape", "Size", "ConstantOfShape", "Range", "Identity", "Cast", "Gather",
                       "GatherElements", "GatherND"})
# With multi-head latent attention the cache holds kv_a_proj_with_mqa's output (the latent and the
# shared rotary key), so its width is the layer's whole KV width; its query is q_b_proj's output.
_K_ROLES = {"k", "k_proj", "key", "k_lin", "wk", "to_k", "kv_a_proj_with_mqa"}
_V_ROLES = {"v", "v_proj", "value", "v_lin", "wv", "to_v"}
_Q_ROLES = {"q", "q_proj", "query", "q_lin", "wq", "to_q", "q_b_proj"}


@dataclass(frozen=True)
class TileUse:
    """Tile `tile` read by graph node `node`: output columns of a MatMul, or table rows of a lookup."""

    tile: int
    node: str
    part: Part

    @property
    def start(self) -> int:
        return self.part.start

    @property
    def stop(self) -> int:
        return self.part.stop


@dataclass
class ModelFacts:
    """The graph as the scheduler sees it."""

    order: list[Node]
    layer_of_node: dict[str, int]
    uses: dict[str, list[TileUse]]  # node name -> the tiles it reads
    attention: dict[str, int]  # attention node name -> layer
    kv_width: dict[int, int]  # layer -> K + V elements per token
    q_width: dict[int, int]  # layer -> query elements per token (heads x head dim)
    graph_tokens: int  # tokens the graph's own shapes are built for (symbolic dims: 1)
    value_elements: dict[str, int] = field(default_factory=dict)  # value -> elements in the graph's own shapes
    score_values: set[str] = field(default_factory=set)  # attention scores: no activation buffer
    weight_chain: set[str] = field(default_factory=set)  # nodes between a stored weight and its reader
    outputs: set[str] = field(default_factory=set)  # graph output values
    output_order: list[str] = field(default_factory=list)  # the same, in the graph's order (logits first)
    expert_of: dict[str, int] = field(default_factory=dict)  # node inside a mixture of experts' expert -> its index
    peaks: dict[tuple[int, int, bool, int, int], int] = field(default_factory=dict)  # memo of activation peaks
    _by_name: dict[str, Node] = field(default_factory=dict, repr=False)
    _runs: LayerRuns | None = field(default=None, repr=False)  # memo of `layer_runs` (memory and build ask)
    _vector: dict[str, list[str]] | None = field(default=None, repr=False)  # memo of `vector_values`

    @property
    def layers(self) -> list[int]:
        return sorted(set(self.layer_of_node.values()))

    def node(self, name: str) -> Node:
        if not self._by_name:
            self._by_name.update((n.name, n) for n in self.order)
        return self._by_name[name]

    def elements_per_token(self, value: str) -> float:
        return self.value_elements.get(value, 0) / self.graph_tokens

    def vector_values(self, node: Node) -> list[str]:
        """The activations a node moves through the vector units, between them and SRAM (inputs
        and outputs): none for a view, a weight's reader (matrix units) or attention (costed as
        matrix work). Vector nodes run fused where one makes a value only the next reads, in the
        same layer (so on the same chiplet), as compilers fuse elementwise chains: that value
        never leaves the vector units, and a fused chain reads each of its inputs once. An RMSNorm
        (square, mean, add, rsqrt, scale, weight) then reads its input and writes its output, and
        SiLU(gate) x up reads gate and up and writes the product, once each."""
        if self._vector is None:
            self._vector = _vector_traffic(self)
        return self._vector.get(node.name, [])

    def vector_elements_per_token(self) -> float:
        return sum(self.elements_per_token(v) for node in self.order for v in self.vector_values(node))


@dataclass(frozen=True)
class LayerRuns:
    """The nodes a weight-stationary prefill walks, in runs of about one layer (every token block
    runs through a run before the next starts), and what the boundaries hold per token."""

    runs: list[list[Node]]
    held_elements_per_token: float  # the most any boundary holds: values made before it, read after it


def layer_runs(facts: ModelFacts) -> LayerRuns:
    """The node order cut where a new layer begins, each cut moved within the plain nodes that end a
    layer (its residual add, the next layer's input norm) to where the fewest elements cross it: so a
    boundary holds the residual stream, not also its normalized copy. A view shares its input's
    bytes (a layer's own reshape of the rotary table is the table). Memoized per facts."""
    if facts._runs is None:
        facts._runs = _layer_runs(facts)
    return facts._runs


def _layer_runs(facts: ModelFacts) -> LayerRuns:
    nodes = [n for n in facts.order if n.name not in facts.weight_chain]
    live = _live_elements(nodes, facts)
    cuts: list[int] = []
    last_weight, newest = -1, -1
    for i, node in enumerate(nodes):
        layer = facts.layer_of_node[node.name]
        if layer > newest:  # a new layer begins (a node of an earlier one, such as a lazily built table, does not cut)
            if i:
                cuts.append(min(range(max(last_weight + 1, cuts[-1] + 1 if cuts else 1), i + 1),
                                key=lambda j: (live[j], -j)))
            newest = layer
        if node.name in facts.uses:
            last_weight = i
    bounds = [0, *sorted(set(cuts)), len(nodes)]
    runs = [nodes[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
    return LayerRuns(runs, max((live[c] for c in cuts), default=0.0))


def _live_elements(nodes: list[Node], facts: ModelFacts) -> list[float]:
    """Per position i: the elements per token of values made before node i and read at or after it."""
    root: dict[str, str] = {}
    span: dict[str, list[float]] = {}  # root -> [made, last read, elements per token]
    for i, node in enumerate(nodes):
        data = [v for v in node.inputs if v is not None and v.name in root]
        for out in node.outputs:
            r = root[data[0].name] if node.op in SHAPE_OPS and data else out.name
            root[out.name] = r
            entry = span.setdefault(r, [i, i, 0.0])
            entry[2] = max(entry[2], facts.elements_per_token(out.name))
        for value in data:
            entry = span[root[value.name]]
            entry[1] = max(entry[1], i)
    delta = [0.0] * (len(nodes) + 2)
    for made, last, elements in span.values():
        if last > made and elements:  # live over positions made + 1 .. last
            delta[int(made) + 1] += elements
            delta[int(last) + 1] -= elements
    live, total = [], 0.0
    for i in range(len(nodes) + 1):
        total += delta[i]
        live.append(total)
    return live


def numel_bound(shape: Sequence[int | str | None]) -> int:
    """Element count with symbolic (or unknown) dims counted as 1."""
    return math.prod(d if isinstance(d, int) else 1 for d in shape)


def model_facts(graph: Graph, tiles: Sequence[Tile]) -> ModelFacts:
    uses = _tile_uses(graph, tiles)
    layer_of_tile_node = {name: tiles[u[0].tile].layer for name, u in uses.items() if u}
    layer_of: dict[str, int] = {}
    value_layer: dict[int, int] = {}
    for node in graph.nodes:
        if node.name in layer_of_tile_node:
            layer = layer_of_tile_node[node.name]
        else:
            layer = max((value_layer.get(id(v), -1) for v in node.inputs if v is not None), default=-1)
        layer_of[node.name] = layer
        for out in node.outputs:
            value_layer[id(out)] = layer
    attention = {n.name: layer_of[n.name] for n in graph.nodes if n.op in ATTENTION_OPS}
    q_width, kv_width = _attention_widths(tiles)
    scores = {v.name for n in graph.nodes if n.op == "Softmax" for v in (*n.inputs, *n.outputs) if v is not None}
    chain = _weight_chain_nodes(graph, uses)
    elements = {out.name: numel_bound(out.type.shape) for n in graph.nodes if n.name not in chain for out in n.outputs}
    from aviatorc.ir.experts import expert_nodes

    return ModelFacts(_experts_side_by_side(graph), layer_of, uses, attention, kv_width, q_width,
                      _graph_tokens(graph), elements, scores, chain, {v.name for v in graph.outputs},
                      [v.name for v in graph.outputs], {n.name: ref.expert for n, ref in expert_nodes(graph).items()})


def _vector_traffic(facts: ModelFacts) -> dict[str, list[str]]:
    """Node -> the values it moves through the vector units (`ModelFacts.vector_values`)."""
    def moved(values: Sequence[Value | None]) -> list[Value]:
        return [v for v in values if v is not None and not v.is_initializer and v.name in facts.value_elements]

    vector = {node.name for node in facts.order
              if not (node.op in SHAPE_OPS or node.name in facts.uses or node.name in facts.attention
                      or node.name in facts.weight_chain) and moved((*node.inputs, *node.outputs))}
    chain = {node.name: node.name for node in facts.order}  # a fused chain's first node

    def first(name: str) -> str:
        while chain[name] != name:
            name = chain[name]
        return name

    fused: set[str] = set()
    for node in facts.order:
        if node.name not in vector:
            continue
        for out in node.outputs:
            readers = {user.name for user in out.users}
            reader = next(iter(readers), "")
            if (len(readers) == 1 and reader in vector and out.name not in facts.outputs
                    and facts.layer_of_node.get(reader) == facts.layer_of_node.get(node.name)):
                fused.add(out.name)
                if first(reader) != first(node.name):
                    chain[first(reader)] = first(node.name)
    read: set[tuple[str, str]] = set()  # (chain, value) read by the chain already
    traffic: dict[str, list[str]] = {}
    for node in facts.order:
        if node.name not in vector:
            continue
        names = []
        for value in moved(node.inputs):
            key = (first(node.name), value.name)
            if value.name not in fused and key not in read:
                read.add(key)
                names.append(value.name)
        traffic[node.name] = names + [v.name for v in moved(node.outputs) if v.name not in fused]
    return traffic


def _experts_side_by_side(graph: Graph) -> list[Node]:
    """The graph's order with each mixture of experts' block in three parts: every expert's
    dispatch, then the experts, then the combines. The block's home then sends every routed expert
    its input before it waits on any of them, so the experts (and their on-demand loads) run side
    by side rather than one after another. Nodes reading stored weights alone keep their place."""
    from aviatorc.ir.experts import expert_nodes

    inside = {node: ref.block for node, ref in expert_nodes(graph).items()}
    weights: set[int] = set()  # values computed from stored weights alone (a dequantized expert weight)
    order: list[Node] = []
    held: dict[str, tuple[list[Node], list[Node], list[Node]]] = {}  # block -> dispatches, experts, combines

    def flush() -> None:
        for dispatches, experts, combines in held.values():
            order.extend(dispatches)
            order.extend(_stage_major(experts))
            order.extend(combines)
        held.clear()

    for node in graph.nodes:
        if all(v is None or v.is_initializer or id(v) in weights for v in node.inputs):
            weights.update(id(out) for out in node.outputs)
            order.append(node)
            continue
        if node.op == "MoECombine":
            routing = node.input(0)
            block = routing.producer.name if routing.producer is not None else routing.name
            held.setdefault(block, ([], [], []))[2].append(node)
        elif node in inside:
            if held and inside[node] not in held:
                flush()
            held.setdefault(inside[node], ([], [], []))[0 if node.op == "MoEDispatch" else 1].append(node)
        else:
            flush()  # the first node past a block's experts
            order.append(node)
    flush()
    return order


def _stage_major(experts: list[Node]) -> list[Node]:
    """A block's expert nodes by their depth inside the block (every expert's first projection,
    then every expert's activation, then every second projection), each depth in graph order. A
    chiplet holding strips of several experts then runs (and loads) all its first-projection strips
    before any second one, which waits on its expert's activation from another chiplet: expert by
    expert, one routed expert's wait held up the loads of all the others on that stream. Depth
    order is a topological order (a node is deeper than every node it reads)."""
    depth: dict[int, int] = {}
    for node in experts:  # graph order: producers first
        depth[id(node)] = 1 + max((depth.get(id(v.producer), -1) for v in node.inputs
                                   if v is not None and v.producer is not None), default=-1)
    return sorted(experts, key=lambda node: depth[id(node)])  # stable: graph order within a depth


WEIGHT_CHAIN_OPS = ("DequantizeWeight", "Cast", "Transpose")  # between a stored weight and its reader


def _weight_chain_nodes(graph: Graph, uses: dict[str, list[TileUse]]) -> set[str]:
    """Nodes between a stored weight and its reader (dequantize, cast, transpose): the tiles
    stand for them, in the plan and in SRAM."""
    chain: set[str] = set()
    for node in graph.nodes:
        if node.name not in uses:
            continue
        value = node.inputs[0] if node.op == "Gather" else node.inputs[1]
        while value is not None and value.producer is not None and value.producer.op in WEIGHT_CHAIN_OPS:
            chain.add(value.producer.name)
            value = value.producer.inputs[0]
    return chain


def _tile_uses(graph: Graph, tiles: Sequence[Tile]) -> dict[str, list[TileUse]]:
    nodes = {n.name: n for n in graph.nodes}
    uses: dict[str, list[TileUse]] = {}
    for index, tile in enumerate(tiles):
        for name in tile.nodes:
            node = nodes.get(name)
            if node is None:
                continue  # config-derived specs name nodes of a graph that was never built
            if node.op == "Gather":
                # A lookup reads table rows: an embedding's row tiles, or a tied head's column strips.
                start, stop = (tile.k_start, tile.k_stop) if tile.is_embedding else (tile.n_start, tile.n_stop)
                uses.setdefault(name, []).append(TileUse(index, name, Part("rows", start, stop)))
            else:
                uses.setdefault(name, []).append(TileUse(index, name, Part("cols", tile.n_start, tile.n_stop)))
    return uses


def _attention_widths(tiles: Sequence[Tile]) -> tuple[dict[int, int], dict[int, int]]:
    """Per layer: query width and K + V width per token, from the projections' columns."""
    q: dict[int, set[tuple[str, int, int]]] = {}
    kv: dict[int, set[tuple[str, int, int]]] = {}
    for tile in tiles:
        parts = tile.parts or ((tile.role, tile.n_start, tile.n_stop),)
        for part_role, start, stop in parts:
            role = part_role or tile.role  # a part without a name of its own has its weight's role
            key = (tile.weight + ":" + role, start, stop)
            if role in _Q_ROLES:
                q.setdefault(tile.layer, set()).add(key)
            elif role in _K_ROLES or role in _V_ROLES:
                kv.setdefault(tile.layer, set()).add(key)
    width = {layer: sum(stop - start for _, start, stop in spans) for layer, spans in kv.items()}
    return {layer: sum(b - a for _, a, b in spans) for layer, spans in q.items()}, width


def _graph_tokens(graph: Graph) -> int:
    """Tokens in the graph's own shapes: the element count of its first integer input (ids)."""
    for value in graph.inputs:
        if value.type.dtype.startswith("int"):
            return max(1, numel_bound(value.type.shape))
    first: Value | None = graph.inputs[0] if graph.inputs else None
    return max(1, numel_bound(first.type.shape[:-1])) if first is not None else 1
