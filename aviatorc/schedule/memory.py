"""SRAM the weights cannot have: the KV cache, activation scratch and streamed-weight staging.

Sized from the model and the workload, before partitioning, so the partitioner places weights
in what is really left (`reserve_bytes`, one figure per chiplet):

- KV cache: layers x (K + V width per token) x positions held x batch x bytes per element (2
  for a 16-bit cache; 1 plus a 2-byte scale per head and token for INT8). A sequence holds its
  whole context, or under a `KVWindow` (StreamingLLM's attention sinks plus a recent window) at
  most `sinks` + 2 x `recent`: the cache, and the attention over it, stop growing. In SRAM when
  it takes at most `KV_SRAM_SHARE` of the machine's SRAM (`kv="auto"`), spread over the allowed
  chiplets one layer at a time, each layer's read in parts beside its home where that makes its
  attention sooner (`kv_split_in_sram`); otherwise it stays in LPDDR and each decode step streams
  it in chunks.
  A KV block held in SRAM costs the same per byte as a resident weight (both are read once per
  step), so which of the two stays is a wash in the bound; auto keeps small caches on chip. Once
  the weights are placed, auto's cache in LPDDR takes the SRAM they left (`kv_in_free_sram`): the
  pool's first blocks of each layer live there, and a step reads them in place and streams only
  the rest.
- Activation scratch: the peak of live activation bytes over the node order (a value lives
  from its producer to its last user) at the tokens a program processes.
- The prefill is weight-stationary (`prefill="stationary"`, the default): it walks the model one
  layer at a time, and every token block of the prompt runs through a layer while its streamed
  tiles stay in SRAM, so each streamed byte crosses LPDDR once per pass. Blocks of
  `prefill_block_tokens` are halved until the activations of `PREFILL_BLOCKS_IN_FLIGHT` of them
  (the scheduler's wavefront) fit `PREFILL_SCRATCH_SHARE` of a chiplet. What a pass holds
  between layers is every block's hand-off (the residual stream, and what earlier layers
  computed for later ones): at most `PREFILL_HOLD_SHARE` of a chiplet, where each block's next
  layer runs. A prompt whose hand-off needs more runs in passes of `prefill_chunk_tokens`
  (halved until it fits), each streaming the weights once. A layer's streamed tiles stay staged
  while its blocks run: `prefill_staging_bytes` per chiplet, sized before placement as
  `PREFILL_STAGING_LAYERS` of the largest layer's bytes spread over the chiplets (the scheduler
  re-loads per block what a chiplet cannot hold). The program may time several of these blocks
  as one (`program_blocks`): they still run one after another through the layer,
  so the SRAM is the same. `"pipelined"` is the same pass with each layer on its home's card: the
  layer's streamed tiles are read from a copy in that card's LPDDR (`prefill_copies`), so a pass's
  activations cross cards only where the homes change card, and the cards work in turn; a
  chiplet then stages its card's share of a layer, so a decode step keeps less resident. It pays
  when a pass's activations are large (a large batch of prompts over several cards), and `"auto"`
  (the default) takes it where `_auto_prefill` estimates that the workload's prefill and decode
  steps up to the context take less time with it. `"chunked"` is the schedule
  main had: chunks of one block each, every chunk streaming every weight again, with no SRAM
  beyond the decode step's taken from the weights.
- Staging: a streamed tile (or KV block) is loaded in chunks of at most `stage_chunk_bytes`
  (column sub-strips of a weight strip are strips too, so each chunk is computed on its own);
  each chiplet keeps `STAGING_DEPTH` chunks in flight: double buffering. Measured on Llama-3-70B
  INT4 x4 against 2 MB chunks four deep (the same staging bytes): 18.295 vs 18.290 ms per token,
  with 29% fewer instructions, since each load, wait, compute, free and send is per chunk.

An activation larger than a whole chiplet's SRAM can never be placed: it is refused here,
with the node and the bytes, before anything is allocated or written.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from aviatorc.errors import InfeasibleError, OptionError
from aviatorc.partition.placement import Placement
from aviatorc.partition.tiling import Tile, lora_reachable
from aviatorc.plan.ir import Workload
from aviatorc.plan.plan import KVWindow, MemoryFigures, kv_pool_blocks
from aviatorc.routing import Routing
from aviatorc.schedule.model import ModelFacts, layer_runs
from aviatorc.target import Target

KV_SRAM_SHARE = 0.25  # kv="auto": keep the cache in SRAM when it needs at most this share of it
KV_BLOCK_TOKENS = 16  # positions per block of the runtime's KV pool (vLLM's default)
KV_DTYPES = {"fp16": 2, "bf16": 2, "int8": 1}
KV_MODES = ("auto", "sram", "lpddr")
KV_SRAM_ROUND = 64  # blocks a layer takes per turn when the caches share the SRAM the weights left
PREFILL_SCRATCH_SHARE = 1 / 32  # of a chiplet's SRAM: a prefill block's activations
PREFILL_HOLD_SHARE = 1 / 8  # of a chiplet's SRAM: a chiplet's share of a pass's hand-off between layers
PREFILL_STAGING_LAYERS = 1.0  # a layer's streamed tiles, held for its blocks (1.5 gained 0.3% TTFT on Llama-3-8B)
PREFILL_SCHEDULES = ("auto", "stationary", "pipelined", "chunked")
PIPELINE_BLOCKS = 4  # a prefill pass's blocks in the program (more: finer overlap, a longer program)
PREFILL_BLOCKS_IN_FLIGHT = PIPELINE_BLOCKS  # every block of a pass at once (build._wavefront)
# ... of at least this many tokens: on Llama-3-70B x4 at batch 1 (128 prompt tokens) 1, 2 and 4 blocks
# gave a TTFT of 38.4, 37.5 and 39.6 ms, and each block adds a copy of the pass to plan.json.
PIPELINE_BLOCK_TOKENS = 256
STAGE_CHUNK_SHARE = 1 / 64  # of a chiplet's SRAM: the most one streamed chunk takes
STAGING_DEPTH = 2  # chunks in flight per chiplet: double buffering
# Layer homes go on the fewest cards whose SRAM holds the weights and the caches at this fill:
# a layer boundary between cards is a card-to-card hand-off every step.
HOME_CARDS_FILL = 0.85
# Auto takes the pipelined prefill where its estimate is this many times below the stationary one's
# (after the decode steps its staging costs): the estimates leave out a card's own transfers.
# Llama-3-70B on 8 cards at batch 1, estimated 62.8 against 80.6 ms, simulated at 56.4 against
# 52.4 ms, with a decode step 13% slower; at batch 16 on 4 cards, 77 against 633 ms estimated,
# 186 against 471 ms simulated.
PIPELINED_MARGIN = 2.0
HEAD_DIM_FOR_SCALES = 128  # INT8 KV: one fp16 scale per head and token, heads of this width assumed


@dataclass(frozen=True)
class KVPlan:
    """Where each layer's KV cache lives and what it costs."""

    dtype: str
    location: str  # "sram" or "lpddr"
    bytes_per_layer: dict[int, int]  # at the workload's batch x positions held
    chiplet_of_layer: dict[int, int]  # the chiplet holding (sram) or reading (lpddr) the layer's cache
    chunk_bytes: int  # lpddr: bytes per streamed chunk
    tokens: int  # positions each sequence holds: the context, or what its window keeps
    window: KVWindow | None = None
    batch: int = 1  # sequences
    block_tokens: int = KV_BLOCK_TOKENS  # positions per block of the runtime's pool
    # layer -> chiplet -> blocks of the layer kept in SRAM there. lpddr: the pool's first blocks,
    # in the chiplets' order (`kv_in_free_sram`), where `free_sram` (kv="auto") lets the cache
    # take the SRAM the weights leave; kv="lpddr" streams all of it. sram: the parts of a cache
    # read beside its home (`kv_split_in_sram`); a layer not named here is held whole at home
    sram_blocks: dict[int, dict[int, int]] = field(default_factory=dict)
    free_sram: bool = False

    @property
    def blocks(self) -> int:
        """The runtime's pool (`kv_pool_blocks`)."""
        return kv_pool_blocks(self.batch, self.tokens, self.block_tokens, self.window)

    def block_bytes(self, layer: int) -> int:
        """One block of the pool in one layer: the layer's cache over the pool's blocks."""
        return -(-self.bytes_per_layer.get(layer, 0) // max(1, self.blocks))

    def sram_parts(self, layer: int) -> dict[int, int]:
        """Chiplet -> the bytes of the layer's cache a decode step reads from SRAM there."""
        nbytes = self.bytes_per_layer.get(layer, 0)
        if self.location == "sram" and layer not in self.sram_blocks:
            return {self.chiplet_of_layer[layer]: nbytes} if nbytes else {}
        parts, left = {}, nbytes
        for c, count in sorted(self.sram_blocks.get(layer, {}).items()):
            parts[c] = min(left, count * self.block_bytes(layer))
            left -= parts[c]
        return {c: b for c, b in parts.items() if b}

    def sram_bytes(self, layer: int) -> int:
        return sum(self.sram_parts(layer).values())

    def streamed_bytes(self, layer: int) -> int:
        """The bytes of the layer's cache a decode step streams from LPDDR."""
        return self.bytes_per_layer.get(layer, 0) - self.sram_bytes(layer)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_per_layer.values())


