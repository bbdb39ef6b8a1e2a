"""The CCE ops with a logit scale (multiplied or divided) and a softcap between classifier and loss, against float64
math: the loss and the gradients of hidden states, classifier and bias for every op and variant (chunked, row-wise,
with the logits returned), ignored rows included; the returned logits transformed as the model computes them, and
their own gradient through the transform; the CUDA kernels through Triton's interpreter on CPU.

The float64 oracle is ``F.cross_entropy(c·tanh(linear(h, W, b)·s/d / c))`` on the very values the op received.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lowerings.cce import linear_cross_entropy, reference, rowwise
from tests.helpers import assert_close_all

N, V, D = 23, 37, 8
FP64 = {"rtol": 1e-10, "atol": 1e-10}
FP32 = {"rtol": 1e-4, "atol": 1e-6}
# (scale, divisor, softcap): Cohere's logit_scale, Granite's logits_scaling, Gemma 2's softcap, a scale then a softcap
TRANSFORMS = [(0.3, 1.0, None), (1.0, 3.0, None), (1.0, 1.0, 0.5), (2.5, 1.0, 1.5)]
IDS = ["mul", "div", "softcap", "mul_softcap"]


def _inputs(dtype: torch.dtype, bias: bool, n: int = N, vocab: int = V, dim: int = D, device: str = "cpu"):
    gen = torch.Generator().manual_seed(n + vocab + dim)
    tensors = [torch.randn(n, dim, generator=gen), torch.randn(vocab, dim, generator=gen) / dim**0.5]
    if bias:
        tensors.append(torch.randn(vocab, generator=gen))
    targets = torch.randint(0, vocab, (n,), generator=gen)
    targets[::4] = -100  # ignored rows
    return [t.to(device, dtype).requires_grad_() for t in tensors], targets.to(device)


def _transformed(logits: torch.Tensor, scale: float, divisor: float, softcap: float | None) -> torch.Tensor:
    """What the model computes after its classifier, op by op."""
    logits = logits * scale / divisor
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


def _exact(leaves, targets, transform, reduction="mean", smoothing=0.0):
    """(loss, transformed logits) in float64 from the leaves' own values, differentiable back to them."""
    logits = _transformed(F.linear(*[t.double() for t in leaves]), *transform)
    return F.cross_entropy(logits, targets, reduction=reduction, label_smoothing=smoothing), logits


def _split(leaves):
    h, w, *b = leaves
    return h, w, (b[0] if b else None)


def _total(loss, logits=None, logits_grad=None):
    """A scalar reaching every row's loss (different weights) and, through ``logits_grad``, the returned logits."""
    weights = torch.linspace(-1, 1, loss.numel(), dtype=loss.dtype).view(loss.shape)
    total = (loss * weights).sum()
    return total if logits_grad is None else total + (logits * logits_grad.to(logits.dtype)).sum()


def _exact_leaves(leaves, targets, transform, reduction="mean", smoothing=0.0):
    """``_exact`` over float64 copies of the leaves, with the copies (for their gradients)."""
    doubles = [t.detach().double().requires_grad_() for t in leaves]
    loss, logits = _exact(doubles, targets, transform, reduction, smoothing)
    return loss, logits, doubles


def _check(ours_loss, ours_logits, leaves, targets, transform, tol, reduction="mean", smoothing=0.0,
           logits_grad=None):
    loss, logits, doubles = _exact_leaves(leaves, targets, transform, reduction, smoothing)
    torch.testing.assert_close(ours_loss.double(), loss.detach(), **tol)
    if ours_logits is not None:
        torch.testing.assert_close(ours_logits.double(), logits.detach(), **tol)
    use_logits = ours_logits is not None and logits_grad is not None
    actual = torch.autograd.grad(_total(ours_loss, ours_logits if use_logits else None,
                                        logits_grad if use_logits else None), leaves)
    expected = torch.autograd.grad(_total(loss, logits if use_logits else None,
                                          logits_grad if use_logits else None), doubles)
    assert_close_all([a.double() for a in actual], expected, **tol)


