"""Attention throughput and memory: memopt's flash attention against SDPA's backends, flex_attention and
torch.compile of eager attention code, in one run.

    python benchmarks/attention.py                    # the shapes of issue 4, causal and not, plus a model step
    python benchmarks/attention.py --shapes 4x16x4096x128 --no-model

FLOPs: 4·B·H·T²·d for the forward (halved when causal); forward + backward counts 3.5× the forward (the
backward is 2.5×), as FlashAttention's benchmarks do. Time is the median of CUDA-event timings; peak memory is
``max_memory_allocated`` above the inputs. The model step compares a causal nanoGPT-style model
(``examples/gpt.py``) compiled with memopt against plain ``torch.compile``, which does not fuse that pattern.
Writes ``attention.json`` and ``attention.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fxpass
import lowerings  # noqa: F401
from benchmarks._common import cuda_peak, error_note, header, release_memory, set_up, write_report

log = logging.getLogger("benchmarks.attention")
MiB = 1 << 20


def eager_attention(q, k, v, causal: bool):
    """Attention as model code writes it: explicit scores, a causal mask, softmax, @ v."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        t = q.shape[-2]
        mask = torch.tril(torch.ones(t, t, device=q.device, dtype=torch.bool))
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


def methods() -> dict[str, Callable[[bool], Callable]]:
    """Factories: causal flag → attention function (q, k, v) -> out."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(backend):
        def make(causal):
            def run(q, k, v):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

            return run

        return make

    def flex(causal):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        compiled = torch.compile(flex_attention)
        mask_cache = {}

        def run(q, k, v):
            if not causal:
                return compiled(q, k, v)
            key = (q.shape[-2], k.shape[-2])
            if key not in mask_cache:
                mask_cache[key] = create_block_mask(
                    lambda b, h, i, j: i >= j, None, None, key[0], key[1], device=q.device
                )
            return compiled(q, k, v, block_mask=mask_cache[key])

        return run

    return {
        "memopt flash_attention": lambda causal: (
            lambda q, k, v: torch.ops.memopt.flash_attention(q, k, v, None, q.shape[-1] ** -0.5, causal, 0.0)[0]
        ),
        "SDPA cuDNN": sdpa(SDPBackend.CUDNN_ATTENTION),
        "SDPA flash (FA2)": sdpa(SDPBackend.FLASH_ATTENTION),
        "SDPA efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION),
        "flex_attention": flex,
        "torch.compile of eager code": lambda causal: torch.compile(lambda q, k, v: eager_attention(q, k, v, causal)),
        "memopt rewrite of eager code": lambda causal: torch.compile(
            lambda q, k, v: eager_attention(q, k, v, causal), backend=fxpass.memopt_backend
        ),
    }


@dataclasses.dataclass
class Result:
    method: str
    shape: str
    causal: bool
    forward_tflops: float | None = None
    fwd_bwd_tflops: float | None = None
    forward_ms: float | None = None
    fwd_bwd_ms: float | None = None
    peak_mib: float | None = None
    note: str = ""


def measure(name: str, factory, shape: tuple[int, int, int, int], causal: bool, dtype) -> Result:
    import triton.testing

    b, h, t, d = shape
    result = Result(name, "x".join(map(str, shape)), causal)
    flops = 4 * b * h * t * t * d / (2 if causal else 1)
    try:
        fn = factory(causal)
        q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
        grad = torch.randn(b, h, t, d, device="cuda", dtype=dtype)

        def forward_backward():
            out = fn(q, k, v)
            return torch.autograd.grad(out, [q, k, v], grad)

        forward_backward()  # compile / warm up
        _, peak, before = cuda_peak(forward_backward)
        result.peak_mib = (peak - before) / MiB
        with torch.no_grad():
            result.forward_ms = triton.testing.do_bench(lambda: fn(q, k, v), warmup=50, rep=300, return_mode="median")
        result.fwd_bwd_ms = triton.testing.do_bench(forward_backward, warmup=50, rep=300, return_mode="median")
        result.forward_tflops = flops / result.forward_ms / 1e9
        result.fwd_bwd_tflops = 3.5 * flops / result.fwd_bwd_ms / 1e9
    except torch.OutOfMemoryError:
        result.note = "out of memory"
    except Exception as error:  # a backend refusing a shape must not stop the comparison
        result.note = error_note(error)
    finally:
        release_memory()
    log.info("%s", result)
    return result


def model_step(causal_len: int, dtype) -> list[Result]:
    """A causal nanoGPT-style training step: memopt (attention rewritten) against plain torch.compile."""
    return [
        _model_result(name, backend, causal_len, dtype)
        for name, backend in (("torch.compile (model)", "inductor"), ("memopt (model)", fxpass.memopt_backend))
    ]


def _model_result(name: str, backend, causal_len: int, dtype) -> Result:
    import triton.testing

    from examples.gpt import GPT, GPTConfig

    result = Result(name, f"GPT 12x768, B2 T{causal_len}", True)
    try:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=32768, block_size=causal_len, n_layer=12, n_head=12, n_embd=768))
        model = model.to("cuda", dtype)
        step = torch.compile(lambda x, y: model(x, y)[1], backend=backend)
        x = torch.randint(0, 32768, (2, causal_len), device="cuda")

        def train():
            step(x, x).backward()

        train()
        _, peak, before = cuda_peak(train)
        result.peak_mib = (peak - before) / MiB
        result.fwd_bwd_ms = triton.testing.do_bench(train, warmup=20, rep=200, return_mode="median")
    except Exception as error:
        result.note = error_note(error)
    finally:
        release_memory()
    log.info("%s", result)
    return result


def table(results: list[Result]) -> str:
    fmt = lambda value, spec: "—" if value is None else format(value, spec)  # noqa: E731
    lines = [
        "| method | B×H×T×d | causal | fwd TFLOP/s | fwd+bwd TFLOP/s | fwd ms | fwd+bwd ms | peak MiB | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.method} | {r.shape} | {r.causal} | {fmt(r.forward_tflops, '.0f')} | {fmt(r.fwd_bwd_tflops, '.0f')} "
            f"| {fmt(r.forward_ms, '.2f')} | {fmt(r.fwd_bwd_ms, '.2f')} | {fmt(r.peak_mib, '.0f')} | {r.note} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Result]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="4x16x4096x128,8x16x2048x64,2x16x8192x128")
    parser.add_argument("--methods", default=None, help="comma-separated subset")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--model-len", type=int, default=4096)
    parser.add_argument("--no-model", dest="model", action="store_false")
    parser.add_argument("--out", type=Path, default=Path("benchmark_results"))
    args = parser.parse_args(argv)
    set_up(args.out, needs_cuda="benchmarks/attention.py")
    dtype = getattr(torch, args.dtype)
    chosen = methods()
    if args.methods:
        chosen = {k: v for k, v in chosen.items() if k in args.methods.split(",")}
    results = []
    for text in args.shapes.split(","):
        shape = tuple(int(x) for x in text.split("x"))
        for causal in (False, True):
            for name, factory in chosen.items():
                results.append(measure(name, factory, shape, causal, dtype))
    if args.model:
        results += model_step(args.model_len, dtype)
    import triton

    title = header("Attention", torch.device("cuda"))
    title += f", triton {triton.__version__}, cuDNN {torch.backends.cudnn.version()}, {args.dtype}"
    (args.out / "attention.json").write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=2))
    write_report(args.out, "attention.md", title + "\n\n" + table(results))
    return results


if __name__ == "__main__":
    main()
