"""Reading target descriptions: shipped TOML files or a user's own, checked against one schema.

A description may `extends = "corsair"` (a shipped name, or a path relative to the file):
its tables are merged over the base's. `--cards N` and `overrides` are applied last, so
`load_target("corsair", cards=4)` is the 4-card server built from the card description.
Every error is a `TargetError` naming the file and the dotted key, and an unknown key comes
with a "did you mean".
"""

from __future__ import annotations

import copy
import difflib
import math
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

from aviatorc.errors import TargetError
from aviatorc.formats import KINDS
from aviatorc.options import check_cards
from aviatorc.target.spec import (
    LINK_LEVELS,
    LPDDR_ATTACH,
    SCHEMA_VERSION,
    Assumption,
    ChipletSpec,
    HostSpec,
    LinkLevel,
    Target,
)

# The schema: table -> key -> kind. Kinds: "int", "float" (ints accepted; positive), "rate" (a
# positive float, or inf: no limit), "seconds" (a float >= 0: a what-if of 0 is a fair question),
# "str", "strlist", "fraction" (a float in [0, 1)), "attach" (one of LPDDR_ATTACH) and "ranges"
# (the `assumed` table: dotted key -> [low, high] around the figure's value).
_LINK = {"bytes_per_s": "float", "latency_s": "seconds", "message_s": "seconds"}
SCHEMA: dict[str, Any] = {
    "schema_version": "int",
    "name": "str",
    "description": "str",
    "extends": "str",
    "assumed": "ranges",
    "chiplet": {
        "sram_bytes": "int",
        "sram_bytes_per_s": "float",
        "mxint4_flops_per_s": "float",
        "mxint8_flops_per_s": "float",
        "mxint16_flops_per_s": "float",
        "vector_bytes_per_s": "rate",
    },
    "package": {"chiplets": "int"},
    "card": {"packages": "int", "lpddr_bytes": "int", "lpddr_bytes_per_s": "float", "lpddr_attach": "attach",
             "pcie_bytes_per_s": "float", "pcie_latency_s": "seconds"},
    "server": {"cards": "int"},
    "host": {"per_token_s": "seconds", "storage_bytes_per_s": "rate"},
    "links": {level: dict(_LINK) for level in LINK_LEVELS},
    "matrix_unit": {"k": "int", "n": "int"},
    "weights": {"formats": "strlist"},
    "runtime": {
        "per_layer_latency_s": "seconds",
        "activation_reserve_fraction": "fraction",
        "activation_bytes_per_element": "int",
    },
}
_OPTIONAL = {"extends", "assumed", "description"}
# Schema 1 had no vector units, host, message overheads or LPDDR channels: a schema-1 description
# keeps the meaning it had (LPDDR pooled per card, none of those costs charged).
_SCHEMA1_DEFAULTS: dict[str, Any] = {
    "chiplet.vector_bytes_per_s": math.inf, "card.lpddr_attach": "card", "card.pcie_latency_s": 0.0,
    "host.per_token_s": 0.0, "host.storage_bytes_per_s": math.inf,
    **{f"links.{level}.message_s": 0.0 for level in LINK_LEVELS},
}
SUPPORTED_SCHEMAS = (1, SCHEMA_VERSION)


def shipped_dir() -> Path:
    return Path(str(resources.files("aviatorc.target.descriptions")))


def list_targets() -> list[str]:
    """Names of the shipped target descriptions."""
    return sorted(p.stem for p in shipped_dir().glob("*.toml"))


def load_target(name_or_path: str | Path | Target, *, cards: int | None = None,
                overrides: dict[str, Any] | None = None) -> Target:
    """A checked `Target` from a shipped name, a TOML path or a `Target` (a pipeline's own, with
    overrides of its own), with `--cards` and overrides applied."""
    check_cards(cards)  # the option is the user's, not the description file's: no TOML path in the error
    if isinstance(name_or_path, Target):
        if cards is None and not overrides:
            return name_or_path
        data, source = name_or_path.resolved(), name_or_path.source
    else:
        path = _locate(name_or_path)
        data, source = _read_merged(path, seen=()), str(path)
    base_cards = data.get("server", {}).get("cards")
    if cards is not None:
        data.setdefault("server", {})["cards"] = cards
    if overrides:
        for key, value in _flatten(overrides).items():
            _check_known(key.split("."), f"{source} (overrides)")
            _rescale_range(data, key, value)
            _set_dotted(data, key, value)
    target = _checked(data, source)
    if cards is not None and cards != base_cards:
        target = _renamed(target, f"{target.name}@{cards}cards")
    return target


