"""Converters for shape and data-movement ATen ops: views, permutes, concat/split, slicing,
indexing, and tensor factories (arange, full, zeros_like, ...).

Targets of reshape-like ops are computed from torch's own output shape (`node.meta`): a
dim equal to the input's becomes 0 ("copy"), one remaining symbolic dim becomes -1, so the
common cases give constant shape operands even when batch and sequence are symbolic.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from aviatorc.frontends.torch.aten import converts
from aviatorc.frontends.torch.importer import Lowering, Sym, Unsupported, _expr
from aviatorc.ir import Value

INT64_MAX = 2**63 - 1


def _norm(axis: int, rank: int) -> int:
    return axis % max(rank, 1) if axis < 0 else axis


def _sizes(cx: Lowering, val: Any) -> list[Any]:
    """torch sizes as ints (static) or `Sym` expressions."""
    out: list[Any] = []
    for size in val.shape:
        expr = _expr(size)
        out.append(int(size) if expr is None else (int(expr) if expr.is_number else Sym(expr)))
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Sym) and isinstance(b, Sym):
        return a.expr == b.expr
    return isinstance(a, int) and isinstance(b, int) and a == b


def reshape_to(cx: Lowering, x: Value, in_val: Any, out_val: Any) -> Value:
    """Reshape `x` (torch value `in_val`) to `out_val`'s shape, with a constant target when possible."""
    ins, outs = _sizes(cx, in_val), _sizes(cx, out_val)
    if len(ins) == len(outs) and all(_same(a, b) for a, b in zip(ins, outs, strict=True)):
        return x
    target: list[Any] = []
    symbolic: list[int] = []
    for i, size in enumerate(outs):
        if i < len(ins) and isinstance(size, Sym) and _same(ins[i], size):
            target.append(0)  # copy the input's dim
        elif isinstance(size, Sym):
            symbolic.append(i)
            target.append(size)
        else:
            target.append(size)
    if 0 in [t for i, t in enumerate(outs) if isinstance(t, int)]:
        return cx.op("Reshape", [x, cx.shape_value(outs)], {"allowzero": 1})
    if len(symbolic) == 1:
        target[symbolic[0]] = -1
    return cx.op("Reshape", [x, cx.shape_value(target)])


@converts("aten.view", "aten.reshape", "aten._unsafe_view", "aten.view_copy", "aten.flatten", "aten.unflatten",
          "aten.squeeze_copy", "aten.unsqueeze_copy", "aten.ravel", "aten.view_as", "aten.reshape_as")
def view(cx: Lowering, node: Any) -> Value:
    src = node.args[0]
    return reshape_to(cx, cx.value(src), cx.meta(src), cx.meta())


@converts("aten.unsqueeze")
def unsqueeze(cx: Lowering, node: Any) -> Value:
    x = cx.value(node.args[0])
    return cx.op("Unsqueeze", [x, cx.ints([_norm(int(node.args[1]), x.type.rank + 1)])])


@converts("aten.squeeze")
def squeeze(cx: Lowering, node: Any) -> Value:
    """squeeze drops size-1 dims; torch ignores named dims that are not size 1."""
    src = node.args[0]
    x = cx.value(src)
    sizes = _sizes(cx, cx.meta(src))
    if len(node.args) > 1:
        dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        axes = [_norm(int(d), len(sizes)) for d in dims]
    else:
        axes = list(range(len(sizes)))
    axes = [a for a in axes if sizes[a] == 1]
    if not axes:
        return x
    return cx.op("Squeeze", [x, cx.ints(axes)])


def _transpose(cx: Lowering, arg: Any, perm: list[int]) -> Value:
    weight = cx.weight_or_none(arg)
    if weight is not None and perm == [1, 0]:
        return cx.weight_kn(weight)
    return cx.op("Transpose", [cx.value(arg)], {"perm": perm})


@converts("aten.permute")
def permute(cx: Lowering, node: Any) -> Value:
    rank = len(cx.meta().shape)
    return _transpose(cx, node.args[0], [_norm(int(d), rank) for d in node.args[1]])


