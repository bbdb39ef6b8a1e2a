"""Flash-attention Triton kernels against float64 math: on CPU through Triton's interpreter, on CUDA natively.

Sequence lengths are odd on purpose: they are not multiples of the 16-row interpreter tiles, so every kernel
meets ragged query and key blocks, and causal runs meet blocks that straddle the diagonal (and, with a sliding
window, blocks that straddle its far edge, and blocks left of it that are never visited).
"""

from __future__ import annotations

import itertools

import pytest
import torch

triton = pytest.importorskip("triton")

from lowerings.flash_attention import kernels  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NEG_INF = float("-inf")


def _attention(q, k, v, bias, scale, causal, keep=None, dropout_p=0.0, softcap=None, window=None):
    """softmax(softcap(q kᵀ·scale) + bias + causal mask and window) v in the inputs' dtype, GQA by repeat_interleave.

    Rows with no visible key give output 0 and lse -inf (torch.softmax would give NaN). ``keep`` applies a
    dropout mask, scaled by 1/(1 − p), after the softmax."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if bias is not None:
        s = s + bias
    if causal:
        s = s.masked_fill(~_visible(q.shape[2], k.shape[2], window, q.device), NEG_INF)
    dead = torch.isneginf(s).all(-1, keepdim=True)
    s = s.masked_fill(dead, 0.0)
    lse = torch.logsumexp(s, -1).masked_fill(dead.squeeze(-1), NEG_INF)
    p = torch.softmax(s, -1).masked_fill(dead, 0.0)
    if keep is not None:
        p = p * keep / (1.0 - dropout_p)
    return p @ v, lse


def _visible(queries, keys, window, device):
    """[Tq, Tk] True where key j is visible to query i: j ≤ i, and i − w < j with a window."""
    i = torch.arange(queries, device=device)[:, None]
    j = torch.arange(keys, device=device)[None, :]
    return (j <= i) & (j > i - window) if window is not None else j <= i


def _reference(q, k, v, bias, grad_out, scale, causal, keep=None, dropout_p=0.0, softcap=None, window=None):
    """Float64 out, lse and (dq, dk, dv) of the same inputs."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    bias = None if bias is None else bias.double()
    out, lse = _attention(*leaves, bias, scale, causal, keep, dropout_p, softcap, window)
    grads = torch.autograd.grad(out, leaves, grad_out.double())
    return out, lse, grads


