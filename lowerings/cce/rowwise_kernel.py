"""Triton kernel of ``memopt::cce_rowwise`` (CUDA): a chunk's loss terms and ``∂loss/∂logits`` in one kernel.

The row-wise op forms a chunk's logits [rows, V] with a cuBLAS GEMM. Its PyTorch path then spends about eight
passes over them in fp32 (an upcast copy, max, exp, sums, gather, divide, scatter, scale). This kernel reads the
16-bit logits twice and writes the gradient once, in place: per row, a first sweep over the vocabulary keeps the
running max and sum of exponentials (online softmax, Milakov & Gimelshein 2018) with the target's logit and the
logits' sum; the second writes ``(softmax − (1 − ε)·onehot − ε/V) · (1 − tanh²) · scale`` over the logits, in
their dtype, ready for the two gradient GEMMs. One program owns one row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowerings._triton import as_fp32, tanh

BLOCK_V = 2048


@triton.jit
def _capped(x, softcap, HAS_SOFTCAP: tl.constexpr):
    """(softcapped logits, tanh(x / c)) in fp32; tanh(x / c) is 0 without a softcap."""
    x = x.to(tl.float32)
    if HAS_SOFTCAP:
        t = tanh(x / softcap)
        return softcap * t, t
    return x, tl.zeros_like(x)


@triton.jit
def _row_gradient_kernel(
    SRC, Z, targets, losses, scale_ptr,
    vocab, stride_src, stride_zn, ignore_index,
    smoothing_keep, smoothing_spread, smoothing, softcap,
    HAS_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Row ``program_id``: its loss term into ``losses`` and the scaled gradient of its logits (read from ``SRC``)
    into ``Z``, which may be ``SRC`` itself."""
    smoothing_keep, smoothing_spread = as_fp32(smoothing_keep), as_fp32(smoothing_spread)
    smoothing, softcap = as_fp32(smoothing), as_fp32(softcap)
    row = tl.program_id(0).to(tl.int64)
    source = SRC + row * stride_src
    base = Z + row * stride_zn
    target = tl.load(targets + row).to(tl.int64)
    valid = target != ignore_index
    cols = tl.arange(0, BLOCK_V)
    running_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_V], tl.float32)
    logit_sum = tl.zeros([BLOCK_V], tl.float32)
    target_logit = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, vocab, BLOCK_V):
        here = start + cols
        inside = here < vocab
        z, _ = _capped(tl.load(source + here, mask=inside, other=0.0), softcap, HAS_SOFTCAP)
        z = tl.where(inside, z, float("-inf"))  # past the vocabulary (a softcap would map -inf to -c)
        new_max = tl.maximum(running_max, z)
        # lanes that have seen only -inf (past the vocabulary) keep a zero sum: exp(-inf - -inf) would be NaN
        empty = new_max == float("-inf")
        shift = tl.where(empty, 0.0, new_max)
        running_sum = running_sum * tl.exp(running_max - shift) + tl.where(empty, 0.0, tl.exp(z - shift))
        running_max = new_max
        logit_sum += tl.where(inside, z, 0.0)
        target_logit += tl.where(here == target, z, 0.0)
    row_max = tl.max(running_max, axis=0)
    total = tl.sum(running_sum * tl.exp(running_max - row_max), axis=0)  # exp(-inf) = 0 on empty lanes
    lse = row_max + tl.log(total)
    loss = (1.0 - smoothing) * (lse - tl.sum(target_logit, axis=0)) + smoothing * (
        lse - tl.sum(logit_sum, axis=0) / vocab
    )
    tl.store(losses + row, tl.where(valid, loss, 0.0))
    scale = tl.where(valid, tl.load(scale_ptr).to(tl.float32), 0.0)
    for start in range(0, vocab, BLOCK_V):
        here = start + cols
        inside = here < vocab
        z, t = _capped(tl.load(source + here, mask=inside, other=0.0), softcap, HAS_SOFTCAP)
        grad = tl.exp(z - lse) - smoothing_spread - tl.where(here == target, smoothing_keep, 0.0)
        if HAS_SOFTCAP:
            grad = grad * (1.0 - t * t)
        tl.store(base + here, (grad * scale).to(Z.dtype.element_ty), mask=inside)


def row_gradient_(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    softcap: float | None,
    scale: torch.Tensor,
    source: torch.Tensor | None = None,
) -> torch.Tensor:
    """Overwrite ``logits`` [rows, V] (contiguous rows) with ``scale · ∂loss/∂logits`` and return the rows' loss
    terms [rows] in fp32 (0 on ignored rows). ``scale`` is a one-element tensor on the logits' device: the mean's
    1 / (valid rows) is known on the device only. With ``source`` (logits of the same shape, rows contiguous) the
    logits are read from there and ``logits`` is only written: the returned-logits case, whose logits must stay."""
    rows, vocab = logits.shape
    source = logits if source is None else source
    losses = torch.empty(rows, device=logits.device, dtype=torch.float32)
    if rows == 0:
        return losses
    keep = 1.0 - label_smoothing
    _row_gradient_kernel[(rows,)](
        source, logits, targets, losses, scale,
        vocab, source.stride(0), logits.stride(0), ignore_index,
        keep, label_smoothing / vocab, label_smoothing, softcap if softcap is not None else 1.0,
        HAS_SOFTCAP=softcap is not None, BLOCK_V=min(BLOCK_V, triton.next_power_of_2(vocab)),
    )
    return losses


@triton.jit
def _scaled_copy_kernel(SRC, OUT, scale_ptr, numel, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offsets = start + tl.arange(0, BLOCK)
    inside = offsets < numel
    scale = tl.load(scale_ptr).to(tl.float32)
    values = tl.load(SRC + offsets, mask=inside).to(tl.float32)
    tl.store(OUT + offsets, (values * scale).to(OUT.dtype.element_ty), mask=inside)


def scaled_copy(source: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``source · scale`` in ``dtype`` (contiguous ``source``, one-element ``scale``), one read and one write.
    Eager PyTorch takes its slow casting loop for an fp32 product written in 16 bits: 1.07 ms a step for the
    op's backward at N = 8192, V = 128256, D = 2048 on the H200, this kernel 0.38 ms (`cce_tune.py --profile`)."""
    out = torch.empty(source.shape, dtype=dtype, device=source.device)
    numel = source.numel()
    if numel:
        block = 4096
        _scaled_copy_kernel[(triton.cdiv(numel, block),)](source, out, scale, numel, BLOCK=block, num_warps=8)
    return out
