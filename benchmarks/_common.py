"""Pieces every benchmark script shares: its start (logging, the device it needs, its output folder), releasing
memory between measurements, peaks, turns, reports and one-line error notes."""

from __future__ import annotations

import gc
import linecache
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from fxpass.notes import error_note

__all__ = [
    "cpu_peak", "cuda_peak", "error_note", "header", "in_turns", "peak_breakdown", "release_memory", "set_up",
    "write_report",
]

T = TypeVar("T")


def set_up(out: Path | None = None, needs_cuda: str | None = None, quiet_rules: bool = False) -> None:
    """A benchmark's first lines: log each line with its time; stop with "``needs_cuda`` needs a CUDA device" (the
    script's path) where the script needs one and there is none; create the output folder ``out``; with
    ``quiet_rules``, leave out the per-graph decision tables that memopt's rules log."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if quiet_rules:
        logging.getLogger("fxpass").setLevel(logging.WARNING)
    if needs_cuda and not torch.cuda.is_available():
        raise SystemExit(f"{needs_cuda} needs a CUDA device")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)


def release_memory(forget_compiled: bool = True) -> None:
    """Free cached blocks, so one measurement's peak never leaks into the next; ``forget_compiled`` also drops
    the compiled graphs (between variants; not after an out-of-memory step of a graph still in use)."""
    gc.collect()
    if forget_compiled:
        torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def in_turns(steps: int, timed: list[Callable[[], float]]) -> list[tuple[list[float], Exception | None]]:
    """Each timed call, one of each in turn, ``steps`` times, so that a machine's drift (a shared CPU's
    neighbours, clocks) reaches every one alike: per call, its times and the error that ended its turns, if any
    (the others go on: one variant running out of memory must not end the comparison)."""
    times: list[list[float]] = [[] for _ in timed]
    errors: list[Exception | None] = [None for _ in timed]
    for _ in range(steps):
        for index, call in enumerate(timed):
            if errors[index] is not None:
                continue
            try:
                times[index].append(call())
            except Exception as error:
                errors[index] = error
    return list(zip(times, errors, strict=True))


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


def peak_mib(step: Callable[[], object], device: torch.device) -> float:
    """One step's peak in MiB above what was allocated before it (the profiler's allocator events on CPU)."""
    if device.type == "cuda":
        _, peak, before = cuda_peak(step)
        return (peak - before) / 2**20
    _, peak = cpu_peak(step)
    return peak / 2**20


def recorded_peak(fn: Callable[[], object], device: torch.device, path: Path, top: int = 25) -> None:
    """Run ``fn`` once on CUDA under the allocator's history and write what was alive at its peak to ``path``
    (``peak_breakdown``): which generated kernel's buffers hold a step's peak, to set beside what memopt's
    simulation says holds it."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        fn()
        torch.cuda.synchronize(device)
        trace = torch.cuda.memory._snapshot()["device_traces"][device.index or 0]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    path.write_text(peak_breakdown(trace, before, top=top) + "\n")


def peak_breakdown(trace: list[dict], before: int, top: int = 15) -> str:
    """Where a recorded stretch of CUDA allocations peaked, and what was alive there, as text.

    ``trace`` is one device's entries of ``torch.cuda.memory._snapshot()["device_traces"]`` recorded under
    ``torch.cuda.memory._record_memory_history(stacks="python")``; ``before`` the bytes allocated when the
    recording started (weights, optimizer state: not in the trace). Blocks alive at the peak are grouped by the
    innermost Python frame outside torch's own modules (Inductor's generated code and ``torch.optim`` count as
    user code), which says which graph, layer or optimizer call holds them."""
    live: dict[int, int] = {}  # sizes only: the sites are needed for the blocks alive at the peak alone
    current = peak = peak_at = 0
    for position, entry in enumerate(trace):
        if entry.get("action") == "alloc":
            live[entry["addr"]] = entry["size"]
            current += entry["size"]
            if current > peak:
                peak, peak_at = current, position
        elif _frees(entry) and entry.get("addr") in live:
            current -= live.pop(entry["addr"])
    alive: dict[int, dict] = {}
    for entry in trace[: peak_at + 1]:  # replayed up to the peak: the blocks alive there
        if entry.get("action") == "alloc":
            alive[entry["addr"]] = entry
        elif _frees(entry):
            alive.pop(entry.get("addr"), None)
    by_site: dict[str, int] = {}
    for entry in alive.values():
        site = _site(entry.get("frames", []))
        by_site[site] = by_site.get(site, 0) + entry["size"]
    gib = 1 << 30
    lines = [
        f"peak {(before + peak) / gib:.2f} GiB = {before / gib:.2f} GiB allocated before the recording + "
        f"{peak / gib:.2f} GiB allocated in it, reached at entry {peak_at} of {len(trace)} "
        f"(by {_site(trace[peak_at].get('frames', [])) if trace else '-'})",
        "",
        "| GiB alive at the peak | allocated at |",
        "|---|---|",
    ]
    for site, size in sorted(by_site.items(), key=lambda item: -item[1])[:top]:
        lines.append(f"| {size / gib:.3f} | {site} |")
    return "\n".join(lines)


def _frees(entry: dict) -> bool:
    return entry.get("action") in ("free_requested", "free_completed")


def _site(frames: list[dict]) -> str:
    """The innermost frame that is not torch's own machinery, as ``file:line function``."""
    for frame in frames:
        name = frame.get("filename", "")
        ours = "/torch/" not in name or "/torch/optim/" in name or "torchinductor" in name
        if ours and not name.startswith("<"):
            site = f"{'/'.join(name.split('/')[-2:])}:{frame.get('line')} {frame.get('name')}"
            code = linecache.getline(name, frame.get("line", 0)).strip() if "torchinductor" in name else ""
            return f"{site} `{code[:120]}`" if code else site  # generated code's line: the buffer, shape, dtype
    return "(torch internals)"


def ratio(ours: float | None, theirs: float | None) -> str:
    """``ours / theirs`` for a table, two decimals; "-" where either is missing (or ``theirs`` is 0)."""
    return "-" if ours is None or not theirs else f"{ours / theirs:.2f}"


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
