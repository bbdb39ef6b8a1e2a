"""Attention in PyTorch, one block of queries at a time: the CPU path of ``memopt::flash_attention`` and its oracle.

softmax(softcap(q kᵀ·scale) + bias, causal mask, sliding window) (dropout) v, with grouped-query heads (query
head h reads key/value head h // (Hq / Hk)). ``softcap`` c turns a score s into c·tanh(s/c) before the bias and the
mask (Gemma 2's ``attn_logit_softcapping``); ``window`` w hides key j from query i unless i − w < j ≤ i. A block's
scores become its probabilities (and in the backward its score gradients) in place, and its temporaries stay
within ``block_budget`` bytes: 1/``FRACTION`` of the B·H·Tq·Tk scores it replaces, at least one query row, at most
``BLOCK_BYTES``. That budget is what the rewrite's memory model charges
(``lowerings.flash_attention.op.working_set``), so CPU and GPU runs of a model take the same decisions. The
backward recomputes the probabilities from the saved log-sum-exp, as the flash-attention kernels do (Dao 2023).
Query heads that share a key/value head are stacked as rows of one product, so k and v are never repeated; a
causal block only reads the keys its last query sees, and with a window only those from its first query's window
on: O(T·w) work, and no T×T mask anywhere. With a softcap the backward needs tanh's slope 1 − tanh²; it
recomputes the block's products for it once dS is formed (one more product a block, no more memory).

Dropout draws the mask of each batch entry's tile of MASK_ROWS query rows from a torch generator seeded by
``seed``, the entry and the tile, so the mask does not depend on how the rows are blocked, and the backward
regenerates exactly the forward's mask.
(The CUDA kernels draw theirs with Triton's Philox instead; the two devices' masks differ, each is consistent
with itself.)
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

# A block's temporaries stay within 1/FRACTION of the scores [B, H, Tq, Tk] (in the input dtype) and under
# BLOCK_BYTES; a block is at least one query row whatever that costs.
FRACTION = 8
BLOCK_BYTES = 32 << 20
MIN_BLOCK_BYTES = 2 << 20
# Query rows per block: enough for efficient products, few enough for the block to stay in cache; a budget that
# holds more takes more batch entries per block, one that holds fewer takes fewer rows.
BLOCK_ROWS = 64
# Dropout masks are drawn in tiles of this many query rows of one batch entry.
MASK_ROWS = 16
# Per query row and head: running max, Σexp, log-sum-exp, rowsum(dO ∘ O), in the compute dtype.
ROW_SCALARS = 4


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def row_bytes(batch, heads, keys, dim, dtype: torch.dtype, *, backward: bool, dropout: bool, causal: bool):
    """Bytes one query row of a block holds, over all batches and heads: its scores (the backward adds their
    gradient), its dropout mask, the row's q and output (backward: q, dO, dQ and dO ∘ O) in the compute dtype, and
    the causal mask's row."""
    acc = compute_dtype(dtype).itemsize
    per_key = (2 if backward else 1) * acc + (1 if dropout else 0)
    per_dim = (4 if backward else 2) * acc
    return batch * heads * (keys * per_key + dim * per_dim + ROW_SCALARS * acc) + (keys if causal else 0)


def fixed_bytes(batch, heads, keys, dtype: torch.dtype, *, dropout: bool, bias_cast: bool):
    """Bytes a pass holds whatever the block size: one tile of uniforms for the dropout mask (MASK_ROWS rows of one
    batch entry), one row of a bias that is added in another dtype."""
    acc = compute_dtype(dtype).itemsize
    uniforms = MASK_ROWS * heads * keys * 4 if dropout else 0
    return uniforms + (batch * heads * keys * acc if bias_cast else 0)


