"""Schema checks of an ONNX model, before any type rule sees a node.

The type rules in `aviatorc.ir.ops` trust their attributes and operands to be what the
ONNX spec says they are (an int axis, int indices). A well-formed protobuf does not
promise that, so the importer first holds every node to the schema of the model's
declared opset, as `onnx.defs` knows it (no second, hand-written table):

- the opset is one the installed `onnx` knows, declared once;
- each node's op exists at that opset; its input and output counts are in the schema's
  range and no required input is empty;
- each attribute is one the schema defines, with the schema's attribute type (an
  UNDEFINED or mistyped attribute is refused), given once; required ones are present;
- each input's element type is one its type constraint allows, and inputs that share a
  type variable share an element type (run per node, once its inputs' types are known).

Then a few checks of meaning that no schema states: axes inside the input's rank, a
permutation that is one, Constant with exactly one value, finite float attributes, and
graph-level names (a graph input listed twice, an initializer re-declared as an input of
another type). Split's sizes are checked by its converter, which computes them.
"""

from __future__ import annotations

import math
from typing import Any

from aviatorc.errors import ModelFormatError
from aviatorc.frontends.onnx.ops import ONNX_DTYPES

DEFAULT_DOMAINS = ("", "ai.onnx")
CONSTANT_VALUE_ATTRS = ("value", "value_float", "value_floats", "value_int", "value_ints", "value_string",
                        "value_strings", "sparse_value")


def printable(text: str, limit: int = 120) -> str:
    """`text` with control characters escaped and cut to `limit` characters, for messages."""
    escaped = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
    return escaped if len(escaped) <= limit else escaped[: limit - 3] + "..."


# -- the opset -------------------------------------------------------------------------


def check_opset(model: Any) -> int:
    """The default-domain opset: declared once, and known to the installed onnx."""
    import onnx

    versions = [int(entry.version) for entry in model.opset_import if entry.domain in DEFAULT_DOMAINS]
    if not versions:
        raise ModelFormatError("the model imports no default-domain (ai.onnx) opset")
    if len(set(versions)) > 1:
        raise ModelFormatError(f"the model imports the ai.onnx opset {len(versions)} times "
                               f"({', '.join(map(str, versions))})", hint="declare one opset version")
    newest = onnx.defs.onnx_opset_version()
    version = versions[0]
    if not 1 <= version <= newest:
        raise ModelFormatError(f"opset {version} is not an ONNX opset (onnx {onnx.__version__} knows 1 to {newest})",
                               opset=version)
    return version


# -- nodes: schema ---------------------------------------------------------------------


def node_schema(node: Any, opset: int, name: str) -> Any:
    """The `OpSchema` of a default-domain node at `opset`; an error when the op is not defined there."""
    import onnx

    try:
        schema = onnx.defs.get_schema(node.op_type, opset, "")
    except onnx.defs.SchemaError:
        hint = None
        try:
            first = onnx.defs.get_schema(node.op_type, onnx.defs.onnx_opset_version(), "").since_version
            hint = f"{node.op_type} was added in opset {first}; the model declares {opset}"
        except onnx.defs.SchemaError:
            hint = "it is not an ai.onnx op"
        raise ModelFormatError(f"{node.op_type} is not defined in ai.onnx opset {opset}", node=name,
                               op=node.op_type, opset=opset, hint=hint) from None
    if schema.deprecated:
        raise ModelFormatError(f"{node.op_type} is deprecated at opset {opset}", node=name, op=node.op_type)
    return schema


def check_node(node: Any, opset: int, name: str, initializers: dict[str, Any] | None = None) -> Any:
    """Hold a node's arity and attributes to its schema; returns the schema."""
    schema = node_schema(node, opset, name)
    check_arity(node, schema, name)
    check_attributes(node, schema, opset, name)
    check_attribute_values(node, name)
    if node.op_type == "Split":
        check_split_count(node, name, initializers or {})
    return schema


