"""The plan artifact: a directory a runtime or a serving stack loads, written atomically.

    OUT.avc/
      manifest.json        format, version, and the sha256 and size of every other file
      plan.json            tiles, programs, memory plan, predictions (docs/plan-format.md)
      weights.safetensors  each tile's packed arrays ("t17.values", "t17.scale", ...) and the
                           graph's other initializers ("init.<name>"); absent for a shape-only
                           compile (the manifest says so)
      graph.ir             the transformed IR, canonical text (the nodes the programs name)
      target.toml          the resolved target description (its sha256 is in plan.json)
      report.json          what the compile measured
      trace.json           the simulated decode step, Chrome trace / Perfetto JSON
      report.html          the report as one self-contained page (`aviatorc.report`), rendered
                           from the files above: no timestamp, so it is deterministic too

No pickle anywhere: JSON, TOML, text and safetensors. The same inputs and options give the
same bytes: keys are sorted, nothing records a time or an absolute path. The directory is
written into a staging folder beside OUT and renamed into place; files are readable by other
users (a serving process may run under another account).

`load(path)` treats the folder as untrusted input (it may come from another machine or
account): it checks the manifest's format, version and schema; reads every file once and checks
its size and sha256 (what is then parsed and run are those very bytes); that every name stays
inside the directory (no separators, no links); plan.json field by field (`Plan.from_dict`,
through `aviatorc.plan.records`); weights.safetensors' header against its bytes
(`aviatorc.plan.tensors`); every program against the target with the plan checker
(`aviatorc.plan.check`); and that the plan's references resolve: tiles to tensors, buffers to
tiles, compute instructions to graph nodes. Each fault is one `ArtifactError` naming the file,
the field and the constraint. A folder others may write is loaded with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Generator, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from aviatorc.errors import ModelFormatError, OptionError
from aviatorc.plan.ir import Compute, Program, tile_name
from aviatorc.plan.plan import Plan
from aviatorc.plan.records import from_json
from aviatorc.plan.tensors import WEIGHTS, TensorHeaderError, TensorStore

ARTIFACT_FORMAT = "aviatorc-artifact"
ARTIFACT_VERSION = 1
MANIFEST = "manifest.json"
# Files an artifact may hold: an existing folder holding only these is an earlier artifact.
KNOWN_FILES = frozenset({MANIFEST, "plan.json", WEIGHTS, "graph.ir", "target.toml", "report.json", "trace.json",
                         "report.html", "timings.json"})
_REQUIRED = ("plan.json", "graph.ir", "target.toml", "report.json")
_BF16 = "bfloat16"
_logger = logging.getLogger("aviatorc.plan")


class ArtifactError(ModelFormatError):
    """An artifact is malformed, tampered with, or from an unknown version."""


def to_json_bytes(data: Any, *, compact: bool = False) -> bytes:
    """JSON with sorted keys; `compact` (plan.json) without indentation or spaces."""
    if compact:
        return (json.dumps(data, sort_keys=True, allow_nan=False, separators=(",", ":")) + "\n").encode()
    return (json.dumps(data, indent=1, sort_keys=True, allow_nan=False) + "\n").encode()


def encode_tensors(tensors: Mapping[str, np.ndarray]) -> tuple[bytes, dict[str, str]]:
    """safetensors bytes, and the names stored as raw 16-bit words (bfloat16, which the format's
    numpy binding cannot write) -> their real dtype."""
    from safetensors.numpy import save

    plain: dict[str, np.ndarray] = {}
    viewed: dict[str, str] = {}
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        if array.dtype.name == _BF16:
            array, viewed[name] = array.view(np.uint16), _BF16
        plain[name] = array
    return save(plain), viewed


def write_artifact(out: str | os.PathLike[str], files: Mapping[str, bytes]) -> Path:
    """Write `files` plus a manifest of their hashes as the artifact directory `out`, atomically."""
    for name in files:
        _check_name(name)
    manifest = {"format": ARTIFACT_FORMAT, "version": ARTIFACT_VERSION,
                "files": {name: {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
                          for name, data in sorted(files.items())},
                "shape_only": WEIGHTS not in files}
    return write_directory_atomically(Path(out), {**files, MANIFEST: to_json_bytes(manifest)})


def write_file_atomically(out: Path, data: bytes) -> Path:
    """Write `data` to a temporary file beside `out`, then rename it to `out` (mode 0644)."""
    out = Path(os.path.abspath(out))
    out.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
        os.chmod(staging, 0o644)
        os.replace(staging, out)
    finally:
        if os.path.exists(staging):
            os.unlink(staging)
    return out


def write_directory_atomically(out: Path, files: Mapping[str, bytes]) -> Path:
    """Write `files` into a fresh staging folder beside `out`, then rename it to `out`.

    An existing `out` is replaced only when it holds nothing but artifact files: a compile must
    never delete a user's folder."""
    out = Path(os.path.abspath(out))
    if out.exists() and not out.is_dir():
        raise OptionError(f"output '{out}' exists and is not a directory")
    if out.is_dir():
        foreign = sorted(p.name for p in out.iterdir() if p.name not in KNOWN_FILES)
        if foreign:
            raise OptionError(f"output '{out}' is a directory that is not an aviatorc artifact "
                              f"(it holds {', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''})",
                              hint="choose a new output path; only an earlier artifact is replaced")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for name, data in files.items():
            path = staging / name
            path.write_bytes(data)
            path.chmod(0o644)
        staging.chmod(0o755)  # mkdtemp makes 0700: other accounts must be able to read the artifact
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
            os.replace(staging, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return out


def check_output_path(out: str | os.PathLike[str], *, directory: bool = True) -> None:
    """Refuse an output path (a folder, or a file) that could not be written, before the work."""
    path = Path(os.path.abspath(out))
    if path.exists() and path.is_dir() != directory:
        raise OptionError(f"output '{path}' exists and is {'not ' if directory else ''}a directory")
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise OptionError(f"cannot write the output '{path}': '{parent}' is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OptionError(f"cannot write the output '{path}': '{parent}' is not writable")
    # Permission bits do not tell everything (as root every folder looks writable, and /proc or
    # /sys refuse files whatever the bits say): try a file there, as the write will.
    try:
        handle, probe = tempfile.mkstemp(prefix=".aviatorc-probe-", dir=parent)
    except OSError as error:
        raise OptionError(f"cannot write the output '{path}': '{parent}' takes no new files ({error.strerror})",
                          hint="choose a folder on a normal file system, such as one under your home or the "
                               "current folder") from None
    os.close(handle)
    os.unlink(probe)


def _check_name(name: str) -> None:
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name or name.startswith("."):
        raise ArtifactError(f"artifact file name '{name!r}' is not a plain name inside the artifact")


# -- loading --------------------------------------------------------------------------------


@dataclass
class Artifact:
    """A loaded, validated artifact: the typed plan, the graph and target texts, the report. Every
    file was read once and checked against its hash; what consumers read (tensors, `file_bytes`)
    are those bytes, so a file replaced after `load` changes nothing that runs."""

    path: Path
    manifest: dict[str, Any]
    plan: Plan
    graph_text: str
    target_toml: str
    report: dict[str, Any]
    files: dict[str, bytes] = field(default_factory=dict, repr=False)  # verified bytes, by file name
    store: TensorStore | None = field(default=None, repr=False)

    @property
    def shape_only(self) -> bool:
        return bool(self.manifest["shape_only"])

    @property
    def programs(self) -> dict[str, Program]:
        return self.plan.programs

    def file_bytes(self, name: str) -> bytes:
        """The verified bytes of one of the artifact's files (trace.json, report.html, ...)."""
        if name not in self.files:
            raise ArtifactError(f"the artifact has no file '{name}'", file=str(self.path))
        return self.files[name]

    def tensor_names(self) -> list[str]:
        return self.store.names() if self.store is not None else []

    def tensor(self, name: str) -> np.ndarray:
        """One stored array (a tile's packed values, scales, ...; or an initializer)."""
        return dict(self.tensors([name]))[name]

    def tensors(self, names: Iterable[str]) -> Generator[tuple[str, np.ndarray], None, None]:
        """Stored arrays by name, from the verified weights bytes (their header parsed once)."""
        if self.store is None:
            raise OptionError("this artifact was compiled shape-only and holds no weights",
                              file=str(self.path), hint="compile from a model with weights")
        for name in names:
            if name not in self.store:
                raise ArtifactError(f"no tensor '{name}' in {WEIGHTS}", file=str(self.path))
            array = self.store.get(name)
            if self.plan.tensor_dtypes.get(name) == _BF16:
                import ml_dtypes

                array = array.view(ml_dtypes.bfloat16)
            yield name, array

    def target(self) -> Any:
        """The resolved target the plan was compiled for, from target.toml's verified bytes."""
        from aviatorc.errors import TargetError
        from aviatorc.target import target_from_toml

        try:
            return target_from_toml(self.target_toml, source="target.toml")
        except TargetError as error:
            raise ArtifactError(str(error), file=str(self.path), field="target.toml") from None

    def graph(self) -> Any:
        """The transformed IR (shapes and small constants; weights come from `tensor`)."""
        from aviatorc.ir import parse_graph

        return parse_graph(self.graph_text)


MAX_MANIFEST_BYTES = 1 << 20  # a manifest lists a handful of files
MAX_FILE_BYTES = 1 << 48
MAX_CHIPLETS = 1 << 16  # a target's chiplets: the simulator and the checker size lists by it
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")


def load(path: str | os.PathLike[str]) -> Artifact:
    """Open an artifact directory: every file read once, its size and sha256 checked against the
    manifest, then each parsed from those bytes and validated (the manifest and plan.json field by
    field, weights.safetensors' header against its bytes, the programs by the plan checker on the
    target, the plan's references). Any fault is one `ArtifactError` naming the file, the field and
    the constraint."""
    root = Path(path)
    where = str(root)
    if not root.is_dir():
        raise ArtifactError("not an artifact directory", file=where)
    warn_if_others_can_write(root)
    manifest, files = _manifest(root, where)
    verified = {name: _read_verified(root, name, entry, where) for name, entry in sorted(files.items())}
    try:
        plan = Plan.from_dict(_json(verified["plan.json"], "plan.json", where))
    except ArtifactError:
        raise
    except ModelFormatError as error:
        text = error.message if error.message.startswith("plan.json") else f"plan.json: {error.message}"
        raise ArtifactError(text, file=where, field="plan.json") from None
    graph_text, target_toml = _text(verified, "graph.ir", where), _text(verified, "target.toml", where)
    if hashlib.sha256(verified["target.toml"]).hexdigest() != plan.target_sha256:
        raise ArtifactError("target.toml is not the target the plan was compiled for (sha256 differs)", file=where)
    store = None
    if WEIGHTS in verified:
        try:
            store = TensorStore(verified.pop(WEIGHTS))
        except TensorHeaderError as error:
            raise ArtifactError(error.message, file=where, field=WEIGHTS) from None
    report = _json(verified["report.json"], "report.json", where)
    artifact = Artifact(root, manifest, plan, graph_text, target_toml, report, verified, store)
    _check_programs(artifact, where)
    _check_references(artifact, where)
    return artifact


def _check_programs(artifact: Artifact, where: str) -> None:
    """The target parses and is of a size a runtime can model; every program is the plan's
    workload and passes the plan checker on that target (chiplets, channels, buffers within SRAM,
    each recv with its send, no deadlock): what a tampered plan.json says is refused here, before
    a backend or a server sizes anything by it."""
    from aviatorc.plan.check import PlanCheckError, check_plan

    target = artifact.target()
    if target.num_chiplets > MAX_CHIPLETS:
        raise ArtifactError(f"target.toml describes {target.num_chiplets:,} chiplets ({target.cards:,} cards); "
                            f"an artifact's target has at most {MAX_CHIPLETS:,}", file=where, field="server.cards")
    for phase, program in sorted(artifact.plan.programs.items()):
        if program.workload != artifact.plan.workload:
            raise ArtifactError(f"plan.json: programs.{phase}: workload {program.workload.to_dict()} is not the "
                                f"plan's {artifact.plan.workload.to_dict()}", file=where, field=f"programs.{phase}")
    try:
        check_plan(artifact.plan, target)
    except PlanCheckError as error:
        raise ArtifactError(f"plan.json breaks the plan rule '{error.check}': {error}", file=where,
                            field="programs") from None


def warn_if_others_can_write(root: Path) -> None:
    """A folder (or file in it) that other accounts may write can be changed under a server: say so."""
    for path in [root, *sorted(root.iterdir())]:
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            continue
        if mode & (stat.S_IWGRP | stat.S_IWOTH) and not (stat.S_ISDIR(mode) and mode & stat.S_ISVTX):
            who = "everyone" if mode & stat.S_IWOTH else "its group"
            _logger.warning(f"{root}: '{path.name if path != root else '.'}' is writable by {who}: whoever can write "
                            f"it can change what this artifact runs (chmod go-w)")
            return


def _manifest(root: Path, where: str) -> tuple[dict[str, Any], dict[str, _FileEntry]]:
    path = root / MANIFEST
    if path.is_symlink() or not path.is_file():
        raise ArtifactError(f"missing {MANIFEST}", file=where)
    with open(path, "rb") as handle:
        data = handle.read(MAX_MANIFEST_BYTES + 1)
    if len(data) > MAX_MANIFEST_BYTES:
        raise ArtifactError(f"{MANIFEST} is larger than {MAX_MANIFEST_BYTES >> 20} MiB", file=where)
    manifest = _json(data, MANIFEST, where)
    if manifest.get("format") != ARTIFACT_FORMAT:
        raise ArtifactError(f"{MANIFEST} is not an aviatorc artifact manifest", file=where, field="format")
    if manifest.get("version") != ARTIFACT_VERSION:
        raise ArtifactError(f"artifact version {_shown(manifest.get('version'))} is not supported (this aviatorc "
                            f"reads version {ARTIFACT_VERSION})", file=where, hint="recompile the model with this aviatorc")
    try:
        files = from_json(_Manifest, manifest, MANIFEST).files
    except ModelFormatError as error:
        raise ArtifactError(error.message, file=where, field=MANIFEST) from None
    missing = [name for name in _REQUIRED if name not in files]
    if missing:
        raise ArtifactError(f"{MANIFEST}: files must list {', '.join(_REQUIRED)} ({', '.join(missing)} missing)",
                            file=where, field="files")
    if manifest["shape_only"] is not (WEIGHTS not in files):
        raise ArtifactError(f"{MANIFEST} says shape_only={manifest['shape_only']} but "
                            f"{'lists' if WEIGHTS in files else 'does not list'} {WEIGHTS}", file=where,
                            field="shape_only")
    for name in files:
        _check_name(name)
    return manifest, files


@dataclass(frozen=True)
class _FileEntry:
    """A manifest's line for one file (read by `aviatorc.plan.records`, bounds checked here)."""

    sha256: str
    bytes: int

    def __post_init__(self) -> None:
        if not _HEX64.match(self.sha256):
            raise ValueError(f"sha256 must be 64 lowercase hex digits, not {_shown(self.sha256)}")
        if not 0 <= self.bytes <= MAX_FILE_BYTES:
            raise ValueError(f"bytes must be in [0, {MAX_FILE_BYTES:,}], not {self.bytes:,}")


@dataclass(frozen=True)
class _Manifest:
    format: str
    version: int
    files: dict[str, _FileEntry]
    shape_only: bool


def _json(data: bytes, name: str, where: str) -> dict[str, Any]:
    try:
        document = json.loads(data)
    except RecursionError:
        raise ArtifactError(f"{name} is not valid JSON: it nests too deeply", file=where) from None
    except (ValueError, UnicodeDecodeError) as error:
        raise ArtifactError(f"{name} is not valid JSON: {error}", file=where) from None
    if not isinstance(document, dict):
        raise ArtifactError(f"{name} must hold a JSON object", file=where)
    return document


def _text(files: dict[str, bytes], name: str, where: str) -> str:
    try:
        return files[name].decode("utf-8")
    except UnicodeDecodeError as error:
        raise ArtifactError(f"{name} is not UTF-8 (byte {error.start})", file=where) from None


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _read_verified(root: Path, name: str, entry: _FileEntry, where: str) -> bytes:
    """The file's bytes, read once, if they are the manifest's size and sha256."""
    path = root / name
    try:
        info = os.lstat(path)
    except OSError:
        raise ArtifactError(f"{MANIFEST} lists '{name}' but it is missing", file=where) from None
    if not stat.S_ISREG(info.st_mode):
        raise ArtifactError(f"'{name}' is not a regular file (links are not followed)", file=where)
    if info.st_size != entry.bytes:
        raise ArtifactError(f"'{name}' is {info.st_size:,} bytes but {MANIFEST} says {entry.bytes:,}: the file "
                            "was changed after the compile", file=where, hint="recompile, or restore the original file")
    with open(path, "rb") as handle:
        data = handle.read(entry.bytes + 1)
    if len(data) != entry.bytes or hashlib.sha256(data).hexdigest() != entry.sha256:
        raise ArtifactError(f"'{name}' does not match its sha256 in {MANIFEST}: the file was changed after the "
                            "compile", file=where, hint="recompile, or restore the original file")
    return data


def _check_references(artifact: Artifact, where: str) -> None:
    count = len(artifact.plan.tiles)
    names = set(artifact.tensor_names())
    if not artifact.shape_only:
        for t in range(count):
            if f"{tile_name(t)}.values" not in names:
                raise ArtifactError(f"tile {tile_name(t)} has no tensor '{tile_name(t)}.values' in {WEIGHTS}", file=where)
    try:
        nodes = {node.name for node in artifact.graph().nodes}
    except ModelFormatError as error:
        raise ArtifactError(f"graph.ir does not parse: {error}", file=where) from None
    except RecursionError:
        raise ArtifactError("graph.ir does not parse: it nests too deeply", file=where) from None
    for phase, program in artifact.programs.items():
        for buffer in program.buffers.values():
            if buffer.tile is not None and not 0 <= buffer.tile < count:
                raise ArtifactError(f"{phase} program: buffer '{buffer.name}' holds unknown tile "
                                    f"'{tile_name(buffer.tile)}'", file=where)
        for chiplet, step, ins in program.instructions():
            if isinstance(ins, Compute) and ins.node not in nodes:
                raise ArtifactError(f"{phase} program, stream {chiplet} step {step}: compute names node "
                                    f"'{ins.node}', which graph.ir does not have", file=where)
