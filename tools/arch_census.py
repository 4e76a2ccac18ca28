"""Which of transformers' causal-LM model types aviatorc compiles, from each source a user has.

    python tools/arch_census.py                      # every type; writes docs/arch_census.md (hours)
    python tools/arch_census.py --types llama phi3   # a few
    python tools/arch_census.py --one llama          # one type in this process, JSON on stdout

For each model type in `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, a tiny config (hidden 64, 2 layers,
4 heads, 2 kv heads, vocab 128; list fields per layer cut to 2 layers; expert counts cut to 4)
and three sources, as a new user would try them:

- config.json: the tiny config written as a file, compiled shape-only for `corsair` at INT4
  (context 64, prompt 8: within its 128 positions);
- module: the `transformers` model built from it (random, seeded, perturbed weights, eager
  attention), compiled for `mock` at fp32; one decode step (3 new tokens after 4) against the
  eager module within 1e-4 (or, where fp32 rounding of large logits exceeds that, within twice
  the eager module's own error against its float64 copy), and up to 6 greedy tokens equal to the eager module's (both stop at
  its eos);
- ONNX: the module exported as a decoder-with-past (`aviatorc.zoo.export_step_onnx`, dynamo,
  opset 18), compiled for `mock`; the step against onnxruntime within 1e-4, and the 6 tokens.

Each source ends as ok, refused (an aviatorc error: its one line is the reason), wrong (it ran
but the numbers or tokens differ: a bug), internal (an exception that is not aviatorc's error:
a bug), or upstream (transformers, the exporter or onnxruntime failed first: nothing aviatorc
saw). Each type runs in its own child process with a timeout. The kind of a type comes from its
built modules: moe (experts), hybrid (layers that are not attention), multimodal (a composite
config), encoder (a bidirectional encoder family with an LM head), encoder-decoder (the decoder of
a seq2seq family), else dense. The goal: every dense decoder works from every source, every other
type is refused in one line.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TINY: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 128, "head_dim": 16, "max_position_embeddings": 128, "bos_token_id": 1, "eos_token_id": 2,
    "pad_token_id": 0,
    # other families' names for the same sizes
    "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128, "n_inner": 128, "d_model": 64, "ffn_dim": 128,
    "num_layers": 2, "n_ctx": 128, "decoder_layers": 2, "decoder_attention_heads": 4, "decoder_ffn_dim": 128,
    "encoder_layers": 2, "encoder_attention_heads": 4, "encoder_ffn_dim": 128, "n_heads": 4, "d_ff": 128,
    "word_embed_proj_dim": 64, "embedding_size": 64, "max_seq_len": 128, "seq_length": 128, "dff": 128,
    # mixtures of experts, kept small
    "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "n_group": 1, "topk_group": 1,
    # rotary, latent attention and other head sizes that must fit the head
    "rotary_dim": 8, "dim_head": 16, "dim_model": 64, "dim_ff": 128, "num_heads": 4, "kv_lora_rank": 32,
    "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "kv_channels": 16,
    "multi_query_group_num": 2, "num_kv_heads": 2, "n_kv_heads": 2,
    # the causal-LM heads of encoder families attend causally only as decoders
    "is_decoder": True,
}
SOURCES = ("config", "module", "onnx")
STATUSES = ("ok", "refused", "wrong", "internal", "upstream", "timeout")
ATOL = 1e-4
PROMPT = [5, 9, 17, 33, 8, 70]
NEW = 6
_MOE = re.compile(r"Expert|MoE|Moe|Router")


# -- one type -----------------------------------------------------------------------------------


def tiny_config(model_type: str) -> Any:
    """The tiny config of `model_type`: the class defaults with the sizes above where it has them."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    default = cls()
    known = set(default.to_dict()) | set(getattr(cls, "attribute_map", {}) or {})
    fields = {k: v for k, v in TINY.items() if k in known}
    if "kv_lora_rank" in fields:  # latent attention: rotary over the rope part, and as many K/V heads as queries
        fields.update({k: fields[v] for k, v in (("head_dim", "qk_rope_head_dim"),
                                                  ("num_key_value_heads", "num_attention_heads")) if k in fields})
    layers = getattr(default, "num_hidden_layers", None)
    for key, value in default.to_dict().items():  # per-layer lists follow the 2 layers
        if isinstance(value, list) and isinstance(layers, int) and len(value) == layers and layers != 2:
            fields[key] = value[:2]
    return cls(**fields), fields


