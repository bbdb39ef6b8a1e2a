"""The embedding's weight gradient in PyTorch, summed in fp32 over the rows the indices touch.

Eager CUDA sums each index's gradient rows in fp32 partial sums and writes the table once in its dtype; eager
CPU accumulates a 16-bit table in its own dtype (an error of 3.0 where fp32 sums err by 0.25: 20000 bf16 rows
over 50 indices), and Inductor's decomposition accumulates into an fp32 table of the whole vocabulary. This
reference sums in fp32 over the distinct indices only: its fp32 buffer is [distinct indices, D], at most the
gradient's own row count, never the vocabulary's.
"""

from __future__ import annotations

import torch


def weight_gradient(
    grad: torch.Tensor, indices: torch.Tensor, num_weights: int, padding_idx: int, scale_grad_by_freq: bool
) -> torch.Tensor:
    """∂W [num_weights, D] in ``grad``'s dtype: the rows of ``grad`` summed by index in fp32, rounded once.

    ``padding_idx`` -1 means none (``aten.embedding_dense_backward``'s convention, which ``F.embedding``
    normalizes negative indices into); that row's gradient stays zero. ``scale_grad_by_freq`` divides each
    index's sum by how often it occurs in the batch, as PyTorch does."""
    width = grad.shape[-1]
    rows = grad.reshape(-1, width)
    flat = indices.reshape(-1)
    distinct, slot = torch.unique(flat, return_inverse=True)
    accumulate = torch.promote_types(grad.dtype, torch.float32)
    sums = torch.zeros(distinct.numel(), width, dtype=accumulate, device=grad.device)
    sums.index_add_(0, slot, rows.to(accumulate))
    if scale_grad_by_freq:
        sums /= torch.bincount(slot, minlength=distinct.numel()).unsqueeze(1).to(accumulate)
    out = grad.new_zeros(num_weights, width)
    kept = distinct != padding_idx
    out[distinct[kept]] = sums[kept].to(grad.dtype)
    return out
