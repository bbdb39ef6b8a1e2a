"""The kernel-choice benchmark on CPU (a smoke run: only memopt's op exists there): every case gets a row, the
library kernels CPU lacks are recorded as failed rather than stopping the run, and the error ratio is measured
against float64 where dropout is off."""

from __future__ import annotations

import json

from benchmarks import attention_dispatch


def test_cpu_smoke_run(tmp_path):
    rows = attention_dispatch.main(["--shapes", "1x2x32x16", "--dtypes", "float32", "--out", str(tmp_path)])
    assert len(rows) == 8 and [row["fastest"] for row in rows] == ["memopt"] * 8
    assert all(set(row.get("failed", {})) >= {"cudnn", "efficient"} for row in rows)
    no_dropout = [row for row in rows if row["dropout"] == 0]
    assert all(0 < row["error_ratio"]["memopt"] < 10 for row in no_dropout), [r["error_ratio"] for r in no_dropout]
    assert json.loads((tmp_path / "attention_dispatch.json").read_text()) == rows
    assert (tmp_path / "attention_dispatch.md").read_text().count("| 1x2x32x16") == 8
