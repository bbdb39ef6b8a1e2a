"""memopt's CPU ops beside torch.compile's code for the same math, forward + backward, steps interleaved.

    python benchmarks/cpu_ops.py --out /tmp/cpu_ops
    python benchmarks/cpu_ops.py --attention 16x12x256x64 --dropout 0,0.1 --cce 2048x50257x768

On CPU the rewrites run their PyTorch references (``lowerings/*/reference.py``), block by block within the
memory model's budget; this script times them against Inductor's CPU code for what they replace:
- attention: ``memopt.flash_attention`` (causal, optional dropout) against compiled eager attention
  (``q kᵀ·scale``, ``tril`` mask, softmax, dropout, ``@ v``), and ATen's SDPA for reference; the row gives the
  reference's block shapes (batch entries × query rows, forward / backward);
- CCE: ``memopt.cce`` and ``memopt.cce_rowwise`` called eagerly and compiled through the backend (the variant
  forced; the backward's scaling then is Inductor's) against compiled ``cross_entropy(linear(h, w).float(), t)``, and
  ``memopt.cce_with_logits`` and ``memopt.cce_rowwise`` returning the logits (dropped before backward) against
  the compiled pair that returns its logits too.
The variants' calls alternate (one of each in turn), so that drift on a shared machine reaches all alike; the
figure is the median of ``--reps``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import lowerings  # noqa: F401  (registers memopt's ops)
from benchmarks._common import header, write_report
from lowerings.flash_attention import reference as attention_reference


def interleaved_ms(variants: dict[str, Callable[[], None]], reps: int) -> dict[str, float]:
    """Median milliseconds of each variant, the calls alternating; two untimed rounds first (compilation)."""
    for _ in range(2):
        for run in variants.values():
            run()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, run in variants.items():
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def attention_case(shape: tuple[int, int, int, int], dropout_p: float, reps: int) -> dict:
    queries, dim = shape[2:]
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=generator).requires_grad_() for _ in range(3))
    grad = torch.randn(shape, generator=generator)
    scale = dim**-0.5

    def eager(q, k, v):
        scores = q @ k.transpose(-2, -1) * scale
        causal = torch.ones(queries, queries, dtype=torch.bool, device=q.device).tril()
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        return F.dropout(probs, dropout_p) @ v

    compiled = torch.compile(eager)
    variants = {
        "torch.compile (eager attention)": lambda: compiled(q, k, v).backward(grad),
        "memopt.flash_attention": lambda: torch.ops.memopt.flash_attention(q, k, v, None, scale, True, dropout_p)[
            0
        ].backward(grad),
        "SDPA (ATen)": lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True).backward(
            grad
        ),
    }
    blocks = [
        attention_reference.block_shape(q, k, None, backward=backward, dropout=dropout_p > 0, causal=True)
        for backward in (False, True)
    ]
    return {
        "op": "attention",
        "shape": "x".join(map(str, shape)),
        "dropout": dropout_p,
        "ms": interleaved_ms(variants, reps),
        "blocks": " / ".join(f"{entries}×{rows}" for entries, rows in blocks),
    }


def cce_case(shape: tuple[int, int, int], reps: int) -> dict:
    n_rows, vocab, dim = shape
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(n_rows, dim, generator=generator).requires_grad_()
    weight = (torch.randn(vocab, dim, generator=generator) / dim**0.5).requires_grad_()
    targets = torch.randint(0, vocab, (n_rows,), generator=generator)

    def loss_and_logits(h, w, t):
        logits = F.linear(h, w)
        return F.cross_entropy(logits.float(), t), logits

    def loss(h, w, t):
        return F.cross_entropy(F.linear(h, w).float(), t)

    loss_only = torch.compile(loss)
    with_logits = torch.compile(loss_and_logits)
    through = {variant: torch.compile(loss, backend="memopt", options={"cce_variant": variant, "force": True})
               for variant in ("chunked", "rowwise")}
    variants = {
        "torch.compile (loss)": lambda: loss_only(hidden, weight, targets).backward(),
        "memopt backend, chunked": lambda: through["chunked"](hidden, weight, targets).backward(),
        "memopt backend, row-wise": lambda: through["rowwise"](hidden, weight, targets).backward(),
        "memopt.cce": lambda: torch.ops.memopt.cce(hidden, weight, None, targets)[0].backward(),
        "memopt.cce_rowwise": lambda: torch.ops.memopt.cce_rowwise(
            hidden, weight, None, targets, -100, "mean", 0.0, None, True, True, False
        )[0].backward(),
        "torch.compile (loss + logits)": lambda: with_logits(hidden, weight, targets)[0].backward(),
        "memopt.cce_with_logits": lambda: torch.ops.memopt.cce_with_logits(hidden, weight, None, targets)[
            0
        ].backward(),
        "memopt.cce_rowwise (logits returned)": lambda: torch.ops.memopt.cce_rowwise(
            hidden, weight, None, targets, -100, "mean", 0.0, None, True, True, False, True
        )[0].backward(),
    }
    return {"op": "cce", "shape": "x".join(map(str, shape)), "dropout": None, "ms": interleaved_ms(variants, reps)}


def table(rows: list[dict]) -> str:
    lines = [
        "| op | shape | dropout | variant | ms | / torch.compile | blocks (fwd / bwd) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        baseline = None
        for name, ms in row["ms"].items():
            if name.startswith("torch.compile"):
                baseline = ms
            ratio = "-" if name.startswith("torch.compile") or baseline is None else f"{ms / baseline:.2f}"
            lines.append(
                f"| {row['op']} | {row['shape']} | {row['dropout'] if row['dropout'] is not None else '-'} | {name} | "
                f"{ms:.1f} | {ratio} | {row.get('blocks', '-') if name.startswith('memopt') else '-'} |"
            )
    return "\n".join(lines)


def _shapes(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(size) for size in item.split("x")) for item in text.split(",") if item]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attention", default="2x12x256x64,16x12x256x64,1x12x1024x64", help="BxHxTxD, comma-separated")
    parser.add_argument("--dropout", default="0,0.1")
    parser.add_argument("--cce", default="512x50257x768", help="NxVxD, comma-separated; empty to skip")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("benchmark_results"))
    args = parser.parse_args(argv)
    rows = []
    for shape in _shapes(args.attention):
        for dropout_p in (float(p) for p in args.dropout.split(",")):
            rows.append(attention_case(shape, dropout_p, args.reps))
            print(json.dumps(rows[-1]), flush=True)
    for shape in _shapes(args.cce):
        rows.append(cce_case(shape, args.reps))
        print(json.dumps(rows[-1]), flush=True)
    title = header(f"memopt's CPU ops against torch.compile ({torch.get_num_threads()} threads)", torch.device("cpu"))
    write_report(args.out, "cpu_ops.md", f"{title}\n\n{table(rows)}")
    (args.out / "cpu_ops.json").write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