# --- memopt.cce (chunked) --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("scale", "divisor", "softcap"), TRANSFORMS, ids=IDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(("dtype", "bias", "smoothing"), [(torch.float64, False, 0.0), (torch.float32, True, 0.1)])
def test_cce_matches_float64(scale, divisor, softcap, reduction, dtype, bias, smoothing):
    leaves, targets = _inputs(dtype, bias)
    h, w, b = _split(leaves)
    loss, _ = torch.ops.memopt.cce(h, w, b, targets, -100, reduction, smoothing, softcap, 0.0, scale, divisor)
    if reduction == "none":
        assert (loss[targets == -100] == 0).all()
    tol = FP64 if dtype == torch.float64 else FP32
    _check(loss, None, leaves, targets, (scale, divisor, softcap), tol, reduction, smoothing)


def test_linear_cross_entropy_takes_the_scale():
    leaves, targets = _inputs(torch.float64, bias=False)
    h, w, _ = _split(leaves)
    loss, lse = linear_cross_entropy(h.view(1, N, D), w, targets.view(1, N), softcap=1.5, scale=2.5, return_lse=True)
    expected, logits, _ = _exact_leaves(leaves, targets, (2.5, 1.0, 1.5))
    torch.testing.assert_close(loss, expected.detach(), **FP64)
    torch.testing.assert_close(lse.view(N), torch.logsumexp(logits, -1).detach(), **FP64)


def test_z_loss_sees_the_transformed_log_sum_exp():
    """The op's log-sum-exp (a z-loss reads it) is that of the transformed logits, and so is its gradient."""
    leaves, targets = _inputs(torch.float64, bias=True)
    h, w, b = _split(leaves)
    loss, lse = torch.ops.memopt.cce(h, w, b, targets, -100, "mean", 0.0, 1.5, 0.0, 2.5, 1.0)
    _, logits, doubles = _exact_leaves(leaves, targets, (2.5, 1.0, 1.5))
    expected_lse = torch.logsumexp(logits, -1)
    torch.testing.assert_close(lse, expected_lse.detach(), **FP64)
    ours = torch.autograd.grad(loss + lse.square().mean(), leaves)
    exact_loss = F.cross_entropy(logits, targets)
    theirs = torch.autograd.grad(exact_loss + expected_lse.square().mean(), doubles)
    assert_close_all(ours, theirs, **FP64)


@pytest.mark.parametrize(("scale", "divisor"), [(0.0, 1.0), (-0.5, 1.0), (1.0, 0.0), (float("inf"), 1.0)])
def test_scale_must_be_positive_and_finite(scale, divisor):
    leaves, targets = _inputs(torch.float32, bias=False)
    h, w, _ = _split(leaves)
    with pytest.raises(RuntimeError, match="logit scale must be positive and finite"):
        torch.ops.memopt.cce(h, w, None, targets, -100, "mean", 0.0, None, 0.0, scale, divisor)


# --- memopt.cce_rowwise ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("scale", "divisor", "softcap"), TRANSFORMS, ids=IDS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(("bias", "smoothing"), [(False, 0.0), (True, 0.1)])
def test_rowwise_matches_float64(monkeypatch, scale, divisor, softcap, reduction, bias, smoothing):
    monkeypatch.setattr(rowwise, "chunk_rows", lambda *_: 5)  # several ragged chunks
    leaves, targets = _inputs(torch.float64, bias)
    h, w, b = _split(leaves)
    needs = (True, True, bias)
    loss = torch.ops.memopt.cce_rowwise(
        h, w, b, targets, -100, reduction, smoothing, softcap, *needs, False, scale, divisor
    )[0]
    _check(loss, None, leaves, targets, (scale, divisor, softcap), FP64, reduction, smoothing)


def _kernel_device() -> str:
    from lowerings._library import interpreting

    return "cpu" if interpreting() or not torch.cuda.is_available() else "cuda"


