"""Frozen records to and from JSON, by their type hints: one checked reader for every plan section.

    to_json(prediction)                      # a plain JSON tree (dataclasses become objects)
    from_json(Prediction, data, "prediction")  # the record again, or a ModelFormatError naming the path

Field types understood: int, float, str, bool, `X | None`, `tuple[X, ...]`, `dict[str, X]`,
`dict[int, X]` (JSON object keys are strings), and nested dataclasses. A float field accepts an
int; every number must be finite (plan.json never holds NaN or infinity). Unknown keys and
missing fields are refused: a plan.json this version did not write is not guessed at.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from functools import cache
from typing import Any, TypeVar

from aviatorc.errors import ModelFormatError

T = TypeVar("T")


def to_json(value: Any) -> Any:
    """A JSON tree of `value`: dataclasses as objects (field order), tuples as lists, int keys as strings."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    return value


def from_json(cls: type[T], data: Any, where: str) -> T:
    """`data` read back as a `cls` (a dataclass), checked field by field."""
    return _read(cls, data, where)  # type: ignore[no-any-return]


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _fail(where: str, why: str) -> ModelFormatError:
    return ModelFormatError(f"{where}: {why}")


def _read(kind: Any, data: Any, where: str) -> Any:
    origin = typing.get_origin(kind)
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        if not isinstance(data, dict):
            raise _fail(where, f"must be an object, not {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(kind) if f.init}
        unknown = sorted(set(data) - names)
        if unknown:
            raise _fail(where, f"unknown field '{unknown[0]}'")
        hints = _hints(kind)
        values = {}
        for f in dataclasses.fields(kind):
            if not f.init:
                continue
            if f.name not in data:
                if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                    continue
                raise _fail(where, f"missing field '{f.name}'")
            values[f.name] = _read(hints[f.name], data[f.name], f"{where}.{f.name}")
        try:
            return kind(**values)
        except (ValueError, TypeError) as error:
            raise _fail(where, str(error)) from None
    if origin in (types.UnionType, typing.Union):
        options = typing.get_args(kind)
        if data is None and type(None) in options:
            return None
        inner = [o for o in options if o is not type(None)]
        return _read(inner[0], data, where)
    if origin is tuple:
        if not isinstance(data, list):
            raise _fail(where, f"must be a list, not {type(data).__name__}")
        args = typing.get_args(kind)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_read(args[0], v, f"{where}[{i}]") for i, v in enumerate(data))
        if len(args) != len(data):
            raise _fail(where, f"must hold {len(args)} items, not {len(data)}")
        return tuple(_read(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, data, strict=True)))
    if origin is dict:
        if not isinstance(data, dict):
            raise _fail(where, f"must be an object, not {type(data).__name__}")
        key_kind, value_kind = typing.get_args(kind)
        out = {}
        for key, value in data.items():
            if key_kind is int:
                if not (key.isdigit() or (key.startswith("-") and key[1:].isdigit())):
                    raise _fail(where, f"key '{key}' is not an integer")
                out[int(key)] = _read(value_kind, value, f"{where}.{key}")
            else:
                out[key] = _read(value_kind, value, f"{where}.{key}")
        return out
    if kind is bool:
        if not isinstance(data, bool):
            raise _fail(where, f"must be true or false, not {data!r}")
        return data
    if kind is int:
        if isinstance(data, bool) or not isinstance(data, int):
            raise _fail(where, f"must be an integer, not {data!r}")
        return data
    if kind is float:
        if isinstance(data, bool) or not isinstance(data, (int, float)) or not math.isfinite(data):
            raise _fail(where, f"must be a finite number, not {data!r}")
        return float(data)
    if kind is str:
        if not isinstance(data, str):
            raise _fail(where, f"must be a string, not {data!r}")
        return data
    if kind is Any:
        return data
    raise TypeError(f"no JSON rule for {kind!r} at {where}")  # a record type this module cannot read: a bug