@converts("aten.transpose")
def transpose(cx: Lowering, node: Any) -> Value:
    rank = len(cx.meta().shape)
    a, b = _norm(int(node.args[1]), rank), _norm(int(node.args[2]), rank)
    perm = list(range(rank))
    perm[a], perm[b] = perm[b], perm[a]
    if perm == list(range(rank)):
        return cx.value(node.args[0])
    return _transpose(cx, node.args[0], perm)


@converts("aten.t", "aten.numpy_T")
def t(cx: Lowering, node: Any) -> Value:
    rank = len(cx.meta().shape)
    if rank < 2:
        return cx.value(node.args[0])
    return _transpose(cx, node.args[0], list(reversed(range(rank))))


@converts("aten.expand")
def expand(cx: Lowering, node: Any) -> Value:
    """expand: a bidirectional Expand whose target is 1 wherever the input keeps its dim."""
    src = node.args[0]
    x = cx.value(src)
    ins, outs = _sizes(cx, cx.meta(src)), _sizes(cx, cx.meta())
    offset = len(outs) - len(ins)
    target: list[Any] = []
    for i, size in enumerate(outs):
        j = i - offset
        target.append(1 if j >= 0 and _same(ins[j], size) else size)
    if offset == 0 and all(t == 1 for t in target):
        return x
    return cx.op("Expand", [x, cx.shape_value(target)])


@converts("aten.repeat")
def repeat(cx: Lowering, node: Any) -> Value:
    x = cx.value(node.args[0])
    repeats = list(node.args[1])
    if len(repeats) > x.type.rank:
        lead = len(repeats) - x.type.rank
        x = cx.op("Unsqueeze", [x, cx.ints(list(range(lead)))])
    return cx.op("Tile", [x, cx.shape_value(repeats)])


@converts("aten.cat", "aten.concat", "aten.concatenate")
def cat(cx: Lowering, node: Any) -> Value:
    dtype = cx.out_dtype()
    rank = len(cx.meta().shape)
    dim = _norm(int(cx.args().get("dim", 0)), rank)
    # torch skips legacy empty 1-D tensors in cat.
    tensors = [t for t in node.args[0] if not (len(cx.meta(t).shape) == 1 and cx.meta(t).shape[0] == 0 and rank > 1)]
    values = [cx.value(t, dtype) for t in tensors]
    if len(values) == 1:
        return values[0]
    return cx.op("Concat", values, {"axis": dim})


@converts("aten.stack")
def stack(cx: Lowering, node: Any) -> Value:
    dtype = cx.out_dtype()
    rank = len(cx.meta().shape)
    dim = _norm(int(cx.args().get("dim", 0)), rank)
    values = [cx.op("Unsqueeze", [cx.value(t, dtype), cx.ints([dim])]) for t in node.args[0]]
    return values[0] if len(values) == 1 else cx.op("Concat", values, {"axis": dim})


@converts("aten.split", "aten.split_with_sizes", "aten.chunk", "aten.unbind", "aten.tensor_split",
          "aten.unsafe_split", "aten.split_copy")
def split(cx: Lowering, node: Any) -> list[Value]:
    """Every splitting op: sizes come from torch's output shapes."""
    src = node.args[0]
    x = cx.value(src)
    outs = cx.meta()
    key = str(node.target)
    rank = x.type.rank
    if key.startswith("aten.unbind"):
        dim = _norm(int(cx.args().get("dim", 0)), rank)
    else:
        dim = _norm(int(cx.args().get("dim", 0)), rank)
    sizes = [_sizes(cx, o)[dim] if not key.startswith("aten.unbind") else 1 for o in outs]
    if len(sizes) == 1:
        parts = [x]
    else:
        parts = cx.op("Split", [x, cx.shape_value(sizes)], {"axis": dim}, num_outputs=len(sizes))
    if key.startswith("aten.unbind"):
        parts = [cx.op("Squeeze", [p, cx.ints([dim])]) for p in parts]
    return list(parts)


