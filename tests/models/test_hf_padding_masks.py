"""HF models with a padded ``attention_mask`` under memopt: the T×T masks transformers materializes under tracing
become a causal flag and a [B, 1, 1, Tk] key bias, and loss, logits and gradients equal eager's.

Under ``torch.compile`` transformers' masking utilities never skip the mask (``_ignore_causal_mask_sdpa`` returns
False while tracing a padding mask), so an ``attention_mask`` from a tokenizer, padded or all ones, reaches SDPA
as a [B, 1, T, T] boolean and eager attention as a [B, 1, T, T] additive finfo.min bias. Left padding leaves the
first query rows of a causal model without any key: eager softmax is uniform there (finfo.min absorbs every
score), SDPA returns zeros; the rewrite gives each what it gave. Every model is built from a small config in
float32, without dropout.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import fxpass
from tests.fxpass.rules.test_attention import square_tensors
from tests.helpers import assert_close_all, grads, rewritten

pytestmark = pytest.mark.slow

VOCAB, T = 384, 12
OPTIONS = {"disable": "cce"}  # the attention rewrite alone; the logits are returned and compared
CAUSAL_LMS = ("gpt2", "llama", "mistral", "qwen2")


def _model(name: str, attention: str, sliding_window: int = 16) -> transformers.PreTrainedModel:
    """A 2-layer model of the named family; Mistral's window is wider than the sequence unless asked."""
    common = dict(vocab_size=VOCAB, attn_implementation=attention)
    decoder = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, attention_dropout=0.0, **common,
    )
    if name == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_positions=64, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            bos_token_id=1, eos_token_id=2, **common,
        ))
    elif name == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**decoder))
    elif name == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=sliding_window, **decoder))
    elif name == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**decoder))
    else:
        model = transformers.BertForMaskedLM(transformers.BertConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **common,
        ))
    model.loss_type = "ForCausalLM" if name in CAUSAL_LMS else "ForMaskedLM"
    return model


