"""Triton kernels of WTA-CRS sampling for eager CUDA calls: row norms and the fused gather-and-weight of samples.

Inside compiled graphs Inductor generates the equivalent kernels from the PyTorch reference (``op.py``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _row_norms_kernel(X, Out, n_cols, stride_row, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = X + row.to(tl.int64) * stride_row
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        values = tl.load(base + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        acc += values * values
    tl.store(Out + row, tl.sqrt(tl.sum(acc, axis=0)))


@triton.jit
def _gather_rows_kernel(X, Index, Weight, Out, n_cols, stride_row, BLOCK: tl.constexpr):
    slot = tl.program_id(0)
    source = tl.load(Index + slot)
    scale = tl.load(Weight + slot)
    src = X + source * stride_row
    dst = Out + slot.to(tl.int64) * n_cols
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        values = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(dst + cols, (values * scale).to(Out.dtype.element_ty), mask=mask)


def _block(n_cols: int) -> int:
    return min(1024, triton.next_power_of_2(max(n_cols, 16)))


def row_norms(x: torch.Tensor) -> torch.Tensor:
    """‖x_i‖₂ in fp32 for each row of a 2-D tensor whose rows are contiguous."""
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    _row_norms_kernel[(x.shape[0],)](x, out, x.shape[1], x.stride(0), BLOCK=_block(x.shape[1]))
    return out


def gather_rows(x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x[index] · weight[:, None] in x's dtype, contiguous [k, D]."""
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty((index.numel(), x.shape[1]), dtype=x.dtype, device=x.device)
    _gather_rows_kernel[(index.numel(),)](
        x, index, weight.float().contiguous(), out, x.shape[1], x.stride(0), BLOCK=_block(x.shape[1])
    )
    return out
