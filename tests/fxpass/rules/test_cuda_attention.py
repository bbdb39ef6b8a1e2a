"""The rewritten attention on CUDA: cuDNN's fused kernel wherever it serves the case (causal flag, key padding,
dropout, grouped heads unrepeated, a key count off cuDNN's alignment), with eager's numbers against float64, rows without
keys as eager gives them, no T×T tensor; memopt's kernel where cuDNN does not serve or is not wanted."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxpass
from fxpass.rules.attention import CUDNN_LOWERING

# Imported here, not inside the functions Dynamo traces: a first import under tracing runs transformers' lazy
# imports (scikit-learn, SciPy) through Dynamo, which fails on some SciPy releases and leaves their settings behind.
masking_utils = pytest.importorskip("transformers.masking_utils")
eager_attention_forward = pytest.importorskip("transformers.models.gemma2.modeling_gemma2").eager_attention_forward

pytestmark = [pytest.mark.gpu]

B, H, KV_HEADS, T, D = 3, 4, 2, 120, 64  # 120 keys: the key bias is padded to cuDNN's alignment of 8


def _qkv(dtype=torch.bfloat16, length=T, batch=B, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(batch, H, length, D), (batch, KV_HEADS, length, D), (batch, KV_HEADS, length, D)]
    return [torch.randn(*s, device="cuda", generator=gen).to(dtype).requires_grad_() for s in shapes]


def _padding(kind: str, batch: int = B, length: int = T) -> torch.Tensor:
    """[B, T] attention_mask: left or right padding, or one sequence that is all padding."""
    mask = torch.ones(batch, length, dtype=torch.long, device="cuda")
    if kind == "left":
        mask[1, :5], mask[2, :17] = 0, 0
    elif kind == "right":
        mask[1, -5:], mask[2, -17:] = 0, 0
    elif kind == "empty":
        mask[1, :9], mask[2] = 0, 0
    return mask


def _repeat_kv(x, groups=H // KV_HEADS):
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, groups, t, d).reshape(b, h * groups, t, d)


def _keep(pad, causal):
    i = torch.arange(pad.shape[1], device=pad.device)
    allowed = i[None, None, None, :] <= i[None, None, :, None] if causal else True
    return pad.bool()[:, None, None, :] & allowed


MASKINGS = {
    "added finfo.min": lambda s, keep: s + torch.where(keep, torch.zeros((), dtype=s.dtype), torch.finfo(s.dtype).min),
    "masked_fill finfo.min": lambda s, keep: s.masked_fill(~keep, torch.finfo(s.dtype).min),
    "added -inf": lambda s, keep: s + torch.where(keep, torch.zeros((), dtype=s.dtype), float("-inf")),
}


def _eager(q, k, v, pad, masking, causal, dropout=0.0, dtype=None):
    """HF-style eager attention (grouped heads repeated, fp32 softmax), optionally computed in ``dtype``."""
    if dtype is not None:
        q, k, v = (t.to(dtype) for t in (q, k, v))
    scores = q @ _repeat_kv(k).transpose(-2, -1) * D**-0.5
    masked = MASKINGS[masking](scores, _keep(pad, causal))
    probs = torch.softmax(masked.to(torch.promote_types(masked.dtype, torch.float32)), dim=-1).to(q.dtype)
    return F.dropout(probs, dropout, training=dropout > 0) @ _repeat_kv(v)


def _sdpa(q, k, v, pad, causal):
    keep = _keep(pad, causal)
    return F.scaled_dot_product_attention(q, _repeat_kv(k), _repeat_kv(v), attn_mask=keep)


def _run(fn, inputs, grad, **options):
    torch._dynamo.reset()
    fxpass.clear_reports()
    compiled = torch.compile(fn, backend="memopt", options={"strict": True, "force": True, **options})
    out = compiled(*inputs)
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    grads = torch.autograd.grad(out, leaves, grad.to(out.dtype))
    records = [r for report in fxpass.reports() for r in report.records if r.rule == "attention"]
    return out, grads, records


def _errors(out, grads, gold, gold_grads):
    pairs = zip((out, *grads), (gold, *gold_grads), strict=True)
    return [(mine.double() - wanted).abs().max().item() for mine, wanted in pairs]


def _golden(fn, inputs, grad):
    leaves = [t.detach().double().requires_grad_() if t.is_floating_point() else t for t in inputs]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, [t for t in leaves if t.requires_grad], grad.double())
    return out.detach(), grads


def _assert_within_eager(fn, inputs, grad, records, out, grads):
    """Every error against float64 at most twice eager's in the same dtype (plus 1e-3): the numerics rule, with
    room for rounding order; a wrong mask or row gives errors of order one."""
    gold, gold_grads = _golden(fn, inputs, grad)
    eager_inputs = [t.detach().requires_grad_() if t.is_floating_point() else t for t in inputs]
    eager_out = fn(*eager_inputs)
    eager_grads = torch.autograd.grad(eager_out, [t for t in eager_inputs if t.requires_grad], grad.to(out.dtype))
    ours, eager = _errors(out, grads, gold, gold_grads), _errors(eager_out, eager_grads, gold, gold_grads)
    for name, mine, theirs in zip(("out", "dq", "dk", "dv"), ours, eager, strict=True):
        assert mine <= 2 * theirs + 1e-3, f"{name}: {mine:.3g} against eager's {theirs:.3g} ({records})"


@pytest.mark.parametrize(
    ("masking", "padding", "causal"),
    [
        ("added finfo.min", "left", True),  # HF eager: rows without keys give the mean of v, with its gradients
        ("added finfo.min", "empty", False),
        ("masked_fill finfo.min", "right", True),
        ("added -inf", "left", True),
        ("added -inf", "empty", False),
    ],
)
def test_eager_attention_with_padding_runs_cudnn(masking, padding, causal):
    inputs = [*_qkv(), _padding(padding)]
    grad = torch.randn(B, H, T, D, device="cuda")
    fn = lambda q, k, v, pad: _eager(q, k, v, pad, masking, causal)  # noqa: E731
    out, grads, records = _run(fn, inputs, grad)
    (record,) = records
    assert record.applied and record.params["lowering"] == CUDNN_LOWERING, record
    if masking == "added -inf":  # eager gives NaN on rows without keys (and then in dk, dv); the rewrite gives 0
        assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
        kept = _keep(inputs[3], causal).any(-1, keepdim=True)
        gold, _ = _golden(fn, inputs, grad)
        eager = fn(*inputs)
        mine, theirs = ((torch.where(kept, x.double() - gold, 0.0)).abs().max().item() for x in (out, eager))
        assert mine <= 2 * theirs + 1e-3, (mine, theirs)
        assert out.masked_select(~kept).abs().max().item() == 0 if (~kept).any() else True
        return
    _assert_within_eager(fn, inputs, grad, records, out, grads)


@pytest.mark.parametrize("padding", ["left", "empty"])
def test_sdpa_with_a_causal_padding_mask_runs_cudnn(padding):
    """transformers' SDPA mask for a padded batch: causal ∧ key padding, [B, 1, T, T] (a padding-only mask is
    already [B, 1, 1, Tk] and stays with SDPA)."""
    causal = True
    inputs = [*_qkv(), _padding(padding)]
    grad = torch.randn(B, H, T, D, device="cuda")
    fn = lambda q, k, v, pad: _sdpa(q, k, v, pad, causal)  # noqa: E731
    out, grads, records = _run(fn, inputs, grad)
    (record,) = records
    assert record.applied and record.params["lowering"] == CUDNN_LOWERING, record
    # SDPA gives zeros on rows without keys; float64 SDPA (math) does the same
    _assert_within_eager(fn, inputs, grad, records, out, grads)


def test_dropout_is_unbiased_and_finite():
    """Dropout 0.1 through cuDNN: finite, a fresh mask per call, and its mean over calls tends to the
    no-dropout output (inverted dropout keeps the expectation)."""
    q, k, v = _qkv(length=64)
    pad = _padding("left", length=64)
    fn = lambda q, k, v, pad: _eager(q, k, v, pad, "added finfo.min", True, dropout=0.1)  # noqa: E731
    torch._dynamo.reset()
    fxpass.clear_reports()
    compiled = torch.compile(fn, backend="memopt", options={"strict": True, "force": True})
    draws = torch.stack([compiled(q, k, v, pad).float() for _ in range(400)])
    (record,) = [r for report in fxpass.reports() for r in report.records if r.rule == "attention"]
    assert record.params["lowering"] == CUDNN_LOWERING and record.params["dropout_p"] == 0.1
    expected = _eager(q, k, v, pad, "added finfo.min", True).float()
    assert torch.isfinite(draws).all()
    assert not torch.equal(draws[0], draws[1])
    spread = (draws[0] - expected).abs().mean()
    assert (draws.mean(0) - expected).abs().mean() < spread / 5  # 400 draws: the noise falls by 20×
    grads = torch.autograd.grad(compiled(q, k, v, pad), (q, k, v), torch.ones(B, H, 64, D, device="cuda"))
    assert all(torch.isfinite(g).all() for g in grads)


def test_no_tt_tensor_at_length_2048():
    """A padded causal batch at T = 2048: the compiled forward and backward allocate less than half of one bf16
    [B, H, T, T] tensor above the inputs (the scores eager keeps, or a key bias materialized over heads and
    queries); q, k, v, their gradients, the output and cuDNN's workspace take the rest."""
    batch, length = 4, 2048
    q, k, v = _qkv(length=length, batch=batch)
    pad = _padding("left", batch=batch, length=length)
    fn = lambda q, k, v, pad: _eager(q, k, v, pad, "added finfo.min", True)  # noqa: E731
    grad = torch.randn(batch, H, length, D, device="cuda", dtype=torch.bfloat16)
    _run(fn, [q, k, v, pad], grad)  # compile first
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    compiled = torch.compile(fn, backend="memopt", options={"strict": True, "force": True})
    torch.autograd.grad(compiled(q, k, v, pad), (q, k, v), grad)
    torch.cuda.synchronize()
    square = batch * H * length * length * 2
    assert torch.cuda.max_memory_allocated() - base < square / 2


