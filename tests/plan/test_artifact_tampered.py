"""Artifacts that come from elsewhere: each tampered file, with the manifest rehashed to match (so
the hash check is not what refuses it), is one `ArtifactError` naming the file, the field and
the constraint; the bytes that run are the bytes that were hashed; a folder others can write
is loaded with a warning."""

from __future__ import annotations

import json
import logging
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import aviatorc
from aviatorc.plan.artifact import MANIFEST, ArtifactError
from tests.plan.tamper import tampered_copy
from tests.zoo_fixtures import zoo_dir, zoo_onnx  # noqa: F401

WEIGHTS = "weights.safetensors"


@pytest.fixture(scope="module")
def artifact(zoo_onnx, tmp_path_factory) -> Path:  # noqa: F811
    result = aviatorc.compile(str(zoo_onnx("llama")), target="mock", quant="int8", context=64, prompt=8)
    return result.save(tmp_path_factory.mktemp("art") / "a.avc")


def split(data: bytes) -> tuple[dict, bytes]:
    length = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + length]), data[8 + length:]


def join(header: dict | bytes, body: bytes, *, length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + body


def first_tensor(header: dict) -> str:
    return next(name for name in sorted(header) if name != "__metadata__")


def header_lie(kind: str, data: bytes) -> bytes:
    header, body = split(data)
    name = first_tensor(header)
    entry = header[name]
    if kind == "2^40 elements":
        entry["shape"] = [1 << 20, 1 << 20]
    elif kind == "offsets past the end":
        entry["data_offsets"] = [entry["data_offsets"][0], len(body) + 4096]
    elif kind == "negative shape":
        entry["shape"] = [-1, *entry["shape"][1:]]
    elif kind == "unknown dtype":
        entry["dtype"] = "F128"
    elif kind == "overlapping":
        other = sorted((e for n, e in header.items() if n not in (name, "__metadata__")),
                       key=lambda e: e["data_offsets"][0])[0]
        entry["data_offsets"], other["data_offsets"] = other["data_offsets"], entry["data_offsets"]
        entry["shape"], other["shape"] = other["shape"], entry["shape"]
        entry["dtype"], other["dtype"] = other["dtype"], entry["dtype"]
        other["data_offsets"] = list(entry["data_offsets"])  # two tensors on the same bytes
    elif kind == "huge header length":
        return join(header, body, length=1 << 62)
    elif kind == "garbage header":
        return join(b"\x00\xff{not json" * 10, body)
    elif kind == "truncated":
        return data[:len(data) // 2]
    elif kind == "empty":
        return b""
    elif kind == "header only":
        return data[:5]
    return join(header, body)


HEADER_LIES = {
    "2^40 elements": "of shape [1048576, 1048576]",
    "offsets past the end": "data_offsets",
    "negative shape": "integers >= 0",
    "unknown dtype": "has dtype \"F128\"",
    "overlapping": "must tile the data",
    "huge header length": "says its header is 4,611,686,018,427,387,904 bytes",
    "garbage header": "header that is not JSON",
    "truncated": "(the data's size)",
    "empty": "is 0 bytes long",
    "header only": "is 5 bytes long",
}


@pytest.mark.parametrize("kind", sorted(HEADER_LIES))
def test_a_safetensors_header_that_lies_is_one_artifact_error(artifact, tmp_path, kind):
    data = header_lie(kind, (artifact / WEIGHTS).read_bytes())
    folder = tampered_copy(artifact, tmp_path / "t.avc", files={WEIGHTS: data})
    with pytest.raises(ArtifactError) as refused:
        aviatorc.load(folder)
    text = str(refused.value)
    assert text.startswith(f"{folder}: {WEIGHTS} ") and HEADER_LIES[kind] in text, text
    assert refused.value.fields["field"] == WEIGHTS


def _workload(key: str, value: object):
    def edit(plan: dict) -> None:
        for record in [plan["workload"], *(p["workload"] for p in plan["programs"].values())]:
            record[key] = value
    return edit


def _set(*path: object, value: object):
    def edit(plan: dict) -> None:
        *parents, last = path
        node = plan
        for key in parents:
            node = node[key]
        node[last] = value
    return edit


def _stream_on(chiplet: int):
    def edit(plan: dict) -> None:
        streams = plan["programs"]["decode"]["streams"]
        streams[str(chiplet)] = streams.pop(sorted(streams)[0])
    return edit


# plan.json edits (schema 2: a tile is a row [weight, k0, k1, n0, n1, bytes, compute chiplet,
# resident chiplet, channel]; buffers are rows [name, chiplet, bytes, kind, tile, layer]).
PLAN_FAULTS = {
    "not json": (lambda raw: raw[: len(raw) // 2], "plan.json is not valid JSON"),
    "nested 100,000 deep": (lambda raw: b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests too deeply"),
    "a list": (lambda raw: b"[" + raw + b"]", "plan.json must hold a JSON object"),
    "no tiles": (lambda plan: plan.pop("tiles"), "plan.json: missing 'tiles'"),
    "batch as a string": (_set("workload", "batch", value="4"), "plan.json: workload.batch: must be an integer, not '4'"),
    "batch 0": (_workload("batch", 0), "plan.json: workload: batch must be in [1, 4,096], not 0"),
    "batch -1": (_workload("batch", -1), "batch must be in [1, 4,096], not -1"),
    "batch 10^9": (_workload("batch", 10**9), "batch must be in [1, 4,096], not 1,000,000,000"),
    "context 2^40": (_workload("context", 1 << 40), "context must be in [1, 16,777,216], not 1,099,511,627,776"),
    "prompt past the context": (_workload("prompt", 65), "prompt must be in [1, 64], not 65"),
    "unknown weight format": (_set("weights", 0, "format", "format", value="int3"), "plan.json: weights[0].format: "),
    "tile computing on chiplet 10^12": (_set("tiles", 0, 6, value=10**12), "plan rule 'wrong-target'"),
    "tile resident nowhere": (_set("tiles", 0, 7, value=-1), "tiles[0] must be resident on a chiplet or streamed"),
    # found by `tools/fuzz.py --artifacts` (plan-tile-field): a range past the weight's columns, and a
    # channel of -7 beside a resident chiplet, loaded
    "tile channel -7": (_set("tiles", 0, 8, value=-7), "tiles[0] must be resident on a chiplet or streamed"),
    "tile columns to 2^26": (_set("tiles", 0, 4, value=1 << 26), "tiles[0] holds "),
    "tile bytes off by one": (lambda plan: plan["tiles"][0].__setitem__(5, plan["tiles"][0][5] + 1), "tiles[0] holds "),
    "negative buffer size": (_set("tables", "buffers", 0, 2, value=-1), "negative bytes or chiplet"),
    "buffer of 2^62 bytes": (_set("tables", "buffers", 0, 2, value=1 << 62), "plan rule 'over-capacity'"),
    "stream on chiplet 10^12": (_stream_on(10**12), "plan rule 'outside-chiplets'"),
    "program workload differs": (_set("programs", "decode", "workload", "batch", value=2),
                                 "plan.json: programs.decode: workload {'batch': 2, 'context': 64, 'prompt': 8} is "
                                 "not the plan's"),
    "malformed program": (_set("programs", "decode", "buffers", value=7), "plan.json: malformed plan program 'decode'"),
}


@pytest.mark.parametrize("fault", sorted(PLAN_FAULTS))
def test_a_malformed_plan_json_is_one_artifact_error(artifact, tmp_path, fault):
    how, want = PLAN_FAULTS[fault]
    if fault in ("not json", "nested 100,000 deep", "a list"):  # edits of the bytes
        folder = tampered_copy(artifact, tmp_path / "t.avc", files={"plan.json": how((artifact / "plan.json").read_bytes())})
    else:
        folder = tampered_copy(artifact, tmp_path / "t.avc", plan=how)
    with pytest.raises(ArtifactError) as refused:
        aviatorc.load(folder)
    assert want in str(refused.value), str(refused.value)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(("edit", "want"), [
    (lambda m: m.pop("files"), "manifest.json: missing field 'files'"),
    (lambda m: m["files"]["plan.json"].update(bytes="91470"), "files.plan.json.bytes: must be an integer, not '91470'"),
    (lambda m: m["files"]["graph.ir"].update(bytes=-1), "files.graph.ir: bytes must be in [0, "),
    (lambda m: m["files"]["graph.ir"].update(sha256="xyz"), "files.graph.ir: sha256 must be 64 lowercase hex digits"),
    (lambda m: m.update(shape_only="no"), "shape_only: must be true or false"),
    (lambda m: m.update(extra=1), "manifest.json: unknown field 'extra'"),
    (lambda m: m["files"].pop("report.json"), "files must list plan.json, graph.ir, target.toml, report.json"),
])
def test_a_malformed_manifest_is_one_artifact_error(artifact, tmp_path, edit, want):
    folder = tampered_copy(artifact, tmp_path / "t.avc")
    manifest = json.loads((folder / MANIFEST).read_text())
    edit(manifest)
    (folder / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="manifest.json") as refused:
        aviatorc.load(folder)
    assert want in str(refused.value)


def test_a_deeply_nested_manifest_is_one_artifact_error(artifact, tmp_path):
    folder = tampered_copy(artifact, tmp_path / "t.avc")
    (folder / MANIFEST).write_bytes(b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(ArtifactError, match="manifest.json is not valid JSON: it nests too deeply"):
        aviatorc.load(folder)


def test_weights_replaced_after_load_change_nothing_that_runs(artifact, tmp_path):
    """The file is read once at load and hashed; a copy swapped in afterwards (other values, same
    header) is never read."""
    folder = tampered_copy(artifact, tmp_path / "t.avc")
    loaded = aviatorc.load(folder)
    feeds = {"input_ids": np.arange(5, 13, dtype=np.int64)[None, :], "attention_mask": np.ones((1, 8), np.int64)}
    before = aviatorc.Session(loaded).run(feeds)["logits"]
    header, body = split((folder / WEIGHTS).read_bytes())
    noise = np.random.default_rng(0).integers(0, 256, len(body), dtype=np.uint8).tobytes()
    (folder / WEIGHTS).write_bytes(join(header, noise))  # in place: same inode, other bytes
    name = first_tensor(header)
    assert np.array_equal(loaded.tensor(name), aviatorc.load(artifact).tensor(name))
    assert np.array_equal(aviatorc.Session(loaded).run(feeds)["logits"], before)
    with pytest.raises(ArtifactError, match="was changed after the compile"):  # a new load sees the change
        aviatorc.load(folder)


def test_a_folder_others_can_write_is_loaded_with_a_warning(artifact, tmp_path, caplog):
    folder = tampered_copy(artifact, tmp_path / "t.avc")
    with caplog.at_level(logging.WARNING, logger="aviatorc"):
        aviatorc.load(folder)
    assert not [r for r in caplog.records if "writable" in r.getMessage()]
    folder.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="aviatorc"):
        aviatorc.load(folder)
    assert any("is writable by everyone" in r.getMessage() and "chmod go-w" in r.getMessage() for r in caplog.records)


def test_the_cli_says_one_line_for_a_tampered_weights_file(artifact, tmp_path):
    folder = tampered_copy(artifact, tmp_path / "t.avc", files={WEIGHTS: header_lie("offsets past the end",
                                                                                    (artifact / WEIGHTS).read_bytes())})
    np.savez(tmp_path / "feeds.npz", input_ids=np.ones((1, 8), dtype=np.int64))
    out = subprocess.run([sys.executable, "-m", "aviatorc", "run", str(folder), "--inputs", str(tmp_path / "feeds.npz")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"aviatorc: error: {folder}: {WEIGHTS} tensor '"), out.stderr


@pytest.mark.parametrize("flops", [1 << 62, -1])
def test_a_count_past_2_to_the_53_or_below_0_in_a_stream_is_one_artifact_error(artifact, tmp_path, flops):
    """Found by `tools/fuzz.py --artifacts` (program-bad-operand): a compute's flops of 2^62 loaded."""
    import dataclasses

    from aviatorc.plan.ir import Compute
    from aviatorc.plan.plan import Plan

    def edit(body: dict) -> None:
        plan = Plan.from_dict(body)
        stream = next(s for s in plan.programs["decode"].streams.values() if any(isinstance(i, Compute) for i in s))
        at = next(n for n, i in enumerate(stream) if isinstance(i, Compute))
        stream[at] = dataclasses.replace(stream[at], flops=flops)
        body.clear()
        body.update(plan.to_dict())

    with pytest.raises(ArtifactError) as refused:
        aviatorc.load(tampered_copy(artifact, tmp_path / "t.avc", plan=edit))
    assert f"'compute' field 'flops' must be a count in [0, 2^53], not {flops}" in str(refused.value), str(refused.value)
