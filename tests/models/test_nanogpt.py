"""The nanoGPT-style example model under ``backend="memopt"``: tied head, ``ignore_index=-1``, (logits, loss).

A step returning only the loss is rewritten and gives eager's loss and gradients; the model's own forward
returns the logits too and gets ``cce_with_logits`` or the row-wise op; dynamic shapes compile once; and a few optimizer steps through Inductor follow
plain ``torch.compile`` step by step.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import fxpass
from examples.gpt import GPT, GPTConfig
from tests.helpers import assert_close_scaled, max_abs

pytestmark = [pytest.mark.slow, pytest.mark.isa_sensitive]

CONFIG = GPTConfig(vocab_size=512, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=True)
FAST = {"force": True, "inner_compiler": "aot_eager"}


def _model(config: GPTConfig = CONFIG) -> GPT:
    model = GPT(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


def _batch(batch: int = 2, seq: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, CONFIG.vocab_size, (batch, seq))
    targets = torch.roll(idx, -1, dims=1)
    targets[:, -1] = -1  # no next token
    targets[0, :3] = -1  # and a masked prompt
    return idx, targets


def _loss_step(model: GPT):
    def step(idx, targets):
        return model(idx, targets)[1]

    return step


def _applied() -> list[fxpass.RewriteRecord]:
    """Applied CCE rewrites, one report per compiled graph (a graph may reach the backend twice)."""
    final = {report.graph_id: report for report in fxpass.reports()}.values()
    return [r for g in final for r in g.records if r.rule == "cce" and r.applied]


def _assert_grads_equal(actual, expected, names, **tol):
    assert len(actual) == len(expected) == len(names)
    for name, a, e in zip(names, actual, expected, strict=True):
        assert a is not None and e is not None, name
        torch.testing.assert_close(a, e, msg=lambda m, n=name: f"gradient of {n}: {m}", **tol)


def test_loss_step_is_rewritten_and_matches_eager():
    model = _model()
    names, params = zip(*model.named_parameters(), strict=True)
    assert "lm_head.weight" not in names  # tied: one parameter, gradients from embedding and head summed
    idx, targets = _batch()
    step = _loss_step(model)

    expected = step(idx, targets)
    expected_grads = torch.autograd.grad(expected, params)
    fxpass.clear_reports()
    actual = torch.compile(step, backend="memopt", fullgraph=True, options=FAST)(idx, targets)
    actual_grads = torch.autograd.grad(actual, params)

    applied = _applied()
    assert len(applied) == 1
    assert applied[0].params["ignore_index"] == -1 and applied[0].params["reduction"] == "mean"
    assert applied[0].params["tokens"] == str(idx.numel()) and applied[0].params["bias"] is False
    torch.testing.assert_close(actual, expected)
    _assert_grads_equal(actual_grads, expected_grads, names)


@pytest.mark.parametrize("use_logits", [False, True], ids=["logits_dropped", "second_loss_on_logits"])
@pytest.mark.parametrize("variant", ["auto", "rowwise"])
def test_model_forward_returning_logits_is_rewritten(use_logits, variant):
    """The model compiled whole returns ``(logits, loss)``: the logits come from ``cce_with_logits`` (the CPU
    default) or from the row-wise op (the CUDA default, the tied weight handed back for the logits' own gradient)
    and equal eager's, and so do the gradients, with the logits dropped or used by a second loss."""
    model = _model()
    names, params = zip(*model.named_parameters(), strict=True)
    idx, targets = _batch()

    def total(logits, loss):
        return loss + (1e-2 * logits.square().mean() if use_logits else 0)

    expected_logits, expected_loss = model(idx, targets)
    expected_grads = torch.autograd.grad(total(expected_logits, expected_loss), params)
    fxpass.clear_reports()
    options = {**FAST, "cce_variant": variant}
    logits, loss = torch.compile(model, backend="memopt", fullgraph=True, options=options)(idx, targets)

    applied = _applied()
    assert len(applied) == 1 and applied[0].params["returns_logits"] is True
    assert applied[0].params["variant"] == ("rowwise" if variant == "rowwise" else "with_logits")
    torch.testing.assert_close(logits, expected_logits)
    torch.testing.assert_close(loss, expected_loss)
    _assert_grads_equal(torch.autograd.grad(total(logits, loss), params), expected_grads, names)


def test_dynamic_shapes_compile_once():
    model = _model()
    names, params = zip(*model.named_parameters(), strict=True)
    step = _loss_step(model)
    compiled = torch.compile(step, backend="memopt", fullgraph=True, dynamic=True, options=FAST)
    fxpass.clear_reports()

    for batch, seq in [(2, 8), (3, 13), (5, 20)]:
        idx, targets = _batch(batch, seq)
        expected = step(idx, targets)
        expected_grads = torch.autograd.grad(expected, params)
        actual = compiled(idx, targets)
        _assert_grads_equal(torch.autograd.grad(actual, params), expected_grads, names)
        torch.testing.assert_close(actual, expected)
        applied = _applied()
        assert len(applied) == 1, f"batch {batch}, seq {seq}: {[r.reason for g in fxpass.reports() for r in g.records]}"
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1, (batch, seq)

    assert len({report.graph_id for report in fxpass.reports()}) == 1
    tokens = applied[0].params["tokens"]
    assert not tokens.isdigit(), tokens  # the rewritten graph is symbolic in batch × sequence


def test_training_steps_through_inductor_follow_plain_compile():
    """memopt with the default inner compiler (Inductor) and plain ``torch.compile``, same init, a few AdamW steps:
    the same losses, the same gradients at every step, the same parameter updates."""
    steps, lr = 4, 1e-2
    ours_model = _model(dataclasses.replace(CONFIG, n_layer=1))  # one layer: cold Inductor compiles are slow
    plain_model = copy.deepcopy(ours_model)
    assert plain_model.lm_head.weight is plain_model.transformer.wte.weight
    names = [name for name, _ in ours_model.named_parameters()]
    initial = [p.detach().clone() for p in ours_model.parameters()]
    batch = _batch(4, 16)  # the same batch each step, so that the loss must fall

    def train(model, compiled_step):
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        losses, step_grads = [], []
        for _ in range(steps):
            idx, targets = batch
            optimizer.zero_grad(set_to_none=True)
            loss = compiled_step(idx, targets)
            loss.backward()
            step_grads.append([p.grad.clone() for p in model.parameters()])
            optimizer.step()
            losses.append(loss.item())
        return losses, step_grads

    fxpass.clear_reports()
    ours, ours_grads = train(ours_model, torch.compile(_loss_step(ours_model), backend="memopt", options={"force": True}))
    assert len(_applied()) == 1
    plain, plain_grads = train(plain_model, torch.compile(_loss_step(plain_model)))

    torch.testing.assert_close(ours, plain, rtol=1e-4, atol=1e-5)  # losses of ~5: rtol is the bound
    assert ours[-1] < ours[0] - 0.1  # it trains: the steps really moved the parameters
    # Gradients at every step. Inductor orders its reductions by instruction set and memopt's ops are other
    # kernels, so rounding scales with the magnitudes summed, not with the element: the key bias's exact gradient
    # is 0 (softmax ignores a shift common to a row's scores) and the computed one is noise of ~1e-11. The floor
    # is each tensor's largest gradient (the key bias shares c_attn.bias with the query and value biases; a
    # parameter whose whole gradient is 0 would need the step's global largest). Measured on default, AVX2 and
    # AVX-512: differences ≤ 1.4e-5 of it (at step 4, where the parameters have drifted apart by rounding);
    # rel 1e-4 leaves 7x and still fails a 1 % error in the attention's dq, which the other checks miss.
    for step, (ours_step, plain_step) in enumerate(zip(ours_grads, plain_grads, strict=True)):
        for name, a, e in zip(names, ours_step, plain_step, strict=True):
            assert_close_scaled(a, e, rel=1e-4, name=f"step {step + 1}, gradient of {name}")
    # Parameters: what AdamW moved them by (the init is shared), against the largest move D ≈ steps·lr (AdamW
    # moves no element much more than lr a step). AdamW divides by √v + eps (eps = 1e-8), so an element whose
    # exact gradient is 0 moves lr·g/eps a step on rounding noise g ≈ 1e-11: the key bias ends ~5e-5 from 0 in
    # either direction, and the runs differ there by up to 1.0e-4 (AVX2); every other element by ≤ 5e-6.
    # The floor 2.5e-2·D ≈ lr/10 allows 10x that noise and fails an element sent a tenth of a step astray.
    moved_ours = [p.detach() - p0 for p, p0 in zip(ours_model.parameters(), initial, strict=True)]
    moved_plain = [p.detach() - p0 for p, p0 in zip(plain_model.parameters(), initial, strict=True)]
    scale = max_abs(moved_plain)
    for name, a, e in zip(names, moved_ours, moved_plain, strict=True):
        assert_close_scaled(a, e, rel=2.5e-2, scale=scale, name=f"update of {name}")
