"""How memopt defines its operators: one name per op, visible to Inductor on CUDA, opaque on CPU.

A ``torch.library.triton_op`` lets Inductor see (and emit) the Triton kernels its body launches through
``wrap_triton``. Its body branches on the device: on CPU it calls an opaque ``custom_op`` holding the chunked
PyTorch reference, so tracing never unrolls a chunk loop (which would guard on the number of rows).
Without Triton (e.g. macOS) the same body is registered as a plain ``custom_op``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import threading
from collections.abc import Callable, Iterator, Mapping

import torch
import torch._guards

NAMESPACE = "memopt"
HAS_TRITON = importlib.util.find_spec("triton") is not None


def device_op(name: str) -> Callable[[Callable], torch.library.CustomOpDef]:
    """Decorator: define ``memopt::<name>`` from a body that may launch Triton kernels on CUDA."""
    qualname = f"{NAMESPACE}::{name}"

    def define(body: Callable) -> torch.library.CustomOpDef:
        if HAS_TRITON:
            return torch.library.triton_op(qualname, body, mutates_args=())
        op = torch.library.custom_op(qualname, body, mutates_args=())
        op.register_fake(body)
        return op

    return define


def reference_op(name: str) -> Callable[[Callable], torch.library.CustomOpDef]:
    """Decorator: define the opaque ``memopt::<name>`` that runs a PyTorch reference eagerly."""
    return lambda body: torch.library.custom_op(f"{NAMESPACE}::{name}", body, mutates_args=())


# The registrations of ``cuda_kernel``; a Library drops its kernels when it is collected.
_CUDA_KERNELS = torch.library.Library(NAMESPACE, "IMPL")


def cuda_kernel(name: str, *, differentiable: bool) -> Callable[[Callable], Callable]:
    """Decorator: register the function as ``memopt::<name>``'s CUDA kernel with the dispatcher itself.

    An opaque op runs at every training step, and a ``custom_op``'s implementation (``register_kernel``
    included) runs beneath its Python layers: the autograd wrapper, a redispatch, the aliasing check, Dynamo's
    disable wrapper. Registered at the CUDA key, the function is called by the dispatcher directly (the
    ``custom_op`` stays the schema, fake and CPU implementation). An op that takes no gradient
    (``differentiable=False``) also falls through autograd on CUDA, so nothing of the ``custom_op`` runs; a
    differentiable one keeps its autograd formula, which redispatches to this kernel.
    `benchmarks/tools/wta_crs_profile.py --host-calls` times both paths."""

    def register(fn: Callable) -> Callable:
        _CUDA_KERNELS.impl(name, fn, "CUDA")
        if not differentiable:
            _CUDA_KERNELS.impl(name, torch.library.fallthrough_kernel, "AutogradCUDA")
        return fn

    return register


# Bytes an op allocates inside its kernels, beyond its inputs and outputs, while it runs: what a simulation of the
# compiled graph (``fxpass/compiled_cost.py``) cannot read from the graph. Keyed by the op's qualified name; each
# function takes the device type whose implementation runs ("cuda", "cpu") and the op's arguments (fake tensors
# of symbolic sizes, constants) and returns bytes, an int or a SymInt.
WORKSPACES: dict[str, Callable[..., object]] = {}



def workspace(name: str) -> Callable[[Callable[..., object]], Callable[..., object]]:
    """Decorator: register ``memopt::<name>``'s workspace function (``WORKSPACES``)."""

    def register(fn: Callable[..., object]) -> Callable[..., object]:
        WORKSPACES[f"{NAMESPACE}::{name}"] = fn
        return fn

    return register


def transient_bytes(terms: Mapping[str, object]) -> object:
    """The sum of a memory model's (``working_set``'s) transient terms: what an op allocates inside its kernels
    and frees before it returns. An op's workspace function is this sum over the terms of the pass it runs."""
    return sum((value for label, value in terms.items() if label.startswith("transient")), start=0)


