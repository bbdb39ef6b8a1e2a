"""``fxpass.pricing`` and the whole-step figures of ``fxpass.explain``: what memopt predicts torch.compile and
memopt keep for the backward equals what the compiled steps really save (counted by a pack hook, on CPU), and
each record's saving is priced against torch.compile, not against the graph as written."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

import fxpass
from tests.fxpass.test_compiled_cost import measured_saved_bytes


def _gpt2():
    config = transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=3000, n_positions=128, attn_implementation="eager",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


def _llama():
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=3000, max_position_embeddings=128, attn_implementation="sdpa", bos_token_id=0, eos_token_id=0,
        pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(config)


@pytest.mark.slow
@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_explain_predicts_the_steps_saved_bytes_exactly(build):
    """``Explanation.saved_bytes()`` against the bytes the compiled loss step saves for its backward, under
    Inductor and under memopt (parameters and inputs aside)."""
    model = build()
    ids = torch.randint(0, 3000, (4, 64))

    def step(ids):
        return model(input_ids=ids, labels=ids).loss

    predicted = fxpass.explain(step, ids).saved_bytes()
    params = [*model.parameters(), *model.buffers()]  # graph inputs, as the prediction counts them (RoPE's)
    measured = {
        "torch.compile": measured_saved_bytes(step, ids, backend="inductor", kept=params),
        "memopt": measured_saved_bytes(step, ids, backend="memopt", kept=params),
    }
    assert predicted == measured
    assert measured["memopt"] < measured["torch.compile"]


def _head(hidden, weight, targets):
    return F.cross_entropy(F.linear(hidden, weight), targets)


def _head_args(dtype=torch.float32):
    hidden = torch.randn(512, 64, dtype=dtype, requires_grad=True)
    weight = torch.randn(4000, 64, dtype=dtype, requires_grad=True)
    return hidden, weight, torch.randint(0, 4000, (512,))


def test_cce_record_frees_what_the_compiled_step_stops_saving():
    args = _head_args()
    record = fxpass.explain(_head, *args).records[0]
    assert record.rule == "cce" and record.applied
    against = record.against_compile
    saved = measured_saved_bytes(_head, *args) - measured_saved_bytes(_head, *args, backend="memopt")
    assert against["saved_hint"] == saved
    assert "against torch.compile" in record.reason
    # torch.compile keeps the logits in their own dtype, never fp32 log-probabilities beside them
    assert any(kept.endswith("[512, 4000] float32") for kept in against["torch.compile keeps"])
    assert len(against["torch.compile keeps"]) <= 4


def test_eager_pricing_keeps_the_graph_as_written():
    args = _head_args()
    compiled = fxpass.explain(_head, *args).records[0]
    eager = fxpass.explain(_head, *args, options={"pricing": "eager"}).records[0]
    assert eager.against_compile is None and "against torch.compile" not in eager.reason
    # as written, the log-probabilities and the logits' copies are charged: the figure torch.compile disproves
    assert eager.saved_bytes_hint > compiled.saved_bytes_hint


def test_pricing_that_fails_keeps_the_decision_and_says_why(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("no partition")

    monkeypatch.setattr(fxpass.pricing, "compiled_cost", refuse)
    fxpass.pricing.clear_cache()  # the same piece at the same static shapes was priced by the tests above
    record = fxpass.explain(_head, *_head_args()).records[0]
    assert record.applied and record.against_compile is None
    assert "priced as the graph is written (against torch.compile: RuntimeError: no partition)" in record.reason
