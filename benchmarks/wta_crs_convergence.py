"""Does training with WTA-CRS weight gradients converge like exact training? Loss curves over seeds.

    python benchmarks/wta_crs_convergence.py                     # CPU is enough: a small GPT, 300 steps
    python benchmarks/wta_crs_convergence.py --steps 100 --seeds 0
    python benchmarks/wta_crs_convergence.py --pretrain-steps 300 --steps 200 --lr 5e-4   # fine-tuning

Trains the nanoGPT-style model of ``examples/gpt.py`` on the Python standard library's sources (the demo's
data and tokenizer) under ``torch.compile(backend=memopt)`` with: exact gradients (WTA-CRS off), WTA-CRS at
budgets 0.3 and 0.1, and plain column-row sampling (CRS, no winners) at 0.3 — same initial weights and the
same batches per seed. With ``--pretrain-steps P`` it measures fine-tuning instead, as the paper does: per
seed one exact pre-training run of P steps on the first half of the training text, then every variant
fine-tunes that checkpoint on the second half. Writes per-step losses to ``wta_crs_convergence.json``, a
markdown summary and a plot (``.png``, with matplotlib) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fxpass
from benchmarks._common import set_up, write_report
from examples.gpt import GPT, GPTConfig
from examples.train_gpt import build_dataset, eval_batches, evaluate, get_batch
from lowerings.wta_crs import reset_estimates

log = logging.getLogger("benchmarks.wta_crs_convergence")

VARIANTS = {
    "exact": {},
    "wta-crs 0.3": {"wta_crs_budget": 0.3},
    "wta-crs 0.1": {"wta_crs_budget": 0.1},
    "crs 0.3": {"wta_crs_budget": 0.3, "wta_crs_winners": False},
}


def pretrained(seed: int, data, args, device: torch.device) -> dict[str, torch.Tensor] | None:
    """Weights after ``--pretrain-steps`` exact steps on the first half of the training text (None: no
    pre-training, every variant starts from the same random init)."""
    if not args.pretrain_steps:
        return None
    torch.manual_seed(seed)
    model = GPT(_config(data, args)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.pretrain_lr, betas=(0.9, 0.95), weight_decay=0.1)
    step = torch.compile(lambda x, y: model(x, y)[1], backend=fxpass.MemoptBackend())
    batches = torch.Generator().manual_seed(2000 + seed)
    text = data.train[: len(data.train) // 2]
    for _ in range(args.pretrain_steps):
        x, y = get_batch(text, args.batch_size, args.seq_len, batches, device)
        step(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def _config(data, args) -> GPTConfig:
    return GPTConfig(vocab_size=data.tokenizer.vocab_size, block_size=args.seq_len, n_layer=args.n_layer,
                     n_head=args.n_head, n_embd=args.n_embd)


def train(variant: str, seed: int, data, args, device: torch.device, start_from=None) -> dict:
    """One run: per-step training loss, validation loss at the end, seconds."""
    torch.manual_seed(seed)
    reset_estimates()
    fxpass.clear_reports()
    model = GPT(_config(data, args)).to(device)
    if start_from is not None:
        model.load_state_dict(start_from)
    text = data.train if start_from is None else data.train[len(data.train) // 2 :]
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    # Every eligible linear, whatever the memory model says at this toy size: the question here is the estimator.
    options = {"wta_crs_min_tokens": 64, "min_saved_bytes": 0, **VARIANTS[variant]}
    step = torch.compile(lambda x, y: model(x, y)[1], backend=fxpass.MemoptBackend(options=options))
    batches = torch.Generator().manual_seed(1000 + seed)
    losses = []
    start = time.perf_counter()
    for _ in range(args.steps):
        x, y = get_batch(text, args.batch_size, args.seq_len, batches, device)
        loss = step(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    latest = {report.graph_id: report for report in fxpass.reports()}.values()  # a graph may compile twice
    applied = sum(r.rule == "wta_crs" and r.applied for report in latest for r in report.records)
    val = evaluate(model, eval_batches(data.val, args.eval_batches, args.batch_size, args.seq_len, device))
    log.info("%s seed %d: final train %.4f, val %.4f, %d WTA-CRS groups, %.0f s", variant, seed,
             statistics.fmean(losses[-20:]), val, applied, seconds)
    torch._dynamo.reset()
    return {"variant": variant, "seed": seed, "losses": losses, "val": val, "seconds": seconds,
            "wta_groups": applied}


def summary(runs: list[dict]) -> str:
    rows = ["| variant | final train loss (mean of last 20 steps) | validation loss | vs exact (val) |",
            "|---|---|---|---|"]
    exact_val = statistics.fmean(r["val"] for r in runs if r["variant"] == "exact")
    for variant in VARIANTS:
        chosen = [r for r in runs if r["variant"] == variant]
        if not chosen:
            continue
        train_final = [statistics.fmean(r["losses"][-20:]) for r in chosen]
        vals = [r["val"] for r in chosen]
        spread = lambda xs: f" ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else ""  # noqa: E731
        rows.append(
            f"| {variant} | {statistics.fmean(train_final):.3f}{spread(train_final)} "
            f"| {statistics.fmean(vals):.3f}{spread(vals)} | {100 * (statistics.fmean(vals) / exact_val - 1):+.2f} % |"
        )
    return "\n".join(rows)


def plot(runs: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib missing: no plot")
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for index, variant in enumerate(VARIANTS):
        for run in (r for r in runs if r["variant"] == variant):
            window = min(10, len(run["losses"]))
            smooth = torch.tensor(run["losses"]).unfold(0, window, 1).mean(1)
            ax.plot(range(window, window + len(smooth)), smooth, color=f"C{index}", alpha=0.7,
                    label=variant if run["seed"] == runs[0]["seed"] else None)
    ax.set(xlabel="step", ylabel="training loss (10-step mean)", title="WTA-CRS vs exact weight gradients")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--pretrain-steps", type=int, default=0, help="exact pre-training first: measure fine-tuning")
    parser.add_argument("--pretrain-lr", type=float, default=2e-3)
    parser.add_argument("--data-mb", type=float, default=4.0)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("benchmark_results"))
    args = parser.parse_args(argv)
    set_up(args.out)
    device = torch.device(args.device)
    data = build_dataset(args.data_mb, args.vocab_size)
    runs = []
    for seed in (int(s) for s in args.seeds.split(",")):
        start_from = pretrained(seed, data, args, device)
        runs += [train(variant, seed, data, args, device, start_from) for variant in args.variants.split(",")]
    regime = f"fine-tuning after {args.pretrain_steps} exact steps" if args.pretrain_steps else "from random init"
    text = (
        f"WTA-CRS convergence ({regime}), {time.strftime('%Y-%m-%d')}, {device}, torch {torch.__version__}; GPT "
        f"{args.n_layer}×{args.n_embd}, vocabulary {data.tokenizer.vocab_size}, "
        f"batch {args.batch_size}×{args.seq_len}, {args.steps} steps, seeds {args.seeds}\n\n" + summary(runs)
    )
    (args.out / "wta_crs_convergence.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                                                   "runs": runs}))
    plot(runs, args.out / "wta_crs_convergence.png")
    write_report(args.out, "wta_crs_convergence.md", text)
    return runs


if __name__ == "__main__":
    main()
