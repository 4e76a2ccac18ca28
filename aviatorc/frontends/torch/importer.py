"""Lowering a `torch.export.ExportedProgram` (an ATen FX graph) to an IR `Graph`.

The walk is one pass over the FX nodes in order. Each `call_function` node is converted by
the function the conversion table (`aten.py`) holds for its op; the converter reads its
arguments through a `Lowering` context and returns an IR value, a list of them (ops with
several results), or a symbolic scalar.

What the context provides:
- typed values: FX nodes become IR values typed from `node.meta["val"]` (the FakeTensor
  torch.export computed): the IR's type rule gives the type, the meta value fills any dim
  the rule cannot know, and a dtype that disagrees with torch's is cast to torch's;
- weights: parameters, buffers and lifted constants become initializers named by their
  state-dict names (`model.layers.0.self_attn.q_proj.weight`). A weight only ever read
  transposed (the weight of `aten.linear`, or `w.t()`) is stored once, as the [in, out] =
  [K, N] transpose, so every frontend gives the same shape of linear layer; the transpose
  is lazy (`Derived`), and a shape-only weight stays shape-only;
- symbolic sizes: every SymInt is kept as its sympy expression and materialized as IR
  shape arithmetic (Shape, Gather, Mul, Add, Div) only where a converter needs it as a
  tensor; sizes known statically are plain ints. Symbols get the names of the
  `torch.export.Dim`s that made them ("batch", "seq"), else their own ("s0").

Unsupported ops are collected over the whole graph before anything fails and reported as
one `UnsupportedOpsError`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from aviatorc.errors import UnsupportedOpsError
from aviatorc.ir import ArrayData, Derived, Graph, ShapeOnly, TensorType, Value, add_value, merge_type
from aviatorc.ir.types import Dim

if TYPE_CHECKING:
    import torch


class Unsupported(Exception):
    """Raised by a converter for a variant of an op it does not handle (named in `key`)."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


@dataclasses.dataclass(frozen=True)
class Complex:
    """A complex tensor as its real and imaginary parts (the IR has no complex element type):
    Llama 4's rotary multiplies `view_as_complex` pairs by `polar` frequencies (`aten_complex`)."""

    re: Value
    im: Value


REAL_PARTS = {"torch.complex64": "float32", "torch.complex128": "float64"}


@dataclasses.dataclass(frozen=True)
class Sym:
    """A symbolic integer (a SymInt's sympy expression) not yet materialized as a tensor."""

    expr: Any


class _Poisoned:
    """The result of a node that could not be converted; its users are skipped silently."""


POISONED = _Poisoned()
_ABSENT = object()


@dataclasses.dataclass
class _Weight:
    """A parameter, buffer or constant; initializers are created on first use."""

    name: str
    tensor: torch.Tensor
    shape_only: bool
    plain: Value | None = None
    transposed: Value | None = None
    transposed_only: bool = False  # every use reads it transposed: the [K, N] form takes the name
    data: Any = None  # its bytes, made once: both forms read them (a tied head is one parameter, not two)


# Ops whose results are the weight read transposed (the [N, K] -> [K, N] view of a 2-D weight).
_TRANSPOSE_USES = ("aten.t.", "aten.numpy_T.")


# Casts that leave a weight as it is when the dtype does not change (DeepSeek-V3's router reads
# `self.weight.type(torch.float32)` of a float32 weight): the weight is still the parameter.
_SAME_WEIGHT = ("aten.to.", "aten._to_copy.", "aten.type_as.", "aten.clone.", "aten.contiguous.", "aten.alias.",
                "aten.detach.")


def same_weight(node: Any, weight_node: Any) -> bool:
    """Whether `node` is `weight_node` cast to its own dtype (or copied): the same weight."""
    if not str(node.target).startswith(_SAME_WEIGHT) or not node.args or node.args[0] is not weight_node:
        return False
    val, source = node.meta.get("val"), weight_node.meta.get("val")
    return val is not None and source is not None and getattr(val, "dtype", None) == getattr(source, "dtype", None)