@dataclass(frozen=True)
class MemoryPlan:
    kv: KVPlan
    scratch_bytes: int  # per chiplet, the larger of the two phases
    prefill_chunk_tokens: int  # tokens per prefill pass (the prompt runs in ceil(B * P / this) passes)
    staging_bytes: int  # per chiplet
    stage_chunk_bytes: int  # the most one load brings in (a sub-strip of a streamed tile, a KV block)
    reserve_bytes: tuple[int, ...]  # per chiplet of the machine: held back from weights
    prefill_block_tokens: int = 0  # tokens per block of a pass (0: the whole pass is one block)
    prefill_staging_bytes: int = 0  # per chiplet: a prefill layer's staged tiles (0: as the decode step's)
    lora_bytes: int = 0  # per chiplet: LoRA adapters' matrices (`lora_bytes`), part of reserve_bytes
    prefill_schedule: str = "stationary"  # "stationary", "pipelined" or "chunked" ("auto" resolved)
    prefill_copies: dict[int, int] = field(default_factory=dict)  # pipelined: tile -> chiplet (`prefill_copies`)
    link_dtype: str = "fp16"  # activations between chiplets: "fp16", or "int8" (`aviatorc.quant.link`)

    @property
    def prefill_blocks(self) -> int:
        """The prefill program's token blocks (`program_blocks`)."""
        return program_blocks(self.prefill_chunk_tokens, self.prefill_block_tokens)

    def describe(self) -> MemoryFigures:
        window = self.kv.window
        return MemoryFigures(kv_dtype=self.kv.dtype, kv_location=self.kv.location, kv_bytes=self.kv.total_bytes,
                             kv_chunk_bytes=self.kv.chunk_bytes, kv_layer_chiplets=dict(self.kv.chiplet_of_layer),
                             scratch_bytes_per_chiplet=self.scratch_bytes,
                             prefill_chunk_tokens=self.prefill_chunk_tokens, staging_bytes_per_chiplet=self.staging_bytes,
                             stage_chunk_bytes=self.stage_chunk_bytes, reserve_bytes=tuple(self.reserve_bytes),
                             kv_sinks=window.sinks if window else 0, kv_recent=window.recent if window else 0,
                             prefill_block_tokens=self.prefill_block_tokens,
                             prefill_staging_bytes_per_chiplet=self.prefill_staging_bytes,
                             lora_bytes_per_chiplet=self.lora_bytes, prefill_copies=dict(self.prefill_copies),
                             link_dtype=self.link_dtype, kv_blocks=self.kv.blocks, kv_block_tokens=self.kv.block_tokens,
                             kv_sram_blocks={layer: dict(parts) for layer, parts in self.kv.sram_blocks.items()})


