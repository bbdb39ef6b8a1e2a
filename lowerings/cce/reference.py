"""Chunked PyTorch implementation of linear + cross-entropy: the CPU path of ``memopt::cce`` and the test oracle.

It never holds more than one chunk of logits, computed in place: rows are processed ``chunk_rows`` at a time,
and a chunk's temporaries stay within ``chunk_budget`` bytes, 1/``FRACTION`` of the N×V logits it replaces
(at least one row, at most ``CHUNK_BYTES``). That budget is what the rewrite's memory model charges
(``lowerings.cce.op.working_set``), so CPU and GPU runs of a model take the same decisions. Forward returns
the per-row loss terms and the log-sum-exp; backward recomputes each chunk's logits from the hidden states
and the classifier (Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary Language Models").

Math, for one row of classifier outputs x, logits z = x·m (m, the logit scale: Cohere's ``logit_scale``, Granite's
1/``logits_scaling``), after the optional softcap z = c·tanh(x·m/c), target t, smoothing ε:
    lse  = log Σ_j exp z_j
    loss = (1 − ε)(lse − z_t) + ε(lse − mean_j z_j)          (ε = 0: plain cross-entropy)
    ∂loss/∂z_j = softmax(z)_j − (1 − ε)·[j = t] − ε/V,       ∂lse/∂z_j = softmax(z)_j
    ∂z_j/∂x_j  = m·(1 − tanh²(x_j·m/c))                      (m without a softcap)
"""

from __future__ import annotations

import math

import torch

