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


def test_compiled_backward_updates_the_estimate_in_place():
    """Under Inductor the sampling and the backward are compiled; the backward still writes this step's
    gradient norms into the estimate buffer (AOTAutograd lifts it as an input and applies the mutation)."""
    reset_estimates()
    torch.manual_seed(0)
    block = Block()
    backend = fxpass.MemoptBackend(options=ON | {"force": True})
    step = torch.compile(lambda x: block(x).square().sum(), backend=backend)
    x = torch.randn(2, 12, 16, requires_grad=True)
    step(x).backward()
    # every estimate was zeroed above; this graph's groups are the ones the backward wrote
    estimates = [found.values for (key, _), found in state._ESTIMATES.items() if key.startswith("wta_crs:")]
    estimates = [values for values in estimates if values.any()]
    assert estimates and all(values[:12].gt(0).all() and not values[12:].any() for values in estimates)
    first = [values.clone() for values in estimates]
    step(x).backward()
    assert all(not torch.equal(a, b) for a, b in zip(first, estimates, strict=True))  # the running average moved


def test_compiled_draws_follow_the_global_seed():
    torch.manual_seed(0)
    block = Block()
    step = torch.compile(lambda x: block(x).square().sum(), backend=fxpass.MemoptBackend(options=ON | {"force": True}))
    x = torch.randn(2, 12, 16, requires_grad=True)

    def weight_grads(seed: int) -> list[torch.Tensor]:
        reset_estimates()
        torch.manual_seed(seed)
        grads = []
        for _ in range(2):
            block.zero_grad(set_to_none=True)
            step(x).backward()
            grads.append(block.fc.weight.grad.clone())
        return grads

    first, again, other = weight_grads(1), weight_grads(1), weight_grads(2)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[1], other[1])
