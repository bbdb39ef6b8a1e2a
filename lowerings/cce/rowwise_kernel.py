"""Triton kernel of ``memopt::cce_rowwise`` (CUDA): a chunk's loss terms and ``∂loss/∂logits`` in one kernel.

The row-wise op forms a chunk's logits [rows, V] with a cuBLAS GEMM. Its PyTorch path then spends about eight
passes over them in fp32 (an upcast copy, max, exp, sums, gather, divide, scatter, scale). This kernel reads the
16-bit logits twice and writes the gradient once, in place: per row, a first sweep over the vocabulary keeps the
running max and sum of exponentials (online softmax, Milakov & Gimelshein 2018) and, with label smoothing, the
logits' sum; the second writes ``(softmax − (1 − ε)·onehot − ε/V) · (1 − tanh²) · scale`` over the logits, in
their dtype, ready for the two gradient GEMMs. One program owns one row.

A logit scale m multiplies the logits before the softcap (x·m, then c·tanh(x·m/c)) and the gradient by the chain
rule. Where the op returns the logits as the loss sees them (``TRANSFORM``), the second sweep writes them back over
the returned logits it reads: the transform costs one store and no pass of its own.

Where the op returns the logits, all of them are in memory, and ∂C = Gᵀ·E is taken a slice of the vocabulary at a
time over every row, one GEMM rounded once as eager's, instead of a sum over row chunks in fp32 (``column_gradient_``:
the same second sweep over a slice of columns, from each row's log-sum-exp, which the row kernel stores).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowerings._library import eager
from lowerings._triton import as_fp32, tanh

# Tiles of one row's vocabulary and warps a program (one row). The kernel was bound by exponentials (the H200's
# 16 a clock an SM against 128 FMAs): now one an element in each sweep, masks only on the last tile, the target's
# logit loaded once, and it runs at 3.8 TB/s of its two reads and one write of 16-bit logits (0.42 ms for 2048 ×
# 128256 against 0.65 before; `benchmarks/tools/cce_tune.py --chunk-kernel` on the H200: 1024 × 4 warps was the fastest
# without smoothing or softcap, at V = 128256 and 50257, and within 9 % of the best with both).
BLOCK_V = 1024
NUM_WARPS = 4
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def _capped(x, softcap, logit_scale, HAS_SOFTCAP: tl.constexpr):
    """(scaled and softcapped logits, tanh(x·m / c)) in fp32; tanh(x·m / c) is 0 without a softcap."""
    x = x.to(tl.float32) * logit_scale
    if HAS_SOFTCAP:
        t = tanh(x / softcap)
        return softcap * t, t
    return x, tl.zeros_like(x)


@triton.jit
def _sum_exp_step(z, running_max, running_sum):
    """Online softmax over one tile (Milakov & Gimelshein 2018) with one scalar maximum: a tile's exponentials
    are taken once, against the new maximum, and the lanes' sums rescaled by one scalar factor. In base 2 (``z``
    is already times log2 e); ``-inf`` logits add nothing, and an all ``-inf`` prefix keeps a zero sum."""
    new_max = tl.maximum(running_max, tl.max(z, axis=0))
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    return new_max, running_sum * tl.exp2(running_max - shift) + tl.exp2(z - shift)


@triton.jit
def _write_gradient(
    source, base, start, cols, vocab, target, offset, keep, spread, softcap, logit_scale,
    MASKED: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, TRANSFORM: tl.constexpr,
):
    """One tile of sweep 2: 2^(z·log2 e − offset) is the scaled softmax; the one-hot and smoothing terms come
    already scaled. Only the last tile (``MASKED``) checks the vocabulary's end. ``TRANSFORM``: z replaces the
    logits it was read from."""
    inside = start + cols < vocab
    x = tl.load(source + start + cols, mask=inside, other=0.0) if MASKED else tl.load(source + start + cols)
    z, t = _capped(x, softcap, logit_scale, HAS_SOFTCAP)
    if TRANSFORM:
        if MASKED:
            tl.store(source + start + cols, z.to(source.dtype.element_ty), mask=inside)
        else:
            tl.store(source + start + cols, z.to(source.dtype.element_ty))
    grad = tl.exp2(z * LOG2E - offset) - tl.where(cols == (target - start).to(tl.int32), keep, 0.0)
    if HAS_SMOOTHING:
        grad -= spread
    if HAS_SOFTCAP:
        grad = grad * (1.0 - t * t)
    if MASKED:
        tl.store(base + start + cols, grad.to(base.dtype.element_ty), mask=inside)
    else:
        tl.store(base + start + cols, grad.to(base.dtype.element_ty))


@triton.jit
def _sweep_terms(valid, scale_ptr, logit_scale, lse, smoothing_keep, smoothing_spread):
    """The second sweep's per-row terms: the exponent's offset (the gradient's scale inside the exponential: a zero
    scale, an ignored row, gives 2^-inf = 0) and the scaled one-hot and smoothing terms."""
    scale = tl.where(valid, tl.load(scale_ptr).to(tl.float32) * logit_scale, 0.0)
    return lse * LOG2E - tl.log2(scale), smoothing_keep * scale, smoothing_spread * scale


@triton.jit
def _row_gradient_kernel(
    SRC, Z, targets, losses, scale_ptr, LSE,
    vocab, stride_src, stride_zn, ignore_index,
    smoothing_keep, smoothing_spread, smoothing, softcap, logit_scale,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, TRANSFORM: tl.constexpr, WRITE_LSE: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Row ``program_id``: its loss term into ``losses`` and the scaled gradient of its logits (read from ``SRC``)
    into ``Z``, which may be ``SRC`` itself (then not ``TRANSFORM``); with ``WRITE_LSE`` its log-sum-exp into
    ``LSE``."""
    smoothing_keep, smoothing_spread = as_fp32(smoothing_keep), as_fp32(smoothing_spread)
    smoothing, softcap, logit_scale = as_fp32(smoothing), as_fp32(softcap), as_fp32(logit_scale)
    row = tl.program_id(0).to(tl.int64)
    source = SRC + row * stride_src
    base = Z + row * stride_zn
    target = tl.load(targets + row).to(tl.int64)
    valid = target != ignore_index
    cols = tl.arange(0, BLOCK_V)
    full = vocab // BLOCK_V * BLOCK_V  # tiles before ``full`` need no mask
    # Sweep 1, in base 2: running maximum (a scalar), the lanes' sums of 2^(z − max), and Σ z for smoothing.
    running_max = tl.full((), float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_V], tl.float32)
    logit_sum = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, full, BLOCK_V):
        z, _ = _capped(tl.load(source + start + cols), softcap, logit_scale, HAS_SOFTCAP)
        z = z * LOG2E
        running_max, running_sum = _sum_exp_step(z, running_max, running_sum)
        if HAS_SMOOTHING:
            logit_sum += z
    if full < vocab:
        inside = full + cols < vocab
        z, _ = _capped(tl.load(source + full + cols, mask=inside, other=0.0), softcap, logit_scale, HAS_SOFTCAP)
        z = z * LOG2E
        # past the vocabulary: -inf (a softcap would have mapped a masked -inf to -c)
        running_max, running_sum = _sum_exp_step(tl.where(inside, z, float("-inf")), running_max, running_sum)
        if HAS_SMOOTHING:
            logit_sum += tl.where(inside, z, 0.0)
    lse = (running_max + tl.log2(tl.sum(running_sum, axis=0))) / LOG2E
    if WRITE_LSE:
        tl.store(LSE + row, lse)
    safe_target = tl.where(valid, target, 0)
    target_logit, _ = _capped(tl.load(source + safe_target), softcap, logit_scale, HAS_SOFTCAP)
    loss = lse - target_logit
    if HAS_SMOOTHING:
        loss = (1.0 - smoothing) * loss + smoothing * (lse - tl.sum(logit_sum, axis=0) / LOG2E / vocab)
    tl.store(losses + row, tl.where(valid, loss, 0.0))
    # Sweep 2: scale · m · (softmax − (1 − ε)·onehot − ε/V) · (1 − tanh²)
    offset, keep, spread = _sweep_terms(valid, scale_ptr, logit_scale, lse, smoothing_keep, smoothing_spread)
    for start in range(0, full, BLOCK_V):
        _write_gradient(source, base, start, cols, vocab, safe_target, offset, keep, spread, softcap, logit_scale,
                        False, HAS_SOFTCAP, HAS_SMOOTHING, TRANSFORM)
    if full < vocab:
        _write_gradient(source, base, full, cols, vocab, safe_target, offset, keep, spread, softcap, logit_scale,
                        True, HAS_SOFTCAP, HAS_SMOOTHING, TRANSFORM)


