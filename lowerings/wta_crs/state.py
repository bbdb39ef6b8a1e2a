"""Per-group running gradient-norm estimates: process state that the compiled graphs read and update.

The estimate steers sampling probabilities only (never the expected gradient), so it lives like an
optimizer's step counter: the backward writes it (``memopt::wta_crs_store``, by key) and the next step's
forward reads it. Keys name a group of linears by their weights' graph names, so recompiles of the same model
share one estimate, and so do blocks compiled one by one, which lift their weights under the same names.

Under CUDA graphs (``mode="reduce-overhead"``) the captured kernels read and write the estimate at a fixed
address, and a tensor first allocated during the warm-up run would land in the graphs' private memory pool.
So the rule creates each estimate when it rewrites the graph and registers it as a buffer of the graph
module; ``reset`` zeroes estimates in place instead of dropping them.
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


def reset(key: str | None = None) -> None:
    """Forget the estimates of ``key`` (all when None): the next step samples by activation norms alone.

    Zeroed in place, so kernels captured in a CUDA graph keep reading the live estimate."""
    for slot, found in _ESTIMATES.items():
        if key is None or slot[0] == key:
            found.values.zero_()
