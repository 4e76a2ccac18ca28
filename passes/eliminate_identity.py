"""eliminate-identity: remove nodes that return their input unchanged.

`Identity(x)`, and `Cast(x)` to the type `x` already has, are replaced by `x` in every
use. Exporters leave both behind (ONNX `Identity` for renamed outputs, a `Cast` to the
same dtype from autocast regions).

Where it goes: first in the cleanup phase, so fusions see producers and users directly.
Does not handle: a node whose output is a graph output is kept, because removing it would
rename the graph output (the IR has no rename, and outputs are the model's signature).
"""

from __future__ import annotations

from aviatorc.passes.manager import Pass, PassContext, PassResult, register_pass

from aviatorc.ir import Graph, Node


def is_identity(node: Node) -> bool:
    """Whether `node` returns its (single) input unchanged."""
    if node.op == "Identity":
        return True
    if node.op == "Cast":
        source = node.inputs[0]
        return source is not None and source.type.dtype == node.outputs[0].type.dtype
    return False


@register_pass
class EliminateIdentity(Pass):
    name = "eliminate-identity"
    summary = "remove Identity nodes and Casts to the same type"

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        removed = 0
        for node in list(graph.nodes):
            if not is_identity(node):
                continue
            source, result = node.input(0), node.outputs[0]
            if result in graph.outputs:
                continue
            graph.replace_all_uses(result, source)
            graph.remove_node(node)
            removed += 1
        return PassResult(changed=removed > 0, stats={"nodes_removed": removed})