def read_transposed(weight_node: Any) -> bool:
    """Whether every read of `weight_node` (its metadata asserts aside) is a transposed one."""
    uses = [u for u in weight_node.users if not str(u.target).startswith("aten._assert_tensor_metadata")]
    return bool(uses) and all(_is_transposed_use(user, weight_node) for user in uses)


def _is_transposed_use(node: Any, weight_node: Any) -> bool:
    """Whether `node` reads the 2-D weight `weight_node` as its transpose (through same-dtype casts)."""
    name = str(node.target)
    if same_weight(node, weight_node):
        return read_transposed(node)
    if name.startswith("aten.linear.") and len(node.args) > 1 and node.args[1] is weight_node:
        return True
    if name.startswith(_TRANSPOSE_USES):
        return True
    if name.startswith("aten.transpose.int"):
        dims = {int(d) % 2 for d in node.args[1:3]}
        return dims == {0, 1}
    if name.startswith("aten.permute."):
        return [int(d) % 2 for d in node.args[1]] == [1, 0]
    return False


class Lowering:
    """The state of one ExportedProgram -> Graph conversion; converters call its helpers."""

    def __init__(self, graph: Graph, *, shape_only: bool, symbol_names: Mapping[str, str]) -> None:
        self.graph = graph
        self.shape_only = shape_only
        self.symbol_names = dict(symbol_names)  # sympy symbol name -> IR dim name
        self.env: dict[Any, Any] = {}  # fx.Node -> Value | list | Sym | int | float | _Weight | None
        self.node: Any = None  # the fx node being converted
        self._sym_sources: dict[str, tuple[Value, int]] = {}  # symbol name -> (graph input, axis)
        self._sym_cache: dict[str, Value] = {}  # str(expr) -> materialized int64 scalar
        self._const_cache: dict[tuple[str, bytes, tuple[int, ...]], Value] = {}
        self._dim_cache: dict[Any, str] = {}  # sympy expression -> its IR dim name

    # -- types ------------------------------------------------------------------------------

    def dim(self, size: Any) -> Dim:
        """An IR dim for a torch size: an int, or the name of its symbolic expression."""
        expr = _expr(size)
        if expr is None:
            return int(size)
        if expr.is_number:
            return int(expr)
        if expr.is_Symbol:
            return self.symbol_names.get(str(expr), str(expr))
        if expr not in self._dim_cache:  # renaming and printing an expression is slow; programs repeat a few
            import sympy

            renamed = expr.subs({s: sympy.Symbol(self.symbol_names.get(str(s), str(s))) for s in expr.free_symbols})
            self._dim_cache[expr] = str(renamed).replace(" ", "")
        return self._dim_cache[expr]

    def tensor_type(self, val: torch.Tensor) -> TensorType:
        return TensorType(dtype_of(val.dtype), tuple(self.dim(d) for d in val.shape))

    def meta(self, node: Any = None) -> Any:
        return (node if node is not None else self.node).meta.get("val")

    def out_dtype(self) -> str:
        """The element type torch gives the current node's (first) result."""
        val = self.meta()
        if isinstance(val, (list, tuple)):
            val = val[0]
        return dtype_of(val.dtype)

    # -- building ---------------------------------------------------------------------------

    def op(self, op: str, inputs: Sequence[Value | None], attrs: Mapping[str, Any] | None = None,
           *, num_outputs: int = 1) -> Any:
        """Add an IR node for the current FX node; returns its output (a list when several)."""
        base = self.node.name if self.node is not None else op
        name = self.graph.unique_name(base)
        outputs = [name] + [self.graph.unique_name(f"{name}_{i}") for i in range(1, num_outputs)]
        from aviatorc.ir import add_op

        node = add_op(self.graph, op, inputs, attrs, name=name, num_outputs=num_outputs, output_names=outputs)
        return node.outputs if num_outputs > 1 else node.outputs[0]

    def const(self, array: Any, dtype: str | None = None, name: str = "const") -> Value:
        """A (cached) constant initializer."""
        arr = np.asarray(array)
        if dtype is not None:
            arr = arr.astype(numpy_dtype(dtype))
        key = (arr.dtype.str, arr.tobytes(), arr.shape)
        if key not in self._const_cache or arr.size > 64:
            value = self.graph.add_constant(arr, name=name)
            if arr.size > 64:
                return value
            self._const_cache[key] = value
        return self._const_cache[key]

    def ints(self, values: Sequence[int]) -> Value:
        return self.const(np.asarray(list(values), dtype=np.int64), name="ints")

    def cast(self, value: Value, dtype: str) -> Value:
        if value.type.dtype == dtype:
            return value
        if value.data is not None and value.data.available and isinstance(value.data, ArrayData) and value.type.numel() <= 64:
            return self.const(value.data.array, dtype)
        return self.op("Cast", [value], {"to": dtype})

    # -- arguments --------------------------------------------------------------------------

    def args(self, node: Any = None) -> dict[str, Any]:
        """The node's arguments by schema name, defaults filled in (FX values left as nodes)."""
        node = node if node is not None else self.node
        schema = getattr(node.target, "_schema", None)
        if schema is None:
            return {str(i): a for i, a in enumerate(node.args)} | dict(node.kwargs)
        bound: dict[str, Any] = {}
        for i, arg in enumerate(schema.arguments):
            if i < len(node.args) and not arg.kwarg_only:
                bound[arg.name] = node.args[i]
            elif arg.name in node.kwargs:
                bound[arg.name] = node.kwargs[arg.name]
            elif arg.has_default_value():
                bound[arg.name] = arg.default_value
            else:
                bound[arg.name] = None
        return bound

    def lookup(self, arg: Any) -> Any:
        """The converted form of an FX argument (recursing into lists); literals unchanged."""
        import torch.fx

        if isinstance(arg, torch.fx.Node):
            if arg not in self.env:
                raise RuntimeError(f"FX node '{arg.name}' is used before it is converted")
            found = self.env[arg]
            if found is POISONED:
                raise _PoisonedInput
            return found
        if isinstance(arg, (list, tuple)):
            return [self.lookup(a) for a in arg]
        return arg

    def value(self, arg: Any, dtype: str | None = None) -> Value:
        """An FX argument as an IR value: tensors as they are, scalars as 0-d constants.

        `dtype` casts the result (and types scalar constants); scalars default to int64 /
        float32 / bool as torch does.
        """
        found = self.lookup(arg)
        if isinstance(found, _Weight):
            found = self.weight(found)
        if isinstance(found, Value):
            return self.cast(found, dtype) if dtype else found
        if isinstance(found, Sym):
            return self.cast(self.sym_value(found.expr), dtype) if dtype else self.sym_value(found.expr)
        if isinstance(found, (bool, int, float, np.number)):
            return self.const(np.asarray(found, dtype=numpy_dtype(dtype or scalar_dtype(found))))
        if found is None:
            raise RuntimeError(f"node '{self.node.name}': a required tensor argument is None")
        raise Unsupported(f"{self.node.target} (argument of type {type(found).__name__})")

    def scalar(self, arg: Any) -> Any:
        """An FX scalar argument: a Python number when static, else a `Sym` or 0-d Value."""
        found = self.lookup(arg)
        if isinstance(found, Sym):
            expr = found.expr
            return int(expr) if expr.is_number else found
        return found

    def is_static(self, arg: Any) -> bool:
        return isinstance(self.scalar(arg), (bool, int, float))

    def shape_value(self, sizes: Sequence[Any]) -> Value:
        """A 1-D int64 tensor of `sizes` (ints, SymInts, `Sym`s, FX nodes): constant when static."""
        parts: list[Any] = []
        for size in sizes:
            found = self.scalar(size) if not isinstance(size, (int, Sym)) and _expr(size) is None else size
            expr = _expr(found) if not isinstance(found, Sym) else found.expr
            if isinstance(found, Value):
                parts.append(self.op("Reshape", [found, self.ints([1])]))
            elif expr is None or expr.is_number:
                parts.append(int(found if expr is None else expr))
            else:
                parts.append(self.op("Unsqueeze", [self.sym_value(expr), self.ints([0])]))
        if all(isinstance(p, int) for p in parts):
            return self.ints(parts)
        # Runs of static sizes stay one constant each.
        pieces: list[Value] = []
        run: list[int] = []
        for part in parts:
            if isinstance(part, int):
                run.append(part)
                continue
            if run:
                pieces.append(self.ints(run))
                run = []
            pieces.append(part)
        if run:
            pieces.append(self.ints(run))
        return pieces[0] if len(pieces) == 1 else self.op("Concat", pieces, {"axis": 0})

    def sym_value(self, expr: Any) -> Value:
        """An int64 0-d tensor computing the symbolic expression `expr` from the graph inputs."""
        expr = _expr(expr) if _expr(expr) is not None else expr
        key = str(expr)
        if key in self._sym_cache:
            return self._sym_cache[key]
        value = self._materialize(expr)
        self._sym_cache[key] = value
        return value

    def _materialize(self, expr: Any) -> Value:
        import sympy

        if expr.is_number:
            return self.const(np.asarray(int(expr), np.int64))
        if expr.is_Symbol:
            source = self._sym_sources.get(str(expr))
            if source is None:
                raise Unsupported(f"symbolic size '{expr}' that no graph input carries")
            value, axis = source
            shape = self.op("Shape", [value])
            return self.op("Gather", [shape, self.const(np.asarray(axis, np.int64))], {"axis": 0})
        args = [self.sym_value(a) for a in expr.args]
        if isinstance(expr, sympy.Add):
            return _fold_left(self, "Add", args)
        if isinstance(expr, sympy.Mul):
            return _fold_left(self, "Mul", args)
        name = type(expr).__name__
        if name == "FloorDiv":  # torch.utils._sympy.functions.FloorDiv: non-negative sizes
            return self.op("Div", args)
        if name in ("Max", "Min"):
            return _fold_left(self, name, args)
        raise Unsupported(f"symbolic size expression '{expr}' ({name})")

    def register_input_symbols(self, value: Value, val: torch.Tensor) -> None:
        """Remember which graph input carries each symbol, to compute sizes from it."""
        for axis, size in enumerate(val.shape):
            expr = _expr(size)
            if expr is not None and expr.is_Symbol:
                self._sym_sources.setdefault(str(expr), (value, axis))

    # -- weights ----------------------------------------------------------------------------

    def weight(self, w: _Weight) -> Value:
        """A weight as stored ([out, in] for a linear weight): created on first use."""
        if w.plain is None:
            name = w.name if not w.transposed_only else self.graph.unique_name(w.name + ".plain")
            if w.data is None:
                w.data = _weight_data(w)
            w.plain = self.graph.add_initializer(name, _weight_type(w.tensor), w.data)
        return w.plain

    def weight_kn(self, w: _Weight) -> Value:
        """A 2-D weight transposed to [K, N] = [in, out] (lazily: the bytes are not copied)."""
        if w.transposed is None:
            name = w.name if w.transposed_only else self.graph.unique_name(w.name + ".T")
            rows, cols = w.tensor.shape
            type = TensorType(dtype_of(w.tensor.dtype), (int(cols), int(rows)))
            if w.data is None:
                w.data = _weight_data(w)
            # Derived even when shape-only: the transposed copy names the bytes it is read from.
            w.transposed = self.graph.add_initializer(name, type, Derived(w.data, _transpose_2d))
        return w.transposed

    def convert_with(self, node: Any, converter: Converter, values: Mapping[Any, Any], *, settle: bool = True) -> Any:
        """`converter` run on `node` with the inputs in `values` read as given (the rest from the
        walk), its result settled against torch's meta value unless `settle` is False; the walk's
        state is left as it was. The MoE lowering re-emits an expert's gate this way, once per
        expert; complex values are converted a part at a time this way."""
        saved = {arg: self.env.get(arg, _ABSENT) for arg in values}
        node_before = self.node
        self.env.update(values)
        self.node = node
        try:
            result = converter(self, node)
            return _settle(self, node, result) if settle else result
        finally:
            for arg, value in saved.items():
                if value is _ABSENT:
                    del self.env[arg]
                else:
                    self.env[arg] = value
            self.node = node_before

    def weight_or_none(self, arg: Any) -> _Weight | None:
        """The weight an FX argument names directly, else None."""
        import torch.fx

        if isinstance(arg, torch.fx.Node):
            found = self.env.get(arg)
            if isinstance(found, _Weight):
                return found
        return None


