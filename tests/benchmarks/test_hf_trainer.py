"""The HF Trainer benchmark's smoke run on CPU (tiny configs, aot_eager) and its peak ratios."""

from __future__ import annotations

import json

import pytest

from benchmarks.hf_trainer import Result, main, with_ratios


@pytest.mark.slow
def test_smoke_run_trains_both_models_under_both_routes(tmp_path):
    results = main(["--smoke", "--variants", "torch.compile/sdpa,memopt/eager", "--out", str(tmp_path)])

    rows = json.loads((tmp_path / "hf_trainer.json").read_text())
    assert [(r["model"], r["variant"]) for r in rows] == [
        ("gpt2", "torch.compile/sdpa"), ("gpt2", "memopt/eager"),
        ("llama-3.2-1b", "torch.compile/sdpa"), ("llama-3.2-1b", "memopt/eager"),
    ]
    assert all(r["note"] == "" and r["step_ms"] > 0 and r["tokens_per_s"] > 0 for r in rows), rows
    assert "| gpt2 | memopt/eager |" in (tmp_path / "hf_trainer.md").read_text()
    by_variant = {(r.model, r.variant): r for r in results}
    for model in ("gpt2", "llama-3.2-1b"):
        baseline, ours = by_variant[model, "torch.compile/sdpa"], by_variant[model, "memopt/eager"]
        assert baseline.rewrites == {} and ours.rewrites.get("cce") == 1
        # the same weights and batches: the first step's loss agrees (bf16 autocast, SDPA against memopt's kernel)
        assert ours.losses[0] == pytest.approx(baseline.losses[0], rel=1e-2)
    assert by_variant["gpt2", "memopt/eager"].rewrites.get("attention") == 2


def test_peak_ratios_divide_by_the_first_torch_compile_variant_of_each_model():
    results = with_ratios([
        Result("a", "memopt/sdpa", 1, 1, peak_gib=3.0),
        Result("a", "torch.compile/sdpa", 1, 1, peak_gib=4.0),
        Result("a", "torch.compile/eager", 1, 1, peak_gib=8.0),
        Result("b", "memopt/sdpa", 1, 1, peak_gib=1.0, note="out of memory"),
        Result("b", "torch.compile/sdpa", 1, 1),  # failed: no peak, no ratios for b
    ])
    assert [r.peak_ratio for r in results] == [0.75, 1.0, 2.0, None, None]
