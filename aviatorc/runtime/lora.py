"""LoRA adapters beside a compiled base: PEFT's format, applied while the base's matmuls run.

    session = Session("base.avc", lora=True)
    session.load_adapter("sql", "adapters/sql")    # adapter_config.json + adapter_model.safetensors
    session.prefill(0, ids, adapter="sql")          # the slot runs with the adapter from then on
    session.decode([0, 1], [t0, t1])                # slot 1 may run the base, or another adapter

A LoRA adapter adds (x @ A^T) @ B^T x scale to the output of each projection it targets, with A
[r, in] and B [out, r] and scale lora_alpha / r (lora_alpha / sqrt(r) under rsLoRA). The base's
weights stay as compiled (quantized or not, never touched): each MatMul column strip the sim
backend computes gets the low-rank product of its columns added, per sequence of the step, by
the adapter that sequence runs (`Adapters.add`), so one step mixes sequences of different
adapters and of the base. Loading one reads two small files and compiles nothing.

A PEFT module is matched to the compiled graph by its path (`model.layers.0.self_attn.q_proj`)
against the graph's weight names, whatever prefix the import added; q, k and v projections that
fuse-qkv joined are matched to their columns of the fused weight. What the runtime does not
implement is refused by name: DoRA, trained biases, modules saved whole (`modules_to_save`), per
module ranks or alphas, and a module that matches no weight or whose shapes do not fit it. The
adapter's weights are read with safetensors, never unpickled.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from aviatorc.errors import ModelFormatError, OptionError
from aviatorc.ir import Graph

_logger = logging.getLogger("aviatorc.runtime.lora")
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")
_UNSUPPORTED = {"use_dora": "DoRA", "modules_to_save": "modules saved whole (modules_to_save)",
                "layer_replication": "layer replication", "rank_pattern": "per-module ranks (rank_pattern)",
                "alpha_pattern": "per-module alphas (alpha_pattern)"}


@dataclass(frozen=True)
class Target:
    """Columns [start, stop) of a MatMul node's output: where one PEFT module's product goes."""

    node: str
    start: int
    stop: int
    k: int


@dataclass(frozen=True)
class Delta:
    """One module's low-rank product: out[..., start:stop] += (x @ a) @ b, scale folded into b."""

    target: Target
    a: np.ndarray  # [in, r] float32
    b: np.ndarray  # [r, out] float32


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str
    rank: int
    deltas: tuple[Delta, ...]


def targets(graph: Graph) -> dict[str, list[Target]]:
    """Module path (dots, the weight's name before `.weight`) -> the columns it owns, for every
    MatMul weight of the graph (a fused q/k/v weight: each projection's columns under its own
    name as well as the fused name)."""
    from aviatorc.partition.tiling import lora_reachable
    from aviatorc.partition.weights import weights_from_graph
    from aviatorc.passes.fuse_qkv import ROLE_TOKENS

    fused_tokens = {fused: {role: token for token, (role, f) in ROLE_TOKENS.items() if f == fused}
                    for _, fused in ROLE_TOKENS.values()}
    nodes = {node.name: node for node in graph.nodes}
    found: dict[str, list[Target]] = {}
    for spec in weights_from_graph(graph):
        readers = [name for name in spec.nodes if name in nodes and nodes[name].op == "MatMul"]
        if not lora_reachable(spec) or not readers:
            continue
        # The name up to its `.weight` (a quantized one is stored as `NAME.weight.values` and scales).
        path = spec.name[:spec.name.rindex(".weight")] if ".weight" in spec.name else spec.name
        for node in readers:
            found.setdefault(path, []).append(Target(node, 0, spec.n, spec.k))
        head, _, last = path.rpartition(".")
        for role, start, stop in spec.splits:
            token = fused_tokens.get(last, {}).get(role)
            if token:
                for node in readers:
                    found.setdefault(f"{head}.{token}", []).append(Target(node, start, stop, spec.k))
    return found


