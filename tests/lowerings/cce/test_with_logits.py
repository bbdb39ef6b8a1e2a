"""``memopt.cce_with_logits`` against float64 math: the loss, the returned logits and every gradient, with the
returned logits' gradient zero (dropped) or real; nothing logits-sized saved; the CUDA backward's kernels (with
the logits' gradient folded in and the logits rounded as the forward's GEMM rounded them) through Triton's
interpreter on CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxpass
from lowerings.cce import reference, with_logits
from tests.helpers import assert_close_all

N, V, D = 23, 37, 8
REDUCTIONS = ("mean", "sum", "none")
FP64 = {"rtol": 1e-10, "atol": 1e-10}


def _inputs(dtype: torch.dtype, bias: bool, n: int = N, vocab: int = V, dim: int = D):
    gen = torch.Generator().manual_seed(n + vocab + dim)
    hidden = torch.randn(n, dim, generator=gen)
    weight = torch.randn(vocab, dim, generator=gen) / dim**0.5
    b = torch.randn(vocab, generator=gen) if bias else None
    targets = torch.randint(0, vocab, (n,), generator=gen)
    targets[::5] = -100
    leaves = [t.to(dtype).requires_grad_() for t in (hidden, weight, b) if t is not None]
    return leaves, targets


def _eager(leaves, targets, reduction, smoothing, softcap, upcast=True):
    """What the graph computed before the rewrite: the linear, its logits returned, the loss over fp32 copies."""
    logits = F.linear(*leaves)
    capped = logits.float() if upcast and logits.dtype != torch.float64 else logits
    if softcap is not None:
        capped = torch.tanh(capped / softcap) * softcap
    return F.cross_entropy(capped, targets, reduction=reduction, label_smoothing=smoothing), logits


def _ours(leaves, targets, reduction, smoothing, softcap):
    h, w, *b = leaves
    loss, _, logits = torch.ops.memopt.cce_with_logits(
        h, w, b[0] if b else None, targets, -100, reduction, smoothing, softcap
    )
    return loss, logits


def _total(loss, logits, logits_grad):
    """A scalar whose gradient reaches the loss and, through ``logits_grad``, the returned logits."""
    weight = torch.linspace(-1, 1, loss.numel(), dtype=loss.dtype).view(loss.shape)
    total = (loss * weight).sum()
    return total if logits_grad is None else total + (logits * logits_grad.to(logits.dtype)).sum()


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize(("bias", "smoothing", "softcap"), [(False, 0.0, None), (True, 0.1, 4.0)])
@pytest.mark.parametrize("logits_used", [False, True])
def test_matches_float64(reduction, bias, smoothing, softcap, logits_used):
    leaves, targets = _inputs(torch.float64, bias)
    logits_grad = torch.randn(N, V, dtype=torch.float64) if logits_used else None
    loss, logits = _ours(leaves, targets, reduction, smoothing, softcap)
    expected_loss, expected_logits = _eager(leaves, targets, reduction, smoothing, softcap)
    torch.testing.assert_close(loss, expected_loss, **FP64)
    torch.testing.assert_close(logits, expected_logits, **FP64)
    actual = torch.autograd.grad(_total(loss, logits, logits_grad), leaves)
    expected = torch.autograd.grad(_total(expected_loss, expected_logits, logits_grad), leaves)
    assert_close_all(actual, expected, **FP64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("logits_used", [False, True])
def test_low_precision_no_worse_than_eager(dtype, logits_used):
    """|ours − fp64| ≤ 2·|eager same dtype − fp64| + floor for the loss and every gradient; the returned
    logits are the linear's own output, bit for bit."""
    leaves, targets = _inputs(dtype, bias=True)
    exact_leaves = [t.detach().double().requires_grad_() for t in leaves]
    logits_grad = 1e-2 * torch.randn(N, V) if logits_used else None
    results = []
    for fn, args in ((_ours, leaves), (_eager, leaves), (_eager, exact_leaves)):
        loss, logits = fn(args, targets, "mean", 0.0, None)
        results.append((loss, logits, torch.autograd.grad(_total(loss, logits, logits_grad), args)))
    (ours, our_logits, our_grads), (low, low_logits, low_grads), (exact, _, exact_grads) = results
    assert torch.equal(our_logits, low_logits)
    for index, (mine, theirs, truth) in enumerate(zip((ours, *our_grads), (low, *low_grads), (exact, *exact_grads),
                                                       strict=True)):
        our_error = (mine.double() - truth).abs().max().item()
        eager_error = (theirs.double() - truth).abs().max().item()
        rounding = torch.finfo(mine.dtype).eps * truth.abs().max().item()  # the result's own final rounding
        assert our_error <= 2 * eager_error + rounding, (index, our_error, eager_error)


