"""The op registry: one entry per op, holding its type rule and its numpy reference kernel.

The op set is closed: every node's `op` must name a registered `OpDef`. The kernel is the
executable meaning of the op (the interpreter calls it); the type rule computes output
types from input types, attributes and, where the output shape depends on them, the
values of constant inputs. A rule answers `None` for a dim it cannot know (a reshape to
a computed shape); the importer fills those from the source model's shape inference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aviatorc.errors import ModelFormatError
from aviatorc.ir.types import TensorType

REQUIRED = object()  # marks an attribute without a default


@dataclass
class InferContext:
    """What a type rule sees: input types, constant input values, attributes."""

    op: str
    types: list[TensorType | None]
    consts: list[np.ndarray | None]
    attrs: dict[str, Any]
    num_outputs: int

    def type(self, index: int) -> TensorType:
        t = self.types[index] if index < len(self.types) else None
        if t is None:
            raise ModelFormatError(f"input {index} is required", op=self.op)
        return t

    def const(self, index: int) -> np.ndarray | None:
        return self.consts[index] if index < len(self.consts) else None

    def has(self, index: int) -> bool:
        return index < len(self.types) and self.types[index] is not None


Kernel = Callable[[list[Any], dict[str, Any]], Sequence[np.ndarray]]
TypeRule = Callable[[InferContext], list[TensorType]]


@dataclass(frozen=True)
class OpDef:
    """An op: arity, attributes with defaults, type rule, reference kernel, one-line doc."""

    name: str
    min_inputs: int
    max_inputs: int  # -1: variadic
    attrs: dict[str, Any]
    infer: TypeRule
    kernel: Kernel
    doc: str
    num_outputs: Callable[[dict[str, Any], int], int] = field(default=lambda attrs, n_in: 1)
    max_outputs: int = 1

    def resolve_attrs(self, attrs: dict[str, Any], node_name: str = "") -> dict[str, Any]:
        """Attributes with defaults filled in; unknown or missing ones are errors."""
        unknown = sorted(set(attrs) - set(self.attrs))
        if unknown:
            raise ModelFormatError(f"unknown attribute(s) {', '.join(unknown)}", node=node_name, op=self.name)
        resolved = {}
        for key, default in self.attrs.items():
            if key in attrs:
                resolved[key] = attrs[key]
            elif default is REQUIRED:
                raise ModelFormatError(f"attribute '{key}' is required", node=node_name, op=self.name)
            else:
                resolved[key] = default
        return resolved


OPS: dict[str, OpDef] = {}


def register(
    name: str,
    *,
    inputs: int | tuple[int, int],
    infer: TypeRule,
    attrs: dict[str, Any] | None = None,
    outputs: int | Callable[[dict[str, Any], int], int] = 1,
    max_outputs: int | None = None,
) -> Callable[[Kernel], Kernel]:
    """Decorator registering a kernel `(inputs, attrs) -> outputs` under an op name."""
    min_in, max_in = (inputs, inputs) if isinstance(inputs, int) else inputs

    def decorate(kernel: Kernel) -> Kernel:
        if name in OPS:
            raise RuntimeError(f"op {name} registered twice")
        count = outputs if callable(outputs) else (lambda attrs, n_in, k=outputs: k)
        OPS[name] = OpDef(
            name=name,
            min_inputs=min_in,
            max_inputs=max_in,
            attrs=dict(attrs or {}),
            infer=infer,
            kernel=kernel,
            doc=(kernel.__doc__ or "").strip().splitlines()[0] if kernel.__doc__ else "",
            num_outputs=count,
            max_outputs=max_outputs or (outputs if isinstance(outputs, int) else 1),
        )
        return kernel

    return decorate


def get_op(name: str) -> OpDef:
    try:
        return OPS[name]
    except KeyError:
        raise ModelFormatError(f"op '{name}' is not in the IR's op set") from None


def infer_types(op: str, types: list[TensorType | None], consts: list[np.ndarray | None],
                attrs: dict[str, Any], num_outputs: int = 1, node_name: str = "") -> list[TensorType]:
    """Run an op's type rule with defaults filled in; errors name the node."""
    opdef = get_op(op)
    resolved = opdef.resolve_attrs(attrs, node_name)
    try:
        return opdef.infer(InferContext(op, types, consts, resolved, num_outputs))
    except ModelFormatError as error:
        if error.node is None:
            error.node, error.op = node_name, op
            error.args = (str(error),)
        raise
