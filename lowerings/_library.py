"""How memopt defines its operators: one name per op, visible to Inductor on CUDA, opaque on CPU.

A ``torch.library.triton_op`` lets Inductor see (and emit) the Triton kernels its body launches through
``wrap_triton``. Its body branches on the device: on CPU it calls an opaque ``custom_op`` holding the chunked
PyTorch reference, so tracing never unrolls a chunk loop (which would guard on the number of rows).
Without Triton (e.g. macOS) the same body is registered as a plain ``custom_op``.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import torch

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


def on_cuda(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cuda" for t in tensors)


def interpreting() -> bool:
    """Whether Triton kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``, the CPU tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def launchable(kernel):
    """``kernel`` wrapped so that Inductor can trace and emit it; the raw kernel under the interpreter."""
    if interpreting():
        return kernel
    return torch.library.wrap_triton(kernel)
