"""LoRA through peft on a tiny Llama with tied, frozen embeddings: frozen base weights, trainable adapters.

CCE with a frozen head computes no weight gradient and gives eager's loss and adapter gradients. WTA-CRS samples
only for adapter weights: a frozen base linear needs no weight gradient, is no candidate, and does not keep the
layer's input alive (so the adapters' A matrices, which read the same input, can still be sampled).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

import fxpass
from tests.helpers import assert_close_all

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.slow

VOCAB, D, RANK, BATCH, SEQ = 64, 32, 4, 2, 16
FAST = {"force": True, "inner_compiler": "aot_eager"}


def _lora_llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=D, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=True,
    )  # fmt: skip
    base = transformers.LlamaForCausalLM(config)
    base.loss_type = "ForCausalLM"
    assert base.lm_head.weight is base.model.embed_tokens.weight
    lora = peft.LoraConfig(r=RANK, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(base, lora)
    with torch.no_grad():  # peft starts B at zero, which would give A a zero gradient
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    assert not base.lm_head.weight.requires_grad
    return model


class _MemoptCalls(TorchDispatchMode):
    """Records the memopt ops run (with their arguments by name), to see what the backward computes."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "memopt":
            names = [a.name for a in func._schema.arguments]
            self.calls.append((func.__name__, {**dict(zip(names, args, strict=False)), **(kwargs or {})}))
        return func(*args, **(kwargs or {}))


def _run(options, **tol):
    """Eager and memopt loss and adapter gradients of the same LoRA step; memopt's records and backward calls."""
    model = _lora_llama()
    trained = [p for p in model.parameters() if p.requires_grad]
    ids = torch.randint(3, VOCAB, (BATCH, SEQ))

    def step(ids):
        return model(input_ids=ids, labels=ids).loss

    expected = step(ids)
    expected_grads = torch.autograd.grad(expected, trained)
    fxpass.clear_reports()
    actual = torch.compile(step, backend="memopt", options=options)(ids)
    spy = _MemoptCalls()
    with spy:
        actual_grads = torch.autograd.grad(actual, trained)
    torch.testing.assert_close(actual, expected)
    assert_close_all(actual_grads, expected_grads, **tol)
    return [r for report in fxpass.reports() for r in report.records], spy.calls


def test_cce_with_frozen_tied_head_is_exact_and_skips_the_weight_gradient():
    records, backward_calls = _run(FAST)
    assert [r.applied for r in records if r.rule == "cce"] == [True]
    needs = [call["need_weight"] for _, call in backward_calls if "need_weight" in call]
    assert needs and not any(needs), backward_calls  # the frozen [V, D] head gets no gradient computed


def test_wta_crs_samples_only_the_adapters():
    """At budget 1 every row is a deterministic winner, so the sampled gradients equal eager's up to rounding."""
    options = {**FAST, "wta_crs_budget": 1.0, "wta_crs_min_tokens": 1}
    records, _ = _run(options, rtol=1e-4, atol=1e-6)
    wta = [r for r in records if r.rule == "wta_crs"]
    assert wta and all(r.applied for r in wta), [r.reason for r in wta]
    # A groups read the layer's input (in D, out RANK per adapter), B groups A's output (in RANK): no base linear
    shapes = sorted((r.params["in_features"], tuple(r.params["out_features"])) for r in wta)
    q_and_v_a, v_b, q_b = (str(D), (str(RANK), str(RANK))), (str(RANK), ("16",)), (str(RANK), (str(D),))
    assert shapes == sorted([q_and_v_a, v_b, q_b] * 2)  # 16: v_proj's width with 2 of 4 heads for keys and values
