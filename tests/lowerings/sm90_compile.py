"""Compile memopt's Triton kernels for an H100/H200 (sm_90) on a machine without a GPU.

    python -m tests.lowerings.sm90_compile            # every case, one JSON line each
    python -m tests.lowerings.sm90_compile draw       # the cases whose name contains "draw"

Run without ``TRITON_INTERPRET`` (``test_sm90_compile.py`` starts it in a subprocess). A stand-in driver
reports an sm_90 device with the H200's 227 KB of shared memory a block, so the host code's launches go through
Triton's real CUDA pipeline, ptxas included, with the launch settings memopt would use on that GPU; then
nothing runs. This finds what the interpreter cannot: code-generation errors (a loop-carried variable that
changes type, an unsupported construct), tiles that overflow shared memory, and ptxas failures; and it
reports each kernel's registers and stack (spill) bytes a thread, from the cubin. It cannot check numerics or
speed. CPU tensors stand in for the device ones: only their dtypes, shapes and strides
reach the compiler.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

import torch

H200_SHARED_BYTES = 232448  # cudaDevAttrMaxSharedMemoryPerBlockOptin on the H200 (and H100)


# What Triton asks of a device: an H200's figures.
H200_PROPERTIES = {
    "max_shared_mem": H200_SHARED_BYTES, "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32,
    "sm_clock_rate": 1980000, "mem_clock_rate": 2619000, "mem_bus_width": 6144,
}


# Registers and stack (spill) bytes a thread of each kernel compiled so far: name → {(registers, stack), …}.
RESOURCES: dict[str, set[tuple[int, int]]] = {}


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) a thread, from ``cuobjdump -res-usage`` (bundled with Triton's CUDA backend).
    Stack beyond zero is local memory: register spills (or arrays the compiler could not keep in registers)."""
    import os
    import re
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        text = subprocess.run([tool, "-res-usage", file.name], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", text)
    return (int(found[1]), int(found[2])) if found else (-1, -1)


class _CompileOnlyUtils:
    def get_device_properties(self, device: int) -> dict:
        return dict(H200_PROPERTIES)

    def load_binary(self, name, kernel, shared, device):  # (module, function, registers, spills, max threads)
        registers, stack = resource_usage(kernel)
        RESOURCES.setdefault(name, set()).add((registers, stack))
        return 0, 0, registers, stack, 1024

    def unload_module(self, module) -> None:  # a forgotten kernel unloads its (never loaded) module
        return None


class CompileOnlyDriver:
    """Triton driver for an sm_90 device that compiles every launch and runs none."""

    def __init__(self) -> None:
        self.utils = _CompileOnlyUtils()

    @staticmethod
    def is_active() -> bool:
        return True

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def launcher_cls(self, src, metadata) -> Callable:
        return lambda *args, **kwargs: None


def forget_compiled() -> None:
    """Drop Triton's in-memory kernels of memopt's modules, so the next launch loads (and measures) again;
    the compiled binaries stay in Triton's disk cache."""
    from triton.runtime.jit import JITFunction

    for name, module in list(sys.modules.items()):
        if name.startswith("lowerings.") and name.endswith(("kernel", "kernels")):
            for value in vars(module).values():
                if isinstance(value, JITFunction) and hasattr(value, "device_caches"):
                    value.device_caches.clear()


def _attention(dtype: torch.dtype, head_dim: int, causal: bool, bias: bool = False, dropout: float = 0.0,
               bias_grad: bool = False, with_backward: bool = True, key_bias: bool = False,
               softcap: float | None = None, **forced) -> Callable[[], None]:
    def run() -> None:
        from lowerings.flash_attention import kernels

        q, k, v, grad = (torch.randn(1, 2, 64, head_dim, dtype=dtype) for _ in range(4))
        additive = torch.zeros(1, 2, 64, 64, dtype=dtype) if bias else None
        if key_bias:  # key padding as the mask proofs build it: [B, 1, 1, Tk] read with stride 0
            additive = torch.zeros(1, 1, 1, 64, dtype=dtype).expand(1, 2, 64, 64)
        seed = torch.zeros(1, dtype=torch.int64)
        scale = head_dim**-0.5
        with kernels.forced_tiles(**forced):
            out, lse = kernels.forward(q, k, v, additive, scale, causal, dropout, seed, softcap)
            if with_backward:
                kernels.backward(q, k, v, additive, out, lse, grad, scale, causal, dropout, seed, bias_grad, softcap)

    return run


def _cross_entropy(dtype: torch.dtype, softcap: float | None, filter_eps: float = 0.0) -> Callable[[], None]:
    def run() -> None:
        from lowerings.cce import kernels

        hidden, weight = torch.randn(64, 48, dtype=dtype), torch.randn(200, 48, dtype=dtype)
        targets = torch.randint(0, 200, (64,))
        bias = torch.zeros(200, dtype=dtype)
        _, lse = kernels.forward_rows(hidden, weight, bias, targets, -100, 0.1, softcap)
        ones = torch.ones(64)
        kernels.backward(hidden, weight, bias, targets, lse, ones, ones, 0.1, softcap, (True, True, True), filter_eps)

    return run


def _wta_crs(winners: bool, estimate: bool = False) -> Callable[[], None]:
    def run() -> None:
        from lowerings.wta_crs import kernels

        x = torch.randn(300, 40, dtype=torch.bfloat16)
        scores = kernels.row_norms(x)
        looked_up = {"estimate": torch.ones(64), "period": 64} if estimate else {}
        index, weight = kernels.draw(scores.float(), torch.rand(90), winners, **looked_up)
        kernels.gather_rows(x, index, weight)
        if estimate:
            kernels.update_estimate(torch.ones(64), scores.float(), 64, 0.9)

    return run


def _cce_rowwise(dtype: torch.dtype, vocab: int, smoothing: float, softcap: float | None) -> Callable[[], None]:
    """The row-wise op's chunk kernel on a chunk laid out as the op lays it (rows padded to 64 columns), and the
    backward's scale-and-cast."""

    def run() -> None:
        from lowerings.cce import rowwise, rowwise_kernel

        padded = torch.randn(8, rowwise.padded_vocab(vocab, "cuda"), dtype=dtype)
        targets = torch.randint(0, vocab, (8,))
        rowwise_kernel.row_gradient_(padded[:, :vocab], targets, -100, smoothing, softcap, torch.ones(1))
        rowwise_kernel.scaled_copy(torch.randn(vocab, 16), torch.ones(()), dtype)

    return run


def _spec(tensor: torch.Tensor):
    from lowerings.precompile import TensorSpec

    return TensorSpec.of(tensor)


Precompiled = tuple[list, Callable[[], None]]  # (calls for ``precompile.warm``, the launches they stand for)


def _precompile_cce(op: str, softcap: float | None) -> Precompiled:
    """``cce`` / ``cce_with_logits``: the backward's kernels, launched as ``cce_backward_rows`` launches them."""
    from lowerings.cce import kernels

    vocab = kernels.CHUNK_COLUMNS + 200  # two chunks, the second narrower: two specializations of each kernel
    hidden = torch.randn(64, 48, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(vocab, 48, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, vocab, (64,))
    last = True if op == "cce_with_logits" else 0.0  # detach_logits, or filter_eps
    calls = [(op, (_spec(hidden), _spec(weight), None, _spec(targets), -100, "mean", 0.0, softcap, last), ())]

    def launch() -> None:
        rows = torch.zeros(64)
        needs = (True, True, False)
        kernels.backward(hidden.detach(), weight.detach(), None, targets, rows, rows, rows, 0.0, softcap, needs, 0.0,
                         None, op == "cce_with_logits")

    return calls, launch


def _precompile_cce_rowwise(return_logits: bool) -> Precompiled:
    """``cce_rowwise``: the chunk kernel over the op's chunks, the last one shorter; with returned logits the
    column sweep over ∂C's slices, the last one narrower."""
    from lowerings.cce import rowwise, rowwise_kernel

    n = rowwise.MIN_GEMM_ROWS + 76 if return_logits else 103  # returned logits: chunks of at least MIN_GEMM_ROWS
    hidden = torch.randn(n, 48, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(3000, 48, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 3000, (n,))
    args = (_spec(hidden), _spec(weight), None, _spec(targets), -100, "mean", 0.1, None, True, True, False)
    calls = [("cce_rowwise", (*args, return_logits), ())]

    def launch() -> None:
        step = rowwise._rows_per_chunk(hidden, 3000, True, return_logits, "cuda")
        assert n % step, "the case must have two chunk heights"
        width = rowwise.padded_vocab(3000, "cuda")
        every = torch.zeros(n, width, dtype=torch.bfloat16) if return_logits else None
        buffer = torch.zeros(step, width, dtype=torch.bfloat16)
        lse = torch.zeros(n) if return_logits else None
        for start in range(0, n, step):
            rows = slice(start, min(start + step, n))
            source = every[rows, :3000] if return_logits else None
            logits = buffer[: rows.stop - start, :3000]
            rowwise_kernel.row_gradient_(logits, targets[rows], -100, 0.1, None, torch.ones(()), source, 1.0, False,
                                         None if lse is None else lse[rows])
        if return_logits:  # ∂C's column sweep, slice by slice, as _weight_gradient_by_columns_ runs it
            columns = rowwise.column_width(n, 3000, buffer.numel())
            assert 3000 % columns, "the case must have two slice widths"
            slices = buffer.view(-1)[: n * columns].view(n, columns)
            for first in range(0, 3000, columns):
                out = slices[:, : min(columns, 3000 - first)]
                rowwise_kernel.column_gradient_(out, every[:, :3000], first, targets, lse, -100, 0.1, None,
                                                torch.ones(()))

    return calls, launch


def _precompile_wta_crs() -> Precompiled:
    """WTA-CRS's draw (uniforms sliced at a misaligned offset, as the rule slices them), opaque sample and store."""
    from lowerings.wta_crs import op

    x = torch.randn(300, 40, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(24, 40, dtype=torch.bfloat16, requires_grad=True)
    estimate = torch.zeros(4096)
    uniforms = torch.rand(200)[3:93]
    norms = torch.rand(300)
    calls = [
        ("wta_crs_draw", (_spec(norms), _spec(estimate), _spec(uniforms), 60, True), ()),
        ("wta_crs_sample", (_spec(x), _spec(estimate), 0.3, 60, True), ()),
        ("wta_crs_linears", (_spec(x), (_spec(weight),), (), (-1,), None, None, "group", 60), ()),
    ]

    def launch() -> None:
        op._draw_with_kernel(norms, estimate, uniforms, 60, True)
        op._sample_with_kernels(x.detach(), estimate, torch.rand(90), 60, True)
        op._update_with_kernel(estimate, norms, 60)

    return calls, launch


def _precompile_wta_crs_traced_sample() -> Precompiled:
    """The traced sample, a Python function in the rewritten graph: the draw op it calls, on fp32 norms."""
    from lowerings.wta_crs import op

    x = torch.randn(300, 40, dtype=torch.bfloat16)
    estimate, uniforms = torch.zeros(4096), torch.rand(200)[3:93]
    calls = [(op.sample, (_spec(x), _spec(estimate), 0.3, 60, True, _spec(uniforms)), ())]

    def launch() -> None:
        op._draw_with_kernel(torch.rand(300), estimate, uniforms, 60, True)

    return calls, launch


def precompile_cases() -> dict[str, Callable[[], Precompiled]]:
    """Name → (calls to warm, the launches of those calls): the launches must compile nothing more."""
    return {
        "precompile cce_with_logits backward, softcap": lambda: _precompile_cce("cce_with_logits", 30.0),
        "precompile cce backward": lambda: _precompile_cce("cce", None),
        "precompile cce_rowwise chunk kernel": lambda: _precompile_cce_rowwise(False),
        "precompile cce_rowwise chunk kernel, returned logits": lambda: _precompile_cce_rowwise(True),
        "precompile wta-crs draw, sample, store": _precompile_wta_crs,
        "precompile wta-crs traced sample": _precompile_wta_crs_traced_sample,
    }


def _recompiled(make: Callable[[], Precompiled]) -> dict[str, object]:
    """Warm a case's calls, then launch them: the calls warmed, the kernels the launches still compiled, and (the
    control) those the same launches compile without the warm-up."""
    from lowerings import precompile

    calls, launch = make()
    warmed = precompile.warm(calls)
    after_warmup = _compiled_by(launch)
    forget_compiled()
    return {"warmed": warmed, "recompiled": after_warmup, "compiled_cold": _compiled_by(launch)}


def _compiled_by(launch: Callable[[], None]) -> list[str]:
    """The kernels Triton's JIT compiled (from source or its disk cache) while ``launch`` ran."""
    from triton.runtime.jit import JITFunction

    compiled: list[str] = []
    compile_once = JITFunction._do_compile

    def recording(self, *args, **kwargs):
        compiled.append(self.fn.__name__)
        return compile_once(self, *args, **kwargs)

    JITFunction._do_compile = recording
    try:
        launch()
    finally:
        JITFunction._do_compile = compile_once
    return compiled


def cases() -> dict[str, Callable[[], None]]:
    """Name → a call of the host code that launches (and so compiles) the kernels of one configuration."""
    return {
        "attention bf16 d64 causal": _attention(torch.bfloat16, 64, True),
        "attention bf16 d128": _attention(torch.bfloat16, 128, False),
        "attention fp16 d80 causal": _attention(torch.float16, 80, True),
        "attention bf16 d256": _attention(torch.bfloat16, 256, False),
        "attention bf16 d128 bias (gradient) and dropout": _attention(
            torch.bfloat16, 128, True, bias=True, dropout=0.1, bias_grad=True
        ),
        "attention bf16 d256 causal, key padding and softcap": _attention(
            torch.bfloat16, 256, True, key_bias=True, softcap=50.0
        ),
        "attention fp32 d128 (exact products)": _attention(torch.float32, 128, False),
        "attention bf16 d128 atomic dQ (opt-in)": _attention(
            torch.bfloat16, 128, False, backward={"PINNED": 128, "SWEPT": 64, "num_warps": 8, "num_stages": 2,
                                                 "ATOMIC_DQ": True},
        ),
        "cross-entropy bf16 softcap": _cross_entropy(torch.bfloat16, 30.0),
        "cross-entropy bf16 filtered": _cross_entropy(torch.bfloat16, None, filter_eps=2.0**-12),
        "cross-entropy fp32": _cross_entropy(torch.float32, None),
        "wta-crs draw, norms, gather": _wta_crs(True),
        "wta-crs draw without winners (plain CRS)": _wta_crs(False),
        "wta-crs draw with the estimate's lookup, estimate update": _wta_crs(True, estimate=True),
        "cce row-wise chunk kernel bf16, odd vocabulary": _cce_rowwise(torch.bfloat16, 50257, 0.0, None),
        "cce row-wise chunk kernel fp16, smoothing and softcap": _cce_rowwise(torch.float16, 4096, 0.1, 30.0),
        "cce row-wise chunk kernel fp32": _cce_rowwise(torch.float32, 3000, 0.0, None),
    }


def expected_failures() -> dict[str, tuple[Callable[[], None], str]]:
    """Cases that must fail, and how: they show that the stand-in driver enforces the device's limits."""
    over = {"PINNED": 128, "SWEPT": 64, "num_warps": 8, "num_stages": 2}  # failed the same way on the H200
    return {
        "attention bf16 d256, 128x64 backward tiles (over the shared memory)": (
            _attention(torch.bfloat16, 256, False, backward=over), "Required: 262144, Hardware limit: 232448"
        ),
    }


def main(selection: list[str]) -> None:
    import triton
    from triton.runtime.driver import driver

    driver.set_active(CompileOnlyDriver())
    every = cases() | {name: run for name, (run, _) in expected_failures().items()}
    for name, run in every.items():
        if selection and not any(part in name for part in selection):
            continue
        RESOURCES.clear()
        forget_compiled()
        try:
            run()
            error = None
        except Exception as exc:  # reported per case; the caller decides
            error = f"{type(exc).__name__}: {exc}"[-2000:]
        kernels = {kernel: sorted(found) for kernel, found in RESOURCES.items()}
        print(json.dumps({"case": name, "triton": triton.__version__, "error": error, "kernels": kernels}), flush=True)
    for name, make in precompile_cases().items():
        if selection and not any(part in name for part in selection):
            continue
        forget_compiled()
        try:
            found, error = _recompiled(make), None
        except Exception as exc:
            found, error = {}, f"{type(exc).__name__}: {exc}"[-2000:]
        print(json.dumps({"case": name, "error": error, **found}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
