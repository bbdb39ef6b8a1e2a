"""Training-level numerics (Golden et al. 2024, §V): how far memopt's rewrites move the trained weights, next
to the deviations everyone already accepts (another seed, bf16 instead of fp32 training).

    python benchmarks/numerics_training.py --time-limit 420 --out $OUT/numerics_training   # GPU, ~6 min on an H200
    python benchmarks/numerics_training.py --smoke --out /tmp/numerics_smoke    # CPU, tiny model, 5 steps, < 1 min

Golden et al. ("Is Flash Attention Stable?", arXiv 2405.02803, §V) train one model twice, differing only in the
attention implementation, and track the difference of the weights over training: the largest |Δw| and the
Wasserstein distance between the two weight distributions. Against a different-seed run and a low-precision
run they find flash attention's deviation 2–5× below low-precision training's. This script asks the same of
each memopt rewrite. Every run starts from the same initial weights (a deep copy of one model), sees the same
batches in the same order and trains the nanoGPT-style model of ``examples/gpt.py`` on the standard library's
sources (``examples/train_gpt.py``'s data) with AdamW under bf16 autocast, compiled as users do:
``torch.compile(model, backend=...)``, the step keeps the loss and drops the logits. Runs, one after another
in this process:

- (a) torch.compile; (a2) the same again: the run-to-run floor (zero on a CPU; on CUDA atomic adds, as in
  Inductor's embedding backward, can make it nonzero);
- (b) memopt, default rewrites (cut cross-entropy, flash attention);
- (c) memopt with WTA-CRS at budget 0.3;
- (d) memopt with CCE's gradient filter (``cce_filter_eps="auto"``). The filter only applies where the graph
  returns just the loss (memopt declines to filter a loss whose logits the graph returns), so (d) compiles
  ``lambda x, y: model(x, y)[1]``, and (d0) is that same step with exact gradients, the filter's control
  (both pin ``cce_variant="chunked"``, the op the filter belongs to);
- (e) torch.compile with another seed for data order (and dropout, when ``--dropout`` > 0);
- (f) torch.compile in fp32, TF32 off: the high-precision reference.

At checkpoints every run's weights are compared with (a)'s and (f)'s at the same step (their snapshots are
kept): per tensor the largest |Δw|, the Wasserstein-1 distance between the two weight distributions and the
relative Frobenius difference ‖w − w_ref‖ / ‖w_ref‖. Every deviation is also given as a ratio to (f) vs (a),
bf16 against fp32 training, as the paper reports it. The JSON is rewritten after every checkpoint, the
markdown table and plots after every run, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fxpass
from benchmarks._common import error_note, header, release_memory, write_report
from examples.gpt import GPT, GPTConfig
from examples.train_gpt import build_dataset, eval_batches, evaluate, get_batch, make_step
from lowerings.wta_crs import reset_estimates

log = logging.getLogger("benchmarks.numerics_training")

Weights = dict[str, torch.Tensor]
Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

METRICS = ("max_abs", "w1", "rel_fro")
METRIC_LABELS = {"max_abs": "max |Δw|", "w1": "Wasserstein-1", "rel_fro": "rel. Frobenius"}
REFERENCES = ("a", "f")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One training run: the backend, memopt's options, the precision, the data/dropout seed and the step."""

    key: str
    label: str
    backend: str  # "compile" (plain torch.compile) or "memopt"
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    precision: str = "bf16"  # "bf16": fp32 weights under bf16 autocast; "fp32": no autocast, TF32 off
    seed_offset: int = 0  # added to --seed for the data order and dropout
    loss_only: bool = False  # compile ``model(x, y)[1]`` instead of the model (the filter needs it)