class _PoisonedInput(Exception):
    """An input of the current node could not be converted: skip it without a new report."""


def _transpose_2d(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array.T)


def _fold_left(cx: Lowering, op: str, args: list[Value]) -> Value:
    out = args[0]
    for arg in args[1:]:
        out = cx.op(op, [out, arg])
    return out


def _expr(size: Any) -> Any:
    """The sympy expression of a SymInt (None for a plain int)."""
    node = getattr(size, "node", None)
    if node is not None and hasattr(node, "expr"):
        return node.expr
    if type(size).__module__.startswith("sympy"):
        return size
    return None


def _weight_type(tensor: torch.Tensor) -> TensorType:
    return TensorType(dtype_of(tensor.dtype), tuple(int(d) for d in tensor.shape))


def _weight_data(w: _Weight) -> Any:
    if w.shape_only or w.tensor.device.type == "meta":
        return ShapeOnly("imported shape-only from PyTorch")
    return ArrayData(tensor_to_numpy(w.tensor))


# -- dtypes --------------------------------------------------------------------------------

_DTYPES = {
    "float64": "float64", "float32": "float32", "float16": "float16", "bfloat16": "bfloat16",
    "int64": "int64", "int32": "int32", "int16": "int16", "int8": "int8", "uint8": "uint8",
    "uint16": "uint16", "uint32": "uint32", "uint64": "uint64", "bool": "bool",
}


