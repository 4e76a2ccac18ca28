"""aviatorc: an ML compiler for in-memory-compute accelerators."""

from aviatorc.errors import AviatorError

__version__ = "0.1.0"

__all__ = ["AviatorError", "__version__", "import_model"]


def import_model(source, example_inputs=None, **options):  # type: ignore[no-untyped-def]
    """Import a model into the IR: an .onnx path, a config.json path, an nn.Module or a GraphModule."""
    from aviatorc.frontends import import_model as _import_model

    return _import_model(source, example_inputs, **options)