@pytest.mark.parametrize("kernel", [False, True], ids=["pytorch_chunks", "chunk_kernel"])
@pytest.mark.parametrize(("scale", "divisor", "softcap"), TRANSFORMS, ids=IDS)
@pytest.mark.parametrize("transform_logits", [False, True], ids=["raw_returned", "transformed_returned"])
def test_rowwise_returned_logits(monkeypatch, kernel, scale, divisor, softcap, transform_logits):
    """``return_logits``: the logits come back as the classifier wrote them or, with ``transform_logits``,
    transformed in place after each chunk read them (by the chunk kernel's second sweep where it runs); the loss
    and gradients are the transformed loss's either way."""
    from lowerings._library import HAS_TRITON

    if kernel:
        if not HAS_TRITON:
            pytest.skip("the chunk kernel needs Triton")
        monkeypatch.setattr(rowwise, "_kernel_serves", lambda device_type, dtype: True)
    monkeypatch.setattr(rowwise, "chunk_rows", lambda *_: 7)
    dtype = torch.float32 if kernel else torch.float64
    leaves, targets = _inputs(dtype, bias=True, device=_kernel_device() if kernel else "cpu")
    h, w, b = _split(leaves)
    loss, *_, logits = torch.ops.memopt.cce_rowwise(
        h, w, b, targets, -100, "mean", 0.1, softcap, True, True, True, True, scale, divisor, transform_logits
    )
    assert not logits.requires_grad
    exact_loss, exact_logits, doubles = _exact_leaves(leaves, targets, (scale, divisor, softcap), smoothing=0.1)
    wanted = exact_logits if transform_logits else F.linear(*doubles)
    tol = FP64 if dtype == torch.float64 else FP32
    torch.testing.assert_close(logits.double(), wanted.detach(), **tol)
    torch.testing.assert_close(loss.double(), exact_loss.detach(), **tol)
    assert_close_all([g.double() for g in torch.autograd.grad(loss, leaves)],
                     torch.autograd.grad(exact_loss, doubles), **tol)


def test_rowwise_pytorch_chunks_return_eagers_bits():
    """Off the chunk kernel, the returned logits are transformed op by op in their dtype, as eager does: the
    same bits (bf16 here, where each op rounds)."""
    leaves, targets = _inputs(torch.bfloat16, bias=False)
    h, w, _ = _split(leaves)
    for scale, divisor, softcap in TRANSFORMS:
        logits = torch.ops.memopt.cce_rowwise(
            h, w, None, targets, -100, "mean", 0.0, softcap, True, True, False, True, scale, divisor, True
        )[4]
        expected = reference.transformed_logits(F.linear(h, w), scale, divisor, softcap)
        eager = F.linear(h, w)
        eager = eager * scale if scale != 1.0 else eager
        eager = eager / divisor if divisor != 1.0 else eager
        eager = torch.tanh(eager / softcap) * softcap if softcap is not None else eager
        assert torch.equal(logits, expected.detach()) and torch.equal(logits, eager.detach())


# --- memopt.cce_with_logits ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("scale", "divisor", "softcap"), TRANSFORMS, ids=IDS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("transform_logits", [False, True], ids=["raw_returned", "transformed_returned"])
@pytest.mark.parametrize("logits_used", [False, True])
def test_with_logits_matches_float64(scale, divisor, softcap, reduction, transform_logits, logits_used):
    """The loss over the transformed logits; the logits returned raw or transformed; a gradient reaching them
    (``logits_used``) goes back through the transform where they are transformed, and not where they are raw."""
    leaves, targets = _inputs(torch.float64, bias=True)
    h, w, b = _split(leaves)
    loss, _, logits = torch.ops.memopt.cce_with_logits(
        h, w, b, targets, -100, reduction, 0.1, softcap, False, None, scale, divisor, transform_logits
    )
    exact_loss, exact_logits, doubles = _exact_leaves(leaves, targets, (scale, divisor, softcap), reduction, 0.1)
    returned = exact_logits if transform_logits else F.linear(*doubles)
    torch.testing.assert_close(logits, returned.detach(), **FP64)
    torch.testing.assert_close(loss, exact_loss.detach(), **FP64)
    logits_grad = torch.randn(N, V, dtype=torch.float64) if logits_used else None
    actual = torch.autograd.grad(_total(loss, logits, logits_grad), leaves)
    expected = torch.autograd.grad(_total(exact_loss, returned, logits_grad), doubles)
    assert_close_all(actual, expected, **FP64)


def test_with_logits_returns_eagers_bits():
    """The transformed logits are the model's own ops in its dtype (bf16: each op rounds), bit for bit."""
    leaves, targets = _inputs(torch.bfloat16, bias=True)
    h, w, b = _split(leaves)
    for scale, divisor, softcap in TRANSFORMS:
        logits = torch.ops.memopt.cce_with_logits(
            h, w, b, targets, -100, "mean", 0.0, softcap, True, None, scale, divisor, True
        )[2]
        eager = _eager_transform(F.linear(h, w, b), scale, divisor, softcap)
        assert torch.equal(logits, eager.detach())