def kind_of(model: Any, config: Any) -> str:
    from aviatorc.frontends.hf_config import _MIXERS

    names = [type(m).__name__ for m in model.modules()]
    if any(p.search(n) for n in names for p, _ in _MIXERS):
        return "hybrid"
    if any(_MOE.search(n) for n in names):
        return "moe"
    if getattr(config, "sub_configs", None) or hasattr(config, "text_config") or hasattr(config, "vision_config"):
        return "multimodal"
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder"
    if hasattr(config, "is_decoder") and not config.is_decoder and _masked_lm(config.model_type):
        return "encoder"
    return "dense"


def _masked_lm(model_type: str) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    return model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES


def one(model_type: str, sources: tuple[str, ...] = SOURCES) -> dict[str, Any]:
    """The census row of one model type (in this process)."""
    import torch

    row: dict[str, Any] = {"model_type": model_type, "kind": "?", "sources": {}}
    try:
        config, fields = tiny_config(model_type)
    except Exception as error:  # noqa: BLE001 - the census's own limit, reported
        row["kind"] = "?"
        row["sources"] = {s: _result("upstream", f"tiny config: {_line(error)}") for s in sources}
        return row
    with tempfile.TemporaryDirectory(prefix="aviatorc-census-") as tmp:
        work = Path(tmp)
        model, built = None, None
        try:
            model = _build(config)
            row["kind"] = kind_of(model, config)
            with torch.no_grad():  # the tiny config must run in transformers itself
                model(input_ids=torch.tensor([PROMPT]), use_cache=False)
        except Exception as error:  # noqa: BLE001
            built = f"transformers cannot run the tiny model: {_line(error)}"
        for source in sources:
            start = time.perf_counter()
            if source == "config":
                result = _from_config(model_type, fields, work)
            elif built is not None:
                result = _result("upstream", built)
            else:
                result = (_from_module if source == "module" else _from_onnx)(model, work)
            result["seconds"] = round(time.perf_counter() - start, 1)
            row["sources"][source] = result
    return _portable(row)


_WORK_DIR = re.compile(r"/\S*aviatorc-census-[A-Za-z0-9_]+/")


def _portable(row: dict[str, Any]) -> dict[str, Any]:
    """The row without the temporary folder's path in its lines (`config.json: ...`), so a rerun
    that changes nothing rewrites nothing."""
    for result in row["sources"].values():
        result["detail"] = _WORK_DIR.sub("", result["detail"])
    return row


def _result(status: str, detail: str = "") -> dict[str, Any]:
    return {"status": status, "detail": detail}


def _line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    text = f"{type(error).__name__}: {text}" if not _is_ours(error) else text
    return text if len(text) <= 300 else text[:297] + "..."


def _is_ours(error: BaseException) -> bool:
    from aviatorc.errors import AviatorError

    return isinstance(error, AviatorError)


def _build(config: Any) -> Any:
    import torch
    import transformers

    from aviatorc import zoo

    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    zoo.perturb(model, 0)
    return model.eval()


def _compile(source: Any, **options: Any) -> tuple[Any, dict[str, Any] | None]:
    import aviatorc

    try:
        return aviatorc.compile(source, time_limit_s=2.0, **options), None
    except Exception as error:  # noqa: BLE001 - classified
        return None, _result("refused" if _is_ours(error) else "internal", _line(error))