# Execution order: the two references first (every later run compares with their snapshots), then the
# controls and the rewrites.
VARIANTS: dict[str, Variant] = {
    v.key: v
    for v in (
        Variant("a", "torch.compile (bf16 autocast)", "compile"),
        Variant("f", "torch.compile, fp32 (TF32 off)", "compile", precision="fp32"),
        Variant("e", "torch.compile, other seed (data order, dropout)", "compile", seed_offset=1),
        Variant("b", "memopt (CCE, attention)", "memopt"),
        Variant("c", "memopt + WTA-CRS 0.3", "memopt", {"wta_crs_budget": 0.3}),
        # The filter belongs to the chunked CCE op; its control pins that op (a loss-only step could otherwise
        # get the row-wise one), so that (d) and (d0) differ by the filter alone.
        Variant(
            "d",
            "memopt + CCE gradient filter (auto), loss-only step",
            "memopt",
            {"cce_filter_eps": "auto", "cce_variant": "chunked"},
            loss_only=True,
        ),
        Variant(
            "d0",
            "memopt, loss-only step, exact (the filter's control)",
            "memopt",
            {"cce_variant": "chunked"},
            loss_only=True,
        ),
        Variant("a2", "torch.compile again (run-to-run floor)", "compile"),
    )
}

# Sizes: (GPU, --smoke). The GPU model is small enough for 2000 steps of all eight runs in one device call.
SIZES: dict[str, tuple[Any, Any]] = {
    "steps": (2000, 5),
    "every": (100, 2),
    "batch_size": (16, 2),
    "seq_len": (256, 16),
    "vocab_size": (16384, 512),
    "n_layer": (4, 1),
    "n_head": (4, 2),
    "n_embd": (256, 32),
    "data_mb": (16.0, 0.3),
    "eval_batches": (4, 1),
}
# At the smoke test's toy sizes memopt's memory model declines every rewrite; force them, with the eager-graph
# inner compiler for speed.
SMOKE_MEMOPT_OPTIONS = {"force": True, "min_saved_bytes": 0, "wta_crs_min_tokens": 1, "inner_compiler": "aot_eager"}


# --- metrics ---------------------------------------------------------------------------------------------


def wasserstein1(a: torch.Tensor, b: torch.Tensor) -> float:
    """W1 between the empirical distributions of ``a`` and ``b`` (equal sizes): the mean |sort(a) − sort(b)|.

    For two 1-D samples of equal size the optimal transport pairs order statistics (Villani, "Optimal Transport:
    Old and New", 2009, Rem. 2.19; Ramdas et al., "On Wasserstein Two-Sample Testing", 2017, §2), so no scipy."""
    if a.numel() != b.numel():
        raise ValueError(f"W1 by sorting needs equal sizes, got {a.numel()} and {b.numel()}")
    diff = torch.sort(a.detach().flatten().double()).values - torch.sort(b.detach().flatten().double()).values
    return diff.abs().mean().item()


def tensor_deviation(w: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """The three per-tensor deviations of ``w`` from ``ref``."""
    diff = w.detach().double() - ref.detach().double()
    ref_norm = ref.detach().double().norm().item()
    return {
        "max_abs": diff.abs().max().item(),
        "w1": wasserstein1(w, ref),
        "rel_fro": diff.norm().item() / ref_norm if ref_norm else math.inf,
    }


def weights_deviation(weights: Weights, ref: Weights) -> dict[str, Any]:
    """Per-tensor deviations and a summary: the largest |Δw| of all, the numel-weighted mean of the tensors'
    W1 (the distributions differ per tensor, so they are not pooled) and the relative Frobenius difference
    of all parameters together."""
    tensors = {name: tensor_deviation(weights[name], ref[name]) for name in ref}
    sizes = {name: ref[name].numel() for name in ref}
    total = sum(sizes.values())
    diff_sq = sum((weights[n].double() - ref[n].double()).pow(2).sum().item() for n in ref)
    ref_sq = sum(ref[n].double().pow(2).sum().item() for n in ref)
    summary = {
        "max_abs": max(t["max_abs"] for t in tensors.values()),
        "w1": sum(tensors[n]["w1"] * sizes[n] for n in ref) / total,
        "rel_fro": math.sqrt(diff_sq / ref_sq) if ref_sq else math.inf,
    }
    return {"summary": summary, "tensors": tensors}


def snapshot(model: torch.nn.Module) -> Weights:
    """A detached copy of the trainable weights (tied weights once), on the model's device."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def checkpoint_steps(steps: int, every: int) -> list[int]:
    """Early log-spaced steps (where deviations first appear), then every ``every`` steps, and the last."""
    early = {s for s in (1, 3, 10, 30) if s < every}
    return sorted(s for s in early | set(range(every, steps + 1, every)) | {steps} if 1 <= s <= steps)


# --- training --------------------------------------------------------------------------------------------


def resolve_sizes(args: argparse.Namespace) -> None:
    """Sizes left unset get the GPU defaults, or the tiny ones with ``--smoke``."""
    column = 1 if args.smoke else 0
    for name, values in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, values[column])


def memopt_options(variant: Variant, smoke: bool) -> dict[str, Any]:
    """The variant's memopt options, plus the smoke test's forcing ones."""
    return {**(SMOKE_MEMOPT_OPTIONS if smoke else {}), **variant.options}


def compile_step(variant: Variant, model: GPT, smoke: bool) -> Step:
    """The variant's forward: the model compiled as users do, its logits dropped (or the loss-only step)."""
    if variant.backend == "memopt":
        backend: Any = fxpass.MemoptBackend(options=memopt_options(variant, smoke))
    else:
        backend = "aot_eager" if smoke else "inductor"
    if variant.loss_only:
        return torch.compile(lambda x, y: model(x, y)[1], backend=backend)
    return make_step(torch.compile(model, backend=backend))


def make_optimizer(model: GPT, lr: float, device: torch.device) -> torch.optim.Optimizer:
    """AdamW as nanoGPT sets it up; fused on CUDA (one kernel, the same arithmetic in every run)."""
    fused = device.type == "cuda"
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)


