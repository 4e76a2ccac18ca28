"""Check the cuda backend on a GPU: the model zoo's plans run on `cuda` against `sim`.

    python tools/check_cuda.py                 # every zoo model: resident fp32, streaming fp32, int4
    python tools/check_cuda.py --only llama    # one model
    python tools/check_cuda.py --device cpu    # the same checks on the CPU debug device (no GPU)

For each plan: the largest |cuda - sim| over its outputs (from `Session(..., device="cuda")`),
then the cuda backend's figures (`counts.extra["cuda"]`, medians over `--repeats` runs after one
warm-up run that pays the cold start): copy ms, compute ms, busy ms (the GPU busy with either),
wall ms (first event to last), overlap = (copy + compute - busy) / min(copy, compute), and the
copies made. Then greedy generation of 16 tokens from llama's decode export on both devices.
The plans are the ones tests/runtime compiles: the mock target, context 64, prompt 8; the
streaming one gives each chiplet 24 KiB of SRAM and the KV cache to LPDDR, so tiles are staged.

Exits 2 with the reason when there is no GPU (and `--device cpu` was not asked for). About a
minute on a GPU machine, most of it exporting and compiling.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ARCHS = ("llama", "gpt2", "bert", "qwen2", "phi3")
STREAM_SRAM_BYTES = 24576
FIGURES = ("copy_ms", "compute_ms", "busy_ms", "wall_ms", "overlap")


def variants(folder: Path) -> dict[str, dict[str, Any]]:
    """Compile options by variant name."""
    target = folder / f"mock-{STREAM_SRAM_BYTES}.toml"
    target.write_text(f'schema_version = 1\nextends = "mock"\nname = "mock-{STREAM_SRAM_BYTES}"\n'
                      f'description = "mock with {STREAM_SRAM_BYTES} bytes of SRAM per chiplet"\n\n'
                      f"[chiplet]\nsram_bytes = {STREAM_SRAM_BYTES}\n")
    return {"fp32": {}, "stream": {"target": str(target), "kv_cache": "lpddr"}, "int4": {"quant": "int4", "group_size": 32}}


def check_plan(result: Any, feeds: dict[str, np.ndarray], device: str, repeats: int) -> dict[str, Any]:
    """One compiled plan on `device` against the sim: the outputs' max abs diff and the figures."""
    from aviatorc.backends.cuda import CudaBackend

    from aviatorc.runtime import Session

    sim = Session(result)
    want = sim.run(feeds)
    got = Session(result, device="cuda").run(feeds) if device == "cuda" else None
    backend = CudaBackend(sim.program, sim.graph, sim.weights, sram_bytes=sim.target.chiplet.sram_bytes, device=device)
    runs = [backend.run(feeds) for _ in range(repeats + 1)][1:]  # the first pays the cold start
    if got is None:
        got = runs[-1][0]
    figures = [counts.extra["cuda"] for _, counts in runs]
    row: dict[str, Any] = {"diff": max(float(np.max(np.abs(got[k] - want[k]))) for k in want)}
    row.update({name: statistics.median(f[name] for f in figures) for name in FIGURES})
    row.update(copies=figures[-1]["copies"], copied_kib=figures[-1]["copied_bytes"] / 1024,
               device_computes=figures[-1]["device_computes"], host_computes=figures[-1]["host_computes"])
    return row


def check_generate(folder: Path, device: str) -> str:
    """Greedy generation from llama's decode export on `device` against the sim's tokens."""
    from aviatorc.backends.cuda import CudaBackend

    import aviatorc
    from aviatorc import zoo
    from aviatorc.runtime import Session

    path = zoo.export_decode_onnx("llama", folder / "llama-decode.onnx")
    result = aviatorc.compile(str(path), target="mock", context=48, prompt=8, time_limit_s=1.0)
    ids = zoo.example_inputs("llama")["input_ids"][0].numpy()
    want = Session(result).generate(ids, 16)
    if device == "cuda":
        got = Session(result, device="cuda").generate(ids, 16)
    else:  # the debug device has no Session switch: swap its backends in (a tool's shortcut)
        session = Session(result)
        session._backends = {phase: CudaBackend(b.program, b.graph, b.weights, sram_bytes=b.sram_bytes, device="cpu")
                             for phase, b in session._backends.items()}
        got = session.generate(ids, 16)
    same = np.array_equal(got, want)
    return f"llama greedy, 16 tokens: {'equal to' if same else 'DIFFERENT from'} the sim's ({got[len(ids):].tolist()})"


def render(rows: list[tuple[str, str, dict[str, Any] | str]], device: str) -> str:
    head = (f"{'model':6} {'plan':6} {'max|cuda-sim|':>13} {'copy ms':>8} {'compute ms':>10} {'busy ms':>8} "
            f"{'wall ms':>8} {'overlap':>7} {'copies':>6} {'copied KiB':>10} {'on device':>9} {'on host':>7}")
    lines = [f"device: {device}", head]
    for arch, variant, row in rows:
        if isinstance(row, str):
            lines.append(f"{arch:6} {variant:6} {row}")
            continue
        lines.append(f"{arch:6} {variant:6} {row['diff']:13.2e} {row['copy_ms']:8.3f} {row['compute_ms']:10.3f} "
                     f"{row['busy_ms']:8.3f} {row['wall_ms']:8.3f} {row['overlap']:7.2f} {row['copies']:6d} "
                     f"{row['copied_kib']:10.1f} {row['device_computes']:9d} {row['host_computes']:7d}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=ARCHS)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: the cuda backend's debug device (same code path, no streams)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    from aviatorc.backends.cuda import cuda_missing

    if args.device == "cuda" and (missing := cuda_missing()):
        print(f"check_cuda: {missing}; run it on a machine with a GPU (or --device cpu for the debug path)",
              file=sys.stderr)
        return 2
    import aviatorc
    from aviatorc import zoo

    rows: list[tuple[str, str, dict[str, Any] | str]] = []
    with tempfile.TemporaryDirectory(prefix="check-cuda-") as tmp:
        folder = Path(tmp)
        options = variants(folder)
        for arch in [args.only] if args.only else ARCHS:
            path = zoo.export_onnx(arch, folder / f"{arch}.onnx", exporter="legacy")
            feeds = {name: t.numpy() for name, t in zoo.example_inputs(arch).items()}
            for variant, extra in options.items():
                try:
                    result = aviatorc.compile(str(path), context=64, prompt=8, time_limit_s=1.0,
                                              **{"target": "mock", **extra})
                except aviatorc.AviatorError as error:  # a plan this target cannot hold: say so, go on
                    rows.append((arch, variant, f"not compiled: {error}"))
                    continue
                rows.append((arch, variant, check_plan(result, feeds, args.device, args.repeats)))
                print(render(rows[-1:], args.device).splitlines()[-1], flush=True)
        generated = check_generate(folder, args.device)
    import torch

    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (debug)"
    print()
    print(render(rows, f"{device}, torch {torch.__version__}"))
    print(generated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