def _eager_transform(logits, scale, divisor, softcap):
    """As HF's models write it: ``logits * logit_scale``, ``logits / logits_scaling``, then Gemma 2's three ops."""
    if scale != 1.0:
        logits = logits * scale
    if divisor != 1.0:
        logits = logits / divisor
    if softcap is not None:
        logits = logits / softcap
        logits = torch.tanh(logits)
        logits = logits * softcap
    return logits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", ["cce", "with_logits", "rowwise"])
def test_low_precision_no_worse_than_eager(dtype, op):
    """|ours − fp64| ≤ 2·|eager same dtype − fp64| + the result's own rounding, for the loss and every gradient,
    with a scale and a softcap (the transform in eager runs in the 16-bit dtype, as a model's does)."""
    scale, divisor, softcap = 2.5, 1.0, 1.5
    leaves, targets = _inputs(dtype, bias=True)
    h, w, b = _split(leaves)
    if op == "cce":
        loss = torch.ops.memopt.cce(h, w, b, targets, -100, "mean", 0.0, softcap, 0.0, scale, divisor)[0]
    elif op == "with_logits":
        loss = torch.ops.memopt.cce_with_logits(
            h, w, b, targets, -100, "mean", 0.0, softcap, True, None, scale, divisor, True
        )[0]
    else:
        loss = torch.ops.memopt.cce_rowwise(
            h, w, b, targets, -100, "mean", 0.0, softcap, True, True, True, False, scale, divisor
        )[0]
    ours = [loss, *torch.autograd.grad(loss, leaves)]
    low_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    low = F.cross_entropy(_eager_transform(F.linear(*low_leaves), scale, divisor, softcap).float(), targets)
    theirs = [low, *torch.autograd.grad(low, low_leaves)]
    exact, _, doubles = _exact_leaves(leaves, targets, (scale, divisor, softcap))
    truth = [exact, *torch.autograd.grad(exact, doubles)]
    for index, (mine, eager, wanted) in enumerate(zip(ours, theirs, truth, strict=True)):
        our_error = (mine.double() - wanted).abs().max().item()
        eager_error = (eager.double() - wanted).abs().max().item()
        rounding = torch.finfo(mine.dtype).eps * wanted.abs().max().item()
        assert our_error <= 2 * eager_error + rounding, (index, our_error, eager_error)


@pytest.mark.parametrize("op", ["cce", "with_logits", "rowwise"])
def test_opcheck(op):
    leaves, targets = _inputs(torch.float32, bias=True)
    h, w, b = _split(leaves)
    if op == "cce":
        target, args = torch.ops.memopt.cce.default, (h, w, b, targets, -100, "mean", 0.0, 1.5, 0.0, 2.5, 3.0)
    elif op == "with_logits":
        target = torch.ops.memopt.cce_with_logits.default
        args = (h, w, b, targets, -100, "mean", 0.0, 1.5, False, None, 2.5, 3.0, True)
    else:
        target = torch.ops.memopt.cce_rowwise.default
        args = (h, w, b, targets, -100, "mean", 0.0, 1.5, True, True, True, True, 2.5, 3.0, True)
    torch.library.opcheck(target, args)


# --- the CUDA kernels (natively on CUDA, through Triton's interpreter on CPU) -----------------------------------


@pytest.fixture
def kernels(monkeypatch):
    """The chunked op's kernels with small vocabulary slices and column chunks, so that several are walked."""
    pytest.importorskip("triton")
    from lowerings.cce import kernels

    monkeypatch.setattr(kernels, "FORWARD_SPLIT_COLUMNS", 16)
    monkeypatch.setattr(kernels, "CHUNK_COLUMNS", 16)
    monkeypatch.setattr(kernels, "MIN_COLUMNS", 16)
    return kernels


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(("scale", "divisor", "softcap"), TRANSFORMS, ids=IDS)
def test_kernels_match_float64(kernels, scale, divisor, softcap):
    """fp32 operands multiply exactly in the kernels: their loss, log-sum-exp and gradients are float64's to fp32
    rounding, with the logit scale m = scale / divisor in the tile and in the chain rule."""
    leaves, targets = _inputs(torch.float32, bias=True, n=21, vocab=45, dim=16, device=_device())
    h, w, b = (t.detach() for t in _split(leaves))
    multiplier = scale / divisor
    rows, lse = kernels.forward_rows(h, w, b, targets, -100, 0.1, softcap, multiplier)
    doubles = [t.double() for t in (h, w, b)]
    expected_rows, expected_lse = reference.forward(*doubles, targets, -100, 0.1, softcap, multiplier)
    torch.testing.assert_close(rows.double(), expected_rows, **FP32)
    torch.testing.assert_close(lse.double(), expected_lse, **FP32)
    grad_rows = torch.where(targets != -100, 0.05, 0.0).to(torch.float32)
    grad_lse = torch.full_like(lse, 0.01)
    needs = (True, True, True)
    actual = kernels.backward(h, w, b, targets, lse, grad_rows, grad_lse, 0.1, softcap, needs, scale=multiplier)
    expected = reference.backward(
        *doubles, targets, expected_lse, grad_rows.double(), grad_lse.double(), -100, 0.1, softcap, needs,
        scale=multiplier,
    )
    assert_close_all([a.double() for a in actual], expected, **FP32)


