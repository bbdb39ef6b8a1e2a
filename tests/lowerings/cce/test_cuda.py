"""CCE on a CUDA device: kernels in Inductor's output code, low-precision accuracy rule, real-size numerics."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import fxpass
from lowerings.cce import linear_cross_entropy

pytestmark = pytest.mark.gpu


def _eager(hidden, weight, targets, bias=None, softcap=None, reduction="mean", smoothing=0.0):
    logits = F.linear(hidden, weight, bias)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.float(), targets, reduction=reduction, label_smoothing=smoothing)


def _lm_batch(n, v, d, dtype, ignore=0.2):
    gen = torch.Generator(device="cuda").manual_seed(n + v + d)
    hidden = torch.randn(n, d, device="cuda", generator=gen).to(dtype)
    weight = (torch.randn(v, d, device="cuda", generator=gen) / d**0.5).to(dtype)
    bias = torch.randn(v, device="cuda", generator=gen).to(dtype)
    targets = torch.randint(0, v, (n,), device="cuda", generator=gen)
    targets[torch.rand(n, device="cuda", generator=gen) < ignore] = -100
    return hidden, weight, bias, targets


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(("use_bias", "softcap", "smoothing"), [(False, None, 0.0), (True, 30.0, 0.1)])
def test_no_worse_than_eager_same_dtype(dtype, reduction, use_bias, softcap, smoothing):
    """|ours − fp32 ref| ≤ |eager same dtype − fp32 ref| + floor for loss, dE, dC, dbias (Apple's test rule)."""
    hidden, weight, bias, targets = _lm_batch(1000, 5003, 256, dtype)
    bias = bias if use_bias else None
    leaves = [t for t in (hidden, weight, bias) if t is not None]

    def run(fn, tensors):
        tensors = [t.detach().clone().requires_grad_() for t in tensors]
        h, w, *rest = tensors
        loss = fn(h, w, targets, rest[0] if rest else None)
        upstream = torch.ones_like(loss) if reduction != "none" else torch.linspace(0, 1, loss.numel(), device="cuda")
        return (loss, *torch.autograd.grad(loss, tensors, upstream))

    options = dict(softcap=softcap, reduction=reduction)
    exact = run(lambda h, w, t, b: _eager(h, w, t, b, smoothing=smoothing, **options), [x.float() for x in leaves])
    eager = run(lambda h, w, t, b: _eager(h, w, t, b, smoothing=smoothing, **options), leaves)
    ours = run(
        lambda h, w, t, b: linear_cross_entropy(h, w, t, b, label_smoothing=smoothing, **options), leaves
    )
    for name, mine, theirs, truth in zip(("loss", "dE", "dC", "dbias"), ours, eager, exact, strict=False):
        our_error = (mine.float() - truth).norm() / truth.norm()
        eager_error = (theirs.float() - truth).norm() / truth.norm()
        assert our_error <= eager_error + 1e-3, (name, our_error.item(), eager_error.item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weight_dtype", ["same", "float32"], ids=["16-bit weight", "fp32 weight"])
@pytest.mark.parametrize(("softcap", "smoothing"), [(None, 0.0), (30.0, 0.1)])
def test_rowwise_no_worse_than_eager_same_dtype(monkeypatch, dtype, weight_dtype, softcap, smoothing):
    """The row-wise op on CUDA (its chunk kernel, ∂C summed into fp32 by the GEMM itself) over several chunks:
    loss, dE and dC within the bf16/fp16 baseline's error against fp32 math."""
    from lowerings.cce import rowwise

    assert rowwise._kernel_serves("cuda", dtype)
    monkeypatch.setattr(rowwise, "chunk_rows", lambda *_: 300)  # 1000 rows: four chunks, the last ragged
    hidden, weight, _, targets = _lm_batch(1000, 5003, 256, dtype)
    if weight_dtype == "float32":
        weight = weight.float()

    def run(fn, h, w):
        h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        loss = fn(h, w)
        return (loss, *torch.autograd.grad(2 * loss, (h, w)))

    def eager(h, w):
        return _eager(h, w.to(h.dtype), targets, softcap=softcap, smoothing=smoothing)

    def ours(h, w):
        loss = torch.ops.memopt.cce_rowwise(h, w.to(h.dtype), None, targets, -100, "mean", smoothing, softcap,
                                            True, True, False)[0]
        return loss

    exact, baseline, mine = run(eager, hidden.float(), weight.float()), run(eager, hidden, weight), run(ours, hidden, weight)
    for name, got, theirs, truth in zip(("loss", "dE", "dC"), mine, baseline, exact, strict=True):
        assert got.dtype == theirs.dtype, name
        our_error = (got.float() - truth).norm() / truth.norm()
        baseline_error = (theirs.float() - truth).norm() / truth.norm()
        assert our_error <= baseline_error + 1e-3, (name, our_error.item(), baseline_error.item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rowwise_bias_gradient_no_worse_than_eager(monkeypatch, dtype):
    """With a bias that wants its gradient the row-wise op keeps its chunk kernel (∂b = the column sums of the
    gradient it writes): loss, dE, dC and db within the 16-bit baseline's error against fp32 math."""
    from lowerings.cce import rowwise

    monkeypatch.setattr(rowwise, "chunk_rows", lambda *_: 300)
    hidden, weight, bias, targets = _lm_batch(1000, 5003, 256, dtype)

    def run(fn, *leaves):
        leaves = [t.detach().clone().requires_grad_() for t in leaves]
        loss = fn(*leaves)
        return (loss, *torch.autograd.grad(loss, leaves))

    def ours(h, w, b):
        return torch.ops.memopt.cce_rowwise(h, w, b, targets, -100, "mean", 0.0, None, True, True, True)[0]

    exact = run(lambda h, w, b: _eager(h, w, targets, b), hidden.float(), weight.float(), bias.float())
    baseline = run(lambda h, w, b: _eager(h, w, targets, b), hidden, weight, bias)
    mine = run(ours, hidden, weight, bias)
    for name, got, theirs, truth in zip(("loss", "dE", "dC", "db"), mine, baseline, exact, strict=True):
        our_error = (got.float() - truth).norm() / truth.norm()
        baseline_error = (theirs.float() - truth).norm() / truth.norm()
        assert our_error <= baseline_error + 1e-3, (name, our_error.item(), baseline_error.item())


def test_inductor_emits_the_forward_kernel():
    """Compiled with backend=memopt and the chunked variant, the CCE forward Triton kernel appears in Inductor's
    output code (the row-wise variant, CUDA's default, runs cuBLAS GEMMs and no such kernel)."""
    from torch._inductor.utils import run_and_get_code

    hidden, weight, _, targets = _lm_batch(512, 8192, 128, torch.bfloat16)
    weight.requires_grad_()

    def step(h, t):
        return F.cross_entropy(F.linear(h, weight).float(), t)

    options = {"strict": True, "cce_variant": "chunked"}
    compiled = torch.compile(step, backend=fxpass.memopt_backend, options=options)
    loss, codes = run_and_get_code(compiled, hidden, targets)
    assert any("_lse_forward_kernel" in code for code in codes), "kernel missing from the output code"
    torch.testing.assert_close(loss, step(hidden, targets), rtol=2e-3, atol=2e-3)
    assert fxpass.reports()[-1].applied, fxpass.reports()[-1].summary()


def test_memory_stays_below_logits():
    """Loss + gradients allocate far less than one copy of the fp32 logits (N×V×4 bytes)."""
    n, v, d = 4096, 65536, 512
    hidden, weight, _, targets = _lm_batch(n, v, d, torch.bfloat16)
    hidden.requires_grad_()
    weight.requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = linear_cross_entropy(hidden, weight, targets)
    grads = torch.autograd.grad(loss, [hidden, weight])
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    gradient_bytes = sum(g.numel() * g.element_size() for g in grads)
    assert peak < gradient_bytes + n * v * 4 // 4, (peak, gradient_bytes)


@pytest.mark.parametrize("return_logits", [False, True], ids=["loss only", "returned logits"])
def test_rowwise_forward_holds_its_outputs_and_the_charged_workspace(return_logits):
    """The row-wise op's forward on CUDA allocates its outputs (∂C kept in bf16) and at most the workspace the
    memory model charges for it: without returned logits ∂C's fp32 sum inside the op (125 MiB here), with them
    no fp32 ∂C at all (∂C by slices of the vocabulary, in the chunk buffer's memory), which the measured peak
    confirms: the workspace charged there has no fp32 sum."""
    from lowerings.cce import rowwise

    n, v, d = 4096, 32000, 1024
    hidden, weight, _, targets = _lm_batch(n, v, d, torch.bfloat16)
    args = (hidden, weight, None, targets, -100, "mean", 0.0, None, True, True, False, return_logits)
    torch.ops.memopt.cce_rowwise(*args)  # (cuBLAS's workspace and the kernels' first launch)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    outputs = torch.ops.memopt.cce_rowwise(*args)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert outputs[2].dtype == torch.bfloat16 and outputs[2].shape == (v, d)
    kept = sum(t.untyped_storage().nbytes() for t in outputs)
    workspace = rowwise.forward_workspace("cuda", *args)
    terms = rowwise.working_set(n, v, d, torch.bfloat16, torch.device("cuda"), (True, True, False), return_logits,
                                torch.bfloat16)
    assert (rowwise.FP32_SUM in terms) == (not return_logits)
    assert peak <= kept + workspace + (8 << 20), (peak, kept, workspace)


@pytest.mark.parametrize("eps", [1e-30, 2.0**-9])
def test_gradient_filter_at_cuda_tile_sizes(eps):
    """The sorted, filtered backward at the CUDA tiles equals float64 math with exactly the dead tiles dropped
    (a vanishing eps drops none: the sorted walk alone must reproduce the exact gradients)."""
    from lowerings.cce import kernels
    from tests.lowerings.cce.test_kernels import _filtered_reference, _relative, _upstream

    hidden, weight, bias, targets = _lm_batch(512, 3001, 64, torch.float32)
    _, lse = kernels.forward_rows(hidden, weight, bias, targets, -100, 0.0, None)
    grad_rows, grad_lse = _upstream(targets, 512)
    blocks = kernels._blocks(torch.float32)
    chunk = min(3001, kernels.chunk_columns(512, 4))
    expected = _filtered_reference(
        hidden, weight, bias, targets, lse, grad_rows, grad_lse, 0.0, None, eps, blocks["BLOCK_N"], blocks["BLOCK_V"],
        chunk,
    )
    got = kernels.backward(
        hidden, weight, bias, targets, lse, grad_rows.float(), grad_lse.float(), 0.0, None, (True, True, True), eps
    )
    for name, actual, ref in zip(("hidden", "weight", "bias"), got, expected[:3], strict=True):
        assert _relative(actual, ref) < 1e-4, name


OUT_OF_RANGE_TARGET = """
import torch, sys
sys.path.insert(0, {root!r})
from lowerings.cce import linear_cross_entropy
hidden = torch.randn(64, 32, device="cuda")
weight = torch.randn(100, 32, device="cuda")
targets = torch.randint(0, 100, (64,), device="cuda")
targets[7] = 100
step = torch.compile(linear_cross_entropy) if {compiled} else linear_cross_entropy
step(hidden, weight, targets)
torch.cuda.synchronize()
"""


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_out_of_range_target_fails_like_pytorch(compiled):
    """An out-of-range target stops the program with a device-side assert, as PyTorch's CUDA cross-entropy
    does (no host sync to raise an IndexError), instead of reading past the classifier. A subprocess: the
    assert leaves the CUDA context unusable."""
    root = str(pathlib.Path(__file__).resolve().parents[3])
    script = OUT_OF_RANGE_TARGET.format(root=root, compiled=compiled)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "device-side assert" in run.stderr or "out of bounds" in run.stderr, run.stderr[-2000:]
