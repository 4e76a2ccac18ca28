"""Recognize a decoder graph that carries its KV cache, so one graph serves prompt and decode.

    layout = find_cache(graph)          # None when the graph has no cache inputs
    layout.pairs                        # (past input, present output) per layer and K/V

Exporters name the cache in a few ways; recognized here, by input and matching output:

    past_key_values.N.key / present.N.key        (Hugging Face optimum, onnxruntime-genai)
    past_key_N / present_key_N                   (flat names, e.g. a torch.onnx.export wrapper)
    past_key_values.N.value, past_value_N ...    (the same for values)

A pair counts only if the shapes agree: same rank, and every dim equal except the sequence
axis, which is symbolic in the past. The token input is `input_ids` with a symbolic length (a
static one bakes the sequence length into rotary tables and masks: such a graph cannot
generate, and `static_reason` says why); `attention_mask` and `position_ids`, where present,
are fed by the runtime. The batch is axis 0 of every input; `CacheLayout.batch` is its declared
size on `input_ids` (a symbol, or 1 for a batch-1 export), which says whether one step may run
several sequences.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from aviatorc.ir import Graph, Value

_PAST = (re.compile(r"past_key_values\.(\d+)\.(key|value)\Z"), re.compile(r"past_(key|value)_(\d+)\Z"))


def _present_names(layer: int, kind: str) -> tuple[str, ...]:
    return (f"present.{layer}.{kind}", f"present_{kind}_{layer}", f"present_key_values.{layer}.{kind}")


@dataclass(frozen=True)
class CachePair:
    layer: int
    kind: str  # "key" or "value"
    past: str  # graph input
    present: str  # graph output
    axis: int  # the sequence axis


@dataclass(frozen=True)
class CacheLayout:
    """How to drive a decoder graph step by step."""

    ids: str  # the token input
    logits: str  # the output read for the next token
    pairs: tuple[CachePair, ...]
    attention_mask: str | None
    position_ids: str | None
    past_shapes: dict[str, tuple[int | str | None, ...]]  # input -> its declared shape
    batch: int | str | None = 1  # input_ids' declared axis 0: a symbol when any batch runs

    @property
    def past_inputs(self) -> set[str]:
        return {p.past for p in self.pairs}

    def runs_batch(self, size: int) -> bool:
        """Whether one step of the graph takes `size` sequences at once."""
        return isinstance(self.batch, str) or self.batch == size


def find_cache(graph: Graph) -> CacheLayout | None:
    """The graph's cache layout, or None if it has no recognizable past/present pairs."""
    inputs = {v.name: v for v in graph.inputs}
    outputs = {v.name: v for v in graph.outputs}
    pairs: list[CachePair] = []
    for name, value in inputs.items():
        match = next((m for m in (p.match(name) for p in _PAST) if m), None)
        if match is None:
            continue
        a, b = match.groups()
        layer, kind = (int(a), b) if a.isdigit() else (int(b), a)
        present = next((outputs[n] for n in _present_names(layer, kind) if n in outputs), None)
        axis = _sequence_axis(value, present) if present is not None else None
        if present is not None and axis is not None:
            pairs.append(CachePair(layer, kind, name, present.name, axis))
    if not pairs or "input_ids" not in inputs:
        return None
    logits = "logits" if "logits" in outputs else next(
        v.name for v in graph.outputs if v.name not in {p.present for p in pairs})
    return CacheLayout("input_ids", logits, tuple(sorted(pairs, key=lambda p: (p.layer, p.kind))),
                       "attention_mask" if "attention_mask" in inputs else None,
                       "position_ids" if "position_ids" in inputs else None,
                       {p.past: inputs[p.past].type.shape for p in pairs},
                       _batch_dim(inputs["input_ids"]))


def _batch_dim(ids: Value) -> int | str | None:
    return ids.type.shape[0] if ids.type.rank >= 1 else None


def _sequence_axis(past: Value, present: Value) -> int | None:
    """The one axis where the shapes differ, symbolic in the past (it grows by the new tokens)."""
    a, b = past.type.shape, present.type.shape
    differing = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    if len(a) == len(b) and len(differing) == 1 and isinstance(a[differing[0]], str):
        return differing[0]
    return None


def static_reason(graph: Graph) -> str:
    """Why `graph` cannot generate (for the error message)."""
    ids = next((v for v in graph.inputs if v.name == "input_ids"), None)
    if ids is None:
        return "the graph has no input_ids input"
    if not any("logits" in v.name for v in graph.outputs):
        outputs = ", ".join(f"'{v.name}'" for v in graph.outputs)
        return (f"it is an encoder (its output{'s are' if len(graph.outputs) > 1 else ' is'} {outputs}, not "
                "next-token logits): an encoder such as BERT reads a whole input at once and predicts no next "
                "token, so it cannot generate; run() computes its outputs")
    if ids.type.rank >= 2 and isinstance(ids.type.shape[1], int):
        return (f"it was exported with a static sequence length ({ids.type.shape[1]}): the length is baked into "
                "its positions and causal mask, and it has no KV cache inputs")
    return "it has no KV cache inputs (past_key_values.N.key / present.N.key, or past_key_N / present_key_N)"