def on_cuda(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cuda" for t in tensors)


def interpreting() -> bool:
    """Whether Triton kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``, the CPU tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def launchable(kernel):
    """``kernel`` wrapped by ``wrap_triton`` while a graph is being traced, so that Inductor records and emits
    it; otherwise (running, or under the interpreter) the kernel itself.

    A ``wrap_triton`` launch outside tracing still dispatches a higher-order op: about 1 ms of CPU a launch
    (torch/_library/triton.py says as much) and an entry in Inductor's kernel side table that is never freed.
    The opaque ops' CUDA bodies (``memopt::cce_backward_rows``, a launch per vocabulary chunk) run at training
    time, where that cost 20 ms a backward on the H200 (GPT-2 small, 13 chunks)."""
    if _warming_here():
        return _Warmup(kernel)
    if interpreting() or not tracing():
        return kernel
    return torch.library.wrap_triton(kernel)


def eager(kernel):
    """``kernel`` for a launch that only ever runs eagerly (inside an opaque op's CUDA body, never traced): the
    kernel itself, or under ``warming`` its compile-only stand-in. It asks nothing about tracing, which costs
    ``launchable`` ~8 µs of CPU a launch (a WTA-CRS step of GPT-2 small launches ~100 such kernels)."""
    return _Warmup(kernel) if _warming_here() else kernel


_WARMING = threading.local()


def _warming_here() -> bool:
    return getattr(_WARMING, "on", False)


@contextlib.contextmanager
def warming() -> Iterator[None]:
    """Within it, launches of this thread through ``launchable`` or ``eager`` compile their kernel for the current CUDA
    device and run nothing (``lowerings/precompile.py``). Tensors may be meta tensors: only their dtypes,
    and their storage offsets for the 16-byte alignment Triton specializes on, reach the compiler."""
    before = _warming_here()
    _WARMING.on = True
    try:
        yield
    finally:
        _WARMING.on = before


class _Warmup:
    """``kernel[grid](*args)`` as Triton's ``warmup``: the same specialization (argument dtypes, integer
    values, pointer alignment, constexprs), hence the same entry of the kernel's cache as the launch."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel

    def __getitem__(self, grid) -> Callable[..., None]:
        def compile_only(*args, **kwargs) -> None:
            with compile_lock(self.kernel):
                self.kernel.warmup(
                    *map(_stand_in, args), grid=grid, **{name: _stand_in(value) for name, value in kwargs.items()}
                )

        return compile_only


_COMPILE_LOCKS: dict[int, tuple[object, threading.Lock]] = {}
_COMPILE_LOCKS_GUARD = threading.Lock()


def compile_lock(kernel) -> threading.Lock:
    """The lock of ``kernel``'s warm-ups. Triton's JIT looks a specialization up in the kernel's cache and
    compiles it on a miss, unlocked: two warm-up threads asking for one specialization both compiled it (GPT-2's
    sample calls of 768- and 3072-wide inputs both warm the same draw, `benchmarks/first_call.py`).
    Held, the second finds the first's kernel in the cache."""
    with _COMPILE_LOCKS_GUARD:
        return _COMPILE_LOCKS.setdefault(id(kernel), (kernel, threading.Lock()))[1]


def _stand_in(value):
    """A tensor as Triton's ``MockTensor`` at an address with the tensor's alignment (its storage assumed
    aligned, as the caching allocator's are); anything else as it is."""
    if not isinstance(value, torch.Tensor):
        return value
    return _aligned_mock()(value.dtype, list(value.shape), value.storage_offset() * value.element_size())


@functools.cache
def _aligned_mock() -> type:
    from triton.runtime.jit import MockTensor

    class AlignedMock(MockTensor):
        def __init__(self, dtype: torch.dtype, shape: list[int], address: int) -> None:
            super().__init__(dtype, shape)
            self.address = address

        def data_ptr(self) -> int:
            return self.address

    return AlignedMock


def tracing() -> bool:
    """Whether tensors here are fake: Dynamo, AOTAutograd or Inductor tracing an op's body."""
    return torch.compiler.is_compiling() or torch._guards.detect_fake_mode() is not None


def keep_side_effect(op: torch.library.CustomOpDef) -> None:
    """Keep ``op`` in compiled graphs although nothing reads its output (it writes process state).

    Where Inductor asks ``torch._library.utils.is_impure`` whether a fallback kernel has side effects (torch
    2.13), the op joins FX's side-effectful functions: every pass keeps it and the graph stays cacheable.
    Elsewhere it is registered as effectful, which AOTAutograd threads an effect token through
    (``with_effects``); that is kept everywhere but bypasses Inductor's FX graph cache."""
    if _inductor_asks_is_impure():
        torch.fx.node.has_side_effect(op._opoverload)
        return
    from torch._higher_order_ops import effects

    effects._register_effectful_op(op._opoverload, effects._EffectType.ORDERED)


def _inductor_asks_is_impure() -> bool:
    import inspect

    from torch._inductor import ir

    try:
        return "is_impure" in inspect.getsource(ir.FallbackKernel.has_side_effects)
    except (OSError, TypeError, AttributeError):
        return False
