"""``memopt.flash_attention_uniform_rows`` against eager attention in float64: the rows whose scores an added
finfo.min absorbed give the mean of v, and their q, k and v gradients are eager's, through a softcap or without."""

from __future__ import annotations

import pytest
import torch

from lowerings.flash_attention import uniform_rows

OP = torch.ops.memopt.flash_attention_uniform_rows
B, H, KV_HEADS, T, D = 2, 4, 2, 7, 8


def _inputs(dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(B, H, T, D), (B, KV_HEADS, T, D), (B, KV_HEADS, T, D)]
    return [torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_() for shape in shapes]


def _rows(*flagged: tuple[int, int]) -> torch.Tensor:
    rows = torch.zeros(B, 1, T, 1, dtype=torch.bool)
    for entry, row in flagged:
        rows[entry, 0, row] = True
    return rows


def _eager(q, k, v, rows, scale, softcap):
    """Gemma 2's eager attention with finfo.min added to every score of the flagged rows, those rows only."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-2, -1) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    fill = torch.tensor(torch.finfo(scores.dtype).min, dtype=scores.dtype)
    scores = scores + torch.where(rows, fill, torch.zeros((), dtype=scores.dtype))
    return torch.where(rows, torch.softmax(scores, dim=-1) @ v, 0.0)


@pytest.mark.parametrize("softcap", [None, 1.5])
@pytest.mark.parametrize("chunk_bytes", [uniform_rows.CHUNK_BYTES, 1], ids=["one-chunk", "row-by-row"])
def test_matches_eager_in_float64(monkeypatch, softcap, chunk_bytes):
    """Flagged rows in both batch entries (left padding's first rows, a row alone), grouped heads, one chunk or
    a row at a time: output and gradients equal eager's to float64 rounding."""
    monkeypatch.setattr(uniform_rows, "CHUNK_BYTES", chunk_bytes)
    q, k, v = _inputs()
    rows = _rows((0, 0), (0, 1), (0, 2), (1, 5))
    out = OP(q, k, v, rows, 0.3, softcap)
    expected = _eager(q, k, v, rows, 0.3, softcap)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    weights = torch.randn_like(expected)
    actual = torch.autograd.grad((out * weights).sum(), [q, k, v])
    wanted = torch.autograd.grad((expected * weights).sum(), [q, k, v])
    for a, e in zip(actual, wanted, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)
    assert wanted[0].abs().max() > 0.1  # the rows' gradients are not trivially zero


def test_no_row_flagged_gives_zeros():
    q, k, v = _inputs()
    out = OP(q, k, v, _rows(), 0.3, 1.5)
    assert torch.all(out == 0)
    assert all(torch.all(g == 0) for g in torch.autograd.grad(out.sum(), [q, k, v]))


def test_bf16_is_computed_in_fp32():
    """16-bit inputs: the mean and the gradients are accumulated in fp32 and returned in the inputs' dtype."""
    q, k, v = (t.detach().to(torch.bfloat16).requires_grad_() for t in _inputs())
    rows = _rows((1, 0), (1, 1))
    out = OP(q, k, v, rows, 0.3, 1.5)
    expected = _eager(*(t.detach().double().requires_grad_() for t in (q, k, v)), rows, 0.3, 1.5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected.detach(), rtol=1e-2, atol=1e-2)
    assert all(g.dtype == torch.bfloat16 for g in torch.autograd.grad(out.sum(), [q, k, v]))


def test_opcheck():
    q, k, v = (t.detach().float().requires_grad_() for t in _inputs())
    rows = _rows((0, 0), (1, 3))
    torch.library.opcheck(OP.default, (q, k, v, rows, 0.3, 1.5))
    torch.library.opcheck(OP.default, (q, k, v, rows[:1], 0.3, None))  # flags broadcast over the batch
    grad = torch.randn(B, H, T, D)
    backward = torch.ops.memopt.flash_attention_uniform_rows_backward.default
    torch.library.opcheck(backward, (q.detach(), k.detach(), v.detach(), rows, grad, 0.3, 1.5))