def _from_config(model_type: str, fields: dict[str, Any], work: Path) -> dict[str, Any]:
    path = work / "config.json"
    path.write_text(json.dumps({"model_type": model_type, **fields}, default=str))
    result, failed = _compile(str(path), target="corsair", quant="int4", context=64, prompt=8)  # tiny configs: 128 positions
    return failed or _result("ok", f"{result.report.data['model']['parameters']:,} parameters")


def _step_feeds(model: Any) -> tuple[dict[str, Any], tuple[Any, ...]]:
    from aviatorc.frontends.torch.decoder import cache_names, example_step

    tensors = example_step(model, new=3, past=4, batch=1, seed=1)
    names = ["input_ids", "attention_mask", "position_ids", *cache_names(model.config.num_hidden_layers)[0]]
    return {n: t.numpy() for n, t in zip(names, tensors, strict=True)}, tensors


def _reference_tokens(model: Any) -> list[int] | str:
    """Greedy tokens from the eager model's own forward (the whole sequence each step, no cache),
    stopping at its eos: what `generate` gives without the generation config's logit processors
    (BART's forced eos at max_length, CTRL's repetition penalty) that a compiled graph leaves to
    the serving stack."""
    import torch

    ids = list(PROMPT)
    try:
        with torch.no_grad():
            for _ in range(NEW):
                ids.append(int(torch.argmax(model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1])))
                if ids[-1] in _eos(model):
                    break
    except Exception as error:  # noqa: BLE001
        return f"transformers' forward failed: {_line(error)}"
    return ids


def _check(session: Any, feeds: dict[str, Any], want_logits: Any, model: Any, against: str) -> dict[str, Any]:
    import numpy as np

    try:
        got = session.run(feeds)["logits"]
    except Exception as error:  # noqa: BLE001
        return _result("refused" if _is_ours(error) else "internal", f"run: {_line(error)}")
    diff = float(np.max(np.abs(got - want_logits)))
    step = f"step within {diff:.1e}"
    if not math.isfinite(diff) or diff > ATOL:
        exact = _float64_logits(model)
        wrong = _result("wrong", f"step logits differ from {against} by {diff:.3g} (> {ATOL:g})")
        if exact is None:
            return wrong
        ours, theirs = (float(np.max(np.abs(x - exact))) for x in (got, want_logits))
        if not ours <= max(ATOL, 2 * theirs):
            return wrong
        step = f"step within {ours:.1e} of float64 transformers ({against}: {theirs:.1e})"
    want = _reference_tokens(model)
    if isinstance(want, str):
        return _result("ok", f"{step}; {want}")
    try:
        tokens = session.generate(PROMPT, NEW, eos_token_id=_eos(model)).tolist()
    except Exception as error:  # noqa: BLE001
        return _result("refused" if _is_ours(error) else "internal", f"generate: {_line(error)}")
    if tokens != want:
        return _result("wrong", f"generated {tokens[len(PROMPT):]}, transformers {want[len(PROMPT):]}")
    return _result("ok", f"{step}; {NEW} tokens as transformers")


def _float64_logits(model: Any) -> Any:
    """The step's logits from a float64 copy of the eager model: the exact answer that both fp32
    results round away from (large logits lose more than 1e-4 to fp32 rounding), or None where the
    model does not run in float64."""
    import copy

    import torch

    from aviatorc.frontends.torch.decoder import decode_step_class

    _, tensors = _step_feeds(model)
    try:
        with torch.no_grad():
            step = decode_step_class()(copy.deepcopy(model).double()).eval()
            return step(*(t.double() if t.is_floating_point() else t for t in tensors))[0].numpy()
    except Exception:  # noqa: BLE001 - no exact reference: the fp32 comparison stands
        return None


