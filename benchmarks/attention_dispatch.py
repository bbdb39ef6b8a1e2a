"""Which kernel should serve each attention case: memopt's Triton kernel against the library kernels that accept
the same semantics, timed and checked side by side in one run.

    python benchmarks/attention_dispatch.py --time-limit 400 --out $OUT/attention_dispatch    # GPU

Cases: the shapes of issue 14 (B, H, T, d), causal or not, dropout 0 or 0.1, with or without a per-sequence key
padding bias ([B, 1, 1, Tk], as memopt's mask proofs produce it), bf16 and fp16. q, k and v are strided views of
one [B, T, 3·H·d] projection, as HF models pass them. Candidates:

- ``memopt``: ``torch.ops.memopt.flash_attention`` (the Triton kernels);
- ``cudnn``, ``efficient``: ATen's ``_scaled_dot_product_{cudnn,efficient}_attention``, which take a causal
  flag *and* an additive bias together (the public SDPA refuses that pair);
- ``flash``: ATen's ``_scaled_dot_product_flash_attention`` (no bias).

FLOPs are 4·B·H·T²·d for the forward (halved when causal) and 3.5× that for forward + backward, as
FlashAttention's benchmarks count. Numerics (dropout 0 only): the largest error of out, dq, dk and dv against a
float64 reference, over the same error of eager attention in the input dtype with an fp32 softmax (the
numerics rule of the project: a kernel may serve a case only if that ratio is ≤ 1). Writes
``attention_dispatch.json`` (rewritten after every case) and ``attention_dispatch.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lowerings  # noqa: F401
from benchmarks._common import error_note, header, write_report

log = logging.getLogger("benchmarks.attention_dispatch")
aten = torch.ops.aten

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run of the script only
SHAPES = ((16, 12, 1024, 64), (8, 16, 2048, 64), (4, 16, 4096, 128), (2, 16, 8192, 128))


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    length: int
    head_dim: int
    causal: bool
    dropout: float
    padded: bool
    dtype: str

    @property
    def name(self) -> str:
        flags = ["causal" if self.causal else "full", f"p={self.dropout}", "keypad" if self.padded else "nopad"]
        return f"{self.batch}x{self.heads}x{self.length}x{self.head_dim} {' '.join(flags)} {self.dtype}"

    def flops(self) -> float:
        forward = 4 * self.batch * self.heads * self.length**2 * self.head_dim
        return 3.5 * forward * (0.5 if self.causal else 1.0)


def inputs(case: Case, batch: int | None = None, dtype=None, seed: int = 0):
    """q, k, v as views of one projection, and the key bias (or None)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    b, h, t, d = batch or case.batch, case.heads, case.length, case.head_dim
    dtype = dtype or getattr(torch, case.dtype)
    qkv = torch.randn(b, t, 3, h, d, device=DEVICE, generator=g).to(dtype).requires_grad_()
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    bias = right_padding(b, t, dtype, g) if case.padded else None
    return qkv, (q, k, v), bias


def right_padding(batch: int, length: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """[B, 1, 1, T] 0 / -inf key bias of right padding, as memopt's mask proofs build it: each sequence keeps a
    different prefix, at least half of its keys."""
    lengths = torch.randint(length // 2, length + 1, (batch,), device=generator.device, generator=generator)
    keep = torch.arange(length, device=generator.device)[None, :] < lengths[:, None]
    bias = torch.zeros(batch, 1, 1, length, device=generator.device, dtype=dtype)
    return bias.masked_fill(~keep[:, None, None], float("-inf"))


def candidates(case: Case) -> dict[str, Callable]:
    """name → f(q, k, v, bias) -> out, for the kernels that serve the case's semantics."""
    scale = 1 / math.sqrt(case.head_dim)
    p, causal = case.dropout, case.causal

    def full(bias, q, k):
        return None if bias is None else bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])

    found = {
        "memopt": lambda q, k, v, bias: torch.ops.memopt.flash_attention(q, k, v, bias, scale, causal, p)[0],
        "cudnn": lambda q, k, v, bias: aten._scaled_dot_product_cudnn_attention(
            q, k, v, full(bias, q, k), True, p, causal, scale=scale
        )[0],
        "efficient": lambda q, k, v, bias: aten._scaled_dot_product_efficient_attention(
            q, k, v, full(bias, q, k), True, p, causal, scale=scale
        )[0],
    }
    if not case.padded:
        found["flash"] = lambda q, k, v, bias: aten._scaled_dot_product_flash_attention(
            q, k, v, p, causal, scale=scale
        )[0]
    return found


