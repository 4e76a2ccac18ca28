"""The ONNX frontend: `import_onnx(path)` reads a model file (any opset the installed
`onnx` knows; exporter output of opsets 17-23 is the main target) into a verified IR graph.

Layout: `loader` parses the file and checks external data; `validate` holds every node to
its `onnx.defs` schema; `importer` builds the graph;
`ops` holds the per-op conversion table. onnx is imported only inside these modules.
"""

from aviatorc.frontends.onnx.importer import import_model_proto, import_onnx
from aviatorc.frontends.onnx.ops import CONVERTERS, ONNX_DTYPES, supported_op

__all__ = ["CONVERTERS", "ONNX_DTYPES", "import_model_proto", "import_onnx", "supported_op"]
