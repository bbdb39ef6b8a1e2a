"""Where an end-to-end step's time goes: ``torch.profiler`` over a few steps of one ``benchmarks/e2e.py`` case.

    python benchmarks/tools/profile_step.py --model gpt2 --flow loss_only \
        --variants 'torch.compile,memopt,memopt:{"cce_variant": "rowwise"}'

Each variant ("torch.compile", "memopt", or "memopt:<options as JSON>") compiles its own copy of the model,
steps ``--warmup`` times, then ``--steps`` profiled steps. Prints, per variant, the wall time per step and the
``--top`` operators by their own device time (kernels under the op that launched them), so that two variants'
tables can be read side by side.

``--trace DIR`` also writes each variant's Chrome trace (open it in Perfetto) and tells, for the forward and
the backward apart, how long the GPU was busy within the span of the work each launched: a phase whose GPU
waits is bound by the CPU, where moving GPU work into it costs nothing and moving work out of it saves nothing.
``--flow fsdp`` profiles the FSDP2 step of ``e2e.py`` (a world of one). ``--model zoo:<family>`` profiles a
family of ``benchmarks/zoo.py`` as the zoo steps it (bf16 weights, the whole model compiled, ``--flow padded`` for
its padded mask; ``--layers`` defaults to the zoo's 2), so that a zoo row's time ratio can be taken apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import linecache
import logging
import re
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks._common import error_note
from benchmarks.e2e import BACKWARD_RANGE, FORWARD_RANGE, build_model, compiled_step, make_batch, training_step

log = logging.getLogger("profile_step")


def parse_variant(text: str) -> tuple[str, dict]:
    """ "memopt:{...}" → ("memopt", {...}); a bare backend name has no options."""
    backend, _, options = text.partition(":")
    return backend, json.loads(options) if options else {}


ZOO_PREFIX = "zoo:"


def e2e_step(args: argparse.Namespace, backend: str, options: dict, device: torch.device):
    """One step of ``benchmarks/e2e.py``'s case: its model, flow and ``--precision`` (as e2e's: fp32 weights under
    bf16 autocast, bf16 weights, or fp32)."""
    torch.manual_seed(0)
    model = build_model(args.model, args.attention, args.dropout, args.tiny, args.checkpointing, args.layers)
    model = model.to(device, torch.bfloat16 if args.precision == "bf16" else torch.float32)
    batch = make_batch(model.config.vocab_size, args.batch, args.seq, args.flow == "padded", device)
    step = compiled_step(model, args.flow, backend, "inductor", options)
    return training_step(model, step, batch, device, autocast=args.precision == "autocast",
                         phases=args.trace is not None)


def zoo_step(args: argparse.Namespace, backend: str, options: dict, device: torch.device):
    """One step of ``benchmarks/zoo.py``'s case for the family after "zoo:", built by the zoo's own
    ``model_and_batch`` (bf16 on CUDA, fp32 off it; ``--tiny`` caps the tokens as the zoo does): the whole model
    compiled, the output alive through the backward, as the zoo measures it."""
    from benchmarks import zoo

    if args.flow not in ("whole_model", "padded"):
        raise SystemExit(f"--model {args.model}: the zoo compiles the whole model; --flow whole_model or padded")
    family = args.model.removeprefix(ZOO_PREFIX)
    if family not in zoo.FAMILIES:
        raise SystemExit(f"--model {args.model}: no zoo family {family!r} (one of {', '.join(zoo.FAMILIES)})")
    case = zoo.Case(family, "padded" if args.flow == "padded" else "none", zoo.FAMILIES[family].decoder)
    sizes = argparse.Namespace(**{**vars(args), "layers": args.layers or zoo.LAYERS})
    model, inputs = zoo.model_and_batch(case, sizes, device, zoo.step_dtype(device))
    return zoo.compiled_step(model, inputs, backend, "inductor", options, sink=lambda report: None)


def profile_variant(args: argparse.Namespace, variant: str, device: torch.device) -> str:
    backend, options = parse_variant(variant)
    make_step = zoo_step if args.model.startswith(ZOO_PREFIX) else e2e_step
    one_step = make_step(args, backend, options, device)
    for _ in range(args.warmup):
        one_step()
    torch.cuda.synchronize(device) if device.type == "cuda" else None
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    before = allocator_counts(device)
    begin = time.perf_counter()
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(args.steps):
            one_step()
        torch.cuda.synchronize(device) if device.type == "cuda" else None
    wall_ms = (time.perf_counter() - begin) / args.steps * 1e3
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = profiler.key_averages().table(sort_by=sort, row_limit=args.top, max_name_column_width=70)
    text = f"## {variant}: {wall_ms:.1f} ms a step (wall, profiled)\n{table}"
    if device.type == "cuda":
        after = allocator_counts(device)
        text += "\nCUDA allocator over the profiled steps: " + ", ".join(
            f"{name} {after[name] - before[name]}" for name in ALLOCATOR_COUNTS
        )
    if args.trace is not None:
        path = Path(args.trace) / f"{re.sub(r'[^A-Za-z0-9]+', '_', variant).strip('_')}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
        text += f"\n{phase_table(phase_times(trace))}\n\nIdle gaps of the GPU within a phase's work:\n"
        text += f"{gap_table(idle_gaps(trace), args.top)}\ntrace: {path}"
    if args.memory and device.type == "cuda":
        try:
            text += "\n" + memory_at_peak(one_step, args.top)
        except Exception as error:  # the history's format is private to torch: report, keep the timings
            text += f"\nmemory history failed: {error_note(error)}"
    return text


# cudaMalloc and cudaFree calls, and the times the caching allocator freed its cache to retry (each a device
# sync): a step that stalls the GPU on them shows idle gaps under an allocation.
ALLOCATOR_COUNTS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def allocator_counts(device: torch.device) -> dict[str, int]:
    stats = torch.cuda.memory_stats(device) if device.type == "cuda" else {}
    return {name: int(stats.get(name, 0)) for name in ALLOCATOR_COUNTS}


DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
LAUNCH_CATEGORIES = {"cuda_runtime", "cuda_driver"}


@dataclasses.dataclass
class PhaseTime:
    """One phase of a step (forward or backward), per step, in ms: the CPU's time in it, and the span of the GPU
    work it launched (first start to last end), of which the GPU was busy (the union of its kernels and copies)."""

    steps: int = 0
    cpu_ms: float = 0.0
    gpu_span_ms: float = 0.0
    gpu_busy_ms: float = 0.0

    @property
    def gpu_idle_ms(self) -> float:
        return self.gpu_span_ms - self.gpu_busy_ms


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


@dataclasses.dataclass(frozen=True)
class Work:
    """A kernel or copy on the GPU, with the CPU's launch of it (µs)."""

    start: float
    end: float
    name: str
    launched_at: float
    thread: object


