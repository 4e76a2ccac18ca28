"""Export a compiled artifact for onnxruntime-based stacks: standard ONNX with the artifact's exact weights.

    from aviatorc.exporter import export
    export("model.avc", "model.onnx")                      # weights as QDQ (DequantizeLinear)
    export("model.avc", "model.onnx", matmul_nbits=True)   # 4-bit weights as com.microsoft.MatMulNBits

Layout: `weights` reads each initializer's whole stored array back from the artifact's tiles;
`quant` turns packed weights into ONNX codes, scales and zero points; `ops` is the IR -> ONNX
table; `genai` writes `genai_config.json` for decoders with a KV cache; `writer` puts them
together and writes the file atomically. onnx is imported inside functions only. docs/export.md
has the user's view.
"""

from aviatorc.exporter.ops import CONVERTERS, ExportError
from aviatorc.exporter.writer import EXTERNAL_DATA_BYTES, ExportResult, export

__all__ = ["CONVERTERS", "EXTERNAL_DATA_BYTES", "ExportError", "ExportResult", "export"]
