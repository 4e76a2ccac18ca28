"""Element types and tensor types of the IR.

A dimension is an `int` (static), a `str` (a named symbolic dimension such as "batch" or
"seq": equal names mean equal sizes) or `None` (unknown, only as an inference result).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from aviatorc.errors import ModelFormatError

Dim = int | str | None

# Closed set of element types: name -> numpy dtype. bfloat16 and the 4-bit types come
# from ml_dtypes (a dependency of onnx) and are imported lazily.
_NUMPY_DTYPES: dict[str, str] = {
    "float64": "float64",
    "float32": "float32",
    "float16": "float16",
    "int64": "int64",
    "int32": "int32",
    "int16": "int16",
    "int8": "int8",
    "uint64": "uint64",
    "uint32": "uint32",
    "uint16": "uint16",
    "uint8": "uint8",
    "bool": "bool",
}
_ML_DTYPES = ("bfloat16",)
DTYPES: tuple[str, ...] = tuple(_NUMPY_DTYPES) + _ML_DTYPES

FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16"})
INT_DTYPES = frozenset({"int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8"})

# Refuse dimensions and element counts that no real model has, before any allocation.
MAX_DIM = 2**31 - 1
MAX_NUMEL = 2**40


def numpy_dtype(dtype: str) -> np.dtype:
    """The numpy dtype for an IR element type name."""
    if dtype in _NUMPY_DTYPES:
        return np.dtype(_NUMPY_DTYPES[dtype])
    if dtype in _ML_DTYPES:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, dtype))
    raise ModelFormatError(f"unknown element type '{dtype}'", hint=f"known: {', '.join(DTYPES)}")


def dtype_name(dtype: np.dtype | type) -> str:
    """The IR element type name of a numpy dtype."""
    name = np.dtype(dtype).name
    if name in _NUMPY_DTYPES or name in _ML_DTYPES:
        return name
    raise ModelFormatError(f"element type '{name}' is not supported", hint=f"supported: {', '.join(DTYPES)}")


def itemsize(dtype: str) -> int:
    return numpy_dtype(dtype).itemsize


@dataclass(frozen=True)
class TensorType:
    """Element type and shape of a value. Shape dims: int, symbolic name, or None (unknown)."""

    dtype: str
    shape: tuple[Dim, ...]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ModelFormatError(f"unknown element type '{self.dtype}'")
        for dim in self.shape:
            if isinstance(dim, int) and not isinstance(dim, bool) and not 0 <= dim <= MAX_DIM:
                raise ModelFormatError(
                    f"dimension {dim} is out of range (0..{MAX_DIM})", hint="the model's shapes are corrupt"
                )
        numel = self.static_numel()
        if numel is not None and numel > MAX_NUMEL:
            raise ModelFormatError(f"tensor of {numel} elements exceeds the limit of {MAX_NUMEL}")

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def is_static(self) -> bool:
        return all(isinstance(d, int) for d in self.shape)

    def static_numel(self) -> int | None:
        if not self.is_static:
            return None
        return math.prod(self.shape)  # type: ignore[arg-type]

    def numel(self) -> int:
        numel = self.static_numel()
        if numel is None:
            raise ModelFormatError(f"shape {format_shape(self.shape)} is not static")
        return numel

    def nbytes(self) -> int:
        return self.numel() * itemsize(self.dtype)

    def __str__(self) -> str:
        return f"{self.dtype}{format_shape(self.shape)}"


def format_dim(dim: Dim) -> str:
    if dim is None:
        return "?"
    return str(dim)


def format_shape(shape: tuple[Dim, ...]) -> str:
    return "[" + ", ".join(format_dim(d) for d in shape) + "]"


def dims_compatible(a: Dim, b: Dim) -> bool:
    """Whether two dims may describe the same size (unknown and symbolic dims are lenient)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return True


def broadcast_shapes(*shapes: tuple[Dim, ...]) -> tuple[Dim, ...] | None:
    """Numpy broadcasting over static and symbolic dims; None when provably incompatible."""
    rank = max((len(s) for s in shapes), default=0)
    out: list[Dim] = []
    for axis in range(rank):
        dims = [s[len(s) - rank + axis] for s in shapes if len(s) - rank + axis >= 0]
        result: Dim = 1
        for dim in dims:
            if dim == 1:
                continue
            if result == 1:
                result = dim
            elif isinstance(result, int) and isinstance(dim, int):
                if result != dim:
                    return None
            elif result != dim:
                # Different symbols, or a symbol against an int: prefer the static size.
                result = dim if isinstance(dim, int) else (result if isinstance(result, int) else None)
        out.append(result)
    return tuple(out)
