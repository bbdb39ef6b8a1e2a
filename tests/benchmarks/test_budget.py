"""The fixed-batch memory_budget benchmark: its configurations by name, its table, and one tiny CPU run of the
script with every kind of row (torch.compile, memopt, memopt with a budget, torch.compile with AOTAutograd's)."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import budget, e2e
from tests.leaks import loggers_restored


def test_a_budget_row_is_named_by_its_fraction():
    assert budget.configuration("memopt+budget0.35").options == {"memory_budget": 0.35}
    assert budget.configuration("torch.compile+budget0.5").activation_budget == 0.5
    with pytest.raises(argparse.ArgumentTypeError, match=r"unknown configuration 'memopt\+lots'"):
        budget.configuration("memopt+lots")


def test_the_table_gives_ratios_to_torch_compile_and_the_prediction():
    def result(name, peak, ms, predicted=None, plan=""):
        row = e2e.Row("llama-1b", "sdpa", "0", "loss_only", name, 8192, step_ms=ms, peak_mib=peak, first_call_s=30.0)
        return budget.Result(name, row, plan, predicted, 12826.0 if predicted else None)

    text = budget.table([result("torch.compile", 12500.0, 135.0), result("memopt", 11000.0, 127.0),
                         result("memopt+budget0.5", 6000.0, 150.0, 6141.5, "recompute model.layers.0–7")])
    assert "| memopt+budget0.5 | 6000 | 0.48 | 150.0 | 1.11 | 6142 | 1.02 | recompute model.layers.0–7 | 30 |" in text
    assert "torch.compile's peak as the plans simulated it: 12826 MiB (1.03× the measured)." in text


@pytest.mark.slow
def test_a_tiny_cpu_run_writes_its_table(tmp_path):
    with loggers_restored():
        results = budget.main([
            "--tiny", "--device", "cpu", "--inner", "aot_eager", "--steps", "1", "--out", str(tmp_path),
            "--configs", "torch.compile,memopt,memopt+budget0.5,torch.compile+budget0.5",
        ])
    assert [r.configuration for r in results] == ["torch.compile", "memopt", "memopt+budget0.5",
                                                  "torch.compile+budget0.5"]
    assert all(r.row.error is None and r.row.step_ms for r in results), [r.row.error for r in results]
    planned = results[2]
    assert planned.predicted_mib and planned.predicted_torch_compile_mib and planned.plan
    assert "| memopt+budget0.5 |" in (tmp_path / "budget.md").read_text()
    assert len(json.loads((tmp_path / "budget.json").read_text())) == 4
