"""Chunked PyTorch implementation of linear + cross-entropy: the CPU path of ``memopt::cce`` and the test oracle.

It never holds more than one chunk of logits: rows are processed ``chunk_rows`` at a time, so peak extra
memory is ``chunk_rows × V`` floats however many tokens there are. Forward returns the per-row loss terms
and the log-sum-exp; backward recomputes each chunk's logits from the hidden states and the classifier
(Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary Language Models").

Math, for one row with logits z (after the optional softcap z = c·tanh(x/c)), target t, smoothing ε:
    lse  = log Σ_j exp z_j
    loss = (1 − ε)(lse − z_t) + ε(lse − mean_j z_j)          (ε = 0: plain cross-entropy)
    ∂loss/∂z_j = softmax(z)_j − (1 − ε)·[j = t] − ε/V,       ∂lse/∂z_j = softmax(z)_j
"""

from __future__ import annotations

import torch

# Logits of one chunk (fp32) stay under this many bytes; the chunk is at least one row.
CHUNK_BYTES = 32 << 20


def chunk_rows(vocab: int) -> int:
    """Rows of logits one chunk may hold so that its fp32 logits stay within ``CHUNK_BYTES``."""
    return max(1, CHUNK_BYTES // (4 * max(vocab, 1)))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics and accumulators are fp32, or fp64 for fp64 inputs (the test oracle's precision)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits of one chunk in the compute dtype, with tanh(x/c) kept for the softcap's chain rule."""
    acc = compute_dtype(hidden.dtype)
    logits = (hidden @ weight.t()).to(acc)
    if bias is not None:
        logits = logits + bias.to(acc)
    if softcap is None:
        return logits, None
    capped = torch.tanh(logits / softcap)
    return capped * softcap, capped


def valid_rows(targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return targets != ignore_index


def check_targets(targets: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Raise like PyTorch's cross-entropy on a class index outside [0, V) that is not ignored."""
    bad = valid_rows(targets, ignore_index) & ((targets < 0) | (targets >= vocab))
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss (0 on ignored rows) and per-row log-sum-exp, both [N] in the compute dtype."""
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    check_targets(targets, vocab, ignore_index)
    losses = hidden.new_empty(n_rows, dtype=compute_dtype(hidden.dtype))
    lse = torch.empty_like(losses)
    step = chunk_rows(vocab)
    for start in range(0, n_rows, step):
        rows = slice(start, min(start + step, n_rows))
        logits, _ = _chunk_logits(hidden[rows], weight, bias, softcap)
        chunk_lse = torch.logsumexp(logits, dim=-1)
        target = targets[rows]
        valid = valid_rows(target, ignore_index)
        target_logit = logits.gather(1, torch.where(valid, target, 0).unsqueeze(1)).squeeze(1)
        loss = (1.0 - label_smoothing) * (chunk_lse - target_logit)
        if label_smoothing:
            loss = loss + label_smoothing * (chunk_lse - logits.mean(dim=-1))
        losses[rows] = torch.where(valid, loss, 0.0)
        lse[rows] = chunk_lse
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of Σ grad_rows·loss_rows + Σ grad_lse·lse w.r.t. hidden, weight and bias.

    ``grad_rows`` is the upstream gradient of each row's loss (already scaled by the reduction and zero
    on ignored rows). Weight and bias gradients accumulate in the compute dtype (fp32 for 16-bit inputs).
    An input whose entry in ``needs`` is False gets an empty gradient.
    """
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    need_hidden, need_weight, need_bias = needs
    grad_hidden = torch.empty_like(hidden) if need_hidden else hidden.new_empty(0)
    acc = compute_dtype(hidden.dtype)
    grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_weight else None
    grad_bias = torch.zeros(vocab, dtype=acc, device=weight.device) if need_bias else None
    step = chunk_rows(vocab)
    for start in range(0, n_rows, step):
        rows = slice(start, min(start + step, n_rows))
        logits, capped = _chunk_logits(hidden[rows], weight, bias, softcap)
        probs = torch.exp(logits - lse[rows].unsqueeze(1))
        g_loss, g_lse = grad_rows[rows].to(acc), grad_lse[rows].to(acc)
        dlogits = probs * (g_loss + g_lse).unsqueeze(1)
        target = targets[rows]
        valid = valid_rows(target, ignore_index)
        onehot_grad = torch.where(valid, g_loss * (1.0 - label_smoothing), 0.0)
        dlogits.scatter_add_(1, torch.where(valid, target, 0).unsqueeze(1), -onehot_grad.unsqueeze(1))
        if label_smoothing:
            dlogits -= (torch.where(valid, g_loss, 0.0) * (label_smoothing / vocab)).unsqueeze(1)
        if capped is not None:
            dlogits *= 1.0 - capped * capped
        if need_hidden:
            grad_hidden[rows] = (dlogits.to(weight.dtype) @ weight).to(hidden.dtype)
        if grad_weight is not None:
            grad_weight += dlogits.t() @ hidden[rows].to(acc)
        if grad_bias is not None:
            grad_bias += dlogits.sum(dim=0)
    return (
        grad_hidden,
        grad_weight.to(weight.dtype) if grad_weight is not None else weight.new_empty(0),
        grad_bias.to(bias.dtype) if grad_bias is not None and bias is not None else weight.new_empty(0),
    )
