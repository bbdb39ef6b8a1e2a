"""Pieces every benchmark script shares: releasing memory between measurements, and one-line error notes."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import TypeVar

import torch

from fxpass.report import error_note

__all__ = ["cuda_peak", "error_note", "release_memory"]

T = TypeVar("T")


def release_memory() -> None:
    """Forget compiled graphs and free cached blocks, so one measurement's peak never leaks into the next."""
    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def cuda_peak(fn: Callable[[], T]) -> tuple[T, int, int]:
    """Run ``fn`` once on a quiet device: (its result, the peak bytes allocated meanwhile, the bytes allocated
    before it). Peak minus before is what ``fn`` itself added at its highest."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    return result, torch.cuda.max_memory_allocated(), before