def phase_work(trace: dict, phases: tuple[str, ...] = (FORWARD_RANGE, BACKWARD_RANGE)):
    """Each phase range of the trace (start, end, name), with the GPU work launched within it: each kernel or copy
    belongs to the phase whose CPU range (``record_function``) launched it (the launch is found by its
    correlation id). Work launched outside every range is left out."""
    events = [event for event in trace.get("traceEvents", []) if event.get("ph") == "X"]
    ranges = sorted((event["ts"], event["ts"] + event["dur"], event["name"]) for event in events
                    if event.get("cat") == "user_annotation" and event.get("name") in phases)
    launches = {event["args"]["correlation"]: event for event in events
                if event.get("cat") in LAUNCH_CATEGORIES and "correlation" in event.get("args", {})}
    work: list[list[Work]] = [[] for _ in ranges]
    for event in events:
        launch = launches.get(event.get("args", {}).get("correlation"))
        if event.get("cat") not in DEVICE_CATEGORIES or launch is None:
            continue
        index = next((i for i, (start, end, _) in enumerate(ranges) if start <= launch["ts"] <= end), None)
        if index is not None:
            work[index].append(Work(event["ts"], event["ts"] + event["dur"], event["name"], launch["ts"],
                                    launch.get("tid")))
    return ranges, work