def _eos(model: Any) -> list[int]:
    """The ids transformers' `generate` stops at."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def _from_module(model: Any, work: Path) -> dict[str, Any]:
    import torch

    import aviatorc
    from aviatorc.frontends.torch.decoder import decode_step_class

    result, failed = _compile(model, target="mock", context=64, prompt=8, batch=1)
    if failed:
        return failed
    feeds, tensors = _step_feeds(model)
    with torch.no_grad():
        want = decode_step_class()(model).eval()(*tensors)[0].numpy()
    return _check(aviatorc.Session(result), feeds, want, model, "eager transformers")


def _from_onnx(model: Any, work: Path) -> dict[str, Any]:
    import onnxruntime as ort

    import aviatorc
    from aviatorc import zoo

    path = work / "step.onnx"
    try:
        zoo.export_step_onnx(model, path)
    except Exception as error:  # noqa: BLE001 - torch.onnx's failure, not aviatorc's
        return _result("upstream", f"torch.onnx.export: {_line(error)}")
    feeds, _ = _step_feeds(model)
    try:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        want = dict(zip(names, session.run(None, feeds), strict=True))["logits"]
    except Exception as error:  # noqa: BLE001
        return _result("upstream", f"onnxruntime: {_line(error)}")
    result, failed = _compile(str(path), target="mock", context=64, prompt=8, batch=1)
    if failed:
        return failed
    return _check(aviatorc.Session(result), feeds, want, model, "onnxruntime")


# -- all types ----------------------------------------------------------------------------------


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


MEMORY_CAP = 12 << 30  # address space of one type's child: a family the tiny config does not shrink stops there


def _cap_memory() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))


def run_child(model_type: str, timeout_s: float) -> dict[str, Any]:
    """`--one TYPE` in a child process (a hang or crash there stays there; so does a model too large
    to build: the child's address space is capped, so it cannot take the machine's memory)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore")
    start = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, __file__, "--one", model_type], capture_output=True, text=True,
                             timeout=timeout_s, env=env, preexec_fn=_cap_memory)
    except subprocess.TimeoutExpired:
        return {"model_type": model_type, "kind": "?", "seconds": timeout_s,
                "sources": {s: _result("timeout", f"the type took more than {timeout_s:.0f} s") for s in SOURCES}}
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        tail = " ".join(out.stderr.strip().splitlines()[-1:])[:300]
        if out.returncode == -9 or "MemoryError" in out.stderr or "DefaultCPUAllocator" in out.stderr:
            return {"model_type": model_type, "kind": "?", "seconds": round(time.perf_counter() - start, 1),
                    "sources": {s: _result("upstream", f"the tiny config still builds a model past the census's "
                                                       f"{MEMORY_CAP >> 30} GiB cap: sizes of this family it does "
                                                       "not shrink") for s in SOURCES}}
        return {"model_type": model_type, "kind": "?", "seconds": round(time.perf_counter() - start, 1),
                "sources": {s: _result("internal", f"the census child died ({out.returncode}): {tail}")
                            for s in SOURCES}}
    row = json.loads(lines[-1])
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    dense = [r for r in rows if r["kind"] == "dense"]
    everywhere = [r for r in dense if all(r["sources"][s]["status"] == "ok" for s in SOURCES)]
    others = [r for r in rows if r["kind"] != "dense"]
    clean = [r for r in others if all(r["sources"][s]["status"] in ("ok", "refused", "upstream") for s in SOURCES)]
    statuses = {s: Counter(r["sources"][s]["status"] for r in rows) for s in SOURCES}
    return {"types": len(rows), "kinds": dict(Counter(r["kind"] for r in rows)), "dense": len(dense),
            "dense_everywhere": len(everywhere), "others": len(others), "others_clean": len(clean),
            "statuses": {s: dict(c) for s, c in statuses.items()}}