# A chunk's temporaries stay within 1/FRACTION of the logits [N, V] (in the input dtype) they stand in for,
# and under CHUNK_BYTES; a chunk is at least one row whatever that costs.
FRACTION = 8
CHUNK_BYTES = 32 << 20
# Per-row vectors of a chunk (max, Σexp, log-sum-exp, target logit and its int64 index, loss, gradient scales and
# their intermediates), counted in elements of the compute dtype.
ROW_SCALARS = 16


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics and accumulators are fp32, or fp64 for fp64 inputs (the test oracle's precision)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _upcast_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of a product kept in ``dtype`` before its copy in the compute dtype (0: no copy)."""
    return dtype.itemsize if dtype.itemsize < compute_dtype(dtype).itemsize else 0


def row_bytes(vocab, dim, dtype: torch.dtype, *, softcap: bool, backward: bool):
    """Bytes one row of a chunk holds: its logits in place (plus tanh(x/c) for the softcap's chain rule in the
    backward), the 16-bit product before its upcast, the upcast hidden row, and per-row vectors."""
    acc, low = compute_dtype(dtype).itemsize, _upcast_bytes(dtype)
    buffers = 2 if softcap and backward else 1
    hidden_row = dim * acc if backward and low else 0
    return vocab * (buffers * acc + low) + hidden_row + ROW_SCALARS * acc


def fixed_bytes(vocab, dtype: torch.dtype, *, bias: bool, backward: bool):
    """Bytes a pass holds whatever the chunk size: the bias in the compute dtype, a chunk's bias-gradient sum."""
    acc = compute_dtype(dtype).itemsize
    return vocab * acc * ((1 if bias and _upcast_bytes(dtype) else 0) + (1 if bias and backward else 0))


def chunk_budget(n_rows, vocab, dim, dtype: torch.dtype):
    """Bytes of temporaries a chunk may hold: 1/FRACTION of the logits, capped at CHUNK_BYTES, never less than one
    row of the costliest pass (backward with softcap and bias). SymInt sizes give a symbolic budget."""
    floor = row_bytes(vocab, dim, dtype, softcap=True, backward=True) + fixed_bytes(
        vocab, dtype, bias=True, backward=True
    )
    share = n_rows * vocab * dtype.itemsize // FRACTION
    return torch.sym_max(floor, torch.sym_min(share, CHUNK_BYTES))


def chunk_rows(
    vocab,
    n_rows=None,
    dim=0,
    dtype: torch.dtype = torch.float32,
    *,
    softcap: bool = False,
    bias: bool = False,
    backward: bool = False,
):
    """Rows per chunk so that a pass's temporaries fit ``chunk_budget`` (at least 1, at most ``n_rows``).

    Without ``n_rows`` (a caller that does not know the problem size): as many fp32 rows as CHUNK_BYTES holds.
    """
    if n_rows is None:
        return max(1, CHUNK_BYTES // (4 * max(vocab, 1)))
    budget = chunk_budget(n_rows, vocab, dim, dtype)
    room = budget - fixed_bytes(vocab, dtype, bias=bias, backward=backward)
    rows = room // row_bytes(vocab, dim, dtype, softcap=softcap, backward=backward)
    return torch.sym_max(1, torch.sym_min(n_rows, rows))


def _chunk_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor
) -> torch.Tensor:
    """``out`` ← hidden @ weightᵀ (+ bias) in the compute dtype; ``bias`` is already in it.

    16-bit logits are rounded to their dtype once, bias included, as the eager classifier (and the forward of
    ``cce_with_logits``, which takes its loss from them) rounds them."""
    if hidden.dtype == out.dtype and weight.dtype == out.dtype:
        torch.mm(hidden, weight.t(), out=out)
        return out if bias is None else out.add_(bias)
    return out.copy_(torch.nn.functional.linear(hidden, weight, None if bias is None else bias.to(hidden.dtype)))


def row_terms_(
    z: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    softcap: float | None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row loss (0 on ignored rows) and log-sum-exp of a chunk's logits ``z`` [rows, V] in the compute dtype,
    in place: ``z`` is scaled and softcapped, then left holding exp(z − max); the third result is its row sums, so
    that ``z / sums`` is the softmax. The log-sum-exp is ``torch.logsumexp``'s (an all −inf row keeps −inf).

    The one loss computation of the chunked forward, ``cce_with_logits`` on CPU and the row-wise op."""
    scale_and_cap_(z, scale, softcap)
    valid = valid_rows(targets, ignore_index)
    target_logit = z.gather(1, torch.where(valid, targets, 0).unsqueeze(1)).squeeze(1)
    mean_logit = z.mean(dim=-1) if label_smoothing else None
    top = z.amax(dim=1, keepdim=True)
    top.masked_fill_(top.abs() == float("inf"), 0.0)
    sums = z.sub_(top).exp_().sum(dim=1)
    lse = sums.log().add_(top.squeeze(1))
    loss = (1.0 - label_smoothing) * (lse - target_logit)
    if mean_logit is not None:
        loss = loss + label_smoothing * (lse - mean_logit)
    return torch.where(valid, loss, 0.0), lse, sums


def scale_and_cap_(z: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    """``z`` ← c·tanh(z·m/c) (``z·m`` without a softcap) in place, in ``z``'s dtype: the loss's view of the
    classifier's outputs, in the compute dtype. Passes that change nothing are skipped."""
    if scale != 1.0:
        z.mul_(scale)
    if softcap is not None:
        z.div_(softcap).tanh_().mul_(softcap)
    return z


def check_logit_scale(scale: float, divisor: float) -> None:
    """A logit scale ``scale / divisor`` the ops take: finite and positive. A negative one would flip the softmax
    (no language model's head does that), and the row-wise kernel keeps its gradient scale inside a logarithm."""
    torch._check(
        math.isfinite(scale) and math.isfinite(divisor) and scale > 0 and divisor > 0,
        lambda: f"memopt.cce: the logit scale must be positive and finite, got {scale} / {divisor}",
    )


def transformed_logits(logits: torch.Tensor, scale: float, divisor: float, softcap: float | None) -> torch.Tensor:
    """The logits a graph returns after its classifier: ``tanh(logits · scale / divisor / c) · c`` as the model
    wrote it, one op at a time in the logits' dtype (each rounded, as eager rounds them). Ops that would change
    nothing (a scale of 1, no softcap) are left out, so the classifier's logits come back as they are."""
    if scale != 1.0:
        logits = logits * scale
    if divisor != 1.0:
        logits = logits / divisor
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def transform_logits_(logits: torch.Tensor, scale: float, divisor: float, softcap: float | None) -> torch.Tensor:
    """``transformed_logits`` in place, for the opaque ops that own the buffer: no second N×V tensor."""
    if scale != 1.0:
        logits.mul_(scale)
    if divisor != 1.0:
        logits.div_(divisor)
    if softcap is not None:
        logits.div_(softcap).tanh_().mul_(softcap)
    return logits


def _buffer(numel: int, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, device=like.device)


def _view(buffer: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return buffer[: rows * cols].view(rows, cols)


def valid_rows(targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return targets != ignore_index


def check_targets(targets: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Raise like PyTorch's cross-entropy on a class index outside [0, V) that is not ignored: an IndexError on
    CPU, a device-side assert on CUDA (no host sync, which a CUDA-graph capture forbids)."""
    bad = valid_rows(targets, ignore_index) & ((targets < 0) | (targets >= vocab))
    if targets.is_cuda:
        torch._assert_async(~bad.any(), "memopt.cce: a target is out of bounds")
        return
    if bool(bad.any()):
        first = int(targets[bad][0])
        raise IndexError(f"Target {first} is out of bounds (vocabulary size {vocab}).")


def forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    softcap: float | None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss (0 on ignored rows) and per-row log-sum-exp, both [N] in the compute dtype, of the logits
    scaled by ``scale`` (then softcapped).

    fp32 and fp64 inputs walk tiles of rows × vocabulary columns with a running log-sum-exp
    (``_forward_by_columns``), 16-bit inputs chunks of whole rows."""
    (n_rows, dim), vocab = hidden.shape, weight.shape[0]
    check_targets(targets, vocab, ignore_index)
    if _by_columns(hidden, weight):
        return _forward_by_columns(hidden, weight, bias, targets, ignore_index, label_smoothing, softcap, scale)
    acc = compute_dtype(hidden.dtype)
    losses = hidden.new_empty(n_rows, dtype=acc)
    lse = torch.empty_like(losses)
    step = chunk_rows(vocab, n_rows, dim, hidden.dtype, softcap=softcap is not None, bias=bias is not None)
    buffer = _buffer(step * vocab, hidden, acc)
    bias = bias.to(acc) if bias is not None else None
    for start in range(0, n_rows, step):
        rows = slice(start, min(start + step, n_rows))
        z = _chunk_logits(hidden[rows], weight, bias, _view(buffer, rows.stop - start, vocab))
        losses[rows], lse[rows], _ = row_terms_(z, targets[rows], ignore_index, label_smoothing, softcap, scale)
    return losses, lse


def backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    lse: torch.Tensor,
    grad_rows: torch.Tensor,
    grad_lse: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    softcap: float | None,
    needs: tuple[bool, bool, bool],
    grad_logits: torch.Tensor | None = None,
    scale: float = 1.0,
    logits_transformed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of Σ grad_rows·loss_rows + Σ grad_lse·lse (+ Σ grad_logits·logits) w.r.t. hidden, weight, bias.

    ``grad_logits`` [N, V], when given, is the gradient of logits the forward returned (``cce_with_logits``);
    it joins each chunk's logit gradient, so it costs no GEMM of its own. Those logits are the classifier's
    outputs x, or with ``logits_transformed`` the scaled and softcapped z the loss saw: their gradient then goes
    through the same chain rule as the loss's (``chain_rule_``).

    fp32 and fp64 inputs walk tiles of rows × vocabulary columns (``_backward_by_columns``); 16-bit inputs walk
    chunks of whole rows, so that each row's hidden-state gradient is one GEMM over the whole vocabulary rounded
    once, as eager's.

    ``grad_rows`` is the upstream gradient of each row's loss (already scaled by the reduction and zero
    on ignored rows). Weight and bias gradients accumulate in the compute dtype (fp32 for 16-bit inputs).
    An input whose entry in ``needs`` is False gets an empty gradient. Each chunk's probabilities become its
    logit gradient in place, in one buffer (two with a softcap, whose chain rule needs tanh(x/c) too).
    """
    if _by_columns(hidden, weight):
        return _backward_by_columns(
            hidden, weight, bias, targets, lse, grad_rows, grad_lse, ignore_index, label_smoothing, softcap, needs,
            grad_logits, scale, logits_transformed,
        )
    (n_rows, dim), vocab = hidden.shape, weight.shape[0]
    need_hidden, need_weight, need_bias = needs
    grad_hidden = hidden.new_empty(hidden.shape) if need_hidden else hidden.new_empty(0)
    acc = compute_dtype(hidden.dtype)
    grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_weight else None
    grad_bias = torch.zeros(vocab, dtype=acc, device=weight.device) if need_bias else None
    step = chunk_rows(
        vocab, n_rows, dim, hidden.dtype, softcap=softcap is not None, bias=bias is not None, backward=True
    )
    buffer = _buffer(step * vocab, hidden, acc)
    slopes = _buffer(step * vocab, hidden, acc) if softcap is not None else None
    bias_acc = bias.to(acc) if bias is not None else None
    for start in range(0, n_rows, step):
        rows = slice(start, min(start + step, n_rows))
        count = rows.stop - start
        if slopes is None:
            dlogits = _chunk_logits(hidden[rows], weight, bias_acc, _view(buffer, count, vocab))
            scale_and_cap_(dlogits, scale, None)
            slope = None
        else:  # tanh(x·m/c) kept for the chain rule; the capped logits c·tanh(x·m/c) go to the other buffer
            slope = _chunk_logits(hidden[rows], weight, bias_acc, _view(slopes, count, vocab))
            slope = scale_and_cap_(slope, scale, None).div_(softcap).tanh_()
            dlogits = torch.mul(slope, softcap, out=_view(buffer, count, vocab))
        dlogits.sub_(lse[rows].unsqueeze(1)).exp_()  # probabilities
        g_loss, g_lse = grad_rows[rows].to(acc), grad_lse[rows].to(acc)
        dlogits.mul_((g_loss + g_lse).unsqueeze(1))
        target = targets[rows]
        valid = valid_rows(target, ignore_index)
        onehot_grad = torch.where(valid, g_loss * (1.0 - label_smoothing), 0.0)
        dlogits.scatter_add_(1, torch.where(valid, target, 0).unsqueeze(1), -onehot_grad.unsqueeze(1))
        if label_smoothing:
            dlogits.sub_((torch.where(valid, g_loss, 0.0) * (label_smoothing / vocab)).unsqueeze(1))
        returned = grad_logits[rows] if grad_logits is not None else None
        chain_rule_(dlogits, slope, scale, returned, logits_transformed)
        if need_hidden:
            _hidden_grad_into(grad_hidden[rows], dlogits, weight)
        if grad_weight is not None:
            grad_weight.addmm_(dlogits.t(), hidden[rows].to(acc))
        if grad_bias is not None:
            grad_bias.add_(dlogits.sum(dim=0))
    return (
        grad_hidden,
        grad_weight.to(weight.dtype) if grad_weight is not None else weight.new_empty(0),
        grad_bias.to(bias.dtype) if grad_bias is not None and bias is not None else weight.new_empty(0),
    )


def chain_rule_(
    dlogits: torch.Tensor,
    slope: torch.Tensor | None,
    scale: float,
    grad_logits: torch.Tensor | None,
    logits_transformed: bool,
) -> torch.Tensor:
    """``dlogits`` ← the gradient w.r.t. the classifier's outputs x, in place, from the gradient w.r.t. the logits
    z = c·tanh(x·m/c): times 1 − tanh² (``slope`` holds tanh(x·m/c) and is overwritten) and times m. The gradient of
    returned logits joins before that chain rule where they are z (``logits_transformed``), after it where they
    are x."""
    if grad_logits is not None and logits_transformed:
        dlogits.add_(grad_logits)
    if slope is not None:
        dlogits.mul_(slope.mul_(slope).neg_().add_(1.0))  # 1 − tanh²
    if scale != 1.0:
        dlogits.mul_(scale)
    if grad_logits is not None and not logits_transformed:
        dlogits.add_(grad_logits)
    return dlogits


def _hidden_grad_into(out: torch.Tensor, dlogits: torch.Tensor, weight: torch.Tensor) -> None:
    """``out`` ← dlogits @ weight, with the logit gradient rounded to the classifier's dtype first (as eager's
    backward GEMM runs in it)."""
    if dlogits.dtype == weight.dtype == out.dtype:
        torch.mm(dlogits, weight, out=out)
    else:
        out.copy_(dlogits.to(weight.dtype) @ weight)


# The fewest vocabulary columns a tile of the column-wise passes takes before it gives up rows: the backward's
# hidden-state gradient GEMM runs over them.
MIN_TILE_COLUMNS = 1024


def _by_columns(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether both passes walk tiles of rows × vocabulary columns: fp32/fp64 inputs, where nothing is rounded
    between tiles. 16-bit inputs walk chunks of whole rows (one rounding per row, as eager's GEMMs)."""
    return hidden.dtype == weight.dtype == compute_dtype(hidden.dtype)


def tile_shape(n_rows: int, vocab: int, room: int, per_logit: int, per_row: int) -> tuple[int, int]:
    """(rows, columns) of a tile whose ``per_logit`` bytes per logit and ``per_row`` per row fit ``room``: all rows
    where MIN_TILE_COLUMNS columns of them fit, so that the GEMMs run over every row (the backward's classifier
    gradient with K = N, written once rather than accumulated chunk by chunk)."""
    columns = min(vocab, MIN_TILE_COLUMNS)
    rows = max(1, min(n_rows, room // (columns * per_logit + per_row)))
    return rows, max(1, min(vocab, (room - rows * per_row) // (rows * per_logit)))


def _backward_by_columns(
    hidden, weight, bias, targets, lse, grad_rows, grad_lse, ignore_index, label_smoothing, softcap, needs,
    grad_logits, scale, logits_transformed,
):
    """``backward`` for fp32/fp64 inputs over tiles of rows × vocabulary columns (the CUDA kernels' order).

    Row chunks of ~1/8 of the logits make the classifier gradient a sum of [V, rows] × [rows, D] products of
    small K, each reading and writing all of ∂C; a tile of every row and a slice of the vocabulary gives it one
    product with K = N per slice instead, and the hidden-state gradient a sum over slices (K = columns)."""
    (n_rows, dim), vocab = hidden.shape, weight.shape[0]
    need_hidden, need_weight, need_bias = needs
    acc = hidden.dtype
    grad_hidden = hidden.new_zeros(hidden.shape) if need_hidden else hidden.new_empty(0)
    grad_weight = weight.new_zeros(weight.shape) if need_weight else weight.new_empty(0)
    grad_bias = torch.zeros(vocab, dtype=acc, device=weight.device) if need_bias else None
    step_rows, step_cols = _tiles(
        n_rows, vocab, dim, acc, softcap=softcap is not None, bias=bias is not None, backward=True
    )
    buffer = _buffer(step_rows * step_cols, hidden, acc)
    slopes = _buffer(step_rows * step_cols, hidden, acc) if softcap is not None else None
    bias_dtype, bias = (bias.dtype, bias.to(acc)) if bias is not None else (None, None)
    for start in range(0, n_rows, step_rows):
        rows = slice(start, min(start + step_rows, n_rows))
        count = rows.stop - start
        target, row_lse = targets[rows], lse[rows].unsqueeze(1)
        valid = valid_rows(target, ignore_index)
        g_loss = torch.where(valid, grad_rows[rows].to(acc), 0.0)
        upstream = (grad_rows[rows].to(acc) + grad_lse[rows].to(acc)).unsqueeze(1)
        onehot_grad = g_loss * -(1.0 - label_smoothing)
        smoothing = (g_loss * (label_smoothing / vocab)).unsqueeze(1) if label_smoothing else None
        target_cols, by_column = _targets_by_column(target, valid, vocab)
        for first in range(0, vocab, step_cols):
            cols = slice(first, min(first + step_cols, vocab))
            width = cols.stop - first
            tile_bias = bias[cols] if bias is not None else None
            if slopes is None:
                dlogits = _chunk_logits(hidden[rows], weight[cols], tile_bias, _view(buffer, count, width))
                scale_and_cap_(dlogits, scale, None)
                slope = None
            else:  # tanh(x·m/c) kept for the chain rule; the capped logits c·tanh(x·m/c) go to the other buffer
                slope = _chunk_logits(hidden[rows], weight[cols], tile_bias, _view(slopes, count, width))
                scale_and_cap_(slope, scale, None).div_(softcap).tanh_()
                dlogits = torch.mul(slope, softcap, out=_view(buffer, count, width))
            dlogits.sub_(row_lse).exp_().mul_(upstream)  # probabilities × upstream gradient
            hits, local = _tile_targets(target_cols, by_column, cols)
            dlogits.index_put_((hits, local), onehot_grad[hits], accumulate=True)
            if smoothing is not None:
                dlogits.sub_(smoothing)
            returned = grad_logits[rows, cols] if grad_logits is not None else None
            chain_rule_(dlogits, slope, scale, returned, logits_transformed)
            if need_hidden:
                grad_hidden[rows].addmm_(dlogits, weight[cols])
            if need_weight:
                grad_weight[cols].addmm_(dlogits.t(), hidden[rows])
            if grad_bias is not None:
                grad_bias[cols].add_(dlogits.sum(dim=0))
    return grad_hidden, grad_weight, grad_bias.to(bias_dtype) if grad_bias is not None else weight.new_empty(0)


def _tiles(n_rows: int, vocab: int, dim: int, dtype: torch.dtype, *, softcap: bool, bias: bool, backward: bool):
    """(rows, columns) of the column-wise passes' tiles within ``chunk_budget``; a tile's row vectors and the index
    updates of its targets are charged at twice the row chunks' per-row allowance."""
    acc = compute_dtype(dtype).itemsize
    room = chunk_budget(n_rows, vocab, dim, dtype) - fixed_bytes(vocab, dtype, bias=bias, backward=backward)
    buffers = 2 if softcap and backward else 1
    return tile_shape(n_rows, vocab, room, buffers * acc, 2 * ROW_SCALARS * acc)


def _targets_by_column(targets: torch.Tensor, valid: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(target columns sorted, the rows in that order), ignored rows last (column V): each column tile then finds
    its rows' targets as one range, with temporaries that scale with them, not with the rows."""
    return torch.sort(torch.where(valid, targets, vocab))


def _tile_targets(target_cols: torch.Tensor, by_column: torch.Tensor, cols: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, their target's column within the tile) of the rows whose target lies in ``cols``."""
    low, high = torch.searchsorted(target_cols, target_cols.new_tensor([cols.start, cols.stop])).tolist()
    return by_column[low:high], target_cols[low:high] - cols.start


def _forward_by_columns(hidden, weight, bias, targets, ignore_index, label_smoothing, softcap, scale):
    """``forward`` for fp32/fp64 inputs over tiles of rows × vocabulary columns, with a running max and sum per row
    (the online log-sum-exp of flash attention, Milakov & Gimelshein 2018): the classifier GEMM runs over every row
    of a tile at once rather than over row chunks of ~1/8 of the logits."""
    (n_rows, dim), vocab = hidden.shape, weight.shape[0]
    acc = hidden.dtype
    losses, lse = hidden.new_empty(n_rows), hidden.new_empty(n_rows)
    step_rows, step_cols = _tiles(
        n_rows, vocab, dim, acc, softcap=softcap is not None, bias=bias is not None, backward=False
    )
    buffer = _buffer(step_rows * step_cols, hidden, acc)
    bias = bias.to(acc) if bias is not None else None
    for start in range(0, n_rows, step_rows):
        rows = slice(start, min(start + step_rows, n_rows))
        count = rows.stop - start
        valid = valid_rows(targets[rows], ignore_index)
        target_cols, by_column = _targets_by_column(targets[rows], valid, vocab)
        target_logit = hidden.new_zeros(count)
        logit_sum = hidden.new_zeros(count) if label_smoothing else None
        shift, total = hidden.new_zeros(count), hidden.new_zeros(count)  # Σ exp(z − shift) so far
        top = hidden.new_full((count,), float("-inf"))
        for first in range(0, vocab, step_cols):
            cols = slice(first, min(first + step_cols, vocab))
            tile_bias = bias[cols] if bias is not None else None
            z = _chunk_logits(hidden[rows], weight[cols], tile_bias, _view(buffer, count, cols.stop - first))
            scale_and_cap_(z, scale, softcap)
            hits, local = _tile_targets(target_cols, by_column, cols)
            target_logit[hits] = z[hits, local]
            if logit_sum is not None:
                logit_sum += z.sum(dim=1)
            torch.maximum(top, z.amax(dim=1), out=top)
            new_shift = top.masked_fill(top.abs() == float("inf"), 0.0)  # as row_terms_: an infinite max shifts by 0
            total.mul_((shift - new_shift).exp_()).add_(z.sub_(new_shift.unsqueeze(1)).exp_().sum(dim=1))
            shift = new_shift
        lse[rows] = total.log().add_(shift)
        loss = (1.0 - label_smoothing) * (lse[rows] - target_logit)
        if logit_sum is not None:
            loss = loss + label_smoothing * (lse[rows] - logit_sum / vocab)
        losses[rows] = torch.where(valid, loss, 0.0)
    return losses, lse