def phase_times(trace: dict, phases: tuple[str, ...] = (FORWARD_RANGE, BACKWARD_RANGE)) -> dict[str, PhaseTime]:
    """Where a step's GPU waits, by phase, from a Chrome trace of ``torch.profiler`` (``phase_work``). A phase whose
    GPU span is much longer than its busy time was bound by the CPU: the GPU waited on launches."""
    ranges, work = phase_work(trace, phases)
    totals = {name: PhaseTime() for name in phases}
    for (start, end, name), items in zip(ranges, work, strict=True):
        total = totals[name]
        total.steps += 1
        total.cpu_ms += (end - start) / 1e3
        if items:
            total.gpu_span_ms += (max(w.end for w in items) - min(w.start for w in items)) / 1e3
            total.gpu_busy_ms += _union_us([(w.start, w.end) for w in items]) / 1e3
    return {name: _per_step(total) for name, total in totals.items()}


def idle_gaps(
    trace: dict, phases: tuple[str, ...] = (FORWARD_RANGE, BACKWARD_RANGE), min_us: float = 50.0
) -> list[tuple[str, str, str, float, int]]:
    """The GPU's idle gaps of at least ``min_us`` within each phase's work, grouped by what the CPU was in when it
    launched the work after the gap (its innermost CPU op, or the runtime call that launched it) and by that
    work's name: (phase, CPU op, next work, ms per step, gaps), the longest first. An idle GPU waits on the CPU:
    the CPU op names what it was busy with (a Python loop of launches, an allocator's cudaMalloc, a sync)."""
    events = [event for event in trace.get("traceEvents", []) if event.get("ph") == "X"]
    cpu_ops = sorted((event["ts"], event["ts"] + event["dur"], event["name"], event.get("tid")) for event in events
                     if event.get("cat") == "cpu_op")
    ranges, work = phase_work(trace, phases)
    steps = Counter(name for _, _, name in ranges)
    found: Counter = Counter()
    count: Counter = Counter()
    for (_, _, phase), items in zip(ranges, work, strict=True):
        reach = None
        for item in sorted(items, key=lambda w: w.start):
            if reach is not None and item.start - reach >= min_us:
                key = (phase, _innermost(cpu_ops, item.launched_at, item.thread), item.name[:60])
                found[key] += (item.start - reach) / 1e3
                count[key] += 1
            reach = item.end if reach is None else max(reach, item.end)
    return [(phase, op, after, ms / max(steps[phase], 1), count[(phase, op, after)])
            for (phase, op, after), ms in found.most_common()]


def _innermost(cpu_ops: list[tuple[float, float, str, object]], at: float, thread: object) -> str:
    """The shortest CPU op of ``thread`` running at ``at`` (µs), or "(no CPU op)"."""
    best = None
    for start, end, name, tid in cpu_ops:
        if start > at:
            break
        if end >= at and tid == thread and (best is None or end - start < best[1] - best[0]):
            best = (start, end, name)
    return best[2] if best else "(no CPU op)"


def gap_table(gaps: list[tuple[str, str, str, float, int]], top: int = 12) -> str:
    rows = ["| phase | CPU op launching the work after the gap | work after the gap | idle ms a step | gaps |",
            "|---|---|---|---|---|"]
    rows += [f"| {phase} | {op} | {after} | {ms:.2f} | {n} |" for phase, op, after, ms, n in gaps[:top]]
    return "\n".join(rows)


def _per_step(total: PhaseTime) -> PhaseTime:
    steps = max(total.steps, 1)
    return PhaseTime(total.steps, total.cpu_ms / steps, total.gpu_span_ms / steps, total.gpu_busy_ms / steps)


def phase_table(found: dict[str, PhaseTime]) -> str:
    rows = ["| phase | steps | CPU ms | GPU span ms | GPU busy ms | GPU idle in span ms |", "|---|---|---|---|---|---|"]
    for name, t in found.items():
        rows.append(f"| {name} | {t.steps} | {t.cpu_ms:.2f} | {t.gpu_span_ms:.2f} | {t.gpu_busy_ms:.2f} "
                    f"| {t.gpu_idle_ms:.2f} |")
    return "\n".join(rows)


