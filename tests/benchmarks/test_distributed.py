"""The distributed benchmark's CPU smoke run (two gloo processes, tiny GPT-2, FSDP2): every row is filled and
memopt's step matches torch.compile's after one step, with the variants timed in turns or one after the other;
the turns themselves; and the largest-batch search."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import distributed
from benchmarks.distributed import largest_batch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("timing", [[], ["--sequential"]], ids=["in-turns", "sequential"])
def test_smoke_run_fills_rows(tmp_path, timing):
    command = [sys.executable, "benchmarks/distributed.py", "--smoke", "--parallel", "fsdp", "--models", "gpt2",
               "--variants", "torch.compile,memopt", "--steps", "2", "--out", str(tmp_path), *timing]
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


def test_cases_are_timed_in_turns_and_a_failing_case_leaves_them():
    """Three steps of three cases: a step of each in turn; the case that fails at its second step records its error
    and is not stepped again, while the others are still timed."""
    import torch.distributed as dist

    from benchmarks.e2e import join_world_of_one

    join_world_of_one(torch.device("cpu"))
    try:
        _time_three_cases()
    finally:
        dist.destroy_process_group()


def _time_three_cases():
    taken = []

    def case(name: str, fails_at: int | None = None) -> distributed.Case:
        def step():
            taken.append(name)
            if taken.count(name) == fails_at:
                raise RuntimeError(f"{name} broke")

        row = distributed.Row("fsdp", "whole", "gpt2", name, world=1, batch=2, seq=8)
        return distributed.Case(row, step, resident_bytes=0)

    cases = [case("a"), case("b", fails_at=2), case("c")]
    distributed.time_cases(cases, steps=3, device=torch.device("cpu"))
    assert taken == ["a", "b", "c", "a", "b", "c", "a", "c"]
    a, b, c = (item.row for item in cases)
    assert "b broke" in b.error and b.step_ms is None
    assert a.error is None and c.error is None and a.step_ms >= 0 and c.tokens_per_s > 0
