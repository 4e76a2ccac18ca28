"""Compile options (and the server's limits): one vocabulary for the Python API and the CLI.

`aviatorc.compile(source, quant="int4", group_size=32, ...)` and
`aviatorc compile MODEL --quant int4 --group-size 32 ...` build the same `CompileOptions`;
validation lives here so both report the same errors.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aviatorc.errors import OptionError
from aviatorc.formats import GROUP_SIZES, LINK_DTYPES

if TYPE_CHECKING:  # the target package imports this module (check_cards)
    from aviatorc.target.spec import Target

QUANT_CHOICES = ("int8", "int4", "mxint8", "mxint4", "fp16", "bf16")
SPARSITY_CHOICES = ("2:4",)
# awq: AWQ's input-channel scales, then round-to-nearest; awq-gptq: the same scales, then GPTQ on the
# scaled weight (its Hessian scaled to match).
CALIBRATION_METHODS = ("rtn", "gptq", "awq", "awq-gptq")
SPARSITY_METHODS = ("magnitude", "wanda", "sparsegpt")
ACTIVATION_METHODS = ("minmax", "percentile")
KV_CACHE_CHOICES = ("auto", "sram", "lpddr")
KV_DTYPE_CHOICES = ("fp16", "bf16", "int8")
LINK_DTYPE_CHOICES = LINK_DTYPES
SOLVER_CHOICES = ("auto", "cpsat", "greedy")  # the partitioner's (partition.AUTO_GAP)
PREFILL_CHOICES = ("auto", "stationary", "pipelined", "chunked")  # aviatorc.schedule.memory.PREFILL_SCHEDULES
DEFAULT_GROUP_SIZE = 32  # int4 and MX when group_size is None; int8 stays per output channel


@dataclass(frozen=True)
class CompileOptions:
    """Everything that shapes a compile, except the model and the calibration data."""

    target: str | Target | None = None  # a shipped target name, a path to a TOML file, or a Target
    cards: int | None = None
    quant: str | None = None
    # Rows along K sharing one scale (32/64/128). None: the format's default, 32 for int4 and MX, per
    # output channel for int8 (group-wise int8 only when asked for: `group_size=128`); 0 asks for
    # per-channel int8 explicitly. `weight_group_size` is what the weights get.
    group_size: int | None = None
    # int4 zero points. None: the default, asymmetric with an fp16 offset per group (symmetric under
    # 2:4); False: 4-bit zero points (`int4_zero` in passes/quantize.py, with the figures behind it:
    # tools/bench_defaults.py and tools/bench_int4_default.py).
    symmetric: bool | None = None
    sparsity: str | None = None
    sparsity_method: str = "magnitude"  # "wanda" / "sparsegpt" need calibration data
    quant_method: str | None = None  # None: "gptq" for int4 with calibration data, else "rtn"
    keep_fp16: tuple[str, ...] = ()  # fnmatch patterns of weight or node names kept in FP16
    activations: str | None = None  # "minmax" or "percentile": W8A8 activation ranges
    fuse_qkv: bool = True
    passes: tuple[str, ...] | None = None  # an explicit pipeline overrides the one built from options
    print_ir_after_change: bool = False
    seed: int = 0
    # The workload the plan is scheduled for (decode: `batch` sequences with `context` tokens of
    # KV cache; prefill: prompts of `prompt` tokens), and how.
    batch: int = 1
    context: int = 2048
    prompt: int = 128
    prefetch: bool = True  # overlap streamed weights' loads with compute (off: load just before use)
    ranges: bool = True  # re-time the plan over the target's assumed figures (their ranges and sensitivity)
    sweep: bool = True  # time per token over other batches and contexts
    kv_cache: str = "auto"  # "auto", "sram" or "lpddr"
    kv_dtype: str = "fp16"  # "fp16", "bf16" or "int8"
    # Activations sent between chiplets: as computed ("fp16"), or "int8" codes with a power-of-two
    # exponent per 32 values (`aviatorc.quant.link`), which halves the bytes on the links; the runtime
    # rounds them so, and the outputs change by what that costs (tests/runtime/test_link_int8.py).
    link_dtype: str = "fp16"
    # A bounded cache for long contexts (StreamingLLM's attention sinks and recent window): each
    # sequence keeps its first `kv_sinks` positions and its last `kv_recent` or more, the ones between
    # evicted `kv_recent` at a time. None keeps every position. The plan sizes and times the cache at
    # the most it holds (sinks + 2 x recent); the runtime evicts so.
    kv_recent: int | None = None
    kv_sinks: int = 4
    # The partitioner: "greedy", or "cpsat" (greedy, then CP-SAT per layer). Greedy by default: on the
    # scheduled plans of tools/bench_plan.py CP-SAT changed the simulated time per token by at most
    # 0.01% while taking about 10x the partition time (BENCHMARKS.md, "Does CP-SAT earn its place?").
    solver: str = "greedy"
    # A mixture of experts' routing (`aviatorc.routing`): "uniform", "zipf:S" or a JSON file of each
    # expert's share per layer. None: measured on the calibration data when there is some, else uniform.
    routing: str | None = None
    # The prefill schedule: "stationary" streams each weight once per pass over the prompt (its
    # SRAM for a layer's staged tiles and the pass's hand-off comes from the weights, so a decode
    # step streams a little more); "pipelined" is the same with each layer on its home's card,
    # reading copies of its streamed tiles from that card's LPDDR, so that a pass's activations
    # stay on the card (for large prompts over several cards); "chunked" re-streams every weight
    # per chunk, as main did; "auto" takes pipelined where it is estimated to pay, else stationary.
    prefill: str = "auto"
    # Confine the placement to these chiplets (resident tiles and compute), so that models can
    # share a server in isolation: "0-7,12" (--chiplets), range(0, 8) or a tuple; None: all.
    chiplets: tuple[int, ...] | None = None
    # LoRA adapters served beside the weights (`aviatorc serve --lora`): their rank and how many at
    # once, for which the plan reserves SRAM and counts the work (0: none).
    lora_rank: int = 0
    max_loras: int = 1
    extra: dict[str, object] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.quant is not None and self.quant not in QUANT_CHOICES:
            raise OptionError(f"unknown quantization '{self.quant}'", hint=f"choose one of {', '.join(QUANT_CHOICES)}")
        if self.sparsity is not None and self.sparsity not in SPARSITY_CHOICES:
            raise OptionError(f"unknown sparsity '{self.sparsity}'", hint="the only structured sparsity is '2:4'")
        check_group_size(self.quant, self.group_size)
        if self.quant_method is not None and self.quant_method not in CALIBRATION_METHODS:
            raise OptionError(f"unknown quantization method '{self.quant_method}'",
                              hint=f"choose one of {', '.join(CALIBRATION_METHODS)}")
        if self.sparsity_method not in SPARSITY_METHODS:
            raise OptionError(f"unknown sparsity method '{self.sparsity_method}'",
                              hint=f"choose one of {', '.join(SPARSITY_METHODS)}")
        if self.activations is not None and self.activations not in ACTIVATION_METHODS:
            raise OptionError(f"unknown activation calibration '{self.activations}'", hint="choose minmax or percentile")
        for name in ("batch", "context", "prompt"):  # a plan for no sequence or no token is no plan
            if getattr(self, name) < 1:
                raise OptionError(f"{name} (--{name}) must be at least 1, got {getattr(self, name)}")
        if self.kv_cache not in KV_CACHE_CHOICES:
            raise OptionError(f"unknown KV cache placement '{self.kv_cache}'",
                              hint=f"choose one of {', '.join(KV_CACHE_CHOICES)}")
        if self.solver not in SOLVER_CHOICES:
            raise OptionError(f"unknown partition solver '{self.solver}'", hint=f"choose one of {', '.join(SOLVER_CHOICES)}")
        if self.routing is not None and not (self.routing == "uniform" or self.routing.startswith("zipf:")
                                             or self.routing.endswith(".json")):
            raise OptionError(f"unknown routing '{self.routing}'", hint="choose uniform, zipf:S (e.g. zipf:1.2) or a "
                              "FILE.json of each expert's share per layer")
        if self.prefill not in PREFILL_CHOICES:
            raise OptionError(f"unknown prefill schedule '{self.prefill}'", hint=f"choose one of {', '.join(PREFILL_CHOICES)}")
        if self.link_dtype not in LINK_DTYPE_CHOICES:
            raise OptionError(f"unknown link type '{self.link_dtype}'", hint=f"choose one of {', '.join(LINK_DTYPE_CHOICES)}")
        if self.kv_dtype not in KV_DTYPE_CHOICES:
            raise OptionError(f"unknown KV cache type '{self.kv_dtype}'", hint=f"choose one of {', '.join(KV_DTYPE_CHOICES)}")
        if self.kv_recent is not None and not (1 <= self.kv_recent <= self.context and 0 <= self.kv_sinks <= self.context):
            raise OptionError(f"a KV window keeps 1 to {self.context:,} recent positions (the context) and 0 to "
                              f"{self.context:,} sinks, not --kv-recent {self.kv_recent} --kv-sinks {self.kv_sinks}",
                              hint="for example --kv-recent 1024 --kv-sinks 4")
        if not 0 <= self.lora_rank <= 4096 or not 1 <= self.max_loras <= 4096:
            raise OptionError(f"--lora-rank must lie in [0, 4096] and --max-loras in [1, 4096], not {self.lora_rank} "
                              f"and {self.max_loras}", hint="for example --lora-rank 16 --max-loras 4")
        check_cards(self.cards)
        object.__setattr__(self, "chiplets", parse_chiplets(self.chiplets))

    @property
    def weight_group_size(self) -> int:
        """The group size the quantized weights are stored with: `group_size`, or where it is None the
        format's default (32 for int4 and MX, 0 for int8: per output channel); 0 for 16-bit weights."""
        if self.quant in ("int4", "mxint8", "mxint4"):
            return self.group_size or DEFAULT_GROUP_SIZE
        if self.quant == "int8":
            return self.group_size or 0
        return 0


