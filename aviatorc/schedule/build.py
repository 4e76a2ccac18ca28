"""The scheduler: a placed graph becomes one instruction stream per chiplet, with prefetch.

Steps, for one phase (a decode step of `batch` tokens, or one prefill pass: see below for how
a weight-stationary pass changes steps 1-3):

1. Homes: each layer's non-weight nodes (norms, rotary, attention, residuals) run on its home
   chiplet: the chiplet holding (or reading) its KV cache, else the one computing most of its
   weight tiles. Weight nodes run where their tiles compute: one `compute` per tile, a column
   strip of a MatMul or a row range of a lookup.
2. Data flow, in the graph's topological order (so every stream follows one global order and
   no two streams can wait on each other in a cycle): a value produced on one chiplet and read
   on another is sent right after it is produced (`send`) and received right before its first
   reader there (`recv`). A weight node's parts are sent to its layer's home and collected
   there (concatenated columns, or summed disjoint rows) before anyone reads the whole value.
3. Weights: a resident tile is read from its buffer. A streamed tile (and, with the KV cache in
   LPDDR, each KV chunk) is staged: `load` from its LPDDR channel into a staging buffer on its
   compute chiplet, `wait`, `compute`, `free`. With prefetch, each stream issues its loads in
   the order it will use them as early as its staging budget allows (after the `free` that
   made room), so the next layers' weights arrive during this layer's compute; without it, a
   load is issued just before its use. A KV chunk streams from the channel of the chiplet
   reading it.
4. Costs written on each `compute`: a strip's FLOPs (2 x tokens x k x n) and the bytes it reads
   from SRAM; attention's FLOPs and KV bytes read, plus the new tokens' K and V written (into
   SRAM, or a `store` to the layer's LPDDR channel when the cache lives there); for every other
   node but the shape ops (views: reshapes, transposes, slices), the activation bytes it moves
   through the vector units; the target's per-layer latency flagged once per transformer layer
   (a layer with attention: the vendor's "per layer"), on its first compute.
5. The end: the graph's first output (the logits) goes to the host (`host`), which samples.

A prefill program is one pass over `prefill_chunk_tokens` of the prompt, weight-stationary: the
nodes are walked in runs of one layer, and each run is emitted once per token block (values
carry the block, `name@b`), so the layer's streamed tiles are loaded before its first block and
freed after its last, on every chiplet whose share of them fits `prefill_staging_bytes` (a
chiplet that cannot hold its share re-loads it per block). The blocks run as a wavefront, two in
flight (`_wavefront`), each with its non-weight work on its own chiplet of the home's card
(`block_home`). A program block stands for a batch of the memory plan's blocks of
`prefill_block_tokens`, which run one after another on the same chiplets (the program times this
coarser pipeline, which fills and drains more slowly than the finer one): `memory.program_blocks`.
The output head (the logits of each sequence's last
token: the node that makes the graph's first output) runs once, in the last block, whose tokens
stand for each sequence's last.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aviatorc.ir import Node, Value
from aviatorc.ir.types import FLOAT_DTYPES
from aviatorc.partition.placement import Placement
from aviatorc.partition.tiling import Tile, lora_reachable
from aviatorc.plan.ir import (
    Buffer,
    Compute,
    Free,
    Host,
    Instruction,
    Load,
    Part,
    Program,
    Recv,
    Send,
    Store,
    ValueRef,
    Wait,
    Workload,
    block_value,
)
from aviatorc.quant.link import LINK_GROUP
from aviatorc.schedule.memory import MemoryPlan
from aviatorc.schedule.model import ModelFacts, TileUse, layer_runs
from aviatorc.target import Target


@dataclass(frozen=True)
class _Staged:
    """A use of a staged buffer: loaded from LPDDR `channel`, consumed by `compute`; its load comes
    before its `first` use and its free after its `last` (one buffer serves every prefill block)."""

    buffer: Buffer
    channel: int
    compute: Compute
    first: bool = True
    last: bool = True
    expert: tuple[int, int] | None = None  # (layer, expert) of a routed expert's tile: loaded on demand


RESIDENT_LAG = 1 / 8  # of a stage of resident layers: how far each prefill block walks behind the one before


def resident_buffer(tile: int) -> str:
    return f"w.t{tile}"


def build_program(facts: ModelFacts, placement: Placement, target: Target, memory: MemoryPlan,
                  workload: Workload, phase: str, *, chiplets: Sequence[int], prefetch: bool = True,
                  routed: bool = False) -> Program:
    """`routed`: a decode step runs only the experts its tokens route to, so an expert's streamed
    weights are loaded on demand, once the stream reaches the expert (its input has come from the
    router's block), never prefetched before the routing is known."""
    blocks = 1 if phase == "decode" else memory.prefill_blocks
    tokens = workload.tokens("decode") if phase == "decode" else math.ceil(memory.prefill_chunk_tokens / blocks)
    builder = _Builder(facts, placement, target, memory, workload, phase, tokens, list(chiplets), blocks)
    builder.on_demand = routed and phase == "decode"
    builder.run()
    return builder.finish(prefetch)


class _Builder:
    def __init__(self, facts: ModelFacts, placement: Placement, target: Target, memory: MemoryPlan,
                 workload: Workload, phase: str, tokens: int, chiplets: list[int], blocks: int = 1) -> None:
        self.facts, self.placement, self.target, self.memory = facts, placement, target, memory
        self.workload, self.phase, self.tokens, self.chiplets = workload, phase, tokens, chiplets
        self.blocks, self.block = blocks, 0
        # The logits of every token a decode step brings (its drafts' too, when it verifies them)
        # and of a mixed step's chunk's last token, of each sequence's last token in a prefill pass.
        self.output_tokens = workload.outputs() if phase == "decode" else min(tokens * blocks, workload.batch)
        self.stationary: set[int] = set()  # chiplets holding this run's streamed tiles for all its blocks
        self.held: dict[tuple[str, int, int], Buffer] = {}  # (node, tile, column) -> its stationary buffer
        self.program = Program(phase, workload)
        self.entries: dict[int, list[Instruction | _Staged]] = {c: [] for c in chiplets}
        self.location: dict[str, int] = {}  # value -> chiplet holding it whole
        self.delivered: set[tuple[str, int]] = set()
        self.sender: dict[tuple[str, int], int] = {}  # (value, reader) -> who sends it there, if not its producer
        self.charged_layers: set[int] = set()
        self.attention_layers = set(facts.attention.values())
        self.homes = self._homes()
        self.kv_offsets = self._kv_offsets()
        self.skipped = facts.weight_chain
        # A prefill's token blocks each keep their non-weight work on a chiplet of their own on the
        # home's card, so the blocks' vector work runs side by side (`block_home`).
        cards: dict[int, list[int]] = {}
        for c in chiplets:
            cards.setdefault(target.card_of(c), []).append(c)
        self.cards = cards
        self.expert_chiplet = self._expert_chiplets()
        self.node_chiplets = {(n.name, b): self._chiplets_of(n, b) for n in facts.order for b in range(blocks)}
        self.staged_names: dict[int, int] = {}
        self.on_demand = False  # routed experts' loads wait for the stream to reach the expert

    # -- placement of nodes --------------------------------------------------------------

    def _homes(self) -> dict[int, int]:
        work: dict[int, dict[int, int]] = {}
        for node, uses in self.facts.uses.items():
            layer = self.facts.layer_of_node[node]
            for use in uses:
                c = self.placement.compute_chiplet[use.tile]
                per = work.setdefault(layer, {})
                per[c] = per.get(c, 0) + self.placement.tiles[use.tile].storage_bytes
        homes: dict[int, int] = {}
        previous = self.chiplets[0]
        for layer in self.facts.layers:
            if layer in self.memory.kv.chiplet_of_layer:
                home = self.memory.kv.chiplet_of_layer[layer]
            elif layer in work:
                home = max(sorted(work[layer]), key=lambda c: work[layer][c])
            else:
                home = previous
            homes[layer] = previous = home
        return homes

    def _expert_chiplets(self) -> dict[str, int]:
        """An expert's nodes -> the one chiplet computing all of its weights, for the experts that
        have one: its activation function runs there and its outputs are collected there, so the
        expert runs on its chiplet start to end (its dispatch and combine stay at the block's home)."""
        chips: dict[tuple[int, int], set[int]] = {}
        for t, tile in enumerate(self.placement.tiles):
            if tile.expert >= 0:
                chips.setdefault((tile.layer, tile.expert), set()).add(self.placement.compute_chiplet[t])
        found = {}
        for name, expert in self.facts.expert_of.items():
            where = chips.get((self.facts.layer_of_node[name], expert), set())
            if len(where) == 1 and self.facts.node(name).op != "MoEDispatch":
                found[name] = next(iter(where))
        return found

    def node_home(self, node: Node, block: int | None = None) -> int:
        """Where a node's non-weight work runs and its weight parts are collected."""
        where = self.expert_chiplet.get(node.name)
        return where if where is not None else self.block_home(self.facts.layer_of_node[node.name], block)

    def _chiplets_of(self, node: Node, block: int) -> list[int]:
        uses = self.facts.uses.get(node.name)
        if uses:
            return sorted({self.placement.compute_chiplet[u.tile] for u in uses})
        if node.name in self.facts.attention:
            return sorted({c for c, _, _ in self._kv_reads(node)})
        return [self.node_home(node, block)]

    def block_home(self, layer: int, block: int | None = None) -> int:
        """Where a block's non-weight work of `layer` runs and its weight nodes' parts are collected:
        the layer's home, or for prefill block b the b-th chiplet after it on its card. Attention
        stays at the home, beside the layer's KV cache. (Spreading the blocks over the cards, so
        that each block's transfers leave from its own card's port, took Llama-3-70B x4 at batch 16
        from 479 to 552 ms: attention's round trips to the home then cross cards.)"""
        home = self.homes[layer]
        block = self.block if block is None else block
        if not block:
            return home
        ring = self.cards[self.target.card_of(home)]
        return ring[(ring.index(home) + block) % len(ring)]

    def _kv_reads(self, node: Node) -> list[tuple[int, int, bool]]:
        """Where a decode step reads each part of the attention node's KV cache: (chiplet, bytes,
        streamed). The blocks kept in SRAM are read where they are (`KVPlan.sram_parts`); the rest
        streams in chunks spread over the allowed chiplets, the last at home. Just home in prefill
        and where the cache takes no room."""
        layer = self.facts.layer_of_node[node.name]
        home = self.homes[layer]
        kv = self.memory.kv
        if self.phase == "prefill" or not kv.bytes_per_layer.get(layer, 0):
            return [(home, 0, False)]
        reads = [(c, nbytes, False) for c, nbytes in sorted(kv.sram_parts(layer).items(), key=lambda p: p[0] == home)]
        streamed = kv.streamed_bytes(layer)
        chunks = math.ceil(streamed / kv.chunk_bytes) if streamed else 0
        start = self.chiplets.index(home) + self.kv_offsets.get(layer, 0)
        where = [self.chiplets[(start + 1 + i) % len(self.chiplets)] for i in range(chunks - 1)] + [home] * (chunks > 0)
        return reads + [(c, min(kv.chunk_bytes, streamed - i * kv.chunk_bytes), True) for i, c in enumerate(where)]

    def _kv_offsets(self) -> dict[int, int]:
        """Layer -> how far past its home the streamed chunks of a cache kept partly in SRAM start,
        where they are fewer than the chiplets: past the chunks of the layers before it, so that
        together they go round the chiplets' channels evenly. (Each starting just past its home,
        the few chunks left streamed all came from the channels beside the homes: Llama-3-8B INT4
        x4 at batch 16, 2.00 against 1.70 ms a token. Where the whole cache streams, shifting the
        chunks off their home's neighbours cost Llama-3-8B x1 at batch 16 6%, Llama-3-70B x1 0.7%.)"""
        kv, offsets, total = self.memory.kv, {}, 0
        for layer in sorted(kv.sram_blocks):
            chunks = math.ceil(kv.streamed_bytes(layer) / max(1, kv.chunk_bytes))
            if 0 < chunks < len(self.chiplets):
                offsets[layer] = total
                total += chunks - 1
        return offsets

    def kv_buffer(self, layer: int, chiplet: int) -> str:
        """The buffer of the layer's cache kept in SRAM on `chiplet`: the whole cache's when it all
        lives there, else that chiplet's share of its blocks."""
        kv = self.memory.kv
        return f"kv.{layer}" if kv.location == "sram" and layer not in kv.sram_blocks else f"kv.{layer}.on{chiplet}"

    # -- sizes ---------------------------------------------------------------------------

    def key(self, name: str) -> str:
        """A value as this block's: its name, with the block in a multi-block prefill."""
        return block_value(name, self.block) if self.blocks > 1 else name

    def makes_logits(self, node: Node) -> bool:
        """Whether `node` makes the graph's first output, the logits (of each sequence's last token
        only; other outputs, such as a KV cache the graph returns, are every token's)."""
        return bool(self.facts.output_order) and any(out.name == self.facts.output_order[0] for out in node.outputs)

    def runs_now(self, node: Node) -> bool:
        """The logits are made in a prefill's last block only."""
        return self.block == self.blocks - 1 or not self.makes_logits(node)

    def value_bytes(self, value: Value | str) -> int:
        name = value if isinstance(value, str) else value.name
        tokens = self.output_tokens if self.facts.output_order and name == self.facts.output_order[0] else self.tokens
        return max(1, math.ceil(self.facts.elements_per_token(name) * tokens * self.target.activation_bytes_per_element))

    def wire_bytes(self, value: Value) -> int:
        """What sending `value` carries (`on_wire`), its rows as wide as its last dim."""
        shape = value.type.shape
        width = shape[-1] if shape and isinstance(shape[-1], int) else 1
        return self.on_wire(self.value_bytes(value), width, value.type.dtype)

    def on_wire(self, nbytes: int, width: int, dtype: str = "float32") -> int:
        """The bytes a transfer of `nbytes` of activations carries: as computed, or with
        `--link-dtype int8` one byte an element and a one-byte exponent per group of `LINK_GROUP`
        along each row of `width` elements (the runtime's rounding: `aviatorc.quant.link.int8_groups`);
        integer values (ids) go as they are."""
        if self.memory.link_dtype != "int8" or dtype not in FLOAT_DTYPES:
            return nbytes
        elements = math.ceil(nbytes / self.target.activation_bytes_per_element)
        width = max(1, width)
        return elements + math.ceil(elements / width) * math.ceil(width / LINK_GROUP)

    def vector_bytes(self, node: Node) -> int:
        """Activation bytes a node moves through the vector units: its inputs and outputs (0 for views)."""
        return sum(self.value_bytes(name) for name in self.facts.vector_values(node))

    def kv_written_bytes(self, layer: int) -> int:
        """The K and V of this program's tokens in one layer, as the cache stores them."""
        kv = self.memory.kv
        per_token = kv.bytes_per_layer.get(layer, 0) / max(1, self.workload.batch * kv.tokens)
        return math.ceil(per_token * self.tokens)

    # -- emission ------------------------------------------------------------------------

    def run(self) -> None:
        for c in self.chiplets:
            self.program.add_buffer(Buffer(f"scratch.{c}", c, self.memory.scratch_bytes, "scratch"))
        for t, w in enumerate(self.placement.where):
            if w < self.placement.num_chiplets:
                self.program.add_buffer(Buffer(resident_buffer(t), w, self.placement.tiles[t].storage_bytes,
                                               "resident", tile=t))
        for layer in sorted(self.memory.kv.bytes_per_layer):
            for c, nbytes in sorted(self.memory.kv.sram_parts(layer).items()):
                self.program.add_buffer(Buffer(self.kv_buffer(layer, c), c, nbytes, "kv", layer=layer))
        for run, lag in self._stages():
            self.stationary = self._stationary_chiplets(run) if self.blocks > 1 else set()
            for _, block, index in _wavefront(len(run), self.blocks, lag):
                self.block, node = block, run[index]
                if not self.runs_now(node):
                    continue
                uses = self.facts.uses.get(node.name)
                if uses:
                    self._weight_node(node, uses)
                else:
                    self._plain_node(node)
        self._to_host()

    def _stages(self) -> list[tuple[list[Node], int]]:
        """The layer runs the prefill's blocks walk, each with its wavefront's lag in nodes. Every
        block runs through a run that streams weights before the next run starts (so each streamed
        byte is loaded once); consecutive runs of resident weights whose homes span cards are one
        stage, which the blocks walk as a pipeline, each `RESIDENT_LAG` of the stage behind the one
        before: the chiplets of later layers (another card's) work on the first blocks while the
        earlier ones take the rest. Llama-3-8B at batch 16 on 4 cards, all resident: 23.5 ms to the
        first tokens in step, 16.6 ms as a pipeline (a lag of 1/12: 20.4, 1/5: 17.7). On one card,
        where the same chiplets serve every layer's blocks, 23.3 in step and 26.0 as a pipeline."""
        stages: list[tuple[list[Node], int]] = []
        resident: list[list[Node]] = []

        def flush() -> None:
            layers = {self.facts.layer_of_node[node.name] for run in resident for node in run}
            if len({self.target.card_of(self.homes[layer]) for layer in layers if layer in self.homes}) > 1:
                stage = [node for run in resident for node in run]
                stages.append((stage, max(1, round(len(stage) * RESIDENT_LAG))))
            else:  # one card's chiplets serve every layer's blocks: in step they overlap best
                stages.extend((run, 1) for run in resident)
            resident.clear()

        for run in layer_runs(self.facts).runs:
            if self.blocks > 1 and not self._streamed_need(run):
                resident.append(run)
                continue
            flush()
            stages.append((run, 1))
        flush()
        return stages

    def _stationary_chiplets(self, run: list[Node]) -> set[int]:
        """The chiplets whose streamed tiles of this run fit their prefill staging for all blocks."""
        return {c for c, nbytes in self._streamed_need(run).items() if nbytes <= self.memory.prefill_staging_bytes}

    def _streamed_need(self, run: list[Node]) -> dict[int, int]:
        """Per chiplet, the bytes of the run's streamed tiles it computes (lookups and the logits,
        which load per use, left out)."""
        need: dict[int, int] = {}
        num_c = self.placement.num_chiplets
        for node in run:
            if node.op == "Gather" or self.makes_logits(node) or node.name not in self.facts.uses:
                continue
            for use in self.facts.uses[node.name]:
                if self.placement.where[use.tile] >= num_c:
                    tile, c = self.placement.tiles[use.tile], self.placement.compute_chiplet[use.tile]
                    need[c] = need.get(c, 0) + sum(tile.format.storage_bytes(tile.k, b - a)
                                                   for a, b in self._pieces(tile, use, streamed=True))
        return need

    def _to_host(self) -> None:
        """The logits (the graph's first output) go to the host, which samples the next token."""
        outputs = [name for name in self.facts.output_order if self.key(name) in self.location]
        if outputs:
            name = outputs[0]
            self.entries[self.location[self.key(name)]].append(Host(ValueRef(self.key(name)), self.value_bytes(name)))

    def _plain_node(self, node: Node) -> None:
        layer = self.facts.layer_of_node[node.name]
        home = self.homes[layer] if node.name in self.facts.attention else self.node_home(node)
        self._receive_inputs(node, home)
        if node.name in self.facts.attention:
            self._attention(node, layer, home)
        else:
            self._compute(home, layer, node=node.name, bufs=(), flops=0, bytes=0, vector_bytes=self.vector_bytes(node),
                          kind="fp16", part=None)
        for out in node.outputs:
            self.location[self.key(out.name)] = home
            self._send_to_readers(out, home)

    def _weight_node(self, node: Node, uses: list[TileUse]) -> None:
        layer = self.facts.layer_of_node[node.name]
        home = self.node_home(node)
        out = node.outputs[0]
        rows_total = max(u.stop for u in uses)
        # A prefill computes the graph's outputs (logits) for each sequence's last token only.
        tokens = self.output_tokens if self.makes_logits(node) else self.tokens
        num_c = self.placement.num_chiplets
        for use in uses:
            tile = self.placement.tiles[use.tile]
            c = self.placement.compute_chiplet[use.tile]
            w = self.placement.where[use.tile]
            self._receive_inputs(node, c)
            for start, stop in self._pieces(tile, use, streamed=w >= num_c):
                part = Part(use.part.kind, start, stop)
                if node.op == "Gather":  # each token reads one row: expected bytes in this row range
                    read = min(tile.storage_bytes, math.ceil(tile.storage_bytes * tokens / max(1, rows_total)))
                    flops = 0
                    part_bytes = self.wire_bytes(out)  # a partial lookup is as wide as the whole
                else:
                    read = tile.format.storage_bytes(tile.k, stop - start)
                    flops = 2 * tokens * tile.k * (stop - start)
                    part_bytes = self.on_wire(math.ceil(self.value_bytes(out) * (stop - start) / max(1, rows_total)),
                                              stop - start, out.type.dtype)
                fields = dict(node=node.name, flops=flops, bytes=read, vector_bytes=0, kind=tile.format.kind, part=part)
                if self.workload.lora_rank and node.op != "Gather" and lora_reachable(tile):
                    # LoRA adapters beside it: each token's x @ A, then those columns of (x A) @ B,
                    # reading the slices of as many adapters as the step's sequences can run.
                    low = self.workload.lora_rank * (tile.k + stop - start)
                    fields["flops"] = flops + 2 * tokens * low
                    fields["bytes"] = read + 2 * low * min(self.workload.batch, self.workload.max_loras)
                if w < num_c:
                    self._compute(c, layer, bufs=(resident_buffer(use.tile),), **fields)
                else:
                    self.entries[c].append(self._staged_tile(node, use.tile, start, c, read, w - num_c, layer, fields))
                if c != home:
                    label = ValueRef(self.key(out.name), part)
                    self.entries[c].append(Send(label, home, part_bytes))
                    self.entries[home].append(Recv(label, c, part_bytes))
        self.location[self.key(out.name)] = home
        self._send_to_readers(out, home)

    def _staged_tile(self, node: Node, tile: int, start: int, chiplet: int, nbytes: int, channel: int, layer: int,
                     fields: dict[str, Any]) -> _Staged:
        """A streamed piece's use: its own buffer, or on a stationary chiplet the one buffer every
        block of the run computes from (loaded before the first, freed after the last)."""
        key = (node.name, tile, start)
        held = chiplet in self.stationary and node.op != "Gather"
        first = not held or key not in self.held
        if first:
            buffer = self.held[key] = self._staging_buffer(f"s.t{tile}.{start}", chiplet, nbytes, tile=tile)
        buffer = self.held[key]
        compute = self._make_compute(chiplet, layer, bufs=(buffer.name,), **fields)
        expert = self.placement.tiles[tile].expert
        return _Staged(buffer, channel, compute, first=first, last=not held or self.block == self.blocks - 1,
                       expert=(layer, expert) if self.on_demand and expert >= 0 else None)

    def _pieces(self, tile: Tile, use: TileUse, *, streamed: bool) -> list[tuple[int, int]]:
        """The column ranges one use is computed in: the whole strip, or for a streamed strip
        sub-strips (whole matrix units) of at most one staging chunk each."""
        if not streamed or use.part.kind == "rows" or tile.storage_bytes <= self.memory.stage_chunk_bytes:
            return [(use.start, use.stop)]
        unit = self.target.matrix_unit_n
        per_unit = max(1, tile.format.storage_bytes(tile.k, unit))
        step = max(1, self.memory.stage_chunk_bytes // per_unit) * unit
        return [(a, min(a + step, use.stop)) for a in range(use.start, use.stop, step)]

    def _attention(self, node: Node, layer: int, home: int) -> None:
        kv = self.memory.kv
        width = self.facts.kv_width.get(layer, 0)
        q_width = self.facts.q_width.get(layer, width)
        kind = "int8" if kv.dtype == "int8" else "fp16"
        written = self.kv_written_bytes(layer)
        in_sram = kv.location == "sram" and layer in kv.bytes_per_layer
        if self.phase == "prefill":
            # A chunk of c tokens attends to the prompt before it: on average half of it (causal).
            context = max(1, min(self.workload.prompt // 2, kv.tokens))
            flops = 4 * self.tokens * context * q_width
            bufs = (self.kv_buffer(layer, home),) if in_sram else ()
            self._compute(home, layer, node=node.name, bufs=bufs, flops=flops, bytes=written if in_sram else 0,
                          vector_bytes=0, kind=kind, part=None)
            self._write_back(home, layer, written, in_sram)
            return
        # Every position attends to its sequence's whole cache, which is read once for all of them.
        # Its parts are read where they are (`_kv_reads`: the pool's blocks, split by positions), a
        # streamed chunk from the channel of the chiplet reading it, so every channel carries its
        # share of every layer's cache. A part attends over its positions with every head, as
        # split-K decoding does: its partial output is as wide as the node's (the softmax's running
        # max and sum beside it are a few bytes a head). The partials are reduced on the way home, as
        # collective libraries reduce: a chiplet's own parts where it reads them, those of one card
        # on its first part's chiplet, which sends one partial across; the home's card's go home.
        # The last part is the home's own, read while the others' partials arrive: it stands for
        # the node's completion, which takes them in as they come (their reduction's few bytes
        # of vector work left out).
        flops = 4 * self.tokens * kv.tokens * q_width
        total = kv.bytes_per_layer.get(layer, 0)
        reads = self._kv_reads(node)
        if reads == [(home, reads[0][1], False)]:  # all of it beside the attention
            bufs = (self.kv_buffer(layer, home),) if total else ()
            self._compute(home, layer, node=node.name, bufs=bufs, flops=flops, bytes=total + written, vector_bytes=0,
                          kind=kind, part=None)
            return
        parts = len(reads)
        out = node.outputs[0]
        partial_bytes = self.on_wire(self.tokens * q_width * self.target.activation_bytes_per_element, q_width)
        relays: dict[int, int] = {self.target.card_of(home): home}  # card -> where its partials are reduced
        last = {c: i for i, (c, _, _) in enumerate(reads)}  # chiplet -> its last part, which sends its partial
        forwarded: list[tuple[int, ValueRef]] = []  # (relay, the partial it sends home)
        arrivals: list[Recv] = []  # the partials home takes in after reading its own part
        for i, (c, nbytes, streamed) in enumerate(reads):
            part = Part("kv", i, parts)
            if i == parts - 1:
                for relay, label in forwarded:
                    self.entries[relay].append(Send(label, home, partial_bytes))
                    arrivals.append(Recv(label, relay, partial_bytes))
            self._receive_inputs(node, c)
            fields = dict(node=node.name, flops=flops * nbytes // total, bytes=nbytes, vector_bytes=0, kind=kind,
                          part=part)
            if streamed:
                buffer = self._staging_buffer(f"kv.{layer}.{i}", c, nbytes, layer=layer)
                compute = self._make_compute(c, layer, bufs=(buffer.name,), **fields)
                self.entries[c].append(_Staged(buffer, self.target.channel_of(c), compute))
            else:
                self._compute(c, layer, bufs=(self.kv_buffer(layer, c),), **fields)
            relay = relays.setdefault(self.target.card_of(c), c)
            label = ValueRef(self.key(out.name), part)
            if i != last[c] or c == home:
                continue  # a chiplet sends its partial once, after its last part
            if relay == c:
                forwarded.append((c, label))
                continue
            self.entries[c].append(Send(label, relay, partial_bytes))
            receive = Recv(label, c, partial_bytes)
            if relay == home:
                arrivals.append(receive)
            else:
                self.entries[relay].append(receive)
        self.entries[home].extend(arrivals)
        self._write_back(home, layer, written, in_sram)

    def _write_back(self, home: int, layer: int, nbytes: int, in_sram: bool) -> None:
        """The new tokens' K and V into a cache kept in LPDDR: a store to the home's channel."""
        if nbytes and not in_sram and layer in self.memory.kv.bytes_per_layer:
            self.entries[home].append(Store(f"kv.{layer}", self.target.channel_of(home), nbytes))

    def _staging_buffer(self, base: str, chiplet: int, nbytes: int, *, tile: int | None = None,
                        layer: int | None = None) -> Buffer:
        name = base
        if name in self.program.buffers:  # a tile staged twice (a tied table's lookup and head)
            name = f"{base}.{sum(1 for b in self.program.buffers if b.startswith(base + '.')) + 1}"
        return self.program.add_buffer(Buffer(name, chiplet, nbytes, "staging", tile=tile, layer=layer))

    def _make_compute(self, chiplet: int, layer: int, **fields: Any) -> Compute:
        # The per-layer latency, once per transformer layer (a layer with attention), on its first compute.
        latency = layer in self.attention_layers and layer not in self.charged_layers
        if latency:
            self.charged_layers.add(layer)
        return Compute(layer_latency=latency, **fields)

    def _compute(self, chiplet: int, layer: int, **fields: Any) -> None:
        self.entries[chiplet].append(self._make_compute(chiplet, layer, **fields))

    def _receive_inputs(self, node: Node, chiplet: int) -> None:
        """Recv each input `node` reads on `chiplet` (`_readers`) that is not there yet."""
        weight = node.inputs[0] if node.op == "Gather" and node.name in self.facts.uses else (
            node.inputs[1] if node.name in self.facts.uses else None)
        for value in node.inputs:
            if (value is None or value is weight or value.is_initializer or self.key(value.name) not in self.location
                    or chiplet not in self._readers(node, value)):
                continue
            name = self.key(value.name)
            source = self.sender.get((name, chiplet), self.location[name])
            if source == chiplet or (name, chiplet) in self.delivered:
                continue
            self.delivered.add((name, chiplet))
            self.entries[chiplet].append(Recv(ValueRef(name), source, self.wire_bytes(value)))

    def _send_to_readers(self, value: Value, source: int) -> None:
        """Send `value` now to every other chiplet that will read it (the recv comes at the reader)."""
        targets = sorted({c for user in value.users if user.name not in self.skipped and self.runs_now(user)
                          for c in self._readers(user, value) if c != source})
        self._broadcast(value, source, targets)

    def _readers(self, user: Node, value: Value) -> list[int]:
        """The chiplets where `user` reads `value`: every chiplet computing a part of it, except
        that an attention's parts away from home read only its query (each attends over the cache
        it holds); the new tokens' keys and values, and the mask, go home, where the newest
        positions are written and the node completes."""
        if user.name in self.facts.attention and value is not user.inputs[0]:
            return [self.homes[self.facts.layer_of_node[user.name]]]
        return self.node_chiplets[(user.name, self.block)]

    def _broadcast(self, value: Value, source: int, targets: list[int]) -> None:
        """A tree, as collective libraries broadcast: a copy crosses to each other card (then to
        each other package) as a binomial tree over them (`_across`), where the group's first
        reader receives it at once and forwards it to the rest of its group. A copy per reader
        would serialize them all on the source's slowest port; a copy per group from the source
        still serializes the groups: 7 other cards took 7 crossings in turn, the tree 3."""
        card, package = self.target.card_of, self.target.package_of
        level = card if any(card(c) != card(source) for c in targets) else (
            package if any(package(c) != package(source) for c in targets) else None)
        if level is None:
            name, nbytes = self.key(value.name), self.wire_bytes(value)
            for c in targets:
                self.entries[source].append(Send(ValueRef(name), c, nbytes))
                self.sender[(name, c)] = source
            return
        groups: dict[int, list[int]] = {}
        for c in targets:
            groups.setdefault(level(c), []).append(c)
        own = groups.pop(level(source), [])
        self._across(value, source, [members for _, members in sorted(groups.items())])
        if own:
            self._broadcast(value, source, own)

    def _across(self, value: Value, holder: int, groups: list[list[int]]) -> None:
        """`holder` sends to the first reader of the far half of `groups`, which carries the value
        on to that half while `holder` goes on with the near half: every round doubles the
        groups that have it."""
        name, nbytes = self.key(value.name), self.wire_bytes(value)
        while groups:
            far, groups = groups[len(groups) // 2:], groups[:len(groups) // 2]
            relay = far[0][0]
            self.entries[holder].append(Send(ValueRef(name), relay, nbytes))
            self.entries[relay].append(Recv(ValueRef(name), holder, nbytes))
            self.delivered.add((name, relay))
            self._across(value, relay, far[1:])
            if far[0][1:]:
                self._broadcast(value, relay, far[0][1:])

    # -- loads ---------------------------------------------------------------------------

    def finish(self, prefetch: bool) -> Program:
        staging = self.memory.prefill_staging_bytes if self.phase == "prefill" else self.memory.staging_bytes
        for c in self.chiplets:
            budget = max(staging, self.memory.staging_bytes) if prefetch else 0
            for ins in _with_loads(self.entries[c], budget):
                self.program.emit(c, ins)
        return self.program


def _with_loads(entries: list[Instruction | _Staged], budget: int) -> list[Instruction]:
    """Insert each staged buffer's `load` (in first-use order, as early as `budget` bytes of staging
    allow; budget 0: just before its first use), `wait` before its first compute and `free` after its last.
    A routed expert's load is not issued before the stream reaches the first use of an expert of its
    block: from there the block's routing is known, and every routed expert's loads can go out."""
    staged = [e for e in entries if isinstance(e, _Staged) and e.first]
    out: list[Instruction] = []
    issued = 0  # staged uses whose load is out
    occupancy = 0
    reached: set[int] = set()  # the layers whose routing the stream knows

    def known(use: _Staged) -> bool:
        return use.expert is None or use.expert[0] in reached

    def issue(upto: int) -> None:
        nonlocal issued, occupancy
        while issued < len(staged) and (issued < upto or (
                occupancy + staged[issued].buffer.bytes <= budget and known(staged[issued]))):
            use = staged[issued]
            out.append(Load(use.buffer.name, use.channel, use.buffer.bytes))
            occupancy += use.buffer.bytes
            issued += 1

    issue(0)
    position = 0
    for entry in entries:
        if not isinstance(entry, _Staged):
            out.append(entry)
            continue
        if entry.expert is not None:
            reached.add(entry.expert[0])
        if entry.first:
            position += 1
            issue(position)  # this buffer's own load, whatever the budget says
            out.append(Wait(entry.buffer.name))
        out.append(entry.compute)
        if entry.last:
            out.append(Free(entry.buffer.name))
            occupancy -= entry.buffer.bytes
            issue(0)
    return out


def _wavefront(nodes: int, blocks: int, lag: int = 1) -> list[tuple[int, int, int]]:
    """The order a run's (block, node) pairs are emitted in: a diagonal wavefront, each block `lag`
    nodes behind the one before it, so every block is in flight and each stream's next block
    overlaps the previous one's wait on others. Within a block the nodes keep their order, and a
    block's node comes after the previous block's: still one global order. Each block half a run
    behind the one before (2 in flight) took 34.5 ms to Llama-3-8B's first tokens at batch 16 on 4
    cards, 465 ms to Llama-3-70B's; one node behind, 23.5 and 400 ms, the program no longer."""
    return sorted((index + block * lag, block, index) for block in range(blocks) for index in range(nodes))