def memory_at_peak(one_step, top: int) -> str:
    """What is allocated at one step's peak, by the line that allocated it: the CUDA allocator's history replayed
    up to the step's highest point. Blocks from before the step (weights, gradients) are left out, so the table
    adds up to the step's own peak, as ``benchmarks/e2e.py`` reports it."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        one_step()
        torch.cuda.synchronize()
        events = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    peak, peak_at = 0, 0
    live: dict = {}
    total = 0
    for index, event in enumerate(events):  # first pass: where the total peaks
        total += _replay(live, event)
        if total > peak:
            peak, peak_at = total, index
    live = {}
    for event in events[: peak_at + 1]:  # second pass: what is live there (no copy at every new peak)
        _replay(live, event)
    by_line: Counter = Counter()
    count: Counter = Counter()
    for event in live.values():
        label = allocation_site(event.get("frames", []))
        by_line[label] += event["size"]
        count[label] += 1
    rows = [
        f"### live at the peak: {peak / 2**20:.0f} MiB, event {peak_at} of {len(events)}",
        "| MiB | blocks | allocated by |",
        "|---|---|---|",
    ]
    rows += [f"| {size / 2**20:.0f} | {count[label]} | {label} |" for label, size in by_line.most_common(top)]
    return "\n".join(rows)


def _replay(live: dict, event: dict) -> int:
    """Apply one allocator event to ``live`` (address → its alloc event); the change in bytes allocated. Frees of
    blocks from before the recording are not in ``live`` and change nothing."""
    if event["action"] == "alloc":
        live[event["addr"]] = event
        return event["size"]
    if event["action"] == "free_completed" and event["addr"] in live:
        return -live.pop(event["addr"])["size"]
    return 0


def allocation_site(frames: list[dict]) -> str:
    """The innermost frame outside torch's own package (a compiled graph's line, a memopt op, the model), with its
    source line: which buffer of which graph holds the memory."""
    torch_dir = str(Path(torch.__file__).parent)
    for frame in frames:
        filename = frame.get("filename", "")
        if filename.startswith(torch_dir) or filename.startswith("<"):
            continue
        source = linecache.getline(filename, frame.get("line", 0)).strip()
        buffer = re.search(r"empty_strided_\w+\((\([^)]*\)), \([^)]*\), (torch\.\w+)", source)
        if buffer:  # a compiled graph's buffer: one row per shape, however many layers allocate it
            return f"compiled graph buffer {buffer.group(1)} {buffer.group(2)}"
        return f"{Path(filename).name}:{frame.get('line')} {frame.get('name')}: `{source[:90]}`"
    return "(torch internals)"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2", help='a model of benchmarks/e2e.py, or "zoo:<family>"')
    parser.add_argument("--flow", default="loss_only", choices=["loss_only", "whole_model", "padded", "fsdp"])
    parser.add_argument("--variants", default="torch.compile,memopt")
    parser.add_argument("--attention", default="sdpa")
    parser.add_argument("--dropout", default="0")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--precision", default="autocast", choices=["autocast", "bf16", "fp32"],
                        help="e2e's models: fp32 weights under bf16 autocast, bf16 weights, or fp32 throughout")
    parser.add_argument("--checkpointing", action="store_true", help="HF's per-layer activation checkpointing")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--memory", action="store_true", help="also list what is allocated at a step's peak")
    parser.add_argument("--trace", default=None, metavar="DIR",
                        help="write each variant's Chrome trace there, with the GPU's busy and idle time by phase")
    parser.add_argument("--layers", type=int, default=None, help="blocks of the model (default: its config's)")
    parser.add_argument("--tiny", action="store_true", help="small models: check the script")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device(args.device)
    for variant in _split_variants(args.variants):
        log.info("%s", profile_variant(args, variant, device))


def _split_variants(text: str) -> list[str]:
    """Split on the commas outside JSON braces."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += char == "{"
        depth -= char == "}"
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [*parts, current] if current else parts


if __name__ == "__main__":
    main()
