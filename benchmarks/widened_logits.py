"""A 16-bit LM head whose logits leave the graph as ``logits.float()`` (accelerate's ``convert_to_fp32`` under HF
Trainer's ``bf16=True``), compiled three ways: torch.compile, memopt with 16-bit logits and the graph's cast
("narrow"), and memopt writing them in fp32 itself ("widened"). Step time, forward time and forward peak; and
cuBLAS's GEMM into bf16, into fp32, and into bf16 then cast, where the vocabulary's fp32 rows may not be 16-byte
aligned (GPT-2's 50257 classes). CUDA only.

    python benchmarks/widened_logits.py --shapes 16384x50257x768,8192x128256x2048
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F


def median_ms(fn: Callable[[], object], reps: int = 20) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return round(1e3 * sorted(times)[reps // 2], 3)


def head(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor):
    logits = F.linear(hidden, weight)
    return logits.float(), F.cross_entropy(logits.float(), targets)


def gemms(hidden: torch.Tensor, weight: torch.Tensor) -> dict[str, float]:
    return {
        "mm into bf16 ms": median_ms(lambda: torch.mm(hidden, weight.t())),
        "mm into fp32 ms": median_ms(lambda: torch.mm(hidden, weight.t(), out_dtype=torch.float32)),
        "mm into bf16, then .float() ms": median_ms(lambda: torch.mm(hidden, weight.t()).float()),
    }


def variant(name: str, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> dict:
    import fxpass
    from fxpass.rules import cce as cce_rule

    widened = cce_rule._widening_is_slow
    torch._dynamo.reset()
    if name == "memopt narrow":
        cce_rule._widening_is_slow = lambda classifier: "kept 16-bit for this benchmark"
    elif name == "memopt widened":
        cce_rule._widening_is_slow = lambda classifier: None
    try:
        backend = "inductor" if name == "torch.compile" else fxpass.MemoptBackend(options={"force": True})
        compiled = torch.compile(head, backend=backend, fullgraph=True)
        for _ in range(3):
            compiled(hidden, weight, targets)[1].backward()
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        outputs = compiled(hidden, weight, targets)
        torch.cuda.synchronize()
        forward_peak = torch.cuda.max_memory_allocated() - base
        del outputs

        def step() -> None:
            compiled(hidden, weight, targets)[1].backward()
            hidden.grad = weight.grad = None

        def forward() -> None:
            with torch.no_grad():
                compiled(hidden, weight, targets)

        return {"variant": name, "forward peak GiB": round(forward_peak / 2**30, 3), "step ms": median_ms(step),
                "forward ms (no_grad)": median_ms(forward)}
    finally:
        cce_rule._widening_is_slow = widened


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="16384x50257x768,8192x128256x2048", help="N x V x D, comma-separated")
    args = parser.parse_args(argv)
    rows = []
    for shape in args.shapes.split(","):
        n, vocab, dim = map(int, shape.split("x"))
        torch.manual_seed(0)
        hidden = torch.randn(n, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        weight = (torch.randn(vocab, dim, device="cuda") / dim**0.5).to(torch.bfloat16).requires_grad_()
        targets = torch.randint(0, vocab, (n,), device="cuda")
        rows.append({"shape": shape, **gemms(hidden.detach(), weight.detach())})
        print(json.dumps(rows[-1]), flush=True)
        for name in ("torch.compile", "memopt narrow", "memopt widened"):
            rows.append({"shape": shape, **variant(name, hidden, weight, targets)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


if __name__ == "__main__":
    main()
