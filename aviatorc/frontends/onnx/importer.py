"""ONNX ModelProto -> verified IR Graph.

The import runs as named steps: read the opset, collect every unsupported op before
failing, hold each node to its ONNX schema (`validate.py`), run onnx shape inference (its types are
hints for the dims our type rules cannot know), order the nodes (rejecting cycles and undefined names), add inputs and
initializers, convert each node through the table in `ops.py`, verify, fold constant
shape subgraphs, refine types, verify again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from aviatorc.errors import AviatorError, ModelFormatError, UnsupportedOpsError
from aviatorc.frontends.onnx import ops as onnx_ops
from aviatorc.frontends.onnx import sandbox, validate
from aviatorc.frontends.onnx.loader import external_data, load_model_proto
from aviatorc.ir import Graph, Value, fold_constants, merge_type, verify
from aviatorc.ir.data import ArrayData, ShapeOnly, TensorData
from aviatorc.ir.ops import get_op, infer_types
from aviatorc.ir.types import Dim, TensorType, numpy_dtype

DEFAULT_DOMAINS = ("", "ai.onnx")
SHAPE_ONLY_KEEP_BYTES = 1 << 16  # in shape-only imports, smaller initializers keep their bytes
CONST_PROPAGATE_ELEMENTS = 1 << 16  # values up to this size are evaluated at import when their inputs are known


def import_onnx(path: str | Path, *, shape_only: bool = False, fold: bool = True) -> Graph:
    """Import an ONNX file (and its external data, lazily) into a verified IR graph.

    shape_only: weights above 64 KiB get no bytes (enough to plan, not to run).
    fold: fold shape computations of static shapes into constants.
    """
    path = Path(path)
    try:
        model = load_model_proto(path)
        return import_model_proto(model, base_dir=path.parent, shape_only=shape_only, fold=fold)
    except AviatorError as error:
        raise error.with_file(str(path)) from None


def import_model_proto(model: Any, *, base_dir: Path, shape_only: bool = False, fold: bool = True) -> Graph:
    """Import a parsed ModelProto whose external data (if any) lives under `base_dir`."""
    opset = validate.check_opset(model)
    check_supported(model.graph)
    validate.check_graph_names(model.graph)
    # Schemas before shape inference and before any type rule: both trust the attributes.
    initializers = {t.name: t for t in model.graph.initializer}
    schemas = [validate.check_node(node, opset, node_name(node, i), initializers)
               for i, node in enumerate(model.graph.node)]
    builder = Builder(model, base_dir=base_dir, opset=opset, shape_only=shape_only)
    builder.hints = inferred_types(model)
    builder.add_inputs_and_initializers()
    names = unique_node_names(model.graph)
    for index, proto in ordered_nodes(model.graph):
        builder.convert_node(proto, names[index], schemas[index])
    graph = builder.finish()
    verify(graph)
    if fold:
        output_names = [v.name for v in graph.outputs]
        fold_constants(graph)
        keep_output_names(graph, output_names)
        refine_types(graph)
        verify(graph)
    return graph


# -- steps -------------------------------------------------------------------------------


def check_supported(graph: Any) -> None:
    """Raise one UnsupportedOpsError listing every unsupported op type, its count and first node."""
    found: dict[str, tuple[int, str]] = {}
    for index, node in enumerate(graph.node):
        key = node.op_type if node.domain in DEFAULT_DOMAINS else f"{node.domain}::{node.op_type}"
        if node.domain in DEFAULT_DOMAINS and onnx_ops.supported_op(node.op_type):
            continue
        count, first = found.get(key, (0, node_name(node, index)))
        found[key] = (count + 1, first)
    if found:
        raise UnsupportedOpsError(found)


def node_name(node: Any, index: int) -> str:
    """The ONNX node name, or a deterministic one made from its position and op."""
    return node.name or f"{node.op_type}_{index}"


def unique_node_names(graph: Any) -> list[str]:
    """Each node's name, made unique: ONNX allows a name on several nodes (exporters that name
    nodes by module give a biased Linear's MatMul and Add one name), but the IR's node names
    identify nodes in the plan. The first keeps its name, a later one gets `name#<index>`."""
    names = [node_name(node, index) for index, node in enumerate(graph.node)]
    taken = set(names)
    seen: set[str] = set()
    for index, name in enumerate(names):
        if name in seen:
            unique = f"{name}#{index}"
            while unique in taken:
                unique += "_"
            names[index] = unique
            taken.add(unique)
        seen.add(names[index])
    return names


def ordered_nodes(graph: Any) -> list[tuple[int, Any]]:
    """The nodes in a topological order; names must be defined once, and no cycles."""
    defined: dict[str, str] = {}
    for value in list(graph.input) + list(graph.initializer):
        defined.setdefault(value.name, "graph")
    producer: dict[str, int] = {}
    for index, node in enumerate(graph.node):
        for out in node.output:
            if not out:
                continue
            if out in producer or (out in defined and out not in producer):
                raise ModelFormatError(f"value '{out}' is defined twice", node=node_name(node, index), op=node.op_type)
            producer[out] = index
    for index, node in enumerate(graph.node):
        for name in node.input:
            if name and name not in producer and name not in defined:
                raise ModelFormatError(
                    f"input '{name}' is not defined (no graph input, initializer or node output)",
                    node=node_name(node, index),
                    op=node.op_type,
                    hint="the model is missing an initializer or is corrupt",
                )
    for out in graph.output:
        if out.name not in producer and out.name not in defined:
            raise ModelFormatError(f"graph output '{out.name}' is not defined")
    # Kahn's algorithm, stable: ties keep the file's order.
    import heapq

    pending = [0] * len(graph.node)
    users: dict[int, list[int]] = {}
    for index, node in enumerate(graph.node):
        deps = {producer[n] for n in node.input if n in producer}
        pending[index] = len(deps)
        for dep in deps:
            users.setdefault(dep, []).append(index)
    ready = [i for i, count in enumerate(pending) if count == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        index = heapq.heappop(ready)
        order.append(index)
        for user in users.get(index, []):
            pending[user] -= 1
            if pending[user] == 0:
                heapq.heappush(ready, user)
    if len(order) != len(graph.node):
        stuck = [i for i, count in enumerate(pending) if count > 0]
        first = graph.node[stuck[0]]
        raise ModelFormatError(
            f"the graph has a cycle through {len(stuck)} node(s)", node=node_name(first, stuck[0]), op=first.op_type
        )
    return [(i, graph.node[i]) for i in order]


def inferred_types(model: Any) -> dict[str, TensorType | None]:
    """Value types from onnx shape inference (with data propagation); empty when it fails.

    Inference runs in a forked child (`sandbox.py`): on some malformed models onnx's native
    code aborts the process instead of raising."""
    import onnx

    def infer() -> bytes:
        for data_prop in (True, False):
            try:
                inferred = onnx.shape_inference.infer_shapes(
                    model, check_type=False, strict_mode=False, data_prop=data_prop
                )
            except Exception:  # noqa: BLE001 - inference is only a source of hints
                continue
            found = onnx.GraphProto()
            found.value_info.extend(inferred.graph.value_info)
            found.value_info.extend(inferred.graph.output)
            return bytes(found.SerializeToString())
        return b""

    data = sandbox.run_in_child(infer)
    if not data:
        return {}
    found = onnx.GraphProto()
    found.ParseFromString(data)
    hints: dict[str, TensorType | None] = {}
    for info in found.value_info:
        try:
            hints[info.name] = type_from_proto(info.type, info.name)
        except ModelFormatError:
            hints[info.name] = None
    return hints


def type_from_proto(type_proto: Any, name: str) -> TensorType | None:
    """The TensorType of an ONNX TypeProto; None when it has no shape. Raises on bad dims."""
    if type_proto.WhichOneof("value") != "tensor_type":
        kind = type_proto.WhichOneof("value") or "untyped"
        raise ModelFormatError(f"value '{name}' is a {kind.replace('_type', '')}, only tensors are supported")
    tensor = type_proto.tensor_type
    dtype = onnx_ops.ir_dtype(tensor.elem_type, f"value '{name}'")
    if not tensor.HasField("shape"):
        return None
    dims: list[Dim] = []
    for dim in tensor.shape.dim:
        if dim.HasField("dim_value"):
            dims.append(int(dim.dim_value))
        elif dim.HasField("dim_param") and dim.dim_param:
            dims.append(str(dim.dim_param))
        else:
            dims.append(None)
    return checked_type(dtype, dims, f"value '{name}'")


def checked_type(dtype: str, dims: list[Dim], what: str) -> TensorType:
    try:
        return TensorType(dtype, tuple(dims))
    except ModelFormatError as error:
        raise ModelFormatError(f"{what}: {error.message}", hint=error.hint) from None


def keep_output_names(graph: Graph, names: list[str]) -> None:
    """Folding replaces an output by a fresh constant: give the model's output name back."""
    for index, (value, name) in enumerate(zip(list(graph.outputs), names, strict=False)):
        if value.name != name:
            node = graph.add_node("Identity", [value], [value.type], name=name, output_names=[name])
            graph.outputs[index] = node.outputs[0]


