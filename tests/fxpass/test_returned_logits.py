"""``fxpass.returned_logits``: the gradient of logits a compiled graph returns without one, added outside it."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import fxpass
from benchmarks._common import allocation_events
from fxpass import returned_logits
from fxpass.returned_logits import LogitsGradient, Operand, ReturnedLogits
from tests.helpers import assert_close_scaled


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


@pytest.mark.parametrize(("scale", "softcap"), [(0.3, None), (1.0, 0.5), (2.5, 1.5)], ids=["scale", "softcap", "both"])
def test_logits_gradient_goes_back_through_the_transform(scale, softcap):
    """float64 gradcheck: for logits returned transformed (z = c·tanh(x·m/c)), ``LogitsGradient`` differentiates
    them as the transform of ``F.linear`` would, its slope read off the returned logits."""
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(7, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    bias = torch.randn(7, dtype=torch.float64, generator=gen, requires_grad=True)
    transform = returned_logits.Transform(scale, softcap)

    def transformed(h, w, b):
        logits = F.linear(h, w, b) * scale
        return logits if softcap is None else torch.tanh(logits / softcap) * softcap

    def attached(h, w, b):
        return LogitsGradient.apply(transformed(h, w, b).detach(), h, w, b, returned_logits.AS_IS,
                                    returned_logits.AS_IS, transform)

    assert torch.autograd.gradcheck(attached, (hidden, weight, bias))
    upstream = torch.randn(5, 7, dtype=torch.float64, generator=gen)
    ours = torch.autograd.grad(attached(hidden, weight, bias), (hidden, weight, bias), upstream)
    theirs = torch.autograd.grad(transformed(hidden, weight, bias), (hidden, weight, bias), upstream)
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


# How a graph returns its logits: as they are, or as accelerate's ``convert_to_fp32`` hands a mixed-precision
# model's outputs to the Trainer (a cast up, here to fp64 over fp32 logits, and a reshape to [B, T, V]).
RETURNED_AS = {"as they are": lambda logits: logits, "cast and reshaped": lambda logits: logits.double().view(4, 16, -1)}


@pytest.mark.parametrize("returned", list(RETURNED_AS))
@pytest.mark.parametrize("variant", ["chunked", "rowwise"])
def test_dropped_logits_cost_no_logits_sized_allocation_in_the_backward(variant, returned):
    """A whole model compiled as it is returns its logits; a caller that drops them (``.loss``, the Trainer) must
    not pay for them in the backward. Before the wrapper served ``cce_with_logits`` too, autograd handed that op
    [N, V] zeros for the dropped logits (and, through accelerate's cast, zeros of the cast's dtype); now no
    allocation of the backward is logits-sized, under either op."""
    rows, vocab, dim = 64, 4096, 8
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, dim, generator=gen).requires_grad_()
    hidden = torch.randn(rows, dim, generator=gen).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=gen)

    def model(h, t):
        logits = F.linear(h, weight)
        return RETURNED_AS[returned](logits), F.cross_entropy(logits, t)

    options = {"strict": True, "force": True, "cce_variant": variant, "inner_compiler": "aot_eager"}
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=fxpass.MemoptBackend(options=options), fullgraph=True)
    loss = compiled(hidden, targets)[1]  # the logits are dropped here, as ``model(...).loss`` drops them
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss.backward()
    largest = max(size for _, _, size in allocation_events(prof))
    assert largest < rows * vocab * 4, largest
    expected_hidden, expected_weight = torch.autograd.grad(F.cross_entropy(hidden @ weight.t(), targets),
                                                           (hidden, weight))
    torch.testing.assert_close(hidden.grad, expected_hidden)
    torch.testing.assert_close(weight.grad, expected_weight)


@pytest.mark.parametrize("variant", ["chunked", "rowwise"])
def test_dropped_transformed_logits_cost_no_logits_sized_allocation_in_the_backward(variant):
    """Gemma 2's case: the model returns its softcapped (here also scaled) logits. The op returns them transformed
    and detached, so a caller that drops them pays nothing logits-sized in the backward either; one that uses
    them gets eager's gradient through the transform."""
    rows, vocab, dim = 64, 4096, 8
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, dim, generator=gen).requires_grad_()
    hidden = torch.randn(rows, dim, generator=gen).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=gen)

    def model(h, t):
        logits = torch.tanh(F.linear(h, weight) * 3.0 / 2.0) * 2.0
        return logits, F.cross_entropy(logits, t)

    options = {"strict": True, "force": True, "cce_variant": variant, "inner_compiler": "aot_eager"}
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=fxpass.MemoptBackend(options=options), fullgraph=True)
    logits, loss = compiled(hidden, targets)
    expected_logits, expected_loss = model(hidden, targets)
    assert torch.equal(logits, expected_logits)
    del logits
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss.backward()
    assert max(size for _, _, size in allocation_events(prof)) < rows * vocab * 4
    wanted = torch.autograd.grad(expected_loss, (hidden, weight))
    torch.testing.assert_close((hidden.grad, weight.grad), wanted, rtol=1e-5, atol=1e-6)
    hidden.grad = weight.grad = None
    logits, loss = compiled(hidden, targets)
    upstream = torch.randn(rows, vocab, generator=gen)
    (loss + (logits * upstream).sum()).backward()
    expected_logits, expected_loss = model(hidden, targets)
    wanted = torch.autograd.grad(expected_loss + (expected_logits * upstream).sum(), (hidden, weight))
    for mine, theirs, name in zip((hidden.grad, weight.grad), wanted, ("hidden", "weight"), strict=True):
        assert_close_scaled(mine, theirs, rel=1e-5, name=name)  # sums of 4096 products in another order