def test_saves_nothing_logits_sized():
    leaves, targets = _inputs(torch.float32, bias=True)
    saved: list[tuple[int, ...]] = []

    def pack(tensor):
        saved.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        _ours(leaves, targets, "mean", 0.0, None)
    assert sorted(saved) == sorted([(N, D), (V, D), (V,), (N,), (N,)]), saved  # h, w, b, targets, lse


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_detached_logits_carry_no_gradient_and_the_loss_is_unchanged(reduction):
    """``detach_logits`` (the whole-model path whose wrapper re-attaches the logits' gradient): the logits do not
    require a gradient, and the loss and its gradients are those of the differentiable op."""
    leaves, targets = _inputs(torch.float64, bias=True)
    h, w, b = leaves
    loss, _, logits = torch.ops.memopt.cce_with_logits(h, w, b, targets, -100, reduction, 0.1, 3.0, True)
    expected_loss, expected_logits = _ours(leaves, targets, reduction, 0.1, 3.0)
    assert not logits.requires_grad and expected_logits.requires_grad
    torch.testing.assert_close(logits, expected_logits.detach(), **FP64)
    torch.testing.assert_close(loss, expected_loss, **FP64)
    actual = torch.autograd.grad(_total(loss, logits, None), leaves)
    expected = torch.autograd.grad(_total(expected_loss, expected_logits, None), leaves)
    assert_close_all(actual, expected, **FP64)


def test_no_zeros_are_filled_for_dropped_logits():
    """Called eagerly with its logits unused, the op's backward gets no N×V zeros for them: autograd does not
    materialize the gradients of outputs that received none."""
    leaves, targets = _inputs(torch.float32, bias=False)
    loss, _ = _ours(leaves, targets, "mean", 0.0, None)
    handed: list[object] = []
    original = torch.ops.memopt.cce_backward

    def recording(*args):
        handed.append(args[15])  # grad_logits
        return original(*args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.ops.memopt, "cce_backward", recording)
        loss.backward()
    assert handed == [None]


def test_out_of_range_target_raises():
    leaves, targets = _inputs(torch.float32, bias=False)
    targets[3] = V
    with pytest.raises(IndexError, match="out of bounds"):
        _ours(leaves, targets, "mean", 0.0, None)


def test_all_targets_ignored_mean_is_nan():
    leaves, targets = _inputs(torch.float32, bias=False)
    loss, _ = _ours(leaves, torch.full_like(targets, -100), "mean", 0.0, None)
    assert torch.isnan(loss)


@pytest.mark.parametrize(("bias", "reduction", "smoothing", "softcap"),
                         [(False, "mean", 0.0, None), (True, "none", 0.1, 3.0), (True, "sum", 0.0, None)])
def test_opcheck(bias, reduction, smoothing, softcap):
    (h, w, *b), targets = _inputs(torch.float32, bias, n=11, vocab=17, dim=5)
    args = (h, w, b[0] if b else None, targets, -100, reduction, smoothing, softcap)
    torch.library.opcheck(torch.ops.memopt.cce_with_logits.default, args)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("detach", [False, True])
def test_widened_logits_hold_the_classifiers_values(dtype, bias, detach):
    """``logits_dtype=torch.float32`` over 16-bit operands (logits the graph returns through accelerate's cast):
    the logits come back in fp32 holding exactly the cast of the classifier's own, and the loss and every
    gradient (the returned logits' own included, unless detached) are those of the op without it."""
    (h, w, *b), targets = _inputs(dtype, bias)
    args = (h, w, b[0] if b else None, targets, -100, "mean", 0.1, None, detach)
    logits_grad = None if detach else (1e-2 * torch.randn(N, V)).to(dtype).float()  # representable either way
    wide = torch.ops.memopt.cce_with_logits(*args, torch.float32)
    narrow = torch.ops.memopt.cce_with_logits(*args)
    assert wide[2].dtype == torch.float32 and narrow[2].dtype == dtype
    assert torch.equal(wide[2], narrow[2].float())
    torch.testing.assert_close(wide[0], narrow[0], rtol=0, atol=0)
    leaves = [h, w, *b]
    actual = torch.autograd.grad(_total(wide[0], wide[2], logits_grad), leaves)
    expected = torch.autograd.grad(_total(narrow[0], narrow[2], logits_grad), leaves)
    assert_close_all(actual, expected, rtol=0, atol=0)


def test_opcheck_widened_logits():
    (h, w, b), targets = _inputs(torch.bfloat16, True, n=11, vocab=17, dim=5)
    args = (h, w, b, targets, -100, "mean", 0.0, None, True, torch.float32)
    torch.library.opcheck(torch.ops.memopt.cce_with_logits.default, args)