def dtype_of(dtype: torch.dtype) -> str:
    """The IR element type of a torch dtype."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise Unsupported(f"element type torch.{name}")
    return _DTYPES[name]


def numpy_dtype(dtype: str) -> np.dtype:
    from aviatorc.ir.types import numpy_dtype as _numpy_dtype

    return _numpy_dtype(dtype)


def scalar_dtype(value: Any) -> str:
    """The dtype torch gives a Python scalar on its own."""
    if isinstance(value, (bool, np.bool_)):
        return "bool"
    if isinstance(value, (int, np.integer)):
        return "int64"
    return "float32"


def tensor_to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A read-only numpy view of a CPU tensor (bfloat16 through ml_dtypes), no copy."""
    import torch

    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        array = tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    else:
        array = tensor.numpy()
    array = array.view()
    array.flags.writeable = False
    return array


# -- the walk ------------------------------------------------------------------------------


Converter = Callable[[Lowering, Any], Any]


def lower_program(ep: Any, table: Mapping[str, Converter], *, shape_only: bool,
                  symbol_names: Mapping[str, str], name: str = "main", blocks: Sequence[Any] = ()) -> Graph:
    """Convert an ExportedProgram to an IR graph (not yet verified). `blocks` are the program's
    MoE blocks (`moe.find_blocks`): each is lowered as a whole at its output node, and none of
    its other nodes is converted on its own."""
    from torch.export.graph_signature import InputKind

    from aviatorc.frontends.torch.moe import emit_block

    graph = Graph(name)
    cx = Lowering(graph, shape_only=shape_only, symbol_names=symbol_names)
    specs = {spec.arg.name: spec for spec in ep.graph_signature.input_specs if hasattr(spec.arg, "name")}
    state = {**ep.state_dict, **ep.constants}
    unsupported: dict[str, list[Any]] = {}
    fx_nodes = list(ep.graph.nodes)
    owner = {n: block for block in blocks for n in block.nodes}

    for node in fx_nodes:
        cx.node = node
        if node.op == "placeholder":
            spec = specs.get(node.name)
            if spec is not None and spec.kind != InputKind.USER_INPUT:
                if spec.kind == InputKind.TOKEN:
                    cx.env[node] = None
                    continue
                tensor = state[spec.target]
                w = _Weight(spec.target, tensor, shape_only)
                w.transposed_only = tensor.dim() == 2 and read_transposed(node)
                cx.env[node] = w
                continue
            val = cx.meta(node)
            if not _is_tensor(val):
                cx.env[node] = val if isinstance(val, (int, float, bool)) else None
                if _expr(val) is not None:
                    cx.env[node] = Sym(_expr(val))
                continue
            value = graph.add_input(node.name, cx.tensor_type(val))
            cx.register_input_symbols(value, val)
            cx.env[node] = value
            continue
        if node.op == "output":
            continue
        if node.op != "call_function":
            _record(unsupported, f"{node.op} {node.target}", node)
            cx.env[node] = POISONED
            continue
        if node in owner:
            if node is not owner[node].output:
                cx.env[node] = POISONED  # lowered with its block (which checked that nothing else reads it)
                continue
            try:
                cx.node = node
                cx.env[node] = _settle(cx, node, emit_block(cx, owner[node], table))
            except _PoisonedInput:
                cx.env[node] = POISONED
            except Unsupported as error:
                _record(unsupported, error.key, node)
                cx.env[node] = POISONED
            continue
        scalar = _scalar_result(node)
        if scalar is not None:
            cx.env[node] = scalar  # size arithmetic: kept symbolic, materialized on use
            continue
        key = op_key(node.target)
        converter = table.get(key)
        if converter is None:
            _record(unsupported, str(node.target), node)
            cx.env[node] = POISONED
            continue
        try:
            if any(isinstance(cx.env.get(arg), Complex) for arg in node.all_input_nodes):
                from aviatorc.frontends.torch.aten_complex import convert_complex

                cx.env[node] = convert_complex(cx, node, converter)
                continue
            result = converter(cx, node)
        except _PoisonedInput:
            cx.env[node] = POISONED
            continue
        except Unsupported as error:
            _record(unsupported, error.key, node)
            cx.env[node] = POISONED
            continue
        cx.env[node] = _settle(cx, node, result)

    if unsupported:
        raise UnsupportedOpsError({k: (len(v), v[0].name) for k, v in unsupported.items()})

    _set_outputs(cx, ep, fx_nodes[-1])
    return graph


