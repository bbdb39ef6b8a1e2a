"""LoRA through peft on tiny Llama and GPT-2 models with tied, frozen embeddings: frozen base weights, trainable
adapters (GPT-2's are on its Conv1D, an addmm with a transposed weight).

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
pytestmark = [pytest.mark.slow, pytest.mark.isa_sensitive]

VOCAB, D, RANK, BATCH, SEQ = 64, 32, 4, 2, 16
FAST = {"force": True, "inner_compiler": "aot_eager"}


def _llama() -> tuple[torch.nn.Module, peft.LoraConfig]:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=D, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=True,
    )  # fmt: skip
    lora = peft.LoraConfig(r=RANK, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return transformers.LlamaForCausalLM(config), lora


def _gpt2() -> tuple[torch.nn.Module, peft.LoraConfig]:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=D, n_layer=2, n_head=2, bos_token_id=1, eos_token_id=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    lora = peft.LoraConfig(r=RANK, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True)
    return transformers.GPT2LMHeadModel(config), lora


# Per model: the (in_features, out_features) of each WTA-CRS group, all adapters. Llama: q's and v's A share the
# layer's input (out RANK each), q's B is D wide and v's B 16 (2 of 4 heads for keys and values); GPT-2: c_attn's A
# and its B (3·D wide).
MODELS = {
    "llama": (_llama, [(str(D), (str(RANK), str(RANK))), (str(RANK), ("16",)), (str(RANK), (str(D),))] * 2),
    "gpt2": (_gpt2, [(str(D), (str(RANK),)), (str(RANK), (str(3 * D),))] * 2),
}


def _lora_model(name: str) -> torch.nn.Module:
    base, lora = MODELS[name][0]()
    base.loss_type = "ForCausalLM"
    assert base.get_output_embeddings().weight is base.get_input_embeddings().weight  # tied
    model = peft.get_peft_model(base, lora)
    with torch.no_grad():  # peft starts B at zero, which would give A a zero gradient
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    assert not base.get_output_embeddings().weight.requires_grad
    return model


class _MemoptCalls(TorchDispatchMode):
    """Records the memopt ops run (with their arguments by name), to see what the backward computes.

    Higher-order ops pass through: where Inductor does not ask ``is_impure`` (``lowerings._library``),
    ``memopt::wta_crs_store`` runs inside ``with_effects`` under aot_eager."""

    supports_higher_order_operators = True

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if func.namespace == "memopt":
            names = [a.name for a in func._schema.arguments]
            self.calls.append((func.__name__, {**dict(zip(names, args, strict=False)), **(kwargs or {})}))
        return func(*args, **(kwargs or {}))


def _run(name, options, **tol):
    """Eager and memopt loss and adapter gradients of the same LoRA step; memopt's records and backward calls."""
    model = _lora_model(name)
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


@pytest.mark.parametrize("name", list(MODELS))
def test_cce_with_frozen_tied_head_is_exact_and_skips_the_weight_gradient(name):
    records, backward_calls = _run(name, FAST)
    assert [r.applied for r in records if r.rule == "cce"] == [True]
    needs = [call["need_weight"] for _, call in backward_calls if "need_weight" in call]
    assert needs and not any(needs), backward_calls  # the frozen [V, D] head gets no gradient computed


@pytest.mark.parametrize("name", list(MODELS))
def test_wta_crs_samples_only_the_adapters(name):
    """At budget 1 every row is a deterministic winner, so the sampled gradients equal eager's up to rounding."""
    options = {**FAST, "wta_crs_budget": 1.0, "wta_crs_min_tokens": 1}
    records, _ = _run(name, options, rtol=1e-4, atol=1e-6)
    wta = [r for r in records if r.rule == "wta_crs"]
    assert wta and all(r.applied for r in wta), [r.reason for r in wta]
    # A groups read the layer's input (out RANK per adapter), B groups A's output (in RANK): no base linear
    shapes = sorted((r.params["in_features"], tuple(r.params["out_features"])) for r in wta)
    assert shapes == sorted(MODELS[name][1])
