"""A training step at a fixed batch under ``memory_budget``, beside torch.compile with and without
``activation_memory_budget``: the measured peak, the step time, and memopt's prediction of each.

    python -m benchmarks.budget --model llama-1b --batch 4 --out $OUT/budget
    python -m benchmarks.budget --model llama-1b --batch 4 \\
        --configs torch.compile,memopt,memopt+budget0.7,memopt+budget0.5,memopt+budget0.35,torch.compile+budget0.5
    python -m benchmarks.budget --tiny --device cpu --inner aot_eager --steps 2      # a smoke run of the script

Every configuration compiles its own copy of the model (same seed) in this one process; then their steps
alternate (``benchmarks/e2e.py``'s ``measure_interleaved``), so drift reaches every median alike, and each
step's peak is measured above what was allocated before it (weights and the previous step's gradients). The
configurations are ``benchmarks/max_batch.py``'s (built by its ``build_step``: bf16 weights, SDPA, the model's
own sequence length), plus ``memopt+budgetF``: memopt with ``memory_budget=F``, a fraction of torch.compile's
simulated peak. The predicted peaks come from the budget plan's report (``fxpass.budget.BudgetPlan``): its
torch.compile and memopt figures without the plan and with it, simulated before anything ran.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import time
from pathlib import Path

import torch

from benchmarks import e2e, max_batch
from benchmarks._common import error_note, header, ratio, release_memory, set_up, write_report

log = logging.getLogger("benchmarks.budget")

DEFAULT_CONFIGS = (
    "torch.compile,memopt,memopt+budget0.7,memopt+budget0.5,memopt+budget0.35,torch.compile+budget0.5,"
    "torch.compile+budget0.3,torch.compile+checkpointing"
)
MiB = 1 << 20


@dataclasses.dataclass
class Result:
    """One configuration's row: the e2e row (time, peak, first call, rewrites) and what memopt predicted."""

    configuration: str
    row: e2e.Row
    plan: str = ""
    predicted_mib: float | None = None  # the budget plan's simulated peak for this configuration
    predicted_torch_compile_mib: float | None = None


def configuration(name: str) -> max_batch.Configuration:
    """A known configuration by name, or ``memopt+budgetF`` (``memory_budget=F``)."""
    known = max_batch.CONFIGURATIONS.get(name)
    if known is not None:
        return known
    match = re.fullmatch(r"memopt\+budget([0-9.]+)", name)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"unknown configuration {name!r}: one of {', '.join(max_batch.CONFIGURATIONS)} or memopt+budgetF")
    return max_batch.Configuration(name, compiler="memopt", options={"memory_budget": float(match[1])})


def spec(args: argparse.Namespace, chosen: max_batch.Configuration) -> max_batch.TrialSpec:
    seq = args.seq or (max_batch.TINY_SEQ if args.tiny else max_batch.SEQ[args.model])
    return max_batch.TrialSpec(
        model=args.model, flow=args.flow, cap="card", configuration=dataclasses.asdict(chosen), batch=args.batch,
        seq=seq, steps=args.steps, device=args.device, inner=args.inner, tiny=args.tiny, dropout=args.dropout,
    )


def plan_of_last_compile() -> tuple[str, float | None, float | None]:
    """The budget plan of the graphs the last first call compiled: its summary, memopt's simulated peak with it,
    and torch.compile's; blanks where no plan was made."""
    import fxpass
    from fxpass.budget import BudgetPlan

    plans = [report.budget for report in fxpass.reports() if report.budget is not None]
    made = [plan for plan in plans if isinstance(plan, BudgetPlan)]
    if not made:
        return ("; ".join(str(plan) for plan in plans), None, None)
    largest = max(made, key=lambda plan: plan.torch_compile)  # the step's graph (one graph in these flows)
    return ("; ".join(largest.measures) or "nothing added", largest.after / MiB, largest.torch_compile / MiB)


