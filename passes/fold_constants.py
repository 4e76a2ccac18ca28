"""fold-constants: evaluate nodes whose inputs are all known constants.

A thin pass over `aviatorc.ir.fold.fold_constants`: nodes whose inputs are small in-memory
constants are evaluated with the op's reference kernel and replaced by a constant, and
`Shape`/`Size` of statically shaped values become constants, so the shape subgraphs of
static exports collapse. Constants left unused are dropped.

Where it goes: in the cleanup phase, before fusions that match on constant operands
(a bias or a Split's sizes must be a constant to be recognized).
Does not handle: results over `FOLD_MAX_ELEMENTS` elements stay as nodes (folding must
not bloat the weights), and nodes reading lazily loaded or shape-only weights are left
alone (folding must not load a model's weights).
"""

from __future__ import annotations

from aviatorc.passes.manager import Pass, PassContext, PassResult, register_pass

from aviatorc.ir import Graph, fold_constants


@register_pass
class FoldConstants(Pass):
    name = "fold-constants"
    summary = "evaluate nodes whose inputs are all constants; fold shapes of static values"

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        initializers_before = len(graph.initializers)
        folded = fold_constants(graph)
        # fold_constants also drops unused in-memory constants, which is a change too.
        changed = folded > 0 or len(graph.initializers) != initializers_before
        return PassResult(changed=changed, stats={"nodes_folded": folded})
