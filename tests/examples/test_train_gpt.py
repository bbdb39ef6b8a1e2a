"""The training demo end to end at toy sizes, and its tokenizer and helpers."""

from __future__ import annotations

import math

import pytest

from examples import train_gpt
from tests.leaks import loggers_restored

# 8 × 256 = 2048 tokens over a vocabulary of 8192: fp32 logits of 64 MiB, enough for memopt's memory model to
# approve the rewrite without force; one narrow layer keeps the two compiles and three steps well under a minute.
TINY = [
    "--device", "cpu", "--steps", "3", "--batch-size", "8", "--seq-len", "256", "--vocab-size", "8192",
    "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--data-mb", "1", "--eval-batches", "1",
    "--checkpoints", "1", "--no-progress",
]  # fmt: skip


@pytest.mark.isa_sensitive
def test_demo_rewrites_saves_memory_and_trains_the_same(capsys):
    with loggers_restored("train_gpt", "fxpass"):  # main sets them up as the script does
        result = train_gpt.main(TINY)
    printed = capsys.readouterr().out

    # The model is compiled as it is: its forward returns (logits, loss), the step drops the logits.
    applied = [r for graph in result["report"] for r in graph["records"] if r["applied"]]
    cce = [r for r in applied if r["rule"] == "cce"]
    assert len(cce) == 1, printed
    assert cce[0]["params"]["returns_logits"] is True
    assert any(r["rule"] == "attention" and r["params"]["causal"] for r in applied), printed
    assert "| cce | yes |" in printed
    assert result["estimated_saved_bytes"] > 0
    assert all(graph["summary"] in printed for graph in result["report"])

    saved = result["memory"]["saved_tensor_bytes"]
    assert saved["memopt"] < saved["torch.compile"], saved
    # What memopt no longer saves is (at least) one logits-sized tensor.
    assert saved["torch.compile"] - saved["memopt"] >= result["logits_bytes"] // 2, saved

    ours, theirs = result["losses"]["memopt"], result["losses"]["torch.compile"]
    assert len(ours) == len(theirs) == 3
    assert all(math.isfinite(value) for value in ours + theirs)
    assert ours[0] == pytest.approx(math.log(result["data"]["vocab_size"]), abs=0.5)  # an untrained model
    assert ours == pytest.approx(theirs, rel=1e-4, abs=1e-4)

    final = result["final"]
    assert final["step"] == 3
    assert final["val"]["memopt"] == pytest.approx(final["val"]["torch.compile"], rel=1e-4, abs=1e-4)
    assert math.isfinite(final["val"]["memopt"])


def test_tokenizer_round_trips_with_byte_fallback():
    text = "def f(x):\n    return x + 1  # déjà vu ✓\n" * 3 + "zzz_unseen_word"
    tokenizer = train_gpt.WordTokenizer.fit(text[:40], vocab_size=270)
    assert tokenizer.vocab_size <= 270
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert any(i >= 256 for i in ids) and any(i < 256 for i in ids)


def test_checkpoint_steps_start_at_the_first_and_end_at_the_last_step():
    assert train_gpt.checkpoint_steps(300, 4) == [1, 75, 150, 225, 300]
    assert train_gpt.checkpoint_steps(3, 4) == [1, 2, 3]
    assert train_gpt.checkpoint_steps(1, 1) == [1]
