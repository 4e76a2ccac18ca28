"""Activations on the links between chiplets at 8 bits (`--link-dtype int8`): how the runtime
rounds what it sends, and the group the cost model charges an exponent for."""

from __future__ import annotations

import numpy as np

LINK_GROUP = 32  # `--link-dtype int8`: elements sharing one scale along a row, as MXINT8 shares an exponent


def int8_groups(array: np.ndarray) -> np.ndarray:
    """An activation as `--link-dtype int8` sends it: along the last axis, each group of
    `LINK_GROUP` elements as int8 codes times one power-of-two scale (an 8-bit exponent, MX style:
    the smallest 2^e with the group's largest magnitude within 127 x 2^e), back in its own dtype.
    Groups keep outliers (a model's massive activations) from flattening a whole row. Integer
    arrays (ids) go as they are, and so do groups with a non-finite value (an attention mask)."""
    if array.dtype.kind in "iub" or array.ndim == 0 or array.size == 0:
        return array
    width = array.shape[-1]
    padded = -(-width // LINK_GROUP) * LINK_GROUP
    values = np.zeros((*array.shape[:-1], padded), dtype=np.float32)
    values[..., :width] = array
    groups = values.reshape(*array.shape[:-1], padded // LINK_GROUP, LINK_GROUP)
    largest = np.max(np.abs(groups), axis=-1, keepdims=True)
    plain = ~np.isfinite(largest)
    with np.errstate(divide="ignore", invalid="ignore"):
        exponent = np.ceil(np.log2(np.where(plain | (largest == 0), 127.0, largest) / 127))
    scale = np.exp2(exponent)
    rounded = np.where(plain, groups, np.clip(np.rint(groups / scale), -127, 127) * scale)
    return rounded.reshape(values.shape)[..., :width].astype(array.dtype)