def _scalar_result(node: Any) -> Any:
    """A `Sym` (or number) for a node computing a symbolic size, else None."""
    val = node.meta.get("val")
    expr = _expr(val)
    if expr is None:
        return None
    if expr.is_number:
        return bool(expr) if expr.is_Boolean else (int(expr) if expr.is_integer else float(expr))
    return Sym(expr)


def unconvertible(ep: Any, table: Mapping[str, Converter], skip: Collection[Any] = ()) -> dict[str, tuple[int, str]]:
    """Ops of `ep` without a converter, outside the nodes in `skip` (those of MoE blocks):
    {op: (count, first node)} (before any conversion)."""
    found: dict[str, list[Any]] = {}
    for node in ep.graph.nodes:
        if node in skip:
            continue
        if node.op == "call_function" and _scalar_result(node) is None and op_key(node.target) not in table:
            _record(found, str(node.target), node)
    return {k: (len(v), v[0].name) for k, v in found.items()}


def _record(unsupported: dict[str, list[Any]], key: str, node: Any) -> None:
    unsupported.setdefault(key, []).append(node)


def _is_tensor(val: Any) -> bool:
    import torch

    return isinstance(val, torch.Tensor)


def op_key(target: Any) -> str:
    """The table key of an FX target: "aten.linear" (overload packet), "operator.getitem"."""
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return f"{target.namespace}.{packet.__name__}"
    module = getattr(target, "__module__", "") or ""
    if module in ("_operator", "operator"):
        return f"operator.{target.__name__}"
    if module.startswith(("math", "torch")) and hasattr(target, "__name__"):
        return f"{module.split('.')[0]}.{target.__name__}"
    return str(target)


