"""Fuzz the artifact loader (`python tools/fuzz.py --artifacts --budget 1000`): an artifact is a
folder that may come from another machine or account, so loading it is parsing untrusted input.

The seed is a real artifact: the zoo's tiny Llama as a decode step with its KV cache, compiled for
`mock` at int8 (batch 2, context 64), so it loads, runs, generates and serves. Each mutant changes
one file (plan.json, manifest.json, the safetensors header of weights.safetensors, target.toml)
by one kind of mutation, drawn from `random.Random(f"{seed}:{index}")` and dealt round-robin, so
the kinds' counts are even and a mutant is rebuilt from its index alone. The manifest is then
rehashed (and plan.json's target sha256 with target.toml), so that the hash check is not what
refuses it: what must refuse it is the validation of its contents.

Every mutant goes through `aviatorc.load` (a probe child, `--probe-load`) and `aviatorc generate`,
and every `--serve-every`-th also through `aviatorc serve` (start, one completion, /health,
SIGTERM), each in a child process with a timeout and an address-space cap. Outcomes as in
`tools/fuzz.py`: ok, refused (exit 1, one `aviatorc: error:` line), internal (exit 3, or a 500
from the server), traceback, hang, killed; flag accepted-invalid: `load` accepted a mutant that
is invalid by construction (every kind here but the data-byte flip). Results:
`tools/results/fuzz_artifacts.md` and `.json`, one table row per mutation kind.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
Files = dict[str, bytes]
Mutation = Callable[[random.Random, Files], tuple[Files, str]]
SAFETENSORS = "weights.safetensors"


# -- the seed -------------------------------------------------------------------------------------


def seed_artifact(cache: Path) -> Path:
    """The seed artifact (compiled once into `cache`)."""
    import aviatorc
    from aviatorc import zoo
    from aviatorc.errors import AviatorError

    folder = cache / "seed.avc"
    if (folder / "manifest.json").exists():
        try:
            aviatorc.load(folder)
            return folder
        except AviatorError:  # compiled by another aviatorc (an older plan schema): compile it again
            shutil.rmtree(folder)

    onnx_path = zoo.export_decode_onnx("llama", cache / "llama-decode.onnx", naming="hf")
    result = aviatorc.compile(str(onnx_path), target="mock", quant="int8", batch=2, context=64, prompt=8,
                              time_limit_s=2.0)
    return result.save(folder)


def read_files(folder: Path) -> Files:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != "manifest.json"}


# -- mutations ------------------------------------------------------------------------------------


def _split(data: bytes) -> tuple[dict[str, Any], bytes]:
    length = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + length]), data[8 + length:]


def _join(header: dict[str, Any] | bytes, body: bytes, length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + body


def _tensors(header: dict[str, Any]) -> list[str]:
    return sorted(n for n in header if n != "__metadata__")


def _header(edit: Callable[[random.Random, dict[str, Any], bytes], str | bytes]) -> Mutation:
    """A mutation of the safetensors header (the body kept, the length rewritten to match)."""
    def mutate(rng: random.Random, files: Files) -> tuple[Files, str]:
        header, body = _split(files[SAFETENSORS])
        out = edit(rng, header, body)
        data = out if isinstance(out, bytes) else _join(header, body)
        return {**files, SAFETENSORS: data}, out if isinstance(out, str) else "raw bytes"
    return mutate


def _pick(rng: random.Random, header: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    name = rng.choice(_tensors(header))
    return name, header[name]


def st_huge_elements(rng: random.Random, header: dict[str, Any], body: bytes) -> str:
    name, entry = _pick(rng, header)
    entry["shape"] = [1 << 20, 1 << 20]
    return f"{name} shape [2^20, 2^20]"


def st_offsets_past_end(rng: random.Random, header: dict[str, Any], body: bytes) -> str:
    name, entry = _pick(rng, header)
    entry["data_offsets"] = [entry["data_offsets"][0], len(body) + rng.choice([1, 4096, 1 << 40])]
    return f"{name} end past the data"


def st_negative_shape(rng: random.Random, header: dict[str, Any], body: bytes) -> str:
    name, entry = _pick(rng, header)
    entry["shape"] = [-entry["shape"][0] if entry["shape"] else -1, *entry["shape"][1:]]
    return f"{name} negative dim"


def st_unknown_dtype(rng: random.Random, header: dict[str, Any], body: bytes) -> str:
    name, entry = _pick(rng, header)
    entry["dtype"] = rng.choice(["F128", "Q4", "", 7])
    return f"{name} dtype {entry['dtype']!r}"


def st_dtype_size(rng: random.Random, header: dict[str, Any], body: bytes) -> str:
    name, entry = _pick(rng, header)
    entry["dtype"] = {"F32": "F16", "F16": "F32", "I8": "I32", "U8": "U16", "I64": "I8", "I32": "I8"}.get(entry["dtype"],
                                                                                                   "F64")
    return f"{name} dtype {entry['dtype']} over the old offsets"


def st_overlap(rng: random.Random, header: dict[str, Any], body: bytes) -> str:
    a, b = rng.sample(_tensors(header), 2)
    header[b]["data_offsets"] = list(header[a]["data_offsets"])
    header[b]["shape"], header[b]["dtype"] = list(header[a]["shape"]), header[a]["dtype"]
    return f"{b} on the bytes of {a}"


def st_missing_tensor(rng: random.Random, header: dict[str, Any], body: bytes) -> bytes:
    """A tensor dropped with its bytes: a well-formed file that lacks what the plan reads."""
    drop = rng.choice([n for n in _tensors(header) if n.endswith(".values")])
    begin, end = header.pop(drop)["data_offsets"]
    for entry in header.values():
        if isinstance(entry, dict) and "data_offsets" in entry and entry["data_offsets"][0] >= end:
            entry["data_offsets"] = [o - (end - begin) for o in entry["data_offsets"]]
    return _join(header, body[:begin] + body[end:])


def st_deep_metadata(rng: random.Random, header: dict[str, Any], body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    raw = b'{"__metadata__": {"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}, " + raw[1:]
    return _join(raw, body)


def st_huge_length(rng: random.Random, header: dict[str, Any], body: bytes) -> bytes:
    return _join(header, body, length=rng.choice([1 << 62, (1 << 64) - 1, 1 << 40]))


def st_short_length(rng: random.Random, header: dict[str, Any], body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return _join(raw, body, length=rng.randrange(1, len(raw)))


def st_garbage_header(rng: random.Random, header: dict[str, Any], body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return _join(bytes(rng.randrange(256) for _ in range(len(raw))), body)


def st_truncated(rng: random.Random, files: Files) -> tuple[Files, str]:
    data = files[SAFETENSORS]
    cut = rng.randrange(0, len(data))
    return {**files, SAFETENSORS: data[:cut]}, f"cut at byte {cut}"


def st_empty(rng: random.Random, files: Files) -> tuple[Files, str]:
    return {**files, SAFETENSORS: b""}, "empty"


def st_body_flip(rng: random.Random, files: Files) -> tuple[Files, str]:
    """Other weight values, well formed: valid by construction (nothing can tell them apart)."""
    header, body = _split(files[SAFETENSORS])
    data = bytearray(body)
    at = rng.randrange(len(data))
    data[at] ^= 1 << rng.randrange(8)
    return {**files, SAFETENSORS: _join(header, bytes(data))}, f"data byte {at}"


def _json_file(name: str, edit: Callable[[random.Random, Any], str]) -> Mutation:
    def mutate(rng: random.Random, files: Files) -> tuple[Files, str]:
        document = json.loads(files[name])
        detail = edit(rng, document)
        return {**files, name: json.dumps(document).encode()}, detail
    return mutate


def _raw_file(name: str, edit: Callable[[random.Random, bytes], tuple[bytes, str]]) -> Mutation:
    def mutate(rng: random.Random, files: Files) -> tuple[Files, str]:
        data, detail = edit(rng, files[name])
        return {**files, name: data}, detail
    return mutate


def not_json(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    cut = rng.randrange(1, len(data) - 1)
    return data[:cut], f"cut at {cut}"


def deep(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    return b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests 100,000 deep"


WRONG = ["4", None, [], {}, True, -1, 1.5, "x" * 10]


def changed(rng: random.Random, old: Any, choices: list[Any]) -> Any:
    """One of `choices` that is not `old` as JSON writes it (a mutation that changes nothing is no mutation)."""
    return rng.choice([c for c in choices if json.dumps(c) != json.dumps(old)])


def missing_key(rng: random.Random, document: dict[str, Any]) -> str:
    key = rng.choice(sorted(document))
    del document[key]
    return f"no {key}"


def wrong_type(rng: random.Random, document: dict[str, Any]) -> str:
    key = rng.choice(sorted(document))
    document[key] = rng.choice([w for w in WRONG if type(w) is not type(document[key])])
    return f"{key} = {json.dumps(document[key])}"


# plan.json is schema 2 (docs/plan-format.md): a tile is a row of 9 integers [weight, k0, k1, n0,
# n1, bytes, compute chiplet, resident chiplet or -1, channel or -1] beside a `weights` table;
# buffers are rows [name, chiplet, bytes, kind, tile, layer] of the shared `tables`; a stream is a
# flat list of integers. Edits of what a program means go through the typed plan and back.
TILE_COMPUTE, TILE_CHIPLET = 6, 7


def tile_field(rng: random.Random, plan: dict[str, Any]) -> str:
    index = rng.randrange(len(plan["tiles"]))
    row = plan["tiles"][index]
    at = rng.randrange(len(row))
    row[at] = changed(rng, row[at], [*WRONG, 1 << 62, -7, (row[at] + 1) << 20])
    return f"tiles[{index}][{at}] = {json.dumps(row[at])}"


def _workload(key: str, values: list[int]) -> Callable[[random.Random, Any], str]:
    def edit(rng: random.Random, plan: dict[str, Any]) -> str:
        value = rng.choice(values)
        for record in [plan["workload"], *(p["workload"] for p in plan["programs"].values())]:
            record[key] = value
        return f"{key} = {value}"
    return edit


def prompt_over_context(rng: random.Random, plan: dict[str, Any]) -> str:
    for record in [plan["workload"], *(p["workload"] for p in plan["programs"].values())]:
        record["prompt"] = record["context"] + 1
    return "prompt = context + 1"


def unknown_format(rng: random.Random, plan: dict[str, Any]) -> str:
    weight = rng.choice(plan["weights"])
    weight["format"]["format"] = rng.choice(["int3", "fp8", "", "INT8"])
    return f"weight {weight['name']} format {weight['format']['format']!r}"


def chiplet_huge(rng: random.Random, plan: dict[str, Any]) -> str:
    value = rng.choice([10**12, 1 << 62, 4, 7])
    if rng.random() < 0.5:
        plan["chiplets"][-1] = value
        return f"chiplets[-1] = {value}"
    index = rng.randrange(len(plan["tiles"]))
    plan["tiles"][index][rng.choice([TILE_COMPUTE, TILE_CHIPLET])] = value
    return f"tiles[{index}] chiplet = {value}"


def buffer_field(column: int, values: list[int]) -> Callable[[random.Random, dict[str, Any]], str]:
    def edit(rng: random.Random, plan: dict[str, Any]) -> str:
        index = rng.randrange(len(plan["tables"]["buffers"]))
        plan["tables"]["buffers"][index][column] = rng.choice(values)
        return f"buffers[{index}][{column}] = {plan['tables']['buffers'][index][column]}"
    return edit


def _typed(edit: Callable[[random.Random, Any], str]) -> Callable[[random.Random, dict[str, Any]], str]:
    """An edit of one program of the typed plan, written back as plan.json."""
    def apply(rng: random.Random, document: dict[str, Any]) -> str:
        from aviatorc.plan.plan import Plan

        plan = Plan.from_dict(document)
        phase = rng.choice(sorted(plan.programs))
        detail = edit(rng, plan.programs[phase].streams)
        document.clear()
        document.update(plan.to_dict())
        return f"{phase}: {detail}"
    return apply


def recv_without_send(rng: random.Random, streams: dict[int, list[Any]]) -> str:
    """A send dropped, or (a program without transfers) a recv of a value no stream sends."""
    from aviatorc.plan.ir import Recv, Send, ValueRef

    sends = [(c, i) for c, items in streams.items() for i, ins in enumerate(items) if isinstance(ins, Send)]
    if sends:
        chiplet, index = rng.choice(sends)
        return f"{streams[chiplet].pop(index)} dropped from stream {chiplet}"
    chiplet = rng.choice(sorted(streams))
    src = rng.choice(sorted(streams))
    streams[chiplet].insert(rng.randrange(len(streams[chiplet]) + 1), Recv(ValueRef("fuzz.value"), src, 64))
    return f"stream {chiplet} receives 'fuzz.value' from {src}, which never sends it"


def dependency_cycle(rng: random.Random, streams: dict[int, list[Any]]) -> str:
    """Two streams that each wait first for an event the other signals last: a deadlock."""
    from aviatorc.plan.ir import Signal, Wait

    a, b = rng.sample(sorted(streams), 2) if len(streams) > 1 else (min(streams), min(streams))
    streams[a][:0] = [Wait("fuzz.b")]
    streams[a].append(Signal("fuzz.a"))
    streams[b][:0] = [Wait("fuzz.a")]
    streams[b].append(Signal("fuzz.b"))
    return f"streams {a} and {b} wait on each other"


def _stream(edit: Callable[[random.Random, list[Any]], str]) -> Callable[[random.Random, dict[str, Any]], str]:
    def apply(rng: random.Random, plan: dict[str, Any]) -> str:
        phase = rng.choice(sorted(plan["programs"]))
        streams = plan["programs"][phase]["streams"]
        chiplet = rng.choice(sorted(streams))
        return f"{phase} stream {chiplet}: {edit(rng, streams[chiplet])}"
    return apply


def unknown_op(rng: random.Random, stream: list[Any]) -> str:
    stream.insert(0, rng.choice([999, -1, 1 << 40]))
    return f"opcode {stream[0]}"


def bad_operand(rng: random.Random, stream: list[Any]) -> str:
    at = rng.randrange(len(stream))
    stream[at] = changed(rng, stream[at], [*WRONG, 1 << 62, -2, 10**6])
    return f"item {at} = {json.dumps(stream[at])}"


def random_edit(rng: random.Random, plan: dict[str, Any]) -> str:
    """Anywhere in plan.json: a value replaced (a wrong type, a huge, negative or nearby number), a
    key dropped or a list item dropped. Not invalid by construction: a figure of the prediction
    may change to another figure."""
    spots: list[tuple[Any, Any]] = []  # (container, key or index)
    stack: list[Any] = [plan]
    while stack:
        node = stack.pop()
        for key in (sorted(node) if isinstance(node, dict) else range(len(node))):
            spots.append((node, key))
            if isinstance(node[key], (dict, list)) and node[key]:
                stack.append(node[key])
    node, key = rng.choice(spots)
    old = node[key]
    if rng.random() < 0.2:
        del node[key]
        return f"dropped {key!r} (was {json.dumps(old)[:40]})"
    nearby = [old + 1, old - 1, -old] if isinstance(old, int) and not isinstance(old, bool) else []
    node[key] = changed(rng, old, [*WRONG, 0, 1 << 62, -(1 << 31), 1e308, *nearby])
    return f"{key!r}: {json.dumps(old)[:40]} -> {json.dumps(node[key])}"


def _target(edit: Callable[[random.Random, str], tuple[str, str]]) -> Mutation:
    """A mutation of target.toml, with plan.json's target sha256 made to match."""
    def mutate(rng: random.Random, files: Files) -> tuple[Files, str]:
        import hashlib

        text, detail = edit(rng, files["target.toml"].decode())
        plan = json.loads(files["plan.json"])
        plan["target"]["sha256"] = hashlib.sha256(text.encode()).hexdigest()
        return {**files, "target.toml": text.encode(), "plan.json": json.dumps(plan).encode()}, detail
    return mutate