# --- the CUDA backward's kernels (natively on CUDA, through Triton's interpreter on CPU) ----------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("bias", "softcap"), [(False, None), (True, 4.0)])
def test_kernel_backward_folds_the_logits_gradient(monkeypatch, dtype, bias, softcap):
    """The kernels' gradients equal the reference's (which recomputes logits with the forward's own matmul)
    when the returned logits' gradient joins each chunk; several column chunks are walked."""
    pytest.importorskip("triton")
    from lowerings.cce import kernels

    monkeypatch.setattr(kernels, "CHUNK_COLUMNS", 16)
    monkeypatch.setattr(kernels, "MIN_COLUMNS", 16)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    (h, w, *b), targets = _inputs(dtype, bias, n=21, vocab=45, dim=16)
    h, w = h.detach().to(device), w.detach().to(device)
    b = b[0].detach().to(device) if b else None
    targets = targets.to(device)
    logits = F.linear(h, w, b)
    _, lse = reference.forward(h, w, b, targets, -100, 0.0, softcap)
    if dtype != torch.float32:  # the log-sum-exp of the logits the forward's GEMM wrote
        capped = logits.float() if softcap is None else torch.tanh(logits.float() / softcap) * softcap
        lse = torch.logsumexp(capped, dim=-1)
    grad_rows = torch.where(targets != -100, 0.05, 0.0)
    grad_lse = torch.zeros_like(lse)
    grad_logits = (0.1 * torch.randn(logits.shape)).to(device, dtype)
    needs = (True, True, bias)
    expected = reference.backward(h, w, b, targets, lse, grad_rows, grad_lse, -100, 0.0, softcap, needs, grad_logits)
    actual = kernels.backward(h, w, b, targets, lse, grad_rows, grad_lse, 0.0, softcap, needs, 0.0, grad_logits,
                              True)
    tolerance = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for a, e in zip(actual, expected, strict=True):
        if e.numel():
            torch.testing.assert_close(a.float(), e.float(), **tolerance)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["chunked", "auto"])
@pytest.mark.parametrize("use_logits", [False, True])
def test_cuda_compiled_whole_head(use_logits, variant):
    """On CUDA through Inductor (the op's body traced, the fp32 upcast fused into the log-sum-exp): loss,
    logits and gradients no worse than eager bf16's against float64. "chunked" pins ``cce_with_logits``; "auto"
    serves this head, alone in its graph, with the row-wise op."""
    torch.manual_seed(0)
    n, vocab, dim = 1000, 5003, 256
    hidden = torch.randn(n, dim, device="cuda")
    weight = torch.randn(vocab, dim, device="cuda") / dim**0.5
    targets = torch.randint(0, vocab, (n,), device="cuda")
    targets[::7] = -100
    logits_grad = 1e-3 * torch.randn(n, vocab, device="cuda") if use_logits else None

    def head(h, w, t):
        logits = F.linear(h, w)
        return logits, F.cross_entropy(logits.float(), t)

    compiled = torch.compile(head, backend="memopt", fullgraph=True, options={"force": True, "cce_variant": variant})
    results = []
    for fn, dtype in ((compiled, torch.bfloat16), (head, torch.bfloat16), (head, torch.float64)):
        leaves = [t.to(dtype).requires_grad_() for t in (hidden, weight)]
        logits, loss = fn(*leaves, targets)
        results.append((loss, logits, torch.autograd.grad(_total(loss, logits, logits_grad), leaves)))
    (ours, our_logits, our_grads), (low, low_logits, low_grads), (exact, _, exact_grads) = results
    torch.testing.assert_close(our_logits, low_logits, rtol=1e-2, atol=1e-2)  # cuBLAS either way
    for index, (mine, theirs, truth) in enumerate(zip((ours, *our_grads), (low, *low_grads), (exact, *exact_grads),
                                                       strict=True)):
        our_error = (mine.double() - truth).norm().item()
        eager_error = (theirs.double() - truth).norm().item()
        assert our_error <= 2 * eager_error + 1e-6, (index, our_error, eager_error)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [32000, 32001])
