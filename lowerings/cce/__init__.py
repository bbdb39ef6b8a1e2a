"""Cut cross-entropy: ``linear`` + ``cross_entropy`` without the N×V logits."""

from __future__ import annotations

import torch

from lowerings.cce import op as _op  # noqa: F401  (registers torch.ops.memopt.cce*)
from lowerings.cce import rowwise as _rowwise  # noqa: F401  (registers torch.ops.memopt.cce_rowwise)
from lowerings.cce import with_logits as _with_logits  # noqa: F401  (registers torch.ops.memopt.cce_with_logits)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    return_lse: bool = False,
    filter_eps: float = 0.0,
    scale: float = 1.0,
    divisor: float = 1.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``F.cross_entropy(F.linear(hidden, weight, bias).float(), targets, ...)`` without the logits.

    ``hidden`` is [..., D] and ``targets`` the matching [...] class indices; "none" returns losses shaped
    like ``targets``. With ``return_lse`` the per-row log-sum-exp (shaped like ``targets``) comes too.
    ``filter_eps`` > 0 trades exact gradients for speed on CUDA (see ``torch.ops.memopt.cce``).
    ``scale`` and ``divisor``: the logits are ``linear(...) * scale / divisor`` (then softcapped).
    """
    lead = targets.shape
    loss, lse = torch.ops.memopt.cce(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, targets.reshape(-1),
        ignore_index, reduction, label_smoothing, softcap, filter_eps, scale, divisor,
    )
    if reduction == "none":
        loss = loss.view(lead)
    return (loss, lse.view(lead)) if return_lse else loss


__all__ = ["linear_cross_entropy"]