def _replace(key: str, value: str) -> Callable[[random.Random, str], tuple[str, str]]:
    def edit(rng: random.Random, text: str) -> tuple[str, str]:
        lines = [f"{key} = {value}" if line.split("=")[0].strip() == key else line for line in text.splitlines()]
        return "\n".join(lines) + "\n", f"{key} = {value}"
    return edit


def target_garbage(rng: random.Random, text: str) -> tuple[str, str]:
    return text.replace("[", "{", 1), "not TOML"


def target_extends(rng: random.Random, text: str) -> tuple[str, str]:
    return 'extends = "../../../../etc/hosts.toml"\n' + text, "extends a path outside"


def target_no_section(rng: random.Random, text: str) -> tuple[str, str]:
    start = text.index("[chiplet]")
    end = text.index("[", start + 1)
    return text[:start] + text[end:], "no [chiplet]"


KINDS: dict[str, tuple[Mutation, bool]] = {  # kind -> (mutation, invalid by construction)
    "st-huge-elements": (_header(st_huge_elements), True),
    "st-offsets-past-end": (_header(st_offsets_past_end), True),
    "st-negative-shape": (_header(st_negative_shape), True),
    "st-unknown-dtype": (_header(st_unknown_dtype), True),
    "st-dtype-size": (_header(st_dtype_size), True),
    "st-overlap": (_header(st_overlap), True),
    "st-missing-tensor": (_header(st_missing_tensor), True),
    "st-deep-metadata": (_header(st_deep_metadata), True),
    "st-huge-header-length": (_header(st_huge_length), True),
    "st-short-header-length": (_header(st_short_length), True),
    "st-garbage-header": (_header(st_garbage_header), True),
    "st-truncated": (st_truncated, True),
    "st-empty": (st_empty, True),
    "st-data-flip": (st_body_flip, False),
    "manifest-not-json": (_raw_file("manifest.json", not_json), True),
    "manifest-deep": (_raw_file("manifest.json", deep), True),
    "manifest-missing-key": (_json_file("manifest.json", missing_key), True),
    "manifest-wrong-type": (_json_file("manifest.json", wrong_type), True),
    "manifest-file-bytes": (_json_file("manifest.json", lambda rng, m: _entry_bytes(rng, m)), True),
    "manifest-outside-name": (_json_file("manifest.json", lambda rng, m: _outside(rng, m)), True),
    "plan-not-json": (_raw_file("plan.json", not_json), True),
    "plan-deep": (_raw_file("plan.json", deep), True),
    "plan-missing-key": (_json_file("plan.json", missing_key), True),
    "plan-wrong-type": (_json_file("plan.json", wrong_type), True),
    "plan-tile-field": (_json_file("plan.json", tile_field), True),
    "plan-batch": (_json_file("plan.json", _workload("batch", [0, -1, 10**9])), True),
    "plan-context": (_json_file("plan.json", _workload("context", [0, 1 << 40, -5])), True),
    "plan-prompt-over-context": (_json_file("plan.json", prompt_over_context), True),
    "plan-unknown-format": (_json_file("plan.json", unknown_format), True),
    "plan-chiplet": (_json_file("plan.json", chiplet_huge), True),
    "plan-random-edit": (_json_file("plan.json", random_edit), False),
    "program-negative-buffer": (_json_file("plan.json", buffer_field(2, [-1, -(1 << 30)])), True),
    "program-huge-buffer": (_json_file("plan.json", buffer_field(2, [1 << 62, 10**15])), True),
    "program-buffer-chiplet": (_json_file("plan.json", buffer_field(1, [10**12, -1, 1 << 40])), True),
    "program-recv-without-send": (_json_file("plan.json", _typed(recv_without_send)), True),
    "program-dependency-cycle": (_json_file("plan.json", _typed(dependency_cycle)), True),
    "program-unknown-op": (_json_file("plan.json", _stream(unknown_op)), True),
    "program-bad-operand": (_json_file("plan.json", _stream(bad_operand)), True),
    "target-cards": (_target(_replace("cards", "1000000000")), True),
    "target-negative-sram": (_target(_replace("sram_bytes", "-1")), True),
    "target-tiny-sram": (_target(_replace("sram_bytes", "64")), True),
    "target-not-toml": (_target(target_garbage), True),
    "target-extends": (_target(target_extends), True),
    "target-no-section": (_target(target_no_section), True),
}


