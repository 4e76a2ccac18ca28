"""dce: dead code elimination.

Removes nodes that no graph output depends on, then initializers that nothing reads.
Graph inputs are never removed: they are the model's signature, used or not.

Where it goes: in the cleanup phase at both ends of the pipeline (after the importer,
and after rewrites such as fuse-qkv and quantize that leave old weights behind).
Does not handle: a multi-output node with some dead outputs keeps all of them (the IR
has no way to drop one output of a Split).
"""

from __future__ import annotations

from aviatorc.passes.manager import Pass, PassContext, PassResult, register_pass

from aviatorc.ir import Graph


@register_pass
class DeadCodeElimination(Pass):
    name = "dce"
    summary = "remove nodes and initializers that no graph output depends on"

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        live = {id(v) for v in graph.outputs}
        dead = []
        # Nodes are in topological order, so walking backwards sees every user of a value
        # before its producer: a node is live when any of its outputs is.
        for node in reversed(graph.nodes):
            if any(id(v) in live for v in node.outputs):
                live.update(id(v) for v in node.inputs if v is not None)
            else:
                dead.append(node)
        for node in dead:  # users before producers, so each is unused when removed
            graph.remove_node(node)
        unused = [v for v in graph.initializers.values() if not v.users and v not in graph.outputs]
        for value in unused:
            graph.remove_initializer(value)
        return PassResult(
            changed=bool(dead or unused), stats={"nodes_removed": len(dead), "initializers_removed": len(unused)}
        )