def train_step(
    step: Step, model: GPT, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor], precision: str
) -> torch.Tensor:
    """One optimizer step; returns the loss (a device tensor: no synchronization per step)."""
    x, y = batch
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        loss = step(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def applied_rewrites() -> dict[str, int]:
    """Applied decisions per rule over the graphs memopt compiled (a graph compiled twice counts once)."""
    latest = {report.graph_id: report for report in fxpass.reports()}.values()
    counts: dict[str, int] = {}
    for report in latest:
        for record in report.records:
            if record.applied:
                counts[record.rule] = counts.get(record.rule, 0) + 1
    return counts


@dataclasses.dataclass
class Context:
    """What every run shares: the data, the initial model, the settings, and where results go."""

    args: argparse.Namespace
    device: torch.device
    train_tokens: torch.Tensor
    val_batches: list[tuple[torch.Tensor, torch.Tensor]]
    initial: GPT
    marks: list[int]
    record: dict[str, Any]
    snapshots: dict[str, dict[int, Weights]] = dataclasses.field(default_factory=dict)
    deadline: float | None = None  # perf_counter() after which no run starts and a running one stops

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.perf_counter() > self.deadline


def compare(ctx: Context, key: str, step: int, weights: Weights) -> dict[str, Any]:
    """This checkpoint's deviations from each reference that has a snapshot at ``step``."""
    out = {}
    for ref in REFERENCES:
        if ref != key and step in ctx.snapshots.get(ref, {}):
            out[ref] = weights_deviation(weights, ctx.snapshots[ref][step])
    return out


def run_variant(ctx: Context, variant: Variant) -> dict[str, Any]:
    """Train one variant from the shared initial weights, comparing at every checkpoint; the result is
    filled into ``ctx.record`` as it grows (and written out at each checkpoint)."""
    args, device = ctx.args, ctx.device
    release_memory()
    fxpass.clear_reports()
    reset_estimates()
    seed = args.seed + variant.seed_offset
    torch.manual_seed(seed)  # dropout and WTA-CRS sampling
    model = copy.deepcopy(ctx.initial)
    model.train()
    step_fn = compile_step(variant, model, args.smoke)
    optimizer = make_optimizer(model, args.lr, device)
    batches = torch.Generator().manual_seed(1000 + seed)
    result: dict[str, Any] = {
        "label": variant.label,
        "backend": variant.backend,
        "options": memopt_options(variant, args.smoke) if variant.backend == "memopt" else {},
        "precision": variant.precision,
        "seed": seed,
        "loss_only_step": variant.loss_only,
        "status": "running",
        "losses": [],
        "checkpoints": [],
    }
    ctx.record["runs"][variant.key] = result
    keep = variant.key in REFERENCES
    if keep:
        ctx.snapshots[variant.key] = {}
    pending: list[torch.Tensor] = []
    train_seconds, start = 0.0, time.perf_counter()
    for step in range(1, args.steps + 1):
        batch = get_batch(ctx.train_tokens, args.batch_size, args.seq_len, batches, device)
        pending.append(train_step(step_fn, model, optimizer, batch, variant.precision))
        if step == 1:
            pending[-1].item()  # wait for the step: its time is mostly compilation
            result["first_step_s"] = time.perf_counter() - start
            result["rewrites"] = applied_rewrites()
            start = time.perf_counter()
        if step not in ctx.marks:
            continue
        result["losses"] += torch.stack(pending).float().cpu().tolist()  # waits for the steps
        train_seconds += time.perf_counter() - start
        pending.clear()
        weights = snapshot(model)
        if keep:
            ctx.snapshots[variant.key][step] = weights
        point = {
            "step": step,
            "val_loss": evaluate(model, ctx.val_batches),
            "vs": compare(ctx, variant.key, step, weights),
        }
        result["checkpoints"].append(point)
        write_json(ctx)
        if ctx.out_of_time() and step < args.steps:
            result["status"] = f"stopped at step {step} (--time-limit)"
            break
        start = time.perf_counter()  # the checkpoint's work is not training time
    if len(result["losses"]) > 1:  # the first step, mostly compilation, is timed apart
        result["step_ms"] = 1e3 * train_seconds / (len(result["losses"]) - 1)
    result["rewrites"] = applied_rewrites()  # the backward compiles at the first backward: count again
    if variant.backend == "memopt" and "cce_filter_eps" in variant.options and device.type != "cuda":
        result["note"] = "the gradient filter is CUDA-only: on this device the CCE backward stays exact"
    if result["status"] == "running":
        result["status"] = "done"
    if not math.isfinite(sum(result["losses"])):
        log.warning("%s: a loss is not finite", variant.key)
    log.info(
        "(%s) %s: final loss %.4f, %s ms/step, first step %.1f s, rewrites %s",
        variant.key,
        variant.label,
        result["losses"][-1],
        f"{result['step_ms']:.1f}" if "step_ms" in result else "—",
        result["first_step_s"],
        result["rewrites"],
    )
    return result


def backfill(ctx: Context) -> None:
    """(a) ran before (f) had snapshots: give (a)'s checkpoints their comparison with (f) afterwards."""
    a = ctx.record["runs"].get("a")
    if a is None or "f" not in ctx.snapshots:
        return
    for point in a["checkpoints"]:
        f_weights = ctx.snapshots["f"].get(point["step"])
        a_weights = ctx.snapshots["a"].get(point["step"])
        if f_weights is not None and a_weights is not None:
            point["vs"]["f"] = weights_deviation(a_weights, f_weights)


# --- output ----------------------------------------------------------------------------------------------


def write_json(ctx: Context) -> None:
    """Rewrite the JSON record (atomically: a killed run leaves the previous version)."""
    path = ctx.args.out / "numerics_training.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(ctx.record, default=str))
    tmp.replace(path)


def series(run: Mapping[str, Any], ref: str, metric: str) -> dict[int, float]:
    """A run's summary deviation from ``ref`` by checkpoint step."""
    return {p["step"]: p["vs"][ref]["summary"][metric] for p in run["checkpoints"] if ref in p["vs"]}


def last_step(runs: Mapping[str, Any], key: str, ref: str) -> int | None:
    """The last checkpoint at which ``key`` was compared with ``ref`` (None: never)."""
    steps = series(runs[key], ref, "w1") if key in runs else {}
    return max(steps) if steps else None


def deviation_at(runs: Mapping[str, Any], key: str, ref: str, metric: str, step: int | None) -> float | None:
    """``key``'s deviation from ``ref`` at ``step``; for the two references either direction."""
    if step is None:
        return None
    for run, other in ((key, ref), (ref, key)) if {key, ref} <= set(REFERENCES) else ((key, ref),):
        value = series(runs[run], other, metric).get(step) if run in runs else None
        if value is not None:
            return value
    return None


def precision_deviation(runs: Mapping[str, Any], metric: str, step: int | None) -> float | None:
    """bf16 against fp32 training, (f) vs (a), at ``step``: the yardstick of every ratio."""
    return deviation_at(runs, "f", "a", metric, step)


def ratio(value: float | None, unit: float | None) -> str:
    """``value / unit`` as "0.42×", or "—"."""
    if value is None or not unit:
        return "—"
    return f"{value / unit:.2g}×"


def fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.2e}"