def load_adapter(name: str, path: str | os.PathLike[str], graph: Graph, known: dict[str, list[Target]] | None = None) -> Adapter:
    """Read a PEFT adapter folder and match it to `graph` (`targets`); errors name the file."""
    folder = Path(path)
    config_path, weights_path = folder / CONFIG, folder / WEIGHTS
    if not config_path.is_file():
        hint = ("that is a PyTorch pickle, which is never loaded: save the adapter with safe_serialization=True"
                if (folder / "adapter_model.bin").exists() else "give the folder PEFT's save_pretrained wrote")
        raise OptionError(f"{folder}: no {CONFIG} here", hint=hint)
    if not weights_path.is_file():
        raise OptionError(f"{folder}: no {WEIGHTS} here", hint="save the adapter with safe_serialization=True")
    config = _config(config_path)
    rank, alpha = config["r"], config["lora_alpha"]
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs = _pairs(weights_path)
    modules = known if known is not None else targets(graph)
    deltas = []
    for module, (a, b) in sorted(pairs.items()):
        matched = _match(module, modules)
        if not matched:
            raise ModelFormatError(f"{weights_path}: module '{module}' matches no projection of the compiled model",
                                   hint="an adapter trained for this model's architecture and names")
        if a.shape[0] != rank or b.shape[1] != rank:
            raise ModelFormatError(f"{weights_path}: module '{module}' has rank {a.shape[0]}, not r = {rank}")
        for target in matched:
            if a.shape[1] != target.k or b.shape[0] != target.stop - target.start:
                raise ModelFormatError(f"{weights_path}: module '{module}' maps [{a.shape[1]}] -> [{b.shape[0]}], "
                                       f"but its projection '{target.node}' maps [{target.k}] -> "
                                       f"[{target.stop - target.start}]")
            deltas.append(Delta(target, np.ascontiguousarray(a.T), np.ascontiguousarray(b.T * np.float32(scale))))
    if not deltas:
        raise ModelFormatError(f"{weights_path}: no LoRA weights (lora_A / lora_B) in it")
    return Adapter(name, str(folder), rank, tuple(deltas))