def _settle(cx: Lowering, node: Any, result: Any) -> Any:
    """Reconcile a converter's result with torch's meta value: fill dims, fix dtypes."""
    val = node.meta.get("val")
    if isinstance(result, Complex) and _is_tensor(val) and val.is_complex():
        want = TensorType(REAL_PARTS[str(val.dtype)], tuple(cx.dim(d) for d in val.shape))
        return Complex(_settle_value(cx, node, result.re, want), _settle_value(cx, node, result.im, want))
    if isinstance(result, Value) and _is_tensor(val):
        return _settle_value(cx, node, result, cx.tensor_type(val))
    if isinstance(result, (list, tuple)) and isinstance(val, (list, tuple)):
        return [_settle_item(cx, node, r, v) for r, v in zip(result, val, strict=False)]
    if result is None and _expr(val) is not None:
        return Sym(_expr(val))
    return result


def _settle_value(cx: Lowering, node: Any, result: Value, want: TensorType) -> Value:
    if result.type.rank != want.rank:
        raise RuntimeError(
            f"converter for {node.target} at '{node.name}' gave rank {result.type.rank}, torch says {want}"
        )
    if result.type.dtype != want.dtype:
        result = cx.cast(result, want.dtype)
    merged = merge_type(result.type, want)
    if merged != result.type and result.producer is not None:
        result.type = merged  # only fills dims the rule could not know
    return result