@pytest.mark.parametrize(("scale", "divisor", "softcap"), TRANSFORMS, ids=IDS)
@pytest.mark.parametrize("logits_transformed", [False, True], ids=["raw_returned", "transformed_returned"])
def test_kernel_backward_folds_the_returned_logits_gradient(kernels, scale, divisor, softcap, logits_transformed):
    """The returned logits' gradient joins each chunk: after the chain rule for raw logits, before it for
    transformed ones (inside the kernel under a softcap, whose slope only it holds)."""
    leaves, targets = _inputs(torch.float32, bias=True, n=21, vocab=45, dim=16, device=_device())
    h, w, b = (t.detach() for t in _split(leaves))
    multiplier = scale / divisor
    _, lse = reference.forward(h, w, b, targets, -100, 0.0, softcap, multiplier)
    grad_rows = torch.where(targets != -100, 0.05, 0.0)
    grad_lse = torch.zeros_like(lse)
    # a strided gradient (a transposed buffer), as a tangent may be
    grad_logits = (0.1 * torch.randn(45, 21)).to(h.device).t()
    needs = (True, True, True)
    expected = reference.backward(
        h, w, b, targets, lse, grad_rows, grad_lse, -100, 0.0, softcap, needs, grad_logits, multiplier,
        logits_transformed,
    )
    actual = kernels.backward(
        h, w, b, targets, lse, grad_rows, grad_lse, 0.0, softcap, needs, 0.0, grad_logits, True, multiplier,
        logits_transformed,
    )
    assert_close_all(actual, expected, rtol=1e-4, atol=1e-5)


def test_row_kernel_matches_float64():
    """The row-wise chunk kernel alone: loss terms and the gradient w.r.t. the logits as read, with a scale and a
    softcap; with ``transform`` the returned logits become the transformed ones."""
    pytest.importorskip("triton")
    from lowerings.cce.rowwise_kernel import row_gradient_

    gen = torch.Generator().manual_seed(0)
    rows, vocab, scale, softcap = 5, 300, 2.5, 1.5
    source = torch.randn(rows, vocab, generator=gen).to(_kernel_device())
    targets = torch.randint(0, vocab, (rows,), generator=gen).to(source.device)
    targets[1] = -100
    raw = source.double().requires_grad_()
    z = torch.tanh(raw * scale / softcap) * softcap
    losses = F.cross_entropy(z, targets, reduction="none")
    expected_grad = torch.autograd.grad(0.5 * losses.sum(), raw)[0]
    returned = source.clone()
    gradient = torch.empty_like(source)
    half = torch.tensor(0.5, device=source.device)
    terms = row_gradient_(gradient, targets, -100, 0.0, softcap, half, returned, scale, True)
    torch.testing.assert_close(terms.double(), losses.detach(), **FP32)
    torch.testing.assert_close(gradient.double(), expected_grad, **FP32)
    torch.testing.assert_close(returned.double(), z.detach(), **FP32)


