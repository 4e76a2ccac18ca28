"""Export a tiny zoo model (random, seeded weights) to ONNX.

python examples/export_zoo.py --arch llama --out out/llama.onnx
python examples/export_zoo.py --arch gpt2 --out out/gpt2.onnx --exporter legacy
python examples/export_zoo.py --arch llama --out out/llama-decode.onnx --decode

Needs `pip install 'aviatorc[examples]'` (onnxscript, for torch.onnx's exporter).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aviatorc import zoo  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Export a tiny zoo model to ONNX.")
    parser.add_argument("--arch", required=True, choices=zoo.ZOO_ARCHS)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--exporter", choices=("dynamo", "legacy"), default="dynamo")
    parser.add_argument("--opset", type=int, default=None, help="default: 18 dynamo, 17 legacy")
    parser.add_argument("--dynamic", action="store_true", help="dynamic batch and seq axes")
    parser.add_argument("--decode", action="store_true", help="one decode step with a KV cache")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.decode or args.exporter == "dynamo":  # torch.onnx's dynamo exporter needs onnxscript
        from aviatorc.errors import AviatorError
        from aviatorc.extras import require

        try:
            require("examples", "exporting to ONNX")
        except AviatorError as error:
            print(f"export_zoo: error: {error}", file=sys.stderr)
            return 1

    if args.decode:
        path = zoo.export_decode_onnx(args.arch, args.out, opset=args.opset or 18, seed=args.seed)
    else:
        path = zoo.export_onnx(
            args.arch,
            args.out,
            exporter=args.exporter,
            opset=args.opset,
            dynamic=args.dynamic,
            seed=args.seed,
        )
    print(f"wrote {path} (checked with onnx.checker full_check)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
