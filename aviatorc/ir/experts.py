"""Where a mixture-of-experts graph keeps its experts and its routers (`aviatorc.ir.ops.moe`).

Expert e of a block is the subgraph from its `MoEDispatch` (expert=e) up to, not including, its
`MoECombine`: every node reached from the dispatch without passing a combine. Its rows that
matter are the tokens the block's routing sends to e (`routing[..., e] != 0`); the others are
computed (the dense form) and multiplied by 0. Calibration (`aviatorc.quant.sequential`) keeps
an expert's statistics to its routed rows and the accuracy report compares experts on them.

A router's weight is the one of the MatMul computing its logits (through a bias Add, casts and
reshapes): quantization keeps it at FP16, as a wrong routing costs more than its bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from aviatorc.ir.graph import Graph, Node, Value

_THROUGH = ("Cast", "Reshape", "Identity", "Squeeze", "Unsqueeze", "Add")


@dataclass(frozen=True)
class ExpertRef:
    """One expert of one block: the block's routing value and the expert's index."""

    routing: Value
    expert: int

    @property
    def block(self) -> str:
        """The block's name: its router node's."""
        return self.routing.producer.name if self.routing.producer is not None else self.routing.name


def expert_index(node: Node) -> int:
    """The `expert` attribute of a MoEDispatch or MoECombine."""
    expert = node.attrs["expert"]
    assert isinstance(expert, int)  # the verifier checked it against the op's type rule
    return expert


def expert_nodes(graph: Graph) -> dict[Node, ExpertRef]:
    """Every node inside an expert's subgraph, with the expert it belongs to."""
    found: dict[Node, ExpertRef] = {}
    for node in graph.nodes:
        if node.op != "MoEDispatch":
            continue
        ref = ExpertRef(node.input(1), expert_index(node))
        stack = [node]
        while stack:
            current = stack.pop()
            if current in found or current.op == "MoECombine":
                continue
            found[current] = ref
            stack.extend(user for out in current.outputs for user in out.users)
    return found


def expert_combines(graph: Graph) -> list[Node]:
    """The `MoECombine` nodes in graph order: input 1 of each is an expert's output."""
    return [node for node in graph.nodes if node.op == "MoECombine"]


def router_matmuls(graph: Graph) -> list[Node]:
    """The MatMuls computing the routers' logits."""
    found = []
    for node in graph.nodes:
        if node.op != "MoERouter":
            continue
        value: Value | None = node.input(0)
        while value is not None and value.producer is not None and value.producer.op in _THROUGH:
            producer = value.producer
            value = next((v for v in producer.inputs if v is not None and not v.is_initializer), None)
        if value is not None and value.producer is not None and value.producer.op == "MatMul":
            found.append(value.producer)
    return found
