"""Launch sweep for WTA-CRS's draw kernel (``lowerings/wta_crs/kernels.draw``), in µs a call.

    python benchmarks/tools/wta_draw_tune.py                       # 4096, 8192, 16384 and 32768 rows, budget 0.3
    python benchmarks/tools/wta_draw_tune.py --rows 16384 --budget 0.1

The draw is one program (the sample needs one cumulative sum over every row), launched once per WTA-CRS group
in the forward: on GPT-2 small at 16 × 1024 tokens its 36 calls are the largest part of WTA-CRS's extra step time
(``wta_crs_profile.py``). Each config is a (BLOCK, num_warps) pair: rows handled per step of the kernel's passes
over the scores; a block that covers every row makes each pass a single tile. Every config's sample is checked
against the current launch's (the same uniforms give the same rows and weights, up to the order of fp32 sums).
The fastest per row count become ``kernels.DRAW_LAUNCHES``.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lowerings.wta_crs import kernels

BLOCKS = (1024, 2048, 4096, 8192, 16384, 32768)
WARPS = (4, 8, 16, 32)


def _time_us(fn, repeat: int = 200) -> float:
    """Median device time of ``fn`` in µs (CUDA events around each call, after warm-up)."""
    for _ in range(10):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return sorted(times)[len(times) // 2]


def _same_sample(drawn: tuple[torch.Tensor, torch.Tensor], reference: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """The same sample up to the order of fp32 sums, which a block size changes: 99 % of the rows the same, their
    weights within 1e-3."""
    (index, weight), (ref_index, ref_weight) = drawn, reference
    same = index == ref_index
    return bool(same.float().mean() >= 0.99 and torch.allclose(weight[same], ref_weight[same], rtol=1e-3))


def sweep(rows: int, budget: float, spread: float, device: torch.device) -> list[tuple[int, int, float | None]]:
    """(BLOCK, num_warps, µs or None where it failed or drew another sample) for one row count."""
    generator = torch.Generator(device=device).manual_seed(0)
    norms = torch.exp(spread * torch.randn(rows, device=device, generator=generator))
    estimate = torch.rand(1024, device=device, generator=generator) + 0.5
    uniforms = torch.rand(max(1, round(budget * rows)), device=device, generator=generator)
    reference = kernels.draw(norms, uniforms, True, launch=kernels.draw_launch(rows), estimate=estimate, period=1024)
    results = []
    for block in BLOCKS:
        for warps in WARPS:
            launch = {"BLOCK": block, "num_warps": warps}
            call = functools.partial(kernels.draw, norms, uniforms, True, launch=launch, estimate=estimate,
                                     period=1024)
            try:
                same = _same_sample(call(), reference)
                us = _time_us(call) if same else None
            except Exception as error:  # a config Triton cannot build is reported, not fatal
                print(f"rows {rows} BLOCK {block} warps {warps}: {type(error).__name__}", flush=True)
                us = None
            results.append((block, warps, us))
            print(f"rows {rows} BLOCK {block:5d} warps {warps:2d}: "
                  f"{'-' if us is None else f'{us:.1f} µs'}", flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="4096,8192,16384,32768")
    parser.add_argument("--budget", type=float, default=0.3)
    parser.add_argument("--spread", type=float, default=1.0, help="scores are exp(spread · N(0, 1))")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; budget {args.budget}, spread {args.spread}")
    lines = []
    for rows in (int(r) for r in args.rows.split(",")):
        results = sweep(rows, args.budget, args.spread, device)
        current = kernels.draw_launch(rows)
        now = next(us for b, w, us in results if (b, w) == (current["BLOCK"], current["num_warps"]))
        block, warps, best = min((r for r in results if r[2] is not None), key=lambda r: r[2])
        lines.append(f"| {rows} | {now:.1f} | ({block}, {warps}) | {best:.1f} | {now / best:.2f}× |")
    print("\n".join(["| rows | current launch µs | fastest (BLOCK, warps) | µs | speed-up |", "|---|---|---|---|---|",
                     *lines]))


if __name__ == "__main__":
    main()
