"""Weight quantization and 2:4 sparsity numerics, independent of the IR passes that use them.

`rtn` holds the storage layouts (packing, exact bytes) and round-to-nearest quantization;
`tiles` slices a packed weight into the tiles the plan stores and dequantizes one on its own;
`gptq` and `awq` the calibrated methods; `sparse` the 2:4 selection rules;
`calibration` the per-MatMul activation statistics (real tokens only: padding left out); `sequential` the one driver that
evaluates the graph stage by stage for them while a pass rewrites it (sequential calibration).
"""

from aviatorc.quant.rtn import PackedWeight, dequantize, pack_weight, packed_layout

__all__ = ["PackedWeight", "dequantize", "pack_weight", "packed_layout"]
