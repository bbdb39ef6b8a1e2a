"""The distributed benchmark's CPU smoke run (two gloo processes, tiny GPT-2, FSDP2): every row is filled and
memopt's step matches torch.compile's after one step; and the largest-batch search."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.distributed import largest_batch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_smoke_run_fills_rows(tmp_path):
    command = [sys.executable, "benchmarks/distributed.py", "--smoke", "--parallel", "fsdp", "--models", "gpt2",
               "--variants", "torch.compile,memopt", "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "distributed.jsonl").read_text().splitlines()]
    assert [(row["parallel"], row["variant"]) for row in rows] == [("fsdp", "torch.compile"), ("fsdp", "memopt")]
    assert all(row["error"] is None and row["step_ms"] > 0 and row["tokens_per_s"] > 0 for row in rows), rows
    memopt = rows[1]
    assert memopt["match"] is True and memopt["grad_max_rel_diff"] < 1e-5, memopt
    # one entry per rank; the two sharded blocks share one graph (no KV cache), so one attention rewrite
    assert memopt["rewrites"] == ["attention×1, cce×1"] * 2


@pytest.mark.parametrize("limit, fits_below, expected", [(512, 37, 36), (512, 1, 0), (40, 1000, 40), (512, 9, 8)])
def test_largest_batch(limit, fits_below, expected):
    tried = []

    def fits(batch):
        tried.append(batch)
        return batch < fits_below

    assert largest_batch(fits, start=4, limit=limit) == expected
    assert len(tried) == len(set(tried)) <= 12
