"""The embedding op on a CUDA device: PyTorch's kernel sums in fp32, and a compiled step's peak drops by the
fp32 table Inductor's decomposition allocates."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lowerings  # noqa: F401  (registers torch.ops.memopt.*)

pytestmark = pytest.mark.gpu


def _batch(vocab, width, rows, repeats_of):
    gen = torch.Generator(device="cuda").manual_seed(vocab + width)
    weight = torch.randn(vocab, width, device="cuda", generator=gen).bfloat16().requires_grad_()
    indices = torch.randint(0, repeats_of, (rows,), device="cuda", generator=gen)
    grad = torch.randn(rows, width, device="cuda", generator=gen).bfloat16()
    return weight, indices, grad


def test_the_gradient_is_summed_in_fp32_and_rounded_once():
    """20000 rows over 50 indices: within one rounding of the float64 sum, as the decomposition's fp32 table."""
    weight, indices, grad = _batch(1000, 64, 20000, 50)
    torch.ops.memopt.embedding(indices, weight, 7, False).backward(grad)
    exact = torch.zeros(1000, 64, dtype=torch.float64, device="cuda").index_add_(0, indices, grad.double())
    exact[7] = 0
    rounded = (exact.bfloat16().double() - exact).abs().max()
    assert (weight.grad.double() - exact).abs().max() <= rounded


def _compiled_peak(backend: str, vocab: int, width: int) -> tuple[int, torch.Tensor]:
    torch._dynamo.reset()
    table = torch.nn.Embedding(vocab, width, device="cuda", dtype=torch.bfloat16)
    torch.nn.init.normal_(table.weight, generator=torch.Generator(device="cuda").manual_seed(0))
    indices = torch.randint(0, vocab, (8, 1024), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    step = torch.compile(lambda ids: F.embedding(ids, table.weight).float().square().mean(), backend=backend)
    step(indices).backward()  # compile
    table.weight.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step(indices).backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, table.weight.grad


def test_a_compiled_backward_keeps_no_fp32_table():
    """V = 131072, D = 1024 in bf16 over 8 × 1024 indices: torch.compile's backward holds a 512 MiB fp32 table
    beside the 256 MiB gradient; memopt's holds the gradient, the kernel's partial sums and index arrays (its
    working set, 36 MiB) and the incoming gradient, so its peak is lower by the fp32 table less those."""
    from lowerings.embedding import op

    vocab, width, rows = 131072, 1024, 8 * 1024
    compiled, expected = _compiled_peak("inductor", vocab, width)
    ours, grad = _compiled_peak("memopt", vocab, width)
    table = vocab * width
    workspace = sum(op.working_set(rows, width, torch.device("cuda")).values())
    incoming = rows * width * (2 + 4)  # the loss's gradient in fp32 and cast to the table's dtype
    figures = f"torch.compile {compiled / 2**20:.1f} MiB, memopt {ours / 2**20:.1f} MiB"
    assert compiled >= table * (4 + 2), figures
    assert ours <= table * 2 + workspace + incoming + (8 << 20), figures
    assert compiled - ours >= table * 4 - workspace - incoming, figures
    assert torch.allclose(grad.float(), expected.float(), rtol=0, atol=2e-2 * expected.float().abs().max().item())
