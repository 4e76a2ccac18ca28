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
probabilities exactly the shares (systematic sampling over a random order of the experts).

Co-activation (which experts a token picks together) comes with a block's `sets`: the
distribution of a token's whole choice, as measured (`measure_routing` keeps the sets of up to
MAX_SET_TOKENS tokens, a uniform sample of them) or given in a file (`"sets": [[[e1, e2], freq],
...]`). A block with sets samples each token's choice from them, and its shares are theirs; two
experts then fire in the same step with `fire_together`, not the product of their chances. Tokens
stay independent of each other. Without sets, a token's experts are independent beyond the shares.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from aviatorc.errors import ModelFormatError, OptionError
from aviatorc.ir import Graph

ROUTING_KINDS = ("uniform", "zipf:S", "FILE.json")
MAX_SET_TOKENS = 4096  # tokens whose expert sets a measured routing keeps per block (a uniform sample)

ExpertSet = tuple[tuple[int, ...], float]  # the experts one token picks, and how often a token picks them


@dataclass(frozen=True)
class BlockRouting:
    """One MoE block's routing: per expert, the probability that a token routes to it; with
    `sets`, the distribution of a token's whole choice (co-activation), whose shares these are."""

    layer: int
    top_k: int
    shares: tuple[float, ...]
    sets: tuple[ExpertSet, ...] = ()

    @staticmethod
    def from_sets(layer: int, top_k: int, experts: int, sets: Sequence[ExpertSet]) -> BlockRouting:
        """A block whose tokens pick `sets` (frequencies normalised to sum to 1), in a canonical
        order (so equal inputs give equal plans)."""
        total = sum(freq for _, freq in sets)
        merged: dict[tuple[int, ...], float] = {}
        for chosen, freq in sets:
            key = tuple(sorted(chosen))
            merged[key] = merged.get(key, 0.0) + freq / total
        shares = np.zeros(experts)
        for chosen, freq in merged.items():
            shares[list(chosen)] += freq
        return BlockRouting(layer, top_k, tuple(float(v) for v in shares), tuple(sorted(merged.items())))

    @property
    def experts(self) -> int:
        return len(self.shares)

    def fires(self, expert: int, tokens: int) -> float:
        """The probability that `expert` runs in a step of `tokens` tokens."""
        return 1.0 - (1.0 - self.shares[expert]) ** tokens

    def pair_share(self, a: int, b: int) -> float:
        """The probability that one token routes to both `a` and `b` (without sets: as if apart)."""
        if not self.sets:
            return self.shares[a] * self.shares[b]
        return float(self._pairs[a, b])

    @cached_property
    def _pairs(self) -> np.ndarray:
        pairs = np.zeros((self.experts, self.experts))
        for chosen, freq in self.sets:
            pairs[np.ix_(chosen, chosen)] += freq
        return pairs

    def fire_together(self, a: int, b: int, tokens: int) -> float:
        """The probability that both `a` and `b` run in a step of `tokens` tokens."""
        neither = max(0.0, 1.0 - self.shares[a] - self.shares[b] + self.pair_share(a, b))
        return max(0.0, 1.0 - (1.0 - self.shares[a]) ** tokens - (1.0 - self.shares[b]) ** tokens + neither ** tokens)

    def expected_active(self, tokens: int) -> float:
        return sum(self.fires(e, tokens) for e in range(self.experts))

    def sample(self, rng: np.random.Generator, tokens: int) -> np.ndarray:
        """Tokens routed to each expert in one step of `tokens` tokens (each token: top_k distinct experts)."""
        shares = np.asarray(self.shares)
        counts = np.zeros(self.experts, dtype=np.int64)
        if self.sets:
            picks = rng.choice(len(self.sets), size=tokens, p=np.asarray([freq for _, freq in self.sets]))
            for pick in picks:
                counts[list(self.sets[pick][0])] += 1
            return counts
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

    def routes(self, layer: int, expert: int) -> bool:
        """Whether `expert` (-1: no expert's weight) of `layer` is routed here; others run on every token."""
        return expert >= 0 and layer in self._by_layer

    def share(self, layer: int, expert: int) -> float:
        """The probability that a token routes to `expert` of `layer` (1 where not `routes`)."""
        return self._by_layer[layer].shares[expert] if self.routes(layer, expert) else 1.0

    def fires(self, layer: int, expert: int, tokens: int) -> float:
        """The probability that a step of `tokens` tokens runs `expert` of `layer` (1 where not `routes`)."""
        return self._by_layer[layer].fires(expert, tokens) if self.routes(layer, expert) else 1.0

    @cached_property
    def _by_layer(self) -> dict[int, BlockRouting]:
        return {b.layer: b for b in self.blocks}

    def to_dict(self) -> dict[str, Any]:
        """The report's form, which `--routing FILE.json` reads back."""
        return {"source": self.source,
                "layers": {str(b.layer): {"top_k": b.top_k, "shares": [round(s, 6) for s in b.shares]}
                           | ({"sets": [[list(chosen), round(freq, 8)] for chosen, freq in b.sets]} if b.sets else {})
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
        if isinstance(entry, dict) and entry.get("sets") is not None:
            found.append(BlockRouting.from_sets(block.layer, block.top_k, block.experts,
                                                _sets(path, block, entry["sets"])))
            continue
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


def _sets(path: Path, block: MoEBlock, raw: Any) -> list[ExpertSet]:
    """A file's expert sets for `block`: [[experts], frequency or count] each, top_k distinct
    experts of the block, a frequency above 0."""
    where = f"{path}: layer {block.layer} sets"
    if not isinstance(raw, list) or not raw:
        raise ModelFormatError(f"{where} must be a non-empty list of [[experts], frequency]")
    out: list[ExpertSet] = []
    for i, item in enumerate(raw):
        ok = isinstance(item, list) and len(item) == 2 and isinstance(item[0], list) and \
            isinstance(item[1], (int, float)) and not isinstance(item[1], bool) and math.isfinite(item[1]) and item[1] > 0
        chosen = item[0] if ok else []
        if not ok or len(chosen) != block.top_k or len(set(map(repr, chosen))) != block.top_k or not all(
                isinstance(e, int) and not isinstance(e, bool) and 0 <= e < block.experts for e in chosen):
            raise ModelFormatError(f"{where}[{i}] must be [[{block.top_k} distinct experts of 0..{block.experts - 1}], "
                                   "a frequency above 0]")
        out.append((tuple(chosen), float(item[1])))
    return out


def measure_routing(graph: Graph, blocks: Sequence[MoEBlock], batches: Sequence[Mapping[str, Any]]) -> Routing:
    """The shares the routers choose on `batches` (feed dicts): each expert's routed tokens over
    all tokens. An expert no token reaches keeps a floor of a hundredth of a uniform share, so it is
    still planned for (and sampled, rarely)."""
    from aviatorc.ir.interpreter import evaluate

    routers = {b.router for b in blocks}
    names = {node.name: node.outputs[0].name for node in graph.nodes if node.name in routers}
    choices: dict[str, list[np.ndarray]] = {b.router: [] for b in blocks}  # per batch, each token's routed mask
    for feeds in batches:
        kept = evaluate(graph, feeds, keep=list(names.values()), only_kept=True)
        for b in blocks:
            choices[b.router].append(kept[names[b.router]].reshape(-1, b.experts) != 0)
    tokens = sum(len(mask) for mask in choices[blocks[0].router])
    keep = np.sort(np.random.default_rng(0).permutation(tokens)[:MAX_SET_TOKENS])  # the tokens whose sets are kept
    found = []
    for b in blocks:
        routed = np.concatenate(choices[b.router])
        floor = 0.01 * b.top_k / b.experts * max(1, tokens)
        if np.any(routed.sum(axis=0) < floor) or np.any(routed.sum(axis=1) != b.top_k):
            # An expert no token reached keeps a floor, so it is still planned for; that is no set of
            # tokens, so such a block keeps its shares alone (as one whose tokens picked fewer experts).
            found.append(BlockRouting(b.layer, b.top_k, capped_shares(np.maximum(routed.sum(axis=0), floor), b.top_k)))
            continue
        picked = [tuple(int(e) for e in np.flatnonzero(row)) for row in routed[keep]]
        found.append(BlockRouting.from_sets(b.layer, b.top_k, b.experts, [(chosen, 1.0) for chosen in picked]))
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
