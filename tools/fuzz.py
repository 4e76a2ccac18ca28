"""Fuzz the importers through the command line: broken inputs must give a working compile or
one `aviatorc: error: ...` line with exit 1, never a traceback, a hang, unbounded memory or
output left behind.

    python tools/fuzz.py --budget 2000                  # the campaign in BENCHMARKS.md
    python tools/fuzz.py --budget 40 --seed 3 --keep /tmp/fuzz-failures
    python tools/fuzz.py --atheris 20000                # coverage-guided, in process (atheris)

Seeds: the zoo's tiny Llama, GPT-2 and BERT exported to ONNX (weights inline), a small model
of the attribute-bearing ops (Gather, LayerNormalization, Transpose, Softmax, Split, Concat,
Flatten, Gemm, Cast, Constant, ReduceMean, Unsqueeze, Reshape), and the zoo's configs as
config.json. Each mutant is one structured mutation of the protobuf or the JSON, or a
byte-level one, drawn from `random.Random(f"{seed}:{index}")`, so a mutant can be rebuilt
from its index alone. Kinds are dealt round-robin, so their counts are even.

Each mutant runs through `aviatorc compile --target mock` (and every other one also
through `aviatorc inspect`) in a child process with a timeout and an address-space cap, at
most `--jobs` at a time. Outcomes: ok, refused (exit 1 with one error line), internal
(exit 3: a bug reported as one line), traceback, hang (past the timeout), killed (a
signal); flags: accepted-invalid (a mutant that breaks the ONNX spec or the config rules by
construction compiled anyway), left-output (a failed compile left files), noisy (a refusal
printed more than its one line). Results go to `tools/results/fuzz.md` and `fuzz.json`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "tools" / "results"
ONNX_SHARE = 0.62  # of the budget; the rest are config.json mutants
OUTCOMES = ("ok", "refused", "internal", "traceback", "hang", "killed")
FLAGS = ("accepted-invalid", "left-output", "noisy")
WORST = {name: rank for rank, name in enumerate(OUTCOMES)}


@dataclass
class Mutant:
    index: int
    family: str  # "onnx" or "config"
    kind: str
    seed_name: str
    detail: str
    data: bytes
    expect_refusal: bool  # invalid by construction: compiling it is a finding
    extra_files: dict[str, bytes] = field(default_factory=dict)


@dataclass
class Run:
    door: str
    outcome: str
    returncode: int
    seconds: float
    max_rss_mb: float
    stderr_tail: str
    flags: list[str]


# -- seeds ----------------------------------------------------------------------------------


def attribute_model() -> Any:
    """x[2, 8], ids[2, 3] -> a chain through every attribute-bearing op the zoo lacks."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)

    def init(name: str, array: Any) -> Any:
        return numpy_helper.from_array(np.asarray(array), name)

    nodes = [
        helper.make_node("Gather", ["emb", "ids"], ["g"], name="gather", axis=0),
        helper.make_node("LayerNormalization", ["g", "scale", "bias"], ["ln"], name="ln", axis=-1, epsilon=1e-5),
        helper.make_node("Transpose", ["ln"], ["t"], name="transpose", perm=[0, 2, 1]),
        helper.make_node("Softmax", ["t"], ["s"], name="softmax", axis=-1),
        helper.make_node("Split", ["s"], ["s1", "s2"], name="split", axis=1, num_outputs=2),
        helper.make_node("Concat", ["s2", "s1"], ["c"], name="concat", axis=1),
        helper.make_node("Flatten", ["c"], ["f"], name="flatten", axis=1),
        helper.make_node("Gemm", ["f", "w", "b"], ["gm"], name="gemm", alpha=0.5, beta=1.0),
        helper.make_node("Cast", ["gm"], ["ch"], name="cast16", to=TensorProto.FLOAT16),
        helper.make_node("Cast", ["ch"], ["cf"], name="cast32", to=TensorProto.FLOAT),
        helper.make_node("Constant", [], ["k"], name="two", value_float=2.0),
        helper.make_node("Mul", ["cf", "k"], ["m"], name="mul"),
        helper.make_node("Add", ["m", "x"], ["a"], name="add"),
        helper.make_node("ReduceMean", ["a", "axes1"], ["r"], name="mean", keepdims=1),
        helper.make_node("Sub", ["a", "r"], ["y"], name="sub"),
        helper.make_node("Unsqueeze", ["y", "axes0"], ["u"], name="unsqueeze"),
        helper.make_node("Reshape", ["u", "shape"], ["out"], name="reshape"),
    ]
    inits = [
        init("emb", rng.standard_normal((16, 8)).astype(np.float32)),
        init("scale", rng.standard_normal(8).astype(np.float32)),
        init("bias", rng.standard_normal(8).astype(np.float32)),
        init("w", rng.standard_normal((24, 8)).astype(np.float32)),
        init("b", rng.standard_normal(8).astype(np.float32)),
        init("axes1", np.array([1], np.int64)),
        init("axes0", np.array([0], np.int64)),
        init("shape", np.array([2, 8], np.int64)),
    ]
    graph = helper.make_graph(
        nodes, "attrs",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8]),
         helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 3])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 8])], inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def onnx_seeds(cache: Path, zoo_archs: tuple[str, ...]) -> dict[str, bytes]:
    """The seed models as serialized bytes, weights inline (exports cached under `cache`)."""
    import onnx

    seeds = {"attrs": attribute_model().SerializeToString()}
    for arch in zoo_archs:
        path = cache / f"{arch}.onnx"
        if not path.exists():
            from aviatorc import zoo

            zoo.export_onnx(arch, path)
        seeds[arch] = onnx.load(str(path)).SerializeToString()  # external data read back inline
    return seeds


