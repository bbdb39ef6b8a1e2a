"""Pieces every benchmark script shares: releasing memory between measurements, and one-line error notes."""

from __future__ import annotations

import gc

import torch


def release_memory() -> None:
    """Forget compiled graphs and free cached blocks, so one measurement's peak never leaks into the next."""
    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def error_note(error: BaseException) -> str:
    """A peer or backend that fails is reported in its table row, not allowed to stop the comparison."""
    return f"{type(error).__name__}: {str(error).splitlines()[0][:100]}"