def check_group_size(quant: str | None, group_size: int | None) -> None:
    """A group size (`--group-size`, `group_size=`) is None (the format's default), one of GROUP_SIZES,
    or 0 for per-channel int8."""
    if group_size is None or group_size in GROUP_SIZES:
        return
    if group_size == 0 and quant in ("int8", None, "fp16", "bf16"):
        return
    if group_size == 0:
        raise OptionError(f"{quant} weights need a group size; 0 (per output channel) is int8's alone",
                          hint=f"choose one of {', '.join(map(str, GROUP_SIZES))}, or leave it out for "
                               f"{DEFAULT_GROUP_SIZE}")
    raise OptionError(f"group size {group_size} is not supported",
                      hint=f"choose one of {', '.join(map(str, GROUP_SIZES))}"
                           + (", or 0 for per output channel" if quant == "int8" else ""))


def check_cards(cards: object) -> None:
    """A card count (`--cards`, `cards=`) is None or a whole number of at least 1: the one check
    `compile` and `target show` share, so both word a bad count the same way."""
    if cards is not None and (isinstance(cards, bool) or not isinstance(cards, int) or cards < 1):
        raise OptionError(f"cards (--cards) must be at least 1, got {cards!r}")


def parse_chiplets(spec: str | Iterable[int] | None, num_chiplets: int | None = None) -> tuple[int, ...] | None:
    """Chiplet ids from "0-7,12" (ranges inclusive), a range or an iterable of ints: sorted, unique.

    With `num_chiplets` (the target's), every id must be below it. The one parser for the CLI
    (--chiplets) and the API (chiplets=...); None stays None (every chiplet)."""
    if spec is None:
        return None
    ids: set[int] = set()
    if isinstance(spec, str):
        for part in (p.strip() for p in spec.split(",")):
            match = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", part)
            if match is None:
                raise OptionError(f"chiplets (--chiplets) '{spec}': cannot read '{part}'",
                                  hint="write chiplet ids and inclusive ranges, like '0-7,12'")
            first, last = int(match.group(1)), int(match.group(2) or match.group(1))
            if last < first:
                raise OptionError(f"chiplets (--chiplets) '{spec}': range '{part}' runs backwards",
                                  hint="write the lower id first, like '0-7'")
            ids.update(range(first, last + 1))
    else:
        try:
            values = list(spec)
        except TypeError:
            raise OptionError(f"chiplets must be a string like '0-7,12', a range or ids, got {spec!r}") from None
        for value in values:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise OptionError(f"chiplets: {value!r} is not a chiplet id (an int >= 0)")
            ids.add(int(value))
    if not ids:
        raise OptionError("chiplets (--chiplets) names no chiplet", hint="like '0-7', or leave it out for all")
    chosen = tuple(sorted(ids))
    if num_chiplets is not None and chosen[-1] >= num_chiplets:
        outside = [c for c in chosen if c >= num_chiplets]
        raise OptionError(f"chiplets (--chiplets) {format_chiplets(outside)} not on the target, which has chiplets "
                          f"0-{num_chiplets - 1}", hint=f"choose ids below {num_chiplets}, or more cards (--cards)")
    return chosen


def format_chiplets(ids: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5": the form `parse_chiplets` reads."""
    runs: list[list[int]] = []
    for c in ids:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


@dataclass(frozen=True)
class ServerLimits:
    """What `aviatorc serve` lets one client cost it (`aviatorc.serve.limits`), and how it stops."""

    # A 128k-token prompt is about 0.8 MB of JSON as ids, 0.5 MB as text; decoding the largest body
    # allowed holds the interpreter for tens of milliseconds (so /health still answers in 0.1 s).
    max_request_bytes: int = 2 << 20
    read_timeout_s: float = 30.0  # for a request's head, and between two pieces of its body
    shutdown_timeout_s: float = 20.0  # requests running at SIGTERM may finish within this

    def __post_init__(self) -> None:
        if self.max_request_bytes < 1:
            raise OptionError(f"--max-request-bytes must be >= 1, not {self.max_request_bytes}")
        for flag, value in (("--read-timeout", self.read_timeout_s), ("--shutdown-timeout", self.shutdown_timeout_s)):
            if not value > 0:  # also refuses NaN
                raise OptionError(f"{flag} must be > 0 seconds, not {value}")
