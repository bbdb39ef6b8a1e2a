"""``memopt.flash_attention`` (CPU path) against float64 math: causal, biases, grouped-query heads, lengths that
differ, dropout reproducibility, opcheck, clear errors."""

from __future__ import annotations

import pytest
import torch

from lowerings.flash_attention import reference

OP = torch.ops.memopt.flash_attention


def _inputs(heads=4, kv_heads=2, queries=7, keys=9, dim=8, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda h, t: torch.randn(2, h, t, dim, generator=gen, dtype=dtype).requires_grad_()  # noqa: E731
    return make(heads, queries), make(kv_heads, keys), make(kv_heads, keys)


def _math(q, k, v, bias, scale, causal):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-2, -1) * scale
    if bias is not None:
        scores = scores + bias
    if causal:
        allowed = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bias_shape", [None, (2, 1, 1, 9), (1, 4, 7, 9)])
def test_matches_float64_math(causal, bias_shape):
    q, k, v = _inputs()
    bias = torch.randn(bias_shape, dtype=torch.float64) if bias_shape else None
    out, lse, _ = OP(q, k, v, bias, 0.4, causal, 0.0)
    expected = _math(q, k, v, bias, 0.4, causal)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    weights = torch.randn_like(expected)
    actual_grads = torch.autograd.grad((out * weights).sum(), [q, k, v])
    expected_grads = torch.autograd.grad((expected * weights).sum(), [q, k, v])
    for actual, wanted in zip(actual_grads, expected_grads, strict=True):
        torch.testing.assert_close(actual, wanted, rtol=1e-10, atol=1e-12)
    assert not lse.requires_grad


def test_blocks_and_fully_masked_rows(monkeypatch):
    """Several query blocks give the same result; a query that sees no key gives 0 and a -inf lse, not NaN."""
    monkeypatch.setattr(reference, "BLOCK_BYTES", 2 * 4 * 9 * 4)  # two queries per block
    q, k, v = _inputs()
    bias = torch.zeros(2, 1, 7, 9, dtype=torch.float64)
    bias[0, :, 3] = float("-inf")
    out, lse, _ = OP(q, k, v, bias, 0.4, False, 0.0)
    assert torch.all(out[0, :, 3] == 0) and torch.all(lse[0, :, 3] == float("-inf"))
    rows = torch.arange(7) != 3
    torch.testing.assert_close(out[:, :, rows], _math(q, k, v, bias, 0.4, False)[:, :, rows].detach() * 1)
    grads = torch.autograd.grad(out.sum(), [q, k, v])
    assert all(torch.isfinite(g).all() for g in grads)


def test_dropout_follows_the_seed():
    q, k, v = _inputs()
    torch.manual_seed(5)
    first = OP(q, k, v, None, 0.4, True, 0.3)
    torch.manual_seed(5)
    again = OP(q, k, v, None, 0.4, True, 0.3)
    other = OP(q, k, v, None, 0.4, True, 0.3)
    assert torch.equal(first[0], again[0]) and torch.equal(first[2], again[2])
    assert not torch.equal(first[0], other[0])


def test_dropout_gradients_match_the_mask_used():
    """The backward regenerates the forward's keep mask: gradients equal float64 math with that mask."""
    q, k, v = _inputs(heads=2, kv_heads=2)
    torch.manual_seed(1)
    out, _, seed = OP(q, k, v, None, 0.4, False, 0.25)
    keep = reference._keep_mask(int(seed), 0, 0, (2, 2, 7, 9), 0.25, q.device, 7).double() / 0.75
    expected = (torch.softmax(q @ k.transpose(-2, -1) * 0.4, -1) * keep) @ v
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    for actual, wanted in zip(
        torch.autograd.grad(out.sum(), [q, k, v]), torch.autograd.grad(expected.sum(), [q, k, v]), strict=True
    ):
        torch.testing.assert_close(actual, wanted, rtol=1e-10, atol=1e-12)


def test_non_contiguous_inputs_and_opcheck():
    q, k, v = _inputs(dtype=torch.float32)
    q_t = q.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    torch.library.opcheck(OP.default, (q_t, k, v, None, 0.4, True, 0.0))
    torch.library.opcheck(OP.default, (q, k, v, torch.randn(2, 1, 1, 9), 0.4, False, 0.0))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda q, k, v: (q, k[:, :1], v), "differ"),
        (lambda q, k, v: (q[..., :4], k, v), "head dim"),
        (lambda q, k, v: (q[:, :3], k, v), "not a multiple"),
        (lambda q, k, v: (q[0], k, v), "4-D"),
    ],
)
def test_clear_errors(change, message):
    q, k, v = (t.detach() for t in _inputs())
    with pytest.raises(RuntimeError, match=message):
        OP(*change(q, k, v), None, 0.4, False, 0.0)


def test_bias_of_the_wrong_shape():
    q, k, v = (t.detach() for t in _inputs())
    with pytest.raises(RuntimeError, match="does not broadcast"):
        OP(q, k, v, torch.zeros(2, 1, 1, 5, dtype=torch.float64), 0.4, False, 0.0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bias_shape", [(2, 4, 7, 9), (1, 4, 7, 9), (2, 1, 1, 9), (7, 9)])
def test_learned_bias_gets_its_gradient(causal, bias_shape):
    """A bias that needs a gradient (T5's position bias) gets ∂loss/∂bias, summed over its broadcast dims."""
    q, k, v = _inputs()
    bias = torch.randn(bias_shape, dtype=torch.float64, requires_grad=True)
    out = OP(q, k, v, bias, 0.4, causal, 0.0)[0]
    expected = _math(q, k, v, bias, 0.4, causal)
    weights = torch.randn_like(expected)
    actual_grads = torch.autograd.grad((out * weights).sum(), [q, k, v, bias])
    expected_grads = torch.autograd.grad((expected * weights).sum(), [q, k, v, bias])
    for actual, wanted in zip(actual_grads, expected_grads, strict=True):
        torch.testing.assert_close(actual, wanted, rtol=1e-10, atol=1e-12)


def test_learned_bias_opcheck():
    q, k, v = _inputs(dtype=torch.float32)
    torch.library.opcheck(OP.default, (q, k, v, torch.randn(1, 4, 7, 9, requires_grad=True), 0.4, True, 0.0))