def refine_types(graph: Graph) -> None:
    """After folding, rules see constant shape operands: fill dims they now know."""
    for node in graph.nodes:
        try:
            inferred = infer_types(
                node.op,
                [v.type if v is not None else None for v in node.inputs],
                [v.const_value() if v is not None and _small_const(v) else None for v in node.inputs],
                node.attrs,
                len(node.outputs),
                node.name,
            )
        except AviatorError:
            continue
        for value, rule in zip(node.outputs, inferred, strict=False):
            if rule.dtype != value.type.dtype or rule.rank != value.type.rank:
                continue
            dims = tuple(
                r if (c is None or isinstance(c, str)) and isinstance(r, int) else c
                for c, r in zip(value.type.shape, rule.shape, strict=False)
            )
            if dims != value.type.shape:
                value.type = TensorType(value.type.dtype, dims)


def _small_const(value: Value) -> bool:
    return (
        value.data is not None
        and isinstance(value.data, ArrayData)
        and value.type.is_static
        and value.type.numel() <= 1 << 16
    )


# -- the builder -------------------------------------------------------------------------


class Builder:
    """Import state: the graph being built and the ONNX name -> IR value map."""

    def __init__(self, model: Any, *, base_dir: Path, opset: int, shape_only: bool) -> None:
        self.model = model
        self.base_dir = base_dir
        self.opset = opset
        self.shape_only = shape_only
        self.graph = Graph(model.graph.name or "main")
        self.values: dict[str, Value] = {}
        self.known: dict[int, np.ndarray] = {}  # id(value) -> array of small values computable at import
        self.hints: dict[str, TensorType | None] = {}
        self.onnx_names = {v.name for v in list(model.graph.input) + list(model.graph.initializer)}
        for node in model.graph.node:
            self.onnx_names.update(n for n in node.output if n)

    # -- names and values ------------------------------------------------------------------

    def fresh(self, base: str) -> str:
        """A value name used neither in the graph nor anywhere in the ONNX model."""
        name = self.graph.unique_name(base)
        while name in self.onnx_names:
            name = self.graph.unique_name(base + "_")
        return name

    def const_of(self, value: Value | None) -> np.ndarray | None:
        """The array of a small initializer, or of a node output computed from constants at import."""
        if value is None:
            return None
        if id(value) in self.known:
            return self.known[id(value)]
        if (
            isinstance(value.data, ArrayData)
            and value.type.is_static
            and value.type.numel() <= CONST_PROPAGATE_ELEMENTS
        ):
            return value.data.array
        return None

    def constant(self, array: np.ndarray, base: str) -> Value:
        return self.graph.add_constant(array, name=self.fresh(base))

    def named_constant(self, array: np.ndarray, name: str) -> Value:
        value = self.graph.add_constant(array, name=name)
        if value.name != name:
            raise ModelFormatError(f"value name '{name}' is defined twice")
        self.values[name] = value
        return value

    def initializer(self, type: TensorType, data: TensorData, base: str) -> Value:
        return self.graph.add_initializer(self.fresh(base), type, data)

    # -- inputs and initializers -------------------------------------------------------------

    def add_inputs_and_initializers(self) -> None:
        graph_proto = self.model.graph
        for tensor in graph_proto.initializer:
            type = checked_type(
                onnx_ops.ir_dtype(tensor.data_type, f"initializer '{tensor.name}'"),
                [int(d) for d in tensor.dims],
                f"initializer '{tensor.name}'",
            )
            value = self.graph.add_initializer(tensor.name, type, self.tensor_data(tensor, type))
            self.values[tensor.name] = value
        for info in graph_proto.input:
            if info.name in self.values:
                continue  # an initializer listed as an input (IR version < 4): a weight
            input_type = type_from_proto(info.type, info.name)
            if input_type is None:
                raise ModelFormatError(
                    f"graph input '{info.name}' has no shape",
                    hint="export with input shapes (dynamic dims may be named)",
                )
            self.values[info.name] = self.graph.add_input(info.name, input_type)

    def tensor_data(self, tensor: Any, type: TensorType) -> TensorData:
        """Lazy external bytes, or inline bytes as an array (shape-only: large ones dropped)."""
        if tensor.data_location == 1:  # TensorProto.EXTERNAL
            data = external_data(self.base_dir, tensor, type)
            if self.shape_only and not isinstance(data, ArrayData):
                return ShapeOnly()
            return data
        if self.shape_only and type.nbytes() > SHAPE_ONLY_KEEP_BYTES:
            return ShapeOnly()
        return ArrayData(self.tensor_array(tensor, f"initializer '{tensor.name}'", type))

    def tensor_array(self, tensor: Any, what: str, type: TensorType | None = None) -> np.ndarray:
        """The array of an inline TensorProto, its size checked before anything is allocated."""
        from onnx import numpy_helper

        if type is None:
            type = checked_type(onnx_ops.ir_dtype(tensor.data_type, what), [int(d) for d in tensor.dims], what)
        if tensor.data_location == 1:
            data = external_data(self.base_dir, tensor, type)
            return data.load()
        numel = type.numel()
        if tensor.HasField("raw_data"):
            if len(tensor.raw_data) != type.nbytes():
                raise ModelFormatError(
                    f"{what} is {type} ({type.nbytes()} bytes) but holds {len(tensor.raw_data)} bytes"
                )
        else:
            count = max(
                len(tensor.float_data),
                len(tensor.int32_data),
                len(tensor.int64_data),
                len(tensor.double_data),
                len(tensor.uint64_data),
            )
            if count != numel:
                raise ModelFormatError(f"{what} is {type} ({numel} elements) but holds {count} values")
        try:
            array = numpy_helper.to_array(tensor)
        except Exception as error:  # noqa: BLE001 - a malformed tensor is a format error
            raise ModelFormatError(f"{what} cannot be decoded: {error}") from None
        array = np.asarray(array)
        if array.dtype != numpy_dtype(type.dtype):
            array = (
                array.view(numpy_dtype(type.dtype))
                if array.dtype.itemsize == numpy_dtype(type.dtype).itemsize
                else array.astype(numpy_dtype(type.dtype))
            )
        return array.reshape(type.shape)  # type: ignore[arg-type]

    # -- nodes ---------------------------------------------------------------------------

    def convert_node(self, proto: Any, name: str, schema: Any) -> None:
        import onnx

        attrs = {}
        for attr in proto.attribute:
            value = onnx.helper.get_attribute_value(attr)
            if isinstance(value, bytes):
                value = value.decode("utf-8", "replace")
            elif isinstance(value, list):
                value = tuple(v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in value)
            attrs[attr.name] = value
        ctx = onnx_ops.NodeContext(self, proto, name, attrs, self.opset)
        inputs = ctx.inputs()
        validate.check_input_types(proto, schema, [v.type.dtype if v is not None else None for v in inputs], name)
        if inputs and inputs[0] is not None:
            validate.check_axes(proto, attrs, inputs[0].type.rank, name)
        try:
            outputs = onnx_ops.convert(ctx)
        except AviatorError as error:
            if error.node is None:
                error.node, error.op = name, proto.op_type
                error.args = (str(error),)
            raise
        for onnx_name, value in zip(proto.output, outputs, strict=False):
            if onnx_name:
                self.values[onnx_name] = value

    def emit(
        self,
        ctx: onnx_ops.NodeContext,
        op: str,
        inputs: list[Value | None],
        attrs: dict[str, Any],
        *,
        final: bool,
        num_outputs: int,
        suffix: str,
        output_index: int = 0,
    ) -> list[Value]:
        if final:
            onnx_outs = list(ctx.proto.output[output_index : output_index + num_outputs])
            names = [n if n else self.fresh(f"{ctx.name}/unused{i}") for i, n in enumerate(onnx_outs)]
            names += [self.fresh(f"{ctx.name}/out{i}") for i in range(len(names), num_outputs)]
            hints = [self.hints.get(n) for n in onnx_outs]
            # The ONNX node's name; a second node making its later outputs (Dropout's mask) is suffixed.
            node_name = ctx.name if output_index == 0 else self.fresh(f"{ctx.name}/{suffix}")
        else:
            names = [self.fresh(f"{ctx.name}/{suffix}")] + [
                self.fresh(f"{ctx.name}/{suffix}{i}") for i in range(1, num_outputs)
            ]
            hints = []
            node_name = names[0]  # `ctx.name/suffix`, made unique: one ONNX node may emit a suffix twice
        consts = [self.const_of(v) for v in inputs]
        types = infer_types(
            op, [v.type if v is not None else None for v in inputs], consts, attrs, num_outputs, node_name
        )[:num_outputs]
        types = [merge_type(t, hints[i] if i < len(hints) else None) for i, t in enumerate(types)]
        node = self.graph.add_node(op, inputs, types, attrs, name=node_name, output_names=names)
        self.propagate(node, consts)
        return node.outputs

    def propagate(self, node: Any, consts: list[np.ndarray | None]) -> None:
        """Evaluate a node whose inputs are known, so shape operands computed from constants
        (axes, reshape targets) are known to later rules even when folding is off."""
        if any(not v.type.is_static or v.type.numel() > CONST_PROPAGATE_ELEMENTS for v in node.outputs):
            return
        x = node.inputs[0] if node.inputs else None
        if node.op in ("Shape", "Size") and x is not None and x.type.is_static:
            ins: list[Any] = [np.zeros(x.type.shape, np.int8)]  # only the shape is read
        elif all(c is not None or v is None for c, v in zip(consts, node.inputs, strict=False)):
            ins = list(consts)
        else:
            return
        opdef = get_op(node.op)
        attrs = opdef.resolve_attrs(node.attrs, node.name)
        attrs["_num_outputs"] = len(node.outputs)
        try:
            with np.errstate(all="ignore"):
                outs = opdef.kernel(ins, attrs)
        except Exception:  # noqa: BLE001 - a kernel failing here fails again, with context, at run time
            return
        for value, array in zip(node.outputs, outs, strict=False):
            array = np.asarray(array)
            if array.dtype == numpy_dtype(value.type.dtype) and tuple(array.shape) == value.type.shape:
                self.known[id(value)] = array

    def finish(self) -> Graph:
        self.graph.outputs = [self.values[out.name] for out in self.model.graph.output]
        for value in list(self.graph.initializers.values()):
            if not value.users and value not in self.graph.outputs:
                self.graph.remove_initializer(value)  # unused weights (or replaced by a transposed copy)
        return self.graph
