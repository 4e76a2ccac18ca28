"""Shape and data-movement ops. Shape operands (reshape targets, slice bounds, axes) are
int64 inputs, as in ONNX, so dynamic graphs can compute them; the type rules read their
values when they are constants."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from aviatorc.errors import ModelFormatError
from aviatorc.ir.ops.elementwise import same_rule
from aviatorc.ir.ops.nn import normalize_axis
from aviatorc.ir.ops.registry import REQUIRED, InferContext, register
from aviatorc.ir.types import Dim, TensorType, broadcast_shapes, format_shape, numpy_dtype

INT64_MAX = np.iinfo(np.int64).max


def _ints(array: np.ndarray | None) -> list[int] | None:
    return None if array is None else [int(v) for v in np.asarray(array).reshape(-1)]


def _unknown(rank: int) -> tuple[Dim, ...]:
    return (None,) * rank


# -- reshape family ----------------------------------------------------------------------


def _reshape_dims(in_shape: tuple[Dim, ...], target: list[int], allowzero: int) -> tuple[Dim, ...]:
    dims: list[Dim] = []
    for i, t in enumerate(target):
        if t == 0 and not allowzero:
            if i >= len(in_shape):
                raise ModelFormatError(f"reshape target {target} copies dim {i} of a rank-{len(in_shape)} input")
            dims.append(in_shape[i])
        elif t < -1:
            raise ModelFormatError(f"reshape target {target} has a negative size {t}")
        else:
            dims.append(t)
    if dims.count(-1) > 1:
        raise ModelFormatError(f"reshape target {target} has more than one -1")
    if -1 in dims:
        known = [d for d in dims if d != -1]
        if all(isinstance(d, int) for d in in_shape) and all(isinstance(d, int) for d in known):
            total, rest = math.prod(in_shape), math.prod(known)  # type: ignore[arg-type]
            if rest == 0 or total % rest:
                raise ModelFormatError(f"cannot reshape {format_shape(in_shape)} to {target}")
            dims[dims.index(-1)] = total // rest
        else:
            # Symbolic: the -1 absorbs whatever the known target dims leave of the input.
            in_syms = [d for d in in_shape if isinstance(d, str)]
            known_syms = [d for d in known if isinstance(d, str)]
            for sym in known_syms:
                if sym in in_syms:
                    in_syms.remove(sym)
            in_ints = math.prod(d for d in in_shape if isinstance(d, int))
            known_ints = math.prod(d for d in known if isinstance(d, int))
            resolved: Dim = None
            if len(known_syms) == len(in_shape) - len([d for d in in_shape if not isinstance(d, str)]) - len(in_syms):
                if not in_syms and known_ints and in_ints % known_ints == 0:
                    resolved = in_ints // known_ints
                elif len(in_syms) == 1 and in_ints == known_ints:
                    resolved = in_syms[0]
            dims[dims.index(-1)] = resolved
    elif all(isinstance(d, int) for d in in_shape) and all(isinstance(d, int) for d in dims):
        if math.prod(in_shape) != math.prod(dims):  # type: ignore[arg-type]
            raise ModelFormatError(f"cannot reshape {format_shape(in_shape)} to {format_shape(tuple(dims))}")
    return tuple(dims)


def _reshape_rule(ctx: InferContext) -> list[TensorType]:
    x = ctx.type(0)
    target = _ints(ctx.const(1))
    if target is None:
        rank = ctx.type(1).shape[0]
        return [TensorType(x.dtype, _unknown(rank if isinstance(rank, int) else 0))]
    return [TensorType(x.dtype, _reshape_dims(x.shape, target, ctx.attrs["allowzero"]))]


@register("Reshape", inputs=2, infer=_reshape_rule, attrs={"allowzero": 0})
def reshape(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """Reshape(x, shape): 0 copies the input dim (unless allowzero), -1 is inferred."""
    x, shape = ins
    target = [int(v) for v in shape]
    if not attrs["allowzero"]:
        target = [x.shape[i] if t == 0 else t for i, t in enumerate(target)]
    return [x.reshape(target)]


def _flatten_axis(axis: int, rank: int) -> int:
    """Flatten's axis lies in [-rank, rank]; a negative one counts from rank (-1 is rank - 1)."""
    if not -rank <= axis <= rank:
        raise ModelFormatError(f"axis {axis} is out of range for rank {rank}")
    return axis + rank if axis < 0 else axis


