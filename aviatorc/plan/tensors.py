"""weights.safetensors as untrusted input: its header checked with bounds, its tensors read from
the very bytes whose hash was checked.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length
N, N bytes of JSON `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
{str: str}}`, then the data, each tensor's bytes at [begin, end) of it. An artifact comes from
elsewhere, so before any tensor is read every claim of the header is checked against the bytes
that are there: the length fits the file, the JSON is an object of well-formed entries, each
dtype is known, each shape's bytes are exactly its offsets' span, and the spans tile the data
in order with nothing left over (as the library itself requires). A header that lies (2^40
elements, offsets past the end) is then one `ArtifactError` naming the tensor and the
constraint, never an allocation or a library error.

`TensorStore` holds the bytes read once at load (the hash is taken of them), so a file replaced
afterwards changes nothing that runs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from aviatorc.errors import ModelFormatError

WEIGHTS = "weights.safetensors"
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit
MAX_RANK = 8
# safetensors dtype -> numpy (bfloat16 is stored as U16 by the writer and viewed back by the reader).
DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
          "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8,
          "BOOL": np.bool_}


class TensorHeaderError(ModelFormatError):
    """weights.safetensors is malformed (`ArtifactError` wraps it with the artifact's path)."""


@dataclass(frozen=True)
class Entry:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # offsets into the data (after the header)
    end: int


def parse_header(data: bytes | memoryview) -> tuple[int, dict[str, Entry]]:
    """(where the data starts, the entries by name); raises TensorHeaderError naming the fault."""
    if len(data) < 8:
        raise _bad(f"is {len(data)} bytes long: a safetensors file starts with an 8-byte header length")
    length = int.from_bytes(data[:8], "little")
    if length > MAX_HEADER_BYTES or 8 + length > len(data):
        raise _bad(f"says its header is {length:,} bytes but the file holds {len(data) - 8:,} after the length "
                   f"(and a header is at most {MAX_HEADER_BYTES:,})")
    try:
        header = json.loads(bytes(data[8:8 + length]).decode("utf-8"))
    except RecursionError:
        raise _bad("has a header that nests too deeply") from None
    except (UnicodeDecodeError, ValueError) as error:
        raise _bad(f"has a header that is not JSON: {error}") from None
    if not isinstance(header, dict):
        raise _bad("has a header that is not a JSON object")
    body = len(data) - 8 - length
    entries: dict[str, Entry] = {}
    for name, raw in header.items():
        if name == "__metadata__":
            if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
                raise _bad("has __metadata__ that is not an object of strings")
            continue
        entries[name] = _entry(name, raw, body)
    position = 0
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin != position:
            raise _bad(f"tensor '{_short(name)}' starts at byte {entry.begin:,} of the data but the tensors before "
                       f"it end at {position:,}: the tensors must tile the data in order")
        position = entry.end
    if position != body:
        raise _bad(f"has {body - position:,} bytes of data that no tensor claims")
    return 8 + length, entries


def _entry(name: str, raw: object, body: int) -> Entry:
    label = f"tensor '{_short(name)}'"
    if not isinstance(raw, dict) or set(raw) != {"dtype", "shape", "data_offsets"}:
        raise _bad(f"{label} must be an object of dtype, shape and data_offsets")
    dtype, shape, offsets = raw["dtype"], raw["shape"], raw["data_offsets"]
    if dtype not in DTYPES:
        raise _bad(f"{label} has dtype {_short(json.dumps(dtype))}; known: {', '.join(DTYPES)}")
    if not isinstance(shape, list) or len(shape) > MAX_RANK or not all(_count(d) for d in shape):
        raise _bad(f"{label} has shape {_short(json.dumps(shape))}: a list of at most {MAX_RANK} integers >= 0")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_count(o) for o in offsets) \
            or not offsets[0] <= offsets[1] <= body:
        raise _bad(f"{label} has data_offsets {_short(json.dumps(offsets))}: [begin, end] with "
                   f"0 <= begin <= end <= {body:,} (the data's size)")
    need = math.prod(shape) * np.dtype(DTYPES[dtype]).itemsize  # Python ints: no overflow at 2^40 elements
    if need != offsets[1] - offsets[0]:
        raise _bad(f"{label} of shape {shape} and dtype {dtype} needs {need:,} bytes but its data_offsets hold "
                   f"{offsets[1] - offsets[0]:,}")
    return Entry(dtype, tuple(shape), offsets[0], offsets[1])


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _bad(message: str) -> TensorHeaderError:
    return TensorHeaderError(f"{WEIGHTS} {message}")


def _short(text: str, limit: int = 80) -> str:
    text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[:limit - 3] + "..."


class TensorStore:
    """The tensors of one weights.safetensors, served from its bytes (checked by `parse_header`)."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._start, self._entries = parse_header(data)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def get(self, name: str) -> np.ndarray:
        """A fresh array of tensor `name` (callers may write to it)."""
        entry = self._entries[name]
        dtype = np.dtype(DTYPES[entry.dtype]).newbyteorder("<")
        count = math.prod(entry.shape)
        if count == 0:
            return np.zeros(entry.shape, dtype=dtype.newbyteorder("="))
        array = np.frombuffer(self._data, dtype=dtype, count=count, offset=self._start + entry.begin)
        return array.astype(dtype.newbyteorder("="), copy=True).reshape(entry.shape)
