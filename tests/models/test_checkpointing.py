"""Activation checkpointing with memopt: ``torch.utils.checkpoint`` inside the compiled region and HF's
``activation_checkpointing_enable()`` (``checkpoint_layers``).

Each run is compared with the same checkpointed model without memopt (eager). Inside a checkpointed region the
attention rewrite applies and its record names the region and counts a transient peak; WTA-CRS declines there
(the region saves only its inputs); selective checkpointing declines every rule; CCE outside still applies.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import fxpass
from fxpass.integrations.transformers import checkpoint_layers
from tests.helpers import assert_close_all

pytestmark = [pytest.mark.slow, pytest.mark.isa_sensitive]

VOCAB, D, T, HEADS = 64, 32, 16, 2
FAST = {"force": True, "inner_compiler": "aot_eager"}


class Block(nn.Module):
    """A causal self-attention block written out, so that the attention rule has a candidate in the region."""

    def __init__(self):
        super().__init__()
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.register_buffer("mask", torch.tril(torch.ones(T, T)).view(1, 1, T, T))

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = (t.view(B, L, HEADS, D // HEADS).transpose(1, 2) for t in self.qkv(x).split(D, 2))
        scores = (q @ k.transpose(-2, -1)) * (D // HEADS) ** -0.5
        probs = scores.masked_fill(self.mask[:, :, :L, :L] == 0, float("-inf")).softmax(-1)
        return x + self.proj((probs @ v).transpose(1, 2).reshape(B, L, D))


class Model(nn.Module):
    def __init__(self, context_fn=None, reentrant: bool = False):
        super().__init__()
        self.emb, self.head = nn.Embedding(VOCAB, D), nn.Linear(D, VOCAB, bias=False)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.extra = {"use_reentrant": reentrant} | ({} if context_fn is None else {"context_fn": context_fn})

    def forward(self, ids, targets):
        x = self.emb(ids)
        for block in self.blocks:
            x = checkpoint(block, x, **self.extra)
        return F.cross_entropy(self.head(x).view(-1, VOCAB), targets.view(-1))


def _batch():
    return torch.randint(0, VOCAB, (2, T)), torch.randint(0, VOCAB, (2, T))


def _run(model, step, *args, options):
    """Eager and memopt losses and gradients of the same checkpointed ``step``; the latter's records."""
    params = list(model.parameters())
    expected = step(*args)
    expected_grads = torch.autograd.grad(expected, params, allow_unused=True)
    fxpass.clear_reports()
    actual = torch.compile(step, backend="memopt", options=options)(*args)
    actual_grads = torch.autograd.grad(actual, params, allow_unused=True)
    torch.testing.assert_close(actual, expected)
    assert_close_all(actual_grads, expected_grads)
    return [r for report in fxpass.reports() for r in report.records]


def test_rewrites_inside_checkpointed_regions_match_eager():
    model = Model()
    records = _run(model, model, *_batch(), options={**FAST, "wta_crs_budget": 0.5, "wta_crs_min_tokens": 1})
    by_rule = {rule: [r for r in records if r.rule == rule] for rule in ("cce", "attention", "wta_crs")}

    [cce] = by_rule["cce"]
    assert cce.applied and "checkpointed_region" not in cce.params

    attention = by_rule["attention"]
    assert [(r.applied, r.params["checkpointed_region"]) for r in attention] == [
        (True, "wrap_body_0"),
        (True, "wrap_body_1"),
    ]
    assert all("recomputation already frees" in r.reason and "transient peak" in r.reason for r in attention)
    assert all(not any(n.startswith("saved") for n in r.memory["before"]) for r in attention)  # nothing saved

    wta = by_rule["wta_crs"]
    assert wta and all(not r.applied and "recomputation already frees the linear's input" in r.reason for r in wta)

    # the regions' transient peaks do not add up: the report counts the largest one beside the saved tensors
    report = fxpass.reports()[-1]
    assert report.saved_bytes_hint == cce.saved_bytes_hint + max(r.saved_bytes_hint for r in attention)


