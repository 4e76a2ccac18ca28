"""How often each expert of a mixture of experts fires: an input to planning.

A decode step at batch B reads only the experts its tokens route to, so what a plan streams,
keeps resident and predicts depends on the routing. Per MoE layer, a `BlockRouting` holds each
expert's *share*: the probability that one token routes to it (the shares sum to the block's
top_k, each at most 1). From the shares, with tokens routed independently:

    P(expert e fires in a step of B tokens) = 1 - (1 - share_e) ** B
    E[experts a step reads]                 = sum over e of that
    E[tokens expert e computes]             = B x share_e

Sources (`--routing`, `routing_for`):
- `uniform`: every expert top_k / E;
- `zipf:S`: the expert of rank r in proportion to 1 / r**S, capped at 1 (ranks are a fixed
  permutation per layer, so different layers have different hot experts);
- a JSON file: `{"layers": {"3": [share or count per expert, ...], ...}}` (counts are scaled to
  sum to top_k), or what a compile's report.json writes under `routing`;
- measured: the routers' choices on calibration batches (`measure_routing`).

`sample` draws one step's routing: per token, top_k distinct experts with inclusion
probabilities exactly the shares (systematic sampling over a random order of the experts). The
co-activation of experts (which fire together) is not modelled: tokens and their choices are
independent beyond the shares.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from aviatorc.errors import ModelFormatError, OptionError
from aviatorc.ir import Graph

ROUTING_KINDS = ("uniform", "zipf:S", "FILE.json")


@dataclass(frozen=True)
class BlockRouting:
    """One MoE block's routing: per expert, the probability that a token routes to it."""

    layer: int
    top_k: int
    shares: tuple[float, ...]

    @property
    def experts(self) -> int:
        return len(self.shares)

    def fires(self, expert: int, tokens: int) -> float:
        """The probability that `expert` runs in a step of `tokens` tokens."""
        return 1.0 - (1.0 - self.shares[expert]) ** tokens

    def expected_active(self, tokens: int) -> float:
        return sum(self.fires(e, tokens) for e in range(self.experts))

    def sample(self, rng: np.random.Generator, tokens: int) -> np.ndarray:
        """Tokens routed to each expert in one step of `tokens` tokens (each token: top_k distinct experts)."""
        shares = np.asarray(self.shares)
        counts = np.zeros(self.experts, dtype=np.int64)
        for _ in range(tokens):
            order = rng.permutation(self.experts)
            edges = np.cumsum(shares[order])
            points = rng.random() + np.arange(self.top_k)
            picked = np.minimum(np.searchsorted(edges, points, side="right"), self.experts - 1)
            counts[order[picked]] += 1
        return counts


@dataclass(frozen=True)
class Routing:
    """Every MoE block's routing, by layer, and where it came from."""

    source: str
    blocks: tuple[BlockRouting, ...]

    def of_layer(self, layer: int) -> BlockRouting | None:
        return self._by_layer.get(layer)

    @property
    def _by_layer(self) -> dict[int, BlockRouting]:
        return {b.layer: b for b in self.blocks}

    def to_dict(self) -> dict[str, Any]:
        """The report's form, which `--routing FILE.json` reads back."""
        return {"source": self.source,
                "layers": {str(b.layer): {"top_k": b.top_k, "shares": [round(s, 6) for s in b.shares]}
                           for b in self.blocks}}


@dataclass(frozen=True)
class MoEBlock:
    """A block as the graph has it: its router node, layer, expert count and top_k."""

    router: str
    layer: int
    experts: int
    top_k: int


def moe_blocks(graph: Graph, weights: Iterable[Any]) -> list[MoEBlock]:
    """The graph's MoE blocks, each with the layer its experts' weights belong to (`weights`:
    `WeightSpec`s or tiles, whose `layer` and `nodes` say where each is used)."""
    from aviatorc.ir.experts import expert_nodes

    refs = {node.name: ref for node, ref in expert_nodes(graph).items()}
    layer_of: dict[str, int] = {}
    for spec in weights:
        if spec.layer is not None:
            for name in spec.nodes:
                if name in refs:
                    layer_of.setdefault(refs[name].block, spec.layer)
    blocks = []
    for node in graph.nodes:
        if node.op != "MoERouter" or node.name not in layer_of:
            continue
        experts = node.outputs[0].type.shape[-1]
        if not isinstance(experts, int):
            raise ModelFormatError(f"MoE router '{node.name}' has no static expert count ({experts})")
        top_k = node.attrs["top_k"]
        assert isinstance(top_k, int)  # the verifier checked it against the op's type rule
        blocks.append(MoEBlock(node.name, layer_of[node.name], experts, top_k))
    layers = [b.layer for b in blocks]
    if len(set(layers)) != len(layers):
        twice = sorted({layer for layer in layers if layers.count(layer) > 1})
        raise ModelFormatError(f"layer {twice[0]} has more than one MoE block; routing is kept per layer")
    return blocks


def uniform_shares(experts: int, top_k: int) -> tuple[float, ...]:
    return (top_k / experts,) * experts


