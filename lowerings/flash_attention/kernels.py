"""Triton kernels of memopt's flash attention (CUDA): softmax(q kᵀ·scale + bias) v without the Tq×Tk matrix.

The algorithm is FlashAttention-2 (Dao 2023, arXiv:2307.08691). The forward keeps one block of queries on chip and
streams the key/value blocks through it with an online softmax: a running row max and sum in fp32, one rescale
of the fp32 accumulator per key block, and the division by the sum only at the end. It saves the per-row
log-sum-exp. The backward recomputes each tile's probabilities from that log-sum-exp. A preprocess kernel computes
delta = rowsum(out ∘ grad_out). One kernel pins a block of keys/values and sweeps the query blocks of every query
head that reads it (GQA) to accumulate dK and dV; another pins a block of queries and sweeps the keys for dQ. Every
gradient tile has a single owner, so no atomics are needed and gradients are deterministic. An alternative
(``ATOMIC_DQ`` in the backward settings, off: 2.2× slower on the H200, docs/tuning.md) adds dQ from the dK/dV kernel
with fp32 atomics, as FA2 does: five GEMMs a tile instead of seven, at the price of a run-dependent summation order.

Scores are kept in base 2 (log2 e folded into the scale, exp2 everywhere); the returned lse is in natural log.
Causal masking is top-left aligned: query i sees keys j ≤ i. Blocks wholly above the diagonal are never visited,
and only the blocks that straddle it (or the ragged end of the keys) pay for a mask. A row whose keys are all
masked (a -inf bias) gets output 0 and lse -inf. Dropout keeps element (b, h, i, j) iff
tl.rand(seed, ((b·Hq + h)·Tq + i)·Tk + j) ≥ p, so the backward redraws the forward's mask instead of storing it.

A key bias (the same row of keys for every query: key padding) is read as one vector a tile, and key blocks
outside the span of keys it leaves above -inf, per (batch, head), are never visited: right padding's tail and
left padding's head cost nothing, forward or backward.

A sliding window of w keys (with causal: query i sees keys i − w < j ≤ i, as FA2's ``window_size=(w − 1, 0)``)
adds a second band edge: key blocks wholly left of every row's window are never visited either, and only the
blocks that straddle one of the two edges pay for a mask, so the work is O(T·w). A softcap c replaces each
score x = q·k·scale by c·tanh(x/c) before the bias and the mask (Gemma 2; FlashAttention-3 and FlexAttention's
``score_mod`` do the same); the backward multiplies dS by tanh's slope 1 − tanh²(x/c) before dQ and dK, while
the bias gradient stays dS itself (the bias is added after the cap).

With ``TRITON_INTERPRET=1`` (CPU tests) the kernels run in Triton's interpreter, with tiny tiles and fp32 dots.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from lowerings._library import interpreting, launchable
from lowerings._triton import as_fp32, exact_fp32_products, tanh

_LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x · log2 e)
_LN2 = tl.constexpr(0.6931471805599453)




# --------------------------------------------------------------------------------------------------------------
# Building blocks


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b in fp32. IEEE: exact fp32 products (fp32 at "highest" precision, and the CPU interpreter, whose 16-bit
    dot is wrong); otherwise ``a`` is rounded to ``b``'s dtype for the tensor cores, as FA2 rounds P before P·V."""
    if IEEE:  # noqa: SIM108  (a constexpr branch in Triton JIT code)
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a.to(b.dtype), b)
    return c