def config_seeds(zoo_archs: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """The zoo's configs as a config.json would hold them (architectures included)."""
    from aviatorc import zoo

    classes = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen2": "Qwen2ForCausalLM", "phi3": "Phi3ForCausalLM", "opt": "OPTForCausalLM", "bert": "BertModel"}
    seeds = {}
    for arch in zoo_archs:
        config = zoo._config(arch).to_diff_dict()
        config["architectures"] = [classes[arch]]
        config.pop("transformers_version", None)
        seeds[arch] = json.loads(json.dumps(config))
    return seeds


# -- ONNX mutations ---------------------------------------------------------------------------

INT_EXTREMES = [0, -1, 1, 2, 7, -(1 << 40), 1 << 40, 1 << 62, -(1 << 63)]
FLOAT_EXTREMES = [0.0, -1.0, 1e30, -1e-30, float("nan"), float("inf"), float("-inf")]
HOSTILE_LOCATIONS = ["../secret.bin", "/etc/passwd", "a" * 300 + ".bin", "d/" + "b" * 256, "w\x00.bin",
                     "w\x1b[31m.bin", "", ".", "nested/../../x.bin", "C:\\w.bin", "\\\\server\\w.bin",
                     "missing.bin", "x" * 5000]


def _copy(model: Any) -> Any:
    import onnx

    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def _wrong_typed(rng: random.Random, name: str, current: int) -> Any:
    """An attribute `name` of a type other than `current` (an AttributeProto type enum)."""
    from onnx import helper

    pool = {1: [0.5, 1.5, -2.5], 2: [0, 3, 1 << 40], 3: ["minus one", "tiny"], 6: [[1.0, 2.0]], 7: [[1, 10], [2], []],
            8: [["a", "b"]]}
    choices = [t for t in pool if t != current]
    value = rng.choice(pool[rng.choice(choices)])
    return helper.make_attribute(name, value) if value != [] else helper.make_attribute(name, [], attr_type=7)


def mutate_onnx(kind: str, rng: random.Random, seed: Any) -> tuple[Any, str, bool, dict[str, bytes]]:
    """Apply one structured mutation; returns (model, detail, invalid by construction, extra files)."""
    from onnx import AttributeProto, TensorProto, helper

    model = _copy(seed)
    graph = model.graph
    nodes = list(graph.node)
    node = rng.choice(nodes)
    with_attrs = [n for n in nodes if n.attribute]
    if kind == "attr-wrong-type":
        target = rng.choice(with_attrs)
        index = rng.randrange(len(target.attribute))
        old = target.attribute[index]
        new = _wrong_typed(rng, old.name, old.type)
        del target.attribute[index]
        target.attribute.append(new)
        return model, f"{target.name}.{old.name} -> {AttributeProto.AttributeType.Name(new.type)}", True, {}
    if kind == "attr-undefined":
        target = rng.choice(with_attrs)
        attr = rng.choice(list(target.attribute))
        attr.type = AttributeProto.UNDEFINED
        return model, f"{target.name}.{attr.name} UNDEFINED", True, {}
    if kind == "attr-extreme":
        target = rng.choice(with_attrs)
        attr = rng.choice(list(target.attribute))
        if attr.type == AttributeProto.INT:
            attr.i = rng.choice(INT_EXTREMES)
            value: Any = attr.i
        elif attr.type == AttributeProto.FLOAT:
            attr.f = rng.choice(FLOAT_EXTREMES)
            value = attr.f
        elif attr.type == AttributeProto.INTS:
            del attr.ints[:]
            attr.ints.extend(rng.choice(INT_EXTREMES) for _ in range(rng.randrange(0, 4)))
            value = list(attr.ints)
        else:
            attr.s = rng.choice([b"", b"reflect", b"\xff\xfe", b"x" * 1000])
            value = attr.s[:20]
        return model, f"{target.name}.{attr.name} = {value!r}", False, {}
    if kind == "attr-unknown-or-twice":
        if rng.random() < 0.5 and with_attrs:
            target = rng.choice(with_attrs)
            target.attribute.append(target.attribute[0])
            return model, f"{target.name}.{target.attribute[0].name} twice", True, {}
        node.attribute.append(helper.make_attribute(rng.choice(["colour", "axis_", "__class__", "\x00"]), 1))
        return model, f"{node.name}: unknown attribute", True, {}
    if kind == "attr-drop":
        target = rng.choice(with_attrs)
        name = target.attribute[0].name
        del target.attribute[0]
        return model, f"{target.name} without {name}", False, {}
    if kind == "inputs":
        choice = rng.choice(["drop", "add", "undefined", "swap", "empty"])
        if choice == "drop" and node.input:
            del node.input[rng.randrange(len(node.input))]
        elif choice == "add":
            node.input.append(rng.choice([i.name for i in graph.input] + [t.name for t in graph.initializer]))
        elif choice == "undefined" and node.input:
            node.input[rng.randrange(len(node.input))] = "nowhere"
            return model, f"{node.name}: input undefined", True, {}
        elif choice == "swap" and len(node.input) > 1:
            node.input[0], node.input[1] = node.input[1], node.input[0]
        elif node.input:
            node.input[rng.randrange(len(node.input))] = ""
        return model, f"{node.name}: inputs {choice}", False, {}
    if kind == "op-swap":
        from aviatorc.frontends.onnx import supported_op

        ops = sorted(n for n in ("Add", "MatMul", "Softmax", "Gather", "Split", "Transpose", "Reshape", "Concat",
                                 "LayerNormalization", "Cast", "Gemm", "Relu", "Where", "Expand", "Slice") if
                     supported_op(n))
        old = node.op_type
        node.op_type = rng.choice(ops)
        return model, f"{node.name}: {old} -> {node.op_type}", False, {}
    if kind == "opset":
        version = rng.choice([0, -1, 1, 7, 11, 13, 999, 10**6])
        for entry in model.opset_import:
            if entry.domain in ("", "ai.onnx"):
                entry.version = version
        return model, f"opset {version}", version in (0, -1, 999, 10**6), {}
    if kind == "graph-io":
        choice = rng.choice(["input-twice", "init-as-input", "output-undefined", "input-dims", "input-dtype"])
        if choice == "input-twice":
            graph.input.append(graph.input[0])
            return model, "graph input listed twice", True, {}
        if choice == "init-as-input" and graph.initializer:
            tensor = rng.choice([t for t in graph.initializer if len(t.dims)] or list(graph.initializer))
            dims = [d + 1 for d in tensor.dims] or [3]
            graph.input.append(helper.make_tensor_value_info(tensor.name, tensor.data_type, dims))
            return model, f"initializer '{tensor.name}' declared as input {dims}", True, {}
        if choice == "output-undefined":
            graph.output[0].name = "nowhere"
            return model, "graph output undefined", True, {}
        info = rng.choice(list(graph.input))
        if choice == "input-dims" and info.type.tensor_type.shape.dim:
            dim = rng.choice(list(info.type.tensor_type.shape.dim))
            dim.dim_value = rng.choice([0, 1, 3, 1 << 40, (1 << 63) - 1])
            return model, f"input '{info.name}' dim {dim.dim_value}", False, {}
        info.type.tensor_type.elem_type = rng.choice([0, 8, 14, 10, 7, 1, 99])
        return model, f"input '{info.name}' elem_type {info.type.tensor_type.elem_type}", False, {}
    if kind == "initializer":
        tensor = rng.choice(list(graph.initializer))
        choice = rng.choice(["dtype", "dims", "raw-length", "huge-dims"])
        if choice == "dtype":
            tensor.data_type = rng.choice([0, 2, 7, 8, 10, 11, 16, 99])
        elif choice == "dims" and tensor.dims:
            tensor.dims[rng.randrange(len(tensor.dims))] += rng.choice([-1, 1, 7])
        elif choice == "raw-length" and tensor.raw_data:
            tensor.raw_data = tensor.raw_data[: len(tensor.raw_data) // 2]
        else:
            del tensor.dims[:]
            tensor.dims.extend([1 << 31, 1 << 31])
        return model, f"initializer '{tensor.name}' {choice}", False, {}
    if kind == "constant-split":
        constants = [n for n in nodes if n.op_type == "Constant"]
        splits = [n for n in nodes if n.op_type == "Split"]
        if constants and (not splits or rng.random() < 0.5):
            target = rng.choice(constants)
            extra = [a for a in ("value_int", "value_float", "value_ints") if a not in [x.name for x in target.attribute]]
            target.attribute.append(helper.make_attribute(extra[0], 3 if extra[0] == "value_int" else
                                                          (1.5 if extra[0] == "value_float" else [1, 2])))
            return model, f"Constant '{target.name}' with two values", True, {}
        if splits:
            target = rng.choice(splits)
            choice = rng.choice(["num_outputs", "fewer-outputs", "more-outputs"])
            if choice == "num_outputs":
                for attr in target.attribute:
                    if attr.name == "num_outputs":
                        attr.i = rng.choice([n for n in (1, 3, 5, 1 << 40) if n != len(target.output)])
                if not any(attr.name == "num_outputs" for attr in target.attribute):
                    target.output.append("extra_split_out")  # sizes given as an input: one output too many
            elif choice == "fewer-outputs" and len(target.output) > 1:
                del target.output[-1]
            else:
                target.output.append("extra_split_out")
            return model, f"Split '{target.name}' {choice}", True, {}
        return mutate_onnx("graph-io", rng, seed)
    if kind == "nodes":
        choice = rng.choice(["delete", "duplicate", "cycle"])
        index = rng.randrange(len(nodes))
        if choice == "delete":
            del graph.node[index]
            return model, f"node {index} deleted", False, {}
        if choice == "duplicate":
            graph.node.append(graph.node[index])
            return model, f"node {index} duplicated", bool(graph.node[index].output), {}
        later = graph.node[rng.randrange(index, len(nodes))]
        if graph.node[index].input and later.output:
            graph.node[index].input[0] = later.output[0]
        return model, f"node {index} reads a later output", False, {}
    if kind == "external-data":
        tensor = rng.choice([t for t in graph.initializer if t.raw_data] or list(graph.initializer))
        location = rng.choice(HOSTILE_LOCATIONS)
        payload = tensor.raw_data
        tensor.ClearField("raw_data")
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in {"location": location, "offset": str(rng.choice([0, 0, -4, 1 << 40])),
                           "length": str(len(payload))}.items():
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        # Every location in the list is refused: outside the folder, not a file name, or absent.
        return model, f"'{tensor.name}' at {location[:40]!r}", True, {}
    raise ValueError(f"unknown ONNX mutation kind {kind!r}")


ONNX_STRUCTURED = ("attr-wrong-type", "attr-undefined", "attr-extreme", "attr-unknown-or-twice", "attr-drop",
                   "inputs", "op-swap", "opset", "graph-io", "initializer", "constant-split", "nodes",
                   "external-data")
BYTE_KINDS = ("byte-flip", "truncate", "splice")


def mutate_bytes(kind: str, rng: random.Random, data: bytes) -> tuple[bytes, str]:
    buf = bytearray(data)
    if kind == "byte-flip":
        count = rng.choice([1, 2, 4, 16])
        for _ in range(count):
            buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
        return bytes(buf), f"{count} bit(s) flipped"
    if kind == "truncate":
        cut = rng.randrange(len(buf))
        return bytes(buf[:cut]), f"cut at {cut} of {len(buf)}"
    start = rng.randrange(len(buf))
    length = rng.randrange(1, 64)
    at = rng.randrange(len(buf))
    return bytes(buf[:at] + buf[start:start + length] + buf[at:]), f"{length} bytes spliced at {at}"


# -- config.json mutations --------------------------------------------------------------------

HOSTILE_VALUES: list[Any] = ["64", "", 0, -1, 1.5, True, None, [], {}, [64], 10**4, 10**9, 10**18, 2**63, 1e308, -0.0]
SHAPE_KEYS = ("hidden_size", "n_embd", "num_hidden_layers", "n_layer", "num_attention_heads", "n_head",
              "num_key_value_heads", "intermediate_size", "n_inner", "ffn_dim", "vocab_size",
              "max_position_embeddings", "n_positions", "head_dim", "rope_theta", "rms_norm_eps",
              "layer_norm_epsilon", "tie_word_embeddings", "hidden_act", "type_vocab_size", "torch_dtype")
FIELD_NAMES = ["__class__", "__dict__", "to_dict", "use_return_dict", "num_labels", "", "a-b", "x" * 300,
               "_name_or_path", "save_pretrained", "id2label", "\u00e9t\u00e9"]
CONFIG_KINDS = ("field-value", "field-drop", "field-add", "divisibility", "architectures", "model-type", "rope",
                "depth", "json-structure", "config-bytes")


def mutate_config(kind: str, rng: random.Random, seed: dict[str, Any]) -> tuple[bytes, str, bool]:
    config = json.loads(json.dumps(seed))
    present = [k for k in SHAPE_KEYS if k in config]

    def dump() -> bytes:
        return json.dumps(config, indent=2).encode()

    if kind == "field-value":
        key = rng.choice(present or list(config))
        config[key] = rng.choice(HOSTILE_VALUES)
        return dump(), f"{key} = {json.dumps(config[key])[:30]}", False
    if kind == "field-drop":
        key = rng.choice(list(config))
        del config[key]
        return dump(), f"without {key}", False
    if kind == "field-add":
        key = rng.choice(FIELD_NAMES)
        config[key] = rng.choice(HOSTILE_VALUES)
        # Refused: dunders, names that are not identifiers, and methods of the config class.
        return dump(), f"field {key[:30]!r}", key.startswith("__") or key in ("to_dict", "save_pretrained", "", "a-b")
    if kind == "divisibility":
        heads_key = "n_head" if "n_head" in config else "num_attention_heads"
        if "num_key_value_heads" in config and rng.random() < 0.5:
            config["num_key_value_heads"] = 3
            return dump(), "kv heads 3 of 4", True
        config[heads_key] = rng.choice([3, 5, 7])
        return dump(), f"{heads_key} {config[heads_key]} of hidden 32", True
    if kind == "architectures":
        value = rng.choice([["AutoTokenizer"], ["pipeline"], ["BertForSequenceClassification"], ["os"],
                            ["__import__"], "LlamaForCausalLM", [1], ["AutoModel"], [], None, ["GPT2LMHeadModel"]])
        config["architectures"] = value
        valid = value in ([], None) or (value == ["GPT2LMHeadModel"] and config.get("model_type") == "gpt2")
        return dump(), f"architectures {json.dumps(value)}", not valid
    if kind == "model-type":
        value = rng.choice([["llama"], "lama", "", None, 7, "bert", "gpt2", "llama", "t5", "clip"])
        config["model_type"] = value
        return dump(), f"model_type {json.dumps(value)}", value in (["llama"], "lama", "", None, 7)
    if kind == "rope":
        choice = rng.choice(["type", "factor", "theta", "not-object"])
        if choice == "type":
            config["rope_scaling"] = {"rope_type": rng.choice(["warp", "", 3]), "factor": 2.0}
        elif choice == "factor":
            config["rope_scaling"] = {"rope_type": "linear", "factor": rng.choice(["2", -1, 0, None])}
        elif choice == "theta":
            config["rope_theta"] = rng.choice(["ten thousand", -1, 0, None])
        else:
            config["rope_scaling"] = rng.choice([[1, 2], "linear", 5])
        return dump(), f"rope {choice}", True
    if kind == "depth":
        key = "n_layer" if "n_layer" in config else "num_hidden_layers"
        config[key] = rng.choice([10**4, 10**9, -1, 0, 300])
        return dump(), f"{key} {config[key]}", True
    if kind == "json-structure":
        choice = rng.choice(["deep", "big-int", "utf8", "nan", "infinity", "duplicate", "array", "empty", "bom",
                             "trailing", "huge"])
        text = dump()
        data = {
            "deep": b'{"model_type": "llama", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            "big-int": text.replace(b"{", b'{"vocab_size": ' + b"7" * 5001 + b",", 1),
            "utf8": text.replace(b'"model_type"', b'"model\xff_type"', 1),
            "nan": text.replace(b"{", b'{"rope_theta": NaN,', 1),
            "infinity": text.replace(b"{", b'{"rope_theta": -Infinity,', 1),
            "duplicate": text.replace(b"{", b'{"model_type": "bert",', 1),
            "array": b"[" + text + b"]",
            "empty": b"",
            "bom": b"\xef\xbb\xbf" + text,
            "trailing": text + b"}",
            "huge": text[:-1] + b', "pad": "' + b"x" * (3 << 20) + b'"}',
        }[choice]
        return data, f"json {choice}", True
    data, detail = mutate_bytes(rng.choice(BYTE_KINDS), rng, dump())
    return data, detail, False


# -- the mutant list ----------------------------------------------------------------------------


def make_mutant(index: int, seed: int, budget: int, onnx_seeds_: dict[str, bytes],
                config_seeds_: dict[str, dict[str, Any]], n_onnx: int | None = None) -> Mutant:
    """Mutant `index` of a campaign: the same (seed, budget, index) gives the same bytes.

    `n_onnx` (default: ONNX_SHARE of the budget) of them are ONNX mutants, spread evenly
    among the config ones, so a campaign stopped early still has both families."""
    import onnx

    rng = random.Random(f"{seed}:{index}")
    n_onnx = round(budget * ONNX_SHARE) if n_onnx is None else n_onnx
    onnx_before = (index * n_onnx) // budget  # ONNX mutants among indices [0, index)
    if ((index + 1) * n_onnx) // budget > onnx_before:
        kinds = ONNX_STRUCTURED + BYTE_KINDS
        kind = kinds[onnx_before % len(kinds)]
        seed_name = rng.choice(sorted(onnx_seeds_))
        if kind in BYTE_KINDS:
            data, detail = mutate_bytes(kind, rng, onnx_seeds_[seed_name])
            return Mutant(index, "onnx", kind, seed_name, detail, data, False)
        model = onnx.load_from_string(onnx_seeds_[seed_name])
        mutated, detail, invalid, extra = mutate_onnx(kind, rng, model)
        return Mutant(index, "onnx", kind, seed_name, detail, mutated.SerializeToString(), invalid, extra)
    kind = CONFIG_KINDS[(index - onnx_before) % len(CONFIG_KINDS)]
    seed_name = rng.choice(sorted(config_seeds_))
    data, detail, invalid = mutate_config(kind, rng, config_seeds_[seed_name])
    return Mutant(index, "config", kind, seed_name, detail, data, invalid)


# -- running ------------------------------------------------------------------------------------


def child_env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                PYTHONPATH=str(ROOT), TRANSFORMERS_VERBOSITY="error")


def run_cli(args: list[str], cwd: Path, door: str, *, timeout_s: float, mem_bytes: int) -> dict[str, Any]:
    """Run one command in a child process (timeout, address-space cap); classify what happened:
    the fields of `Run`, as a dict."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))

    with tempfile.TemporaryFile() as err_file:
        start = time.perf_counter()
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=err_file, cwd=cwd, env=child_env(),
                                preexec_fn=limit, start_new_session=True)
        timed_out = threading.Event()

        def expire() -> None:
            timed_out.set()
            os.killpg(proc.pid, signal.SIGKILL)

        timer = threading.Timer(timeout_s, expire)
        timer.start()
        _, status, usage = os.wait4(proc.pid, 0)  # wait4: this child's own peak memory
        timer.cancel()
        proc.returncode = code = os.waitstatus_to_exitcode(status)
        seconds = time.perf_counter() - start
        err_file.seek(0)
        stderr = err_file.read().decode("utf-8", "replace")
    lines = [line for line in stderr.splitlines() if line.strip()]
    flags = []
    if timed_out.is_set():
        outcome = "hang"
    elif "Traceback (most recent call last)" in stderr:
        outcome = "traceback"
    elif code == 0:
        outcome = "ok"
    elif code == 1 and lines and lines[-1].startswith("aviatorc: error: "):
        outcome = "refused"
        if len(lines) > 1:
            flags.append("noisy")
    elif code == 3:
        outcome = "internal"
    elif code < 0:
        outcome = "killed"
    else:
        outcome = "traceback"
    tail = " | ".join(lines[-3:])[-400:]
    return asdict(Run(door, outcome, code, round(seconds, 2), round(usage.ru_maxrss / 1024, 1), tail, flags))


def run_door(door: str, mutant: Mutant, folder: Path, *, timeout_s: float, mem_bytes: int) -> Run:
    """Run one CLI command on the mutant's file in a child process; classify what happened."""
    name = "model.onnx" if mutant.family == "onnx" else "config.json"
    model = folder / name
    out = folder / "out.avc"
    args = [sys.executable, "-m", "aviatorc", door, str(model)]
    if door == "compile":
        args += ["-o", str(out), "--target", "mock", "-q", "--time-limit", "5"]
    before = {p.name for p in folder.iterdir()}
    run = Run(**run_cli(args, folder, door, timeout_s=timeout_s, mem_bytes=mem_bytes))
    if run.outcome == "ok" and mutant.expect_refusal:
        run.flags.append("accepted-invalid")
    after = {p.name for p in folder.iterdir()}
    if run.outcome != "ok" and after - before:
        run.flags.append("left-output")
    if out.exists():
        shutil.rmtree(out, ignore_errors=True)
    return run


def run_mutant(mutant: Mutant, work: Path, *, timeout_s: float, mem_bytes: int, keep: Path | None,
               inspect_every: int = 2) -> dict[str, Any]:
    folder = work / f"m{mutant.index:05d}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ("model.onnx" if mutant.family == "onnx" else "config.json")).write_bytes(mutant.data)
    for rel, data in mutant.extra_files.items():
        (folder / rel).write_bytes(data)
    doors = ["compile"] + (["inspect"] if inspect_every and mutant.index % inspect_every == 0 else [])
    runs = [run_door(door, mutant, folder, timeout_s=timeout_s, mem_bytes=mem_bytes) for door in doors]
    worst = max(runs, key=lambda r: WORST[r.outcome])
    flags = sorted({f for r in runs for f in r.flags})
    bad = worst.outcome not in ("ok", "refused") or set(flags) & {"accepted-invalid", "left-output"}
    if bad and keep is not None:
        shutil.copytree(folder, keep / folder.name, dirs_exist_ok=True)
    shutil.rmtree(folder, ignore_errors=True)
    record = {k: v for k, v in asdict(mutant).items() if k not in ("data", "extra_files")}
    return record | {"outcome": worst.outcome, "flags": flags, "runs": [asdict(r) for r in runs]}


def campaign(budget: int, seed: int, *, jobs: int = 2, timeout_s: float = 60.0, mem_gb: float = 4.0,
             zoo_archs: tuple[str, ...] = ("llama", "gpt2", "bert"), config_archs: tuple[str, ...] | None = None,
             keep: Path | None = None, cache: Path | None = None, inspect_every: int = 2,
             n_onnx: int | None = None,
             progress: Callable[[list[dict[str, Any]]], None] | None = None) -> dict[str, Any]:
    """Build and run `budget` mutants; returns the JSON-ready results."""
    cache = cache or Path(tempfile.gettempdir()) / "aviatorc-fuzz-seeds"
    cache.mkdir(parents=True, exist_ok=True)
    seeds_onnx = onnx_seeds(cache, zoo_archs)
    seeds_config = config_seeds(config_archs or ("llama", "gpt2", "bert", "qwen2", "opt"))
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="aviatorc-fuzz-") as tmp:
        work = Path(tmp)
        mutants = (make_mutant(i, seed, budget, seeds_onnx, seeds_config, n_onnx) for i in range(budget))
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            pending = set()
            for mutant in mutants:  # a bounded queue: mutants are built as slots free up
                pending.add(pool.submit(run_mutant, mutant, work, timeout_s=timeout_s,
                                        mem_bytes=int(mem_gb * (1 << 30)), keep=keep,
                                        inspect_every=inspect_every))
                if len(pending) >= 2 * jobs:
                    done, pending = concurrent.futures.wait(pending, return_when="FIRST_COMPLETED")
                    for future in done:
                        records.append(future.result())
                        if progress:
                            progress(records)
            for future in concurrent.futures.as_completed(pending):
                records.append(future.result())
                if progress:
                    progress(records)
    records.sort(key=lambda r: r["index"])
    return summarize(records, budget=budget, seed=seed, seconds=time.perf_counter() - start, jobs=jobs,
                     timeout_s=timeout_s, mem_gb=mem_gb, seeds=sorted(seeds_onnx) + sorted(f"{k}.json" for k in
                                                                                          seeds_config))


def summarize(records: list[dict[str, Any]], **meta: Any) -> dict[str, Any]:
    by_kind: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    slowest: dict[tuple[str, str], float] = defaultdict(float)
    peak: dict[tuple[str, str], float] = defaultdict(float)
    for record in records:
        key = (record["family"], record["kind"])
        by_kind[key]["mutants"] += 1
        by_kind[key][record["outcome"]] += 1
        for flag in record["flags"]:
            by_kind[key][flag] += 1
        for run in record["runs"]:
            slowest[key] = max(slowest[key], run["seconds"])
            peak[key] = max(peak[key], run["max_rss_mb"])
    rows = [{"family": f, "kind": k, **{c: by_kind[(f, k)][c] for c in ("mutants", *OUTCOMES, *FLAGS)},
             "max_seconds": slowest[(f, k)], "max_rss_mb": peak[(f, k)]} for f, k in sorted(by_kind)]
    findings = [r for r in records if r["outcome"] not in ("ok", "refused")
                or set(r["flags"]) & {"accepted-invalid", "left-output"}]
    totals = Counter()
    for row in rows:
        for column in ("mutants", *OUTCOMES, *FLAGS):
            totals[f"{row['family']}:{column}"] += row[column]
            totals[column] += row[column]
    return {"meta": meta | {"python": sys.version.split()[0]}, "totals": dict(sorted(totals.items())), "rows": rows,
            "findings": findings, "runs": sum(len(r["runs"]) for r in records)}


def render(results: dict[str, Any], command: str) -> str:
    meta, totals = results["meta"], results["totals"]
    lines = [
        "## Fuzzing the importers (`tools/fuzz.py`)",
        "",
        f"`{command}`: {totals.get('mutants', 0):,} mutants ({totals.get('onnx:mutants', 0):,} ONNX, "
        f"{totals.get('config:mutants', 0):,} config.json), {results['runs']:,} CLI runs "
        f"(`aviatorc compile --target mock`, and `aviatorc inspect` for every other mutant), "
        f"{meta['jobs']} at a time, {meta['timeout_s']:.0f} s timeout, {meta['mem_gb']:g} GiB address-space cap, "
        f"{meta['seconds'] / 60:.1f} min. Seeds: {', '.join(meta['seeds'])}.",
        "",
        f"**{totals.get('traceback', 0)} tracebacks, {totals.get('hang', 0)} hangs, "
        f"{totals.get('internal', 0)} internal errors, {totals.get('killed', 0)} killed, "
        f"{totals.get('left-output', 0)} refusals that left output, "
        f"{totals.get('accepted-invalid', 0)} invalid-by-construction mutants accepted.**",
        "",
        "| family | kind | mutants | ok | refused | internal | traceback | hang | killed | accepted-invalid "
        "| left-output | noisy | max s | max RSS MB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results["rows"]:
        lines.append(f"| {row['family']} | {row['kind']} | " + " | ".join(
            str(row[c]) for c in ("mutants", *OUTCOMES, *FLAGS)) + f" | {row['max_seconds']:.1f} | "
            f"{row['max_rss_mb']:.0f} |")
    lines += ["", "ok: compiled (and inspected); refused: exit 1 with one `aviatorc: error:` line; internal: exit 3, "
              "one `internal error, please report` line; accepted-invalid: the mutant breaks the ONNX spec or the "
              "config rules by construction, yet compiled; noisy: a refusal with other lines (library warnings) "
              "before it. Byte-level mutants and value mutations may stay valid, so `ok` is no finding there."]
    return "\n".join(lines + finding_lines(results["findings"], 20)) + "\n"


def finding_lines(findings: list[dict[str, Any]], limit: int) -> list[str]:
    """The first `limit` findings, one line each, with the worst probe's last words."""
    if not findings:
        return []
    lines = ["", f"Findings (first {limit}):", ""]
    for finding in findings[:limit]:
        run = max(finding["runs"], key=lambda r: WORST[r["outcome"]])
        lines.append(f"- #{finding['index']} {finding['family']}/{finding['kind']} on {finding['seed_name']} "
                     f"({finding['detail'][:60]}): {finding['outcome']} {finding['flags']} in {run['door']}: "
                     f"`{run['stderr_tail'][:200]}`")
    return lines


# -- atheris ----------------------------------------------------------------------------------


def atheris_main(runs: int, seeds: dict[str, bytes]) -> None:
    """Coverage-guided fuzzing of the ONNX import in process: any exception other than an
    AviatorError is a crash (atheris prints the input that caused it)."""
    import atheris  # optional: pip install atheris

    with atheris.instrument_imports():
        from aviatorc.errors import AviatorError
        from aviatorc.frontends.onnx import import_model_proto
        from aviatorc.frontends.onnx.loader import load_model_proto

    corpus = Path(tempfile.mkdtemp(prefix="aviatorc-atheris-"))
    for name, data in seeds.items():
        (corpus / name).write_bytes(data)
    folder = Path(tempfile.mkdtemp(prefix="aviatorc-atheris-run-"))

    def one_input(data: bytes) -> None:
        path = folder / "m.onnx"
        path.write_bytes(data)
        try:
            import_model_proto(load_model_proto(path), base_dir=folder)
        except AviatorError:
            pass

    atheris.Setup([sys.argv[0], f"-runs={runs}", "-timeout=60", "-rss_limit_mb=4096", str(corpus)], one_input)
    atheris.Fuzz()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=200, help="number of mutants")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per CLI run")
    parser.add_argument("--mem-gb", type=float, default=4.0, help="address-space cap per CLI run")
    parser.add_argument("--keep", type=Path, help="copy the folders of findings here")
    parser.add_argument("--out", type=Path, default=RESULTS / "fuzz", help="results stem (.md and .json)")
    parser.add_argument("--atheris", type=int, metavar="RUNS", help="coverage-guided in-process runs instead")
    parser.add_argument("--artifacts", action="store_true", help="fuzz the artifact loader instead "
                        "(tools/fuzz_artifacts.py): tampered plan.json, manifest, safetensors headers, target.toml")
    parser.add_argument("--serve-every", type=int, default=10, metavar="K",
                        help="with --artifacts: every K-th mutant also through `aviatorc serve`")
    args = parser.parse_args(argv)
    if args.artifacts:
        return artifacts_main(args)
    if args.atheris:
        atheris_main(args.atheris, onnx_seeds(Path(tempfile.gettempdir()) / "aviatorc-fuzz-seeds", ("llama",)))
        return 0
    command = "python tools/fuzz.py" + "".join(f" --{k} {v}" for k, v in (("budget", args.budget),
                                                                        ("seed", args.seed)))
    start = time.perf_counter()

    def progress(records: list[dict[str, Any]]) -> None:
        record = records[-1]
        if record["outcome"] not in ("ok", "refused") or set(record["flags"]) - {"noisy"} or len(records) % 50 == 0:
            print(f"[{len(records)}/{args.budget}] #{record['index']} {record['family']}/{record['kind']}: "
                  f"{record['outcome']} {record['flags']}", flush=True)
        if len(records) % 100 == 0:  # a partial table, in case the campaign is stopped
            partial = summarize(sorted(records, key=lambda r: r["index"]), budget=args.budget, seed=args.seed,
                                seconds=time.perf_counter() - start, jobs=args.jobs, timeout_s=args.timeout,
                                mem_gb=args.mem_gb, seeds=["(partial)"])
            args.out.with_suffix(".partial.md").write_text(render(partial, command + f"  [partial: {len(records)}]"))

    args.out.parent.mkdir(parents=True, exist_ok=True)
    results = campaign(args.budget, args.seed, jobs=args.jobs, timeout_s=args.timeout, mem_gb=args.mem_gb,
                       keep=args.keep, progress=progress)
    args.out.with_suffix(".partial.md").unlink(missing_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    text = render(results, command)
    args.out.with_suffix(".md").write_text(text)
    print(text)
    totals = results["totals"]
    return 1 if any(totals.get(k, 0) for k in ("traceback", "hang", "killed", "left-output")) else 0


def artifacts_module() -> Any:
    """tools/fuzz_artifacts.py, imported by path (tools/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("aviatorc_fuzz_artifacts", Path(__file__).with_name("fuzz_artifacts.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def artifacts_main(args: argparse.Namespace) -> int:
    artifacts = artifacts_module()
    command = f"python tools/fuzz.py --artifacts --budget {args.budget} --seed {args.seed}"
    out = args.out if args.out != RESULTS / "fuzz" else RESULTS / "fuzz_artifacts"

    def progress(records: list[dict[str, Any]]) -> None:
        record = records[-1]
        if record["outcome"] not in ("ok", "refused") or record["flags"] or len(records) % 50 == 0:
            print(f"[{len(records)}/{args.budget}] #{record['index']} {record['kind']}: {record['outcome']} "
                  f"{record['flags']} ({record['detail'][:60]})", flush=True)

    results = artifacts.campaign(sys.modules[__name__], args.budget, args.seed, jobs=args.jobs, timeout_s=args.timeout,
                                 mem_gb=args.mem_gb, serve_every=args.serve_every, keep=args.keep, progress=progress)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    text = artifacts.render(results, command, finding_lines)
    out.with_suffix(".md").write_text(text)
    print(text)
    totals = results["totals"]
    return 1 if any(totals.get(k, 0) for k in ("traceback", "hang", "killed", "internal")) else 0


if __name__ == "__main__":
    sys.exit(main())
