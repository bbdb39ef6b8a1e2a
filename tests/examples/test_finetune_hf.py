"""The Hugging Face fine-tuning example at toy sizes: the whole model compiled in place, memopt rewrites HF's
causal-LM loss (the logits returned beside it) and eager attention, saves less for backward than plain
torch.compile, and trains to the same losses (WTA-CRS off)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from examples import finetune_hf

TINY = ["--device", "cpu", "--steps", "2", "--batch-size", "8", "--seq-len", "256", "--n-layer", "1",
        "--n-embd", "32", "--n-head", "2", "--data-mb", "1"]  # fmt: skip


@pytest.mark.slow
def test_example_rewrites_the_loss_and_trains_the_same(capsys):
    outcome = finetune_hf.main(TINY)
    printed = capsys.readouterr().out
    assert {"cce", "attention"} <= set(outcome["applied"]), printed
    records = [record for report in outcome["reports"] for record in report.applied]
    cce = [record for record in records if record.rule == "cce"]
    assert len(cce) == 1 and cce[0].params["returns_logits"] is True, printed
    assert all(record.params["causal"] for record in records if record.rule == "attention"), printed
    ours, theirs = outcome["results"]["memopt"], outcome["results"]["torch.compile"]
    assert ours["saved_bytes"] < theirs["saved_bytes"]
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-4, abs=1e-4)
    assert "tensors saved for backward" in printed
