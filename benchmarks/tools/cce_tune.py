"""Tile-size sweep for memopt's CCE kernels, one component at a time, in TFLOP/s.

    python benchmarks/tools/cce_tune.py --tokens 8192 --vocab 256000 --dim 2304

Components: the forward (2·N·V·D FLOPs), and for one backward chunk of C columns the logit-gradient kernel
(2·N·C·D), cuBLAS's ∂C GEMM and the ∂E accumulation kernel (2·N·C·D each). Prints one line per config;
the fastest become the defaults in ``lowerings/cce/kernels.py``.

    python benchmarks/tools/cce_tune.py --rowwise --tokens 8192 --vocab 128256 --dim 2048

``--rowwise`` sweeps the row-wise op's rows per chunk instead: forward + backward time and peak of the whole op
per chunk size, and one chunk's parts (logits GEMM, chunk kernel, ∂E GEMM, ∂C GEMM into the fp32
accumulator), against 6·N·D·V at cuBLAS's square-GEMM rate. The best becomes ``rowwise.CHUNK_BYTES``.
``--profile`` then lists the device time of every kernel in three steps of the op at its own chunking, beside
torch.compile's linear + cross-entropy: where the whole op's time goes beyond the sum of its parts.

    python benchmarks/tools/cce_tune.py --chunk-kernel --tokens 2048 --vocab 128256,50257

``--chunk-kernel`` times the row-wise op's chunk kernel alone (``rowwise_kernel.row_gradient_``) over one chunk of
``--tokens`` rows for each tile width and warp count, in GB/s of its two reads and one write; the fastest become
``rowwise_kernel.BLOCK_V`` and ``NUM_WARPS``.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lowerings.cce import kernels

TILE_CONFIGS = [
    (128, 256, 64, 8, 3),
    (128, 256, 64, 8, 4),
    (128, 256, 32, 8, 5),
    (256, 128, 64, 8, 3),
    (256, 128, 64, 8, 4),
    (256, 128, 32, 8, 4),
    (256, 128, 32, 8, 5),
    (256, 128, 32, 8, 6),
    (256, 256, 32, 8, 3),
    (256, 64, 64, 8, 4),
    (128, 128, 64, 4, 4),
    (128, 128, 64, 8, 5),
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
    parser.add_argument("--vocab", default="256000", help="a vocabulary (several, by commas, for --chunk-kernel)")
    parser.add_argument("--dim", type=int, default=2304)
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument("--rowwise", action="store_true", help="sweep the row-wise op's rows per chunk")
    parser.add_argument("--rows", default="512,1024,2048,4096", help="rows per chunk for --rowwise")
    parser.add_argument("--profile", action="store_true", help="with --rowwise: kernel times, op against torch.compile")
    parser.add_argument("--chunk-kernel", action="store_true", help="sweep the row-wise chunk kernel's tiles")
    args = parser.parse_args(argv)
    vocabs = [int(v) for v in args.vocab.split(",")]
    if args.chunk_kernel:
        for vocab in vocabs:
            _chunk_kernel_sweep(args.tokens, vocab)
        return None
    args.vocab = vocabs[0]
    if args.rowwise:
        rows = [int(r) for r in args.rows.split(",")] if args.rows else []
        _rowwise_sweep(args.tokens, args.vocab, args.dim, rows)
        if args.profile:
            _rowwise_profile(args.tokens, args.vocab, args.dim)
        return None
    n, v, d, chunk = args.tokens, args.vocab, args.dim, args.chunk
    e = (torch.randn(n, d, device="cuda") / d**0.25).bfloat16()
    c = (torch.randn(v, d, device="cuda") / d**0.25).bfloat16()
    t = torch.randint(0, v, (n,), device="cuda")
    tflops = lambda flops, ms: flops / ms / 1e9  # noqa: E731
    _, lse = kernels.forward_rows(e, c, None, t, -100, 0.0, None)
    grad_rows = torch.full((n,), 1.0 / n, device="cuda")
    zeros = torch.zeros(n, device="cuda")
    g = torch.empty(n, chunk, device="cuda", dtype=torch.bfloat16)
    original_product = kernels._product_blocks
    for bn, bv, bd, warps, stages in TILE_CONFIGS:
        config = dict(BLOCK_N=bn, BLOCK_V=bv, BLOCK_D=bd, num_warps=warps, num_stages=stages)
        try:
            with kernels.forced_blocks(config):
                fwd = _bench(lambda: kernels.forward_rows(e, c, None, t, -100, 0.0, None))
            grid = (triton_cdiv(n, bn) * triton_cdiv(chunk, bv),)
            grad = _bench(
                lambda config=config, grid=grid: kernels._grad_logits_kernel[grid](
                    e, c, None, t, lse, grad_rows, zeros, g, None, None, n, v, d, 0, chunk,
                    e.stride(0), e.stride(1), c.stride(0), c.stride(1), g.stride(0), 1.0, 0.0, 1.0, 0.0,
                    HAS_BIAS=False, HAS_SOFTCAP=False, IEEE=False, FILTER=False, ROUND=False,
                    EVEN_D=d % config["BLOCK_D"] == 0, **config,
                )
            )
            print(
                f"tiles {config}: forward {fwd:.2f} ms = {tflops(2 * n * v * d, fwd):.0f} TFLOP/s; "
                f"logit-gradient chunk {grad:.3f} ms = {tflops(2 * n * chunk * d, grad):.0f} TFLOP/s",
                flush=True,
            )
        except Exception as error:  # an invalid config (shared memory) must not end the sweep
            print(f"tiles {config}: failed: {type(error).__name__}: {str(error).splitlines()[0][:100]}", flush=True)
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


def _rowwise_sweep(n: int, v: int, d: int, chunk_rows: list[int]) -> None:
    from lowerings.cce import rowwise

    tflops = lambda flops, ms: flops / ms / 1e9  # noqa: E731
    e = (torch.randn(n, d, device="cuda") / d**0.25).bfloat16().requires_grad_()
    c = (torch.randn(v, d, device="cuda") / d**0.25).bfloat16().requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda")
    a = torch.randn(8192, 8192, device="cuda").bfloat16()
    rate = tflops(2 * 8192**3, _bench(lambda: a @ a))
    ideal = 6 * n * d * v / rate / 1e9
    print(f"N={n} V={v} D={d}: 6·N·D·V at cuBLAS's {rate:.0f} TFLOP/s = {ideal:.2f} ms", flush=True)
    original = rowwise.chunk_rows

    def step():
        loss = torch.ops.memopt.cce_rowwise(e, c, None, t, -100, "mean", 0.0, None, True, True, False)[0]
        loss.backward()
        e.grad = c.grad = None

    for rows in chunk_rows:
        rowwise.chunk_rows = lambda *_, rows=rows: rows
        try:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            whole = _bench(step)
            parts = _rowwise_chunk_parts(e.detach()[:rows], c.detach(), t[:rows])
            chunks = -(-n // rows)
            print(
                f"rows {rows} ({chunks} chunks): fwd+bwd {whole:.2f} ms ({whole / ideal:.2f}× ideal), "
                f"peak {peak:.0f} MiB; one chunk: "
                + ", ".join(f"{name} {ms:.3f}" for name, ms in parts.items()),
                flush=True,
            )
        except Exception as error:  # an allocation too large for the device must not end the sweep
            print(f"rows {rows}: failed: {type(error).__name__}: {str(error).splitlines()[0][:100]}", flush=True)
    rowwise.chunk_rows = original


def _chunk_kernel_sweep(rows: int, vocab: int) -> None:
    """The chunk kernel over a [rows, V] bf16 chunk laid out as the op lays it out (rows padded to 64 columns),
    for each tile width and warp count, with and without label smoothing and a softcap."""
    from lowerings.cce import rowwise, rowwise_kernel

    width = rowwise.padded_vocab(vocab, "cuda")
    padded = (3 * torch.randn(rows, width, device="cuda")).bfloat16()
    logits = padded[:, :vocab]
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    scale = torch.full((1,), 1.0 / rows, device="cuda")
    gigabytes = 3 * rows * vocab * 2 / 1e9  # two reads and one write of 16-bit logits
    original = rowwise_kernel.BLOCK_V, rowwise_kernel.NUM_WARPS
    for smoothing, softcap in [(0.0, None), (0.1, 30.0)]:
        for block in (1024, 2048, 4096, 8192):
            for warps in (4, 8, 16):
                rowwise_kernel.BLOCK_V, rowwise_kernel.NUM_WARPS = block, warps
                run = functools.partial(rowwise.row_gradient_, logits, targets, -100, smoothing, softcap, scale)
                try:
                    ms = _bench(run)
                except Exception as error:  # a tile too large for the registers must not end the sweep
                    print(f"V={vocab} block {block} warps {warps}: failed: {type(error).__name__}", flush=True)
                    continue
                print(
                    f"V={vocab} rows={rows} smoothing={smoothing} softcap={softcap} block {block} warps {warps}: "
                    f"{ms:.3f} ms, {gigabytes / ms * 1e3:.0f} GB/s",
                    flush=True,
                )
    rowwise_kernel.BLOCK_V, rowwise_kernel.NUM_WARPS = original


def _rowwise_profile(n: int, v: int, d: int, steps: int = 3) -> None:
    """Kernel device times of ``steps`` forward + backward steps: the row-wise op, then torch.compile's."""
    from torch.profiler import ProfilerActivity, profile

    e = (torch.randn(n, d, device="cuda") / d**0.25).bfloat16().requires_grad_()
    c = (torch.randn(v, d, device="cuda") / d**0.25).bfloat16().requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda")

    def compiled_loss(e, c, t):
        return torch.nn.functional.cross_entropy((e @ c.t()).float(), t)

    losses = {
        "memopt (op) row-wise": lambda: torch.ops.memopt.cce_rowwise(
            e, c, None, t, -100, "mean", 0.0, None, True, True, False
        )[0],
        "torch.compile": functools.partial(torch.compile(compiled_loss), e, c, t),
    }
    for name, loss_fn in losses.items():

        def step(loss_fn=loss_fn):
            loss_fn().backward()
            e.grad = c.grad = None

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=70)
        print(f"## {name}: {steps} steps, {_bench(step):.2f} ms a step\n{table}", flush=True)


