"""Where an initializer's bytes come from: memory, a region of a file, or nowhere.

Weights are first-class values. Their bytes may be held in memory, read lazily from a
file (ONNX external data, safetensors), or absent: a shape-only weight lets a 70B model
be planned without its bytes in memory.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from aviatorc.errors import EvaluationError, ModelFormatError, UnsafePathError
from aviatorc.ir.types import TensorType, numpy_dtype


class TensorData(Protocol):
    """Bytes of an initializer. `load()` returns an array of the value's type."""

    @property
    def available(self) -> bool: ...

    def load(self) -> np.ndarray: ...


@dataclass(frozen=True, eq=False)
class ArrayData:
    """Bytes held in memory."""

    array: np.ndarray

    @property
    def available(self) -> bool:
        return True

    def load(self) -> np.ndarray:
        return self.array


@dataclass(frozen=True)
class ShapeOnly:
    """No bytes: the weight was imported for planning only."""

    reason: str = "imported shape-only"

    @property
    def available(self) -> bool:
        return False

    def load(self) -> np.ndarray:
        raise EvaluationError(f"weight has no data ({self.reason})", hint="import the model with its weights to run it")


@dataclass(frozen=True, eq=False)
class FileRegion:
    """Bytes at [offset, offset + length) of a file, read on first use and not cached.

    The file is checked when the region is created (the caller validates the path) and its
    identity (device, inode) recorded; the read opens it without following a symlink and
    refuses a different file, so a path swapped for a link after import reads nothing foreign.
    """

    path: Path
    offset: int
    length: int
    type: TensorType
    _identity: tuple[int, int] = field(init=False, repr=False, default=(0, 0))  # (st_dev, st_ino)

    def __post_init__(self) -> None:
        stat = os.stat(self.path, follow_symlinks=False)
        object.__setattr__(self, "_identity", (stat.st_dev, stat.st_ino))
        size = stat.st_size
        if self.offset < 0 or self.length < 0 or self.offset + self.length > size:
            raise ModelFormatError(
                f"external data [{self.offset}, {self.offset + self.length}) lies past the end of "
                f"'{self.path.name}' ({size} bytes)",
                file=str(self.path),
            )

    @property
    def available(self) -> bool:
        return True

    def load(self) -> np.ndarray:
        dtype = numpy_dtype(self.type.dtype)
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError as error:
            raise ModelFormatError(f"cannot read external data: {error.strerror}", file=str(self.path)) from None
        with os.fdopen(fd, "rb") as f:
            stat = os.fstat(f.fileno())
            if (stat.st_dev, stat.st_ino) != self._identity:
                raise UnsafePathError(f"external data file '{self.path.name}' was replaced after import",
                                      file=str(self.path))
            f.seek(self.offset)
            raw = f.read(self.length)
        if len(raw) != self.length:
            raise ModelFormatError(f"external data ends early in '{self.path.name}'", file=str(self.path))
        return np.frombuffer(raw, dtype=dtype).reshape(self.type.shape).copy()  # type: ignore[arg-type]


@dataclass(frozen=True, eq=False)
class Derived:
    """Bytes computed from another source on load (for example a lazy transpose)."""

    source: TensorData
    transform: Callable[[np.ndarray], np.ndarray] = field(repr=False)

    @property
    def available(self) -> bool:
        return self.source.available

    def load(self) -> np.ndarray:
        return self.transform(self.source.load())
