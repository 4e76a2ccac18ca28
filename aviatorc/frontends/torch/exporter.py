"""Running `torch.export` on a module (or an already-traced `torch.fx.GraphModule`).

- Example inputs: a tuple of positional arguments, a dict of keyword arguments, or one tensor.
- Meta device: a module whose parameters live on the meta device exports with meta
  example inputs and imports shape-only.
- Dynamic shapes: passed through to `torch.export` (`torch.export.Dim`); each symbol torch
  creates is named after the `Dim` that made it ("batch", "seq").
- Decompositions: only the ops the conversion table lacks are decomposed to core ATen
  (`ep.run_decompositions` with a table that keeps ours), so `linear`,
  `scaled_dot_product_attention` or `layer_norm` keep their one-node form.
- Errors from torch.export become an `AviatorError` carrying the first line of torch's message.
- A transformers mixture of experts exports through its grouped-matmul experts implementation
  (`_grouped_experts`), the form the MoE lowering recognizes.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from aviatorc.errors import AviatorError, OptionError
from aviatorc.progress import stage

_logger = logging.getLogger("aviatorc.frontends.torch")

if TYPE_CHECKING:
    import torch


def split_inputs(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(args, kwargs) from a tuple, a list, a dict, or a single tensor."""
    import torch

    if example_inputs is None:
        return (), {}
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise OptionError(
        f"example inputs of type {type(example_inputs).__name__} are not supported",
        hint="pass a tuple of positional tensors, a dict of keyword tensors, or one tensor",
    )


def parameter_device(module: torch.nn.Module) -> str:
    """"meta" when any parameter or buffer is on the meta device, else that of the first one."""
    devices = {t.device.type for t in list(module.parameters()) + list(module.buffers())}
    if "meta" in devices:
        return "meta"
    return next(iter(devices)) if devices else "cpu"


def _to_meta(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_to_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_meta(v) for k, v in value.items()}
    return value


@contextlib.contextmanager
def _eval_mode(module: torch.nn.Module) -> Iterator[None]:
    """Export in eval mode (dropout off) and restore the caller's mode afterwards."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


@contextlib.contextmanager
def _no_stack_traces() -> Iterator[None]:
    """Skip recording a Python stack trace per FX node (about 30% of export time for Llama-3-8B);
    the importer names nodes, it never reads their stack traces."""
    import torch.fx

    config = getattr(torch.fx, "config", None)
    if config is None or not hasattr(config, "do_not_emit_stack_traces"):
        yield
        return
    saved = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = saved


@contextlib.contextmanager
def _grouped_experts(module: torch.nn.Module) -> Iterator[None]:
    """Export a transformers mixture of experts through its grouped-matmul experts implementation
    (transformers' default, what `aviatorc.frontends.torch.moe` recognizes): the "eager" one loops
    over the experts a token reaches (data-dependent control flow torch.export cannot trace) and
    "batched_mm" gathers each token's expert weights; all three compute the same function.
    The module's own setting is restored afterwards."""
    found: dict[int, Any] = {}
    for m in module.modules():
        config: Any = getattr(m, "config", None)
        if getattr(config, "_experts_implementation", None) in ("eager", "batched_mm"):
            found[id(config)] = config
    configs = list(found.values())
    experts = any(type(m).__name__.endswith("Experts") and hasattr(m, "has_gate") for m in module.modules())
    if not experts or not configs:
        yield
        return
    saved = [c._experts_implementation for c in configs]
    _logger.info("exporting the experts through transformers' grouped_mm implementation (was %s)", saved[0])
    for config in configs:
        config._experts_implementation = "grouped_mm"
    try:
        yield
    finally:
        for config, value in zip(configs, saved, strict=True):
            config._experts_implementation = value


def export(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *,
           dynamic_shapes: Any = None, meta: bool = False) -> Any:
    """`torch.export.export(module, args, kwargs, strict=False)`, errors made readable."""
    import torch

    if meta:
        args, kwargs = _to_meta(args), _to_meta(kwargs)
    try:
        with stage(_logger, f"exporting {type(module).__name__} with torch.export"), _eval_mode(module), \
                torch.no_grad(), _no_stack_traces(), _grouped_experts(module):
            return torch.export.export(module, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)
    except AviatorError:
        raise
    except Exception as error:  # torch raises many types; the first line says what failed
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise AviatorError(
            f"torch.export failed: {type(error).__name__}: {first}",
            hint="check that the example inputs run the module eagerly; see torch.export's documentation for "
                 "data-dependent control flow",
        ) from error


def decompose_unsupported(ep: Any, supported: frozenset[str]) -> Any:
    """Decompose to core ATen only the ops outside `supported`; returns the new program."""
    import torch

    from aviatorc.frontends.torch.importer import op_key

    table = torch.export.default_decompositions()
    for op in list(table.keys()):
        if op_key(op) in supported:
            del table[op]
    try:
        return ep.run_decompositions(table)
    except Exception as error:  # keep the undecomposed program: its ops are reported instead
        del error
        return ep


def symbol_names(module: torch.nn.Module, ep: Any, args: tuple[Any, ...], dynamic_shapes: Any) -> dict[str, str]:
    """Map torch's symbols ("s72") to the names of the `Dim`s the user gave ("batch")."""
    if dynamic_shapes is None:
        return {}
    specs: dict[str, Any] = {}
    if isinstance(dynamic_shapes, Mapping):
        specs = dict(dynamic_shapes)
    else:
        try:
            params = [p for p in inspect.signature(module.forward).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        except (TypeError, ValueError):
            params = []
        for param, spec in zip(params, dynamic_shapes, strict=False):
            specs[param.name] = spec
    names: dict[str, str] = {}
    user_inputs = set(ep.graph_signature.user_inputs)
    for node in ep.graph.nodes:
        if node.op != "placeholder" or node.name not in user_inputs or node.name not in specs:
            continue
        spec, val = specs[node.name], node.meta.get("val")
        shape = getattr(val, "shape", None)
        if shape is None or spec is None:
            continue
        items = spec.items() if isinstance(spec, Mapping) else enumerate(spec)
        for axis, dim in items:
            name = getattr(dim, "__name__", None)
            expr = getattr(getattr(shape[axis], "node", None), "expr", None)
            if name and expr is not None and expr.is_Symbol:
                names.setdefault(str(expr), name)
    return names
