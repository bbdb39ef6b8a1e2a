"""Per-group running gradient-norm estimates, kept outside the graph.

The estimate steers sampling probabilities only (never the expected gradient), so it is process state, like
an optimizer's step counter, rather than a graph input: the backward op updates it in place and the next
step's forward reads it. Keys name a group of linears (their weights' graph names), so recompiles of the same
model share one estimate.
"""

from __future__ import annotations

import torch

from lowerings.wta_crs.reference import GradNormEstimate

_ESTIMATES: dict[tuple[str, torch.device], GradNormEstimate] = {}


def estimate(key: str, device: torch.device) -> GradNormEstimate:
    """The estimate for ``key`` on ``device``, created empty (uniform) on first use."""
    slot = (key, torch.device(device))
    if slot not in _ESTIMATES:
        _ESTIMATES[slot] = GradNormEstimate.empty(device)
    return _ESTIMATES[slot]


def reset(key: str | None = None) -> None:
    """Forget the estimates of ``key`` (all when None): the next step samples by activation norms alone."""
    for slot in [s for s in _ESTIMATES if key is None or s[0] == key]:
        del _ESTIMATES[slot]
