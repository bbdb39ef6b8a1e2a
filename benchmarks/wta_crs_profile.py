"""Where a WTA-CRS linear's time goes, against a plain linear, at a GPT-2-medium MLP shape (CUDA).

    python benchmarks/wta_crs_profile.py --tokens 16384 --d-in 1024 --d-out 4096

Prints the median fwd+bwd time of both and the profiler's top CUDA kernels and CPU ops for the sampled one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lowerings  # noqa: F401


def main(argv: list[str] | None = None) -> None:
    import triton.testing

    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--d-in", type=int, default=1024)
    parser.add_argument("--d-out", type=int, default=4096)
    parser.add_argument("--budget", type=float, default=0.3)
    args = parser.parse_args(argv)
    x = torch.randn(args.tokens // 512, 512, args.d_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(args.d_out, args.d_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(args.tokens // 512, 512, args.d_out, device="cuda", dtype=torch.bfloat16)
    op = torch.ops.memopt.wta_crs_linears.default

    def plain():
        torch.autograd.backward(torch.nn.functional.linear(x, w), grad)

    def sampled():
        torch.autograd.backward(op(x, [w], [], [-1], args.budget, 0, "profile", True)[0], grad)

    for name, fn in (("plain linear", plain), ("WTA-CRS linear", sampled)):
        print(f"{name}: {triton.testing.do_bench(fn, warmup=20, rep=200, return_mode='median'):.3f} ms fwd+bwd")
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(10):
            sampled()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
