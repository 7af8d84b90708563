"""Host-side bf16 / fp16 bits for the GPU tests: what ``to_dtype`` makes of float32 values, and back."""

from __future__ import annotations

import numpy as np


def to_f32(bits: np.ndarray, dtype: str) -> np.ndarray:
    """Host bits as to_dtype makes them (uint16 for bfloat16, float16) -> float32."""
    from hybrid_runtime.weights_io import bf16_to_f32

    return bf16_to_f32(bits) if dtype == "bfloat16" else bits.view(np.float16).astype(np.float32)


def host_bits(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 -> the dtype's host bits (uint16 for bfloat16, float16), rounded as the backend rounds."""
    from hybrid_runtime.cuda.backend import to_dtype

    return to_dtype(x, dtype)
