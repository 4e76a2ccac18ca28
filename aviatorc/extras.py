"""Optional dependencies: which pip extra brings which package, and one error when one is missing.

    require("gguf", "reading a GGUF file")   # OptionError: ... pip install 'aviatorc[gguf]'

`pyproject.toml`'s `[project.optional-dependencies]` lists the same packages (a test holds the
two together), so the error names the extra that really installs what is missing.
"""

from __future__ import annotations

import importlib.util

from aviatorc.errors import OptionError

# extra -> (import name, distribution name) of each package it adds for a command.
EXTRAS: dict[str, tuple[tuple[str, str], ...]] = {
    # `aviatorc serve`: an ASGI stack, SSE, Prometheus metrics and grammar masks for structured outputs.
    "serve": (("fastapi", "fastapi"), ("uvicorn", "uvicorn"), ("sse_starlette", "sse-starlette"),
              ("prometheus_client", "prometheus-client"), ("llguidance", "llguidance")),
    # .gguf models: transformers' GGUF reader needs both.
    "gguf": (("gguf", "gguf"), ("accelerate", "accelerate")),
    # examples/export_zoo.py and `aviatorc.zoo.export_onnx`: torch.onnx's exporter needs onnxscript.
    "examples": (("onnxscript", "onnxscript"),),
}


def missing(extra: str) -> list[str]:
    """The distributions of `extra` that are not installed."""
    return [dist for module, dist in EXTRAS[extra] if importlib.util.find_spec(module) is None]


def require(extra: str, what: str) -> None:
    """Raise an OptionError naming the extra to install when a package of `extra` is missing."""
    absent = missing(extra)
    if absent:
        raise OptionError(f"{what} needs the {' and '.join(absent)} package{'s' if len(absent) > 1 else ''}",
                          hint=f"pip install 'aviatorc[{extra}]' (from a checkout: pip install '.[{extra}]')")
