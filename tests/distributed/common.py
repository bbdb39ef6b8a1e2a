"""Running the multi-process driver (``examples/distributed/train.py``) from a test, and reading what each rank
wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2


def run_driver(out: Path, *args: str, world: int = WORLD, gpu: bool = False) -> list[dict[str, Any]]:
    """Spawn the driver's ranks in a fresh interpreter (gloo on CPU, or NCCL with ``gpu``); returns each rank's
    report."""
    env = {**os.environ, "MEMOPT_STRICT": "1", "OMP_NUM_THREADS": "1"}
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    command = [sys.executable, "-m", "examples.distributed.train", "--world", str(world), "--out", str(out), *args]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]


def rank_results(out: Path, world: int = WORLD) -> list[dict[str, Any]]:
    return [torch.load(out / f"rank{rank}.pt") for rank in range(world)]


def assert_same_grads(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], **tol: Any) -> None:
    assert actual.keys() == expected.keys()
    for name, grad in actual.items():
        assert (grad is None) == (expected[name] is None), name
        if grad is not None:
            torch.testing.assert_close(grad, expected[name], msg=lambda m, n=name: f"{n}: {m}", **tol)


def applied(report: dict[str, Any], variant: str = "memopt") -> list[str]:
    return report["variants"][variant]["applied"]


def records(report: dict[str, Any], variant: str = "memopt") -> list[dict[str, Any]]:
    return [r for graph in report["variants"][variant]["graphs"] for r in graph["records"]]
