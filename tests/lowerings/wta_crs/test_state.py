"""Gradient-norm estimates live at fixed addresses: created when the rule rewrites the graph, zeroed in place
on reset. Kernels captured in a CUDA graph read them by address, and a tensor first allocated during a CUDA-graph
warm-up would land in the graphs' private pool (tests/lowerings/wta_crs/test_cuda.py runs that case)."""

from __future__ import annotations

import torch

import fxpass
from lowerings.wta_crs import reset_estimates, state
from tests.fxpass.rules.test_wta_crs import ON, Block


def test_the_rule_creates_estimates_at_compile_time():
    seen_at_compile: list[str] = []
    inner = fxpass.MemoptBackend(options=ON | {"force": True, "inner_compiler": "eager"})

    def backend(gm, example_inputs):
        compiled = inner(gm, example_inputs)
        seen_at_compile.extend(key for key, _ in state._ESTIMATES)
        return compiled

    state._ESTIMATES.clear()
    torch.manual_seed(0)
    block = Block()
    torch.compile(lambda x: block(x).sum(), backend=backend)(torch.randn(2, 12, 16, requires_grad=True))
    assert any(key.startswith("wta_crs:") for key in seen_at_compile), seen_at_compile


def test_reset_zeroes_in_place():
    estimate = state.estimate("test:reset", torch.device("cpu"))
    estimate.values.fill_(2.0)
    address = estimate.values.data_ptr()
    reset_estimates()
    again = state.estimate("test:reset", torch.device("cpu"))
    assert again.values.data_ptr() == address
    assert not again.values.any()
