"""Pieces every benchmark script shares: releasing memory between measurements, and one-line error notes."""

from __future__ import annotations

import gc

import torch

from fxpass.report import error_note

__all__ = ["error_note", "release_memory"]


def release_memory() -> None:
    """Forget compiled graphs and free cached blocks, so one measurement's peak never leaks into the next."""
    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
