"""memopt.embedding on CPU: the gather is F.embedding's, the weight gradient the float64 sum rounded once."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lowerings  # noqa: F401  (registers torch.ops.memopt.*)
from lowerings.embedding import op


def _exact(grad, indices, vocab, padding_idx=-1, by_freq=False):
    """The float64 weight gradient: each index's gradient rows summed (divided by its count with by_freq)."""
    flat, rows = indices.reshape(-1), grad.reshape(-1, grad.shape[-1]).double()
    exact = torch.zeros(vocab, grad.shape[-1], dtype=torch.float64).index_add_(0, flat, rows)
    if by_freq:
        exact /= torch.bincount(flat, minlength=vocab).clamp(min=1).unsqueeze(1).double()
    if padding_idx >= 0:
        exact[padding_idx] = 0
    return exact


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("padding_idx", "by_freq"), [(-1, False), (7, False), (7, True)])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_the_gradient_is_the_exact_sum_rounded_once(dtype, padding_idx, by_freq, index_dtype):
    """20000 rows over 50 of 1000 indices: within one rounding of the float64 sum (eager CPU sums a 16-bit
    table in its own dtype, PyTorch's CUDA kernel and Inductor in fp32)."""
    weight = torch.randn(1000, 64).to(dtype).requires_grad_()
    indices = torch.randint(0, 50, (4, 5000)).to(index_dtype)
    grad = torch.randn(4, 5000, 64).to(dtype)
    out = torch.ops.memopt.embedding(indices, weight, padding_idx, by_freq)
    assert torch.equal(out, F.embedding(indices, weight, padding_idx if padding_idx >= 0 else None,
                                        scale_grad_by_freq=by_freq))
    out.backward(grad)
    exact = _exact(grad, indices.long(), 1000, padding_idx, by_freq)
    rounded = (exact.to(dtype).double() - exact).abs().max()
    assert (weight.grad.double() - exact).abs().max() <= rounded
    if padding_idx >= 0:
        assert not weight.grad[padding_idx].any()


def test_an_fp32_table_gets_an_fp32_gradient():
    weight = torch.randn(30, 8, requires_grad=True)
    indices = torch.tensor([[1, 2, 2], [29, 1, 0]])
    grad = torch.randn(2, 3, 8)
    torch.ops.memopt.embedding(indices, weight).backward(grad)
    torch.testing.assert_close(weight.grad.double(), _exact(grad, indices, 30), rtol=0, atol=1e-6)


def test_float_indices_are_refused():
    with pytest.raises(RuntimeError, match="indices must be integers"):
        torch.ops.memopt.embedding(torch.zeros(3), torch.randn(4, 2))


def test_the_cuda_workspace_is_the_kernels_partial_sums_and_index_arrays():
    """What the pricing charges on CUDA: ⌈1.1 · N · D · 4⌉ fp32 partial sums and six int64 arrays of N."""
    terms = op.working_set(8192, 4096, torch.device("cuda"))
    assert sum(terms.values()) == (8192 * 4096 * 4 * 11 + 9) // 10 + 6 * 8192 * 8
