"""``fxpass.returned_logits``: the gradient of logits a compiled graph returns without one, added outside it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fxpass import returned_logits
from fxpass.returned_logits import LogitsGradient, Operand, ReturnedLogits


def test_logits_gradient_is_the_linear_backward():
    """float64 gradcheck: ``LogitsGradient`` differentiates the logits as ``F.linear`` would, in all operands."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(7, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    bias = torch.randn(7, dtype=torch.float64, generator=gen, requires_grad=True)

    def attached(h, w, b):
        return LogitsGradient.apply(F.linear(h, w, b).detach(), h, w, b)

    assert torch.autograd.gradcheck(attached, (hidden, weight, bias))
    upstream = torch.randn(5, 7, dtype=torch.float64, generator=gen)
    ours = torch.autograd.grad(attached(hidden, weight, bias), (hidden, weight, bias), upstream)
    theirs = torch.autograd.grad(F.linear(hidden, weight, bias), (hidden, weight, bias), upstream)
    for mine, wanted in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, wanted)


def _graph_like(hidden: torch.Tensor, weight: torch.Tensor):
    """A stand-in for a compiled graph that returns (logits without a gradient, loss, hidden as an extra output)."""

    def compiled(h, w):
        logits = F.linear(h, w.to(torch.float64)).detach()
        return [logits, logits.sum(), h]

    entry = ReturnedLogits(positions=(0,), hidden=Operand("output", 2), weight=Operand("input", 1, torch.float64),
                           bias=None)
    return returned_logits.attach(compiled, [entry], extra_outputs=1)


def test_attach_drops_the_extra_outputs_and_casts_the_weight_input():
    """The wrapper returns the graph's own outputs only; the weight input is cast as the op saw it, so its
    gradient reaches the fp32 parameter through the cast."""
    hidden = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, 3, dtype=torch.float32, requires_grad=True)
    outputs = _graph_like(hidden, weight)(hidden, weight)
    assert len(outputs) == 2 and outputs[0].requires_grad
    outputs[0].square().sum().backward()
    expected = F.linear(hidden, weight.to(torch.float64)).square().sum()
    grad_hidden, grad_weight = torch.autograd.grad(expected, (hidden, weight))
    torch.testing.assert_close(hidden.grad, grad_hidden)
    assert weight.grad.dtype == torch.float32
    torch.testing.assert_close(weight.grad, grad_weight)


def test_attach_under_no_grad_only_drops_the_extras():
    hidden, weight = torch.randn(4, 3, dtype=torch.float64), torch.randn(6, 3)
    with torch.no_grad():
        outputs = _graph_like(hidden, weight)(hidden, weight)
    assert len(outputs) == 2 and not outputs[0].requires_grad


def test_attach_without_entries_is_the_compiled_callable():
    def compiled(*args):
        return list(args)

    assert returned_logits.attach(compiled, [], extra_outputs=0) is compiled


def test_a_transposed_weight_input_gets_its_gradient_in_its_own_layout():
    """``h @ W`` with W [D, V] (nanoGPT-style code): the op saw Wᵀ; the gradient reaches W as [D, V], and the
    classifier is only cast and transposed in the backward."""
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(5, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(3, 7, dtype=torch.float64, generator=gen, requires_grad=True)
    seen = Operand("input", 0, None, transposed=True)
    logits = LogitsGradient.apply((hidden @ weight).detach(), hidden, weight, None, seen)
    upstream = torch.randn(5, 7, dtype=torch.float64, generator=gen)
    ours = torch.autograd.grad(logits, (hidden, weight), upstream)
    theirs = torch.autograd.grad(hidden @ weight, (hidden, weight), upstream)
    for mine, wanted in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, wanted)


def test_modifying_the_returned_logits_in_place_raises():
    """The documented limit: an in-place change of the re-attached logits is refused by autograd (an error,
    never a wrong gradient); an out-of-place one is differentiated as usual."""
    hidden = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, 3, dtype=torch.float32, requires_grad=True)
    logits, _ = _graph_like(hidden, weight)(hidden, weight)
    with pytest.raises(RuntimeError, match="modified inplace"):
        logits.mul_(2.0)
    logits, _ = _graph_like(hidden, weight)(hidden, weight)
    (logits * 2.0).sum().backward()
    assert hidden.grad is not None and weight.grad is not None
