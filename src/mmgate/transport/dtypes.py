"""Encoder-input dtype conversion: float32 -> bfloat16 / float16.

Stage: assemble.  ``to_bfloat16_bits`` returns the uint16 bit patterns of
bfloat16 with round-to-nearest-even, as torch's ``Tensor.to(torch.bfloat16)``
(``c10/util/BFloat16.h`` ``round_to_nearest_even``): NaN stays a quiet NaN,
infinities stay infinities.  ``to_float16`` is numpy's IEEE conversion (RNE),
identical to torch's ``.half()``.
"""

from __future__ import annotations

from enum import StrEnum

import numpy as np
import numpy.typing as npt


class EncoderDtype(StrEnum):
    """Dtype of floating encoder inputs on the wire."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


def to_bfloat16_bits(x: npt.NDArray[np.float32]) -> npt.NDArray[np.uint16]:
    """float32 array -> uint16 bfloat16 bit patterns (same shape), round to nearest even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    out = ((bits + rounding) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = np.uint16(0x7FC0)
    return out


def to_float16(x: npt.NDArray[np.float32]) -> npt.NDArray[np.float16]:
    """float32 -> float16 (IEEE round to nearest even)."""
    with np.errstate(over="ignore"):  # overflow to +-inf is the IEEE result, as torch gives it
        return np.asarray(x, dtype=np.float32).astype(np.float16)


def convert_encoder_input(x: np.ndarray, dtype: EncoderDtype) -> tuple[np.ndarray, str]:
    """Convert a float32 encoder input; returns (array, wire dtype name). Non-float arrays pass through."""
    if x.dtype != np.float32 or dtype is EncoderDtype.FLOAT32:
        return x, ""
    if dtype is EncoderDtype.BFLOAT16:
        return to_bfloat16_bits(x), "bfloat16"
    return to_float16(x), "float16"