def _entry_bytes(rng: random.Random, manifest: dict[str, Any]) -> str:
    name = rng.choice(sorted(manifest["files"]))
    manifest["files"][name]["bytes"] += rng.choice([1, -1, 1 << 50])
    return f"{name} bytes off"


def _outside(rng: random.Random, manifest: dict[str, Any]) -> str:
    name = rng.choice(["../x.json", "/etc/passwd", "a/b", ".hidden"])
    manifest["files"][name] = {"sha256": "0" * 64, "bytes": 1}
    return f"lists {name}"


def make_mutant(index: int, seed: int, files: Files) -> tuple[str, str, bool, Files, bytes | None]:
    """(kind, detail, invalid, files, manifest override): kinds dealt round-robin."""
    kind = list(KINDS)[index % len(KINDS)]
    rng = random.Random(f"{seed}:{index}")
    mutation, invalid = KINDS[kind]
    manifest: bytes | None = None
    if kind.startswith("manifest-"):
        manifest_files = {**files, "manifest.json": _manifest_of(files)}
        mutated, detail = mutation(rng, manifest_files)
        manifest = mutated.pop("manifest.json")
        return kind, detail, invalid, mutated, manifest
    mutated, detail = mutation(rng, dict(files))
    return kind, detail, invalid, mutated, manifest