def _flatten_rule(ctx: InferContext) -> list[TensorType]:
    x = ctx.type(0)
    axis = _flatten_axis(ctx.attrs["axis"], x.rank)
    def prod(dims: tuple[Dim, ...]) -> Dim:
        return math.prod(dims) if all(isinstance(d, int) for d in dims) else (dims[0] if len(dims) == 1 else None)  # type: ignore[arg-type]
    return [TensorType(x.dtype, (prod(x.shape[:axis]), prod(x.shape[axis:])))]


@register("Flatten", inputs=1, infer=_flatten_rule, attrs={"axis": 1})
def flatten(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """Flatten(x) to 2-D at `axis`."""
    x = ins[0]
    axis = _flatten_axis(attrs["axis"], x.ndim)
    return [x.reshape(math.prod(x.shape[:axis]), -1) if x.size else x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))]


def _unsqueeze_rule(ctx: InferContext) -> list[TensorType]:
    x = ctx.type(0)
    axes = _ints(ctx.const(1))
    if axes is None:
        return [TensorType(x.dtype, _unknown(x.rank + (ctx.type(1).shape[0] or 0)))]  # type: ignore[operator]
    rank = x.rank + len(axes)
    norm = sorted(normalize_axis(a, rank) for a in axes)
    dims = list(x.shape)
    for a in norm:
        dims.insert(a, 1)
    return [TensorType(x.dtype, tuple(dims))]


