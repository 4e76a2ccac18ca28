"""`Session`: run a compiled plan on its inputs and get the model's outputs.

    session = aviatorc.Session("build/model.avc")          # a path, an Artifact or a CompileResult
    outputs = session.run({"input_ids": ids, "attention_mask": mask})
    session.stats.wall_s, session.stats.predicted_prefill_s, session.stats.instructions

A session opens the artifact once (`aviatorc.load` checks its hashes and references), reads
its target and graph, and builds the device's backend. `run` checks the feeds against the
graph's inputs (names, dtypes, shapes: the plan was compiled for the graph's own shapes) and
executes the plan's `prefill` program, which processes the whole prompt the graph was built
for. Weight tiles are read and dequantized on first use and kept for the session.

Decoder graphs that carry their KV cache (`aviatorc.runtime.cache`) also generate:

    tokens = session.generate(prompt_ids, max_new_tokens=32)            # greedy, as transformers
    logits = session.prefill(slot, prompt_ids); logits = session.decode([slot], [token]); session.free(slot)

`generate` runs the prompt through the `prefill` program (an empty past) and each new token
through the `decode` program, feeding the cache each step returns to the next. The step API
holds up to `num_slots` sequences (`max_seqs`, by default the batch the plan was compiled for),
each at most the plan's context long; the serving stack drives it. Their caches live in one
pool of KV blocks (`aviatorc.runtime.paged`: `kv_blocks` blocks of `block_size` tokens, by
default the plan's KV memory), each sequence holding a table of the blocks it fills, so how many
sequences fit depends on their lengths, not on the context (`OutOfBlocks` when the pool is
spent; `blocks_needed` says what a step will take). `decode` runs the slots it is given as one
batched step when the graph's batch is symbolic (the compiler's own step graphs,
`aviatorc.zoo.export_decode_onnx`), at most the plan's batch at a time (`step_batch`): the
shorter caches are padded to the longest, masked out by attention_mask, and each slot gets its
own position ids. A batch-1 graph steps slot by slot. `prefill` runs one slot at a time.

Devices: `sim` (`aviatorc.backends.sim`, the instruction streams on the CPU, checking every
rule of the plan on each program's first run, replaying its computations after; `replay=False`
checks every run); `cuda` (`aviatorc.backends.cuda`: the same streams with the weight
reads on a GPU, loads on a copy stream; its copy, compute and overlap figures in `stats.extra["cuda"]`).
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from aviatorc.backends.contract import (
    DEVICES,
    Backend,
    BlockRun,
    Precedence,
    WeightStore,
    backend_class,
    open_cluster,
)
from aviatorc.errors import OptionError
from aviatorc.ir import Graph
from aviatorc.ir.types import format_shape, numpy_dtype
from aviatorc.plan.artifact import Artifact, load
from aviatorc.plan.plan import kv_pool_blocks
from aviatorc.runtime.cache import CacheLayout, find_cache, static_reason
from aviatorc.runtime.errors import NotRunnableError, RuntimeInputError
from aviatorc.runtime.lora import Adapters
from aviatorc.runtime.paged import CacheSpec, KVPool
from aviatorc.runtime.sampling import check_sampling, sample
from aviatorc.target import Target

RUN_PHASE = "prefill"  # a run processes the graph's whole prompt: the prefill program
PIECE_TOKENS = 256  # a long prompt runs through the graph this many tokens a step (`_pieces`)
PADDING_LIMIT = 512  # cache positions a batched step pads its shorter sequences with, at most (`_length_groups`)
BLOCK_SIZE = 16  # tokens per KV block, as vLLM's default


@dataclass
class _Sequence:
    """One sequence being generated: the table of its KV blocks in the session's pool, the
    positions it holds, and the tokens it has seen (more than it holds once a bounded cache has
    evicted some: its next position id)."""

    table: list[int]
    length: int
    seen: int
    adapter: str | None = None  # the LoRA adapter it runs with (None: the base alone)

    @property
    def evicted(self) -> bool:
        return self.seen != self.length


@runtime_checkable
class SavesArtifact(Protocol):
    """What `aviatorc.compile` returns, as far as a session needs it: it writes its artifact."""

    def save(self, path: str | os.PathLike[str]) -> Path: ...


@dataclass
class RunStats:
    """The last run: what it executed, what it took, and what the plan predicts for the machine."""

    phase: str
    wall_s: float  # this process, on the CPU: not a prediction of the accelerator
    instructions: dict[str, int]  # executed, by op
    bytes_loaded: int  # LPDDR -> SRAM, as the program's loads declare
    bytes_sent: int  # over the links, as the program's sends declare
    peak_sram_bytes: dict[int, int]  # per chiplet: held buffers plus the most staging live at once
    sram_bytes: int  # each chiplet's capacity
    predicted_prefill_s: float  # `aviatorc.schedule.simulate` of the prefill program (one chunk)
    predicted_decode_s: float  # the same of the decode step
    tile_bytes_read: int = 0  # stored tile bytes read from the artifact so far this session
    extra: dict[str, Any] = field(default_factory=dict)
    experts: tuple[BlockRun, ...] = ()  # a mixture of experts: each block's experts that ran


@dataclass
class ExpertTally:
    """A phase's MoE blocks over a session's runs: the experts that ran (those some token was
    routed to; the others' instructions and loads are skipped) and how well pre-gating named
    the routed ones one block ahead (`aviatorc.routing.PreGating`), as a runtime prefetching
    by it would have hit."""

    runs: int = 0
    blocks: int = 0  # blocks over all runs
    ran: int = 0  # experts that ran, over all blocks and runs
    experts: int = 0  # experts there were, the same
    routed: int = 0  # (token, expert) pairs routed in the predicted blocks
    hits: int = 0  # of those, the pairs pre-gating named

    def add(self, blocks: Sequence[BlockRun]) -> None:
        self.runs += 1
        for block in blocks:
            self.blocks += 1
            self.ran += block.ran
            self.experts += block.experts
            if block.predicted is not None:
                self.routed += block.routed
                self.hits += block.predicted

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.routed if self.routed else None


class Session:
    """A compiled plan ready to run. `source`: an artifact path, an `Artifact`, or a
    `CompileResult` (saved to a temporary artifact first: one loading path for all three)."""

    def __init__(self, source: str | os.PathLike[str] | Artifact | SavesArtifact, device: str = "sim", *,
                 world: int = 1, timeout_s: float = 60.0, replay: bool = True, lora: bool = False,
                 kv_blocks: int | None = None, block_size: int = BLOCK_SIZE, max_seqs: int | None = None,
                 kv_dtype: str | None = None) -> None:
        if device not in DEVICES:
            raise OptionError(f"unknown device '{device}'", hint=f"choose one of {', '.join(DEVICES)}")
        if world < 1:
            raise OptionError(f"world must be >= 1, not {world}")
        if world > 1 and device != "sim":
            raise NotRunnableError(f"multi-card runs (world={world}) on device '{device}' are not implemented yet",
                                   hint="use device='sim'")
        self._cluster: Any = None
        self._scratch: tempfile.TemporaryDirectory[str] | None = None
        self.artifact = self._open(source)
        if self.artifact.shape_only:
            raise NotRunnableError("compiled shape-only: no weights to run", file=str(self.artifact.path),
                                   hint="compile from a model with its weights")
        if RUN_PHASE not in self.artifact.programs:
            raise NotRunnableError(f"the plan has no {RUN_PHASE} program", file=str(self.artifact.path))
        self.device = device
        self.graph: Graph = self.artifact.graph()
        self.target: Target = self.artifact.target()  # from the bytes load() hashed, not the file again
        self.program = self.artifact.programs[RUN_PHASE]
        self.weights = WeightStore(self.artifact, self.graph)
        self.cache: CacheLayout | None = find_cache(self.graph)
        # A bounded cache (`--kv-recent`, StreamingLLM's sinks and recent window; see `_evict`):
        # position ids go on counting the tokens a sequence has seen.
        self.kv_window = self.artifact.plan.memory.kv_window
        if self.kv_window and self.cache is not None and not self.cache.position_ids:
            raise NotRunnableError("the plan keeps a bounded KV cache (--kv-recent), but this graph takes no "
                                   "position_ids, so evicting positions would move the ones after them",
                                   file=str(self.artifact.path), hint="compile without --kv-recent")
        backend = backend_class(device)  # CudaBackend refuses to build without a GPU (NotRunnableError)
        # Every program's backend now: one whose held buffers overflow the SRAM is refused here.
        self._backends: dict[str, Backend] = {
            phase: backend(program, self.graph, self.weights, sram_bytes=self.target.chiplet.sram_bytes, replay=replay)
            for phase, program in sorted(self.artifact.programs.items())}
        self.precedence = Precedence()  # `with session.precedence.first():` pauses this session's other steps
        link_dtype = self.artifact.plan.memory.link_dtype
        if link_dtype != "fp16" and device != "sim":
            raise NotRunnableError(f"the plan sends activations between chiplets as {link_dtype} (--link-dtype), "
                                   f"which only the sim backend rounds so", file=str(self.artifact.path),
                                   hint="run it with device='sim', or compile without --link-dtype")
        for phase_backend in self._backends.values():
            phase_backend.precedence = self.precedence
            phase_backend.link_dtype = link_dtype
        if world > 1:  # one rank per card: this process drives, the others run their cards' streams
            self._cluster = open_cluster(self.artifact, self.graph, self.target, self.weights, world, timeout_s=timeout_s)
            self._backends = {phase: self._cluster.backend(phase) for phase in self._backends}
        self._backend = self._backends[RUN_PHASE]
        # LoRA adapters beside the base (`aviatorc.runtime.lora`): `load_adapter`, then a slot's prefill names one.
        self.adapters: Adapters | None = None
        if lora:
            if device != "sim" or world > 1:
                raise NotRunnableError("LoRA adapters run on the sim backend of one card only",
                                       hint="Session(artifact, lora=True) without device or world")
            stored = self.artifact.plan.workload
            self.adapters = Adapters(self.graph, max_rank=stored.lora_rank, max_loras=stored.max_loras)
            for phase_backend in self._backends.values():
                phase_backend.lora = self.adapters
        self._predicted: dict[str, float] | None = None
        self.stats: RunStats | None = None
        self.experts: dict[str, ExpertTally] = {}  # by phase, since the session started
        # "int8": the cache is kept as int8 codes and fp16 scales per head and token, as the plan's
        # prediction counts it; else in the graph's own dtype. Either way in blocks (`KVPool`).
        # `kv_dtype` overrides the plan's (a server's --kv-dtype): the prediction still counts the plan's.
        if kv_dtype not in (None, "fp16", "int8"):
            raise OptionError(f"unknown KV cache type '{kv_dtype}'", hint="choose fp16 or int8")
        self.kv_dtype = kv_dtype or self.artifact.plan.memory.kv_dtype
        if max_seqs is not None and max_seqs < 1:
            raise OptionError(f"max_seqs must be >= 1, not {max_seqs}")
        self.max_seqs = max_seqs or self.program.workload.batch
        self.kv: KVPool | None = self._pool(kv_blocks, block_size) if self.cache is not None else None
        self._slots: dict[int, _Sequence] = {}

    def close(self) -> None:
        """Stop the ranks of a multi-card session (a no-op otherwise); the session cannot run after."""
        if self._cluster is not None:
            self._cluster.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run_trace(self, path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
        """The last multi-card run as measured: a Perfetto process per rank, a track per chiplet, and
        the messages and bytes per chiplet-to-chiplet edge in its metadata."""
        from aviatorc.plan.artifact import to_json_bytes, write_file_atomically

        if self._cluster is None or not self._cluster.last:
            raise OptionError("run_trace needs a multi-card session (world > 1) that has run",
                              hint="Session(artifact, world=N).run(feeds) first; trace() gives the simulated timeline")
        trace = self._cluster.trace()
        if path is not None:
            write_file_atomically(Path(path), to_json_bytes(trace))
        return trace

    def _open(self, source: str | os.PathLike[str] | Artifact | SavesArtifact) -> Artifact:
        if isinstance(source, Artifact):
            return source
        if isinstance(source, (str, os.PathLike)):
            return load(source)
        if isinstance(source, SavesArtifact):
            self._scratch = tempfile.TemporaryDirectory(prefix="aviatorc-session-")
            return load(source.save(Path(self._scratch.name) / "model.avc"))
        raise OptionError(f"a Session runs an artifact path, an Artifact or a CompileResult, not {type(source).__name__}")

    # -- the model's interface -----------------------------------------------------------

    @property
    def input_names(self) -> list[str]:
        return [v.name for v in self.graph.inputs]

    @property
    def output_names(self) -> list[str]:
        return [v.name for v in self.graph.outputs]

    def run(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """The graph's outputs by name for `feeds` (input name -> array of the input's dtype and
        shape). Raises `RuntimeInputError` for bad feeds and `RuntimeFault` when the plan breaks
        a rule; either way nothing half-run is returned."""
        return self._execute(self._check_feeds(feeds), RUN_PHASE)

    def _execute(self, arrays: dict[str, np.ndarray], phase: str,
                 adapters: Sequence[str | None] = ()) -> dict[str, np.ndarray]:
        """Run `phase`'s program; `adapters`: the LoRA adapter of each sequence of the batch."""
        start = time.perf_counter()
        with self.adapters.running(adapters) if self.adapters is not None else contextlib.nullcontext():
            outputs, counts = self._backends[phase].run(arrays)
        wall_s = time.perf_counter() - start
        predicted = self._predictions()
        self.stats = RunStats(phase, wall_s, counts.instructions, counts.bytes_loaded, counts.bytes_sent,
                              counts.peak_sram_bytes, self.target.chiplet.sram_bytes, predicted.get("prefill", 0.0),
                              predicted.get("decode", 0.0), self.weights.tile_bytes_read, dict(counts.extra),
                              counts.experts)
        if counts.experts:
            self.experts.setdefault(phase, ExpertTally()).add(counts.experts)
        return outputs

    # -- generation ----------------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        """Sequences the step API holds at once (`max_seqs`; by default the plan's batch). Their
        caches share the pool of KV blocks, so how many fit depends on their lengths."""
        return self.max_seqs

    @property
    def step_batch(self) -> int:
        """The most sequences one step runs: the batch the plan was compiled for."""
        return self.program.workload.batch

    @property
    def context(self) -> int:
        """The most tokens (prompt and generated) one sequence may hold: the plan's context."""
        return self.artifact.programs[RUN_PHASE].workload.context

    def prefill(self, slot: int, ids: Any, *, adapter: str | None = None) -> np.ndarray:
        """Start sequence `slot` with prompt `ids` (1-D token ids); the logits after its last token.
        `adapter`: a loaded LoRA adapter the sequence runs with from then on (`load_adapter`)."""
        if not 0 <= slot < self.num_slots:
            raise OptionError(f"slot {slot} is out of range: the session holds {self.num_slots} sequences "
                              f"(0..{self.num_slots - 1})", hint="compile with a larger --batch, or open the "
                              "session with a larger max_seqs (aviatorc serve --max-num-seqs)")
        if slot in self._slots:
            raise OptionError(f"slot {slot} is in use", hint="free it first")
        return self._start(slot, _Sequence([], length=0, seen=0, adapter=self._adapter(adapter)), ids)

    def _start(self, slot: int, sequence: _Sequence, ids: Any) -> np.ndarray:
        """Run a new sequence's prompt; it takes `slot` if that succeeds, else its blocks go back."""
        try:
            logits = self._step(sequence, self._prompt(ids), "prefill")
        except BaseException:
            self._kv().release(sequence.table)
            raise
        self._slots[slot] = sequence
        return logits

    def decode(self, slots: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """Append `tokens[i]` to sequence `slots[i]`; the next logits, one row per slot.

        A graph with a symbolic batch runs the slots as one step (`_batched_step`), or one per group
        of similar lengths where padding the short caches to the longest would cost more than a
        step (`_length_groups`); a batch-1 graph, one step per slot."""
        if len(slots) != len(tokens):
            raise OptionError(f"decode got {len(slots)} slots and {len(tokens)} tokens")
        if len(set(slots)) != len(slots):
            raise OptionError(f"decode got a slot twice: {list(slots)}", hint="give each running slot once per step")
        for slot in slots:
            if slot not in self._slots:
                raise OptionError(f"slot {slot} holds no sequence", hint="prefill it first")
        sequences = [self._slots[slot] for slot in slots]
        ids = np.array(tokens, dtype=np.int64)[:, None]
        if len(sequences) > 1 and self._batches(sequences):
            return self._grouped_step(sequences, ids, "decode")
        return np.stack([self._step(sequence, row[None, :], "decode") for sequence, row in zip(sequences, ids)])

    def free(self, slot: int) -> None:
        """Release slot `slot` and its cache's blocks (a no-op for a free slot)."""
        sequence = self._slots.pop(slot, None)
        if sequence is not None:
            self._kv().release(sequence.table)

    def prefix(self, slot: int, start: int, stop: int) -> dict[str, np.ndarray]:
        """Copies of positions [start, stop) of sequence `slot`'s cache, by cache input (prefix
        caching keeps them to start another sequence with `resume`)."""
        sequence = self._slots.get(slot)
        if sequence is None:
            raise OptionError(f"slot {slot} holds no sequence", hint="prefill it first")
        if not 0 <= start < stop <= sequence.length:
            raise OptionError(f"positions {start}..{stop} are outside slot {slot}'s {sequence.length} tokens")
        self._not_evicted(slot, sequence, "its cache positions are no longer its tokens' to share")
        kv = self._kv()
        return {pair.past: np.array(np.take(kv.read(sequence.table, pair.past, stop), range(start, stop), axis=pair.axis))
                for pair in self._require_cache().pairs}

    def resume(self, slot: int, cache: Mapping[str, np.ndarray], length: int, ids: Any, *,
               adapter: str | None = None) -> np.ndarray:
        """Start sequence `slot` from a cached prefix of `length` tokens (as `prefix` gave it,
        concatenated), then run the rest of its prompt `ids` after it: the logits after its last
        token, as `prefill` of the whole prompt gives them (up to float rounding)."""
        if not 0 <= slot < self.num_slots or slot in self._slots:
            raise OptionError(f"slot {slot} is out of range or in use")
        layout = self._require_cache()
        if {p.past for p in layout.pairs} != set(cache) or any(
                cache[p.past].shape[p.axis] != length for p in layout.pairs):
            raise OptionError(f"a cached prefix must hold {length} positions of every cache input")
        kv = self._kv()
        sequence = _Sequence([], length=length, seen=length, adapter=self._adapter(adapter))
        kv.reserve(sequence.table, 0, length)
        try:
            for pair in layout.pairs:
                kv.write(sequence.table, pair.past, 0, np.asarray(cache[pair.past]))
        except BaseException:
            kv.release(sequence.table)
            raise
        return self._start(slot, sequence, ids)

    def attach(self, slot: int, blocks: Sequence[int], length: int, ids: Any, *, adapter: str | None = None) -> np.ndarray:
        """Start sequence `slot` from `length` positions already in the pool's `blocks` (a cached
        prefix: `aviatorc.serve.prefix`), shared with their other holders copy-on-write, then run
        the rest of its prompt `ids` after them: the logits `prefill` of the whole prompt gives."""
        if not 0 <= slot < self.num_slots or slot in self._slots:
            raise OptionError(f"slot {slot} is out of range or in use")
        kv = self._kv()
        if len(blocks) != kv.blocks_for(length):
            raise OptionError(f"{length} positions are {kv.blocks_for(length)} blocks of {kv.block_size}, not {len(blocks)}")
        sequence = _Sequence(kv.share(blocks), length=length, seen=length, adapter=self._adapter(adapter))
        return self._start(slot, sequence, ids)

    def blocks_of(self, slot: int) -> list[int]:
        """The pool's blocks `slot`'s cache is in, in position order."""
        sequence = self._slots.get(slot)
        if sequence is None:
            raise OptionError(f"slot {slot} holds no sequence", hint="prefill it first")
        return list(sequence.table)

    def load_adapter(self, name: str, path: str | os.PathLike[str]) -> None:
        """Load the PEFT LoRA adapter in folder `path` under `name`; the base is not touched."""
        if self.adapters is None:
            raise OptionError("this session runs no LoRA adapters", hint="open it with Session(artifact, lora=True)")
        self.adapters.load(name, path)

    def unload_adapter(self, name: str) -> None:
        """Drop adapter `name` (refused while a slot runs it)."""
        users = sorted(slot for slot, s in self._slots.items() if s.adapter == name)
        if users:
            raise OptionError(f"adapter '{name}' is in use by slot(s) {users}", hint="free them first")
        if self.adapters is None:
            raise OptionError(f"no adapter named '{name}' is loaded")
        self.adapters.unload(name)

    def _adapter(self, name: str | None) -> str | None:
        if name is not None and (self.adapters is None or name not in self.adapters.loaded):
            loaded = sorted(self.adapters.loaded) if self.adapters is not None else []
            raise OptionError(f"no LoRA adapter named '{name}' is loaded",
                              hint=f"loaded: {', '.join(loaded)}" if loaded else "load it with load_adapter first")
        return name

    def cache_bytes(self, slot: int) -> int:
        """Bytes of the KV blocks `slot` holds in this process (int8 codes and scales under
        `--kv-dtype int8`); a block shared with another holder counts in full for each."""
        sequence = self._slots.get(slot)
        return len(sequence.table) * self._kv().block_bytes if sequence else 0

    def blocks_needed(self, slot: int, new: int) -> int:
        """Free blocks `slot` needs to take `new` more tokens: its new blocks, and a copy of a shared
        last block it would write into (a free slot: the blocks of `new` tokens)."""
        kv, sequence = self._kv(), self._slots.get(slot)
        if sequence is None:
            return kv.blocks_for(new)
        more = max(0, kv.blocks_for(sequence.length + new) - len(sequence.table))
        last = sequence.length // kv.block_size
        shared = last < len(sequence.table) and kv.refs[sequence.table[last]] > 1
        return more + int(shared)

    def slot_length(self, slot: int) -> int:
        """Tokens held in `slot`'s cache (0 when free)."""
        sequence = self._slots.get(slot)
        return sequence.length if sequence else 0

    def extend_many(self, slots: Sequence[int], ids: Sequence[Sequence[int]]) -> np.ndarray:
        """`extend` of several sequences by as many tokens each, as one step where the graph takes
        a batch (speculative decoding verifies every sequence's drafts so): [len(slots), n, vocab]."""
        if len(slots) != len(ids) or len({len(row) for row in ids}) > 1 or not ids or not ids[0]:
            raise OptionError("extend_many needs one equally long, non-empty list of ids per slot")
        for slot in slots:
            if slot not in self._slots:
                raise OptionError(f"slot {slot} holds no sequence", hint="prefill it first")
        sequences = [self._slots[slot] for slot in slots]
        if len(sequences) > 1 and self._batches(sequences) and not self._require_cache().per_token and not self.kv_window:
            return self._grouped_step(sequences, np.asarray(ids, dtype=np.int64), "prefill").reshape(
                len(slots), len(ids[0]), -1)
        return np.stack([self.extend(slot, row) for slot, row in zip(slots, ids)])

    def extend(self, slot: int, ids: Any) -> np.ndarray:
        """Append several tokens `ids` to sequence `slot` in one step; the logits after each of them
        [len(ids), vocab] (speculative decoding verifies a draft's tokens this way)."""
        if slot not in self._slots:
            raise OptionError(f"slot {slot} holds no sequence", hint="prefill it first")
        return self._step(self._slots[slot], self._prompt(ids), "prefill", every_position=True)

    def truncate(self, slot: int, length: int) -> None:
        """Keep only the first `length` tokens of sequence `slot`'s cache (drop rejected drafts): by
        length, a view of the positions kept, nothing copied."""
        sequence = self._slots.get(slot)
        if sequence is None:
            raise OptionError(f"slot {slot} holds no sequence", hint="prefill it first")
        if not 0 < length <= sequence.length:
            raise OptionError(f"cannot truncate slot {slot} to {length} tokens: it holds {sequence.length}")
        self._not_evicted(slot, sequence, "the positions to keep may be gone")
        self._kv().release(sequence.table, keep=length)
        sequence.length = sequence.seen = length

    def _not_evicted(self, slot: int, sequence: _Sequence, why: str) -> None:
        if sequence.evicted:
            raise OptionError(f"slot {slot} has evicted {sequence.seen - sequence.length} positions from its bounded "
                              f"KV cache (--kv-recent): {why}", hint="compile without --kv-recent")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The model's end-of-sequence ids, as its source named them (a GGUF file's or a Hugging Face
        config's; kept in the graph's metadata); () when the source did not say (an ONNX file)."""
        text = self.graph.metadata.get("eos_token_id", "")
        return tuple(int(t) for t in text.split(",") if t.strip())

    def generate(self, input_ids: Any, max_new_tokens: int, *, eos_token_id: int | Sequence[int] | None = None,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                 adapter: str | None = None) -> np.ndarray:
        """The prompt followed by up to `max_new_tokens` generated ids (1-D), as `transformers`'
        `generate` returns them; stops after an end-of-sequence id: `eos_token_id`, or by default the
        model's own (`eos_token_ids`, as `aviatorc generate` does); `eos_token_id=()` never stops early.
        Greedy at temperature 0. `stats.extra` then holds `ttft_s` (the prompt's step, to the first
        token) and `decode_s` (the steps after it), wall clock on this machine."""
        check_sampling(temperature, top_p)
        if max_new_tokens < 0:
            raise OptionError(f"max_new_tokens must be >= 0, not {max_new_tokens}")
        prompt = self._prompt(input_ids)
        if eos_token_id is None:
            eos_token_id = self.eos_token_ids
        stops = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
        rng = np.random.default_rng(seed)
        sequence = _Sequence([], length=0, seen=0, adapter=self._adapter(adapter))
        generated: list[int] = []
        started = time.perf_counter()
        first = started
        try:
            if max_new_tokens:
                logits = self._step(sequence, prompt, "prefill")
                while True:
                    token = sample(logits, temperature=temperature, top_p=top_p, rng=rng)
                    generated.append(token)
                    if len(generated) == 1:
                        first = time.perf_counter()
                    if token in stops or len(generated) == max_new_tokens:
                        break
                    logits = self._step(sequence, np.array([[token]], dtype=np.int64), "decode")
        finally:
            self._kv().release(sequence.table)
        if self.stats is not None:
            ended = time.perf_counter()
            self.stats.extra.update(generated_tokens=len(generated), generate_wall_s=ended - started,
                                    ttft_s=first - started, decode_s=ended - first)
        return np.concatenate([prompt[0], np.array(generated, dtype=np.int64)])

    def _require_cache(self) -> CacheLayout:
        if self.cache is None:
            raise NotRunnableError(f"this model cannot generate: {static_reason(self.graph)}",
                                   file=str(self.artifact.path),
                                   hint="export a decode step that takes and returns its KV cache "
                                        "(see aviatorc.zoo.export_decode_onnx), or use run() on the graph's own shapes")
        return self.cache

    def _prompt(self, ids: Any) -> np.ndarray:
        array = np.asarray(ids)
        if array.ndim == 2 and array.shape[0] == 1:
            array = array[0]
        if array.ndim != 1 or array.size == 0 or not np.issubdtype(array.dtype, np.integer):
            raise RuntimeInputError(f"a prompt is a non-empty 1-D list of token ids, not {array.dtype}{list(array.shape)}",
                                    input="input_ids")
        return array.astype(np.int64)[None, :]

    def _pool(self, kv_blocks: int | None, block_size: int) -> KVPool:
        """The pool every sequence's cache lives in: `kv_blocks` blocks of `block_size` tokens, by
        default as many positions as the plan's pool (`MemoryFigures.kv_blocks`: its batch x the
        positions a sequence holds in whole blocks, plus a block each for a bounded cache's window
        to step past before it evicts)."""
        layout = self._require_cache()
        types = {v.name: v.type for v in self.graph.inputs}
        specs: dict[str, CacheSpec] = {}
        for pair in layout.pairs:
            shape = tuple(d if isinstance(d, int) else 1 for d in types[pair.past].shape)
            if self.kv_dtype == "int8" and pair.axis == len(shape) - 1:
                raise NotRunnableError("an int8 KV cache keeps one scale per head and token, but this graph's cache "
                                       f"has its sequence axis last ({pair.axis})", file=str(self.artifact.path),
                                       hint="compile with --kv-dtype fp16")
            specs[pair.past] = CacheSpec(shape, pair.axis, numpy_dtype(types[pair.past].dtype))
        if block_size < 1:
            raise OptionError(f"--block-size must be >= 1, not {block_size}")
        memory = self.artifact.plan.memory
        if kv_blocks is None:  # the plan's pool, in blocks of this size (an older plan: sized the same way)
            if memory.kv_blocks:
                kv_blocks = math.ceil(memory.kv_blocks * memory.kv_block_tokens / block_size)
            else:
                held = self.kv_window.held(self.context) if self.kv_window else self.context
                kv_blocks = kv_pool_blocks(self.program.workload.batch, held, block_size, self.kv_window)
        if kv_blocks < 1:
            raise OptionError(f"--kv-blocks must be >= 1, not {kv_blocks}")
        return KVPool(specs, num_blocks=kv_blocks, block_size=block_size, int8=self.kv_dtype == "int8",
                      sram_blocks=memory.kv_sram_positions // block_size)

    def _kv(self) -> KVPool:
        self._require_cache()
        assert self.kv is not None
        return self.kv

    def _step(self, sequence: _Sequence, ids: np.ndarray, phase: str, *, every_position: bool = False) -> np.ndarray:
        """Run `ids` [1, n] after `sequence`'s cache; grow the cache; the last position's logits."""
        layout = self._require_cache()
        pieces = self._pieces(sequence, ids.shape[1])
        if len(pieces) > 1:
            self._room(sequence, ids.shape[1])
            rows = [self._step(sequence, ids[:, a:b], "decode" if layout.per_token else phase, every_position=True)
                    for a, b in pieces]
            return np.concatenate(rows) if every_position else rows[-1][-1]
        self._room(sequence, ids.shape[1])
        total = sequence.length + ids.shape[1]
        kv = self._kv()
        kv.reserve(sequence.table, sequence.length, total)
        feeds: dict[str, np.ndarray] = {layout.ids: ids}
        for pair in layout.pairs:
            feeds[pair.past] = kv.read(sequence.table, pair.past, sequence.length)
        if layout.attention_mask:
            feeds[layout.attention_mask] = np.ones((1, total), dtype=np.int64)
        if layout.position_ids:
            feeds[layout.position_ids] = np.arange(sequence.seen, sequence.seen + ids.shape[1], dtype=np.int64)[None, :]
        outputs = self._execute(self._check_feeds(feeds), phase, [sequence.adapter])
        for pair in layout.pairs:
            new = np.take(outputs[pair.present], range(sequence.length, total), axis=pair.axis)
            kv.write(sequence.table, pair.past, sequence.length, new)
        sequence.length, sequence.seen = total, sequence.seen + ids.shape[1]
        self._evict(sequence)
        return outputs[layout.logits][0] if every_position else outputs[layout.logits][0, -1]

    def _pieces(self, sequence: _Sequence, new: int) -> list[tuple[int, int]]:
        """The steps `new` tokens run in: one each for a decoder-with-past export; under a bounded
        cache, cut where a position is a multiple of its window (where eviction happens), so that
        what a token attends to does not depend on how its prompt was split into steps; otherwise
        PIECE_TOKENS at a time (the graph's attention holds the scores of every new position
        against every earlier one: 2,048 tokens of SmolLM2 took 40 s in one step here, 11.8 s in
        pieces of 256, the logits within 4e-5)."""
        if self._require_cache().per_token:
            cuts = list(range(1, new))
        elif self.kv_window:
            recent = self.kv_window.recent
            cuts = list(range(recent - sequence.seen % recent, new, recent))
        else:
            cuts = list(range(PIECE_TOKENS, new, PIECE_TOKENS))
        bounds = [0, *cuts, new]
        return list(zip(bounds, bounds[1:]))

    def _evict(self, sequence: _Sequence) -> None:
        """Under a bounded cache, evict a window's worth of positions at a time (as paged caches free
        whole blocks): once a sequence has seen k x recent tokens it keeps its sinks and the positions
        from (k - 1) x recent on, so it holds between sinks + recent and sinks + 2 x recent."""
        window = self.kv_window
        if window is None:
            return
        sinks = min(window.sinks, sequence.length)
        first = sequence.seen - (sequence.length - sinks)  # the oldest position after the sinks
        keep_from = (sequence.seen // window.recent - 1) * window.recent
        if keep_from <= first:
            return
        kv, gone = self._kv(), keep_from - first
        kept = {}
        for pair in self._require_cache().pairs:
            whole = kv.read(sequence.table, pair.past, sequence.length)
            kept[pair.past] = np.delete(whole, range(sinks, sinks + gone), axis=pair.axis)
        sequence.length -= gone
        kv.release(sequence.table, keep=sinks)  # the sinks' blocks stay; the rest is written again
        kv.reserve(sequence.table, sinks, sequence.length)
        for name, array in kept.items():
            kv.write(sequence.table, name, sinks, np.take(array, range(sinks, sequence.length), axis=kv.specs[name].axis))

    def _room(self, sequence: _Sequence, new: int) -> None:
        """Refuse `new` more tokens past the plan's context (the positions it was compiled for)."""
        total = sequence.seen + new
        if total > self.context:
            raise RuntimeInputError(f"the sequence would reach {total} tokens but the plan was compiled "
                                    f"for a context of {self.context}", input=self._require_cache().ids,
                                    hint="compile with a larger --context")

    def _batches(self, sequences: Sequence[_Sequence]) -> bool:
        """Whether one step can run all of `sequences`: the graph takes that batch, and either they
        are all as long or it takes the mask and positions that padding needs."""
        layout = self._require_cache()
        same_length = len({s.length for s in sequences}) == 1
        padding = layout.attention_mask is not None and layout.position_ids is not None
        return layout.runs_batch(len(sequences)) and (same_length or padding)

    def _grouped_step(self, sequences: Sequence[_Sequence], ids: np.ndarray, phase: str) -> np.ndarray:
        """`_batched_step` of `sequences` in the groups `_length_groups` makes; the rows in their order."""
        groups = _length_groups([s.length for s in sequences], ids.shape[1], self.step_batch)
        if len(groups) == 1:
            return self._batched_step(sequences, ids, phase)
        rows: list[np.ndarray] = [np.empty(0)] * len(sequences)
        for group in groups:
            for i, row in zip(group, self._batched_step([sequences[i] for i in group], ids[group], phase)):
                rows[i] = row
        return np.stack(rows)

    def _batched_step(self, sequences: Sequence[_Sequence], ids: np.ndarray, phase: str = "decode") -> np.ndarray:
        """Run n new tokens per sequence (`ids` [batch, n]) as one step; grow each cache; the
        logits [batch, vocab] after the last of them (n = 1), or [batch, n, vocab] after each.

        Each past is padded at its end to the longest (zeros, attention_mask 0 there), so the new
        tokens sit at indices `longest` .. `longest + n - 1` for all of them while their position
        ids follow the sequence's own length; each sequence's present is its real positions plus
        the new ones."""
        layout = self._require_cache()
        new = ids.shape[1]
        for sequence in sequences:
            self._room(sequence, new)
        lengths = [s.length for s in sequences]
        longest = max(lengths)
        kv = self._kv()
        for sequence in sequences:
            kv.reserve(sequence.table, sequence.length, sequence.length + new)
        feeds: dict[str, np.ndarray] = {layout.ids: ids}
        for pair in layout.pairs:
            feeds[pair.past] = _pad_stack([kv.read(s.table, pair.past, s.length) for s in sequences], pair.axis, longest)
        if layout.attention_mask:
            mask = np.zeros((len(sequences), longest + new), dtype=np.int64)
            for row, length in enumerate(lengths):
                mask[row, :length] = 1
            mask[:, longest:] = 1
            feeds[layout.attention_mask] = mask
        if layout.position_ids:
            seen = [s.seen for s in sequences]
            feeds[layout.position_ids] = np.array(seen, dtype=np.int64)[:, None] + np.arange(new)[None, :]
        outputs = self._execute(self._check_feeds(feeds), phase, [s.adapter for s in sequences])
        for row, (sequence, length) in enumerate(zip(sequences, lengths)):
            for pair in layout.pairs:
                present = np.take(outputs[pair.present][row:row + 1], range(longest, longest + new), axis=pair.axis)
                kv.write(sequence.table, pair.past, length, present)
            sequence.length, sequence.seen = length + new, sequence.seen + new
            self._evict(sequence)
        if self.stats is not None:
            self.stats.extra["batch"] = len(sequences)
        return outputs[layout.logits][:, -1] if new == 1 else outputs[layout.logits]

    def trace(self, path: str | os.PathLike[str] | None = None, *, phase: str | None = None) -> dict[str, Any]:
        """The simulated timeline of `phase` (default: the last run's) as Chrome trace / Perfetto
        JSON, written to `path` if given: what the run would take on the plan's target."""
        from aviatorc.plan.artifact import to_json_bytes, write_file_atomically
        from aviatorc.schedule import simulate
        from aviatorc.schedule.trace import chrome_trace

        phase = phase or (self.stats.phase if self.stats else RUN_PHASE)
        if phase not in self.artifact.programs:
            raise OptionError(f"the plan has no '{phase}' program", hint=f"choose one of {', '.join(sorted(self.artifact.programs))}")
        trace = chrome_trace(simulate(self.artifact.programs[phase], self.target), name=f"{phase} step")
        if path is not None:
            write_file_atomically(Path(path), to_json_bytes(trace))
        return trace

    def _predictions(self) -> dict[str, float]:
        """Each phase's simulated step on the plan's target (computed once, after a run succeeded)."""
        if self._predicted is None:
            from aviatorc.schedule import simulate

            self._predicted = {phase: simulate(program, self.target, record=False).makespan_s
                               for phase, program in sorted(self.artifact.programs.items())}
        return self._predicted

    def _check_feeds(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        names = self.input_names
        for name in names:
            if name not in feeds:
                raise RuntimeInputError(f"missing input '{name}'", input=name, hint=f"the inputs are {', '.join(names)}")
        for name in sorted(feeds):
            if name not in names:
                raise RuntimeInputError(f"unknown input '{name}'", input=name, hint=f"the inputs are {', '.join(names)}")
        arrays: dict[str, np.ndarray] = {}
        bound: dict[str, int] = {}
        for value in self.graph.inputs:
            array = np.asarray(feeds[value.name])
            expected = numpy_dtype(value.type.dtype)
            if array.dtype != expected:
                raise RuntimeInputError(f"input '{value.name}' is {array.dtype}, expected {value.type.dtype}",
                                        input=value.name, hint=f"convert it with .astype('{expected}')")
            shape = list(array.shape)
            wrong = array.ndim != value.type.rank
            for size, dim in zip(array.shape, value.type.shape):
                wrong |= isinstance(dim, int) and size != dim
                wrong |= isinstance(dim, str) and bound.setdefault(dim, size) != size
            if wrong:
                raise RuntimeInputError(f"input '{value.name}' has shape {shape}, expected "
                                        f"{format_shape(value.type.shape)}", input=value.name,
                                        hint="the plan runs the shapes it was compiled for; recompile for others")
            arrays[value.name] = array
        return arrays


def _length_groups(lengths: Sequence[int], new: int, most: int) -> list[list[int]]:
    """Indices of the sequences to step together, longest first: a group takes the next longest
    while it has fewer than `most` (the plan's batch) and the positions its caches are padded with
    (each to the group's longest) stay within PADDING_LIMIT. On this project's CPU a padded position costs about what a real one does
    (the graph's attention and cache copies see no difference), and a step's fixed work about
    600 positions' worth: four 30-token sequences beside a 1,500-token one took 1.3 s a step
    together, 0.3 s in two groups."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups:
            group = groups[-1]
            if len(group) < most and sum(lengths[group[0]] - lengths[j] for j in [*group, i]) <= PADDING_LIMIT:
                group.append(i)
                continue
        groups.append([i])
    return groups


def _pad_stack(caches: Sequence[np.ndarray], axis: int, length: int) -> np.ndarray:
    """Batch-1 caches stacked along axis 0, each zero-padded at the end of `axis` to `length`."""
    first = caches[0]
    shape = [len(caches), *first.shape[1:]]
    shape[axis] = length
    out = np.zeros(shape, dtype=first.dtype)
    for row, cache in enumerate(caches):
        index = [slice(None)] * first.ndim
        index[0], index[axis] = slice(row, row + 1), slice(0, cache.shape[axis])
        out[tuple(index)] = cache
    return out
