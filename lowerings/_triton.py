"""Triton helpers the kernels of several ops share."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowerings._library import interpreting


def exact_fp32_products(dtype: torch.dtype) -> bool:
    """Whether ``tl.dot`` must multiply exactly in fp32 (``input_precision="ieee"``): fp32 inputs unless the user
    allowed TF32, as PyTorch's matmul does, and always in the interpreter, whose 16-bit dot is wrong."""
    if interpreting():
        return True
    return dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest"


@triton.jit
def as_fp32(value):
    """A float kernel argument as fp32. Inductor passes Python floats to user kernels as fp64 (or as constexpr
    when they equal 1); an fp64 scale would promote a kernel's running fp32 statistics to fp64 mid-loop, which
    Triton rejects for loop-carried values."""
    return tl.cast(value, tl.float32)


@triton.jit
def tanh(x):
    """tanh(x) = 2·sigmoid(2x) − 1, the one spelling the CCE kernels share."""
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0