def fmt_loss(value: float | None) -> str:
    return "—" if value is None else f"{value:.4f}"


def final_loss(run: Mapping[str, Any], window: int = 50) -> str:
    """Mean training loss over the last ``window`` steps, and the last validation loss."""
    losses = run["losses"][-window:]
    val = run["checkpoints"][-1]["val_loss"] if run["checkpoints"] else None
    return f"{fmt_loss(statistics.fmean(losses) if losses else None)} / {fmt_loss(val)}"


def deviation_table(runs: Mapping[str, Any], ref: str) -> str:
    """Each run's deviation from ``ref`` at its last checkpoint, every metric beside its ratio to bf16-vs-fp32's
    at that step."""
    head = ["run", "step", "train / val loss"] + [f"{METRIC_LABELS[m]} (÷ f vs a)" for m in METRICS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, run in runs.items():
        if key == ref:
            continue
        step = last_step(runs, key, ref)
        cells = [f"({key}) {run['label']}", str(step or "—"), final_loss(run)]
        for metric in METRICS:
            value = deviation_at(runs, key, ref, metric, step)
            cells.append(f"{fmt(value)} ({ratio(value, precision_deviation(runs, metric, step))})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratios_over_training(runs: Mapping[str, Any], key: str, unit_key: str, metric: str) -> list[float]:
    """``key``'s deviation from (a) over ``unit_key``'s at every checkpoint both have (``"f"``: the precision
    deviation), so one lucky checkpoint does not decide."""
    mine = series(runs[key], "a", metric) if key in runs else {}
    out = []
    for step, value in sorted(mine.items()):
        unit = deviation_at(runs, unit_key, "a", metric, step)
        if unit:
            out.append(value / unit)
    return out


def spread(values: Sequence[float]) -> str:
    """Median [min–max] of ratios, or "—"."""
    if not values:
        return "—"
    return f"median {statistics.median(values):.2g}× [{min(values):.2g}–{max(values):.2g}×]"


def verdicts(runs: Mapping[str, Any]) -> list[str]:
    """For each memopt run and the rerun: is its deviation from (a) below the seed's (e) and the precision's
    (f) at the same step? And the filter against its exact control (d0)."""
    lines = []
    for key in ("b", "c", "d", "d0", "a2"):
        step = last_step(runs, key, "a")
        if step is None:
            continue
        parts = []
        for metric in ("w1", "rel_fro"):
            value = deviation_at(runs, key, "a", metric, step)
            seed = deviation_at(runs, "e", "a", metric, step)
            prec = precision_deviation(runs, metric, step)
            below = [name for name, unit in (("seed", seed), ("precision", prec)) if unit and value < unit]
            parts.append(
                f"{METRIC_LABELS[metric]} {ratio(value, seed)} the seed's, {ratio(value, prec)} the "
                f"precision's (below: {', '.join(below) or 'neither'})"
            )
        over = {unit: spread(ratios_over_training(runs, key, unit, "rel_fro")) for unit in ("e", "f")}
        parts.append(f"rel. Frobenius over all checkpoints: {over['e']} the seed's, {over['f']} the precision's")
        lines.append(f"- ({key}) {runs[key]['label']}, step {step}: " + "; ".join(parts))
    step = last_step(runs, "d", "a")
    filtered, exact = (deviation_at(runs, k, "a", "rel_fro", step) for k in ("d", "d0"))
    if filtered is not None and exact:
        note = f"; {runs['d']['note']}" if "note" in runs["d"] else ""
        lines.append(
            f"- the CCE gradient filter: (d)'s rel. Frobenius deviation from (a) at step {step} is "
            f"{ratio(filtered, exact)} its exact control (d0)'s{note}"
        )
    return lines


def report_text(ctx: Context) -> str:
    """The markdown report: setup, the two deviation tables, the verdicts and the runs' rewrites and speed."""
    args, runs = ctx.args, ctx.record["runs"]
    model = ctx.record["model"]
    lines = [
        ctx.record["header"],
        "",
        f"GPT {model['n_layer']}×{model['n_embd']} ({model['n_head']} heads), vocabulary {model['vocab_size']}, "
        f"{ctx.record['parameters'] / 1e6:.2f}M parameters, batch {args.batch_size}×{args.seq_len}, {args.steps} "
        f"AdamW steps at lr {args.lr}, dropout {args.dropout}; checkpoints {ctx.marks}. Deviations at the last "
        "checkpoint; in brackets the ratio to bf16-vs-fp32 training's, (f) vs (a). Losses: training (mean of the "
        "last 50 steps) / validation.",
        "",
        "Against (a), torch.compile in bf16:",
        "",
        deviation_table(runs, "a"),
        "",
        "Against (f), fp32 training:",
        "",
        deviation_table(runs, "f"),
        "",
        "Reading (rel. Frobenius and W1, last checkpoint):",
        "",
        *verdicts(runs),
        "",
        "| run | rewrites applied | ms/step | first step (compile) s | status |",
        "|---|---|---|---|---|",
    ]
    for key, run in runs.items():
        rewrites = ", ".join(f"{rule}×{n}" for rule, n in sorted(run.get("rewrites", {}).items())) or "—"
        ms = f"{run['step_ms']:.1f}" if "step_ms" in run else "—"
        first = f"{run['first_step_s']:.1f}" if "first_step_s" in run else "—"
        lines.append(f"| ({key}) | {rewrites} | {ms} | {first} | {run['status']} |")
    lines += [f"\n({key}): {run['note']}" for key, run in runs.items() if "note" in run]
    return "\n".join(lines)


CONTROLS = ("a", "f", "e", "a2")  # dashed in the plots: the accepted deviations and the floor


def smoothed(values: Sequence[float], window: int) -> tuple[list[int], list[float]]:
    """Running means over ``window`` steps (fewer when the run is shorter), with the step each one ends at."""
    window = max(1, min(window, len(values)))
    if not values:
        return [], []
    means = torch.tensor(values, dtype=torch.float64).unfold(0, window, 1).mean(1).tolist()
    return list(range(window, window + len(means))), means


def plot(runs: Mapping[str, Any], out: Path) -> list[str]:
    """Loss curves and their gap to (a)'s, and the weight deviations from (a) and (f) over steps on log
    scales; returns the files written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib missing: no plots")
        return []
    colors = {key: f"C{i}" for i, key in enumerate(VARIANTS)}

    def style(key: str) -> dict[str, Any]:
        return {"color": colors[key], "linestyle": "--" if key in CONTROLS else "-", "label": f"({key})"}

    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5))
    base = runs.get("a", {}).get("losses", [])
    for key, run in runs.items():
        left.plot(*smoothed(run["losses"], 20), **style(key) | {"label": f"({key}) {run['label']}"})
        gaps = [abs(x - y) for x, y in zip(run["losses"], base, strict=False)]
        if key != "a" and any(gaps):
            right.plot(*smoothed(gaps, 50), **style(key))
    left.set(xlabel="step", ylabel="training loss (20-step mean)", title="Loss curves")
    right.set(
        xscale="log",
        yscale="log",
        xlabel="step",
        ylabel="|loss − loss (a)| (50-step mean)",
        title="Loss gap to (a), same batches (except (e))",
    )
    if left.get_lines():
        left.legend(fontsize=7)
    if right.get_lines():
        right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "numerics_training_loss.png", dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(len(REFERENCES), len(METRICS), figsize=(15, 8), squeeze=False)
    for row, ref in enumerate(REFERENCES):
        for col, metric in enumerate(METRICS):
            ax = axes[row][col]
            for key, run in runs.items():
                points = {s: v for s, v in series(run, ref, metric).items() if v > 0}
                if points:
                    ax.plot(list(points), list(points.values()), marker=".", **style(key))
            ax.set(xscale="log", yscale="log", xlabel="step", title=f"{METRIC_LABELS[metric]} vs ({ref})")
            if ax.get_lines():
                ax.legend(fontsize=7)
    fig.suptitle("Weight deviation (dashed: (a) bf16, (f) fp32, (e) other seed, (a2) rerun)")
    fig.tight_layout()
    fig.savefig(out / "numerics_training_deviation.png", dpi=120)
    plt.close(fig)
    return ["numerics_training_loss.png", "numerics_training_deviation.png"]


def write_outputs(ctx: Context) -> str:
    """The JSON, the markdown and the plots, as far as the runs have come."""
    write_json(ctx)
    try:
        images = plot(ctx.record["runs"], ctx.args.out)
    except Exception as error:  # a plot must not cost the numbers
        log.warning("no plots: %s", error_note(error))
        images = []
    links = "".join(f"\n![{name}]({name})" for name in images)
    return write_report(ctx.args.out, "numerics_training.md", report_text(ctx) + links)


# --- main ------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU, a few steps (CI)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated keys, run in VARIANTS' order")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (GPU 2000, smoke 5)")
    parser.add_argument("--every", type=int, default=None, help="checkpoint every N steps (GPU 100, smoke 2)")
    for name in ("batch_size", "seq_len", "vocab_size", "n_layer", "n_head", "n_embd", "eval_batches"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    parser.add_argument("--data-mb", type=float, default=None)
    parser.add_argument(
        "--dropout",
        type=float,
        default=0.0,
        help="0 by default: memopt's attention dropout draws its own masks, which would be seed noise",
    )
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0, help="initial weights; data order and dropout of (a)-(d)")
    parser.add_argument("--device", default=None, help="default: cuda when available (cpu with --smoke)")
    parser.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="seconds: past them no run starts, and a running one stops at its next checkpoint",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmark_results"))
    args = parser.parse_args(argv)
    resolve_sizes(args)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; known: {','.join(VARIANTS)}")
    return args


def chosen_variants(names: str) -> list[Variant]:
    """The requested variants in execution order (references first)."""
    wanted = set(names.split(","))
    return [variant for key, variant in VARIANTS.items() if key in wanted]


def run_or_skip(ctx: Context, variant: Variant) -> dict[str, Any]:
    """The variant's result; skipped past the time limit, and a failure recorded rather than raised (one
    failing variant must not cost the others' numbers)."""
    if ctx.out_of_time():
        return {"label": variant.label, "status": "skipped (--time-limit)", "losses": [], "checkpoints": []}
    try:
        return run_variant(ctx, variant)
    except Exception as error:
        log.exception("(%s) failed", variant.key)
        partial = ctx.record["runs"].get(variant.key, {"label": variant.label, "losses": [], "checkpoints": []})
        return partial | {"status": "error", "error": error_note(error)}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run every chosen variant; returns the JSON record."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu"))
    torch.set_float32_matmul_precision("highest")  # TF32 off: (f) is fp32, the others compute in bf16
    torch.backends.cudnn.allow_tf32 = False
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    data = build_dataset(args.data_mb, args.vocab_size)
    config = GPTConfig(
        vocab_size=data.tokenizer.vocab_size,
        block_size=args.seq_len,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        dropout=args.dropout,
    )
    torch.manual_seed(args.seed)
    initial = GPT(config).to(device)
    record: dict[str, Any] = {
        "schema": 1,
        "header": header("Training-level numerics (Golden et al. 2024 §V)", device),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "device": device.type,
        "model": dataclasses.asdict(config),
        "parameters": sum(p.numel() for p in initial.parameters()),
        "data": {"files": data.files, "train_tokens": len(data.train), "val_tokens": len(data.val)},
        "metrics": {
            "max_abs": "max over tensors of max |w − w_ref|",
            "w1": "numel-weighted mean over tensors of mean |sort(w) − sort(w_ref)|",
            "rel_fro": "‖w − w_ref‖ / ‖w_ref‖ over all parameters",
        },
        "runs": {},
    }
    ctx = Context(
        args,
        device,
        data.train,
        eval_batches(data.val, args.eval_batches, args.batch_size, args.seq_len, device),
        initial,
        checkpoint_steps(args.steps, args.every),
        record,
    )
    record["checkpoints"] = ctx.marks
    if args.time_limit is not None:
        ctx.deadline = started + args.time_limit
    for variant in chosen_variants(args.variants):
        record["runs"][variant.key] = run_or_skip(ctx, variant)
        backfill(ctx)
        record["seconds"] = time.perf_counter() - started
        write_outputs(ctx)
    log.info("total %.0f s", time.perf_counter() - started)
    return record


if __name__ == "__main__":
    main()