@pytest.mark.parametrize("variant", ["chunked", "rowwise"])
def test_logits_returned_through_a_cast_get_their_gradient_outside_the_graph(variant):
    """accelerate's ``convert_to_fp32`` between the classifier and the graph's output no longer keeps the logits'
    gradient inside the graph: the op returns them detached, and a caller that uses the cast logits gets the
    gradient eager autograd gives, through the wrapper."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(300, 8, generator=gen).requires_grad_()
    hidden = torch.randn(64, 8, generator=gen).requires_grad_()
    targets = torch.randint(0, 300, (64,), generator=gen)
    upstream = torch.randn(4, 16, 300, dtype=torch.float64, generator=gen)

    def model(h, t):
        logits = F.linear(h, weight)
        return logits.double().view(4, 16, -1), F.cross_entropy(logits, t)

    reports = []
    options = {"strict": True, "force": True, "cce_variant": variant, "inner_compiler": "aot_eager"}
    torch._dynamo.reset()
    backend = fxpass.MemoptBackend(options=options, sink=reports.append)
    logits, loss = torch.compile(model, backend=backend, fullgraph=True)(hidden, targets)
    (loss + (logits * upstream).sum()).backward()
    expected_logits, expected_loss = model(hidden, targets)
    wanted = torch.autograd.grad(expected_loss + (expected_logits * upstream).sum(), (hidden, weight))
    torch.testing.assert_close(logits, expected_logits)
    torch.testing.assert_close((hidden.grad, weight.grad), wanted, rtol=1e-5, atol=1e-4)  # fp32, other sum order
    graph = reports[-1].graph_module.graph
    assert returned_logits.returned_logits(graph), "the wrapper carries the returned logits' gradient"


WIDENED = {
    "cast": (lambda logits: logits.float(), torch.float32),
    "reshaped, then cast": (lambda logits: logits.view(4, 16, -1).float(), torch.float32),
    "cast, then reshaped": (lambda logits: logits.float().view(4, 16, -1), torch.float32),
    "as they are": (lambda logits: logits, None),
    "to float64": (lambda logits: logits.double(), None),  # cuBLAS writes fp32 at most
    "to fp32 and back to fp16": (lambda logits: logits.float().half(), None),
}


class _CompiledHead(NamedTuple):
    model: Callable  # eager: (hidden, targets) -> (transform(logits), loss)
    hidden: torch.Tensor
    weight: torch.Tensor
    targets: torch.Tensor
    generator: torch.Generator
    logits: torch.Tensor  # what the compiled model returned
    loss: torch.Tensor
    logits_dtype: torch.dtype | None  # what the rule asked cce_with_logits for (its logits_dtype)
    report: fxpass.GraphReport


def _compiled_bf16_head(vocab: int, transform: Callable) -> _CompiledHead:
    """A bf16 head of ``vocab`` classes returning ``transform(logits)`` and the loss, compiled by memopt (strict,
    forced, AOTAutograd without Inductor) and called once."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(vocab, 8, generator=gen).to(torch.bfloat16).requires_grad_()
    hidden = torch.randn(64, 8, generator=gen).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, vocab, (64,), generator=gen)

    def model(h, t):
        logits = F.linear(h, weight)
        return transform(logits), F.cross_entropy(logits.float(), t)

    reports = []
    options = {"strict": True, "force": True, "inner_compiler": "aot_eager"}
    torch._dynamo.reset()
    backend = fxpass.MemoptBackend(options=options, sink=reports.append)
    logits, loss = torch.compile(model, backend=backend, fullgraph=True)(hidden, targets)
    (call,) = [node for node in reports[-1].graph_module.graph.nodes
               if node.target is torch.ops.memopt.cce_with_logits.default]
    logits_dtype = call.args[9] if len(call.args) > 9 else None
    return _CompiledHead(model, hidden, weight, targets, gen, logits, loss, logits_dtype, reports[-1])