def run(args: argparse.Namespace) -> list[Result]:
    device = torch.device(args.device)
    results: list[Result] = []
    prepared = []
    for name in args.configs.split(","):
        chosen = configuration(name)
        trial = spec(args, chosen)
        try:
            one_step, row = max_batch.build_step(trial, device)
        except Exception as error:  # one failing configuration must not end the table
            row = e2e.Row(args.model, "sdpa", args.dropout, args.flow, name, args.batch * trial.seq)
            row.error = error_note(error)
            results.append(Result(name, row))
            continue
        result = Result(name, row)
        results.append(result)
        try:
            e2e.first_call(row, one_step, device)
            result.plan, result.predicted_mib, result.predicted_torch_compile_mib = plan_of_last_compile()
            prepared.append((row, one_step))
        except Exception as error:
            row.error = error_note(error)
        log.info("%s: first call %.1f s; %s", name, row.first_call_s or 0.0, result.plan)
    e2e.measure_interleaved(args.steps, prepared, device)
    prepared.clear()
    release_memory()
    return results


def table(results: list[Result]) -> str:
    baseline = next((r.row for r in results if r.configuration == max_batch.BASELINE and not r.row.error), None)
    lines = [
        "| configuration | peak MiB | × torch.compile | step ms | × torch.compile | predicted MiB | predicted / "
        "measured | plan | first call s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        row = result.row
        if row.error:
            lines.append(f"| {result.configuration} | {row.error} |  |  |  |  |  |  |  |")
            continue
        peak = f"{row.peak_mib:.0f}" if row.peak_mib is not None else "-"
        step = f"{row.step_ms:.1f}" if row.step_ms is not None else "-"
        predicted = f"{result.predicted_mib:.0f}" if result.predicted_mib is not None else "-"
        lines.append(
            f"| {result.configuration} | {peak} | {ratio(row.peak_mib, baseline and baseline.peak_mib)} | {step} "
            f"| {ratio(row.step_ms, baseline and baseline.step_ms)} | {predicted} | "
            f"{ratio(result.predicted_mib, row.peak_mib)} | {result.plan} | {row.first_call_s or 0:.0f} |"
        )
    predicted = next((r.predicted_torch_compile_mib for r in results if r.predicted_torch_compile_mib), None)
    if predicted and baseline is not None and baseline.peak_mib:
        lines.append("")
        lines.append(f"torch.compile's peak as the plans simulated it: {predicted:.0f} MiB "
                     f"({predicted / baseline.peak_mib:.2f}× the measured).")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    parsed = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parsed.add_argument("--model", default="llama-1b", choices=list(max_batch.SEQ))
    parsed.add_argument("--flow", default="loss_only", choices=list(max_batch.FLOWS))
    parsed.add_argument("--batch", type=int, default=4)
    parsed.add_argument("--seq", type=int, default=None, help="default: the model's (GPT-2 1024, Llama 2048)")
    parsed.add_argument("--configs", default=DEFAULT_CONFIGS)
    parsed.add_argument("--steps", type=int, default=10)
    parsed.add_argument("--dropout", default="config")
    parsed.add_argument("--inner", default="inductor")
    parsed.add_argument("--tiny", action="store_true", help="small models: check the script, not the numbers")
    parsed.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parsed.add_argument("--out", type=Path, default=Path("benchmark_results"))
    return parsed


def main(argv: list[str] | None = None) -> list[Result]:
    args = parser().parse_args(argv)
    set_up(args.out, quiet_rules=True)
    start = time.perf_counter()
    results = run(args)
    device = torch.device(args.device)
    title = header(f"memory_budget at a fixed batch: {args.model} {args.flow}, batch {args.batch}", device)
    text = f"{title}\n\n{table(results)}\n\n({time.perf_counter() - start:.0f} s in all)"
    write_report(args.out, "budget.md", text)
    rows = [{**dataclasses.asdict(r.row), "configuration": r.configuration, "plan": r.plan,
             "predicted_mib": r.predicted_mib, "predicted_torch_compile_mib": r.predicted_torch_compile_mib}
            for r in results]
    (args.out / "budget.json").write_text(json.dumps(rows, indent=1))
    return results


if __name__ == "__main__":
    main()