@register("Unsqueeze", inputs=2, infer=_unsqueeze_rule)
def unsqueeze(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """Unsqueeze(x, axes): insert size-1 dims at `axes` of the output."""
    x, axes = ins
    rank = x.ndim + len(axes)
    out = x
    for a in sorted(normalize_axis(int(a), rank) for a in axes):
        out = np.expand_dims(out, a)
    return [out]


def _squeeze_rule(ctx: InferContext) -> list[TensorType]:
    x = ctx.type(0)
    if not ctx.has(1):
        if all(isinstance(d, int) for d in x.shape):
            return [TensorType(x.dtype, tuple(d for d in x.shape if d != 1))]
        return [TensorType(x.dtype, tuple(d for d in x.shape if d != 1 and d is not None))]
    axes = _ints(ctx.const(1))
    if axes is None:
        return [TensorType(x.dtype, _unknown(x.rank - (ctx.type(1).shape[0] or 0)))]  # type: ignore[operator]
    norm = {normalize_axis(a, x.rank) for a in axes}
    for a in norm:
        if isinstance(x.shape[a], int) and x.shape[a] != 1:
            raise ModelFormatError(f"cannot squeeze axis {a} of size {x.shape[a]}")
    return [TensorType(x.dtype, tuple(d for i, d in enumerate(x.shape) if i not in norm))]


@register("Squeeze", inputs=(1, 2), infer=_squeeze_rule)
def squeeze(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """Squeeze(x, axes?): drop size-1 dims (all of them when no axes are given)."""
    x = ins[0]
    axes = ins[1] if len(ins) > 1 and ins[1] is not None else None
    if axes is None:
        return [np.squeeze(x)]
    return [np.squeeze(x, axis=tuple(normalize_axis(int(a), x.ndim) for a in axes))]


def _transpose_rule(ctx: InferContext) -> list[TensorType]:
    x = ctx.type(0)
    perm = ctx.attrs["perm"] or tuple(reversed(range(x.rank)))
    if sorted(perm) != list(range(x.rank)):
        raise ModelFormatError(f"perm {list(perm)} is not a permutation of rank {x.rank}")
    return [TensorType(x.dtype, tuple(x.shape[p] for p in perm))]


@register("Transpose", inputs=1, infer=_transpose_rule, attrs={"perm": ()})
def transpose(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """Transpose(x) by `perm` (reversed dims when empty)."""
    x = ins[0]
    return [np.transpose(x, attrs["perm"] or None)]


def _expand_rule(ctx: InferContext) -> list[TensorType]:
    x = ctx.type(0)
    shape = _ints(ctx.const(1))
    if shape is None:
        n = ctx.type(1).shape[0]
        return [TensorType(x.dtype, _unknown(max(x.rank, n if isinstance(n, int) else 0)))]
    out = broadcast_shapes(x.shape, tuple(shape))
    if out is None:
        raise ModelFormatError(f"cannot expand {format_shape(x.shape)} to {shape}")
    return [TensorType(x.dtype, out)]


@register("Expand", inputs=2, infer=_expand_rule)
def expand(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """Expand(x, shape): broadcast x to `shape` (bidirectionally, as ONNX does)."""
    x, shape = ins
    target = np.broadcast_shapes(x.shape, tuple(int(s) for s in shape))
    return [np.array(np.broadcast_to(x, target))]


def _tile_rule(ctx: InferContext) -> list[TensorType]:
    x = ctx.type(0)
    reps = _ints(ctx.const(1))
    if reps is None:
        return [TensorType(x.dtype, _unknown(x.rank))]
    return [TensorType(x.dtype, tuple(d * r if isinstance(d, int) else (d if r == 1 else None) for d, r in zip(x.shape, reps)))]


@register("Tile", inputs=2, infer=_tile_rule)
def tile(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """Tile(x, repeats)."""
    return [np.tile(ins[0], [int(r) for r in ins[1]])]


# -- concat / split / slice --------------------------------------------------------------


def _concat_rule(ctx: InferContext) -> list[TensorType]:
    types = [t for t in ctx.types if t is not None]
    rank = types[0].rank
    axis = normalize_axis(ctx.attrs["axis"], rank)
    if any(t.rank != rank for t in types):
        raise ModelFormatError(f"inputs have different ranks {[t.rank for t in types]}")
    if len({t.dtype for t in types}) > 1:
        raise ModelFormatError(f"inputs have mismatched element types {sorted({t.dtype for t in types})}")
    sizes = [t.shape[axis] for t in types]
    total: Dim = sum(sizes) if all(isinstance(s, int) for s in sizes) else None  # type: ignore[arg-type]
    nonzero = [s for s in sizes if s != 0]
    if total is None and len(nonzero) == 1:
        total = nonzero[0]
    dims = list(types[0].shape)
    dims[axis] = total
    return [TensorType(types[0].dtype, tuple(dims))]


@register("Concat", inputs=(1, -1), infer=_concat_rule, attrs={"axis": REQUIRED})
def concat(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """Concat(x0, x1, ...) along `axis`."""
    return [np.concatenate(ins, axis=attrs["axis"])]


def _split_sizes(dim: int, attrs: dict[str, Any], split: list[int] | None, n: int) -> list[int]:
    if split is not None:
        if sum(split) != dim:
            raise ModelFormatError(f"split sizes {split} do not add up to {dim}")
        return split
    parts = attrs["num_outputs"] or n
    chunk = -(-dim // parts)  # ceil: the last part may be smaller (ONNX opset 18)
    return [min(chunk, dim - i * chunk) for i in range(parts)]


def _split_rule(ctx: InferContext) -> list[TensorType]:
    x = ctx.type(0)
    axis = normalize_axis(ctx.attrs["axis"], x.rank)
    split = _ints(ctx.const(1)) if ctx.has(1) else None
    if ctx.has(1) and split is None:
        return [TensorType(x.dtype, _unknown(x.rank))] * ctx.num_outputs
    dim = x.shape[axis]
    if not isinstance(dim, int):
        if split is not None:
            sizes: list[Dim] = list(split)
        else:
            sizes = [None] * ctx.num_outputs
    else:
        sizes = list(_split_sizes(dim, ctx.attrs, split, ctx.num_outputs))
    return [TensorType(x.dtype, x.shape[:axis] + (s,) + x.shape[axis + 1 :]) for s in sizes]


@register("Split", inputs=(1, 2), infer=_split_rule, attrs={"axis": 0, "num_outputs": 0},
          outputs=lambda attrs, n: attrs.get("num_outputs", 0) or 1, max_outputs=1 << 16)
def split(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """Split(x, split?) along `axis` into the given sizes, or into `num_outputs` parts."""
    x = ins[0]
    sizes_in = ins[1] if len(ins) > 1 and ins[1] is not None else None
    axis = normalize_axis(attrs["axis"], x.ndim)
    n = attrs["_num_outputs"]
    sizes = _split_sizes(x.shape[axis], attrs, None if sizes_in is None else [int(s) for s in sizes_in], n)
    offsets = np.cumsum([0] + sizes)
    return [np.take(x, np.arange(offsets[i], offsets[i + 1]), axis=axis) for i in range(len(sizes))]


def _slice_bounds(dim: int, start: int, end: int, step: int) -> tuple[int, int, int]:
    """Clamp ONNX slice bounds to a dim, as `slice(...).indices` does."""
    if step == 0:
        raise ModelFormatError("slice step is 0")
    return slice(start, end, step).indices(dim)


def _slice_rule(ctx: InferContext) -> list[TensorType]:
    x = ctx.type(0)
    starts, ends = _ints(ctx.const(1)), _ints(ctx.const(2))
    axes = _ints(ctx.const(3)) if ctx.has(3) else list(range(len(starts or [])))
    steps = _ints(ctx.const(4)) if ctx.has(4) else [1] * len(starts or [])
    if starts is None or ends is None or axes is None or steps is None:
        return [TensorType(x.dtype, _unknown(x.rank))]
    dims = list(x.shape)
    for start, end, axis, step in zip(starts, ends, axes, steps):
        axis = normalize_axis(axis, x.rank)
        dim = dims[axis]
        if isinstance(dim, int):
            dims[axis] = len(range(*_slice_bounds(dim, start, end, step)))
        elif start == 0 and step == 1 and end >= 2**31 - 1:
            dims[axis] = dim  # the whole symbolic dim
        else:
            dims[axis] = None
    return [TensorType(x.dtype, tuple(dims))]


@register("Slice", inputs=(3, 5), infer=_slice_rule)
def slice_(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """Slice(x, starts, ends, axes?, steps?), ONNX clamping rules."""
    x, starts, ends = ins[0], ins[1], ins[2]
    axes = ins[3] if len(ins) > 3 and ins[3] is not None else np.arange(len(starts))
    steps = ins[4] if len(ins) > 4 and ins[4] is not None else np.ones(len(starts), np.int64)
    index = [slice(None)] * x.ndim
    for start, end, axis, step in zip(starts, ends, axes, steps):
        axis = normalize_axis(int(axis), x.ndim)
        index[axis] = slice(*_slice_bounds(x.shape[axis], int(start), int(end), int(step)))
        if int(step) < 0 and index[axis].stop < 0:
            index[axis] = slice(index[axis].start, None, index[axis].step)
    return [x[tuple(index)]]


# -- gather / scatter --------------------------------------------------------------------


def _gather_rule(ctx: InferContext) -> list[TensorType]:
    data, indices = ctx.type(0), ctx.type(1)
    axis = normalize_axis(ctx.attrs["axis"], data.rank)
    return [TensorType(data.dtype, data.shape[:axis] + indices.shape + data.shape[axis + 1 :])]


def _check_indices(indices: np.ndarray, dim: int) -> np.ndarray:
    if indices.size and (indices.min() < -dim or indices.max() >= dim):
        raise ModelFormatError(f"index out of range [{-dim}, {dim})")
    return np.where(indices < 0, indices + dim, indices)


@register("Gather", inputs=2, infer=_gather_rule, attrs={"axis": 0})
def gather(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """Gather(data, indices) along `axis` (an embedding lookup at axis 0)."""
    data, indices = ins
    axis = normalize_axis(attrs["axis"], data.ndim)
    return [np.take(data, _check_indices(indices.astype(np.int64), data.shape[axis]), axis=axis)]


@register("GatherElements", inputs=2, infer=lambda ctx: [TensorType(ctx.type(0).dtype, ctx.type(1).shape)],
          attrs={"axis": 0})
def gather_elements(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """GatherElements(data, indices) along `axis`."""
    data, indices = ins
    axis = normalize_axis(attrs["axis"], data.ndim)
    return [np.take_along_axis(data, _check_indices(indices.astype(np.int64), data.shape[axis]), axis=axis)]


def _gather_nd_rule(ctx: InferContext) -> list[TensorType]:
    data, indices = ctx.type(0), ctx.type(1)
    b = ctx.attrs["batch_dims"]
    last = indices.shape[-1]
    if not isinstance(last, int):
        return [TensorType(data.dtype, _unknown(0))]
    return [TensorType(data.dtype, indices.shape[:-1] + data.shape[b + last :])]


@register("GatherND", inputs=2, infer=_gather_nd_rule, attrs={"batch_dims": 0})
def gather_nd(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """GatherND(data, indices) with `batch_dims` leading batch dims."""
    data, indices = ins
    b = attrs["batch_dims"]
    batch_shape = data.shape[:b]
    flat_data = data.reshape((-1,) + data.shape[b:])
    flat_idx = indices.reshape((-1,) + indices.shape[b:]).astype(np.int64)
    out = []
    for i in range(flat_data.shape[0]):
        idx = flat_idx[i]
        k = idx.shape[-1]
        idx = np.where(idx < 0, idx + np.array(flat_data.shape[1 : 1 + k]), idx)
        out.append(flat_data[i][tuple(np.moveaxis(idx, -1, 0))])
    result = np.stack(out) if out else np.zeros((0,), data.dtype)
    return [result.reshape(batch_shape + indices.shape[b:-1] + data.shape[b + indices.shape[-1] :])]


@register("ScatterND", inputs=3, infer=same_rule, attrs={"reduction": "none"})
def scatter_nd(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """ScatterND(data, indices, updates): copy of data with slices replaced (or reduced)."""
    data, indices, updates = ins
    out = data.copy()
    k = indices.shape[-1]
    flat_idx = indices.reshape(-1, k)
    flat_upd = updates.reshape((-1,) + data.shape[k:])
    ops = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}
    for idx, upd in zip(flat_idx, flat_upd):
        key = tuple(int(i) for i in idx)
        out[key] = upd if attrs["reduction"] == "none" else ops[attrs["reduction"]](out[key], upd)
    return [out]


@register("ScatterElements", inputs=3, infer=same_rule, attrs={"axis": 0, "reduction": "none"})
def scatter_elements(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """ScatterElements(data, indices, updates) along `axis`."""
    data, indices, updates = ins
    axis = normalize_axis(attrs["axis"], data.ndim)
    out = data.copy()
    idx = _check_indices(indices.astype(np.int64), data.shape[axis])
    if attrs["reduction"] == "none":
        np.put_along_axis(out, idx, updates, axis=axis)
        return [out]
    ufunc = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}[attrs["reduction"]]
    for pos in np.ndindex(*idx.shape):
        target = list(pos)
        target[axis] = idx[pos]
        out[tuple(target)] = ufunc(out[tuple(target)], updates[pos])
    return [out]


# -- shape queries and generators --------------------------------------------------------


def _shape_rule(ctx: InferContext) -> list[TensorType]:
    rank = ctx.type(0).rank
    start, end = ctx.attrs["start"], ctx.attrs["end"]
    n = len(range(*slice(start, end if end is not None else rank).indices(rank)))
    return [TensorType("int64", (n,))]


@register("Shape", inputs=1, infer=_shape_rule, attrs={"start": 0, "end": None})
def shape(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """Shape(x)[start:end] as int64."""
    dims = ins[0].shape
    end = attrs["end"] if attrs["end"] is not None else len(dims)
    return [np.array(dims[slice(*slice(attrs["start"], end).indices(len(dims)))], dtype=np.int64)]


@register("Size", inputs=1, infer=lambda ctx: [TensorType("int64", ())])
def size(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """Size(x): element count as an int64 scalar."""
    return [np.array(ins[0].size, dtype=np.int64)]


def _constant_of_shape_rule(ctx: InferContext) -> list[TensorType]:
    dims = _ints(ctx.const(0))
    if dims is None:
        n = ctx.type(0).shape[0]
        return [TensorType(ctx.attrs["dtype"], _unknown(n if isinstance(n, int) else 0))]
    return [TensorType(ctx.attrs["dtype"], tuple(dims))]


@register("ConstantOfShape", inputs=1, infer=_constant_of_shape_rule, attrs={"value": 0.0, "dtype": "float32"})
def constant_of_shape(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """ConstantOfShape(shape): a tensor of `shape` filled with `value` of type `dtype`."""
    return [np.full([int(d) for d in ins[0]], attrs["value"], dtype=numpy_dtype(attrs["dtype"]))]


def _range_rule(ctx: InferContext) -> list[TensorType]:
    start, limit, delta = (ctx.const(i) for i in range(3))
    n: Dim = None
    if start is not None and limit is not None and delta is not None:
        n = max(int(math.ceil((float(limit) - float(start)) / float(delta))), 0)
    return [TensorType(ctx.type(0).dtype, (n,))]


@register("Range", inputs=3, infer=_range_rule)
def range_(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """Range(start, limit, delta)."""
    start, limit, delta = ins
    return [np.arange(start, limit, delta, dtype=start.dtype)]


@register("Trilu", inputs=(1, 2), infer=same_rule, attrs={"upper": 1})
def trilu(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """Trilu(x, k?): keep the upper (or lower) triangle of the last two dims."""
    x = ins[0]
    k = int(ins[1]) if len(ins) > 1 and ins[1] is not None else 0
    return [np.triu(x, k) if attrs["upper"] else np.tril(x, k)]


@register("CumSum", inputs=2, infer=same_rule, attrs={"exclusive": 0, "reverse": 0})
def cumsum(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """CumSum(x, axis): running sum, optionally exclusive and/or reversed."""
    x, axis = ins
    axis = normalize_axis(int(axis), x.ndim)
    data = np.flip(x, axis) if attrs["reverse"] else x
    out = np.cumsum(data, axis=axis, dtype=x.dtype)
    if attrs["exclusive"]:
        out = out - data
    return [np.flip(out, axis) if attrs["reverse"] else out]


def _pad_rule(ctx: InferContext) -> list[TensorType]:
    x = ctx.type(0)
    pads = _ints(ctx.const(1))
    axes = _ints(ctx.const(3)) if ctx.has(3) else list(range(x.rank))
    if pads is None or axes is None:
        return [TensorType(x.dtype, _unknown(x.rank))]
    dims = list(x.shape)
    n = len(axes)
    for i, axis in enumerate(axes):
        axis = normalize_axis(axis, x.rank)
        d = dims[axis]
        dims[axis] = d + pads[i] + pads[i + n] if isinstance(d, int) else None
    return [TensorType(x.dtype, tuple(dims))]


@register("Pad", inputs=(2, 4), infer=_pad_rule, attrs={"mode": "constant"})
def pad(ins: list[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    """Pad(x, pads, value?, axes?): constant, edge or reflect padding."""
    x, pads = ins[0], [int(p) for p in ins[1]]
    value = ins[2] if len(ins) > 2 and ins[2] is not None else None
    axes = [int(a) for a in ins[3]] if len(ins) > 3 and ins[3] is not None else list(range(x.ndim))
    widths = [(0, 0)] * x.ndim
    n = len(axes)
    for i, axis in enumerate(axes):
        widths[normalize_axis(axis, x.ndim)] = (pads[i], pads[i + n])
    # Negative pads crop.
    crop = tuple(slice(-b if b < 0 else 0, (x.shape[i] + a) if a < 0 else None) for i, (b, a) in enumerate(widths))
    x = x[crop]
    widths = [(max(b, 0), max(a, 0)) for b, a in widths]
    if attrs["mode"] == "constant":
        fill = value.reshape(()) if value is not None and value.size else 0
        return [np.pad(x, widths, mode="constant", constant_values=fill)]
    mode = {"edge": "edge", "reflect": "reflect", "wrap": "wrap"}[attrs["mode"]]
    return [np.pad(x, widths, mode=mode)]  # type: ignore[call-overload]
