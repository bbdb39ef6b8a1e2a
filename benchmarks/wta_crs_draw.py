"""The WTA-CRS draw on its own: the one-program Triton kernel at several launch settings against the sorted
PyTorch rule (top-k, cumulative sums, search), in µs a call.

    python benchmarks/wta_crs_draw.py                       # 16k, 64k and 256k rows, budgets 0.3 and 0.1
    python benchmarks/wta_crs_draw.py --rows 16384 --budgets 0.3
    TRITON_INTERPRET=1 python benchmarks/wta_crs_draw.py --device cpu --rows 3000 --budgets 0.3   # a smoke run

The kernel runs as one program on one SM, so its time is latency: passes over the rows (total, threshold
rounds, compaction) and one binary search per slot. Each setting's sample is compared with the default
setting's (same algorithm; only the order of fp32 sums differs). Scores are lognormal (σ = 1), as row norms
times gradient norms are.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import error_note
from lowerings.wta_crs import kernels, reference

log = logging.getLogger("benchmarks.wta_crs_draw")

LAUNCHES = [
    {"BLOCK": 1024, "num_warps": 4}, {"BLOCK": 1024, "num_warps": 8}, {"BLOCK": 2048, "num_warps": 8},
    {"BLOCK": 4096, "num_warps": 8}, {"BLOCK": 4096, "num_warps": 16}, {"BLOCK": 8192, "num_warps": 16},
]


def _microseconds(fn, device: str) -> float:
    if device == "cpu":  # the interpreter: one timed call, to check the script, not the kernel
        start = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - start)
    import triton.testing

    return 1000 * triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def measure(rows: int, budget: float, device: str = "cuda") -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(rows)
    scores = torch.exp(torch.randn(rows, device=device, generator=gen))
    uniforms = torch.rand(int(reference.sample_size(rows, budget)), device=device, generator=gen)
    default_index, _ = kernels.draw(scores, uniforms, True)
    results = [{
        "rows": rows, "budget": budget, "method": "sorted rule (PyTorch)",
        "us": _microseconds(lambda: reference.draw(reference.normalize(scores), uniforms, True), device),
    }]
    for launch in LAUNCHES:
        row = {"rows": rows, "budget": budget, "method": f"kernel {launch}"}
        try:
            index, _ = kernels.draw(scores, uniforms, True, launch)
            row["same_as_default"] = (index == default_index).float().mean().item()
            row["us"] = _microseconds(lambda launch=launch: kernels.draw(scores, uniforms, True, launch), device)
        except Exception as error:  # a setting over the register or shared-memory budget must not stop the rest
            row["note"] = error_note(error)
        results.append(row)
        log.info("%s", row)
    return results


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="16384,65536,262144")
    parser.add_argument("--budgets", default="0.3,0.1")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=Path("benchmark_results"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks/wta_crs_draw.py needs a CUDA device (or --device cpu under TRITON_INTERPRET=1)")
    results = [
        row for rows in map(int, args.rows.split(",")) for budget in map(float, args.budgets.split(","))
        for row in measure(rows, budget, args.device)
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "wta_crs_draw.json").write_text(json.dumps(results, indent=2))
    lines = ["| rows | budget | method | µs | same as default |", "|---|---|---|---|---|"]
    for r in results:
        same = f"{r['same_as_default']:.4f}" if "same_as_default" in r else "—"
        lines.append(f"| {r['rows']} | {r['budget']} | {r['method']} | {r.get('us', float('nan')):.1f} | {same} |")
    print("\n".join(lines))
    return results


if __name__ == "__main__":
    main()
