"""An artifact's compiled graph as one ONNX file, with the weights exactly as the artifact stores them.

    result = export("model.avc", "model.onnx")             # QDQ: blocked DequantizeLinear, opset 21+
    result = export(artifact, "model.onnx", matmul_nbits=True)  # blocked weights as com.microsoft.MatMulNBits

The stages, in order: read every initializer's whole stored array back from the tiles
(`aviatorc.exporter.weights`); refuse the ops with no ONNX mapping (all at once); convert node by
node (`aviatorc.exporter.ops`); build the model (opset: the highest any node needs, 21 at least);
write it into a staging folder beside the output (weights as external data when they pass
`external_data_bytes`), check it there with `onnx.checker.check_model(full_check=True)`, and
rename it into place, data file first. A decoder with a KV cache also gets `genai_config.json`
beside it (`aviatorc.exporter.genai`).

Graph inputs and outputs keep the IR's names and types; a symbolic dim keeps its name
(`dim_param`), an unknown one is left open. FP16 and BF16 initializers (an fp16 embedding
table) stay 16-bit: the graph's own Casts read them, as in the IR.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aviatorc.errors import OptionError
from aviatorc.exporter.genai import genai_config
from aviatorc.exporter.ops import CONVERTERS, MS_DOMAIN, OnnxBuilder, check_supported, plan_matmul_nbits
from aviatorc.exporter.weights import initializer_arrays
from aviatorc.ir import Graph, Value
from aviatorc.plan.artifact import Artifact, check_output_path, load, to_json_bytes, write_file_atomically

# Above this many bytes of initializers, they go to `<model>.data` beside the model: protobuf
# refuses messages of 2 GiB, and a model under 1 GiB is easier to move as one file.
EXTERNAL_DATA_BYTES = 1 << 30
GENAI_CONFIG = "genai_config.json"
SPARSE_NOTE = ("2:4 sparse weights are exported dense-equivalent: the kept codes at their rows and the "
               "pruned ones at the zero point, so they dequantize to exactly 0; the file does not store the 2:4 "
               "indices, and onnxruntime runs them as dense weights")


@dataclass(frozen=True)
class ExportResult:
    """What `export` wrote."""

    path: Path
    data_path: Path | None  # external data, when the weights passed the threshold
    genai_config: Path | None  # beside a decoder with a KV cache
    opset: int
    formats: dict[str, int]  # weight format name -> weights exported in it
    matmul_nbits: int  # MatMuls written as com.microsoft.MatMulNBits
    notes: tuple[str, ...] = field(default=())


def export(artifact: Artifact | str | os.PathLike[str], path: str | os.PathLike[str], *, matmul_nbits: bool = False,
           external_data_bytes: int = EXTERNAL_DATA_BYTES, eos_token_id: int = 0) -> ExportResult:
    """Write `artifact` (an `Artifact` or its directory) as the ONNX file `path`. See the module doc."""
    out = Path(os.path.abspath(path))
    check_output_path(out, directory=False)
    if not isinstance(artifact, Artifact):
        artifact = load(artifact)
    graph = artifact.graph()
    arrays = initializer_arrays(artifact, graph)
    check_supported(graph)
    builder = OnnxBuilder(graph, arrays)
    notes = plan_matmul_nbits(builder) if matmul_nbits else []
    for node in graph.nodes:
        CONVERTERS[node.op](builder, node)
    if any("sp24" in name for name in builder.formats):
        notes.append(SPARSE_NOTE)
    model = _model(graph, builder, artifact, notes)
    external = sum(a.nbytes for a in builder.initializers.values()) > external_data_bytes
    data_path = _write(model, out, external)
    config = genai_config(graph, out.name, artifact.plan.workload.context, eos_token_id=eos_token_id)
    config_path = None
    if config is not None:
        config_path = write_file_atomically(out.parent / GENAI_CONFIG, to_json_bytes(config))
    return ExportResult(out, data_path, config_path, builder.opset, dict(sorted(builder.formats.items())),
                        len(builder.fused), tuple(notes))


def _value_info(value: Value) -> Any:
    from onnx import helper

    from aviatorc.exporter.ops import DTYPE_ENUMS

    shape = [d if isinstance(d, (int, str)) else None for d in value.type.shape]
    return helper.make_tensor_value_info(value.name, DTYPE_ENUMS[value.type.dtype], shape)


def _model(graph: Graph, builder: OnnxBuilder, artifact: Artifact, notes: list[str]) -> Any:
    from onnx import helper, numpy_helper

    from aviatorc import __version__

    initializers = [numpy_helper.from_array(array, name) for name, array in builder.initializers.items()]
    body = helper.make_graph(builder.nodes, graph.name, [_value_info(v) for v in graph.inputs],
                             [_value_info(v) for v in graph.outputs], initializers)
    opsets = [helper.make_opsetid("", builder.opset)]
    if MS_DOMAIN in builder.domains:
        opsets.append(helper.make_opsetid(MS_DOMAIN, 1))
    model = helper.make_model(body, opset_imports=opsets, producer_name="aviatorc", producer_version=__version__)
    metadata = {"aviatorc.target": artifact.plan.target_name,
                "aviatorc.weight_formats": json.dumps(dict(sorted(builder.formats.items())), sort_keys=True),
                "aviatorc.weight_encoding": "matmul_nbits" if builder.fused else "qdq"}
    if notes:
        metadata["aviatorc.notes"] = "; ".join(notes)
    if any(SPARSE_NOTE == note for note in notes):
        metadata["aviatorc.sparsity"] = SPARSE_NOTE
    helper.set_model_props(model, metadata)
    return model


def _write(model: Any, out: Path, external: bool) -> Path | None:
    """Write and check the model in a staging folder beside `out`, then rename it into place."""
    import onnx

    out.parent.mkdir(parents=True, exist_ok=True)
    data_name = f"{out.name}.data"
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        staged = staging / out.name
        if external:  # tensors under 1 KiB (shape constants) stay inline: the checker's shape inference reads them
            onnx.save_model(model, str(staged), save_as_external_data=True, all_tensors_to_one_file=True,
                            location=data_name, size_threshold=1024)
        else:
            staged.write_bytes(model.SerializeToString())
        try:
            onnx.checker.check_model(str(staged), full_check=True)
        except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as error:
            raise OptionError(f"the exported model does not pass onnx.checker: {error}",
                              hint="this is a bug in the exporter; please report it") from None
        if external:
            os.chmod(staging / data_name, 0o644)
            os.replace(staging / data_name, out.parent / data_name)
        os.chmod(staged, 0o644)
        os.replace(staged, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out.parent / data_name if external else None
