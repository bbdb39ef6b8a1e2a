"""The memory-model benchmark on a tiny model: its predictions of the whole step's saved bytes match what the
compiled steps save, and the whole-step simulation predicts a lower peak under memopt."""

from __future__ import annotations

import json

import pytest

from benchmarks import memory_model
from tests.leaks import loggers_restored

pytestmark = pytest.mark.slow


def test_tiny_llama_predicted_against_measured(tmp_path):
    with loggers_restored("", "fxpass"):  # main sets logging up as a script does
        rows = memory_model.main(["--tiny", "--device", "cpu", "--models", "llama-1b", "--per-rule", "llama-1b",
                                  "--rule-sets", "all,attention", "--batch", "2", "--seq", "128",
                                  "--out", str(tmp_path)])
    assert [(row.model, row.rules, row.error) for row in rows] == [("llama-1b", "all", None),
                                                                  ("llama-1b", "attention", None)]
    for row in rows:
        for backend in ("torch.compile", "memopt"):
            predicted, measured = row.predicted_saved[backend], row.measured_saved[backend]
            assert abs(predicted - measured) <= 0.1 * measured, (row, backend)
        assert row.measured_drop is None  # (a CUDA figure)
    everything, attention = rows
    assert everything.predicted_saved["memopt"] < everything.predicted_saved["torch.compile"]
    assert everything.simulated_drop > 0 and everything.predicted_drop > 0
    # SDPA's attention is already flash under torch.compile: nothing for the attention rule to take
    assert attention.predicted_saved["memopt"] == attention.predicted_saved["torch.compile"]
    assert attention.simulated_drop == 0
    saved = json.loads((tmp_path / "memory_model.json").read_text())
    assert [entry["rules"] for entry in saved] == ["all", "attention"]
    assert (tmp_path / "memory_model.md").read_text().count("| llama-1b |") == 2


def test_predict_only_prices_the_gpu_step_without_running_it(tmp_path):
    """``--predict-only``: the step is captured and priced for a GPU but never runs (no saved bytes measured),
    and the prediction equals ``fxpass.explain``'s for the same step with ``assume_device="cuda"``."""
    import torch

    import fxpass

    with loggers_restored("", "fxpass"):
        rows = memory_model.main(["--tiny", "--device", "cpu", "--models", "gpt2", "--per-rule", "",
                                  "--batch", "4", "--seq", "128", "--predict-only", "--out", str(tmp_path)])
    (row,) = rows
    assert row.error is None and row.measured_saved is None and row.measured_drop is None
    assert row.predicted_saved["memopt"] < row.predicted_saved["torch.compile"]
    torch.manual_seed(0)
    model = memory_model.build("gpt2", 2, tiny=True).to(torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (4, 128))
    step = memory_model._loss_step(model)
    predicted = memory_model.predict(step, ids, {})
    explained = fxpass.explain(step, ids, assume_device="cuda")
    assert predicted.saved_bytes() == explained.saved_bytes()
    assert predicted.peak_bytes() == explained.peak_bytes()


def test_a_zoo_family_builds_at_the_zoos_sizes():
    """A name the benchmark's own list lacks is one of ``benchmarks/zoo.py``'s families (Granite's logit scale,
    Starcoder2's sliding window), built as the zoo builds it."""
    model = memory_model.build("granite", 2, tiny=True)
    assert type(model).__name__ == "GraniteForCausalLM" and model.training
    assert model.config.num_hidden_layers == 2 and model.config.logits_scaling == 8.0
