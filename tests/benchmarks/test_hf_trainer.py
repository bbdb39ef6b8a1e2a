"""The HF Trainer benchmark's smoke run on CPU (tiny configs, aot_eager), its peak ratios and its peak breakdown."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.hf_trainer import Result, main, with_ratios
from tests.leaks import loggers_restored


@pytest.mark.slow
def test_smoke_run_trains_both_models_under_both_routes(tmp_path):
    with loggers_restored("", "fxpass"):  # main sets logging up as a script does
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


def test_forward_backward_peak_ratios_use_their_own_baseline():
    results = with_ratios([
        Result("a", "torch.compile/sdpa", 1, 1, peak_gib=4.0, train_peak_gib=2.0),
        Result("a", "memopt/sdpa", 1, 1, peak_gib=4.0, train_peak_gib=1.0),
    ])
    assert [(r.peak_ratio, r.train_peak_ratio) for r in results] == [(1.0, 1.0), (1.0, 0.5)]


def test_step_timer_separates_the_optimizer_peak(monkeypatch):
    """Events in the Trainer's order, with a fake allocator: the forward + backward peak leaves out what the
    optimizer step allocates, the whole peak keeps it, and warm-up steps count for neither."""
    from benchmarks.hf_trainer import step_timer

    allocator = {"peak": 0}

    def allocate(n):
        allocator["peak"] = max(allocator["peak"], n)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: allocator["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: allocator.update(peak=0))
    timer = step_timer(warmup=1)
    for forward_backward, optimizer in [(100, 500), (30, 80), (50, 45)]:  # the first step is warm-up
        timer.on_step_begin(None, None, None)
        allocate(forward_backward)
        timer.on_pre_optimizer_step(None, None, None)
        allocate(optimizer)
        timer.on_step_end(None, None, None)
    timer.on_train_end(None, None, None)
    assert (timer.train_peak, timer.peak) == (50, 80)


def test_peak_breakdown_finds_the_peak_and_what_was_alive_there():
    """``--memory-history``'s analysis on a hand-made trace: the peak is the most bytes alive at once, and its
    blocks are grouped by the innermost frame outside torch's own modules."""
    from benchmarks._common import peak_breakdown

    def frame(path: str, line: int, name: str) -> dict:
        return {"filename": path, "line": line, "name": name}

    gib = 1 << 30
    layer = [frame("/env/torch/nn/functional.py", 1, "linear"), frame("/env/transformers/llama.py", 10, "forward")]
    graph = [frame("/tmp/torchinductor_root/ab/cab.py", 50, "call")]
    adamw = [frame("/env/torch/optim/adamw.py", 7, "_multi_tensor_adamw")]
    trace = [
        {"action": "alloc", "addr": 1, "size": 2 * gib, "frames": layer},
        {"action": "alloc", "addr": 2, "size": 3 * gib, "frames": graph},
        {"action": "free_requested", "addr": 1, "size": 2 * gib},
        {"action": "alloc", "addr": 3, "size": gib, "frames": adamw},
        {"action": "free_completed", "addr": 1, "size": 2 * gib},
        {"action": "free_requested", "addr": 2, "size": 3 * gib},
    ]
    text = peak_breakdown(trace, before=4 * gib)
    assert text.startswith("peak 9.00 GiB = 4.00 GiB allocated before the recording + 5.00 GiB allocated in it")
    assert "entry 1 of 6 (by ab/cab.py:50 call)" in text
    assert "| 3.000 | ab/cab.py:50 call |" in text and "| 2.000 | transformers/llama.py:10 forward |" in text
    assert "adamw" not in text  # allocated after the peak
