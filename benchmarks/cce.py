"""Linear + cross-entropy, loss and loss+grad: memopt against every peer in one run.

    python benchmarks/cce.py                      # N=8192 V=256000 D=2304 bf16, both data regimes + N sweep
    python benchmarks/cce.py --tokens 1024 --vocab 32000 --dim 512 --no-sweep   # quick

Peers: torch eager (``F.cross_entropy((e @ c.T).float(), t)``), ``torch.compile`` of that code, Apple's
``cut-cross-entropy`` (default, and with its gradient filter off), Liger's fused linear cross-entropy, and
``F.linear_cross_entropy`` where the torch version has it. memopt runs twice: its op called directly and the
eager code compiled with ``backend="memopt"`` (the graph rewrite). Memory is the peak allocated above the
inputs; time is the median of CUDA-event timings (``triton.testing.do_bench``); gradient errors are relative
Frobenius norms against an fp32 computation on the same inputs. Writes ``cce.json``, ``cce.md`` and
``cce.png`` into ``--out``.

Data regimes (DESIGN.md): "uniform" is random-init hidden states and classifier, ``randn / D**0.25``;
"lm" builds logits whose token log-frequencies follow a Zipf law over shuffled ids, with a bump on the
target, so that the loss is near 3 nats as in a trained language model.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import logging
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fxpass
from benchmarks._common import cuda_peak, error_note, release_memory, set_up, write_report
from lowerings.cce import linear_cross_entropy

log = logging.getLogger("benchmarks.cce")
MiB = 1 << 20

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# --- data -------------------------------------------------------------------------------------------------


def uniform_data(n: int, v: int, d: int, dtype: torch.dtype, gen: torch.Generator):
    e = torch.randn(n, d, device="cuda", generator=gen) / d**0.25
    c = torch.randn(v, d, device="cuda", generator=gen) / d**0.25
    t = torch.randint(0, v, (n,), device="cuda", generator=gen)
    return e.to(dtype), c.to(dtype), t


def lm_data(n: int, v: int, d: int, dtype: torch.dtype, gen: torch.Generator, zipf=1.2, bump=5.0, noise=1.75):
    """Logits = log p_zipf(v) + N(0, noise²) + bump·[v = target]; targets drawn from the Zipf law.

    One hidden dimension is a constant 1 whose classifier column holds the log-prior; the others carry
    random directions, with each hidden state tilted towards its target's classifier row.
    """
    ranks = torch.randperm(v, device="cuda", generator=gen) + 1
    log_prior = -zipf * torch.log(ranks.double())
    log_prior = (log_prior - torch.logsumexp(log_prior, 0)).float()
    t = torch.multinomial(log_prior.exp(), n, replacement=True, generator=gen)
    c_rest = torch.randn(v, d - 1, device="cuda", generator=gen) / math.sqrt(d - 1)
    toward = c_rest[t] / c_rest[t].norm(dim=1, keepdim=True).square()
    e_rest = noise * torch.randn(n, d - 1, device="cuda", generator=gen) + bump * toward
    e = torch.cat([torch.ones(n, 1, device="cuda"), e_rest], 1)
    c = torch.cat([log_prior[:, None], c_rest], 1)
    return e.to(dtype), c.to(dtype), t


# --- methods ----------------------------------------------------------------------------------------------


def torch_eager(e, c, t):
    return F.cross_entropy((e @ c.T).float(), t)


def _rowwise(e, c, t):
    """``memopt.cce_rowwise``: the gradients taken during the forward (6·N·D·V FLOPs). An fp32 classifier goes
    in as the graph rewrite hands it over under autocast: cast, with its own dtype as ∂C's."""
    kept = {} if c.dtype == e.dtype else {"grad_dtype": c.dtype}
    c = c.to(e.dtype)
    return torch.ops.memopt.cce_rowwise(e, c, None, t, -100, "mean", 0.0, None, True, True, False, **kept)[0]


def methods(include: set[str] | None) -> dict[str, Callable[[], LossFn]]:
    """Factories of loss functions ``(e, c, t) -> loss``; a factory returns None if the peer is missing."""
    found: dict[str, Callable[[], LossFn | None]] = {
        "torch eager": lambda: torch_eager,
        "torch.compile": lambda: torch.compile(torch_eager),
        "memopt (op)": lambda: linear_cross_entropy,
        "memopt (op) filter 2^-12": lambda: functools.partial(linear_cross_entropy, filter_eps=2.0**-12),
        "memopt (op) filter 2^-9": lambda: functools.partial(linear_cross_entropy, filter_eps=2.0**-9),
        "memopt (op) row-wise": lambda: _rowwise,
        "memopt (torch.compile rewrite)": lambda: torch.compile(torch_eager, backend=fxpass.memopt_backend),
        "memopt (torch.compile rewrite) chunked": lambda: torch.compile(
            torch_eager, backend=fxpass.MemoptBackend(options={"cce_variant": "chunked"})
        ),
        "apple cce": lambda: _apple("high"),
        "apple cce (no filter)": lambda: _apple(None),
        "liger": _liger,
        "F.linear_cross_entropy": _torch_linear_cross_entropy,
    }
    unknown = (include or set()) - found.keys()
    if unknown:  # a misspelt name would otherwise drop a method from the table without a word
        raise SystemExit(f"unknown methods {sorted(unknown)}; known: {sorted(found)}")
    return {name: f for name, f in found.items() if include is None or name in include}