def test_head_dim_256_runs_cudnn_where_the_gpu_takes_it():
    """Gemma's head dim 256 under a causal padding mask: cuDNN on sm90 with cuDNN 9.10 or newer, memopt's kernel
    elsewhere with the reason; either within eager's error."""
    from fxpass.rules.attention import cudnn_head_dim_limit

    wide = 256
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(B, H, T, wide), (B, KV_HEADS, T, wide), (B, KV_HEADS, T, wide)]
    q, k, v = (torch.randn(*s, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_() for s in shapes)
    inputs = [q, k, v, _padding("left")]
    grad = torch.randn(B, H, T, wide, device="cuda")
    fn = lambda q, k, v, pad: _sdpa(q, k, v, pad, True)  # noqa: E731
    out, grads, records = _run(fn, inputs, grad)
    (record,) = records
    if cudnn_head_dim_limit(torch.device("cuda")) >= wide:
        assert record.params["lowering"] == CUDNN_LOWERING, record
    else:
        assert record.params["lowering"] == "memopt.flash_attention", record
        assert "head dim 256 is not a multiple of 8 up to 128" in record.params["kernel_reason"]
    _assert_within_eager(fn, inputs, grad, records, out, grads)


def test_cases_cudnn_does_not_serve_run_memopt_with_the_reason():
    q, k, v = _qkv(dtype=torch.float32)
    pad = _padding("left")
    fn = lambda q, k, v, pad: _eager(q, k, v, pad, "added finfo.min", True)  # noqa: E731
    grad = torch.randn(B, H, T, D, device="cuda")
    for options, reason in (
        ({}, "cuDNN does not serve it: it takes float16 and bfloat16, not float32"),
        ({"attention_kernel": "memopt"}, "attention_kernel='memopt'"),
    ):
        inputs = [q, k, v, pad] if not options else [*_qkv(), pad]
        out, grads, records = _run(fn, inputs, grad, **options)
        (record,) = records
        assert record.params["lowering"] == "memopt.flash_attention", record
        assert record.params["kernel_reason"] == reason
        if options:  # bf16 through memopt's kernel (its fp32 numerics are pinned in tests/lowerings)
            _assert_within_eager(fn, inputs, grad, records, out, grads)


class _Gemma2Like(torch.nn.Module):
    """What Gemma 2's eager attention reads from its module: grouped heads, the head dim, training mode."""

    num_key_value_groups = H // KV_HEADS
    head_dim = D


_GEMMA2 = _Gemma2Like().eval()


def _gemma2(q, k, v, pad, window, softcap=50.0):
    """transformers' Gemma 2 eager attention (softcap between the scaled scores and the mask) with its own masks:
    0 / finfo.min added, a sliding window of ``window`` keys or causal, key padding from ``pad``."""
    function = (masking_utils.sliding_window_causal_mask_function(window) if window is not None
                else masking_utils.causal_mask_function)
    # The float64 golden keeps float32's fill: Gemma 2's softmax runs in float32, where float64's would be -inf.
    dtype = torch.float32 if q.dtype == torch.float64 else q.dtype
    mask = masking_utils.eager_mask(
        batch_size=q.shape[0], q_length=q.shape[2], kv_length=k.shape[2], mask_function=function,
        attention_mask=pad.bool(), allow_is_causal_skip=False, dtype=dtype, device=q.device,
    )
    return eager_attention_forward(_GEMMA2, q, k, v, mask, scaling=D**-0.5, softcap=softcap)[0].transpose(1, 2)


@pytest.mark.parametrize("window", [None, 32], ids=["global", "sliding"])
@pytest.mark.parametrize("padding", ["right", "left"])
def test_gemma2_softcap_and_window_run_memopt_within_eager(window, padding):
    """Gemma 2's layers on CUDA in bf16: softcap (50) and sliding window stay on memopt's kernel (no library kernel
    caps scores) with the reason recorded; rows without keys (left padding, right padding past a window) get eager's
    mean of v and its gradients through the cap; every error against float64 is at most twice eager's."""
    q, k, v = (t.detach().mul(4).requires_grad_() for t in _qkv())  # scores large enough for the cap to bend them
    inputs = [q, k, v, _padding(padding)]
    grad = torch.randn(B, H, T, D, device="cuda")
    fn = lambda q, k, v, pad: _gemma2(q, k, v, pad, window)  # noqa: E731
    out, grads, records = _run(fn, inputs, grad)
    (record,) = records
    assert record.applied and record.params["lowering"] == "memopt.flash_attention", record
    assert record.params["kernel_reason"] == "cuDNN does not serve it: a softcap: no library attention kernel caps the scores"
    assert record.params.get("window") == window and record.params["softcap"] == 50.0
    _assert_within_eager(fn, inputs, grad, records, out, grads)


def test_sdpa_sliding_window_runs_memopt_with_the_window():
    """Mistral-style SDPA with a [B, 1, T, T] sliding-window mask: memopt's kernel with the window argument (the
    mask is no longer built), within eager's numerics."""
    def fn(q, k, v, pad):
        mask = masking_utils.sdpa_mask(
            batch_size=B, q_length=T, kv_length=T, mask_function=masking_utils.sliding_window_causal_mask_function(16),
            attention_mask=pad.bool(), allow_is_causal_skip=False, device=q.device,
        )
        return F.scaled_dot_product_attention(q, _repeat_kv(k), _repeat_kv(v), attn_mask=mask)

    inputs = [*_qkv(), _padding("right")]
    grad = torch.randn(B, H, T, D, device="cuda")
    out, grads, records = _run(fn, inputs, grad)
    (record,) = records
    assert record.applied and record.params["window"] == 16 and record.params["lowering"] == "memopt.flash_attention"
    assert "a sliding window" in record.params["kernel_reason"]
    _assert_within_eager(fn, inputs, grad, records, out, grads)
