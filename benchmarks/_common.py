"""Pieces every benchmark script shares: releasing memory between measurements, and one-line error notes."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from fxpass.report import error_note

__all__ = ["cuda_peak", "error_note", "header", "release_memory", "write_report"]

T = TypeVar("T")


def release_memory(forget_compiled: bool = True) -> None:
    """Free cached blocks, so one measurement's peak never leaks into the next; ``forget_compiled`` also drops
    the compiled graphs (between variants; not after an out-of-memory step of a graph still in use)."""
    gc.collect()
    if forget_compiled:
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


def header(title: str, device: torch.device) -> str:
    """``title``, today's date, the device's name and torch's version: the first line of every report."""
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return f"{title}, {time.strftime('%Y-%m-%d')}, {where}, torch {torch.__version__}"


def write_report(out: Path, name: str, text: str) -> str:
    """Write ``text`` to ``out/name`` (creating ``out``) and print it; returns it."""
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(text + "\n")
    print(text)
    return text
