"""The models a server holds: each artifact with its session, tokenizer, engine and metrics.

    models = load_models([ModelSpec("build/a.avc"), ModelSpec("build/b.avc", tokenizer="tok/")])

Several artifacts are served at once only as isolated tenants: each compiled onto its own
chiplets of the same target (`aviatorc compile --chiplets`), so no SRAM is shared. Artifacts whose
chiplet sets overlap, or that were compiled for different targets, are refused here, before the
server listens. Each tenant has its own `Session` and `Engine`: its own KV slots, queue and
scheduler task, so one tenant's load cannot change another's outputs.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aviatorc.errors import AviatorError, OptionError
from aviatorc.runtime import NotRunnableError, Session
from aviatorc.runtime.cache import static_reason
from aviatorc.serve.engine import Engine
from aviatorc.serve.metrics import Metrics, Registry


@dataclass(frozen=True)
class ModelSpec:
    artifact: str
    name: str | None = None  # default: the artifact folder's name without its suffix
    tokenizer: str | None = None  # a tokenizer folder or a .gguf file


@dataclass(frozen=True)
class EngineOptions:
    max_num_seqs: int | None = None
    policy: str = "fcfs"
    max_queue: int = 256
    request_timeout_s: float | None = None
    draft: str | None = None  # a draft artifact for speculative decoding (the first model only)
    # "draft" (needs `draft`), "ngram", or "self" (the target's INT4 plan: `draft`, else compiled at start);
    # None: "draft" if a draft is given
    speculative_method: str | None = None
    num_speculative_tokens: int = 4
    keep_speculating: bool = False  # speculate whatever it costs on this machine (no time rule)
    prefix_cache_tokens: int | None = 0  # prefix caching: 0 off; N tokens kept at most; None the whole pool
    max_num_batched_tokens: int | None = None  # chunked prefill: tokens a turn computes (decodes + prompt chunks)
    loras: tuple[tuple[str, str], ...] = ()  # (name, PEFT folder) of LoRA adapters beside the first model
    enable_lora: bool = False  # the first model runs adapters, loaded at start (`loras`) or later over HTTP
    swap_bytes: int = 4 << 30  # host memory for preempted sequences' KV caches (--swap-space)
    kv_blocks: int | None = None  # the KV pool's blocks (None: the plan's KV memory)
    block_size: int = 16  # tokens per KV block
    kv_dtype: str | None = None  # how the KV blocks store their values: "fp16" or "int8" (None: the plan's)

    @property
    def method(self) -> str | None:
        method = self.speculative_method or ("draft" if self.draft is not None else None)
        if method == "draft" and self.draft is None:
            raise OptionError("--speculative-method draft needs a draft model", hint="pass --draft ARTIFACT")
        if method == "ngram" and self.draft is not None:
            raise OptionError("n-gram speculation uses no draft model", hint="drop --draft, or use --speculative-method draft")
        return method


@dataclass
class ServedModel:
    name: str
    session: Session
    tokenizer: Any | None
    engine: Engine
    metrics: Metrics
    chiplets: frozenset[int]
    created: int  # the artifact's mtime, for /v1/models
    grammars: Any = None  # `aviatorc.serve.structured.Grammars`, made at the first structured request


def load_models(specs: list[ModelSpec], options: EngineOptions, registry: Registry) -> dict[str, ServedModel]:
    """Open every artifact (each must be able to generate), check that the tenants are isolated."""
    from aviatorc.runtime.text import load_tokenizer, source_tokenizer
    from aviatorc.serve.prefix import PrefixCache
    from aviatorc.serve.speculative import (
        SELF_DRAFT_QUANT,
        DraftModel,
        NgramDrafts,
        Speculator,
        compile_self_draft,
        same_model,
    )

    if not specs:
        raise OptionError("no artifact to serve", hint="aviatorc serve ARTIFACT [ARTIFACT...]")
    models: dict[str, ServedModel] = {}
    targets: dict[str, str] = {}
    drafts_chiplets: frozenset[int] = frozenset()
    draft_file = ""
    for index, spec in enumerate(specs):
        session = Session(spec.artifact, lora=index == 0 and (options.enable_lora or bool(options.loras)),
                          kv_blocks=options.kv_blocks, block_size=options.block_size, max_seqs=options.max_num_seqs,
                          kv_dtype=options.kv_dtype)
        if session.cache is None:
            raise NotRunnableError(f"this model cannot generate: {static_reason(session.graph)}", file=spec.artifact,
                                   hint="serve a decoder compiled with its KV cache")
        name = spec.name or Path(spec.artifact).resolve().name.removesuffix(".avc")
        if name in models:
            raise OptionError(f"two models are named '{name}'", hint="name them with --served-model-name")
        chiplets = frozenset(session.artifact.plan.chiplets)
        target = session.artifact.plan.target_name
        for other in models.values():
            if targets[other.name] != target:
                raise OptionError(f"'{name}' was compiled for target '{target}' but '{other.name}' for "
                                  f"'{targets[other.name]}'", file=spec.artifact,
                                  hint="tenants share one machine: compile them for the same target")
            shared = sorted(chiplets & other.chiplets)
            if shared:
                raise OptionError(f"'{name}' and '{other.name}' both use chiplets {_ranges(shared)}: tenants must not "
                                  "share SRAM", file=spec.artifact,
                                  hint="compile each onto its own chiplets with --chiplets")
        metrics = registry.model(name)
        speculator = None
        if options.method == "ngram" and index == 0:
            speculator = Speculator(session, NgramDrafts(), options.num_speculative_tokens, metrics,
                                    by_time=not options.keep_speculating)
        if options.method in ("draft", "self") and index == 0:
            # The draft holds the target's sequences, each up to the whole context: it shares no
            # prefix blocks, so it must never run out where the target does not (its pool's pages
            # cost host memory only once written).
            assert session.kv is not None
            draft = Session(options.draft or compile_self_draft(session, _scratch() / "self-draft.avc"),
                            kv_blocks=session.num_slots * session.kv.blocks_for(session.context),
                            block_size=session.kv.block_size, max_seqs=session.num_slots)
            draft_file = str(draft.artifact.path)
            if options.method == "self" and not same_model(draft, session):
                raise OptionError(f"the self draft must be '{name}' compiled again (at {SELF_DRAFT_QUANT}), but it "
                                  "was compiled from another model", file=draft_file,
                                  hint="pass --speculative-method draft for a different draft model")
            if draft.artifact.plan.target_name != target:
                raise OptionError(f"the draft was compiled for target '{draft.artifact.plan.target_name}' but "
                                  f"'{name}' for '{target}'", file=draft_file, hint="compile both for one target")
            speculator = Speculator(session, DraftModel(draft, session), options.num_speculative_tokens, metrics,
                                    by_time=not options.keep_speculating)
            drafts_chiplets = frozenset(draft.artifact.plan.chiplets)
        if session.kv_window and (speculator or options.prefix_cache_tokens != 0):
            raise OptionError(f"'{name}' keeps a bounded KV cache (--kv-recent {session.kv_window.recent}), but "
                              "speculative decoding and prefix caching need every position of a sequence",
                              file=spec.artifact, hint="serve it without --speculative-method and "
                              "--enable-prefix-caching, or compile it without --kv-recent")
        try:
            prefix_cache = None if options.prefix_cache_tokens == 0 else PrefixCache(
                session, capacity_tokens=options.prefix_cache_tokens)
            engine = Engine(session, max_num_seqs=options.max_num_seqs, policy=options.policy,
                            max_queue=options.max_queue, request_timeout_s=options.request_timeout_s,
                            observer=metrics, speculator=speculator, prefix_cache=prefix_cache,
                            max_num_batched_tokens=options.max_num_batched_tokens, swap_bytes=options.swap_bytes)
        except AviatorError as error:
            raise error.with_file(spec.artifact) from None
        # Given, else the artifact's source's own (a GGUF file carries its tokenizer and chat template).
        source = spec.tokenizer or source_tokenizer(session.graph)
        tokenizer = load_tokenizer(source) if source else None
        created = int(Path(spec.artifact).stat().st_mtime)
        models[name] = ServedModel(name, session, tokenizer, engine, metrics, chiplets, created)
        targets[name] = target
    base = next(iter(models.values()))
    for adapter, path in options.loras:
        if adapter in models:
            raise OptionError(f"the adapter name '{adapter}' is a model's", hint="name the adapter otherwise")
        try:
            base.session.load_adapter(adapter, path)
        except AviatorError as error:
            raise error.with_file(path) from None
    if drafts_chiplets:  # the draft shares its target's chiplets (they take turns), no one else's
        first = next(iter(models))
        for other in list(models.values())[1:]:
            shared = sorted(drafts_chiplets & other.chiplets)
            if shared:
                raise OptionError(f"the draft of '{first}' and '{other.name}' both use chiplets {_ranges(shared)}: "
                                  "tenants must not share SRAM", file=draft_file,
                                  hint="compile the draft onto its target's chiplets with --chiplets")
    return models


def _scratch() -> Path:
    """A folder for what the server makes for itself (a self draft), removed when it exits."""
    folder = Path(tempfile.mkdtemp(prefix="aviatorc-serve-"))
    atexit.register(shutil.rmtree, folder, True)
    return folder


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    groups: list[list[int]] = []
    for i in ids:
        if groups and i == groups[-1][1] + 1:
            groups[-1][1] = i
        else:
            groups.append([i, i])
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in groups)