def capped_shares(weights: Sequence[float] | np.ndarray, top_k: int) -> tuple[float, ...]:
    """Shares in proportion to `weights`, summing to `top_k`, none above 1 (the excess of a capped
    expert goes to the others in proportion, as a token picks an expert at most once)."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) < top_k or not np.all(np.isfinite(w)) or np.any(w < 0) or np.count_nonzero(w) < top_k:
        raise ValueError(f"need at least {top_k} non-negative weights, {top_k} of them above 0")
    shares = np.zeros_like(w)
    capped = np.zeros(len(w), dtype=bool)
    while True:
        free = ~capped
        shares[free] = w[free] * (top_k - capped.sum()) / w[free].sum()
        over = free & (shares > 1.0)
        if not over.any():
            break
        capped |= over
        shares[capped] = 1.0
    return tuple(float(s) for s in shares)


def zipf_shares(experts: int, top_k: int, exponent: float, layer: int) -> tuple[float, ...]:
    """Expert of rank r in proportion to 1 / r**exponent; the ranks a fixed permutation for `layer`."""
    ranked = capped_shares([1.0 / (r + 1) ** exponent for r in range(experts)], top_k)
    order = np.random.default_rng(layer).permutation(experts)  # expert order[r] has rank r
    shares = [0.0] * experts
    for rank, expert in enumerate(order):
        shares[int(expert)] = ranked[rank]
    return tuple(shares)


def routing_for(spec: str, blocks: Sequence[MoEBlock]) -> Routing:
    """The routing `spec` names (`uniform`, `zipf:S`, a JSON file) for `blocks`."""
    if spec == "uniform":
        return Routing("uniform", tuple(BlockRouting(b.layer, b.top_k, uniform_shares(b.experts, b.top_k))
                                        for b in blocks))
    if spec.startswith("zipf:"):
        try:
            exponent = float(spec[5:])
        except ValueError:
            exponent = math.nan
        if not math.isfinite(exponent) or exponent < 0:
            raise OptionError(f"routing '{spec}': the Zipf exponent must be a number >= 0",
                              hint="for example --routing zipf:1.2")
        return Routing(f"zipf:{exponent:g}", tuple(
            BlockRouting(b.layer, b.top_k, zipf_shares(b.experts, b.top_k, exponent, b.layer)) for b in blocks))
    if spec.endswith(".json"):
        return _from_file(Path(spec), blocks)
    raise OptionError(f"unknown routing '{spec}'", hint=f"choose one of {', '.join(ROUTING_KINDS)}")


def _from_file(path: Path, blocks: Sequence[MoEBlock]) -> Routing:
    try:
        data = json.loads(path.read_text())
    except OSError as error:
        raise OptionError(f"{path}: cannot read the routing file ({error.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelFormatError(f"{path}: not JSON ({error})") from None
    layers = data.get("layers") if isinstance(data, dict) else None
    if not isinstance(layers, dict):
        raise ModelFormatError(f"{path}: a routing file is an object with 'layers': {{layer: [share per expert]}}")
    found = []
    for block in blocks:
        entry = layers.get(str(block.layer))
        if isinstance(entry, dict):
            entry = entry.get("shares")
        if entry is None:
            raise ModelFormatError(f"{path}: no routing for MoE layer {block.layer} "
                                   f"(the model's MoE layers: {', '.join(str(b.layer) for b in blocks)})")
        if not isinstance(entry, list) or len(entry) != block.experts or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in entry):
            raise ModelFormatError(f"{path}: layer {block.layer} must give {block.experts} numbers, one per expert")
        try:
            shares = capped_shares(entry, block.top_k)
        except ValueError as error:
            raise ModelFormatError(f"{path}: layer {block.layer}: {error}") from None
        found.append(BlockRouting(block.layer, block.top_k, shares))
    return Routing(f"file:{path.name}", tuple(found))


def measure_routing(graph: Graph, blocks: Sequence[MoEBlock], batches: Sequence[Mapping[str, Any]]) -> Routing:
    """The shares the routers choose on `batches` (feed dicts): each expert's routed tokens over
    all tokens. An expert no token reaches keeps a floor of a hundredth of a uniform share, so it is
    still planned for (and sampled, rarely)."""
    from aviatorc.ir.interpreter import evaluate

    routers = {b.router for b in blocks}
    names = {node.name: node.outputs[0].name for node in graph.nodes if node.name in routers}
    counts = {b.router: np.zeros(b.experts) for b in blocks}
    tokens = 0
    for feeds in batches:
        kept = evaluate(graph, feeds, keep=list(names.values()), only_kept=True)
        for b in blocks:
            routed = kept[names[b.router]].reshape(-1, b.experts) != 0
            counts[b.router] += routed.sum(axis=0)
        tokens += kept[names[blocks[0].router]].reshape(-1, blocks[0].experts).shape[0]
    found = []
    for b in blocks:
        floor = 0.01 * b.top_k / b.experts * max(1, tokens)
        found.append(BlockRouting(b.layer, b.top_k, capped_shares(np.maximum(counts[b.router], floor), b.top_k)))
    return Routing(f"measured on {tokens} calibration tokens", tuple(found))


@dataclass(frozen=True)
class PredictionHits:
    """How well one block's routing is predicted from the block before it (`measure_prediction`)."""

    layer: int
    hit_rate: float  # of the experts the block routed its tokens to, the share the predictor named
    chance: float  # the same for a guess of top_k experts drawn by the block's measured shares


