"""``lowerings._library.launchable``: kernels go through ``wrap_triton`` only while a graph is traced.

A ``wrap_triton`` launch at run time dispatches a higher-order op (about 1 ms of CPU each, and a side-table
entry never freed), so the opaque ops' CUDA bodies must get the kernel itself; a ``triton_op`` body that
Inductor traces must get the wrapper, or Inductor could not emit the kernel."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

triton = pytest.importorskip("triton")

from torch._higher_order_ops.triton_kernel_wrap import TraceableTritonKernelWrapper  # noqa: E402

from lowerings import _library  # noqa: E402


def _compiled_kernel():
    """A kernel as on CUDA, not interpreted (``wrap_triton`` passes interpreted kernels through); never launched."""
    interpret = os.environ.pop("TRITON_INTERPRET", None)
    try:

        @triton.jit
        def noop_kernel(x):
            pass

    finally:
        if interpret is not None:
            os.environ["TRITON_INTERPRET"] = interpret
    return noop_kernel


_noop_kernel = _compiled_kernel()


@pytest.fixture
def compiled_kernels(monkeypatch):
    """As on CUDA: kernels are not interpreted."""
    monkeypatch.setattr(_library, "interpreting", lambda: False)


def test_running_eagerly_gets_the_kernel_itself(compiled_kernels):
    assert _library.launchable(_noop_kernel) is _noop_kernel


def test_a_traced_triton_op_body_gets_the_wrapper(compiled_kernels):
    seen = []

    def body(x: torch.Tensor) -> torch.Tensor:  # takes the kernel as a body would, without launching it
        seen.append(_library.launchable(_noop_kernel))
        return x.clone()

    op = torch.library.triton_op("memopt_test::launch_probe", body, mutates_args=())
    torch.compile(lambda x: op(x) + 1, backend="aot_eager", fullgraph=True)(torch.ones(3))
    assert seen and all(isinstance(kernel, TraceableTritonKernelWrapper) for kernel in seen)


class _CountingKernel:
    """A kernel stand-in whose ``warmup`` records how many threads are inside it at once."""

    def __init__(self, rendezvous: threading.Barrier | None = None) -> None:
        self.inside = self.most_inside = 0
        self.rendezvous = rendezvous
        self.guard = threading.Lock()

    def warmup(self, *args, grid, **kwargs) -> None:
        with self.guard:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
        if self.rendezvous is not None:
            self.rendezvous.wait(timeout=10)  # two kernels' warm-ups must be able to meet here
        time.sleep(0.05)
        with self.guard:
            self.inside -= 1


def _warm_in_threads(kernels) -> None:
    def warm(kernel) -> None:
        with _library.warming():
            _library.eager(kernel)[(1,)](3, block=16)

    threads = [threading.Thread(target=warm, args=(kernel,)) for kernel in kernels]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_warm_ups_of_one_kernel_take_turns():
    """Triton compiles a cache miss unlocked: two threads warming one specialization compiled it twice."""
    kernel = _CountingKernel()
    _warm_in_threads([kernel, kernel, kernel])
    assert kernel.most_inside == 1


def test_warm_ups_of_different_kernels_run_side_by_side():
    rendezvous = threading.Barrier(2)
    first, second = _CountingKernel(rendezvous), _CountingKernel(rendezvous)
    _warm_in_threads([first, second])
    assert not rendezvous.broken  # both were inside their warm-up at once