@pytest.mark.parametrize("returned", list(WIDENED))
def test_logits_returned_through_a_cast_to_fp32_are_written_in_fp32_by_the_op(returned):
    """bf16 logits returned only through casts to fp32 (accelerate's ``convert_to_fp32``): the op is asked for
    them in fp32 (``logits_dtype``), so no bf16 copy exists beside the fp32 one; the graph returns exactly
    eager's values, its loss, and (through the wrapper) eager's gradients. Any other chain leaves the dtype."""
    transform, widened = WIDENED[returned]
    head = _compiled_bf16_head(300, transform)
    model, hidden, weight, targets, gen = head.model, head.hidden, head.weight, head.targets, head.generator
    logits, loss = head.logits, head.loss
    assert head.logits_dtype == widened
    expected_logits, expected_loss = model(hidden, targets)
    assert logits.dtype == expected_logits.dtype and torch.equal(logits, expected_logits)
    torch.testing.assert_close(loss, expected_loss)
    upstream = (1e-2 * torch.randn(expected_logits.shape, generator=gen)).to(expected_logits.dtype)
    ours = torch.autograd.grad(loss + (logits * upstream).sum(), (hidden, weight))
    theirs = torch.autograd.grad(expected_loss + (expected_logits * upstream).sum(), (hidden, weight))
    torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=1e-2)  # bf16 GEMMs in another order


def test_logits_of_an_odd_vocabulary_returned_through_a_cast_stay_16_bit():
    """fp32 rows of 301 classes are not 16-byte aligned, where cuBLAS's GEMM into them is slow (GPT-2's 50257):
    the op returns the bf16 logits and the graph's cast runs, as the record says; values stay eager's."""
    head = _compiled_bf16_head(301, lambda logits: logits.float())
    assert head.logits_dtype is None
    (record,) = [record for record in head.report.records if record.rule == "cce" and record.applied]
    assert "returned_logits_dtype" not in record.params
    assert "301 classes are not 16-byte aligned" in record.params["returned_logits_dtype_reason"]
    expected_logits, expected_loss = head.model(head.hidden, head.targets)
    assert head.logits.dtype == torch.float32 and torch.equal(head.logits, expected_logits)
    torch.testing.assert_close(head.loss, expected_loss)


@pytest.mark.parametrize(
    "returned",
    [
        pytest.param(lambda logits: logits * 2.0, id="scaled"),  # not a cast, copy or reshape
        pytest.param(lambda logits: logits.double().view(4, 16, -1).sum(-1), id="reduced"),  # class dim gone
        pytest.param(lambda logits: logits.to(torch.int32), id="cast to integers"),
    ],
)
def test_logits_returned_through_other_ops_keep_their_gradient_in_the_graph(returned):
    """Only casts to a float dtype, copies and reshapes that keep the class dimension last count as returning
    the logits: anything else reads them inside the graph, so the op keeps their gradient (no wrapper entry),
    and the results stay eager's."""
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(300, 8, generator=gen).requires_grad_()
    hidden = torch.randn(64, 8, generator=gen).requires_grad_()
    targets = torch.randint(0, 300, (64,), generator=gen)

    def model(h, t):
        logits = F.linear(h, weight)
        return returned(logits), F.cross_entropy(logits, t)

    reports = []
    options = {"strict": True, "force": True, "inner_compiler": "aot_eager"}
    torch._dynamo.reset()
    backend = fxpass.MemoptBackend(options=options, sink=reports.append)
    out, loss = torch.compile(model, backend=backend, fullgraph=True)(hidden, targets)
    expected_out, expected_loss = model(hidden, targets)
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(loss, expected_loss)
    assert [record.applied for record in reports[-1].records] == [True]
    assert not returned_logits.returned_logits(reports[-1].graph_module.graph)