def reference(q, k, v, bias, causal: bool, dtype: torch.dtype):
    """Attention computed in ``dtype`` (float64: the golden; 16-bit: eager, with an fp32 softmax)."""
    scores = (q.to(dtype) @ k.to(dtype).transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if bias is not None:
        scores = scores + bias.to(dtype)
    if causal:
        t = q.shape[-2]
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    probs = torch.softmax(scores.float() if dtype != torch.float64 else scores, dim=-1).to(dtype)
    return probs @ v.to(dtype)


def golden(case: Case):
    """Inputs on one sequence of the case, the output gradient, and float64's out and input gradient."""
    qkv, (q, k, v), bias = inputs(case, batch=1, seed=1)
    grad = torch.randn(q.shape, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(2))
    qkv64 = qkv.detach().double().requires_grad_()
    q64, k64, v64 = (qkv64[:, :, i].transpose(1, 2) for i in range(3))
    gold = reference(q64, k64, v64, bias, case.causal, torch.float64)
    (gold_d,) = torch.autograd.grad(gold, qkv64, grad.double())
    return (qkv, (q, k, v), bias, grad), (gold.detach(), gold_d)


def errors(data, gold, fn: Callable) -> list[float]:
    """Largest |error| of out, dq, dk, dv against float64."""
    (qkv, (q, k, v), bias, grad), (gold_out, gold_d) = data, gold
    out = fn(q, k, v, bias)
    (dqkv,) = torch.autograd.grad(out, qkv, grad.to(out.dtype))
    return [(out.double() - gold_out).abs().max().item()] + [
        (dqkv[:, :, i].double() - gold_d[:, :, i]).abs().max().item() for i in range(3)
    ]


def timed(case: Case, fn: Callable, reps: int = 20) -> float:
    """Median forward + backward milliseconds."""
    qkv, (q, k, v), bias = inputs(case)
    grad = torch.randn(q.shape, device=DEVICE, dtype=q.dtype)

    def step():
        out = fn(q, k, v, bias)
        torch.autograd.grad(out, qkv, grad)

    for _ in range(3):
        step()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize() if DEVICE == "cuda" else None
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def measure(case: Case) -> dict:
    row: dict = {"case": case.name, **dataclasses.asdict(case), "ms": {}, "tflops": {}, "error_ratio": {}}
    data = gold = eager_err = None
    if case.dropout == 0:
        data, gold = golden(case)
        eager_err = errors(data, gold, lambda q, k, v, bias: reference(q, k, v, bias, case.causal, q.dtype))
        row["eager_error"] = eager_err
    for name, fn in candidates(case).items():
        try:
            ms = timed(case, fn)
            row["ms"][name] = round(ms, 3)
            row["tflops"][name] = round(case.flops() / ms / 1e9, 1)
            if eager_err is not None:
                err = errors(data, gold, fn)
                row["error_ratio"][name] = round(max(e / max(r, 1e-30) for e, r in zip(err, eager_err, strict=True)), 3)
        except Exception as error:
            row["ms"][name] = None
            row.setdefault("failed", {})[name] = error_note(error)
    timings = {k: v for k, v in row["ms"].items() if v is not None}
    row["fastest"] = min(timings, key=timings.get) if timings else None
    return row


def all_cases(shapes, dtypes) -> list[Case]:
    return [
        Case(*shape, causal, dropout, padded, dtype)
        for shape in shapes
        for dtype in dtypes
        for padded in (False, True)
        for causal in (True, False)
        for dropout in (0.0, 0.1)
    ]


def table(rows: list[dict]) -> str:
    names = ["memopt", "cudnn", "flash", "efficient"]
    lines = [
        "| case | " + " | ".join(f"{n} TFLOP/s" for n in names) + " | fastest | error / eager's (dropout 0) |",
        "|---|" + "---|" * (len(names) + 2),
    ]
    for row in rows:
        cells = [str(row["tflops"].get(n, "—")) if row["ms"].get(n) is not None else "—" for n in names]
        ratios = ", ".join(f"{k} {v}" for k, v in row["error_ratio"].items()) or "—"
        lines.append(f"| {row['case']} | " + " | ".join(cells) + f" | {row['fastest']} | {ratios} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES))
    parser.add_argument("--dtypes", default="bfloat16,float16")
    parser.add_argument("--time-limit", type=float, default=None, help="seconds: past them no case starts")
    parser.add_argument("--out", type=Path, default=Path("benchmark_results"))
    args = parser.parse_args(argv)
    deadline = None if args.time_limit is None else time.perf_counter() + args.time_limit
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    rows = []
    for case in all_cases(shapes, args.dtypes.split(",")):
        if deadline is not None and time.perf_counter() > deadline:
            log.info("--time-limit reached: %s and the cases after it not measured", case.name)
            break
        rows.append(measure(case))
        log.info("%s: %s fastest %s", case.name, rows[-1]["tflops"], rows[-1]["fastest"])
        (args.out / "attention_dispatch.json").write_text(json.dumps(rows, indent=1))
    text = header("Attention: which kernel serves which case", torch.device(DEVICE)) + "\n" + table(rows)
    write_report(args.out, "attention_dispatch.md", text)
    return rows


if __name__ == "__main__":
    main()
