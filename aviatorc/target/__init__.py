"""Target descriptions: versioned TOML files shipped with the package, or a user's own.

    load_target("corsair")                 # the public figures (the default)
    load_target("corsair", cards=4)        # a 4-card server built from the card description
    load_target("my.toml", overrides={"card.lpddr_bytes_per_s": 1e12})

`cli_list()` and `cli_show()` give the text of `aviatorc target list` / `target show`.
"""

from __future__ import annotations

from aviatorc.target.loader import SCHEMA, list_targets, load_target, shipped_dir
from aviatorc.target.spec import LINK_LEVELS, SCHEMA_VERSION, ChipletSpec, LinkLevel, Target, dump_toml

DEFAULT_TARGET = "corsair"

__all__ = [
    "DEFAULT_TARGET",
    "LINK_LEVELS",
    "SCHEMA",
    "SCHEMA_VERSION",
    "ChipletSpec",
    "LinkLevel",
    "Target",
    "cli_list",
    "cli_show",
    "dump_toml",
    "list_targets",
    "load_target",
    "shipped_dir",
]


def _bytes(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


def cli_list() -> str:
    """One line per shipped target: name, shape, SRAM, description."""
    lines = []
    for name in list_targets():
        t = load_target(name)
        default = " (default)" if name == DEFAULT_TARGET else ""
        lines.append(f"{name:14} {t.cards} card(s) x {t.chiplets_per_card} chiplets, "
                     f"SRAM {_bytes(t.sram_bytes_total):>9}  {t.description}{default}")
    return "\n".join(lines)


def cli_show(name: str | Target, cards: int | None = None, resolved: bool = False,
             overrides: dict[str, object] | None = None) -> str:
    """The target's TOML: the file as written, or (`resolved`, or a `Target`, or with --cards or
    overrides) every field after extends, --cards and the overrides."""
    target = load_target(name, cards=cards, overrides=overrides)
    if not resolved and cards is None and not overrides and not isinstance(name, Target):
        with open(target.source, encoding="utf-8") as handle:
            return f"# {target.source}\n" + handle.read()
    summary = target.summary()
    header = [f"# {target.name} resolved from {target.source}"]
    header += [f"# {key}: {_bytes(v) if 'bytes' in key and 'per_s' not in key else v}" for key, v in summary.items()]
    if target.assumed:
        header.append("# assumed figures (override them; [assumed] gives each one's range): "
                      f"{', '.join(a.key for a in target.assumed)}")
    return "\n".join(header) + "\n" + target.to_toml()
