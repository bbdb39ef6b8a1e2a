"""``tests/leaks.py``: the snapshot sees each kind of process-wide change, and the autouse check fails the test
that leaves one behind (in a pytest run of its own, so this run's state is not touched)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from tests import leaks

ROOT = Path(__file__).resolve().parents[1]


def test_nothing_changed_nothing_reported():
    assert leaks.diff(leaks.snapshot(), leaks.snapshot()) == []


def test_config_entry_changed_inside_patch_and_restored_after():
    before = leaks.snapshot()
    wanted = torch._dynamo.config.recompile_limit + 3
    with torch._dynamo.config.patch(recompile_limit=wanted):
        inside = leaks.diff(before, leaks.snapshot())
    assert inside == [f"torch._dynamo.config.recompile_limit: {wanted - 3} -> {wanted}"]
    assert leaks.diff(before, leaks.snapshot()) == []


def test_environment_import_hook_logger_and_torch_switch():
    before = leaks.snapshot()
    logger = logging.getLogger("fxpass.rewrite")  # created when fxpass loads, before the snapshot
    handler = logging.NullHandler()
    hook = type("Hook", (), {"find_spec": staticmethod(lambda *args: None)})()
    threads = torch.get_num_threads()
    os.environ["MEMOPT_LEAK_PROBE"] = "1"
    sys.meta_path.append(hook)
    logger.addHandler(handler)
    torch.set_num_threads(threads + 1)
    try:
        found = leaks.diff(before, leaks.snapshot())
    finally:
        del os.environ["MEMOPT_LEAK_PROBE"]
        sys.meta_path.remove(hook)
        logger.removeHandler(handler)
        torch.set_num_threads(threads)
    assert found == sorted([
        "logger 'fxpass.rewrite' (level, propagate, disabled, handlers) changed",
        "os.environ['MEMOPT_LEAK_PROBE']: None -> '1'",
        f"sys.meta_path: {before['meta_path_names']} -> {[*before['meta_path_names'], 'Hook']}",
        f"torch num_threads: {threads} -> {threads + 1}",
    ])
    assert leaks.diff(before, leaks.snapshot()) == []


def test_the_leaking_test_fails_and_the_next_one_starts_clean(tmp_path):
    suite = tmp_path / "test_probe.py"
    suite.write_text(textwrap.dedent("""
        import torch
        import torch._dynamo  # loaded before the first test, as conftest.py loads it for the suite

        def test_leaks():
            torch._dynamo.config.recompile_limit = 3

        def test_after():
            assert torch._dynamo.config.recompile_limit != 3
    """))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.leaks", "-q", "-p", "no:cacheprovider", str(suite)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert "test_leaks left global state changed" in result.stdout, result.stdout[-3000:]
    assert "torch._dynamo.config.recompile_limit: 8 -> 3" in result.stdout
    assert "2 passed, 1 error" in result.stdout, result.stdout[-3000:]
