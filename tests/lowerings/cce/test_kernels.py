"""CCE Triton kernels against float64 math: on CPU through Triton's interpreter, on CUDA natively.

Shapes are odd on purpose (not multiples of any tile) and the split/chunk sizes are shrunk so that the
forward merges several vocabulary slices and the backward walks several column chunks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from lowerings.cce import kernels, reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch):
    monkeypatch.setattr(kernels, "FORWARD_SPLIT_COLUMNS", 32)
    monkeypatch.setattr(kernels, "CHUNK_COLUMNS", 48)


def _inputs(n, v, d, dtype, bias, ignore_every=4):
    gen = torch.Generator().manual_seed(n * 1000 + v + d)
    hidden = torch.randn(n, d, generator=gen)
    weight = torch.randn(v, d, generator=gen) / d**0.5
    b = torch.randn(v, generator=gen) if bias else None
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[::ignore_every] = -100
    cast = lambda t: None if t is None else t.to(DEVICE, dtype)  # noqa: E731
    return cast(hidden), cast(weight), cast(b), targets.to(DEVICE)


def _double(t):
    return None if t is None else t.double()


def _upstream(targets, n):
    gen = torch.Generator().manual_seed(n)
    grad_rows = torch.randn(n, generator=gen).double().to(targets.device) * (targets != -100)
    grad_lse = 0.1 * torch.randn(n, generator=gen).double().to(targets.device)
    return grad_rows, grad_lse


def _relative(actual, expected):
    return ((actual.double() - expected).norm() / expected.norm().clamp_min(1e-30)).item()


# (40, 70, 32): a hidden size that is a multiple of the tile depth (the unmasked loads), ragged rows and classes
@pytest.mark.parametrize("shape", [(37, 53, 19), (5, 130, 24), (64, 97, 33), (40, 70, 32)])
@pytest.mark.parametrize(("bias", "softcap", "smoothing"), [(False, None, 0.0), (True, 4.0, 0.1), (True, None, 0.2)])
def test_fp32_kernels_match_float64(shape, bias, softcap, smoothing):
    """fp32 operands multiply exactly (IEEE), so forward and backward agree with float64 to fp32 rounding."""
    n, v, d = shape
    hidden, weight, b, targets = _inputs(n, v, d, torch.float32, bias)
    loss, lse = kernels.forward_rows(hidden, weight, b, targets, -100, smoothing, softcap)
    ref_loss, ref_lse = reference.forward(_double(hidden), _double(weight), _double(b), targets, -100, smoothing, softcap)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)

    grad_rows, grad_lse = _upstream(targets, n)
    needs = (True, True, bias)
    grads = kernels.backward(hidden, weight, b, targets, lse, grad_rows.float(), grad_lse.float(), smoothing, softcap, needs)
    expected = reference.backward(
        _double(hidden), _double(weight), _double(b), targets, ref_lse, grad_rows, grad_lse, -100, smoothing, softcap,
        needs,
    )
    for name, actual, ref in zip(("hidden", "weight", "bias"), grads, expected, strict=True):
        if ref.numel():
            assert _relative(actual, ref) < 1e-5, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("bias", "softcap"), [(False, None), (True, 5.0)])
def test_low_precision_no_worse_than_eager(dtype, bias, softcap):
    """|ours − fp64| ≤ 2·|eager same dtype − fp64| + floor, for the loss and every gradient."""
    n, v, d = 48, 75, 40
    hidden, weight, b, targets = _inputs(n, v, d, dtype, bias)

    def eager(h, w, bb):
        logits = F.linear(h, w, bb)
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        return F.cross_entropy(logits.float(), targets)

    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight, b) if t is not None]
    low = eager(*leaves, *([None] if b is None else []))
    low_grads = torch.autograd.grad(low, leaves)
    exact_leaves = [t.detach().double().requires_grad_() for t in leaves]
    exact = eager(*exact_leaves, *([None] if b is None else []))
    exact_grads = torch.autograd.grad(exact, exact_leaves)

    rows, lse = kernels.forward_rows(hidden, weight, b, targets, -100, 0.0, softcap)
    valid = (targets != -100).sum()
    ours = rows.sum() / valid
    grad_rows = torch.where(targets != -100, 1.0 / valid, 0.0).float()
    grads = kernels.backward(
        hidden, weight, b, targets, lse, grad_rows, torch.zeros_like(lse), 0.0, softcap, (True, True, bias)
    )
    pairs = [(ours, low, exact), *zip((g for g in grads if g.numel()), low_grads, exact_grads, strict=True)]
    for index, (mine, theirs, truth) in enumerate(pairs):
        our_error = (mine.double() - truth).abs().max().item()
        eager_error = (theirs.double() - truth).abs().max().item()
        assert our_error <= 2 * eager_error + 1e-6, (index, our_error, eager_error)


def test_ignored_rows_and_frozen_inputs():
    """Ignored rows get zero loss but a real log-sum-exp; gradients not asked for come back empty."""
    hidden, weight, _, targets = _inputs(20, 33, 16, torch.float32, False, ignore_every=1)
    loss, lse = kernels.forward_rows(hidden, weight, None, targets, -100, 0.0, None)
    assert torch.count_nonzero(loss) == 0
    torch.testing.assert_close(lse, torch.logsumexp(hidden @ weight.t(), dim=-1), rtol=1e-5, atol=1e-5)
    zeros = torch.zeros_like(lse)
    grad_hidden, grad_weight, grad_bias = kernels.backward(
        hidden, weight, None, targets, lse, zeros, torch.ones_like(lse), 0.0, None, (False, True, False)
    )
    assert grad_hidden.numel() == 0 and grad_bias.numel() == 0
    softmax = torch.softmax(hidden.double() @ weight.double().t(), dim=-1)
    torch.testing.assert_close(grad_weight.double(), softmax.t() @ hidden.double(), rtol=1e-5, atol=1e-5)


def test_strided_inputs():
    """A transposed weight view and a row-strided hidden slice are read through their strides."""
    hidden, weight, _, targets = _inputs(30, 41, 24, torch.float32, False)
    wide = torch.randn(60, 24, device=DEVICE)
    wide[::2] = hidden
    strided_hidden = wide[::2]
    weight_view = weight.t().contiguous().t()
    assert not strided_hidden.is_contiguous() and not weight_view.is_contiguous()
    loss, lse = kernels.forward_rows(strided_hidden, weight_view, None, targets, -100, 0.0, None)
    ref_loss, ref_lse = reference.forward(hidden.double(), weight.double(), None, targets, -100, 0.0, None)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


def _filtered_reference(
    hidden, weight, bias, targets, lse, grad_rows, grad_lse, smoothing, softcap, eps, tile_rows, tile_cols, chunk
):
    """Float64 gradients with the filter's semantics spelled out: columns in the mean-logit order, and every
    tile × tile block (rows × sorted columns, within each backward chunk) whose contributing rows all have
    |softmax − target| < eps dropped from the logit gradient."""
    h, w = hidden.double(), weight.double()
    b = None if bias is None else bias.double()
    order = kernels.vocabulary_order(hidden, weight, bias)
    logits = h @ w.t() + (b if b is not None else 0.0)
    capped = torch.tanh(logits / softcap) if softcap else None
    z = capped * softcap if softcap else logits
    probs = torch.exp(z - lse.double()[:, None])
    n, v = probs.shape
    keep = torch.zeros(n, v, dtype=torch.float64, device=probs.device)
    valid = targets != -100
    keep[valid.nonzero()[:, 0], targets[valid]] = 1.0
    target = (1 - smoothing) * keep + smoothing / v
    grad = probs * (grad_rows + grad_lse)[:, None] - grad_rows[:, None] * target
    if softcap:
        grad = grad * (1 - capped**2)
    contributing = ((grad_rows != 0) | (grad_lse != 0))[:, None]
    distance = torch.where(contributing, (probs - target).abs(), 0.0)[:, order]
    dead = torch.zeros_like(distance, dtype=torch.bool)
    for start in range(0, v, chunk):
        for i in range(0, n, tile_rows):
            for j in range(start, min(start + chunk, v), tile_cols):
                end = min(j + tile_cols, start + chunk, v)
                dead[i : i + tile_rows, j:end] = distance[i : i + tile_rows, j:end].max() < eps
    grad[:, order] = torch.where(dead, 0.0, grad[:, order])
    return grad @ w, grad.t() @ h, grad.sum(0), dead.double().mean().item()


@pytest.mark.skipif(DEVICE != "cpu", reason="tile sizes of the interpreter")
@pytest.mark.parametrize(("bias", "softcap", "smoothing"), [(False, None, 0.0), (True, 4.0, 0.1)])
def test_gradient_filter_drops_exactly_the_dead_tiles(bias, softcap, smoothing):
    """eps → 0 keeps every tile (the sorted walk alone changes nothing); a large eps drops the tiles the rule
    says, no more: the result equals float64 math with those tiles zeroed, and differs from the exact one."""
    n, v, d = 37, 97, 19
    hidden, weight, b, targets = _inputs(n, v, d, torch.float32, bias)
    _, lse = kernels.forward_rows(hidden, weight, b, targets, -100, smoothing, softcap)
    grad_rows, grad_lse = _upstream(targets, n)
    needs = (True, True, bias)
    run = lambda eps: kernels.backward(  # noqa: E731
        hidden, weight, b, targets, lse, grad_rows.float(), grad_lse.float(), smoothing, softcap, needs, eps
    )
    exact = run(0.0)
    for actual, ref in zip(run(1e-30), exact, strict=True):
        if ref.numel():
            assert _relative(actual, ref.double()) < 1e-5
    eps = 0.12  # tiles without a target column die: about a quarter of them here
    expected = _filtered_reference(
        hidden, weight, b, targets, lse, grad_rows, grad_lse, smoothing, softcap, eps, 16, 16, kernels.CHUNK_COLUMNS
    )
    *expected_grads, dead_fraction = expected
    assert 0.1 < dead_fraction < 0.9, dead_fraction
    filtered = run(eps)
    for name, actual, ref, full in zip(("hidden", "weight", "bias"), filtered, expected_grads, exact, strict=True):
        if full.numel():
            assert _relative(actual, ref) < 1e-5, name
            assert _relative(full, ref) > 1e-4, name  # the filter did change this gradient


def test_filter_tiles_must_nest():
    """A product whose tiles straddle the filter's tiles could skip live values: refused, not risked."""
    a = torch.zeros(40, 40, device=DEVICE)
    live = kernels.LiveTiles(torch.ones(4, 4, dtype=torch.int8, device=DEVICE), rows=10, cols=10)
    with pytest.raises(ValueError, match="do not nest"):
        kernels.accumulate_product(torch.zeros(40, 8, device=DEVICE), None, a, torch.zeros(40, 8, device=DEVICE),
                                   live=live)
