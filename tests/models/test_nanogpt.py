"""The nanoGPT-style example model under ``backend="memopt"``: tied head, ``ignore_index=-1``, (logits, loss).

A step returning only the loss is rewritten and gives eager's loss and gradients; the model's own forward
returns the logits too and gets ``cce_with_logits``; dynamic shapes compile once; and a few optimizer steps through Inductor follow
plain ``torch.compile`` step by step.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import fxpass
from examples.gpt import GPT, GPTConfig

pytestmark = pytest.mark.slow

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
def test_model_forward_returning_logits_is_rewritten(use_logits):
    """The model compiled whole returns ``(logits, loss)``: the logits come from ``cce_with_logits`` and equal
    eager's, and so do the gradients, with the logits dropped or used by a second loss."""
    model = _model()
    names, params = zip(*model.named_parameters(), strict=True)
    idx, targets = _batch()

    def total(logits, loss):
        return loss + (1e-2 * logits.square().mean() if use_logits else 0)

    expected_logits, expected_loss = model(idx, targets)
    expected_grads = torch.autograd.grad(total(expected_logits, expected_loss), params)
    fxpass.clear_reports()
    logits, loss = torch.compile(model, backend="memopt", fullgraph=True, options=FAST)(idx, targets)

    applied = _applied()
    assert len(applied) == 1 and applied[0].params["returns_logits"] is True
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
    """memopt with the default inner compiler (Inductor) and plain ``torch.compile``, same init, a few AdamW steps."""
    steps = 4
    ours_model = _model(dataclasses.replace(CONFIG, n_layer=1))  # one layer: cold Inductor compiles are slow
    plain_model = copy.deepcopy(ours_model)
    assert plain_model.lm_head.weight is plain_model.transformer.wte.weight
    batch = _batch(4, 16)  # the same batch each step, so that the loss must fall

    def train(model, compiled_step):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(steps):
            idx, targets = batch
            optimizer.zero_grad(set_to_none=True)
            loss = compiled_step(idx, targets)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses

    fxpass.clear_reports()
    ours = train(ours_model, torch.compile(_loss_step(ours_model), backend="memopt", options={"force": True}))
    assert len(_applied()) == 1
    plain = train(plain_model, torch.compile(_loss_step(plain_model)))

    torch.testing.assert_close(ours, plain, rtol=1e-4, atol=1e-5)
    assert ours[-1] < ours[0] - 0.1  # it trains: the steps really moved the parameters
    for (name, a), b in zip(ours_model.named_parameters(), plain_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