def _manifest_of(files: Files) -> bytes:
    from aviatorc.plan.artifact import MANIFEST, write_artifact

    with tempfile.TemporaryDirectory() as tmp:
        return (write_artifact(Path(tmp) / "a.avc", files) / MANIFEST).read_bytes()


def write_mutant(folder: Path, files: Files, manifest: bytes | None) -> Path:
    from aviatorc.plan.artifact import MANIFEST, write_artifact

    out = write_artifact(folder / "art.avc", files)
    if manifest is not None:
        (out / MANIFEST).write_bytes(manifest)
    return out


# -- doors ---------------------------------------------------------------------------------------


def probe_load(path: str) -> int:
    """What `aviatorc.load` says, in the CLI's words: exit 0, 1 with one error line, or 3."""
    from aviatorc.errors import AviatorError

    try:
        import aviatorc

        aviatorc.load(path)
    except AviatorError as error:
        print(f"aviatorc: error: {error}", file=sys.stderr)
        return 1
    except Exception as error:  # noqa: BLE001 - what the fuzzer looks for
        print(f"aviatorc: internal error, please report: {type(error).__name__}: {error}", file=sys.stderr)
        return 3
    return 0


def serve_door(art: Path, *, timeout_s: float, mem_bytes: int, env: dict[str, str]) -> dict[str, Any]:
    """Start `aviatorc serve`, ask for one completion and /health, SIGTERM it; classify."""
    import resource

    import httpx

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))

    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "aviatorc", "serve", str(art), "--port", "0", "--shutdown-timeout",
                             "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=limit, start_new_session=True)
    ready: list[str] = []
    reader = threading.Thread(target=lambda: ready.extend(line for line in proc.stdout if "listening on" in line),
                              daemon=True)  # type: ignore[union-attr]
    reader.start()
    deadline = time.monotonic() + timeout_s
    while not ready and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    outcome, detail = "ok", ""
    if not ready:
        if proc.poll() is None:
            outcome, detail = "hang", "never listened"
        else:
            stderr = proc.stderr.read() if proc.stderr else ""  # type: ignore[union-attr]
            lines = [line for line in stderr.splitlines() if line.strip()]
            outcome = {1: "refused", 3: "internal"}.get(proc.returncode, "traceback")
            if "Traceback (most recent call last)" in stderr:
                outcome = "traceback"
            detail = lines[-1][-300:] if lines else ""
    else:
        url = ready[0].split()[4]
        try:
            answer = httpx.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2}, timeout=20)
            health = httpx.get(url + "/health", timeout=5)
            detail = f"completion {answer.status_code}, health {health.status_code}"
            if answer.status_code >= 500 or health.status_code >= 500:
                outcome = "internal"
        except httpx.HTTPError as error:
            outcome, detail = "hang", f"no answer: {type(error).__name__}"
        proc.send_signal(signal.SIGTERM)
        try:
            if proc.wait(timeout=15) != 0 and outcome == "ok":
                outcome, detail = "internal", f"exit {proc.returncode} after SIGTERM"
        except subprocess.TimeoutExpired:
            outcome, detail = "hang", "ignored SIGTERM"
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return {"door": "serve", "outcome": outcome, "returncode": proc.returncode, "seconds":
            round(time.perf_counter() - start, 2), "max_rss_mb": 0.0, "stderr_tail": detail, "flags": []}


