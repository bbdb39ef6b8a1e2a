"""What the CCE reference holds against what ``working_set`` charges for it: the memory model's CPU terms are the
reference's measured peak of temporaries, and its CUDA terms follow the kernels' own chunking."""

from __future__ import annotations

import pytest
import torch

from lowerings.cce import kernels, reference
from lowerings.cce.op import working_set
from tests.lowerings.memory import peak_temporary_bytes

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
LSE = "saved: log-sum-exp [N]"


def _transient(n_rows: int, vocab: int, dim: int, dtype: torch.dtype, device=CPU) -> int:
    """The working set without the saved log-sum-exp (an output of the op, not a temporary)."""
    return sum(value for name, value in working_set(n_rows, vocab, dim, dtype, device).items() if name != LSE)


def _peaks(n_rows, vocab, dim, dtype, bias=False, softcap=None, smoothing=0.0) -> tuple[int, int]:
    """Peak temporary bytes of the reference's forward and backward (all three gradients, z-loss included)."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n_rows, dim, generator=gen).to(dtype)
    weight = (torch.randn(vocab, dim, generator=gen) / dim**0.5).to(dtype)
    b = torch.randn(vocab, generator=gen).to(dtype) if bias else None
    targets = torch.randint(0, vocab, (n_rows,), generator=gen)
    targets[::5] = -100
    forward, (_, lse) = peak_temporary_bytes(
        lambda: reference.forward(hidden, weight, b, targets, -100, smoothing, softcap)
    )
    grad_rows = torch.randn(n_rows, generator=gen).to(lse.dtype)
    needs = (True, True, bias)
    backward, _ = peak_temporary_bytes(
        lambda: reference.backward(hidden, weight, b, targets, lse, grad_rows, grad_rows / 7, -100, smoothing,
                                   softcap, needs)
    )
    return forward, backward


@pytest.mark.parametrize(
    ("n_rows", "vocab", "dim", "dtype", "bias", "softcap", "smoothing"),
    [
        (24, 384, 32, torch.float32, False, None, 0.0),  # the HF models' test size: one row a chunk
        (37, 53, 19, torch.float64, True, 2.0, 0.1),  # the oracle's precision, every option
        (512, 1024, 16, torch.float32, False, None, 0.0),  # 1/8 of the logits a chunk
        (512, 1024, 16, torch.float32, True, 30.0, 0.0),  # the softcap's second buffer, within the same budget
        (300, 2000, 8, torch.float64, True, None, 0.1),
    ],
)
def test_peak_is_within_the_working_set(n_rows, vocab, dim, dtype, bias, softcap, smoothing):
    charged = _transient(n_rows, vocab, dim, dtype)
    forward, backward = _peaks(n_rows, vocab, dim, dtype, bias, softcap, smoothing)
    assert max(forward, backward) <= charged, (forward, backward, charged)


def test_working_set_is_what_the_reference_holds():
    """Above the one-row floor the charge is the measured peak of each pass, to within 3 % (the per-row vectors
    are charged at a bound)."""
    n_rows, vocab, dim = 2048, 1024, 16
    charged = _transient(n_rows, vocab, dim, torch.float32)
    assert charged == n_rows * vocab * 4 // reference.FRACTION
    for peak in _peaks(n_rows, vocab, dim, torch.float32):
        assert 0.97 * charged <= peak <= charged, (peak, charged)


def _gemm_workspace(rows: int, vocab: int, dim: int, dtype: torch.dtype) -> int:
    """The most temporary bytes one bare GEMM of the reference's shapes takes on this CPU: workspace of the BLAS
    library (oneDNN), not a tensor of the reference, and different from one CPU to the next (none on an AVX2
    machine; on the H200 host's CPU the reference's backward peaked 2.2 MB above its charge at the size below)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=gen).to(dtype)
    weight = torch.randn(vocab, dim, generator=gen).to(dtype)
    hidden = torch.randn(rows, dim, generator=gen).to(dtype)
    logits32, hidden32, accumulator = logits.float(), hidden.float(), torch.zeros(vocab, dim)
    gemms = [lambda: hidden @ weight.t(), lambda: logits @ weight, lambda: logits.t() @ hidden]
    gemms += [lambda: accumulator.addmm_(logits32.t(), hidden32)]
    return max(peak_temporary_bytes(gemm)[0] for gemm in gemms)


def test_16_bit_inputs_add_their_upcasts_and_the_weight_gradient_accumulator():
    """bf16: the chunk's bf16 product before its fp32 copy, and the fp32 [V, D] weight-gradient accumulator;
    beyond them, only what the CPU's BLAS takes for a GEMM of the same shapes (measured, not charged)."""
    n_rows, vocab, dim = 512, 2048, 32
    terms = working_set(n_rows, vocab, dim, torch.bfloat16, CPU)
    assert terms["transient: weight-gradient accumulator [V, D]"] == vocab * dim * 4
    charged = _transient(n_rows, vocab, dim, torch.bfloat16)
    forward, backward = _peaks(n_rows, vocab, dim, torch.bfloat16, bias=True)
    rows = reference.chunk_rows(vocab, n_rows, dim, torch.bfloat16, bias=True, backward=True)
    workspace = _gemm_workspace(int(rows), vocab, dim, torch.bfloat16)
    assert max(forward, backward) <= charged + workspace, (forward, backward, charged, workspace)


def test_budget_is_a_fraction_of_the_logits_with_a_floor_and_a_ceiling():
    fp32 = torch.float32
    assert reference.chunk_budget(4096, 8192, 64, fp32) == 4096 * 8192 * 4 // 8  # 16 MiB of 128 MiB
    assert reference.chunk_budget(1 << 20, 128256, 2048, fp32) == reference.CHUNK_BYTES  # ceiling
    floor = reference.chunk_budget(1, 384, 32, fp32)  # one row of the costliest pass
    assert floor == reference.row_bytes(384, 32, fp32, softcap=True, backward=True) + reference.fixed_bytes(
        384, fp32, bias=True, backward=True
    )
    assert reference.chunk_rows(8192, 4096, 64, fp32) == 4096 // 8 - 1  # the per-row vectors take a row's room
    assert reference.chunk_rows(384, 24, 32, fp32) >= 1
    assert reference.chunk_rows(384, 0, 32, fp32) == 1


def test_budget_is_symbolic_in_the_rows():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    rows = env.create_unbacked_symint()
    budget = reference.chunk_budget(rows, 8192, 64, torch.float32)
    assert isinstance(budget, torch.SymInt)
    assert "u0" in str(budget)


def test_cuda_terms_follow_the_kernels_chunking():
    """The CUDA backward's chunk is [N, min(V, chunk_columns(N))] in the input dtype: no more columns than the
    vocabulary has (a 384-class head is charged 384 columns, not 4096)."""
    chunk = "transient: one column chunk of logit gradients [N, chunk]"
    for n_rows, vocab, dtype in [(24, 384, torch.float32), (8192, 256000, torch.bfloat16), (65536, 50257, torch.float16)]:
        expected = n_rows * min(vocab, kernels.chunk_columns(n_rows, dtype.itemsize)) * dtype.itemsize
        assert working_set(n_rows, vocab, 64, dtype, CUDA)[chunk] == expected
