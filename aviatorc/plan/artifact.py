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

`load(path)` checks the manifest's format and version, that every file's sha256 matches,
that every name stays inside the directory (no separators, no links), and that the plan's
references resolve: tiles to tensors, buffers to tiles, compute instructions to graph nodes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from aviatorc.errors import ModelFormatError, OptionError
from aviatorc.plan.ir import Compute, Program, tile_name
from aviatorc.plan.plan import Plan

ARTIFACT_FORMAT = "aviatorc-artifact"
ARTIFACT_VERSION = 1
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"
# Files an artifact may hold: an existing folder holding only these is an earlier artifact.
KNOWN_FILES = frozenset({MANIFEST, "plan.json", WEIGHTS, "graph.ir", "target.toml", "report.json", "trace.json",
                         "report.html", "timings.json"})
_REQUIRED = ("plan.json", "graph.ir", "target.toml", "report.json")
_BF16 = "bfloat16"


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
    """A loaded, validated artifact: the typed plan, the graph and target texts, the report.
    Tensors are read lazily from weights.safetensors."""

    path: Path
    manifest: dict[str, Any]
    plan: Plan
    graph_text: str
    target_toml: str
    report: dict[str, Any]

    @property
    def shape_only(self) -> bool:
        return bool(self.manifest["shape_only"])

    @property
    def programs(self) -> dict[str, Program]:
        return self.plan.programs

    def tensor_names(self) -> list[str]:
        if self.shape_only:
            return []
        from safetensors import safe_open

        with safe_open(str(self.path / WEIGHTS), framework="numpy") as handle:
            return sorted(handle.keys())

    def tensor(self, name: str) -> np.ndarray:
        """One stored array (a tile's packed values, scales, ...; or an initializer)."""
        if self.shape_only:
            raise OptionError("this artifact was compiled shape-only and holds no weights",
                              file=str(self.path), hint="compile from a model with weights")
        from safetensors import safe_open

        with safe_open(str(self.path / WEIGHTS), framework="numpy") as handle:
            if name not in handle.keys():
                raise ArtifactError(f"no tensor '{name}' in {WEIGHTS}", file=str(self.path))
            array = handle.get_tensor(name)
        if self.plan.tensor_dtypes.get(name) == _BF16:
            import ml_dtypes

            array = array.view(ml_dtypes.bfloat16)
        return array

    def graph(self) -> Any:
        """The transformed IR (shapes and small constants; weights come from `tensor`)."""
        from aviatorc.ir import parse_graph

        return parse_graph(self.graph_text)


def load(path: str | os.PathLike[str]) -> Artifact:
    """Open an artifact directory, validating version, hashes and references."""
    root = Path(path)
    where = str(root)
    if not root.is_dir():
        raise ArtifactError("not an artifact directory", file=where)
    manifest = _read_json(root, MANIFEST, where)
    if manifest.get("format") != ARTIFACT_FORMAT:
        raise ArtifactError(f"{MANIFEST} is not an aviatorc artifact manifest", file=where)
    if manifest.get("version") != ARTIFACT_VERSION:
        raise ArtifactError(f"artifact version {manifest.get('version')!r} is not supported (this aviatorc reads "
                            f"version {ARTIFACT_VERSION})", file=where, hint="recompile the model with this aviatorc")
    files = manifest.get("files")
    if not isinstance(files, dict) or any(name not in files for name in _REQUIRED):
        raise ArtifactError(f"{MANIFEST} must list {', '.join(_REQUIRED)}", file=where)
    if manifest.get("shape_only") is not (WEIGHTS not in files):
        raise ArtifactError(f"{MANIFEST} says shape_only={manifest.get('shape_only')!r} but "
                            f"{'lists' if WEIGHTS in files else 'does not list'} {WEIGHTS}", file=where)
    for name, entry in sorted(files.items()):
        _check_name(name)
        _verify_file(root, name, entry, where)
    try:
        plan = Plan.from_dict(_read_json(root, "plan.json", where))
    except ModelFormatError as error:
        raise ArtifactError(error.message, file=where) from None
    graph_text = (root / "graph.ir").read_text()
    target_toml = (root / "target.toml").read_text()
    if hashlib.sha256(target_toml.encode()).hexdigest() != plan.target_sha256:
        raise ArtifactError("target.toml is not the target the plan was compiled for (sha256 differs)", file=where)
    artifact = Artifact(root, manifest, plan, graph_text, target_toml, _read_json(root, "report.json", where))
    _check_references(artifact, where)
    return artifact


def _read_json(root: Path, name: str, where: str) -> dict[str, Any]:
    path = root / name
    if path.is_symlink() or not path.is_file():
        raise ArtifactError(f"missing {name}", file=where)
    try:
        data = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as error:
        raise ArtifactError(f"{name} is not valid JSON: {error}", file=where) from None
    if not isinstance(data, dict):
        raise ArtifactError(f"{name} must hold a JSON object", file=where)
    return data


def _verify_file(root: Path, name: str, entry: Any, where: str) -> None:
    path = root / name
    try:
        info = os.lstat(path)
    except OSError:
        raise ArtifactError(f"{MANIFEST} lists '{name}' but it is missing", file=where) from None
    if not stat.S_ISREG(info.st_mode):
        raise ArtifactError(f"'{name}' is not a regular file (links are not followed)", file=where)
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    if not isinstance(entry, dict) or digest.hexdigest() != entry.get("sha256"):
        raise ArtifactError(f"'{name}' does not match its sha256 in {MANIFEST}: the file was changed after the "
                            "compile", file=where, hint="recompile, or restore the original file")


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
    for phase, program in artifact.programs.items():
        for buffer in program.buffers.values():
            if buffer.tile is not None and not 0 <= buffer.tile < count:
                raise ArtifactError(f"{phase} program: buffer '{buffer.name}' holds unknown tile "
                                    f"'{tile_name(buffer.tile)}'", file=where)
        for chiplet, step, ins in program.instructions():
            if isinstance(ins, Compute) and ins.node not in nodes:
                raise ArtifactError(f"{phase} program, stream {chiplet} step {step}: compute names node "
                                    f"'{ins.node}', which graph.ir does not have", file=where)
