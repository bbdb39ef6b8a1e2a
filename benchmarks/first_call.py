"""Time to the first training step (compilation included), cold and with warm caches, each in a fresh process.

    python benchmarks/first_call.py --models gpt2 --attention eager --out $OUT/first_call

A user pays compilation on every start: cold the first time, then from Inductor's on-disk caches (FX graph,
AOTAutograd, compiled kernels). Each variant (torch.compile, memopt, memopt + WTA-CRS 0.3) runs in its own
process over its own fresh cache directories (Inductor's and Triton's): first every variant cold, then every
variant again, warm. A process builds the model (``benchmarks/e2e.py``'s builder), compiles it whole as users
do, and times from its ``torch.compile`` call (where ``backend="inductor"`` imports Inductor) to the end of its
first forward + backward. It also reports the AOTAutograd cache's verdict (hit, miss or bypass), since a
bypassed graph is traced again on every start, the seconds of each compile phase and the number of kernels
Inductor generated, and the Triton kernels the process JIT-compiled itself (memopt's opaque ops launch theirs
eagerly; ``lowerings/precompile.py`` compiles them beside Inductor's compile, which compiles its own in a pool of
workers).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from benchmarks._common import header, write_report

VARIANTS = {
    "torch.compile": None,
    "memopt": {},
    "memopt + WTA-CRS 0.3": {"wta_crs_budget": 0.3},
    # both ways of sampling (``Config.wta_crs_sampling``; the row above takes the default, traced)
    "memopt + WTA-CRS 0.3 (traced sampling)": {"wta_crs_budget": 0.3, "wta_crs_sampling": "traced"},
    "memopt + WTA-CRS 0.3 (opaque sampling)": {"wta_crs_budget": 0.3, "wta_crs_sampling": "opaque"},
    # CPU: small steps, where the memory model declines WTA-CRS, with every rewrite forced
    "memopt + WTA-CRS 0.3 (forced)": {"wta_crs_budget": 0.3, "force": True},
    # the opaque ops' kernels compiled at their first launch, as before ``lowerings/precompile.py``
    "memopt (no precompile)": {"precompile": False},
    "memopt + WTA-CRS 0.3 (no precompile)": {"wta_crs_budget": 0.3, "precompile": False},
}


def child(
    model_name: str, attention: str, dropout: str, batch: int, seq: int, variant: str, tiny: bool,
    layers: int | None = None, profile: Path | None = None, samples: Path | None = None,
) -> dict:
    """One variant's first step in this process (timed as ``e2e.first_call`` times it): seconds, the rewrites applied
    and the AOTAutograd cache counters."""
    from torch._dynamo.utils import counters

    from benchmarks import e2e

    jit_compiles = record_jit_compiles()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = e2e.build_model(model_name, attention, dropout, tiny, layers=layers).to(device)
    inputs = e2e.make_batch(model.config.vocab_size, batch, seq, False, device)
    options = VARIANTS[variant]
    backend = "torch.compile" if options is None else "memopt"
    # From the torch.compile call on: torch.compile(backend="inductor") imports Inductor's compile_fx there,
    # a backend object at its first graph (1.4 s of 2 CPU cores), so timing the first step alone is unfair.
    start = time.perf_counter()
    step = e2e.compiled_step(model, "whole_model", backend, "inductor", options)
    setup_s = time.perf_counter() - start
    one_step = e2e.training_step(model, step, inputs, device, autocast=device.type == "cuda")
    row = e2e.Row(model_name, attention, dropout, "whole_model", backend, tokens=batch * seq)

    def run() -> None:
        e2e.first_call(row, one_step, device)

    sampler = StackSampler() if samples is not None else contextlib.nullcontext()
    with sampler:
        if profile is not None:
            profiled(profile, run)
        else:
            run()
    if samples is not None:
        sampler.write(samples)
    cache = {key: value for key, value in counters["aot_autograd"].items() if key.startswith("autograd_cache")}
    return {
        "variant": variant, "first_call_s": row.first_call_s + setup_s, "torch_compile_call_s": round(setup_s, 2),
        "rewrites": row.rewrites, "aot_autograd_cache": cache,
        "phases_s": compile_phases(), "kernels_generated": generated_kernels(),
        "jit_compiles_s": {name: round(seconds, 2) for name, seconds in jit_compiles},
    }


def record_jit_compiles() -> list[tuple[str, float]]:
    """A list that fills with (kernel, seconds) for every Triton JIT compile of this process from now on: the
    first call's share of memopt's eagerly launched kernels. "(precompile)" marks those compiled by memopt's
    precompile threads beside Inductor's compile, "(autograd)" those of the backward, which autograd runs on
    a thread of its own on CUDA. Empty without Triton."""
    from lowerings import precompile

    compiles: list[tuple[str, float]] = []
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return compiles
    compile_once = JITFunction._do_compile

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return compile_once(self, *args, **kwargs)
        finally:
            thread = threading.current_thread()
            where = "" if thread is threading.main_thread() else " (autograd)"
            where = " (precompile)" if thread.name.startswith(precompile.THREAD_NAME) else where
            compiles.append((f"{self.fn.__name__}#{len(compiles)}{where}", time.perf_counter() - start))

    JITFunction._do_compile = timed
    return compiles


def profiled(path: Path, run) -> None:
    """``run()`` under cProfile; the functions of memopt, Dynamo, AOTAutograd, Inductor and Triton that took
    the most cumulative time go to ``path`` as text: where a warm start's seconds go, below the phases."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(run)
    path.parent.mkdir(parents=True, exist_ok=True)
    profiler.dump_stats(path.with_suffix(".prof"))  # all of it, for pstats
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).sort_stats("cumulative")
    stats.print_stats(r"fxpass|lowerings|_dynamo|_functorch|_inductor|triton", 60)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.getvalue())