def _index_value(cx: Lowering, arg: Any) -> Value:
    """A slice bound or index as a 1-element int64 tensor (static or symbolic)."""
    return cx.shape_value([arg])


@converts("aten.slice")
def slice_(cx: Lowering, node: Any) -> Value:
    a = cx.args()
    src = a["self"]
    x = cx.value(src)
    sizes = _sizes(cx, cx.meta(src))
    dim = _norm(int(a.get("dim", 0)), len(sizes))
    start, end, step = a.get("start"), a.get("end"), a.get("step", 1) or 1
    start = 0 if start is None else cx.scalar(start)
    end = INT64_MAX if end is None else cx.scalar(end)
    whole = isinstance(end, int) and (end >= INT64_MAX or (isinstance(sizes[dim], int) and end >= sizes[dim]))
    if start == 0 and step == 1 and (whole or (isinstance(end, Sym) and _same(end, sizes[dim]))):
        return x
    return cx.op("Slice", [x, _index_value(cx, start), _index_value(cx, end), cx.ints([dim]), cx.ints([int(step)])])


@converts("aten.slice_scatter")
def slice_scatter(cx: Lowering, node: Any) -> Value:
    """slice_scatter(self, src, dim, start, end, step=1): self with [start, end) along dim replaced by src."""
    a = cx.args()
    return _scatter_slice(cx, a["self"], cx.value(a["src"], cx.out_dtype()), a.get("dim", 0), a.get("start"),
                          a.get("end"), a.get("step"))


def _scatter_slice(cx: Lowering, base: Any, src: Value, dim: Any, start: Any, end: Any, step: Any) -> Value:
    """The FX tensor `base` with [start, end) along `dim` replaced by `src`: the concat of what lies
    before, `src` and what lies after (static bounds, step 1)."""
    x = cx.value(base)
    sizes = _sizes(cx, cx.meta(base))
    dim = _norm(int(dim), len(sizes))
    if (step or 1) != 1:
        raise Unsupported("a slice write with a step")
    first = cx.scalar(start) if start is not None else 0
    last = cx.scalar(end) if end is not None else INT64_MAX
    size = sizes[dim]
    if not isinstance(first, int) or not isinstance(last, int) or not isinstance(size, int):
        raise Unsupported("a slice write with symbolic bounds")
    first, last = (min(max(v + size if v < 0 else v, 0), size) for v in (first, last))
    axis = cx.ints([dim])
    pieces = []
    if first > 0:
        pieces.append(cx.op("Slice", [x, cx.ints([0]), cx.ints([first]), axis]))
    pieces.append(cx.cast(src, x.type.dtype))
    if last < size:
        pieces.append(cx.op("Slice", [x, cx.ints([last]), cx.ints([size]), axis]))
    return pieces[0] if len(pieces) == 1 else cx.op("Concat", pieces, {"axis": dim})


_FRESH = ("aten.new_empty", "aten.empty", "aten.new_zeros", "aten.zeros", "aten.empty_like", "aten.zeros_like")


@converts("aten.copy_")
def copy_(cx: Lowering, node: Any) -> Value:
    """copy_(slice of a fresh tensor, src): the fresh tensor's value becomes itself with that slice
    replaced, for the nodes after this one (DeepSeek-V3 fills its keys with
    `key[..., :nope].copy_(k_nope)` and `key[..., nope:].copy_(k_rot)` on a `new_empty` tensor).
    Other in-place copies are unsupported: a write through an arbitrary view is not tracked."""
    from aviatorc.frontends.torch.importer import op_key

    dst, src = node.args[0], node.args[1]
    if op_key(dst.target) != "aten.slice" or op_key(dst.args[0].target) not in _FRESH:
        raise Unsupported("aten.copy_ into a tensor other than a slice of a new one")
    base = dst.args[0]
    args = cx.args(dst)
    value = cx.value(src, cx.out_dtype())
    cx.env[base] = _scatter_slice(cx, base, value, args.get("dim", 0), args.get("start"), args.get("end"),
                                  args.get("step"))
    return value


