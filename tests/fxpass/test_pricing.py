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
    assert any("[512, 4000] float32" in kept for kept in against["torch.compile keeps"])
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


class _Mlp(torch.nn.Module):
    """Three linears in a row; ``before`` is what computes the first one's input from the graph's input."""

    def __init__(self, between: str, before: str = "") -> None:
        super().__init__()
        self.between, self.before = between, before
        self.a, self.b, self.c = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64), torch.nn.Linear(64, 64)

    def forward(self, x):
        if self.before == "norm":
            x = F.layer_norm(x, (64,))
        h = self.a(x)
        if self.between == "gelu":
            h = F.gelu(h, approximate="tanh")
        elif self.between == "silu":
            h = F.silu(h)
        return self.c(self.b(h)).square().mean()


_WTA = {"wta_crs_budget": 0.3, "wta_crs_min_tokens": 1, "min_saved_bytes": 0}


def _wta_saving(step, x, params, **options):
    """The WTA-CRS records of ``step``, and the bytes its compiled step stops saving with them (against memopt
    without WTA-CRS, every other option equal); ``params``: the model's, left out of the count."""
    from fxpass.backend import MemoptBackend

    records = [r for r in fxpass.explain(step, x, options={**_WTA, **options}).records if r.rule == "wta_crs"]
    without = measured_saved_bytes(step, x, backend=MemoptBackend(options={"min_saved_bytes": 0}), kept=params)
    with_wta = measured_saved_bytes(step, x, backend=MemoptBackend(options={**_WTA, **options}), kept=params)
    return records, without - with_wta


@pytest.mark.parametrize("between", ["", "gelu", "silu"])
def test_wta_records_free_what_the_compiled_step_stops_saving(between):
    """Each group is priced with the producers of its input: the records of the groups applied add up to the
    bytes the compiled step stops saving, exactly (a linear's output feeding the next linear is kept for that
    linear alone, so sampling frees it; so is a GELU's or SiLU's output, which torch.compile keeps)."""
    model = _Mlp(between)
    records, measured = _wta_saving(model, torch.randn(4, 128, 64), list(model.parameters()))
    applied = [r for r in records if r.applied]
    assert len(applied) == 2 and all("against torch.compile" in r.reason for r in applied)
    assert sum(r.saved_bytes_hint for r in applied) == measured > 0


def test_wta_declines_a_linear_whose_input_torch_compile_recomputes():
    """A norm of the graph's input: torch.compile saves the input (alive anyway) and recomputes the norm, so
    sampling the norm's output frees nothing and keeps k rows more. Priced as the graph is written the group
    looks profitable; applied so, the compiled step saves more, by the figure the record gives."""
    model, x = _Mlp("", before="norm"), torch.randn(4, 128, 64, requires_grad=True)
    records, _ = _wta_saving(model, x, list(model.parameters()))
    first = records[0]
    assert not first.applied and first.saved_bytes_hint < 0
    assert "against torch.compile" in first.reason and "below min_saved_bytes" in first.reason
    eager_records, measured = _wta_saving(model, x, list(model.parameters()), pricing="eager")
    assert eager_records[0].applied and eager_records[0].saved_bytes_hint > 0  # as written: the norm's output
    applied_later = sum(r.saved_bytes_hint for r in records[1:] if r.applied)
    assert measured == applied_later + first.saved_bytes_hint  # the first group cost what its record said


@pytest.mark.slow
@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_wta_records_of_a_model_free_what_its_step_stops_saving(build):
    model, ids = build(), torch.randint(0, 3000, (4, 64))

    def step(ids):
        return model(input_ids=ids, labels=ids).loss

    records, measured = _wta_saving(step, ids, [*model.parameters(), *model.buffers()])
    applied = [r for r in records if r.applied]
    assert applied and sum(r.saved_bytes_hint for r in applied) == measured


def test_explain_prices_a_step_with_dropout():
    """Inductor's random-seed pass runs in the partition of a graph that draws random numbers; the whole step is
    priced all the same, and equals what the compiled step saves."""
    torch.manual_seed(0)
    weight = torch.randn(256, 64, requires_grad=True)

    def step(x):
        return F.linear(F.dropout(x, 0.1), weight).relu().sum()

    x = torch.randn(512, 64, requires_grad=True)
    predicted = fxpass.explain(step, x).saved_bytes()
    assert predicted is not None
    assert predicted["torch.compile"] == measured_saved_bytes(step, x, kept=[weight]) > 0
