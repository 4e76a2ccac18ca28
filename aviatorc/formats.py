"""Weight storage formats and their exact byte counts.

One place answers "how many bytes does this [K, N] weight cost in SRAM": the quantize and
sparsify passes record a `WeightFormat` on each weight they rewrite, and tiling and the
partitioner count bytes with it. K is the reduction dim (rows of a [K, N] weight), N the
output channels.

Layouts (bytes per [K, N] matrix; G = ceil(K / group) groups, Kp = G * group):
- fp32 / fp16 / bf16: K * N * itemsize.
- int8 per output channel (group_size 0): K * N bytes + one fp16 scale per output channel (N * 2).
- int8 group-wise (group_size 32/64/128): Kp * N bytes (K padded up to a multiple of the group)
  + G * N * 2 (an fp16 scale per (group, channel)); named `int8-g<group>`.
- int4: ceil(Kp / 2) * N (K padded up to a multiple of the group, two values per byte along
  K) + G * N * 2 (an fp16 scale per (group, channel)) and, if asymmetric,
  ceil(G / 2) * N (a 4-bit zero point per (group, channel), two groups per byte along G), or
  with `zero="fp16"` G * N * 2 (an fp16 offset per (group, channel): w = code * scale + offset,
  llama.cpp's Q4_1 and HQQ's float zero; 5 bits a weight at g32, where a 4-bit zero point
  gives 4.625).
- mxint8 / mxint4: blocks of `group_size` (32 by default) along K share an 8-bit exponent:
  Kp * N (mxint8) or ceil(Kp / 2) * N (mxint4), + G * N.
- 2:4 sparsity keeps half of K (Ks = 2 * ceil(K / 4) rows) and a 2-bit index per kept value,
  four per byte along Ks: ceil(Ks / 4) * N; it composes with any of the above (the kept
  values are stored in that format, with K replaced by Ks).

Every term is (rows) * N or a multiple of N: each stored array keeps whole columns, so the
bytes of column strips add up exactly to the weight's and a strip is a slice of the arrays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from aviatorc.errors import OptionError

KINDS = ("fp32", "fp16", "bf16", "int8", "int4", "mxint8", "mxint4")
_DENSE_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "int8": 8, "int4": 4, "mxint8": 8, "mxint4": 4}
GROUP_SIZES = (32, 64, 128)
# Activations on the links between chiplets (`--link-dtype`): as computed, or int8 codes with an
# exponent per 32 values (`aviatorc.quant.link.int8_groups`).
LINK_DTYPES = ("fp16", "int8")
ZERO_KINDS = ("int", "fp16")  # asymmetric int4's zero: a 4-bit zero point, or an fp16 offset
_ALWAYS_GROUPED = ("int4", "mxint8", "mxint4")  # int8 is grouped only with a group size (else per channel)


@dataclass(frozen=True)
class WeightFormat:
    """How one weight matrix is stored."""

    kind: str = "fp32"
    group_size: int = 0  # elements along K sharing a scale; 0 where not grouped (int8: per output channel)
    symmetric: bool = True
    sparsity: str = ""  # "" or "2:4"
    zero: str = "int"  # asymmetric int4: "int", a 4-bit zero point; "fp16", an fp16 offset (see ZERO_KINDS)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise OptionError(f"unknown weight format '{self.kind}'", hint=f"choose one of {', '.join(KINDS)}")
        if self.group_size < 0 or self.kind in _ALWAYS_GROUPED and self.group_size == 0:
            raise OptionError(f"format '{self.kind}' needs a positive group size, not {self.group_size}")
        if self.sparsity not in ("", "2:4"):
            raise OptionError(f"unknown sparsity '{self.sparsity}'", hint="the only structured sparsity is '2:4'")
        if self.zero not in ZERO_KINDS or self.zero != "int" and (self.kind != "int4" or self.symmetric or self.sparsity):
            raise OptionError(f"zero '{self.zero}' is not a zero point of format '{self.kind}'"
                              + (" (symmetric)" if self.symmetric else "")
                              + (" (2:4 sparse: a pruned weight must read 0)" if self.sparsity else ""),
                              hint="an fp16 offset is dense asymmetric int4's alone; zero kinds: " + ", ".join(ZERO_KINDS))

    @property
    def float_zero(self) -> bool:
        """Whether each group stores an fp16 offset (w = code * scale + offset) instead of a 4-bit zero point."""
        return self.zero == "fp16"

    @property
    def grouped(self) -> bool:
        """Whether scales are per group of `group_size` rows along K (else per output channel, or none)."""
        return self.kind in _ALWAYS_GROUPED or self.kind == "int8" and self.group_size > 0

    @property
    def bits(self) -> int:
        return _DENSE_BITS[self.kind]

    @property
    def name(self) -> str:
        text = self.kind
        if self.grouped:
            text += f"-g{self.group_size}"
        if self.kind == "int4" and not self.symmetric:
            text += "-asym" + ("-fp16zero" if self.float_zero else "")
        if self.sparsity:
            text += "-sp" + self.sparsity.replace(":", "")
        return text

    def storage_bytes(self, k: int, n: int) -> int:
        """Exact bytes of a [k, n] weight in this format, scales, zero points and indices included.

        Linear in n (every stored array is [rows, n] or [n]), so column strips add up exactly."""
        if self.sparsity == "2:4":
            kept = math.ceil(k / 4) * 2  # values kept along K
            index_bytes = math.ceil(kept / 4) * n  # a 2-bit position per kept value, four per byte along K
            return self._dense_bytes(kept, n) + index_bytes
        return self._dense_bytes(k, n)

    def _dense_bytes(self, k: int, n: int) -> int:
        if self.kind in ("fp32", "fp16", "bf16"):
            return k * n * self.bits // 8
        if self.kind == "int8" and not self.grouped:
            return k * n + n * 2  # one fp16 scale per output channel
        groups = math.ceil(k / self.group_size)
        k_pad = groups * self.group_size  # a ragged last group is padded
        values = math.ceil(k_pad * self.bits / 8) * n  # 4-bit: two rows per byte along K
        if self.kind in ("int4", "int8"):
            scales = groups * n * 2  # fp16 per (group, channel)
            asymmetric = self.kind == "int4" and not self.symmetric  # int8 is symmetric only
            zeros = (groups * n * 2 if self.float_zero  # an fp16 offset per (group, channel)
                     else math.ceil(groups / 2) * n if asymmetric else 0)  # two groups per byte along G
            return values + scales + zeros
        return values + groups * n  # mx: one shared 8-bit exponent per block

    def to_attrs(self) -> dict[str, Any]:
        attrs: dict[str, Any] = {"format": self.kind, "group_size": self.group_size, "symmetric": int(self.symmetric),
                                 "sparsity": self.sparsity}
        if self.float_zero:  # only then: the other formats' attributes (and plans) stay as they were
            attrs["zero"] = self.zero
        return attrs

    @classmethod
    def from_attrs(cls, attrs: dict[str, Any]) -> WeightFormat:
        return cls(str(attrs["format"]), int(attrs.get("group_size", 0)), bool(attrs.get("symmetric", 1)),
                   str(attrs.get("sparsity", "")), str(attrs.get("zero", "int")))


def dense_format(dtype: str) -> WeightFormat:
    """The format of an unquantized weight of an IR element type."""
    return WeightFormat({"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}.get(dtype, "fp32"))
