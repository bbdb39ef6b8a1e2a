"""Where WTA-CRS's extra step time goes: a compiled fine-tuning step profiled with and without it.

    python benchmarks/tools/wta_crs_profile.py                              # GPT-2-medium width, 6 layers, 32 × 512
    python benchmarks/tools/wta_crs_profile.py --model bert-base --layers 12
    python benchmarks/tools/wta_crs_profile.py --tiny --device cpu          # a smoke run of the script itself
    python benchmarks/tools/wta_crs_profile.py --model gpt2 --batch 16 --seq 1024 --host-calls   # host µs a call

Both variants compile the same loss-only step as ``benchmarks/wta_crs.py`` (its ``training_step``);
``--layers`` cuts the stack so that compiling takes seconds, not minutes (the overhead is per group of
linears, so it scales with the layer count). For each variant it prints the median step time, the kernel
time and launch count per step from ``torch.profiler``, then the kernels whose time per step grew most with
WTA-CRS, and the overhead per rewritten group.

A step whose kernels take less time than the host needs to launch them waits on the host. ``--host-calls``
measures, instead of the step, the host time of one call of each opaque op a group runs (the draw, the linears,
the store) at the model's width and token count, beside the bare kernel or GEMM inside it and an empty custom
op: the calls are only queued, so the loop's time is the host's as long as it is not waiting on the GPU (the
"wall" column, after a synchronize, says whether it was), then where each op's host time goes (cProfile's
largest entries by own time).
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
from benchmarks.wta_crs import (
    add_model_arguments,
    add_step_arguments,
    backends,
    build,
    training_step,
    wta_groups,
)

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


def host_calls(args, device: torch.device, calls: int = 300) -> str:
    """Host µs a call of WTA-CRS's opaque ops (and what they wrap) at ``args``' model width and token count."""
    import torch.nn.functional as F

    from lowerings.wta_crs import kernels, state
    from lowerings.wta_crs.reference import sample_size

    @torch.library.custom_op("memopt_bench::empty", mutates_args=())
    def empty(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x.new_empty(1)

    empty.register_fake(lambda x, y: x.new_empty(1))
    width = build(args.model, args.tiny, layers=1)[0].config.hidden_size
    rows, period = args.batch * args.seq, args.seq
    k = sample_size(rows, args.budget)
    norms, uniforms = torch.rand(rows, device=device), torch.rand(k, device=device)
    estimate = state.estimate("host_calls", device).values
    x = torch.randn(args.batch, args.seq, width, device=device, dtype=torch.bfloat16)
    weight = torch.randn(3 * width, width, device=device, dtype=torch.bfloat16)
    bias = torch.randn(3 * width, device=device, dtype=torch.bfloat16)
    index = torch.randint(0, rows, (k,), device=device)
    sampled = torch.randn(k, width, device=device, dtype=torch.bfloat16)
    draw, store, linears = (torch.ops.memopt.wta_crs_draw.default, torch.ops.memopt.wta_crs_store.default,
                            torch.ops.memopt.wta_crs_linears.default)
    draw_args = (norms, estimate, uniforms, period, True)
    linears_args = (x, [weight], [bias], [0], index, sampled, "host_calls", period)
    # the custom ops' own implementations, beneath their Python layers, against the CUDA kernels registered directly
    custom = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    cases = {
        "an empty custom op": lambda: torch.ops.memopt_bench.empty.default(norms, uniforms),
        "the draw kernel (`kernels.draw`)": lambda: kernels.draw(norms, uniforms, True, estimate=estimate,
                                                                 period=period),
        "`memopt::wta_crs_draw`": lambda: draw(*draw_args),
        "`memopt::wta_crs_draw`, the custom op's implementation": lambda: draw.redispatch(custom, *draw_args),
        "the estimate's update kernel": lambda: kernels.update_estimate(estimate, norms, period, 0.9),
        "`memopt::wta_crs_store`": lambda: store(norms, "host_calls", period),
        "`memopt::wta_crs_store`, the custom op's implementation": lambda: store.redispatch(
            custom, norms, "host_calls", period),
        "`F.linear` (Q/K/V)": lambda: F.linear(x, weight, bias),
        "`memopt::wta_crs_linears` (Q/K/V)": lambda: linears(*linears_args),
        "`memopt::wta_crs_linears`, the custom op's implementation": lambda: linears.redispatch(
            custom, *linears_args),
    }
    lines = ["| call | host µs | wall µs |", "|---|---|---|"]
    with torch.no_grad():
        for name, call in cases.items():
            for _ in range(20):
                call()
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            for _ in range(calls):
                call()
            host = (time.perf_counter() - start) / calls * 1e6
            torch.cuda.synchronize(device)
            wall = (time.perf_counter() - start) / calls * 1e6
            lines.append(f"| {name} | {host:.1f} | {wall:.1f} |")
        profiles = [_python_profile(name, call, calls) for name, call in cases.items() if name.startswith("`memopt")]
    state.reset("host_calls")
    return (f"{rows} token rows of width {width}, {k} sampled, {calls} calls each\n\n" + "\n".join(lines)
            + "\n\nWhere each op's host time goes (cProfile, own time, the largest entries):\n\n"
            + "\n\n".join(profiles))


def _python_profile(name: str, call, calls: int, top: int = 12) -> str:
    """The ``top`` functions by own time over ``calls`` calls of ``call``, as a fenced block under ``name``."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    body = text.getvalue().split("ncalls", 1)[-1]
    return f"{name}:\n\n```\nncalls{body.rstrip()}\n```"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, layers=6, batch=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--host-calls", action="store_true", help="CUDA: host µs a call of the opaque ops instead")
    add_step_arguments(parser)
    args = parser.parse_args(argv)
    set_up(quiet_rules=True)
    device = torch.device(args.device)
    if args.host_calls:
        if device.type != "cuda":
            raise SystemExit("--host-calls times the ops' CUDA launches: it needs a GPU")
        text = header("WTA-CRS opaque ops, host time a call", device) + "; " + host_calls(args, device)
        return write_report(args.out, "wta_crs_host_calls.md", text)
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
