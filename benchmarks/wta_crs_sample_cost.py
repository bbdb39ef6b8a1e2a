"""CPU time of one eager WTA-CRS sample and of each of its calls: what ``wta_crs_sampling="opaque"`` adds to a
step for every group, since the opaque op runs them at training time; and of the two opaque calls a traced
group makes every step (the draw, and the estimate's update in the backward).

    python benchmarks/wta_crs_sample_cost.py                           # GPT-2 small's 16 × 1024 × 768
    python benchmarks/wta_crs_sample_cost.py --rows 8192 --dim 2048 --budget 0.3

Each call is timed over ``--calls`` calls without synchronizing (CPU µs a call; the GPU runs behind), then once
more up to a synchronize (µs a call with the GPU's share). Needs CUDA: elsewhere the sample is the traced
reference, which this does not measure.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lowerings.wta_crs import kernels, reference
from lowerings.wta_crs.op import sample

log = logging.getLogger("benchmarks.wta_crs_sample_cost")


def calls(rows: int, dim: int, budget: float, period: int) -> dict[str, Callable[[], object]]:
    """The opaque op, its body, and each launch of the body, on inputs of one group."""
    x = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16)
    estimate = torch.zeros(reference.MAX_POSITIONS, device="cuda")
    k = int(reference.sample_size(rows, budget))
    scores, uniforms = torch.rand(rows, device="cuda"), torch.rand(k, device="cuda")
    index, weight = torch.randint(0, rows, (k,), device="cuda"), torch.rand(k, device="cuda")
    return {
        "torch.ops.memopt.wta_crs_sample (the opaque op)": lambda: torch.ops.memopt.wta_crs_sample(
            x, estimate, budget, period, True
        ),
        "sample() (its body)": lambda: sample(x, estimate, budget, period, True),
        "torch.ops.memopt.wta_crs_draw (the traced sample's one call)": lambda: torch.ops.memopt.wta_crs_draw(
            scores, estimate, uniforms, period, True
        ),
        "kernels.row_norms": lambda: kernels.row_norms(x),
        "kernels.draw (with the estimate's lookup)": lambda: kernels.draw(
            scores, uniforms, True, estimate=estimate, period=period
        ),
        "kernels.gather_rows": lambda: kernels.gather_rows(x, index, weight),
        "torch.ops.memopt.wta_crs_store (the backward's one call a group)": lambda: torch.ops.memopt.wta_crs_store(
            scores, "benchmarks:sample_cost", period
        ),
        "kernels.update_estimate": lambda: kernels.update_estimate(estimate, scores, period, reference.EMA_DECAY),
        "torch.rand": lambda: torch.rand(k, device="cuda"),
        "reference.sample_size": lambda: reference.sample_size(rows, budget),
    }


def cost_us(fn: Callable[[], object], n: int) -> tuple[float, float]:
    """(CPU µs a call, µs a call up to the GPU's end), after a warm-up."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    cpu = time.perf_counter() - start
    torch.cuda.synchronize()
    return cpu / n * 1e6, (time.perf_counter() - start) / n * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--budget", type=float, default=0.3)
    parser.add_argument("--period", type=int, default=1024)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/wta_crs_sample_cost.py needs a CUDA device")
    log.info("| call | CPU µs | µs with the GPU |\n|---|---|---|")
    for name, fn in calls(args.rows, args.dim, args.budget, args.period).items():
        cpu, total = cost_us(fn, args.calls)
        log.info("| %s | %.1f | %.1f |", name, cpu, total)


if __name__ == "__main__":
    main()
