"""Triton helpers the kernels of several ops share."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def as_fp32(value):
    """A float kernel argument as fp32. Inductor passes Python floats to user kernels as fp64 (or as constexpr
    when they equal 1); an fp64 scale would promote a kernel's running fp32 statistics to fp64 mid-loop, which
    Triton rejects for loop-carried values."""
    return tl.cast(value, tl.float32)