class StackSampler:
    """Every thread's Python stack sampled each ``interval`` seconds, counted as collapsed stacks (``thread;outer;
    ...;inner count``, as flame-graph tools read them). Wall-clock, and for all threads at once: where the main
    thread waits (on a lock, on the GIL, on an import) shows, and so do memopt's precompile threads, which
    cProfile cannot follow (it sees one thread; on Python 3.12 a second profiler in another thread is refused)."""

    def __init__(self, interval: float = 0.005, depth: int = 150) -> None:
        self.interval, self.depth = interval, depth
        self.counts: collections.Counter[str] = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def __enter__(self) -> StackSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        own = threading.get_ident()
        while not self._stop.wait(self.interval):
            names = {thread.ident: thread.name for thread in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident != own:
                    self.counts[self._collapsed(names.get(ident, str(ident)), frame)] += 1

    def _collapsed(self, thread: str, frame) -> str:
        stack = []
        while frame is not None and len(stack) < self.depth:
            code = frame.f_code
            stack.append(f"{Path(code.co_filename).name}:{code.co_name}")
            frame = frame.f_back
        return ";".join([thread, *reversed(stack)])

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = [f"{stack} {count}" for stack, count in self.counts.most_common()]
        path.write_text("\n".join(lines) + "\n")


def compile_phases() -> dict[str, float]:
    """Seconds per timed compile phase of this process (Dynamo's ``compile_times``, summed over graphs), the
    longest first: where a variant's extra first-call time goes."""
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv", aggregate=True)
    phases = {name: round(float(value), 2) for name, value in zip(names, values, strict=True)}
    return dict(sorted(phases.items(), key=lambda item: -item[1]))


def generated_kernels() -> int:
    """Inductor's ``metrics.generated_kernel_count`` for this process: kernels its code generation created
    (candidates it benchmarked included), a measure of the codegen work a graph costs."""
    from torch._inductor import metrics

    return int(metrics.generated_kernel_count)


def run_variant(args, variant: str, cache_dir: str, phase: str) -> dict:
    command = [
        sys.executable, __file__, "--child", variant, "--models", args.models, "--attention", args.attention,
        "--dropout", args.dropout, "--batch", str(args.batch), "--seq", str(args.seq),
    ] + (["--tiny"] if args.tiny else []) + (["--layers", str(args.layers)] if args.layers else [])  # fmt: skip
    slug = "".join(c if c.isalnum() else "-" for c in variant)
    if args.profile:
        command += ["--profile", str(args.profile / f"first-call-profile-{phase}-{slug}.txt")]
    if args.sample:
        command += ["--sample", str(args.sample / f"first-call-stacks-{phase}-{slug}.txt")]
    # Triton's own cache too: memopt launches some kernels eagerly (opaque ops), which Triton's JIT would
    # otherwise compile into ~/.triton once for every variant that runs after the first
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": cache_dir,
        "TRITON_CACHE_DIR": str(Path(cache_dir) / "triton"),
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
    }
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    row = json.loads(lines[-1]) if done.returncode == 0 and lines else {"variant": variant, "error": done.stderr[-500:]}
    return {"phase": phase, **row}


def table(rows: list[dict]) -> str:
    base = {row["phase"]: row.get("first_call_s") for row in rows if row["variant"] == "torch.compile"}
    lines = [
        "| caches | variant | first step s | / torch.compile | of it, the torch.compile call s | AOTAutograd cache |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        seconds, reference = row.get("first_call_s"), base.get(row["phase"])
        ratio = f"{seconds / reference:.2f}" if seconds and reference else "-"
        verdict = ", ".join(f"{k.removeprefix('autograd_cache_')}" for k in row.get("aot_autograd_cache", {}))
        shown = f"{seconds:.1f}" if seconds else f"error: {row.get('error', '')[-120:]}"
        setup = row.get("torch_compile_call_s")
        setup = f"{setup:.2f}" if setup is not None else "-"
        lines.append(f"| {row['phase']} | {row['variant']} | {shown} | {ratio} | {setup} | {verdict or '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt2", help="one model of benchmarks/e2e.py")
    parser.add_argument("--attention", default="eager")
    parser.add_argument("--dropout", default="config")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="names of VARIANTS, comma-separated")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--layers", type=int, default=None, help="blocks of the model (default: its config's)")
    parser.add_argument("--profile", type=Path, default=None, help="cProfile each first call; summaries go here")
    parser.add_argument(
        "--sample", type=Path, default=None,
        help="sample every thread's stack during each first call (wall-clock, collapsed stacks); files go here",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=Path("benchmark_results"))
    args = parser.parse_args(argv)
    if args.child is not None:
        row = child(
            args.models, args.attention, args.dropout, args.batch, args.seq, args.child, args.tiny, args.layers,
            args.profile, args.sample,
        )
        print(json.dumps(row), flush=True)
        return [row]
    rows = []
    with tempfile.TemporaryDirectory(prefix="memopt-first-call-") as root:
        for phase in ("cold", "warm"):
            for number, variant in enumerate(args.variants.split(",")):
                cache_dir = str(Path(root) / f"variant{number}")  # its own: no variant warms another's kernels
                rows.append(run_variant(args, variant, cache_dir, phase))
                print(json.dumps(rows[-1]), flush=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    title = header(f"First step, {args.models} ({args.attention} attention), {args.batch} × {args.seq}", device)
    write_report(args.out, "first_call.md", f"{title}\n\n{table(rows)}")
    (args.out / "first_call.json").write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
