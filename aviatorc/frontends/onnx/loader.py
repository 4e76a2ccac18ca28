"""Safe loading of ONNX files and their external data.

The protobuf is parsed without loading external data (`load_external_data=False`); each
externally stored initializer becomes a lazy `FileRegion` after its location passes
every check: a relative path with no `..`, inside the model's folder, through no
symbolic link, to a regular file with a single hard link (a hard link can make any file
on the volume appear inside the folder), and a byte range inside the file. Nothing is
ever unpickled.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from aviatorc.errors import ModelFormatError, UnsafePathError
from aviatorc.ir.data import ArrayData, FileRegion, TensorData
from aviatorc.ir.types import TensorType

EAGER_EXTERNAL_BYTES = 4096  # external tensors this small are read at import (shape constants)
NAME_MAX_BYTES = 255  # the longest file name POSIX file systems take (ext4, xfs, tmpfs)
PATH_MAX_BYTES = 4096


@dataclass(frozen=True)
class ExternalRef:
    """The `external_data` entries of a TensorProto."""

    location: str
    offset: int
    length: int | None


def load_model_proto(path: Path) -> Any:
    """Parse `path` as an ONNX ModelProto, leaving external data unread."""
    import onnx
    from google.protobuf.message import DecodeError

    if not path.is_file():
        raise ModelFormatError("no such model file", file=str(path))
    size = path.stat().st_size
    if size == 0:
        raise ModelFormatError("the model file is empty (0 bytes)", file=str(path))
    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, RuntimeWarning, ValueError, OSError) as error:
        raise ModelFormatError(
            f"not a valid ONNX protobuf ({type(error).__name__}: {error})",
            file=str(path),
            hint="the file may be truncated or not an ONNX model",
        ) from None
    if not model.HasField("graph") or not (model.graph.node or model.graph.output):
        raise ModelFormatError("the file holds no ONNX graph (truncated or not an ONNX model)", file=str(path))
    check_names_are_text(model, path)
    return model


def check_names_are_text(model: Any, path: Path) -> None:
    """Every name and key the importer reads is text: protobuf hands back `bytes` for a
    string field that is not valid UTF-8 (a flipped bit), which no later step expects."""
    graph = model.graph
    fields: list[tuple[str, Any]] = [("graph name", graph.name)]
    fields += [("opset domain", entry.domain) for entry in model.opset_import]
    for info in list(graph.input) + list(graph.output) + list(graph.value_info):
        fields.append(("value name", info.name))
        shape = info.type.tensor_type.shape if info.type.HasField("tensor_type") else None
        fields += [("dim name", dim.dim_param) for dim in (shape.dim if shape is not None else [])]
    for tensor in graph.initializer:
        fields.append(("initializer name", tensor.name))
        fields += [("external data entry", text) for entry in tensor.external_data for text in (entry.key, entry.value)]
    for node in graph.node:
        fields += [("node name", node.name), ("op type", node.op_type), ("domain", node.domain)]
        fields += [("value name", name) for name in list(node.input) + list(node.output)]
        fields += [("attribute name", attr.name) for attr in node.attribute]
    for what, value in fields:
        if not isinstance(value, str):
            raise ModelFormatError(f"{what} {bytes(value)[:40]!r} is not valid UTF-8", file=str(path),
                                   hint="the file is corrupt")


def external_ref(tensor: Any) -> ExternalRef:
    entries = {entry.key: entry.value for entry in tensor.external_data}
    if "location" not in entries:
        raise ModelFormatError(f"initializer '{tensor.name}' has external data without a location")
    try:
        offset = int(entries.get("offset", 0))
        length = int(entries["length"]) if "length" in entries else None
    except ValueError:
        raise ModelFormatError(
            f"initializer '{tensor.name}' has a non-integer external data offset or length"
        ) from None
    return ExternalRef(entries["location"], offset, length)


def resolve_location(base_dir: Path, location: str, tensor_name: str) -> Path:
    """The checked path of an external data file: inside `base_dir`, no links, a regular file."""

    from aviatorc.frontends.onnx.validate import printable

    def refuse(why: str) -> UnsafePathError:
        # The location is the file's text: escape control characters (a NUL, a terminal
        # escape) and cut it short before it reaches a message.
        return UnsafePathError(
            f"external data of '{printable(tensor_name, 60)}' at '{printable(location)}' {why}",
            location=location,
            tensor=tensor_name,
            hint="keep external data files as plain files next to the model",
        )

    if not location or "\x00" in location:
        raise refuse("is not a valid file name")
    if PurePosixPath(location).is_absolute() or PureWindowsPath(location).is_absolute() or location.startswith("\\"):
        raise refuse("is an absolute path")
    parts = location.replace("\\", "/").split("/")
    if ".." in parts:
        raise refuse("escapes the model's folder ('..')")
    # Names the file system cannot hold are refused here, not as an OSError from lstat.
    if any(len(part.encode("utf-8", "surrogateescape")) > NAME_MAX_BYTES for part in parts):
        raise refuse(f"has a path component longer than {NAME_MAX_BYTES} bytes")
    if len(location.encode("utf-8", "surrogateescape")) > PATH_MAX_BYTES:
        raise refuse(f"is longer than {PATH_MAX_BYTES} bytes")
    base = base_dir.resolve()
    current = base
    try:
        for part in parts:
            if part in ("", "."):
                continue
            current = current / part
            if current.is_symlink():
                raise refuse("goes through a symbolic link")
        if not current.resolve().is_relative_to(base):
            raise refuse("escapes the model's folder")
        info = os.lstat(current)
    except FileNotFoundError:
        raise ModelFormatError(f"external data file '{printable(location)}' of '{printable(tensor_name, 60)}' "
                               "does not exist") from None
    except (OSError, ValueError) as error:  # a name the OS refuses (encoding, length, a loop)
        raise refuse(f"cannot be opened ({type(error).__name__}: {getattr(error, 'strerror', None) or error})") from None
    if not stat.S_ISREG(info.st_mode):
        raise refuse("is not a regular file")
    if info.st_nlink > 1:
        raise refuse(f"has {info.st_nlink} hard links (it may be a file from outside the folder)")
    return current


def external_data(base_dir: Path, tensor: Any, type: TensorType) -> TensorData:
    """A lazy, checked view of an initializer's external bytes (small ones are read now)."""
    import numpy as np

    ref = external_ref(tensor)
    path = resolve_location(base_dir, ref.location, tensor.name)
    nbytes = type.nbytes()
    length = nbytes if ref.length is None else ref.length
    if length != nbytes:
        raise ModelFormatError(
            f"initializer '{tensor.name}' is {type} ({nbytes} bytes) but its external data length is {length}"
        )
    size = path.stat().st_size
    if ref.offset < 0 or ref.offset + length > size:
        raise ModelFormatError(
            f"external data of '{tensor.name}' at [{ref.offset}, {ref.offset + length}) lies past the end of "
            f"'{ref.location}' ({size} bytes)",
            tensor=tensor.name,
        )
    region = FileRegion(path, ref.offset, length, type)
    if length <= EAGER_EXTERNAL_BYTES:
        array = region.load()
        return ArrayData(np.ascontiguousarray(array))
    return region
