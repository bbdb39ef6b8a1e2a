"""What the attention reference holds against what ``working_set`` charges for it, and that its blocking (sized to
the problem now) changes nothing: not the result, not the dropout mask."""

from __future__ import annotations

import pytest
import torch

from lowerings.flash_attention import reference
from lowerings.flash_attention.op import working_set
from tests.lowerings.memory import peak_temporary_bytes

CPU = torch.device("cpu")
LSE = "saved: log-sum-exp [B, H, Tq] (fp32)"
OP = torch.ops.memopt.flash_attention


def _inputs(batch, heads, kv_heads, queries, keys, dim, dtype, bias_shape=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, queries, dim, generator=gen).to(dtype)
    k, v = (torch.randn(batch, kv_heads, keys, dim, generator=gen).to(dtype) for _ in range(2))
    bias = torch.randn(bias_shape, generator=gen).to(dtype) if bias_shape else None
    return q, k, v, bias


def _transient(q, k) -> int:
    batch, heads, queries, dim = q.shape
    terms = working_set(batch, heads, queries, k.shape[2], CPU, dtype=q.dtype, head_dim=dim, kv_heads=k.shape[1])
    return sum(value for name, value in terms.items() if name != LSE)


def _peaks(q, k, v, bias, causal=False, dropout_p=0.0, bias_grad=False, softcap=None, window=None) -> tuple[int, int]:
    forward, (out, lse) = peak_temporary_bytes(
        lambda: reference.forward(q, k, v, bias, 0.3, causal, dropout_p, 5, softcap, window)
    )
    grad_out = torch.randn_like(out)
    backward, _ = peak_temporary_bytes(
        lambda: reference.backward(
            q, k, v, bias, out, lse, grad_out, 0.3, causal, dropout_p, 5, bias_grad, softcap, window
        )
    )
    return forward, backward


