"""Where WTA-CRS's extra step time goes: a compiled fine-tuning step profiled with and without it.

    python benchmarks/tools/wta_crs_profile.py                              # GPT-2-medium width, 6 layers, 32 × 512
    python benchmarks/tools/wta_crs_profile.py --model bert-base --layers 12
    python benchmarks/tools/wta_crs_profile.py --tiny --device cpu          # a smoke run of the script itself

Both variants compile the same loss-only step as ``benchmarks/wta_crs.py`` (its ``training_step``);
``--layers`` cuts the stack so that compiling takes seconds, not minutes (the overhead is per group of
linears, so it scales with the layer count). For each variant it prints the median step time, the kernel
time and launch count per step from ``torch.profiler``, then the kernels whose time per step grew most with
WTA-CRS, and the overhead per rewritten group.
"""

from __future__ import annotations

import argparse
import collections
import logging
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks._common import header, release_memory, set_up, write_report
from benchmarks.wta_crs import add_model_arguments, add_step_arguments, backends, training_step, wta_groups

log = logging.getLogger("benchmarks.tools.wta_crs_profile")


def kernel_times(profile, device: torch.device, steps: int) -> dict[str, tuple[float, float]]:
    """Kernel (or, on CPU, operator) name → (µs per step, calls per step), from self times."""
    found: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for event in profile.key_averages():
        if device.type == "cuda":
            if event.device_type != DeviceType.CUDA:
                continue
            spent = getattr(event, "self_device_time_total", None) or event.self_cuda_time_total
        else:
            spent = event.self_cpu_time_total
        found[event.key][0] += spent / steps
        found[event.key][1] += event.count / steps
    return {name: (spent, calls) for name, (spent, calls) in found.items()}


def profile_variant(name: str, backend, args, device: torch.device) -> tuple[float, dict, int]:
    """(median step ms, kernel table, WTA-CRS groups rewritten) of one variant."""
    train_step, optimizer = training_step(args.model, backend, args, device, layers=args.layers)

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(3):  # compile, then let the optimizer state appear
        train_step(args.batch)
    times = []
    for _ in range(args.steps):
        synchronize()
        start = time.perf_counter()
        train_step(args.batch)
        synchronize()
        times.append(1000 * (time.perf_counter() - start))
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(args.profile_steps):
            train_step(args.batch)
        synchronize()
    groups = wta_groups()
    optimizer.state.clear()
    log.info("%s: %.1f ms per step", name, statistics.median(times))
    return statistics.median(times), kernel_times(profile, device, args.profile_steps), groups


def report(results: dict[str, tuple[float, dict, int]], top: int) -> str:
    (base_name, (base_ms, base, _)), (wta_name, (wta_ms, wta, groups)) = results.items()
    lines = ["| variant | step (ms) | kernel time per step (ms) | launches per step | WTA-CRS groups |",
             "|---|---|---|---|---|"]
    for name, (ms, table, count) in results.items():
        spent = sum(s for s, _ in table.values()) / 1000
        calls = sum(c for _, c in table.values())
        lines.append(f"| {name} | {ms:.1f} | {spent:.1f} | {calls:.0f} | {count} |")
    def change(kernel: str) -> tuple[float, float]:
        (wta_spent, wta_calls), (base_spent, base_calls) = wta.get(kernel, (0.0, 0.0)), base.get(kernel, (0.0, 0.0))
        return wta_spent - base_spent, wta_calls - base_calls

    extra = {kernel: change(kernel) for kernel in wta.keys() | base.keys()}
    lines += ["", f"Largest changes per step, {wta_name} − {base_name}:", "",
              "| kernel | Δ µs per step | Δ calls per step |", "|---|---|---|"]
    for name, (spent, calls) in sorted(extra.items(), key=lambda item: -abs(item[1][0]))[:top]:
        lines.append(f"| `{name[:90]}` | {spent:+.0f} | {calls:+.0f} |")
    if groups:
        step_extra = wta_ms - base_ms
        kernel_extra = sum(s for s, _ in extra.values()) / 1000
        lines += ["", f"Per group ({groups} groups): {step_extra / groups * 1000:+.0f} µs of step time, "
                  f"{kernel_extra / groups * 1000:+.0f} µs of kernel time."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, layers=6, batch=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    add_step_arguments(parser)
    args = parser.parse_args(argv)
    set_up(quiet_rules=True)
    device = torch.device(args.device)
    variants = backends([args.budget], args.mode)
    chosen = {name: variants[name] for name in ("memopt", f"memopt + WTA-CRS {args.budget}")}
    results = {}
    for name, backend in chosen.items():
        results[name] = profile_variant(name, backend, args, device)
        release_memory()  # the variant's model and graphs went out of scope on return
    text = (
        header("WTA-CRS step profile", device)
        + f"; {args.model} × {args.layers} layers, batch {args.batch} × {args.seq}, budget {args.budget}\n\n"
        + report(results, args.top)
    )
    return write_report(args.out, "wta_crs_profile.md", text)


if __name__ == "__main__":
    main()
