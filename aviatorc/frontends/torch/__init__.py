"""The PyTorch frontend: `torch.nn.Module` / `torch.fx.GraphModule` through `torch.export`,
and Hugging Face `config.json` files built on the meta device (shape-only).

    graph = import_torch(model, (input_ids,))                 # weights as numpy views
    graph = import_torch(meta_model, {"input_ids": ids})      # meta device: shape-only
    graph = import_hf_config("llama-3-8b/config.json")        # shape-only, symbolic batch/seq

torch and transformers are imported inside functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from aviatorc.errors import OptionError, UnsupportedOpsError

if TYPE_CHECKING:
    import torch

    from aviatorc.ir import Graph

__all__ = ["import_hf_config", "import_program", "import_torch"]


def import_torch(module: torch.nn.Module, example_inputs: Any = None, *, shape_only: bool | None = None,
                 dynamic_shapes: Any = None, name: str | None = None) -> Graph:
    """Import an `nn.Module` or a traced `fx.GraphModule` through `torch.export` into a verified graph.

    example_inputs: a tuple of positional tensors, a dict of keyword tensors, or one tensor.
    shape_only: None decides from the parameters' device (meta -> shape-only); True keeps only
    the weights' types; False requires real weights.
    dynamic_shapes: as `torch.export.export` takes it; symbols get the `Dim`s' names.
    """
    import torch

    from aviatorc.frontends.torch import exporter

    if not isinstance(module, torch.nn.Module):
        raise OptionError(f"cannot import a {type(module).__name__}", hint="pass a torch.nn.Module or fx.GraphModule")
    on_meta = exporter.parameter_device(module) == "meta"
    if shape_only is None:
        shape_only = on_meta
    elif not shape_only and on_meta:
        raise OptionError("the module's parameters are on the meta device, so it has no weights to import",
                          hint="pass shape_only=True (or None), or materialize the weights")
    args, kwargs = exporter.split_inputs(example_inputs)
    if not args and not kwargs and _needs_inputs(module):
        raise OptionError("example inputs are required to export a module through torch.export",
                          hint="pass example_inputs=(tensor, ...) or {'input_ids': tensor}")
    ep = exporter.export(module, args, kwargs, dynamic_shapes=dynamic_shapes, meta=on_meta)
    names = exporter.symbol_names(module, ep, args, dynamic_shapes)
    return import_program(ep, shape_only=shape_only, symbol_names=names,
                          name=name or type(module).__name__)


def import_program(ep: Any, *, shape_only: bool = False, symbol_names: dict[str, str] | None = None,
                   name: str = "main") -> Graph:
    """Lower an `ExportedProgram` to a verified IR graph (decomposing only what we lack); its
    mixture-of-experts blocks become the IR's MoE ops (`aviatorc.frontends.torch.moe`)."""
    from aviatorc.frontends.torch import aten, exporter, moe
    from aviatorc.frontends.torch.importer import lower_program, unconvertible
    from aviatorc.ir import fold_constants, verify

    table = aten.load()
    blocks = moe.find_blocks(ep)
    if unconvertible(ep, table, moe.unsupported_in_blocks(blocks)):
        # the blocks' own ops are kept whole, so the blocks are found again in the new program
        keep = frozenset(table).union(*(block.op_keys for block in blocks))
        ep = exporter.decompose_unsupported(ep, keep)
        blocks = moe.find_blocks(ep)
    missing = unconvertible(ep, table, moe.unsupported_in_blocks(blocks))
    if missing:
        raise UnsupportedOpsError(missing)
    graph = lower_program(ep, table, shape_only=shape_only, symbol_names=symbol_names or {}, name=name,
                          blocks=blocks)
    fold_constants(graph)
    remove_dead_nodes(graph)
    graph.metadata["frontend"] = "torch.export"
    if shape_only:
        graph.metadata["shape_only"] = "true"
    verify(graph)
    return graph


def remove_dead_nodes(graph: Graph) -> int:
    """Drop nodes none of whose outputs reach a graph output; returns how many."""
    removed = 0
    outputs = {id(v) for v in graph.outputs}
    for node in reversed(list(graph.nodes)):
        if any(v.users or id(v) in outputs for v in node.outputs):
            continue
        graph.remove_node(node)
        removed += 1
    for value in list(graph.initializers.values()):
        if not value.users and id(value) not in outputs:
            graph.remove_initializer(value)
    return removed


def _needs_inputs(module: torch.nn.Module) -> bool:
    import inspect

    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)


def import_hf_config(path: str | Path, *, shape_only: bool = True, seq_len: int | str = "seq",
                     batch: int | str = "batch", **options: Any) -> Graph:
    """Import a Hugging Face `config.json` (built on the meta device) shape-only; see `hf.py`."""
    from aviatorc.frontends.torch.hf import import_hf_config as _import

    return _import(path, shape_only=shape_only, seq_len=seq_len, batch=batch, **options)
