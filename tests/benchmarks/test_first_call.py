"""The first-call benchmark on a tiny model: every variant runs cold then warm in its own process, and the warm
runs are served by the AOTAutograd cache (memopt's graphs included)."""

from __future__ import annotations

import pytest

from benchmarks import first_call

pytestmark = pytest.mark.slow


def test_tiny_run_cold_then_warm(tmp_path):
    rows = first_call.main(["--tiny", "--seq", "32", "--variants", "torch.compile,memopt", "--out", str(tmp_path)])
    assert [(row["phase"], row["variant"]) for row in rows] == [
        (phase, variant) for phase in ("cold", "warm") for variant in ("torch.compile", "memopt")
    ]
    assert all(row.get("first_call_s", 0) > 0 for row in rows), [row.get("error") for row in rows]
    assert all("autograd_cache_hit" in row["aot_autograd_cache"] for row in rows if row["phase"] == "warm")
    assert (tmp_path / "first_call.md").read_text().count("| warm |") == 2
