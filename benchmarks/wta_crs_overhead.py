"""Per-step overhead of WTA-CRS groups at tiny sizes, where a step is all dispatch: a proxy for CPU time spent
outside the kernels (the cost ``benchmarks/wta_crs_profile.py`` found on the H200).

    python benchmarks/wta_crs_overhead.py NAME

Four pre-LN MLP blocks (8 linear groups) over 4 × 64 tokens of width 64, compiled by memopt with Inductor;
prints the median step (forward + backward) with WTA-CRS off and at budget 0.3.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fxpass


def step_ms(options: dict, reps: int = 200) -> float:
    torch.manual_seed(0)
    blocks = [
        torch.nn.Sequential(torch.nn.LayerNorm(64), torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
        for _ in range(4)
    ]
    mlp = torch.nn.Sequential(*blocks)
    options = options | {"force": True, "wta_crs_min_tokens": 8}
    step = torch.compile(lambda x: mlp(x).square().mean(), backend=fxpass.MemoptBackend(options=options))
    x = torch.randn(4, 64, 64)
    for _ in range(5):
        step(x).backward()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step(x).backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "memopt"
    exact, sampled = step_ms({}), step_ms({"wta_crs_budget": 0.3})
    print(f"{name}: exact {exact:.2f} ms, WTA-CRS 0.3 {sampled:.2f} ms, +{sampled - exact:.2f} ms for 8 groups")


if __name__ == "__main__":
    main()
