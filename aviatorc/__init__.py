"""aviatorc: an ML compiler for in-memory-compute accelerators.

    import aviatorc
    graph = aviatorc.import_model("model.onnx")
    art = aviatorc.compile("model.onnx", target="corsair", quant="int8")
    art.save("build/model.avc")

The top level imports nothing heavy: torch, onnx and OR-tools load when a stage needs them.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from aviatorc.errors import AviatorError

# In a checkout, passes/ and backends/ sit beside this folder (pyproject maps them in as
# aviatorc.passes and aviatorc.backends when it installs). Imported from the checkout itself, as
# `python` run in its root does even after a user install, this folder shadows the installed
# package: the checkout's root joins the search path so that they import here as installed.
_checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not os.path.isdir(os.path.join(__path__[0], "passes")) and os.path.isfile(
        os.path.join(_checkout, "passes", "__init__.py")):
    __path__.append(_checkout)
del _checkout

if TYPE_CHECKING:
    from aviatorc.compiler import CompileResult
    from aviatorc.exporter import ExportResult
    from aviatorc.ir import Graph
    from aviatorc.plan.artifact import Artifact
    from aviatorc.runtime import Session

__version__ = "0.1.0"

__all__ = ["AviatorError", "Session", "__version__", "compile", "export", "import_model", "load"]


def import_model(source: Any, example_inputs: Any = None, **options: Any) -> Graph:
    """Import a model into a verified IR graph: an .onnx path, a config.json path, an nn.Module
    (with example inputs) or a torch.fx GraphModule. See `aviatorc.frontends.import_model`."""
    from aviatorc.frontends import import_model as _import_model

    return _import_model(source, example_inputs, **options)


def compile(source: Any, example_inputs: Any = None, **options: Any) -> CompileResult:  # noqa: A001
    """Import, transform and place a model. See `aviatorc.compiler.compile` for the options."""
    from aviatorc.compiler import compile as _compile

    return _compile(source, example_inputs, **options)


def load(path: Any) -> Artifact:
    """Open a compiled artifact directory, checking its version, hashes and references.
    See `aviatorc.plan.artifact`."""
    from aviatorc.plan.artifact import load as _load

    return _load(path)


def export(artifact: Any, path: Any, *, matmul_nbits: bool = False, **options: Any) -> ExportResult:
    """Write a compiled artifact (an `Artifact` or its directory) as a standard ONNX file with its exact
    quantized weights: QDQ, or blocked weights as MatMulNBits. See `aviatorc.exporter` and docs/export.md."""
    from aviatorc.exporter import export as _export

    return _export(artifact, path, matmul_nbits=matmul_nbits, **options)


def __getattr__(name: str) -> Any:
    # `aviatorc.Session` loads the runtime on first use: importing aviatorc stays light.
    if name == "Session":
        from aviatorc.runtime import Session

        return Session
    raise AttributeError(f"module 'aviatorc' has no attribute '{name}'")
