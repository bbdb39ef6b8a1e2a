"""Numeric deviation of attention against an FP64 golden value, after Golden et al. 2024, "Is Flash Attention
Stable?" (§IV): the same random q, k, v through each implementation; max and mean |out − golden|.

    python benchmarks/attention_numerics.py                        # T = 512 … 16384, bf16 and fp16, causal or not
    python benchmarks/attention_numerics.py --lengths 4096 --dtypes bfloat16

Implementations: memopt's flash attention, eager attention math in the same dtype (softmax(q kᵀ·scale) v with
PyTorch ops), and SDPA's flash, efficient, cuDNN and math backends. The golden value is the eager math in
float64 (computed in query blocks to bound memory). Reports the ratio ours / eager: the goal is ≤ 1 everywhere.
Writes ``attention_numerics.json`` and ``.md`` (and a ``.png`` with matplotlib) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lowerings  # noqa: F401
from benchmarks._common import header, set_up, write_report
from lowerings.flash_attention import kernels

log = logging.getLogger("benchmarks.attention_numerics")


def golden(q, k, v, causal: bool, block: int = 1024) -> torch.Tensor:
    """softmax(q kᵀ/√d) v in float64, block by block over queries."""
    scale = 1 / math.sqrt(q.shape[-1])
    q64, k64, v64 = q.double(), k.double(), v.double()
    out = torch.empty_like(q64)
    for start in range(0, q.shape[-2], block):
        rows = slice(start, start + block)
        scores = q64[:, :, rows] @ k64.transpose(-2, -1) * scale
        if causal:
            i = torch.arange(start, start + scores.shape[-2], device=q.device)[:, None]
            j = torch.arange(k.shape[-2], device=q.device)[None, :]
            scores = scores.masked_fill(j > i, float("-inf"))
        out[:, :, rows] = torch.softmax(scores, -1) @ v64
    return out


def eager(q, k, v, causal: bool) -> torch.Tensor:
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        t = q.shape[-2]
        scores = scores.masked_fill(torch.ones(t, t, device=q.device, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, -1) @ v


def memopt_with_tiles(block_m: int | None = None, block_n: int | None = None):
    """memopt's forward, at its chosen tiles or at forced ones (the paper varies the tile size too)."""

    def run(q, k, v, causal):
        call = lambda: torch.ops.memopt.flash_attention(q, k, v, None, q.shape[-1] ** -0.5, causal, 0.0)[0]  # noqa: E731
        if block_m is None:
            return call()
        with kernels.forced_tiles(forward={"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": 4, "num_stages": 2}):
            return call()

    return run


def implementations():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(backend):
        def run(q, k, v, causal):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        return run

    return {
        "memopt": memopt_with_tiles(),
        "memopt tiles 64x32": memopt_with_tiles(64, 32),
        "memopt tiles 64x128": memopt_with_tiles(64, 128),
        "eager (same dtype)": eager,
        "SDPA flash": sdpa(SDPBackend.FLASH_ATTENTION),
        "SDPA efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION),
        "SDPA cuDNN": sdpa(SDPBackend.CUDNN_ATTENTION),
        "SDPA math": sdpa(SDPBackend.MATH),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="512,1024,2048,4096,8192,16384")
    parser.add_argument("--dtypes", default="bfloat16,float16")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("benchmark_results"))
    args = parser.parse_args(argv)
    set_up(args.out, needs_cuda="benchmarks/attention_numerics.py")
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for length in (int(x) for x in args.lengths.split(",")):
            for causal in (False, True):
                gen = torch.Generator(device="cuda").manual_seed(length)
                q, k, v = (
                    torch.randn(args.batch, args.heads, length, args.head_dim, device="cuda", generator=gen).to(dtype)
                    for _ in range(3)
                )
                truth = golden(q, k, v, causal)
                for name, fn in implementations().items():
                    entry = {"dtype": dtype_name, "T": length, "causal": causal, "impl": name}
                    try:
                        deviation = (fn(q, k, v, causal).double() - truth).abs()
                        entry |= {"max": deviation.max().item(), "mean": deviation.mean().item()}
                    except Exception as error:  # e.g. a backend refusing the dtype or the length
                        entry["note"] = f"{type(error).__name__}: {str(error).splitlines()[0][:80]}"
                    rows.append(entry)
                    log.info("%s", entry)
                del q, k, v, truth
                torch.cuda.empty_cache()
    lines = ["| dtype | T | causal | impl | max dev | mean dev | max / eager max |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        eager_max = next(
            (e.get("max") for e in rows if e["impl"] == "eager (same dtype)" and e["dtype"] == r["dtype"]
             and e["T"] == r["T"] and e["causal"] == r["causal"]), None,
        )
        ratio = f"{r['max'] / eager_max:.2f}" if "max" in r and eager_max else "—"
        lines.append(
            f"| {r['dtype']} | {r['T']} | {r['causal']} | {r['impl']} | {r.get('max', float('nan')):.2e} "
            f"| {r.get('mean', float('nan')):.2e} | {ratio} |"
        )
    title = header("Attention deviation from FP64", torch.device("cuda"))
    title += f", B{args.batch} H{args.heads} d{args.head_dim}"
    (args.out / "attention_numerics.json").write_text(json.dumps(rows, indent=2))
    plot(rows, args.out / "attention_numerics.png")
    write_report(args.out, "attention_numerics.md", title + "\n\n" + "\n".join(lines))
    return rows


def plot(rows: list[dict], path: Path) -> None:
    """Max deviation against T, one panel per dtype × causal, one line per implementation."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plot")
        return
    panels = sorted({(r["dtype"], r["causal"]) for r in rows})
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for axis, (dtype, causal) in zip(axes[0], panels, strict=True):
        for impl in dict.fromkeys(r["impl"] for r in rows):
            points = [(r["T"], r["max"]) for r in rows
                      if (r["dtype"], r["causal"], r["impl"]) == (dtype, causal, impl) and "max" in r]
            if points:
                axis.plot(*zip(*points, strict=True), marker="o", label=impl)
        axis.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="max |out − fp64|",
                 title=f"{dtype}, {'causal' if causal else 'full'}")
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