CASES = {
    "hf-test-size": dict(shape=(2, 2, 2, 12, 12, 16), dtype=torch.float32),
    "gqa-causal": dict(shape=(2, 4, 2, 12, 12, 8), dtype=torch.float32, causal=True),
    "dropout": dict(shape=(2, 4, 4, 40, 40, 8), dtype=torch.float32, causal=True, dropout_p=0.1),
    "broadcast-bias": dict(shape=(2, 4, 4, 128, 128, 16), dtype=torch.float32, bias_shape=(2, 1, 1, 128)),
    "fp64-learned-bias": dict(
        shape=(2, 4, 2, 100, 90, 16), dtype=torch.float64, bias_shape=(1, 4, 100, 90), dropout_p=0.2, bias_grad=True
    ),
    "bf16-bias-cast": dict(shape=(2, 4, 4, 128, 128, 16), dtype=torch.bfloat16, bias_shape=(2, 1, 1, 128)),
    # the softcap's slope reuses the probabilities' buffer; a window's mask is one boolean per block pair
    "softcap-window-gqa": dict(shape=(2, 4, 2, 128, 128, 16), dtype=torch.float32, causal=True, softcap=2.0, window=9),
    "bf16-window-dropout-learned-bias": dict(
        shape=(2, 4, 2, 100, 100, 16), dtype=torch.bfloat16, bias_shape=(1, 4, 100, 100), causal=True, window=17,
        dropout_p=0.2, bias_grad=True, softcap=1.5,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_peak_is_within_the_working_set(case):
    options = dict(CASES[case])
    q, k, v, bias = _inputs(*options.pop("shape"), options.pop("dtype"), options.pop("bias_shape", None))
    charged = _transient(q, k)
    forward, backward = _peaks(q, k, v, bias, **options)
    assert max(forward, backward) <= charged, (forward, backward, charged)


def test_working_set_is_what_the_reference_holds():
    """Where the budget binds (blocks of fewer than BLOCK_ROWS queries), the charge is the measured peak of each
    pass, to within 3 %."""
    q, k, v, _ = _inputs(1, 4, 4, 512, 2048, 32, torch.float32)
    charged = _transient(q, k)
    assert charged == 4 * 512 * 2048 * 4 // reference.FRACTION  # 2 MiB of 16 MiB of scores
    assert max(reference.block_shape(q, k, None, backward=False, dropout=False, causal=False)) < reference.BLOCK_ROWS
    for peak in _peaks(q, k, v, None):
        assert 0.97 * charged <= peak <= charged, (peak, charged)


def test_16_bit_inputs_charge_k_and_v_in_fp32():
    terms = working_set(2, 8, 512, 512, CPU, dtype=torch.bfloat16, head_dim=64, kv_heads=2)
    assert terms["transient: k, v and their gradients in fp32 (CPU reference)"] == 4 * 2 * 2 * 512 * 64 * 4
    assert "transient: k, v and their gradients in fp32 (CPU reference)" not in working_set(
        2, 8, 512, 512, CPU, dtype=torch.float32, head_dim=64, kv_heads=2
    )


def test_budget_is_a_fraction_of_the_scores_with_a_floor_and_a_ceiling():
    fp32 = torch.float32
    assert reference.block_budget(2, 12, 1024, 1024, 64, fp32) == 2 * 12 * 1024 * 1024 * 4 // 8
    assert reference.block_budget(4, 16, 4096, 4096, 128, fp32) == reference.BLOCK_BYTES
    floor = reference.block_budget(1, 1, 1, 12, 16, fp32)
    assert floor == reference.row_bytes(1, 1, 12, 16, fp32, backward=True, dropout=True, causal=True) + (
        reference.fixed_bytes(1, 1, 12, fp32, dropout=True, bias_cast=True)
    )
    assert working_set(2, 12, 1024, 1024, torch.device("cuda")) == {LSE: 2 * 12 * 1024 * 4}


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


@pytest.mark.parametrize("shape", [(1, 1), (2, 3), (1, 7), (2, 7)], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_blocks_of_any_size_match_float64_math(monkeypatch, shape, causal):
    """Grouped heads, a bias broadcast over batch, heads and queries (stride 0) and a causal block that reads
    only the keys its last query sees: any blocking, by batch entries and by query rows, gives float64 math,
    forward and backward."""
    monkeypatch.setattr(reference, "block_shape", lambda *args, **kwargs: shape)
    q, k, v, _ = _inputs(2, 4, 2, 7, 9, 8, torch.float64)
    for t in (q, k, v):
        t.requires_grad_()
    bias = torch.randn(1, 1, 1, 9, dtype=torch.float64).expand(2, 4, 7, 9).requires_grad_()
    assert bias.stride()[:3] == (0, 0, 0)
    out, _, _ = OP(q, k, v, bias, 0.4, causal, 0.0)
    expected = _math(q, k, v, bias, 0.4, causal)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    weights = torch.randn_like(expected)
    actual = torch.autograd.grad((out * weights).sum(), [q, k, v, bias])
    wanted = torch.autograd.grad((expected * weights).sum(), [q, k, v, bias])
    for a, e in zip(actual, wanted, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)


def test_dropout_mask_does_not_depend_on_the_blocking(monkeypatch):
    """Each batch entry's tiles of query rows draw their own mask: one block, blocks of single rows, of whole
    tiles or cut across tiles give the same output and gradients."""
    q, k, v, _ = _inputs(2, 2, 2, 2 * reference.MASK_ROWS + 7, 9, 8, torch.float64)
    results = []
    for shape in ((2, q.shape[2]), (1, 1), (1, reference.MASK_ROWS), (2, reference.MASK_ROWS + 3)):
        monkeypatch.setattr(reference, "block_shape", lambda *args, shape=shape, **kwargs: shape)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(3)
        out, _, _ = OP(*leaves, None, 0.4, True, 0.3)
        results.append((out, torch.autograd.grad(out.sum(), leaves)))
    (whole, whole_grads), *others = results
    for out, grads in others:
        torch.testing.assert_close(out, whole, rtol=1e-12, atol=1e-12)
        for a, e in zip(grads, whole_grads, strict=True):
            torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
