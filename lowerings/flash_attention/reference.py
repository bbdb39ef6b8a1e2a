"""Attention in PyTorch, one block of queries at a time: the CPU path of ``memopt::flash_attention`` and its oracle.

softmax(q kᵀ·scale + bias, causal mask) (dropout) v, with grouped-query heads (query head h reads key/value head
h // (Hq / Hk)). Peak extra memory is one block of scores, [B, Hq, block, Tk], not Tq × Tk; the backward
recomputes the probabilities from the saved log-sum-exp, as the flash-attention kernels do (Dao 2023).

Dropout draws its keep mask from a torch generator seeded by ``seed`` and the query block, so that the
backward regenerates exactly the forward's mask. (The CUDA kernels draw theirs with Triton's Philox instead;
the two devices' masks differ, each is consistent with itself.)
"""

from __future__ import annotations

import torch

# Scores of one query block (fp32) stay under this many bytes; the block is at least one query.
BLOCK_BYTES = 32 << 20


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _block_rows(batch: int, heads: int, keys: int) -> int:
    return max(1, BLOCK_BYTES // (4 * max(1, batch * heads * keys)))


def _expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads repeated for the query heads that share them (a view when possible)."""
    groups = heads // t.shape[1]
    if groups == 1:
        return t
    b, hk, tk, d = t.shape
    return t[:, :, None].expand(b, hk, groups, tk, d).reshape(b, heads, tk, d)


def _fold_kv(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Sum the gradients of query heads that share a key/value head."""
    b, h, tk, d = grad.shape
    return grad.view(b, kv_heads, h // kv_heads, tk, d).sum(2)


def _scores(q_block, k, bias_block, scale, causal, first_row, acc):
    scores = (q_block.to(acc) @ k.to(acc).transpose(-2, -1)) * scale
    if bias_block is not None:
        scores = scores + bias_block.to(acc)
    if causal:
        rows = torch.arange(first_row, first_row + q_block.shape[-2], device=q_block.device)[:, None]
        cols = torch.arange(k.shape[-2], device=q_block.device)[None, :]
        scores = scores.masked_fill(cols > rows, float("-inf"))
    return scores


def _keep_mask(seed: int, block: int, shape, dropout_p: float, device) -> torch.Tensor:
    generator = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + block)
    return (torch.rand(shape, generator=generator) >= dropout_p).to(device)


def _blocks(q, k, bias):
    """(block index, row slice, bias slice) over query blocks."""
    b, h, tq, _ = q.shape
    step = _block_rows(b, h, k.shape[-2])
    for index, start in enumerate(range(0, tq, step)):
        rows = slice(start, min(start + step, tq))
        yield index, rows, (bias[:, :, rows] if bias is not None else None)


def forward(q, k, v, bias, scale: float, causal: bool, dropout_p: float, seed: int):
    """(out [B, Hq, Tq, D] in q's dtype, lse [B, Hq, Tq] in the compute dtype); fully masked rows give 0, -inf."""
    acc = compute_dtype(q.dtype)
    heads = q.shape[1]
    k_all, v_all = _expand_kv(k, heads), _expand_kv(v, heads)
    bias = bias.expand(q.shape[0], heads, q.shape[2], k.shape[2]) if bias is not None else None
    out = q.new_empty(q.shape)  # contiguous, as the kernels return it, whatever q's layout
    lse = q.new_empty(q.shape[:-1], dtype=acc)
    for index, rows, bias_block in _blocks(q, k, bias):
        scores = _scores(q[:, :, rows], k_all, bias_block, scale, causal, rows.start, acc)
        block_lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - block_lse.unsqueeze(-1)).nan_to_num(0.0)  # -inf rows: exp(nan) → 0
        if dropout_p > 0:
            probs = probs * _keep_mask(seed, index, probs.shape, dropout_p, q.device).to(acc) / (1 - dropout_p)
        out[:, :, rows] = (probs @ v_all.to(acc)).to(q.dtype)
        lse[:, :, rows] = block_lse
    return out, lse


def backward(
    q, k, v, bias, out, lse, grad_out, scale: float, causal: bool, dropout_p: float, seed: int, bias_grad: bool = False
):
    """(dq, dk, dv, dbias): dS = P ∘ (dP − rowsum(dO ∘ O)), recomputing P from the log-sum-exp block by block.

    dbias (with ``bias_grad``) is dS itself, a full [B, Hq, Tq, Tk] in the compute dtype; else None."""
    acc = compute_dtype(q.dtype)
    heads, kv_heads = q.shape[1], k.shape[1]
    k_all, v_all = _expand_kv(k, heads).to(acc), _expand_kv(v, heads).to(acc)
    bias = bias.expand(q.shape[0], heads, q.shape[2], k.shape[2]) if bias is not None else None
    delta = (grad_out.to(acc) * out.to(acc)).sum(-1)
    dq = q.new_empty(q.shape)
    dk_all = torch.zeros_like(k_all)
    dv_all = torch.zeros_like(v_all)
    dbias = q.new_empty((q.shape[0], heads, q.shape[2], k.shape[2]), dtype=acc) if bias_grad else None
    for index, rows, bias_block in _blocks(q, k, bias):
        q_block, do_block = q[:, :, rows].to(acc), grad_out[:, :, rows].to(acc)
        scores = _scores(q_block, k_all, bias_block, scale, causal, rows.start, acc)
        probs = torch.exp(scores - lse[:, :, rows].unsqueeze(-1)).nan_to_num(0.0)
        grad_probs = do_block @ v_all.transpose(-2, -1)
        dropped = probs
        if dropout_p > 0:
            keep = _keep_mask(seed, index, probs.shape, dropout_p, q.device).to(acc) / (1 - dropout_p)
            dropped = probs * keep
            grad_probs = grad_probs * keep
        dv_all += dropped.transpose(-2, -1) @ do_block
        grad_scores = probs * (grad_probs - delta[:, :, rows].unsqueeze(-1))
        if dbias is not None:
            dbias[:, :, rows] = grad_scores
        dq[:, :, rows] = (grad_scores @ k_all * scale).to(q.dtype)
        dk_all += grad_scores.transpose(-2, -1) @ q_block * scale
    dk, dv = _fold_kv(dk_all, kv_heads).to(k.dtype), _fold_kv(dv_all, kv_heads).to(v.dtype)
    return dq, dk.contiguous(), dv.contiguous(), dbias
