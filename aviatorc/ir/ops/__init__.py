"""The closed op set. Importing this package registers every op family."""

from aviatorc.ir.ops import elementwise, moe, nn, quant, shape  # noqa: F401  (registration)
from aviatorc.ir.ops.registry import OPS, REQUIRED, InferContext, OpDef, get_op, infer_types

__all__ = ["OPS", "REQUIRED", "InferContext", "OpDef", "get_op", "infer_types"]
