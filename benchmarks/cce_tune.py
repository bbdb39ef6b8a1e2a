"""Tile-size sweep for memopt's CCE kernels, one component at a time, in TFLOP/s.

    python benchmarks/cce_tune.py --tokens 8192 --vocab 256000 --dim 2304

Components: the forward (2·N·V·D FLOPs), and for one backward chunk of C columns the logit-gradient kernel
(2·N·C·D), cuBLAS's ∂C GEMM and the ∂E accumulation kernel (2·N·C·D each). Prints one line per config;
the fastest become the defaults in ``lowerings/cce/kernels.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lowerings.cce import kernels

TILE_CONFIGS = [
    (128, 256, 64, 8, 3),
    (256, 128, 64, 8, 3),
    (256, 128, 64, 8, 4),
    (256, 128, 32, 8, 5),
    (256, 64, 64, 8, 4),
    (128, 128, 64, 4, 4),
]
PRODUCT_CONFIGS = [
    (128, 128, 64, 8, 3),
    (128, 256, 64, 8, 3),
    (256, 128, 64, 8, 3),
    (128, 128, 64, 4, 4),
    (128, 256, 32, 8, 4),
]


def _bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=30, rep=200, return_mode="median")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=256000)
    parser.add_argument("--dim", type=int, default=2304)
    parser.add_argument("--chunk", type=int, default=4096)
    args = parser.parse_args(argv)
    n, v, d, chunk = args.tokens, args.vocab, args.dim, args.chunk
    e = (torch.randn(n, d, device="cuda") / d**0.25).bfloat16()
    c = (torch.randn(v, d, device="cuda") / d**0.25).bfloat16()
    t = torch.randint(0, v, (n,), device="cuda")
    tflops = lambda flops, ms: flops / ms / 1e9  # noqa: E731
    _, lse = kernels.forward_rows(e, c, None, t, -100, 0.0, None)
    grad_rows = torch.full((n,), 1.0 / n, device="cuda")
    zeros = torch.zeros(n, device="cuda")
    g = torch.empty(n, chunk, device="cuda", dtype=torch.bfloat16)
    original_blocks, original_product = kernels._blocks, kernels._product_blocks
    for bn, bv, bd, warps, stages in TILE_CONFIGS:
        config = dict(BLOCK_N=bn, BLOCK_V=bv, BLOCK_D=bd, num_warps=warps, num_stages=stages)
        kernels._blocks = lambda dtype, config=config: dict(config)
        try:
            fwd = _bench(lambda: kernels.forward_rows(e, c, None, t, -100, 0.0, None))
            grid = (triton_cdiv(n, bn) * triton_cdiv(chunk, bv),)
            grad = _bench(
                lambda config=config, grid=grid: kernels._grad_logits_kernel[grid](
                    e, c, None, t, lse, grad_rows, zeros, g, None, None, n, v, d, 0, chunk,
                    e.stride(0), e.stride(1), c.stride(0), c.stride(1), g.stride(0), 1.0, 0.0, 1.0, 0.0,
                    HAS_BIAS=False, HAS_SOFTCAP=False, IEEE=False, FILTER=False, ROUND=False, **config,
                )
            )
            print(
                f"tiles {config}: forward {fwd:.2f} ms = {tflops(2 * n * v * d, fwd):.0f} TFLOP/s; "
                f"logit-gradient chunk {grad:.3f} ms = {tflops(2 * n * chunk * d, grad):.0f} TFLOP/s",
                flush=True,
            )
        except Exception as error:  # an invalid config (shared memory) must not end the sweep
            print(f"tiles {config}: failed: {type(error).__name__}: {str(error).splitlines()[0][:100]}", flush=True)
    kernels._blocks = original_blocks
    out = torch.empty(chunk, d, device="cuda", dtype=torch.bfloat16)
    mm = _bench(lambda: torch.mm(g.t(), e, out=out))
    print(f"cuBLAS dC chunk GEMM {mm:.3f} ms = {tflops(2 * n * chunk * d, mm):.0f} TFLOP/s", flush=True)
    high = torch.zeros(n, d, device="cuda", dtype=torch.bfloat16)
    low = torch.zeros_like(high)
    for bm, bn, bk, warps, stages in PRODUCT_CONFIGS:
        config = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
        kernels._product_blocks = lambda dtype, config=config: dict(config)
        try:
            acc = _bench(lambda: kernels.accumulate_product(high, low, g, c[:chunk]))
            print(f"product {config}: {acc:.3f} ms = {tflops(2 * n * chunk * d, acc):.0f} TFLOP/s", flush=True)
        except Exception as error:
            print(f"product {config}: failed: {type(error).__name__}: {str(error).splitlines()[0][:100]}", flush=True)
    kernels._product_blocks = original_product
    a = torch.randn(8192, 8192, device="cuda").bfloat16()
    square = _bench(lambda: a @ a)
    print(f"cuBLAS bf16 8192³: {tflops(2 * 8192**3, square):.0f} TFLOP/s")


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


if __name__ == "__main__":
    main()