def check_split_count(node: Any, name: str, initializers: dict[str, Any]) -> None:
    """Split's part count (num_outputs, or the length of its sizes) must equal its outputs.

    Checked before onnx shape inference, which aborts the process (a C++ assertion, no
    exception) on a Split with more outputs than num_outputs."""
    outputs = len(node.output)
    attrs = {attr.name: attr for attr in node.attribute}
    count = None
    if "num_outputs" in attrs:
        count = attrs["num_outputs"].i
    elif "split" in attrs:
        count = len(attrs["split"].ints)
    elif len(node.input) > 1 and node.input[1] in initializers:
        dims = list(initializers[node.input[1]].dims)
        count = dims[0] if len(dims) == 1 else None
    if count is not None and count != outputs:
        raise ModelFormatError(f"Split into {count} part(s) but the node has {outputs} output(s)", node=name,
                               op="Split", hint="num_outputs (or the number of sizes) must equal the outputs")


def check_arity(node: Any, schema: Any, name: str) -> None:
    import onnx

    def refuse(message: str) -> ModelFormatError:
        return ModelFormatError(message, node=name, op=node.op_type)

    single = onnx.defs.OpSchema.FormalParameterOption.Single
    for index, param in enumerate(schema.inputs):
        if param.option == single and (index >= len(node.input) or not node.input[index]):
            raise refuse(f"required input {index} is missing ('{param.name}')")
    inputs = list(node.input)
    while inputs and not inputs[-1]:
        inputs.pop()  # trailing optional inputs may be given as empty names
    if not schema.min_input <= len(inputs) <= schema.max_input:
        raise refuse(f"has {len(inputs)} input(s); {node.op_type} takes {_range(schema.min_input, schema.max_input)}")
    if not schema.min_output <= len(node.output) <= schema.max_output:
        raise refuse(f"has {len(node.output)} output(s); {node.op_type} gives "
                     f"{_range(schema.min_output, schema.max_output)}")


def _range(low: int, high: int) -> str:
    if low == high:
        return str(low)
    return f"{low} or more" if high >= 1 << 30 else f"{low} to {high}"


def check_attributes(node: Any, schema: Any, opset: int, name: str) -> None:
    """Each attribute defined by the schema, of its type, given once; required ones present."""
    import onnx

    kinds = onnx.AttributeProto.AttributeType
    seen: set[str] = set()
    for attr in node.attribute:
        label = printable(attr.name, 60)

        def refuse(message: str, hint: str | None = None, label: str = label) -> ModelFormatError:
            return ModelFormatError(message, node=name, op=node.op_type, attribute=label, hint=hint)

        if attr.name in seen:
            raise refuse(f"attribute '{label}' is given twice")
        seen.add(attr.name)
        if attr.ref_attr_name:
            raise refuse(f"attribute '{label}' refers to a function attribute ('{printable(attr.ref_attr_name)}') "
                         "outside a function")
        if attr.name not in schema.attributes:
            known = ", ".join(sorted(schema.attributes)) or "none"
            raise refuse(f"attribute '{label}' is not defined for {node.op_type} at opset {opset}",
                         hint=f"its attributes: {known}")
        expected = schema.attributes[attr.name].type
        if attr.type != expected:
            got = kinds.Name(attr.type) if attr.type in kinds.values() else str(attr.type)
            raise refuse(f"attribute '{label}' is {got}, but {node.op_type} (opset {opset}) takes {kinds.Name(expected)}")
    for key, spec in schema.attributes.items():
        if spec.required and key not in seen:
            raise ModelFormatError(f"required attribute '{key}' is missing", node=name, op=node.op_type,
                                   attribute=key)


def check_attribute_values(node: Any, name: str) -> None:
    """What the schema leaves unsaid: one value for Constant; finite floats elsewhere."""
    present = [attr.name for attr in node.attribute]
    if node.op_type == "Constant":
        values = [key for key in present if key in CONSTANT_VALUE_ATTRS]
        if len(values) != 1:
            raise ModelFormatError(f"Constant needs exactly one value attribute, got {len(values)}"
                                   + (f" ({', '.join(values)})" if values else ""), node=name, op="Constant")
        return  # a constant's float value may be inf or NaN (masks)
    for attr in node.attribute:
        floats = [attr.f] if attr.type == 1 else list(attr.floats) if attr.type == 6 else []  # FLOAT, FLOATS
        if any(not math.isfinite(v) for v in floats):
            raise ModelFormatError(f"attribute '{printable(attr.name, 60)}' is not finite ({floats})", node=name,
                                   op=node.op_type, attribute=attr.name)


# -- nodes: operand types, once they are known --------------------------------------------


