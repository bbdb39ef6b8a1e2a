"""Triton kernels of ``memopt::cce`` (CUDA): the N×V logits exist only as on-chip tiles or small chunks.

Forward (Wijmans et al. 2024, Alg. 2, with a split over the vocabulary instead of a lock-merged LSE): each
program owns a tile of rows and a slice of the vocabulary, computes logit tiles with the full hidden
dimension on chip and keeps a running max and sum of exponentials in fp32 (online softmax, Milakov &
Gimelshein 2018). The few per-slice partials are merged with ordinary tensor ops.

Backward: the vocabulary is walked in column chunks. For each chunk a kernel recomputes the logit tiles and
writes ``∂loss/∂logits`` for the chunk (softmax − one-hot, label smoothing and softcap chain rule folded in)
in the input dtype; two GEMMs then give the chunk's exact rows of ``∂C = Gᵀ E`` (fp32 accumulation inside
the GEMM, one rounding) and add ``G C`` into ``∂E``, whose running sum is kept in fp32 precision as a
compensated pair of 16-bit tensors. Nothing is accumulated in plain 16-bit precision, which is where
Apple's default kernels lose accuracy.

The forward launcher goes through ``torch.library.wrap_triton`` so that Inductor sees and emits the kernel
when the op is compiled. The backward runs inside an opaque op: its chunk loop writes slices of the gradient
buffers, which functionalization would turn into copies of whole gradients. With ``TRITON_INTERPRET=1``
(CPU tests) both launch the interpreted kernels directly.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator

import torch
import triton
import triton.language as tl

from lowerings._library import eager, interpreting, launchable
from lowerings._triton import as_fp32, exact_fp32_products, tanh

# Columns of ∂loss/∂logits materialized per backward chunk (N × columns in the input dtype): at most
# CHUNK_COLUMNS, fewer when N is large so that a chunk stays within CHUNK_BYTES (but at least MIN_COLUMNS).
CHUNK_COLUMNS = 4096
CHUNK_BYTES = 64 << 20
MIN_COLUMNS = 512
# Vocabulary columns per forward program: enough programs to fill an H100 at a few thousand tokens.
FORWARD_SPLIT_COLUMNS = 16384




@triton.jit
def _logit_tile(
    E, C, bias, rows, cols, vocab, n_rows, n_cols, dim,
    stride_en, stride_ed, stride_cv, stride_cd,
    softcap, scale,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, IEEE: tl.constexpr, ROUND: tl.constexpr,
    EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """fp32 logits [BLOCK_N, BLOCK_V] for ``rows`` × ``cols`` (times the logit scale, softcapped), and tanh(x·m/c)
    for the chain rule.

    ``vocab`` are the classes at those columns: ``cols`` itself, or their classes in a sorted vocabulary.
    ROUND rounds the linear's output to the input dtype before the scale and softcap, as a GEMM that writes the
    logits in that dtype does: the backward of ``cce_with_logits`` must see the logits its forward's GEMM returned.
    Rows and columns past the ends read the last row or class instead of being masked (callers mask what they
    keep), so that with EVEN_D (``dim`` a multiple of BLOCK_D) the loop's loads carry no mask at all."""
    col_ok = cols < n_cols
    safe_rows = tl.minimum(rows, n_rows - 1).to(tl.int64)
    safe_vocab = tl.where(col_ok, vocab, 0).to(tl.int64)
    e_rows = E + safe_rows[:, None] * stride_en
    c_rows = C + safe_vocab[:, None] * stride_cv
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for k in range(0, dim, BLOCK_D):
        ks = k + tl.arange(0, BLOCK_D)
        if EVEN_D:
            e = tl.load(e_rows + ks[None, :] * stride_ed)
            c = tl.load(c_rows + ks[None, :] * stride_cd)
        else:
            k_ok = (ks < dim)[None, :]
            e = tl.load(e_rows + ks[None, :] * stride_ed, mask=k_ok, other=0.0)
            c = tl.load(c_rows + ks[None, :] * stride_cd, mask=k_ok, other=0.0)
        if IEEE:  # fp32 operands (and the CPU interpreter, whose 16-bit dot is wrong) multiply exactly
            e = e.to(tl.float32)
            c = c.to(tl.float32)
            acc = tl.dot(e, tl.trans(c), acc, input_precision="ieee")
        else:
            acc = tl.dot(e, tl.trans(c), acc)
    if HAS_BIAS:
        acc += tl.load(bias + vocab, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if ROUND:
        acc = acc.to(E.dtype.element_ty).to(tl.float32)
    acc = acc * scale
    capped = acc
    if HAS_SOFTCAP:
        capped = tanh(acc / softcap)
        acc = capped * softcap
    return acc, capped


@triton.jit
def _lse_forward_kernel(
    E, C, bias, targets,
    part_max, part_sum, part_target, part_logit_sum,
    n_rows, n_cols, dim, cols_per_split,
    stride_en, stride_ed, stride_cv, stride_cd,
    softcap, scale,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, WANT_LOGIT_SUM: tl.constexpr, IEEE: tl.constexpr,
    EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Per (row tile, vocabulary slice): running max, Σexp, target logit and Σlogits, all fp32."""
    softcap, scale = as_fp32(softcap), as_fp32(scale)
    pid = tl.program_id(0)
    row_tiles = tl.cdiv(n_rows, BLOCK_N)
    split = pid // row_tiles
    rows = (pid % row_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    target = tl.load(targets + rows, mask=row_ok, other=-1).to(tl.int64)
    col_lo = split * cols_per_split
    col_hi = tl.minimum(col_lo + cols_per_split, n_cols)
    run_max = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    run_sum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    target_logit = tl.zeros((BLOCK_N,), dtype=tl.float32)
    logit_sum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for v in range(col_lo, col_hi, BLOCK_V):
        cols = v + tl.arange(0, BLOCK_V)
        logits, _ = _logit_tile(
            E, C, bias, rows, cols, cols, n_rows, col_hi, dim, stride_en, stride_ed, stride_cv, stride_cd, softcap,
            scale, HAS_BIAS, HAS_SOFTCAP, IEEE, False, EVEN_D, BLOCK_N, BLOCK_V, BLOCK_D,
        )
        col_ok = (cols < col_hi)[None, :]
        target_logit += tl.sum(tl.where(cols.to(tl.int64)[None, :] == target[:, None], logits, 0.0), axis=1)
        if WANT_LOGIT_SUM:
            logit_sum += tl.sum(tl.where(col_ok, logits, 0.0), axis=1)
        logits = tl.where(col_ok, logits, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(logits, axis=1))
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(logits - new_max[:, None]), axis=1)
        run_max = new_max
    out = split * n_rows + rows
    tl.store(part_max + out, run_max, mask=row_ok)
    tl.store(part_sum + out, run_sum, mask=row_ok)
    tl.store(part_target + out, target_logit, mask=row_ok)
    if WANT_LOGIT_SUM:
        tl.store(part_logit_sum + out, logit_sum, mask=row_ok)


# The narrower last chunk of a vocabulary compiles a second specialization (~0.7 s of a cold first step on the
# H200). Not specializing on the chunk's width instead cost 30 % of this kernel's speed and 54 % of the product's
# (``benchmarks/tools/cce_tune.py``, docs/tuning.md, 2026-12-03): the divisibility of the widths is worth the compile.
@triton.jit
def _grad_logits_kernel(
    E, C, bias, targets, lse, grad_rows, grad_lse, G, Order, Live,
    n_rows, n_cols, dim, col_start, chunk_cols,
    stride_en, stride_ed, stride_cv, stride_cd, stride_gn,
    smoothing_keep, smoothing_spread, softcap, filter_eps,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, IEEE: tl.constexpr, FILTER: tl.constexpr,
    ROUND: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    # last, with defaults, so that a launch written without them (a tile sweep's) means what it meant
    scale=1.0, GradLogits=None, stride_ln=0, stride_lv=0, ADD_LOGITS_GRAD: tl.constexpr = False,
):
    """G[n, j] = ∂(Σ g_n·loss_n + Σ h_n·lse_n)/∂x[n, col_start + j], written in G's dtype, x the classifier's output.

    ∂loss/∂z = softmax(z) − (1 − ε)·onehot − ε/V and ∂lse/∂z = softmax(z); through the scale and softcap
    z = c·tanh(x·m/c) both are multiplied by m·(1 − tanh²(x·m/c)). ADD_LOGITS_GRAD: the gradient of returned
    logits z (``GradLogits``, strides ``stride_ln``, ``stride_lv``) joins before that chain rule.

    FILTER (Wijmans et al. 2024, §4.3): columns run through the vocabulary in the sorted ``Order``; a tile whose
    every |softmax − target| of a contributing row is below ``filter_eps`` is written as zeros and marked dead in
    ``Live[row tile, column tile]``, so that the gradient products can skip it.
    """
    smoothing_keep, smoothing_spread, softcap = as_fp32(smoothing_keep), as_fp32(smoothing_spread), as_fp32(softcap)
    scale = as_fp32(scale)
    col_tiles = tl.cdiv(chunk_cols, BLOCK_V)
    pid = tl.program_id(0)
    rows = (pid // col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    local = (pid % col_tiles) * BLOCK_V + tl.arange(0, BLOCK_V)
    cols = col_start + local
    row_ok = rows < n_rows
    if FILTER:  # noqa: SIM108  (a constexpr branch in Triton JIT code)
        vocab = tl.load(Order + cols, mask=cols < n_cols, other=0)
    else:
        vocab = cols
    logits, capped = _logit_tile(
        E, C, bias, rows, cols, vocab, n_rows, n_cols, dim, stride_en, stride_ed, stride_cv, stride_cd, softcap,
        scale, HAS_BIAS, HAS_SOFTCAP, IEEE, ROUND, EVEN_D, BLOCK_N, BLOCK_V, BLOCK_D,
    )
    row_lse = tl.load(lse + rows, mask=row_ok, other=0.0)
    g_loss = tl.load(grad_rows + rows, mask=row_ok, other=0.0)
    g_lse = tl.load(grad_lse + rows, mask=row_ok, other=0.0)
    target = tl.load(targets + rows, mask=row_ok, other=-1).to(tl.int64)
    probs = tl.exp(logits - row_lse[:, None])
    is_target = vocab.to(tl.int64)[None, :] == target[:, None]
    grad = probs * (g_loss + g_lse)[:, None] - (g_loss * smoothing_spread)[:, None]
    grad -= tl.where(is_target, (g_loss * smoothing_keep)[:, None], 0.0)
    mask = row_ok[:, None] & (local < chunk_cols)[None, :]
    if ADD_LOGITS_GRAD:
        at = rows.to(tl.int64)[:, None] * stride_ln + cols.to(tl.int64)[None, :] * stride_lv
        grad += tl.load(GradLogits + at, mask=mask, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        grad = grad * (1.0 - capped * capped)
    grad = grad * scale
    if FILTER:
        contributing = mask & ((g_loss != 0.0) | (g_lse != 0.0))[:, None]
        distance = tl.abs(probs - smoothing_spread - tl.where(is_target, smoothing_keep, 0.0))
        live = tl.max(tl.max(tl.where(contributing, distance, 0.0), axis=1), axis=0) >= as_fp32(filter_eps)
        tl.store(Live + pid, live.to(tl.int8))  # pid = row tile · col_tiles + col tile
        grad = tl.where(live, grad, 0.0)
    tl.store(G + rows.to(tl.int64)[:, None] * stride_gn + local[None, :], grad.to(G.dtype.element_ty), mask=mask)


@triton.jit
def _product_step(
    acc, a_rows, B, BRows, k, k_size, m_ok, n_ok, rn, stride_ak, stride_bk, stride_bn,
    GATHER_B: tl.constexpr, IEEE: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """acc += A[rows, k:k+BLOCK_K] @ B[k:k+BLOCK_K, cols] in fp32 (B's rows gathered through BRows)."""
    rk = k + tl.arange(0, BLOCK_K)
    k_ok = rk < k_size
    a = tl.load(a_rows + rk[None, :] * stride_ak, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
    if GATHER_B:  # noqa: SIM108  (a constexpr branch in Triton JIT code)
        b_rows = tl.load(BRows + rk, mask=k_ok, other=0).to(tl.int64)
    else:
        b_rows = rk.to(tl.int64)
    b_ok = k_ok[:, None] & n_ok[None, :]
    b = tl.load(B + b_rows[:, None] * stride_bk + rn[None, :] * stride_bn, mask=b_ok, other=0.0)
    if IEEE:  # noqa: SIM108  (a constexpr branch in Triton JIT code)
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _accumulate_product_kernel(
    A, B, High, Low, BRows, Live, m_size, n_size, k_size,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, live_stride_m, live_stride_k,
    COMPENSATED: tl.constexpr, IEEE: tl.constexpr, GATHER_B: tl.constexpr, SKIP: tl.constexpr,
    LIVE_M: tl.constexpr, LIVE_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """High + Low += A[M, K] @ B[K, N] in fp32: the ∂E accumulation, with no 16-bit rounding of partials.

    For 16-bit outputs the running sum is kept as an unevaluated pair high + low of two 16-bit numbers
    (~16 significant bits, Dekker 1971), so ``High`` ends as the correctly rounded result and no separate
    fp32 buffer is needed; for fp32 outputs ``High`` alone is the accumulator.

    GATHER_B: row r of B is row ``BRows[r]`` of the ``B`` tensor (a sorted vocabulary). SKIP: the [M, K] blocks
    of A are tiles of LIVE_M × LIVE_K with flags ``Live[m // LIVE_M · live_stride_m + k // LIVE_K · live_stride_k]``;
    dead tiles (all zeros) are not multiplied.
    """
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(m_size, BLOCK_M)
    tiles_n = tl.cdiv(n_size, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % rows_in_group
    pid_n = (pid % (GROUP_M * tiles_n)) // rows_in_group
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < m_size
    n_ok = rn < n_size
    out_ok = m_ok[:, None] & n_ok[None, :]
    offsets = rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
    acc = tl.load(High + offsets, mask=out_ok, other=0.0).to(tl.float32)
    if COMPENSATED:
        acc += tl.load(Low + offsets, mask=out_ok, other=0.0).to(tl.float32)
    a_rows = A + rm.to(tl.int64)[:, None] * stride_am
    if SKIP:
        live_row = (pid_m * BLOCK_M // LIVE_M) * live_stride_m
        for k in range(0, k_size, BLOCK_K):
            if tl.load(Live + live_row + (k // LIVE_K) * live_stride_k) != 0:
                acc = _product_step(acc, a_rows, B, BRows, k, k_size, m_ok, n_ok, rn, stride_ak, stride_bk,
                                    stride_bn, GATHER_B, IEEE, BLOCK_K)
    else:  # the exact path: the plain pipelined loop, no branch inside
        for k in range(0, k_size, BLOCK_K):
            acc = _product_step(acc, a_rows, B, BRows, k, k_size, m_ok, n_ok, rn, stride_ak, stride_bk, stride_bn,
                                GATHER_B, IEEE, BLOCK_K)
    high = acc.to(High.dtype.element_ty)  # round to nearest on GPUs (Triton's CPU interpreter truncates)
    tl.store(High + offsets, high, mask=out_ok)
    if COMPENSATED:
        tl.store(Low + offsets, (acc - high.to(tl.float32)).to(Low.dtype.element_ty), mask=out_ok)


def _blocks(dtype: torch.dtype) -> dict[str, int]:
    """Tile sizes of the logit-gradient kernel: large tiles for the tensor cores, tiny ones for the interpreter."""
    if interpreting():
        return {"BLOCK_N": 16, "BLOCK_V": 16, "BLOCK_D": 16}
    if dtype == torch.float32:
        return {"BLOCK_N": 64, "BLOCK_V": 64, "BLOCK_D": 32, "num_warps": 4, "num_stages": 3}
    # H200, bf16, N=8192 V=128256 D=2048 (benchmarks/tools/cce_tune.py, 2026-12-03, unmasked loads): 565 TFLOP/s
    # (256×128×32 in 5 stages: 538; 128×256×64: 516).
    return {"BLOCK_N": 256, "BLOCK_V": 128, "BLOCK_D": 64, "num_warps": 8, "num_stages": 3}


def _forward_blocks(dtype: torch.dtype) -> dict[str, int]:
    """Tile sizes of the forward (log-sum-exp) kernel."""
    if interpreting() or dtype == torch.float32:
        return _blocks(dtype)
    # Same sweep: 563 TFLOP/s (256×128×32 in 5 stages, the earlier default: 520; 256×128×64: 547).
    return {"BLOCK_N": 128, "BLOCK_V": 256, "BLOCK_D": 64, "num_warps": 8, "num_stages": 3}


_FORCED_BLOCKS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("memopt_cce_blocks", default=None)


@contextlib.contextmanager
def forced_blocks(config: dict) -> Iterator[None]:
    """Launch the forward and logit-gradient kernels with these tiles (BLOCK_N, BLOCK_V, BLOCK_D, num_warps,
    num_stages) instead of ``_forward_blocks``' and ``_blocks``' choice: for tile sweeps."""
    token = _FORCED_BLOCKS.set(config)
    try:
        yield
    finally:
        _FORCED_BLOCKS.reset(token)


def _launch_blocks(choose: Callable[[torch.dtype], dict[str, int]], dtype: torch.dtype) -> dict[str, int]:
    forced = _FORCED_BLOCKS.get()
    return dict(forced) if forced is not None else choose(dtype)


def _product_blocks(dtype: torch.dtype) -> dict[str, int]:
    if interpreting():
        return {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2}
    if dtype == torch.float32:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
    # Same sweep: 471 TFLOP/s for a 4096-column chunk (128×128 tiles: 407; cuBLAS without fp32 output: 730).
    return {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}


@dataclasses.dataclass(frozen=True)
class LiveTiles:
    """Which tiles of a product's left operand are not all zeros: ``flags[i // rows, j // cols]`` for element
    (i, j) of A, with A's axes possibly swapped relative to the flag grid (``transposed``)."""

    flags: torch.Tensor  # int8 [row tiles, col tiles], contiguous
    rows: int
    cols: int
    transposed: bool = False


def accumulate_product(
    high: torch.Tensor,
    low: torch.Tensor | None,
    a: torch.Tensor,
    b: torch.Tensor,
    b_rows: torch.Tensor | None = None,
    live: LiveTiles | None = None,
) -> None:
    """``high (+ low) += a @ b``, summed in fp32; ``low`` holds the compensation of a 16-bit ``high``.

    ``high`` and ``low`` are contiguous [M, N]; ``a`` [M, K] and ``b`` [K, N] may be strided. ``b_rows``
    gathers B's rows (B = b[b_rows]); ``live`` lets the kernel skip A's all-zero tiles.
    """
    m_size, k_size = a.shape
    n_size = b.shape[1]
    blocks = _product_blocks(a.dtype)
    grid = (triton.cdiv(m_size, blocks["BLOCK_M"]) * triton.cdiv(n_size, blocks["BLOCK_N"]),)
    live_m, live_k, stride_m, stride_k = 1, 1, 0, 0
    if live is not None:
        col_tiles = live.flags.shape[1]
        live_m, live_k = (live.cols, live.rows) if live.transposed else (live.rows, live.cols)
        stride_m, stride_k = (1, col_tiles) if live.transposed else (col_tiles, 1)
        if live_m % blocks["BLOCK_M"] or live_k % blocks["BLOCK_K"]:
            raise ValueError(f"product tiles {blocks} do not nest in the filter's {live_m}×{live_k} tiles")
    eager(_accumulate_product_kernel)[grid](
        a, b, high, high if low is None else low, b_rows, live.flags if live is not None else None,
        m_size, n_size, k_size,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), high.stride(0), stride_m, stride_k,
        COMPENSATED=low is not None, IEEE=exact_fp32_products(a.dtype), GATHER_B=b_rows is not None,
        SKIP=live is not None, LIVE_M=live_m, LIVE_K=live_k, **blocks,
    )



def forward_rows(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    softcap: float | None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss (0 on ignored rows) and log-sum-exp, fp32 [N]; the same contract as the reference."""
    n_rows, dim = hidden.shape
    n_cols = weight.shape[0]
    blocks = _launch_blocks(_forward_blocks, hidden.dtype)
    cols_per_split = triton.cdiv(min(FORWARD_SPLIT_COLUMNS, n_cols), blocks["BLOCK_V"]) * blocks["BLOCK_V"]
    splits = triton.cdiv(n_cols, cols_per_split)
    part_max, part_sum, part_target, part_logit_sum = (
        hidden.new_empty((splits, n_rows), dtype=torch.float32) for _ in range(4)
    )
    want_logit_sum = label_smoothing != 0.0
    grid = (triton.cdiv(n_rows, blocks["BLOCK_N"]) * splits,)
    launchable(_lse_forward_kernel)[grid](
        hidden, weight, bias, targets,
        part_max, part_sum, part_target, part_logit_sum,
        n_rows, n_cols, dim, cols_per_split,
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
        softcap or 1.0, scale,
        HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None, WANT_LOGIT_SUM=want_logit_sum,
        IEEE=exact_fp32_products(hidden.dtype), EVEN_D=dim % blocks["BLOCK_D"] == 0, **blocks,
    )
    row_max = part_max.amax(dim=0)
    lse = row_max + torch.log((part_sum * torch.exp(part_max - row_max)).sum(dim=0))
    target_logit = part_target.sum(dim=0)
    loss = (1.0 - label_smoothing) * (lse - target_logit)
    if want_logit_sum:
        loss = loss + label_smoothing * (lse - part_logit_sum.sum(dim=0) / n_cols)
    return torch.where(targets != ignore_index, loss, 0.0), lse


def chunk_columns(n_rows: int, itemsize: int) -> int:
    """Columns per backward chunk for ``n_rows`` tokens (a multiple of 128)."""
    fitting = CHUNK_BYTES // max(1, n_rows * itemsize) // 128 * 128
    return max(min(MIN_COLUMNS, CHUNK_COLUMNS), min(CHUNK_COLUMNS, fitting))


def vocabulary_order(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Classes by descending mean logit over the rows, C·ē (+ b): the order in which filtered tiles cluster.

    The mean logit is linear in the hidden states, so one matrix-vector product gives it (a positive logit scale and
    the softcap, both monotone, keep the order); no pass over the logits is needed."""
    mean_logit = torch.mv(weight, hidden.mean(0, dtype=torch.float32).to(weight.dtype)).float()
    if bias is not None:
        mean_logit = mean_logit + bias.float()
    return torch.argsort(mean_logit, descending=True)


def backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    lse: torch.Tensor,
    grad_rows: torch.Tensor,
    grad_lse: torch.Tensor,
    label_smoothing: float,
    softcap: float | None,
    needs: tuple[bool, bool, bool],
    filter_eps: float = 0.0,
    grad_logits: torch.Tensor | None = None,
    round_logits: bool = False,
    scale: float = 1.0,
    logits_transformed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients w.r.t. hidden, weight, bias (empty where not needed); the reference's contract.

    ``grad_logits`` [N, V] is the gradient that reached logits the forward returned (``cce_with_logits``):
    it is added to each chunk's logit gradient before the two GEMMs, so it costs no pass of its own. It turns
    the filter off (its tiles are not negligible in general). ``round_logits`` recomputes the logits rounded to
    the input dtype, as that op's forward GEMM wrote them and took its log-sum-exp from. ``scale`` is the logit
    scale m; ``logits_transformed``: the returned logits were scaled and softcapped as the loss's, so their
    gradient goes through the chain rule too (inside the kernel under a softcap, whose slope only it has).

    ``filter_eps`` > 0 turns on the speed options of Wijmans et al. 2024 (§4.3): the vocabulary is walked in
    descending order of its mean logit, so that the columns where some row's softmax is not negligible
    cluster at the front, and tiles where every |softmax − target| is below ``filter_eps`` are dropped from
    both gradient products. That changes the gradients by up to ``filter_eps`` per dropped logit."""
    n_rows, dim = hidden.shape
    n_cols = weight.shape[0]
    need_hidden, need_weight, need_bias = needs
    blocks = _launch_blocks(_blocks, hidden.dtype)
    chunk = min(n_cols, chunk_columns(n_rows, hidden.element_size()))
    grad_chunk = hidden.new_empty((n_rows, chunk))
    grad_hidden = hidden.new_zeros((n_rows, dim)) if need_hidden else hidden.new_empty(0)
    compensation = torch.zeros_like(grad_hidden) if need_hidden and hidden.element_size() < 4 else None
    grad_weight = weight.new_empty(weight.shape) if need_weight else weight.new_empty(0)
    grad_bias = weight.new_zeros(n_cols, dtype=torch.float32) if need_bias else None
    row_tiles, col_tiles = triton.cdiv(n_rows, blocks["BLOCK_N"]), triton.cdiv(chunk, blocks["BLOCK_V"])
    grid = (row_tiles * col_tiles,)
    filtering = filter_eps > 0.0 and grad_logits is None
    order = vocabulary_order(hidden, weight, bias) if filtering else None
    live = hidden.new_empty((row_tiles, col_tiles), dtype=torch.int8) if filtering else None
    # The returned logits' gradient joins inside the kernel only where the chain rule needs its slope there.
    in_kernel = grad_logits is not None and logits_transformed and softcap is not None
    logits_strides = grad_logits.stride() if in_kernel else (0, 0)
    for start in range(0, n_cols, chunk):
        cols = min(chunk, n_cols - start)
        g = grad_chunk[:, :cols]
        eager(_grad_logits_kernel)[grid](
            hidden, weight, bias, targets, lse, grad_rows, grad_lse, g, order, live,
            n_rows, n_cols, dim, start, cols,
            hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1), g.stride(0),
            1.0 - label_smoothing, label_smoothing / n_cols, softcap or 1.0, filter_eps,
            HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None, IEEE=exact_fp32_products(hidden.dtype),
            FILTER=filtering, ROUND=round_logits, EVEN_D=dim % blocks["BLOCK_D"] == 0, **blocks,
            scale=scale, GradLogits=grad_logits if in_kernel else None, stride_ln=logits_strides[0],
            stride_lv=logits_strides[1], ADD_LOGITS_GRAD=in_kernel,
        )
        if grad_logits is not None and not in_kernel:  # through the scale alone, or not transformed at all
            g.add_(grad_logits[:, start : start + cols], alpha=scale if logits_transformed else 1.0)
        classes = order[start : start + cols] if filtering else None
        tiles = None
        if filtering:  # the kernel numbered this chunk's tiles row-major over its own column tiles
            chunk_tiles = triton.cdiv(cols, blocks["BLOCK_V"])
            flags = live.view(-1)[: row_tiles * chunk_tiles].view(row_tiles, chunk_tiles)
            tiles = LiveTiles(flags, blocks["BLOCK_N"], blocks["BLOCK_V"])
        if need_weight and filtering:
            rows_of_weight = torch.zeros((cols, dim), dtype=weight.dtype, device=weight.device)
            accumulate_product(rows_of_weight, None, g.t(), hidden, live=dataclasses.replace(tiles, transposed=True))
            grad_weight.index_copy_(0, classes, rows_of_weight)
        elif need_weight:
            torch.mm(g.t(), hidden, out=grad_weight[start : start + cols])
        if need_hidden:  # filtered: B's rows are the chunk's classes, gathered from the whole classifier
            b = weight if filtering else weight[start : start + cols]
            accumulate_product(grad_hidden, compensation, g, b, b_rows=classes, live=tiles)
        if grad_bias is not None:
            sums = torch.sum(g, dim=0, dtype=torch.float32)
            if filtering:
                grad_bias.index_copy_(0, classes, sums)
            else:
                grad_bias[start : start + cols] = sums
    return (
        grad_hidden,
        grad_weight,
        grad_bias.to(bias.dtype) if grad_bias is not None and bias is not None else weight.new_empty(0),
    )
