"""``memopt.flash_attention`` (CPU path) against float64 math: causal, biases, grouped-query heads, lengths that
differ, softcaps and sliding windows, dropout reproducibility, opcheck, clear errors."""

from __future__ import annotations

import pytest
import torch

from lowerings.flash_attention import reference

OP = torch.ops.memopt.flash_attention


def _inputs(heads=4, kv_heads=2, queries=7, keys=9, dim=8, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda h, t: torch.randn(2, h, t, dim, generator=gen, dtype=dtype).requires_grad_()  # noqa: E731
    return make(heads, queries), make(kv_heads, keys), make(kv_heads, keys)


def _math(q, k, v, bias, scale, causal, softcap=None, window=None):
    """Eager attention in the inputs' dtype; rows that see no key give 0 (softmax alone would give NaN)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-2, -1) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias
    if causal:
        i, j = torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2])[None, :]
        allowed = (j <= i) & (j > i - window) if window is not None else j <= i
        scores = scores.masked_fill(~allowed, float("-inf"))
    dead = torch.isneginf(scores).all(-1, keepdim=True)
    return torch.softmax(scores.masked_fill(dead, 0.0), -1).masked_fill(dead, 0.0) @ v


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


@pytest.mark.parametrize(
    ("queries", "keys", "causal", "softcap", "window"),
    [(7, 9, False, 2.0, None), (7, 9, True, 0.5, None), (13, 13, True, None, 3), (13, 13, True, 1.5, 1),
     (11, 6, True, 1.5, 4), (6, 11, True, None, 20)],
)
@pytest.mark.parametrize("blocks", ["one", "several"])
def test_softcap_and_window_match_float64(monkeypatch, queries, keys, causal, softcap, window, blocks):
    """c·tanh(x/c) before the bias and a causal window of w keys, alone and together, with a learned bias, GQA,
    fewer or more queries than keys (rows past the keys' window see nothing: 0) and blocks of two queries
    (each block reads only the keys its rows' windows cover)."""
    if blocks == "several":
        monkeypatch.setattr(reference, "BLOCK_BYTES", 2 * 4 * keys * 8)
        monkeypatch.setattr(reference, "MIN_BLOCK_BYTES", 0)
    q, k, v = _inputs(queries=queries, keys=keys)
    bias = torch.randn(2, 1, queries, keys, dtype=torch.float64, requires_grad=True)
    out = OP(q, k, v, bias, 0.4, causal, 0.0, softcap=softcap, window=window)[0]
    expected = _math(q, k, v, bias, 0.4, causal, softcap, window)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    weights = torch.randn_like(expected)
    actual_grads = torch.autograd.grad((out * weights).sum(), [q, k, v, bias])
    expected_grads = torch.autograd.grad((expected * weights).sum(), [q, k, v, bias])
    for actual, wanted in zip(actual_grads, expected_grads, strict=True):
        torch.testing.assert_close(actual, wanted, rtol=1e-10, atol=1e-12)


def test_window_blocks_read_only_their_keys():
    """A block of query rows reads the keys from its first row's window on: O(T·w) work, not O(T²)."""
    assert reference.key_span(40, 48, 64, True, 5) == slice(36, 48)
    assert reference.key_span(0, 8, 64, True, 5) == slice(0, 8)
    assert reference.key_span(40, 48, 64, True, None) == slice(0, 48)
    assert reference.key_span(40, 48, 20, True, 5) == slice(19, 20)  # past the keys: one key, masked
    assert reference.key_span(40, 48, 64, False, None) == slice(0, 64)


def test_window_with_dropout_follows_the_mask():
    """Dropout's draws do not depend on how a window narrows the blocks: gradients equal float64 math with the
    mask the forward drew."""
    q, k, v = _inputs(heads=2, kv_heads=2, queries=9, keys=9)
    torch.manual_seed(2)
    out, _, seed = OP(q, k, v, None, 0.4, True, 0.25, softcap=2.0, window=3)
    keep = reference._keep_mask(int(seed), 0, 0, (2, 2, 9, 9), 0.25, q.device, 9).double() / 0.75
    scores = torch.tanh(q @ k.transpose(-2, -1) * 0.4 / 2.0) * 2.0
    i, j = torch.arange(9)[:, None], torch.arange(9)[None, :]
    expected = (torch.softmax(scores.masked_fill((j > i) | (j <= i - 3), float("-inf")), -1) * keep) @ v
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    for actual, wanted in zip(
        torch.autograd.grad(out.sum(), [q, k, v]), torch.autograd.grad(expected.sum(), [q, k, v]), strict=True
    ):
        torch.testing.assert_close(actual, wanted, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("softcap", "window"), [(1.5, None), (None, 4), (2.0, 5)], ids=["softcap", "window", "both"])
def test_low_precision_no_worse_than_eager(dtype, softcap, window):
    """|ours − fp64| ≤ 2·|eager same dtype − fp64| + the output dtype's rounding of the exact result, for the
    output and every gradient (the FA2 test rule; the CPU reference computes in fp32)."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in _inputs(queries=11, keys=11, dim=16, seed=4))
    bias = torch.randn(2, 1, 11, 11).to(dtype)
    grad = torch.randn(2, 4, 11, 16).to(dtype)
    out = OP(q, k, v, bias, 0.25, True, 0.0, softcap=softcap, window=window)[0]
    ours = (out, *torch.autograd.grad(out, [q, k, v], grad))
    eager_out = _math(q, k, v, bias, 0.25, True, softcap, window)
    eager = (eager_out, *torch.autograd.grad(eager_out, [q, k, v], grad))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    truth_out = _math(*leaves, bias.double(), 0.25, True, softcap, window)
    truth = (truth_out, *torch.autograd.grad(truth_out, leaves, grad.double()))
    for name, mine, theirs, exact in zip(("out", "dq", "dk", "dv"), ours, eager, truth, strict=True):
        assert mine.dtype == dtype
        floor = max(1e-5, (exact.to(dtype).double() - exact).abs().max().item())
        our_error, eager_error = ((x.double() - exact).abs().max().item() for x in (mine, theirs))
        assert our_error <= 2 * eager_error + floor, (name, our_error, eager_error, floor)


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
    torch.library.opcheck(OP.default, (q, k, v, None, 0.4, True, 0.0), {"softcap": 2.0, "window": 3})


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


@pytest.mark.parametrize(
    ("causal", "options", "message"),
    [(False, {"window": 3}, "comes with causal=True"), (True, {"window": 0}, "must be >= 1"),
     (True, {"softcap": 0.0}, "must be > 0")],
)
def test_clear_errors_for_softcap_and_window(causal, options, message):
    q, k, v = (t.detach() for t in _inputs())
    with pytest.raises(RuntimeError, match=message):
        OP(q, k, v, None, 0.4, causal, 0.0, **options)


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
