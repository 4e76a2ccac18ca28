"""Tampered copies of an artifact whose manifest is rehashed to match, so that what refuses them
is the validation of their contents, not the hash check."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aviatorc.plan.artifact import MANIFEST, to_json_bytes, write_artifact


def tampered_copy(source: Path, out: Path, *, plan: Callable[[dict[str, Any]], None] | None = None,
                  files: dict[str, bytes] | None = None) -> Path:
    """A copy of `source` with `plan` applied to plan.json and `files` replaced, manifest rehashed."""
    data = {p.name: p.read_bytes() for p in sorted(Path(source).iterdir()) if p.name != MANIFEST}
    if plan is not None:
        body = json.loads(data["plan.json"])
        plan(body)
        data["plan.json"] = to_json_bytes(body)
    data.update(files or {})
    return write_artifact(out, data)