def block_budget(batch, heads, queries, keys, dim, dtype: torch.dtype):
    """Bytes of temporaries a block may hold: 1/FRACTION of the scores, capped at BLOCK_BYTES, never less than one
    query row of the costliest pass (backward with dropout, causal mask and a cast bias). Small problems get up to
    MIN_BLOCK_BYTES (at most half their scores): below that, the per-call cost of many tiny products outweighs the
    work. SymInt sizes give a symbolic budget."""
    floor = row_bytes(batch, heads, keys, dim, dtype, backward=True, dropout=True, causal=True) + fixed_bytes(
        batch, heads, keys, dtype, dropout=True, bias_cast=True
    )
    scores = batch * heads * queries * keys * dtype.itemsize
    share = torch.sym_max(scores // FRACTION, torch.sym_min(MIN_BLOCK_BYTES, scores // 2))
    return torch.sym_max(floor, torch.sym_min(share, BLOCK_BYTES))


def block_shape(
    q: torch.Tensor, k: torch.Tensor, bias, *, backward: bool, dropout: bool, causal: bool
) -> tuple[int, int]:
    """(batch entries, query rows) per block so that the pass's temporaries fit ``block_budget``.

    Blocks of BLOCK_ROWS queries (fewer where the budget cannot hold one entry's), as many batch entries as fit.
    Measured on 2 CPU cores, causal forward + backward: [16, 12, 256, 64] in 78–81 ms with 64-row blocks of 2–5
    entries, 133 ms with 10-row blocks of all 16 (compiled eager attention: 113–119 ms); [2, 12, 256, 64]'s
    forward in 3.4–4.1 ms with 64-row blocks, 4.6–5.4 ms with 111-row ones."""
    batch, heads, queries, dim = q.shape
    keys = k.shape[-2]
    bias_cast = bias is not None and bias.dtype != compute_dtype(q.dtype)
    room = block_budget(batch, heads, queries, keys, dim, q.dtype) - fixed_bytes(
        batch, heads, keys, q.dtype, dropout=dropout, bias_cast=bias_cast
    )
    shared = row_bytes(0, heads, keys, dim, q.dtype, backward=backward, dropout=dropout, causal=causal)  # mask row
    per_entry = row_bytes(1, heads, keys, dim, q.dtype, backward=backward, dropout=dropout, causal=causal) - shared
    rows = min(queries, BLOCK_ROWS)
    entries = max(1, min(batch, (room // rows - shared) // per_entry))
    rows = max(1, min(rows, room // (per_entry * entries + shared)))
    if dropout and MASK_ROWS <= rows < queries:  # blocks start on mask tiles, so no tile is drawn twice
        rows -= rows % MASK_ROWS
    return entries, rows


def _blocks(
    batch: int, queries: int, keys: int, shape: tuple[int, int], causal: bool, window: int | None = None
) -> Iterator[tuple[slice, slice, slice]]:
    """(batch entries, query rows, keys they read) per block."""
    entries, step = shape
    for first in range(0, batch, entries):
        batches = slice(first, min(first + entries, batch))
        for start in range(0, queries, step):
            stop = min(start + step, queries)
            yield batches, slice(start, stop), key_span(start, stop, keys, causal, window)


def key_span(start: int, stop: int, keys: int, causal: bool, window: int | None) -> slice:
    """The keys query rows [start, stop) can see: none after the last query (causal), none at or before the first
    query's i − w (a window). Never empty, so that a block of rows that see no key still gets its -inf lse."""
    last = min(keys, stop) if causal else keys
    first = max(0, start - window + 1) if window is not None else 0
    return slice(min(first, max(last - 1, 0)), last)


def _take(buffer: torch.Tensor, *shape: int) -> torch.Tensor:
    """A contiguous view of the first elements of a flat buffer."""
    return buffer[: torch.Size(shape).numel()].view(shape)


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, Hq, rows, n] (contiguous) as [B, Hk, G·rows, n]: the query heads sharing a key/value head stacked."""
    b, heads, rows, n = x.shape
    return x.view(b, kv_heads, heads // kv_heads * rows, n)


def _bmm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``out[i] = a[i] @ b[i]`` over the batch, whatever b's strides (a batched matmul would copy them)."""
    for i in range(out.shape[0]):
        torch.bmm(a[i], b[i], out=out[i])
    return out


def _baddbmm_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> None:
    """``acc[i] += alpha · a[i] @ b[i]`` in place over the batch."""
    for i in range(acc.shape[0]):
        acc[i].baddbmm_(a[i], b[i], alpha=alpha)


def _scores_into(
    s, q_rows, k, bias, scale: float, causal: bool, rows: slice, keys: slice, softcap: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """``s`` [b, Hq, rows, keys] ← softcap(q kᵀ·scale) (+ bias), with the pairs outside the causal band and the window
    masked; ``k`` and ``bias`` are the block's batch entries, ``keys`` the span of keys the block reads."""
    kv_heads = k.shape[1]
    _bmm_into(_grouped(s, kv_heads), _grouped(q_rows, kv_heads), k[:, :, keys].transpose(-2, -1))
    s.mul_(scale)
    if softcap is not None:
        s.div_(softcap).tanh_().mul_(softcap)
    if bias is not None:
        _add_bias_(s, bias[:, :, rows, keys])
    if causal or window is not None:
        s.masked_fill_(_hidden(rows, keys, causal, window, s.device), float("-inf"))
    return s


def _hidden(rows: slice, keys: slice, causal: bool, window: int | None, device) -> torch.Tensor:
    """[rows, keys] boolean, True where key j is hidden from query i: j > i (causal), j ≤ i − w (window). One
    boolean tensor, banded in place: the (row, col) entry is the pair j − i = col − row − (rows.start − keys.start)."""
    band = torch.ones(rows.stop - rows.start, keys.stop - keys.start, dtype=torch.bool, device=device)
    shift = rows.start - keys.start
    if causal:
        band.tril_(shift)
    if window is not None:
        band.triu_(shift - window + 1)
    return band.logical_not_()


def _softcap_slope_(s, q_rows, k, scale: float, softcap: float, keys: slice) -> torch.Tensor:
    """``s`` ← 1 − tanh²(q kᵀ·scale / c), the derivative of c·tanh(x/c) at the block's scores, recomputed."""
    kv_heads = k.shape[1]
    _bmm_into(_grouped(s, kv_heads), _grouped(q_rows, kv_heads), k[:, :, keys].transpose(-2, -1))
    t = s.mul_(scale / softcap).tanh_()
    return t.mul_(t).neg_().add_(1.0)


def _add_bias_(s: torch.Tensor, bias: torch.Tensor) -> None:
    """s += bias; a bias in another dtype row by row, since an in-place add copies its cast operand whole."""
    if bias.dtype == s.dtype:
        s.add_(bias)
        return
    for row in range(s.shape[-2]):
        s[:, :, row].add_(bias[:, :, row])


def _softmax_(s: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension in place; returns the log-sum-exp. A row without any key gives 0 and -inf."""
    top = s.amax(dim=-1, keepdim=True)
    top.masked_fill_(top.abs() == float("inf"), 0.0)
    total = s.sub_(top).exp_().sum(dim=-1, keepdim=True)
    s.div_(total).nan_to_num_(0.0)
    return total.log_().add_(top).squeeze(-1)


def _drop_mask(seed: int, first_entry: int, first_row: int, shape, dropout_p: float, device, queries: int, out=None):
    """Drop mask [b, H, rows, Tk] (True where a probability is dropped) of batch entries and query rows from
    ``first_entry`` and ``first_row`` on, of a problem of ``queries`` rows.

    Each batch entry's rows are drawn in tiles of MASK_ROWS, a tile from a generator seeded by (seed, entry,
    tile), always whole, so that any blocking draws the same mask (a block cut inside a tile draws it again)."""
    b, h, rows, keys = shape
    mask = torch.empty(shape, dtype=torch.bool) if out is None else out
    for entry in range(b):
        row = first_row
        while row < first_row + rows:
            tile, start = divmod(row, MASK_ROWS)
            tile_rows = min(MASK_ROWS, queries - row + start)
            stream = ((seed * 1_000_003 + first_entry + entry) * 1_000_033 + tile) % (1 << 64)
            uniforms = torch.rand((h, tile_rows, keys), generator=torch.Generator().manual_seed(stream))
            stop = min(tile_rows, first_row + rows - row + start)
            offset = row - first_row
            torch.lt(uniforms[:, start:stop], dropout_p, out=mask[entry, :, offset : offset + stop - start])
            del uniforms  # before the next tile's are drawn: one tile at a time
            row += stop - start
    return mask.to(device)


def _keep_mask(seed: int, first_entry: int, first_row: int, shape, dropout_p: float, device, queries: int):
    """The complement of ``_drop_mask``: True where a probability is kept."""
    return ~_drop_mask(seed, first_entry, first_row, shape, dropout_p, device, queries)


def _as_compute(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the compute dtype (itself when it already is: no copy)."""
    return t.to(compute_dtype(t.dtype))


def _full_bias(bias, q, k):
    """The bias as a [B, Hq, Tq, Tk] view (broadcast dimensions keep stride 0; nothing is copied)."""
    return bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2]) if bias is not None else None


def forward(
    q, k, v, bias, scale: float, causal: bool, dropout_p: float, seed: int, softcap: float | None = None,
    window: int | None = None,
):
    """(out [B, Hq, Tq, D] in q's dtype, lse [B, Hq, Tq] in the compute dtype); fully masked rows give 0, -inf."""
    acc = compute_dtype(q.dtype)
    batch, heads, queries, dim = q.shape
    keys = k.shape[2]
    k, v, bias = _as_compute(k), _as_compute(v), _full_bias(bias, q, k)
    out = q.new_empty(q.shape)  # contiguous, as the kernels return it, whatever q's layout
    lse = q.new_empty(q.shape[:-1], dtype=acc)
    shape = block_shape(q, k, bias, backward=False, dropout=dropout_p > 0, causal=causal or window is not None)
    size = shape[0] * heads * shape[1]
    scores = q.new_empty(size * keys, dtype=acc)
    q_rows, out_rows = (q.new_empty(size * dim, dtype=acc) for _ in range(2))
    drop = q.new_empty(size * keys, dtype=torch.bool) if dropout_p > 0 else None
    for entries, rows, seen in _blocks(batch, queries, keys, shape, causal, window):
        count, n, width = rows.stop - rows.start, entries.stop - entries.start, seen.stop - seen.start
        q_block = _take(q_rows, n, heads, count, dim).copy_(q[entries, :, rows])
        block_bias = bias[entries] if bias is not None else None
        probs = _scores_into(
            _take(scores, n, heads, count, width), q_block, k[entries], block_bias, scale, causal, rows, seen,
            softcap, window,
        )
        lse[entries, :, rows] = _softmax_(probs)
        if drop is not None:  # masked_fill_, as an in-place product with a boolean mask would copy it cast
            mask = _drop_mask(seed, entries.start, rows.start, (n, heads, count, keys), dropout_p, q.device,
                              queries, _take(drop, n, heads, count, keys))
            probs.masked_fill_(mask[..., seen], 0.0).div_(1 - dropout_p)
        o = _take(out_rows, n, heads, count, dim)
        _bmm_into(_grouped(o, k.shape[1]), _grouped(probs, k.shape[1]), v[entries, :, seen])
        out[entries, :, rows] = o
    return out, lse


def backward(
    q, k, v, bias, out, lse, grad_out, scale: float, causal: bool, dropout_p: float, seed: int, bias_grad: bool = False,
    softcap: float | None = None, window: int | None = None,
):
    """(dq, dk, dv, dbias): dS = P ∘ (dP − rowsum(dO ∘ O)), recomputing P from the log-sum-exp block by block; with
    a softcap, dS times tanh's slope reaches q and k.

    dbias (with ``bias_grad``) is dS itself (the bias is added after the softcap), a full [B, Hq, Tq, Tk] in the
    compute dtype; else None."""
    acc = compute_dtype(q.dtype)
    batch, heads, queries, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    k_acc, v_acc, bias = _as_compute(k), _as_compute(v), _full_bias(bias, q, k)
    dq = q.new_empty(q.shape)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    dbias = q.new_zeros((batch, heads, queries, keys), dtype=acc) if bias_grad else None
    shape = block_shape(q, k, bias, backward=True, dropout=dropout_p > 0, causal=causal or window is not None)
    size = shape[0] * heads * shape[1]
    probs_buffer, grads_buffer = (q.new_empty(size * keys, dtype=acc) for _ in range(2))
    q_rows, do_rows, dq_rows = (q.new_empty(size * dim, dtype=acc) for _ in range(3))
    drop = q.new_empty(size * keys, dtype=torch.bool) if dropout_p > 0 else None
    for entries, rows, seen in _blocks(batch, queries, keys, shape, causal, window):
        count, n, width = rows.stop - rows.start, entries.stop - entries.start, seen.stop - seen.start
        q_block = _take(q_rows, n, heads, count, dim).copy_(q[entries, :, rows])
        do_block = _take(do_rows, n, heads, count, dim).copy_(grad_out[entries, :, rows])
        dq_block = _take(dq_rows, n, heads, count, dim)
        delta = torch.mul(do_block, out[entries, :, rows].to(acc), out=dq_block).sum(-1, keepdim=True)
        block_k, block_v = k_acc[entries], v_acc[entries]
        block_bias = bias[entries] if bias is not None else None
        probs = _scores_into(
            _take(probs_buffer, n, heads, count, width), q_block, block_k, block_bias, scale, causal, rows, seen,
            softcap, window,
        )
        probs.sub_(lse[entries, :, rows].unsqueeze(-1)).exp_().nan_to_num_(0.0)
        grads = _take(grads_buffer, n, heads, count, width)
        mask = None
        if drop is not None:
            mask = _drop_mask(seed, entries.start, rows.start, (n, heads, count, keys), dropout_p, q.device,
                              queries, _take(drop, n, heads, count, keys))[..., seen]
            dropped = grads.copy_(probs).masked_fill_(mask, 0.0).div_(1 - dropout_p)
        else:
            dropped = probs
        block_dk, block_dv = dk[entries, :, seen], dv[entries, :, seen]
        _baddbmm_(block_dv, _grouped(dropped, kv_heads).transpose(-2, -1), _grouped(do_block, kv_heads))
        _bmm_into(_grouped(grads, kv_heads), _grouped(do_block, kv_heads), block_v[:, :, seen].transpose(-2, -1))
        if mask is not None:
            grads.masked_fill_(mask, 0.0).div_(1 - dropout_p)
        grads.sub_(delta).mul_(probs)  # dS
        if dbias is not None:
            dbias[entries, :, rows, seen] = grads
        if softcap is not None:  # the probabilities are spent: their buffer takes tanh's slope
            grads.mul_(_softcap_slope_(probs, q_block, block_k, scale, softcap, seen))
        _bmm_into(_grouped(dq_block, kv_heads), _grouped(grads, kv_heads), block_k[:, :, seen])
        dq[entries, :, rows] = dq_block.mul_(scale)
        _baddbmm_(block_dk, _grouped(grads, kv_heads).transpose(-2, -1), _grouped(q_block, kv_heads), scale)
    return dq, dk.to(k.dtype), dv.to(v.dtype), dbias