def _batch(padding: str, masked_lm: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, attention_mask and labels (-100 on padding, as the collators set them) for three sequences."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (3, T), generator=gen)
    mask = torch.ones(3, T, dtype=torch.long)
    if padding == "right":
        mask[1, -3:], mask[2, -7:] = 0, 0
    elif padding == "left":
        mask[1, :3], mask[2, :7] = 0, 0
    elif padding == "empty":  # one sequence that is all padding
        mask[1, :3], mask[2] = 0, 0
    labels = ids.masked_fill(mask == 0, -100)
    if masked_lm:
        labels = labels.masked_fill(torch.rand(3, T, generator=gen) > 0.4, -100)
        labels[0, 0] = ids[0, 0]
    return ids, mask, labels


def _attention_records(explanation):
    return [r for r in explanation.records if r.rule == "attention"]


def _check(model, padding: str, **options):
    """Rewrite a step that returns the loss and the logits; they and every gradient equal eager's."""
    ids, mask, labels = _batch(padding, masked_lm=model.loss_type == "ForMaskedLM")
    _, params = zip(*model.named_parameters(), strict=True)

    def step(ids, mask, labels):
        output = model(input_ids=ids, attention_mask=mask, labels=labels)
        return output.loss, output.logits

    loss, logits = step(ids, mask, labels)
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))
    expected_grads = grads(loss + (logits * weights).sum(), params)  # the logits of padded rows too

    torch._dynamo.reset()
    ex = rewritten(step, ids, mask, labels, **{**OPTIONS, **options})
    actual_loss, actual_logits = ex.result
    torch.testing.assert_close(actual_loss, loss)
    torch.testing.assert_close(actual_logits, logits)
    assert_close_all(grads(actual_loss + (actual_logits * weights).sum(), params), expected_grads, rtol=1e-4, atol=1e-5)
    return ex


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("name", [*CAUSAL_LMS, "bert"])
def test_padded_masks_become_a_flag_and_key_padding(name, attention):
    """Right and left padding, all ones (and for BERT a sequence of padding): every layer is rewritten, no
    [..., T, T] tensor is left in the graph, and loss, logits and gradients equal eager's."""
    model = _model(name, attention)
    causal = name in CAUSAL_LMS
    for padding in ("right", "left", "ones", *(() if causal else ("empty",))):
        ex = _check(model, padding)
        records = _attention_records(ex)
        assert len(records) == 2 and all(r.applied for r in records), [r.reason for r in records]
        assert square_tensors(ex, T) == [], padding
        (record, _) = records
        assert record.params["mask"] == ("causal (flag) + key padding" if causal else "key padding")
        if attention == "eager":
            assert record.params["lowering"] == "memopt.flash_attention"
            assert record.params["empty_rows"] == "mean of v, with eager's q and k gradients"
        elif causal:  # SDPA cannot take is_causal with a mask: memopt's op, whose rows without keys are SDPA's 0
            assert record.params["lowering"] == "memopt.flash_attention" and record.params["empty_rows"] == "zero"
        else:
            assert record.params["lowering"] == "F.scaled_dot_product_attention with a [B, 1, 1, Tk] mask"


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("padding", ["left", "right"])
def test_narrow_sliding_window_becomes_the_window_argument(attention, padding):
    """Mistral with a window of 4 keys over 12 tokens: the mask becomes the causal flag, the op's window and a key
    bias, with no T×T tensor left, under eager attention and SDPA. Rows that see no key (left padding; right
    padding once a row's window lies wholly in the padding) give what each gave: eager's mean of v, SDPA's 0."""
    ex = _check(_model("mistral", attention, sliding_window=4), padding)
    records = _attention_records(ex)
    assert len(records) == 2 and all(r.applied for r in records), [r.reason for r in records]
    assert square_tensors(ex, T) == []
    for record in records:
        assert record.params["mask"] == "causal (flag) + sliding window of 4 keys + key padding"
        assert record.params["lowering"] == "memopt.flash_attention"
        assert record.params["empty_rows"] == ("zero" if attention == "sdpa" else "mean of v, with eager's q and k gradients")


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_lengths_that_change_keep_the_structure(attention):
    """A second sequence length recompiles once with symbolic lengths (automatic dynamic shapes): the proofs need
    no size hint and add no guard, so a third length reuses that graph, still rewritten."""
    model = _model("llama", attention)
    options = {"strict": True, "force": True, "inner_compiler": "aot_eager", **OPTIONS}
    step = torch.compile(
        lambda ids, mask, labels: model(input_ids=ids, attention_mask=mask, labels=labels).loss,
        backend=fxpass.MemoptBackend(options=options),
    )
    ids, mask, labels = _batch("left", masked_lm=False)
    for length in (T, 10, 8):
        args = (ids[:, :length].contiguous(), mask[:, -length:].contiguous(), labels[:, :length].contiguous())
        torch.testing.assert_close(step(*args), model(input_ids=args[0], attention_mask=args[1], labels=args[2]).loss)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    dynamic = fxpass.reports()[-1]
    records = [r for r in dynamic.records if r.rule == "attention"]
    assert len(records) == 2 and all(r.applied for r in records), [r.reason for r in records]
    assert all(r.params["mask"] == "causal (flag) + key padding" and r.params["queries"] != str(T) for r in records)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_bf16_autocast(attention):
    """Under bf16 autocast Llama's rotary embedding leaves q and k in fp32 beside a bf16 v; autocast ran both
    products in bf16, so the rewrite casts q, k, v to bf16 as it did, and matches eager to bf16 rounding."""
    model = _model("llama", attention)
    ids, mask, labels = _batch("left", masked_lm=False)
    _, params = zip(*model.named_parameters(), strict=True)

    def step(ids, mask, labels):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(input_ids=ids, attention_mask=mask, labels=labels).loss

    expected = step(ids, mask, labels)
    expected_grads = grads(expected, params)
    ex = rewritten(step, ids, mask, labels, **OPTIONS)
    records = _attention_records(ex)
    assert len(records) == 2 and all(r.applied and r.params["dtype"] == "bfloat16" for r in records), [
        r.reason for r in records
    ]
    torch.testing.assert_close(ex.result, expected, rtol=1e-3, atol=1e-3)
    for actual, wanted in zip(grads(ex.result, params), expected_grads, strict=True):
        assert (actual - wanted).abs().max() <= 0.02 * wanted.abs().max() + 1e-6


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("name", CAUSAL_LMS)
def test_no_mask_and_no_cache_is_causal(name, attention):
    """Fine-tuning scripts turn the KV cache off and often pass no ``attention_mask``. transformers then checks the
    positions for packed sequences: its mask compares ``position_ids[b, q]`` with ``position_ids[b, kv]`` and the
    packed-sequence ids computed from ``diff`` and ``cumsum`` of those positions. Built from ``arange``, they
    prove causal, with no T×T tensor left, and the step equals eager's."""
    model = _model(name, attention)
    model.config.use_cache = False
    ids, _, labels = _batch("ones", masked_lm=False)
    _, params = zip(*model.named_parameters(), strict=True)

    def step(ids, labels):
        output = model(input_ids=ids, labels=labels)
        return output.loss, output.logits

    loss, logits = step(ids, labels)
    expected_grads = grads(loss + logits.square().mean(), params)
    torch._dynamo.reset()
    ex = rewritten(step, ids, labels, **OPTIONS, force=True)
    records = _attention_records(ex)
    assert len(records) == 2 and all(r.applied for r in records), [r.reason for r in records]
    assert all(r.params["mask"].startswith("causal") and "key" not in r.params["mask"] for r in records), [
        r.params["mask"] for r in records
    ]
    assert square_tensors(ex, T) == []
    actual_loss, actual_logits = ex.result
    torch.testing.assert_close(actual_loss, loss)
    torch.testing.assert_close(actual_logits, logits)
    assert_close_all(grads(actual_loss + actual_logits.square().mean(), params), expected_grads, rtol=1e-4, atol=1e-5)
