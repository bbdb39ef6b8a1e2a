"""``torch.ops.memopt.flash_attention_uniform_rows``: eager attention at the rows whose every score a finite fill
absorbed, with eager's gradients through a softcap.

    out = torch.ops.memopt.flash_attention_uniform_rows(q, k, v, rows, scale, softcap)

Why an op: transformers' eager masks add finfo.min to hidden scores. A query row that sees no key at all (left
padding, a sequence of padding, right padding past a sliding window) then has all its scores equal to finfo.min
in floating point, so eager's softmax is uniform over all Tk keys: the row's output is the mean of v. Autograd still
differentiates the addition, so softmax's gradient at P = 1/Tk reaches every score, dS_ij = dO_i·(v_j − v̄)/Tk, and
through the softcap c·tanh(x/c) each score's slope 1 − tanh²(x_ij/c) weighs it on its way to q_i and k_j. Without
a softcap the rewrite reproduces that gradient in the graph with a D×D product (``fxpass.rules.attention``); with
one, the slope differs per (i, j), so the gradient needs the scores of those rows again, which this op recomputes
in its backward, a chunk of rows at a time.

``rows`` is a boolean broadcastable to [B, 1, Tq, 1] (True: the row saw no key). The output is [B, Hq, Tq, D] in
v's dtype: the mean of v at those rows, 0 elsewhere, and rows not flagged get no gradient from it. Grouped-query
heads read their key/value head (query head h reads h // (Hq / Hk)), as ``memopt.flash_attention`` does.

Cost: the forward is O(B·H·T·D). The backward finds the flagged rows (a device synchronization) and spends
O(rows flagged · Tk · D) on them, with at most CHUNK_BYTES of scores at a time, on any device.
"""

from __future__ import annotations

import torch

from lowerings._library import reference_op, workspace
from lowerings.flash_attention.reference import compute_dtype

# Scores, their slope and their gradient for one chunk of flagged rows stay within this many bytes.
CHUNK_BYTES = 32 << 20


def backward_bytes(heads, queries, keys):
    """Bytes of scores the backward holds at most: three fp32 [Hq, rows, Tk] for one chunk of rows, within
    CHUNK_BYTES (for the rewrite's memory model; sizes may be SymInts)."""
    return torch.sym_min(CHUNK_BYTES, 3 * heads * queries * keys * 4)


def _groups(q: torch.Tensor, k: torch.Tensor) -> int:
    return q.shape[1] // k.shape[1]


def _flags(rows: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The flags as a [B, 1, Tq, 1] boolean view."""
    return rows.expand(q.shape[0], 1, q.shape[2], 1)


@workspace("flash_attention_uniform_rows_backward")
def backward_workspace(device_type: str, q, k, *_, **__):
    """Those rows' scores through the softcap, a chunk at a time (``backward_bytes``), on every device."""
    return backward_bytes(q.shape[1], q.shape[2], k.shape[2])


@reference_op("flash_attention_uniform_rows")
def uniform_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, scale: float, softcap: float | None
) -> torch.Tensor:
    torch._check(rows.dtype == torch.bool, lambda: "memopt.flash_attention_uniform_rows: rows must be boolean")
    mean = v.to(compute_dtype(v.dtype)).mean(dim=2, keepdim=True).repeat_interleave(_groups(q, k), dim=1)
    return torch.where(_flags(rows, q), mean, 0.0).to(v.dtype).expand(*q.shape[:3], v.shape[-1]).contiguous()


@uniform_rows.register_fake
def _(q, k, v, rows, scale, softcap):
    return v.new_empty((*q.shape[:3], v.shape[-1]))


@reference_op("flash_attention_uniform_rows_backward")
def uniform_rows_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, grad_out: torch.Tensor, scale: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of eager's uniform rows: softmax's backward at P = 1/Tk, each score's gradient times its
    softcap slope before it reaches q and k (Gemma 2's eager attention, differentiated)."""
    acc = compute_dtype(q.dtype)
    batch, heads = q.shape[:2]
    kv_heads, keys = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    flags = _flags(rows, q)
    grad = torch.where(flags, grad_out.to(acc), 0.0)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    # dV_j = Σ_i P_ij dO_i = Σ_i dO_i / Tk over the flagged rows of every query head of the group
    dv = (grad.sum(dim=2, keepdim=True) / keys).view(batch, kv_heads, groups, 1, -1).sum(2).expand(v.shape).contiguous()
    chunk = max(1, CHUNK_BYTES // (3 * heads * keys * acc.itemsize))
    for b, positions in _flagged_rows(flags):
        k_b, v_b = k[b].to(acc), v[b].to(acc)  # [Hk, Tk, D]
        mean = v_b.mean(dim=1, keepdim=True)
        for index in positions.to(q.device).split(chunk):
            q_rows = q[b][:, index].to(acc).reshape(kv_heads, groups * len(index), -1)  # [Hk, G·n, D]
            do_rows = grad[b][:, index].reshape(kv_heads, groups * len(index), -1)
            ds = (do_rows @ v_b.transpose(-2, -1)).sub_(do_rows @ mean.transpose(-2, -1)).div_(keys)  # dS'
            if softcap is not None:
                slope = torch.bmm(q_rows, k_b.transpose(-2, -1)).mul_(scale / softcap).tanh_()
                ds.mul_(slope.mul_(slope).neg_().add_(1.0))
            dq[b][:, index] = (ds @ k_b).mul_(scale).view(heads, len(index), -1)
            dk[b] += (ds.transpose(-2, -1) @ q_rows).mul_(scale)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _flagged_rows(flags: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(batch entry, its flagged query positions) for the entries with any: one device synchronization."""
    found = flags[:, 0, :, 0].nonzero().cpu()
    entries = found[:, 0].unique_consecutive(return_counts=True)
    return list(zip(entries[0].tolist(), found[:, 1].split(entries[1].tolist()), strict=True))


@uniform_rows_backward.register_fake
def _(q, k, v, rows, grad_out, scale, softcap):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, rows, scale, softcap = inputs
    ctx.save_for_backward(q, k, v, rows)
    ctx.options = (scale, softcap)


def _backward(ctx, grad_out):
    q, k, v, rows = ctx.saved_tensors
    dq, dk, dv = torch.ops.memopt.flash_attention_uniform_rows_backward(q, k, v, rows, grad_out, *ctx.options)
    return dq, dk, dv, None, None, None


uniform_rows.register_autograd(_backward, setup_context=_setup_context)
