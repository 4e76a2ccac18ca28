"""The `aviatorc` command line.

    aviatorc inspect MODEL
    aviatorc compile MODEL -o OUT [--target T] [--cards N] [--quant int8|int4|mxint8|mxint4] ...
    aviatorc run ARTIFACT --inputs feeds.npz [--output out.npz]
    aviatorc report ARTIFACT [-o report.html] [--format html|json|text]
    aviatorc export ARTIFACT --format onnx -o model.onnx [--matmul-nbits] [--external-data]
    aviatorc generate ARTIFACT --prompt-ids 1,2,3 | --prompt TEXT --tokenizer DIR [--max-new-tokens 32]
    aviatorc serve ARTIFACT [ARTIFACT...] [--host 127.0.0.1] [--port 8000] [--tokenizer DIR] [--draft ARTIFACT]
    aviatorc passes | aviatorc ops | aviatorc target list | aviatorc target show NAME [--resolved]

Exit status: 0 done, 1 a user error (one `aviatorc: error:` line; `--debug` shows the
traceback), 2 a usage error (one line naming `--help`), 3 an internal error (a bug: one line),
130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from aviatorc import __version__
from aviatorc.errors import AviatorError, OptionError, VerificationError
from aviatorc.options import (
    ACTIVATION_METHODS,
    CALIBRATION_METHODS,
    KV_CACHE_CHOICES,
    KV_DTYPE_CHOICES,
    LINK_DTYPE_CHOICES,
    PREFILL_CHOICES,
    QUANT_CHOICES,
    SOLVER_CHOICES,
    SPARSITY_CHOICES,
    SPARSITY_METHODS,
    CompileOptions,
    ServerLimits,
)

DEFAULTS = CompileOptions()
LIMITS = ServerLimits()

EXIT_USER_ERROR = 1
EXIT_USAGE_ERROR = 2
EXIT_INTERNAL_ERROR = 3


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error in one line (not the whole usage block) and status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE_ERROR, f"aviatorc: error: {message} (see `{self.prog} --help`)\n")


class _ShowDefaults(argparse.HelpFormatter):
    """Help lines end with "(default: X)" where an option has a default its help does not state."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        # by identity: a default of 0 is shown (0 == False); an empty repeatable option says nothing
        shown = not (default is None or default is False or default is argparse.SUPPRESS or default == [])
        if shown and "default" not in text and action.option_strings:
            text += " (default: %(default)s)"
        return text


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. Exit status: 0 done, 1 a user error (one line), 3 an internal error.

    Every exception that is not an `AviatorError` is a bug in aviatorc, whatever the input
    (a `PlacementCheckError` from the partitioner's checker among them): it is reported as
    one "internal error, please report" line with status 3, and `--debug` (accepted before
    or after the command) shows its traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    end = argv.index("--") if "--" in argv else len(argv)
    late_debug = "--debug" in argv[1:end]
    if late_debug:  # `aviatorc compile m.onnx --debug` as well as `aviatorc --debug compile ...`
        argv = [a for i, a in enumerate(argv) if a != "--debug" or i >= end]
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the command's own parser, so the line points to the command's --help
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.debug = args.debug or late_debug

    def one_line(text: str, limit: int = 2000) -> str:
        # Control characters from the input (a NUL, a terminal escape) are escaped, not printed.
        text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
        return text if len(text) <= limit else text[: limit - 3] + "..."

    try:
        import contextlib

        from aviatorc.terminal import configure_logging

        # Only the commands with -q / -v: `serve` configures logging itself (--log-level).
        with configure_logging(quiet=args.quiet, verbose=args.verbose) if args.progress else contextlib.nullcontext():
            return int(args.handler(args) or 0)
    except AviatorError as error:
        if args.debug:
            raise
        if isinstance(error, VerificationError):
            text = "\n".join(one_line(line) for line in error.details().splitlines())
        else:
            text = one_line(str(error))
        print(f"aviatorc: error: {text}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("aviatorc: interrupted; nothing was written", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `aviatorc ops | head -1`: the reader stopped; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's own flush at exit would fail
        return 0
    except Exception as error:  # noqa: BLE001 - the last line of defence: a bug, reported as one
        if args.debug:
            import traceback

            traceback.print_exc()
        what = "out of memory" if isinstance(error, MemoryError) else f"{type(error).__name__}: {error}"
        print(f"aviatorc: internal error, please report: {one_line(what, 500)}"
              + ("" if args.debug else " (rerun with --debug for the traceback)"), file=sys.stderr)
        return EXIT_INTERNAL_ERROR


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="aviatorc", description="An ML compiler for in-memory-compute accelerators.")
    parser.add_argument("--version", action="version", version=f"aviatorc {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    parser.set_defaults(quiet=False, verbose=False, progress=False)  # the commands without -q / -v (_add_verbosity)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="print a model's inputs, outputs, op census and parameter bytes")
    p.add_argument("model", help="an .onnx file or a Hugging Face config.json")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--ir", action="store_true", help="also print the IR text")
    _add_verbosity(p)
    p.set_defaults(handler=cmd_inspect)

    p = sub.add_parser("compile", help="import, transform, and place a model; write an artifact directory",
                       formatter_class=_ShowDefaults)
    p.add_argument("model", help="an .onnx file, a Hugging Face config.json (shape-only), or a .gguf file")
    p.add_argument("-o", "--output", required=True, help="artifact directory to write")
    p.add_argument("--target", help="a shipped target name (see `aviatorc target list`) or a TOML file (default: corsair)")
    p.add_argument("--cards", type=int, help="build an N-card server from the target's card description")
    _add_set(p)
    p.add_argument("--chiplets", metavar="IDS",
                   help="confine the placement to these chiplets, like '0-7,12' (models sharing a server)")
    p.add_argument("--quant", choices=QUANT_CHOICES, help="weight quantization")
    p.add_argument("--group-size", type=int, default=DEFAULTS.group_size,
                   help="rows along the reduction dim sharing a scale (32/64/128); default 32 for int4 / mx, "
                        "per output channel for int8 (give one for group-wise int8; 0: per channel)")
    zero_points = p.add_mutually_exclusive_group()
    # Neither: int4 is asymmetric with an fp16 offset per group (5 bits a weight at g32), symmetric under 2:4.
    zero_points.add_argument("--asymmetric", action="store_true",
                             help="int4 with 4-bit zero points (4.625 bits a weight at g32; default: an fp16 offset "
                                  "per group, 5 bits)")
    zero_points.add_argument("--symmetric", action="store_true", help="int4 without zero points (4.5 bits a weight at g32)")
    p.add_argument("--quant-method", choices=CALIBRATION_METHODS, help="default: gptq for 4-bit with calibration")
    p.add_argument("--sparsity", choices=SPARSITY_CHOICES, help="structured sparsity")
    p.add_argument("--sparsity-method", choices=SPARSITY_METHODS, default=DEFAULTS.sparsity_method,
                   help="how --sparsity chooses the pruned weights: by magnitude, Wanda (magnitude x activation "
                   "norm; needs --calibration) or SparseGPT (with error correction; needs --calibration)")
    p.add_argument("--keep-fp16", action="append", default=[], metavar="PATTERN",
                   help="keep weights whose name matches this fnmatch pattern in FP16 (repeatable)")
    p.add_argument("--activations", choices=ACTIVATION_METHODS, help="W8A8: calibrate activation ranges")
    p.add_argument("--calibration", metavar="FILE.npz", help="calibration batches: one array per input, batches on axis 0")
    p.add_argument("--calibration-text", metavar="FILE.txt", help="calibrate a decoder on plain text (a few hundred "
                   "tokens or more), tokenized with the model's own tokenizer (a GGUF source's, or --tokenizer); the "
                   "last quarter is held out to measure accuracy")
    p.add_argument("--tokenizer", metavar="DIR", help="the tokenizer for --calibration-text: a Hugging Face tokenizer "
                   "folder or a .gguf file (default: the GGUF source's own)")
    p.add_argument("--eval", metavar="FILE.npz", help="batches to measure accuracy on, as --calibration (default: the "
                   "last quarter of the calibration batches, held out of calibration)")
    p.add_argument("--no-fuse-qkv", action="store_true", help="leave q/k/v projections separate")
    p.add_argument("--passes", help="explicit comma-separated pass pipeline (overrides the options)")
    p.add_argument("--print-ir-after-change", action="store_true", help="print the IR after each pass that changed it")
    p.add_argument("--time-limit", type=float, default=30.0, help="partitioner time budget in seconds")
    p.add_argument("--batch", type=int, default=DEFAULTS.batch, help="sequences decoded together")
    p.add_argument("--context", type=int, default=DEFAULTS.context, help="KV-cache tokens per sequence (decode)")
    p.add_argument("--prompt", type=int, default=DEFAULTS.prompt, help="prompt tokens per sequence (prefill)")
    p.add_argument("--no-prefetch", action="store_true", help="load streamed weights just before use (no overlap)")
    p.add_argument("--no-ranges", action="store_true",
                   help="skip re-timing the plan over the target's assumed figures (faster; no ranges in the report)")
    p.add_argument("--no-sweep", action="store_true", help="skip the batch and context sweep (faster)")
    p.add_argument("--kv-cache", choices=KV_CACHE_CHOICES, default=DEFAULTS.kv_cache, help="where the KV cache lives: auto keeps a small one in SRAM, and a larger one in LPDDR "
                   "except the blocks the SRAM the weights leave can hold; sram or lpddr all of it there")
    p.add_argument("--kv-dtype", choices=KV_DTYPE_CHOICES, default=DEFAULTS.kv_dtype, help="KV cache element type")
    p.add_argument("--link-dtype", choices=LINK_DTYPE_CHOICES, default=DEFAULTS.link_dtype,
                   help="activations sent between chiplets: as computed (fp16, default) or int8 codes with an "
                        "exponent per 32 values, half the bytes on the links; the outputs change by that rounding")
    p.add_argument("--kv-recent", type=int, default=None, metavar="N",
                   help="a bounded KV cache: keep each sequence's first --kv-sinks positions and its last N or "
                        "more, evicting N at a time (at most sinks + 2N held; default: keep all)")
    p.add_argument("--kv-sinks", type=int, default=None, metavar="N",
                   help=f"with --kv-recent: the first positions always kept (attention sinks; default {DEFAULTS.kv_sinks})")
    p.add_argument("--prefill", choices=PREFILL_CHOICES, default=DEFAULTS.prefill,
                   help="prefill schedule: stationary streams each weight once per pass over the prompt; "
                        "pipelined does too with each layer on its home's card, reading copies of its weights from "
                        "that card's LPDDR so that the prompt's activations stay on the card (large prompts over "
                        "several cards); chunked re-streams the weights per chunk and leaves the decode step more "
                        "SRAM; auto (default) takes pipelined where the prefill and the decode steps up to --context "
                        "are estimated to take less time with it, else stationary")
    p.add_argument("--lora-rank", type=int, default=DEFAULTS.lora_rank, metavar="R",
                   help="reserve SRAM beside the weights for LoRA adapters of rank up to R, and count their work in "
                        "the prediction (aviatorc serve --lora); default: none")
    p.add_argument("--max-loras", type=int, default=DEFAULTS.max_loras, metavar="N",
                   help=f"with --lora-rank: adapters held at once (default {DEFAULTS.max_loras})")
    p.add_argument("--solver", choices=SOLVER_CHOICES, default=DEFAULTS.solver,
                   help="partitioner: greedy alone (default); greedy then CP-SAT per layer; or auto: CP-SAT only where the "
                   "greedy placement is over 2%% above its lower bound")
    p.add_argument("--routing", default=None, metavar="uniform|zipf:S|FILE.json",
                   help="a mixture of experts' routing, which decides what a decode step reads: uniform, zipf:S (the "
                        "expert of rank r fires in proportion to 1/r^S), or a JSON file of each expert's share per "
                        "layer (report.json's 'routing' has the form); default: measured on the calibration data, "
                        "else uniform")
    p.add_argument("--seed", type=int, default=0, help="the partitioner's random seed (the same seed and inputs "
                   "give a byte-identical artifact)")
    _add_verbosity(p, quiet="print nothing but warnings and errors (no progress, no summary)")
    p.set_defaults(handler=cmd_compile)

    p = sub.add_parser("report", help="report on a compiled artifact: an HTML page, JSON, or a terminal summary")
    p.add_argument("artifact", help="an artifact directory written by `aviatorc compile`")
    p.add_argument("-o", "--output", metavar="FILE", help="write the report here (default: print it; an HTML "
                   "report needs a file)")
    p.add_argument("--format", choices=("html", "json", "data", "text"), help="html: one self-contained page "
                   "(placement, SRAM over time, timeline, accuracy, latency against the bound); json: what the compile "
                   "measured, the artifact's report.json; data: everything the page draws, as JSON; text: a terminal "
                   "summary (default: html with -o, text without)")
    p.set_defaults(handler=cmd_report)

    p = sub.add_parser("export", help="write a compiled artifact as a standard ONNX file with its exact quantized "
                       "weights (for onnxruntime); a decoder with a KV cache also gets genai_config.json")
    p.add_argument("artifact", help="an artifact directory written by `aviatorc compile`")
    p.add_argument("-o", "--output", required=True, metavar="MODEL.onnx", help="the ONNX file to write")
    p.add_argument("--format", choices=("onnx",), default="onnx", help="the interchange format")
    p.add_argument("--matmul-nbits", action="store_true", help="blocked weights (4-bit, group-wise int8, "
                   "mxint8) as com.microsoft.MatMulNBits "
                   "(default: standard QDQ, blocked DequantizeLinear)")
    p.add_argument("--external-data", action="store_true", help="weights in MODEL.onnx.data beside the model "
                   "(default: only when they pass 1 GiB)")
    p.add_argument("--eos-token-id", type=int, default=0, metavar="ID",
                   help="the end-of-sequence token for genai_config.json (default: 0; the artifact does not know the "
                   "tokenizer)")
    p.set_defaults(handler=cmd_export)

    p = sub.add_parser("run", help="run a compiled artifact on inputs from an .npz file (sim device)")
    p.add_argument("artifact", help="an artifact directory written by `aviatorc compile`")
    p.add_argument("--inputs", required=True, metavar="FEEDS.npz", help="one array per graph input, by name")
    p.add_argument("--output", metavar="OUT.npz", help="write the outputs here (default: print a summary)")
    p.add_argument("--device", choices=("sim", "cuda"), default="sim")
    p.add_argument("--world", type=int, default=1, metavar="N", help="ranks, one per card of a multi-card plan "
                   "(this process is rank 0; the others are spawned; torch.distributed with gloo)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S",
                   help="seconds a rank may wait for another before the run fails (with --world)")
    _add_verbosity(p)
    p.set_defaults(handler=cmd_run)

    p = sub.add_parser("generate", help="generate tokens with a compiled decoder that carries its KV cache")
    p.add_argument("artifact", help="an artifact directory written by `aviatorc compile`")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt-ids", metavar="IDS", help="comma-separated token ids, like 1,2,3 (prints the new "
                        "ids; with --tokenizer, their text)")
    prompt.add_argument("--prompt", metavar="TEXT", help="prompt text (needs a tokenizer; prints the new text)")
    p.add_argument("--tokenizer", metavar="DIR", help="a folder with a Hugging Face tokenizer (tokenizer.json), "
                   "or a .gguf file (default: the GGUF file the artifact was compiled from)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, help="sampling seed")
    p.add_argument("--eos-token-id", type=int, action="append", help="stop after this id (repeatable; default: "
                   "the model's end-of-sequence ids, else the tokenizer's; -1: never stop early)")
    p.add_argument("--device", choices=("sim", "cuda"), default="sim")
    _add_verbosity(p, quiet="print nothing but the generated text or ids (no timing)")
    p.set_defaults(handler=cmd_generate)

    p = sub.add_parser("chat", help="chat with a compiled decoder in the terminal (the tokenizer's chat template)",
                       formatter_class=_ShowDefaults)
    p.add_argument("artifact", help="an artifact directory written by `aviatorc compile`")
    p.add_argument("--tokenizer", metavar="DIR", help="a Hugging Face tokenizer folder or a .gguf file (default: the "
                   "GGUF file the artifact was compiled from)")
    p.add_argument("--system", metavar="TEXT", help="a system message before the conversation")
    p.add_argument("--max-new-tokens", type=int, default=256, help="the longest reply, in tokens")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, help="sampling seed")
    p.add_argument("--device", choices=("sim", "cuda"), default="sim")
    p.set_defaults(handler=cmd_chat)

    p = sub.add_parser("serve", help="serve compiled decoders over the OpenAI API (completions, chat, SSE)",
                       formatter_class=_ShowDefaults)
    p.add_argument("artifacts", nargs="+", metavar="ARTIFACT", help="artifact directories; several are served as "
                   "isolated tenants (each compiled onto its own chiplets with --chiplets)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on, 8000 by default (0: a free one, printed "
                   "when ready)")
    p.add_argument("--tokenizer", action="append", metavar="DIR", help="a Hugging Face tokenizer folder or a .gguf "
                   "file: once for every artifact, or once per artifact in order (default: the GGUF file an artifact "
                   "was compiled from, else token ids only)")
    p.add_argument("--served-model-name", action="append", metavar="NAME",
                   help="the model's name in the API, once per artifact (default: the artifact folder's name)")
    p.add_argument("--max-num-seqs", type=int, metavar="K", help="sequences held at once (default: the plan's compiled "
                   "--batch); their caches share the KV blocks, so more than the batch fit when they are short, and "
                   "each decode step runs at most the batch of them")
    p.add_argument("--kv-blocks", type=int, metavar="N", help="blocks in the KV cache's pool (default: the plan's KV "
                   "memory, its --batch x --context tokens)")
    p.add_argument("--block-size", type=int, default=16, metavar="T", help="tokens per KV block (default: 16, as vLLM)")
    p.add_argument("--kv-dtype", choices=("auto", "fp16", "int8"), default="auto", help="how the KV blocks keep their "
                   "values: int8 codes with an fp16 scale per head and token, or the model's own floats (default: "
                   "auto, what the plan was compiled with, --kv-dtype of aviatorc compile)")
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="fcfs: arrival order; priority: lower `priority` first, may preempt")
    p.add_argument("--max-queue", type=int, default=256, metavar="N", help="requests waiting before new ones get 429")
    p.add_argument("--request-timeout", type=float, metavar="S", help="server-wide limit per request, in seconds "
                   "(a request's own `timeout` may only shorten it)")
    p.add_argument("--draft", metavar="ARTIFACT", help="a small draft model for speculative decoding of the first "
                   "artifact (greedy requests), or with --speculative-method self its INT4 plan")
    p.add_argument("--speculative-method", choices=("draft", "ngram", "self"), help="speculative decoding of the "
                   "first artifact's greedy requests: draft (a small model, --draft), ngram (prompt lookup, no draft "
                   "model) or self (the same model at INT4: --draft, else compiled from its source at start); "
                   "default: draft when --draft is given")
    p.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K", help="draft tokens per step")
    p.add_argument("--keep-speculating", action="store_true", help="speculate whatever it costs on this machine: "
                   "by default a request stops when its drafts cost more time than they save here (measuring "
                   "acceptance on a machine where verification is slow, such as the sim, needs them kept)")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH", help="a PEFT LoRA adapter (its folder: "
                   "adapter_config.json, adapter_model.safetensors) beside the first artifact, which requests with "
                   "model NAME run; repeat for more")
    p.add_argument("--enable-lora", action="store_true", help="run LoRA adapters beside the first artifact, loaded "
                   "and unloaded over HTTP as well (POST /v1/load_lora_adapter, /v1/unload_lora_adapter)")
    p.add_argument("--enable-prefix-caching", action="store_true", help="share the KV blocks of prompts that earlier "
                   "requests computed: a shared system prompt is prefilled once")
    p.add_argument("--prefix-cache-tokens", type=int, default=None, metavar="N", help="tokens the prefix cache keeps "
                   "at most (least recently used dropped first, and whenever the pool runs short; default: the "
                   "whole pool)")
    p.add_argument("--max-num-batched-tokens", type=int, metavar="N", help="chunked prefill: each step computes at "
                   "most N tokens, one per decoding sequence and the rest from prompts, so a long prompt is prefilled "
                   "in chunks between decode steps instead of stalling them (default: whole prompts)")
    p.add_argument("--swap-space", type=float, default=4.0, metavar="GIB", help="host memory (GiB) for the KV "
                   "caches of sequences preempted under --scheduling-policy priority: one that fits is restored on "
                   "readmission, the others are computed again (default: 4, as vLLM)")
    p.add_argument("--shutdown-timeout", type=float, default=LIMITS.shutdown_timeout_s, metavar="S",
                   help="on SIGTERM, how long the requests in progress may run on before they end with an error "
                   "(new ones get 503 meanwhile)")
    p.add_argument("--max-request-bytes", type=int, default=LIMITS.max_request_bytes, metavar="N",
                   help="larger request bodies get 413, before any parsing")
    p.add_argument("--read-timeout", type=float, default=LIMITS.read_timeout_s, metavar="S",
                   help="a client must send a request's head within S seconds, and each piece of its body within "
                   "S seconds of the last (408)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="warning")
    p.set_defaults(handler=cmd_serve)

    p = sub.add_parser("passes", help="list the passes")
    p.set_defaults(handler=cmd_passes)

    p = sub.add_parser("ops", help="list the IR's op set")
    p.set_defaults(handler=cmd_ops)

    p = sub.add_parser("target", help="list and show target descriptions")
    tsub = p.add_subparsers(dest="target_command", required=True)
    t = tsub.add_parser("list", help="list the shipped targets")
    t.set_defaults(handler=cmd_target_list)
    t = tsub.add_parser("show", help="show a target description")
    t.add_argument("name", help="a shipped target name or a TOML file")
    t.add_argument("--cards", type=int)
    _add_set(t)
    t.add_argument("--resolved", action="store_true", help="echo the fully resolved description")
    t.add_argument("--sensitivity", metavar="MODEL",
                   help="instead, the table of how MODEL's predicted figures move with each assumed figure of the "
                        "target (MODEL: a model source, compiled here, or a compiled artifact for this target)")
    t.add_argument("--quant", choices=QUANT_CHOICES, help="with --sensitivity: the weight format MODEL is compiled to")
    t.add_argument("--batch", type=int, help="with --sensitivity: the batch MODEL is compiled for")
    t.add_argument("--context", type=int, help="with --sensitivity: the context MODEL is compiled for")
    t.add_argument("--prompt", type=int, help="with --sensitivity: the prompt length MODEL is compiled for")
    t.set_defaults(handler=cmd_target_show)
    _name_own_parsers(parser)
    return parser


def _name_own_parsers(parser: argparse.ArgumentParser) -> None:
    """Each (sub)command's parser in its namespace as `command_parser`, the innermost winning, so
    an error found after parsing (an unknown option) names that command's --help."""
    parser.set_defaults(command_parser=parser)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _name_own_parsers(child)


def _add_set(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="override a figure of the target description, like runtime.per_layer_latency_s=0 or "
                        "card.lpddr_bytes_per_s=1e12 (repeatable; VALUE is read as TOML: numbers, strings, lists)")


def target_overrides(pairs: Sequence[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` pairs as `load_target` overrides; each VALUE read as a TOML value, a bare
    word as a string."""
    import tomllib


    out: dict[str, Any] = {}
    for pair in pairs:
        key, equals, text = pair.partition("=")
        if not equals or not key.strip():
            raise OptionError(f"--set '{pair}' is not KEY=VALUE", hint="like --set runtime.per_layer_latency_s=0")
        try:
            value = tomllib.loads(f"v = {text.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = text.strip()
        out[key.strip()] = value
    return out


def _add_verbosity(p: argparse.ArgumentParser, *, quiet: str = "print nothing but the result, warnings and errors "
                   "(no progress)") -> None:
    """-q / -v of a long-running command (see `aviatorc.terminal` for what each shows on stderr)."""
    group = p.add_mutually_exclusive_group()
    group.add_argument("-q", "--quiet", action="store_true", help=quiet)
    group.add_argument("-v", "--verbose", action="store_true", help="log each stage and pass as a line on stderr "
                       "(progress is drawn on a terminal either way)")
    p.set_defaults(progress=True)


def _console() -> Any:
    from aviatorc.terminal import stdout_console

    return stdout_console()


def cmd_inspect(args: argparse.Namespace) -> int:
    from aviatorc.frontends import import_model
    from aviatorc.inspect import human_bytes, human_count, summarize
    from aviatorc.ir import print_graph

    start = time.perf_counter()
    graph = import_model(_model_path(args.model))
    summary = summarize(graph)
    seconds = time.perf_counter() - start
    if args.json:
        print(json.dumps(summary.to_dict() | {"import_seconds": round(seconds, 3)}, indent=2))
        return 0
    from rich.table import Table

    console = _console()
    console.print(f"{args.model}: graph '{summary.name}', {summary.num_nodes} nodes, "
                  f"{human_count(summary.num_parameters)} parameters"
                  + (" (shape-only)" if summary.shape_only else "") + f", imported in {seconds:.1f} s")
    io = Table(title="inputs and outputs")
    io.add_column("kind")
    io.add_column("name")
    io.add_column("type")
    for name, type_ in summary.inputs:
        io.add_row("input", name, type_)
    for name, type_ in summary.outputs:
        io.add_row("output", name, type_)
    console.print(io)
    census = Table(title="op census")
    census.add_column("op")
    census.add_column("count", justify="right")
    for op, count in sorted(summary.op_census.items(), key=lambda kv: (-kv[1], kv[0])):
        census.add_row(op, str(count))
    console.print(census)
    sizes = Table(title="initializer bytes by element type")
    sizes.add_column("dtype")
    sizes.add_column("bytes", justify="right")
    for dtype, n in summary.bytes_by_dtype.items():
        sizes.add_row(dtype, human_bytes(n))
    console.print(sizes)
    if args.ir:
        print(print_graph(graph))
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    from aviatorc.compiler import compile as compile_model
    from aviatorc.compiler import load_calibration_npz

    console = _console()
    if args.kv_sinks is not None and args.kv_recent is None:
        raise OptionError("--kv-sinks bounds nothing without --kv-recent", hint="add --kv-recent N")
    # Progress goes to logging (drawn on stderr by `aviatorc.terminal`); --print-ir-after-change
    # prints the IR to stdout (no `log` callback is given).
    calibration = load_calibration_npz(args.calibration) if args.calibration else None
    evaluation = load_calibration_npz(args.eval, what="evaluation") if args.eval else None
    # Neither flag: the default (`int4_zero`).
    symmetric = True if args.symmetric else False if args.asymmetric else None
    target: Any = args.target
    if args.overrides:  # the target is built here, so its errors name the --set that caused them
        from aviatorc.target import DEFAULT_TARGET, load_target

        target = load_target(args.target or DEFAULT_TARGET, cards=args.cards, overrides=target_overrides(args.overrides))
    options: dict[str, Any] = {
        "target": target, "cards": None if args.overrides else args.cards, "quant": args.quant, "group_size": args.group_size,
        "symmetric": symmetric, "quant_method": args.quant_method, "sparsity": args.sparsity,
        "sparsity_method": args.sparsity_method, "keep_fp16": tuple(args.keep_fp16),
        "activations": args.activations, "fuse_qkv": not args.no_fuse_qkv,
        "passes": tuple(p.strip() for p in args.passes.split(",") if p.strip()) if args.passes else None,
        "print_ir_after_change": args.print_ir_after_change, "seed": args.seed, "time_limit_s": args.time_limit,
        "batch": args.batch, "context": args.context, "prompt": args.prompt, "prefetch": not args.no_prefetch,
        "ranges": not args.no_ranges, "sweep": not args.no_sweep,
        "kv_cache": args.kv_cache, "kv_dtype": args.kv_dtype, "kv_recent": args.kv_recent, "link_dtype": args.link_dtype,
        "kv_sinks": DEFAULTS.kv_sinks if args.kv_sinks is None else args.kv_sinks,
        "solver": args.solver, "chiplets": args.chiplets, "prefill": args.prefill, "routing": args.routing,
        "lora_rank": args.lora_rank, "max_loras": args.max_loras,
    }
    from aviatorc.plan.artifact import check_output_path

    check_output_path(args.output)  # before the compile spends its time
    start = time.perf_counter()
    text = None
    if args.calibration_text:
        try:
            text = Path(args.calibration_text).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:

            raise OptionError(f"cannot read the calibration text: {error}", file=args.calibration_text) from None
    result = compile_model(_model_path(args.model), calibration=calibration, evaluation=evaluation,
                           calibration_text=text, tokenizer=args.tokenizer, **options)
    out = result.save(args.output)
    if not args.quiet:
        console.print(result.report.summary())
        if "accuracy" in result.report.data:
            from aviatorc.accuracy import format_accuracy

            console.print(format_accuracy(result.report.data["accuracy"], max_layers=8))
        if result.placement is not None:
            from aviatorc.partition.report import render_table

            console.print(render_table(result.placement))
        console.print(f"wrote {out}/ in {time.perf_counter() - start:.1f} s")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from aviatorc.plan.artifact import check_output_path, load, write_file_atomically
    from aviatorc.report import ReportSources, render_html, render_text, report_data

    fmt = args.format or ("html" if args.output else "text")
    if fmt == "html" and not args.output:
        raise OptionError("an HTML report needs an output file", hint="add -o report.html (the compile also wrote "
                          f"one into the artifact: {Path(args.artifact) / 'report.html'})")
    if args.output:
        check_output_path(args.output, directory=False)
    artifact = load(args.artifact)
    data = report_data(ReportSources.from_artifact(artifact))
    if fmt == "text" and not args.output:
        console = _console()
        html = artifact.path / "report.html"
        for renderable in render_text(data, html_path=str(html) if "report.html" in artifact.manifest["files"] else None):
            console.print(renderable)
        return 0
    if fmt == "html":
        text = render_html(data)
    elif fmt == "json":  # the artifact's own report.json, byte for byte: one shape, whichever way it is read
        text = (artifact.path / "report.json").read_text(encoding="utf-8")
    elif fmt == "data":
        text = json.dumps(data, indent=1, sort_keys=True, allow_nan=False) + "\n"
    else:
        import io

        from rich.console import Console

        console = Console(record=True, width=120, file=io.StringIO(), highlight=False, markup=False)
        for renderable in render_text(data):
            console.print(renderable)
        text = console.export_text()
    if not args.output:
        sys.stdout.write(text)
        return 0
    write_file_atomically(Path(args.output), text.encode())
    print(f"wrote {args.output} ({len(text.encode()):,} bytes)")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from aviatorc.exporter import EXTERNAL_DATA_BYTES, export

    result = export(args.artifact, args.output, matmul_nbits=args.matmul_nbits,
                    external_data_bytes=0 if args.external_data else EXTERNAL_DATA_BYTES,
                    eos_token_id=args.eos_token_id)
    formats = ", ".join(f"{name} x{count}" for name, count in result.formats.items()) or "no quantized weights"
    print(f"wrote {result.path} (opset {result.opset}; weights: {formats}"
          + (f"; {result.matmul_nbits} MatMulNBits" if args.matmul_nbits else "") + ")")
    for extra in (result.data_path, result.genai_config):
        if extra is not None:
            print(f"wrote {extra}")
    for note in result.notes:
        print(f"note: {note}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    import numpy as np

    from aviatorc.plan.artifact import write_file_atomically
    from aviatorc.runtime import Session

    if args.output:
        from aviatorc.plan.artifact import check_output_path

        check_output_path(args.output, directory=False)
    path = Path(args.inputs)
    try:  # allow_pickle=False: an .npz of object arrays would unpickle untrusted data
        with np.load(path, allow_pickle=False) as data:
            feeds = {name: data[name] for name in data.files}
    except (OSError, ValueError) as error:
        raise OptionError(f"{path}: cannot read the inputs: {error}",
                          hint="save them with numpy.savez(path, name=array, ...)") from None
    with Session(args.artifact, device=args.device, world=args.world, timeout_s=args.timeout) as session:
        outputs = session.run(feeds)
    if args.output:
        import io

        buffer = io.BytesIO()
        np.savez(buffer, **outputs)  # type: ignore[arg-type]  # numpy's stub types allow_pickle as a kwarg
        write_file_atomically(Path(args.output), buffer.getvalue())
        print(f"wrote {len(outputs)} output(s) to {args.output}")
    else:
        for name, array in outputs.items():
            print(f"{name}: {array.dtype}{list(array.shape)} mean {float(array.mean()):.6g} "
                  f"min {float(array.min()):.6g} max {float(array.max()):.6g}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from aviatorc.runtime import Session

    session = Session(args.artifact, device=args.device)
    tokenizer = _tokenizer(args.tokenizer, session, needed=args.prompt is not None,
                           why="--prompt TEXT needs a tokenizer", hint="give --tokenizer DIR, or token ids with "
                           "--prompt-ids 1,2,3")
    if args.prompt_ids is not None:
        try:
            ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise OptionError(f"--prompt-ids must be comma-separated integers, not '{args.prompt_ids}'") from None
    else:
        ids = tokenizer.encode(args.prompt)
    eos = args.eos_token_id
    if eos is None and not session.eos_token_ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        eos = [tokenizer.eos_token_id]
    tokens = session.generate(ids, args.max_new_tokens, eos_token_id=eos, temperature=args.temperature,
                              top_p=args.top_p, seed=args.seed)
    new = [int(t) for t in tokens[len(ids):]]
    if tokenizer is not None and (args.prompt is not None or args.tokenizer):  # ids in, ids out, unless asked
        print(tokenizer.decode(new, skip_special_tokens=True))
    else:
        print(",".join(str(t) for t in new))
    if not args.quiet and session.stats is not None:
        print(timing_line(session, len(new)), file=sys.stderr)
    return 0


def timing_line(session: Any, new_tokens: int) -> str:
    """What this generate took on this machine beside what the plan predicts for its target, labelled
    so neither is taken for the other."""
    from aviatorc.report.data import seconds

    extra = session.stats.extra
    prediction = session.artifact.plan.prediction
    decode_steps = max(new_tokens - 1, 0)
    measured_rate = f"{decode_steps / extra['decode_s']:,.1f} tokens/s" if decode_steps and extra["decode_s"] > 0 else "-"
    predicted = (f"predicted for {session.target.name}: time to first token {seconds(prediction.ttft_s)}, "
                 f"decode {prediction.tokens_per_s:,.1f} tokens/s" if prediction else "no prediction in the plan")
    line = (f"timing: measured here ({session.device} device on this machine's CPU): time to first token "
            f"{seconds(extra['ttft_s'])}, decode {measured_rate} over {decode_steps} step(s) | {predicted}")
    decode = session.experts.get("decode")
    if decode is not None and decode.blocks:
        line += (f"\nexperts: a decode step ran {decode.ran / decode.blocks:.1f} of {decode.experts / decode.blocks:.0f} "
                 "a block (only the routed ones compute and load)")
        if decode.hit_rate is not None:
            line += f"; pre-gating one block ahead named {decode.hit_rate:.0%} of them"
    return line


def _tokenizer(given: str | None, session: Any, *, needed: bool, why: str, hint: str) -> Any:
    """The tokenizer `--tokenizer` names, else the one of the artifact's source (a GGUF file), else
    None; an OptionError when `needed` and there is none."""
    from aviatorc.runtime.text import load_tokenizer, source_tokenizer

    path = given or source_tokenizer(session.graph)
    if path is None:
        if needed:
            raise OptionError(why, hint=hint)
        return None
    return load_tokenizer(path)


def cmd_chat(args: argparse.Namespace) -> int:
    """Read a message per line (stdin), answer each with the model, keep the conversation. Older turns
    are dropped when the conversation outgrows the plan's context."""
    from aviatorc.runtime import Session

    session = Session(args.artifact, device=args.device)
    tokenizer = _tokenizer(args.tokenizer, session, needed=True, why="chat needs a tokenizer with a chat template",
                           hint="give --tokenizer DIR (a folder with tokenizer.json) or a .gguf file")
    if not getattr(tokenizer, "chat_template", None):
        raise OptionError("the tokenizer has no chat template, so chat cannot format a conversation",
                          hint="use `aviatorc generate --prompt TEXT` for plain text")
    system = [{"role": "system", "content": args.system}] if args.system else []
    turns: list[dict[str, str]] = []
    terminal = sys.stdin.isatty()
    while True:
        if terminal:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() in ("/exit", "/quit"):
            return 0
        if not line.strip():
            continue
        turns.append({"role": "user", "content": line.rstrip("\n")})
        while True:
            ids = tokenizer.apply_chat_template(system + turns, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
            if len(ids) + 1 <= session.context or len(turns) <= 1:
                break
            turns = turns[2:]  # the oldest exchange goes
        room = session.context - len(ids)
        if room < 1:
            raise OptionError(f"the message takes {len(ids)} tokens but the plan holds {session.context}",
                              hint="compile with a larger --context")
        tokens = session.generate(ids, min(args.max_new_tokens, room), temperature=args.temperature, top_p=args.top_p,
                                  seed=args.seed, eos_token_id=_chat_stops(session, tokenizer))
        reply = tokenizer.decode([int(t) for t in tokens[len(ids):]], skip_special_tokens=True).strip()
        print(reply, flush=True)
        turns.append({"role": "assistant", "content": reply})


def _chat_stops(session: Any, tokenizer: Any) -> list[int]:
    """A reply ends at the model's end-of-sequence ids and the tokenizer's (a chat template's end of turn)."""
    stops = set(session.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        stops.add(int(tokenizer.eos_token_id))
    return sorted(stops)


def cmd_serve(args: argparse.Namespace) -> int:
    from aviatorc.extras import require

    require("serve", "`aviatorc serve`")
    from aviatorc.serve.server import serve
    from aviatorc.serve.tenants import EngineOptions, ModelSpec

    limits = ServerLimits(max_request_bytes=args.max_request_bytes, read_timeout_s=args.read_timeout,
                          shutdown_timeout_s=args.shutdown_timeout)

    count = len(args.artifacts)

    def per_artifact(values: list[str] | None, flag: str, *, shared: bool) -> list[str | None]:
        if not values:
            return [None] * count
        if len(values) == count:
            return [*values]
        if shared and len(values) == 1:
            return [values[0]] * count
        raise OptionError(f"{flag} was given {len(values)} times for {count} artifacts",
                          hint=f"give it once per artifact{' or once for all' if shared else ''}")

    tokenizers = per_artifact(args.tokenizer, "--tokenizer", shared=True)
    names = per_artifact(args.served_model_name, "--served-model-name", shared=False)
    specs = [ModelSpec(a, name=n, tokenizer=t) for a, n, t in zip(args.artifacts, names, tokenizers)]
    options = EngineOptions(max_num_seqs=args.max_num_seqs, policy=args.scheduling_policy, max_queue=args.max_queue,
                            request_timeout_s=args.request_timeout, draft=args.draft,
                            speculative_method=args.speculative_method, num_speculative_tokens=args.num_speculative_tokens,
                            prefix_cache_tokens=_prefix_cache_tokens(args),
                            max_num_batched_tokens=args.max_num_batched_tokens, loras=_loras(args.lora),
                            keep_speculating=args.keep_speculating,
                            enable_lora=args.enable_lora, swap_bytes=_swap_bytes(args.swap_space),
                            kv_blocks=args.kv_blocks, block_size=args.block_size,
                            kv_dtype=None if args.kv_dtype == "auto" else args.kv_dtype)
    serve(specs, options, host=args.host, port=args.port, log_level=args.log_level, limits=limits)
    return 0


def _loras(given: list[str]) -> tuple[tuple[str, str], ...]:
    """--lora NAME=PATH, each once."""
    out: dict[str, str] = {}
    for item in given:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise OptionError(f"--lora takes NAME=PATH, not '{item}'", hint="for example --lora sql=adapters/sql")
        if name in out:
            raise OptionError(f"--lora names '{name}' twice")
        out[name] = path
    return tuple(out.items())


def _swap_bytes(gib: float) -> int:
    if not gib >= 0:  # NaN too
        raise OptionError(f"--swap-space must be >= 0 GiB, not {gib}")
    return int(gib * 2**30)


def _prefix_cache_tokens(args: argparse.Namespace) -> int | None:
    """0: no prefix cache; None: the default size (the whole pool); N: N tokens."""
    if args.prefix_cache_tokens is not None and not args.enable_prefix_caching:
        raise OptionError("--prefix-cache-tokens needs --enable-prefix-caching")
    if args.prefix_cache_tokens is not None and args.prefix_cache_tokens < args.block_size:
        raise OptionError(f"--prefix-cache-tokens must hold at least one {args.block_size}-token block, "
                          f"not {args.prefix_cache_tokens}")
    return args.prefix_cache_tokens if args.enable_prefix_caching else 0


def cmd_passes(args: argparse.Namespace) -> int:
    from aviatorc.passes.manager import list_passes

    for name, summary in list_passes():
        print(f"{name:18} {summary}")
    return 0


def cmd_ops(args: argparse.Namespace) -> int:
    from aviatorc.ir import OPS

    for name in sorted(OPS):
        print(f"{name:20} {OPS[name].doc}")
    return 0


def cmd_target_list(args: argparse.Namespace) -> int:
    from aviatorc.target import cli_list

    print(cli_list())
    return 0


def cmd_target_show(args: argparse.Namespace) -> int:
    from aviatorc.target import cli_show

    if args.sensitivity:
        print(sensitivity_text(args))
        return 0
    print(cli_show(args.name, cards=args.cards, resolved=args.resolved, overrides=target_overrides(args.overrides)))
    return 0


def sensitivity_text(args: argparse.Namespace) -> str:
    """`target show NAME --sensitivity MODEL`: MODEL's predicted figures at each end of each assumed
    figure of the target. An artifact keeps the table it was compiled with; a model source is
    compiled here, on the target as --cards and --set make it."""
    import aviatorc
    from aviatorc.report.sensitivity import render_table, sensitivity_table
    from aviatorc.target import load_target

    source = _model_path(args.sensitivity)
    if (source / "plan.json").is_file():
        artifact = aviatorc.load(source)
        plan = artifact.plan
        if args.name not in (plan.target_name, str(artifact.path / "target.toml")) or args.cards or args.overrides:
            raise OptionError(f"artifact '{source}' was compiled for target '{plan.target_name}' as it stands",
                              hint=f"run `aviatorc target show {plan.target_name} --sensitivity {source}`, or give "
                                   "the model source to compile it for another target")
        target = artifact.target()  # from the bytes load() verified
    else:
        target = load_target(args.name, cards=args.cards, overrides=target_overrides(args.overrides))
        options = {k: v for k, v in (("quant", args.quant), ("batch", args.batch), ("context", args.context),
                                                        ("prompt", args.prompt)) if v}
        plan = aviatorc.compile(str(source), target=target, sweep=False, **options).plan
    if not plan.prediction.ranges:
        raise OptionError(f"the plan of '{source}' has no ranges (compiled with --no-ranges)",
                          hint="compile it again without --no-ranges, or give the model source")
    header = (f"{plan.target_name} ({target.cards} card(s)): how the predicted figures of '{source}' move with each "
              "assumed figure at its low / high end, the others nominal")
    return header + "\n" + render_table(sensitivity_table(plan.prediction.ranges, target))


def _model_path(model: str) -> Path:
    path = Path(model)
    if not path.exists():
        from aviatorc.frontends import ACCEPTED_SOURCES

        raise OptionError(f"model '{model}' does not exist", hint=ACCEPTED_SOURCES)
    return path



if __name__ == "__main__":
    sys.exit(main())
