"""One weight tile's stored arrays, and a tile dequantized on its own.

The plan stores each tile of a weight as its own set of packed arrays, and a runtime
dequantizes one tile without the others. This module is the one place that slices packed
weights (layouts in `aviatorc.quant.rtn`):

- a linear weight's tile is a column strip [all K] x [n0, n1). Every stored array keeps whole
  columns in its last axis (values [*, N], scale [G, N] or [N], zero [ceil(G/2), N], indices
  [ceil(Ks/4), N]), so the strip is `arr[..., n0:n1]` of each, and is exactly the layout of a
  [K, n1 - n0] weight: its bytes are `fmt.storage_bytes(K, n1 - n0)` and the strips' bytes add
  up to the weight's.
- an embedding table's tile is a row range [k0, k1) x all N. Tables are kept dense (fp32 /
  fp16 / bf16), whose only array is the values, so the range is `values[k0:k1]`. Row ranges
  of other formats are refused: their groups, per-channel scales and 2:4 indices run along K,
  so a row range is not a layout of its own.

`dequantize_packed` runs the `DequantizeWeight` kernel itself (`aviatorc.ir.ops.quant.dequantize`):
a tile read back here gives exactly the columns of the whole weight read back by the IR.
Numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from aviatorc.errors import ModelFormatError, OptionError
from aviatorc.formats import WeightFormat
from aviatorc.ir.ops.quant import _FLOAT_DTYPES, dequantize, layout_mismatch, packed_layout


def check_packed(fmt: WeightFormat, arrays: Sequence[np.ndarray | None], k: int, n: int) -> None:
    """Raise ModelFormatError unless `arrays` are the stored layout of a [k, n] weight in `fmt`."""
    stored = [(a.dtype.name, tuple(a.shape)) if a is not None else None for a in arrays]
    problem = layout_mismatch(fmt, k, n, stored)
    if problem:
        raise ModelFormatError(
            problem, hint="the arrays must come from pack_weight or slice_packed of the same format and shape"
        )


def slice_packed(
    fmt: WeightFormat,
    arrays: Sequence[np.ndarray | None],
    k: int,
    n: int,
    *,
    cols: tuple[int, int] | None = None,
    rows: tuple[int, int] | None = None,
) -> list[np.ndarray | None]:
    """The stored arrays of the tile rows [k0, k1) x columns [n0, n1) of a [k, n] weight.

    `arrays` are the whole weight's, in `DequantizeWeight` input order; the result is in the
    same order (None where a slot is absent, trailing absent slots dropped) and is the layout
    of a [k1 - k0, n1 - n0] weight, each array contiguous (ready to write). `cols` defaults to
    all columns and `rows` to all rows; a partial row range needs a dense float format
    without sparsity (an embedding table).
    """
    check_packed(fmt, arrays, k, n)
    n0, n1 = _check_range("cols", cols, n)
    k0, k1 = _check_range("rows", rows, k)
    if (k0, k1) != (0, k) and (fmt.kind not in _FLOAT_DTYPES or fmt.sparsity):
        raise OptionError(
            f"rows [{k0}, {k1}) of a [{k}, {n}] {fmt.name} weight are not a tile of their own",
            hint="only dense fp32 / fp16 / bf16 weights (embedding tables) split by rows; "
            "split quantized or 2:4 weights into column strips (cols=)",
        )
    tile: list[np.ndarray | None] = []
    for slot, array in zip(packed_layout(fmt, k, n), arrays, strict=False):
        if slot is None or array is None:
            tile.append(None)
        elif slot[0] == "values" and (k0, k1) != (0, k):
            tile.append(np.ascontiguousarray(array[k0:k1, n0:n1]))
        else:
            tile.append(np.ascontiguousarray(array[..., n0:n1]))
    return tile


def dequantize_packed(fmt: WeightFormat, arrays: Sequence[np.ndarray | None], k: int, n: int) -> np.ndarray:
    """The float32 [k, n] weight (or tile) that stored `arrays` stand for: the `DequantizeWeight`
    kernel, after checking the arrays against the layout."""
    check_packed(fmt, arrays, k, n)
    return dequantize(list(arrays), fmt, k, n)


def _check_range(name: str, span: tuple[int, int] | None, size: int) -> tuple[int, int]:
    if span is None:
        return 0, size
    start, stop = (int(x) for x in span)
    if not 0 <= start < stop <= size:
        raise OptionError(f"{name} [{start}, {stop}) is not a non-empty range inside [0, {size})")
    return start, stop