# --- CUDA (run on the GPU machine) ------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", ["cce", "with_logits", "rowwise"])
def test_cuda_no_worse_than_eager(monkeypatch, dtype, op):
    """Each op on CUDA (the chunked kernels, the row-wise chunk kernel over several chunks, cuBLAS's logits) with
    a scale before a softcap: loss and gradients no further from float64 than eager's in the same dtype, and the
    returned logits transformed (within a rounding of eager's, whose three ops each round)."""
    monkeypatch.setattr(rowwise, "chunk_rows", lambda *_: 300)  # 1000 rows: four chunks, the last ragged
    torch.manual_seed(0)
    n, vocab, dim, (scale, divisor, softcap) = 1000, 5003, 256, (2.5, 1.0, 4.0)
    base = [torch.randn(n, dim, device="cuda"), torch.randn(vocab, dim, device="cuda") / dim**0.5]
    targets = torch.randint(0, vocab, (n,), device="cuda")
    targets[::7] = -100
    leaves = [t.to(dtype).requires_grad_() for t in base]
    h, w = leaves
    logits = None
    if op == "cce":
        loss = torch.ops.memopt.cce(h, w, None, targets, -100, "mean", 0.0, softcap, 0.0, scale, divisor)[0]
    elif op == "with_logits":
        loss, _, logits = torch.ops.memopt.cce_with_logits(
            h, w, None, targets, -100, "mean", 0.0, softcap, True, None, scale, divisor, True
        )
    else:
        loss, *_, logits = torch.ops.memopt.cce_rowwise(
            h, w, None, targets, -100, "mean", 0.0, softcap, True, True, False, True, scale, divisor, True
        )
    ours = [loss, *torch.autograd.grad(loss, leaves)]
    low_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    low_logits = _eager_transform(F.linear(*low_leaves), scale, divisor, softcap)
    low = F.cross_entropy(low_logits.float(), targets)
    theirs = [low, *torch.autograd.grad(low, low_leaves)]
    exact, exact_logits, doubles = _exact_leaves(leaves, targets, (scale, divisor, softcap))
    truth = [exact, *torch.autograd.grad(exact, doubles)]
    for index, (mine, eager, wanted) in enumerate(zip(ours, theirs, truth, strict=True)):
        our_error = (mine.double() - wanted).norm().item()
        eager_error = (eager.double() - wanted).norm().item()
        assert our_error <= 2 * eager_error + 1e-6, (index, our_error, eager_error)
    if logits is not None:
        our_error = (logits.double() - exact_logits).norm().item()
        eager_error = (low_logits.double() - exact_logits).norm().item()
        assert our_error <= 2 * eager_error + 1e-6, (our_error, eager_error)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["chunked", "rowwise"])
@pytest.mark.parametrize("use_logits", [False, True])
def test_cuda_compiled_head_returning_transformed_logits(variant, use_logits):
    """A Gemma-2-style head (a scale, then the softcap, the transformed logits returned) compiled through Inductor
    on CUDA, where ``cce_with_logits``' body is traced (the transform fused by Inductor) and the row-wise op's
    chunk kernel writes the transformed logits back: loss, logits and gradients (also through the logits) no
    further from float64 than eager bf16's."""
    import fxpass

    torch.manual_seed(0)
    n, vocab, dim = 1000, 5003, 256
    hidden = torch.randn(n, dim, device="cuda")
    weight = torch.randn(vocab, dim, device="cuda") / dim**0.5
    targets = torch.randint(0, vocab, (n,), device="cuda")
    targets[::7] = -100
    logits_grad = 1e-3 * torch.randn(n, vocab, device="cuda") if use_logits else None

    def head(h, w, t):
        logits = torch.tanh(F.linear(h, w) * 2.5 / 4.0) * 4.0
        return logits, F.cross_entropy(logits.float(), t)

    reports = []
    options = {"force": True, "strict": True, "cce_variant": variant}
    compiled = torch.compile(head, backend=fxpass.MemoptBackend(options=options, sink=reports.append), fullgraph=True)
    results = []
    for fn, dtype in ((compiled, torch.bfloat16), (head, torch.bfloat16), (head, torch.float64)):
        leaves = [t.to(dtype).requires_grad_() for t in (hidden, weight)]
        logits, loss = fn(*leaves, targets)
        results.append((loss, logits, *torch.autograd.grad(_total(loss, logits, logits_grad), leaves)))
    (record,) = [record for record in reports[-1].records if record.rule == "cce"]
    assert record.applied and record.params["returned_logits_transformed"] is True, record.reason
    for index, (mine, theirs, truth) in enumerate(zip(*results, strict=True)):
        our_error = (mine.double() - truth).norm().item()
        eager_error = (theirs.double() - truth).norm().item()
        assert our_error <= 2 * eager_error + 1e-6, (index, our_error, eager_error)