def run_mutant(fuzz: Any, index: int, seed: int, files: Files, work: Path, *, timeout_s: float, mem_bytes: int,
               serve_every: int, keep: Path | None) -> dict[str, Any]:
    kind, detail, invalid, mutated, manifest = make_mutant(index, seed, files)
    folder = work / f"m{index:05d}"
    folder.mkdir(parents=True, exist_ok=True)
    art = write_mutant(folder, mutated, manifest)
    env = fuzz.child_env()
    runs = [fuzz.run_cli([sys.executable, str(Path(__file__)), "--probe-load", str(art)], folder, "load",
                         timeout_s=timeout_s, mem_bytes=mem_bytes)]
    runs.append(fuzz.run_cli([sys.executable, "-m", "aviatorc", "generate", str(art), "--prompt-ids", "5,6,7",
                              "--max-new-tokens", "2"], folder, "generate", timeout_s=timeout_s, mem_bytes=mem_bytes))
    if serve_every and index % serve_every == 0:
        runs.append(serve_door(art, timeout_s=timeout_s, mem_bytes=mem_bytes, env=env))
    if invalid and runs[0]["outcome"] == "ok":
        runs[0]["flags"].append("accepted-invalid")
    worst = max(runs, key=lambda r: fuzz.WORST[r["outcome"]])
    flags = sorted({f for r in runs for f in r["flags"]})
    bad = worst["outcome"] not in ("ok", "refused") or "accepted-invalid" in flags
    if bad and keep is not None:
        shutil.copytree(folder, keep / folder.name, dirs_exist_ok=True)
    shutil.rmtree(folder, ignore_errors=True)
    return {"index": index, "family": kind.split("-")[0], "kind": kind, "seed_name": "llama-decode", "detail": detail,
            "expect_refusal": invalid, "outcome": worst["outcome"], "flags": flags, "runs": runs}