def test_cuda_logits_returned_through_a_cast(dtype, vocab):
    """A 16-bit head whose logits leave the graph as ``logits.float()`` (accelerate's ``convert_to_fp32``, HF
    Trainer with ``bf16=True``). 32000 classes: the GEMM writes them in fp32, so the forward's peak holds one fp32
    N×V and no 16-bit copy beside it (eager: both). 32001 classes: fp32 rows are not 16-byte aligned, where
    cuBLAS is slow, so the op returns 16-bit logits and the graph's cast runs, as the record says. Either way the
    logits, loss and gradients are no further from float64 than eager's."""
    torch.manual_seed(0)
    n, dim = 2048, 256
    hidden = torch.randn(n, dim, device="cuda").to(dtype).requires_grad_()
    weight = (torch.randn(vocab, dim, device="cuda") / dim**0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (n,), device="cuda")
    targets[::7] = -100

    def head(h, w, t):
        logits = F.linear(h, w)
        return logits.float(), F.cross_entropy(logits.float(), t)

    reports = []
    # a head alone in its graph: "auto" would take the row-wise op, which returns the logits in their dtype
    options = {"force": True, "strict": True, "cce_variant": "chunked"}
    backend = fxpass.MemoptBackend(options=options, sink=reports.append)
    compiled = torch.compile(head, backend=backend, fullgraph=True)
    compiled(hidden, weight, targets)[1].backward()  # compile, warm up
    (call,) = [node for node in reports[-1].graph_module.graph.nodes
               if node.target is torch.ops.memopt.cce_with_logits.default]
    (record,) = [record for record in reports[-1].records if record.rule == "cce" and record.applied]
    widened = with_logits.rows_aligned(vocab)
    if widened:
        assert call.args[-1] == torch.float32, call.args
    else:
        assert torch.float32 not in call.args, call.args
        assert f"{vocab} classes are not 16-byte aligned" in record.params["returned_logits_dtype_reason"]
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    logits, loss = compiled(hidden, weight, targets)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert logits.dtype == torch.float32 and logits.is_contiguous()
    if widened:
        assert peak < 5 * n * vocab, (peak, 4 * n * vocab)  # fp32 logits (4 bytes each), no 16-bit copy (2 more)
    upstream = 1e-3 * torch.randn(n, vocab, device="cuda")
    exact = [hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()]
    results = []
    for outputs, leaves in (((logits, loss), (hidden, weight)),
                            (head(hidden, weight, targets), (hidden, weight)),
                            (head(*exact, targets), exact)):
        out_logits, out_loss = outputs
        grads = torch.autograd.grad(out_loss + (out_logits * upstream.to(out_logits.dtype)).sum(), leaves)
        results.append((out_logits, out_loss, *grads))
    for index, (mine, theirs, truth) in enumerate(zip(*results, strict=True)):
        our_error = (mine.double() - truth).norm().item()
        eager_error = (theirs.double() - truth).norm().item()
        assert our_error <= 2 * eager_error + 1e-6, (index, our_error, eager_error)


@pytest.mark.parametrize("softcap", [None, 4.0])
def test_row_chunks_change_nothing(monkeypatch, softcap):
    """The CPU forward walks ragged row chunks in place: the same loss and log-sum-exp as in one chunk."""
    leaves, targets = _inputs(torch.float64, bias=True)
    args = (*leaves, targets, -100, "none", 0.1, softcap)
    whole = torch.ops.memopt.cce_with_logits(*args)
    monkeypatch.setattr(reference, "chunk_rows", lambda *_, **__: 5)
    chunked = torch.ops.memopt.cce_with_logits(*args)
    for a, e in zip(chunked, whole, strict=True):
        torch.testing.assert_close(a, e, **FP64)


def test_rows_aligned_for_cublas():
    assert with_logits.rows_aligned(128256) and with_logits.rows_aligned(32000)
    assert not with_logits.rows_aligned(50257) and not with_logits.rows_aligned(32002)


@pytest.mark.parametrize(("n", "vocab", "chunk_bytes"), [(97, 17, 5 * 20 * 4), (8, 6, 2**20)])
def test_fp32_logits_by_row_chunks_are_the_product(monkeypatch, n, vocab, chunk_bytes):
    """Row chunks of 5 (97 rows: a ragged last one) or one chunk, each written padded to 16-byte rows then
    copied into place: the contiguous fp32 product, every row once."""
    monkeypatch.setattr(with_logits, "ROW_CHUNK_BYTES", chunk_bytes)
    hidden = torch.randn(n, 9).to(torch.bfloat16)
    weight = torch.randn(vocab, 9).to(torch.bfloat16)
    logits = torch.ops.memopt.fp32_logits_by_row_chunks(hidden, weight)
    assert logits.dtype == torch.float32 and logits.shape == (n, vocab) and logits.is_contiguous()
    torch.testing.assert_close(logits, hidden.double().mm(weight.double().t()).float(), rtol=1e-6, atol=1e-6)


def test_opcheck_fp32_logits_by_row_chunks():
    args = (torch.randn(11, 5).to(torch.bfloat16), torch.randn(17, 5).to(torch.bfloat16))
    torch.library.opcheck(torch.ops.memopt.fp32_logits_by_row_chunks.default, args)