def render(rows: list[dict[str, Any]], command: str, seconds: float) -> str:
    import transformers

    summary = summarize(rows)
    share = summary["dense_everywhere"] / summary["dense"] if summary["dense"] else 0.0
    lines = [
        "# Architecture census: transformers' causal-LM model types from each source",
        "",
        f"Generated by `{command}` with transformers {transformers.__version__} in {seconds / 60:.0f} min "
        f"(see the script's docstring for the tiny configs and what each source checks). "
        f"{summary['types']} model types: " + ", ".join(f"{n} {k}" for k, n in sorted(summary["kinds"].items())) + ".",
        "",
        f"**Dense decoders working from every source: {summary['dense_everywhere']} of {summary['dense']} "
        f"({share:.0%}). Other types ending in ok, a one-line refusal or an upstream failure from every source: "
        f"{summary['others_clean']} of {summary['others']}.**",
        "",
        "| source | " + " | ".join(STATUSES) + " |",
        "|---|" + "---:|" * len(STATUSES),
    ]
    for source in SOURCES:
        counts = summary["statuses"][source]
        lines.append(f"| {source} | " + " | ".join(str(counts.get(s, 0)) for s in STATUSES) + " |")
    lines += ["", "| model type | kind | config.json (corsair, INT4) | module (mock) | ONNX export (mock) |",
              "|---|---|---|---|---|"]
    for row in rows:
        cells = []
        for source in SOURCES:
            result = row["sources"][source]
            text = result["status"] + (f": {result['detail']}" if result["status"] != "ok" and result["detail"] else "")
            cells.append(text.replace("|", "\\|").replace("\n", " ")[:220])
        lines.append(f"| {row['model_type']} | {row['kind']} | " + " | ".join(cells) + " |")
    lines += ["", "ok: compiled (and, for the module and the ONNX export, the step within 1e-4 of the reference and "
              f"{NEW} greedy tokens equal to transformers'). refused: aviatorc's one-line error. wrong: ran, but "
              "the numbers or tokens differ. internal: an exception that is not aviatorc's error. upstream: "
              "transformers, the ONNX exporter or onnxruntime failed before aviatorc saw the model. timeout: the "
              "type's child process ran past its limit."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", metavar="TYPE", help="one type in this process; its row as JSON on stdout")
    parser.add_argument("--types", nargs="*", help="model types (default: every causal-LM type)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per model type")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "arch_census.md")
    parser.add_argument("--json", type=Path, default=ROOT / "tools" / "results" / "arch_census.json")
    parser.add_argument("--update", action="store_true", help="rerun --types and merge them into --json's rows")
    args = parser.parse_args(argv)
    if args.one:  # a worker process of its own: quiet and on one thread, which `one` leaves to its caller
        import logging

        import torch

        logging.disable(logging.WARNING)
        torch.set_num_threads(1)
        try:
            row = one(args.one)
        except Exception:  # noqa: BLE001 - the census's own bug: say where
            traceback.print_exc()
            return 3
        print(json.dumps(row))
        return 0
    types = args.types or causal_lm_types()
    command = "python tools/arch_census.py" + (f" --types {' '.join(args.types)}" if args.types and not args.update
                                               else "")
    start = time.perf_counter()
    kept = [_portable(r) for r in json.loads(args.json.read_text()) if r["model_type"] not in types] if args.update else []
    rows: list[dict[str, Any]] = list(kept)
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(run_child, t, args.timeout): t for t in types}
        for future in concurrent.futures.as_completed(futures):
            row = future.result()
            rows.append(row)
            status = " ".join(f"{s}={row['sources'][s]['status']}" for s in SOURCES)
            print(f"[{len(rows) - len(kept)}/{len(types)}] {row['model_type']} ({row['kind']}): {status}", flush=True)
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(sorted(rows, key=lambda r: r["model_type"]), indent=1) + "\n")
    rows.sort(key=lambda r: r["model_type"])
    seconds = sum(r.get("seconds", 0.0) for r in rows) / max(1, args.jobs) if args.update else time.perf_counter() - start
    text = render(rows, command, seconds)
    args.out.write_text(text)
    print(text.split("\n\n")[2])
    return 0


if __name__ == "__main__":
    sys.exit(main())
