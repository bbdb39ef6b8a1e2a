"""``torch.ops.memopt.embedding``: ``F.embedding`` whose weight gradient is never an fp32 table.

    out = torch.ops.memopt.embedding(indices, weight, padding_idx=-1, scale_grad_by_freq=False)

Inductor decomposes ``embedding_dense_backward`` into a scatter into a zeroed fp32 [V, D] table, cast to the
weight's dtype at the end (``torch/_decomp/decompositions.py``): for a 16-bit table that is V·D·4 bytes beside
the V·D·2 of the gradient itself, at the end of the backward where every other weight's gradient is alive
(Cohere's 256000 × 4096 table: 4 GiB). Eager CUDA's kernel has no such buffer: it sorts the indices, sums each
index's rows in fp32 partial sums (at most ~1.1 rows per gradient row) and writes the table once, in its dtype.

The forward is the plain gather (a ``triton_op`` body Inductor traces and fuses). The backward,
``memopt::embedding_backward``, is opaque to Inductor: PyTorch's CUDA kernel on CUDA, on CPU the fp32 sum over
the distinct indices of ``reference.py`` (eager CPU accumulates in 16 bits).
"""

from __future__ import annotations

import torch

from lowerings._library import cuda_kernel, device_op, reference_op, transient_bytes, workspace
from lowerings.embedding import reference

# Rows of fp32 partial sums PyTorch's CUDA embedding backward allocates per gradient row: a segment of rows of one
# index is cut every NROWS_PER_THREAD = 10 rows, so partial segments ≤ N/10 + distinct indices ≤ 1.1·N
# (aten/src/ATen/native/cuda/EmbeddingBackwardKernel.cu). In tenths, so that SymInt sizes stay integers.
_PARTIAL_TENTHS = 11
# int64 index arrays of N entries the CUDA kernel sorts and segments through (sorted indices, their order, segment
# offsets and counts, partial segment offsets; one more for the sort's scratch).
_INDEX_ARRAYS = 6


def working_set(
    rows, width, device: torch.device, dtype: torch.dtype = torch.bfloat16
) -> dict[str, object]:
    """Bytes the backward allocates beyond its inputs and its output, by name; ``rows`` is the number of
    indices, ``width`` D. Sizes may be SymInts. The output, the [V, D] gradient in the weight's dtype, is not
    charged: torch.compile's decomposition writes the same tensor."""
    accumulate = torch.promote_types(dtype, torch.float32).itemsize
    if device.type == "cuda":
        partial = (rows * width * accumulate * _PARTIAL_TENTHS + 9) // 10  # ⌈1.1 · N · D · 4⌉
        return {
            "transient: fp32 partial sums of each index's rows (CUDA kernel)": partial,
            "transient: sorted indices and segment offsets (CUDA kernel)": _INDEX_ARRAYS * rows * 8,
        }
    return {
        "transient: the gradient's rows in fp32 (CPU reference)": rows * width * accumulate,
        "transient: fp32 sums of the distinct indices (CPU reference)": rows * width * accumulate,
        "transient: distinct indices and each row's slot (CPU reference)": 3 * rows * 8,
    }


def _check_inputs(indices: torch.Tensor, weight: torch.Tensor) -> None:
    torch._check(weight.dim() == 2, lambda: f"memopt.embedding: weight must be 2-D, got {tuple(weight.shape)}")
    torch._check(
        not indices.dtype.is_floating_point and not indices.dtype.is_complex and indices.dtype != torch.bool,
        lambda: f"memopt.embedding: indices must be integers, got {indices.dtype}",
    )


@device_op("embedding")
def embedding(
    indices: torch.Tensor, weight: torch.Tensor, padding_idx: int = -1, scale_grad_by_freq: bool = False
) -> torch.Tensor:
    _check_inputs(indices, weight)
    return torch.ops.aten.embedding.default(weight, indices, padding_idx, scale_grad_by_freq)


@reference_op("embedding_backward")
def embedding_backward(
    grad: torch.Tensor, indices: torch.Tensor, num_weights: int, padding_idx: int, scale_grad_by_freq: bool
) -> torch.Tensor:
    return reference.weight_gradient(grad, indices, num_weights, padding_idx, scale_grad_by_freq)


@embedding_backward.register_fake
def _(grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    return grad.new_empty(num_weights, grad.shape[-1])


@workspace("embedding_backward")
def _(device_type, grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    terms = working_set(indices.numel(), grad.shape[-1], torch.device(device_type), grad.dtype)
    return transient_bytes(terms)


# PyTorch's CUDA kernel, called by the dispatcher itself (``cuda_kernel``): a backward runs it every step.
@cuda_kernel("embedding_backward", differentiable=False)
def _backward_on_cuda(grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    return torch.ops.aten.embedding_dense_backward.default(grad, indices, num_weights, padding_idx, scale_grad_by_freq)


def _setup_context(ctx, inputs, output) -> None:
    indices, weight, padding_idx, scale_grad_by_freq = inputs
    ctx.save_for_backward(indices)
    ctx.num_weights = weight.shape[0]
    ctx.padding_idx = padding_idx
    ctx.scale_grad_by_freq = scale_grad_by_freq


def _backward(ctx, grad):
    (indices,) = ctx.saved_tensors
    if not ctx.needs_input_grad[1]:
        return None, None, None, None
    weight_grad = torch.ops.memopt.embedding_backward(grad, indices, ctx.num_weights, ctx.padding_idx,
                                                      ctx.scale_grad_by_freq)
    return None, weight_grad, None, None


embedding.register_autograd(_backward, setup_context=_setup_context)