def vary(target: Target, figures: dict[str, float]) -> Target:
    """`target` with some figures replaced (dotted keys, as in `assumed`): the what-ifs behind a
    prediction's range. Checked like any description; the assumed ranges stay as they are."""
    data = target.resolved()
    data.pop("assumed", None)  # a varied figure may sit at an end of its range or past it
    for key, value in figures.items():
        _check_known(key.split("."), f"{target.source} (varied)")
        _set_dotted(data, key, value)
    varied = _checked(data, target.source)
    return _renamed_keeping(varied, target)


def _renamed_keeping(varied: Target, original: Target) -> Target:
    from dataclasses import replace

    return replace(varied, name=original.name, assumed=original.assumed)


def _checked(data: dict[str, Any], source: str) -> Target:
    version = data.get("schema_version")
    if version not in SUPPORTED_SCHEMAS:
        raise TargetError(f"schema_version {version!r} is not supported (this aviatorc reads "
                          f"{', '.join(map(str, SUPPORTED_SCHEMAS))})", file=source, key="schema_version")
    if version == 1:
        for key, value in _SCHEMA1_DEFAULTS.items():
            _set_default(data, key, value)
        if isinstance(data.get("assumed"), list):  # schema 1 named its assumptions without a range
            _check_value(data["assumed"], "strlist", "assumed", source)
            data["assumed"] = {key: [_lookup(data, key)] * 2 for key in data["assumed"] if _numeric(key)}
    _check_tree(data, SCHEMA, (), source)
    return _build(data, source)


# -- files ------------------------------------------------------------------------------------


def _locate(name_or_path: str | Path) -> Path:
    text = str(name_or_path)
    candidate = Path(text)
    if text.endswith(".toml") or candidate.exists():
        if not candidate.is_file():
            raise TargetError("target file does not exist", file=text,
                              hint=f"pass a TOML file or a shipped target: {', '.join(list_targets())}")
        return candidate
    shipped = shipped_dir() / f"{text}.toml"
    if shipped.is_file():
        return shipped
    close = difflib.get_close_matches(text, list_targets(), n=1)
    hint = f"did you mean '{close[0]}'?" if close else f"shipped targets: {', '.join(list_targets())}"
    raise TargetError(f"unknown target '{text}'", hint=hint)