def _rowwise_chunk_parts(e: torch.Tensor, c: torch.Tensor, t: torch.Tensor) -> dict[str, float]:
    """Milliseconds of one chunk's steps in the row-wise op, for the chunk of rows ``e``, on the classifier
    padded as the op pads it (``rowwise.padded_vocab``)."""
    from lowerings.cce import rowwise

    vocab = c.shape[0]
    c = rowwise.padded_rows(c, rowwise.padded_vocab(vocab, "cuda"))
    padded = rowwise._chunk_logits(e, c, None)
    logits = padded[:, :vocab]
    acc = torch.empty(c.shape, device="cuda", dtype=torch.float32)
    one = torch.ones((), device="cuda")
    return {
        "logits GEMM": _bench(lambda: torch.mm(e, c.t(), out=padded)),
        "chunk kernel": _bench(lambda: rowwise.row_gradient_(logits, t, -100, 0.0, None, one)),
        "dE GEMM": _bench(lambda: torch.mm(padded, c)),
        "dC GEMM (first)": _bench(lambda: torch.mm(padded.t(), e, out_dtype=torch.float32, out=acc)),
        "dC GEMM (+= fp32)": _bench(lambda: torch.addmm(acc, padded.t(), e, out_dtype=torch.float32, out=acc)),
    }


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


if __name__ == "__main__":
    main()
