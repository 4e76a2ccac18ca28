"""Compile a small Llama from PyTorch in a training-to-deploy pipeline: INT4 weights with GPTQ
calibration, placed on a 4-card Corsair server, saved as an artifact directory.

    python examples/compile_llama.py --out out/llama-int4.avc

The model is a tiny Llama with grouped-query attention and random weights (no download);
swap in your own `nn.Module` and a few batches of real inputs.
"""

from __future__ import annotations

import argparse

import aviatorc
from aviatorc import zoo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/llama-int4.avc")
    parser.add_argument("--quant", default="int4", choices=["int8", "int4", "mxint8", "mxint4"])
    args = parser.parse_args()

    model = zoo.build_model("llama")  # any torch.nn.Module
    example = zoo.example_inputs("llama")  # keyword inputs for torch.export
    calibration = [{k: v.numpy() for k, v in zoo.example_inputs("llama", seed=s).items()} for s in range(4)]

    art = aviatorc.compile(model, example, target="corsair", cards=4, quant=args.quant,
                           calibration=calibration, log=print)
    print(art.report.summary())
    print(f"saved {art.save(args.out)}")


if __name__ == "__main__":
    main()