def _read(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except tomllib.TOMLDecodeError as error:
        raise TargetError(f"malformed TOML: {error}", file=str(path)) from None
    except OSError as error:
        raise TargetError(f"cannot read target file: {error.strerror}", file=str(path)) from None


def _read_merged(path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    resolved = path.resolve()
    if resolved in seen:
        raise TargetError("`extends` forms a cycle", file=str(path), key="extends")
    data = _read(path)
    _check_unknown(data, SCHEMA, (), str(path))
    base_name = data.get("extends")
    if base_name is None:
        return data
    if not isinstance(base_name, str):
        raise TargetError("`extends` must be a string naming a target", file=str(path), key="extends")
    relative = path.parent / base_name
    base_path = relative if base_name.endswith(".toml") and relative.is_file() else None
    if base_path is None:
        try:
            base_path = _locate(base_name)
        except TargetError as error:
            raise TargetError(error.message, file=str(path), key="extends", hint=error.hint) from None
    base = _read_merged(base_path, seen + (resolved,))
    merged = _merge(base, data)
    merged.pop("extends", None)
    return merged


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


# -- checks -----------------------------------------------------------------------------------


def _unknown(key: str, known: list[str], path: tuple[str, ...], file: str) -> TargetError:
    dotted = ".".join(path + (key,))
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    hint = f"did you mean '{'.'.join(path + (close[0],))}'?" if close else f"known keys here: {', '.join(known)}"
    return TargetError(f"unknown key '{dotted}'", file=file, key=dotted, hint=hint)


def _check_unknown(data: dict[str, Any], schema: dict[str, Any], path: tuple[str, ...], file: str) -> None:
    for key, value in data.items():
        if key not in schema:
            raise _unknown(key, sorted(schema), path, file)
        if isinstance(schema[key], dict):
            if not isinstance(value, dict):
                dotted = ".".join(path + (key,))
                raise TargetError(f"'{dotted}' must be a table", file=file, key=dotted)
            _check_unknown(value, schema[key], path + (key,), file)


def _check_known(parts: list[str], file: str) -> None:
    schema: Any = SCHEMA
    for index, part in enumerate(parts):
        if not isinstance(schema, dict):
            dotted = ".".join(parts[:index])
            raise TargetError(f"'{dotted}' is a value, not a table", file=file, key=".".join(parts))
        if part not in schema:
            known = sorted(schema) if isinstance(schema, dict) else []
            raise _unknown(part, known, tuple(parts[:index]), file)
        schema = schema[part]


def _check_tree(data: dict[str, Any], schema: dict[str, Any], path: tuple[str, ...], file: str) -> None:
    for key, kind in schema.items():
        dotted = ".".join(path + (key,))
        if key not in data:
            if not path and key in _OPTIONAL:
                continue
            raise TargetError(f"missing key '{dotted}'", file=file, key=dotted)
        value = data[key]
        if isinstance(kind, dict):
            if not isinstance(value, dict):
                raise TargetError(f"'{dotted}' must be a table, not {value!r}", file=file, key=dotted)
            _check_tree(value, kind, path + (key,), file)
        else:
            _check_value(value, kind, dotted, file)


def _check_value(value: Any, kind: str, dotted: str, file: str) -> None:
    def bad(why: str) -> TargetError:
        return TargetError(f"'{dotted}' {why}, got {value!r}", file=file, key=dotted)

    if kind == "str":
        if not isinstance(value, str):
            raise bad("must be a string")
    elif kind == "strlist":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise bad("must be a list of strings")
    elif kind == "int":
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise bad("must be a positive integer")
    elif kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise bad("must be a positive number")
    elif kind == "rate":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value <= 0:
            raise bad("must be a positive number (inf: no limit)")
    elif kind == "seconds":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise bad("must be a time in seconds, 0 or more")
    elif kind == "fraction":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise bad("must be a fraction in [0, 1)")
    elif kind == "attach":
        if value not in LPDDR_ATTACH:
            raise bad(f"must be one of {', '.join(LPDDR_ATTACH)}")
    elif kind == "ranges":
        if not isinstance(value, dict):
            raise bad("must be a table of dotted keys -> [low, high]")


def _numeric(key: str) -> bool:
    """A dotted key of a number in the schema (the figures an assumption may be about)."""
    kind: Any = SCHEMA
    for part in key.split("."):
        if not isinstance(kind, dict) or part not in kind:
            return False
        kind = kind[part]
    return kind in ("int", "float", "rate", "seconds", "fraction")


def _lookup(data: dict[str, Any], key: str) -> Any:
    node: Any = data
    for part in key.split("."):
        node = node[part]
    return node


def _set_default(data: dict[str, Any], dotted: str, value: Any) -> None:
    _set_dotted(data, dotted, value, replace=False)


def _assumptions(data: dict[str, Any], file: str) -> tuple[Assumption, ...]:
    """The `assumed` table: each key a figure of the schema, each range [low, high] around its value."""
    out = []
    for key, bounds in sorted(data.get("assumed", {}).items()):
        dotted = f"assumed.{key}"
        _check_known(key.split("."), file)
        if not _numeric(key):
            raise TargetError(f"'{dotted}' names a figure that is not a number", file=file, key=dotted)
        kind: Any = SCHEMA
        for part in key.split("."):
            kind = kind[part]
        if not isinstance(bounds, list) or len(bounds) != 2:
            raise TargetError(f"'{dotted}' must be [low, high], got {bounds!r}", file=file, key=dotted)
        for bound in bounds:
            _check_value(bound, kind, dotted, file)
        value = _lookup(data, key)
        low, high = float(bounds[0]), float(bounds[1])
        if not low <= value <= high:
            raise TargetError(f"'{dotted}' = [{low:g}, {high:g}] does not contain the figure's value {value:g}",
                              file=file, key=dotted, hint="a range is what the figure may really be: it holds the value used")
        out.append(Assumption(key, low, high))
    return tuple(out)


def _build(data: dict[str, Any], file: str) -> Target:
    for fmt in data["weights"]["formats"]:
        if fmt not in KINDS:
            close = difflib.get_close_matches(fmt, KINDS, n=1)
            raise TargetError(f"unknown weight format '{fmt}' in 'weights.formats'", file=file, key="weights.formats",
                              hint=f"did you mean '{close[0]}'?" if close else f"known: {', '.join(KINDS)}")
    links = tuple(LinkLevel(level, float(data["links"][level]["bytes_per_s"]), float(data["links"][level]["latency_s"]),
                            float(data["links"][level]["message_s"])) for level in LINK_LEVELS)
    # The partitioner charges a link level by how many groups at that level a transfer spans;
    # that is only a lower-cost tree when outer levels are no faster than inner ones.
    for inner, outer in zip(links, links[1:], strict=False):
        if outer.bytes_per_s > inner.bytes_per_s or outer.latency_s < inner.latency_s:
            raise TargetError(f"link level '{outer.name}' is faster than '{inner.name}' inside it",
                              file=file, key=f"links.{outer.name}",
                              hint="outer levels must have bytes_per_s <= and latency_s >= the inner level's")
    assumed = _assumptions(data, file)
    chiplet = data["chiplet"]
    runtime = data["runtime"]
    card = data["card"]
    return Target(
        name=data["name"],
        description=data.get("description", ""),
        source=file,
        chiplet=ChipletSpec(int(chiplet["sram_bytes"]), float(chiplet["sram_bytes_per_s"]),
                            float(chiplet["mxint4_flops_per_s"]), float(chiplet["mxint8_flops_per_s"]),
                            float(chiplet["mxint16_flops_per_s"]), float(chiplet["vector_bytes_per_s"])),
        chiplets_per_package=data["package"]["chiplets"],
        packages_per_card=card["packages"],
        cards=data["server"]["cards"],
        lpddr_bytes_per_card=int(card["lpddr_bytes"]),
        lpddr_bytes_per_s_per_card=float(card["lpddr_bytes_per_s"]),
        lpddr_attach=str(card["lpddr_attach"]),
        pcie_bytes_per_s_per_card=float(card["pcie_bytes_per_s"]),
        pcie_latency_s=float(card["pcie_latency_s"]),
        host=HostSpec(float(data["host"]["per_token_s"]), float(data["host"]["storage_bytes_per_s"])),
        links=links,
        matrix_unit_k=data["matrix_unit"]["k"],
        matrix_unit_n=data["matrix_unit"]["n"],
        weight_formats=tuple(data["weights"]["formats"]),
        per_layer_latency_s=float(runtime["per_layer_latency_s"]),
        activation_reserve_fraction=float(runtime["activation_reserve_fraction"]),
        activation_bytes_per_element=int(runtime["activation_bytes_per_element"]),
        assumed=assumed,
        schema_version=SCHEMA_VERSION,
    )


def _renamed(target: Target, name: str) -> Target:
    from dataclasses import replace

    return replace(target, name=name)


# -- overrides --------------------------------------------------------------------------------


def _rescale_range(data: dict[str, Any], key: str, value: Any) -> None:
    """An override of an assumed figure keeps its range relative to it: LPDDR at 1e12 where the
    file says 0.5e12 in [0.35e12, 0.5e12] ranges over [0.7e12, 1e12]; a figure set to 0 has no range."""
    ranges = data.get("assumed")
    if not isinstance(ranges, dict) or key not in ranges or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    try:
        old = float(_lookup(data, key))
        low, high = (float(b) for b in ranges[key])
    except (KeyError, TypeError, ValueError):
        return  # a malformed range: the checks after the overrides say so
    ranges[key] = [low * value / old, high * value / old] if old else [value, value]


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict):
            out.update(_flatten(value, dotted))
        else:
            out[dotted] = value
    return out


def _set_dotted(data: dict[str, Any], dotted: str, value: Any, *, replace: bool = True) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    if replace or parts[-1] not in node:
        node[parts[-1]] = value
