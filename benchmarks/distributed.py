"""Data-parallel training steps per GPU: plain torch.compile, memopt, memopt + WTA-CRS 0.3, under DDP and FSDP2.

    torchrun --standalone --nproc-per-node 2 benchmarks/distributed.py --out $OUT/distributed
    torchrun --standalone --nproc-per-node 2 benchmarks/distributed.py --max-batch --out $OUT/distributed
    python benchmarks/distributed.py --smoke --out /tmp/distributed      # CPU, 2 gloo processes, tiny models

Each case (parallelism × model × variant) builds the model from one seed (GPT-2 small, or Llama-3.2-1B's shape:
vocabulary 128256, hidden 2048, 16 layers, 32/8 heads, intermediate 8192), wraps it (DDP, or ``fully_shard`` on
every block then the root), compiles it whole (``--compile blocks``: each block alone, classifier + loss in one
graph) and trains with AdamW under bf16 autocast, fp32 weights. Rank 0 appends one JSON line per case to
``OUT/distributed.jsonl`` as it ends:

- ``check``: loss and gradients (gathered whole) after one step from the same weights and batch, against
  torch.compile's: ``loss_abs_diff``, ``grad_max_rel_diff`` (max over parameters of ‖g − g_tc‖ / ‖g_tc‖) and
  ``match`` (both within ``--tol``);
- timing: median step (forward, backward, optimizer) over ``--steps`` after ``--warmup``, the slowest rank's,
  with the variants of a model compiled side by side and their steps taken in turns (``--sequential``: each
  alone, freed before the next, for GPUs that cannot hold them all); tokens/s over all ranks; peak allocated
  per GPU (a list, one per rank) as if the variant were alone: what a step adds, plus what the variant keeps
  between steps (weights, optimizer state, DDP's buckets); the first step's time (compilation);
- ``--max-batch``: the largest per-GPU batch that steps without running out of memory (doubling, then bisection;
  every rank must succeed);
- the rewrites memopt applied on each rank.

A failing case records its error and the run goes on. Reuses ``examples/distributed/train.py`` (wrapping,
compiling, gathering gradients), so the benchmark steps what the tests check.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script (torchrun benchmarks/distributed.py): import from the repository
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

from benchmarks._common import error_note, in_turns, release_memory
from examples.distributed.train import Setup, compiled_step, free_port, full_grads, make_batch

log = logging.getLogger("benchmarks.distributed")

VARIANTS = ("torch.compile", "memopt", "memopt+wta")


@dataclasses.dataclass
class Row:
    parallel: str
    compile: str
    model: str
    variant: str
    world: int
    batch: int
    seq: int
    device: str = ""
    step_ms: float | None = None
    tokens_per_s: float | None = None
    peak_mib: list[float] | None = None  # one per rank
    first_step_s: float | None = None
    loss_abs_diff: float | None = None
    grad_max_rel_diff: float | None = None
    match: bool | None = None
    max_batch: int | None = None
    rewrites: list[str] | None = None  # per rank
    error: str | None = None
    tol: float = 2e-2  # the check's relative tolerance


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def applied_rewrites() -> str:
    import fxpass

    rules = [r.rule for report in fxpass.reports() for r in report.records if r.applied]
    return ", ".join(f"{rule}×{rules.count(rule)}" for rule in sorted(set(rules)))


def gather(value: Any) -> list[Any]:
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def comm_device() -> torch.device:
    """Where collectives take their tensors: NCCL needs them on this rank's GPU, gloo on the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def slowest(value: float) -> float:
    """The largest value over ranks: a data-parallel step is as slow as its slowest rank."""
    tensor = torch.tensor([value], dtype=torch.float64, device=comm_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def all_ok(ok: bool) -> bool:
    """Whether every rank's ``ok`` holds."""
    flag = torch.tensor([0 if ok else 1], device=comm_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0


def new_step(variant: str, setup: Setup, device: torch.device) -> tuple[torch.nn.Module, Callable, Callable]:
    """(model, train step of a batch returning the loss, optimizer step). Dynamo's caches are left alone, so that
    cases compiled before stay compiled (the caller resets between groups of cases)."""
    import fxpass

    fxpass.clear_reports()
    model, step = compiled_step(variant, setup, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)

    def train_step(batch) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=setup.autocast):
            loss = step(*batch)
        loss.backward()
        return loss

    def optimizer_step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return model, train_step, optimizer_step


def compare(row: Row, loss: float, grads: dict, reference: tuple[float, dict]) -> None:
    """Fill the check's fields against torch.compile's loss and gradients on this rank (slowest rank's figures).

    WTA-CRS estimates weight gradients, so for ``memopt+wta`` only the loss (an exact forward) decides
    ``match``; its gradient difference is reported as the estimate's deviation after one step."""
    ref_loss, ref_grads = reference
    rel = [((grads[n] - g).norm() / g.norm().clamp_min(1e-30)).item() for n, g in ref_grads.items() if g is not None]
    row.loss_abs_diff = slowest(abs(loss - ref_loss))
    row.grad_max_rel_diff = slowest(max(rel))
    row.match = row.loss_abs_diff <= row.tol * max(abs(ref_loss), 1.0) and (
        row.variant == "memopt+wta" or row.grad_max_rel_diff <= row.tol
    )


@dataclasses.dataclass
class Case:
    """A compiled, warmed-up variant, ready to be timed beside the others."""

    row: Row
    step: Callable[[], None]  # a train step and an optimizer step
    resident_bytes: int  # what the case keeps between steps on this rank: weights, optimizer state, buckets


def allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def prepare(row: Row, setup: Setup, args, device: torch.device, reference) -> tuple[Case | None, tuple | None]:
    """Compile and take the first step (checked against ``reference``, torch.compile's loss and gathered
    gradients, when ``--check``), then warm up. Returns the case (None with ``--no-timing``) and this case's
    (loss, gradients) when it is the reference."""
    before = allocated(device)
    model, train_step, optimizer_step = new_step(row.variant, setup, device)
    batch = make_batch(model.config.vocab_size, row.batch, row.seq, dist.get_rank(), device)
    start = time.perf_counter()
    loss = train_step(batch).item()
    sync(device)
    row.first_step_s = slowest(time.perf_counter() - start)
    row.rewrites = gather(applied_rewrites())
    kept = None
    if args.check:
        grads = full_grads(model)
        if reference is None:
            kept = (loss, grads)
        else:
            compare(row, loss, grads, reference)
        del grads
    optimizer_step()
    if args.no_timing:
        return None, kept

    def step() -> None:
        train_step(batch)
        optimizer_step()

    for _ in range(args.warmup):
        step()
    sync(device)
    return Case(row, step, allocated(device) - before), kept


def step_ms(step: Callable[[], None], device: torch.device) -> float:
    """One step's wall time, from an idle device to an idle device."""
    sync(device)
    begin = time.perf_counter()
    step()
    sync(device)
    return (time.perf_counter() - begin) * 1e3


def time_cases(cases: list[Case], steps: int, device: torch.device) -> None:
    """Time the cases' steps in turns (a step of each, ``steps`` times), so that drift of clocks and neighbours
    reaches every case alike; then each case's peak per rank: what one step adds to what is allocated, plus what
    the case keeps between steps, as if it were alone on the GPU. A case that fails leaves the turns."""
    timed = [lambda case=case: step_ms(case.step, device) for case in cases]
    for case, (times, error) in zip(cases, in_turns(steps, timed), strict=True):
        row = case.row
        if error is not None:  # (ranks run the same shapes, so they fail together)
            log.error("case %s failed while timed", row.variant, exc_info=error)
            row.error = error_note(error)
            continue
        row.step_ms = slowest(statistics.median(times))
        row.tokens_per_s = row.world * row.batch * row.seq / row.step_ms * 1e3
        if device.type == "cuda":
            sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = allocated(device)
            case.step()
            sync(device)
            peak = torch.cuda.max_memory_allocated(device) - before + case.resident_bytes
            row.peak_mib = gather(peak / 2**20)


def two_steps(variant: str, setup: Setup, batch: int, device: torch.device) -> None:
    torch._dynamo.reset()
    model, train_step, optimizer_step = new_step(variant, setup, device)
    data = make_batch(model.config.vocab_size, batch, setup.seq, dist.get_rank(), device)
    for _ in range(2):
        train_step(data)
        optimizer_step()
    sync(device)


def fits(variant: str, setup: Setup, batch: int, device: torch.device) -> bool:
    """Two steps at ``batch`` per GPU on every rank without running out of memory. (An out-of-memory error on
    one rank only, in the middle of a collective, would leave the others waiting: the ranks run the same
    shapes, so they run out together.)"""
    try:
        two_steps(variant, setup, batch, device)
        ok = True
    except torch.OutOfMemoryError:
        ok = False  # the step's tensors went with its frame, once this handler ends
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return all_ok(ok)


def largest_batch(fits_at: Callable[[int], bool], start: int, limit: int) -> int:
    """The largest batch in [1, limit] for which ``fits_at`` holds, assuming it holds below any batch it holds
    at: doubling from ``start``, then bisection. 0 when even 1 does not fit."""
    low, high = 0, None
    batch = max(1, start)
    while high is None and batch <= limit:
        if fits_at(batch):
            low, batch = batch, batch * 2
        else:
            high = batch
    high = high if high is not None else limit + 1
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits_at(middle) else (low, middle)
    return low


def new_row(parallel: str, model: str, variant: str, setup: Setup, args, device: torch.device) -> Row:
    return Row(parallel, args.compile, model, variant, dist.get_world_size(), setup.batch, setup.seq,
               device=device_name(device), tol=args.tol)


def run_group(parallel: str, model: str, variants: list[str], args, device: torch.device, reference) -> tuple:
    """The rows of ``variants`` (one, or all of a model with the default alternating timing), compiled one after
    the other, then timed in turns; and torch.compile's (loss, gradients) when it is among them."""
    setup = case_setup(parallel, model, args)
    rows, cases = [], []
    try:
        torch._dynamo.reset()
        for variant in variants:
            row = new_row(parallel, model, variant, setup, args, device)
            rows.append(row)
            try:
                case, kept = prepare(row, setup, args, device, reference)
                reference = kept if variant == "torch.compile" else reference
                cases += [case] if case is not None else []
            except Exception as error:  # one failing case must not end the run
                log.exception("case %s %s %s failed", parallel, model, variant)
                row.error = error_note(error)
        time_cases(cases, args.steps, device)
    finally:
        cases.clear()
        release_memory()
    if args.max_batch:
        for row in rows:
            row.max_batch = max_batch(row.variant, setup, args, device)
    return rows, reference


def max_batch(variant: str, setup: Setup, args, device: torch.device) -> int | None:
    try:
        return largest_batch(lambda b: fits(variant, setup, b, device), setup.batch, args.max_batch_limit)
    except Exception:  # the row keeps its timing; the search's failure is logged
        log.exception("largest batch of %s failed", variant)
        return None
    finally:
        release_memory()


def case_setup(parallel: str, model: str, args) -> Setup:
    default_batch, default_seq = (4, 2048) if model == "llama-1b" else (8, 1024)
    options = json.loads(args.memopt_options)
    if args.smoke:
        options = {"force": True, "wta_crs_min_tokens": 1, **options}
    return Setup(
        parallel=parallel, compile=args.compile, model=model, full=not args.smoke, attention=args.attention,
        inner=args.inner, mode=args.mode, bucket_mb=args.bucket_mb,
        optimize_ddp={"True": True, "False": False}.get(args.optimize_ddp, args.optimize_ddp),
        batch=args.batch or default_batch,
        seq=args.seq or default_seq, autocast=not args.fp32, options=options,
    )


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def worker(rank: int, world: int, port: int, args) -> None:
    logging.basicConfig(level=logging.INFO, format=f"[rank{rank}] %(message)s")
    from examples.distributed.train import init

    os.environ.setdefault("MASTER_PORT", str(port))
    device = init(rank, world, port)
    dist.barrier()
    out = Path(args.out)
    variants = args.variants.split(",")
    groups = [[variant] for variant in variants] if args.sequential else [variants]
    try:
        for parallel in args.parallel.split(","):
            for model in args.models.split(","):
                reference = None
                for group in groups:
                    rows, reference = run_group(parallel, model, group, args, device, reference)
                    for row in rows if rank == 0 else []:
                        write_row(out, row)
    finally:
        dist.destroy_process_group()


def write_row(out: Path, row: Row) -> None:
    out.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"date": datetime.date.today().isoformat(), "torch": torch.__version__,
                       **dataclasses.asdict(row)})
    log.info("%s", line)
    with (out / "distributed.jsonl").open("a") as jsonl:
        jsonl.write(line + "\n")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parallel", default="ddp,fsdp", help="ddp, fsdp or both, comma-separated")
    parser.add_argument("--models", default="gpt2,llama-1b")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="torch.compile first: the reference")
    parser.add_argument("--compile", choices=["whole", "blocks"], default="whole")
    parser.add_argument("--attention", default="sdpa", help="HF attn_implementation (eager: memopt's flash rewrite)")
    parser.add_argument("--inner", default="inductor", choices=["inductor", "aot_eager"])
    parser.add_argument("--mode", default=None, help="torch.compile mode for every variant")
    parser.add_argument("--bucket-mb", type=float, default=None, help="DDP bucket_cap_mb (default: DDP's 25)")
    parser.add_argument("--optimize-ddp", default="True", choices=["True", "False", "python_reducer"],
                        help="torch._dynamo.config.optimize_ddp (True: Dynamo splits the graph at DDP's buckets)")
    parser.add_argument("--batch", type=int, default=None, help="per GPU; default 8 (GPT-2) or 4 (Llama)")
    parser.add_argument("--seq", type=int, default=None, help="default 1024 (GPT-2) or 2048 (Llama)")
    parser.add_argument("--fp32", action="store_true", help="no bf16 autocast")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--sequential", action="store_true",
                        help="time each variant alone, freed before the next (default: all of a model in turns)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                        help="compare loss and gradients after one step with torch.compile's")
    parser.add_argument("--tol", type=float, default=2e-2, help="relative tolerance of the check (bf16)")
    parser.add_argument("--no-timing", action="store_true", help="only the first step (and its check)")
    parser.add_argument("--max-batch", action="store_true", help="search the largest per-GPU batch")
    parser.add_argument("--max-batch-limit", type=int, default=512)
    parser.add_argument("--memopt-options", default="{}", help="memopt options as JSON")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, 2 gloo processes, tiny models, aot_eager, fp32, one timed step")
    parser.add_argument("--world", type=int, default=2, help="processes to spawn when not under torchrun")
    parser.add_argument("--out", type=Path, default=Path("benchmark_results"))
    args = parser.parse_args(argv)
    if args.smoke:
        args.inner, args.fp32, args.steps, args.warmup = "aot_eager", True, 1, 0
        args.batch, args.seq, args.attention = args.batch or 2, args.seq or 16, "eager"
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.smoke:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the smoke run is the CPU one, on any machine
    if "RANK" in os.environ:  # torchrun
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), 0, args)
        return
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(args.world, free_port(), args), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
