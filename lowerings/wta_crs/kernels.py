"""Triton kernels of WTA-CRS sampling: the draw itself (one program, scores looked up from the gradient-norm
estimate inside it), and, for eager CUDA calls, row norms and the fused gather-and-weight of samples.

Inside compiled graphs Inductor generates the norm and gather kernels from the PyTorch reference (``op.py``);
the draw is the opaque ``memopt::wta_crs_draw``, which launches ``draw`` as it is."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowerings._library import eager
from lowerings.wta_crs.reference import GRAD_FLOOR


@triton.jit
def _row_norms_kernel(X, Out, n_cols, stride_row, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = X + row.to(tl.int64) * stride_row
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        values = tl.load(base + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        acc += values * values
    tl.store(Out + row, tl.sqrt(tl.sum(acc, axis=0)))


@triton.jit
def _gather_rows_kernel(X, Index, Weight, Out, n_cols, stride_row, BLOCK: tl.constexpr):
    slot = tl.program_id(0)
    source = tl.load(Index + slot)
    scale = tl.load(Weight + slot)
    src = X + source * stride_row
    dst = Out + slot.to(tl.int64) * n_cols
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        values = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(dst + cols, (values * scale).to(Out.dtype.element_ty), mask=mask)


def _block(n_cols: int) -> int:
    return min(1024, triton.next_power_of_2(max(n_cols, 16)))


def row_norms(x: torch.Tensor) -> torch.Tensor:
    """‖x_i‖₂ in fp32 for each row of a 2-D tensor whose rows are contiguous."""
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    eager(_row_norms_kernel)[(x.shape[0],)](x, out, x.shape[1], x.stride(0), BLOCK=_block(x.shape[1]))
    return out


def gather_rows(x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x[index] · weight[:, None] in x's dtype, contiguous [k, D]."""
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty((index.numel(), x.shape[1]), dtype=x.dtype, device=x.device)
    eager(_gather_rows_kernel)[(index.numel(),)](
        x, index, weight.float().contiguous(), out, x.shape[1], x.stride(0), BLOCK=_block(x.shape[1])
    )
    return out