@converts("aten.narrow")
def narrow(cx: Lowering, node: Any) -> Value:
    a = cx.args()
    x = cx.value(a["self"])
    dim = _norm(int(a["dim"]), x.type.rank)
    start, length = cx.scalar(a["start"]), cx.scalar(a["length"])
    if isinstance(start, int) and isinstance(length, int):
        end: Any = start + length
        end_value = cx.ints([end])
    else:
        end_value = cx.op("Add", [_index_value(cx, start), _index_value(cx, length)])
    return cx.op("Slice", [x, _index_value(cx, start), end_value, cx.ints([dim])])


@converts("aten.select")
def select(cx: Lowering, node: Any) -> Value:
    a = cx.args()
    x = cx.value(a["self"])
    dim = _norm(int(a["dim"]), x.type.rank)
    index = cx.scalar(a["index"])
    idx = cx.const(np.asarray(index, np.int64)) if isinstance(index, int) else cx.value(a["index"], "int64")
    return cx.op("Gather", [x, idx], {"axis": dim})


@converts("aten.index_select")
def index_select(cx: Lowering, node: Any) -> Value:
    a = cx.args()
    x = cx.value(a["self"])
    return cx.op("Gather", [x, cx.value(a["index"], "int64")], {"axis": _norm(int(a["dim"]), x.type.rank)})


@converts("aten.gather")
def gather(cx: Lowering, node: Any) -> Value:
    a = cx.args()
    x = cx.value(a["self"])
    return cx.op("GatherElements", [x, cx.value(a["index"], "int64")], {"axis": _norm(int(a["dim"]), x.type.rank)})


@converts("aten.index")
def index(cx: Lowering, node: Any) -> Value:
    """x[i0, i1, ...] with integer index tensors (None skips a dim).

    One index: Gather on its axis. Several: broadcast them, stack them on a last axis and
    GatherND over the indexed axes moved to the front; torch puts the result's index dims
    where the indexed axes were when they are adjacent, else in front.
    """
    a = cx.args()
    x = cx.value(a["self"])
    indices = list(a["indices"])
    positions = [i for i, idx in enumerate(indices) if idx is not None]
    for i in positions:
        if cx.meta(indices[i]).dtype.is_floating_point or str(cx.meta(indices[i]).dtype) == "torch.bool":
            raise Unsupported("aten.index with a boolean or float index")
    if len(positions) == 1:
        p = positions[0]
        return cx.op("Gather", [x, cx.value(indices[p], "int64")], {"axis": p})
    rank = x.type.rank
    adjacent = positions == list(range(positions[0], positions[-1] + 1))
    values = [cx.value(indices[i], "int64") for i in positions]
    zero = cx.const(np.asarray(0, np.int64))
    common = values[0] if len(values) == 1 else None
    for value in values:
        scaled = cx.op("Mul", [value, zero])
        common = scaled if common is None else cx.op("Add", [common, scaled])
    stacked = [cx.op("Unsqueeze", [cx.op("Add", [v, common]), cx.ints([-1])]) for v in values]
    idx = cx.op("Concat", stacked, {"axis": -1})
    rest = [i for i in range(rank) if i not in positions]
    moved = x if positions == list(range(len(positions))) else cx.op("Transpose", [x], {"perm": positions + rest})
    out = cx.op("GatherND", [moved, idx])
    if adjacent and positions[0] > 0:
        nb = len(cx.meta().shape) - len(rest)  # index (broadcast) dims, now in front
        p = positions[0]
        perm = list(range(nb, nb + p)) + list(range(nb)) + list(range(nb + p, nb + len(rest)))
        out = cx.op("Transpose", [out], {"perm": perm})
    return out


@converts("aten.tril", "aten.triu")
def tril(cx: Lowering, node: Any) -> Value:
    a = cx.args()
    upper = str(node.target).startswith("aten.triu")
    k = cx.scalar(a.get("diagonal", 0))
    kv = cx.const(np.asarray(k, np.int64)) if isinstance(k, int) else cx.value(a["diagonal"], "int64")
    return cx.op("Trilu", [cx.value(a["self"]), kv], {"upper": int(upper)})