def _config(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()[:MAX_CONFIG_BYTES + 1]
    if len(raw) > MAX_CONFIG_BYTES:
        raise ModelFormatError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelFormatError(f"{path}: not JSON ({error})") from None
    if not isinstance(config, dict):
        raise ModelFormatError(f"{path}: must hold a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ModelFormatError(f"{path}: a {config.get('peft_type')} adapter; only LoRA adapters run beside a base")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise ModelFormatError(f"{path}: {what} is not supported", hint="train the adapter as plain LoRA")
    if config.get("bias", "none") != "none":
        raise ModelFormatError(f"{path}: trained biases (bias={config.get('bias')!r}) are not supported")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1 << 16:
            raise ModelFormatError(f"{path}: '{key}' must be a positive number, not {value!r}")
    if not isinstance(config["r"], int):
        raise ModelFormatError(f"{path}: 'r' must be an integer, not {config['r']!r}")
    return config


def _pairs(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """module -> (lora_A [r, in], lora_B [out, r]) as float32."""
    from safetensors import SafetensorError, safe_open

    found: dict[str, dict[str, np.ndarray]] = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                match = _KEY.match(key)
                if match is None:
                    raise ModelFormatError(f"{path}: '{key}' is not a LoRA weight (lora_A / lora_B)",
                                           hint="only LoRA's low-rank matrices run beside a base")
                tensor = f.get_tensor(key)
                if tensor.ndim != 2 or not tensor.is_floating_point():
                    raise ModelFormatError(f"{path}: '{key}' must be a 2-D float matrix, not {tuple(tensor.shape)} "
                                           f"{tensor.dtype}")
                found.setdefault(match["module"], {})[match["which"]] = tensor.float().numpy()
    except SafetensorError as error:
        raise ModelFormatError(f"{path}: not a safetensors file ({error})") from None
    for module, pair in found.items():
        if set(pair) != {"A", "B"}:
            raise ModelFormatError(f"{path}: module '{module}' has lora_{next(iter(pair))} but not its pair")
    return {module: (pair["A"], pair["B"]) for module, pair in found.items()}


def _match(module: str, known: dict[str, list[Target]]) -> list[Target]:
    """The targets whose path is `module` after some prefix (at a dot or an underscore)."""
    for path, found in known.items():
        if path == module or path.endswith("." + module):
            return found
    flat = module.replace(".", "_")
    for path, found in known.items():
        if path.replace(".", "_").endswith("_" + flat):
            return found
    return []


class Adapters:
    """The adapters a session holds, and the adapter of each sequence of the step each thread is
    running (`running`, set by the session around a step: a step that pauses for a prefill, as
    `Session.precedence` has it, keeps its own)."""

    def __init__(self, graph: Graph, *, max_rank: int = 0, max_loras: int = 0) -> None:
        """`max_rank`, `max_loras`: what the plan reserved SRAM for (`aviatorc compile --lora-rank
        --max-loras`), which loading enforces; 0: nothing reserved, so adapters load unchecked and
        the plan's prediction does not count them (said once, in the log)."""
        self.graph = graph
        self.max_rank, self.max_loras = max_rank, max_loras
        self.known = targets(graph)
        self.nodes = frozenset(t.node for found in self.known.values() for t in found)  # what an adapter may touch
        self.loaded: dict[str, Adapter] = {}
        self._by_node: dict[str, dict[str, list[Delta]]] = {}  # adapter -> node -> its deltas
        self._steps = threading.local()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def running(self, rows: Sequence[str | None]) -> Iterator[None]:
        """While a step of sequences running `rows` (an adapter's name, or None for the base, each) runs."""
        self._steps.rows = rows
        try:
            yield
        finally:
            self._steps.rows = ()

    def load(self, name: str, path: str | os.PathLike[str]) -> Adapter:
        if not name or name in self.loaded:
            raise OptionError(f"an adapter named '{name}' is loaded already" if name else "an adapter needs a name")
        if self.max_rank and len(self.loaded) >= self.max_loras:
            raise OptionError(f"the plan holds {self.max_loras} LoRA adapter(s) at once, and {len(self.loaded)} are "
                              "loaded", hint="unload one, or compile with a larger --max-loras")
        adapter = load_adapter(name, path, self.graph, self.known)
        if self.max_rank and adapter.rank > self.max_rank:
            raise OptionError(f"adapter '{name}' has rank {adapter.rank}, above the {self.max_rank} the plan reserved "
                              "SRAM for", file=str(path), hint=f"compile with --lora-rank {adapter.rank} or more")
        if not self.max_rank and not self.loaded:
            _logger.warning("the plan reserves no SRAM for LoRA adapters (aviatorc compile --lora-rank R --max-loras "
                            "N): adapter '%s' runs, but the plan's prediction does not count it", name)
        by_node: dict[str, list[Delta]] = {}
        for delta in adapter.deltas:
            by_node.setdefault(delta.target.node, []).append(delta)
        with self._lock:
            self.loaded[name] = adapter
            self._by_node[name] = by_node
        return adapter

    def unload(self, name: str) -> None:
        if name not in self.loaded:
            raise OptionError(f"no adapter named '{name}' is loaded")
        with self._lock:
            del self.loaded[name]
            del self._by_node[name]

    def add(self, node: str, start: int, stop: int, out: np.ndarray, x: np.ndarray) -> np.ndarray:
        """`out` (columns [start, stop) of `node`'s product of `x`) with each sequence's adapter's
        low-rank product added: the sim backend's hook after every MatMul strip."""
        rows = getattr(self._steps, "rows", ())
        if not rows or not any(rows):
            return out
        sequences = len(rows)
        xs = x.reshape(sequences, -1, x.shape[-1]).astype(np.float32, copy=False)
        result: np.ndarray | None = None
        for name in sorted({r for r in rows if r is not None}):
            chosen = [i for i, r in enumerate(rows) if r == name]
            for delta in self._by_node.get(name, {}).get(node, ()):
                lo, hi = max(start, delta.target.start), min(stop, delta.target.stop)
                if lo >= hi:
                    continue
                if result is None:
                    result = out.reshape(sequences, -1, out.shape[-1]).astype(np.float32)
                low = xs[chosen] @ delta.a
                result[chosen, :, lo - start:hi - start] += low @ delta.b[:, lo - delta.target.start:hi - delta.target.start]
        return out if result is None else result.reshape(out.shape).astype(out.dtype, copy=False)
