"""The CPU ops benchmark at tiny sizes: every variant runs, the table has a row per variant."""

from __future__ import annotations

import re

import pytest

from benchmarks import cpu_ops

pytestmark = pytest.mark.slow


def test_tiny_run_fills_the_table(tmp_path):
    rows = cpu_ops.main(
        ["--attention", "2x2x20x8", "--dropout", "0,0.1", "--cce", "24x50x8", "--reps", "1", "--out", str(tmp_path)]
    )
    assert [(row["op"], row["dropout"]) for row in rows] == [("attention", 0.0), ("attention", 0.1), ("cce", None)]
    assert all(ms > 0 for row in rows for ms in row["ms"].values())
    assert re.fullmatch(r"\d+×\d+ / \d+×\d+", rows[0]["blocks"])  # batch entries × query rows, forward / backward
    report = (tmp_path / "cpu_ops.md").read_text()
    assert report.count("| attention | 2x2x20x8 |") == 6 and report.count("| cce | 24x50x8 |") == 8
    assert {"memopt backend, chunked", "memopt backend, row-wise"} <= set(rows[2]["ms"])  # compiled through memopt