def campaign(fuzz: Any, budget: int, seed: int, *, jobs: int = 2, timeout_s: float = 60.0, mem_gb: float = 4.0,
             serve_every: int = 10, keep: Path | None = None, cache: Path | None = None,
             kinds: list[int] | None = None,
             progress: Callable[[list[dict[str, Any]]], None] | None = None) -> dict[str, Any]:
    """Run `budget` mutants (or the indices `kinds`); the results, JSON-ready."""
    import concurrent.futures

    cache = cache or Path(tempfile.gettempdir()) / "aviatorc-fuzz-artifacts"
    cache.mkdir(parents=True, exist_ok=True)
    files = read_files(seed_artifact(cache))
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    indices = kinds if kinds is not None else list(range(budget))
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="aviatorc-fuzz-art-") as tmp, \
            concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(run_mutant, fuzz, i, seed, files, Path(tmp), timeout_s=timeout_s,
                               mem_bytes=int(mem_gb * (1 << 30)), serve_every=serve_every, keep=keep) for i in indices]
        for future in concurrent.futures.as_completed(futures):
            records.append(future.result())
            if progress:
                progress(records)
    records.sort(key=lambda r: r["index"])
    return fuzz.summarize(records, budget=len(indices), seed=seed, seconds=time.perf_counter() - start, jobs=jobs,
                          timeout_s=timeout_s, mem_gb=mem_gb, seeds=["llama-decode (mock, int8, batch 2)"],
                          serve_every=serve_every)


