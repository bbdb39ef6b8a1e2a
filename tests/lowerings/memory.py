"""Peak temporary memory of a CPU function, from the allocator events torch's profiler records.

A temporary is an allocation freed before the function returns; what it returns (and keeps) is not one. The peak
of the temporaries alive together is what a reference implementation holds beyond its inputs and outputs, the
quantity an op's ``working_set`` must report.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.profiler import ProfilerActivity, profile

from benchmarks._common import allocation_events


def peak_temporary_bytes(fn: Callable[[], Any]) -> tuple[int, Any]:
    """(the most bytes of temporaries alive at once while ``fn()`` runs, what it returned)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = allocation_events(prof)
    freed, open_at = set(), {}
    for index, (_, ptr, size) in enumerate(events):  # pair each free with the allocation it ends
        if size > 0:
            open_at[ptr] = index
        elif ptr in open_at:
            freed.add(open_at.pop(ptr))
    live = peak = 0
    sizes: dict[int, int] = {}
    for index, (_, ptr, size) in enumerate(events):
        if size > 0 and index in freed:
            sizes[ptr] = size
            live += size
            peak = max(peak, live)
        elif size < 0 and ptr in sizes:
            live -= sizes.pop(ptr)
    return peak, result
