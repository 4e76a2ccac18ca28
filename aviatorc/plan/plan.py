"""The plan: tiles and where they live, the programs for each phase, and what they predict.

One typed contract, from the scheduler to every reader: `schedule` builds a `Plan`, the checker
and the simulator read it, `aviatorc.load` gives it back from an artifact, and backends run its
programs. `Plan.to_dict()` is the body of `plan.json` (docs/plan-format.md): sorted where order
is not meaning, no timestamps, no absolute paths, so the same inputs give the same bytes, and
`Plan.from_dict(json)` reads it back checking every field (`aviatorc.plan.records`), so loading
an artifact and writing it again gives identical bytes.

plan.json is compact: the programs share one table of names and one of buffers (`Tables`), each
stream is a flat list of integers, and a tile is a row of numbers beside a table of the weights
it comes from.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from aviatorc.errors import AviatorError, ModelFormatError
from aviatorc.formats import LINK_DTYPES, WeightFormat
from aviatorc.plan.ir import PHASES, Program, Tables, Workload, tile_name
from aviatorc.plan.records import from_json, to_json

if TYPE_CHECKING:
    from aviatorc.target import Target

PLAN_SCHEMA_VERSION = 9
READABLE_PLAN_SCHEMAS = (2, 3, 4, 5, 6, 7, 8, 9)  # an older plan's missing fields take their defaults (FIELDS_SINCE)
# The memory fields each version added: 3, a bounded KV cache; 4, the weight-stationary prefill.
FIELDS_SINCE = {"kv_sinks": 3, "kv_recent": 3, "prefill_block_tokens": 4, "prefill_staging_bytes_per_chiplet": 4,
                "lora_bytes_per_chiplet": 6, "prefill_copies": 7, "link_dtype": 7, "kv_blocks": 8, "kv_block_tokens": 8,
                "kv_sram_blocks": 9}
# 5: a mixture of experts' routed step; 6: verify steps; 8: mixed steps (decodes and a prompt chunk)
PREDICTION_FIELDS_SINCE = {"routing": 5, "verify": 6, "mixed": 8}


@dataclass(frozen=True)
class PlannedTile:
    """Rows [k0, k1) x columns [n0, n1) of a weight's logical [k, n] layout (an embedding's rows are
    table rows; a tied head's columns are table rows), resident on `chiplet` or streamed from LPDDR
    `channel`; either way it computes on `compute_chiplet` (where a streamed tile is staged)."""

    weight: str
    layer: int
    role: str
    rows: tuple[int, int]
    cols: tuple[int, int]
    format: WeightFormat
    bytes: int
    compute_chiplet: int
    nodes: tuple[str, ...]
    chiplet: int | None = None
    channel: int | None = None

    @property
    def is_embedding(self) -> bool:
        """A row range of a lookup table, stored as its rows (not a column strip)."""
        return self.role == "embedding"

    @property
    def streamed(self) -> bool:
        return self.channel is not None


@dataclass(frozen=True)
class KVWindow:
    """A bounded cache: each sequence keeps its first `sinks` positions and at least its last
    `recent`, evicted `recent` at a time (`aviatorc.runtime.Session`), so at most sinks + 2 x recent."""

    sinks: int
    recent: int

    def held(self, context: int) -> int:
        """The most positions a sequence of `context` tokens holds."""
        return min(context, self.sinks + 2 * self.recent)


def kv_pool_blocks(batch: int, held: int, block_tokens: int, window: KVWindow | None) -> int:
    """The runtime's pool of KV blocks for `batch` sequences of `held` positions each: whole blocks,
    and under a bounded cache one block more, for a step's positions before it evicts."""
    return batch * (-(-held // block_tokens) + (1 if window else 0))


@dataclass(frozen=True)
class MemoryFigures:
    """The memory plan: the KV cache, activation scratch and streamed-weight staging per chiplet."""

    kv_dtype: str
    kv_location: str  # "sram" or "lpddr"
    kv_bytes: int
    kv_chunk_bytes: int
    kv_layer_chiplets: dict[int, int]  # layer -> the chiplet holding (sram) or reading (lpddr) its cache
    scratch_bytes_per_chiplet: int
    prefill_chunk_tokens: int
    staging_bytes_per_chiplet: int
    stage_chunk_bytes: int
    reserve_bytes: tuple[int, ...]
    # A bounded cache (`--kv-recent`, `KVWindow`): each sequence keeps its first kv_sinks positions
    # and its last kv_recent to 2 x kv_recent; kv_recent 0 keeps every position.
    kv_sinks: int = 0
    kv_recent: int = 0
    # The weight-stationary prefill (0, 0: chunked, every weight streamed again per chunk): a pass's
    # token blocks, and the SRAM per chiplet a layer's staged tiles take while every block runs.
    prefill_block_tokens: int = 0
    prefill_staging_bytes_per_chiplet: int = 0
    # LoRA adapters (the workload's lora_rank, max_loras): their A and B matrices, spread over the chiplets.
    lora_bytes_per_chiplet: int = 0
    # A pipelined prefill: streamed tile -> the chiplet whose LPDDR channel holds its copy, which
    # loads and computes it in the prefill program (the decode program reads the tile as `tiles` say).
    prefill_copies: dict[int, int] = field(default_factory=dict)
    # Activations sent between chiplets: "fp16" as computed, "int8" codes with an exponent per 32
    # values (`--link-dtype`, `aviatorc.quant.link`); the runtime rounds what it sends so.
    link_dtype: str = "fp16"
    # The runtime's pool of KV blocks (`aviatorc.runtime.paged`): kv_blocks blocks of kv_block_tokens
    # positions of every layer, in kv_location: each sequence of the batch its held positions, rounded
    # up to whole blocks (0, 0: an older plan; the session sizes the pool the same way).
    kv_blocks: int = 0
    kv_block_tokens: int = 0
    # layer -> chiplet -> blocks of that layer kept in SRAM there. A cache in LPDDR: the pool's first
    # blocks, in the chiplets' order, which a decode step reads in place; the rest stream
    # (`aviatorc.schedule.memory.kv_in_free_sram`). A cache in SRAM: the parts it is read in beside
    # its home (`kv_split_in_sram`); a layer not named is held whole at its home.
    kv_sram_blocks: dict[int, dict[int, int]] = field(default_factory=dict)

    @property
    def kv_window(self) -> KVWindow | None:
        return KVWindow(self.kv_sinks, self.kv_recent) if self.kv_recent else None

    @property
    def kv_sram_positions(self) -> int:
        """The positions at the pool's start that every layer keeps in SRAM: the whole pool for a
        cache in SRAM, else the fewest blocks any layer keeps there."""
        if self.kv_location == "sram":
            return self.kv_blocks * self.kv_block_tokens
        kept = [sum(self.kv_sram_blocks.get(layer, {}).values()) for layer in self.kv_layer_chiplets]
        return min(kept, default=0) * self.kv_block_tokens

    def __post_init__(self) -> None:
        if self.link_dtype not in LINK_DTYPES:
            raise ValueError(f"link_dtype must be one of {', '.join(LINK_DTYPES)}, not {self.link_dtype!r}")
        if not (0 <= self.kv_sinks <= MAX_CONTEXT and 0 <= self.kv_recent <= MAX_CONTEXT):
            raise ValueError(f"kv_sinks and kv_recent must lie in [0, {MAX_CONTEXT}], not {self.kv_sinks} and "
                             f"{self.kv_recent}")


@dataclass(frozen=True)
class PhaseFigures:
    """One simulated program: its makespan and how busy the busiest resources were."""

    step_s: float
    tokens_per_s: float
    lpddr_busy_fraction_max: float
    compute_busy_fraction_max: float
    link_busy_fraction_max: float
    chunks: int = 1  # a prefill runs in `chunks` programs of `chunk_tokens` tokens
    chunk_tokens: int = 0


@dataclass(frozen=True)
class BoundFigures:
    """The physical bound (`aviatorc.schedule.bound`), each figure with its terms; the binding
    term is the largest. `cards` is the number of cards the bound's best use of the machine takes."""

    token_s: float
    ttft_s: float
    cold_s: float
    token_terms: dict[str, float]
    ttft_terms: dict[str, float]
    cards: int

    @property
    def token_binding(self) -> str:
        return max(sorted(self.token_terms), key=lambda k: self.token_terms[k])

    @property
    def ttft_binding(self) -> str:
        return max(sorted(self.ttft_terms), key=lambda k: self.ttft_terms[k])


@dataclass(frozen=True)
class FigureRange:
    """A predicted figure with the range the target's assumed figures span: `low` / `high` with
    every assumption at its favourable / unfavourable end, and per assumption (dotted key) the
    figure with only that one at its low and at its high end."""

    nominal: float
    low: float
    high: float
    sensitivity: dict[str, tuple[float, float]]

    @property
    def most_sensitive(self) -> str:
        """The assumption whose range moves the figure most ('' when there is none)."""
        spread = {k: abs(b - a) for k, (a, b) in self.sensitivity.items()}
        return max(sorted(spread), key=lambda k: spread[k]) if spread and max(spread.values()) > 0 else ""


@dataclass(frozen=True)
class SweepPoint:
    """Time per token at another batch or context, on this placement; with `positions` k + 1, the
    step that verifies k drafted tokens of each sequence (speculative decoding); with `chunk` c, the
    decode step that also prefills c tokens of an arriving prompt (chunked prefill's mixed step)."""

    batch: int
    context: int
    fits: bool
    reason: str = ""
    kv_location: str = ""
    time_per_token_s: float = 0.0
    tokens_per_s: float = 0.0
    bound_s: float = 0.0
    efficiency: float = 0.0
    positions: int = 1
    chunk: int = 0


@dataclass(frozen=True)
class RoutingFigures:
    """A mixture of experts' decode step over sampled routings (`aviatorc.schedule.routed`)."""

    source: str  # where the routing came from: "uniform", "zipf:1.2", "file:NAME", "measured on ..."
    samples: int  # routings simulated
    mean_s: float  # the expected step: the plan's time per token
    p50_s: float
    p99_s: float
    all_experts_s: float  # this plan's step with every expert on every token (its worst routing)
    experts_per_step: float  # experts a step reads, in expectation, over all blocks
    experts_total: int
    # Where experts stream: the mean step of the same placement prefetching experts ahead of their
    # routing, by the predictor's hit rate ("0.9": 9 of 10 routed experts named in advance).
    prefetch: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Prediction:
    """What the plan predicts on its target, next to the physical bound."""

    time_per_token_s: float
    tokens_per_s: float
    ttft_s: float
    cold_start_s: float
    cold_start_naive_order_s: float
    decode: PhaseFigures
    prefill: PhaseFigures
    bound: BoundFigures
    efficiency: float  # bound / simulated time per token
    ttft_efficiency: float
    sram_peak_bytes: dict[int, int]
    ranges: dict[str, FigureRange] = field(default_factory=dict)  # "time_per_token_s", "ttft_s", "cold_start_s"
    sweep: tuple[SweepPoint, ...] = ()
    routing: RoutingFigures | None = None  # a mixture of experts' routed steps (time_per_token_s is their mean)
    verify: tuple[SweepPoint, ...] = ()  # the steps verifying k drafts per sequence, at the compiled batch and context
    mixed: tuple[SweepPoint, ...] = ()  # decode steps that also prefill a prompt chunk, at the compiled batch and context


@dataclass(frozen=True)
class ColdStartOrder:
    """Copying the weights onto the cards: the tile order, and when the first token comes."""

    order: tuple[int, ...]  # tile indices, first use first
    first_token_s: float
    naive_first_token_s: float  # tensors in name order
    load_s: float  # until the last byte is on the cards


@dataclass
class Plan:
    """A compiled plan. `target` (the resolved target) and `trace` (the simulated decode step as a
    Chrome trace) travel beside it: target.toml and trace.json in an artifact, not plan.json."""

    target_name: str
    target_sha256: str  # of the resolved target TOML written beside the plan
    workload: Workload
    chiplets: tuple[int, ...]  # the chiplets this model may use
    tiles: tuple[PlannedTile, ...]
    programs: dict[str, Program]  # "decode", "prefill"
    memory: MemoryFigures
    prediction: Prediction
    cold_start: ColdStartOrder
    prefetch: bool = True
    notes: tuple[str, ...] = ()
    tensor_dtypes: dict[str, str] = field(default_factory=dict)  # stored as raw 16-bit words: their real dtype
    target: Target | None = field(default=None, compare=False)
    trace: dict[str, Any] | None = field(default=None, compare=False)

    def tile_id(self, index: int) -> str:
        return tile_name(index)

    def tiles_in(self, phase: str, target: Target) -> tuple[PlannedTile, ...]:
        """The tiles as `phase`'s program reads them: in a pipelined prefill, a copied tile streams
        from its copy's chiplet's channel and computes there (`MemoryFigures.prefill_copies`)."""
        copies = self.memory.prefill_copies if phase == "prefill" else {}
        if not copies:
            return self.tiles
        return tuple(replace(tile, channel=target.channel_of(copies[t]), compute_chiplet=copies[t])
                     if t in copies else tile for t, tile in enumerate(self.tiles))

    # -- JSON ----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        tables = Tables()
        programs = {phase: program.to_dict(tables) for phase, program in sorted(self.programs.items())}
        weights, rows = _tile_table(self.tiles)
        return {
            "schema_version": PLAN_SCHEMA_VERSION,
            "target": {"name": self.target_name, "sha256": self.target_sha256, "file": "target.toml"},
            "workload": self.workload.to_dict(),
            "chiplets": list(self.chiplets),
            "prefetch": self.prefetch,
            "weights": weights,
            "tiles": rows,
            "memory": to_json(self.memory),
            "tables": tables.to_dict(),
            "programs": programs,
            "cold_start": to_json(self.cold_start),
            "prediction": to_json(self.prediction),
            "notes": list(self.notes),
            "tensor_dtypes": dict(sorted(self.tensor_dtypes.items())),
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "plan.json") -> Plan:
        """A plan read back from its JSON, every field checked (a ModelFormatError names the field)."""
        if not isinstance(data, dict):
            raise ModelFormatError(f"{where} must hold a JSON object")
        version = data.get("schema_version")
        if version not in READABLE_PLAN_SCHEMAS:
            raise ModelFormatError(f"{where}: schema version {version!r} is not supported (this aviatorc reads "
                                   f"{' and '.join(map(str, READABLE_PLAN_SCHEMAS))}; recompile the model)")
        for section, since in (("memory", FIELDS_SINCE), ("prediction", PREDICTION_FIELDS_SINCE)):
            newer = sorted(f for f in data.get(section, {}) if since.get(f, 0) > version) \
                if isinstance(data.get(section), dict) else []
            if newer:
                raise ModelFormatError(f"{where}: {section}.{newer[0]} is a schema version {since[newer[0]]} field, "
                                       f"not version {version}'s")
        expected = {"schema_version", "target", "workload", "chiplets", "prefetch", "weights", "tiles", "memory",
                    "tables", "programs", "cold_start", "prediction", "notes", "tensor_dtypes"}
        missing = sorted(expected - set(data))
        if missing:
            raise ModelFormatError(f"{where}: missing '{missing[0]}'")
        unknown = sorted(set(data) - expected)
        if unknown:
            raise ModelFormatError(f"{where}: unknown field '{unknown[0]}'")
        target = from_json(_TargetRef, data["target"], f"{where}: target")
        try:
            tables = Tables.from_dict(data["tables"])
        except (KeyError, TypeError, ValueError, IndexError) as error:
            raise ModelFormatError(f"{where}: malformed tables: {type(error).__name__}: {error}") from None
        programs_data = data["programs"]
        if not isinstance(programs_data, dict) or any(p not in PHASES for p in programs_data):
            raise ModelFormatError(f"{where}: programs must be an object of phases ({', '.join(PHASES)})")
        programs = {}
        for phase, body in programs_data.items():
            program = Program.from_dict(body, tables)
            if program.phase != phase:
                raise ModelFormatError(f"{where}: programs.{phase} holds a '{program.phase}' program")
            programs[phase] = program
        plan = cls(
            target_name=target.name, target_sha256=target.sha256,
            workload=from_json(_StoredWorkload, data["workload"], f"{where}: workload").workload,
            chiplets=from_json(_Chiplets, {"chiplets": data["chiplets"]}, where).chiplets,
            tiles=_tiles_from(data["weights"], data["tiles"], where),
            programs=programs,
            memory=from_json(MemoryFigures, data["memory"], f"{where}: memory"),
            prediction=from_json(Prediction, data["prediction"], f"{where}: prediction"),
            cold_start=from_json(ColdStartOrder, data["cold_start"], f"{where}: cold_start"),
            prefetch=from_json(_Flag, {"value": data["prefetch"]}, f"{where}: prefetch").value,
            notes=from_json(_Notes, {"notes": data["notes"]}, where).notes,
            tensor_dtypes=from_json(_Dtypes, {"dtypes": data["tensor_dtypes"]}, where).dtypes,
        )
        for layer, parts in sorted(plan.memory.kv_sram_blocks.items()):
            count = sum(parts.values())
            if (layer not in plan.memory.kv_layer_chiplets or any(c not in plan.chiplets or n < 1 for c, n in parts.items())
                    or count > plan.memory.kv_blocks):
                raise ModelFormatError(f"{where}: memory.kv_sram_blocks gives layer {layer} {count} blocks on chiplets "
                                       f"{sorted(parts)}: a layer with a cache, at least one block on each of the plan's "
                                       f"chiplets named, at most the pool's {plan.memory.kv_blocks} in all")
        for t, c in sorted(plan.memory.prefill_copies.items()):
            if not 0 <= t < len(plan.tiles) or plan.tiles[t].channel is None or c not in plan.chiplets:
                raise ModelFormatError(f"{where}: memory.prefill_copies names tile {t} on chiplet {c}: a copy is of a "
                                       f"streamed tile, on one of the plan's chiplets")
        return plan


# Small records that let `from_json` check plan.json's plain sections.
MAX_BATCH = 4096  # sequences decoded together (vendors quote 48-64)
MAX_CONTEXT = 1 << 24  # tokens per sequence (the config import's bound on max_position_embeddings)
MAX_LORA = 1 << 12  # a LoRA rank, and adapters at once


@dataclass(frozen=True)
class _StoredWorkload:
    """A plan's workload, bounded: a runtime and a server size their KV slots and buffers by it."""

    batch: int
    context: int
    prompt: int
    lora_rank: int = 0
    max_loras: int = 0

    def __post_init__(self) -> None:
        for name, high in (("batch", MAX_BATCH), ("context", MAX_CONTEXT), ("prompt", self.context)):
            if not 1 <= getattr(self, name) <= high:
                raise ValueError(f"{name} must be in [1, {high:,}], not {getattr(self, name):,}")
        for name in ("lora_rank", "max_loras"):
            if not 0 <= getattr(self, name) <= MAX_LORA:
                raise ValueError(f"{name} must be in [0, {MAX_LORA:,}], not {getattr(self, name):,}")

    @property
    def workload(self) -> Workload:
        return Workload(self.batch, self.context, self.prompt, lora_rank=self.lora_rank, max_loras=self.max_loras)

@dataclass(frozen=True)
class _TargetRef:
    name: str
    sha256: str
    file: str


@dataclass(frozen=True)
class _Chiplets:
    chiplets: tuple[int, ...]


@dataclass(frozen=True)
class _Flag:
    value: bool


@dataclass(frozen=True)
class _Notes:
    notes: tuple[str, ...]


@dataclass(frozen=True)
class _Dtypes:
    dtypes: dict[str, str]


@dataclass(frozen=True)
class _Weight:
    """What a weight's tiles share: plan.json's `weights` table."""

    name: str
    layer: int
    role: str
    format: dict[str, Any]
    nodes: tuple[str, ...]


# A tile row: [weight index, k0, k1, n0, n1, bytes, compute chiplet, resident chiplet or -1, channel or -1].
_TILE_ROW = 9


def _tile_table(tiles: tuple[PlannedTile, ...]) -> tuple[list[dict[str, Any]], list[list[int]]]:
    weights: list[dict[str, Any]] = []
    index: dict[tuple[str, int, str, str, tuple[str, ...]], int] = {}
    rows = []
    for t in tiles:
        attrs = t.format.to_attrs()
        key = (t.weight, t.layer, t.role, repr(sorted(attrs.items())), t.nodes)
        if key not in index:
            index[key] = len(weights)
            weights.append({"name": t.weight, "layer": t.layer, "role": t.role, "format": attrs, "nodes": list(t.nodes)})
        rows.append([index[key], *t.rows, *t.cols, t.bytes, t.compute_chiplet,
                     -1 if t.chiplet is None else t.chiplet, -1 if t.channel is None else t.channel])
    return weights, rows


def _tiles_from(weights_data: Any, rows: Any, where: str) -> tuple[PlannedTile, ...]:
    if not isinstance(weights_data, list) or not isinstance(rows, list):
        raise ModelFormatError(f"{where}: weights and tiles must be lists")
    weights = [from_json(_Weight, w, f"{where}: weights[{i}]") for i, w in enumerate(weights_data)]
    formats = []
    for i, w in enumerate(weights):
        try:
            formats.append(WeightFormat.from_attrs(w.format))
        except (KeyError, TypeError, ValueError, AviatorError) as error:
            raise ModelFormatError(f"{where}: weights[{i}].format: {error}") from None
    tiles = []
    for i, row in enumerate(rows):
        if (not isinstance(row, list) or len(row) != _TILE_ROW
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in row)):
            raise ModelFormatError(f"{where}: tiles[{i}] must be {_TILE_ROW} integers")
        w, k0, k1, n0, n1, nbytes, compute, chiplet, channel = row
        if not 0 <= w < len(weights):
            raise ModelFormatError(f"{where}: tiles[{i}] names weight {w} of {len(weights)}")
        if not (0 <= k0 < k1 and 0 <= n0 < n1 and nbytes >= 0 and compute >= 0):
            raise ModelFormatError(f"{where}: tiles[{i}] has an empty range or a negative size")
        if (chiplet < 0) == (channel < 0) or min(chiplet, channel) < -1:  # -1: none
            raise ModelFormatError(f"{where}: tiles[{i}] must be resident on a chiplet or streamed from a channel "
                                   f"(the other -1), not chiplet {chiplet} and channel {channel}")
        spec = weights[w]
        stored = formats[w].storage_bytes(k1 - k0, n1 - n0)
        if nbytes not in (0, stored):  # 0: an alias of a tied weight, stored once elsewhere
            raise ModelFormatError(f"{where}: tiles[{i}] holds {nbytes:,} bytes, but rows {k0}:{k1} x columns "
                                   f"{n0}:{n1} in {formats[w].name} are {stored:,}")
        tiles.append(PlannedTile(spec.name, spec.layer, spec.role, (k0, k1), (n0, n1), formats[w], nbytes, compute,
                                 spec.nodes, None if chiplet < 0 else chiplet, None if channel < 0 else channel))
    return tuple(tiles)
