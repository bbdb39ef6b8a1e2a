"""LM families whose attention goes beyond causal, compiled with ``backend="memopt"``: every layer's attention is
rewritten and the step equals eager's (loss and every parameter gradient).

- Gemma 2: eager attention only (transformers has no SDPA path for it), ``attn_logit_softcapping`` (tanh between
  the scaled scores and the mask) in every layer, sliding and global layers alternating.
- Gemma 3: sliding and global layers (``layer_types``), q/k norms, eager and SDPA.
- Mistral: ``sliding_window`` on every layer, here narrower than the sequence.
- Qwen2: ``use_sliding_window`` from ``max_window_layers`` on.

Each runs without an ``attention_mask`` (the masks are built from position comparisons) and with a padded one
(right and left: a key bias beside the flags; left padding and narrow windows leave rows without keys, which get
what eager gave them). Models are built from tiny configs in float32 with all dropout 0; windows of 4 keys over 12
tokens so that they hide something. The cross-entropy rewrite is off: these tests are about attention.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import transformers

# Imported at collection: loading Gemma's modeling code sets up a transformers logger (generation's continuous
# batching adds it a handler), which would otherwise count as the first test's leftover.
from transformers import Gemma2ForCausalLM, Gemma3ForCausalLM, MistralForCausalLM, Qwen2ForCausalLM

import fxpass
from fxpass.rules.attention import SDPA_FUSED
from tests.helpers import assert_close_all, grads

pytestmark = pytest.mark.slow

VOCAB, T, WINDOW, SOFTCAP = 384, 12, 4, 2.0
OPTIONS = {"force": True, "strict": True, "inner_compiler": "aot_eager", "disable": "cce"}


def _decoder(**extra) -> dict:
    return dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.0, **extra,
    )


def _model(name: str, attention: str) -> transformers.PreTrainedModel:
    """A 2-layer model of the family: one sliding and one global layer where the family mixes them. Gemma 2's cap is
    small (2, not 50) so that the tanh bends these small scores."""
    if name == "gemma2":
        config = transformers.Gemma2Config(
            head_dim=8, query_pre_attn_scalar=8, sliding_window=WINDOW, attn_logit_softcapping=SOFTCAP,
            attn_implementation=attention, **_decoder(),
        )
        model = Gemma2ForCausalLM(config)
    elif name == "gemma3":
        config = transformers.Gemma3TextConfig(
            head_dim=8, query_pre_attn_scalar=8, sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"], attn_implementation=attention, **_decoder(),
        )
        model = Gemma3ForCausalLM(config)
    elif name == "mistral":
        config = transformers.MistralConfig(sliding_window=WINDOW, attn_implementation=attention, **_decoder())
        model = MistralForCausalLM(config)
    else:
        config = transformers.Qwen2Config(
            use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, attn_implementation=attention,
            **_decoder(),
        )
        model = Qwen2ForCausalLM(config)
    model.loss_type = "ForCausalLM"
    return model


def _windows(model) -> list[int | None]:
    """Each layer's window as the family configures it (None: global attention)."""
    config = model.config
    types = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    return [WINDOW if kind == "sliding_attention" else None for kind in types]


