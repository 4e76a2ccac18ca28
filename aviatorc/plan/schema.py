"""The shapes manifest.json and plan.json must have, checked before anything reads them.

An artifact may come from another machine or account, so its JSON is untrusted: a missing key,
a string where a number goes, a number out of any sane range must be one `ArtifactError` naming
the file, the field and the constraint, not a KeyError deep in a consumer. The schema is a few
combinators (`Obj`, `Map`, `List`, `Int`, ...) and the two documents written with them; bounds
are generous (far above any real plan) but finite, so no consumer sizes a list by a tampered
number. What the programs say (buffers, instructions, their references) is checked where the
programs are parsed (`aviatorc.plan.ir`); this module checks the plan's frame around them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aviatorc.formats import KINDS

HEX64 = re.compile(r"[0-9a-f]{64}\Z")
MAX_FILE_BYTES = 1 << 48
MAX_BATCH = 4096  # sequences decoded together (vendors quote 48-64)
MAX_CONTEXT = 1 << 24  # tokens per sequence (the config import's bound on max_position_embeddings)
MAX_CHIPLET = 1 << 16
MAX_LAYER = 1 << 20


class SchemaError(Exception):
    """`path`: where in the document; `constraint`: what the value must be."""

    def __init__(self, path: str, constraint: str) -> None:
        self.path, self.constraint = path, constraint
        super().__init__(f"{path or 'the document'}: {constraint}")


Check = Callable[[Any, str], None]


def Int(low: int, high: int) -> Check:  # noqa: N802 - combinators read as types
    def check(value: Any, path: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise SchemaError(path, f"must be an integer in [{low:,}, {high:,}], not {_shown(value)}")
    return check


def Str(pattern: re.Pattern[str] | None = None, choices: tuple[str, ...] = ()) -> Check:  # noqa: N802
    def check(value: Any, path: str) -> None:
        if not isinstance(value, str):
            raise SchemaError(path, f"must be a string, not {_shown(value)}")
        if pattern is not None and not pattern.match(value):
            raise SchemaError(path, f"must match {pattern.pattern}, not {_shown(value)}")
        if choices and value not in choices:
            raise SchemaError(path, f"must be one of {', '.join(choices)}, not {_shown(value)}")
    return check


def Bool(value: Any, path: str) -> None:  # noqa: N802
    if not isinstance(value, bool):
        raise SchemaError(path, f"must be true or false, not {_shown(value)}")


def Anything(value: Any, path: str) -> None:  # noqa: N802 - figures for reports, not read to run
    return


def List(item: Check, *, length: int | None = None, most: int = 1 << 24) -> Check:  # noqa: N802
    def check(value: Any, path: str) -> None:
        if not isinstance(value, list):
            raise SchemaError(path, f"must be a list, not {_shown(value)}")
        if length is not None and len(value) != length or len(value) > most:
            raise SchemaError(path, f"must hold {length if length is not None else f'at most {most:,}'} items, "
                                    f"not {len(value):,}")
        for index, element in enumerate(value):
            item(element, f"{path}[{index}]")
    return check


def Map(item: Check) -> Check:  # noqa: N802
    def check(value: Any, path: str) -> None:
        if not isinstance(value, dict):
            raise SchemaError(path, f"must be an object, not {_shown(value)}")
        for key, element in value.items():
            item(element, f"{path}.{key}" if path else str(key))
    return check


@dataclass(frozen=True)
class Obj:
    """An object with these `fields` (required), `optional` ones, and no others."""

    fields: dict[str, Check]
    optional: dict[str, Check] = field(default_factory=dict)

    def __call__(self, value: Any, path: str) -> None:
        if not isinstance(value, dict):
            raise SchemaError(path, f"must be an object, not {_shown(value)}")
        for key, check in self.fields.items():
            if key not in value:
                raise SchemaError(_join(path, key), "is missing")
            check(value[key], _join(path, key))
        for key, element in value.items():
            if key in self.fields:
                continue
            if key not in self.optional:
                raise SchemaError(_join(path, str(key)), "is not a field of this record")
            self.optional[key](element, _join(path, key))


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _shown(value: Any) -> str:
    import json

    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


# -- the documents ---------------------------------------------------------------------------

MANIFEST = Obj({
    "format": Str(),
    "version": Int(0, 1 << 31),
    "files": Map(Obj({"sha256": Str(HEX64), "bytes": Int(0, MAX_FILE_BYTES)})),
    "shape_only": Bool,
})

_CHIPLET = Int(0, MAX_CHIPLET)
_SPAN = List(Int(0, MAX_FILE_BYTES), length=2)
TILE = Obj(
    {"id": Str(re.compile(r"t\d+\Z")), "weight": Str(), "layer": Int(-1, MAX_LAYER), "role": Str(), "rows": _SPAN,
     "cols": _SPAN, "bytes": Int(0, MAX_FILE_BYTES), "compute_chiplet": _CHIPLET, "nodes": List(Str()),
     "format": Obj({"format": Str(choices=KINDS), "group_size": Int(0, 1 << 16), "symmetric": Int(0, 1),
                    "sparsity": Str()})},
    {"resident_chiplet": _CHIPLET, "streamed_from_card": Int(0, MAX_CHIPLET)},
)
WORKLOAD = Obj({"batch": Int(1, MAX_BATCH), "context": Int(1, MAX_CONTEXT), "prompt": Int(1, MAX_CONTEXT)})
PLAN = Obj(
    {"schema_version": Int(0, 1 << 31),
     "target": Obj({"name": Str(), "sha256": Str(HEX64), "file": Str(choices=("target.toml",))}),
     "workload": WORKLOAD, "chiplets": List(_CHIPLET, most=MAX_CHIPLET), "prefetch": Bool, "tiles": List(TILE),
     "memory": Map(Anything), "programs": Map(Map(Anything)), "cold_start": Map(Anything),
     "prediction": Map(Anything), "notes": List(Str())},
    {"tensor_dtypes": Map(Str(choices=("bfloat16",)))},
)


def check_plan(plan: dict[str, Any], path: str = "") -> None:
    """plan.json's frame, and the facts across fields a consumer relies on: tile ids unique, the
    programs' workload the plan's, a prompt inside the context."""
    PLAN(plan, path)
    ids = [tile["id"] for tile in plan["tiles"]]
    if len(set(ids)) != len(ids):
        raise SchemaError("tiles", f"tile ids must be unique ('{next(i for i in ids if ids.count(i) > 1)}' repeats)")
    workload = plan["workload"]
    if workload["prompt"] > workload["context"]:
        raise SchemaError("workload.prompt", f"must be at most the context ({workload['context']:,}), "
                                             f"not {workload['prompt']:,}")
    for phase, program in plan["programs"].items():
        if program.get("workload") != workload:
            raise SchemaError(f"programs.{phase}.workload", f"must be the plan's workload {_shown(workload)}, "
                                                            f"not {_shown(program.get('workload'))}")
