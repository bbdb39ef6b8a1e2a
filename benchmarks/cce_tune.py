"""Tile-size sweep for memopt's CCE kernels: TFLOP/s of the forward and of one backward pass per config.

    python benchmarks/cce_tune.py --tokens 8192 --vocab 256000 --dim 2304

The forward does 2·N·V·D FLOPs; the backward 6·N·V·D (logit recompute, ∂C and ∂E GEMMs). Prints one line
per config; pick the fastest as the default in ``lowerings/cce/kernels.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lowerings.cce import kernels


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=256000)
    parser.add_argument("--dim", type=int, default=2304)
    parser.add_argument("--chunks", default="2048,4096")
    args = parser.parse_args(argv)
    import triton.testing

    n, v, d = args.tokens, args.vocab, args.dim
    e = (torch.randn(n, d, device="cuda") / d**0.25).bfloat16()
    c = (torch.randn(v, d, device="cuda") / d**0.25).bfloat16()
    t = torch.randint(0, v, (n,), device="cuda")
    flops = 2 * n * v * d
    configs = [
        dict(BLOCK_N=bn, BLOCK_V=bv, BLOCK_D=bd, num_warps=w, num_stages=s)
        for bn, bv, bd, w, s in [
            (128, 256, 64, 8, 3),
            (256, 128, 64, 8, 3),
            (256, 128, 64, 8, 4),
            (128, 256, 64, 8, 4),
            (256, 128, 32, 8, 5),
            (128, 256, 32, 8, 5),
        ]
    ]
    original = kernels._blocks
    for config in configs:
        kernels._blocks = lambda dtype, config=config: dict(config)
        try:
            fwd = triton.testing.do_bench(
                lambda: kernels.forward_rows(e, c, None, t, -100, 0.0, None), warmup=50, rep=300, return_mode="median"
            )
            _, lse = kernels.forward_rows(e, c, None, t, -100, 0.0, None)
            grad_rows = torch.full((n,), 1.0 / n, device="cuda")
            zeros = torch.zeros(n, device="cuda")
            line = f"{config}: forward {fwd:.2f} ms = {flops / fwd / 1e9:.0f} TFLOP/s"
            for chunk in [int(x) for x in args.chunks.split(",")]:
                kernels.CHUNK_COLUMNS = chunk
                bwd = triton.testing.do_bench(
                    lambda lse=lse, grad_rows=grad_rows, zeros=zeros: kernels.backward(
                        e, c, None, t, lse, grad_rows, zeros, 0.0, None, (True, True, False)
                    ),
                    warmup=50,
                    rep=300,
                    return_mode="median",
                )
                line += f"; backward chunk {chunk}: {bwd:.2f} ms = {3 * flops / bwd / 1e9:.0f} TFLOP/s"
            print(line, flush=True)
        except Exception as error:  # an invalid config (shared memory) must not end the sweep
            print(f"{config}: failed: {type(error).__name__}: {str(error).splitlines()[0][:100]}", flush=True)
    kernels._blocks = original
    a = torch.randn(8192, 8192, device="cuda").bfloat16()
    mm = triton.testing.do_bench(lambda: a @ a, warmup=50, rep=300, return_mode="median")
    print(f"cuBLAS bf16 8192³: {2 * 8192**3 / mm / 1e9:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
