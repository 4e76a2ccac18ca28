"""Hugging Face `config.json` -> IR, shape-only, through a model built on the meta device.

The model is constructed with `transformers` under `torch.device("meta")` (no weight bytes
are allocated), exported with `torch.export` on meta `input_ids`, and imported shape-only:
a 70B-parameter model is planned in about half a gigabyte of memory.

Batch and sequence length are symbolic by default (`torch.export.Dim("batch")`,
`Dim("seq")`, which torch.export handles on the meta device); pass ints for static sizes.
The config is validated first (`aviatorc.frontends.hf_config`): a strict JSON read, the
shape fields' types, ranges and divisibility, and `architectures[0]` from an allow-list
(the model type's causal-LM or base model class); without `architectures`, `AutoModel`
for encoder-only model types (BERT), else `AutoModelForCausalLM`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from aviatorc.errors import AviatorError, OptionError
from aviatorc.frontends import hf_config

if TYPE_CHECKING:
    import torch

    from aviatorc.ir import Graph

# Example sizes for symbolic dims: distinct from each other and from every static dim
# a model is likely to have, so torch.export does not unify them (sizes 0 and 1 are
# specialized by torch.export, so neither may be 1).
# Encoder-only model types: without `architectures`, these import as the bare encoder
# (AutoModel), not as the causal-LM head transformers can bolt onto some of them.
ENCODERS = frozenset({"bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2",
                      "mpnet", "camembert", "ernie", "modernbert"})

EXAMPLE_BATCH = 2
EXAMPLE_SEQ = 7


def load_config(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """The config.json path (a folder may be given) and its parsed, field-checked contents."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    config = hf_config.read_config(path)
    try:
        hf_config.check_fields(config)
    except AviatorError as error:
        raise error.with_file(str(path)) from None
    return path, config


def build_meta_model(config: dict[str, Any], *, on_meta: bool = True, seed: int = 0) -> torch.nn.Module:
    """The `transformers` model for `config`, on the meta device (no weights) unless `on_meta` is False.

    `config` must have passed `hf_config.check_fields` (as `load_config` does)."""
    import torch
    import transformers

    hf_config.check_fields(config)
    cfg, model_class = hf_config.check_with_transformers(config)

    def build(attention: str) -> torch.nn.Module:
        cfg._attn_implementation = attention
        with torch.device("meta") if on_meta else _seeded(seed):
            if model_class is not None:
                return model_class(cfg)  # type: ignore[no-any-return]
            if config["model_type"] in ENCODERS:
                return transformers.AutoModel.from_config(cfg)
            try:
                return transformers.AutoModelForCausalLM.from_config(cfg)
            except ValueError as error:
                if _refuses(error, attention):
                    raise
                return transformers.AutoModel.from_config(cfg)

    try:
        model = build("sdpa")  # one aten.scaled_dot_product_attention per layer
    except ValueError as error:
        if not _refuses(error, "sdpa"):
            raise
        # gpt-oss (attention sinks) and Gemma-2 (soft-capping) refuse SDPA: their eager attention
        # is plain matmuls, masks and a softmax, which import as they are.
        model = build("eager")
    hf_config.check_built(model)
    return model.eval()


def _refuses(error: ValueError, attention: str) -> bool:
    """Whether transformers refused the attention implementation (not some other config value)."""
    names = {"sdpa": "scaled_dot_product_attention"}
    return "does not support an attention implementation" in str(error) and names.get(attention, attention) in str(error)


def _seeded(seed: int) -> Any:
    import contextlib

    import torch

    torch.manual_seed(seed)
    return contextlib.nullcontext()


def import_hf_config(path: str | Path, *, shape_only: bool = True, seq_len: int | str = "seq",
                     batch: int | str = "batch", max_seq_len: int | None = None) -> Graph:
    """Import `config.json` (or a folder holding one) as a graph over `input_ids` [batch, seq].

    seq_len / batch: an int for a static size, a str to name a symbolic dim.
    shape_only=False builds the model with seeded random weights on the CPU instead (for
    small configs: tests that run the graph).
    """
    path, config = load_config(path)  # before torch is imported: a refusal here is quick
    import torch

    from aviatorc.frontends.torch import exporter, import_program

    for label, size in (("batch", batch), ("seq_len", seq_len)):
        if not isinstance(size, (int, str)) or isinstance(size, bool) or (isinstance(size, int) and size < 1):
            raise OptionError(f"{label} must be a positive int or a dim name, got {size!r}")
    try:
        model = build_meta_model(config, on_meta=shape_only)
    except AviatorError as error:
        raise error.with_file(str(path)) from None
    hf_config.warn_defaulted_sizes(config, model, str(path))
    device = "meta" if shape_only else "cpu"
    batch_n = batch if isinstance(batch, int) else EXAMPLE_BATCH
    seq_n = seq_len if isinstance(seq_len, int) else EXAMPLE_SEQ
    input_ids = torch.zeros((batch_n, seq_n), dtype=torch.int64, device=device)
    kwargs: dict[str, Any] = {"input_ids": input_ids, "use_cache": False}
    dims: dict[int, Any] = {}
    if isinstance(batch, str):
        dims[0] = torch.export.Dim(batch)
    if isinstance(seq_len, str):
        limit = max_seq_len or config.get("max_position_embeddings") or config.get("n_positions")
        dims[1] = torch.export.Dim(seq_len, max=int(limit)) if limit else torch.export.Dim(seq_len)
    dynamic = {"input_ids": dims or None, "use_cache": None} if dims else None
    try:
        ep = exporter.export(model, (), kwargs, dynamic_shapes=dynamic)
        names = exporter.symbol_names(model, ep, (), dynamic)
        graph = import_program(ep, shape_only=shape_only, symbol_names=names, name=type(model).__name__)
    except AviatorError as error:
        error.with_file(str(path))
        raise
    graph.metadata["source"] = path.name
    graph.metadata["architecture"] = type(model).__name__
    record_model_facts(graph, model.config)
    return graph


def record_model_facts(graph: Graph, config: Any, eos_token_id: Any = None) -> None:
    """What the weights alone do not say, kept in the graph's metadata (and so in the artifact's
    graph.ir): the positions the model was trained for (`aviatorc.workload` bounds the context
    with it) and its end-of-sequence ids (`Session.generate` stops at them; `eos_token_id`, when
    given, names them instead of the config: a generation config's list)."""
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if isinstance(positions, int) and positions > 0:
        graph.metadata["max_position_embeddings"] = str(positions)
    eos = eos_token_id if eos_token_id is not None else getattr(config, "eos_token_id", None)
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    if ids and all(isinstance(i, int) and i >= 0 for i in ids):
        graph.metadata["eos_token_id"] = ",".join(str(i) for i in ids)
