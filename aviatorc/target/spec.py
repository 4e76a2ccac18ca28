"""Target descriptions as frozen data: chiplets, packages, cards, servers and their links.

A `Target` is the machine the partitioner places weights on and the cost model times.
Chiplets are numbered 0..num_chiplets-1 in hierarchy order: chiplet c sits in package
c // chiplets_per_package and on card c // chiplets_per_card. Every quantity carries its
unit in its name. `resolved()` gives the nested dict a TOML file would hold, every default
filled in, so `aviatorc target show NAME --resolved` echoes exactly what the compiler uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SCHEMA_VERSION = 2
LINK_LEVELS = ("die_to_die", "package_to_package", "card_to_card")
# Where a card's LPDDR attaches: each chiplet has its own channel (Corsair: 32 GB per chiplet), or
# one channel per package, or one per card (a pooled memory every chiplet of the card shares).
LPDDR_ATTACH = ("chiplet", "package", "card")


@dataclass(frozen=True)
class LinkLevel:
    """One level of the interconnect: chiplets that first differ at this level talk over it.

    A message occupies its link for `message_s + bytes / bytes_per_s` (the fixed part: setting up
    the transfer, which no other message overlaps) and arrives `latency_s` after that."""

    name: str
    bytes_per_s: float
    latency_s: float
    message_s: float = 0.0

    def occupancy_s(self, nbytes: float) -> float:
        """How long one message of `nbytes` keeps a link of this level busy."""
        return self.message_s + nbytes / self.bytes_per_s

    def transfer_s(self, nbytes: float) -> float:
        """Time from sending `nbytes` across one link of this level to its arrival."""
        return self.occupancy_s(nbytes) + self.latency_s


@dataclass(frozen=True)
class ChipletSpec:
    sram_bytes: int
    sram_bytes_per_s: float
    mxint4_flops_per_s: float
    mxint8_flops_per_s: float
    mxint16_flops_per_s: float
    vector_bytes_per_s: float  # the vector units (norms, softmax, rotary, activations): bytes in and out


@dataclass(frozen=True)
class HostSpec:
    """The server's host: its per-token work and the storage the weights come from at a cold start."""

    per_token_s: float  # sampling and the runtime's bookkeeping for one decode step
    storage_bytes_per_s: float  # reading the weights from disk


@dataclass(frozen=True)
class Assumption:
    """A figure the vendor does not publish: its dotted key and the range it may take."""

    key: str
    low: float
    high: float