def row_gradient_(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    softcap: float | None,
    scale: torch.Tensor,
    source: torch.Tensor | None = None,
    logit_scale: float = 1.0,
    transform: bool = False,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Overwrite ``logits`` [rows, V] (contiguous rows) with ``scale · ∂loss/∂logits`` and return the rows' loss
    terms [rows] in fp32 (0 on ignored rows). ``scale`` is a one-element tensor on the logits' device: the mean's
    1 / (valid rows) is known on the device only. With ``source`` (logits of the same shape, rows contiguous) the
    logits are read from there and ``logits`` is only written: the returned-logits case, whose logits must stay,
    or with ``transform`` become c·tanh(x·m/c). The loss is taken over the logits times ``logit_scale`` m (then
    softcapped), and the gradient is w.r.t. the logits as read. ``lse`` [rows] (fp32), where given, receives each
    row's log-sum-exp, for ``column_gradient_``."""
    rows, vocab = logits.shape
    torch._check(not transform or source is not None, lambda: "row_gradient_: transform needs returned logits")
    source = logits if source is None else source
    losses = torch.empty(rows, device=logits.device, dtype=torch.float32)
    if rows == 0:
        return losses
    keep = 1.0 - label_smoothing
    eager(_row_gradient_kernel)[(rows,)](
        source, logits, targets, losses, scale, losses if lse is None else lse,
        vocab, source.stride(0), logits.stride(0), ignore_index,
        keep, label_smoothing / vocab, label_smoothing, softcap if softcap is not None else 1.0, logit_scale,
        HAS_SOFTCAP=softcap is not None, HAS_SMOOTHING=label_smoothing != 0.0, TRANSFORM=transform,
        WRITE_LSE=lse is not None, BLOCK_V=min(BLOCK_V, triton.next_power_of_2(vocab)), num_warps=NUM_WARPS,
    )
    return losses


@triton.jit
def _column_gradient_kernel(
    SRC, G, targets, LSE, scale_ptr,
    first, end, stride_src, stride_g, ignore_index,
    smoothing_keep, smoothing_spread, softcap, logit_scale,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, TRANSFORM: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Row ``program_id(0)``, tile ``program_id(1)`` of the columns [first, end): the row kernel's second sweep
    over that tile, from the row's stored log-sum-exp, written into ``G`` from its column 0."""
    smoothing_keep, smoothing_spread = as_fp32(smoothing_keep), as_fp32(smoothing_spread)
    softcap, logit_scale = as_fp32(softcap), as_fp32(logit_scale)
    row = tl.program_id(0).to(tl.int64)
    start = first + tl.program_id(1) * BLOCK_V
    source = SRC + row * stride_src
    base = G + row * stride_g - first
    target = tl.load(targets + row).to(tl.int64)
    valid = target != ignore_index
    safe_target = tl.where(valid, target, 0)
    offset, keep, spread = _sweep_terms(valid, scale_ptr, logit_scale, tl.load(LSE + row), smoothing_keep,
                                        smoothing_spread)
    cols = tl.arange(0, BLOCK_V)
    if start + BLOCK_V <= end:
        _write_gradient(source, base, start, cols, end, safe_target, offset, keep, spread, softcap, logit_scale,
                        False, HAS_SOFTCAP, HAS_SMOOTHING, TRANSFORM)
    else:
        _write_gradient(source, base, start, cols, end, safe_target, offset, keep, spread, softcap, logit_scale,
                        True, HAS_SOFTCAP, HAS_SMOOTHING, TRANSFORM)


def column_gradient_(
    out: torch.Tensor,
    source: torch.Tensor,
    first: int,
    targets: torch.Tensor,
    lse: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    softcap: float | None,
    scale: torch.Tensor,
    logit_scale: float = 1.0,
    transform: bool = False,
) -> None:
    """Write ``scale · ∂loss/∂logits`` of the columns [first, first + out.shape[1]) of every row of ``source``
    [rows, V] (the returned logits, rows contiguous) into ``out`` [rows, columns], as ``row_gradient_`` writes a
    row's, from each row's log-sum-exp ``lse`` (fp32, stored by ``row_gradient_``). ``transform``: those columns
    of ``source`` become c·tanh(x·m/c) as they are read."""
    rows, vocab = source.shape
    columns = out.shape[1]
    if rows == 0 or columns == 0:
        return
    block = min(BLOCK_V, triton.next_power_of_2(columns))
    eager(_column_gradient_kernel)[(rows, triton.cdiv(columns, block))](
        source, out, targets, lse, scale,
        first, first + columns, source.stride(0), out.stride(0), ignore_index,
        1.0 - label_smoothing, label_smoothing / vocab, softcap if softcap is not None else 1.0, logit_scale,
        HAS_SOFTCAP=softcap is not None, HAS_SMOOTHING=label_smoothing != 0.0, TRANSFORM=transform,
        BLOCK_V=block, num_warps=NUM_WARPS,
    )


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
        grid = (triton.cdiv(numel, block),)
        eager(_scaled_copy_kernel)[grid](source, out, scale, numel, BLOCK=block, num_warps=8)
    return out