@converts("aten.cumsum")
def cumsum(cx: Lowering, node: Any) -> Value:
    a = cx.args()
    x = cx.value(a["self"], cx.out_dtype())
    return cx.op("CumSum", [x, cx.const(np.asarray(_norm(int(a["dim"]), x.type.rank), np.int64))])


@converts("aten.diff")
def diff(cx: Lowering, node: Any) -> Value:
    """diff(x, n=1, dim, prepend, append): x[1:] - x[:-1] along dim after the concatenations."""
    a = cx.args()
    if a.get("n", 1) != 1:
        raise Unsupported("aten.diff with n > 1")
    x = cx.value(a["self"])
    dim = _norm(int(a.get("dim", -1)), x.type.rank)
    parts = [cx.value(p, x.type.dtype) for p in (a.get("prepend"), a["self"], a.get("append")) if p is not None]
    full = parts[0] if len(parts) == 1 else cx.op("Concat", parts, {"axis": dim})
    axes, one = cx.ints([dim]), cx.ints([1])
    head = cx.op("Slice", [full, one, cx.ints([INT64_MAX]), axes])
    tail = cx.op("Slice", [full, cx.ints([0]), cx.ints([-1]), axes])
    if x.type.dtype == "bool":
        return cx.op("Xor", [head, tail])
    return cx.op("Sub", [head, tail])


@converts("aten.constant_pad_nd", "aten.pad")
def pad(cx: Lowering, node: Any) -> Value:
    a = cx.args()
    if a.get("mode", "constant") not in ("constant", None):
        raise Unsupported(f"aten.pad mode {a['mode']}")
    x = cx.value(a["self"])
    rank = x.type.rank
    pairs = list(a["pad"])
    begins: list[Any] = [0] * rank
    ends: list[Any] = [0] * rank
    for k in range(len(pairs) // 2):  # torch lists (before, after) from the last dim backwards
        begins[rank - 1 - k], ends[rank - 1 - k] = pairs[2 * k], pairs[2 * k + 1]
    fill = a.get("value") or 0
    return cx.op("Pad", [x, cx.shape_value(begins + ends), cx.const(fill, x.type.dtype)])


# -- factories -------------------------------------------------------------------------------


@converts("aten.arange")
def arange(cx: Lowering, node: Any) -> Value:
    dtype = cx.out_dtype()
    args = [a for a in node.args]
    if len(args) == 1:
        start, end, step = 0, args[0], 1
    else:
        start, end = args[0], args[1]
        step = args[2] if len(args) > 2 else node.kwargs.get("step", 1)
    return cx.op("Range", [cx.value(start, dtype), cx.value(end, dtype), cx.value(step, dtype)])


@converts("aten.full", "aten.zeros", "aten.ones", "aten.empty", "aten.new_ones", "aten.new_zeros", "aten.new_full",
          "aten.new_empty", "aten.full_like", "aten.zeros_like", "aten.ones_like", "aten.empty_like",
          "aten.empty_strided", "aten.fill")
def full(cx: Lowering, node: Any) -> Value:
    """Tensor factories: a constant fill of torch's output shape (empty tensors read as zeros)."""
    key = str(node.target).split(".")[1]
    a = cx.args()
    dtype = cx.out_dtype()
    fill: Any = {"ones": 1, "new_ones": 1, "ones_like": 1}.get(key, 0)
    if key in ("full", "new_full", "full_like"):
        fill = a["fill_value"]
    elif key == "fill":
        fill = a["value"]
    shape = cx.shape_value(_sizes(cx, cx.meta()))
    fill = cx.scalar(fill)
    if isinstance(fill, (bool, int, float)):
        return cx.op("ConstantOfShape", [shape], {"value": float(fill), "dtype": dtype})
    return cx.op("Expand", [cx.value(fill, dtype), shape])