@dataclass(frozen=True)
class GateHits:
    """Pre-gating on one block in one run: of the (token, expert) pairs its router chose, those
    the previous block's hidden state, run through this block's router, named."""

    layer: int
    hits: int
    routed: int
    tokens: int
    per_expert: np.ndarray  # routed tokens per expert


@dataclass(frozen=True)
class _Ahead:
    """One predicted block: the hidden state that entered the block before's router (`ahead`), the
    one that enters its own (`own`), its router, the chain from its logits MatMul to the router,
    and the chain's other inputs."""

    block: MoEBlock
    ahead: Any
    own: Any
    router: Any
    chain: list[Any]
    outside: list[Any]


class PreGating:
    """Pre-gating, as a runtime predicts a block's experts one block ahead: block j's router run
    on the hidden state that entered block j - 1's router; its top_k experts per token against
    the ones block j's router then chooses. `needs`: the values `hits` reads (activations, and
    the router weights where the graph keeps no data for them)."""

    def __init__(self, graph: Graph, blocks: Sequence[MoEBlock]) -> None:
        from aviatorc.ir.experts import router_matmuls

        by_router = {b.router: b for b in blocks}
        ordered = [node for node in graph.nodes if node.name in by_router]
        matmul_of: dict[str, Any] = {}
        for matmul in router_matmuls(graph):
            for node in ordered:  # the router whose logits this MatMul computes: the first after it
                if graph.position(node) > graph.position(matmul) and node.name not in matmul_of:
                    matmul_of[node.name] = matmul
                    break
        self.blocks: list[_Ahead] = []  # every block after the first
        for before, node in zip(ordered, ordered[1:], strict=False):
            own = matmul_of[node.name].input(0)
            chain = _chain(graph, matmul_of[node.name], node)
            inside = {out for n in chain for out in n.outputs}
            outside = list(dict.fromkeys(v for n in chain for v in n.inputs
                                         if v is not None and v not in inside and v is not own))
            self.blocks.append(_Ahead(by_router[node.name], matmul_of[before.name].input(0), own, node, chain, outside))
        self.needs: list[Any] = list(dict.fromkeys(
            v for b in self.blocks for v in (b.ahead, b.router.outputs[0], *b.outside)))

    def hits(self, values: Mapping[Any, np.ndarray]) -> list[GateHits]:
        """Each predicted block's hits on one run's `values` (of `needs`, by Value; an
        initializer left out is read from its data)."""
        from aviatorc.ir.interpreter import evaluate_nodes

        found = []
        for b in self.blocks:
            given = {v: values[v] for v in b.outside if v in values}
            given[b.own] = values[b.ahead]
            evaluate_nodes(b.chain, given)
            guess = given[b.router.outputs[0]].reshape(-1, b.block.experts) != 0
            actual = values[b.router.outputs[0]].reshape(-1, b.block.experts) != 0
            found.append(GateHits(b.block.layer, int((guess & actual).sum()), int(actual.sum()), actual.shape[0],
                                  actual.sum(axis=0)))
        return found


def measure_prediction(graph: Graph, blocks: Sequence[MoEBlock], batches: Sequence[Mapping[str, Any]]
                       ) -> list[PredictionHits]:
    """`PreGating`'s hit rate per block after the first, on `batches` (feed dicts), with the
    chance of a guess of top_k experts drawn by the block's measured shares."""
    from aviatorc.ir.interpreter import evaluate

    gating = PreGating(graph, blocks)
    wanted = [v for v in gating.needs if v.data is None]
    runs: dict[int, list[GateHits]] = {}
    for feeds in batches:
        kept = evaluate(graph, feeds, keep=sorted({v.name for v in wanted}), only_kept=True)
        for run in gating.hits({v: kept[v.name] for v in wanted}):
            runs.setdefault(run.layer, []).append(run)
    found = []
    for layer, of_layer in runs.items():
        shares = np.sum([r.per_expert for r in of_layer], axis=0) / max(1, sum(r.tokens for r in of_layer))
        chance = float((shares * shares).sum() / max(1e-12, shares.sum()))  # a guess of expert e is right with e's share
        found.append(PredictionHits(layer, sum(r.hits for r in of_layer) / max(1, sum(r.routed for r in of_layer)), chance))
    return found


def _chain(graph: Graph, matmul: Any, router: Any) -> list[Any]:
    """The nodes from a router's logits MatMul to the router, in graph order."""
    found = {router}
    stack = [router]
    while stack:
        node = stack.pop()
        if node is matmul:
            continue
        for value in node.inputs:
            if value is not None and value.producer is not None and value.producer not in found \
                    and graph.position(value.producer) >= graph.position(matmul):
                found.add(value.producer)
                stack.append(value.producer)
    return sorted(found, key=graph.position)
