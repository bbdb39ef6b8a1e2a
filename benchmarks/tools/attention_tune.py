"""Launch-setting sweep for memopt's flash-attention kernels, forward and backward apart, in TFLOP/s.

    python benchmarks/tools/attention_tune.py                       # the shapes of benchmarks/attention.py
    python benchmarks/tools/attention_tune.py --shapes 4x16x4096x128 --dtype float16
    python benchmarks/tools/attention_tune.py --shapes 8x8x1024x256 --causal yes --key-padding   # Gemma's, padded

Forward FLOPs 4·B·H·T²·d, backward 2.5× that (halved when causal), as in ``benchmarks/attention.py``. Every
setting's output is checked against SDPA's so a setting that computes garbage cannot win. ``--key-padding``
adds the key bias memopt's mask proofs build ([B, 1, 1, Tk], 0 / -inf; right padding keeping half to all of each
sequence, as ``benchmarks/attention_dispatch.py``), FLOPs still counted over every key. The fastest settings
per head dim become ``_tiles``' choice in ``lowerings/flash_attention/kernels.py``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks._common import error_note, set_up
from benchmarks.attention_dispatch import right_padding
from lowerings.flash_attention import kernels

log = logging.getLogger("benchmarks.tools.attention_tune")

# (BLOCK_M, BLOCK_N, num_warps, num_stages, TMA, WARP_SPECIALIZE): TMA loads q, k, v through tensor
# descriptors (Hopper); WARP_SPECIALIZE splits the key loop into load and math warp groups.
FORWARD_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "TMA", "WARP_SPECIALIZE")
FORWARD = [
    (128, 64, 8, 3, False, False), (128, 64, 4, 3, False, False), (128, 128, 8, 3, False, False),
    (128, 128, 8, 2, False, False), (64, 64, 4, 3, False, False), (64, 128, 4, 3, False, False),
    (128, 64, 8, 4, False, False),
    (128, 128, 8, 3, True, False), (128, 128, 8, 2, True, False), (128, 64, 8, 3, True, False),
    (128, 64, 4, 3, True, False),
    (128, 128, 8, 3, False, True), (128, 128, 8, 3, True, True), (128, 64, 4, 3, True, True),
    (128, 128, 4, 2, True, True), (128, 64, 8, 3, True, True),
    # small tiles for head dim 256 (pinned D-wide tiles and accumulators fill shared memory and registers)
    (64, 64, 8, 2, False, False), (64, 64, 4, 2, False, False), (64, 32, 4, 2, False, False),
    (128, 32, 8, 2, False, False), (128, 64, 8, 2, False, False),
]
# (PINNED, SWEPT, num_warps, num_stages, ATOMIC_DQ): ATOMIC_DQ adds dQ from the dK/dV kernel with atomics
# (FA2's five-GEMM scheme) instead of a second kernel that recomputes P and dP.
BACKWARD_KEYS = ("PINNED", "SWEPT", "num_warps", "num_stages", "ATOMIC_DQ")
BACKWARD = [
    (128, 32, 8, 2, False), (128, 32, 8, 3, False), (128, 64, 8, 2, False), (64, 64, 4, 2, False),
    (64, 32, 4, 3, False), (128, 64, 8, 1, False),
    (128, 64, 8, 2, True), (128, 32, 8, 2, True), (64, 64, 4, 2, True), (128, 64, 8, 3, True),
    (64, 32, 4, 3, True), (128, 128, 8, 2, True),
    (64, 16, 8, 2, False), (64, 32, 8, 2, False), (64, 32, 4, 2, False), (32, 32, 4, 2, False),
    (32, 64, 4, 2, False), (32, 64, 8, 2, False), (64, 64, 8, 1, False), (64, 32, 8, 1, False),
]


def _bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=20, rep=100, return_mode="median")


def sweep(shape: tuple[int, int, int, int], causal: bool, dtype: torch.dtype,
          passes: tuple[str, ...] = ("forward", "backward"), key_padding: bool = False) -> list[dict]:
    """One row per setting of each pass: TFLOP/s and the max deviation from SDPA's output or gradient."""
    b, h, t, d = shape
    flops = 4 * b * h * t * t * d / (2 if causal else 1)
    gen = torch.Generator(device="cuda").manual_seed(t)
    q, k, v, grad = (torch.randn(b, h, t, d, device="cuda", generator=gen).to(dtype) for _ in range(4))
    bias = right_padding(b, t, dtype, gen).expand(b, h, t, t) if key_padding else None
    scale = d**-0.5
    with torch.enable_grad():
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        if bias is None:
            expected = F.scaled_dot_product_attention(*leaves, is_causal=causal)
        else:  # SDPA takes no causal flag beside a mask: the causal part joins the bias
            above = torch.ones(t, t, device="cuda", dtype=torch.bool).triu(1) if causal else None
            mask = bias if above is None else bias.masked_fill(above, float("-inf"))
            expected = F.scaled_dot_product_attention(*leaves, attn_mask=mask)
        expected_dq = torch.autograd.grad(expected, leaves[0], grad)[0]
    out, lse = kernels.forward(q, k, v, bias, scale, causal, 0.0, None)
    rows = []
    for setting in FORWARD if "forward" in passes else ():
        tiles = dict(zip(FORWARD_KEYS, setting, strict=True))
        row = {"shape": "x".join(map(str, shape)), "causal": causal, "pass": "forward", "setting": setting,
               "key_padding": key_padding}
        try:
            with kernels.forced_tiles(forward=tiles):
                got = kernels.forward(q, k, v, bias, scale, causal, 0.0, None)[0]
                ms = _bench(lambda: kernels.forward(q, k, v, bias, scale, causal, 0.0, None))
            row |= {"tflops": flops / ms / 1e9, "ms": ms, "deviation": (got - expected).abs().max().item()}
        except Exception as error:  # a setting over the shared-memory limit must not stop the sweep
            row["note"] = error_note(error)
        rows.append(row)
        log.info("%s", row)
    for setting in BACKWARD if "backward" in passes else ():
        tiles = dict(zip(BACKWARD_KEYS, setting, strict=True))
        row = {"shape": "x".join(map(str, shape)), "causal": causal, "pass": "backward", "setting": setting,
               "key_padding": key_padding}
        try:
            with kernels.forced_tiles(backward=tiles):
                run = lambda: kernels.backward(q, k, v, bias, out, lse, grad, scale, causal, 0.0, None)[:3]  # noqa: E731
                dq = run()[0]
                ms = _bench(run)
            row |= {"tflops": 2.5 * flops / ms / 1e9, "ms": ms, "deviation": (dq - expected_dq).abs().max().item()}
        except Exception as error:
            row["note"] = error_note(error)
        rows.append(row)
        log.info("%s", row)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="4x16x4096x128,8x16x2048x64,2x16x8192x128")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--passes", default="forward,backward", help="which kernels to sweep")
    parser.add_argument("--causal", default="no,yes", help="no, yes or both (no,yes)")
    parser.add_argument("--key-padding", action="store_true", help="with a key-padding bias (right padding)")
    parser.add_argument("--out", type=Path, default=Path("benchmark_results"))
    args = parser.parse_args(argv)
    set_up(args.out)
    rows = []
    for text in args.shapes.split(","):
        shape = tuple(int(x) for x in text.split("x"))
        for causal in [{"no": False, "yes": True}[c] for c in args.causal.split(",")]:
            rows += sweep(shape, causal, getattr(torch, args.dtype), tuple(args.passes.split(",")), args.key_padding)
    (args.out / "attention_tune.json").write_text(json.dumps(rows, indent=2))
    for key in sorted({(r["shape"], r["causal"], r["pass"]) for r in rows}):
        ranked = sorted((r for r in rows if (r["shape"], r["causal"], r["pass"]) == key and "tflops" in r),
                        key=lambda r: -r["tflops"])
        best = ", ".join(f"{r['setting']} {r['tflops']:.0f} (dev {r['deviation']:.1e})" for r in ranked[:3])
        print(f"{key}: {best}")
    return rows


if __name__ == "__main__":
    main()
