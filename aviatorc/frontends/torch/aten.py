"""The ATen conversion table: op key ("aten.linear") -> converter.

A converter is `fn(cx: Lowering, node: fx.Node)` returning the node's IR value (a list for
ops with several results, None for assertions). Converters live by op family in
`aten_elementwise.py`, `aten_shape.py` and `aten_nn.py`; each registers itself here with
`@converts(...)`. The importer decomposes (`ep.run_decompositions`) only the ops that are
not in this table, so high-level ops (linear, scaled_dot_product_attention, layer_norm,
embedding) keep their one-node IR form.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

TABLE: dict[str, Callable[[Any, Any], Any]] = {}


def converts(*keys: str) -> Callable[[Callable[[Any, Any], Any]], Callable[[Any, Any], Any]]:
    """Register a converter under one or more op keys ("aten.add", "operator.getitem")."""

    def decorate(fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        for key in keys:
            if key in TABLE:
                raise RuntimeError(f"two converters for {key}")
            TABLE[key] = fn
        return fn

    return decorate


def supported_keys() -> frozenset[str]:
    """Every op key the importer converts (after loading the family modules)."""
    load()
    return frozenset(TABLE)


def load() -> dict[str, Callable[[Any, Any], Any]]:
    """The full table (importing the family modules registers their converters)."""
    from aviatorc.frontends.torch import aten_complex, aten_elementwise, aten_nn, aten_shape  # noqa: F401

    return TABLE