def _inputs(b, hq, hk, tq, tk, d, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, grad_out = torch.randn(b, hq, tq, d, generator=gen), torch.randn(b, hq, tq, d, generator=gen)
    k, v = torch.randn(b, hk, tk, d, generator=gen), torch.randn(b, hk, tk, d, generator=gen)
    return [t.to(DEVICE, dtype) for t in (q, k, v, grad_out)]


def _padding_bias(b, hq, tq, tk, dtype=torch.float32):
    """[B, 1, 1, Tk] key-padding mask expanded to [B, Hq, Tq, Tk]: batch 1 loses its last 7 keys."""
    bias = torch.zeros(b, 1, 1, tk)
    bias[1:, ..., tk - 7 :] = NEG_INF
    return bias.to(DEVICE, dtype).expand(b, hq, tq, tk)


def _position_bias(b, hq, tq, tk, dtype=torch.float32):
    """[1, Hq, Tq, Tk] relative-position-like bias expanded over the batch."""
    gen = torch.Generator().manual_seed(tq * tk)
    return torch.randn(1, hq, tq, tk, generator=gen).to(DEVICE, dtype).expand(b, hq, tq, tk)


def _run(q, k, v, bias, grad_out, scale, causal, dropout_p=0.0, seed=None, softcap=None, window=None):
    out, lse = kernels.forward(q, k, v, bias, scale, causal, dropout_p, seed, softcap, window)
    grads = kernels.backward(q, k, v, bias, out, lse, grad_out, scale, causal, dropout_p, seed, False, softcap, window)
    return out, lse, grads[:3]


def _assert_fp32_close(ours, expected):
    out, lse, grads = ours
    ref_out, ref_lse, ref_grads = expected
    names = ("out", "lse", "dq", "dk", "dv")
    for name, actual, ref in zip(names, (out, lse, *grads), (ref_out, ref_lse, *ref_grads), strict=True):
        torch.testing.assert_close(actual.double(), ref, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


CASES = {
    "gqa": dict(shape=(2, 4, 2, 19, 23, 16), causal=False, bias=None),
    "gqa-causal-padded-d": dict(shape=(2, 4, 2, 19, 23, 24), causal=True, bias=None),
    "causal-square-padding-bias": dict(shape=(2, 2, 2, 33, 33, 16), causal=True, bias=_padding_bias),
    "mqa-causal-tall-position-bias": dict(shape=(1, 4, 1, 23, 17, 16), causal=True, bias=_position_bias),
    "one-query-causal": dict(shape=(2, 2, 1, 1, 23, 16), causal=True, bias=None),
}

# Softcaps and sliding windows. Windows of 1 (each query sees itself), 5 (inside one 16-key tile) and 19 (across
# tile edges); more queries than keys leaves the last rows without any key once their window passes the keys.
SCORE_CASES = {
    "softcap-gqa": dict(shape=(2, 4, 2, 19, 23, 16), causal=False, bias=None, softcap=2.0, window=None),
    "softcap-causal-position-bias": dict(
        shape=(1, 4, 1, 23, 17, 16), causal=True, bias=_position_bias, softcap=1.5, window=None
    ),
    "window-5-gqa": dict(shape=(2, 4, 2, 37, 37, 16), causal=True, bias=None, softcap=None, window=5),
    "window-19-padding-bias": dict(shape=(2, 2, 2, 37, 41, 24), causal=True, bias=_padding_bias, softcap=None,
                                   window=19),
    "window-1-softcap": dict(shape=(1, 2, 1, 21, 21, 16), causal=True, bias=None, softcap=3.0, window=1),
    "window-softcap-tall": dict(shape=(1, 2, 1, 45, 23, 16), causal=True, bias=_position_bias, softcap=1.5,
                                window=7),
}


ATOMIC_DQ = {"PINNED": 16, "SWEPT": 16, "ATOMIC_DQ": True}


@pytest.mark.parametrize("backward", [None, ATOMIC_DQ], ids=["two-kernel", "atomic-dq"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_fp32_matches_float64(case, backward):
    """fp32 operands multiply exactly (IEEE), so out, lse and all gradients agree with float64 to fp32 rounding;
    the one-kernel backward (dQ added with atomics from the dK/dV kernel) gives the same gradients."""
    b, hq, _, tq, tk, d = case["shape"]
    q, k, v, grad_out = _inputs(*case["shape"])
    bias = None if case["bias"] is None else case["bias"](b, hq, tq, tk)
    scale = d**-0.5
    with kernels.forced_tiles(backward=backward):
        ours = _run(q, k, v, bias, grad_out, scale, case["causal"])
    _assert_fp32_close(ours, _reference(q, k, v, bias, grad_out, scale, case["causal"]))
    assert ours[0].is_contiguous() and all(g.is_contiguous() for g in ours[2])


@pytest.mark.parametrize("case", SCORE_CASES.values(), ids=SCORE_CASES.keys())
def test_softcap_and_window_match_float64(case):
    """c·tanh(x/c) on the scores and a causal sliding window, alone and together, with GQA, biases and ragged
    tiles: out, lse and every gradient agree with float64 to fp32 rounding; rows left without keys give 0."""
    b, hq, _, tq, tk, d = case["shape"]
    q, k, v, grad_out = _inputs(*case["shape"], seed=8)
    bias = None if case["bias"] is None else case["bias"](b, hq, tq, tk)
    options = dict(softcap=case["softcap"], window=case["window"])
    ours = _run(q, k, v, bias, grad_out, d**-0.5, case["causal"], **options)
    _assert_fp32_close(ours, _reference(q, k, v, bias, grad_out, d**-0.5, case["causal"], **options))
    if case["window"] is not None and tq > tk + case["window"]:
        assert torch.all(ours[0][:, :, tk + case["window"] - 1 :] == 0)


@pytest.mark.parametrize("atomic", [False, True], ids=["two-kernel", "atomic-dq"])
def test_softcap_window_bias_gradient_and_dropout(atomic):
    """With a softcap the bias gradient is dS itself (the bias is added after the cap) while q and k get dS times
    tanh's slope; dropout's mask is the same in forward and backward; the atomic-dQ backward agrees."""
    b, hq, hk, tq, tk, d = 1, 2, 1, 29, 29, 16
    q, k, v, grad_out = _inputs(b, hq, hk, tq, tk, d, seed=9)
    bias = _position_bias(b, hq, tq, tk)
    seed, p, softcap, window = _seed(3), 0.2, 1.5, 11
    keep = kernels.dropout_keep_mask(seed, b, hq, tq, tk, p, DEVICE)
    with kernels.forced_tiles(backward={"PINNED": 16, "SWEPT": 16, "ATOMIC_DQ": atomic}):
        out, lse = kernels.forward(q, k, v, bias, d**-0.5, True, p, seed, softcap, window)
        *grads, dbias = kernels.backward(
            q, k, v, bias, out, lse, grad_out, d**-0.5, True, p, seed, not atomic, softcap, window
        )
    full = bias.detach().double().clone().requires_grad_()
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected_out, expected_lse = _attention(*leaves, full, d**-0.5, True, keep, p, softcap, window)
    expected = torch.autograd.grad(expected_out, [*leaves, full], grad_out.double())
    _assert_fp32_close((out, lse, grads), (expected_out, expected_lse, expected[:3]))
    if not atomic:  # the bias gradient comes from the dQ kernel, which the atomic scheme does not run
        torch.testing.assert_close(dbias.double(), expected[3], rtol=1e-5, atol=1e-5)


def test_window_skips_key_blocks_left_of_it():
    """Key blocks left of every row's window are never read: NaN keys and values there reach neither the outputs
    of later query blocks nor, through a NaN output gradient of those rows, dK and dV of the early keys."""
    b, hq, hk, t, d, window = 1, 2, 1, 64, 16, 5
    q, k, v, grad_out = _inputs(b, hq, hk, t, t, d, seed=10)
    poisoned_k, poisoned_v, poisoned_grad = k.clone(), v.clone(), grad_out.clone()
    poisoned_k[:, :, :16], poisoned_v[:, :, :16] = float("nan"), float("nan")  # the first key tile
    poisoned_grad[:, :, 48:] = float("nan")  # the last query tile
    out, _ = kernels.forward(q, poisoned_k, poisoned_v, None, d**-0.5, True, 0.0, None, None, window)
    expected_out, _, _ = _reference(q, k, v, None, grad_out, d**-0.5, True, window=window)
    # rows 32.. start their window at key 28 or later: tiles 0 and 1 of 16 keys are never visited
    torch.testing.assert_close(out[:, :, 32:].double(), expected_out[:, :, 32:], rtol=1e-5, atol=1e-5)
    out, lse = kernels.forward(q, k, v, None, d**-0.5, True, 0.0, None, None, window)
    _, dk, dv, _ = kernels.backward(q, k, v, None, out, lse, poisoned_grad, d**-0.5, True, 0.0, None, False, None,
                                    window)
    _, _, (_, expected_dk, expected_dv) = _reference(q, k, v, None, poisoned_grad.nan_to_num(0.0), d**-0.5, True,
                                                     window=window)
    # keys 0..31 are seen by rows up to 35 at most: the query tile 48..63 is never visited for them
    for actual, expected in ((dk, expected_dk), (dv, expected_dv)):
        torch.testing.assert_close(actual[:, :, :32].double(), expected[:, :, :32], rtol=1e-5, atol=1e-5)


def test_strided_inputs():
    """BSHD-permuted q, a head-dim slice of a wider k and a v whose last dim is not unit-stride."""
    b, hq, hk, tq, tk, d = 2, 4, 2, 19, 23, 16
    q, k, v, grad_out = _inputs(b, hq, hk, tq, tk, d, seed=1)
    q_view = q.transpose(1, 2).contiguous().transpose(1, 2)
    k_view = torch.cat([k, torch.randn_like(k)], dim=-1)[..., :d]
    v_view = v.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert not q_view.is_contiguous() and not k_view.is_contiguous() and v_view.stride(-1) != 1
    bias = _position_bias(b, hq, tq, tk)
    ours = _run(q_view, k_view, v_view, bias, grad_out.transpose(1, 2).contiguous().transpose(1, 2), 0.3, False)
    _assert_fp32_close(ours, _reference(q, k, v, bias, grad_out, 0.3, False))


@pytest.mark.parametrize("causal", [False, True])
def test_fully_masked_rows(causal):
    """Rows whose keys are all -inf give out 0 and lse -inf with finite gradients; a row whose first key block
    is masked but later ones are not is exact (the running max starts at -inf)."""
    b, hq, hk, tq, tk, d = 1, 2, 1, 19, 23, 16
    q, k, v, grad_out = _inputs(b, hq, hk, tq, tk, d, seed=2)
    bias = torch.zeros(1, 1, tq, tk)
    bias[0, 0, 3] = NEG_INF  # dead row
    bias[0, 0, 17, :16] = NEG_INF  # first key block masked (causal: key 16 stays visible)
    bias[0, 0, 11, :-1] = NEG_INF  # one key left (causal: dead)
    bias = bias.to(DEVICE).expand(b, hq, tq, tk)
    ours = _run(q, k, v, bias, grad_out, d**-0.5, causal)
    expected = _reference(q, k, v, bias, grad_out, d**-0.5, causal)
    _assert_fp32_close(ours, expected)
    out, lse, grads = ours
    dead = [3, 11] if causal else [3]
    assert torch.all(out[:, :, dead] == 0) and torch.all(torch.isneginf(lse[:, :, dead]))
    assert torch.isfinite(lse[:, :, 17]).all()
    assert all(torch.isfinite(g).all() for g in grads)


def test_left_padding_key_bias_broadcast_over_queries():
    """The graph rewrite's key padding: a [B, 1, 1, Tk] 0 / -inf bias read with stride 0 over heads and queries,
    beside the causal flag. Left padding longer than a key block leaves the first rows without keys (out 0,
    lse -inf, no gradient), a sequence of padding leaves all; the op (CPU reference or kernels) agrees."""
    b, hq, hk, t, d = 3, 4, 2, 37, 16
    q, k, v, grad_out = _inputs(b, hq, hk, t, t, d, seed=3)
    keys = torch.zeros(b, 1, 1, t)
    keys[1, ..., :20] = NEG_INF  # left padding over the first key block and into the second
    keys[2] = NEG_INF  # a sequence of padding
    keys = keys.to(DEVICE)
    bias = keys.expand(b, hq, t, t)
    assert bias.stride()[1:3] == (0, 0)
    ours = _run(q, k, v, bias, grad_out, d**-0.5, True)
    _assert_fp32_close(ours, _reference(q, k, v, bias, grad_out, d**-0.5, True))
    out, lse, grads = ours
    assert torch.all(out[1, :, :20] == 0) and torch.all(torch.isneginf(lse[1, :, :20]))
    assert torch.all(out[2] == 0) and torch.isfinite(lse[1, :, 20:]).all()
    assert all(torch.isfinite(g).all() for g in grads)

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    op_out, op_lse, _ = torch.ops.memopt.flash_attention(*leaves, keys, d**-0.5, True, 0.0)
    op_grads = torch.autograd.grad(op_out, leaves, grad_out)
    _assert_fp32_close((op_out, op_lse, op_grads), _reference(q, k, v, bias, grad_out, d**-0.5, True))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_key_padding_skips_the_key_blocks_it_masks_whole(causal):
    """Key blocks a key bias masks for every query are never read: NaN keys and values in them (right padding's
    tail in sequence 0, left padding's head in sequence 1) reach no output and no gradient, and dK, dV there
    are 0 as the reference's are. The partly padded blocks around them are computed with the bias."""
    b, hq, hk, t, d = 2, 4, 2, 64, 16
    q, k, v, grad_out = _inputs(b, hq, hk, t, t, d, seed=11)
    keys = torch.zeros(b, 1, 1, t)
    keys[0, ..., 20:] = NEG_INF  # 16-key blocks 2 and 3 wholly padded, block 1 partly
    keys[1, ..., :34] = NEG_INF  # blocks 0 and 1 wholly padded, block 2 partly
    bias = keys.to(DEVICE).expand(b, hq, t, t)
    poisoned_k, poisoned_v = k.clone(), v.clone()
    for tensor in (poisoned_k, poisoned_v):
        tensor[0, :, 32:], tensor[1, :, :32] = float("nan"), float("nan")
    tiles = ({"BLOCK_M": 16, "BLOCK_N": 16}, {"PINNED": 16, "SWEPT": 16})
    with kernels.forced_tiles(*tiles):
        ours = _run(q, poisoned_k, poisoned_v, bias, grad_out, d**-0.5, causal)
    expected = _reference(q, k, v, bias, grad_out, d**-0.5, causal)
    _assert_fp32_close(ours, expected)
    _, _, (_, dk, dv) = ours
    assert torch.all(dk[0, :, 20:] == 0) and torch.all(dv[1, :, :34] == 0)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    ("softcap", "window"), [(None, None), (1.5, None), (None, 6), (2.0, 9)], ids=["plain", "softcap", "window", "both"]
)
def test_low_precision_no_worse_than_eager(dtype, softcap, window):
    """|ours − fp64| ≤ 2·|eager same dtype − fp64| + floor for out, lse and every gradient (the FA2 test rule).

    The floor is what rounding the exact result to the output dtype costs (at least 1e-5): no 16-bit result can do
    better, and at these sizes both errors sit within a few such roundings, so their ratio alone is noise (ours
    over eager's ran from 0.6 to 2.4 over four seeds with a softcap)."""
    b, hq, hk, tq, tk, d = 2, 4, 2, 19, 23, 24
    q, k, v, grad_out = _inputs(b, hq, hk, tq, tk, d, dtype, seed=3)
    bias = _position_bias(b, hq, tq, tk, dtype)
    scale = d**-0.5
    out, lse, grads = _run(q, k, v, bias, grad_out, scale, True, softcap=softcap, window=window)
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    eager_out, eager_lse = _attention(*leaves, bias, scale, True, softcap=softcap, window=window)
    eager_grads = torch.autograd.grad(eager_out, leaves, grad_out)
    ref_out, ref_lse, ref_grads = _reference(q, k, v, bias, grad_out, scale, True, softcap=softcap, window=window)
    triples = zip(
        ("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (eager_out, eager_lse, *eager_grads),
        (ref_out, ref_lse, *ref_grads), strict=True,
    )
    for name, mine, theirs, truth in triples:
        our_error = (mine.double() - truth).abs().max().item()
        eager_error = (theirs.double() - truth).abs().max().item()
        floor = max(1e-5, (truth.to(mine.dtype).double() - truth).abs().max().item())
        assert our_error <= 2 * eager_error + floor, (name, our_error, eager_error, floor)


def _seed(value):
    return torch.tensor([value], dtype=torch.int64, device=DEVICE)


def test_dropout_draws_are_seeded():
    """p = 0 is no dropout; a seed fixes the draw, another seed changes it; about 1 − p of the mask is kept."""
    shape = (2, 4, 2, 19, 23, 16)
    q, k, v, _ = _inputs(*shape, seed=4)
    plain, plain_lse = kernels.forward(q, k, v, None, 0.25, True, 0.0, None)
    zero, zero_lse = kernels.forward(q, k, v, None, 0.25, True, 0.0, _seed(7))
    assert torch.equal(plain, zero) and torch.equal(plain_lse, zero_lse)
    first, first_lse = kernels.forward(q, k, v, None, 0.25, True, 0.3, _seed(7))
    again, _ = kernels.forward(q, k, v, None, 0.25, True, 0.3, _seed(7))
    other, _ = kernels.forward(q, k, v, None, 0.25, True, 0.3, _seed(8))
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert torch.equal(first_lse, plain_lse)  # lse is taken before dropout

    keep = kernels.dropout_keep_mask(_seed(7), 2, 4, 19, 23, 0.3, DEVICE)
    assert keep.shape == (2, 4, 19, 23) and keep.dtype == torch.bool
    assert abs(keep.float().mean().item() - 0.7) < 0.03
    assert not torch.equal(keep, kernels.dropout_keep_mask(_seed(8), 2, 4, 19, 23, 0.3, DEVICE))


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_backward_uses_the_forward_mask(causal):
    """With the kernel's own keep mask in a float64 reference, out, lse and all gradients agree to fp32 rounding."""
    b, hq, hk, tq, tk, d = 2, 4, 2, 19, 23, 16
    q, k, v, grad_out = _inputs(b, hq, hk, tq, tk, d, seed=5)
    bias = _padding_bias(b, hq, tq, tk)
    seed, p = _seed(1234), 0.2
    keep = kernels.dropout_keep_mask(seed, b, hq, tq, tk, p, DEVICE)
    ours = _run(q, k, v, bias, grad_out, d**-0.5, causal, p, seed)
    _assert_fp32_close(ours, _reference(q, k, v, bias, grad_out, d**-0.5, causal, keep, p))


@pytest.mark.slow
def test_dropout_is_unbiased():
    """The mean over 256 draws (a stride-0 batch: one problem, a different mask per batch index) is within
    5 standard deviations, computed from the exact probabilities, of the output without dropout."""
    draws, tq, tk, d, p = 256, 13, 21, 16, 0.3
    q, k, v, _ = _inputs(1, 1, 1, tq, tk, d, seed=6)
    expand = lambda t: t.expand(draws, -1, -1, -1)  # noqa: E731
    out, _ = kernels.forward(expand(q), expand(k), expand(v), None, d**-0.5, False, p, _seed(99))
    probs = torch.softmax(q.double() @ k.double().transpose(-1, -2) * d**-0.5, -1)[0, 0]
    exact = probs @ v.double()[0, 0]
    std = ((probs**2 @ v.double()[0, 0] ** 2) * p / (1 - p) / draws).sqrt()
    assert ((out.double().mean(0)[0] - exact).abs() <= 5 * std + 1e-6).all()


@pytest.mark.parametrize(
    "tiles",
    [({"BLOCK_M": 32, "BLOCK_N": 16}, {"PINNED": 32, "SWEPT": 16}),
     ({"BLOCK_M": 16, "BLOCK_N": 32}, {"PINNED": 16, "SWEPT": 32})],
    ids=["tall", "wide"],
)
def test_unequal_tiles(tiles):
    """Block skipping and the masked/unmasked split hold when query and key tiles differ (as on CUDA)."""
    b, hq, hk, tq, tk, d = 1, 2, 1, 37, 29, 16
    q, k, v, grad_out = _inputs(b, hq, hk, tq, tk, d, seed=7)
    bias = _position_bias(b, hq, tq, tk)
    seed, p = _seed(5), 0.25
    keep = kernels.dropout_keep_mask(seed, b, hq, tq, tk, p, DEVICE)
    with kernels.forced_tiles(*tiles):
        assert kernels._launch_tiles(kernels._block_d(d), q.dtype, True) == tiles
        ours = _run(q, k, v, bias, grad_out, d**-0.5, True, p, seed)
    _assert_fp32_close(ours, _reference(q, k, v, bias, grad_out, d**-0.5, True, keep, p))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_cuda_tiles_fit_shared_memory(monkeypatch, dtype):
    """The fixed CUDA tiles are valid dot shapes and their pipelined K/V (or Q/dO) tiles fit Hopper's 227 KB."""
    monkeypatch.setattr(kernels, "interpreting", lambda: False)
    size = torch.finfo(dtype).bits // 8
    for head_dim, extras in itertools.product((16, 32, 64, 80, 96, 128, 256), (False, True)):
        block_d = kernels._block_d(head_dim)
        fwd, bwd = kernels._tiles(block_d, dtype, extras)
        blocks = (fwd["BLOCK_M"], fwd["BLOCK_N"], bwd["PINNED"], bwd["SWEPT"])
        assert all(x >= 16 and x & (x - 1) == 0 for x in blocks)
        forward_bytes = (fwd["BLOCK_M"] + fwd["num_stages"] * 2 * fwd["BLOCK_N"]) * block_d * size
        backward_bytes = (2 * bwd["PINNED"] + bwd["num_stages"] * 2 * bwd["SWEPT"]) * block_d * size
        assert max(forward_bytes, backward_bytes) <= 227 * 1024, (head_dim, forward_bytes, backward_bytes)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_bias_gradient_is_ds(causal, dropout_p):
    """With bias_grad the dQ kernel writes dS = ∂loss/∂bias for every (b, h, i, j); blocks it never visits
    (above the causal diagonal) stay zero."""
    b, hq, hk, tq, tk, d = 2, 4, 2, 21, 19, 16
    q, k, v, grad_out = _inputs(b, hq, hk, tq, tk, d, seed=3)
    bias = _position_bias(b, hq, tq, tk)
    seed = _seed(11)
    keep = kernels.dropout_keep_mask(seed, b, hq, tq, tk, dropout_p, DEVICE) if dropout_p else None
    out, lse = kernels.forward(q, k, v, bias, d**-0.5, causal, dropout_p, seed)
    *_, dbias = kernels.backward(q, k, v, bias, out, lse, grad_out, d**-0.5, causal, dropout_p, seed, bias_grad=True)
    full = bias.detach().double().clone().requires_grad_()
    leaves = [t.detach().double() for t in (q, k, v)]
    expected_out, _ = _attention(*leaves, full, d**-0.5, causal, keep, dropout_p)
    (expected,) = torch.autograd.grad(expected_out, [full], grad_out.double())
    assert dbias.shape == (b, hq, tq, tk) and dbias.dtype == torch.float32
    torch.testing.assert_close(dbias.double(), expected, rtol=1e-5, atol=1e-5)


def test_atomic_dq_with_dropout():
    b, hq, hk, tq, tk, d = 1, 2, 1, 21, 19, 16
    q, k, v, grad_out = _inputs(b, hq, hk, tq, tk, d, seed=4)
    seed, p = _seed(9), 0.3
    keep = kernels.dropout_keep_mask(seed, b, hq, tq, tk, p, DEVICE)
    with kernels.forced_tiles(backward=ATOMIC_DQ):
        ours = _run(q, k, v, None, grad_out, d**-0.5, True, p, seed)
    _assert_fp32_close(ours, _reference(q, k, v, None, grad_out, d**-0.5, True, keep, p))


@pytest.mark.parametrize("case", ["gqa", "gqa-causal-padded-d", "one-query-causal"])
def test_tma_forward_matches_float64(case):
    """The forward through tensor descriptors (Hopper's TMA) gives the same output and lse; a head dim that
    is not a power of two (24) falls back to plain loads."""
    shape, causal = CASES[case]["shape"], CASES[case]["causal"]
    q, k, v, grad_out = _inputs(*shape)
    scale = shape[-1] ** -0.5
    assert kernels._tma_ready(q, k, v) == (shape[-1] == 16)
    with kernels.forced_tiles(forward={"BLOCK_M": 16, "BLOCK_N": 16, "TMA": True}):
        ours = _run(q, k, v, None, grad_out, scale, causal)
    _assert_fp32_close(ours, _reference(q, k, v, None, grad_out, scale, causal))


@pytest.mark.parametrize(("case", "tma"), [("gqa-causal-padded-d", False), ("gqa", True)], ids=["plain-loads", "tma"])
def test_warp_specialized_forward_matches_float64(case, tma):
    """The warp-specialized key loop (opt-in) computes the same attention, with plain loads or descriptors."""
    shape, causal = CASES[case]["shape"], CASES[case]["causal"]
    q, k, v, grad_out = _inputs(*shape)
    assert kernels._tma_ready(q, k, v) == tma
    scale = shape[-1] ** -0.5
    with kernels.forced_tiles(forward={"BLOCK_M": 16, "BLOCK_N": 16, "TMA": tma, "WARP_SPECIALIZE": True}):
        ours = _run(q, k, v, None, grad_out, scale, causal)
    _assert_fp32_close(ours, _reference(q, k, v, None, grad_out, scale, causal))


def test_tma_needs_aligned_rows_and_a_power_of_two_head_dim():
    q = torch.randn(1, 2, 9, 16, device=DEVICE)
    assert kernels._tma_ready(q, q, q)
    shifted = torch.randn(1 + q.numel(), device=DEVICE)[1:].view(q.shape)  # its base 4 bytes off alignment
    assert not kernels._tma_ready(shifted, q, q)
    assert not kernels._tma_ready(torch.randn(1, 2, 9, 24, device=DEVICE), q, q)  # 24 is not a power of two
    assert not kernels._tma_ready(q.transpose(-1, -2), q, q)  # last dim not unit-stride


def test_a_key_bias_keeps_the_tiles_of_its_case():
    """A key bias adds one vector a tile, not a tile of bias values: it launches with the settings of the case
    without a bias, while a bias that varies over the queries, or dropout, takes the narrower ones."""
    b, h, t = 2, 2, 8
    key_bias = torch.zeros(b, 1, 1, t).expand(b, h, t, t)
    full_bias = torch.zeros(b, 1, t, t).expand(b, h, t, t)
    assert not kernels._extras(key_bias, 0.0) and not kernels._extras(None, 0.0)
    assert kernels._extras(full_bias, 0.0) and kernels._extras(key_bias, 0.1)
    padded = torch.zeros(b, 1, 1, t).masked_fill(torch.arange(t) >= 5, NEG_INF)
    padded[1] = NEG_INF  # a sequence of padding: an empty span
    spans = kernels._key_spans(padded.expand(b, h, t, t))
    assert spans.shape == (b, h, 2) and spans.tolist() == [[[0, 5], [0, 5]], [[t, 0], [t, 0]]]
    assert kernels._key_spans(full_bias) is None