@dataclass(frozen=True)
class Target:
    """A machine: `cards` cards of `packages_per_card` packages of `chiplets_per_package` chiplets."""

    name: str
    description: str
    source: str  # the file it was read from (or "<name>" for a shipped one)
    chiplet: ChipletSpec
    chiplets_per_package: int
    packages_per_card: int
    cards: int
    lpddr_bytes_per_card: int
    lpddr_bytes_per_s_per_card: float
    lpddr_attach: str  # one of LPDDR_ATTACH: the card's LPDDR is split evenly over its channels
    pcie_bytes_per_s_per_card: float
    pcie_latency_s: float  # one crossing between host and card
    host: HostSpec
    links: tuple[LinkLevel, ...]  # innermost first: die_to_die, package_to_package, card_to_card
    matrix_unit_k: int
    matrix_unit_n: int
    weight_formats: tuple[str, ...]
    per_layer_latency_s: float
    activation_reserve_fraction: float
    activation_bytes_per_element: int
    assumed: tuple[Assumption, ...] = ()
    schema_version: int = SCHEMA_VERSION

    # -- the hierarchy --------------------------------------------------------------------

    @property
    def chiplets_per_card(self) -> int:
        return self.chiplets_per_package * self.packages_per_card

    @property
    def num_chiplets(self) -> int:
        return self.chiplets_per_card * self.cards

    @property
    def num_packages(self) -> int:
        return self.packages_per_card * self.cards

    def package_of(self, chiplet: int) -> int:
        return chiplet // self.chiplets_per_package

    def card_of(self, chiplet: int) -> int:
        return chiplet // self.chiplets_per_card

    # -- LPDDR channels -------------------------------------------------------------------

    @property
    def chiplets_per_channel(self) -> int:
        """The chiplets one LPDDR channel attaches to (its group: loads inside it cross no link)."""
        return {"chiplet": 1, "package": self.chiplets_per_package, "card": self.chiplets_per_card}[self.lpddr_attach]

    @property
    def channels_per_card(self) -> int:
        return self.chiplets_per_card // self.chiplets_per_channel

    @property
    def num_channels(self) -> int:
        return self.channels_per_card * self.cards

    @property
    def channel_bytes_per_s(self) -> float:
        return self.lpddr_bytes_per_s_per_card / self.channels_per_card

    @property
    def channel_bytes(self) -> int:
        return self.lpddr_bytes_per_card // self.channels_per_card

    def channel_of(self, chiplet: int) -> int:
        """The channel attached to `chiplet`'s group."""
        return chiplet // self.chiplets_per_channel

    def chiplets_of_channel(self, channel: int) -> range:
        """The chiplets channel `channel` attaches to."""
        first = channel * self.chiplets_per_channel
        return range(first, first + self.chiplets_per_channel)

    def card_of_channel(self, channel: int) -> int:
        return channel // self.channels_per_card

    def channel_link(self, channel: int, chiplet: int) -> LinkLevel | None:
        """The link a load from `channel` into `chiplet`'s SRAM crosses (None inside its group)."""
        if self.channel_of(chiplet) == channel:
            return None
        return self.link_between(self.chiplets_of_channel(channel)[0], chiplet)

    def link_between(self, a: int, b: int) -> LinkLevel | None:
        """The link level two chiplets talk over (None for the same chiplet)."""
        if a == b:
            return None
        if self.package_of(a) == self.package_of(b):
            return self.links[0]
        if self.card_of(a) == self.card_of(b):
            return self.links[1]
        return self.links[2]

    # -- capacities -----------------------------------------------------------------------

    @property
    def usable_sram_bytes_per_chiplet(self) -> int:
        """SRAM a chiplet can give to resident weights: what the activation/KV reserve leaves."""
        return int(self.chiplet.sram_bytes * (1.0 - self.activation_reserve_fraction))

    @property
    def sram_bytes_total(self) -> int:
        return self.chiplet.sram_bytes * self.num_chiplets

    @property
    def usable_sram_bytes_total(self) -> int:
        return self.usable_sram_bytes_per_chiplet * self.num_chiplets

    @property
    def lpddr_bytes_total(self) -> int:
        return self.lpddr_bytes_per_card * self.cards

    def assumption(self, key: str) -> Assumption | None:
        return next((a for a in self.assumed if a.key == key), None)

    def flops_per_s(self, format_kind: str) -> float:
        """Per-chiplet peak for weights of a format: 4-bit kinds run as MXINT4, 8-bit as MXINT8,
        16/32-bit floats as MXINT16 (the card has no IEEE FP16 units)."""
        if format_kind in ("int4", "mxint4"):
            return self.chiplet.mxint4_flops_per_s
        if format_kind in ("int8", "mxint8"):
            return self.chiplet.mxint8_flops_per_s
        return self.chiplet.mxint16_flops_per_s

    # -- echo -----------------------------------------------------------------------------

    def resolved(self) -> dict[str, Any]:
        """The nested dict of a TOML description of this target, every field filled in."""
        return {
            "schema_version": self.schema_version,
            "name": self.name,
            "description": self.description,
            "chiplet": {
                "sram_bytes": self.chiplet.sram_bytes,
                "sram_bytes_per_s": self.chiplet.sram_bytes_per_s,
                "mxint4_flops_per_s": self.chiplet.mxint4_flops_per_s,
                "mxint8_flops_per_s": self.chiplet.mxint8_flops_per_s,
                "mxint16_flops_per_s": self.chiplet.mxint16_flops_per_s,
                "vector_bytes_per_s": self.chiplet.vector_bytes_per_s,
            },
            "package": {"chiplets": self.chiplets_per_package},
            "card": {
                "packages": self.packages_per_card,
                "lpddr_bytes": self.lpddr_bytes_per_card,
                "lpddr_bytes_per_s": self.lpddr_bytes_per_s_per_card,
                "lpddr_attach": self.lpddr_attach,
                "pcie_bytes_per_s": self.pcie_bytes_per_s_per_card,
                "pcie_latency_s": self.pcie_latency_s,
            },
            "server": {"cards": self.cards},
            "host": {"per_token_s": self.host.per_token_s, "storage_bytes_per_s": self.host.storage_bytes_per_s},
            "links": {link.name: {"bytes_per_s": link.bytes_per_s, "latency_s": link.latency_s,
                                  "message_s": link.message_s} for link in self.links},
            "matrix_unit": {"k": self.matrix_unit_k, "n": self.matrix_unit_n},
            "weights": {"formats": list(self.weight_formats)},
            "runtime": {
                "per_layer_latency_s": self.per_layer_latency_s,
                "activation_reserve_fraction": self.activation_reserve_fraction,
                "activation_bytes_per_element": self.activation_bytes_per_element,
            },
            "assumed": {a.key: [a.low, a.high] for a in self.assumed},
        }

    def to_toml(self) -> str:
        """The resolved description as TOML text (loads back to an equal target)."""
        return dump_toml(self.resolved())

    def summary(self) -> dict[str, Any]:
        """Derived totals a reader wants next to the description."""
        return {
            "chiplets": self.num_chiplets,
            "sram_bytes_total": self.sram_bytes_total,
            "usable_sram_bytes_total": self.usable_sram_bytes_total,
            "lpddr_bytes_total": self.lpddr_bytes_total,
            "lpddr_bytes_per_s_total": self.lpddr_bytes_per_s_per_card * self.cards,
            "lpddr_channels": self.num_channels,
            "sram_bytes_per_s_total": self.chiplet.sram_bytes_per_s * self.num_chiplets,
        }


def dump_toml(data: dict[str, Any]) -> str:
    """A small TOML writer for the target schema: scalars and lists first, then tables."""
    lines: list[str] = []

    def scalar(value: Any) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, int):
            return str(value)
        if isinstance(value, float):
            return repr(value)
        if isinstance(value, str):
            return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(value, (list, tuple)):
            return "[" + ", ".join(scalar(v) for v in value) + "]"
        raise TypeError(f"cannot write {value!r} as TOML")

    def table(prefix: str, body: dict[str, Any]) -> None:
        plain = {k: v for k, v in body.items() if not isinstance(v, dict)}
        nested = {k: v for k, v in body.items() if isinstance(v, dict)}
        if prefix and plain:
            lines.append(f"\n[{prefix}]")
        for key, value in plain.items():
            bare = key.replace("_", "").replace("-", "").isalnum()
            lines.append(f"{key if bare else scalar(key)} = {scalar(value)}")
        for key, value in nested.items():
            table(f"{prefix}.{key}" if prefix else key, value)

    table("", data)
    return "\n".join(lines).lstrip("\n") + "\n"