def _settle_item(cx: Lowering, node: Any, result: Any, val: Any) -> Any:
    if isinstance(result, Value) and _is_tensor(val):
        want = cx.tensor_type(val)
        if result.type.dtype != want.dtype:
            result = cx.cast(result, want.dtype)
        merged = merge_type(result.type, want)
        if merged != result.type and result.producer is not None:
            result.type = merged
    return result


def _set_outputs(cx: Lowering, ep: Any, output_node: Any) -> None:
    """Graph outputs: the user outputs, named from the output pytree (`logits`) when it has keys."""
    from torch.export.graph_signature import OutputKind

    specs = ep.graph_signature.output_specs
    flat = list(output_node.args[0])
    names = _output_names(ep, sum(1 for s in specs if s.kind == OutputKind.USER_OUTPUT))
    user = [arg for arg, spec in zip(flat, specs, strict=True) if spec.kind == OutputKind.USER_OUTPUT]
    graph = cx.graph
    for index, arg in enumerate(user):
        cx.node = None
        value = cx.value(arg)
        name = graph.unique_name(names[index])
        if value in graph.outputs or value.producer is None or value.producer.outputs != [value]:
            # An input, a weight or a value already returned: give the output its own name.
            value = add_value(graph, "Identity", [value], name=name, output_names=[name])
        else:
            value = _renamed(graph, value, name)
        graph.outputs.append(value)


def _renamed(graph: Graph, value: Value, name: str) -> Value:
    """`value` under a new name: its single-output producer is re-created (names are final)."""
    old = value.producer
    assert old is not None
    index = graph.nodes.index(old)
    new = graph.add_node(old.op, list(old.inputs), [value.type], old.attrs, name=name, output_names=[name])
    graph.nodes.pop()
    graph.nodes.insert(index + 1, new)
    graph.replace_all_uses(value, new.outputs[0])
    graph.remove_node(old)
    return new.outputs[0]


def _output_names(ep: Any, count: int) -> list[str]:
    spec = getattr(ep.call_spec, "out_spec", None)
    keys: list[str] = []
    context = getattr(spec, "context", None)
    if isinstance(context, (list, tuple)) and len(context) == count and all(isinstance(k, str) for k in context):
        keys = list(context)
    if not keys:
        keys = ["output"] if count == 1 else [f"output_{i}" for i in range(count)]
    return keys