def _apple(filter_eps: str | None) -> LossFn | None:
    """Apple's default kernels; ``filter_eps=None`` turns off its gradient filter (PyPI 25.1.1 API)."""
    try:
        from cut_cross_entropy import linear_cross_entropy as apple
    except ImportError:
        return None
    return lambda e, c, t: apple(e, c, t, filter_eps=filter_eps)


def _liger() -> LossFn | None:
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    loss = LigerFusedLinearCrossEntropyLoss()
    return lambda e, c, t: loss(c, e, t)


def _torch_linear_cross_entropy() -> LossFn | None:
    fn = getattr(F, "linear_cross_entropy", None)
    return None if fn is None else (lambda e, c, t: fn(e, c, t))


# --- measurement ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Result:
    regime: str
    method: str
    kind: str
    tokens: int
    time_ms: float | None = None
    peak_mib: float | None = None
    loss_error: float | None = None
    grad_e_error: float | None = None
    grad_c_error: float | None = None
    note: str = ""


def _relative(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref).norm() / ref.norm()).item()


def reference(e, c, t):
    """fp32 loss, gradients and mean entropy on the same bf16 inputs, with exact fp32 matmuls (no TF32)."""
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        e32 = e.float().requires_grad_()
        c32 = c.float().requires_grad_()
        logits = e32 @ c32.T
        loss = F.cross_entropy(logits, t)
        grad_e, grad_c = torch.autograd.grad(loss, [e32, c32])
        logp = torch.log_softmax(logits.detach(), dim=-1)
        del logits
        entropy = -(logp.exp() * logp).sum(-1).mean().item()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    return loss.detach(), grad_e, grad_c, entropy


