"""Per-group running gradient-norm estimates, kept outside the graph.

The estimate steers sampling probabilities only (never the expected gradient), so it is process state, like
an optimizer's step counter, rather than a graph input: the backward op updates it in place and the next
step's forward reads it. Keys name a group of linears (their weights' graph names), so recompiles of the same
model share one estimate.

Under CUDA graphs (``mode="reduce-overhead"``) the captured kernels read and write the estimate at a fixed
address, and a tensor first allocated during the warm-up run would land in the graphs' private memory pool.
So the rule creates each estimate when it rewrites the graph (``prepare``) and registers it as a buffer of the
graph module; ``reset`` zeroes estimates in place instead of dropping them.
"""

from __future__ import annotations

import torch

from lowerings.wta_crs.reference import GradNormEstimate

_ESTIMATES: dict[tuple[str, torch.device], GradNormEstimate] = {}


def estimate(key: str, device: torch.device) -> GradNormEstimate:
    """The estimate for ``key`` on ``device``, created empty (uniform) on first use."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    slot = (key, device)
    if slot not in _ESTIMATES:
        _ESTIMATES[slot] = GradNormEstimate.empty(device)
    return _ESTIMATES[slot]


def prepare(key: str, device: torch.device) -> torch.Tensor:
    """The estimate's values, created now: at compile time, outside any CUDA-graph capture or its memory pool."""
    return estimate(key, device).values


def reset(key: str | None = None) -> None:
    """Forget the estimates of ``key`` (all when None): the next step samples by activation norms alone.

    Zeroed in place, so kernels captured in a CUDA graph keep reading the live estimate."""
    for slot, found in _ESTIMATES.items():
        if key is None or slot[0] == key:
            found.values.zero_()