def _batch(padding: str | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """ids, attention_mask (None: not passed) and labels (-100 on padding) for three sequences."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (3, T), generator=gen)
    if padding is None:
        return ids, None, ids
    mask = torch.ones(3, T, dtype=torch.long)
    if padding == "right":
        mask[1, -3:], mask[2, -9:] = 0, 0  # sequence 2's last rows see only padding through a window of 4
    else:
        mask[1, :3], mask[2, :7] = 0, 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _attention_records() -> list[fxpass.RewriteRecord]:
    """The attention records of the latest report of each compiled graph."""
    final = {report.graph_id: report for report in fxpass.reports()}.values()
    return [r for report in final for r in report.records if r.rule == "attention"]


def _square_tensors(debug_dir: Path) -> list[str]:
    """Lines of the rewritten graphs (``after.py`` in the debug dir) that hold a [..., T, T] tensor."""
    square = re.compile(rf"\[[^\]]*\b{T}, {T}\]")
    return [line.strip() for path in debug_dir.rglob("after.py") for line in path.read_text().splitlines()
            if square.search(line)]


def _check(model, padding: str | None, debug_dir: Path) -> list[fxpass.RewriteRecord]:
    """Compile the step (fullgraph); loss, the logits of every row (padded ones too, through a second loss on them)
    and every parameter gradient equal eager's. Returns the attention records."""
    ids, mask, labels = _batch(padding)
    _, params = zip(*model.named_parameters(), strict=True)
    weights = torch.randn(3, T, VOCAB, generator=torch.Generator().manual_seed(1))

    def step(ids, mask, labels):
        output = model(input_ids=ids, attention_mask=mask, labels=labels)
        return output.loss + (output.logits * weights).mean()

    expected = step(ids, mask, labels)
    expected_grads = grads(expected, params)
    fxpass.clear_reports()
    options = {**OPTIONS, "debug_dir": str(debug_dir)}
    actual = torch.compile(step, backend="memopt", fullgraph=True, options=options)(ids, mask, labels)
    torch.testing.assert_close(actual, expected)
    assert_close_all(grads(actual, params), expected_grads, rtol=1e-4, atol=1e-5)
    return _attention_records()


FAMILIES = [("gemma2", "eager"), *((name, attention) for name in ("gemma3", "mistral", "qwen2")
                                   for attention in ("eager", "sdpa"))]


@pytest.mark.parametrize(("name", "attention"), FAMILIES, ids=[f"{n}-{a}" for n, a in FAMILIES])
@pytest.mark.parametrize("padding", [None, "right", "left"], ids=["no-mask", "right-padding", "left-padding"])
def test_every_layer_rewritten_and_exact(name, attention, padding, tmp_path):
    """Every layer's attention is rewritten with its own structure (the sliding layers' window, Gemma 2's softcap,
    key padding where a mask is passed) into memopt's op, no [..., T, T] tensor is left, and the step equals
    eager's. A global layer under SDPA without a mask already calls SDPA with ``is_causal``: left as is."""
    torch._dynamo.reset()
    model = _model(name, attention)
    records = _check(model, padding, tmp_path)
    windows = _windows(model)
    assert len(records) == len(windows), [r.reason for r in records]
    for record, window in zip(records, windows, strict=True):
        if attention == "sdpa" and window is None and padding is None:
            assert not record.applied and record.reason == SDPA_FUSED, record.reason
            continue
        assert record.applied, record.reason
        assert record.params.get("window") == window, record.params
        assert record.params.get("softcap") == (SOFTCAP if name == "gemma2" else None), record.params
        expected = "causal (flag)" + (f" + sliding window of {window} keys" if window else "")
        assert record.params["mask"] == expected + (" + key padding" if padding else ""), record.params
        if window or name == "gemma2" or padding:
            assert record.params["lowering"] == "memopt.flash_attention", record.params
    assert list(tmp_path.rglob("after.py")) and _square_tensors(tmp_path) == []


def test_gemma2_through_inductor():
    """Gemma 2 under the default inner compiler: Inductor compiles the rewritten graph around the op (opaque on
    CPU), softcap and window arguments included, and the step still equals eager's."""
    torch._dynamo.reset()
    model = _model("gemma2", "eager")
    ids, mask, labels = _batch("right")
    _, params = zip(*model.named_parameters(), strict=True)

    def step(ids, mask, labels):
        return model(input_ids=ids, attention_mask=mask, labels=labels).loss

    expected = step(ids, mask, labels)
    expected_grads = grads(expected, params)
    fxpass.clear_reports()
    options = {key: value for key, value in OPTIONS.items() if key != "inner_compiler"}
    actual = torch.compile(step, backend="memopt", fullgraph=True, options=options)(ids, mask, labels)
    records = _attention_records()
    assert len(records) == 2 and all(r.applied and r.params["softcap"] == SOFTCAP for r in records)
    torch.testing.assert_close(actual, expected)
    assert_close_all(grads(actual, params), expected_grads, rtol=1e-4, atol=1e-5)