@triton.jit
def _update_estimate_kernel(
    Norms, Values, n_rows, period, decay,
    N_POSITIONS: tl.constexpr, SEQUENCES: tl.constexpr, BLOCK: tl.constexpr,
):
    """``reference.GradNormEstimate.updated`` in place for ``BLOCK`` slots: the mean norm of each position over
    the sequences (row i sits at i mod period), the positions from the last slot on averaged into it, then the
    moving average, written only where a position was observed."""
    slots = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    last = N_POSITIONS - 1
    sequences = n_rows // period
    direct = (slots < period) & (slots < last)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for first in range(0, sequences, SEQUENCES):
        seqs = first + tl.arange(0, SEQUENCES)
        mask = (seqs < sequences)[:, None] & direct[None, :]
        rows = seqs.to(tl.int64)[:, None] * period + slots[None, :]
        acc += tl.sum(tl.load(Norms + rows, mask=mask, other=0.0).to(tl.float32), axis=0)
    current = acc / sequences
    if (tl.program_id(0) == last // BLOCK) & (last < period):  # the block of the last slot, which has a tail
        tail = 0.0
        for first in range(0, sequences, SEQUENCES):
            seqs = first + tl.arange(0, SEQUENCES)
            for start in range(last, period, BLOCK):
                positions = start + tl.arange(0, BLOCK)
                mask = (seqs < sequences)[:, None] & (positions < period)[None, :]
                rows = seqs.to(tl.int64)[:, None] * period + positions[None, :]
                tail += tl.sum(tl.sum(tl.load(Norms + rows, mask=mask, other=0.0).to(tl.float32), axis=1), axis=0)
        current = tl.where(slots == last, tail / (sequences * (period - last)).to(tl.float32), current)
    observed = (slots < period) & (slots < N_POSITIONS)
    values = tl.load(Values + slots, mask=observed, other=0.0)
    blended = tl.where(values > 0, decay * values + (1 - decay) * current, current)
    tl.store(Values + slots, blended, mask=observed)


# Slots a program of ``update_estimate`` takes, and sequences it reads at once (a tile of 2048 norms).
ESTIMATE_SLOTS = 256
ESTIMATE_SEQUENCES = 8


def update_estimate(values: torch.Tensor, norms: torch.Tensor, period: int, decay: float) -> None:
    """Fold one step's row norms of the output gradient into a group's estimate ``values`` in place: one launch
    where the reference takes about fifteen ops."""
    period = max(period, 1)
    eager(_update_estimate_kernel)[(triton.cdiv(values.numel(), ESTIMATE_SLOTS),)](
        norms, values, norms.numel(), period, decay,
        N_POSITIONS=values.numel(), SEQUENCES=ESTIMATE_SEQUENCES, BLOCK=ESTIMATE_SLOTS,
    )


@triton.jit
def _probabilities(Scores, rows, valid, total, n_rows):
    """p = score / total, or uniform when every score is zero (as ``reference.normalize``)."""
    scores = tl.load(Scores + rows, mask=valid, other=0.0)
    return tl.where(total > 0, scores / tl.where(total > 0, total, 1.0), 1.0 / n_rows)


@triton.jit
def _draw_kernel(
    Norms, Estimate, Scores, Uniforms, Cumulative, Index, Weight, n_rows, n_slots, max_rounds, period, floor,
    N_POSITIONS: tl.constexpr, LOOKUP: tl.constexpr, WINNERS: tl.constexpr, BLOCK: tl.constexpr,
):
    """One WTA-CRS sample (``reference.draw``'s estimator) in a single program, a few passes over the scores.

    The winner set is the paper's adaptive |C| = argmin_c (1 − P_c)/(k − c) (Liu et al. 2023), found without a
    sort: adding the next-largest row lowers that score exactly when its probability exceeds the score, so
    C = {p > τ} at the fixed point τ = (1 − P(p > τ)) / (k − |p > τ|). From τ = 1/k the sets only grow; the loop
    stops when the count stops changing, after ``max_rounds``, or when a set reaches k rows (fp32 rounding of a
    mass near 1), keeping the last set of fewer than k: any C chosen before the draw keeps the estimate
    unbiased, a smaller one costs a little variance. Winners fill the first slots in row order; the other slots
    are inverse-CDF draws with replacement from the residual mass, found by binary search in a cumulative sum
    kept in ``Cumulative``.

    With ``LOOKUP`` the first pass writes the scores ‖x_i‖ · ĝ(i mod period) into ``Scores`` from the row norms
    and the estimate (``reference.GradNormEstimate.lookup``: positions never seen take the mean of the seen
    ones, or 1 before any; every estimate is floored at ``floor`` times that mean); otherwise ``Scores`` holds
    them already."""
    lanes = tl.arange(0, BLOCK)
    if LOOKUP:
        seen = 0.0
        seen_sum = 0.0
        for start in range(0, N_POSITIONS, BLOCK):
            slots = start + lanes
            values = tl.load(Estimate + slots, mask=slots < N_POSITIONS, other=0.0)
            seen += tl.sum((values > 0).to(tl.float32), axis=0)
            seen_sum += tl.sum(values, axis=0)
        mean = tl.where(seen > 0, seen_sum / tl.maximum(seen, 1.0), 1.0)
        for start in range(0, n_rows, BLOCK):
            rows = start + lanes
            valid = rows < n_rows
            positions = tl.minimum(rows % period, N_POSITIONS - 1)
            estimate = tl.load(Estimate + positions, mask=valid, other=1.0)
            estimate = tl.maximum(tl.where(estimate > 0, estimate, mean), floor * mean)
            norms = tl.load(Norms + rows, mask=valid, other=0.0)
            tl.store(Scores + rows, norms * estimate, mask=valid)
        tl.debug_barrier()  # the scores are read back by other threads below
    total = 0.0
    for start in range(0, n_rows, BLOCK):
        rows = start + lanes
        total += tl.sum(tl.load(Scores + rows, mask=rows < n_rows, other=0.0), axis=0)

    # The winners are the rows above ``chosen``: the last tested threshold whose set leaves a slot to draw.
    chosen = float("inf")  # none yet (and none for plain CRS)
    if WINNERS:
        threshold = 1.0 / n_slots
        count = 0
        previous = -1
        rounds = 0
        while (rounds < max_rounds) & (count != previous) & (count < n_slots):
            previous = count
            mass = 0.0
            count = 0
            for start in range(0, n_rows, BLOCK):
                rows = start + lanes
                valid = rows < n_rows
                p = _probabilities(Scores, rows, valid, total, n_rows)
                above = valid & (p > threshold)
                mass += tl.sum(tl.where(above, p, 0.0), axis=0)
                count += tl.sum(above.to(tl.int32), axis=0)
            chosen = tl.where(count < n_slots, threshold, chosen)
            threshold = tl.maximum(1.0 - mass, 0.0) / tl.maximum(n_slots - count, 1).to(tl.float32)
            rounds += 1

    taken = 0
    residual_mass = 0.0
    for start in range(0, n_rows, BLOCK):
        rows = start + lanes
        valid = rows < n_rows
        p = _probabilities(Scores, rows, valid, total, n_rows)
        win = valid & (p > chosen)
        slot = taken + tl.cumsum(win.to(tl.int32), axis=0) - 1
        tl.store(Index + slot, rows.to(tl.int64), mask=win)
        tl.store(Weight + slot, tl.full((BLOCK,), 1.0, tl.float32), mask=win)
        residual = tl.where(win | ~valid, 0.0, p)
        tl.store(Cumulative + rows, residual_mass + tl.cumsum(residual, axis=0), mask=valid)
        taken += tl.sum(win.to(tl.int32), axis=0)
        residual_mass += tl.sum(residual, axis=0)
    tl.debug_barrier()  # the cumulative sum is read back by other threads below

    draws = tl.maximum(n_slots - taken, 1).to(tl.float32)
    for start in range(0, n_slots, BLOCK):
        slots = start + lanes
        active = (slots >= taken) & (slots < n_slots)
        target = tl.load(Uniforms + slots, mask=active, other=0.0) * residual_mass
        low = tl.zeros((BLOCK,), tl.int32)
        high = tl.where(active, n_rows, 0)
        while tl.max(high - low, axis=0) > 0:  # first row whose cumulative mass exceeds the target
            open_ = low < high
            middle = (low + high) // 2
            below = tl.load(Cumulative + middle, mask=open_, other=0.0) <= target
            low = tl.where(open_ & below, middle + 1, low)
            high = tl.where(open_ & ~below, middle, high)
        drawn = tl.minimum(low, n_rows - 1)
        p = _probabilities(Scores, drawn, active, total, n_rows)
        weight = tl.where(p > 0, residual_mass / tl.maximum(draws * p, 1e-30), 0.0)
        tl.store(Index + slots, drawn.to(tl.int64), mask=active)
        tl.store(Weight + slots, weight, mask=active)


# Fixed-point rounds at most; softmax-normal probabilities over 16384 rows (spreads 0.1–8, budgets 0.01–0.5)
# converged within 11.
WINNER_ROUNDS = 32
# The one program's launch by row count: (most rows, rows and slots handled per loop step, warps); the first
# entry that holds the rows serves. `benchmarks/tools/wta_draw_tune.py --rows 16384,8192` on an H100 (budget 0.3):
# 16384 rows 80.0 µs a call at (8192, 16) against 122.9 at (1024, 8); 8192 rows 58.5 at (4096, 16) against 74.9.
# Beyond 16384 rows, not swept: the earlier default.
DRAW_LAUNCHES: tuple[tuple[int, int, int], ...] = ((8192, 4096, 16), (16384, 8192, 16), (2**62, 1024, 8))


def draw_launch(n_rows: int) -> dict[str, int]:
    """The draw kernel's launch for ``n_rows`` rows (``DRAW_LAUNCHES``)."""
    _, block, warps = next(entry for entry in DRAW_LAUNCHES if n_rows <= entry[0])
    return {"BLOCK": block, "num_warps": warps}


def draw(
    scores: torch.Tensor,
    uniforms: torch.Tensor,
    winners: bool,
    launch: dict[str, int] | None = None,
    *,
    estimate: torch.Tensor | None = None,
    period: int = 1,
    floor: float = GRAD_FLOOR,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(index [k], weight [k]) of one sample from unnormalized fp32 ``scores`` [N], k = len(uniforms).

    ``uniforms`` are k draws from U[0, 1), one per slot (the slots after the winners use them). With
    ``estimate`` (a group's gradient-norm estimate), ``scores`` are the row norms ‖x_i‖ and the kernel scores
    row i by ĝ(i mod ``period``) itself: one launch where the lookup eagerly takes about a dozen."""
    n_rows, n_slots = scores.numel(), uniforms.numel()
    index = torch.empty(n_slots, dtype=torch.int64, device=scores.device)
    weight = torch.empty(n_slots, dtype=torch.float32, device=scores.device)
    cumulative = torch.empty(n_rows, dtype=torch.float32, device=scores.device)
    looked_up = torch.empty_like(cumulative) if estimate is not None else scores
    eager(_draw_kernel)[(1,)](
        scores, scores if estimate is None else estimate, looked_up, uniforms, cumulative, index, weight,
        n_rows, n_slots, WINNER_ROUNDS, max(period, 1), floor,
        N_POSITIONS=1 if estimate is None else estimate.numel(), LOOKUP=estimate is not None, WINNERS=winners,
        **(launch or draw_launch(n_rows)),
    )
    return index, weight