def test_reentrant_checkpointing_is_the_same_region():
    """``use_reentrant=True`` (which refuses ``autograd.grad``) is traced to the same region and handled alike."""
    model = Model(reentrant=True)
    batch = _batch()
    model(*batch).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    fxpass.clear_reports()
    torch.compile(model, backend="memopt", options=FAST)(*batch).backward()
    assert_close_all([p.grad for p in model.parameters()], expected)
    records = fxpass.reports()[-1].records
    assert [(r.applied, r.params.get("checkpointed_region")) for r in records if r.rule == "attention"] == [
        (True, "wrap_body_0"),
        (True, "wrap_body_1"),
    ]


def test_selective_checkpointing_declines_inside():
    """A ``context_fn`` policy chooses what to save by operator: memopt leaves such regions alone."""

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    model = Model(context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
    records = _run(model, model, *_batch(), options=FAST)
    inside = [r for r in records if "checkpointed_region" in r.params]
    assert inside and all(not r.applied and "selective checkpointing" in r.reason for r in inside)
    assert [r.applied for r in records if r.rule == "cce"] == [True]


def test_compile_failure_falls_back_inside_regions_too(monkeypatch):
    """If the rewritten graph fails to compile, the regions' bodies are restored with the top-level graph."""
    import fxpass.rewrite

    monkeypatch.setattr(fxpass.rewrite, "_WARNED", set())
    compiled_graphs = []

    class Refusing(fxpass.MemoptBackend):
        def _compile(self, gm, example_inputs):
            code = "\n".join(m.code for m in gm.modules() if isinstance(m, torch.fx.GraphModule))
            compiled_graphs.append(code)
            if "memopt" in code:
                raise RuntimeError("kernel failed to build")
            return super()._compile(gm, example_inputs)

    model = Model()
    batch = _batch()
    expected = model(*batch)
    with pytest.warns(fxpass.RewriteFailedWarning, match="kernel failed to build"):
        actual = torch.compile(model, backend=Refusing(options={**FAST, "strict": False}))(*batch)
    torch.testing.assert_close(actual, expected)
    assert len(compiled_graphs) == 2 and "memopt" not in compiled_graphs[-1]
    assert not fxpass.reports()[-1].applied


def _hf_gpt2() -> transformers.GPT2LMHeadModel:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=D, n_layer=2, n_head=HEADS, bos_token_id=1, eos_token_id=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    return model


@pytest.mark.parametrize("flow", ["loss_only", "whole_model"])
def test_hf_activation_checkpointing(flow):
    """HF's layers checkpoint themselves: the compiled step or model runs, equals eager, and CCE outside still
    applies (``memopt.cce_with_logits`` when the whole model is compiled and returns its logits). Turned on by
    whichever name the installed transformers has, without its deprecation warning."""
    model = _hf_gpt2()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        checkpoint_layers(model)
    # transformers 5.25 renamed the flag too (the old name warns); 5.17 has only the old one
    renamed = hasattr(type(model), "is_activation_checkpointing")
    assert model.is_activation_checkpointing if renamed else model.is_gradient_checkpointing
    model.train()
    ids, _ = _batch()
    if flow == "loss_only":

        def step(ids):
            return model(input_ids=ids, labels=ids).loss

        records = _run(model, step, ids, options=FAST)
    else:
        expected = model(input_ids=ids, labels=ids)
        compiled = torch.compile(model, backend="memopt", options=FAST)
        fxpass.clear_reports()
        actual = compiled(input_ids=ids, labels=ids)
        torch.testing.assert_close(actual.loss, expected.loss)
        torch.testing.assert_close(actual.logits, expected.logits)
        params = list(model.parameters())
        assert_close_all(torch.autograd.grad(actual.loss, params), torch.autograd.grad(expected.loss, params))
        records = [r for report in fxpass.reports() for r in report.records]
        assert [r.params["returns_logits"] for r in records if r.rule == "cce"] == [True]
    assert [r.applied for r in records if r.rule == "cce"] == [True]
    inside = [r for r in records if r.rule == "attention"]
    assert len(inside) == 2 and all(r.applied and "checkpointed_region" in r.params for r in inside), [
        (r.applied, r.reason) for r in inside
    ]