def measure(fn: LossFn, e, c, t, kind: str, ref, warmup_ms: int, rep_ms: int) -> dict:
    import triton.testing

    e = e.detach().requires_grad_()
    c = c.detach().requires_grad_()
    # fp32 classifier beside 16-bit hidden states: the fine-tuning setup, bf16 autocast over fp32 weights
    autocast = torch.autocast("cuda", e.dtype, enabled=c.dtype != e.dtype)

    def run():
        with autocast:
            loss = fn(e, c, t)
        if kind == "loss":
            return (loss,)
        return (loss, *torch.autograd.grad(loss, [e, c]))

    outputs = run()  # compiles if needed
    torch.cuda.synchronize()
    del outputs
    gc.collect()
    torch.cuda.empty_cache()
    outputs, peak, before = cuda_peak(run)
    found = {"peak_mib": (peak - before) / MiB, "loss_error": abs(outputs[0].float().item() - ref[0].item())}
    if kind == "loss+grad":
        found["grad_e_error"] = _relative(outputs[1], ref[1])
        found["grad_c_error"] = _relative(outputs[2], ref[2])
    del outputs
    found["time_ms"] = triton.testing.do_bench(run, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    return found


def run_case(regime, name, factory, e, c, t, kind, ref, args) -> Result:
    result = Result(regime, name, kind, e.shape[0])
    try:
        fn = factory()
        if fn is None:
            result.note = "not installed"
            return result
        for key, value in measure(fn, e, c, t, kind, ref, args.warmup_ms, args.rep_ms).items():
            setattr(result, key, value)
    except torch.OutOfMemoryError:
        result.note = "out of memory"
    except Exception as error:  # a peer failing must not stop the comparison
        result.note = error_note(error)
        log.exception("%s / %s / %s failed", regime, name, kind)
    finally:
        release_memory()
    log.info("%s", result)
    return result


# --- report -----------------------------------------------------------------------------------------------


def _fmt(value, spec):
    return "—" if value is None else format(value, spec)


def markdown(results: list[Result], header: str) -> str:
    lines = [
        header,
        "",
        "| regime | method | kind | time (ms) | peak above inputs (MiB) | loss err | dE rel err | dC rel err | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.regime} | {r.method} | {r.kind} | {_fmt(r.time_ms, '.1f')} | {_fmt(r.peak_mib, '.0f')} "
            f"| {_fmt(r.loss_error, '.1e')} | {_fmt(r.grad_e_error, '.4f')} | {_fmt(r.grad_c_error, '.4f')} "
            f"| {r.note} |"
        )
    return "\n".join(lines)


def plot(main: list[Result], sweep: list[Result], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib missing: no plot")
        return
    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    rows = [r for r in main if r.kind == "loss+grad" and r.time_ms is not None]
    for ax, regime in zip(axes[:2], ("lm", "uniform"), strict=True):
        chosen = [r for r in rows if r.regime == regime]
        ax.scatter([r.time_ms for r in chosen], [r.peak_mib for r in chosen])
        for r in chosen:
            ax.annotate(r.method, (r.time_ms, r.peak_mib), fontsize=8)
        ax.set(xlabel="loss+grad time (ms)", ylabel="peak above inputs (MiB)", yscale="log", title=f"{regime} logits")
    by_method: dict[str, list[Result]] = {}
    for r in sweep:
        if r.peak_mib is not None:
            by_method.setdefault(r.method, []).append(r)
    for method, points in by_method.items():
        axes[2].plot([p.tokens for p in points], [p.peak_mib for p in points], marker="o", label=method)
    axes[2].set(xlabel="tokens N", ylabel="peak above inputs (MiB)", xscale="log", yscale="log", title="N sweep")
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def environment() -> dict:
    import triton

    versions = {"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name()}
    for package in ("cut_cross_entropy", "liger_kernel"):
        try:
            from importlib.metadata import version

            versions[package] = version(package.replace("_", "-"))
        except Exception:
            versions[package] = "missing"
    return versions


def main(argv: list[str] | None = None) -> list[Result]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=256000)
    parser.add_argument("--dim", type=int, default=2304)
    parser.add_argument("--regimes", default="lm,uniform")
    parser.add_argument("--kinds", default="loss,loss+grad")
    parser.add_argument("--methods", default=None, help="comma-separated subset of method names")
    parser.add_argument("--sweep", default="1024,4096,16384,65536", help="token counts; empty to skip")
    parser.add_argument("--no-sweep", dest="sweep", action="store_const", const="")
    parser.add_argument("--sweep-methods", default="torch.compile,memopt (op),apple cce,liger")
    parser.add_argument("--weights", default="bf16", choices=["bf16", "fp32"],
                        help="the classifier's dtype; fp32 runs every method under bf16 autocast")
    parser.add_argument("--warmup-ms", type=int, default=100)
    parser.add_argument("--rep-ms", type=int, default=400)
    parser.add_argument("--out", type=Path, default=Path("benchmark_results"))
    args = parser.parse_args(argv)
    set_up(args.out, needs_cuda="benchmarks/cce.py")
    include = set(args.methods.split(",")) if args.methods else None
    env = environment()
    log.info("environment %s", env)
    gen = torch.Generator(device="cuda")
    results: list[Result] = []
    stats = {}
    for regime in args.regimes.split(","):
        gen.manual_seed(0)
        make = lm_data if regime == "lm" else uniform_data
        e, c, t = make(args.tokens, args.vocab, args.dim, torch.bfloat16, gen)
        c = c.float() if args.weights == "fp32" else c  # the same values, held in fp32
        ref_loss, ref_e, ref_c, entropy = reference(e, c, t)
        stats[regime] = {"loss": ref_loss.item(), "entropy": entropy}
        log.info("%s data: loss %.3f nats, entropy %.3f nats", regime, ref_loss.item(), entropy)
        ref = (ref_loss, ref_e, ref_c)
        for name, factory in methods(include).items():
            for kind in args.kinds.split(","):
                results.append(run_case(regime, name, factory, e, c, t, kind, ref, args))
        del e, c, t, ref, ref_e, ref_c
        gc.collect()
        torch.cuda.empty_cache()
    sweep: list[Result] = []
    sweep_methods = {m: f for m, f in methods(None).items() if m in args.sweep_methods.split(",")}
    for tokens in [int(x) for x in args.sweep.split(",") if x]:
        gen.manual_seed(0)
        e, c, t = uniform_data(tokens, args.vocab, args.dim, torch.bfloat16, gen)
        fake_ref = (torch.zeros((), device="cuda"), e.float(), c.float())  # errors not reported in the sweep
        for name, factory in sweep_methods.items():
            sweep.append(run_case("sweep", name, factory, e, c, t, "loss+grad", fake_ref, args))
            sweep[-1].loss_error = sweep[-1].grad_e_error = sweep[-1].grad_c_error = None
        del e, c, t, fake_ref
        gc.collect()
        torch.cuda.empty_cache()
    header = (
        f"CCE benchmark, {time.strftime('%Y-%m-%d')}, {env['gpu']}, torch {env['torch']}, triton {env['triton']}, "
        f"cut-cross-entropy {env['cut_cross_entropy']}, liger-kernel {env['liger_kernel']}; "
        f"N={args.tokens} V={args.vocab} D={args.dim} bf16, {args.weights} classifier; data {json.dumps(stats)}"
    )
    text = markdown(results, header) + "\n\n" + markdown(sweep, "N sweep (uniform data, loss+grad)")
    payload = {"environment": env, "args": vars(args) | {"out": str(args.out)}, "data": stats,
               "results": [dataclasses.asdict(r) for r in results], "sweep": [dataclasses.asdict(r) for r in sweep]}
    (args.out / "cce.json").write_text(json.dumps(payload, indent=2))
    plot(results, sweep, args.out / "cce.png")
    write_report(args.out, "cce.md", text)
    return results


if __name__ == "__main__":
    main()