def onnx_type_str(dtype: str) -> str:
    """The schema's spelling of an IR element type: float32 -> 'tensor(float)'."""
    import onnx

    enum = next(code for code, name in ONNX_DTYPES.items() if name == dtype)
    return f"tensor({onnx.TensorProto.DataType.Name(enum).lower()})"


def check_input_types(node: Any, schema: Any, dtypes: list[str | None], name: str) -> None:
    """Each present input's element type is allowed by its type constraint, and inputs bound
    to one type variable agree. `dtypes[i]` is the IR element type of input i (None: omitted)."""
    import onnx

    variadic = onnx.defs.OpSchema.FormalParameterOption.Variadic
    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    bound: dict[str, tuple[str, int]] = {}
    formals = list(schema.inputs)
    for index, dtype in enumerate(dtypes):
        if dtype is None or not formals:
            continue
        param = formals[min(index, len(formals) - 1)]
        if index >= len(formals) and param.option != variadic:
            continue  # arity was checked before
        type_str = onnx_type_str(dtype)
        permitted = allowed.get(param.type_str, {param.type_str})
        if type_str not in permitted:
            names = ", ".join(sorted(t[len("tensor("):-1] for t in permitted if t.startswith("tensor(")))
            raise ModelFormatError(f"input {index} ('{param.name}') is {dtype}, which {node.op_type} does not take "
                                   f"there", node=name, op=node.op_type, hint=f"allowed: {names}")
        if param.type_str in allowed and (param.option != variadic or param.is_homogeneous):
            first = bound.setdefault(param.type_str, (dtype, index))
            if first[0] != dtype:
                raise ModelFormatError(f"mismatched element types {[first[0], dtype]} for inputs {first[1]} and "
                                       f"{index}, which share the type {param.type_str}", node=name,
                                       op=node.op_type)


def check_axes(node: Any, attrs: dict[str, Any], rank: int, name: str) -> None:
    """Axis attributes inside the rank of input 0; a perm that is a permutation of it."""

    def refuse(message: str) -> ModelFormatError:
        return ModelFormatError(message, node=name, op=node.op_type)

    # Flatten's axis may equal the rank (everything in the outer dim); Unsqueeze's axes
    # (an attribute before opset 13) index the output, whose rank the rule checks.
    high = rank + 1 if node.op_type == "Flatten" else rank
    if "axis" in attrs:
        axis = attrs["axis"]
        if not -rank <= axis < max(high, 1):
            raise refuse(f"axis {axis} is out of range for an input of rank {rank}")
    if "axes" in attrs and node.op_type != "Unsqueeze":
        for axis in attrs["axes"]:
            if not -rank <= axis < max(rank, 1):
                raise refuse(f"axes entry {axis} is out of range for an input of rank {rank}")
    if node.op_type == "Transpose" and "perm" in attrs:
        perm = tuple(attrs["perm"])
        if sorted(perm) != list(range(rank)):
            raise refuse(f"perm {list(perm)} is not a permutation of the {rank} axes of its input")


# -- the graph ---------------------------------------------------------------------------


def check_graph_names(graph: Any) -> None:
    """Graph inputs and initializers named once; an initializer re-declared as an input
    (IR version < 4 lists weights as inputs) must declare the same type."""
    from aviatorc.frontends.onnx.importer import type_from_proto

    inputs: dict[str, Any] = {}
    for info in graph.input:
        if info.name in inputs:
            raise ModelFormatError(f"graph input '{printable(info.name)}' is listed twice")
        inputs[info.name] = info
    seen: set[str] = set()
    for tensor in graph.initializer:
        label = printable(tensor.name)
        if tensor.name in seen:
            raise ModelFormatError(f"initializer '{label}' is defined twice")
        seen.add(tensor.name)
        info = inputs.get(tensor.name)
        if info is None:
            continue
        declared = type_from_proto(info.type, label)
        dtype = ONNX_DTYPES.get(tensor.data_type)
        dims = tuple(int(d) for d in tensor.dims)
        if declared is None or dtype is None:  # an unsupported dtype is refused with the initializer
            continue
        if declared.dtype != dtype or len(declared.shape) != len(dims) or any(
            isinstance(d, int) and d != actual for d, actual in zip(declared.shape, dims, strict=True)
        ):
            raise ModelFormatError(f"initializer '{label}' is {dtype}{list(dims)} but is also declared as a graph "
                                   f"input of type {declared}", hint="declare it once, or with its own type")
