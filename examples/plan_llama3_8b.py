"""Plan Llama-3-8B on Corsair from its config.json alone (shape-only: no weights needed).

    python examples/plan_llama3_8b.py --cards 4 --quant int4

Compiles examples/llama3-8b/config.json (Meta-Llama-3-8B's, as Hugging Face ships it): import
on the meta device, INT4 byte accounting, and the placement of every weight tile on the chiplets' SRAM
(resident) or LPDDR (streamed). Try --cards 1 to see the model stream.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import aviatorc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cards", type=int, default=4)
    parser.add_argument("--quant", default="int4", choices=["int8", "int4", "mxint8", "mxint4"])
    parser.add_argument("--out", default="out/llama-3-8b.avc")
    args = parser.parse_args()

    config_path = Path(__file__).resolve().parent / "llama3-8b" / "config.json"
    art = aviatorc.compile(config_path, target="corsair", cards=args.cards, quant=args.quant, log=print)
    print(art.report.summary())
    print(f"saved {art.save(args.out)}")


if __name__ == "__main__":
    main()
