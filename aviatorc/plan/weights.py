"""Each placed tile's stored arrays, cut from the graph's weights, for weights.safetensors.

A tile's arrays are named `t<index>.<slot>` with the `DequantizeWeight` slots (values, scale,
zero, indices) of its own [k, n] layout, cut by `aviatorc.quant.tiles.slice_packed` (the one
place that slices stored weights), so a runtime dequantizes a tile without the rest of its
weight. A dense weight is stored as its [k, n] strip (a weight read through a Transpose is
viewed as [k, n] first; a tied head's strip is a row range of the table, transposed), an
embedding row tile as its rows. Every other initializer of the
graph (norm weights, biases, rotary tables) is stored whole as `init.<name>`.
"""

from __future__ import annotations

import numpy as np

from aviatorc.formats import WeightFormat, dense_format
from aviatorc.ir import Graph, Value
from aviatorc.ir.ops.quant import ROLES
from aviatorc.partition.placement import Placement
from aviatorc.partition.tiling import Tile
from aviatorc.quant.tiles import slice_packed


def pack_weights(graph: Graph, placement: Placement) -> dict[str, np.ndarray] | None:
    """The artifact's tensors; None when the graph is shape-only (no bytes to store)."""
    if any(not v.data.available for v in graph.initializers.values() if v.data is not None):
        return None
    nodes = {n.name: n for n in graph.nodes}
    tensors: dict[str, np.ndarray] = {}
    stored: set[str] = set()  # initializers the tiles stand for
    for index, tile in enumerate(placement.tiles):
        node = nodes[tile.nodes[0]]
        source = node.inputs[0] if node.op == "Gather" else node.inputs[1]
        assert source is not None
        for slot, array in _tile_arrays(source, tile, node.op == "Gather", stored):
            tensors[f"t{index}.{slot}"] = array
    for name, value in sorted(graph.initializers.items()):
        if name not in stored and value.data is not None:
            tensors[f"init.{name}"] = value.data.load()
    return tensors


def _tile_arrays(value: Value, tile: Tile, lookup: bool, stored: set[str]) -> list[tuple[str, np.ndarray]]:
    transposed = False
    while value.producer is not None and value.producer.op in ("Cast", "Transpose"):
        transposed ^= value.producer.op == "Transpose"
        value = value.producer.input(0)
    producer = value.producer
    if producer is not None and producer.op == "DequantizeWeight":
        fmt = WeightFormat.from_attrs(producer.attrs)
        arrays = [v.data.load() if v is not None and v.data is not None else None for v in producer.inputs]
        stored.update(v.name for v in producer.inputs if v is not None)
        k, n = (int(d) for d in producer.outputs[0].type.shape[-2:])  # type: ignore[arg-type]
        pieces = slice_packed(fmt, arrays, k, n, cols=(tile.n_start, tile.n_stop))
        return [(role, a) for role, a in zip(ROLES, pieces, strict=False) if a is not None]
    if value.data is None:
        raise ValueError(f"tile of '{tile.weight}' reads '{value.name}', which is neither stored nor dequantized")
    stored.add(value.name)
    array = value.data.load()
    fmt = dense_format(value.type.dtype)
    if tile.is_embedding:  # rows of a table read by lookups
        pieces = slice_packed(fmt, [array], *array.shape, rows=(tile.k_start, tile.k_stop))
    else:
        if transposed or lookup:  # stored [n, k] (a torch linear, a tied head's table): its [k, n] view
            array = array.T
        pieces = slice_packed(fmt, [array], *array.shape, cols=(tile.n_start, tile.n_stop))
    assert pieces[0] is not None
    return [("values", pieces[0])]
