"""The row-wise CCE's chunk kernel against the op's PyTorch chunk gradient and float64 math: on CPU through
Triton's interpreter, on CUDA natively."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lowerings.cce import rowwise, rowwise_kernel
from lowerings.cce.rowwise_kernel import row_gradient_, scaled_copy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _logits(rows=5, vocab=300, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(rows, vocab, generator=gen)).to(dtype).to(DEVICE)


def _targets(rows=5, vocab=300, ignored=(1,)):
    targets = torch.arange(rows) * 37 % vocab
    for row in ignored:
        targets[row] = -100
    return targets.to(DEVICE)


@pytest.mark.parametrize("softcap", [None, 7.5])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_matches_float64_cross_entropy(label_smoothing, softcap):
    """Loss terms and gradient (scaled, 0 on ignored rows) equal float64 autograd of PyTorch's cross-entropy."""
    logits, targets = _logits(), _targets()
    x = logits.double().requires_grad_()
    z = softcap * torch.tanh(x / softcap) if softcap else x
    expected = F.cross_entropy(z, targets, ignore_index=-100, label_smoothing=label_smoothing, reduction="none")
    (expected_grad,) = torch.autograd.grad(expected.sum() * 0.25, x)
    work = logits.clone()
    losses = row_gradient_(work, targets, -100, label_smoothing, softcap, torch.tensor([0.25], device=DEVICE))
    torch.testing.assert_close(losses.double(), expected.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(work.double(), expected_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_equals_the_pytorch_chunk_path_in_16_bit(dtype):
    """In 16-bit the kernel's gradient is the PyTorch path's to one rounding of the input dtype."""
    logits, targets = _logits(dtype=dtype, vocab=1000), _targets(vocab=1000)
    grad = logits.float()
    loss = rowwise._chunk_gradient_(grad, targets, -100, 0.1, None, torch.ones((), device=DEVICE))
    work = logits.clone()
    losses = row_gradient_(work, targets, -100, 0.1, None, torch.ones(1, device=DEVICE))
    torch.testing.assert_close(losses.sum(), loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(work.float(), grad.to(dtype).float(), rtol=0, atol=torch.finfo(dtype).eps * 2)


@pytest.mark.parametrize("vocab", [256, 300])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_rows_of_several_tiles(monkeypatch, vocab, label_smoothing):
    """Rows longer than a tile: unmasked tiles, then a masked last tile (300) or none (256, a multiple of the
    tile), with the target in any tile; against float64 autograd."""
    monkeypatch.setattr(rowwise_kernel, "BLOCK_V", 64)
    logits, targets = _logits(rows=7, vocab=vocab), _targets(rows=7, vocab=vocab)
    targets[0], targets[2] = vocab - 1, 63  # the last column, and a tile's last column
    x = logits.double().requires_grad_()
    expected = F.cross_entropy(x, targets, label_smoothing=label_smoothing, reduction="none")
    (expected_grad,) = torch.autograd.grad(expected.sum() * 0.5, x)
    work = logits.clone()
    losses = row_gradient_(work, targets, -100, label_smoothing, None, torch.tensor([0.5], device=DEVICE))
    torch.testing.assert_close(losses.double(), expected.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(work.double(), expected_grad, rtol=1e-5, atol=1e-6)


def test_minus_infinity_logits_like_pytorch(monkeypatch):
    """Masked-out vocabulary entries (logits of -inf, as a -inf bias gives), a whole first tile of them among
    them: they take no probability and get a zero gradient, as in PyTorch."""
    monkeypatch.setattr(rowwise_kernel, "BLOCK_V", 64)
    logits, targets = _logits(rows=4, vocab=300), _targets(rows=4, vocab=300, ignored=())
    logits[:, :64] = float("-inf")
    logits[:, 200:230] = float("-inf")
    targets[:] = torch.tensor([64, 100, 299, 150])
    x = logits.double().requires_grad_()
    expected = F.cross_entropy(x, targets, reduction="none")
    (expected_grad,) = torch.autograd.grad(expected.sum(), x)
    work = logits.clone()
    losses = row_gradient_(work, targets, -100, 0.0, None, torch.ones(1, device=DEVICE))
    torch.testing.assert_close(losses.double(), expected.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(work.double(), expected_grad, rtol=1e-5, atol=1e-6)


def test_every_row_ignored_and_an_empty_chunk():
    logits, targets = _logits(rows=3), torch.full((3,), -100, device=DEVICE)
    work = logits.clone()
    losses = row_gradient_(work, targets, -100, 0.0, None, torch.ones(1, device=DEVICE))
    assert torch.all(losses == 0) and torch.all(work == 0)
    empty = torch.empty(0, 300, device=DEVICE)
    assert row_gradient_(empty, targets[:0], -100, 0.0, None, torch.ones(1, device=DEVICE)).shape == (0,)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scaled_copy_rounds_once(dtype):
    """The backward's scale-and-cast of a saved fp32 gradient equals PyTorch's: the fp32 product rounded once."""
    source = _logits(rows=3, vocab=1500)  # 4500 elements: two blocks, the second ragged
    scale = torch.tensor(0.375, device=DEVICE)
    expected = torch.mul(source, scale, out=torch.empty(source.shape, dtype=dtype, device=DEVICE))
    ours = scaled_copy(source, scale, dtype)
    if DEVICE == "cpu" and dtype == torch.bfloat16:  # Triton's interpreter truncates to bf16; the GPU rounds
        torch.testing.assert_close(ours, expected, rtol=torch.finfo(dtype).eps, atol=0)
    else:
        assert torch.equal(ours, expected)
    assert scaled_copy(source[:0], scale, dtype).shape == (0, 1500)


@pytest.mark.parametrize(("softcap", "label_smoothing", "logit_scale"), [(None, 0.0, 1.0), (7.5, 0.1, 0.5)])
def test_column_slices_write_the_row_kernels_gradient(monkeypatch, softcap, label_smoothing, logit_scale):
    """``column_gradient_`` over slices of the vocabulary (130 columns: a tile masked at each slice's end, a
    ragged last slice), from the log-sum-exp the row kernel stores, writes the row kernel's gradient column for
    column, and with ``transform`` leaves the returned logits as the row kernel leaves them."""
    from lowerings.cce.rowwise_kernel import column_gradient_

    monkeypatch.setattr(rowwise_kernel, "BLOCK_V", 64)
    logits, targets = _logits(rows=7, vocab=300), _targets(rows=7, vocab=300)
    targets[0], targets[2], targets[3] = 299, 130, 129  # the last column, a slice's first and last
    scale = torch.tensor([0.25], device=DEVICE)
    expected, transformed = torch.empty_like(logits), logits.clone()
    lse = torch.empty(7, device=DEVICE)
    losses = row_gradient_(expected, targets, -100, label_smoothing, softcap, scale, transformed, logit_scale,
                           True, lse)
    plain = row_gradient_(torch.empty_like(logits), targets, -100, label_smoothing, softcap, scale, logits.clone(),
                          logit_scale)
    assert torch.equal(losses, plain)  # storing the lse changes nothing else
    x = logits.double()
    z = softcap * torch.tanh(x * logit_scale / softcap) if softcap else x * logit_scale
    torch.testing.assert_close(lse.double(), torch.logsumexp(z, dim=1), rtol=1e-6, atol=1e-6)
    ours, source = torch.zeros_like(logits), logits.clone()
    for first in range(0, 300, 130):
        column_gradient_(ours[:, first : first + 130], source, first, targets, lse, -100, label_smoothing, softcap,
                         scale, logit_scale, transform=True)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(source, transformed)
    assert torch.all(ours[1] == 0)  # the ignored row


@pytest.mark.parametrize("buffer_rows", [16, 1])
def test_weight_gradient_by_column_slices_matches_float64(buffer_rows):
    """∂C = Gᵀ·E slice by slice over every row (several slices of 64 columns within the chunk buffer's room, or a
    buffer too small for one slice) equals float64 autograd of the loss's sum."""
    gen = torch.Generator().manual_seed(3)
    n, vocab, dim = 40, 300, 16
    hidden = torch.randn(n, dim, generator=gen).to(DEVICE)
    weight = (torch.randn(vocab, dim, generator=gen) / dim**0.5).to(DEVICE)
    targets = _targets(rows=n, vocab=vocab, ignored=(1, 7))
    logits = hidden @ weight.t()
    lse = torch.empty(n, device=DEVICE)
    scale = torch.ones((), device=DEVICE)
    buffer = torch.empty(buffer_rows, rowwise.padded_vocab(vocab, "cuda"), device=DEVICE)
    row_gradient_(torch.empty_like(logits), targets, -100, 0.0, None, scale, logits, 1.0, False, lse)
    grad_weight = torch.empty_like(weight)
    rowwise._weight_gradient_by_columns_(grad_weight, buffer, logits, hidden, targets, lse, -100, 0.0, None, scale,
                                         1.0, False)
    exact = weight.double().requires_grad_()
    loss = F.cross_entropy(hidden.double() @ exact.t(), targets, reduction="sum")
    (expected,) = torch.autograd.grad(loss, exact)
    torch.testing.assert_close(grad_weight.double(), expected, rtol=1e-5, atol=1e-5)