def render(results: dict[str, Any], command: str, finding_lines: Callable[[list[Any], int], list[str]]) -> str:
    meta, totals = results["meta"], results["totals"]
    accepted = totals.get("accepted-invalid", 0)
    lines = [
        "## Fuzzing the artifact loader (`tools/fuzz.py --artifacts`)",
        "",
        f"`{command}`: {totals.get('mutants', 0):,} tampered artifacts of the tiny Llama decode step ({len(KINDS)} "
        f"kinds, dealt evenly; the manifest rehashed each time), {results['runs']:,} probes (`aviatorc.load`, "
        f"`aviatorc generate`, and `aviatorc serve` for every {meta['serve_every']}th: start, one completion, "
        f"/health, SIGTERM), {meta['jobs']} at a time, {meta['timeout_s']:.0f} s timeout, {meta['mem_gb']:g} GiB "
        f"address-space cap, {meta['seconds'] / 60:.1f} min.",
        "",
        f"**{totals.get('internal', 0)} internal errors, {totals.get('traceback', 0)} tracebacks, "
        f"{totals.get('hang', 0)} hangs, {totals.get('killed', 0)} killed (unbounded allocation), "
        f"{accepted} tampered artifacts accepted by `load`.**",
        "",
        "| kind | mutants | ok | refused | internal | traceback | hang | killed | accepted by load | max s | max RSS MB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results["rows"]:
        lines.append(f"| {row['kind']} | " + " | ".join(str(row[c]) for c in (
            "mutants", "ok", "refused", "internal", "traceback", "hang", "killed", "accepted-invalid"))
            + f" | {row['max_seconds']:.1f} | {row['max_rss_mb']:.0f} |")
    lines += ["", "A row's outcome is its worst probe's. ok: every probe ran (a generate or serve that works on a "
              "tampered artifact that `load` accepted); refused: one `aviatorc: error:` line, exit 1; accepted by "
              "load: invalid by construction (every kind but st-data-flip, whose other weight values nothing can "
              "tell apart, and plan-random-edit, which may change only a predicted figure), yet `aviatorc.load` "
              "returned. The program-* and target-* kinds are refused by `load` running the plan checker on the "
              "artifact's target."]
    return "\n".join(lines + finding_lines(results["findings"], 25)) + "\n"


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--probe-load":
    sys.exit(probe_load(sys.argv[2]))
