"""Pieces every benchmark script shares: releasing memory between measurements, and one-line error notes."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from fxpass.report import error_note

__all__ = ["cpu_peak", "cuda_peak", "error_note", "header", "release_memory", "write_report"]

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


def allocation_events(prof) -> list[tuple[int, int, int]]:
    """(time ns, pointer, bytes) of every CPU allocation (bytes > 0) and free (bytes < 0) a
    ``torch.profiler.profile(profile_memory=True)`` recorded, in time order."""
    from torch._C._profiler import _EventType

    found, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            found.append((node.start_time_ns, fields.ptr, fields.alloc_size))
        stack.extend(node.children)
    return sorted(found)


def cpu_peak(fn: Callable[[], T]) -> tuple[T, int]:
    """Run ``fn`` once under the profiler's allocator events: (its result, the most bytes it had allocated at once
    beyond what was allocated before it), the CPU twin of ``cuda_peak``'s peak minus before. Frees of tensors from
    before ``fn`` count too, as they do on CUDA (gradients replaced, say)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    live = peak = 0
    for _, _, size in allocation_events(prof):
        live += size
        peak = max(peak, live)
    return result, peak


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
