"""(no jax) MXFP4 weights (GPT-OSS's released experts) de-quantized on the host, numpy only.

A tensor `W` [E, N, K] (transformers' `*_proj` of its experts, stored transposed as
[E, K, N]) is stored as `W_blocks` uint8 [E, N, K/32, 16] and `W_scales` uint8
[E, N, K/32]: each 32-element block of a row has one shared exponent (scale - 127) and 32
4-bit E2M1 codes, two per byte, the low nibble first. An element is FP4[code] * 2^(scale -
127), FP4 = {+-0, 0.5, 1, 1.5, 2, 3, 4, 6}. Every such value is exact in float32 (a power
of two times a 3-bit significand; exponents within float32's range), so the float32
result converted to bfloat16 or float16 is what transformers' de-quantization in that
dtype gives, bit for bit (tests/model/test_gpt_oss.py compares them).
"""

from __future__ import annotations

import numpy as np

FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 [E, K, N] (transformers' layout of the experts' `*_proj`) from `blocks`
    uint8 [E, N, G, B] and `scales` uint8 [E, N, G] (K = G * 2B)."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or \
            blocks.shape[:-1] != scales.shape or blocks.ndim != 4:
        raise ValueError(f"MXFP4 blocks [E, N, G, B] and scales [E, N, G] of uint8 expected, "
                         f"got {blocks.dtype}{list(blocks.shape)} and "
                         f"{scales.dtype}{list(scales.shape)}")
    values = np.empty((*blocks.shape[:-1], 2 * blocks.shape[-1]), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    exponents = scales.astype(np.int32)[..., None] - 127
    out = np.ldexp(values, exponents).astype(np.float32)  # exact: a power-of-two scaling
    e, n, g, b = out.shape
    return np.ascontiguousarray(out.reshape(e, n, g * b).transpose(0, 2, 1))


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(blocks, scales) of float `w` [E, K, N] (K a multiple of 32): each row's 32-element
    blocks at the smallest exponent that fits the block's largest magnitude, each element
    rounded to the nearest FP4 value. For tests and benchmarks' random checkpoints; the
    rounding need not be any converter's: only `dequantize` of its output is compared."""
    e, k, n = w.shape
    rows = np.ascontiguousarray(np.asarray(w, np.float32).transpose(0, 2, 1))  # [E, N, K]
    blocks = rows.reshape(e, n, k // 32, 32)
    peak = np.max(np.abs(blocks), axis=-1)
    exp = np.where(peak > 0, np.ceil(np.log2(np.maximum(peak, 1e-30) / 6.0)), 0)
    exp = np.clip(exp, -127, 127).astype(np.int32)
    scaled = blocks / np.ldexp(np.float32(1.0), exp)[..., None]
    codes = np.argmin(np.abs(scaled[..., None] - FP4_VALUES[:8]), axis=-1).astype(np.uint8)
    codes = codes | np.where(scaled < 0, 8, 0).astype(np.uint8)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return packed, (exp + 127).astype(np.uint8)