def program_blocks(pass_tokens: int, block_tokens: int) -> int:
    """The blocks a prefill program times a pass in: at most `PIPELINE_BLOCKS`, of at least
    `PIPELINE_BLOCK_TOKENS` tokens, each standing for one or more blocks of `block_tokens` that
    run one after another on the same chiplets (0: the chunked prefill, one block)."""
    if not block_tokens:
        return 1
    return max(1, min(math.ceil(pass_tokens / block_tokens), PIPELINE_BLOCKS, pass_tokens // PIPELINE_BLOCK_TOKENS))


def kv_bytes_per_token(width: int, dtype: str) -> float:
    """Bytes of one token's K and V in one layer."""
    if dtype not in KV_DTYPES:
        raise OptionError(f"unknown KV cache type '{dtype}'", hint=f"choose one of {', '.join(KV_DTYPES)}")
    scales = 2 * 2 * max(1, width // (2 * HEAD_DIM_FOR_SCALES)) if dtype == "int8" else 0
    return width * KV_DTYPES[dtype] + scales


def plan_memory(facts: ModelFacts, tiles: Sequence[Tile], target: Target, workload: Workload, *,
                chiplets: Sequence[int], kv: str = "auto", kv_dtype: str = "fp16",
                kv_window: KVWindow | None = None, prefill: str = "stationary", link_dtype: str = "fp16",
                routing: Routing | None = None) -> MemoryPlan:
    """`routing`: a mixture of experts' (`aviatorc.routing`), which `prefill="auto"` weighs by."""
    if kv not in KV_MODES:
        raise OptionError(f"unknown KV placement '{kv}'", hint=f"choose one of {', '.join(KV_MODES)}")
    if prefill not in PREFILL_SCHEDULES:
        raise OptionError(f"unknown prefill schedule '{prefill}'", hint=f"choose one of {', '.join(PREFILL_SCHEDULES)}")
    if workload.batch < 1 or workload.context < 0 or workload.prompt < 1:
        raise OptionError(f"batch, context and prompt must be positive (batch={workload.batch}, "
                          f"context={workload.context}, prompt={workload.prompt})")
    if prefill == "auto":
        return _auto_prefill(facts, tiles, target, workload, chiplets=chiplets, kv=kv, kv_dtype=kv_dtype,
                             kv_window=kv_window, link_dtype=link_dtype, routing=routing)
    decode_peak = activation_peak_bytes(facts, target, workload.tokens("decode"), workload.outputs())
    budget = max(decode_peak, int(PREFILL_SCRATCH_SHARE * target.chiplet.sram_bytes))
    # The stationary prefill's blocks run as a wavefront, PREFILL_BLOCKS_IN_FLIGHT at a time (build.py).
    stationary = prefill != "chunked"
    in_flight = PREFILL_BLOCKS_IN_FLIGHT if stationary else 1
    block = workload.tokens("prefill")
    while block > 1 and in_flight * activation_peak_bytes(facts, target, block, workload.batch, refuse=False) > budget:
        block = math.ceil(block / 2)
    block_peak = in_flight * activation_peak_bytes(facts, target, block, workload.batch, refuse=False)
    largest_tile = max((t.storage_bytes for t in tiles), default=0)
    # A chunk is at least one matrix-unit-wide strip of the deepest weight, so any tile can be cut to it.
    narrowest = max((t.format.storage_bytes(t.k, min(t.n, target.matrix_unit_n)) for t in tiles), default=0)
    stage_chunk = max(1, narrowest, min(largest_tile, int(STAGE_CHUNK_SHARE * target.chiplet.sram_bytes)))
    staging = STAGING_DEPTH * stage_chunk
    if stationary:
        ring = min(sum(1 for c in chiplets if target.card_of(c) == card) for card in {target.card_of(c) for c in chiplets})
        passes, hold = _prefill_passes(facts, target, workload.tokens("prefill"), block, ring)
        # A layer's streamed tiles are staged on every chiplet, or with "pipelined" on its home's card.
        sharing = ring if prefill == "pipelined" else len(chiplets)
        prefill_staging = max(staging, math.ceil(PREFILL_STAGING_LAYERS * _largest_layer_bytes(facts, tiles) / sharing))
    else:
        passes, hold, prefill_staging = block, 0, staging
    scratch = max(decode_peak, block_peak + hold)
    held_tokens = kv_window.held(workload.context) if kv_window else workload.context
    per_layer = {layer: math.ceil(kv_bytes_per_token(width, kv_dtype) * held_tokens * workload.batch)
                 for layer, width in sorted(facts.kv_width.items()) if width}
    total_kv = sum(per_layer.values())
    sram_total = target.chiplet.sram_bytes * len(chiplets)
    location = kv if kv != "auto" else ("sram" if total_kv <= KV_SRAM_SHARE * sram_total else "lpddr")
    kv_chunk = stage_chunk if location == "lpddr" else 0
    # Layer homes (each cache's chiplet) spread evenly in layer order over the chiplets of the cards
    # the model needs, so that consecutive layers share a card and each of those cards holds its
    # share of the caches. Dealt round-robin over every chiplet, 32 layers on 8 cards all went to
    # the first 4, the weights took the room the other 4 had left, and every layer's hand-offs
    # crossed cards (Llama-3-8B x8 at batch 16: 3.83 ms a token, 1.59 with the caches spread).
    # The partitioner then places each layer's weights around its home (`partition(homes=...)`).
    in_sram = location == "sram"
    homes = _home_chiplets(target, chiplets, sum(t.storage_bytes for t in tiles) + (total_kv if in_sram else 0),
                           scratch + max(staging, prefill_staging), len(per_layer),
                           max(per_layer.values(), default=0) if in_sram else 0)
    owners = {layer: homes[i * len(homes) // len(per_layer)] for i, layer in enumerate(sorted(per_layer))}
    reserve = [0] * target.num_chiplets
    adapters = math.ceil(lora_bytes(tiles, workload) / max(1, len(chiplets)))
    for c in chiplets:
        reserve[c] = scratch + max(staging, prefill_staging) + adapters
    if location == "sram":
        for layer, nbytes in per_layer.items():
            reserve[owners[layer]] += nbytes
    for c in chiplets:
        if reserve[c] >= target.chiplet.sram_bytes:
            staged = max(staging, prefill_staging)
            held = reserve[c] - scratch - staged - adapters
            lora = f", LoRA adapters ({_mib(adapters)})" if adapters else ""
            raise InfeasibleError(
                f"chiplet {c} needs {_mib(reserve[c])} for the KV cache ({_mib(held)}), activations "
                f"({_mib(scratch)}), weight staging ({_mib(staged)}){lora} but has "
                f"{_mib(target.chiplet.sram_bytes)} SRAM",
                file=target.source, hint="keep the KV cache in LPDDR (kv='lpddr'), use an INT8 KV cache, "
                "a bounded one (--kv-recent), a smaller batch or context, more cards, or the chunked prefill "
                "(--prefill chunked), which stages no more than a decode step")
    kv_plan = KVPlan(dtype=kv_dtype, location=location, bytes_per_layer=per_layer, chiplet_of_layer=owners,
                     chunk_bytes=kv_chunk, tokens=held_tokens, window=kv_window, batch=workload.batch,
                     free_sram=kv == "auto")
    return MemoryPlan(kv=kv_plan, scratch_bytes=scratch, prefill_chunk_tokens=passes, staging_bytes=staging,
                      stage_chunk_bytes=stage_chunk, reserve_bytes=tuple(reserve),
                      prefill_block_tokens=block if stationary else 0,
                      prefill_staging_bytes=prefill_staging, lora_bytes=adapters, prefill_schedule=prefill,
                      link_dtype=link_dtype)


def lora_bytes(tiles: Sequence[Tile], workload: Workload) -> int:
    """The SRAM `workload.max_loras` adapters of rank `workload.lora_rank` take at fp16: for each
    strip of a projection an adapter may target (`runtime.lora.targets`: not an embedding, a tied
    head or an expert), its columns of B [r, n] and a copy of A [k, r], on the chiplet computing it."""
    if not workload.lora_rank or not workload.max_loras:
        return 0
    return sum((t.k + t.n) * workload.lora_rank * 2 * workload.max_loras for t in tiles if lora_reachable(t))


def _prefill_passes(facts: ModelFacts, target: Target, prompt_tokens: int, block: int, ring: int) -> tuple[int, int]:
    """Tokens per weight-stationary pass (halved from the whole prompt until a chiplet's share of
    what it holds between layers fits `PREFILL_HOLD_SHARE` of it, never below one block) and that share."""
    budget = PREFILL_HOLD_SHARE * target.chiplet.sram_bytes
    tokens = prompt_tokens
    while tokens > block and prefill_hold_bytes(facts, target, tokens, block, ring) > budget:
        tokens = max(block, math.ceil(tokens / 2))
    return tokens, prefill_hold_bytes(facts, target, tokens, block, ring)


def prefill_hold_bytes(facts: ModelFacts, target: Target, pass_tokens: int, block: int, ring: int) -> int:
    """The most of a pass's hand-off between layers one chiplet holds. Each program block's lands
    where the block runs its next layer (`build.block_home`: the blocks side by side on the `ring`
    chiplets of the home's card), and a chiplet may hold two blocks' at once: one waiting for its
    next layer, one it made for the layer after."""
    whole = layer_runs(facts).held_elements_per_token * target.activation_bytes_per_element * pass_tokens
    blocks = program_blocks(pass_tokens, block)
    return math.ceil(whole * min(1.0, 2 * math.ceil(blocks / max(1, ring)) / blocks))


def _auto_prefill(facts: ModelFacts, tiles: Sequence[Tile], target: Target, workload: Workload, *,
                  chiplets: Sequence[int], kv: str, kv_dtype: str, kv_window: KVWindow | None, link_dtype: str,
                  routing: Routing | None) -> MemoryPlan:
    """The stationary prefill's memory plan, or the pipelined one's where it should serve the
    workload sooner: its prefill estimated `PIPELINED_MARGIN` times faster than the stationary
    one's (`_prefill_estimates_s`) by more than the decode steps up to the context lose to its
    larger staging (`_decode_loss_s`). So auto weighs the compiled workload's whole time, a
    prefill and context - prompt decode steps: at context 2048 and prompt 128 a decode step
    0.8 ms slower (Llama-3-70B x4, batch 16) costs 1.5 s, five times the 288 ms the pipelined
    prefill saves. `--prefill pipelined` takes it whatever the decode step pays."""
    def memory_for(prefill: str) -> MemoryPlan:
        return plan_memory(facts, tiles, target, workload, chiplets=chiplets, kv=kv, kv_dtype=kv_dtype,
                           kv_window=kv_window, prefill=prefill, link_dtype=link_dtype)

    stationary = memory_for("stationary")
    estimates = _prefill_estimates_s(facts, tiles, target, workload, chiplets, link_dtype, routing)
    if estimates is None or PIPELINED_MARGIN * estimates[1] >= estimates[0]:
        return stationary
    try:
        pipelined = memory_for("pipelined")
    except InfeasibleError:
        return stationary  # a card's share of a layer does not fit beside the caches
    held = sum(pipelined.reserve_bytes) - sum(stationary.reserve_bytes)
    lost_s = max(1, workload.context - workload.prompt) * _decode_loss_s(tiles, held, target, workload, chiplets, routing)
    return pipelined if PIPELINED_MARGIN * estimates[1] + lost_s < estimates[0] else stationary


def _prefill_estimates_s(facts: ModelFacts, tiles: Sequence[Tile], target: Target, workload: Workload,
                         chiplets: Sequence[int], link_dtype: str, routing: Routing | None) -> tuple[float, float] | None:
    """A stationary and a pipelined prefill's seconds, estimated before placement from what binds
    each; None where the pipelined one has nothing to gain (one card, or nothing streamed: nothing
    to copy). Stationary: a layer's weights are spread over every card, so each weight node's
    input goes from its layer's home card to the others and its output comes back, one layer
    after another (`_card_crossing_s`), while every channel streams at once. Pipelined: the cards
    stream their layers' share from their own channels in turn."""
    cards = len({target.card_of(c) for c in chiplets})
    streamed = _streamed_bytes(tiles, target, chiplets)
    if cards < 2 or streamed <= 0:
        return None
    spread_s = streamed / _streaming_bytes_per_s(target, chiplets)
    crossing_s = _card_crossing_s(facts, target, workload.tokens("prefill"), cards, link_dtype, routing)
    return max(spread_s, crossing_s), cards * spread_s


def _streaming_bytes_per_s(target: Target, chiplets: Sequence[int]) -> float:
    """What every LPDDR channel of the chiplets streams at once."""
    return len({target.channel_of(c) for c in chiplets}) * target.channel_bytes_per_s


def _streamed_bytes(tiles: Sequence[Tile], target: Target, chiplets: Sequence[int]) -> float:
    """The weight bytes SRAM cannot hold, estimated before placement (negative: room to spare)."""
    return sum(t.storage_bytes for t in tiles) - HOME_CARDS_FILL * target.chiplet.sram_bytes * len(chiplets)


def _decode_loss_s(tiles: Sequence[Tile], held: int, target: Target, workload: Workload, chiplets: Sequence[int],
                   routing: Routing | None) -> float:
    """What a decode step loses when `held` more bytes of SRAM are kept from the weights of a
    model that already streams: the coldest tiles still resident (an expert by the probability
    that a step's tokens fire it; the partitioner streams the coldest first) stream too, each
    read when it fires."""
    if held <= 0:
        return 0.0
    tokens = workload.tokens("decode")

    def fires(tile: Tile) -> float:
        return routing.fires(tile.layer, tile.expert, tokens) if routing is not None else 1.0

    # The tiles coldest first (stable: equal odds keep their order), laid end to end: the streamed
    # bytes come first, the `held` bytes after them are the ones that now stream too.
    start = max(0.0, _streamed_bytes(tiles, target, chiplets))
    read, offset = 0.0, 0.0
    for odds, nbytes in sorted(((fires(t), t.storage_bytes) for t in tiles), key=lambda pair: pair[0]):
        read += odds * max(0.0, min(offset + nbytes, start + held) - max(offset, start))
        offset += nbytes
    return read / _streaming_bytes_per_s(target, chiplets)


def _card_crossing_s(facts: ModelFacts, target: Target, tokens: int, cards: int, link_dtype: str = "fp16",
                     routing: Routing | None = None) -> float:
    """A pass's activations between cards when every weight is spread over `cards` cards: each
    weight node's input broadcast to the other cards, its output gathered back from them, through
    one card-to-card port at a time (a byte an element with `--link-dtype int8`); an expert's on
    the tokens routed to it."""
    elements = 0.0
    for name in facts.uses:
        node = facts.node(name)
        source = node.inputs[0]
        if source is None or node.op == "Gather" or any(out.name in facts.outputs for out in node.outputs):
            continue  # lookups and the output head (each sequence's last token) move little
        share = (routing.share(facts.layer_of_node[name], facts.expert_of[name])
                 if routing is not None and name in facts.expert_of and name in facts.layer_of_node else 1.0)
        elements += share * (facts.elements_per_token(source.name) * (cards - 1)
                             + facts.elements_per_token(node.outputs[0].name) * (cards - 1) / cards)
    element = 1 if link_dtype == "int8" else target.activation_bytes_per_element
    return target.links[2].transfer_s(elements * tokens * element)


def prefill_copies(placement: Placement, memory: MemoryPlan, target: Target, chiplets: Sequence[int]) -> dict[int, int]:
    """A pipelined prefill's copies of the streamed tiles: each one whose channel is on another card
    than its layer's home gets a copy in the LPDDR of a chiplet on the home's card, the one with
    the fewest of the layer's streamed bytes so far (a layer's loads spread over the card's
    channels), while that card's LPDDR has room; the prefill loads and computes it there. The
    decode step is unchanged. Returns tile -> that chiplet."""
    if memory.prefill_schedule != "pipelined":
        return {}
    num_c, homes = placement.num_chiplets, memory.kv.chiplet_of_layer
    ring: dict[int, list[int]] = {}
    for c in sorted(chiplets):
        ring.setdefault(target.card_of(c), []).append(c)
    used = dict.fromkeys(range(target.cards), 0)  # LPDDR bytes per card
    load: dict[tuple[int, int], int] = {}  # (layer, chiplet) -> the layer's streamed bytes it loads in a prefill
    moving: list[int] = []
    for t, (tile, w) in enumerate(zip(placement.tiles, placement.where, strict=True)):
        if w < num_c or not tile.storage_bytes:
            continue
        used[target.card_of_channel(w - num_c)] += tile.storage_bytes
        home = homes.get(tile.layer)
        if home is None or target.card_of_channel(w - num_c) == target.card_of(home):
            key = (tile.layer, placement.compute_chiplet[t])
            load[key] = load.get(key, 0) + tile.storage_bytes
        else:
            moving.append(t)
    copies: dict[int, int] = {}
    for t in moving:
        tile = placement.tiles[t]
        card = target.card_of(homes[tile.layer])
        if used[card] + tile.storage_bytes > target.lpddr_bytes_per_card:
            continue  # no room for the copy: the tile is read where it is, its activations cross cards
        c = min(ring[card], key=lambda c: (load.get((tile.layer, c), 0), c))
        copies[t] = c
        used[card] += tile.storage_bytes
        load[(tile.layer, c)] = load.get((tile.layer, c), 0) + tile.storage_bytes
    return copies


def with_prefill_copies(placement: Placement, copies: dict[int, int], target: Target) -> Placement:
    """The placement as a pipelined prefill reads it: each copied tile streamed from its copy's
    chiplet's channel and computed there."""
    if not copies:
        return placement
    num_c = placement.num_chiplets
    where, compute = list(placement.where), list(placement.compute_chiplet)
    for t, c in copies.items():
        where[t], compute[t] = num_c + target.channel_of(c), c
    return replace(placement, where=tuple(where), compute_chiplet=tuple(compute))


def _largest_layer_bytes(facts: ModelFacts, tiles: Sequence[Tile]) -> int:
    """The weight bytes of the largest layer a prefill runs every block through (lookups and the
    output head, which reads each sequence's last token only, load per use)."""
    per_layer: dict[int, set[int]] = {}
    for name, uses in facts.uses.items():
        node = facts.node(name)
        if node.op == "Gather" or any(out.name in facts.outputs for out in node.outputs):
            continue
        per_layer.setdefault(facts.layer_of_node[name], set()).update(u.tile for u in uses)
    return max((sum(tiles[t].storage_bytes for t in ts) for ts in per_layer.values()), default=0)


def activation_peak_bytes(facts: ModelFacts, target: Target, tokens: int, output_tokens: int, *,
                          refuse: bool = True) -> int:
    """Peak live activation bytes over the node order; with `refuse`, a value no chiplet could
    hold is an InfeasibleError naming its node. Memoized per facts (the sweep asks again)."""
    key = (tokens, output_tokens, refuse, target.activation_bytes_per_element, target.chiplet.sram_bytes)
    if key not in facts.peaks:
        facts.peaks[key] = _activation_peak_bytes(facts, target, tokens, output_tokens, refuse=refuse)
    return facts.peaks[key]


def _activation_peak_bytes(facts: ModelFacts, target: Target, tokens: int, output_tokens: int, *,
                           refuse: bool) -> int:
    scale = tokens / facts.graph_tokens
    output_scale = min(tokens, output_tokens) / facts.graph_tokens
    element = target.activation_bytes_per_element
    last_use: dict[str, int] = {}
    for index, node in enumerate(facts.order):
        for value in node.inputs:
            if value is not None and value.name in facts.value_elements:
                last_use[value.name] = index
    live = peak = 0
    ending: dict[int, int] = {}
    for index, node in enumerate(facts.order):
        for out in node.outputs:
            if out.name in facts.score_values or out.name not in facts.value_elements:
                continue
            factor = output_scale if out.name in facts.outputs else scale
            nbytes = math.ceil(facts.value_elements[out.name] * factor * element)
            if refuse and nbytes > target.chiplet.sram_bytes:
                raise InfeasibleError(
                    f"activation '{out.name}' needs {_mib(nbytes)} ({facts.value_elements[out.name]:,} elements) "
                    f"but a chiplet has {_mib(target.chiplet.sram_bytes)} of SRAM", node=node.name, op=node.op,
                    file=target.source, needed_bytes=nbytes, hint="no placement can hold it; check the model's shapes")
            live += nbytes
            end = last_use.get(out.name, index)
            ending[end] = ending.get(end, 0) + nbytes
        peak = max(peak, live)
        live -= ending.pop(index, 0)
    return peak


def _home_chiplets(target: Target, chiplets: Sequence[int], nbytes: int, reserve: int, layers: int,
                   layer_bytes: int) -> list[int]:
    """The chiplets of the fewest cards (in order) whose SRAM, less `reserve` a chiplet, holds
    `nbytes` at `HOME_CARDS_FILL`, and where each chiplet's share of the `layers` homes (their
    caches of `layer_bytes` each, when in SRAM) fits beside its reserve; every chiplet when none do."""
    by_card: dict[int, list[int]] = {}
    for c in chiplets:
        by_card.setdefault(target.card_of(c), []).append(c)
    sram = target.chiplet.sram_bytes
    chosen: list[int] = []
    for card in sorted(by_card):
        chosen += by_card[card]
        caches = -(-layers // len(chosen)) * layer_bytes  # the most homes dealt to one chiplet
        if HOME_CARDS_FILL * len(chosen) * max(0, sram - reserve) >= nbytes and reserve + caches < sram:
            return chosen
    return list(chiplets)


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def kv_beside_weights(memory: MemoryPlan, placement: Placement, facts: ModelFacts, target: Target) -> MemoryPlan:
    """Each layer's KV cache, and so its home (where its attention and norms run), moved next to its
    weights once they are placed: to the chiplet computing most of the layer's weight bytes, or the
    next such chiplet when that one lacks the room (its resident weights and reserve must still fit
    its SRAM). A layer whose weight chiplets all lack the room keeps the chiplet sizing gave it.

    Sizing assigns the caches before the weights are placed (the partitioner must know each
    chiplet's reserve, and places each layer's weights around its cache's chiplet); this moves the
    cache onto the chiplet doing most of the layer's weight work, which saves the home's trips
    to it."""
    kv = memory.kv
    if not kv.chiplet_of_layer:
        return memory
    work: dict[int, dict[int, int]] = {}
    for node, uses in facts.uses.items():
        layer = facts.layer_of_node.get(node)
        for use in uses:
            per = work.setdefault(layer if layer is not None else -1, {})
            c = placement.compute_chiplet[use.tile]
            per[c] = per.get(c, 0) + placement.tiles[use.tile].storage_bytes
    held = list(placement.chiplet_bytes)
    reserve = list(memory.reserve_bytes)
    owners = dict(kv.chiplet_of_layer)
    in_sram = kv.location == "sram"
    for layer in sorted(owners):
        # On a tie the cache stays on its card (then the first chiplet of the tie): dealt to the first
        # chiplet of each tie, every layer whose weights spread evenly over 4 cards went to chiplet 0,
        # and one card's port carried every layer's prefill activations to the others. Within the
        # card the first chiplet still wins: keeping each tied cache on its own chiplet took
        # Llama-3-70B x1's decode step from 91.1 to 102.3 ms.
        same_card = target.card_of(owners[layer])
        candidates = sorted(work.get(layer, {}).items(),
                            key=lambda item: (-item[1], target.card_of(item[0]) != same_card, item[0]))
        nbytes = kv.bytes_per_layer.get(layer, 0) if in_sram else 0
        for c, _ in candidates:
            if c == owners[layer]:
                break
            if held[c] + reserve[c] + nbytes <= target.chiplet.sram_bytes:
                reserve[owners[layer]] -= nbytes
                reserve[c] += nbytes
                owners[layer] = c
                break
    return replace(memory, kv=replace(kv, chiplet_of_layer=owners), reserve_bytes=tuple(reserve))


def settle_kv(memory: MemoryPlan, placement: Placement, facts: ModelFacts, target: Target,
              chiplets: Sequence[int], tokens: int) -> MemoryPlan:
    """The KV caches once the weights are placed: beside their weights (`kv_beside_weights`), then
    a streamed cache's blocks in the SRAM the weights left (`kv_in_free_sram`), or a cache kept in
    SRAM read in parts beside its home (`kv_split_in_sram`) by a decode step of `tokens`."""
    memory = kv_beside_weights(memory, placement, facts, target)
    if memory.kv.location == "sram":
        return kv_split_in_sram(memory, placement, facts, target, chiplets, tokens)
    return kv_in_free_sram(memory, placement, target, chiplets)


def kv_split_in_sram(memory: MemoryPlan, placement: Placement, facts: ModelFacts, target: Target,
                     chiplets: Sequence[int], tokens: int) -> MemoryPlan:
    """A cache kept in SRAM, each layer's blocks spread over its home and the chiplets nearest it
    on its card, as many as make its attention soonest: the parts are read at once, each by the
    chiplet holding it, and every part away from home costs the query out and a partial result
    back, through the home's port one after another (`build._attention`). Reading a layer's cache
    of Llama-3-8B at batch 16 (128 MiB) at one chiplet's SRAM speed takes 7.2 us, a quarter of
    the per-layer latency, on every layer's critical path; in the three parts the weights leave
    room for on 8 cards, 2.4 us, and the step 1.449 ms a token, was 1.578 (in eight parts, were
    there room, 1.424). A chiplet takes a part only where the weights leave it the room."""
    kv = memory.kv
    sram = target.chiplet.sram_bytes
    free = {c: sram - placement.chiplet_bytes[c] - memory.reserve_bytes[c] for c in chiplets}
    element = 1 if memory.link_dtype == "int8" else target.activation_bytes_per_element
    reserve = list(memory.reserve_bytes)
    blocks: dict[int, dict[int, int]] = {}
    for layer, nbytes in sorted(kv.bytes_per_layer.items()):
        home = kv.chiplet_of_layer[layer]
        size = kv.block_bytes(layer)
        if not nbytes or kv.blocks < 2:
            continue
        wire = tokens * facts.q_width.get(layer, facts.kv_width.get(layer, 0)) * element  # a query, a partial
        near = sorted((c for c in chiplets if c != home and target.card_of(c) == target.card_of(home)),
                      key=lambda c: (target.package_of(c) != target.package_of(home), c))
        read_s = size / target.chiplet.sram_bytes_per_s  # a block
        best, best_s = 1, kv.blocks * read_s
        helpers: list[int] = []
        moved_s = latency_s = 0.0
        for c in near:
            count = len(helpers) + 2
            share = kv.blocks // count
            if any(free[h] < share * size for h in (*helpers, c)):
                continue
            link = target.link_between(home, c)
            assert link is not None
            moved_s += 2 * link.occupancy_s(wire)
            latency_s = max(latency_s, 2 * link.latency_s)  # the query there, the partial back
            helpers.append(c)
            seconds = (kv.blocks - share * (count - 1)) * read_s + moved_s + latency_s
            if seconds < best_s:
                best, best_s = count, seconds
        if best == 1:
            continue
        share = kv.blocks // best
        blocks[layer] = {c: share for c in helpers[:best - 1]} | {home: kv.blocks - share * (best - 1)}
        for c, count in blocks[layer].items():
            free[c] -= count * size
    if not blocks:
        return memory
    kv = replace(kv, sram_blocks=blocks)
    for layer in blocks:
        reserve[kv.chiplet_of_layer[layer]] -= kv.bytes_per_layer[layer]
        for c, nbytes in kv.sram_parts(layer).items():
            reserve[c] += nbytes
    return replace(memory, kv=kv, reserve_bytes=tuple(reserve))


def kv_in_free_sram(memory: MemoryPlan, placement: Placement, target: Target, chiplets: Sequence[int]) -> MemoryPlan:
    """A cache in LPDDR with as many of its blocks kept in SRAM as the weights and reserves leave
    room for on the allowed chiplets. A decode step reads every held block once, as it reads every
    weight once, so a byte of cache in SRAM saves what a byte of weight would; the weights are
    placed first (the partitioner's knapsack) and the cache takes what is left. The layers take
    turns, `KV_SRAM_ROUND` blocks at a time, so that each keeps about the same share on chip: each
    on its home if it has room (read in place), else on the roomiest chiplet of the home's card,
    else on the roomiest of any (a part away from home sends its partial result there, as a
    streamed chunk does). The runtime hands out the pool's lowest block ids first: those are the
    blocks kept in SRAM."""
    kv = memory.kv
    if kv.location != "lpddr" or not kv.free_sram or not kv.bytes_per_layer:
        return memory
    sram = target.chiplet.sram_bytes
    free = {c: sram - placement.chiplet_bytes[c] - memory.reserve_bytes[c] for c in chiplets}
    need = {layer: kv.blocks for layer, nbytes in kv.bytes_per_layer.items() if nbytes}
    size = {layer: kv.block_bytes(layer) for layer in need}
    # A new part smaller than a streamed chunk saves no load, only adds a part to collect.
    least = {layer: -(-kv.chunk_bytes // size[layer]) for layer in need}
    blocks: dict[int, dict[int, int]] = {}
    while need:
        for layer in sorted(need):
            home = kv.chiplet_of_layer[layer]
            card = target.card_of(home)
            held = blocks.get(layer, {})
            roomy = [c for c in free if free[c] >= (1 if c in held else min(least[layer], need[layer])) * size[layer]]
            if not roomy:
                del need[layer]
                continue
            c = min(roomy, key=lambda c: (c != home, target.card_of(c) != card, -free[c], c))
            turn = KV_SRAM_ROUND if c in held else max(KV_SRAM_ROUND, least[layer])
            count = min(need[layer], turn, free[c] // size[layer])
            blocks[layer] = held | {c: held.get(c, 0) + count}
            free[c] -= count * size[layer]
            need[layer] -= count
            if not need[layer]:
                del need[layer]
    kv = replace(kv, sram_blocks=blocks)
    for layer, parts in blocks.items():
        # The attention completes where its last part is read: at home. A cache kept whole in SRAM
        # away from its home streams its last blocks instead, whose chunk is read at home.
        while parts and kv.chiplet_of_layer[layer] not in parts and not kv.streamed_bytes(layer):
            last = max(parts)
            parts[last] -= 1
            if not parts[last]:
                del parts[last]
    kv = replace(kv, sram_blocks={layer: parts for layer, parts in blocks.items() if parts})
    reserve = list(memory.reserve_bytes)
    for layer in blocks:
        for c, nbytes in kv.sram_parts(layer).items():
            reserve[c] += nbytes
    return replace(memory, kv=kv, reserve_bytes=tuple(reserve))
