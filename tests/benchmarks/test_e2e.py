"""The end-to-end benchmark on tiny models (CPU, eager-graph compilers): every flow runs on both backends, and
memopt's side reports its rewrites."""

from __future__ import annotations

import pytest
import torch

from benchmarks import e2e

pytestmark = pytest.mark.slow


def test_tiny_run_fills_the_table(tmp_path):
    argv = ["--tiny", "--inner", "aot_eager", "--steps", "1", "--device", "cpu", "--precision", "fp32", "--models", "gpt2",
            "--attention", "eager", "--dropout", "0", "--flows", "loss_only,whole_model", "--out", str(tmp_path),
            "--memopt-options", '{"force": true}']  # tiny sizes: the rewrites would not pay
    rows = e2e.main(argv)
    assert [(row.flow, row.backend) for row in rows] == [
        (flow, backend) for flow in ("loss_only", "whole_model") for backend in e2e.BACKENDS
    ]
    assert all(row.error is None and row.step_ms > 0 for row in rows), [row.error for row in rows]
    memopt_rows = [row for row in rows if row.backend == "memopt"]
    assert all("cce×1" in row.rewrites for row in memopt_rows), [row.rewrites for row in memopt_rows]
    report = (tmp_path / "e2e.md").read_text()
    assert report.count("| gpt2 | eager | 0 |") == 2


def test_checkpointing_cases(tmp_path):
    """``--checkpointing on``: checkpointing alone (torch.compile) beside checkpointing + memopt, whose CCE (outside
    the checkpointed layers) and attention rewrites (inside them) still apply. ("off,on" adds the plain runs.)"""
    argv = ["--tiny", "--inner", "aot_eager", "--steps", "1", "--device", "cpu", "--precision", "fp32", "--models", "gpt2",
            "--attention", "eager", "--dropout", "0", "--flows", "loss_only", "--checkpointing", "on", "--seq", "16",
            "--out", str(tmp_path), "--memopt-options", '{"force": true}']  # fmt: skip
    rows = e2e.main(argv)
    assert [(row.checkpointing, row.backend) for row in rows] == [("on", backend) for backend in e2e.BACKENDS]
    assert all(row.error is None and row.step_ms > 0 for row in rows), [row.error for row in rows]
    assert [row.rewrites for row in rows if row.backend == "memopt"] == ["attention×2, cce×1"]
    report = (tmp_path / "e2e.md").read_text()
    assert report.count("| gpt2 | eager | 0 | on | loss_only |") == 1


def test_fsdp_flow_alternates_both_backends(tmp_path):
    """``--flows fsdp``: the whole model under FSDP2 in a world of one (gloo here), each backend's steps timed in
    turn; memopt rewrites the head graph, which FSDP2's per-block frames leave alone."""
    import torch.distributed as dist

    argv = ["--tiny", "--inner", "aot_eager", "--steps", "1", "--device", "cpu", "--precision", "fp32", "--models",
            "llama-1b", "--attention", "eager", "--dropout", "0", "--flows", "fsdp", "--seq", "16",
            "--out", str(tmp_path), "--memopt-options", '{"force": true}']  # fmt: skip
    # FSDP2's per-block frames raise Dynamo's recompile limit (fxpass.integrations.blocks.allow_a_graph_per_block)
    limit = torch._dynamo.config.recompile_limit
    try:
        with torch._dynamo.config.patch(recompile_limit=limit):
            rows = e2e.main(argv)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert [(row.flow, row.backend) for row in rows] == [("fsdp", backend) for backend in e2e.BACKENDS]
    assert all(row.error is None and row.step_ms > 0 for row in rows), [row.error for row in rows]
    assert "cce×1" in rows[1].rewrites, rows[1].rewrites