@triton.jit
def _load_rows(base, rows, n_rows, stride, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """[len(rows), BLOCK_D] tile of a [n_rows, HEAD_DIM] matrix (unit stride along D), zeros outside it.

    HEAD_DIM is a constexpr, so the padding mask is constant over aligned runs of D and loads stay vectorized."""
    dims = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (dims < HEAD_DIM)[None, :]
    return tl.load(base + rows.to(tl.int64)[:, None] * stride + dims[None, :], mask=mask, other=0.0)


@triton.jit
def _store_rows(base, rows, n_rows, stride, value, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    dims = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (dims < HEAD_DIM)[None, :]
    tl.store(base + rows.to(tl.int64)[:, None] * stride + dims[None, :], value.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _kept(seed, offsets, dropout_p):
    """Dropout draw for int64 ``offsets`` into the [B, Hq, Tq, Tk] grid; the same bits in forward and backward."""
    return tl.rand(seed, offsets) >= dropout_p


@triton.jit
def _base2_scores(
    a, b, bias, q_idx, k_idx, len_q, len_k, stride_bm, stride_bn, qk_scale, cap_scale, cap_out, window,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, KEY_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, IEEE: tl.constexpr,
):
    """(s, t) for one tile: s = (softcap(a bᵀ·scale) + bias)·log2 e, -inf where masked; t = tanh(a bᵀ·scale / c)
    with SOFTCAP (the backward's slope is 1 − t²), else s again.

    q_idx and k_idx broadcast to the tile: [M, 1] and [1, N] for a queries × keys tile, the other way round
    for the keys × queries tile of the dK/dV kernel. Unmasked tiles lie wholly inside the keys, the causal band
    and the window. With SOFTCAP, cap_scale = scale / c and cap_out = c·log2 e; qk_scale = scale·log2 e otherwise.
    KEY_BIAS: the bias is one row of keys for every query (stride_bm = 0, key padding), loaded once per tile as a
    vector rather than gathered as a tile of repeated addresses.
    """
    raw = _dot(a, tl.trans(b), IEEE)
    if SOFTCAP:
        t = tanh(raw * cap_scale)
        s = t * cap_out
    else:
        s = raw * qk_scale
        t = s
    if HAS_BIAS and KEY_BIAS:
        s += tl.load(bias + k_idx.to(tl.int64) * stride_bn, mask=k_idx < len_k, other=0.0).to(tl.float32) * _LOG2E
    elif HAS_BIAS:
        inside = (q_idx < len_q) & (k_idx < len_k)
        offsets = q_idx.to(tl.int64) * stride_bm + k_idx.to(tl.int64) * stride_bn
        s += tl.load(bias + offsets, mask=inside, other=0.0).to(tl.float32) * _LOG2E
    if MASKED:
        allowed = k_idx < len_k
        if CAUSAL:
            allowed = allowed & (k_idx <= q_idx)
        if WINDOW:
            allowed = allowed & (k_idx > q_idx - window)
        s = tl.where(allowed, s, float("-inf"))
    return s, t


@triton.jit
def _key_range(
    start_m, len_k, window, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Key blocks seen by query rows [start_m, start_m + BLOCK_M): [lo, edge) and [free, end) need a mask,
    [edge, free) none.

    Without a window lo = edge = 0. With one, blocks before ``lo`` lie left of every row's window, and blocks from
    ``edge`` on start right of the last row's left edge (i − w < j for every row). ``edge`` never passes ``free``;
    where ``free`` falls below ``lo`` (more queries than keys) the last range starts at ``free`` and covers the
    rest, masked."""
    if CAUSAL:
        end = tl.minimum(len_k, start_m + BLOCK_M)
        free = tl.minimum(start_m + 1, len_k) // BLOCK_N * BLOCK_N
    else:
        end = len_k
        free = len_k // BLOCK_N * BLOCK_N
    lo = 0
    edge = 0
    if WINDOW:
        lo = tl.maximum(start_m - window + 1, 0) // BLOCK_N * BLOCK_N
        edge = tl.minimum(tl.cdiv(tl.maximum(start_m + BLOCK_M - window, 0), BLOCK_N) * BLOCK_N, free)
    return lo, edge, free, end


@triton.jit
def _query_range(
    start_n, len_q, len_k, window, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Query blocks that see keys [start_n, start_n + BLOCK_N): [lo, mid) and [free_end, hi) need a mask,
    [mid, free_end) none.

    Causal rows before ``lo`` see none of these keys; with a window, neither do rows from ``hi`` on (their window
    starts after the block's last key), and rows up to ``free_end`` lie within every key's window. A ragged last
    key block is masked everywhere: its padding keys only feed dK/dV rows that are never stored, but the mask
    keeps their arithmetic finite."""
    if CAUSAL:
        lo = start_n // BLOCK_M * BLOCK_M
        mid = tl.cdiv(start_n + BLOCK_N - 1, BLOCK_M) * BLOCK_M
    else:
        lo = 0
        mid = 0
    mid = tl.where(start_n + BLOCK_N > len_k, len_q, tl.minimum(mid, len_q))
    hi = len_q
    free_end = len_q
    if WINDOW:
        hi = tl.minimum(len_q, start_n + BLOCK_N - 1 + window)
        mid = tl.minimum(mid, hi)
        free_end = tl.maximum(mid, tl.minimum((start_n + window) // BLOCK_M * BLOCK_M, hi))
    return lo, mid, free_end, hi


@triton.jit
def _row_stats(Lse, Delta, offsets, ok):
    """Base-2 lse and delta of some query rows. Dead and padding rows get lse +inf, so exp2(s − lse) = 0 there
    even where s is -inf."""
    lse = tl.load(Lse + offsets, mask=ok, other=float("-inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse * _LOG2E)
    return lse, tl.load(Delta + offsets, mask=ok, other=0.0)


@triton.jit
def _key_span(Span, bh, KEY_BIAS: tl.constexpr):
    """(first, one past the last) key of this (batch, head) whose key bias is not -inf; keys outside are masked
    for every query, so tiles wholly outside are skipped (right padding's tail, left padding's head). Without
    KEY_BIAS, (0, 0), which ``_clip`` ignores."""
    first = 0
    stop = 0
    if KEY_BIAS:
        first = tl.load(Span + bh * 2)
        stop = tl.load(Span + bh * 2 + 1)
    return first, stop


@triton.jit
def _clip(start, stop, first, last, KEY_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """A range of key blocks [start, stop) cut to the blocks that hold a key of the span [first, last)."""
    if KEY_BIAS:
        start = tl.maximum(start, first // BLOCK * BLOCK)
        stop = tl.minimum(stop, last)
    return start, stop


@triton.jit
def _spans_block(first, last, start_n, KEY_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Whether the key block [start_n, start_n + BLOCK_N) holds a key of the span [first, last)."""
    seen = True
    if KEY_BIAS:
        seen = (start_n < last) & (start_n + BLOCK_N > first)
    return seen


# --------------------------------------------------------------------------------------------------------------
# Forward


@triton.jit
def _query_block(len_q, n_heads, n_kv_heads, BLOCK_M: tl.constexpr):
    """(first row, rows, batch·head, batch, head, key/value head) of this program's block of queries.

    Blocks of one head are adjacent, so its K/V stay in L2; the last (longest causal) blocks start first.
    """
    q_blocks = tl.cdiv(len_q, BLOCK_M)
    pid = tl.program_id(0)
    start_m = (q_blocks - 1 - pid % q_blocks) * BLOCK_M
    bh = (pid // q_blocks).to(tl.int64)
    b = bh // n_heads
    h = bh % n_heads
    return start_m, start_m + tl.arange(0, BLOCK_M), bh, b, h, h // (n_heads // n_kv_heads)


@triton.jit
def _head_bias(Bias, b, h, stride_bb, stride_bh, HAS_BIAS: tl.constexpr):
    """The bias of one (batch, head): its base pointer when there is a bias (strides may be 0 to broadcast)."""
    bias = Bias
    if HAS_BIAS:
        bias = Bias + b * stride_bb + h * stride_bh
    return bias


@triton.jit
def _dropout_seed(Seed, HAS_DROPOUT: tl.constexpr):
    """The dropout seed, read from its device tensor only when dropout is on."""
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(Seed)
    return seed


@triton.jit
def _forward_step(
    acc, m_i, l_i, q, K, V, bias, seed, drop_rows, rows, start_n, len_q, len_k,
    stride_kt, stride_vt, stride_bm, stride_bn, qk_scale, cap_scale, cap_out, window, dropout_p,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, KEY_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr, HAS_DROPOUT: tl.constexpr, IEEE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TMA: tl.constexpr,
):
    """One key block of the online softmax: rescale sum and accumulator to the new row max, then add the block.

    The sum uses the probabilities before dropout (it is the softmax's denominator); the accumulator after.
    With TMA, K and V are tensor descriptors (Hopper's tensor memory accelerator; zeros past the end)."""
    cols = start_n + tl.arange(0, BLOCK_N)
    if TMA:  # noqa: SIM108  (a constexpr branch in Triton JIT code)
        k = K.load([start_n, 0])
    else:
        k = _load_rows(K, cols, len_k, stride_kt, HEAD_DIM, BLOCK_D)
    s, _ = _base2_scores(
        q, k, bias, rows[:, None], cols[None, :], len_q, len_k, stride_bm, stride_bn, qk_scale, cap_scale, cap_out,
        window, MASKED, CAUSAL, HAS_BIAS, KEY_BIAS, SOFTCAP, WINDOW, IEEE,
    )
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing visible yet: avoid exp2(-inf − -inf)
    p = tl.math.exp2(s - m_ref[:, None])
    alpha = tl.math.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    if HAS_DROPOUT:
        p = tl.where(_kept(seed, drop_rows[:, None] + cols[None, :], dropout_p), p, 0.0)
    if TMA:  # noqa: SIM108  (a constexpr branch in Triton JIT code)
        v = V.load([start_n, 0])
    else:
        v = _load_rows(V, cols, len_k, stride_vt, HEAD_DIM, BLOCK_D)
    acc = acc * alpha[:, None] + _dot(p, v, IEEE)
    return acc, m_new, l_i


@triton.jit
def _forward_kernel(
    Q, K, V, Bias, Span, Out, Lse, Seed,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_bb, stride_bh, stride_bm, stride_bn, stride_ob, stride_oh, stride_ot,
    n_heads, n_kv_heads, len_q, len_k, qk_scale, cap_scale, cap_out, window, dropout_p, keep_scale,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, KEY_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr, HAS_DROPOUT: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    """Out and lse of one block of queries of one (batch, head), streaming the key blocks it can see.

    TMA: q, k and v come through tensor descriptors (needs HEAD_DIM = BLOCK_D and 16-byte aligned rows).
    WARP_SPECIALIZE: Triton splits the unmasked key loop into producer (loads) and consumer (math) warp groups
    (``tl.range(warp_specialize=...)``; on Hopper, triton ≥ 3.4)."""
    qk_scale, dropout_p, keep_scale = as_fp32(qk_scale), as_fp32(dropout_p), as_fp32(keep_scale)
    cap_scale, cap_out = as_fp32(cap_scale), as_fp32(cap_out)
    start_m, rows, bh, b, h, kv = _query_block(len_q, n_heads, n_kv_heads, BLOCK_M)
    if TMA:
        q = tl.make_tensor_descriptor(
            Q + b * stride_qb + h * stride_qh, shape=[len_q, HEAD_DIM], strides=[stride_qt, 1],
            block_shape=[BLOCK_M, HEAD_DIM],
        ).load([start_m, 0])
        K = tl.make_tensor_descriptor(
            K + b * stride_kb + kv * stride_kh, shape=[len_k, HEAD_DIM], strides=[stride_kt, 1],
            block_shape=[BLOCK_N, HEAD_DIM],
        )
        V = tl.make_tensor_descriptor(
            V + b * stride_vb + kv * stride_vh, shape=[len_k, HEAD_DIM], strides=[stride_vt, 1],
            block_shape=[BLOCK_N, HEAD_DIM],
        )
    else:
        q = _load_rows(Q + b * stride_qb + h * stride_qh, rows, len_q, stride_qt, HEAD_DIM, BLOCK_D)
        K += b * stride_kb + kv * stride_kh
        V += b * stride_vb + kv * stride_vh
    bias = _head_bias(Bias, b, h, stride_bb, stride_bh, HAS_BIAS)
    seed = _dropout_seed(Seed, HAS_DROPOUT)
    drop_rows = (bh * len_q + rows) * len_k

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    lo, edge, free, end = _key_range(start_m, len_k, window, CAUSAL, WINDOW, BLOCK_M, BLOCK_N)
    first, last = _key_span(Span, bh, KEY_BIAS)
    edge_lo, edge_hi = _clip(lo, edge, first, last, KEY_BIAS, BLOCK_N)
    free_lo, free_hi = _clip(edge, free, first, last, KEY_BIAS, BLOCK_N)
    end_lo, end_hi = _clip(free, end, first, last, KEY_BIAS, BLOCK_N)
    for start_n in range(edge_lo, edge_hi, BLOCK_N):  # the window's left edge (none without a window)
        acc, m_i, l_i = _forward_step(
            acc, m_i, l_i, q, K, V, bias, seed, drop_rows, rows, start_n, len_q, len_k,
            stride_kt, stride_vt, stride_bm, stride_bn, qk_scale, cap_scale, cap_out, window, dropout_p,
            True, CAUSAL, HAS_BIAS, KEY_BIAS, SOFTCAP, WINDOW, HAS_DROPOUT, IEEE, HEAD_DIM, BLOCK_N, BLOCK_D, TMA,
        )
    for start_n in tl.range(free_lo, free_hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        acc, m_i, l_i = _forward_step(
            acc, m_i, l_i, q, K, V, bias, seed, drop_rows, rows, start_n, len_q, len_k,
            stride_kt, stride_vt, stride_bm, stride_bn, qk_scale, cap_scale, cap_out, window, dropout_p,
            False, CAUSAL, HAS_BIAS, KEY_BIAS, SOFTCAP, WINDOW, HAS_DROPOUT, IEEE, HEAD_DIM, BLOCK_N, BLOCK_D, TMA,
        )
    for start_n in range(end_lo, end_hi, BLOCK_N):
        acc, m_i, l_i = _forward_step(
            acc, m_i, l_i, q, K, V, bias, seed, drop_rows, rows, start_n, len_q, len_k,
            stride_kt, stride_vt, stride_bm, stride_bn, qk_scale, cap_scale, cap_out, window, dropout_p,
            True, CAUSAL, HAS_BIAS, KEY_BIAS, SOFTCAP, WINDOW, HAS_DROPOUT, IEEE, HEAD_DIM, BLOCK_N, BLOCK_D, TMA,
        )

    if HAS_DROPOUT:
        acc = acc * keep_scale
    dead = l_i == 0.0  # every key masked: output 0, lse -inf
    l_i = tl.where(dead, 1.0, l_i)
    _store_rows(Out + b * stride_ob + h * stride_oh, rows, len_q, stride_ot, acc / l_i[:, None], HEAD_DIM, BLOCK_D)
    lse = tl.where(dead, float("-inf"), (m_i + tl.math.log2(l_i)) * _LN2)
    tl.store(Lse + bh * len_q + rows, lse, mask=rows < len_q)


# --------------------------------------------------------------------------------------------------------------
# Backward


@triton.jit
def _delta_kernel(
    Out, GradOut, Delta, stride_ob, stride_oh, stride_ot, stride_gb, stride_gh, stride_gt, n_heads, len_q,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """delta = rowsum(out ∘ grad_out) in fp32 = rowsum(P ∘ dP), the softmax backward's per-row term."""
    q_blocks = tl.cdiv(len_q, BLOCK_M)
    pid = tl.program_id(0)
    bh = (pid // q_blocks).to(tl.int64)
    b = bh // n_heads
    h = bh % n_heads
    rows = (pid % q_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    o = _load_rows(Out + b * stride_ob + h * stride_oh, rows, len_q, stride_ot, HEAD_DIM, BLOCK_D)
    do = _load_rows(GradOut + b * stride_gb + h * stride_gh, rows, len_q, stride_gt, HEAD_DIM, BLOCK_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + bh * len_q + rows, delta, mask=rows < len_q)


@triton.jit
def _dq_step(
    dq, q, do, lse, delta, K, V, bias, dbias, seed, drop_rows, rows, start_n, len_q, len_k,
    stride_kt, stride_vt, stride_bm, stride_bn, qk_scale, cap_scale, cap_out, window, dropout_p, keep_scale,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, KEY_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr, BIAS_GRAD: tl.constexpr, HAS_DROPOUT: tl.constexpr, IEEE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """dQ += dS·K for one key block, dS = P ∘ (dP − delta) with P recomputed from lse (scale applied at the end).

    With BIAS_GRAD the tile of dS, which is ∂loss/∂bias, is written to this head's [Tq, Tk] slice of dbias."""
    cols = start_n + tl.arange(0, BLOCK_N)
    k = _load_rows(K, cols, len_k, stride_kt, HEAD_DIM, BLOCK_D)
    v = _load_rows(V, cols, len_k, stride_vt, HEAD_DIM, BLOCK_D)
    s, t = _base2_scores(
        q, k, bias, rows[:, None], cols[None, :], len_q, len_k, stride_bm, stride_bn, qk_scale, cap_scale, cap_out,
        window, MASKED, CAUSAL, HAS_BIAS, KEY_BIAS, SOFTCAP, WINDOW, IEEE,
    )
    p = tl.math.exp2(s - lse[:, None])
    dp = _dot(do, tl.trans(v), IEEE)
    if HAS_DROPOUT:  # dP of the kept, rescaled probabilities, pulled back through the mask
        dp = tl.where(_kept(seed, drop_rows[:, None] + cols[None, :], dropout_p), dp * keep_scale, 0.0)
    ds = p * (dp - delta[:, None])
    if BIAS_GRAD:
        inside = (rows[:, None] < len_q) & (cols[None, :] < len_k)
        tl.store(dbias + rows[:, None].to(tl.int64) * len_k + cols[None, :], ds, mask=inside)
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    return dq + _dot(ds, k, IEEE)


@triton.jit
def _dq_kernel(
    Q, K, V, Bias, Span, GradOut, Lse, Delta, DQ, DBias, Seed,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_bb, stride_bh, stride_bm, stride_bn, stride_gb, stride_gh, stride_gt, stride_db, stride_dh, stride_dt,
    n_heads, n_kv_heads, len_q, len_k, qk_scale, scale, cap_scale, cap_out, window, dropout_p, keep_scale,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, KEY_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr, HAS_DROPOUT: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BIAS_GRAD: tl.constexpr,
):
    """dQ of one block of queries (pinned with dO, lse and delta), streaming the key blocks it can see; with
    BIAS_GRAD also dS into DBias, a zeroed contiguous fp32 [B, Hq, Tq, Tk] (blocks never visited stay 0)."""
    qk_scale, scale, dropout_p, keep_scale = as_fp32(qk_scale), as_fp32(scale), as_fp32(dropout_p), as_fp32(keep_scale)
    cap_scale, cap_out = as_fp32(cap_scale), as_fp32(cap_out)
    start_m, rows, bh, b, h, kv = _query_block(len_q, n_heads, n_kv_heads, BLOCK_M)
    q = _load_rows(Q + b * stride_qb + h * stride_qh, rows, len_q, stride_qt, HEAD_DIM, BLOCK_D)
    do = _load_rows(GradOut + b * stride_gb + h * stride_gh, rows, len_q, stride_gt, HEAD_DIM, BLOCK_D)
    lse, delta = _row_stats(Lse, Delta, bh * len_q + rows, rows < len_q)
    K += b * stride_kb + kv * stride_kh
    V += b * stride_vb + kv * stride_vh
    bias = _head_bias(Bias, b, h, stride_bb, stride_bh, HAS_BIAS)
    seed = _dropout_seed(Seed, HAS_DROPOUT)
    drop_rows = (bh * len_q + rows) * len_k
    dbias = DBias + bh * len_q * len_k if BIAS_GRAD else DBias

    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    lo, edge, free, end = _key_range(start_m, len_k, window, CAUSAL, WINDOW, BLOCK_M, BLOCK_N)
    first, last = _key_span(Span, bh, KEY_BIAS)
    edge_lo, edge_hi = _clip(lo, edge, first, last, KEY_BIAS, BLOCK_N)
    free_lo, free_hi = _clip(edge, free, first, last, KEY_BIAS, BLOCK_N)
    end_lo, end_hi = _clip(free, end, first, last, KEY_BIAS, BLOCK_N)
    for start_n in range(edge_lo, edge_hi, BLOCK_N):
        dq = _dq_step(
            dq, q, do, lse, delta, K, V, bias, dbias, seed, drop_rows, rows, start_n, len_q, len_k,
            stride_kt, stride_vt, stride_bm, stride_bn, qk_scale, cap_scale, cap_out, window, dropout_p, keep_scale,
            True, CAUSAL, HAS_BIAS, KEY_BIAS, SOFTCAP, WINDOW, BIAS_GRAD, HAS_DROPOUT, IEEE, HEAD_DIM, BLOCK_N,
            BLOCK_D,
        )
    for start_n in range(free_lo, free_hi, BLOCK_N):
        dq = _dq_step(
            dq, q, do, lse, delta, K, V, bias, dbias, seed, drop_rows, rows, start_n, len_q, len_k,
            stride_kt, stride_vt, stride_bm, stride_bn, qk_scale, cap_scale, cap_out, window, dropout_p, keep_scale,
            False, CAUSAL, HAS_BIAS, KEY_BIAS, SOFTCAP, WINDOW, BIAS_GRAD, HAS_DROPOUT, IEEE, HEAD_DIM, BLOCK_N,
            BLOCK_D,
        )
    for start_n in range(end_lo, end_hi, BLOCK_N):
        dq = _dq_step(
            dq, q, do, lse, delta, K, V, bias, dbias, seed, drop_rows, rows, start_n, len_q, len_k,
            stride_kt, stride_vt, stride_bm, stride_bn, qk_scale, cap_scale, cap_out, window, dropout_p, keep_scale,
            True, CAUSAL, HAS_BIAS, KEY_BIAS, SOFTCAP, WINDOW, BIAS_GRAD, HAS_DROPOUT, IEEE, HEAD_DIM, BLOCK_N,
            BLOCK_D,
        )
    _store_rows(DQ + b * stride_db + h * stride_dh, rows, len_q, stride_dt, dq * scale, HEAD_DIM, BLOCK_D)


@triton.jit
def _dkdv_step(
    dk, dv, k, v, Q, GradOut, Lse, Delta, DQ, bias, seed, row_base, cols, start_m, len_q, len_k,
    stride_qt, stride_gt, stride_bm, stride_bn, qk_scale, cap_scale, cap_out, window, dropout_p, keep_scale,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, KEY_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr, HAS_DROPOUT: tl.constexpr, IEEE: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """dV += Pᵀ·dO and dK += dSᵀ·Q for one query block, on the transposed (keys × queries) tile.

    ATOMIC_DQ (FA2's original scheme): also add dS·K into this head's fp32 dQ rows with atomics, so no second
    kernel recomputes P and dP for dQ (five GEMMs a tile instead of seven; dQ's summation order varies)."""
    rows = start_m + tl.arange(0, BLOCK_M)
    q = _load_rows(Q, rows, len_q, stride_qt, HEAD_DIM, BLOCK_D)
    do = _load_rows(GradOut, rows, len_q, stride_gt, HEAD_DIM, BLOCK_D)
    lse, delta = _row_stats(Lse, Delta, row_base + rows, rows < len_q)
    s_t, t_t = _base2_scores(
        k, q, bias, rows[None, :], cols[:, None], len_q, len_k, stride_bm, stride_bn, qk_scale, cap_scale, cap_out,
        window, MASKED, CAUSAL, HAS_BIAS, KEY_BIAS, SOFTCAP, WINDOW, IEEE,
    )
    p_t = tl.math.exp2(s_t - lse[None, :])
    dp_t = _dot(v, tl.trans(do), IEEE)
    if HAS_DROPOUT:
        kept = _kept(seed, (row_base + rows)[None, :] * len_k + cols[:, None], dropout_p)
        dv += _dot(tl.where(kept, p_t * keep_scale, 0.0), do, IEEE)
        dp_t = tl.where(kept, dp_t * keep_scale, 0.0)
    else:
        dv += _dot(p_t, do, IEEE)
    ds_t = p_t * (dp_t - delta[None, :])
    if SOFTCAP:
        ds_t = ds_t * (1.0 - t_t * t_t)
    dk += _dot(ds_t, q, IEEE)
    if ATOMIC_DQ:
        dims = tl.arange(0, BLOCK_D)
        inside = (rows < len_q)[:, None] & (dims < HEAD_DIM)[None, :]
        offsets = rows.to(tl.int64)[:, None] * HEAD_DIM + dims[None, :]
        tl.atomic_add(DQ + offsets, _dot(tl.trans(ds_t), k, IEEE), mask=inside)
    return dk, dv


@triton.jit
def _dkdv_kernel(
    Q, K, V, Bias, Span, GradOut, Lse, Delta, DK, DV, DQ, Seed,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_bb, stride_bh, stride_bm, stride_bn, stride_gb, stride_gh, stride_gt,
    stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh, stride_dvt,
    n_heads, n_kv_heads, len_q, len_k, qk_scale, scale, cap_scale, cap_out, window, dropout_p, keep_scale,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, KEY_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr, HAS_DROPOUT: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ATOMIC_DQ: tl.constexpr,
):
    """dK and dV of one block of keys of one (batch, kv head): pinned K/V, swept over the query blocks of every
    query head of the group, so the GQA sum happens in registers. With ATOMIC_DQ, dQ too: DQ is a zeroed
    contiguous fp32 [B, Hq, Tq, D], unscaled."""
    qk_scale, scale, dropout_p, keep_scale = as_fp32(qk_scale), as_fp32(scale), as_fp32(dropout_p), as_fp32(keep_scale)
    cap_scale, cap_out = as_fp32(cap_scale), as_fp32(cap_out)
    k_blocks = tl.cdiv(len_k, BLOCK_N)
    pid = tl.program_id(0)
    start_n = (pid % k_blocks) * BLOCK_N  # causal: the first key blocks are the longest
    bkv = (pid // k_blocks).to(tl.int64)
    b = bkv // n_kv_heads
    kv = bkv % n_kv_heads
    group = n_heads // n_kv_heads
    cols = start_n + tl.arange(0, BLOCK_N)
    k = _load_rows(K + b * stride_kb + kv * stride_kh, cols, len_k, stride_kt, HEAD_DIM, BLOCK_D)
    v = _load_rows(V + b * stride_vb + kv * stride_vh, cols, len_k, stride_vt, HEAD_DIM, BLOCK_D)
    seed = _dropout_seed(Seed, HAS_DROPOUT)

    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    lo, mid, free_end, hi = _query_range(start_n, len_q, len_k, window, CAUSAL, WINDOW, BLOCK_M, BLOCK_N)
    for g in range(0, group):
        h = kv * group + g
        q_h = Q + b * stride_qb + h * stride_qh
        do_h = GradOut + b * stride_gb + h * stride_gh
        bias = _head_bias(Bias, b, h, stride_bb, stride_bh, HAS_BIAS)
        row_base = (b * n_heads + h) * len_q
        dq_h = DQ + row_base * HEAD_DIM if ATOMIC_DQ else DQ
        first, last = _key_span(Span, b * n_heads + h, KEY_BIAS)
        # a key block wholly outside this head's span is masked for every query: its dK, dV terms are 0
        h_hi = tl.where(_spans_block(first, last, start_n, KEY_BIAS, BLOCK_N), hi, lo)
        h_mid, h_free_end = tl.minimum(mid, h_hi), tl.minimum(free_end, h_hi)
        for start_m in range(lo, h_mid, BLOCK_M):
            dk, dv = _dkdv_step(
                dk, dv, k, v, q_h, do_h, Lse, Delta, dq_h, bias, seed, row_base, cols, start_m, len_q, len_k,
                stride_qt, stride_gt, stride_bm, stride_bn, qk_scale, cap_scale, cap_out, window, dropout_p,
                keep_scale, True, CAUSAL, HAS_BIAS, KEY_BIAS, SOFTCAP, WINDOW, HAS_DROPOUT, IEEE, ATOMIC_DQ, HEAD_DIM,
                BLOCK_M, BLOCK_D,
            )
        for start_m in range(h_mid, h_free_end, BLOCK_M):
            dk, dv = _dkdv_step(
                dk, dv, k, v, q_h, do_h, Lse, Delta, dq_h, bias, seed, row_base, cols, start_m, len_q, len_k,
                stride_qt, stride_gt, stride_bm, stride_bn, qk_scale, cap_scale, cap_out, window, dropout_p,
                keep_scale, False, CAUSAL, HAS_BIAS, KEY_BIAS, SOFTCAP, WINDOW, HAS_DROPOUT, IEEE, ATOMIC_DQ, HEAD_DIM,
                BLOCK_M, BLOCK_D,
            )
        for start_m in range(h_free_end, h_hi, BLOCK_M):  # the window's far edge (none without a window)
            dk, dv = _dkdv_step(
                dk, dv, k, v, q_h, do_h, Lse, Delta, dq_h, bias, seed, row_base, cols, start_m, len_q, len_k,
                stride_qt, stride_gt, stride_bm, stride_bn, qk_scale, cap_scale, cap_out, window, dropout_p,
                keep_scale, True, CAUSAL, HAS_BIAS, KEY_BIAS, SOFTCAP, WINDOW, HAS_DROPOUT, IEEE, ATOMIC_DQ, HEAD_DIM,
                BLOCK_M, BLOCK_D,
            )
    _store_rows(DK + b * stride_dkb + kv * stride_dkh, cols, len_k, stride_dkt, dk * scale, HEAD_DIM, BLOCK_D)
    _store_rows(DV + b * stride_dvb + kv * stride_dvh, cols, len_k, stride_dvt, dv, HEAD_DIM, BLOCK_D)


@triton.jit
def _keep_mask_kernel(Seed, Keep, len_q, len_k, dropout_p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The forward's dropout draws for one tile of one (batch, head), written out (tests only)."""
    q_blocks = tl.cdiv(len_q, BLOCK_M)
    k_blocks = tl.cdiv(len_k, BLOCK_N)
    pid = tl.program_id(0)
    bh = (pid // (q_blocks * k_blocks)).to(tl.int64)
    rows = (pid // k_blocks % q_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % k_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    offsets = (bh * len_q + rows)[:, None] * len_k + cols[None, :]
    kept = _kept(tl.load(Seed), offsets, dropout_p)
    tl.store(Keep + offsets, kept.to(tl.int8), mask=(rows < len_q)[:, None] & (cols < len_k)[None, :])


# --------------------------------------------------------------------------------------------------------------
# Launchers


def _tiles(block_d: int, dtype: torch.dtype, extras: bool) -> tuple[dict[str, int], dict[str, int]]:
    """(forward, backward) launch settings for a padded head dim and dtype, fixed rather than autotuned.

    Forward: BLOCK_M queries pinned against BLOCK_N streamed keys. Backward: PINNED rows (queries for dQ, keys
    for dK/dV) against SWEPT streamed rows. ``extras`` (a bias that varies over the queries, or dropout) adds a
    tile of bias values or Philox state to every step, so those launches get more warps or narrower streamed tiles;
    a key bias (key padding) adds one vector a tile and keeps the settings without one. A softcap (a tanh per score,
    kept until dS) and a window (one more comparison in the masked tiles) load nothing more: they keep the
    settings of their case (not swept with them on a GPU).

    16-bit without extras: the fastest settings of ``benchmarks/tools/attention_tune.py`` on the H200 (docs/tuning.md;
    D = 256 from a non-causal sweep). The others come from offline sm_90 compiles (ptxas -v): within 255
    registers a thread with no spills (a few hundred bytes for D = 256's dK/dV), and shared memory, about
    (pinned + stages · 2 · streamed) · D elements, within Hopper's 227 KB. fp32 at "highest"
    precision multiplies on the FMA units, which need small tiles.
    """
    if interpreting():
        return {"BLOCK_M": 16, "BLOCK_N": 16}, {"PINNED": 16, "SWEPT": 16}
    if dtype == torch.float32:
        side = 32 if block_d <= 128 else 16
        fwd_m, fwd_n, pinned, swept = side, 32 if block_d <= 64 else 16, side, 16
        fwd_warps, bwd_warps, fwd_stages, bwd_stages = 4, 4, 2, 2
    elif extras and block_d <= 64:
        (fwd_m, fwd_n), (pinned, swept) = (128, 64), (128, 32)
        fwd_warps, bwd_warps, fwd_stages, bwd_stages = 8, 8, 3, 3
    elif extras and block_d <= 128:
        (fwd_m, fwd_n), (pinned, swept) = (128, 32), (128, 16)
        fwd_warps, bwd_warps, fwd_stages, bwd_stages = 8, 8, 3, 2
    elif block_d <= 64:
        (fwd_m, fwd_n), (pinned, swept) = (128, 64), (64, 64)
        fwd_warps, bwd_warps, fwd_stages, bwd_stages = 4, 4, 3, 2
    elif block_d <= 128:
        (fwd_m, fwd_n), (pinned, swept) = (128, 128), (64, 64)
        fwd_warps, bwd_warps, fwd_stages, bwd_stages = 8, 4, 3, 2
    elif extras:
        (fwd_m, fwd_n), (pinned, swept) = (64, 32), (64, 16)
        fwd_warps, bwd_warps, fwd_stages, bwd_stages = 8, 8, 2, 2
    else:
        (fwd_m, fwd_n), (pinned, swept) = (128, 64), (32, 64)
        fwd_warps, bwd_warps, fwd_stages, bwd_stages = 8, 4, 2, 2
    return (
        {"BLOCK_M": fwd_m, "BLOCK_N": fwd_n, "num_warps": fwd_warps, "num_stages": fwd_stages},
        {"PINNED": pinned, "SWEPT": swept, "num_warps": bwd_warps, "num_stages": bwd_stages},
    )


_FORCED_TILES: contextvars.ContextVar[tuple[dict | None, dict | None]] = contextvars.ContextVar(
    "memopt_flash_attention_tiles", default=(None, None)
)


@contextlib.contextmanager
def forced_tiles(forward: dict | None = None, backward: dict | None = None) -> Iterator[None]:
    """Launch with these settings instead of ``_tiles``' choice: for tile sweeps and the numerics study.

    forward: BLOCK_M, BLOCK_N, num_warps, num_stages, and optionally TMA and WARP_SPECIALIZE; backward: PINNED,
    SWEPT, num_warps, num_stages, and optionally ATOMIC_DQ."""
    token = _FORCED_TILES.set((forward, backward))
    try:
        yield
    finally:
        _FORCED_TILES.reset(token)


def _launch_tiles(block_d: int, dtype: torch.dtype, extras: bool) -> tuple[dict[str, int], dict[str, int]]:
    chosen = _tiles(block_d, dtype, extras)
    forced = _FORCED_TILES.get()
    return tuple(dict(f) if f is not None else c for f, c in zip(forced, chosen, strict=True))



def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _bias_strides(bias: torch.Tensor | None) -> tuple[int, int, int, int]:
    return (0, 0, 0, 0) if bias is None else bias.stride()


def _is_key_bias(bias: torch.Tensor | None) -> bool:
    """A bias every query reads alike (stride 0 over the queries): key padding, as memopt's mask proofs build it."""
    return bias is not None and (bias.stride(2) == 0 or bias.shape[2] == 1)


def _extras(bias: torch.Tensor | None, dropout_p: float) -> bool:
    """Whether a launch streams a tile of bias values or dropout draws beside the scores (``_tiles``); a key
    bias is one vector a tile and keeps the settings of its case without one."""
    return (bias is not None and not _is_key_bias(bias)) or dropout_p > 0.0


def _key_spans(bias: torch.Tensor | None) -> torch.Tensor | None:
    """[B, Hq, 2] int32 (first, one past the last) key whose key bias is above -inf, per (batch, head); None
    unless the bias is a key bias. Computed on the device from the [B, Hq or 1, Tk] row (no host sync); a row of
    only -inf gives (Tk, 0), an empty span."""
    if not _is_key_bias(bias):
        return None
    keys = bias[:, :1, 0, :] if bias.stride(1) == 0 else bias[:, :, 0, :]
    seen = keys != float("-inf")  # NaN counts as seen: it must reach the output as the reference's does
    index = torch.arange(keys.shape[-1], device=keys.device, dtype=torch.int32)
    first = torch.where(seen, index, keys.shape[-1]).amin(-1)
    last = torch.where(seen, index + 1, 0).amax(-1)
    spans = torch.stack([first, last], dim=-1).to(torch.int32)
    return spans.expand(bias.shape[0], bias.shape[1], 2).contiguous()


def _block_d(head_dim: int) -> int:
    """D padded to a power of two, at least 16 (tl.dot's smallest operand side)."""
    return max(16, triton.next_power_of_2(head_dim))


def _flags(q: torch.Tensor, bias, causal: bool, dropout_p: float, softcap: float | None, window: int | None) -> dict:
    head_dim = q.shape[-1]
    return {
        "HEAD_DIM": head_dim, "BLOCK_D": _block_d(head_dim), "CAUSAL": causal,
        "HAS_BIAS": bias is not None, "KEY_BIAS": _is_key_bias(bias), "SOFTCAP": softcap is not None,
        "WINDOW": window is not None,
        "HAS_DROPOUT": dropout_p > 0.0, "IEEE": exact_fp32_products(q.dtype),
    }


def _score_args(scale: float, softcap: float | None, window: int | None) -> tuple[float, float, int]:
    """(cap_scale, cap_out, window) as the kernels read them: x·scale/c inside tanh and c·log2 e outside it, so the
    capped score comes out in base 2 as the uncapped one does; zeros where unused."""
    if softcap is None:
        return 0.0, 0.0, window or 0
    return scale / softcap, softcap * math.log2(math.e), window or 0


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    causal: bool,
    dropout_p: float,
    seed: torch.Tensor | None,
    softcap: float | None = None,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, Hq, Tq, D] (q's dtype) and natural-log lse [B, Hq, Tq] fp32 of softmax(softcap(q kᵀ·scale) + bias) v.

    k, v: [B, Hk, Tk, D], Hq % Hk == 0; bias: None or a [B, Hq, Tq, Tk] view (stride-0 broadcasts are read
    in place); seed: 1-element int64 tensor on q's device (read only when dropout_p > 0); softcap: c of
    c·tanh(x/c), or None; window: w of a causal sliding window (key j seen by query i iff i − w < j ≤ i), or None."""
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    batch, n_heads, len_q, head_dim = q.shape
    n_kv_heads, len_k = k.shape[1], k.shape[2]
    out = q.new_empty((batch, n_heads, len_q, head_dim))
    lse = q.new_empty((batch, n_heads, len_q), dtype=torch.float32)
    tiles, _ = _launch_tiles(_block_d(head_dim), q.dtype, _extras(bias, dropout_p))
    tma = tiles.pop("TMA", False) and _tma_ready(q, k, v)
    warp_specialize = tiles.pop("WARP_SPECIALIZE", False)
    grid = (triton.cdiv(len_q, tiles["BLOCK_M"]) * batch * n_heads,)
    if grid[0] == 0:
        return out, lse
    launchable(_forward_kernel)[grid](
        q, k, v, bias, _key_spans(bias), out, lse, seed if dropout_p > 0.0 else None,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *_bias_strides(bias), *out.stride()[:3],
        n_heads, n_kv_heads, len_q, len_k, scale * math.log2(math.e), *_score_args(scale, softcap, window),
        dropout_p, 1.0 / (1.0 - dropout_p),
        **_flags(q, bias, causal, dropout_p, softcap, window), TMA=tma, WARP_SPECIALIZE=warp_specialize, **tiles,
    )
    return out, lse


def _tma_ready(*tensors: torch.Tensor) -> bool:
    """Tensor descriptors need a power-of-two head dim that is the whole tile, unit last strides, 16-byte
    aligned rows and bases; and, on a GPU, an allocator for the descriptors' workspace (set here if none is)."""
    head_dim = tensors[0].shape[-1]
    for t in tensors:
        size = t.element_size()
        if t.stride(-1) != 1 or any(s * size % 16 for s in t.stride()[:-1]) or t.storage_offset() * size % 16:
            return False
    if head_dim != _block_d(head_dim):
        return False
    if not interpreting():
        from triton.runtime import _allocation

        if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
            triton.set_allocator(_descriptor_workspace)
    return True


def _descriptor_workspace(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    scale: float,
    causal: bool,
    dropout_p: float,
    seed: torch.Tensor | None,
    bias_grad: bool = False,
    softcap: float | None = None,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """dq, dk, dv (inputs' shapes and dtypes, contiguous) from the forward's out and lse; dk/dv of a shared
    key/value head sum over its query heads. With ``bias_grad`` also ∂loss/∂bias as a full fp32
    [B, Hq, Tq, Tk] (the caller sums it over the bias's broadcast dimensions), else None."""
    q, k, v, out, grad_out = (_unit_last(t) for t in (q, k, v, out, grad_out))
    lse = lse.contiguous()
    batch, n_heads, len_q, head_dim = q.shape
    n_kv_heads, len_k = k.shape[1], k.shape[2]
    _, tiles = _launch_tiles(_block_d(head_dim), q.dtype, _extras(bias, dropout_p))
    pinned, swept = tiles.pop("PINNED"), tiles.pop("SWEPT")
    atomic_dq = tiles.pop("ATOMIC_DQ", False) and not bias_grad  # the bias gradient comes from the dQ kernel
    dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (k, v))
    dq = q.new_empty(q.shape) if not atomic_dq else None
    dq_acc = q.new_zeros(q.shape, dtype=torch.float32) if atomic_dq else None
    flags = _flags(q, bias, causal, dropout_p, softcap, window)
    seed = seed if dropout_p > 0.0 else None
    spans = _key_spans(bias)
    common = (
        n_heads, n_kv_heads, len_q, len_k, scale * math.log2(math.e), scale, *_score_args(scale, softcap, window),
        dropout_p, 1.0 / (1.0 - dropout_p),
    )

    delta = torch.empty_like(lse)
    dbias = q.new_zeros((batch, n_heads, len_q, len_k), dtype=torch.float32) if bias_grad else None
    grid = (triton.cdiv(len_q, pinned) * batch * n_heads,)
    if grid[0]:
        launchable(_delta_kernel)[grid](
            out, grad_out, delta, *out.stride()[:3], *grad_out.stride()[:3], n_heads, len_q,
            HEAD_DIM=head_dim, BLOCK_M=pinned, BLOCK_D=flags["BLOCK_D"],
        )
    if grid[0] and not atomic_dq:
        launchable(_dq_kernel)[grid](
            q, k, v, bias, spans, grad_out, lse, delta, dq, dbias, seed,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *_bias_strides(bias), *grad_out.stride()[:3],
            *dq.stride()[:3], *common,
            **flags, BLOCK_M=pinned, BLOCK_N=swept, BIAS_GRAD=bias_grad, **tiles,
        )
    grid = (triton.cdiv(len_k, pinned) * batch * n_kv_heads,)
    if grid[0]:
        launchable(_dkdv_kernel)[grid](
            q, k, v, bias, spans, grad_out, lse, delta, dk, dv, dq_acc, seed,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *_bias_strides(bias), *grad_out.stride()[:3],
            *dk.stride()[:3], *dv.stride()[:3], *common,
            **flags, BLOCK_M=swept, BLOCK_N=pinned, ATOMIC_DQ=atomic_dq, **tiles,
        )
    if atomic_dq:
        dq = (dq_acc * scale).to(q.dtype)
    return dq, dk, dv, dbias


def dropout_keep_mask(
    seed: torch.Tensor, batch: int, n_heads: int, len_q: int, len_k: int, dropout_p: float, device
) -> torch.Tensor:
    """The keep mask [B, Hq, Tq, Tk] (bool) that forward and backward draw for ``seed``: for tests and debugging."""
    keep = torch.empty((batch, n_heads, len_q, len_k), dtype=torch.int8, device=device)
    blocks = {"BLOCK_M": 16, "BLOCK_N": 16} if interpreting() else {"BLOCK_M": 64, "BLOCK_N": 64}
    grid = (batch * n_heads * triton.cdiv(len_q, blocks["BLOCK_M"]) * triton.cdiv(len_k, blocks["BLOCK_N"]),)
    if grid[0]:
        launchable(_keep_mask_kernel)[grid](seed, keep, len_q, len_k, dropout_p, **blocks)
    return keep.bool()
